// Fused elementwise layer ops on CPU (workers/layers/cpu_ops.py builds and calls them): RMSNorm with
// an optional residual add, SiLU-and-mul, rotary in place, and the KV-cache write. Registered as
// torch.ops.raylm_fused.*. Each op rounds where the torch path rounds: to the activation dtype after
// every op torch runs in it, so in float32 rotary and the cache write are bit for bit the torch path,
// RMSNorm differs only by the order of its sum (accumulated in double here) and SiLU by its exp.
// Built with -ffp-contract=off, so no product and sum are fused into one rounding torch does not do.
#include "cpu_math.h"

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/util/BFloat16.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <tuple>

namespace {

using c10::BFloat16;

inline float widen(float x) { return x; }
inline float widen(BFloat16 x) {
  uint32_t bits = static_cast<uint32_t>(x.x) << 16;
  float f;
  std::memcpy(&f, &bits, sizeof f);
  return f;
}

template <typename T>
inline T narrow(float x);
template <>
inline float narrow<float>(float x) { return x; }
template <>
inline BFloat16 narrow<BFloat16>(float x) { return BFloat16(x); }  // round to nearest even, as torch

// x rounded to T and back: what torch stores after one op in T.
template <typename T>
inline float round_to(float x) { return widen(narrow<T>(x)); }

// exp(x) within about 2 ulp of std::exp on [-87, 88], 0 below and +inf above.
inline float exp_approx(float x) {
  const float y = raylm_cpu::exp_clamped(std::min(std::max(x, -87.0f), 88.0f));
  return x > 88.0f ? std::numeric_limits<float>::infinity() : (x < -87.0f ? 0.0f : y);
}

// Rows run inline below this many elements in all (a decode step's few rows); above it, split over
// torch's intra-op threads.
constexpr int64_t kInlineElements = 1 << 15;

inline int64_t grain(int64_t per_row) { return std::max<int64_t>(1, kInlineElements / std::max<int64_t>(per_row, 1)); }

// A [rows, n] view of a 1-, 2- or 3-D tensor with unit last stride: row r is at
// (r / heads) * outer + (r % heads) * inner.
struct Rows {
  int64_t rows, heads, outer, inner, n;
  int64_t offset(int64_t r) const { return (r / heads) * outer + (r % heads) * inner; }
};

Rows rows_of(const at::Tensor& x, const char* name) {
  TORCH_CHECK_VALUE(x.dim() >= 1 && x.dim() <= 3, name, ": needs 1 to 3 dimensions, got ", x.dim());
  TORCH_CHECK_VALUE(x.size(-1) == 0 || x.stride(-1) == 1 || x.size(-1) == 1, name,
                    ": needs unit stride in its last dimension, got ", x.stride(-1));
  const int64_t n = x.size(-1);
  if (x.dim() == 1) return {1, 1, 0, 0, n};
  if (x.dim() == 2) return {x.size(0), 1, x.stride(0), 0, n};
  return {x.size(0) * x.size(1), x.size(1), x.stride(0), x.stride(1), n};
}

void check_cpu(const at::Tensor& t, const char* name) {
  TORCH_CHECK_VALUE(t.device().is_cpu(), name, ": must be a CPU tensor, got ", t.device());
}

bool is_float_type(at::ScalarType s) { return s == at::kFloat || s == at::kBFloat16; }

// ---- RMSNorm: out = w * round_T(x * rsqrt(mean(x^2) + eps)), x optionally x + residual first ----

template <typename T, typename W, typename O>
void norm_row(const T* x, const W* w, O* out, int64_t n, float eps) {
  double acc = 0.0;
#pragma omp simd reduction(+ : acc)
  for (int64_t i = 0; i < n; ++i) {
    const double v = widen(x[i]);
    acc += v * v;
  }
  const float inv = 1.0f / std::sqrt(static_cast<float>(acc / static_cast<double>(n)) + eps);
  for (int64_t i = 0; i < n; ++i) out[i] = narrow<O>(widen(w[i]) * round_to<T>(widen(x[i]) * inv));
}

template <typename T, typename W, typename O>
void norm_rows(const at::Tensor& x, const at::Tensor* residual, const at::Tensor& w, at::Tensor& out,
               at::Tensor* res_out, float eps) {
  const Rows xr = rows_of(x, "x");
  const Rows rr = residual ? rows_of(*residual, "residual") : xr;
  const T* xp = x.data_ptr<T>();
  const T* rp = residual ? residual->data_ptr<T>() : nullptr;
  T* sp = res_out ? res_out->data_ptr<T>() : nullptr;
  const W* wp = w.data_ptr<W>();
  O* op = out.data_ptr<O>();
  const int64_t n = xr.n;
  at::parallel_for(0, xr.rows, grain(n), [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const T* row = xp + xr.offset(r);
      if (rp != nullptr) {
        T* sum = sp + r * n;
        const T* res = rp + rr.offset(r);
        for (int64_t i = 0; i < n; ++i) sum[i] = narrow<T>(widen(row[i]) + widen(res[i]));
        row = sum;
      }
      norm_row<T, W, O>(row, wp, op + r * n, n, eps);
    }
  });
}

