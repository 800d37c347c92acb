// Model bytes by path (registered in memory or read from disk); see model_bytes.h.
#include "frontend/model_bytes.h"

#include <filesystem>
#include <fstream>
#include <map>
#include <mutex>
#include <sstream>

namespace kiln::frontend {

namespace {
std::mutex& registry_mutex() {
  static std::mutex m;
  return m;
}
std::map<std::string, std::string_view>& registry() {
  static std::map<std::string, std::string_view> r;
  return r;
}
}  // namespace

void register_model_bytes(const std::string& path, std::string_view bytes) {
  std::lock_guard<std::mutex> lock(registry_mutex());
  registry()[path] = bytes;
}

bool is_registered_model(const std::string& path) {
  std::lock_guard<std::mutex> lock(registry_mutex());
  return registry().count(path) > 0;
}

Expected<std::string> read_model_bytes(const std::string& path) {
  {
    std::lock_guard<std::mutex> lock(registry_mutex());
    auto it = registry().find(path);
    if (it != registry().end()) return std::string(it->second);
  }
  namespace fs = std::filesystem;
  std::error_code ec;
  if (!fs::exists(path, ec)) return Status::error(path + ": file not found");
  if (fs::is_directory(path, ec)) return Status::error(path + ": is a directory, not an ONNX model file");
  // A device or FIFO would be read without end (/dev/zero) or block forever.
  if (!fs::is_regular_file(path, ec))
    return Status::error(path + ": not a regular file (a device, FIFO or socket), not an ONNX model file");
  std::ifstream in(path, std::ios::binary);
  if (!in) return Status::error(path + ": cannot open file");
  std::stringstream ss;
  ss << in.rdbuf();
  if (!in.good() && !in.eof()) return Status::error(path + ": read error");
  return ss.str();
}

}  // namespace kiln::frontend
