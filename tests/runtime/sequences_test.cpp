// Tests of runtime/sequences: the Megatron indexed dataset and JSONL readers against
// fixtures written by an independent writer (tools/prepare_data.py --test_fixtures
// tests/data/seq, numpy and struct; expected.json holds their rows), round trips through
// kiln's writers, and every refusal of malformed input (bytes crafted here), each one
// line naming the file and the sequence or line.
#include "runtime/sequences.h"

#include <gtest/gtest.h>
#include <unistd.h>

#include <cstring>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <optional>
#include <random>

#include "fuzz/harness.h"

namespace fs = std::filesystem;
using kiln::runtime::SequenceSet;
namespace rt = kiln::runtime;

namespace {

std::string fixture(const std::string& f) { return std::string(KILN_SOURCE_DIR) + "/tests/data/seq/" + f; }

std::string slurp(const std::string& path) {
  std::ifstream f(path, std::ios::binary);
  return std::string(std::istreambuf_iterator<char>(f), {});
}

std::vector<std::vector<int32_t>> expected_rows(const std::string& key) {
  const std::string text = slurp(fixture("expected.json"));
  EXPECT_FALSE(text.empty()) << "tests/data/seq/expected.json missing (tools/prepare_data.py --test_fixtures)";
  return nlohmann::json::parse(text).at(key).get<std::vector<std::vector<int32_t>>>();
}

std::vector<std::vector<int32_t>> rows_of(const SequenceSet& s) {
  std::vector<std::vector<int32_t>> out;
  for (int64_t i = 0; i < s.size(); ++i) out.emplace_back(s.row(i).begin(), s.row(i).end());
  return out;
}

std::vector<std::vector<int32_t>> label_rows_of(const SequenceSet& s) {
  std::vector<std::vector<int32_t>> out;
  for (int64_t i = 0; i < s.size(); ++i) out.emplace_back(s.row_labels(i).begin(), s.row_labels(i).end());
  return out;
}

SequenceSet make_set(const std::vector<std::vector<int32_t>>& rows,
                     const std::vector<std::vector<int32_t>>& labels = {}) {
  SequenceSet s;
  s.file = "made";
  for (size_t i = 0; i < rows.size(); ++i) {
    s.tokens.insert(s.tokens.end(), rows[i].begin(), rows[i].end());
    if (!labels.empty()) s.labels.insert(s.labels.end(), labels[i].begin(), labels[i].end());
    s.offsets.push_back(static_cast<int64_t>(s.tokens.size()));
  }
  return s;
}

template <typename T>
void put(std::string& out, T v) {
  char b[sizeof(T)];
  std::memcpy(b, &v, sizeof(T));
  out.append(b, sizeof(T));
}

// An .idx built field by field; counts default to the vectors' sizes.
struct Idx {
  std::string magic = std::string("MMIDIDX\0\0", 9);
  uint64_t version = 1;
  uint8_t code = 8;
  std::optional<uint64_t> count, doc_count;
  std::vector<int32_t> lengths;
  std::vector<int64_t> pointers;
  std::vector<int64_t> docs;
  std::string extra;

  std::string bytes() const {
    std::string out = magic;
    put(out, version);
    put(out, code);
    put<uint64_t>(out, count.value_or(lengths.size()));
    put<uint64_t>(out, doc_count.value_or(docs.size()));
    for (int32_t l : lengths) put(out, l);
    for (int64_t p : pointers) put(out, p);
    for (int64_t d : docs) put(out, d);
    return out + extra;
  }
};

// A valid uint16 index of two sequences: [1, 2, 3] and [4, 5] in a 10-byte .bin.
Idx two_u16() {
  Idx x;
  x.lengths = {3, 2};
  x.pointers = {0, 6};
  x.docs = {0, 1, 2};
  return x;
}
std::string two_u16_bin() {
  std::string b;
  for (uint16_t t : {1, 2, 3, 4, 5}) put(b, t);
  return b;
}

// The error of parsing (idx, bin) as prefix "d/x"; fails the test when it parses.
std::string idx_error(const std::string& idx, const std::string& bin) {
  auto r = rt::parse_indexed_dataset(idx, bin, "d/x");
  EXPECT_FALSE(r.has_value()) << "accepted";
  if (r.has_value()) return "";
  EXPECT_EQ(r.message().find('\n'), std::string::npos) << r.message();
  return r.message();
}

std::string jsonl_error(const std::string& text) {
  auto r = rt::parse_jsonl_dataset(text, "d/x.jsonl");
  EXPECT_FALSE(r.has_value()) << "accepted";
  if (r.has_value()) return "";
  EXPECT_EQ(r.message().find('\n'), std::string::npos) << r.message();
  return r.message();
}

class SequenceFiles : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = fs::temp_directory_path() / ("kiln_seq_test_" + std::to_string(getpid()) + "_" +
                                        ::testing::UnitTest::GetInstance()->current_test_info()->name());
    fs::create_directories(dir_);
  }
  void TearDown() override { fs::remove_all(dir_); }
  std::string tmp(const std::string& f) const { return (dir_ / f).string(); }
  void write(const std::string& path, const std::string& bytes) {
    std::ofstream f(path, std::ios::binary);
    f.write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
  }
  fs::path dir_;
};

}  // namespace

