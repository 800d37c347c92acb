// ONNX TensorProto <-> ir::Tensor (see tensor_proto.h). Also holds the shared
// helper that names a tensor in error messages (initializer / Constant / tensor).
#include "frontend/tensor_proto.h"

#include <cctype>
#include <climits>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <sstream>

#include "frontend/tensor_proto_internal.h"

namespace kiln::frontend {

namespace fs = std::filesystem;

namespace {

// Splits a location on '/' and '\' (ONNX locations are POSIX-style, Windows exports use '\').
std::vector<std::string> path_components(const std::string& p) {
  std::vector<std::string> out;
  std::string cur;
  for (char c : p) {
    if (c == '/' || c == '\\') {
      out.push_back(cur);
      cur.clear();
    } else {
      cur.push_back(c);
    }
  }
  out.push_back(cur);
  return out;
}

bool is_absolute_location(const std::string& p) {
  if (p.empty()) return false;
  if (p[0] == '/' || p[0] == '\\') return true;
  // Windows drive letter "C:..."
  if (p.size() >= 2 && std::isalpha(static_cast<unsigned char>(p[0])) && p[1] == ':') return true;
  return false;
}

// A decimal integer >= 0 (all of the text, as ONNX writes offset and length); errors
// name the entry.
Status parse_external_int(const std::string& who, const std::string& key, const std::string& v, int64_t& out) {
  bool digits = !v.empty();
  for (char c : v) digits = digits && c >= '0' && c <= '9';
  if (!digits) {
    if (v.size() > 1 && v[0] == '-' && v.find_first_not_of("0123456789", 1) == std::string::npos)
      return Status::error(who + ": external data " + key + " " + v + " is negative");
    return Status::error(who + ": external data entry '" + key + "' has a non-integer value '" + v + "'");
  }
  int64_t r = 0;
  for (char c : v) {
    if (r > (INT64_MAX - (c - '0')) / 10)
      return Status::error(who + ": external data " + key + " " + v + " is out of range (more than " +
                           std::to_string(INT64_MAX) + ")");
    r = r * 10 + (c - '0');
  }
  out = r;
  return Status::ok();
}

// What a path that is not a regular file is, for error lines.
std::string file_kind(const fs::path& p) {
  std::error_code ec;
  const fs::file_status st = fs::status(p, ec);
  switch (st.type()) {
    case fs::file_type::directory:
      return "a directory";
    case fs::file_type::fifo:
      return "a FIFO";
    case fs::file_type::socket:
      return "a socket";
    case fs::file_type::block:
    case fs::file_type::character:
      return "a device";
    default:
      return "";
  }
}

// Checks the external-data entries of `tp`, then allocates `t` (dtype/dims) and reads it.
// The file must lie inside the model's folder after symlinks are resolved (the ONNX
// external-data path-traversal class: '..', absolute paths, symlinks out of the folder).
Status read_external(const onnx::TensorProto& tp, const std::string& model_dir, const std::string& who, ir::DType dt,
                     const std::vector<int64_t>& dims, size_t nbytes, ir::Tensor& t) {
  std::string location;
  int64_t offset = 0, length = -1;
  for (const auto& e : tp.external_data()) {
    if (e.key() == "location")
      location = e.value();
    else if (e.key() == "offset")
      KILN_RETURN_IF_ERROR(parse_external_int(who, "offset", e.value(), offset));
    else if (e.key() == "length")
      KILN_RETURN_IF_ERROR(parse_external_int(who, "length", e.value(), length));
  }
  if (location.empty()) return Status::error(who + ": external data has no 'location'");
  if (is_absolute_location(location))
    return Status::error(who + ": external data path '" + location +
                         "' is absolute; only paths inside the model's folder are allowed");
  for (const auto& c : path_components(location))
    if (c == "..")
      return Status::error(who + ": external data path '" + location +
                           "' contains '..'; only paths inside the model's folder are allowed");
  const fs::path dir = model_dir.empty() ? fs::path(".") : fs::path(model_dir);
  fs::path file = dir / location;
  std::error_code ec;
  if (!fs::exists(file, ec)) {
    if (fs::is_symlink(fs::symlink_status(file, ec)))
      return Status::error(who + ": external data file '" + location + "' is a dangling symlink");
    return Status::error(who + ": external data file '" + location + "' not found (looked for '" + file.string() +
                         "')");
  }
  {
    const fs::path real_dir = fs::canonical(dir, ec);
    const fs::path real_file = ec ? fs::path() : fs::canonical(file, ec);
    if (ec) return Status::error(who + ": cannot resolve external data path '" + file.string() + "'");
    auto d = real_dir.begin();
    auto f = real_file.begin();
    for (; d != real_dir.end() && f != real_file.end() && *d == *f; ++d, ++f) {
    }
    if (d != real_dir.end() || f == real_file.end())
      return Status::error(who + ": external data path '" + location +
                           "' leads out of the model's folder through a symlink; only files inside it are read");
  }
  if (!fs::is_regular_file(file, ec)) {
    const std::string kind = file_kind(file);
    return Status::error(who + ": external data path '" + location + "' is " +
                         (kind.empty() ? std::string("not a regular file") : kind + ", not a file"));
  }
  auto fsize = static_cast<int64_t>(fs::file_size(file, ec));
  if (ec) return Status::error(who + ": cannot read external data file '" + file.string() + "'");
  if (offset > fsize)
    return Status::error(who + ": external data offset " + std::to_string(offset) + " exceeds the size " +
                         std::to_string(fsize) + " of file '" + location + "'");
  if (length < 0) length = fsize - offset;
  if (length > fsize - offset)
    return Status::error(who + ": external data (offset " + std::to_string(offset) + ", length " +
                         std::to_string(length) + ") exceeds the size " + std::to_string(fsize) + " of file '" +
                         location + "'");
  if (static_cast<size_t>(length) != nbytes)
    return Status::error(who + ": external data length " + std::to_string(length) + " bytes does not match " +
                         std::to_string(nbytes) + " bytes of its dtype and dims");
  std::ifstream in(file, std::ios::binary);
  if (!in) return Status::error(who + ": cannot open external data file '" + file.string() + "'");
  t = ir::Tensor(dt, dims);
  in.seekg(offset);
  in.read(static_cast<char*>(t.raw()), static_cast<std::streamsize>(nbytes));
  if (!in) return Status::error(who + ": short read from external data file '" + file.string() + "'");
  return Status::ok();
}

// Number of elements found in the typed field that holds this dtype.
template <typename Field>
Status check_count(const Field& f, int64_t numel, const std::string& who, const char* field) {
  if (static_cast<int64_t>(f.size()) != numel)
    return Status::error(who + ": " + field + " has " + std::to_string(f.size()) + " values, dims need " +
                         std::to_string(numel));
  return Status::ok();
}

}  // namespace

Expected<ir::Tensor> tensor_from_proto_named(const onnx::TensorProto& tp, const std::string& model_dir,
                                             const std::string& who) {
  auto dt = ir::dtype_from_onnx(tp.data_type());
  if (!dt) return Status::error(who + ": " + dt.message());
  if (tp.has_segment()) return Status::error(who + ": segmented tensors are not supported");
  // Sizes are validated against the data before anything is allocated, so a corrupt
  // header (huge dims) gives an error, not an out-of-memory abort.
  std::vector<int64_t> dims;
  int64_t n = 1;
  const int64_t esize = static_cast<int64_t>(ir::dtype_size(*dt));
  for (int64_t d : tp.dims()) {
    if (d < 0) return Status::error(who + ": negative dim " + std::to_string(d));
    if (d > 0 && n > (INT64_MAX / 16) / d)
      return Status::error(who + ": dims " + ir::dims_to_string({tp.dims().begin(), tp.dims().end()}) +
                           " have too many elements");
    n *= d;
    dims.push_back(d);
  }
  const size_t nbytes = static_cast<size_t>(n * esize);
  ir::Tensor t;

  if (tp.data_location() == onnx::TensorProto::EXTERNAL) {
    if (nbytes == 0) return ir::Tensor(*dt, dims);
    KILN_RETURN_IF_ERROR(read_external(tp, model_dir, who, *dt, dims, nbytes, t));
    return t;
  }
  if (tp.has_raw_data()) {
    if (tp.raw_data().size() != nbytes)
      return Status::error(who + ": raw_data has " + std::to_string(tp.raw_data().size()) + " bytes, " +
                           ir::dtype_name(*dt) + ir::dims_to_string(dims) + " needs " + std::to_string(nbytes));
    t = ir::Tensor(*dt, dims);
    if (nbytes) std::memcpy(t.raw(), tp.raw_data().data(), nbytes);
    return t;
  }
  if (n == 0) return ir::Tensor(*dt, dims);
  switch (*dt) {
    case ir::DType::f32:
      KILN_RETURN_IF_ERROR(check_count(tp.float_data(), n, who, "float_data"));
      t = ir::Tensor(*dt, dims);
      std::memcpy(t.raw(), tp.float_data().data(), nbytes);
      break;
    case ir::DType::f64:
      KILN_RETURN_IF_ERROR(check_count(tp.double_data(), n, who, "double_data"));
      t = ir::Tensor(*dt, dims);
      std::memcpy(t.raw(), tp.double_data().data(), nbytes);
      break;
    case ir::DType::i64:
      KILN_RETURN_IF_ERROR(check_count(tp.int64_data(), n, who, "int64_data"));
      t = ir::Tensor(*dt, dims);
      std::memcpy(t.raw(), tp.int64_data().data(), nbytes);
      break;
    case ir::DType::i32:
      KILN_RETURN_IF_ERROR(check_count(tp.int32_data(), n, who, "int32_data"));
      t = ir::Tensor(*dt, dims);
      std::memcpy(t.raw(), tp.int32_data().data(), nbytes);
      break;
    case ir::DType::f16:
    case ir::DType::bf16: {
      // int32_data holds the uint16 bit patterns (onnx.proto: "float16 values must be bit-wise
      // converted to an uint16_t prior to writing to the buffer").
      KILN_RETURN_IF_ERROR(check_count(tp.int32_data(), n, who, "int32_data"));
      t = ir::Tensor(*dt, dims);
      auto* p = t.data<uint16_t>();
      for (int64_t i = 0; i < n; ++i) p[i] = static_cast<uint16_t>(tp.int32_data(static_cast<int>(i)));
      break;
    }
    case ir::DType::i8:
    case ir::DType::u8:
    case ir::DType::boolean: {
      KILN_RETURN_IF_ERROR(check_count(tp.int32_data(), n, who, "int32_data"));
      t = ir::Tensor(*dt, dims);
      auto* p = t.data<uint8_t>();
      for (int64_t i = 0; i < n; ++i) {
        int32_t v = tp.int32_data(static_cast<int>(i));
        p[i] = *dt == ir::DType::boolean ? (v != 0 ? 1 : 0) : static_cast<uint8_t>(v);
      }
      break;
    }
    default:
      return Status::error(who + ": unsupported dtype");
  }
  return t;
}

Expected<ir::Tensor> tensor_from_proto(const onnx::TensorProto& tp, const std::string& model_dir) {
  return tensor_from_proto_named(tp, model_dir, "tensor '" + tp.name() + "'");
}

Expected<ir::Tensor> load_tensor_pb(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) return Status::error(path + ": cannot open file");
  std::stringstream ss;
  ss << in.rdbuf();
  std::string bytes = ss.str();
  onnx::TensorProto tp;
  if (!tp.ParseFromString(bytes) || (tp.dims_size() == 0 && tp.data_type() == 0))
    return Status::error(path + ": not a serialized ONNX TensorProto (truncated or wrong file?)");
  std::string dir = fs::path(path).parent_path().string();
  auto t = tensor_from_proto(tp, dir);
  if (!t) return t.status().with_context(path);
  return t;
}

