// CUDA row programs (kernel IR reduce expressions, Kernel::is_row_program): hand-made
// Softmax, LayerNormalization and mixed-store kernels in every row schedule (row_warp,
// row_block, and the one-thread-per-row `column` fallback for short rows and reduced outer
// dims), at f32, bf16 (bf16 reduce expressions too), f64 and i32.
//   CudaRowEmit.*   (no GPU needed): the schedule chosen per kernel; the translation unit
//                   compiles with NVRTC for sm_80 and sm_90 and ptxas reports no spill
//                   stores/loads and no local memory for any row kernel.
//   CudaRowDevice.* (GPU): each kernel runs on random inputs (plus one Softmax with NaN and
//                   +-inf inputs) and every output element is compared with
//                   codegen::evaluate_reference. Tolerances: f32 |gpu - ref| <= 1e-5 |ref|
//                   (+ a stated absolute term where an output is a difference that can cancel:
//                   LayerNorm's y, SoftmaxGrad's dx), since CUDA sums in f32 in tree order
//                   and the reference in double, and expf differs from glibc's by a few ulp;
//                   bf16 2e-2 relative (one or two bf16 ulp); f64 1e-12; integers exact;
//                   NaN where the reference has NaN. Outputs start filled with a sentinel on
//                   both sides, so writes outside the kernel's elements are caught.
// Without a CUDA device the device tests skip with one line (KILN_REQUIRE_GPU=1 makes that
// a failure, as in cuda_device_test.cpp).
#include <gtest/gtest.h>

#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <random>
#include <set>

#include "../codegen/kernel_builder.h"
#include "codegen/cuda/cuda_emitter.h"
#include "codegen/cuda/nvrtc.h"
#include "runtime/cuda/cuda_device.h"

