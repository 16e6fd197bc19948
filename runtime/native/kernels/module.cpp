// The CPU kernels' extension module (runtime/native/build.py): each kernel source registers its functions.
#include <torch/extension.h>

void register_block_gemm(pybind11::module_& m);
void register_paged_decode(pybind11::module_& m);
void register_rope(pybind11::module_& m);
void register_norm(pybind11::module_& m);
void register_prefix_attention(pybind11::module_& m);

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  register_block_gemm(m);
  register_paged_decode(m);
  register_rope(m);
  register_norm(m);
  register_prefix_attention(m);
}
