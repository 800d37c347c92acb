// Row programs (cpu_rows.h): the scratch plan and the passes of one row.
#include "codegen/cpu/cpu_rows.h"

#include <algorithm>
#include <functional>
#include <limits>

#include "codegen/cpu/cpu_emitter.h"
#include "codegen/cpu/cpu_schedule.h"
#include "llvm/IR/Intrinsics.h"

namespace kiln::codegen::cpu {

using ir::DType;
using ir::ScalarOp;

/// Float expressions whose value a later pass needs again and whose computation holds
/// a transcendental op (exp, log, tanh, erf, sin, cos, pow; not sqrt or div alone,
/// which cost about what a reload does) or at least kScratchMinOps vector operations
/// (a load of a mask or integer counting one, for its test or conversion) are kept in
/// a row scratch array: the first pass that needs one stores it, later passes reload
/// it instead of recomputing it (the store and the reload use the load/store ports, not
/// the vector ALUs that bound these loops). Only the outermost such expressions are
/// kept (Softmax keeps its exp, not also the exp's argument, in the pass after its
/// max; its masked, scaled scores Where(mask, -inf, x * scale) in the max's pass).
/// Rows longer than kRowScratchBytes / element size keep nothing. The values are
/// bit-identical to recomputation, so the reference evaluator is unchanged.
RowScratch row_scratch_plan(const Kernel& k, const std::vector<int>& level, const std::vector<int>& red,
                            int64_t symbolic_row) {
  constexpr int kScratchMinOps = 3;
  const size_t ne = k.exprs.size();
  const int passes = k.row_passes();
  RowScratch r;
  r.first.assign(ne, 0);
  r.needed.assign(passes + 1, std::vector<bool>(ne, false));
  // needed[p]: the args of the level-p reduce expressions and the expressions of the
  // stores written in pass p (level p - 1), closed over args but not through reduce
  // expressions (their values are known by then).
  for (int p = 1; p <= passes; ++p) {
    std::vector<bool>& need = r.needed[p];
    for (size_t i = 0; i < ne; ++i)
      if (k.exprs[i].kind == KExpr::Kind::reduce && level[i] == p) need[k.exprs[i].args[0]] = true;
    for (const KStore& s : k.stores)
      if (level[s.expr] == p - 1 && (s.reduce != ReduceKind::none || k.varies_along_reduced(s))) need[s.expr] = true;
    for (size_t i = ne; i-- > 0;)
      if (need[i] && k.exprs[i].kind == KExpr::Kind::op)
        for (int a : k.exprs[i].args) need[a] = true;
  }
  int64_t row = 1;  // -1: a symbolic row length without a planned size (no scratch)
  for (int d : red) row = row < 0 || static_extent(k.domain[d]) < 0 ? -1 : row * static_extent(k.domain[d]);
  if (row < 0 && symbolic_row > 0) row = symbolic_row;
  std::vector<bool> heavy(ne, false), costly(ne, false);  // holds a transcendental; heavy or 3+ ops
  std::vector<int> ops(ne, 0);                            // vector operations recomputing it takes (capped)
  for (size_t i = 0; i < ne; ++i) {
    const KExpr& e = k.exprs[i];
    if (e.kind == KExpr::Kind::load) ops[i] = ir::is_float(e.dtype) ? 0 : 1;  // a mask's test
    if (e.kind != KExpr::Kind::op) continue;
    switch (e.op) {
      case ScalarOp::exp:
      case ScalarOp::log:
      case ScalarOp::tanh:
      case ScalarOp::erf:
      case ScalarOp::sin:
      case ScalarOp::cos:
      case ScalarOp::pow:
        heavy[i] = ir::is_float(e.dtype);
        break;
      default:
        break;
    }
    ops[i] = 1;
    for (int a : e.args) {
      const KExpr& ae = k.exprs[a];
      heavy[i] = heavy[i] || (ae.kind == KExpr::Kind::op && heavy[a]);
      if (ae.kind != KExpr::Kind::reduce) ops[i] = std::min(ops[i] + ops[a], 64);
    }
    costly[i] = heavy[i] || ops[i] >= kScratchMinOps;
  }
  // Candidates: costly float exprs first needed in pass q and needed again later.
  // Row-invariant values (one per row, e.g. a per-row coefficient) are not kept.
  std::vector<int> first_need(ne, 0);
  std::vector<bool> cand(ne, false);
  const std::vector<bool> invariant = k.row_invariant();
  for (size_t i = 0; i < ne; ++i) {
    for (int p = 1; p <= passes && !first_need[i]; ++p)
      if (r.needed[p][i]) first_need[i] = p;
    if (!costly[i] || invariant[i] || !ir::is_float(k.exprs[i].dtype) || !first_need[i]) continue;
    for (int p = first_need[i] + 1; p <= passes; ++p) cand[i] = cand[i] || r.needed[p][i];
  }
  // Keep a candidate when some later pass needs it other than through a kept
  // candidate consumer computed before that pass; the budget goes to the values that
  // hold a transcendental first (a long masked softmax row keeps its exp rather than
  // its masked scores when only one array fits).
  std::vector<bool> keep_it(ne, false);
  for (size_t i = 0; i < ne; ++i) {
    if (!cand[i]) continue;
    bool keep = false;
    for (int p = first_need[i] + 1; p <= passes && !keep; ++p) {
      if (!r.needed[p][i]) continue;
      bool direct = false;  // a store or reduce of pass p, or a non-candidate consumer, reads it
      for (const KStore& s : k.stores) direct = direct || (s.expr == static_cast<int>(i) && level[s.expr] == p - 1);
      for (size_t c = i + 1; c < ne && !direct; ++c) {
        const KExpr& ce = k.exprs[c];
        if (std::find(ce.args.begin(), ce.args.end(), static_cast<int>(i)) == ce.args.end()) continue;
        if (ce.kind == KExpr::Kind::reduce)
          direct = direct || level[c] == p;
        else if (r.needed[p][c])
          direct = direct || !(cand[c] && first_need[c] < p);
      }
      keep = direct;
    }
    keep_it[i] = keep;
  }
  int64_t bytes = 0;
  for (bool want_heavy : {true, false})
    for (size_t i = 0; i < ne; ++i) {
      if (!keep_it[i] || heavy[i] != want_heavy || row < 0) continue;
      const int64_t b = row * static_cast<int64_t>(k.exprs[i].dtype == DType::f64 ? 8 : 4);
      if (bytes + b > kRowScratchBytes) continue;
      bytes += b;
      r.first[i] = first_need[i];
    }
  if (bytes > 0) r.row = row;
  return r;
}

/// Vector width (f32 lanes) for a reduced loop of `trip` iterations in a row program:
/// 16 with AVX-512, 8 with AVX, else 0 (the vectorizer's own choice). Also 0 below 16
/// iterations, which LLVM vectorizes only as if optimizing for size (a hinted loop it
/// then leaves scalar draws a "loop not vectorized" remark).
int row_vector_width(const std::string& feats, int64_t trip) {
  if (trip < 16) return 0;
  if (feats.find("+avx512f") != std::string::npos) return 16;
  if (feats.find("+avx") != std::string::npos) return 8;
  return 0;
}

RowProgramEmitter::RowProgramEmitter(KernelEmitter& e, LoopSchedule& s)
    : e_(e), s_(s), M_(e.module()), B_(e.builder()), k_(e.kernel()), level_(e.levels()) {}

/// Row program (Kernel::is_row_program) for one kept point: pass p = 1..passes loops
/// over the reduced dims, accumulating the level-p reduce expressions and the
/// reduction stores of level p - 1 and writing the point stores of level p - 1; row
/// stores are written once their level is finished (kernel_ir.h, evaluate_reference).
void RowProgramEmitter::emit(const std::vector<int>& red, std::vector<llvm::Value*>& idx) {
  const size_t ne = k_.exprs.size();
  // Row scratch: the values of the expressions row_scratch_plan picks are kept in a
  // stack array indexed by the position in the row during the first pass that computes
  // them and reloaded in later passes (a softmax's exp is computed once, not twice).
  Extent row_len = 1;
  for (int d : red) row_len = row_len * k_.domain[d];
  const bool symbolic_row = !row_len.is_constant();
  const RowScratch scratch = row_scratch_plan(k_, level_, red, symbolic_row ? kSymbolicScratchRow : 0);
  std::vector<llvm::Value*> scratch_buf(ne, nullptr);
  if (!symbolic_row) {
    for (size_t i = 0; i < ne; ++i)
      if (scratch.first[i] > 0) scratch_buf[i] = e_.entry_alloca(e_.reg_type(k_.exprs[i].dtype), i64c(scratch.row));
    emit_passes(red, idx, scratch, scratch_buf, LoopSchedule::Trip::any);
    return;
  }
  // A two-way branch at the row; both arms end at `done`.
  auto branch = [&](llvm::Value* cond, const char* name, const std::function<void()>& yes,
                    const std::function<void()>& no) {
    llvm::BasicBlock* a = llvm::BasicBlock::Create(e_.context(), std::string(name), e_.function());
    llvm::BasicBlock* b = llvm::BasicBlock::Create(e_.context(), std::string(name) + ".else", e_.function());
    llvm::BasicBlock* done = llvm::BasicBlock::Create(e_.context(), std::string(name) + ".end");
    B_.CreateCondBr(cond, a, b);
    B_.SetInsertPoint(a);
    yes();
    B_.CreateBr(done);
    B_.SetInsertPoint(b);
    no();
    B_.CreateBr(done);
    done->insertInto(e_.function());
    B_.SetInsertPoint(done);
  };
  // The specialized versions (BladeDISC-style speculation on the extent, Nimble's
  // residue dispatch): an innermost extent that is a multiple of the vector width (no
  // remainder loop), and one shorter than a vector (one masked vector iteration).
  using Trip = LoopSchedule::Trip;
  const Extent& inner = k_.domain[red.back()];
  const int vw = row_vector_width(e_.features(), std::numeric_limits<int64_t>::max());
  auto with_versions = [&](const RowScratch& s, const std::vector<llvm::Value*>& buf) {
    if (!k_.versions || vw <= 1 || inner.is_constant()) {
      emit_passes(red, idx, s, buf, Trip::any);
      return;
    }
    branch(
        B_.CreateICmpEQ(B_.CreateURem(e_.ext(inner), i64c(vw)), i64c(0)), "row.whole",
        [&] { emit_passes(red, idx, s, buf, Trip::whole_vectors); },
        [&] {
          branch(
              B_.CreateICmpSLT(e_.ext(inner), i64c(vw)), "row.short",
              [&] { emit_passes(red, idx, s, buf, Trip::short_row); },
              [&] { emit_passes(red, idx, s, buf, Trip::any); });
        });
  };
  int64_t elem_bytes = 0;  // scratch bytes per row element
  for (size_t i = 0; i < ne; ++i)
    if (scratch.first[i] > 0) elem_bytes += k_.exprs[i].dtype == DType::f64 ? 8 : 4;
  if (elem_bytes == 0) {
    with_versions(scratch, scratch_buf);
    return;
  }
  // A symbolic row keeps its values in arrays of the run-time row length when they fit
  // kRowScratchBytes (the static rows' rule, checked at launch), else recomputes them.
  llvm::Value* fits = nullptr;
  {
    llvm::IRBuilder<> eb(e_.entry_end());
    llvm::Value* row = e_.ext(row_len);
    fits = eb.CreateICmpSLE(row, eb.getInt64(static_cast<uint64_t>(kRowScratchBytes / elem_bytes)), "row.fits");
    llvm::Value* n = eb.CreateSelect(fits, row, eb.getInt64(1));
    for (size_t i = 0; i < ne; ++i)
      if (scratch.first[i] > 0) scratch_buf[i] = eb.CreateAlloca(e_.reg_type(k_.exprs[i].dtype), n, "row.scratch");
  }
  RowScratch none = scratch;
  none.row = 0;
  std::fill(none.first.begin(), none.first.end(), 0);
  branch(
      fits, "row.kept", [&] { with_versions(scratch, scratch_buf); },
      [&] { emit_passes(red, idx, none, std::vector<llvm::Value*>(ne, nullptr), Trip::any); });
}

void RowProgramEmitter::emit_passes(const std::vector<int>& red, std::vector<llvm::Value*>& idx,
                                    const RowScratch& scratch, const std::vector<llvm::Value*>& scratch_buf,
                                    LoopSchedule::Trip trip) {
  const size_t ne = k_.exprs.size(), ns = k_.stores.size();
  auto varies = [&](const KStore& s) { return k_.varies_along_reduced(s); };
  const int passes = k_.row_passes();
  std::vector<llvm::Value*> known(ne, nullptr);
  auto row_pos = [&] {
    llvm::Value* r = i64c(0);
    for (int d : red) r = B_.CreateNSWAdd(B_.CreateNSWMul(r, e_.ext(k_.domain[d])), idx[d]);
    return r;
  };
  auto row_stores = [&](int lvl) {
    std::vector<llvm::Value*> v;
    for (const KStore& s : k_.stores)
      if (s.reduce == ReduceKind::none && !varies(s) && level_[s.expr] == lvl) {
        if (v.empty()) v = e_.eval(idx, &known, lvl + 1);
        e_.store(s.param, idx, v[s.expr], /*rounded=*/true);
      }
  };
  row_stores(0);
  for (int p = 1; p <= passes; ++p) {
    std::vector<llvm::Value*> acc(ne, nullptr), sacc(ns, nullptr), nan_seen(ne, nullptr);
    std::vector<llvm::Type*> ety(ne, nullptr), sty(ns, nullptr);
    for (size_t i = 0; i < ne; ++i) {
      const KExpr& e = k_.exprs[i];
      if (e.kind != KExpr::Kind::reduce || level_[i] != p) continue;
      ety[i] = e_.acc_type_t(e.reduce, e.dtype, false);
      acc[i] = e_.entry_alloca(ety[i], nullptr);
      B_.CreateStore(e_.reduce_init_t(e.reduce, e.dtype, false), acc[i]);
      if (e.reduce == ReduceKind::max && ir::is_float(e.dtype)) {
        // Float max as maxnum (nnan, nsz: a reduction LLVM vectorizes) plus a separate
        // "saw a NaN" flag, so the result is still NaN when any element is.
        nan_seen[i] = e_.entry_alloca(B_.getInt8Ty(), nullptr);
        B_.CreateStore(B_.getInt8(0), nan_seen[i]);
      }
    }
    for (size_t s = 0; s < ns; ++s) {
      const KStore& st = k_.stores[s];
      if (st.reduce == ReduceKind::none || level_[st.expr] != p - 1) continue;
      sty[s] = e_.acc_type(st);
      sacc[s] = e_.entry_alloca(sty[s], nullptr);
      B_.CreateStore(e_.reduce_init(st), sacc[s]);
    }
    s_.reduced_loops(
        red, 0, idx,
        [&] {
          std::vector<llvm::Value*> preset(ne, nullptr);
          llvm::Value* pos = scratch.row > 0 ? row_pos() : nullptr;
          for (size_t i = 0; i < ne; ++i)
            if (scratch_buf[i] && scratch.first[i] < p && scratch.needed[p][i]) {
              llvm::Type* t = e_.reg_type(k_.exprs[i].dtype);
              preset[i] = B_.CreateLoad(t, B_.CreateInBoundsGEP(t, scratch_buf[i], pos));
            }
          std::vector<llvm::Value*> v = e_.eval(idx, &known, p, &preset);
          for (size_t i = 0; i < ne; ++i)
            if (scratch_buf[i] && scratch.first[i] == p) {
              llvm::Type* t = e_.reg_type(k_.exprs[i].dtype);
              B_.CreateStore(v[i], B_.CreateInBoundsGEP(t, scratch_buf[i], pos));
            }
          for (size_t i = 0; i < ne; ++i)
            if (acc[i]) {
              const KExpr& e = k_.exprs[i];
              llvm::Value* x = v[e.args[0]];
              if (nan_seen[i]) {
                llvm::FastMathFlags fmf;
                fmf.setNoNaNs();
                fmf.setNoSignedZeros();
                llvm::Function* mx = llvm::Intrinsic::getDeclaration(&M_, llvm::Intrinsic::maxnum, {ety[i]});
                llvm::CallInst* m = B_.CreateCall(mx, {B_.CreateLoad(ety[i], acc[i]), x});
                m->setFastMathFlags(fmf);
                B_.CreateStore(m, acc[i]);
                llvm::Value* isn = B_.CreateZExt(B_.CreateFCmpUNO(x, x), B_.getInt8Ty());
                B_.CreateStore(B_.CreateOr(B_.CreateLoad(B_.getInt8Ty(), nan_seen[i]), isn), nan_seen[i]);
                continue;
              }
              B_.CreateStore(e_.reduce_step_t(e.reduce, e.dtype, B_.CreateLoad(ety[i], acc[i]), x, true), acc[i]);
            }
          for (size_t s = 0; s < ns; ++s) {
            const KStore& st = k_.stores[s];
            if (level_[st.expr] != p - 1) continue;
            if (sacc[s])
              B_.CreateStore(e_.reduce_step(st, B_.CreateLoad(sty[s], sacc[s]), v[st.expr], true), sacc[s]);
            else if (st.reduce == ReduceKind::none && varies(st))
              e_.store(st.param, idx, v[st.expr], /*rounded=*/true);
          }
        },
        // A symbolic row: the vector width of a long one (remainders run scalar).
        row_vector_width(e_.features(), static_extent(k_.domain[red.back()]) < 0
                                            ? std::numeric_limits<int64_t>::max()
                                            : static_extent(k_.domain[red.back()])),
        trip);
    for (size_t i = 0; i < ne; ++i)
      if (acc[i]) {
        const KExpr& e = k_.exprs[i];
        llvm::Value* r = B_.CreateLoad(ety[i], acc[i]);
        if (nan_seen[i])
          r = B_.CreateSelect(B_.CreateICmpNE(B_.CreateLoad(B_.getInt8Ty(), nan_seen[i]), B_.getInt8(0)),
                              e_.qnan(ety[i]), r);
        llvm::Type* rt = e_.reg_type(e.dtype);
        if (r->getType() != rt) r = B_.CreateFPTrunc(r, rt);
        known[i] = ir::is_float(e.dtype) ? e_.round_to(e.dtype, r) : r;
      }
    for (size_t s = 0; s < ns; ++s)
      if (sacc[s]) e_.store(k_.stores[s].param, idx, e_.acc_result(k_.stores[s], B_.CreateLoad(sty[s], sacc[s])));
    row_stores(p);
  }
}

}  // namespace kiln::codegen::cpu
