// KVDrive's CPU kernels of one decode layer over paged KV (runtime/attention/paged_kernels.py).
//
// select_pages: per sequence, each sealed page's estimated attention mass (the Quest bound q.c + |q|.r of its
//   key box, a softmax over the pages per query head, summed over the heads), plus the mass it drew at the
//   layer's last step; sinks and the recent window forced, pages a sequence lacks last. Returns the top K
//   page indices ascending and the next R by score: runtime/attention/selection.py's select_pages, computed
//   without a [B, Hkv, G, P] tensor per op. With a key sketch (each key quantised to 8 or 4 bits in its
//   page's box, runtime/attention/summaries.py) a page's per-head logit is the log of the softmax weight
//   its sketched keys sum to instead of its bound, so the same softmax over pages gives each page's share
//   of a softmax over every key; asked for them, it also returns those shares per query head and the
//   softmax's log normaliser (what --selection-rest means weighs the pages left out by); given the value
//   sketch (--selection-rest sketch), the column of the pages it left out: a softmax over their sketched
//   keys weighing their sketched values, computed in the same pass over every page less the selected pages'.
// locate_pages: where each selected page can be read in place (its slot in the host arena, which holds both
//   memory tiers), with the open page last, and how many entries hit each tier or missed both.
// paged_decode: exact softmax attention of one query per sequence over K/V read in place, column by column,
//   from the pool's (page, kv, head) rows (hits) or a staging buffer (misses), so the selected pages are
//   never gathered into a copy. Returns the output and the attention mass each column (page) drew, summed
//   over the query heads: runtime/attention/sparse.py's decode_attention over a gathered buffer. The pages
//   the selection left out may come as one more column per query head (a logit and a value), merged last.
// Work is split over (sequence, KV head, column range); the column ranges of one head are merged with their
// softmax maxima (split-K), so one sequence keeps both cores busy.
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <numeric>
#include <vector>

namespace {

constexpr float NEG_INF = -std::numeric_limits<float>::infinity();
constexpr int64_t MAX_G = 16;   // query heads per KV head
constexpr int64_t MAX_D = 512;  // head dimension

template <typename T> inline __m512 load16(const T* p);
template <> inline __m512 load16<float>(const float* p) { return _mm512_loadu_ps(p); }
template <> inline __m512 load16<at::BFloat16>(const at::BFloat16* p) {
  const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}
template <> inline __m512 load16<at::Half>(const at::Half* p) {
  return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}

// Ask for the next page's rows while this one is computed: the pages are scattered over the pool, so the
// hardware prefetcher only ever sees one 4 KiB row at a time.
template <typename T>
inline void prefetch(const T* p, int64_t elems) {
  const char* c = reinterpret_cast<const char*>(p);
  for (int64_t i = 0; i < elems * static_cast<int64_t>(sizeof(T)); i += 64) _mm_prefetch(c + i, _MM_HINT_T0);
}

// e^x in 16 lanes (Cephes' expf: range reduction by ln 2 in two parts, a degree-5 polynomial, 2^n by
// scalef), within 2 ulp of expf for x in [-87, 88]; softmax inputs here are <= 0, and below -87 it gives
// about 1e-38 where expf gives a denormal or 0.
inline __m512 exp16(__m512 x) {
  x = _mm512_max_ps(x, _mm512_set1_ps(-87.0f));
  x = _mm512_min_ps(x, _mm512_set1_ps(88.0f));
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
  __m512 p = _mm512_set1_ps(1.9875691500e-4f);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.3981999507e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3334519073e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1665795894e-2f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666665459e-1f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.0000001201e-1f));
  p = _mm512_fmadd_ps(p, _mm512_mul_ps(r, r), _mm512_add_ps(r, _mm512_set1_ps(1.0f)));
  return _mm512_scalef_ps(p, n);
}

// exp(v[i] - m) for i < n in place; returns their sum.
inline float exp_shifted(float* v, int64_t n, float m) {
  __m512 sum = _mm512_setzero_ps();
  const __m512 mm = _mm512_set1_ps(m);
  for (int64_t i = 0; i < n; i += 16) {
    const __mmask16 k = n - i >= 16 ? static_cast<__mmask16>(0xFFFF) : static_cast<__mmask16>((1u << (n - i)) - 1);
    const __m512 e = _mm512_maskz_mov_ps(k, exp16(_mm512_sub_ps(_mm512_maskz_loadu_ps(k, v + i), mm)));
    _mm512_mask_storeu_ps(v + i, k, e);
    sum = _mm512_add_ps(sum, e);
  }
  return _mm512_reduce_add_ps(sum);
}

struct Geometry {
  int64_t B, Hkv, G, D, S, W, parts;
};

