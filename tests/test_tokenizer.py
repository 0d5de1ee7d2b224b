"""runtime/tokenizer.LightTokenizer against transformers' fast tokenizer on the same directory:
the embedded model's converted tokenizer (its files only, no weights) and small hand-made ones.
Every comparison is exact."""

from __future__ import annotations

import json
import random
import subprocess
import sys
from pathlib import Path

import pytest

from yggtree.data import _humaneval_problems, _mtbench_questions, eval_prompts
from yggtree.runtime import loading
from yggtree.runtime.tokenizer import LightTokenizer

transformers = pytest.importorskip("transformers")
from tokenizers import AddedToken, Tokenizer, models, pre_tokenizers  # noqa: E402
from transformers import PreTrainedTokenizerFast  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def converted() -> Path:
    """The embedded model's tokenizer as load_tokenizer keeps it (converted on a first run)."""
    src = loading.resolve_model("default")
    loading.load_tokenizer(src)
    return loading._cache_dir("tokenizers", src.path)


def test_the_shipped_tokenizer_is_transformers_conversion_of_the_embedded_gguf(tmp_path, monkeypatch):
    """The package's copy of the embedded model's tokenizer (loading.SHIPPED_TOKENIZERS, which a new
    machine's first run copies instead of converting) holds what transformers converts from the
    GGUF now, file for file; and a first load with an empty cache takes the copy."""
    from transformers import AutoTokenizer

    from yggtree.files import file_sha256

    src = loading.resolve_model("default")
    shipped = loading.SHIPPED_TOKENIZERS / f"{src.path.stat().st_size}-{file_sha256(src.path)[:16]}"
    assert loading._shipped_tokenizer(src.path) == shipped
    fresh = tmp_path / "fresh"
    AutoTokenizer.from_pretrained(str(src.path.parent), gguf_file=src.path.name).save_pretrained(str(fresh))
    assert sorted(f.name for f in fresh.iterdir()) == sorted(f.name for f in shipped.iterdir())
    for f in fresh.iterdir():
        if f.suffix == ".json":
            assert json.loads(f.read_text()) == json.loads((shipped / f.name).read_text()), f.name
        else:
            assert f.read_text() == (shipped / f.name).read_text(), f.name
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    seeded, real_seed = [], loading._seed_tokenizer
    monkeypatch.setattr(loading, "_seed_tokenizer", lambda a, b: seeded.append(a) or real_seed(a, b))
    tok = loading.load_tokenizer(src)
    assert seeded == [shipped] and isinstance(tok, LightTokenizer)
    kept = loading._cache_dir("tokenizers", src.path)
    assert all((kept / f.name).read_bytes() == f.read_bytes() for f in shipped.iterdir())


def test_a_gguf_of_no_shipped_size_is_not_hashed(tmp_path, monkeypatch):
    """Looking for a shipped conversion reads no file whose size no shipped one has (a large
    model's sha256 would cost seconds of its first run)."""
    other = tmp_path / "other.gguf"
    other.write_bytes(b"GGUF" + bytes(1000))
    monkeypatch.setattr(loading, "file_sha256", lambda p: pytest.fail("hashed"))
    assert loading._shipped_tokenizer(other) is None


@pytest.fixture(scope="module")
def pair(converted):
    light = LightTokenizer.load(converted)
    assert light is not None
    return light, PreTrainedTokenizerFast.from_pretrained(str(converted))


def _texts(light) -> list[str]:
    """A few hundred strings: yggtree's prompts, code, unicode, whitespace, special-token text."""
    specials = [t for t in light.get_vocab() if t.startswith("<") and t.endswith(">") and len(t) > 2][:40]
    edge = ["", " ", "  ", "\n", "\n\n\n", "\t", " \t \n ", "\r\n", "a  b", "trailing   ", "   leading",
            "naïve café — 日本語 🌲🌳", "👩‍👩‍👧 family", "e\u0301 vs é", "שלום עולם", "Привет, мир!", "a\u00a0b\u200bc\ufeff",
            "\x00\x01\x7f", "Hello\u2028World\u3000!", "1234567890 3.14159 1e-9 0x1F -0", "don't I'm it's we've they're .?!,",
            "    def f(x):\n        return x ** 2\n", "<|im_start|", "|im_end|>", "<|im_end|><|im_end|>", " <|im_end|> ",
            "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n", "x<|endoftext|>y", "<s></s><unk>"]
    code = Path(json.__file__).read_text().splitlines(keepends=True)
    chunks = ["".join(code[i : i + 25]) for i in range(0, len(code), 25)]
    rng = random.Random(0)
    pool = list("abcXYZ019 \n\t.,;:'\"(){}[]<>|_-=+#") + ["日", "本", "🌲", "é", "\u0301", "ß", " <|im_end|>", "<|im_start|>"]
    rand = ["".join(rng.choice(pool) for _ in range(rng.randrange(1, 60))) for _ in range(100)]
    stubs = [p["prompt"] for p in _humaneval_problems()]
    return ([p.text for p in eval_prompts(None, None)] + stubs[:40] + edge + specials + [s + " and <|im_end|> " + s for s in specials]
            + chunks + rand)


