"""Compiled graphs of continuous batching: the decoder block at batch shapes, over a B-row cache.

A compiled engine's packages (runtime/aoti.py) are built for its batch-1 cache. Decoding several
requests at once (runtime/batch.py) reallocates the target's cache with ``max_batch`` rows and
calls every block over a bucket of its leading rows, so the blocks need packages of their own:
one per (batch rows b, input width W, context C), each taking the leading b rows of the layer's
``max_batch``-row cache as it lies in the store (a view, strided as the whole cache: a package
assumes the strides it was compiled for, and ``max_batch`` and S fix them):

    batch inputs   x [b, W, H], cos [b, W, 1, D/2] f32, sin [b, W, 1, D/2] f32, slots [b, W, 1 + T]
                   i64 (row_window's: the slot, then the window; a prefill chunk's [b, W]),
                   mask [b, W, C] bool, then the cache kv [2, b, Hkv, S, D] (a view of the
                   [2, max_batch, Hkv, S, D] layer cache, mutated), then the block's weights
                   (aoti.block_tensors)
    batch output   [b, W, H]

The shapes (:func:`batch_shapes`): every batch bucket at every step width (the plain step and
the plan's verify widths), and a joining request's prefill chunks (b = 1, on its own row) at
every context bucket the engine's prefill takes. A batched step's context is the widest its
requests need; where the attention runs on the kernel library (its row-by-row kernel reads only
each row's visible slots, so a row's bits do not depend on the context) the steps are compiled
at the cache's size alone, else at every context bucket.

They are built once per compiled plan and batch size, beside its packages (offline/batch_build.py:
``yggtree serve --max-batch N`` builds what is missing before it listens), and loaded here:
:class:`BatchPackages`, whose :meth:`~BatchPackages.install` makes the target's blocks run them.
Each package's sha256 is written beside it when it is finished; one whose bytes differ is refused.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from ..errors import YggError
from .aoti import block_key, block_tensors, extracting_here, load_runner, package_name, static_blocks

SCOPE = "batch"


def batch_dir(root: Path, max_batch: int) -> Path:
    """Where the batch packages of a plan's package cache ``root`` live for ``max_batch``."""
    return Path(root) / f"batch-m{max_batch}"


def batch_buckets(max_batch: int) -> list[int]:
    """The batch shapes a decoder of ``max_batch`` rows calls (runtime.batch.batch_bucket)."""
    from ..shapes import batch_bucket

    return sorted({batch_bucket(n, max_batch) for n in range(1, max_batch + 1)})


def batch_shapes(max_batch: int, step_widths: tuple[int, ...], prefill_chunk: int, n_slots: int,
                 native: bool) -> list[tuple[int, int, int]]:
    """Every (b, W, C) a decoder of ``max_batch`` rows calls (see the module's docstring)."""
    from .graphs import context_buckets

    buckets = context_buckets(n_slots)
    steps = [n_slots] if native else buckets
    shapes = [(1, prefill_chunk, c) for c in buckets if c >= prefill_chunk]
    shapes += [(b, w, c) for b in batch_buckets(max_batch) for w in sorted(set(step_widths)) for c in steps if c >= w]
    return list(dict.fromkeys(shapes))


def batch_key(block: nn.Module, max_batch: int, n_slots: int) -> str:
    """12 hex digits naming the batch packages of ``block``'s kind over a cache of ``max_batch``
    rows of ``n_slots`` slots (what fixes the cache's strides)."""
    text = f"{block_key(block)};batch{max_batch};slots{n_slots}"
    return hashlib.sha256(text.encode()).hexdigest()[:12]


def entry(key: str, shape: tuple[int, int, int]) -> tuple[str, int, int]:
    """The package-cache job key of one batch shape: (key with its rows, W, C)."""
    b, w, c = shape
    return (f"{key}-b{b}", w, c)


def file_name(key: str, shape: tuple[int, int, int]) -> str:
    return package_name(*entry(key, shape), SCOPE)


