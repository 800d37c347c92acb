// CUDA rendering of real training programs (issue 9, acceptance point 1; needs no GPU):
// for every example model and a matrix of training configurations (fp32/bf16, every remat
// policy, gradient accumulation 1/2, adamw_torch/adamw_8bit/sgd), the compiled training
// program is built (driver::build_training_program with backend "compiled"), every
// FusedKernel node of train_step and eval (loop bodies included) is lowered to kernel IR,
// all of them are rendered by emit_cuda as ONE translation unit per program, and that unit
// is compiled by NVRTC for sm_80 and sm_90. ptxas' verbose report must name every kernel,
// and the pointwise and row-reduction kernels of the GPT programs must not spill (0 spill
// store/load bytes); local memory and registers are reported for every program.
// CudaRenderRow: hand-made row programs (kernel IR reduce expressions: Softmax, LayerNorm
// with row stores, SoftmaxGrad-like mixed stores; builders as in llvm_cpu_test.cpp) get
// the expected schedule (row_warp / row_block when the reduced dims are innermost after
// collapse_dims, else one thread per row, "column"), passes in the order of
// evaluate_reference, and compile with NVRTC for sm_80 and sm_90 with no spills. Their
// numeric check against evaluate_reference runs on a GPU (tests/gpu/cuda_row_test.cpp).
// Without the CUDA toolkit (no kiln_codegen_cuda, KILN_HAVE_CUDA undefined) the suite is
// one test that skips with a message.
#include <gtest/gtest.h>

#ifdef KILN_HAVE_CUDA
#include <algorithm>
#include <cctype>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <future>
#include <map>
#include <set>
#include <string>
#include <vector>

#include "codegen/cpu/program.h"
#include "codegen/cuda/cuda_emitter.h"
#include "codegen/cuda/nvrtc.h"
#include "codegen/lower.h"
#include "kernel_builder.h"
#include "tools/driver/driver.h"
#endif

