// Helpers for end-to-end tests: build a training program for an example model
// and run training steps with the eager interpreter.
#pragma once
#include <gtest/gtest.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <map>
#include <nlohmann/json.hpp>
#include <sstream>
#include <string>
#include <utility>
#include <vector>

#include "ir/graph.h"
#include "runtime/data.h"
#include "runtime/interpreter.h"
#include "runtime/io.h"
#include "tools/driver/driver.h"

namespace kiln::testing {

inline std::string example_path(const std::string& name, const std::string& file) {
  return std::string(KILN_SOURCE_DIR) + "/examples/" + name + "/" + file;
}

inline nlohmann::json read_json(const std::string& path) {
  std::ifstream f(path);
  return nlohmann::json::parse(f);
}

/// Removes the temp files and folders handed to remove_after_tests when the test program
/// ends with every test passed; after a failure they stay, and their paths are printed.
class TempCleanup : public ::testing::Environment {
 public:
  void TearDown() override {
    namespace fs = std::filesystem;
    const bool passed = ::testing::UnitTest::GetInstance()->Passed();
    for (const std::string& p : paths_) {
      if (!fs::exists(p)) continue;
      if (passed) {
        std::error_code ec;
        fs::remove_all(p, ec);
      } else {
        std::cout << "[ INFO ] kept for inspection: " << p << "\n";
      }
    }
  }
  void add(const std::string& p) {
    if (std::find(paths_.begin(), paths_.end(), p) == paths_.end()) paths_.push_back(p);
  }
  /// The one instance, registered with GoogleTest on first use (before RUN_ALL_TESTS's
  /// teardown, which owns and deletes it).
  static TempCleanup& get() {
    static TempCleanup* env = static_cast<TempCleanup*>(::testing::AddGlobalTestEnvironment(new TempCleanup));
    return *env;
  }

