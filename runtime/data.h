// Training and evaluation data for the trainer: named .npy arrays mapped to graph
// inputs, or one nanoGPT-style uint16 token file sampled in windows.
//
// Arrays (`--train_data input=x.npy --train_data labels=y.npy`): every array has the
// same first dim (rows). An epoch visits the rows in a permutation drawn from
// std::mt19937_64 seeded by mix(seed, epoch) (Fisher-Yates, rejection-sampled so the
// order depends on nothing but the seed); batch i of the epoch is rows
// perm[i*B, (i+1)*B); the last partial batch is dropped (HF dataloader_drop_last).
//
// Tokens (`--train_data train.bin`): a stream of uint16 tokens (nanoGPT prepare.py
// format). Each row is a window of T = block_size tokens: inputs tokens[s:s+T],
// labels tokens[s+1:s+T+1], s = rng() % (n-T) (nanoGPT get_batch, io::sample_token_batch)
// with std::mt19937_64 seeded by mix(seed, epoch, batch index). One epoch is defined as
// n_tokens / (B*T) steps (each token seen about once).
//
// Sequences (`--train_data FILE.jsonl` or a Megatron indexed dataset PREFIX.idx/.bin,
// runtime/sequences.h; issue 31): rows of variable length. A causal LM whose loss kiln
// computes (cross_entropy on the logits) reads tokens[0, n-1) of a row and predicts
// tokens[1, n) (the file's labels[1, n) when it has labels); a model computing its own
// loss (--loss model, Hugging Face's convention) gets the row unshifted. Rows longer than
// --max_length (else the model's fixed sequence length) are truncated to it, with a note.
// A batch is padded on the right to the length the trainer asks for (runtime/shapes.h):
// token ids with --pad_token_id, labels with ignore_index (so the token-normalized loss
// equals the unpadded one), an `attention_mask` input with 1 for real tokens and 0 for
// padding, `token_type_ids` with 0, `position_ids` with 0..L-1. The epoch's order is the
// permutation below, or with --group_by_length Hugging Face's length-grouped megabatches
// (runtime/buckets.h length_grouped_order).
//
// The epoch's last partial batch: dropped by default (--dataloader_drop_last true, kiln's
// default); with --dataloader_drop_last false it is trained (steps_per_epoch rounds up, and
// the trainer runs that step with a program of its row count).
//
// All layouts derive batch (epoch, i) from the seed alone, so a resumed run that
// restarts at step k sees exactly the batches of an uninterrupted run.
//
// Evaluation is sequential and never shuffled: arrays and sequences in file order (last
// partial batch dropped), tokens as windows at a regular stride over the file, at most
// `max_eval_batches` batches.
#pragma once
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "ir/graph.h"
#include "ir/status.h"
#include "ir/tensor.h"
#include "runtime/io.h"

