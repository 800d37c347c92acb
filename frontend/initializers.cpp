// Initializer roles, folded-parameter restoration and ties (see initializers.h).
#include "frontend/initializers.h"

#include <google/protobuf/unknown_field_set.h>

#include <algorithm>
#include <cstring>
#include <map>
#include <set>
#include <sstream>

#include "frontend/onnx_ops.h"
#include "ir/op_table.h"

namespace kiln::frontend {

namespace {

using ir::DType;
using ir::InitRole;
using ir::Tensor;
using ir::Value;

// ---------------------------------------------------------------- metadata

/// metadata_props of an ONNX message. GraphProto (field 16), NodeProto (9) and
/// ValueInfoProto (4) gained them in ONNX 1.16 (IR version 10); Debian's libonnx 1.12
/// proto does not declare them, so protobuf keeps them as unknown fields, read here.
std::map<std::string, std::string> metadata(const google::protobuf::Message& m, int field) {
  std::map<std::string, std::string> out;
  const auto& unknown = m.GetReflection()->GetUnknownFields(m);
  for (int i = 0; i < unknown.field_count(); ++i) {
    const auto& f = unknown.field(i);
    if (f.number() != field || f.type() != google::protobuf::UnknownField::TYPE_LENGTH_DELIMITED) continue;
    onnx::StringStringEntryProto e;
    if (e.ParseFromString(f.length_delimited())) out[e.key()] = e.value();
  }
  return out;
}

/// Names PyTorch's exporters give constants they create: "onnx::Op_N" (TorchScript),
/// "val_N" and "/..." (torch.export and TorchScript constant outputs).
bool exporter_generated_name(const std::string& n) {
  return n.rfind("onnx::", 0) == 0 || n.rfind("/", 0) == 0 ||
         (n.rfind("val_", 0) == 0 && n.size() > 4 && std::all_of(n.begin() + 4, n.end(), ::isdigit));
}

constexpr int kGraphMetadataField = 16, kNodeMetadataField = 9, kValueInfoMetadataField = 4;
const char* kSignatureKey = "pkg.torch.export.ExportedProgram.graph_signature";
const char* kKindKey = "pkg.torch.export.graph_signature.InputSpec.kind";
const char* kOriginalNameKey = "pkg.torch.onnx.original_node_name";
const char* kFxNodeKey = "pkg.torch.onnx.fx_node";

/// One input of the exported program's graph signature.
struct SignatureEntry {
  std::string placeholder, kind, target;
};

/// Parses the signature text: lines "<placeholder>: <KIND> target='<target>' ..." under
/// "# inputs" (outputs are ignored).
std::vector<SignatureEntry> parse_signature(const std::string& text) {
  std::vector<SignatureEntry> out;
  std::istringstream is(text);
  std::string line;
  bool inputs = false;
  while (std::getline(is, line)) {
    if (line.rfind("# inputs", 0) == 0) {
      inputs = true;
      continue;
    }
    if (line.rfind("#", 0) == 0) {
      inputs = false;
      continue;
    }
    if (!inputs) continue;
    const size_t colon = line.find(": ");
    if (colon == std::string::npos) continue;
    SignatureEntry e;
    e.placeholder = line.substr(0, colon);
    const size_t sp = line.find(' ', colon + 2);
    e.kind = line.substr(colon + 2, sp == std::string::npos ? std::string::npos : sp - colon - 2);
    const size_t t = line.find("target='");
    if (t != std::string::npos) {
      const size_t end = line.find('\'', t + 8);
      if (end != std::string::npos) e.target = line.substr(t + 8, end - t - 8);
    }
    out.push_back(e);
  }
  return out;
}

/// An FX node from "pkg.torch.onnx.fx_node": the call target ("torch.ops.aten.linear.default")
/// and the names of its positional arguments that are FX values ("%x" -> "x"; other
/// arguments, such as lists and numbers, are empty strings, so positions are kept).
struct FxCall {
  std::string target;
  std::vector<std::string> args;
};

FxCall parse_fx(const std::string& s) {
  FxCall c;
  const size_t t = s.find("target=");
  if (t != std::string::npos) {
    const size_t end = s.find(']', t);
    c.target = s.substr(t + 7, end == std::string::npos ? std::string::npos : end - t - 7);
  }
  const size_t a = s.find("args = (");
  if (a == std::string::npos) return c;
  size_t i = a + 8;
  int depth = 0;
  std::string cur;
  bool is_value = false;
  auto flush = [&] {
    c.args.push_back(is_value ? cur : "");
    cur.clear();
    is_value = false;
  };
  for (; i < s.size(); ++i) {
    const char ch = s[i];
    if (depth == 0 && ch == ')') {
      if (!cur.empty() || is_value) flush();
      break;
    }
    if (ch == '(' || ch == '[') ++depth;
    if (ch == ')' || ch == ']') --depth;
    if (depth == 0 && ch == ',') {
      flush();
      continue;
    }
    if (depth == 0 && ch == '%' && cur.empty()) {
      is_value = true;
      continue;
    }
    if (ch != ' ' || !cur.empty()) cur.push_back(ch);
  }
  for (std::string& v : c.args)
    while (!v.empty() && v.back() == ' ') v.pop_back();
  return c;
}

bool contains(const std::string& s, const char* part) { return s.find(part) != std::string::npos; }

// ---------------------------------------------------------------- tensor comparisons

/// True when every element of t has the same bytes (ones, zeros, a constant fill).
bool uniform(const Tensor& t) {
  const size_t es = ir::dtype_size(t.dtype());
  const char* p = static_cast<const char*>(t.raw());
  for (int64_t i = 1; i < t.numel(); ++i)
    if (std::memcmp(p, p + i * es, es) != 0) return false;
  return true;
}

std::vector<int64_t> strip_leading_ones(std::vector<int64_t> d) {
  while (!d.empty() && d.front() == 1) d.erase(d.begin());
  return d;
}

/// How constant c is a view of parameter p, bit for bit (rank-2 transposes, leading
/// slices, broadcasts along new leading dims, copies).
enum class View { none, copy, transpose, slice, broadcast };

View view_of(const Tensor& c, const Tensor& p) {
  if (c.dtype() != p.dtype() || c.numel() == 0) return View::none;
  const size_t es = ir::dtype_size(c.dtype());
  const char* pc = static_cast<const char*>(c.raw());
  const char* pp = static_cast<const char*>(p.raw());
  if (c.numel() == p.numel()) {
    if (std::memcmp(pc, pp, c.nbytes()) == 0) return View::copy;
    if (c.rank() == 2 && p.rank() == 2 && c.dims()[0] == p.dims()[1] && c.dims()[1] == p.dims()[0]) {
      const int64_t rows = p.dims()[0], cols = p.dims()[1];
      for (int64_t i = 0; i < rows; ++i)
        for (int64_t j = 0; j < cols; ++j)
          if (std::memcmp(pp + (i * cols + j) * es, pc + (j * rows + i) * es, es) != 0) return View::none;
      return View::transpose;
    }
    return View::none;
  }
  const auto cd = strip_leading_ones(c.dims()), pd = strip_leading_ones(p.dims());
  if (c.numel() < p.numel() && !cd.empty() && cd.size() == pd.size() &&
      std::equal(cd.begin() + 1, cd.end(), pd.begin() + 1) && cd[0] < pd[0])
    return std::memcmp(pc, pp, c.nbytes()) == 0 ? View::slice : View::none;
  if (c.numel() > p.numel() && c.numel() % p.numel() == 0 && cd.size() >= pd.size() &&
      std::equal(pd.begin(), pd.end(), cd.end() - static_cast<long>(pd.size()))) {
    for (int64_t b = 0; b < c.numel() / p.numel(); ++b)
      if (std::memcmp(pc + b * p.nbytes(), pp, p.nbytes()) != 0) return View::none;
    return View::broadcast;
  }
  return View::none;
}

const char* view_name(View v) {
  switch (v) {
    case View::copy:
      return "a copy";
    case View::transpose:
      return "the transpose";
    case View::slice:
      return "a leading slice";
    default:
      return "a broadcast";
  }
}

// ---------------------------------------------------------------- the resolver

class Resolver {
 public:
  Resolver(const onnx::ModelProto& m, ir::Graph& g, const NodeOrigins& origins, bool untie)
      : m_(m), g_(g), origins_(origins), untie_(untie) {}

