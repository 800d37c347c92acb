// Kernel IR: the target-neutral, loop-level form of one fused group of the training
// program (DESIGN.md, codegen/). A kernel is an iteration domain, a DAG of scalar
// expressions over strided loads, and stores. Extents and strides are expressions over
// the program's shape symbols (ir/sym_expr.h; constants in a static program): a symbolic
// kernel (issue 32) is generated once and computes its loop bounds and addresses from
// the symbol values the executor passes at launch (tinygrad's launch_dims(var_vals)). Views (broadcasting,
// and later Transpose/Reshape/Slice) are index arithmetic: each parameter carries its
// own element strides per domain dimension, 0 for a broadcast dimension. Reductions
// are domain dimensions marked `reduced`: a reduction store accumulates over them, and
// a `reduce` expression (an inline reduction, as Halide's `sum(...)` or TVM's `te.sum`)
// is the reduction of its argument over them, usable by later expressions: a row
// kernel such as Softmax is max, then sum of exp(x - max), then a plain store of
// exp(x - max) / sum, one kernel (docs/architecture.md, decision 22).
//
// The CPU emitter (codegen/cpu/llvm_cpu.h) and the CUDA emitter (codegen/cuda/cuda_emitter.h)
// render the same Kernel; nothing target-specific lives here. The form follows
// Halide/TVM's separation of the computation (expressions over an index domain) from
// its schedule (loop order, vectorization and threads, chosen by each emitter).
#pragma once
#include <cstdint>
#include <map>
#include <string>
#include <vector>

#include "ir/dtype.h"
#include "ir/op_table.h"
#include "ir/status.h"
#include "ir/sym_expr.h"

namespace kiln::codegen {

/// An extent or element stride of a kernel: a constant, or a polynomial over shape
/// symbols evaluated at launch (`seq`, `64*seq`).
using Extent = ir::SymExpr;

/// The value of a constant extent, -1 for a symbolic one (for code that handles static
/// kernels only: the CUDA emitter, schedule choices).
inline int64_t static_extent(const Extent& e) { return e.is_constant() ? e.constant_value() : -1; }

/// One buffer the kernel reads or writes.
struct KernelParam {
  std::string name;  ///< the IR value it holds (for dumps and errors)
  ir::DType dtype = ir::DType::f32;
  /// Element strides, one per domain dimension (0: broadcast along that dimension).
  /// Element (i0, i1, ...) of the domain is at sum(i_d * strides[d]) + offset.
  std::vector<Extent> strides;
  int64_t offset = 0;  ///< element offset of domain index (0, ..., 0); static
  bool is_output = false;
  /// Outputs only: written in place of input param `in_place_of` (same dtype, strides and
  /// offset; -1: its own buffer). Emitters address both through the input's pointer, so
  /// the compiler sees one buffer (no alias checks); the executor hands the kernel that
  /// input's buffer, or a copy of it (kiln_inplace on the FusedKernel).
  int in_place_of = -1;
  /// Inputs only: the box of domain points where the param is read, [guard_lo[d],
  /// guard_hi[d]) per dim (empty vectors: everywhere). A load outside the box reads no
  /// memory and gives its fallback (KExpr: a Concat's other input, a Pad's constant);
  /// inside it the element offset + sum i_d * strides[d] lies in the buffer, so `offset`
  /// may be negative (a Concat input starting at index c of the axis: -c * stride).
  /// Static kernels only (verify refuses a guard in a symbolic kernel).
  std::vector<int64_t> guard_lo, guard_hi;
  bool guarded() const { return !guard_lo.empty(); }
};

/// How a store (or a `reduce` expression) combines the values of the domain points
/// that map to one element.
enum class ReduceKind { none, sum, max };

/// One node of the expression DAG. `args` index earlier entries of Kernel::exprs.
///
/// Kind::load of a guarded param (KernelParam::guard_lo) may have one arg: the value
/// outside the guard box (the same dtype; without it, zero).
///
/// Kind::reduce (one arg, `reduce` = sum or max, dtype = the arg's): the value at a
/// domain point is the reduction of the arg over every point that agrees with it on the
/// kept (non-reduced) dims, so it is constant along the reduced dims ("row-invariant").
/// Float sums accumulate in the dtype's compute precision (f32 for f32, bf16 and f16;
/// double for f64) in an order the emitter chooses (vector lanes, warp trees): a rule
/// that needs a double sum of f32 values sums an f64 cast of them (LayerNormalization,
/// SoftmaxGrad); the reference evaluator sums in double. Max starts from -inf (NaN if
/// any element is NaN). The *level* of an
/// expression is the depth of reduce expressions nested in it (loads and constants: 0);
/// emitters compute level-L reductions in the L-th pass over the reduced dims.
struct KExpr {
  enum class Kind { load, constant, op, reduce };
  Kind kind = Kind::op;
  ir::ScalarOp op = ir::ScalarOp::add;  ///< for Kind::op
  ir::DType dtype = ir::DType::f32;     ///< result dtype (bf16/f16: computed in f32, rounded)
  std::vector<int> args;
  int param = -1;                        ///< for Kind::load: index into Kernel::params
  double value = 0;                      ///< for Kind::constant
  ReduceKind reduce = ReduceKind::none;  ///< for Kind::reduce: sum or max
};

/// out[param at domain index] = exprs[expr]; for a reduction store the output's
/// strides are 0 along every reduced dim and the stored element is the sum (or max)
/// over them, starting from 0 (or -inf). In a kernel with reduced dims, a plain
/// (`none`) store is either a *point store* (the output varies along a reduced dim:
/// one element per domain point) or a *row store* (strides 0 along every reduced dim:
/// its expression must be row-invariant, e.g. LayerNormalization's Mean). A kernel
/// with reduced dims needs at least one reduction store or reduce expression.
struct KStore {
  int param = -1;
  int expr = -1;
  ReduceKind reduce = ReduceKind::none;
};

/// One generated kernel.
struct Kernel {
  std::string name;            ///< unique in its program (C identifier characters)
  std::vector<Extent> domain;  ///< iteration extents
  std::vector<bool> reduced;   ///< per domain dim: summed/maxed over (empty = none)
  std::vector<KernelParam> params;
  std::vector<KExpr> exprs;  ///< topological order
  std::vector<KStore> stores;
  std::vector<std::string> fused_nodes;  ///< IR node names the kernel computes (for dumps)
  /// A symbolic kernel may hold specialized versions chosen at launch by a guard (a row
  /// program whose run-time innermost row extent is a multiple of the vector width runs
  /// whole vectors, with no remainder loop; one shorter than a vector runs one masked
  /// vector iteration); false (--symbolic_versions off, the
  /// FusedKernel's kiln_symbolic_versions = 0): the generic form only. Printed as
  /// `generic` in to_string(); no effect on a static kernel.
  bool versions = true;

