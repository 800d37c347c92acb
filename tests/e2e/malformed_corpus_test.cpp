// The malformed-input corpus (tests/data/malformed/, written by tools/make_malformed.py):
// every case of manifest.json runs through the kiln binary in a copy of the folder and
// must print exactly its one recorded line on stderr, exit with its code (1 or 2), and
// leave the folder byte-identical: nothing created (no output folder, lock file,
// metrics.jsonl or cache entry), nothing modified.
#include <sys/stat.h>
#include <sys/wait.h>

#include <fstream>
#include <sstream>

#include "e2e_util.h"

namespace fs = std::filesystem;

namespace {

const std::string kCorpus = std::string(KILN_SOURCE_DIR) + "/tests/data/malformed";
const std::string kBin = std::string(KILN_BINARY_DIR) + "/bin/kiln";

struct Case {
  std::string name;
  std::vector<std::string> args;
  std::vector<nlohmann::json> setup;
  std::string stderr_line;
  int exit_code = 0;
};

// gtest prints a parameter in test listings (and so in ctest's names); the case's name says
// which file it is.
void PrintTo(const Case& c, std::ostream* os) { *os << c.name; }

std::vector<Case> load_cases() {
  std::vector<Case> out;
  std::ifstream f(kCorpus + "/manifest.json");
  if (!f) return out;
  nlohmann::json j = nlohmann::json::parse(f);
  for (const auto& c : j.at("cases")) {
    Case k;
    k.name = c.at("name").get<std::string>();
    k.args = c.at("args").get<std::vector<std::string>>();
    for (const auto& s : c.at("setup")) k.setup.push_back(s);
    k.stderr_line = c.at("stderr").get<std::string>();
    k.exit_code = c.at("exit").get<int>();
    out.push_back(std::move(k));
  }
  return out;
}

std::string read_all(const fs::path& p) {
  std::ifstream f(p, std::ios::binary);
  std::stringstream ss;
  ss << f.rdbuf();
  return ss.str();
}

/// Every entry under `root` (symlinks not followed): its kind, and for files the bytes'
/// FNV-1a hash and size, for symlinks the target.
std::map<std::string, std::string> snapshot(const fs::path& root) {
  std::map<std::string, std::string> m;
  for (auto it = fs::recursive_directory_iterator(root); it != fs::recursive_directory_iterator(); ++it) {
    const fs::path& p = it->path();
    const std::string rel = fs::relative(p, root).string();
    const fs::file_status st = fs::symlink_status(p);
    if (fs::is_symlink(st)) {
      m[rel] = "symlink " + fs::read_symlink(p).string();
    } else if (fs::is_directory(st)) {
      m[rel] = "dir";
    } else if (fs::is_regular_file(st)) {
      const std::string b = read_all(p);
      uint64_t h = 1469598103934665603ull;
      for (unsigned char c : b) h = (h ^ c) * 1099511628211ull;
      m[rel] = "file " + std::to_string(b.size()) + " " + std::to_string(h);
    } else {
      m[rel] = "other";
    }
  }
  return m;
}

void apply_setup(const fs::path& work, const nlohmann::json& s) {
  const std::string kind = s.at(0).get<std::string>();
  const fs::path p = work / s.at(1).get<std::string>();
  if (kind == "symlink") {
    fs::create_symlink(s.at(2).get<std::string>(), p);
  } else if (kind == "fifo") {
    ASSERT_EQ(::mkfifo(p.c_str(), 0644), 0) << p;
  } else if (kind == "deep_json") {
    const int64_t n = s.at(2).get<int64_t>();
    std::string text;
    text.reserve(static_cast<size_t>(n) * 6 + 2);
    for (int64_t i = 0; i < n; ++i) text += "{\"a\":";
    text += "1";
    text.append(static_cast<size_t>(n), '}');
    std::ofstream(p) << text;
  } else {
    FAIL() << "unknown setup step " << kind;
  }
}

std::string quote(const std::string& s) {
  std::string q = "'";
  for (char c : s) q += c == '\'' ? std::string("'\\''") : std::string(1, c);
  return q + "'";
}

class MalformedCorpus : public ::testing::TestWithParam<Case> {};

TEST_P(MalformedCorpus, OneLineExitCodeNoDebris) {
  const Case& c = GetParam();
  const fs::path tmp = kiln::testing::fresh_tmpdir("malformed_" + c.name);
  const fs::path work = tmp / "work";
  fs::copy(kCorpus, work, fs::copy_options::recursive | fs::copy_options::copy_symlinks);
  fs::remove(work / "manifest.json");
  fs::create_directories(work / ".cache");  // KILN_CACHE_DIR: a cache entry would show in the snapshot
  for (const auto& s : c.setup) apply_setup(work, s);
  const auto before = snapshot(work);
  std::string cmd = "cd " + quote(work.string()) + " && KILN_CACHE_DIR=" + quote((work / ".cache").string()) +
                    " HOME=" + quote(work.string()) + " " + quote(kBin);
  for (const std::string& a : c.args) cmd += " " + quote(a);
  const fs::path err = tmp / "stderr.txt";
  cmd += " > " + quote((tmp / "stdout.txt").string()) + " 2> " + quote(err.string());
  const int st = std::system(cmd.c_str());
  ASSERT_TRUE(WIFEXITED(st)) << c.name << ": killed by a signal (status " << st << ")";
  EXPECT_EQ(WEXITSTATUS(st), c.exit_code) << c.name;
  EXPECT_EQ(read_all(err), c.stderr_line + "\n") << c.name;
  const auto after = snapshot(work);
  for (const auto& [path, what] : after) {
    auto b = before.find(path);
    if (b == before.end())
      ADD_FAILURE() << c.name << ": created " << path << " (" << what << ")";
    else if (b->second != what)
      ADD_FAILURE() << c.name << ": modified " << path;
  }
  for (const auto& [path, what] : before)
    if (!after.count(path)) ADD_FAILURE() << c.name << ": removed " << path;
  if (!HasFailure()) fs::remove_all(tmp);
}

INSTANTIATE_TEST_SUITE_P(Cases, MalformedCorpus, ::testing::ValuesIn(load_cases()),
                         [](const ::testing::TestParamInfo<Case>& i) { return i.param.name; });

TEST(MalformedCorpusManifest, HasTheCases) {
  const auto cases = load_cases();
  EXPECT_GE(cases.size(), 80u);
  size_t files = 0;
  for (auto it = fs::recursive_directory_iterator(kCorpus); it != fs::recursive_directory_iterator(); ++it)
    if (it->is_regular_file()) ++files;
  EXPECT_GE(files, 80u);
  for (const Case& c : cases) {
    EXPECT_TRUE(c.exit_code == 1 || c.exit_code == 2) << c.name;
    EXPECT_EQ(c.stderr_line.find('\n'), std::string::npos) << c.name;
    EXPECT_EQ(c.stderr_line.rfind("kiln: error: ", 0), 0u) << c.name;
  }
}

}  // namespace
