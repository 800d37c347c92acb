// Parser of the printer's IR text; see parser.h. A line-oriented recursive-descent
// reader: one graph header, then init / node / state / return lines, a node's regions
// being the nested graphs on the lines right after it.
#include "ir/parser.h"

#include <cctype>
#include <cstdlib>
#include <sstream>
#include <unordered_map>
#include <vector>

namespace kiln::ir {

namespace {

std::string trim(const std::string& s) {
  size_t b = s.find_first_not_of(' '), e = s.find_last_not_of(' ');
  return b == std::string::npos ? "" : s.substr(b, e - b + 1);
}

/// Splits `s` at ", " outside brackets, braces, angle brackets and quotes.
std::vector<std::string> split_top(const std::string& s) {
  std::vector<std::string> out;
  int depth = 0;
  bool quoted = false;
  std::string cur;
  for (size_t i = 0; i < s.size(); ++i) {
    char c = s[i];
    if (c == '"') quoted = !quoted;
    if (!quoted) {
      if (c == '[' || c == '{' || c == '(' || c == '<') ++depth;
      if (c == ']' || c == '}' || c == ')' || c == '>') --depth;
      if (depth == 0 && c == ',' && i + 1 < s.size() && s[i + 1] == ' ') {
        out.push_back(cur);
        cur.clear();
        ++i;
        continue;
      }
    }
    cur += c;
  }
  if (!cur.empty() || !out.empty()) out.push_back(cur);
  return out;
}

class Parser {
 public:
  explicit Parser(const std::string& text) {
    std::stringstream ss(text);
    std::string l;
    while (std::getline(ss, l)) lines_.push_back(l);
  }

  Expected<std::unique_ptr<Graph>> top() {
    skip_blank();
    auto g = std::make_unique<Graph>();
    KILN_RETURN_IF_ERROR(graph(*g));
    skip_blank();
    if (pos_ < lines_.size()) return fail("end of text after the graph's closing '}'");
    return g;
  }

 private:
  std::vector<std::string> lines_;
  size_t pos_ = 0;
  /// Values visible by name: the current graph's and its enclosing graphs' (captures).
  std::vector<std::unordered_map<std::string, Value*>> scopes_;

  void skip_blank() {
    while (pos_ < lines_.size() && trim(lines_[pos_]).empty()) ++pos_;
  }
  Status fail(const std::string& expected) const {
    const std::string got = pos_ < lines_.size() ? trim(lines_[pos_]) : std::string("end of text");
    return Status::error("line " + std::to_string(pos_ + 1) + ": expected " + expected + ", got '" +
                         (got.size() > 80 ? got.substr(0, 80) + "..." : got) + "'");
  }
  Value* lookup(const std::string& name) const {
    for (auto it = scopes_.rbegin(); it != scopes_.rend(); ++it) {
      auto f = it->find(name);
      if (f != it->end()) return f->second;
    }
    return nullptr;
  }

  /// "f32[2, batch]" -> dtype and shape; "f32[2] @arena(64, 8, home)" also sets `arena`
  /// (a node output's step-arena placement; refused where `arena` is null).
  Status type(const std::string& t_in, DType& dt, Shape& shape, ArenaPlacement* arena = nullptr) const {
    std::string t = t_in;
    if (const size_t at = t.find(" @arena("); at != std::string::npos) {
      if (!arena || t.back() != ')')
        return fail("a type such as f32[2, 3] (@arena only on node outputs and graph inputs)");
      std::vector<std::string> f = split_top(t.substr(at + 8, t.size() - at - 9));
      if (f.size() < 2 || f.size() > 3 || (f.size() == 3 && f[2] != "home"))
        return fail("@arena(OFFSET, BYTES[, home])");
      arena->offset = std::strtoll(f[0].c_str(), nullptr, 10);
      arena->bytes = std::strtoll(f[1].c_str(), nullptr, 10);
      arena->home = f.size() == 3;
      t = t.substr(0, at);
    }
    const size_t lb = t.find('[');
    if (lb == std::string::npos || t.back() != ']') return fail("a type such as f32[2, 3]");
    auto d = dtype_from_name(t.substr(0, lb));
    if (!d) return fail("a dtype name in '" + t + "'");
    dt = *d;
    shape = Shape();
    const std::string inner = t.substr(lb + 1, t.size() - lb - 2);
    if (inner.empty()) return Status::ok();
    for (const std::string& item : split_top(inner)) {
      shape.dims.push_back(Dim::from_text(item));
    }
    return Status::ok();
  }