  Status run() {
    for (Value* v : g_.initializers) from_file_.insert(v);
    read_signature();
    assign_roles();
    restore_folded_weights();
    if (!signature_.empty()) restore_tied_names();
    restore_ties();
    if (!signature_.empty()) report_missing();
    return Status::ok();
  }

 private:
  // ---- 1. roles

  void read_signature() {
    auto gm = metadata(m_.graph(), kGraphMetadataField);
    auto it = gm.find(kSignatureKey);
    if (it == gm.end()) return;
    signature_ = parse_signature(it->second);
    for (size_t i = 0; i < signature_.size(); ++i) {
      by_placeholder_[signature_[i].placeholder] = i;
      if (!signature_[i].target.empty()) by_target_[signature_[i].target] = i;
    }
    for (const auto& vi : m_.graph().value_info()) {
      auto md = metadata(vi, kValueInfoMetadataField);
      auto k = md.find(kKindKey);
      if (k == md.end()) continue;
      init_kind_[vi.name()] = k->second;
      auto o = md.find(kOriginalNameKey);
      if (o != md.end()) init_placeholder_[vi.name()] = o->second;
    }
  }

  /// Roles from the value_info kinds. With a signature, an initializer without a kind is
  /// a constant the exporter computed; without one (TorchScript and other exporters) the
  /// name rule decides, except where a kind is written (by kiln, for a parameter the rule
  /// would miss: declare_parameter).
  void assign_roles() {
    for (Value* v : g_.initializers) {
      auto k = init_kind_.find(v->name);
      if (k == init_kind_.end()) {
        if (signature_.empty()) continue;
        v->role = InitRole::constant;
        v->role_source = "not in the exported program's signature (computed by the exporter)";
        continue;
      }
      std::string target;
      if (auto p = init_placeholder_.find(v->name); p != init_placeholder_.end())
        if (auto e = by_placeholder_.find(p->second); e != by_placeholder_.end()) target = signature_[e->second].target;
      v->role_source = (signature_.empty() ? "value_info kind: " : "torch.export signature: ") + k->second +
                       (target.empty() ? "" : " '" + target + "'");
      if (k->second == "PARAMETER")
        v->role = InitRole::parameter;
      else if (k->second == "BUFFER")
        v->role = InitRole::buffer;
      else
        v->role = InitRole::constant;
    }
  }

