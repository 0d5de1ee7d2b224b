#!/usr/bin/env python
"""One decode step's weight products on well-kept libraries against ours (issue #59 item 3; one run).

The embedded default model's products of one decoder step -- each of the 30 blocks' fused q/k/v,
o, gate/up and down, then the LM head, in forward order, each on a [W, in_features] float32 input
-- timed at each width W of ``--widths`` on each of ``--systems``:

- ``w4a8``: ours, the GGUF's own blocks (Q4_0/Q4_1; its LM head Q8_0) on int8 activations
  (``yggtree::w4a8_mm``), as an engine prepares it (scripts/bench_verify.py ``prepare``), each
  product a module call from Python (~25 us of eager overhead each, 121 a step);
  ``w4a8-aoti``: the same products in one AOTInductor package as ``yggtree compile`` builds
  one (the ops called through their C shims; W dynamic), one call a step -- the reference
  (``x ref``) where it is timed, as the one-call systems below are;
- ``int8-tiled``: ours, int8 per channel on 16-bit activations (``yggtree::tiled_mm``);
- ``torch-int8``, ``torch-int4``: torch's weight-only CPU kernels as our ``torch`` product kernel
  runs them (``aten._weight_int8pack_mm``; ``aten._weight_int4pack_mm_for_cpu`` with groups of 32),
  on bfloat16 activations: their float32 paths are scalar loops (runtime/quant.py);
- ``fbgemm``: torch's dynamic-quantized int8 linear (``quantize_dynamic``, per-channel weights,
  activations quantized per call) on ``--engine``, built from the float weights;
- ``ort``: onnxruntime's ``MatMulNBits`` (bits 4, blocks of 32, asymmetric, accuracy_level 4:
  int8 activations), weights quantized by onnxruntime's own ``MatMulNBitsQuantizer``, the LM head
  at ``--ort-head-bits``; one graph of every product in order (inputs fed once per width), one
  ``run_with_iobinding`` per step into preallocated outputs (``--threads`` intra-op threads that
  sleep between calls unless ``--ort-spin``). ``ort-layers``: the same products as
  one single-node session each, run one after another (what calling it per linear from our model
  would pay: the per-layer time sum, each call's overhead included);
- ``xnnpack``: XNNPACK through ExecuTorch (torchao's ``Int8DynamicActivationIntxWeightConfig``:
  int8 dynamic activations, symmetric 4-bit weights in groups of 32, the LM head int8 per
  channel), one program of every product, shapes dynamic in W; skipped with a note where
  executorch does not import.

Every system builds its own packed weights once; ``weights MB`` is what its products read.
``head`` is the LM head alone (on the same library). Timing: one warm-up round, then
``--repeats`` rounds, each calling every (system, W, step / head) once in a freshly shuffled order
(a slow stretch of a shared host falls on all alike), each call after ``--gap-ms`` idle: on 2
cores, a library's pool threads still spinning after its call (XNNPACK's, onnxruntime's where
``--ort-spin``) would take a core from the next call, whose OpenMP regions then wait on a
descheduled thread at every barrier. Medians; ``x ref`` the ratio to ours at the same W (below
1: faster than ours), ``W8/W1`` the system's own cost of 8 rows over one.
``yggtree.offline.timing.LoadMeter`` records what else ran during the timing (``--wait-quiet``
first waits for it to be nothing). The last line is JSON with every median.

XNNPACK needs executorch, which pins its own torchao: install it in a virtualenv that sees this
one's packages (``python -m venv --system-site-packages DIR; DIR/bin/pip install executorch``)
and run this script with that virtualenv's python.

    python scripts/bench_libraries.py --widths 1,2,4,8,16 --threads 2 --repeats 15

The kernels a library picks follow the CPU; on an AVX-512 machine an AVX2 pass of those that can
be told (ours, torch's ATen kernels, fbgemm; onnxruntime's MLAS and XNNPACK cannot) is
``YGGTREE_KERNEL_ISA=avx2 ATEN_CPU_CAPABILITY=avx2 FBGEMM_ENABLE_INSTRUCTIONS=AVX2 python ...``.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import time
from dataclasses import dataclass, field
from typing import Callable

import numpy as np
import torch

from bench_verify import prepare, product_layers
from yggtree.errors import YggError, run_reporting

SYSTEMS = ("w4a8", "w4a8-aoti", "int8-tiled", "torch-int8", "torch-int4", "fbgemm", "ort", "ort-layers", "xnnpack")
# a block's products in the order its forward calls them (fused names: runtime/model.py FUSED_PROJECTIONS)
FORWARD = ("qkv", "q_proj", "k_proj", "v_proj", "o_proj", "gate_up", "gate_proj", "up_proj", "down_proj")
ISA_ENVS = ("YGGTREE_KERNEL_ISA", "ATEN_CPU_CAPABILITY", "FBGEMM_ENABLE_INSTRUCTIONS")
GROUP = 32  # the 4-bit block / group size every 4-bit system here uses (the GGUF's)


@dataclass
class System:
    """One library's products: ``step(w)`` / ``head(w)`` make the call that runs all of them / the
    LM head alone on inputs of ``w`` rows."""

    name: str
    weights_mb: float
    step: Callable[[int], Callable[[], object]]
    head: Callable[[int], Callable[[], object]]
    note: str = ""
    extra: dict = field(default_factory=dict)


def forward_layers(model) -> list:
    """``product_layers(model)`` in the order a decoder step calls them: each block's q/k/v, o,
    gate/up, down, then the LM head."""
    ids = {id(m) for m in product_layers(model)}
    named = [(n, m) for n, m in model.named_modules() if id(m) in ids]

    def key(item):
        parts = item[0].split(".")
        return (int(parts[1]), FORWARD.index(parts[-1])) if parts[0] == "layers" else (len(named), 0)

    return [m for _, m in sorted(named, key=key)]


def float_products(model) -> list[tuple[str, torch.Tensor]]:
    """The float weights [N, K] of one step's products in forward order, q/k/v and gate/up fused
    as the formats fuse them (runtime/model.py FUSED_PROJECTIONS)."""
    out = []
    for i, b in enumerate(model.layers):
        a, m = b.self_attn, b.mlp
        out += [(f"l{i}_qkv", torch.cat([a.q_proj.weight, a.k_proj.weight, a.v_proj.weight])), (f"l{i}_o", a.o_proj.weight),
                (f"l{i}_gate_up", torch.cat([m.gate_proj.weight, m.up_proj.weight])), (f"l{i}_down", m.down_proj.weight)]
    out.append(("lm_head", model.lm_head.weight))
    return [(n, w.detach().float().contiguous()) for n, w in out]


def inputs(widths: list[int], sizes: set[int]) -> dict[int, dict[int, torch.Tensor]]:
    """Per width, one float32 input [W, K] per input width K (every product of that K reads it)."""
    g = torch.Generator().manual_seed(0)
    return {w: {k: torch.randn(w, k, generator=g) for k in sorted(sizes)} for w in widths}


def module_bytes(m: torch.nn.Module) -> int:
    return sum(t.numel() * t.element_size() for t in list(m.buffers()) + list(m.parameters()) if t is not None)


def torch_system(name: str, layers: list, xs, note: str = "", mb: float | None = None) -> System:
    """Products that are torch modules, called one by one as our model calls them."""
    def step(w, xs=xs):
        pairs = [(m, xs[w][m.in_features]) for m in layers]
        return lambda: [m(x) for m, x in pairs]

    def head(w, xs=xs):
        m, x = layers[-1], xs[w][layers[-1].in_features]
        return lambda: m(x)

    size = mb if mb is not None else sum(module_bytes(m) for m in layers) / 1e6
    return System(name, size, step, head, note)


class Products(torch.nn.Module):
    """``layers`` called in order as one module, on the two input widths (hidden, intermediate):
    what a package or program of one step's products runs."""

    def __init__(self, layers) -> None:
        super().__init__()
        self.lins = torch.nn.ModuleList(layers)

    def forward(self, x_small: torch.Tensor, x_large: torch.Tensor) -> tuple[torch.Tensor, ...]:
        by_k = {x.shape[1]: x for x in (x_small, x_large)}
        return tuple(m(by_k[m.in_features]) for m in self.lins)


