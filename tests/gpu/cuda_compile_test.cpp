// CUDA emitter + NVRTC tests that need no GPU: the whole kernel corpus (tests/gpu/gpu_cases.h)
// is rendered as CUDA C++ and compiled for sm_80 and sm_90; ptxas must report no spills and
// no local memory for any kernel. Also launch-geometry choices, error paths and the ptxas
// log parser.
#include <gtest/gtest.h>

#include <set>

#include "codegen/cuda/cuda_emitter.h"
#include "codegen/cuda/nvrtc.h"
#include "runtime/cuda/cuda_device.h"
#include "tests/gpu/gpu_cases.h"

namespace kiln::gputest {
namespace {

using codegen::CudaKernelInfo;
using codegen::CudaModuleSource;

std::vector<Kernel> corpus_kernels() {
  std::vector<Kernel> ks;
  for (Case& c : all_cases()) ks.push_back(c.k);
  return ks;
}

const CudaModuleSource& corpus_source() {
  static CudaModuleSource src = [] {
    auto r = codegen::emit_cuda(corpus_kernels());
    EXPECT_TRUE(r.has_value()) << (r ? "" : r.message());
    return r ? *r : CudaModuleSource{};
  }();
  return src;
}

const CudaKernelInfo* info_of(const std::string& name) {
  for (const CudaKernelInfo& i : corpus_source().kernels)
    if (i.name == name) return &i;
  return nullptr;
}

TEST(CudaEmit, EmitsEveryCorpusKernel) {
  const CudaModuleSource& src = corpus_source();
  const auto ks = corpus_kernels();
  ASSERT_EQ(src.kernels.size(), ks.size());
  for (size_t i = 0; i < ks.size(); ++i) {
    EXPECT_EQ(src.kernels[i].name, ks[i].name);
    EXPECT_NE(src.source.find("extern \"C\" __global__ void __launch_bounds__(256) " + ks[i].name + "("),
              std::string::npos)
        << ks[i].name;
    EXPECT_EQ(src.kernels[i].num_params, static_cast<int>(ks[i].params.size()));
  }
  EXPECT_NE(src.source.find("#include <cuda_bf16.h>"), std::string::npos);
  EXPECT_NE(src.source.find("__float2bfloat16_rn"), std::string::npos);
  EXPECT_NE(src.source.find("__float2half_rn"), std::string::npos);
}

TEST(CudaEmit, SchedulesAndLaunchInfo) {
  struct Want {
    const char* name;
    const char* schedule;
  };
  const Want wants[] = {{"f32_binary_1000003", "pointwise"},
                        {"row_reduce_1000x257", "row_warp"},
                        {"row_reduce_3x1000003", "row_block"},
                        {"all_reduce_1000003", "row_block"},
                        {"row_reduce_7x7", "column"},
                        {"col_reduce_513x1000", "column_atomic"},
                        {"col_max_40x20000", "column_atomic"},
                        {"int_bf16_reduce_4099x33", "column"},
                        {"mid_reduce_17x1001x33", "column_atomic"},
                        {"col_f64_1000x300", "column_atomic"}};
  for (const Want& w : wants) {
    const CudaKernelInfo* i = info_of(w.name);
    ASSERT_NE(i, nullptr) << w.name;
    EXPECT_EQ(i->schedule, w.schedule) << w.name;
    EXPECT_EQ(i->block[0], 256u);
    EXPECT_GE(i->grid[0], 1u);
  }
  // Pointwise: one thread per point up to the grid cap.
  EXPECT_EQ(info_of("f32_binary_1000003")->grid[0], (1000003u + 255) / 256);
  EXPECT_EQ(info_of("f32_binary_7")->grid[0], 1u);
  // Atomic column sums zero their outputs (params 1 and 2, 1000 floats each) first.
  const CudaKernelInfo* cs = info_of("col_reduce_513x1000");
  EXPECT_EQ(cs->zero_init_params, (std::vector<int>{1, 2}));
  ASSERT_EQ(cs->inits.size(), 2u);
  EXPECT_EQ(cs->inits[0].bytes, 4000);
  EXPECT_EQ(cs->inits[0].fill32, 0u);
  EXPECT_GT(cs->grid[1], 1u);
  // Atomic column max fills with -inf; nothing is zeroed.
  const CudaKernelInfo* cm = info_of("col_max_40x20000");
  EXPECT_TRUE(cm->zero_init_params.empty());
  ASSERT_EQ(cm->inits.size(), 2u);
  EXPECT_EQ(cm->inits[1].fill32, 0xff800000u);
  EXPECT_EQ(cm->inits[1].bytes, 80000);
  // Non-atomic schedules need no fills.
  EXPECT_TRUE(info_of("int_bf16_reduce_4099x33")->inits.empty());
  EXPECT_TRUE(info_of("row_reduce_3x1000003")->inits.empty());
  // Buffer extents: the strided output of transposed_129x37 reaches 1 + 128*75 + 36*2 + 1 floats.
  const CudaKernelInfo* tr = info_of("transposed_129x37");
  ASSERT_EQ(tr->param_bytes.size(), 4u);
  EXPECT_EQ(tr->param_bytes[2], (1 + 128 * 75 + 36 * 2 + 1) * 4);
}

TEST(CudaEmit, Errors) {
  KB b("bad name", {4});
  b.out("y", b.load(b.in("x", DType::f32)));
  auto r = codegen::emit_cuda({b.c.k});
  ASSERT_FALSE(r.has_value());
  EXPECT_NE(r.message().find("not a C identifier"), std::string::npos) << r.message();

  KB ok("dup", {4});
  ok.out("y", ok.load(ok.in("x", DType::f32)));
  r = codegen::emit_cuda({ok.c.k, ok.c.k});
  ASSERT_FALSE(r.has_value());
  EXPECT_NE(r.message().find("duplicate kernel name 'dup'"), std::string::npos) << r.message();

  KB v("unverified", {4});
  const int x = v.in("x", DType::f32);
  v.c.k.stores.push_back({x, v.load(x), ReduceKind::none});  // store to an input param
  r = codegen::emit_cuda({v.c.k});
  ASSERT_FALSE(r.has_value());
  EXPECT_NE(r.message().find("unverified"), std::string::npos) << r.message();
}

TEST(CudaNvrtc, FindsHeadersAndVersion) {
  EXPECT_FALSE(codegen::cuda_include_dir().empty());
  EXPECT_NE(codegen::nvrtc_version(), "unknown");
}

// Both architectures, the whole corpus: compiles, and ptxas reports no spills / local memory.
TEST(CudaNvrtc, CorpusCompilesWithoutSpills) {
  const CudaModuleSource& src = corpus_source();
  ASSERT_FALSE(src.source.empty());
  for (const char* arch : {"sm_80", "sm_90"}) {
    auto info = codegen::ptxas_info(src.source, "gpu_corpus", arch);
    ASSERT_TRUE(info.has_value()) << info.message();
    std::set<std::string> seen;
    for (const codegen::PtxasKernelInfo& k : *info) {
      seen.insert(k.kernel);
      EXPECT_EQ(k.arch, arch);
      EXPECT_GT(k.registers, 0) << k.kernel;
      EXPECT_LE(k.registers, 255) << k.kernel;
      EXPECT_EQ(k.spill_store_bytes, 0) << k.kernel << " " << arch;
      EXPECT_EQ(k.spill_load_bytes, 0) << k.kernel << " " << arch;
      EXPECT_EQ(k.local_memory_bytes, 0) << k.kernel << " " << arch;
    }
    for (const CudaKernelInfo& i : src.kernels) EXPECT_TRUE(seen.count(i.name)) << i.name << " missing for " << arch;
  }
}

TEST(CudaNvrtc, PtxAndCubinImages) {
  KB b("tiny_add", {7});
  b.out("y", b.op(ScalarOp::add, {b.load(b.in("x", DType::f32)), b.cst(1, DType::f32)}, DType::f32));
  auto src = codegen::emit_cuda({b.c.k});
  ASSERT_TRUE(src.has_value()) << src.message();
  codegen::NvrtcOptions o;
  o.arch = "sm_80";
  o.cubin = false;
  auto ptx = codegen::nvrtc_compile(src->source, "tiny", o);
  ASSERT_TRUE(ptx.has_value()) << ptx.message();
  const std::string text(ptx->image.data());
  EXPECT_NE(text.find(".entry tiny_add"), std::string::npos);
  EXPECT_NE(text.find(".target sm_80"), std::string::npos);
  o.cubin = true;
  o.arch = "sm_90";
  auto cubin = codegen::nvrtc_compile(src->source, "tiny", o);
  ASSERT_TRUE(cubin.has_value()) << cubin.message();
  ASSERT_GT(cubin->image.size(), 4u);
  EXPECT_EQ(std::string(cubin->image.data() + 1, 3), "ELF");
}

TEST(CudaNvrtc, ErrorNamesProgramAndArch) {
  codegen::NvrtcOptions o;
  o.arch = "sm_90";
  auto r = codegen::nvrtc_compile("extern \"C\" __global__ void k() { undeclared_thing(); }", "broken_prog", o);
  ASSERT_FALSE(r.has_value());
  EXPECT_NE(r.message().find("broken_prog"), std::string::npos) << r.message();
  EXPECT_NE(r.message().find("sm_90"), std::string::npos) << r.message();
  EXPECT_NE(r.message().find("undeclared_thing"), std::string::npos) << r.message();
  EXPECT_EQ(r.message().find('\n'), std::string::npos) << "one line";
  o.arch = "90";
  r = codegen::nvrtc_compile("", "x", o);
  ASSERT_FALSE(r.has_value());
  EXPECT_NE(r.message().find("not of the form sm_XY"), std::string::npos);
}

TEST(CudaNvrtc, ParsesPtxasLog) {
  const std::string log =
      "ptxas info    : 0 bytes gmem\n"
      "ptxas info    : Compiling entry function 'a' for 'sm_90'\n"
      "ptxas info    : Function properties for a\n"
      "ptxas         .     8 bytes stack frame, 4 bytes spill stores, 12 bytes spill loads\n"
      "ptxas info    : Used 40 registers, 16 bytes lmem, 64 bytes smem, 380 bytes cmem[0]\n"
      "ptxas info    : Function properties for helper\n"
      "ptxas         .     99 bytes stack frame, 99 bytes spill stores, 99 bytes spill loads\n"
      "ptxas info    : Compiling entry function 'b' for 'sm_90'\n"
      "ptxas info    : Function properties for b\n"
      "ptxas         .     0 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads\n"
      "ptxas info    : Used 14 registers, used 0 barriers\n";
  auto v = codegen::parse_ptxas_log(log);
  ASSERT_EQ(v.size(), 2u);
  EXPECT_EQ(v[0].kernel, "a");
  EXPECT_EQ(v[0].arch, "sm_90");
  EXPECT_EQ(v[0].registers, 40);
  EXPECT_EQ(v[0].stack_frame_bytes, 8);
  EXPECT_EQ(v[0].spill_store_bytes, 4);
  EXPECT_EQ(v[0].spill_load_bytes, 12);
  EXPECT_EQ(v[0].local_memory_bytes, 16);
  EXPECT_EQ(v[0].shared_memory_bytes, 64);
  EXPECT_EQ(v[1].kernel, "b");
  EXPECT_EQ(v[1].registers, 14);
  EXPECT_EQ(v[1].spill_store_bytes, 0);
}

// Without a driver or device the layer answers with one "no CUDA device:" line; with one it opens.
TEST(CudaDeviceLayer, OpensOrSaysNoDevice) {
  auto d = runtime::CudaDevice::open(0);
  if (d.has_value()) {
    EXPECT_FALSE((*d)->name().empty());
    EXPECT_GE((*d)->compute_capability(), 50);
  } else {
    EXPECT_EQ(d.message().rfind("no CUDA device: ", 0), 0u) << d.message();
    EXPECT_EQ(d.message().find('\n'), std::string::npos);
  }
  auto bad = runtime::CudaDevice::open(1 << 20);
  ASSERT_FALSE(bad.has_value());
  EXPECT_EQ(bad.message().rfind("no CUDA device: ", 0), 0u) << bad.message();
}

}  // namespace
}  // namespace kiln::gputest
