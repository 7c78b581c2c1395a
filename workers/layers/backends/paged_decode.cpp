// Paged decode attention on CPU: reads K/V through the block table (see cpu_paged.py, which builds it).
// Registered as torch.ops.raylm.paged_decode.
#include "cpu_math.h"

#include <ATen/core/Tensor.h>
#include <torch/library.h>
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>
#if defined(__AVX512F__)
#include <immintrin.h>
#endif

namespace {

constexpr int kLanes = 16;  // independent partial sums: vectorisable without reassociating

inline float widen(float x) { return x; }
inline float widen(c10::BFloat16 x) {
  uint32_t bits = static_cast<uint32_t>(x.x) << 16;
  float f;
  std::memcpy(&f, &bits, sizeof f);
  return f;
}

template <typename T, int D>
inline float dot(const float* q, const T* k) {
  float acc[kLanes] = {0.f};
  for (int i = 0; i < D; i += kLanes)
    for (int j = 0; j < kLanes; ++j) acc[j] += q[i + j] * widen(k[i + j]);
  for (int w = kLanes / 2; w > 0; w /= 2)  // a fixed tree: shuffles and vector adds, not 15 scalar adds
    for (int j = 0; j < w; ++j) acc[j] += acc[j + w];
  return acc[0];
}

// exp(x) for x <= 0 (scores minus their maximum), within about 2 ulp of std::exp.
// exp(-87) is near FLT_MIN; lower scores weigh nothing at float precision.
inline float exp_nonpositive(float x) { return raylm_cpu::exp_clamped(std::max(x, -87.0f)); }

inline float sum(const float* x, int64_t n) {
  float acc[kLanes] = {0.f};
  int64_t t = 0;
  for (; t + kLanes <= n; t += kLanes)
    for (int j = 0; j < kLanes; ++j) acc[j] += x[t + j];
  for (; t < n; ++t) acc[0] += x[t];
  float s = 0.f;
  for (int j = 0; j < kLanes; ++j) s += acc[j];
  return s;
}

// scores[t] = dot(q, k + t * stride) for t < count (count <= 16).
template <typename T, int D>
inline void dots(const float* q, const T* k, int64_t stride, int64_t count, float* scores) {
  for (int64_t t = 0; t < count; ++t) scores[t] = dot<T, D>(q, k + t * stride);
}

#if defined(__AVX512F__)
// The same 16 sums as dot() for 16 keys at once, bit for bit: each key's 16 lanes accumulate over
// D in one vector, then the lanes fold as dot() folds them (j + 8, j + 4, j + 2, j + 1), four
// keys' folds per shuffle and add. dot() spends eight dependent shuffles and adds on each key;
// this spends about three per key, and the fold was half a decode row's attention.
template <int D>
inline void dots16(const float* q, const float* k, int64_t stride, int64_t count, float* scores) {
  __m512 v[16];
  for (int t = 0; t < 16; ++t) {
    __m512 acc = _mm512_setzero_ps();
    if (t < count)
      for (int i = 0; i < D; i += kLanes)
        acc = _mm512_fmadd_ps(_mm512_loadu_ps(q + i), _mm512_loadu_ps(k + t * stride + i), acc);
    v[t] = acc;
  }
  __m512 w[8], x[4], y[2];
  for (int i = 0; i < 8; ++i)  // lanes j + 8: keys 2i, 2i + 1 in halves
    w[i] = _mm512_add_ps(_mm512_shuffle_f32x4(v[2 * i], v[2 * i + 1], 0x44),
                         _mm512_shuffle_f32x4(v[2 * i], v[2 * i + 1], 0xEE));
  for (int i = 0; i < 4; ++i)  // lanes j + 4: keys 4i .. 4i + 3 in quarters
    x[i] = _mm512_add_ps(_mm512_shuffle_f32x4(w[2 * i], w[2 * i + 1], 0x88),
                         _mm512_shuffle_f32x4(w[2 * i], w[2 * i + 1], 0xDD));
  for (int i = 0; i < 2; ++i) {  // lanes j + 2: quarter L holds keys 8i + L, 8i + 4 + L
    const __m512d a = _mm512_castps_pd(x[2 * i]), b = _mm512_castps_pd(x[2 * i + 1]);
    y[i] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(a, b)),
                         _mm512_castpd_ps(_mm512_unpackhi_pd(a, b)));
  }
  // lanes j + 1: element 4 L + m is key 4 m + L; the permutation puts key t at element t.
  const __m512 z = _mm512_add_ps(_mm512_shuffle_ps(y[0], y[1], 0x88), _mm512_shuffle_ps(y[0], y[1], 0xDD));
  const __m512i order = _mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15);
  _mm512_mask_storeu_ps(scores, static_cast<__mmask16>((1u << count) - 1), _mm512_permutexvar_ps(order, z));
}
#endif

