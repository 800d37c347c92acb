// Hand-made kernels for the codegen tests: a Kernel with the kernel IR's own builders
// (Kernel::add_*), plus output helpers, and the row programs (softmax, layer norm) that
// the CPU and CUDA emitter tests share. Used by kernel_ir_test.cpp, llvm_cpu_test.cpp,
// cuda_render_test.cpp and tests/gpu/cuda_row_test.cpp.
#pragma once
#include <string>
#include <utility>
#include <vector>

#include "codegen/kernel_ir.h"

namespace kiln::codegen::testing {

struct KB {
  Kernel k;
  explicit KB(std::string name, std::vector<int64_t> domain, std::vector<bool> reduced = {}) {
    k.name = std::move(name);
    k.domain.assign(domain.begin(), domain.end());
    k.reduced = std::move(reduced);
  }
  int param(const std::string& name, ir::DType dt, std::vector<int64_t> strides, bool out = false, int64_t offset = 0) {
    return k.add_param(name, dt, {strides.begin(), strides.end()}, out, offset);
  }
  int load(int p) { return k.add_load(p); }
  int cst(double v, ir::DType dt) { return k.add_constant(v, dt); }
  int op(ir::ScalarOp o, std::vector<int> args, ir::DType dt) { return k.add_op(o, std::move(args), dt); }
  void store(int p, int e, ReduceKind r = ReduceKind::none) { k.add_store(p, e, r); }
  /// Adds an output param with strides `strides` and stores expr e into it.
  int out(const std::string& name, int e, std::vector<int64_t> strides, ReduceKind r = ReduceKind::none) {
    int p = param(name, k.exprs[e].dtype, std::move(strides), true);
    k.add_store(p, e, r);
    return p;
  }
};

/// Softmax over the innermost dim of [rows, cols] in dtype t (computed in f32, f64 for
/// f64): max, sum of exp(x - max), exp(x - max) / sum, as reduce expressions.
inline Kernel row_softmax_kernel(const std::string& name, int64_t rows, int64_t cols, ir::DType t) {
  using ir::ScalarOp;
  KB b(name, {rows, cols}, {false, true});
  const ir::DType c = t == ir::DType::f64 ? ir::DType::f64 : ir::DType::f32;
  int x = b.load(b.param("x", t, {cols, 1}));
  if (c != t) x = b.op(ScalarOp::cast, {x}, c);
  int m = b.k.add_reduce(ReduceKind::max, x);
  int e = b.op(ScalarOp::exp, {b.op(ScalarOp::sub, {x, m}, c)}, c);
  int s = b.k.add_reduce(ReduceKind::sum, e);
  int y = b.op(ScalarOp::div, {e, s}, c);
  if (c != t) y = b.op(ScalarOp::cast, {y}, t);
  b.out("y", y, {cols, 1});
  return b.k;
}

/// LayerNormalization over the innermost dim with scale and bias in dtype t (computed in
/// f32); params x, scale, bias, y, then Mean and InvStdDev (f32) as row stores ([rows]
/// outputs, stride 0 along the row).
inline Kernel row_layernorm_kernel(const std::string& name, int64_t rows, int64_t cols, ir::DType t = ir::DType::f32) {
  using ir::ScalarOp;
  const ir::DType f = ir::DType::f32;
  KB b(name, {rows, cols}, {false, true});
  auto in = [&](const char* n, std::vector<int64_t> st) {
    int v = b.load(b.param(n, t, std::move(st)));
    return t == f ? v : b.op(ScalarOp::cast, {v}, f);
  };
  const int x = in("x", {cols, 1}), sc = in("scale", {0, 1}), bi = in("bias", {0, 1});
  const int n = b.cst(static_cast<double>(cols), f);
  const int mean = b.op(ScalarOp::div, {b.k.add_reduce(ReduceKind::sum, x), n}, f);
  const int d = b.op(ScalarOp::sub, {x, mean}, f);
  const int var = b.op(ScalarOp::div, {b.k.add_reduce(ReduceKind::sum, b.op(ScalarOp::mul, {d, d}, f)), n}, f);
  const int rstd =
      b.op(ScalarOp::div, {b.cst(1, f), b.op(ScalarOp::sqrt, {b.op(ScalarOp::add, {var, b.cst(1e-5, f)}, f)}, f)}, f);
  int y = b.op(ScalarOp::add, {b.op(ScalarOp::mul, {b.op(ScalarOp::mul, {d, rstd}, f), sc}, f), bi}, f);
  if (t != f) y = b.op(ScalarOp::cast, {y}, t);
  b.out("y", y, {cols, 1});
  b.out("mean", mean, {1, 0});
  b.out("rstd", rstd, {1, 0});
  return b.k;
}

}  // namespace kiln::codegen::testing
