"""The plan's greedy decode ms/token (prefill excluded), median over 8 chat prompts of our own x 2 rounds."""
import sys, statistics, torch
sys.path.insert(0, str(__import__("pathlib").Path(__file__).resolve().parents[1]))  # reports/ab.py
from ab import chat_prompts, decoder
from yggtree.bench import plan_runner
torch.set_num_threads(2)
plan, info, make = plan_runner(sys.argv[1])
eng, tok, _ = make(False)
prompts = chat_prompts(tok); dec = decoder(eng)
dec(prompts[0])
ts = [dec(p)[0] for _ in range(2) for p in prompts]
print(f"{statistics.median(ts):.3f} ms/token (median of {len(ts)}), prompt lengths {min(map(len, prompts))}-{max(map(len, prompts))}")