namespace kiln::gputest {
namespace {

using codegen::Kernel;
using codegen::ReduceKind;
using codegen::testing::row_layernorm_kernel;
using codegen::testing::row_softmax_kernel;
using ir::DType;
using ir::ScalarOp;
using runtime::CudaDevice;
using runtime::CudaDevicePtr;

/// One row kernel, its expected schedule, input ranges and tolerances.
struct RowCase {
  Kernel k;
  std::string schedule;
  std::pair<double, double> range = {-2.5, 2.5};  ///< uniform input values (integers: in it)
  bool specials = false;                          ///< NaN / +-inf / +-0 among the inputs
  double rel = 1e-5, abs = 0;                     ///< float tolerance (bf16: rel 2e-2)
};

// ---- Builders (softmax and layer norm: tests/codegen/kernel_builder.h) ---------------------

/// SoftmaxGrad-like mixed stores over [outer, inner] with the reduced dim `reduced_dim`:
/// a reduce expression s = sum(dy * y), a point store dx = y * (dy - s), a reduction store
/// rowsum = sum(dy * y) and a row store of a reduce expression rowmax = max(dy).
Kernel mixed_kernel(const std::string& name, int64_t a, int64_t b, int reduced_dim) {
  const DType f = DType::f32;
  Kernel k;
  k.name = name;
  k.domain = {a, b};
  k.reduced = {reduced_dim == 0, reduced_dim == 1};
  const std::vector<codegen::Extent> dense = {b, 1};
  const std::vector<codegen::Extent> kept =
      reduced_dim == 0 ? std::vector<codegen::Extent>{0, 1} : std::vector<codegen::Extent>{1, 0};
  const int y = k.add_load(k.add_param("y", f, dense));
  const int dy = k.add_load(k.add_param("dy", f, dense));
  const int s = k.add_reduce(ReduceKind::sum, k.add_op(ScalarOp::mul, {dy, y}, f));
  k.add_store(k.add_param("dx", f, dense, true), k.add_op(ScalarOp::mul, {y, k.add_op(ScalarOp::sub, {dy, s}, f)}, f));
  k.add_store(k.add_param("rowsum", f, kept, true), k.add_op(ScalarOp::mul, {dy, y}, f), ReduceKind::sum);
  k.add_store(k.add_param("rowmax", f, kept, true), k.add_reduce(ReduceKind::max, dy));
  return k;
}

/// Integer row program over [rows, cols] (i32): c = x - max(x); out = c * sum(c) (wraps);
/// the row sum of c as a row store.
Kernel int_row_kernel(const std::string& name, int64_t rows, int64_t cols) {
  const DType t = DType::i32;
  Kernel k;
  k.name = name;
  k.domain = {rows, cols};
  k.reduced = {false, true};
  const int x = k.add_load(k.add_param("x", t, {cols, 1}));
  const int c = k.add_op(ScalarOp::sub, {x, k.add_reduce(ReduceKind::max, x)}, t);
  const int s = k.add_reduce(ReduceKind::sum, c);
  k.add_store(k.add_param("out", t, {cols, 1}, true), k.add_op(ScalarOp::mul, {c, s}, t));
  k.add_store(k.add_param("sum", t, {1, 0}, true), s);
  return k;
}

/// Reduce expressions in bf16 itself (rounded to bf16 before use): s = sum(x), m = max(x),
/// y = x - s (point store), s and m as row stores.
Kernel bf16_reduce_kernel(const std::string& name, int64_t rows, int64_t cols) {
  const DType t = DType::bf16;
  Kernel k;
  k.name = name;
  k.domain = {rows, cols};
  k.reduced = {false, true};
  const int x = k.add_load(k.add_param("x", t, {cols, 1}));
  const int s = k.add_reduce(ReduceKind::sum, x);
  k.add_store(k.add_param("y", t, {cols, 1}, true), k.add_op(ScalarOp::sub, {x, s}, t));
  k.add_store(k.add_param("sum", t, {1, 0}, true), s);
  k.add_store(k.add_param("max", t, {1, 0}, true), k.add_reduce(ReduceKind::max, x));
  return k;
}

std::vector<RowCase> row_cases() {
  std::vector<RowCase> v;
  v.push_back({row_softmax_kernel("softmax_f32_37x129", 37, 129, DType::f32), "row_warp"});
  v.push_back({row_softmax_kernel("softmax_bf16_5x64", 5, 64, DType::bf16), "row_warp", {-2.5, 2.5}, false, 2e-2});
  v.push_back({row_softmax_kernel("softmax_f64_4x33", 4, 33, DType::f64), "row_warp", {-2.5, 2.5}, false, 1e-12});
  v.push_back({row_softmax_kernel("softmax_f32_3x5000", 3, 5000, DType::f32), "row_block"});
  v.push_back({row_softmax_kernel("softmax_bf16_2x4099", 2, 4099, DType::bf16), "row_block", {-2.5, 2.5}, false, 2e-2});
  v.push_back({row_softmax_kernel("softmax_f32_300x7", 300, 7, DType::f32), "column"});
  v.push_back({row_softmax_kernel("softmax_f32_1x1", 1, 1, DType::f32), "column"});
  v.push_back({row_softmax_kernel("softmax_specials_40x50", 40, 50, DType::f32), "row_warp", {-2.5, 2.5}, true});
  // y = (x - mean) * rstd * scale + bias can cancel to ~0: 1e-5 absolute besides.
  v.push_back({row_layernorm_kernel("layernorm_f32_9x256", 9, 256), "row_warp", {-2.5, 2.5}, false, 1e-5, 1e-5});
  v.push_back({row_layernorm_kernel("layernorm_f32_4x8192", 4, 8192), "row_block", {-2.5, 2.5}, false, 1e-5, 1e-5});
  v.push_back({row_layernorm_kernel("layernorm_f32_5x20", 5, 20), "column", {-2.5, 2.5}, false, 1e-5, 1e-5});
  v.push_back(
      {row_layernorm_kernel("layernorm_bf16_6x300", 6, 300, DType::bf16), "row_warp", {-2.5, 2.5}, false, 2e-2, 2e-2});
  // Positive inputs (sums without cancellation); dx = y * (dy - s) with s >> dy.
  v.push_back({mixed_kernel("mixed_outer_24x10", 24, 10, 0), "column", {0.5, 1.5}, false, 1e-5, 1e-6});
  v.push_back({mixed_kernel("mixed_outer_300x40", 300, 40, 0), "column", {0.5, 1.5}, false, 1e-5, 1e-6});
  v.push_back({mixed_kernel("mixed_inner_10x300", 10, 300, 1), "row_warp", {0.5, 1.5}, false, 1e-5, 1e-6});
  v.push_back({mixed_kernel("mixed_inner_3x5000", 3, 5000, 1), "row_block", {0.5, 1.5}, false, 1e-5, 1e-6});
  v.push_back({bf16_reduce_kernel("bf16_reduce_6x64", 6, 64), "row_warp", {0.5, 1.5}, false, 2e-2});
  v.push_back({bf16_reduce_kernel("bf16_reduce_9x5", 9, 5), "column", {0.5, 1.5}, false, 2e-2});
  v.push_back({int_row_kernel("int_row_7x100", 7, 100), "row_warp", {-1000, 1000}});
  v.push_back({int_row_kernel("int_row_2x5000", 2, 5000), "row_block", {-1000, 1000}});
  return v;
}

std::vector<Kernel> kernels_of(const std::vector<RowCase>& cs) {
  std::vector<Kernel> ks;
  for (const RowCase& c : cs) ks.push_back(c.k);
  return ks;
}

// ---- No GPU needed -------------------------------------------------------------------

TEST(CudaRowEmit, SchedulesAndLaunchGeometry) {
  const std::vector<RowCase> cs = row_cases();
  auto src = codegen::emit_cuda(kernels_of(cs));
  ASSERT_TRUE(src.has_value()) << src.message();
  ASSERT_EQ(src->kernels.size(), cs.size());
  for (size_t i = 0; i < cs.size(); ++i) {
    const codegen::CudaKernelInfo& info = src->kernels[i];
    EXPECT_TRUE(cs[i].k.is_row_program()) << cs[i].k.name;
    EXPECT_EQ(info.name, cs[i].k.name);
    EXPECT_EQ(info.schedule, cs[i].schedule) << info.name;
    EXPECT_EQ(info.block[0], 256u);
    EXPECT_TRUE(info.inits.empty()) << info.name << ": row programs never need pre-launch fills";
    const int64_t rows = codegen::static_extent(cs[i].k.domain[cs[i].k.reduced[0] ? 1 : 0]);
    const int64_t per_block = info.schedule == "row_warp" ? 8 : info.schedule == "row_block" ? 1 : 256;
    EXPECT_EQ(info.grid[0], static_cast<unsigned>((rows + per_block - 1) / per_block)) << info.name;
  }
  // Softmax's three passes: max, then sum of exp, then the point store.
  const std::string& s = src->source;
  const size_t at = s.find("softmax_f32_37x129(");
  ASSERT_NE(at, std::string::npos);
  const std::string body = s.substr(at, s.find("\n}\n", at) - at);
  EXPECT_NE(body.find("// pass 3 of 3"), std::string::npos) << body;
  EXPECT_NE(body.find("kiln_warp_max(ra"), std::string::npos) << body;
  EXPECT_NE(body.find("kiln_warp_sum(ra"), std::string::npos) << body;
}

TEST(CudaRowEmit, CompilesForSm80AndSm90WithoutSpills) {
  ASSERT_FALSE(codegen::cuda_include_dir().empty()) << "CUDA headers (cuda_bf16.h) not found for NVRTC";
  const std::vector<RowCase> cs = row_cases();
  auto src = codegen::emit_cuda(kernels_of(cs));
  ASSERT_TRUE(src.has_value()) << src.message();
  // KILN_CUDA_ROW_DUMP=<file>: keep the translation unit for inspection.
  if (const char* f = std::getenv("KILN_CUDA_ROW_DUMP")) std::ofstream(f) << src->source;
  for (const char* arch : {"sm_80", "sm_90"}) {
    auto info = codegen::ptxas_info(src->source, "row_programs", arch);
    ASSERT_TRUE(info.has_value()) << info.message();
    std::set<std::string> seen;
    for (const codegen::PtxasKernelInfo& k : *info) {
      seen.insert(k.kernel);
      EXPECT_GT(k.registers, 0) << k.kernel;
      EXPECT_EQ(k.spill_store_bytes, 0) << k.kernel << " " << arch;
      EXPECT_EQ(k.spill_load_bytes, 0) << k.kernel << " " << arch;
      EXPECT_EQ(k.local_memory_bytes, 0) << k.kernel << " " << arch;
    }
    for (const RowCase& c : cs) EXPECT_TRUE(seen.count(c.k.name)) << c.k.name << " missing for " << arch;
  }
}

// ---- On a GPU ------------------------------------------------------------------------

int64_t extent(const Kernel& k, const codegen::KernelParam& p) { return codegen::param_elements(k, p); }

void fill_inputs(DType dt, std::vector<uint8_t>& buf, int64_t n, const RowCase& c, std::mt19937_64& rng) {
  std::uniform_real_distribution<double> u(c.range.first, c.range.second);
  std::uniform_int_distribution<int64_t> ui(static_cast<int64_t>(c.range.first), static_cast<int64_t>(c.range.second));
  for (int64_t i = 0; i < n; ++i) {
    double v = u(rng);
    if (c.specials) {
      if (i % 97 == 3)
        v = NAN;
      else if (i % 89 == 5)
        v = INFINITY;
      else if (i % 83 == 7)
        v = -INFINITY;
      else if (i % 79 == 11)
        v = -0.0;
    }
    switch (dt) {
      case DType::f32:
        reinterpret_cast<float*>(buf.data())[i] = static_cast<float>(v);
        break;
      case DType::f64:
        reinterpret_cast<double*>(buf.data())[i] = v;
        break;
      case DType::bf16:
        reinterpret_cast<uint16_t*>(buf.data())[i] = ir::f32_to_bf16(static_cast<float>(v));
        break;
      case DType::i32:
        reinterpret_cast<int32_t*>(buf.data())[i] = static_cast<int32_t>(ui(rng));
        break;
      default:
        FAIL() << "fill_inputs: no filler for " << ir::dtype_name(dt);
    }
  }
}

double read(DType t, const std::vector<uint8_t>& b, size_t i) {
  switch (t) {
    case DType::f32: {
      float f;
      std::memcpy(&f, b.data() + 4 * i, 4);
      return f;
    }
    case DType::f64: {
      double d;
      std::memcpy(&d, b.data() + 8 * i, 8);
      return d;
    }
    case DType::bf16: {
      uint16_t h;
      std::memcpy(&h, b.data() + 2 * i, 2);
      return ir::bf16_to_f32(h);
    }
    default: {
      int32_t v;
      std::memcpy(&v, b.data() + 4 * i, 4);
      return v;
    }
  }
}

class CudaRowDevice : public ::testing::TestWithParam<int> {
 public:
  static std::vector<RowCase>& cases() {
    static std::vector<RowCase> c = row_cases();
    return c;
  }
  static void SetUpTestSuite() {
    auto d = CudaDevice::open(0);
    if (!d.has_value()) {
      skip_reason_ = d.message();
      std::printf("[ gpu      ] row-program device tests skipped: %s\n", skip_reason_.c_str());
      return;
    }
    device_ = std::move(*d);
    auto src = codegen::emit_cuda(kernels_of(cases()));
    if (!src.has_value()) {
      setup_error_ = src.message();
      return;
    }
    source_ = *src;
    codegen::NvrtcOptions o;
    o.arch = device_->arch();
    auto img = codegen::nvrtc_compile(source_.source, "row_programs", o);
    if (!img.has_value()) {
      setup_error_ = img.message();
      return;
    }
    auto m = device_->load_module(img->image);
    if (!m.has_value()) {
      setup_error_ = m.message();
      return;
    }
    module_ = *m;
  }
  static void TearDownTestSuite() { device_.reset(); }

