// Tests of the `kiln` binary: bad input gives exactly one `kiln: error: ...` line on
// stderr and exit code 2 (usage) or 1 (run time); inspect/run/train on a tiny linear
// classifier built here with the ONNX protobuf classes (reference: float64 x@W+b).
#include <gtest/gtest.h>
#include <onnx/onnx_pb.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cmath>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <sstream>

#include "runtime/io.h"

using namespace kiln;
namespace fs = std::filesystem;

namespace {

const std::string kBin = std::string(KILN_BINARY_DIR) + "/bin/kiln";
constexpr int64_t D = 4, C = 3, N = 24;

float w_at(int64_t i) { return 0.1f * static_cast<float>(i % 7) - 0.3f; }
float b_at(int64_t i) { return 0.05f * static_cast<float>(i); }

/// x (batch, 4) f32 -> MatMul W (4, 3) -> Add b (3) -> logits (batch, 3).
void write_model(const std::string& path) {
  onnx::ModelProto m;
  m.set_ir_version(8);
  m.set_producer_name("kiln cli_test");
  m.add_opset_import()->set_version(17);
  auto* g = m.mutable_graph();
  g->set_name("linear");
  auto add_vi = [](onnx::ValueInfoProto* vi, const std::string& name, std::vector<std::string> sym,
                   std::vector<int64_t> dims) {
    vi->set_name(name);
    auto* tt = vi->mutable_type()->mutable_tensor_type();
    tt->set_elem_type(onnx::TensorProto::FLOAT);
    for (size_t i = 0; i < dims.size(); ++i) {
      auto* d = tt->mutable_shape()->add_dim();
      if (!sym[i].empty())
        d->set_dim_param(sym[i]);
      else
        d->set_dim_value(dims[i]);
    }
  };
  add_vi(g->add_input(), "x", {"batch", ""}, {0, D});
  add_vi(g->add_output(), "logits", {"batch", ""}, {0, C});
  auto* W = g->add_initializer();
  W->set_name("W");
  W->set_data_type(onnx::TensorProto::FLOAT);
  W->add_dims(D);
  W->add_dims(C);
  for (int64_t i = 0; i < D * C; ++i) W->add_float_data(w_at(i));
  auto* b = g->add_initializer();
  b->set_name("b");
  b->set_data_type(onnx::TensorProto::FLOAT);
  b->add_dims(C);
  for (int64_t i = 0; i < C; ++i) b->add_float_data(b_at(i));
  auto* mm = g->add_node();
  mm->set_op_type("MatMul");
  mm->set_name("matmul");
  mm->add_input("x");
  mm->add_input("W");
  mm->add_output("xw");
  auto* add = g->add_node();
  add->set_op_type("Add");
  add->set_name("add");
  add->add_input("xw");
  add->add_input("b");
  add->add_output("logits");
  std::ofstream f(path, std::ios::binary);
  ASSERT_TRUE(m.SerializeToOstream(&f));
}

struct Result {
  int code;
  std::string err, out;
};

Result run_kiln(const std::string& args, const std::string& dir) {
  std::string cmd = kBin + " " + args + " >" + dir + "/stdout.txt 2>" + dir + "/stderr.txt";
  int st = std::system(cmd.c_str());
  Result r;
  r.code = WIFEXITED(st) ? WEXITSTATUS(st) : 128;
  std::ifstream e(dir + "/stderr.txt"), o(dir + "/stdout.txt");
  std::stringstream es, os;
  es << e.rdbuf();
  os << o.rdbuf();
  r.err = es.str();
  r.out = os.str();
  return r;
}

/// One line, starting with "kiln: error: ".
void expect_one_error_line(const Result& r, int code, const std::string& needle) {
  EXPECT_EQ(r.code, code) << r.err;
  EXPECT_EQ(r.err.rfind("kiln: error: ", 0), 0u) << r.err;
  EXPECT_EQ(std::count(r.err.begin(), r.err.end(), '\n'), 1) << r.err;
  EXPECT_NE(r.err.find(needle), std::string::npos) << "'" << needle << "' not in: " << r.err;
}

/// An empty folder for the running test: PREFIX_<pid>_<test name> in the temp folder.
std::string fresh_test_dir(const std::string& prefix) {
  const std::string dir =
      (fs::temp_directory_path() /
       (prefix + std::to_string(getpid()) + "_" + ::testing::UnitTest::GetInstance()->current_test_info()->name()))
          .string();
  fs::remove_all(dir);
  fs::create_directories(dir);
  return dir;
}

class Cli : public ::testing::Test {
 protected:
  void SetUp() override {
    dir = fresh_test_dir("kiln_cli_test_");
    model = dir + "/linear.onnx";
    write_model(model);
    ir::Tensor x(ir::DType::f32, {N, D}), y(ir::DType::i64, {N});
    for (int64_t i = 0; i < N; ++i) {
      y.data<int64_t>()[i] = i % C;
      for (int64_t j = 0; j < D; ++j)
        x.data<float>()[i * D + j] = static_cast<float>(std::sin(0.7 * i + j) + (j == i % C ? 1.0 : 0.0));
    }
    ASSERT_TRUE(runtime::io::save_npy(dir + "/x.npy", x).is_ok());
    ASSERT_TRUE(runtime::io::save_npy(dir + "/y.npy", y).is_ok());
    ASSERT_TRUE(runtime::io::save_npy(dir + "/y_float.npy", y.cast(ir::DType::f32)).is_ok());
    ASSERT_TRUE(runtime::io::save_npy(dir + "/x5.npy", ir::Tensor(ir::DType::f32, {N, 5})).is_ok());
    xdata = x;
  }
  void TearDown() override { fs::remove_all(dir); }
  std::string data() const { return " --train_data x=" + dir + "/x.npy --train_data labels=" + dir + "/y.npy"; }
  std::string dir, model;
  ir::Tensor xdata;
};

}  // namespace

