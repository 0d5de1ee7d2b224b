"""Continuous batching (runtime/batch.py): every request of a batch gets exactly the tokens it gets
decoded alone by ``Engine.generate``, and every verify call bitwise the logits it computes alone -- greedy and seeded sampling, plain and speculative steps,
requests joining mid-run (chunked prefill beside running decodes) and leaving mid-run -- over a
sweep of batch sizes; and the decoder's refusals."""

from __future__ import annotations

import contextlib
import random
from unittest import mock

import pytest
import torch

from yggtree.errors import YggError
from yggtree.runtime import stages
from yggtree.runtime.batch import BatchDecoder, batch_bucket, check_rows_invariant, plain_policy
from yggtree.runtime.drafters import LMDrafter
from yggtree.runtime.eagle import EagleDrafter
from yggtree.runtime.engine import Engine, EngineConfig, SamplingParams, TreeParams
from yggtree.runtime.kernels import library_missing
from yggtree.runtime.packed import pack_linears

from helpers import perturbed, sweep, tiny_model

pytestmark = [
    pytest.mark.usefixtures("one_thread"),
    pytest.mark.skipif(bool(library_missing()), reason="the kernel library needs AVX2 with FMA and F16C (or AVX-512)"),
]

VOCAB, EOS = 97, 3
TREE = TreeParams(draft_width=2, draft_depth=3, verify_width=6, top_k=2)


def tiled(model):
    """``model`` on the tiled product kernel: rows bitwise independent of the call's other rows
    (``F.linear``'s BLAS picks kernels by the row count)."""
    pack_linears(model, kernel="tiled")
    return model


def engine(kind: str, max_context: int = 320, tree: TreeParams = TREE) -> Engine:
    """A fresh tiny engine on the tiled kernel: ``plain`` (no drafter), ``spec`` (a perturbed
    copy drafting) or ``eagle`` (a random EAGLE head)."""
    target = tiled(tiny_model(VOCAB, 64, 2, max_pos=1024, eos=(EOS,), seed=0))
    drafter = None
    if kind == "spec":
        drafter = LMDrafter(tiled(perturbed(tiny_model(VOCAB, 64, 2, max_pos=1024, seed=0), 0.05)), "reference")
    elif kind == "eagle":  # reads the target's layers: features kept per request
        drafter = EagleDrafter.random(target, "reference", max_depth=tree.draft_depth, seed=3, target_layers=(0, 1))
    spec = kind != "plain"
    cfg = EngineConfig(mode="reference", max_context=max_context, prefill_chunk=16,
                       tree=tree if spec else None, verify_widths=(2, 4, 6) if spec else ())
    return Engine(target, cfg, drafter, eos_ids=(EOS,))


def workload(n: int, seed: int, sampling: bool, max_prompt: int = 40, max_new: int = 30):
    """``n`` requests: random prompts (some longer than a prefill chunk), lengths, arrival steps,
    some abandoned after a few steps, some plain on a speculative engine."""
    rng = random.Random(seed)
    reqs = []
    for i in range(n):
        prompt = [rng.randrange(4, VOCAB) for _ in range(rng.randint(1, max_prompt))]
        params = SamplingParams(rng.randint(1, max_new), 0.8 if sampling and i % 2 else 0.0, 0.9, seed=1000 + i)
        reqs.append(dict(key=i, prompt=prompt, params=params, arrive=rng.randint(0, 2) if i < 8 else rng.randint(0, 25),
                         leave=rng.randint(2, 12) if rng.random() < 0.2 else None, plain=rng.random() < 0.25))
    return reqs


def alone(kind: str, reqs, max_context: int, logits: dict | None = None) -> dict:
    """{key: (tokens, finish)} of every request decoded alone by ``Engine.generate``; ``logits``
    receives {key: [each verify call's logits [W_v, V]]}."""
    eng = engine(kind, max_context)
    out = {}
    for r in reqs:
        kw = {"policy": plain_policy(eng)} if kind != "plain" and r["plain"] else {}
        seen = []

        def verify(*args, real=stages.verify):
            res = real(*args)
            seen.append(res[0])
            return res

        with mock.patch.object(stages, "verify", verify):
            res = eng.generate(r["prompt"], r["params"], **kw)
        out[r["key"]] = (res.token_ids, res.finish_reason)
        if logits is not None:
            logits[r["key"]] = seen
    return out


