// CPU code generation: kernel IR -> LLVM IR (llvm-16) -> O3 -> an ELF object for the host
// (PIC, host CPU and features) -> ORC LLJIT (load_cpu_object) or the system linker (`kiln compile`).
//
// Numerics (must match the eager kernels, runtime/kernels/elementwise.cpp and reduction.cpp):
//  * f32 in float, f64 in double, integers in their own width (u8 unsigned), bool as i1
//    in registers and one byte 0/1 in memory.
//  * bf16/f16 values live in registers as f32 already rounded to the storage precision:
//    loads widen, every op whose dtype is bf16/f16 rounds its f32 result (bf16 by bit ops,
//    RNE with NaN kept quiet exactly as ir::f32_to_bf16; f16 through fptrunc/fpext half),
//    stores narrow.
//  * No fast-math flags on pointwise code (bit-equal to the eager f32 kernels); row sums
//    carry `reassoc` on their accumulating fadd so that they vectorize.
//  * max/min: NaN if either operand is NaN, else std::max/std::min; float->int casts
//    truncate toward zero, saturate, NaN -> 0 (llvm.fpto[su]i.sat = ONNX Cast as eager);
//    integer div truncates, x/0 = 0, x/-1 = -x; integer pow by squaring (kiln_cpu_ipow).
//  * Transcendentals: llvm.log/sin/cos/pow intrinsics (lowered to libm logf, ...) and
//    libm erf/tanh for f64, resolved from the process by the JIT; f32 exp, erf and tanh
//    are inline polynomial code (expf_poly, erff_poly, tanhf_poly: within 1-3 ulp of
//    the correctly rounded value, not bit-equal to libm) so that loops with them
//    vectorize (softmax rows, sigmoid, GELU); so is f64 exp (exp_poly_f64, about 1 ulp).
//  * Float sums of reduction stores accumulate in double in the eager ReduceSum's order
//    (index order, or for sums over leading axes the partitions of
//    ir::column_sum_partitions: split_column), so generated and eager sums are
//    bit-identical; max and integer sums in the register type; starting from 0 (sum) or
//    -inf/lowest (max), stored once. Reduce expressions of row programs accumulate in
//    their dtype's register type (f32 sums in f32 vector lanes, f64 in double): a row
//    rule that wants a double sum of f32 values sums an f64 cast.
//
// Row programs (reduce expressions, kernel_ir.h) run row by row: per kept point, pass
// p = 1..P is one loop over the reduced dims (row_program_body). Their float max
// reductions use maxnum (nnan, nsz) plus a "saw a NaN" flag, so they vectorize and still
// give NaN for a row holding one (the sign of a zero maximum is not specified). Values a
// later pass needs again and that hold a transcendental (Softmax's exp) are kept in a
// per-row stack array by the first pass and reloaded (row_scratch_plan); the reduced
// loops carry vectorize.width = the f32 lanes of the target and no interleaving.
// Schedule (after collapse_dims): pointwise kernels run dim 0 over [begin, end) and the
// other dims as nested loops (innermost unit-stride for the vectorizer). Reductions
// parallelize over the outermost kept dim; if the innermost dim is reduced ("row" mode)
// each output element accumulates in a register over all reduced dims; if the innermost
// dim is kept ("column" mode) it is processed in tiles of kTile elements with a stack
// array of accumulators, reduced dims outside and the tile loop inside (unit stride;
// no reassoc there: each output sums in the reference's order, bit-equal to it); a
// column reduction over leading axes runs its row partitions on the threads instead.
#include "codegen/cpu/llvm_cpu.h"

#include <algorithm>
#include <cctype>
#include <chrono>
#include <cmath>
#include <functional>
#include <map>
#include <mutex>
#include <set>
#include <vector>

#include "llvm/Analysis/TargetTransformInfo.h"
#include "llvm/AsmParser/Parser.h"
#include "llvm/ExecutionEngine/Orc/ExecutionUtils.h"
#include "llvm/ExecutionEngine/Orc/JITTargetMachineBuilder.h"
#include "llvm/ExecutionEngine/Orc/LLJIT.h"
#include "llvm/ExecutionEngine/Orc/ThreadSafeModule.h"
#include "llvm/IR/IRBuilder.h"
#include "llvm/IR/LegacyPassManager.h"
#include "llvm/IR/Intrinsics.h"
#include "llvm/IR/DiagnosticHandler.h"
#include "llvm/IR/DiagnosticInfo.h"
#include "llvm/IR/LLVMContext.h"
#include "llvm/IR/Module.h"
#include "llvm/IR/Verifier.h"
#include "llvm/Passes/PassBuilder.h"
#include "llvm/Support/MemoryBuffer.h"
#include "llvm/Support/SourceMgr.h"
#include "llvm/Support/TargetSelect.h"
#include "llvm/Support/raw_ostream.h"
#include "llvm/Target/TargetMachine.h"
#include "llvm/TargetParser/Host.h"

/// Integer power by squaring with ONNX/numpy negative exponents (as the eager Pow kernel);
/// called by generated code for integer pow (the result is truncated to the dtype's width).
extern "C" int64_t kiln_cpu_ipow(int64_t base, int64_t e) { return kiln::codegen::ipow_wrapping(base, e); }

namespace kiln::codegen {

using ir::DType;
using ir::ScalarOp;

namespace {

constexpr int64_t kTile = 256;  // column-mode accumulator tile (elements)

/// Swallows LLVM's remarks, warnings and notes (for example "loop not vectorized" for a
/// loop that carries vectorization hints), which LLVM would print to the user's stderr;
/// errors keep LLVM's default handling.
struct QuietDiagnostics : llvm::DiagnosticHandler {
  bool handleDiagnostics(const llvm::DiagnosticInfo& d) override { return d.getSeverity() != llvm::DS_Error; }
};
void quiet_diagnostics(llvm::LLVMContext& ctx) { ctx.setDiagnosticHandler(std::make_unique<QuietDiagnostics>()); }

/// Polynomial p(t) = sum_i m_i t^i on t in [-1, 1] interpolating f on [a, b] (t = (2x -
/// a - b) / (b - a)) at the n Chebyshev nodes (Numerical Recipes' chebft, then the
/// Chebyshev series expanded into monomials), all in long double; returns m_0..m_{n-1}.
/// The generated code evaluates it by Horner's rule in f32.
std::vector<double> chebyshev_monomials(long double (*f)(long double), long double a, long double b, int n) {
  const long double pi = 3.141592653589793238462643383279502884L;
  const size_t N = static_cast<size_t>(n);
  std::vector<long double> fv(N), c(N);
  for (size_t k = 0; k < N; ++k) fv[k] = f((b - a) / 2 * std::cos(pi * (k + 0.5L) / n) + (a + b) / 2);
  for (size_t j = 0; j < N; ++j) {
    long double s = 0;
    for (size_t k = 0; k < N; ++k) s += fv[k] * std::cos(pi * j * (k + 0.5L) / n);
    c[j] = 2 * s / n / (j == 0 ? 2 : 1);
  }
  // T_0 = 1, T_1 = t, T_j = 2 t T_{j-1} - T_{j-2}, as monomial coefficient vectors.
  std::vector<std::vector<long double>> T(N, std::vector<long double>(N, 0));
  T[0][0] = 1;
  if (N > 1) T[1][1] = 1;
  for (size_t j = 2; j < N; ++j)
    for (size_t i = 0; i < N; ++i) T[j][i] = (i > 0 ? 2 * T[j - 1][i - 1] : 0) - T[j - 2][i];
  std::vector<double> m(N);
  for (size_t i = 0; i < N; ++i) {
    long double s = 0;
    for (size_t j = 0; j < N; ++j) s += c[j] * T[j][i];
    m[i] = static_cast<double>(s);
  }
  return m;
}

constexpr long double kTwoOverSqrtPi = 1.128379167095512573896158903121545172L;
/// erf(sqrt(z)) / sqrt(z) (2 / sqrt(pi) at 0): an entire function of z, so erf(x) =
/// x g(x^2) keeps its relative accuracy near 0 and one polynomial covers [0, 3.92^2].
long double erf_over_x_of_square(long double z) {
  if (z <= 0) return kTwoOverSqrtPi;
  const long double r = std::sqrt(z);
  return std::erf(r) / r;
}
/// tanh(sqrt(z)) / sqrt(z) (1 at 0).
long double tanh_over_x_of_square(long double z) {
  if (z <= 0) return 1;
  const long double r = std::sqrt(z);
  return std::tanh(r) / r;
}

/// f32 erf: |x| < kErfOne as x g(x^2) with g = erf_over_x_of_square, one polynomial of
/// 18 terms in t = 2 x^2 / kErfOne^2 - 1 (g is entire in x^2, so its Chebyshev series
/// converges fast: fit error 8e-9 relative at degree 16; the monomials in t stay below
/// 0.37, so f32 Horner steps lose little); +-1 beyond (erff rounds to +-1 from 3.9192).
/// Within 3 ulp of the correctly rounded value over [0, kErfOne] in a float32 model of
/// the steps; most of it is t's own rounding near t = -1 (small x).
constexpr double kErfOne = 3.92;
/// Horner chains erf's polynomial is evaluated in (grouped_horner: 4 chains of 5, 5,
/// 5 and 3 terms joined in t^5). Measured over the 2.1 M points of
/// LlvmCpu.F32ErfAndTanhAreWithinFourUlpOfLongDouble: max 3 ulp for 1, 3, 4 and 6 chains,
/// 4 ulp for 2. The grouping also moves erf's last bits, and CompiledVsEager's tiny_gpt
/// accum2 case (AdamW amplifies last-bit gradient differences where |g| is near eps)
/// then measured weights within 5.5e-6 (1 chain), 1.6e-5 (3), 1.1e-5 (6) and 1.8e-6 (4)
/// of eager's libm erff: that check is sensitive to any change of erf's rounding.
constexpr size_t kErfGroups = 4;
const std::vector<double>& erf_poly() {
  static const std::vector<double> m =
      chebyshev_monomials(erf_over_x_of_square, 0, static_cast<long double>(kErfOne) * kErfOne, 18);
  return m;
}
/// f32 tanh: |x| < kTanhCut as x g(x^2) (6 terms), else 1 - 2 / (exp(2|x|) + 1).
constexpr double kTanhCut = 0.55;
const std::vector<double>& tanh_small_poly() {
  static const std::vector<double> m =
      chebyshev_monomials(tanh_over_x_of_square, 0, static_cast<long double>(kTanhCut) * kTanhCut, 6);
  return m;
}

double seconds_since(std::chrono::steady_clock::time_point t0) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

std::string llvm_error(llvm::Error e) { return llvm::toString(std::move(e)); }

void init_native_target() {
  static std::once_flag once;
  std::call_once(once, [] {
    llvm::InitializeNativeTarget();
    llvm::InitializeNativeTargetAsmPrinter();
  });
}

std::string host_features_string() {
  llvm::StringMap<bool> feats;
  std::set<std::string> sorted;
  if (llvm::sys::getHostCPUFeatures(feats))
    for (const auto& f : feats) sorted.insert((f.second ? "+" : "-") + f.first().str());
  std::string s;
  for (const auto& f : sorted) s += (s.empty() ? "" : ",") + f;
  return s;
}

bool is_unsigned(DType t) { return t == DType::u8 || t == DType::boolean; }

/// Emits the LLVM function of one (collapsed) kernel.
class KernelEmitter {
 public:
  /// `fn_name`: the LLVM function's name (the kernel's name when empty).
  KernelEmitter(llvm::Module& m, const Kernel& k, const std::string& cpu, const std::string& feats,
                std::string fn_name = {})
      : C_(m.getContext()), M_(m), k_(k), B_(m.getContext()), cpu_(cpu), feats_(feats),
        fn_name_(fn_name.empty() ? k.name : std::move(fn_name)) {}

