// --fp16: f16 autocast with dynamic loss scaling (passes/grad_scaler.cpp), checked
// against torch.amp.GradScaler's documented semantics (init_scale 65536,
// backoff_factor 0.5, growth_factor 2 after growth_interval finite steps, the
// optimizer step skipped when any gradient is inf/NaN) and against kiln's fp32
// run (itself checked against PyTorch in pytorch_match_test.cpp):
//   - a forced overflow (initial scale 1e38: every scaled gradient is inf in f16)
//     skips the step: parameters, AdamW state and the step counter are bit for bit
//     unchanged, the scale halves, the growth tracker resets, the loss is finite;
//   - starting at 2^40 the run backs off one halving per skipped step until the
//     gradients fit in f16, then trains: after the skips, 20 steps track the fp32
//     trajectory on the same batches within 2e-2 relative per step;
//   - the unscaled gradients match PyTorch's fp32 gradients (2e-3 relative);
//   - growth: with growth_interval 3 the scale doubles after every 3 finite steps;
//   - the kiln binary logs "step N skipped: non-finite gradients, loss scale A -> B"
//     and keeps training with finite losses;
//   - tiny GPT in fp16 (every op the policy lets run in f16 has an f16 kernel):
//     20 AdamW steps within 2e-2 relative of PyTorch's fp32 trajectory.
#include <sys/wait.h>

#include <cmath>
#include <filesystem>
#include <sstream>

#include "e2e_util.h"

using namespace kiln;
using namespace kiln::testing;
namespace fs = std::filesystem;

namespace {

runtime::TrainConfig mlp_config(bool fp16, double init_scale, const std::string& model = "mlp_digits") {
  runtime::TrainConfig cfg;
  cfg.model = example_path(model, "model.onnx");
  cfg.per_device_train_batch_size = model == "tiny_gpt" ? 4 : 8;
  cfg.disable_dropout = true;  // as the PyTorch fixtures
  cfg.loss = "cross_entropy";
  cfg.optim = "adamw_torch";
  cfg.learning_rate = 1e-3;
  cfg.weight_decay = 0.01;
  cfg.lr_scheduler_type = "constant";
  cfg.max_steps = 40;
  cfg.fp16 = fp16;
  // Every product in low precision (torch.autocast), whatever its size: the mechanism under test.
  if (cfg.bf16 || cfg.fp16) cfg.autocast_min_flops = 0;
  cfg.fp16_init_scale = init_scale;
  return cfg;
}

struct Fp16Run {
  driver::TrainingProgram prog;
  std::map<std::string, ir::Tensor> state;
  ir::Tensor xs, ys;
};

void setup(Fp16Run& r, const runtime::TrainConfig& cfg, const std::string& model = "mlp_digits") {
  auto prog = driver::build_training_program(cfg, nullptr, false, false, cfg.max_steps);
  ASSERT_TRUE(prog) << prog.message();
  r.prog = std::move(*prog);
  r.state = initial_state(*r.prog.train_step);
  auto xs = runtime::io::load_npy(example_path(model, "fixtures/traj_inputs.npy"));
  ASSERT_TRUE(xs) << xs.message();
  auto ys = runtime::io::load_npy(example_path(model, "fixtures/traj_labels.npy"));
  ASSERT_TRUE(ys) << ys.message();
  r.xs = *xs;
  r.ys = *ys;
}

/// One step on fixture batch `b`; returns all outputs and advances r.state.
std::map<std::string, ir::Tensor> step(Fp16Run& r, int64_t b) {
  auto feeds = r.state;
  feeds[r.prog.data_inputs[0]] = squeeze0(slice_rows(r.xs, b, 1));
  feeds[r.prog.label_input] = squeeze0(slice_rows(r.ys, b, 1));
  runtime::RunOptions ro;
  ro.training = true;
  auto out = runtime::run_graph(*r.prog.train_step, feeds, ro);
  EXPECT_TRUE(out) << out.message();
  if (!out) return {};
  for (auto& sb : r.prog.train_step->state) r.state[sb.input->name] = out->at(sb.output->name);
  return *out;
}

bool bitwise_equal(const ir::Tensor& a, const ir::Tensor& b) {
  return a.dtype() == b.dtype() && a.dims() == b.dims() &&
         std::memcmp(a.raw(), b.raw(), static_cast<size_t>(a.numel()) * ir::dtype_size(a.dtype())) == 0;
}

}  // namespace