namespace {

#ifndef KILN_HAVE_CUDA

TEST(CudaRender, NeedsCudaToolkit) {
  GTEST_SKIP() << "CudaRender cannot run: kiln was built without the CUDA toolkit (no kiln_codegen_cuda, "
                  "KILN_HAVE_CUDA undefined), so there is no CUDA emitter or NVRTC to test";
}

#else

using namespace kiln;

/// One training configuration of one example model.
struct Prog {
  std::string model;
  std::string precision = "fp32";  // fp32 | bf16
  std::string optim = "adamw_torch";
  std::string remat = "none";
  int64_t accum = 1;
  std::string budget;  // --memory_budget for remat "budget"
};

std::string prog_name(const Prog& p) {
  std::string n =
      p.model + "_" + p.precision + "_" + p.optim + "_remat_" + p.remat + "_accum" + std::to_string(p.accum);
  for (char& c : n)
    if (!std::isalnum(static_cast<unsigned char>(c))) c = '_';
  return n;
}
/// gtest prints parameters with this (stable ctest names and readable failures).
void PrintTo(const Prog& p, std::ostream* os) { *os << prog_name(p); }

constexpr int64_t kBatch = 4;

runtime::TrainConfig config_of(const Prog& p) {
  runtime::TrainConfig cfg;
  cfg.model = std::string(KILN_SOURCE_DIR) + "/examples/" + p.model + "/model.onnx";
  cfg.loss = "cross_entropy";
  cfg.per_device_train_batch_size = kBatch;
  cfg.per_device_eval_batch_size = kBatch;
  cfg.gradient_accumulation_steps = p.accum;
  cfg.optim = p.optim;
  cfg.learning_rate = p.optim == "sgd" ? 0.05 : 1e-3;
  cfg.weight_decay = 0.01;
  cfg.max_grad_norm = 1.0;
  cfg.bf16 = p.precision == "bf16";
  cfg.remat_policy = p.remat;
  cfg.memory_budget = p.budget;
  cfg.backend = "compiled";
  cfg.max_steps = 10;
  return cfg;
}

/// Lowers every FusedKernel node of `g`; kernel names get `prefix` so that train_step and
/// eval kernels can share one translation unit.
void lower_graph(const ir::Graph& g, const std::string& prefix, std::vector<codegen::Kernel>& out, int& count) {
  std::set<std::string> names;
  count = 0;
  for (const ir::Node* n : codegen::fused_nodes(g)) {
    auto k = codegen::lower_fused(*n);
    ASSERT_TRUE(k.has_value()) << prefix << ": " << k.message();
    EXPECT_TRUE(names.insert(k->name).second) << prefix << ": two fused nodes lower to kernel name " << k->name;
    k->name = prefix + k->name;
    out.push_back(std::move(*k));
    ++count;
  }
}

bool is_row_or_pointwise(const std::string& schedule) {
  return schedule == "pointwise" || schedule == "row_warp" || schedule == "row_block";
}

class CudaRenderPrograms : public ::testing::TestWithParam<Prog> {};

TEST_P(CudaRenderPrograms, EveryKernelCompilesForSm80AndSm90) {
  const Prog& p = GetParam();
  ASSERT_FALSE(codegen::cuda_include_dir().empty()) << "CUDA headers (cuda_bf16.h) not found for NVRTC";
  const auto t0 = std::chrono::steady_clock::now();
  auto prog = driver::build_training_program(config_of(p));
  ASSERT_TRUE(prog.has_value()) << prog.message();
  ASSERT_TRUE(prog->train_step && prog->eval);
  const double build_s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();

  std::vector<codegen::Kernel> kernels;
  int n_train = 0, n_eval = 0;
  lower_graph(*prog->train_step, "t_", kernels, n_train);
  lower_graph(*prog->eval, "e_", kernels, n_eval);
  if (HasFatalFailure()) return;
  EXPECT_GT(n_train, 0) << "train_step has no FusedKernel node";
  EXPECT_GT(n_eval, 0) << "eval has no FusedKernel node";
  // The CPU programs were built from the same nodes: same kernel counts.
  ASSERT_NE(prog->train_kernels, nullptr);
  ASSERT_NE(prog->eval_kernels, nullptr);
  EXPECT_EQ(prog->train_kernels->kernels.size(), static_cast<size_t>(n_train));
  EXPECT_EQ(prog->eval_kernels->kernels.size(), static_cast<size_t>(n_eval));

  auto src = codegen::emit_cuda(kernels);
  ASSERT_TRUE(src.has_value()) << src.message();
  ASSERT_EQ(src->kernels.size(), kernels.size());
  // KILN_CUDA_RENDER_DUMP=<dir>: keep each program's translation unit for inspection.
  if (const char* dir = std::getenv("KILN_CUDA_RENDER_DUMP")) {
    std::ofstream(std::string(dir) + "/" + prog_name(p) + ".cu") << src->source;
  }
  std::map<std::string, std::string> schedule;
  std::map<std::string, int> by_schedule;
  for (const codegen::CudaKernelInfo& i : src->kernels) {
    schedule[i.name] = i.schedule;
    ++by_schedule[i.schedule];
  }

  // Both architectures at once (two cores): each compile is also ptxas' resource report.
  const std::string name = prog_name(p);
  auto compile = [&](const std::string& arch) {
    const auto c0 = std::chrono::steady_clock::now();
    auto r = codegen::ptxas_info(src->source, name, arch);
    const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - c0).count();
    return std::make_pair(std::move(r), s);
  };
  auto f80 = std::async(std::launch::async, compile, std::string("sm_80"));
  auto r90 = compile("sm_90");
  auto r80 = f80.get();

