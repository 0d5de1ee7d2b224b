#!/usr/bin/env python
"""Plain (autoregressive) decoding benchmark: transformers vs yggtree reference and compiled.

A thin wrapper over ``python -m yggtree.bench`` (same options; see ``--help``), e.g.::

    python scripts/bench_ar.py --prompts 4 --max-new-tokens 64 --dtype both --repeats 3 --out reports/ar
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing

from yggtree.bench import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
