// Internal to codegen/cpu: KernelEmitter, the LLVM function of one (collapsed) kernel.
//
// The emitter owns the function being written and the building blocks every schedule
// needs: register and memory types, loads and stores (bf16/f16 rounding), the scalar
// expressions of the kernel (transcendentals through cpu_math.h), reduction steps and
// counted loops. emit() writes the function's entry and hands the loop nest to
// LoopSchedule (cpu_schedule.h), which runs row programs through RowProgramEmitter
// (cpu_rows.h). The numerics are described at the top of llvm_cpu.cpp.
#pragma once
#include <cstdint>
#include <functional>
#include <map>
#include <string>
#include <vector>

#include "codegen/cpu/cpu_math.h"
#include "codegen/cpu/llvm_cpu.h"
#include "codegen/kernel_ir.h"
#include "llvm/IR/IRBuilder.h"
#include "llvm/IR/Module.h"

namespace kiln::codegen::cpu {

/// Emits the LLVM function of one (collapsed) kernel into a module.
class KernelEmitter {
 public:
  /// `fn_name`: the LLVM function's name (the kernel's name when empty); `cpu` and
  /// `feats`: the target-cpu and target-features attributes (none when empty).
  KernelEmitter(llvm::Module& m, const Kernel& k, const std::string& cpu, const std::string& feats,
                std::string fn_name = {});

  /// Emits the function and returns the schedule (fn left null).
  CpuKernel emit();

  // ---- the function being emitted (valid inside emit())
  llvm::LLVMContext& context() { return C_; }
  llvm::Module& module() { return M_; }
  llvm::IRBuilder<>& builder() { return B_; }
  /// The kernel (collapsed dims).
  const Kernel& kernel() const { return k_; }
  llvm::Function* function() { return F_; }
  /// The function's `begin` and `end` arguments: the range of the parallel dim.
  llvm::Value* begin() { return begin_; }
  llvm::Value* end() { return end_; }
  /// The function's `buffers` argument.
  llvm::Value* buffers() { return buffers_; }
  /// Kernel::expr_levels() of the kernel.
  const std::vector<int>& levels() const { return level_; }
  /// The target-features string ("+avx512f,..."; empty: none given).
  const std::string& features() const { return feats_; }

  // ---- types and constants
  /// Type of a `t` value in registers (bf16/f16 as f32, bool as i1).
  llvm::Type* reg_type(ir::DType t);
  /// Type of a `t` element in memory (bf16/f16 as i16, bool as i8).
  llvm::Type* mem_type(ir::DType t);
  /// An i64 constant.
  llvm::Value* i64c(int64_t v) { return B_.getInt64(static_cast<uint64_t>(v)); }
  /// An extent or stride as an i64 value: a constant, or (a symbolic kernel) computed once
  /// in the entry block from the symbol values the call passes (llvm_cpu.h), so that it
  /// dominates every use and is loop-invariant.
  llvm::Value* ext(const Extent& e);
  /// A symbolic kernel's launch value: the i64 after its symbols' values (the row
  /// partitions of a symbolic split reduction, CpuKernel::split_parts -1); null in a
  /// static kernel.
  llvm::Value* launch_value();
  /// The scratch pointer (CpuKernel::scratch_bytes): the buffer after the parameters'
  /// (and the symbol values' in a symbolic kernel), loaded at the insertion point.
  llvm::Value* scratch();
  /// `v` as a register constant of dtype `t` (rounded to bf16/f16 precision).
  llvm::Value* constant(ir::DType t, double v);
  /// A quiet NaN of float type `t`.
  llvm::Value* qnan(llvm::Type* t) { return llvm::ConstantFP::getQNaN(t); }
  /// Rounds an f32 register value to dtype t's precision (no-op for f32/f64).
  llvm::Value* round_to(ir::DType t, llvm::Value* f);

  // ---- memory
  /// Loads param p's element at domain point `idx` (null entries: index 0) as a register value.
  llvm::Value* load(int p, const std::vector<llvm::Value*>& idx);
  /// A load of a guarded param: the element inside its guard box, else `fallback`.
  llvm::Value* guarded_load(int p, const std::vector<llvm::Value*>& idx, llvm::Value* fallback);
  /// Stores register value `v` to param p's element at `idx`. `rounded`: v is an
  /// expression value of p's dtype, so a bf16 v is already rounded (every bf16 register
  /// value of an expression is) and is stored without rounding again; false for
  /// accumulators converted back.
  void store(int p, const std::vector<llvm::Value*>& idx, llvm::Value* v, bool rounded = false);
  /// While set (d >= 0), dims d and d + 1 are walked by one loop variable j in
  /// [0, domain[d] * domain[d + 1]) with idx[d] = j / inner, idx[d + 1] = j % inner: a
  /// param whose stride along d is inner times its stride along d + 1 is addressed by
  /// j * stride (affine, so its accesses stay consecutive for the loop vectorizer).
  void set_flat(int d, llvm::Value* j, int64_t inner) { flat_d_ = d, flat_j_ = j, flat_inner_ = inner; }

