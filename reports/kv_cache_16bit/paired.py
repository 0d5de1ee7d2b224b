"""Paired ratios (yggtree.bench.paired_ratio) of a bench_formats results.json: python paired.py DIR/results.json"""
import json, sys
from yggtree.bench import paired_ratio
d = json.load(open(sys.argv[1]))
rows = d["per_prompt"]
a, b = "ygg/w4a8/plan:epyc-2core-plain-w4a8-kv16/plain", "ygg/w4a8/plan:epyc-2core-plain-w4a8/plain"
for x, y in ((a, b), (a, "llama.cpp"), (b, "llama.cpp")):
    c = paired_ratio(rows, x, y)
    print(f"{x} / {y}: {c['ratio']:.3f} [{c['ci95'][0]:.3f}, {c['ci95'][1]:.3f}]")
print("new tokens per prompt:", [r[a]["new_tokens"] for r in rows], [r["llama.cpp"]["new_tokens"] for r in rows])
