// Small-M float32 linear on CPU: y[M, N] = x[M, K] W[N, K]^T (+ b), for the few rows a decode step
// sends through one expert (workers/layers/backends/cpu_gemm.py calls it; it is built into the
// fused ops' library, torch.ops.raylm_fused.small_linear).
//
// Why: at ~8 rows oneDNN's packed GEMM read each expert's weights at about half of what one thread
// streams (bench/results/2026-11-29-new-family-steps.md). Here every weight row is read from memory
// once for all M rows: blocks of kNR weight rows, each block's rows dotted with every x row (x stays
// in L1/L2), kMR x rows at a time in registers, a block kAhead blocks on prefetched into L2 while
// this one is summed (prefetching into L1, or leaving it to the hardware prefetcher, one thread read
// ~13 GB/s of four interleaved short row streams; into L2, ~20).
// Dot-product form on the weight as stored (no packed copy): each output is a vector of partial
// sums reduced once at the end, four outputs per shuffle tree.
//
// Each output's summation order depends on K and on which block its weight row falls in (N), never
// on M or on the other rows, so a row's result does not change with the rows beside it.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include <immintrin.h>

#include <algorithm>
#include <cstdint>
#include <optional>
#include <utility>

namespace {

constexpr int kNR = 4;     // weight rows per block: one four-lane store per x row
constexpr int kAhead = 4;  // blocks between the one summed and the one prefetched (~37 KB at K 576)
// Most x rows one call takes: past a few dozen oneDNN's blocked GEMM is the faster kernel anyway.
constexpr int64_t kMaxRows = 64;

#if defined(__AVX512F__) && defined(__AVX512DQ__)
#define RAYLM_VEC 1
using Vec = __m512;
constexpr int kW = 16;
constexpr int kMR = 6;  // 6 x 4 accumulators + 4 weight vectors of 32 registers
inline Vec vzero() { return _mm512_setzero_ps(); }
inline Vec vload(const float* p) { return _mm512_loadu_ps(p); }
inline Vec vload_tail(const float* p, int64_t n) {
  return _mm512_maskz_loadu_ps(static_cast<__mmask16>((1u << n) - 1), p);
}
inline Vec vfma(Vec a, Vec b, Vec c) { return _mm512_fmadd_ps(a, b, c); }
inline __m128 vhalves(Vec s) {  // the sum of the four 128-bit lanes
  const __m256 h = _mm256_add_ps(_mm512_castps512_ps256(s), _mm512_extractf32x8_ps(s, 1));
  return _mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1));
}
inline __m128 unpack_sum(Vec a, Vec b, Vec c, Vec d) {
  const Vec ab = _mm512_add_ps(_mm512_unpacklo_ps(a, b), _mm512_unpackhi_ps(a, b));
  const Vec cd = _mm512_add_ps(_mm512_unpacklo_ps(c, d), _mm512_unpackhi_ps(c, d));
  return vhalves(_mm512_add_ps(_mm512_shuffle_ps(ab, cd, 0x44), _mm512_shuffle_ps(ab, cd, 0xEE)));
}
#elif defined(__AVX2__) && defined(__FMA__)
#define RAYLM_VEC 1
using Vec = __m256;
constexpr int kW = 8;
constexpr int kMR = 2;  // 2 x 4 accumulators + 4 weight vectors of 16 registers
inline Vec vzero() { return _mm256_setzero_ps(); }
inline Vec vload(const float* p) { return _mm256_loadu_ps(p); }
inline Vec vload_tail(const float* p, int64_t n) {
  const __m256i lanes = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
  return _mm256_maskload_ps(p, _mm256_cmpgt_epi32(_mm256_set1_epi32(static_cast<int>(n)), lanes));
}
inline Vec vfma(Vec a, Vec b, Vec c) { return _mm256_fmadd_ps(a, b, c); }
inline __m128 vhalves(Vec s) { return _mm_add_ps(_mm256_castps256_ps128(s), _mm256_extractf128_ps(s, 1)); }
inline __m128 unpack_sum(Vec a, Vec b, Vec c, Vec d) {
  const Vec ab = _mm256_add_ps(_mm256_unpacklo_ps(a, b), _mm256_unpackhi_ps(a, b));
  const Vec cd = _mm256_add_ps(_mm256_unpacklo_ps(c, d), _mm256_unpackhi_ps(c, d));
  return vhalves(_mm256_add_ps(_mm256_shuffle_ps(ab, cd, 0x44), _mm256_shuffle_ps(ab, cd, 0xEE)));
}
#endif