  /// Emits the function and returns the schedule (fn left null).
  CpuKernel emit() {
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
    CpuKernel ck;
    ck.name = k_.name;
    level_ = k_.expr_levels();
    const int n = static_cast<int>(k_.domain.size());
    std::vector<int> kept, red;
    for (int d = 0; d < n; ++d) (k_.has_reduction() && k_.reduced[d] ? red : kept).push_back(d);
    std::vector<llvm::Value*> idx(n, nullptr);
    if (!k_.has_reduction()) {
      if (n == 0) {
        guard_once([&] { store_point(idx); });
      } else {
        ck.parallel_dim = 0;
        ck.parallel_extent = k_.domain[0];
        pointwise_loops(0, idx);
      }
    } else {
      if (!kept.empty()) {
        ck.parallel_dim = kept[0];
        ck.parallel_extent = k_.domain[kept[0]];
      }
      // Row programs loop row by row whatever the layout (fast when the reduced dims are
      // innermost, which the fusion pass arranges).
      const bool column = !kept.empty() && kept.back() == n - 1 && !k_.is_row_program();
      auto body = [&] {
        if (column) column_tiles(kept, red, idx);
        else kept_loops(kept, 0, red, idx, false);  // kept empty: one row
      };
      const int64_t parts = column ? k_.column_split_parts() : 0;
      if (parts > 0) split_column(kept, red, idx, parts, ck);
      else if (kept.empty()) guard_once(body);
      else if (column && kept.size() == 1) column_tiles(kept, red, idx);
      else kept_loops(kept, 0, red, idx, column);
    }
    B_.CreateRetVoid();
    const int64_t total = k_.domain_size();
    ck.work_per_index = ck.parallel_extent > 0 ? std::max<int64_t>(1, total / ck.parallel_extent) : 1;
    return ck;
  }

 private:
  // ---- types and constants
  llvm::Type* reg_type(DType t) {
    switch (t) {
      case DType::f64: return B_.getDoubleTy();
      case DType::f32: case DType::bf16: case DType::f16: return B_.getFloatTy();
      case DType::i64: return i64_;
      case DType::i32: return B_.getInt32Ty();
      case DType::boolean: return B_.getInt1Ty();
      default: return B_.getInt8Ty();
    }
  }
  llvm::Type* mem_type(DType t) {
    switch (t) {
      case DType::bf16: case DType::f16: return B_.getInt16Ty();
      case DType::boolean: return B_.getInt8Ty();
      default: return reg_type(t);
    }
  }
  llvm::Value* i64c(int64_t v) { return B_.getInt64(static_cast<uint64_t>(v)); }

  llvm::Value* constant(DType t, double v) {
    switch (t) {
      case DType::f64: return llvm::ConstantFP::get(B_.getDoubleTy(), v);
      case DType::f32: return llvm::ConstantFP::get(B_.getFloatTy(), static_cast<float>(v));
      case DType::bf16: return llvm::ConstantFP::get(B_.getFloatTy(), ir::bf16_to_f32(ir::f32_to_bf16(static_cast<float>(v))));
      case DType::f16: return llvm::ConstantFP::get(B_.getFloatTy(), ir::f16_to_f32(ir::f32_to_f16(static_cast<float>(v))));
      case DType::boolean: return B_.getInt1(v != 0);
      default: return llvm::ConstantInt::get(reg_type(t), static_cast<uint64_t>(static_cast<int64_t>(v)), true);
    }
  }

  // ---- bf16 / f16
  /// f32 -> bits of the bf16-rounded value in the upper half of an i32 (RNE, NaN quiet).
  llvm::Value* bf16_bits(llvm::Value* f) {
    auto* i32 = B_.getInt32Ty();
    llvm::Value* u = B_.CreateBitCast(f, i32);
    llvm::Value* isnan = B_.CreateICmpUGT(B_.CreateAnd(u, 0x7fffffffu), llvm::ConstantInt::get(i32, 0x7f800000u));
    llvm::Value* lsb = B_.CreateAnd(B_.CreateLShr(u, 16), 1u);
    llvm::Value* r = B_.CreateAnd(B_.CreateAdd(B_.CreateAdd(u, llvm::ConstantInt::get(i32, 0x7fffu)), lsb),
                                  llvm::ConstantInt::get(i32, 0xffff0000u));
    llvm::Value* q = B_.CreateAnd(B_.CreateOr(u, llvm::ConstantInt::get(i32, 0x00400000u)),
                                  llvm::ConstantInt::get(i32, 0xffff0000u));
    return B_.CreateSelect(isnan, q, r);
  }
  /// Rounds an f32 register value to dtype t's precision (no-op for f32/f64).
  llvm::Value* round_to(DType t, llvm::Value* f) {
    if (t == DType::bf16) return B_.CreateBitCast(bf16_bits(f), B_.getFloatTy());
    if (t == DType::f16) return B_.CreateFPExt(B_.CreateFPTrunc(f, B_.getHalfTy()), B_.getFloatTy());
    return f;
  }

