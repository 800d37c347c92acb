// ONNX -> kiln IR import (see onnx_import.h).
//
// Steps, each failing with one line that starts with the model's path:
//  1. read and parse the ModelProto (protobuf); a truncated or non-ONNX file fails here
//     or at the sanity checks (ir_version, graph, opset_import for the default domain);
//  2. opset of the default domain ("" / "ai.onnx") must be <= 18; a model with an opset
//     below 13 is first upgraded to opset 13 with libonnx's version converter
//     (onnx::version_conversion::ConvertVersion; its exceptions become one error line
//     naming the file and the opset);
//  3. build the IR: initializers (raw, typed and external data), graph inputs (inputs
//     that are also initializers are initializers; inputs named in
//     ImportOptions::constant_inputs become initializers; dim_param -> symbolic Dim unless
//     bound by ImportOptions::bind_dims), Constant nodes -> initializers, every other
//     node checked against the op table (unsupported op / non-default domain / missing
//     input / subgraph attribute are errors naming the node);
//  4. for opsets <= 17 (what libonnx 1.12 knows): onnx::checker::check_model and
//     onnx::shape_inference::InferShapes, every libonnx exception turned into a Status;
//     our own checks run first so that their errors (which name node and op) win;
//  5. kiln's op-table type/shape inference (ir::infer_graph), errors naming the node.
#include "frontend/onnx_import.h"

#include <onnx/checker.h>
#include <onnx/onnx_pb.h>
#include <onnx/shape_inference/implementation.h>
#include <onnx/version_converter/convert.h>

#include <algorithm>
#include <cctype>
#include <filesystem>
#include <fstream>
#include <set>
#include <sstream>
#include <unordered_map>

#include "frontend/initializers.h"
#include "frontend/model_bytes.h"
#include "frontend/onnx_lower.h"
#include "frontend/onnx_ops.h"
#include "frontend/tensor_proto.h"
#include "frontend/tensor_proto_internal.h"
#include "ir/op_table.h"

