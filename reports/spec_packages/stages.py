"""A compiled speculative plan: its objective and fixed trees against its own plain steps (decode time per token;
and, in brackets, the whole request per token, prefill included: a policy that may decode plainly defers the
drafter's prompt prefill to its first drafted step, inside the decode time), on
held-out calibration-corpus prompts (not evaluation prompts), systems interleaved per prompt.
usage: python reports/spec_packages/stages.py PLAN N_PROMPTS NEW_TOKENS [D,W_d,W_v ...] [--root=COMPILE_ROOT]"""
import sys, json, statistics, torch
from yggtree.bench import plan_runner
from yggtree.runtime.build import fixed_policy
from yggtree.runtime.policy import FixedPolicy, StepChoice
from yggtree.shapes import SamplingParams
from yggtree.data import calibration_chat_prompts
from yggtree.runtime.loading import encode_prompt

root = next((a.split("=", 1)[1] for a in sys.argv if a.startswith("--root=")), "compile")  # the compile root
argv = [a for a in sys.argv if not a.startswith("--root=")]
plan_path, n_prompts, new = argv[1], int(argv[2]), int(argv[3])
trees = [tuple(int(x) for x in t.split(",")) for t in argv[4:]]  # d,wd,wv
torch.set_num_threads(2)
plan, info, make = plan_runner(plan_path, compile_root=root)
eng, tok, pol = make()
prompts = [encode_prompt(tok, p.text) for p in calibration_chat_prompts(30 + n_prompts, seed=7)[30:]]
params = SamplingParams(max_new_tokens=new)
systems = {"plain": FixedPolicy(StepChoice(0, 1), 1), "objective": pol}
for d, wd, wv in trees:
    systems[f"d{d}w{wd}v{wv}"] = fixed_policy(eng, plan, draft_width=wd, verify_width=wv, draft_depth=d)
rows = {k: [] for k in systems}
for rep in range(2):
    for ids in prompts:
        for name, p in systems.items():
            r = eng.generate(ids, params, policy=p)
            if rep == 1:
                rows[name].append(r)
texts = {name: [r.token_ids for r in rs] for name, rs in rows.items()}
out = {}
for name, rs in rows.items():
    dec_t = sum(r.stats["tpot_ms"] * (r.stats["new_tokens"] - 1) for r in rs)
    dec_n = sum(r.stats["new_tokens"] - 1 for r in rs)
    steps = sum(r.stats["verify_calls"] for r in rs)
    stage = {}
    for r in rs:
        for k, v in r.stats.get("stage_ms", {}).items():
            stage[k] = stage.get(k, 0) + v
    e2e = sum(r.stats["total_ms"] for r in rs) / sum(r.stats["new_tokens"] for r in rs)
    out[name] = {"ms_per_token": dec_t / dec_n, "e2e_ms_per_token": e2e, "aal": sum(r.stats.get("accepted_tokens", 0) + r.stats["verify_calls"] for r in rs) / steps,
                 "stage_ms_per_step": {k: round(v / steps, 3) for k, v in stage.items() if v},
                 "same_as_plain": sum(a == b for a, b in zip(texts[name], texts["plain"]))}
base = out["plain"]["ms_per_token"]; base_e2e = out["plain"]["e2e_ms_per_token"]
for name, o in out.items():
    print(f"{name:12s} {o['ms_per_token']:.2f} ms/token  x plain {base / o['ms_per_token']:.3f}  (prefill included {base_e2e / o['e2e_ms_per_token']:.3f})  AAL {o['aal']:.2f}  "
          f"= plain {o['same_as_plain']}/{len(prompts)}  {o['stage_ms_per_step']}", flush=True)
print(json.dumps({"plan": plan.name, "prompts": len(prompts), "new": new, "systems": out}))
