// Variable-length training (`--shape_mode buckets`): padded-length buckets planned from a
// dataset's length histogram, and the length-grouped row order that fills them.
//
// Lengths are in tokens (a row's sequence length, >= 1). A row of length `len` trained in
// a bucket with boundaries B (ascending) is padded to b(len) = the smallest boundary >=
// len; one program is built per boundary. `plan_buckets` picks the K boundaries that
// minimize the total padded cost exactly (dynamic programming over the distinct lengths);
// `evaluate_buckets` costs explicit boundaries (`--shape_buckets 32,64,128`);
// `length_grouped_order` is Hugging Face's `group_by_length` sampler, so that consecutive
// batches hold rows of similar length (see its comment for where kiln differs from HF);
// `padding_of_batches` measures what a sequence of batches actually padded.
//
// Everything here is pure (no I/O, no global state): the same inputs give the same output.
#pragma once
#include <cstdint>
#include <functional>
#include <map>
#include <vector>

#include "ir/status.h"

namespace kiln::runtime {

/// Padded-length buckets chosen from (or evaluated on) a dataset's length histogram.
struct BucketPlan {
  /// Padded lengths in tokens, strictly ascending. From `plan_buckets` the last is the
  /// histogram's largest length and every boundary is a length of the histogram; from
  /// `evaluate_buckets` they are the given boundaries, unchanged.
  std::vector<int64_t> boundaries;
  /// Rows per bucket (same size as `boundaries`): rows whose length maps to each boundary.
  std::vector<int64_t> rows;
  double cost = 0;            ///< sum over rows of cost(boundary of the row), in the LengthCost's unit
  int64_t real_tokens = 0;    ///< sum of the rows' lengths (tokens before padding)
  int64_t padded_tokens = 0;  ///< padding added: sum over rows of boundary - length (tokens)

  /// Padding fraction: padded_tokens / (real_tokens + padded_tokens), 0 with no tokens.
  double padding_fraction() const;
};

/// Row cost at padded length L (tokens). Unset (the default): L, i.e. the planner minimizes
/// padded tokens. Given: a FLOPs-like weight such as a*L + b*L*L (attention grows with L^2).
/// Must be finite and non-decreasing in L (then the optimal boundaries are lengths of the
/// histogram); the planner checks both on the histogram's lengths.
using LengthCost = std::function<double(int64_t)>;

/// The K boundaries minimizing sum_rows cost(b(len)), b(len) = smallest boundary >= len,
/// exactly: dynamic programming over the n distinct lengths of `histogram` (length in
/// tokens -> number of rows), O(K n^2) time, O(K n) memory (Bellman's optimal-segmentation
/// recurrence: best_j(i) = min_p best_{j-1}(p) + cost(len_i) * rows in (len_p, len_i];
/// ~0.1-0.3 s for n = 4096, K = 8). The last boundary is always the largest length.
/// Fewer distinct lengths than K: every distinct length is a boundary (fewer than K
/// buckets; no padding). Among several optimal sets the DP keeps the first
/// found (each bucket's previous boundary as small as possible), deterministically.
/// `cost` (BucketPlan::cost) is recomputed by evaluate_buckets on the result, so both
/// functions report the same number for the same boundaries.
/// Errors: k < 1; an empty histogram; a length or count < 1; a cost that is not finite or
/// decreases between two lengths (naming them); token totals overflowing int64.
Expected<BucketPlan> plan_buckets(const std::map<int64_t, int64_t>& histogram, int64_t k, const LengthCost& cost = {});

/// Cost of explicit boundaries (`--shape_buckets 32,64,128`): every row padded to the
/// smallest boundary >= its length. An empty histogram costs 0.
/// Errors: no boundaries; a boundary < 1; boundaries not strictly ascending (naming the
/// pair); a length above the last boundary (naming both); a length or count < 1; a
/// non-finite cost; token totals overflowing int64.
Expected<BucketPlan> evaluate_buckets(const std::map<int64_t, int64_t>& histogram, std::vector<int64_t> boundaries,
                                      const LengthCost& cost = {});

/// Smallest boundary >= len in the ascending `boundaries` (binary search), or -1 when len
/// exceeds every boundary or there are none. Any len <= boundaries[0] (0 and negatives
/// included) maps to boundaries[0].
int64_t bucket_for(const std::vector<int64_t>& boundaries, int64_t len);

/// Row order of Hugging Face's LengthGroupedSampler (transformers trainer_pt_utils
/// get_length_grouped_indices): a random permutation of the n = lengths.size() rows, cut
/// into megabatches of mega = batch_rows * mega_batch_mult consecutive rows (the last may
/// be shorter), each sorted by length descending (stable: equal lengths keep their
/// permutation order, as Python's sorted); then the longest row of all (the first
/// megabatch holding it) swaps places with the first row of the first megabatch, so the
/// order starts with the longest row and an out-of-memory shows at step 1. Batches are
/// then consecutive runs of batch_rows rows of the result.
///
/// mega_batch_mult 0 (the default) is HF's default: min(n / (4 * batch_rows), 50), at
/// least 1 (50, or 4 megabatches on small datasets). batch_rows < 1 is taken as 1.
/// Batches padded to their bucket lose to the plan where a batch straddles a boundary, so
/// larger megabatches come closer to the plan (less shuffled): on 20000 log-normal lengths,
/// batch 16, K = 8 planned buckets, HF's default pads 1.37x the plan's padded tokens and
/// mega_batch_mult 200 1.09x (tests/runtime/buckets_test.cpp LengthGroupingCutsPadding).
///
/// Where kiln differs from HF: the permutation is Dataset::epoch_permutation(n, seed,
/// epoch) (std::mt19937_64 seeded by mix_seed(seed, epoch), Fisher-Yates with
/// rejection-sampled draws; the order depends on nothing but (seed, epoch)), the same one
/// the unsorted loader shuffles with, instead of torch.randperm with a torch.Generator;
/// so orders are reproducible across platforms but are not HF's for the same seed.
std::vector<int64_t> length_grouped_order(const std::vector<int64_t>& lengths, int64_t batch_rows, uint64_t seed,
                                          int64_t epoch, int64_t mega_batch_mult = 0);

/// Tokens of a sequence of padded batches.
struct PaddingStats {
  int64_t real_tokens = 0;    ///< sum of the rows' lengths
  int64_t padded_tokens = 0;  ///< padding added: sum over rows of (batch's padded length - length)
  /// 1 - real / (real + padded) tokens, 0 with no tokens.
  double fraction() const;
};

/// Padding of `batches` (each a list of row indices into `lengths`), batch i padded to
/// `padded_length[i]` tokens. Errors: different numbers of batches and padded lengths; a
/// row index outside lengths; a negative length; a row longer than its batch's padded
/// length (naming batch, row and both lengths); totals overflowing int64.
Expected<PaddingStats> padding_of_batches(const std::vector<int64_t>& lengths,
                                          const std::vector<std::vector<int64_t>>& batches,
                                          const std::vector<int64_t>& padded_length);

/// Padding of training on `order` in consecutive batches of batch_rows rows (the last,
/// partial batch included), each padded to its longest row when `boundaries` is empty
/// (`specialize`), else to bucket_for(boundaries, longest row) (`buckets`, `pad` with one
/// boundary). Errors: batch_rows < 1; a row index outside lengths; a longest row above the
/// last boundary; as padding_of_batches otherwise.
Expected<PaddingStats> padding_of_order(const std::vector<int64_t>& lengths, const std::vector<int64_t>& order,
                                        int64_t batch_rows, const std::vector<int64_t>& boundaries = {});

}  // namespace kiln::runtime