namespace kiln::frontend {

namespace fs = std::filesystem;

namespace {

constexpr int64_t kMaxLibonnxOpset = 17;  // newest opset libonnx 1.12 knows

// libonnx messages span several lines ("... ==> Context: ..."); keep one line.
std::string one_line(const std::string& in) {
  std::string s;
  for (char c : in) {
    if (c == '\n' || c == '\r' || c == '\t') c = ' ';
    if (c == ' ' && (s.empty() || s.back() == ' ')) continue;
    s.push_back(c);
  }
  while (!s.empty() && s.back() == ' ') s.pop_back();
  return s;
}

bool is_default_domain(const std::string& d) { return d.empty() || d == "ai.onnx"; }

std::string node_label(const onnx::NodeProto& n, const std::string& name) {
  return "node '" + one_line(name) + "' (" + n.op_type() + ")";
}

// Converts one attribute. `who` names the node for errors.
Expected<ir::AttrValue> convert_attribute(const onnx::AttributeProto& a, const std::string& model_dir,
                                          const std::string& who) {
  using A = onnx::AttributeProto;
  auto type = a.type();
  if (type == A::UNDEFINED) {  // very old exporters leave the type unset: guess from the field set
    if (a.has_f())
      type = A::FLOAT;
    else if (a.has_i())
      type = A::INT;
    else if (a.has_s())
      type = A::STRING;
    else if (a.has_t())
      type = A::TENSOR;
    else if (a.has_g())
      type = A::GRAPH;
    else if (a.floats_size())
      type = A::FLOATS;
    else if (a.ints_size())
      type = A::INTS;
    else if (a.strings_size())
      type = A::STRINGS;
    else if (a.graphs_size())
      type = A::GRAPHS;
  }
  switch (type) {
    case A::INT:
      return ir::AttrValue(static_cast<int64_t>(a.i()));
    case A::FLOAT:
      return ir::AttrValue(static_cast<double>(a.f()));
    case A::STRING:
      return ir::AttrValue(a.s());
    case A::INTS:
      return ir::AttrValue(std::vector<int64_t>(a.ints().begin(), a.ints().end()));
    case A::FLOATS: {
      std::vector<double> v(a.floats().begin(), a.floats().end());
      return ir::AttrValue(std::move(v));
    }
    case A::STRINGS:
      return ir::AttrValue(std::vector<std::string>(a.strings().begin(), a.strings().end()));
    case A::TENSOR: {
      auto t = tensor_from_proto_named(a.t(), model_dir, who + ": attribute '" + a.name() + "'");
      if (!t) return t.status();
      return ir::AttrValue(std::move(*t));
    }
    case A::GRAPH:
    case A::GRAPHS:
      return Status::error(who + ": attribute '" + a.name() +
                           "' is a subgraph; control flow with subgraphs (If/Loop/Scan) is not supported");
    default:
      return Status::error(who + ": attribute '" + a.name() + "' has unsupported attribute type " +
                           std::to_string(static_cast<int>(type)));
  }
}

// Value of a Constant node (ONNX Constant-13: exactly one of value, value_float(s), value_int(s),
// value_string(s), sparse_value).
Expected<ir::Tensor> constant_value(const onnx::NodeProto& n, const std::string& model_dir, const std::string& who) {
  if (n.attribute_size() != 1) return Status::error(who + ": Constant must have exactly one attribute");
  const auto& a = n.attribute(0);
  const std::string& k = a.name();
  if (k == "value") return tensor_from_proto_named(a.t(), model_dir, who + ": attribute 'value'");
  if (k == "value_float") return ir::Tensor::scalar_f32(a.f());
  if (k == "value_int") return ir::Tensor::scalar_i64(a.i());
  if (k == "value_floats") {
    std::vector<float> v(a.floats().begin(), a.floats().end());
    return ir::Tensor::from_f32(v, {static_cast<int64_t>(v.size())});
  }
  if (k == "value_ints") return ir::Tensor::from_i64(std::vector<int64_t>(a.ints().begin(), a.ints().end()));
  return Status::error(who + ": Constant attribute '" + k + "' is not supported (strings and sparse tensors)");
}

Expected<ir::DType> value_info_dtype(const onnx::ValueInfoProto& vi, const std::string& what) {
  if (!vi.type().has_tensor_type())
    return Status::error(what + " '" + vi.name() +
                         "' is not a tensor (sequences, maps and optionals are not supported)");
  auto dt = ir::dtype_from_onnx(vi.type().tensor_type().elem_type());
  if (!dt) return Status::error(what + " '" + vi.name() + "': " + dt.message());
  return *dt;
}

class Importer {
 public:
  Importer(std::string path, const ImportOptions& opts) : path_(std::move(path)), opts_(opts) {
    model_dir_ = fs::path(path_).parent_path().string();
  }

  Expected<std::unique_ptr<ir::Graph>> run() {
    KILN_RETURN_IF_ERROR(parse());
    KILN_RETURN_IF_ERROR(check_window_attributes(model_.graph()));
    KILN_RETURN_IF_ERROR(check_opset());
    g_ = std::make_unique<ir::Graph>();
    g_->opset = opset_;
    KILN_RETURN_IF_ERROR(import_initializers());
    KILN_RETURN_IF_ERROR(import_inputs());
    KILN_RETURN_IF_ERROR(import_nodes());
    KILN_RETURN_IF_ERROR(import_outputs());
    KILN_RETURN_IF_ERROR(resolve_initializers(model_, *g_, origins_, opts_.untie_initializers));
    KILN_RETURN_IF_ERROR(run_libonnx());
    KILN_RETURN_IF_ERROR(infer());
    return std::move(g_);
  }

 private:
  Status fail(const std::string& msg) const { return Status::error(path_ + ": " + msg); }

  Status parse() {
    auto read = read_model_bytes(path_);  // a file, or a model embedded in an AOT binary
    if (!read) return read.status();
    std::string bytes = std::move(*read);
    if (bytes.empty()) return fail("empty file, not an ONNX model");
    if (!model_.ParseFromString(bytes))
      return fail("not a valid ONNX model: protobuf parsing failed (truncated file, or not an ONNX file)");
    if (model_.ir_version() <= 0 || !model_.has_graph())
      return fail(std::string("not a valid ONNX model: ") + (model_.ir_version() <= 0 ? "no ir_version" : "no graph") +
                  " (truncated file, or not an ONNX file)");
    has_external_ = false;
    for (const auto& t : model_.graph().initializer())
      if (t.data_location() == onnx::TensorProto::EXTERNAL) has_external_ = true;
    // An embedded model has no folder: its data must be inline (kiln compile embeds it so),
    // never read from whatever file of that name the current folder holds.
    if (is_registered_model(path_))
      if (std::string ext = first_external_tensor(model_); !ext.empty())
        return fail(ext + " is stored as external data, which an embedded model cannot refer to");
    return Status::ok();
  }

