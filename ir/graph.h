// The kiln IR: Values, Nodes, Graphs with nested regions, typed attributes.
//
// A Graph owns its Nodes (kept in topological order) and its Values. A Value is
// produced by exactly one Node output, or is a graph input, or an initializer
// (a named constant tensor: parameters and folded constants). Node inputs may be
// nullptr for omitted optional ONNX inputs. Uses are computed on demand.
#pragma once
#include <cstdint>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <unordered_map>
#include <unordered_set>
#include <variant>
#include <vector>

#include "ir/dtype.h"
#include "ir/status.h"
#include "ir/sym_expr.h"
#include "ir/tensor.h"

namespace kiln::ir {

/// One dimension: a static extent (value >= 0), a symbolic extent (an expression over
/// named symbols such as ONNX dim_params: `seq`, `batch*seq`; ir/sym_expr.h), or
/// unknown (neither).
struct Dim {
  int64_t value = -1;
  SymExpr expr;  ///< the symbolic extent when value < 0 (never a constant; empty: unknown)
  Dim() = default;
  Dim(int64_t v) : value(v) {}  // NOLINT(implicit)
  /// The symbol `sym` (ONNX dim_param).
  explicit Dim(const std::string& sym) : expr(SymExpr::symbol(sym)) {}
  /// An expression: static when it is a constant >= 0, unknown when it is another
  /// constant or overflowed.
  explicit Dim(const SymExpr& e);
  bool is_static() const { return value >= 0; }
  bool is_symbolic() const { return value < 0 && !expr.is_constant(); }
  bool is_unknown() const { return !is_static() && !is_symbolic(); }
  /// The name of a dim that is one symbol, else "".
  std::string symbol() const { return is_symbolic() ? expr.as_symbol() : std::string(); }
  /// The extent as an expression (a constant for static dims); nullopt when unknown.
  std::optional<SymExpr> as_expr() const;
  /// "64", "batch*seq", or "?".
  std::string to_string() const;
  /// Reads to_string()'s text: "?" unknown, an integer, an expression (SymExpr::parse),
  /// else one symbol named by the whole text (ONNX dim_params may be any string).
  static Dim from_text(const std::string& text);
  bool operator==(const Dim& o) const { return value == o.value && expr == o.expr; }
  bool operator!=(const Dim& o) const { return !(*this == o); }
};

/// Products, sums and exact quotients of dims (unknown when an operand is unknown or
/// the quotient is not exact).
Dim operator*(const Dim& a, const Dim& b);
Dim operator+(const Dim& a, const Dim& b);
Dim operator-(const Dim& a, const Dim& b);
Dim dim_exact_div(const Dim& a, const Dim& b);

/// Tensor shape: rank and per-dimension extents (static or symbolic).
struct Shape {
  std::vector<Dim> dims;
  Shape() = default;
  Shape(std::vector<Dim> d) : dims(std::move(d)) {}  // NOLINT(implicit)
  static Shape of(const std::vector<int64_t>& v);
  int rank() const { return static_cast<int>(dims.size()); }
  bool is_static() const;
  /// Every dim static or symbolic (none unknown): code generation can address it.
  bool is_known() const;
  /// The shape with the symbols of `values` replaced by their values (`batch*seq` with
  /// batch=2 is `2*seq`; a dim naming only bound symbols becomes static).
  Shape bound(const std::map<std::string, int64_t>& values) const;
  /// Static dims as int64 (-1 for non-static ones).
  std::vector<int64_t> to_vector() const;
  /// Product of static dims; -1 if any dim is not static; 0 when a dim is 0; INT64_MAX
  /// when the product overflows int64 (saturated, so a caller's size limit refuses it:
  /// import refuses values above 2^62 bytes, driver.cpp check_value_sizes).
  int64_t numel() const;
  std::string to_string() const;
  bool operator==(const Shape& o) const { return dims == o.dims; }
};

class Node;
class Graph;

/// What an initializer is to training, as far as the model file says.
enum class InitRole {
  unknown,    ///< the file does not say: kiln's name rule decides (is_parameter_candidate)
  parameter,  ///< trainable (a PyTorch nn.Parameter)
  buffer,     ///< saved state that is not trained (BatchNorm statistics, rotary inv_freq)
  constant,   ///< a constant of the graph (computed or folded by the exporter)
};
const char* init_role_name(InitRole r);

/// Where the memory plan placed a value in its program's step arena (the compiled
/// executor's one block, runtime/arena.h), written by the arena planning pass that runs
/// last (passes/arena_plan.cpp) and printed in the IR dump as `@arena(OFFSET, BYTES)`
/// (`, home` when the value's node writes it there; the others get there by in-place
/// and view rules). offset < 0: not in the arena (heap, graph inputs, kept values).
struct ArenaPlacement {
  int64_t offset = -1;  ///< bytes from the block's start
  int64_t bytes = 0;    ///< the planned buffer's size in bytes
  bool home = false;
  bool placed() const { return offset >= 0; }
};

/// An SSA value: the result of one node output, a graph input or an initializer.
class Value {
 public:
  std::string name;
  DType dtype = DType::undefined;
  Shape shape;
  Node* producer = nullptr;  ///< null for graph inputs and initializers
  int producer_output = -1;  ///< index into producer->outputs
  /// Set for initializers (parameters, folded constants).
  std::shared_ptr<Tensor> data;
  bool is_initializer() const { return data != nullptr; }
  /// Initializers (and the inputs attach_loss makes of them): the role the importer read
  /// from the model (frontend/initializers.h) and where it came from, for `kiln inspect`.
  InitRole role = InitRole::unknown;
  std::string role_source;
  /// Its place in the step arena, once the arena planning pass ran (ArenaPlacement).
  ArenaPlacement arena;
  /// Contents of a small integer value known as expressions of shape symbols (Shape of a
  /// symbolic tensor, what the shape subgraph of an export computes from it, a SymInts
  /// node, constant once its symbols are bound), flattened row-major; null when unknown
  /// or when no input of its node is symbolic. Written by inference (OpDef::sym_values),
  /// derived: not serialized.
  std::shared_ptr<const std::vector<SymExpr>> sym_data;
};

/// Attribute value: int, float, string, tensor, or lists of int/float/string.
using AttrValue = std::variant<int64_t, double, std::string, std::vector<int64_t>, std::vector<double>,
                               std::vector<std::string>, Tensor>;

/// Named attributes, ordered by name (for stable printing).
class Attributes {
 public:
  bool has(const std::string& k) const { return map_.count(k) != 0; }
  void set(const std::string& k, AttrValue v) { map_[k] = std::move(v); }
  void erase(const std::string& k) { map_.erase(k); }
  int64_t get_int(const std::string& k, int64_t def) const;
  double get_float(const std::string& k, double def) const;
  std::string get_string(const std::string& k, const std::string& def) const;
  std::vector<int64_t> get_ints(const std::string& k, const std::vector<int64_t>& def = {}) const;
  std::vector<double> get_floats(const std::string& k, const std::vector<double>& def = {}) const;
  std::vector<std::string> get_strings(const std::string& k) const;
  const Tensor* get_tensor(const std::string& k) const;
  const AttrValue* find(const std::string& k) const;
  const std::map<std::string, AttrValue>& all() const { return map_; }