// ----------------------------------------------------------------------------- fixtures

TEST(SequenceFixtures, MegatronUint16ReadByEveryName) {
  const auto five = expected_rows("five");
  ASSERT_EQ(five.size(), 5u);
  for (const std::string name : {"five_u16", "five_u16.idx", "five_u16.bin"}) {
    auto s = rt::read_indexed_dataset(fixture(name));
    ASSERT_TRUE(s.has_value()) << s.message();
    EXPECT_EQ(rows_of(*s), five) << name;
    EXPECT_EQ(s->file, fixture("five_u16.idx"));
    EXPECT_TRUE(s->labels.empty());
    EXPECT_TRUE(rt::check_sequence_set(*s).is_ok());
  }
  auto s = rt::read_indexed_dataset(fixture("five_u16"));
  ASSERT_TRUE(s.has_value());
  EXPECT_EQ(s->size(), 5);
  EXPECT_EQ(s->length(3), 0);  // an empty row is read as such
  EXPECT_EQ(s->max_length(), 8);
  EXPECT_EQ(s->length_histogram(), (std::map<int64_t, int64_t>{{0, 1}, {1, 1}, {3, 1}, {6, 1}, {8, 1}}));
  EXPECT_EQ(s->row_name(3), "sequence 3");
}

TEST(SequenceFixtures, MegatronInt32) {
  auto s = rt::read_sequence_dataset(fixture("wide_i32.idx"));
  ASSERT_TRUE(s.has_value()) << s.message();
  EXPECT_EQ(rows_of(*s), expected_rows("wide"));
  EXPECT_EQ(s->max_length(), 4);
}

TEST(SequenceFixtures, Jsonl) {
  auto s = rt::read_jsonl_dataset(fixture("five.jsonl"));
  ASSERT_TRUE(s.has_value()) << s.message();
  EXPECT_EQ(rows_of(*s), expected_rows("five"));
  EXPECT_TRUE(s->labels.empty());
  EXPECT_EQ(s->lines, (std::vector<int64_t>{1, 2, 3, 4, 5}));
  EXPECT_EQ(s->file, fixture("five.jsonl"));
}

TEST(SequenceFixtures, JsonlWithLabelsCrLfAndABlankLine) {
  auto s = rt::read_sequence_dataset(fixture("five_labels.jsonl"));
  ASSERT_TRUE(s.has_value()) << s.message();
  EXPECT_EQ(rows_of(*s), expected_rows("five"));
  EXPECT_EQ(label_rows_of(*s), expected_rows("five_labels"));
  const auto lines = nlohmann::json::parse(slurp(fixture("expected.json"))).at("five_labels_lines");
  EXPECT_EQ(s->lines, lines.get<std::vector<int64_t>>());
  EXPECT_EQ(s->row_name(2), "line 4");
  EXPECT_TRUE(rt::check_sequence_set(*s).is_ok());
}

// kiln's writer produces the independent writer's bytes (.bin exactly; .idx up to the
// document indices: the fixture groups rows into documents, kiln writes one per row).
TEST(SequenceFixtures, WriterMatchesTheIndependentWriter) {
  for (const auto& [name, key] : {std::pair<std::string, std::string>{"five_u16", "five"}, {"wide_i32", "wide"}}) {
    const auto rows = expected_rows(key);
    auto enc = rt::encode_indexed_dataset(make_set(rows));
    ASSERT_TRUE(enc.has_value()) << enc.message();
    EXPECT_EQ(enc->second, slurp(fixture(name + ".bin"))) << name;
    const size_t head = 34 + 12 * rows.size();
    const std::string idx = slurp(fixture(name + ".idx"));
    ASSERT_GE(idx.size(), head);
    EXPECT_EQ(enc->first.substr(0, 26), idx.substr(0, 26)) << name << ": magic, version, dtype, sequence count";
    EXPECT_EQ(enc->first.substr(34, head - 34), idx.substr(34, head - 34)) << name << ": lengths and pointers";
  }
}

