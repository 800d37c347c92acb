// autocast: bf16 mixed precision (issue 4), driven only by OpDef::precision of the
// op table (DESIGN.md invariant 1; no op names appear here).
//
// Runs on the forward training/eval graph after attach_loss and BEFORE autodiff:
// the forward nodes then carry bf16 values, the activations the backward pass
// reads (saved activations) are the bf16 ones, and every gradient rule emits its
// ops on those dtypes, so the backward pass follows without a second autocast.
// The gradient of a Cast casts dy back to the Cast's input dtype (Cast's grad
// rule), so the gradient of the fp32 master parameter arrives in fp32 through its
// `<param>.bf16` Cast, and the optimizer (run after autodiff) stays fp32.
//
// Rules, node by node in graph order (dtypes of inputs are those already decided):
// - low_precision (MatMul, Gemm, Conv and their gradient ops): every float input
//   not already bf16 is cast to bf16; outputs bf16 (kernels accumulate in f32).
//   Except a node of fewer FLOPs (ir::node_cost) than AutocastOptions::min_flops
//   (--autocast_min_flops, by default the CPU's modelled break-even): it stays f32
//   (attribute kiln_autocast_kept = its FLOPs, shown by `kiln inspect --precision`),
//   since its casts and the bf16 pointwise kernels around it cost more than a small
//   product saves; what follows it then follows its f32 output. A node with symbolic
//   dims is decided by its FLOPs at PassOptions::symbol_bounds (the bound a
//   symbolic program is planned at), and takes the low dtype when there are none.
//   (d) A convolution (low_precision, not a product) below its own break-even
//   (AutocastOptions::min_conv_flops) under --bf16 is not kept f32: its values stay bf16
//   (storage, so its saved activations are bf16, as torch.autocast's) and it is marked
//   kiln_compute_f32 = its FLOPs, so its kernel runs oneDNN's f32 primitive, converting
//   the operands in the reorders that stage them into blocked layouts (the f32 blocked
//   kernels beat oneDNN 2.6's bf16 ones below the break-even). autocast_grad marks the
//   backward convolutions (ConvGradInput, ConvGradWeight) the same way, and (e) points
//   every marked node's operand that is the bf16 Cast of a parameter or graph input at
//   the f32 value itself (read_resident_f32).
// - fp32 (Softmax, normalisations, reductions, Exp/Log/..., every loss): every
//   bf16/f16 float input is cast up to f32; outputs f32.
//   (b) fp32 compute, bf16 storage: when every float activation input of an
//   fp32-policy node arrived in bf16 and its single result has their shape
//   (pointwise ops such as Erf/Exp/Log/Pow/Sqrt/Reciprocal, and normalisations
//   along an axis such as Softmax, and BatchNormalization's normalised output, whose
//   running statistics are state outputs that keep f32; not reductions or losses, and
//   not graph or state outputs), the node computes in f32 and its result is stored in
//   bf16: a
//   Cast "<y>.bf16" right after it, read by every other consumer. This is what
//   PyTorch does for GELU and softmax on bf16 tensors under CPU autocast (float
//   math inside the kernel, bf16 out), and keeps those activations bf16 instead
//   of fp32 (issue 4: saved activations <= 55% of fp32's). bf16 only: its range
//   is f32's, while f16 could overflow (Exp), so --fp16 keeps f32 results.
// - follow_inputs (pointwise and view ops): the node runs in the widest float
//   dtype of its *activation* inputs; weak inputs (trainable parameters, other state
//   such as running statistics, constant initializers and, rule (a), any rank-0 value)
//   follow that dtype, as in
//   PyTorch's type promotion, where a 0-dim tensor does not promote a dimensioned
//   one (bf16 tensor * f32 0-dim -> bf16, so x*0.5 and x/sqrt(2) stay bf16) and
//   nn.Linear adds its bias in bf16. With no activation input, the widest of all
//   float inputs.
// - not_float (Cast, Shape, comparisons' int side, ...): untouched.
// Parameters stay fp32 masters; their bf16 copies are Cast nodes named
// "<param>.bf16" placed at the start of the graph (one per parameter, so a later
// pass can hoist them out of a gradient-accumulation loop). Other casts are placed
// right after the producer of the value (one per value and dtype); constant
// initializers are converted at compile time. Graph outputs (the loss, eval
// logits) and state outputs keep their original dtype (cast back when needed).
//
// autocast_grad (after autodiff): the gradient rules emit their ops on the
// forward dtypes, so an fp32-policy op of the backward pass (the ReduceSum of a
// bias gradient, unbroadcast sums) would otherwise run on bf16/f16 values. This
// pass applies the fp32 rule to every such node (low-precision inputs cast up to
// f32 once per value) and casts the result back to the dtype its consumers were
// built for, after any single-use view ops (so cast_simplify removes the cast back
// when the consumer is the cast to the f32 master's gradient).
// Then rule (c), no saved f32 copies of low-precision values: a forward value read
// by the backward pass that is a widening Cast of a bf16/f16 value x (Erf's input,
// the loss's logits) is recomputed for the backward readers by an identical Cast
// of x, placed before the first of them (value "<y>.remat", node
// "<cast>/grad/remat", DESIGN.md convention 3); exact and cheap, so x (2 bytes per
// element) is saved instead of y (4). When x itself is made by a single-output
// pointwise node from constants and one value the backward pass saves anyway, and
// nothing else in the backward pass reads x (GELU's x / sqrt(2) from x), that node
// is recomputed too ("<x>.remat"), again exactly. The backward readers of a
// rule-(b) result read its stored bf16 copy, upcast ("<y>.bf16.f32.remat"), as
// PyTorch's softmax backward reads its saved bf16 output. cast_simplify leaves
// these "/grad/remat" casts alone (it would merge them back into the forward ones).
// Reference: PyTorch autocast (torch/csrc/autograd/autocast_mode.cpp, CPU lists)
// and type promotion (torch.result_type); AOTAutograd's min-cut partitioner makes
// the same recompute-cheap-pointwise choice.
//
// Options: AutocastOptions::dtype = bf16 (default, --bf16) or f16 (--fp16, used with
// the loss scaling of passes/grad_scaler.cpp; every rule above reads "bf16" as
// "the low-precision dtype"; f16 kernels compute in f32 and round on store).
#include <map>
#include <set>

