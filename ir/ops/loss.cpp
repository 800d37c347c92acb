// Op table entries: loss ops (ONNX opsets 13-18) and their kiln-internal backward ops.
//
//   SoftmaxCrossEntropyLoss(scores (N, C, d...), labels (N, d...), weights? (C))
//       -> loss (scalar, or (N, d...) for reduction=none), log_prob? (N, C, d...)
//   NegativeLogLikelihoodLoss(input (N, C, d...), target (N, d...), weight? (C)) -> loss
//
// Attributes reduction (none|sum|mean, default mean) and ignore_index (optional).
// mean divides by the sum of the weights of the non-ignored elements (their count
// without weights), as the ONNX spec and PyTorch do.
// Gradient rules emit SoftmaxCrossEntropyLossGrad / NegativeLogLikelihoodLossGrad
// (onnx = false, not differentiable), which recompute softmax from the scores.
//
// Two kiln-internal ops carry the forward SoftmaxCrossEntropyLoss of the compiled
// pipeline (passes/decompose.cpp), so that its row work is one generated kernel:
//   CheckLabels(labels) -> labels: the labels unchanged; an error names a label outside
//       [0, num_classes) that is not ignore_index (the eager loss kernels' check).
//   SoftmaxCrossEntropyRows(scores (N, C), labels (N, 1), classes (C) = 0..C-1)
//       -> row_loss (N, 1) f64: log(sum_c exp(scores[n, c])) - scores[n, labels[n]] with
//       the row max subtracted first, 0 where labels[n] == ignore_index. A row op
//       (OpDef::row): max, then the sum of exp and the label's score in one pass.
#include "ir/op_table.h"

