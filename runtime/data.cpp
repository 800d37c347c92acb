// Data loading for the trainer: .npy arrays bound to graph inputs and nanoGPT
// uint16 token streams (see data.h for the sampling rules).
#include "runtime/data.h"

#include <algorithm>
#include <cstring>
#include <fstream>
#include <random>

#include "runtime/io.h"
#include "runtime/sequences.h"

namespace kiln::runtime {

using ir::DType;
using ir::Tensor;

uint64_t mix_seed(uint64_t a, uint64_t b, uint64_t c) {
  auto sm = [](uint64_t x) {
    x += 0x9E3779B97F4A7C15ull;
    x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9ull;
    x = (x ^ (x >> 27)) * 0x94D049BB133111EBull;
    return x ^ (x >> 31);
  };
  return sm(sm(sm(a) ^ b) ^ c);
}

namespace {

/// Uniform integer in [0, n) by rejection (independent of the standard library's
/// distribution implementation, so orders are the same everywhere).
uint64_t uniform_below(std::mt19937_64& rng, uint64_t n) {
  uint64_t limit = UINT64_MAX - UINT64_MAX % n;
  uint64_t x;
  do x = rng();
  while (x >= limit);
  return x % n;
}

std::string shape_str(const ir::Shape& s) { return s.to_string(); }

/// Converts a loaded array to the dtype the graph input wants, or explains why not.
Expected<Tensor> convert_for_input(const NamedArray& a, const DataInputSpec& in, const DataOptions& o) {
  const std::string where = a.file + " (input '" + in.name + "')";
  bool is_label = !o.label_input.empty() && in.name == o.label_input;
  DType got = a.data.dtype();
  if (is_label && o.loss == "cross_entropy") {
    if (!ir::is_integer(got))
      return Status::error(where +
                           ": cross_entropy labels must be integer class ids (int64, int32, int8 or uint8), got " +
                           ir::dtype_name(got));
    DType want = ir::is_integer(in.dtype) ? in.dtype : DType::i64;
    return got == want ? a.data : a.data.cast(want);
  }
  if (got == in.dtype) return a.data;
  // Lossless widenings only.
  if ((got == DType::f32 && in.dtype == DType::f64) || (got == DType::i32 && in.dtype == DType::i64))
    return a.data.cast(in.dtype);
  return Status::error(where + ": expected dtype " + ir::dtype_name(in.dtype) + ", got " + ir::dtype_name(got));
}

/// Checks the rank and the dims after the first against the graph input (gradient
/// accumulation multiplies the first dim, so ranks are equal; a 1-D file for a 2-D
/// input was taken for an extra accumulation dim and failed at step 1).
Status check_trailing_dims(const NamedArray& a, const DataInputSpec& in) {
  const auto& fd = a.data.dims();
  const auto& gd = in.shape.dims;
  auto fail = [&]() {
    if (gd.empty())  // e.g. mse labels shaped like a scalar model output
      return Status::error(a.file + " (input '" + in.name + "'): the graph input is a scalar (shape []), so it " +
                           "cannot take rows of data; got " + ir::dims_to_string(fd));
    // The first dim is the file's rows (any number; the graph's batch size is not meant).
    std::string want = "[rows";
    for (size_t i = 1; i < in.shape.dims.size(); ++i) {
      const ir::Dim& d = in.shape.dims[i];
      want += ", " + d.to_string();
    }
    return Status::error(a.file + " (input '" + in.name + "'): expected shape " + want + "], got " +
                         ir::dims_to_string(fd));
  };
  if (fd.empty() || gd.size() != fd.size()) return fail();
  for (size_t i = 1; i < fd.size(); ++i) {
    const ir::Dim& d = gd[i];
    if (d.is_static() && d.value != fd[i]) return fail();
  }
  return Status::ok();
}

const DataInputSpec* find_input(const std::vector<DataInputSpec>& inputs, const std::string& name) {
  for (auto& i : inputs)
    if (i.name == name) return &i;
  return nullptr;
}

std::string names_of(const std::vector<DataInputSpec>& inputs) {
  std::string s;
  for (auto& i : inputs) s += (s.empty() ? "" : ", ") + i.name;
  return s;
}

bool ends_with(const std::string& s, const std::string& suf) {
  return s.size() >= suf.size() && s.compare(s.size() - suf.size(), suf.size(), suf) == 0;
}

}  // namespace

std::vector<int64_t> Dataset::epoch_permutation(int64_t n, uint64_t seed, int64_t epoch) {
  std::vector<int64_t> p(n);
  for (int64_t i = 0; i < n; ++i) p[i] = i;
  std::mt19937_64 rng(mix_seed(seed, static_cast<uint64_t>(epoch), 0x5EED));
  for (int64_t i = n - 1; i > 0; --i) std::swap(p[i], p[uniform_below(rng, static_cast<uint64_t>(i) + 1)]);
  return p;
}

Expected<Dataset> Dataset::from_arrays(std::vector<NamedArray> arrays, const std::vector<DataInputSpec>& inputs,
                                       const DataOptions& opts) {
  if (arrays.empty()) return Status::error("no data arrays given");
  Dataset ds;
  ds.label_input_ = opts.label_input;
  ds.max_eval_batches_ = opts.max_eval_batches;
  ds.opts_ = opts;
  for (auto& a : arrays) {
    const DataInputSpec* in = find_input(inputs, a.input);
    if (!in)
      return Status::error(a.file + ": the graph has no data input '" + a.input +
                           "' (data inputs: " + names_of(inputs) + ")");
    for (auto& b : ds.arrays_)
      if (b.input == a.input) return Status::error(a.file + ": input '" + a.input + "' given twice");
    KILN_RETURN_IF_ERROR(check_trailing_dims(a, *in));
    KILN_ASSIGN_OR_RETURN(Tensor t, convert_for_input(a, *in, opts));
    if (!ds.arrays_.empty() && t.dim(0) != ds.arrays_[0].data.dim(0))
      return Status::error(a.file + ": has " + std::to_string(t.dim(0)) + " rows but " + ds.arrays_[0].file + " has " +
                           std::to_string(ds.arrays_[0].data.dim(0)) + " (all arrays need the same first dim)");
    ds.arrays_.push_back({a.input, a.file, t});
  }
  for (auto& in : inputs)
    if (std::none_of(ds.arrays_.begin(), ds.arrays_.end(), [&](const NamedArray& x) { return x.input == in.name; }))
      return Status::error("no data for graph input '" + in.name +
                           "' (give NAME=FILE.npy for each of: " + names_of(inputs) + ")");
  return ds;
}

Expected<Dataset> Dataset::from_tokens(std::shared_ptr<const std::vector<uint16_t>> tokens, const std::string& file,
                                       const std::vector<DataInputSpec>& inputs, const DataOptions& opts) {
  Dataset ds;
  ds.tokens_ = std::move(tokens);
  ds.token_file_ = file;
  ds.label_input_ = opts.label_input;
  ds.max_eval_batches_ = opts.max_eval_batches;
  ds.opts_ = opts;
  std::vector<const DataInputSpec*> model_inputs;
  const DataInputSpec* label = nullptr;
  for (auto& in : inputs) {
    if (!opts.label_input.empty() && in.name == opts.label_input)
      label = &in;
    else
      model_inputs.push_back(&in);
  }
  if (model_inputs.size() != 1)
    return Status::error(file + ": a token file feeds a model with exactly one input, the graph has " +
                         std::to_string(model_inputs.size()) + " (" + names_of(inputs) + "); use NAME=FILE.npy arrays");
  const DataInputSpec& in = *model_inputs[0];
  if (!ir::is_integer(in.dtype))
    return Status::error(file + ": token windows feed input '" + in.name + "' which expects " +
                         ir::dtype_name(in.dtype) + ", not integer token ids");
  ds.token_input_ = in.name;
  ds.token_dtype_ = in.dtype;
  int64_t model_T = in.shape.rank() >= 2 && in.shape.dims.back().is_static() ? in.shape.dims.back().value : -1;
  if (in.shape.rank() < 2)
    return Status::error(file + ": input '" + in.name + "' has shape " + in.shape.to_string() +
                         ", token windows need (batch, block_size)");
  ds.block_size_ = opts.block_size > 0 ? opts.block_size : model_T;
  if (ds.block_size_ <= 0)
    return Status::error(file + ": --block_size is needed (input '" + in.name + "' has no static sequence length)");
  if (model_T > 0 && model_T != ds.block_size_)
    return Status::error(file + ": --block_size " + std::to_string(ds.block_size_) + " but input '" + in.name +
                         "' expects sequence length " + std::to_string(model_T));
  if (label) {
    ds.label_input_ = label->name;
    ds.label_dtype_ = ir::is_integer(label->dtype) ? label->dtype : DType::i64;
    if (opts.loss == "cross_entropy" && !ir::is_integer(label->dtype))
      return Status::error(file + ": label input '" + label->name + "' expects " + ir::dtype_name(label->dtype) +
                           ", token labels are integer ids");
  } else {
    ds.label_input_.clear();
  }
  if (static_cast<int64_t>(ds.tokens_->size()) < ds.block_size_ + 1)
    return Status::error(file + ": has " + std::to_string(ds.tokens_->size()) +
                         " tokens, fewer than block_size + 1 = " + std::to_string(ds.block_size_ + 1));
  return ds;
}

bool is_token_file(const std::vector<std::string>& specs) {
  return specs.size() == 1 && specs[0].find('=') == std::string::npos && ends_with(specs[0], ".bin") &&
         !is_sequence_dataset(specs[0]);
}

bool is_sequence_data(const std::vector<std::string>& specs) {
  return specs.size() == 1 && specs[0].find('=') == std::string::npos && is_sequence_dataset(specs[0]);
}

Expected<RawData> load_raw_data(const std::vector<std::string>& specs) {
  if (specs.empty()) return Status::error("no data given");
  RawData raw;
  if (is_sequence_data(specs)) {
    KILN_ASSIGN_OR_RETURN(SequenceSet seqs, read_sequence_dataset(specs[0]));
    raw.sequences = std::make_shared<const SequenceSet>(std::move(seqs));
    return raw;
  }
  if (is_token_file(specs)) {
    KILN_ASSIGN_OR_RETURN(auto toks, io::load_tokens(specs[0]));
    raw.tokens = std::make_shared<const std::vector<uint16_t>>(std::move(toks));
    raw.token_file = specs[0];
    return raw;
  }
  for (auto& s : specs) {
    auto eq = s.find('=');
    if (eq == std::string::npos || eq == 0 || eq + 1 == s.size())
      return Status::error(
          "data '" + s +
          "': expected NAME=FILE.npy arrays, or one FILE.bin (nanoGPT tokens), FILE.jsonl or PREFIX.idx "
          "(variable-length rows)");
    std::string name = s.substr(0, eq), file = s.substr(eq + 1);
    if (ends_with(file, ".bin"))
      return Status::error(file + ": a .bin token file is given alone, without NAME= (e.g. --train_data " + file + ")");
    KILN_ASSIGN_OR_RETURN(Tensor t, io::load_npy(file));
    if (t.rank() < 1) return Status::error(file + ": a 0-d array has no rows (first dim)");
    raw.arrays.push_back({name, file, t});
  }
  return raw;
}

Expected<Dataset> Dataset::bind(const RawData& raw, const std::vector<DataInputSpec>& inputs, const DataOptions& opts) {
  if (raw.sequences) return from_sequences(raw.sequences, inputs, opts);
  if (raw.tokens) return from_tokens(raw.tokens, raw.token_file, inputs, opts);
  return from_arrays(raw.arrays, inputs, opts);
}

Expected<Dataset> Dataset::open(const std::vector<std::string>& specs, const std::vector<DataInputSpec>& inputs,
                                const DataOptions& opts) {
  KILN_ASSIGN_OR_RETURN(RawData raw, load_raw_data(specs));
  return bind(raw, inputs, opts);
}

int64_t Dataset::num_rows() const {
  if (tokens_) return static_cast<int64_t>(tokens_->size()) / block_size_;
  if (seqs_) return static_cast<int64_t>(seq_rows_.size());
  return arrays_.empty() ? 0 : arrays_[0].data.dim(0);
}

int64_t Dataset::steps_per_epoch(int64_t rows_per_step) const {
  if (rows_per_step <= 0) return 0;
  return opts_.drop_last ? num_rows() / rows_per_step : (num_rows() + rows_per_step - 1) / rows_per_step;
}

int64_t Dataset::rows_in_batch(int64_t index, int64_t rows) const {
  return std::max<int64_t>(0, std::min(rows, num_rows() - index * rows));
}

std::string Dataset::files() const {
  if (tokens_) return token_file_;
  if (seqs_) return seqs_->file;
  std::string r;
  for (auto& a : arrays_) r += (r.empty() ? "" : ", ") + a.file;
  return r;
}

std::vector<std::string> Dataset::input_names() const {
  std::vector<std::string> r;
  if (tokens_) {
    r.push_back(token_input_);
    if (!label_input_.empty()) r.push_back(label_input_);
  } else if (seqs_) {
    for (auto& si : seq_inputs_) r.push_back(si.name);
  } else {
    for (auto& a : arrays_) r.push_back(a.input);
  }
  return r;
}

Batch Dataset::gather_rows(const std::vector<int64_t>& rows) const {
  Batch b;
  for (auto& a : arrays_) {
    std::vector<int64_t> dims = a.data.dims();
    dims[0] = static_cast<int64_t>(rows.size());
    Tensor t(a.data.dtype(), dims);
    size_t row_bytes = a.data.dim(0) == 0 ? 0 : a.data.nbytes() / static_cast<size_t>(a.data.dim(0));
    auto* dst = static_cast<char*>(t.raw());
    auto* src = static_cast<const char*>(a.data.raw());
    for (size_t i = 0; i < rows.size(); ++i) std::memcpy(dst + i * row_bytes, src + rows[i] * row_bytes, row_bytes);
    b[a.input] = t;
  }
  return b;
}

Expected<Batch> Dataset::token_windows(const std::vector<int64_t>& starts) const {
  io::TokenFile f{token_file_, tokens_};
  KILN_ASSIGN_OR_RETURN(io::TokenBatch tb, io::token_windows(f, starts, block_size_));
  return to_batch(tb);
}

Batch Dataset::to_batch(const io::TokenBatch& tb) const {
  Batch r;  // (B, T) each
  r[token_input_] = tb.inputs.dtype() == token_dtype_ ? tb.inputs : tb.inputs.cast(token_dtype_);
  if (!label_input_.empty())
    r[label_input_] = tb.targets.dtype() == label_dtype_ ? tb.targets : tb.targets.cast(label_dtype_);
  return r;
}

Expected<Batch> Dataset::train_batch(uint64_t seed, int64_t epoch, int64_t index, int64_t rows, int64_t pad_to) const {
  return train_batch_rows(seed, epoch, index, rows, 0, rows_in_batch(index, rows), pad_to);
}

Expected<std::vector<int64_t>> Dataset::select_train_rows(uint64_t seed, int64_t epoch, int64_t index, int64_t rows,
                                                          int64_t begin, int64_t count) const {
  if (rows <= 0) return Status::error("batch size must be > 0");
  if (index < 0 || index >= steps_per_epoch(rows))
    return Status::error("batch index " + std::to_string(index) + " out of range (" +
                         std::to_string(steps_per_epoch(rows)) + " batches of " + std::to_string(rows) +
                         " rows per epoch)");
  if (begin < 0 || count <= 0 || begin + count > rows_in_batch(index, rows))
    return Status::error("rows [" + std::to_string(begin) + ", " + std::to_string(begin + count) +
                         ") are not within a batch of " + std::to_string(rows_in_batch(index, rows)));
  const std::vector<int64_t>& order = epoch_order(seed, epoch, rows);
  const int64_t first = index * rows + begin;
  return std::vector<int64_t>(order.begin() + first, order.begin() + first + count);
}

int64_t Dataset::train_batch_length(uint64_t seed, int64_t epoch, int64_t index, int64_t rows, int64_t begin,
                                    int64_t count) const {
  if (!seqs_) return 0;
  auto sel = select_train_rows(seed, epoch, index, rows, begin, count);
  return sel ? sequence_batch_length(*sel) : 0;
}

int64_t Dataset::train_batch_tokens(uint64_t seed, int64_t epoch, int64_t index, int64_t rows, int64_t begin,
                                    int64_t count) const {
  if (!seqs_) return 0;
  auto sel = select_train_rows(seed, epoch, index, rows, begin, count);
  int64_t n = 0;
  if (sel)
    for (int64_t r : *sel) n += seq_lengths_[static_cast<size_t>(r)];
  return n;
}

Expected<Batch> Dataset::train_batch_rows(uint64_t seed, int64_t epoch, int64_t index, int64_t rows, int64_t begin,
                                          int64_t count, int64_t pad_to) const {
  if (tokens_) {
    if (rows <= 0) return Status::error("batch size must be > 0");
    if (index < 0 || index >= steps_per_epoch(rows))
      return Status::error("batch index " + std::to_string(index) + " out of range (" +
                           std::to_string(steps_per_epoch(rows)) + " batches of " + std::to_string(rows) +
                           " rows per epoch)");
    if (begin < 0 || count <= 0 || begin + count > rows)
      return Status::error("rows [" + std::to_string(begin) + ", " + std::to_string(begin + count) +
                           ") are not within a batch of " + std::to_string(rows));
    // nanoGPT get_batch: s = rng() % (n - T) per row, rng seeded by (seed, epoch, index);
    // every row's start is drawn so that a part equals the same rows of the whole.
    std::mt19937_64 rng(mix_seed(seed, static_cast<uint64_t>(epoch), static_cast<uint64_t>(index) + 1));
    io::TokenFile f{token_file_, tokens_};
    KILN_ASSIGN_OR_RETURN(auto starts, io::sample_token_starts(f, rows, block_size_, rng));
    return token_windows(std::vector<int64_t>(starts.begin() + begin, starts.begin() + begin + count));
  }
  KILN_ASSIGN_OR_RETURN(std::vector<int64_t> sel, select_train_rows(seed, epoch, index, rows, begin, count));
  if (seqs_) return sequence_batch(sel, pad_to);
  return gather_rows(sel);
}

Expected<Batch> Dataset::first_batch(int64_t rows) const {
  if (rows <= 0) return Status::error("batch size must be > 0");
  if (num_rows() < rows)
    return Status::error("data has " + std::to_string(num_rows()) + " rows, fewer than the batch size " +
                         std::to_string(rows));
  std::vector<int64_t> sel(rows);
  for (int64_t i = 0; i < rows; ++i) sel[i] = tokens_ ? i * block_size_ : i;
  if (tokens_) return token_windows(sel);
  if (seqs_) return sequence_batch(sel, 0);
  return gather_rows(sel);
}

int64_t Dataset::num_eval_batches(int64_t rows, bool with_partial) const {
  if (rows <= 0) return 0;
  if (tokens_) {
    // Non-overlapping windows available: (n-1) / T.
    int64_t windows = (static_cast<int64_t>(tokens_->size()) - 1) / block_size_;
    return std::min(max_eval_batches_, windows / rows);
  }
  return with_partial ? (num_rows() + rows - 1) / rows : num_rows() / rows;
}

int64_t Dataset::eval_rows_in_batch(int64_t index, int64_t rows) const {
  if (tokens_) return rows;
  return std::max<int64_t>(0, std::min(rows, num_rows() - index * rows));
}

int64_t Dataset::eval_batch_length(int64_t index, int64_t rows) const {
  if (!seqs_ || index < 0 || index >= num_eval_batches(rows, true)) return 0;
  std::vector<int64_t> sel(static_cast<size_t>(eval_rows_in_batch(index, rows)));
  for (size_t i = 0; i < sel.size(); ++i) sel[i] = index * rows + static_cast<int64_t>(i);
  return sequence_batch_length(sel);
}

Expected<Batch> Dataset::eval_batch(int64_t index, int64_t rows, int64_t pad_to) const {
  int64_t nb = num_eval_batches(rows, true);
  if (index < 0 || index >= nb)
    return Status::error("eval batch " + std::to_string(index) + " out of range (" + std::to_string(nb) + " batches)");
  std::vector<int64_t> sel(static_cast<size_t>(eval_rows_in_batch(index, rows)));
  if (tokens_) {
    // nb*rows windows spread at a regular stride over [0, n-T-1].
    int64_t W = nb * rows;
    int64_t last = static_cast<int64_t>(tokens_->size()) - block_size_ - 1;
    int64_t stride = W > 1 ? last / (W - 1) : 0;  // >= T - 1 since W <= (n-1)/T
    for (int64_t i = 0; i < rows; ++i) sel[i] = (index * rows + i) * stride;
    return token_windows(sel);
  }
  for (size_t i = 0; i < sel.size(); ++i) sel[i] = index * rows + static_cast<int64_t>(i);
  if (seqs_) return sequence_batch(sel, pad_to);
  return gather_rows(sel);
}

int64_t count_num_items(const Tensor& labels, int64_t ignore_index) {
  if (ir::is_float(labels.dtype())) return labels.numel();
  int64_t n = 0;
  for (int64_t i = 0; i < labels.numel(); ++i) n += static_cast<int64_t>(labels.get_f64(i)) != ignore_index;
  return n;
}

Tensor num_items_tensor(int64_t count, ir::DType dtype) {
  Tensor t(dtype, {});
  t.set_f64(0, static_cast<double>(count));
  return t;
}

void add_num_items_feed(const ir::Graph& g, const Tensor& labels, int64_t ignore_index,
                        std::map<std::string, Tensor>& feeds) {
  for (ir::Value* in : g.inputs)
    if (in->name == kNumItemsInput)
      feeds[in->name] = num_items_tensor(count_num_items(labels, ignore_index), in->dtype);
}

Expected<Tensor> microbatch_rows(const Tensor& full, int64_t t, int64_t trips) {
  if (full.rank() < 1 || trips < 1 || full.dim(0) % trips != 0 || t < 0 || t >= trips)
    return Status::error("leading dim of " + ir::dims_to_string(full.dims()) + " has no microbatch " +
                         std::to_string(t) + " of " + std::to_string(trips) + " equal ones");
  std::vector<int64_t> dims = full.dims();
  dims[0] /= trips;
  Tensor out(full.dtype(), dims);
  std::memcpy(out.raw(), static_cast<const char*>(full.raw()) + static_cast<size_t>(t) * out.nbytes(), out.nbytes());
  return out;
}

std::function<Expected<Tensor>(const ir::Value&, int64_t, int64_t)> microbatches_of(
    std::map<std::string, Tensor> whole) {
  return [whole = std::move(whole)](const ir::Value& in, int64_t t, int64_t trips) -> Expected<Tensor> {
    auto it = whole.find(in.name);
    if (it == whole.end()) return Status::error("no data for streamed input '" + in.name + "'");
    auto rows = microbatch_rows(it->second, t, trips);
    if (!rows) return rows.status().with_context("input '" + in.name + "'");
    return rows;
  };
}

Expected<Tensor> fit_to_input(const Tensor& t, const DataInputSpec& in) {
  const auto& gd = in.shape.dims;
  auto fail = [&]() {
    return Status::error("input '" + in.name + "': the graph expects shape " + in.shape.to_string() +
                         ", the batch is " + ir::dims_to_string(t.dims()));
  };
  if (static_cast<int>(gd.size()) != t.rank()) return fail();
  for (int i = 0; i < t.rank(); ++i)
    if (gd[i].is_static() && gd[i].value != t.dim(i)) return fail();
  return t;
}

}  // namespace kiln::runtime
