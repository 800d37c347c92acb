// Binary serialization of IR graphs; see serialize.h.
#include "ir/serialize.h"

#include <cstring>

namespace kiln::ir {

void ByteWriter::u64(uint64_t v) {
  char b[8];
  for (int i = 0; i < 8; ++i) b[i] = static_cast<char>((v >> (8 * i)) & 0xff);
  s_.append(b, 8);
}

void ByteWriter::f64(double v) {
  uint64_t u;
  std::memcpy(&u, &v, 8);
  u64(u);
}

void ByteWriter::str(const std::string& v) {
  u64(v.size());
  s_ += v;
}

bool ByteReader::u8(uint8_t& v) {
  if (left() < 1) return false;
  v = static_cast<uint8_t>(s_[pos_++]);
  return true;
}

bool ByteReader::u64(uint64_t& v) {
  if (left() < 8) return false;
  v = 0;
  for (int i = 0; i < 8; ++i) v |= static_cast<uint64_t>(static_cast<uint8_t>(s_[pos_ + i])) << (8 * i);
  pos_ += 8;
  return true;
}

bool ByteReader::i64(int64_t& v) {
  uint64_t u;
  if (!u64(u)) return false;
  v = static_cast<int64_t>(u);
  return true;
}

bool ByteReader::f64(double& v) {
  uint64_t u;
  if (!u64(u)) return false;
  std::memcpy(&v, &u, 8);
  return true;
}

bool ByteReader::str(std::string& v) {
  uint64_t n;
  size_t save = pos_;
  if (!u64(n) || n > left()) {
    pos_ = save;
    return false;
  }
  v.assign(s_, pos_, n);
  pos_ += n;
  return true;
}

bool ByteReader::bytes(void* p, size_t n) {
  if (n > left()) return false;
  if (n) std::memcpy(p, s_.data() + pos_, n);
  pos_ += n;
  return true;
}

bool ByteReader::count(uint64_t& n, size_t min_bytes_each) {
  size_t save = pos_;
  if (!u64(n)) return false;
  if (min_bytes_each > 0 && n > left() / min_bytes_each) {
    pos_ = save;
    return false;
  }
  return true;
}

// ---- writer

namespace {

enum AttrTag : uint8_t { kInt = 0, kFloat, kString, kInts, kFloats, kStrings, kTensor };

void write_shape(const Shape& s, ByteWriter& w) {
  w.u64(s.dims.size());
  for (const Dim& d : s.dims) {
    w.i64(d.value);
    w.str(d.is_symbolic() ? d.to_string() : std::string());
  }
}

void write_tensor_bytes(const Tensor& t, ByteWriter& w) {
  w.u8(static_cast<uint8_t>(t.dtype()));
  w.u64(t.dims().size());
  for (int64_t d : t.dims()) w.i64(d);
  const size_t n = t.nbytes();
  w.u64(n);
  if (n) w.bytes(t.raw(), n);
}

bool read_tensor_bytes(ByteReader& r, Tensor& out, std::string& why) {
  uint8_t dt;
  uint64_t rank;
  if (!r.u8(dt) || !r.count(rank, 8)) return why = "truncated tensor header", false;
  if (dt >= static_cast<uint8_t>(DType::undefined)) return why = "bad tensor dtype " + std::to_string(dt), false;
  std::vector<int64_t> dims(rank);
  int64_t numel = 1;
  for (auto& d : dims) {
    if (!r.i64(d)) return why = "truncated tensor dims", false;
    if (d < 0 || (d > 0 && numel > INT64_MAX / d)) return why = "bad tensor dim " + std::to_string(d), false;
    numel *= d;
  }
  uint64_t n;
  if (!r.u64(n)) return why = "truncated tensor size", false;
  const DType dtype = static_cast<DType>(dt);
  // Bytes as Tensor counts them (dims in order, from the dtype size: a 0 after a huge dim
  // does not save a product that overflows on the way).
  int64_t bytes = static_cast<int64_t>(dtype_size(dtype));
  for (int64_t d : dims)
    if (__builtin_mul_overflow(bytes, d, &bytes))
      return why = "tensor dims " + dims_to_string(dims) + " overflow", false;
  if (numel > static_cast<int64_t>(r.left() / std::max<size_t>(1, dtype_size(dtype))) ||
      n != static_cast<uint64_t>(numel) * dtype_size(dtype))
    return why = "tensor of " + dims_to_string(dims) + " " + dtype_name(dtype) + " with " + std::to_string(n) +
                 " bytes (or fewer left)",
           false;
  Tensor t = Tensor::uninitialized(dtype, dims);
  if (!r.bytes(t.raw(), n)) return why = "truncated tensor data", false;
  out = std::move(t);
  return true;
}

void write_attr(const AttrValue& a, ByteWriter& w, GraphWriter& gw) {
  w.u8(static_cast<uint8_t>(a.index()));
  std::visit(
      [&](const auto& v) {
        using T = std::decay_t<decltype(v)>;
        if constexpr (std::is_same_v<T, int64_t>) {
          w.i64(v);
        } else if constexpr (std::is_same_v<T, double>) {
          w.f64(v);
        } else if constexpr (std::is_same_v<T, std::string>) {
          w.str(v);
        } else if constexpr (std::is_same_v<T, std::vector<int64_t>>) {
          w.u64(v.size());
          for (int64_t x : v) w.i64(x);
        } else if constexpr (std::is_same_v<T, std::vector<double>>) {
          w.u64(v.size());
          for (double x : v) w.f64(x);
        } else if constexpr (std::is_same_v<T, std::vector<std::string>>) {
          w.u64(v.size());
          for (const auto& x : v) w.str(x);
        } else {
          w.i64(gw.tensor_index(std::make_shared<Tensor>(v)));
        }
      },
      a);
}

std::string pool_key(const Tensor& t) {
  std::string k = std::to_string(reinterpret_cast<uintptr_t>(t.raw())) + ":" + dtype_name(t.dtype());
  for (int64_t d : t.dims()) k += "," + std::to_string(d);
  return k;
}

}  // namespace

int64_t GraphWriter::id_of(const Value* v) const {
  auto it = ids_.find(v);
  return it == ids_.end() ? -1 : it->second;
}

int64_t GraphWriter::tensor_index(const std::shared_ptr<Tensor>& t) {
  const std::string k = pool_key(*t);
  auto [it, fresh] = pool_index_.emplace(k, static_cast<int64_t>(pool_.size()));
  if (fresh) pool_.push_back(t);
  return it->second;
}

void GraphWriter::write_tensors(ByteWriter& w) const {
  w.u64(pool_.size());
  for (const auto& t : pool_) write_tensor_bytes(*t, w);
}

void GraphWriter::define(const Value* v, ByteWriter& w) {
  ids_.emplace(v, static_cast<int64_t>(ids_.size()));
  w.str(v->name);
  w.u8(static_cast<uint8_t>(v->dtype));
  write_shape(v->shape, w);
  w.u8(static_cast<uint8_t>(v->role));
  w.str(v->role_source);
  w.i64(v->data ? tensor_index(v->data) : -1);
  w.i64(v->arena.offset);
  w.i64(v->arena.bytes);
  w.u8(v->arena.home ? 1 : 0);
}

void GraphWriter::ref(const Value* v, ByteWriter& w) const { w.i64(v ? id_of(v) : -1); }

void GraphWriter::write(const Graph& g, ByteWriter& w) {
  w.str(g.name);
  w.i64(g.opset);
  w.i64(g.arena_bytes);
  w.i64(g.planned_peak_bytes);
  w.u64(g.inputs.size());
  for (const Value* v : g.inputs) define(v, w);
  w.u64(g.initializers.size());
  for (const Value* v : g.initializers) define(v, w);
  w.u64(g.nodes().size());
  for (const auto& n : g.nodes()) {
    w.str(n->op);
    w.str(n->name);
    w.u64(n->inputs.size());
    for (const Value* v : n->inputs) ref(v, w);
    w.u64(n->outputs.size());
    for (const Value* v : n->outputs) define(v, w);
    const auto& attrs = n->attrs.all();
    w.u64(attrs.size());
    for (const auto& [k, a] : attrs) {
      w.str(k);
      write_attr(a, w, *this);
    }
    w.u64(n->regions.size());
    for (const auto& r : n->regions) write(*r, w);
  }
  w.u64(g.outputs.size());
  for (const Value* v : g.outputs) ref(v, w);
  w.u64(g.state.size());
  for (const StateBinding& sb : g.state) {
    w.str(sb.kind);
    ref(sb.input, w);
    ref(sb.output, w);
    w.i64(sb.initial ? tensor_index(sb.initial) : -1);
    w.u64(sb.full_dims.size());
    for (int64_t d : sb.full_dims) w.i64(d);
  }
  w.u64(g.import_notes.size());
  for (const auto& s : g.import_notes) w.str(s);
  w.u64(g.initializer_origins.size());
  for (const auto& [name, list] : g.initializer_origins) {
    w.str(name);
    w.u64(list.size());
    for (const InitializerOrigin& o : list) {
      w.str(o.onnx_name);
      w.str(o.view);
      w.i64(o.node);
      w.i64(o.input);
    }
  }
  w.u64(g.input_defaults.size());
  for (const auto& [name, t] : g.input_defaults) {
    w.str(name);
    w.i64(t ? tensor_index(t) : -1);
  }
}

// ---- reader

namespace {

struct ValueRecord {
  std::string name;
  DType dtype = DType::undefined;
  Shape shape;
  InitRole role = InitRole::unknown;
  std::string role_source;
  int64_t tensor = -1;
  ArenaPlacement arena;
};

Status bad(const std::string& what) { return Status::error("malformed graph section: " + what); }

Status read_record(ByteReader& r, ValueRecord& rec) {
  uint8_t dt, role;
  uint64_t rank;
  if (!r.str(rec.name) || !r.u8(dt) || !r.count(rank, 16)) return bad("truncated value");
  if (dt > static_cast<uint8_t>(DType::undefined))
    return bad("value '" + rec.name + "': bad dtype " + std::to_string(dt));
  rec.dtype = static_cast<DType>(dt);
  rec.shape.dims.resize(rank);
  for (Dim& d : rec.shape.dims) {
    int64_t value;
    std::string text;
    if (!r.i64(value) || !r.str(text)) return bad("value '" + rec.name + "': truncated shape");
    d = value >= 0 ? Dim(value) : text.empty() ? Dim() : Dim::from_text(text);
  }
  uint8_t home;
  if (!r.u8(role) || !r.str(rec.role_source) || !r.i64(rec.tensor) || !r.i64(rec.arena.offset) ||
      !r.i64(rec.arena.bytes) || !r.u8(home))
    return bad("value '" + rec.name + "': truncated");
  if (rec.arena.placed() && rec.arena.bytes < 0) return bad("value '" + rec.name + "': bad arena placement");
  rec.arena.home = home != 0;
  if (role > static_cast<uint8_t>(InitRole::constant)) return bad("value '" + rec.name + "': bad role");
  rec.role = static_cast<InitRole>(role);
  return Status::ok();
}

}  // namespace

Value* GraphReader::value(int64_t id) const {
  return id >= 0 && id < static_cast<int64_t>(values_.size()) ? values_[static_cast<size_t>(id)] : nullptr;
}

std::shared_ptr<Tensor> GraphReader::tensor(int64_t i) const {
  return i >= 0 && i < static_cast<int64_t>(pool_.size()) ? pool_[static_cast<size_t>(i)] : nullptr;
}

Status GraphReader::read_tensors(ByteReader& r) {
  uint64_t n;
  if (!r.count(n, 17)) return bad("truncated tensor pool");
  pool_.reserve(n);
  for (uint64_t i = 0; i < n; ++i) {
    Tensor t;
    std::string why;
    if (!read_tensor_bytes(r, t, why)) return bad("tensor " + std::to_string(i) + ": " + why);
    pool_.push_back(std::make_shared<Tensor>(std::move(t)));
  }
  return Status::ok();
}

Expected<std::unique_ptr<Graph>> GraphReader::read(ByteReader& r) {
  auto g = std::make_unique<Graph>();
  KILN_RETURN_IF_ERROR(read_into(*g, r, 0));
  return g;
}

Status GraphReader::read_into(Graph& g, ByteReader& r, int depth) {
  if (depth > 64) return bad("regions nested deeper than 64");
  auto named = [](const Value* v, const ValueRecord& rec) -> Status {
    if (v->name != rec.name) return bad("value '" + rec.name + "' clashes with another of that name");
    return Status::ok();
  };
  auto apply = [&](Value* v, const ValueRecord& rec) -> Status {
    KILN_RETURN_IF_ERROR(named(v, rec));
    v->dtype = rec.dtype;
    v->shape = rec.shape;
    v->role = rec.role;
    v->role_source = rec.role_source;
    v->arena = rec.arena;
    values_.push_back(v);
    return Status::ok();
  };
  auto ref = [&](Value*& out, bool nullable) -> Status {
    int64_t id;
    if (!r.i64(id)) return bad("truncated value reference");
    if (id == -1 && nullable) return out = nullptr, Status::ok();
    out = value(id);
    if (!out)
      return bad("value id " + std::to_string(id) + " out of range (" + std::to_string(values_.size()) + " read)");
    return Status::ok();
  };
  uint64_t n;
  if (!r.str(g.name) || !r.i64(g.opset) || !r.i64(g.arena_bytes) || !r.i64(g.planned_peak_bytes) || !r.count(n, 33))
    return bad("truncated graph header");
  for (uint64_t i = 0; i < n; ++i) {
    ValueRecord rec;
    KILN_RETURN_IF_ERROR(read_record(r, rec));
    KILN_RETURN_IF_ERROR(apply(g.add_input(rec.name, rec.dtype, rec.shape), rec));
  }
  if (!r.count(n, 33)) return bad("truncated initializer list");
  for (uint64_t i = 0; i < n; ++i) {
    ValueRecord rec;
    KILN_RETURN_IF_ERROR(read_record(r, rec));
    std::shared_ptr<Tensor> t = tensor(rec.tensor);
    if (!t) return bad("initializer '" + rec.name + "' without data");
    Value* v = g.add_initializer(rec.name, *t);
    v->data = t;
    KILN_RETURN_IF_ERROR(apply(v, rec));
  }
  if (!r.count(n, 40)) return bad("truncated node list");
  for (uint64_t i = 0; i < n; ++i) {
    std::string op, name;
    uint64_t nin, nout, nattr, nreg;
    if (!r.str(op) || !r.str(name) || !r.count(nin, 8)) return bad("truncated node");
    std::vector<Value*> ins(nin);
    for (Value*& v : ins) KILN_RETURN_IF_ERROR(ref(v, true).with_context("node '" + name + "'"));
    if (!r.count(nout, 33)) return bad("node '" + name + "': truncated outputs");
    std::vector<ValueRecord> outs(nout);
    std::vector<std::string> out_names;
    for (ValueRecord& rec : outs) {
      KILN_RETURN_IF_ERROR(read_record(r, rec));
      out_names.push_back(rec.name);
    }
    Attributes attrs;
    if (!r.count(nattr, 9)) return bad("node '" + name + "': truncated attributes");
    for (uint64_t a = 0; a < nattr; ++a) {
      std::string key;
      uint8_t tag;
      uint64_t len;
      if (!r.str(key) || !r.u8(tag)) return bad("node '" + name + "': truncated attribute");
      bool ok = true;
      switch (tag) {
        case kInt: {
          int64_t v;
          ok = r.i64(v);
          attrs.set(key, v);
          break;
        }
        case kFloat: {
          double v;
          ok = r.f64(v);
          attrs.set(key, v);
          break;
        }
        case kString: {
          std::string v;
          ok = r.str(v);
          attrs.set(key, v);
          break;
        }
        case kInts: {
          std::vector<int64_t> v;
          ok = r.count(len, 8);
          for (uint64_t k = 0; ok && k < len; ++k) ok = r.i64(v.emplace_back());
          attrs.set(key, v);
          break;
        }
        case kFloats: {
          std::vector<double> v;
          ok = r.count(len, 8);
          for (uint64_t k = 0; ok && k < len; ++k) ok = r.f64(v.emplace_back());
          attrs.set(key, v);
          break;
        }
        case kStrings: {
          std::vector<std::string> v;
          ok = r.count(len, 8);
          for (uint64_t k = 0; ok && k < len; ++k) ok = r.str(v.emplace_back());
          attrs.set(key, v);
          break;
        }
        case kTensor: {
          int64_t idx;
          ok = r.i64(idx);
          std::shared_ptr<Tensor> t = ok ? tensor(idx) : nullptr;
          if (ok && !t) return bad("node '" + name + "': attribute '" + key + "' names tensor " + std::to_string(idx));
          if (t) attrs.set(key, *t);
          break;
        }
        default:
          return bad("node '" + name + "': attribute '" + key + "' of unknown kind " + std::to_string(tag));
      }
      if (!ok) return bad("node '" + name + "': attribute '" + key + "' truncated");
    }
    Node* node = g.add_node(op, name, ins, out_names, std::move(attrs));
    for (size_t k = 0; k < outs.size(); ++k) KILN_RETURN_IF_ERROR(apply(node->outputs[k], outs[k]));
    if (!r.count(nreg, 40)) return bad("node '" + name + "': truncated regions");
    for (uint64_t k = 0; k < nreg; ++k) {
      auto region = std::make_unique<Graph>();
      KILN_RETURN_IF_ERROR(read_into(*region, r, depth + 1));
      node->regions.push_back(std::move(region));
    }
  }
  if (!r.count(n, 8)) return bad("truncated graph outputs");
  for (uint64_t i = 0; i < n; ++i) {
    Value* v;
    KILN_RETURN_IF_ERROR(ref(v, false).with_context("graph output"));
    g.outputs.push_back(v);
  }
  if (!r.count(n, 32)) return bad("truncated state bindings");
  for (uint64_t i = 0; i < n; ++i) {
    StateBinding sb;
    int64_t t;
    if (!r.str(sb.kind)) return bad("truncated state binding");
    KILN_RETURN_IF_ERROR(ref(sb.input, true).with_context("state binding"));
    KILN_RETURN_IF_ERROR(ref(sb.output, true).with_context("state binding"));
    if (!r.i64(t)) return bad("truncated state binding");
    sb.initial = tensor(t);
    if (t != -1 && !sb.initial) return bad("state binding names tensor " + std::to_string(t));
    uint64_t rank;
    if (!r.count(rank, 8)) return bad("truncated state binding");
    sb.full_dims.resize(rank);
    for (int64_t& d : sb.full_dims)
      if (!r.i64(d) || d < 0) return bad("truncated state binding");
    g.state.push_back(std::move(sb));
  }
  if (!r.count(n, 8)) return bad("truncated import notes");
  for (uint64_t i = 0; i < n; ++i)
    if (!r.str(g.import_notes.emplace_back())) return bad("truncated import note");
  if (!r.count(n, 16)) return bad("truncated initializer origins");
  for (uint64_t i = 0; i < n; ++i) {
    std::string name;
    uint64_t m;
    if (!r.str(name) || !r.count(m, 32)) return bad("truncated initializer origin");
    auto& list = g.initializer_origins[name];
    for (uint64_t k = 0; k < m; ++k) {
      InitializerOrigin o;
      int64_t node, input;
      if (!r.str(o.onnx_name) || !r.str(o.view) || !r.i64(node) || !r.i64(input))
        return bad("truncated initializer origin");
      o.node = static_cast<int>(node);
      o.input = static_cast<int>(input);
      list.push_back(std::move(o));
    }
  }
  if (!r.count(n, 16)) return bad("truncated input defaults");
  for (uint64_t i = 0; i < n; ++i) {
    std::string name;
    int64_t t;
    if (!r.str(name) || !r.i64(t)) return bad("truncated input default");
    if (!(g.input_defaults[name] = tensor(t)))
      return bad("input default '" + name + "' names tensor " + std::to_string(t));
  }
  return Status::ok();
}

}  // namespace kiln::ir
