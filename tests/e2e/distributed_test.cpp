// Data-parallel training (issue 35): `mpirun -np N kiln train` against one process.
//  - N ranks with per-device batch b against one process with batch N*b (N = 2, 3, 4,
//    oversubscribed on this 2-core machine; MLP and tiny GPT; 10 AdamW steps, clipping
//    on): per-step losses and the global gradient norm within 1e-6 relative, weights
//    within 1e-4 (Adam amplifies rounding noise; see the test).
//  - N ranks against one process with --gradient_accumulation_steps N (N = 2, 3, 4; MLP,
//    tiny GPT, cnn_bn): bit-exact losses and parameters. cnn_bn's BatchNorm normalizes
//    each rank's own batch (no SyncBatchNorm, as DDP), as the loop does each microbatch;
//    its running statistics are rank 0's own (checked to differ from the loop's).
//  - The summary's counters: collectives per step = the buckets of the program's IR,
//    bytes sent per rank per step = 2(N-1)/N x the bucket bytes (each bucket padded to a
//    multiple of N elements).
//  - A checkpoint written by 2 ranks resumes on 1 and on 4 ranks (same global batch) and
//    ends within 1e-6 of the uninterrupted run; rank 0 alone writes output_dir.
//  - A rank killed mid-run ends the job within seconds, the surviving rank saying so in
//    one line.
// Every run uses OMP_NUM_THREADS=1, so one process and each rank run the same kernels.
#include <chrono>
#include <cmath>
#include <regex>
#include <set>

#include "e2e_util.h"

using namespace kiln;
using namespace kiln::testing;
namespace fs = std::filesystem;

