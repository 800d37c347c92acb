// Readers and writers of variable-length token datasets (see sequences.h).
#include "runtime/sequences.h"

#include <algorithm>
#include <bit>
#include <cstring>
#include <filesystem>
#include <limits>
#include <nlohmann/json.hpp>

#include "runtime/io.h"

namespace kiln::runtime {

static_assert(std::endian::native == std::endian::little, "the indexed dataset is little-endian");

namespace {

constexpr int64_t kInt32Max = std::numeric_limits<int32_t>::max();
constexpr int32_t kIgnoreIndex = -100;

bool ends_with(const std::string& s, std::string_view suffix) {
  return s.size() >= suffix.size() && s.compare(s.size() - suffix.size(), suffix.size(), suffix) == 0;
}

template <typename T>
T load_le(const char* p) {
  T v;
  std::memcpy(&v, p, sizeof(T));
  return v;
}

template <typename T>
void put_le(std::string& out, T v) {
  char b[sizeof(T)];
  std::memcpy(b, &v, sizeof(T));
  out.append(b, sizeof(T));
}

}  // namespace

// ----------------------------------------------------------------------------- SequenceSet

int64_t SequenceSet::max_length() const {
  int64_t m = 0;
  for (int64_t i = 0; i < size(); ++i) m = std::max(m, length(i));
  return m;
}

std::map<int64_t, int64_t> SequenceSet::length_histogram() const {
  std::map<int64_t, int64_t> h;
  for (int64_t i = 0; i < size(); ++i) ++h[length(i)];
  return h;
}

std::string SequenceSet::row_name(int64_t i) const {
  if (i >= 0 && i < static_cast<int64_t>(lines.size())) return "line " + std::to_string(lines[i]);
  return "sequence " + std::to_string(i);
}

Status check_sequence_set(const SequenceSet& s) {
  const std::string& f = s.file.empty() ? std::string("sequence set") : s.file;
  if (s.offsets.empty() || s.offsets[0] != 0) return Status::error(f + ": offsets do not start with 0");
  if (s.offsets.back() != static_cast<int64_t>(s.tokens.size()))
    return Status::error(f + ": offsets end at " + std::to_string(s.offsets.back()) + ", but there are " +
                         std::to_string(s.tokens.size()) + " tokens");
  if (!s.labels.empty() && s.labels.size() != s.tokens.size())
    return Status::error(f + ": " + std::to_string(s.labels.size()) + " labels for " + std::to_string(s.tokens.size()) +
                         " tokens");
  if (!s.lines.empty() && static_cast<int64_t>(s.lines.size()) != s.size())
    return Status::error(f + ": " + std::to_string(s.lines.size()) + " line numbers for " + std::to_string(s.size()) +
                         " rows");
  for (int64_t i = 0; i < s.size(); ++i) {
    if (s.offsets[i + 1] < s.offsets[i])
      return Status::error(f + ": " + s.row_name(i) + " has a negative length (offsets decrease)");
    for (int64_t k = s.offsets[i]; k < s.offsets[i + 1]; ++k) {
      if (s.tokens[k] < 0)
        return Status::error(f + ": " + s.row_name(i) + ": token " + std::to_string(k - s.offsets[i]) +
                             " is negative (" + std::to_string(s.tokens[k]) + ")");
      if (!s.labels.empty() && s.labels[k] < 0 && s.labels[k] != kIgnoreIndex)
        return Status::error(f + ": " + s.row_name(i) + ": label " + std::to_string(k - s.offsets[i]) +
                             " is negative (" + std::to_string(s.labels[k]) + ") and not -100, the ignore index");
    }
  }
  return Status::ok();
}

// ----------------------------------------------------------------------------- indexed

namespace {

constexpr char kIndexMagic[9] = {'M', 'M', 'I', 'D', 'I', 'D', 'X', '\0', '\0'};
constexpr size_t kIndexHeaderBytes = 9 + 8 + 1 + 8 + 8;  // magic, version, dtype, counts

struct IndexDType {
  const char* name;
  int item_size;  // 0: not a token dtype
  bool is_float;
};

// Megatron's DType enum: code -> numpy name and size; nullptr name for unknown codes.
IndexDType index_dtype(uint8_t code) {
  switch (code) {
    case 1:
      return {"uint8", 1, false};
    case 2:
      return {"int8", 1, false};
    case 3:
      return {"int16", 2, false};
    case 4:
      return {"int32", 4, false};
    case 5:
      return {"int64", 8, false};
    case 6:
      return {"float64", 8, true};
    case 7:
      return {"float32", 4, true};
    case 8:
      return {"uint16", 2, false};
    default:
      return {nullptr, 0, false};
  }
}

// The token at p in dtype `code` (non-float), widened to int64 (uint64 is not a Megatron
// dtype, so every value fits).
int64_t load_token(uint8_t code, const char* p) {
  switch (code) {
    case 1:
      return load_le<uint8_t>(p);
    case 2:
      return load_le<int8_t>(p);
    case 3:
      return load_le<int16_t>(p);
    case 4:
      return load_le<int32_t>(p);
    case 5:
      return load_le<int64_t>(p);
    default:
      return load_le<uint16_t>(p);
  }
}

std::string index_prefix(const std::string& path) {
  if (ends_with(path, ".idx") || ends_with(path, ".bin")) return path.substr(0, path.size() - 4);
  return path;
}

}  // namespace

Expected<SequenceSet> parse_indexed_dataset(std::string_view idx, std::string_view bin, const std::string& prefix) {
  const std::string idx_name = prefix + ".idx";
  const std::string bin_name = prefix + ".bin";
  auto bad = [&](const std::string& why) { return Status::error(idx_name + ": " + why); };
  if (idx.substr(0, sizeof(kIndexMagic)) != std::string_view(kIndexMagic, std::min(idx.size(), sizeof(kIndexMagic))))
    return bad("not a Megatron indexed dataset index (no MMIDIDX magic)");
  if (idx.size() < kIndexHeaderBytes)
    return bad("truncated header (" + std::to_string(idx.size()) + " bytes, the MMIDIDX header has " +
               std::to_string(kIndexHeaderBytes) + ")");
  const char* p = idx.data() + sizeof(kIndexMagic);
  const uint64_t version = load_le<uint64_t>(p);
  if (version != 1) return bad("index version " + std::to_string(version) + ", only version 1 is supported");
  const uint8_t code = load_le<uint8_t>(p + 8);
  const IndexDType dt = index_dtype(code);
  if (!dt.name)
    return bad("unknown dtype code " + std::to_string(code) +
               " (Megatron's: 1 uint8, 2 int8, 3 int16, 4 int32, 5 int64, 6 float64, 7 float32, 8 uint16)");
  if (dt.is_float)
    return bad("dtype " + std::string(dt.name) + " (code " + std::to_string(code) + ") holds no token ids");
  const uint64_t count = load_le<uint64_t>(p + 9);
  const uint64_t doc_count = load_le<uint64_t>(p + 17);

  // Sizes before anything is allocated: lengths (4) and pointers (8) per sequence, then
  // 8 per document index, then nothing or one mode byte per sequence (multimodal).
  const uint64_t rest = idx.size() - kIndexHeaderBytes;
  if (count > rest / 12)
    return bad("sequence count " + std::to_string(count) + " needs " +
               (count > UINT64_MAX / 12 ? "more" : std::to_string(count * 12)) +
               " bytes of lengths and pointers, the file has " + std::to_string(rest) + " after its header");
  const uint64_t rest_docs = rest - count * 12;
  if (doc_count > rest_docs / 8)
    return bad("document count " + std::to_string(doc_count) + " needs " +
               (doc_count > UINT64_MAX / 8 ? "more" : std::to_string(doc_count * 8)) +
               " bytes of document indices, the file has " + std::to_string(rest_docs) + " after the sequences");
  const uint64_t trailing = rest_docs - doc_count * 8;
  if (trailing != 0 && trailing != count)
    return bad(std::to_string(trailing) + " bytes after the document indices (expected none, or " +
               std::to_string(count) + " sequence modes of a multimodal index)");
  if (count == 0) return bad("no sequences");

  const char* lengths = idx.data() + kIndexHeaderBytes;
  const char* pointers = lengths + 4 * count;
  const char* documents = pointers + 8 * count;
  const uint64_t item = static_cast<uint64_t>(dt.item_size);
  const uint64_t bin_size = bin.size();
  uint64_t total_bytes = 0;
  for (uint64_t i = 0; i < count; ++i) {
    const int32_t len = load_le<int32_t>(lengths + 4 * i);
    const int64_t ptr = load_le<int64_t>(pointers + 8 * i);
    const std::string seq = "sequence " + std::to_string(i);
    if (len < 0) return bad(seq + " has a negative length (" + std::to_string(len) + ")");
    if (ptr < 0) return bad(seq + " starts at a negative byte offset (" + std::to_string(ptr) + ")");
    const uint64_t nbytes = static_cast<uint64_t>(len) * item;  // < 2^34
    const uint64_t end = static_cast<uint64_t>(ptr) + nbytes;   // < 2^63 + 2^34: no wrap
    if (end > bin_size)
      return bad(seq + " ends at byte " + std::to_string(end) + " beyond the .bin's " + std::to_string(bin_size) +
                 " bytes");
    total_bytes += nbytes;  // each <= bin_size, count < 2^60: no wrap
    if (total_bytes > bin_size)
      return bad("sequences 0.." + std::to_string(i) + " hold " + std::to_string(total_bytes) +
                 " bytes together, more than the .bin's " + std::to_string(bin_size) + " (overlapping sequences)");
  }
  int64_t prev_doc = 0;
  for (uint64_t k = 0; k < doc_count; ++k) {
    const int64_t d = load_le<int64_t>(documents + 8 * k);
    if (d < 0 || static_cast<uint64_t>(d) > count)
      return bad("document index " + std::to_string(k) + " is " + std::to_string(d) + ", outside [0, " +
                 std::to_string(count) + "]");
    if (d < prev_doc)
      return bad("document indices decrease at entry " + std::to_string(k) + " (" + std::to_string(prev_doc) +
                 " then " + std::to_string(d) + ")");
    prev_doc = d;
  }

  SequenceSet s;
  s.file = idx_name;
  s.offsets.reserve(count + 1);
  s.tokens.reserve(total_bytes / item);
  for (uint64_t i = 0; i < count; ++i) {
    const int32_t len = load_le<int32_t>(lengths + 4 * i);
    const char* src = bin.data() + load_le<int64_t>(pointers + 8 * i);
    for (int32_t j = 0; j < len; ++j) {
      const int64_t v = load_token(code, src + j * item);
      if (v < 0)
        return Status::error(bin_name + ": sequence " + std::to_string(i) + ": token " + std::to_string(j) +
                             " is negative (" + std::to_string(v) + ")");
      if (v > kInt32Max)
        return Status::error(bin_name + ": sequence " + std::to_string(i) + ": token " + std::to_string(j) + " is " +
                             std::to_string(v) + ", above int32's range");
      s.tokens.push_back(static_cast<int32_t>(v));
    }
    s.offsets.push_back(static_cast<int64_t>(s.tokens.size()));
  }
  return s;
}

Expected<SequenceSet> read_indexed_dataset(const std::string& path) {
  const std::string prefix = index_prefix(path);
  auto idx = io::read_file(prefix + ".idx");
  if (!idx) return idx.status();
  auto bin = io::read_file(prefix + ".bin");
  if (!bin) return bin.status();
  return parse_indexed_dataset(*idx, *bin, prefix);
}

Expected<std::pair<std::string, std::string>> encode_indexed_dataset(const SequenceSet& s) {
  KILN_RETURN_IF_ERROR(check_sequence_set(s));
  const std::string& f = s.file.empty() ? std::string("sequence set") : s.file;
  if (!s.labels.empty())
    return Status::error(f + ": the indexed dataset format holds no labels (write JSONL to keep them)");
  int64_t max_id = 0;
  for (int32_t t : s.tokens) max_id = std::max<int64_t>(max_id, t);
  const bool u16 = max_id < 65500;
  const int item = u16 ? 2 : 4;
  const uint64_t n = static_cast<uint64_t>(s.size());
  for (int64_t i = 0; i < s.size(); ++i)
    if (s.length(i) > kInt32Max)
      return Status::error(f + ": " + s.row_name(i) + " has " + std::to_string(s.length(i)) +
                           " tokens, more than the format's int32 length");

  std::string bin;
  bin.reserve(s.tokens.size() * item);
  for (int32_t t : s.tokens) {
    if (u16)
      put_le<uint16_t>(bin, static_cast<uint16_t>(t));
    else
      put_le<int32_t>(bin, t);
  }
  std::string idx(kIndexMagic, sizeof(kIndexMagic));
  put_le<uint64_t>(idx, 1);
  put_le<uint8_t>(idx, u16 ? 8 : 4);
  put_le<uint64_t>(idx, n);
  put_le<uint64_t>(idx, n + 1);
  for (int64_t i = 0; i < s.size(); ++i) put_le<int32_t>(idx, static_cast<int32_t>(s.length(i)));
  for (int64_t i = 0; i < s.size(); ++i) put_le<int64_t>(idx, s.offsets[i] * item);
  for (uint64_t d = 0; d <= n; ++d) put_le<int64_t>(idx, static_cast<int64_t>(d));
  return std::make_pair(std::move(idx), std::move(bin));
}

Status write_indexed_dataset(const SequenceSet& s, const std::string& prefix) {
  auto files = encode_indexed_dataset(s);
  if (!files) return files.status();
  KILN_RETURN_IF_ERROR(io::save_bytes(prefix + ".bin", files->second));
  return io::save_bytes(prefix + ".idx", files->first);
}

// ----------------------------------------------------------------------------- JSONL

namespace {

// Reads `key` of `obj` (a list of integers) into out; `is_label` allows -100. Returns ""
// or the error (without the "ORIGIN: line N: " head).
std::string read_int_list(const nlohmann::json& obj, const char* key, bool is_label, std::vector<int32_t>& out) {
  const nlohmann::json& v = obj.at(key);
  const std::string name = std::string("'") + key + "'";
  if (!v.is_array()) return name + " is not a list of integers (" + io::json_excerpt(v) + ")";
  for (size_t k = 0; k < v.size(); ++k) {
    const nlohmann::json& e = v[k];
    const std::string at = name + "[" + std::to_string(k) + "]";
    if (e.is_number_unsigned()) {
      const uint64_t u = e.get<uint64_t>();
      if (u > static_cast<uint64_t>(kInt32Max)) return at + " is " + std::to_string(u) + ", above int32's range";
      out.push_back(static_cast<int32_t>(u));
    } else if (e.is_number_integer()) {
      const int64_t x = e.get<int64_t>();
      if (x < 0 && !(is_label && x == kIgnoreIndex))
        return at + " is negative (" + std::to_string(x) + ")" + (is_label ? " and not -100, the ignore index" : "");
      if (x > kInt32Max) return at + " is " + std::to_string(x) + ", above int32's range";
      out.push_back(static_cast<int32_t>(x));
    } else {
      return name + " is not a list of integers (" + at + " is " + io::json_excerpt(e) + ")";
    }
  }
  return "";
}

}  // namespace

Expected<SequenceSet> parse_jsonl_dataset(std::string_view text, const std::string& origin) {
  SequenceSet s;
  s.file = origin;
  int64_t line_no = 0;
  int64_t first_line = 0;  // the first row's line, and whether it had labels
  bool has_labels = false;
  size_t pos = 0;
  std::vector<int32_t> labels;
  while (pos < text.size()) {
    size_t eol = text.find('\n', pos);
    if (eol == std::string_view::npos) eol = text.size();
    std::string_view line = text.substr(pos, eol - pos);
    pos = eol + 1;
    ++line_no;
    if (!line.empty() && line.back() == '\r') line.remove_suffix(1);
    if (line.find_first_not_of(" \t\r") == std::string_view::npos) continue;
    const std::string at = origin + ": line " + std::to_string(line_no) + ": ";
    nlohmann::json j;
    try {
      j = io::parse_json_untrusted(line);
    } catch (const std::exception& e) {
      std::string w = e.what();
      return Status::error(at + "not valid JSON (" + w.substr(0, w.find('\n')) + ")");
    }
    if (!j.is_object()) return Status::error(at + "not a JSON object (" + io::json_excerpt(j) + ")");
    if (!j.contains("input_ids")) return Status::error(at + "no 'input_ids'");
    const size_t before = s.tokens.size();
    if (std::string e = read_int_list(j, "input_ids", false, s.tokens); !e.empty()) return Status::error(at + e);
    const bool row_labels = j.contains("labels") && !j.at("labels").is_null();
    if (first_line == 0) {
      first_line = line_no;
      has_labels = row_labels;
    } else if (row_labels != has_labels) {
      return Status::error(at + (row_labels ? "has 'labels', but line " + std::to_string(first_line) + " has none"
                                            : "no 'labels', but line " + std::to_string(first_line) + " has them"));
    }
    if (row_labels) {
      if (std::string e = read_int_list(j, "labels", true, labels); !e.empty()) return Status::error(at + e);
      const size_t n_ids = s.tokens.size() - before;
      const size_t n_labels = labels.size() - before;
      if (n_labels != n_ids)
        return Status::error(at + "'labels' has " + std::to_string(n_labels) + " entries, 'input_ids' " +
                             std::to_string(n_ids));
    }
    s.offsets.push_back(static_cast<int64_t>(s.tokens.size()));
    s.lines.push_back(line_no);
  }
  if (s.size() == 0) return Status::error(origin + ": no sequences");
  s.labels = std::move(labels);
  return s;
}

Expected<SequenceSet> read_jsonl_dataset(const std::string& path) {
  auto text = io::read_file(path);
  if (!text) return text.status();
  return parse_jsonl_dataset(*text, path);
}

Expected<std::string> encode_jsonl_dataset(const SequenceSet& s) {
  KILN_RETURN_IF_ERROR(check_sequence_set(s));
  std::string out;
  auto list = [&](std::span<const int32_t> v) {
    out += '[';
    for (size_t k = 0; k < v.size(); ++k) {
      if (k) out += ',';
      out += std::to_string(v[k]);
    }
    out += ']';
  };
  for (int64_t i = 0; i < s.size(); ++i) {
    out += "{\"input_ids\":";
    list(s.row(i));
    if (!s.labels.empty()) {
      out += ",\"labels\":";
      list(s.row_labels(i));
    }
    out += "}\n";
  }
  return out;
}

Status write_jsonl_dataset(const SequenceSet& s, const std::string& path) {
  auto text = encode_jsonl_dataset(s);
  if (!text) return text.status();
  return io::save_bytes(path, *text);
}

// ----------------------------------------------------------------------------- dispatch

bool is_sequence_dataset(const std::string& spec) {
  if (ends_with(spec, ".jsonl") || ends_with(spec, ".idx")) return true;
  if (!ends_with(spec, ".bin")) return false;
  std::error_code ec;
  return std::filesystem::is_regular_file(index_prefix(spec) + ".idx", ec);
}

Expected<SequenceSet> read_sequence_dataset(const std::string& path) {
  if (ends_with(path, ".jsonl")) return read_jsonl_dataset(path);
  if (ends_with(path, ".idx") || ends_with(path, ".bin")) return read_indexed_dataset(path);
  std::error_code ec;
  if (std::filesystem::is_regular_file(path + ".idx", ec)) return read_indexed_dataset(path);
  return Status::error(path +
                       ": not a variable-length dataset (expected a .jsonl file, or a Megatron indexed dataset: "
                       "PREFIX.idx and PREFIX.bin, named by PREFIX, PREFIX.idx or PREFIX.bin)");
}

}  // namespace kiln::runtime