  // Convolution and pooling window attributes (kernel_shape, strides, dilations) must be
  // positive before libonnx sees the model: its shape inference divides by the stride
  // (a stride of 0 raised SIGFPE in onnx::convPoolShapeInference, where kiln's own check,
  // ir/ops/nn.cpp, runs only later). Recurses into subgraph attributes.
  Status check_window_attributes(const onnx::GraphProto& graph) {
    for (int i = 0; i < graph.node_size(); ++i) {
      const onnx::NodeProto& n = graph.node(i);
      for (const auto& a : n.attribute()) {
        if (a.type() == onnx::AttributeProto::GRAPH) KILN_RETURN_IF_ERROR(check_window_attributes(a.g()));
        for (const auto& sub : a.graphs()) KILN_RETURN_IF_ERROR(check_window_attributes(sub));
        const OnnxOpInfo* info = onnx_op_info(n.op_type());
        if (!is_default_domain(n.domain()) || !info || !info->windowed) continue;
        if (a.name() != "kernel_shape" && a.name() != "strides" && a.name() != "dilations") continue;
        for (int64_t v : a.ints())
          if (v <= 0)
            return fail(node_label(n, n.name().empty() ? "#" + std::to_string(i) : n.name()) + ": attribute " +
                        a.name() + " has " + std::to_string(v) +
                        "; kernel_shape, strides and dilations must be positive");
      }
    }
    return Status::ok();
  }

  Status check_opset() {
    opset_ = -1;
    for (const auto& op : model_.opset_import())
      if (is_default_domain(op.domain())) opset_ = op.version();
    if (opset_ < 0)
      return fail("model has no opset_import for the default ONNX domain (truncated file, or not an ONNX file)");
    if (opset_ > kMaxOpset)
      return fail("opset " + std::to_string(opset_) +
                  " of the default ONNX domain is newer than kiln knows (its newest "
                  "is opset " +
                  std::to_string(kMaxOpset) + ", of ONNX 1.23; it accepts " + std::to_string(kMinOpset) + ".." +
                  std::to_string(kMaxOpset) + " and upgrades older opsets to " + std::to_string(kMinOpset) +
                  "); re-export the model with opset_version <= " + std::to_string(kMaxOpset));
    if (opset_ < kMinOpset) return upgrade_opset();
    return Status::ok();
  }

  // Every graph output of the main graph is a graph input, an initializer or a node
  // output: the message of the import's own check (opset >= 13), which the version
  // converter would not reach. (Subgraph outputs do not crash the converter.)
  Status check_graph_outputs_defined(const onnx::GraphProto& g) const {
    std::set<std::string> defined;
    for (const auto& v : g.input()) defined.insert(v.name());
    for (const auto& t : g.initializer()) defined.insert(t.name());
    for (const auto& n : g.node())
      for (const auto& o : n.output()) defined.insert(o);
    for (const auto& o : g.output())
      if (!defined.count(o.name()))
        return fail("graph output '" + o.name() + "' is not produced by any node, input or initializer");
    return Status::ok();
  }

  // Upgrades an opset < 13 model to opset 13 with libonnx's version converter, which
  // rewrites the ops whose signature changed (e.g. Split/Squeeze/ReduceSum attributes ->
  // inputs, Upsample -> Resize) and fails for ops it has no adapter for.
  Status upgrade_opset() {
    const int64_t from = opset_;
    auto conversion_failed = [&](const std::string& why) {
      return fail("cannot upgrade opset " + std::to_string(from) + " model to opset " + std::to_string(kMinOpset) +
                  " (ONNX version converter): " + why);
    };
    if (has_external_) return conversion_failed("initializers with external data are not supported by the converter");
    // libonnx 1.12's converter dereferences a null value for a graph output that nothing
    // defines (SIGSEGV in onnx::graphProtoToGraph; found by fuzz/ onnx): refused first.
    if (Status s = check_graph_outputs_defined(model_.graph()); !s) return s;
    try {
      // Shapes first: libonnx 1.12's converter needs input shapes for some adapters (Add/Gemm
      // broadcast, Softmax) and, without this, misses those of scalar Constant outputs.
      onnx::shape_inference::InferShapes(model_);
      model_ = onnx::version_conversion::ConvertVersion(model_, static_cast<int>(kMinOpset));
    } catch (const std::exception& e) {
      return conversion_failed(one_line(e.what()));
    } catch (...) {
      return conversion_failed("unknown exception");
    }
    // Opset 13 needs IR version >= 7; the converter keeps the old one, and IR < 4 would
    // make the checker demand that initializers the converter added (e.g. Pad's pads)
    // be graph inputs.
    if (model_.ir_version() < 7) model_.set_ir_version(7);
    opset_ = -1;
    for (const auto& op : model_.opset_import())
      if (is_default_domain(op.domain())) opset_ = op.version();
    if (opset_ != kMinOpset) return conversion_failed("the converted model has opset " + std::to_string(opset_));
    return Status::ok();
  }