def test_the_embedded_tokenizer_reads_as_transformers_reads_it(pair):
    light, hf = pair
    assert light._backend.to_str() == hf.backend_tokenizer.to_str()  # the same backend, as transformers sets it up
    assert light.get_vocab() == hf.get_vocab() and len(light) == len(hf)
    for attr in ("bos_token", "eos_token", "unk_token", "pad_token", "sep_token", "cls_token", "mask_token"):
        assert (getattr(light, attr), getattr(light, attr + "_id")) == (getattr(hf, attr), getattr(hf, attr + "_id"))
    assert light.all_special_ids == hf.all_special_ids and light.all_special_tokens == hf.all_special_tokens
    assert light.special_tokens_map == hf.special_tokens_map
    assert light.chat_template == hf.chat_template and light.clean_up_tokenization_spaces == hf.clean_up_tokenization_spaces
    for t in ["<|im_end|>", "Ġthe", "not a token", ["<|im_start|>", "a", "zzzz"]]:
        assert light.convert_tokens_to_ids(t) == hf.convert_tokens_to_ids(t)


def test_encoding_equals_transformers(pair):
    light, hf = pair
    texts = _texts(light)
    assert len(texts) > 400
    for s in texts:
        for special in (True, False):
            assert light(s, add_special_tokens=special) == dict(hf(s, add_special_tokens=special)), s
            assert light.encode(s, add_special_tokens=special) == hf.encode(s, add_special_tokens=special)
        assert light(s) == dict(hf(s)) and light.encode(s) == hf.encode(s)


def test_decoding_equals_transformers(pair):
    light, hf = pair
    rng = random.Random(1)
    seqs = [light.encode(s) for s in _texts(light)]
    special = sorted(hf.added_tokens_decoder)
    seqs += [[rng.choice(special) if rng.random() < 0.2 else rng.randrange(len(hf)) for _ in range(rng.randrange(0, 40))]
             for _ in range(300)]
    for ids in seqs:
        for skip in (True, False):
            assert light.decode(ids, skip_special_tokens=skip) == hf.decode(ids, skip_special_tokens=skip), ids
    assert light.decode(2) == hf.decode(2) and light.decode(seqs[:3]) == hf.decode(seqs[:3])
    torch = pytest.importorskip("torch")
    assert light.decode(torch.tensor(seqs[0]), skip_special_tokens=True) == hf.decode(torch.tensor(seqs[0]), skip_special_tokens=True)


def _conversations() -> list[list[dict]]:
    firsts = [p.text for p in eval_prompts(None, 20)]
    out = [[{"role": "user", "content": t}] for t in firsts]
    out += [[{"role": "system", "content": "Be brief."}, {"role": "user", "content": t}] for t in firsts[:20]]
    for q in _mtbench_questions()[:20]:  # two turns, with an answer between
        out.append([{"role": "user", "content": q["turns"][0]}, {"role": "assistant", "content": "Sure.\n\nFirst, ..."},
                    {"role": "user", "content": q["turns"][1]}])
    out.append([{"role": "user", "content": "x", "name": None}, {"role": "assistant", "content": "y", "reasoning": "z"}])
    out.append([{"role": "user", "content": "<|im_end|> inside \n\n a message "}])
    return out


def test_chat_template_equals_transformers(pair):
    light, hf = pair
    for conv in _conversations():
        for gen in (True, False):
            text = light.apply_chat_template(conv, add_generation_prompt=gen, tokenize=False)
            assert text == hf.apply_chat_template(conv, add_generation_prompt=gen, tokenize=False)
            assert light(text, add_special_tokens=False)["input_ids"] == hf(text, add_special_tokens=False)["input_ids"]
        assert light.apply_chat_template(conv) == dict(hf.apply_chat_template(conv))
        assert light.apply_chat_template(conv, return_dict=False) == hf.apply_chat_template(conv, return_dict=False)
    for tok in pair:
        with pytest.raises(ValueError):
            tok.apply_chat_template([], tokenize=False)
    text = "Write a haiku."
    assert loading.encode_prompt(light, text) == loading.encode_prompt(hf, text)
    assert loading.encode_prompt(light, text, raw=True) == loading.encode_prompt(hf, text, raw=True)


