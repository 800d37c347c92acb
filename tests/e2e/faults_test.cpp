// Faults a training run survives (issue 36), through the kiln binary:
//   - SIGKILL at random moments (during steps, half-written files, complete checkpoints
//     not yet renamed, the metrics.jsonl rewrite of a resume, and at random times), then
//     --resume_from_checkpoint latest: every resume starts from the newest complete
//     checkpoint, every checkpoint left on disk equals the uninterrupted run's, and the
//     final weights equal the uninterrupted run's bit for bit. 50 trials (KILN_FAULTS_TRIALS),
//     seeded by KILN_FAULTS_SEED (printed; random when unset);
//   - a save that hits the file-size limit (RLIMIT_FSIZE, as a full disk) prints one
//     error line, exits 1 and leaves the previous checkpoint intact and loadable;
//   - SIGTERM/SIGINT stop after the current step (a checkpoint when --save_steps is set,
//     exit 128 + signal); a second signal ends the process at once;
//   - an implausibly large finite loss gets one warning line.
// Kills at exact points use kiln's test hook KILN_FAULT_KILL=NAME:N (runtime/interrupt.h).
#include <fcntl.h>
#include <gtest/gtest.h>
#include <poll.h>
#include <signal.h>
#include <sys/resource.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <functional>
#include <map>
#include <optional>
#include <random>
#include <regex>
#include <sstream>
#include <string>
#include <vector>

#include "e2e_util.h"
#include "runtime/checkpoint.h"
#include "runtime/io.h"

namespace fs = std::filesystem;
using Clock = std::chrono::steady_clock;

