// Polynomial approximations of exp, erf and tanh as LLVM IR (see cpu_math.h).
#include "codegen/cpu/cpu_math.h"

#include <algorithm>
#include <cmath>

namespace kiln::codegen::cpu {

namespace {

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

}  // namespace

llvm::Value* MathEmitter::intrinsic(llvm::Intrinsic::ID id, std::vector<llvm::Value*> args) {
  llvm::Function* f = llvm::Intrinsic::getDeclaration(&M_, id, {args[0]->getType()});
  return B_.CreateCall(f, args);
}

/// a * b + c for polynomial steps: llvm.fmuladd, one FMA instruction where the host
/// CPU has FMA (one rounding, at least as accurate), a multiply and an add elsewhere.
llvm::Value* MathEmitter::muladd(llvm::Value* a, llvm::Value* b, llvm::Value* c) {
  return intrinsic(llvm::Intrinsic::fmuladd, {a, b, c});
}

llvm::Value* MathEmitter::libm(const std::string& name32, const std::string& name64, llvm::Value* x) {
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

/// An f32 literal (v rounded to float).
llvm::Constant* MathEmitter::f32c(double v) { return llvm::ConstantFP::get(B_.getFloatTy(), static_cast<float>(v)); }

/// sum_i m_i t^i (t: f32 or f64; coefficients rounded to t's type) as `groups` interleaved Horner chains over
/// consecutive blocks of s = ceil(n / groups) coefficients, joined by Horner's rule in t^s (a second-order Horner
/// scheme, Knuth TAOCP vol. 2, 4.6.4). The same multiply-adds as plain Horner plus the few multiplies for t^s, but a
/// dependency chain of about s + groups steps instead of n: erf's 18 terms as one chain were 72 cycles of FMA latency
/// per vector, which left GELU's loop waiting on latency rather than on its ports. (Estrin's scheme shortens the chain
/// further but needs a register copy per pair and spilled the constants.)
llvm::Value* MathEmitter::grouped_horner(llvm::Value* t, const std::vector<double>& m, size_t groups) {
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
llvm::Value* MathEmitter::horner_f32(llvm::Value* x, const std::vector<double>& m, double scale, double shift) {
  return grouped_horner(B_.CreateFAdd(B_.CreateFMul(x, f32c(scale)), f32c(shift)), m, 1);
}

/// erf of an f32 register value as straight-line f32 code the loop vectorizer widens
/// (libm's erff keeps a loop scalar: GELU's kernels ran at a tenth of the copy rate):
/// x g(x^2) with one polynomial (erf_poly) on |x| clamped to kErfOne, +-1 beyond, odd,
/// NaN kept; the polynomial in kErfGroups Horner chains (GELU ran 10-30% faster than
/// with one chain, single thread). About 25 vector instructions; an earlier two-range version (x g(x^2) below
/// 1, 1 - exp(-x^2) q(x) above, both evaluated for every lane) took about 60.
llvm::Value* MathEmitter::erff_poly(llvm::Value* x) {
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
llvm::Value* MathEmitter::tanhf_poly(llvm::Value* x) {
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
llvm::Value* MathEmitter::expf_poly(llvm::Value* x) {
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
llvm::Value* MathEmitter::exp_poly_f64(llvm::Value* x) {
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

}  // namespace kiln::codegen::cpu
