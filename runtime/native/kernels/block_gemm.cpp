// KVDrive's CPU kernels for weights kept in a GGUF file's own blocks (runtime/model/block_kernels.py;
// built with the other kernels by runtime/native/build.py).
//
// A weight W [N, K] is kept as integer levels with a float32 scale, and optionally a float32 offset, per
// block of B inputs of each row:  W[n, k] = q[n, k] * scale[n, k / B] + offset[n, k / B].
//   - "nib": q in 0..15, two per byte in ggml's order (block of 32: byte j holds input j in its low
//     nibble and input j + 16 in its high one), B = 32;
//   - "i8":  q an int8, B = 32 or 16 (Q6_K's sub-blocks).
// The levels, scales and offsets are exactly the file's, so W is exactly what the file dequantizes to,
// and the products are summed in float32 with float32 inputs: the result differs from an fp32 matmul of
// the dequantized weight only in the order of the additions.
//
// block_dequant multiplies then adds, rounding once as gguf's own dequantization does (built with
// -ffp-contract=off), so its float32 weights equal the loader's bit for bit.
// block_gemv: y [M, N] = x [M, K] @ W.T for a few rows (decode); block_dequant: W as float32 or bfloat16
// (prefill).
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <immintrin.h>

#include <vector>

namespace {

inline __m512 i8x16(const uint8_t* p) {
  return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
}

// The 32 levels of block g of row r as two 16-lane halves.
template <bool NIB>
inline void levels(const uint8_t* row, int64_t g, __m512& lo, __m512& hi) {
  if (NIB) {
    const __m512i v = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(row + g * 16)));
    lo = _mm512_cvtepi32_ps(_mm512_and_si512(v, _mm512_set1_epi32(15)));
    hi = _mm512_cvtepi32_ps(_mm512_srli_epi32(v, 4));
  } else {
    lo = i8x16(row + g * 32);
    hi = i8x16(row + g * 32 + 16);
  }
}

struct Args {
  const float* x;       // [M, K]
  const uint8_t* q;     // [N, K] int8 or [N, K / 2] nibbles
  const float* scale;   // [N, K / B]
  const float* offset;  // [N, K / B] or null
  const float* xsum;    // [M, K / B]: each block's sum of inputs (for the offsets) or null
  float* y;             // [M, N]
  int64_t M, K, N, B;
};

// NR output rows against MR input rows; each block's weights are loaded once for all MR inputs. Each row's
// sum is computed the same way whatever NR is: the tiling changes the speed, never a result.
template <bool NIB, bool HALF, int MR, int NR>
inline void tile(const Args& a, int64_t m0, int64_t n) {
  const int64_t rowbytes = NIB ? a.K / 2 : a.K, G32 = a.K / 32, G = a.K / a.B;
  __m512 acc[MR][NR];
  for (int m = 0; m < MR; ++m)
    for (int r = 0; r < NR; ++r) acc[m][r] = _mm512_setzero_ps();
  for (int64_t g = 0; g < G32; ++g) {
    __m512 x0[MR], x1[MR];
    for (int m = 0; m < MR; ++m) {
      x0[m] = _mm512_loadu_ps(a.x + (m0 + m) * a.K + g * 32);
      x1[m] = _mm512_loadu_ps(a.x + (m0 + m) * a.K + g * 32 + 16);
    }
    for (int r = 0; r < NR; ++r) {
      __m512 lo, hi;
      levels<NIB>(a.q + (n + r) * rowbytes, g, lo, hi);
      const float* s = a.scale + (n + r) * G;
      if (HALF) {  // blocks of 16: one scale per half
        lo = _mm512_mul_ps(lo, _mm512_set1_ps(s[2 * g]));
        hi = _mm512_mul_ps(hi, _mm512_set1_ps(s[2 * g + 1]));
        for (int m = 0; m < MR; ++m) {
          acc[m][r] = _mm512_fmadd_ps(lo, x0[m], acc[m][r]);
          acc[m][r] = _mm512_fmadd_ps(hi, x1[m], acc[m][r]);
        }
      } else {
        const __m512 sv = _mm512_set1_ps(s[g]);
        for (int m = 0; m < MR; ++m) {
          __m512 t = _mm512_mul_ps(lo, x0[m]);
          t = _mm512_fmadd_ps(hi, x1[m], t);
          acc[m][r] = _mm512_fmadd_ps(t, sv, acc[m][r]);
        }
      }
    }
  }
  for (int m = 0; m < MR; ++m)
    for (int r = 0; r < NR; ++r) {
      if (a.offset != nullptr) {  // + offsets . the blocks' input sums, 16 blocks a vector
        const float* o = a.offset + (n + r) * G;
        const float* xs = a.xsum + (m0 + m) * G;
        for (int64_t g = 0; g < G; g += 16) {
          const __mmask16 k = G - g >= 16 ? static_cast<__mmask16>(0xFFFF) : static_cast<__mmask16>((1u << (G - g)) - 1);
          acc[m][r] = _mm512_fmadd_ps(_mm512_maskz_loadu_ps(k, o + g), _mm512_maskz_loadu_ps(k, xs + g), acc[m][r]);
        }
      }
      a.y[(m0 + m) * a.N + n + r] = _mm512_reduce_add_ps(acc[m][r]);
    }
}

