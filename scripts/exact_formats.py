"""Is speculative decoding token-for-token plain decoding in every weight format? (issue #20)

For each ``--formats`` entry: the plain engine and the speculative engine (``--drafter``, fixed
tree ``--spec-tree``), both as ``yggtree run --weights FMT`` builds them (compiled, one plan's
padding for both: the fastest padding of packed float products that is batch-invariant at
widths 1 and W_v, measured here as a plan's profile chooses it), greedy on the same prompts (``--prompts N``: N MT-Bench first turns and N
HumanEval prompts, chat template applied, as scripts/bench_formats.py), over a float32 KV cache or
a 16-bit one (``--kv-cache``, float32-activation formats). Prints per format how many
prompts are identical and the first differing position of the others; one JSON line at the end;
exit code 1 if any prompt differs. No timing: scripts/bench_formats.py measures speed.

    python scripts/exact_formats.py --formats bfloat16,int8,int4,gguf-native --prompts 10 \\
        --max-new-tokens 128 --threads 1

``--plan PATH`` (repeatable) checks compiled plans instead, on the packages ``yggtree run --plan``
runs: the plan's plain decoding (``--no-speculate``: no drafter) against its speculative decoding
with every (D, W_d, W_v) of the plan in turn, one per step (:class:`EveryTree`), so every whole
verify step and drafter-call package of the plan is exercised.
"""

from __future__ import annotations

import argparse
import json
import sys

from yggtree.errors import YggError, run_reporting


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="default")
    p.add_argument("--drafter", default="default")
    p.add_argument("--formats", default="float32,bfloat16,int8,int4,gguf-native,w4a8")
    p.add_argument("--quant-dtype", default="float32", choices=("float32", "bfloat16"))
    p.add_argument("--spec-tree", default="8,6,32,8", metavar="W_d,D,W_v,k")
    p.add_argument("--prompts", type=int, default=10)
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--max-context", type=int, default=1024)
    p.add_argument("--kv-cache", default=None, choices=("float16", "bfloat16"),
                   help="the target's KV cache for the float32-activation formats (default: float32)")
    p.add_argument("--plan", action="append", metavar="PATH",
                   help="check this compiled plan's packages instead of --formats (repeatable)")
    p.add_argument("--out", metavar="FILE", help="also write the JSON record here")
    return p.parse_args(argv)


def first_difference(a: list[int], b: list[int]) -> int | None:
    """Index of the first differing token (the shorter length if one is a prefix), None if equal."""
    if a == b:
        return None
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


class EveryTree:
    """A step policy taking the plan's trees (D, W_d, W_v) in turn, one per step (made lazily: the
    policy base class needs torch)."""

    @staticmethod
    def of(plan):
        from yggtree.runtime.policy import StepChoice, StepPolicy

        class _EveryTree(StepPolicy):
            def __init__(self) -> None:
                self.trees = [(d, wd, wv) for d in range(1, plan.d_max + 1) for wd in plan.draft_widths
                              for wv in plan.verify_widths if wv <= 1 + d * wd]
                self.i, self.used = 0, set()

            def choose_draft(self, h_root, committed):
                d, wd, _ = self.trees[self.i % len(self.trees)]
                return StepChoice(d, wd)

            def choose_verify(self, tree, choice, committed):
                wv = self.trees[self.i % len(self.trees)][2]
                self.used.add(self.trees[self.i % len(self.trees)])
                self.i += 1
                return wv

        return _EveryTree()


