// The decoder-layer driver: a decode step's whole layer loop in one call (cpu_driver.py builds it
// and decides where it applies). Registered as torch.ops.raylm_driver.decode over a
// torch.classes.raylm_driver.Plan that holds the model's weights; the caches come with each call
// (a plan holding them would keep an unbound pool alive).
//
// It runs no arithmetic of its own: every op is the compiled kernel the Python path calls
// (raylm_fused's norms, rotary, cache write and SiLU-and-mul, raylm_gguf's int8 linear, raylm's
// paged decode attention), looked up once in torch's dispatcher and called in the order and on
// the tensors the Python layers use, so the result is bit for bit theirs. What it saves is the
// ~13 Python-to-C++ crossings per layer (about 400 a step on a 30-layer model) and the Python
// between them.
#include <ATen/core/Tensor.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/ops/empty.h>
#include <torch/custom_class.h>
#include <torch/library.h>

#include <cstdint>
#include <tuple>
#include <vector>

namespace {

using Tensor = at::Tensor;
using Pair = std::tuple<Tensor, Tensor>;

template <typename Sig>
c10::TypedOperatorHandle<Sig> op(const char* name) {
  return c10::Dispatcher::singleton().findSchemaOrThrow(name, "").typed<Sig>();
}

// The kernels, with the C++ signatures they were registered with (the dispatcher checks them).
struct Ops {
  c10::TypedOperatorHandle<Tensor(const Tensor&, const Tensor&, double)> rms_norm =
      op<Tensor(const Tensor&, const Tensor&, double)>("raylm_fused::rms_norm");
  c10::TypedOperatorHandle<Pair(const Tensor&, const Tensor&, const Tensor&, double)> add_rms_norm =
      op<Pair(const Tensor&, const Tensor&, const Tensor&, double)>("raylm_fused::add_rms_norm");
  c10::TypedOperatorHandle<Tensor(const Tensor&)> silu_and_mul =
      op<Tensor(const Tensor&)>("raylm_fused::silu_and_mul");
  using Five = void(const Tensor&, const Tensor&, const Tensor&, const Tensor&, const Tensor&);
  c10::TypedOperatorHandle<Five> rotary = op<Five>("raylm_fused::rotary_");
  c10::TypedOperatorHandle<Five> write_kv = op<Five>("raylm_fused::write_kv");
  using Paged = void(Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, double, int64_t, double, Tensor);
  c10::TypedOperatorHandle<Paged> paged_decode = op<Paged>("raylm::paged_decode");
  using Linear = Tensor(const Tensor&, const Tensor&, const Tensor&, const Tensor&, int64_t, int64_t);
  c10::TypedOperatorHandle<Linear> linear_packed = op<Linear>("raylm_gguf::linear_packed");
};

const Ops& ops() {
  static const Ops found;  // the three libraries are loaded before the first Plan is built
  return found;
}

// One GGUF weight as gguf_int8.cpp's `pack` left it: tiles, scales, mins, rows, block type.
struct Packed {
  Tensor codes, scales, mins;
  int64_t n, qtype;
  Tensor operator()(const Tensor& x) const {
    return ops().linear_packed.call(x, codes, scales, mins, n, qtype);
  }
};

struct Layer {
  Tensor input_norm, post_norm;
  Packed qkv, o, gate_up, down;
};

// Tensors per layer in the constructor's list, and ints (rows and block type per linear).
constexpr size_t kLayerTensors = 14, kLayerInts = 8;

struct Plan : torch::CustomClassHolder {
  std::vector<Layer> layers;
  Tensor final_norm, cos, sin, no_sinks;
  int64_t heads, kv_heads, head_dim;
  double eps, scale;