namespace {

const std::string kSrc = KILN_SOURCE_DIR;
const std::string kBin = std::string(KILN_BINARY_DIR) + "/bin/kiln";

/// How a child kiln ended, and what it printed.
struct Result {
  bool exited = false;
  int code = -1;                           ///< exit status when exited
  int signal = 0;                          ///< terminating signal when not exited
  std::string out;                         ///< stdout
  std::string err;                         ///< stderr
  double seconds_after_training_line = 0;  ///< from the "training:" line to the end
  std::string text() const {
    return (exited ? "exit " + std::to_string(code) : "signal " + std::to_string(signal)) + "\n--- stdout\n" + out +
           "--- stderr\n" + err;
  }
};

/// What to do to the child while it runs.
struct Plan {
  std::map<std::string, std::string> env;  ///< set in the child
  double kill_after_training_s = -1;       ///< >= 0: SIGKILL this long after "training:" appears
  rlim_t fsize_limit = RLIM_INFINITY;      ///< RLIMIT_FSIZE of the child
  std::string binary = kBin;               ///< the program run (a `kiln compile` binary)
  double timeout_s = 300;                  ///< then SIGKILL (a test that failed to stop it)
  /// Called with the child's pid and its stdout so far, each time more arrives; returns
  /// true when it has done its part (then no longer called).
  std::function<bool(pid_t, const std::string&)> on_output;
};

/// Runs `kiln ARGS` from the source directory (repository-relative data paths).
Result run_kiln(const std::vector<std::string>& args, const Plan& plan = {}) {
  int out_pipe[2], err_pipe[2];
  if (::pipe2(out_pipe, O_CLOEXEC) != 0 || ::pipe2(err_pipe, O_CLOEXEC) != 0) {
    ADD_FAILURE() << "pipe failed";
    return {};
  }
  std::vector<std::string> argv_s = {plan.binary};
  argv_s.insert(argv_s.end(), args.begin(), args.end());
  std::vector<char*> argv;
  for (auto& a : argv_s) argv.push_back(a.data());
  argv.push_back(nullptr);
  const pid_t pid = ::fork();
  if (pid == 0) {
    ::dup2(out_pipe[1], 1);
    ::dup2(err_pipe[1], 2);
    if (::chdir(kSrc.c_str()) != 0) ::_exit(127);
    for (auto& [k, v] : plan.env) ::setenv(k.c_str(), v.c_str(), 1);
    if (plan.fsize_limit != RLIM_INFINITY) {
      struct rlimit rl {
        plan.fsize_limit, plan.fsize_limit
      };
      ::setrlimit(RLIMIT_FSIZE, &rl);
    }
    ::execv(plan.binary.c_str(), argv.data());
    ::_exit(127);
  }
  ::close(out_pipe[1]);
  ::close(err_pipe[1]);
  Result r;
  const auto started = Clock::now();
  std::optional<Clock::time_point> training_at, kill_at;
  bool killed = false, hook_done = !plan.on_output;
  int open_fds = 2;
  struct pollfd fds[2] = {{out_pipe[0], POLLIN, 0}, {err_pipe[0], POLLIN, 0}};
  while (open_fds > 0) {
    // Wait at most until the kill is due (sub-millisecond: ppoll).
    struct timespec ts {
      0, 20 * 1000 * 1000
    };
    if (kill_at && !killed) {
      const auto left = std::chrono::duration_cast<std::chrono::nanoseconds>(*kill_at - Clock::now()).count();
      ts = {0, std::max<long>(0, std::min<long>(left, 20 * 1000 * 1000))};
    }
    const int n = ::ppoll(fds, 2, &ts, nullptr);
    if (n < 0 && errno != EINTR) break;
    for (int i = 0; i < 2; ++i) {
      if (fds[i].fd < 0 || !(fds[i].revents & (POLLIN | POLLHUP | POLLERR))) continue;
      char buf[4096];
      const ssize_t got = ::read(fds[i].fd, buf, sizeof buf);
      if (got <= 0) {
        ::close(fds[i].fd);
        fds[i].fd = -1;
        --open_fds;
        continue;
      }
      (i == 0 ? r.out : r.err).append(buf, static_cast<size_t>(got));
      if (i == 0 && !training_at && r.out.find("training:") != std::string::npos) {
        training_at = Clock::now();
        if (plan.kill_after_training_s >= 0)
          kill_at = *training_at + std::chrono::nanoseconds(static_cast<int64_t>(plan.kill_after_training_s * 1e9));
      }
      if (i == 0 && !hook_done) hook_done = plan.on_output(pid, r.out);
    }
    if (!killed && Clock::now() - started > std::chrono::duration<double>(plan.timeout_s)) {
      ADD_FAILURE() << "kiln ran past " << plan.timeout_s << " s: killed";
      kill_at = Clock::now();
    }
    if (kill_at && !killed && Clock::now() >= *kill_at) {
      ::kill(pid, SIGKILL);
      killed = true;
    }
  }
  int st = 0;
  ::waitpid(pid, &st, 0);
  if (training_at) r.seconds_after_training_line = std::chrono::duration<double>(Clock::now() - *training_at).count();
  r.exited = WIFEXITED(st);
  r.code = r.exited ? WEXITSTATUS(st) : -1;
  r.signal = WIFSIGNALED(st) ? WTERMSIG(st) : 0;
  return r;
}

std::string read_bytes(const std::string& path) {
  std::ifstream f(path, std::ios::binary);
  std::stringstream ss;
  ss << f.rdbuf();
  return ss.str();
}

std::vector<std::string> split(const std::string& s) {
  std::vector<std::string> r;
  std::istringstream in(s);
  for (std::string w; in >> w;) r.push_back(w);
  return r;
}

/// Names in `dir` ending in ".tmp" (interrupted saves and rewrites).
std::vector<std::string> tmp_leftovers(const std::string& dir) {
  std::vector<std::string> r;
  for (auto& e : fs::recursive_directory_iterator(dir)) {
    const std::string n = e.path().filename().string();
    if (n.size() > 4 && n.compare(n.size() - 4, 4, ".tmp") == 0) r.push_back(fs::relative(e.path(), dir).string());
  }
  return r;
}

/// Lines of `s` (non-empty).
std::vector<std::string> lines(const std::string& s) {
  std::vector<std::string> r;
  std::istringstream in(s);
  for (std::string l; std::getline(in, l);)
    if (!l.empty()) r.push_back(l);
  return r;
}

// The tiny MLP of the examples on its 8-row fixture batch: 2 steps per epoch of 4 rows,
// 20 steps, a checkpoint every 2 (10 saves of 4 files each, then model.safetensors).
constexpr int kSteps = 20, kSaveEvery = 2;
std::vector<std::string> mlp_args(const std::string& out) {
  return split(
      "train examples/mlp_digits/model.onnx --train_data input=examples/mlp_digits/fixtures/batch_input.npy "
      "--train_data labels=examples/mlp_digits/fixtures/batch_labels.npy --per_device_train_batch_size 4 "
      "--learning_rate 1e-2 --logging_steps 1 --seed 11 --max_steps " +
      std::to_string(kSteps) + " --save_steps " + std::to_string(kSaveEvery) + " --output_dir " + out);
}
std::vector<std::string> with(std::vector<std::string> a, const std::string& more) {
  for (auto& w : split(more)) a.push_back(w);
  return a;
}

/// OMP_NUM_THREADS=1: the runs are short; threads would only contend on a shared machine.
Plan plan_env(Plan p = {}) {
  p.env["OMP_NUM_THREADS"] = "1";
  return p;
}

}  // namespace

