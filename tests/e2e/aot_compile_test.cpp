// `kiln compile` (issue 8) end to end on the tiny GPT and real token data:
//   - DIR/train, copied alone into another folder, trains with the same seed and data
//     and logs kiln train's losses within 1e-5 relative (reference: `kiln train` with
//     the same flags, compiled backend); changing --max_steps at run time still matches;
//     a flag fixed at compile time (--bf16) is refused with one line;
//   - every artifact is produced and parses: ir/NN-PASS.txt for each pass,
//     kernels/*.kir (one per kernel, as compile_report.json counts them), kernels/*.ll
//     accepted by LLVM's parser and verifier, memory_plan.txt, compile_report.json;
//     every IR dump re-imports (ir/parser.h) and prints back to the same text;
//   - a model with external data (torch.onnx's MODEL.onnx.data) is embedded whole: the
//     binary alone, beside a garbage file of the data file's name, trains kiln train's losses;
//   - the compile cache: a second compile in a new process is a disk hit; a truncated
//     entry is rebuilt with exactly one warning line;
//   - KILN_LOGS prints its topics with a [kiln:TOPIC] prefix, and warns once on an
//     unknown topic;
//   - DIR/train runs the program it holds with the .onnx it came from deleted, and runs
//     no pass; kiln train's program cache: a hit (another --max_steps) imports nothing
//     and runs no pass, a program-changing flag misses, a damaged entry is rebuilt with
//     one warning line.
#include <gtest/gtest.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <sstream>

#include "codegen/cpu/llvm_cpu.h"
#include "e2e_util.h"
#include "ir/parser.h"
#include "ir/printer.h"

namespace fs = std::filesystem;

namespace {

const std::string kSrc = KILN_SOURCE_DIR;
const std::string kBin = std::string(KILN_BINARY_DIR) + "/bin/kiln";

struct ShellRun {
  int code;
  std::string out, err;
};

std::string slurp(const fs::path& p) {
  std::ifstream f(p, std::ios::binary);
  std::stringstream ss;
  ss << f.rdbuf();
  return ss.str();
}

/// Runs `cmd` in `cwd` with environment prefix `env` ("" or "NAME=VALUE ...").
ShellRun sh(const std::string& cmd, const std::string& cwd, const std::string& env = "") {
  const std::string base = (fs::temp_directory_path() / ("kiln_aot_" + std::to_string(::getpid()))).string();
  kiln::testing::remove_after_tests(base + ".out");
  kiln::testing::remove_after_tests(base + ".err");
  std::string full = "cd '" + cwd + "' && " + env + " " + cmd + " > '" + base + ".out' 2> '" + base + ".err'";
  int st = std::system(full.c_str());
  return {WIFEXITED(st) ? WEXITSTATUS(st) : 128, slurp(base + ".out"), slurp(base + ".err")};
}

std::string tmpdir(const std::string& name) { return kiln::testing::fresh_tmpdir("aot_" + name); }

using kiln::testing::train_losses;

int count_lines_with(const std::string& text, const std::string& needle) {
  int n = 0;
  std::stringstream ss(text);
  std::string line;
  while (std::getline(ss, line)) n += line.find(needle) != std::string::npos;
  return n;
}

const std::string kModel = kSrc + "/examples/tiny_gpt/model.onnx";
const std::string kTrainFlags = " --train_data " + kSrc +
                                "/data/text/train.bin --block_size 64 --per_device_train_batch_size 4 "
                                "--learning_rate 1e-3 --logging_steps 1 --seed 7";

void require_data() {
  if (!fs::exists(kSrc + "/data/text/train.bin"))
    FAIL() << "data/text/train.bin is missing: run tools/prepare_test_data.sh (tools/test.sh does)";
}

/// One compiled tiny GPT shared by the tests of this file (compiling takes seconds).
const std::string& compiled_dir() {
  static std::string dir;
  if (dir.empty()) {
    dir = tmpdir("gpt");
    ShellRun r = sh("'" + kBin + "' compile " + kModel + kTrainFlags + " --max_steps 6 --cache_dir " + dir +
                        "/cache -o " + dir + "/out",
                    kSrc);
    EXPECT_EQ(r.code, 0) << r.out << r.err;
  }
  return dir;
}

void expect_close_losses(const std::map<int64_t, double>& got, const std::map<int64_t, double>& want, size_t steps) {
  ASSERT_EQ(got.size(), steps);
  ASSERT_EQ(want.size(), steps);
  for (auto& [step, w] : want) {
    ASSERT_TRUE(got.count(step)) << "step " << step;
    EXPECT_LE(std::fabs(got.at(step) - w), 1e-5 * std::fabs(w))
        << "step " << step << ": binary " << got.at(step) << ", kiln train " << w;
  }
}

}  // namespace

