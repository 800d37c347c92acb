// grad_scaler: dynamic loss scaling for --fp16 (issue 4), as IR, with the
// semantics of torch.cuda.amp.GradScaler / torch.cpu.amp.GradScaler:
//   scale the loss, backprop, unscale the gradients (grad * (1/scale)), look for
//   inf/NaN in any gradient (found_inf); when found, skip the optimizer step and
//   multiply the scale by backoff_factor (0.5) and reset the growth tracker; else
//   take the step and, after growth_interval (2000) consecutive finite steps,
//   multiply the scale by growth_factor (2) if the result stays finite
//   (torch's _amp_update_scale_). Initial scale 65536.
//
// Three passes, one per place in the training pipeline (tools/driver/driver.cpp):
// - loss_scale (before autodiff): adds the state "loss_scale" (f32 scalar) and
//   "growth_tracker" (f32 scalar, consecutive finite steps), both of the kind
//   "grad_scaler" (checkpointed with the optimizer state, never exported as model
//   weights), and the value "loss.scaled" = loss * loss_scale. autodiff then
//   differentiates "loss.scaled" (option loss_output); the graph output "loss"
//   stays the unscaled loss.
// - grad_unscale (after autodiff): every "<param>.grad" becomes
//   (scaled gradient) * Reciprocal(loss_scale), so the optimizer, clipping and
//   `kiln grad` see true gradients. Gradients are f32 (the fp32 master's own dtype).
// - grad_scaler_update (after the optimizer): found_inf = the sum over all
//   gradients of ReduceSum(grad * 0) is not equal to itself (inf * 0 and NaN * 0
//   are NaN; a finite gradient contributes exactly 0, so a large finite gradient
//   never overflows the check as a sum of squares could). Every state output but
//   BatchNorm's running statistics (updated by the forward pass, as in torch where
//   the forward runs on a skipped step too): parameters, optimizer state and the
//   step counter, becomes
//   Where(found_inf, old, new): a skipped step leaves them bit for bit unchanged.
//   Because the step counter does not advance either, the LR schedule and AdamW's
//   bias correction do not advance on a skipped step, as in the Hugging Face
//   Trainer (it steps the LR scheduler only when the optimizer step was not
//   skipped) and torch (AdamW's own step count). The trainer's global step does
//   advance (as HF's global_step does). Graph outputs "found_inf" (bool scalar) and
//   "loss_scale.next" (the scale for the next step) let the trainer log skips.
//
// Options: "loss_scale_init" (65536), "loss_scale_growth_interval" (2000),
// "loss_scale_growth_factor" (2), "loss_scale_backoff_factor" (0.5).
#include <cmath>
#include <limits>

#include "passes/passes.h"
#include "passes/training_util.h"

