"""AOTInductor's C++ build of our packages, made cheaper (:func:`lean_build`, entered while a
package compiles; the generated kernels and the model's code are untouched).

A package's wrapper (``*.wrapper.cpp``) is two things: the model's own code (its entry point,
``run_impl``, and constructor), and a copy of AOTInductor's runtime interface (torch's
``codegen/aoti_runtime/interface.cpp``: the C entry points and the model container, which
instantiate ``AOTInductorModelBase<AOTInductorModel>`` and std::regex). The interface is the
same text in every package and 2-3 s of each wrapper's compile (a one-layer package's wrapper
took 3.9 s, 1.5 s without it). Two changes, both falling back to torch's own build where the
generated code is not as expected:

- :func:`_no_input_checks`: no per-input check functions (they run only under
  ``AOTI_RUNTIME_CHECK_INPUTS``; a whole step's 218 inputs made 16,000 of its 20,000 lines).
- :func:`_shared_interface`: the interface is compiled once per build (per compiler command,
  in inductor's cache directory) with the base class instantiated there, and linked into every
  package; each package compiles only the model's code (from a file beside its wrapper, which
  is left whole), with that instantiation declared ``extern``. Every package still holds the
  whole runtime (it is loaded on its own).
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import os
import re
from pathlib import Path

__all__ = ["lean_build"]

# the base class the interface's container and the model's constructor both use (model.h)
_BASE = "torch::aot_inductor::AOTInductorModelBase<torch::aot_inductor::AOTInductorModel>"
_INTERFACE_DIR = "yggtree-aoti-interface"  # under inductor's cache directory


@contextlib.contextmanager
def lean_build():
    """Inside the block, AOTInductor packages compile without per-input checks and with the
    runtime interface compiled once and shared (module docstring)."""
    with _no_input_checks(), _shared_interface():
        yield


@contextlib.contextmanager
def _no_input_checks():
    """AOTInductor's generated wrapper without its per-input checks.

    It writes a function per graph input that checks the input's dtype, sizes, strides and
    device, run only where ``AOTI_RUNTIME_CHECK_INPUTS`` is set: a whole step takes 218 inputs (the
    layers' weights and caches), and their checks were 16,000 of its wrapper's 20,000 lines and half
    of its C++ compile. Our runners pass what the package was compiled for (contiguous activations,
    the model's own tensors). Where torch's code generator has no such method the compile is as torch's."""
    from torch._inductor.codegen.cpp_wrapper_cpu import CppWrapperCpu

    orig = getattr(CppWrapperCpu, "generate_input_output_runtime_checks", None)
    if orig is None:
        yield
        return

    def no_checks(self) -> None:  # the entry point calls these two: kept, empty
        self.prefix.splice_aot("""
            static bool _check_aoti_runtime_check_inputs_env() {
                const static char* env_var_value = getenv("AOTI_RUNTIME_CHECK_INPUTS");
                const static bool result = env_var_value != nullptr && env_var_value[0] != '0';
                return result;
            }

            AOTI_NOINLINE static void __check_inputs_outputs(AtenTensorHandle*, AtenTensorHandle*) {}
        """)

    CppWrapperCpu.generate_input_output_runtime_checks = no_checks
    try:
        yield
    finally:
        CppWrapperCpu.generate_input_output_runtime_checks = orig


def _declaration(interface: str) -> str:
    """What replaces the interface in the model's code: its includes, and the base class's
    instantiation declared extern."""
    includes = "".join(ln + "\n" for ln in interface.splitlines() if ln.startswith("#include"))
    return f"{includes}\nextern template class {_BASE};\n"


def restore_wrapper(text: str, interface: str) -> str:
    """A wrapper as inductor wrote it: an earlier yggtree (09321a5 to fef8ac8) rewrote wrappers in
    place with the model's code alone, and inductor reuses a wrapper file already in its cache;
    the interface goes back where its declaration stands (exactly the text it replaced). Any
    other text is returned as it is."""
    declared = _declaration(interface)
    if interface in text or text.count(declared) != 1:
        return text
    return text.replace(declared, interface, 1)


def split_wrapper(text: str, interface: str) -> tuple[str, str] | None:
    """``(model, shared)``: a wrapper's source without the runtime interface (its includes kept,
    the base class's instantiation declared extern), and the interface on its own (with what
    precedes it: the device's header) instantiating the base class; None where the wrapper does
    not hold the interface's text exactly once."""
    at = text.find(interface)
    if at < 0 or text.find(interface, at + 1) >= 0:
        return None
    end = at + len(interface)
    model = f"{text[:at]}{_declaration(interface)}{text[end:]}"
    shared = f"{text[:end]}\ntemplate class {_BASE};\n"
    return model, shared


@contextlib.contextmanager
def _shared_interface():
    """Each package's wrapper compiled without the runtime interface, which is compiled once per
    compiler command (the wrappers' own, flags and precompiled header alike) into inductor's cache
    directory and added to each package's link (a file lock: children building packages side by
    side compile it once). Hooks inductor's ``CppBuilder`` as ``AotCodeCompiler`` uses it: a
    wrapper's compile, then the link naming its object."""
    from torch._inductor import codecache
    from torch._inductor.codegen import cpp_wrapper_cpu
    from torch._inductor.runtime.cache_dir_utils import cache_dir

    try:
        interface = (Path(cpp_wrapper_cpu.__file__).parent / "aoti_runtime" / "interface.cpp").read_text()
    except OSError:
        interface = ""
    torch_builder = getattr(codecache, "CppBuilder", None)
    if not interface or torch_builder is None:
        yield
        return
    shared_of: dict[str, str] = {}  # a wrapper's object -> the shared interface's object

    class Builder(torch_builder):
        def __init__(self, name, sources, BuildOption, output_dir: str = "") -> None:
            srcs = [sources] if isinstance(sources, str) else list(sources)
            is_wrapper = (len(srcs) == 1 and srcs[0].endswith(".wrapper.cpp") and BuildOption.get_compile_only()
                          and not BuildOption.get_precompiling() and not BuildOption.get_preprocessing())
            parts = None
            if is_wrapper:
                parts = split_wrapper(restore_wrapper(Path(srcs[0]).read_text(), interface), interface)
            if parts is not None:  # the model's code compiled from a file of its own (the wrapper stays whole)
                srcs = [_write_beside(Path(srcs[0]), parts[0])]
            elif not is_wrapper:
                srcs += [shared_of[s] for s in srcs if s in shared_of]
            super().__init__(name=name, sources=srcs if not isinstance(sources, str) else srcs[0],
                             BuildOption=BuildOption, output_dir=output_dir)
            if parts is not None:
                shared_of[self.get_target_file_path()] = _build_shared(
                    parts[1], srcs[0], self, BuildOption, Path(cache_dir()) / _INTERFACE_DIR, torch_builder)

    codecache.CppBuilder = Builder
    try:
        yield
    finally:
        codecache.CppBuilder = torch_builder


def _write_beside(wrapper: Path, model: str) -> str:
    """The model's code written beside its wrapper (``<hash>.model.cpp``, replaced whole); the
    wrapper itself is never rewritten: inductor reuses a wrapper file already on disk, so the next
    compile of the same graph splits it again. Its temporary name holds the process id (not
    files.write_text_atomic's one name): build children compiling identical graphs write the same file."""
    path = wrapper.with_name(wrapper.name.removesuffix(".wrapper.cpp") + ".model.cpp")
    part = path.with_name(f"{path.name}.{os.getpid()}")
    part.write_text(model)
    os.replace(part, path)
    return str(path)


def _build_shared(shared: str, src: str, wrapper, option, root: Path, torch_builder) -> str:
    """The shared interface's object for the model compiled by ``wrapper`` from ``src`` (compiled
    now, under a lock, unless there)."""
    # the interface's compile as the wrapper's: its command with the paths taken out
    command = wrapper.get_command_line().replace(src, "SRC").replace(wrapper.get_target_file_path(), "OUT")
    command = re.sub(r"\s+", " ", command)
    key = hashlib.sha256((shared + "\0" + command).encode()).hexdigest()[:20]
    root.mkdir(parents=True, exist_ok=True)
    source = root / f"interface_{key}.cpp"
    obj = Path(torch_builder(name=source.stem, sources=str(source), BuildOption=option,
                             output_dir=str(root)).get_target_file_path())
    with open(root / f"{key}.lock", "a") as held:
        fcntl.flock(held, fcntl.LOCK_EX)
        if not obj.is_file():  # written under another name and renamed: a stopped compile leaves none
            source.write_text(shared)
            part = torch_builder(name=f"{source.stem}_{os.getpid()}", sources=str(source), BuildOption=option,
                                 output_dir=str(root))
            part.build()  # raises on a compile error, as the wrapper's own would
            os.replace(part.get_target_file_path(), obj)
    return str(obj)
