// Kernel IR: the target-neutral, loop-level form of one fused group of the training
// program (DESIGN.md, codegen/). A kernel is an iteration domain with static extents,
// a DAG of scalar expressions over strided loads, and stores. Views (broadcasting,
// and later Transpose/Reshape/Slice) are index arithmetic: each parameter carries its
// own element strides per domain dimension, 0 for a broadcast dimension. Reductions
// are domain dimensions marked `reduced`: a reduction store accumulates over them.
//
// The CPU emitter (codegen/cpu/llvm_cpu.h) and the CUDA emitter (codegen/cuda/cuda_emitter.h)
// render the same Kernel; nothing target-specific lives here. The form follows
// Halide/TVM's separation of the computation (expressions over an index domain) from
// its schedule (loop order, vectorization and threads, chosen by each emitter).
#pragma once
#include <cstdint>
#include <string>
#include <vector>

#include "ir/dtype.h"
#include "ir/op_table.h"
#include "ir/status.h"

namespace kiln::codegen {

/// One buffer the kernel reads or writes.
struct KernelParam {
  std::string name;              ///< the IR value it holds (for dumps and errors)
  ir::DType dtype = ir::DType::f32;
  /// Element strides, one per domain dimension (0: broadcast along that dimension).
  /// Element (i0, i1, ...) of the domain is at sum(i_d * strides[d]) + offset.
  std::vector<int64_t> strides;
  int64_t offset = 0;            ///< element offset of domain index (0, ..., 0)
  bool is_output = false;
};

/// One node of the expression DAG. `args` index earlier entries of Kernel::exprs.
struct KExpr {
  enum class Kind { load, constant, op };
  Kind kind = Kind::op;
  ir::ScalarOp op = ir::ScalarOp::add;  ///< for Kind::op
  ir::DType dtype = ir::DType::f32;     ///< result dtype (bf16/f16: computed in f32, rounded)
  std::vector<int> args;
  int param = -1;                       ///< for Kind::load: index into Kernel::params
  double value = 0;                     ///< for Kind::constant
};

/// How a store combines the values of the domain points that map to one element.
enum class ReduceKind { none, sum, max };

/// out[param at domain index] = exprs[expr]; for a reduction store the output's
/// strides are 0 along every reduced dim and the stored element is the sum (or max)
/// over them, starting from 0 (or -inf). A kernel's stores are all `none` (then no
/// dim is reduced) or all reductions over the same reduced dims.
struct KStore {
  int param = -1;
  int expr = -1;
  ReduceKind reduce = ReduceKind::none;
};

/// One generated kernel.
struct Kernel {
  std::string name;                 ///< unique in its program (C identifier characters)
  std::vector<int64_t> domain;      ///< iteration extents (static)
  std::vector<bool> reduced;        ///< per domain dim: summed/maxed over (empty = none)
  std::vector<KernelParam> params;
  std::vector<KExpr> exprs;         ///< topological order
  std::vector<KStore> stores;
  std::vector<std::string> fused_nodes;  ///< IR node names the kernel computes (for dumps)

  /// Number of domain points (product of extents; 1 for rank 0).
  int64_t domain_size() const;
  bool has_reduction() const;
  /// Text form, e.g.
  ///   kernel fused_3 domain [512, 64] reduced [-, -]
  ///     param 0 %x f32 strides [64, 1] in
  ///     %e0 = load p0 : f32
  ///     %e2 = add %e0, %e1 : f32
  ///     store p2 <- %e2
  std::string to_string() const;
  /// Structural checks (arity, dtypes, strides length, store rules); error names the kernel.
  Status verify() const;

  // Builders: each appends one entry and returns its index (no checks; verify() checks).
  /// A buffer parameter: element strides per domain dim (0: broadcast), element offset.
  int add_param(std::string name, ir::DType dt, std::vector<int64_t> strides, bool is_output = false,
                int64_t offset = 0);
  /// A load of parameter `param`, in its dtype.
  int add_load(int param);
  /// A literal of dtype `dt`.
  int add_constant(double v, ir::DType dt);
  /// A primitive applied to earlier expressions; `dt` is the result dtype.
  int add_op(ir::ScalarOp op, std::vector<int> args, ir::DType dt);
  /// Stores expression `expr` into output parameter `param` (a reduction when r != none).
  void add_store(int param, int expr, ReduceKind r = ReduceKind::none);
};

/// base^e for 64-bit integers by squaring, wrapping on overflow, with ONNX/numpy rules
/// for negative exponents (1 for base 1, +-1 for base -1, else 0), as the eager Pow
/// kernel; emitters narrow the result to the dtype's width.
int64_t ipow_wrapping(int64_t base, int64_t e);

/// Text of `k`'s computation without its name and the IR names of its parameters: two
/// kernels with equal keys compute the same function over the same buffer layouts, so
/// one generated function serves both (emitters deduplicate with it).
std::string structure_key(const Kernel& k);

/// Copy of `k` with adjacent domain dims merged wherever every parameter (and the
/// reduced flags) allows it, so that emitters see the fewest, longest loops. The
/// function computed is unchanged.
Kernel collapse_dims(const Kernel& k);

/// Reference evaluator (the oracle for emitter tests): runs `k` point by point on raw
/// buffers (one pointer per parameter) in each dtype's compute type, as the eager
/// kernels do: f32 for f32/bf16/f16 (bf16/f16 results rounded to nearest even),
/// double for f64, int64 for integers. Slow; for tests only.
Status evaluate_reference(const Kernel& k, const std::vector<void*>& buffers);

}  // namespace kiln::codegen
