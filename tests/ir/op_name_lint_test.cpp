// Guards DESIGN.md invariant 1 ("one table per op ... nothing keeps a private list of op
// names"): outside the op table (ir/ops/, ir/op_table.*), the eager kernels
// (runtime/kernels/) and the frontend's table of ONNX op types (frontend/onnx_ops.*),
// no source compares an op name with a string literal. Code asks the table instead
// (ir::has_trait, OpDef hooks; frontend::onnx_op_info for raw ONNX op types).
//
// Flagged forms, on code with // comments removed:
//   op == "X", n->op != "X", node.op_type() == "X"     (either order: "X" == n.op)
//   op.compare("X"), n.op.rfind("X", 0), op.starts_with("X")
//   a brace list naming two or more ops of the table ({"Gather", "GatherND"}), the seed of a
//   private std::set / std::map / initializer list of op names
#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>
#include <regex>
#include <set>
#include <sstream>
#include <string>
#include <vector>

#include "ir/op_table.h"

namespace fs = std::filesystem;

namespace {

/// `line` without a trailing // comment (a "//" inside a string literal is kept).
std::string strip_comment(const std::string& line) {
  bool in_str = false;
  for (size_t i = 0; i + 1 < line.size(); ++i) {
    if (line[i] == '\\' && in_str) {
      ++i;
      continue;
    }
    if (line[i] == '"') in_str = !in_str;
    if (!in_str && line[i] == '/' && line[i + 1] == '/') return line.substr(0, i);
  }
  return line;
}

/// Why `line` compares an op name with a string literal, or "" when it does not.
std::string violation(const std::string& raw) {
  static const std::string id = R"((?:\bop_type\(\)|\bop\b))";
  static const std::regex cmp_right(id + R"(\s*(?:==|!=)\s*")");
  static const std::regex cmp_left(R"("[A-Za-z_][A-Za-z0-9_]*"\s*(?:==|!=)\s*[A-Za-z0-9_>.\-\s]*)" + id);
  static const std::regex method(id + R"(\s*\.\s*(?:compare|rfind|find|starts_with|ends_with|substr)\s*\()");
  static const std::regex listed(R"re([{,]\s*"([A-Za-z][A-Za-z0-9_]*)"\s*(?=[,}]))re");
  const std::string line = strip_comment(raw);
  if (std::regex_search(line, cmp_right) || std::regex_search(line, cmp_left))
    return "op name compared with a string literal";
  if (std::regex_search(line, method)) return "op name inspected with a string method";
  const auto& ops = kiln::ir::OpTable::get().all();
  std::set<std::string> named;
  for (auto it = std::sregex_iterator(line.begin(), line.end(), listed); it != std::sregex_iterator(); ++it)
    if (ops.count((*it)[1].str())) named.insert((*it)[1].str());
  if (named.size() >= 2) return "a private list of op names";
  return "";
}

/// Whether `rel` (a path relative to the source root, '/'-separated) is scanned.
bool scanned(const std::string& rel) {
  auto under = [&](const std::string& d) { return rel.rfind(d, 0) == 0; };
  if (!(under("ir/") || under("frontend/") || under("passes/") || under("codegen/") || under("runtime/") ||
        under("tools/")))
    return false;
  if (under("ir/ops/") || under("ir/op_table.") || under("runtime/kernels/") || under("frontend/onnx_ops."))
    return false;
  const std::string ext = fs::path(rel).extension().string();
  return ext == ".cpp" || ext == ".h";
}

}  // namespace

TEST(OpNameLint, DetectsEachForm) {
  EXPECT_NE(violation(R"(  if (n->op == "Dropout") {)"), "");
  EXPECT_NE(violation(R"(  if (n.op != "Reshape" || x) return;)"), "");
  EXPECT_NE(violation(R"(  if ("Cast" == n->op) return;)"), "");
  EXPECT_NE(violation(R"(  if (node.op_type() == "Constant") {)"), "");
  EXPECT_NE(violation(R"(  const bool s = n.op.rfind("Scatter", 0) == 0;)"), "");
  EXPECT_NE(violation(R"(  static const std::set<std::string> k = {"Gather", "GatherND"};)"), "");
  EXPECT_NE(violation(R"(  return op == "Reshape" || op == "Flatten";)"), "");
  // Not comparisons of op names.
  EXPECT_EQ(violation(R"(  Value* y = b.op("Mul", {b.op("Sub", {x, m}), s});)"), "");
  EXPECT_EQ(violation(R"(  if (kind == "pointwise") return;)"), "");
  EXPECT_EQ(violation(R"(  // an old form: n->op == "Dropout")"), "");
  EXPECT_EQ(violation(R"(  a.set("axis", int64_t(1));)"), "");
}

TEST(OpNameLint, NoSourceComparesOpNames) {
  const fs::path root = KILN_SOURCE_DIR;
  std::vector<std::string> found;
  int files = 0;
  for (const char* top : {"ir", "frontend", "passes", "codegen", "runtime", "tools"}) {
    ASSERT_TRUE(fs::is_directory(root / top)) << (root / top).string();
    for (const auto& e : fs::recursive_directory_iterator(root / top)) {
      if (!e.is_regular_file()) continue;
      const std::string rel = fs::relative(e.path(), root).generic_string();
      if (!scanned(rel)) continue;
      ++files;
      std::ifstream in(e.path());
      std::string line;
      for (int no = 1; std::getline(in, line); ++no)
        if (std::string why = violation(line); !why.empty())
          found.push_back(rel + ":" + std::to_string(no) + ": " + why + ": " + line);
    }
  }
  EXPECT_GT(files, 50) << "the scan found too few sources under " << root.string();
  std::ostringstream os;
  for (const auto& f : found) os << "  " << f << "\n";
  EXPECT_TRUE(found.empty()) << found.size()
                             << " comparison(s) of op names with string literals; declare a trait or hook "
                                "in the op table (ir/op_table.h, ir/ops/) and ask it instead:\n"
                             << os.str();
}
