// optimizer: appends gradient clipping, the learning-rate schedule and the
// optimizer update to a differentiated training graph, as ordinary IR ops, so
// later passes can fuse them (DESIGN.md convention 11).
//
// Semantics follow PyTorch and Hugging Face exactly:
// - global L2 norm clipping as torch.nn.utils.clip_grad_norm_: norm over all
//   parameter gradients, coef = min(max_grad_norm / (norm + 1e-6), 1); the
//   pre-clip norm is the output "grad_norm" (0 max_grad_norm: no clipping and no norm,
//   as Hugging Face's Trainer, which logs grad_norm only when it clips). The squares
//   are summed in blocks of 256 elements, then the block sums in parameter order, so
//   that ZeRO-1 (zero_shards, below) reproduces the norm bit for bit.
// - schedules as transformers.get_scheduler with t = optimizer steps taken so far
//   (the state counter "step"): linear, cosine (half a cycle), constant,
//   constant_with_warmup; warmup multiplies by t / warmup_steps. Output
//   "learning_rate" is the rate used by this step.
// - adamw_torch = torch.optim.AdamW: p -= lr*wd*p (decoupled), m = b1 m + (1-b1) g,
//   v = b2 v + (1-b2) g^2, p -= lr/(1-b1^t) * m / (sqrt(v)/sqrt(1-b2^t) + eps),
//   with t = step + 1.
// - Weight decay (both optimizers) applies only to parameters of rank >= 2: no
//   decay on biases and norm scales, as Hugging Face's Trainer groups parameters.
// - sgd = torch.optim.SGD: g += wd*p; buf = g on the first step, else
//   momentum*buf + g; nesterov uses g + momentum*buf; p -= lr*g.
// - adamw_8bit (alias adamw_bnb_8bit) = bitsandbytes' blockwise 8-bit AdamW (Dettmers
//   et al. 2021): parameters with >= 4096 elements (min_8bit_size) keep both moments as
//   uint8 codes "<param>.exp_avg.q8" / "<param>.exp_avg_sq.q8" (u8[numel]) with one f32
//   absmax per 256 elements "<param>.exp_avg.absmax" / "<param>.exp_avg_sq.absmax"
//   (dynamic tree maps: signed for exp_avg, unsigned for exp_avg_sq; the maps are the
//   initializers "optimizer/qmap.signed" and "optimizer/qmap.unsigned"). Each such
//   parameter is updated by ONE AdamW8bitUpdate node (dequantize, the adamw_torch
//   update above with the clipping coefficient applied to the gradient first,
//   requantize). Smaller parameters use the adamw_torch ops with fp32 state.
// Optimizer state is carried as StateBinding kind "optimizer_state", named
// "<param>.exp_avg", "<param>.exp_avg_sq" or "<param>.momentum_buffer" (8-bit: above).
#include <cmath>

#include "ir/ops/optim8bit.h"
#include "passes/passes.h"
#include "passes/training_util.h"