Expected<onnx::TensorProto> tensor_to_proto(const ir::Tensor& t, const std::string& name) {
  if (t.dtype() == ir::DType::undefined) return Status::error("tensor '" + name + "' has no dtype");
  onnx::TensorProto tp;
  tp.set_name(name);
  tp.set_data_type(ir::dtype_to_onnx(t.dtype()));
  for (int64_t d : t.dims()) tp.add_dims(d);
  if (t.nbytes() > 0)
    tp.set_raw_data(static_cast<const char*>(t.raw()), t.nbytes());
  else
    tp.set_raw_data(std::string());
  return tp;
}

Status save_tensor_pb(const ir::Tensor& t, const std::string& name, const std::string& path) {
  KILN_ASSIGN_OR_RETURN(onnx::TensorProto tp, tensor_to_proto(t, name));
  std::string tmp = path + ".tmp";
  {
    std::ofstream out(tmp, std::ios::binary | std::ios::trunc);
    if (!out || !tp.SerializeToOstream(&out)) return Status::error(path + ": cannot write file");
  }
  std::error_code ec;
  fs::rename(tmp, path, ec);
  if (ec) return Status::error(path + ": cannot rename " + tmp + ": " + ec.message());
  return Status::ok();
}

namespace {

/// Calls fn(tensor, who) on each TensorProto of graph `g`: initializers, then node
/// attributes (t, tensors) and the graphs of attributes (g, graphs), depth first; stops at
/// the first error. Adds nothing to `g` (only fields that are present are visited).
template <class Fn>
Status visit_tensors(onnx::GraphProto& g, Fn&& fn) {
  for (auto& tp : *g.mutable_initializer()) KILN_RETURN_IF_ERROR(fn(tp, "initializer '" + tp.name() + "'"));
  for (auto& n : *g.mutable_node())
    for (auto& a : *n.mutable_attribute()) {
      const std::string who = "node '" + n.name() + "': attribute '" + a.name() + "'";
      if (a.has_t()) KILN_RETURN_IF_ERROR(fn(*a.mutable_t(), who));
      for (auto& t : *a.mutable_tensors()) KILN_RETURN_IF_ERROR(fn(t, who));
      if (a.has_g()) KILN_RETURN_IF_ERROR(visit_tensors(*a.mutable_g(), fn));
      for (auto& sg : *a.mutable_graphs()) KILN_RETURN_IF_ERROR(visit_tensors(sg, fn));
    }
  return Status::ok();
}

}  // namespace

