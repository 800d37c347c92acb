// Training configuration with Hugging Face TrainingArguments names and semantics.
#pragma once
#include <cstdint>
#include <map>
#include <set>
#include <string>
#include <vector>

#include "ir/status.h"

namespace kiln::runtime {

/// Everything `kiln train` / `kiln grad` / `kiln bench` accept. Field names are
/// Hugging Face TrainingArguments names; defaults follow Hugging Face.
struct TrainConfig {
  // --- model and data ---
  std::string model;                     ///< path of the .onnx file
  std::map<std::string, int64_t> shape;  ///< --shape batch=8,seq=64 (dim_param bindings)
  /// --train_data NAME=FILE.npy (repeatable) or a single nanoGPT uint16 FILE.bin.
  std::vector<std::string> train_data;
  std::vector<std::string> eval_data;
  int64_t block_size = 0;  ///< token windows for .bin data
  // Variable-length data (issue 31; runtime/shapes.h, runtime/data.h).
  int64_t pad_token_id = 0;              ///< token id of padding (labels pad with ignore_index)
  int64_t max_length = 0;                ///< rows truncated to this many tokens; pad mode pads to it (0: longest row)
  std::string shape_mode = "pad";        ///< pad | specialize | buckets | symbolic
  std::string shape_buckets = "4";       ///< buckets mode: K boundaries planned from the data, or a list 32,64,128
  std::string symbolic_versions = "on";  ///< on | off: specialized versions of symbolic kernels (issue 32)
  int64_t recompile_limit = 8;           ///< specialize mode: programs built before batches pad to a built length
  bool group_by_length = false;          ///< HF's length-grouped megabatches (implied by --shape_mode buckets)
  bool dataloader_drop_last = true;      ///< drop the epoch's last partial batch (HF's default is false)
  // --- loss and parameters ---
  std::string loss = "cross_entropy";  ///< cross_entropy | mse | bce_with_logits | l1 | model
  std::string label_input;             ///< graph input fed with labels (default: "labels")
  int64_t ignore_index = -100;
  double label_smoothing = 0.0;
  std::string freeze;     ///< regex of initializers NOT trained
  std::string trainable;  ///< regex: only these are trained
  // --- optimizer and schedule ---
  std::string optim = "adamw_torch";  ///< adamw_torch | adamw_8bit (alias adamw_bnb_8bit) | sgd
  double learning_rate = 5e-5;
  double weight_decay = 0.0;
  double adam_beta1 = 0.9, adam_beta2 = 0.999, adam_epsilon = 1e-8;
  double momentum = 0.0;                     ///< SGD
  bool nesterov = false;                     ///< SGD
  double max_grad_norm = 1.0;                ///< 0 disables clipping
  std::string lr_scheduler_type = "linear";  ///< linear | cosine | constant | constant_with_warmup
  double warmup_ratio = 0.0;
  int64_t warmup_steps = 0;
  // --- loop ---
  std::string output_dir = "kiln_output";
  int64_t per_device_train_batch_size = 8;
  int64_t per_device_eval_batch_size = 8;
  double num_train_epochs = 3.0;
  int64_t max_steps = -1;  ///< > 0 overrides num_train_epochs
  uint64_t seed = 42;
  int64_t logging_steps = 10;
  int64_t eval_steps = 0;        ///< 0: evaluate only at the end (when eval data given)
  int64_t save_steps = 0;        ///< 0: no intermediate checkpoints
  int64_t save_total_limit = 0;  ///< 0: keep all
  std::string resume_from_checkpoint;
  /// Hugging Face's flag. kiln refuses to start a run that saves checkpoints into an
  /// output_dir holding checkpoint-N past the run's first step (another run's: saving
  /// would overwrite them, and --save_total_limit, which keeps the highest steps, would
  /// delete this run's own new checkpoints); with this flag those are deleted first.
  bool overwrite_output_dir = false;
  bool bf16 = false;
  bool fp16 = false;  ///< f16 autocast + dynamic loss scaling (GradScaler)
  /// --bf16/--fp16: a GEMM, MatMul or convolution of fewer FLOPs than this (forward,
  /// per microbatch) stays f32, where bf16 would cost more in casts than it saves
  /// (passes/autocast.cpp). -1: the break-even modelled for this CPU and dtype
  /// (driver::autocast_break_even_flops); 0: every one in low precision, as torch.autocast.
  /// Otherwise in [0, 1e18]; only with --bf16 or --fp16.
  double autocast_min_flops = -1;
  /// kiln extensions (torch GradScaler's init_scale / growth_interval) for --fp16.
  double fp16_init_scale = 65536.0;
  int64_t fp16_growth_interval = 2000;
  int64_t gradient_accumulation_steps = 1;
  /// "tokens": summed loss / non-ignored labels of all microbatches (Hugging Face's
  /// num_items_in_batch); "microbatch": each microbatch's mean loss / N; "" = default
  /// (tokens for cross_entropy, else microbatch).
  std::string accumulation_normalization;
  /// Ranks of the data-parallel job this process belongs to (runtime/comm.h launch_info;
  /// not a flag: mpirun or srun sets it). Programs are built for it (passes/data_parallel.cpp).
  int64_t world_size = 1;
  /// Hugging Face's flags: seconds a collective may wait for the other ranks before the job
  /// fails (a rank died or hangs), and the gradient bucket size in MiB (DDP's bucket_cap_mb).
  double ddp_timeout = 1800;
  double ddp_bucket_cap_mb = 25;
  /// DeepSpeed's ZeRO stage: 0 (every rank holds the whole optimizer state) or 1 (each
  /// rank holds and updates 1/world_size of it; passes/optimizer.cpp zero_shards).
  int64_t zero_stage = 0;
  std::string backend = "eager";  // the library's default: the reference; the kiln CLI defaults to compiled
  /// Compile cache of generated kernels (issue 8): "" = $KILN_CACHE_DIR, else
  /// $XDG_CACHE_HOME/kiln, else ~/.cache/kiln. Has no effect on results.
  std::string cache_dir;
  bool no_cache = false;  ///< compile without the cache (no file read or written)
  /// kiln extension: drop every Dropout node from the training program (what setting
  /// the model's dropout probability to 0 does in PyTorch), for deterministic checks.
  bool disable_dropout = false;
  /// kiln: keep initializers apart that the importer re-expresses as views of one
  /// parameter (ties restored from an exporter's copies, transposes, slices, broadcasts
  /// and Identity aliases; frontend/initializers.h): each trains on its own.
  bool untie_initializers = false;
  /// Hugging Face's flag: rematerialize each repeated layer (remat policy "blocks").
  bool gradient_checkpointing = false;
  /// kiln: none | blocks | sqrt | min-cut | budget (passes/remat.cpp); "" = blocks when
  /// gradient_checkpointing, else none.
  std::string remat_policy;
  /// kiln: planned-peak budget of a training step for remat_policy budget: "24GiB", "800MB",
  /// "123456" (bytes). Parsed by parse_byte_size.
  std::string memory_budget;
  /// kiln (issue 33): choose the recipe (batch x accumulation, precision, remat policy,
  /// optimizer state) that fits --memory_budget before training (what `kiln fit` prints);
  /// the flags given on the command line or in --config stay fixed.
  bool auto_fit = false;
  /// Hugging Face's flag: the same search with --memory_budget auto unless a budget is given
  /// (HF halves the batch after each out-of-memory; kiln plans instead).
  bool auto_find_batch_size = false;
  /// kiln fit / --auto_fit: samples per optimizer step the recipe keeps
  /// (per_device_train_batch_size x gradient_accumulation_steps); 0: that product as given.
  int64_t effective_batch_size = 0;
  /// Whether the recipe search is on (--auto_fit or --auto_find_batch_size).
  bool fitting() const { return auto_fit || auto_find_batch_size; }
  // --- reporting ---
  /// Hugging Face's flag: no live progress bar on a terminal (plain log lines only).
  bool disable_tqdm = false;
  /// Hugging Face's flag: where metrics go besides stdout and metrics.jsonl: "none"
  /// (default), "tensorboard", "all" (= tensorboard, the one integration kiln has); a
  /// comma list of those.
  std::string report_to = "none";
  /// Hugging Face's flag: the TensorBoard log folder ("" = OUTPUT_DIR/runs/<Mon><DD>_<HH>-<MM>-<SS>_<host>).
  std::string logging_dir;
  /// Whether report_to asks for TensorBoard event files.
  bool reports_tensorboard() const;

