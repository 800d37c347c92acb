// Initializers as PyTorch holds them: roles read from the exporter's metadata,
// parameters restored where the exporter folded them into constants, ties restored.
// Part of the ONNX import (onnx_import.cpp calls resolve_initializers once the graph is
// built, before type inference). Each decision that changes what trains is one note line
// (Graph::import_notes).
//
// 1. Roles (Value::role). The torch.export-based exporter (torch.onnx.export(...,
//    dynamo=True)) records the exported program's graph signature: model metadata
//    "pkg.torch.export.ExportedProgram.graph_signature" lists each placeholder with its
//    kind and target (PARAMETER, BUFFER, CONSTANT_TENSOR), and the value_info of each
//    initializer it kept carries "pkg.torch.export.graph_signature.InputSpec.kind".
//    Such initializers get that role; any other initializer of such a model is a
//    constant the exporter computed (masks, folded shape data). Models without the
//    signature (the TorchScript exporter, other producers) keep the role unknown, and
//    kiln's name rule (ir::is_parameter_candidate) decides.
// 2. Parameters folded into constants. Both PyTorch exporters constant-fold the
//    transpose of a Linear layer's weight used by a MatMul (x @ W^T on 3-D input), so
//    the file holds W^T under a generated name ("val_84", "onnx::MatMul_362") and not W.
//    The parameter is restored under PyTorch's name, in PyTorch's [out, in] layout, and
//    the MatMul reads Transpose(W): the name comes from the node's FX metadata
//    ("pkg.torch.onnx.fx_node": aten.linear(%x, %p_<weight>, ...)) and the signature
//    (torch.export), or from the node's scope name "/<module path>/MatMul" (TorchScript:
//    "<module path>.weight"). A restored name that is already taken is not used.
// 3. Ties by content. A constant that is bit for bit a copy, a transpose (rank 2), a
//    leading slice (along its first non-unit dim) or a broadcast (repeated along new
//    leading dims) of a parameter is re-expressed as that view of the parameter
//    (Identity, Transpose, Slice, Expand), so one tensor trains as PyTorch trains it
//    (GPT-2's lm_head = wte^T). Tensors whose elements are all equal are never taken as
//    ties (a freshly initialized model's ones and zeros match by accident). An Identity
//    of a parameter (eval-mode exports' aliases) is a tie too, unless its elements are
//    all equal: the TorchScript exporter deduplicates equal-valued parameters of a fresh
//    model into Identity aliases, and such an alias becomes a parameter of its own,
//    named as the alias. With `untie` nothing is
//    re-expressed: each copy becomes a parameter of its own, named as in the file.
// 4. Names of tied parameters (torch.export). PyTorch lists tied parameters once, under
//    the first name (named_parameters()); the exporter keeps one initializer, named by
//    one of them. When a node's FX metadata names a parameter that is missing from the
//    file and the node reads another parameter instead, they are one tensor: it is
//    renamed to the earlier of the two signature names. When that tensor's elements are
//    all equal (the exporter merged equal-valued parameters of a fresh model, e.g. all
//    LayerNorm weights of ones), each missing parameter is restored as a copy of its own
//    instead. A bias the exporter dropped as all zeros (a Linear's Gemm without C, a
//    LayerNormalization without B) is restored as zeros under its signature name.
//    Signature parameters that still have no tensor are named in one warning line.
#pragma once
#include <onnx/onnx_pb.h>

#include <unordered_map>

#include "ir/graph.h"
#include "ir/status.h"

namespace kiln::frontend {

/// The ONNX node each IR node was imported from (nodes made by lowerings map to the
/// lowered node).
using NodeOrigins = std::unordered_map<const ir::Node*, const onnx::NodeProto*>;

/// Steps 1-4 above on the imported graph `g` of `model` (nodes in topological order,
/// types not yet inferred). Adds notes to g.import_notes. Errors: none in practice (a
/// malformed signature is ignored: roles stay unknown).
Status resolve_initializers(const onnx::ModelProto& model, ir::Graph& g, const NodeOrigins& origins, bool untie);

/// The transpose of rank-2 tensor `t` ([r, c] -> [c, r], any dtype): a Linear weight
/// from the folded W^T the exporters store, and back when a trained model is written.
ir::Tensor transpose_2d(const ir::Tensor& t);

/// Makes a re-import of `model` train initializer `name` (already added to its graph,
/// with dims and data type) where its roles would not: with a torch.export signature, an
/// initializer without a kind; without one, a name the exporters generate
/// ("val_N", "onnx::...", which the name rule keeps constant). Writes a value_info carrying
/// "pkg.torch.export.graph_signature.InputSpec.kind" = PARAMETER, as the exporter writes its
/// own, with the signature placeholder where the signature lists `name` as a PARAMETER
/// target. Used when a trained model puts back a parameter the exporter merged or dropped,
/// or keeps an untied copy (--untie_initializers) trained. No-op where a kind is already
/// stated (a BUFFER stays one), where the name rule trains it, or for a name `model` has no
/// initializer of.
void declare_parameter(onnx::ModelProto& model, const std::string& name);

}  // namespace kiln::frontend
