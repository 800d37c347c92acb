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
    if (w.rank() != 1 || dims_conflict(w.dims[0], s.dims[1])) return c.fail("weights must be (C), got " + w.to_string());
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

}  // namespace

void register_loss_ops(OpTable& t) {
  OpDef sce = loss_def("SoftmaxCrossEntropyLoss",
                       "Cross entropy of softmax(scores, axis 1) and integer labels (ONNX SoftmaxCrossEntropyLoss-13)", 2,
                       3, 2, infer_loss);
  sce.diff = Differentiability::differentiable;
  sce.grad = grad_sce;
  t.add(std::move(sce));
  OpDef nll = loss_def("NegativeLogLikelihoodLoss",
                       "loss = -input[n, target[n], d...] * weight[target] (ONNX NegativeLogLikelihoodLoss-13)", 2, 3, 1,
                       infer_loss);
  nll.diff = Differentiability::differentiable;
  nll.grad = grad_nll;
  t.add(std::move(nll));
  OpDef sg = loss_def("SoftmaxCrossEntropyLossGrad",
                      "kiln: dScores = (softmax(scores) - onehot(labels)) * w * dLoss / denominator from "
                      "(dLoss, scores, labels, weights?)",
                      3, 4, 1, infer_loss_grad);
  sg.onnx = false;
  t.add(std::move(sg));
  OpDef ng = loss_def("NegativeLogLikelihoodLossGrad",
                      "kiln: dInput = -w * dLoss / denominator at the target class from (dLoss, input, target, weight?)", 3,
                      4, 1, infer_loss_grad);
  ng.onnx = false;
  t.add(std::move(ng));
}

}  // namespace kiln::ir