def aoti_system(name: str, model, xs, note: str) -> System:
    """``model``'s products compiled into one AOTInductor package (W dynamic, 1..16), as
    ``yggtree compile`` compiles a step: the library's ops called through their C shims."""
    import tempfile
    from pathlib import Path

    from yggtree.runtime.aoti import package_config

    layers = forward_layers(model)
    fn = Products(layers)
    ks = sorted({m.in_features for m in layers})
    dim = torch.export.Dim("W", min=1, max=max(16, *xs))
    with torch.no_grad():
        ep = torch.export.export(fn, tuple(torch.randn(2, k) for k in ks), dynamic_shapes=tuple({0: dim} for _ in ks),
                                 strict=False)
        path = Path(tempfile.mkdtemp(prefix="bench_libraries_")) / "products.pt2"
        config = package_config(model.layers[0])  # the library's ops through their C shims
        runner = torch._inductor.aoti_load_package(
            torch._inductor.aoti_compile_and_package(ep, package_path=str(path), inductor_configs=config))
        w0 = next(iter(xs))
        if not all(torch.equal(a, b) for a, b in zip(runner(*(xs[w0][k] for k in ks)), fn(*(xs[w0][k] for k in ks)))):
            raise YggError("the package's products differ from the modules' (bitwise)")

    def step(w):
        args = tuple(xs[w][k] for k in ks)
        return lambda: runner(*args)

    eager = torch_system(name, layers, xs)
    return System(name, eager.weights_mb, step, eager.head, note + "; one package (the head timed eagerly)")


