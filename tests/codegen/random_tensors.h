// Deterministic random test tensors for the codegen tests.
#pragma once
#include <cstdint>
#include <random>
#include <vector>

#include "ir/tensor.h"

namespace kiln::testing {

/// f32 tensor of `dims` with values uniform in [-2, 2) from mt19937_64(`seed`).
inline ir::Tensor random_f32(std::vector<int64_t> dims, uint64_t seed) {
  std::mt19937_64 g(seed);
  std::uniform_real_distribution<double> u(-2, 2);
  ir::Tensor t(ir::DType::f32, std::move(dims));
  for (int64_t i = 0; i < t.numel(); ++i) t.set_f64(i, u(g));
  return t;
}

}  // namespace kiln::testing
