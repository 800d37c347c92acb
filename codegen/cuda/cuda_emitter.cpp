// CUDA emitter: kernel IR -> CUDA C++ source + launch geometry (see cuda_emitter.h for
// the schedules and the numeric semantics).
#include "codegen/cuda/cuda_emitter.h"

#include <algorithm>
#include <cctype>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <functional>
#include <limits>
#include <set>
#include <sstream>

namespace kiln::codegen {
namespace {

using ir::DType;
using ir::ScalarOp;

constexpr int kBlock = 256;  // threads per block for every schedule
constexpr int kWarpsPerBlock = kBlock / 32;
constexpr int64_t kMaxGridX = 1 << 20;  // grid-stride loops cover the rest

bool is_ident(const std::string& s) {
  if (s.empty() || !(std::isalpha(static_cast<unsigned char>(s[0])) || s[0] == '_')) return false;
  for (char c : s)
    if (!(std::isalnum(static_cast<unsigned char>(c)) || c == '_')) return false;
  return true;
}

bool is_lowp(DType t) { return t == DType::bf16 || t == DType::f16; }
bool is_f32ish(DType t) { return t == DType::f32 || is_lowp(t); }

/// Storage (memory) C type.
const char* storage_type(DType t) {
  switch (t) {
    case DType::f32:
      return "float";
    case DType::f64:
      return "double";
    case DType::bf16:
      return "__nv_bfloat16";
    case DType::f16:
      return "__half";
    case DType::i64:
      return "long long";
    case DType::i32:
      return "int";
    case DType::i8:
      return "signed char";
    case DType::u8:
      return "unsigned char";
    case DType::boolean:
      return "unsigned char";
    default:
      return nullptr;
  }
}

/// Register (compute) C type.
const char* reg_type(DType t) {
  switch (t) {
    case DType::f32:
    case DType::bf16:
    case DType::f16:
      return "float";
    case DType::f64:
      return "double";
    case DType::boolean:
      return "bool";
    default:
      return storage_type(t);
  }
}

/// Reduction accumulator type.
const char* acc_type(DType t) {
  if (is_f32ish(t)) return "float";
  if (t == DType::f64) return "double";
  return "long long";
}

std::string acc_init(DType t, ReduceKind r) {
  if (r == ReduceKind::sum) return is_f32ish(t) ? "0.0f" : (t == DType::f64 ? "0.0" : "0LL");
  if (is_f32ish(t)) return "__int_as_float(0xff800000)";
  if (t == DType::f64) return "__longlong_as_double(0xfff0000000000000LL)";
  if (t == DType::i32) return "(-2147483647LL - 1)";
  if (t == DType::i8) return "-128LL";
  if (t == DType::u8) return "0LL";
  return "(-9223372036854775807LL - 1)";
}

/// Rounds a register value to dtype `t` (bf16/f16 rounding, integer wrap).
std::string round_to(DType t, const std::string& x) {
  switch (t) {
    case DType::bf16:
      return "kiln_rbf(" + x + ")";
    case DType::f16:
      return "kiln_rh(" + x + ")";
    case DType::f32:
    case DType::f64:
    case DType::boolean:
      return x;
    default:
      return std::string("(") + storage_type(t) + ")(" + x + ")";
  }
}

/// Register value -> storage value.
std::string to_storage(DType t, const std::string& x) {
  switch (t) {
    case DType::bf16:
      return "__float2bfloat16_rn(" + x + ")";
    case DType::f16:
      return "__float2half_rn(" + x + ")";
    case DType::boolean:
      return "(unsigned char)((" + x + ") ? 1 : 0)";
    default:
      return std::string("(") + storage_type(t) + ")(" + x + ")";
  }
}

std::string load_expr(DType t, const std::string& ptr, const std::string& off) {
  std::string e = ptr + "[" + off + "]";
  switch (t) {
    case DType::bf16:
      return "__bfloat162float(" + e + ")";
    case DType::f16:
      return "__half2float(" + e + ")";
    case DType::boolean:
      return "(" + e + " != 0)";
    default:
      return e;
  }
}

std::string hex_u32(uint32_t v) {
  char b[32];
  std::snprintf(b, sizeof b, "0x%08xu", v);
  return b;
}

std::string constant_expr(DType t, double v) {
  if (is_f32ish(t)) {
    float f = static_cast<float>(v);
    if (t == DType::bf16) f = ir::bf16_to_f32(ir::f32_to_bf16(f));
    if (t == DType::f16) f = ir::f16_to_f32(ir::f32_to_f16(f));
    uint32_t u;
    std::memcpy(&u, &f, 4);
    return "__uint_as_float(" + hex_u32(u) + ")";
  }
  if (t == DType::f64) {
    uint64_t u;
    std::memcpy(&u, &v, 8);
    char b[96];
    std::snprintf(b, sizeof b, "__longlong_as_double((long long)0x%016llxULL)", static_cast<unsigned long long>(u));
    return b;
  }
  if (t == DType::boolean) return v != 0 ? "true" : "false";
  int64_t i = std::isfinite(v) ? static_cast<int64_t>(v) : 0;
  char b[64];
  std::snprintf(b, sizeof b, "(%s)(long long)0x%016llxULL", storage_type(t), static_cast<unsigned long long>(i));
  return b;
}

std::string truth(DType t, const std::string& x) { return t == DType::boolean ? x : "(" + x + " != 0)"; }

/// C expression of one op; `a` holds the argument names, `ad` their dtypes. Semantics are
/// those of evaluate_reference (kernel_ir.cpp): integer arithmetic wraps to the width,
/// integer x/0 = 0, float max/min propagate NaN (else std::max/std::min), abs(x) = x < 0 ? -x : x,
/// float->int casts truncate and saturate (NaN -> 0).
Expected<std::string> op_expr(const Kernel& k, int idx, const KExpr& e, const std::vector<std::string>& a,
                              const std::vector<DType>& ad) {
  const DType rd = e.dtype;
  const DType t0 = ad.empty() ? rd : ad[0];
  const bool f32 = is_f32ish(t0), f64 = t0 == DType::f64, flt = f32 || f64;
  const std::string T = storage_type(t0) ? storage_type(t0) : "float";
  const std::string U = t0 == DType::i64 ? "unsigned long long" : "unsigned int";
  auto unary_math = [&](const char* fname) -> std::string {
    return std::string(fname) + (f32 ? "f(" : "(") + a[0] + ")";
  };
  auto wrap_bin = [&](const char* op) {
    return "(" + T + ")((" + U + ")" + a[0] + " " + op + " (" + U + ")" + a[1] + ")";
  };
  std::string r;
  switch (e.op) {
    case ScalarOp::add:
      r = flt ? a[0] + " + " + a[1] : wrap_bin("+");
      break;
    case ScalarOp::sub:
      r = flt ? a[0] + " - " + a[1] : wrap_bin("-");
      break;
    case ScalarOp::mul:
      r = flt ? a[0] + " * " + a[1] : wrap_bin("*");
      break;
    case ScalarOp::div:
      r = flt ? a[0] + " / " + a[1] : "(" + T + ")kiln_idiv(" + a[0] + ", " + a[1] + ")";
      break;
    case ScalarOp::pow:
      r = f32   ? "powf(" + a[0] + ", " + a[1] + ")"
          : f64 ? "pow(" + a[0] + ", " + a[1] + ")"
                : "(" + T + ")kiln_ipow(" + a[0] + ", " + a[1] + ")";
      break;
    case ScalarOp::max:
      r = f32   ? "kiln_maxf(" + a[0] + ", " + a[1] + ")"
          : f64 ? "kiln_maxd(" + a[0] + ", " + a[1] + ")"
                : "(" + a[0] + " < " + a[1] + " ? " + a[1] + " : " + a[0] + ")";
      break;
    case ScalarOp::min:
      r = f32   ? "kiln_minf(" + a[0] + ", " + a[1] + ")"
          : f64 ? "kiln_mind(" + a[0] + ", " + a[1] + ")"
                : "(" + a[1] + " < " + a[0] + " ? " + a[1] + " : " + a[0] + ")";
      break;
    case ScalarOp::neg:
      r = flt ? "-" + a[0] : "(" + T + ")((" + U + ")0 - (" + U + ")" + a[0] + ")";
      break;
    case ScalarOp::abs:
      r = flt ? "(" + a[0] + " < 0 ? -" + a[0] + " : " + a[0] + ")"
              : "(" + a[0] + " < 0 ? (" + T + ")((" + U + ")0 - (" + U + ")" + a[0] + ") : " + a[0] + ")";
      break;
    case ScalarOp::exp:
      r = unary_math("exp");
      break;
    case ScalarOp::log:
      r = unary_math("log");
      break;
    case ScalarOp::sqrt:
      r = unary_math("sqrt");
      break;
    case ScalarOp::erf:
      r = unary_math("erf");
      break;
    case ScalarOp::tanh:
      r = unary_math("tanh");
      break;
    case ScalarOp::sin:
      r = unary_math("sin");
      break;
    case ScalarOp::cos:
      r = unary_math("cos");
      break;
    case ScalarOp::floor:
      r = unary_math("floor");
      break;
    case ScalarOp::ceil:
      r = unary_math("ceil");
      break;
    case ScalarOp::round:
      r = unary_math("rint");
      break;  // round half to even
    case ScalarOp::fmod:
      r = flt ? std::string(f32 ? "fmodf(" : "fmod(") + a[0] + ", " + a[1] + ")"
              : "(" + T + ")kiln_imod(" + a[0] + ", " + a[1] + ")";
      break;
    case ScalarOp::lt:
      r = a[0] + " < " + a[1];
      break;
    case ScalarOp::le:
      r = a[0] + " <= " + a[1];
      break;
    case ScalarOp::gt:
      r = a[0] + " > " + a[1];
      break;
    case ScalarOp::ge:
      r = a[0] + " >= " + a[1];
      break;
    case ScalarOp::eq:
      r = a[0] + " == " + a[1];
      break;
    case ScalarOp::logical_and:
      r = truth(ad[0], a[0]) + " && " + truth(ad[1], a[1]);
      break;
    case ScalarOp::logical_or:
      r = truth(ad[0], a[0]) + " || " + truth(ad[1], a[1]);
      break;
    case ScalarOp::logical_xor:
      r = truth(ad[0], a[0]) + " != " + truth(ad[1], a[1]);
      break;
    case ScalarOp::logical_not:
      r = "!" + truth(ad[0], a[0]);
      break;
    case ScalarOp::select:
      r = truth(ad[0], a[0]) + " ? " + a[1] + " : " + a[2];
      break;
    case ScalarOp::fma:
      r = std::string(f64 ? "fma(" : "fmaf(") + a[0] + ", " + a[1] + ", " + a[2] + ")";
      break;
    case ScalarOp::cast: {
      if (rd == DType::boolean) {
        r = truth(t0, a[0]);
      } else if (is_f32ish(rd)) {
        r = t0 == DType::boolean ? a[0] + " ? 1.0f : 0.0f" : "(float)" + a[0];
      } else if (rd == DType::f64) {
        r = t0 == DType::boolean ? a[0] + " ? 1.0 : 0.0" : "(double)" + a[0];
      } else if (flt) {  // float -> integer: truncate, saturate to the target range, NaN -> 0
        const char* range = rd == DType::i32  ? "-2147483648.0, 2147483647.0, false"
                            : rd == DType::i8 ? "-128.0, 127.0, false"
                            : rd == DType::u8 ? "0.0, 255.0, false"
                                              : "-9223372036854775808.0, 9223372036854775807.0, true";
        r = "kiln_f2i((double)" + a[0] + ", " + range + ")";
      } else {
        r = a[0];  // integer/bool -> integer: wraps (round_to below)
      }
      break;
    }
    default:
      return Status::error("emit_cuda: kernel " + k.name + ": expression %e" + std::to_string(idx) +
                           ": unsupported scalar op " + ir::scalar_op_name(e.op));
  }
  return round_to(rd, "(" + r + ")");
}

/// Per-kernel emission state.
struct KernelEmitter {
  const Kernel& k;  // collapsed
  std::ostringstream os;
  std::string idx_t = "int";
  std::vector<bool> used_param;  // loaded or stored

