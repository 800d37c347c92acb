// Console lines of the trainer (runtime/metrics.h): numbers formatted as documented, and
// every NaN spelled "nan" (glibc's printf writes "-nan" for a NaN with the sign bit set,
// which 0/0 gives; a mean loss over batches whose labels are all ignored is such a NaN).
#include "runtime/metrics.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <limits>
#include <sstream>
#include <thread>

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
            "step 20/100 | epoch 0.25 | loss 2.3457 | grad_norm 1.5 | lr 3.0e-04 | 12.3 ms/step | 650.4 samples/s");
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

TEST(Metrics, TimesKeepThreeSignificantDigitsWithTheirUnit) {
  EXPECT_EQ(runtime::format_time(0), "0 s");
  EXPECT_EQ(runtime::format_time(0.000000123), "0.123 us");
  EXPECT_EQ(runtime::format_time(0.0000085), "8.50 us");
  EXPECT_EQ(runtime::format_time(0.000123), "123 us");
  EXPECT_EQ(runtime::format_time(0.0009996), "1.00 ms");  // rounds up into the next unit
  EXPECT_EQ(runtime::format_time(0.00123), "1.23 ms");
  EXPECT_EQ(runtime::format_time(0.0123), "12.3 ms");
  EXPECT_EQ(runtime::format_time(0.123), "123 ms");
  EXPECT_EQ(runtime::format_time(0.99951), "1.00 s");
  EXPECT_EQ(runtime::format_time(4.567), "4.57 s");
  EXPECT_EQ(runtime::format_time(45.67), "45.7 s");
  EXPECT_EQ(runtime::format_time(456.7), "457 s");
  EXPECT_EQ(runtime::format_time(4567.0), "4567 s");
  EXPECT_EQ(runtime::format_time(std::nan("")), "nan");
  runtime::LogEntry e;
  e.step_time_s = 0.00042;  // the tiny MLP's steps: "0.000 s/step" before
  EXPECT_NE(runtime::format_log_line(e).find("| 420 us/step |"), std::string::npos) << runtime::format_log_line(e);
}

TEST(Metrics, IntervalsAsTqdm) {
  EXPECT_EQ(runtime::format_interval(0), "00:00");
  EXPECT_EQ(runtime::format_interval(65.9), "01:05");
  EXPECT_EQ(runtime::format_interval(3599), "59:59");
  EXPECT_EQ(runtime::format_interval(3600 + 62), "1:01:02");
}

TEST(Metrics, ProgressLineHasTqdmLayout) {
  // tqdm(total=400, ncols=80) after 180 steps in 2.1 s, postfix loss=0.3123:
  // " 45%|████▌     | 180/400 [00:02<00:02, 85.71it/s, loss=0.312]" with the bar filling 80 columns.
  const std::string line = runtime::format_progress_line("", 180, 400, 2.1, 180 / 2.1, 0.3123, 80, true);
  EXPECT_EQ(line.substr(0, 5), " 45%|");
  EXPECT_NE(line.find("| 180/400 [00:02<00:02, 85.71it/s, loss=0.312]"), std::string::npos) << line;
  int cols = 0;
  for (unsigned char c : line) cols += (c & 0xC0) != 0x80;
  EXPECT_EQ(cols, 80) << line;
  // The bar: 80 - 5 - 46 = 29 cells, 45% of them = 13.05 -> 13 full cells, then blanks.
  const std::string bar = line.substr(5, line.find("| 180") - 5);
  std::string full;
  for (int i = 0; i < 13; ++i) full += "\u2588";
  EXPECT_EQ(bar, full + std::string(16, ' '));
  // 90 of 400 (no postfix: 42 cells): 9.45 cells -> 9 full, 3/8 of one (U+258D), blanks.
  const std::string part = runtime::format_progress_line("", 90, 400, 1, 90, std::nan(""), 80, true);
  std::string nine;
  for (int i = 0; i < 9; ++i) nine += "\u2588";
  EXPECT_NE(part.find("|" + nine + "\u258d" + std::string(32, ' ') + "| 90/400"), std::string::npos) << part;
  // ASCII (no UTF-8 locale), a description, slow steps (s/it), nothing known yet.
  EXPECT_EQ(runtime::format_progress_line("eval", 1, 4, 2.5, 0.4, std::nan(""), 51, false),
            "eval:  25%|##5       | 1/4 [00:02<00:07,  2.50s/it]");
  EXPECT_EQ(runtime::format_progress_line("", 0, 10, 0, 0, std::nan(""), 38, false),
            "  0%|          | 0/10 [00:00<?, ?it/s]");
  EXPECT_EQ(runtime::format_progress_line("", 10, 10, 1, 10, 1.5, 57, false),
            "100%|##########| 10/10 [00:01<00:00, 10.00it/s, loss=1.5]");
}