TEST_F(Cli, UnknownFlag) {
  auto r = run_kiln("train " + model + data() + " --no_such_flag 3", dir);
  expect_one_error_line(r, 2, "--no_such_flag");
}

TEST_F(Cli, BadOptionValue) {
  expect_one_error_line(run_kiln("train " + model + data() + " --optim foo --output_dir " + dir + "/o", dir), 2,
                        "--optim: unknown value 'foo'");
  expect_one_error_line(run_kiln("train " + model + data() + " --learning_rate abc", dir), 2, "--learning_rate");
  expect_one_error_line(run_kiln("train " + model + data() + " --gradient_accumulation_steps 0", dir), 2,
                        "--gradient_accumulation_steps: must be > 0");
  expect_one_error_line(run_kiln("train " + model + data() + " --per_device_train_batch_size 0", dir), 2,
                        "per_device_train_batch_size");
}

TEST_F(Cli, ContradictoryMemoryFlags) {
  expect_one_error_line(run_kiln("inspect " + model + " --memory --memory_budget 1MB", dir), 2,
                        "--memory_budget: only applies to --remat_policy budget");
  expect_one_error_line(run_kiln("inspect " + model + " --memory --gradient_checkpointing --remat_policy none", dir), 2,
                        "contradicts --gradient_checkpointing");
  expect_one_error_line(run_kiln("inspect " + model + " --memory --remat_policy budget --memory_budget 0.4", dir), 2,
                        "got '0.4'");
  expect_one_error_line(run_kiln("inspect " + model + " --memory --precision", dir), 2,
                        "give one of --memory and --precision");
}

TEST_F(Cli, PrecisionFlagErrors) {
  expect_one_error_line(run_kiln("train " + model + data() + " --bf16 --fp16 --output_dir " + dir + "/o", dir), 2,
                        "--fp16");
  expect_one_error_line(
      run_kiln("train " + model + data() + " --fp16 --fp16_init_scale 0 --output_dir " + dir + "/o", dir), 2,
      "--fp16_init_scale: must be a finite number > 0");
  expect_one_error_line(run_kiln("inspect " + model + " --precision --fp16 --fp16_growth_interval 0", dir), 2,
                        "--fp16_growth_interval: must be > 0");
}

TEST_F(Cli, BackendFlagErrors) {
  expect_one_error_line(run_kiln("train " + model + data() + " --backend jit --output_dir " + dir + "/o", dir), 2,
                        "--backend: unknown value 'jit'");
  expect_one_error_line(run_kiln("bench " + model + " --backend eager,foo", dir), 2, "--backend: unknown value 'foo'");
  expect_one_error_line(
      run_kiln("train " + model + data() + " --backend eager,compiled --output_dir " + dir + "/o", dir), 2,
      "one backend per program");
}

/// kiln bench --remat_policy a,b: one program per policy (times backend), steps
/// interleaved, one row per variant; train takes one policy only.
TEST_F(Cli, BenchRematPolicyList) {
  const std::string base =
      "bench " + model + data() + " --per_device_train_batch_size 4 --warmup_steps_bench 1 --bench_steps 2";
  auto r = run_kiln(base + " --backend eager --remat_policy none,sqrt", dir);
  ASSERT_EQ(r.code, 0) << r.err << r.out;
  EXPECT_NE(r.out.find("steps alternate between variants"), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("\nvariant "), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("\nnone "), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("\nsqrt "), std::string::npos) << r.out;
  auto both = run_kiln(base + " --backend eager,compiled --remat_policy none,sqrt", dir);
  ASSERT_EQ(both.code, 0) << both.err << both.out;
  for (const char* v : {"\neager/none ", "\neager/sqrt ", "\ncompiled/none ", "\ncompiled/sqrt "})
    EXPECT_NE(both.out.find(v), std::string::npos) << v << " missing in\n" << both.out;
  // --memory_budget goes to the budget variant only.
  auto budget = run_kiln(base + " --backend eager --remat_policy none,budget --memory_budget 1GiB", dir);
  ASSERT_EQ(budget.code, 0) << budget.err << budget.out;
  EXPECT_NE(budget.out.find("\nbudget "), std::string::npos) << budget.out;
  expect_one_error_line(run_kiln(base + " --remat_policy none,sqrt --memory_budget 1GiB", dir), 2,
                        "only applies to --remat_policy budget");
  expect_one_error_line(run_kiln(base + " --remat_policy none,bogus", dir), 2, "--remat_policy: unknown value 'bogus'");
  expect_one_error_line(run_kiln(base + " --remat_policy none,", dir), 2, "--remat_policy: empty item");
  expect_one_error_line(run_kiln(base + " --backend ,eager", dir), 2, "--backend: empty item");
  expect_one_error_line(
      run_kiln("train " + model + data() + " --remat_policy none,sqrt --output_dir " + dir + "/o", dir), 2,
      "one policy per program");
}

/// `kiln bench --optim a,b`: one program per optimizer, steps alternating, a row and a
/// profile section each; other commands take one optimizer.
TEST_F(Cli, BenchOptimList) {
  const std::string base =
      "bench " + model + data() + " --per_device_train_batch_size 4 --warmup_steps_bench 1 --bench_steps 2";
  auto r = run_kiln(base + " --backend eager --optim sgd,adamw_torch --profile", dir);
  ASSERT_EQ(r.code, 0) << r.err << r.out;
  EXPECT_NE(r.out.find("steps alternate between variants"), std::string::npos) << r.out;
  for (const char* v : {"\nsgd ", "\nadamw_torch ", "profile (sgd)", "profile (adamw_torch)"})
    EXPECT_NE(r.out.find(v), std::string::npos) << v << " missing in\n" << r.out;
  auto both = run_kiln(base + " --backend eager,compiled --optim sgd,adamw_torch", dir);
  ASSERT_EQ(both.code, 0) << both.err << both.out;
  for (const char* v : {"\neager/sgd ", "\neager/adamw_torch ", "\ncompiled/sgd ", "\ncompiled/adamw_torch "})
    EXPECT_NE(both.out.find(v), std::string::npos) << v << " missing in\n" << both.out;
  expect_one_error_line(run_kiln(base + " --optim sgd,adam", dir), 2, "--optim: unknown value 'adam'");
  expect_one_error_line(
      run_kiln("train " + model + data() + " --optim sgd,adamw_torch --output_dir " + dir + "/o", dir), 2,
      "one optimizer per program");
}