def test_save_pretrained_loads_back_alike(pair, tmp_path):
    light, hf = pair
    light.save_pretrained(tmp_path / "copy")
    again, back = LightTokenizer.load(tmp_path / "copy"), PreTrainedTokenizerFast.from_pretrained(str(tmp_path / "copy"))
    assert again is not None and back.backend_tokenizer.to_str() == hf.backend_tokenizer.to_str()
    assert again.get_vocab() == light.get_vocab() and back.chat_template == light.chat_template


def test_loading_the_cached_tokenizer_imports_neither_transformers_nor_jinja(converted):
    code = ("import sys\nimport yggtree.runtime.loading as l\ntok = l.load_tokenizer(l.resolve_model('default'))\n"
            "assert type(tok).__name__ == 'LightTokenizer' and 'jinja2' not in sys.modules\n"
            "ids = l.encode_prompt(tok, 'Write a haiku about trees.')\nassert tok.decode(ids, skip_special_tokens=True)\n"
            "assert 'transformers' not in sys.modules, 'transformers imported'\nprint('ok')")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=600)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr


# ----------------------------------------------------------------------------- hand-made directories

TEMPLATE = ("{{ bos_token }}{% set ns = namespace(n=0) %}{% for m in messages %}{% if m['role'] == 'tool' %}"
            "{{ raise_exception('no tools') }}{% endif %}{% if loop.index > 5 %}{% break %}{% endif %}"
            "{% set ns.n = ns.n + 1 %}[{{ m['role'] }}:{{ m['content'] | tojson }}{{ dict(a=1) | tojson }}]{% endfor %}\n"
            "  {% if add_generation_prompt %}{{ ns.n }}>{{ eos_token }}{% endif %}{{ strftime_now('%Y') }}")


def _word_level(path: Path, clean: bool, **extra) -> None:
    vocab = {c: i for i, c in enumerate("abcdefghijklmnopqrstuvwxyz .,'!?<>|")}
    core = Tokenizer(models.WordLevel(vocab, unk_token="|"))
    core.pre_tokenizer = pre_tokenizers.Split("", "isolated")
    tok = PreTrainedTokenizerFast(tokenizer_object=core, eos_token="<", bos_token=">", unk_token="|",
                                  clean_up_tokenization_spaces=clean, **extra)
    tok.chat_template = TEMPLATE
    tok.save_pretrained(str(path))


def _byte_bpe(path: Path, clean: bool) -> None:
    """A byte-level BPE (a few merges), with its special tokens in the backend, saved as transformers 4
    did: added_tokens_decoder and the chat template in tokenizer_config.json, a special_tokens_map.json."""
    vocab = {t: i for i, t in enumerate(sorted(pre_tokenizers.ByteLevel.alphabet()) + ["Ġt", "he", "Ġthe"])}
    core = Tokenizer(models.BPE(vocab, [("Ġ", "t"), ("h", "e"), ("Ġt", "he")]))
    core.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    from tokenizers import decoders

    core.decoder = decoders.ByteLevel()
    core.add_special_tokens([AddedToken("<e>", special=True, normalized=False), AddedToken("<s>", special=True, normalized=False)])
    core.save(str(path / "tokenizer.json"))
    added = {str(i): {"content": t.content, "lstrip": t.lstrip, "normalized": t.normalized, "rstrip": t.rstrip,
                      "single_word": t.single_word, "special": t.special} for i, t in core.get_added_tokens_decoder().items()}
    (path / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "added_tokens_decoder": added, "bos_token": "<s>",
        "eos_token": "<e>", "clean_up_tokenization_spaces": clean, "model_max_length": 512, "chat_template": TEMPLATE,
        "additional_special_tokens": ["<s>"], "extra_special_tokens": {}}))
    (path / "special_tokens_map.json").write_text(json.dumps({"eos_token": {"content": "<x>"}}))  # not read then


