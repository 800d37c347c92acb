// Eager kernels: elementwise ops (ONNX semantics, see ir/ops/elementwise.cpp).
// Floats are computed in f32 (f32, bf16, f16) or f64 (f64) and stored with
// round-to-nearest-even; integers in their own type. Binary ops broadcast with
// numpy rules through for_each_strided (util.h); loops use OpenMP when large.
#include <omp.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstring>
#include <type_traits>

#if defined(__x86_64__)
#include <immintrin.h>
// GCC 12's AVX-512 intrinsics start some results from _mm512_undefined_*() and then
// warn, where inlined, that the undefined value is used (a false positive).
#pragma GCC diagnostic ignored "-Wuninitialized"
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#endif

#include "runtime/kernels/kernels.h"
#include "runtime/kernels/util.h"

namespace kiln::runtime::kernels {

using ir::DType;
using ir::KernelContext;
using ir::KernelFn;
using ir::Tensor;

namespace {

/// y[i] = f(x[i]) for the dtypes selected by the flags.
template <bool Ints, typename F>
KernelFn unary_kernel(F f) {
  return [f](KernelContext& c) -> Status {
    const Tensor& x = c.in(0);
    Tensor& y = c.out(0);
    return dispatch<true, Ints, false>(c, x.dtype(), [&](auto tag) {
      using T = decltype(tag);
      using C = compute_t<T>;
      const T* a = x.data<T>();
      T* o = y.data<T>();
      const int64_t n = x.numel();
#pragma omp parallel for schedule(static) if (n >= kParallelThreshold)
      for (int64_t i = 0; i < n; ++i) o[i] = store<T>(static_cast<C>(f(load(a[i]))));
    });
  };
}

/// out[o] = f(a[ia], b[ib]) with numpy broadcasting; f returns the output storage value.
template <typename TA, typename TB, typename TO, typename F>
void binary_loop(const Tensor& a, const Tensor& b, Tensor& out, F f) {
  const TA* pa = a.data<TA>();
  const TB* pb = b.data<TB>();
  TO* po = out.data<TO>();
  const auto& od = out.dims();
  const int64_t n = out.numel();
  if (a.dims() == od && b.dims() == od) {
#pragma omp parallel for schedule(static) if (n >= kParallelThreshold)
    for (int64_t i = 0; i < n; ++i) po[i] = f(load(pa[i]), load(pb[i]));
    return;
  }
  if (a.dims() == od && b.numel() == 1) {
    auto bv = load(pb[0]);
#pragma omp parallel for schedule(static) if (n >= kParallelThreshold)
    for (int64_t i = 0; i < n; ++i) po[i] = f(load(pa[i]), bv);
    return;
  }
  for_each_strided<2>(
      od, {broadcast_strides(a.dims(), od), broadcast_strides(b.dims(), od)},
      [&](int64_t o, const std::array<int64_t, 2>& off) { po[o] = f(load(pa[off[0]]), load(pb[off[1]])); });
}

/// Same-dtype binary arithmetic: out = f(a, b) in the compute type.
template <typename F>
KernelFn arith_kernel(F f) {
  return [f](KernelContext& c) -> Status {
    return dispatch_numeric(c, c.in(0).dtype(), [&](auto tag) {
      using T = decltype(tag);
      using C = compute_t<T>;
      binary_loop<T, T, T>(c.in(0), c.in(1), c.out(0), [&](C x, C y) { return store<T>(static_cast<C>(f(x, y))); });
    });
  };
}

/// Comparison: bool out = f(a, b).
template <bool Bools, typename F>
KernelFn compare_kernel(F f) {
  return [f](KernelContext& c) -> Status {
    return dispatch<true, true, Bools>(c, c.in(0).dtype(), [&](auto tag) {
      using T = decltype(tag);
      using C = compute_t<T>;
      binary_loop<T, T, bool_t>(c.in(0), c.in(1), c.out(0), [&](C x, C y) { return bool_t{uint8_t(f(x, y) ? 1 : 0)}; });
    });
  };
}

template <typename F>
KernelFn logic_kernel(F f) {
  return [f](KernelContext& c) -> Status {
    if (c.in(0).dtype() != DType::boolean || c.in(1).dtype() != DType::boolean) return c.fail("expects bool inputs");
    binary_loop<bool_t, bool_t, bool_t>(c.in(0), c.in(1), c.out(0),
                                        [&](bool x, bool y) { return bool_t{uint8_t(f(x, y) ? 1 : 0)}; });
    return Status::ok();
  };
}

/// Integer power by squaring with ONNX/numpy-compatible negative exponents (truncated).
template <typename C>
C int_pow(C base, int64_t e) {
  if (e < 0) {
    if (base == 1) return 1;
    if (base == static_cast<C>(-1)) return (e % 2) ? static_cast<C>(-1) : 1;
    return 0;
  }
  C r = 1;
  while (e) {
    if (e & 1) r = static_cast<C>(r * base);
    base = static_cast<C>(base * base);
    e >>= 1;
  }
  return r;
}

Status pow_kernel(KernelContext& c) {
  const Tensor& a = c.in(0);
  const Tensor& b = c.in(1);
  Status inner = Status::ok();
  Status outer = dispatch_numeric(c, a.dtype(), [&](auto ta) {
    using T = decltype(ta);
    using C = compute_t<T>;
    inner = dispatch_numeric(c, b.dtype(), [&](auto tb) {
      using E = decltype(tb);
      using CE = compute_t<E>;
      binary_loop<T, E, T>(a, b, c.out(0), [](C x, CE e) {
        T r;
        if constexpr (is_float_v<T>)
          r = store<T>(static_cast<C>(std::pow(x, static_cast<C>(e))));
        else if constexpr (std::is_integral_v<CE>)
          r = int_pow<C>(x, static_cast<int64_t>(e));
        else
          r = convert<T>(std::pow(static_cast<double>(x), static_cast<double>(e)));
        return r;
      });
    });
  });
  KILN_RETURN_IF_ERROR(outer);
  return inner;
}

/// Variadic Max/Min: out = fold(pick) over all inputs with broadcasting; NaN propagates for floats.
template <bool IsMax>
Status minmax_kernel(KernelContext& c) {
  Tensor& out = c.out(0);
  const auto& od = out.dims();
  for (int i = 0; i < static_cast<int>(c.inputs.size()); ++i)
    if (!c.has_input(i) || c.in(i).dtype() != out.dtype()) return c.fail("inputs must all be present with one dtype");
  return dispatch_numeric(c, out.dtype(), [&](auto tag) {
    using T = decltype(tag);
    using C = compute_t<T>;
    T* po = out.data<T>();
    const Tensor& x0 = c.in(0);
    strided_copy(po, x0.raw(), sizeof(T), od, broadcast_strides(x0.dims(), od), 0);
    for (size_t k = 1; k < c.inputs.size(); ++k) {
      const Tensor& xk = c.in(static_cast<int>(k));
      const T* pk = xk.data<T>();
      for_each_strided<1>(od, {broadcast_strides(xk.dims(), od)}, [&](int64_t o, const std::array<int64_t, 1>& off) {
        C acc = load(po[o]);
        C v = load(pk[off[0]]);
        C r;
        if constexpr (is_float_v<T>) {
          if (std::isnan(acc) || std::isnan(v))
            r = std::numeric_limits<C>::quiet_NaN();
          else
            r = IsMax ? std::max(acc, v) : std::min(acc, v);
        } else {
          r = IsMax ? std::max(acc, v) : std::min(acc, v);
        }
        po[o] = store<T>(r);
      });
    }
  });
}

Status clip_kernel(KernelContext& c) {
  const Tensor& x = c.in(0);
  return dispatch_numeric(c, x.dtype(), [&](auto tag) {
    using T = decltype(tag);
    using C = compute_t<T>;
    C lo = std::numeric_limits<C>::lowest(), hi = std::numeric_limits<C>::max();
    if constexpr (is_float_v<T>) {
      lo = -std::numeric_limits<C>::infinity();
      hi = std::numeric_limits<C>::infinity();
    }
    if (c.has_input(1) && c.in(1).numel() > 0)
      lo = load(c.in(1).data<T>()[0]);
    else if (c.attrs().has("min"))
      lo = static_cast<C>(c.attrs().get_float("min", 0));
    if (c.has_input(2) && c.in(2).numel() > 0)
      hi = load(c.in(2).data<T>()[0]);
    else if (c.attrs().has("max"))
      hi = static_cast<C>(c.attrs().get_float("max", 0));
    const T* a = x.data<T>();
    T* o = c.out(0).data<T>();
    const int64_t n = x.numel();
#pragma omp parallel for schedule(static) if (n >= kParallelThreshold)
    for (int64_t i = 0; i < n; ++i) {
      C v = load(a[i]);
      C r = v < lo ? lo : v;
      r = r > hi ? hi : r;
      o[i] = store<T>(r);
    }
  });
}

Status where_kernel(KernelContext& c) {
  const Tensor& cond = c.in(0);
  if (cond.dtype() != DType::boolean) return c.fail("condition must be bool");
  Tensor& out = c.out(0);
  const auto& od = out.dims();
  return dispatch_all(c, out.dtype(), [&](auto tag) {
    using T = decltype(tag);
    const uint8_t* pc = cond.data<uint8_t>();
    const T* px = c.in(1).data<T>();
    const T* py = c.in(2).data<T>();
    T* po = out.data<T>();
    for_each_strided<3>(
        od,
        {broadcast_strides(cond.dims(), od), broadcast_strides(c.in(1).dims(), od),
         broadcast_strides(c.in(2).dims(), od)},
        [&](int64_t o, const std::array<int64_t, 3>& off) { po[o] = pc[off[0]] ? px[off[1]] : py[off[2]]; });
  });
}

/// Converts src into dst (same numel) with ONNX Cast semantics.
Status cast_into(KernelContext& c, const Tensor& src, Tensor& dst) {
  if (src.dtype() == dst.dtype()) {
    if (src.nbytes()) std::memcpy(dst.raw(), src.raw(), src.nbytes());
    return Status::ok();
  }
  Status inner = Status::ok();
  Status outer = dispatch_all(c, src.dtype(), [&](auto ts) {
    using S = decltype(ts);
    inner = dispatch_all(c, dst.dtype(), [&](auto td) {
      using D = decltype(td);
      const S* ps = src.data<S>();
      D* pd = dst.data<D>();
      const int64_t n = src.numel();
#pragma omp parallel for schedule(static) if (n >= kParallelThreshold)
      for (int64_t i = 0; i < n; ++i) pd[i] = convert<D>(load(ps[i]));
    });
  });
  KILN_RETURN_IF_ERROR(outer);
  return inner;
}

Status copy_kernel(KernelContext& c) {
  const Tensor& x = c.in(0);
  if (x.nbytes()) std::memcpy(c.out(0).raw(), x.raw(), x.nbytes());
  return Status::ok();
}

#if defined(__x86_64__)
/// AVX2 Dropout for f32 and bf16, the same bits as the portable path below: Philox4x32-10 on 32
/// blocks at once (4 interleaved vectors of 8 blocks, so that the multiplies of
/// independent rounds overlap), the 32x32->64 products as two vpmuludq on even and odd
/// lanes, the four words of 8 blocks transposed into element order, keep = (bits >> 8)
/// >= thr, the kept elements x * s and the dropped ones +0 (a bitwise and-not), the mask
/// as bytes. bf16 elements are widened to f32 (a 16-bit shift), scaled in f32 and rounded
/// back to nearest even with NaN kept quiet, as ir::f32_to_bf16. Handles groups [g0, g1)
/// of kDropoutGroup elements each.
constexpr int64_t kDropoutGroup = 128;

/// hi:lo = x * m per 32-bit lane (8 lanes): vpmuludq on the even lanes, then the odd ones.
__attribute__((target("avx2"))) inline void mul32(__m256i x, __m256i m, __m256i& hi, __m256i& lo) {
  const __m256i pe = _mm256_mul_epu32(x, m);                         // lanes 0, 2, 4, 6
  const __m256i po = _mm256_mul_epu32(_mm256_srli_epi64(x, 32), m);  // lanes 1, 3, 5, 7
  lo = _mm256_blend_epi32(pe, _mm256_slli_epi64(po, 32), 0xAA);
  hi = _mm256_blend_epi32(_mm256_srli_epi64(pe, 32), po, 0xAA);
}

template <typename T>
__attribute__((target("avx2"))) void dropout_avx2(const T* a, T* o, uint8_t* pm, int64_t g0, int64_t g1, uint64_t seed,
                                                  uint64_t sub, uint64_t offset, uint32_t thr, float s) {
  constexpr int NV = 4;
  const __m256i M0 = _mm256_set1_epi32(static_cast<int>(kPhiloxM0));
  const __m256i M1 = _mm256_set1_epi32(static_cast<int>(kPhiloxM1));
  const __m256i iota = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
  const __m256i sign = _mm256_set1_epi32(static_cast<int>(0x80000000u));
  const __m256i thr_v = _mm256_set1_epi32(static_cast<int>(thr ^ 0x80000000u));
  const __m256i one = _mm256_set1_epi32(1);
  const __m256 s_v = _mm256_set1_ps(s);
  for (int64_t g = g0; g < g1; ++g) {
    const int64_t base = g * kDropoutGroup;
    // Blocks base/4 .. base/4 + 31; base/4 is a multiple of 32, so the low counter word
    // of 8 consecutive blocks never carries into the high one.
    __m256i c0[NV], c1[NV], c2[NV], c3[NV];
    for (int v = 0; v < NV; ++v) {
      const uint64_t b = static_cast<uint64_t>(base / 4) + 8u * v;
      c0[v] = _mm256_add_epi32(_mm256_set1_epi32(static_cast<int>(static_cast<uint32_t>(b))), iota);
      c1[v] = _mm256_set1_epi32(static_cast<int>(static_cast<uint32_t>(b >> 32)));
      c2[v] = _mm256_set1_epi32(static_cast<int>(static_cast<uint32_t>(offset)));
      c3[v] = _mm256_set1_epi32(static_cast<int>(static_cast<uint32_t>(sub)));
    }
    uint32_t k0 = static_cast<uint32_t>(seed), k1 = static_cast<uint32_t>(seed >> 32);
    for (int round = 0; round < 10; ++round) {
      const __m256i K0 = _mm256_set1_epi32(static_cast<int>(k0)), K1 = _mm256_set1_epi32(static_cast<int>(k1));
      for (int v = 0; v < NV; ++v) {
        __m256i h0, l0, h1, l1;
        mul32(c0[v], M0, h0, l0);
        mul32(c2[v], M1, h1, l1);
        const __m256i n0 = _mm256_xor_si256(_mm256_xor_si256(h1, c1[v]), K0);
        const __m256i n2 = _mm256_xor_si256(_mm256_xor_si256(h0, c3[v]), K1);
        c1[v] = l1;
        c3[v] = l0;
        c0[v] = n0;
        c2[v] = n2;
      }
      k0 += kPhiloxW0;
      k1 += kPhiloxW1;
    }
    for (int v = 0; v < NV; ++v) {
      // Word w of blocks 0..7 is in c_w; element 4 * block + word: a 4 x 8 transpose.
      const __m256i t0 = _mm256_unpacklo_epi32(c0[v], c1[v]), t1 = _mm256_unpackhi_epi32(c0[v], c1[v]);
      const __m256i t2 = _mm256_unpacklo_epi32(c2[v], c3[v]), t3 = _mm256_unpackhi_epi32(c2[v], c3[v]);
      const __m256i u0 = _mm256_unpacklo_epi64(t0, t2), u1 = _mm256_unpackhi_epi64(t0, t2);
      const __m256i u2 = _mm256_unpacklo_epi64(t1, t3), u3 = _mm256_unpackhi_epi64(t1, t3);
      const __m256i e[4] = {_mm256_permute2x128_si256(u0, u1, 0x20), _mm256_permute2x128_si256(u2, u3, 0x20),
                            _mm256_permute2x128_si256(u0, u1, 0x31), _mm256_permute2x128_si256(u2, u3, 0x31)};
      for (int q = 0; q < 4; ++q) {
        const int64_t at = base + 32 * v + 8 * q;
        // keep = (bits >> 8) >= thr, unsigned, as a signed compare of sign-flipped values.
        const __m256i top = _mm256_xor_si256(_mm256_srli_epi32(e[q], 8), sign);
        const __m256i drop = _mm256_cmpgt_epi32(thr_v, top);
        const __m256 y = _mm256_andnot_ps(_mm256_castsi256_ps(drop), _mm256_mul_ps(load8_f32(a + at), s_v));
        store8_f32(o + at, y);
        if (pm) {
          const __m256i keep = _mm256_andnot_si256(drop, one);
          const __m128i k16 = _mm_packs_epi32(_mm256_castsi256_si128(keep), _mm256_extracti128_si256(keep, 1));
          _mm_storel_epi64(reinterpret_cast<__m128i*>(pm + at), _mm_packus_epi16(k16, k16));
        }
      }
    }
  }
}

#define KILN_DROPOUT_AVX512 __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq")))

bool cpu_has_avx512() {
  static const bool yes = cpu_has_avx2() && __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
                          __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq");
  return yes;
}

/// Highest Dropout path (0 portable, 1 AVX2, 2 AVX-512); dropout_testing lowers it.
std::atomic<int> g_dropout_max_isa{2};

/// hi:lo = x * m per 32-bit lane (16 lanes): vpmuludq on the even lanes and on the odd
/// ones (shifted down), the halves merged by two dword permutes.
KILN_DROPOUT_AVX512 inline void mul32x16(__m512i x, __m512i m, __m512i& hi, __m512i& lo) {
  const __m512i pe = _mm512_mul_epu32(x, m);                         // lanes 0, 2, ...: 64-bit products
  const __m512i po = _mm512_mul_epu32(_mm512_srli_epi64(x, 32), m);  // lanes 1, 3, ...
  // dword 2i of pe is lo(lane 2i), 2i + 1 is hi(lane 2i); the same for po and lane 2i + 1.
  const __m512i lo_idx = _mm512_setr_epi32(0, 16, 2, 18, 4, 20, 6, 22, 8, 24, 10, 26, 12, 28, 14, 30);
  const __m512i hi_idx = _mm512_setr_epi32(1, 17, 3, 19, 5, 21, 7, 23, 9, 25, 11, 27, 13, 29, 15, 31);
  lo = _mm512_permutex2var_epi32(pe, lo_idx, po);
  hi = _mm512_permutex2var_epi32(pe, hi_idx, po);
}

/// dropout_avx2 with 16 blocks per vector (AVX-512), the same bits: NV vectors of 16
/// blocks (NV / 2 kDropoutGroup groups from element `base`) at once, so that the
/// multiplies of independent rounds overlap; the Philox xors are one vpternlogd each,
/// the 4 x 16 transpose unpacks in 128-bit lanes then moves the lanes, keep is a mask
/// register (dropped elements +0 by a zero-masked multiply).
template <typename T, int NV>
KILN_DROPOUT_AVX512 inline void dropout_avx512_vectors(const T* a, T* o, uint8_t* pm, int64_t base, uint64_t seed,
                                                       uint64_t sub, uint64_t offset, uint32_t thr, float s) {
  const __m512i M0 = _mm512_set1_epi32(static_cast<int>(kPhiloxM0));
  const __m512i M1 = _mm512_set1_epi32(static_cast<int>(kPhiloxM1));
  const __m512i iota = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
  const __m512i thr_v = _mm512_set1_epi32(static_cast<int>(thr));
  const __m512 s_v = _mm512_set1_ps(s);
  const __m128i ones = _mm_set1_epi8(1);
  // Blocks base/4 .. base/4 + 16 NV - 1; base/4 is a multiple of 32, so the low counter
  // word of 16 consecutive blocks never carries into the high one.
  __m512i c0[NV], c1[NV], c2[NV], c3[NV];
  for (int v = 0; v < NV; ++v) {
    const uint64_t b = static_cast<uint64_t>(base / 4) + 16u * v;
    c0[v] = _mm512_add_epi32(_mm512_set1_epi32(static_cast<int>(static_cast<uint32_t>(b))), iota);
    c1[v] = _mm512_set1_epi32(static_cast<int>(static_cast<uint32_t>(b >> 32)));
    c2[v] = _mm512_set1_epi32(static_cast<int>(static_cast<uint32_t>(offset)));
    c3[v] = _mm512_set1_epi32(static_cast<int>(static_cast<uint32_t>(sub)));
  }
  uint32_t k0 = static_cast<uint32_t>(seed), k1 = static_cast<uint32_t>(seed >> 32);
  for (int round = 0; round < 10; ++round) {
    const __m512i K0 = _mm512_set1_epi32(static_cast<int>(k0)), K1 = _mm512_set1_epi32(static_cast<int>(k1));
    for (int v = 0; v < NV; ++v) {
      __m512i h0, l0, h1, l1;
      mul32x16(c0[v], M0, h0, l0);
      mul32x16(c2[v], M1, h1, l1);
      const __m512i n0 = _mm512_ternarylogic_epi32(h1, c1[v], K0, 0x96);  // h1 ^ c1 ^ K0
      const __m512i n2 = _mm512_ternarylogic_epi32(h0, c3[v], K1, 0x96);  // h0 ^ c3 ^ K1
      c1[v] = l1;
      c3[v] = l0;
      c0[v] = n0;
      c2[v] = n2;
    }
    k0 += kPhiloxW0;
    k1 += kPhiloxW1;
  }
  for (int v = 0; v < NV; ++v) {
    // Word w of blocks 0..15 is in c_w; element 4 * block + w. In each 128-bit lane L,
    // u_k holds the 4 words of block 4L + k; output vector q is lane q of u0..u3.
    const __m512i t0 = _mm512_unpacklo_epi32(c0[v], c1[v]), t1 = _mm512_unpackhi_epi32(c0[v], c1[v]);
    const __m512i t2 = _mm512_unpacklo_epi32(c2[v], c3[v]), t3 = _mm512_unpackhi_epi32(c2[v], c3[v]);
    const __m512i u0 = _mm512_unpacklo_epi64(t0, t2), u1 = _mm512_unpackhi_epi64(t0, t2);
    const __m512i u2 = _mm512_unpacklo_epi64(t1, t3), u3 = _mm512_unpackhi_epi64(t1, t3);
    const __m512i s01lo = _mm512_shuffle_i32x4(u0, u1, 0x44), s23lo = _mm512_shuffle_i32x4(u2, u3, 0x44);
    const __m512i s01hi = _mm512_shuffle_i32x4(u0, u1, 0xEE), s23hi = _mm512_shuffle_i32x4(u2, u3, 0xEE);
    const __m512i e[4] = {_mm512_shuffle_i32x4(s01lo, s23lo, 0x88), _mm512_shuffle_i32x4(s01lo, s23lo, 0xDD),
                          _mm512_shuffle_i32x4(s01hi, s23hi, 0x88), _mm512_shuffle_i32x4(s01hi, s23hi, 0xDD)};
    for (int q = 0; q < 4; ++q) {
      const int64_t at = base + 64 * v + 16 * q;
      // keep = (bits >> 8) >= thr (unsigned)
      const __mmask16 keep = _mm512_cmpge_epu32_mask(_mm512_srli_epi32(e[q], 8), thr_v);
      if constexpr (std::is_same_v<T, float>) {
        _mm512_storeu_ps(o + at, _mm512_maskz_mul_ps(keep, _mm512_loadu_ps(a + at), s_v));
      } else {
        const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(a + at));
        const __m512 x = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
        const __m512i u = _mm512_castps_si512(_mm512_maskz_mul_ps(keep, x, s_v));
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(o + at), round16_bf16(u));  // as ir::f32_to_bf16
      }
      if (pm) _mm_storeu_si128(reinterpret_cast<__m128i*>(pm + at), _mm_maskz_mov_epi8(keep, ones));
    }
  }
}