/// Resuming with another optimizer would drop the checkpoint's optimizer state: refused,
/// and the checkpoint stays.
TEST_F(Cli, ResumeWithAnotherOptimizerIsRefused) {
  // Trains 2 steps with `first` into `out`, then resumes with `second`: one error line.
  auto refused = [&](const std::string& first, const std::string& second, const std::string& out,
                     const std::string& expected) {
    auto r = run_kiln("train " + model + data() + " --optim " + first +
                          " --per_device_train_batch_size 4 --max_steps 2"
                          " --save_steps 2 --output_dir " +
                          out,
                      dir);
    ASSERT_EQ(r.code, 0) << r.err << r.out;
    expect_one_error_line(run_kiln("train " + model + data() + " --optim " + second +
                                       " --per_device_train_batch_size 4 --max_steps 4 --output_dir " + out +
                                       " --resume_from_checkpoint latest",
                                   dir),
                          1, expected);
  };
  std::string out = dir + "/run";
  refused("adamw_torch", "sgd", out, "is not state of this training program");
  EXPECT_TRUE(fs::exists(out + "/checkpoint-2/optimizer.safetensors"));
  // The other direction: the program needs optimizer state the checkpoint lacks.
  refused("sgd", "adamw_torch", dir + "/run_sgd",
          "(optimizer_state) in optimizer.safetensors; the checkpoint was written with --optim sgd (this run: "
          "adamw_torch)");
}

TEST_F(Cli, ConfigFileUnknownKeyAndFlagOverride) {
  std::ofstream(dir + "/cfg.json") << R"({"optim": "sgd", "lerning_rate": 0.1})";
  expect_one_error_line(run_kiln("train " + model + data() + " --config " + dir + "/cfg.json", dir), 2,
                        "unknown key 'lerning_rate'");
  // The flag overrides the file's (bad) value, so the run gets past validation to the data check.
  std::ofstream(dir + "/cfg2.json") << R"({"optim": "foo", "output_dir": ")" + dir + R"(/o"})";
  auto r = run_kiln("train " + model + " --train_data x=" + dir + "/x5.npy --train_data labels=" + dir +
                        "/y.npy --config " + dir + "/cfg2.json --optim sgd",
                    dir);
  expect_one_error_line(r, 1, "x5.npy");
}

TEST_F(Cli, MissingDataFile) {
  auto r = run_kiln("train " + model + " --train_data x=" + dir + "/nope.npy --train_data labels=" + dir +
                        "/y.npy --output_dir " + dir + "/o",
                    dir);
  expect_one_error_line(r, 1, "nope.npy");
}

TEST_F(Cli, EvalStepsWithoutEvalData) {
  // An eval schedule with nothing to evaluate on is an error (as in Hugging Face's
  // Trainer), not a silently skipped evaluation.
  expect_one_error_line(run_kiln("train " + model + data() + " --eval_steps 2 --output_dir " + dir + "/o", dir), 2,
                        "--eval_steps 2: no --eval_data");
  // A config file's eval schedule with the eval data emptied on the command line
  // (`--eval_data ""`): evaluation is off and the run trains.
  std::ofstream(dir + "/cfg.json") << R"({"eval_steps": 2, "eval_data": ["x=)" + dir + R"(/x.npy"]})";
  auto r = run_kiln("train " + model + data() + " --config " + dir + "/cfg.json --eval_data '' --max_steps 2 " +
                        "--per_device_train_batch_size 4 --output_dir " + dir + "/o2",
                    dir);
  EXPECT_EQ(r.code, 0) << r.err;
  EXPECT_EQ(r.out.find("eval_loss"), std::string::npos) << r.out;
  // An empty item empties the list whatever came before it on the command line.
  auto r2 =
      run_kiln("train " + model + data() + " --eval_data x=" + dir + "/x.npy --eval_data labels=" + dir +
                   "/y.npy --eval_data '' --max_steps 2 --per_device_train_batch_size 4 --output_dir " + dir + "/o4",
               dir);
  EXPECT_EQ(r2.code, 0) << r2.err;
  EXPECT_EQ(r2.out.find("eval_loss"), std::string::npos) << r2.out;
  // ... and with --eval_steps also on the command line, the contradiction is refused.
  expect_one_error_line(run_kiln("train " + model + data() + " --config " + dir + "/cfg.json --eval_data '' " +
                                     "--eval_steps 3 --output_dir " + dir + "/o3",
                                 dir),
                        2, "--eval_steps 3: no --eval_data");
}

TEST_F(Cli, ShapeBatchMustBeTheBatchSize) {
  // --shape batch=N fixes the batch dim: with another batch size the run is refused
  // before anything compiles, naming both flags; the same value is accepted.
  expect_one_error_line(
      run_kiln("train " + model + data() + " --per_device_train_batch_size 4 --shape batch=16 " + "--output_dir " +
                   dir + "/o",
               dir),
      1, "--shape batch=16: 'batch' is the batch dim of input 'x', and --per_device_train_batch_size is 4");
  // The same value works (the eval batch size, default 8, matters only with eval data).
  auto ok = run_kiln("train " + model + data() + " --per_device_train_batch_size 4 --shape batch=4 --max_steps 2 " +
                         "--output_dir " + dir + "/o2",
                     dir);
  EXPECT_EQ(ok.code, 0) << ok.err;
  expect_one_error_line(
      run_kiln("train " + model + data() + " --eval_data x=" + dir + "/x.npy --eval_data labels=" + dir +
                   "/y.npy --per_device_train_batch_size 4 --shape batch=4 --output_dir " + dir + "/o3",
               dir),
      1, "and --per_device_eval_batch_size is 8");
}

