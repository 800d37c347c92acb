// Microbenchmarks (Google Benchmark) of the compiled CPU backend (issue 7):
//   Codegen/Copy*       copy bandwidth of this machine, measured by this binary: memcpy of a
//                       64 MiB f32 buffer, single-threaded and split into the OpenMP chunks
//                       the runtime uses; bytes counted read + write.
//   Codegen/Pointwise*  hand-built kernel IR compiled with codegen::compile_cpu: y = a*b + c*d
//                       (f32, 16M elements) and the AdamW update (p, g, m, v -> p', m', v').
//   Codegen/RowSum      sum over the last dim of (4096, 4096) f32 -> 4096.
//   Codegen/ColSum      bias-gradient column sum (8192, 256) f32 -> 256.
//   Codegen/Gelu        GPT-2's exact GELU (erf) over 8 x 256 x 1024 f32 elements.
//   Codegen/Exp{F32,F64} y = exp(x - 1) alone over 2 M f32 elements, in f32 and through f64
//                       (the row kernels' exp: a reference for Softmax and CrossEntropyGrad).
//   Codegen/Softmax     GPT-2's causal attention softmax row kernel over (8, 8, 256, 256)
//                       (half the scores masked to -inf, as in training); SoftmaxTiny: the
//                       tiny GPT's (8, 4, 64, 64).
//   Codegen/CrossEntropyGrad  the tiny GPT's cross-entropy gradient row kernel (512, 256),
//                       softmax in f64 (passes/decompose.cpp).
//   Codegen/Build*      driver::build_training_program with backend "compiled" (import, all
//                       passes, fusion, lowering, LLVM O3 + JIT) of the tiny GPT (batch 8) and
//                       of gpt_4l256 (build/examples/, tools/prepare_bench_models.sh; batch 8).
//
//   OMP_NUM_THREADS=2 build/bin/kiln_microbench --benchmark_filter=Codegen
//   (KILN_BENCH_DUMP_IR=DIR writes each kernel's optimized LLVM IR to DIR/NAME.ll)
//
// Generated kernels run over the whole domain with the split of run_fused_compiled
// (runtime/interpreter.cpp): min(extent, threads, work / 32768) chunks of the parallel dim,
// one omp parallel-for, static schedule. Buffers are allocated and first-touched once
// (the runtime allocates outputs per call; page faults are not measured here).
// Counters: bytes_per_second = bytes the kernel must move (each input read once, each output
// written once) / wall time; copy_ratio = that rate / the parallel-copy rate (1.0 = as fast
// as memcpy of the same bytes).
#include <benchmark/benchmark.h>
#include <omp.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <memory>
#include <string>
#include <vector>

#include "codegen/cpu/llvm_cpu.h"
#include "codegen/kernel_ir.h"
#include "runtime/interpreter.h"
#include "runtime/train_config.h"
#include "tools/driver/driver.h"

using namespace kiln;
using codegen::Kernel;
using codegen::KernelParam;
using codegen::KExpr;
using codegen::ReduceKind;
using ir::DType;
using ir::ScalarOp;