// ------------------------------------------------------------------ SIGKILL and resume
TEST(Faults, KillAtRandomMomentsAndResumeEndsBitIdentical) {
  const int trials = std::getenv("KILN_FAULTS_TRIALS") ? std::atoi(std::getenv("KILN_FAULTS_TRIALS")) : 50;
  const uint64_t seed = std::getenv("KILN_FAULTS_SEED") ? std::strtoull(std::getenv("KILN_FAULTS_SEED"), nullptr, 10)
                                                        : std::random_device{}();
  std::cout << "[ faults ] seed " << seed << " (rerun with KILN_FAULTS_SEED=" << seed << "), " << trials << " trials"
            << std::endl;

  // The uninterrupted run: its checkpoints, final weights and losses are the reference.
  const std::string ref = kiln::testing::fresh_tmpdir("faults_ref");
  Result r0 = run_kiln(mlp_args(ref), plan_env());  // warms the caches
  ASSERT_EQ(r0.code, 0) << r0.text();
  // The trials rotate checkpoints (--save_total_limit 3): a kill may land in a deletion.
  auto trial_args = [](const std::string& out) { return with(mlp_args(out), "--save_total_limit 3"); };
  const std::string ref2 = kiln::testing::fresh_tmpdir("faults_ref2");
  Result r = run_kiln(trial_args(ref2), plan_env());
  ASSERT_EQ(r.code, 0) << r.text();
  const double train_s = r.seconds_after_training_line;
  std::map<int, std::pair<std::string, std::string>> ref_ckpt;  // step -> model, optimizer bytes
  for (int s = kSaveEvery; s <= kSteps; s += kSaveEvery) {
    const std::string d = ref + "/checkpoint-" + std::to_string(s);
    ref_ckpt[s] = {read_bytes(d + "/model.safetensors"), read_bytes(d + "/optimizer.safetensors")};
    ASSERT_FALSE(ref_ckpt[s].first.empty()) << d;
  }
  const std::string ref_weights = read_bytes(ref + "/model.safetensors");
  ASSERT_EQ(ref_weights, read_bytes(ref2 + "/model.safetensors")) << "two uninterrupted runs differ";
  const auto ref_losses = kiln::testing::train_losses(ref);
  ASSERT_EQ(ref_losses.size(), static_cast<size_t>(kSteps));

  std::map<std::string, int> landed;  // where the kills landed
  int kills = 0, resumes = 0, identical = 0;
  const std::regex resuming("resuming at step ([0-9]+)");
  for (int trial = 0; trial < trials; ++trial) {
    SCOPED_TRACE("trial " + std::to_string(trial) + " of seed " + std::to_string(seed));
    std::mt19937_64 rng(seed * 1000003 + static_cast<uint64_t>(trial));
    auto uniform = [&](int lo, int hi) { return std::uniform_int_distribution<int>(lo, hi)(rng); };
    const std::string dir = kiln::testing::fresh_tmpdir("faults_trial");
    const int legs = uniform(1, 2);  // runs killed before the one that finishes
    std::string story;
    // The newest complete checkpoint in dir (0: none), after checking every complete
    // checkpoint there against the reference.
    auto newest_checked = [&]() -> int {
      int newest = 0;
      for (auto& [step, path] : kiln::runtime::list_checkpoints(dir)) {
        auto it = ref_ckpt.find(static_cast<int>(step));
        EXPECT_NE(it, ref_ckpt.end()) << path << ": a checkpoint the run never saves";
        if (it == ref_ckpt.end()) continue;
        EXPECT_EQ(read_bytes(path + "/model.safetensors"), it->second.first) << path << " differs from the reference";
        EXPECT_EQ(read_bytes(path + "/optimizer.safetensors"), it->second.second)
            << path << " differs from the reference";
        auto loaded = kiln::runtime::load_checkpoint(path);
        EXPECT_TRUE(static_cast<bool>(loaded)) << path << ": " << loaded.message();
        if (loaded) {
          EXPECT_EQ(loaded->state.global_step, step) << path;
        }
        newest = std::max(newest, static_cast<int>(step));
      }
      return newest;
    };
    auto run_leg = [&](int from, Plan plan) -> Result {
      std::vector<std::string> a = trial_args(dir);
      if (from > 0) a = with(a, "--resume_from_checkpoint latest");
      Result res = run_kiln(a, plan);
      if (from > 0 && (res.exited || res.out.find("training:") != std::string::npos)) {
        std::smatch m;
        EXPECT_TRUE(std::regex_search(res.out, m, resuming)) << story << res.text();
        if (!m.empty()) {
          EXPECT_EQ(std::stoi(m[1]), from) << "did not resume from the newest complete checkpoint\n"
                                           << story << res.text();
        }
        ++resumes;
      }
      return res;
    };
    for (int leg = 0; leg < legs; ++leg) {
      const int from = newest_checked();
      const auto tmps_before = tmp_leftovers(dir);
      // What is left to do from `from`: steps, saves, files written (4 per save, then
      // model.safetensors), and a metrics.jsonl rewrite when resuming.
      const int steps_left = kSteps - from, saves_left = steps_left / kSaveEvery, writes_left = 4 * saves_left + 1;
      std::vector<std::string> modes = {"time", "write", "publish"};
      if (steps_left > 0) modes.insert(modes.end(), {"time", "log", "log", "step", "step", "checkpoint", "checkpoint"});
      if (from > 0) modes.insert(modes.end(), {"metrics", "metrics"});
      const std::string mode = modes[static_cast<size_t>(uniform(0, static_cast<int>(modes.size()) - 1))];
      Plan plan = plan_env();
      std::string moment;
      if (mode == "time") {
        // Anywhere in the steps, saves and final writes (the run's own share of them).
        const double s = std::uniform_real_distribution<double>(0, 0.9)(rng) * train_s * steps_left / kSteps;
        plan.kill_after_training_s = s;
        moment = "time +" + std::to_string(static_cast<int64_t>(s * 1e6)) + " us after 'training:'";
      } else if (mode == "log") {
        // Inside the step after a logged one (or its save), at a random microsecond.
        const int k = uniform(from + 1, kSteps);
        const int us = uniform(0, 300);
        const std::string line = "step " + std::to_string(k) + "/";
        plan.on_output = [line, us](pid_t pid, const std::string& out) {
          if (out.find(line) == std::string::npos) return false;
          ::usleep(static_cast<useconds_t>(us));
          ::kill(pid, SIGKILL);
          return true;
        };
        moment = "SIGKILL " + std::to_string(us) + " us after the log line of step " + std::to_string(k);
      } else {
        const int n = mode == "step"         ? uniform(1, steps_left)
                      : mode == "checkpoint" ? uniform(1, saves_left)
                      : mode == "metrics"    ? 1
                                             : uniform(1, writes_left);
        plan.env["KILN_FAULT_KILL"] = mode + ":" + std::to_string(n);
        moment = "KILN_FAULT_KILL=" + mode + ":" + std::to_string(n);
      }
      Result res = run_leg(from, plan);
      story += "leg " + std::to_string(leg) + " from step " + std::to_string(from) + ": " + moment + " -> " +
               (res.exited ? "exit " + std::to_string(res.code) : "signal " + std::to_string(res.signal)) + "\n";
      if (res.exited) {
        // A timed kill that came after the run ended (rare): the run finished normally.
        ASSERT_TRUE(mode == "time" || mode == "log") << story << res.text();
        ASSERT_EQ(res.code, 0) << story << res.text();
        ++landed["missed (run ended first)"];
        continue;
      }
      ASSERT_EQ(res.signal, SIGKILL) << story << res.text();
      ++kills;
      // Where it landed, from what it left behind (a checkpoint-N.tmp below the newest
      // complete checkpoint is one being deleted by --save_total_limit).
      const int newest = newest_checked();
      std::string where = mode == "time" ? "timed: " : mode == "log" ? "after a log line: " : "hook " + mode + ": ";
      bool in_ckpt = false, in_rotation = false, in_metrics = false, in_file = false;
      for (auto& t : tmp_leftovers(dir)) {
        if (std::find(tmps_before.begin(), tmps_before.end(), t) != tmps_before.end()) continue;
        const int64_t n = kiln::runtime::checkpoint_step(t, ".tmp");
        if (n >= 0 && n < newest)
          in_rotation = true;
        else if (t.rfind("checkpoint-", 0) == 0)
          in_ckpt = true;
        else if (t == "metrics.jsonl.tmp")
          in_metrics = true;
        else
          in_file = true;
      }
      where += in_ckpt       ? "during a checkpoint write"
               : in_rotation ? "during a checkpoint deletion (--save_total_limit)"
               : in_metrics  ? "during the metrics.jsonl rewrite"
               : in_file     ? "during the final weights' write"
               : res.out.find("training:") == std::string::npos
                   ? "at start-up or in the first steps (nothing printed yet)"
                   : "between or during steps";
      ++landed[where];
    }
    // The run that finishes: from the newest complete checkpoint, or fresh without one.
    const int from = newest_checked();
    Result fin = run_leg(from, plan_env());
    ASSERT_EQ(fin.code, 0) << story << fin.text();
    ASSERT_TRUE(fin.exited) << story << fin.text();
    const bool same = read_bytes(dir + "/model.safetensors") == ref_weights;
    EXPECT_TRUE(same) << "final weights differ from the uninterrupted run's\n" << story;
    EXPECT_EQ(kiln::testing::train_losses(dir), ref_losses) << "logged losses differ\n" << story;
    // Nothing half-written is left, except a deleted checkpoint's folder when the last run
    // saved nothing (the next run that saves removes it; one that does not touches no checkpoint).
    for (const std::string& t : tmp_leftovers(dir))
      EXPECT_TRUE(from == kSteps && t.rfind("checkpoint-", 0) == 0) << "left behind: " << t << "\n" << story;
    identical += same ? 1 : 0;
    std::error_code ec;
    fs::remove_all(dir, ec);
  }
  std::cout << "[ faults ] " << identical << "/" << trials << " trials bit-identical to the uninterrupted run; "
            << kills << " SIGKILLs, " << resumes << " resumes; kills landed:" << std::endl;
  for (auto& [where, n] : landed) std::cout << "[ faults ]   " << n << " " << where << std::endl;
  EXPECT_EQ(identical, trials);
  EXPECT_GE(kills, trials);
}