def example_inputs(block: nn.Module, shape: tuple[int, int, int], max_batch: int, n_slots: int) -> tuple:
    """Activations and cache of a block call at ``shape`` (b, W, C), as the decoder makes them:
    the cache a view of a ``max_batch``-row layer cache (its strides), slots with the row
    window where the block computes the call's attention row by row."""
    from .model import LOGICAL_WINDOW

    b, w, c = shape
    attn = block.self_attn
    cache = attn.cache.kv  # [2, B, Hkv, S, D]: any cache of the block's, for its dtype and heads
    cfg = attn.cfg
    x = torch.zeros(b, w, cfg.hidden_size, dtype=block.input_layernorm.weight.dtype)
    cos = torch.zeros(b, w, 1, cfg.head_dim // 2)
    slots = (torch.zeros(b, w, 1 + LOGICAL_WINDOW, dtype=torch.int64) if w <= attn.invariant_rows
             else torch.zeros(b, w, dtype=torch.int64))
    mask = torch.zeros(b, w, c, dtype=torch.bool)
    kv = torch.zeros(2, max_batch, cache.shape[2], n_slots, cache.shape[4], dtype=cache.dtype)[:, :b]
    return (x, cos, cos.clone(), slots, mask, kv)


@dataclass(frozen=True)
class BatchPackages:
    """Loaded batch packages of a target: (b, W, C) -> AOTI runner, for a cache of ``max_batch``
    rows of ``n_slots`` slots."""

    runners: dict  # (int, int, int) -> torch._C._aoti.AOTIModelPackageLoader
    max_batch: int
    n_slots: int
    step_contexts: tuple[int, ...]  # the contexts batched steps are compiled at

    @classmethod
    def load(cls, root: Path, target: nn.Module, shapes: list[tuple[int, int, int]], max_batch: int,
             n_slots: int) -> BatchPackages:
        """The packages of ``shapes`` from ``root`` (:func:`batch_dir`); YggError naming the first
        one missing or damaged."""
        from ..files import file_sha256

        key = batch_key(target.layers[0], max_batch, n_slots)
        runners = {}
        with extracting_here():
            for shape in shapes:
                path = Path(root) / file_name(key, shape)
                if not path.is_file():
                    raise YggError(f"the batched graph {path.name} is not built (in {root})")
                try:
                    ok = path.with_suffix(".sha256").read_text().strip() == file_sha256(path)
                except OSError:
                    ok = False
                if not ok:
                    raise YggError(f"the batched graph {path} is damaged (its sha256 differs from the one written "
                                   "when it was built)")
                runners[shape] = load_runner(path, "the batched graph")
        contexts = sorted({c for b, w, c in shapes if w == 1})
        return cls(runners, max_batch, n_slots, tuple(contexts))

    def context(self, need: int) -> int:
        """The context a batched step whose rows need ``need`` slots runs at."""
        return next(c for c in self.step_contexts if c >= need)

    def layers(self, target: nn.Module, store, tokens, positions, slots, mask, capture=()):
        """``runtime.batch.batch_layers`` over ``store`` (a bucket of the batch cache) with each
        layer's package called directly: the last layer's output [b, W, H] and the captured
        layers (each [b, W, H]). tokens, positions, slots [b, W] int64; mask [b, W, C] bool."""
        from .model import row_window

        runner = runner_for(self.runners, (*tokens.shape, mask.shape[-1]))
        cs = target.rope[positions]  # [b, W, D/2, 2]
        cos, sin = cs[..., 0].unsqueeze(2).contiguous(), cs[..., 1].unsqueeze(2).contiguous()
        x = target.embed_tokens(tokens)
        window, mask = row_window(mask)
        acts = [cos, sin, torch.cat([slots[..., None], window], -1).contiguous(), mask.contiguous()]
        captured = []
        for i, (block, cache) in enumerate(zip(target.layers, store.caches)):
            x = runner.run([x, *acts, cache.kv, *block.forward.weights])[0]  # its BatchForward's (install)
            if i in capture:
                captured.append(x)
        return x, tuple(captured)

    def install(self, target: nn.Module) -> None:
        """Make every block of ``target`` (its cache set up with ``max_batch`` rows) run these
        packages; a call of a shape without one is a YggError, never a compile."""
        kv = target.kv.kv
        if tuple(kv.shape[2:3]) != (self.max_batch,) or kv.shape[4] != self.n_slots:
            raise YggError(f"the batched graphs are built for {self.max_batch} rows of {self.n_slots} slots, "
                           f"the cache holds {kv.shape[2]} of {kv.shape[4]}")
        for block in target.layers:  # a block on a batch-1 cache of its own keeps its packages
            block.forward = BatchForward(block, self.runners, block.__dict__.get("forward"))


def runner_for(runners: dict, shape: tuple[int, int, int]):
    """The runner of ``shape`` (b, W, C); a YggError naming it and what was built, never a compile."""
    runner = runners.get(shape)
    if runner is None:
        raise YggError(f"no batched graph for {shape[0]} rows of width {shape[1]} at context {shape[2]} "
                       f"(built: {sorted(runners)})")
    return runner


class BatchForward:
    """A block's forward that runs its batch package for the call's (b, W, C)."""

    def __init__(self, block: nn.Module, runners: dict, solo=None) -> None:
        # solo: the block's forward on a batch-1 cache of its own (its packages', else its eager code)
        self.block, self.runners = block, runners
        self.solo = solo or (lambda *args: type(block).forward(block, *args))
        self.weights = [p for _, p in block_tensors(block)]

    def __call__(self, x, cos, sin, slots, mask):
        kv = self.block.self_attn.cache.kv
        if kv.shape[1] == 1 and kv.is_contiguous():  # not a view of the batch cache
            return self.solo(x, cos, sin, slots, mask)
        runner = runner_for(self.runners, (x.shape[0], x.shape[1], mask.shape[-1]))
        acts = (x.contiguous(), cos.contiguous(), sin.contiguous(), slots.contiguous(), mask.contiguous())
        return runner.run([*acts, self.block.self_attn.cache.kv, *self.weights])[0]


def package_root(target: nn.Module) -> Path:
    """The package cache a compiled target's packages were loaded from (YggError otherwise)."""
    root = getattr(target, "package_root", None)
    if root is None or static_blocks(target) is None:
        raise YggError("batched decoding on compiled graphs needs a compiled plan's packages")
    return Path(root)
