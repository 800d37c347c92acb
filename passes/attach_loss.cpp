// attach_loss: turns an imported forward graph into the forward half of a
// training (or evaluation) program.
//
// 1. Trainable parameters: every floating-point initializer (not bool, not a
//    constant produced by an exported Constant node, i.e. not named "/..."), minus
//    BatchNormalization running statistics, minus those matching LossOptions::freeze
//    (or only those matching "trainable"). In mode "train" each becomes a graph
//    input with a StateBinding of kind "parameter" (its ONNX initializer is the
//    initial value); in mode "eval" it becomes a plain input of the same name.
//    A parameter used by two nodes (tied weights) stays one value, so autodiff
//    sums its gradients once.
// 2. Mode: "train" sets BatchNormalization training_mode=1 with running-stat
//    outputs bound as state of kind "buffer" (updated once per forward) and gives
//    every Dropout a mask output (reused by its gradient) and a stable Philox id
//    (attribute kiln_rng_id, DESIGN.md invariant 6); "eval" sets training_mode=0.
//    Dropout's training_mode input is dropped: the run's training flag decides.
//    LossOptions::disable_dropout turns every Dropout into Identity (dropout p = 0).
// 3. Loss (LossOptions::loss), PyTorch semantics, on the model output named by
//    "logits_output" (default: the first graph output):
//    cross_entropy: logits (..., C) and int64 labels (...), mean over labels !=
//      ignore_index, optional label_smoothing (torch.nn.functional.cross_entropy);
//    mse / l1: mean of squared / absolute error, labels shaped like the output;
//    bce_with_logits: mean of max(x,0) - x*y + log(1 + exp(-|x|));
//    model: the model's scalar output is the loss.
//    Labels come from a new graph input named by "label_input" (default "labels").
//    Outputs become ["loss"] in train mode, ["loss", logits] in eval mode.
// 4. Gradient accumulation (AccumulationOptions::gradient_accumulation_steps N > 1, train mode):
//    with accumulation_normalization "tokens" (default for cross_entropy) the loss
//    is the sum over this microbatch's non-ignored labels divided by a new scalar
//    input "num_items_in_batch" (the count over all N microbatches, fed with the
//    step: runtime::count_num_items); with "microbatch" the mean loss is scaled by 1/N.
#include <algorithm>
#include <map>
#include <regex>
#include <set>

#include "passes/passes.h"
#include "passes/training_util.h"

