// fusion: groups pointwise nodes into FusedKernel nodes, each run as one generated
// kernel by the compiled backend (DESIGN.md pipeline: ... -> accumulation -> fusion).
//
// Algorithm (greedy vertical fusion in schedule order, the producer-consumer fusion
// of XLA's instruction fusion and TorchInductor's pointwise scheduler, without
// horizontal fusion yet):
//  * A node is fusable when its op-table entry is pointwise and has a scalar rule
//    (OpDef::scalar) that accepts the node's dtypes, every output has a known shape
//    (static, or symbolic: a kernel with run-time extents, issue 32),
//    and it carries no kiln_inplace attribute (in-place accumulator updates keep their
//    buffer-reuse contract with the executor).
//  * Walking the nodes in order, a fusable node joins (and merges) the groups of its
//    producers when (a) its output shape equals the group's domain (the shape every
//    member produces; inputs of smaller shapes are broadcast loads), and (b) no value
//    of the group is read by a node placed between the group's members and this node
//    outside the group, because the fused node runs where its last member was.
//    Otherwise it starts a new group.
//  * A reduction with a code-generation rule (OpDef::reduce_combine: ReduceSum) closes
//    the pointwise group producing its input when no other node reads that group (a
//    "reduction" kernel: pointwise prologue, then the sum; bias gradients such as
//    ReduceSum(dY) or sums of squares for the gradient norm), else it forms a
//    reduction kernel of its own. Epilogues after a reduction are not fused yet.
//  * A row op (OpDef::row: Softmax, LogSoftmax, their gradients, LayerNormalization)
//    whose row dims are the trailing dims of its input joins the pointwise groups of its
//    producers over its input's shape (prologue: attention scale and mask, bf16 -> f32
//    casts) like a pointwise node, and later pointwise nodes over that shape join it
//    (epilogue: the f32 -> bf16 cast): a "row" kernel, at most one row op each
//    (docs/architecture.md, decision 22). A node that reads only a row group's
//    statistics (row stores such as Mean) does not join it: it starts its own group
//    (typically the prologue of a column reduction, passes/decompose.cpp).
//  * A widening Cast of a value read elsewhere too starts a group (its readers join it)
//    instead of joining its producer's, which would write a second, wider copy. A
//    widening Cast read by several fusable nodes is first repeated before each of them
//    (repeat_shared_widening_casts), so each kernel reads the narrow value.
//  * A view (Transpose; Expand; Slice with positive steps; the Reshape family; constant
//    shape operands) starts a group over its output shape (later pointwise nodes join
//    it): code generation reads its input through permuted, broadcast, stepped or
//    reshaped dense strides with an offset, so the copy is one generated loop nest,
//    fused with its consumers, never a separate pass. Its input must reach the kernel
//    only through it; its constant operands are copied into the body. A Reshape-family
//    view is fused only for its one reader, and a group of such views alone stays
//    unfused (the interpreter shares their storage). A guarded view (Concat, Pad in
//    constant mode, SliceGrad with unit steps: ir::is_guarded_view_op) is fused the same
//    way, each data input read inside a box of the output and the fill outside (a
//    Concat's other inputs, the pad value, zeros), as Inductor lowers cat and pad into
//    masked loads: the rotary embedding's concatenation of its rotated halves, and the
//    SliceGrad / Concat of its backward, become part of the pointwise kernels around them.
//  * Each group becomes one FusedKernel node at the position of its last member. The
//    body region holds the original nodes (names, attributes and all), so the IR dump
//    shows every fusion decision (invariant 2). Rank-0 constants the members read
//    are copied into the body so code generation can fold them.
//  * Runs recursively on loop bodies (AccumulationLoop regions).
// Options: fusion_min_nodes (default 1): groups with fewer nodes stay unfused.
#include <algorithm>
#include <map>
#include <set>
#include <unordered_map>
#include <unordered_set>

#include "ir/op_table.h"
#include "ir/ops/nn.h"
#include "passes/passes.h"