  /// A parameter-like initializer: a declared parameter, or (role unknown) a name kiln's
  /// rule trains that is not a generated name of an exporter.
  static bool is_param(const Value* v) {
    if (!v->is_initializer() || !ir::is_float(v->dtype)) return false;
    if (v->role != InitRole::unknown) return v->role == InitRole::parameter;
    return ir::is_parameter_candidate(*v) && !generated_name(v->name);
  }
  /// Names PyTorch's exporters give constants they create: "onnx::Op_N" (TorchScript),
  /// "val_N" and "/..." (torch.export and TorchScript constant outputs).
  static bool generated_name(const std::string& n) { return exporter_generated_name(n); }
  /// A constant that could be a parameter in disguise: not a parameter, float, more
  /// than one element, and (role unknown) a generated name.
  static bool is_folded_constant(const Value* v) {
    if (!v->is_initializer() || !ir::is_float(v->dtype) || v->shape.numel() <= 1) return false;
    if (v->role != InitRole::unknown) return v->role == InitRole::constant;
    return generated_name(v->name);
  }

  FxCall fx_of(const ir::Node* n) const {
    auto it = origins_.find(n);
    if (it == origins_.end()) return {};
    auto md = metadata(*it->second, kNodeMetadataField);
    auto f = md.find(kFxNodeKey);
    return f == md.end() ? FxCall{} : parse_fx(f->second);
  }
  /// The signature target of FX value name `arg` when it is a PARAMETER placeholder.
  std::string param_target(const std::string& arg) const {
    auto e = by_placeholder_.find(arg);
    if (e == by_placeholder_.end() || signature_[e->second].kind != "PARAMETER") return "";
    return signature_[e->second].target;
  }

  std::vector<ir::Use> uses_of(const Value* v) const { return g_.uses(v); }

  /// A new parameter initializer `name` holding `t`, with its role.
  Value* add_parameter(const std::string& name, Tensor t, const std::string& source) {
    Value* p = g_.add_initializer(name, std::move(t));
    p->role = InitRole::parameter;
    p->role_source = source;
    return p;
  }

  /// Inserts `op(inputs)` before node `before` and returns its output.
  Value* insert_before(const ir::Node* before, const std::string& op, const std::string& name,
                       std::vector<Value*> inputs, ir::Attributes attrs = {}) {
    const int at = std::max(0, g_.index_of(before));
    ir::Node* n = g_.insert_node(static_cast<size_t>(at), op, g_.unique_name(name), std::move(inputs),
                                 {g_.unique_name(name)}, std::move(attrs));
    return n->outputs[0];
  }

  // ---- 2. parameters folded into W^T constants