  const bool gpt = p.model == "tiny_gpt";
  std::string report;
  for (auto* r : {&r80, &r90}) {
    auto& [info, secs] = *r;
    const std::string arch = r == &r80 ? "sm_80" : "sm_90";
    ASSERT_TRUE(info.has_value()) << info.message();
    std::set<std::string> seen;
    int spilling = 0, spilling_checked = 0, max_regs = 0;
    int64_t max_lmem = 0, max_stack = 0;
    for (const codegen::PtxasKernelInfo& k : *info) {
      seen.insert(k.kernel);
      EXPECT_GT(k.registers, 0) << k.kernel << " " << arch;
      const bool spills = k.spill_store_bytes > 0 || k.spill_load_bytes > 0;
      spilling += spills;
      max_regs = std::max(max_regs, k.registers);
      max_lmem = std::max(max_lmem, k.local_memory_bytes);
      max_stack = std::max(max_stack, k.stack_frame_bytes);
      auto it = schedule.find(k.kernel);
      if (gpt && it != schedule.end() && is_row_or_pointwise(it->second)) {
        spilling_checked += spills;
        EXPECT_EQ(k.spill_store_bytes, 0) << k.kernel << " (" << it->second << ") " << arch;
        EXPECT_EQ(k.spill_load_bytes, 0) << k.kernel << " (" << it->second << ") " << arch;
      }
      if (spills || k.local_memory_bytes > 0)
        std::printf("    %s %s (%s): %d regs, %lld B stack, %lld B spill st, %lld B spill ld, %lld B lmem\n",
                    arch.c_str(), k.kernel.c_str(), it == schedule.end() ? "?" : it->second.c_str(), k.registers,
                    static_cast<long long>(k.stack_frame_bytes), static_cast<long long>(k.spill_store_bytes),
                    static_cast<long long>(k.spill_load_bytes), static_cast<long long>(k.local_memory_bytes));
    }
    for (const codegen::CudaKernelInfo& i : src->kernels)
      EXPECT_TRUE(seen.count(i.name)) << i.name << " missing from ptxas' report for " << arch;
    char line[256];
    std::snprintf(line, sizeof line,
                  " | %s %.2f s, max %d regs, %d spilling kernels%s, max lmem %lld B, max stack %lld B", arch.c_str(),
                  secs, max_regs, spilling, gpt ? (spilling_checked ? " (CHECKED ONES SPILL)" : "") : "",
                  static_cast<long long>(max_lmem), static_cast<long long>(max_stack));
    report += line;
  }
  std::string scheds;
  for (auto& [s, n] : by_schedule) scheds += (scheds.empty() ? "" : " ") + s + "=" + std::to_string(n);
  std::printf("[cuda_render] %s: %zu kernels (train %d + eval %d; %s), %zu KiB source, build %.2f s%s\n", name.c_str(),
              kernels.size(), n_train, n_eval, scheds.c_str(), src->source.size() / 1024, build_s, report.c_str());
  std::fflush(stdout);
}

/// Every value of every axis on every model at least once (tiny_gpt: all of them in five
/// programs, the fewest that cover the five remat policies).
/// Budgets (batch 4, `kiln inspect --memory`): tiny_gpt bf16 sgd peaks at 3.53 MB and
/// reaches 2.76 MB by recomputation, cnn_bn fp32 sgd 116 KB / 100 KB, resnet18 fp32 sgd
/// accum 2 2.44 MB / 1.77 MB, so those budgets force recomputation. mlp_digits cannot
/// lower its peak by recomputation (172 KB planned, 205 KB at best with remat): its budget
/// is one that fits without it. resnet18 (the slowest to compile) gets bf16 and accum 2
/// once each.
std::vector<Prog> programs() {
  std::vector<Prog> v;
  v.push_back({"tiny_gpt", "bf16", "adamw_torch", "none", 1, ""});
  v.push_back({"tiny_gpt", "fp32", "sgd", "blocks", 2, ""});
  v.push_back({"tiny_gpt", "fp32", "adamw_8bit", "sqrt", 1, ""});
  v.push_back({"tiny_gpt", "bf16", "adamw_8bit", "min-cut", 2, ""});
  v.push_back({"tiny_gpt", "bf16", "sgd", "budget", 1, "3MB"});
  for (const char* m : {"mlp_digits", "cnn_bn"}) {
    v.push_back({m, "fp32", "adamw_torch", "none", 1, ""});
    v.push_back({m, "bf16", "sgd", "blocks", 2, ""});
    v.push_back({m, "fp32", "adamw_8bit", "sqrt", 1, ""});
    v.push_back({m, "bf16", "adamw_torch", "min-cut", 2, ""});
    v.push_back({m, "fp32", "sgd", "budget", 1, std::string(m) == "cnn_bn" ? "105KB" : "1MB"});
  }
  v.push_back({"resnet18", "fp32", "adamw_torch", "none", 1, ""});
  v.push_back({"resnet18", "bf16", "sgd", "blocks", 1, ""});
  v.push_back({"resnet18", "fp32", "adamw_8bit", "sqrt", 1, ""});
  v.push_back({"resnet18", "fp32", "adamw_torch", "min-cut", 1, ""});
  v.push_back({"resnet18", "fp32", "sgd", "budget", 2, "2MB"});
  return v;
}