  /// "{1, 2.5}" -> values.
  static std::vector<double> number_list(const std::string& s) {
    std::vector<double> v;
    if (s.size() < 2) return v;
    for (const std::string& item : split_top(s.substr(1, s.size() - 2)))
      if (!item.empty()) v.push_back(std::strtod(item.c_str(), nullptr));
    return v;
  }

  static Tensor filled(DType dt, const Shape& shape, const std::vector<double>& v) {
    std::vector<int64_t> dims;
    for (const Dim& d : shape.dims) dims.push_back(d.is_static() ? d.value : 0);
    Tensor t(dt, dims);
    for (int64_t i = 0; i < t.numel() && i < static_cast<int64_t>(v.size()); ++i) t.set_f64(i, v[i]);
    return t;
  }

  Expected<AttrValue> attr_value(const std::string& s) const {
    if (s.empty()) return fail("an attribute value");
    if (s[0] == '"') return AttrValue(s.substr(1, s.size() - 2));
    if (s.rfind("tensor<", 0) == 0) {
      const size_t close = s.find('>');
      if (close == std::string::npos) return fail("tensor<TYPE>");
      DType dt;
      Shape sh;
      KILN_RETURN_IF_ERROR(type(s.substr(7, close - 7), dt, sh));
      return AttrValue(filled(dt, sh, close + 1 < s.size() ? number_list(s.substr(close + 1)) : std::vector<double>{}));
    }
    if (s[0] == '[') {
      std::vector<std::string> items = split_top(s.substr(1, s.size() - 2));
      if (!items.empty() && !items[0].empty() && items[0][0] == '"') {
        std::vector<std::string> v;
        for (auto& i : items) v.push_back(i.size() >= 2 ? i.substr(1, i.size() - 2) : i);
        return AttrValue(v);
      }
      bool floating = false;
      for (auto& i : items) floating |= i.find_first_of(".eninf") != std::string::npos;
      if (floating) {
        std::vector<double> v;
        for (auto& i : items) v.push_back(std::strtod(i.c_str(), nullptr));
        return AttrValue(v);
      }
      std::vector<int64_t> v;
      for (auto& i : items)
        if (!i.empty()) v.push_back(std::strtoll(i.c_str(), nullptr, 10));
      return AttrValue(v);
    }
    if (s.find_first_of(".eninf") != std::string::npos) return AttrValue(std::strtod(s.c_str(), nullptr));
    return AttrValue(static_cast<int64_t>(std::strtoll(s.c_str(), nullptr, 10)));
  }