  // ---- expressions
  /// Every expression at `idx` (no reduce expressions).
  std::vector<llvm::Value*> eval(const std::vector<llvm::Value*>& idx);
  /// Expressions of level < max_level at `idx`; reduce expressions from `known`,
  /// non-null `preset` entries used as given.
  std::vector<llvm::Value*> eval(const std::vector<llvm::Value*>& idx, const std::vector<llvm::Value*>* known,
                                 int max_level, const std::vector<llvm::Value*>* preset = nullptr);

  // ---- reductions
  /// Accumulator type of a reduction of dtype t (float store sums: double).
  llvm::Type* acc_type_t(ReduceKind r, ir::DType t, bool is_store = true);
  /// Accumulator type of a reduction store.
  llvm::Type* acc_type(const KStore& s);
  /// An accumulator converted back to the register type of the store's output.
  llvm::Value* acc_result(const KStore& s, llvm::Value* acc);
  /// The start value of a reduction (0, -inf or the lowest integer).
  llvm::Value* reduce_init_t(ReduceKind r, ir::DType t, bool is_store = true);
  /// The start value of a reduction store.
  llvm::Value* reduce_init(const KStore& s);
  /// acc (+ or max) v; `reassoc` marks a float sum reassociable.
  llvm::Value* reduce_step_t(ReduceKind r, ir::DType t, llvm::Value* acc, llvm::Value* v, bool reassoc);
  /// reduce_step_t for a reduction store.
  llvm::Value* reduce_step(const KStore& s, llvm::Value* acc, llvm::Value* v, bool reassoc);

  // ---- control flow
  /// for (i = lo; i < hi; ++i) body(i), with a vectorize.width hint when vector_width > 0
  /// (`predicated`: and tail folding into masked vector operations); the builder ends
  /// at the loop exit.
  void for_range(llvm::Value* lo, llvm::Value* hi, const std::function<void(llvm::Value*)>& body, int vector_width = 0,
                 bool predicated = false);
  /// if (begin < end) body().
  void guard_once(const std::function<void()>& body);
  /// Lower and upper bound of dim d's loop ([begin, end) for the parallel dim).
  llvm::Value* range_lo(int d, int parallel) { return d == parallel ? begin_ : i64c(0); }
  llvm::Value* range_hi(int d, int parallel) { return d == parallel ? end_ : ext(k_.domain[d]); }
  /// The end of the entry block (before its branch to the loops) in a symbolic kernel,
  /// where values computed from the symbols (ext) are placed.
  llvm::Instruction* entry_end() { return entry_->getTerminator(); }
  /// An alloca of n (null: one) `t` in the entry block.
  llvm::Value* entry_alloca(llvm::Type* t, llvm::Value* n);

 private:
  llvm::Value* bf16_bits(llvm::Value* f);
  llvm::Value* address(int p, const std::vector<llvm::Value*>& idx);
  llvm::Value* intrinsic(llvm::Intrinsic::ID id, std::vector<llvm::Value*> args) {
    return math_.intrinsic(id, std::move(args));
  }
  llvm::Value* float_op(ir::ScalarOp op, ir::DType t, llvm::Value* x, llvm::Value* y);
  llvm::Value* int_op(ir::ScalarOp op, ir::DType t, llvm::Value* x, llvm::Value* y);
  llvm::Value* compare(ir::ScalarOp op, ir::DType t, llvm::Value* x, llvm::Value* y);
  llvm::Value* cast(ir::DType from, ir::DType to, llvm::Value* x);

  llvm::LLVMContext& C_;
  llvm::Module& M_;
  Kernel k_;
  llvm::IRBuilder<> B_;
  MathEmitter math_;
  std::string cpu_, feats_, fn_name_;
  llvm::Type* i64_ = nullptr;
  llvm::Function* F_ = nullptr;
  llvm::BasicBlock* entry_ = nullptr;
  llvm::Value* begin_ = nullptr;
  llvm::Value* end_ = nullptr;
  llvm::Value* buffers_ = nullptr;
  std::vector<llvm::Value*> base_;
  /// Per param: its alias scope (one per buffer: an in-place output shares its input's)
  /// and the scopes of every other buffer, set on each load and store so that LLVM need
  /// not prove with run-time checks that the kernel's buffers are disjoint (the executor
  /// gives every output its own buffer, or, declared by in_place_of, its input's).
  std::vector<llvm::MDNode*> scope_, noalias_;
  int flat_d_ = -1;  ///< set_flat
  llvm::Value* flat_j_ = nullptr;
  int64_t flat_inner_ = 1;
  std::vector<int> level_;                   ///< Kernel::expr_levels()
  std::map<std::string, llvm::Value*> sym_;  ///< symbol -> its value (loaded in the entry block)
  llvm::Value* sym_vals_ = nullptr;          ///< the symbol values' pointer (a symbolic kernel)
  llvm::Value* launch_value_ = nullptr;      ///< see launch_value() (loaded on first use)
  std::map<std::string, llvm::Value*> ext_;  ///< ext(): expression text -> its value
};

}  // namespace kiln::codegen::cpu