  /// The remat policy in effect: remat_policy, else "blocks" with gradient_checkpointing,
  /// else "min-cut" for the compiled backend (torch.compile partitions forward and
  /// backward with AOTAutograd's min-cut recompute of cheap ops by default) and "none"
  /// for eager (PyTorch eager saves every activation).
  std::string effective_remat_policy() const {
    if (!remat_policy.empty()) return remat_policy;
    if (gradient_checkpointing) return "blocks";
    return backend == "compiled" ? "min-cut" : "none";
  }

  /// Total optimizer steps, from max_steps or epochs x steps per epoch.
  int64_t total_steps(int64_t steps_per_epoch) const;
  /// Warmup steps from warmup_steps (if > 0) else ceil(warmup_ratio * total).
  int64_t warmup(int64_t total) const;
  /// Checks option values (unknown loss/optim/scheduler names, non-positive sizes).
  /// Error: one line naming the option and the bad value.
  Status validate() const;
};

/// Parses a byte size: an integer or decimal number with an optional unit B, KB, MB, GB,
/// TB (powers of 1000) or KiB, MiB, GiB, TiB (powers of 1024), case-insensitive for the
/// prefix ("24GiB", "800MB", "1e9"). Error names --memory_budget and the text.
Expected<int64_t> parse_byte_size(const std::string& text);

/// --shape_buckets: a count K (the boundaries are planned from the data) or explicit
/// ascending lengths "32,64,128".
struct ShapeBuckets {
  int64_t count = 0;             ///< K (> 0) when planned
  std::vector<int64_t> lengths;  ///< explicit boundaries, ascending (count 0)
};
/// Parses --shape_buckets. Error: one line naming the flag and the text (not a positive
/// integer, or lengths not ascending and positive).
Expected<ShapeBuckets> parse_shape_buckets(const std::string& text);

/// One TrainConfig field, for table-driven flags and JSON (every field has one entry;
/// `name` is the flag without "--" and the JSON key).
struct ConfigField {
  enum class Kind { str, i64, u64, f64, boolean, str_list, shape_map };
  std::string name;
  Kind kind;
  void* ptr;  ///< points into the TrainConfig passed to config_fields()
  std::string help;
};
/// All fields of `cfg`, in declaration order, pointing into `cfg`.
std::vector<ConfigField> config_fields(TrainConfig& cfg);
/// The items of a comma list ("eager,compiled" -> {"eager", "compiled"}), in order,
/// empty items kept ("a," -> {"a", ""}) so that callers can reject them; "" -> {""}.
/// `kiln bench` takes lists for --backend and --remat_policy.
std::vector<std::string> comma_list(const std::string& text);

/// Sets a field from its command-line text ("1e-4", "true", "batch=8,seq=64", a list item
/// appended for str_list). Error: "--NAME: expected a number, got 'abc'".
Status set_config_field(const ConfigField& f, const std::string& text);

/// Applies command-line values of the flags that were given (name -> the values in
/// order): a list flag is replaced by its values, a boolean flag given without a value
/// is true, anything else takes its last value. Error: an unknown name, or the first
/// value set_config_field refuses.
Status apply_flag_values(TrainConfig& cfg, const std::map<std::string, std::vector<std::string>>& given);
/// `--eval_data ""` on the command line turns evaluation off: when the flags emptied the
/// eval data and did not set --eval_steps, an eval_steps from the config file (or the
/// compiled binary) becomes 0. An explicit --eval_steps N without eval data stays, for the
/// caller to refuse.
void eval_off_without_eval_data(TrainConfig& cfg, const std::map<std::string, std::vector<std::string>>& given);
/// An eval schedule needs eval data: --eval_steps N > 0 with no --eval_data is an error
/// (Hugging Face's Trainer refuses an eval strategy without an eval dataset) rather than
/// a run that never evaluates. For the commands that train (not bench, which does not
/// evaluate). Error: "--eval_steps N: no --eval_data to evaluate on (...)".
Status check_eval_schedule(const TrainConfig& cfg);
/// What to tell a user about a flag name kiln does not know: what kiln does instead when
/// it is a Hugging Face TrainingArguments flag kiln lacks (--eval_strategy,
/// --save_strategy, --load_best_model_at_end, --report_to, ...), else "did you mean
/// --X?" for another spelling (--lr, --bs, --label_smoothing_factor, dashes for
/// underscores) or the near misses in `suggest` (one edit for names up to 6 characters,
/// two for longer ones; all that are equally near, up to three); "" when none. as_key:
/// spelled as a config-file key ('learning_rate') rather than a flag.
std::string unknown_flag_hint(const std::string& name, const std::set<std::string>& suggest, bool as_key = false);
/// For a command line the flag parser refused with "arguments were not expected": one
/// line naming the first "--name", "--name=value" or argparse-style "-name" in `args`
/// whose name is not in `known` (long and short names without dashes), with
/// unknown_flag_hint over `suggest` (default: `known`); the token after a known flag in
/// `value_flags` is its value and skipped. Empty when every flag is known.
std::string unknown_flag_message(const std::vector<std::string>& args, const std::set<std::string>& known,
                                 const std::set<std::string>* suggest = nullptr,
                                 const std::set<std::string>* value_flags = nullptr);
/// Reads a command line as Hugging Face's argparse does before the flag parser sees it:
/// a switch (in `switches`) followed by a string_to_bool word (yes/true/t/y/1,
/// no/false/f/n/0, any case) takes that value ("--bf16 True" becomes "--bf16=True").
/// Error: a value-taking flag (in `value_flags`, long or short names) given last or
/// followed by another flag ("--name", or a single-dash option in `short_names` such as
/// -h), which the parser would take for its value ("--output_dir --bf16" trained in fp32
/// into a folder named "--bf16"). "-foo" or "-1e-3" after a flag stay its value.
Status normalize_flag_values(std::vector<std::string>& args, const std::set<std::string>& value_flags,
                             const std::set<std::string>& switches, const std::set<std::string>& short_names = {"h"});
/// Reads a JSON config file with the same keys as the flags. Unknown keys are an error.
Status load_config_json(const std::string& path, TrainConfig& cfg);
/// Writes the config as JSON (used in trainer_state.json).
std::string config_to_json(const TrainConfig& cfg);
/// Parses JSON text (an object with flag names as keys) into `cfg`; `origin` names the source in errors.
Status config_from_json_text(const std::string& text, const std::string& origin, TrainConfig& cfg);

/// The names in `candidates` near `name` for a "did you mean" hint: within one edit for
/// names up to 6 characters, two for longer ones, the nearest only (all that are equally
/// near, at most three; more than three: none); candidates of two or fewer characters are
/// never offered.
std::vector<std::string> near_names(const std::string& name, const std::set<std::string>& candidates);

}  // namespace kiln::runtime
