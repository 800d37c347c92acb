// The program file (issue 30, runtime/program.h):
//   - a built program saved and loaded back (no import, no pass: kernels JIT-linked from
//     the file's object code) trains bit-identically to the one in memory: the same
//     losses and the same state after every step, for examples in fp32, bf16 with 8-bit
//     AdamW and gradient accumulation, and the eager backend;
//   - a file of another format version is refused with one line naming both versions;
//     truncated files, a flipped payload byte, and payloads corrupted behind a valid
//     SHA-256 are refused with one line or load, never crash;
//   - kiln train imports its model once per run (with evaluation); on a program-cache hit
//     it imports nothing and its losses equal the first run's.
#include <openssl/evp.h>

#include <cmath>
#include <optional>
#include <random>
#include <sstream>

#include "e2e_util.h"
#include "ir/printer.h"
#include "runtime/program.h"
#include "tools/driver/program_cache.h"
#include "tools/driver/train_run.h"

using namespace kiln;
using namespace kiln::testing;

namespace {

struct Built {
  driver::TrainingProgram prog;
  std::string bytes;
};

Built build_and_save(const ExampleCase& c, const std::string& backend) {
  auto [xs, ys] = load_trajectory(c.model);
  EXPECT_TRUE(xs && ys);
  auto p = driver::build_training_program(example_case_config(c, backend, xs->dim(1)), nullptr, false, false, c.steps);
  EXPECT_TRUE(p) << p.message();
  runtime::ProgramFileInfo info;
  info.kiln_version = driver::kiln_version();
  info.cpu = "test";
  info.model_bytes = "model bytes";
  auto bytes = runtime::serialize_program(*p, info);
  EXPECT_TRUE(bytes) << bytes.message();
  return {std::move(*p), bytes ? *bytes : std::string()};
}

class ProgramFileRoundTrip : public ::testing::TestWithParam<std::pair<ExampleCase, std::string>> {};

TEST_P(ProgramFileRoundTrip, LoadedProgramTrainsBitIdentically) {
  const auto& [c, backend] = GetParam();
  auto [xs, ys] = load_trajectory(c.model);
  ASSERT_TRUE(xs && ys);
  Built b = build_and_save(c, backend);
  ASSERT_FALSE(b.bytes.empty());
  runtime::ProgramFileInfo info;
  auto loaded = runtime::deserialize_program(b.bytes, "test.kiln", driver::jit_kernel_binder(), &info);
  ASSERT_TRUE(loaded) << loaded.message();
  EXPECT_EQ(info.model_bytes, "model bytes");
  EXPECT_EQ(info.format, runtime::kProgramFormatVersion);
  EXPECT_EQ(loaded->data_inputs, b.prog.data_inputs);
  EXPECT_EQ(loaded->parameters, b.prog.parameters);
  EXPECT_EQ(loaded->signature.planned_peak_bytes, b.prog.signature.planned_peak_bytes);
  EXPECT_EQ(loaded->signature.index_extents, b.prog.signature.index_extents);
  EXPECT_EQ(loaded->train_kernels == nullptr, b.prog.train_kernels == nullptr);
  if (b.prog.train_kernels) {
    EXPECT_EQ(loaded->train_kernels->by_node.size(), b.prog.train_kernels->by_node.size());
    ASSERT_NE(loaded->train_arena, nullptr);
    EXPECT_EQ(loaded->train_arena->block_bytes(), b.prog.train_arena->block_bytes());
    EXPECT_EQ(loaded->train_arena->num_homes(), b.prog.train_arena->num_homes());
  }
  // The loaded graphs print as the built ones (every node, attribute, shape and offset).
  EXPECT_EQ(ir::graph_to_string(*loaded->train_step), ir::graph_to_string(*b.prog.train_step));
  ASSERT_NE(loaded->eval, nullptr);
  EXPECT_EQ(ir::graph_to_string(*loaded->eval), ir::graph_to_string(*b.prog.eval));
  // Saved again, the loaded program gives the same bytes.
  runtime::ProgramFileInfo again = info;
  auto bytes2 = runtime::serialize_program(*loaded, again);
  ASSERT_TRUE(bytes2) << bytes2.message();
  EXPECT_TRUE(*bytes2 == b.bytes) << "re-saved program differs";

  std::map<std::string, ir::Tensor> s_built, s_loaded;
  auto l_built = trajectory_losses(b.prog, *xs, *ys, c.steps, false, &s_built);
  auto l_loaded = trajectory_losses(*loaded, *xs, *ys, c.steps, false, &s_loaded);
  ASSERT_EQ(l_built.size(), static_cast<size_t>(c.steps));
  ASSERT_EQ(l_loaded.size(), l_built.size());
  for (size_t i = 0; i < l_built.size(); ++i) EXPECT_EQ(l_loaded[i], l_built[i]) << "step " << i;
  expect_bitwise_equal(s_loaded, s_built);
}

std::vector<std::pair<ExampleCase, std::string>> round_trip_cases() {
  ExampleCase gpt{"tiny_gpt", "bf16", "adamw_8bit", "blocks", 2, 3};
  ExampleCase mlp{"mlp_digits", "fp32", "adamw_torch", "none", 1, 3};
  ExampleCase cnn{"cnn_bn", "fp32", "sgd", "none", 2, 3};
  return {{gpt, "compiled"}, {mlp, "compiled"}, {cnn, "compiled"}, {cnn, "eager"}};
}

INSTANTIATE_TEST_SUITE_P(Examples, ProgramFileRoundTrip, ::testing::ValuesIn(round_trip_cases()), [](const auto& info) {
  return example_case_name(info.param.first) + "_" + info.param.second;
});

/// A small compiled program's file bytes, built once.
const std::string& small_program() {
  static const std::string bytes =
      build_and_save({"mlp_digits", "fp32", "adamw_torch", "none", 1, 2}, "compiled").bytes;
  return bytes;
}

std::string raw_sha256(const std::string& s) {
  unsigned char md[EVP_MAX_MD_SIZE];
  unsigned int len = 0;
  EVP_Digest(s.data(), s.size(), md, &len, EVP_sha256(), nullptr);
  return std::string(reinterpret_cast<const char*>(md), len);
}

void expect_one_line_refusal(const std::string& bytes, const std::string& what) {
  auto p = runtime::deserialize_program(bytes, "prog.kiln", driver::jit_kernel_binder());
  ASSERT_FALSE(p) << what << ": loaded";
  EXPECT_EQ(p.message().find('\n'), std::string::npos) << what << ": " << p.message();
  EXPECT_EQ(p.message().rfind("prog.kiln: ", 0), 0u) << what << ": " << p.message();
}

TEST(ProgramFile, OtherFormatVersionIsRefusedNamingBothVersions) {
  std::string bytes = small_program();
  ASSERT_GT(bytes.size(), 64u);
  const uint32_t other = runtime::kProgramFormatVersion + 1;
  for (int i = 0; i < 4; ++i) bytes[8 + i] = static_cast<char>((other >> (8 * i)) & 0xff);
  auto p = runtime::deserialize_program(bytes, "prog.kiln", driver::jit_kernel_binder());
  ASSERT_FALSE(p);
  EXPECT_NE(p.message().find("format " + std::to_string(other)), std::string::npos) << p.message();
  EXPECT_NE(p.message().find("reads format " + std::to_string(runtime::kProgramFormatVersion)), std::string::npos)
      << p.message();
  EXPECT_EQ(p.message().find('\n'), std::string::npos);
  auto info = runtime::read_program_info(bytes, "prog.kiln");
  ASSERT_FALSE(info);
  EXPECT_EQ(info.message(), p.message());
}

TEST(ProgramFile, TruncatedOrCorruptedFilesAreRefusedWithOneLine) {
  const std::string& bytes = small_program();
  ASSERT_GT(bytes.size(), 1000u);
  for (size_t n : {size_t{0}, size_t{5}, size_t{30}, size_t{52}, bytes.size() / 2, bytes.size() - 1})
    expect_one_line_refusal(bytes.substr(0, n), "truncated to " + std::to_string(n));
  expect_one_line_refusal(bytes + "x", "a byte appended");
  expect_one_line_refusal("ONNX not a program at all", "not a program");
  std::mt19937 rng(7);
  for (int i = 0; i < 20; ++i) {
    std::string flipped = bytes;
    const size_t at = 52 + rng() % (bytes.size() - 52);
    flipped[at] = static_cast<char>(flipped[at] ^ 0x5a);
    auto p = runtime::deserialize_program(flipped, "prog.kiln", driver::jit_kernel_binder());
    ASSERT_FALSE(p) << "byte " << at << " flipped: loaded";
    EXPECT_NE(p.message().find("SHA-256 mismatch"), std::string::npos) << p.message();
  }
}

TEST(ProgramFile, PayloadsCorruptedBehindAValidHashNeverCrash) {
  // A hostile file can carry a matching SHA-256: every section kiln reads is
  // bounds-checked, so a corrupted payload is refused with one line or loads; it never
  // crashes. The kernels' object code is not fuzzed: a program file holds machine code
  // that loading it runs, so it is trusted like an executable (LLVM's JIT linker aborts
  // on some malformed objects).
  const std::string& bytes = small_program();
  const std::string payload = bytes.substr(52);
  const size_t object_at = payload.find(
      "\x7f"
      "ELF");
  ASSERT_NE(object_at, std::string::npos);
  std::mt19937 rng(11);
  int refused = 0;
  for (int i = 0; i < 150; ++i) {
    std::string p = payload;
    const int flips = 1 + static_cast<int>(rng() % 4);
    // Bias towards the front (meta, counts and graph structure) where corruption matters.
    for (int k = 0; k < flips; ++k) {
      const size_t span = (i % 2) ? object_at : std::min<size_t>(object_at, 4096);
      const size_t at = rng() % span;
      p[at] = static_cast<char>(rng());
    }
    std::string file = bytes.substr(0, 20) + raw_sha256(p) + p;
    auto prog = runtime::deserialize_program(file, "prog.kiln", driver::jit_kernel_binder());
    if (!prog) {
      ++refused;
      EXPECT_EQ(prog.message().find('\n'), std::string::npos) << prog.message();
      EXPECT_EQ(prog.message().rfind("prog.kiln: ", 0), 0u) << prog.message();
    }
  }
  EXPECT_GT(refused, 0) << "no corruption was noticed";
  std::cout << "[ CORRUPT ] " << refused << " of 150 corrupted payloads refused, the others loaded\n";
}

// ---- kiln train: one import per run, none on a program-cache hit

runtime::TrainConfig digits_config(const std::string& out, const std::string& cache) {
  runtime::TrainConfig cfg;
  cfg.model = example_path("mlp_digits", "model.onnx");
  const std::string d = std::string(KILN_SOURCE_DIR) + "/data/digits/";
  cfg.train_data = {"input=" + d + "x_train.npy", "labels=" + d + "y_train.npy"};
  cfg.eval_data = {"input=" + d + "x_eval.npy", "labels=" + d + "y_eval.npy"};
  cfg.per_device_train_batch_size = 32;
  cfg.per_device_eval_batch_size = 32;
  cfg.gradient_accumulation_steps = 2;
  cfg.max_steps = 6;
  cfg.eval_steps = 3;
  cfg.logging_steps = 1;
  cfg.learning_rate = 1e-3;
  cfg.backend = "compiled";
  cfg.output_dir = out;
  cfg.cache_dir = cache;
  return cfg;
}

TEST(ModelImports, OnePerKilnTrainRunWithEvaluationNoneOnAProgramCacheHit) {
  const std::string dir = fresh_tmpdir("imports");
  runtime::TrainConfig cfg = digits_config(dir + "/a", dir + "/cache");
  ASSERT_TRUE(cfg.validate()) << cfg.validate().message();
  std::ostringstream out;
  const int64_t before = driver::model_imports();
  Status s = driver::run_training(cfg, nullptr, out);
  ASSERT_TRUE(s) << s.message();
  EXPECT_EQ(driver::model_imports() - before, 1) << "a run with evaluation imports its model once";
  // The same program again (another output folder, more steps: per-run settings): a
  // cache hit imports nothing and trains the same losses for the steps both ran.
  runtime::TrainConfig again = cfg;
  again.output_dir = dir + "/b";
  again.max_steps = 8;
  const int64_t before2 = driver::model_imports();
  s = driver::run_training(again, nullptr, out);
  ASSERT_TRUE(s) << s.message();
  EXPECT_EQ(driver::model_imports() - before2, 0) << "a program-cache hit imports nothing";
  // The same run without the cache: same losses as the cached program's (8 steps).
  runtime::TrainConfig fresh = again;
  fresh.output_dir = dir + "/c";
  fresh.no_cache = true;
  s = driver::run_training(fresh, nullptr, out);
  ASSERT_TRUE(s) << s.message();
  auto lb = train_losses(dir + "/b"), lc = train_losses(dir + "/c");
  ASSERT_EQ(lb.size(), 8u);
  EXPECT_EQ(lb, lc) << "the cached program trains as a fresh build";
}

}  // namespace