/// Groups [g0, g1) of kDropoutGroup elements by AVX-512, two groups at a time.
template <typename T>
KILN_DROPOUT_AVX512 void dropout_avx512(const T* a, T* o, uint8_t* pm, int64_t g0, int64_t g1, uint64_t seed,
                                        uint64_t sub, uint64_t offset, uint32_t thr, float s) {
  static_assert(4 * 16 * 2 == kDropoutGroup, "one group is two vectors of 16 Philox blocks");
  int64_t g = g0;
  for (; g + 2 <= g1; g += 2) dropout_avx512_vectors<T, 4>(a, o, pm, g * kDropoutGroup, seed, sub, offset, thr, s);
  if (g < g1) dropout_avx512_vectors<T, 2>(a, o, pm, g * kDropoutGroup, seed, sub, offset, thr, s);
}
#endif

Status dropout_kernel(KernelContext& c) {
  const Tensor& x = c.in(0);
  Tensor& y = c.out(0);
  bool has_mask = c.outputs.size() > 1 && c.out(1).defined() && c.out(1).raw();
  double ratio = c.attrs().get_float("ratio", 0.5);
  if (c.has_input(1) && c.in(1).numel() > 0) ratio = c.in(1).get_f64(0);
  bool training = c.training;
  if (c.has_input(2) && c.in(2).numel() > 0) training = c.in(2).get_i64(0) != 0;
  if (!(ratio >= 0.0 && ratio <= 1.0))
    return c.fail("ratio " + std::to_string(ratio) + " is outside [0, 1]");  // NaN too
  const int64_t n = x.numel();
  if (!training || ratio == 0.0) {
    KILN_RETURN_IF_ERROR(copy_kernel(c));
    if (has_mask) std::memset(c.out(1).raw(), 1, static_cast<size_t>(n));
    return Status::ok();
  }
  const uint64_t seed = c.seed, sub = rng_id(c), offset = c.step;
  const double scale = ratio < 1.0 ? 1.0 / (1.0 - ratio) : 0.0;
  const float r = static_cast<float>(ratio);
  uint8_t* pm = has_mask ? c.out(1).data<uint8_t>() : nullptr;
  return dispatch_float(c, x.dtype(), [&](auto tag) {
    using T = decltype(tag);
    using C = compute_t<T>;
    const T* a = x.data<T>();
    T* o = y.data<T>();
    const int64_t blocks = (n + 3) / 4;
    const int64_t groups = (blocks + kPhiloxLanes - 1) / kPhiloxLanes;  // kPhiloxLanes blocks at a time
    const C s = static_cast<C>(scale);
    constexpr int kGroup = 4 * kPhiloxLanes;  // elements per philox_blocks call
    int64_t first_group = 0;                  // groups before it are done by the AVX2 path
#if defined(__x86_64__)
    if constexpr (std::is_same_v<T, float> || std::is_same_v<T, bf16_t>) {
      const int isa = g_dropout_max_isa.load(std::memory_order_relaxed);
      if (isa >= 1 && cpu_has_avx2()) {
        // keep <=> (bits >> 8) * 2^-24 >= r <=> (bits >> 8) >= ceil(r * 2^24): exact in double.
        const auto thr = static_cast<uint32_t>(std::ceil(static_cast<double>(r) * 16777216.0));
        const int64_t full = n / kDropoutGroup;
        const int chunks = std::max(1, n >= kParallelThreshold ? omp_get_max_threads() : 1);
#pragma omp parallel for schedule(static) if (chunks > 1)
        for (int k = 0; k < chunks; ++k)
          if (isa >= 2 && cpu_has_avx512())
            dropout_avx512<T>(a, o, pm, full * k / chunks, full * (k + 1) / chunks, seed, sub, offset, thr, s);
          else
            dropout_avx2<T>(a, o, pm, full * k / chunks, full * (k + 1) / chunks, seed, sub, offset, thr, s);
        first_group = full * kDropoutGroup / kGroup;
      }
    }
#endif
#pragma omp parallel for schedule(static) if (n >= kParallelThreshold)
    for (int64_t grp = first_group; grp < groups; ++grp) {
      uint32_t bits[4][kPhiloxLanes];
      philox_blocks(seed, sub, offset, static_cast<uint64_t>(grp * kPhiloxLanes), bits);
      const int64_t base = grp * kGroup;
      if (base + kGroup <= n) {
        // Full group: the keep flags in element order, then one contiguous (vectorizable)
        // pass over the 32 elements; same values as the general path below.
        bool keep[kGroup];
        for (int l = 0; l < kPhiloxLanes; ++l)
          for (int w = 0; w < 4; ++w) keep[l * 4 + w] = uint32_to_uniform(bits[w][l]) >= r;
        for (int j = 0; j < kGroup; ++j) o[base + j] = store<T>(keep[j] ? static_cast<C>(load(a[base + j]) * s) : C(0));
        if (pm)
          for (int j = 0; j < kGroup; ++j) pm[base + j] = keep[j] ? 1 : 0;
        continue;
      }
      for (int l = 0; l < kPhiloxLanes; ++l)
        for (int w = 0; w < 4; ++w) {
          const int64_t i = (grp * kPhiloxLanes + l) * 4 + w;  // element i: word i % 4 of block i / 4
          if (i >= n) break;
          const bool keep = uint32_to_uniform(bits[w][l]) >= r;
          o[i] = store<T>(keep ? static_cast<C>(load(a[i]) * s) : C(0));
          if (pm) pm[i] = keep ? 1 : 0;
        }
    }
  });
}

