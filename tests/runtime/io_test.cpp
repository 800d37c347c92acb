// Tests of runtime/io: .npy files written by numpy (tests/data/npy, made by make_npy.py),
// safetensors files written by tools/make_fixtures.py, round trips for every dtype,
// malformed files (errors naming the file, never crashes) and token-window sampling.
#include "runtime/io.h"

#include <gtest/gtest.h>
#include <unistd.h>

#include <cmath>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <random>
#include <set>

namespace fs = std::filesystem;
using kiln::ir::DType;
using kiln::ir::Tensor;
namespace io = kiln::runtime::io;

namespace {

std::string npy(const std::string& f) { return std::string(KILN_SOURCE_DIR) + "/tests/data/npy/" + f; }

class IoTest : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = fs::temp_directory_path() / ("kiln_io_test_" + std::to_string(getpid()) + "_" +
                                        ::testing::UnitTest::GetInstance()->current_test_info()->name());
    fs::create_directories(dir_);
  }
  void TearDown() override { fs::remove_all(dir_); }
  std::string tmp(const std::string& f) const { return (dir_ / f).string(); }
  void write_bytes(const std::string& path, const std::string& bytes) {
    std::ofstream f(path, std::ios::binary);
    f.write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
  }
  std::string read_bytes(const std::string& path) {
    std::ifstream f(path, std::ios::binary);
    return std::string(std::istreambuf_iterator<char>(f), {});
  }
  fs::path dir_;
};

// Fills t (any dtype) with a deterministic pattern that every dtype can hold exactly.
Tensor pattern(DType dt, std::vector<int64_t> dims) {
  Tensor t(dt, dims);
  for (int64_t i = 0; i < t.numel(); ++i) {
    double v = (dt == DType::boolean) ? (i % 3 == 0) : (dt == DType::u8 ? i % 200 : (i % 17) - 8);
    if (kiln::ir::is_float(dt)) v *= 0.25;
    t.set_f64(i, v);
  }
  return t;
}

void expect_same(const Tensor& a, const Tensor& b) {
  ASSERT_EQ(a.dtype(), b.dtype());
  ASSERT_EQ(a.dims(), b.dims());
  ASSERT_EQ(a.nbytes(), b.nbytes());
  EXPECT_EQ(0, std::memcmp(a.raw(), b.raw(), a.nbytes()));
}

}  // namespace

// ----------------------------------------------------------------------------- .npy
TEST_F(IoTest, NpyReadsNumpyFilesOfEveryDtype) {
  // make_npy.py: arange(6).reshape(2,3); floats * 0.5 - 1; bool = i % 2 == 1.
  struct Case {
    const char* file;
    DType dt;
  };
  for (Case c : {Case{"good_f4.npy", DType::f32}, Case{"good_f8.npy", DType::f64}, Case{"good_f2.npy", DType::f16},
                 Case{"good_i8.npy", DType::i64}, Case{"good_i4.npy", DType::i32}, Case{"good_i1.npy", DType::i8},
                 Case{"good_u1.npy", DType::u8}, Case{"good_b1.npy", DType::boolean}}) {
    SCOPED_TRACE(c.file);
    auto t = io::load_npy(npy(c.file));
    ASSERT_TRUE(t.has_value()) << t.message();
    EXPECT_EQ(t->dtype(), c.dt);
    EXPECT_EQ(t->dims(), (std::vector<int64_t>{2, 3}));
    for (int64_t i = 0; i < 6; ++i) {
      double want = kiln::ir::is_float(c.dt) ? i * 0.5 - 1 : (c.dt == DType::boolean ? i % 2 : i);
      EXPECT_EQ(t->get_f64(i), want) << "element " << i;
    }
  }
}

