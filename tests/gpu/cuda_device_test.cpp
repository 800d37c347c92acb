// Device tests of the CUDA backend: every corpus kernel (tests/gpu/gpu_cases.h) runs on the
// GPU on random inputs and is compared element by element with codegen::evaluate_reference.
// Tolerances (stated per case in gpu_cases.h):
//   f32 pointwise arithmetic: bit-exact (NVRTC --fmad=false); transcendentals and powf
//     1e-5 relative (CUDA's expf/erff/... differ from glibc's by a few ulp);
//   bf16/f16: exact or 1 ulp (the f32 value before rounding may differ by those ulp);
//   integers, bool, casts, max reductions: exact;
//   f32 sums: against an f64 oracle (evaluate_reference on the kernel widened to f64 outputs),
//     |gpu - o| <= 1e-5 |o| + 1e-6 sum|terms|, since the reference's own sequential f32 sum
//     over 10^6 terms is off by ~1e-5 relative;
//   f64 sums: 1e-12 relative.
// Output buffers start filled with a sentinel byte on both sides, so writes outside the
// kernel's elements are caught. Without a CUDA device every test here is skipped with one line.
#include "runtime/cuda/cuda_device.h"

#include <gtest/gtest.h>

#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <random>

#include "codegen/cuda/cuda_emitter.h"
#include "codegen/cuda/nvrtc.h"
#include "tests/gpu/gpu_cases.h"