TEST_F(Cli, FreezeMatchingNothingIsRefused) {
  // A --freeze pattern that matches no parameter (a typo) would silently train them all.
  expect_one_error_line(run_kiln("train " + model + data() + " --freeze '^nomatch' --output_dir " + dir + "/o", dir), 1,
                        "--freeze '^nomatch' matches no parameter");
}

TEST_F(Cli, MissingModelFile) {
  expect_one_error_line(run_kiln("train " + dir + "/none.onnx" + data(), dir), 1, "none.onnx");
}

TEST_F(Cli, WrongLabelDtype) {
  auto r = run_kiln("train " + model + " --train_data x=" + dir + "/x.npy --train_data labels=" + dir +
                        "/y_float.npy --output_dir " + dir + "/o",
                    dir);
  expect_one_error_line(r, 1, "y_float.npy");
  EXPECT_NE(r.err.find("integer"), std::string::npos);
}

TEST_F(Cli, LabelsOutsideTheClassesFailBeforeTraining) {
  // A label the model has no class for is refused before the first step, naming the
  // flag, the file and the row, for training and for eval data (which would otherwise
  // stop the run at its first evaluation, after the training); ignore_index passes.
  ir::Tensor bad(ir::DType::i64, {N});
  for (int64_t i = 0; i < N; ++i) bad.data<int64_t>()[i] = i % C;
  bad.data<int64_t>()[3] = -100;  // ignore_index: allowed
  ASSERT_TRUE(runtime::io::save_npy(dir + "/y_ignored.npy", bad).is_ok());
  bad.data<int64_t>()[7] = C;
  ASSERT_TRUE(runtime::io::save_npy(dir + "/y_bad.npy", bad).is_ok());
  const std::string base =
      "train " + model + " --max_steps 50 --per_device_train_batch_size 4 --output_dir " + dir + "/o";
  auto r = run_kiln(base + data() + " --eval_data x=" + dir + "/x.npy --eval_data labels=" + dir + "/y_bad.npy", dir);
  expect_one_error_line(r, 1, "--eval_data: labels=" + dir + "/y_bad.npy: label " + std::to_string(C) + " at row 7");
  EXPECT_EQ(r.out.find("step"), std::string::npos) << "trained before refusing:\n" << r.out;
  auto t = run_kiln(base + " --train_data x=" + dir + "/x.npy --train_data labels=" + dir + "/y_bad.npy", dir);
  expect_one_error_line(t, 1, "--train_data: labels=" + dir + "/y_bad.npy: label " + std::to_string(C));
  auto ok = run_kiln(
      base + " --max_steps 2 --train_data x=" + dir + "/x.npy --train_data labels=" + dir + "/y_ignored.npy", dir);
  EXPECT_EQ(ok.code, 0) << ok.err;
}

TEST_F(Cli, DataShapeMismatch) {
  auto r = run_kiln("train " + model + " --train_data x=" + dir + "/x5.npy --train_data labels=" + dir +
                        "/y.npy --output_dir " + dir + "/o",
                    dir);
  expect_one_error_line(r, 1, "x5.npy");
  EXPECT_NE(r.err.find("[24, 5]"), std::string::npos) << r.err;
}

TEST_F(Cli, UnwritableOutputDir) {
  expect_one_error_line(run_kiln("train " + model + data() + " --output_dir /proc/kiln_test", dir), 1,
                        "/proc/kiln_test");
}

TEST_F(Cli, InspectListsInputsParametersAndOps) {
  auto r = run_kiln("inspect " + model + " --shape batch=8", dir);
  ASSERT_EQ(r.code, 0) << r.err;
  EXPECT_NE(r.out.find("x  f32"), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("parameters: 15 "), std::string::npos) << r.out;  // 4*3 + 3
  EXPECT_NE(r.out.find("MatMul 1"), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("forward FLOPs"), std::string::npos) << r.out;
}

TEST_F(Cli, RunWritesOutputsMatchingFloat64Reference) {
  auto r = run_kiln("run " + model + " --input x=" + dir + "/x.npy --output_dir " + dir + "/out", dir);
  ASSERT_EQ(r.code, 0) << r.err;
  auto y = runtime::io::load_npy(dir + "/out/logits.npy");
  ASSERT_TRUE(y) << y.message();
  ASSERT_EQ(y->dims(), (std::vector<int64_t>{N, C}));
  for (int64_t i = 0; i < N; ++i)
    for (int64_t c = 0; c < C; ++c) {
      double ref = b_at(c);
      for (int64_t j = 0; j < D; ++j) ref += static_cast<double>(xdata.data<float>()[i * D + j]) * w_at(j * C + c);
      EXPECT_NEAR(y->get_f64(i * C + c), ref, 1e-5) << i << "," << c;
    }
  expect_one_error_line(run_kiln("run " + model + " --input q=" + dir + "/x.npy --output_dir " + dir + "/out", dir), 1,
                        "no input 'q'");
}

