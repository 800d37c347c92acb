// Tests of the shape-bucket planner and length-grouped batching (runtime/buckets.h): the DP
// against brute force over every boundary set on random small histograms, hand-checked
// cases, explicit-boundary errors, bucket_for edges, and HF's group_by_length order
// (permutation, determinism, megabatch structure, padding against a random order).
#include "runtime/buckets.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <limits>
#include <random>
#include <set>

#include "runtime/data.h"

using namespace kiln;
using namespace kiln::runtime;

namespace {

using Histogram = std::map<int64_t, int64_t>;

/// The test's own cost of boundaries: every row padded to the smallest boundary >= its
/// length by a linear scan, summed row group by row group in length order. +inf when a
/// length is above every boundary.
double brute_cost(const Histogram& h, const std::vector<int64_t>& bounds, const std::function<double(int64_t)>& w) {
  double total = 0;
  for (auto [len, count] : h) {
    int64_t b = -1;
    for (int64_t x : bounds)
      if (x >= len && (b < 0 || x < b)) b = x;
    if (b < 0) return std::numeric_limits<double>::infinity();
    total += static_cast<double>(count) * w(b);
  }
  return total;
}

/// Least brute_cost over every subset of `candidates` with 1..k elements (bitmask search).
double brute_min(const Histogram& h, const std::vector<int64_t>& candidates, int64_t k,
                 const std::function<double(int64_t)>& w) {
  double best = std::numeric_limits<double>::infinity();
  const int m = static_cast<int>(candidates.size());
  for (uint32_t mask = 1; mask < (1u << m); ++mask) {
    if (__builtin_popcount(mask) > k) continue;
    std::vector<int64_t> b;
    for (int i = 0; i < m; ++i)
      if (mask & (1u << i)) b.push_back(candidates[i]);
    best = std::min(best, brute_cost(h, b, w));
  }
  return best;
}

bool same_cost(double a, double b, bool exact) {
  if (exact) return a == b;
  return std::fabs(a - b) <= 1e-12 * std::max(std::fabs(a), std::fabs(b));
}

}  // namespace

TEST(Buckets, HandCheckedSmallCases) {
  // {1:1, 2:1, 10:5}: K=2 -> {2, 10} costs 2*2 + 10*5 = 54 (vs {1, 10}: 1 + 10*6 = 61).
  Histogram h{{1, 1}, {2, 1}, {10, 5}};
  auto p = plan_buckets(h, 2);
  ASSERT_TRUE(p) << p.message();
  EXPECT_EQ(p->boundaries, (std::vector<int64_t>{2, 10}));
  EXPECT_EQ(p->rows, (std::vector<int64_t>{2, 5}));
  EXPECT_EQ(p->cost, 54);
  EXPECT_EQ(p->real_tokens, 53);
  EXPECT_EQ(p->padded_tokens, 1);
  EXPECT_DOUBLE_EQ(p->padding_fraction(), 1.0 / 54);

  // K=1: everything padded to 10.
  p = plan_buckets(h, 1);
  ASSERT_TRUE(p) << p.message();
  EXPECT_EQ(p->boundaries, (std::vector<int64_t>{10}));
  EXPECT_EQ(p->cost, 70);
  EXPECT_EQ(p->padded_tokens, 17);

  // K >= distinct lengths: every length its own bucket, no padding, fewer than K buckets.
  for (int64_t k : {3, 5, 1000}) {
    p = plan_buckets(h, k);
    ASSERT_TRUE(p) << p.message();
    EXPECT_EQ(p->boundaries, (std::vector<int64_t>{1, 2, 10}));
    EXPECT_EQ(p->padded_tokens, 0);
    EXPECT_EQ(p->cost, 53);
  }

  // A quadratic cost changes the answer: {4:3, 6:1, 10:1}, K=2.
  // Tokens: {4,10} = 3*4 + 2*10 = 32 < {6,10} = 4*6 + 10 = 34.
  // L^2:    {4,10} = 3*16 + 2*100 = 248 > {6,10} = 4*36 + 100 = 244.
  Histogram q{{4, 3}, {6, 1}, {10, 1}};
  p = plan_buckets(q, 2);
  ASSERT_TRUE(p) << p.message();
  EXPECT_EQ(p->boundaries, (std::vector<int64_t>{4, 10}));
  EXPECT_EQ(p->cost, 32);
  p = plan_buckets(q, 2, [](int64_t l) { return static_cast<double>(l * l); });
  ASSERT_TRUE(p) << p.message();
  EXPECT_EQ(p->boundaries, (std::vector<int64_t>{6, 10}));
  EXPECT_EQ(p->cost, 244);
  EXPECT_EQ(p->padded_tokens, 3 * 2);  // three rows 4 -> 6; 6 and 10 fit their buckets exactly
}

