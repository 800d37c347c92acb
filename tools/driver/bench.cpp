// `kiln bench` (bench.h): one training program per variant, warm-up and timed steps
// interleaved across the variants, then the result tables.
#include "tools/driver/bench.h"

#include <omp.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <filesystem>
#include <optional>
#include <random>
#include <vector>

#include "ir/tensor.h"
#include "passes/memory_plan.h"
#include "runtime/data.h"
#include "runtime/metrics.h"
#include "runtime/profile.h"
#include "runtime/trainer.h"
#include "tools/driver/driver.h"
#include "tools/driver/train_run.h"

namespace kiln::driver {

namespace {

namespace fs = std::filesystem;
using runtime::TrainConfig;

std::string fmt(const char* f, double v) { return bench_fmt(f, v); }
std::string pad(const std::string& s, size_t width, bool left = false) { return bench_pad(s, width, left); }

/// Random batch for the graph's data inputs (normal floats, class ids in [0, classes)).
Expected<runtime::Batch> synthetic_batch(const std::vector<runtime::DataInputSpec>& specs, const std::string& label,
                                         int64_t rows, int64_t classes, uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::normal_distribution<double> nd;
  runtime::Batch b;
  for (auto& s : specs) {
    // (rows, the input's trailing dims): gradient accumulation multiplies the first dim.
    std::vector<int64_t> dims = {rows};
    for (int i = 1; i < s.shape.rank(); ++i) {
      const ir::Dim& d = s.shape.dims[i];
      if (!d.is_static())
        return Status::error("bench: input '" + s.name + "' has a non-static dim " + s.shape.to_string() +
                             "; bind it with --shape or give --train_data");
      dims.push_back(d.value);
    }
    ir::Tensor t(s.dtype, dims);
    for (int64_t i = 0; i < t.numel(); ++i) {
      if (ir::is_float(s.dtype))
        t.set_f64(i, nd(rng));
      else if (s.name == label)
        t.set_f64(i, static_cast<double>(rng() % static_cast<uint64_t>(std::max<int64_t>(1, classes))));
      else
        t.set_f64(i, static_cast<double>(rng() % 2));
    }
    b[s.name] = t;
  }
  return b;
}

/// One program variant: its label names what varies (backend, then policy, then optimizer).
struct Variant {
  std::string label, backend, policy, optim;
  std::string shape_mode = "pad";  ///< "symbolic": the sequence dim left a symbol (issue 32)
};

/// The variants of `cfg`'s backend x remat_policy x optim x shape_mode lists, each item
/// once. On fixed-shape data --shape_mode pad,symbolic compares the static program of the
/// --shape length with the symbolic program run at that length (--compare_static).
std::vector<Variant> bench_variants(const TrainConfig& cfg, bool compare_static, bool* by_policy) {
  auto split = [](const std::string& text) {  // validated items, each once
    std::vector<std::string> items;
    for (const std::string& item : runtime::comma_list(text))
      if (std::find(items.begin(), items.end(), item) == items.end()) items.push_back(item);
    return items;
  };
  const std::vector<std::string> backend_items = split(cfg.backend);
  const std::vector<std::string> policy_items = split(cfg.remat_policy);
  const std::vector<std::string> optim_items = split(cfg.optim);
  // On a synthetic batch every static mode (pad, specialize, buckets) builds the program
  // of the --shape length: one "static" variant.
  std::vector<std::string> shape_items;
  for (const std::string& m : split(cfg.shape_mode)) {
    const std::string item = m == "symbolic" ? m : "pad";
    if (std::find(shape_items.begin(), shape_items.end(), item) == shape_items.end()) shape_items.push_back(item);
  }
  // --compare_static: the symbolic program against the static one of its shape.
  if (compare_static && std::find(shape_items.begin(), shape_items.end(), "pad") == shape_items.end())
    shape_items.insert(shape_items.begin(), "pad");
  std::vector<Variant> variants;
  for (const std::string& b : backend_items)
    for (const std::string& p : policy_items)
      for (const std::string& o : optim_items)
        for (const std::string& m : shape_items) {
          std::string label;
          auto add = [&](const std::string& part) { label += (label.empty() ? "" : "/") + part; };
          if (backend_items.size() > 1) add(b);
          if (policy_items.size() > 1) add(p.empty() ? "none" : p);
          if (optim_items.size() > 1) add(o);
          if (shape_items.size() > 1) add(m == "symbolic" ? "symbolic" : "static");
          if (label.empty()) label = b;
          variants.push_back({label, b, p, o, m});
        }
  *by_policy = policy_items.size() > 1 || optim_items.size() > 1;
  return variants;
}

using Run = BenchRun;

double median(std::vector<double> t) { return bench_median(std::move(t)); }

}  // namespace

std::string bench_fmt(const char* f, double v) {
  char b[64];
  std::snprintf(b, sizeof b, f, v);
  return b;
}

std::string bench_pad(const std::string& s, size_t width, bool left) {
  if (s.size() >= width) return s;
  return left ? s + std::string(width - s.size(), ' ') : std::string(width - s.size(), ' ') + s;
}

double bench_median(std::vector<double> t) {
  if (t.empty()) return 0;
  std::sort(t.begin(), t.end());
  return t.size() % 2 ? t[t.size() / 2] : 0.5 * (t[t.size() / 2 - 1] + t[t.size() / 2]);
}

Status prepare_bench_run(BenchRun& run, const TrainConfig& c, passes::PassContext& dbg, int64_t total_steps,
                         std::optional<runtime::Dataset>& ds, int64_t length) {
  const auto t0 = std::chrono::steady_clock::now();
  KILN_ASSIGN_OR_RETURN(run.prog, build_training_program(c, &dbg, false, false, total_steps));
  run.compile_s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  auto& prog = run.prog;
  if (!ds) {
    // A data-parallel job's step reads world_size x the rank's rows (each rank its slice).
    const int64_t rows =
        c.per_device_train_batch_size * c.gradient_accumulation_steps * std::max<int64_t>(1, c.world_size);
    KILN_ASSIGN_OR_RETURN(auto specs, program_specs(*prog.train_step, prog.data_inputs));
    // A symbolic program's synthetic batch: its symbolic dims at the rows (dim 0) and
    // the length (the others).
    if (length > 0)
      for (auto& sp : specs)
        for (size_t k = 0; k < sp.shape.dims.size(); ++k)
          if (!sp.shape.dims[k].is_static()) sp.shape.dims[k] = ir::Dim(k == 0 ? rows : length);
    if (!c.train_data.empty()) {
      auto raw = runtime::load_raw_data(c.train_data);
      if (!raw) return raw.status().with_context("--train_data");
      // As kiln train: labels and token ids against the model before any step.
      KILN_ASSIGN_OR_RETURN(auto forward, load_model(c.model, c.shape));
      KILN_RETURN_IF_ERROR(check_data_values(*raw, "--train_data", *forward, c));
      auto bound = runtime::Dataset::bind(*raw, specs, data_options(c));
      if (!bound) return bound.status().with_context("--train_data");
      ds.emplace(std::move(*bound));
    } else {
      int64_t classes = 2;
      if (auto* lo = prog.train_step->find_value(prog.logits_output);
          lo && lo->shape.rank() > 0 && lo->shape.dims.back().is_static())
        classes = lo->shape.dims.back().value;
      KILN_ASSIGN_OR_RETURN(auto b, synthetic_batch(specs, prog.label_input, rows, classes, c.seed));
      std::vector<runtime::NamedArray> arrays;
      for (auto& [n, t] : b) arrays.push_back({n, "synthetic", t});
      KILN_ASSIGN_OR_RETURN(auto from, runtime::Dataset::from_arrays(arrays, specs, data_options(c)));
      ds.emplace(std::move(from));
    }
  }
  TrainConfig bc = c;
  bc.max_steps = total_steps;
  runtime::TrainerOptions to;
  to.write_files = false;
  KILN_ASSIGN_OR_RETURN(auto tr, runtime::Trainer::create(bc, graphs_of(prog), &*ds, nullptr, to));
  run.tr.emplace(std::move(tr));
  run.plan = executor_plan(prog);
  run.planned_peak = run.plan ? run.plan->peak_bytes : prog.signature.planned_peak_bytes;
  return Status::ok();
}

void start_timing(BenchRun& r) {
  r.resident = initializer_bytes(*r.prog.train_step) + step_arena_bytes(r.prog);
  for (auto& [n, t] : r.tr->state()) r.resident += static_cast<int64_t>(t.nbytes());
}

Status timed_bench_step(BenchRun& r) {
  // Measured step peak: MemoryStats peak during the step minus what was resident before
  // it, plus the step's own resident inputs (its constants and state).
  ir::MemoryStats::reset_peak();
  const int64_t before = ir::MemoryStats::current_bytes();
  const int64_t allocs = ir::MemoryStats::allocations();
  runtime::comm::Communicator* w = runtime::comm::world();
  if (w) w->reset_stats();
  auto st = r.tr->step();
  if (!st) return st.status();
  if (w) {
    const runtime::comm::CommStats s = w->stats();
    r.comm.bytes_sent += s.bytes_sent;
    r.comm.collectives += s.collectives;
    r.comm.busy_seconds += s.busy_seconds;
    r.comm.wait_seconds += s.wait_seconds;
  }
  r.times.push_back(st->seconds);
  r.allocations += ir::MemoryStats::allocations() - allocs;
  r.peak = std::max(r.peak, ir::MemoryStats::peak_bytes() - before + r.resident);
  return Status::ok();
}

Status run_bench(const BenchOptions& opts, std::ostream& out_given, std::ostream& err) {
  TrainConfig cfg = opts.config;
  if (opts.compare_static) {
    const std::vector<std::string> modes = runtime::comma_list(cfg.shape_mode);
    if (std::find(modes.begin(), modes.end(), "symbolic") == modes.end())
      return Status::error(
          "--compare_static: compares a symbolic program with static ones (add symbolic to "
          "--shape_mode, got '" +
          cfg.shape_mode + "')");
  }
  if (runtime::is_sequence_data(cfg.train_data)) {
    if (runtime::comm::launch_info().world_size > 1)
      return Status::error("kiln bench: variable-length data is benchmarked on one process (run it without mpirun)");
    return run_shape_bench(opts, out_given, err);
  }
  // Under mpirun or srun: every rank runs the same variants in the same order (their
  // collectives pair up); rank 0 prints, with each variant's communication per step.
  KILN_ASSIGN_OR_RETURN(const runtime::comm::Communicator* world, join_job(cfg));
  std::ostream quiet(nullptr);
  std::ostream& out = !world || world->rank() == 0 ? out_given : quiet;
  const int steps = opts.steps;
  int warmup = opts.warmup;
  const int64_t rows = cfg.per_device_train_batch_size * cfg.gradient_accumulation_steps;
  // --backend eager,compiled, --remat_policy none,blocks and/or --optim
  // adamw_torch,adamw_8bit: one program per variant (backend x policy x optimizer), their
  // steps interleaved so that the machine's load falls on each alike (ratios from one
  // run, not absolute times).
  bool by_policy = false;
  const std::vector<Variant> variants = bench_variants(cfg, opts.compare_static, &by_policy);
  std::vector<std::string> backends;
  for (const Variant& v : variants) backends.push_back(v.label);
  std::vector<Run> runs(backends.size());
  if (backends.size() > 1 && warmup < 1) {
    // The first step of a process pays one-time costs (page faults of the JIT code and
    // arena, oneDNN primitive creation) that would land on whichever backend runs first.
    err << "kiln: note: --warmup_steps_bench raised to 1: each backend needs a warm-up step to compare\n";
    warmup = 1;
  }
  passes::PassContext dbg = opts.pass_context ? opts.pass_context() : passes::PassContext();
  const std::string dump_root = dbg.dump_ir_dir;
  std::optional<runtime::Dataset> ds;
  for (size_t r = 0; r < backends.size(); ++r) {
    TrainConfig c = cfg;
    c.backend = variants[r].backend;
    c.remat_policy = variants[r].policy;
    c.optim = variants[r].optim;
    c.shape_mode = variants[r].shape_mode;
    int64_t length = 0;  // the symbolic variant's: the --shape length it runs at
    if (c.shape_mode == "symbolic") {
      // The symbolic program (issue 32): the sequence dims --shape binds stay symbols,
      // bounded by --max_length (default: that length), and the program runs the same
      // batch as the static variant (the synthetic batch of the --shape length).
      if (!cfg.train_data.empty())
        return Status::error("--shape_mode " + cfg.shape_mode +
                             ": a static and a symbolic program compare on a synthetic batch (no --train_data)");
      KILN_ASSIGN_OR_RETURN(auto module, import_model(c.model, c.untie_initializers));
      for (const std::string& sym : sequence_symbols(*module))
        if (auto it = c.shape.find(sym); it != c.shape.end()) {
          length = std::max(length, it->second);
          c.shape.erase(it);
        }
      if (length == 0)
        return Status::error("--shape_mode symbolic: give the sequence length to compare at (--shape SEQ=N)");
      if (c.max_length == 0) c.max_length = length;
      if (c.max_length < length)
        return Status::error("--max_length " + std::to_string(c.max_length) + ": below the --shape length " +
                             std::to_string(length) + " the symbolic program runs at");
    }
    if (c.effective_remat_policy() != "budget") c.memory_budget.clear();  // --memory_budget is the budget variant's
    runs[r].backend = backends[r];
    if (!dump_root.empty() && backends.size() > 1) {  // one --dump-ir-dir folder per backend
      std::string folder = backends[r];
      std::replace(folder.begin(), folder.end(), '/', '_');
      dbg.dump_ir_dir = (fs::path(dump_root) / folder).string();
      dbg.dump_index = 0;
    }
    KILN_RETURN_IF_ERROR(prepare_bench_run(runs[r], c, dbg, warmup + steps, ds, length));
  }
  if (opts.after_build) opts.after_build(dbg);
  for (auto& r : runs)
    if (auto* k = r.prog.train_kernels.get(); k && k->module) {
      const auto& st = k->module->stats();
      const auto& bt = r.prog.train_times;
      out << "compile (" << r.backend << " train step): " << st.num_kernels << " kernels (" << st.num_unique
          << " distinct); import " << fmt("%.3f", bt.import_s) << " s, training passes " << fmt("%.3f", bt.passes_s)
          << " s, fusion passes " << fmt("%.3f", bt.fusion_s) << " s, lower " << fmt("%.3f", k->lower_s)
          << " s, LLVM IR " << fmt("%.3f", st.emit_s) << " s, O3 " << fmt("%.3f", st.optimize_s)
          << " s, machine code + JIT link " << fmt("%.3f", st.codegen_s) << " s, arena plan " << fmt("%.3f", bt.arena_s)
          << " s\n";
    }
  for (int i = 0; i < warmup; ++i)
    for (auto& r : runs)
      if (auto st = r.tr->step(); !st) return st.status();
  for (auto& r : runs) {
    start_timing(r);
    if (opts.profile) {
      r.profile.set_group(opts.profile_by == "node" ? runtime::ProfileGroup::node : runtime::ProfileGroup::op);
      r.tr->set_profile(&r.profile);
    }
  }
  for (int i = 0; i < steps; ++i)
    for (auto& r : runs) KILN_RETURN_IF_ERROR(timed_bench_step(r));
  // --profile: per-op (or, --profile_by node, per-node) table of one backend's timed
  // steps (top 25 keys, then the rest summed).
  auto print_profile = [&](Run& r) {
    if (!opts.profile) return;
    double step_s = 0;
    for (double t : r.times) step_s += t;
    const double ops_s = r.profile.total_seconds();
    out << "profile (" << r.backend << "): " << steps << " timed steps, " << fmt("%.3f", step_s * 1e3)
        << " ms in steps, " << fmt("%.3f", ops_s * 1e3) << " ms in ops ("
        << fmt("%.1f", step_s > 0 ? 100.0 * ops_s / step_s : 0.0) << "%)\n"
        << r.profile.table(opts.profile_row_limit);
  };
  // Tensor storage allocated per timed step, and the compiled executor's step arena
  // (runtime/arena.h): its planned values take no allocation.
  auto print_allocations = [&] {
    out << "tensor allocations per step:";
    for (size_t i = 0; i < runs.size(); ++i) {
      const Run& r = runs[i];
      out << (i ? "," : "") << " " << r.backend << " "
          << fmt("%.1f", steps > 0 ? static_cast<double>(r.allocations) / steps : 0.0);
      if (auto* a = r.prog.train_arena.get())
        out << " (step arena " << passes::human_bytes(a->block_bytes()) << ", " << a->num_homes()
            << " planned outputs)";
    }
    out << "\n";
  };
  // A data-parallel job: per rank and timed step, what the program plans and the
  // communication layer counted (docs/distributed.md).
  auto print_data_parallel = [&] {
    if (cfg.world_size <= 1) return;
    for (const Run& r : runs) {
      const DataParallelPlan plan = data_parallel_plan(*r.prog.train_step, cfg.world_size);
      const double n = steps > 0 ? static_cast<double>(steps) : 1.0;
      const double overlap =
          r.comm.busy_seconds > 0 ? std::clamp(1.0 - r.comm.wait_seconds / r.comm.busy_seconds, 0.0, 1.0) : 0.0;
      out << "data parallel (" << r.backend << ", per rank of " << cfg.world_size
          << (cfg.zero_stage == 1 ? ", ZeRO stage 1" : "") << "): optimizer state "
          << passes::human_bytes(plan.optimizer_state_bytes) << ", " << fmt("%.3g", double(r.comm.collectives) / n)
          << " collectives (planned " << plan.collectives << ") and " << fmt("%.0f", double(r.comm.bytes_sent) / n)
          << " B sent (planned " << plan.bytes_sent << ") per step, communication "
          << runtime::format_time(r.comm.busy_seconds / n) << "/step, exposed "
          << runtime::format_time(r.comm.wait_seconds / n) << " (overlap " << fmt("%.0f", overlap * 100) << "%)\n";
    }
  };
  // Precision column (issue 4): what the step computes in (--bf16 / --fp16, else fp32).
  const char* precision = cfg.bf16 ? "bf16" : cfg.fp16 ? "fp16" : "fp32";
  if (runs.size() == 1) {
    Run& r = runs[0];
    const double med = median(r.times);
    out << "bench: " << steps << " steps after " << warmup << " warm-up, batch " << rows
        << (cfg.world_size > 1 ? " per rank (" + std::to_string(cfg.world_size) + " ranks)" : std::string()) << " ("
        << r.backend << ")\n";
    out << "precision " << precision << " | median step time " << runtime::format_time(med) << " | "
        << fmt("%.1f", med > 0 ? rows / med : 0.0) << " samples/s\n";
    out << "peak memory: "
        << (r.planned_peak >= 0
                ? planned_vs_measured(r.planned_peak, r.peak)
                : "measured " + passes::human_bytes(r.peak) + " (" + std::to_string(r.peak) + " B), no plan")
        << "\n";
    print_allocations();
    print_data_parallel();
    print_profile(r);
    return Status::ok();
  }
  out << "bench: " << steps << " steps after " << warmup << " warm-up, batch " << rows
      << (cfg.world_size > 1 ? " per rank (" + std::to_string(cfg.world_size) + " ranks)" : std::string())
      << ", precision " << precision << ", OpenMP threads: " << omp_get_max_threads() << "; steps alternate between "
      << (by_policy ? "variants" : "backends") << "\n";
  size_t label_w = 10;
  for (auto& r : runs) label_w = std::max(label_w, r.backend.size() + 2);
  const size_t vs_w = std::max<size_t>(14, runs[0].backend.size() + 5);
  out << pad(by_policy ? "variant" : "backend", label_w, true) << pad("median step", 16) << pad("samples/s", 12)
      << pad("vs " + runs[0].backend, vs_w) << pad("peak measured", 16) << pad("peak planned", 16) << pad("build", 10)
      << "\n";
  const double base = median(runs[0].times);
  for (auto& r : runs) {
    const double med = median(r.times);
    out << pad(r.backend, label_w, true) << pad(runtime::format_time(med), 16)
        << pad(fmt("%.1f", med > 0 ? rows / med : 0.0), 12) << pad(fmt("%.2fx", med > 0 ? base / med : 0.0), vs_w)
        << pad(passes::human_bytes(r.peak), 16)
        << pad(r.planned_peak >= 0 ? passes::human_bytes(r.planned_peak) : "-", 16)
        << pad(runtime::format_time(r.compile_s), 10) << "\n";
  }
  print_allocations();
  print_data_parallel();
  for (auto& r : runs) print_profile(r);
  return Status::ok();
}

}  // namespace kiln::driver