@pytest.mark.parametrize("make", ["word-clean", "word", "bpe-clean", "bpe"])
def test_hand_made_directories_read_as_transformers_reads_them(tmp_path, make):
    kind, clean = make.split("-")[0], make.endswith("clean")
    (_word_level if kind == "word" else _byte_bpe)(tmp_path, clean)
    light, hf = LightTokenizer.load(tmp_path), PreTrainedTokenizerFast.from_pretrained(str(tmp_path))
    assert light is not None and light._backend.to_str() == hf.backend_tokenizer.to_str()
    assert (light.eos_token_id, light.bos_token_id, light.unk_token_id) == (hf.eos_token_id, hf.bos_token_id, hf.unk_token_id)
    assert light.all_special_ids == hf.all_special_ids and light.get_vocab() == hf.get_vocab()
    for s in ["the cat , isn't it ? yes !", "a . b 're c 's", " the  the ", "<e>the<s>", ""]:
        for special in (True, False):
            ids = light.encode(s, add_special_tokens=special)
            assert ids == hf.encode(s, add_special_tokens=special)
            for skip in (True, False):
                assert light.decode(ids, skip_special_tokens=skip) == hf.decode(ids, skip_special_tokens=skip)
                for cleanup in (True, False):
                    assert (light.decode(ids, skip_special_tokens=skip, clean_up_tokenization_spaces=cleanup)
                            == hf.decode(ids, skip_special_tokens=skip, clean_up_tokenization_spaces=cleanup))
    convs = [[{"role": "user", "content": "hi \"there\""}], [{"role": r, "content": r * 2} for r in ["a", "b"] * 4]]
    for conv in convs:
        for gen in (True, False):
            text = light.apply_chat_template(conv, add_generation_prompt=gen, tokenize=False)
            assert text == hf.apply_chat_template(conv, add_generation_prompt=gen, tokenize=False)
    import jinja2

    for tok in (light, hf):
        with pytest.raises(jinja2.exceptions.TemplateError, match="no tools"):
            tok.apply_chat_template([{"role": "tool", "content": "x"}], tokenize=False)


def test_the_cleanup_applies_where_transformers_applies_it(tmp_path):
    """(the cases above would pass without any clean-up if it never changed these texts)"""
    _word_level(tmp_path, True)
    light = LightTokenizer.load(tmp_path)
    ids = light.encode("isn't it?")
    assert light.decode(ids) != light.decode(ids, clean_up_tokenization_spaces=False)  # a WordLevel model: cleaned up
    (tmp_path / "bpe").mkdir()
    _byte_bpe(tmp_path / "bpe", True)
    bpe = LightTokenizer.load(tmp_path / "bpe")
    assert bpe.decode(bpe.encode("the ?")) == "the ?"  # BPE: transformers ignores the setting


def test_a_namespace_refuses_private_names_as_in_transformers(tmp_path):
    _word_level(tmp_path, False)
    for tok in (LightTokenizer.load(tmp_path), PreTrainedTokenizerFast.from_pretrained(str(tmp_path))):
        tok.chat_template = "{% set ns = namespace(_x=1) %}{{ ns._x }}"
        if isinstance(tok, LightTokenizer):
            tok._compiled = None
        with pytest.raises(Exception, match="underscore-prefixed"):
            tok.apply_chat_template([{"role": "user", "content": "x"}], tokenize=False)


def _edit(path: Path, name: str, change) -> None:
    data = json.loads((path / name).read_text())
    change(data)
    (path / name).write_text(json.dumps(data))


FALLBACKS = {
    "no tokenizer.json": lambda p: (p / "tokenizer.json").unlink(),
    "a model-specific class": lambda p: _edit(p, "tokenizer_config.json", lambda c: c.update(tokenizer_class="GPT2Tokenizer")),
    "an unknown setting": lambda p: _edit(p, "tokenizer_config.json", lambda c: c.update(fix_mistral_regex=True)),
    "a model-specific token": lambda p: _edit(p, "tokenizer_config.json", lambda c: c.update(image_token="a")),
    "a special token the backend lacks": lambda p: _edit(p, "tokenizer_config.json", lambda c: c.update(pad_token="<pad>")),
    "a special token the backend has as text": lambda p: _edit(p, "tokenizer_config.json", lambda c: c.update(pad_token="a")),
    "split special tokens": lambda p: _edit(p, "tokenizer_config.json", lambda c: c.update(split_special_tokens=True)),
    "padding in tokenizer.json": lambda p: _edit(p, "tokenizer.json", lambda t: t.update(padding={
        "strategy": "BatchLongest", "direction": "Right", "pad_to_multiple_of": None, "pad_id": 0, "pad_type_id": 0,
        "pad_token": "<"})),
    "a generation block": lambda p: (p / "chat_template.jinja").write_text("{% generation %}x{% endgeneration %}"),
    "several templates": lambda p: ((p / "chat_template.jinja").unlink(), _edit(
        p, "tokenizer_config.json", lambda c: c.update(chat_template=[{"name": "default", "template": "x"}]))),
    "a legacy added_tokens.json": lambda p: (p / "added_tokens.json").write_text("{}"),
}


@pytest.mark.parametrize("case", sorted(FALLBACKS))
def test_what_it_cannot_reproduce_is_left_to_transformers(tmp_path, case):
    _word_level(tmp_path, False)
    assert LightTokenizer.load(tmp_path) is not None
    FALLBACKS[case](tmp_path)
    assert LightTokenizer.load(tmp_path) is None
    if case not in ("a model-specific class", "no tokenizer.json"):  # (which transformers cannot read either)
        got = loading._cached_tokenizer(tmp_path)
        assert isinstance(got, PreTrainedTokenizerFast)
