// Console lines of the trainer (runtime/metrics.h): numbers formatted as documented, and
// every NaN spelled "nan" (glibc's printf writes "-nan" for a NaN with the sign bit set,
// which 0/0 gives; a mean loss over batches whose labels are all ignored is such a NaN).
#include "runtime/metrics.h"

#include <gtest/gtest.h>

#include <cmath>
#include <limits>

using namespace kiln;

namespace {

TEST(Metrics, LogLineFormatsNumbersAndSpellsEveryNaNTheSameWay) {
  runtime::LogEntry e;
  e.step = 20;
  e.total_steps = 100;
  e.epoch = 0.25;
  e.loss = 2.345678;
  e.grad_norm = 1.5;
  e.learning_rate = 3e-4;
  e.step_time_s = 0.0123;
  e.samples_per_second = 650.4;
  EXPECT_EQ(runtime::format_log_line(e),
            "step 20/100 | epoch 0.25 | loss 2.3457 | grad_norm 1.5 | lr 3.0e-04 | 0.012 s/step | 650.4 samples/s");
  volatile double zero = 0.0;
  e.loss = zero / zero;  // the sign bit is set on x86-64: printf says "-nan"
  ASSERT_TRUE(std::isnan(e.loss));
  EXPECT_NE(runtime::format_log_line(e).find("| loss nan |"), std::string::npos) << runtime::format_log_line(e);
  e.loss = -std::numeric_limits<double>::quiet_NaN();
  EXPECT_NE(runtime::format_log_line(e).find("| loss nan |"), std::string::npos) << runtime::format_log_line(e);
  e.loss = std::numeric_limits<double>::infinity();
  EXPECT_NE(runtime::format_log_line(e).find("| loss inf |"), std::string::npos) << runtime::format_log_line(e);
}

TEST(Metrics, EvalLineSpellsNaNAndMissingValuesAsNan) {
  nlohmann::json j;
  j["step"] = 4;
  j["epoch"] = 0.04;
  j["eval_loss"] = nullptr;  // metrics.jsonl holds NaN as null
  EXPECT_EQ(runtime::format_eval_line(j), "eval step 4 | epoch 0.04 | eval_loss nan");
  j["eval_loss"] = -std::numeric_limits<double>::quiet_NaN();
  EXPECT_EQ(runtime::format_eval_line(j), "eval step 4 | epoch 0.04 | eval_loss nan");
}

}  // namespace