// One unit: sequence b, KV head h, columns [w0, w1). Leaves its softmax max m[g], sum l[g], unnormalized
// output o[g][D] and each column's unnormalized mass cm[g][w].
// GC, DCC: the query heads per KV head and the head dim / 16 as compile-time constants (0: read from geo),
// so that the common shapes keep their queries and accumulators in registers.
template <typename T, int64_t GC, int64_t DCC>
void decode_unit(const Geometry& geo, int64_t b, int64_t h, int64_t p, const float* q, const T* rows,
                 const T* stage, const int64_t* slots, const int64_t* ntok, float* part_m, float* part_l,
                 float* part_o, float* part_cm) {
  const int64_t G = GC ? GC : geo.G, DC = DCC ? DCC : geo.D / 16, D = DC * 16;
  const int64_t S = geo.S, W = geo.W, Hkv = geo.Hkv, SD = S * D;
  constexpr int64_t NG = GC ? GC : MAX_G, NV = GC && DCC ? GC * DCC : MAX_G * (MAX_D / 16);
  const int64_t w0 = W * p / geo.parts, w1 = W * (p + 1) / geo.parts;
  const float scale = 1.0f / std::sqrt(static_cast<float>(D));
  __m512 qv[NV];
  for (int64_t g = 0; g < G; ++g)
    for (int64_t c = 0; c < DC; ++c)
      qv[g * DC + c] = _mm512_mul_ps(_mm512_loadu_ps(q + ((b * Hkv + h) * G + g) * D + c * 16), _mm512_set1_ps(scale));
  auto base = [&](int64_t w, int64_t kv) -> const T* {
    const int64_t slot = slots[b * W + w];
    if (slot >= 0) return rows + ((slot * 2 + kv) * Hkv + h) * SD;
    return stage + (((-1 - slot) * 2 + kv) * Hkv + h) * SD;
  };
  const int64_t cols = w1 - w0;
  std::vector<float> sc(static_cast<size_t>(G * cols * S));
  float m[NG];
  std::fill(m, m + G, NEG_INF);
  auto ahead = [&](int64_t w, int64_t kv) {
    if (w < w1 && ntok[b * W + w] > 0) prefetch(base(w, kv), SD);
  };
  for (int64_t w = w0; w < w0 + 4; ++w) ahead(w, 0);
  for (int64_t w = w0; w < w0 + 2; ++w) ahead(w, 1);
  for (int64_t w = w0; w < w1; ++w) {
    const int64_t n = ntok[b * W + w];
    ahead(w + 4, 0);
    ahead(w + 2, 1);
    if (n <= 0) continue;
    const T* k = base(w, 0);
    for (int64_t t = 0; t < n; ++t) {
      __m512 acc[NG];
      for (int64_t g = 0; g < G; ++g) acc[g] = _mm512_setzero_ps();
      for (int64_t c = 0; c < DC; ++c) {
        const __m512 kv = load16<T>(k + t * D + c * 16);
        for (int64_t g = 0; g < G; ++g) acc[g] = _mm512_fmadd_ps(qv[g * DC + c], kv, acc[g]);
      }
      for (int64_t g = 0; g < G; ++g) {
        const float s = _mm512_reduce_add_ps(acc[g]);
        sc[(g * cols + (w - w0)) * S + t] = s;
        m[g] = std::max(m[g], s);
      }
    }
  }
  const int64_t unit = (b * Hkv + h) * geo.parts + p;
  __m512 ov[NV];
  for (int64_t i = 0; i < G * DC; ++i) ov[i] = _mm512_setzero_ps();
  float l[NG];
  std::fill(l, l + G, 0.f);
  for (int64_t w = w0; w < w1; ++w) {
    const int64_t n = ntok[b * W + w];
    float* cm = part_cm + ((b * Hkv + h) * G) * W + w;  // [g * W]
    if (n <= 0) {
      for (int64_t g = 0; g < G; ++g) cm[g * W] = 0.f;
      continue;
    }
    for (int64_t g = 0; g < G; ++g) {
      const float sum = exp_shifted(&sc[(g * cols + (w - w0)) * S], n, m[g]);
      cm[g * W] = sum;
      l[g] += sum;
    }
    const T* v = base(w, 1);
    for (int64_t t = 0; t < n; ++t) {
      for (int64_t c = 0; c < DC; ++c) {
        const __m512 vv = load16<T>(v + t * D + c * 16);
        for (int64_t g = 0; g < G; ++g)
          ov[g * DC + c] = _mm512_fmadd_ps(_mm512_set1_ps(sc[(g * cols + (w - w0)) * S + t]), vv, ov[g * DC + c]);
      }
    }
  }
  for (int64_t g = 0; g < G; ++g) {
    part_m[unit * G + g] = m[g];
    part_l[unit * G + g] = l[g];
    for (int64_t c = 0; c < DC; ++c) _mm512_storeu_ps(part_o + (unit * G + g) * D + c * 16, ov[g * DC + c]);
  }
}

template <typename T>
using UnitFn = void (*)(const Geometry&, int64_t, int64_t, int64_t, const float*, const T*, const T*, const int64_t*,
                        const int64_t*, float*, float*, float*, float*);

// The unit specialized for the models' shapes (SmolLM2 3 x 64, Gemma 3 4 x 256, Llama 3 / Qwen 4 x 128 and
// 8 x 128, Mistral / Qwen 2 x 128 and 7 x 128), else the one that reads G and D at run time.
template <typename T>
UnitFn<T> pick_unit(int64_t G, int64_t D) {
  if (G == 3 && D == 64) return &decode_unit<T, 3, 4>;
  if (G == 4 && D == 256) return &decode_unit<T, 4, 16>;
  if (G == 4 && D == 128) return &decode_unit<T, 4, 8>;
  if (G == 8 && D == 128) return &decode_unit<T, 8, 8>;
  if (G == 7 && D == 128) return &decode_unit<T, 7, 8>;
  if (G == 2 && D == 128) return &decode_unit<T, 2, 8>;
  return &decode_unit<T, 0, 0>;
}

void check_decode(const torch::Tensor& q, const torch::Tensor& rows, const torch::Tensor& stage,
                  const torch::Tensor& slots, const torch::Tensor& ntok, int64_t hkv, int64_t page_size) {
  TORCH_CHECK(q.dim() == 3 && q.scalar_type() == torch::kFloat && q.is_contiguous(), "q: [B, Hq, D] float32");
  const int64_t B = q.size(0), Hq = q.size(1), D = q.size(2);
  TORCH_CHECK(Hq % hkv == 0 && Hq / hkv <= MAX_G, "query heads per KV head: at most ", MAX_G);
  TORCH_CHECK(D % 16 == 0 && D <= MAX_D, "head dim: a multiple of 16 up to ", MAX_D);
  TORCH_CHECK(rows.dim() == 2 && rows.size(1) == page_size * D && rows.is_contiguous(), "rows: [R, S * D]");
  TORCH_CHECK(stage.scalar_type() == rows.scalar_type() && stage.is_contiguous(), "stage: contiguous, the rows' dtype");
  TORCH_CHECK(stage.numel() % (2 * hkv * page_size * D) == 0, "stage: [M, 2, Hkv, S, D]");
  TORCH_CHECK(slots.dim() == 2 && slots.size(0) == B && slots.scalar_type() == torch::kLong && slots.is_contiguous(),
              "slots: [B, W] int64");
  TORCH_CHECK(ntok.sizes() == slots.sizes() && ntok.scalar_type() == torch::kLong && ntok.is_contiguous(),
              "ntok: [B, W] int64");
  const int64_t R = rows.size(0) / (2 * hkv), M = stage.numel() / (2 * hkv * page_size * D);
  const int64_t* s = slots.data_ptr<int64_t>();
  const int64_t* n = ntok.data_ptr<int64_t>();
  for (int64_t i = 0; i < slots.numel(); ++i) {
    TORCH_CHECK(n[i] >= 0 && n[i] <= page_size, "ntok out of 0..", page_size);
    TORCH_CHECK(n[i] == 0 || (s[i] >= 0 ? s[i] < R : -1 - s[i] < M), "slot ", s[i], " out of the pool or stage");
  }
}

}  // namespace