  void restore_folded_weights() {
    std::vector<std::string> restored;
    for (Value* c : std::vector<Value*>(g_.initializers)) {
      if (!is_folded_constant(c) || c->shape.rank() != 2) continue;
      auto uses = uses_of(c);
      if (uses.empty()) continue;
      bool all_matmul_b = true;
      for (auto& u : uses) {
        const OnnxOpInfo* info = onnx_op_info(u.user->op);
        all_matmul_b = all_matmul_b && info && info->linear_weight_input == u.index;
      }
      if (!all_matmul_b) continue;
      // PyTorch's name of W (c = W^T) from the first use.
      const ir::Node* mm = uses[0].user;
      std::string name;
      if (!signature_.empty()) {
        FxCall fx = fx_of(mm);
        if (contains(fx.target, "aten.linear") && fx.args.size() >= 2) name = param_target(fx.args[1]);
      } else if (c->role == InitRole::unknown && mm->name.size() > 8 && mm->name[0] == '/' &&
                 mm->name.compare(mm->name.size() - 7, 7, "/MatMul") == 0) {
        std::string path = mm->name.substr(1, mm->name.size() - 8);  // "/a/b.0/c/MatMul" -> "a/b.0/c"
        std::replace(path.begin(), path.end(), '/', '.');
        if (!path.empty()) name = path + ".weight";
      }
      if (name.empty()) continue;
      if (g_.find_value(name)) continue;  // present under its own name: a tie (step 3) if the bytes match
      if (uniform(*c->data)) continue;    // nothing tells which parameter a constant fill is
      bool view_of_param = false;         // a tied weight (GPT-2's lm_head = wte^T): step 3
      for (Value* p : g_.initializers)
        if (p != c && is_param(p) && view_of(*c->data, *p->data) != View::none) view_of_param = true;
      if (view_of_param) continue;
      // W = c^T in PyTorch's [out, in] layout.
      Value* p = add_parameter(
          name, transpose_2d(*c->data),
          signature_.empty()
              ? "restored from '" + c->name + "' (its transpose; name from the node scope)"
              : "torch.export signature: PARAMETER '" + name + "', restored from '" + c->name + "' (its transpose)");
      ir::Attributes a;
      a.set("perm", std::vector<int64_t>{1, 0});
      Value* t = insert_before(mm, "Transpose", name + ".T", {p}, a);
      g_.replace_all_uses(c, t);
      g_.initializer_origins[name] = {{c->name, "transpose", -1, -1}};
      restored.push_back(name);
    }
    g_.remove_unused_initializers();
    if (!restored.empty())
      note(std::to_string(restored.size()) + " Linear weight" + (restored.size() > 1 ? "s" : "") +
           " that the exporter stored transposed as constants restored as parameters under PyTorch's names (" +
           list(restored) + ")");
  }

  // ---- 3. ties by content

  void restore_ties() {
    std::vector<Value*> params;
    for (Value* v : g_.initializers)
      if (is_param(v) && v->shape.numel() > 1 && !uniform(*v->data)) params.push_back(v);
    std::vector<std::string> tied, untied;
    for (Value* c : std::vector<Value*>(g_.initializers)) {
      if (!is_folded_constant(c) || uses_of(c).empty() || uniform(*c->data)) continue;
      Value* orig = nullptr;
      View how = View::none;
      for (Value* p : params)
        if ((how = view_of(*c->data, *p->data)) != View::none) {
          orig = p;
          break;
        }
      if (!orig) continue;
      if (untie_) {
        c->role = InitRole::parameter;
        c->role_source =
            std::string("kept apart (--untie_initializers): ") + view_name(how) + " of '" + orig->name + "'";
        untied.push_back(c->name);
        continue;
      }
      const ir::Node* first = uses_of(c)[0].user;
      Value* view = nullptr;
      const auto& cd = c->data->dims();
      if (how == View::copy) {
        view = insert_before(first, "Identity", c->name + ".tied", {orig});
      } else if (how == View::transpose) {
        ir::Attributes a;
        a.set("perm", std::vector<int64_t>{1, 0});
        view = insert_before(first, "Transpose", c->name + ".tied", {orig}, a);
      } else if (how == View::slice) {
        const auto od = strip_leading_ones(orig->data->dims());
        const auto sd = strip_leading_ones(cd);
        const int64_t axis = static_cast<int64_t>(orig->data->rank() - od.size());
        Value* s = insert_before(first, "Slice", c->name + ".tied",
                                 {orig, const_i64({0}), const_i64({sd[0]}), const_i64({axis})});
        view = insert_before(first, "Reshape", c->name + ".tied", {s, const_i64(cd)});
      } else {
        view = insert_before(first, "Expand", c->name + ".tied", {orig, const_i64(cd)});
      }
      // Every use of c must come after the view: c's uses follow `first` in node order.
      g_.replace_all_uses(c, view);
      add_origin(orig, {c->name,
                        how == View::copy        ? ""
                        : how == View::transpose ? "transpose"
                        : how == View::slice     ? "slice"
                                                 : "broadcast",
                        -1, -1});
      tied.push_back("'" + c->name + "' is " + view_name(how) + " of '" + orig->name + "'");
    }
    // Identity aliases of parameters (eval-mode exports). The TorchScript exporter also
    // deduplicates equal-valued parameters into Identity aliases: an alias of a tensor
    // whose elements are all equal (a fresh model's ones and zeros) is such a merge, not
    // a tie, and becomes a parameter of its own, as with --untie_initializers.
    std::vector<std::string> merged, aliases;
    for (ir::Node* n : node_list()) {
      if (!ir::has_trait(*n, ir::OpTrait::identity) || n->inputs.size() != 1 || !n->inputs[0] ||
          !is_param(n->inputs[0]))
        continue;
      Value* src = n->inputs[0];
      const bool fill = uniform(*src->data);
      if (!untie_ && !fill) {
        aliases.push_back("'" + n->outputs[0]->name + "' of '" + src->name + "'");
        continue;
      }
      const std::string why =
          fill ? "restored: an Identity alias of '" + src->name + "' (the exporter merged equal-valued parameters)"
               : "kept apart (--untie_initializers): an Identity alias of '" + src->name + "'";
      (fill ? merged : untied).push_back(n->outputs[0]->name);
      separate_alias(n, why);
    }
    g_.remove_unused_initializers();
    if (!tied.empty())
      note("tied initializers trained as one parameter, as in PyTorch: " + list(tied) +
           " (--untie_initializers keeps them apart)");
    // A naive export (eval mode, constant folding) writes parameters as Identity aliases
    // of others: trained tied, which the model's author may not have meant.
    if (!aliases.empty())
      note(
          "warning: initializers that are Identity aliases of other initializers are trained tied, as one "
          "parameter: " +
          list(aliases) + " (--untie_initializers trains them separately)");
    if (!merged.empty())
      note(
          "the exporter merged equal-valued parameters (a freshly initialized model) through Identity aliases; "
          "restored as " +
          std::to_string(merged.size()) + (merged.size() == 1 ? " separate parameter (" : " separate parameters (") +
          list(merged) + ")");
    if (!untied.empty())
      note("--untie_initializers: " + list(untied) +
           (untied.size() == 1 ? " trained as a parameter of its own" : " trained as parameters of their own"));
  }