#include "passes/passes.h"
#include "passes/training_util.h"

namespace kiln::passes {

using namespace kiln::ir;

namespace {

int rank_of(DType t) {
  switch (t) {
    case DType::bf16:
    case DType::f16:
      return 1;
    case DType::f32:
      return 2;
    case DType::f64:
      return 3;
    default:
      return 0;
  }
}

/// A deliberate recomputation made by rule (c) (left alone by cast_simplify).
bool is_remat_node(const Node& n) {
  const std::string suffix = "/grad/remat";
  return n.name.size() >= suffix.size() && n.name.compare(n.name.size() - suffix.size(), suffix.size(), suffix) == 0;
}

/// Rule (c), run at the end of autocast_grad: no f32 copy of a low-precision value is
/// saved for the backward pass. For every forward value y read by a backward node:
///  - y = Cast(x) widening a bf16/f16 x to f32 (autocast's input casts of fp32-policy
///    ops, e.g. Erf's input, the loss's logits): the backward readers get an identical
///    Cast of x placed before the first of them ("<y>.remat"), exact, so x is saved;
///  - y = the f32 result of an fp32-policy node whose only forward reader is its
///    narrowing storage Cast y_s (rule (b), e.g. Softmax's output): the backward readers
///    get Cast(y_s) to f32 ("<y_s>.f32.remat"), so y_s is saved, as PyTorch saves the
///    bf16 output of softmax on bf16 inputs.
/// The new nodes are named "<forward cast>/grad/remat" (backward scope, DESIGN.md
/// convention 3).
Expected<bool> remat_saved_casts(Graph& g) {
  const auto& nodes = g.nodes();
  size_t bwd = nodes.size();
  for (size_t i = 0; i < nodes.size(); ++i)
    if (in_grad_scope(nodes[i]->name)) {
      bwd = i;
      break;
    }
  // Forward values to replace: y -> (source value, forward Cast whose name the clone takes).
  struct Plan {
    Value* y;
    Value* src;
    const Node* cast;
  };
  std::vector<Plan> plans;
  std::set<const Node*> forward;
  for (size_t i = 0; i < bwd; ++i) forward.insert(nodes[i].get());
  std::map<const Value*, std::vector<const Node*>> fwd_readers;
  for (size_t i = 0; i < bwd; ++i)
    for (Value* in : nodes[i]->inputs)
      if (in) fwd_readers[in].push_back(nodes[i].get());
  std::set<const Value*> read_by_bwd;
  for (size_t i = bwd; i < nodes.size(); ++i)
    for (Value* in : nodes[i]->inputs)
      if (in && in->producer && forward.count(in->producer)) read_by_bwd.insert(in);
  for (size_t i = 0; i < bwd; ++i) {
    Node* f = nodes[i].get();
    if (f->num_outputs() != 1) continue;
    Value* y = f->outputs[0];
    if (!read_by_bwd.count(y) || y->dtype != DType::f32 || g.is_graph_output(y)) continue;
    if (has_trait(*f, OpTrait::cast)) {
      Value* x = f->input(0);
      if (x && is_float(x->dtype) && rank_of(x->dtype) < rank_of(y->dtype)) plans.push_back({y, x, f});
      continue;
    }
    const OpDef* def = OpTable::get().find(f->op);
    if (!def || def->precision != PrecisionPolicy::fp32) continue;
    auto it = fwd_readers.find(y);
    if (it == fwd_readers.end() || it->second.size() != 1) continue;
    const Node* s = it->second[0];
    if (has_trait(*s, OpTrait::cast) && rank_of(s->outputs[0]->dtype) == 1) plans.push_back({y, s->outputs[0], s});
  }
  for (const Plan& pl : plans) {
    std::vector<Node*> readers;
    for (auto& u : g.uses(pl.y))
      if (!forward.count(u.user)) readers.push_back(u.user);
    if (readers.empty()) continue;
    int first = g.index_of(readers[0]);
    for (Node* r : readers) first = std::min(first, g.index_of(r));
    const bool exact = pl.src == pl.cast->input(0);
    const std::string out = exact ? pl.y->name + ".remat" : pl.src->name + ".f32.remat";
    Node* c = g.insert_node(static_cast<size_t>(first), "Cast", pl.cast->name + "/grad/remat", {pl.src}, {out},
                            make_attrs({{"to", int64_t(dtype_to_onnx(DType::f32))}}));
    KILN_RETURN_IF_ERROR(infer_node(*c).with_context("autocast_grad (rule c)"));
    // The source itself is recomputed too when that saves it and is exact and free of
    // new saved bytes: a single-output pointwise node of the forward pass (x / sqrt(2)
    // before GELU's Erf) whose only non-constant input is saved anyway and whose value
    // no backward node reads but this Cast.
    Node* sp = pl.src->producer;
    const OpDef* sd = sp ? OpTable::get().find(sp->op) : nullptr;
    if (exact && sp && forward.count(sp) && sd && sd->fusion == FusionClass::pointwise && sp->num_outputs() == 1 &&
        !read_by_bwd.count(pl.src) && sp->regions.empty()) {
      Value* act = nullptr;
      int acts = 0;
      for (Value* in : sp->inputs)
        if (in && !in->is_initializer()) act = in, ++acts;
      if (acts == 1 && read_by_bwd.count(act)) {
        Node* r = g.insert_node(static_cast<size_t>(g.index_of(c)), sp->op, sp->name + "/grad/remat", sp->inputs,
                                {pl.src->name + ".remat"}, sp->attrs);
        KILN_RETURN_IF_ERROR(infer_node(*r).with_context("autocast_grad (rule c)"));
        c->inputs[0] = r->outputs[0];
      }
    }
    for (Node* r : readers)
      for (auto& in : r->inputs)
        if (in == pl.y) in = c->outputs[0];
  }
  return !plans.empty();
}

/// Rule (d): marks convolution-class node `n` (low_precision, not a matrix product) of
/// fewer FLOPs than `min_conv_flops` kiln_compute_f32 = its FLOPs when the low-precision
/// dtype is bf16: its values stay bf16 (storage, saved activations) and its kernel
/// computes in f32 (runtime/kernels/onednn.h, prepare_conv). Returns whether it marked.
bool mark_compute_f32(Node& n, DType low, double min_conv_flops) {
  if (low != DType::bf16 || min_conv_flops <= 0 || has_trait(n, OpTrait::matmul) || !n.shapes_static()) return false;
  const OpDef* def = OpTable::get().find(n.op);
  if (!def || def->precision != PrecisionPolicy::low_precision) return false;
  const double flops = node_cost(n).flops;
  if (flops >= min_conv_flops) return false;
  n.attrs.set("kiln_compute_f32", flops);
  return true;
}

/// Rule (e), run at the end of autocast_grad (the training step; an eval graph keeps its
/// casts): a node marked kiln_compute_f32 by rule (d) computes in f32, so an operand
/// that is the bf16 Cast of an f32 value the step holds anyway (a parameter's f32 master,
/// a graph input such as the batch) is read in f32 instead. The Cast would only round it,
/// at the price of a kernel, a copy and, when the backward pass reads it, saved bytes or a
/// recomputation; the node then computes with the unrounded operand (more precise than
/// torch.autocast, which rounds the weights). Casts left without readers are removed.
bool read_resident_f32(Graph& g) {
  std::set<const Value*> resident(g.inputs.begin(), g.inputs.end());
  for (auto& sb : g.state)
    if (sb.input) resident.insert(sb.input);
  bool changed = false;
  for (auto& n : g.nodes()) {
    if (!n->attrs.has("kiln_compute_f32")) continue;
    for (auto& in : n->inputs) {
      Node* c = in ? in->producer : nullptr;
      if (!c || in->dtype != DType::bf16 || !has_trait(*c, OpTrait::cast)) continue;
      Value* src = c->input(0);
      if (!src || src->dtype != DType::f32 || !(resident.count(src) || src->is_initializer())) continue;
      in = src;
      changed = true;
    }
  }
  if (changed) g.dead_code_elimination();
  return changed;
}

class Autocast : public Pass {
 public:
  std::string name() const override { return "autocast"; }
  std::string describe_options(const PassOptions& o) const override {
    OptionText t;
    t.add("autocast_dtype", dtype_name(o.autocast.dtype))
        .add("autocast_min_flops", o.autocast.min_flops)
        .add("autocast_min_conv_flops", o.autocast.min_conv_flops);
    if (!o.symbol_bounds.empty()) {
      std::string b;
      for (const auto& [s, v] : o.symbol_bounds) b += (b.empty() ? "" : ",") + s + "=" + std::to_string(v);
      t.add("symbol_bounds", b);
    }
    return t.str();
  }

