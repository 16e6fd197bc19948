// KVDrive's CPU kernel of rotary position embeddings (runtime/model/rope.py), in the "rotate half" layout:
//   out = x * cos + rotate_half(x) * sin,  rotate_half(x) = (-x[D/2:], x[:D/2])
// for queries and keys at once, read through their strides (views of the fused qkv projection), written
// contiguous. Each element is the same two products and one sum, rounded as torch rounds them (built with
// -ffp-contract=off: no fused multiply-add), so the result equals torch's bit for bit; it saves a decode
// layer the ten tensor ops of the torch form.
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <vector>

namespace {

// x [N, H, D] float32 (last stride 1); cos, sin [N, 1, D] float32 contiguous -> [N, H, D] contiguous
torch::Tensor rotate(const torch::Tensor& x, const torch::Tensor& cos, const torch::Tensor& sin) {
  TORCH_CHECK(x.dim() == 3 && x.scalar_type() == torch::kFloat && x.stride(2) == 1, "x: [N, H, D] float32");
  const int64_t N = x.size(0), H = x.size(1), D = x.size(2), half = D / 2;
  TORCH_CHECK(D % 2 == 0, "head dim must be even");
  TORCH_CHECK(cos.numel() == N * D && sin.numel() == N * D && cos.is_contiguous() && sin.is_contiguous() &&
              cos.scalar_type() == torch::kFloat && sin.scalar_type() == torch::kFloat, "cos, sin: [N, 1, D] float32");
  auto out = torch::empty({N, H, D}, x.options());
  const float *xp = x.data_ptr<float>(), *cp = cos.data_ptr<float>(), *sp = sin.data_ptr<float>();
  float* op = out.data_ptr<float>();
  const int64_t s0 = x.stride(0), s1 = x.stride(1);
  at::parallel_for(0, N * H, 64, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      const int64_t n = r / H, h = r % H;
      const float* a = xp + n * s0 + h * s1;
      const float* c = cp + n * D;
      const float* s = sp + n * D;
      float* o = op + r * D;
      for (int64_t d = 0; d < half; ++d) o[d] = a[d] * c[d] + (-a[d + half]) * s[d];
      for (int64_t d = half; d < D; ++d) o[d] = a[d] * c[d] + a[d - half] * s[d];
    }
  });
  return out;
}

}  // namespace

// q [N, Hq, D], k [N, Hkv, D] float32 (last stride 1); cos, sin [N, 1, D] -> rotated q, k (contiguous)
std::vector<torch::Tensor> rope_rotate(torch::Tensor q, torch::Tensor k, torch::Tensor cos, torch::Tensor sin) {
  return {rotate(q, cos, sin), rotate(k, cos, sin)};
}

void register_rope(pybind11::module_& m) {
  m.def("rope_rotate", &rope_rotate, "rotary embeddings of queries and keys, equal to torch's bit for bit");
}
