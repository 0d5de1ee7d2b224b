"""Paired A/B of the plan's plain engine: weights on huge pages (as built) vs weights where the
loader left them (runtime.build.move_to_huge_pages patched out; the KV store stays on huge pages).
Decode ms/token, 8 chat prompts of our own, 64 new tokens, alternating, 3 rounds, 2 threads."""
import sys, statistics, torch
import yggtree.runtime.build as build
from yggtree.bench import plan_runner
from yggtree.runtime.engine import SamplingParams
from yggtree.runtime.hugepages import huge_page_bytes
torch.set_num_threads(2)
plan, info, make = plan_runner(sys.argv[1])
h0 = huge_page_bytes()
A, tok, _ = make(False)
h1 = huge_page_bytes()
real = build.move_to_huge_pages
build.move_to_huge_pages = lambda *a, **k: 0
B, _, _ = make(False)
build.move_to_huge_pages = real
print(f"huge-page bytes: {h0/1e6:.0f} MB before, {h1/1e6:.0f} MB after the first engine, {huge_page_bytes()/1e6:.0f} MB after both")
qs = ["Explain how a hash table works.", "Write a haiku about autumn rain.", "What causes the seasons on Earth?",
      "Give three tips for writing clean Python code.", "Summarise the plot of Romeo and Juliet.",
      "How do I reverse a linked list in C?", "Compare TCP and UDP briefly.", "Why is the sky blue?"]
prompts = [tok.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True, return_dict=False) for q in qs]
p = SamplingParams(max_new_tokens=64)
def dec(eng, ids):
    r = eng.generate(ids, p)
    return (r.stats["total_ms"] - r.stats["ttft_ms"]) / (len(r.token_ids) - 1), r.token_ids
dec(A, prompts[0]); dec(B, prompts[0])
ta, tb, same = [], [], 0
for rnd in range(3):
    for i, ids in enumerate(prompts):
        if (i + rnd) % 2: a = dec(A, ids); b = dec(B, ids)
        else: b = dec(B, ids); a = dec(A, ids)
        ta.append(a[0]); tb.append(b[0]); same += a[1] == b[1]
r = [b / a for a, b in zip(ta, tb)]
print(f"huge pages {statistics.median(ta):.3f} ms/token, ordinary {statistics.median(tb):.3f}; speed-up median {statistics.median(r):.3f} (min {min(r):.3f}, max {max(r):.3f}); identical {same}/{len(r)}")