  Status graph(Graph& g) {
    skip_blank();
    if (pos_ >= lines_.size()) return fail("'graph NAME(...) {'");
    const std::string head = trim(lines_[pos_]);
    if (head.rfind("graph ", 0) != 0 || head.size() < 9 || head.substr(head.size() - 3) != ") {")
      return fail("'graph NAME(...) {'");
    const size_t lp = head.find('(');
    if (lp == std::string::npos) return fail("'graph NAME(...) {'");
    g.name = head.substr(6, lp - 6);
    scopes_.emplace_back();
    for (const std::string& in : split_top(head.substr(lp + 1, head.size() - lp - 4))) {
      const size_t colon = in.rfind(": ");
      if (in.empty() || in[0] != '%' || colon == std::string::npos) return fail("'%NAME: TYPE' graph inputs");
      DType dt;
      Shape sh;
      ArenaPlacement arena;
      KILN_RETURN_IF_ERROR(type(in.substr(colon + 2), dt, sh, &arena));
      const std::string name = in.substr(1, colon - 1);
      Value* v = g.add_input(name, dt, sh);
      v->arena = arena;
      scopes_.back()[name] = v;
    }
    ++pos_;
    Node* last = nullptr;
    for (;;) {
      skip_blank();
      if (pos_ >= lines_.size()) return fail("'}' closing graph " + g.name);
      const std::string l = trim(lines_[pos_]);
      if (l == "}") {
        ++pos_;
        scopes_.pop_back();
        return Status::ok();
      }
      if (l.rfind("graph ", 0) == 0) {  // a region of the node just read
        if (!last) return fail("a node before a region");
        auto r = std::make_unique<Graph>();
        KILN_RETURN_IF_ERROR(graph(*r));
        last->regions.push_back(std::move(r));
        continue;
      }
      if (l.rfind("memory ", 0) == 0) {
        std::istringstream is(l.substr(7));
        std::string a, b;
        is >> a >> b;
        if (a.rfind("arena_bytes=", 0) != 0 || b.rfind("planned_peak_bytes=", 0) != 0)
          return fail("'memory arena_bytes=N planned_peak_bytes=M'");
        g.arena_bytes = std::strtoll(a.c_str() + 12, nullptr, 10);
        g.planned_peak_bytes = std::strtoll(b.c_str() + 19, nullptr, 10);
        ++pos_;
        continue;
      }
      if (l.rfind("init %", 0) == 0) {
        const size_t colon = l.find(": ");
        if (colon == std::string::npos) return fail("'init %NAME: TYPE'");
        std::string rest = l.substr(colon + 2), data;
        const size_t eq = rest.find(" = ");
        if (eq != std::string::npos) data = rest.substr(eq + 3), rest = rest.substr(0, eq);
        DType dt;
        Shape sh;
        KILN_RETURN_IF_ERROR(type(rest, dt, sh));
        const std::string name = l.substr(6, colon - 6);
        scopes_.back()[name] = g.add_initializer(name, filled(dt, sh, number_list(data)));
        ++pos_;
        continue;
      }
      if (l.rfind("state ", 0) == 0) {
        std::istringstream is(l.substr(6));
        std::string kind, in, arrow, out, shard_kw;
        std::vector<int64_t> full;
        is >> kind >> in >> arrow >> out;
        if (is >> shard_kw) {  // ZeRO-1: "shard_of [D0, D1, ...]"
          std::string rest, dim;
          std::getline(is, rest);
          const size_t lb = rest.find('['), rb = rest.rfind(']');
          if (shard_kw != "shard_of" || lb == std::string::npos || rb == std::string::npos || rb < lb)
            return fail("'state KIND %INPUT <- %OUTPUT [shard_of [DIMS]]'");
          std::istringstream dims(rest.substr(lb + 1, rb - lb - 1));
          while (std::getline(dims, dim, ',')) {
            char* end = nullptr;
            const long long d = std::strtoll(dim.c_str(), &end, 10);
            if (end == dim.c_str() || d < 0) return fail("'shard_of [DIMS]': dims are integers >= 0");
            full.push_back(d);
          }
          if (full.empty()) return fail("'shard_of [DIMS]' names no dims");
        }
        if (in.empty() || in[0] != '%' || arrow != "<-" || out.empty() || out[0] != '%')
          return fail("'state KIND %INPUT <- %OUTPUT'");
        StateBinding sb;
        sb.kind = kind;
        sb.full_dims = full;
        sb.input = lookup(in.substr(1));
        sb.output = out == "%?" ? nullptr : lookup(out.substr(1));
        if (!sb.input || (out != "%?" && !sb.output)) return fail("state values defined in the graph");
        g.state.push_back(sb);
        ++pos_;
        continue;
      }
      if (l.rfind("return", 0) == 0) {
        for (const std::string& o : split_top(trim(l.substr(6)))) {
          Value* v = o.size() > 1 && o[0] == '%' ? lookup(o.substr(1)) : nullptr;
          if (!v) return fail("'return %VALUE, ...' naming defined values");
          g.outputs.push_back(v);
        }
        ++pos_;
        continue;
      }
      KILN_ASSIGN_OR_RETURN(last, node(g, l));
      ++pos_;
    }
  }

