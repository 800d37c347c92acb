// TensorBoard event records (runtime/tensorboard.h): CRC32C, TFRecord framing, tags.
#include "runtime/tensorboard.h"

#include <gtest/gtest.h>
#include <unistd.h>

#include <cstring>
#include <filesystem>
#include <fstream>
#include <sstream>

using namespace kiln;

namespace {

TEST(TensorBoard, Crc32cOfTheCheckString) {
  EXPECT_EQ(runtime::crc32c("123456789", 9), 0xE3069283u);  // the CRC-32C check value
  EXPECT_EQ(runtime::crc32c("", 0), 0u);
  const uint32_t c = runtime::crc32c("abc", 3);
  EXPECT_EQ(runtime::masked_crc32c("abc", 3), ((c >> 15) | (c << 17)) + 0xa282ead8u);
}

TEST(TensorBoard, TagsAsHuggingFaceRewritesThem) {
  EXPECT_EQ(runtime::tensorboard_tag("loss"), "train/loss");
  EXPECT_EQ(runtime::tensorboard_tag("eval_loss"), "eval/loss");
  EXPECT_EQ(runtime::tensorboard_tag("eval_accuracy"), "eval/accuracy");
  EXPECT_EQ(runtime::tensorboard_tag("train_runtime"), "train/train_runtime");
  const std::string d = runtime::default_logging_dir("out");
  EXPECT_EQ(d.rfind("out/runs/", 0), 0u) << d;
}

TEST(TensorBoard, RecordsAreFramedWithMaskedCrcs) {
  const std::string dir =
      (std::filesystem::temp_directory_path() / ("kiln_tb_unit_" + std::to_string(::getpid()))).string();
  std::filesystem::remove_all(dir);
  runtime::TensorBoardWriter w;
  ASSERT_TRUE(w.open(dir + "/a/b").ok());
  ASSERT_TRUE(w.write_scalars(7, {{"train/loss", 0.0}}).ok());
  std::ifstream f(w.path(), std::ios::binary);
  std::stringstream ss;
  ss << f.rdbuf();
  const std::string bytes = ss.str();
  size_t pos = 0;
  int records = 0;
  while (pos < bytes.size()) {
    ASSERT_LE(pos + 12, bytes.size());
    uint64_t len = 0;
    std::memcpy(&len, bytes.data() + pos, 8);
    uint32_t len_crc = 0, data_crc = 0;
    std::memcpy(&len_crc, bytes.data() + pos + 8, 4);
    EXPECT_EQ(len_crc, runtime::masked_crc32c(bytes.data() + pos, 8));
    ASSERT_LE(pos + 12 + len + 4, bytes.size());
    std::memcpy(&data_crc, bytes.data() + pos + 12 + len, 4);
    EXPECT_EQ(data_crc, runtime::masked_crc32c(bytes.data() + pos + 12, len));
    if (records == 0) {
      EXPECT_NE(bytes.substr(pos + 12, len).find("brain.Event:2"), std::string::npos);
    }
    // A 0.0 scalar is still written (simple_value is in a oneof): tag 0x15 and four zero bytes.
    if (records == 1) {
      EXPECT_NE(bytes.substr(pos + 12, len).find(std::string("\x15\0\0\0\0", 5)), std::string::npos);
    }
    pos += 12 + len + 4;
    ++records;
  }
  EXPECT_EQ(records, 2);
  std::filesystem::remove_all(dir);
}

}  // namespace
