// Readers and writers for .npy, safetensors and nanoGPT uint16 token files (see io.h).
// Files are read fully into memory and every size is checked before a byte is copied.
#include "runtime/io.h"

#include <fcntl.h>
#include <unistd.h>

#include <algorithm>
#include <bit>
#include <cctype>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <limits>
#include <nlohmann/json.hpp>
#include <sstream>

#include "runtime/interrupt.h"

namespace kiln::runtime::io {

std::string json_nesting_error(const char* begin, const char* end, int max_depth) {
  int depth = 0;
  bool in_string = false;
  for (const char* p = begin; p < end; ++p) {
    const char c = *p;
    if (in_string) {
      if (c == '\\')
        ++p;
      else if (c == '"')
        in_string = false;
    } else if (c == '"') {
      in_string = true;
    } else if (c == '[' || c == '{') {
      if (++depth > max_depth) return "JSON nested more than " + std::to_string(max_depth) + " levels deep";
    } else if (c == ']' || c == '}') {
      --depth;
    }
  }
  return "";
}

static_assert(std::endian::native == std::endian::little, "kiln's file formats assume a little-endian host");

using ir::DType;
using ir::Tensor;

Expected<std::string> read_file(const std::string& path) {
  std::error_code ec;
  if (std::filesystem::is_directory(path, ec)) return Status::error(path + ": is a directory, not a file");
  // A device or FIFO would be read without end (/dev/zero) or block forever.
  if (std::filesystem::exists(path, ec) && !std::filesystem::is_regular_file(path, ec))
    return Status::error(path + ": not a regular file (a device, FIFO or socket)");
  std::ifstream f(path, std::ios::binary);
  if (!f) return Status::error(path + ": cannot open file");
  // Sized up front: a failed allocation throws std::bad_alloc (reported as out of
  // memory), where a growing stream buffer would stop early and look like a short file.
  const auto size = std::filesystem::file_size(path, ec);
  if (ec) return Status::error(path + ": cannot read its size (" + ec.message() + ")");
  std::string buf(static_cast<size_t>(size), '\0');
  f.read(buf.data(), static_cast<std::streamsize>(size));
  if (f.bad() || f.gcount() != static_cast<std::streamsize>(size)) return Status::error(path + ": read error");
  return buf;
}

void sync_to_disk(const std::string& path) {
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) return;
  ::fsync(fd);
  ::close(fd);
}

Status publish_file(const std::string& tmp, const std::string& path) {
  sync_to_disk(tmp);
  fault_point("publish");  // complete, not yet renamed (tests)
  std::error_code ec;
  std::filesystem::rename(tmp, path, ec);
  if (ec) {
    const std::string why = ec.message();  // before remove() reuses ec
    std::filesystem::remove(tmp, ec);
    return Status::error(path + ": cannot rename '" + tmp + "' into place (" + why + ")");
  }
  const auto dir = std::filesystem::path(path).parent_path();
  sync_to_disk(dir.empty() ? std::string(".") : dir.string());
  return Status::ok();
}

namespace {

// Writes head, body and `more` to path.tmp with write(2), fsyncs and closes it (each
// checked: a full disk may show only at fsync or close), then publishes it over path
// (publish_file). On an error path.tmp is removed and the error names path and errno's
// text ("No space left on device", "File too large" past RLIMIT_FSIZE).
Status write_file_atomic(const std::string& path, const std::string& head, const void* body, size_t body_bytes,
                         const std::vector<std::pair<const void*, size_t>>& more = {}) {
  const std::string tmp = path + ".tmp";
  const int fd = ::open(tmp.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0666);
  if (fd < 0) return Status::error(path + ": cannot open '" + tmp + "' for writing (" + std::strerror(errno) + ")");
  auto fail = [&](const char* what, int err) {
    ::close(fd);
    std::error_code ec;
    std::filesystem::remove(tmp, ec);
    return Status::error(path + ": " + what + " failed (" + std::strerror(err) + ")");
  };
  auto put = [&](const void* p, size_t n) -> int {
    const char* c = static_cast<const char*>(p);
    while (n > 0) {
      const ssize_t w = ::write(fd, c, std::min<size_t>(n, size_t{1} << 30));
      if (w < 0 && errno == EINTR) continue;
      if (w < 0) return errno;
      if (w == 0) return ENOSPC;
      c += w;
      n -= static_cast<size_t>(w);
    }
    return 0;
  };
  int err = put(head.data(), head.size());
  fault_point("write");  // a half-written file (tests)
  if (!err && body_bytes) err = put(body, body_bytes);
  for (auto& [p, n] : more)
    if (!err && n) err = put(p, n);
  if (err) return fail("write", err);
  if (::fsync(fd) != 0) return fail("write (fsync)", errno);
  if (::close(fd) != 0) {
    err = errno;
    std::error_code ec;
    std::filesystem::remove(tmp, ec);
    return Status::error(path + ": write (close) failed (" + std::strerror(err) + ")");
  }
  return publish_file(tmp, path);
}

}  // namespace

