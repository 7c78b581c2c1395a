// Linears over GGUF blocks kept as stored (see gguf_cpu.py, which builds it).
// Registered as torch.ops.raylm_gguf.{linear,dequantize}. `linear` here keeps the activations in
// float32; it is the fallback for builds without AVX512-VNNI, where GGUFWeight.matmul uses the
// int8 kernel of gguf_int8.cpp instead. `dequantize` serves every build.
//
// Layout, per weight row of K inputs:
//   Q4_0, Q4_1: codes uint8 [N, K/2], 16 bytes per 32-element block, byte j holding element j
//               (low nibble) and element j + 16 (high nibble), as GGUF stores them.
//   Q8_0:       codes int8 [N, K].
//               scales float32 [N, K/32] (GGUF's fp16 d, widened exactly); Q4_1 also mins.
//   Q4_K, Q5_K, Q6_K: codes uint8 [N, K/256 * bytes], the file's 256-element super-blocks
//               unchanged (fp16 scales, 6-bit or 8-bit sub-block scales and the quants); scales
//               and mins are unused (empty). See `kbits` (gguf_blocks.h) for where each
//               element lives.
// Element value: Q4_0 d * (q - 8), Q4_1 d * q + m, Q8_0 d * q; Q4_K and Q5_K (d * sc) * q -
// dmin * mn; Q6_K (d * sc) * (q - 32). Each operation is rounded once in float32 (built with
// -ffp-contract=off), in gguf-py's order, so `dequantize` gives the bits gguf-py's
// de-quantisation gives. `linear` computes the same weights in registers, 32 at a time (a K-quant
// super-block's scales decoded once), and
// accumulates x * w with fused multiply-adds in 16 lanes per row, reduced by a fixed tree: the
// same numbers as x @ dequantize(W)^T up to summation order.
#include "gguf_blocks.h"

#include <ATen/core/Tensor.h>
#include <ATen/Parallel.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#if defined(__AVX512F__) || defined(__F16C__)
#include <immintrin.h>
#endif

