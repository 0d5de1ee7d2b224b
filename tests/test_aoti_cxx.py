"""How our AOTInductor packages' wrappers are split (``yggtree.runtime.aoti_cxx.split_wrapper``):
the runtime interface taken out of the model's code once, and declared there. Compiled packages
built this way are run in test_aoti.py and test_compile.py (slow)."""

from __future__ import annotations

from yggtree.runtime.aoti_cxx import restore_wrapper, split_wrapper

INTERFACE = '#include <a/interface.h>\n#include <vector>\n\nextern "C" { int api() { return 1; } }\n'
WRAPPER = "#include <dev/cpu.h>\n" + INTERFACE + "void run_impl() {}\n"


def test_the_model_keeps_its_code_and_the_interface_includes_not_its_body():
    model, shared = split_wrapper(WRAPPER, INTERFACE)
    assert model.startswith("#include <dev/cpu.h>\n#include <a/interface.h>\n#include <vector>\n")
    assert 'extern "C"' not in model.replace("extern template", "")
    assert "extern template class torch::aot_inductor::AOTInductorModelBase" in model
    assert model.endswith("void run_impl() {}\n")


def test_the_shared_part_is_the_interface_with_the_base_class_instantiated():
    _, shared = split_wrapper(WRAPPER, INTERFACE)
    assert shared.startswith("#include <dev/cpu.h>\n" + INTERFACE)
    assert "run_impl" not in shared
    assert shared.rstrip().endswith(
        "template class torch::aot_inductor::AOTInductorModelBase<torch::aot_inductor::AOTInductorModel>;")


def test_a_wrapper_without_the_interface_or_with_it_twice_is_left_alone():
    assert split_wrapper("void run_impl() {}\n", INTERFACE) is None
    assert split_wrapper(WRAPPER + INTERFACE, INTERFACE) is None


def test_a_wrapper_an_earlier_version_rewrote_in_place_splits_as_the_original():
    """09321a5 wrote the model's code over the wrapper, and inductor reuses that file: restored,
    it splits exactly as the wrapper inductor wrote (a left-alone wrapper links no interface)."""
    model, shared = split_wrapper(WRAPPER, INTERFACE)
    assert restore_wrapper(model, INTERFACE) == WRAPPER
    assert split_wrapper(restore_wrapper(model, INTERFACE), INTERFACE) == (model, shared)
    for text in (WRAPPER, "void run_impl() {}\n", model + model):
        assert restore_wrapper(text, INTERFACE) == text
