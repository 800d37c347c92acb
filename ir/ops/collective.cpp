// Op table entries: collectives of data-parallel training (issue 35), placed by
// passes/data_parallel.cpp and run by the communication layer (runtime/comm.h).
//
// AllReduce (kiln-internal):
//   inputs:  x_0 .. x_{k-1}   one bucket of tensors of one float dtype (gradients, the loss)
//   outputs: y_0 .. y_{k-1}   y_i = the sum of x_i over every rank (same dtype and shape)
//   attrs:   bucket (int, the bucket's number in the order backward fills them)
// Every rank gets the same bits (a reduce-scatter then an all-gather: runtime/comm.h).
// Fusion class "collective": never fused, never folded, never recomputed; its cost is
// the bytes one rank sends (2 (N-1)/N of the bucket, N unknown here: taken as 2x).
#include "ir/op_table.h"

namespace kiln::ir {

void register_collective_ops(OpTable& t) {
  OpDef d = make_op(
      "AllReduce",
      "kiln: sum of each input over every rank of a data-parallel job (MPI reduce-scatter + all-gather, as "
      "PyTorch DDP's bucketed all-reduce)",
      1, 1 << 20,
      [](InferContext& c) -> Status {
        if (c.out.size() != c.in.size()) return c.fail("needs one output per input");
        for (size_t i = 0; i < c.in.size(); ++i) {
          if (!c.in[i].present()) return c.fail("input " + std::to_string(i) + " is missing");
          if (c.in[i].dtype != c.in[0].dtype) return c.fail("a bucket holds one dtype");
          if (c.in[i].dtype != DType::f32 && c.in[i].dtype != DType::f64)
            return c.fail("sums f32 or f64 tensors (got " + std::string(dtype_name(c.in[i].dtype)) + ")");
          if (!c.in[i].shape.is_static()) return c.fail("input " + std::to_string(i) + " has a symbolic shape");
          c.out[i] = c.in[i];
        }
        return Status::ok();
      },
      PrecisionPolicy::fp32, FusionClass::collective);
  d.min_outputs = 1;
  d.max_outputs = 1 << 20;
  d.attrs = {{"bucket", AttrKind::i, false}};
  d.onnx = false;
  d.cost = [](const Node& n) {
    Cost c;
    for (const Value* v : n.inputs)
      if (v && v->shape.is_static()) c.bytes += 2.0 * double(v->shape.numel()) * double(dtype_size(v->dtype));
    return c;
  };
  t.add(d);
}

}  // namespace kiln::ir
