"""The objective's W_v pricing of a drafted tree (13 nodes: D 3, W_d 4), tensor ops against the
host lists, hot and after a 16 MB product at 2 threads (as after a verify); paired, alternating,
median microseconds of 300 calls each.

    python reports/policy_shortcut/verify_choice.py profiles/epyc-2core-w4a8.yaml
"""
import statistics
import sys
import time

import torch

from yggtree.plan import load_plan
from yggtree.runtime.calibration import Calibration, aal_by_width, aal_by_width_lists, path_values
from yggtree.runtime.tree import Tree

torch.set_num_threads(2)
plan = load_plan(sys.argv[1])
cal = Calibration.load(plan.calibration, plan)
g = torch.Generator().manual_seed(0)
parent = torch.tensor([0, 0, 0, 0, 0, 1, 1, 2, 3, 5, 5, 6, 8])
depth = torch.tensor([0, 1, 1, 1, 1, 2, 2, 2, 2, 3, 3, 3, 3])
edge = -torch.rand(13, generator=g) * 2
logp = torch.zeros(13)
for i in range(1, 13):
    logp[i] = logp[parent[i]] + edge[i]
tree = Tree(torch.arange(13), parent, depth, torch.ones(13, dtype=torch.bool), logp)
widths = [1, *plan.verify_widths]
a, b = torch.randn(2048, 2048), torch.randn(2048, 64)
fns = {"tensor": lambda: aal_by_width(path_values(tree, cal.edge_prob, 3), tree, widths),
       "lists": lambda: aal_by_width_lists(tree, cal, 3, widths)}
for cold in (False, True):
    res = {k: [] for k in fns}
    for i in range(300):
        for k in (("tensor", "lists") if i % 2 else ("lists", "tensor")):
            if cold:
                a @ b
            t0 = time.perf_counter()
            fns[k]()
            res[k].append((time.perf_counter() - t0) * 1e6)
    print(f"{'cold' if cold else 'hot '}: " + ", ".join(f"{k} {statistics.median(v):6.1f} us" for k, v in res.items()))