// ------------------------------------------------------------------ full disk
TEST(Faults, SaveThatHitsTheFileSizeLimitKeepsThePreviousCheckpoint) {
  // 8 steps, a checkpoint every 2. The uninterrupted run first (it also puts the program
  // in the compile caches: the limited run below has none to write).
  auto eight = [](const std::string& out) {
    std::vector<std::string> a = mlp_args(out);
    for (size_t i = 0; i + 1 < a.size(); ++i)
      if (a[i] == "--max_steps") a[i + 1] = "8";
    return a;
  };
  const std::string whole = kiln::testing::fresh_tmpdir("faults_fsize_whole");
  Result w = run_kiln(eight(whole), plan_env());
  ASSERT_EQ(w.code, 0) << w.text();
  // A run killed after step 5 leaves checkpoint-2 and checkpoint-4.
  const std::string dir = kiln::testing::fresh_tmpdir("faults_fsize");
  Plan kill5 = plan_env();
  kill5.env["KILN_FAULT_KILL"] = "step:5";
  Result a = run_kiln(eight(dir), kill5);
  ASSERT_EQ(a.signal, SIGKILL) << a.text();
  const std::string ck4 = dir + "/checkpoint-4";
  std::map<std::string, std::string> before;
  for (auto& e : fs::directory_iterator(ck4)) before[e.path().filename().string()] = read_bytes(e.path().string());
  const auto model_bytes = fs::file_size(ck4 + "/model.safetensors"),
             optim_bytes = fs::file_size(ck4 + "/optimizer.safetensors");
  ASSERT_LT(model_bytes + 1000, optim_bytes);
  // Resumed under a file-size limit between the two files' sizes: the save at step 6
  // writes model.safetensors, and optimizer.safetensors fails (EFBIG, as a full disk).
  Plan limited = plan_env();
  limited.fsize_limit = (model_bytes + optim_bytes) / 2;
  const std::vector<std::string> resume = with(eight(dir), "--resume_from_checkpoint latest");
  Result b = run_kiln(resume, limited);
  EXPECT_TRUE(b.exited) << b.text();  // not killed by SIGXFSZ
  EXPECT_EQ(b.code, 1) << b.text();
  const auto err = lines(b.err);
  ASSERT_EQ(err.size(), 1u) << b.text();
  EXPECT_NE(err[0].find("kiln: error: checkpoint '" + dir + "/checkpoint-6' not saved: "), std::string::npos) << err[0];
  EXPECT_NE(err[0].find("optimizer.safetensors: write failed (File too large)"), std::string::npos) << err[0];
  EXPECT_NE(err[0].find("the previous checkpoints are kept"), std::string::npos) << err[0];
  EXPECT_FALSE(fs::exists(dir + "/checkpoint-6")) << b.text();
  EXPECT_EQ(tmp_leftovers(dir), std::vector<std::string>{});
  std::map<std::string, std::string> after;
  for (auto& e : fs::directory_iterator(ck4)) after[e.path().filename().string()] = read_bytes(e.path().string());
  EXPECT_EQ(before, after) << "checkpoint-4 changed";
  // It loads, and the resume from it ends where the uninterrupted run does.
  Result c = run_kiln(resume, plan_env());
  ASSERT_EQ(c.code, 0) << c.text();
  EXPECT_NE(c.out.find("resuming at step 4"), std::string::npos) << c.text();
  EXPECT_EQ(read_bytes(dir + "/model.safetensors"), read_bytes(whole + "/model.safetensors"));
}

