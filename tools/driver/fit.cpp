// kiln fit (fit.h): recipes planned through a trie of shared pass prefixes, ranked by the
// cost model, the best few measured.
#include "tools/driver/fit.h"

#include <omp.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <map>
#include <memory>
#include <nlohmann/json.hpp>
#include <optional>
#include <sstream>
#include <thread>

#include "ir/op_table.h"
#include "passes/memory_plan.h"
#include "passes/pass.h"
#include "runtime/checkpoint.h"
#include "runtime/metrics.h"
#include "tools/driver/bench.h"
#include "tools/driver/driver.h"
#include "tools/driver/pipeline.h"
#include "tools/driver/plot.h"
#include "tools/driver/train_run.h"

namespace kiln::driver {

namespace {

using Clock = std::chrono::steady_clock;
using runtime::TrainConfig;

double since(Clock::time_point t0) { return std::chrono::duration<double>(Clock::now() - t0).count(); }

/// One pass run of the search trie: the pass, the options it runs with, and the recipes
/// whose pipelines go through it (`ends`: those whose pipeline ends here).
struct TrieNode {
  std::string key;  ///< pass name and the options it reads (Pass::describe_options)
  std::string pass;
  passes::PassOptions options;
  std::vector<std::unique_ptr<TrieNode>> kids;
  std::vector<int> ends;
};

/// What the remat pass recomputed (forward nodes cloned into the backward pass).
struct RematInfo {
  int nodes = 0;
  double flops = 0;
};

/// Recomputed nodes are named "<forward node>/grad/remat" by the remat pass (passes/remat.cpp).
RematInfo count_recomputed(const ir::Graph& g) {
  static const std::string kSuffix = "/grad/remat";
  RematInfo r;
  for (const auto& n : g.nodes())
    if (n->name.size() >= kSuffix.size() &&
        n->name.compare(n->name.size() - kSuffix.size(), kSuffix.size(), kSuffix) == 0) {
      ++r.nodes;
      r.flops += ir::node_cost(*n).flops;
    }
  return r;
}

void collect(const TrieNode& t, std::vector<int>& out) {
  out.insert(out.end(), t.ends.begin(), t.ends.end());
  for (const auto& k : t.kids) collect(*k, out);
}

/// The search's state while it walks the trie.
struct Search {
  const FitOptions& o;
  const MachineRates& rates;
  std::vector<FitCandidate>& cands;
  OpTimes& times;
  std::vector<StepEstimate>& estimates;  ///< per recipe
  int passes_run = 0;

  void finish(int i, const ir::Graph& g, const RematInfo& info) {
    FitCandidate& c = cands[static_cast<size_t>(i)];
    if (o.config.backend == "compiled" && g.planned_peak_bytes >= 0) {
      // The arena_plan pass planned the step (the plan the executor runs and reports).
      c.planned_peak = g.planned_peak_bytes;
    } else {
      auto plan = passes::plan_memory(g, passes::PlanOptions::eager());
      if (!plan) {
        c.error = plan.status().message();
        return;
      }
      c.planned_peak = plan->peak_bytes;
    }
    estimates[static_cast<size_t>(i)] = estimate_step(g, rates, times);
    c.recomputed_nodes = info.nodes;
    c.recompute_flops = info.flops;
  }

