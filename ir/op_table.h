// The op table: ONE entry per op kind (DESIGN.md invariant 1, convention 1).
//
// An entry holds the op's name, arity, attribute schema, type/shape inference,
// gradient rule (or an explicit "not differentiable"), precision policy, cost
// model, fusion class and eager kernel. Autodiff, autocast, remat, fusion, the
// memory planner and the eager interpreter all read this table; nothing keeps a
// private list of op names.
//
// The eager kernel field is filled at start-up by runtime/kernels
// (`kiln::runtime::register_eager_kernels()`), because the ir library cannot
// link the runtime. Everything else is set where the op is declared, in ir/ops/.
#pragma once
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "ir/graph.h"
#include "ir/status.h"
#include "ir/tensor.h"

namespace kiln::ir {

/// How code generation may group the op (DESIGN.md: pointwise / reduction / library / view).
/// collective: a communication op of data-parallel training (AllReduceStart, ReduceScatter,
/// AllGather, ...), never fused.
enum class FusionClass { pointwise, reduction, library, view, opaque, collective };
/// Mixed-precision policy: run in bf16 (fp32 accumulation), follow the widest input, or always fp32.
enum class PrecisionPolicy { low_precision, follow_inputs, fp32, not_float };

const char* fusion_class_name(FusionClass f);
const char* precision_policy_name(PrecisionPolicy p);

/// Attribute kinds of the schema.
enum class AttrKind { i, f, s, ints, floats, strings, tensor };
/// One attribute of an op's schema. Unknown attributes on a node are a verifier error.
struct AttrSpec {
  std::string name;
  AttrKind kind;
  bool required = false;
};

/// Element type and shape of one value.
struct TypeInfo {
  DType dtype = DType::undefined;
  Shape shape;
  bool present() const { return dtype != DType::undefined; }
};

/// Contents of an integer tensor as shape expressions, flattened row-major.
using SymValues = std::vector<SymExpr>;
/// Shape tensors longer than this are not tracked as expressions.
inline constexpr int64_t kMaxSymValues = 64;

/// Input of type/shape inference. `values[i]` is the constant value of input i
/// when known (initializers, folded constants, or every input in eager mode), else nullptr.
struct InferContext {
  const Node& node;
  std::vector<TypeInfo> in;  ///< dtype undefined for omitted optional inputs
  std::vector<const Tensor*> values;
  std::vector<TypeInfo> out;  ///< to be filled, one per node output
  /// Per input: its contents as shape expressions when they are symbolic (Value::sym_data), else null.
  std::vector<const SymValues*> syms;

