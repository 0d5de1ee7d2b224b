"""The w4a8 plan's plain engine (4 chat prompts x 64 tokens, median decode ms/token), measured
again in the same process as other things happen in it. Run from the checkout:

- ``python reports/bench_noise/same_process.py builds``: after each system the formats bench
  builds is built and run (an engine per format on the tiled kernel, the two transformers
  models), then with the cyclic GC frozen and disabled;
- ``... footprint``: alone, beside 6 GB of touched tensors, after they are freed, after an int8
  engine is built, run and freed."""
import gc
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # reports/ab.py
from ab import chat_prompts, decoder  # noqa: E402

from yggtree.bench import load_hf_model, plan_runner  # noqa: E402
from yggtree.runtime.build import EngineSpec, build_engine  # noqa: E402
from yggtree.runtime.loading import resolve_model  # noqa: E402

torch.set_num_threads(2)
_, _, make = plan_runner("profiles/epyc-2core-w4a8.yaml")
eng, tok, _ = make(False)
dec = decoder(eng)
ps = chat_prompts(tok)[:4]
dec(ps[0])


def med(run=dec) -> float:
    return round(statistics.median([run(p)[0] for p in ps]), 3)


def engine(fmt: str):
    dtype = "bfloat16" if fmt == "bfloat16" else "float32"
    return build_engine(EngineSpec(model="default", dtype=dtype, kernel="tiled",
                                   weights=None if fmt in ("float32", "bfloat16") else fmt))[0]


if sys.argv[1] == "builds":
    print("alone", med(), flush=True)
    keep = []
    for fmt in ["float32", "bfloat16", "int8", "int4", "gguf-native"]:
        keep.append(engine(fmt))
        print(fmt, "own", med(decoder(keep[-1])), "w4a8 after", med(), "gc objs", len(gc.get_objects()), flush=True)
    for dtype in ["float32", "bfloat16"]:
        keep.append(load_hf_model(resolve_model("default"), dtype))
        print("hf", dtype, "w4a8 after", med(), "gc objs", len(gc.get_objects()), flush=True)
    gc.freeze()
    print("after gc.freeze", med(), flush=True)
    gc.disable()
    print("gc disabled", med(), flush=True)
else:
    print("alone", med(), med(), flush=True)
    junk = [torch.ones(256 << 20, dtype=torch.uint8) for _ in range(24)]
    print("6GB junk", med(), med(), flush=True)
    del junk
    gc.collect()
    print("junk freed", med(), flush=True)
    e = engine("int8")
    print("int8 built", med(), med(), flush=True)
    d = decoder(e)
    d(ps[0])
    print("int8 ran", med(), med(), flush=True)
    del e, d
    gc.collect()
    print("int8 freed", med(), flush=True)
