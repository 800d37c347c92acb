// Variable-length data for the trainer (issue 31): a runtime::SequenceSet (Megatron
// indexed dataset or JSON Lines, runtime/sequences.h) bound to a model's inputs, batched
// and padded (see data.h for the rules).
#include <algorithm>
#include <cstring>

#include "runtime/buckets.h"
#include "runtime/data.h"
#include "runtime/sequences.h"

namespace kiln::runtime {

using ir::DType;
using ir::Tensor;

namespace {

/// What a sequence dataset feeds a graph input with.
enum class Fill { tokens, labels, attention_mask, zeros, positions };

bool is_named(const std::string& name, const char* what) { return name == what; }

}  // namespace

Expected<Dataset> Dataset::from_sequences(std::shared_ptr<const SequenceSet> seqs,
                                          const std::vector<DataInputSpec>& inputs, const DataOptions& opts) {
  if (!seqs || seqs->size() == 0) return Status::error((seqs ? seqs->file : std::string("data")) + ": no sequences");
  Dataset ds;
  ds.seqs_ = seqs;
  ds.label_input_ = opts.label_input;
  ds.max_eval_batches_ = opts.max_eval_batches;
  ds.opts_ = opts;
  const std::string& file = seqs->file;
  // Roles of the graph's data inputs (Hugging Face's names for the masks and ids).
  for (const DataInputSpec& in : inputs) {
    SequenceInput si;
    si.name = in.name;
    si.dtype = in.dtype;
    // The label input: the one kiln's loss reads, or with --loss model the model's own
    // `labels` input (Hugging Face's name; the model shifts them inside).
    const bool model_labels = opts.loss == "model" && opts.label_input.empty() && in.name == "labels";
    if ((!opts.label_input.empty() && in.name == opts.label_input) || model_labels) {
      si.fill = static_cast<int>(Fill::labels);
      if (opts.loss == "cross_entropy" && !ir::is_integer(in.dtype))
        return Status::error(file + ": label input '" + in.name + "' expects " + ir::dtype_name(in.dtype) +
                             ", token labels are integer ids");
      if (!ir::is_integer(in.dtype)) si.dtype = DType::i64;
    } else if (is_named(in.name, "attention_mask")) {
      si.fill = static_cast<int>(Fill::attention_mask);
    } else if (is_named(in.name, "token_type_ids")) {
      si.fill = static_cast<int>(Fill::zeros);
    } else if (is_named(in.name, "position_ids")) {
      si.fill = static_cast<int>(Fill::positions);
    } else {
      if (ds.seq_token_input_ >= 0)
        return Status::error(file + ": token sequences feed one model input, the graph has two token inputs ('" +
                             ds.seq_inputs_[ds.seq_token_input_].name + "', '" + in.name +
                             "'); attention_mask, token_type_ids and position_ids are filled; use NAME=FILE.npy "
                             "arrays for other inputs");
      if (!ir::is_integer(in.dtype))
        return Status::error(file + ": token sequences feed input '" + in.name + "' which expects " +
                             ir::dtype_name(in.dtype) + ", not integer token ids");
      si.fill = static_cast<int>(Fill::tokens);
      ds.seq_token_input_ = static_cast<int>(ds.seq_inputs_.size());
      if (in.shape.rank() == 2 && !in.shape.dims[1].is_static()) ds.seq_symbol_ = in.shape.dims[1].symbol();
    }
    if (in.shape.rank() != 2)
      return Status::error(file + ": input '" + in.name + "' has shape " + in.shape.to_string() +
                           ", token sequences feed (batch, sequence) inputs");
    if (in.shape.dims[1].is_static()) {
      const int64_t T = in.shape.dims[1].value;
      if (ds.static_length_ > 0 && ds.static_length_ != T)
        return Status::error(file + ": the model's inputs have different fixed sequence lengths (" +
                             std::to_string(ds.static_length_) + " and " + std::to_string(T) + ")");
      ds.static_length_ = T;
    }
    ds.seq_inputs_.push_back(si);
  }
  if (ds.seq_token_input_ < 0) return Status::error(file + ": the model has no integer input for the token ids");
  // Rows: a causal LM whose loss kiln computes (cross_entropy on the logits) reads
  // tokens[0, n-1) and predicts tokens[1, n) (labels[1, n) when the file has labels), as
  // nanoGPT's windows; a model that computes its own loss (--loss model, Hugging Face's
  // convention) shifts inside: input_ids and labels are the row as it is.
  ds.shift_ = opts.loss != "model" && !opts.label_input.empty();
  // Tokens per model input row: --max_length, else the model's fixed length.
  const int64_t cap = opts.max_length > 0 ? opts.max_length : ds.static_length_;
  if (opts.max_length > 0 && ds.static_length_ > 0 && opts.max_length != ds.static_length_)
    return Status::error("--max_length " + std::to_string(opts.max_length) + ": the model's input '" +
                         ds.seq_inputs_[ds.seq_token_input_].name + "' has a fixed sequence length of " +
                         std::to_string(ds.static_length_) + " (give --max_length " +
                         std::to_string(ds.static_length_) + " or export with a dynamic sequence axis)");
  int64_t truncated = 0, dropped = 0;
  for (int64_t i = 0; i < seqs->size(); ++i) {
    int64_t n = seqs->length(i) - (ds.shift_ ? 1 : 0);
    if (n <= 0) {
      ++dropped;
      continue;
    }
    if (cap > 0 && n > cap) {
      n = cap;
      ++truncated;
    }
    ds.seq_rows_.push_back(i);
    ds.seq_lengths_.push_back(n);
  }
  if (ds.seq_rows_.empty())
    return Status::error(file + ": no sequence has " + (ds.shift_ ? "2 or more tokens" : "a token") +
                         " (a causal LM predicts each token from those before it)");
  const int64_t longest = *std::max_element(ds.seq_lengths_.begin(), ds.seq_lengths_.end());
  // pad pads to --max_length (or the fixed length); otherwise to the longest row kept.
  ds.max_length_ = cap > 0 ? cap : longest;
  if (truncated > 0)
    ds.notes_.push_back(file + ": " + std::to_string(truncated) + " of " + std::to_string(seqs->size()) +
                        " rows give the model more than " + std::to_string(cap) + " tokens" +
                        (opts.max_length > 0 ? " (--max_length)" : " (the model's sequence length)") +
                        " and are truncated to it");
  if (dropped > 0)
    ds.notes_.push_back(file + ": " + std::to_string(dropped) + (dropped == 1 ? " row" : " rows") + " of " +
                        (ds.shift_ ? "fewer than 2 tokens" : "no tokens") + (dropped == 1 ? " has" : " have") +
                        " nothing to predict and " + (dropped == 1 ? "is" : "are") + " left out");
  // Token ids are checked against the vocabulary by the driver (check_data_values).
  return ds;
}

std::map<int64_t, int64_t> Dataset::length_histogram() const {
  std::map<int64_t, int64_t> h;
  for (int64_t n : seq_lengths_) ++h[n];
  return h;
}

const std::vector<int64_t>& Dataset::epoch_order(uint64_t seed, int64_t epoch, int64_t rows_per_step) const {
  if (cached_epoch_ != epoch || cached_seed_ != seed || cached_perm_.size() != static_cast<size_t>(num_rows())) {
    cached_perm_ = seqs_ && opts_.group_by_length
                       ? length_grouped_order(seq_lengths_, rows_per_step, seed, epoch, opts_.mega_batch_mult)
                       : epoch_permutation(num_rows(), seed, epoch);
    cached_epoch_ = epoch;
    cached_seed_ = seed;
  }
  return cached_perm_;
}

int64_t Dataset::sequence_batch_length(const std::vector<int64_t>& sel) const {
  int64_t m = 0;
  for (int64_t r : sel) m = std::max(m, seq_lengths_[static_cast<size_t>(r)]);
  return m;
}

Expected<Batch> Dataset::sequence_batch(const std::vector<int64_t>& sel, int64_t pad_to) const {
  const int64_t need = sequence_batch_length(sel);
  const int64_t L = pad_to > 0 ? pad_to : need;
  if (L < need)
    return Status::error(seqs_->file + ": a batch whose longest row has " + std::to_string(need) +
                         " tokens cannot be padded to " + std::to_string(L));
  const int64_t B = static_cast<int64_t>(sel.size());
  Batch b;
  for (const SequenceInput& si : seq_inputs_) {
    Tensor t(si.dtype, {B, L});
    const Fill fill = static_cast<Fill>(si.fill);
    for (int64_t r = 0; r < B; ++r) {
      const int64_t row = seq_rows_[static_cast<size_t>(sel[static_cast<size_t>(r)])];
      const int64_t n = seq_lengths_[static_cast<size_t>(sel[static_cast<size_t>(r)])];
      const int64_t begin = seqs_->offsets[static_cast<size_t>(row)];
      for (int64_t j = 0; j < L; ++j) {
        const bool real = j < n;
        int64_t v = 0;
        switch (fill) {
          case Fill::tokens:
            v = real ? seqs_->tokens[static_cast<size_t>(begin + j)] : opts_.pad_token_id;
            break;
          case Fill::labels: {
            const int64_t k = begin + j + (shift_ ? 1 : 0);
            v = !real                    ? opts_.ignore_index
                : !seqs_->labels.empty() ? seqs_->labels[static_cast<size_t>(k)]
                                         : seqs_->tokens[static_cast<size_t>(k)];
            break;
          }
          case Fill::attention_mask:
            v = real ? 1 : 0;
            break;
          case Fill::zeros:
            v = 0;
            break;
          case Fill::positions:
            v = j;
            break;
        }
        t.set_f64(r * L + j, static_cast<double>(v));
      }
    }
    b[si.name] = std::move(t);
  }
  return b;
}

}  // namespace kiln::runtime