template <typename T, int D>
inline void score_keys(const float* q, const T* k, int64_t stride, int64_t count, float* scores) {
#if defined(__AVX512F__)
  if constexpr (std::is_same_v<T, float>) {
    for (int64_t t = 0; t < count; t += 16)
      dots16<D>(q, k + t * stride, stride, std::min<int64_t>(16, count - t), scores + t);
    return;
  }
#endif
  dots<T, D>(q, k, stride, count, scores);
}

// The weighted sums of values of N query rows that share a KV head, over tokens [first, seq_len):
// out_r = sum_t p_r[t] * v_t, added in token order, one fused multiply-add per element as axpy
// compiles to (contraction is on here), so each row's sum is the one axpy gives. The sums stay in
// registers over the whole context (accumulating them in memory, token by token, spent a load
// and a store per 16 elements on each product), each value row is loaded once for the N rows,
// and their N * C independent chains keep the multiply-adds from waiting on each other's
// latency. SmolLM2's shape, 175 tokens, 30 calls, 1 thread, interleaved: 5 verify rows 2.10 ->
// 1.78 ms in registers -> 1.59 ms with a KV head's rows together (1 row 0.53 -> 0.41 -> 0.38).
// Columns go up to 128 at a time (C <= 8: head sizes up to 128 in one pass, as before; a latent
// row of 256 in two, not 64 accumulators that spill); acc has a row stride of acc_stride.
#if defined(__AVX512F__)
template <int N, int C>
inline void weighted_columns(const float* p, int64_t p_stride, const float* vc, const int32_t* table,
                             int64_t first, int64_t seq_len, int64_t bs, int64_t token, float* acc,
                             int64_t acc_stride) {
  __m512 a[N][C];
  for (int r = 0; r < N; ++r)
    for (int c = 0; c < C; ++c) a[r][c] = _mm512_setzero_ps();
  for (int64_t t0 = first - first % bs; t0 < seq_len; t0 += bs) {
    const float* vb = vc + static_cast<int64_t>(table[t0 / bs]) * bs * token;
    for (int64_t t = std::max(t0, first); t < std::min(seq_len, t0 + bs); ++t) {
      const float* v = vb + (t - t0) * token;
      for (int c = 0; c < C; ++c) {
        const __m512 x = _mm512_loadu_ps(v + c * kLanes);
        for (int r = 0; r < N; ++r)
          a[r][c] = _mm512_fmadd_ps(_mm512_set1_ps(p[r * p_stride + t - first]), x, a[r][c]);
      }
    }
  }
  for (int r = 0; r < N; ++r)
    for (int c = 0; c < C; ++c) _mm512_storeu_ps(acc + r * acc_stride + c * kLanes, a[r][c]);
}
#endif

