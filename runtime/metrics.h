// Training metrics: the console line of each logging step (Hugging Face Trainer
// style), metrics.jsonl (one JSON object per line), and a tqdm-style progress bar on a terminal.
#pragma once
#include <cmath>
#include <cstdint>
#include <fstream>
#include <memory>
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

/// "step 10/200 | epoch 0.25 | loss 2.3012 | grad_norm 1.234 | lr 4.9e-04 | 12.0 ms/step | 666.7 samples/s"
std::string format_log_line(const LogEntry& e);
/// {"step", "epoch", "loss", "grad_norm", "learning_rate", "step_time_s", "samples_per_second"}
/// ("grad_norm" only when the step reports one: with clipping)
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

/// A time with a unit that keeps three significant digits: "850 us", "1.23 ms", "12.3 ms",
/// "4.56 s", "123 s" (whole seconds from 1000 s on); "0 s" for 0, "nan" for NaN. Every
/// time kiln prints goes through it.
std::string format_time(double seconds);

/// A loss or metric value as log lines print it: 4 decimals ("0.2924") when
/// 1e-4 <= |v| < 1e6 or v is 0, otherwise 4 decimals in scientific notation ("1.0490e+29",
/// "3.2000e-06"), so that a diverged or tiny loss stays readable; "nan", "inf", "-inf".
std::string format_metric(double v);

/// tqdm's format_interval: "MM:SS", or "H:MM:SS" from one hour on.
std::string format_interval(double seconds);

/// One line in tqdm's layout (ncols wide, the bar taking what the rest leaves):
/// "desc:  45%|████▌     | 180/400 [00:02<00:03, 85.31it/s, loss=0.312]". `rate` is steps
/// per second (<= 0 or NaN: not known yet, "?it/s" and remaining "?"); below one step a
/// second it reads "2.50s/it" as tqdm does. `loss` NaN: no postfix. `unicode`: tqdm's
/// eighth blocks, else its ASCII bar ("####5     ").
std::string format_progress_line(const std::string& desc, int64_t n, int64_t total, double elapsed_s, double rate,
                                 double loss, int ncols, bool unicode);

/// The width of the terminal on stdout (TIOCGWINSZ), else $COLUMNS, else 80.
int terminal_columns();
/// Whether the locale (LC_ALL, LC_CTYPE, LANG, the first one set) is UTF-8.
bool utf8_locale();

/// tqdm-style live bar redrawn with '\r' on a terminal. Only active when `enabled` (the
/// trainer enables it when stdout is a terminal and --disable_tqdm is not given).
class ProgressBar {
 public:
  /// `desc` prefixes the line ("eval"); `leave`: close() keeps the last line (tqdm's leave).
  ProgressBar(std::ostream& out, bool enabled, std::string desc = "", bool leave = true);
  /// Starts the clock for `total` steps, `initial` of them already done (a resumed run).
  void start(int64_t total, int64_t initial = 0);
  /// Records `done` steps and the latest loss (NaN: none); redraws at most every 0.1 s,
  /// and always at the last step.
  void update(int64_t done, double loss = std::nan(""));
  /// Redraws now (after a log line printed over the bar).
  void refresh();
  /// Erases the bar (before printing a log line).
  void clear();
  /// Ends the bar: the last state stays on its own line when `leave`, else it is erased.
  void close();
  bool enabled() const { return enabled_; }
  /// Least seconds between two redraws (tqdm's mininterval, 0.1 by default).
  void set_min_interval(double seconds) { min_interval_ = seconds; }

 private:
  void draw();
  std::ostream& out_;
  bool enabled_;
  std::string desc_;
  bool leave_;
  bool drawn_ = false;
  bool unicode_ = false;
  int64_t total_ = 0, initial_ = 0, done_ = 0;
  double loss_ = std::nan("");
  double t0_ = 0, last_draw_ = -1, min_interval_ = 0.1;
};

/// tqdm's bar without a total for work whose length is unknown (a compile): from
/// `delay` seconds after start() until stop(), a background thread redraws
/// "desc: [MM:SS]" every 0.1 s; stop() erases it. Nothing is drawn when not `enabled`
/// or when the work ends within `delay` (HF's Trainer shows no bar for short work either).
class ElapsedIndicator {
 public:
  ElapsedIndicator(std::ostream& out, bool enabled, std::string desc, double delay = 1.0);
  ~ElapsedIndicator();
  ElapsedIndicator(const ElapsedIndicator&) = delete;
  ElapsedIndicator& operator=(const ElapsedIndicator&) = delete;
  /// Starts the clock (and the thread, when enabled).
  void start();
  /// Stops the thread and erases the line if one was drawn. Idempotent.
  void stop();

 private:
  struct State;
  std::ostream& out_;
  bool enabled_;
  std::string desc_;
  double delay_;
  std::unique_ptr<State> state_;
};

/// "1h02m03s" / "2m05s" / "7s".
std::string format_duration(double seconds);

}  // namespace kiln::runtime
