// The GGUF linear with int8 activations and AVX512-VNNI integer dot products, as llama.cpp's
// and vLLM's GGUF kernels compute it. Registered as torch.ops.raylm_gguf.{isa,pack,linear_packed}
// (pack and linear_packed only in builds with -mavx512vnni; `isa` says which build this is).
//
// Activations: each row of x is cut into 32-element blocks; block b is quantized to int8 codes
// q = round(x / d_x) with d_x = max|x_b| / 127 (round to nearest even), and the codes' integer
// sums are kept per 16 elements. The kernel therefore computes xhat @ W^T exactly up to float32
// rounding, where xhat = d_x * q is x rounded to its block's grid: |y - x @ W^T| <= sum over
// blocks of (d_x / 2) * sum |w| (plus float rounding).
//
// Weights: `pack` converts the stored blocks once into tiles of 16 weight rows. Every element
// becomes an unsigned code u (Q4_0, Q4_1, Q4_K 0..15; Q5_K 0..31; Q6_K q + 32 in 0..63; Q8_0
// q + 128) and each block of 32 an affine map w = scale * (u - offset) + min:
//   Q4_0 d, 8, 0;   Q4_1 d, 0, m;   Q8_0 d, 128, 0;
//   Q4_K, Q5_K (d * sc), 0, -(dmin * mn);   Q6_K (d * sc) per 16 elements, 32, 0.
// (scale and min are the float32 products `dequantize` uses.) Tile t, block b holds, for each
// group g of four elements (4 g .. 4 g + 3), one 64-byte vector with the four codes of each of
// the 16 rows side by side; 4-bit codes pack groups g and g + 4 into one vector's low and high
// nibbles (the legacy types' own byte order). One VPDPBUSD of that vector with the activation
// codes of group g (four int8, broadcast) adds four products to each row's int32 lane, so 8 of
// them give the block's 16 integer dot products at once, and
//   y[n] += scale[n] * d_x * (dot[n] - offset * sum(q)) + min[n] * d_x * sum(q)
// is one int-to-float conversion and two or three float operations per block and 16 rows. The
// offset term is the integer start of the dot product.
#include "gguf_blocks.h"

#include <ATen/Parallel.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/zeros.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <string>
#include <tuple>
#if defined(__AVX512VNNI__)
#include <immintrin.h>
#endif