TEST_F(IoTest, NpyScalarEmptyVectorAndVersion2) {
  auto s = io::load_npy(npy("scalar_f8.npy"));
  ASSERT_TRUE(s.has_value()) << s.message();
  EXPECT_EQ(s->rank(), 0);
  EXPECT_EQ(s->get_f64(0), 3.25);
  auto e = io::load_npy(npy("empty_f4.npy"));
  ASSERT_TRUE(e.has_value()) << e.message();
  EXPECT_EQ(e->dims(), (std::vector<int64_t>{0, 3}));
  auto v = io::load_npy(npy("vec_i8.npy"));
  ASSERT_TRUE(v.has_value()) << v.message();
  EXPECT_EQ(v->to_i64_vector(), (std::vector<int64_t>{-5, 7, int64_t{1} << 40}));
  auto v2 = io::load_npy(npy("v2_f4.npy"));
  ASSERT_TRUE(v2.has_value()) << v2.message();
  EXPECT_EQ(v2->dims(), (std::vector<int64_t>{2, 3}));
  EXPECT_EQ(v2->get_f64(5), 1.5);
}

TEST_F(IoTest, NpyWriterMatchesNumpyByteForByte) {
  // numpy 1.24's np.save output for the same arrays (header padded to 64 bytes).
  for (const char* f : {"good_f4.npy", "good_i8.npy", "good_b1.npy", "scalar_f8.npy", "vec_i8.npy", "empty_f4.npy"}) {
    SCOPED_TRACE(f);
    auto t = io::load_npy(npy(f));
    ASSERT_TRUE(t.has_value()) << t.message();
    ASSERT_TRUE(io::save_npy(tmp("out.npy"), *t).is_ok());
    EXPECT_EQ(read_bytes(tmp("out.npy")), read_bytes(npy(f)));
  }
}

TEST_F(IoTest, NpyRoundTripEveryDtype) {
  for (DType dt : {DType::f32, DType::f64, DType::f16, DType::i64, DType::i32, DType::i8, DType::u8, DType::boolean}) {
    for (auto dims :
         {std::vector<int64_t>{}, std::vector<int64_t>{7}, std::vector<int64_t>{3, 0}, std::vector<int64_t>{2, 3, 5}}) {
      SCOPED_TRACE(std::string(kiln::ir::dtype_name(dt)) + " " + kiln::ir::dims_to_string(dims));
      Tensor t = pattern(dt, dims);
      ASSERT_TRUE(io::save_npy(tmp("rt.npy"), t).is_ok());
      EXPECT_FALSE(fs::exists(tmp("rt.npy.tmp")));
      auto back = io::load_npy(tmp("rt.npy"));
      ASSERT_TRUE(back.has_value()) << back.message();
      expect_same(*back, t);
    }
  }
  // A header longer than 65535 bytes needs format 2.0.
  Tensor big(DType::u8, std::vector<int64_t>(25000, 1));
  ASSERT_TRUE(io::save_npy(tmp("big.npy"), big).is_ok());
  EXPECT_EQ(read_bytes(tmp("big.npy"))[6], 2);
  auto back = io::load_npy(tmp("big.npy"));
  ASSERT_TRUE(back.has_value()) << back.message();
  EXPECT_EQ(back->rank(), 25000);
}

TEST_F(IoTest, NpyShapeReadsTheHeaderOnly) {
  // The files written by numpy (make_npy.py): each header's shape, version 1 and 2, and the
  // shape of a file whose data is truncated (only the header is read).
  struct Case {
    const char* file;
    std::vector<int64_t> dims;
  };
  for (const Case& c : {Case{"good_f4.npy", {2, 3}}, Case{"v2_f4.npy", {2, 3}}, Case{"scalar_f8.npy", {}},
                        Case{"empty_f4.npy", {0, 3}}, Case{"vec_i8.npy", {3}}}) {
    SCOPED_TRACE(c.file);
    auto d = io::npy_shape(npy(c.file));
    ASSERT_TRUE(d.has_value()) << d.message();
    EXPECT_EQ(*d, c.dims);
    auto t = io::load_npy(npy(c.file));  // the reference: the whole file's tensor
    ASSERT_TRUE(t.has_value()) << t.message();
    EXPECT_EQ(*d, t->dims());
  }
  EXPECT_TRUE(io::npy_shape(npy("bad_truncated.npy")).has_value());
  for (const char* f : {"bad_magic.npy", "bad_short.npy", "bad_header.npy", "does_not_exist.npy"}) {
    auto d = io::npy_shape(npy(f));
    ASSERT_FALSE(d.has_value()) << f;
    EXPECT_NE(d.message().find(f), std::string::npos) << d.message();
  }
}

