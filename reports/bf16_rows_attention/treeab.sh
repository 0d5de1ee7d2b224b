#!/bin/bash
# A plan in two checkouts, interleaved: OLD_DIR and NEW_DIR each hold the code and the plan compiled
# by it (compile/NAME). 3 rounds; one JSON line per (round, arm) with tpots.py's tpot and tokens.
#   treeab.sh PLAN OLD_DIR NEW_DIR OUT
# (ab_tpots.jsonl: OLD_DIR a worktree at 6b84646 with the plan compiled there, NEW_DIR the main checkout)
HERE=$(cd "$(dirname "$0")" && pwd)
PLAN=$1; OLD=$2; NEW=$3; OUT=$4; : > "$OUT"
for r in 1 2 3; do for arm in old new; do
  if [ $arm = old ]; then D=$OLD; else D=$NEW; fi
  echo "{\"arm\": \"$arm\", \"round\": $r, \"res\": $(cd "$D" && PYTHONPATH="$D" OMP_NUM_THREADS=2 python "$HERE"/tpots.py "$PLAN" 2>/dev/null | tail -1)}" >> "$OUT"
done; done
