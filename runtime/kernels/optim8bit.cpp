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
// x / absmax is the correctly rounded quotient: on the vector paths a multiply by the
// rounded reciprocal and one FMA correction (Markstein's theorem, exact when nothing
// underflows: used only for absmax in [2^-60, 2^60] and maps whose nonzero thresholds
// are >= 2^-40 in magnitude), elsewhere a division, so denormal absmax values cannot
// overflow to inf. sqrt(v') / sqrt_bc2 is computed the same way.
#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstring>
#include <memory>
#include <mutex>
#include <vector>

#if defined(__x86_64__)
#include <immintrin.h>
// GCC 12's AVX-512 intrinsics start some results from _mm512_undefined_*() and then
// warn, where inlined, that the undefined value is used (a false positive).
#pragma GCC diagnostic ignored "-Wuninitialized"
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#endif

#include "ir/ops/optim8bit.h"
#include "runtime/kernels/kernels.h"

#if defined(__x86_64__)
/// The AVX-512 paths' target (16-lane loads, gathers, masks, byte narrowing).
#define KILN_AVX512 __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,fma")))
#endif

namespace kiln::runtime::kernels {

namespace {

using ir::KernelContext;
using ir::Tensor;

#if defined(__x86_64__)
/// The all-lanes mask 0xffff, hidden from the optimizer: with a constant full mask GCC
/// ignores a gather's source operand and leaves the destination register's old value in
/// place (see lookup16).
KILN_AVX512 inline __mmask16 opaque_all_lanes() {
  __mmask16 m = 0xffff;
  asm("" : "+Yk"(m));
  return m;
}
#endif

/// Checks that a quantization map is sorted ascending (the binary search needs it).
Status check_qmap(KernelContext& c, const Tensor& q, const char* what) {
  if (q.numel() != ir::kQuantMapSize) return c.fail(std::string(what) + " must have 256 entries");
  const float* m = q.data<float>();
  for (int i = 1; i < ir::kQuantMapSize; ++i)
    if (!(m[i - 1] <= m[i]))
      return c.fail(std::string(what) + " is not sorted ascending (entry " + std::to_string(i) + ")");
  return Status::ok();
}

int64_t blocksize(const KernelContext& c) { return c.attrs().get_int("blocksize", ir::kBlockSize8bit); }

/// ir::nearest_code, exactly, at table speed. nearest_code is monotone in x, so
/// code(x) = #{j in 1..255 : x >= t_j} with t_j the smallest float whose code is >= j
/// (found once per map by bisection over the order-preserving integer keys of floats).
/// A table over the top 16 bits of x's key gives the code of the bucket's smallest
/// value; a few threshold compares finish (at most one for the dynamic maps in [-1, 1]).
/// Where one is enough, the AVX2 path reads one packed entry per bucket holding the
/// start code and the low key bits of the one threshold inside the bucket. Built once per
/// distinct map and cached.
class CodeFinder {
 public:
  explicit CodeFinder(const float* qmap) : map_(qmap, qmap + ir::kQuantMapSize) {
    for (int j = 1; j < ir::kQuantMapSize; ++j) {
      uint32_t lo = key_of(-INFINITY), hi = key_of(INFINITY);  // code(hi) = 255 >= j
      while (lo < hi) {
        uint32_t mid = lo + (hi - lo) / 2;
        if (ir::nearest_code(qmap, float_of(mid)) >= j)
          hi = mid;
        else
          lo = mid + 1;
      }
      t_[j] = float_of(lo);
    }
    t_[ir::kQuantMapSize] = INFINITY;  // x >= t_[256] never holds for finite x
    for (uint32_t b = 0; b < kBuckets; ++b) {
      float lo = float_of(b << (32 - kBits));
      start_[b] = lo != lo ? 0 : ir::nearest_code(qmap, lo);  // NaN keys (never looked up)
    }
    for (int j = 1; j < ir::kQuantMapSize; ++j)
      if (t_[j] != 0.f && std::fabs(t_[j]) < 0x1p-40f) recip_ok_ = false;
    // The most threshold steps any x in [-1, 1] takes past its bucket's start code.
    for (uint32_t b = key_of(-1.f) >> (32 - kBits); b <= key_of(1.f) >> (32 - kBits); ++b) {
      const uint32_t hi_key = std::min(((b + 1) << (32 - kBits)) - 1, key_of(1.f));
      max_steps_ = std::max(max_steps_, ir::nearest_code(qmap, float_of(hi_key)) - int(start_[b]));
    }
    if (max_steps_ <= 1) {
      packed_.resize(kBuckets);
      for (uint32_t b = 0; b < kBuckets; ++b) {
        const int next = start_[b] + 1;  // the code a threshold inside the bucket leads to
        const uint32_t t_key = next < ir::kQuantMapSize ? key_of(t_[next]) : 0;
        const bool inside = next < ir::kQuantMapSize && (t_key >> (32 - kBits)) == b;
        // (start << 16) + 0x10000 - threshold's low key bits (0: none), minus the bucket's
        // own key bits b << 16 (mod 2^32): entry + key = (start << 16) + (0x10000 - thr)
        // + low, which reaches (start + 1) << 16 exactly when low >= thr.
        const uint32_t step = inside ? 0x10000u - (t_key & 0xffffu) : 0u;
        packed_[b] = (uint32_t(start_[b]) << 16) + step - (b << 16);
      }
    }
  }
  /// Whether x / absmax may be computed by reciprocal and correction (div_rn8): every
  /// nonzero threshold has magnitude >= 2^-40, so the quotients whose correction could be
  /// inexact (|x| < 2^-102, where the residual underflows: below 2^-42 for absmax >=
  /// 2^-60) lie in one code with 0.
  bool recip_ok() const { return recip_ok_; }
  bool same_map(const float* qmap) const {
    return std::equal(map_.begin(), map_.end(), qmap, [](float a, float b) { return std::memcmp(&a, &b, 4) == 0; });
  }
  uint8_t operator()(float x) const {
    if (x != x) return 0;  // NaN, as nearest_code
    int i = start_[key_of(x) >> (32 - kBits)];
    while (i < ir::kQuantMapSize - 1 && x >= t_[i + 1]) ++i;
    return static_cast<uint8_t>(i);
  }
#if defined(__x86_64__)
  /// code(x) for 8 finite x in [-1, 1] (AVX2), equal to operator(). With packed_ (at
  /// most one threshold per bucket): one packed entry per lane and an integer compare.
  /// Otherwise the bucket's start code by a byte gather, then max_steps_ threshold
  /// compares, each a gather of t_[i + 1] (a step past the final code compares against
  /// the same threshold and stays).
  __attribute__((target("avx2"))) __m256i codes8(__m256 x) const {
    const __m256i bits = _mm256_castps_si256(x);
    const __m256i key =
        _mm256_xor_si256(bits, _mm256_or_si256(_mm256_srai_epi32(bits, 31), _mm256_set1_epi32(INT32_MIN)));
    if (!packed_.empty()) {
      // code = (entry + key) >> 16 (see packed_).
      // Eight scalar loads, not vpgatherdd: faster on the AMD cores measured (docs/performance.md).
      alignas(32) uint32_t bucket[8];
      _mm256_store_si256(reinterpret_cast<__m256i*>(bucket), _mm256_srli_epi32(key, 32 - kBits));
      const uint32_t* pk = packed_.data();
      const __m256i e = _mm256_setr_epi32(pk[bucket[0]], pk[bucket[1]], pk[bucket[2]], pk[bucket[3]], pk[bucket[4]],
                                          pk[bucket[5]], pk[bucket[6]], pk[bucket[7]]);
      return _mm256_srli_epi32(_mm256_add_epi32(e, key), 16);
    }
    // Byte gather: 4 bytes from start_ + bucket (start_ has 3 bytes of padding), low byte kept.
    __m256i i = _mm256_and_si256(
        _mm256_i32gather_epi32(reinterpret_cast<const int*>(start_), _mm256_srli_epi32(key, 32 - kBits), 1),
        _mm256_set1_epi32(0xff));
    for (int s = 0; s < max_steps_; ++s) {
      const __m256 t = _mm256_i32gather_ps(t_ + 1, i, 4);
      i = _mm256_sub_epi32(i, _mm256_castps_si256(_mm256_cmp_ps(x, t, _CMP_GE_OQ)));
    }
    return i;
  }
  /// codes8 for 16 lanes (AVX-512), equal to operator(); needs has_packed(): one gathered
  /// packed entry per lane, code = (entry + key) >> 16.
  KILN_AVX512 __m512i codes16(__m512 x) const {
    const __m512i bits = _mm512_castps_si512(x);
    const __m512i key =
        _mm512_xor_si512(bits, _mm512_or_si512(_mm512_srai_epi32(bits, 31), _mm512_set1_epi32(INT32_MIN)));
    const __m512i e =
        _mm512_mask_i32gather_epi32(_mm512_setzero_si512(), opaque_all_lanes(), _mm512_srli_epi32(key, 32 - kBits),
                                    packed_.data(), 4);  // see lookup16
    return _mm512_srli_epi32(_mm512_add_epi32(e, key), 16);
  }
  /// codes16 for x >= +0 (sign bit clear, not NaN), in the low byte of each lane only:
  /// there the key is bits + 2^31, so the bucket is bits >> 16 from the table's upper half,
  /// and entry + bits differs from entry + key in bit 31 alone, which the shift moves to
  /// bit 15, above the code's byte (three integer operations fewer than codes16).
  KILN_AVX512 __m512i codes16_nonneg(__m512 x) const {
    const __m512i bits = _mm512_castps_si512(x);
    const __m512i e =
        _mm512_mask_i32gather_epi32(_mm512_setzero_si512(), opaque_all_lanes(), _mm512_srli_epi32(bits, 32 - kBits),
                                    packed_.data() + kBuckets / 2, 4);
    return _mm512_srli_epi32(_mm512_add_epi32(e, bits), 16);
  }
#endif
  /// Whether the one-compare packed table exists (every bucket of [-1, 1] holds at most
  /// one threshold; true for the dynamic maps).
  bool has_packed() const { return !packed_.empty(); }
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
  static constexpr int kBits = 16;
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
  float t_[ir::kQuantMapSize + 1] = {};  // t_[j]: smallest float of code >= j (t_[0] unused)
  uint8_t start_[kBuckets + 3] = {};     // + 3: the last bucket's 4-byte gather stays inside
  int max_steps_ = 0;
  bool recip_ok_ = true;
  /// Per bucket b, when max_steps_ <= 1: (start code << 16) + (0x10000 - the low 16 key
  /// bits of the threshold inside the bucket, or 0 when none) - (b << 16), mod 2^32, so
  /// that a key in the bucket has code (entry + key) >> 16 (one add and one shift).
  std::vector<uint32_t> packed_;
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

#if defined(__x86_64__)
/// The AVX2 paths also use FMA (every AVX2 CPU kiln targets has it; checked anyway).
bool cpu_has_avx2() {
  static const bool yes = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
  return yes;
}
bool cpu_has_avx512() {
  static const bool yes = cpu_has_avx2() && __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
                          __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq");
  return yes;
}
#endif

/// Highest path the kernels may take (0 portable, 1 AVX2, 2 AVX-512); tests lower it.
std::atomic<int> g_max_isa{2};

/// The path this call takes: the CPU's best, capped by g_max_isa.
int isa_level() {
  int cpu = 0;
#if defined(__x86_64__)
  cpu = cpu_has_avx512() ? 2 : cpu_has_avx2() ? 1 : 0;
#endif
  return std::min(cpu, g_max_isa.load(std::memory_order_relaxed));
}

#if defined(__x86_64__)
/// a / b rounded to nearest for 8 lanes, given y = RN(1/b): q = a*y, r = a - b*q (exact
/// by FMA), q + r*y (P. Markstein, "Computation of elementary functions on the IBM
/// RISC System/6000 processor", IBM J. Res. Dev. 34(1), 1990). Equals the division when
/// y is finite and normal and the residual does not underflow (|a| >= 2^-102); callers
/// keep b in [2^-60, 2^60]. Checked against the f32 division for every other mantissa of
/// b and quotients in [2^-40, 1] (Optim8bit.ReciprocalDivisionEqualsF32Division). Zero
/// quotients may lose their sign; infinite or NaN a gives NaN (callers exclude or repair
/// those lanes).
__attribute__((target("avx2,fma"))) inline __m256 div_rn8(__m256 a, __m256 b, __m256 y) {
  const __m256 q = _mm256_mul_ps(a, y);
  return _mm256_fmadd_ps(_mm256_fnmadd_ps(q, b, a), y, q);
}

/// map[code[0..8)] as 8 floats, by eight scalar loads (faster than vgatherdps on the AMD
/// cores measured, docs/performance.md).
__attribute__((target("avx2,fma"))) inline __m256 lookup8(const float* map, const uint8_t* code) {
  return _mm256_setr_ps(map[code[0]], map[code[1]], map[code[2]], map[code[3]], map[code[4]], map[code[5]],
                        map[code[6]], map[code[7]]);
}

/// out[i] = div_rn8(a[i], b, RN(1 / b)) for n elements (n a multiple of 8); test hook.
__attribute__((target("avx2,fma"))) void divide_by_reciprocal_avx2(const float* a, float b, float* out, int64_t n) {
  const __m256 bb = _mm256_set1_ps(b), y = _mm256_set1_ps(1.f / b);
  for (int64_t i = 0; i + 8 <= n; i += 8) _mm256_storeu_ps(out + i, div_rn8(_mm256_loadu_ps(a + i), bb, y));
}

/// Stores the low bytes of 8 codes (each 0..255) to out[0..8).
__attribute__((target("avx2,fma"))) inline void store_codes8(__m256i c, uint8_t* out) {
  const __m128i c16 = _mm_packs_epi32(_mm256_castsi256_si128(c), _mm256_extracti128_si256(c, 1));
  _mm_storel_epi64(reinterpret_cast<__m128i*>(out), _mm_packus_epi16(c16, c16));
}

/// Folds |x| of 8 lanes into a running max (NaN lanes ignored) and a running NaN mask.
__attribute__((target("avx2,fma"))) inline void fold_absmax8(__m256 x, __m256& mx, __m256& nan) {
  const __m256 a = _mm256_andnot_ps(_mm256_set1_ps(-0.f), x);
  mx = _mm256_max_ps(a, mx);  // MAXPS returns the second operand when one is NaN
  nan = _mm256_or_ps(nan, _mm256_cmp_ps(x, x, _CMP_UNORD_Q));
}

/// Horizontal max of 8 lanes (no NaN lanes).
__attribute__((target("avx2,fma"))) inline float hmax8(__m256 v) {
  __m128 m = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  m = _mm_max_ps(m, _mm_movehl_ps(m, m));
  m = _mm_max_ss(m, _mm_shuffle_ps(m, m, 1));
  return _mm_cvtss_f32(m);
}

/// quantize_block with AVX2, bit-identical to it. `mx` (max |x|, NaN lanes ignored) and
/// `any_nan` may come from the loop that produced x; a block that is not all finite with
/// a positive absmax goes through quantize_block itself (its exact NaN and zero rules).
__attribute__((target("avx2,fma"))) float quantize_block_avx2(const float* x, int64_t n, float mx, bool any_nan,
                                                              const CodeFinder& code, uint8_t zero_code,
                                                              uint8_t* codes) {
  if (any_nan || !(mx > 0.f && std::isfinite(mx))) return quantize_block(x, n, code, zero_code, codes);
  const __m256 d = _mm256_set1_ps(mx);
  int64_t i = 0;
  if (code.recip_ok() && mx >= 0x1p-60f && mx <= 0x1p60f) {  // div_rn8's exact range
    const __m256 y = _mm256_set1_ps(1.f / mx);
    for (; i + 8 <= n; i += 8) store_codes8(code.codes8(div_rn8(_mm256_loadu_ps(x + i), d, y)), codes + i);
  }
  for (; i + 8 <= n; i += 8) store_codes8(code.codes8(_mm256_div_ps(_mm256_loadu_ps(x + i), d)), codes + i);
  for (; i < n; ++i) codes[i] = code(x[i] / mx);
  return mx;
}

/// Max |x| over one block by AVX2 and whether it holds a NaN.
__attribute__((target("avx2,fma"))) float block_absmax_avx2(const float* x, int64_t n, bool* any_nan) {
  __m256 mx = _mm256_setzero_ps(), nan = _mm256_setzero_ps();
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) fold_absmax8(_mm256_loadu_ps(x + i), mx, nan);
  float m = hmax8(mx);
  bool has_nan = _mm256_movemask_ps(nan) != 0;
  for (; i < n; ++i) {
    const float a = std::fabs(x[i]);
    has_nan = has_nan || a != a;
    m = a > m ? a : m;
  }
  *any_nan = has_nan;
  return m;
}
#endif

Status dequantize_kernel(KernelContext& c) {
  const Tensor& codes = c.in(0);
  KILN_RETURN_IF_ERROR(check_qmap(c, c.in(2), "qmap"));
  const float* qmap = c.in(2).data<float>();
  const int64_t n = codes.numel(), bs = blocksize(c), nb = ir::num_blocks_8bit(n, bs);
  if (c.in(1).numel() != nb)
    return c.fail("absmax has " + std::to_string(c.in(1).numel()) + " entries, expected " + std::to_string(nb));
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

/// The f32 constants of one AdamW8bitUpdate, rounded as adamw_torch's IR rounds them.
struct AdamConsts {
  float b1, omb1, b2, omb2, eps, lr_wd, step_size, sqrt_bc2, coef;
  bool clip, decay;
};

/// One element's AdamW step from dequantized moments (the header's formulas, in order).
/// Returns the new parameter; writes the new moments.
inline float adam_element(const AdamConsts& k, float p, float gr, float mo, float vo, float& mn, float& vn) {
  if (k.clip) gr = gr * k.coef;
  if (k.decay) p = p - p * k.lr_wd;
  mn = mo * k.b1 + gr * k.omb1;
  vn = vo * k.b2 + (gr * gr) * k.omb2;
  const float denom = std::sqrt(vn) / k.sqrt_bc2 + k.eps;
  return p - k.step_size * (mn / denom);
}

/// Pointers of one AdamW8bitUpdate call (inputs, then outputs; see the op's schema).
struct AdamBuffers {
  const float *p, *g, *a1, *a2, *qs, *qu;
  const uint8_t *q1, *q2;
  float *po, *a1o, *a2o;
  uint8_t *q1o, *q2o;
};

/// Block b (elements [lo, lo + len)) by the portable scalar code; m, v: len floats scratch.
void adam8bit_block(const AdamConsts& k, const AdamBuffers& t, int64_t b, int64_t lo, int64_t len, const CodeFinder& fs,
                    const CodeFinder& fu, uint8_t zs, uint8_t zu, float* m, float* v) {
  const float am = t.a1[b], av = t.a2[b];
  for (int64_t j = 0; j < len; ++j) {
    const int64_t i = lo + j;
    t.po[i] = adam_element(k, t.p[i], t.g[i], t.qs[t.q1[i]] * am, t.qu[t.q2[i]] * av, m[j], v[j]);
  }
  t.a1o[b] = quantize_block(m, len, fs, zs, t.q1o + lo);
  t.a2o[b] = quantize_block(v, len, fu, zu, t.q2o + lo);
}

/// Elements [j, len) of block b past the vector paths' last full vector: the scalar
/// update, their |m'| and |v'| folded into the running absmax values and NaN flags.
inline void adam8bit_tail(const AdamConsts& k, const AdamBuffers& t, int64_t b, int64_t lo, int64_t j, int64_t len,
                          float* m, float* v, float& xm, float& xv, bool& nm, bool& nv) {
  const float am = t.a1[b], av = t.a2[b];
  for (; j < len; ++j) {
    const int64_t i = lo + j;
    t.po[i] = adam_element(k, t.p[i], t.g[i], t.qs[t.q1[i]] * am, t.qu[t.q2[i]] * av, m[j], v[j]);
    const float a = std::fabs(m[j]), c = std::fabs(v[j]);
    nm = nm || a != a;
    nv = nv || c != c;
    xm = a > xm ? a : xm;
    xv = c > xv ? c : xv;
  }
}

#if defined(__x86_64__)
/// adam8bit_block by AVX2, bit-identical to it: 8 elements at a time with the same f32
/// operations in the same order (nothing contracted: this file is compiled with
/// -ffp-contract=off; the only FMAs are div_rn8's exact corrections), the map lookups as
/// scalar loads, absmax folded into the update loop. sqrt(v') / sqrt_bc2 is div_rn8 by
/// the reciprocal of sqrt_bc2 when that lies in [2^-60, 1] (sqrt(v') is 0 or >= 2^-75,
/// so the quotient is 0 or >= 2^-75; an infinite or NaN lane keeps the plain product,
/// which is then the quotient's inf or NaN).
__attribute__((target("avx2,fma"))) void adam8bit_block_avx2(const AdamConsts& k, const AdamBuffers& t, int64_t b,
                                                             int64_t lo, int64_t len, const CodeFinder& fs,
                                                             const CodeFinder& fu, uint8_t zs, uint8_t zu, float* m,
                                                             float* v) {
  const float am = t.a1[b], av = t.a2[b];
  const __m256 am8 = _mm256_set1_ps(am), av8 = _mm256_set1_ps(av);
  const __m256 b1 = _mm256_set1_ps(k.b1), omb1 = _mm256_set1_ps(k.omb1), b2 = _mm256_set1_ps(k.b2),
               omb2 = _mm256_set1_ps(k.omb2), eps = _mm256_set1_ps(k.eps), lr_wd = _mm256_set1_ps(k.lr_wd),
               ss = _mm256_set1_ps(k.step_size), sbc2 = _mm256_set1_ps(k.sqrt_bc2), coef = _mm256_set1_ps(k.coef);
  const bool clip = k.clip, decay = k.decay;
  const bool recip_bc2 = k.sqrt_bc2 >= 0x1p-60f && k.sqrt_bc2 <= 1.f;
  const __m256 rbc2 = _mm256_set1_ps(1.f / k.sqrt_bc2);
  __m256 mx_m = _mm256_setzero_ps(), mx_v = _mm256_setzero_ps(), nan_m = _mm256_setzero_ps(),
         nan_v = _mm256_setzero_ps();
  // Locals, so the stores below cannot make the compiler reload the pointers.
  const float* pp = t.p + lo;  // may alias po (kiln_donate): each element read before written
  const float* __restrict gp = t.g + lo;
  const uint8_t* q1 = t.q1 + lo;  // may alias t.q1o (kiln_donate): written only after this loop
  const uint8_t* q2 = t.q2 + lo;
  const float* qs = t.qs;
  const float* qu = t.qu;
  float* po = t.po + lo;
  int64_t j = 0;
  for (; j + 8 <= len; j += 8) {
    const __m256 mo = _mm256_mul_ps(lookup8(qs, q1 + j), am8);
    const __m256 vo = _mm256_mul_ps(lookup8(qu, q2 + j), av8);
    __m256 gr = _mm256_loadu_ps(gp + j);
    if (clip) gr = _mm256_mul_ps(gr, coef);
    __m256 p = _mm256_loadu_ps(pp + j);
    if (decay) p = _mm256_sub_ps(p, _mm256_mul_ps(p, lr_wd));
    const __m256 mn = _mm256_add_ps(_mm256_mul_ps(mo, b1), _mm256_mul_ps(gr, omb1));
    const __m256 vn = _mm256_add_ps(_mm256_mul_ps(vo, b2), _mm256_mul_ps(_mm256_mul_ps(gr, gr), omb2));
    const __m256 s = _mm256_sqrt_ps(vn);
    __m256 sq;
    if (recip_bc2) {
      const __m256 q = _mm256_mul_ps(s, rbc2), r = _mm256_fnmadd_ps(q, sbc2, s);
      sq = _mm256_blendv_ps(_mm256_fmadd_ps(r, rbc2, q), q, _mm256_cmp_ps(r, r, _CMP_UNORD_Q));
    } else {
      sq = _mm256_div_ps(s, sbc2);
    }
    const __m256 denom = _mm256_add_ps(sq, eps);
    _mm256_storeu_ps(po + j, _mm256_sub_ps(p, _mm256_mul_ps(ss, _mm256_div_ps(mn, denom))));
    _mm256_storeu_ps(m + j, mn);
    _mm256_storeu_ps(v + j, vn);
    fold_absmax8(mn, mx_m, nan_m);
    fold_absmax8(vn, mx_v, nan_v);
  }
  float xm = hmax8(mx_m), xv = hmax8(mx_v);
  bool nm = _mm256_movemask_ps(nan_m) != 0, nv = _mm256_movemask_ps(nan_v) != 0;
  adam8bit_tail(k, t, b, lo, j, len, m, v, xm, xv, nm, nv);
  t.a1o[b] = quantize_block_avx2(m, len, xm, nm, fs, zs, t.q1o + lo);
  t.a2o[b] = quantize_block_avx2(v, len, xv, nv, fu, zu, t.q2o + lo);
}

/// div_rn8 for 16 lanes.
KILN_AVX512 inline __m512 div_rn16(__m512 a, __m512 b, __m512 y) {
  const __m512 q = _mm512_mul_ps(a, y);
  return _mm512_fmadd_ps(_mm512_fnmadd_ps(q, b, a), y, q);
}

/// Whether quantize_block_avx512 takes its reciprocal fast path for a block with this
/// absmax: all finite with a positive absmax, the packed table, and absmax in div_rn8's
/// exact range (also the loop the 8-bit update runs for both moments at once).
inline bool quantize_fast_path(const CodeFinder& code, float mx, bool any_nan) {
  return !any_nan && mx > 0.f && std::isfinite(mx) && code.has_packed() && code.recip_ok() && mx >= 0x1p-60f &&
         mx <= 0x1p60f;
}

/// The fast path's codes of x[0..16) / d (y = RN(1 / d)) to out[0..16); kNonneg: every x
/// is >= +0 (CodeFinder::codes16_nonneg).
template <bool kNonneg>
KILN_AVX512 inline void requantize16(const CodeFinder& code, const float* x, __m512 d, __m512 y, uint8_t* out) {
  const __m512 q = div_rn16(_mm512_loadu_ps(x), d, y);
  _mm_storeu_si128(reinterpret_cast<__m128i*>(out),
                   _mm512_cvtepi32_epi8(kNonneg ? code.codes16_nonneg(q) : code.codes16(q)));
}

/// quantize_block_avx2 with 16 lanes (gathered packed entries), bit-identical to it.
/// nonneg: the caller knows every x of the vector part is >= +0 (CodeFinder::codes16_nonneg).
KILN_AVX512 float quantize_block_avx512(const float* x, int64_t n, float mx, bool any_nan, const CodeFinder& code,
                                        uint8_t zero_code, uint8_t* codes, bool nonneg = false) {
  if (any_nan || !(mx > 0.f && std::isfinite(mx)) || !code.has_packed())
    return quantize_block_avx2(x, n, mx, any_nan, code, zero_code, codes);
  const __m512 d = _mm512_set1_ps(mx);
  int64_t i = 0;
  if (quantize_fast_path(code, mx, any_nan)) {
    const __m512 y = _mm512_set1_ps(1.f / mx);
    for (; i + 16 <= n; i += 16)
      nonneg ? requantize16<true>(code, x + i, d, y, codes + i) : requantize16<false>(code, x + i, d, y, codes + i);
  }
  for (; i + 16 <= n; i += 16)
    _mm_storeu_si128(reinterpret_cast<__m128i*>(codes + i),
                     _mm512_cvtepi32_epi8(code.codes16(_mm512_div_ps(_mm512_loadu_ps(x + i), d))));
  for (; i < n; ++i) codes[i] = code(x[i] / mx);
  return mx;
}

/// map[code[0..16)] as 16 floats (one gather from the 1 KiB map). A gather merges into its
/// destination register, so it waits for that register's last writer; GCC's gather
/// intrinsics (also the masked ones with a zero source and a full mask, which it folds)
/// leave the register to the allocator, which picked ones that the previous iteration's
/// square root or division wrote: a false loop-carried dependency through the divider.
/// A zero source with a mask GCC cannot see is all ones (opaque_all_lanes) makes it
/// write a zero (or copy one) to the destination first, which breaks the dependency.
KILN_AVX512 inline __m512 lookup16(const float* map, const uint8_t* code) {
  return _mm512_mask_i32gather_ps(_mm512_setzero_ps(), opaque_all_lanes(),
                                  _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(code))), map,
                                  4);
}

/// out[i] = div_rn16(a[i], b, RN(1 / b)) for n elements (n a multiple of 16); test hook.
KILN_AVX512 void divide_by_reciprocal_avx512(const float* a, float b, float* out, int64_t n) {
  const __m512 bb = _mm512_set1_ps(b), y = _mm512_set1_ps(1.f / b);
  for (int64_t i = 0; i + 16 <= n; i += 16) _mm512_storeu_ps(out + i, div_rn16(_mm512_loadu_ps(a + i), bb, y));
}

/// adam8bit_block_avx2 with 16 lanes, bit-identical to it (the same f32 operations in the
/// same order; absmax as max over lanes with NaN lanes tracked in a mask).
KILN_AVX512 void adam8bit_block_avx512(const AdamConsts& k, const AdamBuffers& t, int64_t b, int64_t lo, int64_t len,
                                       const CodeFinder& fs, const CodeFinder& fu, uint8_t zs, uint8_t zu, float* m,
                                       float* v) {
  const float am = t.a1[b], av = t.a2[b];
  const __m512 am16 = _mm512_set1_ps(am), av16 = _mm512_set1_ps(av);
  const __m512 b1 = _mm512_set1_ps(k.b1), omb1 = _mm512_set1_ps(k.omb1), b2 = _mm512_set1_ps(k.b2),
               omb2 = _mm512_set1_ps(k.omb2), eps = _mm512_set1_ps(k.eps), lr_wd = _mm512_set1_ps(k.lr_wd),
               ss = _mm512_set1_ps(k.step_size), sbc2 = _mm512_set1_ps(k.sqrt_bc2), coef = _mm512_set1_ps(k.coef);
  const bool clip = k.clip, decay = k.decay;
  const bool recip_bc2 = k.sqrt_bc2 >= 0x1p-60f && k.sqrt_bc2 <= 1.f;
  const __m512 rbc2 = _mm512_set1_ps(1.f / k.sqrt_bc2);
  // max |m'| and |v'| as unsigned integers: for non-negative floats the integer order is
  // the float order, and a NaN's bits exceed +inf's, so one VPMAXUD per moment finds both
  // the absmax and whether a NaN occurred (MAXPS and a NaN compare took four vector uops).
  // v' is taken with its sign bit: a negative v' (only from a map with negative entries)
  // also sends the block to quantize_block, so the others may use codes16_nonneg.
  __m512i mx_m = _mm512_setzero_si512(), mx_v = _mm512_setzero_si512();
  const __m512i abs_bits = _mm512_set1_epi32(0x7fffffff);
  const float* pp = t.p + lo;  // may alias po (kiln_donate): each element read before written
  const float* __restrict gp = t.g + lo;
  const uint8_t* q1 = t.q1 + lo;  // may alias t.q1o (kiln_donate): written only after this loop
  const uint8_t* q2 = t.q2 + lo;
  const float* qs = t.qs;
  const float* qu = t.qu;
  float* po = t.po + lo;
  int64_t j = 0;
  for (; j + 16 <= len; j += 16) {
    const __m512 mo = _mm512_mul_ps(lookup16(qs, q1 + j), am16);
    const __m512 vo = _mm512_mul_ps(lookup16(qu, q2 + j), av16);
    __m512 gr = _mm512_loadu_ps(gp + j);
    if (clip) gr = _mm512_mul_ps(gr, coef);
    __m512 p = _mm512_loadu_ps(pp + j);
    if (decay) p = _mm512_sub_ps(p, _mm512_mul_ps(p, lr_wd));
    const __m512 mn = _mm512_add_ps(_mm512_mul_ps(mo, b1), _mm512_mul_ps(gr, omb1));
    const __m512 vn = _mm512_add_ps(_mm512_mul_ps(vo, b2), _mm512_mul_ps(_mm512_mul_ps(gr, gr), omb2));
    const __m512 s = _mm512_sqrt_ps(vn);
    __m512 sq;
    if (recip_bc2) {
      const __m512 q = _mm512_mul_ps(s, rbc2), r = _mm512_fnmadd_ps(q, sbc2, s);
      // A NaN residual (s infinite or NaN) keeps the product, which is then the quotient.
      sq = _mm512_mask_blend_ps(_mm512_cmp_ps_mask(r, r, _CMP_UNORD_Q), _mm512_fmadd_ps(r, rbc2, q), q);
    } else {
      sq = _mm512_div_ps(s, sbc2);
    }
    const __m512 denom = _mm512_add_ps(sq, eps);
    _mm512_storeu_ps(po + j, _mm512_sub_ps(p, _mm512_mul_ps(ss, _mm512_div_ps(mn, denom))));
    _mm512_storeu_ps(m + j, mn);
    _mm512_storeu_ps(v + j, vn);
    mx_m = _mm512_max_epu32(mx_m, _mm512_and_si512(_mm512_castps_si512(mn), abs_bits));
    mx_v = _mm512_max_epu32(mx_v, _mm512_castps_si512(vn));
  }
  const uint32_t bm = _mm512_reduce_max_epu32(mx_m), bv = _mm512_reduce_max_epu32(mx_v);
  bool nm = bm > 0x7f800000u, nv = bv > 0x7f800000u;  // NaN (v': or < +0): quantize_block
  float xm = 0.f, xv = 0.f;
  if (!nm) std::memcpy(&xm, &bm, 4);
  if (!nv) std::memcpy(&xv, &bv, 4);
  adam8bit_tail(k, t, b, lo, j, len, m, v, xm, xv, nm, nv);
  if (len % 16 == 0 && quantize_fast_path(fs, xm, nm) && quantize_fast_path(fu, xv, nv)) {
    // Both moments in one loop (quantize_block_avx512's fast path, interleaved).
    const __m512 dm = _mm512_set1_ps(xm), ym = _mm512_set1_ps(1.f / xm);
    const __m512 dv = _mm512_set1_ps(xv), yv = _mm512_set1_ps(1.f / xv);
    for (int64_t i = 0; i < len; i += 16) {
      requantize16<false>(fs, m + i, dm, ym, t.q1o + lo + i);
      requantize16<true>(fu, v + i, dv, yv, t.q2o + lo + i);
    }
    t.a1o[b] = xm, t.a2o[b] = xv;
    return;
  }
  t.a1o[b] = quantize_block_avx512(m, len, xm, nm, fs, zs, t.q1o + lo);
  t.a2o[b] = quantize_block_avx512(v, len, xv, nv, fu, zu, t.q2o + lo, /*nonneg=*/true);
}
#endif

/// Quantizes one block (quantize_block), by AVX-512 or AVX2 where the CPU has it.
/// nonneg: as quantize_block_avx512's (the AVX-512 path only).
inline float quantize_block_fast(const float* x, int64_t n, const CodeFinder& code, uint8_t zero_code, uint8_t* codes,
                                 bool nonneg = false) {
#if defined(__x86_64__)
  if (const int isa = isa_level(); isa >= 1) {
    bool nan = false;
    const float mx = block_absmax_avx2(x, n, &nan);
    return isa == 2 ? quantize_block_avx512(x, n, mx, nan, code, zero_code, codes, nonneg)
                    : quantize_block_avx2(x, n, mx, nan, code, zero_code, codes);
  }
#endif
  return quantize_block(x, n, code, zero_code, codes);
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
    absmax[b] = quantize_block_fast(xp + lo, len, finder, zero, codes + lo);
  }
  return Status::ok();
}

