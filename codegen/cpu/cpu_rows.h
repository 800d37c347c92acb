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

#include "codegen/cpu/cpu_schedule.h"
#include "codegen/kernel_ir.h"
#include "llvm/IR/IRBuilder.h"
#include "llvm/IR/Module.h"

namespace kiln::codegen::cpu {

class KernelEmitter;

/// Which expressions of a row program are computed once per row and reloaded: see
/// row_scratch_plan.
struct RowScratch {
  int64_t row = 0;                        ///< elements per row (0: no scratch)
  std::vector<int> first;                 ///< per expr: the pass that stores it (0: not kept)
  std::vector<std::vector<bool>> needed;  ///< [pass][expr]: the pass uses the expr's value
};

/// The row scratch of row program `k` (`level`: k.expr_levels(); `red`: its reduced dims).
/// A symbolic row length is planned as `symbolic_row` elements (0: no scratch): which
/// values to keep is decided for rows that long; the emitter then sizes the arrays by
/// the run-time row and keeps them when they fit kRowScratchBytes.
RowScratch row_scratch_plan(const Kernel& k, const std::vector<int>& level, const std::vector<int>& red,
                            int64_t symbolic_row = 0);

/// Bytes of row scratch a row program keeps per calling thread, on its stack (all
/// arrays together): a static row keeps what fits; a symbolic row checks at launch.
inline constexpr int64_t kRowScratchBytes = 128 * 1024;

/// Row elements a symbolic row program's scratch plan assumes (16 KiB per f32 array).
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
  /// symbolic row with a scratch plan keeps its values in stack arrays of the run-time
  /// row length when they fit kRowScratchBytes, else recomputes them (a loop-invariant
  /// guard). With Kernel::versions, a symbolic innermost row extent that is a multiple
  /// of the vector width takes a whole-vectors version (no scalar remainder loop), and
  /// one shorter than a vector a short-row version (one masked vector iteration).
  void emit(const std::vector<int>& red, std::vector<llvm::Value*>& idx);

 private:
  /// The passes of one row with `scratch` (its arrays in `buf`; none when scratch.row == 0);
  /// `trip`: see LoopSchedule::Trip.
  void emit_passes(const std::vector<int>& red, std::vector<llvm::Value*>& idx, const RowScratch& scratch,
                   const std::vector<llvm::Value*>& buf, LoopSchedule::Trip trip);
  llvm::Value* i64c(int64_t v) { return B_.getInt64(static_cast<uint64_t>(v)); }

  KernelEmitter& e_;
  LoopSchedule& s_;
  llvm::Module& M_;
  llvm::IRBuilder<>& B_;
  const Kernel& k_;
  const std::vector<int>& level_;
};

}  // namespace kiln::codegen::cpu