TEST(Faults, SaveOnAFullTmpfsKeepsThePreviousCheckpoint) {
  // A real full disk: a small tmpfs, mounted in a private mount namespace (root only;
  // skipped elsewhere). Checkpoint-2 and -4 are saved, then the tmpfs is shrunk to what
  // they use plus room for model.safetensors, and the resumed run's save at step 6 runs
  // out of space (ENOSPC) in optimizer.safetensors.
  auto eight = [](const std::string& out) {
    std::string a;
    for (auto& w : mlp_args(out)) a += (a.empty() ? "" : " ") + (w == std::to_string(kSteps) ? std::string("8") : w);
    return a;
  };
  const std::string ref = kiln::testing::fresh_tmpdir("faults_tmpfs_ref");
  std::vector<std::string> ref_args = split(eight(ref));
  Result w = run_kiln(ref_args, plan_env());
  ASSERT_EQ(w.code, 0) << w.text();
  const std::string dir = kiln::testing::fresh_tmpdir("faults_tmpfs");
  const std::string m = dir + "/mnt", out = m + "/out";
  const std::string script = "M=" + m +
                             "; mkdir -p $M; mount -t tmpfs -o size=4m kiln_faults $M 2>/dev/null || exit 77\n"
                             "KILN_FAULT_KILL=step:5 '" +
                             kBin + "' " + eight(out) +
                             " >/dev/null 2>&1\n"
                             "used=$(df -B1 --output=used $M | tail -1 | tr -d ' ')\n"
                             "mount -o remount,size=$((used + 100 * 1024)) $M || exit 3\n"
                             "'" +
                             kBin + "' " + eight(out) + " --resume_from_checkpoint latest > " + dir + "/run.out 2> " +
                             dir +
                             "/run.err\n"
                             "echo $? > " +
                             dir +
                             "/run.code\n"
                             "cp -a " +
                             out + " " + dir +
                             "/copy\n"
                             "umount $M\n";
  Plan p = plan_env();
  p.binary = "/usr/bin/unshare";
  Result r = run_kiln({"-m", "--propagation", "private", "sh", "-c", script}, p);
  if (r.exited && (r.code == 77 || r.code == 127 || r.code == 1) && !fs::exists(dir + "/run.code"))
    GTEST_SKIP() << "no private tmpfs here (needs root and unshare): " << r.text();
  ASSERT_EQ(r.code, 0) << r.text();
  const std::string err = read_bytes(dir + "/run.err");
  EXPECT_EQ(read_bytes(dir + "/run.code"), "1\n") << err;
  ASSERT_EQ(lines(err).size(), 1u) << err;
  EXPECT_NE(err.find("kiln: error: checkpoint '" + out + "/checkpoint-6' not saved: "), std::string::npos) << err;
  EXPECT_NE(err.find("No space left on device"), std::string::npos) << err;
  const std::string copy = dir + "/copy";
  EXPECT_FALSE(fs::exists(copy + "/checkpoint-6"));
  EXPECT_EQ(tmp_leftovers(copy), std::vector<std::string>{});
  for (const char* f : {"model.safetensors", "optimizer.safetensors"})
    EXPECT_EQ(read_bytes(copy + "/checkpoint-4/" + f), read_bytes(ref + "/checkpoint-4/" + f)) << f;
  // The checkpoint left loads and ends where the uninterrupted run does.
  Result c = run_kiln(with(split(eight(copy)), "--resume_from_checkpoint latest"), plan_env());
  ASSERT_EQ(c.code, 0) << c.text();
  EXPECT_NE(c.out.find("resuming at step 4"), std::string::npos) << c.text();
  EXPECT_EQ(read_bytes(copy + "/model.safetensors"), read_bytes(ref + "/model.safetensors"));
}