// ----------------------------------------------------------------------------- round trips

TEST_F(SequenceFiles, RoundTripBothFormats) {
  std::mt19937_64 rng(7);
  for (int32_t max_id : {255, 65499, 65500, 2147483647}) {
    std::vector<std::vector<int32_t>> rows, labels;
    for (int i = 0; i < 40; ++i) {
      std::vector<int32_t> r(rng() % 20), l;
      for (auto& t : r) {
        t = static_cast<int32_t>(rng() % (static_cast<uint64_t>(max_id) + 1));
        l.push_back(rng() % 3 == 0 ? -100 : t);
      }
      rows.push_back(r);
      labels.push_back(l);
    }
    rows[3].push_back(max_id);
    labels[3].push_back(-100);
    SequenceSet s = make_set(rows);
    ASSERT_TRUE(rt::write_indexed_dataset(s, tmp("rt")).is_ok());
    EXPECT_FALSE(fs::exists(tmp("rt.idx.tmp")));
    EXPECT_EQ(static_cast<uint8_t>(slurp(tmp("rt.idx"))[17]), max_id < 65500 ? 8 : 4)
        << "dtype code, max id " << max_id;
    auto back = rt::read_sequence_dataset(tmp("rt"));
    ASSERT_TRUE(back.has_value()) << back.message();
    EXPECT_EQ(back->offsets, s.offsets);
    EXPECT_EQ(back->tokens, s.tokens);

    SequenceSet sl = make_set(rows, labels);
    ASSERT_TRUE(rt::write_jsonl_dataset(sl, tmp("rt.jsonl")).is_ok());
    auto jb = rt::read_sequence_dataset(tmp("rt.jsonl"));
    ASSERT_TRUE(jb.has_value()) << jb.message();
    EXPECT_EQ(jb->offsets, sl.offsets);
    EXPECT_EQ(jb->tokens, sl.tokens);
    EXPECT_EQ(jb->labels, sl.labels);
    EXPECT_EQ(jb->size(), 40);
  }
}

TEST(SequenceWriters, RefuseWhatTheyCannotWrite) {
  SequenceSet s = make_set({{1, 2}, {3}}, {{1, -100}, {3}});
  auto e = rt::encode_indexed_dataset(s);
  ASSERT_FALSE(e.has_value());
  EXPECT_NE(e.message().find("holds no labels"), std::string::npos) << e.message();
  EXPECT_TRUE(rt::encode_jsonl_dataset(s).has_value());

  SequenceSet neg = make_set({{1, 2}, {3, -4}});
  auto n = rt::encode_jsonl_dataset(neg);
  ASSERT_FALSE(n.has_value());
  EXPECT_EQ(n.message(), "made: sequence 1: token 1 is negative (-4)");

  SequenceSet bad_label = make_set({{1, 2}}, {{1, -5}});
  EXPECT_FALSE(rt::check_sequence_set(bad_label).is_ok());
  SequenceSet ragged = make_set({{1, 2}, {3}});
  ragged.offsets.back() = 2;
  EXPECT_FALSE(rt::check_sequence_set(ragged).is_ok());
  ragged.offsets = {0, 2, 1, 3};
  EXPECT_FALSE(rt::check_sequence_set(ragged).is_ok());
  SequenceSet empty;
  EXPECT_TRUE(rt::check_sequence_set(empty).is_ok());
  EXPECT_EQ(empty.size(), 0);
  EXPECT_EQ(empty.max_length(), 0);
}

// ----------------------------------------------------------------------------- dispatch