  // ---- memory
  llvm::Value* address(int p, const std::vector<llvm::Value*>& idx) {
    const KernelParam& kp = k_.params[p];
    llvm::Value* off = i64c(kp.offset);
    for (size_t d = 0; d < idx.size(); ++d)
      if (idx[d] && kp.strides[d] != 0)
        off = B_.CreateNSWAdd(off, kp.strides[d] == 1 ? idx[d] : B_.CreateNSWMul(idx[d], i64c(kp.strides[d])));
    return B_.CreateInBoundsGEP(mem_type(kp.dtype), base_[p], off);
  }
  llvm::Value* load(int p, const std::vector<llvm::Value*>& idx) {
    const DType t = k_.params[p].dtype;
    llvm::Value* v = B_.CreateLoad(mem_type(t), address(p, idx));
    switch (t) {
      case DType::bf16:
        return B_.CreateBitCast(B_.CreateShl(B_.CreateZExt(v, B_.getInt32Ty()), 16), B_.getFloatTy());
      case DType::f16: return B_.CreateFPExt(B_.CreateBitCast(v, B_.getHalfTy()), B_.getFloatTy());
      case DType::boolean: return B_.CreateICmpNE(v, B_.getInt8(0));
      default: return v;
    }
  }
  /// A load of a guarded param (KernelParam::guard_lo): inside the guard box the element,
  /// else `fallback`; the memory is touched only inside (a branch the loop vectorizer
  /// if-converts into masked loads), so the address may lie outside the buffer elsewhere.
  llvm::Value* guarded_load(int p, const std::vector<llvm::Value*>& idx, llvm::Value* fallback) {
    const KernelParam& q = k_.params[p];
    llvm::Value* in = nullptr;
    for (size_t d = 0; d < idx.size() && d < q.guard_lo.size(); ++d) {
      if (q.guard_lo[d] == 0 && q.guard_hi[d] == k_.domain[d]) continue;
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
  void store(int p, const std::vector<llvm::Value*>& idx, llvm::Value* v) {
    const DType t = k_.params[p].dtype;
    switch (t) {
      case DType::bf16: v = B_.CreateTrunc(B_.CreateLShr(bf16_bits(v), 16), B_.getInt16Ty()); break;
      case DType::f16: v = B_.CreateBitCast(B_.CreateFPTrunc(v, B_.getHalfTy()), B_.getInt16Ty()); break;
      case DType::boolean: v = B_.CreateZExt(v, B_.getInt8Ty()); break;
      default: break;
    }
    B_.CreateStore(v, address(p, idx));
  }

  // ---- expressions
  llvm::Value* intrinsic(llvm::Intrinsic::ID id, std::vector<llvm::Value*> args) {
    llvm::Function* f = llvm::Intrinsic::getDeclaration(&M_, id, {args[0]->getType()});
    return B_.CreateCall(f, args);
  }
  /// a * b + c for polynomial steps: llvm.fmuladd, one FMA instruction where the host
  /// CPU has FMA (one rounding, at least as accurate), a multiply and an add elsewhere.
  llvm::Value* muladd(llvm::Value* a, llvm::Value* b, llvm::Value* c) {
    return intrinsic(llvm::Intrinsic::fmuladd, {a, b, c});
  }
  llvm::Value* libm(const std::string& name32, const std::string& name64, llvm::Value* x) {
    const bool dbl = x->getType()->isDoubleTy();
    auto* fty = llvm::FunctionType::get(x->getType(), {x->getType()}, false);
    llvm::FunctionCallee callee = M_.getOrInsertFunction(dbl ? name64 : name32, fty);
    if (auto* f = llvm::dyn_cast<llvm::Function>(callee.getCallee())) {
      f->setDoesNotAccessMemory();
      f->setDoesNotThrow();
      f->setWillReturn();
    }
    return B_.CreateCall(callee, {x});
  }
  llvm::Value* qnan(llvm::Type* t) { return llvm::ConstantFP::getQNaN(t); }

  /// An f32 literal (v rounded to float).
  llvm::Constant* f32c(double v) { return llvm::ConstantFP::get(B_.getFloatTy(), static_cast<float>(v)); }

  /// sum_i m_i t^i (t: f32 or f64; coefficients rounded to t's type) as `groups` interleaved Horner chains over consecutive blocks of
  /// s = ceil(n / groups) coefficients, joined by Horner's rule in t^s (a second-order
  /// Horner scheme, Knuth TAOCP vol. 2, 4.6.4). The same multiply-adds as plain Horner
  /// plus the few multiplies for t^s, but a dependency chain of about s + groups steps
  /// instead of n: erf's 18 terms as one chain were 72 cycles of FMA latency per vector,
  /// which left GELU's loop waiting on latency rather than on its ports. (Estrin's scheme
  /// shortens the chain further but needs a register copy per pair and spilled the
  /// constants.)
  llvm::Value* grouped_horner(llvm::Value* t, const std::vector<double>& m, size_t groups) {
    auto c = [&](double v) { return llvm::ConstantFP::get(t->getType(), v); };
    const size_t n = m.size(), step = (n + groups - 1) / groups;
    std::vector<llvm::Value*> g;
    for (size_t lo = 0; lo < n; lo += step) {
      const size_t hi = std::min(n, lo + step);
      llvm::Value* r = c(m[hi - 1]);
      for (size_t i = hi - 1; i-- > lo;) r = muladd(r, t, c(m[i]));
      g.push_back(r);
    }
    if (g.size() == 1) return g[0];
    llvm::Value* ts = nullptr;  // t^step by binary powering
    llvm::Value* base = t;
    for (size_t e = step; e > 0; e >>= 1) {
      if (e & 1) ts = ts ? B_.CreateFMul(ts, base) : base;
      if (e > 1) base = B_.CreateFMul(base, base);
    }
    llvm::Value* r = g.back();
    for (size_t j = g.size() - 1; j-- > 0;) r = muladd(r, ts, g[j]);
    return r;
  }

  /// sum_i m_i t^i by Horner's rule at t = x * scale + shift (x: f32 register value).
  llvm::Value* horner_f32(llvm::Value* x, const std::vector<double>& m, double scale, double shift) {
    return grouped_horner(B_.CreateFAdd(B_.CreateFMul(x, f32c(scale)), f32c(shift)), m, 1);
  }

  /// erf of an f32 register value as straight-line f32 code the loop vectorizer widens
  /// (libm's erff keeps a loop scalar: GELU's kernels ran at a tenth of the copy rate):
  /// x g(x^2) with one polynomial (erf_poly) on |x| clamped to kErfOne, +-1 beyond, odd,
  /// NaN kept; the polynomial in kErfGroups Horner chains (GELU ran 10-30% faster than
  /// with one chain, single thread). About 25 vector instructions; an earlier two-range version (x g(x^2) below
  /// 1, 1 - exp(-x^2) q(x) above, both evaluated for every lane) took about 60.
  llvm::Value* erff_poly(llvm::Value* x) {
    llvm::Value* ax = intrinsic(llvm::Intrinsic::fabs, {x});
    llvm::Value* in_range = B_.CreateFCmpOLT(ax, f32c(kErfOne));
    llvm::Value* ac = B_.CreateSelect(in_range, ax, f32c(kErfOne));
    const double z1 = kErfOne * kErfOne;
    llvm::Value* t = muladd(B_.CreateFMul(ac, ac), f32c(2 / z1), f32c(-1));  // one rounding near t = -1
    llvm::Value* g = grouped_horner(t, erf_poly(), kErfGroups);
    llvm::Value* r = B_.CreateSelect(in_range, B_.CreateFMul(ac, g), f32c(1));
    r = intrinsic(llvm::Intrinsic::copysign, {r, x});
    return B_.CreateSelect(B_.CreateFCmpUNO(x, x), x, r);
  }

  /// tanh of an f32 register value, vectorizable: |x| < kTanhCut as x g(x^2)
  /// (tanh_small_poly), else 1 - 2 / (exp(2|x|) + 1) with |x| clamped to 9.1 (tanh rounds
  /// to 1 in f32 from 9.01); odd, NaN kept. About 1 ulp in the polynomial range, a few
  /// ulp beyond (expf_poly's error, damped by the division).
  llvm::Value* tanhf_poly(llvm::Value* x) {
    llvm::Value* ax = intrinsic(llvm::Intrinsic::fabs, {x});
    llvm::Value* as = B_.CreateSelect(B_.CreateFCmpOLT(ax, f32c(kTanhCut)), ax, f32c(kTanhCut));
    llvm::Value* small =
        B_.CreateFMul(as, horner_f32(B_.CreateFMul(as, as), tanh_small_poly(), 2 / (kTanhCut * kTanhCut), -1));
    llvm::Value* al = B_.CreateSelect(B_.CreateFCmpOLT(ax, f32c(9.1)), ax, f32c(9.1));
    llvm::Value* e = expf_poly(B_.CreateFAdd(al, al));
    llvm::Value* large = B_.CreateFSub(f32c(1), B_.CreateFDiv(f32c(2), B_.CreateFAdd(e, f32c(1))));
    llvm::Value* r = B_.CreateSelect(B_.CreateFCmpOLT(ax, f32c(kTanhCut)), small, large);
    r = intrinsic(llvm::Intrinsic::copysign, {r, x});
    return B_.CreateSelect(B_.CreateFCmpUNO(x, x), x, r);
  }

  /// exp of an f32 register value as straight-line code the loop vectorizer widens (a
  /// libm call would keep the loop scalar): Cephes' expf (range reduction by ln 2 in two
  /// parts, degree-7 polynomial, 2^n built in two halves so that subnormal results stay
  /// finite); within 1 ulp of the correctly rounded value over [-104, 89]
  /// (F32ExpIsWithinTwoUlpOfLongDouble); +inf above 88.7228, 0 below -103.97, NaN kept.
  /// n = round(x log2 e) by adding 1.5 * 2^23 (its integer bits are then n, no
  /// float -> int conversion); x clamped to 89 first, where the halves already give +inf
  /// (x > 88.7228: 2^128 times y > 0.9998); below -103.97 the result is 0 by a select;
  /// a NaN passes the clamps and is put back at the end.
  llvm::Value* expf_poly(llvm::Value* x) {
    llvm::Type* f32 = B_.getFloatTy();
    llvm::Type* i32 = B_.getInt32Ty();
    auto c = [&](double v) { return llvm::ConstantFP::get(f32, v); };
    // Lanes whose result is 0 compute exp(0) instead: the scaling below would underflow
    // there, and on x86 every underflowing multiply takes a microcode assist (a masked
    // softmax, half -inf, ran 4x slower); only true subnormal results still pay it.
    llvm::Value* zero = B_.CreateFCmpOLT(x, c(-103.972076416));
    llvm::Value* xc = B_.CreateSelect(zero, c(0.0), x);
    xc = B_.CreateSelect(B_.CreateFCmpOGT(xc, c(89.0)), c(89.0), xc);
    const double magic = 12582912.0;  // 1.5 * 2^23: t's low mantissa bits hold n (|n| <= 151)
    llvm::Value* t = muladd(xc, c(1.44269504088896341), c(magic));
    llvm::Value* n = B_.CreateFSub(t, c(magic));
    llvm::Value* r = muladd(n, c(-0.693359375), xc);
    r = muladd(n, c(2.12194440e-4), r);
    llvm::Value* p = grouped_horner(
        r, {5.0000001201e-1, 1.6666665459e-1, 4.1665795894e-2, 8.3334519073e-3, 1.3981999507e-3, 1.9875691500e-4}, 1);
    // p r^2 + r + 1 in three roundings as Cephes (and glibc's expf results, in the
    // tested cases): one FMA for p r^2 + r rounds differently in some last bits, and Adam's
    // first, sign-like steps amplify those (CompiledVsEager tiny_gpt accum2 moved to 1.7e-5).
    llvm::Value* y = B_.CreateFAdd(B_.CreateFAdd(B_.CreateFMul(p, B_.CreateFMul(r, r)), r), c(1.0));
    llvm::Value* ni = B_.CreateSub(B_.CreateBitCast(t, i32), llvm::ConstantInt::get(i32, 0x4B400000));
    llvm::Value* n1 = B_.CreateAShr(ni, 1);
    llvm::Value* n2 = B_.CreateSub(ni, n1);
    auto pow2 = [&](llvm::Value* e) {
      return B_.CreateBitCast(B_.CreateShl(B_.CreateAdd(e, llvm::ConstantInt::get(i32, 127)), 23), f32);
    };
    llvm::Value* res = B_.CreateSelect(zero, c(0.0), B_.CreateFMul(B_.CreateFMul(y, pow2(n1)), pow2(n2)));
    return B_.CreateSelect(B_.CreateFCmpUNO(x, x), x, res);
  }

  /// exp of an f64 register value as straight-line code the loop vectorizer widens (libm's
  /// exp keeps a loop scalar): range reduction by ln 2 in two parts (Cephes' constants),
  /// degree-13 Taylor polynomial on |r| <= ln2/2 (truncation error below 5e-18), 2^n
  /// from the exponent bits in two halves (subnormal results stay finite). As expf_poly:
  /// n = round(x log2 e) by adding 1.5 * 2^52 (its low bits are then n), x clamped to
  /// 709.79 first, where the halves already give +inf (x > 709.7827: 2^1024 times y >= 1);
  /// 0 below -745.133 by a select; NaN put back at the end. Relative error about 1 ulp
  /// of f64 (F64ExpIsWithinTwoUlpOfLongDouble).
  llvm::Value* exp_poly_f64(llvm::Value* x) {
    llvm::Type* f64 = B_.getDoubleTy();
    llvm::Type* i64 = B_.getInt64Ty();
    auto c = [&](double v) { return llvm::ConstantFP::get(f64, v); };
    auto ci = [&](int64_t v) { return llvm::ConstantInt::get(i64, static_cast<uint64_t>(v)); };
    llvm::Value* zero = B_.CreateFCmpOLT(x, c(-745.1332191019412));  // as in expf_poly: no underflow
    llvm::Value* xc = B_.CreateSelect(zero, c(0.0), x);
    xc = B_.CreateSelect(B_.CreateFCmpOGT(xc, c(709.79)), c(709.79), xc);
    const double magic = 6755399441055744.0;  // 1.5 * 2^52: t's low mantissa bits hold n
    llvm::Value* t = muladd(xc, c(1.4426950408889634074), c(magic));
    llvm::Value* n = B_.CreateFSub(t, c(magic));
    llvm::Value* r = muladd(n, c(-6.93145751953125E-1), xc);
    r = muladd(n, c(-1.42860682030941723212E-6), r);
    // p = sum_k r^k / (k + 1)! for k = 0..12 by Horner's rule (one chain: split into two
    // or three, the 16-lane f64 loop of the cross-entropy gradient, two registers per
    // value, spilled constants and got slower in llvm-mca), then 1 + r * p.
    std::vector<double> inv_fact(13);
    double f = 1;
    for (int k = 0; k < 13; ++k) inv_fact[k] = (f /= (k + 1));
    llvm::Value* y = muladd(grouped_horner(r, inv_fact, 1), r, c(1.0));
    llvm::Value* ni = B_.CreateSub(B_.CreateBitCast(t, i64), ci(0x4338000000000000LL));
    llvm::Value* n1 = B_.CreateAShr(ni, 1);
    llvm::Value* n2 = B_.CreateSub(ni, n1);
    auto pow2 = [&](llvm::Value* e) { return B_.CreateBitCast(B_.CreateShl(B_.CreateAdd(e, ci(1023)), 52), f64); };
    llvm::Value* res = B_.CreateSelect(zero, c(0.0), B_.CreateFMul(B_.CreateFMul(y, pow2(n1)), pow2(n2)));
    return B_.CreateSelect(B_.CreateFCmpUNO(x, x), x, res);
  }

  llvm::Value* float_op(ScalarOp op, DType t, llvm::Value* x, llvm::Value* y) {
    llvm::Value* r = nullptr;
    switch (op) {
      case ScalarOp::add: r = B_.CreateFAdd(x, y); break;
      case ScalarOp::sub: r = B_.CreateFSub(x, y); break;
      case ScalarOp::mul: r = B_.CreateFMul(x, y); break;
      case ScalarOp::div: r = B_.CreateFDiv(x, y); break;
      case ScalarOp::pow: r = intrinsic(llvm::Intrinsic::pow, {x, y}); break;
      case ScalarOp::max:
      case ScalarOp::min: {
        llvm::Value* nan = B_.CreateFCmpUNO(x, y);
        llvm::Value* take_y = op == ScalarOp::max ? B_.CreateFCmpOLT(x, y) : B_.CreateFCmpOLT(y, x);
        r = B_.CreateSelect(nan, qnan(x->getType()), B_.CreateSelect(take_y, y, x));
        break;
      }
      case ScalarOp::neg: r = B_.CreateFNeg(x); break;
      case ScalarOp::abs:
        r = B_.CreateSelect(B_.CreateFCmpOLT(x, llvm::ConstantFP::get(x->getType(), 0.0)), B_.CreateFNeg(x), x);
        break;
      case ScalarOp::exp: r = x->getType()->isFloatTy() ? expf_poly(x) : exp_poly_f64(x); break;
      case ScalarOp::log: r = intrinsic(llvm::Intrinsic::log, {x}); break;
      case ScalarOp::sqrt: r = intrinsic(llvm::Intrinsic::sqrt, {x}); break;
      case ScalarOp::sin: r = intrinsic(llvm::Intrinsic::sin, {x}); break;
      case ScalarOp::cos: r = intrinsic(llvm::Intrinsic::cos, {x}); break;
      case ScalarOp::floor: r = intrinsic(llvm::Intrinsic::floor, {x}); break;
      case ScalarOp::ceil: r = intrinsic(llvm::Intrinsic::ceil, {x}); break;
      case ScalarOp::round: r = intrinsic(llvm::Intrinsic::roundeven, {x}); break;
      case ScalarOp::fmod: r = B_.CreateFRem(x, y); break;  // LLVM's frem is C fmod
      case ScalarOp::erf: r = x->getType()->isFloatTy() ? erff_poly(x) : libm("erff", "erf", x); break;
      case ScalarOp::tanh: r = x->getType()->isFloatTy() ? tanhf_poly(x) : libm("tanhf", "tanh", x); break;
      default: r = x; break;
    }
    return round_to(t, r);
  }

  llvm::Value* int_op(ScalarOp op, DType t, llvm::Value* x, llvm::Value* y) {
    const bool u = is_unsigned(t);
    llvm::Type* ty = x->getType();
    llvm::Value* zero = llvm::ConstantInt::get(ty, 0);
    switch (op) {
      case ScalarOp::add: return B_.CreateAdd(x, y);
      case ScalarOp::sub: return B_.CreateSub(x, y);
      case ScalarOp::mul: return B_.CreateMul(x, y);
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
      case ScalarOp::neg: return B_.CreateSub(zero, x);
      case ScalarOp::fmod: {  // truncated remainder; x % 0 = 0 and x % -1 = 0 (no trap)
        llvm::Value* yz = B_.CreateICmpEQ(y, zero);
        llvm::Value* bad = u ? yz : B_.CreateOr(yz, B_.CreateICmpEQ(y, llvm::ConstantInt::getSigned(ty, -1)));
        llvm::Value* safe = B_.CreateSelect(bad, llvm::ConstantInt::get(ty, 1), y);
        return B_.CreateSelect(bad, zero, u ? B_.CreateURem(x, safe) : B_.CreateSRem(x, safe));
      }
      case ScalarOp::abs:
        if (u) return x;
        return B_.CreateSelect(B_.CreateICmpSLT(x, zero), B_.CreateSub(zero, x), x);
      default: return x;
    }
  }

  llvm::Value* compare(ScalarOp op, DType t, llvm::Value* x, llvm::Value* y) {
    if (ir::is_float(t)) {
      switch (op) {
        case ScalarOp::lt: return B_.CreateFCmpOLT(x, y);
        case ScalarOp::le: return B_.CreateFCmpOLE(x, y);
        case ScalarOp::gt: return B_.CreateFCmpOGT(x, y);
        case ScalarOp::ge: return B_.CreateFCmpOGE(x, y);
        default: return B_.CreateFCmpOEQ(x, y);
      }
    }
    const bool u = is_unsigned(t);
    switch (op) {
      case ScalarOp::lt: return u ? B_.CreateICmpULT(x, y) : B_.CreateICmpSLT(x, y);
      case ScalarOp::le: return u ? B_.CreateICmpULE(x, y) : B_.CreateICmpSLE(x, y);
      case ScalarOp::gt: return u ? B_.CreateICmpUGT(x, y) : B_.CreateICmpSGT(x, y);
      case ScalarOp::ge: return u ? B_.CreateICmpUGE(x, y) : B_.CreateICmpSGE(x, y);
      default: return B_.CreateICmpEQ(x, y);
    }
  }

  /// ONNX Cast from `from` to `to` (as runtime/kernels/util.h convert()).
  llvm::Value* cast(DType from, DType to, llvm::Value* x) {
    if (from == to) return x;
    llvm::Type* rt = reg_type(to);
    const bool ff = ir::is_float(from);
    if (to == DType::boolean)
      return ff ? B_.CreateFCmpUNE(x, llvm::ConstantFP::get(x->getType(), 0.0))
                : B_.CreateICmpNE(x, llvm::ConstantInt::get(x->getType(), 0));
    if (ir::is_float(to)) {
      llvm::Value* r;
      if (ff) r = B_.CreateFPCast(x, rt);
      else r = is_unsigned(from) ? B_.CreateUIToFP(x, rt) : B_.CreateSIToFP(x, rt);
      return round_to(to, r);
    }
    if (ff) {
      const auto id = is_unsigned(to) ? llvm::Intrinsic::fptoui_sat : llvm::Intrinsic::fptosi_sat;
      llvm::Function* f = llvm::Intrinsic::getDeclaration(&M_, id, {rt, x->getType()});
      return B_.CreateCall(f, {x});
    }
    return B_.CreateIntCast(x, rt, !is_unsigned(from));
  }

  std::vector<llvm::Value*> eval(const std::vector<llvm::Value*>& idx) { return eval(idx, nullptr, 1); }
  /// Expressions of level < max_level at `idx` (null for the others); reduce
  /// expressions take their finished values from `known`; a non-null `preset[i]` is
  /// used as expression i's value instead of computing it (a row-scratch reload).
  std::vector<llvm::Value*> eval(const std::vector<llvm::Value*>& idx, const std::vector<llvm::Value*>* known,
                                 int max_level, const std::vector<llvm::Value*>* preset = nullptr) {
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
        case ScalarOp::lt: case ScalarOp::le: case ScalarOp::gt: case ScalarOp::ge: case ScalarOp::eq:
          v[i] = compare(e.op, adt(0), a(0), a(1));
          break;
        case ScalarOp::logical_and: v[i] = B_.CreateAnd(a(0), a(1)); break;
        case ScalarOp::logical_or: v[i] = B_.CreateOr(a(0), a(1)); break;
        case ScalarOp::logical_xor: v[i] = B_.CreateXor(a(0), a(1)); break;
        case ScalarOp::logical_not: v[i] = B_.CreateNot(a(0)); break;
        case ScalarOp::select: v[i] = B_.CreateSelect(a(0), a(1), a(2)); break;
        case ScalarOp::cast: v[i] = cast(adt(0), e.dtype, a(0)); break;
        case ScalarOp::fma: v[i] = round_to(e.dtype, intrinsic(llvm::Intrinsic::fma, {a(0), a(1), a(2)})); break;
        default: {
          llvm::Value* y = e.args.size() > 1 ? a(1) : nullptr;
          v[i] = ir::is_float(e.dtype) ? float_op(e.op, e.dtype, a(0), y) : int_op(e.op, e.dtype, a(0), y);
        }
      }
    }
    return v;
  }