// ------------------------------------------------------------------ SIGTERM / SIGINT
namespace {
/// A run long enough to be signalled mid-training (constant LR: the schedule does not
/// depend on --max_steps, so a resume with fewer steps continues the same trajectory).
std::vector<std::string> long_args(const std::string& out, const std::string& more) {
  return with(
      split("train examples/mlp_digits/model.onnx --train_data input=examples/mlp_digits/fixtures/batch_input.npy "
            "--train_data labels=examples/mlp_digits/fixtures/batch_labels.npy --per_device_train_batch_size 4 "
            "--lr_scheduler_type constant --logging_steps 10 --seed 3 --output_dir " +
            out),
      more);
}
/// on_output hook: sends `sigs` (in order) once a log line of step >= 30 has appeared.
std::function<bool(pid_t, const std::string&)> signal_after_steps(std::vector<int> sigs, bool stop_first = false) {
  return [sigs, stop_first](pid_t pid, const std::string& out) {
    if (out.find("step 30/") == std::string::npos) return false;
    if (stop_first) ::kill(pid, SIGSTOP);
    for (int s : sigs) ::kill(pid, s);
    if (stop_first) ::kill(pid, SIGCONT);
    return true;
  };
}
int logged_last_step(const std::string& err) {
  std::smatch m;
  static const std::regex re("stopped after step ([0-9]+) of");
  return std::regex_search(err, m, re) ? std::stoi(m[1]) : -1;
}
}  // namespace