// The first dv columns of each row's weighted values (a latent head's value is the first
// kv_lora_rank columns of its cached row: the rotary columns past them are never summed).
template <typename T, int N>
inline void weighted_values(const float* p, int64_t p_stride, const T* vc, const int32_t* table,
                            int64_t first, int64_t seq_len, int64_t bs, int64_t token, int64_t dv,
                            float* acc, int64_t acc_stride) {
#if defined(__AVX512F__)
  if constexpr (std::is_same_v<T, float>) {
    if (dv % kLanes == 0) {
      for (int64_t c0 = 0, step = 0; c0 < dv / kLanes; c0 += step) {
        const int64_t left = dv / kLanes - c0;
        step = left >= 8 ? 8 : left >= 6 ? 6 : left >= 4 ? 4 : left >= 2 ? 2 : 1;
        const float* v = vc + c0 * kLanes;
        float* a = acc + c0 * kLanes;
        switch (step) {
          case 8: weighted_columns<N, 8>(p, p_stride, v, table, first, seq_len, bs, token, a, acc_stride); break;
          case 6: weighted_columns<N, 6>(p, p_stride, v, table, first, seq_len, bs, token, a, acc_stride); break;
          case 4: weighted_columns<N, 4>(p, p_stride, v, table, first, seq_len, bs, token, a, acc_stride); break;
          case 2: weighted_columns<N, 2>(p, p_stride, v, table, first, seq_len, bs, token, a, acc_stride); break;
          default: weighted_columns<N, 1>(p, p_stride, v, table, first, seq_len, bs, token, a, acc_stride); break;
        }
      }
      return;
    }
  }
#endif
  for (int r = 0; r < N; ++r) {
    float* out = acc + r * acc_stride;
    std::fill(out, out + dv, 0.f);
    for (int64_t t0 = first - first % bs; t0 < seq_len; t0 += bs) {
      const T* vb = vc + static_cast<int64_t>(table[t0 / bs]) * bs * token;
      for (int64_t t = std::max(t0, first); t < std::min(seq_len, t0 + bs); ++t) {
        const T* v = vb + (t - t0) * token;
        const float pt = p[r * p_stride + t - first];
        for (int64_t i = 0; i < dv; ++i) out[i] += pt * widen(v[i]);
      }
    }
  }
}

struct Shape {
  int64_t hk, group, block_size, table_stride;
  float scale;
  int64_t window;  // attend to the last `window` tokens only; 0: all of them
  float softcap;   // scores become softcap * tanh(score / softcap); 0: no cap (Gemma 2)
  const float* sinks;  // [Hq] one extra logit per query head in the denominator; null: none
  int64_t value_width;  // columns of each value row summed (<= D; the rest of out is zero)
};

// One request's KV heads [h0, h0 + nh): their nh * group query rows (row j at q + j * q_head_stride,
// KV head h0 + j / group) attend over cached tokens [first, seq_len) (first > 0 under a sliding
// window). Each token's K (then V) row is read once for all of those heads, so a block is one
// contiguous read when nh covers every KV head. sinks, when given, points at row 0's sink logit.
template <typename T, int D>
void attend(const T* q, int64_t q_head_stride, const T* kc, const T* vc, const int32_t* table, int64_t first,
            int64_t seq_len, int64_t h0, int64_t nh, const Shape& s, const float* sinks, float* work,
            T* out) {
  const int64_t G = s.group, R = nh * G, bs = s.block_size, token = s.hk * D, n = seq_len - first;
  float* qf = work;                 // [R, D] scaled queries
  float* acc = qf + R * D;          // [R, D] weighted values
  float* scores = acc + R * D;      // [R, n]
  for (int64_t j = 0; j < R; ++j)
    for (int64_t i = 0; i < D; ++i) qf[j * D + i] = widen(q[j * q_head_stride + i]) * s.scale;
  for (int64_t t0 = first - first % bs; t0 < seq_len; t0 += bs) {
    const T* kb = kc + static_cast<int64_t>(table[t0 / bs]) * bs * token + h0 * D;
    const int64_t lo = std::max(t0, first), count = std::min(seq_len, t0 + bs) - lo;
    for (int64_t j = 0; j < R; ++j)
      score_keys<T, D>(qf + j * D, kb + (lo - t0) * token + (j / G) * D, token, count, scores + j * n + lo - first);
  }
  if (s.softcap > 0.f)
    for (int64_t i = 0; i < R * n; ++i) scores[i] = s.softcap * std::tanh(scores[i] / s.softcap);
  for (int64_t j = 0; j < R; ++j) {
    float* row = scores + j * n;
    // A sink is one more score in the softmax whose value vector is zero: it adds to the
    // denominator only.
    const float m = std::max(*std::max_element(row, row + n), sinks ? sinks[j] : -INFINITY);
    for (int64_t t = 0; t < n; ++t) row[t] = exp_nonpositive(row[t] - m);
    const float inv = 1.f / (sum(row, n) + (sinks ? exp_nonpositive(sinks[j] - m) : 0.f));
    for (int64_t t = 0; t < n; ++t) row[t] *= inv;
  }
  for (int64_t j = 0; j < R;) {  // up to 4 rows of one KV head at a time
    const int64_t rows = std::min<int64_t>({4, R - j, G - j % G});
    const T* v = vc + (h0 + j / G) * D;
    float* a = acc + j * D;
    const float* p = scores + j * n;
    const int64_t dv = s.value_width;
    switch (rows) {
      case 4: weighted_values<T, 4>(p, n, v, table, first, seq_len, bs, token, dv, a, D); break;
      case 3: weighted_values<T, 3>(p, n, v, table, first, seq_len, bs, token, dv, a, D); break;
      case 2: weighted_values<T, 2>(p, n, v, table, first, seq_len, bs, token, dv, a, D); break;
      default: weighted_values<T, 1>(p, n, v, table, first, seq_len, bs, token, dv, a, D); break;
    }
    j += rows;
  }
  for (int64_t j = 0; j < R; ++j)
    for (int64_t i = 0; i < D; ++i) out[j * D + i] = i < s.value_width ? static_cast<T>(acc[j * D + i]) : static_cast<T>(0.f);
}