  explicit KernelEmitter(const Kernel& kk) : k(kk) {}

  /// Declares i<d> for `dims` (outer -> inner) from the linear index `var`.
  void decompose(const std::string& ind, const std::string& var, const std::vector<int>& dims) {
    if (dims.empty()) return;
    os << ind << idx_t;
    for (size_t j = 0; j < dims.size(); ++j) os << (j ? ", i" : " i") << dims[j];
    os << ";\n" << ind << "{\n" << ind << "  " << idx_t << " q = (" << idx_t << ")(" << var << ");\n";
    for (size_t j = dims.size(); j-- > 0;) {
      const int d = dims[j];
      const int64_t ext = static_extent(k.domain[d]);
      if (j == 0) {
        os << ind << "  i" << d << " = q;\n";
      } else if (ext == 1) {
        os << ind << "  i" << d << " = 0;\n";
      } else {
        os << ind << "  i" << d << " = q % " << ext << "; q /= " << ext << ";\n";
      }
    }
    os << ind << "}\n";
  }

  /// sum of i_d * stride_d over `dims` for param p ("0" when none).
  std::string linear(int p, const std::vector<int>& dims) {
    std::string s;
    for (int d : dims) {
      const int64_t st = static_extent(k.params[p].strides[d]);
      if (st == 0 || static_extent(k.domain[d]) == 1) continue;
      if (!s.empty()) s += " + ";
      s += st == 1 ? "i" + std::to_string(d)
                   : "i" + std::to_string(d) + " * (" + idx_t + ")(" + std::to_string(st) + ")";
    }
    return s.empty() ? "0" : s;
  }

