// Backends (issue 30, runtime/backend.h): the executor runs programs through a per-device
// backend.
//   - "compiled" runs a program's kernels and arena exactly as the executor does without
//     the interface: the same losses and state, bit for bit, over several steps;
//   - "eager", the reference, ignores the kernels and arena and agrees with "compiled"
//     within the tolerance of a generated kernel against the op-by-op oracle;
//   - buffers carry their device: a tensor on another device is refused by the host
//     backends with one line naming the input and both devices;
//   - an unknown backend name is refused listing the known ones.
#include "runtime/backend.h"

#include "e2e_util.h"
#include "ir/parser.h"

using namespace kiln;
using namespace kiln::testing;

namespace {

/// Losses of `steps` train steps of `prog` run by `backend` (as trajectory_losses feeds them).
std::vector<double> backend_losses(const driver::TrainingProgram& prog, runtime::Backend& backend, const ir::Tensor& xs,
                                   const ir::Tensor& ys, int64_t steps,
                                   std::map<std::string, ir::Tensor>* final_state) {
  std::vector<double> losses;
  auto ex = backend.load(*prog.train_step, {prog.train_kernels.get(), prog.train_arena.get()});
  EXPECT_TRUE(ex) << ex.message();
  if (!ex) return losses;
  auto state = initial_state(*prog.train_step);
  runtime::RunOptions ro;
  ro.training = true;
  for (int64_t i = 0; i < steps; ++i) {
    auto feeds = state;
    feeds[prog.data_inputs[0]] = squeeze0(slice_rows(xs, i, 1));
    feeds[prog.label_input] = squeeze0(slice_rows(ys, i, 1));
    runtime::add_num_items_feed(*prog.train_step, feeds[prog.label_input], -100, feeds);
    ro.step = static_cast<uint64_t>(i);
    auto out = backend.run(**ex, feeds, ro);
    if (!out) {
      ADD_FAILURE() << "step " << i << ": " << out.message();
      break;
    }
    losses.push_back((*out)["loss"].get_f64(0));
    for (auto& sb : prog.train_step->state) state[sb.input->name] = (*out)[sb.output->name];
  }
  if (final_state) *final_state = state;
  return losses;
}

class BackendRuns : public ::testing::TestWithParam<ExampleCase> {};

TEST_P(BackendRuns, CompiledIsTheExecutorBitForBitAndEagerAgrees) {
  const ExampleCase& c = GetParam();
  auto [xs, ys] = load_trajectory(c.model);
  ASSERT_TRUE(xs && ys);
  auto prog =
      driver::build_training_program(example_case_config(c, "compiled", xs->dim(1)), nullptr, false, false, c.steps);
  ASSERT_TRUE(prog) << prog.message();
  ASSERT_NE(prog->train_kernels, nullptr);
  std::map<std::string, ir::Tensor> s_direct, s_compiled, s_eager;
  const auto l_direct = trajectory_losses(*prog, *xs, *ys, c.steps, false, &s_direct);

  auto compiled = runtime::make_backend("compiled");
  ASSERT_TRUE(compiled) << compiled.message();
  EXPECT_EQ((*compiled)->name(), "compiled");
  EXPECT_TRUE((*compiled)->device().is_cpu());
  const auto l_compiled = backend_losses(*prog, **compiled, *xs, *ys, c.steps, &s_compiled);
  ASSERT_EQ(l_compiled.size(), l_direct.size());
  for (size_t i = 0; i < l_direct.size(); ++i) EXPECT_EQ(l_compiled[i], l_direct[i]) << "step " << i;
  expect_bitwise_equal(s_compiled, s_direct);

  auto eager = runtime::make_backend("eager");
  ASSERT_TRUE(eager) << eager.message();
  const auto l_eager = backend_losses(*prog, **eager, *xs, *ys, c.steps, &s_eager);
  ASSERT_EQ(l_eager.size(), l_direct.size());
  // Generated kernels against the op-by-op oracle (fp32): reassociated sums and
  // polynomial exp/log differ in the last bits; a relative 1e-4 on the loss bounds that.
  for (size_t i = 0; i < l_direct.size(); ++i)
    EXPECT_NEAR(l_eager[i], l_direct[i], 1e-4 * std::max(1.0, std::abs(l_direct[i]))) << "step " << i;
  // And the eager backend really ran eagerly: it is not bit-identical on every value
  // only by chance, so compare it with the executor run without kernels and arena.
  driver::TrainingProgram no_kernels;
  no_kernels.train_step = std::move(prog->train_step);
  no_kernels.data_inputs = prog->data_inputs;
  no_kernels.label_input = prog->label_input;
  std::map<std::string, ir::Tensor> s_plain;
  const auto l_plain = trajectory_losses(no_kernels, *xs, *ys, c.steps, false, &s_plain, false);
  ASSERT_EQ(l_plain.size(), l_eager.size());
  for (size_t i = 0; i < l_plain.size(); ++i) EXPECT_EQ(l_eager[i], l_plain[i]) << "step " << i;
  expect_bitwise_equal(s_eager, s_plain);
}

INSTANTIATE_TEST_SUITE_P(Examples, BackendRuns,
                         ::testing::Values(ExampleCase{"mlp_digits", "fp32", "adamw_torch", "none", 1, 3},
                                           ExampleCase{"tiny_gpt", "fp32", "adamw_torch", "blocks", 2, 3}),
                         [](const auto& info) { return example_case_name(info.param); });

/// A tensor whose storage claims to be on cuda:0 (a fake address never dereferenced).
ir::Tensor fake_device_tensor(ir::DType dtype, std::vector<int64_t> dims) {
  const size_t bytes = static_cast<size_t>(ir::numel_of(dims)) * ir::dtype_size(dtype);
  auto released = std::make_shared<bool>(false);
  auto st = std::make_shared<ir::Storage>(ir::Device::cuda(0), reinterpret_cast<void*>(uintptr_t{0x1000}), bytes,
                                          [released](void*) { *released = true; });
  return ir::Tensor::over(std::move(st), dtype, std::move(dims));
}

TEST(Backend, BuffersCarryTheirDeviceAndHostBackendsRefuseOthers) {
  EXPECT_EQ(ir::Device::cpu().str(), "cpu");
  EXPECT_EQ(ir::Device::cuda(1).str(), "cuda:1");
  EXPECT_TRUE(ir::Tensor(ir::DType::f32, {2}).device().is_cpu());
  ir::Tensor dev = fake_device_tensor(ir::DType::f32, {2, 3});
  EXPECT_EQ(dev.device(), ir::Device::cuda(0));

  auto parsed = ir::parse_graph("graph main(%x: f32[2, 3]) {\n  %y = Relu(%x) : f32[2, 3]\n  return %y\n}\n");
  ASSERT_TRUE(parsed) << parsed.message();
  const ir::Graph& g = **parsed;
  for (const char* name : {"eager", "compiled"}) {
    auto b = runtime::make_backend(name);
    ASSERT_TRUE(b) << b.message();
    auto ex = (*b)->load(g, {});
    ASSERT_TRUE(ex) << ex.message();
    auto bad = (*b)->run(**ex, {{"x", dev}});
    ASSERT_FALSE(bad) << name;
    EXPECT_EQ(bad.message(),
              "input 'x': the tensor is on cuda:0, this executor runs on cpu (copy it with its backend's to_host)");
    auto host = (*b)->to_host(dev);
    ASSERT_FALSE(host);
    EXPECT_NE(host.message().find("cuda:0"), std::string::npos) << host.message();
    // A host tensor runs (Relu of -1, 2 ...).
    ir::Tensor in = ir::Tensor::from_f32({-1, 2, -3, 4, -5, 6}, {2, 3});
    auto ok = (*b)->run(**ex, {{"x", in}});
    ASSERT_TRUE(ok) << ok.message();
    EXPECT_EQ(ok->at("y").get_f64(0), 0.0);
    EXPECT_EQ(ok->at("y").get_f64(1), 2.0);
  }
}

TEST(Backend, UnknownNameListsTheKnownOnes) {
  auto b = runtime::make_backend("tpu");
  ASSERT_FALSE(b);
  EXPECT_EQ(b.message().rfind("unknown backend 'tpu' (known: ", 0), 0u) << b.message();
  EXPECT_NE(b.message().find("compiled"), std::string::npos);
  EXPECT_NE(b.message().find("eager"), std::string::npos);
  // A registered backend is reachable by name.
  runtime::register_backend("test-host", [] { return runtime::make_backend("eager"); });
  auto t = runtime::make_backend("test-host");
  ASSERT_TRUE(t) << t.message();
  EXPECT_EQ((*t)->name(), "eager");
}

}  // namespace