TEST(AotCompile, BinaryCopiedAloneReproducesKilnTrain) {
  require_data();
  const std::string dir = compiled_dir();
  ASSERT_TRUE(fs::exists(dir + "/out/train"));
  // Reference: kiln train, same flags.
  ShellRun ref = sh(
      "'" + kBin + "' train " + kModel + kTrainFlags + " --max_steps 6 --no_cache --output_dir " + dir + "/ref", kSrc);
  ASSERT_EQ(ref.code, 0) << ref.err;
  // The binary alone in another folder (no model.onnx, no build tree beside it).
  const std::string alone = dir + "/elsewhere";
  fs::create_directories(alone);
  fs::copy_file(dir + "/out/train", alone + "/train");
  ShellRun r = sh("./train --train_data " + kSrc + "/data/text/train.bin --output_dir run", alone);
  ASSERT_EQ(r.code, 0) << r.out << r.err;
  EXPECT_EQ(r.err.find("differ from the ones compiled"), std::string::npos) << r.err;
  expect_close_losses(train_losses(alone + "/run"), train_losses(dir + "/ref"), 6);
  EXPECT_TRUE(fs::exists(alone + "/run/model.onnx"));
  EXPECT_TRUE(fs::exists(alone + "/run/model.safetensors"));
}

TEST(AotCompile, ExternalDataIsEmbeddedInTheBinary) {
  const std::string d = kSrc + "/tests/data/hf/gpt2/";
  ASSERT_TRUE(fs::exists(d + "logits_dynamo.onnx.data"));
  const std::string flags = " --shape batch=2,seq=8 --train_data input_ids=" + d +
                            "input_ids.npy --train_data labels=" + d +
                            "logit_labels.npy --per_device_train_batch_size 2 --max_steps 3 --logging_steps 1";
  const std::string dir = tmpdir("external");
  ShellRun c =
      sh("'" + kBin + "' compile " + d + "logits_dynamo.onnx" + flags + " --no_cache -o " + dir + "/out", kSrc);
  ASSERT_EQ(c.code, 0) << c.out << c.err;
  ShellRun ref =
      sh("'" + kBin + "' train " + d + "logits_dynamo.onnx" + flags + " --no_cache --output_dir " + dir + "/ref", kSrc);
  ASSERT_EQ(ref.code, 0) << ref.err;
  // Alone, beside a file named as the model's data file that holds garbage: the binary
  // must neither need the real one nor read this one.
  const std::string alone = dir + "/elsewhere";
  fs::create_directories(alone);
  fs::copy_file(dir + "/out/train", alone + "/train");
  {
    std::ofstream junk(alone + "/logits_dynamo.onnx.data", std::ios::binary);
    for (int i = 0; i < 1 << 18; ++i) junk.put(static_cast<char>(0x7f));
  }
  ShellRun r = sh("./train --output_dir run", alone);
  ASSERT_EQ(r.code, 0) << r.out << r.err;
  expect_close_losses(train_losses(alone + "/run"), train_losses(dir + "/ref"), 3);
}

