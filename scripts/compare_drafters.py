"""Rank EAGLE drafter heads by held-out chain acceptance on calibration prompts none of them
trained on, without running the decoding loop.

    OMP_NUM_THREADS=1 python scripts/compare_drafters.py --drafter default \\
        --drafter /path/to/run_a --drafter /path/to/run_b --first 4000 --prompts 80

The target (float32, or ``--weights FORMAT`` as a plan in that format runs it) answers
``--prompts`` calibration chat prompts greedily, from corpus chunk ``--first`` on (half of them in
the "basic" request style, half "varied"; the shipped drafter and ``yggtree distill``'s defaults
use chunks below 1000), capturing the features of every layer any of the drafters reads. Each
drafter's acceptance by depth is then computed as ``yggtree distill`` validates: a chain accepts
``>= d`` tokens at a root inside a greedy answer when the head's top-1 at draft depths ``0..d-1``
(its own predicted features fed back, exactly the runtime's chain: tests/test_distill.py) equals
the target's argmax every time. Chain-4 AAL is ``1 + sum(P(>= d), d = 1..4)``, over every root;
"walked" is the tokens per verify step of the chain of 4 / the top-4 tree of depth ``--depth`` as
the engine walks the answers (a root after each verify), what a decoding run measures.

This is for choosing between drafters; the evaluation prompts (MT-Bench, HumanEval) are not used
here, only by scripts/eval_drafter.py to report the chosen one. Output: a table on stdout and
ONE JSON line. Progress on stderr.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

from yggtree.errors import YggError, run_reporting
from yggtree.offline import distill_config as DC
from yggtree.offline import distill_data as DD
from yggtree.offline import teacher_data as TD
from yggtree.offline import distill_eval as DE
from yggtree.offline import distill_loss as DL
from yggtree.progress import stderr_progress


def selection_prompts(first: int, n: int, seed: int) -> list[str]:
    """``n`` calibration chat prompts from chunk ``first`` on: half basic, half varied requests."""
    from yggtree.data import calibration_chat_prompts

    half = n // 2
    basic = calibration_chat_prompts(first + half, seed, 400, "basic")[first:]
    varied = calibration_chat_prompts(first + n, seed, 400, "varied")[first + half :]
    return [p.text for p in basic + varied]


def heldout_data(root: Path, target, n: int, layers: tuple[int, ...]) -> "TD.TeacherData":
    """The first ``n`` held-out conversations of a transcript directory with the float32 target's
    features (as at run time), by batched prefill."""
    from yggtree.offline import transcripts as tr

    parts, got = [], 0
    for path in tr.shard_paths(root, "heldout"):
        sh = tr.load_shard(path, DD.target_fingerprint(target))
        k = min(sh.n_seq, n - got)
        cut = tr.Shard(sh.tokens[: int(sh.offsets[k])], sh.offsets[: k + 1], sh.role[: int(sh.offsets[k])], sh.meta)
        feats = tr.prefill_features(target, cut, layers, batch=4)
        parts.append(TD.TeacherData(cut.tokens, feats, cut.offsets, cut.role))
        got += k
        if got == n:
            break
    if not parts:
        raise YggError(f"no heldout-*.safetensors shards in {root}")
    return TD.concat_teacher(parts)


def main(args) -> int:
    from yggtree.runtime.build import EngineSpec
    from yggtree.runtime.prepare import load_drafter
    from yggtree.runtime.eagle import EagleDrafter
    from yggtree.runtime.loading import encode_auto, load_model, load_tokenizer, resolve_model
    from yggtree.runtime.model import rope_table

    if args.threads:
        torch.set_num_threads(args.threads)
    src = resolve_model(args.model)
    target = load_model(src, "float32")
    ref = target  # float weights of the target's LM head (a quantized target's dequantized blocks)
    if args.weights:
        import copy

        from yggtree.runtime.prepare import quantize_models

        target = copy.deepcopy(ref)
        quantize_models(target, None, args.weights, src)
    tok = load_tokenizer(src)
    tc = target.cfg
    heads: dict[str, EagleDrafter] = {}
    for name in args.drafter:
        d = load_drafter(EngineSpec(model=args.model, drafter=name, mode="reference"), ref, tok)
        if not isinstance(d, EagleDrafter):
            raise YggError(f"--drafter {name}: not an EAGLE head")
        heads[name] = d
    layers = sorted({i for d in heads.values() for i in d.target_layers} | {tc.num_layers - 1})
    eos = tuple(tc.eos_token_ids) or ((tok.eos_token_id,) if tok.eos_token_id is not None else ())
    cfg = DC.DistillConfig(max_new_tokens=args.max_new_tokens, gen_batch=args.gen_batch,
                          max_seq_len=args.max_seq_len, eval_depth=args.depth, unroll=1,
                          batch_size=4)
    t0 = time.perf_counter()
    if args.transcripts:
        data = heldout_data(Path(args.transcripts), target, args.prompts, tuple(layers))
        where = f"{data.n_seq} held-out conversations of {args.transcripts}"
    else:
        texts = selection_prompts(args.first, args.prompts, args.seed)
        ids = [encode_auto(tok, t)[-args.max_seq_len :] for t in texts]
        with stderr_progress() as progress:
            data = DD.build_teacher(target, ids, cfg, eos, tuple(layers), progress)
        where = f"{args.prompts} calibration prompts from chunk {args.first} (held out)"
    gen_s = time.perf_counter() - t0
    h = tc.hidden_size
    rows = []
    for name, d in heads.items():
        lay = TD.FeatureLayout.make(tuple(d.target_layers), tc.num_layers, h)
        cols = torch.cat([torch.arange(layers.index(i) * h, (layers.index(i) + 1) * h) for i in lay.stored])
        view = TD.TeacherData(data.tokens, data.feats[:, cols], data.offsets, data.role)
        net = d.net.float()
        vmap = net.draft_vocab
        th = DL.TargetHead(norm_weight=ref.norm.weight.float(), eps=tc.rms_norm_eps,
                          w_draft=ref.lm_head.weight[vmap].float(), w_full=ref.lm_head.weight.float())
        rope = rope_table(net.cfg.layer_config(), args.max_seq_len + 8)
        scale = DL.feature_dim_std(lay.last_layer(view.feats))
        ev = DE.evaluate(net, th, view, list(range(view.n_seq)), cfg, scale, rope, lay)
        rows.append({"drafter": name, "target_layers": list(lay.inputs),
                     "accept_by_depth": ev["accept_by_depth"], "top8_at_depth": ev["top8_at_depth"],
                     "chain4_aal": ev["est_chain4_aal"], "tree4_aal": ev["est_tree4_aal"],
                     "walk_chain4_aal": ev["walk_chain4_aal"], "walk_tree4_aal": ev["walk_tree4_aal"], "roots": ev["chain_roots"],
                     "top1": ev["val_top1_by_step"][0], "kl": ev["val_kl"]})
    print(f"{where}, {int(data.tokens.shape[0])} tokens, features in {gen_s:.0f} s")
    print(f"{'drafter':<40} {'top1':>6} {'chain-4 AAL':>12} {'tree-4 AAL':>11} {'walked':>13}  "
          f"P(accepted >= d), d = 1..{args.depth}")
    for r in rows:
        acc = " ".join(f"{a:.3f}" for a in r["accept_by_depth"])
        walked = f"{r['walk_chain4_aal']:.3f}/{r['walk_tree4_aal']:.3f}"
        print(f"{r['drafter'][-40:]:<40} {r['top1']:6.3f} {r['chain4_aal']:12.3f} {r['tree4_aal']:11.3f} {walked:>13}  {acc}")
    print(json.dumps({"weights": args.weights or "float32", "transcripts": args.transcripts, "first": args.first, "prompts": args.prompts, "max_new_tokens": args.max_new_tokens,
                      "n_tokens": int(data.tokens.shape[0]), "rows": rows}))
    return 0


def parse(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="default")
    p.add_argument("--drafter", action="append", required=True, help="'default' or an EAGLE head directory (repeatable)")
    p.add_argument("--first", type=int, default=4000, help="first calibration corpus chunk")
    p.add_argument("--transcripts", metavar="DIR",
                   help="rank on the held-out synthetic chat conversations of these transcripts instead")
    p.add_argument("--prompts", type=int, default=80)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--max-seq-len", type=int, default=640)
    p.add_argument("--gen-batch", type=int, default=16)
    p.add_argument("--depth", type=int, default=6)
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--weights", default=None,
                   help="the target's weight format (a plan's `weights`, e.g. w4a8): its answers and "
                        "features, as a plan in that format runs; default float32")
    return p.parse_args(argv)


if __name__ == "__main__":
    sys.exit(run_reporting("compare_drafters", main, parse()))