TEST_F(SequenceFiles, IsSequenceDatasetAndDispatch) {
  EXPECT_TRUE(rt::is_sequence_dataset("a/b.jsonl"));
  EXPECT_TRUE(rt::is_sequence_dataset("a/b.idx"));
  EXPECT_FALSE(rt::is_sequence_dataset("a/b.npy"));
  EXPECT_FALSE(rt::is_sequence_dataset(tmp("tokens.bin")));  // no .idx beside it: a nanoGPT token file
  write(tmp("tokens.bin"), two_u16_bin());
  EXPECT_FALSE(rt::is_sequence_dataset(tmp("tokens.bin")));
  write(tmp("tokens.idx"), two_u16().bytes());
  EXPECT_TRUE(rt::is_sequence_dataset(tmp("tokens.bin")));
  for (const std::string name : {"tokens", "tokens.bin", "tokens.idx"}) {
    auto s = rt::read_sequence_dataset(tmp(name));
    ASSERT_TRUE(s.has_value()) << name << ": " << s.message();
    EXPECT_EQ(rows_of(*s), (std::vector<std::vector<int32_t>>{{1, 2, 3}, {4, 5}}));
  }
  auto none = rt::read_sequence_dataset(tmp("other.txt"));
  ASSERT_FALSE(none.has_value());
  EXPECT_EQ(none.message().rfind(tmp("other.txt") + ": not a variable-length dataset", 0), 0u) << none.message();
  auto missing = rt::read_sequence_dataset(tmp("missing.jsonl"));
  ASSERT_FALSE(missing.has_value());
  EXPECT_NE(missing.message().find(tmp("missing.jsonl")), std::string::npos) << missing.message();
  auto no_bin = rt::read_indexed_dataset(tmp("lonely.idx"));
  ASSERT_FALSE(no_bin.has_value());
  write(tmp("lonely.idx"), two_u16().bytes());
  no_bin = rt::read_indexed_dataset(tmp("lonely.idx"));
  ASSERT_FALSE(no_bin.has_value());
  EXPECT_NE(no_bin.message().find(tmp("lonely.bin")), std::string::npos) << no_bin.message();
}

TEST_F(SequenceFiles, TruncatedBinNamesTheFileAndSequence) {
  write(tmp("t.idx"), two_u16().bytes());
  write(tmp("t.bin"), two_u16_bin().substr(0, 9));
  auto s = rt::read_indexed_dataset(tmp("t.bin"));
  ASSERT_FALSE(s.has_value());
  EXPECT_EQ(s.message(), tmp("t.idx") + ": sequence 1 ends at byte 10 beyond the .bin's 9 bytes");
}

// ----------------------------------------------------------------------------- indexed errors

TEST(SequenceIndexedErrors, Header) {
  const std::string bin = two_u16_bin();
  EXPECT_TRUE(rt::parse_indexed_dataset(two_u16().bytes(), bin, "d/x").has_value());
  Idx bad = two_u16();
  bad.magic = "MMIDIDY\0\0";
  bad.magic.resize(9);
  EXPECT_EQ(idx_error(bad.bytes(), bin), "d/x.idx: not a Megatron indexed dataset index (no MMIDIDX magic)");
  EXPECT_EQ(idx_error("", bin), "d/x.idx: truncated header (0 bytes, the MMIDIDX header has 34)");
  EXPECT_EQ(idx_error(two_u16().bytes().substr(0, 20), bin),
            "d/x.idx: truncated header (20 bytes, the MMIDIDX header has 34)");
  EXPECT_EQ(idx_error("MMID", bin), "d/x.idx: truncated header (4 bytes, the MMIDIDX header has 34)");
  Idx v = two_u16();
  v.version = 2;
  EXPECT_EQ(idx_error(v.bytes(), bin), "d/x.idx: index version 2, only version 1 is supported");
  Idx f = two_u16();
  f.code = 7;
  EXPECT_EQ(idx_error(f.bytes(), bin), "d/x.idx: dtype float32 (code 7) holds no token ids");
  f.code = 6;
  EXPECT_EQ(idx_error(f.bytes(), bin), "d/x.idx: dtype float64 (code 6) holds no token ids");
  f.code = 9;
  EXPECT_NE(idx_error(f.bytes(), bin).find("d/x.idx: unknown dtype code 9"), std::string::npos);
  f.code = 0;
  EXPECT_NE(idx_error(f.bytes(), bin).find("d/x.idx: unknown dtype code 0"), std::string::npos);
}

