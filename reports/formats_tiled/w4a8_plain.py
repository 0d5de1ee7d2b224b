"""The w4a8 plan's plain engine (compiled packages), median decode ms/token on our chat prompts.
``python reports/formats_tiled/w4a8_plain.py LABEL`` times it on 8 prompts; with a second argument
FMT (``... LABEL int8``) on 4 prompts, then an engine of format FMT on the tiled kernel in the same
process, then the w4a8 plan again. Run from the checkout (the plan path is relative)."""
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # reports/ab.py
from ab import chat_prompts, decoder  # noqa: E402

from yggtree.bench import plan_runner  # noqa: E402
from yggtree.runtime.build import EngineSpec, build_engine  # noqa: E402

torch.set_num_threads(2)
plan, info, make = plan_runner("profiles/epyc-2core-w4a8.yaml")
eng, tok, _ = make(False)
dec = decoder(eng)
other = sys.argv[2] if len(sys.argv) > 2 else None
ps = chat_prompts(tok)[: 4 if other else 8]
dec(ps[0])


def median_ms(run) -> float:
    return round(statistics.median([run(p)[0] for p in ps]), 3)


if other is None:
    print(sys.argv[1], "median ms/token", median_ms(dec))
else:
    print("w4a8 alone", median_ms(dec), flush=True)
    engine, _ = build_engine(EngineSpec(model="default", dtype="float32", weights=other, kernel="tiled"))
    print(other, "tiled", median_ms(decoder(engine)), flush=True)
    print("w4a8 after", median_ms(dec), flush=True)