  // tensors: per layer [input norm, post-attention norm, then codes, scales, mins of qkv, o,
  // gate_up, down], then [final norm, cos, sin]; ints: per layer (rows,
  // qtype) of qkv, o, gate_up, down, then [heads, kv_heads, head_dim]; floats: [eps, scale].
  Plan(std::vector<Tensor> tensors, std::vector<int64_t> ints, std::vector<double> floats) {
    TORCH_CHECK_VALUE(tensors.size() >= 3 && (tensors.size() - 3) % kLayerTensors == 0,
                      "tensors: 14 per layer and 3 more, got ", tensors.size());
    const size_t n = (tensors.size() - 3) / kLayerTensors;
    TORCH_CHECK_VALUE(n >= 1 && ints.size() == n * kLayerInts + 3 && floats.size() == 2,
                      "ints/floats: ", n * kLayerInts + 3, " and 2 expected, got ", ints.size(),
                      " and ", floats.size());
    for (size_t i = 0; i < n; ++i) {
      const Tensor* t = tensors.data() + i * kLayerTensors;
      const int64_t* k = ints.data() + i * kLayerInts;
      layers.push_back({t[0], t[1], {t[2], t[3], t[4], k[0], k[1]}, {t[5], t[6], t[7], k[2], k[3]},
                        {t[8], t[9], t[10], k[4], k[5]}, {t[11], t[12], t[13], k[6], k[7]}});
    }
    final_norm = tensors[n * kLayerTensors];
    cos = tensors[n * kLayerTensors + 1];
    sin = tensors[n * kLayerTensors + 2];
    heads = ints[n * kLayerInts];
    kv_heads = ints[n * kLayerInts + 1];
    head_dim = ints[n * kLayerInts + 2];
    TORCH_CHECK_VALUE(heads >= 1 && kv_heads >= 1 && head_dim >= 1, "heads, kv_heads, head_dim: ",
                      "must be positive, got ", heads, ", ", kv_heads, ", ", head_dim);
    eps = floats[0];
    scale = floats[1];
    no_sinks = at::empty({0}, final_norm.options().dtype(at::kFloat));
    ops();  // fail here, not mid-step, if a kernel library is missing
  }

  // LlamaAttention.forward and Attention.forward: qkv, rotary in place, cache write, paged
  // attention over the cache, o_proj (q, k and v are views into the qkv output, as there).
  Tensor attention(const Layer& l, const Tensor& kc, const Tensor& vc, const Tensor& h,
                   const Tensor& positions, const Tensor& slots, const Tensor& tables,
                   const Tensor& seq_lens) const {
    const Tensor qkv = l.qkv(h);
    const int64_t t = qkv.size(0), width = qkv.size(1), d = head_dim;
    const int64_t at0 = qkv.storage_offset();
    const Tensor q = qkv.as_strided({t, heads, d}, {width, d, 1}, at0);
    const Tensor k = qkv.as_strided({t, kv_heads, d}, {width, d, 1}, at0 + heads * d);
    const Tensor v = qkv.as_strided({t, kv_heads, d}, {width, d, 1}, at0 + (heads + kv_heads) * d);
    ops().rotary.call(q, k, positions, cos, sin);
    ops().write_kv.call(k, v, kc, vc, slots);
    Tensor out = at::empty({t, heads, d}, h.options());
    ops().paged_decode.call(out, q, kc, vc, tables, seq_lens, scale, 0, 0.0, no_sinks);
    return l.o(out.view({t, heads * d}));
  }

  // PreNormBlock.forward over every layer, then the final norm (run_stage's last stage); caches:
  // each layer's k_cache and v_cache.
  Tensor run(at::TensorList caches, const Tensor& x0, const Tensor& positions, const Tensor& slots,
             const Tensor& tables, const Tensor& seq_lens) const {
    TORCH_CHECK_VALUE(caches.size() == 2 * layers.size(), "caches: 2 per layer (",
                      2 * layers.size(), ") expected, got ", caches.size());
    TORCH_CHECK_VALUE(x0.dim() == 2 && x0.is_contiguous() && x0.scalar_type() == at::kFloat &&
                          x0.size(1) == final_norm.size(0),
                      "x: contiguous float32 [tokens, ", final_norm.size(0), "] expected, got ",
                      x0.scalar_type(), " ", x0.sizes());
    const Ops& k = ops();
    Tensor x = x0, residual, h;
    for (size_t i = 0; i < layers.size(); ++i) {
      const Layer& l = layers[i];
      if (i == 0) {  // first_norm: the embedding is the first residual
        h = k.rms_norm.call(x, l.input_norm, eps);
        residual = x;
      } else {
        std::tie(h, residual) = k.add_rms_norm.call(x, residual, l.input_norm, eps);
      }
      x = attention(l, caches[2 * i], caches[2 * i + 1], h, positions, slots, tables, seq_lens);
      std::tie(h, residual) = k.add_rms_norm.call(x, residual, l.post_norm, eps);
      x = l.down(k.silu_and_mul.call(l.gate_up(h)));
    }
    return std::get<0>(k.add_rms_norm.call(x, residual, final_norm, eps));
  }
};

Tensor decode(const c10::intrusive_ptr<Plan>& plan, at::TensorList caches, const Tensor& x,
              const Tensor& positions, const Tensor& slots, const Tensor& tables,
              const Tensor& seq_lens) {
  return plan->run(caches, x, positions, slots, tables, seq_lens);
}

}  // namespace

TORCH_LIBRARY(raylm_driver, m) {
  m.class_<Plan>("Plan").def(
      torch::init<std::vector<Tensor>, std::vector<int64_t>, std::vector<double>>());
  m.def("decode", &decode);
}