  Expected<bool> run(Graph& g, PassContext& ctx) override {
    const DType want = ctx.options.autocast.dtype;
    const double min_product_flops = ctx.options.autocast.min_flops;
    const double min_conv_flops = ctx.options.autocast.min_conv_flops;
    if (want != DType::bf16 && want != DType::f16)
      return Status::error("autocast: unsupported autocast dtype '" + std::string(dtype_name(want)) +
                           "' (expected bf16 or f16)");
    low_ = want;
    params_.clear();
    state_.clear();
    cache_.clear();
    for (auto& sb : g.state)
      if (sb.kind == "parameter")
        params_.insert(sb.input);
      else if (sb.input)
        state_.insert(sb.input);  // buffers: BatchNormalization's running statistics

    // Original dtypes of graph outputs and state outputs, restored at the end.
    std::vector<std::pair<Value*, DType>> keep;
    for (Value* o : g.outputs) keep.push_back({o, o->dtype});
    for (auto& sb : g.state)
      if (sb.output) keep.push_back({sb.output, sb.output->dtype});

    std::vector<Node*> order;
    for (auto& n : g.nodes()) order.push_back(n.get());
    const auto& table = OpTable::get();
    bool changed = false;
    for (Node* n : order) {
      const OpDef* def = table.find(n->op);
      if (!def) return Status::error("autocast: node '" + n->name + "': op '" + n->op + "' is not in the op table");
      const PrecisionPolicy p = def->precision;
      // Inputs may have changed dtype upstream: every node is re-inferred (below,
      // once its inputs agree with the policy).
      if (p == PrecisionPolicy::not_float) {
        Status s = infer_node(*n);
        if (!s) return s.with_context("autocast");
        continue;
      }
      DType target = DType::undefined;
      if (p == PrecisionPolicy::low_precision) {
        target = low_;
        // Too small to pay for its casts (AutocastOptions::min_flops): f32, unless an
        // input is already wider (it then follows, as follow_inputs would).
        const double min_flops = has_trait(*n, OpTrait::matmul) ? min_product_flops : min_conv_flops;
        const auto& bounds = ctx.options.symbol_bounds;
        if (min_flops > 0 && (n->shapes_static() || !bounds.empty())) {
          const double flops = node_cost_at(*n, bounds).flops;
          if (flops < min_flops && mark_compute_f32(*n, low_, min_conv_flops)) {
            // A convolution: bf16 storage, f32 compute (rule (d)).
          } else if (flops < min_flops) {
            target = DType::f32;
            for (Value* in : n->inputs)
              if (in && is_float(in->dtype) && rank_of(in->dtype) > rank_of(target)) target = in->dtype;
            n->attrs.set("kiln_autocast_kept", flops);
          }
        }
      } else if (p == PrecisionPolicy::fp32) {
        target = DType::f32;
      } else {  // follow_inputs
        DType strong = DType::undefined, any = DType::undefined;
        for (Value* in : n->inputs) {
          if (!in || !is_float(in->dtype)) continue;
          if (rank_of(in->dtype) > rank_of(any)) any = in->dtype;
          if (!is_weak(in) && rank_of(in->dtype) > rank_of(strong)) strong = in->dtype;
        }
        target = strong != DType::undefined ? strong : any;
      }
      // Rule (b) precondition, read before any input is cast: every float activation
      // input arrives in the low-precision dtype.
      bool all_low = false;
      const Value* first_act = nullptr;
      if (p == PrecisionPolicy::fp32) {
        int acts = 0, lows = 0;
        for (Value* in : n->inputs) {
          if (!in || !is_float(in->dtype) || is_weak(in)) continue;
          if (!first_act) first_act = in;
          ++acts;
          lows += in->dtype == low_;
        }
        all_low = acts > 0 && acts == lows;
      }
      bool node_changed = false;
      // Pass 0 converts activations and parameters; pass 1 converts constant
      // initializers only when the node does not infer or not to `target` without
      // (so e.g. Dropout's ratio keeps its exact f32 value).
      for (int pass = 0; pass < 2; ++pass) {
        for (int i = 0; i < n->num_inputs(); ++i) {
          Value* in = n->inputs[i];
          if (target == DType::undefined || !in || !is_float(in->dtype) || in->dtype == target) continue;
          // fp32 ops only upcast low-precision inputs (an f64 input stays f64).
          if (p == PrecisionPolicy::fp32 && rank_of(in->dtype) >= rank_of(DType::f32)) continue;
          bool constant = in->is_initializer() && !params_.count(in);
          if (constant != (pass == 1)) continue;
          KILN_ASSIGN_OR_RETURN(Value * c, cast_of(g, in, target));
          n->inputs[i] = c;
          node_changed = true;
        }
        Status s = infer_node(*n);
        bool ok = s.is_ok() && (target == DType::undefined || n->outputs.empty() || !is_float(n->outputs[0]->dtype) ||
                                n->outputs[0]->dtype == target);
        if (ok) break;
        if (pass == 1) {
          if (!s) return s.with_context("autocast");
          return Status::error("autocast: node '" + n->name + "' (" + n->op + ") computes in " +
                               dtype_name(n->outputs[0]->dtype) + ", policy " + precision_policy_name(p) + " wants " +
                               dtype_name(target));
        }
      }
      changed = changed || node_changed;
      if (all_low && low_ == DType::bf16 && stores_low(g, *n, first_act, keep)) {
        KILN_RETURN_IF_ERROR(store_low(g, n));
        changed = true;
      }
    }
    // Graph outputs and state outputs keep their dtype.
    for (auto& [v, dt] : keep) {
      if (v->dtype == dt || !is_float(dt)) continue;
      restore_dtype(g, v, dt);
      changed = true;
    }
    return changed;
  }

