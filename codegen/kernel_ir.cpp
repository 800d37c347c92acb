// Kernel IR: printer, verifier, dimension collapsing and the reference evaluator
// (the point-by-point oracle that the CPU and CUDA emitter tests compare against).
#include "codegen/kernel_ir.h"

#include <algorithm>
#include <cctype>
#include <cmath>
#include <cstring>
#include <limits>
#include <set>
#include <sstream>
#include <type_traits>

#include "ir/ops/nn.h"

namespace kiln::codegen {

using ir::DType;
using ir::ScalarOp;

Extent Kernel::domain_size() const {
  Extent n = 1;
  for (const Extent& e : domain) n = n * e;
  return n;
}

bool Kernel::is_symbolic() const {
  for (const Extent& e : domain)
    if (!e.is_constant()) return true;
  for (const KernelParam& p : params)
    for (const Extent& st : p.strides)
      if (!st.is_constant()) return true;
  return false;
}

std::vector<std::string> Kernel::symbols() const {
  std::set<std::string> names;
  auto add = [&](const Extent& e) {
    for (const std::string& n : e.symbols()) names.insert(n);
  };
  for (const Extent& e : domain) add(e);
  for (const KernelParam& p : params)
    for (const Extent& st : p.strides) add(st);
  return {names.begin(), names.end()};
}

Kernel Kernel::bind(const std::map<std::string, int64_t>& values) const {
  Kernel b = *this;
  for (Extent& e : b.domain) e = e.substitute(values);
  for (KernelParam& p : b.params)
    for (Extent& st : p.strides) st = st.substitute(values);
  return b;
}

bool Kernel::has_reduction() const {
  for (bool r : reduced)
    if (r) return true;
  return false;
}

std::vector<int> Kernel::expr_levels() const {
  std::vector<int> lv(exprs.size(), 0);
  for (size_t i = 0; i < exprs.size(); ++i) {
    int l = 0;
    for (int a : exprs[i].args)
      if (a >= 0 && a < static_cast<int>(i)) l = std::max(l, lv[a]);
    lv[i] = exprs[i].kind == KExpr::Kind::reduce ? l + 1 : l;
  }
  return lv;
}

std::vector<bool> Kernel::row_invariant() const {
  std::vector<bool> inv(exprs.size(), true);
  for (size_t i = 0; i < exprs.size(); ++i) {
    const KExpr& e = exprs[i];
    if (e.kind == KExpr::Kind::reduce || e.kind == KExpr::Kind::constant) continue;
    if (e.kind == KExpr::Kind::load) {
      if (e.param < 0 || e.param >= static_cast<int>(params.size())) continue;
      const KernelParam& p = params[e.param];
      for (size_t d = 0; d < reduced.size() && d < p.strides.size(); ++d) {
        // (A symbolic extent may exceed 1.)
        if (reduced[d] && p.strides[d] != 0 && domain[d] != 1) inv[i] = false;
        // A guard that cuts a reduced dim makes the value change along it.
        if (reduced[d] && p.guarded() && (p.guard_lo[d] > 0 || Extent(p.guard_hi[d]) != domain[d])) inv[i] = false;
      }
      if (!e.args.empty() && e.args[0] >= 0 && e.args[0] < static_cast<int>(i) && !inv[e.args[0]]) inv[i] = false;
      continue;
    }
    for (int a : e.args)
      if (a >= 0 && a < static_cast<int>(i) && !inv[a]) inv[i] = false;
  }
  return inv;
}

bool Kernel::varies_along_reduced(const KStore& s) const {
  const KernelParam& p = params[s.param];
  for (size_t d = 0; d < reduced.size() && d < p.strides.size(); ++d)
    if (reduced[d] && p.strides[d] != 0) return true;
  return false;
}

int Kernel::row_passes() const {
  const std::vector<int> level = expr_levels();
  int passes = 0;
  for (size_t i = 0; i < exprs.size(); ++i)
    if (exprs[i].kind == KExpr::Kind::reduce) passes = std::max(passes, level[i]);
  for (const KStore& s : stores)
    if (s.reduce != ReduceKind::none || varies_along_reduced(s)) passes = std::max(passes, level[s.expr] + 1);
  return passes;
}

bool Kernel::column_split_shape(Extent* rows_out, int64_t* cols_out) const {
  if (!has_reduction() || is_row_program() || domain.empty()) return false;
  // The dims of extent > 1, whatever the strides (so that the eager ReduceSum, which
  // sees only the shape, decides alike): reduced ones first, then kept ones.
  Extent rows = 1;
  int64_t cols = 1;
  bool seen_kept = false;
  for (size_t d = 0; d < domain.size(); ++d) {
    const int64_t e = static_extent(domain[d]);
    if (e == 1) continue;
    if (reduced[d]) {
      if (seen_kept) return false;  // a reduced dim after a kept one
      rows = rows * domain[d];
    } else {
      if (e < 0) return false;  // symbolic columns
      seen_kept = true;
      cols *= e;
    }
  }
  if (!seen_kept || (rows.is_constant() && rows.constant_value() == 1)) return false;
  *rows_out = rows;
  *cols_out = cols;
  return true;
}

int64_t Kernel::column_split_parts() const {
  Extent rows = 1;
  int64_t cols = 0;
  if (!column_split_shape(&rows, &cols) || !rows.is_constant()) return 0;
  return ir::column_sum_partitions(rows.constant_value(), cols);
}

bool Kernel::is_row_program() const {
  if (!has_reduction()) return false;
  for (const KExpr& e : exprs)
    if (e.kind == KExpr::Kind::reduce) return true;
  for (const KStore& s : stores)
    if (s.reduce == ReduceKind::none) return true;
  return false;
}

namespace {

const char* reduce_name(ReduceKind r) {
  switch (r) {
    case ReduceKind::sum:
      return "sum";
    case ReduceKind::max:
      return "max";
    default:
      return "none";
  }
}

template <typename T>
std::string join(const std::vector<T>& v) {
  std::ostringstream os;
  for (size_t i = 0; i < v.size(); ++i) os << (i ? ", " : "") << v[i];  // Extent: ir::operator<< (to_string)
  return os.str();
}

enum class OpClass { binary_arith, unary_arith, unary_float, compare, logic_binary, logic_not, select, cast, fma };

OpClass op_class(ScalarOp op) {
  switch (op) {
    case ScalarOp::add:
    case ScalarOp::sub:
    case ScalarOp::mul:
    case ScalarOp::div:
    case ScalarOp::pow:
    case ScalarOp::max:
    case ScalarOp::min:
    case ScalarOp::fmod:
      return OpClass::binary_arith;
    case ScalarOp::neg:
    case ScalarOp::abs:
      return OpClass::unary_arith;
    case ScalarOp::exp:
    case ScalarOp::log:
    case ScalarOp::sqrt:
    case ScalarOp::erf:
    case ScalarOp::tanh:
    case ScalarOp::sin:
    case ScalarOp::cos:
    case ScalarOp::floor:
    case ScalarOp::ceil:
    case ScalarOp::round:
      return OpClass::unary_float;
    case ScalarOp::lt:
    case ScalarOp::le:
    case ScalarOp::gt:
    case ScalarOp::ge:
    case ScalarOp::eq:
      return OpClass::compare;
    case ScalarOp::logical_and:
    case ScalarOp::logical_or:
    case ScalarOp::logical_xor:
      return OpClass::logic_binary;
    case ScalarOp::logical_not:
      return OpClass::logic_not;
    case ScalarOp::select:
      return OpClass::select;
    case ScalarOp::fma:
      return OpClass::fma;
    default:
      return OpClass::cast;
  }
}

int op_arity(ScalarOp op) {
  switch (op_class(op)) {
    case OpClass::binary_arith:
    case OpClass::compare:
    case OpClass::logic_binary:
      return 2;
    case OpClass::select:
    case OpClass::fma:
      return 3;
    default:
      return 1;
  }
}

bool is_numeric(DType t) { return ir::is_float(t) || ir::is_integer(t); }

bool valid_identifier(const std::string& s) {
  if (s.empty() || std::isdigit(static_cast<unsigned char>(s[0]))) return false;
  for (char c : s)
    if (!(std::isalnum(static_cast<unsigned char>(c)) || c == '_')) return false;
  return true;
}

}  // namespace

std::string Kernel::to_string() const {
  std::ostringstream os;
  os << "kernel " << name << " domain [" << join(domain) << "] reduced [";
  for (size_t d = 0; d < domain.size(); ++d) os << (d ? ", " : "") << (d < reduced.size() && reduced[d] ? "r" : "-");
  os << "]" << (!versions && is_symbolic() ? " generic" : "") << "\n";
  if (!fused_nodes.empty()) os << "  nodes " << join(fused_nodes) << "\n";
  for (size_t i = 0; i < params.size(); ++i) {
    const KernelParam& p = params[i];
    os << "  param " << i << " %" << p.name << " " << ir::dtype_name(p.dtype) << " strides [" << join(p.strides) << "]";
    if (p.offset) os << " offset " << p.offset;
    if (p.guarded()) {
      os << " guard [";
      for (size_t d = 0; d < p.guard_lo.size(); ++d) os << (d ? ", " : "") << p.guard_lo[d] << ":" << p.guard_hi[d];
      os << "]";
    }
    os << (p.is_output ? " out" : " in");
    if (p.in_place_of >= 0) os << " in_place_of p" << p.in_place_of;
    os << "\n";
  }
  for (size_t i = 0; i < exprs.size(); ++i) {
    const KExpr& e = exprs[i];
    os << "  %e" << i << " = ";
    if (e.kind == KExpr::Kind::load) {
      os << "load p" << e.param;
      if (!e.args.empty()) os << " else %e" << e.args[0];
    } else if (e.kind == KExpr::Kind::reduce) {
      os << "reduce_" << reduce_name(e.reduce) << " %e" << (e.args.empty() ? -1 : e.args[0]);
    } else if (e.kind == KExpr::Kind::constant) {
      std::ostringstream v;
      v.precision(17);
      v << e.value;
      os << "const " << v.str();
    } else {
      os << ir::scalar_op_name(e.op);
      for (size_t a = 0; a < e.args.size(); ++a) os << (a ? ", %e" : " %e") << e.args[a];
    }
    os << " : " << ir::dtype_name(e.dtype) << "\n";
  }
  for (const KStore& s : stores) {
    os << "  store p" << s.param << " <- ";
    if (s.reduce != ReduceKind::none) os << reduce_name(s.reduce) << " ";
    os << "%e" << s.expr << "\n";
  }
  return os.str();
}

Status Kernel::verify() const {
  auto fail = [&](const std::string& msg) { return Status::error("kernel '" + name + "': " + msg); };
  if (!valid_identifier(name)) return fail("name must be a non-empty C identifier");
  const size_t rank = domain.size();
  for (const Extent& e : domain) {
    if (!e.valid()) return fail("an extent overflowed");
    if (e.is_constant() && e.constant_value() < 0) return fail("negative domain extent " + e.to_string());
  }
  const bool symbolic = is_symbolic();
  if (!reduced.empty() && reduced.size() != rank)
    return fail("reduced has " + std::to_string(reduced.size()) + " flags for a rank-" + std::to_string(rank) +
                " domain");
  bool any_reduced_dim = false;
  for (bool r : reduced) any_reduced_dim |= r;
  for (size_t i = 0; i < params.size(); ++i) {
    const KernelParam& p = params[i];
    const std::string pn = "param " + std::to_string(i) + " (%" + p.name + ")";
    if (p.dtype == DType::undefined) return fail(pn + " has an undefined dtype");
    if (p.strides.size() != rank)
      return fail(pn + " has " + std::to_string(p.strides.size()) + " strides for a rank-" + std::to_string(rank) +
                  " domain");
    for (const Extent& st : p.strides)
      if (!st.valid() || (st.is_constant() && st.constant_value() < 0)) return fail(pn + " has a negative stride");
    if (p.guarded()) {
      if (p.is_output) return fail(pn + " is an output with a guard");
      if (symbolic) return fail(pn + " has a guard in a symbolic kernel");
      if (p.guard_lo.size() != rank || p.guard_hi.size() != rank) return fail(pn + " has a guard of the wrong rank");
      int64_t first = p.offset;  // the smallest element offset inside the box
      for (size_t d = 0; d < rank; ++d) {
        if (p.guard_lo[d] < 0 || p.guard_lo[d] >= p.guard_hi[d] || p.guard_hi[d] > domain[d].constant_value())
          return fail(pn + " has an empty or out-of-domain guard on dim " + std::to_string(d));
        first += p.guard_lo[d] * p.strides[d].constant_value();
      }
      if (first < 0) return fail(pn + " reads before its buffer inside its guard");
    } else if (p.offset < 0) {
      return fail(pn + " has a negative offset");
    }
    if (p.in_place_of >= 0) {
      if (!p.is_output || p.in_place_of >= static_cast<int>(params.size()) || params[p.in_place_of].is_output)
        return fail(pn + " is in place of a param that is not an input");
      const KernelParam& q = params[p.in_place_of];
      if (q.dtype != p.dtype || q.strides != p.strides || q.offset != p.offset)
        return fail(pn + " is in place of param " + std::to_string(p.in_place_of) + " with other dtype or strides");
    }
  }
  for (size_t i = 0; i < exprs.size(); ++i) {
    const KExpr& e = exprs[i];
    const std::string en = "%e" + std::to_string(i);
    if (e.dtype == DType::undefined) return fail(en + " has an undefined dtype");
    for (int a : e.args)
      if (a < 0 || a >= static_cast<int>(i)) return fail(en + " uses %e" + std::to_string(a) + ", not an earlier expr");
    auto arg_dt = [&](int k) { return exprs[e.args[k]].dtype; };
    switch (e.kind) {
      case KExpr::Kind::load: {
        if (e.param < 0 || e.param >= static_cast<int>(params.size()))
          return fail(en + ": load of missing param " + std::to_string(e.param));
        const KernelParam& p = params[e.param];
        if (e.args.size() > 1 || (!e.args.empty() && !p.guarded()))
          return fail(en + ": only a load of a guarded param takes an arg (its fallback)");
        if (!e.args.empty() && arg_dt(0) != e.dtype) return fail(en + ": fallback dtype differs from the load's");
        if (p.is_output) return fail(en + ": load of output param p" + std::to_string(e.param));
        if (p.dtype != e.dtype)
          return fail(en + ": load dtype " + ir::dtype_name(e.dtype) + " != param dtype " + ir::dtype_name(p.dtype));
        break;
      }
      case KExpr::Kind::constant:
        if (!e.args.empty()) return fail(en + ": constant takes no args");
        break;
      case KExpr::Kind::reduce:
        if (e.args.size() != 1) return fail(en + ": reduce takes one arg");
        if (e.reduce == ReduceKind::none) return fail(en + ": reduce needs sum or max");
        if (!is_numeric(e.dtype)) return fail(en + ": reduce of a non-numeric dtype");
        if (arg_dt(0) != e.dtype) return fail(en + ": reduce dtype differs from its arg's");
        if (!any_reduced_dim) return fail(en + ": reduce in a kernel without reduced dims");
        break;
      case KExpr::Kind::op: {
        const std::string on = en + " (" + ir::scalar_op_name(e.op) + ")";
        const int arity = op_arity(e.op);
        if (static_cast<int>(e.args.size()) != arity)
          return fail(on + " takes " + std::to_string(arity) + " args, got " + std::to_string(e.args.size()));
        switch (op_class(e.op)) {
          case OpClass::binary_arith:
            if (!is_numeric(e.dtype)) return fail(on + ": needs a numeric dtype, got " + ir::dtype_name(e.dtype));
            if (arg_dt(0) != e.dtype || arg_dt(1) != e.dtype) return fail(on + ": operand dtypes differ from result");
            break;
          case OpClass::unary_arith:
            if (!is_numeric(e.dtype)) return fail(on + ": needs a numeric dtype, got " + ir::dtype_name(e.dtype));
            if (arg_dt(0) != e.dtype) return fail(on + ": operand dtype differs from result");
            break;
          case OpClass::unary_float:
            if (!ir::is_float(e.dtype)) return fail(on + ": needs a float dtype, got " + ir::dtype_name(e.dtype));
            if (arg_dt(0) != e.dtype) return fail(on + ": operand dtype differs from result");
            break;
          case OpClass::compare:
            if (e.dtype != DType::boolean) return fail(on + ": result must be bool");
            if (arg_dt(0) != arg_dt(1)) return fail(on + ": operand dtypes differ");
            break;
          case OpClass::logic_binary:
          case OpClass::logic_not:
            if (e.dtype != DType::boolean) return fail(on + ": result must be bool");
            for (size_t a = 0; a < e.args.size(); ++a)
              if (arg_dt(static_cast<int>(a)) != DType::boolean) return fail(on + ": operands must be bool");
            break;
          case OpClass::select:
            if (arg_dt(0) != DType::boolean) return fail(on + ": condition must be bool");
            if (arg_dt(1) != e.dtype || arg_dt(2) != e.dtype) return fail(on + ": branch dtypes differ from result");
            break;
          case OpClass::fma:
            if (!ir::is_float(e.dtype)) return fail(on + ": needs a float dtype, got " + ir::dtype_name(e.dtype));
            if (arg_dt(0) != e.dtype || arg_dt(1) != e.dtype || arg_dt(2) != e.dtype)
              return fail(on + ": operand dtypes differ from result");
            break;
          case OpClass::cast:
            break;
        }
        break;
      }
    }
  }
  if (stores.empty()) return fail("no stores");
  std::vector<int> stored(params.size(), 0);
  const std::vector<bool> inv = row_invariant();
  bool any_reduction = false;
  for (const KExpr& e : exprs) any_reduction |= e.kind == KExpr::Kind::reduce;
  for (size_t i = 0; i < stores.size(); ++i) {
    const KStore& s = stores[i];
    const std::string sn = "store " + std::to_string(i);
    if (s.param < 0 || s.param >= static_cast<int>(params.size()))
      return fail(sn + " to missing param " + std::to_string(s.param));
    const KernelParam& p = params[s.param];
    if (!p.is_output) return fail(sn + " to input param p" + std::to_string(s.param) + " (%" + p.name + ")");
    if (stored[s.param]++) return fail(sn + ": param p" + std::to_string(s.param) + " stored twice");
    if (s.expr < 0 || s.expr >= static_cast<int>(exprs.size()))
      return fail(sn + " of missing expr " + std::to_string(s.expr));
    if (exprs[s.expr].dtype != p.dtype)
      return fail(sn + ": expr dtype " + ir::dtype_name(exprs[s.expr].dtype) + " != param dtype " +
                  ir::dtype_name(p.dtype));
    const bool varies = varies_along_reduced(s);
    if (s.reduce != ReduceKind::none) {
      any_reduction = true;
      if (!is_numeric(p.dtype)) return fail(sn + ": reduction of a non-numeric dtype");
      for (size_t d = 0; d < rank; ++d)
        if (d < reduced.size() && reduced[d] && p.strides[d] != 0)
          return fail(sn + ": output stride along reduced dim " + std::to_string(d) + " must be 0");
    } else if (any_reduced_dim && !varies && !inv[s.expr]) {
      return fail(sn + ": row store (stride 0 along the reduced dims) of %e" + std::to_string(s.expr) +
                  ", which varies along them");
    }
  }
  if (any_reduction && !any_reduced_dim) return fail("reduction store but no reduced dim");
  if (!any_reduction && any_reduced_dim) return fail("reduced dims but no reduction store or reduce expression");
  for (size_t i = 0; i < params.size(); ++i)
    if (params[i].is_output && !stored[i]) return fail("output param p" + std::to_string(i) + " is never stored");
  return Status::ok();
}

Kernel collapse_dims(const Kernel& k) {
  Kernel out = k;
  const size_t rank = k.domain.size();
  std::vector<bool> red(rank, false);
  for (size_t d = 0; d < rank && d < k.reduced.size(); ++d) red[d] = k.reduced[d];
  int reduced_left = 0;
  for (bool r : red) reduced_left += r;
  // 1. Drop extent-1 dims (the index is always 0); keep one reduced dim of a reduction.
  std::vector<size_t> keep;
  for (size_t d = 0; d < rank; ++d) {
    if (k.domain[d] == 1 && (!red[d] || reduced_left > 1)) {
      if (red[d]) --reduced_left;
      continue;
    }
    keep.push_back(d);
  }
  std::vector<Extent> dom;
  std::vector<bool> rflags;
  std::vector<std::vector<Extent>> strides(k.params.size());
  std::vector<std::vector<int64_t>> glo(k.params.size()), ghi(k.params.size());
  // A guard that cuts dim d (not the whole extent) keeps d a dim of its own.
  auto cut = [&](size_t p, size_t d) {
    const KernelParam& q = k.params[p];
    return q.guarded() && (q.guard_lo[d] != 0 || Extent(q.guard_hi[d]) != k.domain[d]);
  };
  size_t prev = 0;
  for (size_t d : keep) {
    const bool r = red[d];
    bool merge = !dom.empty() && rflags.back() == r;
    if (merge)
      for (size_t p = 0; p < k.params.size(); ++p)
        if (strides[p].back() != k.params[p].strides[d] * k.domain[d] || cut(p, d) || cut(p, prev)) merge = false;
    if (merge) {
      dom.back() = dom.back() * k.domain[d];
      for (size_t p = 0; p < k.params.size(); ++p) {
        strides[p].back() = k.params[p].strides[d];
        if (k.params[p].guarded()) ghi[p].back() = static_extent(dom.back());
      }
    } else {
      dom.push_back(k.domain[d]);
      rflags.push_back(r);
      for (size_t p = 0; p < k.params.size(); ++p) {
        strides[p].push_back(k.params[p].strides[d]);
        if (k.params[p].guarded()) {
          glo[p].push_back(k.params[p].guard_lo[d]);
          ghi[p].push_back(k.params[p].guard_hi[d]);
        }
      }
    }
    prev = d;
  }
  out.domain = dom;
  bool any = false;
  for (bool r : rflags) any |= r;
  out.reduced = any ? rflags : std::vector<bool>();
  for (size_t p = 0; p < k.params.size(); ++p) {
    out.params[p].strides = strides[p];
    if (k.params[p].guarded()) {
      out.params[p].guard_lo = glo[p];
      out.params[p].guard_hi = ghi[p];
    }
  }
  return out;
}

// ---------------------------------------------------------------------------
// Reference evaluator
// ---------------------------------------------------------------------------
namespace {

/// One scalar in its compute type: floats in `f` (an f32 value for f32/bf16/f16),
/// integers and bool in `i`.
struct Val {
  double f = 0;
  int64_t i = 0;
};

/// Rounds a float compute value to the precision of dtype `t`.
double round_float(DType t, double x) {
  switch (t) {
    case DType::f64:
      return x;
    case DType::bf16:
      return ir::bf16_to_f32(ir::f32_to_bf16(static_cast<float>(x)));
    case DType::f16:
      return ir::f16_to_f32(ir::f32_to_f16(static_cast<float>(x)));
    default:
      return static_cast<float>(x);
  }
}

/// Wraps an integer to dtype `t`'s width (bool: != 0).
int64_t wrap_int(DType t, int64_t x) {
  switch (t) {
    case DType::i32:
      return static_cast<int32_t>(x);
    case DType::i8:
      return static_cast<int8_t>(x);
    case DType::u8:
      return static_cast<uint8_t>(x);
    case DType::boolean:
      return x != 0;
    default:
      return x;
  }
}

Val load_val(DType t, const void* base, int64_t idx) {
  Val v;
  switch (t) {
    case DType::f32:
      v.f = static_cast<const float*>(base)[idx];
      break;
    case DType::f64:
      v.f = static_cast<const double*>(base)[idx];
      break;
    case DType::bf16:
      v.f = ir::bf16_to_f32(static_cast<const uint16_t*>(base)[idx]);
      break;
    case DType::f16:
      v.f = ir::f16_to_f32(static_cast<const uint16_t*>(base)[idx]);
      break;
    case DType::i64:
      v.i = static_cast<const int64_t*>(base)[idx];
      break;
    case DType::i32:
      v.i = static_cast<const int32_t*>(base)[idx];
      break;
    case DType::i8:
      v.i = static_cast<const int8_t*>(base)[idx];
      break;
    case DType::u8:
      v.i = static_cast<const uint8_t*>(base)[idx];
      break;
    case DType::boolean:
      v.i = static_cast<const uint8_t*>(base)[idx] != 0;
      break;
    default:
      break;
  }
  return v;
}

void store_val(DType t, void* base, int64_t idx, const Val& v) {
  switch (t) {
    case DType::f32:
      static_cast<float*>(base)[idx] = static_cast<float>(v.f);
      break;
    case DType::f64:
      static_cast<double*>(base)[idx] = v.f;
      break;
    case DType::bf16:
      static_cast<uint16_t*>(base)[idx] = ir::f32_to_bf16(static_cast<float>(v.f));
      break;
    case DType::f16:
      static_cast<uint16_t*>(base)[idx] = ir::f32_to_f16(static_cast<float>(v.f));
      break;
    case DType::i64:
      static_cast<int64_t*>(base)[idx] = v.i;
      break;
    case DType::i32:
      static_cast<int32_t*>(base)[idx] = static_cast<int32_t>(v.i);
      break;
    case DType::i8:
      static_cast<int8_t*>(base)[idx] = static_cast<int8_t>(v.i);
      break;
    case DType::u8:
      static_cast<uint8_t*>(base)[idx] = static_cast<uint8_t>(v.i);
      break;
    case DType::boolean:
      static_cast<uint8_t*>(base)[idx] = v.i ? 1 : 0;
      break;
    default:
      break;
  }
}

Val constant_val(DType t, double value) {
  Val v;
  if (ir::is_float(t))
    v.f = round_float(t, value);
  else if (t == DType::boolean)
    v.i = value != 0;
  else
    v.i = wrap_int(t, static_cast<int64_t>(value));
  return v;
}

int64_t int_pow(int64_t base, int64_t e, DType t) { return wrap_int(t, ipow_wrapping(base, e)); }

/// Float op in compute type C (float or double).
template <typename C>
double float_op(ScalarOp op, C x, C y) {
  switch (op) {
    case ScalarOp::add:
      return x + y;
    case ScalarOp::sub:
      return x - y;
    case ScalarOp::mul:
      return x * y;
    case ScalarOp::div:
      return x / y;
    case ScalarOp::pow:
      return std::pow(x, y);
    case ScalarOp::max:
      if (std::isnan(x) || std::isnan(y)) return std::numeric_limits<C>::quiet_NaN();
      return std::max(x, y);
    case ScalarOp::min:
      if (std::isnan(x) || std::isnan(y)) return std::numeric_limits<C>::quiet_NaN();
      return std::min(x, y);
    case ScalarOp::neg:
      return -x;
    case ScalarOp::abs:
      return x < C(0) ? -x : x;
    case ScalarOp::exp:
      return std::exp(x);
    case ScalarOp::log:
      return std::log(x);
    case ScalarOp::sqrt:
      return std::sqrt(x);
    case ScalarOp::erf:
      return std::erf(x);
    case ScalarOp::tanh:
      return std::tanh(x);
    case ScalarOp::sin:
      return std::sin(x);
    case ScalarOp::cos:
      return std::cos(x);
    case ScalarOp::floor:
      return std::floor(x);
    case ScalarOp::ceil:
      return std::ceil(x);
    case ScalarOp::round:
      return std::nearbyint(x);  // the default rounding mode: half to even
    case ScalarOp::fmod:
      return std::fmod(x, y);
    default:
      return 0;
  }
}

int64_t int_op(ScalarOp op, int64_t x, int64_t y, DType t) {
  const bool u = t == DType::u8;
  switch (op) {
    case ScalarOp::add:
      return wrap_int(t, static_cast<int64_t>(static_cast<uint64_t>(x) + static_cast<uint64_t>(y)));
    case ScalarOp::sub:
      return wrap_int(t, static_cast<int64_t>(static_cast<uint64_t>(x) - static_cast<uint64_t>(y)));
    case ScalarOp::mul:
      return wrap_int(t, static_cast<int64_t>(static_cast<uint64_t>(x) * static_cast<uint64_t>(y)));
    case ScalarOp::div:
      if (y == 0) return 0;
      if (!u && y == -1) return wrap_int(t, static_cast<int64_t>(0 - static_cast<uint64_t>(x)));
      return wrap_int(t, x / y);
    case ScalarOp::pow:
      return int_pow(x, y, t);
    case ScalarOp::max:
      return std::max(x, y);
    case ScalarOp::min:
      return std::min(x, y);
    case ScalarOp::neg:
      return wrap_int(t, static_cast<int64_t>(0 - static_cast<uint64_t>(x)));
    case ScalarOp::abs:
      return x < 0 ? wrap_int(t, static_cast<int64_t>(0 - static_cast<uint64_t>(x))) : x;
    case ScalarOp::fmod:
      if (y == 0 || (!u && y == -1)) return 0;
      return wrap_int(t, x % y);
    default:
      return 0;
  }
}

bool compare(ScalarOp op, const Val& a, const Val& b, DType t) {
  if (ir::is_float(t)) {
    switch (op) {
      case ScalarOp::lt:
        return a.f < b.f;
      case ScalarOp::le:
        return a.f <= b.f;
      case ScalarOp::gt:
        return a.f > b.f;
      case ScalarOp::ge:
        return a.f >= b.f;
      default:
        return a.f == b.f;
    }
  }
  switch (op) {
    case ScalarOp::lt:
      return a.i < b.i;
    case ScalarOp::le:
      return a.i <= b.i;
    case ScalarOp::gt:
      return a.i > b.i;
    case ScalarOp::ge:
      return a.i >= b.i;
    default:
      return a.i == b.i;
  }
}

/// ONNX Cast from `s` (dtype `from`) to dtype `to`, as runtime/kernels/util.h convert().
Val cast_val(const Val& s, DType from, DType to) {
  Val r;
  const bool ff = ir::is_float(from);
  if (to == DType::boolean) {
    r.i = ff ? (s.f != 0) : (s.i != 0);
  } else if (ir::is_float(to)) {
    double x = ff ? s.f : static_cast<double>(s.i);
    if (!ff && to != DType::f64) x = static_cast<float>(s.i);  // int -> float directly (one rounding)
    r.f = round_float(to, x);
  } else if (ff) {
    if (std::isnan(s.f)) {
      r.i = 0;
    } else {
      double lo, hi;
      switch (to) {
        case DType::i32:
          lo = std::numeric_limits<int32_t>::min();
          hi = std::numeric_limits<int32_t>::max();
          break;
        case DType::i8:
          lo = -128;
          hi = 127;
          break;
        case DType::u8:
          lo = 0;
          hi = 255;
          break;
        default:
          lo = -9223372036854775808.0;
          hi = 9223372036854775807.0;
          break;
      }
      const double t = std::trunc(s.f);
      if (t <= lo)
        r.i = static_cast<int64_t>(lo);
      else if (t >= hi)
        r.i = to == DType::i64 ? std::numeric_limits<int64_t>::max() : static_cast<int64_t>(hi);
      else
        r.i = static_cast<int64_t>(t);
    }
  } else {
    r.i = wrap_int(to, s.i);
  }
  return r;
}

Val eval_op(const KExpr& e, const std::vector<Val>& vals, const std::vector<KExpr>& exprs) {
  Val r;
  auto a = [&](int k) -> const Val& { return vals[e.args[k]]; };
  auto adt = [&](int k) { return exprs[e.args[k]].dtype; };
  switch (op_class(e.op)) {
    case OpClass::binary_arith:
    case OpClass::unary_arith:
    case OpClass::unary_float: {
      const Val& x = a(0);
      const Val y = e.args.size() > 1 ? a(1) : Val{};
      if (e.dtype == DType::f64)
        r.f = float_op<double>(e.op, x.f, y.f);
      else if (ir::is_float(e.dtype))
        r.f = round_float(e.dtype, float_op<float>(e.op, static_cast<float>(x.f), static_cast<float>(y.f)));
      else
        r.i = int_op(e.op, x.i, y.i, e.dtype);
      break;
    }
    case OpClass::compare:
      r.i = compare(e.op, a(0), a(1), adt(0));
      break;
    case OpClass::logic_binary:
      if (e.op == ScalarOp::logical_and)
        r.i = a(0).i && a(1).i;
      else if (e.op == ScalarOp::logical_or)
        r.i = a(0).i || a(1).i;
      else
        r.i = (a(0).i != 0) != (a(1).i != 0);
      break;
    case OpClass::logic_not:
      r.i = !a(0).i;
      break;
    case OpClass::select:
      r = a(0).i ? a(1) : a(2);
      break;
    case OpClass::cast:
      r = cast_val(a(0), adt(0), e.dtype);
      break;
    case OpClass::fma:  // one rounding in the compute type (float for f32, bf16 and f16)
      if (e.dtype == DType::f64)
        r.f = std::fma(a(0).f, a(1).f, a(2).f);
      else
        r.f = round_float(e.dtype,
                          std::fma(static_cast<float>(a(0).f), static_cast<float>(a(1).f), static_cast<float>(a(2).f)));
      break;
  }
  return r;
}

/// Initial value of a reduction accumulator of dtype t.
Val reduce_init(ReduceKind kind, DType t) {
  Val v;
  if (kind == ReduceKind::max) {
    if (ir::is_float(t))
      v.f = -std::numeric_limits<double>::infinity();
    else if (t == DType::i32)
      v.i = std::numeric_limits<int32_t>::min();
    else if (t == DType::i8)
      v.i = -128;
    else if (t == DType::u8)
      v.i = 0;
    else
      v.i = std::numeric_limits<int64_t>::min();
  }
  return v;
}

/// acc = acc (+ or max) v in the accumulator type: float sums in double (as the eager
/// ReduceSum does, so generated and eager sums agree bit for bit), integers wrapped.
void reduce_step(ReduceKind kind, DType t, Val& acc, const Val& v) {
  if (ir::is_float(t)) {
    if (kind == ReduceKind::sum) {
      acc.f += v.f;
    } else {
      if (std::isnan(acc.f) || std::isnan(v.f))
        acc.f = std::numeric_limits<double>::quiet_NaN();
      else if (v.f > acc.f)
        acc.f = v.f;
    }
  } else {
    if (kind == ReduceKind::sum)
      acc.i = wrap_int(t, static_cast<int64_t>(static_cast<uint64_t>(acc.i) + static_cast<uint64_t>(v.i)));
    else if (v.i > acc.i)
      acc.i = v.i;
  }
}

/// Calls f(index) for every point of `dom` in row-major order.
template <typename F>
void for_each_point(const std::vector<int64_t>& dom, F&& f) {
  for (int64_t e : dom)
    if (e == 0) return;
  std::vector<int64_t> idx(dom.size(), 0);
  while (true) {
    f(idx);
    int d = static_cast<int>(dom.size()) - 1;
    for (; d >= 0; --d) {
      if (++idx[d] < dom[d]) break;
      idx[d] = 0;
    }
    if (d < 0) return;
  }
}

}  // namespace

Status evaluate_reference(const Kernel& symbolic, const std::vector<void*>& buffers,
                          const std::map<std::string, int64_t>& symbols) {
  KILN_RETURN_IF_ERROR(symbolic.verify());
  const Kernel k = symbolic.bind(symbols);
  if (k.is_symbolic())
    return Status::error("kernel '" + k.name + "': no value for a symbol of " + k.domain_size().to_string());
  // Every extent and stride is a constant from here on.
  std::vector<int64_t> domain;
  for (const Extent& e : k.domain) domain.push_back(e.constant_value());
  std::vector<std::vector<int64_t>> strides;
  for (const KernelParam& p : k.params) {
    strides.emplace_back();
    for (const Extent& st : p.strides) strides.back().push_back(st.constant_value());
  }
  if (buffers.size() != k.params.size())
    return Status::error("kernel '" + k.name + "': " + std::to_string(buffers.size()) + " buffers for " +
                         std::to_string(k.params.size()) + " params");
  for (size_t i = 0; i < buffers.size(); ++i)
    if (!buffers[i] && k.domain_size().constant_value() > 0)
      return Status::error("kernel '" + k.name + "': null buffer for param " + std::to_string(i));
  const size_t rank = k.domain.size();
  auto offset_of = [&](int p, const std::vector<int64_t>& idx) {
    int64_t o = k.params[p].offset;
    for (size_t d = 0; d < rank; ++d) o += idx[d] * strides[p][d];
    return o;
  };
  std::vector<Val> vals(k.exprs.size());
  // Values of the reduce expressions at the current kept point (filled pass by pass).
  std::vector<Val> reduced_vals(k.exprs.size());
  const std::vector<int> level = k.expr_levels();
  // Evaluates every expression of level < max_level at `idx` (reduce expressions take
  // their finished values); higher levels are left stale.
  auto eval_point = [&](const std::vector<int64_t>& idx, int max_level) {
    for (size_t i = 0; i < k.exprs.size(); ++i) {
      const KExpr& e = k.exprs[i];
      if (level[i] >= max_level) continue;
      if (e.kind == KExpr::Kind::load) {
        const KernelParam& p = k.params[e.param];
        bool inside = true;
        for (size_t d = 0; d < rank && p.guarded(); ++d)
          inside = inside && idx[d] >= p.guard_lo[d] && idx[d] < p.guard_hi[d];
        if (inside)
          vals[i] = load_val(e.dtype, buffers[e.param], offset_of(e.param, idx));
        else
          vals[i] = e.args.empty() ? Val{} : vals[e.args[0]];
      } else if (e.kind == KExpr::Kind::constant)
        vals[i] = constant_val(e.dtype, e.value);
      else if (e.kind == KExpr::Kind::reduce)
        vals[i] = reduced_vals[i];
      else
        vals[i] = eval_op(e, vals, k.exprs);
    }
  };
  auto store_at = [&](const KStore& s, const std::vector<int64_t>& idx, const Val& v) {
    store_val(k.params[s.param].dtype, buffers[s.param], offset_of(s.param, idx), v);
  };
  if (!k.has_reduction()) {
    for_each_point(domain, [&](const std::vector<int64_t>& idx) {
      eval_point(idx, 1);
      for (const KStore& s : k.stores) store_at(s, idx, vals[s.expr]);
    });
    return Status::ok();
  }
  // Kernels with reduced dims, one kept point (row) at a time. Pass p (1..passes) runs
  // over the row's reduced points and handles the items of level p - 1: it accumulates
  // the reduce expressions of level p and the reduction stores of level p - 1, and
  // writes the point stores of level p - 1. Row stores are written once, after the
  // pass that finishes their level. Accumulation is in index order (the oracle order).
  std::vector<int64_t> kept_dom = domain, red_dom = domain;
  for (size_t d = 0; d < rank; ++d) (k.reduced[d] ? kept_dom : red_dom)[d] = 1;
  auto varies = [&](const KStore& s) { return k.varies_along_reduced(s); };
  const int passes = k.row_passes();
  std::vector<Val> acc(k.exprs.size());
  std::vector<Val> store_acc(k.stores.size()), part_acc(k.stores.size());
  const int64_t parts = k.column_split_parts();
  int64_t red_rows = 1;
  for (size_t d = 0; d < rank; ++d)
    if (k.reduced[d]) red_rows *= domain[d];
  for_each_point(kept_dom, [&](const std::vector<int64_t>& kp) {
    for (size_t s = 0; s < k.stores.size(); ++s)
      if (k.stores[s].reduce == ReduceKind::none && !varies(k.stores[s]) && level[k.stores[s].expr] == 0) {
        eval_point(kp, 1);
        store_at(k.stores[s], kp, vals[k.stores[s].expr]);
      }
    for (int p = 1; p <= passes; ++p) {
      for (size_t i = 0; i < k.exprs.size(); ++i)
        if (k.exprs[i].kind == KExpr::Kind::reduce && level[i] == p)
          acc[i] = reduce_init(k.exprs[i].reduce, k.exprs[i].dtype);
      for (size_t s = 0; s < k.stores.size(); ++s)
        if (k.stores[s].reduce != ReduceKind::none && level[k.stores[s].expr] == p - 1)
          store_acc[s] = reduce_init(k.stores[s].reduce, k.params[k.stores[s].param].dtype);
      // A split column reduction (Kernel::column_split_parts) sums each partition of
      // flat reduced rows on its own, then folds the partial results in order.
      int64_t flat = 0, part = 0;
      for (size_t s = 0; s < k.stores.size(); ++s)
        if (parts > 0) part_acc[s] = reduce_init(k.stores[s].reduce, k.params[k.stores[s].param].dtype);
      auto fold_partition = [&] {
        for (size_t s = 0; s < k.stores.size(); ++s) {
          const KStore& st = k.stores[s];
          const DType t = k.params[st.param].dtype;
          if (part == 0)
            store_acc[s] = part_acc[s];
          else
            reduce_step(st.reduce, t, store_acc[s], part_acc[s]);
          part_acc[s] = reduce_init(st.reduce, t);
        }
        ++part;
      };
      std::vector<int64_t> idx = kp;
      for_each_point(red_dom, [&](const std::vector<int64_t>& sub) {
        for (size_t d = 0; d < rank; ++d)
          if (k.reduced[d]) idx[d] = sub[d];
        eval_point(idx, p);
        for (size_t i = 0; i < k.exprs.size(); ++i)
          if (k.exprs[i].kind == KExpr::Kind::reduce && level[i] == p)
            reduce_step(k.exprs[i].reduce, k.exprs[i].dtype, acc[i], vals[k.exprs[i].args[0]]);
        if (parts > 0 && flat == (part + 1) * red_rows / parts) fold_partition();
        ++flat;
        for (size_t s = 0; s < k.stores.size(); ++s) {
          const KStore& st = k.stores[s];
          if (level[st.expr] != p - 1) continue;
          if (st.reduce != ReduceKind::none)
            reduce_step(st.reduce, k.params[st.param].dtype, parts > 0 ? part_acc[s] : store_acc[s], vals[st.expr]);
          else if (varies(st))
            store_at(st, idx, vals[st.expr]);
        }
      });
      if (parts > 0) fold_partition();
      for (size_t i = 0; i < k.exprs.size(); ++i)
        if (k.exprs[i].kind == KExpr::Kind::reduce && level[i] == p) {
          reduced_vals[i] = acc[i];
          if (ir::is_float(k.exprs[i].dtype)) reduced_vals[i].f = round_float(k.exprs[i].dtype, acc[i].f);
        }
      for (size_t s = 0; s < k.stores.size(); ++s) {
        const KStore& st = k.stores[s];
        if (st.reduce != ReduceKind::none && level[st.expr] == p - 1) store_at(st, kp, store_acc[s]);
        if (st.reduce == ReduceKind::none && !varies(st) && level[st.expr] == p) {
          eval_point(kp, p + 1);
          store_at(st, kp, vals[st.expr]);
        }
      }
    }
  });
  return Status::ok();
}

std::string structure_key(const Kernel& k) {
  Kernel c = k;
  c.name = "k";
  c.fused_nodes.clear();
  for (size_t i = 0; i < c.params.size(); ++i) c.params[i].name = "p" + std::to_string(i);
  return c.to_string();
}

int64_t param_elements(const Kernel& k, const KernelParam& p) {
  if (k.is_symbolic()) return -1;
  for (const Extent& e : k.domain)
    if (e.constant_value() == 0) return 0;
  int64_t hi = p.offset;
  for (size_t d = 0; d < k.domain.size(); ++d)
    hi += std::max<int64_t>(0, (k.domain[d].constant_value() - 1) * p.strides[d].constant_value());
  return hi + 1;
}

int64_t ipow_wrapping(int64_t base, int64_t e) {
  if (e < 0) {
    if (base == 1) return 1;
    if (base == -1) return (e % 2) ? -1 : 1;
    return 0;
  }
  uint64_t r = 1, b = static_cast<uint64_t>(base);
  while (e) {
    if (e & 1) r *= b;
    b *= b;
    e >>= 1;
  }
  return static_cast<int64_t>(r);
}

int Kernel::add_param(std::string pname, ir::DType dt, std::vector<Extent> strides, bool output, int64_t offset) {
  KernelParam p;
  p.name = std::move(pname);
  p.dtype = dt;
  p.strides = std::move(strides);
  p.offset = offset;
  p.is_output = output;
  params.push_back(std::move(p));
  return static_cast<int>(params.size()) - 1;
}

int Kernel::add_load(int param, int fallback) {
  KExpr e;
  e.kind = KExpr::Kind::load;
  e.param = param;
  if (fallback >= 0) e.args.push_back(fallback);
  e.dtype = params[param].dtype;
  exprs.push_back(std::move(e));
  return static_cast<int>(exprs.size()) - 1;
}

int Kernel::add_constant(double v, ir::DType dt) {
  KExpr e;
  e.kind = KExpr::Kind::constant;
  e.value = v;
  e.dtype = dt;
  exprs.push_back(std::move(e));
  return static_cast<int>(exprs.size()) - 1;
}

int Kernel::add_op(ir::ScalarOp op, std::vector<int> args, ir::DType dt) {
  KExpr e;
  e.kind = KExpr::Kind::op;
  e.op = op;
  e.args = std::move(args);
  e.dtype = dt;
  exprs.push_back(std::move(e));
  return static_cast<int>(exprs.size()) - 1;
}

int Kernel::add_reduce(ReduceKind r, int arg) {
  KExpr e;
  e.kind = KExpr::Kind::reduce;
  e.reduce = r;
  e.args = {arg};
  e.dtype = arg >= 0 && arg < static_cast<int>(exprs.size()) ? exprs[arg].dtype : ir::DType::undefined;
  exprs.push_back(std::move(e));
  return static_cast<int>(exprs.size()) - 1;
}

void Kernel::add_store(int param, int expr, ReduceKind r) { stores.push_back({param, expr, r}); }

}  // namespace kiln::codegen