 protected:
  void SetUp() override {
    if (!device_) {
      if (std::getenv("KILN_REQUIRE_GPU")) FAIL() << "KILN_REQUIRE_GPU is set but: " << skip_reason_;
      GTEST_SKIP() << "skipped: " << skip_reason_;
    }
    ASSERT_TRUE(setup_error_.empty()) << setup_error_;
  }

  static std::unique_ptr<CudaDevice> device_;
  static std::string skip_reason_, setup_error_;
  static codegen::CudaModuleSource source_;
  static runtime::CudaModule* module_;
};

std::unique_ptr<CudaDevice> CudaRowDevice::device_;
std::string CudaRowDevice::skip_reason_;
std::string CudaRowDevice::setup_error_;
codegen::CudaModuleSource CudaRowDevice::source_;
runtime::CudaModule* CudaRowDevice::module_ = nullptr;

TEST_P(CudaRowDevice, MatchesReference) {
  const int ci = GetParam();
  const RowCase& c = cases()[ci];
  const Kernel& k = c.k;
  const codegen::CudaKernelInfo& info = source_.kernels[ci];
  ASSERT_EQ(info.name, k.name);
  std::mt19937_64 rng(4321 + ci);
  const size_t np = k.params.size();
  std::vector<std::vector<uint8_t>> host(np), got(np);
  for (size_t p = 0; p < np; ++p) {
    const int64_t n = extent(k, k.params[p]);
    host[p].assign(static_cast<size_t>(n) * ir::dtype_size(k.params[p].dtype), 0x5a);
    if (!k.params[p].is_output) fill_inputs(k.params[p].dtype, host[p], n, c, rng);
  }
  std::vector<CudaDevicePtr> dev(np);
  for (size_t p = 0; p < np; ++p) {
    auto a = device_->alloc(host[p].size());
    ASSERT_TRUE(a.has_value()) << a.message();
    dev[p] = *a;
    ASSERT_TRUE(device_->copy_to_device(dev[p], host[p].data(), host[p].size()).is_ok());
  }
  Status st = device_->launch(module_, info, dev);
  ASSERT_TRUE(st.is_ok()) << st.message();
  st = device_->synchronize();
  ASSERT_TRUE(st.is_ok()) << st.message();
  for (size_t p = 0; p < np; ++p) {
    got[p].resize(host[p].size());
    ASSERT_TRUE(device_->copy_to_host(got[p].data(), dev[p], got[p].size()).is_ok());
    ASSERT_TRUE(device_->free(dev[p]).is_ok());
  }
  std::vector<void*> ptrs;
  for (auto& h : host) ptrs.push_back(h.data());
  st = codegen::evaluate_reference(k, ptrs);
  ASSERT_TRUE(st.is_ok()) << st.message();

  for (size_t p = 0; p < np; ++p) {
    const codegen::KernelParam& kp = k.params[p];
    if (!kp.is_output) continue;
    const size_t sz = ir::dtype_size(kp.dtype), n = host[p].size() / sz;
    int64_t bad = 0;
    std::string first;
    for (size_t i = 0; i < n; ++i) {
      if (std::memcmp(got[p].data() + sz * i, host[p].data() + sz * i, sz) == 0) continue;  // bit-equal (sentinels too)
      const double g = read(kp.dtype, got[p], i), r = read(kp.dtype, host[p], i);
      bool ok;
      if (kp.dtype == DType::i32)
        ok = false;
      else if (std::isnan(r) || std::isnan(g))
        ok = std::isnan(r) && std::isnan(g);
      else if (std::isinf(r) || std::isinf(g))
        ok = g == r;
      else
        ok = std::fabs(g - r) <= c.rel * std::fabs(r) + c.abs;
      if (!ok && ++bad <= 5)
        first += "\n  [" + std::to_string(i) + "] gpu " + std::to_string(g) + " ref " + std::to_string(r);
    }
    EXPECT_EQ(bad, 0) << k.name << " output " << kp.name << " (" << ir::dtype_name(kp.dtype) << ", schedule "
                      << info.schedule << "): " << bad << " of " << n << " elements differ" << first;
  }
}

INSTANTIATE_TEST_SUITE_P(RowPrograms, CudaRowDevice,
                         ::testing::Range(0, static_cast<int>(CudaRowDevice::cases().size())),
                         [](const ::testing::TestParamInfo<int>& i) { return CudaRowDevice::cases()[i.param].k.name; });

}  // namespace
}  // namespace kiln::gputest