// q [B, Hq, D] float32; rows [R, S * D] (the pool's (slot, kv, head) rows, float32 / bfloat16 / float16);
// stage [M, 2, Hkv, S, D] (blocks that missed every memory tier, the rows' dtype); slots [B, W] int64 (a pool
// slot, or -1 - j for stage block j); ntok [B, W] int64 (tokens attended in each column, 0: none)
// rest_lse [B, Hq] and rest_out [B, Hq, D] float32, or both empty: one more column per query head, of logit
// rest_lse and value rest_out (the pages the selection left out, runtime/attention/selection.py's
// rest_of_pages)
// -> out [B, Hq, D] float32, mass [B, W] float32 (each column's share of the softmax, the rest column's included).
std::vector<torch::Tensor> paged_decode(torch::Tensor q, torch::Tensor rows, torch::Tensor stage, torch::Tensor slots,
                                        torch::Tensor ntok, int64_t hkv, int64_t page_size, torch::Tensor rest_lse,
                                        torch::Tensor rest_out) {
  check_decode(q, rows, stage, slots, ntok, hkv, page_size);
  const int64_t B = q.size(0), D = q.size(2), W = slots.size(1), G = q.size(1) / hkv;
  const bool rest = rest_lse.numel() > 0;
  if (rest) {
    TORCH_CHECK(rest_lse.scalar_type() == torch::kFloat && rest_lse.is_contiguous() && rest_lse.numel() == B * hkv * G,
                "rest_lse: [B, Hq] float32");
    TORCH_CHECK(rest_out.scalar_type() == torch::kFloat && rest_out.is_contiguous() &&
                    rest_out.numel() == B * hkv * G * D, "rest_out: [B, Hq, D] float32");
  }
  const float* rl = rest ? rest_lse.data_ptr<float>() : nullptr;
  const float* ro = rest ? rest_out.data_ptr<float>() : nullptr;
  const int64_t threads = at::get_num_threads();
  const int64_t parts = std::max<int64_t>(1, std::min<int64_t>(W / 4, (2 * threads + B * hkv - 1) / (B * hkv)));
  const Geometry geo{B, hkv, G, D, page_size, W, parts};
  const auto f = q.options();
  auto part_m = torch::empty({B * hkv * parts * G}, f), part_l = torch::empty({B * hkv * parts * G}, f);
  auto part_o = torch::empty({B * hkv * parts * G * D}, f), part_cm = torch::empty({B * hkv * G * W}, f);
  const float* qp = q.data_ptr<float>();
  const int64_t* sp = slots.data_ptr<int64_t>();
  const int64_t* np = ntok.data_ptr<int64_t>();
  float *pm = part_m.data_ptr<float>(), *pl = part_l.data_ptr<float>(), *po = part_o.data_ptr<float>(),
        *pc = part_cm.data_ptr<float>();
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, rows.scalar_type(), "paged_decode", [&] {
    if constexpr (std::is_same_v<scalar_t, double>) {
      TORCH_CHECK(false, "rows: float32, bfloat16 or float16");
    } else {
      const scalar_t* rp = rows.data_ptr<scalar_t>();
      const scalar_t* stp = stage.data_ptr<scalar_t>();
      const auto unit = pick_unit<scalar_t>(G, D);
      at::parallel_for(0, B * hkv * parts, 1, [&](int64_t u0, int64_t u1) {
        for (int64_t u = u0; u < u1; ++u) {
          const int64_t p = u % parts, bh = u / parts;
          unit(geo, bh / hkv, bh % hkv, p, qp, rp, stp, sp, np, pm, pl, po, pc);
        }
      });
    }
  });
  auto out = torch::empty({B, hkv * G, D}, f);
  auto mass = torch::zeros({B, W}, f);
  float *op = out.data_ptr<float>(), *mp = mass.data_ptr<float>();
  for (int64_t bh = 0; bh < B * hkv; ++bh) {
    const int64_t b = bh / hkv;
    for (int64_t g = 0; g < G; ++g) {
      const float rlse = rest ? rl[bh * G + g] : NEG_INF;
      float mx = rlse;
      for (int64_t p = 0; p < parts; ++p) mx = std::max(mx, pm[(bh * parts + p) * G + g]);
      float scalep[64];
      float total = 0.f;
      for (int64_t p = 0; p < parts; ++p) {
        const float mp_ = pm[(bh * parts + p) * G + g];
        scalep[p] = mp_ == NEG_INF ? 0.f : std::exp(mp_ - mx);
        total += pl[(bh * parts + p) * G + g] * scalep[p];
      }
      const float rw = rlse == NEG_INF ? 0.f : std::exp(rlse - mx);  // the rest column's weight
      total += rw;
      float* o = op + (bh * G + g) * D;
      for (int64_t d = 0; d < D; ++d) {
        float acc = rw == 0.f ? 0.f : rw * ro[(bh * G + g) * D + d];
        for (int64_t p = 0; p < parts; ++p) acc += po[((bh * parts + p) * G + g) * D + d] * scalep[p];
        o[d] = acc / total;
      }
      for (int64_t p = 0; p < parts; ++p) {
        const float k = scalep[p] / total;
        for (int64_t w = W * p / parts; w < W * (p + 1) / parts; ++w) mp[b * W + w] += pc[(bh * G + g) * W + w] * k;
      }
    }
  }
  return {out, mass};
}