TEST(Faults, SigtermStopsAfterTheStepWithACheckpoint) {
  const std::string dir = kiln::testing::fresh_tmpdir("faults_sigterm");
  Plan p = plan_env();
  p.on_output = signal_after_steps({SIGTERM});
  Result r = run_kiln(long_args(dir, "--max_steps 10000000 --save_steps 1000000"), p);
  ASSERT_TRUE(r.exited) << r.text();
  EXPECT_EQ(r.code, 128 + SIGTERM) << r.text();
  const auto err = lines(r.err);
  ASSERT_EQ(err.size(), 1u) << r.text();
  const int n = logged_last_step(err[0]);
  ASSERT_GE(n, 30) << r.text();
  EXPECT_NE(err[0].find("kiln: SIGTERM: stopped after step " + std::to_string(n) + " of 10000000; saved " + dir +
                        "/checkpoint-" + std::to_string(n) + " (continue with --resume_from_checkpoint latest)"),
            std::string::npos)
      << err[0];
  auto ck = kiln::runtime::load_checkpoint(dir + "/checkpoint-" + std::to_string(n));
  ASSERT_TRUE(static_cast<bool>(ck)) << ck.message();
  EXPECT_EQ(ck->state.global_step, n);
  EXPECT_FALSE(fs::exists(dir + "/model.onnx")) << "a stopped run wrote the trained model";
  EXPECT_EQ(tmp_leftovers(dir), std::vector<std::string>{});
  // The checkpoint continues the run: 4 more steps equal an uninterrupted run of n + 4.
  Result c =
      run_kiln(long_args(dir, "--max_steps " + std::to_string(n + 4) + " --resume_from_checkpoint latest"), plan_env());
  ASSERT_EQ(c.code, 0) << c.text();
  const std::string whole = kiln::testing::fresh_tmpdir("faults_sigterm_whole");
  Result w = run_kiln(long_args(whole, "--max_steps " + std::to_string(n + 4)), plan_env());
  ASSERT_EQ(w.code, 0) << w.text();
  EXPECT_EQ(read_bytes(dir + "/model.safetensors"), read_bytes(whole + "/model.safetensors"));
}

TEST(Faults, SigintWithoutSaveStepsStopsAndSaysNothingWasSaved) {
  const std::string dir = kiln::testing::fresh_tmpdir("faults_sigint");
  Plan p = plan_env();
  p.on_output = signal_after_steps({SIGINT});
  Result r = run_kiln(long_args(dir, "--max_steps 10000000"), p);
  ASSERT_TRUE(r.exited) << r.text();
  EXPECT_EQ(r.code, 128 + SIGINT) << r.text();
  const auto err = lines(r.err);
  ASSERT_EQ(err.size(), 1u) << r.text();
  EXPECT_NE(err[0].find("kiln: SIGINT: stopped after step "), std::string::npos) << err[0];
  EXPECT_NE(err[0].find("; no checkpoint saved (--save_steps is 0)"), std::string::npos) << err[0];
  EXPECT_TRUE(kiln::runtime::list_checkpoints(dir).empty());
  EXPECT_FALSE(fs::exists(dir + "/model.onnx"));
  // A run whose steps reach no multiple of --save_steps does not save either (its output
  // folder was not checked for other runs' checkpoints, which a save could replace).
  const std::string dir2 = kiln::testing::fresh_tmpdir("faults_sigint_nosave");
  Result r2 = run_kiln(long_args(dir2, "--max_steps 10000000 --save_steps 20000000"), p);
  EXPECT_EQ(r2.code, 128 + SIGINT) << r2.text();
  EXPECT_NE(r2.err.find("; not saved (this run's steps reach no multiple of --save_steps)"), std::string::npos)
      << r2.text();
  EXPECT_TRUE(kiln::runtime::list_checkpoints(dir2).empty());
}

