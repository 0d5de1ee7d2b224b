"""``yggtree run``: generate text for a prompt.

With ``--plan``, the compiled plan's engine, steered by its latency objective when the plan names
a profile and a calibration. Without one, the default plan's settings fill the flags left unset,
and a compiled plan tuned for this device is taken when nothing else is asked (else the default
plan with a quick profile); engine flags alone make a plan in memory with one fixed tree. Every
engine is built from its plan the same way (runtime/build.py ``build_plan_engine``). The text
streams to stdout with a summary line on stderr, or comes as one JSON object (``--json``).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
from pathlib import Path

from .errors import YggError
from .offline.compile import prepare_run
from .plan import NON_PATH_MODELS, Plan, Sampling, validate_plan
from .quickstart import default_quick_start
from .runtime.device import detect_device
from .runtime.schedule import resolve_plan
from .shapes import (
    DEFAULT_DRAFT_DEPTH, DEFAULT_DRAFT_WIDTH, DEFAULT_VERIFY_WIDTH, KV_CACHE_DTYPES, TreeParams, check_sizes,
    kv_cache_dtype, weight_format,
)
from .streaming import TextStream


def _int_at_least(lo: int):
    """An argparse type: an integer >= ``lo``."""

    def parse(text: str) -> int:
        try:
            v = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
        if v < lo:
            raise argparse.ArgumentTypeError(f"must be >= {lo}, got {v}")
        return v

    return parse


_positive_int, _nonneg_int = _int_at_least(1), _int_at_least(0)


def _float(text: str) -> float:
    try:
        return float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--prompt", required=True, help="user message (wrapped in the chat template)")
    p.add_argument("--raw", action="store_true", help="send the prompt untouched (no chat template)")
    p.add_argument("--max-new-tokens", type=_positive_int, default=128)
    p.add_argument("--temperature", type=_float, default=0.0, help="0 = greedy")
    p.add_argument("--top-p", type=_float, default=1.0)
    p.add_argument("--seed", type=int, default=0)
    add_engine_arguments(p)
    p.add_argument("--json", action="store_true", help="print one JSON object instead of streaming")
    p.add_argument(
        "--trace", metavar="FILE", help="write a JSONL record per decode step (reference mode only)"
    )


def add_engine_arguments(p: argparse.ArgumentParser) -> None:
    """The flags that choose and build the engine (model, plan, format, drafter, tree), shared by
    ``yggtree run`` and ``yggtree serve``; :func:`build_from_args` builds from them."""
    p.add_argument("--model", default="default", help="default | HF directory | .gguf file")
    p.add_argument("--dtype", choices=["float32", "bfloat16"], default=None,
                   help="default: the default plan's (float32)")
    p.add_argument("--weights", default=None,
                   help="float32 | bfloat16 | int8 | int4 | int4@G | gguf-native | w4a8: the format of "
                   "the block linears and LM heads (default: float in --dtype; runtime/quant.py, "
                   "runtime/w4a8.py)")
    p.add_argument("--drafter-weights", default=None,
                   help="the drafter's own weight format (any --weights value; default: the target's): "
                   "a float target verifies what a quantized drafter proposes, its output unchanged")
    p.add_argument("--kv-cache", choices=KV_CACHE_DTYPES, default=None,
                   help="the target's KV cache dtype: float16 or bfloat16 under float32 activations "
                   "halves attention's reads at long contexts (an approximation, as a weight format is); "
                   "default: in --dtype")
    p.add_argument("--mode", choices=["reference", "performance"], default="performance")
    p.add_argument("--max-context", type=_positive_int, default=None,
                   help="default: the default plan's (1024)")
    p.add_argument("--prefill-chunk", type=_positive_int, default=None,
                   help="default: the default plan's (64)")
    p.add_argument(
        "--drafter",
        default=None,
        help="self | HF directory | .gguf | EAGLE head directory | none (default: plain decoding; "
        "none with --lookup N: lookup-only speculation)",
    )
    p.add_argument(
        "--lookup",
        type=_nonneg_int,
        default=None,
        help="at most N lookup nodes per step: continuations of the prompt and the text generated so "
        "far join the drafter's tree (0 disables; <= the verify width; default: the plan's, 0, or on "
        "this machine's plan the count its objective measured fastest with)",
    )
    p.add_argument("--no-speculate", action="store_true", help="plain decoding even with a drafter")
    p.add_argument("--speculate", action="store_true",
                   help="this machine's plan speculates even where it measured its plain steps faster")
    p.add_argument("--draft-width", type=_positive_int, default=None, help=f"W_d (default {DEFAULT_DRAFT_WIDTH})")
    p.add_argument("--draft-depth", type=_positive_int, default=None, help=f"D (default {DEFAULT_DRAFT_DEPTH})")
    p.add_argument("--verify-width", type=_positive_int, default=None, help=f"W_v (default {DEFAULT_VERIFY_WIDTH})")
    p.add_argument(
        "--stages",
        default="auto",
        help="execution plan of a decode step: auto (default: the plan's recorded one, or its "
        "compile-time search's choice for a plan with stages: auto; else sequential) | sequential | "
        "ahead (ahead-of-time tail and head draft) | overlap (the drafter on its own worker while "
        "the target verifies); a thread split may follow: sequential@2, overlap@1+1 (target + "
        "drafter threads)",
    )
    p.add_argument("--threads", type=_nonneg_int, default=0,
                   help="intra-op threads while decoding (0: torch's default; at most the cores)")
    p.add_argument("--top-k", type=_positive_int, default=None, help="default: the default plan's (4)")
    p.add_argument(
        "--depth",
        default="auto",
        help="with --plan: draft depth D per step; auto (default) = the plan's depth predictor if it "
        "names one, else the latency objective's choice; N = always N drafter calls (1..d_max)",
    )
    p.add_argument(
        "--plan",
        metavar="PLAN_YAML",
        help="run a compiled plan (its model, drafter, dtype, context and graphs); widths must be "
        "in its compiled sets. Default: a plan tuned for this device and --dtype if one is "
        "compiled (in ~/.local/share/yggtree/profiles/, or a checkout's profiles/), else the "
        "default plan (yggtree/plans/default.yaml), which decodes "
        "plainly on a device it has no latency profile for",
    )
    p.add_argument(
        "--no-feedback",
        action="store_true",
        help="with --plan: the objective uses its offline profile and calibration only, without "
        "correcting them from the measured steps",
    )
    p.add_argument(
        "--compile-missing",
        action="store_true",
        help="with --plan: compile missing or stale artifacts instead of refusing",
    )


def add_parser(subparsers) -> argparse.ArgumentParser:
    """``run`` on a CLI's subparsers (help line, flags), handled by :func:`run`."""
    p = subparsers.add_parser("run", help="generate text for a prompt")
    add_arguments(p)
    p.set_defaults(func=run)
    return p


