// Shared kernel helpers (see util.h): broadcast strides and the strided copy.
#include "runtime/kernels/util.h"

namespace kiln::runtime::kernels {

std::vector<int64_t> broadcast_strides(const std::vector<int64_t>& in, const std::vector<int64_t>& out) {
  std::vector<int64_t> s(out.size(), 0);
  std::vector<int64_t> own = ir::strides_of(in);
  int off = static_cast<int>(out.size()) - static_cast<int>(in.size());
  for (int i = 0; i < static_cast<int>(in.size()); ++i)
    if (off + i >= 0) s[off + i] = in[i] == 1 ? 0 : own[i];
  return s;
}

template <typename W>
static void strided_copy_typed(W* dst, const W* src, const std::vector<int64_t>& out_dims,
                               const std::vector<int64_t>& src_strides, int64_t src_offset) {
  const W* s = src + src_offset;
  for_each_strided<1>(out_dims, {src_strides},
                      [&](int64_t o, const std::array<int64_t, 1>& off) { dst[o] = s[off[0]]; });
}

void strided_copy(void* dst, const void* src, size_t esize, const std::vector<int64_t>& out_dims,
                  const std::vector<int64_t>& src_strides, int64_t src_offset) {
  switch (esize) {
    case 1:
      strided_copy_typed(static_cast<uint8_t*>(dst), static_cast<const uint8_t*>(src), out_dims, src_strides,
                         src_offset);
      break;
    case 2:
      strided_copy_typed(static_cast<uint16_t*>(dst), static_cast<const uint16_t*>(src), out_dims, src_strides,
                         src_offset);
      break;
    case 4:
      strided_copy_typed(static_cast<uint32_t*>(dst), static_cast<const uint32_t*>(src), out_dims, src_strides,
                         src_offset);
      break;
    default:
      strided_copy_typed(static_cast<uint64_t*>(dst), static_cast<const uint64_t*>(src), out_dims, src_strides,
                         src_offset);
      break;
  }
}

bool cpu_has_avx2() {
  static const bool yes = __builtin_cpu_supports("avx2");
  return yes;
}

namespace {
__attribute__((target("avx2"))) void widen_bf16_avx2(const uint16_t* in, float* out, int64_t n) {
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) _mm256_storeu_ps(out + i, load8_f32(reinterpret_cast<const bf16_t*>(in) + i));
  for (; i < n; ++i) out[i] = ir::bf16_to_f32(in[i]);
}
__attribute__((target("avx2"))) void narrow_to_bf16_avx2(const float* in, uint16_t* out, int64_t n) {
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) store8_f32(reinterpret_cast<bf16_t*>(out) + i, _mm256_loadu_ps(in + i));
  for (; i < n; ++i) out[i] = ir::f32_to_bf16(in[i]);
}

bool cpu_has_avx512bw() {
  static const bool yes = __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw");
  return yes;
}

#define KILN_AVX512BW __attribute__((target("avx2,avx512f,avx512bw")))

KILN_AVX512BW void widen_bf16_avx512(const uint16_t* in, float* out, int64_t n) {
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) {
    const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(in + i));
    _mm512_storeu_ps(out + i, _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16)));
  }
  widen_bf16_avx2(in + i, out + i, n - i);
}

KILN_AVX512BW void narrow_to_bf16_avx512(const float* in, uint16_t* out, int64_t n) {
  int64_t i = 0;
  for (; i + 16 <= n; i += 16)
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + i),
                        round16_bf16(_mm512_castps_si512(_mm512_loadu_ps(in + i))));
  narrow_to_bf16_avx2(in + i, out + i, n - i);
}
}  // namespace

void widen_bf16(const uint16_t* in, float* out, int64_t n) {
  if (cpu_has_avx512bw()) return widen_bf16_avx512(in, out, n);
  if (cpu_has_avx2()) return widen_bf16_avx2(in, out, n);
  for (int64_t i = 0; i < n; ++i) out[i] = ir::bf16_to_f32(in[i]);
}

void narrow_to_bf16(const float* in, uint16_t* out, int64_t n) {
  if (cpu_has_avx512bw()) return narrow_to_bf16_avx512(in, out, n);
  if (cpu_has_avx2()) return narrow_to_bf16_avx2(in, out, n);
  for (int64_t i = 0; i < n; ++i) out[i] = ir::f32_to_bf16(in[i]);
}

}  // namespace kiln::runtime::kernels