 private:
  std::map<std::string, AttrValue> map_;
};

/// An operation. `op` names an entry of the op table (ONNX op names for ONNX ops).
class Node {
 public:
  std::string op;
  std::string name;
  std::vector<Value*> inputs;  ///< nullptr entries for omitted optional inputs
  std::vector<Value*> outputs;
  Attributes attrs;
  /// Nested regions (e.g. the body of a gradient-accumulation loop).
  std::vector<std::unique_ptr<Graph>> regions;
  Graph* owner = nullptr;

  Value* input(int i) const { return i < static_cast<int>(inputs.size()) ? inputs[i] : nullptr; }
  Value* output(int i) const { return outputs[i]; }
  int num_inputs() const { return static_cast<int>(inputs.size()); }
  int num_outputs() const { return static_cast<int>(outputs.size()); }
  /// Every input given and every output has a static shape (omitted optional inputs are
  /// skipped): what the node costs and computes is known before it runs.
  bool shapes_static() const {
    for (const Value* v : inputs)
      if (v && !v->shape.is_static()) return false;
    for (const Value* v : outputs)
      if (!v || !v->shape.is_static()) return false;
    return true;
  }
};

/// A use of a value: node `user` reads it as input `index`.
struct Use {
  Node* user;
  int index;
};

/// State carried from one training step to the next: the step reads `input`
/// (a graph input) and produces `output` (also a graph output); the trainer feeds
/// `output` back as the next step's `input`. `initial` is the value before step 1
/// (parameters: the ONNX initializer; optimizer state: zeros).
struct StateBinding {
  std::string kind;  ///< "parameter", "optimizer_state", "buffer" (BatchNorm running stats), "counter"
  Value* input = nullptr;
  Value* output = nullptr;
  std::shared_ptr<Tensor> initial;
  /// ZeRO-1 (passes/optimizer.cpp with zero_shards > 1): the binding holds this rank's
  /// shard of a tensor of dims `full_dims`, flattened (rank r: elements [r*S, (r+1)*S) of
  /// it, S = the shard's numel, zeros past the end); checkpoints hold the whole tensor.
  /// Empty: the binding holds the whole tensor.
  std::vector<int64_t> full_dims;
};

/// Where a trainable initializer sits in the model file it was imported from, when not
/// (only) as the file's initializer of its own name (frontend/initializers.h): how a
/// trained value is written back into that file (tools/driver/export_trained.cpp).
struct InitializerOrigin {
  /// The file's initializer holding it, or a view of it (empty: none; it is added).
  std::string onnx_name;
  /// What that initializer holds: "" the tensor itself, "transpose" (rank 2), "slice"
  /// (its leading part along the first non-unit dim), "broadcast" (repeated along new
  /// leading dims).
  std::string view;
  /// onnx_name empty: index of the file's node that reads the added initializer, as input
  /// `input` (appended when past the node's inputs; -1: added to the node's output 0,
  /// a Linear's dropped bias; kReplacesNode: the node, an Identity alias, is replaced by
  /// the initializer, which takes its output's name).
  int node = -1;
  int input = -1;
  static constexpr int kReplacesNode = -2;
};

/// A graph (or region): nodes in topological order, inputs, outputs, initializers.
class Graph {
 public:
  std::string name = "main";
  std::vector<Value*> inputs;  ///< runtime inputs (not initializers)
  std::vector<Value*> outputs;
  std::vector<Value*> initializers;  ///< values with data, in insertion order
  /// Training state (empty for inference graphs), printed in the IR dump.
  std::vector<StateBinding> state;
  /// Optional opset version of the default ONNX domain the graph came from.
  int64_t opset = 17;
  /// One-line notes of the importer for the user (restored ties and parameters, roles of
  /// initializers read from the exporter's metadata); printed once by the driver.
  std::vector<std::string> import_notes;
  /// Trainable initializers the importer re-expressed (restored, renamed or tied): their
  /// places in the model file, by IR name (absent: the file's initializer of that name).
  std::map<std::string, std::vector<InitializerOrigin>> initializer_origins;
  /// Defaults of graph inputs that a caller may leave unfed (ONNX: an initializer that is
  /// also a graph input), by input name: a program's run-time settings, such as the LR
  /// schedule's step counts (passes/optimizer.cpp, kScheduleTotalInput), which the trainer
  /// feeds from its run so that one compiled program serves any --max_steps.
  std::map<std::string, std::shared_ptr<Tensor>> input_defaults;
  /// Written by the arena planning pass (top-level graphs): the step arena's size in
  /// bytes and the plan's peak bytes of one step (-1: not planned); printed in the dump.
  int64_t arena_bytes = -1;
  int64_t planned_peak_bytes = -1;