  Status define(const std::string& name, ir::Value* v, const std::string& what) {
    if (values_.count(name)) return fail(what + " '" + name + "' is defined twice");
    values_[name] = v;
    return Status::ok();
  }

  Status import_initializers() {
    const auto& graph = model_.graph();
    if (graph.sparse_initializer_size() > 0)
      return fail("sparse initializer '" + graph.sparse_initializer(0).values().name() + "' is not supported");
    for (const auto& tp : graph.initializer()) {
      if (tp.name().empty()) return fail("an initializer has no name");
      auto t = tensor_from_proto_named(tp, model_dir_, "initializer '" + tp.name() + "'");
      if (!t) return fail(t.message());
      ir::Value* v = g_->add_initializer(tp.name(), std::move(*t));
      KILN_RETURN_IF_ERROR(define(tp.name(), v, "initializer"));
    }
    return Status::ok();
  }

  Status import_inputs() {
    for (const auto& vi : model_.graph().input()) {
      if (values_.count(vi.name()) && values_[vi.name()]->is_initializer()) continue;  // older exports
      if (auto c = opts_.constant_inputs.find(vi.name()); c != opts_.constant_inputs.end()) {
        if (vi.type().has_tensor_type()) {
          auto dt = ir::dtype_from_onnx(vi.type().tensor_type().elem_type());
          if (dt && *dt != c->second.dtype())
            return fail("constant input '" + vi.name() + "' has dtype " + ir::dtype_name(c->second.dtype()) +
                        ", the graph input is " + ir::dtype_name(*dt));
        }
        ir::Value* v = g_->add_initializer(vi.name(), c->second);
        KILN_RETURN_IF_ERROR(define(vi.name(), v, "graph input"));
        continue;
      }
      auto dt = value_info_dtype(vi, "graph input");
      if (!dt) return fail(dt.message());
      const auto& tt = vi.type().tensor_type();
      if (!tt.has_shape()) return fail("graph input '" + vi.name() + "' has no shape (unknown rank is not supported)");
      ir::Shape shape;
      for (const auto& d : tt.shape().dim()) {
        if (d.has_dim_value()) {
          if (d.dim_value() < 0)
            return fail("graph input '" + vi.name() + "' has negative dim " + std::to_string(d.dim_value()));
          shape.dims.emplace_back(d.dim_value());
        } else if (d.has_dim_param() && !d.dim_param().empty()) {
          auto it = opts_.bind_dims.find(d.dim_param());
          if (it != opts_.bind_dims.end())
            shape.dims.emplace_back(it->second);
          else
            shape.dims.emplace_back(ir::Dim(d.dim_param()));
        } else {
          shape.dims.emplace_back();  // unknown
        }
      }
      ir::Value* v = g_->add_input(vi.name(), *dt, shape);
      KILN_RETURN_IF_ERROR(define(vi.name(), v, "graph input"));
    }
    return Status::ok();
  }

  /// The ONNX schema versions kiln implements for `op` (op table or lowering); null when
  /// the op is unknown.
  static const std::vector<int>* onnx_versions(const std::string& op) {
    if (auto it = onnx_lowerings().find(op); it != onnx_lowerings().end()) return &it->second.onnx_since;
    const ir::OpDef* def = ir::OpTable::get().find(op);
    if (!def || !def->onnx) return nullptr;
    return &def->onnx_since;
  }