  /// Emits every expression (or those with only[i] set); offsets of param p are named
  /// off(p). A reduce expression emits nothing: its value is the row-scope register
  /// rv<i>, set by the row-program schedule once its pass has finished.
  Status exprs(const std::string& ind, const std::function<std::string(int)>& off,
               const std::vector<bool>* only = nullptr) {
    std::vector<std::string> names(k.exprs.size());
    for (size_t i = 0; i < k.exprs.size(); ++i) {
      const KExpr& e = k.exprs[i];
      names[i] = "v" + std::to_string(i);
      if (e.kind == KExpr::Kind::reduce) {
        names[i] = "rv" + std::to_string(i);
        continue;
      }
      if (only && !(*only)[i]) continue;
      std::string rhs;
      if (e.kind == KExpr::Kind::load) {
        rhs = load_expr(k.params[e.param].dtype, "p" + std::to_string(e.param), off(e.param));
        const KernelParam& q = k.params[e.param];
        std::string pred;  // a guarded load reads memory only inside its box
        for (size_t d = 0; d < q.guard_lo.size(); ++d) {
          if (q.guard_lo[d] == 0 && q.guard_hi[d] == static_extent(k.domain[d])) continue;
          const std::string id = "i" + std::to_string(d);
          pred += (pred.empty() ? "" : " && ") + std::string("(") + id + " < " + std::to_string(q.guard_hi[d]) +
                  (q.guard_lo[d] > 0 ? " && " + id + " >= " + std::to_string(q.guard_lo[d]) : "") + ")";
        }
        if (!pred.empty())
          rhs = "(" + pred + ") ? (" + rhs + ") : " + (e.args.empty() ? constant_expr(e.dtype, 0) : names[e.args[0]]);
      } else if (e.kind == KExpr::Kind::constant) {
        rhs = constant_expr(e.dtype, e.value);
      } else {
        std::vector<std::string> a;
        std::vector<DType> ad;
        for (int x : e.args) {
          a.push_back(names[x]);
          ad.push_back(k.exprs[x].dtype);
        }
        KILN_ASSIGN_OR_RETURN(rhs, op_expr(k, static_cast<int>(i), e, a, ad));
      }
      os << ind << "const " << reg_type(e.dtype) << " " << names[i] << " = " << rhs << ";\n";
    }
    return Status::ok();
  }
};

int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }

/// True when the elements param p's strides reach over `dims` form one dense range
/// [offset, offset + count).
bool dense_over(const Kernel& k, int p, const std::vector<int>& dims) {
  std::vector<std::pair<int64_t, int64_t>> se;  // (stride, extent)
  for (int d : dims) {
    if (static_extent(k.domain[d]) == 1) continue;
    if (static_extent(k.params[p].strides[d]) <= 0) return false;
    se.push_back({static_extent(k.params[p].strides[d]), static_extent(k.domain[d])});
  }
  std::sort(se.begin(), se.end());
  int64_t expect = 1;
  for (auto& [s, e] : se) {
    if (s != expect) return false;
    expect *= e;
  }
  return true;
}

/// C expression combining two reduction accumulators `a` and `b` of a `t` reduction.
std::string combine(ReduceKind r, DType t, const std::string& a, const std::string& b) {
  if (r == ReduceKind::sum) {
    if (ir::is_float(t)) return a + " + " + b;
    return "(long long)((unsigned long long)" + a + " + (unsigned long long)" + b + ")";  // wraps
  }
  if (is_f32ish(t)) return "kiln_rmaxf(" + a + ", " + b + ")";
  if (t == DType::f64) return "kiln_rmaxd(" + a + ", " + b + ")";
  return "(" + b + " > " + a + " ? " + b + " : " + a + ")";
}

/// Row program (Kernel::is_row_program): the passes of evaluate_reference, each over the
/// whole row. Pass p (1..passes) loops the row's elements (lanes / threads / one thread,
/// by schedule), accumulating the level-p reduce expressions and the reduction stores of
/// level p - 1 and writing the point stores of level p - 1; the accumulators are then
/// combined across the row's threads (xor-shuffle tree, which leaves the identical result
/// in every lane since + and max commute; row_block adds one shared-memory slot per warp,
/// which every thread folds in the same order) and each reduce expression's value is kept
/// in a register rv<i>, rounded to its dtype, for the later passes. Reduction stores and
/// row stores are written by the row's first thread once their level is known.
Status emit_row_program(KernelEmitter& em, const std::vector<int>& kept, const std::vector<int>& red, int64_t M,
                        int64_t R, bool row_like, CudaKernelInfo& info) {
  const Kernel& k = em.k;
  std::ostream& os = em.os;
  const size_t ne = k.exprs.size(), ns = k.stores.size();
  const std::vector<int> level = k.expr_levels();
  const std::vector<bool> inv = k.row_invariant();
  auto varies = [&](const KStore& s) { return k.varies_along_reduced(s); };  // a point store
  const int passes = k.row_passes();
  // Expressions needed for `roots` (reduce expressions are registers: not expanded).
  auto closure = [&](const std::vector<int>& roots) {
    std::vector<bool> need(ne, false);
    for (int r : roots) need[r] = true;
    for (size_t i = ne; i-- > 0;)
      if (need[i] && k.exprs[i].kind != KExpr::Kind::reduce)
        for (int a : k.exprs[i].args) need[a] = true;
    return need;
  };

  enum class Mode { warp, block, serial } mode = Mode::serial;
  if (row_like && R >= 32) mode = R >= 4096 && M < 2048 ? Mode::block : Mode::warp;
  std::string leader, r_start, r_step;
  switch (mode) {
    case Mode::warp:
      info.schedule = "row_warp";
      info.grid[0] = static_cast<unsigned>(std::clamp<int64_t>(ceil_div(M, kWarpsPerBlock), 1, kMaxGridX));
      os << "  const int lane = threadIdx.x & 31;\n"
         << "  for (long long row = (long long)blockIdx.x * " << kWarpsPerBlock << " + (threadIdx.x >> 5); row < " << M
         << "LL; row += (long long)gridDim.x * " << kWarpsPerBlock << ") {\n";
      leader = "lane == 0", r_start = "lane", r_step = "32";
      break;
    case Mode::block:
      info.schedule = "row_block";
      info.grid[0] = static_cast<unsigned>(std::clamp<int64_t>(M, 1, kMaxGridX));
      os << "  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;\n";
      for (size_t i = 0; i < ne; ++i)
        if (k.exprs[i].kind == KExpr::Kind::reduce)
          os << "  __shared__ " << acc_type(k.exprs[i].dtype) << " sh_ra" << i << "[" << kWarpsPerBlock << "];\n";
      for (size_t s = 0; s < ns; ++s)
        if (k.stores[s].reduce != ReduceKind::none)
          os << "  __shared__ " << acc_type(k.params[k.stores[s].param].dtype) << " sh_sa" << s << "[" << kWarpsPerBlock
             << "];\n";
      os << "  for (long long row = blockIdx.x; row < " << M << "LL; row += gridDim.x) {\n";
      leader = "threadIdx.x == 0", r_start = "threadIdx.x", r_step = "blockDim.x";
      break;
    case Mode::serial:
      info.schedule = "column";  // one thread per row, sequential passes
      info.grid[0] = static_cast<unsigned>(std::clamp<int64_t>(ceil_div(M, kBlock), 1, kMaxGridX));
      os << "  for (long long row = (long long)blockIdx.x * blockDim.x + threadIdx.x; row < " << M
         << "LL; row += (long long)gridDim.x * blockDim.x) {\n";
      r_start = "0", r_step = "1";
      break;
  }
  const std::string ind = "    ";
  em.decompose(ind, "row", kept);
  for (size_t p = 0; p < k.params.size(); ++p)
    os << ind << "const " << em.idx_t << " b" << p << " = (" << em.idx_t << ")(" << k.params[p].offset << ") + "
       << em.linear(static_cast<int>(p), kept) << ";\n";
  // A block run by the row's first thread (its own scope for expression names).
  auto open_leader = [&](const std::string& in) {
    os << in << (leader.empty() ? std::string("{\n") : "if (" + leader + ") {\n");
  };
  auto close_leader = [&](const std::string& in) { os << in << "}\n"; };
  // Row stores whose expression has level `lvl`, evaluated at the row's base offsets
  // (their loads have stride 0 along the reduced dims).
  auto row_stores = [&](int lvl) -> Status {
    std::vector<int> roots;
    for (const KStore& s : k.stores)
      if (s.reduce == ReduceKind::none && !varies(s) && level[s.expr] == lvl) roots.push_back(s.expr);
    if (roots.empty()) return Status::ok();
    const std::vector<bool> need = closure(roots);
    open_leader(ind);
    const std::string in2 = ind + "  ";
    KILN_RETURN_IF_ERROR(em.exprs(
        in2, [](int p) { return "b" + std::to_string(p); }, &need));
    for (const KStore& s : k.stores)
      if (s.reduce == ReduceKind::none && !varies(s) && level[s.expr] == lvl)
        os << in2 << "p" << s.param << "[b" << s.param << "] = "
           << to_storage(k.params[s.param].dtype,
                         (k.exprs[s.expr].kind == KExpr::Kind::reduce ? "rv" : "v") + std::to_string(s.expr))
           << ";\n";
    close_leader(ind);
    return Status::ok();
  };
  auto value_name = [&](int e) { return (k.exprs[e].kind == KExpr::Kind::reduce ? "rv" : "v") + std::to_string(e); };

  KILN_RETURN_IF_ERROR(row_stores(0));
  for (int p = 1; p <= passes; ++p) {
    // This pass's accumulators: (name, kind, dtype, value expression index).
    struct Acc {
      std::string name;
      ReduceKind r;
      DType t;
      int value;
    };
    std::vector<Acc> accs;
    std::vector<int> roots;
    for (size_t i = 0; i < ne; ++i)
      if (k.exprs[i].kind == KExpr::Kind::reduce && level[i] == p) {
        accs.push_back({"ra" + std::to_string(i), k.exprs[i].reduce, k.exprs[i].dtype, k.exprs[i].args[0]});
        roots.push_back(k.exprs[i].args[0]);
      }
    std::vector<int> point_stores;
    for (size_t s = 0; s < ns; ++s) {
      const KStore& st = k.stores[s];
      if (level[st.expr] != p - 1) continue;
      if (st.reduce != ReduceKind::none) {
        accs.push_back({"sa" + std::to_string(s), st.reduce, k.params[st.param].dtype, st.expr});
        roots.push_back(st.expr);
      } else if (varies(st)) {
        point_stores.push_back(static_cast<int>(s));
        roots.push_back(st.expr);
      }
    }
    const std::vector<bool> need = closure(roots);
    std::vector<bool> param_used(k.params.size(), false);
    for (size_t i = 0; i < ne; ++i)
      if (need[i] && !(R > 0 && inv[i]) && k.exprs[i].kind == KExpr::Kind::load) param_used[k.exprs[i].param] = true;
    for (int s : point_stores) param_used[k.stores[s].param] = true;

    // Row-invariant expressions are computed once, before the loop, at the row's base
    // offsets (their loads have stride 0 along the reduced dims); not for an empty row,
    // whose buffers may hold no element at all.
    std::vector<bool> hoist(ne, false), in_loop = need;
    for (size_t i = 0; i < ne; ++i)
      if (R > 0 && need[i] && inv[i] && k.exprs[i].kind != KExpr::Kind::reduce) hoist[i] = true, in_loop[i] = false;

    os << ind << "// pass " << p << " of " << passes << "\n";
    for (const Acc& a : accs) os << ind << acc_type(a.t) << " " << a.name << " = " << acc_init(a.t, a.r) << ";\n";
    // Unrolled by 4 at most: a fully unrolled short row would keep every loaded element
    // live across the passes (and across division/sqrt slow-path calls) and spill;
    const std::string in1 = ind + "  ", in2 = ind + "    ";
    os << ind << "{\n";
    KILN_RETURN_IF_ERROR(em.exprs(
        in1, [](int q) { return "b" + std::to_string(q); }, &hoist));
    // f64 transcendentals (CUDA's exp/log/... for double are long inline sequences) are
    // not unrolled at all: four copies in flight spill.
    bool f64_libm = false;
    for (size_t i = 0; i < ne; ++i) {
      const KExpr& e = k.exprs[i];
      if (in_loop[i] && e.kind == KExpr::Kind::op && e.dtype == DType::f64) switch (e.op) {
          case ScalarOp::exp:
          case ScalarOp::log:
          case ScalarOp::pow:
          case ScalarOp::erf:
          case ScalarOp::tanh:
          case ScalarOp::sin:
          case ScalarOp::cos:
            f64_libm = true;
            break;
          default:
            break;
        }
    }
    os << (f64_libm ? "#pragma unroll 1\n" : "#pragma unroll 4\n") << in1 << "for (long long r = " << r_start
       << "; r < " << R << "LL; r += " << r_step << ") {\n";
    em.decompose(in2, "r", red);
    for (size_t q = 0; q < k.params.size(); ++q)
      if (param_used[q])
        os << in2 << "const " << em.idx_t << " o" << q << " = b" << q << " + " << em.linear(static_cast<int>(q), red)
           << ";\n";
    KILN_RETURN_IF_ERROR(em.exprs(
        in2, [](int q) { return "o" + std::to_string(q); }, &in_loop));
    for (const Acc& a : accs)
      os << in2 << a.name << " = "
         << combine(a.r, a.t, a.name, std::string("(") + acc_type(a.t) + ")" + value_name(a.value)) << ";\n";
    for (int s : point_stores) {
      const KStore& st = k.stores[s];
      os << in2 << "p" << st.param << "[o" << st.param
         << "] = " << to_storage(k.params[st.param].dtype, value_name(st.expr)) << ";\n";
    }
    os << in1 << "}\n" << ind << "}\n";
    // Combine across the row's threads: afterwards every thread holds the row's result.
    if (mode != Mode::serial && !accs.empty()) {
      for (const Acc& a : accs)
        os << ind << a.name << " = " << (a.r == ReduceKind::sum ? "kiln_warp_sum" : "kiln_warp_max") << "(" << a.name
           << ");\n";
      if (mode == Mode::block) {
        for (const Acc& a : accs) os << ind << "if (lane == 0) sh_" << a.name << "[warp] = " << a.name << ";\n";
        os << ind << "__syncthreads();\n";
        for (const Acc& a : accs) {
          os << ind << a.name << " = sh_" << a.name << "[0];\n";
          os << ind << "for (int w = 1; w < " << kWarpsPerBlock << "; ++w) " << a.name << " = "
             << combine(a.r, a.t, a.name, "sh_" + a.name + "[w]") << ";\n";
        }
      }
    }
    // Reduce expressions of level p: rounded to their dtype, kept for later passes.
    for (size_t i = 0; i < ne; ++i)
      if (k.exprs[i].kind == KExpr::Kind::reduce && level[i] == p) {
        const DType t = k.exprs[i].dtype;
        os << ind << "const " << reg_type(t) << " rv" << i << " = "
           << round_to(t, std::string("(") + reg_type(t) + ")ra" + std::to_string(i)) << ";\n";
      }
    bool any_red_store = false;
    for (const Acc& a : accs) any_red_store |= a.name[0] == 's';
    if (any_red_store) {
      open_leader(ind);
      for (size_t s = 0; s < ns; ++s) {
        const KStore& st = k.stores[s];
        if (st.reduce == ReduceKind::none || level[st.expr] != p - 1) continue;
        os << ind << "  p" << st.param << "[b" << st.param
           << "] = " << to_storage(k.params[st.param].dtype, "sa" + std::to_string(s)) << ";\n";
      }
      close_leader(ind);
    }
    KILN_RETURN_IF_ERROR(row_stores(p));
  }
  // The shared slots are reused by the next row.
  if (mode == Mode::block) os << ind << "__syncthreads();\n";
  os << "  }\n}\n\n";
  return Status::ok();
}

Status emit_kernel(const Kernel& orig, std::ostringstream& out, CudaKernelInfo& info) {
  // Every extent and stride below is a constant (static_extent).
  if (orig.is_symbolic())
    return Status::error("emit_cuda: kernel " + orig.name + " has symbolic extents (" + orig.domain_size().to_string() +
                         " points); the CUDA emitter generates static kernels only");
  const Kernel k = collapse_dims(orig);
  const int rank = static_cast<int>(k.domain.size());
  KernelEmitter em(k);
  info.name = k.name;
  info.num_params = static_cast<int>(k.params.size());

  // Index width: 32-bit when every index and offset fits comfortably.
  bool need64 = static_extent(k.domain_size()) > (int64_t(1) << 30);
  for (const KernelParam& p : k.params) {
    int64_t bound = std::abs(p.offset);
    for (int d = 0; d < rank; ++d)
      bound +=
          std::abs((static_extent(k.domain[d]) > 0 ? static_extent(k.domain[d]) - 1 : 0) * static_extent(p.strides[d]));
    if (bound > (int64_t(1) << 30)) need64 = true;
    info.param_bytes.push_back(param_elements(k, p) * static_cast<int64_t>(ir::dtype_size(p.dtype)));
  }
  em.idx_t = need64 ? "long long" : "int";

  for (const KernelParam& p : k.params)
    if (!storage_type(p.dtype))
      return Status::error("emit_cuda: kernel " + k.name + ": param " + p.name + ": unsupported dtype " +
                           ir::dtype_name(p.dtype));
  for (size_t i = 0; i < k.exprs.size(); ++i)
    if (!storage_type(k.exprs[i].dtype))
      return Status::error("emit_cuda: kernel " + k.name + ": expression %e" + std::to_string(i) +
                           ": unsupported dtype " + ir::dtype_name(k.exprs[i].dtype));

  std::vector<bool> loaded(k.params.size(), false);
  for (const KExpr& e : k.exprs)
    if (e.kind == KExpr::Kind::load) loaded[e.param] = true;

  // Signature.
  std::ostringstream sig;
  for (size_t p = 0; p < k.params.size(); ++p) {
    const KernelParam& kp = k.params[p];
    if (p) sig << ",\n    ";
    if (kp.is_output)
      sig << storage_type(kp.dtype) << "* p" << p;
    else
      sig << "const " << storage_type(kp.dtype) << "* __restrict__ p" << p;
  }
  std::ostream& os = em.os;
  os << "// kernel " << k.name << ": domain [";
  for (int d = 0; d < rank; ++d)
    os << (d ? ", " : "") << static_extent(k.domain[d])
       << (static_cast<int>(k.reduced.size()) > d && k.reduced[d] ? "r" : "");
  os << "]";
  if (!k.fused_nodes.empty()) {
    os << " nodes:";
    for (auto& n : k.fused_nodes) os << " " << n;
  }
  os << "\n// params:";
  for (size_t p = 0; p < k.params.size(); ++p) os << " p" << p << "=" << k.params[p].name;
  os << "\nextern \"C\" __global__ void __launch_bounds__(" << kBlock << ") " << k.name << "(\n    " << sig.str()
     << ") {\n";

  info.block[0] = kBlock;
  std::vector<int> all_dims, kept, red;
  for (int d = 0; d < rank; ++d) {
    all_dims.push_back(d);
    (k.reduced.size() > static_cast<size_t>(d) && k.reduced[d] ? red : kept).push_back(d);
  }

  if (!k.has_reduction()) {
    // ---- pointwise ----
    info.schedule = "pointwise";
    const int64_t n = static_extent(k.domain_size());
    info.grid[0] = static_cast<unsigned>(std::clamp<int64_t>(ceil_div(n, kBlock), 1, kMaxGridX));
    // One point per thread when the grid covers the domain, else a grid-stride loop.
    os << "  const long long n = " << n << "LL;\n";
    if (ceil_div(n, kBlock) <= kMaxGridX)
      os << "  {\n    const long long li = (long long)blockIdx.x * blockDim.x + threadIdx.x;\n"
         << "    if (li >= n) return;\n";
    else
      os << "  for (long long li = (long long)blockIdx.x * blockDim.x + threadIdx.x; li < n;"
         << " li += (long long)gridDim.x * blockDim.x) {\n";
    em.decompose("    ", "li", all_dims);
    std::vector<std::string> offs(k.params.size());
    for (size_t p = 0; p < k.params.size(); ++p) {
      os << "    const " << em.idx_t << " o" << p << " = (" << em.idx_t << ")(" << k.params[p].offset << ") + "
         << em.linear(static_cast<int>(p), all_dims) << ";\n";
    }
    KILN_RETURN_IF_ERROR(em.exprs("    ", [](int p) { return "o" + std::to_string(p); }));
    for (const KStore& s : k.stores)
      os << "    p" << s.param << "[o" << s.param
         << "] = " << to_storage(k.params[s.param].dtype, "v" + std::to_string(s.expr)) << ";\n";
    os << "  }\n}\n\n";
    out << em.os.str();
    return Status::ok();
  }

  // ---- reductions ----
  int64_t M = 1, R = 1;
  for (int d : kept) M *= static_extent(k.domain[d]);
  for (int d : red) R *= static_extent(k.domain[d]);
  bool row_like = true;  // every reduced dim after every kept dim
  for (int d : kept)
    if (!red.empty() && d > red.front()) row_like = false;
  if (k.is_row_program()) {
    KILN_RETURN_IF_ERROR(emit_row_program(em, kept, red, M, R, row_like, info));
    out << em.os.str();
    return Status::ok();
  }

  // Per store: accumulator declaration, combine, final store.
  auto acc_decl = [&](const std::string& ind) {
    for (size_t s = 0; s < k.stores.size(); ++s) {
      const DType t = k.params[k.stores[s].param].dtype;
      os << ind << acc_type(t) << " acc" << s << " = " << acc_init(t, k.stores[s].reduce) << ";\n";
    }
  };
  auto acc_update = [&](const std::string& ind) {
    for (size_t s = 0; s < k.stores.size(); ++s) {
      const KStore& st = k.stores[s];
      const DType t = k.params[st.param].dtype;
      const std::string v = std::string("(") + acc_type(t) + ")v" + std::to_string(st.expr);
      const std::string a = "acc" + std::to_string(s);
      if (st.reduce == ReduceKind::sum && !ir::is_float(t))  // wraps like the reference
        os << ind << a << " = (long long)((unsigned long long)" << a << " + (unsigned long long)" << v << ");\n";
      else if (st.reduce == ReduceKind::sum)
        os << ind << a << " += " << v << ";\n";
      else if (is_f32ish(t))
        os << ind << a << " = kiln_rmaxf(" << a << ", " << v << ");\n";
      else if (t == DType::f64)
        os << ind << a << " = kiln_rmaxd(" << a << ", " << v << ");\n";
      else
        os << ind << "{ const long long w = " << v << "; " << a << " = w > " << a << " ? w : " << a << "; }\n";
    }
  };
  auto warp_combine = [&](const std::string& ind) {
    for (size_t s = 0; s < k.stores.size(); ++s)
      os << ind << "acc" << s << " = " << (k.stores[s].reduce == ReduceKind::sum ? "kiln_warp_sum" : "kiln_warp_max")
         << "(acc" << s << ");\n";
  };
  auto final_store = [&](const std::string& ind) {
    for (size_t s = 0; s < k.stores.size(); ++s) {
      const int p = k.stores[s].param;
      os << ind << "p" << p << "[b" << p << "] = " << to_storage(k.params[p].dtype, "acc" + std::to_string(s)) << ";\n";
    }
  };
  auto bases = [&](const std::string& ind) {
    for (size_t p = 0; p < k.params.size(); ++p)
      os << ind << "const " << em.idx_t << " b" << p << " = (" << em.idx_t << ")(" << k.params[p].offset << ") + "
         << em.linear(static_cast<int>(p), kept) << ";\n";
  };
  auto inner_body = [&](const std::string& ind, const std::string& rvar) -> Status {
    em.decompose(ind, rvar, red);
    for (size_t p = 0; p < k.params.size(); ++p) {
      if (!loaded[p]) continue;
      os << ind << "const " << em.idx_t << " o" << p << " = b" << p << " + " << em.linear(static_cast<int>(p), red)
         << ";\n";
    }
    KILN_RETURN_IF_ERROR(em.exprs(ind, [](int p) { return "o" + std::to_string(p); }));
    acc_update(ind);
    return Status::ok();
  };

  if (row_like && R >= 32) {
    const bool block_row = R >= 4096 && M < 2048;
    if (block_row) {
      info.schedule = "row_block";
      info.grid[0] = static_cast<unsigned>(std::clamp<int64_t>(M, 1, kMaxGridX));
      os << "  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;\n";
      for (size_t s = 0; s < k.stores.size(); ++s)
        os << "  __shared__ " << acc_type(k.params[k.stores[s].param].dtype) << " sh" << s << "[" << kWarpsPerBlock
           << "];\n";
      os << "  for (long long row = blockIdx.x; row < " << M << "LL; row += gridDim.x) {\n";
      em.decompose("    ", "row", kept);
      bases("    ");
      acc_decl("    ");
      os << "    for (long long r = threadIdx.x; r < " << R << "LL; r += blockDim.x) {\n";
      KILN_RETURN_IF_ERROR(inner_body("      ", "r"));
      os << "    }\n";
      warp_combine("    ");
      for (size_t s = 0; s < k.stores.size(); ++s) os << "    if (lane == 0) sh" << s << "[warp] = acc" << s << ";\n";
      os << "    __syncthreads();\n    if (warp == 0) {\n";
      for (size_t s = 0; s < k.stores.size(); ++s) {
        const DType t = k.params[k.stores[s].param].dtype;
        os << "      acc" << s << " = lane < " << kWarpsPerBlock << " ? sh" << s
           << "[lane] : " << acc_init(t, k.stores[s].reduce) << ";\n";
      }
      warp_combine("      ");
      os << "      if (lane == 0) {\n";
      final_store("        ");
      os << "      }\n    }\n    __syncthreads();\n  }\n}\n\n";
    } else {
      info.schedule = "row_warp";
      info.grid[0] = static_cast<unsigned>(std::clamp<int64_t>(ceil_div(M, kWarpsPerBlock), 1, kMaxGridX));
      os << "  const int lane = threadIdx.x & 31;\n"
         << "  for (long long row = (long long)blockIdx.x * " << kWarpsPerBlock << " + (threadIdx.x >> 5); row < " << M
         << "LL; row += (long long)gridDim.x * " << kWarpsPerBlock << ") {\n";
      em.decompose("    ", "row", kept);
      bases("    ");
      acc_decl("    ");
      os << "    for (long long r = lane; r < " << R << "LL; r += 32) {\n";
      KILN_RETURN_IF_ERROR(inner_body("      ", "r"));
      os << "    }\n";
      warp_combine("    ");
      os << "    if (lane == 0) {\n";
      final_store("      ");
      os << "    }\n  }\n}\n\n";
    }
    out << em.os.str();
    return Status::ok();
  }

  // Column schedule: one thread per output element; optional split of R over gridDim.y.
  const int64_t blocks_x = std::max<int64_t>(1, ceil_div(M, kBlock));
  bool atomic_ok = R >= 32 && blocks_x <= kMaxGridX;
  for (const KStore& s : k.stores) {
    const DType t = k.params[s.param].dtype;
    if (!(t == DType::f32 || (t == DType::f64 && s.reduce == ReduceKind::sum))) atomic_ok = false;
    if (!dense_over(k, s.param, kept)) atomic_ok = false;
  }
  std::set<int> store_params;
  for (const KStore& s : k.stores)
    if (!store_params.insert(s.param).second) atomic_ok = false;
  int64_t splits = 1, chunk = R;
  if (atomic_ok) {
    splits = std::clamp<int64_t>(1024 / blocks_x, 1, ceil_div(R, 32));
    splits = std::min<int64_t>(splits, 65535);
    chunk = ceil_div(R, splits);
    splits = ceil_div(R, chunk);
  }
  info.grid[0] = static_cast<unsigned>(std::clamp<int64_t>(blocks_x, 1, kMaxGridX));
  info.grid[1] = static_cast<unsigned>(splits);
  info.schedule = splits > 1 ? "column_atomic" : "column";
  if (splits > 1) {
    for (const KStore& s : k.stores) {
      const KernelParam& kp = k.params[s.param];
      CudaBufferInit init;
      init.param = s.param;
      init.byte_offset = kp.offset * static_cast<int64_t>(ir::dtype_size(kp.dtype));
      init.bytes = M * static_cast<int64_t>(ir::dtype_size(kp.dtype));
      init.fill32 = s.reduce == ReduceKind::sum ? 0u : 0xff800000u;
      if (init.fill32 == 0) info.zero_init_params.push_back(s.param);
      info.inits.push_back(init);
    }
  }
  os << "  for (long long oi = (long long)blockIdx.x * blockDim.x + threadIdx.x; oi < " << M
     << "LL; oi += (long long)gridDim.x * blockDim.x) {\n";
  em.decompose("    ", "oi", kept);
  bases("    ");
  acc_decl("    ");
  if (splits > 1)
    os << "    const long long r0 = (long long)blockIdx.y * " << chunk << "LL;\n"
       << "    const long long r1 = r0 + " << chunk << "LL < " << R << "LL ? r0 + " << chunk << "LL : " << R << "LL;\n";
  else
    os << "    const long long r0 = 0, r1 = " << R << "LL;\n";
  os << "    for (long long r = r0; r < r1; ++r) {\n";
  KILN_RETURN_IF_ERROR(inner_body("      ", "r"));
  os << "    }\n";
  if (splits > 1) {
    for (size_t s = 0; s < k.stores.size(); ++s) {
      const int p = k.stores[s].param;
      if (k.stores[s].reduce == ReduceKind::sum)
        os << "    atomicAdd(&p" << p << "[b" << p << "], acc" << s << ");\n";
      else
        os << "    kiln_atomic_max_f32(&p" << p << "[b" << p << "], acc" << s << ");\n";
    }
  } else {
    final_store("    ");
  }
  os << "  }\n}\n\n";
  out << em.os.str();
  return Status::ok();
}

const char* kPrelude = R"(// Generated by kiln's CUDA emitter (codegen/cuda/cuda_emitter.cpp). Do not edit.
#include <cuda_bf16.h>
#include <cuda_fp16.h>

// bf16/f16 values live in f32 registers; every low-precision result is rounded (RNE).
static __device__ __forceinline__ float kiln_rbf(float x) { return __bfloat162float(__float2bfloat16_rn(x)); }
static __device__ __forceinline__ float kiln_rh(float x) { return __half2float(__float2half_rn(x)); }

// Semantics of evaluate_reference (codegen/kernel_ir.cpp): NaN-propagating max/min,
// integer division by 0 gives 0, x / -1 wraps, integer pow by squaring (wrapping),
// float -> integer casts truncate and saturate with NaN -> 0.
static __device__ __forceinline__ float kiln_maxf(float x, float y) {
  return (x != x || y != y) ? __int_as_float(0x7fc00000) : (x < y ? y : x);
}
static __device__ __forceinline__ float kiln_minf(float x, float y) {
  return (x != x || y != y) ? __int_as_float(0x7fc00000) : (y < x ? y : x);
}
static __device__ __forceinline__ double kiln_maxd(double x, double y) {
  return (x != x || y != y) ? __longlong_as_double(0x7ff8000000000000LL) : (x < y ? y : x);
}
static __device__ __forceinline__ double kiln_mind(double x, double y) {
  return (x != x || y != y) ? __longlong_as_double(0x7ff8000000000000LL) : (y < x ? y : x);
}
static __device__ __forceinline__ long long kiln_idiv(long long x, long long y) {
  if (y == 0) return 0;
  if (y == -1) return (long long)(0ULL - (unsigned long long)x);
  return x / y;
}
static __device__ __forceinline__ long long kiln_imod(long long x, long long y) {
  return (y == 0 || y == -1) ? 0 : x % y;
}
static __device__ __forceinline__ long long kiln_ipow(long long base, long long e) {
  if (e < 0) return base == 1 ? 1 : base == -1 ? ((e % 2) ? -1 : 1) : 0;
  unsigned long long r = 1, b = (unsigned long long)base;
  while (e) {
    if (e & 1) r *= b;
    b *= b;
    e >>= 1;
  }
  return (long long)r;
}
static __device__ __forceinline__ long long kiln_f2i(double x, double lo, double hi, bool i64) {
  if (x != x) return 0;
  const double t = trunc(x);
  if (t <= lo) return (long long)lo;
  if (t >= hi) return i64 ? 9223372036854775807LL : (long long)hi;
  return (long long)t;
}
// Reduction max step: NaN-propagating, else the larger.
static __device__ __forceinline__ float kiln_rmaxf(float acc, float v) {
  return (acc != acc || v != v) ? __int_as_float(0x7fc00000) : (v > acc ? v : acc);
}
static __device__ __forceinline__ double kiln_rmaxd(double acc, double v) {
  return (acc != acc || v != v) ? __longlong_as_double(0x7ff8000000000000LL) : (v > acc ? v : acc);
}

static __device__ __forceinline__ float kiln_warp_sum(float v) {
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}
static __device__ __forceinline__ double kiln_warp_sum(double v) {
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}
static __device__ __forceinline__ long long kiln_warp_sum(long long v) {
  for (int o = 16; o > 0; o >>= 1)
    v = (long long)((unsigned long long)v + (unsigned long long)__shfl_xor_sync(0xffffffffu, v, o));
  return v;
}
static __device__ __forceinline__ float kiln_warp_max(float v) {
  for (int o = 16; o > 0; o >>= 1) v = kiln_rmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
  return v;
}
static __device__ __forceinline__ double kiln_warp_max(double v) {
  for (int o = 16; o > 0; o >>= 1) v = kiln_rmaxd(v, __shfl_xor_sync(0xffffffffu, v, o));
  return v;
}
static __device__ __forceinline__ long long kiln_warp_max(long long v) {
  for (int o = 16; o > 0; o >>= 1) {
    const long long w = __shfl_xor_sync(0xffffffffu, v, o);
    v = w > v ? w : v;
  }
  return v;
}
// Float atomic max on an f32 cell that holds a float (the launcher fills it with -inf):
// non-negative floats order like signed ints, negative ones inversely like unsigned ints.
// The sign bit (not v >= 0) picks the branch so that -0.0f is handled; a NaN is made the
// positive quiet NaN, which then wins every later atomicMax/atomicMin (propagates).
static __device__ __forceinline__ void kiln_atomic_max_f32(float* a, float v) {
  if (v != v) v = __int_as_float(0x7fc00000);
  if (__float_as_int(v) >= 0)
    atomicMax(reinterpret_cast<int*>(a), __float_as_int(v));
  else
    atomicMin(reinterpret_cast<unsigned int*>(a), __float_as_uint(v));
}

)";

}  // namespace

Expected<CudaModuleSource> emit_cuda(const std::vector<Kernel>& kernels) {
  CudaModuleSource mod;
  std::ostringstream out;
  out << kPrelude;
  std::set<std::string> names;
  for (const Kernel& k : kernels) {
    if (!is_ident(k.name)) return Status::error("emit_cuda: kernel name '" + k.name + "' is not a C identifier");
    if (!names.insert(k.name).second) return Status::error("emit_cuda: duplicate kernel name '" + k.name + "'");
    KILN_RETURN_IF_ERROR(k.verify().with_context("emit_cuda"));
    CudaKernelInfo info;
    KILN_RETURN_IF_ERROR(emit_kernel(k, out, info));
    mod.kernels.push_back(std::move(info));
  }
  mod.source = out.str();
  return mod;
}

}  // namespace kiln::codegen
