// SIGINT/SIGTERM: stop after the current step; a second one ends the process. SIGXFSZ
// ignored. The KILN_FAULT_KILL test hook. See interrupt.h.
#include "runtime/interrupt.h"

#include <signal.h>

#include <atomic>
#include <cstdio>
#include <cstdlib>
#include <string>

namespace kiln::runtime {

namespace {
// The first signal's number; signals counted, so that two handlers running at once on two
// threads cannot both take themselves for the first (lock-free atomics are signal-safe).
std::atomic<int> g_signal{0};
std::atomic<int> g_count{0};
static_assert(std::atomic<int>::is_always_lock_free);
struct sigaction g_prev_int, g_prev_term;

extern "C" void on_stop_signal(int sig) {
  if (g_count.fetch_add(1) > 0) {
    // The second signal: end now, as if no handler were installed.
    ::signal(sig, SIG_DFL);
    ::raise(sig);
    return;
  }
  g_signal.store(sig);
}
}  // namespace

StopOnSignal::StopOnSignal() {
  struct sigaction sa {};
  sa.sa_handler = on_stop_signal;
  sigemptyset(&sa.sa_mask);
  sa.sa_flags = SA_RESTART;  // a step's reads and writes go on; the trainer checks between steps
  ::sigaction(SIGINT, &sa, &g_prev_int);
  ::sigaction(SIGTERM, &sa, &g_prev_term);
}

StopOnSignal::~StopOnSignal() {
  ::sigaction(SIGINT, &g_prev_int, nullptr);
  ::sigaction(SIGTERM, &g_prev_term, nullptr);
}

int stop_signal() { return g_signal.load(); }
void clear_stop_signal() {
  g_signal.store(0);
  g_count.store(0);
}

const char* signal_name(int sig) {
  if (sig == SIGINT) return "SIGINT";
  if (sig == SIGTERM) return "SIGTERM";
  static char buf[32];
  std::snprintf(buf, sizeof buf, "signal %d", sig);
  return buf;
}

void ignore_file_size_signal() { ::signal(SIGXFSZ, SIG_IGN); }

namespace {
struct FaultPlan {
  std::string name;
  long at = 0;  // 0: off
  long seen = 0;
  int signal = SIGKILL;
};
FaultPlan& fault_plan() {
  static FaultPlan plan = [] {
    FaultPlan p;
    const char* v = std::getenv("KILN_FAULT_KILL");
    if (!v && (v = std::getenv("KILN_FAULT_STOP"))) p.signal = SIGSTOP;  // a hung process
    if (!v) return p;
    const std::string s = v;
    const size_t colon = s.rfind(':');
    if (colon == std::string::npos) return p;
    p.name = s.substr(0, colon);
    p.at = std::strtol(s.c_str() + colon + 1, nullptr, 10);
    return p;
  }();
  return plan;
}
}  // namespace

void fault_point(const char* name) {
  FaultPlan& p = fault_plan();
  if (p.at <= 0 || p.name != name) return;
  if (++p.seen == p.at) ::raise(p.signal);
}

}  // namespace kiln::runtime
