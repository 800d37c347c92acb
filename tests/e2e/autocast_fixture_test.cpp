// kiln --bf16 against PyTorch's CPU autocast bf16 (issue 4 acceptance): 20 AdamW
// steps of mlp_digits and tiny_gpt from the same initial weights on the same batches
// as examples/<m>/fixtures/trajectories_bf16.json (tools/make_autocast_fixture.py,
// torch.autocast("cpu", dtype=torch.bfloat16), fp32 master weights); each step's
// loss within 2e-2 relative of PyTorch's. The worst difference is printed, next to
// the difference from the fp32 trajectory, so a drift towards the bound shows.
#include <cmath>

#include "e2e_util.h"

using namespace kiln;
using namespace kiln::testing;

namespace {

void check_bf16_trajectory(const std::string& model) {
  auto traj = read_json(example_path(model, "fixtures/trajectories_bf16.json"));
  auto f32 = read_json(example_path(model, "fixtures/trajectories.json"))["adamw"]["losses"];
  auto spec = traj["adamw"];
  auto xs = runtime::io::load_npy(example_path(model, "fixtures/traj_inputs.npy"));
  ASSERT_TRUE(xs) << xs.message();
  auto ys = runtime::io::load_npy(example_path(model, "fixtures/traj_labels.npy"));
  ASSERT_TRUE(ys) << ys.message();
  const int64_t steps = spec["steps"].get<int64_t>();
  ASSERT_EQ(spec["losses"].size(), static_cast<size_t>(steps));
  runtime::TrainConfig cfg;
  cfg.model = example_path(model, "model.onnx");
  cfg.per_device_train_batch_size = xs->dim(1);
  cfg.per_device_eval_batch_size = xs->dim(1);
  cfg.loss = "cross_entropy";
  cfg.disable_dropout = true;  // the fixture runs with dropout off
  cfg.bf16 = true;
  cfg.optim = spec["optim"].get<std::string>();
  cfg.learning_rate = spec["learning_rate"].get<double>();
  cfg.weight_decay = spec["weight_decay"].get<double>();
  cfg.lr_scheduler_type = spec["lr_scheduler_type"].get<std::string>();
  cfg.max_grad_norm = spec["max_grad_norm"].get<double>();
  cfg.adam_beta1 = spec["adam_beta1"].get<double>();
  cfg.adam_beta2 = spec["adam_beta2"].get<double>();
  cfg.adam_epsilon = spec["adam_epsilon"].get<double>();
  cfg.max_steps = steps;
  auto prog = driver::build_training_program(cfg, nullptr, false, false, steps);
  ASSERT_TRUE(prog) << prog.message();
  auto losses = trajectory_losses(*prog, *xs, *ys, steps);
  ASSERT_EQ(static_cast<int64_t>(losses.size()), steps);
  double worst = 0, worst_f32 = 0;
  for (int64_t i = 0; i < steps; ++i) {
    double loss = losses[static_cast<size_t>(i)];
    double ref = spec["losses"][i].get<double>();
    double e = std::abs(loss - ref) / std::abs(ref);
    worst = std::max(worst, e);
    worst_f32 = std::max(worst_f32, std::abs(loss - f32[i].get<double>()) / std::abs(f32[i].get<double>()));
    EXPECT_LT(e, 2e-2) << model << " step " << i << ": kiln --bf16 " << loss << " vs PyTorch autocast bf16 " << ref;
  }
  std::cout << model << ": 20 bf16 steps, worst relative loss difference to PyTorch autocast bf16 " << worst
            << " (to the fp32 trajectory " << worst_f32 << ")\n";
}

}  // namespace

TEST(AutocastFixture, MlpDigitsBf16TracksPyTorchAutocast) { check_bf16_trajectory("mlp_digits"); }
TEST(AutocastFixture, TinyGptBf16TracksPyTorchAutocast) { check_bf16_trajectory("tiny_gpt"); }