Status save_bytes(const std::string& path, const std::string& bytes) {
  return write_file_atomic(path, bytes, nullptr, 0);
}

namespace {

// numel * elem_size, or -1 on a negative dim or overflow past int64.
int64_t checked_nbytes(const std::vector<int64_t>& dims, size_t elem) {
  int64_t n = static_cast<int64_t>(elem);
  for (int64_t d : dims) {
    if (d < 0) return -1;
    if (d != 0 && n > std::numeric_limits<int64_t>::max() / d) return -1;
    n *= d;
  }
  return n;
}

// ---- .npy header: a Python dict literal such as
//   {'descr': '<f4', 'fortran_order': False, 'shape': (2, 3), }
struct NpyHeader {
  std::string descr;
  bool fortran = false;
  std::vector<int64_t> shape;
};

Expected<NpyHeader> parse_npy_header(const std::string& h, const std::string& path) {
  auto bad = [&](const std::string& why) { return Status::error(path + ": malformed .npy header (" + why + ")"); };
  auto find_key = [&](const char* key) -> size_t {
    for (char q : {'\'', '"'}) {
      std::string k = std::string(1, q) + key + q;
      size_t p = h.find(k);
      if (p != std::string::npos) {
        p = h.find(':', p + k.size());
        return p == std::string::npos ? p : p + 1;
      }
    }
    return std::string::npos;
  };
  auto skip_ws = [&](size_t p) {
    while (p < h.size() && std::isspace(static_cast<unsigned char>(h[p]))) ++p;
    return p;
  };
  NpyHeader out;
  size_t p = find_key("descr");
  if (p == std::string::npos) return bad("no 'descr'");
  p = skip_ws(p);
  if (p >= h.size() || (h[p] != '\'' && h[p] != '"'))
    return Status::error(path + ": unsupported .npy dtype (structured or non-string descr)");
  char q = h[p];
  size_t e = h.find(q, p + 1);
  if (e == std::string::npos) return bad("unterminated descr");
  out.descr = h.substr(p + 1, e - p - 1);

  p = find_key("fortran_order");
  if (p == std::string::npos) return bad("no 'fortran_order'");
  p = skip_ws(p);
  if (h.compare(p, 4, "True") == 0)
    out.fortran = true;
  else if (h.compare(p, 5, "False") == 0)
    out.fortran = false;
  else
    return bad("fortran_order is neither True nor False");

  p = find_key("shape");
  if (p == std::string::npos) return bad("no 'shape'");
  p = skip_ws(p);
  if (p >= h.size() || h[p] != '(') return bad("shape is not a tuple");
  e = h.find(')', p);
  if (e == std::string::npos) return bad("unterminated shape");
  std::string body = h.substr(p + 1, e - p - 1);
  size_t i = 0;
  while (i < body.size()) {
    while (i < body.size() && (std::isspace(static_cast<unsigned char>(body[i])) || body[i] == ',')) ++i;
    if (i >= body.size()) break;
    size_t j = i;
    while (j < body.size() && std::isdigit(static_cast<unsigned char>(body[j]))) ++j;
    // Python 2 era files may write "3L".
    if (j == i) return bad("shape entry '" + body.substr(i, 8) + "' is not a non-negative integer");
    std::string num = body.substr(i, j - i);
    if (num.size() > 18) return bad("shape entry too large");
    out.shape.push_back(std::stoll(num));
    i = j;
    if (i < body.size() && body[i] == 'L') ++i;
  }
  return out;
}

Expected<DType> npy_dtype(const std::string& descr, const std::string& path) {
  if (descr.size() < 2) return Status::error(path + ": unsupported .npy dtype '" + descr + "'");
  char order = descr[0];
  std::string code = descr.substr(1);
  if (order == '>' && code != "i1" && code != "u1" && code != "b1")
    return Status::error(path + ": big-endian .npy data ('" + descr +
                         "') is not supported; save it little-endian "
                         "(arr.astype(arr.dtype.newbyteorder('<')))");
  if (order != '<' && order != '|' && order != '=' && order != '>')
    return Status::error(path + ": unsupported .npy dtype '" + descr + "'");
  if (code == "f4") return DType::f32;
  if (code == "f8") return DType::f64;
  if (code == "f2") return DType::f16;
  if (code == "i8") return DType::i64;
  if (code == "i4") return DType::i32;
  if (code == "i1") return DType::i8;
  if (code == "u1") return DType::u8;
  if (code == "b1") return DType::boolean;
  return Status::error(path + ": unsupported .npy dtype '" + descr + "' (supported: <f4 <f8 <f2 <i8 <i4 |i1 |u1 |b1)");
}

Expected<std::string> npy_descr(DType t) {
  switch (t) {
    case DType::f32:
      return std::string("<f4");
    case DType::f64:
      return std::string("<f8");
    case DType::f16:
      return std::string("<f2");
    case DType::i64:
      return std::string("<i8");
    case DType::i32:
      return std::string("<i4");
    case DType::i8:
      return std::string("|i1");
    case DType::u8:
      return std::string("|u1");
    case DType::boolean:
      return std::string("|b1");
    case DType::bf16:
      return Status::error("bf16 has no .npy dtype; cast to f32 before saving");
    default:
      return Status::error("undefined tensor");
  }
}

// ---- safetensors dtype names
const char* st_name(DType t) {
  switch (t) {
    case DType::f32:
      return "F32";
    case DType::f64:
      return "F64";
    case DType::bf16:
      return "BF16";
    case DType::f16:
      return "F16";
    case DType::i64:
      return "I64";
    case DType::i32:
      return "I32";
    case DType::i8:
      return "I8";
    case DType::u8:
      return "U8";
    case DType::boolean:
      return "BOOL";
    default:
      return nullptr;
  }
}

Expected<DType> st_dtype(const std::string& s, const std::string& where) {
  for (DType t :
       {DType::f32, DType::f64, DType::bf16, DType::f16, DType::i64, DType::i32, DType::i8, DType::u8, DType::boolean})
    if (s == st_name(t)) return t;
  return Status::error(where + ": unsupported safetensors dtype '" + s +
                       "' (supported: F32 F64 BF16 F16 I64 I32 I8 "
                       "U8 BOOL)");
}

}  // namespace

