// Errors as values: Status and Expected<T> (DESIGN.md convention 15).
// A Status carries one human-readable line naming the file, node, op or flag at fault.
#pragma once
#include <cassert>
#include <string>
#include <utility>
#include <variant>

namespace kiln {

/// Result of an operation that returns nothing: ok, or one error line.
class Status {
 public:
  Status() = default;
  /// Builds an error status with the given message (must be non-empty).
  static Status error(std::string msg) {
    Status s;
    s.msg_ = std::move(msg);
    s.failed_ = true;
    return s;
  }
  static Status ok() { return Status(); }
  bool is_ok() const { return !failed_; }
  explicit operator bool() const { return !failed_; }
  const std::string& message() const { return msg_; }
  /// Returns a copy with "context: " prepended to the message.
  Status with_context(const std::string& ctx) const {
    if (!failed_) return *this;
    return error(ctx + ": " + msg_);
  }

 private:
  std::string msg_;
  bool failed_ = false;
};

/// Either a value of type T or an error Status.
template <typename T>
class Expected {
 public:
  Expected(T v) : v_(std::move(v)) {}
  Expected(Status s) : v_(std::move(s)) { assert(!std::get<Status>(v_).is_ok()); }
  bool has_value() const { return v_.index() == 0; }
  explicit operator bool() const { return has_value(); }
  T& value() { return std::get<0>(v_); }
  const T& value() const { return std::get<0>(v_); }
  T& operator*() { return value(); }
  const T& operator*() const { return value(); }
  T* operator->() { return &value(); }
  const T* operator->() const { return &value(); }
  const Status& status() const { return std::get<1>(v_); }
  const std::string& message() const { return status().message(); }

 private:
  std::variant<T, Status> v_;
};

}  // namespace kiln

/// Propagates an error Status from an expression returning Status.
#define KILN_RETURN_IF_ERROR(expr) \
  do {                             \
    ::kiln::Status _st = (expr);   \
    if (!_st.is_ok()) return _st;  \
  } while (0)

#define KILN_CONCAT_INNER(a, b) a##b
#define KILN_CONCAT(a, b) KILN_CONCAT_INNER(a, b)
/// `KILN_ASSIGN_OR_RETURN(auto x, f());` : unwraps an Expected or returns its Status.
#define KILN_ASSIGN_OR_RETURN(lhs, expr)                                                       \
  auto KILN_CONCAT(_exp_, __LINE__) = (expr);                                                  \
  if (!KILN_CONCAT(_exp_, __LINE__).has_value()) return KILN_CONCAT(_exp_, __LINE__).status(); \
  lhs = std::move(KILN_CONCAT(_exp_, __LINE__).value())
