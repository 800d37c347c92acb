// Op table entries of 8-bit block-wise optimizer state (Dettmers et al. 2021, "8-bit
// Optimizers via Block-wise Quantization"; bitsandbytes' blockwise 8-bit Adam):
//   BlockwiseQuantize8bit    x -> (codes u8[n], absmax f32[ceil(n/256)])
//   BlockwiseDequantize8bit  (codes, absmax) -> f32[n]
//   AdamW8bitUpdate          one fused step per parameter: dequantize both moments,
//                            the torch.optim.AdamW update, requantize.
// and create_dynamic_map (bitsandbytes.functional.create_dynamic_map). The quantization
// map is an ordinary f32[256] input (an initializer in training graphs), so the IR dump
// shows which map each moment uses. The eager kernels are in runtime/kernels/optim8bit.cpp.
#include "ir/ops/optim8bit.h"

#include <algorithm>
#include <cmath>

#include "ir/op_table.h"

namespace kiln::ir {

std::vector<float> create_dynamic_map(bool signed_map, int max_exponent_bits, int total_bits) {
  // Follows bitsandbytes exactly, including its quirk that non_sign_bits is
  // total_bits - 1 for signed and unsigned maps alike; arithmetic in float64, each
  // entry rounded to f32 (torch computes in f32: entries agree within 2 ulp).
  std::vector<double> data;
  const int non_sign_bits = total_bits - 1;
  const int additional_items = (1 << std::max(0, non_sign_bits - max_exponent_bits)) - 1;
  auto add_means = [&](int items, double scale) {
    // midpoints of linspace(0.1, 1, items + 1)
    for (int k = 0; k < items; ++k) {
      double a = 0.1 + 0.9 * k / items, b = 0.1 + 0.9 * (k + 1) / items;
      double m = (a + b) / 2.0;
      data.push_back(scale * m);
      if (signed_map) data.push_back(-scale * m);
    }
  };
  int i = 0;
  for (i = 0; i < max_exponent_bits; ++i) {
    int fraction_items = signed_map ? (1 << (i + non_sign_bits - max_exponent_bits)) + 1
                                    : (1 << (i + non_sign_bits - max_exponent_bits + 1)) + 1;
    add_means(fraction_items - 1, std::pow(10.0, -(max_exponent_bits - 1) + i));
  }
  if (additional_items > 0) add_means(additional_items, std::pow(10.0, -(max_exponent_bits - 1) + (i - 1)));
  data.push_back(0.0);
  data.push_back(1.0);
  while (data.size() < static_cast<size_t>(kQuantMapSize)) data.push_back(0.0);
  std::sort(data.begin(), data.end());
  std::vector<float> out(data.size());
  for (size_t k = 0; k < data.size(); ++k) out[k] = static_cast<float>(data[k]);
  return out;
}

namespace {

Status expect_type(const InferContext& c, int i, DType dt, int rank, const char* what) {
  if (!c.has_input(i)) return c.fail(std::string("missing input ") + what);
  const TypeInfo& t = c.in[i];
  if (t.dtype != dt) return c.fail(std::string(what) + " must be " + dtype_name(dt) + ", got " + dtype_name(t.dtype));
  if (rank >= 0 && t.shape.rank() != rank)
    return c.fail(std::string(what) + " must have rank " + std::to_string(rank) + ", got shape " + t.shape.to_string());
  return Status::ok();
}

Status expect_qmap(const InferContext& c, int i, const char* what) {
  KILN_RETURN_IF_ERROR(expect_type(c, i, DType::f32, 1, what));
  const Dim& d = c.in[i].shape.dims[0];
  if (d.is_static() && d.value != kQuantMapSize)
    return c.fail(std::string(what) + " must have " + std::to_string(kQuantMapSize) + " entries, got " +
                  c.in[i].shape.to_string());
  return Status::ok();
}

Expected<int64_t> blocksize_of(const InferContext& c) {
  int64_t b = c.attrs().get_int("blocksize", kBlockSize8bit);
  if (b <= 0) return c.fail("blocksize must be > 0, got " + std::to_string(b));
  return b;
}

/// Checks that codes (u8[n]) and absmax (f32[ceil(n/blocksize)]) agree with n elements.
Status expect_state(const InferContext& c, int codes, int absmax, int64_t n, int64_t bs, const char* what) {
  KILN_RETURN_IF_ERROR(expect_type(c, codes, DType::u8, 1, what));
  KILN_RETURN_IF_ERROR(expect_type(c, absmax, DType::f32, 1, what));
  const Dim& dn = c.in[codes].shape.dims[0];
  const Dim& db = c.in[absmax].shape.dims[0];
  if (n >= 0 && dn.is_static() && dn.value != n)
    return c.fail(std::string(what) + " codes have " + std::to_string(dn.value) + " elements, the parameter " +
                  std::to_string(n));
  if (dn.is_static() && db.is_static() && db.value != num_blocks_8bit(dn.value, bs))
    return c.fail(std::string(what) + " absmax has " + std::to_string(db.value) + " entries, expected ceil(" +
                  std::to_string(dn.value) + "/" + std::to_string(bs) +
                  ") = " + std::to_string(num_blocks_8bit(dn.value, bs)));
  return Status::ok();
}

Status infer_quantize(InferContext& c) {
  KILN_ASSIGN_OR_RETURN(int64_t bs, blocksize_of(c));
  KILN_RETURN_IF_ERROR(expect_type(c, 0, DType::f32, -1, "x"));
  KILN_RETURN_IF_ERROR(expect_qmap(c, 1, "qmap"));
  int64_t n = c.in[0].shape.numel();
  if (n < 0) return c.fail("x needs a static shape, got " + c.in[0].shape.to_string());
  c.out[0] = {DType::u8, Shape::of({n})};
  c.out[1] = {DType::f32, Shape::of({num_blocks_8bit(n, bs)})};
  return Status::ok();
}

Status infer_dequantize(InferContext& c) {
  KILN_ASSIGN_OR_RETURN(int64_t bs, blocksize_of(c));
  KILN_RETURN_IF_ERROR(expect_state(c, 0, 1, -1, bs, "state"));
  KILN_RETURN_IF_ERROR(expect_qmap(c, 2, "qmap"));
  c.out[0] = {DType::f32, c.in[0].shape};
  return Status::ok();
}

Status infer_adamw8bit(InferContext& c) {
  KILN_ASSIGN_OR_RETURN(int64_t bs, blocksize_of(c));
  KILN_RETURN_IF_ERROR(expect_type(c, 0, DType::f32, -1, "param"));
  KILN_RETURN_IF_ERROR(expect_type(c, 1, DType::f32, -1, "grad"));
  if (!(c.in[1].shape == c.in[0].shape))
    return c.fail("grad shape " + c.in[1].shape.to_string() + " differs from param shape " + c.in[0].shape.to_string());
  int64_t n = c.in[0].shape.numel();
  if (n < 0) return c.fail("param needs a static shape, got " + c.in[0].shape.to_string());
  KILN_RETURN_IF_ERROR(expect_state(c, 2, 3, n, bs, "exp_avg"));
  KILN_RETURN_IF_ERROR(expect_state(c, 4, 5, n, bs, "exp_avg_sq"));
  KILN_RETURN_IF_ERROR(expect_qmap(c, 6, "qmap_signed"));
  KILN_RETURN_IF_ERROR(expect_qmap(c, 7, "qmap_unsigned"));
  KILN_RETURN_IF_ERROR(expect_type(c, 8, DType::f32, 0, "lr"));
  KILN_RETURN_IF_ERROR(expect_type(c, 9, DType::f32, 0, "step_size"));
  KILN_RETURN_IF_ERROR(expect_type(c, 10, DType::f32, 0, "sqrt_bias_correction2"));
  if (c.has_input(11)) KILN_RETURN_IF_ERROR(expect_type(c, 11, DType::f32, 0, "clip_coef"));
  const double b1 = c.attrs().get_float("beta1", 0.9), b2 = c.attrs().get_float("beta2", 0.999);
  if (!(b1 >= 0 && b1 < 1) || !(b2 >= 0 && b2 < 1)) return c.fail("beta1 and beta2 must be in [0, 1)");
  c.out[0] = c.in[0];
  c.out[1] = c.in[2];
  c.out[2] = c.in[3];
  c.out[3] = c.in[4];
  c.out[4] = c.in[5];
  return Status::ok();
}

double numel_or0(const Value* v) { return v && v->shape.numel() > 0 ? static_cast<double>(v->shape.numel()) : 0; }

}  // namespace

void register_optim8bit_ops(OpTable& t) {
  {
    OpDef d = make_op("BlockwiseQuantize8bit",
                      "kiln: block-wise 8-bit quantization (Dettmers et al. 2021): absmax per block of `blocksize` "
                      "elements, each element the nearest entry of the sorted f32[256] map to x/absmax",
                      2, 2, infer_quantize, PrecisionPolicy::fp32, FusionClass::reduction);
    d.min_outputs = d.max_outputs = 2;
    d.attrs = {{"blocksize", AttrKind::i, false}};
    d.onnx = false;
    d.cost = [](const Node& n) {
      const double e = numel_or0(n.input(0));
      // |x|, max, divide, 8 binary-search compares + 1 neighbour compare per element
      return Cost{e * 12, e * 4 + e + 4 * num_blocks_8bit(static_cast<int64_t>(e)) + kQuantMapSize * 4};
    };
    t.add(std::move(d));  // not differentiable: rounding to a code has no useful gradient
  }
  {
    OpDef d = make_op("BlockwiseDequantize8bit",
                      "kiln: block-wise 8-bit dequantization (Dettmers et al. 2021): y_i = qmap[codes_i] * "
                      "absmax[i / blocksize]",
                      3, 3, infer_dequantize, PrecisionPolicy::fp32, FusionClass::pointwise);
    d.attrs = {{"blocksize", AttrKind::i, false}};
    d.onnx = false;
    d.cost = [](const Node& n) {
      const double e = numel_or0(n.input(0));
      return Cost{e, e + e * 4 + 4 * numel_or0(n.input(1)) + kQuantMapSize * 4};
    };
    t.add(std::move(d));
  }
  {
    OpDef d =
        make_op("AdamW8bitUpdate",
                "kiln: fused 8-bit AdamW step (bitsandbytes blockwise Adam, Dettmers et al. 2021): dequantize exp_avg "
                "(signed map) and exp_avg_sq (unsigned map), g = grad * clip_coef, torch.optim.AdamW update with "
                "decoupled weight decay, requantize both moments with fresh per-block absmax",
                11, 12, infer_adamw8bit, PrecisionPolicy::fp32, FusionClass::reduction);
    // inputs: param, grad, exp_avg.q8, exp_avg.absmax, exp_avg_sq.q8, exp_avg_sq.absmax, qmap_signed,
    //         qmap_unsigned, lr, step_size (= lr / (1 - beta1^t)), sqrt(1 - beta2^t), [clip_coef]
    // outputs: param', exp_avg.q8', exp_avg.absmax', exp_avg_sq.q8', exp_avg_sq.absmax'
    d.min_outputs = d.max_outputs = 5;
    d.attrs = {{"beta1", AttrKind::f, true},
               {"beta2", AttrKind::f, true},
               {"eps", AttrKind::f, true},
               {"weight_decay", AttrKind::f, false},
               {"blocksize", AttrKind::i, false}};
    d.onnx = false;
    d.multi_tensor = true;  // one launch with the step's other parameter updates
    // param', the codes and the absmax may be written into param, the codes and the absmax
    // (kiln_donate): each block reads them before it writes them (runtime/kernels/optim8bit.cpp).
    d.in_place_outputs = {0, 2, 3, 4, 5};
    d.cost = [](const Node& n) {
      const double e = numel_or0(n.input(0));
      const double blocks = numel_or0(n.input(3));
      // per element: ~16 flops of Adam + 2 x (divide + 9 compares) of requantization;
      // bytes: param r/w (8) + grad (4) + two codes r/w (4) + absmax r/w + both maps
      return Cost{e * 36, e * 16 + blocks * 16 + 2 * kQuantMapSize * 4};
    };
    t.add(std::move(d));  // not differentiable: an optimizer update is not part of the loss
  }
}

}  // namespace kiln::ir
