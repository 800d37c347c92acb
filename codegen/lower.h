// Lowering of fused IR groups to kernel IR (codegen/kernel_ir.h).
//
// A FusedKernel node (passes/fusion.cpp) of kind "pointwise" becomes one Kernel whose
// domain is the members' common output shape. Each body input is a parameter with
// numpy broadcast strides against the domain (0 along broadcast dims), each body
// output a contiguous output parameter; every member node contributes the scalar
// expressions of its op-table scalar rule (OpDef::scalar), and rank-0 body
// initializers become literals. A "reduction" kernel ends in a ReduceSum/ReduceMax (a
// reduction store). A "row" kernel's domain is its row op's input 0 shape, with the op's
// row dims (OpDef::row_dims) reduced; the row op contributes its row rule (OpDef::row,
// reduce expressions), and outputs of smaller shape (statistics) become row stores.
#pragma once
#include <string>
#include <vector>

#include "codegen/kernel_ir.h"
#include "ir/graph.h"
#include "ir/status.h"

namespace kiln::codegen {

/// Lowers one FusedKernel node. Parameter order: the node's inputs, then its outputs
/// (so buffers[i] is input i for i < num_inputs, output j at num_inputs + j).
/// Errors name the node (unsupported op or dtype, non-static shape).
Expected<Kernel> lower_fused(const ir::Node& fused);

/// Every FusedKernel node of `g`, nested regions included, in schedule order.
std::vector<const ir::Node*> fused_nodes(const ir::Graph& g);

}  // namespace kiln::codegen