TEST(AotCompile, RunTimeMaxStepsMatchesKilnTrain) {
  require_data();
  const std::string dir = compiled_dir();
  ShellRun ref = sh(
      "'" + kBin + "' train " + kModel + kTrainFlags + " --max_steps 4 --no_cache --output_dir " + dir + "/ref4", kSrc);
  ASSERT_EQ(ref.code, 0) << ref.err;
  ShellRun r = sh("'" + dir + "/out/train' --max_steps 4 --output_dir " + dir + "/run4", kSrc);
  ASSERT_EQ(r.code, 0) << r.out << r.err;
  expect_close_losses(train_losses(dir + "/run4"), train_losses(dir + "/ref4"), 4);
  // The binary's warnings carry its name, as its errors do ("train: error:"); they said
  // "kiln: warning:".
  ShellRun a = sh("'" + dir + "/out/train' --max_steps 2 --save_steps 2 --output_dir " + dir + "/resume", kSrc);
  ASSERT_EQ(a.code, 0) << a.out << a.err;
  ShellRun b = sh("'" + dir +
                      "/out/train' --max_steps 3 --save_steps 2 --seed 7 --resume_from_checkpoint latest "
                      "--output_dir " +
                      dir + "/resume",
                  kSrc);
  ASSERT_EQ(b.code, 0) << b.out << b.err;
  EXPECT_NE(b.err.find("train: warning: resuming from a run with --max_steps 2 (this run: 3)"), std::string::npos)
      << b.err;
  EXPECT_EQ(b.err.find("kiln:"), std::string::npos) << b.err;
}

TEST(AotCompile, FixedFlagRefusedWithOneLine) {
  const std::string dir = compiled_dir();
  ShellRun r = sh("'" + dir + "/out/train' --bf16", kSrc);
  EXPECT_EQ(r.code, 2);
  EXPECT_EQ(std::count(r.err.begin(), r.err.end(), '\n'), 1) << r.err;
  EXPECT_NE(r.err.find("--bf16 is fixed when the binary is compiled"), std::string::npos) << r.err;
  // The value it was compiled with is no change: accepted (the next flag's bad value then
  // is what the run refuses).
  ShellRun same = sh("'" + dir + "/out/train' --bf16 false --max_steps abc", kSrc);
  EXPECT_EQ(same.code, 2) << same.err;
  EXPECT_EQ(same.err.find("--bf16"), std::string::npos) << same.err;
  EXPECT_NE(same.err.find("max_steps"), std::string::npos) << same.err;
  ShellRun u = sh("'" + dir + "/out/train' --no_such_flag 1", kSrc);
  EXPECT_EQ(u.code, 2) << u.err;
  EXPECT_NE(u.err.find("unknown flag --no_such_flag"), std::string::npos) << u.err;
  ShellRun hf = sh("'" + dir + "/out/train' --save_strategy steps", kSrc);
  EXPECT_EQ(hf.code, 2) << hf.err;
  EXPECT_NE(hf.err.find("unknown flag --save_strategy (a Hugging Face flag kiln does not take"), std::string::npos)
      << hf.err;
}

