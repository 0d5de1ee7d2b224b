"""reports/spec_packages/stages.py with the compiled speculative plan's engine at a given prefetch distance (its
profile predates the measurement, so it runs the library's default, 1024): the measured distance's effect on trees.
usage: python reports/xeon_record/prefetch/stages_at.py DISTANCE PLAN N_PROMPTS NEW_TOKENS [D,W_d,W_v ...] [--root=ROOT]"""
import runpy, sys
from pathlib import Path
import yggtree.plan

distance = int(sys.argv.pop(1))
yggtree.plan.profile_prefetch = lambda path: distance  # what a profile measuring it would hold
import yggtree.runtime.build  # noqa: E402  (imports plan_prefetch, which reads profile_prefetch at call time)
print(f"prefetch distance {distance}", flush=True)
runpy.run_path(str(Path(__file__).parents[2] / "spec_packages" / "stages.py"), run_name="__main__")
