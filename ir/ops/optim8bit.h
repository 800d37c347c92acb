// 8-bit block-wise optimizer state (Dettmers et al. 2021, "8-bit Optimizers via
// Block-wise Quantization"; bitsandbytes semantics): constants, the dynamic (tree)
// quantization map and the nearest-code search shared by the op table entries
// (ir/ops/optim8bit.cpp), the eager kernels (runtime/kernels/optim8bit.cpp) and the
// optimizer pass (passes/optimizer.cpp, --optim adamw_8bit).
//
// A tensor x of n f32 elements is stored as n uint8 codes plus one f32 absmax per
// block of kBlockSize8bit elements: absmax_b = max |x_i| over block b, and
// code_i = argmin_c |qmap[c] - x_i / absmax_b| (nearest entry of the sorted map,
// found by binary search). Dequantization is x_i ~= qmap[code_i] * absmax_b.
#pragma once
#include <cstdint>
#include <vector>

namespace kiln::ir {

/// Elements per quantization block (bitsandbytes' blockwise optimizers).
inline constexpr int64_t kBlockSize8bit = 256;
/// Parameters with fewer elements keep fp32 Adam state (bitsandbytes min_8bit_size).
inline constexpr int64_t kMin8bitSize = 4096;
/// Entries of an 8-bit quantization map.
inline constexpr int kQuantMapSize = 256;

/// bitsandbytes.functional.create_dynamic_map(signed, max_exponent_bits, total_bits):
/// the dynamic tree quantization map, 2^total_bits values in [-1, 1] sorted ascending.
/// Signed (first Adam moment): +-10^(i-6) * midpoints of linspace(0.1, 1, 2^i + 1) for
/// i = 0..6, plus 0 and 1. Unsigned (second moment): 10^(i-6) * midpoints of
/// linspace(0.1, 1, 2^(i+1) + 1), plus 0 and 1. Values are rounded to f32 as torch does.
std::vector<float> create_dynamic_map(bool signed_map, int max_exponent_bits = 7, int total_bits = 8);

/// Index of the entry of the sorted 256-entry `qmap` nearest to `x` (ties: the lower
/// index; x below/above the map: the first/last entry; NaN: 0). Branch-free binary search.
inline uint8_t nearest_code(const float* qmap, float x) {
  int i = 0;
  for (int s = kQuantMapSize / 2; s > 0; s >>= 1) i += (qmap[i + s] <= x) ? s : 0;
  if (i + 1 < kQuantMapSize && (qmap[i + 1] - x) < (x - qmap[i])) ++i;
  return static_cast<uint8_t>(i);
}

/// Number of blocks (absmax entries) of an n-element tensor: ceil(n / blocksize).
inline int64_t num_blocks_8bit(int64_t n, int64_t blocksize = kBlockSize8bit) {
  return (n + blocksize - 1) / blocksize;
}

}  // namespace kiln::ir
