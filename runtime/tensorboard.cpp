// TensorBoard event files (see tensorboard.h).
#include "runtime/tensorboard.h"

#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <ctime>
#include <filesystem>

#include "tensorboard_event.pb.h"

namespace kiln::runtime {

namespace {
const uint32_t* crc_table() {
  static uint32_t table[256];
  static bool init = [] {
    for (uint32_t i = 0; i < 256; ++i) {
      uint32_t c = i;
      for (int k = 0; k < 8; ++k) c = (c & 1) ? (c >> 1) ^ 0x82F63B78u : c >> 1;  // reflected Castagnoli
      table[i] = c;
    }
    return true;
  }();
  (void)init;
  return table;
}

std::string hostname() {
  char buf[256] = {0};
  if (gethostname(buf, sizeof buf - 1) != 0 || !buf[0]) return "localhost";
  return buf;
}

double wall_time() {
  return std::chrono::duration<double>(std::chrono::system_clock::now().time_since_epoch()).count();
}
}  // namespace

uint32_t crc32c(const void* data, size_t n) {
  const uint32_t* t = crc_table();
  const auto* p = static_cast<const unsigned char*>(data);
  uint32_t c = 0xFFFFFFFFu;
  for (size_t i = 0; i < n; ++i) c = t[(c ^ p[i]) & 0xFF] ^ (c >> 8);
  return c ^ 0xFFFFFFFFu;
}

uint32_t masked_crc32c(const void* data, size_t n) {
  const uint32_t c = crc32c(data, n);
  return ((c >> 15) | (c << 17)) + 0xa282ead8u;
}

std::string tensorboard_tag(const std::string& key) {
  for (const char* prefix : {"eval", "test"}) {
    const std::string p = std::string(prefix) + "_";
    if (key.rfind(p, 0) == 0) return std::string(prefix) + "/" + key.substr(p.size());
  }
  return "train/" + key;
}

std::string default_logging_dir(const std::string& output_dir) {
  std::time_t now = std::time(nullptr);
  std::tm tm{};
  localtime_r(&now, &tm);
  char stamp[64];
  std::strftime(stamp, sizeof stamp, "%b%d_%H-%M-%S", &tm);
  return (std::filesystem::path(output_dir) / "runs" / (std::string(stamp) + "_" + hostname())).string();
}

Status TensorBoardWriter::open(const std::string& dir) {
  std::error_code ec;
  std::filesystem::create_directories(dir, ec);
  if (ec) return Status::error("--logging_dir " + dir + ": cannot create (" + ec.message() + ")");
  char name[512];
  std::snprintf(name, sizeof name, "events.out.tfevents.%010lld.%s.%d.0", static_cast<long long>(std::time(nullptr)),
                hostname().c_str(), static_cast<int>(getpid()));
  path_ = (std::filesystem::path(dir) / name).string();
  out_.open(path_, std::ios::out | std::ios::binary | std::ios::trunc);
  if (!out_) return Status::error(path_ + ": cannot open for writing");
  tensorboard::Event e;
  e.set_wall_time(wall_time());
  e.set_step(0);
  e.set_file_version("brain.Event:2");
  return write_record(e.SerializeAsString());
}

Status TensorBoardWriter::write_record(const std::string& bytes) {
  if (!out_.is_open()) return Status::ok();
  unsigned char header[12];
  const uint64_t len = bytes.size();
  for (int i = 0; i < 8; ++i) header[i] = static_cast<unsigned char>(len >> (8 * i));  // little-endian
  const uint32_t len_crc = masked_crc32c(header, 8);
  for (int i = 0; i < 4; ++i) header[8 + i] = static_cast<unsigned char>(len_crc >> (8 * i));
  const uint32_t data_crc = masked_crc32c(bytes.data(), bytes.size());
  unsigned char footer[4];
  for (int i = 0; i < 4; ++i) footer[i] = static_cast<unsigned char>(data_crc >> (8 * i));
  out_.write(reinterpret_cast<const char*>(header), sizeof header);
  out_.write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
  out_.write(reinterpret_cast<const char*>(footer), sizeof footer);
  out_.flush();  // TensorBoard shows a running job's curves as they grow
  if (!out_) return Status::error(path_ + ": write failed");
  return Status::ok();
}

Status TensorBoardWriter::write_scalars(int64_t step, const std::vector<std::pair<std::string, double>>& scalars) {
  if (!out_.is_open() || scalars.empty()) return Status::ok();
  tensorboard::Event e;
  e.set_wall_time(wall_time());
  e.set_step(step);
  auto* summary = e.mutable_summary();
  for (const auto& [tag, v] : scalars) {
    auto* value = summary->add_value();
    value->set_tag(tag);
    value->set_simple_value(static_cast<float>(v));
  }
  return write_record(e.SerializeAsString());
}

Status TensorBoardWriter::write_metrics(const nlohmann::json& line) {
  std::vector<std::pair<std::string, double>> scalars;
  for (auto it = line.begin(); it != line.end(); ++it) {
    if (it.key() == "step" || !it.value().is_number()) continue;
    scalars.emplace_back(tensorboard_tag(it.key()), it.value().get<double>());
  }
  return write_scalars(line.value("step", int64_t{0}), scalars);
}

}  // namespace kiln::runtime
