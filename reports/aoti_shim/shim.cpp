#include <ATen/ATen.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/csrc/inductor/aoti_torch/c/shim.h>
#include <torch/csrc/inductor/aoti_torch/utils.h>
using namespace torch::aot_inductor;
extern "C" AOTITorchError aoti_torch_cpu_w4a8_mm(AtenTensorHandle x, AtenTensorHandle codes, AtenTensorHandle d,
                                                 AtenTensorHandle m, AtenTensorHandle* ret0) {
  AOTI_TORCH_CONVERT_EXCEPTION_TO_ERROR_CODE({
    static auto op = c10::Dispatcher::singleton().findSchemaOrThrow("yggtree::w4a8_mm", "")
                         .typed<at::Tensor(const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&)>();
    at::Tensor out = op.call(*tensor_handle_to_tensor_pointer(x), *tensor_handle_to_tensor_pointer(codes),
                             *tensor_handle_to_tensor_pointer(d), *tensor_handle_to_tensor_pointer(m));
    *ret0 = new_tensor_handle(std::move(out));
  });
}
