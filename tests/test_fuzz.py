"""Fuzzing (hypothesis) the ``yggtree run`` command line and the Python API on tiny random-weight
models: every input either succeeds or is refused with one ``YggError`` line (exit 1, or 2 for a
flag argparse refuses); never a traceback, never a hang (each example runs under a 60 s alarm),
never a silent wrong answer (every greedy success equals plain decoding token for token).

Size per run: ``CLI_EXAMPLES`` command lines (--lookup and --drafter none included) and
``API_EXAMPLES`` API calls, derandomized (no example database, no random seed from the clock);
about 25 s on one thread of the shared 2-core machine, under a minute when it is busy."""

from __future__ import annotations

import contextlib
import io
import json
import math
import signal

import pytest
from hypothesis import HealthCheck, given, seed, settings
from hypothesis import strategies as st

from yggtree.cli import main
from yggtree.errors import YggError
from yggtree.runtime.drafters import LMDrafter
from yggtree.runtime.engine import Engine, EngineConfig, Result, SamplingParams, TreeParams

transformers = pytest.importorskip("transformers")
pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("one_thread")]  # hundreds of examples

CLI_EXAMPLES = 300
API_EXAMPLES = 400
LIMIT_S = 60


OUTCOMES: dict[str, int] = {}  # what the examples did (checked last: the fuzz must reach decoding)


def seen(kind: str) -> None:
    OUTCOMES[kind] = OUTCOMES.get(kind, 0) + 1


class Hang(Exception):
    pass


@contextlib.contextmanager
def time_limit(seconds: int = LIMIT_S):
    def alarm(signum, frame):
        raise Hang(f"no answer within {seconds} s")

    old = signal.signal(signal.SIGALRM, alarm)
    signal.alarm(seconds)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, old)


# ----------------------------------------------------------------------------- the command line


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    from test_compile import save_tiny_checkpoint

    d = tmp_path_factory.mktemp("fuzz") / "model"
    save_tiny_checkpoint(d)
    return str(d)


@pytest.fixture(scope="module")
def plain(checkpoint):
    """Plain greedy decoding of the checkpoint, the reference for every greedy success."""
    from yggtree.runtime.build import EngineSpec, build_engine

    engine, _ = build_engine(EngineSpec(model=checkpoint, mode="reference", max_context=128,
                                        prefill_chunk=8))
    return engine


def sometimes(good, bad):
    """``good`` about 15 times in 16, else ``bad``."""
    return st.integers(0, 15).flatmap(lambda i: bad if i == 0 else good)


def numbers(lo, hi):
    """Mostly sensible values, sometimes absurd ones or not numbers at all."""
    return sometimes(st.integers(lo, hi).map(str), st.one_of(
        st.integers(-10, 10**6).map(str),
        st.sampled_from(["0", "-1", "1e9", "inf", "nan", "3.5", "", "abc", "0x10", " 4"])))


def floats(lo, hi):
    return sometimes(st.floats(lo, hi, allow_nan=False).map(repr), st.sampled_from(
        ["0", "1", "-0.5", "inf", "-inf", "nan", "1e9", "1e-300", "x", "0.7"]))


WORDS = st.lists(st.integers(0, 127).map(lambda i: f"t{i}"), min_size=1, max_size=40).map(" ".join)
TEXT = sometimes(WORDS, st.one_of(st.text(max_size=30), st.sampled_from(
    ["ab\udcff\udcfecd", " ", "", "\x00", "t1 \u00e9\u4e2d t3", "t200 t999"])))


@st.composite
def run_args(draw):
    argv = ["run", "--model", "CHECKPOINT", "--raw", "--mode", "reference", "--json"]
    argv += ["--prompt", draw(TEXT), "--max-new-tokens", draw(numbers(1, 24)),
             "--max-context", draw(numbers(64, 128))]
    optional = {
        "--temperature": sometimes(st.just("0"), floats(0, 2)),
        "--top-p": floats(0.05, 1),
        "--seed": numbers(0, 2**31),
        "--prefill-chunk": numbers(1, 70),
        "--draft-width": numbers(1, 6),
        "--draft-depth": numbers(1, 6),
        "--verify-width": numbers(1, 12),
        "--top-k": numbers(1, 8),
        "--lookup": numbers(0, 6),
    }
    for flag, values in optional.items():
        if draw(st.booleans()):
            argv += [flag, draw(values)]
    drafter = draw(st.sampled_from([None, "self", "self", "self", "none", "nonexistent-dir"]))
    if drafter:
        argv += ["--drafter", drafter]
    if draw(st.integers(0, 9)) == 0:
        argv += ["--no-speculate"]
    if draw(st.integers(0, 9)) == 0:
        argv = [a for a in argv if a != "--json"]
    return argv


def cli(argv) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            code = main(argv)
        except SystemExit as e:  # argparse's refusal (our parser writes one line first)
            code = e.code
    return code, out.getvalue(), err.getvalue()


