// Compiles every FusedKernel node of a graph, through the in-memory and on-disk compile
// cache; see program.h for the cache key and the .kcache file layout.
#include "codegen/cpu/program.h"

#include <unistd.h>

#include <array>
#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <map>
#include <mutex>
#include <set>
#include <sstream>

#include "codegen/lower.h"
#include "llvm/Config/llvm-config.h"
#include "llvm/ADT/StringRef.h"
#include "llvm/Support/SHA256.h"

#ifndef KILN_VERSION
#define KILN_VERSION "0.1.0"
#endif

namespace kiln::codegen {

namespace {

namespace fs = std::filesystem;

/// Bumped whenever the payload layout or anything the key does not cover changes.
constexpr uint32_t kCacheFormatVersion = 1;
constexpr char kMagic[8] = {'K', 'I', 'L', 'N', 'C', 'C', 'H', '\0'};
constexpr size_t kHeaderSize = 8 + 4 + 8 + 32;

double seconds_since(std::chrono::steady_clock::time_point t0) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

std::string hex(const std::array<uint8_t, 32>& h) {
  static const char* d = "0123456789abcdef";
  std::string s;
  for (uint8_t b : h) {
    s += d[b >> 4];
    s += d[b & 15];
  }
  return s;
}

std::array<uint8_t, 32> sha256(const std::string& s) {
  llvm::SHA256 h;
  h.update(llvm::StringRef(s));
  return h.final();
}

/// The cache key: SHA-256 over length-prefixed fields (so that no two field lists collide).
std::string cache_key(const std::vector<Kernel>& kernels, const std::string& prefix) {
  llvm::SHA256 h;
  auto field = [&](const std::string& s) {
    const std::string len = std::to_string(s.size()) + ":";
    h.update(llvm::StringRef(len));
    h.update(llvm::StringRef(s));
  };
  field("kiln-cpu-compile-cache/" + std::to_string(kCacheFormatVersion));
  field(KILN_VERSION);
  field(LLVM_VERSION_STRING);
  field(host_cpu_description());
  field(prefix);
  field(std::to_string(kernels.size()));
  for (const Kernel& k : kernels) field(k.to_string());
  return hex(h.final());
}

// ---- payload serialization (little-endian fixed-width integers, length-prefixed strings)

class Writer {
 public:
  void u64(uint64_t v) {
    for (int i = 0; i < 8; ++i) s_ += static_cast<char>((v >> (8 * i)) & 0xff);
  }
  void i64(int64_t v) { u64(static_cast<uint64_t>(v)); }
  void f64(double v) {
    uint64_t u;
    std::memcpy(&u, &v, 8);
    u64(u);
  }
  void str(const std::string& v) {
    u64(v.size());
    s_ += v;
  }
  std::string& data() { return s_; }

 private:
  std::string s_;
};

class Reader {
 public:
  explicit Reader(const std::string& s) : s_(s) {}
  bool u64(uint64_t& v) {
    if (s_.size() - pos_ < 8) return false;
    v = 0;
    for (int i = 0; i < 8; ++i) v |= static_cast<uint64_t>(static_cast<uint8_t>(s_[pos_ + i])) << (8 * i);
    pos_ += 8;
    return true;
  }
  bool i64(int64_t& v) {
    uint64_t u;
    if (!u64(u)) return false;
    v = static_cast<int64_t>(u);
    return true;
  }
  bool f64(double& v) {
    uint64_t u;
    if (!u64(u)) return false;
    std::memcpy(&v, &u, 8);
    return true;
  }
  bool str(std::string& v) {
    uint64_t n;
    if (!u64(n) || n > s_.size() - pos_) return false;
    v.assign(s_, pos_, n);
    pos_ += n;
    return true;
  }
  bool at_end() const { return pos_ == s_.size(); }