namespace {

using namespace raylm_gguf;

std::string isa() {
#if defined(__AVX512VNNI__)
  return "avx512_vnni";
#elif defined(__AVX512F__)
  return "avx512";
#elif defined(__AVX2__)
  return "avx2";
#else
  return "default";
#endif
}

#if defined(__AVX512VNNI__)

constexpr int kTile = 16;  // weight rows per tile: one float32 lane each
constexpr int kRowTile = 8;  // activation rows sharing each decoded weight vector

// What each type subtracts from its codes (in integers) and whether it adds a float min.
constexpr int offset_of(int64_t Q) { return Q == Q4_0 ? 8 : Q == Q8_0 ? 128 : Q == Q6_K ? 32 : 0; }
constexpr bool has_min(int64_t Q) { return Q == Q4_1 || Q == Q4_K || Q == Q5_K; }

// ---- packing the stored blocks (once per weight)

inline bool four_bit(int64_t qtype) { return qtype == Q4_0 || qtype == Q4_1 || qtype == Q4_K; }
inline int halves(int64_t qtype) { return qtype == Q6_K ? 2 : 1; }
inline int64_t tile_block_bytes(int64_t qtype) { return four_bit(qtype) ? 256 : 512; }

// One block of one row as the kernel sees it: unsigned codes, scales (per 16 elements), min.
struct Affine {
  uint8_t u[kBlock];
  float scale[2];
  float min;
};

inline Affine legacy_block(const Weights& w, int64_t n, int64_t b) {
  Affine a{};
  const uint8_t* p = w.codes + n * w.row_bytes + b * block_bytes(w.qtype);
  a.scale[0] = a.scale[1] = w.d[n * w.chunks + b];
  a.min = w.mins ? w.mins[n * w.chunks + b] : 0.0f;
  for (int j = 0; j < kBlock / 2; ++j) {
    if (w.qtype == Q8_0) {  // signed codes moved to 0..255; the kernel subtracts 128 * sum(q)
      a.u[j] = p[j] ^ 0x80;
      a.u[j + 16] = p[j + 16] ^ 0x80;
    } else {
      a.u[j] = p[j] & 0xF;
      a.u[j + 16] = p[j] >> 4;
    }
  }
  return a;
}

inline Affine k_block(const Weights& w, int64_t n, int64_t b) {
  Affine a{};
  const uint8_t* sb = w.codes + n * w.row_bytes + (b / 8) * block_bytes(w.qtype);
  const int c = static_cast<int>(b % 8);
  KScales ks;
  kscales(w.qtype, sb, ks);
  const KBits bits = kbits(w.qtype, sb, c);
  const int lift = w.qtype == Q6_K ? 32 : 0;  // Q6_K's -32..31 moved to 0..63
  for (int j = 0; j < kBlock; ++j) a.u[j] = static_cast<uint8_t>(kquant(w.qtype, bits, j) + lift);
  a.scale[0] = ks.lo[c];
  a.scale[1] = ks.hi[c];
  a.min = -ks.min[c];
  return a;
}

// Where code j (0..31) of row i (0..15) goes in a tile's block: group g = j / 4 of four codes,
// row i's four bytes at 4 i. 4-bit codes: groups 4..7 in the high nibbles of groups 0..3.
inline void place_code(int64_t qtype, uint8_t* tb, int i, int j, uint8_t u) {
  const int g = j / 4, e = j % 4;
  if (four_bit(qtype))
    tb[64 * (g % 4) + 4 * i + e] |= static_cast<uint8_t>(g < 4 ? u : u << 4);
  else
    tb[64 * g + 4 * i + e] = u;
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> pack(const at::Tensor& codes, const at::Tensor& d,
                                                    const at::Tensor& mins, int64_t qtype) {
  const Weights w = weights_of(codes, d, mins, qtype);
  const int64_t tiles = (w.n + kTile - 1) / kTile, blocks = w.chunks;
  const int h = halves(qtype);
  auto bytes = codes.options().dtype(at::kByte);
  auto floats = codes.options().dtype(at::kFloat);
  // Rows past N (the last tile's padding) stay zero: scale 0, min 0, outputs never stored.
  at::Tensor pc = at::zeros({tiles, blocks, tile_block_bytes(qtype)}, bytes);
  at::Tensor ps = at::zeros({tiles, blocks, h, kTile}, floats);
  at::Tensor pm = at::zeros({has_min(qtype) ? tiles : 0, blocks, kTile}, floats);
  uint8_t* c = pc.data_ptr<uint8_t>();
  float* s = ps.data_ptr<float>();
  float* m = pm.data_ptr<float>();
  at::parallel_for(0, w.n, 16, [&](int64_t begin, int64_t end) {
    for (int64_t n = begin; n < end; ++n) {
      const int64_t t = n / kTile;
      const int i = static_cast<int>(n % kTile);
      for (int64_t b = 0; b < blocks; ++b) {
        const Affine a = is_k(qtype) ? k_block(w, n, b) : legacy_block(w, n, b);
        const int64_t tb = t * blocks + b;
        for (int j = 0; j < kBlock; ++j)
          place_code(qtype, c + tb * tile_block_bytes(qtype), i, j, a.u[j]);
        for (int half = 0; half < h; ++half) s[(tb * h + half) * kTile + i] = a.scale[half];
        if (has_min(qtype)) m[tb * kTile + i] = a.min;
      }
    }
  });
  return {pc, ps, pm};
}

// ---- activations, quantized per call

struct Acts {
  int64_t rows, k, blocks;
  const int8_t* q;  // [rows, k]
  const float* d;  // [rows, blocks]: d_x
  const float* s;  // [rows, blocks]: d_x * sum(q), for the mins
  const int32_t* half_sum;  // [rows, 2 blocks]: sum(q) over each 16 elements
};

inline float max_abs(__m512 a, __m512 b) {
  const __m512 sign = _mm512_set1_ps(-0.0f);
  return _mm512_reduce_max_ps(_mm512_max_ps(_mm512_andnot_ps(sign, a), _mm512_andnot_ps(sign, b)));
}

// Codes of 16 floats at 1/d_x (round to nearest even), stored as int8; their sum.
inline int32_t codes16(__m512 x, __m512 inv, int8_t* q) {
  const __m512i v = _mm512_cvt_roundps_epi32(_mm512_mul_ps(x, inv),
                                             _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  _mm_storeu_si128(reinterpret_cast<__m128i*>(q), _mm512_cvtsepi32_epi8(v));
  return _mm512_reduce_add_epi32(v);
}

inline void quantize_block(const float* x, int8_t* q, float* d, float* s, int32_t* half_sum) {
  const __m512 lo = _mm512_loadu_ps(x), hi = _mm512_loadu_ps(x + 16);
  const float amax = max_abs(lo, hi);
  const __m512 inv = _mm512_set1_ps(amax > 0.0f ? 127.0f / amax : 0.0f);
  half_sum[0] = codes16(lo, inv, q);
  half_sum[1] = codes16(hi, inv, q + 16);
  // x - x is 0 for a finite element and NaN for NaN or infinity: a block holding one gets a NaN
  // d_x, so every output of its row is NaN, as the float product's would be (the max above and
  // the int8 conversion would otherwise turn it into a finite code).
  const float poison =
      _mm512_reduce_add_ps(_mm512_add_ps(_mm512_sub_ps(lo, lo), _mm512_sub_ps(hi, hi)));
  *d = amax / 127.0f + poison;
  *s = *d * static_cast<float>(half_sum[0] + half_sum[1]);
}

// ---- the tile kernel

// The 8 code vectors of one tile's block (group g: elements 4 g .. 4 g + 3 of 16 rows).
template <int Q>
inline void load_codes(const uint8_t* p, __m512i* u) {
  if constexpr (Q == Q4_0 || Q == Q4_1 || Q == Q4_K) {
    const __m512i nibble = _mm512_set1_epi8(0x0F);
    for (int g = 0; g < 4; ++g) {
      const __m512i v = _mm512_loadu_si512(p + 64 * g);
      u[g] = _mm512_and_si512(v, nibble);
      u[g + 4] = _mm512_and_si512(_mm512_srli_epi16(v, 4), nibble);
    }
  } else {
    for (int g = 0; g < 8; ++g) u[g] = _mm512_loadu_si512(p + 64 * g);
  }
}

// Four int8 activation codes, broadcast to every lane.
inline __m512i four_codes(const int8_t* q) {
  int32_t v;
  std::memcpy(&v, q, 4);
  return _mm512_set1_epi32(v);
}

// Sum over groups [g0, g1) of u * q per row lane, starting from `start`.
template <int G0, int G1>
inline __m512i dot(__m512i start, const __m512i* u, const int8_t* q) {
  for (int g = G0; g < G1; ++g) start = _mm512_dpbusd_epi32(start, u[g], four_codes(q + 4 * g));
  return start;
}

struct Packed {
  int64_t n, tiles, blocks;
  const uint8_t* codes;
  const float* scales;
  const float* mins;
};

// Block b of the next tile is fetched while block b of this one is computed. Weights stream from
// memory in a decode step, and without it the stream paused while a block's dot products ran, so
// each activation row past the first added its compute to the memory time: on SmolLM2's 120
// linears (1 thread) 5 rows took 7.90 ms and 8 rows 10.72 against 6.84 and 8.59 with it; 1 row
// the same 5.6 ms. Two or four tiles ahead did no better (bench/results/2026-11-29-verify-rows.md).
template <int Q>
inline void prefetch_block(const Packed& w, int64_t tb) {
  const char* c = reinterpret_cast<const char*>(w.codes + tb * tile_block_bytes(Q));
  for (int line = 0; line < tile_block_bytes(Q); line += 64) _mm_prefetch(c + line, _MM_HINT_T0);
  const float* sc = w.scales + tb * (Q == Q6_K ? 2 : 1) * kTile;
  _mm_prefetch(reinterpret_cast<const char*>(sc), _MM_HINT_T0);
  if constexpr (has_min(Q))
    _mm_prefetch(reinterpret_cast<const char*>(w.mins + tb * kTile), _MM_HINT_T0);
}

// y[r0 .. r0 + R) x [16 t .. 16 t + 16) for one tile of weight rows.
template <int Q, int R>
void tile_rows(const Packed& w, int64_t t, const Acts& a, int64_t r0, float* y) {
  constexpr int h = Q == Q6_K ? 2 : 1;
  constexpr int off = offset_of(Q);
  __m512 acc[R];
  for (int r = 0; r < R; ++r) acc[r] = _mm512_setzero_ps();
  __m512i u[8];
  for (int64_t b = 0; b < w.blocks; ++b) {
    const int64_t tb = t * w.blocks + b;
    prefetch_block<Q>(w, tb + w.blocks);  // past the last tile: a hint, never a fault
    load_codes<Q>(w.codes + tb * tile_block_bytes(Q), u);
    const float* sc = w.scales + tb * h * kTile;
    for (int r = 0; r < R; ++r) {
      const int64_t row = (r0 + r) * a.blocks + b;
      const int8_t* q = a.q + (r0 + r) * a.k + b * kBlock;
      const int32_t* hs = a.half_sum + 2 * row;
      const __m512 dx = _mm512_set1_ps(a.d[row]);
      if constexpr (h == 2) {  // a scale per 16 elements
        const __m512i lo = dot<0, 4>(_mm512_set1_epi32(-off * hs[0]), u, q);
        const __m512i hi = dot<4, 8>(_mm512_set1_epi32(-off * hs[1]), u, q);
        acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(lo),
                                 _mm512_mul_ps(_mm512_loadu_ps(sc), dx), acc[r]);
        acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(hi),
                                 _mm512_mul_ps(_mm512_loadu_ps(sc + kTile), dx), acc[r]);
      } else {
        const __m512i all = dot<0, 8>(_mm512_set1_epi32(-off * (hs[0] + hs[1])), u, q);
        acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(all),
                                 _mm512_mul_ps(_mm512_loadu_ps(sc), dx), acc[r]);
      }
      if constexpr (has_min(Q))
        acc[r] = _mm512_fmadd_ps(_mm512_loadu_ps(w.mins + tb * kTile), _mm512_set1_ps(a.s[row]),
                                 acc[r]);
    }
  }
  const int64_t valid = std::min<int64_t>(kTile, w.n - t * kTile);
  const __mmask16 mask = static_cast<__mmask16>((1u << valid) - 1);
  for (int r = 0; r < R; ++r) _mm512_mask_storeu_ps(y + (r0 + r) * w.n + t * kTile, mask, acc[r]);
}

