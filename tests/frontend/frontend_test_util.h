// Helpers shared by the frontend tests: fixture paths (written by tools/make_bad_models.py)
// and graph comparison.
#pragma once
#include <gtest/gtest.h>

#include <cstring>
#include <string>

#include "ir/graph.h"
#include "ir/printer.h"

namespace kiln::test {

/// Path of a fixture in tests/data/bad_models/.
inline std::string fixture(const std::string& name) {
  return std::string(KILN_SOURCE_DIR) + "/tests/data/bad_models/" + name;
}

/// Scratch folder for files written by a test (inside the build dir).
inline std::string scratch(const std::string& name) { return std::string(KILN_BINARY_DIR) + "/" + name; }

/// Bytewise equality of dtype, dims and data.
inline ::testing::AssertionResult tensors_equal(const ir::Tensor& a, const ir::Tensor& b) {
  if (a.dtype() != b.dtype())
    return ::testing::AssertionFailure() << "dtype " << ir::dtype_name(a.dtype()) << " vs "
                                         << ir::dtype_name(b.dtype());
  if (a.dims() != b.dims())
    return ::testing::AssertionFailure() << "dims " << ir::dims_to_string(a.dims()) << " vs "
                                         << ir::dims_to_string(b.dims());
  if (a.nbytes() && std::memcmp(a.raw(), b.raw(), a.nbytes()) != 0)
    return ::testing::AssertionFailure() << "data differs: " << a.debug_string() << " vs " << b.debug_string();
  return ::testing::AssertionSuccess();
}

/// Structural equality: the printed IR (names, ops, attributes, types, shapes) and every
/// initializer's data.
inline ::testing::AssertionResult graphs_equal(const ir::Graph& a, const ir::Graph& b) {
  std::string sa = ir::graph_to_string(a), sb = ir::graph_to_string(b);
  if (sa != sb) return ::testing::AssertionFailure() << "IR differs:\n" << sa << "\nvs\n" << sb;
  if (a.initializers.size() != b.initializers.size()) return ::testing::AssertionFailure() << "initializer count";
  for (size_t i = 0; i < a.initializers.size(); ++i) {
    auto r = tensors_equal(*a.initializers[i]->data, *b.initializers[i]->data);
    if (!r) return r << " (initializer '" << a.initializers[i]->name << "')";
  }
  return ::testing::AssertionSuccess();
}

}  // namespace kiln::test