TEST_F(Cli, TrainWritesMetricsCheckpointsAndModel) {
  std::string out = dir + "/run";
  auto r = run_kiln("train " + model + data() + " --eval_data x=" + dir + "/x.npy --eval_data labels=" + dir +
                        "/y.npy --optim sgd --learning_rate 0.5 --per_device_train_batch_size 4 --max_steps 12"
                        " --logging_steps 3 --save_steps 6 --save_total_limit 1 --output_dir " +
                        out,
                    dir);
  ASSERT_EQ(r.code, 0) << r.err << r.out;
  EXPECT_TRUE(fs::exists(out + "/metrics.jsonl"));
  EXPECT_TRUE(fs::exists(out + "/checkpoint-12/model.safetensors"));
  EXPECT_FALSE(fs::exists(out + "/checkpoint-6"));  // save_total_limit 1
  EXPECT_TRUE(fs::exists(out + "/model.onnx"));
  EXPECT_NE(r.out.find("eval_loss"), std::string::npos) << r.out;
  // The exported model holds the trained weights: they differ from the initial ones.
  auto w = runtime::io::load_safetensors(out + "/model.safetensors");
  ASSERT_TRUE(w) << w.message();
  ASSERT_TRUE(w->count("W"));
  double diff = 0;
  for (int64_t i = 0; i < D * C; ++i) diff += std::fabs(w->at("W").get_f64(i) - w_at(i));
  EXPECT_GT(diff, 1e-3);
  // and model.onnx runs with them.
  auto rr = run_kiln("run " + out + "/model.onnx --input x=" + dir + "/x.npy --output_dir " + dir + "/out2", dir);
  ASSERT_EQ(rr.code, 0) << rr.err;
}

TEST_F(Cli, GradMatchesFloat64Reference) {
  // Reference: mean softmax cross-entropy of x[:B] @ W + b, gradients in float64.
  const int64_t B = 8;
  std::vector<double> gW(D * C, 0.0), gb(C, 0.0);
  double loss = 0;
  for (int64_t i = 0; i < B; ++i) {
    double z[C], mx = -1e300, s = 0;
    for (int64_t c = 0; c < C; ++c) {
      z[c] = b_at(c);
      for (int64_t j = 0; j < D; ++j) z[c] += static_cast<double>(xdata.data<float>()[i * D + j]) * w_at(j * C + c);
      mx = std::max(mx, z[c]);
    }
    for (int64_t c = 0; c < C; ++c) s += std::exp(z[c] - mx);
    int64_t y = i % C;
    loss += (mx + std::log(s) - z[y]) / B;
    for (int64_t c = 0; c < C; ++c) {
      double d = (std::exp(z[c] - mx) / s - (c == y)) / B;
      gb[c] += d;
      for (int64_t j = 0; j < D; ++j) gW[j * C + c] += static_cast<double>(xdata.data<float>()[i * D + j]) * d;
    }
  }
  for (bool f64 : {true, false}) {
    std::string out = dir + (f64 ? "/g64.safetensors" : "/g32.safetensors");
    auto r = run_kiln(
        "grad " + model + data() + " --per_device_train_batch_size 8 --out " + out + (f64 ? " --float64" : ""), dir);
    ASSERT_EQ(r.code, 0) << r.err;
    auto g = runtime::io::load_safetensors(out);
    ASSERT_TRUE(g) << g.message();
    const double tol = f64 ? 1e-12 : 2e-6;
    EXPECT_EQ(g->at("W").dtype(), f64 ? ir::DType::f64 : ir::DType::f32);
    EXPECT_NEAR(g->at("loss").get_f64(0), loss, tol);
    for (int64_t i = 0; i < D * C; ++i) EXPECT_NEAR(g->at("W").get_f64(i), gW[i], tol) << "W " << i;
    for (int64_t i = 0; i < C; ++i) EXPECT_NEAR(g->at("b").get_f64(i), gb[i], tol) << "b " << i;
  }
  expect_one_error_line(run_kiln("grad " + model + data(), dir), 2, "--out");
}

/// `kiln compile` bad input: one line each, exit 2 for usage, 1 at run time; nothing
/// half-written is reported as a success.
TEST_F(Cli, CompileFlagErrors) {
  expect_one_error_line(run_kiln("compile " + model + " --max_steps 2", dir), 2, "-o DIR is required");
  expect_one_error_line(run_kiln("compile " + model + " -o " + dir + "/c", dir), 1, "give --max_steps or --train_data");
  expect_one_error_line(run_kiln("compile " + model + " --backend eager --max_steps 2 -o " + dir + "/c", dir), 2,
                        "--backend eager cannot be compiled ahead of time");
  expect_one_error_line(run_kiln("compile " + model + " --max_steps 2 --train_data x=" + dir +
                                     "/x5.npy --train_data labels=" + dir + "/y.npy -o " + dir + "/c",
                                 dir),
                        1, "--train_data");
  expect_one_error_line(run_kiln("compile " + dir + "/none.onnx --max_steps 2 -o " + dir + "/c", dir), 1,
                        "no such file");
  EXPECT_FALSE(fs::exists(dir + "/c/train"));
}

/// The linear model compiled ahead of time: the binary trains and writes kiln train's outputs.
TEST_F(Cli, CompiledLinearBinaryTrains) {
  auto c = run_kiln(
      "compile " + model + data() + " --max_steps 3 --per_device_train_batch_size 8 --no_cache -o " + dir + "/c", dir);
  ASSERT_EQ(c.code, 0) << c.err;
  ASSERT_TRUE(fs::exists(dir + "/c/train"));
  const std::string cmd = dir + "/c/train --output_dir " + dir + "/run >" + dir + "/b.out 2>" + dir + "/b.err";
  int st = std::system(cmd.c_str());
  std::ifstream e(dir + "/b.err");
  std::stringstream es;
  es << e.rdbuf();
  ASSERT_TRUE(WIFEXITED(st) && WEXITSTATUS(st) == 0) << es.str();
  EXPECT_TRUE(fs::exists(dir + "/run/model.onnx"));
  EXPECT_TRUE(fs::exists(dir + "/run/metrics.jsonl"));
}

/// `-o DIR` never deletes what kiln compile did not write: a non-empty folder without
/// the compile marker is refused and left as it was; an earlier output is replaced.
TEST_F(Cli, CompileRefusesForeignOutputFolder) {
  fs::create_directories(dir + "/proj/ir");
  std::ofstream(dir + "/proj/ir/keep.h") << "// user file\n";
  expect_one_error_line(run_kiln("compile " + model + data() + " --max_steps 2 --no_cache -o " + dir + "/proj", dir), 1,
                        "is not a kiln compile output");
  EXPECT_TRUE(fs::exists(dir + "/proj/ir/keep.h"));
  auto first = run_kiln("compile " + model + data() + " --max_steps 2 --no_cache -o " + dir + "/out", dir);
  ASSERT_EQ(first.code, 0) << first.err;
  auto again = run_kiln("compile " + model + data() + " --max_steps 2 --no_cache -o " + dir + "/out", dir);
  EXPECT_EQ(again.code, 0) << again.err;
}

