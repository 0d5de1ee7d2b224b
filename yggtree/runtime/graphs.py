"""Static graphs of one model: compile per decoder block, warm up every width, then freeze.

Compilation is regional: each decoder block is compiled once (fullgraph, static shapes) and the
one graph per input width is shared by all layers, because dynamo lifts parameters and buffers
to graph inputs. That keeps cold compiles to seconds per width on a CPU instead of minutes for a
fully unrolled model, while every block's kernels are still fused by inductor. The glue (token
embedding, RoPE gather, mask construction, LM head) runs as a handful of eager ops.

After :meth:`Graphs.warm_up` every shape the engine can request has a graph; decoding then runs
under ``torch.compiler.set_stance("fail_on_recompile")`` so a shape that slipped through is an
error, never a silent compile in the decode loop.
"""

from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass, field

import torch

from ..errors import YggError
from . import steps
from .model import Transformer

MODES = ("reference", "performance")
BACKENDS = ("inductor-cpu", "eager", "cuda", "npu")


def check_backend(backend: str) -> None:
    """Refuse a backend whose runtime is missing on this machine, saying what to install."""
    if backend not in BACKENDS:
        raise YggError(f"unknown backend {backend!r} (choose from {', '.join(BACKENDS)})")
    if backend == "cuda" and not torch.cuda.is_available():
        raise YggError("backend 'cuda' needs an NVIDIA GPU and a CUDA build of torch (see README)")
    if backend == "npu":
        try:
            import torch_npu  # noqa: F401
            import torchair  # noqa: F401
        except ImportError:
            raise YggError(
                "backend 'npu' needs Ascend's torch_npu and torchair: pip install torch-npu torchair"
            ) from None


@dataclass
class Graphs:
    """A model plus the compiled state of its blocks. ``compile_s`` accumulates warm-up time."""

    model: Transformer
    mode: str
    widths: set[int] = field(default_factory=set)  # input widths warmed up so far
    compile_s: float = 0.0

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise YggError(f"unknown mode {self.mode!r} (choose from {', '.join(MODES)})")
        if self.mode == "performance":
            for block in self.model.layers:
                block.compile(fullgraph=True, dynamic=False)

    @property
    def compiled(self) -> bool:
        return self.mode == "performance"

    def warm_up(self, widths: list[int], capture: tuple[int, ...] = ()) -> None:
        """Build the graph of every width not built yet (writes scratch data into the cache)."""
        todo = sorted(set(widths) - self.widths)
        if not todo:
            return
        t0 = time.perf_counter()
        dev = self.model.embed_tokens.weight.device
        zero = torch.zeros((), dtype=torch.int64, device=dev)
        with torch.no_grad(), torch._dynamo.config.patch(recompile_limit=256):
            for w in todo:
                ar = torch.arange(w, device=dev)
                anc = ar[None, :] <= ar[:, None]
                steps.tree_step(self.model, ar, ar, ar, anc, zero, capture)
        self.widths.update(todo)
        self.compile_s += time.perf_counter() - t0

    def frozen(self):
        """Context for the decode loop: compiled mode may not compile anything new."""
        if self.compiled:
            return torch.compiler.set_stance("fail_on_recompile")
        return contextlib.nullcontext()