namespace {

const std::string kSrc = KILN_SOURCE_DIR;
const std::string kBin = std::string(KILN_BINARY_DIR) + "/bin/kiln";

/// The environment of every run: one thread per process, mpirun allowed as root.
const std::string kEnv = "cd '" + kSrc +
                         "' && OMP_NUM_THREADS=1 OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 "
                         "OMPI_MCA_rmaps_base_oversubscribe=1 ";

void require_setup() {
  if (!fs::exists(kSrc + "/data/digits/x_train.npy") || !fs::exists(kSrc + "/data/text/train.bin"))
    FAIL() << "data/ is missing: run tools/prepare_test_data.sh (tools/test.sh does)";
  if (shell("command -v mpirun").first != 0)
    FAIL() << "mpirun is missing: tools/install_deps.sh installs Open MPI (openmpi-bin, libopenmpi-dev)";
}

struct Model {
  std::string name, data;
  int64_t batch;  ///< per-device batch b
};

const Model kMlp{"mlp_digits", "--train_data input=data/digits/x_train.npy --train_data labels=data/digits/y_train.npy",
                 8};
const Model kGpt{"tiny_gpt", "--train_data data/text/train.bin --block_size 64", 4};
const Model kCnn{"cnn_bn", "--train_data input=data/digits/x_train_img.npy --train_data labels=data/digits/y_train.npy",
                 8};

const Model& model_named(const std::string& name) {
  return name == "mlp_digits" ? kMlp : name == "tiny_gpt" ? kGpt : kCnn;
}

/// Test names of (model, ranks) parameters: "tiny_gpt_3ranks".
std::string model_ranks_name(const ::testing::TestParamInfo<std::tuple<std::string, int>>& info) {
  return std::get<0>(info.param) + "_" + std::to_string(std::get<1>(info.param)) + "ranks";
}

/// A 2-rank job whose rank 1 runs `rank1` (a command line, optionally prefixed by
/// mpirun's `-x VAR=VALUE`) and rank 0 `args`: what it printed and how long it took.
struct TimedJob {
  std::pair<int, std::string> result;
  double seconds = 0;
};
TimedJob two_rank_job(const std::string& args, const std::string& rank1) {
  const auto t0 = std::chrono::steady_clock::now();
  TimedJob j;
  j.result = shell(kEnv + "timeout 120 mpirun --bind-to none -np 1 " + args + " : -np 1 " + rank1);
  j.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  return j;
}

/// A job that must fail: a non-zero exit, before `limit_s` seconds (`why` says what a
/// slower end would mean), and a line matching `line` in its output.
void expect_job_fails(const TimedJob& j, double limit_s, const std::string& line, const std::string& why = "") {
  const auto& [r, secs] = j;
  EXPECT_NE(r.first, 0) << r.second;
  EXPECT_LT(secs, limit_s) << why << r.second;
  EXPECT_TRUE(std::regex_search(r.second, std::regex(line))) << r.second;
}

std::string cache_dir() {
  static const std::string d = fresh_tmpdir("dp_cache");
  return d;
}

/// The kiln train command line of `m` (10 AdamW steps, clipping at 1, one log line per step).
std::string train_args(const Model& m, int64_t batch, int64_t accum, const std::string& out,
                       const std::string& extra = "") {
  return kBin + " train examples/" + m.name + "/model.onnx " + m.data + " --per_device_train_batch_size " +
         std::to_string(batch) + " --gradient_accumulation_steps " + std::to_string(accum) +
         " --max_steps 10 --logging_steps 1 --learning_rate 3e-3 --weight_decay 0.01 --max_grad_norm 1.0 "
         "--disable_dropout --disable_tqdm --seed 7 --cache_dir " +
         cache_dir() + " --output_dir " + out + " " + extra;
}

std::pair<int, std::string> run_ranks(int ranks, const std::string& args) {
  return shell(kEnv + "timeout 300 mpirun -np " + std::to_string(ranks) + " --bind-to none " + args);
}

std::pair<int, std::string> run_one(const std::string& args) { return shell(kEnv + "timeout 300 " + args); }

std::map<std::string, ir::Tensor> weights(const std::string& dir) {
  auto w = runtime::io::load_safetensors(dir + "/model.safetensors");
  EXPECT_TRUE(w) << dir << ": " << (w ? "" : w.message());
  return w ? *w : std::map<std::string, ir::Tensor>{};
}

bool is_buffer(const std::string& name) { return name.find("running_") != std::string::npos; }

/// Every tensor of `ref` (parameters only with `params_only`) within `tol` (relative L2).
void expect_close(const std::map<std::string, ir::Tensor>& got, const std::map<std::string, ir::Tensor>& ref,
                  double tol, bool params_only, const std::string& what) {
  ASSERT_FALSE(ref.empty()) << what;
  int checked = 0;
  for (auto& [name, t] : ref) {
    if (params_only && is_buffer(name)) continue;
    auto it = got.find(name);
    ASSERT_NE(it, got.end()) << what << ": no " << name;
    EXPECT_LE(rel_l2(it->second, t), tol) << what << ": " << name;
    ++checked;
  }
  EXPECT_GT(checked, 0) << what;
}

void expect_losses_close(const std::string& dir, const std::string& ref_dir, double tol, const std::string& what) {
  auto a = train_losses(dir), b = train_losses(ref_dir);
  ASSERT_EQ(a.size(), 10u) << what;
  ASSERT_EQ(b.size(), 10u) << what;
  for (auto& [step, l] : b) EXPECT_LE(std::abs(a.at(step) - l), tol * std::abs(l)) << what << ": step " << step;
}

/// Losses of each step of DIR/metrics.jsonl, and the first step's pre-clip gradient norm.
double first_grad_norm(const std::string& dir) {
  std::ifstream f(dir + "/metrics.jsonl");
  for (std::string line; std::getline(f, line);) {
    auto j = nlohmann::json::parse(line);
    if (j.contains("grad_norm") && j["step"] == 1) return j["grad_norm"].get<double>();
  }
  ADD_FAILURE() << dir << ": no grad_norm at step 1";
  return 0;
}

/// The set of files under `d` (relative paths).
std::set<std::string> files_under(const std::string& d) {
  std::set<std::string> f;
  for (auto& e : fs::recursive_directory_iterator(d)) f.insert(fs::relative(e.path(), d).string());
  return f;
}

class RanksVsOneLargeBatch : public ::testing::TestWithParam<std::tuple<std::string, int>> {};

// N ranks x b rows against one process of N*b rows: another graph (one mean over N*b
// rows against N means of b rows, summed), so the check is independent of the pass's
// own arithmetic. Losses of all 10 steps and the first step's global gradient norm
// within 1e-6; the weights after 10 AdamW steps within 1e-4, since Adam turns
// noise-level gradient differences into whole steps (m / sqrt(v) of a near-zero
// gradient); the exact equality of the trajectory is RanksVsAccumulation's.
TEST_P(RanksVsOneLargeBatch, LossesGradientNormAndWeights) {
  require_setup();
  const auto [name, n] = GetParam();
  const Model& m = name == "mlp_digits" ? kMlp : kGpt;
  const std::string dir = fresh_tmpdir("dp_" + name + "_" + std::to_string(n));
  auto ref = run_one(train_args(m, n * m.batch, 1, dir + "/one"));
  ASSERT_EQ(ref.first, 0) << ref.second;
  auto dp = run_ranks(n, train_args(m, m.batch, 1, dir + "/ranks"));
  ASSERT_EQ(dp.first, 0) << dp.second;
  EXPECT_NE(dp.second.find("(" + std::to_string(n) + " ranks x " + std::to_string(m.batch) + ")"), std::string::npos)
      << dp.second;
  expect_losses_close(dir + "/ranks", dir + "/one", 1e-6, name);
  const double g = first_grad_norm(dir + "/ranks"), g1 = first_grad_norm(dir + "/one");
  EXPECT_LE(std::abs(g - g1), 1e-6 * g1) << "grad_norm " << g << " vs " << g1;
  expect_close(weights(dir + "/ranks"), weights(dir + "/one"), 1e-4, false, name);
  // One writer, the single-process layout: the files the one process wrote.
  EXPECT_EQ(files_under(dir + "/ranks"), files_under(dir + "/one"));
}

INSTANTIATE_TEST_SUITE_P(Distributed, RanksVsOneLargeBatch,
                         ::testing::Combine(::testing::Values("mlp_digits", "tiny_gpt"), ::testing::Values(2, 3, 4)),
                         model_ranks_name);

class RanksVsAccumulation : public ::testing::TestWithParam<std::tuple<std::string, int>> {};

// N ranks x b rows against one process accumulating N microbatches of b rows: the same
// rows per gradient (BatchNorm normalizes each rank's b rows as the loop does each
// microbatch's), summed in the same order (runtime/comm.h), so losses and parameters
// are equal bit for bit. BatchNorm running statistics are the exception: rank 0's own,
// updated once per step from its rows, where the loop threads them through N updates.
TEST_P(RanksVsAccumulation, BitExact) {
  require_setup();
  const auto [name, n] = GetParam();
  const Model& m = model_named(name);
  const std::string dir = fresh_tmpdir("dp_exact_" + name + "_" + std::to_string(n));
  auto ref = run_one(train_args(m, m.batch, n, dir + "/accum"));
  ASSERT_EQ(ref.first, 0) << ref.second;
  auto dp = run_ranks(n, train_args(m, m.batch, 1, dir + "/ranks"));
  ASSERT_EQ(dp.first, 0) << dp.second;
  auto a = train_losses(dir + "/ranks"), b = train_losses(dir + "/accum");
  ASSERT_EQ(a.size(), 10u);
  for (auto& [step, l] : b) EXPECT_EQ(a.at(step), l) << "step " << step;
  auto w = weights(dir + "/ranks"), w1 = weights(dir + "/accum");
  ASSERT_EQ(w.size(), w1.size());
  int buffers = 0;
  for (auto& [nm, t] : w1) {
    ASSERT_TRUE(w.count(nm)) << nm;
    if (is_buffer(nm)) {
      ++buffers;
      EXPECT_GT(rel_l2(w.at(nm), t), 1e-6) << nm << ": rank 0's running statistics should be its own";
      continue;
    }
    EXPECT_EQ(std::memcmp(w.at(nm).raw(), t.raw(), t.nbytes()), 0) << nm << " differs";
  }
  EXPECT_EQ(buffers, name == "cnn_bn" ? 4 : 0);
}

INSTANTIATE_TEST_SUITE_P(Distributed, RanksVsAccumulation,
                         ::testing::Combine(::testing::Values("mlp_digits", "tiny_gpt", "cnn_bn"),
                                            ::testing::Values(2, 3, 4)),
                         model_ranks_name);

/// The final summary line of DIR/metrics.jsonl.
nlohmann::json summary_of(const std::string& dir) {
  std::ifstream f(dir + "/metrics.jsonl");
  nlohmann::json last;
  for (std::string line; std::getline(f, line);) {
    auto j = nlohmann::json::parse(line);
    if (j.contains("train_runtime")) last = j;
  }
  return last;
}

TEST(Distributed, CountersMatchTheBuckets) {
  require_setup();
  for (int n : {2, 3}) {
    const std::string dir = fresh_tmpdir("dp_count_" + std::to_string(n));
    // Buckets of at most 0.01 MiB (the first too), so the GPT has several.
    // Rank 0 alone prints the IR after data_parallel (the other ranks' flags differ only there).
    const std::string args = train_args(kGpt, kGpt.batch, 1, dir + "/ranks", "--ddp_bucket_cap_mb 0.01");
    auto dp = shell(kEnv + "timeout 300 mpirun --bind-to none -np 1 " + args +
                    " --print-ir-after=data_parallel : -np " + std::to_string(n - 1) + " " + args);
    ASSERT_EQ(dp.first, 0) << dp.second;
    // The buckets as the IR dump shows them (printed once per rank): elements per bucket.
    // The waits' outputs: one sum per bucket member (the start's token is input 0).
    std::regex node(R"(= AllReduceWait\(([^)]*)\) \{bucket=(\d+)\} : ([^#]*)#)");
    std::map<int64_t, int64_t> elements;  // bucket -> elements
    std::regex dims(R"(f32\[([0-9, ]*)\])");
    for (std::sregex_iterator it(dp.second.begin(), dp.second.end(), node), end; it != end; ++it) {
      const int64_t bucket = std::stoll((*it)[2]);
      if (elements.count(bucket)) continue;  // another rank's dump
      int64_t total = 0;
      const std::string types = (*it)[3];
      for (std::sregex_iterator d(types.begin(), types.end(), dims), e; d != e; ++d) {
        int64_t numel = 1;
        std::stringstream ss((*d)[1].str());
        for (std::string x; std::getline(ss, x, ',');)
          if (!x.empty()) numel *= std::stoll(x);
        total += numel;
      }
      elements[bucket] = total;
    }
    ASSERT_GE(elements.size(), 3u) << dp.second;
    double expect_bytes = 0;
    for (auto& [b, e] : elements) expect_bytes += 2.0 * (n - 1) * std::ceil(double(e) / n) * 4.0;
    const auto s = summary_of(dir + "/ranks");
    ASSERT_TRUE(s.contains("ddp_collectives_per_step")) << s.dump();
    EXPECT_EQ(s["ddp_world_size"].get<int>(), n);
    EXPECT_DOUBLE_EQ(s["ddp_collectives_per_step"].get<double>(), double(elements.size()));
    EXPECT_DOUBLE_EQ(s["ddp_bytes_sent_per_step"].get<double>(), expect_bytes);
    // 2(N-1)/N of the gradient bytes, up to each bucket's padding and the 4-byte loss.
    int64_t grad_elems = 0;
    for (auto& [b, e] : elements) grad_elems += e;
    const double ideal = 2.0 * (n - 1) / n * 4.0 * double(grad_elems);
    EXPECT_LE(std::abs(s["ddp_bytes_sent_per_step"].get<double>() - ideal), 2.0 * (n - 1) * 4.0 * elements.size());
  }
}

TEST(Distributed, CheckpointResumesOnOtherRankCounts) {
  require_setup();
  const std::string dir = fresh_tmpdir("dp_resume");
  // Uninterrupted: 2 ranks x 8 rows, 10 steps, saving at 5.
  auto full = run_ranks(2, train_args(kMlp, 8, 1, dir + "/full", "--save_steps 5"));
  ASSERT_EQ(full.first, 0) << full.second;
  ASSERT_TRUE(fs::exists(dir + "/full/checkpoint-5/model.safetensors"));
  const std::string ck = " --resume_from_checkpoint " + dir + "/full/checkpoint-5";
  // The same global batch of 16 rows on 1 process (2 microbatches of 8: the same sums as
  // the 2 ranks, so bit-exact) and on 4 ranks of 4 rows (other sums: within 1e-6).
  auto one = run_one(train_args(kMlp, 8, 2, dir + "/one", ck));
  ASSERT_EQ(one.first, 0) << one.second;
  auto four = run_ranks(4, train_args(kMlp, 4, 1, dir + "/four", ck));
  ASSERT_EQ(four.first, 0) << four.second;
  expect_bitwise_equal(weights(dir + "/one"), weights(dir + "/full"));
  expect_close(weights(dir + "/four"), weights(dir + "/full"), 1e-6, false, "resumed on 4 ranks");
  for (const char* d : {"/one", "/four"}) {  // the checkpoint's log history, then steps 6..10
    auto l = train_losses(dir + d), lf = train_losses(dir + "/full");
    ASSERT_EQ(l.size(), 10u) << d;
    for (auto& [step, v] : l) EXPECT_LE(std::abs(v - lf.at(step)), 1e-6 * std::abs(lf.at(step))) << d << step;
  }
  // Another global batch changes the data order: refused in one line.
  auto other = run_ranks(2, train_args(kMlp, 4, 1, dir + "/other", ck));
  EXPECT_NE(other.first, 0);
  EXPECT_NE(other.second.find("resuming would change the data order"), std::string::npos) << other.second;
}

TEST(Distributed, KilledRankEndsTheJob) {
  require_setup();
  const std::string dir = fresh_tmpdir("dp_kill");
  const std::string args = train_args(kMlp, 8, 1, dir + "/out", "--ddp_timeout 60") + " --max_steps 100000";
  // Rank 1 raises SIGKILL at its third step (the fault hook of tests/e2e/faults_test.cpp).
  // Rank 0 says what happened in one line (the launcher's own report around it).
  expect_job_fails(two_rank_job(args, "-x KILN_FAULT_KILL=step:3 " + args), 60.0,
                   R"(kiln \(rank 0 of 2\): error: [^\n]*SIGTERM while waiting for the other ranks[^\n]*)",
                   "the job did not end before the collective timeout:\n");
}

TEST(Distributed, OneRankJobAddsNothing) {
  require_setup();
  const std::string dir = fresh_tmpdir("dp_one");
  auto one = run_ranks(1, train_args(kMlp, 8, 1, dir + "/ranks", "--print-ir-after=all"));
  ASSERT_EQ(one.first, 0) << one.second;
  EXPECT_EQ(one.second.find("AllReduce"), std::string::npos);
  EXPECT_EQ(one.second.find("data parallel:"), std::string::npos);
}

class ZeroVsUnsharded : public ::testing::TestWithParam<std::tuple<std::string, std::string, int>> {};

// ZeRO-1 (--zero_stage 1) against the unsharded job, clipping on: the same updates element
// by element and the same global norm (block sums of whole 256-element blocks, gathered in
// parameter order: passes/optimizer.cpp), so weights and the consolidated optimizer state of
// the checkpoint are equal bit for bit; each rank holds 1/N of the state plus at most one
// 256-element block per tensor.
TEST_P(ZeroVsUnsharded, BitExactAndOneNthOfTheState) {
  require_setup();
  const auto [name, optim, n] = GetParam();
  const Model& m = name == "mlp_digits" ? kMlp : kGpt;
  const std::string dir = fresh_tmpdir("zero_" + name + "_" + optim + "_" + std::to_string(n));
  const std::string extra = "--optim " + optim + " --save_steps 10";
  auto plain = run_ranks(n, train_args(m, m.batch, 1, dir + "/plain", extra));
  ASSERT_EQ(plain.first, 0) << plain.second;
  auto zero = run_ranks(n, train_args(m, m.batch, 1, dir + "/zero", extra + " --zero_stage 1"));
  ASSERT_EQ(zero.first, 0) << zero.second;
  expect_bitwise_equal(weights(dir + "/zero"), weights(dir + "/plain"));
  auto opt = runtime::io::load_safetensors(dir + "/zero/checkpoint-10/optimizer.safetensors");
  auto opt1 = runtime::io::load_safetensors(dir + "/plain/checkpoint-10/optimizer.safetensors");
  ASSERT_TRUE(opt && opt1);
  expect_bitwise_equal(*opt, *opt1);  // same names, dims (the single-process layout) and bits
  // State per rank: the whole state / N, plus the padding of at most one block per tensor.
  double whole = 0, blocks = 0;
  for (auto& [k, t] : *opt1) {
    if (t.dims().empty()) continue;  // the step counter: not optimizer state
    whole += double(t.nbytes());
    blocks += 256.0 * double(ir::dtype_size(t.dtype()));
  }
  const double per_rank = summary_of(dir + "/zero")["ddp_optimizer_state_bytes"].get<double>();
  EXPECT_GE(per_rank, whole / n);
  EXPECT_LE(per_rank, whole / n + blocks);
  EXPECT_EQ(summary_of(dir + "/plain")["ddp_optimizer_state_bytes"].get<double>(), whole);
}

INSTANTIATE_TEST_SUITE_P(Distributed, ZeroVsUnsharded,
                         ::testing::Combine(::testing::Values("mlp_digits", "tiny_gpt"),
                                            ::testing::Values("adamw_torch", "adamw_8bit"), ::testing::Values(2, 3)),
                         [](const auto& info) {
                           return std::get<0>(info.param) + "_" + std::get<1>(info.param) + "_" +
                                  std::to_string(std::get<2>(info.param)) + "ranks";
                         });

TEST(Distributed, ZeroCheckpointResumesUnshardedAndOnOtherRanks) {
  require_setup();
  const std::string dir = fresh_tmpdir("zero_resume");
  const std::string extra = "--optim adamw_8bit --save_steps 5";
  auto full = run_ranks(2, train_args(kMlp, 8, 1, dir + "/full", extra + " --zero_stage 1"));
  ASSERT_EQ(full.first, 0) << full.second;
  const std::string ck = " --resume_from_checkpoint " + dir + "/full/checkpoint-5";
  // One process, unsharded, 2 microbatches of 8: the same sums, so bit-exact.
  auto one = run_one(train_args(kMlp, 8, 2, dir + "/one", extra + ck));
  ASSERT_EQ(one.first, 0) << one.second;
  expect_bitwise_equal(weights(dir + "/one"), weights(dir + "/full"));
  // 4 ranks of 4 rows, sharded 4 ways: other sums, within 1e-6.
  auto four = run_ranks(4, train_args(kMlp, 4, 1, dir + "/four", extra + " --zero_stage 1" + ck));
  ASSERT_EQ(four.first, 0) << four.second;
  expect_close(weights(dir + "/four"), weights(dir + "/full"), 1e-6, false, "resumed on 4 ranks");
}

// kiln inspect --memory under mpirun plans one rank of the job: its collectives, the bytes
// it sends and its optimizer state; the run's counters (runtime/comm.h) and state measure
// the same, with and without ZeRO-1.
TEST(Distributed, InspectPlansWhatTheRunMeasures) {
  require_setup();
  for (const std::string zero : {"0", "1"}) {
    const std::string dir = fresh_tmpdir("dp_inspect_" + zero);
    const std::string flags = " --zero_stage " + zero + " --optim adamw_8bit --ddp_bucket_cap_mb 0.05";
    auto run = run_ranks(3, train_args(kGpt, kGpt.batch, 1, dir + "/out", flags));
    ASSERT_EQ(run.first, 0) << run.second;
    auto plan = run_ranks(3, kBin + " inspect examples/tiny_gpt/model.onnx --memory --per_device_train_batch_size 4 " +
                                 "--train_data data/text/train.bin --block_size 64 --cache_dir " + cache_dir() + flags);
    ASSERT_EQ(plan.first, 0) << plan.second;
    std::smatch m;
    std::regex line(
        R"(data parallel, per rank of 3[^:]*: optimizer state [^(]*\((\d+) B\), (\d+) collectives and (\d+) B sent)");
    ASSERT_TRUE(std::regex_search(plan.second, m, line)) << plan.second;
    const auto s = summary_of(dir + "/out");
    EXPECT_EQ(s["ddp_optimizer_state_bytes"].get<double>(), std::stod(m[1])) << "zero_stage " << zero;
    EXPECT_EQ(s["ddp_collectives_per_step"].get<double>(), std::stod(m[2])) << "zero_stage " << zero;
    EXPECT_EQ(s["ddp_bytes_sent_per_step"].get<double>(), std::stod(m[3])) << "zero_stage " << zero;
    // Printed once (rank 0), not once per rank.
    EXPECT_EQ(plan.second.find("data parallel, per rank", m.position(0) + 1), std::string::npos);
  }
}

// kiln compile under mpirun builds a binary for that many ranks; DIR/train under mpirun
// trains as kiln train does, and refuses another rank count in one line.
TEST(Distributed, CompiledBinaryRunsUnderMpirun) {
  require_setup();
  const std::string dir = fresh_tmpdir("dp_aot");
  const std::string model = "examples/mlp_digits/model.onnx ";
  auto compiled = run_ranks(2, kBin + " compile " + model + kMlp.data +
                                   " --per_device_train_batch_size 8 --max_grad_norm 1 --learning_rate 3e-3 "
                                   "--weight_decay 0.01 --disable_dropout --seed 7 --cache_dir " +
                                   cache_dir() + " -o " + dir + "/bin");
  ASSERT_EQ(compiled.first, 0) << compiled.second;
  const std::string run_flags = " " + kMlp.data + " --max_steps 10 --logging_steps 1 --disable_tqdm --output_dir ";
  auto two = run_ranks(2, dir + "/bin/train" + run_flags + dir + "/aot");
  ASSERT_EQ(two.first, 0) << two.second;
  auto ref = run_ranks(2, train_args(kMlp, 8, 1, dir + "/train"));
  ASSERT_EQ(ref.first, 0) << ref.second;
  expect_bitwise_equal(weights(dir + "/aot"), weights(dir + "/train"));
  auto three = run_ranks(3, dir + "/bin/train" + run_flags + dir + "/three");
  EXPECT_NE(three.first, 0);
  EXPECT_NE(three.second.find("compiled for 2 rank(s) and runs on 3"), std::string::npos) << three.second;
}

// Dropout on (the tiny GPT's 0.1): rank r's microbatch is the job's microbatch r, so two
// ranks draw the masks of one process accumulating two microbatches, bit for bit.
TEST(Distributed, DropoutDrawsTheJobsMicrobatchMasks) {
  require_setup();
  const std::string dir = fresh_tmpdir("dp_dropout");
  auto args = [&](int64_t accum, const std::string& out) {
    std::string a = train_args(kGpt, kGpt.batch, accum, dir + out);
    a.replace(a.find("--disable_dropout "), std::string("--disable_dropout ").size(), "");
    return a;
  };
  auto ref = run_one(args(2, "/accum"));
  ASSERT_EQ(ref.first, 0) << ref.second;
  auto dp = run_ranks(2, args(1, "/ranks"));
  ASSERT_EQ(dp.first, 0) << dp.second;
  expect_bitwise_equal(weights(dir + "/ranks"), weights(dir + "/accum"));
  // Dropout is on: the same job without it trains to other weights.
  auto off = run_ranks(2, train_args(kGpt, kGpt.batch, 1, dir + "/off"));
  ASSERT_EQ(off.first, 0) << off.second;
  EXPECT_GT(rel_l2(weights(dir + "/off").at("transformer.h.0.attn.c_attn.weight"),
                   weights(dir + "/ranks").at("transformer.h.0.attn.c_attn.weight")),
            1e-6);
}

// A rank that hangs (SIGSTOP at its third step): the other fails after --ddp_timeout with
// one line naming the collective, and the launcher ends the job.
TEST(Distributed, HungRankTimesOut) {
  require_setup();
  const std::string dir = fresh_tmpdir("dp_hang");
  const std::string args = train_args(kMlp, 8, 1, dir + "/out", "--ddp_timeout 3") + " --max_steps 100000";
  expect_job_fails(two_rank_job(args, "-x KILN_FAULT_STOP=step:3 " + args), 60.0,
                   R"(kiln \(rank 0 of 2\): error: [^\n]*no answer from the other ranks within --ddp_timeout 3 s)");
}

class GradientsVsOneProcess : public ::testing::TestWithParam<std::tuple<std::string, int>> {};

// `mpirun -np N kiln grad`: the job's summed gradients of the first N*b rows (rank r on the
// r-th b rows) against one process's gradients of the same N*b rows (cnn_bn: accumulating N
// microbatches of b, since BatchNorm normalizes per rank), each within 1e-6 of its norm.
TEST_P(GradientsVsOneProcess, Within1e6) {
  require_setup();
  const auto [name, n] = GetParam();
  const Model& m = model_named(name);
  const bool bn = name == "cnn_bn";
  const std::string dir = fresh_tmpdir("dp_grad_" + name + "_" + std::to_string(n));
  auto cmd = [&](int64_t batch, int64_t accum, const std::string& out) {
    return kBin + " grad examples/" + m.name + "/model.onnx " + m.data + " --per_device_train_batch_size " +
           std::to_string(batch) + " --gradient_accumulation_steps " + std::to_string(accum) +
           " --disable_dropout --cache_dir " + cache_dir() + " --out " + out;
  };
  auto job = run_ranks(n, cmd(m.batch, 1, dir + "/ranks.safetensors"));
  ASSERT_EQ(job.first, 0) << job.second;
  auto one = run_one(cmd(bn ? m.batch : n * m.batch, bn ? n : 1, dir + "/one.safetensors"));
  ASSERT_EQ(one.first, 0) << one.second;
  auto g = runtime::io::load_safetensors(dir + "/ranks.safetensors");
  auto g1 = runtime::io::load_safetensors(dir + "/one.safetensors");
  ASSERT_TRUE(g && g1);
  EXPECT_EQ(g->size(), g1->size());
  expect_close(*g, *g1, 1e-6, false, name + " gradients");
}

INSTANTIATE_TEST_SUITE_P(Distributed, GradientsVsOneProcess,
                         ::testing::Combine(::testing::Values("mlp_digits", "tiny_gpt", "cnn_bn"),
                                            ::testing::Values(2, 3, 4)),
                         model_ranks_name);

// kiln bench under mpirun: every rank times the same variants; rank 0 prints, per variant,
// the collectives and bytes the communication layer counted next to the program's plan.
TEST(Distributed, BenchReportsCommunicationPerRank) {
  require_setup();
  for (const std::string zero : {"0", "1"}) {
    auto r = run_ranks(2, kBin + " bench examples/mlp_digits/model.onnx --per_device_train_batch_size 8 " +
                              "--backend eager,compiled --bench_steps 3 --cache_dir " + cache_dir() + " --zero_stage " +
                              zero);
    ASSERT_EQ(r.first, 0) << r.second;
    std::regex line(
        R"(data parallel \((eager|compiled), per rank of 2[^)]*\): optimizer state [^,]*, ([0-9.]+) collectives \(planned (\d+)\) and (\d+) B sent \(planned (\d+)\) per step)");
    int seen = 0;
    for (std::sregex_iterator it(r.second.begin(), r.second.end(), line), end; it != end; ++it, ++seen) {
      EXPECT_EQ(std::stod((*it)[2]), std::stod((*it)[3])) << (*it)[0];
      EXPECT_EQ((*it)[4], (*it)[5]) << (*it)[0];
    }
    EXPECT_EQ(seen, 2) << r.second;  // one line per variant, printed by rank 0 only
  }
}

class MixedPrecisionRanks : public ::testing::TestWithParam<std::string> {};

// --bf16 and --fp16 (loss scaling: the overflow check reads the summed gradients, so every
// rank skips the same steps) on 2 ranks against one process accumulating 2 microbatches:
// bit-exact losses and weights.
TEST_P(MixedPrecisionRanks, BitExactAgainstAccumulation) {
  require_setup();
  const std::string flag = GetParam();
  const std::string dir = fresh_tmpdir("dp_" + flag);
  auto ref = run_one(train_args(kGpt, kGpt.batch, 2, dir + "/accum", "--" + flag));
  ASSERT_EQ(ref.first, 0) << ref.second;
  auto dp = run_ranks(2, train_args(kGpt, kGpt.batch, 1, dir + "/ranks", "--" + flag));
  ASSERT_EQ(dp.first, 0) << dp.second;
  auto a = train_losses(dir + "/ranks"), b = train_losses(dir + "/accum");
  ASSERT_EQ(a.size(), 10u);
  for (auto& [step, l] : b) EXPECT_EQ(a.at(step), l) << "step " << step;
  expect_bitwise_equal(weights(dir + "/ranks"), weights(dir + "/accum"));
}

INSTANTIATE_TEST_SUITE_P(Distributed, MixedPrecisionRanks, ::testing::Values("bf16", "fp16"));

// An error on one rank only (here its data file is missing) ends the job within seconds
// with that rank's one line, instead of leaving the other waiting in a collective.
TEST(Distributed, ErrorOnOneRankEndsTheJob) {
  require_setup();
  const std::string dir = fresh_tmpdir("dp_error");
  const std::string args = train_args(kMlp, 8, 1, dir + "/out");
  std::string bad = args;
  bad.replace(bad.find("data/digits/x_train.npy"), std::string("data/digits/x_train.npy").size(), "no/such.npy");
  expect_job_fails(two_rank_job(args, bad), 30.0, R"(kiln \(rank 1 of 2\): error: [^\n]*no/such\.npy)");
}

// --print-ir-after and the log lines come from rank 0 only.
TEST(Distributed, Rank0AlonePrints) {
  require_setup();
  const std::string dir = fresh_tmpdir("dp_print");
  auto r = run_ranks(2, train_args(kMlp, 8, 1, dir + "/out", "--print-ir-after data_parallel"));
  ASSERT_EQ(r.first, 0) << r.second;
  auto count = [&](const std::string& what) {
    size_t n = 0;
    for (size_t at = r.second.find(what); at != std::string::npos; at = r.second.find(what, at + 1)) ++n;
    return n;
  };
  EXPECT_EQ(count("IR after data_parallel"), 1u) << r.second;
  EXPECT_EQ(count("step 10/10"), 1u) << r.second;
  EXPECT_EQ(count("data parallel: 2 ranks"), 1u) << r.second;
}

}  // namespace