def fbgemm_layers(weights, engine: str) -> list:
    """torch's dynamic-quantized int8 linears (per-channel weights) of the float weights."""
    from torch.ao.quantization import per_channel_dynamic_qconfig, quantize_dynamic

    if engine not in torch.backends.quantized.supported_engines:
        raise YggError(f"quantized engine {engine} is not in this torch ({torch.backends.quantized.supported_engines})")
    torch.backends.quantized.engine = engine
    seq = torch.nn.Sequential()
    for _, wt in weights:
        lin = torch.nn.Linear(wt.shape[1], wt.shape[0], bias=False)
        lin.weight.data = wt.clone()
        seq.append(lin)
    q = quantize_dynamic(seq, {torch.nn.Linear: per_channel_dynamic_qconfig}, dtype=torch.qint8)
    return list(q)


# ----------------------------------------------------------------------------- onnxruntime


def ort_model(weights, head_bits: int):
    """One ONNX graph of every product (``MatMul`` on its float weight, quantized by onnxruntime's
    own ``MatMulNBitsQuantizer`` to ``MatMulNBits``: the blocks at 4 bits, the LM head at
    ``head_bits``), inputs ``x{K}`` [W, K] shared by the products of one K, outputs ``y{i}``."""
    import onnx
    from onnx import TensorProto, helper, numpy_helper
    from onnxruntime.quantization.matmul_nbits_quantizer import DefaultWeightOnlyQuantConfig, MatMulNBitsQuantizer

    def graph(items):
        nodes, inits, outs = [], [], []
        for name, wt in items:
            n, k = wt.shape
            inits.append(numpy_helper.from_array(wt.t().contiguous().numpy(), f"w_{name}"))
            nodes.append(helper.make_node("MatMul", [f"x{k}", f"w_{name}"], [f"y_{name}"], name=name))
            outs.append(helper.make_tensor_value_info(f"y_{name}", TensorProto.FLOAT, ["W", n]))
        ks = sorted({w.shape[1] for _, w in items})
        ins = [helper.make_tensor_value_info(f"x{k}", TensorProto.FLOAT, ["W", k]) for k in ks]
        return helper.make_model(helper.make_graph(nodes, "products", ins, outs, inits),
                                 opset_imports=[helper.make_opsetid("", 21), helper.make_opsetid("com.microsoft", 1)])

    def quantize(model, bits):
        cfg = DefaultWeightOnlyQuantConfig(block_size=GROUP, is_symmetric=False, accuracy_level=4, bits=bits)
        q = MatMulNBitsQuantizer(model, bits=bits, block_size=GROUP, is_symmetric=False, accuracy_level=4, algo_config=cfg)
        q.process()
        return q.model.model

    import logging

    logging.getLogger("onnxruntime.quantization.matmul_nbits_quantizer").setLevel(logging.WARNING)
    blocks = quantize(graph(weights[:-1]), 4)
    head = quantize(graph(weights[-1:]), head_bits)
    merged = onnx.ModelProto()
    merged.CopyFrom(blocks)  # the head's node, initializers and output appended: forward order
    merged.graph.node.extend(head.graph.node)
    merged.graph.initializer.extend(head.graph.initializer)
    merged.graph.output.extend(head.graph.output)
    if not any(i.name == head.graph.input[0].name for i in merged.graph.input):
        merged.graph.input.extend(head.graph.input)
    ops = {n.op_type for n in merged.graph.node}
    if ops != {"MatMulNBits"}:
        raise YggError(f"onnxruntime's quantizer left {sorted(ops - {'MatMulNBits'})} nodes unquantized")
    return merged