TEST(Fp16, ProgramRunsMatMulInF16WithF32Masters) {
  Fp16Run r;
  setup(r, mlp_config(true, 65536));
  const ir::Graph& g = *r.prog.train_step;
  int f16_gemms = 0;
  for (auto& n : g.nodes())
    if (n->op == "Gemm" || n->op == "MatMul") {
      EXPECT_EQ(n->outputs[0]->dtype, ir::DType::f16) << n->name;
      ++f16_gemms;
    }
  EXPECT_GE(f16_gemms, 3);
  int scaler_state = 0;
  for (auto& sb : g.state) {
    if (sb.kind == "parameter" || sb.kind == "optimizer_state") {
      EXPECT_EQ(sb.input->dtype, ir::DType::f32);
    }
    if (sb.kind == "grad_scaler") ++scaler_state;
  }
  EXPECT_EQ(scaler_state, 2);
  EXPECT_EQ(r.state.at("loss_scale").get_f64(0), 65536.0);
  EXPECT_TRUE(g.find_value("found_inf"));
}

TEST(Fp16, ForcedOverflowSkipsStepAndHalvesScale) {
  Fp16Run r;
  setup(r, mlp_config(true, 1e38));
  auto before = r.state;
  auto out = step(r, 0);
  ASSERT_FALSE(out.empty());
  EXPECT_NE(out.at("found_inf").get_f64(0), 0.0);
  EXPECT_TRUE(std::isfinite(out.at("loss").get_f64(0)));
  EXPECT_FALSE(std::isfinite(out.at("grad_norm").get_f64(0)));
  int unchanged = 0;
  for (auto& sb : r.prog.train_step->state) {
    if (sb.kind == "grad_scaler") continue;
    EXPECT_TRUE(bitwise_equal(r.state.at(sb.input->name), before.at(sb.input->name)))
        << sb.kind << " '" << sb.input->name << "' changed on a skipped step";
    ++unchanged;
  }
  EXPECT_EQ(unchanged, 6 * 3 + 1);  // 6 parameters, their exp_avg / exp_avg_sq, the step counter
  EXPECT_FLOAT_EQ(r.state.at("loss_scale").get_f64(0), 5e37f);
  EXPECT_EQ(r.state.at("growth_tracker").get_f64(0), 0.0);
  // The same batch with the default scale is finite and updates every parameter.
  Fp16Run ok;
  setup(ok, mlp_config(true, 65536));
  auto p0 = ok.state;
  auto o2 = step(ok, 0);
  EXPECT_EQ(o2.at("found_inf").get_f64(0), 0.0);
  for (auto& p : ok.prog.parameters) EXPECT_FALSE(bitwise_equal(ok.state.at(p), p0.at(p))) << p;
  EXPECT_EQ(ok.state.at("step").get_f64(0), 1.0);
  EXPECT_EQ(ok.state.at("loss_scale").get_f64(0), 65536.0);
  EXPECT_EQ(ok.state.at("growth_tracker").get_f64(0), 1.0);
}

TEST(Fp16, BacksOffThenTracksFp32Trajectory) {
  Fp16Run h, f;
  setup(h, mlp_config(true, std::ldexp(1.0, 40)));
  setup(f, mlp_config(false, 65536));
  // Skipped steps do not change the parameters: feed the batch of the next applied
  // step, so applied step i sees fixture batch i, as the fp32 run does.
  int64_t applied = 0, skipped = 0;
  double scale = std::ldexp(1.0, 40);
  std::vector<double> h_loss;
  for (int it = 0; it < 60 && applied < 20; ++it) {
    auto out = step(h, applied);
    ASSERT_FALSE(out.empty());
    ASSERT_TRUE(std::isfinite(out.at("loss").get_f64(0)));
    bool inf = out.at("found_inf").get_f64(0) != 0;
    double next = out.at("loss_scale.next").get_f64(0);
    if (inf) {
      ASSERT_EQ(applied, 0) << "overflow after training started, at scale " << scale;
      EXPECT_EQ(next, scale * 0.5);
      ++skipped;
    } else {
      EXPECT_EQ(next, scale);  // growth_interval 2000 not reached
      h_loss.push_back(out.at("loss").get_f64(0));
      ++applied;
    }
    scale = next;
  }
  ASSERT_EQ(applied, 20);
  // 2^40 * |dlogits| overflows f16 (max 65504) until the scale is near 2^16..2^20.
  EXPECT_GE(skipped, 15);
  EXPECT_LE(skipped, 30);
  EXPECT_EQ(h.state.at("step").get_f64(0), 20.0);
  std::cout << "fp16: " << skipped << " skipped steps, final scale 2^" << std::log2(scale) << "\n";
  double worst = 0;
  for (int64_t i = 0; i < 20; ++i) {
    auto out = step(f, i);
    double ref = out.at("loss").get_f64(0);
    double e = std::fabs(h_loss[i] - ref) / std::fabs(ref);
    worst = std::max(worst, e);
    EXPECT_LT(e, 2e-2) << "step " << i << ": fp16 " << h_loss[i] << " fp32 " << ref;
  }
  std::cout << "fp16 vs fp32 losses over 20 steps: worst relative difference " << worst << "\n";
}