  // ---- reductions
  /// Accumulator type of a reduction store: float sums accumulate in double, as the
  /// eager ReduceSum does (same order, so the sums are bit-identical); else the register
  /// type. Reduce expressions (row rules) accumulate in their register type instead:
  /// f32 sums in f32 over vector lanes, f64 in double (kernel_ir.h, KExpr).
  llvm::Type* acc_type_t(ReduceKind r, DType t, bool is_store = true) {
    llvm::Type* ty = reg_type(t);
    return (is_store && r == ReduceKind::sum && ty->isFloatingPointTy()) ? B_.getDoubleTy() : ty;
  }
  llvm::Type* acc_type(const KStore& s) { return acc_type_t(s.reduce, k_.params[s.param].dtype); }
  /// An accumulator converted back to the register type of the store's output.
  llvm::Value* acc_result(const KStore& s, llvm::Value* acc) {
    llvm::Type* ty = reg_type(k_.params[s.param].dtype);
    return acc->getType() == ty ? acc : B_.CreateFPTrunc(acc, ty);
  }
  llvm::Value* reduce_init_t(ReduceKind r, DType t, bool is_store = true) {
    llvm::Type* ty = acc_type_t(r, t, is_store);
    if (r == ReduceKind::sum)
      return ty->isFloatingPointTy() ? llvm::ConstantFP::get(ty, 0.0) : llvm::ConstantInt::get(ty, 0);
    if (ty->isFloatingPointTy()) return llvm::ConstantFP::getInfinity(ty, true);
    if (is_unsigned(t)) return llvm::ConstantInt::get(ty, 0);
    return llvm::ConstantInt::get(ty, llvm::APInt::getSignedMinValue(ty->getIntegerBitWidth()));
  }
  llvm::Value* reduce_init(const KStore& s) { return reduce_init_t(s.reduce, k_.params[s.param].dtype); }
  /// acc (+ or max) v; `reassoc` marks a float sum reassociable (row mode, so it vectorizes).
  llvm::Value* reduce_step_t(ReduceKind r, DType t, llvm::Value* acc, llvm::Value* v, bool reassoc) {
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
  llvm::Value* reduce_step(const KStore& s, llvm::Value* acc, llvm::Value* v, bool reassoc) {
    return reduce_step_t(s.reduce, k_.params[s.param].dtype, acc, v, reassoc);
  }

  // ---- loops
  /// for (i = lo; i < hi; ++i) body(i); the builder ends at the loop exit.
  void for_range(llvm::Value* lo, llvm::Value* hi, const std::function<void(llvm::Value*)>& body,
                 int vector_width = 0) {
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
      llvm::Metadata* ops[] = {nullptr, llvm::MDNode::get(C_, width), llvm::MDNode::get(C_, inter)};
      llvm::MDNode* md = llvm::MDNode::getDistinct(C_, ops);
      md->replaceOperandWith(0, md);
      latch->setMetadata(llvm::LLVMContext::MD_loop, md);
    }
    exit->insertInto(F_);
    B_.SetInsertPoint(exit);
  }
  /// if (begin < end) body(): the schedule of kernels without a parallel dim.
  void guard_once(const std::function<void()>& body) {
    llvm::BasicBlock* then = llvm::BasicBlock::Create(C_, "once", F_);
    llvm::BasicBlock* done = llvm::BasicBlock::Create(C_, "once.end");
    B_.CreateCondBr(B_.CreateICmpSLT(begin_, end_), then, done);
    B_.SetInsertPoint(then);
    body();
    B_.CreateBr(done);
    done->insertInto(F_);
    B_.SetInsertPoint(done);
  }
  llvm::Value* range_lo(int d, int parallel) { return d == parallel ? begin_ : i64c(0); }
  llvm::Value* range_hi(int d, int parallel) { return d == parallel ? end_ : i64c(k_.domain[d]); }