namespace {

// The Quest bound q.c + radius * |q|.r of pages [p0, p1) of one KV head's summaries (rows ``stride`` apart, [2D] each:
// center, radius) for the G queries q [G, D] of its query heads, scaled: bound[g * P + p]. Each summary row is
// read once for all G queries. GC, DCC: G and D / 16 as compile-time constants (0: read at run time), so
// that the queries stay in registers.
template <int64_t GC, int64_t DCC>
void quest_bounds(const float* q, const float* summ, int64_t stride, int64_t p0, int64_t p1, int64_t G_, int64_t D,
                  int64_t P, float scale, float radius, float* bound) {
  const int64_t G = GC ? GC : G_, DC = DCC ? DCC : D / 16;
  constexpr int64_t NG = GC ? GC : MAX_G, NV = GC && DCC ? GC * DCC : MAX_G * (MAX_D / 16);
  __m512 qq[NV], qa[NV];
  for (int64_t g = 0; g < G; ++g)
    for (int64_t c = 0; c < DC; ++c) {
      qq[g * DC + c] = _mm512_mul_ps(_mm512_loadu_ps(q + g * D + c * 16), _mm512_set1_ps(scale));
      qa[g * DC + c] = _mm512_mul_ps(_mm512_abs_ps(qq[g * DC + c]), _mm512_set1_ps(radius));
    }
  for (int64_t p = p0; p < p1; ++p) {
    const float* cr = summ + p * stride;  // [2D]: center, radius
    __m512 acc[NG];
    for (int64_t g = 0; g < G; ++g) acc[g] = _mm512_setzero_ps();
    for (int64_t c = 0; c < DC; ++c) {
      const __m512 cc = _mm512_loadu_ps(cr + c * 16), rr = _mm512_loadu_ps(cr + D + c * 16);
      for (int64_t g = 0; g < G; ++g) {
        acc[g] = _mm512_fmadd_ps(qq[g * DC + c], cc, acc[g]);
        acc[g] = _mm512_fmadd_ps(qa[g * DC + c], rr, acc[g]);
      }
    }
    for (int64_t g = 0; g < G; ++g) bound[g * P + p] = _mm512_reduce_add_ps(acc[g]);
  }
}

using BoundsFn = void (*)(const float*, const float*, int64_t, int64_t, int64_t, int64_t, int64_t, int64_t, float,
                          float, float*);

// One page's 16 token scores per query head from the key sketch: acc[g] lane t = q_g . k_t * scale, each key
// k_t = kmin + code_t * step (kmin = c - r, step = 2r / (2^bits - 1) from the page's summary row ``cr`` [2D]).
// Codes [Dp, 16] (``code``): byte (j, t) is token t's code of dimension j (8 bits) or of dimensions 2j (low
// nibble) and 2j + 1 (high nibble) (4 bits), so a load of 16 bytes is one dimension for all 16 tokens. ``qs``
// [G, D] is scratch. GC: G as a compile-time constant (0: at run time).
template <int64_t GC, int BITS>
inline void page_key_scores(const float* q, const float* cr, const uint8_t* code, int64_t G_, int64_t D, float scale,
                            float* qs, __m512* acc) {
  const int64_t G = GC ? GC : G_, DC = D / 16;
  constexpr int64_t NG = GC ? GC : MAX_G;
  const float unit = 2.0f / static_cast<float>((1 << BITS) - 1);
  __m512 base[NG];
  for (int64_t g = 0; g < G; ++g) base[g] = _mm512_setzero_ps();
  for (int64_t c = 0; c < DC; ++c) {
    const __m512 cc = _mm512_loadu_ps(cr + c * 16), rr = _mm512_loadu_ps(cr + D + c * 16);
    const __m512 lo = _mm512_sub_ps(cc, rr), st = _mm512_mul_ps(rr, _mm512_set1_ps(unit * scale));
    for (int64_t g = 0; g < G; ++g) {
      const __m512 qq = _mm512_loadu_ps(q + g * D + c * 16);
      base[g] = _mm512_fmadd_ps(qq, lo, base[g]);
      _mm512_store_ps(qs + g * D + c * 16, _mm512_mul_ps(qq, st));
    }
  }
  for (int64_t g = 0; g < G; ++g) acc[g] = _mm512_set1_ps(_mm512_reduce_add_ps(base[g]) * scale);
  if constexpr (BITS == 8) {
    for (int64_t d = 0; d < D; ++d) {
      const __m512 kv = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(
          _mm_loadu_si128(reinterpret_cast<const __m128i*>(code + d * 16))));
      for (int64_t g = 0; g < G; ++g) acc[g] = _mm512_fmadd_ps(_mm512_set1_ps(qs[g * D + d]), kv, acc[g]);
    }
  } else {
    for (int64_t j = 0; j < D / 2; ++j) {
      const __m512i w = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(code + j * 16)));
      const __m512 even = _mm512_cvtepi32_ps(_mm512_and_si512(w, _mm512_set1_epi32(0xF)));
      const __m512 odd = _mm512_cvtepi32_ps(_mm512_srli_epi32(w, 4));
      for (int64_t g = 0; g < G; ++g) {
        acc[g] = _mm512_fmadd_ps(_mm512_set1_ps(qs[g * D + 2 * j]), even, acc[g]);
        acc[g] = _mm512_fmadd_ps(_mm512_set1_ps(qs[g * D + 2 * j + 1]), odd, acc[g]);
      }
    }
  }
}

// The sketch's page logits: for pages [p0, p1) of one KV head, logit[g * P + p] = log sum_t exp(q_g . k_t *
// scale) over the page's 16 keys (``page_key_scores``; codes [Dp, 16] per page, ``cstride`` bytes apart): the
// 16 lanes hold the tokens and each query head keeps one accumulator of its 16 scores. GC: G as a
// compile-time constant (0: at run time).
template <int64_t GC, int BITS>
void sketch_logits(const float* q, const float* summ, int64_t stride, const uint8_t* codes, int64_t cstride,
                   int64_t p0, int64_t p1, int64_t G_, int64_t D, int64_t P, float scale, float* logit) {
  const int64_t G = GC ? GC : G_;
  constexpr int64_t NG = GC ? GC : MAX_G;
  alignas(64) float qs[MAX_G * MAX_D];  // [G, D]: q_g * step * scale of the page at hand
  for (int64_t p = p0; p < p1; ++p) {
    __m512 acc[NG];
    page_key_scores<GC, BITS>(q, summ + p * stride, codes + p * cstride, G, D, scale, qs, acc);
    for (int64_t g = 0; g < G; ++g) {
      const float m = _mm512_reduce_max_ps(acc[g]);
      logit[g * P + p] = m + std::log(_mm512_reduce_add_ps(exp16(_mm512_sub_ps(acc[g], _mm512_set1_ps(m)))));
    }
  }
}