namespace kiln::runtime {

struct SequenceSet;

/// A graph data input the loader feeds: name, dtype and shape (static or symbolic dims).
struct DataInputSpec {
  std::string name;
  ir::DType dtype = ir::DType::undefined;
  ir::Shape shape;
};

/// Loader options (from TrainConfig and the training program).
struct DataOptions {
  std::string label_input = "labels";  ///< graph input fed with labels ("" for --loss model)
  std::string loss = "cross_entropy";  ///< labels of cross_entropy must be integer class ids
  int64_t block_size = 0;              ///< token window; 0: the model input's static dim 1
  int64_t max_eval_batches = 20;       ///< bound on eval batches of a token file
  /// Sequences: the token id of padding (--pad_token_id; labels are padded with ignore_index).
  int64_t pad_token_id = 0;
  int64_t ignore_index = -100;
  /// Sequences: rows are truncated to this many tokens (--max_length; 0: the model's fixed
  /// sequence length, else no limit).
  int64_t max_length = 0;
  /// Sequences: Hugging Face's length-grouped order (--group_by_length).
  bool group_by_length = false;
  /// Batches per length-grouped megabatch (runtime/buckets.h length_grouped_order; 0:
  /// Hugging Face's default, min(rows / (4 x batch), 50)).
  int64_t mega_batch_mult = 0;
  /// Drop the epoch's last partial batch (--dataloader_drop_last).
  bool drop_last = true;
};

/// A batch: graph input name -> tensor with `rows` as first dim.
using Batch = std::map<std::string, ir::Tensor>;

/// One named array loaded from a file, before checking against the graph.
struct NamedArray {
  std::string input;  ///< graph input name
  std::string file;   ///< file it came from (for error messages)
  ir::Tensor data;
};

/// Data files read into memory but not yet bound to a graph (so the CLI can check
/// them and count rows before the training program is compiled).
struct RawData {
  std::vector<NamedArray> arrays;                       ///< NAME=FILE.npy specs
  std::shared_ptr<const std::vector<uint16_t>> tokens;  ///< or one FILE.bin
  std::string token_file;
  std::shared_ptr<const SequenceSet> sequences;  ///< or one FILE.jsonl / PREFIX.idx (variable length)
};

/// Reads `--train_data`/`--eval_data` specs (NAME=FILE.npy entries, or one FILE.bin).
/// Errors name the spec or file (bad NAME=FILE syntax, unreadable or malformed file).
Expected<RawData> load_raw_data(const std::vector<std::string>& specs);

/// Whether `specs` (--train_data / --eval_data items) name a token file: one FILE.bin
/// without NAME=, read as windows of --block_size (load_raw_data).
bool is_token_file(const std::vector<std::string>& specs);

/// Whether `specs` name one variable-length dataset without NAME= (FILE.jsonl, PREFIX.idx,
/// or PREFIX.bin beside PREFIX.idx; runtime/sequences.h).
bool is_sequence_data(const std::vector<std::string>& specs);

/// The scalar graph input of the step's label count (ir::kNumItemsInput).
inline constexpr const char* kNumItemsInput = ir::kNumItemsInput;

/// Hugging Face's num_items_in_batch for one microbatch: the labels != ignore_index
/// (every element for float labels).
int64_t count_num_items(const ir::Tensor& labels, int64_t ignore_index);

/// The kNumItemsInput feed of a step: `count` as a scalar of `dtype`. A step whose labels
/// are all ignored has count 0 and a NaN loss (0 / 0), as the same batch without
/// accumulation (mean over no labels) and PyTorch; its gradients are 0 (ignored
/// positions get none).
ir::Tensor num_items_tensor(int64_t count, ir::DType dtype);

/// Adds the kNumItemsInput feed (count_num_items of `labels`) when `g` has that input;
/// no change otherwise.
void add_num_items_feed(const ir::Graph& g, const ir::Tensor& labels, int64_t ignore_index,
                        std::map<std::string, ir::Tensor>& feeds);

/// Microbatch `t` of `trips` of a whole-step tensor: rows [t·b, (t+1)·b) of its leading
/// dim, b = dim 0 / trips, copied. Error: no leading dim, or one not divisible by trips.
Expected<ir::Tensor> microbatch_rows(const ir::Tensor& full, int64_t t, int64_t trips);

/// A RunOptions::microbatch source over whole-step tensors held by the caller (input
/// name -> N·b rows): call t copies rows [t·b, (t+1)·b). For tests and benchmarks that
/// stream a step's data as the trainer does. Error: an input it does not hold.
std::function<Expected<ir::Tensor>(const ir::Value&, int64_t, int64_t)> microbatches_of(
    std::map<std::string, ir::Tensor> whole);

/// A dataset bound to a graph's data inputs.
class Dataset {
 public:
  Dataset() = default;