def assert_same_logits(got: dict, want: dict, keys) -> None:
    """Every verify call of every request computed bitwise the logits it computes alone."""
    for k in keys:
        a_calls, b_calls = got.get(k, []), want.get(k, [])
        assert len(a_calls) <= len(b_calls)
        for i, (a, b) in enumerate(zip(a_calls, b_calls)):
            assert torch.equal(a, b), (k, i)


def batched(kind: str, reqs, max_batch: int, max_context: int, logits: dict | None = None):
    """Run ``reqs`` through a decoder: each joins at its arrival step (or later, when the batch is
    full) and leaves after ``leave`` steps if it has not finished. Returns {key: (tokens, finish)}
    and the largest batch seen; ``logits`` receives {key: [each verify call's logits [W_v, V]]}."""
    eng = engine(kind, max_context)
    dec = BatchDecoder(eng, max_batch)
    spy = contextlib.nullcontext()
    if logits is not None:
        real = dec._settle

        def settle(s, st):
            logits.setdefault(s.key, []).append(st.logits.clone())
            return real(s, st)

        def verify(*args, real=stages.verify):  # one request: the engine's own step
            res = real(*args)
            logits.setdefault(dec.slots[0].key, []).append(res[0])
            return res

        dec._settle = settle
        spy = mock.patch.object(stages, "verify", verify)
    pending = sorted(reqs, key=lambda r: r["arrive"])
    got, finish, steps_in, widest = {}, {}, {}, 0
    step = 0
    with spy:
        while pending or dec.running:
            widest = max(widest, run_step(dec, eng, kind, reqs, pending, got, finish, steps_in, step))
            step += 1
            assert step < 5000
    return {k: (got[k], finish[k]) for k in got}, widest


def run_step(dec, eng, kind, reqs, pending, got, finish, steps_in, step) -> int:
    """Admit the requests that arrived, drop those that leave now, run one step; the batch size
    the step ran at."""
    while pending and pending[0]["arrive"] <= step and dec.free:
        r = pending.pop(0)
        policy = plain_policy(eng) if kind != "plain" and r["plain"] else None
        dec.add(r["key"], r["prompt"], r["params"], policy)
        got[r["key"]], steps_in[r["key"]] = [], 0
    for r in reqs:
        k = r["key"]
        if k in steps_in and k not in finish and r["leave"] is not None and steps_in[k] >= r["leave"]:
            dec.remove(k)
            finish[k] = "left"
    running = dec.running
    for e in dec.step():
        assert e.error is None, e.error
        got[e.key] += e.tokens
        if e.finish is not None:
            finish[e.key] = e.finish
    for k in steps_in:
        steps_in[k] += 1
    return running


@pytest.mark.parametrize("kind,max_batch,sampling", sweep(
    ["plain", "spec", "eagle"], [1, 2, 4, 8], [False, True],
    unit=[("plain", 2, False), ("spec", 4, True), ("eagle", 8, False)]))
def test_every_request_of_a_batch_equals_its_decoding_alone(kind, max_batch, sampling):
    reqs = workload(12, seed=max_batch, sampling=sampling)
    want_logits, got_logits = {}, {}
    want = alone(kind, reqs, 320, want_logits)
    got, widest = batched(kind, reqs, max_batch, 320, got_logits)
    assert widest == max_batch  # the batch filled up
    assert_same_logits(got_logits, want_logits, [r["key"] for r in reqs])
    assert sum(map(len, got_logits.values())) > 50
    left = 0
    for r in reqs:
        tokens, finish = got[r["key"]]
        ref, ref_finish = want[r["key"]]
        if finish == "left":  # abandoned mid-run: what it got is the start of its decoding alone
            left += 1
            assert tokens == ref[: len(tokens)], r["key"]
        else:
            assert (tokens, finish) == (ref, ref_finish), r["key"]
    assert left > 0