namespace {

using Clock = std::chrono::steady_clock;

/// 64-byte aligned buffer of `elems` elements of `dtype`, first-touched by the omp threads
/// in static chunks: f32/f64 v + 1e-3 (i % 1000), i64 i % 256 (class ids), others zero.
struct Buf {
  void* p = nullptr;
  int64_t n = 0;
  Buf(int64_t elems, DType dtype, float v) : n(elems) {
    const int64_t width = static_cast<int64_t>(ir::dtype_size(dtype));
    p = std::aligned_alloc(64, ((elems * width + 63) / 64) * 64);
    auto* f32 = static_cast<float*>(p);
    auto* f64 = static_cast<double*>(p);
    auto* i64 = static_cast<int64_t*>(p);
    if (dtype != DType::f32 && dtype != DType::f64 && dtype != DType::i64) {
      std::memset(p, 0, static_cast<size_t>(elems * width));  // bools false, other dtypes zero
      return;
    }
#pragma omp parallel for schedule(static)
    for (int64_t i = 0; i < elems; ++i) {
      const double x = v + 1e-3 * static_cast<double>(i % 1000);
      switch (dtype) {
        case DType::f32:
          f32[i] = static_cast<float>(x);
          break;
        case DType::f64:
          f64[i] = x;
          break;
        default:
          i64[i] = i % 256;
          break;
      }
    }
  }
  ~Buf() { std::free(p); }
  Buf(const Buf&) = delete;
  Buf& operator=(const Buf&) = delete;
};

/// memcpy of `bytes` split into `chunks` pieces over omp threads (1: plain memcpy).
void split_copy(char* dst, const char* src, int64_t bytes, int chunks) {
  if (chunks <= 1) {
    std::memcpy(dst, src, bytes);
    return;
  }
#pragma omp parallel for schedule(static)
  for (int c = 0; c < chunks; ++c) {
    const int64_t b = bytes * c / chunks, e = bytes * (c + 1) / chunks;
    std::memcpy(dst + b, src + b, e - b);
  }
}

constexpr int64_t kCopyElems = 16 * 1024 * 1024;  // 64 MiB of f32

/// Parallel copy bandwidth in bytes/s (read + write), best of 8, measured once.
double copy_bandwidth() {
  static double bw = [] {
    Buf a(kCopyElems, DType::f32, 1.f), b(kCopyElems, DType::f32, 1.f);
    double best = 0;
    for (int r = 0; r < 8; ++r) {
      const auto t0 = Clock::now();
      split_copy(reinterpret_cast<char*>(b.p), reinterpret_cast<const char*>(a.p), kCopyElems * 4,
                 omp_get_max_threads());
      const double s = std::chrono::duration<double>(Clock::now() - t0).count();
      best = std::max(best, 2.0 * kCopyElems * 4 / s);
    }
    return best;
  }();
  return bw;
}

void BM_CodegenCopy(benchmark::State& state) {
  const int chunks = state.range(0) == 0 ? 1 : omp_get_max_threads();
  Buf a(kCopyElems, DType::f32, 1.f), b(kCopyElems, DType::f32, 1.f);
  for (auto _ : state) {
    split_copy(reinterpret_cast<char*>(b.p), reinterpret_cast<const char*>(a.p), kCopyElems * 4, chunks);
    benchmark::DoNotOptimize(b.p);
    benchmark::ClobberMemory();
  }
  state.SetBytesProcessed(state.iterations() * 2 * kCopyElems * 4);
  state.counters["threads"] = chunks;
}

// ----------------------------------------------------------------------------- kernel IR
/// f32 shorthand over the kernel IR's own builders (Kernel::add_*).
struct KB {
  Kernel k;
  KB(std::string name, std::vector<int64_t> domain, std::vector<bool> reduced = {}) {
    k.name = std::move(name);
    k.domain.assign(domain.begin(), domain.end());
    k.reduced = std::move(reduced);
  }
  int param(const std::string& name, std::vector<int64_t> strides, bool out = false) {
    return k.add_param(name, DType::f32, {strides.begin(), strides.end()}, out);
  }
  int load(int p) { return k.add_load(p); }
  int cst(double v) { return k.add_constant(v, DType::f32); }
  int op(ScalarOp o, std::vector<int> args) { return k.add_op(o, std::move(args), DType::f32); }
  void store(int p, int e, ReduceKind r = ReduceKind::none) { k.add_store(p, e, r); }
};

constexpr int64_t kPointwiseElems = 16 * 1024 * 1024;

/// y = a*b + c*d over a 1-D domain of n elements.
Kernel axpby_kernel(int64_t n) {
  KB b("bench_mul_add", {n});
  int pa = b.param("a", {1}), pb = b.param("b", {1}), pc = b.param("c", {1}), pd = b.param("d", {1});
  int e = b.op(ScalarOp::add,
               {b.op(ScalarOp::mul, {b.load(pa), b.load(pb)}), b.op(ScalarOp::mul, {b.load(pc), b.load(pd)})});
  b.store(b.param("y", {1}, true), e);
  return b.k;
}

/// torch.optim.AdamW's update of one parameter (lr 1e-3, betas 0.9/0.999, eps 1e-8, wd 0.01,
/// bias corrections of step 10 folded into constants): params p, g, m, v in; p', m', v' out.
Kernel adamw_kernel(int64_t n) {
  KB b("bench_adamw", {n});
  const double lr = 1e-3, b1 = 0.9, b2 = 0.999, eps = 1e-8, wd = 0.01;
  const double bc1 = 1 - std::pow(b1, 10), bc2 = 1 - std::pow(b2, 10);
  int pp = b.param("p", {1}), pg = b.param("g", {1}), pm = b.param("m", {1}), pv = b.param("v", {1});
  int g = b.load(pg);
  int m = b.op(ScalarOp::add, {b.op(ScalarOp::mul, {b.cst(b1), b.load(pm)}), b.op(ScalarOp::mul, {b.cst(1 - b1), g})});
  int v = b.op(ScalarOp::add, {b.op(ScalarOp::mul, {b.cst(b2), b.load(pv)}),
                               b.op(ScalarOp::mul, {b.cst(1 - b2), b.op(ScalarOp::mul, {g, g})})});
  int denom =
      b.op(ScalarOp::add, {b.op(ScalarOp::mul, {b.op(ScalarOp::sqrt, {v}), b.cst(1 / std::sqrt(bc2))}), b.cst(eps)});
  int upd = b.op(ScalarOp::div, {b.op(ScalarOp::mul, {m, b.cst(lr / bc1)}), denom});
  int p = b.op(ScalarOp::sub, {b.op(ScalarOp::mul, {b.load(pp), b.cst(1 - lr * wd)}), upd});
  b.store(b.param("p_out", {1}, true), p);
  b.store(b.param("m_out", {1}, true), m);
  b.store(b.param("v_out", {1}, true), v);
  return b.k;
}

/// out[i] = sum_j x[i, j] over a (rows, cols) domain.
Kernel row_sum_kernel(int64_t rows, int64_t cols) {
  KB b("bench_row_sum", {rows, cols}, {false, true});
  int x = b.param("x", {cols, 1});
  b.store(b.param("out", {1, 0}, true), b.load(x), ReduceKind::sum);
  return b.k;
}

/// out[j] = sum_i x[i, j] over a (rows, cols) domain (bias gradient).
Kernel col_sum_kernel(int64_t rows, int64_t cols) {
  KB b("bench_col_sum", {rows, cols}, {true, false});
  int x = b.param("x", {cols, 1});
  b.store(b.param("out", {0, 1}, true), b.load(x), ReduceKind::sum);
  return b.k;
}

/// Causal attention softmax as the fusion pass builds it for GPT-2 (one row kernel):
/// y = Softmax(Where(mask, -inf, x * scale)) over the last dim of a (batch, heads, seq,
/// seq) domain; mask is a bool (seq, seq) broadcast over batch and heads; exp in f32, the
/// row sum in f64, the normalization (times 1 / sum) as an exact f32 x f64 product, as
/// Softmax's row rule writes it (mul_exact_f32 in ir/ops/nn.cpp).
Kernel attention_softmax_kernel(int64_t batch, int64_t heads, int64_t seq) {
  KB b("bench_softmax", {batch, heads, seq, seq}, {false, false, false, true});
  const std::vector<int64_t> dense = {heads * seq * seq, seq * seq, seq, 1};
  int x = b.load(b.param("x", dense));
  int mask = b.k.add_load(b.k.add_param("mask", DType::boolean, {0, 0, seq, 1}));
  int s = b.op(ScalarOp::select, {mask, b.cst(-INFINITY), b.op(ScalarOp::mul, {x, b.cst(0.125)})});
  int mx = b.k.add_reduce(ReduceKind::max, s);
  int e = b.op(ScalarOp::exp, {b.op(ScalarOp::sub, {s, mx})});
  const DType f64 = DType::f64;
  int sum = b.k.add_reduce(ReduceKind::sum, b.k.add_op(ScalarOp::cast, {e}, f64));
  int inv = b.k.add_op(ScalarOp::div, {b.k.add_constant(1.0, f64), sum}, f64);
  int hi = b.k.add_op(ScalarOp::cast, {inv}, DType::f32);
  int lo = b.k.add_op(ScalarOp::cast, {b.k.add_op(ScalarOp::sub, {inv, b.k.add_op(ScalarOp::cast, {hi}, f64)}, f64)},
                      DType::f32);
  b.store(b.param("y", dense, true), b.op(ScalarOp::fma, {e, hi, b.op(ScalarOp::mul, {e, lo})}));
  return b.k;
}

/// GPT-2's exact GELU as the fusion pass builds it from the exported graph (bias add
/// left out): y = x * (erf(x / sqrt 2) + 1) * 0.5 over n f32 elements.
Kernel gelu_kernel(int64_t n) {
  KB b("bench_gelu", {n});
  int x = b.load(b.param("x", {1}));
  int e = b.op(ScalarOp::erf, {b.op(ScalarOp::div, {x, b.cst(1.4142135381698608)})});
  b.store(b.param("y", {1}, true),
          b.op(ScalarOp::mul, {b.op(ScalarOp::mul, {x, b.op(ScalarOp::add, {e, b.cst(1.0)})}), b.cst(0.5)}));
  return b.k;
}

/// The exp the row kernels use, alone (a reference for them: no reduction, one pass):
/// y = exp(x) over n f32 elements, in f32 (expf_poly) or, `f64`, as Cast(Exp(Cast(x, f64)),
/// f32) (exp_poly_f64, the cross-entropy rule's exp).
Kernel exp_kernel(int64_t n, bool f64) {
  KB b(f64 ? "bench_exp_f64" : "bench_exp_f32", {n});
  int x = b.load(b.param("x", {1}));
  if (!f64) {
    b.store(b.param("y", {1}, true), b.op(ScalarOp::exp, {b.op(ScalarOp::sub, {x, b.cst(1.0)})}));
    return b.k;
  }
  int xd = b.k.add_op(ScalarOp::cast, {x}, DType::f64);
  int e = b.k.add_op(ScalarOp::exp, {b.k.add_op(ScalarOp::sub, {xd, b.k.add_constant(1.0, DType::f64)}, DType::f64)},
                     DType::f64);
  b.store(b.param("y", {1}, true), b.k.add_op(ScalarOp::cast, {e}, DType::f32));
  return b.k;
}

/// The cross-entropy gradient row kernel as passes/decompose.cpp and the fusion pass
/// build it for the tiny GPT (rows = batch * seq, cols = vocab): p = Softmax(Cast(x, f64))
/// with exp in f64, dx = Cast(p * coef - Where(class == label, coef, 0), f32).
Kernel cross_entropy_grad_kernel(int64_t rows, int64_t cols) {
  KB b("bench_ce_grad", {rows, cols}, {false, true});
  const DType f64 = DType::f64;
  int cls = b.k.add_load(b.k.add_param("classes", DType::i64, {0, 1}));
  int lab = b.k.add_load(b.k.add_param("labels", DType::i64, {1, 0}));
  int x = b.k.add_op(ScalarOp::cast, {b.load(b.param("x", {cols, 1}))}, f64);
  int coef = b.k.add_load(b.k.add_param("coef", f64, {1, 0}));
  int mx = b.k.add_reduce(ReduceKind::max, x);
  int e = b.k.add_op(ScalarOp::exp, {b.k.add_op(ScalarOp::sub, {x, mx}, f64)}, f64);
  int inv = b.k.add_op(ScalarOp::div, {b.k.add_constant(1.0, f64), b.k.add_reduce(ReduceKind::sum, e)}, f64);
  int p = b.k.add_op(ScalarOp::mul, {e, inv}, f64);
  int hit = b.k.add_op(ScalarOp::eq, {cls, lab}, DType::boolean);
  int onehot = b.k.add_op(ScalarOp::select, {hit, coef, b.k.add_constant(0.0, f64)}, f64);
  int dx = b.k.add_op(ScalarOp::sub, {b.k.add_op(ScalarOp::mul, {p, coef}, f64), onehot}, f64);
  b.store(b.param("dx", {cols, 1}, true), b.k.add_op(ScalarOp::cast, {dx}, DType::f32));
  return b.k;
}

/// Compiles `k` and runs it over its whole domain with the runtime's OpenMP split;
/// reports the bytes its parameters span (inputs read once, outputs written once).
void run_kernel(benchmark::State& state, const Kernel& k) {
  auto mod = codegen::compile_cpu({k});
  if (!mod) {
    state.SkipWithError(mod.message().c_str());
    return;
  }
  const codegen::CpuKernel& ck = (*mod)->kernels()[0];
  if (const char* dir = std::getenv("KILN_BENCH_DUMP_IR")) {  // optimized LLVM IR, for reading
    std::ofstream(std::string(dir) + "/" + k.name + ".ll") << (*mod)->llvm_ir();
  }
  std::vector<std::unique_ptr<Buf>> bufs;
  std::vector<void*> ptrs;
  int64_t bytes = 0;
  for (auto& p : k.params) {
    const int64_t n = codegen::param_elements(k, p);
    bufs.push_back(std::make_unique<Buf>(n, p.dtype, p.is_output ? 0.f : 0.5f));
    ptrs.push_back(bufs.back()->p);
    const int64_t width = static_cast<int64_t>(ir::dtype_size(p.dtype));
    if (p.dtype == DType::boolean) {
      auto* m = static_cast<uint8_t*>(bufs.back()->p);
      if (p.name == "mask" && k.domain.size() >= 2) {  // causal: key j > query i is masked (true)
        const int64_t seq = codegen::static_extent(k.domain.back());
        for (int64_t i = 0; i < seq; ++i)
          for (int64_t j = i + 1; j < seq; ++j) m[i * seq + j] = 1;
      }
    }
    bytes += n * width;
  }
  const double copy_bw = copy_bandwidth();
  // The split of run_fused_compiled (runtime/interpreter.cpp).
  const int64_t extent = ck.parallel_dim < 0 ? 1 : codegen::static_extent(ck.parallel_extent);
  const int64_t work = extent * std::max<int64_t>(1, codegen::static_extent(ck.work_per_index));
  const int threads = omp_get_max_threads();
  const int64_t chunks = std::min<int64_t>({extent, static_cast<int64_t>(threads), std::max<int64_t>(1, work / 32768)});
  std::vector<double> scratch(static_cast<size_t>((ck.scratch_bytes + 7) / 8));
  if (ck.scratch_bytes > 0) ptrs.push_back(scratch.data());
  void* const* args = ptrs.data();
  double seconds = 0;
  for (auto _ : state) {
    const auto t0 = Clock::now();
    if (chunks <= 1) {
      ck.fn(args, 0, extent);
    } else {
#pragma omp parallel for schedule(static)
      for (int64_t c = 0; c < chunks; ++c) ck.fn(args, c * extent / chunks, (c + 1) * extent / chunks);
    }
    codegen::combine_cpu_partitions(ck, args);  // as run_fused_compiled
    seconds += std::chrono::duration<double>(Clock::now() - t0).count();
    benchmark::ClobberMemory();
  }
  state.SetBytesProcessed(state.iterations() * bytes);
  const double rate = seconds > 0 ? static_cast<double>(bytes) * state.iterations() / seconds : 0;
  state.counters["copy_ratio"] = copy_bw > 0 ? rate / copy_bw : 0;
  state.counters["copy_GBps"] = copy_bw / 1e9;
  state.counters["chunks"] = static_cast<double>(chunks);
  state.counters["llvm_compile_s"] = (*mod)->stats().emit_s + (*mod)->stats().optimize_s + (*mod)->stats().codegen_s;
}

void BM_CodegenPointwiseMulAdd(benchmark::State& s) { run_kernel(s, axpby_kernel(kPointwiseElems)); }
void BM_CodegenPointwiseAdamW(benchmark::State& s) { run_kernel(s, adamw_kernel(kPointwiseElems)); }
void BM_CodegenRowSum(benchmark::State& s) { run_kernel(s, row_sum_kernel(4096, 4096)); }
void BM_CodegenColSum(benchmark::State& s) { run_kernel(s, col_sum_kernel(8192, 256)); }
void BM_CodegenGelu(benchmark::State& s) { run_kernel(s, gelu_kernel(8 * 256 * 1024)); }
void BM_CodegenExpF32(benchmark::State& s) { run_kernel(s, exp_kernel(8 * 256 * 1024, false)); }
void BM_CodegenExpF64(benchmark::State& s) { run_kernel(s, exp_kernel(8 * 256 * 1024, true)); }
void BM_CodegenSoftmax(benchmark::State& s) { run_kernel(s, attention_softmax_kernel(8, 8, 256)); }
void BM_CodegenSoftmaxTiny(benchmark::State& s) { run_kernel(s, attention_softmax_kernel(8, 4, 64)); }
void BM_CodegenCrossEntropyGrad(benchmark::State& s) { run_kernel(s, cross_entropy_grad_kernel(512, 256)); }

// ----------------------------------------------------------------------------- build time
/// Path of a repository file: as given when it exists from the working directory, else
/// relative to the source tree this file was compiled from.
std::string repo_path(const std::string& rel) {
  if (std::filesystem::exists(rel)) return rel;
  std::filesystem::path src(__FILE__);
  return (src.parent_path().parent_path() / rel).string();
}

void build_program(benchmark::State& state, const std::string& rel, int64_t batch) {
  runtime::register_eager_kernels();
  const std::string path = repo_path(rel);
  if (!std::filesystem::exists(path)) {
    const std::string msg = path + " not found (gpt_4l256: run tools/prepare_bench_models.sh)";
    state.SkipWithError(msg.c_str());
    return;
  }
  runtime::TrainConfig cfg;
  cfg.model = path;
  cfg.per_device_train_batch_size = batch;
  cfg.per_device_eval_batch_size = batch;
  cfg.backend = "compiled";
  cfg.learning_rate = 1e-3;
  cfg.weight_decay = 0.01;
  cfg.max_steps = 100;
  int kernels = 0;
  double llvm_s = 0;
  for (auto _ : state) {
    auto prog = driver::build_training_program(cfg);
    if (!prog) {
      state.SkipWithError(prog.message().c_str());
      return;
    }
    kernels = 0;
    llvm_s = 0;
    for (auto* p : {prog->train_kernels.get(), prog->eval_kernels.get()})
      if (p && p->module) {
        kernels += p->module->stats().num_kernels;
        llvm_s += p->lower_s + p->module->stats().emit_s + p->module->stats().optimize_s + p->module->stats().codegen_s;
      }
    benchmark::DoNotOptimize(prog);
  }
  state.counters["kernels"] = kernels;
  state.counters["lower_llvm_s"] = llvm_s;
}

void BM_CodegenBuildTinyGpt(benchmark::State& s) { build_program(s, "examples/tiny_gpt/model.onnx", 8); }
void BM_CodegenBuildGpt4l256(benchmark::State& s) { build_program(s, "build/examples/gpt_4l256/model.onnx", 8); }

}  // namespace