TEST(SequenceIndexedErrors, CountsCheckedAgainstTheFileSize) {
  const std::string bin = two_u16_bin();
  Idx c = two_u16();
  c.count = uint64_t{1} << 40;  // would allocate terabytes if believed
  EXPECT_EQ(idx_error(c.bytes(), bin),
            "d/x.idx: sequence count 1099511627776 needs 13194139533312 bytes of lengths and pointers, the file "
            "has 48 after its header");
  c.count = UINT64_MAX;
  EXPECT_NE(idx_error(c.bytes(), bin).find("sequence count 18446744073709551615 needs more bytes"), std::string::npos);
  c.count = 3;  // 36 bytes of lengths and pointers exist (24 + 24 in the file), but no documents
  EXPECT_NE(idx_error(c.bytes(), bin).find("document count 3 needs 24 bytes of document indices, the file has 12"),
            std::string::npos);
  Idx d = two_u16();
  d.doc_count = UINT64_MAX;
  EXPECT_NE(idx_error(d.bytes(), bin).find("document count 18446744073709551615 needs more bytes"), std::string::npos);
  Idx t = two_u16();
  t.extra = "abc";
  EXPECT_EQ(idx_error(t.bytes(), bin),
            "d/x.idx: 3 bytes after the document indices (expected none, or 2 sequence modes of a multimodal index)");
  t.extra = std::string("\1\0", 2);  // one mode per sequence: a multimodal index
  EXPECT_TRUE(rt::parse_indexed_dataset(t.bytes(), bin, "d/x").has_value());
  Idx none;
  none.docs = {0};
  EXPECT_EQ(idx_error(none.bytes(), ""), "d/x.idx: no sequences");
}

TEST(SequenceIndexedErrors, SequencesOutsideTheBin) {
  const std::string bin = two_u16_bin();
  Idx x = two_u16();
  x.lengths = {3, -1};
  EXPECT_EQ(idx_error(x.bytes(), bin), "d/x.idx: sequence 1 has a negative length (-1)");
  x = two_u16();
  x.pointers = {-2, 6};
  EXPECT_EQ(idx_error(x.bytes(), bin), "d/x.idx: sequence 0 starts at a negative byte offset (-2)");
  x = two_u16();
  x.pointers = {0, 8};
  EXPECT_EQ(idx_error(x.bytes(), bin), "d/x.idx: sequence 1 ends at byte 12 beyond the .bin's 10 bytes");
  x.pointers = {0, INT64_MAX};
  EXPECT_EQ(idx_error(x.bytes(), bin),
            "d/x.idx: sequence 1 ends at byte 9223372036854775811 beyond the .bin's 10 bytes");
  x = two_u16();
  x.lengths = {3, INT32_MAX};
  EXPECT_EQ(idx_error(x.bytes(), bin), "d/x.idx: sequence 1 ends at byte 4294967300 beyond the .bin's 10 bytes");
  x = two_u16();
  x.pointers = {0, 0};  // the second overlaps the first: 14 bytes claimed of 10
  x.lengths = {5, 2};
  EXPECT_EQ(idx_error(x.bytes(), bin),
            "d/x.idx: sequences 0..1 hold 14 bytes together, more than the .bin's 10 (overlapping sequences)");
}

TEST(SequenceIndexedErrors, DocumentIndices) {
  const std::string bin = two_u16_bin();
  Idx x = two_u16();
  x.docs = {0, 3};
  EXPECT_EQ(idx_error(x.bytes(), bin), "d/x.idx: document index 1 is 3, outside [0, 2]");
  x.docs = {-1};
  EXPECT_EQ(idx_error(x.bytes(), bin), "d/x.idx: document index 0 is -1, outside [0, 2]");
  x.docs = {0, 2, 1};
  EXPECT_EQ(idx_error(x.bytes(), bin), "d/x.idx: document indices decrease at entry 2 (2 then 1)");
  x.docs = {};  // no documents at all: accepted (rows are the sequences)
  EXPECT_TRUE(rt::parse_indexed_dataset(x.bytes(), bin, "d/x").has_value());
}