  /// Opens `--train_data`/`--eval_data` specs: NAME=FILE.npy entries, or one FILE.bin.
  /// Errors (one line naming the file): unreadable file, unknown or missing input name,
  /// row counts differ, dtype or trailing dims differ from the graph input, float labels
  /// for cross_entropy, token file shorter than one window.
  static Expected<Dataset> open(const std::vector<std::string>& specs, const std::vector<DataInputSpec>& inputs,
                                const DataOptions& opts);
  /// Binds loaded files to the graph inputs (from_arrays or from_tokens).
  static Expected<Dataset> bind(const RawData& raw, const std::vector<DataInputSpec>& inputs, const DataOptions& opts);
  /// Binds already loaded arrays (i32 labels become i64, f32 data widens to an f64 input).
  static Expected<Dataset> from_arrays(std::vector<NamedArray> arrays, const std::vector<DataInputSpec>& inputs,
                                       const DataOptions& opts);
  /// Binds a token stream; `file` names it in errors.
  static Expected<Dataset> from_tokens(std::shared_ptr<const std::vector<uint16_t>> tokens, const std::string& file,
                                       const std::vector<DataInputSpec>& inputs, const DataOptions& opts);
  /// Binds variable-length sequences: the model's integer (batch, seq) input gets the
  /// tokens, the label input the labels, attention_mask / token_type_ids / position_ids
  /// are filled (see the file comment). Errors (one line naming the file): no sequences,
  /// two token inputs, an input that is not (batch, seq), --max_length against a fixed
  /// sequence length, no row long enough to predict a token.
  static Expected<Dataset> from_sequences(std::shared_ptr<const SequenceSet> seqs,
                                          const std::vector<DataInputSpec>& inputs, const DataOptions& opts);

  bool is_tokens() const { return tokens_ != nullptr; }
  /// Variable-length rows (from_sequences): batches are padded to a length.
  bool is_sequences() const { return seqs_ != nullptr; }
  /// Rows of the array dataset or the sequences, or n_tokens / block_size for a token stream.
  int64_t num_rows() const;
  /// Optimizer steps per epoch: num_rows / rows_per_step, rounded down when the last
  /// partial batch is dropped (DataOptions::drop_last), else up.
  int64_t steps_per_epoch(int64_t rows_per_step) const;
  /// Rows of batch `index` of an epoch of `rows`-row batches: `rows`, or fewer for the last
  /// partial batch when it is not dropped.
  int64_t rows_in_batch(int64_t index, int64_t rows) const;
  /// Batch `index` of epoch `epoch` (shuffled arrays / random windows), `rows` rows;
  /// sequences padded to `pad_to` tokens (0: the batch's longest row).
  Expected<Batch> train_batch(uint64_t seed, int64_t epoch, int64_t index, int64_t rows, int64_t pad_to = 0) const;
  /// Rows [begin, begin + count) of train_batch(seed, epoch, index, rows), without
  /// gathering the others: one microbatch of a gradient-accumulation step, streamed
  /// into the loop by the trainer.
  Expected<Batch> train_batch_rows(uint64_t seed, int64_t epoch, int64_t index, int64_t rows, int64_t begin,
                                   int64_t count, int64_t pad_to = 0) const;
  /// Sequences: tokens of the longest row among rows [begin, begin + count) of the batch
  /// (the length the batch needs); 0 for fixed-length data.
  int64_t train_batch_length(uint64_t seed, int64_t epoch, int64_t index, int64_t rows, int64_t begin,
                             int64_t count) const;
  /// Sequences: real (non-pad) tokens of rows [begin, begin + count) of the batch; 0 for
  /// fixed-length data.
  int64_t train_batch_tokens(uint64_t seed, int64_t epoch, int64_t index, int64_t rows, int64_t begin,
                             int64_t count) const;
  /// The first `rows` rows in file order (arrays) or windows at 0, T, 2T, ... (tokens).
  Expected<Batch> first_batch(int64_t rows) const;
  /// Number of sequential eval batches of `rows` rows.
  /// `with_partial`: also the last partial batch of the remaining rows (arrays and
  /// sequences, for a program whose batch dim is symbolic; a token file's eval windows
  /// come in whole batches).
  int64_t num_eval_batches(int64_t rows, bool with_partial = false) const;
  /// Rows of eval batch `index`: `rows`, or fewer for the last partial batch.
  int64_t eval_rows_in_batch(int64_t index, int64_t rows) const;
  /// Eval batch `index` (sequential, not shuffled; the last partial one too, see
  /// num_eval_batches); sequences padded to `pad_to` (0: its longest row).
  Expected<Batch> eval_batch(int64_t index, int64_t rows, int64_t pad_to = 0) const;
  /// Sequences: the longest row of eval batch `index` (0 for fixed-length data).
  int64_t eval_batch_length(int64_t index, int64_t rows) const;
  /// Sequences: tokens per row after truncation: --max_length, the model's fixed length,
  /// else the longest row (0 for fixed-length data).
  int64_t max_length() const { return max_length_; }
  /// Sequences: the name of the token input's sequence dim ("seq"; empty when unnamed or fixed).
  const std::string& sequence_dim_name() const { return seq_symbol_; }
  /// Sequences: the model's fixed sequence length (0: a dynamic axis).
  int64_t fixed_length() const { return static_length_; }
  /// Sequences: rows per length (after shift and truncation), for the bucket planner.
  std::map<int64_t, int64_t> length_histogram() const;
  /// Sequences: each row's tokens after shift and truncation, in file order (rows left out
  /// are not counted).
  const std::vector<int64_t>& sequence_lengths() const { return seq_lengths_; }
  /// Sequences: the graph input fed with token ids.
  std::string token_input() const {
    return seqs_ ? seq_inputs_[static_cast<size_t>(seq_token_input_)].name : token_input_;
  }
  /// Notes from binding (truncated rows, rows left out): printed once by the caller.
  const std::vector<std::string>& notes() const { return notes_; }
  /// Names of the inputs this dataset feeds.
  std::vector<std::string> input_names() const;
  /// The files it was read from, comma-separated (for messages).
  std::string files() const;

