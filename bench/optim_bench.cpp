// Microbenchmarks (Google Benchmark) of the optimizer step: the fused 8-bit AdamW update
// (--optim adamw_8bit: one AdamW8bitUpdate node per parameter) against the fp32
// adamw_torch update (its IR op sequence, one eager kernel and one allocation per op),
// on the same parameter. Both programs come from the real optimizer pass applied to a
// graph that holds just one parameter, its gradient (a graph input) and a scalar loss
// input, so they also contain the same clipping-norm and LR-schedule ops; each is run by
// runtime::run_graph, the state outputs fed back as the next step's inputs.
//
//   build/bin/kiln_microbench --benchmark_filter=Optim
//
// items_per_second = parameter elements updated per second; the acceptance is
// adamw_8bit throughput >= 0.8 x adamw_torch's (both memory-bandwidth bound).
#include <benchmark/benchmark.h>

#include <cstdio>
#include <map>
#include <memory>
#include <random>

#include "ir/graph.h"
#include "ir/op_table.h"
#include "ir/ops/optim8bit.h"
#include "passes/pass.h"
#include "passes/training_util.h"
#include "runtime/interpreter.h"
#include "runtime/kernels/kernels.h"

using namespace kiln;
using ir::DType;
using ir::Tensor;

namespace {

struct OptimProgram {
  std::unique_ptr<ir::Graph> g;
  std::map<std::string, Tensor> feeds;
};

/// One (rows, cols) parameter "w" with gradient input "w.grad", optimized by `optim`.
OptimProgram build(const std::string& optim, int64_t rows, int64_t cols) {
  OptimProgram p;
  p.g = std::make_unique<ir::Graph>();
  ir::Graph& g = *p.g;
  ir::Value* w = g.add_input("w", DType::f32, ir::Shape::of({rows, cols}));
  ir::Value* gr = g.add_input("w.grad", DType::f32, ir::Shape::of({rows, cols}));
  ir::Value* loss = g.add_input("loss", DType::f32, ir::Shape());
  std::mt19937 rng(1);
  std::normal_distribution<float> nd(0.f, 1.f);
  Tensor wt(DType::f32, {rows, cols}), gt(DType::f32, {rows, cols});
  for (int64_t i = 0; i < wt.numel(); ++i) wt.data<float>()[i] = 0.02f * nd(rng), gt.data<float>()[i] = 1e-3f * nd(rng);
  g.state.push_back({"parameter", w, nullptr, std::make_shared<Tensor>(wt)});
  g.outputs = {loss};
  passes::PassContext ctx;
  ctx.options.optimizer.optim = optim;
  ctx.options.optimizer.learning_rate = 1e-3;
  ctx.options.optimizer.weight_decay = 0.01;
  ctx.options.optimizer.max_grad_norm = 1.0;
  ctx.options.optimizer.total_steps = 1000000;
  ctx.options.optimizer.lr_scheduler_type = "linear";
  Status st = passes::run_pipeline(g, {"optimizer"}, ctx);
  if (!st) {
    std::fprintf(stderr, "optimizer pass: %s\n", st.message().c_str());
    std::abort();
  }
  for (auto& sb : g.state) p.feeds[sb.input->name] = sb.initial->clone();
  p.feeds["w.grad"] = gt;
  p.feeds["loss"] = Tensor::scalar_f32(0.f);
  return p;
}

void run_optim(benchmark::State& state, const std::string& optim) {
  runtime::register_eager_kernels();
  const int64_t rows = state.range(0), cols = state.range(1);
  OptimProgram p = build(optim, rows, cols);
  int nodes = static_cast<int>(p.g->nodes().size());
  for (auto _ : state) {
    auto out = runtime::run_graph(*p.g, p.feeds);
    if (!out) {
      state.SkipWithError(out.message().c_str());
      return;
    }
    for (auto& sb : p.g->state) p.feeds[sb.input->name] = (*out)[sb.output->name];
    benchmark::DoNotOptimize(p.feeds);
  }
  state.SetItemsProcessed(state.iterations() * rows * cols);
  state.counters["ir_nodes"] = nodes;
}

/// The AdamW8bitUpdate kernel alone on `n` elements, its outputs allocated once (as in
/// the compiled program, where they live in planned buffers): the state is fed back in
/// place of the inputs each iteration, so the codes evolve as in training.
void BM_OptimAdamW8bitKernel(benchmark::State& state) {
  runtime::register_eager_kernels();
  const int64_t n = state.range(0), nb = (n + 255) / 256;
  std::mt19937 rng(1);
  std::normal_distribution<float> nd(0.f, 1.f);
  ir::Graph g;
  std::vector<ir::Value*> in;
  auto f32 = [&](const char* name, int64_t k) { return g.add_input(name, DType::f32, ir::Shape::of({k})); };
  in = {f32("p", n),
        f32("g", n),
        g.add_input("q1", DType::u8, ir::Shape::of({n})),
        f32("a1", nb),
        g.add_input("q2", DType::u8, ir::Shape::of({n})),
        f32("a2", nb),
        f32("qs", 256),
        f32("qu", 256),
        f32("lr", 1),
        f32("ss", 1),
        f32("sb", 1)};
  ir::Attributes at;
  at.set("beta1", 0.9);
  at.set("beta2", 0.999);
  at.set("eps", 1e-8);
  at.set("weight_decay", 0.01);
  ir::Node* node = g.add_node("AdamW8bitUpdate", "update", in, {"p1", "q1o", "a1o", "q2o", "a2o"}, at);
  std::vector<Tensor> t = {Tensor(DType::f32, {n}),
                           Tensor(DType::f32, {n}),
                           Tensor(DType::u8, {n}),
                           Tensor(DType::f32, {nb}),
                           Tensor(DType::u8, {n}),
                           Tensor(DType::f32, {nb}),
                           Tensor::from_f32(ir::create_dynamic_map(true), {256}),
                           Tensor::from_f32(ir::create_dynamic_map(false), {256}),
                           Tensor::scalar_f32(1e-3f),
                           Tensor::scalar_f32(1e-2f),
                           Tensor::scalar_f32(0.05f)};
  for (int64_t i = 0; i < n; ++i) t[0].data<float>()[i] = 0.02f * nd(rng), t[1].data<float>()[i] = 1e-3f * nd(rng);
  const uint8_t zs = ir::nearest_code(t[6].data<float>(), 0.f), zu = ir::nearest_code(t[7].data<float>(), 0.f);
  std::fill_n(t[2].data<uint8_t>(), n, zs);
  std::fill_n(t[4].data<uint8_t>(), n, zu);
  ir::KernelContext c{*node, {}, {}};
  for (auto& x : t) c.inputs.push_back(&x);
  c.outputs = {Tensor(DType::f32, {n}), Tensor(DType::u8, {n}), Tensor(DType::f32, {nb}), Tensor(DType::u8, {n}),
               Tensor(DType::f32, {nb})};
  const ir::KernelFn& kernel = ir::OpTable::get().find("AdamW8bitUpdate")->kernel;
  for (auto _ : state) {
    Status st = kernel(c);
    if (!st) {
      state.SkipWithError(st.message().c_str());
      return;
    }
    std::swap(t[0], c.outputs[0]);  // parameters and state fed back
    std::swap(t[2], c.outputs[1]);
    std::swap(t[3], c.outputs[2]);
    std::swap(t[4], c.outputs[3]);
    std::swap(t[5], c.outputs[4]);
  }
  state.SetItemsProcessed(state.iterations() * n);
  state.SetBytesProcessed(state.iterations() * n * 16);  // p, g in; p out (f32); 2 codes in and out
}

/// The eager Dropout kernel (Philox4x32-10 masks) on GPT-4-layer attention probabilities
/// (8 x 8 x 128 x 128 f32, ratio 0.1, mask output), by path: state.range(0) = 2 AVX-512,
/// 1 AVX2, 0 portable (capped by runtime::kernels::dropout_testing; skipped where the CPU
/// lacks it). All paths write the same bits.
void BM_KernelDropout(benchmark::State& state) {
  runtime::register_eager_kernels();
  namespace hooks = runtime::kernels::dropout_testing;
  const int prev = hooks::set_max_isa(static_cast<int>(state.range(0)));
  if (hooks::active_isa() != state.range(0)) {
    hooks::set_max_isa(prev);
    state.SkipWithError("this CPU lacks the instruction set of this path");
    return;
  }
  const int64_t n = 8 * 8 * 128 * 128;
  ir::Graph g;
  ir::Value* x = g.add_input("x", DType::f32, ir::Shape::of({n}));
  ir::Value* r = g.add_input("ratio", DType::f32, ir::Shape::of({}));
  ir::Node* node = g.add_node("Dropout", "dropout", {x, r}, {"y", "mask"}, ir::Attributes{});
  std::vector<Tensor> t = {Tensor(DType::f32, {n}), Tensor::scalar_f32(0.1f)};
  std::mt19937 rng(3);
  std::normal_distribution<float> nd(0.f, 1.f);
  for (int64_t i = 0; i < n; ++i) t[0].data<float>()[i] = nd(rng);
  ir::KernelContext c{*node, {&t[0], &t[1]}, {Tensor(DType::f32, {n}), Tensor(DType::boolean, {n})}};
  c.training = true;
  c.seed = 1234;
  const ir::KernelFn& kernel = ir::OpTable::get().find("Dropout")->kernel;
  for (auto _ : state) {
    c.step++;
    Status st = kernel(c);
    if (!st) {
      state.SkipWithError(st.message().c_str());
      break;
    }
  }
  hooks::set_max_isa(prev);
  state.SetItemsProcessed(state.iterations() * n);
  state.SetBytesProcessed(state.iterations() * n * 9);  // x in, y out (f32), mask out (1 B)
}

void BM_OptimAdamWTorchFp32(benchmark::State& s) { run_optim(s, "adamw_torch"); }
void BM_OptimAdamW8bitFused(benchmark::State& s) { run_optim(s, "adamw_8bit"); }

}  // namespace

// 2048 x 2048 = 4M parameters (16 MiB of f32 weights).
BENCHMARK(BM_OptimAdamWTorchFp32)->Args({2048, 2048})->Unit(benchmark::kMillisecond)->UseRealTime();
BENCHMARK(BM_OptimAdamW8bitFused)->Args({2048, 2048})->Unit(benchmark::kMillisecond)->UseRealTime();
// 262144: one GPT-4-layer MLP weight (4 MiB of state in, in L2/L3); 4M: streamed from memory.
BENCHMARK(BM_OptimAdamW8bitKernel)->Arg(262144)->Arg(4 << 20)->Unit(benchmark::kMicrosecond)->UseRealTime();

BENCHMARK(BM_KernelDropout)->Arg(2)->Arg(1)->Arg(0)->Unit(benchmark::kMicrosecond)->UseRealTime();

BENCHMARK_MAIN();
