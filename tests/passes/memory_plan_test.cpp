// The static memory planner (passes/memory_plan.h): peaks of hand-built graphs against
// hand-computed byte counts, arena offsets checked pairwise for every pair of buffers
// live at the same time, in-place reuse along pointwise chains, the planned peak of one
// eager training step of every example model against the interpreter's measured peak
// (MemoryStats, an independent counter in every tensor allocation), the same with
// gradient accumulation (an AccumulationLoop, planned body included), optimizer-state
// bytes per parameter of 8-bit vs fp32 AdamW against the bitsandbytes layout, and the
// bf16 / fp32 ratio of saved-activation bytes of the tiny GPT.
#include "passes/memory_plan.h"

#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <iostream>
#include <optional>
#include <set>
#include <unordered_set>

#include "ir/op_table.h"
#include "measure_util.h"
#include "passes/passes.h"
#include "passes/training_util.h"
#include "runtime/data.h"
#include "runtime/interpreter.h"
#include "runtime/io.h"
#include "tools/driver/driver.h"

using namespace kiln;
using namespace kiln::ir;
using passes::MemoryCategory;
using passes::MemoryPlan;
using passes::PlanOptions;

namespace {

std::string example_path(const std::string& name, const std::string& file) {
  return std::string(KILN_SOURCE_DIR) + "/examples/" + name + "/" + file;
}

/// Every pair of arena buffers whose lifetimes overlap must occupy disjoint byte ranges;
/// every value must lie inside its buffer and the arena. Returns the pairs checked.
int64_t expect_no_overlap(const MemoryPlan& p) {
  const auto& b = p.buffers;
  int64_t checked = 0;
  for (size_t i = 0; i < b.size(); ++i) {
    EXPECT_GE(b[i].offset, 0);
    EXPECT_LE(b[i].offset + b[i].size, p.arena_bytes);
    EXPECT_EQ(b[i].offset % p.options.alignment, 0);
    for (size_t j = i + 1; j < b.size(); ++j) {
      bool live_together = b[i].first <= b[j].last && b[j].first <= b[i].last;
      if (!live_together) continue;
      ++checked;
      bool disjoint = b[i].offset + b[i].size <= b[j].offset || b[j].offset + b[j].size <= b[i].offset;
      EXPECT_TRUE(disjoint) << "buffers " << i << " [" << b[i].offset << ", +" << b[i].size << ") nodes " << b[i].first
                            << ".." << b[i].last << " and " << j << " [" << b[j].offset << ", +" << b[j].size
                            << ") nodes " << b[j].first << ".." << b[j].last;
    }
  }
  // Values: same buffer only along an in-place chain, lifetimes inside the buffer's.
  for (const auto& v : p.values) {
    if (v.buffer < 0) continue;
    const auto& buf = b[v.buffer];
    EXPECT_GE(v.def, buf.first);
    EXPECT_LE(v.end, buf.last);
    EXPECT_LE(v.bytes, buf.size);
  }
  return checked;
}

/// Independent liveness peak: simulate the interpreter (free after last use, outputs
/// allocated while the node's inputs are live, plus the f64 [M, N] product tensor of the
/// eager Gemm kernel for dtypes oneDNN does not run, see runtime/kernels/nn.cpp) by
/// replaying allocations and frees.
int64_t simulate_eager_peak(const Graph& g) {
  std::map<const Value*, int> last;
  for (size_t i = 0; i < g.nodes().size(); ++i)
    for (Value* in : g.nodes()[i]->inputs)
      if (in) last[in] = static_cast<int>(i);
  std::set<const Value*> pinned(g.outputs.begin(), g.outputs.end());
  int64_t cur = 0, peak = 0;
  auto bytes = [](const Value* v) { return v->shape.numel() * static_cast<int64_t>(dtype_size(v->dtype)); };
  for (Value* v : g.inputs) cur += bytes(v);
  for (Value* v : g.initializers) cur += bytes(v);
  peak = cur;
  for (size_t i = 0; i < g.nodes().size(); ++i) {
    const Node& n = *g.nodes()[i];
    for (Value* o : n.outputs) cur += bytes(o);
    int64_t scratch = 0;
    if (n.op == "Gemm" && n.inputs[0]->dtype != DType::f32 && n.inputs[0]->dtype != DType::bf16)
      scratch = n.outputs[0]->shape.numel() * 8;
    peak = std::max(peak, cur + scratch);
    std::set<const Value*> seen;
    for (Value* in : n.inputs)
      if (in && in->producer && last[in] == static_cast<int>(i) && !pinned.count(in) && seen.insert(in).second)
        cur -= bytes(in);
  }
  return peak;
}

/// x [16,16] f32 -> a = Exp(x) -> b = Transpose(a) -> c = MatMul(a, b) -> d = Relu(c) -> out.
std::unique_ptr<Graph> small_graph() {
  auto g = std::make_unique<Graph>();
  Value* x = g->add_input("x", DType::f32, Shape::of({16, 16}));
  passes::Builder B(*g, "fwd");
  Value* a = B.op("Exp", {x});
  Value* b = B.op("Transpose", {a}, passes::make_attrs({{"perm", std::vector<int64_t>{1, 0}}}));
  Value* c = B.op("MatMul", {a, b});
  Value* d = B.op("Relu", {c});
  EXPECT_TRUE(B.status()) << B.status().message();
  g->outputs = {d};
  return g;
}

TEST(MemoryPlan, SmallGraphPeakMatchesHandCount) {
  auto g = small_graph();
  // Each value is 16*16*4 = 1024 B. Live sets (x is resident):
  //  node 0 Exp:       x a           = 2048
  //  node 1 Transpose: x a b         = 3072
  //  node 2 MatMul:    x a b c       = 4096   <- peak (a, b die after node 2)
  //  node 3 Relu:      x c d         = 3072 eager; x c|d (in place) = 2048
  auto eager = passes::plan_memory(*g, PlanOptions::eager());
  ASSERT_TRUE(eager) << eager.message();
  EXPECT_EQ(eager->peak_bytes, 4096);
  EXPECT_EQ(eager->peak_node, 2);
  EXPECT_EQ(eager->in_place_reuses, 0);
  EXPECT_EQ(eager->persistent_bytes, 1024);
  EXPECT_EQ(simulate_eager_peak(*g), 4096);
  auto planned = passes::plan_memory(*g);
  ASSERT_TRUE(planned) << planned.message();
  EXPECT_EQ(planned->peak_bytes, 4096);
  EXPECT_EQ(planned->in_place_reuses, 1);  // Relu writes into c's buffer
  EXPECT_EQ(planned->buffers.size(), 3u);
  // a, b, c are live together at node 2: arena needs 3 KiB; d reuses c.
  EXPECT_EQ(planned->arena_bytes, 3072);
  EXPECT_EQ(expect_no_overlap(*planned), 3);  // (a,b), (a,c), (b,c); d shares c's buffer
  expect_no_overlap(*eager);
  // No state: everything made by a node is a temporary, x is data.
  EXPECT_EQ(planned->at_peak[static_cast<int>(MemoryCategory::temporaries)], 3072);
  EXPECT_EQ(planned->at_peak[static_cast<int>(MemoryCategory::data_and_buffers)], 1024);
}

/// x (f32[1000] input) -> ops[0] -> ops[1] -> ...: a chain of single-input pointwise
/// nodes named "chain/..."; the last is the graph output. Returns the node outputs in
/// order (empty if a node could not be built).
std::vector<Value*> pointwise_chain(Graph& g, const std::vector<std::string>& ops) {
  Value* v = g.add_input("x", DType::f32, Shape::of({1000}));
  passes::Builder B(g, "chain");
  std::vector<Value*> out;
  for (const std::string& op : ops) out.push_back(v = B.op(op, {v}));
  if (!B.status()) return {};
  g.outputs = {v};
  return out;
}

// PlanOptions::heap_values (the step arena's values kept on the heap): a buffer whose
// first value is listed takes no arena space and gets offset -1; its bytes still count.
TEST(MemoryPlan, HeapValuesTakeNoArenaSpace) {
  auto g = std::make_unique<Graph>();
  std::vector<Value*> v = pointwise_chain(*g, {"Exp", "Relu", "Neg"});
  ASSERT_EQ(v.size(), 3u);
  Value *b = v[1], *c = v[2];
  PlanOptions o;
  o.in_place = false;
  auto all = passes::plan_memory(*g, o);
  ASSERT_TRUE(all) << all.message();
  // a dies at Relu, b at Neg: a|b, b|c overlap pairwise; c may reuse a's bytes.
  EXPECT_EQ(all->arena_bytes, 2 * 4032);
  std::unordered_set<const ir::Value*> heap = {c};
  o.heap_values = &heap;
  auto some = passes::plan_memory(*g, o);
  ASSERT_TRUE(some) << some.message();
  EXPECT_EQ(some->peak_bytes, all->peak_bytes);
  int off_arena = 0;
  for (const auto& buf : some->buffers)
    if (!buf.in_arena) {
      ++off_arena;
      EXPECT_EQ(buf.offset, -1);
      EXPECT_EQ(some->values[buf.values.front()].value, c);
    }
  EXPECT_EQ(off_arena, 1);
  for (const auto& vp : some->values)
    if (vp.value == c) EXPECT_EQ(vp.offset, -1);
  EXPECT_EQ(some->arena_bytes, 2 * 4032);  // a and b still overlap
  heap = {b};
  auto mid = passes::plan_memory(*g, o);
  ASSERT_TRUE(mid) << mid.message();
  EXPECT_EQ(mid->arena_bytes, 4032);  // a and c never overlap: one slot
}

TEST(MemoryPlan, PointwiseChainRunsInOneBuffer) {
  auto g = std::make_unique<Graph>();
  ASSERT_EQ(pointwise_chain(*g, {"Exp", "Relu", "Neg", "Sigmoid"}).size(), 4u);
  auto p = passes::plan_memory(*g);
  ASSERT_TRUE(p) << p.message();
  EXPECT_EQ(p->in_place_reuses, 3);
  ASSERT_EQ(p->buffers.size(), 1u);
  EXPECT_EQ(p->buffers[0].values.size(), 4u);
  EXPECT_EQ(p->peak_bytes, 8000);   // x + one 4000-byte buffer
  EXPECT_EQ(p->arena_bytes, 4032);  // 4000 rounded up to 64
  auto e = passes::plan_memory(*g, PlanOptions::eager());
  ASSERT_TRUE(e) << e.message();
  EXPECT_EQ(e->peak_bytes, 12000);  // x + input + output of each op
  EXPECT_EQ(e->peak_bytes, simulate_eager_peak(*g));
  // An input still needed later is never overwritten.
  auto g2 = std::make_unique<Graph>();
  Value* y = g2->add_input("y", DType::f32, Shape::of({1000}));
  passes::Builder B2(*g2, "fork");
  Value* e1 = B2.op("Exp", {y});
  Value* r = B2.op("Relu", {e1});
  Value* s = B2.op("Add", {r, e1});  // e1 dies here: in place into e1 or r
  ASSERT_TRUE(B2.status()) << B2.status().message();
  g2->outputs = {s};
  auto p2 = passes::plan_memory(*g2);
  ASSERT_TRUE(p2) << p2.message();
  EXPECT_EQ(p2->in_place_reuses, 1);  // Relu may not reuse e1 (read again by Add)
  EXPECT_EQ(p2->peak_bytes, 12000);
  expect_no_overlap(*p2);
}

TEST(MemoryPlan, NonStaticShapeIsAnError) {
  auto g = std::make_unique<Graph>();
  Shape s;
  s.dims = {Dim(std::string("batch")), Dim(4)};
  Value* x = g->add_input("x", DType::f32, s);
  passes::Builder B(*g, "f");
  Value* y = B.op("Relu", {x});
  g->outputs = {y};
  auto p = passes::plan_memory(*g);
  ASSERT_FALSE(p);
  EXPECT_NE(p.message().find("'x'"), std::string::npos) << p.message();
}

// ---------------------------------------------------------------- example models

runtime::TrainConfig config_for(const std::string& model, int64_t batch, bool bf16, int64_t accum = 1) {
  runtime::TrainConfig cfg;
  cfg.gradient_accumulation_steps = accum;
  cfg.model = example_path(model, "model.onnx");
  cfg.per_device_train_batch_size = batch;
  cfg.per_device_eval_batch_size = batch;
  cfg.loss = "cross_entropy";
  cfg.bf16 = bf16;
  // Every product in low precision (torch.autocast), whatever its size: the mechanism under test.
  if (cfg.bf16 || cfg.fp16) cfg.autocast_min_flops = 0;
  return cfg;
}

struct StepMeasure {
  int64_t planned = 0, measured = 0;
  MemoryPlan plan;  ///< points into prog's train_step
  std::shared_ptr<driver::TrainingProgram> prog;
};

/// `t` repeated `n` times along axis 0 (the N microbatches of an accumulated step).
Tensor tile_rows(const Tensor& t, int64_t n) {
  std::vector<int64_t> dims = t.dims();
  dims[0] *= n;
  Tensor out(t.dtype(), dims);
  for (int64_t i = 0; i < n; ++i)
    std::memcpy(static_cast<char*>(out.raw()) + static_cast<size_t>(i) * t.nbytes(), t.raw(), t.nbytes());
  return out;
}

/// Plans the train_step with eager semantics, then runs one eager training step on the
/// fixture batch and measures the interpreter's peak: MemoryStats peak during the run
/// minus the bytes resident before it, plus the resident bytes the step itself uses
/// (its feeds and its constant initializers).
/// With `accum` > 1 the step runs `accum` microbatches of the fixture batch (the
/// fixture tiled `accum` times) inside an AccumulationLoop.
/// `optim`, `fp16` and `micro_repeat` (the microbatch is the fixture batch tiled that many
/// times) select other training configurations.
void measure_example(const std::string& model, bool bf16, StepMeasure& m, int64_t accum = 1,
                     const std::string& optim = "adamw_torch", bool fp16 = false, int64_t micro_repeat = 1) {
  auto x0 = runtime::io::load_npy(example_path(model, "fixtures/batch_input.npy"));
  ASSERT_TRUE(x0) << x0.message();
  auto y0 = runtime::io::load_npy(example_path(model, "fixtures/batch_labels.npy"));
  ASSERT_TRUE(y0) << y0.message();
  const int64_t micro = x0->dim(0) * micro_repeat;
  std::optional<Tensor> x(tile_rows(*x0, accum * micro_repeat)), y(tile_rows(*y0, accum * micro_repeat));
  runtime::TrainConfig cfg = config_for(model, micro, bf16, accum);
  cfg.optim = optim;
  cfg.fp16 = fp16;
  // Every product in low precision (torch.autocast), whatever its size: the mechanism under test.
  if (cfg.bf16 || cfg.fp16) cfg.autocast_min_flops = 0;
  auto built = driver::build_training_program(cfg);
  ASSERT_TRUE(built) << built.message();
  m.prog = std::make_shared<driver::TrainingProgram>(std::move(*built));
  const auto& prog = m.prog;
  const Graph& g = *prog->train_step;
  auto plan = passes::plan_memory(g, PlanOptions::eager());
  ASSERT_TRUE(plan) << plan.message();
  EXPECT_GT(expect_no_overlap(*plan), 0);
  auto planned_compiled = passes::plan_memory(g);
  ASSERT_TRUE(planned_compiled) << planned_compiled.message();
  expect_no_overlap(*planned_compiled);
  EXPECT_LE(planned_compiled->peak_bytes, plan->peak_bytes);
  if (accum <= 1) EXPECT_EQ(simulate_eager_peak(g), plan->peak_bytes);  // (no regions there)

  std::map<std::string, Tensor> feeds;
  for (auto& sb : g.state) feeds[sb.input->name] = sb.initial->clone();
  runtime::add_num_items_feed(g, *y, cfg.ignore_index, feeds);
  if (accum > 1) {  // microbatches streamed into the loop, as the trainer runs them
    m.measured = kiln::testing::measured_step_peak(
        g, feeds, runtime::microbatches_of({{prog->data_inputs[0], *x}, {prog->label_input, *y}}));
  } else {
    feeds[prog->data_inputs[0]] = *x;
    feeds[prog->label_input] = *y;
    m.measured = kiln::testing::measured_step_peak(g, feeds);
  }
  ASSERT_GE(m.measured, 0);
  m.planned = plan->peak_bytes;
  m.plan = std::move(*plan);
  std::cout << "[ MEMORY ] " << model << (bf16 ? " --bf16" : "") << (fp16 ? " --fp16" : "") << " --optim " << optim
            << " microbatch " << micro
            << (accum > 1 ? " --gradient_accumulation_steps " + std::to_string(accum) : std::string()) << ": planned "
            << m.planned << " B (" << passes::human_bytes(m.planned) << "), measured " << m.measured << " B, diff "
            << 100.0 * double(m.planned - m.measured) / double(m.measured) << "%; compiled plan (in-place) "
            << planned_compiled->peak_bytes << " B, arena " << planned_compiled->arena_bytes << " B, "
            << planned_compiled->in_place_reuses << " in-place reuses; saved activations "
            << m.plan.saved_activation_bytes << " B\n";
}

class ExampleMemory : public ::testing::TestWithParam<const char*> {};

TEST_P(ExampleMemory, PlannedPeakMatchesMeasuredEagerStep) {
  StepMeasure m;
  measure_example(GetParam(), false, m);
  if (HasFatalFailure()) return;
  ASSERT_GT(m.measured, 0);
  // The eager kernels allocate no tensors besides their outputs, so the plan with the
  // interpreter's semantics should be exact; 5% is the acceptance bound.
  EXPECT_LE(std::abs(double(m.planned - m.measured)) / double(m.measured), 0.05)
      << "planned " << m.planned << " measured " << m.measured;
  std::cout << passes::format_memory_plan(m.plan);
  // The categories partition the peak; parameters and AdamW state (2 fp32 moments) exist.
  int64_t sum = 0;
  for (int64_t c : m.plan.at_peak) sum += c;
  EXPECT_EQ(sum, m.plan.peak_bytes);
  EXPECT_GT(m.plan.at_peak[static_cast<int>(MemoryCategory::parameters)], 0);
  EXPECT_GT(m.plan.max_by_category[static_cast<int>(MemoryCategory::gradients)], 0);
  EXPECT_GT(m.plan.saved_activation_bytes, 0);
  EXPECT_DOUBLE_EQ(m.plan.optimizer_state_bytes_per_param_element(), 8.0);
}

INSTANTIATE_TEST_SUITE_P(Examples, ExampleMemory, ::testing::Values("mlp_digits", "cnn_bn", "tiny_gpt", "resnet18"),
                         [](const auto& info) { return std::string(info.param); });

/// bf16 / fp32 saved-activation bytes of the tiny GPT training step (fixture batch).
double tiny_gpt_saved_ratio(StepMeasure& f32, StepMeasure& b16) {
  measure_example("tiny_gpt", false, f32);
  if (::testing::Test::HasFatalFailure()) return 0;
  measure_example("tiny_gpt", true, b16);
  if (::testing::Test::HasFatalFailure()) return 0;
  return double(b16.plan.saved_activation_bytes) / double(f32.plan.saved_activation_bytes);
}

// With --bf16 the saved activations shrink, and the planner sees the low-precision weight copies.
// Measured ratio 0.502 (2026-11-29; 0.776 before autocast's rules (a)-(c), see
// passes/autocast.cpp): the only fp32 saved values left are the residual stream feeding
// LayerNormalization (0.33 MB, fp32 in PyTorch autocast too); the breakdown is printed below.
TEST(MemoryPlan, TinyGptBf16SavedActivations) {
  StepMeasure f32, b16;
  const double ratio = tiny_gpt_saved_ratio(f32, b16);
  if (HasFatalFailure()) return;
  EXPECT_LE(std::abs(double(b16.planned - b16.measured)) / double(b16.measured), 0.05);
  EXPECT_GT(b16.plan.max_by_category[static_cast<int>(MemoryCategory::low_precision_weights)], 0);
  std::cout << "[ MEMORY ] tiny_gpt saved activations: fp32 " << f32.plan.saved_activation_bytes << " B, bf16 "
            << b16.plan.saved_activation_bytes << " B, ratio " << ratio << "\n";
  // What the saved bytes are, by producing op and dtype (printed for the report).
  std::map<std::string, int64_t> by_kind;
  for (const auto& v : b16.plan.values)
    if (v.category == MemoryCategory::saved_activations)
      by_kind[(v.value->producer ? v.value->producer->op : std::string("input")) + " " + dtype_name(v.value->dtype)] +=
          v.bytes;
  for (auto& [k, b] : by_kind) std::cout << "[ MEMORY ]   bf16 saved: " << k << " " << b << " B\n";
  // f32 saved values by the forward ops that read them (which op table policy kept them fp32).
  std::map<std::string, int64_t> f32_readers;
  const Graph& bg = *b16.prog->train_step;
  for (const auto& v : b16.plan.values) {
    if (v.category != MemoryCategory::saved_activations || v.value->dtype != DType::f32) continue;
    std::set<std::string> ops;
    for (auto& u : bg.uses(v.value))
      if (u.user->name.find("/grad") == std::string::npos && u.user->name.rfind("optimizer/", 0) != 0) {
        const OpDef* d = OpTable::get().find(u.user->op);
        ops.insert(u.user->op + "(" + (d ? precision_policy_name(d->precision) : "?") + ")");
      }
    std::string key = v.value->producer->op + " -> ";
    for (auto& o : ops) key += o + " ";
    f32_readers[key] += v.bytes;
  }
  for (auto& [k, b] : f32_readers) std::cout << "[ MEMORY ]   f32 saved: " << k << b << " B\n";
  EXPECT_LT(ratio, 0.53);  // regression guard at the measured 0.502
}

// Issue 4's acceptance point: saved activations with --bf16 at most 55% of fp32's
// (0.502 measured; breakdown printed by TinyGptBf16SavedActivations).
TEST(MemoryPlan, TinyGptBf16SavedActivationsAtMost55PercentOfFp32) {
  StepMeasure f32, b16;
  const double ratio = tiny_gpt_saved_ratio(f32, b16);
  if (HasFatalFailure()) return;
  EXPECT_LE(ratio, 0.55);
}

// ---------------------------------------------------------------- gradient accumulation

/// x [8,4] (scan) and w [4] (captured) -> acc0 = zeros [2,4] -> AccumulationLoop (4 trips,
/// carried acc) { y = xs * w; s = Relu(y); acc' = Add(acc, s) kiln_inplace=0 } -> Relu.
std::unique_ptr<Graph> small_loop_graph() {
  auto g = std::make_unique<Graph>();
  Value* x = g->add_input("x", DType::f32, Shape::of({8, 4}));
  Value* w = g->add_input("w", DType::f32, Shape::of({4}));
  passes::Builder B(*g, "outer");
  Tensor zero(DType::f32, {1});
  std::memset(zero.raw(), 0, zero.nbytes());
  Attributes za;
  za.set("value", zero);
  Value* acc0 = B.op("ConstantOfShape", {B.ints({2, 4})}, za);
  EXPECT_TRUE(B.status()) << B.status().message();
  auto body = std::make_unique<Graph>();
  body->name = "body";
  Value* acc_in = body->add_input("acc.in", DType::f32, Shape::of({2, 4}));
  Value* xs = body->add_input("xs", DType::f32, Shape::of({2, 4}));
  Node* mul = body->add_node("Mul", "body/mul", {xs, w}, {"y"});
  EXPECT_TRUE(ir::infer_node(*mul));
  Node* relu = body->add_node("Relu", "body/relu", {mul->outputs[0]}, {"s"});
  EXPECT_TRUE(ir::infer_node(*relu));
  Attributes aa;
  aa.set("kiln_inplace", int64_t(0));
  Node* add = body->add_node("Add", "body/add", {acc_in, relu->outputs[0]}, {"acc.next"}, aa);
  EXPECT_TRUE(ir::infer_node(*add));
  body->outputs = {add->outputs[0]};
  Attributes la;
  la.set("trip_count", int64_t(4));
  la.set("num_carried", int64_t(1));
  Node* loop = g->add_node("AccumulationLoop", "loop", {acc0, x}, {"acc"}, la);
  loop->regions.push_back(std::move(body));
  EXPECT_TRUE(ir::infer_node(*loop));
  Value* out = B.op("Relu", {loop->outputs[0]});
  EXPECT_TRUE(B.status()) << B.status().message();
  g->outputs = {out};
  return g;
}

TEST(MemoryPlan, AccumulationLoopPeakMatchesHandCountAndInterpreter) {
  auto g = small_loop_graph();
  // 32 B per [2,4] f32 value; resident x 128 + w 16 + the shape constant 16 = 160.
  // Schedule: 0 ConstantOfShape, 1 Mul, 2 Relu, 3 Add (body, one iteration), 4 loop, 5 Relu.
  //  0: acc0                        192
  //  1: acc(moved in) xs y          256  <- peak (xs dies here)
  //  2: acc y s                     256
  //  3: acc'(in place) s            224
  //  4: acc (loop output)           192
  //  5: acc o                       224
  PlanOptions fed = PlanOptions::eager();
  fed.streamed_microbatches = false;  // x is fed whole (128 B resident)
  auto p = passes::plan_memory(*g, fed);
  ASSERT_TRUE(p) << p.message();
  EXPECT_EQ(p->num_nodes, 6);
  EXPECT_EQ(p->accumulation_loops, 1);
  EXPECT_EQ(p->trip_count, 4);
  EXPECT_EQ(p->persistent_bytes, 160);
  EXPECT_EQ(p->peak_bytes, 256);
  EXPECT_EQ(p->peak_node, 1);
  EXPECT_TRUE(p->peak_in_loop_body);
  EXPECT_EQ(p->in_place_reuses, 1);  // the kiln_inplace Add
  expect_no_overlap(*p);
  // One chain: acc0 -> body input -> Add output -> loop output share a buffer.
  const Value* acc0 = g->nodes()[0]->outputs[0];
  const Value* acc = g->nodes()[1]->outputs[0];
  int b0 = -1, b1 = -2;
  for (auto& v : p->values) {
    if (v.value == acc0) b0 = v.buffer;
    if (v.value == acc) b1 = v.buffer;
  }
  EXPECT_EQ(b0, b1);
  // Without honouring kiln_inplace, step 3 holds acc, s and acc' (256): same peak here,
  // one reuse less.
  PlanOptions no_attr = fed;
  no_attr.honor_inplace_attr = false;
  auto q = passes::plan_memory(*g, no_attr);
  ASSERT_TRUE(q) << q.message();
  EXPECT_EQ(q->in_place_reuses, 0);
  EXPECT_EQ(q->peak_bytes, 256);

  // The interpreter's measured peak (MemoryStats) and the result (independent float math).
  Tensor x(DType::f32, {8, 4}), w(DType::f32, {4});
  for (int i = 0; i < 32; ++i) x.set_f64(i, 0.25 * (i % 7) - 0.5);
  for (int i = 0; i < 4; ++i) w.set_f64(i, 1.0 + i);
  std::map<std::string, Tensor> feeds{{"x", x}, {"w", w}};
  const int64_t resident = 128 + 16 + 16;
  const int64_t before = MemoryStats::current_bytes();
  MemoryStats::reset_peak();
  {
    auto out = runtime::run_graph(*g, feeds, runtime::RunOptions{});
    ASSERT_TRUE(out) << out.message();
    const Tensor& o = out->begin()->second;
    for (int r = 0; r < 2; ++r)
      for (int c = 0; c < 4; ++c) {
        double ref = 0;
        for (int t = 0; t < 4; ++t) ref += std::max(0.0, x.get_f64((2 * t + r) * 4 + c) * w.get_f64(c));
        EXPECT_NEAR(o.get_f64(r * 4 + c), ref, 1e-6);
      }
  }
  EXPECT_EQ(MemoryStats::peak_bytes() - before + resident, 256);

  // Streamed (the trainer's way): x is never resident whole, each iteration's 2 rows are
  // the body input xs: resident w 16 + shape 16 = 32; peak 256 - 128 = 128 at node 1.
  auto st = passes::plan_memory(*g, PlanOptions::eager());
  ASSERT_TRUE(st) << st.message();
  EXPECT_EQ(st->persistent_bytes, 32);
  EXPECT_EQ(st->peak_bytes, 128);
  runtime::RunOptions ro;
  ro.microbatch = runtime::microbatches_of({{"x", x}});
  std::map<std::string, Tensor> wfeed{{"w", w}};
  const int64_t before2 = MemoryStats::current_bytes();
  MemoryStats::reset_peak();
  {
    auto out = runtime::run_graph(*g, wfeed, ro);
    ASSERT_TRUE(out) << out.message();
    for (int r = 0; r < 2; ++r)
      for (int c = 0; c < 4; ++c) {
        double ref = 0;
        for (int t = 0; t < 4; ++t) ref += std::max(0.0, x.get_f64((2 * t + r) * 4 + c) * w.get_f64(c));
        EXPECT_NEAR(out->begin()->second.get_f64(r * 4 + c), ref, 1e-6);
      }
  }
  EXPECT_EQ(MemoryStats::peak_bytes() - before2 + 32, 128);
}

class AccumulatedMemory : public ::testing::TestWithParam<const char*> {};

// --gradient_accumulation_steps 4: the plan (loop body included) against the measured
// peak of one eager step of 4 microbatches of the fixture batch.
TEST_P(AccumulatedMemory, PlannedPeakMatchesMeasuredWithFourMicrobatches) {
  StepMeasure m4, m1;
  measure_example(GetParam(), false, m4, 4);
  if (HasFatalFailure()) return;
  measure_example(GetParam(), false, m1, 1);
  if (HasFatalFailure()) return;
  ASSERT_GT(m4.measured, 0);
  EXPECT_EQ(m4.plan.accumulation_loops, 1);
  EXPECT_EQ(m4.plan.trip_count, 4);
  EXPECT_LE(std::abs(double(m4.planned - m4.measured)) / double(m4.measured), 0.05)
      << "planned " << m4.planned << " measured " << m4.measured;
  std::cout << passes::format_memory_plan(m4.plan);
  int64_t sum = 0;
  for (int64_t c : m4.plan.at_peak) sum += c;
  EXPECT_EQ(sum, m4.plan.peak_bytes);
  // Accumulators are gradients: at least one fp32 copy of every parameter.
  EXPECT_GE(m4.plan.max_by_category[static_cast<int>(MemoryCategory::gradients)], 4 * m4.plan.parameter_elements);
  EXPECT_GT(m4.plan.in_place_reuses, 0);  // the kiln_inplace accumulator Adds
  EXPECT_DOUBLE_EQ(m4.plan.optimizer_state_bytes_per_param_element(), 8.0);
  std::cout << "[ MEMORY ] " << GetParam() << " N=4 vs N=1 at microbatch "
            << "fixture: planned " << m4.planned << " / " << m1.planned << " = "
            << double(m4.planned) / double(m1.planned) << ", measured " << m4.measured << " / " << m1.measured << " = "
            << double(m4.measured) / double(m1.measured) << "\n";
}

INSTANTIATE_TEST_SUITE_P(Examples, AccumulatedMemory, ::testing::Values("mlp_digits", "tiny_gpt"),
                         [](const auto& info) { return std::string(info.param); });

// A compiled program's FusedKernel nodes take the phase of the nodes they hold, so its
// plan still finds the gradients (the parameter gradients live before the update).
TEST(MemoryPlan, CompiledProgramCategoriesSeeThroughFusedKernels) {
  runtime::TrainConfig cfg = config_for("tiny_gpt", 4, false);
  cfg.backend = "compiled";
  cfg.no_cache = true;
  auto prog = driver::build_training_program(cfg);
  ASSERT_TRUE(prog) << prog.message();
  int fused = 0;
  for (auto& n : prog->train_step->nodes()) fused += n->op == "FusedKernel";
  ASSERT_GT(fused, 10);
  auto p = passes::plan_memory(*prog->train_step, PlanOptions::eager());
  ASSERT_TRUE(p) << p.message();
  EXPECT_GE(p->max_by_category[static_cast<int>(MemoryCategory::gradients)], 4 * p->parameter_elements);
  EXPECT_GT(p->max_by_category[static_cast<int>(MemoryCategory::saved_activations)], 0);
}

// ---------------------------------------------------------------- optimizer state

// Bytes of optimizer state per parameter element: adamw_torch keeps two fp32 moments
// (8 B); adamw_8bit keeps, for parameters of >= 4096 elements, two u8 codes per element
// plus one f32 absmax per 256-element block per moment (bitsandbytes' blockwise layout:
// 2 + 8/256 = 2.03 B), and fp32 moments for the smaller ones.
TEST(MemoryPlan, OptimizerStateBytesPerParameter8bitVsFp32) {
  for (const std::string optim : {"adamw_torch", "adamw_8bit"}) {
    SCOPED_TRACE(optim);
    runtime::TrainConfig cfg = config_for("tiny_gpt", 4, false);
    cfg.optim = optim;
    auto prog = driver::build_training_program(cfg);
    ASSERT_TRUE(prog) << prog.message();
    const Graph& g = *prog->train_step;
    auto p = passes::plan_memory(g, PlanOptions::eager());
    ASSERT_TRUE(p) << p.message();
    int64_t e8 = 0, b8 = 0, eo = 0, bo = 0;
    int t8 = 0;
    for (auto& sb : g.state) {
      if (sb.kind != "parameter") continue;
      const int64_t n = sb.input->shape.numel();
      if (optim == "adamw_8bit" && n >= 4096) {
        e8 += n, b8 += 2 * n + 2 * 4 * ((n + 255) / 256), ++t8;
      } else {
        eo += n, bo += 8 * n;
      }
    }
    EXPECT_EQ(p->parameter_elements, e8 + eo);
    EXPECT_EQ(p->optimizer_state_bytes, b8 + bo);
    EXPECT_EQ(p->optim_8bit.tensors, t8);
    EXPECT_EQ(p->optim_8bit.param_elements, e8);
    EXPECT_EQ(p->optim_8bit.state_bytes, b8);
    EXPECT_EQ(p->optim_other.param_elements, eo);
    EXPECT_EQ(p->optim_other.state_bytes, bo);
    if (eo) EXPECT_DOUBLE_EQ(p->optim_other.bytes_per_param(), 8.0);
    const std::string report = passes::format_memory_plan(*p);
    EXPECT_NE(report.find("optimizer state per parameter: "), std::string::npos) << report;
    std::cout << "[ MEMORY ] tiny_gpt --optim " << optim << ": "
              << report.substr(report.find("optimizer state per parameter"),
                               report.find('\n', report.find("optimizer state per parameter")) -
                                   report.find("optimizer state per parameter"))
              << "\n";
    if (optim == "adamw_torch") {
      EXPECT_DOUBLE_EQ(p->optimizer_state_bytes_per_param_element(), 8.0);
      EXPECT_EQ(p->optim_8bit.tensors, 0);
    } else {
      ASSERT_GT(t8, 0) << "tiny_gpt has no parameter of >= 4096 elements";
      EXPECT_NEAR(p->optim_8bit.bytes_per_param(), 2.03, 0.01);
      EXPECT_NE(report.find("8-bit blockwise: 2.03 B/param"), std::string::npos) << report;
      EXPECT_LT(p->optimizer_state_bytes_per_param_element(), 8.0);
    }
  }
}

// Regression (user report): with --optim adamw_8bit the plan underestimated the measured
// peak (-9.3% for mlp_digits --fp16 at batch 128, -1.4% at 4 x 32 accumulated rows).
// Cause: the eager f16 Gemm kernel allocates an f64 [M, N] product tensor; with 8-bit
// state the step's peak moves from the optimizer to those Gemms. The eager plan must
// equal the interpreter's measured peak exactly, as it does for adamw_torch and sgd.
TEST(MemoryPlan, Adamw8bitPlannedEqualsMeasured) {
  struct Case {
    bool fp16;
    int64_t accum, repeat;  // microbatch = 8 fixture rows x repeat
  };
  for (const Case c : {Case{true, 1, 16}, Case{false, 1, 16}, Case{false, 4, 4}, Case{true, 4, 4}}) {
    SCOPED_TRACE(std::string(c.fp16 ? "fp16" : "fp32") + " accum " + std::to_string(c.accum) + " microbatch " +
                 std::to_string(8 * c.repeat));
    StepMeasure m;
    measure_example("mlp_digits", false, m, c.accum, "adamw_8bit", c.fp16, c.repeat);
    if (HasFatalFailure()) return;
    ASSERT_GT(m.measured, 0);
    EXPECT_EQ(m.planned, m.measured);
    EXPECT_GT(m.plan.optim_8bit.tensors, 0);
    if (c.fp16) {
      EXPECT_GT(m.plan.kernel_scratch_bytes, 0);
      EXPECT_GT(m.plan.max_by_category[static_cast<int>(MemoryCategory::low_precision_weights)], 0);
      const std::string report = passes::format_memory_plan(m.plan);
      EXPECT_NE(report.find("low-precision weight copies"), std::string::npos) << report;
      EXPECT_EQ(report.find("bf16 weight"), std::string::npos) << report;
    } else {
      EXPECT_EQ(m.plan.kernel_scratch_bytes, 0);  // f32 Gemm: oneDNN, no tensor scratch
    }
    int64_t sum = 0;
    for (int64_t b : m.plan.at_peak) sum += b;
    EXPECT_EQ(sum, m.plan.peak_bytes);
  }
}

}  // namespace