def run(args) -> int:
    """The ``run`` subcommand: checks every flag before loading, builds the engine, generates."""
    from .runtime.engine import SamplingParams
    from .runtime.loading import encode_prompt

    try:
        args.prompt.encode("utf-8")  # undecodable argv bytes arrive as lone surrogates
    except UnicodeEncodeError as e:
        raise YggError(f"the prompt is not valid UTF-8 (undecodable byte at position {e.start})") from None
    if not args.prompt.strip():
        raise YggError("the prompt is empty")
    params = SamplingParams(args.max_new_tokens, args.temperature, args.top_p, args.seed)
    params.validate()
    if args.trace and args.mode != "reference":
        raise YggError("--trace needs --mode reference")
    engine, tok, policy = build_from_args(args)
    ids = encode_prompt(tok, args.prompt, raw=args.raw)
    mp = getattr(args, "machine", None)  # this machine's plan (yggtree.machine_plan), if the run took it
    learnt = _learnt_feedback(args, mp, policy)
    # its build, if it runs in the background: paused while this run decodes
    with open_trace(args.trace) as trace, mp.paused() if mp else contextlib.nullcontext():
        code = _generate(args, engine, tok, ids, params, trace, policy)
    if learnt is not None:
        mp.keep_learnt(learnt, policy.feedback.learnt())
    return code


