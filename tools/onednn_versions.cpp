// oneDNN version / layout micro-benchmark (not part of the CMake build): one source,
// compiled by tools/bench_onednn.sh against Debian's oneDNN 2.6 and against a PyPI
// oneDNN 3.x, timing kiln's ResNet-18 (width 8, 32x32) convolutions and a few GEMMs.
//
// Each primitive is created once, warmed up 20 calls, then timed per call (steady_clock,
// execute + stream.wait) for 200 calls; the median is printed. Layouts:
//   plain: NCHW / OIHW (kiln's runtime/kernels/onednn.cpp today)
//   any:   format_tag::any for src/weights/dst (oneDNN picks); the primitive is timed
//          alone, and separately the reorders from/to NCHW/OIHW that an isolated call
//          would need (sum of the medians of each needed reorder).
//
// Output: one tab-separated line per measurement,
//   R <group> <name> <op> <layout> <prim_median_ms> <prim_min_ms> <reorder_ms> <impl> <formats>
// and header lines starting with '#'.
//
// Usage: onednn_versions <group>...   groups: conv_f32_n4 conv_f32_n32 conv_bf16_n32 gemm_f32 gemm_bf16
#include <sys/resource.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <oneapi/dnnl/dnnl.hpp>
#include <random>
#include <string>
#include <unordered_map>
#include <vector>

using dnnl::memory;
using Dt = memory::data_type;
using Tag = memory::format_tag;

