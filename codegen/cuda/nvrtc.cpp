// NVRTC front end: CUDA C++ -> cubin/PTX, and ptxas resource reports (see nvrtc.h).
#include "codegen/cuda/nvrtc.h"

#include <glob.h>
#include <nvrtc.h>
#include <sys/stat.h>

#include <cstdlib>
#include <memory>
#include <regex>
#include <sstream>

namespace kiln::codegen {
namespace {

bool file_exists(const std::string& p) {
  struct stat st;
  return ::stat(p.c_str(), &st) == 0;
}

std::vector<std::string> glob_dirs(const std::string& pattern) {
  std::vector<std::string> out;
  glob_t g{};
  if (::glob(pattern.c_str(), 0, nullptr, &g) == 0)
    for (size_t i = 0; i < g.gl_pathc; ++i) out.push_back(g.gl_pathv[i]);
  ::globfree(&g);
  return out;
}

/// The log's error lines (or its first lines) joined into one line, at most ~1500 chars.
std::string condense_log(const std::string& log) {
  std::istringstream is(log);
  std::string line, errs, first;
  while (std::getline(is, line)) {
    if (line.empty()) continue;
    if (first.size() < 600) first += (first.empty() ? "" : " | ") + line;
    if (line.find("error") != std::string::npos && errs.size() < 1500) errs += (errs.empty() ? "" : " | ") + line;
  }
  return errs.empty() ? first : errs;
}

Status nvrtc_fail(const std::string& prog, const std::string& arch, nvrtcResult r, const std::string& log) {
  std::string msg = "nvrtc: " + prog + " for " + arch + ": " + nvrtcGetErrorString(r);
  const std::string c = condense_log(log);
  if (!c.empty()) msg += ": " + c;
  return Status::error(msg);
}

}  // namespace

std::string cuda_include_dir() {
  std::vector<std::string> cands;
  for (const char* env : {"KILN_CUDA_INCLUDE"})
    if (const char* v = std::getenv(env)) cands.push_back(v);
  for (const char* env : {"CUDA_HOME", "CUDA_PATH"})
    if (const char* v = std::getenv(env)) cands.push_back(std::string(v) + "/include");
  cands.push_back("/usr/local/cuda/include");
  for (auto& d : glob_dirs("/usr/local/cuda-*/include")) cands.push_back(d);
  for (const char* pat : {"/usr/local/lib/python3*/dist-packages/nvidia/cu13/include",
                          "/usr/local/lib/python3*/dist-packages/nvidia/cuda_runtime/include",
                          "/usr/lib/python3/dist-packages/nvidia/cuda_runtime/include",
                          "/opt/*/.venv/lib/python3*/site-packages/nvidia/cu13/include",
                          "/opt/*/.venv/lib/python3*/site-packages/nvidia/cuda_runtime/include",
                          "/usr/local/lib/python3*/site-packages/nvidia/cu13/include",
                          "/usr/local/lib/python3*/site-packages/nvidia/cuda_runtime/include"})
    for (auto& d : glob_dirs(pat)) cands.push_back(d);
  for (const std::string& d : cands)
    if (file_exists(d + "/cuda_bf16.h") && file_exists(d + "/cuda_fp16.h")) return d;
  return "";
}

std::string nvrtc_version() {
  int maj = 0, min = 0;
  if (nvrtcVersion(&maj, &min) != NVRTC_SUCCESS) return "unknown";
  return std::to_string(maj) + "." + std::to_string(min);
}

Expected<NvrtcOutput> nvrtc_compile(const std::string& source, const std::string& program_name,
                                    const NvrtcOptions& options) {
  const std::string& arch = options.arch;
  if (arch.size() < 5 || arch.compare(0, 3, "sm_") != 0)
    return Status::error("nvrtc: " + program_name + ": architecture '" + arch + "' is not of the form sm_XY");
  std::vector<std::string> opts;
  opts.push_back(options.cubin ? "--gpu-architecture=" + arch : "--gpu-architecture=compute_" + arch.substr(3));
  opts.push_back("-std=c++17");
  opts.push_back(options.fmad ? "--fmad=true" : "--fmad=false");
  opts.push_back("--diag-suppress=177");  // unused static helpers of the generated prelude
  std::vector<std::string> incs = options.include_dirs;
  if (incs.empty()) {
    std::string d = cuda_include_dir();
    if (d.empty())
      return Status::error("nvrtc: " + program_name + " for " + arch +
                           ": cuda_bf16.h not found (set KILN_CUDA_INCLUDE to the CUDA toolkit's include dir)");
    incs.push_back(d);
  }
  for (auto& d : incs) opts.push_back("--include-path=" + d);
  if (options.ptxas_verbose && options.cubin) opts.push_back("--ptxas-options=-v");
  for (auto& o : options.extra_options) opts.push_back(o);
  std::vector<const char*> copts;
  for (auto& o : opts) copts.push_back(o.c_str());

  nvrtcProgram prog = nullptr;
  nvrtcResult r = nvrtcCreateProgram(&prog, source.c_str(), (program_name + ".cu").c_str(), 0, nullptr, nullptr);
  if (r != NVRTC_SUCCESS) return nvrtc_fail(program_name, arch, r, "");
  std::unique_ptr<nvrtcProgram, void (*)(nvrtcProgram*)> guard(&prog, [](nvrtcProgram* p) { nvrtcDestroyProgram(p); });

  r = nvrtcCompileProgram(prog, static_cast<int>(copts.size()), copts.data());
  NvrtcOutput out;
  out.arch = arch;
  out.is_cubin = options.cubin;
  size_t log_size = 0;
  if (nvrtcGetProgramLogSize(prog, &log_size) == NVRTC_SUCCESS && log_size > 1) {
    std::string log(log_size, '\0');
    if (nvrtcGetProgramLog(prog, log.data()) == NVRTC_SUCCESS) out.log = log.c_str();
  }
  if (r != NVRTC_SUCCESS) return nvrtc_fail(program_name, arch, r, out.log);

  size_t n = 0;
  if (options.cubin) {
    r = nvrtcGetCUBINSize(prog, &n);
    if (r == NVRTC_SUCCESS && n > 0) {
      out.image.resize(n);
      r = nvrtcGetCUBIN(prog, out.image.data());
    }
  } else {
    r = nvrtcGetPTXSize(prog, &n);
    if (r == NVRTC_SUCCESS && n > 0) {
      out.image.resize(n);
      r = nvrtcGetPTX(prog, out.image.data());
    }
  }
  if (r != NVRTC_SUCCESS) return nvrtc_fail(program_name, arch, r, out.log);
  if (out.image.empty())
    return Status::error("nvrtc: " + program_name + " for " + arch + ": compile produced an empty image");
  return out;
}

std::vector<PtxasKernelInfo> parse_ptxas_log(const std::string& log) {
  static const std::regex entry_re(R"(Compiling entry function '([^']+)' for '([^']+)')");
  static const std::regex props_re(R"(Function properties for (\S+))");
  static const std::regex frame_re(R"((\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads)");
  static const std::regex used_re(R"(Used (\d+) registers)");
  static const std::regex lmem_re(R"((\d+) bytes lmem)");
  static const std::regex smem_re(R"((\d+) bytes smem)");
  std::vector<PtxasKernelInfo> out;
  auto find = [&](const std::string& name) -> PtxasKernelInfo* {
    for (auto& k : out)
      if (k.kernel == name) return &k;
    return nullptr;
  };
  PtxasKernelInfo* cur = nullptr;  // entry whose properties / usage lines follow
  std::istringstream is(log);
  std::string line;
  std::smatch m;
  while (std::getline(is, line)) {
    if (std::regex_search(line, m, entry_re)) {
      PtxasKernelInfo k;
      k.kernel = m[1];
      k.arch = m[2];
      out.push_back(k);
      cur = &out.back();
    } else if (std::regex_search(line, m, props_re)) {
      cur = find(m[1]);  // nullptr for non-entry functions
    } else if (std::regex_search(line, m, frame_re)) {
      if (cur) {
        cur->stack_frame_bytes = std::stoll(m[1]);
        cur->spill_store_bytes = std::stoll(m[2]);
        cur->spill_load_bytes = std::stoll(m[3]);
      }
    } else if (std::regex_search(line, m, used_re)) {
      if (cur) {
        cur->registers = std::stoi(m[1]);
        if (std::regex_search(line, m, lmem_re)) cur->local_memory_bytes = std::stoll(m[1]);
        if (std::regex_search(line, m, smem_re)) cur->shared_memory_bytes = std::stoll(m[1]);
      }
    }
  }
  return out;
}

Expected<std::vector<PtxasKernelInfo>> ptxas_info(const std::string& source, const std::string& program_name,
                                                  const std::string& arch) {
  NvrtcOptions o;
  o.arch = arch;
  o.cubin = true;
  o.ptxas_verbose = true;
  KILN_ASSIGN_OR_RETURN(NvrtcOutput res, nvrtc_compile(source, program_name, o));
  std::vector<PtxasKernelInfo> info = parse_ptxas_log(res.log);
  if (info.empty()) return Status::error("nvrtc: " + program_name + " for " + arch + ": no ptxas report in the log");
  return info;
}

}  // namespace kiln::codegen