  /// The permutation of `n` rows for (seed, epoch): public for tests and documentation.
  static std::vector<int64_t> epoch_permutation(int64_t n, uint64_t seed, int64_t epoch);

 private:
  /// The epoch's row order (permutation or length-grouped), cached for the epoch.
  const std::vector<int64_t>& epoch_order(uint64_t seed, int64_t epoch, int64_t rows_per_step) const;
  /// Selected rows of batch `index` of `rows` rows: [begin, begin + count) of it.
  Expected<std::vector<int64_t>> select_train_rows(uint64_t seed, int64_t epoch, int64_t index, int64_t rows,
                                                   int64_t begin, int64_t count) const;
  int64_t sequence_batch_length(const std::vector<int64_t>& sel) const;
  Expected<Batch> sequence_batch(const std::vector<int64_t>& sel, int64_t pad_to) const;
  Batch gather_rows(const std::vector<int64_t>& rows) const;
  Expected<Batch> token_windows(const std::vector<int64_t>& starts) const;
  Batch to_batch(const io::TokenBatch& tb) const;

  std::vector<NamedArray> arrays_;
  std::shared_ptr<const std::vector<uint16_t>> tokens_;
  std::string token_file_;
  std::string token_input_, label_input_;
  ir::DType token_dtype_ = ir::DType::i64, label_dtype_ = ir::DType::i64;
  int64_t block_size_ = 0;
  int64_t max_eval_batches_ = 20;
  DataOptions opts_;
  // Sequences: the set, the rows kept (index into it) and their lengths after shift and
  // truncation, how each graph input is filled.
  struct SequenceInput {
    std::string name;
    ir::DType dtype = ir::DType::i64;
    int fill = 0;  // data_sequences.cpp Fill
  };
  std::shared_ptr<const SequenceSet> seqs_;
  std::vector<int64_t> seq_rows_, seq_lengths_;
  std::vector<SequenceInput> seq_inputs_;
  int seq_token_input_ = -1;
  bool shift_ = false;
  int64_t static_length_ = 0, max_length_ = 0;
  std::string seq_symbol_;
  std::vector<std::string> notes_;
  // Cache of the current epoch's permutation.
  mutable int64_t cached_epoch_ = -1;
  mutable uint64_t cached_seed_ = 0;
  mutable std::vector<int64_t> cached_perm_;
};

/// Checks a (rows, ...) batch tensor against the graph input: the same rank and the same
/// static dims (returned unchanged). Error naming the input and both shapes otherwise.
Expected<ir::Tensor> fit_to_input(const ir::Tensor& t, const DataInputSpec& in);

/// splitmix64 finalizer: mixes seed words into one 64-bit RNG seed.
uint64_t mix_seed(uint64_t a, uint64_t b, uint64_t c = 0);

}  // namespace kiln::runtime