std::tuple<at::Tensor, at::Tensor> norm_impl(const at::Tensor& x, const at::Tensor* residual,
                                             const at::Tensor& weight, double eps) {
  check_cpu(x, "x");
  check_cpu(weight, "weight");
  TORCH_CHECK_VALUE(is_float_type(x.scalar_type()), "x: float32 or bfloat16, got ", x.scalar_type());
  TORCH_CHECK_VALUE(weight.scalar_type() == x.scalar_type() || weight.scalar_type() == at::kFloat,
                    "weight: must be float32 or x's dtype ", x.scalar_type(), ", got ", weight.scalar_type());
  TORCH_CHECK_VALUE(weight.dim() == 1 && weight.is_contiguous() && weight.size(0) == x.size(-1), "weight: needs ",
                    x.size(-1), " contiguous elements (x's last dimension), got shape ", weight.sizes());
  TORCH_CHECK_VALUE(std::isfinite(eps) && eps >= 0, "eps: must be finite and not negative, got ", eps);
  rows_of(x, "x");
  if (residual != nullptr) {
    check_cpu(*residual, "residual");
    TORCH_CHECK_VALUE(residual->scalar_type() == x.scalar_type(), "residual: must have x's dtype ",
                      x.scalar_type(), ", got ", residual->scalar_type());
    TORCH_CHECK_VALUE(residual->sizes() == x.sizes(), "residual: must have x's shape ", x.sizes(), ", got ",
                      residual->sizes());
    rows_of(*residual, "residual");
  }
  const auto out_type = weight.scalar_type() == at::kFloat ? at::kFloat : x.scalar_type();
  at::Tensor out = at::empty(x.sizes(), x.options().dtype(out_type));
  at::Tensor summed = residual ? at::empty(x.sizes(), x.options()) : at::Tensor();
  at::Tensor* res_out = residual ? &summed : nullptr;
  const float e = static_cast<float>(eps);
  if (x.scalar_type() == at::kFloat) {
    norm_rows<float, float, float>(x, residual, weight, out, res_out, e);
  } else if (weight.scalar_type() == at::kFloat) {
    norm_rows<BFloat16, float, float>(x, residual, weight, out, res_out, e);
  } else {
    norm_rows<BFloat16, BFloat16, BFloat16>(x, residual, weight, out, res_out, e);
  }
  return {out, summed};
}

at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps) {
  return std::get<0>(norm_impl(x, nullptr, weight, eps));
}

std::tuple<at::Tensor, at::Tensor> add_rms_norm(const at::Tensor& x, const at::Tensor& residual,
                                                const at::Tensor& weight, double eps) {
  return norm_impl(x, &residual, weight, eps);
}

// ---- SiLU-and-mul: out = round_T(silu(gate)) * up over x = [gate | up] ----

template <typename T>
void silu_rows(const at::Tensor& x, const at::Tensor& out) {
  const int64_t rows = x.size(0), n = out.size(1), stride = x.stride(0);
  const T* xp = x.data_ptr<T>();
  T* op = out.data_ptr<T>();
  at::parallel_for(0, rows, grain(n), [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const T* gate = xp + r * stride;
      const T* up = gate + n;
      T* o = op + r * n;
      for (int64_t i = 0; i < n; ++i) {
        const float g = widen(gate[i]);
        o[i] = narrow<T>(round_to<T>(g / (1.0f + exp_approx(-g))) * widen(up[i]));
      }
    }
  });
}

