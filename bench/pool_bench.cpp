// Microbenchmark of the eager max pooling kernels (runtime/kernels/nn.cpp) at ResNet-18's
// stem pool: 3x3, stride 2, pad 1 over (N, 8, 16, 16) f32 (width 8 on 32x32 images), N
// from the benchmark argument. One MaxPool or MaxPoolGrad node run through
// runtime::run_node, as the executor runs it.
// OMP_NUM_THREADS=1 build/bin/kiln_microbench --benchmark_filter=Pool
#include <benchmark/benchmark.h>

#include <random>

#include "ir/graph.h"
#include "runtime/interpreter.h"

namespace {

using namespace kiln;

struct PoolCase {
  ir::Graph g;
  ir::Node* pool = nullptr;
  ir::Node* grad = nullptr;
  ir::Tensor x, dy;
  explicit PoolCase(int64_t n) : x(ir::DType::f32, {n, 8, 16, 16}), dy(ir::DType::f32, {n, 8, 8, 8}) {
    runtime::register_eager_kernels();
    ir::Attributes a;
    a.set("kernel_shape", std::vector<int64_t>{3, 3});
    a.set("strides", std::vector<int64_t>{2, 2});
    a.set("pads", std::vector<int64_t>{1, 1, 1, 1});
    ir::Value* xv = g.add_input("x", ir::DType::f32, ir::Shape::of(x.dims()));
    ir::Value* dyv = g.add_input("dy", ir::DType::f32, ir::Shape::of(dy.dims()));
    pool = g.add_node("MaxPool", "pool", {xv}, {"y"}, a);
    grad = g.add_node("MaxPoolGrad", "pool_grad", {dyv, xv}, {"dx"}, a);
    std::mt19937 r(1);
    std::normal_distribution<float> d;
    for (int64_t i = 0; i < x.numel(); ++i) x.set_f64(i, d(r));
    for (int64_t i = 0; i < dy.numel(); ++i) dy.set_f64(i, d(r));
  }
};

void BM_MaxPoolStem(benchmark::State& st) {
  PoolCase c(st.range(0));
  for (auto _ : st) {
    auto y = runtime::run_node(*c.pool, {&c.x});
    if (!y) st.SkipWithError(y.message().c_str());
    benchmark::DoNotOptimize(y);
  }
}

void BM_MaxPoolGradStem(benchmark::State& st) {
  PoolCase c(st.range(0));
  for (auto _ : st) {
    auto dx = runtime::run_node(*c.grad, {&c.dy, &c.x});
    if (!dx) st.SkipWithError(dx.message().c_str());
    benchmark::DoNotOptimize(dx);
  }
}

}  // namespace

BENCHMARK(BM_MaxPoolStem)->Arg(4)->Arg(32)->Unit(benchmark::kMicrosecond)->UseRealTime();
BENCHMARK(BM_MaxPoolGradStem)->Arg(4)->Arg(32)->Unit(benchmark::kMicrosecond)->UseRealTime();