def single_node(model, node):
    """The model of ``node`` alone, with its initializers, input and output."""
    import onnx
    from onnx import helper

    g = model.graph
    inits = [i for i in g.initializer if i.name in node.input]
    ins = [i for i in g.input if i.name in node.input]
    outs = [o for o in g.output if o.name in node.output]
    m = helper.make_model(helper.make_graph([node], node.name, ins, outs, inits), opset_imports=list(model.opset_import))
    onnx.checker.check_model(m)
    return m


def ort_systems(weights, xs, threads: int, head_bits: int, want: set[str], spin: bool = False) -> list[System]:
    import onnxruntime as ort

    model = ort_model(weights, head_bits)

    def session(m):
        so = ort.SessionOptions()
        so.intra_op_num_threads, so.inter_op_num_threads = threads, 1
        # its threads sleep between calls: spinning ones take a core from the next library's call
        # (torch's OpenMP barriers then wait on a descheduled thread: steps 10-50x slower)
        so.add_session_config_entry("session.intra_op.allow_spinning", "1" if spin else "0")
        so.execution_mode = ort.ExecutionMode.ORT_SEQUENTIAL
        so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
        so.log_severity_level = 3
        return ort.InferenceSession(m.SerializeToString(), so, providers=["CPUExecutionProvider"])

    dims = {o.name: o.type.tensor_type.shape.dim[1].dim_value for o in model.graph.output}

    def bound(sess, w):
        """``sess`` bound to the width-``w`` inputs and to preallocated outputs: one call runs it."""
        b, keep = sess.io_binding(), []
        for i in sess.get_inputs():
            keep.append(xs[w][int(i.name[1:])].numpy())
            b.bind_cpu_input(i.name, keep[-1])
        for o in sess.get_outputs():
            keep.append(np.empty((w, dims[o.name]), np.float32))
            b.bind_output(o.name, "cpu", element_type=np.float32, shape=keep[-1].shape, buffer_ptr=keep[-1].ctypes.data)
        return lambda keep=keep: sess.run_with_iobinding(b)

    mb = sum(len(i.raw_data) or 0 for i in model.graph.initializer) / 1e6
    nodes = list(model.graph.node)
    head_sess = session(single_node(model, nodes[-1]))
    head = lambda w: bound(head_sess, w)  # noqa: E731
    # check the graph against the float products (a wrong layout would time nonsense)
    whole = session(model)
    w0 = next(iter(xs))
    ref = xs[w0][weights[-1][1].shape[1]] @ weights[-1][1].t()
    got = whole.run([f"y_{weights[-1][0]}"], {i.name: xs[w0][int(i.name[1:])].numpy() for i in whole.get_inputs()})[0]
    err = float(np.abs(got - ref.numpy()).max() / ref.abs().max())
    if err > 0.05:
        raise YggError(f"onnxruntime's LM head is off by {err:.3f} of its largest output")
    blocks = f"MatMulNBits 4-bit/{GROUP} acc4, head {head_bits}-bit; onnxruntime {ort.__version__}"
    systems = []
    if "ort" in want:
        systems.append(System("ort", mb, lambda w: bound(whole, w), head, f"{blocks}, one graph"))
    if "ort-layers" in want:
        sessions = [session(single_node(model, n)) for n in nodes]

        def step(w):
            calls = [bound(s, w) for s in sessions]
            return lambda: [c() for c in calls]

        systems.append(System("ort-layers", mb, step, head, f"{blocks}, a session per product"))
    return systems