def _learnt_feedback(args, mp, policy) -> str | None:
    """On this machine's plan, the objective's feedback continues from what earlier runs learnt
    on its profile; returns the profile's sha256 to keep this run's under (None: nothing kept)."""
    feedback = getattr(policy, "feedback", None)
    if mp is None or feedback is None or getattr(args, "machine_build", None) != "done":
        return None
    sha = args.profile_sha
    record = mp.learnt(sha) if sha else None
    if record is not None:
        policy.feedback = feedback.with_learnt(record)
    return sha


def build_from_args(args):
    """(engine, tokenizer, policy or None) from the engine flags (:func:`add_engine_arguments`),
    every flag checked before the model loads. Every engine is built from a plan by one function
    (runtime/build.py ``build_plan_engine``): a compiled plan (``--plan``), else the default plan's
    settings with a tuned plan or the quick start when nothing else is asked, else the plan the
    flags describe (:func:`flags_plan`, in memory: one fixed tree)."""
    resolve_plan(args.stages, True, threads=args.threads)  # a bad plan is refused before loading
    if args.depth != "auto" and not args.plan:
        raise YggError("--depth needs --plan (without a plan, --draft-depth sets a fixed tree)")
    if args.depth != "auto" and args.draft_depth is not None:
        raise YggError("--depth and --draft-depth exclude each other (--depth keeps the objective's "
                       "widths, --draft-depth fixes the whole tree)")
    if args.drafter == "none":  # lookup-only speculation with --lookup N, else plain decoding
        if args.plan:
            raise YggError("--drafter none and --plan exclude each other (a plan names its drafter)")
        args.drafter, args.drafter_none = None, True
    if args.weights is not None and args.plan:
        raise YggError("--weights and --plan exclude each other (a plan names its format: its 'weights' key)")
    if args.drafter_weights is not None and args.plan:
        raise YggError("--drafter-weights and --plan exclude each other (a plan names its drafter's format: "
                       "its 'drafter_weights' key)")
    if args.kv_cache is not None and args.plan:
        raise YggError("--kv-cache and --plan exclude each other (a plan names its cache: its 'kv_cache' key)")
    if args.speculate and args.no_speculate:
        raise YggError("--speculate and --no-speculate exclude each other")
    if not args.plan:
        _pick_plan(args)
    if getattr(args, "quick", None) is not None:  # speculation by default
        args.ran_weights = args.quick.plan.weights or args.quick.plan.dtype
        return args.quick.engine()
    if args.plan:
        from .compiled import artifact_dir

        plan = prepare_run(args.plan, args.compile_missing)
        args.ran_weights = plan.weights or plan.dtype
        return _plan_engine(args, plan, artifact_dir(plan) if plan.backend != "eager" else None)
    plan = flags_plan(args)
    args.ran_weights = args.weights or args.dtype  # as the flag names it
    return _plan_engine(args, plan, flags=True)


