// Decompositions of the op table (OpDef::decomposable / decompose), applied by the
// decompose pass (passes/decompose.cpp): rewrites backward ops that compute both row-wise and column-wise results
// into parts the fusion pass can generate, in the manner of PyTorch's decompositions
// (torch._decomp) that Inductor applies before lowering. Runs in the compiled pipeline
// before fusion (tools/driver/driver.cpp); the eager backend keeps the undecomposed ops.
//
//   LayerNormalizationGrad(dY, X, Scale) -> dX, dScale, dB  becomes
//     dX, Mean, InvStdDev = LayerNormalizationInputGrad(dY, X, Scale)   (one row kernel)
//     dScale = Cast(ReduceSum(Cast(dY, f64) * ((Cast(X, f64) - Mean) * InvStdDev), rows))
//     dB     = Cast(ReduceSum(Cast(dY, f64), rows))                      (column sums)
//   with the statistics and sums in f64 as the eager kernel (runtime/kernels/nn.cpp), so
//   the results agree with it to f64 rounding. The rows are the dims before `axis`; dScale
//   and dB keep Scale's dtype and shape (a Reshape when the row dims' shape differs). Only
//   outputs something reads are built. Nodes whose Scale is a broadcast single element,
//   or with non-static shapes, are left alone.
//
//   SoftmaxCrossEntropyLossGrad(dLoss, scores (N, C), labels (N)) becomes a Softmax with a
//   one-hot epilogue (see decompose_sce_grad): one row kernel after fusion.
//
//   SoftmaxCrossEntropyLoss(scores (N, C), labels (N)) -> loss becomes CheckLabels, the
//   per-row SoftmaxCrossEntropyRows (one row kernel: no (N, C) log-probabilities are
//   written) and its sum in f64 (see decompose_sce): cross_entropy = nll(log_softmax) as
//   PyTorch defines it, fused the way Inductor fuses it.
//
//   ReduceMean(X) -> Y  becomes  Cast(Div(ReduceSum(Cast(X, f64)), n), Y's dtype): the
//   eager kernel's double sum in its order, divided by the count in double, rounded once
//   (bit-identical); the cast fuses into the reduction kernel, the division and the
//   narrowing cast into its readers (an RMSNorm's rsqrt: one reduction kernel and one
//   pointwise kernel instead of an eager ReduceMean).
//
//   Split(X) -> Y0..Yn  becomes one Slice per output (Y_k = X[.., c_k : c_k + e_k, ..]),
//   which fusion reads as strided views of X, fused with their readers (the halves of a
//   rotary embedding, GPT-2's q/k/v), instead of an eager copy of every part.
//
//   Gather, GatherElements, GatherND, ScatterElements and ScatterND (reduction none) whose
//   indices are a constant affine in their coordinates (arange-built indices: position
//   embeddings, the broadcast aranges of attention-mask indexing, slice and select
//   assignments such as T5's label shift) become AsStrided(data) or
//   AsStridedScatter(data, updates) with the same strides (PyTorch's as_strided and
//   as_strided_scatter): fusion reads them through strides or guard boxes instead of
//   running an eager gather or scatter.
//
//   BatchNormalization(X, scale, B, input_mean, input_var) with an explicit training_mode
//   (attach_loss sets it in every training and evaluation program) becomes, with
//   f64 = Cast(., f64) and the axes every dim but C (keepdims, so (1, C, 1, ..)):
//     mean = ReduceSum(f64 X) / n,  var = ReduceSum((f64 X - mean)^2) / n   (training)
//     a = scale / sqrt(var + eps),  Y = Cast(f64 X * a + (B - mean * a))
//     running_mean = input_mean * momentum + mean * (1 - momentum)
//     running_var  = input_var * momentum + var * n / (n - 1) * (1 - momentum)
//   (evaluation: mean and var are the inputs, and only Y may be read);
//   BatchNormalizationGrad(dY, X, scale, mean, var) becomes the column sums
//     dB = ReduceSum(f64 dY),  dscale = ReduceSum(f64 dY * (f64 X - mean) * inv)
//     dX = scale * inv / n * (n dY - dB - xhat * dscale)   (evaluation: dY * scale * inv)
//   with the batch statistics recomputed from X in training mode. The formulas, their
//   order of operations and the f64 arithmetic are the eager kernels'
//   (runtime/kernels/nn.cpp), so only the sums' order differs; fusion turns them into
//   column-reduction kernels with their prologues and pointwise kernels that fuse with
//   the ReLU around them, as Inductor decomposes batch norm (torch._decomp's
//   native_batch_norm and its backward) instead of calling an opaque kernel.
//
// The pass puts the new nodes in the place of the original node in the schedule (same
// position, in order dX, dScale, dB), named "<node>/input", "<node>/dscale/...",
// "<node>/dbias/...".
#include <optional>
#include <tuple>

#include "ir/builder.h"
#include "ir/dtype.h"
#include "ir/op_table.h"
#include "ir/ops/nn.h"

