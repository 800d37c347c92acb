// What a person sees while kiln trains (issue 34): tqdm's bar in a real terminal (a tmux
// pane: the command is typed into it and the screen captured), plain log lines when
// stdout is a file, --disable_tqdm, and the refusals of the reporting flags.
#include <gtest/gtest.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <filesystem>
#include <fstream>
#include <regex>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "e2e_util.h"

namespace fs = std::filesystem;

namespace {

const std::string kSrc = KILN_SOURCE_DIR;
const std::string kBin = std::string(KILN_BINARY_DIR) + "/bin/kiln";
const std::string kMlp =
    "train examples/mlp_digits/model.onnx --train_data input=data/digits/x_train.npy --train_data "
    "labels=data/digits/y_train.npy --eval_data input=data/digits/x_eval.npy --eval_data "
    "labels=data/digits/y_eval.npy --per_device_train_batch_size 32 --max_steps 300 --logging_steps 100 "
    "--eval_steps 150 --learning_rate 2e-3 ";

std::pair<int, std::string> sh(const std::string& cmd) { return kiln::testing::shell(cmd); }

std::vector<std::string> lines_of(const std::string& text) {
  std::vector<std::string> out;
  std::istringstream is(text);
  for (std::string l; std::getline(is, l);) out.push_back(l);
  return out;
}

/// Display columns of a UTF-8 line (lead bytes).
int columns(const std::string& s) {
  int w = 0;
  for (unsigned char c : s) w += (c & 0xC0) != 0x80;
  return w;
}

void require_data() {
  if (!fs::exists(kSrc + "/data/digits/x_train.npy"))
    FAIL() << "data/ is missing: run tools/prepare_test_data.sh (tools/test.sh does)";
}

/// Types `args` (a kiln command line) into a fresh 120x40 tmux pane with a UTF-8 locale,
/// waits for it to end, and returns the pane's text (the screen, as a person sees it).
std::string run_in_tmux(const std::string& args, const std::string& name) {
  const std::string sock = "kiln_test_" + name + "_" + std::to_string(::getpid());
  const std::string tmux = "tmux -u -L " + sock + " ";
  auto [code, why] = sh(tmux + "-f /dev/null new-session -d -s t -x 120 -y 40");
  if (code != 0) {
    ADD_FAILURE() << "tmux could not start (tools/install_deps.sh installs it): " << why;
    return "";
  }
  // Typed into the pane's shell, as a person would; the marker says it has ended.
  const std::string line =
      "cd '" + kSrc + "' && clear && LANG=C.UTF-8 LC_ALL=C.UTF-8 '" + kBin + "' " + args + " ; echo KILN_EXIT=$?";
  sh(tmux + "send-keys -t t " + "'" + std::regex_replace(line, std::regex("'"), "'\\''") + "' Enter");
  std::string pane;
  const auto t0 = std::chrono::steady_clock::now();
  while (std::chrono::steady_clock::now() - t0 < std::chrono::seconds(240)) {
    std::this_thread::sleep_for(std::chrono::milliseconds(300));
    pane = sh(tmux + "capture-pane -p -t t").second;
    if (std::regex_search(pane, std::regex("KILN_EXIT=[0-9]"))) break;
  }
  sh(tmux + "kill-server");
  return pane;
}

TEST(Progress, TqdmBarInARealTerminal) {
  require_data();
  const std::string dir = kiln::testing::fresh_tmpdir("progress_tty");
  const std::string pane = run_in_tmux(kMlp + "--output_dir " + dir, "tty");
  ASSERT_NE(pane.find("KILN_EXIT=0"), std::string::npos) << pane;
  // The bar left at the end, tqdm's layout filling the pane's width (120 columns, less
  // the one kept free): percent, bar, step/total, elapsed<remaining, rate, latest loss.
  const std::regex bar(
      "^100%\\|(\u2588)+\\| 300/300 \\[\\d\\d:\\d\\d<00:00, +\\d+\\.\\d\\d(it/s|s/it), loss=[0-9.e+-]+\\]$");
  int bars = 0;
  for (const std::string& l : lines_of(pane)) {
    // Log lines print above the bar, never on its line.
    if (l.find("%|") != std::string::npos)
      EXPECT_EQ(l.find("step "), std::string::npos) << "a log line on the bar's line:\n" << pane;
    if (!std::regex_search(l, bar)) continue;
    ++bars;
    EXPECT_EQ(columns(l), 119) << l;
  }
  EXPECT_EQ(bars, 1) << pane;
  // The log lines and eval lines are there, each on its own line, times with units.
  EXPECT_TRUE(std::regex_search(pane, std::regex("\nstep 100/300 \\| epoch [0-9.]+ \\| loss [0-9.]+ .*\\| [0-9.]+ "
                                                 "(us|ms)/step \\|")))
      << pane;
  EXPECT_TRUE(std::regex_search(pane, std::regex("\neval step 150 \\| epoch [0-9.]+ \\| eval_loss"))) << pane;
  // The eval bar is erased once evaluation is done (tqdm's leave=False for evaluation).
  EXPECT_EQ(pane.find("eval: "), std::string::npos) << pane;
  EXPECT_NE(pane.find("done: step 300"), std::string::npos) << pane;
}

TEST(Progress, DisableTqdmInATerminalPrintsPlainLines) {
  require_data();
  const std::string dir = kiln::testing::fresh_tmpdir("progress_off");
  const std::string pane = run_in_tmux(kMlp + "--disable_tqdm --output_dir " + dir, "off");
  ASSERT_NE(pane.find("KILN_EXIT=0"), std::string::npos) << pane;
  EXPECT_EQ(pane.find("%|"), std::string::npos) << pane;
  EXPECT_NE(pane.find("step 300/300 |"), std::string::npos) << pane;
}

TEST(Progress, PlainLinesWithoutATerminal) {
  require_data();
  const std::string dir = kiln::testing::fresh_tmpdir("progress_file");
  auto [code, out] = sh("cd '" + kSrc + "' && '" + kBin + "' " + kMlp + "--output_dir " + dir);
  ASSERT_EQ(code, 0) << out;
  EXPECT_EQ(out.find('\r'), std::string::npos) << "a bar drawn into a file";
  EXPECT_EQ(out.find("%|"), std::string::npos) << out;
  EXPECT_EQ(out.find("\033"), std::string::npos) << out;
  for (int step : {100, 200, 300})
    EXPECT_TRUE(std::regex_search(out, std::regex("(^|\n)step " + std::to_string(step) +
                                                  "/300 \\| .*\\| [0-9.]+ (us|ms|s)/step \\| [0-9.]+ samples/s\n")))
        << out;
  EXPECT_EQ(out.find("0.000 s/step"), std::string::npos) << out;
  EXPECT_TRUE(std::regex_search(out, std::regex("train_runtime [0-9.]+ (us|ms|s)\n"))) << out;
}

TEST(Progress, BadReportingFlagsAreOneLineErrors) {
  for (const std::string& flags : {std::string("--report_to wandb"), std::string("--report_to none,tensorboard"),
                                   std::string("--logging_dir somewhere")}) {
    auto [code, out] =
        sh("cd '" + kSrc + "' && '" + kBin + "' " + kMlp + flags + " --output_dir /tmp/kiln_progress_never");
    EXPECT_NE(code, 0) << flags << ": " << out;
    EXPECT_EQ(lines_of(out).size(), 1u) << flags << ": " << out;
    EXPECT_NE(out.find(flags.substr(0, flags.find(' '))), std::string::npos) << out;
    EXPECT_FALSE(fs::exists("/tmp/kiln_progress_never"));
  }
  // kiln bench writes nothing: TensorBoard files are refused rather than silently not written.
  auto [code, out] = sh("cd '" + kSrc + "' && '" + kBin +
                        "' bench examples/mlp_digits/model.onnx --train_data input=data/digits/x_train.npy "
                        "--train_data labels=data/digits/y_train.npy --report_to tensorboard");
  EXPECT_EQ(code, 2) << out;
  EXPECT_EQ(out.rfind("kiln: error: --report_to: kiln bench", 0), 0u) << out;
  EXPECT_EQ(lines_of(out).size(), 1u) << out;
}

}  // namespace