def flags_plan(args) -> Plan:
    """The plan a run's engine flags describe, made in memory (no ``--plan``, no tuned plan or
    quick start taken): the model, drafter, dtype, weight format, KV cache dtype, context and
    prefill chunk the flags name (the default plan's where unset: :func:`_pick_plan`) and, where
    its engine verifies trees (a drafter, or lookup nodes alone), the one tree W_d, D, W_v, k of
    the tree flags (yggtree.shapes' defaults where unset) as its only widths and its lookup
    nodes; ``--no-speculate`` makes a plain plan. The flags are checked first in the lines that
    name them, then by the plan schema as a plan file is (:func:`yggtree.plan.validate_plan`)."""
    from .runtime.loading import resolve_model

    drafter = None if args.no_speculate else args.drafter or None
    lookup = 0 if args.no_speculate or args.lookup is None else args.lookup
    tree_flags = _tree_flags(args)
    if tree_flags and not args.no_speculate and drafter is None and not lookup:
        if args.model != "default" or getattr(args, "drafter_none", False):
            verb = "shape" if len(tree_flags) > 1 else "shapes"
            raise YggError(f"{' and '.join(tree_flags)} {verb} a speculative tree, but nothing drafts it: "
                           "add --drafter (an EAGLE head, self, a model) or --lookup N")
        drafter = "default"  # the embedded model's shipped EAGLE head
    if args.drafter_weights is not None:
        try:
            weight_format(args.drafter_weights, args.dtype)
        except YggError as e:
            raise YggError(f"--drafter-weights: {e}") from None
        if not args.no_speculate and drafter is None:  # a drafter's format asks for a drafter, as a tree does
            if args.model != "default" or getattr(args, "drafter_none", False):
                raise YggError("--drafter-weights names the drafter's format, but nothing drafts: "
                               "add --drafter (an EAGLE head or a model)")
            drafter = "default"
    # lookup-only: by default the verify width holds the root and the N lookup nodes, no more
    wv = args.verify_width or (min(lookup + 1, DEFAULT_VERIFY_WIDTH) if lookup and not drafter
                               else DEFAULT_VERIFY_WIDTH)
    tree = TreeParams(args.draft_width or DEFAULT_DRAFT_WIDTH, args.draft_depth or DEFAULT_DRAFT_DEPTH,
                      wv, args.top_k)
    verifies = drafter is not None or lookup > 0
    if verifies:
        tree.validate()
    _check_lookup(lookup, tree.verify_width)
    check_sizes(args.max_context, args.prefill_chunk, tree if drafter else None)
    kv_cache_dtype(args.kv_cache, args.dtype)
    weight_format(args.weights, args.dtype)
    resolve_model(args.model)  # a model that is not there, in loading's words
    if drafter not in (None, *NON_PATH_MODELS["drafter"]) and not Path(drafter).expanduser().exists():
        raise YggError(f"model path does not exist: {Path(drafter).expanduser()}")
    raw = {"name": "flags", "target": args.model, "drafter": drafter, "dtype": args.dtype,
           "weights": args.weights, "drafter_weights": args.drafter_weights if drafter else None,
           "kv_cache": args.kv_cache, "max_context": args.max_context,
           "prefill_chunk": args.prefill_chunk,
           # a plan's sampling defaults, valid at any context (a run samples by its own flags)
           "sampling": {"max_new_tokens": min(Sampling.max_new_tokens, args.max_context - 1)}}
    if verifies:
        raw |= {"draft_widths": [tree.draft_width], "d_max": tree.draft_depth,
                "verify_widths": [tree.verify_width], "top_k": tree.top_k, "lookup": lookup}
    return validate_plan(raw, origin="the run's flags", lookup_only=True)


def _tree_flags(args) -> list[str]:
    """The tree flags the run names (``--draft-width``, ``--draft-depth``, ``--verify-width``): one fixed tree."""
    return [f"--{f.replace('_', '-')}" for f in ("draft_width", "draft_depth", "verify_width")
            if getattr(args, f) is not None]