namespace kiln::ir {

namespace {

bool used(const Graph& g, const Value* v) { return v && (!g.uses(v).empty() || g.is_graph_output(v)); }

/// `n` has `inputs` inputs, no region, and known shapes everywhere (static, or symbolic:
/// a symbolic program's leading dims; the rules below need static rows and classes).
bool known_node(const Node& n, int inputs) {
  if (n.num_inputs() != inputs || !n.regions.empty()) return false;
  for (const Value* v : n.inputs)
    if (!v || !v->shape.is_known()) return false;
  for (const Value* v : n.outputs)
    if (!v || !v->shape.is_known()) return false;
  return true;
}

/// `n` has `inputs` inputs, no region, and static shapes everywhere.
bool static_node(const Node& n, int inputs) {
  if (n.num_inputs() != inputs || !n.regions.empty()) return false;
  for (const Value* v : n.inputs)
    if (!v) return false;
  return n.shapes_static();
}

/// Eligible LayerNormalizationGrad: float shapes, static row dims (the leading dims may be
/// symbolic), Scale static with as many elements as a row.
bool decomposable_ln_grad(const Node& n) {
  if (!known_node(n, 3)) return false;
  for (const Value* v : n.inputs)
    if (!is_float(v->dtype)) return false;
  const Shape& x = n.inputs[1]->shape;
  auto ax = normalize_axis(n.attrs.get_int("axis", -1), x.rank());
  if (!ax || *ax == 0) return false;  // no row dims: nothing to sum over
  int64_t row = 1;
  for (int i = *ax; i < x.rank(); ++i) {
    if (!x.dims[i].is_static()) return false;
    row *= x.dims[i].value;
  }
  return n.inputs[2]->shape.is_static() && n.inputs[2]->shape.numel() == row && row > 0;
}

Attributes cast_to(DType t) {
  Attributes a;
  a.set("to", static_cast<int64_t>(dtype_to_onnx(t)));
  return a;
}

/// Rewrites one LayerNormalizationGrad node: removes it, then appends its replacement
/// with `b` (the caller moves the new nodes to the node's position). The results that
/// something reads keep their value names; their readers are rewired.
Status decompose_ln_grad(Graph& g, Graph& root, Node* n) {
  const std::string name = n->name;
  Value* dY = n->inputs[0];
  Value* X = n->inputs[1];
  Value* scale = n->inputs[2];
  const Attributes attrs = n->attrs;
  const int ax = static_cast<int>(*normalize_axis(attrs.get_int("axis", -1), X->shape.rank()));
  std::vector<Value*> old = n->outputs;
  std::vector<bool> need(3, false);
  for (size_t i = 0; i < old.size() && i < 3; ++i) need[i] = used(g, old[i]);
  std::vector<std::string> names;
  for (Value* v : old) names.push_back(v->name);
  g.remove_node(n);  // frees the output names for the replacement

  Builder b(g, name);
  b.set_constant_graph(&root);
  Attributes a;
  a.set("axis", attrs.get_int("axis", -1));
  a.set("epsilon", attrs.get_float("epsilon", 1e-5));
  const int nout = need[1] ? 3 : 1;
  std::vector<std::string> outs = {names[0], name + "/mean", name + "/inv_std_dev"};
  outs.resize(static_cast<size_t>(nout));
  Node* row = g.add_node("LayerNormalizationInputGrad", name + "/input", {dY, X, scale}, outs, a);
  KILN_RETURN_IF_ERROR(infer_node(*row));
  const std::vector<Value*> parts = row->outputs;
  std::vector<Value*> fresh = {parts[0], nullptr, nullptr};

  std::vector<int64_t> rows;
  for (int i = 0; i < ax; ++i) rows.push_back(i);
  auto f64 = [&](Value* v) { return v->dtype == DType::f64 ? v : b.op("Cast", {v}, cast_to(DType::f64)); };
  // A column sum over the rows in Scale's dtype and shape; the last node's output is named `out`.
  auto column_sum = [&](Value* v, const std::string& out) -> Value* {
    const std::vector<int64_t> xd = X->shape.to_vector();  // the row dims (from ax) are static
    const bool reshape = scale->shape.to_vector() != std::vector<int64_t>(xd.begin() + ax, xd.end());
    const bool cast = scale->dtype != DType::f64;
    Value* s = b.op("ReduceSum", {v, b.ints(rows)}, make_attrs({{"keepdims", int64_t(0)}}), reshape || cast ? "" : out);
    if (s && reshape) s = b.op("Reshape", {s, b.ints(scale->shape.to_vector())}, {}, cast ? "" : out);
    if (s && cast) s = b.op("Cast", {s}, cast_to(scale->dtype), out);
    return s;
  };
  if (need[1]) {
    b.set_prefix(name + "/dscale");
    Value* xhat = b.op("Mul", {b.op("Sub", {f64(X), parts[1]}), parts[2]});
    fresh[1] = column_sum(b.op("Mul", {f64(dY), xhat}), names[1]);
  }
  if (need[2]) {
    b.set_prefix(name + "/dbias");
    fresh[2] = column_sum(f64(dY), names[2]);
  }
  KILN_RETURN_IF_ERROR(b.status());
  for (int i = 0; i < 3; ++i)
    if (need[i] && fresh[i] != old[i]) g.replace_all_uses(old[i], fresh[i]);
  return Status::ok();
}

/// What the cross-entropy rewrites need of a SoftmaxCrossEntropyLoss(-Grad) node (scores
/// at input `x_input`, labels after them), taken before the node leaves the graph.
struct SceParts {
  std::string name, out_name, reduction;
  Attributes attrs;
  Value *X = nullptr, *L = nullptr, *old = nullptr;
  int64_t N = 0, C = 0;  ///< N: -1 when symbolic (sce_shapes admits that only where label_count does not read N)
};
SceParts detach_sce(Graph& g, Node* n, int x_input) {
  SceParts p;
  p.name = n->name;
  p.attrs = n->attrs;
  p.X = n->inputs[x_input];
  p.L = n->inputs[x_input + 1];
  p.old = n->outputs[0];
  p.out_name = p.old->name;
  p.N = p.X->shape.dims[0].value;
  p.C = p.X->shape.dims[1].value;
  p.reduction = p.attrs.get_string("reduction", "mean");
  g.remove_node(n);
  return p;
}

/// Boolean (N): labels != ignore_index; nullptr when the node has no ignore_index.
Value* counted_labels(Builder& b, const SceParts& p) {
  if (!p.attrs.has("ignore_index")) return nullptr;
  Value* ig = b.ints({p.attrs.get_int("ignore_index", -100)});
  if (p.L->dtype != DType::i64) ig = b.op("Cast", {ig}, cast_to(p.L->dtype));
  return b.op("Not", {b.op("Equal", {p.L, ig})});
}

/// The mean's denominator, f64 rank 0: the count of `counted` labels, or N without it.
Value* label_count(Builder& b, const SceParts& p, Value* counted) {
  if (!counted) return b.scalar(static_cast<double>(p.N), DType::f64);
  return b.op("ReduceSum", {b.op("Cast", {counted}, cast_to(DType::f64)), b.ints({0})},
              make_attrs({{"keepdims", int64_t(0)}}));
}

/// The class indices 0..C-1 as an i64 constant (C).
Value* class_indices(Builder& b, int64_t C) {
  std::vector<int64_t> iota(static_cast<size_t>(C));
  for (int64_t c = 0; c < C; ++c) iota[static_cast<size_t>(c)] = c;
  return b.ints(iota);
}

/// The scores (N, C) and labels (N) of a cross entropy: C static, N static or symbolic
/// (equal in both); a symbolic N with a mean over every label needs its count at run time
/// (ignore_index: the count of valid labels is computed anyway).
bool sce_shapes(const Node& n, const Value* x, const Value* l) {
  if (x->shape.rank() != 2 || l->shape.rank() != 1 || !x->shape.dims[1].is_static() || x->shape.dims[1].value <= 0)
    return false;
  if (x->shape.dims[0] != l->shape.dims[0]) return false;
  if (x->shape.dims[0].is_static()) return x->shape.dims[0].value > 0;
  return n.attrs.has("ignore_index") || n.attrs.get_string("reduction", "mean") != "mean";
}

/// Eligible SoftmaxCrossEntropyLossGrad: (dLoss, scores (N, C), labels (N) i64), no
/// weights, known shapes (sce_shapes).
bool decomposable_sce_grad(const Node& n) {
  if (!known_node(n, 3) || n.num_outputs() != 1) return false;
  const Value* x = n.inputs[1];
  const Value* l = n.inputs[2];
  return is_float(x->dtype) && is_float(n.inputs[0]->dtype) && l->dtype == DType::i64 && sce_shapes(n, x, l);
}

/// SoftmaxCrossEntropyLossGrad(dLoss, scores, labels) becomes, in f64 after the softmax
/// (as the eager kernel: dX = p * coef - onehot * coef, coef = 0 at ignored labels):
///   p      = Softmax(Cast(scores, f64), axis 1)                          (row kernel)
///   coef   = Where(valid, dLoss [/ count of valid labels for mean], 0)   (N) or scalar
///   onehot = Equal(iota(C), Reshape(labels, (N, 1)))
///   dX     = Cast(p * coef - Where(onehot, coef, 0), dtype of scores)
/// The fusion pass makes the softmax and everything after it one row kernel. Labels are
/// not range-checked here: the forward loss of the same step (its eager kernel, or the
/// CheckLabels of its decomposition) rejects a label outside [0, C) first.
Status decompose_sce_grad(Graph& g, Graph& root, Node* n) {
  Value* dL = n->inputs[0];
  const SceParts s = detach_sce(g, n, 1);
  Value* X = s.X;
  const DType t = X->dtype;
  const std::string& out_name = s.out_name;

  Builder b(g, s.name);
  b.set_constant_graph(&root);
  const DType f = DType::f64;
  auto to = [&](Value* v, DType d) { return v->dtype == d ? v : b.op("Cast", {v}, cast_to(d)); };
  Value* valid = counted_labels(b, s);  // boolean (N): label != ignore_index
  Value* zero = b.scalar(0.0, f);
  Value* coef = to(dL, f);  // rank 0 (mean, sum) or (N) (none)
  if (s.reduction == "mean") coef = b.op("Div", {coef, label_count(b, s, valid)});
  if (valid) coef = b.op("Where", {valid, coef, zero});
  if (coef && coef->shape.rank() == 1) coef = b.op("Reshape", {coef, b.ints({-1, 1})});
  Value* onehot = b.op("Equal", {class_indices(b, s.C), b.op("Reshape", {s.L, b.ints({-1, 1})})});
  Attributes sa;
  sa.set("axis", int64_t(1));
  // The softmax in f64 (libm exp), as the eager kernel: dX rounded to f32 then equals the
  // eager result except where the two f64 values straddle an f32 rounding boundary, so
  // that training trajectories stay as close as eager and compiled elsewhere are (an f32
  // exp's 1e-7 differences are amplified by Adam's first, sign-like steps).
  Value* p = b.op("Softmax", {to(X, f)}, sa);
  Value* dx = nullptr;
  if (p && coef && onehot) {
    Value* d = b.op("Sub", {b.op("Mul", {p, coef}), b.op("Where", {onehot, coef, zero})}, {}, t == f ? out_name : "");
    dx = t == f ? d : (d ? b.op("Cast", {d}, cast_to(t), out_name) : nullptr);
  }
  KILN_RETURN_IF_ERROR(b.status());
  g.replace_all_uses(s.old, dx);
  return Status::ok();
}

/// Eligible SoftmaxCrossEntropyLoss: scores (N, C) float, labels (N) i64/i32, no
/// weights, known shapes (sce_shapes), no log_prob output read.
bool decomposable_sce(const Graph& g, const Node& n) {
  if (!known_node(n, 2) || n.num_outputs() < 1) return false;
  for (int k = 1; k < n.num_outputs(); ++k)
    if (used(g, n.outputs[k])) return false;
  const Value* x = n.inputs[0];
  const Value* l = n.inputs[1];
  return is_float(x->dtype) && (l->dtype == DType::i64 || l->dtype == DType::i32) && sce_shapes(n, x, l);
}

/// SoftmaxCrossEntropyLoss(scores, labels) becomes, in f64 after the row kernel (as the
/// eager kernel, which sums the per-row losses in double in row order):
///   checked = CheckLabels(labels)                                         (the eager check)
///   rows    = SoftmaxCrossEntropyRows(scores, Reshape(checked, (N, 1)), iota(C))  (N, 1) f64
///   none: Cast(Reshape(rows, (N)));  sum: Cast(ReduceSum(rows));
///   mean: Cast(ReduceSum(rows) / count), count = the labels != ignore_index (N without it)
/// A mean over zero counted labels is 0/0 = NaN, as the eager kernel and PyTorch.
Status decompose_sce(Graph& g, Graph& root, Node* n) {
  const SceParts s = detach_sce(g, n, 0);
  const DType t = s.old->dtype;
  Builder b(g, s.name);
  b.set_constant_graph(&root);
  Attributes ca, ra;
  ca.set("num_classes", s.C);
  // Labels flattened by a Reshape (token labels [batch, seq]): their fed dims, so that an
  // error names the element as the user sees it.
  const Node* lp = s.L->producer;
  if (lp && lp->op == "Reshape" && lp->input(0) && lp->input(0)->shape.is_static() && lp->input(0)->shape.rank() > 1)
    ca.set("label_dims", lp->input(0)->shape.to_vector());
  if (s.attrs.has("ignore_index")) {
    ca.set("ignore_index", s.attrs.get_int("ignore_index", -100));
    ra.set("ignore_index", s.attrs.get_int("ignore_index", -100));
  }
  Value* checked = b.op("CheckLabels", {s.L}, ca);
  Value* rows = checked ? b.op("SoftmaxCrossEntropyRows",
                               {s.X, b.op("Reshape", {checked, b.ints({-1, 1})}), class_indices(b, s.C)}, ra)
                        : nullptr;
  Value* res = nullptr;  // f64: (N) for none, else rank 0
  if (rows && s.reduction == "none") {
    res = b.op("Reshape", {rows, b.ints({-1})});
  } else if (rows) {
    res = b.op("ReduceSum", {rows, b.ints({0, 1})}, make_attrs({{"keepdims", int64_t(0)}}));
    if (res && s.reduction == "mean") res = b.op("Div", {res, label_count(b, s, counted_labels(b, s))});
  }
  Value* out = res ? b.op("Cast", {res}, cast_to(t), s.out_name) : nullptr;
  KILN_RETURN_IF_ERROR(b.status());
  if (!out) return Status::error("decompose: node '" + s.name + "' could not be rewritten");
  g.replace_all_uses(s.old, out);
  return Status::ok();
}

/// Eligible ReduceMean: a float input, static shapes, constant axes (attribute or input),
/// not the no-op form.
bool decomposable_reduce_mean(const Node& n) {
  if (!n.regions.empty() || n.num_outputs() != 1 || n.num_inputs() < 1) return false;
  const Value* x = n.input(0);
  const Value* ax = n.input(1);
  if (!x || !is_float(x->dtype) || !x->shape.is_static() || !n.outputs[0]->shape.is_static()) return false;
  if (ax && !ax->data) return false;
  auto spec = reduce_spec(n.attrs, ax != nullptr, ax ? ax->data.get() : nullptr, x->shape.rank());
  return spec && !spec->noop && x->shape.numel() > 0;
}

Status decompose_reduce_mean(Graph& g, Graph& root, Node* n) {
  const std::string name = n->name;
  Value* x = n->inputs[0];
  Value* old = n->outputs[0];
  const Value* ax = n->input(1);
  auto spec = reduce_spec(n->attrs, ax != nullptr, ax ? ax->data.get() : nullptr, x->shape.rank());
  if (!spec) return spec.status();
  int64_t count = 1;
  for (int a : spec->axes) count *= x->shape.dims[a].value;
  const std::string out_name = old->name;
  g.remove_node(n);
  Builder b(g, name);
  b.set_constant_graph(&root);
  Value* x64 = x->dtype == DType::f64 ? x : b.op("Cast", {x}, cast_to(DType::f64));
  Value* s = b.op("ReduceSum", {x64, b.ints(std::vector<int64_t>(spec->axes.begin(), spec->axes.end()))},
                  make_attrs({{"keepdims", int64_t(spec->keepdims ? 1 : 0)}}));
  Value* m = b.op("Div", {s, b.scalar(static_cast<double>(count), DType::f64)});
  Value* out = old->dtype == DType::f64 ? m : b.op("Cast", {m}, cast_to(old->dtype), out_name);
  KILN_RETURN_IF_ERROR(b.status());
  if (!out) return Status::error("decompose: node '" + name + "' could not be rewritten");
  g.replace_all_uses(old, out);
  return Status::ok();
}

/// Eligible Split: static shapes, every output read (an unread output is left alone).
bool decomposable_split(const Graph& g, const Node& n) {
  if (!n.regions.empty() || !n.input(0) || !n.input(0)->shape.is_known() || n.num_outputs() < 2) return false;
  const auto axis = normalize_axis(n.attrs.get_int("axis", 0), n.input(0)->shape.rank());
  if (!axis) return false;
  // Known shapes, static along the axis (the other dims may be symbolic: q, k and v of a
  // symbolic program's attention).
  for (const Value* o : n.outputs)
    if (!o->shape.is_known() || o->shape.rank() != n.input(0)->shape.rank() || !o->shape.dims[*axis].is_static())
      return false;
  (void)g;
  return true;
}

Status decompose_split(Graph& g, Graph& root, Node* n) {
  const std::string name = n->name;
  Value* x = n->inputs[0];
  const int axis = *normalize_axis(n->attrs.get_int("axis", 0), x->shape.rank());
  std::vector<Value*> old = n->outputs;
  std::vector<std::string> names;
  for (Value* o : old) names.push_back(o->name);
  g.remove_node(n);
  Builder b(g, name);
  b.set_constant_graph(&root);
  int64_t start = 0;
  for (size_t k = 0; k < old.size(); ++k) {
    const int64_t e = old[k]->shape.dims[axis].value;
    Value* s = b.op("Slice", {x, b.ints({start}), b.ints({start + e}), b.ints({axis})}, {}, names[k]);
    KILN_RETURN_IF_ERROR(b.status());
    if (!s) return Status::error("decompose: node '" + name + "' could not be rewritten");
    g.replace_all_uses(old[k], s);
    start += e;
  }
  return Status::ok();
}

// ---------------------------------------------------------------- indexing with constant indices

/// Element strides and offset of an indexing op's access into its data (dense row-major)
/// when its constant indices address the data affinely: the view as AsStrided /
/// AsStridedScatter attributes (size = the output, or the updates, shape).
struct StridedAccess {
  std::vector<int64_t> size, stride;
  int64_t offset = 0;
};

/// Fits the constant indices `idx` (shape L + [K] when `components`, else L with K = 1)
/// as affine functions of the coordinates of L: wrap(idx[l, m], n[m]) = c0[m] + sum_d
/// l_d * c[m][d] (negative indices count from n[m], as the kernels do). False when an
/// index is outside [-n, n) (the run time reports it) or the map is not affine.
bool fit_affine(const Tensor& idx, bool components, const std::vector<int64_t>& n, std::vector<int64_t>& c0,
                std::vector<std::vector<int64_t>>& c) {
  std::vector<int64_t> lead = idx.dims();
  const int64_t K = components ? (lead.empty() ? 0 : lead.back()) : 1;
  if (components) lead.pop_back();
  if (K != static_cast<int64_t>(n.size()) || K <= 0) return false;
  const int64_t count = numel_of(lead);
  if (count <= 0) return false;
  auto at = [&](int64_t l, int64_t m, int64_t& v) {
    v = idx.get_i64(l * K + m);
    if (v < -n[m] || v >= n[m]) return false;
    if (v < 0) v += n[m];
    return true;
  };
  const std::vector<int64_t> dense = strides_of(lead);
  c0.assign(K, 0);
  c.assign(K, std::vector<int64_t>(lead.size(), 0));
  for (int64_t m = 0; m < K; ++m) {
    if (!at(0, m, c0[m])) return false;
    for (size_t d = 0; d < lead.size(); ++d) {
      if (lead[d] <= 1) continue;
      int64_t v;
      if (!at(dense[d], m, v)) return false;
      c[m][d] = v - c0[m];
    }
  }
  std::vector<int64_t> coord(lead.size(), 0);
  for (int64_t l = 0; l < count; ++l) {
    for (int64_t m = 0; m < K; ++m) {
      int64_t v, want = c0[m];
      for (size_t d = 0; d < lead.size(); ++d) want += coord[d] * c[m][d];
      if (!at(l, m, v) || v != want) return false;
    }
    for (int d = static_cast<int>(lead.size()) - 1; d >= 0; --d) {
      if (++coord[d] < lead[d]) break;
      coord[d] = 0;
    }
  }
  return true;
}

/// The strided access of Gather, GatherElements, GatherND (the output's elements read
/// from the data), ScatterElements and ScatterND with reduction none (the updates'
/// elements written into the data) when the indices (input 1) are a constant whose
/// values are affine in their coordinates: position embeddings gathered with arange,
/// GatherND over broadcast aranges (attention masks), slice and select assignments
/// exported as scatters (T5's shift of the labels). nullopt otherwise.
std::optional<StridedAccess> strided_access(const Node& n) {
  if (!n.regions.empty() || n.num_outputs() != 1) return std::nullopt;
  const bool scatter = n.op.rfind("Scatter", 0) == 0;
  if (n.num_inputs() != (scatter ? 3 : 2)) return std::nullopt;
  if (scatter && n.attrs.get_string("reduction", "none") != "none") return std::nullopt;
  const Value* data = n.input(0);
  const Value* idx = n.input(1);
  const Value* out = scatter ? n.input(2) : n.outputs[0];  // the strided side
  if (!data || !idx || !idx->data || !out || !data->shape.is_static() || !out->shape.is_static() ||
      !n.outputs[0]->shape.is_static() || data->shape.rank() == 0)
    return std::nullopt;
  if (idx->data->numel() > (int64_t{1} << 22)) return std::nullopt;  // bounded compile-time work
  const std::vector<int64_t> dd = data->shape.to_vector(), ds = strides_of(dd);
  const int r = static_cast<int>(dd.size());
  StridedAccess a;
  a.size = out->shape.to_vector();
  std::vector<int64_t> c0;
  std::vector<std::vector<int64_t>> c;
  if (n.op == "Gather") {
    auto ax = normalize_axis(n.attrs.get_int("axis", 0), r);
    if (!ax || !fit_affine(*idx->data, false, {dd[*ax]}, c0, c)) return std::nullopt;
    for (int d = 0; d < *ax; ++d) a.stride.push_back(ds[d]);
    for (int64_t cd : c[0]) a.stride.push_back(cd * ds[*ax]);
    for (int d = *ax + 1; d < r; ++d) a.stride.push_back(ds[d]);
    a.offset = c0[0] * ds[*ax];
  } else if (n.op == "GatherElements" || n.op == "ScatterElements") {
    auto ax = normalize_axis(n.attrs.get_int("axis", 0), r);
    if (!ax || idx->shape.rank() != r || !fit_affine(*idx->data, false, {dd[*ax]}, c0, c)) return std::nullopt;
    for (int d = 0; d < r; ++d) a.stride.push_back((d == *ax ? 0 : ds[d]) + c[0][d] * ds[*ax]);
    a.offset = c0[0] * ds[*ax];
  } else {  // GatherND (batch_dims b) and ScatterND (b = 0): indices B + J + [K]
    const int b = static_cast<int>(n.attrs.get_int("batch_dims", 0));
    const std::vector<int64_t> id = idx->shape.to_vector();
    if (id.empty() || b < 0) return std::nullopt;
    const int64_t K = id.back();
    if (b + K > r) return std::nullopt;
    std::vector<int64_t> lim;
    for (int64_t m = 0; m < K; ++m) lim.push_back(dd[static_cast<size_t>(b + m)]);
    if (b > 0) {
      // Each batch row indexes its own slice: fit per batch coordinate as a lead dim.
      for (int d = 0; d < b; ++d)
        if (id[d] != dd[d]) return std::nullopt;
    }
    if (!fit_affine(*idx->data, true, lim, c0, c)) return std::nullopt;
    const int lead = static_cast<int>(id.size()) - 1;
    for (int d = 0; d < lead; ++d) {
      int64_t st = d < b ? ds[d] : 0;
      for (int64_t m = 0; m < K; ++m) st += c[m][d] * ds[static_cast<size_t>(b + m)];
      a.stride.push_back(st);
    }
    for (int d = static_cast<int>(b + K); d < r; ++d) a.stride.push_back(ds[d]);
    for (int64_t m = 0; m < K; ++m) a.offset += c0[m] * ds[static_cast<size_t>(b + m)];
  }
  if (a.stride.size() != a.size.size()) return std::nullopt;
  return a;
}

/// Gather-family node with constant affine indices -> AsStrided(data); scatter ->
/// AsStridedScatter(data, updates). The output keeps its name and readers.
Status decompose_strided(Graph& g, Node* n) {
  auto a = strided_access(*n);
  if (!a) return Status::error("decompose: node '" + n->name + "' has no strided form");
  const std::string name = n->name;
  const bool scatter = n->op.rfind("Scatter", 0) == 0;
  Value* data = n->inputs[0];
  Value* updates = scatter ? n->inputs[2] : nullptr;
  Value* old = n->outputs[0];
  const std::string out_name = old->name;
  g.remove_node(n);
  Attributes at;
  at.set("size", a->size);
  at.set("stride", a->stride);
  at.set("storage_offset", a->offset);
  std::vector<Value*> ins = {data};
  if (scatter) ins.push_back(updates);
  Node* v = g.add_node(scatter ? "AsStridedScatter" : "AsStrided", name + "/strided", ins, {out_name}, at);
  KILN_RETURN_IF_ERROR(infer_node(*v));
  g.replace_all_uses(old, v->outputs[0]);
  return Status::ok();
}

// ---------------------------------------------------------------- batch normalization

/// Eligible BatchNormalization(-Grad): static float shapes, X (N, C, ...) with elements,
/// 1-D per-channel inputs of C elements from input `first_param` on, and an explicit
/// training_mode (without it the run's training flag decides, known only at run time).
/// An evaluation-mode forward qualifies only when nothing reads its statistics outputs.
bool decomposable_bn(const Graph& g, const Node& n, int x_input, int first_param) {
  if (!static_node(n, 5) || !n.attrs.has("training_mode")) return false;
  for (const Value* v : n.inputs)
    if (!is_float(v->dtype)) return false;
  const Shape& x = n.inputs[static_cast<size_t>(x_input)]->shape;
  if (x.rank() < 2 || x.numel() <= 0) return false;
  for (int i = first_param; i < 5; ++i) {
    const Shape& p = n.inputs[static_cast<size_t>(i)]->shape;
    if (p.rank() != 1 || p.dims[0].value != x.dims[1].value) return false;
  }
  if (x_input == 0 && n.attrs.get_int("training_mode", 0) == 0)
    for (size_t o = 1; o < n.outputs.size(); ++o)
      if (used(g, n.outputs[o])) return false;
  return true;
}

/// The per-channel view shared by the batch-norm rewrites: X's reduction axes (all but
/// 1), the broadcast shape (1, C, 1, ..) and the element count per channel.
struct BnView {
  std::vector<int64_t> axes, keep;
  int64_t C = 0;
  double count = 0;
  explicit BnView(const Shape& x) {
    C = x.dims[1].value;
    int64_t per = 1;
    for (int i = 0; i < x.rank(); ++i) {
      keep.push_back(i == 1 ? C : 1);
      if (i != 1) {
        axes.push_back(i);
        per *= x.dims[static_cast<size_t>(i)].value;
      }
    }
    count = static_cast<double>(per);
  }
};

/// f64 builders of the batch-norm rewrites. Each reader of an activation gets its own
/// Cast to f64 (and its own x - mean): fusion then computes them inside every kernel that
/// reads them instead of writing an f64 copy of the activation that several kernels read.
struct BnBuild {
  Builder& b;
  const BnView& v;
  Value* f64(Value* x) { return x->dtype == DType::f64 ? x : b.op("Cast", {x}, cast_to(DType::f64)); }
  /// A (C) parameter as f64 (1, C, 1, ..): reshaped first (a view of the stored tensor),
  /// then cast, so that the Cast has the per-channel shape of the arithmetic that reads it
  /// and fuses into the same kernel (a Cast on (C) before the Reshape was a kernel of its own).
  Value* channel(Value* p) { return f64(b.op("Reshape", {p, b.ints(v.keep)})); }
  Value* c(double x) { return b.scalar(x, DType::f64); }
  Value* sum(Value* x) { return b.op("ReduceSum", {x, b.ints(v.axes)}, make_attrs({{"keepdims", int64_t(1)}})); }
  /// Batch mean and biased variance of `x` in f64 (1, C, 1, ..), two passes as channel_stats.
  std::pair<Value*, Value*> stats(Value* x) {
    Value* mean = b.op("Div", {sum(f64(x)), c(v.count)});
    Value* d = b.op("Sub", {f64(x), mean});
    return {mean, b.op("Div", {sum(b.op("Mul", {d, d})), c(v.count)})};
  }
  /// 1 / sqrt(var + eps).
  Value* inv_std(Value* var, double eps) { return b.op("Div", {c(1.0), b.op("Sqrt", {b.op("Add", {var, c(eps)})})}); }
  /// (1, C, 1, ..) f64 -> (C) in `dt`, the last node's output named `out`: cast in the
  /// per-channel shape (fused with the arithmetic that produced x), then reshaped (a view).
  Value* to_param(Value* x, DType dt, const std::string& out) {
    if (dt != DType::f64) x = b.op("Cast", {x}, cast_to(dt));
    return b.op("Reshape", {x, b.ints({v.C})}, {}, out);
  }
};

/// What a batch-norm rewrite takes from its node, which it then removes: inputs, outputs
/// (and which of them something reads, and their names), mode and epsilon.
struct BnNode {
  std::string name;
  std::vector<Value*> in, old;
  std::vector<bool> need;
  std::vector<std::string> names;
  bool training = false;
  double eps = 1e-5, momentum = 0.9;
};
BnNode detach_bn(Graph& g, Node* n) {
  BnNode d;
  d.name = n->name;
  d.in = n->inputs;
  d.old = n->outputs;
  d.training = n->attrs.get_int("training_mode", 0) != 0;
  d.eps = n->attrs.get_float("epsilon", 1e-5);
  d.momentum = n->attrs.get_float("momentum", 0.9);
  for (Value* o : d.old) {
    d.need.push_back(used(g, o));
    d.names.push_back(o->name);
  }
  g.remove_node(n);
  return d;
}

/// Mean and variance (1, C, 1, ..) f64: the batch's of `x` in training mode, else the
/// given statistics (inputs 3 and 4 of both ops).
std::pair<Value*, Value*> bn_statistics(BnBuild& f, const BnNode& d, Value* x) {
  return d.training ? f.stats(x) : std::make_pair(f.channel(d.in[3]), f.channel(d.in[4]));
}

/// Rewires the readers of each needed output to its replacement in `fresh`.
Status install_bn(Graph& g, Builder& b, const BnNode& d, const std::vector<Value*>& fresh) {
  KILN_RETURN_IF_ERROR(b.status());
  for (size_t o = 0; o < d.old.size(); ++o) {
    if (!d.need[o]) continue;
    if (!fresh[o]) return Status::error("decompose: node '" + d.name + "' could not be rewritten");
    if (fresh[o] != d.old[o]) g.replace_all_uses(d.old[o], fresh[o]);
  }
  return Status::ok();
}

Status decompose_bn(Graph& g, Graph& root, Node* n) {
  const BnNode d = detach_bn(g, n);
  const std::vector<Value*>& in = d.in;
  const BnView view(in[0]->shape);
  Builder b(g, d.name);
  b.set_constant_graph(&root);
  BnBuild f{b, view};
  auto [mean, var] = bn_statistics(f, d, in[0]);
  Value* a = b.op("Mul", {f.channel(in[1]), f.inv_std(var, d.eps)});
  Value* shift = b.op("Sub", {f.channel(in[2]), b.op("Mul", {mean, a})});
  Value* y = b.op("Add", {b.op("Mul", {f.f64(in[0]), a}), shift});
  std::vector<Value*> fresh(d.old.size(), nullptr);
  fresh[0] = in[0]->dtype == DType::f64 ? y : b.op("Cast", {y}, cast_to(d.old[0]->dtype), d.names[0]);
  const double cnt = view.count, mom = d.momentum;
  for (size_t o = 1; o < d.old.size(); ++o) {
    if (!d.need[o]) continue;
    Value* v = nullptr;
    if (o == 1) {
      v = b.op("Add", {b.op("Mul", {f.channel(in[3]), f.c(mom)}), b.op("Mul", {mean, f.c(1 - mom)})});
    } else if (o == 2) {
      Value* unbiased = cnt > 1 ? b.op("Div", {b.op("Mul", {var, f.c(cnt)}), f.c(cnt - 1)}) : var;
      v = b.op("Add", {b.op("Mul", {f.channel(in[4]), f.c(mom)}), b.op("Mul", {unbiased, f.c(1 - mom)})});
    } else {
      v = o == 3 ? mean : var;
    }
    fresh[o] = f.to_param(v, d.old[o]->dtype, d.names[o]);
  }
  return install_bn(g, b, d, fresh);
}

Status decompose_bn_grad(Graph& g, Graph& root, Node* n) {
  const BnNode d = detach_bn(g, n);
  const std::vector<Value*>& in = d.in;  // dY, X, scale, mean, var
  const BnView view(in[1]->shape);
  Builder b(g, d.name);
  b.set_constant_graph(&root);
  BnBuild f{b, view};
  auto [mean, var] = bn_statistics(f, d, in[1]);
  Value* inv = f.inv_std(var, d.eps);
  auto centered = [&, mean = mean] { return b.op("Sub", {f.f64(in[1]), mean}); };
  Value* sb = f.sum(f.f64(in[0]));
  Value* ss = f.sum(b.op("Mul", {b.op("Mul", {f.f64(in[0]), centered()}), inv}));
  Value* scale = f.channel(in[2]);
  Value* dx = nullptr;
  if (d.training) {
    const double cnt = view.count;
    Value* xh = b.op("Mul", {centered(), inv});
    Value* k = b.op("Div", {b.op("Mul", {scale, inv}), f.c(cnt)});
    Value* t = b.op("Sub", {b.op("Sub", {b.op("Mul", {f.c(cnt), f.f64(in[0])}), sb}), b.op("Mul", {xh, ss})});
    dx = b.op("Mul", {k, t});
  } else {
    dx = b.op("Mul", {b.op("Mul", {f.f64(in[0]), scale}), inv});
  }
  std::vector<Value*> fresh(d.old.size(), nullptr);
  fresh[0] = d.old[0]->dtype == DType::f64 ? dx : b.op("Cast", {dx}, cast_to(d.old[0]->dtype), d.names[0]);
  if (d.old.size() > 1 && d.need[1]) fresh[1] = f.to_param(ss, d.old[1]->dtype, d.names[1]);
  if (d.old.size() > 2 && d.need[2]) fresh[2] = f.to_param(sb, d.old[2]->dtype, d.names[2]);
  return install_bn(g, b, d, fresh);
}

}  // namespace

void register_decompositions(OpTable& t) {
  auto set = [&](const char* op, std::function<bool(const Graph&, const Node&)> applies,
                 std::function<Status(Graph&, Graph&, Node*)> rewrite) {
    OpDef* d = t.find_mutable(op);
    d->decomposable = std::move(applies);
    d->decompose = std::move(rewrite);
  };
  set(
      "LayerNormalizationGrad", [](const Graph&, const Node& n) { return decomposable_ln_grad(n); }, decompose_ln_grad);
  set(
      "SoftmaxCrossEntropyLossGrad", [](const Graph&, const Node& n) { return decomposable_sce_grad(n); },
      decompose_sce_grad);
  set("SoftmaxCrossEntropyLoss", decomposable_sce, decompose_sce);
  set(
      "ReduceMean", [](const Graph&, const Node& n) { return decomposable_reduce_mean(n); }, decompose_reduce_mean);
  set("Split", decomposable_split, decompose_split);
  set(
      "BatchNormalization", [](const Graph& g, const Node& n) { return decomposable_bn(g, n, 0, 1); }, decompose_bn);
  set(
      "BatchNormalizationGrad", [](const Graph& g, const Node& n) { return decomposable_bn(g, n, 1, 2); },
      decompose_bn_grad);
  for (const char* op : {"Gather", "GatherElements", "GatherND", "ScatterElements", "ScatterND"})
    set(
        op, [](const Graph&, const Node& n) { return strided_access(n).has_value(); },
        [](Graph& g, Graph&, Node* n) { return decompose_strided(g, n); });
}

}  // namespace kiln::ir
