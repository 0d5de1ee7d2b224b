"""Token agreement of each yggtree format's plain greedy output with llama.cpp's on the same GGUF
(bench_formats results.json): llama.cpp's text re-tokenized with the model's tokenizer, mean
common prefix over prompts and prompts identical over the first 32 tokens.

    python reports/formats_w4a8_agree.py reports/formats_w4a8/results.json
"""
import json
import sys

from yggtree.runtime.loading import load_tokenizer, resolve_model


def common(a, b):
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


r = json.loads(open(sys.argv[1]).read())
tok = load_tokenizer(resolve_model("default"))
rows = {}
for p in r["per_prompt"]:
    ref = tok.encode(p["llama.cpp"]["text"], add_special_tokens=False)
    for k, v in p.items():
        if k.startswith("ygg/") and k.endswith("/plain"):
            n = min(len(ref), len(v["tokens"]))
            rows.setdefault(k, []).append(common(ref[:n], v["tokens"][:n]))
out = {k: {"mean_common_prefix": sum(v) / len(v), "first_32_identical": sum(c >= 32 for c in v),
           "prompts": len(v)} for k, v in rows.items()}
print(json.dumps(out, indent=1))
