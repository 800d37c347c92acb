// --report_to tensorboard (issue 34): the event files kiln writes, read back by an
// independent reader (tools/read_tfevents.py: Python's standard library, CRCs checked,
// protobuf decoded by hand), hold every number of metrics.jsonl at its step, as the
// float32 TensorBoard stores, under Hugging Face's tags; a damaged file is refused.
#include <gtest/gtest.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cmath>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <map>
#include <nlohmann/json.hpp>
#include <regex>
#include <set>
#include <sstream>
#include <string>
#include <tuple>
#include <vector>

#include "e2e_util.h"

namespace fs = std::filesystem;

namespace {

const std::string kSrc = KILN_SOURCE_DIR;
const std::string kBin = std::string(KILN_BINARY_DIR) + "/bin/kiln";
const std::string kMlp =
    "train examples/mlp_digits/model.onnx --train_data input=data/digits/x_train.npy --train_data "
    "labels=data/digits/y_train.npy --eval_data input=data/digits/x_eval.npy --eval_data "
    "labels=data/digits/y_eval.npy --per_device_train_batch_size 32 --max_steps 60 --logging_steps 10 "
    "--eval_steps 30 --learning_rate 2e-3 ";

std::pair<int, std::string> sh(const std::string& cmd) { return kiln::testing::shell(cmd); }

std::string reader(const std::string& path) { return "python3 '" + kSrc + "/tools/read_tfevents.py' '" + path + "'"; }

std::string event_file(const std::string& dir) {
  for (auto& e : fs::recursive_directory_iterator(dir))
    if (e.path().filename().string().rfind("events.out.tfevents.", 0) == 0) return e.path().string();
  return "";
}

TEST(TensorBoardEvents, ReadBackEqualMetricsJsonl) {
  if (!fs::exists(kSrc + "/data/digits/x_train.npy")) FAIL() << "data/ is missing: run tools/prepare_test_data.sh";
  const std::string dir = kiln::testing::fresh_tmpdir("tb_run");
  auto [code, out] = sh("cd '" + kSrc + "' && '" + kBin + "' " + kMlp + "--report_to tensorboard --logging_dir '" +
                        dir + "/tb' --output_dir '" + dir + "/out'");
  ASSERT_EQ(code, 0) << out;
  const std::string file = event_file(dir + "/tb");
  ASSERT_FALSE(file.empty()) << "no event file under " << dir << "/tb";
  EXPECT_TRUE(std::regex_search(fs::path(file).filename().string(),
                                std::regex("^events\\.out\\.tfevents\\.\\d{10}\\..+\\.\\d+\\.0$")))
      << file;
  auto [rc, text] = sh(reader(file));
  ASSERT_EQ(rc, 0) << text;
  // The events in file order after the file_version record: (step, tag -> value).
  std::vector<std::pair<int64_t, std::map<std::string, double>>> events;
  std::istringstream is(text);
  std::string line;
  int n = 0;
  while (std::getline(is, line)) {
    auto j = nlohmann::json::parse(line);
    if (n++ == 0) {
      EXPECT_EQ(j.value("file_version", ""), "brain.Event:2") << line;
      EXPECT_EQ(j["step"].get<int64_t>(), 0);
      continue;
    }
    ASSERT_TRUE(j.contains("tag")) << line;
    EXPECT_GT(j["wall_time"].get<double>(), 1.6e9);
    // Scalars of one event share its record index (1 on: record 0 is file_version).
    const size_t record = j["record"].get<size_t>();
    ASSERT_GE(record, 1u) << line;
    if (events.size() < record) events.resize(record);
    if (events[record - 1].second.empty()) events[record - 1].first = j["step"].get<int64_t>();
    EXPECT_EQ(events[record - 1].first, j["step"].get<int64_t>()) << line;
    auto& event = events[record - 1];
    const std::string tag = j["tag"];
    EXPECT_EQ(event.second.count(tag), 0u) << "twice in one event: " << line;
    event.second[tag] = j["value"].get<double>();
  }
  // One event per metrics.jsonl line, in order: every number of the line at its step, as
  // float32, under HF's tag, and nothing else.
  std::ifstream m(dir + "/out/metrics.jsonl");
  size_t i = 0;
  std::set<std::string> tags;
  while (std::getline(m, line)) {
    auto j = nlohmann::json::parse(line);
    ASSERT_LT(i, events.size()) << "no event for " << line;
    const auto& [step, values] = events[i++];
    EXPECT_EQ(step, j["step"].get<int64_t>()) << line;
    std::map<std::string, double> want;
    for (auto it = j.begin(); it != j.end(); ++it) {
      if (it.key() == "step" || !it.value().is_number()) continue;
      const std::string tag = it.key().rfind("eval_", 0) == 0 ? "eval/" + it.key().substr(5) : "train/" + it.key();
      want[tag] = static_cast<double>(static_cast<float>(it.value().get<double>()));
      tags.insert(tag);
    }
    EXPECT_EQ(values, want) << line;
  }
  EXPECT_EQ(i, events.size()) << "events that metrics.jsonl does not hold";
  EXPECT_EQ(i, 6u + 2u + 1u);  // 6 logs, 2 evaluations, the summary
  for (const char* t : {"train/loss", "train/learning_rate", "train/grad_norm", "train/samples_per_second", "eval/loss",
                        "eval/accuracy", "train/planned_peak_bytes", "train/measured_peak_bytes"})
    EXPECT_EQ(tags.count(t), 1u) << t;

  // A damaged copy (one byte of a record's data flipped) is refused by the reader.
  std::ifstream in(file, std::ios::binary);
  std::string bytes((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  ASSERT_GT(bytes.size(), 100u);
  bytes[bytes.size() - 10] ^= 0x01;
  const std::string bad = dir + "/damaged.tfevents";
  std::ofstream(bad, std::ios::binary) << bytes;
  auto [brc, btext] = sh(reader(bad));
  EXPECT_EQ(brc, 1) << btext;
  EXPECT_NE(btext.find("CRC mismatch"), std::string::npos) << btext;
}

TEST(TensorBoardEvents, DefaultLoggingDirIsUnderOutputDirRuns) {
  if (!fs::exists(kSrc + "/data/digits/x_train.npy")) FAIL() << "data/ is missing: run tools/prepare_test_data.sh";
  const std::string dir = kiln::testing::fresh_tmpdir("tb_default");
  auto [code, out] =
      sh("cd '" + kSrc + "' && '" + kBin + "' " + kMlp + "--max_steps 10 --report_to all --output_dir '" + dir + "'");
  ASSERT_EQ(code, 0) << out;
  const std::string file = event_file(dir + "/runs");
  ASSERT_FALSE(file.empty()) << out;
  // HF: runs/<Mon><DD>_<HH>-<MM>-<SS>_<host>
  EXPECT_TRUE(std::regex_match(fs::path(file).parent_path().filename().string(),
                               std::regex("[A-Z][a-z]{2}\\d\\d_\\d\\d-\\d\\d-\\d\\d_.+")))
      << file;
  // --report_to none (the default) writes no event file.
  const std::string none = kiln::testing::fresh_tmpdir("tb_none");
  auto [c2, o2] = sh("cd '" + kSrc + "' && '" + kBin + "' " + kMlp + "--max_steps 10 --output_dir '" + none + "'");
  ASSERT_EQ(c2, 0) << o2;
  EXPECT_FALSE(fs::exists(none + "/runs"));
}

}  // namespace
