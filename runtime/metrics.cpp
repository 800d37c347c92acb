// Training metrics: console lines, metrics.jsonl, progress bar (see metrics.h).
#include "runtime/metrics.h"

#include <cmath>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <sstream>
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

std::string format_log_line(const LogEntry& e) {
  std::ostringstream os;
  os << "step " << e.step << "/" << e.total_steps << " | epoch " << fmt("%.2f", e.epoch) << " | loss "
     << fmt("%.4f", e.loss);
  if (!std::isnan(e.grad_norm)) os << " | grad_norm " << fmt("%.4g", e.grad_norm);
  if (!std::isnan(e.learning_rate)) os << " | lr " << fmt("%.1e", e.learning_rate);
  os << " | " << fmt("%.3f", e.step_time_s) << " s/step | " << fmt("%.1f", e.samples_per_second) << " samples/s";
  return os.str();
}

nlohmann::json log_entry_json(const LogEntry& e) {
  nlohmann::json j;
  j["step"] = e.step;
  j["epoch"] = e.epoch;
  j["loss"] = num(e.loss);
  j["grad_norm"] = num(e.grad_norm);
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
      os << " | " << k << " " << (v.is_number() ? fmt("%.4f", v.get<double>()) : std::string("nan"));
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

void ProgressBar::update(int64_t done, int64_t total, double sec_per_step) {
  if (!enabled_ || total <= 0) return;
  const int width = 30;
  int filled = static_cast<int>(width * static_cast<double>(done) / static_cast<double>(total));
  std::string bar(filled, '#');
  bar += std::string(width - filled, ' ');
  out_ << "\r[" << bar << "] " << done << "/" << total << " ETA "
       << format_duration(sec_per_step * static_cast<double>(total - done)) << "   " << std::flush;
  drawn_ = true;
}

void ProgressBar::clear() {
  if (!enabled_ || !drawn_) return;
  out_ << "\r" << std::string(60, ' ') << "\r" << std::flush;
  drawn_ = false;
}

}  // namespace kiln::runtime