TEST_F(IoTest, NpyErrorsNameTheFileAndTheProblem) {
  struct Case {
    const char* file;
    const char* needle;
  };
  for (Case c : {Case{"bad_fortran.npy", "fortran_order"}, Case{"bad_bigendian.npy", "big-endian"},
                 Case{"bad_u2.npy", "unsupported .npy dtype '<u2'"}, Case{"bad_truncated.npy", "truncated"},
                 Case{"bad_trailing.npy", "bytes after the data"}, Case{"bad_magic.npy", "bad magic"},
                 Case{"bad_header.npy", "no 'shape'"}, Case{"bad_short.npy", "bad magic"},
                 Case{"does_not_exist.npy", "cannot open"}}) {
    SCOPED_TRACE(c.file);
    auto t = io::load_npy(npy(c.file));
    ASSERT_FALSE(t.has_value());
    EXPECT_NE(t.message().find(c.file), std::string::npos) << t.message();
    EXPECT_NE(t.message().find(c.needle), std::string::npos) << t.message();
  }
  auto st = io::save_npy(tmp("x.npy"), Tensor(DType::bf16, {2}));
  EXPECT_FALSE(st.is_ok());
  EXPECT_NE(st.message().find("bf16"), std::string::npos);
  EXPECT_FALSE(io::save_npy(tmp("no_such_dir/x.npy"), Tensor(DType::f32, {2})).is_ok());
}

TEST_F(IoTest, NpyGarbageNeverCrashes) {
  // Every prefix of a valid file, and random byte flips in the header, give an error or
  // a well-formed tensor; never a crash (run under ASan/UBSan in sanitizer builds).
  std::string good = read_bytes(npy("good_f8.npy"));
  for (size_t n = 0; n < good.size(); ++n) {
    write_bytes(tmp("p.npy"), good.substr(0, n));
    EXPECT_FALSE(io::load_npy(tmp("p.npy")).has_value()) << "prefix " << n;
  }
  std::mt19937_64 rng(7);
  for (int i = 0; i < 200; ++i) {
    std::string b = good;
    b[rng() % 128] = static_cast<char>(rng());
    write_bytes(tmp("f.npy"), b);
    auto t = io::load_npy(tmp("f.npy"));
    if (t.has_value()) {
      EXPECT_EQ(t->nbytes() + 128, b.size());
    }
  }
}

TEST_F(IoTest, ReadsExampleArraysWrittenByExportScript) {
  std::string ex = std::string(KILN_SOURCE_DIR) + "/examples/tiny_gpt/";
  auto in = io::load_npy(ex + "input.npy");
  ASSERT_TRUE(in.has_value()) << in.message();
  EXPECT_EQ(in->dtype(), DType::i64);
  EXPECT_EQ(in->dims(), (std::vector<int64_t>{4, 64}));
  for (int64_t i = 0; i < in->numel(); ++i) ASSERT_LT(static_cast<uint64_t>(in->get_i64(i)), 256u);
  auto out = io::load_npy(ex + "output.npy");
  ASSERT_TRUE(out.has_value()) << out.message();
  EXPECT_EQ(out->dtype(), DType::f32);
  EXPECT_EQ(out->dims(), (std::vector<int64_t>{4, 64, 256}));
}

