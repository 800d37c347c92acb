// Tests of the trainer's data loader: shuffling determinism, drop-last, dtype/shape
// errors naming the file, i32 label conversion, token windows, accumulation layout.
#include "runtime/data.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <filesystem>
#include <set>

#include "runtime/io.h"

using namespace kiln;
using namespace kiln::runtime;
using ir::DType;
using ir::Tensor;

namespace {

std::vector<DataInputSpec> specs_xy(DType ydt = DType::i64) {
  return {{"x", DType::f32, ir::Shape({ir::Dim(std::string("batch")), ir::Dim(int64_t{3})})},
          {"labels", ydt, ir::Shape({ir::Dim(std::string("batch"))})}};
}

Tensor rows_f32(int64_t n, int64_t d) {
  Tensor t(DType::f32, {n, d});
  for (int64_t i = 0; i < n * d; ++i) t.data<float>()[i] = static_cast<float>(i / d);  // row id in every column
  return t;
}

Tensor labels_i64(int64_t n) {
  Tensor t(DType::i64, {n});
  for (int64_t i = 0; i < n; ++i) t.data<int64_t>()[i] = i;
  return t;
}

std::string tmpdir(const std::string& name) {
  auto p = std::filesystem::temp_directory_path() / ("kiln_data_test_" + name + "_" + std::to_string(getpid()));
  std::filesystem::remove_all(p);
  std::filesystem::create_directories(p);
  return p.string();
}

}  // namespace

TEST(Data, PermutationIsDeterministicPerSeedAndEpoch) {
  auto a = Dataset::epoch_permutation(100, 42, 0);
  auto b = Dataset::epoch_permutation(100, 42, 0);
  auto c = Dataset::epoch_permutation(100, 42, 1);
  auto d = Dataset::epoch_permutation(100, 43, 0);
  EXPECT_EQ(a, b);
  EXPECT_NE(a, c);
  EXPECT_NE(a, d);
  auto sorted = a;
  std::sort(sorted.begin(), sorted.end());
  for (int64_t i = 0; i < 100; ++i) ASSERT_EQ(sorted[i], i) << "not a permutation";
  // Shuffled: not the identity.
  int fixed = 0;
  for (int64_t i = 0; i < 100; ++i) fixed += a[i] == i;
  EXPECT_LT(fixed, 20);
}

TEST(Data, EpochVisitsEachRowOnceAndDropsLastPartialBatch) {
  auto ds =
      Dataset::from_arrays({{"x", "x.npy", rows_f32(10, 3)}, {"labels", "y.npy", labels_i64(10)}}, specs_xy(), {});
  ASSERT_TRUE(ds) << ds.message();
  EXPECT_EQ(ds->steps_per_epoch(3), 3);  // 10 rows, batch 3: the 10th row is dropped
  std::set<int64_t> seen;
  for (int64_t i = 0; i < 3; ++i) {
    auto b = ds->train_batch(7, 0, i, 3);
    ASSERT_TRUE(b) << b.message();
    const Tensor& x = b->at("x");
    const Tensor& y = b->at("labels");
    ASSERT_EQ(x.dims(), (std::vector<int64_t>{3, 3}));
    for (int r = 0; r < 3; ++r) {
      // x row r and label r come from the same source row.
      EXPECT_EQ(static_cast<int64_t>(x.data<float>()[r * 3 + 2]), y.data<int64_t>()[r]);
      EXPECT_TRUE(seen.insert(y.data<int64_t>()[r]).second) << "row repeated within an epoch";
    }
  }
  EXPECT_EQ(seen.size(), 9u);
  EXPECT_FALSE(ds->train_batch(7, 0, 3, 3)) << "index past the epoch must be an error";
  // Same (seed, epoch, index) -> same batch; another epoch -> another order.
  auto b1 = ds->train_batch(7, 1, 0, 3), b2 = ds->train_batch(7, 1, 0, 3), b0 = ds->train_batch(7, 0, 0, 3);
  EXPECT_EQ(b1->at("labels").to_i64_vector(), b2->at("labels").to_i64_vector());
  auto p0 = Dataset::epoch_permutation(10, 7, 0);
  EXPECT_EQ(b0->at("labels").to_i64_vector(), (std::vector<int64_t>{p0[0], p0[1], p0[2]}));
}

