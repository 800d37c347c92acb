#include "runtime/backend.h"

#include <algorithm>
#include <mutex>

namespace kiln::runtime {

namespace {

/// A graph loaded by a host backend: the parts it runs with and the executor's per-node
/// facts (ScheduleCache), computed on the first run.
class HostExecutable : public Executable {
 public:
  HostExecutable(const ir::Graph& g, const ProgramParts& parts) : g_(g), parts_(parts) {}
  const ir::Graph& graph() const override { return g_; }
  const ProgramParts& parts() const { return parts_; }
  ScheduleCache& schedule() { return schedule_; }

 private:
  const ir::Graph& g_;
  ProgramParts parts_;
  ScheduleCache schedule_;
};

/// The host backends: "compiled" runs the program's kernels and arena, "eager" (the
/// reference) drops them and runs every node's eager kernel.
class HostBackend : public Backend {
 public:
  explicit HostBackend(bool compiled) : compiled_(compiled) {}
  std::string name() const override { return compiled_ ? "compiled" : "eager"; }
  ir::Device device() const override { return ir::Device::cpu(); }

  Expected<ir::Tensor> zeros(ir::DType dtype, const std::vector<int64_t>& dims) override {
    try {
      return ir::Tensor(dtype, dims);
    } catch (const ir::OutOfMemory& e) {
      return Status::error(std::string(e.what()));
    }
  }
  Expected<ir::Tensor> to_device(const ir::Tensor& host) override { return on_host(host, "to_device"); }
  Expected<ir::Tensor> to_host(const ir::Tensor& t) override { return on_host(t, "to_host"); }

  Expected<std::unique_ptr<Executable>> load(const ir::Graph& g, const ProgramParts& parts) override {
    ProgramParts used = compiled_ ? parts : ProgramParts{};
    return std::unique_ptr<Executable>(std::make_unique<HostExecutable>(g, used));
  }

  Expected<std::map<std::string, ir::Tensor>> run(Executable& e, const std::map<std::string, ir::Tensor>& feeds,
                                                  const RunOptions& opts) override {
    RunOptions ro;
    KILN_ASSIGN_OR_RETURN(HostExecutable * he, own(e, opts, ro));
    return run_graph(he->graph(), feeds, ro);  // run_graph's check_feed refuses non-host feeds
  }

  Expected<std::vector<ir::Tensor>> run_positional(Executable& e, const std::vector<ir::Tensor>& feeds,
                                                   const RunOptions& opts) override {
    RunOptions ro;
    KILN_ASSIGN_OR_RETURN(HostExecutable * he, own(e, opts, ro));
    return run_graph_positional(he->graph(), feeds, ro);
  }

 private:
  /// `e` as this backend's executable, and `opts` with its program, arena and schedule.
  Expected<HostExecutable*> own(Executable& e, const RunOptions& opts, RunOptions& ro) const {
    auto* he = dynamic_cast<HostExecutable*>(&e);
    if (!he) return Status::error(name() + " backend: the executable was loaded by another backend");
    ro = opts;
    ro.program = he->parts().cpu_kernels;
    ro.arena = he->parts().arena;
    ro.schedule = &he->schedule();
    return he;
  }
  Expected<ir::Tensor> on_host(const ir::Tensor& t, const char* what) const {
    if (!t.device().is_cpu())
      return Status::error(name() + " backend: " + what + " of a tensor on " + t.device().str() +
                           " (this backend runs on cpu)");
    return t;
  }
  bool compiled_;
};

struct Registry {
  std::mutex mu;
  std::map<std::string, BackendFactory> factories;
  Registry() {
    factories["eager"] = [] { return Expected<std::unique_ptr<Backend>>(std::make_unique<HostBackend>(false)); };
    factories["compiled"] = [] { return Expected<std::unique_ptr<Backend>>(std::make_unique<HostBackend>(true)); };
  }
};

Registry& registry() {
  static Registry r;
  return r;
}

}  // namespace

void register_backend(const std::string& name, BackendFactory factory) {
  Registry& r = registry();
  std::lock_guard<std::mutex> lock(r.mu);
  r.factories[name] = std::move(factory);
}

std::vector<std::string> backend_names() {
  Registry& r = registry();
  std::lock_guard<std::mutex> lock(r.mu);
  std::vector<std::string> names;
  for (auto& [n, f] : r.factories) names.push_back(n);
  return names;  // std::map: sorted
}

Expected<std::unique_ptr<Backend>> make_backend(const std::string& name) {
  BackendFactory f;
  {
    Registry& r = registry();
    std::lock_guard<std::mutex> lock(r.mu);
    auto it = r.factories.find(name);
    if (it != r.factories.end()) f = it->second;
  }
  if (!f) {
    std::string known;
    for (const std::string& n : backend_names()) known += (known.empty() ? "" : ", ") + n;
    return Status::error("unknown backend '" + name + "' (known: " + known + ")");
  }
  return f();
}

}  // namespace kiln::runtime
