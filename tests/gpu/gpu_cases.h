// Hand-built kernel-IR corpus shared by the CUDA compile tests (NVRTC, no GPU needed) and
// the device tests (run on a GPU, compared with codegen::evaluate_reference): pointwise
// f32/bf16/f16/f64/integer/bool kernels covering every ir::ScalarOp, broadcasts (0 strides),
// transposed and offset views, and row/column/middle/all sum and max reductions at odd
// sizes (1, 7, 1000003).
#pragma once
#include <string>
#include <utility>
#include <vector>

#include "codegen/kernel_ir.h"

namespace kiln::gputest {

using codegen::Kernel;
using codegen::KernelParam;
using codegen::KExpr;
using codegen::KStore;
using codegen::ReduceKind;
using ir::DType;
using ir::ScalarOp;

/// How a case's outputs are compared with the reference.
enum class Check {
  exact_or_rel,  ///< floats: |gpu - ref| <= rel*|ref| + abs; ints/bool exact; bf16/f16 within `ulps`
  sum_f64,       ///< f32 sums: |gpu - o64| <= 1e-5*|o64| + 1e-6*sum|terms| against an f64 oracle
};

/// One test kernel with input value ranges and its tolerance.
struct Case {
  Kernel k;
  std::vector<std::pair<double, double>> range;  ///< per param: uniform [lo, hi) (ints: integers in it)
  Check check = Check::exact_or_rel;
  double rel = 0, abs = 0;  ///< float tolerance of exact_or_rel
  int ulps = 0;             ///< bf16/f16 tolerance (bit distance)
  bool big = false;         ///< a 1000003-sized case
};

/// Small builder for kernels.
struct KB {
  Case c;
  KB(std::string name, std::vector<int64_t> domain, std::vector<bool> reduced = {}) {
    c.k.name = std::move(name);
    c.k.domain.assign(domain.begin(), domain.end());
    c.k.reduced = std::move(reduced);
  }
  int param(const std::string& name, DType dt, std::vector<int64_t> strides, bool out = false, int64_t offset = 0,
            std::pair<double, double> range = {-2, 2}) {
    c.range.push_back(range);
    return c.k.add_param(name, dt, {strides.begin(), strides.end()}, out, offset);
  }
  /// Dense row-major strides of the domain (an input read contiguously).
  std::vector<int64_t> dense() const {
    std::vector<int64_t> s(c.k.domain.size());
    int64_t m = 1;
    for (size_t d = s.size(); d-- > 0;) {
      s[d] = m;
      m *= codegen::static_extent(c.k.domain[d]);
    }
    return s;
  }
  /// Row-major strides over the kept dims, 0 along reduced ones (a reduction's output).
  std::vector<int64_t> kept_dense() const {
    std::vector<int64_t> s(c.k.domain.size(), 0);
    int64_t m = 1;
    for (size_t d = s.size(); d-- > 0;) {
      if (d < c.k.reduced.size() && c.k.reduced[d]) continue;
      s[d] = m;
      m *= codegen::static_extent(c.k.domain[d]);
    }
    return s;
  }
  int in(const std::string& name, DType dt, std::pair<double, double> range = {-2, 2}) {
    return param(name, dt, dense(), false, 0, range);
  }
  int load(int p) { return c.k.add_load(p); }
  int cst(double v, DType dt) { return c.k.add_constant(v, dt); }
  int op(ScalarOp o, std::vector<int> args, DType dt) { return c.k.add_op(o, std::move(args), dt); }
  /// New dense output holding expression `e` (pointwise).
  void out(const std::string& name, int e) {
    const int p = param(name, c.k.exprs[e].dtype, dense(), true);
    c.k.stores.push_back({p, e, ReduceKind::none});
  }
  /// New reduction output (row-major over kept dims) holding the sum/max of `e`.
  void red_out(const std::string& name, int e, ReduceKind r) {
    const int p = param(name, c.k.exprs[e].dtype, kept_dense(), true);
    c.k.stores.push_back({p, e, r});
  }
};

inline Case f32_binary(int64_t n) {
  KB b("f32_binary_" + std::to_string(n), {n});
  const int x = b.load(b.in("x", DType::f32)), y = b.load(b.in("y", DType::f32));
  const int xp = b.load(b.in("xp", DType::f32, {0.1, 3}));
  const ScalarOp ops[] = {ScalarOp::add, ScalarOp::sub, ScalarOp::mul, ScalarOp::div, ScalarOp::max, ScalarOp::min};
  for (ScalarOp o : ops) b.out(ir::scalar_op_name(o), b.op(o, {x, y}, DType::f32));
  b.out("pow", b.op(ScalarOp::pow, {xp, y}, DType::f32));
  // A constant and a chain (x * 0.5 + y) / 3 in separately rounded steps.
  const int h = b.op(ScalarOp::mul, {x, b.cst(0.5, DType::f32)}, DType::f32);
  b.out("chain", b.op(ScalarOp::div, {b.op(ScalarOp::add, {h, y}, DType::f32), b.cst(3, DType::f32)}, DType::f32));
  b.out("fma", b.op(ScalarOp::fma, {x, y, b.op(ScalarOp::neg, {h}, DType::f32)}, DType::f32));  // fmaf: one rounding
  b.c.rel = 1e-5;  // powf: CUDA vs glibc differ by a few ulp; the rest is exact (--fmad=false)
  b.c.abs = 1e-30;
  b.c.big = n > 100000;
  return b.c;
}

inline Case f32_unary(int64_t n) {
  KB b("f32_unary_" + std::to_string(n), {n});
  const int x = b.load(b.in("x", DType::f32, {-3, 3}));
  const int xp = b.load(b.in("xp", DType::f32, {0.01, 10}));
  const ScalarOp ops[] = {ScalarOp::neg,  ScalarOp::abs, ScalarOp::exp, ScalarOp::erf,
                          ScalarOp::tanh, ScalarOp::sin, ScalarOp::cos, ScalarOp::floor};
  for (ScalarOp o : ops) b.out(ir::scalar_op_name(o), b.op(o, {x}, DType::f32));
  b.out("log", b.op(ScalarOp::log, {xp}, DType::f32));
  b.out("sqrt", b.op(ScalarOp::sqrt, {xp}, DType::f32));
  // CUDA's expf/erff/tanhf/sinf/cosf/logf are within 2 ulp of the correctly rounded result,
  // glibc's within 1: 1e-5 relative is far above that; 1e-7 absolute for results near 0.
  b.c.rel = 1e-5;
  b.c.abs = 1e-7;
  b.c.big = n > 100000;
  return b.c;
}

inline Case f32_logic(int64_t n) {
  KB b("f32_logic_" + std::to_string(n), {n});
  const int x = b.load(b.in("x", DType::f32, {-3, 3})), y = b.load(b.in("y", DType::f32, {-3, 3}));
  const int lt = b.op(ScalarOp::lt, {x, y}, DType::boolean);
  const int ge = b.op(ScalarOp::ge, {x, y}, DType::boolean);
  const int fx = b.op(ScalarOp::floor, {x}, DType::f32), fy = b.op(ScalarOp::floor, {y}, DType::f32);
  const int eq = b.op(ScalarOp::eq, {fx, fy}, DType::boolean);
  b.out("lt", lt);
  b.out("le", b.op(ScalarOp::le, {fx, fy}, DType::boolean));
  b.out("gt", b.op(ScalarOp::gt, {x, y}, DType::boolean));
  b.out("ge", ge);
  b.out("eq", eq);
  b.out("and", b.op(ScalarOp::logical_and, {lt, eq}, DType::boolean));
  b.out("or", b.op(ScalarOp::logical_or, {lt, eq}, DType::boolean));
  b.out("xor", b.op(ScalarOp::logical_xor, {ge, eq}, DType::boolean));
  b.out("not", b.op(ScalarOp::logical_not, {eq}, DType::boolean));
  b.out("select", b.op(ScalarOp::select, {lt, x, y}, DType::f32));
  b.c.big = n > 100000;
  return b.c;
}

inline Case casts(int64_t n) {
  KB b("casts_" + std::to_string(n), {n});
  const int x = b.load(b.in("x", DType::f32, {-300, 300}));
  const int i = b.load(b.in("i", DType::i64, {-1000, 1000}));
  const int t = b.load(b.in("t", DType::boolean, {0, 2}));
  const int d = b.load(b.in("d", DType::f64, {-1e3, 1e3}));
  const DType xto[] = {DType::i64, DType::i32, DType::i8, DType::u8, DType::bf16, DType::f16, DType::f64};
  for (DType dt : xto) b.out(std::string("x_") + ir::dtype_name(dt), b.op(ScalarOp::cast, {x}, dt));
  const int z = b.op(ScalarOp::floor, {b.op(ScalarOp::div, {x, b.cst(100, DType::f32)}, DType::f32)}, DType::f32);
  b.out("z_bool", b.op(ScalarOp::cast, {z}, DType::boolean));
  const DType ito[] = {DType::f32, DType::bf16, DType::i8, DType::u8, DType::i32, DType::boolean, DType::f64};
  for (DType dt : ito) b.out(std::string("i_") + ir::dtype_name(dt), b.op(ScalarOp::cast, {i}, dt));
  b.out("t_f32", b.op(ScalarOp::cast, {t}, DType::f32));
  b.out("t_i64", b.op(ScalarOp::cast, {t}, DType::i64));
  b.out("d_f32", b.op(ScalarOp::cast, {d}, DType::f32));
  b.out("d_bf16", b.op(ScalarOp::cast, {d}, DType::bf16));
  b.out("d_i32", b.op(ScalarOp::cast, {d}, DType::i32));
  b.c.rel = 0;  // casts are exact on both sides
  b.c.abs = 0;
  b.c.ulps = 0;
  b.c.big = n > 100000;
  return b.c;
}

/// Every float op in a low-precision dtype (computed in f32, each result rounded).
inline Case lowp_ops(DType dt, int64_t n) {
  KB b(std::string(ir::dtype_name(dt)) + "_ops_" + std::to_string(n), {n});
  const int a = b.load(b.in("a", dt, {-2, 2})), c = b.load(b.in("c", dt, {-2, 2}));
  const int p = b.load(b.in("p", dt, {0.1, 3}));
  const ScalarOp bin[] = {ScalarOp::add, ScalarOp::sub, ScalarOp::mul, ScalarOp::div, ScalarOp::max, ScalarOp::min};
  for (ScalarOp o : bin) b.out(ir::scalar_op_name(o), b.op(o, {a, c}, dt));
  b.out("pow", b.op(ScalarOp::pow, {p, c}, dt));
  const ScalarOp un[] = {ScalarOp::neg,  ScalarOp::abs, ScalarOp::exp, ScalarOp::erf,
                         ScalarOp::tanh, ScalarOp::sin, ScalarOp::cos, ScalarOp::floor};
  for (ScalarOp o : un) b.out(ir::scalar_op_name(o), b.op(o, {a}, dt));
  b.out("log", b.op(ScalarOp::log, {p}, dt));
  b.out("sqrt", b.op(ScalarOp::sqrt, {p}, dt));
  // tanh(a * c + a): three roundings to dt.
  b.out("chain", b.op(ScalarOp::tanh, {b.op(ScalarOp::add, {b.op(ScalarOp::mul, {a, c}, dt), a}, dt)}, dt));
  b.out("lt", b.op(ScalarOp::lt, {a, c}, DType::boolean));
  b.out("to_f32", b.op(ScalarOp::cast, {a}, DType::f32));
  b.c.ulps = 1;  // the f32 result may differ by a few f32 ulp (transcendentals) -> 1 ulp after rounding
  b.c.big = n > 100000;
  return b.c;
}

inline Case int_ops(int64_t n) {
  KB b("int_ops_" + std::to_string(n), {n});
  const int a = b.load(b.in("a", DType::i64, {-50, 50})), c = b.load(b.in("c", DType::i64, {-5, 5}));
  const int e = b.load(b.in("e", DType::i64, {-2, 12}));
  const ScalarOp bin[] = {ScalarOp::add, ScalarOp::sub, ScalarOp::mul, ScalarOp::div, ScalarOp::max, ScalarOp::min};
  for (ScalarOp o : bin) b.out(ir::scalar_op_name(o), b.op(o, {a, c}, DType::i64));  // c holds zeros: x/0 = 0
  b.out("pow", b.op(ScalarOp::pow, {c, e}, DType::i64));
  b.out("neg", b.op(ScalarOp::neg, {a}, DType::i64));
  b.out("abs", b.op(ScalarOp::abs, {a}, DType::i64));
  b.out("lt", b.op(ScalarOp::lt, {a, c}, DType::boolean));
  b.out("eq", b.op(ScalarOp::eq, {c, b.cst(0, DType::i64)}, DType::boolean));
  // Narrow integers wrap: i32 over the full range, i8 and u8.
  const int w = b.load(b.in("w", DType::i32, {-2147483648.0, 2147483647.0}));
  const int v = b.load(b.in("v", DType::i32, {-2147483648.0, 2147483647.0}));
  b.out("i32_add", b.op(ScalarOp::add, {w, v}, DType::i32));
  b.out("i32_mul", b.op(ScalarOp::mul, {w, v}, DType::i32));
  b.out("i32_div", b.op(ScalarOp::div, {w, b.op(ScalarOp::cast, {c}, DType::i32)}, DType::i32));
  const int s8 = b.load(b.in("s8", DType::i8, {-128, 128}));
  b.out("i8_mul", b.op(ScalarOp::mul, {s8, s8}, DType::i8));
  b.out("i8_abs", b.op(ScalarOp::abs, {s8}, DType::i8));
  const int u8 = b.load(b.in("u8", DType::u8, {0, 256}));
  b.out("u8_sub", b.op(ScalarOp::sub, {u8, b.cst(200, DType::u8)}, DType::u8));
  b.c.big = n > 100000;
  return b.c;
}

inline Case bool_ops(int64_t n) {
  KB b("bool_ops_" + std::to_string(n), {n});
  const int p = b.load(b.in("p", DType::boolean, {0, 2})), q = b.load(b.in("q", DType::boolean, {0, 2}));
  b.out("and", b.op(ScalarOp::logical_and, {p, q}, DType::boolean));
  b.out("or", b.op(ScalarOp::logical_or, {p, q}, DType::boolean));
  b.out("xor", b.op(ScalarOp::logical_xor, {p, q}, DType::boolean));
  const int nq = b.op(ScalarOp::logical_not, {q}, DType::boolean);
  b.out("not", nq);
  b.out("select", b.op(ScalarOp::select, {p, q, nq}, DType::boolean));
  b.out("eq", b.op(ScalarOp::eq, {p, q}, DType::boolean));
  b.c.big = n > 100000;
  return b.c;
}

inline Case f64_ops(int64_t n) {
  KB b("f64_ops_" + std::to_string(n), {n});
  const int x = b.load(b.in("x", DType::f64, {-3, 3})), y = b.load(b.in("y", DType::f64, {-3, 3}));
  b.out("add", b.op(ScalarOp::add, {x, y}, DType::f64));
  b.out("div", b.op(ScalarOp::div, {x, y}, DType::f64));
  b.out("max", b.op(ScalarOp::max, {x, y}, DType::f64));
  b.out("exp", b.op(ScalarOp::exp, {x}, DType::f64));
  b.out("tanh", b.op(ScalarOp::tanh, {x}, DType::f64));
  b.c.rel = 1e-13;  // CUDA's double exp/tanh: 1-2 ulp
  b.c.abs = 1e-300;
  b.c.big = n > 100000;
  return b.c;
}

/// out[i, j] = x[i, j] * row[j] + col[i] (row and column vectors broadcast with 0 strides).
inline Case broadcast(int64_t m, int64_t n) {
  KB b("broadcast_" + std::to_string(m) + "x" + std::to_string(n), {m, n});
  const int x = b.load(b.in("x", DType::f32));
  const int r = b.load(b.param("row", DType::f32, {0, 1}));
  const int c = b.load(b.param("col", DType::f32, {1, 0}));
  const int s = b.load(b.param("scalar", DType::bf16, {0, 0}));
  const int sx = b.op(ScalarOp::cast, {s}, DType::f32);
  b.out("y", b.op(ScalarOp::add, {b.op(ScalarOp::mul, {x, r}, DType::f32), b.op(ScalarOp::mul, {c, sx}, DType::f32)},
                  DType::f32));
  b.c.big = m * n > 100000;
  return b.c;
}

/// Transposed read, an offset slice of a wider buffer, and a strided output (gaps stay untouched).
inline Case transposed(int64_t m, int64_t n) {
  KB b("transposed_" + std::to_string(m) + "x" + std::to_string(n), {m, n});
  const int xt = b.load(b.param("xt", DType::f32, {1, m}));                   // x is [n, m] in memory
  const int sl = b.load(b.param("slice", DType::f32, {n + 3, 1}, false, 5));  // [m, n+3] buffer, offset 5
  const int e = b.op(ScalarOp::sub, {xt, sl}, DType::f32);
  const int p = b.param("y_strided", DType::f32, {2 * n + 1, 2}, true, 1);
  b.c.k.stores.push_back({p, e, ReduceKind::none});
  const int q = b.param("y_t_bf16", DType::bf16, {1, m}, true);  // transposed write
  b.c.k.stores.push_back({q, b.op(ScalarOp::cast, {e}, DType::bf16), ReduceKind::none});
  return b.c;
}

/// sum over the inner dim of x[i, j] * w[j] (+ sum of squares, + max): row reductions.
inline Case row_reduce(int64_t m, int64_t r) {
  KB b("row_reduce_" + std::to_string(m) + "x" + std::to_string(r), {m, r}, {false, true});
  const int x = b.load(b.in("x", DType::f32, {0.5, 1.5}));
  const int w = b.load(b.param("w", DType::f32, {0, 1}, false, 0, {0.5, 1.5}));
  b.red_out("dot", b.op(ScalarOp::mul, {x, w}, DType::f32), ReduceKind::sum);
  b.red_out("sumsq", b.op(ScalarOp::mul, {x, x}, DType::f32), ReduceKind::sum);
  b.c.check = Check::sum_f64;
  b.c.big = m * r > 100000;
  return b.c;
}

inline Case row_max(int64_t m, int64_t r) {
  KB b("row_max_" + std::to_string(m) + "x" + std::to_string(r), {m, r}, {false, true});
  const int x = b.load(b.in("x", DType::f32, {-5, 5}));
  b.red_out("max", x, ReduceKind::max);
  const int hb = b.load(b.in("h", DType::bf16, {-5, 5}));
  b.red_out("max_bf16", hb, ReduceKind::max);
  b.red_out("sum_bf16", hb, ReduceKind::sum);  // f32 accumulation, one rounding: within 1 bf16 ulp
  b.c.ulps = 1;
  b.c.big = m * r > 100000;
  return b.c;
}

/// sum and max over the outer dim: column reductions (atomic split when f32 and R is long).
inline Case col_reduce(int64_t r, int64_t k) {
  KB b("col_reduce_" + std::to_string(r) + "x" + std::to_string(k), {r, k}, {true, false});
  const int x = b.load(b.in("x", DType::f32, {0.5, 1.5}));
  b.red_out("sum", x, ReduceKind::sum);
  b.red_out("sum_exp", b.op(ScalarOp::exp, {x}, DType::f32), ReduceKind::sum);
  b.c.check = Check::sum_f64;
  b.c.big = r * k > 100000;
  return b.c;
}

inline Case col_max(int64_t r, int64_t k) {
  KB b("col_max_" + std::to_string(r) + "x" + std::to_string(k), {r, k}, {true, false});
  const int x = b.load(b.in("x", DType::f32, {-5, 5}));
  b.red_out("max", x, ReduceKind::max);
  b.red_out("max_neg", b.op(ScalarOp::sub, {b.cst(-10, DType::f32), b.op(ScalarOp::abs, {x}, DType::f32)}, DType::f32),
            ReduceKind::max);  // all values negative: checks the -inf fill and the negative atomic path
  b.c.big = r * k > 100000;
  return b.c;
}

/// Integer and bf16 reductions: exact (ints) / 1 ulp (bf16); column, not atomic.
inline Case int_bf16_reduce(int64_t r, int64_t k) {
  KB b("int_bf16_reduce_" + std::to_string(r) + "x" + std::to_string(k), {r, k}, {true, false});
  const int i = b.load(b.in("i", DType::i64, {-1000, 1000}));
  b.red_out("isum", i, ReduceKind::sum);
  b.red_out("imax", i, ReduceKind::max);
  const int j = b.load(b.in("j", DType::i32, {-1000, 1000}));
  b.red_out("jmax", j, ReduceKind::max);
  const int h = b.load(b.in("h", DType::bf16, {-2, 2}));
  b.red_out("hsum", h, ReduceKind::sum);
  b.c.ulps = 1;
  b.c.big = r * k > 100000;
  return b.c;
}

/// Reduction over the middle dim of [a, r, c] (kept dims on both sides).
inline Case mid_reduce(int64_t a, int64_t r, int64_t c) {
  KB b("mid_reduce_" + std::to_string(a) + "x" + std::to_string(r) + "x" + std::to_string(c), {a, r, c},
       {false, true, false});
  const int x = b.load(b.in("x", DType::f32, {0.5, 1.5}));
  b.red_out("sum", x, ReduceKind::sum);
  b.c.check = Check::sum_f64;
  return b.c;
}

/// Every dim reduced: one output element.
inline Case all_reduce(int64_t n) {
  KB b("all_reduce_" + std::to_string(n), {n}, {true});
  const int x = b.load(b.in("x", DType::f32, {0.5, 1.5}));
  b.red_out("sum", x, ReduceKind::sum);
  b.c.check = Check::sum_f64;
  b.c.big = n > 100000;
  return b.c;
}

/// f64 column sum (atomicAdd on double).
inline Case col_f64(int64_t r, int64_t k) {
  KB b("col_f64_" + std::to_string(r) + "x" + std::to_string(k), {r, k}, {true, false});
  const int x = b.load(b.in("x", DType::f64, {-1, 1}));
  b.red_out("sum", x, ReduceKind::sum);
  b.c.rel = 1e-12;
  b.c.abs = 1e-12 * static_cast<double>(r);
  return b.c;
}

/// The whole corpus.
inline std::vector<Case> all_cases() {
  std::vector<Case> v;
  for (int64_t n : {int64_t(1), int64_t(7), int64_t(1000003)}) {
    v.push_back(f32_binary(n));
    v.push_back(f32_unary(n));
    v.push_back(f32_logic(n));
    v.push_back(casts(n));
    v.push_back(lowp_ops(DType::bf16, n));
    v.push_back(lowp_ops(DType::f16, n));
    v.push_back(int_ops(n));
    v.push_back(bool_ops(n));
    v.push_back(f64_ops(n));
    v.push_back(all_reduce(n));
  }
  v.push_back(broadcast(1, 1));
  v.push_back(broadcast(7, 131071));
  v.push_back(transposed(1, 7));
  v.push_back(transposed(129, 37));
  for (auto [m, r] : std::vector<std::pair<int64_t, int64_t>>{{1, 1}, {7, 7}, {1000, 257}, {3, 1000003}, {20000, 40}}) {
    v.push_back(row_reduce(m, r));
    v.push_back(row_max(m, r));
  }
  for (auto [r, k] : std::vector<std::pair<int64_t, int64_t>>{{1, 1}, {7, 7}, {513, 1000}, {1000003, 3}, {40, 20000}}) {
    v.push_back(col_reduce(r, k));
    v.push_back(col_max(r, k));
  }
  v.push_back(int_bf16_reduce(7, 7));
  v.push_back(int_bf16_reduce(4099, 33));
  v.push_back(mid_reduce(17, 1001, 33));
  v.push_back(mid_reduce(1, 7, 1));
  v.push_back(col_f64(1000, 300));
  return v;
}

}  // namespace kiln::gputest