namespace kiln::gputest {
namespace {

using runtime::CudaDevice;
using runtime::CudaDevicePtr;

/// Elements a param's buffer must hold.
int64_t extent(const Kernel& k, const KernelParam& p) { return codegen::param_elements(k, p); }

void fill_random(DType dt, std::vector<uint8_t>& buf, int64_t n, std::pair<double, double> range,
                 std::mt19937_64& rng) {
  std::uniform_real_distribution<double> u(range.first, range.second);
  auto ri = [&]() {
    std::uniform_int_distribution<int64_t> d(static_cast<int64_t>(std::ceil(range.first)),
                                             static_cast<int64_t>(std::ceil(range.second)) - 1);
    return d(rng);
  };
  for (int64_t i = 0; i < n; ++i) {
    switch (dt) {
      case DType::f32:
        reinterpret_cast<float*>(buf.data())[i] = static_cast<float>(u(rng));
        break;
      case DType::f64:
        reinterpret_cast<double*>(buf.data())[i] = u(rng);
        break;
      case DType::bf16:
        reinterpret_cast<uint16_t*>(buf.data())[i] = ir::f32_to_bf16(static_cast<float>(u(rng)));
        break;
      case DType::f16:
        reinterpret_cast<uint16_t*>(buf.data())[i] = ir::f32_to_f16(static_cast<float>(u(rng)));
        break;
      case DType::i64:
        reinterpret_cast<int64_t*>(buf.data())[i] = ri();
        break;
      case DType::i32:
        reinterpret_cast<int32_t*>(buf.data())[i] = static_cast<int32_t>(ri());
        break;
      case DType::i8:
        reinterpret_cast<int8_t*>(buf.data())[i] = static_cast<int8_t>(ri());
        break;
      case DType::u8:
      case DType::boolean:
        buf[i] = static_cast<uint8_t>(ri());
        break;
      default:
        break;
    }
  }
}

/// Ordered integer of a 16-bit float's bits (adjacent values differ by 1, +0 == -0).
int32_t ordered16(uint16_t b) { return (b & 0x8000) ? -static_cast<int32_t>(b & 0x7fff) : static_cast<int32_t>(b); }

/// Kernel whose f32 sum stores are widened: store s -> f64 sum of (double)e and an extra f64
/// param with the sum of |e|. Params keep their indices; the abs params are appended.
Kernel widen_sums(const Kernel& k, std::vector<int>& abs_param) {
  Kernel w = k;
  w.name = k.name + "_f64";
  abs_param.assign(k.stores.size(), -1);
  for (size_t s = 0; s < k.stores.size(); ++s) {
    KStore& st = w.stores[s];
    KernelParam& p = w.params[st.param];
    p.dtype = DType::f64;
    KExpr cast;
    cast.kind = KExpr::Kind::op;
    cast.op = ScalarOp::cast;
    cast.dtype = DType::f64;
    cast.args = {st.expr};
    KExpr ab;
    ab.kind = KExpr::Kind::op;
    ab.op = ScalarOp::abs;
    ab.dtype = w.exprs[st.expr].dtype;
    ab.args = {st.expr};
    w.exprs.push_back(cast);
    st.expr = static_cast<int>(w.exprs.size()) - 1;
    w.exprs.push_back(ab);
    KExpr cast2 = cast;
    cast2.args = {static_cast<int>(w.exprs.size()) - 1};
    w.exprs.push_back(cast2);
    KernelParam ap = p;
    ap.name += "_abs";
    w.params.push_back(ap);
    abs_param[s] = static_cast<int>(w.params.size()) - 1;
    w.stores.push_back({abs_param[s], static_cast<int>(w.exprs.size()) - 1, ReduceKind::sum});
  }
  return w;
}

class CudaDeviceTest : public ::testing::TestWithParam<int> {
 public:
  static void SetUpTestSuite() {
    auto d = CudaDevice::open(0);
    if (!d.has_value()) {
      skip_reason_ = d.message();
      std::printf("[ gpu      ] device tests skipped: %s\n", skip_reason_.c_str());
      return;
    }
    device_ = std::move(*d);
    std::printf("[ gpu      ] %s, %s, %d SMs, driver %d, NVRTC %s\n", device_->name().c_str(), device_->arch().c_str(),
                device_->multiprocessors(), device_->driver_version(), codegen::nvrtc_version().c_str());
    std::vector<Kernel> ks;
    for (Case& c : cases()) ks.push_back(c.k);
    auto src = codegen::emit_cuda(ks);
    if (!src.has_value()) {
      setup_error_ = src.message();
      return;
    }
    source_ = *src;
    codegen::NvrtcOptions o;
    o.arch = device_->arch();
    auto img = codegen::nvrtc_compile(source_.source, "gpu_corpus", o);
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

  static std::vector<Case>& cases() {
    static std::vector<Case> c = all_cases();
    return c;
  }

 protected:
  void SetUp() override {
    if (!device_) {
      // tools/gpu_check.sh sets KILN_REQUIRE_GPU=1: there a missing device is a failure.
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

std::unique_ptr<CudaDevice> CudaDeviceTest::device_;
std::string CudaDeviceTest::skip_reason_;
std::string CudaDeviceTest::setup_error_;
codegen::CudaModuleSource CudaDeviceTest::source_;
runtime::CudaModule* CudaDeviceTest::module_ = nullptr;

TEST_P(CudaDeviceTest, MatchesReference) {
  const int ci = GetParam();
  const Case& c = cases()[ci];
  const Kernel& k = c.k;
  const codegen::CudaKernelInfo& info = source_.kernels[ci];
  ASSERT_EQ(info.name, k.name);
  std::mt19937_64 rng(1234 + ci);

  // Host buffers: inputs random, outputs a sentinel; the GPU gets copies of the same bytes.
  const size_t np = k.params.size();
  std::vector<std::vector<uint8_t>> host(np);
  for (size_t p = 0; p < np; ++p) {
    const int64_t n = extent(k, k.params[p]);
    host[p].assign(static_cast<size_t>(n) * ir::dtype_size(k.params[p].dtype), 0x5a);
    if (!k.params[p].is_output) fill_random(k.params[p].dtype, host[p], n, c.range[p], rng);
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
  std::vector<std::vector<uint8_t>> got(np);
  for (size_t p = 0; p < np; ++p) {
    got[p].resize(host[p].size());
    ASSERT_TRUE(device_->copy_to_host(got[p].data(), dev[p], got[p].size()).is_ok());
    ASSERT_TRUE(device_->free(dev[p]).is_ok());
  }

  // Reference.
  std::vector<void*> ptrs;
  for (auto& h : host) ptrs.push_back(h.data());
  st = codegen::evaluate_reference(k, ptrs);
  ASSERT_TRUE(st.is_ok()) << st.message();

  // f64 oracle of f32 sums.
  std::vector<std::vector<double>> o64(np), abs64(np);
  if (c.check == Check::sum_f64) {
    std::vector<int> abs_param;
    Kernel w = widen_sums(k, abs_param);
    std::vector<std::vector<uint8_t>> wb(w.params.size());
    std::vector<void*> wp;
    for (size_t p = 0; p < w.params.size(); ++p) {
      if (p < np && !k.params[p].is_output) {
        wp.push_back(host[p].data());
        continue;
      }
      wb[p].assign(static_cast<size_t>(extent(w, w.params[p])) * 8, 0);
      wp.push_back(wb[p].data());
    }
    st = codegen::evaluate_reference(w, wp);
    ASSERT_TRUE(st.is_ok()) << st.message();
    for (size_t s = 0; s < k.stores.size(); ++s) {
      const int p = k.stores[s].param;
      const size_t n = wb[p].size() / 8;
      o64[p].resize(n);
      abs64[p].resize(n);
      std::memcpy(o64[p].data(), wb[p].data(), n * 8);
      std::memcpy(abs64[p].data(), wb[abs_param[s]].data(), n * 8);
    }
  }

  // Compare every element of every output buffer (sentinel gaps included).
  for (size_t p = 0; p < np; ++p) {
    const KernelParam& kp = k.params[p];
    if (!kp.is_output) continue;
    const size_t n = host[p].size() / ir::dtype_size(kp.dtype);
    int64_t bad = 0;
    std::string first;
    auto report = [&](size_t i, const std::string& g, const std::string& r) {
      if (++bad <= 5) first += "\n  [" + std::to_string(i) + "] gpu " + g + " ref " + r;
    };
    const bool sentinel_only_gap = c.check == Check::sum_f64;
    for (size_t i = 0; i < n; ++i) {
      switch (kp.dtype) {
        case DType::f32: {
          float g, r;
          std::memcpy(&g, got[p].data() + 4 * i, 4);
          std::memcpy(&r, host[p].data() + 4 * i, 4);
          uint32_t gb, rb;
          std::memcpy(&gb, &g, 4);
          std::memcpy(&rb, &r, 4);
          bool ok;
          if (sentinel_only_gap && rb != 0x5a5a5a5au) {
            const double o = o64[p][i];
            ok = std::fabs(g - o) <= 1e-5 * std::fabs(o) + 1e-6 * abs64[p][i];
            if (!ok) report(i, std::to_string(g), std::to_string(r) + " f64 oracle " + std::to_string(o));
            break;
          }
          ok = gb == rb || (std::isnan(g) && std::isnan(r)) || std::fabs(g - r) <= c.rel * std::fabs(r) + c.abs;
          if (!ok) report(i, std::to_string(g), std::to_string(r));
          break;
        }
        case DType::f64: {
          double g, r;
          std::memcpy(&g, got[p].data() + 8 * i, 8);
          std::memcpy(&r, host[p].data() + 8 * i, 8);
          const bool ok = std::memcmp(&g, &r, 8) == 0 || (std::isnan(g) && std::isnan(r)) ||
                          std::fabs(g - r) <= c.rel * std::fabs(r) + c.abs;
          if (!ok) report(i, std::to_string(g), std::to_string(r));
          break;
        }
        case DType::bf16:
        case DType::f16: {
          uint16_t g, r;
          std::memcpy(&g, got[p].data() + 2 * i, 2);
          std::memcpy(&r, host[p].data() + 2 * i, 2);
          const bool bf = kp.dtype == DType::bf16;
          const float gf = bf ? ir::bf16_to_f32(g) : ir::f16_to_f32(g),
                      rf = bf ? ir::bf16_to_f32(r) : ir::f16_to_f32(r);
          const bool ok =
              g == r || (std::isnan(gf) && std::isnan(rf)) || std::abs(ordered16(g) - ordered16(r)) <= c.ulps;
          if (!ok) report(i, std::to_string(gf), std::to_string(rf));
          break;
        }
        default: {
          const size_t sz = ir::dtype_size(kp.dtype);
          if (std::memcmp(got[p].data() + sz * i, host[p].data() + sz * i, sz) != 0) {
            int64_t g = 0, r = 0;
            std::memcpy(&g, got[p].data() + sz * i, sz);
            std::memcpy(&r, host[p].data() + sz * i, sz);
            report(i, std::to_string(g), std::to_string(r));
          }
        }
      }
    }
    EXPECT_EQ(bad, 0) << k.name << " output " << kp.name << " (" << ir::dtype_name(kp.dtype) << ", schedule "
                      << info.schedule << "): " << bad << " of " << n << " elements differ" << first;
  }
}

std::string case_name(const ::testing::TestParamInfo<int>& i) { return CudaDeviceTest::cases()[i.param].k.name; }

INSTANTIATE_TEST_SUITE_P(Corpus, CudaDeviceTest, ::testing::Range(0, static_cast<int>(CudaDeviceTest::cases().size())),
                         case_name);

}  // namespace
}  // namespace kiln::gputest
