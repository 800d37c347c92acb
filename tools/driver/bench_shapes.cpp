// `kiln bench --shape_mode pad,specialize,buckets --train_data ROWS.jsonl` (issue 31): the
// strategies for variable-length data side by side on one model and the same batches.
// Each mode trains from the same initial weights with its own Trainer and its own
// programs (ShapePrograms, a fresh cache folder per mode, so "cold" is a real compile);
// their steps alternate so that the machine's load falls on each alike.
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <limits>
#include <map>
#include <optional>
#include <vector>

#include "ir/tensor.h"
#include "passes/memory_plan.h"
#include "runtime/buckets.h"
#include "runtime/data.h"
#include "runtime/metrics.h"
#include "runtime/profile.h"
#include "runtime/trainer.h"
#include "tools/driver/bench.h"
#include "tools/driver/driver.h"
#include "tools/driver/train_run.h"

namespace kiln::driver {

namespace {

namespace fs = std::filesystem;
using runtime::TrainConfig;

/// One mode's run and its measurements.
struct ModeRun {
  std::string mode;
  TrainConfig cfg;
  std::optional<ShapePrograms> programs;
  std::optional<runtime::Trainer> tr;
  int64_t programs_before_step2 = 0;  // programs built before the second step
  int64_t real_tokens = 0, padded_tokens = 0;
  double step_s = 0;                              // timed steps, compile time excluded
  std::map<int64_t, std::vector<double>> by_len;  // padded length -> step seconds
  std::map<int64_t, int64_t> runs_at;             // padded length -> steps run there (warm-up included)
  // --compare_static: per length, the timed step that was the mode's first run there
  // (cold), and the timed steps from its third run on (warm).
  std::map<int64_t, double> cold;
  std::map<int64_t, std::vector<double>> warm;
  int64_t peak = 0;            // measured step peak
  double warm_s = 0;           // the same programs from the program cache
  runtime::OpProfile profile;  // --profile: the timed steps' ops or nodes
};

}  // namespace

Status run_shape_bench(const BenchOptions& opts, std::ostream& out, std::ostream& err) {
  const TrainConfig& cfg = opts.config;
  std::vector<std::string> modes;
  for (const std::string& m : runtime::comma_list(cfg.shape_mode))
    if (std::find(modes.begin(), modes.end(), m) == modes.end()) modes.push_back(m);
  // --compare_static: "static", the program of exactly each batch length (specialize
  // without a recompile limit), on the same batches as the symbolic program.
  if (opts.compare_static) modes.push_back("static");
  for (const char* list : {"backend", "remat_policy", "optim"}) {
    const std::string& v = std::string(list) == "backend" ? cfg.backend
                           : std::string(list) == "optim" ? cfg.optim
                                                          : cfg.remat_policy;
    if (v.find(',') != std::string::npos)
      return Status::error(std::string("--") + list +
                           ": one value with variable-length data (kiln bench compares --shape_mode lists there)");
  }
  const int steps = opts.steps, warmup = std::max(opts.warmup, 1);
  const int64_t total = warmup + steps;
  // The same batches in every mode: length-grouped order for all (buckets needs it;
  // the others run the same rows for a fair comparison).
  TrainConfig base = cfg;
  base.group_by_length = true;
  base.max_steps = total;
  auto ds = bind_train_data(base);
  if (!ds) return ds.status();
  if (!cfg.group_by_length) err << "kiln: note: every mode trains length-grouped batches (--group_by_length)\n";
  const fs::path cache_root = fs::temp_directory_path() / ("kiln_bench_shapes_" + std::to_string(::getpid()));
  struct Cleanup {
    fs::path p;
    ~Cleanup() {
      std::error_code ec;
      fs::remove_all(p, ec);
    }
  } cleanup{cache_root};
  std::vector<ModeRun> runs(modes.size());
  for (size_t i = 0; i < modes.size(); ++i) {
    ModeRun& r = runs[i];
    r.mode = modes[i];
    r.cfg = base;
    r.cfg.shape_mode = modes[i] == "static" ? "specialize" : modes[i];
    if (modes[i] == "static") r.cfg.recompile_limit = std::numeric_limits<int32_t>::max();
    r.cfg.cache_dir = (cache_root / modes[i]).string();  // cold: nothing cached yet
    r.programs.emplace(r.cfg, nullptr, total, nullptr);
    r.programs->set_longest_row(ds->max_length());
    runtime::TrainerOptions to;
    to.write_files = false;
    to.programs = r.programs->provider();
    KILN_ASSIGN_OR_RETURN(auto tr, runtime::Trainer::create(r.cfg, runtime::TrainGraphs{}, &*ds, nullptr, to));
    r.tr.emplace(std::move(tr));
    KILN_RETURN_IF_ERROR(r.tr->prepare_programs());  // buckets: all before step 1
  }
  const int64_t rows = cfg.per_device_train_batch_size * cfg.gradient_accumulation_steps;
  for (int k = 0; k < total; ++k)
    for (ModeRun& r : runs) {
      if (k == 1) r.programs_before_step2 = r.programs->built() + r.programs->cache_hits();
      const runtime::StepShape shape = r.tr->step_shape(k);
      const double compile_before = r.programs->seconds();
      ir::MemoryStats::reset_peak();
      const int64_t before = ir::MemoryStats::current_bytes();
      if (k == warmup && opts.profile) {
        r.profile.set_group(opts.profile_by == "node" ? runtime::ProfileGroup::node : runtime::ProfileGroup::op);
        r.tr->set_profile(&r.profile);
      }
      auto st = r.tr->step();
      if (!st) return st.status().with_context("--shape_mode " + r.mode);
      const int64_t nth = ++r.runs_at[shape.length];  // this step is the mode's nth run at its length
      if (k < warmup) continue;
      // The step's own time: a program built during it is compile time, counted apart.
      const double s = std::max(0.0, st->seconds - (r.programs->seconds() - compile_before));
      const int64_t spe = r.tr->steps_per_epoch();
      const int64_t n = shape.micro_rows * shape.trips;
      const int64_t real = ds->train_batch_tokens(r.cfg.seed, k / spe, k % spe, rows, 0, n);
      const int64_t length = shape.length;
      r.real_tokens += real;
      r.padded_tokens += n * length;
      r.step_s += s;
      r.by_len[length].push_back(s);
      if (nth == 1) r.cold[length] = s;
      if (nth >= 3) r.warm[length].push_back(s);
      int64_t state = 0;
      for (auto& [name, t] : r.tr->state()) state += static_cast<int64_t>(t.nbytes());
      r.peak = std::max(r.peak, ir::MemoryStats::peak_bytes() - before + state + r.programs->arena_bytes());
    }
  // Warm: every program of the mode again, from the program cache its cold run filled.
  for (ModeRun& r : runs) {
    ShapePrograms warm(r.cfg, nullptr, total, nullptr);
    warm.set_longest_row(ds->max_length());  // the cold run's bound (a symbolic program's key)
    for (const auto& [shape, prog] : r.programs->programs())
      if (auto g = warm.get(shape, "warm"); !g) return g.status();
    r.warm_s = warm.seconds();
  }
  const char* precision = cfg.bf16 ? "bf16" : cfg.fp16 ? "fp16" : "fp32";
  const size_t vs_w = std::max<size_t>(12, runs[0].mode.size() + 5);
  out << "bench: variable-length data " << ds->files() << " (" << ds->num_rows() << " rows, up to " << ds->max_length()
      << " tokens), " << steps << " steps after " << warmup << " warm-up, batch " << rows << ", precision " << precision
      << ", backend " << cfg.backend << "; steps alternate between modes\n";
  out << bench_pad("mode", 12, true) << bench_pad("programs", 10) << bench_pad("compile cold", 14)
      << bench_pad("warm", 10) << bench_pad("rebuilds", 10) << bench_pad("padding", 9) << bench_pad("real tok/s", 12)
      << bench_pad("vs " + runs[0].mode, std::max<size_t>(12, runs[0].mode.size() + 5)) << bench_pad("peak planned", 14)
      << bench_pad("peak measured", 15) << "\n";
  const double base_rate = runs[0].step_s > 0 ? runs[0].real_tokens / runs[0].step_s : 0;
  for (ModeRun& r : runs) {
    const int64_t np = r.programs->built() + r.programs->cache_hits();
    const double rate = r.step_s > 0 ? r.real_tokens / r.step_s : 0;
    const double padding =
        r.padded_tokens > 0 ? 1.0 - static_cast<double>(r.real_tokens) / static_cast<double>(r.padded_tokens) : 0;
    out << bench_pad(r.mode, 12, true) << bench_pad(std::to_string(np), 10)
        << bench_pad(runtime::format_time(r.programs->seconds()), 14) << bench_pad(runtime::format_time(r.warm_s), 10)
        << bench_pad(std::to_string(np - r.programs_before_step2), 10)
        << bench_pad(bench_fmt("%.1f%%", 100 * padding), 9) << bench_pad(bench_fmt("%.0f", rate), 12)
        << bench_pad(bench_fmt("%.2fx", base_rate > 0 ? rate / base_rate : 0), vs_w)
        << bench_pad(passes::human_bytes(std::max<int64_t>(0, r.programs->max_planned_peak())), 14)
        << bench_pad(passes::human_bytes(r.peak), 15) << "\n";
  }
  // Padding over a whole epoch of the same order (not only the timed steps), against the
  // bound: every row padded to its bucket, the exact optimum of the planner.
  {
    const std::vector<int64_t>& lens = ds->sequence_lengths();
    const std::vector<int64_t> order =
        runtime::length_grouped_order(lens, rows, base.seed, 0, data_options(base).mega_batch_mult);
    out << "padding over one epoch (" << lens.size() << " rows in batches of " << rows << "):";
    for (ModeRun& r : runs) {
      // The epoch's batches shaped as the mode shapes them, the specialize limit included.
      const runtime::ShapeChooser* ch = r.tr->shape_chooser();
      runtime::ShapeChooser sim(ch->mode(), ch->max_length(), ch->buckets(), ch->recompile_limit());
      std::vector<std::vector<int64_t>> batches;
      std::vector<int64_t> padded;
      for (size_t b = 0; b < order.size(); b += static_cast<size_t>(rows)) {
        batches.emplace_back(order.begin() + static_cast<std::ptrdiff_t>(b),
                             order.begin() + static_cast<std::ptrdiff_t>(std::min(order.size(), b + rows)));
        int64_t need = 0;
        for (int64_t row : batches.back()) need = std::max(need, lens[static_cast<size_t>(row)]);
        padded.push_back(sim.choose(need).length);
        sim.add_built(padded.back());
      }
      auto st = runtime::padding_of_batches(lens, batches, padded);
      if (!st) return st.status();
      const std::vector<int64_t>& bounds = ch->buckets();
      out << " " << r.mode << " " << bench_fmt("%.1f%%", 100 * st->fraction());
      if (ch->mode() == runtime::ShapeMode::buckets) {
        auto plan = runtime::evaluate_buckets(ds->length_histogram(), bounds);
        if (!plan) return plan.status();
        const double bound = plan->padding_fraction();
        out << " (buckets ";
        for (size_t i = 0; i < bounds.size(); ++i) out << (i ? "," : "") << bounds[i];
        out << ": bound " << bench_fmt("%.1f%%", 100 * bound) << ", padded tokens "
            << bench_fmt("%.2fx", plan->padded_tokens > 0 ? double(st->padded_tokens) / double(plan->padded_tokens) : 0)
            << " the bound's)";
      }
    }
    out << "\n";
  }
  out << "step time per padded length (median of the timed steps at that length):\n";
  for (ModeRun& r : runs) {
    out << "  " << bench_pad(r.mode, 12, true);
    for (auto& [len, t] : r.by_len)
      out << " " << len << ": " << runtime::format_time(bench_median(t)) << " (" << t.size() << ")";
    out << "\n";
  }
  if (opts.compare_static) {
    // Per length both ran at (the same batches): the symbolic program's step time against
    // the static program's of that length.
    const ModeRun* sym = nullptr;
    const ModeRun* fixed = nullptr;
    for (const ModeRun& r : runs) {
      if (r.mode == "symbolic") sym = &r;
      if (r.mode == "static") fixed = &r;
    }
    // A timed step that is a program's first run at its length is cold: the static
    // program of that length makes its oneDNN primitives and touches its new step arena
    // then (the symbolic program runs a new length's first two products per layout on
    // shape-generic primitives and makes its own on the third). From a program's third
    // run at a length on, both run their own primitives (warm). Per length: the cold
    // ratio (both first runs timed) and the warm ratio of the medians; then the
    // geometric mean of each.
    out << "symbolic / static step time per length (--compare_static; cold: each program's first run at the "
           "length, warm: median of its third and later runs):\n ";
    double log_cold = 0, log_warm = 0;
    int n_cold = 0, n_warm = 0;
    for (const auto& [len, t] : sym->by_len) {
      if (!fixed->by_len.count(len)) continue;
      std::string item;
      auto c1 = sym->cold.find(len), c2 = fixed->cold.find(len);
      if (c1 != sym->cold.end() && c2 != fixed->cold.end() && c1->second > 0 && c2->second > 0) {
        item += " cold " + bench_fmt("%.3f", c1->second / c2->second);
        log_cold += std::log(c1->second / c2->second), ++n_cold;
      }
      auto w1 = sym->warm.find(len), w2 = fixed->warm.find(len);
      if (w1 != sym->warm.end() && w2 != fixed->warm.end()) {
        const double a = bench_median(w1->second), b = bench_median(w2->second);
        if (a > 0 && b > 0) {
          item += std::string(item.empty() ? "" : ",") + " warm " + bench_fmt("%.3f", a / b);
          log_warm += std::log(a / b), ++n_warm;
        }
      }
      if (!item.empty()) out << " " << len << ":" << item;
    }
    out << "\n  geometric mean: cold "
        << (n_cold ? bench_fmt("%.3f", std::exp(log_cold / n_cold)) : std::string("none")) << " over " << n_cold
        << " lengths, warm " << (n_warm ? bench_fmt("%.3f", std::exp(log_warm / n_warm)) : std::string("none"))
        << " over " << n_warm << " lengths"
        << (opts.profile ? "" : " (per kernel: add --profile_by node; steady state at one length: --shape SEQ=N)")
        << "\n";
  }
  // --profile: per op (--profile_by node: per node or generated kernel) over each mode's
  // timed steps, the same batches in every mode (with --compare_static, the symbolic
  // program's kernels against those of the static programs of the same lengths).
  if (opts.profile)
    for (const ModeRun& r : runs) {
      const double ops_s = r.profile.total_seconds();
      out << "profile (" << r.mode << "): " << steps << " timed steps, " << bench_fmt("%.3f", r.step_s * 1e3)
          << " ms in steps, " << bench_fmt("%.3f", ops_s * 1e3) << " ms in ops ("
          << bench_fmt("%.1f", r.step_s > 0 ? 100.0 * ops_s / r.step_s : 0.0) << "%)\n"
          << r.profile.table(opts.profile_row_limit);
    }
  out << "rebuilds: programs built after step 1 (the compile time of those steps is left out of their step time); "
         "peak measured: the step's transient peak plus the state and every step arena of the mode's programs\n";
  return Status::ok();
}

}  // namespace kiln::driver