def _pick_plan(args) -> None:
    """Without --plan: the default plan's settings fill the flags left unset, and when the run
    asks for nothing but the embedded default (no model, format, cache or context flags; no
    drafter but the default), a compiled plan tuned for this device and dtype
    (``yggtree.tuned.find_tuned_plan``) is used instead, else this machine's own plan: they
    speculate by their measured latency objective, or with tree flags by that one fixed tree
    (:func:`_machine_tree_plan`). With neither, the quick start times the default plan here."""
    from .plan import default_plan
    from .tuned import find_tuned_plan

    base = default_plan()
    shaped = (args.max_context, args.prefill_chunk, args.top_k) != (None,) * 3  # flags a plan would otherwise decide
    tree = bool(_tree_flags(args))  # one fixed tree
    for flag, value in (("dtype", base.dtype), ("max_context", base.max_context),
                        ("prefill_chunk", base.prefill_chunk), ("top_k", base.top_k)):
        if getattr(args, flag) is None:
            setattr(args, flag, value)
    # --no-speculate keeps what the default would run (its plan's graphs, plainly): compared like for like
    only_defaults = (args.model == "default" and args.drafter in (None, "default")
                     and args.mode == "performance" and not shaped and args.weights is None
                     and args.drafter_weights is None
                     and args.kv_cache is None
                     and not getattr(args, "drafter_none", False))
    if not only_defaults:
        return
    device = detect_device()
    passed_over = []  # a namesake device's tuned plan: said only where no plan of this machine's runs
    ready, waiting = find_tuned_plan(args.dtype, device, say=passed_over.append)
    if ready is not None:
        sys.stderr.write(f"yggtree: plan {ready} (tuned for this {device['kind']}, {args.dtype})\n")
        args.plan = str(ready)
        args.no_default_note = None
        return
    if tree:  # a fixed tree: this machine's plan where it is built and compiles the tree, else the flags' plan
        _machine_tree_plan(args, device)
        return
    if _machine_plan(args, device, waiting):
        return
    for line in passed_over:
        sys.stderr.write(f"yggtree: {line}\n")
    if args.no_speculate:
        return
    import torch  # no compiled tuned plan: the default plan with a quick profile (yggtree.quickstart)

    compile_hint = waiting and f"`yggtree compile {waiting}` once to speculate with the plan tuned for it"
    args.quick, why = default_quick_start(args.dtype, device, torch.get_num_threads(), compile_hint)
    args.no_default_note = (f"plan {waiting} is tuned for this {device['kind']} but not compiled: "
                            f"{compile_hint}" if waiting is not None else
                            why and f"no tuned plan for this {device['kind']} in {args.dtype}: {why}")


def _machine_tree_plan(args, device: dict) -> None:
    """The tree flags' fixed tree on this machine's plan where it is built and compiles the
    tree's widths (``args.plan`` set); else nothing is set and the flags' own plan runs, with one
    line saying why where the plan is built but compiles other widths."""
    import torch

    from . import machine_plan
    from .plan import load_plan

    if not machine_plan.enabled():
        return
    mp = machine_plan.machine_plan(device, args.threads or torch.get_num_threads())
    path, _ = mp.ready_plan()
    if path is None:
        return
    plan = load_plan(path)
    try:
        plan.tree_params(args.draft_width, args.verify_width, args.draft_depth)
    except YggError as e:
        sys.stderr.write(f"yggtree: this machine's plan {path} does not compile this tree ({e}): "
                         "the flags' own plan runs, float32 and compiled now\n")
        return
    sys.stderr.write(f"yggtree: this machine's plan {path} ({mp.weights or 'float32'} weights, compiled here), "
                     "one fixed tree\n")
    args.plan, args.machine_build = str(path), "done"


def _machine_plan(args, device: dict, waiting) -> bool:
    """Without a tuned plan: this machine's own compiled plan (yggtree.machine_plan) when it is
    built; else plain decoding that compiles nothing now, its build started in the background.
    False where the background build is turned off (the quick start then runs)."""
    import torch

    from . import machine_plan

    if waiting is not None or not machine_plan.enabled():
        return False
    mp = machine_plan.machine_plan(device, args.threads or torch.get_num_threads())
    args.machine = mp
    path, why = mp.ready_plan()
    args.no_default_note = None
    if path is not None:
        args.profile_sha = machine_plan.profile_sha(path)  # its feedback and verdict are kept under it
        verdict = mp.speculates(args.profile_sha)
        busy = mp.unsettled(path) if verdict is not None else None
        # its verdict not measured yet (measured), or a measurement taken while busy (taken again)
        if (verdict is None or busy) and not mp.building():
            try:
                mp.start()
            except OSError:
                pass
        how = "latency objective on its own profile"
        # `yggtree serve`'s flags carry no sampling (each request brings its own): the greedy verdict
        sampled = getattr(args, "temperature", 0.0) > 0
        pays, ratio = verdict.for_requests(sampled) if verdict is not None else (True, 0.0)
        if not pays and not (args.speculate or args.no_speculate):
            args.no_speculate = True  # measured: plain steps are faster here than keeping the objective's option
            how = (f"plain steps: its latency objective decoded {'sampled requests ' if sampled else ''}at "
                   f"{ratio:.2f}x their speed here; --speculate to use it")
        elif verdict is not None and not args.no_speculate and args.lookup is None:
            args.lookup = verdict.lookup  # the lookup count its objective was fastest with here
            how += f", {verdict.lookup} lookup nodes a step" if verdict.lookup else ""
        sys.stderr.write(f"yggtree: this machine's plan {path} ({mp.weights or 'float32'} weights, compiled "
                         f"here, {how}"
                         f"{f'; {busy.line}: measuring it again in the background' if busy else ''})\n")
        args.plan, args.machine_build = str(path), "done"
        return True
    args.machine_build = "failed" if mp.failed() is not None else "pending"
    try:
        line = mp.start()
    except OSError as e:
        line = f"this machine's plan cannot be built in {mp.root} ({e.strerror or e})"
        args.machine_build = "unbuildable"
    if why != machine_plan.NOT_BUILT:  # built once, no longer usable (a damaged package, new code)
        line = f"this machine's plan is stale ({why}): {line}"
    sys.stderr.write(f"yggtree: {line}; meanwhile plain decoding, uncompiled\n")
    args.mode = "reference"  # eager: nothing to compile before the first token (every core: the
    # build runs only on CPU time the run leaves idle, machine_plan._yield_to_runs)
    return True