using SketchFn = void (*)(const float*, const float*, int64_t, const uint8_t*, int64_t, int64_t, int64_t, int64_t,
                          int64_t, int64_t, float, float*);

template <int BITS>
SketchFn pick_sketch_group(int64_t G) {
  switch (G) {  // the query heads per KV head of the registry's models (Qwen 0.5B / 1.5B, Gemma 3, SmolLM2)
    case 7: return &sketch_logits<7, BITS>;
    case 6: return &sketch_logits<6, BITS>;
    case 4: return &sketch_logits<4, BITS>;
    case 3: return &sketch_logits<3, BITS>;
    default: return &sketch_logits<0, BITS>;
  }
}

SketchFn pick_sketch(int64_t G, int64_t bits) { return bits == 8 ? pick_sketch_group<8>(G) : pick_sketch_group<4>(G); }

BoundsFn pick_bounds(int64_t G, int64_t D) {
  if (G == 3 && D == 64) return &quest_bounds<3, 4>;
  if (G == 4 && D == 256) return &quest_bounds<4, 16>;
  if (G == 4 && D == 128) return &quest_bounds<4, 8>;
  if (G == 8 && D == 128) return &quest_bounds<8, 8>;
  return &quest_bounds<0, 0>;
}

}  // namespace

namespace {

// The pages [p0, p1) of one KV head that a selection left out (``skip``), every key and value as its sketch
// gives it: token scores as sketch_logits computes them (the key sketch, BITS 8 or 4), values
// vmin + code * vstep from the value sketch (8 bits, token-major [S, D] a page, ``vstride`` bytes apart;
// the value box rows [2D] ``bstride`` floats apart). Leaves a softmax over those keys, unnormalised: its max
// m[g], sum l[g] and output o[g * D + d]. GC, DCC: G and D / 16 as compile-time constants (0: run time).
template <int64_t GC, int64_t DCC, int BITS>
void rest_unit(const float* q, const float* summ, int64_t stride, const uint8_t* codes, int64_t cstride,
               const float* vbox, int64_t bstride, const uint8_t* vcodes, int64_t vstride, const bool* skip,
               int64_t p0, int64_t p1, int64_t G_, int64_t D_, float scale, float* m_out, float* l_out, float* o_out,
               float* logit, int64_t P) {
  const int64_t G = GC ? GC : G_, DC = DCC ? DCC : D_ / 16, D = DC * 16;
  constexpr int64_t NG = GC ? GC : MAX_G, NV = GC && DCC ? GC * DCC : MAX_G * (MAX_D / 16);
  constexpr int64_t NC = DCC ? DCC : MAX_D / 16;
  constexpr int64_t S = 16;
  alignas(64) float qs[MAX_G * MAX_D];  // [G, D]: q_g * step * scale of the page at hand
  alignas(64) float e[MAX_G * S];       // [G, S]: the page's token weights, relative to m[g]
  __m512 ov[NV];
  for (int64_t i = 0; i < G * DC; ++i) ov[i] = _mm512_setzero_ps();
  float m[NG], l[NG];
  std::fill(m, m + G, NEG_INF);
  std::fill(l, l + G, 0.f);
  for (int64_t p = p0; p < p1; ++p) {
    if (skip && skip[p]) continue;
    __m512 acc[NG];
    page_key_scores<GC, BITS>(q, summ + p * stride, codes + p * cstride, G, D, scale, qs, acc);
    for (int64_t g = 0; g < G; ++g) {  // online softmax: rescale what came before when the max rises
      const float pm = _mm512_reduce_max_ps(acc[g]);
      if (pm > m[g]) {
        const float k = m[g] == NEG_INF ? 0.f : std::exp(m[g] - pm);
        l[g] *= k;
        for (int64_t c = 0; c < DC; ++c) ov[g * DC + c] = _mm512_mul_ps(ov[g * DC + c], _mm512_set1_ps(k));
        m[g] = pm;
      }
      const __m512 w = exp16(_mm512_sub_ps(acc[g], _mm512_set1_ps(m[g])));
      const float pl = _mm512_reduce_add_ps(w);
      l[g] += pl;
      _mm512_store_ps(e + g * S, w);
      if (logit) logit[g * P + p] = m[g] + std::log(pl);  // the page's log-sum-exp, as sketch_logits gives it
    }
    const float* vb = vbox + p * bstride;  // [2D]: the values' box center, radius
    __m512 vmin[NC], vstep[NC];
    for (int64_t c = 0; c < DC; ++c) {
      const __m512 cc = _mm512_loadu_ps(vb + c * 16), rr = _mm512_loadu_ps(vb + D + c * 16);
      vmin[c] = _mm512_sub_ps(cc, rr);
      vstep[c] = _mm512_mul_ps(rr, _mm512_set1_ps(2.0f / 255.0f));
    }
    const uint8_t* vcode = vcodes + p * vstride;  // [S, D]
    for (int64_t t = 0; t < S; ++t) {
      __m512 vh[NC];
      for (int64_t c = 0; c < DC; ++c) {
        const __m512 code8 = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(
            _mm_loadu_si128(reinterpret_cast<const __m128i*>(vcode + t * D + c * 16))));
        vh[c] = _mm512_fmadd_ps(code8, vstep[c], vmin[c]);
      }
      for (int64_t g = 0; g < G; ++g) {
        const __m512 wt = _mm512_set1_ps(e[g * S + t]);
        for (int64_t c = 0; c < DC; ++c) ov[g * DC + c] = _mm512_fmadd_ps(wt, vh[c], ov[g * DC + c]);
      }
    }
  }
  for (int64_t g = 0; g < G; ++g) {
    m_out[g] = m[g];
    l_out[g] = l[g];
    for (int64_t c = 0; c < DC; ++c) _mm512_storeu_ps(o_out + g * D + c * 16, ov[g * DC + c]);
  }
}

