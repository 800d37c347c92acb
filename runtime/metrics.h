// Training metrics: the console line of each logging step (Hugging Face Trainer
// style), metrics.jsonl (one JSON object per line), and a TTY progress bar.
#pragma once
#include <cstdint>
#include <fstream>
#include <nlohmann/json.hpp>
#include <ostream>
#include <string>

#include "ir/status.h"

namespace kiln::runtime {

/// Values of one logging step. Means are over the steps since the previous log (HF).
struct LogEntry {
  int64_t step = 0;
  int64_t total_steps = 0;
  double epoch = 0;          ///< global_step / steps_per_epoch
  double loss = 0;           ///< mean training loss since the last log
  double grad_norm = 0;      ///< pre-clip global L2 norm of the last step (NaN: not reported)
  double learning_rate = 0;  ///< learning rate used by the last step (NaN: not reported)
  double step_time_s = 0;    ///< mean wall time per step (s)
  double samples_per_second = 0;
};

/// "step 10/200 | epoch 0.25 | loss 2.3012 | grad_norm 1.234 | lr 4.9e-04 | 0.012 s/step | 666.7 samples/s"
std::string format_log_line(const LogEntry& e);
/// {"step", "epoch", "loss", "grad_norm", "learning_rate", "step_time_s", "samples_per_second"}
nlohmann::json log_entry_json(const LogEntry& e);
/// "eval step 200 | epoch 1.00 | eval_loss 1.2345 | eval_accuracy 0.8125"
std::string format_eval_line(const nlohmann::json& eval);

/// Appends JSON lines to output_dir/metrics.jsonl (flushed after each line).
class MetricsWriter {
 public:
  /// Opens `path`. Fresh runs truncate it; a resumed run keeps the lines with
  /// step <= `keep_up_to_step` and appends after them. `history` (a resumed checkpoint's
  /// metrics.jsonl, when it has one) replaces `path` as the source of the kept lines.
  Status open(const std::string& path, bool resume, int64_t keep_up_to_step, const std::string& history = "");
  Status write(const nlohmann::json& j);
  bool is_open() const { return out_.is_open(); }

 private:
  std::string path_;
  std::ofstream out_;
};

/// A one-line progress bar with ETA, redrawn with '\r'. Only active when `enabled`
/// (the trainer enables it when stdout is a TTY).
class ProgressBar {
 public:
  ProgressBar(std::ostream& out, bool enabled) : out_(out), enabled_(enabled) {}
  /// Redraws for `done` of `total` steps, `sec_per_step` seconds per step.
  void update(int64_t done, int64_t total, double sec_per_step);
  /// Erases the bar (before printing a log line).
  void clear();

 private:
  std::ostream& out_;
  bool enabled_;
  bool drawn_ = false;
};

/// "1h02m03s" / "2m05s" / "7s".
std::string format_duration(double seconds);

}  // namespace kiln::runtime