TEST(Buckets, PlanEqualsBruteForceOnRandomHistograms) {
  std::mt19937_64 rng(20240531);
  const std::vector<std::pair<const char*, std::function<double(int64_t)>>> costs = {
      {"tokens", [](int64_t l) { return static_cast<double>(l); }},
      {"3L+L^2", [](int64_t l) { return static_cast<double>(3 * l + l * l); }},
      {"L+L^2/37", [](int64_t l) { return static_cast<double>(l) + static_cast<double>(l * l) / 37.0; }},
  };
  int checked = 0;
  for (int trial = 0; trial < 300; ++trial) {
    // Alternate dense small lengths (brute force over every integer boundary set too) and
    // sparse large ones (brute force over subsets of the histogram's lengths).
    const bool small = trial % 2 == 0;
    const int64_t max_len = small ? 4 + static_cast<int64_t>(rng() % 9) : 50 + static_cast<int64_t>(rng() % 4000);
    const int64_t distinct = 1 + static_cast<int64_t>(rng() % std::min<int64_t>(10, max_len));
    Histogram h;
    while (static_cast<int64_t>(h.size()) < distinct) {
      int64_t len = 1 + static_cast<int64_t>(rng() % max_len);
      int64_t count = rng() % 5 == 0 ? 1 + static_cast<int64_t>(rng() % 1000) : 1 + static_cast<int64_t>(rng() % 20);
      h[len] = count;
    }
    std::vector<int64_t> lengths;
    int64_t real = 0;
    for (auto [len, count] : h) {
      lengths.push_back(len);
      real += len * count;
    }
    std::vector<int64_t> integers;  // every boundary from 1 to two past the largest length
    for (int64_t x = 1; x <= lengths.back() + 2; ++x) integers.push_back(x);
    for (size_t ci = 0; ci < costs.size(); ++ci) {
      const auto& [name, w] = costs[ci];
      const bool exact = ci < 2;  // integer-valued costs: sums are exact in double
      for (int64_t k = 1; k <= 5; ++k) {
        SCOPED_TRACE(std::string("cost ") + name + " K=" + std::to_string(k) + " trial " + std::to_string(trial));
        auto p = ci == 0 ? plan_buckets(h, k) : plan_buckets(h, k, w);
        ASSERT_TRUE(p) << p.message();
        const double want = brute_min(h, lengths, k, w);
        EXPECT_TRUE(same_cost(p->cost, want, exact)) << p->cost << " vs brute force " << want;
        if (small) {
          const double any = brute_min(h, integers, k, w);
          EXPECT_TRUE(same_cost(any, want, exact)) << "boundaries between lengths beat lengths: " << any;
        }
        // The boundaries achieve it, and have the documented shape.
        EXPECT_TRUE(same_cost(brute_cost(h, p->boundaries, w), want, exact));
        EXPECT_EQ(static_cast<int64_t>(p->boundaries.size()), std::min<int64_t>(k, distinct));
        EXPECT_EQ(p->boundaries.back(), lengths.back());
        for (size_t i = 0; i < p->boundaries.size(); ++i) {
          EXPECT_TRUE(h.count(p->boundaries[i])) << p->boundaries[i] << " is not a length";
          if (i > 0) {
            EXPECT_LT(p->boundaries[i - 1], p->boundaries[i]);
          }
        }
        EXPECT_EQ(p->real_tokens, real);
        if (ci == 0) {
          EXPECT_EQ(static_cast<double>(p->real_tokens + p->padded_tokens), p->cost);
        }
        int64_t rows = 0, total_rows = 0;
        for (int64_t r : p->rows) rows += r;
        for (auto [len, count] : h) total_rows += count;
        EXPECT_EQ(rows, total_rows);
        ++checked;
      }
    }
  }
  EXPECT_EQ(checked, 300 * 3 * 5);
}