  const Attributes& attrs() const { return node.attrs; }
  int num_inputs() const { return static_cast<int>(in.size()); }
  bool has_input(int i) const { return i < num_inputs() && in[i].present(); }
  const Tensor* value(int i) const { return i < static_cast<int>(values.size()) ? values[i] : nullptr; }
  /// Contents of integer input i, constant or symbolic; nullopt when unknown (or not an integer tensor).
  std::optional<SymValues> int_values(int i) const;
  /// The shape that 1-D integer input i holds (a Reshape, Expand or ConstantOfShape
  /// target, a gradient's input shape) when its contents are known: constants give
  /// static dims, symbolic entries symbolic ones, negative constants unknown ones.
  std::optional<Shape> shape_input(int i) const;
  /// Error naming the node and op.
  Status fail(const std::string& msg) const;
};

/// Cost of one execution of a node: floating-point operations and bytes moved.
struct Cost {
  double flops = 0;
  double bytes = 0;
};

/// Context of an eager kernel: inputs (nullptr for omitted optional ones), outputs
/// already allocated with the dtypes/shapes computed by the op's inference.
struct KernelContext {
  const Node& node;
  std::vector<const Tensor*> inputs;
  std::vector<Tensor> outputs;
  bool training = false;  ///< Dropout / BatchNormalization training behaviour
  uint64_t seed = 0;      ///< Philox seed of the run
  uint64_t step = 0;      ///< Philox offset base (advanced once per training step)
  uint64_t op_id = 0;     ///< stable id of the node in its graph (Philox subsequence)
  /// This node's slot for what its kernel prepares once and reuses on later calls (a
  /// oneDNN primitive with its descriptors); kept by the executor with the graph's facts
  /// (runtime::ScheduleCache), so it lives as long as the graph's node list. Null: no
  /// slot (one-off runs); a kernel then prepares per call. A kernel must check that what
  /// it finds was prepared for the same input dims and dtypes.
  std::shared_ptr<void>* cache = nullptr;
  /// Values of the graph's shape symbols in this run (bound from the dims of the fed
  /// inputs; SymInts evaluates its expressions with them); null: none bound.
  const std::map<std::string, int64_t>* symbols = nullptr;
  const Attributes& attrs() const { return node.attrs; }
  const Tensor& in(int i) const { return *inputs[i]; }
  bool has_input(int i) const { return i < static_cast<int>(inputs.size()) && inputs[i] != nullptr; }
  Tensor& out(int i) { return outputs[i]; }
  Status fail(const std::string& msg) const;
};

/// Context of a gradient rule, implemented by the autodiff pass. A rule reads the
/// forward node's inputs/outputs and output gradients and emits IR that computes
/// input gradients, with the same ops any graph uses (DESIGN.md convention 3).
class GradContext {
 public:
  virtual ~GradContext() = default;
  virtual const Node& node() const = 0;
  Value* input(int i) const { return node().input(i); }
  Value* output(int i) const { return node().output(i); }
  /// Gradient flowing into output i, or nullptr when that output does not reach the loss.
  virtual Value* grad_output(int i) = 0;
  /// True when input i needs a gradient (float, reaches a trainable parameter).
  virtual bool needs_grad(int i) const = 0;
  /// Records the gradient of input i (shape must equal the input's shape).
  virtual void set_grad_input(int i, Value* g) = 0;
  /// Emits a node into the backward graph; returns its outputs (shapes inferred).
  virtual std::vector<Value*> emit(const std::string& op, std::vector<Value*> inputs, int num_outputs,
                                   Attributes attrs = {}) = 0;
  Value* emit1(const std::string& op, std::vector<Value*> inputs, Attributes attrs = {}) {
    return emit(op, std::move(inputs), 1, std::move(attrs))[0];
  }
  /// Scalar or 1-D constants as initializers of the graph.
  virtual Value* const_f(double v, DType dtype) = 0;
  virtual Value* const_i64(const std::vector<int64_t>& v) = 0;
  /// 1-D i64 extents of `d` (ir::Builder::dims: a constant when static, else SymInts).
  virtual Value* dims(const std::vector<Dim>& d) = 0;
  /// Sums `g` over broadcast dims so its shape becomes `target`'s shape (ReduceSum + Reshape).
  virtual Value* unbroadcast(Value* g, const Value* target) = 0;
};

/// The shape of `v` as a 1-D i64 value for a gradient rule: a constant when static, the
/// dims' expressions (SymInts) when symbolic, a Shape node only when some dim is unknown
/// (a Shape node keeps `v` alive until the gradient reads it).
Value* shape_of(GradContext& g, Value* v);
/// Zeros shaped and typed like `v` for a gradient rule (ConstantOfShape of shape_of(v)).
Value* zeros_like(GradContext& g, Value* v);

/// Scalar primitives that pointwise code generation is built from (target-neutral:
/// codegen/ renders them as LLVM IR or CUDA C++). Float ops on bf16/f16 compute in f32
/// and round the result to the storage dtype, exactly as the eager kernels do.
enum class ScalarOp {
  add,
  sub,
  mul,
  div,
  pow,
  max,
  min,  // binary arithmetic (integer div truncates)
  neg,
  abs,
  exp,
  log,
  sqrt,
  erf,
  tanh,
  sin,
  cos,  // unary
  floor,
  lt,
  le,
  gt,
  ge,
  eq,  // comparisons -> boolean
  logical_and,
  logical_or,
  logical_xor,
  logical_not,
  select,  // select(cond, a, b)
  cast,    // to the Ref's dtype (float->int truncates)
  fma,     // fma(a, b, c) = a * b + c, one rounding (floats)
  ceil,
  round,  // ceil(x); round half to even (floats)
  fmod,   // fmod(a, b): remainder with a's sign (C fmod;
          // integers truncate, a % 0 = 0)
};
/// Name used by the kernel-IR printer ("add", "select", ...).
const char* scalar_op_name(ScalarOp op);

/// What a pointwise op's scalar rule writes one output element with (TVM's FTVMCompute,
/// one op, one entry). The code generator implements it; the rule never sees buffers,
/// strides or broadcasting.
class ScalarBuilder {
 public:
  using Ref = int;
  virtual ~ScalarBuilder() = default;
  virtual const Node& node() const = 0;
  /// True when optional input i is present.
  virtual bool has_input(int i) const = 0;
  /// The element of input i (numpy broadcasting is the generator's job), in that input's dtype.
  virtual Ref input(int i) = 0;
  /// A literal of dtype `dt`.
  virtual Ref constant(double v, DType dt) = 0;
  /// Applies a primitive; `dt` is the result dtype (arithmetic: the operands' dtype,
  /// comparisons and logic: boolean, cast: the target dtype).
  virtual Ref apply(ScalarOp op, std::vector<Ref> args, DType dt) = 0;
  virtual DType dtype(Ref r) const = 0;
  /// Row rules only (OpDef::row): the combination, ScalarOp::add (sum) or ScalarOp::max,
  /// of `x` over the op's row dims (OpDef::row_dims), in x's dtype (float sums accumulate
  /// in double); the result is the same at every element of a row. Scalar rules of
  /// pointwise ops never call it.
  virtual Ref reduce(ScalarOp combine, Ref x) = 0;
};
/// A pointwise op's element rule: fills `outputs` (one Ref per node output).
using ScalarFn = std::function<Status(ScalarBuilder&, std::vector<ScalarBuilder::Ref>& outputs)>;

using InferFn = std::function<Status(InferContext&)>;
using GradFn = std::function<Status(GradContext&)>;
using CostFn = std::function<Cost(const Node&)>;
using KernelFn = std::function<Status(KernelContext&)>;

/// An eager kernel's work as `count` independent pieces (KernelPiecesFn): `run(c)` for
/// c in [0, count), in any order, on any thread, together equal one kernel call.
struct KernelPieces {
  int64_t count = 0;
  std::function<void(int64_t)> run;
};
/// Checks a kernel call (the same errors as the kernel) and returns its work as pieces;
/// the context (its inputs and outputs) must outlive the pieces' runs.
using KernelPiecesFn = std::function<Expected<KernelPieces>(KernelContext&)>;

/// Whether an op has a gradient rule.
enum class Differentiability { differentiable, not_differentiable };

/// What passes, code generation, the runtime and the tools ask about an op kind, declared
/// with the op (OpDef::traits) instead of compared against its name anywhere else
/// (DESIGN.md invariant 1). Query with has_trait(). Bits of an OpTraits set.
enum class OpTrait : uint32_t {
  /// Same elements in the same order with new dims (Reshape, Flatten, Squeeze, Unsqueeze):
  /// the output may share the input's buffer (is_view_op).
  view = 1u << 0,
  /// Code generation reads input 0 through strides instead of running the op (Transpose,
  /// Expand, Slice, AsStrided; OpDef::strided_read gives the strides).
  strided_view = 1u << 1,
  /// Code generation reads the data inputs through guard boxes (Concat, constant Pad,
  /// SliceGrad, AsStridedScatter; ir::guarded_read in ir/ops/nn.h).
  guarded_view = 1u << 2,
  /// A generated kernel whose one region is its body, run as one step (FusedKernel):
  /// passes do not recurse into it as into a loop.
  fused_kernel = 1u << 3,
  /// A loop over micro-batches whose one region is its body, with `num_carried` carried
  /// inputs and scanned inputs after them (AccumulationLoop).
  loop = 1u << 4,
  /// Draws random numbers from a counter-based Philox stream (attribute `kiln_rng_id`,
  /// else the node's position): never folded at compile time, recomputed (remat) only
  /// with a stable stream id.
  random = 1u << 5,
  /// Dropout: (data, ratio?, training_mode?) -> output, mask?; an identity in eval mode;
  /// its Philox stream is `kiln_rng_id` (set by attach_loss), else its position.
  dropout = 1u << 6,
  /// Normalizes with batch statistics when attribute `training_mode` is 1 and updates
  /// running statistics (inputs 3 and 4 -> outputs 1 and 2), else uses them
  /// (BatchNormalization).
  running_stats = 1u << 7,
  /// Output 0 is input 0 unchanged (Identity).
  identity = 1u << 8,
  /// Converts input 0 to the dtype named by attribute `to` (an ONNX type code) (Cast).
  cast = 1u << 9,
  /// A float dtype of the output comes from an attribute: `to` (an ONNX type code) or
  /// the one-element tensor `value` (Cast, ConstantOfShape); to_float64 widens it.
  dtype_from_attr = 1u << 10,
  /// A matrix product of inputs 0 and 1 (MatMul, Gemm): low-precision products may be
  /// widened (passes/gemm_widening.cpp).
  matmul = 1u << 11,
  /// A matrix product that reads its operands transposed by any permutation of their
  /// dims given as attributes `kiln_perm_a` / `kiln_perm_b` (MatMul).
  operand_perms = 1u << 12,
  /// A 2-D matrix product that reads its operands transposed when attributes `transA` /
  /// `transB` are 1 (Gemm).
  operand_trans_flags = 1u << 13,
  /// Permutes the dims of input 0 by attribute `perm` (reversed when absent) (Transpose).
  transpose = 1u << 14,
  /// Picks slices of input 0 (a table) at the indices in input 1 along attribute `axis`
  /// (Gather: embedding lookups).
  gather = 1u << 15,
  /// An optional input may be omitted (null) before a present one, so IR builders pass
  /// null inputs through (Clip's min, Dropout's ratio).
  omittable_inputs = 1u << 16,
  /// This rank's shard of input 0 in a data-parallel job (Shard: ZeRO-1's optimizer
  /// reads its slice of a parameter or gradient); passes/data_parallel.cpp turns the
  /// all-reduce of a gradient that only shards read into a reduce-scatter.
  rank_shard = 1u << 17,
};
/// A set of OpTrait bits.
using OpTraits = uint32_t;
/// The set holding `a` and `b`.
constexpr OpTraits operator|(OpTrait a, OpTrait b) { return static_cast<OpTraits>(a) | static_cast<OpTraits>(b); }
/// The set `a` with `b` added.
constexpr OpTraits operator|(OpTraits a, OpTrait b) { return a | static_cast<OpTraits>(b); }

/// How code generation reads input 0 of a strided view (OpTrait::strided_view or view)
/// at the index of its output: input element offset + sum i_d * strides[d] (dims of
/// size 1 get stride 0).
struct StridedRead {
  std::vector<SymExpr> strides;  ///< constants, or expressions over the shape symbols
  int64_t offset = 0;
};

/// Element strides reading a dense row-major tensor of `shape` at each index of a
/// rank-`domain_rank` domain (numpy broadcasting: right-aligned, 0 along missing leading
/// dims and dims of static extent 1), as expressions over its symbolic dims; nullopt when
/// a dim is unknown or the shape has the higher rank.
std::optional<std::vector<SymExpr>> broadcast_strides(const Shape& shape, int domain_rank);

/// One op kind.
struct OpDef {
  std::string name;
  std::string doc;  ///< one line; cites the ONNX spec or the paper
  int min_inputs = 0, max_inputs = 0;
  int min_outputs = 1, max_outputs = 1;
  std::vector<AttrSpec> attrs;
  InferFn infer;
  Differentiability diff = Differentiability::not_differentiable;
  GradFn grad;  ///< set iff diff == differentiable
  PrecisionPolicy precision = PrecisionPolicy::follow_inputs;
  CostFn cost;  ///< optional; default_cost used when empty
  FusionClass fusion = FusionClass::opaque;
  KernelFn kernel;  ///< eager CPU kernel (filled by the runtime)
  /// The eager kernel writes every element of every output whatever the inputs, so the
  /// interpreter allocates its outputs without zero-filling them (set by the runtime
  /// beside `kernel`; false: outputs start as zeros, as kernels that accumulate need).
  bool kernel_writes_all_outputs = false;
  /// The op may join a multi-tensor launch (passes/multi_tensor.cpp: with the other
  /// per-parameter updates of a step, in one parallel region): set with the op for
  /// updates whose eager kernel also comes as `pieces`.
  bool multi_tensor = false;
  /// Outputs whose eager kernel may write into an input's buffer: entry j is the input
  /// index output j may share (-1: none). Only for kernels that read every element of
  /// that input before writing the same element of the output, and no other element
  /// after it (set with the op: every kernel of it must honour it;
  /// passes/fused_inplace.cpp donates state inputs through it, kiln_donate).
  std::vector<int> in_place_outputs;
  /// Piece-wise form of `kernel` (filled by the runtime beside it; empty: none). The
  /// executor runs a multi-tensor group's pieces from one list over all threads.
  KernelPiecesFn pieces;
  /// Element rule of a pointwise op for code generation (empty: the fusion pass never
  /// puts the op in a generated kernel; it runs as its own step).
  ScalarFn scalar;
  /// Reductions code generation can emit (axes from ir/ops/nn.h reduce_spec): how two
  /// elements combine, ScalarOp::add (ReduceSum) or ScalarOp::max (ReduceMax); unset
  /// for every other op.
  std::optional<ScalarOp> reduce_combine;
  /// Row rule of a row-reduction op (Softmax, LogSoftmax and their gradients,
  /// LayerNormalization): every output element as an expression over the inputs'
  /// elements at the same index (numpy broadcasting) and ScalarBuilder::reduce over
  /// `row_dims`. Outputs whose shape is 1 along the row dims (LayerNormalization's Mean)
  /// must be row-invariant. The fusion pass puts such an op, with pointwise prologue and
  /// epilogue, in one generated "row" kernel (codegen/kernel_ir.h, reduce expressions).
  ScalarFn row;
  /// The dims of input 0 that `row` reduces over, for node `n` with static shapes; an
  /// error when the node's attributes are invalid.
  std::function<Expected<std::vector<int>>(const Node& n)> row_dims;
  /// Collectives (FusionClass::collective) that launch one: the bytes one rank sends for
  /// node `n` in a job of `world` ranks (runtime/comm.h counts the same). Empty: not a
  /// collective launch (Shard, AllReduceWait, every other op).
  std::function<int64_t(const Node& n, int64_t world)> comm_bytes;
  bool onnx = true;  ///< an ONNX op (imported/exported by name) vs a kiln-internal op
  /// ONNX ops: the since-versions of the op's ONNX schema that kiln implements, from the
  /// one in force at opset 13 (the oldest opset kiln imports without upgrading) to the
  /// newest at kiln's newest opset (frontend::kMaxOpset), ascending. A node of a model at
  /// opset N has the largest version <= N; the importer refuses an op whose list is
  /// empty or starts above N. tests/ir/op_table_test.cpp compares every list with ONNX's
  /// schema history (tests/data/onnx_schema_versions.json).
  std::vector<int> onnx_since;
  /// What the op is, for the passes, code generation, runtime and tools that ask (OpTrait bits).
  OpTraits traits = 0;
  /// The input a node returns unchanged (same dtype and static shape as its output), or
  /// nullptr: canonicalize replaces the node's output by it (Identity, a no-op Reshape,
  /// Expand or Pad, a Where with a constant all-true or all-false condition).
  std::function<Value*(const Node& n)> passthrough;
  /// Output values computed from the static shapes of the inputs alone (Shape), for
  /// constant folding without the data; nullopt when the shapes are not static enough.
  std::function<std::optional<std::vector<Tensor>>(const Node& n)> eval_from_shapes;
  /// Integer outputs as shape expressions of the inputs' shapes and contents
  /// (InferContext::int_values), after `infer` filled the output types: Shape of a
  /// symbolic tensor, and the Gather / Concat / Unsqueeze / arithmetic of the shape
  /// subgraphs exports write (ir/ops/sym_values.cpp). Per output, nullopt when unknown.
  /// Inference stores them in Value::sym_data, so that Reshape, Expand, Range and
  /// ConstantOfShape give symbolic dims, and fold_constants turns such nodes into
  /// SymInts nodes.
  std::function<std::vector<std::optional<SymValues>>(const InferContext& c)> sym_values;
  /// Bytes of scratch memory the eager kernel allocates for node `n` beyond its outputs
  /// (the memory planner counts them as temporaries); empty: none.
  std::function<int64_t(const Node& n)> kernel_scratch_bytes;
  /// Strided views (OpTrait::strided_view, view): whether code generation can absorb
  /// node `n` (static shapes, constant operands already checked by the caller) ...
  std::function<bool(const Node& n)> view_fusable;
  /// ... and how it then reads input 0 (static shapes; errors name the node).
  std::function<Expected<StridedRead>(const Node& n)> strided_read;
  /// Rewrite of a node into simpler ops that code generation can fuse, applied by
  /// passes/decompose.cpp before fusion (the eager backend keeps the op): `decomposable`
  /// says whether node `n` of graph `g` qualifies; `decompose` removes it from `g` and
  /// appends its replacement (constants into `root`, the outermost graph), keeping the
  /// names of the outputs that something reads.
  std::function<bool(const Graph& g, const Node& n)> decomposable;
  std::function<Status(Graph& g, Graph& root, Node* n)> decompose;
};

/// Whether op `op` is in the table and declares `t`.
bool has_trait(const std::string& op, OpTrait t);
/// Whether node `n`'s op declares `t`.
bool has_trait(const Node& n, OpTrait t);

/// Reshape-family ops whose output is its input's elements in the same order with new
/// dims (OpTrait::view): the interpreter and the memory planner let the output share the
/// input's buffer when the input dies at that node.
bool is_view_op(const std::string& op);
/// Ops code generation reads through strides instead of running (passes/fusion.cpp,
/// codegen/lower.cpp): OpTrait::strided_view (Transpose, Expand, Slice, AsStrided) and
/// the is_view_op family (the dense strides of the output dims).
bool is_strided_view_op(const std::string& op);

/// Ops code generation reads through guarded parameters (OpTrait::guarded_view;
/// codegen/kernel_ir.h: a load that gives a fallback outside a box of the domain) instead
/// of running them: Concat (each input a box along the axis), Pad in constant mode (the
/// input a box, the constant outside), the kiln-internal SliceGrad with unit steps (dy a
/// box, zeros outside) and AsStridedScatter whose written elements form a box of the data
/// (src inside, data outside). ir::guarded_read (ir/ops/nn.h) gives the box.
bool is_guarded_view_op(const std::string& op);

/// The table. Access with OpTable::get(); entries are registered once on first use.
class OpTable {
 public:
  static OpTable& get();
  const OpDef* find(const std::string& name) const;
  OpDef* find_mutable(const std::string& name);
  /// Adds an entry (aborts on a duplicate name: a programming error).
  OpDef& add(OpDef def);
  const std::map<std::string, OpDef>& all() const { return ops_; }