  void store_point(const std::vector<llvm::Value*>& idx) {
    std::vector<llvm::Value*> v = eval(idx);
    for (const KStore& s : k_.stores) store(s.param, idx, v[s.expr]);
  }
  void pointwise_loops(int d, std::vector<llvm::Value*>& idx) {
    if (d == static_cast<int>(k_.domain.size())) {
      store_point(idx);
      return;
    }
    for_range(range_lo(d, 0), range_hi(d, 0), [&](llvm::Value* i) {
      idx[d] = i;
      pointwise_loops(d + 1, idx);
    });
    idx[d] = nullptr;
  }
  llvm::Value* entry_alloca(llvm::Type* t, llvm::Value* n) {
    llvm::IRBuilder<> eb(entry_, entry_->begin());
    return eb.CreateAlloca(t, n);
  }
  /// Loops over kept dims kept[ki..] (all but the innermost in column mode), then the body.
  void kept_loops(const std::vector<int>& kept, size_t ki, const std::vector<int>& red,
                  std::vector<llvm::Value*>& idx, bool column) {
    const size_t stop = column ? kept.size() - 1 : kept.size();
    if (ki == stop) {
      if (column) column_tiles(kept, red, idx);
      else if (k_.is_row_program()) row_program_body(red, idx);
      else row_body(red, idx);
      return;
    }
    const int d = kept[ki];
    for_range(range_lo(d, kept[0]), range_hi(d, kept[0]), [&](llvm::Value* i) {
      idx[d] = i;
      kept_loops(kept, ki + 1, red, idx, column);
    });
    idx[d] = nullptr;
  }
  void reduced_loops(const std::vector<int>& red, size_t ri, std::vector<llvm::Value*>& idx,
                     const std::function<void()>& body, int vector_width = 0) {
    if (ri == red.size()) {
      body();
      return;
    }
    const int d = red[ri];
    for_range(
        i64c(0), i64c(k_.domain[d]),
        [&](llvm::Value* i) {
          idx[d] = i;
          reduced_loops(red, ri + 1, idx, body, vector_width);
        },
        ri + 1 == red.size() ? vector_width : 0);
    idx[d] = nullptr;
  }
  /// The reduced points of flat (row-major over red) indices [lo, hi), in order: one
  /// loop whose index is split into the reduced dims' indices.
  void flat_reduced_loop(const std::vector<int>& red, std::vector<llvm::Value*>& idx, llvm::Value* lo,
                         llvm::Value* hi, const std::function<void()>& body) {
    for_range(lo, hi, [&](llvm::Value* r) {
      for (size_t k = red.size(); k-- > 0;) {
        const int d = red[k];
        if (k == 0) {
          idx[d] = r;
        } else {
          idx[d] = B_.CreateSRem(r, i64c(k_.domain[d]));
          r = B_.CreateSDiv(r, i64c(k_.domain[d]));
        }
      }
      body();
    });
    for (int d : red) idx[d] = nullptr;
  }
  /// Row mode: one register accumulator per store over all reduced dims.
  void row_body(const std::vector<int>& red, std::vector<llvm::Value*>& idx) {
    std::vector<llvm::Value*> acc;
    for (const KStore& s : k_.stores) {
      llvm::Type* t = acc_type(s);
      acc.push_back(entry_alloca(t, nullptr));
      B_.CreateStore(reduce_init(s), acc.back());
    }
    reduced_loops(red, 0, idx, [&] {
      std::vector<llvm::Value*> v = eval(idx);
      for (size_t s = 0; s < k_.stores.size(); ++s) {
        llvm::Type* t = acc_type(k_.stores[s]);
        // Row sums may reassociate (so they vectorize): an f32-family sum accumulates in
        // double, whose rounding error is far below the final f32 rounding, so the
        // stored result equals the eager sequential double sum except at rare ties.
        const bool reassoc = true;
        B_.CreateStore(reduce_step(k_.stores[s], B_.CreateLoad(t, acc[s]), v[k_.stores[s].expr], reassoc), acc[s]);
      }
    });
    for (size_t s = 0; s < k_.stores.size(); ++s) {
      llvm::Type* t = acc_type(k_.stores[s]);
      store(k_.stores[s].param, idx, acc_result(k_.stores[s], B_.CreateLoad(t, acc[s])));
    }
  }
  /// Vector width (f32 lanes) for a reduced loop of `trip` iterations in a row program:
  /// 16 with AVX-512, 8 with AVX, else 0 (the vectorizer's own choice). Also 0 below 16
  /// iterations, which LLVM vectorizes only as if optimizing for size (a hinted loop it
  /// then leaves scalar draws a "loop not vectorized" remark).
  int row_vector_width(int64_t trip) const {
    if (trip < 16) return 0;
    if (feats_.find("+avx512f") != std::string::npos) return 16;
    if (feats_.find("+avx") != std::string::npos) return 8;
    return 0;
  }

  /// Which expressions of a row program are computed once per row and reloaded: see
  /// row_scratch_plan.
  struct RowScratch {
    int64_t row = 0;                       ///< elements per row (0: no scratch)
    std::vector<int> first;                ///< per expr: the pass that stores it (0: not kept)
    std::vector<std::vector<bool>> needed; ///< [pass][expr]: the pass uses the expr's value
  };
  /// Float expressions whose value a later pass needs again and whose computation holds
  /// a transcendental op (exp, log, tanh, erf, sin, cos, pow; not sqrt or div alone,
  /// which cost about what a reload does) or at least kScratchMinOps vector operations
  /// (a load of a mask or integer counting one, for its test or conversion) are kept in
  /// a row scratch array: the first pass that needs one stores it, later passes reload
  /// it instead of recomputing it (the store and the reload use the load/store ports, not
  /// the vector ALUs that bound these loops). Only the outermost such expressions are
  /// kept (Softmax keeps its exp, not also the exp's argument, in the pass after its
  /// max; its masked, scaled scores Where(mask, -inf, x * scale) in the max's pass).
  /// Rows longer than kScratchBytes / element size keep nothing. The values are
  /// bit-identical to recomputation, so the reference evaluator is unchanged.
  RowScratch row_scratch_plan(const std::vector<int>& red) {
    constexpr int64_t kScratchBytes = 128 * 1024;
    constexpr int kScratchMinOps = 3;
    const size_t ne = k_.exprs.size();
    const int passes = k_.row_passes();
    RowScratch r;
    r.first.assign(ne, 0);
    r.needed.assign(passes + 1, std::vector<bool>(ne, false));
    // needed[p]: the args of the level-p reduce expressions and the expressions of the
    // stores written in pass p (level p - 1), closed over args but not through reduce
    // expressions (their values are known by then).
    for (int p = 1; p <= passes; ++p) {
      std::vector<bool>& need = r.needed[p];
      for (size_t i = 0; i < ne; ++i)
        if (k_.exprs[i].kind == KExpr::Kind::reduce && level_[i] == p) need[k_.exprs[i].args[0]] = true;
      for (const KStore& s : k_.stores)
        if (level_[s.expr] == p - 1 && (s.reduce != ReduceKind::none || k_.varies_along_reduced(s))) need[s.expr] = true;
      for (size_t i = ne; i-- > 0;)
        if (need[i] && k_.exprs[i].kind == KExpr::Kind::op)
          for (int a : k_.exprs[i].args) need[a] = true;
    }
    int64_t row = 1;
    for (int d : red) row *= k_.domain[d];
    std::vector<bool> heavy(ne, false), costly(ne, false);  // holds a transcendental; heavy or 3+ ops
    std::vector<int> ops(ne, 0);  // vector operations recomputing it takes (capped)
    for (size_t i = 0; i < ne; ++i) {
      const KExpr& e = k_.exprs[i];
      if (e.kind == KExpr::Kind::load) ops[i] = ir::is_float(e.dtype) ? 0 : 1;  // a mask's test
      if (e.kind != KExpr::Kind::op) continue;
      switch (e.op) {
        case ScalarOp::exp: case ScalarOp::log: case ScalarOp::tanh: case ScalarOp::erf: case ScalarOp::sin:
        case ScalarOp::cos: case ScalarOp::pow: heavy[i] = ir::is_float(e.dtype); break;
        default: break;
      }
      ops[i] = 1;
      for (int a : e.args) {
        const KExpr& ae = k_.exprs[a];
        heavy[i] = heavy[i] || (ae.kind == KExpr::Kind::op && heavy[a]);
        if (ae.kind != KExpr::Kind::reduce) ops[i] = std::min(ops[i] + ops[a], 64);
      }
      costly[i] = heavy[i] || ops[i] >= kScratchMinOps;
    }
    // Candidates: costly float exprs first needed in pass q and needed again later.
    // Row-invariant values (one per row, e.g. a per-row coefficient) are not kept.
    std::vector<int> first_need(ne, 0);
    std::vector<bool> cand(ne, false);
    const std::vector<bool> invariant = k_.row_invariant();
    for (size_t i = 0; i < ne; ++i) {
      for (int p = 1; p <= passes && !first_need[i]; ++p)
        if (r.needed[p][i]) first_need[i] = p;
      if (!costly[i] || invariant[i] || !ir::is_float(k_.exprs[i].dtype) || !first_need[i]) continue;
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
        for (const KStore& s : k_.stores)
          direct = direct || (s.expr == static_cast<int>(i) && level_[s.expr] == p - 1);
        for (size_t c = i + 1; c < ne && !direct; ++c) {
          const KExpr& ce = k_.exprs[c];
          if (std::find(ce.args.begin(), ce.args.end(), static_cast<int>(i)) == ce.args.end()) continue;
          if (ce.kind == KExpr::Kind::reduce) direct = direct || level_[c] == p;
          else if (r.needed[p][c]) direct = direct || !(cand[c] && first_need[c] < p);
        }
        keep = direct;
      }
      keep_it[i] = keep;
    }
    int64_t bytes = 0;
    for (bool want_heavy : {true, false})
      for (size_t i = 0; i < ne; ++i) {
        if (!keep_it[i] || heavy[i] != want_heavy) continue;
        const int64_t b = row * static_cast<int64_t>(k_.exprs[i].dtype == DType::f64 ? 8 : 4);
        if (bytes + b > kScratchBytes) continue;
        bytes += b;
        r.first[i] = first_need[i];
      }
    if (bytes > 0) r.row = row;
    return r;
  }