  void walk(TrieNode& t, std::unique_ptr<ir::Graph> g, const RematInfo& info) {
    for (size_t k = 0; k < t.kids.size(); ++k) {
      TrieNode& kid = *t.kids[k];
      std::unique_ptr<ir::Graph> mine = k + 1 < t.kids.size() ? g->clone() : std::move(g);
      ++passes_run;
      if (Status st = run_pass_list(*mine, {kid.pass}, kid.options); !st) {
        std::vector<int> under;
        collect(kid, under);
        for (int i : under) cands[static_cast<size_t>(i)].error = st.message();
        continue;
      }
      const RematInfo mine_info = kid.pass == "remat" ? count_recomputed(*mine) : info;
      for (int i : kid.ends) finish(i, *mine, mine_info);
      walk(kid, std::move(mine), mine_info);
    }
  }
};

/// The (per-device batch, accumulation steps) pairs of product `o.effective_batch_size`,
/// largest batch first, that the fixed batch flags of `cfg` allow. Error: none does (one
/// line naming the flags).
Expected<std::vector<std::pair<int64_t, int64_t>>> batch_splits(const FitOptions& o, const TrainConfig& cfg) {
  const int64_t E = o.effective_batch_size;
  std::vector<std::pair<int64_t, int64_t>> splits;
  for (int64_t b = E; b >= 1; --b) {
    if (E % b != 0) continue;
    if (o.fix_batch && b != cfg.per_device_train_batch_size) continue;
    if (o.fix_accumulation && E / b != cfg.gradient_accumulation_steps) continue;
    splits.push_back({b, E / b});
  }
  if (splits.empty())
    return Status::error("--effective_batch_size " + std::to_string(E) +
                         ": no split into --per_device_train_batch_size" +
                         (o.fix_batch ? " " + std::to_string(cfg.per_device_train_batch_size) : std::string()) +
                         " x --gradient_accumulation_steps" +
                         (o.fix_accumulation ? " " + std::to_string(cfg.gradient_accumulation_steps) : std::string()) +
                         " gives it; leave one of them free or give sizes whose product is " + std::to_string(E));
  return splits;
}

std::string fmt(const char* f, double v) { return bench_fmt(f, v); }
std::string pad(const std::string& s, size_t w, bool left = false) { return bench_pad(s, w, left); }

std::string recomputed_text(const FitCandidate& c) {
  if (c.recomputed_nodes == 0) return "nothing";
  const double f = c.recompute_flops;
  return std::to_string(c.recomputed_nodes) + (c.recomputed_nodes == 1 ? " node, " : " nodes, ") +
         (f >= 1e9   ? fmt("%.2f GFLOP", f / 1e9)
          : f >= 1e6 ? fmt("%.2f MFLOP", f / 1e6)
                     : fmt("%.0f FLOP", f)) +
         " per microbatch";
}

}  // namespace

Expected<int64_t> resolve_memory_budget(const std::string& text, std::string* how) {
  if (text != "auto") return runtime::parse_byte_size(text);
  int64_t avail = -1;
  {
    std::ifstream in("/proc/meminfo");
    for (std::string line; std::getline(in, line);)
      if (line.rfind("MemAvailable:", 0) == 0) {
        std::istringstream ls(line.substr(13));
        int64_t kib = 0;
        if (ls >> kib) avail = kib * 1024;
      }
  }
  std::string source = "MemAvailable";
  // A cgroup v2 limit (a container) can be lower than what the kernel has free.
  auto read_num = [](const char* path) -> int64_t {
    std::ifstream in(path);
    std::string v;
    if (!(in >> v) || v == "max") return -1;
    try {
      return std::stoll(v);
    } catch (...) {
      return -1;
    }
  };
  // cgroup v2 (memory.max, memory.current), else v1 (memory.limit_in_bytes, usage_in_bytes;
  // "unlimited" is a huge number there).
  int64_t max = read_num("/sys/fs/cgroup/memory.max"), cur = read_num("/sys/fs/cgroup/memory.current");
  std::string which = "memory.max";
  if (max <= 0) {
    max = read_num("/sys/fs/cgroup/memory/memory.limit_in_bytes");
    cur = read_num("/sys/fs/cgroup/memory/memory.usage_in_bytes");
    which = "memory.limit_in_bytes";
  }
  if (max > 0 && cur >= 0 && max > cur && (avail < 0 || max - cur < avail))
    avail = max - cur, source = "the cgroup's " + which;
  if (avail <= 0) return Status::error("--memory_budget auto: cannot read the memory available (/proc/meminfo)");
  const int64_t budget = avail - avail / 10;
  if (how)
    *how = "--memory_budget auto: " + passes::human_bytes(budget) + " (" + source + " " + passes::human_bytes(avail) +
           " less a 10% margin)";
  return budget;
}

std::string apply_checkpoint_recipe(TrainConfig& cfg) {
  std::string dir = cfg.resume_from_checkpoint;
  if (dir == "true" || dir == "latest") {
    auto all = runtime::list_checkpoints(cfg.output_dir);
    if (all.empty()) return "";
    dir = all.back().second;
  }
  std::ifstream in(std::filesystem::path(dir) / "trainer_state.json");
  if (!in) return "";
  const nlohmann::json j = nlohmann::json::parse(in, nullptr, false);
  if (j.is_discarded() || !j.is_object() || !j.contains("config") || !j["config"].is_object()) return "";
  TrainConfig saved = cfg;
  if (!runtime::config_from_json_text(j["config"].dump(), dir, saved)) return "";
  cfg.per_device_train_batch_size = saved.per_device_train_batch_size;
  cfg.gradient_accumulation_steps = saved.gradient_accumulation_steps;
  cfg.bf16 = saved.bf16;
  cfg.fp16 = saved.fp16;
  cfg.remat_policy = saved.remat_policy;
  cfg.gradient_checkpointing = saved.gradient_checkpointing;
  cfg.memory_budget = saved.memory_budget;
  cfg.optim = saved.optim;
  cfg.auto_fit = cfg.auto_find_batch_size = false;
  cfg.effective_batch_size = 0;
  return dir;
}

Expected<FitOptions> fit_options(const TrainConfig& cfg, const std::function<bool(const std::string&)>& given,
                                 std::string* budget_note) {
  FitOptions o;
  o.config = cfg;
  const bool explicit_e = cfg.effective_batch_size > 0;
  o.effective_batch_size =
      explicit_e ? cfg.effective_batch_size : cfg.per_device_train_batch_size * cfg.gradient_accumulation_steps;
  o.fix_batch = explicit_e && given("per_device_train_batch_size");
  o.fix_accumulation = explicit_e && given("gradient_accumulation_steps");
  o.fix_precision = given("bf16") || given("fp16");
  o.fix_remat = given("remat_policy") || given("gradient_checkpointing");
  o.fix_optim = given("optim");
  if (auto splits = batch_splits(o, cfg); !splits) return splits.status();
  std::string text = cfg.memory_budget;
  if (text.empty() && cfg.auto_find_batch_size) text = "auto";
  if (text.empty()) return Status::error("--memory_budget: the recipe search needs a budget (e.g. 800MB, 24GiB, auto)");
  KILN_ASSIGN_OR_RETURN(o.memory_budget, resolve_memory_budget(text, budget_note));
  // A remat budget given with a fixed --remat_policy budget is that policy's own budget.
  o.config.memory_budget.clear();
  return o;
}

Status check_fit_data(const FitOptions& o) {
  const TrainConfig& c = o.config;
  if (c.train_data.empty()) return Status::ok();
  auto raw = runtime::load_raw_data(c.train_data);
  if (!raw) return raw.status().with_context("--train_data");
  KILN_ASSIGN_OR_RETURN(auto forward, load_model(c.model, c.shape));
  return check_data_values(*raw, "--train_data", *forward, c);
}

std::string FitCandidate::label() const {
  return std::to_string(batch) + "x" + std::to_string(accumulation) + " " + precision + " " + remat + " " + optim;
}

FitCandidate FitCandidate::of(const TrainConfig& c) {
  FitCandidate r;
  r.batch = c.per_device_train_batch_size, r.accumulation = c.gradient_accumulation_steps;
  r.precision = c.bf16 ? "bf16" : c.fp16 ? "fp16" : "fp32";
  r.remat = c.effective_remat_policy(), r.optim = c.optim;
  return r;
}

TrainConfig FitCandidate::config(const TrainConfig& base, int64_t memory_budget) const {
  TrainConfig c = base;
  c.per_device_train_batch_size = batch;
  c.gradient_accumulation_steps = accumulation;
  c.bf16 = precision == "bf16";
  c.fp16 = precision == "fp16";
  c.remat_policy = remat;
  c.gradient_checkpointing = false;
  c.optim = optim;
  c.memory_budget = remat == "budget" ? std::to_string(memory_budget) : std::string();
  // The recipe is a plain configuration: training it searches nothing.
  c.auto_fit = c.auto_find_batch_size = false;
  c.effective_batch_size = 0;
  return c;
}

Expected<FitResult> run_fit(const FitOptions& o, std::ostream& err) {
  const auto t_start = Clock::now();
  const TrainConfig& base = o.config;
  const int64_t E = o.effective_batch_size;
  if (E <= 0)
    return Status::error("--effective_batch_size: expected a positive number of samples, got " + std::to_string(E));
  if (o.memory_budget <= 0)
    return Status::error("--memory_budget: expected a byte count > 0, got " + std::to_string(o.memory_budget));
  // The (batch, accumulation) pairs of product E that the fixed flags allow.
  KILN_ASSIGN_OR_RETURN(const auto splits, batch_splits(o, base));
  const std::vector<std::string> precisions = o.fix_precision
                                                  ? std::vector<std::string>{FitCandidate::of(base).precision}
                                                  : std::vector<std::string>{"fp32", "bf16"};
  const std::vector<std::string> remats = o.fix_remat
                                              ? std::vector<std::string>{base.effective_remat_policy()}
                                              : std::vector<std::string>{"none", "blocks", "sqrt", "min-cut", "budget"};
  const std::vector<std::string> optims =
      o.fix_optim ? std::vector<std::string>{base.optim} : std::vector<std::string>{"adamw_torch", "adamw_8bit"};

  FitResult res;
  KILN_ASSIGN_OR_RETURN(res.rates, machine_rates(base.cache_dir, base.no_cache));
  if (res.rates.calibrate_s > 0)
    err << "kiln fit: measured this machine's rates in " << fmt("%.1f", res.rates.calibrate_s)
        << " s (kept in the cache folder for later searches)\n";
  auto& cands = res.candidates;
  for (auto [b, a] : splits)
    for (const auto& p : precisions)
      for (const auto& r : remats)
        for (const auto& op : optims) {
          FitCandidate c;
          c.batch = b, c.accumulation = a, c.precision = p, c.remat = r, c.optim = op;
          cands.push_back(c);
        }

  // Progress for a person watching (a search takes tens of seconds); not in logs.
  const bool tty = ::isatty(STDERR_FILENO) != 0;
  if (tty) err << "kiln fit: planning " << cands.size() << " recipes...\n";
  // Plan: one trie per batch size (its specialised model is the root), one path per recipe.
  const auto t_plan = Clock::now();
  KILN_ASSIGN_OR_RETURN(auto module, import_model(base.model, base.untie_initializers));
  const int64_t total_steps = base.max_steps > 0 ? base.max_steps : 1;
  std::map<int64_t, TrieNode> roots;
  for (size_t i = 0; i < cands.size(); ++i) {
    const TrainConfig c = cands[i].config(base, o.memory_budget);
    const Pipeline pipe = training_pipeline(pipeline_options(c, total_steps));
    TrieNode* at = &roots[cands[i].batch];
    for (const PipelineStage& st : pipe.train.stages) {
      if (st.name == "specialize") continue;  // specialize_train_step's work
      for (const std::string& pass : st.passes) {
        auto p = passes::make_pass(pass);
        if (!p) return passes::unknown_pass(pass);
        const std::string key = pass + "|" + p->describe_options(pipe.train.options);
        TrieNode* next = nullptr;
        for (auto& k : at->kids)
          if (k->key == key) next = k.get();
        if (!next) {
          at->kids.push_back(std::make_unique<TrieNode>());
          next = at->kids.back().get();
          next->key = key, next->pass = pass, next->options = pipe.train.options;
        }
        at = next;
        ++res.passes_unshared;
      }
    }
    at->ends.push_back(static_cast<int>(i));
  }
  // The tries are independent (each recipe is under one batch size): the machine's cores
  // walk them in parallel, each writing only its own recipes.
  std::vector<std::pair<int64_t, TrieNode*>> work;
  for (auto& [b, root] : roots) work.push_back({b, &root});
  std::atomic<size_t> next{0};
  auto worker = [&](Search& search) {
    for (size_t w; (w = next.fetch_add(1)) < work.size();) {
      auto [b, root] = work[w];
      TrainConfig c = base;
      c.per_device_train_batch_size = b;
      auto g = specialize_train_step(c, *module);
      if (!g) {
        std::vector<int> under;
        collect(*root, under);
        for (int i : under) cands[static_cast<size_t>(i)].error = g.status().message();
        continue;
      }
      search.walk(*root, std::move(*g), RematInfo{});
    }
  };
  const size_t nthreads = std::max<size_t>(
      1,
      std::min<size_t>(work.size(), static_cast<size_t>(o.plan_threads > 0 ? o.plan_threads : omp_get_max_threads())));
  OpTimes times(base.cache_dir, base.no_cache);
  std::vector<StepEstimate> estimates(cands.size());
  std::vector<Search> searches(nthreads, Search{o, res.rates, cands, times, estimates});
  {
    std::vector<std::thread> threads;
    for (size_t t = 1; t < nthreads; ++t) threads.emplace_back(worker, std::ref(searches[t]));
    worker(searches[0]);
    for (auto& t : threads) t.join();
  }
  for (const Search& s : searches) res.passes_run += s.passes_run;
  // The eager kernels of every recipe, each distinct one timed once (cached per machine).
  times.measure();
  res.timed_kernels = static_cast<int>(times.size());
  res.kernels_measured = times.measured_count();
  res.kernel_timing_s = times.measure_seconds();
  for (size_t i = 0; i < cands.size(); ++i)
    if (cands[i].planned()) {
      cands[i].estimated_s = estimates[i].seconds(times);
      cands[i].modelled_launches = estimates[i].modelled_launches;
    }
  res.plan_s = since(t_plan);

  // A budget recipe that recomputes nothing is the recipe without remat.
  for (size_t i = 0; i < cands.size(); ++i) {
    FitCandidate& c = cands[i];
    if (c.remat != "budget" || !c.planned() || c.recomputed_nodes > 0) continue;
    for (size_t j = 0; j < cands.size(); ++j)
      if (cands[j].remat == "none" && cands[j].batch == c.batch && cands[j].precision == c.precision &&
          cands[j].optim == c.optim)
        c.same_as = static_cast<int>(j);
  }
  bool any_planned = false;
  for (size_t i = 0; i < cands.size(); ++i) {
    const FitCandidate& c = cands[i];
    if (!c.planned()) continue;
    any_planned = true;
    if (res.smallest < 0 || c.planned_peak < cands[static_cast<size_t>(res.smallest)].planned_peak)
      res.smallest = static_cast<int>(i);
    if (c.same_as < 0 && c.planned_peak <= o.memory_budget) res.fitting.push_back(static_cast<int>(i));
  }
  if (!any_planned) {
    // Every recipe failed before its plan: the reason is not the budget (the model, data
    // or a flag): say it once.
    for (const auto& c : cands)
      if (!c.error.empty() && c.error.find("--memory_budget") == std::string::npos) return Status::error(c.error);
    return Status::error(cands.empty() ? "no recipe to search" : cands[0].error);
  }
  std::stable_sort(res.fitting.begin(), res.fitting.end(), [&](int a, int b) {
    return cands[static_cast<size_t>(a)].estimated_s < cands[static_cast<size_t>(b)].estimated_s;
  });

  // Measure the best few, steps interleaved so that the machine's load falls on each alike.
  const auto t_measure = Clock::now();
  if (tty && o.measure_top > 0 && !res.fitting.empty())
    err << "kiln fit: measuring the best " << std::min<size_t>(res.fitting.size(), o.measure_top) << " of "
        << res.fitting.size() << " fitting recipes...\n";
  // Rounds of measure_top recipes, until one measures within the budget (a plan is exact
  // up to what a library kernel allocates for itself).
  for (size_t first = 0; o.measure_top > 0 && res.chosen < 0 && first < res.fitting.size();
       first += static_cast<size_t>(o.measure_top)) {
    const size_t k = std::min(res.fitting.size() - first, static_cast<size_t>(o.measure_top));
    std::vector<BenchRun> runs(k);
    std::optional<runtime::Dataset> ds;
    passes::PassContext dbg;
    for (size_t r = 0; r < k; ++r) {
      const FitCandidate& c = cands[static_cast<size_t>(res.fitting[first + r])];
      runs[r].backend = c.label();
      KILN_RETURN_IF_ERROR(prepare_bench_run(runs[r], c.config(base, o.memory_budget), dbg, 1 + o.measure_steps, ds)
                               .with_context("measuring " + c.label()));
    }
    for (auto& r : runs)  // one warm-up step each (oneDNN primitives, page faults)
      if (auto st = r.tr->step(); !st) return st.status().with_context("measuring " + r.backend);
    for (auto& r : runs) start_timing(r);
    for (int s = 0; s < std::max(1, o.measure_steps); ++s)
      for (auto& r : runs) KILN_RETURN_IF_ERROR(timed_bench_step(r).with_context("measuring " + r.backend));
    for (size_t r = 0; r < k; ++r) {
      FitCandidate& c = cands[static_cast<size_t>(res.fitting[first + r])];
      c.measured_s = bench_median(runs[r].times);
      c.measured_peak = runs[r].peak;
      if (runs[r].plan && runs[r].plan->peak_bytes != c.planned_peak)
        err << "kiln fit: note: " << c.label() << ": the built program plans " << runs[r].plan->peak_bytes
            << " B where the search planned " << c.planned_peak << " B\n";
    }
    for (size_t r = 0; r < k; ++r) {
      const int i = res.fitting[first + r];
      const FitCandidate& c = cands[static_cast<size_t>(i)];
      if (c.measured_peak > o.memory_budget) {
        err << "kiln fit: note: " << c.label() << " measured a peak of " << passes::human_bytes(c.measured_peak)
            << ", over the budget: not chosen\n";
        continue;
      }
      if (res.chosen < 0 || c.measured_s < cands[static_cast<size_t>(res.chosen)].measured_s) res.chosen = i;
    }
  }
  if (o.measure_top <= 0 && !res.fitting.empty()) res.chosen = res.fitting[0];
  res.measure_s = since(t_measure);
  res.total_s = since(t_start);
  return res;
}

std::string format_fit(const FitResult& r, const FitOptions& o) {
  const auto& cands = r.candidates;
  std::ostringstream os;
  int planned = 0, fitting = static_cast<int>(r.fitting.size()), dupes = 0;
  for (const auto& c : cands) planned += c.planned() ? 1 : 0, dupes += c.same_as >= 0 ? 1 : 0;
  os << "kiln fit: " << o.config.model << ", budget " << passes::human_bytes(o.memory_budget) << " (" << o.memory_budget
     << " B), effective batch " << o.effective_batch_size << ", backend " << o.config.backend << "\n";
  os << "searched " << cands.size() << " recipes: " << planned << " planned in " << fmt("%.2f", r.plan_s) << " s ("
     << r.passes_run << " pass runs, shared prefixes once, of " << r.passes_unshared << "), " << fitting
     << " distinct ones fit the budget"
     << (dupes > 0 ? " (" + std::to_string(dupes) +
                         " remat budget recipes recompute "
                         "nothing: the same as remat none)"
                   : std::string())
     << "; " << r.timed_kernels << " distinct eager kernels timed at their shapes (" << r.kernels_measured << " now, "
     << fmt("%.1f", r.kernel_timing_s) << " s; the rest cached for " << r.rates.machine << ")\n";
  // Rows: the Pareto front of planned peak against estimated time (no other recipe plans
  // less and is estimated faster), plus every measured recipe, by planned peak.
  std::vector<int> rows;
  for (size_t i = 0; i < cands.size(); ++i) {
    const FitCandidate& c = cands[i];
    if (!c.planned() || c.same_as >= 0) continue;
    bool dominated = false;
    for (const auto& d : cands)
      if (&d != &c && d.planned() && d.same_as < 0 && d.planned_peak <= c.planned_peak &&
          d.estimated_s <= c.estimated_s && (d.planned_peak < c.planned_peak || d.estimated_s < c.estimated_s))
        dominated = true;
    if (!dominated || c.measured_s > 0 || static_cast<int>(i) == r.chosen) rows.push_back(static_cast<int>(i));
  }
  std::stable_sort(rows.begin(), rows.end(), [&](int a, int b) {
    return cands[static_cast<size_t>(a)].planned_peak < cands[static_cast<size_t>(b)].planned_peak;
  });
  int unique = 0;
  for (const auto& c : cands) unique += c.planned() && c.same_as < 0 ? 1 : 0;
  const double E = static_cast<double>(o.effective_batch_size);
  os << pad("batch x accum", 14, true) << pad("prec", 5, true) << pad("remat", 8, true) << pad("optim", 12, true)
     << pad("planned peak", 13) << pad("fits", 5) << pad("est ms/step", 12) << pad("meas ms/step", 13)
     << pad("samples/s", 10) << "  recomputed\n";
  for (int i : rows) {
    const FitCandidate& c = cands[static_cast<size_t>(i)];
    const bool fits = c.planned_peak <= o.memory_budget;
    const double t = c.measured_s > 0 ? c.measured_s : c.estimated_s;
    os << pad(std::to_string(c.batch) + " x " + std::to_string(c.accumulation), 14, true) << pad(c.precision, 5, true)
       << pad(c.remat, 8, true) << pad(c.optim, 12, true) << pad(passes::human_bytes(c.planned_peak), 13)
       << pad(fits ? "yes" : "no", 5) << pad(fmt("%.1f", c.estimated_s * 1e3), 12)
       << pad(c.measured_s > 0 ? fmt("%.1f", c.measured_s * 1e3) : "-", 13) << pad(t > 0 ? fmt("%.1f", E / t) : "-", 10)
       << "  " << recomputed_text(c) << (i == r.chosen ? "  <- chosen" : "") << "\n";
  }
  if (unique > static_cast<int>(rows.size()))
    os << unique - static_cast<int>(rows.size())
       << " other recipes are dominated (another plans less memory and is estimated faster): --report_json lists "
          "every recipe\n";
  int failed = 0;
  for (const auto& c : cands) failed += c.planned() ? 0 : 1;
  if (failed > 0) {
    os << failed << " recipes have no plan (remat budget cannot reach the budget, or their passes failed)";
    for (const auto& c : cands)
      if (!c.planned()) {
        os << "; e.g. " << c.label() << ": " << c.error;
        break;
      }
    os << "\n";
  }
  os << "search " << fmt("%.1f", r.total_s) << " s (planning " << fmt("%.1f", r.plan_s) << " s, measuring "
     << fmt("%.1f", r.measure_s) << " s)\n";
  if (r.chosen >= 0) {
    const FitCandidate& c = cands[static_cast<size_t>(r.chosen)];
    os << "chosen: " << c.label() << ": planned peak " << passes::human_bytes(c.planned_peak);
    if (c.measured_peak >= 0) os << ", measured " << passes::human_bytes(c.measured_peak);
    if (c.measured_s > 0) os << ", " << fmt("%.1f", c.measured_s * 1e3) << " ms per optimizer step";
    os << "\n  kiln train " << o.config.model << " [this command's other flags] " << fit_flags(c, o.memory_budget)
       << "\n";
    os << "  --config JSON: " << fit_config_json(c, o.memory_budget) << "\n";
  }
  return os.str();
}

std::string fit_flags(const FitCandidate& c, int64_t memory_budget) {
  std::string s = "--per_device_train_batch_size " + std::to_string(c.batch) + " --gradient_accumulation_steps " +
                  std::to_string(c.accumulation);
  if (c.precision == "bf16") s += " --bf16";
  if (c.precision == "fp16") s += " --fp16";
  s += " --remat_policy " + c.remat;
  if (c.remat == "budget") s += " --memory_budget " + std::to_string(memory_budget);
  s += " --optim " + c.optim;
  return s;
}

std::string fit_config_json(const FitCandidate& c, int64_t memory_budget) {
  nlohmann::ordered_json j;
  j["per_device_train_batch_size"] = c.batch;
  j["gradient_accumulation_steps"] = c.accumulation;
  j["bf16"] = c.precision == "bf16";
  j["fp16"] = c.precision == "fp16";
  j["remat_policy"] = c.remat;
  if (c.remat == "budget") j["memory_budget"] = std::to_string(memory_budget);
  j["optim"] = c.optim;
  return j.dump();
}

std::string fit_report_json(const FitResult& r, const FitOptions& o) {
  nlohmann::ordered_json j;
  j["model"] = o.config.model;
  j["memory_budget"] = o.memory_budget;
  j["effective_batch_size"] = o.effective_batch_size;
  j["backend"] = o.config.backend;
  j["machine"] = r.rates.machine;
  j["plan_s"] = r.plan_s;
  j["measure_s"] = r.measure_s;
  j["total_s"] = r.total_s;
  j["passes_run"] = r.passes_run;
  j["passes_unshared"] = r.passes_unshared;
  j["chosen"] = r.chosen;
  nlohmann::ordered_json list = nlohmann::ordered_json::array();
  for (size_t i = 0; i < r.candidates.size(); ++i) {
    const FitCandidate& c = r.candidates[i];
    // The recipe's keys as --save_config writes them, then what the search learned.
    nlohmann::ordered_json e = nlohmann::ordered_json::parse(fit_config_json(c, o.memory_budget));
    e["label"] = c.label();
    e["planned_peak"] = c.planned_peak;
    e["fits"] = c.planned() && c.planned_peak <= o.memory_budget;
    e["same_as"] = c.same_as;
    e["estimated_s"] = c.estimated_s;
    e["modelled_launches"] = c.modelled_launches;
    e["measured_s"] = c.measured_s;
    e["measured_peak"] = c.measured_peak;
    e["recomputed_nodes"] = c.recomputed_nodes;
    e["recompute_flops"] = c.recompute_flops;
    e["error"] = c.error;
    e["chosen"] = static_cast<int>(i) == r.chosen;
    list.push_back(e);
  }
  j["candidates"] = list;
  return j.dump(1);
}

std::string fit_nothing_fits(const FitResult& r, const FitOptions& o) {
  // Recipes planned within the budget whose measured peak was over it (the plan missed
  // allocations of some kernel): say that, with the smallest measured peak.
  const FitCandidate* least = nullptr;
  for (int i : r.fitting) {
    const FitCandidate& c = r.candidates[static_cast<size_t>(i)];
    if (c.measured_peak >= 0 && (!least || c.measured_peak < least->measured_peak)) least = &c;
  }
  if (least)
    return "--memory_budget " + passes::human_bytes(o.memory_budget) +
           ": no recipe fits: " + std::to_string(r.fitting.size()) +
           " plan within the budget, but every one measured over it; the smallest measured peak is " +
           passes::human_bytes(least->measured_peak) + " (" + std::to_string(least->measured_peak) + " B, planned " +
           std::to_string(least->planned_peak) + " B), reached by " + fit_flags(*least, o.memory_budget);
  std::string s = "--memory_budget " + passes::human_bytes(o.memory_budget) + ": no recipe fits";
  if (r.smallest >= 0) {
    const FitCandidate& c = r.candidates[static_cast<size_t>(r.smallest)];
    s += "; the smallest planned peak is " + passes::human_bytes(c.planned_peak) + " (" +
         std::to_string(c.planned_peak) + " B), reached by " + fit_flags(c, o.memory_budget);
  }
  return s;
}

std::string fit_svg(const FitResult& r, const FitOptions& o) {
  std::vector<ScatterPoint> pts;
  const auto& cands = r.candidates;
  for (size_t i = 0; i < cands.size(); ++i) {
    const FitCandidate& c = cands[i];
    if (!c.planned() || c.same_as >= 0) continue;
    ScatterPoint p;
    const bool measured = c.measured_s > 0;
    p.label = c.label() + (measured ? " (measured)" : " (estimated)");
    p.x = static_cast<double>(c.planned_peak) / (1024.0 * 1024.0);
    p.y = (measured ? c.measured_s : c.estimated_s) * 1e3;
    p.group = c.precision == "fp32" ? 0 : 1;
    p.filled = measured;
    p.highlight = static_cast<int>(i) == r.chosen;
    if (p.highlight) p.label = "chosen: " + c.label();
    pts.push_back(p);
  }
  return scatter_svg(
      "kiln fit: planned peak against time per optimizer step (blue fp32, orange bf16; "
      "filled: measured)",
      "planned peak (MiB)", "ms per optimizer step", pts, static_cast<double>(o.memory_budget) / (1024.0 * 1024.0),
      "budget " + passes::human_bytes(o.memory_budget));
}

}  // namespace kiln::driver