// ============================================================================= .npy
namespace {
/// Where the header dict of the .npy bytes `buf` lies (magic and version checked):
/// [hstart, hstart + hlen). `buf` may be only the file's first 12 bytes: the caller checks
/// that the header is there.
Status locate_npy_header(const std::string& buf, const std::string& path, size_t& hstart, size_t& hlen) {
  static const char kMagic[] = "\x93NUMPY";
  if (buf.size() < 10 || std::memcmp(buf.data(), kMagic, 6) != 0)
    return Status::error(path + ": not a .npy file (bad magic)");
  int major = static_cast<unsigned char>(buf[6]);
  if (major == 1) {
    hlen = static_cast<unsigned char>(buf[8]) | (static_cast<size_t>(static_cast<unsigned char>(buf[9])) << 8);
    hstart = 10;
  } else if (major == 2 || major == 3) {
    if (buf.size() < 12) return Status::error(path + ": truncated .npy header");
    uint32_t l;
    std::memcpy(&l, buf.data() + 8, 4);
    hlen = l;
    hstart = 12;
  } else {
    return Status::error(path + ": unsupported .npy format version " + std::to_string(major));
  }
  return Status::ok();
}
}  // namespace

Expected<std::vector<int64_t>> npy_shape(const std::string& path) {
  std::ifstream f(path, std::ios::binary);
  if (!f) return Status::error(path + ": cannot open the .npy file");
  std::string buf(12, '\0');
  f.read(buf.data(), 12);
  buf.resize(static_cast<size_t>(f.gcount()));
  size_t hstart = 0, hlen = 0;
  KILN_RETURN_IF_ERROR(locate_npy_header(buf, path, hstart, hlen));
  if (hlen > (size_t(1) << 20))  // numpy's own limit is 2^16 bytes unless told otherwise
    return Status::error(path + ": malformed .npy header (" + std::to_string(hlen) + " bytes long)");
  buf.resize(hstart + hlen);
  f.seekg(0);
  f.read(buf.data(), static_cast<std::streamsize>(buf.size()));
  if (static_cast<size_t>(f.gcount()) != buf.size()) return Status::error(path + ": truncated .npy header");
  KILN_ASSIGN_OR_RETURN(NpyHeader h, parse_npy_header(buf.substr(hstart, hlen), path));
  return h.shape;
}

