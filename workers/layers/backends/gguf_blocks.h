// Where each element of a GGUF block lives, shared by the float kernel and de-quantisation
// (gguf_linear.cpp) and the int8 kernel's packing (gguf_int8.cpp).
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/util/Half.h>

#include <cstdint>
#if defined(__F16C__)
#include <immintrin.h>
#endif

namespace raylm_gguf {

constexpr int kBlock = 32;  // elements per chunk the kernels compute at once
constexpr int kSuper = 256;  // elements per K-quant super-block

enum QType : int64_t { Q4_0 = 0, Q4_1 = 1, Q8_0 = 2, Q4_K = 3, Q5_K = 4, Q6_K = 5 };

inline bool is_k(int64_t qtype) { return qtype >= Q4_K; }

// Bytes of one stored block: 32 elements for the legacy types, 256 for the K-quants.
inline int64_t block_bytes(int64_t qtype) {
  switch (qtype) {
    case Q8_0: return kBlock;
    case Q4_K: return 144;
    case Q5_K: return 176;
    case Q6_K: return 210;
    default: return kBlock / 2;
  }
}

inline float half_at(const uint8_t* p) {
  const uint16_t bits = static_cast<uint16_t>(p[0] | (p[1] << 8));
#ifdef __F16C__
  return _cvtsh_ss(bits);  // exact, as the portable conversion below
#else
  return c10::detail::fp16_ieee_to_fp32_value(bits);
#endif
}

// A K-quant super-block's per-chunk float scales, decoded once per super-block: chunk c
// (elements 32 c .. 32 c + 31) is lo[c] * q - min[c] for its first 16 elements and hi[c] * q -
// min[c] for the rest (Q6_K: min 0, not subtracted).
struct KScales {
  float lo[8], hi[8], min[8];
};

inline void kscales(int64_t qtype, const uint8_t* sb, KScales& k) {
  if (qtype == Q6_K) {  // 16 int8 scales, one per 16 elements, then fp16 d
    const float d = half_at(sb + 208);
    const int8_t* sc = reinterpret_cast<const int8_t*>(sb + 192);
    for (int c = 0; c < 8; ++c) {
      k.lo[c] = d * static_cast<float>(sc[2 * c]);
      k.hi[c] = d * static_cast<float>(sc[2 * c + 1]);
      k.min[c] = 0.0f;
    }
    return;
  }
  // Q4_K, Q5_K: fp16 d, fp16 dmin, then 12 bytes of eight 6-bit scales and mins. Bytes 0-3 and
  // 4-7 hold scales and mins 0-3 in their low six bits; bytes 8-11 the low four bits of scales
  // 4-7 (low nibble) and mins 4-7 (high nibble), whose top two bits are the top two bits of
  // bytes 0-3 (scales) and 4-7 (mins).
  const float d = half_at(sb), dmin = half_at(sb + 2);
  const uint8_t* s = sb + 4;
  for (int c = 0; c < 8; ++c) {
    int sc, mn;
    if (c < 4) {
      sc = s[c] & 63;
      mn = s[c + 4] & 63;
    } else {
      sc = (s[c + 4] & 0xF) | ((s[c - 4] >> 6) << 4);
      mn = (s[c + 4] >> 4) | ((s[c] >> 6) << 4);
    }
    k.lo[c] = k.hi[c] = d * static_cast<float>(sc);
    k.min[c] = dmin * static_cast<float>(mn);
  }
}

// Where the quants of chunk c of a K-quant super-block live:
//   Q4_K (d, dmin, scales, 128 bytes of nibbles): element j is nibble (c % 2) of byte
//     16 + 32 (c / 2) + j.
//   Q5_K (d, dmin, scales, 32 bytes of fifth bits, 128 of nibbles): as Q4_K from byte 48, plus
//     bit c of byte 16 + j as 16.
//   Q6_K (128 bytes of low nibbles, 64 of high bit pairs, scales, d): in half h = c / 4, quarter
//     t = c % 4, nibble (t / 2) of byte 64 h + 32 (t % 2) + j, plus bits 2 t and 2 t + 1 of byte
//     128 + 32 h + j as 16 and 32; then minus 32.
struct KBits {
  const uint8_t* low;  // 32 bytes holding the low four bits
  int low_shift;
  const uint8_t* high;  // Q5_K: 32 bytes with one bit each, Q6_K: with a bit pair each
  int high_shift;
};

inline KBits kbits(int64_t qtype, const uint8_t* sb, int c) {
  if (qtype == Q6_K) {
    const int h = c / 4, t = c % 4;
    return {sb + 64 * h + 32 * (t % 2), 4 * (t / 2), sb + 128 + 32 * h, 2 * t};
  }
  return {sb + (qtype == Q4_K ? 16 : 48) + 32 * (c / 2), 4 * (c % 2),
          qtype == Q5_K ? sb + 16 : nullptr, c};
}

// Element j of a K-quant chunk: Q4_K 0..15, Q5_K 0..31, Q6_K -32..31.
inline int kquant(int64_t qtype, const KBits& k, int j) {
  const int low = (k.low[j] >> k.low_shift) & 0xF;
  if (qtype == Q4_K) return low;
  if (qtype == Q5_K) return low | (((k.high[j] >> k.high_shift) & 1) << 4);
  return (low | (((k.high[j] >> k.high_shift) & 3) << 4)) - 32;
}

// One weight in the stored layout (see gguf_linear.cpp's header), checked.
struct Weights {
  int64_t qtype, n, k, row_bytes, chunks;
  const uint8_t* codes;
  const float* d;
  const float* mins;
};

inline Weights weights_of(const at::Tensor& codes, const at::Tensor& d, const at::Tensor& mins,
                   int64_t qtype) {
  TORCH_CHECK(qtype >= Q4_0 && qtype <= Q6_K, "qtype: unknown ", qtype);
  TORCH_CHECK(codes.is_contiguous() && codes.dim() == 2 && codes.element_size() == 1,
              "codes must be contiguous bytes [N, bytes per row]");
  const int64_t n = codes.size(0);
  if (is_k(qtype)) {
    TORCH_CHECK(codes.size(1) % block_bytes(qtype) == 0, "codes: rows of whole super-blocks of ",
                block_bytes(qtype), " bytes expected");
    const int64_t k = codes.size(1) / block_bytes(qtype) * kSuper;
    return {qtype, n, k, codes.size(1), k / kBlock, static_cast<const uint8_t*>(codes.data_ptr()),
            nullptr, nullptr};
  }
  TORCH_CHECK(d.is_contiguous() && d.scalar_type() == at::kFloat, "scales must be contiguous float32");
  TORCH_CHECK(d.dim() == 2 && d.size(0) == n, "shape mismatch");
  const int64_t chunks = d.size(1);
  const int64_t row_bytes = chunks * block_bytes(qtype);
  TORCH_CHECK(codes.size(1) == row_bytes, "codes: expected ", row_bytes, " bytes per row");
  const float* m = nullptr;
  if (qtype == Q4_1) {
    TORCH_CHECK(mins.sizes() == d.sizes() && mins.is_contiguous() && mins.scalar_type() == at::kFloat,
                "mins must match scales");
    m = mins.data_ptr<float>();
  }
  return {qtype, n, chunks * kBlock, row_bytes, chunks,
          static_cast<const uint8_t*>(codes.data_ptr()), d.data_ptr<float>(), m};
}

}  // namespace raylm_gguf