TEST(Buckets, PlanErrors) {
  Histogram h{{3, 2}, {8, 1}};
  auto e = plan_buckets(h, 0);
  ASSERT_FALSE(e);
  EXPECT_NE(e.message().find(">= 1"), std::string::npos) << e.message();
  EXPECT_FALSE(plan_buckets(h, -4));
  e = plan_buckets({}, 2);
  ASSERT_FALSE(e);
  EXPECT_NE(e.message().find("empty"), std::string::npos) << e.message();
  e = plan_buckets({{0, 1}, {4, 1}}, 2);
  ASSERT_FALSE(e);
  EXPECT_NE(e.message().find("length 0"), std::string::npos) << e.message();
  EXPECT_FALSE(plan_buckets({{-3, 1}}, 1));
  e = plan_buckets({{5, 0}}, 1);
  ASSERT_FALSE(e);
  EXPECT_NE(e.message().find("length 5 has 0 rows"), std::string::npos) << e.message();
  EXPECT_FALSE(plan_buckets({{5, -2}}, 1));
  // A decreasing cost: named with both lengths.
  e = plan_buckets(h, 1, [](int64_t l) { return 100.0 - static_cast<double>(l); });
  ASSERT_FALSE(e);
  EXPECT_NE(e.message().find("cost(3)"), std::string::npos) << e.message();
  EXPECT_NE(e.message().find("cost(8)"), std::string::npos) << e.message();
  e = plan_buckets(h, 1, [](int64_t) { return std::nan(""); });
  ASSERT_FALSE(e);
  EXPECT_NE(e.message().find("not finite"), std::string::npos) << e.message();
  // Token totals beyond int64.
  EXPECT_FALSE(plan_buckets({{int64_t{1} << 40, int64_t{1} << 30}}, 1));
}

TEST(Buckets, EvaluateExplicitBoundaries) {
  // 10 x2 -> 32, 33 -> 64, 64 -> 64, 100 x3 -> 128.
  Histogram h{{10, 2}, {33, 1}, {64, 1}, {100, 3}};
  auto p = evaluate_buckets(h, {32, 64, 128});
  ASSERT_TRUE(p) << p.message();
  EXPECT_EQ(p->boundaries, (std::vector<int64_t>{32, 64, 128}));
  EXPECT_EQ(p->rows, (std::vector<int64_t>{2, 2, 3}));
  EXPECT_EQ(p->real_tokens, 20 + 33 + 64 + 300);
  EXPECT_EQ(p->padded_tokens, 2 * 22 + 31 + 0 + 3 * 28);
  EXPECT_EQ(p->cost, 2 * 32 + 2 * 64 + 3 * 128);
  // A cost function, and an unused bucket kept as given.
  p = evaluate_buckets(h, {16, 32, 64, 128, 256}, [](int64_t l) { return static_cast<double>(l * l); });
  ASSERT_TRUE(p) << p.message();
  EXPECT_EQ(p->rows, (std::vector<int64_t>{2, 0, 2, 3, 0}));
  EXPECT_EQ(p->cost, 2 * 16 * 16 + 2 * 64 * 64 + 3 * 128 * 128);
  // An empty histogram costs nothing.
  p = evaluate_buckets({}, {8});
  ASSERT_TRUE(p) << p.message();
  EXPECT_EQ(p->cost, 0);
  EXPECT_EQ(p->padding_fraction(), 0);
  // The plan's boundaries evaluate to the plan.
  auto planned = plan_buckets(h, 2);
  ASSERT_TRUE(planned);
  auto again = evaluate_buckets(h, planned->boundaries);
  ASSERT_TRUE(again);
  EXPECT_EQ(again->cost, planned->cost);
  EXPECT_EQ(again->padded_tokens, planned->padded_tokens);
}