@seed(20261125)
@settings(max_examples=CLI_EXAMPLES, deadline=None, derandomize=True, database=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
@given(argv=run_args())
def test_fuzz_cli_run(checkpoint, plain, argv):
    argv = [checkpoint if a == "CHECKPOINT" else a for a in argv]
    with time_limit():
        code, out, err = cli(argv)
    seen(f"cli exit {code}")
    if code != 0:
        assert code in (1, 2), (code, err)
        assert err.count("\n") == 1 and err.startswith("yggtree: error: "), err
        assert "Traceback" not in err and out == ""
        return
    lines = [ln for ln in err.splitlines() if ln.strip()]
    assert all("Traceback" not in ln for ln in lines)
    if "--json" not in argv:
        assert len(lines) == 1 and lines[0].startswith("["), err  # the one stats line
        return
    res = json.loads(out)
    temperature = float(argv[argv.index("--temperature") + 1]) if "--temperature" in argv else 0.0
    if temperature == 0:
        want = plain.generate(res["prompt_token_ids"], SamplingParams(len(res["token_ids"]))).token_ids
        seen("cli greedy compared")
        if res["finish_reason"] == "length":
            assert res["token_ids"] == want
        else:  # stopped at EOS: plain decoding stops there too
            assert res["token_ids"] == want[: len(res["token_ids"])] and want[len(res["token_ids"]) - 1] == res["token_ids"][-1]


# ----------------------------------------------------------------------------- the Python API


@pytest.fixture(scope="module")
def models():
    from test_engine import tiny

    target = tiny(vocab=50, hidden=32, layers=2, seed=5)
    plain_engine = Engine(target.shared_copy(), EngineConfig(mode="reference", max_context=96,
                                                              prefill_chunk=8))
    return target, plain_engine, {}


ANY = st.one_of(
    st.integers(-5, 60), st.floats(allow_nan=True), st.text(max_size=3), st.none(), st.booleans(),
    st.lists(st.integers(0, 49), max_size=2),
)
IDS = st.lists(st.integers(0, 49), min_size=1, max_size=30)
PROMPT = sometimes(IDS, st.one_of(
    st.lists(ANY, max_size=5), st.text(max_size=10), st.just([]),
    st.lists(st.integers(0, 49), min_size=90, max_size=100),
    IDS.map(tuple), IDS.map(lambda x: [float(t) for t in x])))
PARAMS = st.builds(
    SamplingParams,
    max_new_tokens=sometimes(st.integers(1, 20), st.one_of(st.integers(-3, 200), st.floats(0, 5))),
    temperature=sometimes(st.sampled_from([0.0, 0.0, 0.7, 1.0]), st.one_of(
        st.floats(allow_nan=True), st.sampled_from([math.inf, 1e9, -1.0, "0.5", None]))),
    top_p=sometimes(st.sampled_from([1.0, 0.9]), st.one_of(st.floats(0, 1.5), st.sampled_from([math.nan, 0.0]))),
    seed=sometimes(st.integers(0, 1000), st.integers(-2**70, 2**70)),
)
TREE = sometimes(
    st.one_of(st.none(), st.builds(TreeParams, st.integers(1, 4), st.integers(1, 4), st.integers(1, 8),
                                   st.integers(1, 4))),
    st.builds(TreeParams, st.integers(-1, 80), st.integers(-1, 40), st.integers(-1, 300),
              st.integers(-1, 70)),
)


@seed(20261125)
@settings(max_examples=API_EXAMPLES, deadline=None, derandomize=True, database=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
@given(prompt=PROMPT, params=PARAMS, tree=TREE, context=sometimes(st.sampled_from([96, 64]), st.sampled_from([20, 1, 600])),
       chunk=sometimes(st.sampled_from([8, 5]), st.sampled_from([1, 96, 97])))
def test_fuzz_api(models, prompt, params, tree, context, chunk):
    target, plain_engine, engines = models
    key = (tree, context, chunk)
    with time_limit():
        try:
            if key not in engines:  # an engine per shape, kept: building one is the slow part
                drafter = LMDrafter(target.shared_copy(), "reference") if tree is not None else None
                engines[key] = Engine(target.shared_copy(),
                                      EngineConfig(mode="reference", max_context=context,
                                                   prefill_chunk=chunk, tree=tree), drafter)
            res = engines[key].generate(prompt, params)
        except YggError as e:
            assert "\n" not in str(e) and str(e)
            seen("api refused")
            return
    seen("api ok")
    assert isinstance(res, Result) and 1 <= len(res.token_ids) <= params.max_new_tokens
    assert all(isinstance(t, int) and 0 <= t < 50 for t in res.token_ids)
    if params.temperature == 0:
        want = plain_engine.generate(list(prompt), SamplingParams(len(res.token_ids))).token_ids
        assert res.token_ids == want
        seen("api greedy compared" + (" (tree)" if tree is not None else ""))


def test_fuzz_reached_decoding():
    """The examples above are not all refusals: enough of them decode, greedy ones are compared
    with plain decoding, speculative ones included (runs after the two fuzz tests)."""
    print(OUTCOMES)
    assert OUTCOMES.get("cli exit 0", 0) >= CLI_EXAMPLES // 5
    assert OUTCOMES.get("cli greedy compared", 0) >= CLI_EXAMPLES // 20
    assert OUTCOMES.get("api ok", 0) >= API_EXAMPLES // 5
    assert OUTCOMES.get("api greedy compared (tree)", 0) >= API_EXAMPLES // 20
