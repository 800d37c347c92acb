// Golden IR tests of the passes (docs/architecture.md, convention 7: TVM's Before/Expected).
//
// Every file tests/data/golden/passes/<case>.txt is one test case (adding a case is adding a
// file; the case's name is the file's stem):
//
//   # what the case checks (comment lines, kept as they are)
//   pass: NAME                      the registered pass to run (passes/registry.cpp)
//   option: KEY=VALUE               a PassContext option (any number of these lines)
//   == Before ==
//   graph main(...) { ... }         IR text (ir/parser.h) of the graph the pass receives
//   == Expected ==
//   graph main(...) { ... }         the graph printed (ir/printer.h) after the pass
//
// The Before text is parsed with ir::parse_graph, the pass runs through the pass manager
// (passes::run_pipeline, --verify-each on, the eager interpreter as constant folding's
// evaluator, as the driver gives it) and the printed graph must equal the Expected text
// exactly. The Expected text must itself parse and print back unchanged.
//
// Regenerating: KILN_UPDATE_GOLDEN=1 build/bin/test_passes --gtest_filter='GoldenPass*'
// rewrites the Expected section of every case (or of the cases the filter selects) with
// what the passes print now; review the diff (git diff tests/data/golden) before committing.
// A new file needs only its header and Before section: the update run writes its Expected.
//
// Also: every registered pass has at least one case here (GoldenPassCoverage).
#include <gtest/gtest.h>

#include <algorithm>
#include <cctype>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <map>
#include <set>
#include <sstream>
#include <string>
#include <vector>

#include "ir/parser.h"
#include "ir/printer.h"
#include "passes/pass.h"
#include "runtime/interpreter.h"

using namespace kiln;

