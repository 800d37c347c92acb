// oneDNN 2.6 helpers (see onednn.h): matmul and convolution primitives over plain
// row-major buffers, cached by a key of dims, strides and dtypes, with an f32
// fallback for bf16 when the CPU lacks a bf16 implementation. Convolutions take
// oneDNN's preferred (blocked) layouts, staged by reorders around each call.
#include "runtime/kernels/onednn.h"

#include <omp.h>

#include <cstddef>
#include <map>
#include <memory>
#include <mutex>
#include <oneapi/dnnl/dnnl.hpp>
#include <string>
#include <unordered_map>

#include "runtime/kernels/util.h"

namespace kiln::runtime::kernels::onednn {

namespace {

using dnnl::memory;
using Dt = memory::data_type;

dnnl::engine& engine() {
  static dnnl::engine e(dnnl::engine::kind::cpu, 0);
  return e;
}

Dt to_dnnl(ir::DType t) { return t == ir::DType::bf16 ? Dt::bf16 : Dt::f32; }

std::vector<int64_t> row_major(const std::vector<int64_t>& dims) {
  std::vector<int64_t> s(dims.size(), 1);
  for (int i = static_cast<int>(dims.size()) - 2; i >= 0; --i) s[i] = s[i + 1] * dims[i + 1];
  return s;
}

memory::desc md(const std::vector<int64_t>& dims, Dt dt, const std::vector<int64_t>& strides = {}) {
  return memory::desc(memory::dims(dims.begin(), dims.end()), dt,
                      memory::dims(strides.empty() ? row_major(dims) : strides));
}

/// Appends `v` (its length, then its values) to a cache key as raw bytes.
void key_add(std::string& key, const std::vector<int64_t>& v) {
  const int64_t n = static_cast<int64_t>(v.size());
  key.append(reinterpret_cast<const char*>(&n), sizeof n);
  key.append(reinterpret_cast<const char*>(v.data()), v.size() * sizeof(int64_t));
}

/// A cached primitive, or an empty entry when oneDNN has no implementation. `args`
/// keeps the memory objects of the primitive's arguments between calls (their
/// descriptors are fixed by the key); each call points them at its buffers.
struct Cached {
  bool ok = false;
  dnnl::primitive prim;
  std::string why;
  std::mutex mu;  ///< guards args during one call
  std::unordered_map<int, memory> args;
};

/// One argument of a primitive call: its oneDNN argument id, descriptor and buffer.
struct Arg {
  int id;
  const memory::desc& desc;
  const void* data;
};

std::mutex g_mu;
std::unordered_map<std::string, std::shared_ptr<Cached>>& cache() {
  static std::unordered_map<std::string, std::shared_ptr<Cached>> c;
  return c;
}

/// Finds or builds the primitive of `key` with `build` (which may throw dnnl::error).
template <typename Build>
std::shared_ptr<Cached> get_or_build(const std::string& key, Build&& build) {
  {
    std::lock_guard<std::mutex> l(g_mu);
    auto it = cache().find(key);
    if (it != cache().end()) return it->second;
  }
  auto c = std::make_shared<Cached>();
  try {
    c->prim = build();
    c->ok = true;
  } catch (const dnnl::error& e) {
    c->why = e.what();
  }
  std::lock_guard<std::mutex> l(g_mu);
  cache()[key] = c;
  return c;
}

/// Executes `c` on `args`: the entry's memory objects are created on its first call and
/// re-pointed (set_data_handle) on later ones, on this thread's stream; no allocation
/// after the first call with a given key.
Status run(Cached& c, std::initializer_list<Arg> args) {
  try {
    static thread_local dnnl::stream s(engine());
    std::lock_guard<std::mutex> l(c.mu);
    for (const Arg& a : args) {
      auto it = c.args.find(a.id);
      if (it == c.args.end())
        c.args.emplace(a.id, memory(a.desc, engine(), const_cast<void*>(a.data)));
      else
        it->second.set_data_handle(const_cast<void*>(a.data));
    }
    c.prim.execute(s, c.args);
    s.wait();
  } catch (const dnnl::error& e) {
    return Status::error(std::string("oneDNN execution failed: ") + e.what());
  }
  return Status::ok();
}

memory mem(const memory::desc& d, const void* p) { return memory(d, engine(), const_cast<void*>(p)); }

/// Copies a (possibly strided) bf16 operand into a dense f32 operand.
Operand to_f32_operand(const Operand& o, std::vector<float>& buf) {
  std::vector<int64_t> st = o.strides.empty() ? row_major(o.dims) : o.strides;
  int64_t n = 1;
  for (int64_t d : o.dims) n *= d;
  buf.assign(static_cast<size_t>(n), 0.f);
  const uint16_t* src = static_cast<const uint16_t*>(o.data);
  std::vector<int64_t> idx(o.dims.size(), 0);
  for (int64_t i = 0; i < n; ++i) {
    int64_t off = 0, rem = i;
    for (int d = static_cast<int>(o.dims.size()) - 1; d >= 0; --d) {
      off += (rem % o.dims[d]) * st[d];
      rem /= o.dims[d];
    }
    buf[i] = ir::bf16_to_f32(src[off]);
  }
  return Operand{buf.data(), o.dims, {}};
}

int64_t numel(const std::vector<int64_t>& d) {
  int64_t n = 1;
  for (int64_t x : d) n *= x;
  return n;
}

std::string conv_key(const char* kind, const ConvGeometry& g, Dt dt, bool bias) {
  std::string key =
      std::string(kind) + std::to_string(static_cast<int>(dt)) + (bias ? "b" : "") + 'g' + std::to_string(g.group);
  key_add(key, g.x_dims);
  key_add(key, g.w_dims);
  key_add(key, g.y_dims);
  key_add(key, g.strides);
  key_add(key, g.dilations);
  key_add(key, g.pads_begin);
  key_add(key, g.pads_end);
  return key;
}

/// A convolution's plain (row-major NCHW, OIHW, GOIHW) descriptors, or with `any` the
/// same dims with format_tag::any (oneDNN picks the layout).
struct ConvMds {
  memory::desc x, w, b, y;
  memory::dims strides, dilates, pl, pr;
};

ConvMds conv_mds(const ConvGeometry& g, Dt dt, bool any = false) {
  ConvMds m;
  auto make = [&](const std::vector<int64_t>& dims) {
    return any ? memory::desc(dims, dt, memory::format_tag::any) : md(dims, dt);
  };
  m.x = make(g.x_dims);
  m.y = make(g.y_dims);
  std::vector<int64_t> wd = g.w_dims;
  if (g.group > 1) {
    wd[0] /= g.group;
    wd.insert(wd.begin(), g.group);  // (G, M/G, C/G, k...): the same bytes as ONNX (M, C/G, k...)
  }
  m.w = make(wd);
  m.b = md({g.w_dims[0]}, dt);
  for (size_t i = 0; i < g.strides.size(); ++i) {
    m.strides.push_back(g.strides[i]);
    m.dilates.push_back(g.dilations[i] - 1);  // oneDNN counts dilation from 0
    m.pl.push_back(g.pads_begin[i]);
    m.pr.push_back(g.pads_end[i]);
  }
  return m;
}

dnnl::convolution_forward::primitive_desc fwd_pd(const ConvMds& m, bool bias, dnnl::prop_kind pk) {
  using CF = dnnl::convolution_forward;
  auto d = bias
               ? CF::desc(pk, dnnl::algorithm::convolution_direct, m.x, m.w, m.b, m.y, m.strides, m.dilates, m.pl, m.pr)
               : CF::desc(pk, dnnl::algorithm::convolution_direct, m.x, m.w, m.y, m.strides, m.dilates, m.pl, m.pr);
  return CF::primitive_desc(d, engine());
}

Status unimplemented(const char* what, const Cached& c) {
  return Status::error(std::string("oneDNN has no ") + what + " implementation: " + c.why);
}

/// A row-major f32 copy of operand `o` read with element `strides`, by a cached oneDNN
/// reorder into `buf` (resized; the returned operand points into it), or `o` itself when
/// the strides are already row-major. Errors: oneDNN has no reorder for the layout.
Expected<Operand> dense_f32_copy(const Operand& o, const std::vector<int64_t>& strides, std::vector<float>& buf) {
  if (strides == row_major(o.dims)) return Operand{o.data, o.dims, {}};
  buf.resize(static_cast<size_t>(numel(o.dims)));
  const memory::desc from = md(o.dims, Dt::f32, strides), to = md(o.dims, Dt::f32, {});
  std::string key = "reorder_dense";
  key_add(key, o.dims);
  key_add(key, strides);
  auto re = get_or_build(key, [&] { return dnnl::primitive(dnnl::reorder(mem(from, o.data), mem(to, buf.data()))); });
  if (!re->ok) return unimplemented("reorder", *re);
  KILN_RETURN_IF_ERROR(run(*re, {{DNNL_ARG_FROM, from, o.data}, {DNNL_ARG_TO, to, buf.data()}}));
  return Operand{buf.data(), o.dims, {}};
}

}  // namespace

/// Convolutions (2 * N * M * C/G * kernel taps * output pixels) and matrix products
/// (2 * batch * M * N * K) below this many FLOPs run on the calling thread alone: oneDNN creates and runs the primitive
/// with one OpenMP thread, so a call enters no parallel region. Measured on a 2-core AVX-512 Xeon (docs/performance.md,
/// "Peer benchmark", "Second session"): resnet18 batch 4 took 2.18 ms per step with every call on two
/// threads, 1.88-1.93 with thresholds from 1 to 64 MFLOP; at batch 32, 4.43-4.49 ms up to 16 MFLOP and 4.80 at 64.
constexpr int64_t kSingleThreadFlops = int64_t{4} << 20;

/// Sets the calling thread's OpenMP thread count for its lifetime, when `one` is true.
class OneThread {
 public:
  explicit OneThread(bool one) : prev_(one ? omp_get_max_threads() : 0) {
    if (one) omp_set_num_threads(1);
  }
  ~OneThread() {
    if (prev_ > 0) omp_set_num_threads(prev_);
  }
  OneThread(const OneThread&) = delete;
  OneThread& operator=(const OneThread&) = delete;

