// Tests of kiln fit's search (tools/driver/fit.h) and cost model (tools/driver/cost_model.h):
// the trie's planned peaks equal what a full build of each recipe plans (an independent
// path: build_training_program, kernels and all), parallel planning equals sequential,
// the chosen recipe measures within the budget, fixed flags stay fixed, and nothing
// fitting names the smallest peak (the command line's tests are in cli_test.cpp).
#include "tools/driver/fit.h"

#include <gtest/gtest.h>
#include <unistd.h>

#include <cmath>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <set>
#include <sstream>

#include "tools/driver/cost_model.h"
#include "tools/driver/driver.h"
#include "tools/driver/train_run.h"

using namespace kiln;
namespace fs = std::filesystem;

namespace {

const std::string kSrc = KILN_SOURCE_DIR;
const std::string kGpt = kSrc + "/examples/tiny_gpt/model.onnx";
const std::string kMlp = kSrc + "/examples/mlp_digits/model.onnx";

runtime::TrainConfig base_config(const std::string& model) {
  runtime::TrainConfig c;
  c.model = model;
  c.backend = "compiled";
  c.max_steps = 3;
  return c;
}

driver::FitOptions options(const std::string& model, int64_t E, int64_t budget) {
  driver::FitOptions o;
  o.config = base_config(model);
  o.effective_batch_size = E;
  o.memory_budget = budget;
  o.measure_top = 0;
  return o;
}

const driver::FitCandidate* find(const driver::FitResult& r, int64_t b, const std::string& prec,
                                 const std::string& remat, const std::string& optim) {
  for (const auto& c : r.candidates)
    if (c.batch == b && c.precision == prec && c.remat == remat && c.optim == optim) return &c;
  return nullptr;
}

TEST(Fit, TriePlansWhatEachRecipesOwnBuildPlans) {
  auto o = options(kGpt, 8, int64_t{1} << 40);
  auto r = driver::run_fit(o);
  ASSERT_TRUE(r.has_value()) << r.message();
  // 4 splits x 2 precisions x 5 policies x 2 optimizers; shared prefixes ran once.
  ASSERT_EQ(r->candidates.size(), 80u);
  EXPECT_LT(r->passes_run, r->passes_unshared);
  // A recipe of every policy, precision and optimizer, built the way kiln train builds it.
  struct Pick {
    int64_t b;
    const char *prec, *remat, *optim;
  };
  for (Pick p : {Pick{8, "fp32", "none", "adamw_torch"}, Pick{4, "bf16", "blocks", "adamw_8bit"},
                 Pick{2, "fp32", "sqrt", "adamw_8bit"}, Pick{8, "bf16", "min-cut", "adamw_torch"}}) {
    const driver::FitCandidate* c = find(*r, p.b, p.prec, p.remat, p.optim);
    ASSERT_NE(c, nullptr);
    ASSERT_TRUE(c->planned()) << c->label() << ": " << c->error;
    auto prog = driver::build_training_program(c->config(o.config, o.memory_budget));
    ASSERT_TRUE(prog.has_value()) << prog.message();
    auto plan = driver::executor_plan(*prog);
    ASSERT_TRUE(plan.has_value());
    EXPECT_EQ(plan->peak_bytes, c->planned_peak) << c->label();
    EXPECT_EQ(prog->signature.gradient_accumulation_steps, 8 / p.b) << c->label();
  }
  // Recomputation costs time in the model, and a smaller microbatch holds less.
  const auto* none = find(*r, 8, "fp32", "none", "adamw_torch");
  const auto* blocks = find(*r, 8, "fp32", "blocks", "adamw_torch");
  const auto* small = find(*r, 2, "fp32", "none", "adamw_torch");
  ASSERT_TRUE(none && blocks && small);
  EXPECT_GT(blocks->recompute_flops, 0);
  EXPECT_EQ(none->recomputed_nodes, 0);
  EXPECT_GT(blocks->estimated_s, none->estimated_s);
  EXPECT_LT(blocks->planned_peak, none->planned_peak);
  EXPECT_LT(small->planned_peak, none->planned_peak);
  // 8-bit state: 2 bytes + absmax per parameter element instead of 8.
  const auto* eight = find(*r, 8, "fp32", "none", "adamw_8bit");
  ASSERT_TRUE(eight);
  EXPECT_LT(eight->planned_peak, none->planned_peak);
}

TEST(Fit, ParallelPlanningEqualsSequential) {
  auto o = options(kGpt, 4, int64_t{1} << 40);
  o.plan_threads = 1;
  auto one = driver::run_fit(o);
  o.plan_threads = 2;
  auto two = driver::run_fit(o);
  ASSERT_TRUE(one.has_value() && two.has_value());
  ASSERT_EQ(one->candidates.size(), two->candidates.size());
  for (size_t i = 0; i < one->candidates.size(); ++i) {
    const auto &a = one->candidates[i], &b = two->candidates[i];
    EXPECT_EQ(a.label(), b.label());
    EXPECT_EQ(a.planned_peak, b.planned_peak) << a.label();
    EXPECT_EQ(a.recomputed_nodes, b.recomputed_nodes) << a.label();
    EXPECT_DOUBLE_EQ(a.estimated_s, b.estimated_s) << a.label();
  }
}

TEST(Fit, ChosenRecipeMeasuresWithinTheBudget) {
  // Half of the plain recipe's peak (batch 8, fp32, no remat, 32-bit AdamW).
  auto all = driver::run_fit(options(kGpt, 8, int64_t{1} << 40));
  ASSERT_TRUE(all.has_value());
  const auto* plain = find(*all, 8, "fp32", "none", "adamw_torch");
  ASSERT_TRUE(plain);
  auto o = options(kGpt, 8, plain->planned_peak / 2);
  o.measure_top = 2;
  o.measure_steps = 1;
  auto r = driver::run_fit(o);
  ASSERT_TRUE(r.has_value()) << r.message();
  ASSERT_GE(r->chosen, 0);
  const auto& c = r->candidates[static_cast<size_t>(r->chosen)];
  EXPECT_LE(c.planned_peak, o.memory_budget);
  EXPECT_GT(c.measured_peak, 0);
  EXPECT_LE(c.measured_peak, o.memory_budget);
  EXPECT_GT(c.measured_s, 0);
  EXPECT_EQ(c.batch * c.accumulation, 8);
  for (int i : r->fitting) {
    EXPECT_LE(r->candidates[static_cast<size_t>(i)].planned_peak, o.memory_budget);
    EXPECT_LT(r->candidates[static_cast<size_t>(i)].same_as, 0);
  }
  // The fitting list is ranked by the estimate, and whatever is not in it does not fit.
  for (size_t k = 1; k < r->fitting.size(); ++k)
    EXPECT_LE(r->candidates[static_cast<size_t>(r->fitting[k - 1])].estimated_s,
              r->candidates[static_cast<size_t>(r->fitting[k])].estimated_s);
  std::set<int> fit(r->fitting.begin(), r->fitting.end());
  for (size_t i = 0; i < r->candidates.size(); ++i) {
    const auto& x = r->candidates[i];
    if (!fit.count(static_cast<int>(i)) && x.planned() && x.same_as < 0)
      EXPECT_GT(x.planned_peak, o.memory_budget) << x.label();
  }
  // Recipe as flags and JSON.
  const std::string flags = driver::fit_flags(c, o.memory_budget);
  EXPECT_NE(flags.find("--per_device_train_batch_size " + std::to_string(c.batch)), std::string::npos);
  auto j = nlohmann::json::parse(driver::fit_config_json(c, o.memory_budget));
  EXPECT_EQ(j["per_device_train_batch_size"].get<int64_t>(), c.batch);
  EXPECT_EQ(j["optim"].get<std::string>(), c.optim);
}

TEST(Fit, NothingFitsNamesTheSmallestPeak) {
  auto o = options(kMlp, 4, 1024);
  auto r = driver::run_fit(o);
  ASSERT_TRUE(r.has_value()) << r.message();
  EXPECT_EQ(r->chosen, -1);
  EXPECT_TRUE(r->fitting.empty());
  ASSERT_GE(r->smallest, 0);
  int64_t least = INT64_MAX;
  for (const auto& c : r->candidates)
    if (c.planned()) least = std::min(least, c.planned_peak);
  EXPECT_EQ(r->candidates[static_cast<size_t>(r->smallest)].planned_peak, least);
  const std::string line = driver::fit_nothing_fits(*r, o);
  EXPECT_NE(line.find(std::to_string(least) + " B"), std::string::npos) << line;
  EXPECT_EQ(line.find('\n'), std::string::npos);
}

TEST(Fit, GivenFlagsStayFixed) {
  runtime::TrainConfig c = base_config(kGpt);
  c.bf16 = true;
  c.optim = "adamw_8bit";
  c.per_device_train_batch_size = 2;
  c.effective_batch_size = 8;
  c.memory_budget = "1GiB";
  c.auto_fit = true;
  const std::set<std::string> given = {"bf16", "optim", "per_device_train_batch_size"};
  auto o = driver::fit_options(c, [&](const std::string& n) { return given.count(n) > 0; });
  ASSERT_TRUE(o.has_value()) << o.message();
  EXPECT_EQ(o->memory_budget, int64_t{1} << 30);
  EXPECT_EQ(o->effective_batch_size, 8);
  o->measure_top = 0;
  auto r = driver::run_fit(*o);
  ASSERT_TRUE(r.has_value()) << r.message();
  ASSERT_EQ(r->candidates.size(), 5u);  // the remat policy alone is free
  for (const auto& x : r->candidates) {
    EXPECT_EQ(x.batch, 2);
    EXPECT_EQ(x.accumulation, 4);
    EXPECT_EQ(x.precision, "bf16");
    EXPECT_EQ(x.optim, "adamw_8bit");
  }
  // Without --effective_batch_size, the batch flags only set the product.
  c.effective_batch_size = 0;
  c.per_device_train_batch_size = 4;
  c.gradient_accumulation_steps = 2;
  auto o2 = driver::fit_options(c, [&](const std::string& n) { return given.count(n) > 0; });
  ASSERT_TRUE(o2.has_value());
  EXPECT_EQ(o2->effective_batch_size, 8);
  EXPECT_FALSE(o2->fix_batch);
  // An impossible split is one line naming the flags.
  c.effective_batch_size = 6;
  c.per_device_train_batch_size = 4;
  auto o3 = driver::fit_options(c, [&](const std::string& n) { return given.count(n) > 0; });
  ASSERT_FALSE(o3.has_value());
  EXPECT_NE(o3.message().find("--effective_batch_size 6: no split into --per_device_train_batch_size 4"),
            std::string::npos)
      << o3.message();
}

TEST(Fit, MemoryBudgetAutoReadsTheMachine) {
  std::string how;
  auto b = driver::resolve_memory_budget("auto", &how);
  ASSERT_TRUE(b.has_value()) << b.message();
  int64_t total = 0;
  std::ifstream in("/proc/meminfo");
  for (std::string line; std::getline(in, line);)
    if (line.rfind("MemTotal:", 0) == 0) total = std::stoll(line.substr(9)) * 1024;
  EXPECT_GT(*b, 0);
  EXPECT_LT(*b, total);
  EXPECT_NE(how.find("10% margin"), std::string::npos);
  EXPECT_EQ(*driver::resolve_memory_budget("2MiB"), 2 * 1024 * 1024);
  EXPECT_FALSE(driver::resolve_memory_budget("lots").has_value());
}

TEST(CostModel, RateCurveInterpolatesInLogFlops) {
  driver::RateCurve c;
  c.points = {{1e6, 10e9}, {1e8, 30e9}};
  EXPECT_DOUBLE_EQ(c.rate(1e5), 10e9);   // held below the range
  EXPECT_DOUBLE_EQ(c.rate(1e9), 30e9);   // and above it
  EXPECT_NEAR(c.rate(1e7), 20e9, 1e-3);  // halfway in log(FLOPs)
  EXPECT_EQ(driver::RateCurve{}.rate(1e7), 0);
}

TEST(CostModel, RatesAreCachedPerMachine) {
  const fs::path dir = fs::temp_directory_path() / ("kiln_fit_rates_" + std::to_string(getpid()));
  fs::remove_all(dir);
  auto first = driver::machine_rates(dir.string());
  ASSERT_TRUE(first.has_value()) << first.message();
  EXPECT_GT(first->calibrate_s, 0);
  EXPECT_GT(first->bandwidth, 1e8);
  for (const auto* c : {&first->matmul_f32, &first->matmul_bf16, &first->conv_f32, &first->conv_bf16})
    ASSERT_EQ(c->points.size(), 3u);
  // 2 x 512^3 FLOPs take at least 1 ms below 300 GFLOP/s: a rate past a few TFLOP/s on two
  // cores would be a timing bug, not a fast machine.
  EXPECT_LT(first->matmul_f32.points.back().second, 5e12);
  auto second = driver::machine_rates(dir.string());
  ASSERT_TRUE(second.has_value());
  EXPECT_EQ(second->calibrate_s, 0);  // read back, not measured
  EXPECT_EQ(second->machine, driver::machine_key());
  EXPECT_DOUBLE_EQ(second->bandwidth, first->bandwidth);
  // A file of another machine is measured again, not trusted.
  {
    std::ifstream in(dir / "fit_rates.json");
    auto j = nlohmann::json::parse(in);
    j["machine"] = "another CPU, 64 threads";
    std::ofstream(dir / "fit_rates.json") << j.dump();
  }
  auto third = driver::machine_rates(dir.string());
  ASSERT_TRUE(third.has_value());
  EXPECT_GT(third->calibrate_s, 0);
  fs::remove_all(dir);
}

}  // namespace
