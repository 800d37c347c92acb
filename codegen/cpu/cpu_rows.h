// Internal to codegen/cpu: row programs (reduce expressions, kernel_ir.h), the
// softmax, layer-norm and cross-entropy row kernels.
//
// A row program runs row by row: per kept point, pass p = 1..P is one loop over the
// reduced dims. Their float max reductions use maxnum (nnan, nsz) plus a "saw a NaN"
// flag, so they vectorize and still give NaN for a row holding one (the sign of a zero
// maximum is not specified). Values a later pass needs again and that hold a
// transcendental (Softmax's exp) are kept in a per-row stack array by the first pass
// and reloaded (row_scratch_plan); the reduced loops carry vectorize.width = the f32
// lanes of the target and no interleaving. Reduce expressions accumulate in their
// dtype's register type (f32 sums in f32 vector lanes, f64 in double).
#pragma once
#include <cstdint>
#include <string>
#include <vector>

#include "codegen/kernel_ir.h"
#include "llvm/IR/IRBuilder.h"
#include "llvm/IR/Module.h"

namespace kiln::codegen::cpu {

class KernelEmitter;
class LoopSchedule;

/// Which expressions of a row program are computed once per row and reloaded: see
/// row_scratch_plan.
struct RowScratch {
  int64_t row = 0;                        ///< elements per row (0: no scratch)
  std::vector<int> first;                 ///< per expr: the pass that stores it (0: not kept)
  std::vector<std::vector<bool>> needed;  ///< [pass][expr]: the pass uses the expr's value
};

/// The row scratch of row program `k` (`level`: k.expr_levels(); `red`: its reduced dims).
/// A symbolic row length is planned as `symbolic_row` elements (0: no scratch): the
/// emitter then guards the scratch version with row <= symbolic_row at run time.
RowScratch row_scratch_plan(const Kernel& k, const std::vector<int>& level, const std::vector<int>& red,
                            int64_t symbolic_row = 0);

/// Row elements the scratch version of a symbolic row program is planned for (16 KiB per
/// f32 array): rows up to this long take it, longer ones the generic version.
inline constexpr int64_t kSymbolicScratchRow = 4096;

/// Vector width (f32 lanes) for a reduced loop of `trip` iterations of a row program on
/// a target with features `feats` (0: the vectorizer's own choice).
int row_vector_width(const std::string& feats, int64_t trip);

/// Emits a row program (Kernel::is_row_program) for one kept point.
class RowProgramEmitter {
 public:
  /// `e`: the kernel's emitter; `s`: its schedule (for the reduced loops).
  RowProgramEmitter(KernelEmitter& e, LoopSchedule& s);

  /// Emits all passes of the row at kept point `idx` (`red`: the reduced dims). A
  /// symbolic row with a scratch plan (Kernel::versions) gets two versions: with the
  /// scratch array when the run-time row fits it, else without (the guard is
  /// loop-invariant).
  void emit(const std::vector<int>& red, std::vector<llvm::Value*>& idx);

 private:
  /// The passes of one row with `scratch` (its arrays in `buf`; none when scratch.row == 0).
  void emit_passes(const std::vector<int>& red, std::vector<llvm::Value*>& idx, const RowScratch& scratch,
                   const std::vector<llvm::Value*>& buf);
  llvm::Value* i64c(int64_t v) { return B_.getInt64(static_cast<uint64_t>(v)); }

  KernelEmitter& e_;
  LoopSchedule& s_;
  llvm::Module& M_;
  llvm::IRBuilder<>& B_;
  const Kernel& k_;
  const std::vector<int>& level_;
};

}  // namespace kiln::codegen::cpu