namespace {

constexpr int kWarmup = 20;
constexpr int kIters = 200;

dnnl::engine& eng() {
  static dnnl::engine e(dnnl::engine::kind::cpu, 0);
  return e;
}
dnnl::stream& strm() {
  static dnnl::stream s(eng());
  return s;
}

/// A memory filled with small random values (an f32 pattern converted by a reorder for
/// other data types and blocked layouts).
memory filled(const memory::desc& d) {
  memory m(d, eng());
  // A plain (row-major) f32 descriptor with the same dims generates the data.
#if DNNL_VERSION_MAJOR >= 3
  memory::dims dims = d.get_dims();
#else
  memory::dims dims = d.dims();
#endif
  memory::dims strides(dims.size(), 1);
  for (int i = static_cast<int>(dims.size()) - 2; i >= 0; --i) strides[i] = strides[i + 1] * dims[i + 1];
  memory::desc src(dims, Dt::f32, strides);
  memory tmp(src, eng());
  float* p = static_cast<float*>(tmp.get_data_handle());
  size_t n = src.get_size() / sizeof(float);
  std::mt19937 rng(42);
  std::uniform_real_distribution<float> u(-1.f, 1.f);
  for (size_t i = 0; i < n; ++i) p[i] = u(rng);
  // Zero the whole destination first (blocked layouts have padding).
  std::memset(m.get_data_handle(), 0, d.get_size());
  dnnl::reorder(tmp, m).execute(strm(), tmp, m);
  strm().wait();
  return m;
}

/// Minimum of the last timing (a contention-robust companion of the median).
double g_last_min = 0.0;

double median_ms(const std::function<void()>& f) {
  for (int i = 0; i < kWarmup; ++i) f();
  std::vector<double> t(kIters);
  for (int i = 0; i < kIters; ++i) {
    auto a = std::chrono::steady_clock::now();
    f();
    auto b = std::chrono::steady_clock::now();
    t[i] = std::chrono::duration<double, std::milli>(b - a).count();
  }
  g_last_min = *std::min_element(t.begin(), t.end());
  std::nth_element(t.begin(), t.begin() + kIters / 2, t.end());
  return t[kIters / 2];
}

double time_prim(const dnnl::primitive& p, const std::unordered_map<int, memory>& args) {
  return median_ms([&] {
    p.execute(strm(), args);
    strm().wait();
  });
}

/// Time of a reorder between a plain and a chosen descriptor (0 when they are equal).
double time_reorder(const memory::desc& from, const memory::desc& to) {
  if (from == to) return 0.0;
  memory a = filled(from), b(to, eng());
  dnnl::reorder r(a, b);
  return time_prim(r, {{DNNL_ARG_FROM, a}, {DNNL_ARG_TO, b}});
}

/// A short description of a descriptor's layout: "plain" or its inner blocks ("8b16a" style).
std::string fmt(const memory::desc& d) {
#if DNNL_VERSION_MAJOR >= 3
  auto blks = d.get_inner_blks();
  auto idxs = d.get_inner_idxs();
  auto strides = d.get_strides();
#else
  const auto& bd = d.data.format_desc.blocking;
  std::vector<int64_t> blks(bd.inner_blks, bd.inner_blks + bd.inner_nblks);
  std::vector<int64_t> idxs(bd.inner_idxs, bd.inner_idxs + bd.inner_nblks);
  std::vector<int64_t> strides(bd.strides, bd.strides + d.data.ndims);
#endif
  // outer order: dims sorted by stride, descending
  std::vector<int> ord(strides.size());
  for (size_t i = 0; i < ord.size(); ++i) ord[i] = static_cast<int>(i);
  std::stable_sort(ord.begin(), ord.end(), [&](int a, int b) { return strides[a] > strides[b]; });
  std::string s;
  for (int i : ord) s += static_cast<char>('a' + i);
  for (size_t i = 0; i < blks.size(); ++i) s += std::to_string(blks[i]) + static_cast<char>('a' + idxs[i]);
  return s;
}

memory::desc plain(const memory::dims& dims, Dt dt) {
  return memory::desc(dims, dt, dims.size() == 4 ? Tag::abcd : (dims.size() == 2 ? Tag::ab : Tag::abc));
}
memory::desc anyd(const memory::dims& dims, Dt dt) { return memory::desc(dims, dt, Tag::any); }

struct Conv {
  const char* name;
  int ic, oc, hw, k, stride, pad;
};

// ResNet-18, base width 8, 32x32 input (examples/resnet18).
const Conv kConvs[] = {
    {"conv1_3to8_7x7s2_32", 3, 8, 32, 7, 2, 3}, {"c3_8to8_8x8", 8, 8, 8, 3, 1, 1},
    {"c3_16to16_4x4", 16, 16, 4, 3, 1, 1},      {"c3_32to32_2x2", 32, 32, 2, 3, 1, 1},
    {"c3_64to64_1x1", 64, 64, 1, 3, 1, 1},      {"c3s2_8to16_8x8", 8, 16, 8, 3, 2, 1},
    {"c3s2_16to32_4x4", 16, 32, 4, 3, 2, 1},    {"c3s2_32to64_2x2", 32, 64, 2, 3, 2, 1},
    {"ds1x1s2_8to16_8x8", 8, 16, 8, 1, 2, 0},   {"ds1x1s2_16to32_4x4", 16, 32, 4, 1, 2, 0},
    {"ds1x1s2_32to64_2x2", 32, 64, 2, 1, 2, 0},
};

void out(const std::string& group, const std::string& name, const char* op, const char* layout, double ms,
         double min_ms, double rms, const char* impl, const std::string& formats) {
  std::printf("R\t%s\t%s\t%s\t%s\t%.5f\t%.5f\t%.5f\t%s\t%s\n", group.c_str(), name.c_str(), op, layout, ms, min_ms, rms,
              impl, formats.c_str());
  std::fflush(stdout);
}

void bench_conv(const std::string& group, const Conv& c, int n, Dt dt, bool any) {
  const int oh = (c.hw + 2 * c.pad - c.k) / c.stride + 1;
  memory::dims xd{n, c.ic, c.hw, c.hw}, wd{c.oc, c.ic, c.k, c.k}, yd{n, c.oc, oh, oh};
  memory::dims st{c.stride, c.stride}, dil{0, 0}, pad{c.pad, c.pad};
  const memory::desc xp = plain(xd, dt), wp = plain(wd, dt), yp = plain(yd, dt);
  const memory::desc xq = any ? anyd(xd, dt) : xp, wq = any ? anyd(wd, dt) : wp, yq = any ? anyd(yd, dt) : yp;
  const auto alg = dnnl::algorithm::convolution_direct;
  const char* layout = any ? "any" : "plain";
  using CF = dnnl::convolution_forward;
  using CBD = dnnl::convolution_backward_data;
  using CBW = dnnl::convolution_backward_weights;
#if DNNL_VERSION_MAJOR >= 3
  CF::primitive_desc fpd(eng(), dnnl::prop_kind::forward_training, alg, xq, wq, yq, st, dil, pad, pad);
  CBD::primitive_desc dpd(eng(), alg, xq, wq, yq, st, dil, pad, pad, fpd);
  CBW::primitive_desc wpd(eng(), alg, xq, wq, yq, st, dil, pad, pad, fpd);
#else
  CF::primitive_desc fpd(CF::desc(dnnl::prop_kind::forward_training, alg, xq, wq, yq, st, dil, pad, pad), eng());
  CBD::primitive_desc dpd(CBD::desc(alg, xq, wq, yq, st, dil, pad, pad), eng(), fpd);
  CBW::primitive_desc wpd(CBW::desc(alg, xq, wq, yq, st, dil, pad, pad), eng(), fpd);
#endif
  {  // forward: x, w in; y out
    auto x = filled(fpd.src_desc()), w = filled(fpd.weights_desc()), y = filled(fpd.dst_desc());
    std::unordered_map<int, memory> a{{DNNL_ARG_SRC, x}, {DNNL_ARG_WEIGHTS, w}, {DNNL_ARG_DST, y}};
    if (fpd.workspace_desc().get_size()) a[DNNL_ARG_WORKSPACE] = memory(fpd.workspace_desc(), eng());
    if (fpd.scratchpad_desc().get_size()) a[DNNL_ARG_SCRATCHPAD] = memory(fpd.scratchpad_desc(), eng());
    double ms = time_prim(CF(fpd), a), mn = g_last_min;
    double r =
        any ? time_reorder(xp, fpd.src_desc()) + time_reorder(wp, fpd.weights_desc()) + time_reorder(fpd.dst_desc(), yp)
            : 0.0;
    out(group, c.name, "fwd", layout, ms, mn, r, fpd.impl_info_str(),
        fmt(fpd.src_desc()) + "," + fmt(fpd.weights_desc()) + "," + fmt(fpd.dst_desc()));
  }
  {  // backward data: dy, w in; dx out
    auto dy = filled(dpd.diff_dst_desc()), w = filled(dpd.weights_desc()), dx = filled(dpd.diff_src_desc());
    std::unordered_map<int, memory> a{{DNNL_ARG_DIFF_DST, dy}, {DNNL_ARG_WEIGHTS, w}, {DNNL_ARG_DIFF_SRC, dx}};
    if (dpd.scratchpad_desc().get_size()) a[DNNL_ARG_SCRATCHPAD] = memory(dpd.scratchpad_desc(), eng());
    double ms = time_prim(CBD(dpd), a), mn = g_last_min;
    double r = any ? time_reorder(yp, dpd.diff_dst_desc()) + time_reorder(wp, dpd.weights_desc()) +
                         time_reorder(dpd.diff_src_desc(), xp)
                   : 0.0;
    out(group, c.name, "bwd_data", layout, ms, mn, r, dpd.impl_info_str(),
        fmt(dpd.diff_dst_desc()) + "," + fmt(dpd.weights_desc()) + "," + fmt(dpd.diff_src_desc()));
  }
  {  // backward weights: dy, x in; dw out
    auto dy = filled(wpd.diff_dst_desc()), x = filled(wpd.src_desc()), dw = filled(wpd.diff_weights_desc());
    std::unordered_map<int, memory> a{{DNNL_ARG_DIFF_DST, dy}, {DNNL_ARG_SRC, x}, {DNNL_ARG_DIFF_WEIGHTS, dw}};
    if (wpd.scratchpad_desc().get_size()) a[DNNL_ARG_SCRATCHPAD] = memory(wpd.scratchpad_desc(), eng());
    double ms = time_prim(CBW(wpd), a), mn = g_last_min;
    double r = any ? time_reorder(yp, wpd.diff_dst_desc()) + time_reorder(xp, wpd.src_desc()) +
                         time_reorder(wpd.diff_weights_desc(), wp)
                   : 0.0;
    out(group, c.name, "bwd_weights", layout, ms, mn, r, wpd.impl_info_str(),
        fmt(wpd.diff_dst_desc()) + "," + fmt(wpd.src_desc()) + "," + fmt(wpd.diff_weights_desc()));
  }
}

void bench_gemm(const std::string& group, int m, int k, int n, Dt in) {
  const memory::desc a = plain({m, k}, in), b = plain({k, n}, in), c = plain({m, n}, Dt::f32);
#if DNNL_VERSION_MAJOR >= 3
  dnnl::matmul::primitive_desc pd(eng(), a, b, c);
#else
  dnnl::matmul::primitive_desc pd(dnnl::matmul::desc(a, b, c), eng());
#endif
  auto am = filled(a), bm = filled(b), cm = filled(c);
  std::unordered_map<int, memory> args{{DNNL_ARG_SRC, am}, {DNNL_ARG_WEIGHTS, bm}, {DNNL_ARG_DST, cm}};
  if (pd.scratchpad_desc().get_size()) args[DNNL_ARG_SCRATCHPAD] = memory(pd.scratchpad_desc(), eng());
  double ms = time_prim(dnnl::matmul(pd), args), mn = g_last_min;
  std::string name = std::to_string(m) + "x" + std::to_string(k) + "x" + std::to_string(n);
  out(group, name, "matmul", "plain", ms, mn, 0.0, pd.impl_info_str(), "");
}

}  // namespace