  Status import_nodes() {
    const auto& graph = model_.graph();
    for (int i = 0; i < graph.node_size(); ++i) {
      const auto& n = graph.node(i);
      std::string name = n.name().empty() ? n.op_type() + "_" + std::to_string(i) : n.name();
      std::string label = node_label(n, name);
      if (!is_default_domain(n.domain())) {
        // The domain's own version (a com.microsoft op is opset 1 of com.microsoft).
        std::string version = "no opset_import for that domain";
        for (const auto& op : model_.opset_import())
          if (op.domain() == n.domain()) version = "opset " + std::to_string(op.version()) + " of that domain";
        return fail("unsupported op '" + n.op_type() + "' of domain '" + n.domain() + "' (node '" + name + "', " +
                    version + ")");
      }
      if (const OnnxOpInfo* info = onnx_op_info(n.op_type()); info && info->constant) {
        auto t = constant_value(n, model_dir_, label);
        if (!t) return fail(t.message());
        if (n.output_size() != 1 || n.output(0).empty()) return fail(label + ": Constant must have one output");
        ir::Value* v = g_->add_initializer(n.output(0), std::move(*t));
        KILN_RETURN_IF_ERROR(define(n.output(0), v, "value"));
        continue;
      }
      const std::vector<int>* versions = onnx_versions(n.op_type());
      if (!versions)
        return fail("unsupported op '" + n.op_type() + "' (node '" + name + "', opset " + std::to_string(opset_) + ")");
      if (versions->empty() || versions->front() > opset_)
        return fail(label + ": op " + n.op_type() + " is not in opset " + std::to_string(opset_) +
                    (versions->empty() ? std::string()
                                       : " (ONNX added it in opset " + std::to_string(versions->front()) + ")"));
      std::vector<ir::Value*> ins;
      std::vector<int> seq_inputs;  // input positions holding sequences
      for (int k = 0; k < n.input_size(); ++k) {
        const std::string& in = n.input(k);
        if (in.empty()) {
          ins.push_back(nullptr);
          continue;
        }
        if (sequences_.count(in)) {
          ins.push_back(nullptr);
          seq_inputs.push_back(k);
          continue;
        }
        auto it = values_.find(in);
        if (it == values_.end()) {
          // Computed by a node at or after this one: a cycle, or nodes out of order.
          for (int later = i; later < graph.node_size(); ++later)
            for (const auto& o : graph.node(later).output())
              if (o == in) {
                const auto& ln = graph.node(later);
                const std::string lname = ln.name().empty() ? ln.op_type() + "_" + std::to_string(later) : ln.name();
                if (later == i)
                  return fail("value '" + in + "' used by " + label + " is that node's own output (a cycle)");
                return fail("value '" + in + "' used by " + label + " is computed by " + node_label(ln, lname) +
                            ", which comes after it: a cycle, or nodes not in topological order as ONNX requires");
              }
          return fail("missing initializer or value '" + in + "' used by " + label +
                      " (not a graph input, initializer or output of an earlier node)");
        }
        ins.push_back(it->second);
      }
      ir::Attributes attrs;
      for (const auto& a : n.attribute()) {
        if (!a.ref_attr_name().empty())
          return fail(label + ": attribute '" + a.name() + "' refers to a function attribute; not supported");
        auto v = convert_attribute(a, model_dir_, label);
        if (!v) return fail(v.message());
        attrs.set(a.name(), std::move(*v));
      }
      int nout = n.output_size();
      while (nout > 0 && n.output(nout - 1).empty()) --nout;
      for (int k = 0; k < nout; ++k) {
        const std::string& o = n.output(k);
        if (!o.empty() && (values_.count(o) || sequences_.count(o)))
          return fail(label + ": output '" + o + "' is already defined (values must be assigned once)");
      }
      if (auto lw = onnx_lowerings().find(n.op_type()); lw != onnx_lowerings().end()) {
        NodeLowering ctx(*this, n, name, label, ins, attrs, nout);
        KILN_RETURN_IF_ERROR(lw->second.lower(ctx));
        KILN_RETURN_IF_ERROR(ctx.check_outputs());
        continue;
      }
      if (!seq_inputs.empty())
        return fail(label + ": input '" + n.input(seq_inputs[0]) +
                    "' is a sequence; kiln holds sequences only through SplitToSequence, SequenceAt, "
                    "ConcatFromSequence, SequenceConstruct, SequenceInsert, SequenceErase and SequenceLength");
      while (!ins.empty() && ins.back() == nullptr) ins.pop_back();
      // Trailing omitted outputs are dropped; omitted outputs in the middle get a generated name.
      std::vector<std::string> out_names;
      for (int k = 0; k < nout; ++k) {
        const std::string& o = n.output(k);
        out_names.push_back(o.empty() ? name + "/unused_output_" + std::to_string(k) : o);
      }
      ir::Node* node = g_->add_node(n.op_type(), name, std::move(ins), out_names, std::move(attrs));
      origins_[node] = &n;
      (void)ir::infer_node(*node);  // shapes for later lowerings; errors are reported by infer()
      for (int k = 0; k < nout; ++k)
        if (!n.output(k).empty()) values_[n.output(k)] = node->outputs[k];
    }
    return Status::ok();
  }

