// Shared helpers of the eager CPU kernels: element-type dispatch (f32, f64, bf16,
// f16, i64, i32, i8, u8, bool), numpy-style broadcast iteration over strided
// inputs, a byte-generic strided copy (the workhorse of the view/shape kernels),
// and the counter-based Philox4x32-10 generator (Salmon et al., "Parallel random
// numbers: as easy as 1, 2, 3", SC'11) used by every random kernel
// (DESIGN.md invariant 6: same seed, op id and offset give the same numbers).
#pragma once
#include <immintrin.h>

#include <array>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <type_traits>
#include <vector>

#include "ir/dtype.h"
#include "ir/op_table.h"
#include "ir/status.h"
#include "ir/tensor.h"

namespace kiln::runtime::kernels {

// ---------------------------------------------------------------------------
// Element types
// ---------------------------------------------------------------------------

/// Storage type of bfloat16 elements (computed in f32, stored round-to-nearest-even).
struct bf16_t {
  uint16_t bits;
};
/// Storage type of IEEE half elements (computed in f32).
struct f16_t {
  uint16_t bits;
};
/// Storage type of bool elements (one byte, 0 or 1).
struct bool_t {
  uint8_t v;
};

/// Arithmetic type a storage type is computed in: float for f32/bf16/f16,
/// double for f64, the integer itself for integers, bool for bool.
template <typename T>
struct compute_of {
  using type = T;
};
template <>
struct compute_of<bf16_t> {
  using type = float;
};
template <>
struct compute_of<f16_t> {
  using type = float;
};
template <>
struct compute_of<bool_t> {
  using type = bool;
};
template <typename T>
using compute_t = typename compute_of<T>::type;

/// True for the floating storage types (float, double, bf16_t, f16_t).
template <typename T>
inline constexpr bool is_float_v = std::is_floating_point_v<T> || std::is_same_v<T, bf16_t> || std::is_same_v<T, f16_t>;

/// Reads one stored element as its compute type.
template <typename T>
inline compute_t<T> load(const T& v) {
  if constexpr (std::is_same_v<T, bf16_t>)
    return ir::bf16_to_f32(v.bits);
  else if constexpr (std::is_same_v<T, f16_t>)
    return ir::f16_to_f32(v.bits);
  else if constexpr (std::is_same_v<T, bool_t>)
    return v.v != 0;
  else
    return v;
}
/// Converts a compute value to the storage type (bf16: round to nearest even).
template <typename T>
inline T store(compute_t<T> v) {
  if constexpr (std::is_same_v<T, bf16_t>)
    return bf16_t{ir::f32_to_bf16(v)};
  else if constexpr (std::is_same_v<T, f16_t>)
    return f16_t{ir::f32_to_f16(v)};
  else if constexpr (std::is_same_v<T, bool_t>)
    return bool_t{static_cast<uint8_t>(v ? 1 : 0)};
  else
    return v;
}

/// Converts any arithmetic value to storage type T with ONNX Cast semantics:
/// float -> int truncates toward zero (NaN -> 0, out of range saturates), x -> bool is x != 0.
template <typename T, typename V>
inline T convert(V v) {
  using C = compute_t<T>;
  if constexpr (std::is_same_v<T, bool_t>) {
    return bool_t{static_cast<uint8_t>(v != V(0) ? 1 : 0)};
  } else if constexpr (std::is_integral_v<C> && std::is_floating_point_v<V>) {
    if (std::isnan(v)) return store<T>(C(0));
    double t = std::trunc(static_cast<double>(v));
    if (t <= static_cast<double>(std::numeric_limits<C>::min())) return store<T>(std::numeric_limits<C>::min());
    if (t >= static_cast<double>(std::numeric_limits<C>::max())) return store<T>(std::numeric_limits<C>::max());
    return store<T>(static_cast<C>(t));
  } else {
    return store<T>(static_cast<C>(v));
  }
}

/// Calls `f(T{})` with the storage type of dtype `t`, for the dtype families enabled by
/// the template flags (only those are instantiated). Returns an error naming the node
/// when the dtype is not supported by the op.
template <bool Floats, bool Ints, bool Bools, typename F>
Status dispatch(const ir::KernelContext& ctx, ir::DType t, F&& f) {
  using ir::DType;
  if constexpr (Floats) {
    switch (t) {
      case DType::f32:
        f(float{});
        return Status::ok();
      case DType::f64:
        f(double{});
        return Status::ok();
      case DType::bf16:
        f(bf16_t{});
        return Status::ok();
      case DType::f16:
        f(f16_t{});
        return Status::ok();
      default:
        break;
    }
  }
  if constexpr (Ints) {
    switch (t) {
      case DType::i64:
        f(int64_t{});
        return Status::ok();
      case DType::i32:
        f(int32_t{});
        return Status::ok();
      case DType::i8:
        f(int8_t{});
        return Status::ok();
      case DType::u8:
        f(uint8_t{});
        return Status::ok();
      default:
        break;
    }
  }
  if constexpr (Bools) {
    if (t == DType::boolean) {
      f(bool_t{});
      return Status::ok();
    }
  }
  return ctx.fail(std::string("dtype ") + ir::dtype_name(t) + " is not supported by the eager kernel");
}
/// Float dtypes only (f32, f64, bf16, f16).
template <typename F>
Status dispatch_float(const ir::KernelContext& c, ir::DType t, F&& f) {
  return dispatch<true, false, false>(c, t, std::forward<F>(f));
}
/// Float and integer dtypes.
template <typename F>
Status dispatch_numeric(const ir::KernelContext& c, ir::DType t, F&& f) {
  return dispatch<true, true, false>(c, t, std::forward<F>(f));
}
/// Every dtype, bool included.
template <typename F>
Status dispatch_all(const ir::KernelContext& c, ir::DType t, F&& f) {
  return dispatch<true, true, true>(c, t, std::forward<F>(f));
}

// ---------------------------------------------------------------------------
// Broadcast iteration
// ---------------------------------------------------------------------------

/// Element count above which kernels run their outer loop with OpenMP.
inline constexpr int64_t kParallelThreshold = 1 << 15;

/// Strides (elements) of a row-major tensor with dims `in` read as if broadcast to
/// `out` (numpy rules, right-aligned): 0 on broadcast dims. Size == out.size().
std::vector<int64_t> broadcast_strides(const std::vector<int64_t>& in, const std::vector<int64_t>& out);

/// Calls `f(o, offs)` for every output element o (row-major over `out_dims`), where
/// offs[k] = sum_d coord[d] * strides[k][d] is input k's element offset. Strides are
/// in elements, one per output dim (0 = broadcast). Rows of the last dim are
/// distributed over OpenMP threads when the output is large; f must be thread-safe.
template <size_t N, typename F>
void for_each_strided(const std::vector<int64_t>& out_dims, const std::array<std::vector<int64_t>, N>& strides, F&& f) {
  const int r = static_cast<int>(out_dims.size());
  const int64_t total = ir::numel_of(out_dims);
  if (total == 0) return;
  if (r == 0) {
    std::array<int64_t, N> offs{};
    f(int64_t(0), offs);
    return;
  }
  const int64_t inner = out_dims[r - 1];
  const int64_t rows = total / inner;
  std::array<int64_t, N> last{};
  for (size_t k = 0; k < N; ++k) last[k] = strides[k][r - 1];
#pragma omp parallel for schedule(static) if (total >= kParallelThreshold && rows > 1)
  for (int64_t row = 0; row < rows; ++row) {
    std::array<int64_t, N> base{};
    int64_t rem = row;
    for (int d = r - 2; d >= 0; --d) {
      int64_t c = rem % out_dims[d];
      rem /= out_dims[d];
      for (size_t k = 0; k < N; ++k) base[k] += c * strides[k][d];
    }
    const int64_t o0 = row * inner;
    std::array<int64_t, N> offs;
    for (int64_t j = 0; j < inner; ++j) {
      for (size_t k = 0; k < N; ++k) offs[k] = base[k] + j * last[k];
      f(o0 + j, offs);
    }
  }
}

/// Copies a strided view of `src` (element size `esize` bytes, element offset
/// `src_offset`, one stride per output dim, 0 = broadcast, negative allowed) into
/// the contiguous row-major buffer `dst` of dims `out_dims`.
void strided_copy(void* dst, const void* src, size_t esize, const std::vector<int64_t>& out_dims,
                  const std::vector<int64_t>& src_strides, int64_t src_offset);

// ---------------------------------------------------------------------------
// Philox4x32-10
// ---------------------------------------------------------------------------

/// Multipliers of the Philox4x32 round function.
inline constexpr uint32_t kPhiloxM0 = 0xD2511F53u, kPhiloxM1 = 0xCD9E8D57u;

/// One Philox4x32 round on counter words (c0, c1, c2, c3) with key words (k0, k1).
inline void philox_round(uint32_t& c0, uint32_t& c1, uint32_t& c2, uint32_t& c3, uint32_t k0, uint32_t k1) {
  const uint64_t p0 = static_cast<uint64_t>(kPhiloxM0) * c0;
  const uint64_t p1 = static_cast<uint64_t>(kPhiloxM1) * c2;
  const uint32_t n0 = static_cast<uint32_t>(p1 >> 32) ^ c1 ^ k0;
  const uint32_t n2 = static_cast<uint32_t>(p0 >> 32) ^ c3 ^ k1;
  c1 = static_cast<uint32_t>(p1);
  c3 = static_cast<uint32_t>(p0);
  c0 = n0;
  c2 = n2;
}

/// Weyl increments of the Philox4x32 key per round.
inline constexpr uint32_t kPhiloxW0 = 0x9E3779B9u, kPhiloxW1 = 0xBB67AE85u;

/// One Philox4x32-10 block: 10 rounds on a 128-bit counter with a 64-bit key.
inline std::array<uint32_t, 4> philox4x32_10(std::array<uint32_t, 4> c, std::array<uint32_t, 2> k) {
  for (int round = 0; round < 10; ++round) {
    philox_round(c[0], c[1], c[2], c[3], k[0], k[1]);
    k[0] += kPhiloxW0;
    k[1] += kPhiloxW1;
  }
  return c;
}

/// The Philox block holding element `index` of stream (seed, subsequence, offset):
/// key = seed (64 bits); counter = (block lo, block hi, offset lo 32 bits, subsequence lo 32 bits)
/// with block = index / 4. Element `index` is word index % 4 of the block.
inline std::array<uint32_t, 4> philox_block(uint64_t seed, uint64_t subsequence, uint64_t offset, uint64_t block) {
  return philox4x32_10({static_cast<uint32_t>(block), static_cast<uint32_t>(block >> 32), static_cast<uint32_t>(offset),
                        static_cast<uint32_t>(subsequence)},
                       {static_cast<uint32_t>(seed), static_cast<uint32_t>(seed >> 32)});
}

/// Philox4x32-10 for `kPhiloxLanes` consecutive blocks at once (blocks first_block,
/// first_block + 1, ...), the same bits as philox_block per block: out[w][l] is word w
/// of block first_block + l. Written lane-parallel so that the compiler can use SIMD
/// (32x32->64 multiplies), which the one-block form does not allow.
inline constexpr int kPhiloxLanes = 8;
inline void philox_blocks(uint64_t seed, uint64_t subsequence, uint64_t offset, uint64_t first_block,
                          uint32_t out[4][kPhiloxLanes]) {
  uint32_t c0[kPhiloxLanes], c1[kPhiloxLanes], c2[kPhiloxLanes], c3[kPhiloxLanes];
  for (int l = 0; l < kPhiloxLanes; ++l) {
    const uint64_t b = first_block + static_cast<uint64_t>(l);
    c0[l] = static_cast<uint32_t>(b);
    c1[l] = static_cast<uint32_t>(b >> 32);
    c2[l] = static_cast<uint32_t>(offset);
    c3[l] = static_cast<uint32_t>(subsequence);
  }
  uint32_t k0 = static_cast<uint32_t>(seed), k1 = static_cast<uint32_t>(seed >> 32);
  for (int round = 0; round < 10; ++round) {
#pragma omp simd
    for (int l = 0; l < kPhiloxLanes; ++l) philox_round(c0[l], c1[l], c2[l], c3[l], k0, k1);
    k0 += kPhiloxW0;
    k1 += kPhiloxW1;
  }
  for (int l = 0; l < kPhiloxLanes; ++l) {
    out[0][l] = c0[l];
    out[1][l] = c1[l];
    out[2][l] = c2[l];
    out[3][l] = c3[l];
  }
}

/// Maps 32 random bits to a float uniform in [0, 1) (top 24 bits, exact in f32).
inline float uint32_to_uniform(uint32_t x) { return static_cast<float>(x >> 8) * (1.0f / 16777216.0f); }

/// Uniform float in [0, 1) for element `index` of the counter-based stream keyed by
/// (seed, subsequence = rng/op id, offset = step). Pure function: the same arguments
/// always give the same number, on any thread and in any order (eager == compiled,
/// recomputed dropout == original).
inline float philox_uniform(uint64_t seed, uint64_t subsequence, uint64_t offset, uint64_t index) {
  return uint32_to_uniform(philox_block(seed, subsequence, offset, index / 4)[index % 4]);
}

/// Rng stream id of a node: attribute `kiln_rng_id` when present, else the node's op id.
inline uint64_t rng_id(const ir::KernelContext& ctx) {
  return static_cast<uint64_t>(ctx.attrs().get_int("kiln_rng_id", static_cast<int64_t>(ctx.op_id)));
}

// ---- bf16 <-> f32 with AVX2 (callers check the CPU first: cpu_has_avx2)

/// 8 elements at `p` as f32 (T = float or bf16_t).
template <typename T>
__attribute__((target("avx2"))) inline __m256 load8_f32(const T* p) {
  if constexpr (std::is_same_v<T, float>) {
    return _mm256_loadu_ps(p);
  } else {
    const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
  }
}

/// Stores 8 f32 values to `p` as T (bf16: round to nearest even, NaN quiet; ir::f32_to_bf16).
template <typename T>
__attribute__((target("avx2"))) inline void store8_f32(T* p, __m256 v) {
  if constexpr (std::is_same_v<T, float>) {
    _mm256_storeu_ps(p, v);
  } else {
    const __m256i u = _mm256_castps_si256(v);
    const __m256i nan =
        _mm256_cmpgt_epi32(_mm256_and_si256(u, _mm256_set1_epi32(0x7fffffff)), _mm256_set1_epi32(0x7f800000));
    const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
    const __m256i rounded =
        _mm256_srli_epi32(_mm256_add_epi32(u, _mm256_add_epi32(lsb, _mm256_set1_epi32(0x7fff))), 16);
    const __m256i quiet = _mm256_or_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(0x40));
    const __m256i b = _mm256_blendv_epi8(rounded, quiet, nan);  // each lane 0..0xffff
    _mm_storeu_si128(reinterpret_cast<__m128i*>(p),
                     _mm_packus_epi32(_mm256_castsi256_si128(b), _mm256_extracti128_si256(b, 1)));
  }
}

