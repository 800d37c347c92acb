// Stopping a training run on SIGINT/SIGTERM, file-size signals, and the kill test hook.
//
// While a StopOnSignal object lives, the first SIGINT or SIGTERM only records the signal:
// the trainer finishes the step it is in, saves a checkpoint when --save_steps is set, and
// the command exits with 128 + the signal's number (130 for SIGINT, 143 for SIGTERM). A
// second SIGINT or SIGTERM ends the process at once (the default action, re-raised). A
// save cut off that way leaves checkpoint-N.tmp, which the next run removes.
#pragma once

namespace kiln::runtime {

/// Installs the handlers; the destructor restores the previous ones (a recorded signal
/// stays recorded: stop_signal()).
class StopOnSignal {
 public:
  StopOnSignal();
  ~StopOnSignal();
  StopOnSignal(const StopOnSignal&) = delete;
  StopOnSignal& operator=(const StopOnSignal&) = delete;
};

/// The first SIGINT/SIGTERM received while a StopOnSignal lived (0: none).
int stop_signal();
/// Forgets a recorded signal (tests).
void clear_stop_signal();
/// "SIGINT", "SIGTERM", else "signal N".
const char* signal_name(int sig);

/// Ignores SIGXFSZ, so that a write past RLIMIT_FSIZE fails with EFBIG (reported as an
/// error naming the file, the previous checkpoint kept) instead of killing the process.
void ignore_file_size_signal();

/// Test hook for the kill-and-resume tests (tests/e2e/faults_test.cpp): with the
/// environment variable KILN_FAULT_KILL=NAME:N, the N-th call of fault_point(NAME) in
/// this process raises SIGKILL. Points: "step" (after an optimizer step, before its log
/// and save), "write" (a file half written: after its header), "publish" (a complete
/// file.tmp before its rename), "checkpoint" (a complete checkpoint-N.tmp before its
/// rename), "metrics" (metrics.jsonl.tmp written before it replaces metrics.jsonl on a
/// resume). KILN_FAULT_STOP=NAME:N raises SIGSTOP instead (a hung rank of a
/// data-parallel job: tests/e2e/distributed_test.cpp). Unset (always, outside tests), a
/// call costs a load and a compare.
void fault_point(const char* name);

}  // namespace kiln::runtime
