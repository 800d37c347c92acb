// Binary serialization of kiln IR graphs, for the program file (runtime/program.h).
//
// A serialized graph is exact: every value (name, dtype, shape with symbolic dims, role),
// node (op, name, operands, attributes bit for bit, nested regions), graph output, state
// binding and initializer origin, and every tensor's bytes; tensors that share storage
// (a parameter's initial value and its initializer) are written once and share storage
// again when read. Values are numbered in definition order (GraphWriter::id_of), so side
// tables keyed by Value* (a step arena) can be written by number and bound to the read
// graph's values (GraphReader::value).
//
// Layout: little-endian fixed-width integers, u64-length-prefixed strings; documented
// field by field in docs/architecture.md ("The program file").
#pragma once
#include <cstdint>
#include <memory>
#include <string>
#include <unordered_map>
#include <vector>

#include "ir/graph.h"
#include "ir/status.h"

namespace kiln::ir {

/// Appends little-endian fixed-width integers, IEEE doubles (bit patterns) and
/// u64-length-prefixed strings to a byte string.
class ByteWriter {
 public:
  void u8(uint8_t v) { s_ += static_cast<char>(v); }
  void u64(uint64_t v);
  void i64(int64_t v) { u64(static_cast<uint64_t>(v)); }
  void f64(double v);
  void str(const std::string& v);
  void bytes(const void* p, size_t n) { s_.append(static_cast<const char*>(p), n); }
  std::string& data() { return s_; }

 private:
  std::string s_;
};

/// Reads what ByteWriter wrote; every read returns false (and reads nothing) when the
/// bytes end first. `count` reads a u64 element count and refuses one larger than the
/// bytes left divided by `min_bytes_each` (a corrupted count never allocates).
class ByteReader {
 public:
  explicit ByteReader(const std::string& s, size_t pos = 0) : s_(s), pos_(pos) {}
  bool u8(uint8_t& v);
  bool u64(uint64_t& v);
  bool i64(int64_t& v);
  bool f64(double& v);
  bool str(std::string& v);
  bool bytes(void* p, size_t n);
  bool count(uint64_t& n, size_t min_bytes_each = 1);
  size_t left() const { return s_.size() - pos_; }
  bool at_end() const { return pos_ == s_.size(); }

 private:
  const std::string& s_;
  size_t pos_ = 0;
};

/// Writes graphs (and the tensors they hold) into one stream. Tensors are pooled: call
/// tensors() after the last graph to get the pool section, which a reader needs first.
class GraphWriter {
 public:
  /// Appends `g` (regions included) to `w`; values get ids from the writer's counter.
  void write(const Graph& g, ByteWriter& w);
  /// Id of a value written so far, or -1 (orphaned or never written).
  int64_t id_of(const Value* v) const;
  /// Index of `t` in the tensor pool (adding it): a tensor sharing storage, dtype and
  /// dims with one already pooled gets that one's index.
  int64_t tensor_index(const std::shared_ptr<Tensor>& t);
  /// The tensor pool: u64 count, then per tensor u8 dtype, u64 rank, i64 dims, raw bytes.
  void write_tensors(ByteWriter& w) const;

 private:
  void define(const Value* v, ByteWriter& w);
  void ref(const Value* v, ByteWriter& w) const;
  std::unordered_map<const Value*, int64_t> ids_;
  std::vector<std::shared_ptr<Tensor>> pool_;
  std::unordered_map<std::string, int64_t> pool_index_;
};

/// Reads what GraphWriter wrote (tensor pool first, then graphs, in the same order).
/// Errors say what is malformed ("truncated", "bad dtype", "value id out of range", ...);
/// never a crash on bad bytes.
class GraphReader {
 public:
  Status read_tensors(ByteReader& r);
  Expected<std::unique_ptr<Graph>> read(ByteReader& r);
  /// The value of id `id` read so far, or nullptr.
  Value* value(int64_t id) const;
  /// Pooled tensor `i`, or nullptr.
  std::shared_ptr<Tensor> tensor(int64_t i) const;

 private:
  Status read_into(Graph& g, ByteReader& r, int depth);
  std::vector<Value*> values_;
  std::vector<std::shared_ptr<Tensor>> pool_;
};

}  // namespace kiln::ir