namespace {

namespace fs = std::filesystem;

const std::string kGoldenDir = std::string(KILN_SOURCE_DIR) + "/tests/data/golden/passes";
const char* const kBefore = "== Before ==";
const char* const kExpected = "== Expected ==";

bool update_goldens() {
  const char* u = std::getenv("KILN_UPDATE_GOLDEN");
  return u && std::string(u) == "1";
}

/// One golden case, as read from its file.
struct GoldenCase {
  std::string path;
  std::string header;  ///< everything before the Before marker (comments, pass, options)
  std::string pass;
  std::map<std::string, std::string> options;
  std::string before;
  std::string expected;
  bool has_expected = false;
};

std::string read_text(const std::string& path) {
  std::ifstream f(path);
  std::stringstream ss;
  ss << f.rdbuf();
  return ss.str();
}

std::string trim(std::string s) {
  while (!s.empty() && std::isspace(static_cast<unsigned char>(s.back()))) s.pop_back();
  size_t i = 0;
  while (i < s.size() && std::isspace(static_cast<unsigned char>(s[i]))) ++i;
  return s.substr(i);
}

/// Reads a case file; an error names the file and line.
Expected<GoldenCase> read_case(const std::string& path) {
  GoldenCase c;
  c.path = path;
  std::istringstream in(read_text(path));
  std::string line;
  enum { header, before, expected } at = header;
  int lineno = 0;
  while (std::getline(in, line)) {
    ++lineno;
    const std::string where = path + ":" + std::to_string(lineno) + ": ";
    if (trim(line) == kBefore) {
      if (at != header) return Status::error(where + "a second '" + kBefore + "'");
      at = before;
      continue;
    }
    if (trim(line) == kExpected) {
      if (at != before) return Status::error(where + "'" + kExpected + "' before '" + kBefore + "'");
      at = expected;
      c.has_expected = true;
      continue;
    }
    if (at == before) {
      c.before += line + "\n";
    } else if (at == expected) {
      c.expected += line + "\n";
    } else {
      c.header += line + "\n";
      const std::string t = trim(line);
      if (t.empty() || t[0] == '#') continue;
      if (t.rfind("pass:", 0) == 0) {
        c.pass = trim(t.substr(5));
      } else if (t.rfind("option:", 0) == 0) {
        const std::string kv = trim(t.substr(7));
        const size_t eq = kv.find('=');
        if (eq == std::string::npos) return Status::error(where + "expected 'option: KEY=VALUE', got '" + t + "'");
        c.options[trim(kv.substr(0, eq))] = trim(kv.substr(eq + 1));
      } else {
        return Status::error(where + "expected a '#' comment, 'pass: NAME', 'option: KEY=VALUE' or '" + kBefore +
                             "', got '" + t + "'");
      }
    }
  }
  if (c.pass.empty()) return Status::error(path + ": no 'pass: NAME' line");
  if (at == header) return Status::error(path + ": no '" + kBefore + "' section");
  // Trailing blank lines of a section are layout, not IR.
  c.before = trim(c.before) + "\n";
  c.expected = c.has_expected ? trim(c.expected) + "\n" : "";
  return c;
}

/// Every case file, sorted (stable test order and names).
std::vector<std::string> case_files() {
  std::vector<std::string> files;
  if (fs::is_directory(kGoldenDir))
    for (const auto& e : fs::directory_iterator(kGoldenDir))
      if (e.is_regular_file() && e.path().extension() == ".txt") files.push_back(e.path().string());
  std::sort(files.begin(), files.end());
  return files;
}

std::string case_name(const std::string& path) {
  std::string n = fs::path(path).stem().string();
  for (char& ch : n)
    if (!std::isalnum(static_cast<unsigned char>(ch))) ch = '_';
  return n;
}

/// Sets the typed pass option a case file's `option: KEY=VALUE` line names (the
/// TrainingArguments-style names the driver maps from). Error: a key not listed here.
Status set_option(passes::PassOptions& o, const std::string& k, const std::string& v) {
  const double d = std::strtod(v.c_str(), nullptr);
  const int64_t i = std::strtoll(v.c_str(), nullptr, 10);
  if (k == "gradient_accumulation_steps")
    o.accumulation.gradient_accumulation_steps = i;
  else if (k == "learning_rate")
    o.optimizer.learning_rate = d;
  else if (k == "weight_decay")
    o.optimizer.weight_decay = d;
  else if (k == "max_grad_norm")
    o.optimizer.max_grad_norm = d;
  else if (k == "lr_scheduler_type")
    o.optimizer.lr_scheduler_type = v;
  else if (k == "optim")
    o.optimizer.optim = v;
  else if (k == "loss")
    o.loss.loss = v;
  else if (k == "mode")
    o.mode = v == "eval" ? passes::Mode::eval : passes::Mode::train;
  else if (k == "remat_policy")
    o.remat.policy = v;
  else if (k == "world_size")
    o.data_parallel.world_size = i;
  else if (k == "bucket_cap_mb")
    o.data_parallel.bucket_cap_mb = d;
  else if (k == "widen_bf16_gemm")
    o.lowering.widen_bf16_gemm = v == "1";
  else
    return Status::error("unknown option '" + k + "' (add it to set_option)");
  return Status::ok();
}

class GoldenPass : public ::testing::TestWithParam<std::string> {};

TEST_P(GoldenPass, MatchesExpected) {
  auto c = read_case(GetParam());
  ASSERT_TRUE(c) << c.message();
  ASSERT_TRUE(passes::make_pass(c->pass)) << c->path << ": no pass named '" << c->pass << "'";

  auto g = ir::parse_graph(c->before);
  ASSERT_TRUE(g) << c->path << " (Before): " << g.message();
  passes::PassContext ctx;
  for (const auto& [k, v] : c->options) {
    Status so = set_option(ctx.options, k, v);
    ASSERT_TRUE(so) << c->path << ": " << so.message();
  }
  ctx.verify_each = true;
  runtime::register_eager_kernels();       // the evaluator's kernels
  ctx.evaluator = runtime::evaluate_node;  // constant folding's evaluator, as the driver gives it
  Status st = passes::run_pipeline(**g, {c->pass}, ctx);
  ASSERT_TRUE(st.is_ok()) << c->path << ": " << st.message();
  const std::string got = ir::graph_to_string(**g);

  if (update_goldens()) {
    std::ofstream(c->path) << c->header << kBefore << "\n" << c->before << kExpected << "\n" << got;
    std::cout << "[ NOTE ] rewrote the Expected section of " << c->path << "\n";
    return;
  }
  ASSERT_TRUE(c->has_expected) << c->path << ": no '" << kExpected
                               << "' section (KILN_UPDATE_GOLDEN=1 writes it; then review it)";
  EXPECT_EQ(got, c->expected) << c->path << ": the graph after pass '" << c->pass
                              << "' changed; review the diff and rerun with KILN_UPDATE_GOLDEN=1 if it is intended";
  // The Expected text is a well-formed graph: it parses and prints back unchanged.
  auto want = ir::parse_graph(c->expected);
  ASSERT_TRUE(want) << c->path << " (Expected): " << want.message();
  EXPECT_EQ(ir::graph_to_string(**want), c->expected) << c->path << ": the Expected text does not print back as itself";
}

INSTANTIATE_TEST_SUITE_P(Cases, GoldenPass, ::testing::ValuesIn(case_files()),
                         [](const ::testing::TestParamInfo<std::string>& info) { return case_name(info.param); });

TEST(GoldenPassCoverage, EveryRegisteredPassHasACase) {
  std::set<std::string> covered;
  for (const std::string& f : case_files())
    if (auto c = read_case(f)) covered.insert(c->pass);
  for (const std::string& name : passes::pass_names())
    EXPECT_TRUE(covered.count(name)) << "pass '" << name << "' has no golden case in " << kGoldenDir;
}

}  // namespace
