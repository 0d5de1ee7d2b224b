"""The model runtime against transformers on tiny random-weight checkpoints (HF directories)."""

from __future__ import annotations

import json

import pytest
import torch

from yggtree.errors import YggError
from yggtree.runtime import steps
from yggtree.runtime.kv_cache import KVCache
from yggtree.runtime.model import Attention, ModelConfig
from yggtree.runtime.loading import load_model, resolve_model

transformers = pytest.importorskip("transformers")

TINY = dict(
    vocab_size=128,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=3,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=256,
    rms_norm_eps=1e-5,
)

CASES = {
    "llama-tied": ("LlamaConfig", "LlamaForCausalLM", dict(tie_word_embeddings=True)),
    "llama-untied-llama3-rope": (
        "LlamaConfig",
        "LlamaForCausalLM",
        dict(
            tie_word_embeddings=False,
            rope_theta=500000.0,
            rope_scaling=dict(
                rope_type="llama3",
                factor=8.0,
                low_freq_factor=1.0,
                high_freq_factor=4.0,
                original_max_position_embeddings=64,
            ),
        ),
    ),
    "llama-linear-rope": (
        "LlamaConfig",
        "LlamaForCausalLM",
        dict(rope_scaling=dict(rope_type="linear", factor=2.0)),
    ),
    "llama-yarn-rope": (
        "LlamaConfig",
        "LlamaForCausalLM",
        dict(rope_scaling=dict(rope_type="yarn", factor=4.0, original_max_position_embeddings=64)),
    ),
    "mistral": ("MistralConfig", "MistralForCausalLM", dict(sliding_window=None)),
    "qwen2-bias": ("Qwen2Config", "Qwen2ForCausalLM", dict(tie_word_embeddings=True)),
}


def save_tiny(tmp_path, case: str, shard: bool = False):
    cfg_cls, model_cls, extra = CASES[case]
    torch.manual_seed(0)
    cfg = getattr(transformers, cfg_cls)(**TINY, **extra)
    hf = getattr(transformers, model_cls)(cfg).eval()
    with torch.no_grad():
        for p in hf.parameters():
            p.normal_(0, 0.2)  # large enough that wrong RoPE or bias handling is visible
    hf.save_pretrained(tmp_path, max_shard_size="100KB" if shard else "10GB")
    return hf


def causal_logits(model, ids: list[int], capture=()):
    model.setup_cache(1, 64)
    n = len(ids)
    pos = torch.arange(n)[None]
    mask = (torch.arange(64)[None, :] <= torch.arange(n)[:, None])[None]
    with torch.no_grad():
        out = model(torch.tensor([ids]), pos, pos, mask, capture)
        return model.logits(out.hidden)[0], [x[0] for x in out.layers]


@pytest.mark.parametrize("case", list(CASES))
def test_logits_match_transformers(tmp_path, case):
    hf = save_tiny(tmp_path, case, shard=case == "llama-tied")
    ours = load_model(resolve_model(str(tmp_path)))
    ids = [3, 17, 99, 5, 64, 12, 7, 120, 33, 1, 2, 90] * 3
    with torch.no_grad():
        ref = hf(torch.tensor([ids]), output_hidden_states=True)
    got, layers = causal_logits(ours, ids, capture=(0, 2))
    torch.testing.assert_close(got, ref.logits[0], rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(layers[0], ref.hidden_states[1][0], rtol=1e-4, atol=1e-4)


def test_sharded_checkpoint_loads(tmp_path):
    save_tiny(tmp_path, "llama-tied", shard=True)
    assert (tmp_path / "model.safetensors.index.json").is_file()
    assert load_model(resolve_model(str(tmp_path))).cfg.num_layers == 3


def test_chunked_prefill_then_decode_equals_full_forward(tmp_path):
    """Prefill in padded chunks + one-token tree steps reproduce the full causal forward."""
    save_tiny(tmp_path, "qwen2-bias")
    model = load_model(resolve_model(str(tmp_path)))
    ids = list(range(3, 30))
    full, _ = causal_logits(model, ids)
    model.setup_cache(1, 64)
    with torch.no_grad():
        c, n0 = 8, 19
        for start in range(0, n0, c):
            part = ids[start : min(start + c, n0)]
            buf = torch.zeros(1, c, dtype=torch.int64)
            buf[0, : len(part)] = torch.tensor(part)
            last, _, _ = steps.prefill_chunk(model, buf, torch.tensor(start), torch.tensor(len(part)))
        torch.testing.assert_close(last[0], full[n0 - 1], rtol=1e-4, atol=1e-4)
        one = torch.ones(1, 1, dtype=torch.bool)
        zero = torch.zeros(1, dtype=torch.int64)
        for i in range(n0, len(ids)):
            lg, _, _ = steps.tree_step(model, torch.tensor([ids[i]]), zero, zero, one, torch.tensor(i))
            torch.testing.assert_close(lg[0], full[i], rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("case", list(CASES))
def test_bfloat16_matches_transformers_in_bfloat16(tmp_path, case):
    """bfloat16: the weights are exactly the checkpoint's rounded to bfloat16, the blocks compute
    in bfloat16, and the logits (returned in float32) are transformers' bfloat16 forward's up to
    bfloat16 rounding: within 4 eps (2^-7) of the largest logit (seen: at most 0.32 of that)."""
    hf = save_tiny(tmp_path, case)
    ours = load_model(resolve_model(str(tmp_path)), "bfloat16")
    f32 = load_model(resolve_model(str(tmp_path)), "float32")
    for (name, p16), (_, p32) in zip(ours.named_parameters(), f32.named_parameters(), strict=True):
        assert torch.equal(p16, p32.to(torch.bfloat16)), name
    ids = [3, 17, 99, 5, 64, 12, 7, 120, 33, 1, 2, 90] * 3
    got, layers = causal_logits(ours, ids, capture=(0,))
    with torch.no_grad():
        ref = hf.to(torch.bfloat16)(torch.tensor([ids])).logits[0].float()
    assert got.dtype == torch.float32 and layers[0].dtype == torch.bfloat16
    tol = 4 * torch.finfo(torch.bfloat16).eps * ref.abs().max().item()
    torch.testing.assert_close(got, ref, rtol=0, atol=tol)


def test_unsupported_architecture_is_refused(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["GPT2LMHeadModel"]}))
    with pytest.raises(YggError, match="unsupported architecture"):
        load_model(resolve_model(str(tmp_path)))