/// Blocks of 256 elements per piece of a multi-tensor launch (16 KiB of parameters).
constexpr int64_t kBlocksPerPiece = 16;

/// The AdamW8bitUpdate call as pieces of kBlocksPerPiece blocks (ir::KernelPieces): the
/// checks, constants and pointers once, then any piece on any thread (each thread keeps
/// its own m, v scratch of one block).
Expected<ir::KernelPieces> adamw8bit_pieces(KernelContext& c) {
  const Tensor& p = c.in(0);
  const Tensor& g = c.in(1);
  KILN_RETURN_IF_ERROR(check_qmap(c, c.in(6), "qmap_signed"));
  KILN_RETURN_IF_ERROR(check_qmap(c, c.in(7), "qmap_unsigned"));
  const int64_t n = p.numel(), bs = blocksize(c), nb = ir::num_blocks_8bit(n, bs);
  if (g.numel() != n || c.in(2).numel() != n || c.in(4).numel() != n || c.in(3).numel() != nb || c.in(5).numel() != nb)
    return c.fail("state sizes do not match the parameter's " + std::to_string(n) + " elements");
  AdamConsts k{};
  const float lr = c.in(8).data<float>()[0];
  k.step_size = c.in(9).data<float>()[0];
  k.sqrt_bc2 = c.in(10).data<float>()[0];
  k.clip = c.has_input(11);
  k.coef = k.clip ? c.in(11).data<float>()[0] : 1.f;
  // Constants rounded to f32 exactly as the adamw_torch IR's scalar initializers are.
  const double b1d = c.attrs().get_float("beta1", 0.9), b2d = c.attrs().get_float("beta2", 0.999);
  k.b1 = static_cast<float>(b1d), k.omb1 = static_cast<float>(1.0 - b1d);
  k.b2 = static_cast<float>(b2d), k.omb2 = static_cast<float>(1.0 - b2d);
  k.eps = static_cast<float>(c.attrs().get_float("eps", 1e-8));
  const double wd = c.attrs().get_float("weight_decay", 0.0);
  k.decay = wd != 0.0;
  k.lr_wd = lr * static_cast<float>(wd);  // Mul(lr, C(wd)) of the fp32 graph
  const float* qs = c.in(6).data<float>();
  const float* qu = c.in(7).data<float>();
  const uint8_t zero_s = ir::nearest_code(qs, 0.f), zero_u = ir::nearest_code(qu, 0.f);
  const CodeFinder* find_s = &CodeFinder::get(qs);
  const CodeFinder* find_u = &CodeFinder::get(qu);
  const AdamBuffers t{p.data<float>(),
                      g.data<float>(),
                      c.in(3).data<float>(),
                      c.in(5).data<float>(),
                      qs,
                      qu,
                      c.in(2).data<uint8_t>(),
                      c.in(4).data<uint8_t>(),
                      c.out(0).data<float>(),
                      c.out(2).data<float>(),
                      c.out(4).data<float>(),
                      c.out(1).data<uint8_t>(),
                      c.out(3).data<uint8_t>()};
  const int isa = isa_level();
  ir::KernelPieces pieces;
  pieces.count = (nb + kBlocksPerPiece - 1) / kBlocksPerPiece;
  pieces.run = [=](int64_t piece) {
    thread_local std::vector<float> m, v;  // one block of new moments before requantization
    if (static_cast<int64_t>(m.size()) < bs) m.resize(static_cast<size_t>(bs)), v.resize(static_cast<size_t>(bs));
    const int64_t b_end = std::min(nb, (piece + 1) * kBlocksPerPiece);
    for (int64_t b = piece * kBlocksPerPiece; b < b_end; ++b) {
      const int64_t lo = b * bs, len = std::min(bs, n - lo);
#if defined(__x86_64__)
      if (isa == 2) {
        adam8bit_block_avx512(k, t, b, lo, len, *find_s, *find_u, zero_s, zero_u, m.data(), v.data());
        continue;
      }
      if (isa == 1) {
        adam8bit_block_avx2(k, t, b, lo, len, *find_s, *find_u, zero_s, zero_u, m.data(), v.data());
        continue;
      }
#endif
      adam8bit_block(k, t, b, lo, len, *find_s, *find_u, zero_s, zero_u, m.data(), v.data());
    }
  };
  return pieces;
}

