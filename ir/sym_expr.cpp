// Polynomial shape expressions (sym_expr.h): canonical form, arithmetic, exact
// division, evaluation, text form and its parser.
#include "ir/sym_expr.h"

#include <algorithm>
#include <cctype>

namespace kiln::ir {

SymExpr SymExpr::constant(int64_t c) {
  SymExpr e;
  if (c != 0) e.terms_.push_back({c, {}});
  return e;
}

SymExpr SymExpr::symbol(const std::string& name) {
  SymExpr e;
  e.terms_.push_back({1, {name}});
  return e;
}

std::string SymExpr::as_symbol() const {
  if (valid_ && terms_.size() == 1 && terms_[0].coeff == 1 && terms_[0].symbols.size() == 1)
    return terms_[0].symbols[0];
  return "";
}

std::set<std::string> SymExpr::symbols() const {
  std::set<std::string> s;
  for (const Term& t : terms_) s.insert(t.symbols.begin(), t.symbols.end());
  return s;
}

void SymExpr::canonicalize() {
  for (Term& t : terms_) std::sort(t.symbols.begin(), t.symbols.end());
  std::sort(terms_.begin(), terms_.end(), [](const Term& a, const Term& b) {
    if (a.symbols.size() != b.symbols.size()) return a.symbols.size() < b.symbols.size();
    return a.symbols < b.symbols;
  });
  std::vector<Term> merged;
  for (Term& t : terms_) {
    if (!merged.empty() && merged.back().symbols == t.symbols) {
      if (__builtin_add_overflow(merged.back().coeff, t.coeff, &merged.back().coeff)) valid_ = false;
    } else {
      merged.push_back(std::move(t));
    }
  }
  merged.erase(std::remove_if(merged.begin(), merged.end(), [](const Term& t) { return t.coeff == 0; }), merged.end());
  terms_ = std::move(merged);
}

SymExpr SymExpr::operator+(const SymExpr& o) const {
  SymExpr r = *this;
  r.valid_ = valid_ && o.valid_;
  r.terms_.insert(r.terms_.end(), o.terms_.begin(), o.terms_.end());
  r.canonicalize();
  return r;
}

SymExpr SymExpr::operator-(const SymExpr& o) const {
  SymExpr neg = o;
  for (Term& t : neg.terms_)
    if (__builtin_mul_overflow(t.coeff, int64_t{-1}, &t.coeff)) neg.valid_ = false;
  return *this + neg;
}

SymExpr SymExpr::operator*(const SymExpr& o) const {
  SymExpr r;
  r.valid_ = valid_ && o.valid_;
  for (const Term& a : terms_)
    for (const Term& b : o.terms_) {
      Term t;
      if (__builtin_mul_overflow(a.coeff, b.coeff, &t.coeff)) r.valid_ = false;
      t.symbols = a.symbols;
      t.symbols.insert(t.symbols.end(), b.symbols.begin(), b.symbols.end());
      r.terms_.push_back(std::move(t));
    }
  r.canonicalize();
  return r;
}

std::optional<SymExpr> SymExpr::exact_div(const SymExpr& d) const {
  if (!valid_ || !d.valid_ || d.terms_.size() != 1) return std::nullopt;
  const Term& dt = d.terms_[0];
  SymExpr q;
  for (const Term& t : terms_) {
    if (t.coeff % dt.coeff != 0) return std::nullopt;
    // Remove dt's symbols (a sorted multiset) from t's.
    std::vector<std::string> rest;
    size_t j = 0;
    for (const std::string& s : t.symbols) {
      if (j < dt.symbols.size() && dt.symbols[j] == s)
        ++j;
      else
        rest.push_back(s);
    }
    if (j != dt.symbols.size()) return std::nullopt;
    q.terms_.push_back({t.coeff / dt.coeff, std::move(rest)});
  }
  q.canonicalize();
  return q;
}

std::optional<int64_t> SymExpr::evaluate(
    const std::function<std::optional<int64_t>(const std::string&)>& lookup) const {
  if (!valid_) return std::nullopt;
  int64_t sum = 0;
  for (const Term& t : terms_) {
    int64_t p = t.coeff;
    for (const std::string& s : t.symbols) {
      std::optional<int64_t> v = lookup(s);
      if (!v || __builtin_mul_overflow(p, *v, &p)) return std::nullopt;
    }
    if (__builtin_add_overflow(sum, p, &sum)) return std::nullopt;
  }
  return sum;
}

std::optional<int64_t> SymExpr::evaluate(const std::map<std::string, int64_t>& bindings) const {
  return evaluate([&](const std::string& s) -> std::optional<int64_t> {
    auto it = bindings.find(s);
    if (it == bindings.end()) return std::nullopt;
    return it->second;
  });
}

SymExpr SymExpr::substitute(const std::map<std::string, int64_t>& bindings) const {
  if (!valid_) return *this;
  SymExpr sum = constant(0);
  for (const Term& t : terms_) {
    SymExpr p = constant(t.coeff);
    for (const std::string& s : t.symbols) {
      auto it = bindings.find(s);
      p = p * (it == bindings.end() ? symbol(s) : constant(it->second));
    }
    sum = sum + p;
  }
  return sum;
}

std::string SymExpr::to_string() const {
  if (!valid_) return "?";
  if (terms_.empty()) return "0";
  std::string s;
  auto put = [&](const Term& t) {
    int64_t c = t.coeff;
    if (c < 0) {
      s += "-";
      c = -c;  // |INT64_MIN| is never a coefficient the arithmetic keeps valid past printing
    } else if (!s.empty()) {
      s += "+";
    }
    std::string mono;
    for (const std::string& n : t.symbols) mono += (mono.empty() ? "" : "*") + n;
    if (mono.empty())
      s += std::to_string(c);
    else if (c == 1)
      s += mono;
    else
      s += std::to_string(c) + "*" + mono;
  };
  // Highest degree first (seq*seq-seq), the canonical order within a degree, the
  // constant term last.
  std::vector<const Term*> order;
  for (const Term& t : terms_) order.push_back(&t);
  std::stable_sort(order.begin(), order.end(),
                   [](const Term* a, const Term* b) { return a->symbols.size() > b->symbols.size(); });
  for (const Term* t : order) put(*t);
  return s;
}

namespace {

/// Recursive-descent reader of sym_expr.h's grammar.
struct ExprReader {
  const std::string& s;
  size_t i = 0;
  bool ok = true;