  /// Identity alias n of a parameter becomes a parameter of its own: named as the alias
  /// (PyTorch's name in TorchScript exports) in place of the node, or, when that name is
  /// a generated one or a graph output, "<alias>.param" read by the Identity. The file
  /// place is recorded for the export (the node replaced, or its input set).
  void separate_alias(ir::Node* n, const std::string& why) {
    Value* src = n->inputs[0];
    Value* out = n->outputs[0];
    const int idx = node_index(n);
    if (!generated_name(out->name) && !g_.is_graph_output(out)) {
      const std::string name = out->name;
      g_.remove_node(n);  // frees the name
      Value* p = add_parameter(name, src->data->clone(), why);
      g_.replace_all_uses(out, p);
      g_.initializer_origins[name] = {{"", "", idx, ir::InitializerOrigin::kReplacesNode}};
      return;
    }
    Value* copy = add_parameter(g_.unique_name(out->name + ".param"), src->data->clone(), why);
    n->inputs[0] = copy;
    g_.initializer_origins[copy->name] = {{"", "", idx, 0}};
  }

  Value* const_i64(const std::vector<int64_t>& v) {
    return g_.add_initializer(g_.unique_name("tie_const"), Tensor::from_i64(v));
  }

  // ---- 4. tied names, merged and dropped parameters (torch.export)

  /// The innermost module of node n from its "namespace" metadata ("...; /<path>: <class>/<op>:
  /// <aten op>"): its path and class, empty when the node has none.
  std::pair<std::string, std::string> module_of(const ir::Node* n) const {
    auto it = origins_.find(n);
    if (it == origins_.end()) return {};
    auto md = metadata(*it->second, kNodeMetadataField);
    auto ns = md.find("namespace");
    if (ns == md.end()) return {};
    std::vector<std::string> seg;
    std::string cur;
    for (char ch : ns->second) {
      if (ch == '/') {
        seg.push_back(cur);
        cur.clear();
      } else {
        cur.push_back(ch);
      }
    }
    seg.push_back(cur);
    if (seg.size() < 2) return {};
    const std::string& m = seg[seg.size() - 2];
    const size_t colon = m.find(": ");
    if (colon == std::string::npos || colon == 0) return {};
    return {m.substr(0, colon), m.substr(colon + 2)};
  }