namespace {

// Bad data-parallel flags: one line naming the flag, a non-zero exit, nothing left behind.
TEST(Distributed, BadFlagsGiveOneLineAndLeaveNothing) {
  require_setup();
  const std::string dir = fresh_tmpdir("dp_bad");
  const std::pair<const char*, const char*> cases[] = {{"--zero_stage 2", "--zero_stage"},
                                                       {"--ddp_timeout 0", "--ddp_timeout"},
                                                       {"--ddp_bucket_cap_mb -1", "--ddp_bucket_cap_mb"}};
  for (const auto& [flag, name] : cases) {
    const std::string out = dir + "/out";
    auto r = run_one(train_args(kMlp, 8, 1, out, flag));
    EXPECT_EQ(r.first, 2) << flag << ": " << r.second;
    EXPECT_NE(r.second.find(std::string("kiln: error: ") + name), std::string::npos) << r.second;
    EXPECT_EQ(std::count(r.second.begin(), r.second.end(), '\n'), 1) << r.second;
    EXPECT_FALSE(fs::exists(out)) << flag;
  }
  // Refused by the job itself (the last partial batch cannot split over the ranks): one
  // line per rank, exit 1, no output folder.
  const std::string out = dir + "/drop";
  auto r = run_ranks(2, train_args(kMlp, 8, 1, out, "--dataloader_drop_last false"));
  EXPECT_NE(r.first, 0) << r.second;
  EXPECT_NE(r.second.find("--dataloader_drop_last false is not supported in a data-parallel job"), std::string::npos)
      << r.second;
  EXPECT_FALSE(fs::exists(out)) << r.second;
}

}  // namespace