TEST(Buckets, EvaluateErrors) {
  Histogram h{{10, 2}, {100, 3}};
  auto e = evaluate_buckets(h, {});
  ASSERT_FALSE(e);
  EXPECT_NE(e.message().find("no boundaries"), std::string::npos) << e.message();
  e = evaluate_buckets(h, {32, 64});
  ASSERT_FALSE(e);
  EXPECT_NE(e.message().find("rows are longer than the last length 64"), std::string::npos) << e.message();
  EXPECT_NE(e.message().find("the longest has 100 tokens"), std::string::npos) << e.message();
  e = evaluate_buckets(h, {64, 32, 128});
  ASSERT_FALSE(e);
  EXPECT_NE(e.message().find("64 then 32"), std::string::npos) << e.message();
  e = evaluate_buckets(h, {32, 32, 128});
  ASSERT_FALSE(e);
  EXPECT_NE(e.message().find("ascending"), std::string::npos) << e.message();
  e = evaluate_buckets(h, {0, 128});
  ASSERT_FALSE(e);
  EXPECT_NE(e.message().find("not positive"), std::string::npos) << e.message();
  EXPECT_FALSE(evaluate_buckets(h, {-8, 128}));
  EXPECT_FALSE(evaluate_buckets({{0, 1}}, {8}));
  EXPECT_FALSE(evaluate_buckets({{4, 0}}, {8}));
  EXPECT_FALSE(evaluate_buckets(h, {128}, [](int64_t) { return std::numeric_limits<double>::infinity(); }));
}

TEST(Buckets, BucketForEdges) {
  const std::vector<int64_t> b{32, 64, 128};
  EXPECT_EQ(bucket_for(b, 1), 32);
  EXPECT_EQ(bucket_for(b, 0), 32);
  EXPECT_EQ(bucket_for(b, -5), 32);
  EXPECT_EQ(bucket_for(b, 31), 32);
  EXPECT_EQ(bucket_for(b, 32), 32);
  EXPECT_EQ(bucket_for(b, 33), 64);
  EXPECT_EQ(bucket_for(b, 64), 64);
  EXPECT_EQ(bucket_for(b, 65), 128);
  EXPECT_EQ(bucket_for(b, 128), 128);
  EXPECT_EQ(bucket_for(b, 129), -1);
  EXPECT_EQ(bucket_for({}, 1), -1);
  EXPECT_EQ(bucket_for({7}, 7), 7);
  EXPECT_EQ(bucket_for({7}, 8), -1);
}

namespace {

/// A skewed length distribution like sentences: log-normal around e^3.5 ~ 33 tokens,
/// a long tail, clipped to [1, 512].
std::vector<int64_t> skewed_lengths(int64_t n, uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::vector<int64_t> out(n);
  for (auto& l : out) {
    // Box-Muller from two uniform doubles (the test's own, independent of <random>'s distributions).
    double u1 = (static_cast<double>(rng() >> 11) + 1.0) / 9007199254740993.0;
    double u2 = static_cast<double>(rng() >> 11) / 9007199254740992.0;
    double z = std::sqrt(-2.0 * std::log(u1)) * std::cos(2.0 * 3.14159265358979323846 * u2);
    l = std::clamp<int64_t>(static_cast<int64_t>(std::exp(3.5 + 0.9 * z)), 1, 512);
  }
  return out;
}

}  // namespace