INSTANTIATE_TEST_SUITE_P(CudaRender, CudaRenderPrograms, ::testing::ValuesIn(programs()),
                         [](const ::testing::TestParamInfo<Prog>& i) { return prog_name(i.param); });

// ---- Row programs (reduce expressions) --------------------------------------------

using codegen::Kernel;
using codegen::ReduceKind;
using codegen::testing::KB;
using codegen::testing::row_layernorm_kernel;
using codegen::testing::row_softmax_kernel;
using ir::DType;
using ir::ScalarOp;

/// SoftmaxGrad-like mixed stores over [a, b], reduced dim `rd`: reduce expression
/// s = sum(dy * y), point store dx = y * (dy - s), reduction store rowsum = sum(dy * y),
/// row store rowmax = max(dy).
Kernel mixed_kernel(const std::string& name, int64_t a, int64_t bb, int rd) {
  const DType f = DType::f32;
  KB b(name, {a, bb}, {rd == 0, rd == 1});
  const std::vector<int64_t> kept = rd == 0 ? std::vector<int64_t>{0, 1} : std::vector<int64_t>{1, 0};
  int y = b.load(b.param("y", f, {bb, 1}));
  int dy = b.load(b.param("dy", f, {bb, 1}));
  int s = b.k.add_reduce(ReduceKind::sum, b.op(ScalarOp::mul, {dy, y}, f));
  b.out("dx", b.op(ScalarOp::mul, {y, b.op(ScalarOp::sub, {dy, s}, f)}, f), {bb, 1});
  b.out("rowsum", b.op(ScalarOp::mul, {dy, y}, f), kept, ReduceKind::sum);
  b.out("rowmax", b.k.add_reduce(ReduceKind::max, dy), kept);
  return b.k;
}

struct RowWant {
  Kernel k;
  const char* schedule;
  unsigned grid;
};

std::vector<RowWant> row_kernels() {
  std::vector<RowWant> v;
  v.push_back({row_softmax_kernel("softmax_f32", 37, 129, DType::f32), "row_warp", 5});
  v.push_back({row_softmax_kernel("softmax_bf16", 5, 64, DType::bf16), "row_warp", 1});
  v.push_back({row_softmax_kernel("softmax_f64", 4, 33, DType::f64), "row_warp", 1});
  v.push_back({row_softmax_kernel("softmax_long", 3, 5000, DType::f32), "row_block", 3});
  v.push_back({row_softmax_kernel("softmax_short", 300, 7, DType::f32), "column", 2});
  v.push_back({row_layernorm_kernel("layernorm", 9, 256), "row_warp", 2});
  v.push_back({row_layernorm_kernel("layernorm_long", 2, 8192), "row_block", 2});
  v.push_back({mixed_kernel("mixed_outer", 24, 10, 0), "column", 1});
  v.push_back({mixed_kernel("mixed_inner", 10, 300, 1), "row_warp", 2});
  {  // a bf16 reduce expression (rounded to bf16 before use): y = x - sum(x)
    KB b("bf16_center", {6, 64}, {false, true});
    int x = b.load(b.param("x", DType::bf16, {64, 1}));
    b.out("y", b.op(ScalarOp::sub, {x, b.k.add_reduce(ReduceKind::sum, x)}, DType::bf16), {64, 1});
    v.push_back({b.k, "row_warp", 1});
  }
  {  // [4, 6, 64] reduced innermost: collapses to 24 rows of 64.
    KB b("softmax_3d", {4, 6, 64}, {false, false, true});
    int x = b.load(b.param("x", DType::f32, {384, 64, 1}));
    int e = b.op(ScalarOp::exp, {b.op(ScalarOp::sub, {x, b.k.add_reduce(ReduceKind::max, x)}, DType::f32)}, DType::f32);
    b.out("y", b.op(ScalarOp::div, {e, b.k.add_reduce(ReduceKind::sum, e)}, DType::f32), {384, 64, 1});
    v.push_back({b.k, "row_warp", 3});
  }
  return v;
}

