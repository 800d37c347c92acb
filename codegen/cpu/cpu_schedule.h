// Internal to codegen/cpu: the loop nest of a kernel's function (its schedule).
//
// After collapse_dims, pointwise kernels run dim 0 over [begin, end) and the other dims
// as nested loops (innermost unit-stride for the vectorizer). Reductions parallelize
// over the outermost kept dim; if the innermost dim is reduced ("row" mode) each output
// element accumulates in a register over all reduced dims; if the innermost dim is kept
// ("column" mode) it is processed in tiles of accumulators on the stack, reduced dims
// outside and the tile loop inside (unit stride; no reassoc there: each output sums in
// the reference's order, bit-equal to it); a column reduction over leading axes runs its
// row partitions on the threads instead (split_column). Row programs run one row at a
// time through RowProgramEmitter (cpu_rows.h).
#pragma once
#include <cstdint>
#include <functional>
#include <utility>
#include <vector>

#include "codegen/cpu/llvm_cpu.h"
#include "codegen/kernel_ir.h"
#include "llvm/IR/IRBuilder.h"

namespace kiln::codegen::cpu {

class KernelEmitter;

/// Emits the loops of one kernel with a KernelEmitter's building blocks.
class LoopSchedule {
 public:
  /// `e`: the emitter whose function is being written (entry block done).
  explicit LoopSchedule(KernelEmitter& e);

  /// Emits the kernel's loop nest at the builder's insert point and sets ck's
  /// parallel dim and extent (and split_parts, scratch_bytes for a split reduction).
  void emit(CpuKernel& ck);

  /// What the caller has checked about the innermost reduced extent e (a symbolic row's
  /// specialized versions): `whole_vectors`: e is a multiple of the vector width w, and
  /// the trip count is written (e / w) * w, which the vectorizer then knows needs no
  /// scalar remainder; `short_row`: e < w, and the loop is vectorized with its tail
  /// folded into masked vector operations (llvm.loop.vectorize.predicate.enable), one
  /// masked iteration instead of e scalar ones.
  enum class Trip { any, whole_vectors, short_row };

  /// Nested loops over the reduced dims red[ri..] (setting idx), then body(); the
  /// innermost loop carries `vector_width` as a vectorize.width hint when > 0.
  void reduced_loops(const std::vector<int>& red, size_t ri, std::vector<llvm::Value*>& idx,
                     const std::function<void()>& body, int vector_width = 0, Trip trip = Trip::any);

 private:
  void store_point(const std::vector<llvm::Value*>& idx);
  void pointwise_loops(int d, std::vector<llvm::Value*>& idx);
  void kept_loops(const std::vector<int>& kept, size_t ki, const std::vector<int>& red, std::vector<llvm::Value*>& idx,
                  bool column);
  void flat_reduced_loop(const std::vector<int>& red, std::vector<llvm::Value*>& idx, llvm::Value* lo, llvm::Value* hi,
                         const std::function<void()>& body);
  void row_body(const std::vector<int>& red, std::vector<llvm::Value*>& idx);
  void split_column(const std::vector<int>& kept, const std::vector<int>& red, std::vector<llvm::Value*>& idx,
                    int64_t parts, CpuKernel& ck);
  void column_tiles(const std::vector<int>& kept, const std::vector<int>& red, std::vector<llvm::Value*>& idx);
  void column_tile_loops(int inner, const std::vector<int>& red, std::vector<llvm::Value*>& idx, llvm::Value* lo,
                         llvm::Value* hi, std::pair<llvm::Value*, llvm::Value*> rows,
                         const std::function<void(size_t, llvm::Value*)>& finish);
  llvm::Value* i64c(int64_t v) { return B_.getInt64(static_cast<uint64_t>(v)); }

  KernelEmitter& e_;
  llvm::LLVMContext& C_;
  llvm::IRBuilder<>& B_;
  const Kernel& k_;
};

}  // namespace kiln::codegen::cpu