// ----------------------------------------------------------------------------- safetensors
TEST_F(IoTest, SafetensorsRoundTripEveryDtypeWithMetadata) {
  std::map<std::string, Tensor> m;
  for (DType dt :
       {DType::f32, DType::f64, DType::bf16, DType::f16, DType::i64, DType::i32, DType::i8, DType::u8, DType::boolean})
    m[std::string("t.") + kiln::ir::dtype_name(dt)] = pattern(dt, {3, 5});
  m["scalar"] = Tensor::scalar_f32(2.5f);
  m["empty"] = Tensor(DType::f32, {0, 4});
  ASSERT_TRUE(io::save_safetensors(tmp("w.safetensors"), m, {{"format", "pt"}, {"step", "12"}}).is_ok());
  EXPECT_FALSE(fs::exists(tmp("w.safetensors.tmp")));
  std::string raw = read_bytes(tmp("w.safetensors"));
  uint64_t hlen;
  std::memcpy(&hlen, raw.data(), 8);
  EXPECT_EQ(hlen % 8, 0u);
  EXPECT_EQ(raw.substr(8, 14), "{\"__metadata__");
  std::map<std::string, std::string> meta;
  auto back = io::load_safetensors(tmp("w.safetensors"), &meta);
  ASSERT_TRUE(back.has_value()) << back.message();
  ASSERT_EQ(back->size(), m.size());
  for (auto& [k, t] : m) {
    SCOPED_TRACE(k);
    ASSERT_TRUE(back->count(k));
    expect_same(back->at(k), t);
  }
  EXPECT_EQ(meta, (std::map<std::string, std::string>{{"format", "pt"}, {"step", "12"}}));
  // No tensors at all is a valid file too.
  ASSERT_TRUE(io::save_safetensors(tmp("e.safetensors"), {}).is_ok());
  auto e = io::load_safetensors(tmp("e.safetensors"));
  ASSERT_TRUE(e.has_value()) << e.message();
  EXPECT_TRUE(e->empty());
}

TEST_F(IoTest, SafetensorsReadsPythonWrittenGradientFixtures) {
  // grads_f32 / grads_f64 of mlp_digits, written by tools/make_fixtures.py (PyTorch).
  std::string d = std::string(KILN_SOURCE_DIR) + "/examples/mlp_digits/fixtures/";
  std::map<std::string, std::string> meta;
  auto g32 = io::load_safetensors(d + "grads_f32.safetensors", &meta);
  auto g64 = io::load_safetensors(d + "grads_f64.safetensors");
  ASSERT_TRUE(g32.has_value()) << g32.message();
  ASSERT_TRUE(g64.has_value()) << g64.message();
  EXPECT_EQ(meta["format"], "pt");
  std::map<std::string, std::vector<int64_t>> want = {{"fc1.weight", {128, 64}}, {"fc1.bias", {128}},
                                                      {"fc2.weight", {64, 128}}, {"fc2.bias", {64}},
                                                      {"fc3.weight", {10, 64}},  {"fc3.bias", {10}}};
  ASSERT_EQ(g32->size(), want.size());
  for (auto& [k, dims] : want) {
    SCOPED_TRACE(k);
    const Tensor& a = g32->at(k);
    const Tensor& b = g64->at(k);
    EXPECT_EQ(a.dtype(), DType::f32);
    EXPECT_EQ(b.dtype(), DType::f64);
    EXPECT_EQ(a.dims(), dims);
    EXPECT_EQ(b.dims(), dims);
    // The f32 and f64 PyTorch gradients agree to f32 rounding: |a-b| <= 1e-5 max|b| + 1e-7.
    double mx = 0;
    for (int64_t i = 0; i < b.numel(); ++i) mx = std::max(mx, std::abs(b.get_f64(i)));
    EXPECT_GT(mx, 0.0);
    for (int64_t i = 0; i < b.numel(); ++i) ASSERT_NEAR(a.get_f64(i), b.get_f64(i), 1e-5 * mx + 1e-7) << i;
  }
}

