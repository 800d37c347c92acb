// Eager kernels of the 8-bit block-wise optimizer ops (ir/ops/optim8bit.cpp):
// BlockwiseQuantize8bit, BlockwiseDequantize8bit and the fused AdamW8bitUpdate.
//
// Algorithm (bitsandbytes' kOptimizerStatic8bit2StateBlockwise, without stochastic
// rounding): for each block of `blocksize` elements (one OpenMP task per block range)
//   m = qmap_s[q1] * absmax1,  v = qmap_u[q2] * absmax2          (dequantize)
//   g = grad * clip_coef
//   p = p - p * (lr * wd)                        (decoupled decay; wd = 0: none)
//   m' = m * b1 + g * (1 - b1),  v' = v * b2 + (g * g) * (1 - b2)
//   p' = p - step_size * (m' / (sqrt(v') / sqrt_bc2 + eps))
//   absmax' = max |m'| (|v'|) over the block; q' = nearest code of m' / absmax'
// The arithmetic is the f32 arithmetic of passes/optimizer.cpp's adamw_torch ops in the
// same order, so with exact state the result equals adamw_torch bit for bit. A block
// whose absmax is 0 stores the code of 0.0 (dequantizes to 0 whatever the code).
// x / absmax is a division (not a multiply by 1/absmax) so denormal absmax values
// cannot overflow to inf.
#include <algorithm>
#include <cmath>
#include <cstring>
#include <memory>
#include <mutex>
#include <vector>

#include "ir/ops/optim8bit.h"
#include "runtime/kernels/kernels.h"

namespace kiln::runtime::kernels {

namespace {

using ir::KernelContext;
using ir::Tensor;

/// Checks that a quantization map is sorted ascending (the binary search needs it).
Status check_qmap(KernelContext& c, const Tensor& q, const char* what) {
  if (q.numel() != ir::kQuantMapSize) return c.fail(std::string(what) + " must have 256 entries");
  const float* m = q.data<float>();
  for (int i = 1; i < ir::kQuantMapSize; ++i)
    if (!(m[i - 1] <= m[i])) return c.fail(std::string(what) + " is not sorted ascending (entry " + std::to_string(i) + ")");
  return Status::ok();
}

int64_t blocksize(const KernelContext& c) { return c.attrs().get_int("blocksize", ir::kBlockSize8bit); }

/// ir::nearest_code, exactly, at table speed. nearest_code is monotone in x, so
/// code(x) = #{j in 1..255 : x >= t_j} with t_j the smallest float whose code is >= j
/// (found once per map by bisection over the order-preserving integer keys of floats).
/// A table over the top 14 bits of x's key gives the code of the bucket's smallest
/// value; a few threshold compares finish. Built once per distinct map and cached.
class CodeFinder {
 public:
  explicit CodeFinder(const float* qmap) : map_(qmap, qmap + ir::kQuantMapSize) {
    for (int j = 1; j < ir::kQuantMapSize; ++j) {
      uint32_t lo = key_of(-INFINITY), hi = key_of(INFINITY);  // code(hi) = 255 >= j
      while (lo < hi) {
        uint32_t mid = lo + (hi - lo) / 2;
        if (ir::nearest_code(qmap, float_of(mid)) >= j) hi = mid;
        else lo = mid + 1;
      }
      t_[j] = float_of(lo);
    }
    for (uint32_t b = 0; b < kBuckets; ++b) {
      float lo = float_of(b << (32 - kBits));
      start_[b] = lo != lo ? 0 : ir::nearest_code(qmap, lo);  // NaN keys (never looked up)
    }
  }
  bool same_map(const float* qmap) const {
    return std::equal(map_.begin(), map_.end(), qmap, [](float a, float b) { return std::memcmp(&a, &b, 4) == 0; });
  }
  uint8_t operator()(float x) const {
    if (x != x) return 0;  // NaN, as nearest_code
    int i = start_[key_of(x) >> (32 - kBits)];
    while (i < ir::kQuantMapSize - 1 && x >= t_[i + 1]) ++i;
    return static_cast<uint8_t>(i);
  }
  /// The cached finder for `qmap` (thread-safe).
  static const CodeFinder& get(const float* qmap) {
    static std::mutex mu;
    static std::vector<std::unique_ptr<CodeFinder>> cache;
    std::lock_guard<std::mutex> lock(mu);
    for (auto& f : cache)
      if (f->same_map(qmap)) return *f;
    if (cache.size() > 16) cache.erase(cache.begin());
    cache.push_back(std::make_unique<CodeFinder>(qmap));
    return *cache.back();
  }

