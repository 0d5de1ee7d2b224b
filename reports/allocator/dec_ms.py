"""Median decode ms/token of the plan's plain engine over 8 chat prompts of our own x 64 (one pass after a warm-up)."""
import sys, statistics, torch
sys.path.insert(0, str(__import__("pathlib").Path(__file__).resolve().parents[1]))
from ab import chat_prompts, decoder
from yggtree.bench import plan_runner
torch.set_num_threads(2)
plan, info, make = plan_runner(sys.argv[1])
eng, tok, _ = make(False)
prompts = chat_prompts(tok); dec = decoder(eng)
dec(prompts[0])
ms = [dec(p)[0] for p in prompts]
print(f"{statistics.median(ms):.3f}")