namespace {
// A safetensors file from a raw header string and data bytes.
std::string st_file(const std::string& header, const std::string& data) {
  uint64_t n = header.size();
  return std::string(reinterpret_cast<const char*>(&n), 8) + header + data;
}
}  // namespace

TEST_F(IoTest, SafetensorsMalformedFilesGiveErrors) {
  const std::string d8(8, '\1');
  struct Case {
    const char* name;
    std::string bytes;
    const char* needle;
  };
  std::vector<Case> cases = {
      {"short", std::string("\x10\0\0", 3), "shorter than"},
      {"huge_header", std::string("\xff\xff\xff\xff\xff\xff\xff\x7f", 8) + "{}", "exceeds 100 MB"},
      {"header_past_end", std::string("\x40\0\0\0\0\0\0\0", 8) + "{}", "truncated"},
      {"bad_json", st_file("{\"a\": [", ""), "not valid JSON"},
      {"not_object", st_file("[1,2]", ""), "not a JSON object"},
      {"bad_dtype", st_file(R"({"a":{"dtype":"F8_E4M3","shape":[2],"data_offsets":[0,2]}})", "ab"), "F8_E4M3"},
      {"missing_field", st_file(R"({"a":{"dtype":"F32","shape":[2]}})", d8), "data_offsets"},
      {"past_end", st_file(R"({"a":{"dtype":"F32","shape":[4],"data_offsets":[0,16]}})", d8), "past the data area"},
      {"size_mismatch", st_file(R"({"a":{"dtype":"F32","shape":[3],"data_offsets":[0,8]}})", d8), "needs 12 bytes"},
      {"reversed", st_file(R"({"a":{"dtype":"U8","shape":[0],"data_offsets":[8,0]}})", d8), "reversed"},
      {"negative_dim", st_file(R"({"a":{"dtype":"U8","shape":[-8],"data_offsets":[0,8]}})", d8), "non-negative"},
      {"hole", st_file(R"({"a":{"dtype":"U8","shape":[4],"data_offsets":[4,8]}})", d8), "hole"},
      {"overlap",
       st_file(R"({"a":{"dtype":"U8","shape":[8],"data_offsets":[0,8]},)"
               R"("b":{"dtype":"U8","shape":[4],"data_offsets":[4,8]}})",
               d8),
       "overlapping"},
      {"trailing", st_file(R"({"a":{"dtype":"U8","shape":[4],"data_offsets":[0,4]}})", d8), "after the last tensor"},
      {"bad_metadata", st_file(R"({"__metadata__":{"k":1}})", ""), "not a string"},
  };
  for (auto& c : cases) {
    SCOPED_TRACE(c.name);
    std::string path = tmp(std::string(c.name) + ".safetensors");
    write_bytes(path, c.bytes);
    std::map<std::string, std::string> meta;
    auto r = io::load_safetensors(path, &meta);
    ASSERT_FALSE(r.has_value());
    EXPECT_NE(r.message().find(path), std::string::npos) << r.message();
    EXPECT_NE(r.message().find(c.needle), std::string::npos) << r.message();
  }
  EXPECT_FALSE(io::load_safetensors(tmp("missing.safetensors")).has_value());
  // Truncations of a valid file never crash and always fail.
  std::map<std::string, Tensor> m = {{"w", pattern(DType::f32, {4, 4})}, {"b", pattern(DType::i64, {4})}};
  ASSERT_TRUE(io::save_safetensors(tmp("ok.safetensors"), m).is_ok());
  std::string good = read_bytes(tmp("ok.safetensors"));
  for (size_t n = 0; n < good.size(); ++n) {
    write_bytes(tmp("cut.safetensors"), good.substr(0, n));
    EXPECT_FALSE(io::load_safetensors(tmp("cut.safetensors")).has_value()) << "prefix " << n;
  }
  EXPECT_FALSE(io::save_safetensors(tmp("x.safetensors"), {{"__metadata__", Tensor::scalar_f32(1)}}).is_ok());
  EXPECT_FALSE(io::save_safetensors(tmp("no_dir/x.safetensors"), m).is_ok());
}

