// Import-time lowerings of ONNX ops into ops of kiln's table (see onnx_lower.h).
#include "frontend/onnx_lower.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <set>

#include "ir/op_table.h"

namespace kiln::frontend {

using ir::Attributes;
using ir::DType;
using ir::Tensor;
using ir::Value;

namespace {

Attributes attrs_of(std::initializer_list<std::pair<const char*, ir::AttrValue>> kv) {
  Attributes a;
  for (auto& [k, v] : kv) a.set(k, v);
  return a;
}

int rank_of(const Value* v) { return v ? v->shape.rank() : -1; }

/// Static extent of dim d (negative counts from the end) of `v`, or -1.
int64_t static_dim(const Value* v, int d) {
  const int r = v->shape.rank();
  if (d < 0) d += r;
  if (d < 0 || d >= r || !v->shape.dims[d].is_static()) return -1;
  return v->shape.dims[d].value;
}

/// The constant integer contents of v, if it is an initializer.
bool const_ints(const Value* v, std::vector<int64_t>& out) {
  if (!v || !v->data) return false;
  out = v->data->to_i64_vector();
  return true;
}

Value* cast_to(LowerContext& c, Value* v, DType to) {
  if (v->dtype == to) return v;
  return c.emit1("Cast", {v}, attrs_of({{"to", static_cast<int64_t>(ir::dtype_to_onnx(to))}}));
}

Value* transpose(LowerContext& c, Value* v, std::vector<int64_t> perm) {
  bool identity = true;
  for (size_t i = 0; i < perm.size(); ++i) identity = identity && perm[i] == static_cast<int64_t>(i);
  if (identity) return v;
  return c.emit1("Transpose", {v}, attrs_of({{"perm", perm}}));
}

Value* reshape(LowerContext& c, Value* v, const std::vector<int64_t>& shape, const std::string& out = "") {
  return c.emit1("Reshape", {v, c.const_i64(shape)}, {}, out);
}

/// dim `d` of v as a 1-element i64 value (a constant when static, else Shape -> Gather).
Value* dim_value(LowerContext& c, Value* v, int d) {
  const int64_t s = static_dim(v, d);
  if (s >= 0) return c.const_i64({s});
  const int r = v->shape.rank();
  if (d < 0) d += r;
  Value* shape = c.emit1("Shape", {v});
  return c.emit1("Gather", {shape, c.const_i64({d})}, attrs_of({{"axis", int64_t(0)}}));
}

// ------------------------------------------------------------------ RMSNormalization-23

/// ONNX's function body: XU = Cast(X, stash_type); Y = Cast(XU / sqrt(mean(XU*XU over
/// [axis, r)) + epsilon), X's dtype) * scale.
Status lower_rms_normalization(LowerContext& c) {
  Value* x = c.input(0);
  Value* scale = c.input(1);
  if (!x || !scale) return c.fail("needs inputs X and scale");
  const int r = rank_of(x);
  if (r < 1) return c.fail("X needs a known rank >= 1");
  int64_t axis = c.attrs().get_int("axis", -1);
  if (axis < -r || axis >= r)
    return c.fail("axis " + std::to_string(axis) + " out of range for rank " + std::to_string(r));
  if (axis < 0) axis += r;
  const int64_t stash = c.attrs().get_int("stash_type", 1);
  auto stash_dt = ir::dtype_from_onnx(static_cast<int>(stash));
  if (!stash_dt || !ir::is_float(*stash_dt))
    return c.fail("stash_type " + std::to_string(stash) + " is not a float type");
  const double eps = c.attrs().get_float("epsilon", 1e-5);
  std::vector<int64_t> axes;
  for (int64_t a = axis; a < r; ++a) axes.push_back(a);
  Value* xu = cast_to(c, x, *stash_dt);
  Value* mean =
      c.emit1("ReduceMean", {c.emit1("Mul", {xu, xu}), c.const_i64(axes)}, attrs_of({{"keepdims", int64_t(1)}}));
  Value* rms = c.emit1("Sqrt", {c.emit1("Add", {mean, c.scalar(eps, *stash_dt)})});
  Value* normalized = cast_to(c, c.emit1("Div", {xu, rms}), x->dtype);
  c.emit1("Mul", {normalized, scale}, {}, c.output_name(0));
  return Status::ok();
}

// ------------------------------------------------------------------ RotaryEmbedding-23

/// ONNX's reference (onnx/reference/ops/op_rotary_embedding.py), op for op.
Status lower_rotary_embedding(LowerContext& c) {
  Value* x = c.input(0);
  Value* cos = c.input(1);
  Value* sin = c.input(2);
  Value* pos = c.input(3);
  if (!x || !cos || !sin) return c.fail("needs inputs X, cos_cache and sin_cache");
  const int r = rank_of(x);
  if (r != 3 && r != 4) return c.fail("X must have rank 3 or 4, got " + x->shape.to_string());
  const int64_t interleaved = c.attrs().get_int("interleaved", 0);
  Value* xt;  // (B, S, H, Dh)
  if (r == 4) {
    xt = transpose(c, x, {0, 2, 1, 3});
  } else {
    const int64_t heads = c.attrs().get_int("num_heads", 0);
    if (heads <= 0) return c.fail("num_heads must be given for a 3-D input");
    xt = reshape(c, x, {0, 0, heads, -1});
  }
  // The head size need not be known at import (it often comes from shape computations
  // folded later): slices run to the end of the dim, halves come from an equal Split.
  constexpr int64_t kEnd = std::numeric_limits<int64_t>::max();
  const int64_t rd = c.attrs().get_int("rotary_embedding_dim", 0);  // 0: the whole head
  if (rd < 0 || rd % 2) return c.fail("rotary_embedding_dim " + std::to_string(rd) + " must be even and >= 0");
  const int64_t dh = static_dim(xt, 3);
  if (rd > 0 && dh > 0 && rd > dh)
    return c.fail("rotary_embedding_dim " + std::to_string(rd) + " exceeds the head size " + std::to_string(dh));
  const bool partial = rd > 0 && rd != dh;
  auto slice = [&](Value* v, int64_t b, int64_t e, int64_t step) {
    return c.emit1("Slice", {v, c.const_i64({b}), c.const_i64({e}), c.const_i64({3}), c.const_i64({step})});
  };
  Value* x_rot = partial ? slice(xt, 0, rd, 1) : xt;
  if (pos) {
    cos = c.emit1("Gather", {cos, pos}, attrs_of({{"axis", int64_t(0)}}));
    sin = c.emit1("Gather", {sin, pos}, attrs_of({{"axis", int64_t(0)}}));
  }
  cos = c.emit1("Unsqueeze", {cos, c.const_i64({2})});  // (B, S, 1, rd/2)
  sin = c.emit1("Unsqueeze", {sin, c.const_i64({2})});
  Value *x1, *x2;
  if (interleaved) {
    x1 = slice(x_rot, 0, kEnd, 2);
    x2 = slice(x_rot, 1, kEnd, 2);
  } else {
    auto halves = c.emit("Split", {x_rot}, 2, attrs_of({{"axis", int64_t(3)}, {"num_outputs", int64_t(2)}}));
    x1 = halves[0];
    x2 = halves[1];
  }
  Value* real = c.emit1("Sub", {c.emit1("Mul", {cos, x1}), c.emit1("Mul", {sin, x2})});
  Value* imag = c.emit1("Add", {c.emit1("Mul", {sin, x1}), c.emit1("Mul", {cos, x2})});
  Value* rotated;
  if (interleaved) {
    Value* re = c.emit1("Unsqueeze", {real, c.const_i64({-1})});
    Value* im = c.emit1("Unsqueeze", {imag, c.const_i64({-1})});
    rotated = reshape(c, c.emit1("Concat", {re, im}, attrs_of({{"axis", int64_t(-1)}})), {0, 0, 0, -1});
  } else {
    rotated = c.emit1("Concat", {real, imag}, attrs_of({{"axis", int64_t(-1)}}));
  }
  Value* y =
      partial ? c.emit1("Concat", {rotated, slice(xt, rd, kEnd, 1)}, attrs_of({{"axis", int64_t(-1)}})) : rotated;
  if (r == 4)
    c.emit1("Transpose", {y}, attrs_of({{"perm", std::vector<int64_t>{0, 2, 1, 3}}}), c.output_name(0));
  else
    reshape(c, y, {0, 0, -1}, c.output_name(0));
  return Status::ok();
}

// ------------------------------------------------------------------ Attention-23/24/25

/// (1, Sq, Skv)-shaped i64 grids i (query index) and j (key index) of the scores of
/// `qk` (B, H, Sq, Skv): i as (Sq, 1), j as (1, Skv).
void index_grids(LowerContext& c, Value* qk, Value*& i, Value*& j) {
  auto range = [&](int d) {
    Value* n = c.emit1("Squeeze", {dim_value(c, qk, d), c.const_i64({0})});
    return c.emit1("Range", {c.scalar(0, DType::i64), n, c.scalar(1, DType::i64)});
  };
  i = c.emit1("Unsqueeze", {range(2), c.const_i64({1})});
  j = c.emit1("Unsqueeze", {range(3), c.const_i64({0})});
}

/// Where(allowed, 0, -inf) in dtype dt.
Value* bias_of(LowerContext& c, Value* allowed, DType dt) {
  return c.emit1("Where", {allowed, c.scalar(0, dt), c.scalar(-std::numeric_limits<double>::infinity(), dt)});
}

Status lower_attention(LowerContext& c) {
  Value* q = c.input(0);
  Value* k = c.input(1);
  Value* v = c.input(2);
  Value* mask = c.input(3);
  Value* past_k = c.input(4);
  Value* past_v = c.input(5);
  Value* nonpad = c.input(6);
  if (!q || !k || !v) return c.fail("needs inputs Q, K and V");
  const Attributes& a = c.attrs();
  const int r = rank_of(q);
  if (r != 3 && r != 4) return c.fail("Q must have rank 3 or 4, got " + q->shape.to_string());
  if (rank_of(k) != r || rank_of(v) != r) return c.fail("Q, K and V must have the same rank");
  if ((past_k == nullptr) != (past_v == nullptr)) return c.fail("past_key and past_value must be given together");
  if (nonpad && past_k) return c.fail("nonpad_kv_seqlen cannot be combined with past_key/past_value");
  const DType dt = q->dtype;
  if (!ir::is_float(dt)) return c.fail("Q must be a float tensor");
  int64_t hq, hkv;
  if (r == 3) {
    hq = a.get_int("q_num_heads", 0);
    hkv = a.get_int("kv_num_heads", 0);
    if (hq <= 0 || hkv <= 0) return c.fail("q_num_heads and kv_num_heads must be given for 3-D inputs");
    auto heads = [&](Value* x, int64_t h) { return transpose(c, reshape(c, x, {0, 0, h, -1}), {0, 2, 1, 3}); };
    q = heads(q, hq);
    k = heads(k, hkv);
    v = heads(v, hkv);
  } else {
    if (a.has("q_num_heads") || a.has("kv_num_heads"))
      return c.fail("q_num_heads and kv_num_heads must not be given for 4-D inputs");
    hq = static_dim(q, 1);  // -1 when not known at import (then decided at run time)
    hkv = static_dim(k, 1);
  }
  if (hq > 0 && hkv > 0 && hq % hkv)
    return c.fail("q heads (" + std::to_string(hq) + ") must be a multiple of kv heads (" + std::to_string(hkv) + ")");
  if (past_k) {
    k = c.emit1("Concat", {past_k, k}, attrs_of({{"axis", int64_t(2)}}));
    v = c.emit1("Concat", {past_v, v}, attrs_of({{"axis", int64_t(2)}}));
  }
  if (c.has_output(1)) KILN_RETURN_IF_ERROR(c.define_output(1, k));
  if (c.has_output(2)) KILN_RETURN_IF_ERROR(c.define_output(2, v));
  // Q and K are each scaled by sqrt(scale) rounded to Q's dtype, scale defaulting to
  // 1/sqrt(head size) (the function body; computed in double as the reference does).
  Value* s;
  const int64_t d = static_dim(q, 3);
  if (a.has("scale") || d > 0) {
    const double scale = a.has("scale") ? a.get_float("scale", 1.0) : 1.0 / std::sqrt(static_cast<double>(d));
    s = c.scalar(std::sqrt(scale), dt);
  } else {  // the head size is known after shape folding: the same double ops, folded then
    Value* hd = cast_to(c, c.emit1("Squeeze", {dim_value(c, q, 3), c.const_i64({0})}), DType::f64);
    s = cast_to(c, c.emit1("Sqrt", {c.emit1("Reciprocal", {c.emit1("Sqrt", {hd})})}), dt);
  }
  Value* qs = c.emit1("Mul", {q, s});
  Value* ks = c.emit1("Mul", {k, s});
  if (hq < 0 || hkv < 0 || hq != hkv) {
    // Grouped-query attention: each kv head serves hq / hkv consecutive q heads
    // (np.repeat along the head axis); with head counts unknown at import the repeat
    // factor is computed (1 when they are equal: a no-op removed after folding).
    Value* g = (hq > 0 && hkv > 0) ? c.const_i64({hq / hkv}) : c.emit1("Div", {dim_value(c, q, 1), dim_value(c, k, 1)});
    Value* hq_v = hq > 0 ? c.const_i64({hq}) : dim_value(c, q, 1);
    auto repeat = [&](Value* x) {
      Value* shape5 =
          c.emit1("Concat", {c.const_i64({1, 1}), g, c.const_i64({1, 1})}, attrs_of({{"axis", int64_t(0)}}));
      Value* e = c.emit1("Expand", {c.emit1("Unsqueeze", {x, c.const_i64({2})}), shape5});
      Value* shape4 = c.emit1("Concat", {c.const_i64({0}), hq_v, c.const_i64({-1}), dim_value(c, x, 3)},
                              attrs_of({{"axis", int64_t(0)}}));
      return c.emit1("Reshape", {e, shape4});
    };
    ks = repeat(ks);
    v = repeat(v);
  }
  Value* qk = c.emit1("MatMul", {qs, transpose(c, ks, {0, 1, 3, 2})});  // (B, Hq, Sq, Skv)
  const int64_t mode = a.get_int("qk_matmul_output_mode", 0);
  Value* qk_out = qk;
  const double softcap = a.get_float("softcap", 0.0);
  if (softcap > 0) {
    Value* sc = c.scalar(softcap, dt);
    qk = c.emit1("Mul", {c.emit1("Tanh", {c.emit1("Div", {qk, sc})}), sc});
    if (mode == 1) qk_out = qk;
  }
  // The additive bias: the mask (bool -> 0 / -inf; float added), the causal frontier and
  // the windows at offset past_len (past_key), nonpad - Sq per batch, or 0; padded keys.
  Value* bias = nullptr;
  auto add_bias = [&](Value* b) { bias = bias ? c.emit1("Add", {bias, b}) : b; };
  if (mask) {
    // bool or a float type (ONNX's U); -inf in an integer dtype was undefined behavior
    // (found by fuzz/ onnx under UBSan).
    if (mask->dtype != DType::boolean && !ir::is_float(mask->dtype))
      return c.fail("attn_mask must be a bool or float tensor, not " + std::string(ir::dtype_name(mask->dtype)));
    const int64_t skv = static_dim(k, 2), ml = static_dim(mask, -1);
    const int mr = rank_of(mask);
    if (mr < 1) return c.fail("attn_mask needs a known rank >= 1");
    if (!(skv > 0 && ml > 0 && ml == skv)) {
      // A mask shorter than the keys is padded with "not attended" (Attention-24); the
      // pad width is computed when not known at import (0 after folding: a no-op).
      Value* width = c.emit1("Sub", {dim_value(c, k, 2), dim_value(c, mask, -1)});
      Value* pads = c.emit1("Concat", {c.const_i64(std::vector<int64_t>(2 * static_cast<size_t>(mr) - 1, 0)), width},
                            attrs_of({{"axis", int64_t(0)}}));
      Value* fill = mask->dtype == DType::boolean ? c.constant(Tensor(DType::boolean, {}))
                                                  : c.scalar(-std::numeric_limits<double>::infinity(), mask->dtype);
      mask = c.emit1("Pad", {mask, pads, fill});
    }
    add_bias(mask->dtype == DType::boolean ? bias_of(c, mask, dt) : mask);
  }
  const bool causal = a.get_int("is_causal", 0) != 0;
  const int64_t left = a.get_int("left_window_size", -1), right = a.get_int("right_window_size", -1);
  if (causal || left >= 0 || right >= 0 || nonpad) {
    Value *i, *j;
    index_grids(c, qk, i, j);
    Value* p = i;  // the query's absolute position: i + offset
    if (past_k) {
      p = c.emit1("Add", {i, dim_value(c, past_k, 2)});
    } else if (nonpad) {  // (B, 1, 1, 1) offsets
      Value* off = c.emit1("Sub", {cast_to(c, nonpad, DType::i64), dim_value(c, q, 2)});
      p = c.emit1("Add", {i, reshape(c, off, {-1, 1, 1, 1})});
    }
    Value* allowed = nullptr;
    auto both = [&](Value* x) { allowed = allowed ? c.emit1("And", {allowed, x}) : x; };
    if (causal) both(c.emit1("LessOrEqual", {j, p}));
    if (left >= 0)
      both(c.emit1("LessOrEqual", {c.emit1("Sub", {p, j}), c.scalar(static_cast<double>(left), DType::i64)}));
    if (right >= 0)
      both(c.emit1("LessOrEqual", {c.emit1("Sub", {j, p}), c.scalar(static_cast<double>(right), DType::i64)}));
    if (allowed) add_bias(bias_of(c, allowed, dt));
    if (nonpad) {  // keys at or past nonpad[b] are padding
      Value* n = reshape(c, cast_to(c, nonpad, DType::i64), {-1, 1, 1, 1});
      add_bias(bias_of(c, c.emit1("Less", {j, n}), dt));
    }
  }
  if (bias) qk = c.emit1("Add", {qk, bias});
  if (mode == 2) qk_out = qk;
  DType sdt = dt;
  if (a.has("softmax_precision")) {
    auto p = ir::dtype_from_onnx(static_cast<int>(a.get_int("softmax_precision", 1)));
    if (!p || !ir::is_float(*p)) return c.fail("softmax_precision must be a float type");
    sdt = *p;
  }
  Value* probs = c.emit1("Softmax", {cast_to(c, qk, sdt)}, attrs_of({{"axis", int64_t(-1)}}));
  if (bias) {  // a query row with every key masked gives zeros, not NaN (decided on the bias)
    Value* mx = c.emit1("ReduceMax", {bias, c.const_i64({-1})}, attrs_of({{"keepdims", int64_t(1)}}));
    Value* none = c.emit1("Equal", {mx, c.scalar(-std::numeric_limits<double>::infinity(), bias->dtype)});
    probs = c.emit1("Where", {none, c.scalar(0, sdt), probs});
  }
  probs = cast_to(c, probs, dt);
  if (mode == 3) qk_out = probs;
  if (mode < 0 || mode > 3) return c.fail("qk_matmul_output_mode must be 0..3");
  if (c.has_output(3)) KILN_RETURN_IF_ERROR(c.define_output(3, qk_out));
  Value* y = c.emit1("MatMul", {probs, v}, {}, r == 4 ? c.output_name(0) : "");  // (B, Hq, Sq, Dv)
  if (r == 3) reshape(c, transpose(c, y, {0, 2, 1, 3}), {0, 0, -1}, c.output_name(0));
  return Status::ok();
}

// ------------------------------------------------------------------ Einsum-12/28

/// An operand's labels: letters as their char code, ellipsis dims as 1000 + their
/// position counted from the right (so ellipsis dims of different operands align right).
using Labels = std::vector<int>;

Status parse_term(LowerContext& c, const std::string& term, int rank, Labels& out, int& ellipsis_rank) {
  out.clear();
  const size_t e = term.find("...");
  int letters = 0;
  for (char ch : term)
    if (std::isalpha(static_cast<unsigned char>(ch)))
      ++letters;
    else if (ch != '.')
      return c.fail("equation term '" + term + "' has character '" + std::string(1, ch) + "'");
  if (e == std::string::npos) {
    if (letters != rank && rank >= 0)
      return c.fail("equation term '" + term + "' has " + std::to_string(letters) + " letters for an operand of rank " +
                    std::to_string(rank));
    for (char ch : term) out.push_back(static_cast<unsigned char>(ch));
    return Status::ok();
  }
  if (term.find("...", e + 3) != std::string::npos) return c.fail("equation term '" + term + "' has two ellipses");
  const int er = rank - letters;
  if (er < 0)
    return c.fail("equation term '" + term + "' has more letters than the operand's rank " + std::to_string(rank));
  if (ellipsis_rank >= 0 && ellipsis_rank != er && rank >= 0)
    ellipsis_rank = std::max(ellipsis_rank, er);
  else if (ellipsis_rank < 0)
    ellipsis_rank = er;
  for (size_t i = 0; i < e; ++i) out.push_back(static_cast<unsigned char>(term[i]));
  for (int k = er; k > 0; --k) out.push_back(1000 + k);
  for (size_t i = e + 3; i < term.size(); ++i) out.push_back(static_cast<unsigned char>(term[i]));
  return Status::ok();
}

/// Sums the labels of `v` not in `keep` (ReduceSum, dims dropped).
Value* sum_out(LowerContext& c, Value* v, Labels& l, const std::set<int>& keep) {
  std::vector<int64_t> axes;
  Labels rest;
  for (size_t i = 0; i < l.size(); ++i) {
    if (keep.count(l[i]))
      rest.push_back(l[i]);
    else
      axes.push_back(static_cast<int64_t>(i));
  }
  if (axes.empty()) return v;
  l = rest;
  return c.emit1("ReduceSum", {v, c.const_i64(axes)}, attrs_of({{"keepdims", int64_t(0)}}));
}

/// The product of the static dims of `v` at positions [b, e), or -1 when one is not static.
int64_t group_size(const Value* v, size_t b, size_t e) {
  int64_t p = 1;
  for (size_t i = b; i < e; ++i) {
    const int64_t d = static_dim(v, static_cast<int>(i));
    if (d < 0) return -1;
    p *= d;
  }
  return p;
}

/// Contracts two operands: batch labels (in both, needed later) stay leading dims of a
/// batched MatMul, labels of one operand become its M (left) or N (right) dims, shared
/// labels not needed later are the K dim.
Status contract(LowerContext& c, Value*& a, Labels& la, Value* b, Labels lb, const std::set<int>& needed) {
  std::set<int> in_b(lb.begin(), lb.end()), in_a(la.begin(), la.end());
  std::set<int> keep_a = needed, keep_b = needed;
  keep_a.insert(lb.begin(), lb.end());
  keep_b.insert(la.begin(), la.end());
  a = sum_out(c, a, la, keep_a);
  b = sum_out(c, b, lb, keep_b);
  Labels batch, left, contr, right;
  for (int l : la) {
    if (in_b.count(l))
      (needed.count(l) ? batch : contr).push_back(l);
    else
      left.push_back(l);
  }
  for (int l : lb)
    if (!in_a.count(l)) right.push_back(l);
  auto perm_of = [](const Labels& from, const Labels& order) {
    std::vector<int64_t> p;
    for (int l : order) p.push_back(std::find(from.begin(), from.end(), l) - from.begin());
    return p;
  };
  Labels oa = batch, ob = batch;
  oa.insert(oa.end(), left.begin(), left.end());
  oa.insert(oa.end(), contr.begin(), contr.end());
  ob.insert(ob.end(), contr.begin(), contr.end());
  ob.insert(ob.end(), right.begin(), right.end());
  Value* ta = transpose(c, a, perm_of(la, oa));
  Value* tb = transpose(c, b, perm_of(lb, ob));
  const size_t nb = batch.size();
  auto flat = [&](Value* v, size_t g1, size_t g2, const char* what) -> Expected<Value*> {
    // v: batch dims, then group 1 (g1 dims), then group 2 (g2 dims) -> batch dims, G1, G2
    // (an empty group is a dim of 1).
    const int64_t s1 = group_size(v, nb, nb + g1), s2 = group_size(v, nb + g1, nb + g1 + g2);
    if (g1 == 1 && g2 == 1) return v;
    if (s1 < 0 && s2 < 0)
      return c.fail(std::string("the ") + what + " dims of the Einsum must be static to be flattened");
    std::vector<int64_t> shape(nb, 0);
    shape.push_back(s1 < 0 ? -1 : s1);
    shape.push_back(s2 < 0 ? -1 : s2);
    return reshape(c, v, shape);
  };
  // Empty groups are dims of size 1 (a MatMul needs both).
  KILN_ASSIGN_OR_RETURN(Value * ma, flat(ta, left.size(), contr.size(), "left"));
  KILN_ASSIGN_OR_RETURN(Value * mb, flat(tb, contr.size(), right.size(), "right"));
  Value* m = c.emit1("MatMul", {ma, mb});  // batch..., M, N
  std::vector<int64_t> out_shape(nb, 0);
  for (size_t i = 0; i < left.size(); ++i) out_shape.push_back(static_dim(ta, static_cast<int>(nb + i)));
  for (size_t i = 0; i < right.size(); ++i)
    out_shape.push_back(static_dim(tb, static_cast<int>(nb + contr.size() + i)));
  const int unknown = static_cast<int>(std::count(out_shape.begin() + nb, out_shape.end(), -1));
  if (unknown > 1) return c.fail("the Einsum's output dims must be static");
  a = reshape(c, m, out_shape);
  la = batch;
  la.insert(la.end(), left.begin(), left.end());
  la.insert(la.end(), right.begin(), right.end());
  return Status::ok();
}

/// Replaces each pair of equal labels of one operand by its diagonal: the two dims move
/// last, merge into one of n*n elements, and a Slice with step n+1 keeps the diagonal.
Status diagonals(LowerContext& c, Value*& v, Labels& l) {
  while (true) {
    size_t p = 0, q = 0;
    bool found = false;
    for (size_t i = 0; i < l.size() && !found; ++i)
      for (size_t j = i + 1; j < l.size() && !found; ++j)
        if (l[i] == l[j]) p = i, q = j, found = true;
    if (!found) return Status::ok();
    const int64_t n = static_dim(v, static_cast<int>(p));
    if (n < 0 || static_dim(v, static_cast<int>(q)) != n)
      return c.fail("a letter repeated within one operand (a diagonal) needs equal static dims");
    std::vector<int64_t> perm;
    Labels rest;
    for (size_t i = 0; i < l.size(); ++i)
      if (i != p && i != q) {
        perm.push_back(static_cast<int64_t>(i));
        rest.push_back(l[i]);
      }
    perm.push_back(static_cast<int64_t>(p));
    perm.push_back(static_cast<int64_t>(q));
    std::vector<int64_t> shape(rest.size(), 0);
    shape.push_back(n * n);
    Value* flat = reshape(c, transpose(c, v, perm), shape);
    v = c.emit1("Slice", {flat, c.const_i64({0}), c.const_i64({n * n}), c.const_i64({-1}), c.const_i64({n + 1})});
    rest.push_back(l[p]);
    l = rest;
  }
}

Status lower_einsum(LowerContext& c) {
  std::string eq;
  for (char ch : c.attrs().get_string("equation", ""))
    if (ch != ' ') eq.push_back(ch);
  if (eq.empty()) return c.fail("missing attribute equation");
  const size_t arrow = eq.find("->");
  const std::string lhs = eq.substr(0, arrow);
  std::vector<std::string> terms;
  size_t start = 0;
  while (true) {
    size_t comma = lhs.find(',', start);
    terms.push_back(lhs.substr(start, comma == std::string::npos ? std::string::npos : comma - start));
    if (comma == std::string::npos) break;
    start = comma + 1;
  }
  if (static_cast<int>(terms.size()) != c.num_inputs())
    return c.fail("equation '" + eq + "' has " + std::to_string(terms.size()) + " terms for " +
                  std::to_string(c.num_inputs()) + " inputs");
  int ell = -1;
  std::vector<Labels> labels(terms.size());
  std::map<int, int> count;
  for (size_t i = 0; i < terms.size(); ++i) {
    Value* v = c.input(static_cast<int>(i));
    if (!v) return c.fail("input " + std::to_string(i) + " is missing");
    KILN_RETURN_IF_ERROR(parse_term(c, terms[i], rank_of(v), labels[i], ell));
    for (int l : labels[i]) ++count[l];
  }
  Labels out;
  if (arrow != std::string::npos) {
    int dummy = -1;
    const std::string rhs = eq.substr(arrow + 2);
    const int letters = static_cast<int>(
        std::count_if(rhs.begin(), rhs.end(), [](char ch) { return std::isalpha(static_cast<unsigned char>(ch)); }));
    KILN_RETURN_IF_ERROR(
        parse_term(c, rhs, letters + (rhs.find("...") != std::string::npos ? std::max(ell, 0) : 0), out, dummy));
    for (int l : out)
      if (!count.count(l))
        return c.fail("equation '" + eq + "': output letter '" + std::string(1, static_cast<char>(l)) +
                      "' is in no input");
  } else {  // implicit: ellipsis dims, then the letters seen once, in ASCII order
    for (int k = std::max(ell, 0); k > 0; --k) out.push_back(1000 + k);
    for (auto& [l, n] : count)
      if (l < 1000 && n == 1) out.push_back(l);
  }
  const std::set<int> out_set(out.begin(), out.end());
  // A letter repeated within one operand takes its diagonal ("ii->i", "...ii->...i").
  std::vector<Value*> operands;
  for (size_t i = 0; i < terms.size(); ++i) {
    Value* v = c.input(static_cast<int>(i));
    KILN_RETURN_IF_ERROR(diagonals(c, v, labels[i]));
    operands.push_back(v);
  }
  Value* acc = operands[0];
  Labels la = labels[0];
  for (size_t i = 1; i < terms.size(); ++i) {
    std::set<int> needed = out_set;
    for (size_t j = i + 1; j < terms.size(); ++j) needed.insert(labels[j].begin(), labels[j].end());
    KILN_RETURN_IF_ERROR(contract(c, acc, la, operands[i], labels[i], needed));
  }
  acc = sum_out(c, acc, la, out_set);
  std::vector<int64_t> perm;
  for (int l : out) perm.push_back(std::find(la.begin(), la.end(), l) - la.begin());
  Value* y = transpose(c, acc, perm);
  return c.define_output(0, y);
}

// ------------------------------------------------------------------ sequences

/// A constant scalar or 1-element position input, wrapped into [0, n] (`allow_end`: n
/// itself allowed, as for an insert position).
Status position_of(LowerContext& c, int input, int64_t n, bool allow_end, int64_t& p) {
  std::vector<int64_t> v;
  if (!const_ints(c.input(input), v) || v.size() != 1)
    return c.fail("the position must be a constant scalar (kiln holds sequences of known length at import)");
  p = v[0];
  const int64_t hi = allow_end ? n : n - 1;
  if (p < -n || p > hi)
    return c.fail("position " + std::to_string(p) + " out of range for a sequence of " + std::to_string(n));
  if (p < 0) p += n;
  return Status::ok();
}

const std::vector<Value*>& seq_or_empty(LowerContext& c, int i, bool& ok) {
  static const std::vector<Value*> empty;
  const auto* s = c.sequence_input(i);
  ok = s != nullptr;
  return s ? *s : empty;
}

Status lower_split_to_sequence(LowerContext& c) {
  Value* x = c.input(0);
  if (!x) return c.fail("missing input");
  const int r = rank_of(x);
  int64_t axis = c.attrs().get_int("axis", 0);
  if (axis < -r || axis >= r) return c.fail("axis out of range");
  if (axis < 0) axis += r;
  const int64_t n = static_dim(x, static_cast<int>(axis));
  if (n < 0) return c.fail("the split dim must be static (bind symbolic dims with --shape)");
  std::vector<int64_t> sizes;
  bool squeeze = false;
  if (Value* s = c.input(1)) {
    std::vector<int64_t> sv;
    if (!const_ints(s, sv)) return c.fail("split must be a constant");
    if (s->shape.rank() == 0) {
      if (sv[0] <= 0) return c.fail("split must be positive");
      for (int64_t done = 0; done < n; done += sv[0]) sizes.push_back(std::min(sv[0], n - done));
    } else {
      sizes = sv;
    }
  } else {
    sizes.assign(static_cast<size_t>(n), 1);
    squeeze = c.attrs().get_int("keepdims", 1) == 0;
  }
  int64_t total = 0;
  for (int64_t s : sizes) total += s;
  if (total != n) return c.fail("split sizes sum to " + std::to_string(total) + ", the dim is " + std::to_string(n));
  std::vector<Value*> parts;
  if (sizes.size() == 1) {
    parts.push_back(x);
  } else if (!sizes.empty()) {
    parts = c.emit("Split", {x, c.const_i64(sizes)}, static_cast<int>(sizes.size()), attrs_of({{"axis", axis}}));
  }
  if (squeeze)
    for (Value*& p : parts) p = c.emit1("Squeeze", {p, c.const_i64({axis})});
  return c.define_sequence(0, parts);
}

Status lower_sequence_at(LowerContext& c) {
  bool ok;
  const auto& s = seq_or_empty(c, 0, ok);
  if (!ok) return c.fail("input 0 is not a sequence");
  int64_t p;
  KILN_RETURN_IF_ERROR(position_of(c, 1, static_cast<int64_t>(s.size()), false, p));
  return c.define_output(0, s[static_cast<size_t>(p)]);
}

Status lower_sequence_length(LowerContext& c) {
  bool ok;
  const auto& s = seq_or_empty(c, 0, ok);
  if (!ok) return c.fail("input 0 is not a sequence");
  return c.define_output(0, c.constant(Tensor::scalar_i64(static_cast<int64_t>(s.size()))));
}

Status lower_concat_from_sequence(LowerContext& c) {
  bool ok;
  const auto& s = seq_or_empty(c, 0, ok);
  if (!ok) return c.fail("input 0 is not a sequence");
  if (s.empty()) return c.fail("the sequence is empty");
  if (!c.attrs().has("axis")) return c.fail("missing attribute axis");
  const int64_t axis = c.attrs().get_int("axis", 0);
  const bool new_axis = c.attrs().get_int("new_axis", 0) != 0;
  std::vector<Value*> items = s;
  if (new_axis)
    for (Value*& v : items) v = c.emit1("Unsqueeze", {v, c.const_i64({axis})});
  if (items.size() == 1) return c.define_output(0, items[0]);
  c.emit1("Concat", items, attrs_of({{"axis", axis}}), c.output_name(0));
  return Status::ok();
}

Status lower_sequence_construct(LowerContext& c) {
  std::vector<Value*> items;
  for (int i = 0; i < c.num_inputs(); ++i) {
    if (!c.input(i)) return c.fail("input " + std::to_string(i) + " is missing or not a tensor");
    items.push_back(c.input(i));
  }
  return c.define_sequence(0, items);
}

Status lower_sequence_empty(LowerContext& c) { return c.define_sequence(0, {}); }

Status lower_sequence_insert(LowerContext& c) {
  bool ok;
  std::vector<Value*> s = seq_or_empty(c, 0, ok);
  if (!ok) return c.fail("input 0 is not a sequence");
  if (!c.input(1)) return c.fail("missing tensor input");
  int64_t p = static_cast<int64_t>(s.size());
  if (c.num_inputs() > 2 && c.input(2))
    KILN_RETURN_IF_ERROR(position_of(c, 2, static_cast<int64_t>(s.size()), true, p));
  s.insert(s.begin() + p, c.input(1));
  return c.define_sequence(0, s);
}

Status lower_sequence_erase(LowerContext& c) {
  bool ok;
  std::vector<Value*> s = seq_or_empty(c, 0, ok);
  if (!ok) return c.fail("input 0 is not a sequence");
  if (s.empty()) return c.fail("the sequence is empty");
  int64_t p = static_cast<int64_t>(s.size()) - 1;
  if (c.num_inputs() > 1 && c.input(1))
    KILN_RETURN_IF_ERROR(position_of(c, 1, static_cast<int64_t>(s.size()), false, p));
  s.erase(s.begin() + p);
  return c.define_sequence(0, s);
}

}  // namespace

const std::map<std::string, Lowering>& onnx_lowerings() {
  // ONNX schema versions handled (compared with ONNX's history by tests/frontend).
  static const std::map<std::string, Lowering> m = {
      {"Attention", {{23, 24, 25}, lower_attention}},
      {"RotaryEmbedding", {{23}, lower_rotary_embedding}},
      {"RMSNormalization", {{23}, lower_rms_normalization}},
      {"Einsum", {{12, 28}, lower_einsum}},
      {"SplitToSequence", {{11, 24}, lower_split_to_sequence}},
      {"SequenceAt", {{11}, lower_sequence_at}},
      {"SequenceLength", {{11}, lower_sequence_length}},
      {"ConcatFromSequence", {{11}, lower_concat_from_sequence}},
      {"SequenceConstruct", {{11}, lower_sequence_construct}},
      {"SequenceEmpty", {{11}, lower_sequence_empty}},
      {"SequenceInsert", {{11}, lower_sequence_insert}},
      {"SequenceErase", {{11}, lower_sequence_erase}},
  };
  return m;
}

bool importable_op(const std::string& op) {
  if (onnx_lowerings().count(op)) return true;
  const ir::OpDef* d = ir::OpTable::get().find(op);
  return d && d->onnx;
}

}  // namespace kiln::frontend