TEST(Metrics, ProgressBarRedrawsOverOneLineAndLeavesTheLast) {
  std::ostringstream os;
  runtime::ProgressBar bar(os, true);
  bar.set_min_interval(3600);  // deterministic: only the first and the last step draw
  bar.start(3);
  bar.update(1, 2.0);
  bar.update(2, 1.0);  // within the interval: not redrawn
  bar.update(3, 0.5);  // the last step: always drawn
  bar.close();
  const std::string s = os.str();
  EXPECT_EQ(std::count(s.begin(), s.end(), '\r'), 3) << s;  // step 1, step 3, close
  EXPECT_EQ(s.back(), '\n');
  EXPECT_NE(s.find("100%|"), std::string::npos) << s;
  EXPECT_NE(s.find("3/3 ["), std::string::npos) << s;
  EXPECT_NE(s.find("loss=0.5]"), std::string::npos) << s;
  std::ostringstream quiet;
  runtime::ProgressBar off(quiet, false);
  off.start(3);
  off.update(3, 1.0);
  off.close();
  EXPECT_EQ(quiet.str(), "");
  std::ostringstream ev;
  runtime::ProgressBar eval(ev, true, "eval", /*leave=*/false);
  eval.start(2);
  eval.update(1);
  eval.close();  // erased: carriage return and erase-line
  EXPECT_NE(ev.str().find("eval:  50%|"), std::string::npos) << ev.str();
  EXPECT_EQ(ev.str().substr(ev.str().size() - 4), "\r\033[K");
}

TEST(Metrics, ElapsedIndicatorDrawsAfterItsDelayAndErasesItself) {
  std::ostringstream quick;
  {
    runtime::ElapsedIndicator ind(quick, true, "compiling", /*delay=*/30);
    ind.start();
    ind.stop();  // done within the delay: nothing drawn
  }
  EXPECT_EQ(quick.str(), "");
  std::ostringstream slow;
  runtime::ElapsedIndicator ind(slow, true, "compiling", /*delay=*/0.01);
  ind.start();
  std::this_thread::sleep_for(std::chrono::milliseconds(300));
  ind.stop();
  const std::string s = slow.str();
  EXPECT_EQ(s.rfind("\rcompiling: [00:00]", 0), 0u) << s;
  EXPECT_EQ(s.substr(s.size() - 4), "\r\033[K") << s;
  std::ostringstream off;
  runtime::ElapsedIndicator none(off, false, "compiling", 0);
  none.start();
  std::this_thread::sleep_for(std::chrono::milliseconds(50));
  none.stop();
  EXPECT_EQ(off.str(), "");
}

}  // namespace

TEST(Metrics, LossesStayReadableAtEveryMagnitude) {
  // A diverged run printed "loss 104898694540773550773015412736.0000" and a cut
  // "train_loss 644891053613294618066722750464."; a tiny loss printed "0.0000".
  EXPECT_EQ(kiln::runtime::format_metric(0.29244), "0.2924");
  EXPECT_EQ(kiln::runtime::format_metric(0.0), "0.0000");
  EXPECT_EQ(kiln::runtime::format_metric(999999.0), "999999.0000");
  EXPECT_EQ(kiln::runtime::format_metric(1.0489869454077355e29), "1.0490e+29");
  EXPECT_EQ(kiln::runtime::format_metric(-3.2e-6), "-3.2000e-06");
  EXPECT_EQ(kiln::runtime::format_metric(std::nan("")), "nan");
  EXPECT_EQ(kiln::runtime::format_metric(-std::numeric_limits<double>::infinity()), "-inf");
}