  /// Row program (Kernel::is_row_program) for one kept point: pass p = 1..passes loops
  /// over the reduced dims, accumulating the level-p reduce expressions and the
  /// reduction stores of level p - 1 and writing the point stores of level p - 1; row
  /// stores are written once their level is finished (kernel_ir.h, evaluate_reference).
  void row_program_body(const std::vector<int>& red, std::vector<llvm::Value*>& idx) {
    const size_t ne = k_.exprs.size(), ns = k_.stores.size();
    auto varies = [&](const KStore& s) { return k_.varies_along_reduced(s); };
    const int passes = k_.row_passes();
    std::vector<llvm::Value*> known(ne, nullptr);
    // Row scratch: the values of the expressions row_scratch_plan picks are kept in a
    // stack array indexed by the position in the row during the first pass that computes
    // them and reloaded in later passes (a softmax's exp is computed once, not twice).
    const RowScratch scratch = row_scratch_plan(red);
    std::vector<llvm::Value*> scratch_buf(ne, nullptr);
    for (size_t i = 0; i < ne; ++i)
      if (scratch.first[i] > 0)
        scratch_buf[i] = entry_alloca(reg_type(k_.exprs[i].dtype), i64c(scratch.row));
    auto row_pos = [&] {
      llvm::Value* r = i64c(0);
      for (int d : red) r = B_.CreateNSWAdd(B_.CreateNSWMul(r, i64c(k_.domain[d])), idx[d]);
      return r;
    };
    auto row_stores = [&](int lvl) {
      std::vector<llvm::Value*> v;
      for (const KStore& s : k_.stores)
        if (s.reduce == ReduceKind::none && !varies(s) && level_[s.expr] == lvl) {
          if (v.empty()) v = eval(idx, &known, lvl + 1);
          store(s.param, idx, v[s.expr]);
        }
    };
    row_stores(0);
    for (int p = 1; p <= passes; ++p) {
      std::vector<llvm::Value*> acc(ne, nullptr), sacc(ns, nullptr), nan_seen(ne, nullptr);
      std::vector<llvm::Type*> ety(ne, nullptr), sty(ns, nullptr);
      for (size_t i = 0; i < ne; ++i) {
        const KExpr& e = k_.exprs[i];
        if (e.kind != KExpr::Kind::reduce || level_[i] != p) continue;
        ety[i] = acc_type_t(e.reduce, e.dtype, false);
        acc[i] = entry_alloca(ety[i], nullptr);
        B_.CreateStore(reduce_init_t(e.reduce, e.dtype, false), acc[i]);
        if (e.reduce == ReduceKind::max && ir::is_float(e.dtype)) {
          // Float max as maxnum (nnan, nsz: a reduction LLVM vectorizes) plus a separate
          // "saw a NaN" flag, so the result is still NaN when any element is.
          nan_seen[i] = entry_alloca(B_.getInt8Ty(), nullptr);
          B_.CreateStore(B_.getInt8(0), nan_seen[i]);
        }
      }
      for (size_t s = 0; s < ns; ++s) {
        const KStore& st = k_.stores[s];
        if (st.reduce == ReduceKind::none || level_[st.expr] != p - 1) continue;
        sty[s] = acc_type(st);
        sacc[s] = entry_alloca(sty[s], nullptr);
        B_.CreateStore(reduce_init(st), sacc[s]);
      }
      reduced_loops(red, 0, idx, [&] {
        std::vector<llvm::Value*> preset(ne, nullptr);
        llvm::Value* pos = scratch.row > 0 ? row_pos() : nullptr;
        for (size_t i = 0; i < ne; ++i)
          if (scratch_buf[i] && scratch.first[i] < p && scratch.needed[p][i]) {
            llvm::Type* t = reg_type(k_.exprs[i].dtype);
            preset[i] = B_.CreateLoad(t, B_.CreateInBoundsGEP(t, scratch_buf[i], pos));
          }
        std::vector<llvm::Value*> v = eval(idx, &known, p, &preset);
        for (size_t i = 0; i < ne; ++i)
          if (scratch_buf[i] && scratch.first[i] == p) {
            llvm::Type* t = reg_type(k_.exprs[i].dtype);
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
            B_.CreateStore(reduce_step_t(e.reduce, e.dtype, B_.CreateLoad(ety[i], acc[i]), x, true), acc[i]);
          }
        for (size_t s = 0; s < ns; ++s) {
          const KStore& st = k_.stores[s];
          if (level_[st.expr] != p - 1) continue;
          if (sacc[s]) B_.CreateStore(reduce_step(st, B_.CreateLoad(sty[s], sacc[s]), v[st.expr], true), sacc[s]);
          else if (st.reduce == ReduceKind::none && varies(st)) store(st.param, idx, v[st.expr]);
        }
      }, row_vector_width(k_.domain[red.back()]));
      for (size_t i = 0; i < ne; ++i)
        if (acc[i]) {
          const KExpr& e = k_.exprs[i];
          llvm::Value* r = B_.CreateLoad(ety[i], acc[i]);
          if (nan_seen[i])
            r = B_.CreateSelect(B_.CreateICmpNE(B_.CreateLoad(B_.getInt8Ty(), nan_seen[i]), B_.getInt8(0)),
                                qnan(ety[i]), r);
          llvm::Type* rt = reg_type(e.dtype);
          if (r->getType() != rt) r = B_.CreateFPTrunc(r, rt);
          known[i] = ir::is_float(e.dtype) ? round_to(e.dtype, r) : r;
        }
      for (size_t s = 0; s < ns; ++s)
        if (sacc[s]) store(k_.stores[s].param, idx, acc_result(k_.stores[s], B_.CreateLoad(sty[s], sacc[s])));
      row_stores(p);
    }
  }

  /// Split column reduction (Kernel::column_split_parts = K > 0). Split by columns, a
  /// column reduction over few columns gives every thread a part of each row, and both
  /// threads' hardware prefetchers then stream about the whole matrix (Codegen/ColSum
  /// ran at 0.45-0.6 of copy bandwidth). Here fn(b, begin, end) with end <= K sums the
  /// row partitions [begin, end) of the flat reduced index (ir::column_sum_partitions:
  /// contiguous rows, from the shape alone) into the scratch buffer (buffers[params],
  /// CpuKernel::scratch_bytes: per store, K rows of the flat kept extent in the
  /// accumulator type; kept dims that did not merge loop around the column tiles);
  /// fn(b, K, K + 1) then folds each column's K partial results in partition order (the
  /// same reduce step) and stores them: the eager ReduceSum's and the reference's order.
  void split_column(const std::vector<int>& kept, const std::vector<int>& red, std::vector<llvm::Value*>& idx,
                    int64_t parts, CpuKernel& ck) {
    auto* ptr = llvm::PointerType::getUnqual(C_);
    const int inner = kept.back();
    int64_t rows = 1, cols = 1;
    for (int d : red) rows *= k_.domain[d];
    for (int d : kept) cols *= k_.domain[d];
    llvm::Value* scratch = B_.CreateLoad(
        ptr, B_.CreateConstInBoundsGEP1_64(ptr, buffers_, static_cast<uint64_t>(k_.params.size())), "scratch");
    std::vector<llvm::Type*> ty;
    std::vector<llvm::Value*> base;  // per store: its K x cols partial rows, 8-byte aligned
    int64_t bytes = 0;
    for (const KStore& s : k_.stores) {
      ty.push_back(acc_type(s));
      base.push_back(B_.CreateConstInBoundsGEP1_64(B_.getInt8Ty(), scratch, static_cast<uint64_t>(bytes)));
      const int64_t width = (static_cast<int64_t>(ty.back()->getPrimitiveSizeInBits()) + 7) / 8;  // i1: 1 byte
      bytes += (parts * cols * width + 7) / 8 * 8;
    }
    ck.parallel_dim = red[0];
    ck.parallel_extent = parts;
    ck.split_parts = parts;
    ck.scratch_bytes = bytes;
    // The flat (row-major) index of the kept point in idx.
    auto flat_kept = [&] {
      llvm::Value* f = i64c(0);
      for (int d : kept) f = B_.CreateNSWAdd(B_.CreateNSWMul(f, i64c(k_.domain[d])), idx[d]);
      return f;
    };
    // Loops over the kept dims but the innermost, then body.
    std::function<void(size_t, const std::function<void()>&)> outer_kept = [&](size_t ki,
                                                                                const std::function<void()>& body) {
      if (ki + 1 >= kept.size()) {
        body();
        return;
      }
      for_range(i64c(0), i64c(k_.domain[kept[ki]]), [&](llvm::Value* i) {
        idx[kept[ki]] = i;
        outer_kept(ki + 1, body);
      });
      idx[kept[ki]] = nullptr;
    };
    llvm::BasicBlock* partial = llvm::BasicBlock::Create(C_, "split.partial", F_);
    llvm::BasicBlock* combine = llvm::BasicBlock::Create(C_, "split.combine", F_);
    llvm::BasicBlock* done = llvm::BasicBlock::Create(C_, "split.end");
    B_.CreateCondBr(B_.CreateICmpSGE(begin_, i64c(parts)), combine, partial);
    B_.SetInsertPoint(partial);
    for_range(begin_, end_, [&](llvm::Value* p) {
      llvm::Value* lo = B_.CreateSDiv(B_.CreateNSWMul(p, i64c(rows)), i64c(parts));
      llvm::Value* hi = B_.CreateSDiv(B_.CreateNSWMul(B_.CreateNSWAdd(p, i64c(1)), i64c(rows)), i64c(parts));
      llvm::Value* row0 = B_.CreateNSWMul(p, i64c(cols));
      outer_kept(0, [&] {
        column_tile_loops(inner, red, idx, i64c(0), i64c(k_.domain[inner]), {lo, hi}, [&](size_t s, llvm::Value* acc) {
          B_.CreateStore(acc, B_.CreateInBoundsGEP(ty[s], base[s], B_.CreateNSWAdd(row0, flat_kept())));
        });
        idx[inner] = nullptr;
      });
    });
    B_.CreateBr(done);
    B_.SetInsertPoint(combine);
    outer_kept(0, [&] {
      for_range(i64c(0), i64c(k_.domain[inner]), [&](llvm::Value* j) {
        idx[inner] = j;
        llvm::Value* col = flat_kept();
        for (size_t s = 0; s < k_.stores.size(); ++s) {
          llvm::Value* acc = entry_alloca(ty[s], nullptr);
          B_.CreateStore(B_.CreateLoad(ty[s], B_.CreateInBoundsGEP(ty[s], base[s], col)), acc);
          for_range(i64c(1), i64c(parts), [&](llvm::Value* q) {
            llvm::Value* x = B_.CreateLoad(
                ty[s], B_.CreateInBoundsGEP(ty[s], base[s], B_.CreateNSWAdd(B_.CreateNSWMul(q, i64c(cols)), col)));
            B_.CreateStore(reduce_step(k_.stores[s], B_.CreateLoad(ty[s], acc), x, false), acc);
          });
          store(k_.stores[s].param, idx, acc_result(k_.stores[s], B_.CreateLoad(ty[s], acc)));
        }
      });
      idx[inner] = nullptr;
    });
    B_.CreateBr(done);
    done->insertInto(F_);
    B_.SetInsertPoint(done);
  }