Expected<int64_t> inline_external_data(onnx::ModelProto& model, const std::string& model_dir) {
  int64_t inlined = 0;
  Status st = visit_tensors(*model.mutable_graph(), [&](onnx::TensorProto& tp, const std::string& who) -> Status {
    if (tp.data_location() != onnx::TensorProto::EXTERNAL) return Status::ok();
    auto t = tensor_from_proto_named(tp, model_dir, who);
    if (!t) return t.status();
    tp.clear_external_data();
    tp.set_data_location(onnx::TensorProto::DEFAULT);
    tp.set_raw_data(std::string(static_cast<const char*>(t->raw()), t->nbytes()));  // little-endian host
    inlined += static_cast<int64_t>(t->nbytes());
    return Status::ok();
  });
  if (!st) return st;
  return inlined;
}

std::string first_external_tensor(const onnx::ModelProto& model) {
  std::string first;
  // The visitor only reads here: the const_cast lends it the model without a copy.
  (void)visit_tensors(const_cast<onnx::GraphProto&>(model.graph()),
                      [&](onnx::TensorProto& tp, const std::string& who) -> Status {
                        if (tp.data_location() != onnx::TensorProto::EXTERNAL) return Status::ok();
                        first = who;
                        return Status::error("found");
                      });
  return first;
}

}  // namespace kiln::frontend
