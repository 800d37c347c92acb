// Training metrics: console lines, metrics.jsonl, progress bar (see metrics.h).
#include "runtime/metrics.h"

#include <sys/ioctl.h>
#include <unistd.h>

#include <algorithm>
#include <cctype>
#include <chrono>
#include <cmath>
#include <condition_variable>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <mutex>
#include <sstream>
#include <thread>
#include <vector>

#include "runtime/interrupt.h"
#include "runtime/io.h"

namespace kiln::runtime {

namespace {
/// printf of one double; every NaN prints as "nan" (glibc writes "-nan" for a NaN with the
/// sign bit set, which 0/0 and most NaN arithmetic give), infinities as "inf"/"-inf".
std::string fmt(const char* f, double v) {
  if (std::isnan(v)) return "nan";
  char buf[64];
  std::snprintf(buf, sizeof buf, f, v);
  return buf;
}
/// JSON cannot hold NaN/Inf: such values become null.
nlohmann::json num(double v) { return std::isfinite(v) ? nlohmann::json(v) : nlohmann::json(nullptr); }
}  // namespace

std::string format_metric(double v) {
  if (std::isnan(v)) return "nan";
  if (std::isinf(v)) return v > 0 ? "inf" : "-inf";
  const double a = std::fabs(v);
  return fmt(a == 0 || (a >= 1e-4 && a < 1e6) ? "%.4f" : "%.4e", v);
}

std::string format_log_line(const LogEntry& e) {
  std::ostringstream os;
  os << "step " << e.step << "/" << e.total_steps << " | epoch " << fmt("%.2f", e.epoch) << " | loss "
     << format_metric(e.loss);
  if (!std::isnan(e.grad_norm)) os << " | grad_norm " << fmt("%.4g", e.grad_norm);
  if (!std::isnan(e.learning_rate)) os << " | lr " << fmt("%.1e", e.learning_rate);
  os << " | " << format_time(e.step_time_s) << "/step | " << fmt("%.1f", e.samples_per_second) << " samples/s";
  return os.str();
}

nlohmann::json log_entry_json(const LogEntry& e) {
  nlohmann::json j;
  j["step"] = e.step;
  j["epoch"] = e.epoch;
  j["loss"] = num(e.loss);
  if (!std::isnan(e.grad_norm)) j["grad_norm"] = num(e.grad_norm);  // NaN: no clipping, no norm (as HF)
  j["learning_rate"] = num(e.learning_rate);
  j["step_time_s"] = num(e.step_time_s);
  j["samples_per_second"] = num(e.samples_per_second);
  return j;
}

std::string format_eval_line(const nlohmann::json& j) {
  std::ostringstream os;
  os << "eval step " << j.value("step", int64_t{0}) << " | epoch " << fmt("%.2f", j.value("epoch", 0.0));
  for (const char* k : {"eval_loss", "eval_accuracy"})
    if (j.contains(k)) {
      const auto& v = j[k];
      os << " | " << k << " " << (v.is_number() ? format_metric(v.get<double>()) : std::string("nan"));
    }
  return os.str();
}

Status MetricsWriter::open(const std::string& path, bool resume, int64_t keep_up_to_step, const std::string& history) {
  path_ = path;
  std::vector<std::string> kept;
  if (resume) {
    std::error_code ec;
    std::ifstream in(!history.empty() && std::filesystem::is_regular_file(history, ec) ? history : path);
    std::string line;
    while (std::getline(in, line)) {
      if (line.empty()) continue;
      try {
        auto j = nlohmann::json::parse(line);
        if (j.value("step", int64_t{0}) <= keep_up_to_step) kept.push_back(line);
      } catch (const std::exception&) {
        // a torn last line of an interrupted run: dropped
      }
    }
  }
  if (resume) {
    // The kept lines go to a temporary file renamed over the old one: a kill while they
    // are rewritten must not leave the history truncated.
    const std::string tmp = path + ".tmp";
    {
      std::ofstream t(tmp, std::ios::out | std::ios::trunc);
      if (!t) return Status::error(tmp + ": cannot open for writing");
      for (auto& l : kept) t << l << "\n";
      t.flush();
      if (!t) return Status::error(tmp + ": write failed");
    }
    fault_point("metrics");  // the history rewritten, not yet renamed (tests)
    KILN_RETURN_IF_ERROR(io::publish_file(tmp, path));
    out_.open(path, std::ios::out | std::ios::app);
  } else {
    std::error_code ec;
    std::filesystem::remove(path + ".tmp", ec);  // left by a run killed while it rewrote the history
    out_.open(path, std::ios::out | std::ios::trunc);
  }
  if (!out_) return Status::error(path + ": cannot open for writing");
  return Status::ok();
}

Status MetricsWriter::write(const nlohmann::json& j) {
  if (!out_.is_open()) return Status::ok();
  out_ << j.dump() << "\n";
  out_.flush();
  if (!out_) return Status::error(path_ + ": write failed");
  return Status::ok();
}

std::string format_duration(double s) {
  if (!std::isfinite(s) || s < 0) s = 0;
  int64_t t = static_cast<int64_t>(s + 0.5);
  char buf[64];
  if (t >= 3600)
    std::snprintf(buf, sizeof buf, "%lldh%02lldm%02llds", (long long)(t / 3600), (long long)(t / 60 % 60),
                  (long long)(t % 60));
  else if (t >= 60)
    std::snprintf(buf, sizeof buf, "%lldm%02llds", (long long)(t / 60), (long long)(t % 60));
  else
    std::snprintf(buf, sizeof buf, "%llds", (long long)t);
  return buf;
}

std::string format_time(double s) {
  if (std::isnan(s)) return "nan";
  if (std::isinf(s)) return s > 0 ? "inf s" : "-inf s";
  if (s == 0) return "0 s";
  const double a = std::fabs(s);
  // The unit is the largest whose value, rounded to three digits, is at least 1.
  const char* unit = "s";
  double v = s;
  if (a < 0.0009995) {
    unit = "us";
    v = s * 1e6;
  } else if (a < 0.9995) {
    unit = "ms";
    v = s * 1e3;
  }
  const double av = std::fabs(v);
  const char* f = av < 9.995 ? "%.2f %s" : av < 99.95 ? "%.1f %s" : "%.0f %s";
  if (av < 0.9995 && unit[0] == 'u') f = "%.3g %s";  // below a microsecond
  char buf[64];
  std::snprintf(buf, sizeof buf, f, v, unit);
  return buf;
}

std::string format_interval(double t) {
  if (!std::isfinite(t) || t < 0) t = 0;
  const int64_t secs = static_cast<int64_t>(t);
  const int64_t m = secs / 60 % 60, h = secs / 3600, sec = secs % 60;
  char buf[64];
  if (h > 0)
    std::snprintf(buf, sizeof buf, "%lld:%02lld:%02lld", (long long)h, (long long)m, (long long)sec);
  else
    std::snprintf(buf, sizeof buf, "%02lld:%02lld", (long long)m, (long long)sec);
  return buf;
}

std::string format_progress_line(const std::string& desc, int64_t n, int64_t total, double elapsed_s, double rate,
                                 double loss, int ncols, bool unicode) {
  const double frac = total > 0 ? std::min(1.0, std::max(0.0, static_cast<double>(n) / static_cast<double>(total))) : 0;
  char pct[16];
  std::snprintf(pct, sizeof pct, "%3.0f%%", frac * 100);
  const std::string l_bar = (desc.empty() ? "" : desc + ": ") + pct + "|";
  const bool known = std::isfinite(rate) && rate > 0;
  std::string rate_s = "?it/s", remaining = "?";
  if (known) {
    char b[32];
    if (rate >= 1)
      std::snprintf(b, sizeof b, "%5.2fit/s", rate);
    else
      std::snprintf(b, sizeof b, "%5.2fs/it", 1 / rate);
    rate_s = b;
    remaining = format_interval(static_cast<double>(std::max<int64_t>(0, total - n)) / rate);
  }
  std::string postfix;
  if (!std::isnan(loss)) {
    char b[32];
    std::snprintf(b, sizeof b, "%.3g", loss);  // tqdm's set_postfix: '{0:2.3g}'
    postfix = std::string(", loss=") + b;
  }
  const std::string r_bar = "| " + std::to_string(n) + "/" + std::to_string(total) + " [" + format_interval(elapsed_s) +
                            "<" + remaining + ", " + rate_s + postfix + "]";
  // Display width of l_bar and r_bar: ASCII, but desc may hold UTF-8 (count lead bytes).
  auto width = [](const std::string& t) {
    int w = 0;
    for (unsigned char c : t) w += (c & 0xC0) != 0x80;
    return w;
  };
  const int bar_w = std::max(1, ncols - width(l_bar) - width(r_bar));
  // tqdm's Bar: full cells, one partial cell of 1/8ths (ASCII: 1/10ths as digits), blanks.
  static const char* kUtf[] = {" ", "\u258f", "\u258e", "\u258d", "\u258c", "\u258b", "\u258a", "\u2589", "\u2588"};
  static const char* kAscii[] = {" ", "1", "2", "3", "4", "5", "6", "7", "8", "9", "#"};
  const char* const* cs = unicode ? kUtf : kAscii;
  const int nsyms = unicode ? 8 : 10;
  const int64_t units = static_cast<int64_t>(frac * bar_w * nsyms);
  const int64_t full = units / nsyms, part = units % nsyms;
  std::string bar;
  for (int64_t i = 0; i < full; ++i) bar += cs[nsyms];
  if (full < bar_w) {
    bar += cs[part];
    for (int64_t i = full + 1; i < bar_w; ++i) bar += ' ';
  }
  return l_bar + bar + r_bar;
}

int terminal_columns() {
  struct winsize ws {};
  if (ioctl(STDOUT_FILENO, TIOCGWINSZ, &ws) == 0 && ws.ws_col > 0) return ws.ws_col;
  if (const char* c = std::getenv("COLUMNS")) {
    const int v = std::atoi(c);
    if (v > 0) return v;
  }
  return 80;
}

bool utf8_locale() {
  for (const char* name : {"LC_ALL", "LC_CTYPE", "LANG"}) {
    const char* v = std::getenv(name);
    if (!v || !*v) continue;
    std::string s(v);
    for (char& c : s) c = static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
    return s.find("utf-8") != std::string::npos || s.find("utf8") != std::string::npos;
  }
  return false;
}

namespace {
double now_s() { return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count(); }
}  // namespace

ProgressBar::ProgressBar(std::ostream& out, bool enabled, std::string desc, bool leave)
    : out_(out), enabled_(enabled), desc_(std::move(desc)), leave_(leave) {
  if (enabled_) unicode_ = utf8_locale();
}

void ProgressBar::start(int64_t total, int64_t initial) {
  total_ = total;
  initial_ = done_ = initial;
  t0_ = now_s();
  last_draw_ = -1;
}

void ProgressBar::update(int64_t done, double loss) {
  done_ = done;
  if (!std::isnan(loss)) loss_ = loss;
  if (!enabled_ || total_ <= 0) return;
  const double t = now_s();
  if (done < total_ && last_draw_ >= 0 && t - last_draw_ < min_interval_) return;  // tqdm's mininterval
  draw();
}

void ProgressBar::refresh() {
  if (enabled_ && total_ > 0) draw();
}

void ProgressBar::draw() {
  const double t = now_s();
  const double elapsed = t - t0_;
  const double rate = elapsed > 0 && done_ > initial_ ? static_cast<double>(done_ - initial_) / elapsed : 0;
  // One column short of the width: a line that fills the last column wraps on some terminals.
  out_ << "\r" << format_progress_line(desc_, done_, total_, elapsed, rate, loss_, terminal_columns() - 1, unicode_)
       << std::flush;
  drawn_ = true;
  last_draw_ = t;
}

void ProgressBar::clear() {
  if (!enabled_ || !drawn_) return;
  out_ << "\r\033[K" << std::flush;  // carriage return, erase to the end of the line
  drawn_ = false;
}

void ProgressBar::close() {
  if (!enabled_ || total_ <= 0) return;
  if (leave_) {
    draw();
    out_ << "\n" << std::flush;
    drawn_ = false;
  } else {
    clear();
  }
  total_ = 0;
}

struct ElapsedIndicator::State {
  std::mutex mu;
  std::condition_variable cv;
  bool done = false;
  bool drawn = false;
  std::thread thread;
};

ElapsedIndicator::ElapsedIndicator(std::ostream& out, bool enabled, std::string desc, double delay)
    : out_(out), enabled_(enabled), desc_(std::move(desc)), delay_(delay) {}

ElapsedIndicator::~ElapsedIndicator() { stop(); }

void ElapsedIndicator::start() {
  if (!enabled_ || state_) return;
  state_ = std::make_unique<State>();
  State* st = state_.get();
  const double t0 = now_s();
  st->thread = std::thread([this, st, t0] {
    std::unique_lock<std::mutex> lock(st->mu);
    if (st->cv.wait_for(lock, std::chrono::duration<double>(delay_), [st] { return st->done; })) return;
    while (!st->done) {
      out_ << "\r" << desc_ << ": [" << format_interval(now_s() - t0) << "]" << std::flush;
      st->drawn = true;
      st->cv.wait_for(lock, std::chrono::milliseconds(100), [st] { return st->done; });
    }
  });
}

void ElapsedIndicator::stop() {
  if (!state_) return;
  {
    std::lock_guard<std::mutex> lock(state_->mu);
    state_->done = true;
  }
  state_->cv.notify_all();
  state_->thread.join();
  if (state_->drawn) out_ << "\r\033[K" << std::flush;
  state_.reset();
}

}  // namespace kiln::runtime
