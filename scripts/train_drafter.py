"""Retrain the shipped default drafter from scratch (a thin wrapper over ``yggtree distill``).

    python scripts/train_drafter.py [--out DIR] [extra distill options...]

runs ``python -m yggtree.offline.distill --model default --threads 1 --out DIR`` with the
options the shipped head (yggtree/assets/drafters/smollm2-135m-eagle) was trained with; its
manifest.json records them all. Output is deterministic given the seed and the thread count.
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from yggtree.offline.distill import main  # noqa: E402

SHIPPED = ["--model", "default", "--threads", "1"]

if __name__ == "__main__":
    argv = sys.argv[1:]
    if "--out" not in argv:
        argv = ["--out", "drafter-retrained", *argv]
    sys.exit(main(SHIPPED + argv))