Expected<Tensor> load_npy(const std::string& path) {
  KILN_ASSIGN_OR_RETURN(std::string buf, read_file(path));
  size_t hlen = 0, hstart = 0;
  KILN_RETURN_IF_ERROR(locate_npy_header(buf, path, hstart, hlen));
  if (hstart + hlen > buf.size()) return Status::error(path + ": truncated .npy header");
  KILN_ASSIGN_OR_RETURN(NpyHeader h, parse_npy_header(buf.substr(hstart, hlen), path));
  if (h.fortran)
    return Status::error(path +
                         ": fortran_order=True .npy files are not supported; save a C-ordered array "
                         "(np.ascontiguousarray)");
  KILN_ASSIGN_OR_RETURN(DType dt, npy_dtype(h.descr, path));
  int64_t nbytes = checked_nbytes(h.shape, ir::dtype_size(dt));
  if (nbytes < 0) return Status::error(path + ": .npy shape " + ir::dims_to_string(h.shape) + " is too large");
  size_t off = hstart + hlen;
  size_t have = buf.size() - off;
  if (static_cast<uint64_t>(nbytes) > have)
    return Status::error(path + ": truncated .npy data: shape " + ir::dims_to_string(h.shape) + " " + h.descr +
                         " needs " + std::to_string(nbytes) + " bytes, file has " + std::to_string(have));
  if (static_cast<uint64_t>(nbytes) < have)
    return Status::error(path + ": .npy file has " + std::to_string(have - nbytes) + " bytes after the data of shape " +
                         ir::dims_to_string(h.shape));
  Tensor t(dt, h.shape);
  if (nbytes) std::memcpy(t.raw(), buf.data() + off, static_cast<size_t>(nbytes));
  if (dt == DType::boolean) {  // normalise to 0/1
    auto* b = t.data<uint8_t>();
    for (int64_t i = 0; i < t.numel(); ++i) b[i] = b[i] ? 1 : 0;
  }
  return t;
}

Status save_npy(const std::string& path, const Tensor& t) {
  auto d = npy_descr(t.dtype());
  if (!d) return d.status().with_context(path);
  std::string shape = "(";
  for (size_t i = 0; i < t.dims().size(); ++i) {
    if (i) shape += ", ";
    shape += std::to_string(t.dims()[i]);
  }
  if (t.rank() == 1) shape += ",";  // Python's one-element tuple
  shape += ")";
  std::string dict = "{'descr': '" + *d + "', 'fortran_order': False, 'shape': " + shape + ", }";
  // Pad with spaces so that magic + length + header (ending in '\n') is a multiple of 64.
  size_t pre = 10;
  size_t total = (pre + dict.size() + 1 + 63) / 64 * 64;
  int major = 1;
  if (total - pre > 65535) {
    major = 2;
    pre = 12;
    total = (pre + dict.size() + 1 + 63) / 64 * 64;
  }
  std::string hdr = dict + std::string(total - pre - dict.size() - 1, ' ') + "\n";
  std::string head = std::string("\x93NUMPY", 6) + static_cast<char>(major) + '\0';
  if (major == 1) {
    uint16_t l = static_cast<uint16_t>(hdr.size());
    head.append(reinterpret_cast<const char*>(&l), 2);
  } else {
    uint32_t l = static_cast<uint32_t>(hdr.size());
    head.append(reinterpret_cast<const char*>(&l), 4);
  }
  head += hdr;
  return write_file_atomic(path, head, t.raw(), t.nbytes());
}

