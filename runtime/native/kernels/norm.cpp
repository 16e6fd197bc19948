// KVDrive's CPU kernel of RMS normalisation (runtime/model/layers.py RMSNorm), for float32 activations:
//   Llama (offset 0):  out = w * (x * r)            r = 1 / sqrt(mean(x^2) + eps)
//   Gemma (offset 1):  out = (x * r) * (1 + w)
// Each output element is rounded as torch's ops round it (the same products in the same order, built with
// -ffp-contract=off); only the sum of squares adds in another order (16 lanes, then across them), so a
// result may differ from torch's in the last bit of r. One call replaces the norm's seven tensor ops.
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <immintrin.h>

#include <cmath>

// x [R, D] or [N, H, D] float32 (last stride 1), w [D] float32 -> [..., D] contiguous
torch::Tensor rms_norm(torch::Tensor x, torch::Tensor w, double eps, double offset) {
  TORCH_CHECK((x.dim() == 2 || x.dim() == 3) && x.scalar_type() == torch::kFloat && x.stride(-1) == 1,
              "x: [R, D] or [N, H, D] float32 with unit last stride");
  const int64_t D = x.size(-1), H = x.dim() == 3 ? x.size(1) : 1, N = x.size(0);
  TORCH_CHECK(w.dim() == 1 && w.size(0) == D && w.is_contiguous() && w.scalar_type() == torch::kFloat,
              "weight: [D] float32 contiguous");
  const int64_t s0 = x.stride(0), s1 = x.dim() == 3 ? x.stride(1) : 0;
  auto out = torch::empty(x.sizes(), x.options());
  const float *xp = x.data_ptr<float>(), *wp = w.data_ptr<float>();
  float* op = out.data_ptr<float>();
  const float e = static_cast<float>(eps), off = static_cast<float>(offset);
  const bool gemma = offset != 0.0;
  at::parallel_for(0, N * H, 16, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      const float* a = xp + (r / H) * s0 + (r % H) * s1;
      float* o = op + r * D;
      __m512 acc = _mm512_setzero_ps();
      int64_t d = 0;
      for (; d + 16 <= D; d += 16) {
        const __m512 v = _mm512_loadu_ps(a + d);
        acc = _mm512_add_ps(acc, _mm512_mul_ps(v, v));
      }
      float ss = _mm512_reduce_add_ps(acc);
      for (; d < D; ++d) ss += a[d] * a[d];
      const float rs = 1.0f / std::sqrt(ss / static_cast<float>(D) + e);
      for (d = 0; d < D; ++d) {
        const float n = a[d] * rs;
        o[d] = gemma ? n * (off + wp[d]) : wp[d] * n;
      }
    }
  });
  return out;
}

void register_norm(pybind11::module_& m) {
  m.def("rms_norm", &rms_norm, "RMS normalisation of float32 rows (Llama's w * x r, or Gemma's x r (1 + w))");
}