// The gradients the optimizer sees are unscaled: against PyTorch's fp32 gradients of
// the fixture batch (fixtures/grads_f32.safetensors) within 2e-3 relative L2 per
// tensor (f16 activations; a missing 1/65536 would be off by 65536x).
TEST(Fp16, UnscaledGradientsMatchPyTorchFp32) {
  auto x = runtime::io::load_npy(example_path("mlp_digits", "fixtures/batch_input.npy"));
  ASSERT_TRUE(x) << x.message();
  auto y = runtime::io::load_npy(example_path("mlp_digits", "fixtures/batch_labels.npy"));
  ASSERT_TRUE(y) << y.message();
  auto ref = runtime::io::load_safetensors(example_path("mlp_digits", "fixtures/grads_f32.safetensors"));
  ASSERT_TRUE(ref) << ref.message();
  auto prog = driver::build_training_program(mlp_config(true, 65536), nullptr, /*want_grads=*/true);
  ASSERT_TRUE(prog) << prog.message();
  auto feeds = initial_state(*prog->grads);
  feeds[prog->data_inputs[0]] = *x;
  feeds[prog->label_input] = *y;
  runtime::RunOptions ro;
  ro.training = true;
  auto out = runtime::run_graph(*prog->grads, feeds, ro);
  ASSERT_TRUE(out) << out.message();
  int checked = 0;
  for (auto& [name, t] : *ref) {
    if (name == "loss") continue;
    auto it = out->find(name + ".grad");
    ASSERT_NE(it, out->end()) << name;
    double e = rel_l2(it->second, t);
    EXPECT_LT(e, 2e-3) << name;
    std::cout << name << ".grad fp16 vs PyTorch fp32: " << e << "\n";
    ++checked;
  }
  EXPECT_EQ(checked, 6);
}

TEST(Fp16, ScaleGrowsAfterGrowthInterval) {
  auto cfg = mlp_config(true, 1024);
  cfg.fp16_growth_interval = 3;
  Fp16Run r;
  setup(r, cfg);
  // torch GradScaler with growth_interval=3, no overflow: the scale after each update.
  const double want_scale[] = {1024, 1024, 2048, 2048, 2048, 4096, 4096};
  const double want_tracker[] = {1, 2, 0, 1, 2, 0, 1};
  for (int i = 0; i < 7; ++i) {
    auto out = step(r, i);
    ASSERT_FALSE(out.empty());
    EXPECT_EQ(out.at("found_inf").get_f64(0), 0.0) << "step " << i;
    EXPECT_EQ(r.state.at("loss_scale").get_f64(0), want_scale[i]) << "step " << i;
    EXPECT_EQ(r.state.at("growth_tracker").get_f64(0), want_tracker[i]) << "step " << i;
  }
}

TEST(Fp16, ConfigRejectsBf16AndFp16Together) {
  runtime::TrainConfig cfg = mlp_config(true, 65536);
  cfg.bf16 = true;
  Status s = cfg.validate();
  ASSERT_FALSE(s.is_ok());
  EXPECT_NE(s.message().find("--fp16"), std::string::npos) << s.message();
  cfg.bf16 = false;
  cfg.fp16_growth_interval = 0;
  EXPECT_FALSE(cfg.validate().is_ok());
}

