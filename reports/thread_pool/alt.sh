#!/bin/bash
# alternate the modes by process: alt.sh ITERATIONS OUT
export LD_PRELOAD=/usr/lib/x86_64-linux-gnu/libjemalloc.so.2 OMP_NUM_THREADS=2
for i in $(seq 1 $1); do
  for m in omp pool omp-chunk; do
    case $m in
      omp) python reports/thread_pool/dec_mode.py omp profiles/epyc-2core-plain-w4a8.yaml 3 ;;
      pool) python reports/thread_pool/dec_mode.py pool reports/serial_small_kernels/chunk.yaml 3 ;;
      omp-chunk) python reports/thread_pool/dec_mode.py omp reports/serial_small_kernels/chunk.yaml 3 | sed 's/^omp/omp-chunk/' ;;
    esac
  done 2>/dev/null | grep -E "^(omp|pool)" >> $2
done