 private:
  /// Parameters, other state (buffers), constant initializers and rank-0 values follow the activations' dtype
  /// (rule (a): PyTorch type promotion, where a 0-dim tensor does not promote a
  /// dimensioned one of the same category: bf16 tensor * f32 0-dim -> bf16).
  bool is_weak(const Value* v) const {
    return params_.count(v) || state_.count(v) || v->is_initializer() || v->shape.rank() == 0;
  }

  /// Rule (b): whether the f32 result of fp32-policy node `n`, all of whose float
  /// activation inputs arrived in bf16, is stored in bf16: one float output, shaped
  /// like its first activation input (pointwise ops and normalisations along an axis;
  /// not reductions or losses, whose results change shape), and neither a graph output
  /// nor a state output (those keep their dtype).
  static bool stores_low(const Graph& g, const Node& n, const Value* first_act,
                         const std::vector<std::pair<Value*, DType>>& keep) {
    if (n.num_outputs() < 1 || !first_act) return false;
    const Value* y = n.outputs[0];
    if (y->dtype != DType::f32 || !(y->shape == first_act->shape) || g.is_graph_output(y)) return false;
    for (auto& [v, dt] : keep)
      if (v == y) return false;
    return true;
  }

  /// Rule (b): casts the f32 result y of `n` to the low-precision dtype right after `n`
  /// ("autocast/<y>.bf16", the stored value) and points every other reader of y at it.
  /// The grad rule of `n` still reads y; autocast_grad points those backward reads at
  /// the stored value (rule (c)).
  Status store_low(Graph& g, Node* n) {
    Value* y = n->outputs[0];
    const std::string nm = y->name + "." + dtype_name(low_);
    Node* c = g.insert_node(static_cast<size_t>(g.index_of(n)) + 1, "Cast", "autocast/" + nm, {y}, {nm},
                            make_attrs({{"to", int64_t(dtype_to_onnx(low_))}}));
    KILN_RETURN_IF_ERROR(infer_node(*c).with_context("autocast"));
    for (auto& other : g.nodes())
      if (other.get() != c)
        for (auto& in : other->inputs)
          if (in == y) in = c->outputs[0];
    cache_[std::make_pair(y, low_)] = c->outputs[0];
    return Status::ok();
  }