TEST(AotCompile, ArtifactsAreProducedAndParse) {
  const std::string out = compiled_dir() + "/out";
  // IR after each pass.
  int ir_files = 0;
  bool saw_fusion = false, saw_autodiff = false;
  for (auto& e : fs::directory_iterator(out + "/ir")) {
    ++ir_files;
    const std::string n = e.path().filename().string();
    saw_fusion |= n.find("-fusion.txt") != std::string::npos;
    saw_autodiff |= n.find("-autodiff.txt") != std::string::npos;
    const std::string text = slurp(e.path());
    EXPECT_FALSE(text.empty()) << n;
    auto parsed = kiln::ir::parse_graph(text);  // the dumps re-import (ir/parser.h)
    ASSERT_TRUE(parsed) << n << ": " << parsed.message();
    EXPECT_EQ(kiln::ir::graph_to_string(**parsed), text) << n;
  }
  EXPECT_GE(ir_files, 5);
  EXPECT_TRUE(saw_fusion);
  EXPECT_TRUE(saw_autodiff);
  // Report.
  nlohmann::json rep;
  ASSERT_NO_THROW(rep = nlohmann::json::parse(slurp(out + "/compile_report.json")));
  for (const char* k :
       {"passes", "fusion", "lower_to_kernel_ir", "llvm_ir", "llvm_o3", "machine_code", "link", "total"})
    EXPECT_TRUE(rep["seconds"].contains(k)) << k;
  const int train_kernels = rep["programs"]["train"]["kernels"].get<int>();
  const int eval_kernels = rep["programs"]["eval"]["kernels"].get<int>();
  EXPECT_GT(train_kernels, 10);
  EXPECT_GT(rep["programs"]["train"]["fused_ops"].get<int>(), train_kernels);
  EXPECT_GT(rep["planned_peak_bytes"].get<int64_t>(), 0);
  EXPECT_GT(rep["planned_peak_bytes_by_category"]["parameters"].get<int64_t>(), 0);
  // One kernel-IR file per kernel; each program's LLVM IR verifies.
  int kir = 0, ll = 0;
  for (auto& e : fs::directory_iterator(out + "/kernels")) {
    if (e.path().extension() == ".kir") {
      ++kir;
      EXPECT_NE(slurp(e.path()).find("kernel"), std::string::npos) << e.path();
    }
    if (e.path().extension() == ".ll") {
      ++ll;
      kiln::Status s = kiln::codegen::verify_llvm_ir_text(slurp(e.path()));
      EXPECT_TRUE(s.ok()) << e.path() << ": " << s.message();
    }
  }
  EXPECT_EQ(kir, train_kernels + eval_kernels);
  EXPECT_EQ(ll, 2);
  const std::string plan = slurp(out + "/memory_plan.txt");
  EXPECT_NE(plan.find("peak"), std::string::npos) << plan;
}

TEST(AotCompile, CacheHitAndTruncatedEntryRebuilt) {
  require_data();
  const std::string dir = compiled_dir();  // its compile filled dir/cache
  auto cache_status = [&](const std::string& out) {
    auto rep = nlohmann::json::parse(slurp(out + "/compile_report.json"));
    return rep["programs"]["train"]["compile_cache"].get<std::string>();
  };
  const std::string cmd =
      "'" + kBin + "' compile " + kModel + kTrainFlags + " --max_steps 6 --cache_dir " + dir + "/cache -o ";
  ShellRun hit = sh(cmd + dir + "/out2", kSrc);
  ASSERT_EQ(hit.code, 0) << hit.err;
  EXPECT_EQ(cache_status(dir + "/out2"), "disk hit");
  int entries = 0;
  for (auto& e : fs::directory_iterator(dir + "/cache")) {
    if (e.path().extension() != ".kcache") continue;
    ++entries;
    fs::resize_file(e.path(), fs::file_size(e.path()) / 2);
  }
  EXPECT_EQ(entries, 2);  // train and eval programs
  ShellRun again = sh(cmd + dir + "/out3", kSrc);
  ASSERT_EQ(again.code, 0) << again.err;
  EXPECT_EQ(cache_status(dir + "/out3"), "miss");
  EXPECT_EQ(count_lines_with(again.err, "compile cache entry"), 2) << again.err;  // one per truncated entry
  ShellRun fixed = sh(cmd + dir + "/out4", kSrc);
  EXPECT_EQ(cache_status(dir + "/out4"), "disk hit");
}

TEST(AotCompile, KilnLogsTopics) {
  require_data();
  const std::string dir = tmpdir("logs");
  ShellRun r =
      sh("'" + kBin + "' train " + kModel + kTrainFlags + " --max_steps 1 --no_cache --output_dir " + dir + "/o", kSrc,
         "KILN_LOGS=fusion,recompiles,memory,bogus");
  ASSERT_EQ(r.code, 0) << r.err;
  EXPECT_GT(count_lines_with(r.err, "[kiln:fusion] "), 10);
  EXPECT_EQ(count_lines_with(r.err, "[kiln:recompiles] "), 2);  // train and eval programs
  EXPECT_GT(count_lines_with(r.err, "[kiln:memory] "), 3);
  EXPECT_EQ(count_lines_with(r.err, "[kiln:graph] "), 0);
  EXPECT_EQ(count_lines_with(r.err, "unknown topic 'bogus'"), 1);
}

