"""The w4a8 plan's plain engine (compiled packages), median decode ms/token on our chat prompts;
w4a8_mix.py also runs an engine of another format (argv[1]) on the tiled kernel in between. Run from
the checkout to measure (the plan path is relative)."""
import sys, statistics, torch
sys.path.insert(0, str(__import__("pathlib").Path(__file__).resolve().parents[1]))  # reports/ab.py
from ab import chat_prompts, decoder
from yggtree.bench import plan_runner
torch.set_num_threads(2)
plan, info, make = plan_runner("profiles/epyc-2core-w4a8.yaml")
eng, tok, _ = make(False)
dec = decoder(eng)
ps = chat_prompts(tok)
dec(ps[0])
ts = [dec(p)[0] for p in ps]
print(sys.argv[1], "median ms/token", round(statistics.median(ts), 3))
