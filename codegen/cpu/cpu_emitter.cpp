// KernelEmitter (cpu_emitter.h): the function of one kernel, its types, memory
// accesses, expressions and reduction steps; the loop nest comes from LoopSchedule.
#include "codegen/cpu/cpu_emitter.h"

#include <llvm/IR/MDBuilder.h>

#include <algorithm>

#include "codegen/cpu/cpu_schedule.h"
#include "llvm/IR/Intrinsics.h"

namespace kiln::codegen::cpu {

using ir::DType;
using ir::ScalarOp;

namespace {

bool is_unsigned(DType t) { return t == DType::u8 || t == DType::boolean; }

}  // namespace

KernelEmitter::KernelEmitter(llvm::Module& m, const Kernel& k, const std::string& cpu, const std::string& feats,
                             std::string fn_name)
    : C_(m.getContext()),
      M_(m),
      k_(k),
      B_(m.getContext()),
      math_(m, B_),
      cpu_(cpu),
      feats_(feats),
      fn_name_(fn_name.empty() ? k.name : std::move(fn_name)) {}

CpuKernel KernelEmitter::emit() {
  i64_ = B_.getInt64Ty();
  auto* ptr = llvm::PointerType::getUnqual(C_);
  auto* fty = llvm::FunctionType::get(B_.getVoidTy(), {ptr, i64_, i64_}, false);
  F_ = llvm::Function::Create(fty, llvm::Function::ExternalLinkage, fn_name_, M_);
  F_->addFnAttr(llvm::Attribute::NoUnwind);
  if (!cpu_.empty()) F_->addFnAttr("target-cpu", cpu_);
  if (!feats_.empty()) F_->addFnAttr("target-features", feats_);
  // LLVM tunes Intel's AVX-512 server cores to prefer 256-bit vectors (the clock
  // penalty of early AVX-512 parts); the generated kernels are compute-bound
  // polynomial loops that run faster with zmm (docs/performance.md).
  if (feats_.find("+avx512f") != std::string::npos) F_->addFnAttr("prefer-vector-width", "512");
  auto arg = F_->arg_begin();
  llvm::Value* buffers = &*arg++;
  begin_ = &*arg++;
  end_ = &*arg;
  buffers->setName("buffers");
  buffers_ = buffers;
  begin_->setName("begin");
  end_->setName("end");
  entry_ = llvm::BasicBlock::Create(C_, "entry", F_);
  B_.SetInsertPoint(entry_);
  for (size_t p = 0; p < k_.params.size(); ++p) {
    llvm::Value* slot = B_.CreateConstInBoundsGEP1_64(ptr, buffers, p);
    base_.push_back(B_.CreateLoad(ptr, slot, "p" + std::to_string(p)));
  }
  // An output written in place of an input goes through the input's pointer: one
  // buffer for LLVM, so the loop vectorizes without runtime alias checks.
  for (size_t p = 0; p < k_.params.size(); ++p)
    if (k_.params[p].in_place_of >= 0) base_[p] = base_[static_cast<size_t>(k_.params[p].in_place_of)];
  {
    llvm::MDBuilder mdb(C_);
    llvm::MDNode* domain = mdb.createAnonymousAliasScopeDomain("kiln.buffers");
    const size_t np = k_.params.size();
    std::vector<llvm::MDNode*> own(np, nullptr);
    auto root = [&](size_t p) {
      return k_.params[p].in_place_of >= 0 ? static_cast<size_t>(k_.params[p].in_place_of) : p;
    };
    for (size_t p = 0; p < np; ++p)
      if (root(p) == p) own[p] = mdb.createAnonymousAliasScope(domain, "p" + std::to_string(p));
    scope_.assign(np, nullptr);
    noalias_.assign(np, nullptr);
    for (size_t p = 0; p < np; ++p) {
      std::vector<llvm::Metadata*> others;
      for (size_t q = 0; q < np; ++q)
        if (own[q] && q != root(p)) others.push_back(own[q]);
      scope_[p] = llvm::MDNode::get(C_, {own[root(p)]});
      noalias_[p] = llvm::MDNode::get(C_, others);
    }
  }
  if (k_.is_symbolic()) {
    // The symbol values (after the buffers), loaded once; ext() computes the extents and
    // strides from them at the end of the entry block, which branches to the loops.
    llvm::Value* vals = B_.CreateLoad(ptr, B_.CreateConstInBoundsGEP1_64(ptr, buffers, k_.params.size()), "symbols");
    const std::vector<std::string> names = k_.symbols();
    for (size_t i = 0; i < names.size(); ++i)
      sym_[names[i]] = B_.CreateLoad(i64_, B_.CreateConstInBoundsGEP1_64(i64_, vals, i), "sym." + names[i]);
    sym_vals_ = vals;
    llvm::BasicBlock* start = llvm::BasicBlock::Create(C_, "start", F_);
    B_.CreateBr(start);
    B_.SetInsertPoint(start);
  }
  CpuKernel ck;
  ck.name = k_.name;
  level_ = k_.expr_levels();
  LoopSchedule(*this).emit(ck);
  B_.CreateRetVoid();
  // Domain points per parallel index: the product of the other extents (an expression
  // in a symbolic kernel, evaluated at launch).
  Extent work = 1;
  for (size_t d = 0; d < k_.domain.size(); ++d)
    if (static_cast<int>(d) != ck.parallel_dim) work = work * k_.domain[d];
  // A symbolic split reduction: the whole domain (the executor divides it by the
  // launch's partitions).
  ck.work_per_index = ck.split_parts > 0
                          ? Extent(std::max<int64_t>(1, static_extent(k_.domain_size()) / ck.split_parts))
                      : ck.split_parts < 0 ? k_.domain_size()
                                           : work;
  ck.symbols = k_.symbols();
  return ck;
}

llvm::Type* KernelEmitter::reg_type(DType t) {
  switch (t) {
    case DType::f64:
      return B_.getDoubleTy();
    case DType::f32:
    case DType::bf16:
    case DType::f16:
      return B_.getFloatTy();
    case DType::i64:
      return i64_;
    case DType::i32:
      return B_.getInt32Ty();
    case DType::boolean:
      return B_.getInt1Ty();
    default:
      return B_.getInt8Ty();
  }
}

llvm::Type* KernelEmitter::mem_type(DType t) {
  switch (t) {
    case DType::bf16:
    case DType::f16:
      return B_.getInt16Ty();
    case DType::boolean:
      return B_.getInt8Ty();
    default:
      return reg_type(t);
  }
}

llvm::Value* KernelEmitter::constant(DType t, double v) {
  switch (t) {
    case DType::f64:
      return llvm::ConstantFP::get(B_.getDoubleTy(), v);
    case DType::f32:
      return llvm::ConstantFP::get(B_.getFloatTy(), static_cast<float>(v));
    case DType::bf16:
      return llvm::ConstantFP::get(B_.getFloatTy(), ir::bf16_to_f32(ir::f32_to_bf16(static_cast<float>(v))));
    case DType::f16:
      return llvm::ConstantFP::get(B_.getFloatTy(), ir::f16_to_f32(ir::f32_to_f16(static_cast<float>(v))));
    case DType::boolean:
      return B_.getInt1(v != 0);
    default:
      return llvm::ConstantInt::get(reg_type(t), static_cast<uint64_t>(static_cast<int64_t>(v)), true);
  }
}

/// f32 -> bits of the bf16-rounded value in the upper half of an i32 (RNE, NaN quiet).
llvm::Value* KernelEmitter::bf16_bits(llvm::Value* f) {
  auto* i32 = B_.getInt32Ty();
  llvm::Value* u = B_.CreateBitCast(f, i32);
  llvm::Value* isnan = B_.CreateICmpUGT(B_.CreateAnd(u, 0x7fffffffu), llvm::ConstantInt::get(i32, 0x7f800000u));
  llvm::Value* lsb = B_.CreateAnd(B_.CreateLShr(u, 16), 1u);
  llvm::Value* r = B_.CreateAnd(B_.CreateAdd(B_.CreateAdd(u, llvm::ConstantInt::get(i32, 0x7fffu)), lsb),
                                llvm::ConstantInt::get(i32, 0xffff0000u));
  llvm::Value* q =
      B_.CreateAnd(B_.CreateOr(u, llvm::ConstantInt::get(i32, 0x00400000u)), llvm::ConstantInt::get(i32, 0xffff0000u));
  return B_.CreateSelect(isnan, q, r);
}

/// Rounds an f32 register value to dtype t's precision (no-op for f32/f64).
llvm::Value* KernelEmitter::round_to(DType t, llvm::Value* f) {
  if (t == DType::bf16) return B_.CreateBitCast(bf16_bits(f), B_.getFloatTy());
  if (t == DType::f16) return B_.CreateFPExt(B_.CreateFPTrunc(f, B_.getHalfTy()), B_.getFloatTy());
  return f;
}

llvm::Value* KernelEmitter::address(int p, const std::vector<llvm::Value*>& idx) {
  const KernelParam& kp = k_.params[p];
  llvm::Value* off = i64c(kp.offset);
  const size_t fd = static_cast<size_t>(flat_d_);
  const bool flat = flat_d_ >= 0 && fd + 1 < idx.size() && idx[fd] && idx[fd + 1] &&
                    kp.strides[fd] == kp.strides[fd + 1] * flat_inner_;
  for (size_t d = 0; d < idx.size(); ++d) {
    if (flat && (d == fd || d == fd + 1)) {
      if (d == fd && kp.strides[fd + 1] != 0)  // j * stride: consecutive in j
        off =
            B_.CreateNSWAdd(off, kp.strides[fd + 1] == 1 ? flat_j_ : B_.CreateNSWMul(flat_j_, ext(kp.strides[fd + 1])));
      continue;
    }
    if (idx[d] && kp.strides[d] != 0)
      off = B_.CreateNSWAdd(off, kp.strides[d] == 1 ? idx[d] : B_.CreateNSWMul(idx[d], ext(kp.strides[d])));
  }
  return B_.CreateInBoundsGEP(mem_type(kp.dtype), base_[p], off);
}

llvm::Value* KernelEmitter::load(int p, const std::vector<llvm::Value*>& idx) {
  const DType t = k_.params[p].dtype;
  llvm::LoadInst* ld = B_.CreateLoad(mem_type(t), address(p, idx));
  ld->setMetadata(llvm::LLVMContext::MD_alias_scope, scope_[static_cast<size_t>(p)]);
  ld->setMetadata(llvm::LLVMContext::MD_noalias, noalias_[static_cast<size_t>(p)]);
  llvm::Value* v = ld;
  switch (t) {
    case DType::bf16:
      return B_.CreateBitCast(B_.CreateShl(B_.CreateZExt(v, B_.getInt32Ty()), 16), B_.getFloatTy());
    case DType::f16:
      return B_.CreateFPExt(B_.CreateBitCast(v, B_.getHalfTy()), B_.getFloatTy());
    case DType::boolean:
      return B_.CreateICmpNE(v, B_.getInt8(0));
    default:
      return v;
  }
}

/// A load of a guarded param (KernelParam::guard_lo): inside the guard box the element,
/// else `fallback`; the memory is touched only inside (a branch the loop vectorizer
/// if-converts into masked loads), so the address may lie outside the buffer elsewhere.
llvm::Value* KernelEmitter::guarded_load(int p, const std::vector<llvm::Value*>& idx, llvm::Value* fallback) {
  const KernelParam& q = k_.params[p];
  llvm::Value* in = nullptr;
  for (size_t d = 0; d < idx.size() && d < q.guard_lo.size(); ++d) {
    if (q.guard_lo[d] == 0 && k_.domain[d] == q.guard_hi[d]) continue;
    llvm::Value* c = B_.CreateICmpSLT(idx[d], i64c(q.guard_hi[d]));
    if (q.guard_lo[d] > 0) c = B_.CreateAnd(B_.CreateICmpSGE(idx[d], i64c(q.guard_lo[d])), c);
    in = in ? B_.CreateAnd(in, c) : c;
  }
  if (!in) return load(p, idx);
  llvm::BasicBlock* pre = B_.GetInsertBlock();
  llvm::BasicBlock* then = llvm::BasicBlock::Create(C_, "guard.in", F_);
  llvm::BasicBlock* merge = llvm::BasicBlock::Create(C_, "guard.end");
  B_.CreateCondBr(in, then, merge);
  B_.SetInsertPoint(then);
  llvm::Value* v = load(p, idx);
  llvm::BasicBlock* then_end = B_.GetInsertBlock();
  B_.CreateBr(merge);
  merge->insertInto(F_);
  B_.SetInsertPoint(merge);
  llvm::PHINode* phi = B_.CreatePHI(v->getType(), 2, "guarded");
  phi->addIncoming(v, then_end);
  phi->addIncoming(fallback, pre);
  return phi;
}

void KernelEmitter::store(int p, const std::vector<llvm::Value*>& idx, llvm::Value* v, bool rounded) {
  const DType t = k_.params[p].dtype;
  switch (t) {
    case DType::bf16:
      // A value already rounded to bf16 (its low 16 bits zero) is stored by its high half.
      v = B_.CreateTrunc(B_.CreateLShr(rounded ? B_.CreateBitCast(v, B_.getInt32Ty()) : bf16_bits(v), 16),
                         B_.getInt16Ty());
      break;
    case DType::f16:
      v = B_.CreateBitCast(B_.CreateFPTrunc(v, B_.getHalfTy()), B_.getInt16Ty());
      break;
    case DType::boolean:
      v = B_.CreateZExt(v, B_.getInt8Ty());
      break;
    default:
      break;
  }
  llvm::StoreInst* st = B_.CreateStore(v, address(p, idx));
  st->setMetadata(llvm::LLVMContext::MD_alias_scope, scope_[static_cast<size_t>(p)]);
  st->setMetadata(llvm::LLVMContext::MD_noalias, noalias_[static_cast<size_t>(p)]);
}

llvm::Value* KernelEmitter::float_op(ScalarOp op, DType t, llvm::Value* x, llvm::Value* y) {
  llvm::Value* r = nullptr;
  switch (op) {
    case ScalarOp::add:
      r = B_.CreateFAdd(x, y);
      break;
    case ScalarOp::sub:
      r = B_.CreateFSub(x, y);
      break;
    case ScalarOp::mul:
      r = B_.CreateFMul(x, y);
      break;
    case ScalarOp::div:
      r = B_.CreateFDiv(x, y);
      break;
    case ScalarOp::pow:
      r = intrinsic(llvm::Intrinsic::pow, {x, y});
      break;
    // max, min, neg and abs of values rounded to t's precision (every bf16/f16 register
    // value is) are exactly representable in t (a NaN result is the canonical quiet NaN,
    // also exact): no rounding after them.
    case ScalarOp::max:
    case ScalarOp::min: {
      llvm::Value* nan = B_.CreateFCmpUNO(x, y);
      llvm::Value* take_y = op == ScalarOp::max ? B_.CreateFCmpOLT(x, y) : B_.CreateFCmpOLT(y, x);
      return B_.CreateSelect(nan, qnan(x->getType()), B_.CreateSelect(take_y, y, x));
    }
    case ScalarOp::neg:
      return B_.CreateFNeg(x);
    case ScalarOp::abs:
      return B_.CreateSelect(B_.CreateFCmpOLT(x, llvm::ConstantFP::get(x->getType(), 0.0)), B_.CreateFNeg(x), x);
    case ScalarOp::exp:
      r = x->getType()->isFloatTy() ? math_.expf_poly(x) : math_.exp_poly_f64(x);
      break;
    case ScalarOp::log:
      r = intrinsic(llvm::Intrinsic::log, {x});
      break;
    case ScalarOp::sqrt:
      r = intrinsic(llvm::Intrinsic::sqrt, {x});
      break;
    case ScalarOp::sin:
      r = intrinsic(llvm::Intrinsic::sin, {x});
      break;
    case ScalarOp::cos:
      r = intrinsic(llvm::Intrinsic::cos, {x});
      break;
    case ScalarOp::floor:
      r = intrinsic(llvm::Intrinsic::floor, {x});
      break;
    case ScalarOp::ceil:
      r = intrinsic(llvm::Intrinsic::ceil, {x});
      break;
    case ScalarOp::round:
      r = intrinsic(llvm::Intrinsic::roundeven, {x});
      break;
    case ScalarOp::fmod:
      r = B_.CreateFRem(x, y);
      break;  // LLVM's frem is C fmod
    case ScalarOp::erf:
      r = x->getType()->isFloatTy() ? math_.erff_poly(x) : math_.libm("erff", "erf", x);
      break;
    case ScalarOp::tanh:
      r = x->getType()->isFloatTy() ? math_.tanhf_poly(x) : math_.libm("tanhf", "tanh", x);
      break;
    default:
      r = x;
      break;
  }
  return round_to(t, r);
}

llvm::Value* KernelEmitter::int_op(ScalarOp op, DType t, llvm::Value* x, llvm::Value* y) {
  const bool u = is_unsigned(t);
  llvm::Type* ty = x->getType();
  llvm::Value* zero = llvm::ConstantInt::get(ty, 0);
  switch (op) {
    case ScalarOp::add:
      return B_.CreateAdd(x, y);
    case ScalarOp::sub:
      return B_.CreateSub(x, y);
    case ScalarOp::mul:
      return B_.CreateMul(x, y);
    case ScalarOp::div: {
      llvm::Value* yz = B_.CreateICmpEQ(y, zero);
      if (u) {
        llvm::Value* q = B_.CreateUDiv(x, B_.CreateSelect(yz, llvm::ConstantInt::get(ty, 1), y));
        return B_.CreateSelect(yz, zero, q);
      }
      llvm::Value* ym1 = B_.CreateICmpEQ(y, llvm::ConstantInt::getSigned(ty, -1));
      llvm::Value* safe = B_.CreateSelect(B_.CreateOr(yz, ym1), llvm::ConstantInt::get(ty, 1), y);
      llvm::Value* q = B_.CreateSDiv(x, safe);
      return B_.CreateSelect(yz, zero, B_.CreateSelect(ym1, B_.CreateSub(zero, x), q));
    }
    case ScalarOp::pow: {
      auto* fty = llvm::FunctionType::get(i64_, {i64_, i64_}, false);
      llvm::FunctionCallee f = M_.getOrInsertFunction("kiln_cpu_ipow", fty);
      if (auto* fn = llvm::dyn_cast<llvm::Function>(f.getCallee())) {
        fn->setDoesNotAccessMemory();
        fn->setDoesNotThrow();
        fn->setWillReturn();
      }
      llvm::Value* r = B_.CreateCall(f, {B_.CreateIntCast(x, i64_, !u), B_.CreateIntCast(y, i64_, !u)});
      return B_.CreateTrunc(r, ty);
    }
    case ScalarOp::max:
      return B_.CreateSelect(u ? B_.CreateICmpUGT(y, x) : B_.CreateICmpSGT(y, x), y, x);
    case ScalarOp::min:
      return B_.CreateSelect(u ? B_.CreateICmpULT(y, x) : B_.CreateICmpSLT(y, x), y, x);
    case ScalarOp::neg:
      return B_.CreateSub(zero, x);
    case ScalarOp::fmod: {  // truncated remainder; x % 0 = 0 and x % -1 = 0 (no trap)
      llvm::Value* yz = B_.CreateICmpEQ(y, zero);
      llvm::Value* bad = u ? yz : B_.CreateOr(yz, B_.CreateICmpEQ(y, llvm::ConstantInt::getSigned(ty, -1)));
      llvm::Value* safe = B_.CreateSelect(bad, llvm::ConstantInt::get(ty, 1), y);
      return B_.CreateSelect(bad, zero, u ? B_.CreateURem(x, safe) : B_.CreateSRem(x, safe));
    }
    case ScalarOp::abs:
      if (u) return x;
      return B_.CreateSelect(B_.CreateICmpSLT(x, zero), B_.CreateSub(zero, x), x);
    default:
      return x;
  }
}

llvm::Value* KernelEmitter::compare(ScalarOp op, DType t, llvm::Value* x, llvm::Value* y) {
  if (ir::is_float(t)) {
    switch (op) {
      case ScalarOp::lt:
        return B_.CreateFCmpOLT(x, y);
      case ScalarOp::le:
        return B_.CreateFCmpOLE(x, y);
      case ScalarOp::gt:
        return B_.CreateFCmpOGT(x, y);
      case ScalarOp::ge:
        return B_.CreateFCmpOGE(x, y);
      default:
        return B_.CreateFCmpOEQ(x, y);
    }
  }
  const bool u = is_unsigned(t);
  switch (op) {
    case ScalarOp::lt:
      return u ? B_.CreateICmpULT(x, y) : B_.CreateICmpSLT(x, y);
    case ScalarOp::le:
      return u ? B_.CreateICmpULE(x, y) : B_.CreateICmpSLE(x, y);
    case ScalarOp::gt:
      return u ? B_.CreateICmpUGT(x, y) : B_.CreateICmpSGT(x, y);
    case ScalarOp::ge:
      return u ? B_.CreateICmpUGE(x, y) : B_.CreateICmpSGE(x, y);
    default:
      return B_.CreateICmpEQ(x, y);
  }
}

/// ONNX Cast from `from` to `to` (as runtime/kernels/util.h convert()).
llvm::Value* KernelEmitter::cast(DType from, DType to, llvm::Value* x) {
  if (from == to) return x;
  llvm::Type* rt = reg_type(to);
  const bool ff = ir::is_float(from);
  if (to == DType::boolean)
    return ff ? B_.CreateFCmpUNE(x, llvm::ConstantFP::get(x->getType(), 0.0))
              : B_.CreateICmpNE(x, llvm::ConstantInt::get(x->getType(), 0));
  if (ir::is_float(to)) {
    llvm::Value* r;
    if (ff)
      r = B_.CreateFPCast(x, rt);
    else
      r = is_unsigned(from) ? B_.CreateUIToFP(x, rt) : B_.CreateSIToFP(x, rt);
    return round_to(to, r);
  }
  if (ff) {
    const auto id = is_unsigned(to) ? llvm::Intrinsic::fptoui_sat : llvm::Intrinsic::fptosi_sat;
    llvm::Function* f = llvm::Intrinsic::getDeclaration(&M_, id, {rt, x->getType()});
    return B_.CreateCall(f, {x});
  }
  return B_.CreateIntCast(x, rt, !is_unsigned(from));
}

std::vector<llvm::Value*> KernelEmitter::eval(const std::vector<llvm::Value*>& idx) { return eval(idx, nullptr, 1); }

/// Expressions of level < max_level at `idx` (null for the others); reduce
/// expressions take their finished values from `known`; a non-null `preset[i]` is
/// used as expression i's value instead of computing it (a row-scratch reload).
std::vector<llvm::Value*> KernelEmitter::eval(const std::vector<llvm::Value*>& idx,
                                              const std::vector<llvm::Value*>* known, int max_level,
                                              const std::vector<llvm::Value*>* preset) {
  std::vector<llvm::Value*> v(k_.exprs.size(), nullptr);
  for (size_t i = 0; i < k_.exprs.size(); ++i) {
    const KExpr& e = k_.exprs[i];
    if (level_[i] >= max_level) continue;
    if (preset && (*preset)[i]) {
      v[i] = (*preset)[i];
      continue;
    }
    if (e.kind == KExpr::Kind::reduce) {
      v[i] = known ? (*known)[i] : nullptr;
      continue;
    }
    if (e.kind == KExpr::Kind::load) {
      v[i] = k_.params[e.param].guarded()
                 ? guarded_load(e.param, idx, e.args.empty() ? constant(e.dtype, 0) : v[e.args[0]])
                 : load(e.param, idx);
      continue;
    }
    if (e.kind == KExpr::Kind::constant) {
      v[i] = constant(e.dtype, e.value);
      continue;
    }
    auto a = [&](int j) { return v[e.args[j]]; };
    auto adt = [&](int j) { return k_.exprs[e.args[j]].dtype; };
    switch (e.op) {
      case ScalarOp::lt:
      case ScalarOp::le:
      case ScalarOp::gt:
      case ScalarOp::ge:
      case ScalarOp::eq:
        v[i] = compare(e.op, adt(0), a(0), a(1));
        break;
      case ScalarOp::logical_and:
        v[i] = B_.CreateAnd(a(0), a(1));
        break;
      case ScalarOp::logical_or:
        v[i] = B_.CreateOr(a(0), a(1));
        break;
      case ScalarOp::logical_xor:
        v[i] = B_.CreateXor(a(0), a(1));
        break;
      case ScalarOp::logical_not:
        v[i] = B_.CreateNot(a(0));
        break;
      case ScalarOp::select:
        v[i] = B_.CreateSelect(a(0), a(1), a(2));
        break;
      case ScalarOp::cast:
        v[i] = cast(adt(0), e.dtype, a(0));
        break;
      case ScalarOp::fma:
        v[i] = round_to(e.dtype, intrinsic(llvm::Intrinsic::fma, {a(0), a(1), a(2)}));
        break;
      default: {
        llvm::Value* y = e.args.size() > 1 ? a(1) : nullptr;
        v[i] = ir::is_float(e.dtype) ? float_op(e.op, e.dtype, a(0), y) : int_op(e.op, e.dtype, a(0), y);
      }
    }
  }
  return v;
}

/// Accumulator type of a reduction store: float sums accumulate in double, as the
/// eager ReduceSum does (same order, so the sums are bit-identical); else the register
/// type. Reduce expressions (row rules) accumulate in their register type instead:
/// f32 sums in f32 over vector lanes, f64 in double (kernel_ir.h, KExpr).
llvm::Type* KernelEmitter::acc_type_t(ReduceKind r, DType t, bool is_store) {
  llvm::Type* ty = reg_type(t);
  return (is_store && r == ReduceKind::sum && ty->isFloatingPointTy()) ? B_.getDoubleTy() : ty;
}

llvm::Type* KernelEmitter::acc_type(const KStore& s) { return acc_type_t(s.reduce, k_.params[s.param].dtype); }

/// An accumulator converted back to the register type of the store's output.
llvm::Value* KernelEmitter::acc_result(const KStore& s, llvm::Value* acc) {
  llvm::Type* ty = reg_type(k_.params[s.param].dtype);
  return acc->getType() == ty ? acc : B_.CreateFPTrunc(acc, ty);
}

llvm::Value* KernelEmitter::reduce_init_t(ReduceKind r, DType t, bool is_store) {
  llvm::Type* ty = acc_type_t(r, t, is_store);
  if (r == ReduceKind::sum)
    return ty->isFloatingPointTy() ? llvm::ConstantFP::get(ty, 0.0) : llvm::ConstantInt::get(ty, 0);
  if (ty->isFloatingPointTy()) return llvm::ConstantFP::getInfinity(ty, true);
  if (is_unsigned(t)) return llvm::ConstantInt::get(ty, 0);
  return llvm::ConstantInt::get(ty, llvm::APInt::getSignedMinValue(ty->getIntegerBitWidth()));
}

llvm::Value* KernelEmitter::reduce_init(const KStore& s) { return reduce_init_t(s.reduce, k_.params[s.param].dtype); }

/// acc (+ or max) v; `reassoc` marks a float sum reassociable (row mode, so it vectorizes).
llvm::Value* KernelEmitter::reduce_step_t(ReduceKind r, DType t, llvm::Value* acc, llvm::Value* v, bool reassoc) {
  if (r == ReduceKind::sum) {
    if (!acc->getType()->isFloatingPointTy()) return B_.CreateAdd(acc, v);
    if (v->getType() != acc->getType()) v = B_.CreateFPExt(v, acc->getType());
    llvm::Value* res = B_.CreateFAdd(acc, v);
    if (reassoc) {
      llvm::FastMathFlags fmf;
      fmf.setAllowReassoc();
      llvm::cast<llvm::Instruction>(res)->setFastMathFlags(fmf);
    }
    return res;
  }
  if (acc->getType()->isFloatingPointTy()) {
    llvm::Value* nan = B_.CreateFCmpUNO(acc, v);
    llvm::Value* gt = B_.CreateFCmpOGT(v, acc);
    return B_.CreateSelect(nan, qnan(acc->getType()), B_.CreateSelect(gt, v, acc));
  }
  llvm::Value* gt = is_unsigned(t) ? B_.CreateICmpUGT(v, acc) : B_.CreateICmpSGT(v, acc);
  return B_.CreateSelect(gt, v, acc);
}

llvm::Value* KernelEmitter::reduce_step(const KStore& s, llvm::Value* acc, llvm::Value* v, bool reassoc) {
  return reduce_step_t(s.reduce, k_.params[s.param].dtype, acc, v, reassoc);
}

/// for (i = lo; i < hi; ++i) body(i); the builder ends at the loop exit.
void KernelEmitter::for_range(llvm::Value* lo, llvm::Value* hi, const std::function<void(llvm::Value*)>& body,
                              int vector_width, bool predicated) {
  llvm::BasicBlock* pre = B_.GetInsertBlock();
  llvm::BasicBlock* loop = llvm::BasicBlock::Create(C_, "loop", F_);
  llvm::BasicBlock* exit = llvm::BasicBlock::Create(C_, "loop.end");
  B_.CreateCondBr(B_.CreateICmpSLT(lo, hi), loop, exit);
  B_.SetInsertPoint(loop);
  llvm::PHINode* i = B_.CreatePHI(i64_, 2, "i");
  i->addIncoming(lo, pre);
  body(i);
  llvm::Value* next = B_.CreateNSWAdd(i, i64c(1));
  i->addIncoming(next, B_.GetInsertBlock());
  llvm::BranchInst* latch = B_.CreateCondBr(B_.CreateICmpSLT(next, hi), loop, exit);
  if (vector_width > 0) {
    // llvm.loop.vectorize.width (and no interleaving): the loop vectorizer's cost model
    // otherwise narrows loops that mix f32 and f64 to the f64 width and interleaves
    // them, which spills the exp polynomial's constants.
    llvm::Metadata* width[] = {llvm::MDString::get(C_, "llvm.loop.vectorize.width"),
                               llvm::ConstantAsMetadata::get(B_.getInt32(vector_width))};
    llvm::Metadata* inter[] = {llvm::MDString::get(C_, "llvm.loop.interleave.count"),
                               llvm::ConstantAsMetadata::get(B_.getInt32(1))};
    llvm::Metadata* pred[] = {llvm::MDString::get(C_, "llvm.loop.vectorize.predicate.enable"),
                              llvm::ConstantAsMetadata::get(B_.getInt1(true))};
    std::vector<llvm::Metadata*> ops = {nullptr, llvm::MDNode::get(C_, width), llvm::MDNode::get(C_, inter)};
    if (predicated) ops.push_back(llvm::MDNode::get(C_, pred));
    llvm::MDNode* md = llvm::MDNode::getDistinct(C_, ops);
    md->replaceOperandWith(0, md);
    latch->setMetadata(llvm::LLVMContext::MD_loop, md);
  }
  exit->insertInto(F_);
  B_.SetInsertPoint(exit);
}

/// if (begin < end) body(): the schedule of kernels without a parallel dim.
void KernelEmitter::guard_once(const std::function<void()>& body) {
  llvm::BasicBlock* then = llvm::BasicBlock::Create(C_, "once", F_);
  llvm::BasicBlock* done = llvm::BasicBlock::Create(C_, "once.end");
  B_.CreateCondBr(B_.CreateICmpSLT(begin_, end_), then, done);
  B_.SetInsertPoint(then);
  body();
  B_.CreateBr(done);
  done->insertInto(F_);
  B_.SetInsertPoint(done);
}

llvm::Value* KernelEmitter::ext(const Extent& e) {
  if (e.is_constant()) return i64c(e.constant_value());
  const std::string key = e.to_string();
  if (auto it = ext_.find(key); it != ext_.end()) return it->second;
  // sum of coeff * product of symbols, in the entry block (before its branch).
  llvm::IRBuilder<> eb(entry_->getTerminator());
  llvm::Value* sum = nullptr;
  for (const ir::SymExpr::Term& t : e.terms()) {
    llvm::Value* term = t.coeff == 1 && !t.symbols.empty() ? nullptr : eb.getInt64(static_cast<uint64_t>(t.coeff));
    for (const std::string& s : t.symbols) {
      llvm::Value* v = sym_.at(s);
      term = term ? eb.CreateNSWMul(term, v) : v;
    }
    sum = sum ? eb.CreateNSWAdd(sum, term) : term;
  }
  if (!sum) sum = eb.getInt64(0);
  ext_[key] = sum;
  return sum;
}

llvm::Value* KernelEmitter::launch_value() {
  if (!launch_value_ && sym_vals_) {
    llvm::IRBuilder<> eb(entry_->getTerminator());
    launch_value_ = eb.CreateLoad(i64_, eb.CreateConstInBoundsGEP1_64(i64_, sym_vals_, k_.symbols().size()), "launch");
  }
  return launch_value_;
}

llvm::Value* KernelEmitter::scratch() {
  auto* ptr = llvm::PointerType::getUnqual(C_);
  const uint64_t at = k_.params.size() + (k_.is_symbolic() ? 1 : 0);
  return B_.CreateLoad(ptr, B_.CreateConstInBoundsGEP1_64(ptr, buffers_, at), "scratch");
}

llvm::Value* KernelEmitter::entry_alloca(llvm::Type* t, llvm::Value* n) {
  llvm::IRBuilder<> eb(entry_, entry_->begin());
  return eb.CreateAlloca(t, n);
}

}  // namespace kiln::codegen::cpu