def _plan_engine(args, plan: Plan, art=None, flags: bool = False):
    """(engine, tokenizer, policy or None) of ``plan`` as the run's flags ask: a plan file's (its
    compiled artifacts ``art``) steered by its latency objective and depth predictor, else one
    choice of its widths; or the plan of the run's flags (``flags``: its one tree, no policy, its
    product kernel measured for this engine in performance mode)."""
    from .runtime.build import build_plan_engine, fixed_policy
    from .runtime.objective import plan_policy

    mode = "reference" if args.mode == "reference" else None
    fixed = bool(_tree_flags(args))
    depth = _depth_flag(args.depth, plan)
    policy = (None if fixed or args.no_speculate  # checked before loading
              else plan_policy(plan, feedback=not args.no_feedback))
    if policy is None and plan.predictor is not None and not (fixed or args.no_speculate):
        raise YggError(f"plan {plan.name!r} names a depth predictor but no profile and calibration: "
                       "choosing a depth needs the latency objective")
    # without an objective, --depth N is the depth of one fixed tree
    draft_depth = args.draft_depth if policy is not None or depth is None else depth
    lookup = 0 if args.no_speculate else (plan.lookup if args.lookup is None else args.lookup)
    if lookup and not plan.verifies:
        raise YggError(f"--lookup {lookup}: plan {plan.name!r} has no drafter and compiles no verify "
                       "widths (lookup-only decoding: --drafter none --lookup N without a plan)")
    _check_lookup(lookup, max(plan.verify_widths) if plan.verifies else 1)
    products = {}
    if flags:  # the kernel this CPU runs fastest, measured once (reference mode: oneDNN's, unpadded)
        from .measure.kernel_choice import measured_spec

        products = {"kernel": "torch", "min_rows": 1,
                    "measure": measured_spec if args.mode == "performance" else None}
    engine, tok = build_plan_engine(plan, art, mode, stages=args.stages, threads=args.threads,
                                    speculate=not args.no_speculate, reserve=getattr(args, "reserve", None),
                                    **products)
    if engine.drafter is not None:
        engine.set_lookup(lookup)
    if policy is not None:
        from .runtime.predictor import policy_with_predictor

        if depth is None:
            policy = policy_with_predictor(plan, policy, hidden_size=engine.target.cfg.hidden_size)
        else:
            policy = policy.fresh(depth_fn=lambda h_root, committed: depth)
    if engine.drafter is not None and not args.no_speculate and policy is None and not flags:
        policy = fixed_policy(engine, plan, args.draft_width, args.verify_width, draft_depth)
    return engine, tok, policy


def _depth_flag(text: str, plan) -> int | None:
    """``--depth``: None for auto, else N checked against the plan's 1..d_max."""
    if text == "auto":
        return None
    try:
        d = int(text)
    except ValueError:
        raise YggError(f"--depth must be auto or an integer, got {text!r}") from None
    if not plan.speculative:
        raise YggError(f"--depth {d}: plan {plan.name!r} has no drafter")
    if not 1 <= d <= plan.d_max:
        raise YggError(f"--depth {d} is outside the plan's 1..d_max ({plan.d_max})")
    return d


