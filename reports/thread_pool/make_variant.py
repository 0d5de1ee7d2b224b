"""Build the experiment's variant of the kernel library: the shipped csrc with at::parallel_for on pool.cpp's pool and the
ops registered as yggpool:: (the AOTInductor C shims keep their names: load this library before the real one and packages
resolve their calls here). Returns the .so path."""
import pathlib, torch
from torch.utils import cpp_extension
from yggtree.runtime.kernels import CFLAGS, LDFLAGS, SOURCES
here = pathlib.Path(__file__).resolve().parent
def build():
    out = here / "build"; out.mkdir(exist_ok=True)
    srcs = [str(here / "pool.cpp")]
    for f in SOURCES[:2]:  # w4a8.cpp, rows_attention.cpp
        t = f.read_text()
        t = t.replace("#include <ATen/Parallel.h>", "#include <ATen/Parallel.h>\n#include <functional>\nnamespace ygg_pool { void parallel_for(int64_t, int64_t, int64_t, const std::function<void(int64_t, int64_t)>&); }")
        t = t.replace("at::parallel_for(", "ygg_pool::parallel_for(")
        t = t.replace("TORCH_LIBRARY_FRAGMENT(yggtree", "TORCH_LIBRARY_FRAGMENT(yggpool").replace("TORCH_LIBRARY_IMPL(yggtree", "TORCH_LIBRARY_IMPL(yggpool")
        p = out / ("v_" + f.name); p.write_text(t); srcs.append(str(p))
    cpp_extension.load(name="yggpool_kernels", sources=srcs, extra_cflags=list(CFLAGS), extra_ldflags=list(LDFLAGS),
                       build_directory=str(out), is_python_module=False, verbose=False)
    return out / "yggpool_kernels.so"