template <int Q, int R>
void rows_upto(const Packed& w, int64_t t, const Acts& a, int64_t r0, int64_t rows, float* y) {
  if constexpr (R > 1) {
    if (rows < R) return rows_upto<Q, R - 1>(w, t, a, r0, rows, y);
  }
  tile_rows<Q, R>(w, t, a, r0, y);
}

// Work a thread should have before the weight rows are split, in tile blocks times activation
// rows. Below it a fork and join costs more than it saves (and on a busy machine waiting for a
// descheduled thread far more). In a decode step the weights come cold from memory, so a second
// thread pays off sooner than on a warm microbenchmark: on the quiet 2-core VM, SmolLM2 Q4_1 at
// batch 1 decoded 75.6 tok/s with 2048 (only gate_up and the LM head split), 89-96 with 512
// (every layer but o), 73 with 256 (bench/quantized_cpu.py --threads 2).
constexpr int64_t kMinWork = 512;

template <int Q>
void tiles(const Packed& w, const Acts& a, float* y) {
  const int64_t grain = std::max<int64_t>(1, kMinWork / std::max<int64_t>(1, w.blocks * a.rows));
  // A tile's blocks (at most 512 bytes each per 32 inputs) stay in L1 while every group of
  // activation rows passes over them.
  at::parallel_for(0, w.tiles, grain, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t)
      for (int64_t r0 = 0; r0 < a.rows; r0 += kRowTile)
        rows_upto<Q, kRowTile>(w, t, a, r0, std::min<int64_t>(kRowTile, a.rows - r0), y);
  });
}