  /// Inputs of an ONNX op that hold a PyTorch module's `weight` / `bias` (how the
  /// exporters lower nn.Embedding, nn.Linear, HF Conv1D, norms and convolutions:
  /// OnnxOpInfo::module_params).
  static std::vector<ModuleParam> module_params(const std::string& op) {
    const OnnxOpInfo* info = onnx_op_info(op);
    return info ? info->module_params : std::vector<ModuleParam>{};
  }

  void restore_tied_names() {
    std::set<std::string> present;
    for (Value* v : g_.initializers) present.insert(v->name);
    auto missing_param = [&](const std::string& t) {
      auto e = by_target_.find(t);
      return e != by_target_.end() && signature_[e->second].kind == "PARAMETER" && !present.count(t);
    };
    std::vector<std::string> renamed, copies, zeros;
    std::map<Value*, std::set<std::string>> groups;  // tied tensors and their signature names
    for (ir::Node* n : node_list()) {
      auto [path, cls] = module_of(n);
      if (path.empty()) continue;
      for (auto [i, suffix] : module_params(n->op)) {
        const std::string want = path + "." + suffix;
        if (!missing_param(want)) continue;
        Value* v = n->input(i);
        if (v && v->is_initializer() && v->role == InitRole::parameter) {
          if (uniform(*v->data)) {
            // Equal-valued parameters merged by the exporter: the module's own parameter.
            Value* copy =
                add_parameter(want, v->data->clone(),
                              "torch.export signature: PARAMETER '" + want +
                                  "', restored (the exporter merged it with '" + v->name + "', equal values)");
            n->inputs[i] = copy;
            g_.initializer_origins[want] = {{"", "", node_index(n), i}};
            copies.push_back(want);
          } else {
            // One tensor under two names: tied in PyTorch (named below).
            auto& names = groups[v];
            names.insert(target_of(v).empty() ? v->name : target_of(v));
            names.insert(want);
          }
          present.insert(want);
        } else if (!v && suffix == std::string("bias") && i == n->num_inputs()) {
          // A bias the exporter dropped (all zeros of a fresh model).
          const Value* w = n->input(1);
          if (!w || !w->is_initializer() || !w->shape.is_static()) continue;
          const DType dt = w->dtype;
          const auto wd = w->shape.to_vector();
          int64_t width = -1;
          const OnnxOpInfo* info = onnx_op_info(n->op);
          const DroppedBias how = info ? info->dropped_bias : DroppedBias::none;
          if (how == DroppedBias::gemm_out_columns && wd.size() == 2)
            width = n->attrs.get_int("transB", 0) ? wd[0] : wd[1];
          else if (how == DroppedBias::weight_rows && !wd.empty())
            width = wd[0];
          Value* b = nullptr;
          if (how == DroppedBias::like_weight)
            b = add_parameter(want, Tensor(dt, wd), restored_bias(want));
          else if (width > 0)
            b = add_parameter(want, Tensor(dt, {width}), restored_bias(want));
          if (!b) continue;
          n->inputs.push_back(b);
          g_.initializer_origins[want] = {{"", "", node_index(n), i}};
          present.insert(want);
          zeros.push_back(want);
        }
      }
      // A Linear on 3-D input is MatMul (+ Add of the bias): a dropped bias has no Add.
      const OnnxOpInfo* linear = onnx_op_info(n->op);
      if (linear && linear->linear_weight_input >= 0 && cls.size() >= 6 &&
          cls.compare(cls.size() - 6, 6, "Linear") == 0 && missing_param(path + ".bias") &&
          n->outputs[0]->shape.rank() >= 1) {
        const Value* w = n->input(linear->linear_weight_input);
        int64_t width = -1;
        if (w && w->is_initializer() && w->shape.rank() == 2 && w->shape.is_static()) width = w->shape.dims[1].value;
        if (w && w->producer && ir::has_trait(*w->producer, ir::OpTrait::transpose) &&
            w->producer->input(0)->shape.rank() == 2)
          width = w->producer->input(0)->shape.dims[0].value;  // a restored W read as Transpose(W)
        if (width <= 0) continue;
        const std::string want = path + ".bias";
        Value* b = add_parameter(want, Tensor(n->input(0)->dtype, {width}), restored_bias(want));
        g_.initializer_origins[want] = {{"", "", node_index(n), -1}};
        Value* y = n->outputs[0];
        const int at = g_.index_of(n) + 1;
        ir::Node* add = g_.insert_node(static_cast<size_t>(at), "Add", g_.unique_name(want + ".add"), {y, b},
                                       {g_.unique_name(y->name + ".biased")});
        std::vector<ir::Use> us = g_.uses(y);
        for (const ir::Use& u : us)
          if (u.user != add) u.user->inputs[u.index] = add->outputs[0];
        for (Value*& o : g_.outputs)
          if (o == y) o = add->outputs[0];
        present.insert(want);
        zeros.push_back(want);
      }
    }
    // torch.export routes every use of a tied tensor through the last of its names; the
    // earlier names are placeholders no node reads. One that is missing from the file and
    // listed just before a name of a tied group is taken as another name of that tensor
    // (T5's shared.weight before encoder.embed_tokens.weight).
    std::set<std::string> referenced;
    for (ir::Node* n : node_list())
      for (const std::string& a : fx_of(n).args) referenced.insert(a);
    for (size_t i = 0; i + 1 < signature_.size(); ++i) {
      const SignatureEntry& e = signature_[i];
      if (e.kind != "PARAMETER" || present.count(e.target) || referenced.count(e.placeholder)) continue;
      for (auto& [v, names] : groups)
        if (names.count(signature_[i + 1].target)) {
          names.insert(e.target);
          present.insert(e.target);
          break;
        }
    }
    // Each tied tensor trains under the name PyTorch lists it by: its earliest name.
    for (auto& [v, names] : groups) {
      std::string first;
      for (const std::string& nm : names)
        if (by_target_.count(nm) && (first.empty() || by_target_.at(nm) < by_target_.at(first))) first = nm;
      if (first.empty()) continue;
      std::vector<std::string> quoted;
      for (const std::string& nm : names) {
        quoted.push_back("'" + nm + "'");
        if (nm != first) tied_names_.insert(nm);
      }
      renamed.push_back(list(quoted) + " are one tensor (tied in PyTorch): trained as '" + first + "'");
      if (v->name != first && !g_.find_value(first)) rename(v, first);
    }
    if (!renamed.empty()) note(list(renamed));
    if (!copies.empty())
      note("the exporter merged equal-valued parameters into one tensor (a freshly initialized model); restored as " +
           std::to_string(copies.size()) + " separate parameters from its signature (" + list(copies) + ")");
    if (!zeros.empty()) note("biases the exporter dropped as all zeros restored as parameters (" + list(zeros) + ")");
  }