// ============================================================================= safetensors
Status save_safetensors(const std::string& path, const std::map<std::string, Tensor>& tensors,
                        const std::map<std::string, std::string>& metadata) {
  nlohmann::ordered_json h = nlohmann::ordered_json::object();
  if (!metadata.empty()) {
    nlohmann::ordered_json m = nlohmann::ordered_json::object();
    for (auto& [k, v] : metadata) m[k] = v;
    h["__metadata__"] = m;
  }
  std::vector<std::pair<const void*, size_t>> blobs;
  uint64_t off = 0;
  for (auto& [name, t] : tensors) {
    if (name.empty() || name == "__metadata__")
      return Status::error(path + ": invalid safetensors tensor name '" + name + "'");
    const char* dn = st_name(t.dtype());
    if (!dn || (t.numel() > 0 && !t.raw())) return Status::error(path + ": tensor '" + name + "' is undefined");
    uint64_t n = t.nbytes();
    h[name] = {{"dtype", dn}, {"shape", t.dims()}, {"data_offsets", {off, off + n}}};
    blobs.push_back({t.raw(), static_cast<size_t>(n)});
    off += n;
  }
  std::string js = h.dump();
  js.append((8 - js.size() % 8) % 8, ' ');
  uint64_t len = js.size();
  std::string head(reinterpret_cast<const char*>(&len), 8);
  head += js;
  return write_file_atomic(path, head, nullptr, 0, blobs);
}

