"""The decode loop: prefill, then plain decoding or tree speculation, streaming tokens.

One speculation step (DESIGN section 2)::

    head   drafter sees the root (the last emitted token)        -> top-k children
    draft  D x (EGT select W_d nodes, drafter step over them)     -> tree of 1 + D*W_d nodes
    prune  keep the W_v best nodes (a connected subtree)          -> verify tree
    verify target over the W_v nodes, tree mask                   -> logits at every node
    accept greedy or lossless sampling                            -> accepted path + bonus
    commit move the accepted path's KV to contiguous slots (target and drafter)
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable

import torch

from ..errors import YggError
from . import steps
from .accept import filter_probs, greedy_accept, sample_accept, truncate
from .drafters import Drafter
from .egt import egt_expand, egt_feed_inputs, egt_init, egt_select
from .graphs import Graphs
from .model import Transformer
from .prune import prune_topk, subtree
from .tree import ancestor_mask, check_invariants

STAGES = ("head", "draft", "prune", "verify", "accept", "commit")


@dataclass(frozen=True)
class SamplingParams:
    max_new_tokens: int = 128
    temperature: float = 0.0  # 0 = greedy
    top_p: float = 1.0
    seed: int = 0

    def validate(self) -> None:
        if self.max_new_tokens < 1:
            raise YggError(f"max-new-tokens must be >= 1, got {self.max_new_tokens}")
        if not self.temperature >= 0:
            raise YggError(f"temperature must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise YggError(f"top-p must be in (0, 1], got {self.top_p}")


@dataclass(frozen=True)
class TreeParams:
    """Static tree shape of one speculation step."""

    draft_width: int = 4  # W_d: nodes fed to the drafter per draft call
    draft_depth: int = 4  # D: draft calls per step
    verify_width: int = 16  # W_v: nodes the target verifies (root included)
    top_k: int = 4  # children proposed per fed node

    @property
    def tree_size(self) -> int:
        return 1 + self.draft_width * self.draft_depth

    def validate(self) -> None:
        for name in ("draft_width", "draft_depth", "verify_width", "top_k"):
            if getattr(self, name) < 1:
                raise YggError(f"{name.replace('_', '-')} must be >= 1, got {getattr(self, name)}")
        if self.verify_width > self.tree_size:
            raise YggError(
                f"verify-width {self.verify_width} exceeds the drafted tree "
                f"(1 + draft-width {self.draft_width} x draft-depth {self.draft_depth} "
                f"= {self.tree_size} nodes)"
            )


@dataclass(frozen=True)
class EngineConfig:
    mode: str = "performance"  # reference (eager, checks) | performance (compiled)
    max_context: int = 1024  # prompt + generated tokens
    prefill_chunk: int = 64
    tree: TreeParams | None = None  # None: plain decoding


@dataclass
class Result:
    token_ids: list[int]
    prompt_token_ids: list[int]
    finish_reason: str  # "stop" (EOS) | "length"
    stats: dict = field(default_factory=dict)


class Engine:
    """Target (+ optional drafter) with static caches and graphs, ready to generate."""

    def __init__(
        self,
        target: Transformer,
        cfg: EngineConfig,
        drafter: Drafter | None = None,
        eos_ids: tuple[int, ...] = (),
    ) -> None:
        if cfg.max_context < 2:
            raise YggError(f"max-context must be >= 2, got {cfg.max_context}")
        if cfg.prefill_chunk < 1:
            raise YggError(f"prefill-chunk must be >= 1, got {cfg.prefill_chunk}")
        if cfg.max_context > target.cfg.max_position_embeddings:
            raise YggError(
                f"max-context {cfg.max_context} exceeds the model's context window "
                f"({target.cfg.max_position_embeddings})"
            )
        if (cfg.tree is None) != (drafter is None):
            raise YggError("speculation needs both tree parameters and a drafter")
        if cfg.tree is not None:
            cfg.tree.validate()
            if drafter.vocab_size != target.cfg.vocab_size:
                raise YggError(
                    f"drafter vocabulary ({drafter.vocab_size}) differs from the target's "
                    f"({target.cfg.vocab_size})"
                )
        self.cfg = cfg
        self.target = target
        self.drafter = drafter
        self.eos_ids = tuple(eos_ids)
        self.graphs = Graphs(target, cfg.mode)
        tree = cfg.tree
        reserve = max(tree.verify_width, tree.tree_size) if tree else 1
        self.n_slots = cfg.max_context + reserve + 1  # + scratch slot
        target.setup_cache(1, self.n_slots)
        self.graphs.warm_up([cfg.prefill_chunk, 1] + ([tree.verify_width] if tree else []))
        if drafter is not None:
            drafter.setup(self.n_slots, [cfg.prefill_chunk, 1, tree.draft_width], cfg.prefill_chunk)

    @property
    def compile_s(self) -> float:
        extra = getattr(getattr(self.drafter, "graphs", None), "compile_s", 0.0)
        return self.graphs.compile_s + extra

    # ------------------------------------------------------------------ helpers

    def _check_prompt(self, prompt_ids: list[int], params: SamplingParams) -> None:
        params.validate()
        if not prompt_ids:
            raise YggError("the prompt is empty")
        n, cap = len(prompt_ids), self.cfg.max_context
        if n >= cap:
            raise YggError(f"the prompt has {n} tokens, the context window is {cap}")
        if n + params.max_new_tokens > cap:
            raise YggError(
                f"prompt ({n} tokens) + max-new-tokens ({params.max_new_tokens}) exceeds the "
                f"context window ({cap}); lower max-new-tokens or raise max-context"
            )
        vocab = self.target.cfg.vocab_size
        bad = [t for t in prompt_ids if not 0 <= t < vocab]
        if bad:
            raise YggError(f"prompt token id {bad[0]} is outside the vocabulary (0..{vocab - 1})")

    def _prefill(self, prompt: torch.Tensor) -> tuple[torch.Tensor, tuple[torch.Tensor, ...]]:
        """Chunked prefill of the target. Returns last logits [V] and captured layers [n, H]."""
        c = self.cfg.prefill_chunk
        n = prompt.shape[0]
        layers = self.drafter.target_layers if self.drafter is not None else ()
        feats: list[list[torch.Tensor]] = [[] for _ in layers]
        logits = None
        for start in range(0, n, c):
            part = prompt[start : start + c]
            buf = torch.zeros(c, dtype=torch.int64)
            buf[: part.shape[0]] = part
            logits, _, caps = steps.prefill_chunk(
                self.target,
                buf[None],
                torch.tensor(start),
                torch.tensor(part.shape[0]),
                layers,
                self.graphs.bucket(start + c),
            )
            for f, x in zip(feats, caps):
                f.append(x[0, : part.shape[0]])
        return logits[0], tuple(torch.cat(f) for f in feats)

    @staticmethod
    def _choose(logits: torch.Tensor, params: SamplingParams, gen: torch.Generator) -> int:
        if params.temperature == 0:
            return int(logits.argmax())
        probs = filter_probs(logits, params.temperature, params.top_p)
        return int(torch.multinomial(probs, 1, generator=gen))

    # ------------------------------------------------------------------ generation

    def generate(
        self,
        prompt_ids: list[int],
        params: SamplingParams = SamplingParams(),
        on_tokens: Callable[[list[int]], None] | None = None,
        trace: Callable[[dict], None] | None = None,
    ) -> Result:
        """Decode up to ``params.max_new_tokens`` tokens; ``on_tokens`` receives each emission.

        ``trace`` (reference mode) receives one JSON-ready record per decode step: the drafted
        tree, the kept nodes, the accepted path, the emitted tokens and the stage times."""
        if trace is not None and self.cfg.mode != "reference":
            raise YggError("step traces are written in reference mode only (--mode reference)")
        self._check_prompt(prompt_ids, params)
        gen = torch.Generator().manual_seed(params.seed)
        stats = {name: 0.0 for name in STAGES}
        t0 = time.perf_counter()
        with torch.no_grad(), self.graphs.frozen():
            prompt = torch.tensor(prompt_ids, dtype=torch.int64)
            logits, feats = self._prefill(prompt)
            first = self._choose(logits, params, gen)
            ttft = time.perf_counter() - t0
            out, reason = truncate([first], self.eos_ids, params.max_new_tokens)
            if on_tokens:
                on_tokens(out)
            counters = {"verify_calls": 0, "draft_calls": 0, "accepted_tokens": 0, "accept_hist": []}
            if reason is None:
                if self.drafter is None:
                    reason = self._plain_loop(
                        out, len(prompt_ids), params, gen, on_tokens, counters, trace
                    )
                else:
                    with self.drafter.frozen():
                        self.drafter.prefill(prompt, feats)
                        reason = self._spec_loop(
                            out, len(prompt_ids), params, gen, on_tokens, counters, stats, trace
                        )
        total = time.perf_counter() - t0
        n = len(out)
        stats = self._stats(n, total, ttft, counters, stats)
        return Result(out, list(prompt_ids), reason, stats)

    def _stats(self, n: int, total: float, ttft: float, c: dict, stage: dict) -> dict:
        verify = max(c["verify_calls"], 1)
        s = {
            "new_tokens": n,
            "tokens_per_s": n / total,
            "decode_tokens_per_s": (n - 1) / (total - ttft) if n > 1 and total > ttft else 0.0,
            "ttft_ms": ttft * 1e3,
            "tpot_ms": (total - ttft) / (n - 1) * 1e3 if n > 1 else 0.0,
            "total_ms": total * 1e3,
            "compile_s": self.compile_s,
            "verify_calls": c["verify_calls"],
        }
        if self.drafter is not None:
            hist = c["accept_hist"]
            d = self.cfg.tree.draft_depth
            s.update(
                draft_calls=c["draft_calls"],
                accepted_tokens=c["accepted_tokens"],
                aal=(c["accepted_tokens"] + c["verify_calls"]) / verify,
                accept_by_position=[
                    sum(1 for a in hist if a >= i) / verify for i in range(1, d + 1)
                ],
                stage_ms={k: v * 1e3 for k, v in stage.items()},
            )
        return s

    def _plain_loop(self, out, n_prompt, params, gen, on_tokens, counters, trace) -> str:
        zero = torch.zeros(1, dtype=torch.int64)
        anc = torch.ones(1, 1, dtype=torch.bool)
        committed = n_prompt
        while True:
            root = torch.tensor([out[-1]])
            logits, _, _ = steps.tree_step(
                self.target, root, zero, zero, anc, torch.tensor(committed), (),
                self.graphs.bucket(committed + 1),
            )
            counters["verify_calls"] += 1
            committed += 1
            new, reason = truncate(
                [self._choose(logits[0], params, gen)], self.eos_ids, params.max_new_tokens - len(out)
            )
            out.extend(new)
            if on_tokens and new:
                on_tokens(new)
            if trace:
                trace({"step": counters["verify_calls"], "committed": committed - 1, "emitted": new})
            if reason is not None:
                return reason

    def _spec_loop(self, out, n_prompt, params, gen, on_tokens, counters, stage, trace) -> str:
        tp = self.cfg.tree
        drafter = self.drafter
        check = self.cfg.mode == "reference"
        d, wd, k, wv = tp.draft_depth, tp.draft_width, tp.top_k, tp.verify_width
        committed = n_prompt
        dst_off = torch.arange(1, d + 1)
        layers = drafter.target_layers
        while True:
            t = time.perf_counter()
            L = torch.tensor(committed)
            root = torch.tensor(out[-1])
            head = drafter.head(root, L, k)
            t1 = time.perf_counter()
            state = egt_init(root, head.token[0], head.logp[0], d, wd)
            for s in range(d):
                state, fed = egt_select(state, s)
                tokens, pos, rows = egt_feed_inputs(state, fed, L)
                prop = drafter.step(tokens, pos - L, fed, state.tree.parent[fed], rows, L, k)
                state = egt_expand(state, fed, prop.token, prop.logp)
            counters["draft_calls"] += d + 1
            t2 = time.perf_counter()
            tree = state.tree
            if check:
                check_invariants(tree)
            kept, kept_valid = prune_topk(tree, tree.logp, wv)
            vtree = subtree(tree, kept, kept_valid)
            anc = ancestor_mask(vtree.parent, vtree.depth, vtree.valid, d)
            if check:
                check_invariants(vtree)
            t3 = time.perf_counter()
            node = torch.arange(wv)
            logits, _, caps = steps.tree_step(
                self.target, vtree.token, vtree.depth, node, anc, L, layers,
                self.graphs.bucket(committed + wv),
            )
            counters["verify_calls"] += 1
            t4 = time.perf_counter()
            if params.temperature == 0:
                acc = greedy_accept(vtree, logits, max_depth=d)
            else:
                acc = sample_accept(vtree, logits, params.temperature, params.top_p, gen, max_depth=d)
            emitted = acc.emitted()
            n_acc = len(emitted) - 1
            counters["accepted_tokens"] += n_acc
            counters["accept_hist"].append(n_acc)
            new, reason = truncate(emitted, self.eos_ids, params.max_new_tokens - len(out))
            out.extend(new)
            if on_tokens and new:
                on_tokens(new)
            t5 = time.perf_counter()
            if reason is None:
                path = acc.path[1:]  # [D] local verify-tree nodes of the accepted tokens (padded)
                steps.commit(self.target, L + path, L + dst_off)
                feats = tuple(x[acc.path] for x in caps)
                drafter.commit(
                    L + kept[path], L + dst_off, vtree.token[acc.path], acc.n_accepted, feats
                )
                committed += 1 + n_acc
            t6 = time.perf_counter()
            times = {}
            for name, a, b in zip(STAGES, (t, t1, t2, t3, t4, t5), (t1, t2, t3, t4, t5, t6)):
                stage[name] += b - a
                times[name] = (b - a) * 1e3
            if trace:
                trace(
                    {
                        "step": counters["verify_calls"],
                        "committed": committed - (1 + n_acc if reason is None else 0),
                        "root": int(root),
                        "tree": {
                            "token": tree.token.tolist(),
                            "parent": tree.parent.tolist(),
                            "depth": tree.depth.tolist(),
                            "valid": tree.valid.tolist(),
                            "logp": [round(x, 4) if x > float("-inf") else None for x in tree.logp.tolist()],
                        },
                        "kept": kept.tolist(),
                        "kept_valid": kept_valid.tolist(),
                        "accepted_path": acc.path.tolist(),
                        "n_accepted": n_acc,
                        "emitted": new,
                        "finish": reason,
                        "stage_ms": times,
                    }
                )
            if reason is not None:
                return reason