def _check_lookup(n: int, verify_width: int) -> None:
    """``--lookup N``: at most the verify width (the root and N - 1 lookup nodes fill it)."""
    if n > verify_width:
        raise YggError(f"--lookup {n} exceeds the verify width ({verify_width})")


@contextlib.contextmanager
def open_trace(path: str | None):
    """A callable writing one JSON line per record to ``path`` (None: no trace)."""
    if path is None:
        yield None
        return
    try:
        f = open(path, "x")  # never overwrite a user's file
    except FileExistsError:
        raise YggError(f"trace file already exists: {path}") from None
    except OSError as e:
        raise YggError(f"cannot write trace file {path}: {e.strerror}") from None
    with f:
        yield lambda rec: f.write(json.dumps(rec) + "\n")


def _generate(args, engine, tok, ids, params, trace, policy=None) -> int:
    steps: dict[str, int] = {}

    def on_step(rec) -> None:  # how often each (D, W_d, W_v) ran
        d = rec.choice.draft_depth
        key = f"{d},{rec.choice.draft_width if d else 0},{rec.verify_width}"
        steps[key] = steps.get(key, 0) + 1

    kw = {"policy": policy, "on_step": on_step} if policy is not None else {}
    kv = getattr(engine.target, "kv_dtype", None)  # None: the activations' dtype
    ran = {"weights": getattr(args, "ran_weights", None), "speculative": engine.drafter is not None,
           "lookup": engine.cfg.lookup,  # lookup nodes a step (0: none)
           "kv_cache": str(kv).removeprefix("torch.") if kv is not None else None}
    if getattr(args, "machine_build", None):
        ran["machine_build"] = args.machine_build  # this machine's plan: pending (building) | blocks | done | unbuildable | failed
    if args.json:
        res = engine.generate(ids, params, trace=trace, **kw)
        res.stats.update(ran)
        if policy is not None:
            res.stats["steps_by_choice"] = dict(sorted(steps.items()))
            log = getattr(policy, "log", None)  # the objective's prediction of every step
            if log:
                from .runtime.prediction import predicted_speedup

                res.stats["predicted_speedup"] = round(predicted_speedup(log), 4)
        from .runtime.allocator import running

        res.stats["allocator"] = running()  # runtime/allocator.py: the one this process runs on
        text = tok.decode(res.token_ids, skip_special_tokens=True)
        obj = {
            "text": text,
            "token_ids": res.token_ids,
            "prompt_token_ids": res.prompt_token_ids,
            "finish_reason": res.finish_reason,
            "stats": res.stats,
        }
        print(json.dumps(obj))
        return 0
    stream = TextStream(tok, sys.stdout)
    res = engine.generate(ids, params, on_tokens=stream.push, trace=trace, **kw)
    stream.close()
    s = res.stats
    what = f"{ran['weights']}, " if ran["weights"] else ""
    what += f"{ran['kv_cache']} KV cache, " if ran["kv_cache"] else ""
    what += f"speculative, aal {s['aal']:.2f}" if "aal" in s else "plain"
    what += f", lookup {ran['lookup']}" if ran["lookup"] and "aal" in s else ""
    note = getattr(args, "no_default_note", None)
    if note and "aal" not in s:
        what += f" ({note})"
    build = {"pending": ", this machine's plan: building in the background",
             "done": ", this machine's plan",
             "unbuildable": ", this machine's plan: cannot be built here",
             "failed": ", this machine's plan: its build failed (see above)"}.get(ran.get("machine_build"), "")
    sys.stderr.write(
        f"[{s['new_tokens']} tokens, decode {s['decode_tokens_per_s']:.1f} tok/s, ttft {s['ttft_ms']:.0f} ms, "
        f"{what}, compile {s['compile_s']:.1f} s{build}, finish: {res.finish_reason}]\n"
    )
    return 0