TEST(CudaRenderRow, SchedulesAndPasses) {
  const std::vector<RowWant> want = row_kernels();
  std::vector<Kernel> ks;
  for (const RowWant& w : want) {
    ASSERT_TRUE(w.k.is_row_program()) << w.k.name;
    ASSERT_TRUE(w.k.verify().is_ok()) << w.k.verify().message();
    ks.push_back(w.k);
  }
  auto src = codegen::emit_cuda(ks);
  ASSERT_TRUE(src.has_value()) << src.message();
  ASSERT_EQ(src->kernels.size(), want.size());
  for (size_t i = 0; i < want.size(); ++i) {
    const codegen::CudaKernelInfo& info = src->kernels[i];
    EXPECT_EQ(info.schedule, want[i].schedule) << info.name;
    EXPECT_EQ(info.grid[0], want[i].grid) << info.name;
    EXPECT_EQ(info.block[0], 256u) << info.name;
    EXPECT_TRUE(info.inits.empty()) << info.name;
  }
  auto body = [&](const std::string& name) {
    const size_t at = src->source.find(" " + name + "(\n");
    EXPECT_NE(at, std::string::npos) << name;
    return at == std::string::npos ? std::string() : src->source.substr(at, src->source.find("\n}\n", at) - at);
  };
  // Softmax: pass 1 max, pass 2 sum of exp (combined across the warp), pass 3 stores.
  const std::string sm = body("softmax_f32");
  const size_t p1 = sm.find("// pass 1 of 3"), p2 = sm.find("// pass 2 of 3"), p3 = sm.find("// pass 3 of 3");
  ASSERT_TRUE(p1 != std::string::npos && p2 != std::string::npos && p3 != std::string::npos) << sm;
  EXPECT_LT(p1, sm.find("kiln_warp_max(ra"));
  EXPECT_LT(sm.find("kiln_warp_max(ra"), p2);
  EXPECT_LT(p2, sm.find("kiln_warp_sum(ra"));
  EXPECT_LT(sm.find("kiln_warp_sum(ra"), p3);
  EXPECT_GT(sm.find("p1[o1] = "), p3) << "the point store belongs to the last pass";
  // bf16 reduce results are rounded to bf16 before use.
  EXPECT_NE(body("bf16_center").find("kiln_rbf((float)ra"), std::string::npos);
  // LayerNorm: Mean/InvStdDev row stores by lane 0; the block schedule folds shared slots.
  EXPECT_NE(body("layernorm").find("if (lane == 0) {"), std::string::npos);
  const std::string lb = body("layernorm_long");
  EXPECT_NE(lb.find("__syncthreads();"), std::string::npos);
  EXPECT_NE(lb.find("if (threadIdx.x == 0) {"), std::string::npos);
  // One thread per row: no shuffles.
  EXPECT_EQ(body("mixed_outer").find("kiln_warp_"), std::string::npos);
}

TEST(CudaRenderRow, CompilesForSm80AndSm90WithoutSpills) {
  ASSERT_FALSE(codegen::cuda_include_dir().empty()) << "CUDA headers (cuda_bf16.h) not found for NVRTC";
  std::vector<Kernel> ks;
  for (const RowWant& w : row_kernels()) ks.push_back(w.k);
  auto src = codegen::emit_cuda(ks);
  ASSERT_TRUE(src.has_value()) << src.message();
  for (const char* arch : {"sm_80", "sm_90"}) {
    auto info = codegen::ptxas_info(src->source, "row_programs", arch);
    ASSERT_TRUE(info.has_value()) << info.message();
    std::set<std::string> seen;
    for (const codegen::PtxasKernelInfo& k : *info) {
      seen.insert(k.kernel);
      EXPECT_EQ(k.spill_store_bytes, 0) << k.kernel << " " << arch;
      EXPECT_EQ(k.spill_load_bytes, 0) << k.kernel << " " << arch;
      EXPECT_EQ(k.local_memory_bytes, 0) << k.kernel << " " << arch;
    }
    for (const Kernel& k : ks) EXPECT_TRUE(seen.count(k.name)) << k.name << " missing for " << arch;
  }
}

#endif  // KILN_HAVE_CUDA

}  // namespace
