"""The kernel record of the machine this runs on, from what `yggtree compile` measured and cached:
every compiled plan's manifest under a compile root (product kernel, padding, allocator, loops)
and the measurements behind them (the kernel, allocator caches). Writes one JSON document.

    python reports/xeon_record/collect.py compile-xeon > reports/xeon_record/record.json
"""

import json
import platform
import sys
from pathlib import Path

from yggtree.files import cache_root

KEEP = ("plan_name", "threads", "packed_kernel", "packed_min_rows", "attention", "allocator", "loops",
        "versions", "created", "compile_s")


def main(root: str) -> None:
    cpu = next((line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                if line.startswith("model name")), platform.processor())
    plans = {}
    for m in sorted(Path(root).glob("*/manifest.json")):
        d = json.loads(m.read_text())
        plans[d["plan_name"]] = {"weights": d["plan"].get("weights", d["dtype"])} | {k: d[k] for k in KEEP if k in d}
    kernels = []
    for f in sorted((cache_root() / "kernels").glob("choice-*.json")):
        d = json.loads(f.read_text())
        if "/tmp/" not in str(d.get("key", {}).get("model", "")):  # the tests' tiny models are not the record
            kernels.append(d)
    allocators = [json.loads(f.read_text()) for f in sorted((cache_root() / "allocator").glob("choice-*.json"))]
    json.dump({"cpu": cpu, "plans": plans, "kernel_measurements": kernels, "allocator_measurements": allocators},
              sys.stdout, indent=1)
    print()


if __name__ == "__main__":
    main(sys.argv[1])