 private:
  std::map<std::string, OpDef> ops_;
};

/// Starts a one-output op entry: name, doc, input arity, inference, precision and fusion
/// class (not differentiable until add_differentiable marks it).
OpDef make_op(const std::string& name, const std::string& doc, int min_in, int max_in, InferFn infer,
              PrecisionPolicy prec, FusionClass fusion = FusionClass::pointwise);
/// Adds `traits` to the entry of op `name` (aborts when the op is missing: a programming error).
void add_traits(OpTable& t, const char* name, OpTraits traits);
/// Sets OpDef::onnx_since of op `name` (aborts when the op is missing: a programming error).
void set_onnx_since(OpTable& t, const char* name, std::vector<int> versions);
/// Adds `d` to the table as differentiable, with gradient rule `g`.
void add_differentiable(OpTable& t, OpDef d, GradFn g);

/// Runs the op's inference on `n` from its inputs' current types (and the constant
/// data of initializer inputs) and writes dtype/shape to its outputs.
Status infer_node(Node& n);
/// Infers every node of `g` in order.
Status infer_graph(Graph& g);

/// Binds symbolic dims (issue 32): replaces the symbols of `values` by their values in
/// every dim of `g` (inputs, outputs, node outputs, nested regions) and in the
/// expressions of its SymInts nodes, then re-infers the graph; symbols `values` leaves
/// out stay symbolic (batch*seq with batch=2 becomes 2*seq). Inference computes the
/// contents of shape subgraphs only where an input is symbolic: a Shape of a tensor that
/// binding made static is left to fold_constants, as in any static graph. Errors:
/// inference's, when a bound shape contradicts the graph (one line naming the node).
Status bind_symbols(Graph& g, const std::map<std::string, int64_t>& values);
/// Cost of a node from the table (default: bytes of inputs and outputs, flops = output numel).
Cost node_cost(const Node& n);
/// node_cost of `n` with the symbols of its values' dims replaced by `values` (a symbolic
/// program's cost at its bound, issue 32): evaluated on a copy of the node over copies of
/// its values; node_cost(n) when `values` is empty or `n`'s shapes are static.
Cost node_cost_at(const Node& n, const std::map<std::string, int64_t>& values);

// ---- Helpers shared by inference functions and eager kernels ----

/// Numpy-style multidirectional broadcast of two shapes; error when incompatible.
Expected<Shape> broadcast_shapes(const Shape& a, const Shape& b);
/// Normalises a possibly negative axis for rank r: axis in [-r, r) (none for a scalar);
/// error when out of range.
Expected<int> normalize_axis(int64_t axis, int rank);

/// Registration functions of the op groups (each in ir/ops/<group>.cpp).
void register_elementwise_ops(OpTable& t);
void register_shape_ops(OpTable& t);
void register_nn_ops(OpTable& t);
void register_reduction_ops(OpTable& t);
void register_loss_ops(OpTable& t);
void register_training_ops(OpTable& t);
void register_optim8bit_ops(OpTable& t);  ///< ir/ops/optim8bit.cpp (8-bit AdamW state)
void register_control_ops(OpTable& t);
void register_collective_ops(OpTable& t);  ///< ir/ops/collective.cpp
/// ZeRO-1: elements of one rank's shard of a tensor of `numel` elements on `ranks` ranks,
/// ceil(ceil(numel / 256) / ranks) * 256 (whole 256-element blocks: the 8-bit optimizer
/// state's blocks stay on one rank). Rank r holds elements [r*S, (r+1)*S).
int64_t shard_elems(int64_t numel, int64_t ranks);
void register_indexing_ops(OpTable& t);  ///< ir/ops/indexing.cpp (GatherElements, ScatterND, CumSum, ...)
/// Fills OpDef::scalar of the pointwise ops (ir/ops/elementwise.cpp), after every op is registered.
void register_scalar_rules(OpTable& t);
/// Sets OpDef::traits and the per-op hooks of ir/ops/traits.cpp, after every op is registered.
void register_op_traits(OpTable& t);
/// Sets OpDef::decomposable / decompose (ir/ops/decompose.cpp), after every op is registered.
void register_decompositions(OpTable& t);
/// OpDef::sym_values of the ops that compute shapes, and the kiln-internal SymInts op
/// (ir/ops/sym_values.cpp).
void register_sym_values(OpTable& t);

}  // namespace kiln::ir