 private:
  const std::string& s_;
  size_t pos_ = 0;
};

std::string encode_payload(const std::string& key, const CpuObject& obj) {
  Writer w;
  w.str(key);
  w.u64(obj.kernels.size());
  for (size_t i = 0; i < obj.kernels.size(); ++i) {
    const CpuKernel& k = obj.kernels[i];
    w.str(k.name);
    w.i64(k.parallel_dim);
    w.i64(k.parallel_extent);
    w.i64(k.work_per_index);
    w.str(obj.symbols[i]);
  }
  w.f64(obj.stats.emit_s);
  w.f64(obj.stats.optimize_s);
  w.f64(obj.stats.codegen_s);
  w.i64(obj.stats.num_kernels);
  w.i64(obj.stats.num_unique);
  w.str(obj.llvm_ir);
  w.str(obj.object);
  return std::move(w.data());
}

/// Decodes a payload; "" on success, else why it is unusable.
std::string decode_payload(const std::string& p, std::string& key, CpuObject& obj) {
  Reader r(p);
  uint64_t n;
  if (!r.str(key) || !r.u64(n) || n > p.size()) return "corrupt (bad kernel table)";
  for (uint64_t i = 0; i < n; ++i) {
    CpuKernel k;
    int64_t dim;
    std::string sym;
    if (!r.str(k.name) || !r.i64(dim) || !r.i64(k.parallel_extent) || !r.i64(k.work_per_index) || !r.str(sym))
      return "corrupt (bad kernel table)";
    k.parallel_dim = static_cast<int>(dim);
    obj.kernels.push_back(std::move(k));
    obj.symbols.push_back(std::move(sym));
  }
  int64_t nk, nu;
  if (!r.f64(obj.stats.emit_s) || !r.f64(obj.stats.optimize_s) || !r.f64(obj.stats.codegen_s) || !r.i64(nk) ||
      !r.i64(nu) || !r.str(obj.llvm_ir) || !r.str(obj.object) || !r.at_end())
    return "corrupt (bad payload layout)";
  obj.stats.num_kernels = static_cast<int>(nk);
  obj.stats.num_unique = static_cast<int>(nu);
  return "";
}

std::string encode_file(const std::string& payload) {
  Writer w;
  w.data().append(kMagic, 8);
  for (int i = 0; i < 4; ++i) w.data() += static_cast<char>((kCacheFormatVersion >> (8 * i)) & 0xff);
  w.u64(payload.size());
  const auto h = sha256(payload);
  w.data().append(reinterpret_cast<const char*>(h.data()), h.size());
  w.data() += payload;
  return std::move(w.data());
}

/// Checks header, length and hash of a .kcache file's bytes; "" when valid (payload set).
std::string check_file(const std::string& bytes, std::string& payload) {
  if (bytes.size() < kHeaderSize) return "truncated (" + std::to_string(bytes.size()) + " bytes, no complete header)";
  if (std::memcmp(bytes.data(), kMagic, 8) != 0) return "corrupt (bad magic)";
  uint32_t version = 0;
  for (int i = 0; i < 4; ++i) version |= static_cast<uint32_t>(static_cast<uint8_t>(bytes[8 + i])) << (8 * i);
  if (version != kCacheFormatVersion)
    return "stale (format version " + std::to_string(version) + ", expected " + std::to_string(kCacheFormatVersion) + ")";
  uint64_t len = 0;
  for (int i = 0; i < 8; ++i) len |= static_cast<uint64_t>(static_cast<uint8_t>(bytes[12 + i])) << (8 * i);
  const uint64_t have = bytes.size() - kHeaderSize;
  if (have < len) return "truncated (payload " + std::to_string(have) + " of " + std::to_string(len) + " bytes)";
  if (have > len) return "corrupt (" + std::to_string(have - len) + " bytes after the payload)";
  payload.assign(bytes, kHeaderSize, len);
  const auto h = sha256(payload);
  if (std::memcmp(h.data(), bytes.data() + 20, 32) != 0) return "corrupt (payload SHA-256 mismatch)";
  return "";
}

void warn(const std::string& line) {
  const std::string s = "kiln: warning: " + line + "\n";
  std::fputs(s.c_str(), stderr);
  std::fflush(stderr);
}

/// Writes `bytes` to `path` atomically (temp file in the same dir, then rename); "" or the error.
std::string write_atomic(const fs::path& path, const std::string& bytes) {
  std::error_code ec;
  fs::create_directories(path.parent_path(), ec);
  if (ec) return "cannot create " + path.parent_path().string() + ": " + ec.message();
  static std::atomic<uint64_t> counter{0};
  const fs::path tmp = path.string() + ".tmp." + std::to_string(::getpid()) + "." + std::to_string(counter++);
  {
    std::ofstream f(tmp, std::ios::binary | std::ios::trunc);
    if (!f) return "cannot create " + tmp.string() + ": " + std::strerror(errno);
    f.write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
    f.close();
    if (!f) {
      fs::remove(tmp, ec);
      return "cannot write " + tmp.string();
    }
  }
  fs::rename(tmp, path, ec);
  if (ec) {
    std::error_code ec2;
    fs::remove(tmp, ec2);
    return "cannot rename " + tmp.string() + " to " + path.string() + ": " + ec.message();
  }
  return "";
}

struct MemoryEntry {
  std::shared_ptr<CpuModule> module;
  std::shared_ptr<const CpuObject> object;
};

std::mutex& memory_mutex() {
  static std::mutex m;
  return m;
}
std::map<std::string, MemoryEntry>& memory_cache() {
  static std::map<std::string, MemoryEntry> c;
  return c;
}

/// "" when the entry's kernels are those of `kernels` (count and names), else why not.
std::string match_kernels(const CpuObject& obj, const std::vector<Kernel>& kernels) {
  if (obj.kernels.size() != kernels.size() || obj.symbols.size() != kernels.size())
    return "stale (" + std::to_string(obj.kernels.size()) + " kernels, expected " + std::to_string(kernels.size()) + ")";
  for (size_t i = 0; i < kernels.size(); ++i)
    if (obj.kernels[i].name != kernels[i].name)
      return "stale (kernel " + std::to_string(i) + " is '" + obj.kernels[i].name + "', expected '" + kernels[i].name +
             "')";
  return "";
}

std::string kernels_summary(const CpuObject& obj) {
  std::ostringstream os;
  os << obj.kernels.size() << " kernels, " << obj.stats.num_unique << " functions, " << obj.object.size()
     << " bytes of object code";
  return os.str();
}

}  // namespace

std::string default_cache_dir() {
  if (const char* d = std::getenv("KILN_CACHE_DIR"); d && *d) return d;
  if (const char* x = std::getenv("XDG_CACHE_HOME"); x && *x) return (fs::path(x) / "kiln").string();
  if (const char* h = std::getenv("HOME"); h && *h) return (fs::path(h) / ".cache" / "kiln").string();
  return ".kiln_cache";
}

void clear_cpu_memory_cache() {
  std::lock_guard<std::mutex> lock(memory_mutex());
  memory_cache().clear();
}

Expected<std::shared_ptr<CpuProgram>> compile_graph_cpu(const ir::Graph& g) {
  return compile_graph_cpu(g, CpuCompileOptions{});
}

Expected<std::shared_ptr<CpuProgram>> compile_graph_cpu(const ir::Graph& g, const CpuCompileOptions& opts) {
  auto prog = std::make_shared<CpuProgram>();
  prog->cache_status = "off";
  const auto t0 = std::chrono::steady_clock::now();
  std::vector<const ir::Node*> nodes = fused_nodes(g);
  for (const ir::Node* n : nodes) {
    KILN_ASSIGN_OR_RETURN(Kernel k, lower_fused(*n));
    prog->kernels.push_back(std::move(k));
  }
  prog->lower_s = seconds_since(t0);
  if (nodes.empty()) return prog;

  auto log = [&](const std::string& topic, const std::string& text) {
    if (opts.log) opts.log(topic, text);
  };
  prog->cache_key = cache_key(prog->kernels, opts.symbol_prefix);
  const std::string& key = prog->cache_key;
  const auto t_lookup = std::chrono::steady_clock::now();

  // 1. In memory.
  if (opts.use_cache) {
    std::lock_guard<std::mutex> lock(memory_mutex());
    auto it = memory_cache().find(key);
    if (it != memory_cache().end() && match_kernels(*it->second.object, prog->kernels).empty()) {
      prog->module = it->second.module;
      prog->object = it->second.object;
      prog->cache_status = "memory hit";
    }
  }

  // 2. On disk.
  const fs::path dir = opts.cache_dir.empty() ? fs::path(default_cache_dir()) : fs::path(opts.cache_dir);
  const fs::path path = dir / (key + ".kcache");
  bool rewrite = false;  // a bad entry was found: overwrite it
  if (opts.use_cache && !prog->module) {
    std::error_code ec;
    if (fs::exists(path, ec)) {
      std::string bytes, payload, why;
      if (!fs::is_regular_file(path, ec)) {
        why = "not a regular file";
      } else {
        try {
          std::ifstream f(path, std::ios::binary);
          if (!f) why = "unreadable";
          else bytes.assign(std::istreambuf_iterator<char>(f), std::istreambuf_iterator<char>());
        } catch (const std::exception& e) {
          why = std::string("unreadable (") + e.what() + ")";
        }
      }
      if (why.empty()) why = check_file(bytes, payload);
      auto obj = std::make_shared<CpuObject>();
      std::string stored_key;
      if (why.empty()) why = decode_payload(payload, stored_key, *obj);
      if (why.empty() && stored_key != key) why = "stale (its key is " + stored_key.substr(0, 16) + "...)";
      if (why.empty()) why = match_kernels(*obj, prog->kernels);
      if (why.empty()) {
        // The LLVM times of the original compile are not spent again.
        obj->stats.emit_s = obj->stats.optimize_s = obj->stats.codegen_s = 0;
        auto mod = load_cpu_object(*obj);
        if (mod) {
          prog->module = std::shared_ptr<CpuModule>(std::move(*mod));
          prog->object = std::move(obj);
          prog->cache_status = "disk hit";
        } else {
          why = "unloadable (" + mod.message() + ")";
        }
      }
      if (!why.empty()) {
        warn("compile cache entry " + path.string() + " is " + why + "; rebuilding");
        rewrite = true;
      }
    }
  }

  // 3. Compile.
  if (!prog->module) {
    CpuObjectOptions oo;
    oo.symbol_prefix = opts.symbol_prefix;
    KILN_ASSIGN_OR_RETURN(CpuObject obj, compile_cpu_object(prog->kernels, oo));
    auto shared = std::make_shared<const CpuObject>(std::move(obj));
    KILN_ASSIGN_OR_RETURN(auto mod, load_cpu_object(*shared));
    prog->module = std::shared_ptr<CpuModule>(std::move(mod));
    prog->object = shared;
    const CpuCompileStats& st = prog->module->stats();
    std::ostringstream os;
    os.precision(3);
    os << (opts.use_cache ? "miss " : "off (cache disabled) ") << key << ": compiled " << kernels_summary(*shared)
       << " in " << st.emit_s + st.optimize_s + st.codegen_s << " s (emit " << st.emit_s << ", O3 " << st.optimize_s
       << ", codegen+link " << st.codegen_s << ")";
    log("cache", os.str());
    if (opts.use_cache) {
      prog->cache_status = "miss";
      const std::string err = write_atomic(path, encode_file(encode_payload(key, *shared)));
      if (err.empty()) log("cache", std::string(rewrite ? "rewrote " : "stored ") + path.string());
      else {
        // One warning per cache folder and process (train and eval programs share it).
        static std::mutex warned_mutex;
        static std::set<std::string> warned;
        std::lock_guard<std::mutex> lock(warned_mutex);
        if (warned.insert(dir.string()).second)
          warn("cannot write compile cache entries in " + dir.string() + " (" + err + "); continuing without the cache");
      }
    }
  } else {
    std::ostringstream os;
    os.precision(3);
    os << prog->cache_status << " " << key << ": " << kernels_summary(*prog->object) << " in "
       << seconds_since(t_lookup) << " s" << (prog->cache_status == "disk hit" ? " from " + path.string() : "");
    log("cache", os.str());
  }
  if (opts.use_cache) {
    std::lock_guard<std::mutex> lock(memory_mutex());
    memory_cache()[key] = MemoryEntry{prog->module, prog->object};
  }

  if (opts.log) {
    for (const Kernel& k : prog->kernels) log("output_code", k.to_string());
    log("output_code", prog->object->llvm_ir);
  }

  const auto& ks = prog->module->kernels();
  if (ks.size() != nodes.size()) return Status::error("compile_cpu returned a wrong number of kernels");
  for (size_t i = 0; i < nodes.size(); ++i) prog->by_node[nodes[i]->name] = &ks[i];
  return prog;
}

}  // namespace kiln::codegen
