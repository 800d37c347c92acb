// Internal to codegen/cpu: the transcendental functions of the generated CPU code.
//
// f32 exp, erf and tanh and f64 exp are emitted as inline straight-line polynomial code
// (within 1-3 ulp of the correctly rounded value, not bit-equal to libm) so that loops
// holding them vectorize (softmax rows, sigmoid, GELU); f64 erf and tanh call libm.
// The polynomials' coefficients are computed once, in long double, from Chebyshev fits.
#pragma once
#include <string>
#include <vector>

#include "llvm/IR/IRBuilder.h"
#include "llvm/IR/Intrinsics.h"
#include "llvm/IR/Module.h"

namespace kiln::codegen::cpu {

/// Emits math at the insert point of a builder that writes into a module's functions.
class MathEmitter {
 public:
  MathEmitter(llvm::Module& m, llvm::IRBuilder<>& b) : M_(m), B_(b) {}

  /// A call of the intrinsic `id` overloaded on the type of args[0].
  llvm::Value* intrinsic(llvm::Intrinsic::ID id, std::vector<llvm::Value*> args);
  /// a * b + c as llvm.fmuladd (one FMA where the host has FMA).
  llvm::Value* muladd(llvm::Value* a, llvm::Value* b, llvm::Value* c);
  /// A call of the libm function `name32` (f32 x) or `name64` (f64 x), declared readnone.
  llvm::Value* libm(const std::string& name32, const std::string& name64, llvm::Value* x);

  /// sum_i m_i t^i in `groups` interleaved Horner chains (t: f32 or f64).
  llvm::Value* grouped_horner(llvm::Value* t, const std::vector<double>& m, size_t groups);
  /// sum_i m_i t^i by Horner's rule at t = x * scale + shift (x: f32).
  llvm::Value* horner_f32(llvm::Value* x, const std::vector<double>& m, double scale, double shift);

  /// exp of an f32 value (Cephes' expf; within 1 ulp over [-104, 89], NaN kept).
  llvm::Value* expf_poly(llvm::Value* x);
  /// exp of an f64 value (degree-13 polynomial; about 1 ulp, NaN kept).
  llvm::Value* exp_poly_f64(llvm::Value* x);
  /// erf of an f32 value (x g(x^2) below 3.92, +-1 beyond; within 3 ulp, NaN kept).
  llvm::Value* erff_poly(llvm::Value* x);
  /// tanh of an f32 value (polynomial below 0.55, through expf_poly beyond; NaN kept).
  llvm::Value* tanhf_poly(llvm::Value* x);

 private:
  llvm::Constant* f32c(double v);

  llvm::Module& M_;
  llvm::IRBuilder<>& B_;
};

}  // namespace kiln::codegen::cpu