def run_plans(args, prompts, sp) -> dict:
    """Speculative = plain decoding on each compiled plan's packages (see the module docs)."""
    from yggtree.bench import plan_runner

    out = {}
    for path in args.plan:
        plan, _, make = plan_runner(path)
        spec_engine, _, _ = make()
        policy = EveryTree.of(plan)
        spec = [spec_engine.generate(ids, sp, policy=policy).token_ids for _, ids in prompts]
        del spec_engine
        plain_engine, _, _ = make(False)
        plain = [plain_engine.generate(ids, sp).token_ids for _, ids in prompts]
        del plain_engine
        diffs = {pid: first_difference(p, s) for (pid, _), p, s in zip(prompts, plain, spec)}
        same = sum(d is None for d in diffs.values())
        out[plan.name] = {"identical": same, "compared": len(prompts), "trees": len(policy.trees),
                          "trees_used": len(policy.used), "differ_at": {k: v for k, v in diffs.items() if v is not None}}
        print(f"plan {plan.name}: speculative ({len(policy.used)}/{len(policy.trees)} trees of the plan, in turn) "
              f"= plain on {same}/{len(prompts)} prompts"
              + "".join(f"; {k} differs at token {v}" for k, v in diffs.items() if v is not None), flush=True)
    return out


def run(args) -> int:
    import torch

    from yggtree.data import interleave, load_prompts
    from yggtree.offline.profile_padding import model_padding
    from yggtree.runtime.build import EngineSpec, build_engine
    from yggtree.runtime.engine import SamplingParams, TreeParams
    from yggtree.runtime.loading import load_tokenizer, resolve_model

    try:
        tree = TreeParams(*(int(x) for x in args.spec_tree.split(",")))
    except (TypeError, ValueError):
        raise YggError(f"--spec-tree wants four integers W_d,D,W_v,k, got {args.spec_tree!r}") from None
    torch.set_num_threads(args.threads)
    tok = load_tokenizer(resolve_model(args.model))
    prompts = interleave(load_prompts(args.prompts, args.prompts, tok))
    sp = SamplingParams(max_new_tokens=args.max_new_tokens, temperature=0.0)
    record = {"spec_tree": args.spec_tree, "prompts": len(prompts), "max_new_tokens": args.max_new_tokens,
              "threads": args.threads, "torch": torch.__version__, "kv_cache": args.kv_cache, "formats": {}}
    if args.plan:
        record["plans"] = run_plans(args, prompts, sp)
        del record["spec_tree"], record["kv_cache"], record["formats"]
    for fmt in args.formats.split(",") if not args.plan else ():
        dtype = fmt if fmt in ("float32", "bfloat16") else args.quant_dtype
        weights = None if fmt in ("float32", "bfloat16") else fmt
        # packed float products (a quantized model's too: what stays float): one padding for
        # both engines, as a plan's profile gives it (the fastest one batch-invariant at 1 and W_v)
        pad = model_padding(resolve_model(args.model), dtype, weights, (1, tree.verify_width))
        min_rows, kernel = pad["min_rows"], pad["kernel"]
        out = {}
        for kind in ("plain", "spec"):
            spec = EngineSpec(model=args.model, drafter=args.drafter if kind == "spec" else None, dtype=dtype,
                              mode="performance", max_context=args.max_context, weights=weights,
                              kv_cache=args.kv_cache if dtype == "float32" else None,
                              min_rows=min_rows, kernel=kernel, threads=args.threads,
                              tree=tree if kind == "spec" else TreeParams())
            engine, _ = build_engine(spec)
            out[kind] = [engine.generate(ids, sp).token_ids for _, ids in prompts]
            del engine
        diffs = {pid: first_difference(p, s) for (pid, _), p, s in zip(prompts, out["plain"], out["spec"])}
        same = sum(d is None for d in diffs.values())
        record["formats"][fmt] = {"identical": same, "compared": len(prompts), "min_rows": min_rows, "kernel": kernel,
                                  "differ_at": {k: v for k, v in diffs.items() if v is not None}}
        print(f"{fmt}: speculative = plain on {same}/{len(prompts)} prompts"
              + "".join(f"; {k} differs at token {v}" for k, v in diffs.items() if v is not None), flush=True)
    line = json.dumps(record)
    print(line)
    if args.out:
        with open(args.out, "w") as f:
            f.write(line + "\n")
    checked = record["plans"] if args.plan else record["formats"]
    return 0 if all(r["identical"] == r["compared"] for r in checked.values()) else 1


def main(argv=None) -> int:
    return run_reporting("exact_formats", run, parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