  /// Column mode: the innermost (kept) dim in tiles of kTile accumulators on the stack.
  void column_tiles(const std::vector<int>& kept, const std::vector<int>& red, std::vector<llvm::Value*>& idx) {
    const int inner = kept.back();
    column_tile_loops(inner, red, idx, range_lo(inner, kept[0]), range_hi(inner, kept[0]), {nullptr, nullptr},
                      [&](size_t s, llvm::Value* acc) {
                        store(k_.stores[s].param, idx, acc_result(k_.stores[s], acc));
                      });
  }
  /// Columns [lo, hi) of the innermost dim `inner` in tiles of kTile stack accumulators,
  /// the reduced dims outside the tile loop (only the flat reduced indices [rows.first,
  /// rows.second) when given: a row partition of a split reduction); each
  /// finished accumulator goes to finish(store, value) with idx[inner] at its column.
  void column_tile_loops(int inner, const std::vector<int>& red, std::vector<llvm::Value*>& idx, llvm::Value* lo,
                         llvm::Value* hi, std::pair<llvm::Value*, llvm::Value*> rows,
                         const std::function<void(size_t, llvm::Value*)>& finish) {
    std::vector<llvm::Value*> acc;
    std::vector<llvm::Type*> ty;
    for (const KStore& s : k_.stores) {
      ty.push_back(acc_type(s));
      acc.push_back(entry_alloca(ty.back(), i64c(kTile)));
    }
    llvm::Value* n = B_.CreateSub(hi, lo);
    llvm::Value* ntiles = B_.CreateSDiv(B_.CreateAdd(n, i64c(kTile - 1)), i64c(kTile));
    for_range(i64c(0), ntiles, [&](llvm::Value* t) {
      llvm::Value* t0 = B_.CreateNSWAdd(lo, B_.CreateNSWMul(t, i64c(kTile)));
      llvm::Value* rem = B_.CreateSub(hi, t0);
      llvm::Value* w = B_.CreateSelect(B_.CreateICmpSLT(rem, i64c(kTile)), rem, i64c(kTile));
      for_range(i64c(0), w, [&](llvm::Value* j) {
        for (size_t s = 0; s < acc.size(); ++s)
          B_.CreateStore(reduce_init(k_.stores[s]), B_.CreateInBoundsGEP(ty[s], acc[s], j));
      });
      auto reduce_body =
          [&] {
            for_range(i64c(0), w, [&](llvm::Value* j) {
              idx[inner] = B_.CreateNSWAdd(t0, j);
              std::vector<llvm::Value*> v = eval(idx);
              for (size_t s = 0; s < acc.size(); ++s) {
                llvm::Value* slot = B_.CreateInBoundsGEP(ty[s], acc[s], j);
                B_.CreateStore(reduce_step(k_.stores[s], B_.CreateLoad(ty[s], slot), v[k_.stores[s].expr], false),
                               slot);
              }
            });
          };
      if (rows.first) flat_reduced_loop(red, idx, rows.first, rows.second, reduce_body);
      else reduced_loops(red, 0, idx, reduce_body);
      for_range(i64c(0), w, [&](llvm::Value* j) {
        idx[inner] = B_.CreateNSWAdd(t0, j);
        for (size_t s = 0; s < acc.size(); ++s) finish(s, B_.CreateLoad(ty[s], B_.CreateInBoundsGEP(ty[s], acc[s], j)));
      });
      idx[inner] = nullptr;
    });
  }

  llvm::LLVMContext& C_;
  llvm::Module& M_;
  Kernel k_;
  llvm::IRBuilder<> B_;
  std::string cpu_, feats_, fn_name_;
  llvm::Type* i64_ = nullptr;
  llvm::Function* F_ = nullptr;
  llvm::BasicBlock* entry_ = nullptr;
  llvm::Value* begin_ = nullptr;
  llvm::Value* end_ = nullptr;
  llvm::Value* buffers_ = nullptr;
  std::vector<llvm::Value*> base_;
  std::vector<int> level_;  ///< Kernel::expr_levels()
};

/// Host target machine (cpu, features, O3 codegen).
Expected<std::unique_ptr<llvm::TargetMachine>> host_target_machine(llvm::orc::JITTargetMachineBuilder& jtmb) {
  auto tm = jtmb.createTargetMachine();
  if (!tm) return Status::error("LLVM: cannot create the host target machine: " + llvm_error(tm.takeError()));
  return std::move(*tm);
}

Expected<llvm::orc::JITTargetMachineBuilder> host_jtmb() {
  init_native_target();
  auto jtmb = llvm::orc::JITTargetMachineBuilder::detectHost();
  if (!jtmb) return Status::error("LLVM: cannot detect the host target: " + llvm_error(jtmb.takeError()));
  jtmb->setCPU(llvm::sys::getHostCPUName().str());
  jtmb->setCodeGenOptLevel(llvm::CodeGenOpt::Aggressive);
  return std::move(*jtmb);
}

/// Verifies, collapses and emits `kernels` into `m`; returns their schedules.
Expected<std::vector<CpuKernel>> emit_module(const std::vector<Kernel>& kernels, llvm::Module& m,
                                             const std::string& cpu, const std::string& feats,
                                             std::vector<int>* alias_of = nullptr,
                                             const std::vector<std::string>* fn_names = nullptr) {
  std::set<std::string> names;
  std::map<std::string, int> by_key;  // structure_key -> first kernel with it
  std::vector<CpuKernel> out;
  for (size_t i = 0; i < kernels.size(); ++i) {
    const Kernel& k = kernels[i];
    KILN_RETURN_IF_ERROR(k.verify());
    if (!names.insert(k.name).second) return Status::error("kernel '" + k.name + "': duplicate kernel name");
    Kernel c = collapse_dims(k);
    if (alias_of) {
      // Structurally equal kernels (the AdamW update of same-shaped parameters, ...)
      // share one generated function.
      auto [it, fresh] = by_key.emplace(structure_key(c), static_cast<int>(i));
      alias_of->push_back(fresh ? -1 : it->second);
      if (!fresh) {
        CpuKernel ck = out[it->second];
        ck.name = k.name;
        out.push_back(ck);
        continue;
      }
    }
    KernelEmitter em(m, c, cpu, feats, fn_names ? (*fn_names)[i] : std::string());
    out.push_back(em.emit());
  }
  std::string err;
  llvm::raw_string_ostream os(err);
  if (llvm::verifyModule(m, &os))
    return Status::error("kernel module (first kernel '" + (kernels.empty() ? std::string() : kernels[0].name) +
                         "'): LLVM verifier: " + os.str());
  return out;
}

std::string print_module(const llvm::Module& m) {
  std::string s;
  llvm::raw_string_ostream os(s);
  m.print(os, nullptr);
  return os.str();
}

class CpuModuleImpl : public CpuModule {
 public:
  const std::vector<CpuKernel>& kernels() const override { return kernels_; }
  const std::string& llvm_ir() const override { return ir_; }
  const CpuCompileStats& stats() const override { return stats_; }

  std::unique_ptr<llvm::orc::LLJIT> jit;
  std::vector<CpuKernel> kernels_;
  std::string ir_;
  CpuCompileStats stats_;
};

}  // namespace

namespace {

/// Host target machine for object emission: PIC relocations (links into PIE executables),
/// small code model, O3 code generation.
Expected<std::unique_ptr<llvm::TargetMachine>> object_target_machine() {
  KILN_ASSIGN_OR_RETURN(auto jtmb, host_jtmb());
  jtmb.setRelocationModel(llvm::Reloc::PIC_);
  jtmb.setCodeModel(llvm::CodeModel::Small);
  return host_target_machine(jtmb);
}

/// Runs LLVM's O3 module pipeline (no unrolling, loop and SLP vectorizers on).
void optimize_o3(llvm::Module& m, llvm::TargetMachine& tm) {
  llvm::LoopAnalysisManager lam;
  llvm::FunctionAnalysisManager fam;
  llvm::CGSCCAnalysisManager cgam;
  llvm::ModuleAnalysisManager mam;
  llvm::PipelineTuningOptions pto;
  pto.LoopVectorization = true;
  pto.SLPVectorization = true;
  pto.LoopUnrolling = false;  // vector loops stay compact: most of the compile time was unrolled code
  llvm::PassBuilder pb(&tm, pto);
  fam.registerPass([&] { return tm.getTargetIRAnalysis(); });
  pb.registerModuleAnalyses(mam);
  pb.registerCGSCCAnalyses(cgam);
  pb.registerFunctionAnalyses(fam);
  pb.registerLoopAnalyses(lam);
  pb.crossRegisterProxies(lam, fam, cgam, mam);
  llvm::ModulePassManager mpm = pb.buildPerModuleDefaultPipeline(llvm::OptimizationLevel::O3);
  mpm.run(m, mam);
}

/// Machine code of `m` as an ELF relocatable object.
Expected<std::string> emit_object(llvm::Module& m, llvm::TargetMachine& tm, const std::string& what) {
  llvm::SmallVector<char, 0> buf;
  llvm::raw_svector_ostream os(buf);
  llvm::legacy::PassManager pm;
  if (tm.addPassesToEmitFile(pm, os, nullptr, llvm::CGFT_ObjectFile))
    return Status::error("LLVM: the host target cannot emit object files (" + what + ")");
  pm.run(m);
  return std::string(buf.data(), buf.size());
}

bool is_c_identifier(const std::string& s) {
  if (s.empty() || std::isdigit(static_cast<unsigned char>(s[0]))) return false;
  for (char c : s)
    if (!(std::isalnum(static_cast<unsigned char>(c)) || c == '_')) return false;
  return true;
}

/// compile_cpu_object with a naming rule: symbol of kernel i (raw = the kernel's own name).
Expected<CpuObject> compile_object(const std::vector<Kernel>& kernels, const std::string* prefix) {
  using clock = std::chrono::steady_clock;
  CpuObject obj;
  obj.stats.num_kernels = static_cast<int>(kernels.size());
  KILN_ASSIGN_OR_RETURN(auto tm, object_target_machine());
  const std::string cpu = tm->getTargetCPU().str(), feats = tm->getTargetFeatureString().str();

  std::vector<std::string> names;
  for (size_t i = 0; i < kernels.size(); ++i) {
    if (!prefix) {
      names.push_back(kernels[i].name);
      continue;
    }
    std::string n = *prefix + std::to_string(i) + "_" + kernels[i].name;
    for (size_t c = prefix->size(); c < n.size(); ++c)
      if (!(std::isalnum(static_cast<unsigned char>(n[c])) || n[c] == '_')) n[c] = '_';
    names.push_back(std::move(n));
  }

  auto t0 = clock::now();
  llvm::LLVMContext ctx;
  quiet_diagnostics(ctx);
  llvm::Module m("kiln_cpu", ctx);
  m.setTargetTriple(tm->getTargetTriple().str());
  m.setDataLayout(tm->createDataLayout());
  std::vector<int> alias_of;
  KILN_ASSIGN_OR_RETURN(obj.kernels, emit_module(kernels, m, cpu, feats, &alias_of, &names));
  obj.stats.emit_s = seconds_since(t0);
  int unique = 0;
  for (size_t i = 0; i < kernels.size(); ++i) {
    obj.symbols.push_back(alias_of[i] >= 0 ? obj.symbols[alias_of[i]] : names[i]);
    unique += alias_of[i] < 0;
  }
  obj.stats.num_unique = unique;

  t0 = clock::now();
  optimize_o3(m, *tm);
  obj.llvm_ir = print_module(m);
  obj.stats.optimize_s = seconds_since(t0);

  t0 = clock::now();
  KILN_ASSIGN_OR_RETURN(obj.object, emit_object(m, *tm, kernels.empty() ? "empty module" : "first kernel '" + kernels[0].name + "'"));
  obj.stats.codegen_s = seconds_since(t0);
  return obj;
}

}  // namespace