Expected<std::map<std::string, Tensor>> load_safetensors(const std::string& path,
                                                         std::map<std::string, std::string>* metadata) {
  KILN_ASSIGN_OR_RETURN(std::string buf, read_file(path));
  if (buf.size() < 8) return Status::error(path + ": not a safetensors file (shorter than the 8-byte header length)");
  uint64_t hlen;
  std::memcpy(&hlen, buf.data(), 8);
  if (hlen > 100'000'000ull)
    return Status::error(path + ": safetensors header length " + std::to_string(hlen) +
                         " exceeds 100 MB (corrupt file?)");
  if (8 + hlen > buf.size())
    return Status::error(path + ": truncated safetensors file: header of " + std::to_string(hlen) +
                         " bytes, file has " + std::to_string(buf.size()) + " bytes");
  if (std::string deep = json_nesting_error(reinterpret_cast<const char*>(buf.data()) + 8,
                                            reinterpret_cast<const char*>(buf.data()) + 8 + hlen);
      !deep.empty())
    return Status::error(path + ": safetensors header: " + deep);
  nlohmann::json h;
  try {
    h = parse_json_untrusted(std::string_view(buf.data() + 8, static_cast<size_t>(hlen)));
  } catch (const std::exception& e) {
    std::string w = e.what();
    return Status::error(path + ": safetensors header is not valid JSON (" + w.substr(0, w.find('\n')) + ")");
  }
  if (!h.is_object()) return Status::error(path + ": safetensors header is not a JSON object");
  const uint64_t data_len = buf.size() - 8 - hlen;
  const char* data = buf.data() + 8 + hlen;
  std::map<std::string, Tensor> out;
  std::vector<std::pair<uint64_t, uint64_t>> ranges;
  std::vector<std::string> range_names;
  for (auto it = h.begin(); it != h.end(); ++it) {
    const std::string& name = it.key();
    const auto& e = it.value();
    if (name == "__metadata__") {
      if (!e.is_object()) return Status::error(path + ": __metadata__ is not an object");
      if (metadata) {
        metadata->clear();
        for (auto m = e.begin(); m != e.end(); ++m) {
          if (!m.value().is_string())
            return Status::error(path + ": __metadata__ value '" + m.key() + "' is not a string");
          (*metadata)[m.key()] = m.value().get<std::string>();
        }
      }
      continue;
    }
    std::string where = path + ": tensor '" + name + "'";
    if (!e.is_object() || !e.contains("dtype") || !e.contains("shape") || !e.contains("data_offsets"))
      return Status::error(where + ": entry needs dtype, shape and data_offsets");
    if (!e["dtype"].is_string()) return Status::error(where + ": dtype is not a string");
    KILN_ASSIGN_OR_RETURN(DType dt, st_dtype(e["dtype"].get<std::string>(), where));
    std::vector<int64_t> dims;
    if (!e["shape"].is_array()) return Status::error(where + ": shape is not an array");
    for (auto& d : e["shape"]) {
      if (!d.is_number_unsigned()) return Status::error(where + ": shape entries must be non-negative integers");
      uint64_t v = d.get<uint64_t>();
      if (v > static_cast<uint64_t>(std::numeric_limits<int64_t>::max()))
        return Status::error(where + ": shape entry too large");
      dims.push_back(static_cast<int64_t>(v));
    }
    const auto& o = e["data_offsets"];
    if (!o.is_array() || o.size() != 2 || !o[0].is_number_unsigned() || !o[1].is_number_unsigned())
      return Status::error(where + ": data_offsets must be two non-negative integers");
    uint64_t b = o[0].get<uint64_t>(), en = o[1].get<uint64_t>();
    if (b > en)
      return Status::error(where + ": data_offsets [" + std::to_string(b) + ", " + std::to_string(en) +
                           "] are reversed");
    if (en > data_len)
      return Status::error(where + ": data_offsets end " + std::to_string(en) + " is past the data area of " +
                           std::to_string(data_len) + " bytes (truncated file?)");
    int64_t nbytes = checked_nbytes(dims, ir::dtype_size(dt));
    if (nbytes < 0 || static_cast<uint64_t>(nbytes) != en - b)
      return Status::error(where + ": shape " + ir::dims_to_string(dims) + " " + ir::dtype_name(dt) + " needs " +
                           std::to_string(nbytes) + " bytes but data_offsets span " + std::to_string(en - b));
    Tensor t(dt, dims);
    if (nbytes) std::memcpy(t.raw(), data + b, static_cast<size_t>(nbytes));
    out.emplace(name, std::move(t));
    ranges.push_back({b, en});
    range_names.push_back(name);
  }
  // The tensors must tile the data area: sorted by start, each begins where the last ended.
  std::vector<size_t> order(ranges.size());
  for (size_t i = 0; i < order.size(); ++i) order[i] = i;
  std::sort(order.begin(), order.end(), [&](size_t a, size_t c) { return ranges[a] < ranges[c]; });
  uint64_t pos = 0;
  for (size_t i : order) {
    if (ranges[i].first != pos)
      return Status::error(path + ": tensor '" + range_names[i] + "' starts at byte " +
                           std::to_string(ranges[i].first) + " of the data area, expected " + std::to_string(pos) +
                           (ranges[i].first < pos ? " (overlapping tensors)" : " (hole in the data area)"));
    pos = ranges[i].second;
  }
  if (pos != data_len)
    return Status::error(path + ": " + std::to_string(data_len - pos) +
                         " bytes after the last tensor in the data area");
  return out;
}

// ============================================================================= tokens
Expected<std::vector<uint16_t>> load_tokens(const std::string& path) {
  KILN_ASSIGN_OR_RETURN(std::string buf, read_file(path));
  if (buf.size() % 2 != 0)
    return Status::error(path + ": token file has an odd number of bytes (" + std::to_string(buf.size()) +
                         "); expected a uint16 little-endian stream");
  std::vector<uint16_t> toks(buf.size() / 2);
  if (!toks.empty()) std::memcpy(toks.data(), buf.data(), buf.size());
  return toks;
}

Expected<TokenFile> open_token_file(const std::string& path) {
  KILN_ASSIGN_OR_RETURN(auto toks, load_tokens(path));
  TokenFile f;
  f.path = path;
  f.tokens = std::make_shared<const std::vector<uint16_t>>(std::move(toks));
  return f;
}