namespace kiln::passes {

using namespace kiln::ir;

namespace {

/// Records dtypes only: checks that a node's scalar rule accepts its dtypes.
class DryRunBuilder : public ScalarBuilder {
 public:
  explicit DryRunBuilder(const Node& n) : n_(n) {}
  const Node& node() const override { return n_; }
  bool has_input(int i) const override { return i < n_.num_inputs() && n_.inputs[i]; }
  Ref input(int i) override { return push(n_.inputs[i] ? n_.inputs[i]->dtype : DType::undefined); }
  Ref constant(double, DType dt) override { return push(dt); }
  Ref apply(ScalarOp, std::vector<Ref>, DType dt) override { return push(dt); }
  DType dtype(Ref r) const override { return dts_[r]; }
  Ref reduce(ScalarOp, Ref x) override { return push(dts_[x]); }

 private:
  Ref push(DType d) {
    dts_.push_back(d);
    return static_cast<Ref>(dts_.size() - 1);
  }
  const Node& n_;
  std::vector<DType> dts_;
};

bool fusable(const Node& n) {
  const OpDef* def = OpTable::get().find(n.op);
  if (!def || def->fusion != FusionClass::pointwise || !def->scalar) return false;
  if (n.attrs.has("kiln_inplace") || !n.regions.empty()) return false;
  for (const Value* o : n.outputs)
    if (!o->shape.is_known() || o->dtype == DType::undefined) return false;
  if (n.num_outputs() != 1) return false;
  for (const Value* in : n.inputs)
    if (!in || !in->shape.is_known()) return false;
  DryRunBuilder b(n);
  std::vector<ScalarBuilder::Ref> outs;
  if (!def->scalar(b, outs).is_ok() || outs.size() != 1) return false;
  return b.dtype(outs[0]) == n.outputs[0]->dtype;
}

/// A row op code generation can emit as one kernel (OpDef::row): known shapes, float
/// input 0, row dims that are the trailing dims of input 0 (the rows are contiguous, the
/// fast layout of every emitter), and a row rule whose results match the outputs.
bool row_fusable(const Node& n) {
  const OpDef* def = OpTable::get().find(n.op);
  if (!def || !def->row || !def->row_dims || !n.regions.empty() || n.attrs.has("kiln_inplace")) return false;
  const Value* x = n.input(0);
  if (!x || !x->shape.is_known() || !is_float(x->dtype) || x->shape.rank() == 0) return false;
  for (const Value* in : n.inputs)
    if (in && (!in->shape.is_known() || in->shape.rank() > x->shape.rank())) return false;
  for (const Value* o : n.outputs)
    if (!o->shape.is_known() || o->dtype == DType::undefined) return false;
  auto dims = def->row_dims(n);
  if (!dims || dims->empty()) return false;
  for (size_t i = 0; i < dims->size(); ++i)
    if ((*dims)[i] != x->shape.rank() - static_cast<int>(dims->size()) + static_cast<int>(i)) return false;
  DryRunBuilder b(n);
  std::vector<ScalarBuilder::Ref> outs;
  if (!def->row(b, outs).is_ok() || outs.size() != n.outputs.size()) return false;
  for (size_t i = 0; i < outs.size(); ++i)
    if (b.dtype(outs[i]) != n.outputs[i]->dtype) return false;
  return true;
}

/// Ops code generation reads through strides (ir::is_strided_view_op) or guards
/// (ir::is_guarded_view_op: Concat, constant Pad, SliceGrad) instead of running them.
bool is_view_node(const Node& n) { return is_strided_view_op(n.op) || is_guarded_view_op(n.op); }

/// Inputs of a view node that code generation reads through it (the others are constant
/// operands): input 0 of a strided view, the data inputs of a guarded one.
std::vector<int> viewed_inputs(const Node& n) {
  if (is_guarded_view_op(n.op)) return guarded_view_inputs(n);
  return {0};
}
bool is_viewed_input(const Node& n, int k) {
  const auto v = viewed_inputs(n);
  return std::find(v.begin(), v.end(), k) != v.end();
}

/// A view that code generation absorbs as index arithmetic: its input becomes a kernel
/// parameter with permuted (Transpose), broadcast (Expand: stride 0 along expanded
/// dims), stepped and offset (Slice, positive steps) or its own (AsStrided, non-negative)
/// strides, no copy of its own.
/// Known shapes (guarded views: static); Expand's shape and Slice's starts/ends/axes/steps
/// are constants (they are copied into the kernel body).
bool view_fusable(const Node& n) {
  if (!is_view_node(n) || n.num_outputs() != 1 || !n.regions.empty() || n.attrs.has("kiln_inplace")) return false;
  if (is_guarded_view_op(n.op)) {
    // Every data input read through a guard box (distinct values: one parameter each),
    // the constant operands copied into the body.
    const Value* y = n.outputs[0];
    if (!y->shape.is_static() || y->shape.numel() <= 0 || y->dtype == DType::undefined) return false;
    std::unordered_set<const Value*> seen;
    const auto data = guarded_view_inputs(n);
    for (int k = 0; k < n.num_inputs(); ++k) {
      const Value* v = n.inputs[k];
      const bool is_data = std::find(data.begin(), data.end(), k) != data.end();
      if (!is_data) {
        if (v && !v->is_initializer()) return false;
        continue;
      }
      if (!v || v->dtype != y->dtype || !seen.insert(v).second || !guarded_read(n, k)) return false;
    }
    return true;
  }
  const Value* x = n.input(0);
  const Value* y = n.outputs[0];
  if (!x || !x->shape.is_known() || !y->shape.is_known() || x->dtype == DType::undefined) return false;
  for (int k = 1; k < n.num_inputs(); ++k)
    if (n.inputs[k] && !n.inputs[k]->is_initializer()) return false;
  if (y->shape.is_static() && y->shape.numel() <= 0) return false;
  // The op's own conditions (OpDef::view_fusable): Transpose keeps the rank, AsStrided's
  // strides are non-negative, Slice's steps positive, ...
  const OpDef* def = OpTable::get().find(n.op);
  return def && def->view_fusable && def->view_fusable(n);
}

/// Values read by node `n`, nested-region captures included.
std::vector<const Value*> reads(const Node& n) {
  std::vector<const Value*> r(n.inputs.begin(), n.inputs.end());
  for (auto& reg : n.regions) {
    std::unordered_set<const Value*> caps;
    collect_captures(*reg, caps);
    r.insert(r.end(), caps.begin(), caps.end());
  }
  return r;
}

struct Group {
  std::vector<Node*> members;
  Shape domain;
  std::unordered_set<const Value*> values;  // outputs of members
  bool reduction = false;                   // closed by a reduction (its last member)
  bool row = false;                         // holds a row op (kind "row")
  bool view = false;                        // holds a view (Transpose, Expand, Slice) read through strides
};

/// A reduction code generation can emit: ReduceSum-like op (OpDef::reduce_combine) on a
/// known-shape float input, constant axes, not the no-op form, one output.
bool reduction_fusable(const Node& n) {
  const OpDef* def = OpTable::get().find(n.op);
  if (!def || !def->reduce_combine || n.num_outputs() != 1 || !n.regions.empty()) return false;
  const Value* x = n.input(0);
  if (!x || !x->shape.is_known() || !is_float(x->dtype) || x->shape.rank() == 0) return false;
  if (!n.outputs[0]->shape.is_known() || n.outputs[0]->dtype != x->dtype) return false;
  const Value* ax = n.input(1);
  if (ax && !ax->is_initializer()) return false;
  auto spec = reduce_spec(n.attrs, ax != nullptr, ax ? ax->data.get() : nullptr, x->shape.rank());
  return spec && !spec->noop && !spec->axes.empty();
}

Status fuse_graph(Graph& g, int min_nodes, int& counter);

Status fuse_regions(Graph& g, int min_nodes, int& counter) {
  for (auto& n : g.nodes())
    for (auto& r : n->regions)
      if (!has_trait(*n, OpTrait::fused_kernel)) KILN_RETURN_IF_ERROR(fuse_graph(*r, min_nodes, counter));
  return Status::ok();
}

/// A widening Cast (autocast's bf16 -> f32 input casts of fp32-policy nodes: a batch
/// norm's statistics and normalisation over a convolution's bf16 output) read by several
/// nodes that fuse is repeated right before each of its later fusable readers
/// ("<cast>/dup<k>"), so that every copy fuses into its reader's kernel, which then reads
/// the narrow value. Written out once, the wide copy would cost a kernel of its own, a
/// write and reads of twice the bytes, and its memory while the readers run (Inductor
/// inlines cheap pointwise producers into each consumer the same way). The cast stays
/// for its first reader and for any reader that does not fuse.
Status repeat_shared_widening_casts(Graph& g) {
  std::unordered_set<const Value*> outs(g.outputs.begin(), g.outputs.end());
  for (auto& sb : g.state)
    if (sb.output) outs.insert(sb.output);
  // Readers of every value in schedule order (each once), found in one pass.
  std::unordered_map<const Value*, std::vector<Node*>> readers;
  std::vector<Node*> casts;
  for (auto& n : g.nodes()) {
    for (const Value* in : n->inputs) {
      if (!in) continue;
      auto& r = readers[in];
      if (r.empty() || r.back() != n.get()) r.push_back(n.get());
    }
    const Value* x = n->num_inputs() == 1 ? n->inputs[0] : nullptr;
    if (has_trait(*n, OpTrait::cast) && x && is_float(x->dtype) && n->num_outputs() == 1 &&
        is_float(n->outputs[0]->dtype) && dtype_size(n->outputs[0]->dtype) > dtype_size(x->dtype) &&
        !outs.count(n->outputs[0]) && fusable(*n))
      casts.push_back(n.get());
  }
  for (Node* c : casts) {
    Value* y = c->outputs[0];
    const std::vector<Node*>& rs = readers[y];
    for (size_t k = 1; k < rs.size(); ++k) {
      Node* r = rs[k];
      if (!fusable(*r) && !reduction_fusable(*r) && !row_fusable(*r)) continue;
      Node* d = g.insert_node(static_cast<size_t>(g.index_of(r)), c->op, c->name + "/dup" + std::to_string(k),
                              {c->inputs[0]}, {g.unique_name(y->name + ".dup")}, c->attrs);
      KILN_RETURN_IF_ERROR(infer_node(*d).with_context("fusion"));
      for (auto& in : r->inputs)
        if (in == y) in = d->outputs[0];
    }
  }
  return Status::ok();
}

Status fuse_graph(Graph& g, int min_nodes, int& counter) {
  KILN_RETURN_IF_ERROR(fuse_regions(g, min_nodes, counter));
  KILN_RETURN_IF_ERROR(repeat_shared_widening_casts(g));
  const auto& nodes = g.nodes();
  std::unordered_map<const Node*, size_t> pos;
  for (size_t i = 0; i < nodes.size(); ++i) pos[nodes[i].get()] = i;
  // Readers of every value, as node positions (nodes[] is not modified until every
  // group is known).
  std::unordered_map<const Value*, std::vector<size_t>> readers;
  for (size_t i = 0; i < nodes.size(); ++i)
    for (const Value* v : reads(*nodes[i]))
      if (v) readers[v].push_back(i);
  auto group_at = [&](size_t r, const std::unordered_map<const Node*, int>& go) {
    auto it = go.find(nodes[r].get());
    return it == go.end() ? -1 : it->second;
  };

  std::unordered_set<const Value*> graph_outs(g.outputs.begin(), g.outputs.end());
  for (auto& sb : g.state)
    if (sb.output) graph_outs.insert(sb.output);
  std::vector<Group> groups;
  std::unordered_map<const Node*, int> group_of;
  for (size_t i = 0; i < nodes.size(); ++i) {
    Node* n = nodes[i].get();
    if (reduction_fusable(*n)) {
      // Joins the pointwise group producing its input when nothing else reads that
      // group (the reduced value is the kernel's only output); else runs alone.
      const Value* x = n->inputs[0];
      int chosen = -1;
      auto it = x->producer ? group_of.find(x->producer) : group_of.end();
      if (it != group_of.end() && !groups[it->second].reduction && !groups[it->second].row &&
          groups[it->second].domain == x->shape) {
        bool ok = true;
        for (const Value* v : groups[it->second].values) {
          if (graph_outs.count(v)) ok = false;
          for (size_t r : readers[v])
            if (r != i && group_at(r, group_of) != it->second) ok = false;
        }
        if (ok) chosen = it->second;
      }
      if (chosen < 0) {
        groups.push_back({});
        chosen = static_cast<int>(groups.size()) - 1;
        groups[chosen].domain = x->shape;
      }
      groups[chosen].members.push_back(n);
      groups[chosen].values.insert(n->outputs[0]);
      groups[chosen].reduction = true;
      group_of[n] = chosen;
      continue;
    }
    const bool row = row_fusable(*n);
    // A Reshape-family view joins a kernel only for its one reader: were its output read
    // elsewhere too, the kernel would write it out (a copy where the interpreter shares
    // storage) or the other reader would split a kernel it used to share.
    const bool view = !row && view_fusable(*n) &&
                      (!is_view_op(n->op) || (readers[n->outputs[0]].size() == 1 && !graph_outs.count(n->outputs[0])));
    if (!row && !view && !fusable(*n)) continue;
    // Pointwise: its output shape. Row op: its input 0's shape (the kernel's domain).
    const Shape& dom = row ? n->inputs[0]->shape : n->outputs[0]->shape;
    // Candidate groups: those of n's producers with n's domain (pointwise groups, or a
    // row group that n extends with an epilogue; a row op takes no second row op). A
    // candidate stays when every reader of its values placed before n belongs to a
    // candidate too; the survivors merge with n into one group.
    std::set<int> cand;
    // A widening Cast of a value that something else reads too (so it is written out
    // anyway) starts a group and fuses forward into its readers: joining the producer
    // would add a second, wider output (an f64 copy of an activation for a column sum).
    const Value* x0 = n->num_inputs() == 1 ? n->inputs[0] : nullptr;
    const bool widen_shared = has_trait(*n, OpTrait::cast) && x0 && n->num_outputs() == 1 &&
                              dtype_size(n->outputs[0]->dtype) > dtype_size(x0->dtype) &&
                              (readers[x0].size() > 1 || graph_outs.count(x0));
    for (const Value* in : n->inputs) {
      if (view || widen_shared) break;  // a view starts a group: its input must come from outside it
      if (!in || !in->producer) continue;
      auto it = group_of.find(in->producer);
      if (it == group_of.end()) continue;
      const Group& gc = groups[it->second];
      // A row group takes as epilogue only nodes that read one of its elementwise
      // values; a node reading just its row statistics (Mean, InvStdDev: broadcast
      // along the row) starts a group of its own, so that it can feed a column
      // reduction instead of becoming a full-size output of the row kernel.
      if (gc.row && !row && !(in->shape == dom)) continue;
      if (gc.domain == dom && !gc.reduction && !(row && gc.row)) cand.insert(it->second);
    }
    for (bool changed = true; changed;) {
      changed = false;
      for (auto c = cand.begin(); c != cand.end();) {
        bool ok = true;
        for (const Value* v : groups[*c].values) {
          for (size_t r : readers[v])
            if (r < i && !cand.count(group_at(r, group_of))) ok = false;
          if (!ok) break;
        }
        if (ok) {
          ++c;
        } else {
          c = cand.erase(c);
          changed = true;
        }
      }
    }
    // A view's input must be a kernel input read only through it (one parameter per
    // input, with the view's strides): drop candidates holding views until
    // no merged group reads a viewed value another way or computes it.
    auto view_conflict = [&]() {
      std::unordered_map<const Value*, int> viewed;
      std::unordered_set<const Value*> direct, made;
      auto add = [&](const Node* m) {
        if (is_view_node(*m))
          for (int k : viewed_inputs(*m)) viewed[m->inputs[k]]++;
        else
          for (const Value* in : m->inputs)
            if (in) direct.insert(in);
        for (const Value* o : m->outputs) made.insert(o);
      };
      for (int c : cand)
        for (const Node* m : groups[c].members) add(m);
      add(n);
      for (auto& [v, k] : viewed)
        if (k > 1 || direct.count(v) || made.count(v)) return true;
      return false;
    };
    bool any_view = view;
    for (int c : cand) any_view |= groups[c].view;
    while (any_view && !cand.empty() && view_conflict()) {
      auto drop = cand.begin();
      for (auto c = cand.begin(); c != cand.end(); ++c)
        for (const Node* m : groups[*c].members)
          if (is_view_node(*m)) drop = c;
      cand.erase(drop);
    }
    // At most one row op per kernel: keep the first row candidate only.
    bool have_row = row;
    for (auto c = cand.begin(); c != cand.end();) {
      if (groups[*c].row && have_row) {
        c = cand.erase(c);
        continue;
      }
      have_row |= groups[*c].row;
      ++c;
    }
    int chosen = cand.empty() ? -1 : *cand.begin();
    for (int c : cand) {
      if (c == chosen) continue;
      Group& from = groups[c];
      for (Node* m : from.members) {
        groups[chosen].members.push_back(m);
        group_of[m] = chosen;
      }
      groups[chosen].values.insert(from.values.begin(), from.values.end());
      groups[chosen].row |= from.row;
      groups[chosen].view |= from.view;
      from.members.clear();
      from.values.clear();
    }
    if (chosen < 0) {
      groups.push_back({});
      chosen = static_cast<int>(groups.size()) - 1;
      groups[chosen].domain = dom;
    }
    groups[chosen].members.push_back(n);
    for (Value* o : n->outputs) groups[chosen].values.insert(o);
    groups[chosen].row |= row;
    groups[chosen].view |= view;
    group_of[n] = chosen;
  }
  // Condition (b) makes every reader of a group value outside the group come after
  // the group's last member, where the fused node runs. Merged groups list their
  // members out of order: restore schedule order.
  for (Group& gr : groups)
    std::sort(gr.members.begin(), gr.members.end(), [&](const Node* a, const Node* b) { return pos[a] < pos[b]; });

  // Interfaces of every group, computed before the graph changes.
  struct Plan {
    Group* gr;
    std::vector<Value*> ext_in, consts, ext_out;
  };
  std::vector<Plan> plans;
  std::unordered_set<const Value*> graph_outputs(g.outputs.begin(), g.outputs.end());
  for (auto& sb : g.state)
    if (sb.output) graph_outputs.insert(sb.output);
  for (Group& gr : groups) {
    if (gr.members.empty() || static_cast<int>(gr.members.size()) < min_nodes) continue;
    // A group of Reshape-family views alone would turn the interpreter's storage-sharing
    // view into a copy kernel: leave it unfused.
    bool only_reshapes = true;
    for (const Node* m : gr.members) only_reshapes &= is_view_op(m->op);
    if (only_reshapes) continue;
    std::unordered_set<const Node*> member_set(gr.members.begin(), gr.members.end());
    // External inputs in first-read order; group outputs read outside or graph outputs.
    std::vector<Value*> ext_in;
    std::unordered_set<const Value*> seen;
    std::vector<Value*> consts;  // rank-0 initializers copied into the body
    for (Node* m : gr.members)
      for (int k = 0; k < m->num_inputs(); ++k) {
        Value* in = m->inputs[k];
        if (!in || gr.values.count(in) || seen.count(in)) continue;
        seen.insert(in);
        const bool axes = gr.reduction && m == gr.members.back() && k == 1;     // reduction axes: constant
        const bool view_operand = is_view_node(*m) && !is_viewed_input(*m, k);  // Expand's shape, Slice's starts...
        // Data a guarded view reads inside its box is loaded through the guard, a
        // one-element constant too (T5's label shift at batch 1 scatters a [1, 1] zero).
        const bool guarded_data = is_guarded_view_op(m->op) && is_viewed_input(*m, k);
        if (axes || view_operand ||
            (!guarded_data && in->is_initializer() && in->data->numel() == 1 && !is_parameter_candidate(*in)))
          consts.push_back(in);
        else
          ext_in.push_back(in);
      }
    std::vector<Value*> ext_out;
    for (Node* m : gr.members)
      for (Value* o : m->outputs) {
        bool outside = graph_outputs.count(o) > 0;
        for (size_t r : readers[o])
          if (!member_set.count(nodes[r].get())) outside = true;
        if (outside) ext_out.push_back(o);
      }
    if (ext_out.empty()) continue;  // dead group: canonicalize removes it
    plans.push_back({&gr, ext_in, consts, ext_out});
  }
  std::unordered_map<Value*, Value*> renamed;  // outputs of groups already replaced
  for (Plan& p : plans) {
    Group& gr = *p.gr;
    std::vector<Value*> ext_in = p.ext_in;
    for (Value*& v : ext_in)
      while (renamed.count(v)) v = renamed[v];
    const std::vector<Value*>& consts = p.consts;
    const std::vector<Value*>& ext_out = p.ext_out;
    const std::string name = "fused_" + std::to_string(counter++);
    auto body = std::make_unique<Graph>();
    body->name = name;
    body->opset = g.opset;
    std::unordered_map<const Value*, Value*> map;
    // Body values are named "<fused>/<outer name>": value names are unique across a
    // graph and its regions (verifier), and the outer names stay with the outer values.
    const std::string pre = name + "/";
    for (Value* v : ext_in) map[v] = body->add_input(pre + v->name, v->dtype, v->shape);
    for (Value* v : consts) map[v] = body->add_initializer(pre + v->name, *v->data);
    for (Node* m : gr.members) {
      std::vector<Value*> ins;
      for (Value* in : m->inputs) ins.push_back(in ? map.at(in) : nullptr);
      std::vector<std::string> outs;
      for (Value* o : m->outputs) outs.push_back(pre + o->name);
      Node* bn = body->add_node(m->op, m->name, ins, outs, m->attrs);
      for (size_t k = 0; k < m->outputs.size(); ++k) {
        bn->outputs[k]->dtype = m->outputs[k]->dtype;
        bn->outputs[k]->shape = m->outputs[k]->shape;
        map[m->outputs[k]] = bn->outputs[k];
      }
    }
    for (Value* o : ext_out) body->outputs.push_back(map.at(o));
    // Replace the members by one node where the last member was.
    std::vector<std::string> out_names;
    for (Value* o : ext_out) out_names.push_back(o->name);
    const int last_pos = g.index_of(gr.members.back());
    for (auto it = gr.members.rbegin(); it != gr.members.rend(); ++it) g.remove_node(*it);
    const size_t insert_at = static_cast<size_t>(last_pos) + 1 - gr.members.size();
    Attributes a;
    a.set("kind", std::string(gr.reduction ? "reduction" : gr.row ? "row" : "pointwise"));
    Node* f = g.insert_node(insert_at, "FusedKernel", name, ext_in, out_names, a);
    f->regions.push_back(std::move(body));
    for (size_t k = 0; k < ext_out.size(); ++k) {
      Value* nv = f->outputs[k];
      nv->dtype = ext_out[k]->dtype;
      nv->shape = ext_out[k]->shape;
      g.replace_all_uses(ext_out[k], nv);
      renamed[ext_out[k]] = nv;
      for (auto& sb : g.state)
        if (sb.output == ext_out[k]) sb.output = nv;
    }
  }
  return Status::ok();
}

/// --symbolic_versions off: every FusedKernel with a symbolic shape gets
/// kiln_symbolic_versions = 0 (codegen generates its generic form only; Kernel::versions).
void mark_generic(Graph& g) {
  for (auto& n : g.nodes()) {
    if (has_trait(*n, OpTrait::fused_kernel)) {
      bool symbolic = false;
      for (const Value* v : n->inputs) symbolic |= v && !v->shape.is_static();
      for (const Value* v : n->outputs) symbolic |= v && !v->shape.is_static();
      if (symbolic) n->attrs.set("kiln_symbolic_versions", int64_t(0));
      continue;
    }
    for (auto& r : n->regions) mark_generic(*r);
  }
}

class Fusion : public Pass {
 public:
  std::string name() const override { return "fusion"; }
  std::string describe_options(const PassOptions& o) const override {
    OptionText t;
    t.add("fusion_min_nodes", o.lowering.fusion_min_nodes);
    if (!o.lowering.symbolic_versions) t.add("symbolic_versions", false);
    return t.str();
  }
  Expected<bool> run(Graph& g, PassContext& ctx) override {
    const int min_nodes = ctx.options.lowering.fusion_min_nodes;
    int counter = 0;
    KILN_RETURN_IF_ERROR(fuse_graph(g, std::max(1, min_nodes), counter));
    if (!ctx.options.lowering.symbolic_versions) mark_generic(g);
    // Rank-0 constants now copied into every kernel that read them (the decompositions'
    // counts and epsilons) no longer need to stay resident.
    if (counter > 0) g.remove_unused_initializers();
    return counter > 0;
  }
};

}  // namespace

std::unique_ptr<Pass> make_fusion_pass() { return std::make_unique<Fusion>(); }

}  // namespace kiln::passes