BENCHMARK(BM_CodegenCopy)->Arg(0)->Arg(1)->Unit(benchmark::kMillisecond)->UseRealTime();
BENCHMARK(BM_CodegenPointwiseMulAdd)->Unit(benchmark::kMillisecond)->UseRealTime();
BENCHMARK(BM_CodegenPointwiseAdamW)->Unit(benchmark::kMillisecond)->UseRealTime();
BENCHMARK(BM_CodegenRowSum)->Unit(benchmark::kMillisecond)->UseRealTime();
BENCHMARK(BM_CodegenColSum)->Unit(benchmark::kMillisecond)->UseRealTime();
BENCHMARK(BM_CodegenGelu)->Unit(benchmark::kMillisecond)->UseRealTime();
BENCHMARK(BM_CodegenExpF32)->Unit(benchmark::kMillisecond)->UseRealTime();
BENCHMARK(BM_CodegenExpF64)->Unit(benchmark::kMillisecond)->UseRealTime();
BENCHMARK(BM_CodegenSoftmax)->Unit(benchmark::kMillisecond)->UseRealTime();
BENCHMARK(BM_CodegenSoftmaxTiny)->Unit(benchmark::kMicrosecond)->UseRealTime();
BENCHMARK(BM_CodegenCrossEntropyGrad)->Unit(benchmark::kMillisecond)->UseRealTime();
BENCHMARK(BM_CodegenBuildTinyGpt)->Unit(benchmark::kSecond)->UseRealTime()->Iterations(3);
BENCHMARK(BM_CodegenBuildGpt4l256)->Unit(benchmark::kSecond)->UseRealTime()->Iterations(2);