Expected<TokenBatch> token_windows(const TokenFile& f, const std::vector<int64_t>& starts, int64_t seq) {
  const int64_t n = f.size();
  if (seq < 1) return Status::error(f.path + ": sequence length must be >= 1, got " + std::to_string(seq));
  if (starts.empty()) return Status::error(f.path + ": no window starts given");
  TokenBatch b;
  const int64_t B = static_cast<int64_t>(starts.size());
  b.inputs = Tensor(DType::i64, {B, seq});
  b.targets = Tensor(DType::i64, {B, seq});
  b.starts = starts;
  int64_t* x = b.inputs.data<int64_t>();   // (B, T)
  int64_t* y = b.targets.data<int64_t>();  // (B, T)
  const uint16_t* tok = f.tokens ? f.tokens->data() : nullptr;
  for (int64_t r = 0; r < B; ++r) {
    int64_t s = starts[r];
    if (s < 0 || s > n - seq - 1)
      return Status::error(f.path + ": window start " + std::to_string(s) + " with T = " + std::to_string(seq) +
                           " runs past the " + std::to_string(n) + " tokens (needs s + T + 1 <= n)");
    for (int64_t t = 0; t < seq; ++t) {
      x[r * seq + t] = tok[s + t];
      y[r * seq + t] = tok[s + t + 1];
    }
  }
  return b;
}

Expected<std::vector<int64_t>> sample_token_starts(const TokenFile& f, int64_t batch, int64_t seq,
                                                   std::mt19937_64& rng) {
  if (batch < 1) return Status::error(f.path + ": batch size must be >= 1, got " + std::to_string(batch));
  if (seq < 1) return Status::error(f.path + ": sequence length must be >= 1, got " + std::to_string(seq));
  if (f.size() < seq + 1)
    return Status::error(f.path + ": has " + std::to_string(f.size()) +
                         " tokens, fewer than T + 1 = " + std::to_string(seq + 1));
  const uint64_t span = static_cast<uint64_t>(f.size() - seq);  // s in [0, n - T - 1]
  std::vector<int64_t> starts(batch);
  for (auto& s : starts) s = static_cast<int64_t>(rng() % span);
  return starts;
}

Expected<TokenBatch> sample_token_batch(const TokenFile& f, int64_t batch, int64_t seq, std::mt19937_64& rng) {
  KILN_ASSIGN_OR_RETURN(auto starts, sample_token_starts(f, batch, seq, rng));
  return token_windows(f, starts, seq);
}

// ----------------------------------------------------------------------------- JSON
nlohmann::json parse_json_untrusted(std::string_view text) {
  // Nesting is refused before the parser (iterative itself) builds a value that a
  // recursive dump could not print.
  if (std::string deep = json_nesting_error(text.data(), text.data() + text.size()); !deep.empty())
    throw std::invalid_argument(deep);
  return nlohmann::json::parse(text.begin(), text.end());
}

namespace {
void excerpt_into(const nlohmann::json& v, std::string& out, size_t max_chars) {
  if (out.size() > max_chars) return;
  auto scalar = [](const nlohmann::json& x) {
    return x.dump(-1, ' ', false, nlohmann::json::error_handler_t::replace);
  };
  if (v.is_object()) {
    out += '{';
    bool first = true;
    for (auto it = v.begin(); it != v.end() && out.size() <= max_chars; ++it) {
      out += first ? "" : ",";
      first = false;
      out += scalar(nlohmann::json(it.key())) + ":";
      excerpt_into(it.value(), out, max_chars);
    }
    out += '}';
  } else if (v.is_array()) {
    out += '[';
    bool first = true;
    for (auto it = v.begin(); it != v.end() && out.size() <= max_chars; ++it) {
      out += first ? "" : ",";
      first = false;
      excerpt_into(*it, out, max_chars);
    }
    out += ']';
  } else {
    out += scalar(v);
  }
}
}  // namespace

std::string json_excerpt(const nlohmann::json& v, size_t max_chars) {
  std::string out;
  excerpt_into(v, out, max_chars);
  if (out.size() > max_chars) out = out.substr(0, max_chars) + "...";
  return out;
}

}  // namespace kiln::runtime::io