Expected<CpuObject> compile_cpu_object(const std::vector<Kernel>& kernels, const CpuObjectOptions& opts) {
  return compile_object(kernels, &opts.symbol_prefix);
}

Expected<std::unique_ptr<CpuModule>> load_cpu_object(const CpuObject& obj) {
  const auto t0 = std::chrono::steady_clock::now();
  if (obj.symbols.size() != obj.kernels.size())
    return Status::error("kernel object: " + std::to_string(obj.symbols.size()) + " symbols for " +
                         std::to_string(obj.kernels.size()) + " kernels");
  auto mod = std::make_unique<CpuModuleImpl>();
  mod->kernels_ = obj.kernels;
  mod->ir_ = obj.llvm_ir;
  mod->stats_ = obj.stats;
  if (obj.kernels.empty()) return std::unique_ptr<CpuModule>(std::move(mod));
  KILN_ASSIGN_OR_RETURN(auto jtmb, host_jtmb());
  auto jit = llvm::orc::LLJITBuilder().setJITTargetMachineBuilder(std::move(jtmb)).create();
  if (!jit) return Status::error("LLVM: cannot create LLJIT: " + llvm_error(jit.takeError()));
  llvm::orc::JITDylib& jd = (*jit)->getMainJITDylib();
  auto gen = llvm::orc::DynamicLibrarySearchGenerator::GetForCurrentProcess((*jit)->getDataLayout().getGlobalPrefix());
  if (!gen) return Status::error("LLVM: process symbol search: " + llvm_error(gen.takeError()));
  jd.addGenerator(std::move(*gen));
  llvm::orc::SymbolMap syms;
  syms[(*jit)->mangleAndIntern("kiln_cpu_ipow")] = llvm::JITEvaluatedSymbol(
      llvm::pointerToJITTargetAddress(&kiln_cpu_ipow), llvm::JITSymbolFlags::Exported | llvm::JITSymbolFlags::Callable);
  if (auto err = jd.define(llvm::orc::absoluteSymbols(std::move(syms))))
    return Status::error("LLVM: cannot define runtime symbols: " + llvm_error(std::move(err)));
  if (auto err = (*jit)->addObjectFile(llvm::MemoryBuffer::getMemBufferCopy(obj.object, "kiln_cpu.o")))
    return Status::error("LLVM: cannot add the kernel object: " + llvm_error(std::move(err)));
  std::map<std::string, CpuKernelFn> by_symbol;
  for (size_t i = 0; i < mod->kernels_.size(); ++i) {
    CpuKernel& ck = mod->kernels_[i];
    auto it = by_symbol.find(obj.symbols[i]);
    if (it == by_symbol.end()) {
      auto addr = (*jit)->lookup(obj.symbols[i]);
      if (!addr)
        return Status::error("kernel '" + ck.name + "': JIT link of symbol '" + obj.symbols[i] +
                             "' failed: " + llvm_error(addr.takeError()));
      it = by_symbol.emplace(obj.symbols[i], addr->toPtr<CpuKernelFn>()).first;
    }
    ck.fn = it->second;
  }
  mod->stats_.num_unique = static_cast<int>(by_symbol.size());
  mod->jit = std::move(*jit);
  mod->stats_.codegen_s += seconds_since(t0);
  return std::unique_ptr<CpuModule>(std::move(mod));
}

Expected<std::unique_ptr<CpuModule>> compile_cpu(const std::vector<Kernel>& kernels) {
  KILN_ASSIGN_OR_RETURN(CpuObject obj, compile_object(kernels, nullptr));
  return load_cpu_object(obj);
}

Expected<std::string> emit_aot_data_object(const std::vector<std::pair<std::string, std::string>>& blobs,
                                           const std::string& table_symbol, const std::vector<std::string>& fn_symbols) {
  std::set<std::string> defined;
  auto define = [&](const std::string& s) -> Status {
    if (!is_c_identifier(s)) return Status::error("AOT data object: symbol '" + s + "' is not a C identifier");
    if (!defined.insert(s).second) return Status::error("AOT data object: symbol '" + s + "' defined twice");
    return Status::ok();
  };
  for (const auto& [name, bytes] : blobs) {
    KILN_RETURN_IF_ERROR(define(name));
    KILN_RETURN_IF_ERROR(define(name + "_size"));
  }
  KILN_RETURN_IF_ERROR(define(table_symbol));
  KILN_RETURN_IF_ERROR(define(table_symbol + "_count"));
  for (const std::string& f : fn_symbols) {
    if (!is_c_identifier(f)) return Status::error("AOT data object: function symbol '" + f + "' is not a C identifier");
    if (defined.count(f)) return Status::error("AOT data object: function symbol '" + f + "' clashes with a data symbol");
  }
  KILN_ASSIGN_OR_RETURN(auto tm, object_target_machine());
  llvm::LLVMContext ctx;
  llvm::Module m("kiln_aot_data", ctx);
  m.setTargetTriple(tm->getTargetTriple().str());
  m.setDataLayout(tm->createDataLayout());
  auto* i64 = llvm::Type::getInt64Ty(ctx);
  auto* ptr = llvm::PointerType::getUnqual(ctx);
  auto add_global = [&](const std::string& name, llvm::Constant* init, unsigned align) {
    auto* g = new llvm::GlobalVariable(m, init->getType(), /*isConstant=*/true, llvm::GlobalValue::ExternalLinkage,
                                       init, name);
    g->setAlignment(llvm::Align(align));
  };
  for (const auto& [name, bytes] : blobs) {
    add_global(name, llvm::ConstantDataArray::getString(ctx, bytes, /*AddNull=*/true), 64);
    add_global(name + "_size", llvm::ConstantInt::get(i64, bytes.size()), 8);
  }
  std::vector<llvm::Constant*> fns;
  auto* fty = llvm::FunctionType::get(llvm::Type::getVoidTy(ctx), false);
  for (const std::string& f : fn_symbols) {
    llvm::Function* fn = m.getFunction(f);
    if (!fn) fn = llvm::Function::Create(fty, llvm::Function::ExternalLinkage, f, m);
    fns.push_back(fn);
  }
  add_global(table_symbol, llvm::ConstantArray::get(llvm::ArrayType::get(ptr, fns.size()), fns), 8);
  add_global(table_symbol + "_count", llvm::ConstantInt::get(i64, fns.size()), 8);
  std::string err;
  llvm::raw_string_ostream os(err);
  if (llvm::verifyModule(m, &os)) return Status::error("AOT data object: LLVM verifier: " + os.str());
  return emit_object(m, *tm, "AOT data object");
}

Status verify_llvm_ir_text(const std::string& text) {
  llvm::LLVMContext ctx;
  llvm::SMDiagnostic diag;
  std::unique_ptr<llvm::Module> m = llvm::parseAssemblyString(text, diag, ctx);
  if (!m) {
    std::string msg;
    llvm::raw_string_ostream os(msg);
    diag.print("llvm_ir", os, /*ShowColors=*/false);
    os.flush();
    while (!msg.empty() && msg.back() == '\n') msg.pop_back();
    return Status::error("LLVM IR parse error: " + msg);
  }
  std::string err;
  llvm::raw_string_ostream os(err);
  if (llvm::verifyModule(*m, &os)) {
    os.flush();
    while (!err.empty() && err.back() == '\n') err.pop_back();
    return Status::error("LLVM verifier: " + err);
  }
  return Status::ok();
}


/// LLVM IR of `kernels` before optimization, for `cpu` and `feats` (the host's when null).
static Expected<std::string> emit_llvm_ir_for(const std::vector<Kernel>& kernels, const std::string* cpu,
                                              const std::string* feats) {
  KILN_ASSIGN_OR_RETURN(auto jtmb, host_jtmb());
  KILN_ASSIGN_OR_RETURN(auto tm, host_target_machine(jtmb));
  llvm::LLVMContext ctx;
  quiet_diagnostics(ctx);
  llvm::Module m("kiln_cpu", ctx);
  m.setTargetTriple(tm->getTargetTriple().str());
  m.setDataLayout(tm->createDataLayout());
  KILN_ASSIGN_OR_RETURN(auto ks, emit_module(kernels, m, cpu ? *cpu : tm->getTargetCPU().str(),
                                             feats ? *feats : tm->getTargetFeatureString().str()));
  (void)ks;
  return print_module(m);
}

Expected<std::string> emit_llvm_ir(const std::vector<Kernel>& kernels) {
  return emit_llvm_ir_for(kernels, nullptr, nullptr);
}

Expected<std::string> emit_llvm_ir(const std::vector<Kernel>& kernels, const std::string& cpu,
                                   const std::string& features) {
  return emit_llvm_ir_for(kernels, &cpu, &features);
}

std::string host_cpu_description() { return llvm::sys::getHostCPUName().str() + " " + host_features_string(); }

}  // namespace kiln::codegen