  /// The value `v` converted to `dt`: a compile-time converted initializer for
  /// constants, else a Cast node (cached per value and dtype).
  Expected<Value*> cast_of(Graph& g, Value* v, DType dt) {
    auto key = std::make_pair(v, dt);
    auto it = cache_.find(key);
    if (it != cache_.end()) return it->second;
    const std::string nm = v->name + "." + dtype_name(dt);
    Value* out;
    Node* pr = v->producer;
    const OpDef* pdef = pr ? OpTable::get().find(pr->op) : nullptr;
    int float_ins = 0;
    Value* src = nullptr;
    if (pr)
      for (Value* in : pr->inputs)
        if (in && is_float(in->dtype)) ++float_ins, src = in;
    if (pdef && pdef->fusion == FusionClass::view && pr->num_outputs() == 1 && float_ins == 1 && params_.count(src)) {
      // A view of a parameter (the exported W^T of nn.Linear): cast the parameter
      // ("<param>.bf16") and repeat the view on the copy, so the cast is per parameter.
      KILN_ASSIGN_OR_RETURN(Value * cs, cast_of(g, src, dt));
      std::vector<Value*> ins = pr->inputs;
      for (auto& in : ins)
        if (in == src) in = cs;
      size_t pos = static_cast<size_t>(std::max(g.index_of(pr), g.index_of(cs->producer)) + 1);
      Node* c = g.insert_node(pos, pr->op, pr->name + "/" + dtype_name(dt), ins, {nm}, pr->attrs);
      KILN_RETURN_IF_ERROR(infer_node(*c).with_context("autocast"));
      out = c->outputs[0];
    } else if (v->is_initializer() && !params_.count(v)) {
      out = g.add_initializer(g.unique_name(nm), v->data->cast(dt));
    } else {
      size_t pos = 0;
      if (v->producer) pos = static_cast<size_t>(g.index_of(v->producer)) + 1;
      Node* c =
          g.insert_node(pos, "Cast", "autocast/" + nm, {v}, {nm}, make_attrs({{"to", int64_t(dtype_to_onnx(dt))}}));
      KILN_RETURN_IF_ERROR(infer_node(*c).with_context("autocast"));
      out = c->outputs[0];
    }
    cache_[key] = out;
    return out;
  }