TEST(Data, FloatLabelsForCrossEntropyNameTheFile) {
  auto ds = Dataset::from_arrays(
      {{"x", "x.npy", rows_f32(4, 3)}, {"labels", "y_float.npy", rows_f32(4, 1).reshaped({4})}}, specs_xy(), {});
  ASSERT_FALSE(ds);
  EXPECT_NE(ds.message().find("y_float.npy"), std::string::npos) << ds.message();
  EXPECT_NE(ds.message().find("integer"), std::string::npos) << ds.message();
}

TEST(Data, Int32LabelsBecomeInt64) {
  Tensor y32 = labels_i64(4).cast(DType::i32);
  auto ds = Dataset::from_arrays({{"x", "x.npy", rows_f32(4, 3)}, {"labels", "y.npy", y32}}, specs_xy(), {});
  ASSERT_TRUE(ds) << ds.message();
  auto b = ds->first_batch(4);
  ASSERT_TRUE(b);
  EXPECT_EQ(b->at("labels").dtype(), DType::i64);
  EXPECT_EQ(b->at("labels").to_i64_vector(), (std::vector<int64_t>{0, 1, 2, 3}));
}

TEST(Data, DtypeAndShapeErrors) {
  // Wrong dtype for x.
  auto d1 = Dataset::from_arrays(
      {{"x", "x64.npy", rows_f32(4, 3).cast(DType::i64)}, {"labels", "y.npy", labels_i64(4)}}, specs_xy(), {});
  ASSERT_FALSE(d1);
  EXPECT_NE(d1.message().find("x64.npy"), std::string::npos);
  EXPECT_NE(d1.message().find("expected dtype f32, got i64"), std::string::npos) << d1.message();
  // Wrong trailing dims.
  auto d2 = Dataset::from_arrays({{"x", "x5.npy", rows_f32(4, 5)}, {"labels", "y.npy", labels_i64(4)}}, specs_xy(), {});
  ASSERT_FALSE(d2);
  EXPECT_NE(d2.message().find("x5.npy"), std::string::npos);
  EXPECT_NE(d2.message().find("[4, 5]"), std::string::npos) << d2.message();
  // The first dim is the file's rows, not the graph's batch size (it read "[8, 3]").
  EXPECT_NE(d2.message().find("expected shape [rows, 3]"), std::string::npos) << d2.message();
  // A 1-D file for a 2-D input (it passed this check, its one dim taken for an
  // accumulation dim, and failed at step 1 without the file's name).
  auto d1d = Dataset::from_arrays(
      {{"x", "x1d.npy", rows_f32(4, 3).reshaped({12})}, {"labels", "y.npy", labels_i64(12)}}, specs_xy(), {});
  ASSERT_FALSE(d1d);
  EXPECT_NE(d1d.message().find("x1d.npy"), std::string::npos) << d1d.message();
  EXPECT_NE(d1d.message().find("got [12]"), std::string::npos) << d1d.message();
  // Different row counts.
  auto d3 = Dataset::from_arrays({{"x", "x.npy", rows_f32(4, 3)}, {"labels", "y5.npy", labels_i64(5)}}, specs_xy(), {});
  ASSERT_FALSE(d3);
  EXPECT_NE(d3.message().find("y5.npy"), std::string::npos) << d3.message();
  // Unknown input name, missing input.
  auto d4 = Dataset::from_arrays({{"input", "x.npy", rows_f32(4, 3)}}, specs_xy(), {});
  ASSERT_FALSE(d4);
  EXPECT_NE(d4.message().find("no data input 'input'"), std::string::npos) << d4.message();
  auto d5 = Dataset::from_arrays({{"x", "x.npy", rows_f32(4, 3)}}, specs_xy(), {});
  ASSERT_FALSE(d5);
  EXPECT_NE(d5.message().find("labels"), std::string::npos) << d5.message();
}

