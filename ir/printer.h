// Stable, diffable text form of a Graph (DESIGN.md convention 6).
//
//   graph main(%x: f32[batch, 64], %y: i64[batch]) {
//     init %fc1.weight: f32[32, 64]
//     %h = Gemm(%x, %fc1.weight, %fc1.bias) {transB=1} : f32[batch, 32]   # /fc1/Gemm
//     return %loss
//   }
#pragma once
#include <ostream>
#include <string>

#include "ir/graph.h"

namespace kiln::ir {

/// Prints the graph (nested regions indented). Initializer data is not printed, only types.
void print_graph(const Graph& g, std::ostream& os, int indent = 0);
/// Same, as a string.
std::string graph_to_string(const Graph& g);
/// One attribute value as text (ints as "3", lists as "[1, 2]", tensors as "tensor<f32[2]>").
std::string attr_to_string(const AttrValue& v);

}  // namespace kiln::ir