  /// Makes graph/state output `v` carry dtype `dt` again: its producer writes a
  /// fresh low-precision value and a Cast node produces `v` (same name) from it.
  void restore_dtype(Graph& g, Value* v, DType dt) {
    Node* p = v->producer;
    if (!p) return;
    Value* low = g.new_value(v->name + "." + dtype_name(v->dtype), v->dtype, v->shape);
    low->producer = p;
    low->producer_output = v->producer_output;
    p->outputs[v->producer_output] = low;
    for (auto& n : g.nodes())
      for (auto& in : n->inputs)
        if (in == v) in = low;
    int pos = g.index_of(p) + 1;
    Node* c = g.insert_node(static_cast<size_t>(pos), "Cast", "autocast/" + v->name + ".restore", {low}, {},
                            make_attrs({{"to", int64_t(dtype_to_onnx(dt))}}));
    c->outputs.push_back(v);
    v->producer = c;
    v->producer_output = 0;
    v->dtype = dt;
  }

  DType low_ = DType::bf16;
  std::set<const Value*> params_;
  std::set<const Value*> state_;  ///< state inputs other than parameters (weak, like them)
  std::map<std::pair<Value*, DType>, Value*> cache_;
};

/// cast_simplify: see passes/passes.h.
class CastSimplify : public Pass {
 public:
  std::string name() const override { return "cast_simplify"; }
  Expected<bool> run(Graph& g, PassContext&) override {
    bool changed = false;
    auto cast_to = [](const Node* n) {
      auto dt = dtype_from_onnx(static_cast<int>(n->attrs.get_int("to", 0)));
      return dt ? *dt : DType::undefined;
    };
    bool again = true;
    while (again) {
      again = false;
      std::map<std::pair<Value*, int64_t>, Value*> seen;
      std::vector<Node*> order;
      for (auto& n : g.nodes()) order.push_back(n.get());
      for (Node* n : order) {
        if (!has_trait(*n, OpTrait::cast) || !n->input(0) || is_remat_node(*n)) continue;
        Value* x = n->input(0);
        Value* y = n->outputs[0];
        if (g.is_graph_output(y)) continue;  // keep output names and producers
        DType to = cast_to(n);
        // (1) a cast to the input's own dtype is an identity.
        if (to == x->dtype) {
          g.replace_all_uses(y, x);
          again = changed = true;
          continue;
        }
        // (2) duplicate cast of one value to one dtype: keep the first.
        auto key = std::make_pair(x, n->attrs.get_int("to", 0));
        auto s = seen.find(key);
        if (s != seen.end()) {
          g.replace_all_uses(y, s->second);
          again = changed = true;
          continue;
        }
        seen[key] = y;
        // (3) round trip Cast(Cast(a -> m) -> dtype(a)).
        Node* inner = x->producer;
        if (inner && has_trait(*inner, OpTrait::cast) && inner->input(0) && inner->input(0)->dtype == to &&
            is_float(to) && is_float(x->dtype)) {
          Value* a = inner->input(0);
          bool widening_first = rank_of(x->dtype) >= rank_of(a->dtype);  // exact: bf16 -> f32 -> bf16
          auto uses = g.uses(x);
          bool only_user = uses.size() == 1 && !g.is_graph_output(x);
          if (widening_first || only_user) {
            g.replace_all_uses(y, a);
            again = changed = true;
            continue;
          }
        }
      }
      if (again) g.dead_code_elimination();
    }
    return changed;
  }
};

/// autocast_grad: see passes/passes.h and the file comment.
class AutocastGrad : public Pass {
 public:
  std::string name() const override { return "autocast_grad"; }
  Expected<bool> run(Graph& g, PassContext& ctx) override {
    const auto& table = OpTable::get();
    std::map<Value*, Value*> up;  // low-precision value -> its f32 copy
    std::vector<Node*> order;
    for (auto& n : g.nodes()) order.push_back(n.get());
    bool changed = false;
    for (Node* n : order) {
      // Rule (d) for the backward pass's convolutions (ConvGradInput, ConvGradWeight) on
      // bf16 operands.
      bool bf16_in = false;
      for (Value* in : n->inputs) bf16_in = bf16_in || (in && in->dtype == DType::bf16);
      if (bf16_in && !n->attrs.has("kiln_compute_f32") &&
          mark_compute_f32(*n, ctx.options.autocast.dtype, ctx.options.autocast.min_conv_flops))
        changed = true;
      const OpDef* def = table.find(n->op);
      if (!def || def->precision != PrecisionPolicy::fp32) continue;
      bool low_in = false;
      for (Value* in : n->inputs) low_in = low_in || (in && rank_of(in->dtype) == 1);
      if (!low_in) continue;
      std::vector<DType> before;
      for (Value* o : n->outputs) before.push_back(o->dtype);
      for (auto& in : n->inputs) {
        if (!in || rank_of(in->dtype) != 1) continue;
        auto it = up.find(in);
        if (it == up.end()) {
          Node* c = g.insert_node(static_cast<size_t>(g.index_of(n)), "Cast", "autocast_grad/" + in->name + ".f32",
                                  {in}, {in->name + ".f32"}, make_attrs({{"to", int64_t(dtype_to_onnx(DType::f32))}}));
          KILN_RETURN_IF_ERROR(infer_node(*c).with_context("autocast_grad"));
          it = up.emplace(in, c->outputs[0]).first;
        }
        in = it->second;
      }
      KILN_RETURN_IF_ERROR(infer_node(*n).with_context("autocast_grad: node '" + n->name + "'"));
      changed = true;
      for (size_t i = 0; i < n->outputs.size(); ++i) {
        Value* cur = n->outputs[i];
        if (cur->dtype == before[i] || !is_float(before[i])) continue;
        // Sink the cast back through single-use view ops (the bias gradient's
        // Reshape), so a following cast to f32 (the master's gradient) cancels it
        // in cast_simplify and the reduced value never goes through low precision.
        for (;;) {
          auto uses = g.uses(cur);
          if (uses.size() != 1 || g.is_graph_output(cur)) break;
          Node* u = uses[0].user;
          const OpDef* ud = table.find(u->op);
          int floats = 0;
          for (Value* in : u->inputs) floats += in && is_float(in->dtype);
          if (!ud || ud->fusion != FusionClass::view || floats != 1 || u->num_outputs() != 1) break;
          KILN_RETURN_IF_ERROR(infer_node(*u).with_context("autocast_grad"));
          cur = u->outputs[0];
        }
        auto uses = g.uses(cur);
        Node* c = g.insert_node(
            static_cast<size_t>(g.index_of(cur->producer) + 1), "Cast", "autocast_grad/" + cur->name + ".restore",
            {cur}, {cur->name + "." + dtype_name(before[i])}, make_attrs({{"to", int64_t(dtype_to_onnx(before[i]))}}));
        KILN_RETURN_IF_ERROR(infer_node(*c).with_context("autocast_grad"));
        for (auto& use : uses) use.user->inputs[use.index] = c->outputs[0];
        for (auto& o : g.outputs)
          if (o == cur) o = c->outputs[0];
      }
    }
    KILN_ASSIGN_OR_RETURN(bool remat, remat_saved_casts(g));
    return read_resident_f32(g) || changed || remat;
  }
};

}  // namespace

std::unique_ptr<Pass> make_autocast_grad_pass() { return std::make_unique<AutocastGrad>(); }
std::unique_ptr<Pass> make_autocast_pass() { return std::make_unique<Autocast>(); }
std::unique_ptr<Pass> make_cast_simplify_pass() { return std::make_unique<CastSimplify>(); }

}  // namespace kiln::passes