# ----------------------------------------------------------------------------- XNNPACK (ExecuTorch)


def xnnpack_system(weights, xs, threads: int) -> System:
    """XNNPACK's int8-dynamic-activation 4-bit-weight products through ExecuTorch, one program."""
    try:
        from executorch.backends.xnnpack.partition.xnnpack_partitioner import XnnpackPartitioner
        from executorch.exir import to_edge_transform_and_lower
        from executorch.extension.pybindings import portable_lib
        from torchao.quantization import Int8DynamicActivationIntxWeightConfig, quantize_
        from torchao.quantization.granularity import PerAxis, PerGroup
    except ImportError as e:
        raise YggError(f"executorch does not import here ({e})") from None
    from importlib.metadata import version

    def linear(wt):
        lin = torch.nn.Linear(wt.shape[1], wt.shape[0], bias=False)
        lin.weight.data = wt.clone()
        return lin

    def program(items):
        mod = Products([linear(wt) for _, wt in items]).eval()
        last = len(items) - 1 if items[-1][0] == "lm_head" else None
        quantize_(mod, Int8DynamicActivationIntxWeightConfig(weight_dtype=torch.int4, weight_granularity=PerGroup(GROUP)),
                  filter_fn=lambda m, fqn: isinstance(m, torch.nn.Linear) and fqn != f"lins.{last}")
        if last is not None:
            quantize_(mod, Int8DynamicActivationIntxWeightConfig(weight_dtype=torch.int8, weight_granularity=PerAxis(0)),
                      filter_fn=lambda m, fqn: isinstance(m, torch.nn.Linear) and fqn == f"lins.{last}")
        wmax = max(xs)
        dim = torch.export.Dim("W", min=1, max=max(wmax, 2))
        example = tuple(torch.randn(2, k) for k in ks)
        ep = torch.export.export(mod, example, dynamic_shapes=tuple({0: dim} for _ in ks))
        prog = to_edge_transform_and_lower(ep, partitioner=[XnnpackPartitioner()]).to_executorch()
        buffer = prog.buffer  # the loaded program reads it in place: kept alive beside it
        return (portable_lib._load_for_executorch_from_buffer(buffer), buffer), len(buffer)

    ks = sorted({wt.shape[1] for _, wt in weights})
    if len(ks) != 2:
        raise YggError(f"the products read {len(ks)} input widths; this program takes two")
    portable_lib._unsafe_reset_threadpool(threads)
    (whole, whole_buf), size = program(weights)
    (head_prog, head_buf), _ = program(weights[-1:])
    w0 = next(iter(xs))
    got = whole.forward(tuple(xs[w0][k] for k in ks))[-1]
    ref = xs[w0][weights[-1][1].shape[1]] @ weights[-1][1].t()
    err = float((got - ref).abs().max() / ref.abs().max())
    if err > 0.05:
        raise YggError(f"XNNPACK's LM head is off by {err:.3f} of its largest output")

    def step(w):
        args = tuple(xs[w][k] for k in ks)
        return lambda: whole.forward(args)

    def head(w):
        args = tuple(xs[w][k] for k in ks)
        return lambda: head_prog.forward(args)

    return System("xnnpack", size / 1e6, step, head,
                  f"ExecuTorch {version('executorch')} XNNPACK qd8 4-bit/{GROUP} symmetric, head qc8w; one program",
                  {"buffers": (whole_buf, head_buf)})


# ----------------------------------------------------------------------------- run


