// Op table entries: collectives of data-parallel training (issue 35), placed by
// passes/data_parallel.cpp and passes/optimizer.cpp (ZeRO-1), run by the communication
// layer (runtime/comm.h). Fusion class "collective": never fused, never folded, never
// recomputed. Costs count the bytes one rank sends for N = 2 (N is known at run time).
//
// AllReduceStart (kiln-internal):
//   inputs:  x_0 .. x_{k-1}   one bucket of tensors of one float dtype (gradients, the loss)
//   output:  a token (i64 scalar) that orders the pair
//   attrs:   bucket (int, the bucket's number in the order backward fills them)
//   Hands the bucket's all-reduce to the communication thread and returns at once.
// AllReduceWait (kiln-internal):
//   inputs:  the Start's token, then x_0 .. x_{k-1} (read for their types only: they stay
//            alive until the wait, as DDP's gradients stay in their bucket)
//   outputs: y_0 .. y_{k-1}   y_i = the sum of x_i over every rank (same dtype and shape)
//   attrs:   bucket
//   Every rank gets the same bits (runtime/comm.h: a rank-ordered reduce-scatter, then an
//   all-gather).
// ReduceScatter (kiln-internal, ZeRO-1):
//   inputs:  x_0 .. x_{k-1}   one bucket of float tensors (gradients)
//   outputs: y_0 .. y_{k-1}   y_i (flat, shard_elems[i] elements) = this rank's shard of the
//                             sum of x_i over every rank: elements [r*S, (r+1)*S) of the
//                             flattened sum, zeros past its end
//   attrs:   shard_elems (ints, one per input), bucket
// Shard (kiln-internal, ZeRO-1):
//   input x, output y (flat, shard_elems elements): this rank's shard of x as above, no
//   communication. attrs: shard_elems.
// AllGather (kiln-internal, ZeRO-1):
//   input x (flat, one rank's shard), output y with dims `shape`: the ranks' shards
//   concatenated in rank order, cut to the numel of `shape`. attrs: shape (ints).
// The shard of a tensor of n elements on N ranks holds S = ceil(ceil(n / 256) / N) * 256
// elements (ir::shard_elems): cut on 256-element blocks, so each block of the 8-bit
// optimizer state and its absmax stay on one rank (bitsandbytes issues #89, #2080).
#include "ir/op_table.h"
#include "ir/ops/optim8bit.h"