// Where the operands live: x rows at x + m * ldx, weight rows at w + n * ldw, y rows at y + m * ldy.
struct Operands {
  const float* x;
  const float* w;
  const float* b;  // nullptr: no bias
  float* y;
  int64_t M, N, K, ldx, ldw, ldy;
};

#ifdef RAYLM_VEC

// What a chunk prefetches of the block at `first` (nothing when nullptr): rows row, row + step, ...
struct Prefetch {
  const float* first;
  int row, step;
};

// y[m0 .. m0+MR, n0 .. n0+kNR] for one block of kNR weight rows, prefetching kNR vectors of the
// block ahead per step. The block's chunks of x rows share its prefetches (chunk c takes rows
// c, c + chunks, ...), so memory streams while every chunk computes, not only the first.
template <int MR>
void block(const Operands& o, int64_t m0, int64_t n0, Prefetch pf) {
  Vec acc[MR][kNR];
  for (auto& row : acc)
    for (auto& a : row) a = vzero();
  const float* w = o.w + n0 * o.ldw;
  const float* x = o.x + m0 * o.ldx;
  const int64_t kv = o.K - o.K % kW;
  for (int64_t k = 0; k < kv; k += kW) {
    if (pf.first != nullptr)  // contiguous rows: the block's lines in address order (~10% faster)
      for (int r = pf.row; r < kNR; r += pf.step) {
        const float* line = o.ldw == o.K ? pf.first + k * kNR + r * kW : pf.first + r * o.ldw + k;
        _mm_prefetch(reinterpret_cast<const char*>(line), _MM_HINT_T1);
      }
    Vec wr[kNR];
    for (int r = 0; r < kNR; ++r) wr[r] = vload(w + r * o.ldw + k);
    for (int m = 0; m < MR; ++m) {
      const Vec xv = vload(x + m * o.ldx + k);
      for (int r = 0; r < kNR; ++r) acc[m][r] = vfma(xv, wr[r], acc[m][r]);
    }
  }
  if (kv < o.K) {  // the last K % kW columns, masked (never read past a row)
    const int64_t n = o.K - kv;
    Vec wr[kNR];
    for (int r = 0; r < kNR; ++r) wr[r] = vload_tail(w + r * o.ldw + kv, n);
    for (int m = 0; m < MR; ++m) {
      const Vec xv = vload_tail(x + m * o.ldx + kv, n);
      for (int r = 0; r < kNR; ++r) acc[m][r] = vfma(xv, wr[r], acc[m][r]);
    }
  }
  const __m128 bias = o.b != nullptr ? _mm_loadu_ps(o.b + n0) : _mm_setzero_ps();
  for (int m = 0; m < MR; ++m) {
    const __m128 s = unpack_sum(acc[m][0], acc[m][1], acc[m][2], acc[m][3]);
    _mm_storeu_ps(o.y + (m0 + m) * o.ldy + n0, _mm_add_ps(s, bias));
  }
}

// One weight row n (the last N % kNR) for MR x rows, summed as `block` sums its rows (the same tree
// with three zero partners), so no output's order depends on where N ends.
template <int MR>
void single(const Operands& o, int64_t m0, int64_t n) {
  Vec acc[MR];
  for (auto& a : acc) a = vzero();
  const float* w = o.w + n * o.ldw;
  const float* x = o.x + m0 * o.ldx;
  const int64_t kv = o.K - o.K % kW;
  for (int64_t k = 0; k < kv; k += kW) {
    const Vec wv = vload(w + k);
    for (int m = 0; m < MR; ++m) acc[m] = vfma(vload(x + m * o.ldx + k), wv, acc[m]);
  }
  if (kv < o.K) {
    const Vec wv = vload_tail(w + kv, o.K - kv);
    for (int m = 0; m < MR; ++m) acc[m] = vfma(vload_tail(x + m * o.ldx + kv, o.K - kv), wv, acc[m]);
  }
  const float bias = o.b != nullptr ? o.b[n] : 0.f;
  for (int m = 0; m < MR; ++m)
    o.y[(m0 + m) * o.ldy + n] = _mm_cvtss_f32(unpack_sum(acc[m], vzero(), vzero(), vzero())) + bias;
}

template <int MR>
void rows(const Operands& o, int64_t m0, int64_t n0, bool whole, Prefetch pf) {
  if (whole) return block<MR>(o, m0, n0, pf);
  for (int64_t n = n0; n < o.N; ++n) single<MR>(o, m0, n);
}

using RowsFn = void (*)(const Operands&, int64_t, int64_t, bool, Prefetch);

