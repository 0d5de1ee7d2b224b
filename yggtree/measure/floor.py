"""Speed-of-light references for benchmarks: memory bandwidth and the weight-matmul floor.

Plain decoding of a small model on CPU is bound by streaming the weights (docs/design.md section 14). These
functions measure, on the machine at hand, the two numbers a benchmark table compares against:

- :func:`copy_bandwidth_gbps`: how fast a large tensor copy streams memory.
- :func:`matmul_floor_ms`: how long the model's weight matmuls alone take for one step at a given width
  (tokens verified per step); a decoder cannot take less per step than this.

They use the current torch thread settings and change no global state. All timings: warm-up first, then
``repeats`` samples with :func:`time.perf_counter`, report medians. They are measurements, not assertions:
never use them in unit tests as speed checks.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence

import numpy as np
import torch

from ..errors import YggError

MIB = 1 << 20


def _check_counts(repeats: int, warmup: int) -> None:
    """User-facing validation of timing loop sizes."""
    if repeats < 1:
        raise YggError(f"repeats must be >= 1, got {repeats}")
    if warmup < 0:
        raise YggError(f"warmup must be >= 0, got {warmup}")


def _sync(device: torch.device) -> None:
    """Wait for queued work on an asynchronous device (no-op on CPU)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_calls(fn: Callable[[], object], repeats: int, warmup: int, device: torch.device) -> list[float]:
    """Seconds per call of fn: ``warmup`` untimed calls, then ``repeats`` timed ones."""
    for _ in range(warmup):
        fn()
    _sync(device)
    samples = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        _sync(device)
        samples.append(time.perf_counter() - start)
    return samples


def copy_bandwidth_gbps(
    nbytes: int = 256 * MIB, repeats: int = 10, warmup: int = 2, device: str | torch.device = "cpu"
) -> float:
    """Measured bandwidth of ``dst.copy_(src)`` for two ``nbytes`` uint8 buffers, in GB/s (1e9 bytes/s).

    Convention: reported as bytes *read* per second, ``nbytes / median_seconds``. A copy also writes
    ``nbytes`` (plus possibly a write-allocate read of the destination), so the total memory traffic is at
    least twice this figure. Bytes read per second is what compares directly with a decoder streaming its
    weights, which reads them and writes almost nothing. Choose ``nbytes`` well above the last-level cache.
    """
    if nbytes < 1:
        raise YggError(f"nbytes must be >= 1, got {nbytes}")
    _check_counts(repeats, warmup)
    device = torch.device(device)
    src = torch.ones(nbytes, dtype=torch.uint8, device=device)  # touch every page before timing
    dst = torch.zeros_like(src)
    samples = time_calls(lambda: dst.copy_(src), repeats, warmup, device)
    return nbytes / float(np.median(samples)) / 1e9


def weight_bytes(weights: Sequence[torch.Tensor]) -> int:
    """Total storage bytes of the given tensors (``numel * element_size``)."""
    return sum(w.numel() * w.element_size() for w in weights)