def test_long_contexts_across_context_buckets():
    """Requests whose contexts lie in different attention buckets share verify calls."""
    reqs = workload(6, seed=7, sampling=False, max_prompt=250, max_new=40)
    for kind in ("plain", "spec"):
        want_logits, got_logits = {}, {}
        want = alone(kind, reqs, 600, want_logits)
        got, _ = batched(kind, reqs, 4, 600, got_logits)
        assert_same_logits(got_logits, want_logits, [r["key"] for r in reqs])
        for r in reqs:
            tokens, finish = got[r["key"]]
            ref, ref_finish = want[r["key"]]
            if finish == "left":
                assert tokens == ref[: len(tokens)]
            else:
                assert (tokens, finish) == (ref, ref_finish)


def test_batch_buckets():
    assert [batch_bucket(n, 8) for n in range(1, 9)] == [1, 2, 4, 4, 8, 8, 8, 8]
    assert [batch_bucket(n, 6) for n in range(1, 7)] == [1, 2, 4, 4, 6, 6]
    assert batch_bucket(3, 3) == 3


def test_refusals_are_one_line():
    eng = engine("spec")
    for bad in (0, 33, True, "4"):
        with pytest.raises(YggError, match="max-batch must be an integer") as e:
            BatchDecoder(eng, bad)
        assert "\n" not in str(e.value)
    dec = BatchDecoder(eng, 1)
    with pytest.raises(YggError, match="the prompt is empty"):
        dec.add("a", [], SamplingParams(4))
    dec.add("a", [5, 6], SamplingParams(4))
    with pytest.raises(YggError, match="the batch is full"):
        dec.add("b", [5, 6], SamplingParams(4))
    compiled = engine("plain")
    compiled.graphs.mode = "performance"
    with pytest.raises(YggError, match="needs its batched graphs"):
        BatchDecoder(compiled, 2)


def test_a_product_that_is_not_row_invariant_is_refused():
    class Skewed(torch.nn.Linear):  # rounds a row otherwise when others share the call
        def forward(self, x):
            y = super().forward(x)
            return y + (x.shape[0] > 1) * 1e-3

    model = tiled(tiny_model(VOCAB, 64, 1))
    check_rows_invariant(model, 48)
    model.lm_head = Skewed(64, VOCAB, bias=False)
    with pytest.raises(YggError, match="not row-invariant"):
        check_rows_invariant(model, 4)


def test_the_decoding_settings_are_held_while_requests_run_and_restored_when_the_batch_empties(monkeypatch):
    """The engine's thread count and library settings are taken at a step and kept across steps
    (not entered and left every step: the library's loop pool is a thread made and joined), and
    restored once the last request leaves, by finishing or by removal."""
    import contextlib

    entered = []

    @contextlib.contextmanager
    def library(self, threads):
        entered.append(threads)
        yield

    monkeypatch.setattr(Engine, "library", library)
    eng = engine("spec")
    eng.use_plan("sequential", threads=2)  # decodes at 2 threads, the caller at 1
    dec = BatchDecoder(eng, 2)
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        dec.add("a", [5, 6, 7], SamplingParams(6))
        dec.add("b", [8, 9], SamplingParams(30))
        steps = 0
        while any(s.key == "a" for s in dec.slots):
            dec.step()
            steps += 1
            assert torch.get_num_threads() == 2  # held between steps
        assert steps > 1 and entered == [2]  # entered once for all of them
        dec.remove("b")  # the last request leaves: restored
        assert torch.get_num_threads() == 1 and dec._held is None
        dec.add("c", [5, 6], SamplingParams(2))
        while dec.running:
            dec.step()
        assert torch.get_num_threads() == 1 and len(entered) == 2  # finished: restored, taken again next time
    finally:
        torch.set_num_threads(before)


