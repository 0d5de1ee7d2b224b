"""Compile a plan with inductor's cpp.min_chunk_size raised (kernels of fewer elements run serially: here the
per-layer SiLU-mul of 1,536 elements, the one inductor kernel of the plain w4a8 step with an OpenMP region).
usage: OMP_NUM_THREADS=2 python reports/serial_small_kernels/compile_chunk.py reports/serial_small_kernels/chunk.yaml 4096"""
import sys
import yggtree.runtime.aoti as aoti
aoti.INDUCTOR_CPU_CONFIG["cpp.min_chunk_size"] = int(sys.argv[2])
from yggtree.cli import main
sys.argv = ["yggtree", "compile", sys.argv[1]]
main()
