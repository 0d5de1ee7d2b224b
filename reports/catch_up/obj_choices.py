"""The objective's choices over held-out prompts, one pass, a fresh policy: steps, realised and predicted AAL per (D, W_d, W_v).
usage: LD_PRELOAD=<jemalloc> OMP_NUM_THREADS=2 python reports/catch_up/obj_choices.py profiles/epyc-2core-w4a8.yaml NEW_TOKENS"""
import sys, torch, collections, statistics
from yggtree.shapes import SamplingParams
from common import objective_setup
eng, pol, prompts = objective_setup(sys.argv[1])
params = SamplingParams(max_new_tokens=int(sys.argv[2]))
cnt = collections.Counter(); acc = collections.defaultdict(list); pred = collections.defaultdict(list)
for ids in prompts:
    recs = []; n0 = len(pol.log)
    eng.generate(ids, params, policy=pol, on_step=recs.append)
    for p, rec in zip(pol.log[n0:], recs):
        k = (rec.choice.draft_depth, rec.choice.draft_width if rec.choice.draft_depth else 0, rec.verify_width)
        cnt[k] += 1; acc[k].append(1 + rec.n_accepted); pred[k].append(p.aal_online or p.aal)
for k, n in cnt.most_common(10):
    print(f"D{k[0]} Wd{k[1]} Wv{k[2]}: {n} steps, AAL realised {statistics.mean(acc[k]):.2f} predicted {statistics.mean(pred[k]):.2f}")
