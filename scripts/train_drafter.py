"""Retrain the shipped default drafter from scratch (a thin wrapper over ``yggtree distill``).

    python scripts/train_drafter.py [--out DIR] [extra distill options...]

runs ``python -m yggtree.offline.distill --model default --threads 1 --out DIR`` with the
options the shipped head (yggtree/assets/drafters/smollm2-135m-eagle) was trained with (extra
options given here override them); its manifest.json records them all. Output is deterministic
given the seed and the thread count. About an hour on one core of this machine: teacher data
~20 min (640 chat prompts answered greedily + 600k characters of calibration text teacher-forced,
both cached under ~/.cache/yggtree/distill), training ~40 min.
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from yggtree.offline.distill import main  # noqa: E402

SHIPPED = [
    "--model", "default", "--threads", "1",
    "--prompts", "640", "--max-new-tokens", "128", "--gen-batch", "16",
    "--text-chars", "600000", "--val-frac", "0.03",
    "--epochs", "2", "--batch-size", "4", "--lr", "8e-4",
    "--unroll", "3", "--unroll-decay", "0.9", "--eval-every", "100",
]

if __name__ == "__main__":
    argv = sys.argv[1:]
    if "--out" not in argv:
        argv = ["--out", "drafter-retrained", *argv]
    sys.exit(main(SHIPPED + argv))
