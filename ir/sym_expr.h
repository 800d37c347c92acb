// Integer expressions over named shape symbols (issue 32): the extent of a symbolic dim
// (`seq`, `batch*seq`, `seq+1`) and the contents of small integer tensors that hold
// shapes (what `Shape(x)` of a symbolic x evaluates to). An expression is a polynomial
// with int64 coefficients over symbols, kept in one canonical form so that two equal
// polynomials compare equal (`batch*seq` is `seq*batch`): products and sums are exact,
// division is exact or refused. This is the shape algebra of torch.fx's SymInt / sympy
// and TVM's PrimExpr, restricted to what the shape subgraphs of exported models compute
// (products, sums, exact quotients of the form (batch*seq*64)/(seq*64)); floor division,
// min and max of symbols are not expressions (inference leaves such dims unknown).
#pragma once
#include <cstdint>
#include <functional>
#include <map>
#include <optional>
#include <ostream>
#include <set>
#include <string>
#include <vector>

namespace kiln::ir {

/// A polynomial over symbol names with int64 coefficients, in canonical form: terms
/// sorted by their monomials (the constant term, an empty monomial, first), no zero
/// coefficient, monomials sorted with repeats for powers (seq*seq). The empty
/// polynomial is 0. Arithmetic saturates nothing: coefficients that overflow int64 make
/// the result invalid (`valid()` false), which callers treat as unknown.
class SymExpr {
 public:
  /// coeff * product of `symbols` (sorted, repeated for powers).
  struct Term {
    int64_t coeff = 0;
    std::vector<std::string> symbols;
    bool operator==(const Term& o) const { return coeff == o.coeff && symbols == o.symbols; }
  };

  SymExpr() = default;
  /// The constant `c` (implicit, so that a static extent or stride reads as itself:
  /// kernel IR's `domain = {4, seq}`).
  SymExpr(int64_t c) : SymExpr(constant(c)) {}  // NOLINT(implicit)
  /// The constant `c`.
  static SymExpr constant(int64_t c);
  /// The symbol `name` (non-empty).
  static SymExpr symbol(const std::string& name);

  /// No symbols (possibly 0).
  bool is_constant() const { return valid_ && (terms_.empty() || (terms_.size() == 1 && terms_[0].symbols.empty())); }
  /// The value of a constant expression (0 for the empty polynomial); call only when is_constant().
  int64_t constant_value() const { return terms_.empty() ? 0 : terms_[0].coeff; }
  /// Exactly one symbol with coefficient 1 and nothing else: its name, else "".
  std::string as_symbol() const;
  /// False after a coefficient overflowed.
  bool valid() const { return valid_; }
  const std::vector<Term>& terms() const { return terms_; }
  /// Every symbol the expression names.
  std::set<std::string> symbols() const;

  SymExpr operator+(const SymExpr& o) const;
  SymExpr operator-(const SymExpr& o) const;
  SymExpr operator*(const SymExpr& o) const;
  /// `*this / d` when the quotient is a polynomial with integer coefficients that this
  /// class can find: d a non-zero constant dividing every coefficient, or d a single
  /// term whose monomial divides every term's and whose coefficient divides theirs.
  /// nullopt otherwise (the caller leaves the result unknown).
  std::optional<SymExpr> exact_div(const SymExpr& d) const;
  bool operator==(const SymExpr& o) const { return valid_ == o.valid_ && terms_ == o.terms_; }
  bool operator!=(const SymExpr& o) const { return !(*this == o); }

  /// Value with every symbol bound by `lookup` (nullopt: unbound symbol, or overflow).
  std::optional<int64_t> evaluate(const std::function<std::optional<int64_t>(const std::string&)>& lookup) const;
  /// Same, from a map of bindings.
  std::optional<int64_t> evaluate(const std::map<std::string, int64_t>& bindings) const;
  /// The expression with the symbols of `bindings` replaced by their values (the others
  /// stay): `batch*seq` with batch=2 is `2*seq`. Invalid on overflow.
  SymExpr substitute(const std::map<std::string, int64_t>& bindings) const;

  /// Text without spaces: `batch*seq`, `2*seq+1`, `seq*seq-seq`, `-1`, `0`; symbols in
  /// sorted order, terms by descending degree, the constant term last. parse() reads it back.
  std::string to_string() const;
  /// Parses sums, differences and products of integers and identifiers
  /// ([A-Za-z_][A-Za-z0-9_.]*), with parentheses. nullopt when `text` is not such an
  /// expression (the caller may then read it as one symbol of that name).
  static std::optional<SymExpr> parse(const std::string& text);

 private:
  void canonicalize();
  std::vector<Term> terms_;
  bool valid_ = true;
};

/// Writes to_string() (messages, test output).
inline std::ostream& operator<<(std::ostream& os, const SymExpr& e) { return os << e.to_string(); }

}  // namespace kiln::ir