def build(name: str, args, xs, floats) -> list[System]:
    if name == "w4a8":
        return [torch_system(name, forward_layers(prepare("w4a8", "torch")), xs,
                             "ours: GGUF Q4 blocks, head Q8_0; int8 activations")]
    if name == "w4a8-aoti":
        return [aoti_system(name, prepare("w4a8", "torch"), xs, "ours as `yggtree compile` packages it")]
    if name == "int8-tiled":
        return [torch_system(name, forward_layers(prepare("int8", "tiled")), xs, "ours: int8 per channel, 16-bit activations")]
    if name == "torch-int8":
        return [torch_system(name, forward_layers(prepare("int8", "torch")), xs, "aten._weight_int8pack_mm, bf16 activations")]
    if name == "torch-int4":
        return [torch_system(name, forward_layers(prepare(f"int4@{GROUP}", "torch")), xs,
                             f"aten._weight_int4pack_mm_for_cpu /{GROUP} (head too), bf16 activations")]
    if name == "fbgemm":
        layers = fbgemm_layers(floats(), args.engine)
        mb = sum(w.numel() + 8 * w.shape[0] for _, w in floats()) / 1e6  # int8 codes + per-channel scale, zero point
        return [torch_system(name, layers, xs, f"quantize_dynamic int8 per channel on {args.engine}", mb)]
    if name in ("ort", "ort-layers"):
        return ort_systems(floats(), xs, args.threads, args.ort_head_bits, {name}, args.ort_spin)
    if name == "xnnpack":
        return [xnnpack_system(floats(), xs, args.threads)]
    raise YggError(f"unknown system {name!r} (choose from {', '.join(SYSTEMS)})")


def wait_quiet(minutes: float, window_s: float = 10.0) -> dict | None:
    """Sleep until ``window_s`` of idle sees other processes keep at most ``BUSY_CORES`` cores busy
    (LoadMeter) or ``minutes`` have passed: how long it waited and the last window's load."""
    from yggtree.offline.timing import BUSY_CORES, LoadMeter

    if minutes <= 0:
        return None
    t0 = time.monotonic()
    while True:
        with LoadMeter() as m:
            time.sleep(window_s)
        load = m.result or {"other_cores": 0.0, "steal_cores": 0.0}
        done = load["other_cores"] <= BUSY_CORES and load["steal_cores"] <= BUSY_CORES
        if done or time.monotonic() - t0 > minutes * 60:
            return {"waited_s": round(time.monotonic() - t0), "quiet": done, "last_window": load}


