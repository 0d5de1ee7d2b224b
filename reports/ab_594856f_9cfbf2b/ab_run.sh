#!/bin/bash
# A/B 594856f (before) vs 9cfbf2b (after): two rounds, processes pinned to one core each, cores swapped in round 2
set -u
run() { # round core dir label
  ( cd $3 && PYTHONPATH=$3 OMP_NUM_THREADS=1 taskset -c $2 python scripts/bench_objective.py --plan profiles/epyc-2core.yaml \
      --prompts-mtbench 10 --prompts-humaneval 10 --max-new-tokens 128 --threads 1 --systems fixed,objective \
      --out /work/ab/r$1_$4.json > /work/ab/r$1_$4.log 2>&1 )
}
for r in 1 2; do
  if [ $r = 1 ]; then cb=0; ca=1; else cb=1; ca=0; fi
  run $r $cb /work/ab-before before &
  run $r $ca /work/ab-after after &
  wait
  echo round $r done $(date)
done