namespace {

using namespace raylm_gguf;

constexpr int kLanes = 16;
constexpr int kRowTile = 8;  // activation rows sharing one pass over a weight row

// The 32 weights of chunk c of a K-quant super-block, as dequantize writes them.
inline void kchunk_weights(int64_t qtype, const uint8_t* sb, const KScales& ks, int c, float* w) {
  const KBits k = kbits(qtype, sb, c);
  for (int j = 0; j < kBlock; ++j) {
    const float v = (j < 16 ? ks.lo[c] : ks.hi[c]) * static_cast<float>(kquant(qtype, k, j));
    w[j] = qtype == Q6_K ? v : v - ks.min[c];
  }
}

// The 32 weights of block c (elements 32 c .. 32 c + 31) of one row of a legacy type, exactly as
// dequantize writes them.
inline void chunk_weights(int64_t qtype, const uint8_t* codes, const float* d, const float* mins,
                          int64_t c, float* w) {
  const float scale = d[c];
  if (qtype == Q8_0) {
    const int8_t* q = reinterpret_cast<const int8_t*>(codes) + c * kBlock;
    for (int j = 0; j < kBlock; ++j) w[j] = scale * static_cast<float>(q[j]);
    return;
  }
  const uint8_t* q = codes + c * (kBlock / 2);
  if (qtype == Q4_0) {
    for (int j = 0; j < kBlock / 2; ++j) {
      w[j] = scale * static_cast<float>(static_cast<int>(q[j] & 0xF) - 8);
      w[j + 16] = scale * static_cast<float>(static_cast<int>(q[j] >> 4) - 8);
    }
    return;
  }
  const float m = mins[c];
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

// y[r, n] for rows [r0, r0 + rows) of x and one weight row n.
template <int R>
void row_tile(const Weights& w, int64_t n, const float* x, int64_t r0, float* y) {
  float acc[R][kLanes] = {};
  float wb[kBlock];
  const uint8_t* codes = w.codes + n * w.row_bytes;
  const float* d = w.d ? w.d + n * w.chunks : nullptr;
  const float* m = w.mins ? w.mins + n * w.chunks : nullptr;
  auto add = [&](int64_t b) {
    for (int r = 0; r < R; ++r) {
      const float* xb = x + (r0 + r) * w.k + b * kBlock;
      for (int j = 0; j < kLanes; ++j) acc[r][j] = std::fma(wb[j], xb[j], acc[r][j]);
      for (int j = 0; j < kLanes; ++j) acc[r][j] = std::fma(wb[j + 16], xb[j + 16], acc[r][j]);
    }
  };
  if (is_k(w.qtype)) {
    KScales ks;
    for (int64_t sbi = 0; sbi < w.chunks / 8; ++sbi) {
      const uint8_t* sb = codes + sbi * block_bytes(w.qtype);
      kscales(w.qtype, sb, ks);
      for (int c = 0; c < 8; ++c) {
        kchunk_weights(w.qtype, sb, ks, c, wb);
        add(sbi * 8 + c);
      }
    }
  } else {
    for (int64_t b = 0; b < w.chunks; ++b) {
      chunk_weights(w.qtype, codes, d, m, b, wb);
      add(b);
    }
  }
  for (int r = 0; r < R; ++r) y[(r0 + r) * w.n + n] = reduce(acc[r]);
}

#ifdef __AVX512F__
inline __m512i bytes16(const uint8_t* p) {
  return _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
}

// 16 quants (elements j0 .. j0 + 15 of a K-quant chunk) as integers.
inline __m512i kquants16(int64_t qtype, const KBits& k, int j0) {
  const __m512i low = _mm512_and_si512(
      _mm512_srli_epi32(bytes16(k.low + j0), k.low_shift), _mm512_set1_epi32(0xF));
  if (qtype == Q4_K) return low;
  const __m512i mask = _mm512_set1_epi32(qtype == Q5_K ? 1 : 3);
  const __m512i high = _mm512_and_si512(_mm512_srli_epi32(bytes16(k.high + j0), k.high_shift), mask);
  const __m512i q = _mm512_or_si512(low, _mm512_slli_epi32(high, 4));
  return qtype == Q5_K ? q : _mm512_sub_epi32(q, _mm512_set1_epi32(32));
}

// Chunk c of a K-quant super-block as two vectors (elements 0-15 and 16-31), the same values
// kchunk_weights writes: one rounding per multiply and per subtraction.
inline void kchunk_vectors(int64_t qtype, const uint8_t* sb, const KScales& ks, int c, __m512& lo,
                           __m512& hi) {
  const KBits k = kbits(qtype, sb, c);
  lo = _mm512_mul_ps(_mm512_set1_ps(ks.lo[c]), _mm512_cvtepi32_ps(kquants16(qtype, k, 0)));
  hi = _mm512_mul_ps(_mm512_set1_ps(ks.hi[c]), _mm512_cvtepi32_ps(kquants16(qtype, k, 16)));
  if (qtype != Q6_K) {
    const __m512 mv = _mm512_set1_ps(ks.min[c]);
    lo = _mm512_sub_ps(lo, mv);
    hi = _mm512_sub_ps(hi, mv);
  }
}

// Block c of a legacy type as two vectors (elements 0-15 and 16-31), the same values
// chunk_weights writes: one rounding per multiply and per add.
inline void chunk_vectors(const Weights& w, const uint8_t* codes, const float* d, const float* m,
                          int64_t c, __m512& lo, __m512& hi) {
  const __m512 scale = _mm512_set1_ps(d[c]);
  if (w.qtype == Q8_0) {
    const __m256i q = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(codes + c * kBlock));
    lo = _mm512_mul_ps(scale, _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm256_castsi256_si128(q))));
    hi = _mm512_mul_ps(scale,
                       _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm256_extracti128_si256(q, 1))));
    return;
  }
  const __m512i q = bytes16(codes + c * (kBlock / 2));
  __m512i ql = _mm512_and_si512(q, _mm512_set1_epi32(0xF));
  __m512i qh = _mm512_srli_epi32(q, 4);
  if (w.qtype == Q4_0) {
    ql = _mm512_sub_epi32(ql, _mm512_set1_epi32(8));
    qh = _mm512_sub_epi32(qh, _mm512_set1_epi32(8));
  }
  lo = _mm512_mul_ps(scale, _mm512_cvtepi32_ps(ql));
  hi = _mm512_mul_ps(scale, _mm512_cvtepi32_ps(qh));
  if (w.qtype == Q4_1) {
    const __m512 mv = _mm512_set1_ps(m[c]);
    lo = _mm512_add_ps(lo, mv);
    hi = _mm512_add_ps(hi, mv);
  }
}