namespace kiln::passes {

using namespace kiln::ir;

namespace {

/// Adds the scaler state and "loss.scaled" = loss * loss_scale.
class LossScale : public Pass {
 public:
  std::string name() const override { return "loss_scale"; }
  std::string describe_options(const PassOptions& o) const override {
    return OptionText()
        .add("loss_scale_init", o.grad_scaler.init_scale)
        .add("loss_scale_growth_interval", o.grad_scaler.growth_interval)
        .str();
  }
  Expected<bool> run(Graph& g, PassContext& ctx) override {
    Value* loss = g.find_value("loss");
    if (!loss) return Status::error("loss_scale: no 'loss' value (run attach_loss first)");
    if (loss->dtype != DType::f32)
      return Status::error("loss_scale: the loss is " + std::string(dtype_name(loss->dtype)) + ", expected f32");
    if (g.find_value("loss_scale")) return Status::error("loss_scale: the graph already has a value 'loss_scale'");
    const double init = ctx.options.grad_scaler.init_scale;
    if (!(init > 0) || std::isinf(init))
      return Status::error("loss_scale: loss_scale_init must be finite and > 0, got " + format_option(init));
    if (ctx.options.grad_scaler.growth_interval <= 0)
      return Status::error("loss_scale: loss_scale_growth_interval must be > 0");
    Value* scale = g.add_input("loss_scale", DType::f32, Shape());
    Value* tracker = g.add_input("growth_tracker", DType::f32, Shape());
    Tensor s0(DType::f32, {});
    s0.set_f64(0, init);
    g.state.push_back({"grad_scaler", scale, nullptr, std::make_shared<Tensor>(s0)});
    g.state.push_back({"grad_scaler", tracker, nullptr, std::make_shared<Tensor>(Tensor(DType::f32, {}))});
    Builder b(g, "grad_scaler/scale");
    Value* scaled = b.op("Mul", {loss, scale}, {}, "loss.scaled");
    if (!scaled) return b.status();
    return true;
  }
};

/// "<param>.grad" = scaled gradient * (1 / loss_scale).
class GradUnscale : public Pass {
 public:
  std::string name() const override { return "grad_unscale"; }
  Expected<bool> run(Graph& g, PassContext&) override {
    Value* scale = g.find_value("loss_scale");
    if (!scale) return Status::error("grad_unscale: no 'loss_scale' state (run loss_scale before autodiff)");
    Builder b(g, "grad_scaler/unscale");
    Value* inv = b.op("Reciprocal", {scale}, {}, "loss_scale.inv");
    if (!inv) return b.status();
    bool changed = false;
    for (auto& sb : g.state) {
      if (sb.kind != "parameter") continue;
      Value* gr = g.find_value(sb.input->name + ".grad");
      if (!gr) return Status::error("grad_unscale: no gradient '" + sb.input->name + ".grad' (run autodiff first)");
      Node* id = gr->producer;
      // A parameter that does not reach the loss has an Expand of 0: nothing to unscale.
      if (!id || !has_trait(*id, OpTrait::identity)) continue;
      if (gr->dtype != DType::f32)
        return Status::error("grad_unscale: gradient '" + gr->name + "' is " + dtype_name(gr->dtype) +
                             ", expected f32 (fp32 master weights)");
      b.set_prefix(sb.input->name + "/grad/unscale");
      Value* u = b.op("Mul", {id->inputs[0], inv});
      if (!u) return b.status();
      id->inputs[0] = u;
      changed = true;
    }
    // The Mul nodes were appended after their Identity consumers.
    KILN_RETURN_IF_ERROR(g.topo_sort().with_context("grad_unscale"));
    return changed;
  }
};

/// found_inf, Where(found_inf, old, new) on every state output, scale update.
class GradScalerUpdate : public Pass {
 public:
  std::string name() const override { return "grad_scaler_update"; }
  std::string describe_options(const PassOptions& o) const override {
    return OptionText()
        .add("loss_scale_growth_factor", o.grad_scaler.growth_factor)
        .add("loss_scale_backoff_factor", o.grad_scaler.backoff_factor)
        .add("loss_scale_growth_interval", o.grad_scaler.growth_interval)
        .str();
  }
  Expected<bool> run(Graph& g, PassContext& ctx) override {
    StateBinding* scale_sb = nullptr;
    StateBinding* tracker_sb = nullptr;
    for (auto& sb : g.state) {
      if (sb.kind != "grad_scaler") continue;
      if (sb.input->name == "loss_scale") scale_sb = &sb;
      if (sb.input->name == "growth_tracker") tracker_sb = &sb;
    }
    if (!scale_sb || !tracker_sb)
      return Status::error("grad_scaler_update: no 'loss_scale'/'growth_tracker' state (run loss_scale first)");
    Value* scale = scale_sb->input;
    Value* tracker = tracker_sb->input;
    const DType f32 = DType::f32;
    Builder b(g, "grad_scaler/found_inf");
    auto C = [&](double v) { return b.scalar(v, f32); };
    auto kZero = make_attrs({{"keepdims", int64_t(0)}});

    // ---- found_inf: any non-finite element in any gradient ----
    Value* acc = nullptr;
    for (auto& sb : g.state) {
      if (sb.kind != "parameter") continue;
      Value* gr = g.find_value(sb.input->name + ".grad");
      if (!gr) return Status::error("grad_scaler_update: no gradient '" + sb.input->name + ".grad'");
      Value* z = b.op("ReduceSum", {b.op("Mul", {gr, b.scalar(0.0, gr->dtype)})}, kZero);
      if (z && z->dtype != f32) z = b.op("Cast", {z}, make_attrs({{"to", int64_t(dtype_to_onnx(f32))}}));
      acc = acc ? b.op("Add", {acc, z}) : z;
    }
    if (!acc) return Status::error("grad_scaler_update: no trainable parameters");
    Value* found = b.op("Not", {b.op("Equal", {acc, acc})}, {}, "found_inf");
    if (!found) return b.status();

    // ---- skip the step: every state output keeps its old value on found_inf ----
    for (auto& sb : g.state) {
      // BatchNorm running statistics ("buffer") are updated by the forward pass,
      // which runs on a skipped step in torch too.
      if (sb.kind == "grad_scaler" || sb.kind == "buffer" || !sb.output) continue;
      b.set_prefix("grad_scaler/skip/" + sb.input->name);
      Value* w = b.op("Where", {found, sb.input, sb.output}, {}, g.unique_name(sb.output->name + ".checked"));
      if (!w) return b.status();
      for (auto& o : g.outputs)
        if (o == sb.output) o = w;
      sb.output = w;
    }

    // ---- scale update (torch _amp_update_scale_) ----
    b.set_prefix("grad_scaler/update");
    const double growth = ctx.options.grad_scaler.growth_factor;
    const double backoff = ctx.options.grad_scaler.backoff_factor;
    const int64_t interval = ctx.options.grad_scaler.growth_interval;
    Value* succ = b.op("Add", {tracker, C(1.0)});
    Value* grow = b.op("GreaterOrEqual", {succ, C(double(interval))});
    Value* grown = b.op("Mul", {scale, C(growth)});
    Value* grown_ok = b.op("Less", {grown, C(std::numeric_limits<double>::infinity())});
    Value* kept = b.op("Where", {b.op("And", {grow, grown_ok}), grown, scale});
    Value* scale_next = b.op("Where", {found, b.op("Mul", {scale, C(backoff)}), kept}, {}, "loss_scale.next");
    Value* zero = C(0.0);
    Value* tracker_next = b.op("Where", {found, zero, b.op("Where", {grow, zero, succ})}, {}, "growth_tracker.next");
    if (!b.status()) return b.status();
    scale_sb->output = scale_next;
    tracker_sb->output = tracker_next;
    for (Value* v : {found, scale_next, tracker_next})
      if (!g.is_graph_output(v)) g.outputs.push_back(v);
    return true;
  }
};

}  // namespace

std::unique_ptr<Pass> make_loss_scale_pass() { return std::make_unique<LossScale>(); }
std::unique_ptr<Pass> make_grad_unscale_pass() { return std::make_unique<GradUnscale>(); }
std::unique_ptr<Pass> make_grad_scaler_update_pass() { return std::make_unique<GradScalerUpdate>(); }

}  // namespace kiln::passes