// ----------------------------------------------------------------------------- tokens
TEST_F(IoTest, TokenFileSamplingFollowsNanoGptGetBatch) {
  const int64_t n = 1000, B = 6, T = 16;
  std::vector<uint16_t> toks(n);
  for (int64_t i = 0; i < n; ++i) toks[i] = static_cast<uint16_t>((i * 2654435761u) & 0xffff);
  write_bytes(tmp("t.bin"), std::string(reinterpret_cast<const char*>(toks.data()), n * 2));
  auto f = io::open_token_file(tmp("t.bin"));
  ASSERT_TRUE(f.has_value()) << f.message();
  EXPECT_EQ(f->size(), n);

  std::mt19937_64 rng(42), ref(42);
  auto b = io::sample_token_batch(*f, B, T, rng);
  ASSERT_TRUE(b.has_value()) << b.message();
  EXPECT_EQ(b->inputs.dtype(), DType::i64);
  EXPECT_EQ(b->inputs.dims(), (std::vector<int64_t>{B, T}));
  EXPECT_EQ(b->targets.dims(), (std::vector<int64_t>{B, T}));
  for (int64_t r = 0; r < B; ++r) {
    int64_t s = static_cast<int64_t>(ref() % static_cast<uint64_t>(n - T));  // documented draw
    ASSERT_EQ(b->starts[r], s);
    for (int64_t t = 0; t < T; ++t) {
      ASSERT_EQ(b->inputs.get_i64(r * T + t), toks[s + t]);
      ASSERT_EQ(b->targets.get_i64(r * T + t), toks[s + t + 1]);
    }
  }
  // Starts cover [0, n-T-1] (with n - T = 2 every start value appears).
  std::vector<uint16_t> small(T + 2);
  write_bytes(tmp("s.bin"), std::string(reinterpret_cast<const char*>(small.data()), small.size() * 2));
  auto fs2 = io::open_token_file(tmp("s.bin"));
  ASSERT_TRUE(fs2.has_value());
  std::set<int64_t> seen;
  for (int i = 0; i < 50; ++i) {
    auto bb = io::sample_token_batch(*fs2, 1, T, rng);
    ASSERT_TRUE(bb.has_value()) << bb.message();
    seen.insert(bb->starts[0]);
  }
  EXPECT_EQ(seen, (std::set<int64_t>{0, 1}));

  // Consecutive windows as used by the fixtures: s = i*T.
  auto w = io::token_windows(*f, {0, T, 2 * T}, T);
  ASSERT_TRUE(w.has_value()) << w.message();
  EXPECT_EQ(w->inputs.get_i64(T), toks[T]);
  EXPECT_EQ(w->targets.get_i64(3 * T - 1), toks[3 * T]);
}

TEST_F(IoTest, TokenFileErrors) {
  write_bytes(tmp("odd.bin"), "abc");
  auto o = io::open_token_file(tmp("odd.bin"));
  ASSERT_FALSE(o.has_value());
  EXPECT_NE(o.message().find("odd number of bytes"), std::string::npos) << o.message();
  EXPECT_FALSE(io::open_token_file(tmp("missing.bin")).has_value());
  write_bytes(tmp("short.bin"), std::string(8, '\0'));  // 4 tokens
  auto f = io::open_token_file(tmp("short.bin"));
  ASSERT_TRUE(f.has_value());
  std::mt19937_64 rng(1);
  auto b = io::sample_token_batch(*f, 2, 4, rng);
  ASSERT_FALSE(b.has_value());
  EXPECT_NE(b.message().find("short.bin"), std::string::npos) << b.message();
  EXPECT_TRUE(io::sample_token_batch(*f, 2, 3, rng).has_value());
  EXPECT_FALSE(io::sample_token_batch(*f, 0, 3, rng).has_value());
  EXPECT_FALSE(io::token_windows(*f, {1}, 3).has_value());
  EXPECT_FALSE(io::token_windows(*f, {-1}, 2).has_value());
}

