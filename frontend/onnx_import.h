// ONNX -> IR import and IR -> ONNX export (libonnx + protobuf).
//
// Import accepts opsets 13..kMaxOpset of the default domain (the newest ONNX release's);
// models with an opset below 13 are first upgraded to opset 13 with libonnx's version
// converter (an op it cannot convert is an import error naming the file and the opset).
// Each node's op must be an ONNX op of kiln's op table or a lowered op (onnx_lower.h)
// whose ONNX schema versions (OpDef::onnx_since) cover the model's opset. For opsets
// libonnx 1.12 knows (<= 17) the model is also run through onnx::checker::check_model
// and onnx::shape_inference::InferShapes; newer opsets rely on kiln's own op-table
// inference (ir::infer_graph) alone. Tensor conversion: tensor_proto.h.
#pragma once
#include <map>
#include <memory>
#include <string>

#include "ir/graph.h"
#include "ir/status.h"

namespace kiln::frontend {

/// The opsets of the default ONNX domain kiln imports: older models are upgraded to
/// kMinOpset; kMaxOpset is the newest opset of the newest ONNX release kiln follows
/// (ONNX 1.23: opset 28).
inline constexpr int64_t kMinOpset = 13;
inline constexpr int64_t kMaxOpset = 28;

/// Options of an import.
struct ImportOptions {
  /// Values of ONNX dim_param symbols (e.g. {"batch": 8, "seq": 64}); unbound symbols stay
  /// symbolic; bindings of symbols that no graph input uses are ignored.
  std::map<std::string, int64_t> bind_dims;
  /// Fold shape-computation subgraphs (Shape, Gather, Concat, ...) once shapes are static.
  /// Read by driver::load_model, which runs the "fold_constants" pass after import:
  /// import_onnx itself only turns Constant nodes into initializers (frontend/ may not
  /// depend on passes/ or on the runtime's kernels).
  bool fold_constants = true;
  /// Graph inputs to import as initializers with the given values (dtype must match the
  /// declared one; the value's shape replaces the declared shape). kiln compiles for static
  /// shapes, so shape-like inputs (ReduceSum's axes, Reshape's shape, Slice's starts, ...)
  /// fed as graph inputs must be compile-time constants; such inputs are no longer graph
  /// inputs of the imported graph. Names that are not graph inputs are ignored.
  std::map<std::string, ir::Tensor> constant_inputs;
  /// Keep initializers apart that the importer would re-express as views of one
  /// parameter (ties restored from an exporter's copies, transposes, slices, broadcasts
  /// or Identity aliases; frontend/initializers.h): each copy trains on its own.
  bool untie_initializers = false;
};

/// Imports an ONNX model file. Errors (one line, naming the file and the node/op/initializer at fault):
/// unreadable or non-ONNX file, failed checker, unsupported op (with node name and opset),
/// missing initializer, external data outside the model's folder.
Expected<std::unique_ptr<ir::Graph>> import_onnx(const std::string& path, const ImportOptions& opts = {});

/// Parses "batch=8,seq=64" (a --shape flag) into {"batch": 8, "seq": 64}. Spaces around
/// names/values are ignored; "" gives an empty map. Errors name the bad item: missing '=',
/// empty name, a value that is not a non-negative integer, a name given twice.
Expected<std::map<std::string, int64_t>> parse_shape_bindings(const std::string& spec);

/// Writes `g` as an ONNX model (ir_version 8, opset g.opset, initializers as raw_data, graph
/// inputs/outputs with dtypes and shapes, symbolic dims as dim_param) that passes the ONNX
/// checker (checked before writing for opsets <= 17). Attributes named "kiln_*" are dropped.
/// Errors: a kiln-internal op (OpDef::onnx == false, named with its node), nested regions,
/// a value without dtype, an unwritable path. The file is written to "<path>.tmp" then renamed.
Status export_onnx(const ir::Graph& g, const std::string& path);

}  // namespace kiln::frontend