def run(args) -> int:
    from yggtree.offline.timing import LoadMeter, load_warning
    from yggtree.runtime.kernels import isa
    from yggtree.runtime.loading import load_model, resolve_model

    torch.set_num_threads(args.threads)
    bad = [s for s in args.systems if s not in SYSTEMS]
    if bad:
        raise YggError(f"unknown system {bad[0]!r} (choose from {', '.join(SYSTEMS)})")
    if not {"w4a8", "w4a8-aoti"} & set(args.systems):
        raise YggError("--systems must include w4a8 or w4a8-aoti (the reference every ratio is to)")
    float_model = load_model(resolve_model("default"))
    cfg = float_model.cfg
    cached = []

    def floats():
        if not cached:
            cached.append(float_products(float_model))
        return cached[0]

    xs = inputs(args.widths, {cfg.hidden_size, cfg.intermediate_size})
    systems, skipped = [], {}
    wants = list(dict.fromkeys(args.systems))
    if "ort" in wants and "ort-layers" in wants:  # one quantized model and pool for both
        wants.remove("ort-layers")
    for name in wants:
        try:
            if name == "ort" and "ort-layers" in args.systems:
                systems += ort_systems(floats(), xs, args.threads, args.ort_head_bits, {"ort", "ort-layers"}, args.ort_spin)
            else:
                systems += build(name, args, xs, floats)
        except (YggError, ImportError, RuntimeError) as e:
            skipped[name] = str(e).splitlines()[0]
            sys.stderr.write(f"{name}: skipped ({skipped[name]})\n")
    built = [s.name for s in systems]
    reference = "w4a8-aoti" if "w4a8-aoti" in built else "w4a8"
    if reference not in built:
        raise YggError(f"the reference {reference} did not build ({skipped.get(reference)})")
    calls = {}
    for s in systems:
        for w in args.widths:
            calls[(s.name, "step", w)] = s.step(w)
            calls[(s.name, "head", w)] = s.head(w)
    waited = wait_quiet(args.wait_quiet)
    keys = list(calls)
    times = {k: [] for k in keys}
    rng = random.Random(0)
    with torch.no_grad(), LoadMeter() as meter:
        for r in range(args.repeats + 1):  # round 0: warm-up
            order = keys[:]
            rng.shuffle(order)
            for k in order:
                time.sleep(args.gap_ms / 1e3)  # the previous call's threads (any library's) back asleep
                t0 = time.perf_counter()
                calls[k]()
                if r:
                    times[k].append((time.perf_counter() - t0) * 1e3)
    med = {k: statistics.median(v) for k, v in times.items()}
    envs = {e: os.environ[e] for e in ISA_ENVS if e in os.environ}
    print(f"one decode step's products ({cfg.num_layers} blocks + LM head), {args.threads} thread(s), median ms of "
          f"{args.repeats} rounds; our library {isa()}, torch {torch.__version__}, quantized engine {args.engine}; "
          f"x ref: over {reference} at the same W"
          + (f"; {' '.join(f'{k}={v}' for k, v in envs.items())}" if envs else ""))
    head = f"{'system':<12} {'weights MB':>10}" + "".join(f" {'W=' + str(w):>7} {'x ref':>6}" for w in args.widths)
    head += f" {'W8/W1':>6} {'head W=1':>8} {'head W=8':>8}"
    print(head)
    rows = []
    ref = {w: med[(reference, "step", w)] for w in args.widths}
    for s in systems:
        st = {w: med[(s.name, "step", w)] for w in args.widths}
        hd = {w: med[(s.name, "head", w)] for w in args.widths}
        line = f"{s.name:<12} {s.weights_mb:>10.1f}" + "".join(f" {st[w]:>7.2f} {st[w] / ref[w]:>6.2f}" for w in args.widths)
        w8 = st[8] / st[1] if 1 in st and 8 in st else float("nan")
        line += f" {w8:>6.2f} {hd.get(1, float('nan')):>8.2f} {hd.get(8, float('nan')):>8.2f}"
        print(line)
        rows.append({"system": s.name, "note": s.note, "weights_mb": round(s.weights_mb, 2),
                     "step_ms": {w: round(st[w], 3) for w in args.widths},
                     "head_ms": {w: round(hd[w], 3) for w in args.widths},
                     "x_reference": {w: round(st[w] / ref[w], 3) for w in args.widths}})
    for s in systems:
        print(f"  {s.name}: {s.note}")
    for name, why in skipped.items():
        print(f"  {name}: skipped ({why})")
    if waited is not None:
        print(f"waited {waited['waited_s']} s for a quiet machine ({'found' if waited['quiet'] else 'not found'}; "
              f"last {waited['last_window']})")
    print(f"load while timing: {meter.result}")
    warn = load_warning("bench_libraries", meter.result)
    if warn:
        sys.stderr.write(warn + "\n")
    print(json.dumps({"command": "bench_libraries", "reference": reference, "isa": isa(), "threads": args.threads,
                      "repeats": args.repeats, "engine": args.engine, "ort_head_bits": args.ort_head_bits, "env": envs,
                      "load": meter.result, "waited": waited,
                      "torch": torch.__version__, "rows": rows, "skipped": skipped}))
    return 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    csv = lambda t: [x for x in t.split(",") if x]  # noqa: E731
    p.add_argument("--systems", type=csv, default=list(SYSTEMS))
    p.add_argument("--widths", type=lambda t: [int(x) for x in t.split(",")], default=[1, 2, 4, 8, 16])
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--repeats", type=int, default=15)
    p.add_argument("--engine", default="fbgemm", help="torch.backends.quantized.engine for fbgemm (default fbgemm)")
    p.add_argument("--ort-head-bits", type=int, choices=(4, 8), default=8,
                   help="MatMulNBits bits of the LM head (default 8: as ours, whose GGUF stores it Q8_0)")
    p.add_argument("--gap-ms", type=float, default=20.0,
                   help="idle milliseconds before each timed call (default 20): a library's thread pool still "
                        "spinning after its call would take a core from the next one")
    p.add_argument("--wait-quiet", type=float, default=0.0, metavar="MINUTES",
                   help="after building, wait up to this long for other processes to leave the cores idle")
    p.add_argument("--ort-spin", action="store_true",
                   help="let onnxruntime's threads spin between calls (its default; it slows the other systems' calls)")
    args = p.parse_args(argv)
    return run_reporting("bench_libraries", run, args)


if __name__ == "__main__":
    sys.exit(main())