namespace kiln::ir {

int64_t shard_elems(int64_t numel, int64_t ranks) {
  return (num_blocks_8bit(numel) + ranks - 1) / ranks * kBlockSize8bit;
}

namespace {

/// Inputs [first, end) of a collective: present, static, f32 or f64, one dtype.
Status check_bucket(InferContext& c, size_t first) {
  for (size_t i = first; i < c.in.size(); ++i) {
    if (!c.in[i].present()) return c.fail("input " + std::to_string(i) + " is missing");
    if (c.in[i].dtype != DType::f32 && c.in[i].dtype != DType::f64)
      return c.fail("sums f32 or f64 tensors (got " + std::string(dtype_name(c.in[i].dtype)) + ")");
    if (c.in[i].dtype != c.in[first].dtype) return c.fail("a bucket holds one dtype");
    if (!c.in[i].shape.is_static()) return c.fail("input " + std::to_string(i) + " has a symbolic shape");
  }
  return Status::ok();
}

double bytes_in(const Node& n) {
  double b = 0;
  for (const Value* v : n.inputs)
    if (v && v->shape.is_static()) b += double(v->shape.numel()) * double(dtype_size(v->dtype));
  return b;
}

int64_t esize(const Value* v) { return static_cast<int64_t>(dtype_size(v->dtype)); }

/// An all-reduce of a bucket: a reduce-scatter and an all-gather of ceil(count / N)
/// elements per rank (runtime/comm.h), (N - 1) shards each.
int64_t all_reduce_bytes(const Node& n, int64_t world) {
  int64_t count = 0, es = 0;
  for (size_t i = 0; i < n.inputs.size(); ++i) {
    count += n.inputs[i]->shape.numel();
    es = esize(n.inputs[i]);
  }
  return 2 * (world - 1) * ((count + world - 1) / world) * es;
}

OpDef collective(const char* name, const char* doc, InferFn infer) {
  OpDef d = make_op(name, doc, 1, 1 << 20, std::move(infer), PrecisionPolicy::fp32, FusionClass::collective);
  d.min_outputs = 1;
  d.max_outputs = 1 << 20;
  d.onnx = false;
  return d;
}

}  // namespace

void register_collective_ops(OpTable& t) {
  // An all-reduce in two halves, so that it runs while backward goes on (DDP's overlap):
  // data_parallel places the wait just before the first reader of a sum.
  OpDef st = collective(
      "AllReduceStart",
      "kiln: starts the all-reduce of a bucket on the communication thread (returns a token; AllReduceWait ends it)",
      [](InferContext& c) -> Status {
        if (c.out.size() != 1) return c.fail("one output: the token");
        KILN_RETURN_IF_ERROR(check_bucket(c, 0));
        c.out[0] = {DType::i64, Shape()};
        return Status::ok();
      });
  st.max_outputs = 1;
  st.attrs = {{"bucket", AttrKind::i, true}};
  st.cost = [](const Node& n) { return Cost{0, bytes_in(n)}; };
  st.comm_bytes = [](const Node& n, int64_t world) { return all_reduce_bytes(n, world); };
  t.add(st);

  OpDef wt = collective(
      "AllReduceWait",
      "kiln: waits for the all-reduce AllReduceStart began (input 0: its token; inputs 1..k: the bucket) and "
      "writes the sums",
      [](InferContext& c) -> Status {
        if (c.in.size() < 2 || c.out.size() != c.in.size() - 1)
          return c.fail("inputs: the token, then the bucket; one output per bucket member");
        if (c.in[0].dtype != DType::i64) return c.fail("input 0 must be AllReduceStart's token");
        KILN_RETURN_IF_ERROR(check_bucket(c, 1));
        for (size_t i = 1; i < c.in.size(); ++i) c.out[i - 1] = c.in[i];
        return Status::ok();
      });
  wt.min_inputs = 2;
  wt.attrs = {{"bucket", AttrKind::i, true}};
  wt.cost = [](const Node& n) { return Cost{0, 0}; };
  t.add(wt);

  OpDef rs =
      collective("ReduceScatter",
                 "kiln: this rank's shard of the sum of each input over every rank (ZeRO-1's gradient reduce-scatter)",
                 [](InferContext& c) -> Status {
                   const auto shards = c.attrs().get_ints("shard_elems");
                   if (c.out.size() != c.in.size() || shards.size() != c.in.size())
                     return c.fail("needs one output and one shard_elems entry per input");
                   KILN_RETURN_IF_ERROR(check_bucket(c, 0));
                   for (size_t i = 0; i < c.in.size(); ++i) {
                     if (shards[i] <= 0) return c.fail("shard_elems must be > 0");
                     c.out[i] = {c.in[i].dtype, Shape::of({shards[i]})};
                   }
                   return Status::ok();
                 });
  rs.attrs = {{"shard_elems", AttrKind::ints, true}, {"bucket", AttrKind::i, false}};
  rs.cost = [](const Node& n) { return Cost{0, bytes_in(n) / 2}; };
  rs.comm_bytes = [](const Node& n, int64_t world) {
    int64_t b = 0;
    for (const Value* o : n.outputs) b += (world - 1) * o->shape.numel() * esize(o);
    return b;
  };
  t.add(rs);

  OpDef sh =
      collective("Shard", "kiln: this rank's shard of the flattened input (ZeRO-1's optimizer slice), no communication",
                 [](InferContext& c) -> Status {
                   if (c.in.size() != 1 || c.out.size() != 1) return c.fail("one input, one output");
                   const int64_t s = c.attrs().get_int("shard_elems", 0);
                   if (s <= 0) return c.fail("shard_elems must be > 0");
                   if (!c.in[0].present() || !c.in[0].shape.is_static()) return c.fail("needs a static input");
                   c.out[0] = {c.in[0].dtype, Shape::of({s})};
                   return Status::ok();
                 });
  sh.max_inputs = 1;
  sh.max_outputs = 1;
  sh.attrs = {{"shard_elems", AttrKind::i, true}};
  sh.traits = static_cast<OpTraits>(OpTrait::rank_shard);
  sh.cost = [](const Node& n) { return Cost{0, 0}; };
  t.add(sh);

  OpDef ag =
      collective("AllGather",
                 "kiln: the ranks' shards concatenated in rank order, cut and shaped to `shape` (ZeRO-1's parameters)",
                 [](InferContext& c) -> Status {
                   if (c.in.size() != 1 || c.out.size() != 1) return c.fail("one input, one output");
                   if (!c.in[0].present() || !c.in[0].shape.is_static() || c.in[0].shape.rank() != 1)
                     return c.fail("needs a flat static shard");
                   const auto dims = c.attrs().get_ints("shape");
                   Shape out = Shape::of(dims);
                   c.out[0] = {c.in[0].dtype, out};
                   return Status::ok();
                 });
  ag.max_inputs = 1;
  ag.max_outputs = 1;
  ag.attrs = {{"shape", AttrKind::ints, true}};
  ag.cost = [](const Node& n) { return Cost{0, bytes_in(n)}; };
  ag.comm_bytes = [](const Node& n, int64_t world) {
    return (world - 1) * n.inputs[0]->shape.numel() * esize(n.inputs[0]);
  };
  t.add(ag);
}

}  // namespace kiln::ir