  std::string restored_bias(const std::string& name) const {
    return "torch.export signature: PARAMETER '" + name + "', restored as zeros (the exporter dropped it)";
  }

  std::string target_of(const Value* v) const {
    auto p = init_placeholder_.find(v->name);
    return p == init_placeholder_.end() ? "" : param_target(p->second);
  }

  /// Records that the file holds parameter p (also) at `o`; the first record of a
  /// parameter read from the file also names its own place.
  void add_origin(const Value* p, ir::InitializerOrigin o) {
    auto& list = g_.initializer_origins[p->name];
    if (list.empty() && from_file_.count(p)) list.push_back({p->name, "", -1, -1});
    list.push_back(std::move(o));
  }

  /// Index of the file's node an IR node was imported from (-1: none).
  int node_index(const ir::Node* n) const {
    auto it = origins_.find(n);
    if (it == origins_.end()) return -1;
    if (node_indices_.empty())  // a RepeatedPtrField's elements are separate objects: map them
      for (int i = 0; i < m_.graph().node_size(); ++i) node_indices_[&m_.graph().node(i)] = i;
    auto k = node_indices_.find(it->second);
    return k == node_indices_.end() ? -1 : k->second;
  }

  void rename(Value* v, const std::string& name) {
    // Values are registered by name in the graph: re-create the initializer under the new
    // name and move the uses.
    Value* nv = g_.add_initializer(name, Tensor(*v->data));
    nv->role = v->role;
    nv->role_source = "torch.export signature: PARAMETER '" + name + "' (tied with '" + v->name + "')";
    init_placeholder_[name] = init_placeholder_[v->name];
    for (auto& [k, idx] : by_placeholder_)
      if (signature_[idx].target == name) init_placeholder_[name] = k;
    g_.replace_all_uses(v, nv);
    // Its places in the file move with it (its own place first, when it came from the file).
    auto old = g_.initializer_origins.find(v->name);
    std::vector<ir::InitializerOrigin> places;
    if (old != g_.initializer_origins.end()) {
      places = old->second;
      g_.initializer_origins.erase(old);
    } else if (from_file_.count(v)) {
      places.push_back({v->name, "", -1, -1});
    }
    if (from_file_.count(v)) from_file_.insert(nv);
    g_.initializer_origins[name] = places;
    g_.remove_unused_initializers();
  }

  std::vector<ir::Node*> node_list() const {
    std::vector<ir::Node*> v;
    for (auto& n : g_.nodes()) v.push_back(n.get());
    return v;
  }