  /// The LowerContext of one ONNX node (onnx_lower.h): emits IR nodes into the graph,
  /// binds the node's outputs to values or sequences.
  class NodeLowering : public LowerContext {
   public:
    NodeLowering(Importer& imp, const onnx::NodeProto& n, std::string name, std::string label,
                 std::vector<ir::Value*> ins, ir::Attributes attrs, int nout)
        : imp_(imp),
          n_(n),
          name_(std::move(name)),
          label_(std::move(label)),
          ins_(std::move(ins)),
          attrs_(std::move(attrs)),
          nout_(nout) {}
    const std::string& op() const override { return n_.op_type(); }
    const std::string& name() const override { return name_; }
    const ir::Attributes& attrs() const override { return attrs_; }
    int64_t opset() const override { return imp_.opset_; }
    ir::Value* input(int i) const override { return i < static_cast<int>(ins_.size()) ? ins_[i] : nullptr; }
    int num_inputs() const override { return static_cast<int>(ins_.size()); }
    const std::vector<ir::Value*>* sequence_input(int i) const override {
      if (i >= n_.input_size()) return nullptr;
      auto it = imp_.sequences_.find(n_.input(i));
      return it == imp_.sequences_.end() ? nullptr : &it->second;
    }
    int num_outputs() const override { return nout_; }
    bool has_output(int k) const override { return k < nout_ && !n_.output(k).empty(); }
    std::vector<ir::Value*> emit(const std::string& op, std::vector<ir::Value*> inputs, int num_outputs,
                                 ir::Attributes attrs, std::vector<std::string> out_names) override {
      std::vector<std::string> names;
      for (int k = 0; k < num_outputs; ++k) {
        std::string nm = k < static_cast<int>(out_names.size()) ? out_names[k] : "";
        names.push_back(nm.empty() ? imp_.g_->unique_name(name_ + "/" + op) : nm);
      }
      const std::string node_name = name_ + "/" + op + "_" + std::to_string(emitted_++);
      ir::Node* node = imp_.g_->add_node(op, node_name, std::move(inputs), names, std::move(attrs));
      imp_.origins_[node] = &n_;
      (void)ir::infer_node(*node);
      for (int k = 0; k < num_outputs; ++k)
        for (int j = 0; j < nout_; ++j)
          if (!n_.output(j).empty() && names[k] == n_.output(j)) bind(j, node->outputs[k]);
      return node->outputs;
    }
    ir::Value* constant(ir::Tensor t) override {
      return imp_.g_->add_initializer(imp_.g_->unique_name(name_ + "/const"), std::move(t));
    }
    ir::Value* scalar(double v, ir::DType dt) override {
      ir::Tensor t(dt, {});
      t.set_f64(0, v);
      return constant(std::move(t));
    }
    std::string output_name(int k) const override { return has_output(k) ? n_.output(k) : ""; }
    Status define_output(int k, ir::Value* v) override {
      if (!has_output(k)) return Status::ok();
      emit("Identity", {v}, 1, {}, {n_.output(k)});
      return Status::ok();
    }
    Status define_sequence(int k, std::vector<ir::Value*> items) override {
      if (!has_output(k)) return Status::ok();
      imp_.sequences_[n_.output(k)] = std::move(items);
      done_.insert(k);
      return Status::ok();
    }
    Status fail(const std::string& msg) const override { return imp_.fail(label_ + ": " + msg); }
    /// Every used output was bound.
    Status check_outputs() const {
      for (int k = 0; k < nout_; ++k)
        if (has_output(k) && !done_.count(k))
          return fail("internal error: the lowering did not produce output '" + n_.output(k) + "'");
      return Status::ok();
    }