Status adamw8bit_kernel(KernelContext& c) {
  KILN_ASSIGN_OR_RETURN(ir::KernelPieces pieces, adamw8bit_pieces(c));
  const int64_t elements = c.in(0).numel();
#pragma omp parallel for schedule(dynamic, 1) if (elements >= (1 << 16) && pieces.count > 1)
  for (int64_t piece = 0; piece < pieces.count; ++piece) pieces.run(piece);
  return Status::ok();
}

}  // namespace

namespace optim8bit_testing {

int set_max_isa(int level) { return g_max_isa.exchange(std::clamp(level, 0, 2)); }

int active_isa() { return isa_level(); }

bool divide_by_reciprocal(const float* a, float b, float* out, int64_t n) {
#if defined(__x86_64__)
  const int isa = isa_level();
  if (isa == 2) divide_by_reciprocal_avx512(a, b, out, n);
  if (isa == 1) divide_by_reciprocal_avx2(a, b, out, n);
  return isa >= 1;
#else
  return false;
#endif
}

bool quantize_nonneg(const float* x, int64_t n, const float* qmap, uint8_t* codes, float* absmax) {
  if (isa_level() < 2) return false;
  const CodeFinder& finder = CodeFinder::get(qmap);
  const uint8_t zero = ir::nearest_code(qmap, 0.f);
  for (int64_t lo = 0, b = 0; lo < n; lo += ir::kBlockSize8bit, ++b)
    absmax[b] = quantize_block_fast(x + lo, std::min<int64_t>(ir::kBlockSize8bit, n - lo), finder, zero, codes + lo,
                                    /*nonneg=*/true);
  return true;
}

}  // namespace optim8bit_testing

void register_optim8bit_kernels(ir::OpTable& t) {
  // Each writes every code, absmax, value and parameter of its outputs: no zero fill.
  set_kernel_writing_all_outputs(t, "BlockwiseQuantize8bit", quantize_kernel);
  set_kernel_writing_all_outputs(t, "BlockwiseDequantize8bit", dequantize_kernel);
  set_kernel_writing_all_outputs(t, "AdamW8bitUpdate", adamw8bit_kernel);
  t.find_mutable("AdamW8bitUpdate")->pieces = adamw8bit_pieces;
  // OpDef::in_place_outputs of AdamW8bitUpdate (ir/ops/optim8bit.cpp) holds for these
  // kernels: per block, the parameter element by element (read, then written), both
  // moments' codes and absmax read in the update loop and written only by the
  // requantization after it.
}

}  // namespace kiln::runtime::kernels