  Graph() = default;
  Graph(const Graph&) = delete;
  Graph& operator=(const Graph&) = delete;

  /// Creates a fresh value; the name is made unique by suffixing ".N" if taken.
  Value* new_value(const std::string& name, DType dtype = DType::undefined, Shape shape = {});
  /// Adds a graph input.
  Value* add_input(const std::string& name, DType dtype, Shape shape);
  /// Adds an initializer holding `t` (dtype and shape taken from it).
  Value* add_initializer(const std::string& name, Tensor t);
  /// Appends a node at the end. Output values are created with the given names.
  Node* add_node(const std::string& op, const std::string& name, std::vector<Value*> inputs,
                 const std::vector<std::string>& output_names, Attributes attrs = {});
  /// Inserts a node before position `pos` (index into nodes()).
  Node* insert_node(size_t pos, const std::string& op, const std::string& name, std::vector<Value*> inputs,
                    const std::vector<std::string>& output_names, Attributes attrs = {});
  /// Removes a node (its outputs must be unused). The node's output values stay owned but orphaned.
  void remove_node(Node* n);
  /// Replaces every use of `from` (node inputs, graph outputs and state-binding outputs) by `to`.
  void replace_all_uses(Value* from, Value* to);
  /// Removes initializers that no node, output or state binding uses.
  void remove_unused_initializers();
  /// Removes nodes whose outputs are transitively unused by graph outputs. Returns count removed.
  int dead_code_elimination();

