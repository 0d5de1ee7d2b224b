"""`yggtree run`'s engine flags as a plan (run_cmd.flags_plan): the flags left unset take the default
plan's settings and yggtree.shapes' tree, the plan is the schema's (plan.validate_plan) and goes to
the engine as every plan does (runtime/build.py build_plan_engine); a bad flag is one line."""

from __future__ import annotations

import pytest

import yggtree.run_cmd as run_cmd
from yggtree.cli import build_parser, main
from yggtree.errors import YggError
from yggtree.plan import validate_plan
from yggtree.runtime.build import EngineSpec, shipped_table
from yggtree.runtime.engine import EngineConfig
from yggtree.shapes import TreeParams


@pytest.fixture
def plan_of(monkeypatch):
    """``plan_of(*flags)``: the plan ``yggtree run --prompt hi FLAGS`` builds its engine from
    (nothing loads: the engine is not built)."""
    seen = []
    monkeypatch.setattr(run_cmd, "_plan_engine",
                        lambda args, plan, art=None, flags=False: seen.append((plan, flags)) or (None, None, None))

    def plan_of(*flags):
        seen.clear()
        run_cmd.build_from_args(build_parser().parse_args(["run", "--prompt", "hi", *flags]))
        (plan, from_flags), = seen
        assert from_flags
        return plan

    return plan_of


def engine_config(plan) -> EngineConfig:
    """The EngineConfig of ``plan``'s engine (a run's flags: the kernel measured later)."""
    return EngineSpec.from_plan(plan, kernel="torch", min_rows=1).config()


def test_a_tree_and_a_weight_format(plan_of):
    plan = plan_of("--weights", "int8", "--drafter", "self", "--draft-width", "1", "--draft-depth", "3",
                   "--verify-width", "4", "--top-k", "4")
    assert plan == validate_plan({"name": "flags", "target": "default", "drafter": "self", "weights": "int8",
                                  "draft_widths": [1], "d_max": 3, "verify_widths": [4], "top_k": 4})
    # the default plan's dtype, context and prefill chunk where no flag names them
    assert (plan.dtype, plan.max_context, plan.prefill_chunk, plan.stages) == ("float32", 1024, 64, "sequential")
    assert engine_config(plan) == EngineConfig(mode="performance", max_context=1024, prefill_chunk=64,
                                               tree=TreeParams(1, 3, 4, 4), draft_widths=(1,), verify_widths=(4,),
                                               static_lookup=shipped_table("default"))  # the embedded model's


def test_plain_runs_hold_no_tree(plan_of):
    plan = plan_of("--weights", "int4", "--max-context", "64", "--dtype", "bfloat16", "--kv-cache", "bfloat16",
                   "--draft-depth", "1000", "--no-speculate")  # a tree flag of a plain run is not used (nor checked)
    assert (plan.drafter, plan.weights, plan.dtype, plan.kv_cache, plan.max_context) == (
        None, "int4@32", "bfloat16", None, 64)
    assert not plan.verifies and plan.sampling.max_new_tokens == 63  # a valid plan at any context
    assert engine_config(plan).tree is None
    plain = plan_of("--drafter", "self", "--no-speculate", "--lookup", "2", "--draft-width", "2")
    assert (plain.drafter, plain.lookup, plain.verifies) == (None, 0, False)


def test_tree_flags_on_the_embedded_model_draft_with_its_shipped_head(plan_of):
    """Tree flags name no drafter: on the embedded model its shipped head drafts the tree; on another
    model they are one error line (tests/test_lookup_cli.py)."""
    plan = plan_of("--weights", "int4", "--draft-depth", "2", "--verify-width", "4")
    assert (plan.drafter, plan.d_max, plan.verify_widths) == ("default", 2, (4,))
    with pytest.raises(YggError, match="draft-depth 1000 exceeds the limit"):  # checked, as any tree
        plan_of("--weights", "int4", "--draft-depth", "1000")


def test_lookup_only(plan_of):
    plan = plan_of("--drafter", "none", "--lookup", "3")
    assert (plan.drafter, plan.lookup, plan.verify_widths, plan.verifies) == (None, 3, (4,), True)
    cfg = engine_config(plan)
    assert (cfg.tree, cfg.lookup, cfg.verify_widths) == (TreeParams(4, 4, 4, 4), 3, (4,))
    with pytest.raises(YggError, match="a plan without a drafter"):  # a plan file never holds one
        validate_plan({"name": "x", "target": "default", "lookup": 3, "verify_widths": [4]})


def test_the_engine_of_the_flags_plan(monkeypatch):
    """The flags' plan goes to build_plan_engine as a plan file's does, with the run's own stage
    plan, its product kernel measured for it in performance mode, and no policy (one fixed tree)."""
    seen = []

    class Engine:
        drafter = None

    monkeypatch.setattr("yggtree.runtime.build.build_plan_engine",
                        lambda plan, art, mode, **kw: seen.append((plan, art, mode, kw)) or (Engine(), None))
    for mode in ("reference", "performance"):
        args = build_parser().parse_args(["run", "--prompt", "hi", "--drafter", "self", "--stages", "ahead",
                                          "--mode", mode])
        _, _, policy = run_cmd.build_from_args(args)
        (plan, art, got_mode, kw), = seen
        assert (plan.stages, art, got_mode, policy) == ("sequential", None, mode if mode == "reference" else None,
                                                        None)
        assert (kw["stages"], kw["kernel"], kw["min_rows"]) == ("ahead", "torch", 1)
        assert (kw["measure"] is None) == (mode == "reference") and args.ran_weights == "float32"
        seen.clear()


def run_line(capsys, *flags) -> str:
    """The error line of ``yggtree run FLAGS`` (exit code 1, nothing on stdout)."""
    code = main(["run", "--prompt", "hi", "--max-new-tokens", "4", *flags])
    cap = capsys.readouterr()
    assert code == 1 and cap.out == ""
    return cap.err


@pytest.mark.parametrize("flags,line", [
    (["--drafter", "self", "--verify-width", "40"],
     "verify-width 40 exceeds the drafted tree (1 + draft-width 4 x draft-depth 4 = 17 nodes)"),
    (["--weights", "int9"], "unknown weight format 'int9' (choose from"),
    (["--model", "/no/such/model"], "model path does not exist: /no/such/model"),
    (["--drafter", "/no/such/drafter"], "model path does not exist: /no/such/drafter"),
    (["--drafter", "none", "--lookup", "17"], "--lookup 17 exceeds the verify width (16)"),
    (["--drafter", "self", "--max-context", "1"], "max-context must be >= 2, got 1"),
])
def test_a_bad_flag_is_one_line(monkeypatch, capsys, flags, line):
    import yggtree.runtime.loading as loading

    monkeypatch.setattr(loading, "load_model", lambda *a, **k: pytest.fail("a model was loaded"))
    err = run_line(capsys, *flags)
    assert err.startswith(f"yggtree: error: {line}") and err.count("\n") == 1, err


def test_the_schema_checks_what_the_flags_do_not(monkeypatch, capsys, tmp_path):
    """gguf-native needs a GGUF target: the plan schema's line, before anything loads."""
    (tmp_path / "config.json").write_text("{}")
    err = run_line(capsys, "--model", str(tmp_path), "--weights", "gguf-native")
    assert err == (f"yggtree: error: the run's flags: key 'weights': gguf-native needs a GGUF target, {tmp_path} "
                   "is not one (use int8 or int4)\n")
