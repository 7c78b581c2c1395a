// Linears over GGUF blocks kept as stored (see gguf_cpu.py, which builds it).
// Registered as torch.ops.raylm_gguf.{linear,dequantize}.
//
// Layout, per weight row of K inputs, one scale per 32-element block:
//   Q4_0, Q4_1: codes uint8 [N, K/2], 16 bytes per block, byte j holding element j (low nibble)
//               and element j + 16 (high nibble), as GGUF stores them.
//   Q8_0:       codes int8 [N, K].
//   scales float32 [N, K/32] (GGUF's fp16 d, widened exactly); Q4_1 also mins float32 [N, K/32].
// Element value: Q4_0 d * (q - 8), Q4_1 d * q + m, Q8_0 d * q, each rounded once per operation in
// float32 (built with -ffp-contract=off), so `dequantize` gives the bits gguf-py's de-quantisation
// gives. `linear` computes the same weights in registers and accumulates x * w with fused
// multiply-adds in 16 lanes per row, reduced by a fixed tree: the same numbers as x @ dequantize(W)^T
// up to summation order.
#include <ATen/core/Tensor.h>
#include <ATen/Parallel.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#ifdef __AVX512F__
#include <immintrin.h>
#endif

namespace {

constexpr int kBlock = 32;
constexpr int kLanes = 16;
constexpr int kRowTile = 8;  // activation rows sharing one pass over a weight row

enum QType : int64_t { Q4_0 = 0, Q4_1 = 1, Q8_0 = 2 };

// The 32 weights of block b of one row, exactly as dequantize writes them.
inline void block_weights(int64_t qtype, const uint8_t* codes, const float* d, const float* mins,
                          int64_t b, float* w) {
  const float scale = d[b];
  if (qtype == Q8_0) {
    const int8_t* q = reinterpret_cast<const int8_t*>(codes) + b * kBlock;
    for (int j = 0; j < kBlock; ++j) w[j] = scale * static_cast<float>(q[j]);
    return;
  }
  const uint8_t* q = codes + b * (kBlock / 2);
  if (qtype == Q4_0) {
    for (int j = 0; j < kBlock / 2; ++j) {
      w[j] = scale * static_cast<float>(static_cast<int>(q[j] & 0xF) - 8);
      w[j + 16] = scale * static_cast<float>(static_cast<int>(q[j] >> 4) - 8);
    }
    return;
  }
  const float m = mins[b];
  for (int j = 0; j < kBlock / 2; ++j) {
    w[j] = scale * static_cast<float>(q[j] & 0xF) + m;
    w[j + 16] = scale * static_cast<float>(q[j] >> 4) + m;
  }
}

inline float reduce(float* acc) {
  for (int w = kLanes / 2; w > 0; w /= 2)
    for (int j = 0; j < w; ++j) acc[j] += acc[j + w];
  return acc[0];
}

struct Weights {
  int64_t qtype, n, k, row_bytes, blocks;
  const uint8_t* codes;
  const float* d;
  const float* mins;
};

Weights weights_of(const at::Tensor& codes, const at::Tensor& d, const at::Tensor& mins,
                   int64_t qtype) {
  TORCH_CHECK(qtype == Q4_0 || qtype == Q4_1 || qtype == Q8_0, "qtype: unknown ", qtype);
  TORCH_CHECK(codes.is_contiguous() && d.is_contiguous() && d.scalar_type() == at::kFloat,
              "codes and scales must be contiguous, scales float32");
  TORCH_CHECK(codes.dim() == 2 && d.dim() == 2 && d.size(0) == codes.size(0), "shape mismatch");
  const int64_t blocks = d.size(1);
  const int64_t row_bytes = qtype == Q8_0 ? blocks * kBlock : blocks * kBlock / 2;
  TORCH_CHECK(codes.size(1) == row_bytes, "codes: expected ", row_bytes, " bytes per row");
  const float* m = nullptr;
  if (qtype == Q4_1) {
    TORCH_CHECK(mins.sizes() == d.sizes() && mins.is_contiguous() && mins.scalar_type() == at::kFloat,
                "mins must match scales");
    m = mins.data_ptr<float>();
  }
  return {qtype, codes.size(0), blocks * kBlock, row_bytes, blocks,
          static_cast<const uint8_t*>(codes.data_ptr()), d.data_ptr<float>(), m};
}

// y[r, n] for rows [r0, r0 + rows) of x and one weight row n.
template <int R>
void row_tile(const Weights& w, int64_t n, const float* x, int64_t r0, float* y) {
  float acc[R][kLanes] = {};
  float wb[kBlock];
  const uint8_t* codes = w.codes + n * w.row_bytes;
  const float* d = w.d + n * w.blocks;
  const float* m = w.mins ? w.mins + n * w.blocks : nullptr;
  for (int64_t b = 0; b < w.blocks; ++b) {
    block_weights(w.qtype, codes, d, m, b, wb);
    for (int r = 0; r < R; ++r) {
      const float* xb = x + (r0 + r) * w.k + b * kBlock;
      for (int j = 0; j < kLanes; ++j) acc[r][j] = std::fma(wb[j], xb[j], acc[r][j]);
      for (int j = 0; j < kLanes; ++j) acc[r][j] = std::fma(wb[j + 16], xb[j + 16], acc[r][j]);
    }
  }
  for (int r = 0; r < R; ++r) y[(r0 + r) * w.n + n] = reduce(acc[r]);
}

#ifdef __AVX512F__
// The 32 weights of block b as two vectors (elements 0-15 and 16-31), the same values
// block_weights writes: one rounding per multiply and per add.
inline void block_vectors(const Weights& w, const uint8_t* codes, const float* d, const float* m,
                          int64_t b, __m512& lo, __m512& hi) {
  const __m512 scale = _mm512_set1_ps(d[b]);
  if (w.qtype == Q8_0) {
    const __m256i q = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(codes + b * kBlock));
    lo = _mm512_mul_ps(scale, _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm256_castsi256_si128(q))));
    hi = _mm512_mul_ps(scale,
                       _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm256_extracti128_si256(q, 1))));
    return;
  }
  const __m512i q = _mm512_cvtepu8_epi32(
      _mm_loadu_si128(reinterpret_cast<const __m128i*>(codes + b * (kBlock / 2))));
  __m512i ql = _mm512_and_si512(q, _mm512_set1_epi32(0xF));
  __m512i qh = _mm512_srli_epi32(q, 4);
  if (w.qtype == Q4_0) {
    ql = _mm512_sub_epi32(ql, _mm512_set1_epi32(8));
    qh = _mm512_sub_epi32(qh, _mm512_set1_epi32(8));
  }
  lo = _mm512_mul_ps(scale, _mm512_cvtepi32_ps(ql));
  hi = _mm512_mul_ps(scale, _mm512_cvtepi32_ps(qh));
  if (w.qtype == Q4_1) {
    const __m512 mv = _mm512_set1_ps(m[b]);
    lo = _mm512_add_ps(lo, mv);
    hi = _mm512_add_ps(hi, mv);
  }
}

