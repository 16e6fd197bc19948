// A prompt chunk's attention to its sequence's earlier keys (every one visible, no mask), with bfloat16 dot
// products (AVX512-BF16's vdpbf16ps) accumulated in float32: q·k and p·v as the bf16 GEMMs of the chunk's
// projections are (--gemm bf16). The chunk's causal attention to its own keys stays with PyTorch's flash
// kernel; the two are merged by their log-sum-exps (runtime/attention/dense.py).
//
// Grouped-query heads fold into rows: each key head's g query heads x N positions are one block of g*N query
// rows, so every key and value is packed and read once for all of them. Per key head the keys are packed
// for vdpbf16ps (kp: [T/16][D/2][16][2], the 16 keys of a group side by side for each pair of dimensions;
// vp: [T/2][D][2], each pair of keys side by side for each dimension); the queries are pre-scaled by
// scale*log2(e) and rounded to bf16 pairs, so the online softmax runs in base 2. Rows are processed in tiles
// of ROWS, register-blocked 4 rows x 64 keys at a time; a tile's output accumulators stay in L1 while the
// key/value blocks stream by.
#include <torch/extension.h>
#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

namespace {

constexpr int64_t KB = 64;    // keys per block
constexpr int64_t ROWS = 32;  // query rows per tile (multiple of 4)
constexpr float LOG2E = 1.4426950408889634f;
constexpr float LN2 = 0.6931471805599453f;

#define BF16_TARGET __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx512bf16")))

BF16_TARGET inline __m512 exp2_ps(__m512 x) {  // 2^x for x <= 0 (relative error ~2e-5)
  x = _mm512_max_ps(x, _mm512_set1_ps(-126.0f));
  const __m512 fi = _mm512_roundscale_ps(x, _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC);
  const __m512 f = _mm512_sub_ps(x, fi);  // [0, 1)
  __m512 p = _mm512_set1_ps(1.5403530e-4f);
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.3333558e-3f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(9.6181291e-3f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(5.5504109e-2f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(2.4022651e-1f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(6.9314718e-1f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.0f));
  return _mm512_scalef_ps(p, fi);
}

template <int D>
BF16_TARGET inline void row_to_bf16(const float* src, float mul, uint16_t* dst) {  // D floats, round to nearest even
  const __m512 f = _mm512_set1_ps(mul);
  for (int c = 0; c < D / 16; ++c)
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst + 16 * c),
                        (__m256i)_mm512_cvtneps_pbh(_mm512_mul_ps(_mm512_loadu_ps(src + 16 * c), f)));
}

// One key head: packed keys/values (tp keys, padded to a multiple of KB with zeros), its query rows as bf16
// pairs [rp][D/2], and the rows' outputs o [rows][D] and base-2 log-sum-exps.
template <int D>
BF16_TARGET void head_tile(const uint32_t* qp, const uint16_t* kp, const uint16_t* vp, int64_t t, int64_t tp,
                           int64_t r0, int64_t nrows, float* o, float* lse2) {
  constexpr int P = D / 2;   // dimension pairs
  constexpr int C = D / 16;  // zmm per output row
  alignas(64) float acc_o[ROWS][D];
  alignas(64) uint32_t pbuf[4][KB / 2];
  float m[ROWS], l[ROWS];
  for (int r = 0; r < ROWS; ++r) {
    m[r] = -1e30f;
    l[r] = 0.0f;
    for (int d = 0; d < D; ++d) acc_o[r][d] = 0.0f;
  }
  const int quads = static_cast<int>((nrows + 3) / 4);
  for (int64_t kb = 0; kb < tp; kb += KB) {
    const int64_t valid = std::min<int64_t>(KB, t - kb);
    for (int qd = 0; qd < quads; ++qd) {
      __m512 s[4][4];
      for (int r = 0; r < 4; ++r)
        for (int c = 0; c < 4; ++c) s[r][c] = _mm512_setzero_ps();
      const uint32_t* q4 = qp + (r0 + qd * 4) * P;
      const uint16_t* kblk = kp + kb * D;  // (kb/16) groups of [P][16][2]
      for (int p = 0; p < P; ++p) {
        __m512bh kv[4];
        for (int c = 0; c < 4; ++c)
          kv[c] = (__m512bh)_mm512_loadu_si512(kblk + (static_cast<int64_t>(c) * P + p) * 32);
        for (int r = 0; r < 4; ++r) {
          const __m512bh qb = (__m512bh)_mm512_set1_epi32(static_cast<int>(q4[r * P + p]));
          for (int c = 0; c < 4; ++c) s[r][c] = _mm512_dpbf16_ps(s[r][c], qb, kv[c]);
        }
      }
      __m512 corr[4];
      for (int r = 0; r < 4; ++r) {
        const int row = qd * 4 + r;
        if (valid < KB) {
          for (int c = 0; c < 4; ++c) {
            const int64_t left = valid - 16 * c;
            const __mmask16 keep = left >= 16 ? 0xFFFF : left <= 0 ? 0 : static_cast<__mmask16>((1u << left) - 1);
            s[r][c] = _mm512_mask_mov_ps(_mm512_set1_ps(-1e30f), keep, s[r][c]);
          }
        }
        const __m512 mx = _mm512_max_ps(_mm512_max_ps(s[r][0], s[r][1]), _mm512_max_ps(s[r][2], s[r][3]));
        const float m_new = std::max(m[row], _mm512_reduce_max_ps(mx));
        const __m512 mv = _mm512_set1_ps(m_new);
        __m512 sum = _mm512_setzero_ps();
        for (int c = 0; c < 4; ++c) {
          s[r][c] = exp2_ps(_mm512_sub_ps(s[r][c], mv));
          sum = _mm512_add_ps(sum, s[r][c]);
        }
        const float cf = std::exp2(m[row] - m_new);
        l[row] = l[row] * cf + _mm512_reduce_add_ps(sum);
        m[row] = m_new;
        corr[r] = _mm512_set1_ps(cf);
        _mm512_store_si512(pbuf[r], (__m512i)_mm512_cvtne2ps_pbh(s[r][1], s[r][0]));
        _mm512_store_si512(pbuf[r] + 16, (__m512i)_mm512_cvtne2ps_pbh(s[r][3], s[r][2]));
      }
      __m512 ov[4][C];
      for (int r = 0; r < 4; ++r)
        for (int c = 0; c < C; ++c) ov[r][c] = _mm512_mul_ps(_mm512_load_ps(&acc_o[qd * 4 + r][16 * c]), corr[r]);
      const uint16_t* vblk = vp + kb * D;  // [KB/2][D][2]
      for (int kp2 = 0; kp2 < KB / 2; ++kp2) {
        __m512bh vv[C];
        for (int c = 0; c < C; ++c)
          vv[c] = (__m512bh)_mm512_loadu_si512(vblk + (static_cast<int64_t>(kp2) * D + 16 * c) * 2);
        for (int r = 0; r < 4; ++r) {
          const __m512bh pb = (__m512bh)_mm512_set1_epi32(static_cast<int>(pbuf[r][kp2]));
          for (int c = 0; c < C; ++c) ov[r][c] = _mm512_dpbf16_ps(ov[r][c], pb, vv[c]);
        }
      }
      for (int r = 0; r < 4; ++r)
        for (int c = 0; c < C; ++c) _mm512_store_ps(&acc_o[qd * 4 + r][16 * c], ov[r][c]);
    }
  }
  for (int64_t r = 0; r < nrows; ++r) {
    const float inv = 1.0f / l[r];
    for (int d = 0; d < D; ++d) o[r * D + d] = acc_o[r][d] * inv;
    lse2[r] = m[r] + std::log2(l[r]);
  }
}

template <int D>
BF16_TARGET void run(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v, double scale,
                     torch::Tensor& out, torch::Tensor& lse) {
  constexpr int P = D / 2;
  const int64_t hq = q.size(0), n = q.size(1), hkv = k.size(0), t = k.size(1);
  const int64_t g = hq / hkv, rows = g * n;
  const int64_t rp = (rows + ROWS - 1) / ROWS * ROWS, tp = (t + KB - 1) / KB * KB;
  std::vector<uint32_t> qp(static_cast<size_t>(hkv * rp * P), 0u);
  std::vector<uint16_t> kp(static_cast<size_t>(hkv * tp * D), 0), vp(static_cast<size_t>(hkv * tp * D), 0);
  const float* qd = q.data_ptr<float>();
  const float* kd = k.data_ptr<float>();
  const float* vd = v.data_ptr<float>();
  const int64_t ks0 = k.stride(0), ks1 = k.stride(1), vs0 = v.stride(0), vs1 = v.stride(1);
  const float qs = static_cast<float>(scale) * LOG2E;
#pragma omp parallel for collapse(2) schedule(static)
  for (int64_t h = 0; h < hkv; ++h) {
    for (int64_t j = 0; j < t; ++j) {
      const float* kr = kd + h * ks0 + j * ks1;
      const float* vr = vd + h * vs0 + j * vs1;
      alignas(64) uint16_t kb16[D], vb16[D];
      row_to_bf16<D>(kr, 1.0f, kb16);
      row_to_bf16<D>(vr, 1.0f, vb16);
      uint32_t* kdst = reinterpret_cast<uint32_t*>(kp.data() + h * tp * D + (j / 16) * 16 * D + (j % 16) * 2);
      uint16_t* vdst = vp.data() + h * tp * D + (j / 2) * 2 * D + (j % 2);
      const uint32_t* kpairs = reinterpret_cast<const uint32_t*>(kb16);
      for (int p = 0; p < P; ++p) kdst[p * 16] = kpairs[p];
      for (int d = 0; d < D; ++d) vdst[d * 2] = vb16[d];
    }
  }
#pragma omp parallel for collapse(2) schedule(static)
  for (int64_t h = 0; h < hkv; ++h) {
    for (int64_t r = 0; r < rows; ++r) {
      const float* src = qd + ((h * g + r / n) * n + r % n) * D;
      row_to_bf16<D>(src, qs, reinterpret_cast<uint16_t*>(qp.data() + (h * rp + r) * P));
    }
  }
  std::vector<float> ob(static_cast<size_t>(hkv * rp * D)), lb(static_cast<size_t>(hkv * rp));
  const int64_t tiles = rp / ROWS;
#pragma omp parallel for collapse(2) schedule(dynamic, 1)
  for (int64_t h = 0; h < hkv; ++h) {
    for (int64_t tile = 0; tile < tiles; ++tile) {
      const int64_t r0 = tile * ROWS;
      head_tile<D>(qp.data() + h * rp * P, kp.data() + h * tp * D, vp.data() + h * tp * D, t, tp, r0,
                   std::min<int64_t>(ROWS, rows - r0), ob.data() + (h * rp + r0) * D, lb.data() + h * rp + r0);
    }
  }
  float* od = out.data_ptr<float>();
  float* ld = lse.data_ptr<float>();
#pragma omp parallel for collapse(2) schedule(static)
  for (int64_t h = 0; h < hkv; ++h) {
    for (int64_t r = 0; r < rows; ++r) {
      const int64_t dst = (h * g + r / n) * n + r % n;  // (query head, position)
      std::memcpy(od + dst * D, ob.data() + (h * rp + r) * D, D * sizeof(float));
      ld[dst] = lb[h * rp + r] * LN2;
    }
  }
}

// q [Hq, N, D] float32 (contiguous), k, v [Hkv, T, D] float32 (last dim contiguous), Hq a multiple of Hkv,
// T >= 1, D 32 / 64 / 128 -> (out [Hq, N, D] float32, lse [Hq, N] float32: natural log-sum-exp of the scaled
// scores, as PyTorch's flash kernel returns it).
std::vector<torch::Tensor> prefix_attention_bf16(const torch::Tensor& q, const torch::Tensor& k,
                                                 const torch::Tensor& v, double scale) {
  TORCH_CHECK(__builtin_cpu_supports("avx512bf16"), "prefix_attention_bf16 needs AVX512-BF16");
  TORCH_CHECK(q.dim() == 3 && k.dim() == 3 && v.dim() == 3, "q [Hq, N, D], k and v [Hkv, T, D]");
  TORCH_CHECK(q.scalar_type() == torch::kFloat32 && k.scalar_type() == torch::kFloat32 &&
              v.scalar_type() == torch::kFloat32, "float32 inputs");
  TORCH_CHECK(q.is_contiguous() && k.stride(2) == 1 && v.stride(2) == 1, "contiguous rows");
  TORCH_CHECK(k.sizes() == v.sizes() && k.size(2) == q.size(2) && q.size(0) % k.size(0) == 0 && k.size(1) >= 1,
              "shapes: q [Hq, N, D], k = v [Hkv, T, D], Hq % Hkv == 0");
  auto out = torch::empty_like(q);
  auto lse = torch::empty({q.size(0), q.size(1)}, q.options());
  switch (q.size(2)) {
    case 32: run<32>(q, k, v, scale, out, lse); break;
    case 64: run<64>(q, k, v, scale, out, lse); break;
    case 128: run<128>(q, k, v, scale, out, lse); break;
    default: TORCH_CHECK(false, "head dim ", q.size(2), " (32, 64 or 128)");
  }
  return {out, lse};
}

}  // namespace

void register_prefix_attention(pybind11::module_& m) {
  m.def("prefix_attention_bf16", &prefix_attention_bf16,
        "a prompt chunk's attention to its earlier keys, bf16 dot products: (q, k, v, scale) -> (out, lse)");
}