template <typename T, int D>
void run(at::Tensor& out, const at::Tensor& q, const at::Tensor& kc, const at::Tensor& vc,
         const at::Tensor& tables, const at::Tensor& seq_lens, const Shape& s) {
  const int64_t n = q.size(0), hq = q.size(1);
  const T* qp = q.data_ptr<T>();
  const T* kp = kc.data_ptr<T>();
  const T* vp = vc.data_ptr<T>();
  T* op = out.data_ptr<T>();
  const int32_t* tp = tables.data_ptr<int32_t>();
  const int32_t* lp = seq_lens.data_ptr<int32_t>();
  const int64_t longest = *std::max_element(lp, lp + n);
  // A task per request (all KV heads, contiguous reads) when that keeps every thread busy; a task
  // per (request, KV head) for small batches. Each head's arithmetic is the same either way.
  const int64_t nh = n >= 2 * at::get_num_threads() ? s.hk : 1, parts = s.hk / nh;
  at::parallel_for(0, n * parts, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> work(nh * s.group * (2 * D + longest));
    for (int64_t item = begin; item < end; ++item) {
      const int64_t r = item / parts, h0 = (item % parts) * nh, head = h0 * s.group;
      const int64_t first = s.window > 0 ? std::max<int64_t>(0, lp[r] - s.window) : 0;
      attend<T, D>(qp + r * q.stride(0) + head * q.stride(1), q.stride(1), kp, vp, tp + r * s.table_stride, first,
                   lp[r], h0, nh, s, s.sinks ? s.sinks + head : nullptr, work.data(), op + (r * hq + head) * D);
    }
  });
}

template <typename T>
void dispatch_head(at::Tensor& out, const at::Tensor& q, const at::Tensor& kc, const at::Tensor& vc,
                   const at::Tensor& tables, const at::Tensor& seq_lens, const Shape& s) {
  switch (q.size(2)) {
    case 32: return run<T, 32>(out, q, kc, vc, tables, seq_lens, s);
    case 64: return run<T, 64>(out, q, kc, vc, tables, seq_lens, s);
    case 96: return run<T, 96>(out, q, kc, vc, tables, seq_lens, s);
    case 128: return run<T, 128>(out, q, kc, vc, tables, seq_lens, s);
    case 256: return run<T, 256>(out, q, kc, vc, tables, seq_lens, s);
  }
  TORCH_CHECK_VALUE(false, "paged_decode: head size ", q.size(2), " is not compiled in");
}

// Block ids are read as raw offsets: check them once here rather than per load.
void check_tables(const at::Tensor& tables, const at::Tensor& seq_lens, int64_t num_blocks, int64_t bs) {
  const int32_t* tp = tables.data_ptr<int32_t>();
  const int32_t* lp = seq_lens.data_ptr<int32_t>();
  for (int64_t r = 0; r < seq_lens.size(0); ++r) {
    TORCH_CHECK_VALUE(lp[r] >= 1 && (lp[r] + bs - 1) / bs <= tables.size(1),
                "seq_lens: row ", r, " has ", lp[r], " tokens for ", tables.size(1), " table entries");
    for (int64_t b = 0; b < (lp[r] + bs - 1) / bs; ++b) {
      const int32_t id = tp[r * tables.stride(0) + b];
      TORCH_CHECK_VALUE(id >= 0 && id < num_blocks, "block_tables: row ", r, " names block ", id);
    }
  }
}

}  // namespace

