// Trainer checkpoints (Hugging Face Trainer layout):
//   output_dir/checkpoint-N/model.safetensors      parameters and buffers, named by ONNX initializer
//   output_dir/checkpoint-N/optimizer.safetensors  optimizer state and counters (the "step" counter)
//   output_dir/checkpoint-N/trainer_state.json     global_step, epoch, data position, log accumulators, config
//   output_dir/checkpoint-N/metrics.jsonl          the log lines up to step N (HF: log_history), restored on resume
// A checkpoint is written into checkpoint-N.tmp and renamed when complete, so a crash
// never leaves a half-written checkpoint-N and never destroys an existing one.
#pragma once
#include <cstdint>
#include <map>
#include <memory>
#include <nlohmann/json.hpp>
#include <string>
#include <utility>
#include <vector>

#include "ir/status.h"
#include "ir/tensor.h"

namespace kiln::runtime {

/// Everything besides tensors that a resumed run needs to continue exactly.
struct TrainerState {
  int64_t global_step = 0;  ///< optimizer steps done
  double epoch = 0;         ///< global_step / steps_per_epoch
  int64_t total_steps = 0;
  int64_t steps_per_epoch = 0;  ///< data position: batch (global_step / spe, global_step % spe)
  int64_t rows_per_step = 0;
  uint64_t seed = 0;  ///< data order and dropout derive from (seed, epoch, index / step)
  // Logging accumulators since the last log line (HF: tr_loss), so logged means match.
  double log_loss_sum = 0;
  int64_t log_loss_count = 0;
  double log_time_sum = 0;
  double total_loss_sum = 0;  ///< for the final train_loss
  std::string config_json;    ///< config_to_json() of the run
};

/// A checkpoint's contents.
struct Checkpoint {
  std::map<std::string, ir::Tensor> model;      ///< parameters and buffers
  std::map<std::string, ir::Tensor> optimizer;  ///< optimizer state and counters
  TrainerState state;
  /// Path of the run's metrics.jsonl up to this step ("" = none), copied into the
  /// checkpoint as checkpoint-N/metrics.jsonl: a resume restores its log history from it,
  /// as Hugging Face's trainer_state.json log_history, not from whatever output_dir's
  /// metrics.jsonl holds then.
  std::string log_history;
};

/// Creates `dir` (and parents) and checks that a file can be written in it.
/// Error: "output_dir 'DIR': cannot create directory (reason)" / "... is not writable".
Status prepare_output_dir(const std::string& dir);

/// Writes checkpoint `dir` atomically: into `dir`.tmp, then renamed to `dir` (an
/// existing `dir` is replaced only after the new one is complete).
Status save_checkpoint(const std::string& dir, const Checkpoint& ckpt);
/// Reads a checkpoint directory. Errors name the directory and the missing/bad file.
Expected<Checkpoint> load_checkpoint(const std::string& dir);

/// The step N of a folder or file name "checkpoint-N<suffix>" (N: 1 to 18 digits), else -1.
int64_t checkpoint_step(const std::string& name, const std::string& suffix = "");

/// checkpoint-N directories of `output_dir`, sorted by N (complete ones only, not *.tmp).
std::vector<std::pair<int64_t, std::string>> list_checkpoints(const std::string& output_dir);
/// Deletes the oldest checkpoints so that at most `limit` remain (limit 0: keep all); each
/// is renamed to checkpoint-N.tmp before its files are deleted.
Status rotate_checkpoints(const std::string& output_dir, int64_t limit);

/// Removes the checkpoint-N.tmp folders of output_dir: saves that were interrupted (a
/// complete save is renamed to checkpoint-N). Call only while holding OutputDirLock, so
/// that no other run is writing one. checkpoint-N.old folders are left alone. Returns
/// one note per folder removed.
std::vector<std::string> remove_interrupted_saves(const std::string& output_dir);

/// An exclusive advisory lock (flock) on output_dir/.kiln.lock, held by a training run
/// that writes into output_dir for as long as the object lives, so that a second run
/// cannot remove or overwrite the first one's files. Errors: the lock file cannot be
/// created, or another process holds the lock.
class OutputDirLock {
 public:
  static Expected<std::unique_ptr<OutputDirLock>> acquire(const std::string& output_dir);
  ~OutputDirLock();
  OutputDirLock(const OutputDirLock&) = delete;
  OutputDirLock& operator=(const OutputDirLock&) = delete;

 private:
  explicit OutputDirLock(int fd) : fd_(fd) {}
  int fd_ = -1;
};

/// trainer_state.json <-> TrainerState.
nlohmann::json trainer_state_to_json(const TrainerState& s);
Expected<TrainerState> trainer_state_from_json(const nlohmann::json& j, const std::string& origin);

}  // namespace kiln::runtime
