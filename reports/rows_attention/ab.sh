#!/bin/bash
# A/B of yggtree::rows_attention's source, interleaved in one checkout: /tmp/rows_old.cpp (e.g.
# `git show 6b84646:yggtree/runtime/csrc/rows_attention.cpp`) against /tmp/rows_new.cpp (this
# commit's). The kernel library is built per source hash and cached, and compiled plans call the
# op through the library loaded at run time, so each side runs the same packages.
#   reports/rows_attention/ab.sh verifystep.py PLAN WIDTH
cd "$(git rev-parse --show-toplevel)"
for r in 1 2 3; do for v in old new; do
  cp /tmp/rows_$v.cpp yggtree/runtime/csrc/rows_attention.cpp
  echo "== $v $*"; OMP_NUM_THREADS=2 python reports/rows_attention/"$1" "${@:2}" 2>&1 | grep " ms"
done; done
cp /tmp/rows_new.cpp yggtree/runtime/csrc/rows_attention.cpp