 private:
  std::vector<std::string> paths_;
};

/// Marks a temp path (file or folder) for removal when the test program passes.
inline void remove_after_tests(const std::string& path) { TempCleanup::get().add(path); }

/// A fresh (removed, then created) folder under the temp dir, unique to this process;
/// removed at the end of a passing test program.
inline std::string fresh_tmpdir(const std::string& name) {
  namespace fs = std::filesystem;
  fs::path p = fs::temp_directory_path() / ("kiln_e2e_" + name + "_" + std::to_string(::getpid()));
  fs::remove_all(p);
  fs::create_directories(p);
  remove_after_tests(p.string());
  return p.string();
}

/// Runs `cmd` with /bin/sh (stdout and stderr to one temp file, removed after a passing
/// test program); returns its exit status (128 when a signal ended it) and what it printed.
inline std::pair<int, std::string> shell(const std::string& cmd) {
  namespace fs = std::filesystem;
  const std::string log = (fs::temp_directory_path() / ("kiln_e2e_sh_" + std::to_string(::getpid()) + ".log")).string();
  remove_after_tests(log);
  const int st = std::system(("(" + cmd + ") > '" + log + "' 2>&1").c_str());
  std::ifstream f(log);
  std::stringstream ss;
  ss << f.rdbuf();
  return {WIFEXITED(st) ? WEXITSTATUS(st) : 128, ss.str()};
}

/// Training losses by step from DIR/metrics.jsonl (lines with a "loss" key).
inline std::map<int64_t, double> train_losses(const std::string& dir) {
  std::map<int64_t, double> m;
  std::ifstream f(dir + "/metrics.jsonl");
  std::string line;
  while (std::getline(f, line)) {
    auto j = nlohmann::json::parse(line);
    if (j.contains("loss")) m[j["step"].get<int64_t>()] = j["loss"].get<double>();
  }
  return m;
}

/// Bitwise equality of two state maps (same names, dtypes, dims and bytes); reports the
/// first differing tensor.
inline void expect_bitwise_equal(const std::map<std::string, ir::Tensor>& a,
                                 const std::map<std::string, ir::Tensor>& b) {
  ASSERT_EQ(a.size(), b.size());
  for (auto& [name, t] : a) {
    ASSERT_TRUE(b.count(name)) << name;
    const ir::Tensor& u = b.at(name);
    ASSERT_EQ(t.dtype(), u.dtype()) << name;
    ASSERT_EQ(t.dims(), u.dims()) << name;
    EXPECT_EQ(std::memcmp(t.raw(), u.raw(), t.nbytes()), 0) << name << " differs";
  }
}

/// Initial state (parameters, buffers, optimizer state, counter) of a program's train_step.
inline std::map<std::string, ir::Tensor> initial_state(const ir::Graph& g) {
  std::map<std::string, ir::Tensor> s;
  for (auto& sb : g.state) s[sb.input->name] = sb.initial->clone();
  return s;
}

/// Row slice [i*b, (i+1)*b) of the leading dim (or the i-th entry of a [steps, B, ...] array).
inline ir::Tensor slice_rows(const ir::Tensor& t, int64_t begin, int64_t count) {
  std::vector<int64_t> dims = t.dims();
  int64_t row = t.numel() / dims[0];
  dims[0] = count;
  ir::Tensor out(t.dtype(), dims);
  std::memcpy(out.raw(), static_cast<const char*>(t.raw()) + begin * row * ir::dtype_size(t.dtype()),
              static_cast<size_t>(count * row) * ir::dtype_size(t.dtype()));
  return out;
}

/// Drops the leading dim of a [1, ...] slice.
inline ir::Tensor squeeze0(const ir::Tensor& t) {
  std::vector<int64_t> d(t.dims().begin() + 1, t.dims().end());
  return t.reshaped(d);
}

/// One whole-program training case of an example model (the compiled-vs-eager and step
/// arena matrices): precision fp32 | bf16 | fp16, optimizer, remat policy, accumulation.
struct ExampleCase {
  std::string model;
  std::string precision = "fp32";
  std::string optim = "adamw_torch";
  std::string remat = "none";
  int64_t accum = 1;
  int64_t steps = 3;
};

/// "tiny_gpt_bf16_adamw_8bit_remat_blocks_accum2" (a gtest name: alphanumerics and '_').
inline std::string example_case_name(const ExampleCase& c) {
  std::string n =
      c.model + "_" + c.precision + "_" + c.optim + "_remat_" + c.remat + "_accum" + std::to_string(c.accum);
  for (char& ch : n)
    if (!std::isalnum(static_cast<unsigned char>(ch))) ch = '_';
  return n;
}

/// gtest prints parameters with this (stable ctest names and readable failures).
inline void PrintTo(const ExampleCase& c, std::ostream* os) { *os << example_case_name(c); }

/// The TrainConfig of `c` for `backend` with `rows` rows per optimizer step (split into
/// c.accum microbatches): cross entropy, lr 1e-3 (sgd 0.05), weight decay 0.01, clipping
/// at 1.0, remat budget 14MB, c.steps steps.
/// An example's trajectory fixtures (tools/make_fixtures.py): fixtures/traj_inputs.npy
/// ([steps, rows, ...]) and fixtures/traj_labels.npy, as loaded (check both before use).
struct TrajectoryFixture {
  Expected<ir::Tensor> xs, ys;
};
inline TrajectoryFixture load_trajectory(const std::string& model) {
  return {runtime::io::load_npy(example_path(model, "fixtures/traj_inputs.npy")),
          runtime::io::load_npy(example_path(model, "fixtures/traj_labels.npy"))};
}

inline runtime::TrainConfig example_case_config(const ExampleCase& c, const std::string& backend, int64_t rows) {
  runtime::TrainConfig cfg;
  cfg.model = example_path(c.model, "model.onnx");
  cfg.per_device_train_batch_size = rows / c.accum;
  cfg.per_device_eval_batch_size = rows / c.accum;
  cfg.gradient_accumulation_steps = c.accum;
  cfg.loss = "cross_entropy";
  cfg.optim = c.optim;
  cfg.learning_rate = c.optim == "sgd" ? 0.05 : 1e-3;
  cfg.weight_decay = 0.01;
  cfg.max_grad_norm = 1.0;
  cfg.bf16 = c.precision == "bf16";
  cfg.fp16 = c.precision == "fp16";
  // Every product in low precision (torch.autocast), whatever its size: the mechanism under test.
  if (cfg.bf16 || cfg.fp16) cfg.autocast_min_flops = 0;
  cfg.remat_policy = c.remat;
  if (c.remat == "budget") cfg.memory_budget = "14MB";
  cfg.backend = backend;
  cfg.max_steps = c.steps;
  return cfg;
}

/// Losses of `steps` training steps of `prog`'s train_step from its initial state; step
/// i reads batch i of `xs`/`ys` ([steps, B, ...] arrays); float data is cast to f64 for
/// a float64 program. A failed step is a test failure and ends the list early.
/// `final_state` (optional) receives the state after the last step. The program's
/// generated kernels (--backend compiled) are used when it has them, and its step arena
/// unless `use_arena` is false.
inline std::vector<double> trajectory_losses(const driver::TrainingProgram& prog, const ir::Tensor& xs,
                                             const ir::Tensor& ys, int64_t steps, bool f64 = false,
                                             std::map<std::string, ir::Tensor>* final_state = nullptr,
                                             bool use_arena = true, runtime::ScheduleCache* schedule = nullptr,
                                             int64_t* donated = nullptr) {
  std::vector<double> losses;
  auto state = initial_state(*prog.train_step);
  runtime::RunOptions ro;
  // `donated` non-null: run as the Trainer does (RunOptions::donate_state, the state
  // owned here) and count the state outputs that came back in their input's buffer.
  ro.donate_state = donated != nullptr;
  if (donated) *donated = 0;
  ro.training = true;
  ro.program = prog.train_kernels.get();
  ro.arena = use_arena ? prog.train_arena.get() : nullptr;  // the compiled executor's step arena
  ro.schedule = schedule;  // per-graph executor facts kept across steps (as the trainer does)
  for (int64_t i = 0; i < steps; ++i) {
    auto feeds = state;
    ir::Tensor xi = squeeze0(slice_rows(xs, i, 1));
    if (f64 && ir::is_float(xi.dtype())) xi = xi.cast(ir::DType::f64);
    feeds[prog.data_inputs[0]] = xi;
    feeds[prog.label_input] = squeeze0(slice_rows(ys, i, 1));
    runtime::add_num_items_feed(*prog.train_step, feeds[prog.label_input], -100, feeds);  // accumulation, tokens
    ro.step = static_cast<uint64_t>(i);
    auto out = runtime::run_graph(*prog.train_step, feeds, ro);
    if (!out) {
      ADD_FAILURE() << "step " << i << ": " << out.message();
      break;
    }
    losses.push_back((*out)["loss"].get_f64(0));
    for (auto& sb : prog.train_step->state) {
      if (donated && (*out)[sb.output->name].raw() == state[sb.input->name].raw()) ++*donated;
      state[sb.input->name] = (*out)[sb.output->name];
    }
  }
  if (final_state) *final_state = state;
  return losses;
}

inline double rel_l2(const ir::Tensor& a, const ir::Tensor& ref) {
  double d = 0, r = 0;
  for (int64_t i = 0; i < ref.numel(); ++i) {
    double x = a.get_f64(i) - ref.get_f64(i);
    d += x * x;
    r += ref.get_f64(i) * ref.get_f64(i);
  }
  return std::sqrt(d) / std::max(std::sqrt(r), 1e-30);
}

}  // namespace kiln::testing
