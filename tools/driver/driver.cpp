// The pipeline driver: import -> passes -> graphs for the runtime.
#include "tools/driver/driver.h"

#include <atomic>
#include <chrono>
#include <functional>
#include <iostream>
#include <limits>
#include <set>
#include <sstream>
#include <unordered_map>
#include <unordered_set>

#include "frontend/onnx_import.h"
#include "ir/op_table.h"
#include "ir/printer.h"
#include "ir/verifier.h"
#include "passes/memory_plan.h"
#include "passes/passes.h"
#include "runtime/data.h"
#include "runtime/interpreter.h"
#include "runtime/io.h"
#include "runtime/trainer.h"
#include "tools/driver/logs.h"
#include "tools/driver/pipeline.h"
#include "tools/driver/train_run.h"

namespace kiln::driver {

namespace {
/// Measured break-even (docs/performance.md, 1 thread, Xeon with AVX512_BF16):
/// mlp_digits' products (0.08-0.5 MFLOP) and cnn_bn's first convolution (0.6 MFLOP)
/// are slower in bf16; tiny_gpt's (4.2-25 MFLOP, attention included) are faster, and
/// keeping its 4.2 MFLOP attention products in f32 cost more casts than it saved.
constexpr double kAutocastBreakEvenFlops = 3e6;
/// Convolutions: on oneDNN's blocked layouts (runtime/kernels/onednn.cpp) the f32 kernels
/// beat the bf16 ones at every ResNet-18 (width 8, 32x32) size measured, up to 19 MFLOP
/// (tools/bench_onednn.sh: batch 32, conv1 forward 0.10 against 0.09 ms, backward-weights
/// 0.12 against 0.38 ms; the 3x3 convolutions' backward 2-3x slower in bf16), and cnn_bn
/// and resnet18 trained slower with --bf16 than in fp32 while they were cast. The
/// break-even lies above that; 100 MFLOP until a larger convolution is measured.
constexpr double kAutocastConvBreakEvenFlops = 1e8;

/// The error for a compiled program without its step arena: --stop-after cut off the
/// pass arena_plan (the compiled backend cannot run without it), else an internal error.
Status no_arena_plan(const char* which, const passes::PassContext* dbg) {
  if (dbg && dbg->stop_after > 0)
    return Status::error(std::string("--stop-after ") + std::to_string(dbg->stop_after) + " stops the " + which +
                         " program before the pass arena_plan, which --backend compiled needs to run it; use "
                         "--backend eager, or stop after a later pass");
  return Status::error(std::string("the ") + which + " program has no arena plan (internal)");
}
}  // namespace

bool host_has_native_bf16() {
#if defined(__x86_64__) && defined(__GNUC__)
  __builtin_cpu_init();
  return __builtin_cpu_supports("avx512bf16");
#else
  return false;
#endif
}

double autocast_break_even_flops(ir::DType low, bool convolution) {
  if (low == ir::DType::f16) return std::numeric_limits<double>::infinity();
  // With native bf16 dot products a bf16 product runs about 2x an f32 one, so it pays
  // once the product outweighs its casts; without them the product is widened back to
  // f32 (gemm_widening) and only the memory traffic of larger operands is saved.
  const double flops = convolution ? kAutocastConvBreakEvenFlops : kAutocastBreakEvenFlops;
  return host_has_native_bf16() ? flops : 4 * flops;
}

double autocast_min_flops(const runtime::TrainConfig& cfg, bool convolution) {
  return cfg.autocast_min_flops < 0
             ? autocast_break_even_flops(cfg.fp16 ? ir::DType::f16 : ir::DType::bf16, convolution)
             : cfg.autocast_min_flops;
}

using namespace kiln::ir;

/// Runs `pipeline` on `g` with `options`, under the debugging switches of `dbg` (a quiet
/// context when null). Error: a name that is not a registered pass (unknown_pass), before
/// anything runs.
static Status run_passes(Graph& g, const std::vector<std::string>& pipeline, passes::PassContext* dbg,
                         const passes::PassOptions& options) {
  for (const std::string& n : pipeline)
    if (!passes::make_pass(n)) return passes::unknown_pass(n);
  passes::PassContext local;
  passes::PassContext& ctx = dbg ? *dbg : local;
  ctx.options = options;
  if (!ctx.evaluator) ctx.evaluator = runtime::evaluate_node;  // constant folding's evaluator
  if (log_enabled("passes")) {
    std::string list;
    for (auto& n : pipeline) list += (list.empty() ? "" : ", ") + n;
    log_text("passes", "graph " + g.name + ": " + list);
  }
  return passes::run_pipeline(g, pipeline, ctx);
}

/// Symbolic dim names used anywhere in the graph's inputs.
static std::set<std::string> input_symbols(const Graph& g) {
  std::set<std::string> s;
  for (Value* v : g.inputs)
    for (const Dim& d : v->shape.dims)
      if (!d.is_static() && !d.symbol().empty()) s.insert(d.symbol());
  return s;
}

/// Prints each import note once per process (a run loads its model for several programs).
void print_import_notes(const Graph& g) {
  static std::set<std::string> printed;
  for (const std::string& n : g.import_notes)
    if (printed.insert(n).second) {
      const bool warning = n.rfind("warning: ", 0) == 0;
      std::cerr << runtime::message_prefix() << ": " << (warning ? "" : "note: ") << n << "\n";
    }
}

namespace {
std::atomic<int64_t> g_model_imports{0};
}

int64_t model_imports() { return g_model_imports.load(); }

Expected<std::unique_ptr<Graph>> import_model(const std::string& path, bool untie_initializers) {
  runtime::register_eager_kernels();  // constant folding evaluates through the op table's kernels
  ++g_model_imports;
  log_text("passes", "import " + path);
  frontend::ImportOptions opts;  // nothing bound: the module keeps its dim_params
  opts.untie_initializers = untie_initializers;
  auto g = frontend::import_onnx(path, opts);
  if (!g) return g.status();
  print_import_notes(**g);
  return g;
}

/// Every static shape of `g` (inputs, initializers, node outputs) holds at most
/// 2^62 bytes: element counts and byte sizes (int64 throughout kiln: FLOPs, the memory
/// plan, allocation) cannot overflow.
static Status check_value_sizes(const Graph& g) {
  auto check = [](const Value* v) -> Status {
    if (!v || !v->shape.is_static()) return Status::ok();
    const int64_t limit = (int64_t{1} << 62) / static_cast<int64_t>(std::max<size_t>(1, ir::dtype_size(v->dtype)));
    int64_t n = 1;
    for (const ir::Dim& d : v->shape.dims) {
      if (d.value == 0) return Status::ok();
      if (d.value < 0 || n > limit / d.value)
        return Status::error("value '" + v->name + "' of shape " + v->shape.to_string() +
                             " has more elements than kiln can count (more than 2^62 bytes)");
      n *= d.value;
    }
    return Status::ok();
  };
  for (const Value* v : g.inputs) KILN_RETURN_IF_ERROR(check(v));
  for (const Value* v : g.initializers) KILN_RETURN_IF_ERROR(check(v));
  for (const auto& n : g.nodes())
    for (const Value* o : n->outputs) KILN_RETURN_IF_ERROR(check(o));
  return Status::ok();
}

/// Every lookup (Gather) whose indices became constants when `shape` was bound reads
/// inside its table: a GPT's position table `wpe` of P rows takes at most P tokens, and
/// binding seq past it is refused here, before any pass or kernel, instead of failing at
/// the first step. Error: "node N looks up row R of 'TABLE', which has P rows (with
/// seq=300): ...".
static Status check_constant_lookups(const Graph& g, const std::map<std::string, int64_t>& shape) {
  for (const auto& n : g.nodes()) {
    if (!ir::has_trait(*n, ir::OpTrait::gather) || n->num_inputs() < 2 || !n->inputs[0] || !n->inputs[1]) continue;
    const Value *table = n->inputs[0], *idx = n->inputs[1];
    if (!idx->data || !ir::is_integer(idx->dtype)) continue;
    int64_t axis = n->attrs.get_int("axis", 0);
    if (axis < 0) axis += table->shape.rank();
    if (axis < 0 || axis >= table->shape.rank() || !table->shape.dims[static_cast<size_t>(axis)].is_static()) continue;
    const int64_t rows = table->shape.dims[static_cast<size_t>(axis)].value;
    for (int64_t i = 0; i < idx->data->numel(); ++i) {
      const int64_t r = idx->data->get_i64(i);
      if (r >= -rows && r < rows) continue;
      std::string bound;
      for (auto& [k, v] : shape) bound += (bound.empty() ? "" : ", ") + k + "=" + std::to_string(v);
      return Status::error("node '" + n->name + "' looks up row " + std::to_string(r) + " of '" + table->name +
                           "', which has " + std::to_string(rows) + " rows" +
                           (bound.empty() ? std::string() : " (with " + bound + ")") + ": the model takes at most " +
                           std::to_string(rows) + " positions (lower --max_length, --block_size or --shape)");
    }
  }
  return Status::ok();
}

Expected<std::unique_ptr<Graph>> specialize_model(const Graph& module, const std::string& path,
                                                  const std::map<std::string, int64_t>& shape, bool to_f64,
                                                  passes::PassContext* dbg) {
  runtime::register_eager_kernels();
  // A --shape name that no input uses is a typo, not something to ignore silently.
  auto syms = input_symbols(module);
  for (auto& [name, v] : shape)
    if (!syms.count(name)) {
      std::string known;
      for (auto& s : syms) known += (known.empty() ? "" : ", ") + s;
      return Status::error("--shape " + name + "=" + std::to_string(v) + ": the model has no input dim named '" + name +
                           "' (symbolic dims: " + (known.empty() ? "none" : known) + ")");
    }
  std::unique_ptr<Graph> g = module.clone();
  KILN_RETURN_IF_ERROR(ir::bind_symbols(*g, shape).with_context(path));
  KILN_RETURN_IF_ERROR(run_passes(*g, specialize_pipeline(to_f64), dbg, {}).with_context(path));
  KILN_RETURN_IF_ERROR(check_value_sizes(*g).with_context(path));
  KILN_RETURN_IF_ERROR(check_constant_lookups(*g, shape).with_context(path));
  return g;
}

Expected<std::unique_ptr<Graph>> load_model(const std::string& path, const std::map<std::string, int64_t>& shape,
                                            bool to_f64, passes::PassContext* dbg, bool untie_initializers) {
  KILN_ASSIGN_OR_RETURN(auto module, import_model(path, untie_initializers));
  return specialize_model(*module, path, shape, to_f64, dbg);
}

Expected<std::unique_ptr<Graph>> load_inference_model(const std::string& path,
                                                      const std::map<std::string, int64_t>& shape,
                                                      passes::PassContext* dbg, bool untie_initializers) {
  KILN_ASSIGN_OR_RETURN(auto g, load_model(path, shape, false, dbg, untie_initializers));
  KILN_RETURN_IF_ERROR(run_passes(*g, {"eval_mode", "canonicalize"}, dbg, {}).with_context(path));
  return g;
}

/// Generated kernels of `g` (`which`: "train" or "eval"): LLVM through the compile cache
/// (codegen/cpu/program.h). The ahead-of-time binary of `kiln compile` (built with
/// KILN_AOT) loads its program and never builds one: an error there.
static Expected<std::shared_ptr<codegen::CpuProgram>> compile_program(const Graph& g, const runtime::TrainConfig& cfg,
                                                                      const std::string& which) {
  log_text("fusion", describe_fusion(g));
  std::shared_ptr<codegen::CpuProgram> prog;
#ifdef KILN_AOT
  (void)cfg;
  (void)prog;
  return Status::error("the training binary builds no " + which + " kernels: it runs the program it holds");
#else
  codegen::CpuCompileOptions co;
  co.use_cache = !cfg.no_cache;
  co.cache_dir = cfg.cache_dir;
  co.symbol_prefix = "kiln_" + which + "_";
  if (log_enabled("output_code") || log_enabled("cache"))
    co.log = [](const std::string& topic, const std::string& text) { log_text(topic, text); };
  KILN_ASSIGN_OR_RETURN(prog, codegen::compile_graph_cpu(g, co));
#endif
  if (log_enabled("recompiles")) {
    std::ostringstream os;
    os << "compiled " << g.name << " (" << which << "): " << prog->kernels.size()
       << " kernels; reason: a new program (static shapes and options; kiln never recompiles a program)";
    if (!prog->cache_status.empty()) os << "; compile cache: " << prog->cache_status;
    log_text("recompiles", os.str());
  }
  return prog;
}

Expected<passes::MemoryPlan> plan_step_arena_layout(const Graph& g) { return passes::plan_step_arena_layout(g); }

std::shared_ptr<runtime::StepArena> arena_of_plan(const passes::MemoryPlan& plan) {
  std::unordered_map<const ir::Value*, runtime::ArenaSlot> slots;
  for (const passes::ValuePlan& vp : plan.values) {
    if (vp.persistent || vp.buffer < 0 || vp.offset < 0 || !vp.value) continue;
    const passes::BufferPlan& b = plan.buffers[static_cast<size_t>(vp.buffer)];
    runtime::ArenaSlot s;
    s.offset = vp.offset;
    s.bytes = b.size;
    // The first value of its buffer, produced by a node: the others get there by the
    // interpreter's in-place and view rules.
    s.home = vp.def >= 0 && plan.values[b.values.front()].value == vp.value;
    slots.emplace(vp.value, s);
  }
  return std::make_shared<runtime::StepArena>(std::move(slots), plan.arena_bytes);
}

Expected<std::shared_ptr<runtime::StepArena>> plan_step_arena(const Graph& g) {
  KILN_ASSIGN_OR_RETURN(passes::MemoryPlan plan, plan_step_arena_layout(g));
  return arena_of_plan(plan);
}

/// dim_param bindings of a program whose data batch is `batch` rows, in order of precedence:
/// --shape's; each input's symbolic dim 0 bound to `batch`; when the training data is a token
/// file, the symbolic dim 1 of integer (batch, seq) inputs bound to --block_size; each
/// other symbolic dim k of an input fed by NAME=FILE.npy bound to the file's dim k (the
/// files in `data` first, then the training data's: an eval program without eval data
/// takes the training data's lengths). `flag` names the batch-size flag; with `enforce`, a
/// --shape value for a batch dim other than `batch` is an error, and so is a named
/// symbolic dim of an input that nothing binds (one line naming the dim and the flags).
static Expected<std::map<std::string, int64_t>> batch_bindings(const runtime::TrainConfig& cfg, const Graph& module,
                                                               const std::vector<std::string>& data, int64_t batch,
                                                               const char* flag, bool enforce) {
  std::map<std::string, int64_t> b = cfg.shape;
  const bool token_data = runtime::is_token_file(cfg.train_data);  // windows of --block_size
  // --shape_mode symbolic (issue 32) leaves the sequence dims of variable-length data
  // symbolic, and the batch dim too where no accumulation loop or data-parallel job
  // slices the rows (the epoch's last partial batch then runs on the same program).
  // (Without data: kiln bench's symbolic variant, run on a synthetic batch.)
  const bool symbolic =
      cfg.shape_mode == "symbolic" && (runtime::is_sequence_data(cfg.train_data) || cfg.train_data.empty());
  const bool free_batch = symbolic && cfg.gradient_accumulation_steps <= 1 && cfg.world_size <= 1;
  std::set<std::string> left_symbolic;
  for (Value* in : module.inputs) {
    if (in->shape.rank() == 0) continue;
    const std::string sym = in->shape.dims[0].symbol();
    // A batch dim set by --shape must be the batch.
    if (auto it = cfg.shape.find(sym); enforce && !sym.empty() && it != cfg.shape.end() && it->second != batch)
      return Status::error("--shape " + sym + "=" + std::to_string(it->second) + ": '" + sym +
                           "' is the batch dim of input '" + in->name + "', and " + flag + " is " +
                           std::to_string(batch) + ": leave it out of --shape (kiln binds it from the batch size) " +
                           "or give the same value");
    // A batch dim fixed at export (torch.onnx.export without dynamic_axes) takes only
    // batches of that size: say so now, not at the first step (or in a compiled binary).
    if (enforce && in->shape.dims[0].is_static() && in->shape.dims[0].value != batch)
      return Status::error(std::string(flag) + " " + std::to_string(batch) + ": the model's input '" + in->name +
                           "' has a fixed batch dim of " + std::to_string(in->shape.dims[0].value) + " (shape " +
                           in->shape.to_string() + "; exported without dynamic_axes): pass " + flag + " " +
                           std::to_string(in->shape.dims[0].value) + ", or export with dynamic_axes={'" + in->name +
                           "': {0: 'batch'}}");
    if (!in->shape.dims[0].is_static() && !sym.empty() && !b.count(sym)) {
      if (free_batch)
        left_symbolic.insert(sym);
      else
        b[sym] = batch;
    }
    // Token windows (--block_size): a symbolic sequence dim of an integer (batch, seq)
    // input is the window length, as the batch dim is the batch size.
    if (cfg.block_size > 0 && token_data && in->shape.rank() == 2 && ir::is_integer(in->dtype)) {
      const std::string seq = in->shape.dims[1].symbol();
      if (!in->shape.dims[1].is_static() && !seq.empty() && !b.count(seq)) b[seq] = cfg.block_size;
    }
    // Variable-length rows with --max_length: one program of that length (kiln compile,
    // kiln inspect; kiln train builds one per batch shape, runtime/shapes.h).
    if (cfg.max_length > 0 && runtime::is_sequence_data(cfg.train_data) && in->shape.rank() == 2 &&
        ir::is_integer(in->dtype) && !symbolic) {
      const std::string seq = in->shape.dims[1].symbol();
      if (!in->shape.dims[1].is_static() && !seq.empty() && !b.count(seq)) b[seq] = cfg.max_length;
    }
  }
  // .npy data: dim k >= 1 of the file fed to an input is that input's dim k (dim 0 is the
  // file's rows; the batch comes from the batch size). A file that cannot be read is left
  // to the data loader, which names it in its own line.
  std::vector<std::string> files = data;
  if (&data != &cfg.train_data) files.insert(files.end(), cfg.train_data.begin(), cfg.train_data.end());
  for (const std::string& spec : files) {
    const size_t eq = spec.find('=');
    if (eq == std::string::npos) continue;
    const Value* in = nullptr;
    for (const Value* v : module.inputs)
      if (v->name == spec.substr(0, eq)) in = v;
    if (!in) continue;
    auto dims = runtime::io::npy_shape(spec.substr(eq + 1));
    if (!dims || static_cast<int>(dims->size()) != in->shape.rank()) continue;
    for (int k = 1; k < in->shape.rank(); ++k) {
      const ir::Dim& d = in->shape.dims[k];
      if (d.is_static() || d.symbol().empty() || b.count(d.symbol())) continue;
      const int64_t v = (*dims)[static_cast<size_t>(k)];
      if (v <= 0)
        return Status::error(spec.substr(eq + 1) + ": shape " + ir::dims_to_string(*dims) + " gives input '" +
                             in->name + "' dim " + std::to_string(k) + " ('" + d.symbol() + "') the length " +
                             std::to_string(v) + "; each dim must be > 0");
      b[d.symbol()] = v;
    }
  }
  if (symbolic)
    for (const Value* in : module.inputs)
      if (in->shape.rank() == 2 && ir::is_integer(in->dtype) && !in->shape.dims[1].symbol().empty())
        left_symbolic.insert(in->shape.dims[1].symbol());
  if (enforce)
    for (const Value* in : module.inputs)
      for (int k = 0; k < in->shape.rank(); ++k) {
        const ir::Dim& d = in->shape.dims[k];
        if (d.is_static() || d.symbol().empty() || b.count(d.symbol()) || left_symbolic.count(d.symbol())) continue;
        return Status::error("input '" + in->name + "' dim " + std::to_string(k) + " ('" + d.symbol() + "', shape " +
                             in->shape.to_string() + ") is bound by nothing: give data for it (--train_data " +
                             in->name + "=FILE.npy" +
                             (runtime::is_token_file(cfg.train_data)      ? ", or --block_size"
                              : runtime::is_sequence_data(cfg.train_data) ? ", or --max_length"
                                                                          : "") +
                             ") or its value (--shape " + d.symbol() + "=N)");
      }
  return b;
}

Status run_pass_list(Graph& g, const std::vector<std::string>& pipeline, const passes::PassOptions& options) {
  return run_passes(g, pipeline, nullptr, options);
}

Expected<std::unique_ptr<Graph>> specialize_train_step(const runtime::TrainConfig& cfg, const Graph& module) {
  KILN_ASSIGN_OR_RETURN(auto dims, batch_bindings(cfg, module, cfg.train_data, cfg.per_device_train_batch_size,
                                                  "--per_device_train_batch_size", true));
  return specialize_model(module, cfg.model, dims, false, nullptr);
}

const std::vector<std::string>& compiled_pipeline() {
  static const std::vector<std::string> p = [] {
    PipelineOptions o;
    o.compiled = true;
    return training_pipeline(o).train.stage("lowering");
  }();
  return p;
}

std::map<std::string, int64_t> symbol_values(const Graph& g, int64_t batch, int64_t length) {
  std::map<std::string, int64_t> values;
  for (const Value* in : g.inputs)
    for (int k = 0; k < in->shape.rank(); ++k)
      if (in->shape.dims[k].is_symbolic())
        for (const std::string& s : in->shape.dims[k].expr.symbols()) values.emplace(s, k == 0 ? batch : length);
  return values;
}

std::map<std::string, int64_t> symbolic_bounds(const Graph& g, const runtime::TrainConfig& cfg, int64_t batch) {
  return symbol_values(g, batch, cfg.max_length);
}

Expected<runtime::Dataset> bind_train_data(const runtime::TrainConfig& cfg) {
  auto raw = runtime::load_raw_data(cfg.train_data);
  if (!raw) return raw.status().with_context("--train_data");
  KILN_ASSIGN_OR_RETURN(auto module, import_model(cfg.model, cfg.untie_initializers));
  KILN_ASSIGN_OR_RETURN(auto forward, specialize_model(*module, cfg.model, cfg.shape, false, nullptr));
  const runtime::ProgramSignature sig = model_signature(*forward, cfg);
  KILN_RETURN_IF_ERROR(check_data_values(*raw, "--train_data", sig, cfg));
  auto ds = runtime::Dataset::bind(*raw, sig.forward_specs, data_options(cfg));
  if (!ds) return ds.status().with_context("--train_data");
  return std::move(*ds);
}

std::vector<std::pair<int64_t, int64_t>> epoch_batch_shapes(const runtime::Dataset& data,
                                                            const runtime::TrainConfig& cfg) {
  const runtime::Dataset* ds = &data;  // variable-length rows: train_batch_length is 0 otherwise
  const int64_t rows = cfg.per_device_train_batch_size * cfg.gradient_accumulation_steps;
  std::vector<std::pair<int64_t, int64_t>> shapes;
  for (int64_t b = 0, n = ds->steps_per_epoch(rows); b < n; ++b) {
    const int64_t in_batch = ds->rows_in_batch(b, rows);
    const int64_t need = std::max<int64_t>(1, ds->train_batch_length(cfg.seed, 0, b, rows, 0, in_batch));
    shapes.push_back({in_batch, cfg.max_length > 0 ? std::min(need, cfg.max_length) : need});
  }
  return shapes;
}

Expected<TrainingProgram> build_training_program(const runtime::TrainConfig& cfg, passes::PassContext* dbg,
                                                 bool want_grads, bool to_f64, int64_t total_steps,
                                                 const Graph* module_in) {
  if (total_steps <= 0) total_steps = cfg.max_steps > 0 ? cfg.max_steps : 1;
  if (cfg.backend.find(',') != std::string::npos)
    return Status::error("--backend: one backend per program (a list such as '" + cfg.backend + "' is for kiln bench)");
  TrainingProgram prog;
  // The pipelines as data (tools/driver/pipeline.h): what runs below, stage by stage.
  Pipeline pipe = training_pipeline(pipeline_options(cfg, total_steps, to_f64));
  // Runs stage `stage` of `program` on `g`, with the debugging switches where it has them.
  auto run_stage = [&](Graph& g, const ProgramPipeline& program, const std::string& stage) -> Status {
    for (const PipelineStage& s : program.stages)
      if (s.name == stage) return run_passes(g, s.passes, s.debug ? dbg : nullptr, program.options);
    return Status::ok();  // a stage with no pass for these options
  };
  using Clock = std::chrono::steady_clock;
  auto since = [](Clock::time_point t0) { return std::chrono::duration<double>(Clock::now() - t0).count(); };
  auto t0 = Clock::now();
  // One import: the train and eval programs are specialised from the same module.
  std::unique_ptr<Graph> own_module;
  if (!module_in) {
    KILN_ASSIGN_OR_RETURN(own_module, import_model(cfg.model, cfg.untie_initializers));
    module_in = own_module.get();
  }
  const Graph& module = *module_in;
  KILN_ASSIGN_OR_RETURN(auto train_dims, batch_bindings(cfg, module, cfg.train_data, cfg.per_device_train_batch_size,
                                                        "--per_device_train_batch_size", true));
  // The eval batch size matters only with eval data.
  KILN_ASSIGN_OR_RETURN(auto eval_dims, batch_bindings(cfg, module, cfg.eval_data, cfg.per_device_eval_batch_size,
                                                       "--per_device_eval_batch_size", !cfg.eval_data.empty()));
  {
    KILN_ASSIGN_OR_RETURN(auto forward, specialize_model(module, cfg.model, cfg.shape, false, nullptr));
    prog.signature = model_signature(*forward, cfg);
  }
  // A symbolic program is checked at its bound as a static one is at its length: a
  // position table shorter than --max_length is refused before step 1. Autocast decides
  // its symbolic products by their FLOPs at the bound.
  if (const auto bounds = symbolic_bounds(module, cfg, cfg.per_device_train_batch_size);
      cfg.shape_mode == "symbolic" && !bounds.empty() && cfg.max_length > 0) {
    std::map<std::string, int64_t> at_bound = train_dims;
    at_bound.insert(bounds.begin(), bounds.end());
    KILN_ASSIGN_OR_RETURN(auto probe, specialize_model(module, cfg.model, at_bound, false, nullptr));
    for (ProgramPipeline* p : {&pipe.train, &pipe.grads}) p->options.symbol_bounds = bounds;
    pipe.eval.options.symbol_bounds = symbolic_bounds(module, cfg, cfg.per_device_eval_batch_size);
  }

  // Training step: forward + loss + backward + optimizer.
  KILN_ASSIGN_OR_RETURN(auto train, specialize_model(module, cfg.model, train_dims, to_f64, dbg));
  prog.train_times.import_s = since(t0);
  t0 = Clock::now();
  for (Value* in : train->inputs) prog.data_inputs.push_back(in->name);
  prog.logits_output = train->outputs.empty() ? "" : train->outputs[0]->name;
  // Loss, mixed precision, autodiff and remat (pipeline.cpp's stage "step").
  KILN_RETURN_IF_ERROR(run_stage(*train, pipe.train, "step"));
  if (cfg.loss != "model") {
    prog.label_input = pipe.train.options.loss.label_input;
    prog.data_inputs.push_back(prog.label_input);
  }
  for (auto& sb : train->state)
    if (sb.kind == "parameter") prog.parameters.push_back(sb.input->name);
  if (want_grads) {
    prog.grads = train->clone();
    // The gradient program accumulates over the same microbatches as the step.
    for (const PipelineStage& s : pipe.grads.stages) KILN_RETURN_IF_ERROR(run_stage(*prog.grads, pipe.grads, s.name));
  }
  // Optimizer, GradScaler update and the accumulation loop (stage "update").
  KILN_RETURN_IF_ERROR(run_stage(*train, pipe.train, "update"));
  // What the trainer reads from the program rather than the flags: the microbatch it
  // was bound to, the accumulation loop's trip count, the eval batch.
  prog.signature.microbatch_rows = cfg.per_device_train_batch_size;
  prog.signature.gradient_accumulation_steps = 1;
  for (const auto& n : train->nodes())
    if (has_trait(*n, ir::OpTrait::loop))
      prog.signature.gradient_accumulation_steps = n->attrs.get_int("trip_count", 1);
  prog.signature.rows_per_step = prog.signature.microbatch_rows * prog.signature.gradient_accumulation_steps;
  prog.signature.world_size = std::max<int64_t>(1, cfg.world_size);
  prog.signature.eval_rows = cfg.per_device_eval_batch_size;
  // --backend compiled: pointwise groups become FusedKernel nodes, then generated code.
  const bool compiled = cfg.backend == "compiled";
  prog.train_times.passes_s = since(t0);
  t0 = Clock::now();
  KILN_RETURN_IF_ERROR(run_stage(*train, pipe.train, "lowering"));
  prog.train_times.fusion_s = compiled ? since(t0) : 0.0;
  KILN_RETURN_IF_ERROR(verify_graph(*train).with_context("training program"));
  log_text("graph", "training step after all passes:\n" + ir::graph_to_string(*train));
  if (log_enabled("memory")) {
    auto plan = passes::plan_memory(*train, passes::PlanOptions::eager());
    log_text("memory", plan ? passes::format_memory_plan(*plan) : "no memory plan: " + plan.status().message());
  }
  if (compiled) {
    t0 = Clock::now();
    KILN_ASSIGN_OR_RETURN(prog.train_kernels, compile_program(*train, cfg, "train"));
    prog.train_times.kernels_s = since(t0);
    t0 = Clock::now();
    // The arena as the last pass (arena_plan) placed it; its peak is what the run reports.
    prog.train_arena = runtime::StepArena::of_graph(*train);
    if (!prog.train_arena) return no_arena_plan("training", dbg);
    prog.signature.planned_peak_bytes = train->planned_peak_bytes;
    prog.train_times.arena_s = since(t0);
  } else {
    // A symbolic program (--shape_mode symbolic) is planned at its upper bound.
    std::unique_ptr<Graph> bound;
    const std::map<std::string, int64_t> bounds = symbolic_bounds(*train, cfg, cfg.per_device_train_batch_size);
    if (!bounds.empty() && cfg.max_length > 0) {
      bound = train->clone();
      if (!ir::bind_symbols(*bound, bounds).is_ok()) bound.reset();
    }
    if (bounds.empty() || bound)
      if (auto plan = passes::plan_memory(bound ? *bound : *train, passes::PlanOptions::eager()))
        prog.signature.planned_peak_bytes = plan->peak_bytes;
      else
        log_text("memory", "no memory plan of the training program: " + plan.status().message());
  }
  prog.train_step = std::move(train);

  // Evaluation: forward + loss in inference mode, parameters as inputs.
  KILN_ASSIGN_OR_RETURN(auto eval, specialize_model(module, cfg.model, eval_dims, to_f64, nullptr));
  KILN_RETURN_IF_ERROR(run_stage(*eval, pipe.eval, "forward"));
  log_text("graph", "eval program after all passes:\n" + ir::graph_to_string(*eval));
  if (compiled) {
    KILN_ASSIGN_OR_RETURN(prog.eval_kernels, compile_program(*eval, cfg, "eval"));
    prog.eval_arena = runtime::StepArena::of_graph(*eval);
    if (!prog.eval_arena) return no_arena_plan("eval", dbg);
  }
  prog.eval = std::move(eval);
  return prog;
}

Expected<runtime::comm::Communicator*> join_job(runtime::TrainConfig& cfg) {
  KILN_RETURN_IF_ERROR(runtime::comm::init_world(cfg.ddp_timeout));
  runtime::comm::Communicator* world = runtime::comm::world();
  cfg.world_size = world ? world->world_size() : 1;
  return world;
}

DataParallelPlan data_parallel_plan(const ir::Graph& train_step, int64_t world_size) {
  DataParallelPlan p;
  std::function<void(const ir::Graph&)> walk = [&](const ir::Graph& g) {
    for (const auto& n : g.nodes()) {
      const ir::OpDef* def = ir::OpTable::get().find(n->op);
      if (def && def->comm_bytes) {
        p.collectives += 1;
        p.bytes_sent += def->comm_bytes(*n, world_size);
      }
      for (const auto& r : n->regions) walk(*r);
    }
  };
  walk(train_step);
  for (const ir::StateBinding& sb : train_step.state)
    if (sb.kind == "optimizer_state" && sb.initial)
      p.optimizer_state_bytes += static_cast<int64_t>(sb.initial->nbytes());
  return p;
}

}  // namespace kiln::driver