TEST(Buckets, LengthGroupedOrderStructure) {
  const int64_t n = 1000, batch = 8;
  const auto lengths = skewed_lengths(n, 7);
  const auto order = length_grouped_order(lengths, batch, 42, 0);
  // A permutation of 0..n-1.
  ASSERT_EQ(static_cast<int64_t>(order.size()), n);
  auto sorted = order;
  std::sort(sorted.begin(), sorted.end());
  for (int64_t i = 0; i < n; ++i) ASSERT_EQ(sorted[i], i) << "not a permutation";
  // Deterministic per (seed, epoch); other epochs and seeds give other orders.
  EXPECT_EQ(order, length_grouped_order(lengths, batch, 42, 0));
  EXPECT_NE(order, length_grouped_order(lengths, batch, 42, 1));
  EXPECT_NE(order, length_grouped_order(lengths, batch, 43, 0));
  // The first row is a longest one.
  EXPECT_EQ(lengths[order[0]], *std::max_element(lengths.begin(), lengths.end()));

  // HF's default megabatch: batch * min(n / (4 * batch), 50) = 8 * 31 rows here. Each is the
  // permutation's chunk sorted by length descending (stable), except for the one swap that
  // brought the longest row to the front.
  const int64_t mega = batch * std::min<int64_t>(n / (4 * batch), 50);
  ASSERT_EQ(mega, 248);
  const auto perm = Dataset::epoch_permutation(n, 42, 0);
  int changed = 0;
  for (int64_t s = 0; s < n; s += mega) {
    const int64_t e = std::min(s + mega, n);
    // Descending after the first row (the first may be the row swapped in from megabatch 0).
    for (int64_t i = s + 2; i < e; ++i)
      ASSERT_GE(lengths[order[i - 1]], lengths[order[i]]) << "megabatch at " << s << " not descending at " << i;
    std::vector<int64_t> got(order.begin() + s, order.begin() + e), want(perm.begin() + s, perm.begin() + e);
    std::sort(got.begin(), got.end());
    std::sort(want.begin(), want.end());
    if (got != want) {
      ++changed;
      std::vector<int64_t> diff;
      std::set_difference(got.begin(), got.end(), want.begin(), want.end(), std::back_inserter(diff));
      EXPECT_EQ(diff.size(), 1u) << "megabatch at " << s << " differs from its chunk by more than one swapped row";
    }
  }
  EXPECT_LE(changed, 2);
  // Stable: rows of equal length keep their permutation order within a megabatch (checked on
  // the megabatches the swap left untouched).
  std::vector<int64_t> pos(n);
  for (int64_t i = 0; i < n; ++i) pos[perm[i]] = i;
  for (int64_t i = 2; i < n; ++i)
    if (i % mega >= 2 && lengths[order[i - 1]] == lengths[order[i]]) {
      EXPECT_LT(pos[order[i - 1]], pos[order[i]]) << "equal lengths reordered at " << i;
    }

  // An explicit multiplier, and HF's cap of 50 on large datasets.
  const auto o2 = length_grouped_order(lengths, batch, 42, 0, 2);
  for (int64_t s = 0; s < n; s += 16)
    for (int64_t i = s + 2; i < std::min(s + 16, n); ++i) ASSERT_GE(lengths[o2[i - 1]], lengths[o2[i]]);
  EXPECT_EQ(lengths[o2[0]], lengths[order[0]]);
  const auto big_lengths = skewed_lengths(100000, 9);
  const auto big = length_grouped_order(big_lengths, batch, 1, 0);
  const auto big_perm = Dataset::epoch_permutation(100000, 1, 0);
  // Megabatches of 400 = 8 * 50 rows: each holds its chunk of the permutation, except the
  // first and the first one holding a longest row (they exchanged one row).
  int64_t longest_chunk = 0, longest = -1;
  for (int64_t s = 0; s < 100000; s += 400)
    for (int64_t i = s; i < s + 400; ++i)
      if (big_lengths[big_perm[i]] > longest) {
        longest = big_lengths[big_perm[i]];
        longest_chunk = s;
      }
  EXPECT_EQ(big_lengths[big[0]], longest);
  for (int64_t s = 400; s < 100000; s += 400) {
    if (s == longest_chunk) continue;
    std::vector<int64_t> a(big.begin() + s, big.begin() + s + 400), b(big_perm.begin() + s, big_perm.begin() + s + 400);
    std::sort(a.begin(), a.end());
    std::sort(b.begin(), b.end());
    ASSERT_EQ(a, b) << "megabatch at " << s;
    for (int64_t i = s + 1; i < s + 400; ++i) ASSERT_GE(big_lengths[big[i - 1]], big_lengths[big[i]]);
    ASSERT_LT(big_lengths[big[s + 399]], big_lengths[big[s]]) << "megabatch at " << s << " not sorted by length";
  }

  // Edge cases: empty, one row, batch larger than the data, batch_rows < 1.
  EXPECT_TRUE(length_grouped_order({}, 4, 1, 0).empty());
  EXPECT_EQ(length_grouped_order({5}, 4, 1, 0), (std::vector<int64_t>{0}));
  const std::vector<int64_t> few{3, 9, 1, 9, 4};
  auto o3 = length_grouped_order(few, 100, 5, 0);
  std::vector<int64_t> few_lens;
  for (int64_t r : o3) few_lens.push_back(few[r]);
  EXPECT_EQ(few_lens, (std::vector<int64_t>{9, 9, 4, 3, 1}));
  EXPECT_EQ(length_grouped_order(few, 0, 5, 0).size(), few.size());
}