/// dx = dy * d/dx Gelu(x) (exact or tanh approximation, PyTorch formulas).
Status gelu_grad_kernel(KernelContext& c) {
  bool tanh_approx = c.attrs().get_string("approximate", "none") == "tanh";
  if (c.in(0).dims() != c.in(1).dims() || c.in(0).dtype() != c.in(1).dtype())
    return c.fail("dy and x must have one dtype and shape");
  return dispatch_float(c, c.in(0).dtype(), [&](auto tag) {
    using T = decltype(tag);
    using C = compute_t<T>;
    const T* pdy = c.in(0).data<T>();
    const T* px = c.in(1).data<T>();
    T* po = c.out(0).data<T>();
    const int64_t n = c.in(0).numel();
#pragma omp parallel for schedule(static) if (n >= kParallelThreshold)
    for (int64_t i = 0; i < n; ++i) {
      C x = load(px[i]), dy = load(pdy[i]);
      C d;
      if (tanh_approx) {
        const C kBeta = static_cast<C>(M_SQRT2 * M_2_SQRTPI * 0.5), kKappa = static_cast<C>(0.044715);
        C inner = kBeta * (x + kKappa * x * x * x);
        C th = std::tanh(inner);
        d = C(0.5) * (C(1) + th) + C(0.5) * x * (C(1) - th * th) * kBeta * (C(1) + C(3) * kKappa * x * x);
      } else {
        C cdf = C(0.5) * (C(1) + std::erf(x * static_cast<C>(M_SQRT1_2)));
        C pdf = std::exp(C(-0.5) * x * x) * static_cast<C>(M_2_SQRTPI * M_SQRT1_2 * 0.5);
        d = cdf + x * pdf;
      }
      po[i] = store<T>(dy * d);
    }
  });
}

}  // namespace

