// Compiled backend against eager (DESIGN.md invariant 4, issue 7's differential tests):
// whole training steps of every example with --backend compiled (fusion pass, kernel
// IR, LLVM-generated kernels) and with --backend eager (the interpreter, op by op),
// from the same initial state on the same PyTorch fixture batches. Losses of every
// step and every state tensor after the last step (parameters, optimizer state,
// BatchNorm buffers) must agree: fp32 within 1e-5 relative, bf16/fp16 within 1e-2
// (relative L2 per tensor; losses relative per step). The matrix covers fp32 and
// bf16, every remat policy, gradient accumulation, and adamw_torch, adamw_8bit, sgd.
// The eager reference is an independent implementation: hand-written kernels per op,
// against generated code from the scalar rules.
#include <cmath>
#include <optional>
#include <set>

#include "codegen/cpu/program.h"
#include "e2e_util.h"
#include "tools/driver/train_run.h"

using namespace kiln;
using namespace kiln::testing;

namespace {

using Case = ExampleCase;

runtime::TrainConfig config_of(const Case& c, const std::string& backend, int64_t rows) {
  return example_case_config(c, backend, rows);
}

/// The training step of `c` for `rows` fixture rows, built for the eager and the compiled backend.
void build_both(const Case& c, int64_t rows, std::optional<driver::TrainingProgram>& eager,
                std::optional<driver::TrainingProgram>& compiled) {
  auto e = driver::build_training_program(config_of(c, "eager", rows), nullptr, false, false, c.steps);
  ASSERT_TRUE(e) << e.message();
  auto k = driver::build_training_program(config_of(c, "compiled", rows), nullptr, false, false, c.steps);
  ASSERT_TRUE(k) << k.message();
  eager.emplace(std::move(*e));
  compiled.emplace(std::move(*k));
}

class CompiledVsEager : public ::testing::TestWithParam<Case> {};

TEST_P(CompiledVsEager, LossesAndStateAgree) {
  const Case& c = GetParam();
  auto [xs, ys] = load_trajectory(c.model);
  ASSERT_TRUE(xs && ys);
  const int64_t rows = xs->dim(1);
  std::optional<driver::TrainingProgram> eager, compiled;
  build_both(c, rows, eager, compiled);
  if (HasFatalFailure()) return;
  ASSERT_NE(compiled->train_kernels, nullptr);
  EXPECT_GT(compiled->train_kernels->kernels.size(), 0u) << "no generated kernel";
  EXPECT_EQ(eager->train_kernels, nullptr);

  std::map<std::string, ir::Tensor> se, sc;
  auto le = trajectory_losses(*eager, *xs, *ys, c.steps, false, &se);
  int64_t donated = 0;  // the compiled step runs as the Trainer runs it: state donated
  auto lc = trajectory_losses(*compiled, *xs, *ys, c.steps, false, &sc, true, nullptr, &donated);
  ASSERT_EQ(le.size(), static_cast<size_t>(c.steps));
  ASSERT_EQ(lc.size(), le.size());
  const double tol = c.precision == "fp32" ? 1e-5 : 1e-2;
  for (size_t i = 0; i < le.size(); ++i)
    EXPECT_NEAR(lc[i], le[i], tol * std::max(1.0, std::fabs(le[i]))) << "step " << i;
  ASSERT_EQ(se.size(), sc.size());
  for (auto& [name, t] : se) {
    ASSERT_TRUE(sc.count(name)) << name;
    const ir::Tensor& u = sc.at(name);
    ASSERT_EQ(u.dims(), t.dims()) << name;
    if (!ir::is_float(t.dtype())) {
      // Integer state (8-bit codes, the step counter): codes may differ by one
      // quantization step where the fp32 inputs differ in the last ulp. Near zero the
      // dynamic map's gaps shrink to about 1e-7 of the block's absmax, so a moment that
      // differs in its last bits may move a code further: at most 0.1% of the codes in
      // fp32; in bf16 the moments agree to about 1e-2 (the float tolerance): 2%.
      int64_t diff = 0;
      for (int64_t i = 0; i < t.numel(); ++i) diff += std::llabs(u.get_i64(i) - t.get_i64(i)) > 1;
      const int64_t allowed = c.precision == "fp32" ? t.numel() / 1000 : t.numel() / 50;
      EXPECT_LE(diff, allowed) << name << ": " << diff << " of " << t.numel() << " codes";
      continue;
    }
    const std::string suffix = "attn.c_attn.bias";
    if (c.optim != "sgd" && name.size() > suffix.size() &&
        name.compare(name.size() - suffix.size(), suffix.size(), suffix) == 0) {
      // The key third of the fused q|k|v bias has an exactly zero gradient (softmax is
      // invariant to the per-query constant q.b_k), so its computed gradient is rounding
      // noise, and Adam's m / sqrt(v) turns any noise into steps of about lr: eager and
      // compiled arithmetic (f32 exp, other summation orders) give different noise.
      // The q and v thirds must agree at the tolerance; the k third only within the
      // AdamW step bound 2 * lr * steps.
      const int64_t third = t.numel() / 3;
      double dq = 0, nq = 0, kmax = 0;
      for (int64_t i = 0; i < t.numel(); ++i) {
        const double a = u.get_f64(i), b = t.get_f64(i);
        if (i >= third && i < 2 * third) {
          kmax = std::max(kmax, std::fabs(a - b));
        } else {
          dq += (a - b) * (a - b);
          nq += b * b;
        }
      }
      EXPECT_LE(std::sqrt(dq / std::max(nq, 1e-30)), tol) << name << " (q and v thirds)";
      EXPECT_LE(kmax, 2 * 1e-3 * c.steps) << name << " (k third)";
      continue;
    }
    EXPECT_LE(rel_l2(u, t), tol) << name;
  }
}

// Issue 7: "compiled peak memory no higher than eager's". The planned peaks that kiln
// bench reports (driver::executor_plan, which kiln bench also measures against) of the
// same training step built for each backend, for the examples among issue 7's benchmark
// models. The compiled step donates the old state's buffers to the optimizer's update
// kernels (kiln_donate): without that, its multi-tensor update held the old and the new
// state and every gradient at once (mlp_digits 479.8 KiB against eager's 438.7,
// resnet18 4.84 MiB against 4.30).
// resnet18 with SGD (no optimizer state: each new parameter takes its dying gradient's
// buffer, kiln_inplace) planned 2.13 MiB against 1.77 measured and eager's 1.77: the
// planner counted each such buffer twice over the multi-tensor group.
TEST(CompiledPeak, NoHigherThanEagerOnTheBenchmarkExamples) {
  std::vector<Case> cs;
  for (const char* model : {"mlp_digits", "tiny_gpt", "resnet18"})
    for (const char* prec : {"fp32", "bf16"}) cs.push_back({model, prec});
  cs.push_back({"resnet18", "fp32", "sgd"});
  // 8-bit AdamW: its eager update kernels donate too (OpDef::in_place_outputs); without
  // that the compiled peak was above eager's (resnet18 2.82 against 2.46 MiB).
  cs.push_back({"mlp_digits", "fp32", "adamw_8bit"});
  cs.push_back({"resnet18", "fp32", "adamw_8bit"});
  for (const Case& c : cs) {
    {
      const char* model = c.model.c_str();
      const char* prec = c.precision.c_str();
      auto [xs, ys] = load_trajectory(c.model);
      ASSERT_TRUE(xs && ys);
      std::optional<driver::TrainingProgram> eager, compiled;
      build_both(c, xs->dim(1), eager, compiled);
      if (HasFatalFailure()) return;
      auto pe = driver::executor_plan(*eager);
      auto pc = driver::executor_plan(*compiled);
      ASSERT_TRUE(pe && pc) << model;
      std::cout << model << " " << prec << " " << c.optim << ": planned peak eager " << pe->peak_bytes
                << " B, compiled " << pc->peak_bytes << " B (" << pc->donated_outputs << " state outputs donated, "
                << pc->donated_bytes << " B)\n";
      EXPECT_LE(pc->peak_bytes, pe->peak_bytes) << model << " " << prec;
      int64_t state = 0;
      for (auto& sb : compiled->train_step->state) state += sb.kind == "parameter";
      if (c.optim != "sgd") {
        EXPECT_GE(pc->donated_outputs, state) << model << " " << prec << ": not every parameter update is donated";
      }
      // The fp32 gradients the optimizer reads are gradients in both precisions (under
      // --bf16 the compiled plan counted those made by a kernel fused with the clipping
      // norm as optimizer temporaries: mlp_digits 34 KiB of gradients at most, not 67).
      // Parameters with equal gradients share one value (cse: the biases of the two
      // BatchNorms summed by a residual Add), so the bound counts each distinct gradient
      // once: the f32 inputs of the parameter updates that are not state and have their
      // parameter's size, or their bf16 inputs under --bf16 (fusion repeats the widening
      // Cast of a bf16 gradient into each kernel that reads it, so the update reads the
      // bf16 value).
      std::set<const ir::Value*> state_in, grads;
      for (auto& sb : compiled->train_step->state) state_in.insert(sb.input);
      for (auto& sb : compiled->train_step->state) {
        if (sb.kind != "parameter" || !sb.output || !sb.output->producer) continue;
        for (const ir::Value* in : sb.output->producer->inputs)
          if (in && !state_in.count(in) && !in->is_initializer() &&
              (in->dtype == ir::DType::f32 || (c.precision == "bf16" && in->dtype == ir::DType::bf16)) &&
              in->shape.numel() == sb.input->shape.numel())
            grads.insert(in);
      }
      int64_t grad_bytes = 0;
      for (const ir::Value* v : grads) grad_bytes += static_cast<int64_t>(ir::dtype_size(v->dtype)) * v->shape.numel();
      EXPECT_LE(grad_bytes, 4 * pc->parameter_elements) << model << " " << prec;
      EXPECT_GE(grad_bytes, 2 * pc->parameter_elements) << model << " " << prec << ": gradients not found";
      const int64_t grad_max = pc->max_by_category[static_cast<int>(passes::MemoryCategory::gradients)];
      EXPECT_GE(grad_max, grad_bytes) << model << " " << prec << ": gradients " << grad_max << " B";
    }
  }
}

std::vector<Case> cases() {
  std::vector<Case> v;
  for (const char* m : {"mlp_digits", "cnn_bn", "tiny_gpt", "resnet18"})
    for (const char* p : {"fp32", "bf16"}) v.push_back({m, p});
  for (const char* o : {"sgd", "adamw_8bit"}) {
    v.push_back({"tiny_gpt", "fp32", o});
    v.push_back({"mlp_digits", "bf16", o});
  }
  for (const char* r : {"blocks", "sqrt", "min-cut", "budget"}) v.push_back({"tiny_gpt", "fp32", "adamw_torch", r});
  v.push_back({"tiny_gpt", "bf16", "adamw_torch", "blocks"});
  v.push_back({"tiny_gpt", "fp32", "adamw_torch", "none", 2});
  v.push_back({"tiny_gpt", "bf16", "adamw_8bit", "none", 2});
  v.push_back({"cnn_bn", "fp32", "sgd", "none", 2});
  v.push_back({"mlp_digits", "fp16"});
  return v;
}

INSTANTIATE_TEST_SUITE_P(Examples, CompiledVsEager, ::testing::ValuesIn(cases()),
                         [](const ::testing::TestParamInfo<Case>& i) { return example_case_name(i.param); });

}  // namespace