TEST(Buckets, PaddingOfBatches) {
  const std::vector<int64_t> lengths{3, 5, 8, 2};
  auto s = padding_of_batches(lengths, {{0, 1}, {2, 3}}, {5, 8});
  ASSERT_TRUE(s) << s.message();
  EXPECT_EQ(s->real_tokens, 18);
  EXPECT_EQ(s->padded_tokens, 2 + 0 + 0 + 6);
  EXPECT_DOUBLE_EQ(s->fraction(), 1.0 - 18.0 / 26.0);
  EXPECT_EQ(PaddingStats{}.fraction(), 0);

  auto e = padding_of_batches(lengths, {{0, 1}}, {5, 8});
  ASSERT_FALSE(e);
  EXPECT_NE(e.message().find("1 batches but 2 padded lengths"), std::string::npos) << e.message();
  e = padding_of_batches(lengths, {{0, 4}}, {8});
  ASSERT_FALSE(e);
  EXPECT_NE(e.message().find("row 4"), std::string::npos) << e.message();
  EXPECT_FALSE(padding_of_batches(lengths, {{-1}}, {8}));
  e = padding_of_batches(lengths, {{0}, {2}}, {4, 7});
  ASSERT_FALSE(e);
  EXPECT_NE(e.message().find("batch 1 row 2 has length 8 > the batch's padded length 7"), std::string::npos)
      << e.message();

  // Consecutive batches of an order: the last partial batch counts.
  auto o = padding_of_order(lengths, {2, 0, 1, 3, 0}, 2);  // [8,3] -> 8, [5,2] -> 5, [3] -> 3
  ASSERT_TRUE(o) << o.message();
  EXPECT_EQ(o->real_tokens, 21);
  EXPECT_EQ(o->padded_tokens, 5 + 3 + 0);
  o = padding_of_order(lengths, {2, 0, 1, 3, 0}, 2, {4, 8});  // -> 8, 8, 4
  ASSERT_TRUE(o) << o.message();
  EXPECT_EQ(o->padded_tokens, 5 + (3 + 6) + 1);
  e = padding_of_order(lengths, {2, 0}, 2, {4, 6});
  ASSERT_FALSE(e);
  EXPECT_NE(e.message().find("length 8 > the last boundary 6"), std::string::npos) << e.message();
  EXPECT_FALSE(padding_of_order(lengths, {0}, 0));
  EXPECT_FALSE(padding_of_order(lengths, {9}, 1));
}