  /// Number of domain points (product of extents; 1 for rank 0).
  Extent domain_size() const;
  /// True when an extent or stride names a symbol.
  bool is_symbolic() const;
  /// The symbols the extents and strides name, sorted: the order of the values a
  /// symbolic kernel takes at launch (see llvm_cpu.h).
  std::vector<std::string> symbols() const;
  /// Copy with the symbols of `values` replaced by their values (a static kernel when
  /// every symbol is bound).
  Kernel bind(const std::map<std::string, int64_t>& values) const;
  /// True when some domain dim is reduced (reduction stores or reduce expressions).
  bool has_reduction() const;
  /// True when the kernel has reduce expressions or plain stores beside reduced dims
  /// (a "row program": several passes over each row); false for plain pointwise kernels
  /// and for kernels whose stores are all reductions of level-0 expressions.
  bool is_row_program() const;
  /// Per expression: its level (nested reduce depth; see KExpr).
  std::vector<int> expr_levels() const;
  /// Per expression: true when its value is constant along every reduced dim (constants,
  /// loads with stride 0 there, reduce expressions, ops of such).
  std::vector<bool> row_invariant() const;
  /// True when the output of store `s` has a non-zero stride along some reduced dim: a
  /// plain store then writes one element per domain point (a point store), else once
  /// per row (a row store).
  bool varies_along_reduced(const KStore& s) const;
  /// Passes over each row that a kernel with reduced dims needs: the deepest reduce
  /// expression's level, or one more than the level of a reduction or point store's
  /// expression, whichever is larger (see evaluate_reference).
  int row_passes() const;
  /// Partitions of a split column reduction (ir::column_sum_partitions), 0 for none
  /// (and for a kernel whose row count is symbolic: see column_split_shape):
  /// a reduction kernel (not a row program) whose reduced dims of extent > 1 all precede
  /// its kept dims of extent > 1 (from the shape alone, as the eager ReduceSum decides;
  /// rows and columns are the products of each). Float sums of such a kernel follow the
  /// partitioned order (evaluate_reference, the emitters); max and integer sums do not
  /// depend on the order.
  int64_t column_split_parts() const;
  /// The shape of a column reduction that may be split (column_split_parts' rule) with
  /// static columns: true with `rows` (the product of the reduced extents, an expression
  /// where a reduced extent is symbolic) and `cols` (the product of the kept extents).
  /// False for other kernels and when a kept extent or a reduced extent after a kept one
  /// is symbolic. A symbolic `rows` is split at launch (ir::column_sum_partitions of its
  /// value), which is the order the bound kernel's column_split_parts gives.
  bool column_split_shape(Extent* rows, int64_t* cols) const;
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
  int add_param(std::string name, ir::DType dt, std::vector<Extent> strides, bool is_output = false,
                int64_t offset = 0);
  /// A load of parameter `param`, in its dtype; `fallback` (guarded params only, -1:
  /// zero) is the value outside the param's guard box.
  int add_load(int param, int fallback = -1);
  /// A literal of dtype `dt`.
  int add_constant(double v, ir::DType dt);
  /// A primitive applied to earlier expressions; `dt` is the result dtype.
  int add_op(ir::ScalarOp op, std::vector<int> args, ir::DType dt);
  /// The sum or max of expression `arg` over the reduced dims (dtype: the arg's).
  int add_reduce(ReduceKind r, int arg);
  /// Stores expression `expr` into output parameter `param` (a reduction when r != none).
  void add_store(int param, int expr, ReduceKind r = ReduceKind::none);
};

/// Elements the buffer of param `p` of a static kernel must hold: the largest element
/// index it reaches over the domain, plus one (0 for an empty domain; -1 when `k` is
/// symbolic).
int64_t param_elements(const Kernel& k, const KernelParam& p);

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
/// double for f64, int64 for integers. Slow; for tests only. A symbolic kernel runs at
/// the symbol values `symbols` (every symbol it names; else an error).
Status evaluate_reference(const Kernel& k, const std::vector<void*>& buffers,
                          const std::map<std::string, int64_t>& symbols = {});

}  // namespace kiln::codegen