// ---- through the kiln binary ----
namespace {

const std::string kSrc = KILN_SOURCE_DIR;
const std::string kBin = std::string(KILN_BINARY_DIR) + "/bin/kiln";

int kiln(const std::string& args, std::string* out) {
  std::string log = (fs::temp_directory_path() / ("kiln_fp16_" + std::to_string(::getpid()) + ".log")).string();
  std::string cmd = "cd '" + kSrc + "' && '" + kBin + "' " + args + " > '" + log + "' 2>&1";
  int st = std::system(cmd.c_str());
  std::ifstream f(log);
  std::stringstream ss;
  ss << f.rdbuf();
  *out = ss.str();
  fs::remove(log);
  return WIFEXITED(st) ? WEXITSTATUS(st) : 128;
}

/// Per-step losses from metrics.jsonl of a run with --logging_steps 1.
std::vector<double> run_losses(const std::string& args, const std::string& tag, std::string* out) {
  fs::path dir = fs::temp_directory_path() / ("kiln_fp16_" + tag + "_" + std::to_string(::getpid()));
  fs::remove_all(dir);
  int rc = kiln(args + " --logging_steps 1 --seed 7 --output_dir " + dir.string(), out);
  EXPECT_EQ(rc, 0) << *out;
  std::vector<double> losses;
  std::ifstream f(dir / "metrics.jsonl");
  std::string line;
  while (std::getline(f, line)) {
    auto j = nlohmann::json::parse(line);
    if (j.contains("loss") && j["loss"].is_number()) losses.push_back(j["loss"].get<double>());
  }
  fs::remove_all(dir);
  return losses;
}

}  // namespace

TEST(Fp16Cli, LogsSkippedStepAndContinues) {
  if (!fs::exists(kSrc + "/data/digits/x_train.npy")) FAIL() << "data/ is missing: run tools/prepare_test_data.sh";
  std::string out;
  auto losses = run_losses(
      "train examples/mlp_digits/model.onnx --train_data input=data/digits/x_train.npy "
      "--train_data labels=data/digits/y_train.npy --per_device_train_batch_size 32 --learning_rate 2e-3 "
      "--fp16 --autocast_min_flops 0 --fp16_init_scale 4194304 --max_steps 30",
      "mlp", &out);
  EXPECT_NE(out.find("step 1 skipped: non-finite gradients, loss scale 4.1943e+06 -> 2.09715e+06"), std::string::npos)
      << out;
  ASSERT_EQ(losses.size(), 30u) << out;
  for (double l : losses) EXPECT_TRUE(std::isfinite(l));
  EXPECT_LT(losses.back(), losses.front());  // it trained after the skips
}

// 20 fp16 AdamW steps of the tiny GPT (every op the policy lets run in f16 needs an
// f16 kernel) against PyTorch's fp32 trajectory (fixtures/trajectories.json, the
// same hyper-parameters and batches): each loss within 2e-2 relative. About 6 s idle,
// 40 s on a busy 2-core machine (f16 MatMul has no oneDNN path yet).
TEST(Fp16, TinyGptTracksPyTorchFp32Trajectory) {
  auto traj = read_json(example_path("tiny_gpt", "fixtures/trajectories.json"))["adamw"];
  ASSERT_EQ(traj["learning_rate"].get<double>(), 1e-3);
  ASSERT_EQ(traj["lr_scheduler_type"].get<std::string>(), "constant");
  Fp16Run r;
  setup(r, mlp_config(true, 65536, "tiny_gpt"), "tiny_gpt");
  int64_t applied = 0, skipped = 0;
  double worst = 0;
  while (applied < 20 && skipped < 10) {
    auto out = step(r, applied);
    ASSERT_FALSE(out.empty());
    if (out.at("found_inf").get_f64(0) != 0) {
      ++skipped;
      continue;
    }
    double loss = out.at("loss").get_f64(0), ref = traj["losses"][applied].get<double>();
    double e = std::fabs(loss - ref) / std::fabs(ref);
    worst = std::max(worst, e);
    EXPECT_LT(e, 2e-2) << "step " << applied << ": fp16 " << loss << " PyTorch fp32 " << ref;
    ++applied;
  }
  ASSERT_EQ(applied, 20) << skipped << " skipped steps";
  std::cout << "tiny_gpt fp16: " << skipped << " skipped, worst relative loss difference to PyTorch fp32 " << worst
            << "\n";
}
