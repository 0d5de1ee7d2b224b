"""The w4a8 plan's plain engine (compiled packages), median decode ms/token on our chat prompts;
w4a8_mix.py also runs an engine of another format (argv[1]) on the tiled kernel in between. Run from
the checkout to measure (the plan path is relative)."""
import sys, statistics, torch
sys.path.insert(0, str(__import__("pathlib").Path(__file__).resolve().parents[1]))  # reports/ab.py
from ab import chat_prompts, decoder
from yggtree.bench import plan_runner
from yggtree.runtime.build import EngineSpec, build_engine
torch.set_num_threads(2)
plan, info, make = plan_runner("profiles/epyc-2core-w4a8.yaml")
eng, tok, _ = make(False)
dec = decoder(eng)
ps = chat_prompts(tok)[:4]
dec(ps[0])
print("w4a8 alone", round(statistics.median([dec(p)[0] for p in ps]), 3), flush=True)
other, _ = build_engine(EngineSpec(model="default", dtype="float32", weights=sys.argv[1], kernel="tiled"))
od = decoder(other)
print(sys.argv[1], "tiled", round(statistics.median([od(p)[0] for p in ps]), 3), flush=True)
print("w4a8 after", round(statistics.median([dec(p)[0] for p in ps]), 3), flush=True)
