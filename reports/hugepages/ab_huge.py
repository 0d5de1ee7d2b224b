"""Paired A/B of the plan's plain engine: weights on huge pages (as built) vs weights where the
loader left them (runtime.build.move_to_huge_pages patched out; the KV store stays on huge pages).
Decode ms/token, 8 chat prompts of our own, 64 new tokens, alternating, 3 rounds, 2 threads."""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # reports/ab.py
from ab import chat_prompts, decoder, paired  # noqa: E402
import torch
import yggtree.runtime.build as build
from yggtree.bench import plan_runner
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
r = paired(decoder(A), decoder(B), chat_prompts(tok))
print(f"huge pages {r['a_ms']:.3f} ms/token, ordinary {r['b_ms']:.3f}; speed-up median {r['speedup']:.3f} "
      f"(min {r['min']:.3f}, max {r['max']:.3f}); identical {r['same']}/{r['pairs']}")
