"""scripts/compare_drafters.py with every linear of each head rounded through Q4_1 (what the w4a8
format does to an EAGLE head; QD=layers leaves the draft LM head float), to price that rounding:

    OMP_NUM_THREADS=2 python reports/drafter_w4a8/qcmp.py --drafter default --first 4000 --prompts 48 \
        --threads 2 --weights w4a8
    QD=layers OMP_NUM_THREADS=2 python reports/drafter_w4a8/qcmp.py ...   # the layer, fc and reduce only
"""
import os
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "scripts"))
import compare_drafters  # noqa: E402
from yggtree.errors import run_reporting  # noqa: E402
from yggtree.runtime import build  # noqa: E402
from yggtree.runtime.w4a8 import dequantize_blocks, q4_1_blocks  # noqa: E402

load = build.load_drafter


def rounded(*args, **kwargs):
    d = load(*args, **kwargs)
    net = d.net.float()  # in place: compare_drafters' own .float() is then a no-op
    skip = net.lm_head if os.environ.get("QD") == "layers" else None
    n = 0
    for mod in net.modules():
        if isinstance(mod, torch.nn.Linear) and mod is not skip and mod.in_features % 32 == 0:
            with torch.no_grad():
                mod.weight.copy_(dequantize_blocks(q4_1_blocks(mod.weight)).float())
            n += 1
    print(f"{n} linears rounded through Q4_1", file=sys.stderr)
    return d


build.load_drafter = rounded
sys.exit(run_reporting("qcmp", compare_drafters.main, compare_drafters.parse()))