TEST_F(IoTest, ReadsPreparedTokenFileFormatFromFixtures) {
  // tiny_gpt's fixture batch: windows at 0, 64, 128, 192 of data/text/train.bin. The
  // committed batch_input/batch_labels .npy must be consistent shifts of one stream.
  std::string d = std::string(KILN_SOURCE_DIR) + "/examples/tiny_gpt/fixtures/";
  auto x = io::load_npy(d + "batch_input.npy");
  auto y = io::load_npy(d + "batch_labels.npy");
  ASSERT_TRUE(x.has_value()) << x.message();
  ASSERT_TRUE(y.has_value()) << y.message();
  ASSERT_EQ(x->dims(), (std::vector<int64_t>{4, 64}));
  // Rebuild the stream prefix and check token_windows reproduces the fixture batch.
  std::vector<uint16_t> stream(4 * 64 + 1);
  for (int64_t i = 0; i < 4 * 64; ++i) stream[i] = static_cast<uint16_t>(x->get_i64(i));
  stream[4 * 64] = static_cast<uint16_t>(y->get_i64(4 * 64 - 1));
  write_bytes(tmp("p.bin"), std::string(reinterpret_cast<const char*>(stream.data()), stream.size() * 2));
  auto f = io::open_token_file(tmp("p.bin"));
  ASSERT_TRUE(f.has_value());
  auto w = io::token_windows(*f, {0, 64, 128, 192}, 64);
  ASSERT_TRUE(w.has_value()) << w.message();
  for (int64_t i = 0; i < 4 * 64; ++i) {
    ASSERT_EQ(w->inputs.get_i64(i), x->get_i64(i));
    ASSERT_EQ(w->targets.get_i64(i), y->get_i64(i));
  }
}

// ---------------------------------------------------------------- untrusted JSON (issue 36)
TEST(UntrustedJson, NestingUpToTheLimitParsesDeeperIsRefused) {
  auto nested = [](int n) { return std::string(n, '[') + std::string(n, ']'); };
  EXPECT_NO_THROW(io::parse_json_untrusted(nested(io::kMaxJsonDepth)));
  EXPECT_NO_THROW(io::parse_json_untrusted("{\"a\": " + nested(io::kMaxJsonDepth - 1) + "}"));
  try {
    io::parse_json_untrusted(nested(io::kMaxJsonDepth + 1));
    FAIL() << "accepted";
  } catch (const std::exception& e) {
    EXPECT_NE(std::string(e.what()).find("JSON nested more than 100 levels deep"), std::string::npos) << e.what();
  }
  // A million levels (the --config that overflowed the stack): refused, not a crash.
  EXPECT_THROW(io::parse_json_untrusted(nested(1'000'000)), std::exception);
  EXPECT_THROW(io::parse_json_untrusted("{\"a\": [1,"), std::exception);  // still refuses bad JSON
  EXPECT_EQ(io::parse_json_untrusted("{\"a\": [1, 2.5, \"x\"]}")["a"][2], "x");
}

TEST(UntrustedJson, ExcerptIsCompactAndCut) {
  EXPECT_EQ(io::json_excerpt(nlohmann::json::parse("{\"a\": [1, true, null, \"s\"]}")), "{\"a\":[1,true,null,\"s\"]}");
  EXPECT_EQ(io::json_excerpt(nlohmann::json(2.5)), "2.5");
  nlohmann::json deep = nlohmann::json::array();
  for (int i = 0; i < 200; ++i) deep = nlohmann::json::array({std::move(deep)});
  const std::string e = io::json_excerpt(deep, 60);
  EXPECT_EQ(e, std::string(60, '[') + "...");
  EXPECT_EQ(io::json_excerpt(nlohmann::json(std::string(500, 'x')), 10), "\"xxxxxxxxx...");
}