namespace {

TEST(AotCompile, BinaryLoadsItsProgramWithTheModelDeletedAndRunsNoPass) {
  // DIR/train runs the program it holds (issue 30): with the .onnx file it was compiled
  // from deleted, it imports nothing and runs no pass (KILN_LOGS=passes prints nothing).
  require_data();
  const std::string dir = tmpdir("deleted");
  fs::copy_file(kModel, dir + "/model.onnx");
  ShellRun c = sh("'" + kBin + "' compile " + dir + "/model.onnx" + kTrainFlags + " --max_steps 3 --cache_dir " + dir +
                      "/cache -o " + dir + "/out",
                  kSrc);
  ASSERT_EQ(c.code, 0) << c.out << c.err;
  EXPECT_TRUE(fs::exists(dir + "/out/program.kiln"));
  fs::remove(dir + "/model.onnx");
  ShellRun r = sh("'" + dir + "/out/train' --output_dir " + dir + "/run", kSrc, "KILN_LOGS=passes");
  ASSERT_EQ(r.code, 0) << r.out << r.err;
  EXPECT_EQ(count_lines_with(r.err, "[kiln:passes]"), 0) << r.err;
  EXPECT_EQ(train_losses(dir + "/run").size(), 3u);
  EXPECT_TRUE(fs::exists(dir + "/run/model.onnx"));
}

TEST(AotCompile, KilnTrainProgramCacheHitRunsNoImportAndNoPass) {
  require_data();
  const std::string dir = tmpdir("program_cache");
  const std::string cmd =
      "'" + kBin + "' train " + kModel + kTrainFlags + " --backend compiled --cache_dir " + dir + "/cache";
  ShellRun first = sh(cmd + " --max_steps 3 --output_dir " + dir + "/a", kSrc, "KILN_LOGS=passes,cache");
  ASSERT_EQ(first.code, 0) << first.err;
  EXPECT_EQ(count_lines_with(first.err, "[kiln:passes] import"), 1) << first.err;
  EXPECT_GT(count_lines_with(first.err, "[kiln:passes] graph"), 3) << first.err;
  EXPECT_EQ(count_lines_with(first.err, "program cache store"), 1) << first.err;
  // Another run length and output folder: the same program.
  ShellRun hit = sh(cmd + " --max_steps 4 --output_dir " + dir + "/b", kSrc, "KILN_LOGS=passes,cache");
  ASSERT_EQ(hit.code, 0) << hit.err;
  EXPECT_EQ(count_lines_with(hit.err, "program cache hit"), 1) << hit.err;
  EXPECT_EQ(count_lines_with(hit.err, "[kiln:passes]"), 0) << hit.err;
  // A flag that changes the program misses.
  ShellRun miss = sh(cmd + " --max_steps 2 --weight_decay 0.1 --output_dir " + dir + "/c", kSrc, "KILN_LOGS=cache");
  ASSERT_EQ(miss.code, 0) << miss.err;
  EXPECT_EQ(count_lines_with(miss.err, "program cache miss"), 1) << miss.err;
  // A corrupted entry: one warning line, then rebuilt.
  int entries = 0;
  for (auto& e : fs::directory_iterator(dir + "/cache/programs"))
    if (e.path().extension() == ".kiln") ++entries, fs::resize_file(e.path(), fs::file_size(e.path()) - 7);
  EXPECT_EQ(entries, 2);
  ShellRun rebuilt = sh(cmd + " --max_steps 4 --output_dir " + dir + "/d", kSrc);
  ASSERT_EQ(rebuilt.code, 0) << rebuilt.err;
  EXPECT_EQ(count_lines_with(rebuilt.err, "program cache: "), 1) << rebuilt.err;
  EXPECT_EQ(train_losses(dir + "/d"), train_losses(dir + "/b"));
}

}  // namespace
