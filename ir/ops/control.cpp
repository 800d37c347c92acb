// Op table entries: control flow. AccumulationLoop is the gradient-accumulation
// loop of DESIGN.md convention 11 (passes/accumulation.cpp builds it).
//
// AccumulationLoop (kiln-internal, one region "body"):
//   inputs:  carried_0 .. carried_{k-1}  initial values of the loop-carried state
//                                        (zero accumulators, BatchNorm running stats)
//            scan_0 .. scan_{s-1}        per-step data, leading dim trip_count * b
//   outputs: carried values after the last iteration (dtype/shape of the inputs)
//   attrs:   trip_count (N >= 1), num_carried (k)
//   body inputs:  carried (k), then scan slices (s) with leading dim b: iteration t
//                 sees rows [t*b, (t+1)*b) of every scan input (ONNX Scan's slicing,
//                 along axis 0, without Scan's stacking of the trip count as a dim)
//   body outputs: the next carried values (k)
// The body may read values of the enclosing graph directly (loop invariants such
// as parameters and their hoisted bf16 casts), as ONNX Loop/Scan bodies read outer
// scope. The eager interpreter runs it (runtime/interpreter.cpp).
//
// FusedKernel (kiln-internal, one region "body", built by passes/fusion.cpp):
//   inputs:  every value the group reads from outside (body input i <-> node input i)
//   outputs: every group value used outside it (body output j <-> node output j)
//   attrs:   kind ("pointwise": every body node is pointwise with one output shape,
//            the kernel's iteration domain; "reduction": a pointwise prologue closed by a
//            ReduceSum/ReduceMax; "row": one row op (OpDef::row: Softmax family,
//            LayerNormalization) with pointwise prologue and epilogue over its input's shape)
//   The body is self-contained (no captures). The compiled backend runs it as one
//   generated kernel (codegen/lower.h); the eager interpreter runs the body op by op,
//   so a fused program still has the eager oracle.
#include "ir/op_table.h"

namespace kiln::ir {

void register_control_ops(OpTable& t) {
  OpDef d = make_op(
      "AccumulationLoop",
      "kiln: gradient-accumulation loop over trip_count microbatches; carried state in, carried state out "
      "(body region reads scan slices of the leading dim, cf. ONNX Scan)",
      1, 1 << 20,
      [](InferContext& c) -> Status {
        const Node& n = c.node;
        const int64_t trips = c.attrs().get_int("trip_count", 0);
        const int64_t k = c.attrs().get_int("num_carried", -1);
        if (trips < 1) return c.fail("trip_count must be >= 1");
        if (k < 0 || k > static_cast<int64_t>(c.in.size())) return c.fail("num_carried out of range");
        if (n.regions.size() != 1) return c.fail("expects exactly one region (the body)");
        const Graph& body = *n.regions[0];
        if (body.inputs.size() != c.in.size())
          return c.fail("body has " + std::to_string(body.inputs.size()) + " inputs, the node " +
                        std::to_string(c.in.size()));
        if (static_cast<int64_t>(body.outputs.size()) != k || static_cast<int64_t>(c.out.size()) != k)
          return c.fail("body and node must have num_carried outputs");
        for (size_t i = static_cast<size_t>(k); i < c.in.size(); ++i) {
          const Shape& s = c.in[i].shape;
          if (s.rank() < 1 || !s.dims[0].is_static() || s.dims[0].value % trips != 0)
            return c.fail("scan input " + std::to_string(i) + " has leading dim " + s.to_string() +
                          ", not a multiple of trip_count " + std::to_string(trips));
        }
        for (int64_t i = 0; i < k; ++i) c.out[i] = c.in[i];
        return Status::ok();
      },
      PrecisionPolicy::follow_inputs, FusionClass::opaque);
  d.min_outputs = 1;
  d.max_outputs = 1 << 20;
  d.attrs = {{"trip_count", AttrKind::i, true}, {"num_carried", AttrKind::i, true}};
  d.onnx = false;
  d.cost = [](const Node& n) {
    // The body's cost, trip_count times.
    Cost c;
    const int64_t trips = n.attrs.get_int("trip_count", 1);
    if (n.regions.empty()) return c;
    for (auto& bn : n.regions[0]->nodes()) {
      const OpDef* bd = OpTable::get().find(bn->op);
      if (!bd || !bd->cost) continue;
      Cost b = bd->cost(*bn);
      c.flops += b.flops * static_cast<double>(trips);
      c.bytes += b.bytes * static_cast<double>(trips);
    }
    return c;
  };
  t.add(d);

  OpDef f = make_op(
      "FusedKernel",
      "kiln: a fused group of pointwise ops run as one generated kernel; the body region holds the original "
      "nodes (body inputs = node inputs, body outputs = node outputs)",
      0, 1 << 20,
      [](InferContext& c) -> Status {
        const Node& n = c.node;
        if (n.regions.size() != 1) return c.fail("expects exactly one region (the body)");
        const Graph& body = *n.regions[0];
        if (body.inputs.size() != c.in.size())
          return c.fail("body has " + std::to_string(body.inputs.size()) + " inputs, the node " +
                        std::to_string(c.in.size()));
        if (body.outputs.size() != c.out.size())
          return c.fail("body has " + std::to_string(body.outputs.size()) + " outputs, the node " +
                        std::to_string(c.out.size()));
        for (size_t i = 0; i < c.in.size(); ++i)
          if (c.in[i].dtype != body.inputs[i]->dtype)
            return c.fail("input " + std::to_string(i) + " dtype differs from the body's");
        for (size_t i = 0; i < c.out.size(); ++i) c.out[i] = {body.outputs[i]->dtype, body.outputs[i]->shape};
        return Status::ok();
      },
      PrecisionPolicy::follow_inputs, FusionClass::opaque);
  f.min_outputs = 1;
  f.max_outputs = 1 << 20;
  f.attrs = {{"kind", AttrKind::s, true}};
  f.onnx = false;
  f.cost = [](const Node& n) {
    // Members' flops; bytes of the fused node's own inputs and outputs (intermediates stay in registers).
    Cost c;
    if (n.regions.empty()) return c;
    for (auto& bn : n.regions[0]->nodes()) c.flops += node_cost(*bn).flops;
    for (const Value* v : n.inputs)
      if (v && v->shape.is_static()) c.bytes += static_cast<double>(v->shape.numel() * dtype_size(v->dtype));
    for (const Value* v : n.outputs)
      if (v->shape.is_static()) c.bytes += static_cast<double>(v->shape.numel() * dtype_size(v->dtype));
    return c;
  };
  t.add(f);
}

}  // namespace kiln::ir