// out, q: [n, Hq, D] (q may be a strided view, e.g. of a fused QKV projection); caches: [num_blocks, block_size, Hk, D]; tables: [n, >= blocks] int32;
// v_cache may instead be a view of its first Dv <= D columns (with k_cache's strides: latent attention's
// cached rows, whose values are the latent, the rotary columns after it are keys only); out's columns
// past Dv are then zero;
// seq_lens: [n] int32 (context length including this step's token); window: attend to the last
// `window` tokens only (a sliding window), 0 for the whole context; softcap: tanh cap on the scores,
// 0 for none; sinks: float32 [Hq] per-head sink logits, or an empty tensor for none.
void paged_decode(at::Tensor out, at::Tensor q, at::Tensor k_cache, at::Tensor v_cache,
                  at::Tensor block_tables, at::Tensor seq_lens, double scale, int64_t window,
                  double softcap, at::Tensor sinks) {
  TORCH_CHECK_VALUE(q.dim() == 3 && q.stride(2) == 1 && out.is_contiguous() && out.sizes() == q.sizes(),
              "q/out: [n, Hq, D] of one shape, out contiguous, q contiguous in its last dimension");
  TORCH_CHECK_VALUE(k_cache.dim() == 4 && k_cache.is_contiguous() && v_cache.dim() == 4
              && v_cache.strides() == k_cache.strides() && k_cache.size(3) == q.size(2)
              && v_cache.sizes().slice(0, 3) == k_cache.sizes().slice(0, 3)
              && v_cache.size(3) >= 1 && v_cache.size(3) <= k_cache.size(3),
              "k_cache/v_cache: contiguous [blocks, block_size, Hk, D], v_cache may be a view of "
              "its first Dv <= D columns");
  TORCH_CHECK_VALUE(q.scalar_type() == k_cache.scalar_type() && out.scalar_type() == q.scalar_type()
              && v_cache.scalar_type() == q.scalar_type(), "q/out/caches: one dtype");
  TORCH_CHECK_VALUE(block_tables.scalar_type() == at::kInt && seq_lens.scalar_type() == at::kInt
              && block_tables.dim() == 2 && block_tables.stride(1) == 1 && seq_lens.is_contiguous()
              && block_tables.size(0) == q.size(0) && seq_lens.size(0) == q.size(0),
              "block_tables/seq_lens: int32 [n, blocks] (rows contiguous) and [n]");
  const int64_t hk = k_cache.size(2);
  TORCH_CHECK_VALUE(q.size(1) % hk == 0, "q: ", q.size(1), " heads are not a multiple of ", hk, " KV heads");
  TORCH_CHECK_VALUE(window >= 0, "window: must be 0 (none) or positive, got ", window);
  TORCH_CHECK_VALUE(softcap >= 0 && std::isfinite(softcap), "softcap: must be 0 (none) or positive, got ", softcap);
  TORCH_CHECK_VALUE(sinks.numel() == 0 || (sinks.scalar_type() == at::kFloat && sinks.is_contiguous()
              && sinks.dim() == 1 && sinks.size(0) == q.size(1)),
              "sinks: empty, or float32 [Hq] contiguous");
  if (q.size(0) == 0) return;
  check_tables(block_tables, seq_lens, k_cache.size(0), k_cache.size(1));
  const Shape s{hk, q.size(1) / hk, k_cache.size(1), block_tables.stride(0), static_cast<float>(scale), window,
                static_cast<float>(softcap), sinks.numel() ? sinks.data_ptr<float>() : nullptr, v_cache.size(3)};
  if (q.scalar_type() == at::kFloat) return dispatch_head<float>(out, q, k_cache, v_cache, block_tables, seq_lens, s);
  TORCH_CHECK_VALUE(q.scalar_type() == at::kBFloat16, "q: float32 or bfloat16, got ", q.scalar_type());
  dispatch_head<c10::BFloat16>(out, q, k_cache, v_cache, block_tables, seq_lens, s);
}

TORCH_LIBRARY(raylm, m) { m.def("paged_decode", &paged_decode); }
