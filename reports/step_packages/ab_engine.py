"""Paired A/B of the plan's plain engine: whole-step packages vs block packages only; decode ms/token
(prefill excluded) on 8 chat prompts of our own, 64 new tokens, alternating, 3 rounds."""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # reports/ab.py
from ab import chat_prompts, decoder, paired  # noqa: E402
import torch
from yggtree.bench import plan_runner
torch.set_num_threads(2)
plan, info, make = plan_runner(sys.argv[1])
eng, tok, _ = make(False)
sp = eng.target.step_packages
prompts = chat_prompts(tok)
dec = decoder(eng)


def on(path):
    def run(ids):
        eng.target.step_packages = path
        return dec(ids)
    return run


r = paired(on(sp), on(None), prompts)
eng.target.step_packages = sp
print(f"whole-step {r['a_ms']:.3f} ms/token, blocks {r['b_ms']:.3f} ms/token, speed-up median {r['speedup']:.3f} "
      f"(min {r['min']:.3f}, max {r['max']:.3f}); identical {r['same']}/{r['pairs']}")
