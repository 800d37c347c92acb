// The compiled executor's step arena (runtime/arena.h, issue 7): planned values are
// written at their planned offsets in one block instead of being allocated. The arena
// only decides where results go, so a compiled run with it must equal the same compiled
// program run with one allocation per result bit for bit (losses and every state
// tensor), through run_graph and through the Trainer (which copies the new state out
// of the arena into its own buffers), with accumulation loops, remat, bf16, fp16 loss
// scaling, 8-bit AdamW and BatchNorm; so must a run that keeps the executor's per-graph
// facts across steps (runtime::ScheduleCache). The arena run must also allocate (nearly) no
// tensor storage per step: counted with ir::MemoryStats::allocations().
#include <cstring>
#include <sstream>

#include "e2e_util.h"
#include "runtime/data.h"
#include "runtime/trainer.h"
#include "tools/driver/train_run.h"

using namespace kiln;
using namespace kiln::testing;

namespace {

const std::string kSrc = KILN_SOURCE_DIR;

using ArenaCase = ExampleCase;

class StepArenaRuns : public ::testing::TestWithParam<ArenaCase> {};

TEST_P(StepArenaRuns, BitIdenticalToAllocatingExecutorAndNoPerStepAllocation) {
  const ArenaCase& c = GetParam();
  auto [xs, ys] = load_trajectory(c.model);
  ASSERT_TRUE(xs && ys);
  const int64_t steps = c.steps, rows = xs->dim(1);
  auto prog = driver::build_training_program(example_case_config(c, "compiled", rows), nullptr, false, false, steps);
  ASSERT_TRUE(prog) << prog.message();
  ASSERT_NE(prog->train_arena, nullptr);
  const runtime::StepArena& arena = *prog->train_arena;
  EXPECT_GT(arena.num_homes(), 10) << "the arena places almost nothing";

  std::map<std::string, ir::Tensor> with, without;
  const int64_t placed0 = arena.placed(), a0 = ir::MemoryStats::allocations();
  auto la = trajectory_losses(*prog, *xs, *ys, steps, false, &with, true);
  const int64_t allocs_arena = ir::MemoryStats::allocations() - a0;
  const int64_t a1 = ir::MemoryStats::allocations();
  auto lb = trajectory_losses(*prog, *xs, *ys, steps, false, &without, false);
  const int64_t allocs_heap = ir::MemoryStats::allocations() - a1;
  ASSERT_EQ(la.size(), static_cast<size_t>(steps));
  ASSERT_EQ(lb.size(), la.size());
  for (size_t i = 0; i < la.size(); ++i) EXPECT_EQ(la[i], lb[i]) << "step " << i;
  expect_bitwise_equal(with, without);

  // Every output written at its planned place is an allocation saved, except graph
  // outputs, which run_graph still copies out of the arena here (results_in_arena is
  // off); the trainer test below counts what a real step allocates.
  const int64_t outputs = static_cast<int64_t>(prog->train_step->outputs.size());
  const int64_t placed = arena.placed() - placed0;
  std::cout << example_case_name(c) << ": " << arena.num_homes() << " planned outputs, block " << arena.block_bytes()
            << " B; tensor allocations per step with the arena " << allocs_arena / steps << ", without "
            << allocs_heap / steps << "; outputs placed per step " << placed / steps << ", relocated "
            << arena.relocated() << "\n";
  EXPECT_GE(placed, steps * arena.num_homes() / 2) << "most planned outputs were not placed";
  EXPECT_GE(allocs_heap - allocs_arena, placed - steps * outputs);
  // The executor facts kept across steps (RunOptions::schedule, as the trainer runs)
  // change nothing either.
  runtime::ScheduleCache schedule;
  std::map<std::string, ir::Tensor> cached;
  auto lc = trajectory_losses(*prog, *xs, *ys, steps, false, &cached, true, &schedule);
  ASSERT_EQ(lc.size(), la.size());
  for (size_t i = 0; i < la.size(); ++i) EXPECT_EQ(la[i], lc[i]) << "step " << i << " with the schedule cache";
  expect_bitwise_equal(with, cached);
  // State donation (kiln_donate, as the Trainer runs: RunOptions::donate_state): the
  // update kernels write the new state into the old state's buffers, which must give
  // the same bits as writing it into copies (no element read after its own write), and
  // every donated output must come back in its input's buffer.
  int64_t marked = 0;
  for (auto& n : prog->train_step->nodes())
    for (int64_t k : n->attrs.get_ints("kiln_donate")) marked += k >= 0;
  // (SGD without momentum has no optimizer state, and its update writes the new
  // parameter into the dying gradient instead: kiln_inplace.)
  if (c.optim != "sgd") EXPECT_GT(marked, 0) << "no state update was marked kiln_donate";
  int64_t donated = 0;
  std::map<std::string, ir::Tensor> in_place;
  auto ld = trajectory_losses(*prog, *xs, *ys, steps, false, &in_place, true, &schedule, &donated);
  ASSERT_EQ(ld.size(), la.size());
  for (size_t i = 0; i < la.size(); ++i) EXPECT_EQ(la[i], ld[i]) << "step " << i << " with donated state";
  expect_bitwise_equal(with, in_place);
  EXPECT_EQ(donated, marked * steps) << "donated outputs that did not come back in their input's buffer";
}

std::vector<ArenaCase> arena_cases() {
  return {{"tiny_gpt"},
          {"tiny_gpt", "bf16", "adamw_8bit", "blocks"},
          {"tiny_gpt", "fp32", "adamw_torch", "none", 2},
          {"resnet18", "fp32", "sgd"},
          {"cnn_bn", "bf16"},
          {"mlp_digits", "fp16"}};
}

INSTANTIATE_TEST_SUITE_P(Examples, StepArenaRuns, ::testing::ValuesIn(arena_cases()),
                         [](const ::testing::TestParamInfo<ArenaCase>& i) { return example_case_name(i.param); });

// The Trainer path: results taken from the arena (RunOptions::results_in_arena) and the
// new state copied into the trainer's own buffers; eval batches on the eval arena.
TEST(StepArena, TrainerRunEqualsAllocatingRunBitwise) {
  if (!std::filesystem::exists(kSrc + "/data/text/train.bin"))
    FAIL() << "data/text/train.bin is missing: run tools/prepare_test_data.sh (tools/test.sh does)";
  runtime::TrainConfig cfg;
  cfg.model = example_path("tiny_gpt", "model.onnx");
  cfg.train_data = {kSrc + "/data/text/train.bin"};
  cfg.block_size = 64;
  cfg.per_device_train_batch_size = 2;
  cfg.gradient_accumulation_steps = 2;
  cfg.learning_rate = 3e-3;
  cfg.optim = "adamw_8bit";
  cfg.max_steps = 6;
  cfg.seed = 11;
  cfg.backend = "compiled";
  cfg.output_dir = fresh_tmpdir("arena_trainer");
  auto prog = driver::build_training_program(cfg, nullptr, false, false, cfg.max_steps);
  ASSERT_TRUE(prog) << prog.message();
  ASSERT_NE(prog->train_arena, nullptr);
  auto raw = runtime::load_raw_data(cfg.train_data);
  ASSERT_TRUE(raw) << raw.message();
  std::vector<std::string> present;
  for (auto& n : prog->data_inputs)
    for (ir::Value* in : prog->train_step->inputs)
      if (in->name == n) present.push_back(n);
  auto specs = runtime::data_input_specs(*prog->train_step, present);
  ASSERT_TRUE(specs) << specs.message();
  runtime::DataOptions dopt;
  dopt.block_size = cfg.block_size;
  auto ds = runtime::Dataset::bind(*raw, *specs, dopt);
  ASSERT_TRUE(ds) << ds.message();

  auto run = [&](bool arena, std::map<std::string, ir::Tensor>* state, int64_t* allocs) {
    runtime::TrainGraphs g = driver::graphs_of(*prog);
    g.eval = nullptr;
    if (!arena) g.train_arena = nullptr;
    std::ostringstream log;
    runtime::TrainerOptions to;
    to.out = &log;
    to.progress = 0;
    to.write_files = false;
    auto tr = runtime::Trainer::create(cfg, g, &*ds, nullptr, to);
    EXPECT_TRUE(tr) << tr.message();
    std::vector<double> losses;
    if (!tr) return losses;
    auto first = tr->step();  // warm-up: first-touch and caches
    EXPECT_TRUE(first) << first.message();
    if (first) losses.push_back(first->loss);
    const int64_t a0 = ir::MemoryStats::allocations();
    for (int i = 1; i < cfg.max_steps; ++i) {
      auto r = tr->step();
      EXPECT_TRUE(r) << r.message();
      if (!r) break;
      losses.push_back(r->loss);
    }
    *allocs = ir::MemoryStats::allocations() - a0;
    for (auto& [n, t] : tr->state()) (*state)[n] = t.clone();
    return losses;
  };
  std::map<std::string, ir::Tensor> sa, sb;
  int64_t alloc_a = 0, alloc_b = 0;
  auto la = run(true, &sa, &alloc_a);
  auto lb = run(false, &sb, &alloc_b);
  ASSERT_EQ(la.size(), static_cast<size_t>(cfg.max_steps));
  ASSERT_EQ(la, lb);
  expect_bitwise_equal(sa, sb);
  const int64_t timed = cfg.max_steps - 1;
  std::cout << "trainer: tensor allocations per step with the arena " << alloc_a / timed << ", without "
            << alloc_b / timed << "\n";
  // With the arena (measured 9): the microbatch gathers (2 inputs x 2 microbatches),
  // the token count and a few kernel scratch tensors; no state copies, no step values.
  EXPECT_LE(alloc_a / timed, 16);
  EXPECT_LT(alloc_a * 4, alloc_b);
}

}  // namespace