namespace kiln::ir {

namespace {

bool dims_conflict(const Dim& a, const Dim& b) { return a.is_static() && b.is_static() && a.value != b.value; }

/// Checks (scores, labels, weights?) at input offset `o` and returns the reduction.
Expected<std::string> check_loss_inputs(const InferContext& c, int o) {
  if (!c.has_input(o) || !is_float(c.in[o].dtype)) return c.fail("scores/input must be a float tensor");
  if (!c.has_input(o + 1) || !(c.in[o + 1].dtype == DType::i64 || c.in[o + 1].dtype == DType::i32))
    return c.fail("labels/target must be i64 or i32");
  const Shape& s = c.in[o].shape;
  const Shape& l = c.in[o + 1].shape;
  if (s.rank() < 2) return c.fail("scores must be (N, C, d...), got " + s.to_string());
  if (l.rank() != s.rank() - 1) return c.fail("labels " + l.to_string() + " do not match scores " + s.to_string());
  for (int i = 0; i < l.rank(); ++i)
    if (dims_conflict(l.dims[i], s.dims[i == 0 ? 0 : i + 1]))
      return c.fail("labels " + l.to_string() + " do not match scores " + s.to_string());
  if (c.has_input(o + 2)) {
    const Shape& w = c.in[o + 2].shape;
    if (c.in[o + 2].dtype != c.in[o].dtype) return c.fail("weights must have the dtype of the scores");
    if (w.rank() != 1 || dims_conflict(w.dims[0], s.dims[1]))
      return c.fail("weights must be (C), got " + w.to_string());
  }
  std::string r = c.attrs().get_string("reduction", "mean");
  if (r != "none" && r != "sum" && r != "mean") return c.fail("reduction must be none, sum or mean, got '" + r + "'");
  return r;
}

Status infer_loss(InferContext& c) {
  auto r = check_loss_inputs(c, 0);
  if (!r) return r.status();
  c.out[0] = {c.in[0].dtype, *r == "none" ? c.in[1].shape : Shape()};
  if (c.out.size() > 1) c.out[1] = c.in[0];
  return Status::ok();
}

// *Grad(dLoss, scores, labels, weights?) -> dScores
Status infer_loss_grad(InferContext& c) {
  auto r = check_loss_inputs(c, 1);
  if (!r) return r.status();
  if (!c.has_input(0) || !is_float(c.in[0].dtype)) return c.fail("dLoss must be a float tensor");
  if (*r == "none" ? c.in[0].shape.rank() != c.in[2].shape.rank() : c.in[0].shape.rank() != 0)
    return c.fail("dLoss " + c.in[0].shape.to_string() + " does not match reduction '" + *r + "'");
  c.out[0] = {c.in[1].dtype, c.in[1].shape};
  return Status::ok();
}

Attributes loss_attrs(const Node& n) {
  Attributes a;
  a.set("reduction", n.attrs.get_string("reduction", "mean"));
  if (n.attrs.has("ignore_index")) a.set("ignore_index", n.attrs.get_int("ignore_index", 0));
  return a;
}

Status grad_sce(GradContext& c) {
  if (!c.needs_grad(0)) return Status::ok();
  const Node& n = c.node();
  Value* g = nullptr;
  if (Value* dL = c.grad_output(0)) {
    std::vector<Value*> ins = {dL, c.input(0), c.input(1)};
    if (c.input(2)) ins.push_back(c.input(2));
    g = c.emit1("SoftmaxCrossEntropyLossGrad", ins, loss_attrs(n));
  }
  if (n.num_outputs() > 1) {
    if (Value* dlp = c.grad_output(1)) {
      Attributes a;
      a.set("axis", int64_t(1));
      Value* h = c.emit1("LogSoftmaxGrad", {dlp, c.output(1)}, a);
      g = g ? c.emit1("Add", {g, h}) : h;
    }
  }
  if (g) c.set_grad_input(0, g);
  return Status::ok();
}

Status grad_nll(GradContext& c) {
  Value* dL = c.grad_output(0);
  if (!dL || !c.needs_grad(0)) return Status::ok();
  std::vector<Value*> ins = {dL, c.input(0), c.input(1)};
  if (c.input(2)) ins.push_back(c.input(2));
  c.set_grad_input(0, c.emit1("NegativeLogLikelihoodLossGrad", ins, loss_attrs(c.node())));
  return Status::ok();
}

OpDef loss_def(const char* name, const char* doc, int min_in, int max_in, int max_out, InferFn infer) {
  OpDef d;
  d.name = name;
  d.doc = doc;
  d.min_inputs = min_in;
  d.max_inputs = max_in;
  d.min_outputs = 1;
  d.max_outputs = max_out;
  d.attrs = {{"ignore_index", AttrKind::i}, {"reduction", AttrKind::s}};
  d.infer = std::move(infer);
  d.precision = PrecisionPolicy::fp32;
  d.fusion = FusionClass::reduction;
  return d;
}

// ---- CheckLabels / SoftmaxCrossEntropyRows (see the header)

Status infer_check_labels(InferContext& c) {
  if (!c.has_input(0) || !(c.in[0].dtype == DType::i64 || c.in[0].dtype == DType::i32))
    return c.fail("labels must be i64 or i32");
  if (!c.attrs().has("num_classes") || c.attrs().get_int("num_classes", 0) < 1)
    return c.fail("attribute num_classes must be >= 1");
  c.out[0] = c.in[0];
  return Status::ok();
}

Status infer_sce_rows(InferContext& c) {
  if (!c.has_input(0) || !is_float(c.in[0].dtype) || c.in[0].shape.rank() != 2)
    return c.fail("scores must be a float (N, C) tensor");
  for (int i : {1, 2})
    if (!c.has_input(i) || !(c.in[i].dtype == DType::i64 || c.in[i].dtype == DType::i32))
      return c.fail(std::string(i == 1 ? "labels" : "classes") + " must be i64 or i32");
  const Shape& s = c.in[0].shape;
  const Shape& l = c.in[1].shape;
  const Shape& k = c.in[2].shape;
  if (l.rank() != 2 || dims_conflict(l.dims[0], s.dims[0]) || !(l.dims[1].is_static() && l.dims[1].value == 1))
    return c.fail("labels must be (N, 1) for scores " + s.to_string() + ", got " + l.to_string());
  if (k.rank() != 1 || dims_conflict(k.dims[0], s.dims[1]))
    return c.fail("classes must be (C) for scores " + s.to_string() + ", got " + k.to_string());
  c.out[0] = {DType::f64, Shape({s.dims[0], Dim(1)})};
  return Status::ok();
}

/// Row rule of SoftmaxCrossEntropyRows over the class dim: the max, then exp(x - max)
/// in the scores' compute type (f32 for f32/bf16/f16, as the Softmax row rule) summed in
/// f64, and the label's x - max picked by comparing the class index with the label.
Status sce_rows_row(ScalarBuilder& b, std::vector<ScalarBuilder::Ref>& outs) {
  using Ref = ScalarBuilder::Ref;
  const Node& n = b.node();
  const DType t = b.dtype(b.input(0)), ct = t == DType::f64 ? DType::f64 : DType::f32, wt = DType::f64;
  auto widen = [&](Ref v, DType d) { return b.dtype(v) == d ? v : b.apply(ScalarOp::cast, {v}, d); };
  Ref x = widen(b.input(0), ct);
  Ref z = b.apply(ScalarOp::sub, {x, b.reduce(ScalarOp::max, x)}, ct);
  Ref s = b.reduce(ScalarOp::add, widen(b.apply(ScalarOp::exp, {z}, ct), wt));
  Ref label = widen(b.input(1), DType::i64);
  Ref hit = b.apply(ScalarOp::eq, {widen(b.input(2), DType::i64), label}, DType::boolean);
  Ref picked = b.reduce(ScalarOp::add, b.apply(ScalarOp::select, {hit, widen(z, wt), b.constant(0.0, wt)}, wt));
  Ref loss = b.apply(ScalarOp::sub, {b.apply(ScalarOp::log, {s}, wt), picked}, wt);
  if (n.attrs.has("ignore_index")) {
    Ref ignored = b.apply(ScalarOp::eq, {label, b.constant(double(n.attrs.get_int("ignore_index", 0)), DType::i64)},
                          DType::boolean);
    loss = b.apply(ScalarOp::select, {ignored, b.constant(0.0, wt), loss}, wt);
  }
  outs = {loss};
  return Status::ok();
}

}  // namespace

void register_loss_ops(OpTable& t) {
  OpDef sce = loss_def("SoftmaxCrossEntropyLoss",
                       "Cross entropy of softmax(scores, axis 1) and integer labels (ONNX SoftmaxCrossEntropyLoss-13)",
                       2, 3, 2, infer_loss);
  sce.diff = Differentiability::differentiable;
  sce.grad = grad_sce;
  t.add(std::move(sce));
  OpDef nll = loss_def("NegativeLogLikelihoodLoss",
                       "loss = -input[n, target[n], d...] * weight[target] (ONNX NegativeLogLikelihoodLoss-13)", 2, 3,
                       1, infer_loss);
  nll.diff = Differentiability::differentiable;
  nll.grad = grad_nll;
  t.add(std::move(nll));
  OpDef sg = loss_def("SoftmaxCrossEntropyLossGrad",
                      "kiln: dScores = (softmax(scores) - onehot(labels)) * w * dLoss / denominator from "
                      "(dLoss, scores, labels, weights?)",
                      3, 4, 1, infer_loss_grad);
  sg.onnx = false;
  t.add(std::move(sg));
  OpDef ng =
      loss_def("NegativeLogLikelihoodLossGrad",
               "kiln: dInput = -w * dLoss / denominator at the target class from (dLoss, input, target, weight?)", 3, 4,
               1, infer_loss_grad);
  ng.onnx = false;
  t.add(std::move(ng));

  OpDef cl = make_op("CheckLabels",
                     "kiln: the labels unchanged; error at a label outside [0, num_classes) that is not ignore_index",
                     1, 1, infer_check_labels, PrecisionPolicy::follow_inputs, FusionClass::opaque);
  // label_dims (optional): the labels' dims before they were flattened, for the message.
  cl.attrs = {{"num_classes", AttrKind::i}, {"ignore_index", AttrKind::i}, {"label_dims", AttrKind::ints}};
  cl.onnx = false;
  t.add(std::move(cl));
  OpDef rows = make_op("SoftmaxCrossEntropyRows",
                       "kiln: per-row cross entropy log(sum(exp(scores))) - scores[label] (0 at ignore_index) from "
                       "(scores (N, C), labels (N, 1), classes (C)), f64",
                       3, 3, infer_sce_rows, PrecisionPolicy::fp32, FusionClass::reduction);
  rows.attrs = {{"ignore_index", AttrKind::i}};
  rows.onnx = false;
  rows.row = sce_rows_row;
  rows.row_dims = [](const Node&) -> Expected<std::vector<int>> { return std::vector<int>{1}; };
  t.add(std::move(rows));

  // ONNX schema versions implemented (OpDef::onnx_since; tests/ir/op_table_test.cpp
  // compares them with ONNX's own history).
  set_onnx_since(t, "NegativeLogLikelihoodLoss", {13, 22});
  set_onnx_since(t, "SoftmaxCrossEntropyLoss", {13});
}

}  // namespace kiln::ir