/// A cache entry that is a folder is reported in one warning line and the compile goes on.
TEST_F(Cli, CompileCacheEntryThatIsAFolder) {
  auto first =
      run_kiln("compile " + model + data() + " --max_steps 2 --cache_dir " + dir + "/cache -o " + dir + "/o1", dir);
  ASSERT_EQ(first.code, 0) << first.err;
  int entries = 0;
  for (auto& e : fs::directory_iterator(dir + "/cache"))
    if (e.path().extension() == ".kcache") {
      fs::remove(e.path());
      fs::create_directories(e.path());
      ++entries;
    }
  ASSERT_GT(entries, 0);
  auto r =
      run_kiln("compile " + model + data() + " --max_steps 2 --cache_dir " + dir + "/cache -o " + dir + "/o2", dir);
  EXPECT_EQ(r.code, 0) << r.err;
  EXPECT_NE(r.err.find("is not a regular file; rebuilding"), std::string::npos) << r.err;
  EXPECT_EQ(r.err.find("internal error"), std::string::npos) << r.err;
}

/// A batch whose labels are all ignore_index has a NaN mean loss (as in PyTorch):
/// gradcheck must fail with one line instead of reporting "ok" on NaN differences.
TEST_F(Cli, GradcheckRefusesNonFiniteLoss) {
  ir::Tensor y(ir::DType::i64, {N});
  for (int64_t i = 0; i < N; ++i) y.data<int64_t>()[i] = -100;
  ASSERT_TRUE(runtime::io::save_npy(dir + "/y_ignored.npy", y).is_ok());
  expect_one_error_line(run_kiln("gradcheck " + model + " --train_data x=" + dir + "/x.npy --train_data labels=" + dir +
                                     "/y_ignored.npy --per_device_train_batch_size 8",
                                 dir),
                        1, "not finite");
}

/// `kiln bench --profile`: after the timing, one op table per backend (header with
/// `calls`, a `MatMul` row); only the timed steps are profiled, so with the same warm-up
/// twice the timed steps give exactly twice the MatMul calls.
TEST_F(Cli, BenchProfilePrintsOpTablePerBackend) {
  // Calls of the `MatMul` row in the "profile (<backend>)" section, -1 when absent.
  auto matmul_calls = [](const std::string& out, const std::string& backend) -> long long {
    const size_t sec = out.find("profile (" + backend + ")");
    if (sec == std::string::npos) return -1;
    const size_t hdr = out.find("calls", sec);
    const size_t row = out.find("\nMatMul ", sec);
    if (hdr == std::string::npos || row == std::string::npos) return -1;
    return std::atoll(out.c_str() + row + 8);
  };
  const std::string base =
      "bench " + model + data() + " --per_device_train_batch_size 4 --warmup_steps_bench 2 --profile";
  auto both = run_kiln(base + " --backend eager,compiled --bench_steps 3", dir);
  ASSERT_EQ(both.code, 0) << both.err << both.out;
  const long long eager3 = matmul_calls(both.out, "eager"), compiled3 = matmul_calls(both.out, "compiled");
  EXPECT_GT(eager3, 0) << both.out;
  EXPECT_EQ(eager3 % 3, 0) << both.out;
  EXPECT_EQ(compiled3, eager3) << both.out;  // MatMul is a library op: never fused
  // The tables follow the timing lines.
  EXPECT_LT(both.out.find("median step"), both.out.find("profile (eager)")) << both.out;
  auto six = run_kiln(base + " --backend eager --bench_steps 6", dir);
  ASSERT_EQ(six.code, 0) << six.err << six.out;
  EXPECT_EQ(matmul_calls(six.out, "eager"), 2 * eager3) << six.out;
  EXPECT_LT(six.out.find("median step time"), six.out.find("profile (eager)")) << six.out;
  // Without --profile, no table.
  auto plain =
      run_kiln("bench " + model + data() + " --per_device_train_batch_size 4 --backend eager --bench_steps 1", dir);
  ASSERT_EQ(plain.code, 0) << plain.err;
  EXPECT_EQ(plain.out.find("profile ("), std::string::npos) << plain.out;
  // --profile_by node (implies --profile): rows per node; generated kernels list what they fuse.
  auto nodes = run_kiln("bench " + model + data() +
                            " --per_device_train_batch_size 4 --backend compiled --bench_steps 1 "
                            "--profile_by node",
                        dir);
  ASSERT_EQ(nodes.code, 0) << nodes.err << nodes.out;
  EXPECT_NE(nodes.out.find("profile (compiled)"), std::string::npos) << nodes.out;
  EXPECT_NE(nodes.out.find(" FusedKernel[pointwise] (generated): "), std::string::npos) << nodes.out;
  EXPECT_EQ(nodes.out.find("\nMatMul "), std::string::npos) << "op-level row in a per-node table\n" << nodes.out;
  // The compiled program's build time by phase (issue 7: passes, fusion, LLVM, JIT link).
  {
    const size_t c = nodes.out.find("compile (compiled train step): ");
    ASSERT_NE(c, std::string::npos) << nodes.out;
    const std::string line = nodes.out.substr(c, nodes.out.find('\n', c) - c);
    for (const char* phase : {" import ", " training passes ", " fusion passes ", " lower ", " LLVM IR ", " O3 ",
                              " machine code + JIT link ", " arena plan "})
      EXPECT_NE(line.find(phase), std::string::npos) << phase << " missing: " << line;
  }
  auto bad = run_kiln("bench " + model + data() + " --profile_by kernel", dir);
  EXPECT_EQ(bad.code, 2) << bad.out << bad.err;
  EXPECT_NE(bad.err.find("--profile_by"), std::string::npos) << bad.err;
  // --profile_row_limit (implies --profile): N rows, then "(K other keys)"; 0 = every key.
  auto rows = [](const std::string& out) {
    const size_t sec = out.find("profile (compiled)"), end = out.find("\ntotal ", sec);
    int n = 0;
    for (size_t at = out.find("\n", out.find("-----", sec)); at != std::string::npos && at < end;
         at = out.find("\n", at + 1))
      ++n;
    return n;
  };
  const std::string by_node = "bench " + model + data() +
                              " --per_device_train_batch_size 4 --backend compiled --bench_steps 1 --profile_by node";
  auto two = run_kiln(by_node + " --profile_row_limit 2", dir);
  ASSERT_EQ(two.code, 0) << two.err << two.out;
  EXPECT_EQ(rows(two.out), 3) << two.out;  // 2 keys + "(N other keys)"
  EXPECT_NE(two.out.find(" other keys)"), std::string::npos) << two.out;
  auto all = run_kiln(by_node + " --profile_row_limit 0", dir);
  ASSERT_EQ(all.code, 0) << all.err << all.out;
  EXPECT_EQ(all.out.find(" other keys)"), std::string::npos) << all.out;
  const size_t other = two.out.find(" other keys)");
  const size_t open = two.out.rfind('(', other);
  ASSERT_NE(open, std::string::npos) << two.out;
  EXPECT_EQ(rows(all.out), 2 + std::atoi(two.out.c_str() + open + 1)) << all.out << two.out;  // every key
  auto negative = run_kiln(by_node + " --profile_row_limit -1", dir);
  EXPECT_EQ(negative.code, 2) << negative.out << negative.err;
  EXPECT_NE(negative.err.find("--profile_row_limit"), std::string::npos) << negative.err;
}