TEST(Buckets, LengthGroupingCutsPadding) {
  const int64_t n = 20000, batch = 16;
  const auto lengths = skewed_lengths(n, 11);
  // A random order padded to each batch's longest row (`specialize`) against length-grouped
  // batches of the same rows.
  auto random = padding_of_order(lengths, Dataset::epoch_permutation(n, 3, 0), batch);
  auto grouped = padding_of_order(lengths, length_grouped_order(lengths, batch, 3, 0), batch);
  ASSERT_TRUE(random && grouped);
  std::printf("padding, %lld rows of batch %lld: random order %.4f, length-grouped %.4f (ratio %.3f)\n",
              static_cast<long long>(n), static_cast<long long>(batch), random->fraction(), grouped->fraction(),
              grouped->fraction() / random->fraction());
  EXPECT_EQ(random->real_tokens, grouped->real_tokens);
  EXPECT_LT(grouped->fraction(), 0.5 * random->fraction());

  // Planned buckets: the plan's padding is a lower bound for length-grouped batches padded
  // to the bucket of their longest row (each row alone would sit in its own bucket).
  std::map<int64_t, int64_t> h;
  for (int64_t l : lengths) ++h[l];
  for (int64_t k : {2, 4, 8}) {
    auto plan = plan_buckets(h, k);
    ASSERT_TRUE(plan) << plan.message();
    std::printf("K=%lld buckets:", static_cast<long long>(k));
    for (int64_t b : plan->boundaries) std::printf(" %lld", static_cast<long long>(b));
    std::printf("; planned padding %.4f\n", plan->padding_fraction());
    Expected<PaddingStats> got = Status::error("unset");
    for (int64_t mult : {0, 200}) {  // HF's default megabatches (50 batches here), and 200 batches
      got = padding_of_order(lengths, length_grouped_order(lengths, batch, 3, 0, mult), batch, plan->boundaries);
      ASSERT_TRUE(got) << got.message();
      std::printf("  length-grouped batches, mega_batch_mult %s: padding %.4f (%.3fx the plan's padded tokens)\n",
                  mult ? "200" : "default", got->fraction(),
                  static_cast<double>(got->padded_tokens) / static_cast<double>(plan->padded_tokens));
      EXPECT_EQ(got->real_tokens, plan->real_tokens);
      EXPECT_GE(got->padded_tokens, plan->padded_tokens);
    }
    auto one = padding_of_order(lengths, length_grouped_order(lengths, batch, 3, 0), batch, {512});
    ASSERT_TRUE(one);
    EXPECT_LT(got->fraction(), one->fraction());  // buckets beat padding everything to the max
  }
}

TEST(Buckets, LargeHistogramPlansQuickly) {
  // 4096 distinct lengths, K=8: O(K n^2) ~ 1.3e8 steps.
  std::mt19937_64 rng(5);
  Histogram h;
  for (int64_t l = 1; l <= 4096; ++l) h[l] = 1 + static_cast<int64_t>(rng() % 100) + (l < 512 ? 400 : 0);
  auto t0 = std::chrono::steady_clock::now();
  auto p = plan_buckets(h, 8);
  auto t1 = std::chrono::steady_clock::now();
  ASSERT_TRUE(p) << p.message();
  std::printf("plan_buckets: 4096 distinct lengths, K=8 in %.1f ms; boundaries",
              std::chrono::duration<double, std::milli>(t1 - t0).count());
  for (int64_t b : p->boundaries) std::printf(" %lld", static_cast<long long>(b));
  std::printf("\n");
  ASSERT_EQ(p->boundaries.size(), 8u);
  EXPECT_EQ(p->boundaries.back(), 4096);
  // No worse than evenly spaced boundaries, nor than any single boundary moved to a neighbour.
  auto even = evaluate_buckets(h, {512, 1024, 1536, 2048, 2560, 3072, 3584, 4096});
  ASSERT_TRUE(even);
  EXPECT_LE(p->cost, even->cost);
  for (size_t i = 0; i + 1 < p->boundaries.size(); ++i)
    for (int64_t d : {-1, 1}) {
      auto moved = p->boundaries;
      moved[i] += d;
      if ((i > 0 && moved[i] <= moved[i - 1]) || moved[i] >= moved[i + 1] || moved[i] < 1) continue;
      auto m = evaluate_buckets(h, moved);
      ASSERT_TRUE(m);
      EXPECT_LE(p->cost, m->cost) << "boundary " << i << " moved by " << d;
    }
  // A quadratic (attention-like) cost on the same histogram.
  auto q = plan_buckets(h, 8, [](int64_t l) { return 4096.0 * static_cast<double>(l) + static_cast<double>(l * l); });
  ASSERT_TRUE(q) << q.message();
  EXPECT_EQ(q->boundaries.back(), 4096);
}