at::Tensor silu_and_mul(const at::Tensor& x) {
  check_cpu(x, "x");
  TORCH_CHECK_VALUE(is_float_type(x.scalar_type()), "x: float32 or bfloat16, got ", x.scalar_type());
  TORCH_CHECK_VALUE(x.dim() == 2 && x.size(1) % 2 == 0, "x: needs shape [rows, 2n], got ", x.sizes());
  TORCH_CHECK_VALUE(x.size(1) == 0 || x.stride(1) == 1, "x: needs unit stride in its last dimension");
  at::Tensor out = at::empty({x.size(0), x.size(1) / 2}, x.options());
  if (x.scalar_type() == at::kFloat) {
    silu_rows<float>(x, out);
  } else {
    silu_rows<BFloat16>(x, out);
  }
  return out;
}

// ---- Rotary (neox layout) in place: x1' = x1 c - x2 s, x2' = x2 c + x1 s over the table's width ----

template <typename T>
void rotate_head(T* x, const float* cos, const float* sin, int64_t half) {
  for (int64_t i = 0; i < half; ++i) {
    const float x1 = widen(x[i]), x2 = widen(x[half + i]);
    const float c1 = round_to<T>(cos[i]), c2 = round_to<T>(cos[half + i]);
    const float s1 = round_to<T>(sin[i]), s2 = round_to<T>(sin[half + i]);
    x[i] = narrow<T>(round_to<T>(x1 * c1) - round_to<T>(x2 * s1));
    x[half + i] = narrow<T>(round_to<T>(x2 * c2) + round_to<T>(x1 * s2));
  }
}

template <typename T>
void rotary_rows(const at::Tensor& q, const at::Tensor& k, const int64_t* pos, const float* cos, const float* sin,
                 int64_t width) {
  const int64_t tokens = q.size(0), hq = q.size(1), hk = k.size(1), half = width / 2;
  T* qp = q.data_ptr<T>();
  T* kp = k.data_ptr<T>();
  at::parallel_for(0, tokens, grain((hq + hk) * width), [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const float* c = cos + pos[t] * width;
      const float* s = sin + pos[t] * width;
      for (int64_t h = 0; h < hq; ++h) rotate_head<T>(qp + t * q.stride(0) + h * q.stride(1), c, s, half);
      for (int64_t h = 0; h < hk; ++h) rotate_head<T>(kp + t * k.stride(0) + h * k.stride(1), c, s, half);
    }
  });
}

void check_heads(const at::Tensor& x, const char* name) {
  check_cpu(x, name);
  TORCH_CHECK_VALUE(is_float_type(x.scalar_type()), name, ": float32 or bfloat16, got ", x.scalar_type());
  TORCH_CHECK_VALUE(x.dim() == 3, name, ": needs shape [tokens, heads, head_dim], got ", x.sizes());
  TORCH_CHECK_VALUE(x.size(2) <= 1 || x.stride(2) == 1, name, ": needs unit stride in its last dimension");
}

void check_slots(const at::Tensor& index, int64_t count, int64_t limit, const char* name) {
  check_cpu(index, name);
  TORCH_CHECK_VALUE(index.scalar_type() == at::kLong && index.dim() == 1 && index.size(0) == count, name,
                    ": needs int64 [", count, "], got ", index.scalar_type(), " ", index.sizes());
  const at::Tensor flat = index.contiguous();
  const int64_t* p = flat.data_ptr<int64_t>();
  for (int64_t i = 0; i < count; ++i)
    TORCH_CHECK_VALUE(p[i] >= 0 && p[i] < limit, name, ": entry ", i, " is ", p[i], ", outside [0, ", limit, ")");
}