at::Tensor linear_packed(const at::Tensor& x, const at::Tensor& codes, const at::Tensor& scales,
                         const at::Tensor& mins, int64_t n, int64_t qtype) {
  TORCH_CHECK(qtype >= Q4_0 && qtype <= Q6_K, "qtype: unknown ", qtype);
  TORCH_CHECK(codes.dim() == 3 && codes.is_contiguous() && codes.size(2) == tile_block_bytes(qtype),
              "codes: packed tiles expected (see pack)");
  const int64_t tiles_n = codes.size(0), blocks = codes.size(1), k = blocks * kBlock;
  TORCH_CHECK(n >= 0 && (n + kTile - 1) / kTile == tiles_n, "n: ", n, " rows do not fill ",
              tiles_n, " tiles");
  TORCH_CHECK(scales.is_contiguous() && scales.numel() == tiles_n * blocks * halves(qtype) * kTile &&
                  mins.is_contiguous() &&
                  mins.numel() == (has_min(qtype) ? tiles_n * blocks * kTile : 0),
              "scales and mins: packed tiles expected (see pack)");
  TORCH_CHECK(x.dim() == 2 && x.size(1) == k && x.is_contiguous() && x.scalar_type() == at::kFloat,
              "x must be contiguous float32 [M, ", k, "]");
  const int64_t rows = x.size(0);
  // The activations' codes, d_x, d_x * sum(q) and half sums in one scratch buffer: a decode step
  // makes ~120 of these calls, and four allocations each were a measurable share of the small ones.
  // Every part starts 4-byte aligned: k is a multiple of 32.
  at::Tensor scratch = at::empty({rows * (k + 4 * blocks * 4)}, x.options().dtype(at::kByte));
  int8_t* qp = reinterpret_cast<int8_t*>(scratch.data_ptr<uint8_t>());
  float* dp = reinterpret_cast<float*>(qp + rows * k);
  float* sp = dp + rows * blocks;
  int32_t* hp = reinterpret_cast<int32_t*>(sp + rows * blocks);
  const float* xp = x.data_ptr<float>();
  at::parallel_for(0, rows * blocks, kMinWork, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i)
      quantize_block(xp + i * kBlock, qp + i * kBlock, dp + i, sp + i, hp + 2 * i);
  });
  const Acts a{rows, k, blocks, qp, dp, sp, hp};
  const Packed w{n, tiles_n, blocks, codes.data_ptr<uint8_t>(), scales.data_ptr<float>(),
                 mins.data_ptr<float>()};
  at::Tensor y = at::empty({rows, n}, x.options());
  float* yp = y.data_ptr<float>();
  switch (qtype) {
    case Q4_0: tiles<Q4_0>(w, a, yp); break;
    case Q4_1: tiles<Q4_1>(w, a, yp); break;
    case Q8_0: tiles<Q8_0>(w, a, yp); break;
    case Q4_K: tiles<Q4_K>(w, a, yp); break;
    case Q5_K: tiles<Q5_K>(w, a, yp); break;
    default: tiles<Q6_K>(w, a, yp); break;
  }
  return y;
}

#endif  // __AVX512VNNI__

}  // namespace

TORCH_LIBRARY_FRAGMENT(raylm_gguf, m) {
  m.def("isa", &isa);
#if defined(__AVX512VNNI__)
  m.def("pack", &pack);
  m.def("linear_packed", &linear_packed);
#endif
}