namespace dropout_testing {
int set_max_isa(int level) {
#if defined(__x86_64__)
  return g_dropout_max_isa.exchange(std::clamp(level, 0, 2));
#else
  (void)level;
  return 0;
#endif
}
int active_isa() {
#if defined(__x86_64__)
  const int cpu = cpu_has_avx512() ? 2 : cpu_has_avx2() ? 1 : 0;
  return std::min(cpu, g_dropout_max_isa.load());
#else
  return 0;
#endif
}
}  // namespace dropout_testing

void register_elementwise_kernels(ir::OpTable& t) {
  // ---- binary arithmetic
  set_kernel(t, "Add", arith_kernel([](auto x, auto y) { return x + y; }));
  set_kernel(t, "Sub", arith_kernel([](auto x, auto y) { return x - y; }));
  set_kernel(t, "Mul", arith_kernel([](auto x, auto y) { return x * y; }));
  set_kernel(t, "Div", arith_kernel([](auto x, auto y) {
               using C = decltype(x);
               if constexpr (std::is_integral_v<C>) {
                 if (y == 0) return C(0);  // integer division by zero: 0 instead of a trap
                 if constexpr (std::is_signed_v<C>)
                   if (y == C(-1)) return static_cast<C>(-x);
               }
               return static_cast<C>(x / y);
             }));
  set_kernel(t, "Pow", pow_kernel);

  // ---- unary math (ints where ONNX allows them)
  set_kernel(t, "Neg", unary_kernel<true>([](auto x) { return -x; }));
  set_kernel(t, "Abs", unary_kernel<true>([](auto x) { return x < decltype(x)(0) ? -x : x; }));
  set_kernel(t, "Relu", unary_kernel<true>([](auto x) { return x < decltype(x)(0) ? decltype(x)(0) : x; }));
  set_kernel(t, "Sqrt", unary_kernel<false>([](auto x) { return std::sqrt(x); }));
  set_kernel(t, "Reciprocal", unary_kernel<false>([](auto x) { return decltype(x)(1) / x; }));
  set_kernel(t, "Exp", unary_kernel<false>([](auto x) { return std::exp(x); }));
  set_kernel(t, "Log", unary_kernel<false>([](auto x) { return std::log(x); }));
  set_kernel(t, "Tanh", unary_kernel<false>([](auto x) { return std::tanh(x); }));
  set_kernel(t, "Sigmoid", unary_kernel<false>([](auto x) {
               using C = decltype(x);
               if (x >= C(0)) return C(1) / (C(1) + std::exp(-x));
               C e = std::exp(x);
               return e / (C(1) + e);
             }));
  set_kernel(t, "Erf", unary_kernel<false>([](auto x) { return std::erf(x); }));
  set_kernel(t, "Softplus", unary_kernel<false>([](auto x) {
               using C = decltype(x);
               return x > C(0) ? x + std::log1p(std::exp(-x)) : std::log1p(std::exp(x));
             }));
  set_kernel(t, "Sin", unary_kernel<false>([](auto x) { return std::sin(x); }));
  set_kernel(t, "Cos", unary_kernel<false>([](auto x) { return std::cos(x); }));
  set_kernel(t, "LeakyRelu", [](KernelContext& c) -> Status {
    double alpha = c.attrs().get_float("alpha", 0.01);
    return unary_kernel<false>([alpha](auto x) {
      using C = decltype(x);
      return x < C(0) ? static_cast<C>(alpha) * x : x;
    })(c);
  });
  set_kernel(t, "Gelu", [](KernelContext& c) -> Status {
    std::string approx = c.attrs().get_string("approximate", "none");
    if (approx == "tanh")
      return unary_kernel<false>([](auto x) {
        using C = decltype(x);
        const C k = static_cast<C>(M_SQRT2 * M_2_SQRTPI * 0.5);
        return C(0.5) * x * (C(1) + std::tanh(k * (x + C(0.044715) * x * x * x)));
      })(c);
    if (approx != "none") return c.fail("approximate must be 'none' or 'tanh', got '" + approx + "'");
    return unary_kernel<false>([](auto x) {
      using C = decltype(x);
      return C(0.5) * x * (C(1) + std::erf(x * static_cast<C>(M_SQRT1_2)));
    })(c);
  });
  set_kernel(t, "GeluGrad", gelu_grad_kernel);
  set_kernel(t, "Floor", unary_kernel<false>([](auto x) { return std::floor(x); }));
  set_kernel(t, "Ceil", unary_kernel<false>([](auto x) { return std::ceil(x); }));
  set_kernel(t, "Round", unary_kernel<false>([](auto x) { return std::nearbyint(x); }));  // halves to even
  set_kernel(t, "Sign", unary_kernel<true>([](auto x) {
               using C = decltype(x);
               return x > C(0) ? C(1) : x < C(0) ? C(-1) : x;  // 0 and NaN stay
             }));
  set_kernel(t, "IsNaN", [](KernelContext& c) -> Status {
    return dispatch_float(c, c.in(0).dtype(), [&](auto tag) {
      using T = decltype(tag);
      const T* a = c.in(0).data<T>();
      bool_t* o = c.out(0).data<bool_t>();
      for (int64_t i = 0; i < c.in(0).numel(); ++i) o[i] = bool_t{uint8_t(std::isnan(load(a[i])) ? 1 : 0)};
    });
  });
  set_kernel(t, "IsInf", [](KernelContext& c) -> Status {
    const bool pos = c.attrs().get_int("detect_positive", 1) != 0, neg = c.attrs().get_int("detect_negative", 1) != 0;
    return dispatch_float(c, c.in(0).dtype(), [&](auto tag) {
      using T = decltype(tag);
      const T* a = c.in(0).data<T>();
      bool_t* o = c.out(0).data<bool_t>();
      for (int64_t i = 0; i < c.in(0).numel(); ++i) {
        auto v = load(a[i]);
        o[i] = bool_t{uint8_t((std::isinf(v) && ((v > 0 && pos) || (v < 0 && neg))) ? 1 : 0)};
      }
    });
  });
  set_kernel(t, "Mod", [](KernelContext& c) -> Status {
    const bool trunc = c.attrs().get_int("fmod", 0) != 0;
    return dispatch_numeric(c, c.in(0).dtype(), [&](auto tag) {
      using T = decltype(tag);
      using C = compute_t<T>;
      binary_loop<T, T, T>(c.in(0), c.in(1), c.out(0), [&](C x, C y) {
        C r;
        if constexpr (std::is_integral_v<C>) {
          if (y == 0) return store<T>(C(0));  // undefined in ONNX; 0 as integer Div does
          if constexpr (std::is_signed_v<C>) {
            if (y == C(-1)) return store<T>(C(0));
          }
          r = static_cast<C>(x % y);
          if (!trunc && r != 0 && ((r < 0) != (y < 0))) r = static_cast<C>(r + y);
        } else {
          r = std::fmod(x, y);
          if (!trunc) {  // Mod-28: the sign of b, a zero takes b's sign
            if (r != 0 && ((r < 0) != (y < 0)))
              r += y;
            else if (r == 0)
              r = std::copysign(C(0), y);
          }
        }
        return store<T>(r);
      });
    });
  });
  set_kernel(t, "Clip", clip_kernel);
  set_kernel(t, "Max", minmax_kernel<true>);
  set_kernel(t, "Min", minmax_kernel<false>);
  set_kernel(t, "Where", where_kernel);

  // ---- comparisons and logic
  set_kernel(t, "Equal", compare_kernel<true>([](auto x, auto y) { return x == y; }));
  set_kernel(t, "Less", compare_kernel<false>([](auto x, auto y) { return x < y; }));
  set_kernel(t, "LessOrEqual", compare_kernel<false>([](auto x, auto y) { return x <= y; }));
  set_kernel(t, "Greater", compare_kernel<false>([](auto x, auto y) { return x > y; }));
  set_kernel(t, "GreaterOrEqual", compare_kernel<false>([](auto x, auto y) { return x >= y; }));
  set_kernel(t, "And", logic_kernel([](bool x, bool y) { return x && y; }));
  set_kernel(t, "Or", logic_kernel([](bool x, bool y) { return x || y; }));
  set_kernel(t, "Xor", logic_kernel([](bool x, bool y) { return x != y; }));
  set_kernel(t, "Not", [](KernelContext& c) -> Status {
    if (c.in(0).dtype() != DType::boolean) return c.fail("expects a bool input");
    const uint8_t* a = c.in(0).data<uint8_t>();
    uint8_t* o = c.out(0).data<uint8_t>();
    for (int64_t i = 0; i < c.in(0).numel(); ++i) o[i] = a[i] ? 0 : 1;
    return Status::ok();
  });

  // ---- conversions and copies
  set_kernel(t, "Cast", [](KernelContext& c) { return cast_into(c, c.in(0), c.out(0)); });
  set_kernel(t, "CastLike", [](KernelContext& c) { return cast_into(c, c.in(0), c.out(0)); });
  set_kernel(t, "Identity", copy_kernel);
  set_kernel_writing_all_outputs(t, "Dropout", dropout_kernel);
}

}  // namespace kiln::runtime::kernels