/// 16 f32 lanes (as bits) rounded to bf16 bit patterns, one per 16-bit lane: nearest
/// even, a NaN kept quiet (ir::f32_to_bf16). Callers check for AVX-512BW first.
__attribute__((target("avx512f,avx512bw"))) inline __m256i round16_bf16(__m512i u) {
  const __mmask16 nan =
      _mm512_cmpgt_epi32_mask(_mm512_and_si512(u, _mm512_set1_epi32(0x7fffffff)), _mm512_set1_epi32(0x7f800000));
  const __m512i hi = _mm512_srli_epi32(u, 16);
  const __m512i rounded = _mm512_srli_epi32(
      _mm512_add_epi32(u, _mm512_add_epi32(_mm512_and_si512(hi, _mm512_set1_epi32(1)), _mm512_set1_epi32(0x7fff))), 16);
  return _mm512_cvtepi32_epi16(_mm512_mask_blend_epi32(nan, rounded, _mm512_or_si512(hi, _mm512_set1_epi32(0x40))));
}

/// Whether this CPU runs the avx2 helpers above.
bool cpu_has_avx2();

/// Widens n bf16 values (bit patterns) to f32 (exact). AVX2 where the CPU has it.
void widen_bf16(const uint16_t* in, float* out, int64_t n);
/// Rounds n f32 values to bf16 bit patterns, as ir::f32_to_bf16 (nearest even, NaN kept
/// quiet). AVX2 where the CPU has it.
void narrow_to_bf16(const float* in, uint16_t* out, int64_t n);

}  // namespace kiln::runtime::kernels