  /// "%a, %b = Op(%x, _) {k=v} : T1, T2  # name"
  Expected<Node*> node(Graph& g, const std::string& l) {
    const size_t eq = l.find(" = ");
    if (l.empty() || l[0] != '%' || eq == std::string::npos) return fail("a node line '%OUT = Op(...) : TYPE'");
    std::vector<std::string> outs;
    for (const std::string& o : split_top(l.substr(0, eq))) {
      if (o.size() < 2 || o[0] != '%') return fail("'%NAME' outputs");
      outs.push_back(o.substr(1));
    }
    std::string rest = l.substr(eq + 3);
    const size_t lp = rest.find('(');
    if (lp == std::string::npos) return fail("'Op(' after '='");
    const std::string op = rest.substr(0, lp);
    // Matching ')' of the input list.
    size_t rp = lp, depth = 0;
    for (; rp < rest.size(); ++rp) {
      if (rest[rp] == '(') ++depth;
      if (rest[rp] == ')' && --depth == 0) break;
    }
    if (rp >= rest.size()) return fail("')' closing the inputs of " + op);
    std::vector<Value*> ins;
    for (const std::string& i : split_top(rest.substr(lp + 1, rp - lp - 1))) {
      if (i == "_") {
        ins.push_back(nullptr);
        continue;
      }
      Value* v = i.size() > 1 && i[0] == '%' ? lookup(i.substr(1)) : nullptr;
      if (!v) return fail("inputs that name values defined before (" + i + ")");
      ins.push_back(v);
    }
    rest = rest.substr(rp + 1);
    Attributes attrs;
    if (rest.rfind(" {", 0) == 0) {
      size_t close = 1, d = 0;
      bool quoted = false;
      for (; close < rest.size(); ++close) {
        if (rest[close] == '"') quoted = !quoted;
        if (quoted) continue;
        if (rest[close] == '{' || rest[close] == '[' || rest[close] == '<') ++d;
        if ((rest[close] == '}' || rest[close] == ']' || rest[close] == '>') && --d == 0 && rest[close] == '}') break;
      }
      if (close >= rest.size()) return fail("'}' closing the attributes of " + op);
      for (const std::string& kv : split_top(rest.substr(2, close - 2))) {
        const size_t e = kv.find('=');
        if (e == std::string::npos) return fail("attributes 'name=value'");
        KILN_ASSIGN_OR_RETURN(AttrValue v, attr_value(kv.substr(e + 1)));
        attrs.set(kv.substr(0, e), std::move(v));
      }
      rest = rest.substr(close + 1);
    }
    if (rest.rfind(" : ", 0) != 0) return fail("' : TYPE' after " + op + "(...)");
    rest = rest.substr(3);
    std::string name;
    const size_t hash = rest.find("  # ");
    if (hash != std::string::npos) name = rest.substr(hash + 4), rest = rest.substr(0, hash);
    std::vector<std::string> types = split_top(rest);
    if (types.size() != outs.size()) return fail(std::to_string(outs.size()) + " output types");
    Node* n = g.add_node(op, name, ins, outs, attrs);
    for (size_t k = 0; k < outs.size(); ++k) {
      KILN_RETURN_IF_ERROR(type(types[k], n->outputs[k]->dtype, n->outputs[k]->shape, &n->outputs[k]->arena));
      scopes_.back()[outs[k]] = n->outputs[k];
    }
    return n;
  }
};

}  // namespace

Expected<std::unique_ptr<Graph>> parse_graph(const std::string& text) { return Parser(text).top(); }

}  // namespace kiln::ir