template <int R>
void row_tile_avx512(const Weights& w, int64_t n, const float* x, int64_t r0, float* y) {
  __m512 acc[R];
  for (int r = 0; r < R; ++r) acc[r] = _mm512_setzero_ps();
  const uint8_t* codes = w.codes + n * w.row_bytes;
  const float* d = w.d + n * w.blocks;
  const float* m = w.mins ? w.mins + n * w.blocks : nullptr;
  for (int64_t b = 0; b < w.blocks; ++b) {
    __m512 lo, hi;
    block_vectors(w, codes, d, m, b, lo, hi);
    for (int r = 0; r < R; ++r) {
      const float* xb = x + (r0 + r) * w.k + b * kBlock;
      acc[r] = _mm512_fmadd_ps(lo, _mm512_loadu_ps(xb), acc[r]);
      acc[r] = _mm512_fmadd_ps(hi, _mm512_loadu_ps(xb + 16), acc[r]);
    }
  }
  for (int r = 0; r < R; ++r) y[(r0 + r) * w.n + n] = _mm512_reduce_add_ps(acc[r]);
}
#endif

template <int R>
void rows_upto(const Weights& w, int64_t n, const float* x, int64_t r0, int64_t rows, float* y) {
  if constexpr (R > 1) {
    if (rows < R) return rows_upto<R - 1>(w, n, x, r0, rows, y);
  }
#ifdef __AVX512F__
  row_tile_avx512<R>(w, n, x, r0, y);
#else
  row_tile<R>(w, n, x, r0, y);
#endif
}

at::Tensor linear(const at::Tensor& x, const at::Tensor& codes, const at::Tensor& d,
                  const at::Tensor& mins, int64_t qtype) {
  const Weights w = weights_of(codes, d, mins, qtype);
  TORCH_CHECK(x.dim() == 2 && x.size(1) == w.k && x.is_contiguous() && x.scalar_type() == at::kFloat,
              "x must be contiguous float32 [M, ", w.k, "]");
  const int64_t rows = x.size(0);
  at::Tensor y = at::empty({rows, w.n}, x.options());
  const float* xp = x.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  at::parallel_for(0, w.n, 16, [&](int64_t begin, int64_t end) {
    for (int64_t n = begin; n < end; ++n)
      for (int64_t r0 = 0; r0 < rows; r0 += kRowTile)
        rows_upto<kRowTile>(w, n, xp, r0, std::min<int64_t>(kRowTile, rows - r0), yp);
  });
  return y;
}

at::Tensor dequantize(const at::Tensor& codes, const at::Tensor& d, const at::Tensor& mins,
                      int64_t qtype) {
  const Weights w = weights_of(codes, d, mins, qtype);
  at::Tensor out = at::empty({w.n, w.k}, d.options());
  float* o = out.data_ptr<float>();
  at::parallel_for(0, w.n, 16, [&](int64_t begin, int64_t end) {
    for (int64_t n = begin; n < end; ++n) {
      const uint8_t* c = w.codes + n * w.row_bytes;
      const float* dn = w.d + n * w.blocks;
      const float* mn = w.mins ? w.mins + n * w.blocks : nullptr;
      for (int64_t b = 0; b < w.blocks; ++b) block_weights(w.qtype, c, dn, mn, b, o + n * w.k + b * kBlock);
    }
  });
  return out;
}

}  // namespace

TORCH_LIBRARY(raylm_gguf, m) {
  m.def("linear", &linear);
  m.def("dequantize", &dequantize);
}