template <int R>
void row_tile_avx512(const Weights& w, int64_t n, const float* x, int64_t r0, float* y) {
  __m512 acc[R];
  for (int r = 0; r < R; ++r) acc[r] = _mm512_setzero_ps();
  const uint8_t* codes = w.codes + n * w.row_bytes;
  const float* d = w.d ? w.d + n * w.chunks : nullptr;
  const float* m = w.mins ? w.mins + n * w.chunks : nullptr;
  __m512 lo, hi;
  auto add = [&](int64_t b) {
    for (int r = 0; r < R; ++r) {
      const float* xb = x + (r0 + r) * w.k + b * kBlock;
      acc[r] = _mm512_fmadd_ps(lo, _mm512_loadu_ps(xb), acc[r]);
      acc[r] = _mm512_fmadd_ps(hi, _mm512_loadu_ps(xb + 16), acc[r]);
    }
  };
  if (is_k(w.qtype)) {  // each super-block's scales decoded once, then its eight chunks
    KScales ks;
    for (int64_t sbi = 0; sbi < w.chunks / 8; ++sbi) {
      const uint8_t* sb = codes + sbi * block_bytes(w.qtype);
      kscales(w.qtype, sb, ks);
      for (int c = 0; c < 8; ++c) {
        kchunk_vectors(w.qtype, sb, ks, c, lo, hi);
        add(sbi * 8 + c);
      }
    }
  } else {
    for (int64_t b = 0; b < w.chunks; ++b) {
      chunk_vectors(w, codes, d, m, b, lo, hi);
      add(b);
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
  at::Tensor out = at::empty({w.n, w.k}, codes.options().dtype(at::kFloat));
  float* o = out.data_ptr<float>();
  at::parallel_for(0, w.n, 16, [&](int64_t begin, int64_t end) {
    for (int64_t n = begin; n < end; ++n) {
      const uint8_t* c = w.codes + n * w.row_bytes;
      const float* dn = w.d ? w.d + n * w.chunks : nullptr;
      const float* mn = w.mins ? w.mins + n * w.chunks : nullptr;
      float* on = o + n * w.k;
      if (is_k(w.qtype)) {
        KScales ks;
        for (int64_t sbi = 0; sbi < w.chunks / 8; ++sbi) {
          const uint8_t* sb = c + sbi * block_bytes(w.qtype);
          kscales(w.qtype, sb, ks);
          for (int j = 0; j < 8; ++j) kchunk_weights(w.qtype, sb, ks, j, on + (sbi * 8 + j) * kBlock);
        }
      } else {
        for (int64_t b = 0; b < w.chunks; ++b) chunk_weights(w.qtype, c, dn, mn, b, on + b * kBlock);
      }
    }
  });
  return out;
}

}  // namespace

TORCH_LIBRARY(raylm_gguf, m) {
  m.def("linear", &linear);
  m.def("dequantize", &dequantize);
}