// ---- kiln fit and --auto_fit (tools/driver/fit.h; the search itself: fit_test.cpp)

namespace {

const std::string kSrc = KILN_SOURCE_DIR;
const std::string kMlp = kSrc + "/examples/mlp_digits/model.onnx";

/// The last line of stderr is one `kiln: error:` line with `needle` (notes may precede it).
void expect_error(const Result& r, int code, const std::string& needle) {
  EXPECT_EQ(r.code, code) << r.err;
  const size_t at = r.err.rfind("kiln: error: ");
  ASSERT_NE(at, std::string::npos) << r.err;
  const std::string line = r.err.substr(at);
  EXPECT_EQ(std::count(line.begin(), line.end(), '\n'), 1) << r.err;
  EXPECT_NE(line.find(needle), std::string::npos) << "'" << needle << "' not in: " << r.err;
}

class FitCli : public ::testing::Test {
 protected:
  void SetUp() override { dir = fresh_test_dir("kiln_fit_cli_"); }
  void TearDown() override { fs::remove_all(dir); }
  std::string dir;
};

TEST_F(FitCli, BadFlagsAreOneLine) {
  expect_error(run_kiln("fit " + kMlp + " --effective_batch_size 8", dir), 2, "--memory_budget is required");
  expect_error(run_kiln("fit " + kMlp + " --memory_budget lots", dir), 2, "--memory_budget");
  expect_error(run_kiln("fit " + kMlp + " --memory_budget 1GiB --measure_top -1", dir), 2, "--measure_top");
  expect_error(run_kiln("bench " + kMlp + " --auto_fit --memory_budget 1GiB", dir), 2, "--auto_fit");
  expect_error(run_kiln("inspect " + kMlp + " --memory --remat_policy budget --memory_budget auto", dir), 2, "'auto'");
  expect_error(run_kiln("fit " + kMlp + " --memory_budget 1GiB --effective_batch_size -3", dir), 2,
               "--effective_batch_size");
}

TEST_F(FitCli, OutputsAndRunFlagsAreCheckedBeforeTheSearch) {
  const std::string base = "fit " + kMlp + " --memory_budget 4MiB --effective_batch_size 8 --measure_top 0";
  // Two outputs on one path; a folder that does not exist: refused before anything runs.
  expect_error(run_kiln(base + " --plot " + dir + "/a.svg --save_config " + dir + "/a.svg", dir), 2,
               "the same file as --plot");
  expect_error(run_kiln(base + " --plot " + dir + "/f.svg --report_json " + dir + "/no/such/r.json", dir), 2,
               "no such folder");
  EXPECT_FALSE(fs::exists(dir + "/f.svg"));
  EXPECT_FALSE(fs::exists(dir + "/a.svg"));
  // Flags of a run kiln fit does not train.
  expect_error(run_kiln(base + " --output_dir " + dir + "/o", dir), 2, "--output_dir: kiln fit searches recipes");
  EXPECT_FALSE(fs::exists(dir + "/o"));
  // Batch flags that leave no split of the effective batch: a usage error.
  expect_error(run_kiln(base + " --per_device_train_batch_size 3", dir), 2, "--effective_batch_size 8: no split");
  // Data that does not fit the model: before the search, one line naming the file.
  expect_error(
      run_kiln(base + " --train_data input=" + dir + "/none.npy --train_data labels=" + dir + "/none.npy", dir), 1,
      "--train_data");
}

TEST_F(FitCli, NothingFitsLeavesNothingBehind) {
  const std::string plot = dir + "/fit.svg", cfg = dir + "/recipe.json";
  auto r = run_kiln("fit " + kMlp + " --memory_budget 1KiB --effective_batch_size 4 --measure_top 0 --plot " + plot +
                        " --save_config " + cfg,
                    dir);
  expect_error(r, 1, "no recipe fits; the smallest planned peak is");
  EXPECT_FALSE(fs::exists(plot));
  EXPECT_FALSE(fs::exists(cfg));
}

TEST_F(FitCli, WritesTableRecipePlotAndTrainsWithIt) {
  const std::string plot = dir + "/fit.svg", cfg = dir + "/recipe.json", rep = dir + "/report.json";
  auto r = run_kiln("fit " + kMlp +
                        " --memory_budget 4MiB --effective_batch_size 8 --measure_top 2 --measure_steps 1 "
                        "--optim adamw_torch --plot " +
                        plot + " --save_config " + cfg + " --report_json " + rep,
                    dir);
  ASSERT_EQ(r.code, 0) << r.err;
  EXPECT_NE(r.out.find("chosen: "), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("kiln train " + kMlp + " [this command's other flags] --per_device_train_batch_size"),
            std::string::npos)
      << r.out;
  // --optim given: fixed.
  EXPECT_EQ(r.out.find("adamw_8bit"), std::string::npos) << r.out;
  std::ifstream svg(plot);
  std::stringstream ss;
  ss << svg.rdbuf();
  EXPECT_NE(ss.str().find("id=\"vline\""), std::string::npos);
  EXPECT_NE(ss.str().find("id=\"point-"), std::string::npos);
  EXPECT_NE(ss.str().find("chosen: "), std::string::npos);
  std::ifstream ci(cfg);
  auto recipe = nlohmann::json::parse(ci);
  EXPECT_EQ(recipe["per_device_train_batch_size"].get<int64_t>() * recipe["gradient_accumulation_steps"].get<int64_t>(),
            8);
  std::ifstream ri(rep);
  auto report = nlohmann::json::parse(ri);
  EXPECT_EQ(report["candidates"].size(), 4u * 2 * 5);  // 8 = 8x1, 4x2, 2x4, 1x8; fp32/bf16; five policies
  // The recipe file trains as it is (flags override it).
  const std::string data = kSrc + "/data/digits";
  if (!fs::exists(data + "/x_train.npy")) {
    std::cout << "[  NOTE    ] " << data << "/x_train.npy missing (tools/prepare_test_data.sh): training with "
              << "the recipe not run\n";
    GTEST_SKIP() << "no digits data";
  }
  auto t = run_kiln("train " + kMlp + " --config " + cfg + " --train_data input=" + data +
                        "/x_train.npy --train_data labels=" + data + "/y_train.npy --max_steps 2 --output_dir " + dir +
                        "/run",
                    dir);
  EXPECT_EQ(t.code, 0) << t.err;
}

TEST_F(FitCli, TrainAutoFitLogsAndTrainsTheRecipe) {
  const std::string data = kSrc + "/data/digits";
  if (!fs::exists(data + "/x_train.npy")) {
    std::cout << "[  NOTE    ] " << data << "/x_train.npy missing (tools/prepare_test_data.sh): not run\n";
    GTEST_SKIP() << "no digits data";
  }
  auto r = run_kiln("train " + kMlp +
                        " --auto_fit --memory_budget 3MiB --per_device_train_batch_size 16 "
                        "--train_data input=" +
                        data + "/x_train.npy --train_data labels=" + data +
                        "/y_train.npy --max_steps 2 --logging_steps 1 --output_dir " + dir + "/run",
                    dir);
  ASSERT_EQ(r.code, 0) << r.err;
  const size_t at = r.out.find("auto_fit: training with --per_device_train_batch_size ");
  ASSERT_NE(at, std::string::npos) << r.out;
  // The product stays 16 (per_device_train_batch_size x gradient_accumulation_steps as given).
  std::istringstream line(r.out.substr(at + std::string("auto_fit: training with").size()));
  std::string flag;
  int64_t b = 0, a = 0;
  line >> flag >> b >> flag >> a;
  EXPECT_EQ(b * a, 16) << r.out;
  EXPECT_TRUE(fs::exists(dir + "/run/metrics.jsonl"));
  // A resume continues the checkpoint's recipe without searching again.
  const std::string train = "train " + kMlp + " --auto_fit --memory_budget 3MiB --per_device_train_batch_size 16 " +
                            "--train_data input=" + data + "/x_train.npy --train_data labels=" + data +
                            "/y_train.npy --save_steps 1 --output_dir " + dir + "/resumed";
  auto first = run_kiln(train + " --max_steps 1", dir);
  ASSERT_EQ(first.code, 0) << first.err;
  const size_t chose = first.out.find("auto_fit: training with ");
  ASSERT_NE(chose, std::string::npos) << first.out;
  const std::string recipe = first.out.substr(chose + 24, first.out.find('\n', chose) - chose - 24);
  auto again = run_kiln(train + " --max_steps 2 --resume_from_checkpoint latest", dir);
  ASSERT_EQ(again.code, 0) << again.err;
  EXPECT_EQ(again.out.find(" recipes: "), std::string::npos) << again.out;  // no table: no search
  EXPECT_NE(again.out.find("auto_fit: resuming with the recipe of " + dir + "/resumed/checkpoint-1: " + recipe),
            std::string::npos)
      << again.out << "\nwanted: " << recipe;
  // A recipe flag that contradicts the checkpoint's recipe is refused, not dropped.
  const bool was_8bit = recipe.find("adamw_8bit") != std::string::npos;
  auto other = run_kiln(
      train + " --max_steps 3 --resume_from_checkpoint latest --optim " + (was_8bit ? "adamw_torch" : "adamw_8bit"),
      dir);
  expect_error(other, 2, "--optim: this --auto_fit run resumes");
  // --auto_find_batch_size: the same search under the memory available.
  auto h = run_kiln(
      "train " + kMlp + " --auto_find_batch_size --per_device_train_batch_size 16 --train_data input=" + data +
          "/x_train.npy --train_data labels=" + data + "/y_train.npy --max_steps 1 --output_dir " + dir + "/run2",
      dir);
  ASSERT_EQ(h.code, 0) << h.err;
  EXPECT_NE(h.err.find("--memory_budget auto: "), std::string::npos) << h.err;
  EXPECT_NE(h.out.find("auto_fit: training with"), std::string::npos) << h.out;
}

}  // namespace
