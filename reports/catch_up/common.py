"""What the objective scripts here share: a compiled speculative plan's engine and objective policy, and the 6
held-out calibration-corpus prompts reports/spec_packages/stages.py decodes (not evaluation prompts)."""
import torch

from yggtree.bench import plan_runner
from yggtree.data import calibration_chat_prompts
from yggtree.runtime.loading import encode_prompt


def objective_setup(plan_path: str):
    """(engine, objective policy, prompt ids) of ``plan_path`` at 2 threads."""
    torch.set_num_threads(2)
    plan, info, make = plan_runner(plan_path)
    eng, tok, pol = make()
    prompts = [encode_prompt(tok, p.text) for p in calibration_chat_prompts(36, seed=7)[30:]]
    return eng, pol, prompts