template <int... MRs>
constexpr RowsFn pick(int mr, std::integer_sequence<int, MRs...>) {
  RowsFn fn = nullptr;
  ((fn = mr == MRs + 1 ? &rows<MRs + 1> : fn), ...);
  return fn;
}

// Blocks [begin, end) of kNR weight rows: each block comes from L2 (prefetched) for the first chunk
// of x rows and from L1 for the others.
void blocks(const Operands& o, int64_t begin, int64_t end) {
  const int chunks = static_cast<int>((o.M + kMR - 1) / kMR);  // balanced: 8 rows as 4 + 4
  constexpr int kMaxChunks = (kMaxRows + kMR - 1) / kMR;
  RowsFn fn[kMaxChunks];
  int64_t first[kMaxChunks];
  for (int c = 0, m0 = 0; c < chunks; ++c) {
    const int mr = static_cast<int>(o.M / chunks + (c < o.M % chunks ? 1 : 0));
    fn[c] = pick(mr, std::make_integer_sequence<int, kMR>{});
    first[c] = m0;
    m0 += mr;
  }
  for (int64_t nb = begin; nb < end; ++nb) {
    const int64_t n0 = nb * kNR, ahead = n0 + kAhead * kNR;
    const float* next = ahead + kNR <= o.N ? o.w + ahead * o.ldw : nullptr;
    for (int c = 0; c < chunks; ++c) fn[c](o, first[c], n0, n0 + kNR <= o.N, Prefetch{next, c, chunks});
  }
}

#else  // no vector unit we compile for: plain loops, the same products in column order

void blocks(const Operands& o, int64_t begin, int64_t end) {
  for (int64_t n = begin * kNR; n < std::min(end * kNR, o.N); ++n)
    for (int64_t m = 0; m < o.M; ++m) {
      float acc = 0.f;
      for (int64_t k = 0; k < o.K; ++k) acc += o.x[m * o.ldx + k] * o.w[n * o.ldw + k];
      o.y[m * o.ldy + n] = acc + (o.b != nullptr ? o.b[n] : 0.f);
    }
}

#endif

void check_matrix(const at::Tensor& t, const char* name) {
  TORCH_CHECK_VALUE(t.device().is_cpu() && t.scalar_type() == at::kFloat && t.dim() == 2, name,
                    ": must be a 2-D float32 CPU tensor, got ", t.dim(), "-D ", t.scalar_type(), " on ",
                    t.device());
  TORCH_CHECK_VALUE(t.stride(1) == 1 || t.size(1) <= 1, name,
                    ": needs unit stride along its columns (rows may be strided), got strides ", t.strides());
}

// Work per task when torch's intra-op pool splits the blocks: 64 weight rows (~150 KB at K 576).
constexpr int64_t kGrainBlocks = 16;

at::Tensor small_linear(const at::Tensor& x, const at::Tensor& weight, const std::optional<at::Tensor>& bias) {
  check_matrix(x, "x");
  check_matrix(weight, "weight");
  TORCH_CHECK_VALUE(weight.size(1) == x.size(1), "weight: needs x's ", x.size(1), " columns, got shape ",
                    weight.sizes());
  const int64_t M = x.size(0), N = weight.size(0), K = x.size(1);
  TORCH_CHECK_VALUE(M <= kMaxRows, "x: the small-row linear takes at most ", kMaxRows, " rows, got ", M);
  const float* b = nullptr;
  if (bias.has_value()) {
    TORCH_CHECK_VALUE(bias->device().is_cpu() && bias->scalar_type() == at::kFloat && bias->dim() == 1 &&
                          bias->size(0) == N && (bias->stride(0) == 1 || N <= 1),
                      "bias: must be a contiguous float32 CPU vector of ", N, " elements, got ", bias->sizes());
    b = bias->data_ptr<float>();
  }
  at::Tensor y = at::empty({M, N}, x.options());
  if (M == 0 || N == 0) return y;
  if (K == 0) return b != nullptr ? y.copy_(bias->expand({M, N})) : y.zero_();
  const Operands o{x.data_ptr<float>(), weight.data_ptr<float>(), b, y.data_ptr<float>(), M, N, K,
                   x.stride(0), weight.stride(0), N};
  at::parallel_for(0, (N + kNR - 1) / kNR, kGrainBlocks, [&](int64_t begin, int64_t end) { blocks(o, begin, end); });
  return y;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(raylm_fused, m) { m.def("small_linear(Tensor x, Tensor weight, Tensor? bias) -> Tensor", &small_linear); }