namespace kiln::passes {

using namespace kiln::ir;

namespace {

class Optimizer : public Pass {
 public:
  std::string name() const override { return "optimizer"; }
  std::string describe_options(const PassOptions& o) const override {
    const OptimizerOptions& oo = o.optimizer;
    OptionText t;
    t.add("optim", oo.optim).add("learning_rate", oo.learning_rate);
    if (oo.optim == "sgd")
      t.add("momentum", oo.momentum).add("nesterov", oo.nesterov);
    else
      t.add("adam_beta1", oo.adam_beta1).add("adam_beta2", oo.adam_beta2).add("adam_epsilon", oo.adam_epsilon);
    return t.add("weight_decay", oo.weight_decay)
        .add("max_grad_norm", oo.max_grad_norm)
        .add("lr_scheduler_type", oo.lr_scheduler_type)
        .add("total_steps", oo.total_steps)
        .add("warmup_steps", oo.warmup_steps)
        .add("zero_shards", oo.zero_shards)
        .str();
  }
  Expected<bool> run(Graph& g, PassContext& ctx) override {
    const OptimizerOptions& oo = ctx.options.optimizer;
    const std::string& optim = oo.optim;
    const bool eightbit = optim == "adamw_8bit" || optim == "adamw_bnb_8bit";
    const bool adam = optim == "adamw_torch" || eightbit;
    if (!adam && optim != "sgd")
      return Status::error("unknown --optim '" + optim + "' (expected adamw_torch, adamw_8bit or sgd)");
    Value* loss = g.find_value("loss");
    if (!loss) return Status::error("no 'loss' value");
    // Indices, not pointers: g.state grows below (the step counter).
    std::vector<size_t> param_idx;
    for (size_t i = 0; i < g.state.size(); ++i)
      if (g.state[i].kind == "parameter") param_idx.push_back(i);
    std::vector<StateBinding> params_copy;
    for (size_t i : param_idx) params_copy.push_back(g.state[i]);
    std::vector<StateBinding*> params;
    for (auto& sb : params_copy) params.push_back(&sb);
    std::vector<Value*> grads;
    for (auto* sb : params) {
      Value* gr = g.find_value(sb->input->name + ".grad");
      if (!gr) return Status::error("no gradient '" + sb->input->name + ".grad' (run autodiff first)");
      grads.push_back(gr);
    }
    if (params.empty()) return Status::error("no trainable parameters");
    const DType dt = params[0]->input->dtype;
    Builder b(g, "optimizer");
    auto C = [&](double v) { return b.scalar(v, dt); };
    auto kZero = make_attrs({{"keepdims", int64_t(0)}});

    // ---- ZeRO-1: the optimizer runs on this rank's shard of each parameter ----
    // (DeepSpeed's stage 1; issue 35) Every parameter and its gradient are read through
    // Shard (the rank's slice, whole 256-element blocks: ir::shard_elems), the state holds
    // the shard only, and the updated shards are all-gathered into the whole parameter.
    // passes/data_parallel.cpp turns the gradients' all-reduce into a reduce-scatter.
    const int64_t shards = oo.zero_shards;
    std::vector<Value*> full_params;  // the parameters themselves (sharded or not)
    for (auto* sb : params) full_params.push_back(sb->input);
    std::vector<Value*> views = full_params;  // what each update reads: the parameter or its shard
    if (shards > 1)
      for (size_t i = 0; i < params.size(); ++i) {
        b.set_prefix("optimizer/" + full_params[i]->name);
        const int64_t se = shard_elems(full_params[i]->shape.numel(), shards);
        Attributes sa;
        sa.set("shard_elems", se);
        views[i] = b.op("Shard", {full_params[i]}, sa, full_params[i]->name + ".shard");
        grads[i] = b.op("Shard", {grads[i]}, sa, grads[i]->name + ".shard");
      }

    // ---- global gradient norm and clipping ----
    // The sum of squares in blocks of 256 elements: each gradient's squares summed per
    // block (the last one zero-padded), the block sums of every parameter concatenated in
    // parameter order, then summed. ZeRO-1's shards are whole blocks, so a sharded job
    // computes the same block sums on their owners and, all-gathered and put back in that
    // order, the same norm bit for bit (a sum of per-shard partial sums would associate
    // the additions otherwise).
    // Only with clipping (max_grad_norm > 0): Hugging Face's Trainer computes and logs
    // grad_norm only when it clips, and without it the norm is a reduction per parameter
    // that nothing reads (about 8% of a small MLP's step).
    const double max_norm = oo.max_grad_norm;
    Value* norm = nullptr;
    Value* coef = nullptr;
    b.set_prefix("optimizer/clip");
    if (max_norm > 0) {
      constexpr int64_t kNormBlock = kBlockSize8bit;  // ir::shard_elems cuts ZeRO-1 shards on these blocks
      std::vector<Value*> partials;
      for (Value* gr : grads) {
        const int64_t n = gr->shape.numel(), m = (n + kNormBlock - 1) / kNormBlock;
        // The views first, so that fusion makes the squares the reduction's prologue.
        Value* flat = b.op("Reshape", {gr, b.ints({n})});
        if (m * kNormBlock != n) flat = b.op("Pad", {flat, b.ints({0, m * kNormBlock - n})});
        Value* blocks = b.op("Reshape", {flat, b.ints({m, kNormBlock})});
        partials.push_back(b.op("ReduceSum", {b.op("Mul", {blocks, blocks}), b.ints({1})}, kZero));  // (m)
      }
      Value* block_sums =
          partials.size() == 1 ? partials[0] : b.op("Concat", partials, make_attrs({{"axis", int64_t(0)}}));
      if (shards > 1) {
        // ZeRO-1: every rank's block sums (rank-major), then the real blocks in parameter
        // order, as one process holds them.
        int64_t local = 0;  // block sums on each rank
        std::vector<int64_t> offset;
        for (Value* gr : grads) {
          offset.push_back(local);
          local += gr->shape.numel() / kNormBlock;
        }
        std::vector<int64_t> order;
        for (size_t i = 0; i < grads.size(); ++i) {
          const int64_t per_rank = grads[i]->shape.numel() / kNormBlock;
          const int64_t blocks = (full_params[i]->shape.numel() + kNormBlock - 1) / kNormBlock;
          for (int64_t j = 0; j < blocks; ++j) order.push_back(j / per_rank * local + offset[i] + j % per_rank);
        }
        Value* all = b.op("AllGather", {block_sums}, make_attrs({{"shape", std::vector<int64_t>{shards * local}}}),
                          "optimizer/clip/block_sums");
        block_sums = b.op("Gather", {all, b.ints(order)}, make_attrs({{"axis", int64_t(0)}}));
      }
      Value* sq = b.op("ReduceSum", {block_sums}, kZero);
      norm = b.op("Sqrt", {sq}, {}, "grad_norm");
      coef = b.op("Min", {b.op("Div", {C(max_norm), b.op("Add", {norm, C(1e-6)})}), C(1.0)});
    }

    // ---- step counter and LR schedule ----
    b.set_prefix("optimizer/schedule");
    Value* step = g.add_input("step", dt, Shape());
    {
      Tensor zero(dt, {});
      g.state.push_back({"counter", step, nullptr, std::make_shared<Tensor>(zero)});
    }
    Value* step_next = b.op("Add", {step, C(1.0)}, {}, "step.next");
    const double base_lr = oo.learning_rate;
    const int64_t total = oo.total_steps;
    const int64_t warmup = oo.warmup_steps;
    const std::string& sched = oo.lr_scheduler_type;
    // factor(t): warmup ramp t/W for t < W, then the schedule's decay. T, W and
    // max(1, T - W) are scalar inputs whose defaults are this build's values: the trainer
    // feeds its run's counts, so the program serves any --max_steps (ir::kScheduleTotalInput).
    auto setting = [&](const char* name, double v) {
      if (Value* have = g.find_value(name)) return have;
      Value* in = g.add_input(name, dt, Shape());
      Tensor t(dt, {});
      t.set_f64(0, v);
      g.input_defaults[name] = std::make_shared<Tensor>(std::move(t));
      return in;
    };
    auto total_in = [&] { return setting(kScheduleTotalInput, double(total)); };
    auto warmup_in = [&] { return setting(kScheduleWarmupInput, double(warmup)); };
    auto decay_in = [&] { return setting(kScheduleDecayInput, double(std::max<int64_t>(1, total - warmup))); };
    Value* decay;
    if (sched == "linear") {
      Value* rem = b.op("Div", {b.op("Sub", {total_in(), step}), decay_in()});
      decay = b.op("Max", {rem, C(0.0)});
    } else if (sched == "cosine") {
      Value* progress = b.op("Div", {b.op("Sub", {step, warmup_in()}), decay_in()});
      Value* c = b.op("Cos", {b.op("Mul", {progress, C(M_PI)})});
      decay = b.op("Max", {b.op("Mul", {C(0.5), b.op("Add", {C(1.0), c})}), C(0.0)});
    } else if (sched == "constant" || sched == "constant_with_warmup") {
      decay = C(1.0);
    } else {
      return Status::error("unknown --lr_scheduler_type '" + sched +
                           "' (expected linear, cosine, constant, constant_with_warmup)");
    }
    Value* factor = decay;
    // With warmup (--warmup_steps or --warmup_ratio) W >= 1 for every run length.
    if (warmup > 0 && sched != "constant") {
      Value* ramp = b.op("Div", {step, warmup_in()});
      factor = b.op("Where", {b.op("Less", {step, warmup_in()}), ramp, decay});
    }
    Value* lr = b.op("Mul", {factor, C(base_lr)}, {}, "learning_rate");

    // ---- per-parameter update ----
    const double wd = oo.weight_decay;
    const double b1 = oo.adam_beta1, b2 = oo.adam_beta2;
    const double eps = oo.adam_epsilon;
    const double momentum = oo.momentum;
    const bool nesterov = oo.nesterov;
    Value *bc1 = nullptr, *step_size = nullptr, *sqrt_bc2 = nullptr, *first = nullptr;
    if (adam) {
      bc1 = b.op("Sub", {C(1.0), b.op("Pow", {C(b1), step_next})});
      sqrt_bc2 = b.op("Sqrt", {b.op("Sub", {C(1.0), b.op("Pow", {C(b2), step_next})})});
      step_size = b.op("Div", {lr, bc1});
    } else if (momentum != 0) {
      first = b.op("Equal", {step, C(0.0)});
    }
    std::vector<StateBinding> new_state;
    Value *qmap_s = nullptr, *qmap_u = nullptr;  // 8-bit maps, created with the first 8-bit parameter
    for (size_t i = 0; i < params.size(); ++i) {
      Value* const whole = full_params[i];
      b.set_prefix("optimizer/" + whole->name);
      Value* gr = grads[i];
      // A parameter that nothing computes with (it does not reach the loss: its gradient
      // is autodiff's zero Expand) is not decayed either: PyTorch's optimizers skip a
      // parameter whose .grad is None. Its zero gradient leaves Adam's and SGD's steps 0.
      // (Decided on the whole parameter, as 8-bit or fp32 state is, before sharding.)
      const bool decay_this =
          wd != 0 && whole->shape.rank() >= 2 && g.uses(whole).size() > (shards > 1 ? size_t(1) : size_t(0));
      const bool use_8bit = eightbit && dt == DType::f32 && whole->shape.numel() >= kMin8bitSize;
      Value* p = views[i];  // the parameter, or its shard (ZeRO-1)
      const std::string pname = whole->name;
      const std::string next_name = shards > 1 ? pname + ".shard.next" : pname + ".next";
      // Binds a state input to its next value; ZeRO-1 states hold a shard of `full` elements.
      auto bind = [&](Value* in, Value* out, std::vector<int64_t> full) {
        new_state.push_back({"optimizer_state", in, out, std::make_shared<Tensor>(in->dtype, in->shape.to_vector()),
                             shards > 1 ? std::move(full) : std::vector<int64_t>{}});
      };
      const std::vector<int64_t> full_dims = whole->shape.to_vector();
      const int64_t full_n = whole->shape.numel();
      Value* p_new;
      if (use_8bit) {
        // One fused node: dequantize -> AdamW -> requantize (ir/ops/optim8bit.cpp).
        if (!qmap_s) {
          auto ms = create_dynamic_map(true), mu = create_dynamic_map(false);
          qmap_s = g.add_initializer("optimizer/qmap.signed", Tensor::from_f32(ms, {kQuantMapSize}));
          qmap_u = g.add_initializer("optimizer/qmap.unsigned", Tensor::from_f32(mu, {kQuantMapSize}));
        }
        const int64_t n = p->shape.numel(), nb = num_blocks_8bit(n);
        Value* q1 = g.add_input(pname + ".exp_avg.q8", DType::u8, Shape::of({n}));
        Value* a1 = g.add_input(pname + ".exp_avg.absmax", DType::f32, Shape::of({nb}));
        Value* q2 = g.add_input(pname + ".exp_avg_sq.q8", DType::u8, Shape::of({n}));
        Value* a2 = g.add_input(pname + ".exp_avg_sq.absmax", DType::f32, Shape::of({nb}));
        std::vector<Value*> ins = {p, gr, q1, a1, q2, a2, qmap_s, qmap_u, lr, step_size, sqrt_bc2};
        if (coef) ins.push_back(coef);
        Attributes at = make_attrs({{"beta1", b1},
                                    {"beta2", b2},
                                    {"eps", eps},
                                    {"weight_decay", decay_this ? wd : 0.0},
                                    {"blocksize", kBlockSize8bit}});
        Node* nd = g.add_node("AdamW8bitUpdate", "optimizer/" + pname + "/AdamW8bitUpdate", ins,
                              {next_name, pname + ".exp_avg.q8.next", pname + ".exp_avg.absmax.next",
                               pname + ".exp_avg_sq.q8.next", pname + ".exp_avg_sq.absmax.next"},
                              std::move(at));
        KILN_RETURN_IF_ERROR(infer_node(*nd));
        p_new = nd->outputs[0];
        bind(q1, nd->outputs[1], {full_n});
        bind(a1, nd->outputs[2], {num_blocks_8bit(full_n)});
        bind(q2, nd->outputs[3], {full_n});
        bind(a2, nd->outputs[4], {num_blocks_8bit(full_n)});
      } else {
        if (coef) gr = b.op("Mul", {gr, coef});
        if (adam) {
          Value* m = g.add_input(pname + ".exp_avg", dt, p->shape);
          Value* v = g.add_input(pname + ".exp_avg_sq", dt, p->shape);
          Value* pd = p;
          if (decay_this) pd = b.op("Sub", {p, b.op("Mul", {p, b.op("Mul", {lr, C(wd)})})});
          Value* m_new =
              b.op("Add", {b.op("Mul", {m, C(b1)}), b.op("Mul", {gr, C(1.0 - b1)})}, {}, pname + ".exp_avg.next");
          Value* v_new = b.op("Add", {b.op("Mul", {v, C(b2)}), b.op("Mul", {b.op("Mul", {gr, gr}), C(1.0 - b2)})}, {},
                              pname + ".exp_avg_sq.next");
          Value* denom = b.op("Add", {b.op("Div", {b.op("Sqrt", {v_new}), sqrt_bc2}), C(eps)});
          p_new = b.op("Sub", {pd, b.op("Mul", {step_size, b.op("Div", {m_new, denom})})}, {}, next_name);
          bind(m, m_new, full_dims);
          bind(v, v_new, full_dims);
        } else {
          Value* d = gr;
          if (decay_this) d = b.op("Add", {d, b.op("Mul", {p, C(wd)})});
          if (momentum != 0) {
            Value* buf = g.add_input(pname + ".momentum_buffer", dt, p->shape);
            Value* upd = b.op("Add", {b.op("Mul", {buf, C(momentum)}), d});
            Value* buf_new = b.op("Where", {first, d, upd}, {}, pname + ".momentum_buffer.next");
            bind(buf, buf_new, full_dims);
            d = nesterov ? b.op("Add", {d, b.op("Mul", {buf_new, C(momentum)})}) : buf_new;
          }
          p_new = b.op("Sub", {p, b.op("Mul", {d, lr})}, {}, next_name);
        }
      }
      // ZeRO-1: every rank's updated shard, gathered into the whole parameter.
      if (shards > 1)
        p_new = b.op("AllGather", {p_new}, make_attrs({{"shape", whole->shape.to_vector()}}), pname + ".next");
      g.state[param_idx[i]].output = p_new;
    }
    if (!b.status()) return b.status();
    for (auto& sb : g.state)
      if (sb.kind == "counter" && sb.input == step) sb.output = step_next;
    for (auto& sb : new_state) g.state.push_back(sb);
    g.outputs.clear();
    g.outputs.push_back(loss);
    if (norm) g.outputs.push_back(norm);
    g.outputs.push_back(lr);
    for (auto& sb : g.state)
      if (sb.output && !g.is_graph_output(sb.output)) g.outputs.push_back(sb.output);
    return true;
  }
};

}  // namespace

std::unique_ptr<Pass> make_optimizer_pass() { return std::make_unique<Optimizer>(); }

}  // namespace kiln::passes