  const std::vector<std::unique_ptr<Node>>& nodes() const { return nodes_; }
  std::vector<std::unique_ptr<Node>>& mutable_nodes() {
    touch();
    return nodes_;
  }
  /// Identity of the node list: a number no other graph state (this graph's earlier node
  /// lists, any other graph's) has had, renewed whenever nodes are added, removed or
  /// reordered (and on mutable_nodes()). Executor caches key on it (runtime::ScheduleCache).
  uint64_t structure_id() const { return structure_id_; }
  /// Position of `n` in nodes(), or -1.
  int index_of(const Node* n) const;
  /// Finds a value by name (inputs, initializers, node outputs), or nullptr.
  Value* find_value(const std::string& name) const;
  /// All uses of `v` by nodes of this graph (not nested regions).
  std::vector<Use> uses(const Value* v) const;
  bool is_graph_output(const Value* v) const;
  /// Creates a unique value name derived from `base`.
  std::string unique_name(const std::string& base);
  /// Gives `v` (a value of this graph) the name unique_name(`base`) and returns it; the
  /// old name no longer finds it.
  const std::string& rename_value(Value* v, const std::string& base);
  /// Deep copy of the whole graph (tensor data shared, not copied).
  std::unique_ptr<Graph> clone() const;
  /// Sorts nodes topologically (stable with respect to the current order). Error on a cycle.
  Status topo_sort();

 private:
  std::vector<std::unique_ptr<Node>> nodes_;
  static uint64_t next_structure_id();
  void touch() { structure_id_ = next_structure_id(); }
  uint64_t structure_id_ = next_structure_id();
  std::vector<std::unique_ptr<Value>> values_;
  std::map<std::string, Value*> by_name_;
};

/// Values a region reads from its enclosing graphs (implicit captures, as ONNX Loop/Scan
/// bodies read outer scope), nested regions included; added to `out`. The interpreter's
/// liveness, the memory planner and topo_sort treat them as inputs of the region's node.
void collect_captures(const Graph& region, std::unordered_set<const Value*>& out);

/// Index of the last node of `g` that reads each value (a region's captures count as
/// reads of its node): the interpreter frees a value right after it, and passes that
/// reuse a dying input's buffer ask whether a node is that last reader.
std::unordered_map<const Value*, size_t> last_reads(const Graph& g);

/// Graph inputs of `g` that only top-level AccumulationLoop nodes read, as scan inputs
/// (not carried, not read by another node, not graph outputs): the data a runtime may
/// stream one microbatch at a time (runtime::RunOptions::microbatch) and the memory
/// planner then never counts whole (passes::PlanOptions::streamed_microbatches).
std::unordered_set<const Value*> streamable_scan_inputs(const Graph& g);

/// Position of the "/grad" scope segment in a node name (autodiff names backward nodes
/// `<node>/grad/...`, DESIGN.md convention 3), followed by '/' or the end; npos if none.
size_t grad_scope_pos(const std::string& node_name);
/// True for a backward node's name (grad_scope_pos != npos).
inline bool in_grad_scope(const std::string& node_name) { return grad_scope_pos(node_name) != std::string::npos; }

/// Name of the scalar graph input that gradient accumulation with token normalization
/// adds (passes/attach_loss.cpp) and the trainer feeds: the count of real labels over
/// the whole optimizer step (Hugging Face's num_items_in_batch).
inline constexpr const char* kNumItemsInput = "num_items_in_batch";

/// Scalar graph inputs of the LR schedule (passes/optimizer.cpp; Graph::input_defaults
/// hold the values the program was built with): the run's optimizer steps T, warmup
/// steps W and max(1, T - W), in the step counter's dtype. The trainer feeds them from
/// the run it trains (runtime/trainer.cpp).
inline constexpr const char* kScheduleTotalInput = "lr_schedule.total_steps";
inline constexpr const char* kScheduleWarmupInput = "lr_schedule.warmup_steps";
inline constexpr const char* kScheduleDecayInput = "lr_schedule.decay_steps";

/// kiln's rule for a trainable-parameter candidate (used by attach_loss, constant
/// folding and `kiln inspect`): a floating-point initializer whose role the model states
/// (Value::role, e.g. the torch.export exporter's graph signature) is `parameter`; when
/// the role is unknown (TorchScript exports, other producers), one whose name does not
/// start with '/' (PyTorch names exported Constant outputs "/...") and that has more
/// than one element, or one element and a name ending in ".weight" or ".bias" (a module
/// parameter by its state_dict key, e.g. the bias of Linear(h, 1); other one-element
/// initializers are the graph's scalar constants). BatchNormalization running
/// statistics are excluded separately by attach_loss.
bool is_parameter_candidate(const Value& v);

/// BatchNormalization running statistics (inputs 3 and 4 that are initializers): saved
/// state attach_loss updates as buffers and never trains.
std::unordered_set<const Value*> batchnorm_statistics(const Graph& g);

/// The initializers attach_loss makes trainable parameters (before --freeze / --trainable):
/// parameter candidates that are not BatchNormalization statistics, in initializer order.
std::vector<const Value*> trainable_initializers(const Graph& g);

}  // namespace kiln::ir