 private:
  static constexpr int kBits = 14;
  static constexpr uint32_t kBuckets = 1u << kBits;
  /// Order-preserving map from non-NaN floats to uint32 (and back).
  static uint32_t key_of(float f) {
    uint32_t b;
    std::memcpy(&b, &f, 4);
    return (b & 0x80000000u) ? ~b : (b | 0x80000000u);
  }
  static float float_of(uint32_t k) {
    uint32_t b = (k & 0x80000000u) ? (k & 0x7fffffffu) : ~k;
    float f;
    std::memcpy(&f, &b, 4);
    return f;
  }
  std::vector<float> map_;
  float t_[ir::kQuantMapSize] = {};
  uint8_t start_[kBuckets] = {};
};

/// Quantizes n values of one block: returns absmax, writes codes.
inline float quantize_block(const float* x, int64_t n, const CodeFinder& code, uint8_t zero_code, uint8_t* codes) {
  float mx = 0.f;  // a NaN element makes absmax NaN (and stays): non-finite state stays visible
  for (int64_t i = 0; i < n; ++i) {
    const float a = std::fabs(x[i]);
    mx = (a > mx || a != a) ? a : mx;
  }
  if (mx > 0.f && std::isfinite(mx)) {
    for (int64_t i = 0; i < n; ++i) codes[i] = code(x[i] / mx);
  } else {
    for (int64_t i = 0; i < n; ++i) codes[i] = zero_code;
  }
  return mx;
}

Status quantize_kernel(KernelContext& c) {
  const Tensor& x = c.in(0);
  KILN_RETURN_IF_ERROR(check_qmap(c, c.in(1), "qmap"));
  const float* qmap = c.in(1).data<float>();
  const int64_t n = x.numel(), bs = blocksize(c), nb = ir::num_blocks_8bit(n, bs);
  const uint8_t zero = ir::nearest_code(qmap, 0.f);
  const CodeFinder& finder = CodeFinder::get(qmap);
  const float* xp = x.data<float>();
  uint8_t* codes = c.out(0).data<uint8_t>();
  float* absmax = c.out(1).data<float>();
#pragma omp parallel for schedule(static) if (n >= (1 << 16))
  for (int64_t b = 0; b < nb; ++b) {
    const int64_t lo = b * bs, len = std::min(bs, n - lo);
    absmax[b] = quantize_block(xp + lo, len, finder, zero, codes + lo);
  }
  return Status::ok();
}

Status dequantize_kernel(KernelContext& c) {
  const Tensor& codes = c.in(0);
  KILN_RETURN_IF_ERROR(check_qmap(c, c.in(2), "qmap"));
  const float* qmap = c.in(2).data<float>();
  const int64_t n = codes.numel(), bs = blocksize(c), nb = ir::num_blocks_8bit(n, bs);
  if (c.in(1).numel() != nb) return c.fail("absmax has " + std::to_string(c.in(1).numel()) + " entries, expected " + std::to_string(nb));
  const uint8_t* q = codes.data<uint8_t>();
  const float* absmax = c.in(1).data<float>();
  float* y = c.out(0).data<float>();
#pragma omp parallel for schedule(static) if (n >= (1 << 16))
  for (int64_t b = 0; b < nb; ++b) {
    const int64_t lo = b * bs, hi = std::min(n, lo + bs);
    const float a = absmax[b];
    for (int64_t i = lo; i < hi; ++i) y[i] = qmap[q[i]] * a;
  }
  return Status::ok();
}

Status adamw8bit_kernel(KernelContext& c) {
  const Tensor& p = c.in(0);
  const Tensor& g = c.in(1);
  KILN_RETURN_IF_ERROR(check_qmap(c, c.in(6), "qmap_signed"));
  KILN_RETURN_IF_ERROR(check_qmap(c, c.in(7), "qmap_unsigned"));
  const int64_t n = p.numel(), bs = blocksize(c), nb = ir::num_blocks_8bit(n, bs);
  if (g.numel() != n || c.in(2).numel() != n || c.in(4).numel() != n || c.in(3).numel() != nb ||
      c.in(5).numel() != nb)
    return c.fail("state sizes do not match the parameter's " + std::to_string(n) + " elements");
  const float* qs = c.in(6).data<float>();
  const float* qu = c.in(7).data<float>();
  const float lr = c.in(8).data<float>()[0];
  const float step_size = c.in(9).data<float>()[0];
  const float sqrt_bc2 = c.in(10).data<float>()[0];
  const bool clip = c.has_input(11);
  const float coef = clip ? c.in(11).data<float>()[0] : 1.f;
  // Constants rounded to f32 exactly as the adamw_torch IR's scalar initializers are.
  const double b1d = c.attrs().get_float("beta1", 0.9), b2d = c.attrs().get_float("beta2", 0.999);
  const float b1 = static_cast<float>(b1d), omb1 = static_cast<float>(1.0 - b1d);
  const float b2 = static_cast<float>(b2d), omb2 = static_cast<float>(1.0 - b2d);
  const float eps = static_cast<float>(c.attrs().get_float("eps", 1e-8));
  const double wd = c.attrs().get_float("weight_decay", 0.0);
  const bool decay = wd != 0.0;
  const float lr_wd = lr * static_cast<float>(wd);  // Mul(lr, C(wd)) of the fp32 graph
  const uint8_t zero_s = ir::nearest_code(qs, 0.f), zero_u = ir::nearest_code(qu, 0.f);
  const CodeFinder& find_s = CodeFinder::get(qs);
  const CodeFinder& find_u = CodeFinder::get(qu);

  const float* pp = p.data<float>();
  const float* gp = g.data<float>();
  const uint8_t* q1 = c.in(2).data<uint8_t>();
  const float* a1 = c.in(3).data<float>();
  const uint8_t* q2 = c.in(4).data<uint8_t>();
  const float* a2 = c.in(5).data<float>();
  float* po = c.out(0).data<float>();
  uint8_t* q1o = c.out(1).data<uint8_t>();
  float* a1o = c.out(2).data<float>();
  uint8_t* q2o = c.out(3).data<uint8_t>();
  float* a2o = c.out(4).data<float>();

#pragma omp parallel if (n >= (1 << 16))
  {
    std::vector<float> m(static_cast<size_t>(bs)), v(static_cast<size_t>(bs));
#pragma omp for schedule(static)
    for (int64_t b = 0; b < nb; ++b) {
      const int64_t lo = b * bs, len = std::min(bs, n - lo);
      const float am = a1[b], av = a2[b];
      for (int64_t k = 0; k < len; ++k) {
        const int64_t i = lo + k;
        float gr = gp[i];
        if (clip) gr = gr * coef;
        const float mo = qs[q1[i]] * am, vo = qu[q2[i]] * av;
        float pd = pp[i];
        if (decay) pd = pd - pd * lr_wd;
        const float mn = mo * b1 + gr * omb1;
        const float vn = vo * b2 + (gr * gr) * omb2;
        const float denom = std::sqrt(vn) / sqrt_bc2 + eps;
        po[i] = pd - step_size * (mn / denom);
        m[k] = mn;
        v[k] = vn;
      }
      a1o[b] = quantize_block(m.data(), len, find_s, zero_s, q1o + lo);
      a2o[b] = quantize_block(v.data(), len, find_u, zero_u, q2o + lo);
    }
  }
  return Status::ok();
}

}  // namespace

void register_optim8bit_kernels(ir::OpTable& t) {
  set_kernel(t, "BlockwiseQuantize8bit", quantize_kernel);
  set_kernel(t, "BlockwiseDequantize8bit", dequantize_kernel);
  set_kernel(t, "AdamW8bitUpdate", adamw8bit_kernel);
}

}  // namespace kiln::runtime::kernels