template <bool NIB, bool HALF, int MR>
void rows(const Args& a, int64_t m0, int64_t n0, int64_t n1, bool paired) {
  int64_t n = n0;
  if (paired)
    for (; n + 2 <= n1; n += 2) tile<NIB, HALF, MR, 2>(a, m0, n);
  for (; n < n1; ++n) tile<NIB, HALF, MR, 1>(a, m0, n);
}

// Whether to walk the weight two rows at a time (each block's x loaded once for both) or one row at a time.
// A row at a time reads the weight as one forward stream, which this host's prefetchers follow at its
// read bandwidth; interleaved rows are not followed as well. Measured, 2 threads: Gemma 3's 262K x 640
// int8 head at 1 row, 5.7 ms a call against 14.5 with 4-row tiles; a SmolLM2-shaped step of 121 nibble
// and int8 weights at 1 row, 7.6 ms against 10.4 (4-row tiles). With 4 input rows the small weights are
// bound by arithmetic and pairs win (13.9 against 14.9 ms one row at a time), the large ones do not (the
// Gemma 3 head: 11.3 ms one row at a time against 18.4 in pairs).
bool paired_rows(int64_t M, int64_t N, int64_t rowbytes) {
  return M > 1 && N * rowbytes < (int64_t(16) << 20);
}

template <bool NIB, bool HALF>
void run(const Args& a) {
  const bool paired = paired_rows(a.M, a.N, NIB ? a.K / 2 : a.K);
  for (int64_t m0 = 0; m0 < a.M; m0 += 4) {
    const int64_t mr = std::min<int64_t>(4, a.M - m0);
    at::parallel_for(0, (a.N + 3) / 4, 8, [&](int64_t b, int64_t e) {
      const int64_t n0 = b * 4, n1 = std::min(e * 4, a.N);
      switch (mr) {
        case 1: rows<NIB, HALF, 1>(a, m0, n0, n1, paired); break;
        case 2: rows<NIB, HALF, 2>(a, m0, n0, n1, paired); break;
        case 3: rows<NIB, HALF, 3>(a, m0, n0, n1, paired); break;
        default: rows<NIB, HALF, 4>(a, m0, n0, n1, paired);
      }
    });
  }
}

void check(const torch::Tensor& q, const torch::Tensor& scale, const c10::optional<torch::Tensor>& offset,
           int64_t K, bool nib) {
  TORCH_CHECK(q.is_contiguous() && scale.is_contiguous() && scale.scalar_type() == torch::kFloat32,
              "levels and scales must be contiguous, scales float32");
  TORCH_CHECK(K % 32 == 0, "inputs must be whole blocks of 32, got ", K);
  TORCH_CHECK(q.scalar_type() == (nib ? torch::kUInt8 : torch::kInt8), "levels: uint8 nibbles or int8");
  TORCH_CHECK(q.size(1) == (nib ? K / 2 : K), "levels [N, ", nib ? K / 2 : K, "] expected");
  const int64_t B = K / scale.size(1);
  TORCH_CHECK(B == 32 || (B == 16 && !nib), "blocks of 32 (or 16 for int8 levels), got ", B);
  if (offset) TORCH_CHECK(offset->sizes() == scale.sizes() && offset->is_contiguous(), "offsets shaped as scales");
}

}  // namespace