  void report_missing() {
    std::vector<std::string> missing;
    std::set<std::string> have;
    for (Value* v : g_.initializers) have.insert(v->name);
    for (const auto& e : signature_)
      if (e.kind == "PARAMETER" && !have.count(e.target)) missing.push_back(e.target);
    // Tied names PyTorch lists once are not missing: the tie note named them.
    std::vector<std::string> really;
    for (const std::string& m : missing)
      if (!tied_away(m)) really.push_back(m);
    if (!really.empty())
      note("warning: " + std::to_string(really.size()) +
           " parameters of the exported program are not in the ONNX file and cannot be trained (the exporter folded "
           "them into constants, e.g. a static sequence length makes a position table a constant slice; export with "
           "dynamic shapes): " +
           list(really));
  }

  bool tied_away(const std::string& target) const { return tied_names_.count(target) != 0; }

  void note(const std::string& s) { g_.import_notes.push_back(s); }

  static std::string list(const std::vector<std::string>& v) {
    std::string out;
    const size_t shown = std::min<size_t>(v.size(), 8);
    for (size_t i = 0; i < shown; ++i) out += (i ? ", " : "") + v[i];
    if (v.size() > shown) out += ", and " + std::to_string(v.size() - shown) + " more";
    return out;
  }

  const onnx::ModelProto& m_;
  ir::Graph& g_;
  const NodeOrigins& origins_;
  mutable std::unordered_map<const onnx::NodeProto*, int> node_indices_;  ///< filled by node_index
  bool untie_;
  std::vector<SignatureEntry> signature_;
  std::map<std::string, size_t> by_placeholder_, by_target_;
  std::map<std::string, std::string> init_kind_, init_placeholder_;
  /// Signature names of tied parameters trained under another name (not missing).
  std::set<std::string> tied_names_;
  /// Initializers read from the file (the others were made by this resolver).
  std::set<const Value*> from_file_;
};

}  // namespace

Tensor transpose_2d(const Tensor& t) {
  const int64_t r = t.dims()[0], c = t.dims()[1];
  Tensor out(t.dtype(), {c, r});
  const size_t es = ir::dtype_size(t.dtype());
  const char* src = static_cast<const char*>(t.raw());
  char* dst = static_cast<char*>(out.raw());
  for (int64_t i = 0; i < r; ++i)
    for (int64_t j = 0; j < c; ++j) std::memcpy(dst + (j * r + i) * es, src + (i * c + j) * es, es);
  return out;
}

void declare_parameter(onnx::ModelProto& model, const std::string& name) {
  const onnx::TensorProto* init = nullptr;
  for (const auto& tp : model.graph().initializer())
    if (tp.name() == name) init = &tp;
  if (!init) return;
  auto gm = metadata(model.graph(), kGraphMetadataField);
  auto it = gm.find(kSignatureKey);
  const bool has_signature = it != gm.end();
  onnx::ValueInfoProto* vi = nullptr;
  for (auto& v : *model.mutable_graph()->mutable_value_info())
    if (v.name() == name) vi = &v;
  if (vi) {
    auto md = metadata(*vi, kValueInfoMetadataField);
    if (md.count(kKindKey)) return;  // its role is stated (buffers stay buffers)
  }
  // Without a signature, the name rule trains a float initializer with a name of its own.
  if (!has_signature && !exporter_generated_name(name)) return;
  std::string placeholder;
  if (has_signature)
    for (const SignatureEntry& e : parse_signature(it->second))
      if (e.kind == "PARAMETER" && e.target == name) placeholder = e.placeholder;
  if (!vi) {
    vi = model.mutable_graph()->add_value_info();
    vi->set_name(name);
    auto* tt = vi->mutable_type()->mutable_tensor_type();
    tt->set_elem_type(init->data_type());
    for (int64_t d : init->dims()) tt->mutable_shape()->add_dim()->set_dim_value(d);
  }
  // metadata_props (field 4): unknown to Debian's proto, written as the exporter's bytes;
  // a later entry of a key overrides an earlier one.
  std::map<std::string, std::string> entries{{kKindKey, "PARAMETER"}};
  if (!placeholder.empty()) entries[kOriginalNameKey] = placeholder;
  auto* unknown = vi->GetReflection()->MutableUnknownFields(vi);
  for (auto& [k, v] : entries) {
    onnx::StringStringEntryProto e;
    e.set_key(k);
    e.set_value(v);
    unknown->AddLengthDelimited(kValueInfoMetadataField, e.SerializeAsString());
  }
}

Status resolve_initializers(const onnx::ModelProto& model, ir::Graph& g, const NodeOrigins& origins, bool untie) {
  return Resolver(model, g, origins, untie).run();
}

}  // namespace kiln::frontend
