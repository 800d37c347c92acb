// TensorBoard event files (--report_to tensorboard): the record format of TensorFlow's
// TFRecord (u64 length, masked CRC32C of the length, the bytes, masked CRC32C of the
// bytes) holding Event protobufs (runtime/proto/tensorboard_event.proto, TensorBoard's
// field numbers): first file_version "brain.Event:2", then one Summary of scalars per
// metrics.jsonl line, tagged as Hugging Face's TensorBoardCallback tags them.
#pragma once
#include <cstdint>
#include <fstream>
#include <nlohmann/json.hpp>
#include <string>
#include <utility>
#include <vector>

#include "ir/status.h"

namespace kiln::runtime {

/// CRC-32C (Castagnoli) of `n` bytes.
uint32_t crc32c(const void* data, size_t n);
/// TFRecord's mask of a CRC: ((crc >> 15) | (crc << 17)) + 0xa282ead8.
uint32_t masked_crc32c(const void* data, size_t n);

/// Hugging Face's rewrite_logs: "eval_loss" -> "eval/loss", "test_x" -> "test/x", any
/// other key k -> "train/k".
std::string tensorboard_tag(const std::string& key);

/// The default --logging_dir: OUTPUT_DIR/runs/<Mon><DD>_<HH>-<MM>-<SS>_<host> (Hugging
/// Face's, local time).
std::string default_logging_dir(const std::string& output_dir);

/// Appends events to one events.out.tfevents.<time>.<host>.<pid>.0 file of a folder.
class TensorBoardWriter {
 public:
  /// Creates `dir` (and parents) and the event file, and writes the file_version event.
  Status open(const std::string& dir);
  bool is_open() const { return out_.is_open(); }
  /// The event file's path.
  const std::string& path() const { return path_; }
  /// One event at `step` with a Summary of (tag, value) scalars, stored as float32.
  Status write_scalars(int64_t step, const std::vector<std::pair<std::string, double>>& scalars);
  /// The numbers of a metrics.jsonl line as scalars at its "step": every key but "step",
  /// tagged by tensorboard_tag; null (NaN) values are left out.
  Status write_metrics(const nlohmann::json& line);

 private:
  Status write_record(const std::string& bytes);
  std::string path_;
  std::ofstream out_;
};

}  // namespace kiln::runtime