using RestFn = void (*)(const float*, const float*, int64_t, const uint8_t*, int64_t, const float*, int64_t,
                        const uint8_t*, int64_t, const bool*, int64_t, int64_t, int64_t, int64_t, float, float*, float*,
                        float*, float*, int64_t);

template <int BITS>
RestFn pick_rest_bits(int64_t G, int64_t D) {
  if (G == 7 && D == 64) return &rest_unit<7, 4, BITS>;  // Qwen2.5 0.5B
  if (G == 6 && D == 128) return &rest_unit<6, 8, BITS>;  // Qwen2.5 1.5B
  if (G == 3 && D == 64) return &rest_unit<3, 4, BITS>;  // SmolLM2
  if (G == 4 && D == 256) return &rest_unit<4, 16, BITS>;  // Gemma 3
  return &rest_unit<0, 0, BITS>;
}

RestFn pick_rest(int64_t G, int64_t D, int64_t bits) { return bits == 8 ? pick_rest_bits<8>(G, D) : pick_rest_bits<4>(G, D); }

}  // namespace

// q [B, Hq, D] float32; summaries [B, Hkv, P, 2D] float32 (center, radius; any strides but the last);
// drawn [B, P] float32 (last stride 1); npages [B] int64; codes (bits 8 or 4) [B, Hkv, P, D * bits / 8, 16]
// uint8, the last two dims contiguous (bits 0: none, codes ignored) -> selected [B, K] int64 ascending,
// runners-up [B, min(P, K + R) - K] int64 by score (see select_pages in runtime/attention/selection.py), and
// with ``weights`` (a sketch's) each page's share of each query head's softmax [B, Hkv, G, P] (0 past a
// sequence's pages) and that softmax's log normaliser [B, Hkv, G] (selection.py's sketch_weights), and with
// the value sketch, vbox [B, Hkv, P, 2D] float32 (the values' box per page; last stride 1) and vcodes [B, Hkv,
// P, 16, D] uint8 (the values quantised to 8 bits in it, token-major; the last two dims contiguous; both empty:
// none), the pages left out as one column: lse [B, Hkv, G], mean [B, Hkv, G, D] (selection.py's
// sketched_rest; -inf and 0 where nothing, or under 1e-4 of the sketched mass, was left out).
std::vector<torch::Tensor> select_pages(torch::Tensor q, torch::Tensor summaries, torch::Tensor drawn,
                                        torch::Tensor npages, int64_t sink, int64_t recent, int64_t k, int64_t runners_up,
                                        double radius, torch::Tensor codes, int64_t bits, bool weights,
                                        torch::Tensor vbox, torch::Tensor vcodes) {
  TORCH_CHECK(q.dim() == 3 && q.scalar_type() == torch::kFloat && q.is_contiguous(), "q: [B, Hq, D] float32");
  TORCH_CHECK(summaries.dim() == 4 && summaries.scalar_type() == torch::kFloat && summaries.stride(3) == 1,
              "summaries: [B, Hkv, P, 2D] float32");
  const int64_t B = q.size(0), Hq = q.size(1), D = q.size(2), Hkv = summaries.size(1), P = summaries.size(2);
  TORCH_CHECK(summaries.size(0) == B && summaries.size(3) == 2 * D && Hq % Hkv == 0, "summaries do not match q");
  TORCH_CHECK(drawn.dim() == 2 && drawn.size(0) == B && drawn.size(1) == P && drawn.stride(1) == 1 &&
              drawn.scalar_type() == torch::kFloat, "drawn: [B, P] float32");
  TORCH_CHECK(npages.dim() == 1 && npages.size(0) == B && npages.scalar_type() == torch::kLong, "npages: [B] int64");
  TORCH_CHECK(k >= 1 && k <= P && runners_up >= 0, "k: 1..P");
  TORCH_CHECK(D % 16 == 0 && D <= MAX_D, "head dim: a multiple of 16 up to ", MAX_D);
  const int64_t G = Hq / Hkv, total = std::min(P, k + runners_up);
  const float scale = 1.0f / std::sqrt(static_cast<float>(D));
  auto npc = npages.contiguous();
  const int64_t* np = npc.data_ptr<int64_t>();
  for (int64_t b = 0; b < B; ++b) TORCH_CHECK(np[b] >= 0 && np[b] <= P, "npages out of 0..P");
  TORCH_CHECK(bits == 0 || bits == 4 || bits == 8, "bits: 0, 4 or 8");
  TORCH_CHECK(G <= MAX_G, "at most ", MAX_G, " query heads per KV head");
  if (bits) {
    TORCH_CHECK(codes.dim() == 5 && codes.scalar_type() == torch::kByte && codes.size(0) == B &&
                    codes.size(1) == Hkv && codes.size(2) == P && codes.size(3) == D * bits / 8 &&
                    codes.size(4) == 16 && codes.stride(4) == 1 && codes.stride(3) == 16,
                "codes: [B, Hkv, P, D * bits / 8, 16] uint8, the last two dims contiguous");
  }
  const bool rest = vbox.numel() > 0;  // --selection-rest sketch: the left-out pages' column too
  if (rest) {
    TORCH_CHECK(bits, "vbox, vcodes: with a key sketch only");
    TORCH_CHECK(vbox.dim() == 4 && vbox.scalar_type() == torch::kFloat && vbox.stride(3) == 1 && vbox.size(0) == B &&
                    vbox.size(1) == Hkv && vbox.size(2) == P && vbox.size(3) == 2 * D, "vbox: [B, Hkv, P, 2D] float32");
    TORCH_CHECK(vcodes.dim() == 5 && vcodes.scalar_type() == torch::kByte && vcodes.size(0) == B &&
                    vcodes.size(1) == Hkv && vcodes.size(2) == P && vcodes.size(3) == 16 && vcodes.size(4) == D &&
                    vcodes.stride(4) == 1 && vcodes.stride(3) == D,
                "vcodes: [B, Hkv, P, 16, D] uint8, the last two dims contiguous");
  }
  // [B, Hkv, G, P]: each query head's softmax over the pages' logits (bounds or sketch), one unit per query head
  auto head_mass = torch::empty({B, Hkv, G, P}, q.options());
  const float* qp = q.data_ptr<float>();
  const float* sp = summaries.data_ptr<float>();
  const int64_t s0 = summaries.stride(0), s1 = summaries.stride(1), s2 = summaries.stride(2);
  float* hm = head_mass.data_ptr<float>();
  const auto bounds = pick_bounds(G, D);
  const auto sketch = bits ? pick_sketch(G, bits) : nullptr;
  const uint8_t* cp = bits ? codes.data_ptr<uint8_t>() : nullptr;
  const int64_t c0 = bits ? codes.stride(0) : 0, c1 = bits ? codes.stride(1) : 0, c2 = bits ? codes.stride(2) : 0;
  // the logits: (sequence, KV head, page range) units, so that one sequence keeps both cores busy
  const int64_t threads = at::get_num_threads();
  const int64_t chunks = std::max<int64_t>(1, std::min<int64_t>(P / 16, (2 * threads + B * Hkv - 1) / (B * Hkv)));
  // with the rest: every page's sketched keys weigh its sketched values in the same pass (a softmax over all
  // of them per unit, unnormalised); the selected pages' share is taken out once they are known
  const auto rest_fn = rest ? pick_rest(G, D, bits) : nullptr;
  const auto f = q.options();
  auto rm = rest ? torch::empty({B * Hkv * (chunks + 1) * G}, f) : torch::empty({0}, f);
  auto rl = rest ? torch::empty({B * Hkv * (chunks + 1) * G}, f) : torch::empty({0}, f);
  auto ro = rest ? torch::empty({B * Hkv * (chunks + 1) * G * D}, f) : torch::empty({0}, f);
  float *rmp = rest ? rm.data_ptr<float>() : nullptr, *rlp = rest ? rl.data_ptr<float>() : nullptr,
        *rop = rest ? ro.data_ptr<float>() : nullptr;  // [(b, h), chunk + 1, G (, D)]: the last slot the selected pages'
  const float* vbp = rest ? vbox.data_ptr<float>() : nullptr;
  const uint8_t* vcp = rest ? vcodes.data_ptr<uint8_t>() : nullptr;
  at::parallel_for(0, B * Hkv * chunks, 1, [&](int64_t u0, int64_t u1) {
    for (int64_t u = u0; u < u1; ++u) {
      const int64_t c = u % chunks, bh = u / chunks, b = bh / Hkv, h = bh % Hkv, n = np[b];
      const int64_t slot = bh * (chunks + 1) + c;
      if (rest_fn)
        rest_fn(qp + bh * G * D, sp + b * s0 + h * s1, s2, cp + b * c0 + h * c1, c2,
                vbp + b * vbox.stride(0) + h * vbox.stride(1), vbox.stride(2),
                vcp + b * vcodes.stride(0) + h * vcodes.stride(1), vcodes.stride(2), nullptr, n * c / chunks,
                n * (c + 1) / chunks, G, D, scale, rmp + slot * G, rlp + slot * G, rop + slot * G * D,
                hm + bh * G * P, P);
      else if (sketch)
        sketch(qp + bh * G * D, sp + b * s0 + h * s1, s2, cp + b * c0 + h * c1, c2, n * c / chunks,
               n * (c + 1) / chunks, G, D, P, scale, hm + bh * G * P);
      else
        bounds(qp + bh * G * D, sp + b * s0 + h * s1, s2, n * c / chunks, n * (c + 1) / chunks, G, D, P, scale,
               static_cast<float>(radius), hm + bh * G * P);
    }
  });
  // then each query head's softmax over its sequence's pages
  TORCH_CHECK(!weights || bits, "weights: a key sketch's only");
  auto log_total = weights ? torch::empty({B, Hkv, G}, q.options()) : torch::empty({0}, q.options());
  float* lt = weights ? log_total.data_ptr<float>() : nullptr;
  at::parallel_for(0, B * Hq, 1, [&](int64_t u0, int64_t u1) {
    for (int64_t u = u0; u < u1; ++u) {
      const int64_t n = np[u / Hq];
      float* row = hm + u * P;  // head_mass[b, h, g]
      if (lt) {
        std::fill(row + n, row + P, 0.f);
        lt[u] = NEG_INF;
      }
      if (n == 0) continue;
      float mx = NEG_INF;
      for (int64_t p = 0; p < n; ++p) mx = std::max(mx, row[p]);
      const float sum = exp_shifted(row, n, mx);
      for (int64_t p = 0; p < n; ++p) row[p] /= sum;
      if (lt) lt[u] = mx + std::log(sum);
    }
  });
  auto selected = torch::empty({B, k}, npages.options());
  auto near = torch::empty({B, total - k}, npages.options());
  int64_t *sel = selected.data_ptr<int64_t>(), *nr = near.data_ptr<int64_t>();
  const float* dp = drawn.data_ptr<float>();
  const int64_t d0 = drawn.stride(0);
  at::parallel_for(0, B, 1, [&](int64_t b0, int64_t b1) {
    std::vector<float> score(static_cast<size_t>(P));
    std::vector<int64_t> order(static_cast<size_t>(P));
    for (int64_t b = b0; b < b1; ++b) {
      const int64_t n = np[b];
      for (int64_t p = 0; p < P; ++p) {
        if (p >= n) {
          score[p] = NEG_INF;
        } else if (p < sink || p >= n - recent) {
          score[p] = std::numeric_limits<float>::infinity();
        } else {
          float s = dp[b * d0 + p];
          for (int64_t h = 0; h < Hkv; ++h) {  // the heads' masses summed per KV head, then over the KV heads
            float hs = 0.f;
            for (int64_t g = 0; g < G; ++g) hs += hm[((b * Hkv + h) * G + g) * P + p];
            s += hs;
          }
          score[p] = s;
        }
      }
      std::iota(order.begin(), order.end(), 0);
      std::partial_sort(order.begin(), order.begin() + total, order.end(), [&](int64_t x, int64_t y) {
        return score[x] > score[y] || (score[x] == score[y] && x < y);
      });
      std::sort(order.begin(), order.begin() + k);
      std::copy(order.begin(), order.begin() + k, sel + b * k);
      std::copy(order.begin() + k, order.begin() + total, nr + b * (total - k));
    }
  });
  std::vector<torch::Tensor> out{selected, near};
  if (weights) {
    out.push_back(head_mass);
    out.push_back(log_total);
  }
  if (!rest) return out;
  // the selected pages' part of each unit's softmax, in the slot after the chunks', then all of it less theirs
  at::parallel_for(0, B * Hkv, 1, [&](int64_t u0, int64_t u1) {
    std::vector<uint8_t> skip(static_cast<size_t>(P));
    for (int64_t bh = u0; bh < u1; ++bh) {
      const int64_t b = bh / Hkv, h = bh % Hkv, n = np[b];
      std::fill(skip.begin(), skip.end(), 1);
      for (int64_t j = 0; j < k; ++j)
        if (sel[b * k + j] < n) skip[sel[b * k + j]] = 0;
      const int64_t slot = bh * (chunks + 1) + chunks;
      rest_fn(qp + bh * G * D, sp + b * s0 + h * s1, s2, cp + b * c0 + h * c1, c2,
              vbp + b * vbox.stride(0) + h * vbox.stride(1), vbox.stride(2),
              vcp + b * vcodes.stride(0) + h * vcodes.stride(1), vcodes.stride(2),
              reinterpret_cast<const bool*>(skip.data()), 0, n, G, D, scale, rmp + slot * G, rlp + slot * G,
              rop + slot * G * D, nullptr, P);
    }
  });
  auto lse = torch::empty({B, Hkv, G}, f);
  auto mean = torch::zeros({B, Hkv, G, D}, f);
  float *lp = lse.data_ptr<float>(), *mp = mean.data_ptr<float>();
  for (int64_t bh = 0; bh < B * Hkv; ++bh) {
    for (int64_t g = 0; g < G; ++g) {
      const float* m = rmp + bh * (chunks + 1) * G + g;  // [chunk + 1] every G
      const float* l = rlp + bh * (chunks + 1) * G + g;
      float mx = NEG_INF;
      for (int64_t c = 0; c <= chunks; ++c) mx = std::max(mx, m[c * G]);
      float* o = mp + (bh * G + g) * D;
      float all = 0.f, mine = 0.f;
      for (int64_t c = 0; c <= chunks; ++c) {
        if (m[c * G] == NEG_INF) continue;
        const float w = std::exp(m[c * G] - mx) * (c == chunks ? -1.f : 1.f);  // the selected pages' part subtracted
        (c == chunks ? mine : all) += l[c * G] * std::abs(w);
        const float* oc = rop + ((bh * (chunks + 1) + c) * G + g) * D;
        for (int64_t d = 0; d < D; ++d) o[d] += oc[d] * w;
      }
      const float left = all - mine;
      if (!(left > 1e-4f * all)) {  // nothing left out, or too little to tell from float error: no column
        lp[bh * G + g] = NEG_INF;
        std::fill(o, o + D, 0.f);
        continue;
      }
      for (int64_t d = 0; d < D; ++d) o[d] /= left;
      lp[bh * G + g] = mx + std::log(left);
    }
  }
  out.push_back(lse);
  out.push_back(mean);
  return out;
}



