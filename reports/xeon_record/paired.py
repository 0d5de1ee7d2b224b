"""Paired ratios of the formats bench on this machine (yggtree.bench.paired_ratio over its per-prompt rows).
usage: python reports/xeon_record/paired.py reports/xeon_record/formats/results.json"""
import json
import sys

from yggtree.bench import paired_ratio

d = json.load(open(sys.argv[1]))
rows = d["per_prompt"]
names = [s["system"] for s in d["table"]] if isinstance(d["table"], list) else list(rows[0])
plans = [n for n in names if "/plan:" in n]
pairs = [(p, "llama.cpp") for p in plans] + [(f"ygg/{f}/plain", "llama.cpp") for f in ("int8", "int4", "gguf-native", "w4a8")]
pairs += [(p, p.split("/plan:")[0] + "/plain") for p in plans]
pairs += [(f"ygg/{f}/spec", f"ygg/{f}/plain") for f in d["formats"].split(",")]
print("paired ratios (yggtree.bench.paired_ratio: decode speed of the first over the second, 8 prompts, bootstrap 95% CI)")
for a, b in pairs:
    r = paired_ratio(rows, a, b)
    print(f"{a} vs {b}: {r['ratio']:.3f} [{r['ci95'][0]:.3f}, {r['ci95'][1]:.3f}], faster on {r['a_faster_share']:.0%}")
