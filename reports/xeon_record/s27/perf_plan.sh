# usage: perf_plan.sh FMT  -- perf profile of the compiled plain plan decoding 800 tokens
cd /work/main
f=$1
LD_PRELOAD=/usr/lib/x86_64-linux-gnu/libjemalloc.so.2 OMP_NUM_THREADS=2 perf record -F 4000 -e cpu-clock -g -o /tmp/perf-$f.data -- \
  python -m yggtree.cli run --plan compile-xeon/epyc-2core-plain-$f/plan.yaml --no-speculate --max-new-tokens 800 --threads 2 \
  --prompt "Write a long story about a lighthouse keeper who finds a map." > /tmp/perf-$f.out 2>&1
perf report -i /tmp/perf-$f.data --no-children --sort dso,sym --stdio 2>/dev/null | grep -v "^#" | grep "%" | head -40 > /tmp/perf-$f.txt