def test_a_failing_request_leaves_the_others_running():
    eng = engine("spec")
    dec = BatchDecoder(eng, 2)
    dec.add("ok", [5, 6, 7], SamplingParams(20))
    dec.add("bad", [8, 9], SamplingParams(20))
    real = eng.drafter.head

    def head(root, committed, k):  # fails while the request "bad" runs its stages (its row bound)
        bad = next((s for s in dec.slots if s.key == "bad"), None)
        if bad is not None and eng.target.kv is dec.rows[bad.row]:
            raise RuntimeError("injected")
        return real(root, committed, k)

    eng.drafter.head = head
    got, errors, finish = [], [], None
    while dec.running:
        for e in dec.step():
            if e.error is not None:
                errors.append(e.key)
            elif e.key == "ok":
                got += e.tokens
                finish = e.finish or finish
    assert errors == ["bad"]
    eng.drafter.head = real
    want = engine("spec").generate([5, 6, 7], SamplingParams(20))
    assert (got, finish) == (want.token_ids, want.finish_reason)


def tiny_objective():
    """A profile whose verify curve is flat up to 12 rows and steep after, and a calibration
    where deeper, wider trees accept more: trees alone, plain steps in a full batch."""
    from yggtree.runtime.batch_objective import BatchObjective
    from yggtree.runtime.calibration import Calibration
    from yggtree.runtime.cost import CostModel, Curve

    def curve(ms_at):
        xs = tuple(float(w) for w in sorted(ms_at))
        ys = tuple(float(ms_at[w]) for w in sorted(ms_at))
        return Curve((256, 1024), (xs, xs), (ys, ys))

    verify = curve({1: 30, 6: 31, 12: 33, 24: 60, 48: 120})
    draft = curve({1: 2.0, 2: 2.1, 4: 2.2})
    head = curve({1: 2.0})
    stages = {"egt": {"1": 0.05}, "prune": {"4": 0.1}, "accept": 0.1, "commit": 0.1, "policy": 0.2,
              "plain_accept": 0.05}
    wvs = (2, 4, 6)
    calib = Calibration((0.0, 1.0), (0.0, 0.9),
                        {"2": [[1.0 + 0.3 * d + 0.1 * wv for wv in wvs] for d in (1, 2, 3)]}, wvs)
    return BatchObjective(CostModel(verify, draft, head, stages), calib, (2,), wvs, 3)


@pytest.mark.parametrize("kind", ["spec", "eagle"])
def test_batch_aware_trees_stay_lossless_and_fall_back_to_plain_steps(kind):
    """With the joint objective a request's trees change with the batch around it (trees alone,
    plain steps in a full batch), its greedy tokens never do. (Seeded sampling is the same
    distribution under any tree, not the same draws: its identity is tested on fixed trees.)"""
    reqs = workload(12, seed=3, sampling=False)
    want = alone(kind, reqs, 320)
    eng = engine(kind)
    dec = BatchDecoder(eng, 8, objective=tiny_objective())
    got, finish, drafted_by_batch = {}, {}, {}
    pending = list(reqs)
    while pending or dec.running:
        while pending and dec.free:
            r = pending.pop(0)
            policy = plain_policy(eng) if r["plain"] else None
            dec.add(r["key"], r["prompt"], r["params"], policy)
            got[r["key"]] = []
        n = sum(s.req is not None for s in dec.slots)  # requests in this step's verify call
        for e in dec.step():
            assert e.error is None, e.error
            got[e.key] += e.tokens
            if e.tokens and (e.drafted or e.verify_width == 1):
                drafted_by_batch.setdefault(n, []).append(e.drafted)
            if e.finish is not None:
                finish[e.key] = e.finish
    for r in reqs:
        assert (got[r["key"]], finish[r["key"]]) == want[r["key"]], r["key"]
    assert drafted_by_batch[8] and not any(drafted_by_batch[8])  # a full batch: plain steps only
    assert any(any(v) for n, v in drafted_by_batch.items() if n <= 2)  # few requests: trees