def test_bad_paths_are_refused(tmp_path):
    with pytest.raises(YggError, match="does not exist"):
        resolve_model(str(tmp_path / "missing"))
    with pytest.raises(YggError, match="no config.json"):
        resolve_model(str(tmp_path))
    (tmp_path / "x.bin").write_text("x")
    with pytest.raises(YggError, match="neither a HF directory nor a .gguf"):
        resolve_model(str(tmp_path / "x.bin"))
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"not a gguf file at all")
    with pytest.raises(YggError, match="cannot read GGUF"):
        load_model(resolve_model(str(bad)))


def test_truncated_safetensors_is_refused(tmp_path):
    save_tiny(tmp_path, "llama-tied")
    f = tmp_path / "model.safetensors"
    f.write_bytes(f.read_bytes()[:1000])
    with pytest.raises(YggError, match="cannot read weights"):
        load_model(resolve_model(str(tmp_path)))


@pytest.mark.parametrize("heads, kv_heads", [(4, 4), (6, 2), (9, 3)])
def test_one_query_attention_equals_the_batched_path(heads, kv_heads):
    """The fused one-query path (plain decode steps) computes what the bmm path computes for the
    same query when it is one row of a wider call (the rows a tree verification feeds)."""
    torch.manual_seed(0)
    cfg = ModelConfig(vocab_size=32, hidden_size=48, intermediate_size=64, num_layers=1,
                      num_heads=heads, num_kv_heads=kv_heads, head_dim=16)
    attn = Attention(cfg).requires_grad_(False)
    attn.cache = KVCache.zeros(1, kv_heads, 40, 16, torch.float32, "cpu")
    attn.cache.k.normal_()
    attn.cache.v.normal_()
    x = torch.randn(1, 3, 48)
    cos, sin = torch.rand(1, 3, 1, 8), torch.rand(1, 3, 1, 8)
    slots = torch.tensor([[20, 21, 22]])
    mask = torch.rand(1, 3, 32) < 0.7
    mask[..., 20:23] = False
    mask[0, 0, 20] = True  # row 0 sees its own slot and a random part of the prefix
    wide = attn(x, cos, sin, slots, mask)  # [1, 3, 48]: three rows, the bmm path
    one = attn(x[:, :1], cos[:, :1], sin[:, :1], slots[:, :1], mask[:, :1])  # the fused path
    torch.testing.assert_close(one[0, 0], wide[0, 0], rtol=1e-5, atol=1e-5)


def test_a_converted_tokenizer_is_read_back_as_autotokenizer_reads_it(tmp_path):
    """runtime/loading._cached_tokenizer: a fast tokenizer saved by an earlier load comes back
    encoding, decoding and templating as the class AutoTokenizer picks does: as a LightTokenizer
    (runtime/tokenizer.py, tests/test_tokenizer.py) where that reproduces it."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    from yggtree.runtime.loading import _cached_tokenizer
    from yggtree.runtime.tokenizer import LightTokenizer

    assert _cached_tokenizer(tmp_path) is None
    vocab = {c: i for i, c in enumerate("abcdefghijklmnopqrstuvwxyz <>|")}
    core = Tokenizer(models.WordLevel(vocab, unk_token="|"))
    core.pre_tokenizer = pre_tokenizers.Split("", "isolated")
    tok = PreTrainedTokenizerFast(tokenizer_object=core, eos_token="<", unk_token="|")
    tok.chat_template = "{% for m in messages %}<{{ m['content'] }}>{% endfor %}"
    tok.save_pretrained(str(tmp_path))
    got, want = _cached_tokenizer(tmp_path), AutoTokenizer.from_pretrained(str(tmp_path))
    assert isinstance(got, LightTokenizer)
    text = got.apply_chat_template([{"role": "user", "content": "hi there"}], tokenize=False)
    assert text == want.apply_chat_template([{"role": "user", "content": "hi there"}], tokenize=False)
    ids = got(text)["input_ids"]
    assert ids == want(text)["input_ids"] and got.decode(ids) == want.decode(ids)
    assert got.eos_token_id == want.eos_token_id == vocab["<"]
