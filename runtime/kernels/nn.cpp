// Eager kernels: nn ops (see ir/ops/nn.cpp for the op semantics).
//
// MatMul, Gemm, Conv and the Conv backward ops call oneDNN (runtime/kernels/onednn.h)
// for f32 and bf16 (f32 accumulation); f64 (gradient checks) and f16 use the plain
// loops below with double accumulation. Every other op is a plain loop, OpenMP over
// the outer dimension, computing in f32 for f32/bf16/f16 (bf16 rounded to nearest
// even on store) and in f64 for f64. N-D windowed ops run as 3-D by padding the
// spatial dims with extent-1 dims in front.
#include "ir/ops/nn.h"

#include <omp.h>

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstring>
#include <limits>
#include <map>
#include <string>
#include <type_traits>

#include "runtime/kernels/kernels.h"
#include "runtime/kernels/onednn.h"
#include "runtime/kernels/util.h"

namespace kiln::runtime::kernels {

using ir::DType;
using ir::KernelContext;
using ir::Tensor;

namespace {

bool use_onednn(DType t) { return t == DType::f32 || t == DType::bf16; }

template <typename T>
inline double ld(const T* p, int64_t i) {
  return static_cast<double>(load(p[i]));
}
template <typename T>
inline void st(T* p, int64_t i, double v) {
  p[i] = store<T>(static_cast<compute_t<T>>(v));
}

// ---------------------------------------------------------------------------
// MatMul / Gemm
// ---------------------------------------------------------------------------

struct MatmulShape {
  std::vector<int64_t> ad, bd, cd;  // equal rank, batch dims padded with 1
  int64_t M = 0, K = 0, N = 0;
};

/// Plain-loop batched matmul, double accumulation: a batch + (M, K), b batch + (K, N) with
/// element strides (batch dims of extent 1 broadcast), c contiguous batch + (M, N).
template <typename T, typename O>
void matmul_plain(const T* a, const T* b, O* c, const MatmulShape& s, const std::vector<int64_t>& a_str,
                  const std::vector<int64_t>& b_str, double alpha = 1.0) {
  const int r = static_cast<int>(s.cd.size());
  std::vector<int64_t> batch(s.cd.begin(), s.cd.end() - 2);
  int64_t nb = ir::numel_of(batch);
  const int64_t M = s.M, N = s.N, K = s.K;
#pragma omp parallel for schedule(static) if (nb * M * N * K > (1 << 16))
  for (int64_t bm = 0; bm < nb * M; ++bm) {
    int64_t bi = bm / M, m = bm % M;
    int64_t ao = 0, bo = 0, rem = bi;
    for (int d = r - 3; d >= 0; --d) {
      int64_t cidx = rem % s.cd[d];
      rem /= s.cd[d];
      if (s.ad[d] != 1) ao += cidx * a_str[d];
      if (s.bd[d] != 1) bo += cidx * b_str[d];
    }
    std::vector<double> acc(static_cast<size_t>(N), 0.0);
    for (int64_t k = 0; k < K; ++k) {
      double av = ld(a, ao + m * a_str[r - 2] + k * a_str[r - 1]);
      if (av == 0.0) continue;
      const int64_t brow = bo + k * b_str[r - 2];
      for (int64_t n = 0; n < N; ++n) acc[n] += av * ld(b, brow + n * b_str[r - 1]);
    }
    O* crow = c + (bi * M + m) * N;
    for (int64_t n = 0; n < N; ++n) st(crow, n, alpha * acc[n]);
  }
}

MatmulShape matmul_shape(const std::vector<int64_t>& a, const std::vector<int64_t>& b) {
  MatmulShape s;
  s.ad = a;
  s.bd = b;
  if (s.ad.size() == 1) s.ad.insert(s.ad.begin(), 1);
  if (s.bd.size() == 1) s.bd.push_back(1);
  size_t r = std::max(s.ad.size(), s.bd.size());
  while (s.ad.size() < r) s.ad.insert(s.ad.begin(), 1);
  while (s.bd.size() < r) s.bd.insert(s.bd.begin(), 1);
  s.cd.resize(r);
  for (size_t i = 0; i + 2 < r; ++i) s.cd[i] = s.ad[i] == 1 ? s.bd[i] : s.ad[i];
  s.M = s.ad[r - 2];
  s.K = s.ad[r - 1];
  s.N = s.bd[r - 1];
  s.cd[r - 2] = s.M;
  s.cd[r - 1] = s.N;
  return s;
}

/// A MatMul operand as the product reads it: input `t` viewed as Transpose(t, perm)
/// (perm from kiln_perm_a / kiln_perm_b; empty: t itself), dims and element strides.
struct OperandView {
  std::vector<int64_t> dims, strides;
};
OperandView operand_view(const Tensor& t, const std::vector<int64_t>& perm) {
  OperandView v{t.dims(), ir::strides_of(t.dims())};
  if (perm.empty()) return v;
  OperandView p;
  for (int64_t i : perm) {
    p.dims.push_back(v.dims[static_cast<size_t>(i)]);
    p.strides.push_back(v.strides[static_cast<size_t>(i)]);
  }
  return p;
}

/// Element strides of a view padded as matmul_shape pads its dims: a 1-D A gains a
/// leading M = 1 dim, a 1-D B a trailing N = 1 dim, then leading batch dims of size 1
/// up to rank r (strides of size-1 dims are never used to step; they get the span of
/// the dims inside them, as row-major strides would).
std::vector<int64_t> padded_strides(const OperandView& v, bool is_a, size_t r) {
  std::vector<int64_t> st = v.strides, d = v.dims;
  if (d.size() == 1 && is_a) st.insert(st.begin(), d[0] * st[0]), d.insert(d.begin(), 1);
  if (d.size() == 1 && !is_a) st.push_back(1), d.push_back(1);
  while (st.size() < r) {
    int64_t span = 1;
    for (size_t i = 0; i < d.size(); ++i) span = std::max(span, st[i] * d[i]);
    st.insert(st.begin(), span);
    d.insert(d.begin(), 1);
  }
  return st;
}

/// What a MatMul or Gemm node keeps in its cache slot (KernelContext::cache): the oneDNN
/// product prepared for the input dims and dtypes it was first called with.
struct MatmulNodeCache {
  std::vector<int64_t> a, b, c;  ///< dims of inputs A, B and C (empty without C)
  DType in_dt = DType::undefined, out_dt = DType::undefined;
  std::shared_ptr<onednn::PreparedMatmul> prim;
  /// A node of a symbolic program (an operand's or its result's graph shape names a
  /// symbol): per operand layout (dtypes, dims and strides), the calls seen and the
  /// layout's own product once made (see matmul_into).
  struct Seen {
    int64_t calls = 0;
    std::shared_ptr<onednn::PreparedMatmul> prim;
  };
  std::map<std::vector<int64_t>, Seen> shapes;
};

/// Calls of one operand layout that a symbolic program's product runs on oneDNN's
/// shape-generic primitive (onednn::matmul_any_shape) before it makes the layout's own:
/// a length seen once or twice (the first epoch of variable-length data) costs no
/// primitive creation (0.2-1.8 ms each), one that recurs gets the faster kernel (up to
/// 2x in bf16) from its third call on.
constexpr int64_t kOwnPrimitiveAfter = 3;

/// The operands of a product as one 2-D product (M = the rows of A's leading dims) when
/// A is row-major and B has no batch dims other than 1; false otherwise.
bool as_2d(const onednn::Operand& a, const onednn::Operand& b, const std::vector<int64_t>& c_dims, onednn::Operand& a2,
           onednn::Operand& b2, std::vector<int64_t>& c2) {
  const size_t r = a.dims.size();
  if (r < 2 || b.dims.size() != r || c_dims.size() != r) return false;
  if (r > 2 && !a.strides.empty() && a.strides != ir::strides_of(a.dims)) return false;
  for (size_t i = 0; i + 2 < r; ++i)
    if (b.dims[i] != 1) return false;
  const int64_t K = a.dims[r - 1], N = b.dims[r - 1];
  int64_t M = 1;
  for (size_t i = 0; i + 1 < r; ++i) M *= a.dims[i];
  a2 = {a.data, {M, K}, r == 2 ? a.strides : std::vector<int64_t>{}};
  b2 = {b.data,
        {K, N},
        b.strides.empty() ? std::vector<int64_t>{} : std::vector<int64_t>{b.strides[r - 2], b.strides[r - 1]}};
  c2 = {M, N};
  return true;
}

std::vector<int64_t> dims_of_input(const KernelContext& ctx, int i) {
  return ctx.has_input(i) ? ctx.in(i).dims() : std::vector<int64_t>{};
}

/// The node's prepared product when it was prepared for these inputs, else null.
onednn::PreparedMatmul* cached_matmul(const KernelContext& ctx, DType out_dt) {
  const auto* c = ctx.cache ? static_cast<const MatmulNodeCache*>(ctx.cache->get()) : nullptr;
  if (!c || c->in_dt != ctx.in(0).dtype() || c->out_dt != out_dt || c->a != ctx.in(0).dims() ||
      c->b != ctx.in(1).dims() || (ctx.has_input(2) ? c->c != ctx.in(2).dims() : !c->c.empty()))
    return nullptr;
  return c->prim.get();
}

std::string where(const KernelContext& ctx) { return "node '" + ctx.node.name + "' (" + ctx.node.op + ")"; }

/// `st`, prefixed with where(ctx) when it is an error (the text is built only then: these
/// calls are on every step's path).
Status in_node(Status st, const KernelContext& ctx) { return st ? st : st.with_context(where(ctx)); }

/// Runs the product of operands `a`, `b` (and `bias`) into `y` through a newly prepared
/// oneDNN primitive, kept in the node's cache slot, or through onednn::matmul when no
/// direct primitive applies. Errors: onednn::matmul's.
Status matmul_into(KernelContext& ctx, const onednn::Operand& a, const onednn::Operand& b, Tensor& y,
                   const onednn::Operand* bias) {
  // A node of a symbolic program: an operand's or the result's graph shape names a
  // symbol (a weight gradient X^T dY has a static result and a symbolic K).
  bool symbolic = false;
  for (const auto* vs : {&ctx.node.inputs, &ctx.node.outputs})
    for (const ir::Value* v : *vs)
      for (size_t d = 0; v && d < v->shape.dims.size(); ++d) symbolic = symbolic || v->shape.dims[d].is_symbolic();
  if (ctx.cache && symbolic) {
    // A symbolic program's product: its lengths change from call to call. Each layout
    // runs on the shape-generic primitive for its first calls, then on its own
    // primitive, kept per layout in the node's cache.
    if (!*ctx.cache) *ctx.cache = std::make_shared<MatmulNodeCache>();
    auto& nc = *static_cast<MatmulNodeCache*>(ctx.cache->get());
    // The layout: dtypes, then each operand's dims and strides, each list after its length.
    std::vector<int64_t> key = {static_cast<int64_t>(ctx.in(0).dtype()), static_cast<int64_t>(y.dtype())};
    key.reserve(32);
    for (const std::vector<int64_t>* v :
         {&a.dims, &a.strides, &b.dims, &b.strides, &y.dims(), bias ? &bias->dims : nullptr}) {
      key.push_back(v ? static_cast<int64_t>(v->size()) : -1);
      if (v) key.insert(key.end(), v->begin(), v->end());
    }
    MatmulNodeCache::Seen& seen = nc.shapes[key];
    ++seen.calls;
    if (!seen.prim && seen.calls >= kOwnPrimitiveAfter)
      seen.prim = onednn::prepare_matmul(a, b, y.dims(), ctx.in(0).dtype(), y.dtype(), bias);
    if (seen.prim) return onednn::run_matmul(*seen.prim, a.data, b.data, y.raw(), bias ? bias->data : nullptr);
    onednn::Operand a2, b2;
    std::vector<int64_t> c2;
    if (seen.calls < kOwnPrimitiveAfter && !bias) {
      // One 2-D product where the leading dims flatten (a Linear layer), else the
      // batched one (attention), on the shape-generic primitive of their layout.
      if (as_2d(a, b, y.dims(), a2, b2, c2) &&
          onednn::matmul_any_shape(a2, b2, y.raw(), c2, ctx.in(0).dtype(), y.dtype()))
        return Status::ok();
      if (onednn::matmul_any_shape(a, b, y.raw(), y.dims(), ctx.in(0).dtype(), y.dtype())) return Status::ok();
    }
    return onednn::matmul(a, b, y.raw(), y.dims(), ctx.in(0).dtype(), y.dtype(), bias);
  }
  auto p = onednn::prepare_matmul(a, b, y.dims(), ctx.in(0).dtype(), y.dtype(), bias);
  if (!p) return onednn::matmul(a, b, y.raw(), y.dims(), ctx.in(0).dtype(), y.dtype(), bias);
  if (ctx.cache)
    *ctx.cache = std::make_shared<MatmulNodeCache>(
        MatmulNodeCache{ctx.in(0).dims(), ctx.in(1).dims(), dims_of_input(ctx, 2), ctx.in(0).dtype(), y.dtype(), p});
  return onednn::run_matmul(*p, a.data, b.data, y.raw(), bias ? bias->data : nullptr);
}

Status matmul_kernel(KernelContext& ctx) {
  const Tensor& A = ctx.in(0);
  const Tensor& B = ctx.in(1);
  Tensor& Y = ctx.out(0);
  if (use_onednn(A.dtype()))
    if (onednn::PreparedMatmul* p = cached_matmul(ctx, Y.dtype()))
      return in_node(onednn::run_matmul(*p, A.raw(), B.raw(), Y.raw()), ctx);
  // kiln_perm_a / kiln_perm_b (passes/absorb_transpose.cpp): an operand is read through a
  // transposed view, strided, without a copy.
  const std::vector<int64_t> perm_a = ctx.attrs().get_ints("kiln_perm_a"), perm_b = ctx.attrs().get_ints("kiln_perm_b");
  if ((!perm_a.empty() && perm_a.size() != A.dims().size()) || (!perm_b.empty() && perm_b.size() != B.dims().size()))
    return ctx.fail("kiln_perm_a/kiln_perm_b rank differs from the operand's");
  const OperandView va = operand_view(A, perm_a), vb = operand_view(B, perm_b);
  MatmulShape s = matmul_shape(va.dims, vb.dims);
  if (Y.numel() == 0) return Status::ok();
  if (s.K == 0) {  // an empty sum: zeros (outputs are not zero-filled for this kernel)
    std::memset(Y.raw(), 0, Y.nbytes());
    return Status::ok();
  }
  for (size_t i = 0; i + 2 < s.cd.size(); ++i)
    if (s.ad[i] != 1 && s.bd[i] != 1 && s.ad[i] != s.bd[i])
      return ctx.fail("batch dims " + ir::dims_to_string(A.dims()) + " x " + ir::dims_to_string(B.dims()) +
                      " do not broadcast");
  const bool strided = !perm_a.empty() || !perm_b.empty();
  const std::vector<int64_t> as = strided ? padded_strides(va, true, s.cd.size()) : ir::strides_of(s.ad);
  const std::vector<int64_t> bs = strided ? padded_strides(vb, false, s.cd.size()) : ir::strides_of(s.bd);
  if (use_onednn(A.dtype())) {
    Tensor y = Y.reshaped(s.cd);  // C (..., M, N) as oneDNN sees it: Y's buffer
    return in_node(matmul_into(ctx, {A.raw(), s.ad, strided ? as : std::vector<int64_t>{}},
                               {B.raw(), s.bd, strided ? bs : std::vector<int64_t>{}}, y, nullptr),
                   ctx);
  }
  return dispatch_float(ctx, A.dtype(), [&](auto tag) {
    using T = decltype(tag);
    matmul_plain(A.data<T>(), B.data<T>(), Y.data<T>(), s, as, bs);
  });
}

Status gemm_kernel(KernelContext& ctx) {
  const Tensor& A = ctx.in(0);
  const Tensor& B = ctx.in(1);
  const Tensor* Cm = ctx.has_input(2) ? ctx.inputs[2] : nullptr;
  Tensor& Y = ctx.out(0);
  if (use_onednn(A.dtype()))
    if (onednn::PreparedMatmul* p = cached_matmul(ctx, Y.dtype()))
      return in_node(onednn::run_matmul(*p, A.raw(), B.raw(), Y.raw(), Cm ? Cm->raw() : nullptr), ctx);
  bool ta = ctx.attrs().get_int("transA", 0) != 0, tb = ctx.attrs().get_int("transB", 0) != 0;
  double alpha = ctx.attrs().get_float("alpha", 1.0), beta = ctx.attrs().get_float("beta", 1.0);
  const int64_t M = Y.dim(0), N = Y.dim(1), K = ta ? A.dim(0) : A.dim(1);
  if (Y.numel() == 0) return Status::ok();
  // op(A) (M, K) and op(B) (K, N) as strided views of the stored matrices.
  std::vector<int64_t> as = ta ? std::vector<int64_t>{1, M} : std::vector<int64_t>{K, 1};
  std::vector<int64_t> bs = tb ? std::vector<int64_t>{1, K} : std::vector<int64_t>{N, 1};
  MatmulShape s;
  s.ad = {M, K};
  s.bd = {K, N};
  s.cd = {M, N};
  s.M = M;
  s.K = K;
  s.N = N;
  std::vector<int64_t> cstr;
  if (Cm) {
    if (Cm->dtype() != Y.dtype()) return ctx.fail("C dtype differs from A");
    cstr = broadcast_strides(Cm->dims(), {M, N});
  }
  // prod = op(A) op(B) in f32 (oneDNN) or f64 (loops)
  auto finish = [&](auto tag, auto* prod) {
    using T = decltype(tag);
    T* y = Y.data<T>();
    const T* c = Cm ? Cm->data<T>() : nullptr;
#pragma omp parallel for schedule(static) if (M * N > kParallelThreshold)
    for (int64_t m = 0; m < M; ++m)
      for (int64_t n = 0; n < N; ++n) {
        double v = alpha * static_cast<double>(prod[m * N + n]);
        if (c) v += beta * ld(c, m * cstr[0] + n * cstr[1]);
        st(y, m * N + n, v);
      }
  };
  if (use_onednn(A.dtype()) && K > 0 && !Cm && alpha == 1.0) {
    // Y = op(A) op(B): oneDNN writes Y in its dtype (f32 accumulation), no extra pass.
    return in_node(matmul_into(ctx, {A.raw(), {M, K}, as}, {B.raw(), {K, N}, bs}, Y, nullptr), ctx);
  }
  if (use_onednn(A.dtype()) && K > 0 && Cm && alpha == 1.0 && beta == 1.0 && Cm->numel() > 0) {
    // Y = op(A) op(B) + C with C broadcast from (N), (1, N), (M, 1) or (M, N): C is
    // oneDNN's bias, added to the f32 product before the one rounding to Y's dtype (a
    // Linear layer's forward in one call; the f64 pass below cost more than the product
    // at small sizes: mlp_digits' first layer 18.8 us per call).
    std::vector<int64_t> cd = Cm->dims();
    while (cd.size() < 2) cd.insert(cd.begin(), 1);
    const onednn::Operand bias{Cm->raw(), cd, {}};
    if (matmul_into(ctx, {A.raw(), {M, K}, as}, {B.raw(), {K, N}, bs}, Y, &bias)) return Status::ok();
  }
  if (use_onednn(A.dtype()) && K > 0) {
    std::vector<float> prod(static_cast<size_t>(M * N));
    Status stt =
        onednn::matmul({A.raw(), {M, K}, as}, {B.raw(), {K, N}, bs}, prod.data(), {M, N}, A.dtype(), DType::f32);
    if (!stt) return stt.with_context("node '" + ctx.node.name + "' (Gemm)");
    return dispatch_float(ctx, A.dtype(), [&](auto tag) { finish(tag, prod.data()); });
  }
  return dispatch_float(ctx, A.dtype(), [&](auto tag) {
    using T = decltype(tag);
    std::vector<double> prod(static_cast<size_t>(M * N), 0.0);
    if (K > 0) {
      Tensor tmp(DType::f64, {M, N});
      matmul_plain(A.data<T>(), B.data<T>(), tmp.data<double>(), s, as, bs);
      std::copy(tmp.data<double>(), tmp.data<double>() + M * N, prod.begin());
    }
    finish(tag, prod.data());
  });
}

// ---------------------------------------------------------------------------
// Windows (Conv, pools)
// ---------------------------------------------------------------------------

/// Geometry padded to 3 spatial dims (leading extent-1 dims).
struct Win3 {
  int64_t in[3], out[3], k[3], s[3], d[3], pb[3], pe[3];
};

Win3 to_win3(const ir::WindowGeometry& g, const std::vector<int64_t>& in_spatial,
             const std::vector<int64_t>& out_spatial) {
  Win3 w;
  int n = static_cast<int>(in_spatial.size()), off = 3 - n;
  for (int i = 0; i < 3; ++i) {
    int j = i - off;
    bool real = j >= 0;
    w.in[i] = real ? in_spatial[j] : 1;
    w.out[i] = real ? out_spatial[j] : 1;
    w.k[i] = real ? g.kernel[j] : 1;
    w.s[i] = real ? g.strides[j] : 1;
    w.d[i] = real ? g.dilations[j] : 1;
    w.pb[i] = real ? g.pads_begin[j] : 0;
    w.pe[i] = real ? g.pads_end[j] : 0;
  }
  return w;
}

std::vector<int64_t> spatial(const std::vector<int64_t>& d) { return std::vector<int64_t>(d.begin() + 2, d.end()); }

Expected<ir::WindowGeometry> geometry(const KernelContext& ctx, const std::vector<int64_t>& x_dims,
                                      const std::vector<int64_t>& kernel) {
  std::vector<ir::Dim> in;
  for (int64_t v : spatial(x_dims)) in.push_back(ir::Dim(v));
  auto g = ir::window_geometry(ctx.attrs(), in, kernel);
  if (!g) return ctx.fail(g.message());
  return g;
}

int64_t in_size3(const Win3& w) { return w.in[0] * w.in[1] * w.in[2]; }
int64_t out_size3(const Win3& w) { return w.out[0] * w.out[1] * w.out[2]; }

/// Conv problem: X (N, C, in), W (M, C/G, k), Y (N, M, out).
struct ConvProblem {
  int64_t N, C, M, G;
  Win3 w;
  onednn::ConvGeometry geo;
};

Expected<ConvProblem> conv_problem(const KernelContext& ctx, const std::vector<int64_t>& x,
                                   const std::vector<int64_t>& w, const std::vector<int64_t>& y) {
  ConvProblem p;
  p.N = x[0];
  p.C = x[1];
  p.M = w[0];
  p.G = ctx.attrs().get_int("group", 1);
  if (p.G <= 0 || p.C % p.G || p.M % p.G || w[1] * p.G != p.C)
    return ctx.fail("channels/group mismatch: X " + ir::dims_to_string(x) + ", W " + ir::dims_to_string(w));
  auto g = geometry(ctx, x, spatial(w));
  if (!g) return g.status();
  if (g->out_static() != spatial(y)) return ctx.fail("output extents do not match the window geometry");
  p.w = to_win3(*g, spatial(x), spatial(y));
  p.geo = {x, w, y, p.G, g->strides, g->dilations, g->pads_begin, g->pads_end};
  return p;
}

template <typename T>
void conv_fwd_loop(const ConvProblem& p, const T* x, const T* w, const T* b, T* y) {
  const Win3& q = p.w;
  const int64_t Cg = p.C / p.G, Mg = p.M / p.G, IS = in_size3(q), OS = out_size3(q), KS = q.k[0] * q.k[1] * q.k[2];
#pragma omp parallel for schedule(static)
  for (int64_t nm = 0; nm < p.N * p.M; ++nm) {
    const int64_t n = nm / p.M, m = nm % p.M, g = m / Mg;
    for (int64_t o0 = 0; o0 < q.out[0]; ++o0)
      for (int64_t o1 = 0; o1 < q.out[1]; ++o1)
        for (int64_t o2 = 0; o2 < q.out[2]; ++o2) {
          double acc = b ? ld(b, m) : 0.0;
          for (int64_t c = 0; c < Cg; ++c) {
            const T* xc = x + (n * p.C + g * Cg + c) * IS;
            const T* wc = w + (m * Cg + c) * KS;
            for (int64_t k0 = 0; k0 < q.k[0]; ++k0) {
              int64_t i0 = o0 * q.s[0] - q.pb[0] + k0 * q.d[0];
              if (i0 < 0 || i0 >= q.in[0]) continue;
              for (int64_t k1 = 0; k1 < q.k[1]; ++k1) {
                int64_t i1 = o1 * q.s[1] - q.pb[1] + k1 * q.d[1];
                if (i1 < 0 || i1 >= q.in[1]) continue;
                for (int64_t k2 = 0; k2 < q.k[2]; ++k2) {
                  int64_t i2 = o2 * q.s[2] - q.pb[2] + k2 * q.d[2];
                  if (i2 < 0 || i2 >= q.in[2]) continue;
                  acc += ld(xc, (i0 * q.in[1] + i1) * q.in[2] + i2) * ld(wc, (k0 * q.k[1] + k1) * q.k[2] + k2);
                }
              }
            }
          }
          st(y, nm * OS + (o0 * q.out[1] + o1) * q.out[2] + o2, acc);
        }
  }
}

template <typename T>
void conv_bwd_data_loop(const ConvProblem& p, const T* dy, const T* w, T* dx) {
  const Win3& q = p.w;
  const int64_t Cg = p.C / p.G, Mg = p.M / p.G, IS = in_size3(q), OS = out_size3(q), KS = q.k[0] * q.k[1] * q.k[2];
#pragma omp parallel for schedule(static)
  for (int64_t ng = 0; ng < p.N * p.G; ++ng) {
    const int64_t n = ng / p.G, g = ng % p.G;
    std::vector<double> acc(static_cast<size_t>(Cg * IS), 0.0);
    for (int64_t mm = 0; mm < Mg; ++mm) {
      const int64_t m = g * Mg + mm;
      const T* dym = dy + (n * p.M + m) * OS;
      for (int64_t o0 = 0; o0 < q.out[0]; ++o0)
        for (int64_t o1 = 0; o1 < q.out[1]; ++o1)
          for (int64_t o2 = 0; o2 < q.out[2]; ++o2) {
            double gy = ld(dym, (o0 * q.out[1] + o1) * q.out[2] + o2);
            if (gy == 0.0) continue;
            for (int64_t c = 0; c < Cg; ++c) {
              const T* wc = w + (m * Cg + c) * KS;
              double* ac = acc.data() + c * IS;
              for (int64_t k0 = 0; k0 < q.k[0]; ++k0) {
                int64_t i0 = o0 * q.s[0] - q.pb[0] + k0 * q.d[0];
                if (i0 < 0 || i0 >= q.in[0]) continue;
                for (int64_t k1 = 0; k1 < q.k[1]; ++k1) {
                  int64_t i1 = o1 * q.s[1] - q.pb[1] + k1 * q.d[1];
                  if (i1 < 0 || i1 >= q.in[1]) continue;
                  for (int64_t k2 = 0; k2 < q.k[2]; ++k2) {
                    int64_t i2 = o2 * q.s[2] - q.pb[2] + k2 * q.d[2];
                    if (i2 < 0 || i2 >= q.in[2]) continue;
                    ac[(i0 * q.in[1] + i1) * q.in[2] + i2] += gy * ld(wc, (k0 * q.k[1] + k1) * q.k[2] + k2);
                  }
                }
              }
            }
          }
    }
    T* out = dx + (n * p.C + g * Cg) * IS;
    for (int64_t i = 0; i < Cg * IS; ++i) st(out, i, acc[i]);
  }
}

template <typename T>
void conv_bwd_weight_loop(const ConvProblem& p, const T* dy, const T* x, T* dw) {
  const Win3& q = p.w;
  const int64_t Cg = p.C / p.G, Mg = p.M / p.G, IS = in_size3(q), OS = out_size3(q), KS = q.k[0] * q.k[1] * q.k[2];
#pragma omp parallel for schedule(static)
  for (int64_t m = 0; m < p.M; ++m) {
    const int64_t g = m / Mg;
    for (int64_t c = 0; c < Cg; ++c)
      for (int64_t k0 = 0; k0 < q.k[0]; ++k0)
        for (int64_t k1 = 0; k1 < q.k[1]; ++k1)
          for (int64_t k2 = 0; k2 < q.k[2]; ++k2) {
            double acc = 0;
            for (int64_t n = 0; n < p.N; ++n) {
              const T* dym = dy + (n * p.M + m) * OS;
              const T* xc = x + (n * p.C + g * Cg + c) * IS;
              for (int64_t o0 = 0; o0 < q.out[0]; ++o0) {
                int64_t i0 = o0 * q.s[0] - q.pb[0] + k0 * q.d[0];
                if (i0 < 0 || i0 >= q.in[0]) continue;
                for (int64_t o1 = 0; o1 < q.out[1]; ++o1) {
                  int64_t i1 = o1 * q.s[1] - q.pb[1] + k1 * q.d[1];
                  if (i1 < 0 || i1 >= q.in[1]) continue;
                  for (int64_t o2 = 0; o2 < q.out[2]; ++o2) {
                    int64_t i2 = o2 * q.s[2] - q.pb[2] + k2 * q.d[2];
                    if (i2 < 0 || i2 >= q.in[2]) continue;
                    acc += ld(dym, (o0 * q.out[1] + o1) * q.out[2] + o2) * ld(xc, (i0 * q.in[1] + i1) * q.in[2] + i2);
                  }
                }
              }
            }
            st(dw, (m * Cg + c) * KS + (k0 * q.k[1] + k1) * q.k[2] + k2, acc);
          }
  }
}

/// What a Conv, ConvGradInput or ConvGradWeight node keeps in its cache slot: the oneDNN
/// primitive prepared for the dims and dtypes it was first called with.
struct ConvNodeCache {
  std::vector<int64_t> x, w, y;
  std::array<DType, 4> dts;
  bool bias;
  std::shared_ptr<onednn::PreparedConv> prim;
};

/// Runs the node's convolution through oneDNN: the primitive in the node's cache slot when
/// it was prepared for these dims, dtypes and bias, else conv_problem's checks and a newly
/// prepared primitive (kept in the slot). a, b, bias, out: as onednn::run_conv; dts: their
/// dtypes (the bias's undefined without one). `mixed`: the node is marked kiln_compute_f32
/// (below the convolution break-even): oneDNN's f32 primitive runs on operands of either
/// float dtype, the bf16 ones widened (and a bf16 result narrowed) around it.
Status onednn_conv(KernelContext& ctx, onednn::ConvDirection dir, const std::vector<int64_t>& x,
                   const std::vector<int64_t>& w, const std::vector<int64_t>& y, const std::array<DType, 4>& dts,
                   bool mixed, const void* a, const void* b, const void* bias, void* out) {
  auto* c = ctx.cache ? static_cast<ConvNodeCache*>(ctx.cache->get()) : nullptr;
  if (!c || c->x != x || c->w != w || c->y != y || c->dts != dts || c->bias != (bias != nullptr)) {
    auto p = conv_problem(ctx, x, w, y);
    if (!p) return p.status();
    const DType dt = dts[0];
    const DType compute = mixed ? DType::f32 : dt;
    auto fresh = std::make_shared<ConvNodeCache>(ConvNodeCache{
        x, w, y, dts, bias != nullptr, onednn::prepare_conv(dir, p->geo, dt, bias != nullptr, compute, &dts)});
    if (ctx.cache) *ctx.cache = fresh;
    return in_node(onednn::run_conv(*fresh->prim, a, b, bias, out), ctx);
  }
  return in_node(onednn::run_conv(*c->prim, a, b, bias, out), ctx);
}

/// The operand dtypes of a convolution node, checked: all equal, or, for a node marked
/// kiln_compute_f32 (autocast rule (e)), each f32 or bf16. Errors name the operands.
/// `mixed`: the node's kiln_compute_f32 mark.
Expected<std::array<DType, 4>> conv_dtypes(const KernelContext& ctx, bool mixed, const char* names, DType a, DType b,
                                           DType out, const Tensor* bias) {
  std::array<DType, 4> d = {a, b, out, bias ? bias->dtype() : DType::undefined};
  if (mixed) {
    for (int i = 0; i < (bias ? 4 : 3); ++i)
      if (!use_onednn(d[i]))
        return ctx.fail(std::string("a convolution computed in f32 (kiln_compute_f32) takes f32 or bf16 operands, ") +
                        names + " are " + ir::dtype_name(a) + ", " + ir::dtype_name(b) +
                        (bias ? std::string(", ") + ir::dtype_name(d[3]) : std::string()));
    return d;
  }
  if (a != b || (bias && d[3] != a)) return ctx.fail(std::string(names) + " differ in dtype");
  return d;
}

Status conv_kernel(KernelContext& ctx) {
  const Tensor& X = ctx.in(0);
  const Tensor& W = ctx.in(1);
  const Tensor* B = ctx.has_input(2) ? ctx.inputs[2] : nullptr;
  Tensor& Y = ctx.out(0);
  if (B && B->numel() != W.dim(0)) return ctx.fail("B must be (M)");
  const bool mixed = ctx.attrs().has("kiln_compute_f32");
  auto dts = conv_dtypes(ctx, mixed, B ? "X, W and B" : "X and W", X.dtype(), W.dtype(), Y.dtype(), B);
  if (!dts) return dts.status();
  if ((mixed || use_onednn(X.dtype())) && X.numel() > 0 && Y.numel() > 0)
    return onednn_conv(ctx, onednn::ConvDirection::forward, X.dims(), W.dims(), Y.dims(), *dts, mixed, X.raw(), W.raw(),
                       B ? B->raw() : nullptr, Y.raw());
  auto p = conv_problem(ctx, X.dims(), W.dims(), Y.dims());
  if (!p) return p.status();
  if (Y.numel() == 0) return Status::ok();
  return dispatch_float(ctx, X.dtype(), [&](auto tag) {
    using T = decltype(tag);
    conv_fwd_loop<T>(*p, X.data<T>(), W.data<T>(), B ? B->data<T>() : nullptr, Y.data<T>());
  });
}

Status conv_grad_input_kernel(KernelContext& ctx) {
  const Tensor& dY = ctx.in(0);
  const Tensor& W = ctx.in(1);
  Tensor& dX = ctx.out(0);
  const bool mixed = ctx.attrs().has("kiln_compute_f32");
  auto dts = conv_dtypes(ctx, mixed, "dY and W", dY.dtype(), W.dtype(), dX.dtype(), nullptr);
  if (!dts) return dts.status();
  if ((mixed || use_onednn(dY.dtype())) && dX.numel() > 0 && dY.numel() > 0)
    return onednn_conv(ctx, onednn::ConvDirection::backward_data, dX.dims(), W.dims(), dY.dims(), *dts, mixed, dY.raw(),
                       W.raw(), nullptr, dX.raw());
  auto p = conv_problem(ctx, dX.dims(), W.dims(), dY.dims());
  if (!p) return p.status();
  if (dX.numel() == 0 || dY.numel() == 0) return Status::ok();
  return dispatch_float(ctx, dY.dtype(), [&](auto tag) {
    using T = decltype(tag);
    conv_bwd_data_loop<T>(*p, dY.data<T>(), W.data<T>(), dX.data<T>());
  });
}

Status conv_grad_weight_kernel(KernelContext& ctx) {
  const Tensor& dY = ctx.in(0);
  const Tensor& X = ctx.in(1);
  Tensor& dW = ctx.out(0);
  const bool mixed = ctx.attrs().has("kiln_compute_f32");
  auto dts = conv_dtypes(ctx, mixed, "dY and X", dY.dtype(), X.dtype(), dW.dtype(), nullptr);
  if (!dts) return dts.status();
  if ((mixed || use_onednn(dY.dtype())) && dW.numel() > 0 && dY.numel() > 0)
    return onednn_conv(ctx, onednn::ConvDirection::backward_weights, X.dims(), dW.dims(), dY.dims(), *dts, mixed,
                       dY.raw(), X.raw(), nullptr, dW.raw());
  auto p = conv_problem(ctx, X.dims(), dW.dims(), dY.dims());
  if (!p) return p.status();
  if (dW.numel() == 0 || dY.numel() == 0) return Status::ok();
  return dispatch_float(ctx, dY.dtype(), [&](auto tag) {
    using T = decltype(tag);
    conv_bwd_weight_loop<T>(*p, dY.data<T>(), X.data<T>(), dW.data<T>());
  });
}

// ---- Pools ----

struct PoolProblem {
  int64_t NC;
  Win3 w;
};

Expected<PoolProblem> pool_problem(const KernelContext& ctx, const std::vector<int64_t>& x,
                                   const std::vector<int64_t>& y, const std::vector<int64_t>& kernel) {
  auto g = geometry(ctx, x, kernel);
  if (!g) return g.status();
  if (g->out_static() != spatial(y)) return ctx.fail("output extents do not match the window geometry");
  return PoolProblem{x[0] * x[1], to_win3(*g, spatial(x), spatial(y))};
}

/// Calls f(input offset) for each valid input position of output window (o0, o1, o2).
template <typename F>
inline void for_window(const Win3& q, int64_t o0, int64_t o1, int64_t o2, F&& f) {
  for (int64_t k0 = 0; k0 < q.k[0]; ++k0) {
    int64_t i0 = o0 * q.s[0] - q.pb[0] + k0 * q.d[0];
    if (i0 < 0 || i0 >= q.in[0]) continue;
    for (int64_t k1 = 0; k1 < q.k[1]; ++k1) {
      int64_t i1 = o1 * q.s[1] - q.pb[1] + k1 * q.d[1];
      if (i1 < 0 || i1 >= q.in[1]) continue;
      for (int64_t k2 = 0; k2 < q.k[2]; ++k2) {
        int64_t i2 = o2 * q.s[2] - q.pb[2] + k2 * q.d[2];
        if (i2 < 0 || i2 >= q.in[2]) continue;
        f((i0 * q.in[1] + i1) * q.in[2] + i2);
      }
    }
  }
}

/// Number of window taps that fall in [lo, hi) along dim i.
inline int64_t taps_in(const Win3& q, int i, int64_t o, int64_t lo, int64_t hi) {
  int64_t n = 0;
  for (int64_t k = 0; k < q.k[i]; ++k) {
    int64_t p = o * q.s[i] - q.pb[i] + k * q.d[i];
    n += (p >= lo && p < hi);
  }
  return n;
}

/// AveragePool divisor of window (o0, o1, o2): valid taps, or (count_include_pad) taps
/// inside the padded input, as PyTorch counts them.
inline double avg_divisor(const Win3& q, bool include_pad, int64_t o0, int64_t o1, int64_t o2) {
  int64_t o[3] = {o0, o1, o2};
  double d = 1;
  for (int i = 0; i < 3; ++i)
    d *= static_cast<double>(include_pad ? taps_in(q, i, o[i], -q.pb[i], q.in[i] + q.pe[i])
                                         : taps_in(q, i, o[i], 0, q.in[i]));
  return d;
}

/// Index (within one (n, c) slice) of the first maximum of a window; -1 when empty.
template <typename T>
inline int64_t window_argmax(const Win3& q, const T* xs, int64_t o0, int64_t o1, int64_t o2, double& best) {
  int64_t arg = -1;
  best = -std::numeric_limits<double>::infinity();
  for_window(q, o0, o1, o2, [&](int64_t i) {
    double v = ld(xs, i);
    if (arg < 0 || v > best || (std::isnan(v) && !std::isnan(best))) {
      best = v;
      arg = i;
    }
  });
  return arg;
}

/// Taps [lo, hi) of window o along dim i that fall inside the input.
inline void tap_range(const Win3& q, int i, int64_t o, int64_t& lo, int64_t& hi) {
  const int64_t base = o * q.s[i] - q.pb[i];
  lo = base >= 0 ? 0 : (-base + q.d[i] - 1) / q.d[i];
  hi = base > q.in[i] - 1 ? 0 : std::min(q.k[i], (q.in[i] - 1 - base) / q.d[i] + 1);
  if (hi < lo) hi = lo;
}

/// Valid tap ranges of every output position along each dim (tap_range), computed once
/// per call: [lo, hi) of output o along dim i is r[i][2 o], r[i][2 o + 1].
struct TapRanges {
  std::vector<int64_t> r[3];
  explicit TapRanges(const Win3& q) {
    for (int i = 0; i < 3; ++i) {
      r[i].resize(static_cast<size_t>(2 * q.out[i]));
      for (int64_t o = 0; o < q.out[i]; ++o) tap_range(q, i, o, r[i][2 * o], r[i][2 * o + 1]);
    }
  }
};

/// window_argmax for f32 over precomputed tap ranges (no per-tap bounds checks, divisions
/// or double conversions); the same taps in the same order, so the same first maximum
/// (and the first NaN wins, as there).
/// An f32 or bf16 element as f32 (exact).
inline float pool_f32(float v) { return v; }
inline float pool_f32(bf16_t v) { return ir::bf16_to_f32(v.bits); }

template <typename T>
inline int64_t window_argmax_f32(const Win3& q, const TapRanges& t, const T* xs, int64_t o0, int64_t o1, int64_t o2,
                                 float& best) {
  const int64_t lo[3] = {t.r[0][2 * o0], t.r[1][2 * o1], t.r[2][2 * o2]};
  const int64_t hi[3] = {t.r[0][2 * o0 + 1], t.r[1][2 * o1 + 1], t.r[2][2 * o2 + 1]};
  int64_t arg = -1;
  best = -std::numeric_limits<float>::infinity();
  const int64_t b0 = o0 * q.s[0] - q.pb[0], b1 = o1 * q.s[1] - q.pb[1], b2 = o2 * q.s[2] - q.pb[2];
  for (int64_t k0 = lo[0]; k0 < hi[0]; ++k0) {
    const int64_t i0 = b0 + k0 * q.d[0];
    for (int64_t k1 = lo[1]; k1 < hi[1]; ++k1) {
      const int64_t row = (i0 * q.in[1] + b1 + k1 * q.d[1]) * q.in[2] + b2;
      for (int64_t k2 = lo[2]; k2 < hi[2]; ++k2) {
        const int64_t i = row + k2 * q.d[2];
        const float v = pool_f32(xs[i]);
        if (arg < 0 || v > best || (v != v && best == best)) {
          best = v;
          arg = i;
        }
      }
    }
  }
  return arg;
}

/// Output columns [lo, hi) along the last dim whose windows have every tap inside the
/// input (tap range [0, k)): the columns maxpool_row_f32 handles branch-free.
std::pair<int64_t, int64_t> interior_columns(const Win3& q, const TapRanges& t) {
  int64_t lo = 0, hi = q.out[2];
  auto full = [&](int64_t o) { return t.r[2][2 * o] == 0 && t.r[2][2 * o + 1] == q.k[2]; };
  while (lo < hi && !full(lo)) ++lo;
  while (hi > lo && !full(hi - 1)) --hi;
  for (int64_t o = lo; o < hi; ++o)
    if (!full(o)) return {0, 0};
  return {lo, hi};
}

/// window_argmax_f32 for every column of output row (o0, o1) of one plane `xs`: `best`
/// and `arg` (plane offsets, -1 for an empty window) get out[2] entries. The interior
/// columns [c.first, c.second) are computed tap by tap across the row with selects
/// instead of a branch per tap (a max pool's comparisons are unpredictable), in the same
/// tap order and with the same rule (first maximum; the first NaN wins), so the results
/// are window_argmax_f32's; the edge columns call it.
template <typename T>
void maxpool_row_f32(const Win3& q, const TapRanges& t, std::pair<int64_t, int64_t> c, const T* xs, int64_t o0,
                     int64_t o1, float* best, int64_t* arg) {
  const int64_t lo0 = t.r[0][2 * o0], hi0 = t.r[0][2 * o0 + 1], lo1 = t.r[1][2 * o1], hi1 = t.r[1][2 * o1 + 1];
  if (lo0 >= hi0 || lo1 >= hi1) c = {0, 0};
  for (int64_t o2 = 0; o2 < q.out[2]; ++o2)
    if (o2 < c.first || o2 >= c.second) arg[o2] = window_argmax_f32(q, t, xs, o0, o1, o2, best[o2]);
  if (c.first >= c.second) return;
  // Offsets of an interior window's taps from its column's origin, in window order.
  int64_t off[64];
  int64_t taps = 0;
  const int64_t b0 = o0 * q.s[0] - q.pb[0], b1 = o1 * q.s[1] - q.pb[1];
  const bool small = (hi0 - lo0) * (hi1 - lo1) * q.k[2] <= 64;
  if (!small) {  // a large window: the per-column routine
    for (int64_t o2 = c.first; o2 < c.second; ++o2) arg[o2] = window_argmax_f32(q, t, xs, o0, o1, o2, best[o2]);
    return;
  }
  for (int64_t k0 = lo0; k0 < hi0; ++k0)
    for (int64_t k1 = lo1; k1 < hi1; ++k1)
      for (int64_t k2 = 0; k2 < q.k[2]; ++k2)
        off[taps++] = ((b0 + k0 * q.d[0]) * q.in[1] + b1 + k1 * q.d[1]) * q.in[2] - q.pb[2] + k2 * q.d[2];
  // Up to 16 columns at a time, tap by tap across them: each column's taps stay in window
  // order (the same first maximum), while the columns' select chains are independent, so
  // they overlap instead of one column's 9 dependent selects setting the pace.
  constexpr int64_t kCols = 16;
  const int64_t s2 = q.s[2];
  for (int64_t c0 = c.first; c0 < c.second; c0 += kCols) {
    const int64_t cn = std::min(kCols, c.second - c0);
    const T* __restrict p = xs + c0 * s2;
    float b[kCols];
    int64_t a[kCols];
    for (int64_t j = 0; j < cn; ++j) {
      b[j] = pool_f32(p[j * s2 + off[0]]);
      a[j] = off[0];
    }
    for (int64_t k = 1; k < taps; ++k) {
      const int64_t ok = off[k];
      for (int64_t j = 0; j < cn; ++j) {
        // Selects by masks, not branches (a compiler turns `take ? v : b` back into a jump).
        const float v = pool_f32(p[j * s2 + ok]);
        // v > b, or v is NaN and b is not: b >= v fails exactly then, unless b is NaN.
        const bool take = !(b[j] >= v) & (b[j] == b[j]);
        const uint32_t m = 0u - static_cast<uint32_t>(take);
        const int64_t m64 = -static_cast<int64_t>(take);
        b[j] = std::bit_cast<float>((std::bit_cast<uint32_t>(v) & m) | (std::bit_cast<uint32_t>(b[j]) & ~m));
        a[j] = (ok & m64) | (a[j] & ~m64);
      }
    }
    for (int64_t j = 0; j < cn; ++j) {
      best[c0 + j] = b[j];
      arg[c0 + j] = a[j] + (c0 + j) * s2;
    }
  }
}

/// Calls fn(lo, hi) on contiguous ranges of [0, planes) that cover it, one per OpenMP
/// thread when `parallel` (static split), else once over the whole range.
template <typename F>
void for_plane_ranges(int64_t planes, bool parallel, F&& fn) {
  if (!parallel || planes < 2) {
    fn(0, planes);
    return;
  }
#pragma omp parallel
  {
    const int64_t t = omp_get_thread_num(), nt = omp_get_num_threads();
    const int64_t lo = planes * t / nt, hi = planes * (t + 1) / nt;
    if (lo < hi) fn(lo, hi);
  }
}

/// This thread's f32 scratch buffer `slot` (0-1) with at least n elements (kept between
/// calls; a pool's row of maxima).
float* scratch_f32(int slot, int64_t n) {
  thread_local std::vector<float> buf[2];
  if (static_cast<int64_t>(buf[slot].size()) < n) buf[slot].resize(static_cast<size_t>(n));
  return buf[slot].data();
}
/// This thread's int64 scratch vector `slot`, resized to n.
std::vector<int64_t>& scratch_i64(int slot, int64_t n) {
  thread_local std::vector<int64_t> buf[2];
  buf[slot].resize(static_cast<size_t>(n));
  return buf[slot];
}

/// window_argmax, by window_argmax_f32 for f32 (the common case).
template <typename T>
inline int64_t window_argmax_of(const Win3& q, const TapRanges& t, const T* xs, int64_t o0, int64_t o1, int64_t o2,
                                double& best) {
  if constexpr (std::is_same_v<T, float>) {
    float b;
    const int64_t a = window_argmax_f32(q, t, xs, o0, o1, o2, b);
    best = b;
    return a;
  } else {
    return window_argmax(q, xs, o0, o1, o2, best);
  }
}

Status maxpool_kernel(KernelContext& ctx) {
  const Tensor& X = ctx.in(0);
  Tensor& Y = ctx.out(0);
  Tensor* I = ctx.outputs.size() > 1 && ctx.outputs[1].defined() ? &ctx.outputs[1] : nullptr;
  // storage_order=1: Indices count the spatial position column-major (ONNX MaxPool:
  // for 2-D, h + w * H), still offset by (n * C + c) * H * W.
  const bool col_major = ctx.attrs().get_int("storage_order", 0) != 0;
  const std::vector<int64_t> sp(X.dims().begin() + 2, X.dims().end());
  auto spatial_index = [&](int64_t a) {
    if (!col_major) return a;
    int64_t r = 0, stride = 1;
    std::vector<int64_t> m(sp.size());
    for (size_t j = sp.size(); j-- > 0;) {  // row-major flat index -> multi-index
      m[j] = a % sp[j];
      a /= sp[j];
    }
    for (size_t j = 0; j < sp.size(); ++j) {  // first spatial dim fastest
      r += m[j] * stride;
      stride *= sp[j];
    }
    return r;
  };
  const bool integer = ir::is_integer(X.dtype());
  auto p = pool_problem(ctx, X.dims(), Y.dims(), ctx.attrs().get_ints("kernel_shape"));
  if (!p) return p.status();
  const Win3& q = p->w;
  const int64_t IS = in_size3(q), OS = out_size3(q);
  const TapRanges taps(q);
  if (X.dtype() == ir::DType::f32 || X.dtype() == ir::DType::bf16) {
    // f32 and bf16 (widened on load, exactly; each maximum is one of the inputs, so its
    // bf16 store is exact): the row routine, one thread's planes at a time.
    const auto cols = interior_columns(q, taps);
    int64_t* idx = I ? I->data<int64_t>() : nullptr;
    // Work: every output reads its window's taps (a 3x3 pool is 9 loads and selects each).
    const int64_t work = p->NC * OS * q.k[0] * q.k[1] * q.k[2];
    auto run = [&](auto tag) {
      using T = decltype(tag);
      const T* x = X.data<T>();
      T* y = Y.data<T>();
      for_plane_ranges(p->NC, work >= kParallelThreshold, [&](int64_t lo, int64_t hi) {
        std::vector<int64_t>& arg = scratch_i64(0, q.out[2]);
        float* best = scratch_f32(0, q.out[2]);
        for (int64_t nc = lo; nc < hi; ++nc)
          for (int64_t o0 = 0; o0 < q.out[0]; ++o0)
            for (int64_t o1 = 0; o1 < q.out[1]; ++o1) {
              const int64_t r = (nc * q.out[0] + o0) * q.out[1] + o1;
              T* yr = y + r * q.out[2];
              if constexpr (std::is_same_v<T, float>) {
                maxpool_row_f32(q, taps, cols, x + nc * IS, o0, o1, yr, arg.data());
              } else {
                maxpool_row_f32(q, taps, cols, x + nc * IS, o0, o1, best, arg.data());
                for (int64_t o2 = 0; o2 < q.out[2]; ++o2) yr[o2].bits = ir::f32_to_bf16(best[o2]);
              }
              if (idx)
                for (int64_t o2 = 0; o2 < q.out[2]; ++o2)
                  idx[r * q.out[2] + o2] = arg[o2] < 0 ? -1 : nc * IS + spatial_index(arg[o2]);
            }
      });
    };
    if (X.dtype() == ir::DType::f32)
      run(float{});
    else
      run(bf16_t{});
    return Status::ok();
  }
  return dispatch_numeric(ctx, X.dtype(), [&](auto tag) {
    using T = decltype(tag);
    const T* x = X.data<T>();
    T* y = Y.data<T>();
    int64_t* idx = I ? I->data<int64_t>() : nullptr;
#pragma omp parallel for schedule(static)
    for (int64_t nc = 0; nc < p->NC; ++nc)
      for (int64_t o0 = 0; o0 < q.out[0]; ++o0)
        for (int64_t o1 = 0; o1 < q.out[1]; ++o1)
          for (int64_t o2 = 0; o2 < q.out[2]; ++o2) {
            double best;
            int64_t a = window_argmax_of(q, taps, x + nc * IS, o0, o1, o2, best);
            int64_t o = nc * OS + (o0 * q.out[1] + o1) * q.out[2] + o2;
            if (a < 0 && integer) best = 0;  // empty window (all padding): no -inf in integers
            st(y, o, best);
            if (idx) idx[o] = a < 0 ? -1 : nc * IS + spatial_index(a);
          }
  });
}

Status maxpool_grad_kernel(KernelContext& ctx) {
  const Tensor& dY = ctx.in(0);
  const Tensor& X = ctx.in(1);
  Tensor& dX = ctx.out(0);
  if (dY.dtype() != X.dtype()) return ctx.fail("dY and X differ in dtype");
  auto p = pool_problem(ctx, X.dims(), dY.dims(), ctx.attrs().get_ints("kernel_shape"));
  if (!p) return p.status();
  const Win3& q = p->w;
  const int64_t IS = in_size3(q), OS = out_size3(q);
  const TapRanges taps(q);
  if (X.dtype() == ir::DType::f32 || X.dtype() == ir::DType::bf16) {
    // Windows that do not overlap give each input at most one addend: dX is written
    // directly (0 + dy is exact, in bf16 too); overlapping ones sum in f64, as below, and
    // are stored as the generic code stores them (bf16: through f32). bf16 X and dY are
    // widened on load (exact).
    bool disjoint = true;
    for (int i = 0; i < 3; ++i) disjoint &= q.out[i] <= 1 || q.s[i] >= (q.k[i] - 1) * q.d[i] + 1;
    const auto cols = interior_columns(q, taps);
    const int64_t work = p->NC * (IS + OS * q.k[0] * q.k[1] * q.k[2]);
    auto run = [&](auto tag) {
      using T = decltype(tag);
      const T* x = X.data<T>();
      const T* dy = dY.data<T>();
      T* dx = dX.data<T>();
      for_plane_ranges(p->NC, work >= kParallelThreshold, [&](int64_t lo, int64_t hi) {
        float* best = scratch_f32(0, q.out[2]);
        std::vector<int64_t>& arg = scratch_i64(0, q.out[2]);
        thread_local std::vector<double> acc;
        for (int64_t nc = lo; nc < hi; ++nc) {
          T* dxp = dx + nc * IS;
          if (disjoint)
            std::fill(dxp, dxp + IS, T{});  // +0 in both dtypes
          else
            acc.assign(static_cast<size_t>(IS), 0.0);
          for (int64_t o0 = 0; o0 < q.out[0]; ++o0)
            for (int64_t o1 = 0; o1 < q.out[1]; ++o1) {
              maxpool_row_f32(q, taps, cols, x + nc * IS, o0, o1, best, arg.data());
              const T* dyr = dy + nc * OS + (o0 * q.out[1] + o1) * q.out[2];
              for (int64_t o2 = 0; o2 < q.out[2]; ++o2) {
                if (arg[o2] < 0) continue;
                if (!disjoint)
                  acc[arg[o2]] += pool_f32(dyr[o2]);
                else if constexpr (std::is_same_v<T, float>)
                  dxp[arg[o2]] += dyr[o2];
                else  // the input's only addend: 0 + dy, as the generic code stores it
                  dxp[arg[o2]].bits = ir::f32_to_bf16(0.0f + pool_f32(dyr[o2]));
              }
            }
          if (!disjoint) {
            for (int64_t i = 0; i < IS; ++i) {
              if constexpr (std::is_same_v<T, float>)
                dxp[i] = static_cast<float>(acc[i]);
              else
                dxp[i].bits = ir::f32_to_bf16(static_cast<float>(acc[i]));
            }
          }
        }
      });
    };
    if (X.dtype() == ir::DType::f32)
      run(float{});
    else
      run(bf16_t{});
    return Status::ok();
  }
  return dispatch_float(ctx, X.dtype(), [&](auto tag) {
    using T = decltype(tag);
    const T* x = X.data<T>();
    const T* dy = dY.data<T>();
    T* dx = dX.data<T>();
#pragma omp parallel for schedule(static)
    for (int64_t nc = 0; nc < p->NC; ++nc) {
      std::vector<double> acc(static_cast<size_t>(IS), 0.0);
      for (int64_t o0 = 0; o0 < q.out[0]; ++o0)
        for (int64_t o1 = 0; o1 < q.out[1]; ++o1)
          for (int64_t o2 = 0; o2 < q.out[2]; ++o2) {
            double best;
            const int64_t a = window_argmax_of(q, taps, x + nc * IS, o0, o1, o2, best);
            if (a >= 0) acc[a] += ld(dy, nc * OS + (o0 * q.out[1] + o1) * q.out[2] + o2);
          }
      for (int64_t i = 0; i < IS; ++i) st(dx, nc * IS + i, acc[i]);
    }
  });
}

Status avgpool_kernel(KernelContext& ctx) {
  const Tensor& X = ctx.in(0);
  Tensor& Y = ctx.out(0);
  auto p = pool_problem(ctx, X.dims(), Y.dims(), ctx.attrs().get_ints("kernel_shape"));
  if (!p) return p.status();
  const Win3& q = p->w;
  const bool inc = ctx.attrs().get_int("count_include_pad", 0) != 0;
  const int64_t IS = in_size3(q), OS = out_size3(q);
  return dispatch_float(ctx, X.dtype(), [&](auto tag) {
    using T = decltype(tag);
    const T* x = X.data<T>();
    T* y = Y.data<T>();
#pragma omp parallel for schedule(static)
    for (int64_t nc = 0; nc < p->NC; ++nc)
      for (int64_t o0 = 0; o0 < q.out[0]; ++o0)
        for (int64_t o1 = 0; o1 < q.out[1]; ++o1)
          for (int64_t o2 = 0; o2 < q.out[2]; ++o2) {
            double s = 0;
            for_window(q, o0, o1, o2, [&](int64_t i) { s += ld(x + nc * IS, i); });
            double d = avg_divisor(q, inc, o0, o1, o2);
            st(y, nc * OS + (o0 * q.out[1] + o1) * q.out[2] + o2, d > 0 ? s / d : 0.0);
          }
  });
}

Status avgpool_grad_kernel(KernelContext& ctx) {
  const Tensor& dY = ctx.in(0);
  Tensor& dX = ctx.out(0);
  auto p = pool_problem(ctx, dX.dims(), dY.dims(), ctx.attrs().get_ints("kernel_shape"));
  if (!p) return p.status();
  const Win3& q = p->w;
  const bool inc = ctx.attrs().get_int("count_include_pad", 0) != 0;
  const int64_t IS = in_size3(q), OS = out_size3(q);
  return dispatch_float(ctx, dY.dtype(), [&](auto tag) {
    using T = decltype(tag);
    const T* dy = dY.data<T>();
    T* dx = dX.data<T>();
#pragma omp parallel for schedule(static)
    for (int64_t nc = 0; nc < p->NC; ++nc) {
      std::vector<double> acc(static_cast<size_t>(IS), 0.0);
      for (int64_t o0 = 0; o0 < q.out[0]; ++o0)
        for (int64_t o1 = 0; o1 < q.out[1]; ++o1)
          for (int64_t o2 = 0; o2 < q.out[2]; ++o2) {
            double d = avg_divisor(q, inc, o0, o1, o2);
            if (d <= 0) continue;
            double g = ld(dy, nc * OS + (o0 * q.out[1] + o1) * q.out[2] + o2) / d;
            for_window(q, o0, o1, o2, [&](int64_t i) { acc[i] += g; });
          }
      for (int64_t i = 0; i < IS; ++i) st(dx, nc * IS + i, acc[i]);
    }
  });
}

Status global_avgpool_kernel(KernelContext& ctx) {
  const Tensor& X = ctx.in(0);
  Tensor& Y = ctx.out(0);
  const int64_t NC = X.dim(0) * X.dim(1), S = NC ? X.numel() / NC : 0;
  return dispatch_float(ctx, X.dtype(), [&](auto tag) {
    using T = decltype(tag);
    const T* x = X.data<T>();
    T* y = Y.data<T>();
#pragma omp parallel for schedule(static) if (X.numel() > kParallelThreshold)
    for (int64_t nc = 0; nc < NC; ++nc) {
      double s = 0;
      for (int64_t i = 0; i < S; ++i) s += ld(x, nc * S + i);
      st(y, nc, S ? s / static_cast<double>(S) : 0.0);
    }
  });
}

// ---------------------------------------------------------------------------
// Normalization
// ---------------------------------------------------------------------------

bool bn_training(const KernelContext& ctx) { return ctx.training || ctx.attrs().get_int("training_mode", 0) != 0; }

/// Per-channel mean and biased variance of X viewed as (N, C, S), in double.
template <typename T>
void channel_stats(const T* x, int64_t N, int64_t C, int64_t S, std::vector<double>& mean, std::vector<double>& var) {
  mean.assign(C, 0.0);
  var.assign(C, 0.0);
  const double cnt = static_cast<double>(N * S);
#pragma omp parallel for schedule(static)
  for (int64_t c = 0; c < C; ++c) {
    double s = 0;
    for (int64_t n = 0; n < N; ++n)
      for (int64_t i = 0; i < S; ++i) s += ld(x, (n * C + c) * S + i);
    double mu = cnt > 0 ? s / cnt : 0.0, v = 0;
    for (int64_t n = 0; n < N; ++n)
      for (int64_t i = 0; i < S; ++i) {
        double d = ld(x, (n * C + c) * S + i) - mu;
        v += d * d;
      }
    mean[c] = mu;
    var[c] = cnt > 0 ? v / cnt : 0.0;
  }
}

/// Reads a 1-D float tensor as doubles.
std::vector<double> as_doubles(const Tensor& t) {
  std::vector<double> v(static_cast<size_t>(t.numel()));
  for (int64_t i = 0; i < t.numel(); ++i) v[i] = t.get_f64(i);
  return v;
}

Status bn_kernel(KernelContext& ctx) {
  const Tensor& X = ctx.in(0);
  Tensor& Y = ctx.out(0);
  const int64_t N = X.dim(0), C = X.dim(1), S = (N * C) != 0 ? X.numel() / (N * C) : 0;
  const double eps = ctx.attrs().get_float("epsilon", 1e-5), mom = ctx.attrs().get_float("momentum", 0.9);
  std::vector<double> scale = as_doubles(ctx.in(1)), bias = as_doubles(ctx.in(2));
  std::vector<double> in_mean = as_doubles(ctx.in(3)), in_var = as_doubles(ctx.in(4));
  for (int i = 1; i < 5; ++i)
    if (ctx.in(i).numel() != C) return ctx.fail("input " + std::to_string(i) + " must have C elements");
  const bool training = bn_training(ctx);
  std::vector<double> mean = in_mean, var = in_var;
  Status st_ = dispatch_float(ctx, X.dtype(), [&](auto tag) {
    using T = decltype(tag);
    if (training) channel_stats(X.data<T>(), N, C, S, mean, var);
    const T* x = X.data<T>();
    T* y = Y.data<T>();
#pragma omp parallel for schedule(static)
    for (int64_t nc = 0; nc < N * C; ++nc) {
      int64_t c = nc % C;
      double inv = 1.0 / std::sqrt(var[c] + eps), a = scale[c] * inv, b = bias[c] - mean[c] * a;
      for (int64_t i = 0; i < S; ++i) st(y, nc * S + i, ld(x, nc * S + i) * a + b);
    }
  });
  KILN_RETURN_IF_ERROR(st_);
  const double cnt = static_cast<double>(N * S);
  for (size_t o = 1; o < ctx.outputs.size(); ++o) {
    Tensor& t = ctx.outputs[o];
    if (!t.defined() || t.numel() != C) continue;
    for (int64_t c = 0; c < C; ++c) {
      double v;
      if (!training)
        v = o == 1 || o == 3 ? in_mean[c] : in_var[c];
      else if (o == 1)
        v = in_mean[c] * mom + mean[c] * (1 - mom);
      else if (o == 2)
        v = in_var[c] * mom + (cnt > 1 ? var[c] * cnt / (cnt - 1) : var[c]) * (1 - mom);  // unbiased, as PyTorch
      else if (o == 3)
        v = mean[c];
      else
        v = var[c];  // saved_var (BatchNormalization-9): biased batch variance
      t.set_f64(c, v);
    }
  }
  return Status::ok();
}

Status bn_grad_kernel(KernelContext& ctx) {
  const Tensor& dY = ctx.in(0);
  const Tensor& X = ctx.in(1);
  if (dY.dims() != X.dims() || dY.dtype() != X.dtype()) return ctx.fail("dY and X differ in dtype or shape");
  const int64_t N = X.dim(0), C = X.dim(1), S = (N * C) != 0 ? X.numel() / (N * C) : 0;
  const double eps = ctx.attrs().get_float("epsilon", 1e-5);
  std::vector<double> scale = as_doubles(ctx.in(2));
  if (static_cast<int64_t>(scale.size()) != C) return ctx.fail("scale must have C elements");
  const bool training = bn_training(ctx);
  std::vector<double> mean, var;
  if (!training) {
    if (!ctx.has_input(3) || !ctx.has_input(4)) return ctx.fail("inference-mode gradient needs mean and var");
    mean = as_doubles(ctx.in(3));
    var = as_doubles(ctx.in(4));
  }
  std::vector<double> dscale(C, 0.0), dbias(C, 0.0);
  const double cnt = static_cast<double>(N * S);
  Status st_ = dispatch_float(ctx, X.dtype(), [&](auto tag) {
    using T = decltype(tag);
    const T* x = X.data<T>();
    const T* dy = dY.data<T>();
    T* dx = ctx.out(0).data<T>();
    if (training) channel_stats(x, N, C, S, mean, var);
#pragma omp parallel for schedule(static)
    for (int64_t c = 0; c < C; ++c) {
      double inv = 1.0 / std::sqrt(var[c] + eps), sb = 0, ss = 0;
      for (int64_t n = 0; n < N; ++n)
        for (int64_t i = 0; i < S; ++i) {
          int64_t o = (n * C + c) * S + i;
          double g = ld(dy, o);
          sb += g;
          ss += g * (ld(x, o) - mean[c]) * inv;
        }
      dbias[c] = sb;
      dscale[c] = ss;
      for (int64_t n = 0; n < N; ++n)
        for (int64_t i = 0; i < S; ++i) {
          int64_t o = (n * C + c) * S + i;
          double g = ld(dy, o), v;
          if (training) {
            double xh = (ld(x, o) - mean[c]) * inv;
            v = scale[c] * inv / cnt * (cnt * g - sb - xh * ss);
          } else {
            v = g * scale[c] * inv;
          }
          st(dx, o, v);
        }
    }
  });
  KILN_RETURN_IF_ERROR(st_);
  for (int64_t c = 0; c < C; ++c) {
    if (ctx.outputs.size() > 1 && ctx.out(1).defined()) ctx.out(1).set_f64(c, dscale[c]);
    if (ctx.outputs.size() > 2 && ctx.out(2).defined()) ctx.out(2).set_f64(c, dbias[c]);
  }
  return Status::ok();
}

/// (R, D) view of LayerNormalization: D = prod(dims[axis:]).
Expected<std::pair<int64_t, int64_t>> ln_view(const KernelContext& ctx, const Tensor& X) {
  auto ax = ir::normalize_axis(ctx.attrs().get_int("axis", -1), X.rank());
  if (!ax) return ctx.fail(ax.message());
  int64_t D = 1;
  for (int i = *ax; i < X.rank(); ++i) D *= X.dim(i);
  return std::make_pair(D ? X.numel() / D : 0, D);
}

/// Per-element parameter reader: a tensor with D elements, or 1 (broadcast).
struct Param {
  std::vector<double> v;
  double at(int64_t j) const { return v.size() == 1 ? v[0] : v[j]; }
};

Status ln_kernel(KernelContext& ctx) {
  const Tensor& X = ctx.in(0);
  auto view = ln_view(ctx, X);
  if (!view) return view.status();
  auto [R, D] = *view;
  Param scale{as_doubles(ctx.in(1))}, bias;
  if (ctx.has_input(2)) bias.v = as_doubles(ctx.in(2));
  if ((scale.v.size() != 1 && static_cast<int64_t>(scale.v.size()) != D) ||
      (!bias.v.empty() && bias.v.size() != 1 && static_cast<int64_t>(bias.v.size()) != D))
    return ctx.fail("Scale/B must have prod(X.shape[axis:]) = " + std::to_string(D) + " elements");
  const double eps = ctx.attrs().get_float("epsilon", 1e-5);
  Tensor* mean_out = ctx.outputs.size() > 1 && ctx.outputs[1].defined() ? &ctx.outputs[1] : nullptr;
  Tensor* inv_out = ctx.outputs.size() > 2 && ctx.outputs[2].defined() ? &ctx.outputs[2] : nullptr;
  return dispatch_float(ctx, X.dtype(), [&](auto tag) {
    using T = decltype(tag);
    const T* x = X.data<T>();
    T* y = ctx.out(0).data<T>();
#pragma omp parallel for schedule(static) if (X.numel() > kParallelThreshold)
    for (int64_t r = 0; r < R; ++r) {
      double s = 0, ss = 0;
      for (int64_t j = 0; j < D; ++j) s += ld(x, r * D + j);
      double mu = s / static_cast<double>(D);
      for (int64_t j = 0; j < D; ++j) {
        double d = ld(x, r * D + j) - mu;
        ss += d * d;
      }
      double inv = 1.0 / std::sqrt(ss / static_cast<double>(D) + eps);
      for (int64_t j = 0; j < D; ++j) {
        double v = (ld(x, r * D + j) - mu) * inv * scale.at(j);
        if (!bias.v.empty()) v += bias.at(j);
        st(y, r * D + j, v);
      }
      if (mean_out) mean_out->set_f64(r, mu);
      if (inv_out) inv_out->set_f64(r, inv);
    }
  });
}

/// The row part of LayerNormalizationGrad over R rows of D elements: dX, and the row
/// statistics mu and inv (f64) recomputed from X, as the forward kernel computes them.
template <typename T>
void ln_grad_rows(const T* x, const T* dy, const Param& scale, int64_t R, int64_t D, double eps, T* dx, double* mu,
                  double* inv) {
#pragma omp parallel for schedule(static) if (R * D > kParallelThreshold)
  for (int64_t r = 0; r < R; ++r) {
    const T* xr = x + r * D;
    const T* gr = dy + r * D;
    double s = 0, ss = 0;
    for (int64_t j = 0; j < D; ++j) s += ld(xr, j);
    double m = s / static_cast<double>(D);
    for (int64_t j = 0; j < D; ++j) ss += (ld(xr, j) - m) * (ld(xr, j) - m);
    double iv = 1.0 / std::sqrt(ss / static_cast<double>(D) + eps);
    mu[r] = m;
    inv[r] = iv;
    // dX = inv * (g - mean(g) - xhat * mean(g * xhat)), g = dY * scale
    double mg = 0, mgx = 0;
    for (int64_t j = 0; j < D; ++j) {
      double g = ld(gr, j) * scale.at(j), xh = (ld(xr, j) - m) * iv;
      mg += g;
      mgx += g * xh;
    }
    mg /= static_cast<double>(D);
    mgx /= static_cast<double>(D);
    for (int64_t j = 0; j < D; ++j) {
      double g = ld(gr, j) * scale.at(j), xh = (ld(xr, j) - m) * iv;
      st(dx + r * D, j, iv * (g - mg - xh * mgx));
    }
  }
}

/// (dY, X, Scale) checked and viewed as R rows of D elements.
Expected<std::pair<int64_t, int64_t>> ln_grad_setup(KernelContext& ctx, Param& scale) {
  const Tensor& dY = ctx.in(0);
  const Tensor& X = ctx.in(1);
  if (dY.dims() != X.dims() || dY.dtype() != X.dtype()) return ctx.fail("dY and X differ in dtype or shape");
  auto view = ln_view(ctx, X);
  if (!view) return view.status();
  scale.v = as_doubles(ctx.in(2));
  if (scale.v.size() != 1 && static_cast<int64_t>(scale.v.size()) != view->second)
    return ctx.fail("Scale must have prod(X.shape[axis:]) = " + std::to_string(view->second) + " elements");
  return view;
}

Status ln_input_grad_kernel(KernelContext& ctx) {
  Param scale;
  auto view = ln_grad_setup(ctx, scale);
  if (!view) return view.status();
  auto [R, D] = *view;
  const double eps = ctx.attrs().get_float("epsilon", 1e-5);
  std::vector<double> mu(R), inv(R);
  KILN_RETURN_IF_ERROR(dispatch_float(ctx, ctx.in(1).dtype(), [&](auto tag) {
    using T = decltype(tag);
    ln_grad_rows(ctx.in(1).data<T>(), ctx.in(0).data<T>(), scale, R, D, eps, ctx.out(0).data<T>(), mu.data(),
                 inv.data());
  }));
  for (int o = 1; o < 3 && o < static_cast<int>(ctx.outputs.size()); ++o) {
    Tensor& t = ctx.outputs[o];
    if (!t.defined()) continue;
    const std::vector<double>& src = o == 1 ? mu : inv;
    for (int64_t r = 0; r < R && r < t.numel(); ++r) t.set_f64(r, src[r]);
  }
  return Status::ok();
}

Status ln_grad_kernel(KernelContext& ctx) {
  Param scale;
  auto view = ln_grad_setup(ctx, scale);
  if (!view) return view.status();
  auto [R, D] = *view;
  const Tensor& dY = ctx.in(0);
  const Tensor& X = ctx.in(1);
  const double eps = ctx.attrs().get_float("epsilon", 1e-5);
  std::vector<double> mu(R), inv(R);
  std::vector<double> dscale(static_cast<size_t>(D), 0.0), dbias(static_cast<size_t>(D), 0.0);
  Status st_ = dispatch_float(ctx, X.dtype(), [&](auto tag) {
    using T = decltype(tag);
    const T* x = X.data<T>();
    const T* dy = dY.data<T>();
    ln_grad_rows(x, dy, scale, R, D, eps, ctx.out(0).data<T>(), mu.data(), inv.data());
#pragma omp parallel for schedule(static) if (X.numel() > kParallelThreshold)
    for (int64_t j = 0; j < D; ++j) {
      double a = 0, b = 0;
      for (int64_t r = 0; r < R; ++r) {
        double g = ld(dy, r * D + j);
        a += g * (ld(x, r * D + j) - mu[r]) * inv[r];
        b += g;
      }
      dscale[j] = a;
      dbias[j] = b;
    }
  });
  KILN_RETURN_IF_ERROR(st_);
  // Parameters of one element (broadcast Scale/B) receive the sum.
  for (int o = 1; o < 3 && o < static_cast<int>(ctx.outputs.size()); ++o) {
    Tensor& t = ctx.outputs[o];
    if (!t.defined()) continue;
    const std::vector<double>& src = o == 1 ? dscale : dbias;
    if (t.numel() == 1) {
      double s = 0;
      for (double v : src) s += v;
      t.set_f64(0, s);
    } else {
      for (int64_t j = 0; j < t.numel() && j < D; ++j) t.set_f64(j, src[j]);
    }
  }
  return Status::ok();
}

// ---------------------------------------------------------------------------
// Softmax family: X viewed as (outer, A, inner) around the axis
// ---------------------------------------------------------------------------

struct AxisView {
  int64_t outer = 1, A = 1, inner = 1;
};

Expected<AxisView> axis_view(const KernelContext& ctx, const std::vector<int64_t>& dims) {
  auto ax = ir::normalize_axis(ctx.attrs().get_int("axis", -1), static_cast<int>(dims.size()));
  if (!ax) return ctx.fail(ax.message());
  AxisView v;
  for (int i = 0; i < static_cast<int>(dims.size()); ++i) {
    if (i < *ax)
      v.outer *= dims[i];
    else if (i == *ax)
      v.A = dims[i];
    else
      v.inner *= dims[i];
  }
  return v;
}

template <bool Log>
Status softmax_kernel(KernelContext& ctx) {
  const Tensor& X = ctx.in(0);
  auto v = axis_view(ctx, X.dims());
  if (!v) return v.status();
  const AxisView q = *v;
  return dispatch_float(ctx, X.dtype(), [&](auto tag) {
    using T = decltype(tag);
    const T* x = X.data<T>();
    T* y = ctx.out(0).data<T>();
#pragma omp parallel if (X.numel() > kParallelThreshold)
    {
      // exp(z) of one row, computed once and reused for the output (same values as
      // recomputing it; the exponential dominated this kernel).
      std::vector<double> e(Log ? 0 : static_cast<size_t>(q.A));
#pragma omp for schedule(static)
      for (int64_t oi = 0; oi < q.outer * q.inner; ++oi) {
        const int64_t o = oi / q.inner, i = oi % q.inner, base = o * q.A * q.inner + i;
        double m = -std::numeric_limits<double>::infinity();
        for (int64_t a = 0; a < q.A; ++a) m = std::max(m, ld(x, base + a * q.inner));
        double s = 0;
        for (int64_t a = 0; a < q.A; ++a) {
          const double ea = std::exp(ld(x, base + a * q.inner) - m);
          if (!Log) e[static_cast<size_t>(a)] = ea;
          s += ea;
        }
        if (Log) {
          const double ls = std::log(s);
          for (int64_t a = 0; a < q.A; ++a) st(y, base + a * q.inner, ld(x, base + a * q.inner) - m - ls);
        } else {
          for (int64_t a = 0; a < q.A; ++a) st(y, base + a * q.inner, e[static_cast<size_t>(a)] / s);
        }
      }
    }
  });
}

template <bool Log>
Status softmax_grad_kernel(KernelContext& ctx) {
  const Tensor& dY = ctx.in(0);
  const Tensor& Y = ctx.in(1);
  if (dY.dims() != Y.dims() || dY.dtype() != Y.dtype()) return ctx.fail("dY and Y differ in dtype or shape");
  auto v = axis_view(ctx, Y.dims());
  if (!v) return v.status();
  const AxisView q = *v;
  return dispatch_float(ctx, Y.dtype(), [&](auto tag) {
    using T = decltype(tag);
    const T* y = Y.data<T>();
    const T* dy = dY.data<T>();
    T* dx = ctx.out(0).data<T>();
#pragma omp parallel for schedule(static) if (Y.numel() > kParallelThreshold)
    for (int64_t oi = 0; oi < q.outer * q.inner; ++oi) {
      const int64_t o = oi / q.inner, i = oi % q.inner, base = o * q.A * q.inner + i;
      double s = 0;
      for (int64_t a = 0; a < q.A; ++a) {
        int64_t k = base + a * q.inner;
        s += Log ? ld(dy, k) : ld(dy, k) * ld(y, k);
      }
      for (int64_t a = 0; a < q.A; ++a) {
        int64_t k = base + a * q.inner;
        st(dx, k, Log ? ld(dy, k) - std::exp(ld(y, k)) * s : ld(y, k) * (ld(dy, k) - s));
      }
    }
  });
}

}  // namespace

void register_nn_kernels(ir::OpTable& t) {
  set_kernel_writing_all_outputs(t, "MatMul", matmul_kernel);
  set_kernel_writing_all_outputs(t, "Gemm", gemm_kernel);
  set_kernel(t, "Conv", conv_kernel);
  set_kernel(t, "ConvGradInput", conv_grad_input_kernel);
  set_kernel(t, "ConvGradWeight", conv_grad_weight_kernel);
  set_kernel(t, "MaxPool", maxpool_kernel);
  set_kernel(t, "MaxPoolGrad", maxpool_grad_kernel);
  set_kernel(t, "AveragePool", avgpool_kernel);
  set_kernel(t, "AveragePoolGrad", avgpool_grad_kernel);
  set_kernel(t, "GlobalAveragePool", global_avgpool_kernel);
  set_kernel(t, "BatchNormalization", bn_kernel);
  set_kernel(t, "BatchNormalizationGrad", bn_grad_kernel);
  set_kernel(t, "LayerNormalization", ln_kernel);
  set_kernel(t, "LayerNormalizationGrad", ln_grad_kernel);
  set_kernel(t, "LayerNormalizationInputGrad", ln_input_grad_kernel);
  set_kernel(t, "Softmax", softmax_kernel<false>);
  set_kernel(t, "LogSoftmax", softmax_kernel<true>);
  set_kernel(t, "SoftmaxGrad", softmax_grad_kernel<false>);
  set_kernel(t, "LogSoftmaxGrad", softmax_grad_kernel<true>);
}

}  // namespace kiln::runtime::kernels
