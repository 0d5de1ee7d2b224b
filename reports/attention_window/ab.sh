#!/bin/bash
# plain decoding ms/token before (f098332) and after (8c6b718+) the attention change, alternating processes
cd /tmp
for round in 1 2; do
  for v in old new; do
    if [ $v = old ]; then P=/work/ev5; else P=/work/main; fi
    for fmt in int4 float32; do
      echo "$round $v $(OMP_NUM_THREADS=2 PYTHONPATH=$P python /work/main/reports/formats_int4op/ab_decode.py $fmt 2 2>/dev/null | tail -1)"
    done
  done
done