// x [M, K] float32, q [N, K] int8 or [N, K/2] uint8 nibbles, scale/offset [N, K/B] float32 -> y [M, N]
torch::Tensor block_gemv(torch::Tensor x, torch::Tensor q, torch::Tensor scale,
                         c10::optional<torch::Tensor> offset, bool nib) {
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous() && x.scalar_type() == torch::kFloat32, "x: [M, K] float32");
  const int64_t M = x.size(0), K = x.size(1), N = scale.size(0);
  check(q, scale, offset, K, nib);
  const int64_t B = K / scale.size(1);
  auto y = torch::empty({M, N}, x.options());
  std::vector<float> xsum;  // [M, K / B]: each block's sum of inputs, for the offsets
  if (offset) {
    xsum.resize(static_cast<size_t>(M * (K / B)));
    const float* xp = x.data_ptr<float>();
    for (int64_t i = 0; i < M * (K / B); ++i) {
      float t = 0.f;
      for (int64_t j = 0; j < B; ++j) t += xp[i * B + j];
      xsum[static_cast<size_t>(i)] = t;
    }
  }
  const Args a{x.data_ptr<float>(), reinterpret_cast<const uint8_t*>(q.data_ptr()), scale.data_ptr<float>(),
               offset ? offset->data_ptr<float>() : nullptr, offset ? xsum.data() : nullptr,
               y.data_ptr<float>(), M, K, N, B};
  if (nib) run<true, false>(a);
  else if (B == 16) run<false, true>(a);
  else run<false, false>(a);
  return y;
}

// -> W [N, K] float32
// 16 finite floats as bfloat16, rounded to nearest even: what torch's float32 -> bfloat16 conversion gives
// (AVX-512F only, so any host with the kernels can take it).
inline void store_bf16(uint16_t* dst, __m512 v) {
  __m512i b = _mm512_castps_si512(v);
  const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(b, 16), _mm512_set1_epi32(1));
  b = _mm512_add_epi32(b, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7FFF)));
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst), _mm512_cvtepi32_epi16(_mm512_srli_epi32(b, 16)));
}

// W [N, K] as float32, or (bf16) those same values rounded to bfloat16 in the same pass: a prompt chunk's
// bf16 GEMM then reads and writes a quarter of the bytes that a float32 W and a separate cast move.
torch::Tensor block_dequant(torch::Tensor q, torch::Tensor scale, c10::optional<torch::Tensor> offset, bool nib,
                            bool bf16) {
  const int64_t N = scale.size(0), K = nib ? q.size(1) * 2 : q.size(1);
  check(q, scale, offset, K, nib);
  const int64_t B = K / scale.size(1), G = K / B;
  auto w = torch::empty({N, K}, scale.options().dtype(bf16 ? torch::kBFloat16 : torch::kFloat32));
  const uint8_t* qp = reinterpret_cast<const uint8_t*>(q.data_ptr());
  const float* sp = scale.data_ptr<float>();
  const float* op = offset ? offset->data_ptr<float>() : nullptr;
  float* wp = bf16 ? nullptr : w.data_ptr<float>();
  uint16_t* hp = bf16 ? reinterpret_cast<uint16_t*>(w.data_ptr()) : nullptr;
  at::parallel_for(0, N, 16, [&](int64_t n0, int64_t n1) {
    for (int64_t n = n0; n < n1; ++n) {
      for (int64_t g = 0; g < K / 32; ++g) {
        __m512 lo, hi;
        if (nib) levels<true>(qp + n * (K / 2), g, lo, hi);
        else levels<false>(qp + n * K, g, lo, hi);
        const int64_t b0 = (g * 32) / B, b1 = (g * 32 + 16) / B;
        const __m512 o0 = _mm512_set1_ps(op ? op[n * G + b0] : 0.f), o1 = _mm512_set1_ps(op ? op[n * G + b1] : 0.f);
        const __m512 w0 = _mm512_add_ps(_mm512_mul_ps(lo, _mm512_set1_ps(sp[n * G + b0])), o0);
        const __m512 w1 = _mm512_add_ps(_mm512_mul_ps(hi, _mm512_set1_ps(sp[n * G + b1])), o1);
        if (bf16) {
          store_bf16(hp + n * K + g * 32, w0);
          store_bf16(hp + n * K + g * 32 + 16, w1);
        } else {
          _mm512_storeu_ps(wp + n * K + g * 32, w0);
          _mm512_storeu_ps(wp + n * K + g * 32 + 16, w1);
        }
      }
    }
  });
  return w;
}

void register_block_gemm(pybind11::module_& m) {
  m.def("block_gemv", &block_gemv, "y = x @ W.T, W in blocks (levels, float32 scales and offsets)");
  m.def("block_dequant", &block_dequant, "W in blocks -> float32 (bf16: rounded to bfloat16)");
}
