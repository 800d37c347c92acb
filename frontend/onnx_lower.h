// Import-time lowerings of ONNX ops that kiln does not keep as ops of its own
// (DESIGN.md convention 2, "small primitive core"): each is rewritten into ops of the
// table as it is imported, so autodiff, autocast, fusion and the memory planner see
// only primitives, and the op's gradient, precision policy and fused kernels are
// those of its decomposed form.
//
//  - Attention-23/24/25, RotaryEmbedding-23 and RMSNormalization-23: ONNX defines them
//    by function bodies; the lowerings follow those bodies and ONNX's reference
//    implementation (onnx/reference/ops/op_attention.py, ...), e.g. Q and K scaled by
//    sqrt(scale) each, interleaved-repeat of key/value heads for grouped-query attention,
//    bottom-right causal alignment, a fully masked query row giving a zero output row.
//  - Einsum-12/28: transposes, reshapes, one batched MatMul per operand pair and
//    ReduceSum for letters summed in one operand only (no repeated letter in a term).
//  - SplitToSequence-11/24, SequenceAt, ConcatFromSequence, SequenceConstruct,
//    SequenceLength, SequenceInsert, SequenceErase, SequenceEmpty: kiln has no sequence
//    values; a sequence whose length and positions are known at import is a list of
//    tensors held by the importer, and these ops become Split / Concat / Unsqueeze /
//    Identity nodes or constants.
#pragma once
#include <functional>
#include <map>
#include <string>
#include <unordered_map>
#include <vector>

#include "ir/graph.h"
#include "ir/status.h"

namespace kiln::frontend {

/// One ONNX node being lowered, and the importer services a lowering uses.
class LowerContext {
 public:
  virtual ~LowerContext() = default;
  virtual const std::string& op() const = 0;
  /// The node's name (generated names of its IR nodes and values start with it).
  virtual const std::string& name() const = 0;
  virtual const ir::Attributes& attrs() const = 0;
  /// The model's opset of the default domain.
  virtual int64_t opset() const = 0;
  /// Input i as a tensor value (nullptr when omitted or a sequence).
  virtual ir::Value* input(int i) const = 0;
  virtual int num_inputs() const = 0;
  /// Input i as a sequence held by the importer (nullptr when it is not one).
  virtual const std::vector<ir::Value*>* sequence_input(int i) const = 0;
  /// Number of the node's outputs (trailing omitted ones dropped) and whether output k is used.
  virtual int num_outputs() const = 0;
  virtual bool has_output(int k) const = 0;
  /// Adds an IR node (types inferred at once where its inputs' are known) and returns its
  /// outputs. `out_names`: explicit value names (empty entries get generated ones).
  virtual std::vector<ir::Value*> emit(const std::string& op, std::vector<ir::Value*> inputs, int num_outputs,
                                       ir::Attributes attrs = {}, std::vector<std::string> out_names = {}) = 0;
  ir::Value* emit1(const std::string& op, std::vector<ir::Value*> inputs, ir::Attributes attrs = {},
                   const std::string& out_name = "") {
    return emit(op, std::move(inputs), 1, std::move(attrs), {out_name})[0];
  }
  /// A new initializer (a constant of the lowering).
  virtual ir::Value* constant(ir::Tensor t) = 0;
  ir::Value* const_i64(const std::vector<int64_t>& v) { return constant(ir::Tensor::from_i64(v)); }
  /// A scalar of dtype `dt` holding `v`.
  virtual ir::Value* scalar(double v, ir::DType dt) = 0;
  /// The ONNX name of output k: the value computing it must carry this name (emit's
  /// out_names), or be passed to define_output.
  virtual std::string output_name(int k) const = 0;
  /// Binds output k to an existing value (an Identity carries the output's name).
  virtual Status define_output(int k, ir::Value* v) = 0;
  /// Binds output k to a sequence of tensors.
  virtual Status define_sequence(int k, std::vector<ir::Value*> items) = 0;
  /// Error naming the model, node and op.
  virtual Status fail(const std::string& msg) const = 0;
};

using LowerFn = std::function<Status(LowerContext&)>;

/// A lowered op: the since-versions of its ONNX schema that the lowering implements
/// (from the one in force at opset 13, or the op's first, up to kiln's newest opset;
/// as OpDef::onnx_since) and the lowering.
struct Lowering {
  std::vector<int> onnx_since;
  LowerFn lower;
};

/// The lowered ops: ONNX op name -> lowering. An op here is importable although the op
/// table has no entry for it.
const std::map<std::string, Lowering>& onnx_lowerings();

/// True when the importer can bring op `op` of the default domain into the IR: an ONNX
/// op of the op table or a lowered op (what `kiln` supports).
bool importable_op(const std::string& op);

}  // namespace kiln::frontend
