// The step-time cost model of kiln fit (cost_model.h).
#include "tools/driver/cost_model.h"

#include <omp.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <mutex>
#include <nlohmann/json.hpp>
#include <optional>
#include <random>

#include "codegen/cpu/program.h"
#include "ir/op_table.h"
#include "ir/printer.h"
#include "ir/tensor.h"
#include "runtime/interpreter.h"

namespace kiln::driver {

namespace {

namespace fs = std::filesystem;
using Clock = std::chrono::steady_clock;
using ir::DType;

/// Version of the calibration: bump when the microbenchmarks change.
constexpr int kRatesVersion = 3;

/// A tensor of `dims` with values in [-1, 1) (deterministic): copied from a pool of
/// random values made once per dtype (a per-element generator took most of the time of
/// timing large kernels).
ir::Tensor random_tensor(DType dt, const std::vector<int64_t>& dims) {
  static std::mutex mu;
  static std::map<DType, ir::Tensor> pools;
  constexpr int64_t kPool = int64_t{1} << 20;  // elements
  const ir::Tensor* pool = nullptr;
  {
    std::lock_guard<std::mutex> lock(mu);
    auto it = pools.find(dt);
    if (it == pools.end()) {
      ir::Tensor p(dt, {kPool});
      std::mt19937 rng(7);
      std::uniform_real_distribution<double> u(-1.0, 1.0);
      for (int64_t i = 0; i < kPool; ++i) p.set_f64(i, u(rng));
      it = pools.emplace(dt, std::move(p)).first;
    }
    pool = &it->second;
  }
  ir::Tensor t = ir::Tensor::uninitialized(dt, dims);
  const size_t esize = ir::dtype_size(dt);
  auto* dst = static_cast<char*>(t.raw());
  const auto* src = static_cast<const char*>(pool->raw());
  for (int64_t done = 0, n = t.numel(); done < n;) {
    const int64_t k = std::min(kPool - done % 7919, n - done);  // shifted, so tiles differ
    std::memcpy(dst + done * static_cast<int64_t>(esize), src + (done % 7919) * static_cast<int64_t>(esize),
                static_cast<size_t>(k) * esize);
    done += k;
  }
  return t;
}

/// Median seconds of `n`'s eager kernel on `ins` (nullptr: an omitted input): one untimed
/// run (the library creates its primitives), then runs until `min_total` seconds and at
/// least `min_runs` runs (at most `max_runs`). A first run longer than `single_above` seconds is
/// the timing itself (primitive creation is noise there). The training flag of `opts`
/// applies (Dropout, BatchNormalization).
Expected<double> median_kernel_seconds(const ir::Node& n, const std::vector<const ir::Tensor*>& ins,
                                       const runtime::RunOptions& opts, double min_total, size_t min_runs,
                                       size_t max_runs, double single_above) {
  const auto f0 = Clock::now();
  if (auto r = runtime::run_node(n, ins, opts); !r) return r.status();
  const double first = std::chrono::duration<double>(Clock::now() - f0).count();
  if (first > single_above) return first;
  std::vector<double> t;
  double total = 0;
  while ((total < min_total || t.size() < min_runs) && t.size() < max_runs) {
    const auto t0 = Clock::now();
    if (auto r = runtime::run_node(n, ins, opts); !r) return r.status();
    t.push_back(std::chrono::duration<double>(Clock::now() - t0).count());
    total += t.back();
  }
  std::sort(t.begin(), t.end());
  return t[t.size() / 2];
}

/// Median seconds of `n`'s eager kernel on `inputs`: about 40 ms of runs, at least 3.
Expected<double> time_node(const ir::Node& n, const std::vector<ir::Tensor>& inputs) {
  std::vector<const ir::Tensor*> ins;
  for (const auto& t : inputs) ins.push_back(&t);
  auto s = median_kernel_seconds(n, ins, {}, 0.04, 3, 2000, INFINITY);
  if (!s) return s.status().with_context("calibrating " + n.op);
  return *s;
}

/// A one-node graph of `op` over inputs of `dims`, all of dtype `dt`.
struct OneNode {
  ir::Graph g;
  ir::Node* node = nullptr;
  std::vector<ir::Tensor> inputs;
  OneNode(const std::string& op, DType dt, const std::vector<std::vector<int64_t>>& dims, ir::Attributes attrs = {}) {
    std::vector<ir::Value*> ins;
    for (size_t i = 0; i < dims.size(); ++i) {
      ins.push_back(g.add_input("x" + std::to_string(i), dt, ir::Shape::of(dims[i])));
      inputs.push_back(random_tensor(dt, dims[i]));
    }
    node = g.add_node(op, "calibrate/" + op, ins, {"y"}, std::move(attrs));
  }
};

/// FLOP/s of MatMul [m, m] x [m, m] in `dt` at three sizes.
Expected<RateCurve> matmul_curve(DType dt) {
  RateCurve c;
  for (int64_t m : {64, 192, 512}) {
    OneNode one("MatMul", dt, {{m, m}, {m, m}});
    KILN_ASSIGN_OR_RETURN(double s, time_node(*one.node, one.inputs));
    const double flops = 2.0 * static_cast<double>(m * m * m);
    c.points.push_back({flops, flops / std::max(s, 1e-9)});
  }
  return c;
}

/// FLOP/s of a 3x3 Conv (pads 1) in `dt` at three sizes (batch, channels, height = width).
Expected<RateCurve> conv_curve(DType dt) {
  RateCurve c;
  struct Size {
    int64_t n, ch, hw;
  };
  for (Size z : {Size{2, 16, 16}, Size{8, 32, 16}, Size{16, 64, 16}}) {
    ir::Attributes a;
    a.set("kernel_shape", std::vector<int64_t>{3, 3});
    a.set("pads", std::vector<int64_t>{1, 1, 1, 1});
    OneNode one("Conv", dt, {{z.n, z.ch, z.hw, z.hw}, {z.ch, z.ch, 3, 3}}, a);
    KILN_ASSIGN_OR_RETURN(double s, time_node(*one.node, one.inputs));
    const double flops = 2.0 * static_cast<double>(z.n * z.ch * z.hw * z.hw * z.ch * 9);
    c.points.push_back({flops, flops / std::max(s, 1e-9)});
  }
  return c;
}

/// Median seconds of one OpenMP parallel loop c = a + b over `n` floats in buffers
/// allocated once (what a generated pointwise kernel does), in batches of `per_batch`
/// loops after one untimed loop that touches the pages; at least 5 batches and `min_total`
/// seconds. Each loop reads what the previous one wrote, so none is elided.
double parallel_add_seconds(int64_t n, int per_batch, double min_total) {
  std::vector<float> a(static_cast<size_t>(n), 1.0f), b(static_cast<size_t>(n), 2.0f), c(static_cast<size_t>(n));
  float* pa = a.data();
  float* pb = b.data();
  float* pc = c.data();
  auto loop = [&](int k) {
#pragma omp parallel for schedule(static)
    for (int64_t i = 0; i < n; ++i) pc[i] = pa[i] + pb[i];
    pa[k % n] = pc[(k * 13) % n];
  };
  loop(0);
  std::vector<double> t;
  double total = 0;
  for (int batch = 0; t.size() < 5 || total < min_total; ++batch) {
    const auto t0 = Clock::now();
    for (int k = 0; k < per_batch; ++k) loop(batch * per_batch + k + 1);
    const double s = std::chrono::duration<double>(Clock::now() - t0).count();
    t.push_back(s / per_batch), total += s;
  }
  std::sort(t.begin(), t.end());
  return t[t.size() / 2];
}

/// Bytes/s (read + written) streamed by the loop over 8 Mi floats (the eager Add would
/// also time its output's allocation and page faults).
double stream_bandwidth() {
  const int64_t n = int64_t{8} << 20;
  return 3.0 * 4.0 * static_cast<double>(n) / std::max(parallel_add_seconds(n, 1, 0.04), 1e-9);
}

/// Seconds of the loop over 16 Ki floats, the shape of a small generated kernel: mostly
/// the parallel region's entry and exit.
double parallel_region_seconds() { return parallel_add_seconds(16 * 1024, 400, 0.0); }

nlohmann::json curve_json(const RateCurve& c) {
  nlohmann::json j = nlohmann::json::array();
  for (auto& [f, r] : c.points) j.push_back({f, r});
  return j;
}

bool curve_from(const nlohmann::json& j, RateCurve& c) {
  if (!j.is_array() || j.empty()) return false;
  for (const auto& p : j) {
    if (!p.is_array() || p.size() != 2 || !p[0].is_number() || !p[1].is_number()) return false;
    const double f = p[0].get<double>(), r = p[1].get<double>();
    if (!(f > 0) || !(r > 0)) return false;
    c.points.push_back({f, r});
  }
  return true;
}

/// The cached rates of this machine, when the file holds them (anything else: none).
std::optional<MachineRates> read_rates(const fs::path& file, const std::string& key) {
  std::ifstream in(file);
  if (!in) return std::nullopt;
  nlohmann::json j = nlohmann::json::parse(in, nullptr, false);
  if (j.is_discarded() || !j.is_object() || j.value("version", 0) != kRatesVersion || j.value("machine", "") != key)
    return std::nullopt;
  MachineRates r;
  r.machine = key;
  if (!j.contains("bandwidth") || !j["bandwidth"].is_number() || !j.contains("launch_s") || !j["launch_s"].is_number())
    return std::nullopt;
  r.bandwidth = j["bandwidth"].get<double>();
  r.launch_s = j["launch_s"].get<double>();
  if (!(r.bandwidth > 0) || !(r.launch_s >= 0)) return std::nullopt;
  if (!curve_from(j.value("matmul_f32", nlohmann::json()), r.matmul_f32) ||
      !curve_from(j.value("matmul_bf16", nlohmann::json()), r.matmul_bf16) ||
      !curve_from(j.value("conv_f32", nlohmann::json()), r.conv_f32) ||
      !curve_from(j.value("conv_bf16", nlohmann::json()), r.conv_bf16))
    return std::nullopt;
  return r;
}

/// Seconds of one node (loops: their bodies, trip_count times).
double node_seconds(const ir::Node& n, const MachineRates& r) {
  if (ir::has_trait(n, ir::OpTrait::loop)) {
    double s = 0;
    const double trips = static_cast<double>(n.attrs.get_int("trip_count", 1));
    if (!n.regions.empty())
      for (const auto& b : n.regions[0]->nodes()) s += node_seconds(*b, r);
    return s * trips;
  }
  const ir::OpDef* def = ir::OpTable::get().find(n.op);
  if (def && def->fusion == ir::FusionClass::view) return 0;
  const ir::Cost c = ir::node_cost(n);
  if (def && def->fusion == ir::FusionClass::library) {
    const bool low =
        !n.inputs.empty() && n.inputs[0] && (n.inputs[0]->dtype == DType::bf16 || n.inputs[0]->dtype == DType::f16);
    const bool mm = ir::has_trait(n, ir::OpTrait::matmul);
    const RateCurve& curve = mm ? (low ? r.matmul_bf16 : r.matmul_f32) : (low ? r.conv_bf16 : r.conv_f32);
    const double rate = curve.rate(c.flops);
    return r.launch_s + (rate > 0 ? c.flops / rate : 0.0);
  }
  return r.launch_s + (r.bandwidth > 0 ? c.bytes / r.bandwidth : 0.0);
}

}  // namespace

double RateCurve::rate(double flops) const {
  if (points.empty()) return 0;
  if (flops <= points.front().first) return points.front().second;
  if (flops >= points.back().first) return points.back().second;
  for (size_t i = 1; i < points.size(); ++i)
    if (flops <= points[i].first) {
      const auto& [f0, r0] = points[i - 1];
      const auto& [f1, r1] = points[i];
      const double t = (std::log(flops) - std::log(f0)) / std::max(1e-12, std::log(f1) - std::log(f0));
      return r0 + t * (r1 - r0);
    }
  return points.back().second;
}

std::string machine_key() {
  std::string model = "unknown CPU";
  std::ifstream in("/proc/cpuinfo");
  for (std::string line; std::getline(in, line);)
    if (line.rfind("model name", 0) == 0) {
      const size_t colon = line.find(':');
      if (colon != std::string::npos) model = line.substr(colon + 1);
      while (!model.empty() && model.front() == ' ') model.erase(model.begin());
      break;
    }
  // Threads and their wait policy change every kernel's time (a passive wait costs tens
  // of microseconds per parallel region), so they are part of the key.
  const char* wait = std::getenv("OMP_WAIT_POLICY");
  return model + ", " + std::to_string(omp_get_max_threads()) + " threads" +
         (wait && *wait ? std::string(", OMP_WAIT_POLICY=") + wait : std::string());
}

Expected<MachineRates> machine_rates(const std::string& cache_dir, bool no_cache) {
  const std::string key = machine_key();
  const fs::path dir = cache_dir.empty() ? fs::path(codegen::default_cache_dir()) : fs::path(cache_dir);
  const fs::path file = dir / "fit_rates.json";
  if (!no_cache)
    if (auto cached = read_rates(file, key)) return *cached;
  runtime::register_eager_kernels();
  const auto t0 = Clock::now();
  MachineRates r;
  r.machine = key;
  KILN_ASSIGN_OR_RETURN(r.matmul_f32, matmul_curve(DType::f32));
  KILN_ASSIGN_OR_RETURN(r.matmul_bf16, matmul_curve(DType::bf16));
  KILN_ASSIGN_OR_RETURN(r.conv_f32, conv_curve(DType::f32));
  KILN_ASSIGN_OR_RETURN(r.conv_bf16, conv_curve(DType::bf16));
  r.bandwidth = stream_bandwidth();
  {
    // A generated kernel's fixed cost: its OpenMP parallel region (thread wake-up and
    // join: a few microseconds with spinning threads, tens with OMP_WAIT_POLICY=passive),
    // at least the dispatch of a one-element eager kernel.
    OneNode tiny("Add", DType::f32, {{1}, {1}});
    KILN_ASSIGN_OR_RETURN(double dispatch, time_node(*tiny.node, tiny.inputs));
    r.launch_s = std::max(dispatch, parallel_region_seconds());
  }
  r.calibrate_s = std::chrono::duration<double>(Clock::now() - t0).count();
  if (!no_cache) {
    nlohmann::json j = {{"version", kRatesVersion},
                        {"machine", key},
                        {"bandwidth", r.bandwidth},
                        {"launch_s", r.launch_s},
                        {"matmul_f32", curve_json(r.matmul_f32)},
                        {"matmul_bf16", curve_json(r.matmul_bf16)},
                        {"conv_f32", curve_json(r.conv_f32)},
                        {"conv_bf16", curve_json(r.conv_bf16)}};
    std::error_code ec;
    fs::create_directories(dir, ec);
    const fs::path tmp = file.string() + ".tmp";
    bool written = false;
    {
      std::ofstream out(tmp);
      written = static_cast<bool>(out << j.dump(1) << "\n");
    }
    if (written) fs::rename(tmp, file, ec);
    if (!written || ec) fs::remove(tmp, ec);  // the rates are still used; only the cache is skipped
  }
  return r;
}

double estimate_step_seconds(const ir::Graph& g, const MachineRates& r) {
  double s = 0;
  for (const auto& n : g.nodes()) s += node_seconds(*n, r);
  return s;
}

// ---------------------------------------------------------------- timed kernels

namespace {

constexpr int kOpTimesVersion = 2;

/// FNV-1a 64-bit of `s` as 16 hex digits: the cache key of a signature.
std::string fnv_hex(const std::string& s) {
  uint64_t h = 1469598103934665603ull;
  for (unsigned char c : s) h = (h ^ c) * 1099511628211ull;
  char b[20];
  std::snprintf(b, sizeof b, "%016llx", static_cast<unsigned long long>(h));
  return b;
}

bool is_loop_or_fused(const ir::Node& n) {
  return ir::has_trait(n, ir::OpTrait::loop) || ir::has_trait(n, ir::OpTrait::fused_kernel);
}

}  // namespace

/// One registered signature: a one-node graph of the same op, attributes and input types,
/// the constants it reads, and the estimate used when it cannot be timed.
struct OpTimes::Entry {
  ir::Graph g;
  ir::Node* node = nullptr;
  std::vector<std::shared_ptr<ir::Tensor>> constants;  ///< per input: the value, or null (made at timing)
  double fallback_s = 0;
  double seconds = -1;  ///< measured or cached (-1: neither)
};

OpTimes::OpTimes(const std::string& cache_dir, bool no_cache) : no_cache_(no_cache) {
  machine_ = machine_key();
  const fs::path dir = cache_dir.empty() ? fs::path(codegen::default_cache_dir()) : fs::path(cache_dir);
  file_ = (dir / "fit_ops.json").string();
  if (no_cache_) return;
  std::ifstream in(file_);
  if (!in) return;
  nlohmann::json j = nlohmann::json::parse(in, nullptr, false);
  if (j.is_discarded() || !j.is_object() || j.value("version", 0) != kOpTimesVersion ||
      j.value("machine", "") != machine_ || !j.contains("ops") || !j["ops"].is_object())
    return;
  for (auto& [k, v] : j["ops"].items())
    if (v.is_number() && v.get<double>() >= 0) cached_[k] = v.get<double>();
}

OpTimes::~OpTimes() = default;

bool OpTimes::timed(const ir::Node& n) {
  if (is_loop_or_fused(n)) return false;
  const ir::OpDef* def = ir::OpTable::get().find(n.op);
  // Every eager kernel the executor runs (library, opaque, and pointwise or reduction ops
  // left unfused, such as gradient accumulation's adds); views only re-label a buffer.
  if (!def || ir::has_trait(n, ir::OpTrait::view)) return false;
  // Integer data (indices, class ids) cannot be synthesized faithfully: all-zero indices
  // make an embedding's gradient add every row into one (serialized where the real data
  // spreads), and other values may be out of range. Such nodes keep the roofline.
  for (const ir::Value* v : n.inputs)
    if (v && !v->data && ir::is_integer(v->dtype)) return false;
  return true;
}

std::string OpTimes::signature(const ir::Node& n) {
  std::string s = n.op + "(";
  for (const auto& [k, v] : n.attrs.all()) s += k + "=" + ir::attr_to_string(v) + ";";
  s += ")";
  for (const ir::Value* v : n.inputs) {
    if (!v) {
      s += " -";
      continue;
    }
    s += " " + std::string(ir::dtype_name(v->dtype)) + v->shape.to_string();
    if (v->data && v->data->numel() <= 64) {
      s += "=";
      for (int64_t i = 0; i < v->data->numel(); ++i) s += (i ? "," : "") + std::to_string(v->data->get_f64(i));
    }
  }
  return s;
}

std::string OpTimes::add(const ir::Node& n, double fallback_s) {
  std::string sig = signature(n);
  std::lock_guard<std::mutex> lock(mu_);
  if (entries_.count(sig)) return sig;
  auto e = std::make_unique<Entry>();
  e->fallback_s = fallback_s;
  if (auto it = cached_.find(fnv_hex(sig)); it != cached_.end()) e->seconds = it->second;
  std::vector<ir::Value*> ins;
  for (size_t i = 0; i < n.inputs.size(); ++i) {
    const ir::Value* v = n.inputs[i];
    if (!v) {
      ins.push_back(nullptr);
      e->constants.push_back(nullptr);
      continue;
    }
    ins.push_back(e->g.add_input("in" + std::to_string(i), v->dtype, v->shape));
    // Small constants (shapes, axes, scalars) as the graph has them; the rest made at timing.
    e->constants.push_back(v->data && v->data->numel() <= 64 ? v->data : nullptr);
  }
  std::vector<std::string> outs;
  for (size_t i = 0; i < n.outputs.size(); ++i) outs.push_back("out" + std::to_string(i));
  e->node = e->g.add_node(n.op, "timed/" + n.op, ins, outs, n.attrs);
  for (size_t i = 0; i < n.outputs.size(); ++i) {
    e->node->outputs[i]->dtype = n.outputs[i]->dtype;
    e->node->outputs[i]->shape = n.outputs[i]->shape;
  }
  entries_.emplace(sig, std::move(e));
  return sig;
}

namespace {

/// Seconds of one run of `e`'s kernel on synthetic inputs: the median of a few runs after
/// an untimed one (about 10 ms in all, at most 20 runs). The first run creates the
/// library's primitives; past 20 ms that is noise and the first run is the timing (the
/// large kernels are most of the time spent here). nullopt: it cannot run on its own.
template <typename Entry>
std::optional<double> time_entry(const Entry& e) {
  std::vector<ir::Tensor> inputs;
  std::vector<const ir::Tensor*> ptrs;
  inputs.reserve(e.constants.size());
  for (size_t i = 0; i < e.constants.size(); ++i) {
    const ir::Value* v = e.node->inputs[i];
    if (!v) {
      ptrs.push_back(nullptr);
      continue;
    }
    if (e.constants[i]) {
      ptrs.push_back(e.constants[i].get());
      continue;
    }
    std::vector<int64_t> dims;
    for (const ir::Dim& d : v->shape.dims) {
      if (!d.is_static()) return std::nullopt;
      dims.push_back(d.value);
    }
    inputs.push_back(ir::is_float(v->dtype) ? random_tensor(v->dtype, dims) : ir::Tensor(v->dtype, dims));
    ptrs.push_back(&inputs.back());
  }
  runtime::RunOptions ro;
  ro.training = true;  // Dropout and BatchNormalization as a training step runs them
  auto s = median_kernel_seconds(*e.node, ptrs, ro, 0.01, 2, 20, 0.02);
  if (!s) return std::nullopt;
  return *s;
}

}  // namespace

void OpTimes::measure() {
  runtime::register_eager_kernels();
  const auto t0 = Clock::now();
  std::lock_guard<std::mutex> lock(mu_);
  // Two passes over the kernels the cache lacks, the faster of the two kept: a shared
  // machine's load only ever slows a timing down, and a slowed one would stay cached.
  std::vector<std::pair<std::string, Entry*>> todo;
  for (auto& [sig, e] : entries_)
    if (e->seconds < 0) todo.push_back({sig, e.get()});
  for (auto& [sig, e] : todo)
    if (auto s = time_entry(*e)) e->seconds = *s;
  // The second pass re-times kernels of 1 ms and more: a handful of runs each, so one slow
  // moment shows in their median; shorter ones took the median of 10 ms of runs.
  for (auto& [sig, e] : todo)
    if (e->seconds >= 1e-3)
      if (auto s = time_entry(*e)) e->seconds = std::min(e->seconds, *s);
  bool added = false;
  for (auto& [sig, e] : todo)
    if (e->seconds >= 0) {
      cached_[fnv_hex(sig)] = e->seconds;
      ++measured_;
      added = true;
    }
  measure_s_ += std::chrono::duration<double>(Clock::now() - t0).count();
  if (!added || no_cache_) return;
  // Another search may have written timings since this one read the file: keep them.
  {
    std::ifstream in(file_);
    const nlohmann::json old = in ? nlohmann::json::parse(in, nullptr, false) : nlohmann::json();
    if (old.is_object() && old.value("version", 0) == kOpTimesVersion && old.value("machine", "") == machine_ &&
        old.contains("ops") && old["ops"].is_object())
      for (auto& [k, v] : old["ops"].items())
        if (v.is_number() && v.get<double>() >= 0 && !cached_.count(k)) cached_[k] = v.get<double>();
  }
  nlohmann::json ops = nlohmann::json::object();
  for (auto& [k, v] : cached_) ops[k] = v;
  nlohmann::json j = {{"version", kOpTimesVersion}, {"machine", machine_}, {"ops", ops}};
  std::error_code ec;
  fs::create_directories(fs::path(file_).parent_path(), ec);
  const std::string tmp = file_ + ".tmp." + std::to_string(::getpid());
  bool written = false;
  {
    std::ofstream out(tmp);
    written = static_cast<bool>(out << j.dump() << "\n");
  }
  if (written) fs::rename(tmp, file_, ec);
  if (!written || ec) fs::remove(tmp, ec);
}

double OpTimes::seconds(const std::string& sig) const {
  std::lock_guard<std::mutex> lock(mu_);
  auto it = entries_.find(sig);
  if (it == entries_.end()) return 0;
  return it->second->seconds >= 0 ? it->second->seconds : it->second->fallback_s;
}

size_t OpTimes::size() const {
  std::lock_guard<std::mutex> lock(mu_);
  return entries_.size();
}

double StepEstimate::seconds(const OpTimes& t) const {
  double s = modelled_s;
  for (const auto& [sig, count] : kernels) s += count * t.seconds(sig);
  return s;
}

namespace {

void add_terms(const ir::Graph& g, const MachineRates& r, OpTimes& times, double mult, StepEstimate& est) {
  for (const auto& np : g.nodes()) {
    const ir::Node& n = *np;
    if (ir::has_trait(n, ir::OpTrait::loop)) {
      if (!n.regions.empty())
        add_terms(*n.regions[0], r, times, mult * static_cast<double>(n.attrs.get_int("trip_count", 1)), est);
      continue;
    }
    const double modelled = node_seconds(n, r);
    if (OpTimes::timed(n)) {
      est.kernels[times.add(n, modelled)] += mult;
    } else {
      est.modelled_s += mult * modelled;
      if (modelled > 0) est.modelled_launches += mult;
    }
  }
}

}  // namespace

StepEstimate estimate_step(const ir::Graph& g, const MachineRates& r, OpTimes& times) {
  StepEstimate est;
  add_terms(g, r, times, 1.0, est);
  return est;
}

}  // namespace kiln::driver
