// Replays the fuzz findings and seeds through the fuzz harness (fuzz/harness.h), the same
// reader code the libFuzzer targets drive (tools/fuzz.sh), in the normal build:
// - every file of tests/data/fuzz_regressions/TARGET/ (an input that crashed a reader
//   before its fix) must be refused with an error status, not crash;
// - every seed of fuzz/seeds/TARGET/ must go through without a crash (status either way).
// Under tools/sanitize.sh the same replays run with ASan and UBSan.
#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>
#include <sstream>

#include "fuzz/harness.h"

using namespace kiln;
namespace fs = std::filesystem;

namespace {

std::string slurp(const fs::path& p) {
  std::ifstream in(p, std::ios::binary);
  std::stringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

std::vector<fs::path> files_of(const fs::path& dir) {
  std::vector<fs::path> out;
  std::error_code ec;
  if (!fs::is_directory(dir, ec)) return out;
  for (const auto& e : fs::directory_iterator(dir))
    if (e.is_regular_file()) out.push_back(e.path());
  std::sort(out.begin(), out.end());
  return out;
}

}  // namespace

TEST(FuzzRegressions, EveryFindingIsRefusedWithAnError) {
  const fs::path root = fs::path(KILN_SOURCE_DIR) / "tests/data/fuzz_regressions";
  int n = 0;
  for (const std::string& t : fuzz::target_names())
    for (const fs::path& f : files_of(root / t)) {
      Status s = fuzz::run_target(t, slurp(f));
      EXPECT_FALSE(s.is_ok()) << t << ": " << f.filename() << " was accepted";
      EXPECT_FALSE(s.message().empty()) << t << ": " << f.filename();
      ++n;
    }
  std::error_code ec;
  for (const auto& e : fs::directory_iterator(root, ec)) {
    const std::string name = e.path().filename().string();
    const auto& names = fuzz::target_names();
    EXPECT_NE(std::find(names.begin(), names.end(), name), names.end()) << "no fuzz target named " << name;
  }
  std::cout << n << " regression inputs replayed\n";
}

TEST(FuzzRegressions, SeedsGoThroughWithoutACrash) {
  const fs::path root = fs::path(KILN_SOURCE_DIR) / "fuzz/seeds";
  int n = 0, ok = 0;
  for (const std::string& t : fuzz::target_names())
    for (const fs::path& f : files_of(root / t)) {
      ok += fuzz::run_target(t, slurp(f)).is_ok() ? 1 : 0;
      ++n;
    }
  EXPECT_GT(n, 0);
  std::cout << n << " seeds replayed, " << ok << " accepted\n";
}

TEST(FuzzRegressions, UnknownTargetIsAnError) { EXPECT_FALSE(fuzz::run_target("nope", "").is_ok()); }