void rotary_(const at::Tensor& q, const at::Tensor& k, const at::Tensor& positions, const at::Tensor& cos,
             const at::Tensor& sin) {
  check_heads(q, "q");
  check_heads(k, "k");
  TORCH_CHECK_VALUE(k.scalar_type() == q.scalar_type(), "k: must have q's dtype ", q.scalar_type(), ", got ",
                    k.scalar_type());
  TORCH_CHECK_VALUE(k.size(0) == q.size(0) && k.size(2) == q.size(2), "k: needs q's tokens and head_dim ",
                    q.size(0), ", ", q.size(2), ", got shape ", k.sizes());
  for (const auto& [t, name] : {std::pair{&cos, "cos"}, std::pair{&sin, "sin"}}) {
    check_cpu(*t, name);
    TORCH_CHECK_VALUE(t->scalar_type() == at::kFloat && t->dim() == 2 && t->is_contiguous(), name,
                      ": needs a contiguous float32 [positions, rotary_dim] table, got ", t->scalar_type(), " ",
                      t->sizes());
  }
  TORCH_CHECK_VALUE(sin.sizes() == cos.sizes(), "sin: must have cos's shape ", cos.sizes(), ", got ", sin.sizes());
  const int64_t width = cos.size(1);
  TORCH_CHECK_VALUE(width % 2 == 0 && width <= q.size(2), "cos: rotary_dim ", width,
                    " must be even and at most head_dim ", q.size(2));
  check_slots(positions, q.size(0), cos.size(0), "positions");
  const at::Tensor pos = positions.contiguous();
  if (q.scalar_type() == at::kFloat) {
    rotary_rows<float>(q, k, pos.data_ptr<int64_t>(), cos.data_ptr<float>(), sin.data_ptr<float>(), width);
  } else {
    rotary_rows<BFloat16>(q, k, pos.data_ptr<int64_t>(), cos.data_ptr<float>(), sin.data_ptr<float>(), width);
  }
}

// ---- KV-cache write: cache[slot[t]] = k[t], v[t] (both caches in one call) ----

void copy_rows(const at::Tensor& src, const at::Tensor& cache, const int64_t* slots) {
  const int64_t tokens = src.size(0), heads = src.size(1), d = src.size(2);
  const int64_t bytes = d * src.element_size();
  const auto* sp = static_cast<const char*>(src.data_ptr());
  auto* cp = static_cast<char*>(cache.data_ptr());
  const int64_t s0 = src.stride(0) * src.element_size(), s1 = src.stride(1) * src.element_size();
  for (int64_t t = 0; t < tokens; ++t)
    for (int64_t h = 0; h < heads; ++h)
      std::memcpy(cp + (slots[t] * heads + h) * bytes, sp + t * s0 + h * s1, bytes);
}

void write_kv(const at::Tensor& k, const at::Tensor& v, const at::Tensor& k_cache, const at::Tensor& v_cache,
              const at::Tensor& slot_mapping) {
  check_heads(k, "k");
  check_heads(v, "v");
  TORCH_CHECK_VALUE(v.sizes() == k.sizes() && v.scalar_type() == k.scalar_type(), "v: must have k's shape ",
                    k.sizes(), " and dtype, got ", v.sizes(), " ", v.scalar_type());
  const int64_t row = k.size(1) * k.size(2);
  for (const auto& [c, name] : {std::pair{&k_cache, "k_cache"}, std::pair{&v_cache, "v_cache"}}) {
    check_cpu(*c, name);
    TORCH_CHECK_VALUE(c->scalar_type() == k.scalar_type() && c->is_contiguous() && row > 0 && c->numel() % row == 0,
                      name, ": needs a contiguous ", k.scalar_type(), " cache of whole [", k.size(1), ", ",
                      k.size(2), "] slots, got ", c->scalar_type(), " ", c->sizes());
  }
  TORCH_CHECK_VALUE(v_cache.numel() == k_cache.numel(), "v_cache: must have k_cache's ", k_cache.numel(),
                    " elements, got ", v_cache.numel());
  check_slots(slot_mapping, k.size(0), k_cache.numel() / row, "slot_mapping");
  const at::Tensor slots = slot_mapping.contiguous();
  copy_rows(k, k_cache, slots.data_ptr<int64_t>());
  copy_rows(v, v_cache, slots.data_ptr<int64_t>());
}

}  // namespace

TORCH_LIBRARY(raylm_fused, m) {
  m.def("rms_norm", &rms_norm);
  m.def("add_rms_norm", &add_rms_norm);
  m.def("silu_and_mul", &silu_and_mul);
  m.def("rotary_(Tensor(a!) q, Tensor(b!) k, Tensor positions, Tensor cos, Tensor sin) -> ()", &rotary_);
  m.def("write_kv(Tensor k, Tensor v, Tensor(a!) k_cache, Tensor(b!) v_cache, Tensor slot_mapping) -> ()",
        &write_kv);
}