int main(int argc, char** argv) {
  const dnnl_version_t* v = dnnl_version();
  const char* rt = v->cpu_runtime == DNNL_RUNTIME_OMP   ? "OMP"
                   : v->cpu_runtime == DNNL_RUNTIME_TBB ? "TBB"
                   : v->cpu_runtime == DNNL_RUNTIME_SEQ ? "SEQ"
                                                        : "other";
  std::printf("# oneDNN %d.%d.%d (%s) cpu_runtime=%s max_threads=%d\n", v->major, v->minor, v->patch, v->hash, rt,
              []() {
                const char* e = std::getenv("OMP_NUM_THREADS");
                return e ? std::atoi(e) : -1;
              }());
  const auto wall0 = std::chrono::steady_clock::now();
  for (int i = 1; i < argc; ++i) {
    std::string g = argv[i];
    try {
      if (g == "conv_f32_n4" || g == "conv_f32_n32" || g == "conv_bf16_n32") {
        const int n = g == "conv_f32_n4" ? 4 : 32;
        const Dt dt = g == "conv_bf16_n32" ? Dt::bf16 : Dt::f32;
        for (const Conv& c : kConvs)
          for (bool any : {false, true}) bench_conv(g, c, n, dt, any);
      } else if (g == "gemm_f32" || g == "gemm_bf16") {
        const Dt dt = g == "gemm_bf16" ? Dt::bf16 : Dt::f32;
        const int shapes[][3] = {{2048, 384, 1536}, {2048, 1536, 384}, {256, 256, 256}, {32, 64, 128}};
        for (auto& s : shapes) bench_gemm(g, s[0], s[1], s[2], dt);
      } else {
        std::fprintf(stderr, "unknown group %s\n", g.c_str());
        return 2;
      }
    } catch (const dnnl::error& e) {
      std::fprintf(stderr, "dnnl error in %s: %s (status %d)\n", g.c_str(), e.what(), static_cast<int>(e.status));
      return 1;
    }
  }
  rusage ru{};
  getrusage(RUSAGE_SELF, &ru);
  const double cpu = ru.ru_utime.tv_sec + ru.ru_stime.tv_sec + 1e-6 * (ru.ru_utime.tv_usec + ru.ru_stime.tv_usec);
  std::printf("@ self_cpu_s %.3f wall_s %.3f\n", cpu,
              std::chrono::duration<double>(std::chrono::steady_clock::now() - wall0).count());
  return 0;
}