TEST(SequenceIndexedErrors, TokenValues) {
  Idx x;
  x.code = 3;  // int16
  x.lengths = {1, 2};
  x.pointers = {0, 2};
  x.docs = {0, 2};
  std::string bin;
  for (int16_t t : {7, 8, -1}) put(bin, t);
  EXPECT_EQ(idx_error(x.bytes(), bin), "d/x.bin: sequence 1: token 1 is negative (-1)");
  x.code = 5;  // int64
  x.pointers = {0, 8};
  bin.clear();
  for (int64_t t : {int64_t{7}, int64_t{8}, int64_t{1} << 31}) put(bin, t);
  EXPECT_EQ(idx_error(x.bytes(), bin), "d/x.bin: sequence 1: token 1 is 2147483648, above int32's range");
  bin.clear();
  for (int64_t t : {int64_t{7}, int64_t{8}, int64_t{INT32_MAX}}) put(bin, t);
  auto ok = rt::parse_indexed_dataset(x.bytes(), bin, "d/x");
  ASSERT_TRUE(ok.has_value()) << ok.message();
  EXPECT_EQ(ok->tokens, (std::vector<int32_t>{7, 8, INT32_MAX}));
  x.code = 1;  // uint8: every value is an id
  x.pointers = {0, 1};
  auto u8 = rt::parse_indexed_dataset(x.bytes(), std::string("\xff\x00\x80", 3), "d/x");
  ASSERT_TRUE(u8.has_value()) << u8.message();
  EXPECT_EQ(u8->tokens, (std::vector<int32_t>{255, 0, 128}));
  x.code = 2;  // int8
  EXPECT_EQ(idx_error(x.bytes(), std::string("\x01\x02\x80", 3)), "d/x.bin: sequence 1: token 1 is negative (-128)");
}

// ----------------------------------------------------------------------------- JSONL errors

TEST(SequenceJsonlErrors, Lines) {
  const std::string ok1 = "{\"input_ids\": [1, 2]}\n";
  EXPECT_TRUE(rt::parse_jsonl_dataset(ok1 + ok1, "d/x.jsonl").has_value());
  EXPECT_TRUE(rt::parse_jsonl_dataset("{\"input_ids\": [1, 2]}", "d/x.jsonl").has_value());  // no final newline
  const std::string broken = jsonl_error(ok1 + ok1 + "{\"input_ids\": [1,\n");
  EXPECT_EQ(broken.rfind("d/x.jsonl: line 3: not valid JSON (", 0), 0u) << broken;
  EXPECT_EQ(broken.back(), ')') << broken;
  EXPECT_EQ(jsonl_error(ok1 + "[1, 2]\n"), "d/x.jsonl: line 2: not a JSON object ([1,2])");
  EXPECT_EQ(jsonl_error(ok1 + "{\"ids\": [1]}\n"), "d/x.jsonl: line 2: no 'input_ids'");
  EXPECT_EQ(jsonl_error("\n\n" + ok1 + "{} {}\n").rfind("d/x.jsonl: line 4: not valid JSON", 0), 0u);
  EXPECT_EQ(jsonl_error(ok1 + std::string(200, '[') + std::string(200, ']') + "\n"),
            "d/x.jsonl: line 2: not valid JSON (JSON nested more than 100 levels deep)");
}

TEST(SequenceJsonlErrors, InputIds) {
  const std::string ok1 = "{\"input_ids\": [1, 2]}\n";
  EXPECT_EQ(jsonl_error(ok1 + ok1 + ok1 + ok1 + ok1 + ok1 + ok1 + ok1 + ok1 + ok1 + ok1 + "{\"input_ids\": 5}\n"),
            "d/x.jsonl: line 12: 'input_ids' is not a list of integers (5)");
  EXPECT_EQ(jsonl_error("{\"input_ids\": [1, 2.5]}\n"),
            "d/x.jsonl: line 1: 'input_ids' is not a list of integers ('input_ids'[1] is 2.5)");
  EXPECT_EQ(jsonl_error("{\"input_ids\": [1, \"2\"]}\n"),
            "d/x.jsonl: line 1: 'input_ids' is not a list of integers ('input_ids'[1] is \"2\")");
  EXPECT_EQ(jsonl_error("{\"input_ids\": [1, 1e30]}\n"),
            "d/x.jsonl: line 1: 'input_ids' is not a list of integers ('input_ids'[1] is 1e+30)");
  EXPECT_EQ(jsonl_error("{\"input_ids\": [3, -1]}\n"), "d/x.jsonl: line 1: 'input_ids'[1] is negative (-1)");
  EXPECT_EQ(jsonl_error("{\"input_ids\": [2147483648]}\n"),
            "d/x.jsonl: line 1: 'input_ids'[0] is 2147483648, above int32's range");
  EXPECT_EQ(jsonl_error("{\"input_ids\": [18446744073709551615]}\n"),
            "d/x.jsonl: line 1: 'input_ids'[0] is 18446744073709551615, above int32's range");
  EXPECT_EQ(jsonl_error("{\"input_ids\": [-9223372036854775808]}\n"),
            "d/x.jsonl: line 1: 'input_ids'[0] is negative (-9223372036854775808)");
  auto max = rt::parse_jsonl_dataset("{\"input_ids\": [2147483647, 0]}", "d/x.jsonl");
  ASSERT_TRUE(max.has_value()) << max.message();
  EXPECT_EQ(max->tokens, (std::vector<int32_t>{INT32_MAX, 0}));
  auto empty_row = rt::parse_jsonl_dataset("{\"input_ids\": []}", "d/x.jsonl");
  ASSERT_TRUE(empty_row.has_value()) << empty_row.message();
  EXPECT_EQ(empty_row->size(), 1);
  EXPECT_EQ(empty_row->length(0), 0);
}