  void skip() {
    while (i < s.size() && std::isspace(static_cast<unsigned char>(s[i]))) ++i;
  }
  SymExpr factor() {
    skip();
    if (i >= s.size()) {
      ok = false;
      return {};
    }
    const char c = s[i];
    if (c == '(') {
      ++i;
      SymExpr e = sum();
      skip();
      if (i >= s.size() || s[i] != ')') ok = false;
      ++i;
      return e;
    }
    if (c == '-') {
      ++i;
      return SymExpr::constant(0) - factor();
    }
    if (std::isdigit(static_cast<unsigned char>(c))) {
      int64_t v = 0;
      while (i < s.size() && std::isdigit(static_cast<unsigned char>(s[i]))) {
        if (__builtin_mul_overflow(v, int64_t{10}, &v) || __builtin_add_overflow(v, int64_t{s[i] - '0'}, &v))
          ok = false;
        ++i;
      }
      return SymExpr::constant(v);
    }
    if (std::isalpha(static_cast<unsigned char>(c)) || c == '_') {
      const size_t b = i;
      while (i < s.size() && (std::isalnum(static_cast<unsigned char>(s[i])) || s[i] == '_' || s[i] == '.')) ++i;
      return SymExpr::symbol(s.substr(b, i - b));
    }
    ok = false;
    return {};
  }
  SymExpr product() {
    SymExpr e = factor();
    for (skip(); ok && i < s.size() && s[i] == '*'; skip()) {
      ++i;
      e = e * factor();
    }
    return e;
  }
  SymExpr sum() {
    SymExpr e = product();
    for (skip(); ok && i < s.size() && (s[i] == '+' || s[i] == '-'); skip()) {
      const bool minus = s[i++] == '-';
      SymExpr t = product();
      e = minus ? e - t : e + t;
    }
    return e;
  }
};

}  // namespace

std::optional<SymExpr> SymExpr::parse(const std::string& text) {
  ExprReader r{text};
  SymExpr e = r.sum();
  r.skip();
  if (!r.ok || r.i != text.size() || !e.valid()) return std::nullopt;
  return e;
}

}  // namespace kiln::ir
