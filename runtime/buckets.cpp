// Bucket planning and length-grouped batching for variable-length training (see buckets.h).
#include "runtime/buckets.h"

#include <algorithm>
#include <cmath>
#include <string>

#include "runtime/data.h"

namespace kiln::runtime {

namespace {

/// a + b * c into `acc`, false on int64 overflow.
bool add_product(int64_t& acc, int64_t b, int64_t c) {
  int64_t p;
  if (__builtin_mul_overflow(b, c, &p)) return false;
  return !__builtin_add_overflow(acc, p, &acc);
}

Status check_histogram(const std::map<int64_t, int64_t>& histogram) {
  for (auto [len, count] : histogram) {
    if (len < 1) return Status::error("length histogram: length " + std::to_string(len) + " is not positive");
    if (count < 1)
      return Status::error("length histogram: length " + std::to_string(len) + " has " + std::to_string(count) +
                           " rows (must be >= 1)");
  }
  return Status::ok();
}

/// cost(len), or len itself when no cost is given; error when not finite.
Expected<double> cost_at(const LengthCost& cost, int64_t len) {
  double w = cost ? cost(len) : static_cast<double>(len);
  if (!std::isfinite(w))
    return Status::error("bucket cost at length " + std::to_string(len) + " is not finite (" + std::to_string(w) + ")");
  return w;
}

Status overflow(const std::string& what) { return Status::error(what + ": token count overflows int64"); }

}  // namespace

double BucketPlan::padding_fraction() const {
  double total = static_cast<double>(real_tokens) + static_cast<double>(padded_tokens);
  return total > 0 ? static_cast<double>(padded_tokens) / total : 0.0;
}

double PaddingStats::fraction() const {
  double total = static_cast<double>(real_tokens) + static_cast<double>(padded_tokens);
  return total > 0 ? static_cast<double>(padded_tokens) / total : 0.0;
}

int64_t bucket_for(const std::vector<int64_t>& boundaries, int64_t len) {
  auto it = std::lower_bound(boundaries.begin(), boundaries.end(), len);
  return it == boundaries.end() ? -1 : *it;
}

Expected<BucketPlan> evaluate_buckets(const std::map<int64_t, int64_t>& histogram, std::vector<int64_t> boundaries,
                                      const LengthCost& cost) {
  if (boundaries.empty()) return Status::error("no boundaries given");
  for (size_t i = 0; i < boundaries.size(); ++i) {
    if (boundaries[i] < 1) return Status::error("boundary " + std::to_string(boundaries[i]) + " is not positive");
    if (i > 0 && boundaries[i] <= boundaries[i - 1])
      return Status::error("boundaries must be strictly ascending, got " + std::to_string(boundaries[i - 1]) +
                           " then " + std::to_string(boundaries[i]));
  }
  KILN_RETURN_IF_ERROR(check_histogram(histogram));
  BucketPlan plan;
  plan.rows.assign(boundaries.size(), 0);
  size_t b = 0;  // lengths ascend, so the bucket index only moves up
  for (auto [len, count] : histogram) {
    while (b < boundaries.size() && boundaries[b] < len) ++b;
    if (b == boundaries.size()) {
      int64_t over = 0, longest = 0;
      for (auto [l, c] : histogram)
        if (l > boundaries.back()) over += c, longest = std::max(longest, l);
      return Status::error(std::to_string(over) + (over == 1 ? " row is" : " rows are") +
                           " longer than the last length " + std::to_string(boundaries.back()) + " (the longest has " +
                           std::to_string(longest) + " tokens): end the lengths at " + std::to_string(longest) +
                           " or give --max_length " + std::to_string(boundaries.back()));
    }
    if (!add_product(plan.rows[b], count, 1) || !add_product(plan.real_tokens, len, count) ||
        !add_product(plan.padded_tokens, boundaries[b] - len, count))
      return overflow("bucket plan");
  }
  // Summed per bucket in ascending order, exactly as plan_buckets' recurrence adds them.
  for (size_t i = 0; i < boundaries.size(); ++i) {
    if (plan.rows[i] == 0) continue;
    KILN_ASSIGN_OR_RETURN(double w, cost_at(cost, boundaries[i]));
    plan.cost += w * static_cast<double>(plan.rows[i]);
  }
  plan.boundaries = std::move(boundaries);
  return plan;
}

Expected<BucketPlan> plan_buckets(const std::map<int64_t, int64_t>& histogram, int64_t k, const LengthCost& cost) {
  if (k < 1) return Status::error("the number of buckets must be >= 1, got " + std::to_string(k));
  if (histogram.empty()) return Status::error("the length histogram is empty (no rows)");
  KILN_RETURN_IF_ERROR(check_histogram(histogram));
  const int64_t n = static_cast<int64_t>(histogram.size());
  std::vector<int64_t> len, rows_upto(n + 1, 0);  // rows_upto[i]: rows of the i shortest lengths
  std::vector<double> w;
  len.reserve(n);
  w.reserve(n);
  for (auto [l, count] : histogram) {
    KILN_ASSIGN_OR_RETURN(double wl, cost_at(cost, l));
    if (!w.empty() && wl < w.back())
      return Status::error("the cost must be non-decreasing in the length, but cost(" + std::to_string(len.back()) +
                           ") = " + std::to_string(w.back()) + " > cost(" + std::to_string(l) +
                           ") = " + std::to_string(wl));
    int64_t i = static_cast<int64_t>(len.size());
    rows_upto[i + 1] = rows_upto[i];
    if (!add_product(rows_upto[i + 1], count, 1)) return overflow("bucket plan");
    len.push_back(l);
    w.push_back(wl);
  }

  std::vector<int64_t> boundaries;
  if (k >= n) {
    boundaries = len;  // every length its own bucket: no padding, the least cost possible
  } else {
    // best[i]: least cost of the i+1 shortest lengths with j buckets, the last one at len[i].
    // With j buckets, best_j[i] = min over p < i of best_{j-1}[p] + w[i] * rows in (len[p], len[i]];
    // arg[j][i] keeps that p (the first minimum). A boundary is never better placed between two
    // lengths: lowering it to the length below costs no more, since w is non-decreasing.
    std::vector<double> prev(n), cur(n);
    std::vector<std::vector<int64_t>> arg(k, std::vector<int64_t>());
    for (int64_t i = 0; i < n; ++i) prev[i] = w[i] * static_cast<double>(rows_upto[i + 1]);
    for (int64_t j = 1; j < k; ++j) {  // j: buckets before the last one
      arg[j].assign(n, -1);
      for (int64_t i = j; i < n; ++i) {
        double best = 0;
        int64_t best_p = -1;
        for (int64_t p = j - 1; p < i; ++p) {
          double c = prev[p] + w[i] * static_cast<double>(rows_upto[i + 1] - rows_upto[p + 1]);
          if (best_p < 0 || c < best) {
            best = c;
            best_p = p;
          }
        }
        cur[i] = best;
        arg[j][i] = best_p;
      }
      std::swap(prev, cur);
    }
    boundaries.resize(k);
    int64_t i = n - 1;
    for (int64_t j = k - 1; j >= 0; --j) {
      boundaries[j] = len[i];
      if (j > 0) i = arg[j][i];
    }
  }
  return evaluate_buckets(histogram, std::move(boundaries), cost);
}

std::vector<int64_t> length_grouped_order(const std::vector<int64_t>& lengths, int64_t batch_rows, uint64_t seed,
                                          int64_t epoch, int64_t mega_batch_mult) {
  const int64_t n = static_cast<int64_t>(lengths.size());
  if (n == 0) return {};
  const int64_t b = std::max<int64_t>(batch_rows, 1);
  int64_t mult = mega_batch_mult > 0 ? mega_batch_mult : std::max<int64_t>(1, std::min<int64_t>(n / b / 4, 50));
  // Megabatch size, at most n (a larger one is one megabatch all the same).
  const int64_t mega = mult > n / b ? n : b * mult;
  std::vector<int64_t> order = Dataset::epoch_permutation(n, seed, epoch);
  auto longer = [&](int64_t x, int64_t y) { return lengths[x] > lengths[y]; };
  int64_t longest_start = 0;  // start of the first megabatch holding a longest row
  for (int64_t s = 0; s < n; s += mega) {
    auto first = order.begin() + s, last = order.begin() + std::min(s + mega, n);
    std::stable_sort(first, last, longer);
    if (lengths[order[s]] > lengths[order[longest_start]]) longest_start = s;
  }
  std::swap(order[0], order[longest_start]);
  return order;
}

Expected<PaddingStats> padding_of_batches(const std::vector<int64_t>& lengths,
                                          const std::vector<std::vector<int64_t>>& batches,
                                          const std::vector<int64_t>& padded_length) {
  if (batches.size() != padded_length.size())
    return Status::error("padding: " + std::to_string(batches.size()) + " batches but " +
                         std::to_string(padded_length.size()) + " padded lengths");
  const int64_t n = static_cast<int64_t>(lengths.size());
  PaddingStats s;
  for (size_t bi = 0; bi < batches.size(); ++bi) {
    for (int64_t row : batches[bi]) {
      if (row < 0 || row >= n)
        return Status::error("padding: batch " + std::to_string(bi) + " has row " + std::to_string(row) +
                             ", outside the " + std::to_string(n) + " rows");
      const int64_t len = lengths[row];
      if (len < 0) return Status::error("padding: row " + std::to_string(row) + " has negative length");
      if (len > padded_length[bi])
        return Status::error("padding: batch " + std::to_string(bi) + " row " + std::to_string(row) + " has length " +
                             std::to_string(len) + " > the batch's padded length " + std::to_string(padded_length[bi]));
      if (!add_product(s.real_tokens, len, 1) || !add_product(s.padded_tokens, padded_length[bi] - len, 1))
        return overflow("padding");
    }
  }
  return s;
}

Expected<PaddingStats> padding_of_order(const std::vector<int64_t>& lengths, const std::vector<int64_t>& order,
                                        int64_t batch_rows, const std::vector<int64_t>& boundaries) {
  if (batch_rows < 1) return Status::error("padding: batch_rows must be >= 1, got " + std::to_string(batch_rows));
  const int64_t n = static_cast<int64_t>(lengths.size());
  std::vector<std::vector<int64_t>> batches;
  std::vector<int64_t> padded;
  for (size_t s = 0; s < order.size(); s += static_cast<size_t>(batch_rows)) {
    size_t e = std::min(order.size(), s + static_cast<size_t>(batch_rows));
    std::vector<int64_t> batch(order.begin() + static_cast<std::ptrdiff_t>(s),
                               order.begin() + static_cast<std::ptrdiff_t>(e));
    int64_t longest = 0;
    for (int64_t row : batch) {
      if (row < 0 || row >= n)
        return Status::error("padding: order has row " + std::to_string(row) + ", outside the " + std::to_string(n) +
                             " rows");
      longest = std::max(longest, lengths[row]);
    }
    int64_t pad_to = longest;
    if (!boundaries.empty()) {
      pad_to = bucket_for(boundaries, longest);
      if (pad_to < 0)
        return Status::error("padding: batch " + std::to_string(batches.size()) + " has a row of length " +
                             std::to_string(longest) + " > the last boundary " + std::to_string(boundaries.back()));
    }
    batches.push_back(std::move(batch));
    padded.push_back(pad_to);
  }
  return padding_of_batches(lengths, batches, padded);
}

}  // namespace kiln::runtime