TEST(SequenceJsonlErrors, Labels) {
  EXPECT_EQ(jsonl_error("{\"input_ids\": [1], \"labels\": [1]}\n\n"
                        "{\"input_ids\": [1, 2, 3, 4, 5, 6], \"labels\": [1, 2, 3, 4, 5]}\n"),
            "d/x.jsonl: line 3: 'labels' has 5 entries, 'input_ids' 6");
  EXPECT_EQ(jsonl_error("{\"input_ids\": [1, 2], \"labels\": [-100, -5]}\n"),
            "d/x.jsonl: line 1: 'labels'[1] is negative (-5) and not -100, the ignore index");
  EXPECT_EQ(jsonl_error("{\"input_ids\": [1], \"labels\": [2147483648]}\n"),
            "d/x.jsonl: line 1: 'labels'[0] is 2147483648, above int32's range");
  EXPECT_EQ(jsonl_error("{\"input_ids\": [1], \"labels\": \"x\"}\n"),
            "d/x.jsonl: line 1: 'labels' is not a list of integers (\"x\")");
  EXPECT_EQ(jsonl_error("{\"input_ids\": [1], \"labels\": [1]}\n{\"input_ids\": [1]}\n"),
            "d/x.jsonl: line 2: no 'labels', but line 1 has them");
  EXPECT_EQ(jsonl_error("\n{\"input_ids\": [1]}\n{\"input_ids\": [1], \"labels\": [1]}\n"),
            "d/x.jsonl: line 3: has 'labels', but line 2 has none");
  auto null_labels = rt::parse_jsonl_dataset("{\"input_ids\": [1], \"labels\": null}", "d/x.jsonl");
  ASSERT_TRUE(null_labels.has_value()) << null_labels.message();
  EXPECT_TRUE(null_labels->labels.empty());
}

TEST(SequenceJsonlErrors, NoSequences) {
  EXPECT_EQ(jsonl_error(""), "d/x.jsonl: no sequences");
  EXPECT_EQ(jsonl_error("\n  \n\r\n\t\n"), "d/x.jsonl: no sequences");
}

// ----------------------------------------------------------------------------- fuzz harness

TEST(SequenceFuzzHarness, ReadsBothFormatsAndTheSeeds) {
  for (const std::string name : {"five_u16", "wide_i32"}) {
    const std::string input =
        kiln::fuzz::wrap_indexed_dataset(slurp(fixture(name + ".idx")), slurp(fixture(name + ".bin")));
    EXPECT_TRUE(kiln::fuzz::run_target("sequences", input).is_ok()) << name;
    EXPECT_EQ(slurp(std::string(KILN_SOURCE_DIR) + "/fuzz/seeds/sequences/" + name + ".indexed"), input) << name;
  }
  EXPECT_TRUE(kiln::fuzz::run_target("sequences", slurp(fixture("five_labels.jsonl"))).is_ok());
  EXPECT_FALSE(kiln::fuzz::run_target("sequences", "I\x05").is_ok());  // too short to be indexed: JSONL, invalid
  const kiln::Status s = kiln::fuzz::run_target("sequences", kiln::fuzz::wrap_indexed_dataset("MMIDIDX", ""));
  ASSERT_FALSE(s.is_ok());
  EXPECT_EQ(s.message(), "fuzz.idx: truncated header (7 bytes, the MMIDIDX header has 34)");
}