TEST(Faults, CompiledTrainingBinaryStopsOnSigtermToo) {
  const std::string bin = kiln::testing::fresh_tmpdir("faults_aot") + "/bin";
  Result c = run_kiln(split("compile examples/mlp_digits/model.onnx --train_data "
                            "input=examples/mlp_digits/fixtures/batch_input.npy --train_data "
                            "labels=examples/mlp_digits/fixtures/batch_labels.npy --per_device_train_batch_size 4 "
                            "--logging_steps 10 -o " +
                            bin),
                      plan_env());
  ASSERT_EQ(c.code, 0) << c.text();
  const std::string dir = kiln::testing::fresh_tmpdir("faults_aot_out");
  Plan p = plan_env();
  p.binary = bin + "/train";
  p.on_output = signal_after_steps({SIGTERM});
  Result r = run_kiln(split("--max_steps 10000000 --save_steps 1000000 --output_dir " + dir), p);
  ASSERT_TRUE(r.exited) << r.text();
  EXPECT_EQ(r.code, 128 + SIGTERM) << r.text();
  const auto err = lines(r.err);
  ASSERT_EQ(err.size(), 1u) << r.text();
  const int n = logged_last_step(err[0]);
  EXPECT_NE(err[0].find("train: SIGTERM: stopped after step " + std::to_string(n) + " of 10000000; saved "),
            std::string::npos)
      << err[0];
  EXPECT_TRUE(static_cast<bool>(kiln::runtime::load_checkpoint(dir + "/checkpoint-" + std::to_string(n))));
}

TEST(Faults, SecondSignalEndsTheProcessAtOnce) {
  // Both pending while the process is stopped: the first handler asks for a stop, the
  // second signal's default action ends the process.
  const std::string dir = kiln::testing::fresh_tmpdir("faults_second_signal");
  Plan p = plan_env();
  p.on_output = signal_after_steps({SIGINT, SIGTERM}, /*stop_first=*/true);
  Result r = run_kiln(long_args(dir, "--max_steps 10000000 --save_steps 1000000"), p);
  EXPECT_FALSE(r.exited) << r.text();
  EXPECT_TRUE(r.signal == SIGTERM || r.signal == SIGINT) << r.text();
  // Nothing half-saved passes for a checkpoint.
  for (auto& [step, path] : kiln::runtime::list_checkpoints(dir)) {
    auto ck = kiln::runtime::load_checkpoint(path);
    EXPECT_TRUE(static_cast<bool>(ck)) << ck.message();
  }
}

// ------------------------------------------------------------------ implausible loss
TEST(Faults, ImplausiblyLargeFiniteLossWarnsOnce) {
  const std::string dir = kiln::testing::fresh_tmpdir("faults_huge_loss");
  auto x = kiln::runtime::io::load_npy(kSrc + "/examples/mlp_digits/fixtures/batch_input.npy");
  ASSERT_TRUE(static_cast<bool>(x)) << x.message();
  for (int64_t i = 0; i < x->numel(); ++i) x->data<float>()[i] = x->data<float>()[i] * 1e24f + 1e24f;
  const std::string big = dir + "/x_huge.npy";
  ASSERT_TRUE(static_cast<bool>(kiln::runtime::io::save_npy(big, *x)));
  Result r = run_kiln(split("train examples/mlp_digits/model.onnx --train_data input=" + big +
                            " --train_data labels=examples/mlp_digits/fixtures/batch_labels.npy "
                            "--per_device_train_batch_size 4 --learning_rate 0 --max_steps 6 --output_dir " +
                            dir + "/out"),
                      plan_env());
  ASSERT_EQ(r.code, 0) << r.text();
  int warned = 0;
  for (auto& l : lines(r.err))
    if (l.find("implausibly large") != std::string::npos) {
      ++warned;
      EXPECT_NE(l.find("kiln: warning: loss is "), std::string::npos) << l;
      EXPECT_NE(l.find(" at step 1, implausibly large"), std::string::npos) << l;
    }
  EXPECT_EQ(warned, 1) << r.text();
  // An ordinary loss gets none.
  Result ok = run_kiln(with(mlp_args(dir + "/plain"), ""), plan_env());
  ASSERT_EQ(ok.code, 0) << ok.text();
  EXPECT_EQ(ok.err.find("implausibly"), std::string::npos) << ok.text();
}