   private:
    void bind(int j, ir::Value* v) {
      imp_.values_[n_.output(j)] = v;
      done_.insert(j);
    }
    Importer& imp_;
    const onnx::NodeProto& n_;
    std::string name_, label_;
    std::vector<ir::Value*> ins_;
    ir::Attributes attrs_;
    int nout_;
    int emitted_ = 0;
    std::set<int> done_;
  };

  Status import_outputs() {
    for (const auto& vi : model_.graph().output()) {
      if (sequences_.count(vi.name()))
        return fail("graph output '" + vi.name() + "' is a sequence; kiln's graph outputs are tensors");
      auto it = values_.find(vi.name());
      if (it == values_.end())
        return fail("graph output '" + vi.name() + "' is not produced by any node, input or initializer");
      g_->outputs.push_back(it->second);
    }
    if (g_->outputs.empty()) return fail("graph has no outputs");
    return Status::ok();
  }

  Status run_libonnx() {
    if (opset_ > kMaxLibonnxOpset) return Status::ok();  // libonnx 1.12 does not know opset 18
    try {
      if (has_external_)
        onnx::checker::check_model(path_);  // resolves external data next to the file
      else
        onnx::checker::check_model(model_);
    } catch (const std::exception& e) {
      return fail("ONNX checker: " + one_line(e.what()));
    } catch (...) {
      return fail("ONNX checker failed with an unknown exception");
    }
    try {
      onnx::shape_inference::InferShapes(model_);
    } catch (const std::exception& e) {
      return fail("ONNX shape inference: " + one_line(e.what()));
    } catch (...) {
      return fail("ONNX shape inference failed with an unknown exception");
    }
    return Status::ok();
  }

  Status infer() {
    for (auto& n : g_->nodes()) {
      Status s = ir::infer_node(*n);
      if (!s.is_ok()) {
        std::string m = s.message();
        if (m.rfind("node '", 0) != 0) m = "node '" + n->name + "' (" + n->op + "): " + m;
        return fail("type inference: " + m);
      }
    }
    return Status::ok();
  }

  std::string path_;
  ImportOptions opts_;
  std::string model_dir_;
  onnx::ModelProto model_;
  bool has_external_ = false;
  int64_t opset_ = -1;
  std::unique_ptr<ir::Graph> g_;
  std::unordered_map<std::string, ir::Value*> values_;
  /// The ONNX node of each IR node (initializers.h reads the nodes' metadata).
  NodeOrigins origins_;
  /// Sequences of tensors (SplitToSequence, SequenceConstruct, ...) by ONNX value name.
  std::unordered_map<std::string, std::vector<ir::Value*>> sequences_;
};

std::string trim(const std::string& s) {
  size_t b = 0, e = s.size();
  while (b < e && std::isspace(static_cast<unsigned char>(s[b]))) ++b;
  while (e > b && std::isspace(static_cast<unsigned char>(s[e - 1]))) --e;
  return s.substr(b, e - b);
}

}  // namespace

Expected<std::unique_ptr<ir::Graph>> import_onnx(const std::string& path, const ImportOptions& opts) {
  try {
    Importer imp(path, opts);
    return imp.run();
  } catch (const std::exception& e) {  // protobuf / libonnx / filesystem exceptions
    return Status::error(path + ": import failed: " + one_line(e.what()));
  }
}

Expected<std::map<std::string, int64_t>> parse_shape_bindings(const std::string& spec) {
  std::map<std::string, int64_t> out;
  if (trim(spec).empty()) return out;
  std::stringstream ss(spec);
  std::string item;
  while (std::getline(ss, item, ',')) {
    std::string it = trim(item);
    if (it.empty()) return Status::error("shape binding '" + spec + "': empty item (expected name=value,...)");
    auto eq = it.find('=');
    if (eq == std::string::npos) return Status::error("shape binding '" + it + "': expected name=value (e.g. batch=8)");
    std::string name = trim(it.substr(0, eq)), val = trim(it.substr(eq + 1));
    if (name.empty()) return Status::error("shape binding '" + it + "': empty dim name");
    if (val.empty() || val.size() > 18 ||
        !std::all_of(val.begin(), val.end(), [](char c) { return std::isdigit(static_cast<unsigned char>(c)); }))
      return Status::error("shape binding '" + it + "': value '" + val + "' is not a non-negative integer");
    if (out.count(name)) return Status::error("shape binding '" + name + "' given twice");
    out[name] = std::stoll(val);
  }
  return out;
}

}  // namespace kiln::frontend
