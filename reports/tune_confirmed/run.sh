#!/bin/bash
set -eu
cd /work/tune3
export PYTHONPATH=/work/tune3 XDG_CACHE_HOME=/work/fresh-cache
while pgrep -f NOTHING_TO_WAIT_FOR >/dev/null; do sleep 10; done
echo "tune $(date)"
/usr/bin/time -f "tune_wall_s %e" python -m yggtree.cli tune --hw epyc-2core-tuned --threads 2 --space weights=float32 --budget-minutes 14 > /work/tune3/tune.log 2>&1
echo "bench $(date)"
mkdir -p reports/plans
OMP_NUM_THREADS=2 python scripts/bench_plans.py --plan profiles/epyc-2core-tuned.yaml --threads 2 --prompts-mtbench 40 --prompts-humaneval 40 --max-new-tokens 128 --out reports/plans/epyc-2core-tuned.json > /work/tune3/bench_plans.log 2>&1
echo "done $(date)"
