// Float helpers shared by the CPU kernels (cpu_fused.cpp, paged_decode.cpp). Inline, so each
// library compiles them under its own flags, as it compiled its own copy before.
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>

namespace raylm_cpu {

// exp(x) for x already clamped to [-87, 88], within about 2 ulp of std::exp; plain arithmetic,
// so the loops that call it vectorise (std::exp stays one scalar call per element).
inline float exp_clamped(float x) {
  const float n = std::nearbyint(x * 1.44269504088896341f);
  const float r = (x - n * 0.693145751953125f) - n * 1.428606765330187045e-6f;  // x - n ln2, two parts
  float p = 1.f / 5040.f;
  p = p * r + 1.f / 720.f;
  p = p * r + 1.f / 120.f;
  p = p * r + 1.f / 24.f;
  p = p * r + 1.f / 6.f;
  p = p * r + 0.5f;
  p = p * r + 1.f;
  p = p * r + 1.f;
  const int32_t bits = (static_cast<int32_t>(n) + 127) << 23;  // 2^n, n in [-126, 127]
  float scale;
  std::memcpy(&scale, &bits, sizeof scale);
  return p * scale;
}

}  // namespace raylm_cpu
