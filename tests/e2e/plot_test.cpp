// SVG pictures (issue 34): `kiln plot OUTPUT_DIR... -o curves.svg` and `kiln inspect MODEL
// --memory --plot memory.svg`. Each file validates as XML (xmllint --noout), and its
// structure (element counts by name, the ids of panels, series, areas, peak and phase
// marks) matches tests/data/golden/plots/*.txt. After an intended change:
// KILN_UPDATE_GOLDEN=1 build/bin/test_e2e --gtest_filter='Plot*' rewrites them.
#include <gtest/gtest.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <map>
#include <regex>
#include <set>
#include <sstream>
#include <string>

#include "e2e_util.h"

namespace fs = std::filesystem;

namespace {

const std::string kSrc = KILN_SOURCE_DIR;
const std::string kBin = std::string(KILN_BINARY_DIR) + "/bin/kiln";

std::pair<int, std::string> sh(const std::string& cmd) { return kiln::testing::shell(cmd); }

std::string read(const std::string& path) {
  std::ifstream f(path);
  std::stringstream ss;
  ss << f.rdbuf();
  return ss.str();
}

/// "element NAME COUNT" lines in name order, then "id ID" lines in document order.
std::string structure(const std::string& svg) {
  std::map<std::string, int> count;
  std::string ids;
  const std::regex tag("<([a-zA-Z][a-zA-Z0-9]*)([^>]*)>");
  const std::regex id(" id=\"([^\"]*)\"");
  for (auto it = std::sregex_iterator(svg.begin(), svg.end(), tag); it != std::sregex_iterator(); ++it) {
    ++count[(*it)[1]];
    std::smatch m;
    const std::string attrs = (*it)[2];
    if (std::regex_search(attrs, m, id)) ids += "id " + m[1].str() + "\n";
  }
  std::string out;
  for (auto& [name, n] : count) out += "element " + name + " " + std::to_string(n) + "\n";
  return out + ids;
}

/// xmllint --noout on `path`; the structure against tests/data/golden/plots/<golden>.
void check_svg(const std::string& path, const std::string& golden) {
  ASSERT_TRUE(fs::exists(path)) << path;
  auto [code, out] = sh("xmllint --noout '" + path + "'");
  ASSERT_EQ(code, 0) << "xmllint (libxml2-utils; tools/install_deps.sh installs it) refused " << path << ":\n" << out;
  const std::string svg = read(path);
  EXPECT_NE(svg.find("<svg xmlns=\"http://www.w3.org/2000/svg\""), std::string::npos);
  const std::string got = structure(svg);
  const std::string gpath = kSrc + "/tests/data/golden/plots/" + golden;
  if (std::getenv("KILN_UPDATE_GOLDEN")) {
    fs::create_directories(fs::path(gpath).parent_path());
    std::ofstream(gpath) << got;
    return;
  }
  ASSERT_TRUE(fs::exists(gpath)) << gpath << " is missing (KILN_UPDATE_GOLDEN=1 writes it)";
  EXPECT_EQ(got, read(gpath)) << "structure of " << path << " differs from " << gpath;
}

TEST(Plot, CurvesOfTwoRunsOverlaid) {
  if (!fs::exists(kSrc + "/data/digits/x_train.npy")) FAIL() << "data/ is missing: run tools/prepare_test_data.sh";
  const std::string dir = kiln::testing::fresh_tmpdir("plot_curves");
  for (const char* lr : {"2e-3", "5e-4"}) {
    auto [code, out] =
        sh("cd '" + kSrc + "' && '" + kBin +
           "' train examples/mlp_digits/model.onnx --train_data input=data/digits/x_train.npy --train_data "
           "labels=data/digits/y_train.npy --eval_data input=data/digits/x_eval.npy --eval_data "
           "labels=data/digits/y_eval.npy --per_device_train_batch_size 32 --max_steps 60 --logging_steps 10 "
           "--eval_steps 20 --learning_rate " +
           std::string(lr) + " --output_dir '" + dir + "/lr" + lr + "'");
    ASSERT_EQ(code, 0) << out;
  }
  auto [code, out] = sh("'" + kBin + "' plot '" + dir + "/lr2e-3' '" + dir + "/lr5e-4' -o '" + dir + "/curves.svg'");
  ASSERT_EQ(code, 0) << out;
  EXPECT_NE(out.find("wrote " + dir + "/curves.svg"), std::string::npos) << out;
  check_svg(dir + "/curves.svg", "curves_two_runs.txt");
  // Each run's training loss polyline has one point per logged step (6).
  const std::string svg = read(dir + "/curves.svg");
  std::smatch m;
  ASSERT_TRUE(std::regex_search(svg, m, std::regex("id=\"series-loss-1\"[^>]*points=\"([^\"]*)\"")));
  const std::string pts = m[1];
  EXPECT_EQ(std::count(pts.begin(), pts.end(), ','), 6) << pts;
  EXPECT_NE(svg.find(dir + "/lr5e-4</text>"), std::string::npos) << "the legend names the runs";
}

TEST(Plot, SeriesNoRunLoggedSaysSo) {
  // No eval data and no clipping (--max_grad_norm 0: no grad_norm, as Hugging Face): those
  // panels said nothing and drew axes ticked 0, 0, 1, 1, 1; now each is one line of text.
  if (!fs::exists(kSrc + "/data/digits/x_train.npy")) FAIL() << "data/ is missing: run tools/prepare_test_data.sh";
  const std::string dir = kiln::testing::fresh_tmpdir("plot_missing");
  auto [code, out] = sh("cd '" + kSrc + "' && '" + kBin +
                        "' train examples/mlp_digits/model.onnx --train_data input=data/digits/x_train.npy "
                        "--train_data labels=data/digits/y_train.npy --max_steps 10 --logging_steps 2 "
                        "--max_grad_norm 0 --output_dir '" +
                        dir + "/run'");
  ASSERT_EQ(code, 0) << out;
  auto [pcode, pout] = sh("'" + kBin + "' plot '" + dir + "/run' -o '" + dir + "/curves.svg'");
  ASSERT_EQ(pcode, 0) << pout;
  const std::string svg = read(dir + "/curves.svg");
  EXPECT_NE(svg.find("grad norm: not logged by these runs"), std::string::npos);
  EXPECT_NE(svg.find("eval loss: not logged by these runs"), std::string::npos);
  EXPECT_EQ(svg.find("training loss: not logged"), std::string::npos);
  EXPECT_NE(svg.find("id=\"series-loss-0\""), std::string::npos);
}

TEST(Plot, MemoryOfSeveralRematPolicies) {
  const std::string dir = kiln::testing::fresh_tmpdir("plot_memory");
  auto [code, out] =
      sh("cd '" + kSrc + "' && '" + kBin +
         "' inspect examples/mlp_digits/model.onnx --memory --remat_policy none,sqrt --plot '" + dir + "/memory.svg'");
  ASSERT_EQ(code, 0) << out;
  EXPECT_NE(out.find("remat policy none\n"), std::string::npos) << out;
  EXPECT_NE(out.find("remat policy sqrt\n"), std::string::npos) << out;
  check_svg(dir + "/memory.svg", "memory_mlp_none_sqrt.txt");
  // The peak label of each panel is the plan's planned peak.
  const std::string svg = read(dir + "/memory.svg");
  std::smatch m;
  ASSERT_TRUE(std::regex_search(out, m, std::regex("planned peak for this run: ([0-9.]+ [KMG]?i?B) ")));
  EXPECT_NE(svg.find("peak " + m[1].str() + "</text>"), std::string::npos) << m[1];
}

TEST(Plot, BadInvocationsAreOneLineErrors) {
  const std::string dir = kiln::testing::fresh_tmpdir("plot_bad");
  for (const std::string& args :
       {"plot " + dir + "/nothing_here -o " + dir + "/x.svg",
        std::string("inspect examples/mlp_digits/model.onnx --plot ") + dir + "/x.svg",
        std::string("inspect examples/mlp_digits/model.onnx --memory --remat_policy none,sqrt"),
        std::string("inspect examples/mlp_digits/model.onnx --memory --remat_policy none,bogus --plot ") + dir +
            "/x.svg"}) {
    auto [code, out] = sh("cd '" + kSrc + "' && '" + kBin + "' " + args);
    EXPECT_NE(code, 0) << args << ": " << out;
    EXPECT_EQ(std::count(out.begin(), out.end(), '\n'), 1) << args << ": " << out;
    EXPECT_EQ(out.rfind("kiln: error: ", 0), 0u) << args << ": " << out;
    EXPECT_FALSE(fs::exists(dir + "/x.svg")) << args;
  }
}

}  // namespace