def matmul_weights(weights: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """The 2-D tensors among weights (the ones :func:`matmul_floor_ms` times), in order."""
    return [w for w in weights if w.dim() == 2]


KERNELS = ("linear", "packed", "tiled")  # F.linear; oneDNN packed; our tiled kernel (runtime/packed.py)


def matmul_floor_step(
    weights: Sequence[torch.Tensor], width: int, kernel: str = "linear"
) -> tuple[Callable[[], None], list[torch.Tensor]]:
    """One step's weight matmuls at ``width`` tokens as a callable (see :func:`matmul_floor_ms`),
    and the 2-D weights it multiplies by. Inputs and packed weights are prepared once, so a
    benchmark can time the step between its own runs (same machine state as the system timed)."""
    if kernel not in KERNELS:
        raise YggError(f"unknown matmul kernel {kernel!r} (choose from {', '.join(KERNELS)})")
    if width < 1:
        raise YggError(f"width must be >= 1, got {width}")
    mats = matmul_weights(weights)
    if not mats:
        raise YggError("matmul_floor_ms needs at least one 2-D weight")
    bad = sorted({str(w.dtype) for w in mats if not w.is_floating_point()})
    if bad:
        raise YggError(f"matmul_floor_ms needs floating-point weights, got {', '.join(bad)}")
    devices = {w.device for w in mats}
    if len(devices) != 1:
        raise YggError(f"all weights must be on one device, got {sorted(map(str, devices))}")
    device = devices.pop()

    gen = torch.Generator(device=device).manual_seed(0)  # local: the global RNG is left alone
    inputs: dict[tuple[int, torch.dtype], torch.Tensor] = {}
    for w in mats:
        key = (w.shape[1], w.dtype)
        if key not in inputs:
            inputs[key] = torch.randn(width, w.shape[1], generator=gen, device=device).to(w.dtype)
    if kernel == "packed":
        from ..runtime.packed import can_pack, packed_linear

        if device.type != "cpu" or not all(can_pack(torch.nn.Linear(1, 1).to(w.dtype)) for w in mats):
            raise YggError("the packed matmul floor needs oneDNN on a CPU for these weight dtypes")
        prods = [(inputs[(w.shape[1], w.dtype)], torch.ops.mkldnn._reorder_linear_weight(w.detach(), None),
                  w.shape[0]) for w in mats]

        @torch.no_grad()
        def step() -> None:
            for x, p, n in prods:
                packed_linear(x, p, n)
    elif kernel == "tiled":
        from ..runtime.kernels import load_library
        from ..runtime.packed import pack_weight, tiled_linear

        if device.type != "cpu" or not all(w.dtype in (torch.float32, torch.bfloat16) for w in mats):
            raise YggError("the tiled matmul floor needs float32 or bfloat16 weights on a CPU")
        load_library()  # YggError in one line where this CPU cannot run it
        prods = [(inputs[(w.shape[1], w.dtype)], pack_weight(w, "tiled"), w.shape[0]) for w in mats]

        @torch.no_grad()
        def step() -> None:
            for x, p, n in prods:
                tiled_linear(x, p, n)
    else:
        plan = [(inputs[(w.shape[1], w.dtype)], w.detach().t()) for w in mats]

        @torch.no_grad()
        def step() -> None:
            for x, wt in plan:
                x @ wt

    return step, mats


def floor_summary(samples_ms: Sequence[float], mats: Sequence[torch.Tensor], width: int, kernel: str) -> dict:
    """The dict :func:`matmul_floor_ms` returns, from per-step samples in ms."""
    samples = np.asarray(samples_ms, dtype=float)
    nbytes = weight_bytes(mats)
    median = float(np.median(samples))
    return {
        "median_ms": median,
        "p10_ms": float(np.percentile(samples, 10)),
        "p90_ms": float(np.percentile(samples, 90)),
        "weight_bytes": nbytes,
        "n_matmuls": len(mats),
        "gbps": nbytes / (median / 1e3) / 1e9,
        "width": width,
        "repeats": len(samples),
        "kernel": kernel,
    }


def matmul_floor_ms(
    weights: Sequence[torch.Tensor], width: int, repeats: int = 20, warmup: int = 3, kernel: str = "linear"
) -> dict[str, float | int]:
    """Time of one step's weight matmuls alone at ``width`` tokens.

    ``kernel`` is the product timed: ``linear`` is ``x @ w.T`` (what eager code such as
    transformers runs), ``packed`` the oneDNN product on weights reordered once into oneDNN's
    blocked layout (what yggtree's packed layers run, :mod:`yggtree.runtime.packed`; CPU only).
    On the CPUs measured so far the packed kernel streams weights faster at every width, so it
    is the stricter floor.

    For each 2-D weight ``w`` of shape [out, in] (other tensors are ignored), compute ``x @ w.T`` with
    ``x`` of shape [width, in] in ``w``'s dtype and device (output allocated, as in a model's forward); all
    weights in sequence are one sample (one decoding step's worth of matmuls). Pass the weights the model
    multiplies by, one per product, including the vocabulary projection (tied or not) and excluding
    embedding lookups (``Transformer.matmul_weights``).

    Returns a dict:

    - ``median_ms``, ``p10_ms``, ``p90_ms``: per-step time over ``repeats`` samples after ``warmup``;
    - ``weight_bytes``: bytes of the timed 2-D weights; ``n_matmuls``: how many;
    - ``gbps``: ``weight_bytes / median`` in 1e9 bytes/s, the weight-streaming rate achieved;
    - ``width``, ``repeats``, ``kernel``: echoed.
    """
    _check_counts(repeats, warmup)
    step, mats = matmul_floor_step(weights, width, kernel)
    device = mats[0].device
    samples_ms = np.array(time_calls(step, repeats, warmup, device)) * 1e3
    return floor_summary(samples_ms, mats, width, kernel)