// slot_of [Pcap + 1] int64 (each page id's arena slot in this layer, < 0: in neither memory tier); pids [B, K]
// int64; valid [B, K] bool; tails [B] int64 (the open pages' slots); dram_base (the first DRAM slot)
// -> slots [B, K + 1] int64 (-1 where a valid entry missed), and the valid entries on the device tier, in
// DRAM and missed.
std::tuple<torch::Tensor, int64_t, int64_t, int64_t> locate_pages(torch::Tensor slot_of, torch::Tensor pids,
                                                                  torch::Tensor valid, torch::Tensor tails,
                                                                  int64_t dram_base) {
  TORCH_CHECK(slot_of.dim() == 1 && slot_of.scalar_type() == torch::kLong && slot_of.is_contiguous(),
              "slot_of: [Pcap + 1] int64");
  TORCH_CHECK(pids.dim() == 2 && pids.scalar_type() == torch::kLong, "pids: [B, K] int64");
  TORCH_CHECK(valid.sizes() == pids.sizes() && valid.scalar_type() == torch::kBool, "valid: [B, K] bool");
  TORCH_CHECK(tails.dim() == 1 && tails.size(0) == pids.size(0) && tails.scalar_type() == torch::kLong, "tails: [B] int64");
  auto pc = pids.contiguous();
  auto vc = valid.contiguous();
  auto tc = tails.contiguous();
  const int64_t B = pids.size(0), K = pids.size(1), cap = slot_of.size(0);
  auto slots = torch::empty({B, K + 1}, pids.options());
  const int64_t *so = slot_of.data_ptr<int64_t>(), *pp = pc.data_ptr<int64_t>(), *tp = tc.data_ptr<int64_t>();
  const bool* vp = vc.data_ptr<bool>();
  int64_t* out = slots.data_ptr<int64_t>();
  int64_t dev = 0, dram = 0, miss = 0;
  for (int64_t b = 0; b < B; ++b) {
    for (int64_t k = 0; k < K; ++k) {
      const int64_t pid = pp[b * K + k];
      TORCH_CHECK(pid >= 0 && pid < cap, "page id ", pid, " out of 0..", cap - 1);
      const int64_t slot = so[pid];
      out[b * (K + 1) + k] = slot >= 0 ? slot : -1;
      if (!vp[b * K + k]) continue;
      if (slot < 0) ++miss;
      else if (slot < dram_base) ++dev;
      else ++dram;
    }
    out[b * (K + 1) + K] = tp[b];
  }
  return {slots, dev, dram, miss};
}

void register_paged_decode(pybind11::module_& m) {
  m.def("locate_pages", &locate_pages, "each selected page's arena slot, and the reads by tier");
  m.def("paged_decode", &paged_decode, "decode attention over pages read in place, with each page's mass");
  m.def("select_pages", &select_pages, "the pages each decode query attends to, and the runners-up");
}
