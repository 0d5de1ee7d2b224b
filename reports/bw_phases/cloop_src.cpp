
#include <torch/extension.h>
#include <torch/csrc/inductor/aoti_torch/c/shim.h>
#include <torch/csrc/inductor/aoti_torch/utils.h>
#include <dlfcn.h>
#include <chrono>
typedef AOTITorchError (*shim_t)(AtenTensorHandle, AtenTensorHandle, AtenTensorHandle*);
double loop(std::vector<torch::Tensor> xs, std::vector<torch::Tensor> ws, int64_t reps, std::string sym, double gap_us) {
  shim_t f = (shim_t)dlsym(RTLD_DEFAULT, sym.c_str());
  TORCH_CHECK(f, "no symbol ", sym);
  std::vector<AtenTensorHandle> hx, hw;
  for (auto& x : xs) hx.push_back(torch::aot_inductor::new_tensor_handle(torch::Tensor(x)));
  for (auto& w : ws) hw.push_back(torch::aot_inductor::new_tensor_handle(torch::Tensor(w)));
  auto t0 = std::chrono::steady_clock::now();
  for (int64_t r = 0; r < reps; ++r)
    for (size_t i = 0; i < hw.size(); ++i) {
      AtenTensorHandle out;
      f(hx[i], hw[i], &out);
      aoti_torch_delete_tensor_object(out);
      if (gap_us > 0) { auto s = std::chrono::steady_clock::now();
        while (std::chrono::duration<double>(std::chrono::steady_clock::now() - s).count() * 1e6 < gap_us) {} }
    }
  double dt = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count() / reps;
  for (auto h : hx) aoti_torch_delete_tensor_object(h);
  for (auto h : hw) aoti_torch_delete_tensor_object(h);
  return dt;
}