namespace kiln::passes {

using namespace kiln::ir;

namespace {

void add_output(Graph& g, Node* n, const std::string& name) {
  Value* v = g.new_value(name);
  v->producer = n;
  v->producer_output = n->num_outputs();
  n->outputs.push_back(v);
}

class AttachLoss : public Pass {
 public:
  std::string name() const override { return "attach_loss"; }
  Expected<bool> run(Graph& g, PassContext& ctx) override {
    const LossOptions& lo = ctx.options.loss;
    const bool train = ctx.options.mode == Mode::train;
    const std::string& loss_kind = lo.loss;
    if (g.outputs.empty()) return Status::error("model has no outputs");
    const std::string& label_name = lo.label_input;
    // The names kiln adds must not be the model's own values: the label input is reused
    // only where the model already takes it as a graph input (it is fed the labels), and
    // "num_items_in_batch" is the token count that the trainer feeds by that name.
    if (loss_kind != "model") {
      Value* v = g.find_value(label_name);
      if (v && (v->is_initializer() || v->producer))
        return Status::error(
            "the model already has a value named '" + label_name + "' (" +
            (v->producer ? "computed by node '" + v->producer->name + "'" : std::string("a parameter or constant")) +
            "); the labels would replace it: rename it in the model, or name the label input "
            "otherwise with --label_input");
    }
    if (g.find_value(kNumItemsInput))
      return Status::error(std::string("the model has a value named '") + kNumItemsInput +
                           "', the input through which kiln feeds the token count of gradient accumulation; "
                           "rename it in the model");

    // --- BatchNormalization running statistics ---
    const std::unordered_set<const Value*> bn_stats = batchnorm_statistics(g);

    // --- parameters ---
    std::regex freeze_re, train_re;
    const std::string &freeze = lo.freeze, &trainable = lo.trainable;
    try {
      if (!freeze.empty()) freeze_re = std::regex(freeze);
      if (!trainable.empty()) train_re = std::regex(trainable);
    } catch (const std::regex_error& e) {
      return Status::error("--freeze/--trainable: invalid regular expression: " + std::string(e.what()));
    }
    std::vector<Value*> inits = g.initializers, keep;
    if (!freeze.empty()) {
      // A pattern that freezes nothing is most likely a typo: say so rather than train all.
      std::string example;
      bool any = false;
      for (Value* v : inits)
        if (is_parameter_candidate(*v) && !bn_stats.count(v)) {
          any = any || std::regex_search(v->name, freeze_re);
          if (example.empty()) example = v->name;
        }
      if (!any && !example.empty())
        return Status::error("--freeze '" + freeze + "' matches no parameter (names look like '" + example +
                             "'; kiln inspect MODEL lists them)");
    }
    for (Value* v : inits) {
      bool param = is_parameter_candidate(*v) && !bn_stats.count(v);
      if (param && !trainable.empty() && !std::regex_search(v->name, train_re)) param = false;
      if (param && !freeze.empty() && std::regex_search(v->name, freeze_re)) param = false;
      bool as_input = param || bn_stats.count(v);
      if (!as_input) {
        keep.push_back(v);
        continue;
      }
      std::shared_ptr<Tensor> init = v->data;
      v->data = nullptr;
      g.inputs.push_back(v);
      if (train && param) g.state.push_back({"parameter", v, nullptr, init});
      if (!train || !param) init_values_[v] = init;
    }
    g.initializers = keep;

    // --- BatchNormalization / Dropout modes ---
    int rng_id = 0;
    for (auto& np : g.nodes()) {
      Node* n = np.get();
      if (has_trait(*n, OpTrait::running_stats)) {
        n->attrs.set("training_mode", int64_t(train ? 1 : 0));
        if (train) {
          while (n->num_outputs() < 3) add_output(g, n, n->name + "/running_stat");
          for (int i = 3; i <= 4; ++i) {
            Value* stat = n->input(i);
            if (stat && bn_stats.count(stat))
              g.state.push_back({"buffer", stat, n->outputs[i - 2], init_values_[stat]});
          }
        } else {
          while (n->num_outputs() > 1 && g.uses(n->outputs.back()).empty()) n->outputs.pop_back();
        }
        KILN_RETURN_IF_ERROR(infer_node(*n));
      } else if (has_trait(*n, OpTrait::dropout) && train && lo.disable_dropout) {
        n->op = "Identity";
        n->inputs.resize(1);
        n->attrs = Attributes();
        while (n->num_outputs() > 1) {
          Value* mask = n->outputs.back();
          if (!g.uses(mask).empty() || g.is_graph_output(mask))
            return Status::error("node '" + n->name + "': Dropout mask is used; cannot disable dropout");
          n->outputs.pop_back();
        }
        KILN_RETURN_IF_ERROR(infer_node(*n));
      } else if (has_trait(*n, OpTrait::dropout)) {
        if (n->num_inputs() > 2) n->inputs.resize(2);
        n->attrs.set("kiln_rng_id", int64_t(++rng_id));
        if (train && n->num_outputs() < 2) add_output(g, n, n->outputs[0]->name + "/mask");
        KILN_RETURN_IF_ERROR(infer_node(*n));
      }
    }

    // --- loss ---
    Value* logits = g.outputs[0];
    if (!lo.logits_output.empty()) {
      logits = nullptr;
      for (Value* o : g.outputs)
        if (o->name == lo.logits_output) logits = o;
      if (!logits) return Status::error("model has no output named '" + lo.logits_output + "'");
    }
    Builder b(g, "loss");
    Value* loss = nullptr;
    // Gradient accumulation (passes/accumulation.cpp): how microbatch losses combine.
    // A data-parallel job (passes/data_parallel.cpp) sums the gradients of world_size
    // ranks: its microbatches are the N ranks' accumulation steps together, so the loss
    // is normalized as if one process accumulated accum * world_size microbatches.
    const int64_t accum = train ? ctx.options.accumulation.gradient_accumulation_steps *
                                      std::max<int64_t>(1, ctx.options.data_parallel.world_size)
                                : 1;
    std::string norm = ctx.options.accumulation.normalization;
    if (norm.empty()) norm = loss_kind == "cross_entropy" ? "tokens" : "microbatch";
    if (norm != "tokens" && norm != "microbatch")
      return Status::error("unknown --accumulation_normalization '" + norm + "' (expected tokens or microbatch)");
    if (accum > 1 && norm == "tokens" && loss_kind != "cross_entropy")
      return Status::error("--accumulation_normalization tokens needs --loss cross_entropy (got " + loss_kind + ")");
    const bool tokens_norm = accum > 1 && norm == "tokens";
    if (loss_kind == "model") {
      if (logits->shape.numel() != 1)
        return Status::error("--loss model: output '" + logits->name + "' is not a scalar (shape " +
                             logits->shape.to_string() + ")");
      loss = logits->shape.rank() == 0 ? logits : b.op("Reshape", {logits, b.ints({})});
    } else if (loss_kind == "cross_entropy") {
      if (!is_float(logits->dtype))
        return Status::error("cross_entropy needs float logits; output '" + logits->name + "' is " +
                             std::string(dtype_name(logits->dtype)));
      if (logits->shape.rank() == 0)
        return Status::error("cross_entropy needs logits of shape (..., classes); output '" + logits->name +
                             "' is a scalar: if the model computes its own loss (an export with labels), train it "
                             "with --loss model");
      // Every dim known (static, or a symbolic expression of the inputs' dims, issue
      // 32), the classes static.
      const std::vector<Dim>& dims = logits->shape.dims;
      bool unknown = !dims.back().is_static();
      for (const Dim& d : dims) unknown |= d.is_unknown();
      if (unknown) {
        std::string syms;  // the unbound dims, for the hint
        for (const auto& d : dims)
          if (!d.symbol().empty()) syms += (syms.empty() ? "" : ", ") + d.symbol();
        return Status::error(
            "cross_entropy needs logits of shape (..., classes) with known dims and static classes; "
            "got " +
            logits->shape.to_string() +
            (syms.empty() ? std::string()
                          : " (bind " + syms +
                                " with --shape NAME=N, or a sequence length with "
                                "--block_size N for token data)"));
      }
      const Dim classes = dims.back();
      const std::vector<Dim> label_dims(dims.begin(), dims.end() - 1);
      Value* labels = g.find_value(label_name);
      if (!labels) labels = g.add_input(label_name, DType::i64, Shape(label_dims));
      Dim rows(1);
      for (const Dim& d : label_dims) rows = rows * d;
      Value* x = logits;
      Value* y = labels;
      if (dims.size() != 2) {
        x = b.op("Reshape", {logits, b.dims({rows, classes})});
        y = b.op("Reshape", {labels, b.dims({rows})});
      }
      int64_t ignore = lo.ignore_index;
      double eps = lo.label_smoothing;
      // Gradient accumulation with token normalization: the sum over this
      // microbatch's real labels divided by the count over the whole step
      // (input num_items_in_batch, counted by whoever feeds the step).
      Value* num_items = nullptr;
      if (tokens_norm) num_items = g.add_input(kNumItemsInput, x->dtype, Shape());
      auto sce_attrs = make_attrs({{"reduction", std::string(num_items ? "sum" : "mean")}, {"ignore_index", ignore}});
      if (eps <= 0) {
        loss = b.op("SoftmaxCrossEntropyLoss", {x, y}, sce_attrs);
        if (num_items) loss = b.op("Div", {loss, num_items});
      } else {
        Value* lp = b.op("LogSoftmax", {x}, make_attrs({{"axis", int64_t(1)}}));
        Value* nll = b.op("NegativeLogLikelihoodLoss", {lp, y}, sce_attrs);
        Value* row_mean =
            b.op("ReduceMean", {lp}, make_attrs({{"axes", std::vector<int64_t>{1}}, {"keepdims", int64_t(0)}}));
        Value* valid = b.op("Cast", {b.op("Not", {b.op("Equal", {y, b.ints({ignore})})})},
                            make_attrs({{"to", int64_t(dtype_to_onnx(x->dtype))}}));
        Value* smooth_sum = b.op("ReduceSum", {b.op("Mul", {row_mean, valid})}, make_attrs({{"keepdims", int64_t(0)}}));
        Value* count = num_items ? num_items : b.op("ReduceSum", {valid}, make_attrs({{"keepdims", int64_t(0)}}));
        if (num_items) nll = b.op("Div", {nll, num_items});
        Value* smooth = b.op("Neg", {b.op("Div", {smooth_sum, count})});
        loss = b.op(
            "Add", {b.op("Mul", {nll, b.scalar(1.0 - eps, x->dtype)}), b.op("Mul", {smooth, b.scalar(eps, x->dtype)})});
      }
    } else if (loss_kind == "mse" || loss_kind == "l1" || loss_kind == "bce_with_logits") {
      Value* labels = g.find_value(label_name);
      if (!labels) labels = g.add_input(label_name, logits->dtype, logits->shape);
      Value* per;
      if (loss_kind == "mse") {
        Value* d = b.op("Sub", {logits, labels});
        per = b.op("Mul", {d, d});
      } else if (loss_kind == "l1") {
        per = b.op("Abs", {b.op("Sub", {logits, labels})});
      } else {
        Value* relu = b.op("Relu", {logits});
        Value* xy = b.op("Mul", {logits, labels});
        Value* sp = b.op("Softplus", {b.op("Neg", {b.op("Abs", {logits})})});
        per = b.op("Add", {b.op("Sub", {relu, xy}), sp});
      }
      loss = b.op("ReduceMean", {per}, make_attrs({{"keepdims", int64_t(0)}}));
    } else {
      return Status::error("unknown --loss '" + loss_kind +
                           "' (expected cross_entropy, mse, bce_with_logits, l1, model)");
    }
    if (accum > 1 && !tokens_norm && loss) loss = b.op("Mul", {loss, b.scalar(1.0 / double(accum), loss->dtype)});
    if (!b.status()) return b.status().with_context("building the " + loss_kind + " loss");
    // The program's output is named "loss". A model value of that name (the output of a
    // --loss model export, now scaled for accumulation) keeps its place under another name.
    if (loss->name != "loss")
      if (Value* taken = g.find_value("loss"); taken && taken->producer) g.rename_value(taken, "model_loss");
    if (loss->name != "loss") loss = b.op("Identity", {loss}, {}, "loss");
    if (!b.status()) return b.status();
    if (loss->name != "loss") return Status::error("the model already has a value named 'loss'; rename it");
    g.outputs.clear();
    g.outputs.push_back(loss);
    if (!train) g.outputs.push_back(logits);
    return true;
  }
  std::string describe_options(const PassOptions& o) const override {
    const LossOptions& lo = o.loss;
    return OptionText()
        .add("mode", mode_name(o.mode))
        .add("loss", lo.loss)
        .add("label_input", lo.label_input)
        .add("logits_output", lo.logits_output)
        .add("ignore_index", lo.ignore_index)
        .add("label_smoothing", lo.label_smoothing)
        .add("freeze", lo.freeze)
        .add("trainable", lo.trainable)
        .add("disable_dropout", lo.disable_dropout)
        .add("gradient_accumulation_steps", o.accumulation.gradient_accumulation_steps)
        .add("accumulation_normalization", o.accumulation.normalization)
        .add("world_size", o.data_parallel.world_size)
        .str();
  }

 private:
  std::map<Value*, std::shared_ptr<Tensor>> init_values_;
};

}  // namespace

std::unique_ptr<Pass> make_attach_loss_pass() { return std::make_unique<AttachLoss>(); }

}  // namespace kiln::passes