TEST(Data, OpensNpyFilesAndReportsMissingFile) {
  std::string dir = tmpdir("npy");
  ASSERT_TRUE(io::save_npy(dir + "/x.npy", rows_f32(6, 3)).is_ok());
  ASSERT_TRUE(io::save_npy(dir + "/y.npy", labels_i64(6).cast(DType::i32)).is_ok());
  auto ds = Dataset::open({"x=" + dir + "/x.npy", "labels=" + dir + "/y.npy"}, specs_xy(), {});
  ASSERT_TRUE(ds) << ds.message();
  EXPECT_EQ(ds->num_rows(), 6);
  auto missing = Dataset::open({"x=" + dir + "/nope.npy", "labels=" + dir + "/y.npy"}, specs_xy(), {});
  ASSERT_FALSE(missing);
  EXPECT_NE(missing.message().find("nope.npy"), std::string::npos) << missing.message();
  auto bad_spec = Dataset::open({dir + "/x.npy"}, specs_xy(), {});
  ASSERT_FALSE(bad_spec);
  EXPECT_NE(bad_spec.message().find("NAME=FILE.npy"), std::string::npos) << bad_spec.message();
  std::filesystem::remove_all(dir);
}

TEST(Data, TokenWindowsShiftLabelsByOne) {
  auto toks = std::make_shared<std::vector<uint16_t>>(1000);
  for (int i = 0; i < 1000; ++i) (*toks)[i] = static_cast<uint16_t>(i);
  std::vector<DataInputSpec> specs = {
      {"idx", DType::i64, ir::Shape({ir::Dim(std::string("batch")), ir::Dim(int64_t{16})})},
      {"labels", DType::i64, ir::Shape({ir::Dim(std::string("batch")), ir::Dim(int64_t{16})})}};
  auto ds = Dataset::from_tokens(toks, "train.bin", specs, {});
  ASSERT_TRUE(ds) << ds.message();
  EXPECT_EQ(ds->steps_per_epoch(4), 1000 / (4 * 16));  // n_tokens / (B*T)
  auto b = ds->train_batch(1, 0, 3, 4);
  ASSERT_TRUE(b) << b.message();
  const Tensor& x = b->at("idx");
  const Tensor& y = b->at("labels");
  ASSERT_EQ(x.dims(), (std::vector<int64_t>{4, 16}));
  for (int64_t r = 0; r < 4; ++r) {
    int64_t s = x.get_i64(r * 16);
    EXPECT_LE(s + 16, 999);
    for (int64_t t = 0; t < 16; ++t) {
      EXPECT_EQ(x.get_i64(r * 16 + t), s + t);
      EXPECT_EQ(y.get_i64(r * 16 + t), s + t + 1);
    }
  }
  auto again = ds->train_batch(1, 0, 3, 4);
  EXPECT_EQ(again->at("idx").to_i64_vector(), x.to_i64_vector());
  // Eval: sequential, bounded, the same every time.
  EXPECT_EQ(ds->num_eval_batches(4), std::min<int64_t>(20, (999 / 16) / 4));
  auto e0 = ds->eval_batch(0, 4);
  ASSERT_TRUE(e0);
  EXPECT_EQ(e0->at("idx").get_i64(0), 0);
  // Too-short file.
  auto small = std::make_shared<std::vector<uint16_t>>(10);
  EXPECT_FALSE(Dataset::from_tokens(small, "tiny.bin", specs, {}));
}

// A batch must have the graph input's rank and static dims (gradient accumulation
// multiplies the first dim; there is no extra leading accumulation dim).
TEST(Data, FitToInputChecksRankAndDims) {
  DataInputSpec spec{"x", DType::f32, ir::Shape({ir::Dim(int64_t{8}), ir::Dim(int64_t{3})})};
  auto r = fit_to_input(rows_f32(8, 3), spec);
  ASSERT_TRUE(r) << r.message();
  EXPECT_EQ(r->dims(), (std::vector<int64_t>{8, 3}));
  DataInputSpec spec3{"x", DType::f32, ir::Shape({ir::Dim(int64_t{2}), ir::Dim(int64_t{4}), ir::Dim(int64_t{3})})};
  auto bad = fit_to_input(rows_f32(8, 3), spec3);
  ASSERT_FALSE(bad);
  EXPECT_NE(bad.message().find("input 'x'"), std::string::npos);
  EXPECT_FALSE(fit_to_input(rows_f32(6, 3), spec));
}