 private:
  int prev_;
};

/// The layout oneDNN's primitive `p` takes for argument `arg` (DNNL_ARG_*).
memory::desc arg_md(const dnnl::primitive& p, int arg) {
  const dnnl_memory_desc_t* d = dnnl_primitive_desc_query_md(p.get_primitive_desc(), dnnl_query_exec_arg_md, arg);
  return d ? memory::desc(*d) : memory::desc();
}

struct PreparedMatmul {
  bool single = false;  ///< below kSingleThreadFlops: one OpenMP thread
  bool bias = false;
  std::shared_ptr<Cached> prim;
  memory src, weights, bias_mem, dst;
  std::unordered_map<int, memory> args;
};

namespace {

/// Whether `a` is the transposed A that matmul first copies row-major (see there).
bool dense_copy_first(const Operand& a, const std::vector<int64_t>& c_dims, Dt idt) {
  // A stored transposed (2-D, strides {1, M}: the weight gradient X^T dY of a Linear
  // layer). oneDNN 2.6's AVX2 gemm runs this layout at about half the speed of a row-major
  // A when M is large and N small (measured: M = K = 1024, N = 256: 10.7 against 4.2 ms;
  // M = 2048: 19.2 against 10.9; no gain at M = 256 or at N = 768), so such an A is first
  // copied row-major by a oneDNN reorder (1.4 ms for 1024 x 1024) into a per-thread
  // scratch buffer (not a kiln tensor: like oneDNN's own scratchpad it is outside the
  // memory plan; M * K * 4 bytes, kept).
  return a.dims.size() == 2 && idt == Dt::f32 && a.strides == std::vector<int64_t>{1, a.dims[0]} && a.dims[0] >= 512 &&
         c_dims.back() <= 384 && a.dims[0] * a.dims[1] * c_dims.back() >= (int64_t{1} << 24);
}

/// The cached primitive of the direct product (and `single`): operands as given, a
/// strided one refused when only the reference implementation would take it.
std::shared_ptr<Cached> direct_matmul(const Operand& a, const Operand& b, const std::vector<int64_t>& c_dims, Dt idt,
                                      Dt odt, const Operand* bias, bool& single) {
  int64_t flops = 2 * a.dims.back();
  for (int64_t d : c_dims) flops *= d;
  single = flops < kSingleThreadFlops;
  OneThread one(single);  // oneDNN sizes the primitive's thread team when it is created
  std::vector<int64_t> as = a.strides.empty() ? row_major(a.dims) : a.strides;
  std::vector<int64_t> bs = b.strides.empty() ? row_major(b.dims) : b.strides;
  std::string key = std::string(bias ? "mmb" : "mm") + (single ? "t1_" : "") + std::to_string(static_cast<int>(idt)) +
                    "_" + std::to_string(static_cast<int>(odt));
  key_add(key, a.dims);
  key_add(key, as);
  key_add(key, b.dims);
  key_add(key, bs);
  key_add(key, c_dims);
  if (bias) key_add(key, bias->dims);
  const bool strided = as != row_major(a.dims) || bs != row_major(b.dims);
  return get_or_build(key, [&] {
    auto amd = md(a.dims, idt, as), bmd = md(b.dims, idt, bs), cmd = md(c_dims, odt);
    dnnl::matmul::primitive_desc pd =
        bias ? dnnl::matmul::primitive_desc(dnnl::matmul::desc(amd, bmd, md(bias->dims, odt), cmd), engine())
             : dnnl::matmul::primitive_desc(dnnl::matmul::desc(amd, bmd, cmd), engine());
    // A strided (transposed-view) operand or a bias that only oneDNN's reference code
    // takes goes another way instead (the reference matmul is orders of magnitude slower).
    if ((strided || bias) && std::string(pd.impl_info_str()).rfind("ref", 0) == 0)
      throw dnnl::error(dnnl_unimplemented, "only the reference implementation takes these strides or this bias");
    return dnnl::primitive(dnnl::matmul(pd));
  });
}

}  // namespace

namespace {

/// `prim` (built, ok) with memory objects of the layouts it takes, their buffers set per
/// call by run_matmul; null when oneDNN refuses one.
std::shared_ptr<PreparedMatmul> bind_matmul(std::shared_ptr<Cached> prim, bool single, bool bias) {
  auto p = std::make_shared<PreparedMatmul>();
  p->prim = std::move(prim);
  p->single = single;
  try {
    const dnnl::primitive& pr = p->prim->prim;
    p->src = memory(arg_md(pr, DNNL_ARG_SRC), engine(), DNNL_MEMORY_NONE);
    p->weights = memory(arg_md(pr, DNNL_ARG_WEIGHTS), engine(), DNNL_MEMORY_NONE);
    p->dst = memory(arg_md(pr, DNNL_ARG_DST), engine(), DNNL_MEMORY_NONE);
    p->args = {{DNNL_ARG_SRC, p->src}, {DNNL_ARG_WEIGHTS, p->weights}, {DNNL_ARG_DST, p->dst}};
    if (bias) {
      p->bias = true;
      p->bias_mem = memory(arg_md(pr, DNNL_ARG_BIAS), engine(), DNNL_MEMORY_NONE);
      p->args[DNNL_ARG_BIAS] = p->bias_mem;
    }
  } catch (const dnnl::error&) {
    return nullptr;
  }
  return p;
}

}  // namespace

std::shared_ptr<PreparedMatmul> prepare_matmul(const Operand& a, const Operand& b, const std::vector<int64_t>& c_dims,
                                               ir::DType in_dt, ir::DType out_dt, const Operand* bias) {
  const Dt idt = to_dnnl(in_dt), odt = to_dnnl(out_dt);
  if (!bias && dense_copy_first(a, c_dims, idt)) return nullptr;
  bool single = false;
  auto prim = direct_matmul(a, b, c_dims, idt, odt, bias, single);
  return prim->ok ? bind_matmul(std::move(prim), single, bias != nullptr) : nullptr;
}

Status run_matmul(PreparedMatmul& p, const void* a, const void* b, void* c, const void* bias) {
  try {
    static thread_local dnnl::stream s(engine());
    OneThread one(p.single);
    p.src.set_data_handle(const_cast<void*>(a));
    p.weights.set_data_handle(const_cast<void*>(b));
    p.dst.set_data_handle(c);
    if (p.bias) p.bias_mem.set_data_handle(const_cast<void*>(bias));
    p.prim->prim.execute(s, p.args);
    s.wait();
  } catch (const dnnl::error& e) {
    return Status::error(std::string("oneDNN execution failed: ") + e.what());
  }
  return Status::ok();
}

Status matmul_any_shape(const Operand& a, const Operand& b, void* c, const std::vector<int64_t>& c_dims,
                        ir::DType in_dt, ir::DType out_dt) {
  const size_t r = c_dims.size();
  if (r < 2 || r > 4 || a.dims.size() != r || b.dims.size() != r)
    return Status::error("matmul_any_shape: operands of rank 2 to 4");
  for (size_t i = 0; i + 2 < r; ++i)
    if (a.dims[i] != c_dims[i] || b.dims[i] != c_dims[i])
      return Status::error("matmul_any_shape: broadcast batch dims");  // fixed when the primitive is made
  const Dt idt = to_dnnl(in_dt), odt = to_dnnl(out_dt);
  // Each operand a dense tensor in some order of its dims (a transposed or permuted
  // view), named by its oneDNN format tag: oneDNN 2.6 has a gemm implementation for
  // run-time dims with format tags, only its reference code for run-time strides.
  using tag = memory::format_tag;
  static const std::vector<std::pair<std::string, tag>> tags = {
      {"ab", tag::ab},     {"ba", tag::ba},     {"abc", tag::abc},   {"acb", tag::acb},
      {"bac", tag::bac},   {"abcd", tag::abcd}, {"abdc", tag::abdc}, {"acbd", tag::acbd},
      {"acdb", tag::acdb}, {"adbc", tag::adbc}, {"adcb", tag::adcb}, {"bacd", tag::bacd}};
  // The tag whose dense strides (dims in the tag's order, the last fastest) are the
  // operand's; dims of extent 1 match any stride.
  auto tag_of = [&](const Operand& o) -> int {
    const std::vector<int64_t> st = o.strides.empty() ? row_major(o.dims) : o.strides;
    for (size_t t = 0; t < tags.size(); ++t) {
      const std::string& order = tags[t].first;
      if (order.size() != r) continue;
      bool ok = true;
      int64_t step = 1;
      for (size_t k = r; k-- > 0 && ok;) {
        const size_t d = static_cast<size_t>(order[k] - 'a');
        ok = o.dims[d] == 1 || st[d] == step;
        step *= o.dims[d];
      }
      if (ok) return static_cast<int>(t);
    }
    return -1;
  };
  const int ta = tag_of(a), tb = tag_of(b);
  if (ta < 0 || tb < 0) return Status::error("matmul_any_shape: an operand is not a dense tensor in a known order");
  const std::string key = "mm_any_" + std::to_string(static_cast<int>(idt)) + "_" +
                          std::to_string(static_cast<int>(odt)) + "_" + tags[static_cast<size_t>(ta)].first + "_" +
                          tags[static_cast<size_t>(tb)].first;
  auto prim = get_or_build(key, [&] {
    const memory::dims rt(r, DNNL_RUNTIME_DIM_VAL);
    static const tag dense[] = {tag::undef, tag::undef, tag::ab, tag::abc, tag::abcd};
    dnnl::matmul::primitive_desc pd(dnnl::matmul::desc(memory::desc(rt, idt, tags[static_cast<size_t>(ta)].second),
                                                       memory::desc(rt, idt, tags[static_cast<size_t>(tb)].second),
                                                       memory::desc(rt, odt, dense[r])),
                                    engine());
    if (std::string(pd.impl_info_str()).rfind("ref", 0) == 0)
      throw dnnl::error(dnnl_unimplemented, "only the reference implementation takes run-time dims");
    return dnnl::primitive(dnnl::matmul(pd));
  });
  if (!prim->ok) return unimplemented("matmul", *prim);
  try {
    static thread_local dnnl::stream s(engine());
    const std::vector<int64_t> as = a.strides.empty() ? row_major(a.dims) : a.strides;
    const std::vector<int64_t> bs = b.strides.empty() ? row_major(b.dims) : b.strides;
    prim->prim.execute(s, {{DNNL_ARG_SRC, mem(md(a.dims, idt, as), a.data)},
                           {DNNL_ARG_WEIGHTS, mem(md(b.dims, idt, bs), b.data)},
                           {DNNL_ARG_DST, mem(md(c_dims, odt), c)}});
    s.wait();
  } catch (const dnnl::error& e) {
    return Status::error(std::string("oneDNN execution failed: ") + e.what());
  }
  return Status::ok();
}

Status matmul(const Operand& a, const Operand& b, void* c, const std::vector<int64_t>& c_dims, ir::DType in_dt,
              ir::DType out_dt, const Operand* bias) {
  if (auto p = prepare_matmul(a, b, c_dims, in_dt, out_dt, bias))
    return run_matmul(*p, a.data, b.data, c, bias ? bias->data : nullptr);
  const Dt idt = to_dnnl(in_dt), odt = to_dnnl(out_dt);
  bool single = false;
  if (bias) return unimplemented("matmul with bias", *direct_matmul(a, b, c_dims, idt, odt, bias, single));
  if (dense_copy_first(a, c_dims, idt)) {
    thread_local std::vector<float> dense;
    auto a2 = dense_f32_copy(a, a.strides, dense);
    if (a2) return matmul(*a2, b, c, c_dims, in_dt, out_dt);
  }
  std::vector<int64_t> as = a.strides.empty() ? row_major(a.dims) : a.strides;
  std::vector<int64_t> bs = b.strides.empty() ? row_major(b.dims) : b.strides;
  const bool strided = as != row_major(a.dims) || bs != row_major(b.dims);
  auto prim = direct_matmul(a, b, c_dims, idt, odt, nullptr, single);
  if (prim->ok)  // the direct product after all (the dense copy above failed)
    if (auto p = bind_matmul(prim, single, false)) return run_matmul(*p, a.data, b.data, c, nullptr);
  if (strided && idt == Dt::f32) {
    // Dense copies of the strided operands (oneDNN reorders), then the dense product.
    std::vector<float> da, db;
    auto a2 = dense_f32_copy(a, as, da);
    if (!a2) return a2.status();
    auto b2 = dense_f32_copy(b, bs, db);
    if (!b2) return b2.status();
    return matmul(*a2, *b2, c, c_dims, in_dt, out_dt);
  }
  if (in_dt != ir::DType::bf16) return unimplemented("matmul", *prim);
  // bf16 without a bf16 implementation: f32 on converted copies, rounded on store.
  std::vector<float> fa, fb;
  Operand a32 = to_f32_operand(a, fa), b32 = to_f32_operand(b, fb);
  if (out_dt == ir::DType::f32) return matmul(a32, b32, c, c_dims, ir::DType::f32, ir::DType::f32);
  std::vector<float> fc(static_cast<size_t>(numel(c_dims)));
  KILN_RETURN_IF_ERROR(matmul(a32, b32, fc.data(), c_dims, ir::DType::f32, ir::DType::f32));
  narrow_to_bf16(fc.data(), static_cast<uint16_t*>(c), numel(c_dims));
  return Status::ok();
}

/// Per-thread staging buffers of the blocked-layout convolutions (one per role: a, b, out, bias; and 4 + role for the
/// f32 copies of bf16 operands),
/// grown to the largest call's need and reused: like oneDNN's own scratchpad they are
/// outside kiln's memory plan, and a staged copy lives only during its call.
void* staging(int role, size_t bytes) {
  thread_local std::vector<std::byte> buf[8];
  if (buf[role].size() < bytes + 64) buf[role].resize(bytes + 64);
  const auto p = reinterpret_cast<uintptr_t>(buf[role].data());
  return reinterpret_cast<void*>((p + 63) & ~uintptr_t{63});  // 64-byte aligned, as oneDNN's own buffers
}

int64_t conv_flops(const ConvGeometry& g) {
  int64_t f = 2 * g.x_dims[0] * g.w_dims[0];
  for (size_t i = 1; i < g.w_dims.size(); ++i) f *= g.w_dims[i];  // C/G and the kernel taps
  for (size_t i = 2; i < g.y_dims.size(); ++i) f *= g.y_dims[i];
  return f;
}

struct PreparedConv {
  ConvDirection dir;
  ConvGeometry g;
  ir::DType dt;
  ir::DType compute;  ///< the primitive's dtype (dt, or f32 for a bf16 convolution computed in f32)
  bool bias;
  bool single = false;  ///< conv_flops below kSingleThreadFlops: one OpenMP thread
  ConvMds m;
  std::shared_ptr<Cached> prim;
  /// One operand of the call in the order (a, b, out, bias): its oneDNN argument id, its
  /// plain descriptor and, when the primitive takes another layout (oneDNN's blocked
  /// formats, chosen with format_tag::any) or dtype (`compute`), the reorder between the
  /// two.
  struct Arg {
    int id = 0;
    memory::desc plain, chosen;
    bool staged = false;
    /// A bf16 operand of an f32-computed convolution: widened to (or, the output, narrowed
    /// from) an f32 plain copy by kiln's own conversion (runtime/kernels/util.h), so oneDNN
    /// reorders f32 to f32 only (its bf16-converting reorders ran at half their speed);
    /// `plain` is then the f32 copy's descriptor and n its element count.
    bool widen = false;
    int64_t n = 0;
    dnnl::primitive reorder;  ///< plain -> chosen for a and b, chosen -> plain for out
    memory plain_mem, chosen_mem;
    std::unordered_map<int, memory> reorder_args;  ///< FROM / TO of `reorder`
  };
  Arg args[4];
  int nargs = 3;  ///< 4 with a bias
  std::unordered_map<int, memory> exec_args;
};

std::shared_ptr<PreparedConv> prepare_conv(ConvDirection dir, const ConvGeometry& g, ir::DType dt, bool bias,
                                           ir::DType compute, const std::array<ir::DType, 4>* mixed) {
  auto p = std::make_shared<PreparedConv>();
  p->dir = dir;
  p->g = g;
  p->dt = dt;
  p->compute = compute == ir::DType::undefined ? dt : compute;
  p->bias = bias && dir == ConvDirection::forward;
  const Dt d = to_dnnl(dt), cd = to_dnnl(p->compute);
  p->m = conv_mds(g, d);  // the operands as kiln stores them
  // The primitive on the layouts oneDNN prefers (blocked channels: jit:avx512_core
  // instead of gemm:jit on plain NCHW, 3-4x faster on ResNet-18's convolutions even with
  // the reorders around each call; docs/performance.md), the plain one if that fails.
  const ConvMds any = conv_mds(g, cd, true), plain_cd = conv_mds(g, cd);
  auto build = [&](const ConvMds& m) -> dnnl::primitive {
    switch (dir) {
      case ConvDirection::forward:
        return dnnl::primitive(dnnl::convolution_forward(fwd_pd(m, p->bias, dnnl::prop_kind::forward_inference)));
      case ConvDirection::backward_data: {
        using CB = dnnl::convolution_backward_data;
        auto hint = fwd_pd(m, false, dnnl::prop_kind::forward_training);
        CB::desc desc(dnnl::algorithm::convolution_direct, m.x, m.w, m.y, m.strides, m.dilates, m.pl, m.pr);
        return dnnl::primitive(CB(CB::primitive_desc(desc, engine(), hint)));
      }
      case ConvDirection::backward_weights: {
        using CB = dnnl::convolution_backward_weights;
        auto hint = fwd_pd(m, false, dnnl::prop_kind::forward_training);
        CB::desc desc(dnnl::algorithm::convolution_direct, m.x, m.w, m.y, m.strides, m.dilates, m.pl, m.pr);
        return dnnl::primitive(CB(CB::primitive_desc(desc, engine(), hint)));
      }
    }
    throw dnnl::error(dnnl_invalid_arguments, "unknown convolution direction");
  };
  static const char* const kind[] = {"cf", "cbd", "cbw"};
  p->single = conv_flops(g) < kSingleThreadFlops;
  OneThread one(p->single);  // oneDNN sizes the primitive's thread team when it is created
  p->prim = get_or_build(
      std::string(p->single ? "any1_" : "any_") + conv_key(kind[static_cast<int>(dir)], g, cd, p->bias), [&] {
        try {
          return build(any);
        } catch (const dnnl::error&) {
          return build(plain_cd);
        }
      });
  // bf16 without a bf16 implementation (oneDNN 2.x needs AVX-512 for bf16): the f32
  // primitive on widened operands, the result rounded on store, which computes the same
  // function (bf16 products are exact in f32).
  if (!p->prim->ok && p->compute == ir::DType::bf16) return prepare_conv(dir, g, dt, bias, ir::DType::f32, mixed);
  const ConvMds& m = p->m;
  auto role = [&](int r, int id, const memory::desc& plain) {
    p->args[r].id = id;
    p->args[r].plain = plain;
  };
  switch (dir) {
    case ConvDirection::forward:
      role(0, DNNL_ARG_SRC, m.x), role(1, DNNL_ARG_WEIGHTS, m.w), role(2, DNNL_ARG_DST, m.y);
      break;
    case ConvDirection::backward_data:
      role(0, DNNL_ARG_DIFF_DST, m.y), role(1, DNNL_ARG_WEIGHTS, m.w), role(2, DNNL_ARG_DIFF_SRC, m.x);
      break;
    case ConvDirection::backward_weights:
      role(0, DNNL_ARG_DIFF_DST, m.y), role(1, DNNL_ARG_SRC, m.x), role(2, DNNL_ARG_DIFF_WEIGHTS, m.w);
      break;
  }
  if (p->bias) role(3, DNNL_ARG_BIAS, m.b), p->nargs = 4;
  // Computed in f32: every operand's plain copy is f32 (a bf16 one is widened into it).
  if (p->compute == ir::DType::f32)
    for (int r = 0; r < p->nargs; ++r) {
      PreparedConv::Arg& a = p->args[r];
      const memory::dims dims = a.plain.dims();
      a.widen = (mixed ? (*mixed)[r] : dt) == ir::DType::bf16;
      a.n = numel(std::vector<int64_t>(dims.begin(), dims.end()));
      a.plain = md(dims, Dt::f32);
    }
  if (!p->prim->ok) return p;
  try {
    for (int r = 0; r < p->nargs; ++r) {
      PreparedConv::Arg& a = p->args[r];
      const bool input = r != 2;
      a.chosen = arg_md(p->prim->prim, a.id);
      a.plain_mem = memory(a.plain, engine(), DNNL_MEMORY_NONE);
      a.staged = a.chosen != a.plain;
      if (a.staged) {
        a.chosen_mem = memory(a.chosen, engine(), DNNL_MEMORY_NONE);
        const memory& from = input ? a.plain_mem : a.chosen_mem;
        const memory& to = input ? a.chosen_mem : a.plain_mem;
        a.reorder = dnnl::primitive(
            dnnl::reorder(dnnl::reorder::primitive_desc(engine(), from.get_desc(), engine(), to.get_desc())));
        a.reorder_args = {{DNNL_ARG_FROM, from}, {DNNL_ARG_TO, to}};
      }
      p->exec_args[a.id] = a.staged ? a.chosen_mem : a.plain_mem;
    }
  } catch (const dnnl::error& e) {
    p->prim = std::make_shared<Cached>();
    p->prim->why = std::string("staging the convolution's layouts: ") + e.what();
  }
  return p;
}

Status run_conv(PreparedConv& p, const void* a, const void* b, const void* bias, void* out) {
  if (p.prim->ok) {
    try {
      static thread_local dnnl::stream s(engine());
      OneThread one(p.single);
      const void* ptr[4] = {a, b, out, bias};
      for (int r = 0; r < p.nargs; ++r) {
        PreparedConv::Arg& x = p.args[r];
        void* plain = const_cast<void*>(ptr[r]);
        if (x.widen) {
          float* copy = static_cast<float*>(staging(4 + r, static_cast<size_t>(x.n) * sizeof(float)));
          if (r != 2) widen_bf16(static_cast<const uint16_t*>(ptr[r]), copy, x.n);
          plain = copy;
        }
        x.plain_mem.set_data_handle(plain);
        if (x.staged) x.chosen_mem.set_data_handle(staging(r, x.chosen.get_size()));
        if (x.staged && r != 2) x.reorder.execute(s, x.reorder_args);
      }
      p.prim->prim.execute(s, p.exec_args);
      if (p.args[2].staged) p.args[2].reorder.execute(s, p.args[2].reorder_args);
      s.wait();
      if (p.args[2].widen)
        narrow_to_bf16(static_cast<const float*>(p.args[2].plain_mem.get_data_handle()), static_cast<uint16_t*>(out),
                       p.args[2].n);
    } catch (const dnnl::error& e) {
      return Status::error(std::string("oneDNN execution failed: ") + e.what());
    }
    return Status::ok();
  }
  static const char* const what[] = {"convolution", "convolution backward-data", "convolution backward-weights"};
  return unimplemented(what[static_cast<int>(p.dir)], *p.prim);
}

}  // namespace kiln::runtime::kernels::onednn
