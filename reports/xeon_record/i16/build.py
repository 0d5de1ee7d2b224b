import torch
from torch.utils import cpp_extension
import os
def load():
    os.makedirs("/tmp/i16_proto_build", exist_ok=True)
    cpp_extension.load(name="proto_i16", sources=[__file__.replace("build.py", "i16.cpp")], extra_cflags=["-O3", "-march=native", "-fopenmp"],
                       extra_ldflags=["-fopenmp"], build_directory="/tmp/i16_proto_build", is_python_module=False, verbose=False)
