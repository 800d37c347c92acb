// Tests of the ahead-of-time object path and the compile cache (issue 8):
//  * compile_cpu_object + load_cpu_object run hand-made kernels (pointwise with broadcast,
//    integer pow through kiln_cpu_ipow, exp through libm, row max/sum, column sum, two
//    structurally equal kernels sharing a symbol) and must match evaluate_reference (the
//    kernel-IR oracle, checked against float64 math in kernel_ir_test.cpp): exact (bit
//    equality, NaN == NaN) except f32 row sums (1e-5 relative, vectorized and
//    reassociated, as in llvm_cpu_test.cpp) and exp (1e-6 relative: LLVM may call another
//    libm entry point); and bit-equal to compile_cpu's JIT results;
//  * the same object linked by the system C compiler into an executable, with the data
//    object of emit_aot_data_object (blob + function table), computes the same bytes;
//  * compile_graph_cpu's cache: miss -> .kcache file -> disk hit -> memory hit, all with
//    bit-identical outputs, equal to the eager interpreter (exact for Add/Mul/Max);
//    truncated, bit-flipped and stale-version entries give exactly one warning line, a
//    rebuild and a valid entry; use_cache=false writes nothing; an unwritable cache dir
//    warns once and still compiles;
//  * verify_llvm_ir_text accepts a module's IR and rejects garbage and invalid IR.
#include <gtest/gtest.h>
#include <stdlib.h>

#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <map>
#include <random>
#include <sstream>

#include "codegen/cpu/llvm_cpu.h"
#include "codegen/cpu/program.h"
#include "codegen/kernel_ir.h"
#include "codegen/lower.h"
#include "ir/op_table.h"
#include "ir/verifier.h"
#include "kernel_builder.h"
#include "passes/pass.h"
#include "runtime/interpreter.h"

namespace kiln::codegen {
namespace {

namespace fs = std::filesystem;
using ir::DType;
using ir::ScalarOp;
using testing::KB;

/// A fresh empty directory under /tmp (removed by the fixture).
std::string make_temp_dir() {
  std::string t = (fs::temp_directory_path() / "kiln_cc_test_XXXXXX").string();
  char* p = ::mkdtemp(t.data());
  EXPECT_NE(p, nullptr);
  return t;
}

std::string read_file(const fs::path& p) {
  std::ifstream f(p, std::ios::binary);
  return std::string(std::istreambuf_iterator<char>(f), std::istreambuf_iterator<char>());
}
void write_file(const fs::path& p, const std::string& s) {
  std::ofstream f(p, std::ios::binary | std::ios::trunc);
  f.write(s.data(), static_cast<std::streamsize>(s.size()));
}

/// Deterministic inputs: floats in [-2.5, 2.5] with some NaN/inf, integers in [-4, 4].
void fill(DType t, void* b, int64_t n, uint32_t seed) {
  std::mt19937 g(seed);
  for (int64_t i = 0; i < n; ++i) {
    double v = std::uniform_real_distribution<double>(-2.5, 2.5)(g);
    if (i % 53 == 7) v = NAN;
    if (i % 59 == 9) v = INFINITY;
    const int64_t iv = static_cast<int64_t>(g() % 9) - 4;
    switch (t) {
      case DType::f32:
        static_cast<float*>(b)[i] = static_cast<float>(v);
        break;
      case DType::f64:
        static_cast<double*>(b)[i] = v;
        break;
      case DType::i64:
        static_cast<int64_t*>(b)[i] = iv;
        break;
      case DType::i32:
        static_cast<int32_t*>(b)[i] = static_cast<int32_t>(iv);
        break;
      default:
        FAIL() << "dtype not used here";
    }
  }
}

double read(DType t, const void* b, int64_t i) {
  switch (t) {
    case DType::f32:
      return static_cast<const float*>(b)[i];
    case DType::f64:
      return static_cast<const double*>(b)[i];
    case DType::i64:
      return static_cast<double>(static_cast<const int64_t*>(b)[i]);
    case DType::i32:
      return static_cast<const int32_t*>(b)[i];
    default:
      return 0;
  }
}

/// The kernels of the object-path tests and the relative tolerance of each one's outputs.
std::vector<std::pair<Kernel, double>> test_kernels() {
  std::vector<std::pair<Kernel, double>> v;
  {  // z = x * y + x, y broadcast along dim 0
    KB b("axpy_bcast", {37, 65});
    int x = b.load(b.param("x", DType::f32, {65, 1}));
    int y = b.load(b.param("y", DType::f32, {0, 1}));
    b.out("z", b.op(ScalarOp::add, {b.op(ScalarOp::mul, {x, y}, DType::f32), x}, DType::f32), {65, 1});
    v.push_back({b.k, 0.0});
  }
  {  // integer pow (kiln_cpu_ipow) and max
    KB b("ipow", {300});
    int x = b.load(b.param("x", DType::i64, {1}));
    int e = b.load(b.param("e", DType::i64, {1}));
    b.out("z", b.op(ScalarOp::max, {b.op(ScalarOp::pow, {x, e}, DType::i64), b.cst(-3, DType::i64)}, DType::i64), {1});
    v.push_back({b.k, 0.0});
  }
  {  // libm: exp
    KB b("expo", {129});
    b.out("z", b.op(ScalarOp::exp, {b.load(b.param("x", DType::f32, {1}))}, DType::f32), {1});
    v.push_back({b.k, 1e-6});
  }
  {  // row max (exact) and row sum of an f32 (double accumulation, reassociated)
    KB b("row_max", {33, 70}, {false, true});
    b.out("m", b.load(b.param("x", DType::f32, {70, 1})), {1, 0}, ReduceKind::max);
    v.push_back({b.k, 0.0});
    KB s("row_sum", {33, 70}, {false, true});
    s.out("s", s.load(s.param("x", DType::f32, {70, 1})), {1, 0}, ReduceKind::sum);
    v.push_back({s.k, 1e-5});
  }
  {  // column sum (index order, exact)
    KB b("col_sum", {40, 300}, {true, false});
    b.out("s", b.load(b.param("x", DType::f64, {300, 1})), {0, 1}, ReduceKind::sum);
    v.push_back({b.k, 0.0});
  }
  {  // split column sum (rows in 2 partitions, combined in order; f32 in double)
    KB b("tall_col_sum", {600, 40}, {true, false});
    b.out("s", b.load(b.param("x", DType::f32, {40, 1})), {0, 1}, ReduceKind::sum);
    v.push_back({b.k, 1e-6});
  }
  {  // structurally equal to axpy.bcast (another name, other param names): shares its function
    KB b("axpy_twin", {37, 65});
    int x = b.load(b.param("a", DType::f32, {65, 1}));
    int y = b.load(b.param("b", DType::f32, {0, 1}));
    b.out("c", b.op(ScalarOp::add, {b.op(ScalarOp::mul, {x, y}, DType::f32), x}, DType::f32), {65, 1});
    v.push_back({b.k, 0.0});
  }
  return v;
}

/// Buffers of kernel `k`: inputs filled, outputs set to 0xAB bytes.
std::vector<std::vector<uint8_t>> make_buffers(const Kernel& k) {
  std::vector<std::vector<uint8_t>> bufs(k.params.size());
  for (size_t p = 0; p < k.params.size(); ++p) {
    const int64_t n = codegen::param_elements(k, k.params[p]);
    bufs[p].assign(static_cast<size_t>(n * ir::dtype_size(k.params[p].dtype)), 0xAB);
    if (!k.params[p].is_output) fill(k.params[p].dtype, bufs[p].data(), n, 99u + 31u * p);
  }
  return bufs;
}

std::vector<void*> ptrs(std::vector<std::vector<uint8_t>>& bufs) {
  std::vector<void*> v;
  for (auto& b : bufs) v.push_back(b.data());
  return v;
}

/// Runs `ck` over its parallel extent in 3 chunks, last chunk first (then a split
/// reduction's combine call, with its scratch after the buffers).
void run_chunked(const CpuKernel& ck, std::vector<void*> p) {
  std::vector<double> scratch(static_cast<size_t>(ck.scratch_bytes / 8 + 1));
  if (ck.scratch_bytes > 0) p.push_back(scratch.data());
  if (ck.parallel_dim < 0) return ck.fn(p.data(), 0, 1);
  const int64_t e = codegen::static_extent(ck.parallel_extent);
  for (int i = 2; i >= 0; --i)
    if (e * i / 3 < e * (i + 1) / 3) ck.fn(p.data(), e * i / 3, e * (i + 1) / 3);
  combine_cpu_partitions(ck, p.data());
}

/// Compares the output buffers of `got` with `ref` (relative tolerance `tol`, NaN == NaN).
void expect_close(const Kernel& k, const std::vector<std::vector<uint8_t>>& got,
                  const std::vector<std::vector<uint8_t>>& ref, double tol, const std::string& what) {
  for (size_t p = 0; p < k.params.size(); ++p) {
    if (!k.params[p].is_output) continue;
    const DType t = k.params[p].dtype;
    if (tol == 0) {
      EXPECT_EQ(got[p], ref[p]) << what << ": kernel " << k.name << " param " << p << " not bit-equal";
      continue;
    }
    const int64_t n = codegen::param_elements(k, k.params[p]);
    int bad = 0;
    for (int64_t i = 0; i < n && bad < 5; ++i) {
      const double a = read(t, got[p].data(), i), r = read(t, ref[p].data(), i);
      if (std::isnan(r) || std::isnan(a)) {
        if (std::isnan(r) != std::isnan(a)) ++bad;
        EXPECT_EQ(std::isnan(a), std::isnan(r)) << what << ": " << k.name << " element " << i;
        continue;
      }
      if (std::isinf(r) || std::isinf(a)) {
        EXPECT_EQ(a, r) << what << ": " << k.name << " element " << i;
        continue;
      }
      const bool ok = std::fabs(a - r) <= tol * std::max(1.0, std::fabs(r));
      bad += !ok;
      EXPECT_TRUE(ok) << what << ": " << k.name << " element " << i << ": got " << a << ", reference " << r;
    }
  }
}

int count_lines_with(const std::string& text, const std::string& needle) {
  int n = 0;
  std::istringstream is(text);
  for (std::string line; std::getline(is, line);) n += line.find(needle) != std::string::npos;
  return n;
}

int count_lines(const std::string& text) {
  int n = 0;
  std::istringstream is(text);
  for (std::string line; std::getline(is, line);) n += !line.empty();
  return n;
}

TEST(CpuObject, ObjectPathMatchesReferenceAndJit) {
  auto cases = test_kernels();
  std::vector<Kernel> ks;
  for (auto& c : cases) ks.push_back(c.first);
  auto obj = compile_cpu_object(ks);
  ASSERT_TRUE(obj) << obj.message();
  ASSERT_GT(obj->object.size(), 4u);
  EXPECT_EQ(obj->object.substr(0, 4), std::string("\x7f"
                                                  "ELF"));
  ASSERT_EQ(obj->kernels.size(), ks.size());
  ASSERT_EQ(obj->symbols.size(), ks.size());
  // Symbols: prefix + index + "_" + sanitized name; the twin shares kernel 0's symbol.
  EXPECT_EQ(obj->symbols[0], "kiln_k_0_axpy_bcast");
  EXPECT_EQ(obj->symbols[1], "kiln_k_1_ipow");
  EXPECT_EQ(obj->symbols.back(), "kiln_k_0_axpy_bcast");
  EXPECT_EQ(obj->stats.num_kernels, static_cast<int>(ks.size()));
  EXPECT_EQ(obj->stats.num_unique, static_cast<int>(ks.size()) - 1);
  for (size_t i = 0; i + 1 < ks.size(); ++i) {
    EXPECT_EQ(obj->kernels[i].name, ks[i].name);
    EXPECT_EQ(obj->kernels[i].fn, nullptr);
    EXPECT_NE(obj->object.find(obj->symbols[i]), std::string::npos) << obj->symbols[i] << " not in the object";
    EXPECT_NE(obj->llvm_ir.find("define void @" + obj->symbols[i] + "("), std::string::npos) << obj->symbols[i];
  }
  EXPECT_EQ(obj->object.find("kiln_k_7_axpy_twin"), std::string::npos) << "the twin got its own function";

  auto mod = load_cpu_object(*obj);
  ASSERT_TRUE(mod) << mod.message();
  EXPECT_EQ((*mod)->llvm_ir(), obj->llvm_ir);
  EXPECT_GE((*mod)->stats().codegen_s, obj->stats.codegen_s);
  auto jit = compile_cpu(ks);
  ASSERT_TRUE(jit) << jit.message();
  EXPECT_EQ((*mod)->kernels()[0].fn, (*mod)->kernels().back().fn);

  for (size_t i = 0; i < ks.size(); ++i) {
    const Kernel& k = ks[i];
    const CpuKernel& ck = (*mod)->kernels()[i];
    ASSERT_NE(ck.fn, nullptr) << k.name;
    EXPECT_EQ(ck.parallel_dim, (*jit)->kernels()[i].parallel_dim);
    EXPECT_EQ(ck.parallel_extent, (*jit)->kernels()[i].parallel_extent);
    EXPECT_EQ(ck.split_parts, (*jit)->kernels()[i].split_parts);
    EXPECT_EQ(ck.scratch_bytes, (*jit)->kernels()[i].scratch_bytes);
    auto ref = make_buffers(k), got = ref, via_jit = ref;
    ASSERT_TRUE(evaluate_reference(k, ptrs(ref)).is_ok());
    run_chunked(ck, ptrs(got));
    run_chunked((*jit)->kernels()[i], ptrs(via_jit));
    expect_close(k, got, ref, cases[i].second, "object vs reference");
    expect_close(k, got, via_jit, 0.0, "object vs compile_cpu");
  }
}

TEST(CpuObject, SymbolPrefixOption) {
  KB b("neg_1", {8});
  b.out("z", b.op(ScalarOp::neg, {b.load(b.param("x", DType::f32, {1}))}, DType::f32), {1});
  CpuObjectOptions o;
  o.symbol_prefix = "kiln_train_";
  auto obj = compile_cpu_object({b.k}, o);
  ASSERT_TRUE(obj) << obj.message();
  ASSERT_EQ(obj->symbols.size(), 1u);
  EXPECT_EQ(obj->symbols[0], "kiln_train_0_neg_1");
  EXPECT_EQ(obj->kernels[0].name, "neg_1");
}

/// Links the kernel object, a data object and a C driver with the system compiler and
/// checks that the executable computes the reference bytes of kernel axpy and ipow.
TEST(CpuObject, LinksIntoAnExecutableWithTheAotDataObject) {
  const std::string dir = make_temp_dir();
  auto cases = test_kernels();
  std::vector<Kernel> ks = {cases[0].first, cases[1].first};
  auto obj = compile_cpu_object(ks);
  ASSERT_TRUE(obj) << obj.message();
  // Blob: the inputs of both kernels concatenated (the AOT binary embeds weights like this).
  std::vector<std::vector<std::vector<uint8_t>>> bufs, refs;
  std::string blob;
  for (const Kernel& k : ks) {
    bufs.push_back(make_buffers(k));
    refs.push_back(bufs.back());
    ASSERT_TRUE(evaluate_reference(k, ptrs(refs.back())).is_ok());
    for (size_t p = 0; p < k.params.size(); ++p)
      if (!k.params[p].is_output)
        blob.append(reinterpret_cast<const char*>(bufs.back()[p].data()), bufs.back()[p].size());
  }
  auto data = emit_aot_data_object({{"kiln_blob_inputs", blob}, {"kiln_blob_empty", ""}}, "kiln_kernel_table",
                                   {obj->symbols[0], obj->symbols[1]});
  ASSERT_TRUE(data) << data.message();
  EXPECT_EQ(data->substr(0, 4), std::string("\x7f"
                                            "ELF"));
  write_file(fs::path(dir) / "kernels.o", obj->object);
  write_file(fs::path(dir) / "data.o", *data);
  // The driver: inputs from the blob, outputs written to out.bin.
  std::ostringstream c;
  c << "#include <stdint.h>\n#include <stdio.h>\n#include <string.h>\n#include <stdlib.h>\n"
    << "extern const char kiln_blob_inputs[]; extern const int64_t kiln_blob_inputs_size;\n"
    << "extern const char kiln_blob_empty[]; extern const int64_t kiln_blob_empty_size;\n"
    << "extern void* const kiln_kernel_table[]; extern const int64_t kiln_kernel_table_count;\n"
    << "typedef void (*fn_t)(void* const*, int64_t, int64_t);\n"
    << "int64_t kiln_cpu_ipow(int64_t b, int64_t e) {\n"
    << "  if (e < 0) return b == 1 ? 1 : b == -1 ? ((e & 1) ? -1 : 1) : 0;\n"
    << "  uint64_t r = 1, x = (uint64_t)b; while (e) { if (e & 1) r *= x; x *= x; e >>= 1; } return (int64_t)r; }\n"
    << "int main(void) {\n"
    << "  if (kiln_kernel_table_count != 2 || kiln_blob_empty_size != 0 || kiln_blob_empty[0] != 0) return 2;\n"
    << "  if (kiln_blob_inputs[kiln_blob_inputs_size] != 0) return 3;\n"
    << "  const char* in = kiln_blob_inputs; FILE* f = fopen(\"" << dir << "/out.bin\", \"wb\");\n";
  for (size_t ki = 0; ki < ks.size(); ++ki) {
    const Kernel& k = ks[ki];
    const CpuKernel& ok = obj->kernels[ki];
    c << "  { void* b[" << k.params.size() + 1 << "];\n";
    if (ok.scratch_bytes > 0) c << "    b[" << k.params.size() << "] = calloc(1, " << ok.scratch_bytes << ");\n";
    for (size_t p = 0; p < k.params.size(); ++p) {
      if (k.params[p].is_output)
        c << "    b[" << p << "] = calloc(1, " << bufs[ki][p].size() << ");\n";
      else
        c << "    b[" << p << "] = (void*)in; in += " << bufs[ki][p].size() << ";\n";
    }
    c << "    ((fn_t)kiln_kernel_table[" << ki << "])(b, 0, " << ok.parallel_extent << ");\n";
    if (ok.split_parts > 0)
      c << "    ((fn_t)kiln_kernel_table[" << ki << "])(b, " << ok.split_parts << ", " << ok.split_parts + 1 << ");\n";
    for (size_t p = 0; p < k.params.size(); ++p)
      if (k.params[p].is_output) c << "    fwrite(b[" << p << "], 1, " << bufs[ki][p].size() << ", f);\n";
    c << "  }\n";
  }
  c << "  fclose(f); return 0; }\n";
  write_file(fs::path(dir) / "main.c", c.str());
  const std::string cmd = "cd " + dir + " && cc -O1 -pie -fPIE main.c kernels.o data.o -o aot_test -lm > link.log 2>&1";
  ASSERT_EQ(std::system(cmd.c_str()), 0) << "link failed:\n" << read_file(fs::path(dir) / "link.log");
  ASSERT_EQ(std::system((dir + "/aot_test").c_str()), 0);
  const std::string out = read_file(fs::path(dir) / "out.bin");
  std::string want;
  for (size_t ki = 0; ki < ks.size(); ++ki)
    for (size_t p = 0; p < ks[ki].params.size(); ++p)
      if (ks[ki].params[p].is_output) {
        // The executable's outputs start zeroed, the reference's at 0xAB: every element is written.
        want.append(reinterpret_cast<const char*>(refs[ki][p].data()), refs[ki][p].size());
      }
  EXPECT_EQ(out.size(), want.size());
  EXPECT_TRUE(out == want) << "AOT executable output differs from the reference";
  fs::remove_all(dir);
}

TEST(CpuObject, AotDataObjectRejectsBadSymbols) {
  EXPECT_FALSE(emit_aot_data_object({{"not a name", "x"}}, "t", {}));
  EXPECT_FALSE(emit_aot_data_object({{"a", "x"}, {"a", "y"}}, "t", {}));
  EXPECT_FALSE(emit_aot_data_object({}, "t", {"f", "1bad"}));
  auto empty = emit_aot_data_object({}, "kiln_table", {});
  ASSERT_TRUE(empty) << empty.message();
  EXPECT_EQ(empty->substr(0, 4), std::string("\x7f"
                                             "ELF"));
  EXPECT_NE(empty->find("kiln_table_count"), std::string::npos);
}

TEST(CpuObject, VerifyLlvmIrText) {
  KB b("v", {16});
  b.out("z", b.op(ScalarOp::sqrt, {b.load(b.param("x", DType::f32, {1}))}, DType::f32), {1});
  auto obj = compile_cpu_object({b.k});
  ASSERT_TRUE(obj) << obj.message();
  Status ok = verify_llvm_ir_text(obj->llvm_ir);
  EXPECT_TRUE(ok.is_ok()) << ok.message();
  Status garbage = verify_llvm_ir_text("this is not LLVM IR {");
  ASSERT_FALSE(garbage.is_ok());
  EXPECT_NE(garbage.message().find("parse"), std::string::npos) << garbage.message();
  // Parses, but the use of %y is not dominated by its definition.
  Status bad = verify_llvm_ir_text(
      "define i32 @f() {\nentry:\n  br label %b\nb:\n  ret i32 %y\nc:\n  %y = add i32 1, 2\n  ret i32 %y\n}\n");
  ASSERT_FALSE(bad.is_ok());
  EXPECT_NE(bad.message().find("verifier"), std::string::npos) << bad.message();
}

// ---- compile_graph_cpu and the cache

/// y = max(x * w + b, x), z = y * y: one fused kernel after the fusion pass.
std::unique_ptr<ir::Graph> small_fused_graph() {
  auto g = std::make_unique<ir::Graph>();
  ir::Value* x = g->add_input("x", DType::f32, ir::Shape::of({6, 17}));
  ir::Value* w = g->add_input("w", DType::f32, ir::Shape::of({17}));
  ir::Value* b = g->add_input("b", DType::f32, ir::Shape::of({6, 1}));
  ir::Value* m = g->add_node("Mul", "mul", {x, w}, {"m"})->outputs[0];
  ir::Value* a = g->add_node("Add", "add", {m, b}, {"a"})->outputs[0];
  ir::Value* y = g->add_node("Max", "max", {a, x}, {"y"})->outputs[0];
  ir::Value* z = g->add_node("Mul", "sq", {y, y}, {"z"})->outputs[0];
  g->outputs.push_back(y);
  g->outputs.push_back(z);
  EXPECT_TRUE(ir::infer_graph(*g).is_ok());
  EXPECT_TRUE(ir::verify_graph(*g).is_ok());
  return g;
}

std::map<std::string, ir::Tensor> feeds() {
  std::map<std::string, ir::Tensor> f;
  std::mt19937_64 gen(7);
  std::uniform_real_distribution<double> u(-2, 2);
  for (auto [name, dims] :
       std::vector<std::pair<std::string, std::vector<int64_t>>>{{"x", {6, 17}}, {"w", {17}}, {"b", {6, 1}}}) {
    ir::Tensor t(DType::f32, dims);
    for (int64_t i = 0; i < t.numel(); ++i) t.set_f64(i, u(gen));
    f[name] = t;
  }
  return f;
}

class CompileCache : public ::testing::Test {
 public:
  void SetUp() override {
    runtime::register_eager_kernels();
    dir_ = make_temp_dir();
    ::setenv("KILN_CACHE_DIR", dir_.c_str(), 1);
    clear_cpu_memory_cache();
    eager_ = small_fused_graph();
    fused_ = eager_->clone();
    passes::PassContext ctx;
    ctx.verify_each = true;
    ASSERT_TRUE(passes::run_pipeline(*fused_, {"fusion"}, ctx).is_ok());
    ASSERT_EQ(fused_nodes(*fused_).size(), 1u);
  }
  void TearDown() override {
    ::unsetenv("KILN_CACHE_DIR");
    clear_cpu_memory_cache();
    fs::remove_all(dir_);
  }
  std::vector<fs::path> entries() const {
    std::vector<fs::path> v;
    for (auto& e : fs::directory_iterator(dir_)) v.push_back(e.path());
    return v;
  }
  /// Compiles with the default options (cache dir from $KILN_CACHE_DIR).
  std::shared_ptr<CpuProgram> compile(std::vector<std::pair<std::string, std::string>>* logs = nullptr) {
    CpuCompileOptions o;
    if (logs) o.log = [logs](const std::string& t, const std::string& s) { logs->push_back({t, s}); };
    auto p = compile_graph_cpu(*fused_, o);
    EXPECT_TRUE(p) << p.message();
    return p ? *p : nullptr;
  }
  /// Outputs of the fused graph run with `prog`'s kernels.
  std::map<std::string, ir::Tensor> run(const CpuProgram& prog) {
    runtime::RunOptions ro;
    ro.program = &prog;
    auto r = runtime::run_graph(*fused_, feeds(), ro);
    EXPECT_TRUE(r) << r.message();
    return r ? *r : std::map<std::string, ir::Tensor>{};
  }
  static std::string bytes(const ir::Tensor& t) { return std::string(static_cast<const char*>(t.raw()), t.nbytes()); }
  void expect_same_outputs(const std::map<std::string, ir::Tensor>& a, const std::map<std::string, ir::Tensor>& b) {
    for (const char* n : {"y", "z"}) {
      ASSERT_TRUE(a.count(n) && b.count(n)) << n;
      EXPECT_EQ(bytes(a.at(n)), bytes(b.at(n))) << n << " differs";
    }
  }
  std::string dir_;
  std::unique_ptr<ir::Graph> eager_, fused_;
};

TEST_F(CompileCache, MissThenDiskHitThenMemoryHit) {
  EXPECT_EQ(default_cache_dir(), dir_);
  std::vector<std::pair<std::string, std::string>> logs;
  auto p1 = compile(&logs);
  ASSERT_TRUE(p1);
  EXPECT_EQ(p1->cache_status, "miss");
  EXPECT_EQ(p1->cache_key.size(), 64u);
  ASSERT_TRUE(p1->object);
  ASSERT_EQ(p1->object->symbols.size(), 1u);
  EXPECT_EQ(p1->object->symbols[0].rfind("kiln_k_0_", 0), 0u) << p1->object->symbols[0];
  const auto files = entries();
  ASSERT_EQ(files.size(), 1u);
  EXPECT_EQ(files[0].filename().string(), p1->cache_key + ".kcache");
  EXPECT_GE(count_lines_with(
                [&] {
                  std::string s;
                  for (auto& l : logs)
                    if (l.first == "cache") s += l.second + "\n";
                  return s;
                }(),
                "miss"),
            1);
  int code_logs = 0;
  for (auto& l : logs) code_logs += l.first == "output_code";
  EXPECT_EQ(code_logs, 2);  // one kernel's kernel IR + the module's LLVM IR

  // Eager reference (exact: Mul/Add/Max in f32, same operation order).
  auto ref = runtime::run_graph(*eager_, feeds());
  ASSERT_TRUE(ref) << ref.message();
  auto out1 = run(*p1);
  expect_same_outputs(out1, *ref);

  clear_cpu_memory_cache();
  ::testing::internal::CaptureStderr();
  auto p2 = compile();
  const std::string err2 = ::testing::internal::GetCapturedStderr();
  ASSERT_TRUE(p2);
  EXPECT_EQ(p2->cache_status, "disk hit");
  EXPECT_EQ(err2, "");
  EXPECT_EQ(p2->cache_key, p1->cache_key);
  EXPECT_TRUE(p2->object->object == p1->object->object) << "object bytes differ";
  EXPECT_EQ(p2->module->llvm_ir(), p1->module->llvm_ir());
  EXPECT_EQ(p2->object->stats.optimize_s, 0.0) << "a disk hit ran O3";
  EXPECT_NE(p2->module.get(), p1->module.get());
  expect_same_outputs(run(*p2), out1);

  auto p3 = compile();
  ASSERT_TRUE(p3);
  EXPECT_EQ(p3->cache_status, "memory hit");
  EXPECT_EQ(p3->module.get(), p2->module.get());
  expect_same_outputs(run(*p3), out1);

  // Another symbol prefix is another key (and another file).
  CpuCompileOptions o;
  o.symbol_prefix = "kiln_eval_";
  auto p4 = compile_graph_cpu(*fused_, o);
  ASSERT_TRUE(p4) << p4.message();
  EXPECT_EQ((*p4)->cache_status, "miss");
  EXPECT_NE((*p4)->cache_key, p1->cache_key);
  EXPECT_EQ(entries().size(), 2u);
  expect_same_outputs(run(**p4), out1);

  // The one-argument form uses the default options (cache on, $KILN_CACHE_DIR).
  auto p5 = compile_graph_cpu(*fused_);
  ASSERT_TRUE(p5) << p5.message();
  EXPECT_EQ((*p5)->cache_status, "memory hit");
}

/// Damages the entry with `damage`, then expects one warning, a rebuild and a valid entry.
void check_bad_entry(
    CompileCache& t,
    std::shared_ptr<CpuProgram> (CompileCache::*compile)(std::vector<std::pair<std::string, std::string>>*),
    const std::function<void(const fs::path&)>& damage, const std::string& reason) {
  auto p1 = (t.*compile)(nullptr);
  ASSERT_TRUE(p1);
  ASSERT_EQ(p1->cache_status, "miss");
  const fs::path file = fs::path(default_cache_dir()) / (p1->cache_key + ".kcache");
  ASSERT_TRUE(fs::exists(file));
  const std::string good = read_file(file);
  damage(file);
  ASSERT_NE(read_file(file), good);
  clear_cpu_memory_cache();
  ::testing::internal::CaptureStderr();
  auto p2 = (t.*compile)(nullptr);
  const std::string err = ::testing::internal::GetCapturedStderr();
  ASSERT_TRUE(p2);
  EXPECT_EQ(p2->cache_status, "miss");
  EXPECT_EQ(count_lines(err), 1) << err;
  EXPECT_EQ(err.rfind("kiln: warning: compile cache entry " + file.string() + " is " + reason, 0), 0u) << err;
  EXPECT_NE(err.find("; rebuilding\n"), std::string::npos) << err;
  // Rewritten: same layout as the good entry (only the recorded compile times differ).
  const std::string rewritten = read_file(file);
  EXPECT_EQ(rewritten.size(), good.size()) << "the entry was not rewritten";
  EXPECT_TRUE(rewritten.compare(0, 20, good, 0, 20) == 0) << "the entry's header was not rewritten";
  clear_cpu_memory_cache();
  ::testing::internal::CaptureStderr();
  auto p3 = (t.*compile)(nullptr);
  EXPECT_EQ(::testing::internal::GetCapturedStderr(), "");
  ASSERT_TRUE(p3);
  EXPECT_EQ(p3->cache_status, "disk hit");
}

TEST_F(CompileCache, StorePrunesLeastRecentlyUsedEntriesBeyond512MiB) {
  // Three old entries of 200 MiB each (sparse files: no disk used) plus another file:
  // after the store, the oldest .kcache files go until the folder's entries fit in
  // 512 MiB; the new entry and non-cache files stay.
  const auto now = fs::file_time_type::clock::now();
  for (int i = 0; i < 3; ++i) {
    const fs::path p = fs::path(dir_) / ("old" + std::to_string(i) + ".kcache");
    std::ofstream(p).put('x');
    fs::resize_file(p, uintmax_t(200) << 20);
    fs::last_write_time(p, now - std::chrono::hours(24 * (10 - i)));  // old0 is the oldest
  }
  const fs::path other = fs::path(dir_) / "notes.txt";
  std::ofstream(other) << "not a cache entry";
  fs::resize_file(other, uintmax_t(300) << 20);
  std::vector<std::pair<std::string, std::string>> logs;
  auto p = compile(&logs);
  ASSERT_TRUE(p);
  EXPECT_EQ(p->cache_status, "miss");
  EXPECT_FALSE(fs::exists(fs::path(dir_) / "old0.kcache"));
  EXPECT_TRUE(fs::exists(fs::path(dir_) / "old1.kcache"));
  EXPECT_TRUE(fs::exists(fs::path(dir_) / "old2.kcache"));
  EXPECT_TRUE(fs::exists(fs::path(dir_) / (p->cache_key + ".kcache")));
  EXPECT_TRUE(fs::exists(other));
  bool logged = false;
  for (auto& l : logs) logged |= l.first == "cache" && l.second.find("pruned 1 ") != std::string::npos;
  EXPECT_TRUE(logged);
  // A disk hit marks its entry recently used.
  clear_cpu_memory_cache();
  const fs::path mine = fs::path(dir_) / (p->cache_key + ".kcache");
  fs::last_write_time(mine, now - std::chrono::hours(24 * 30));
  auto hit = compile();
  ASSERT_TRUE(hit);
  EXPECT_EQ(hit->cache_status, "disk hit");
  EXPECT_GT(fs::last_write_time(mine), now - std::chrono::hours(1));
}

TEST_F(CompileCache, TruncatedEntryIsRebuilt) {
  check_bad_entry(
      *this, &CompileCache::compile,
      [](const fs::path& f) {
        const std::string s = read_file(f);
        write_file(f, s.substr(0, s.size() / 2));
      },
      "truncated");
}

TEST_F(CompileCache, TruncatedHeaderIsRebuilt) {
  check_bad_entry(
      *this, &CompileCache::compile, [](const fs::path& f) { write_file(f, read_file(f).substr(0, 10)); }, "truncated");
}

TEST_F(CompileCache, FlippedPayloadByteIsRebuilt) {
  check_bad_entry(
      *this, &CompileCache::compile,
      [](const fs::path& f) {
        std::string s = read_file(f);
        s[s.size() - 100] ^= 0x10;  // inside the object bytes
        write_file(f, s);
      },
      "corrupt");
}

TEST_F(CompileCache, OtherFormatVersionIsStale) {
  check_bad_entry(
      *this, &CompileCache::compile,
      [](const fs::path& f) {
        std::string s = read_file(f);
        s[8] = static_cast<char>(s[8] + 1);  // format version, right after the 8-byte magic
        write_file(f, s);
      },
      "stale");
}

TEST_F(CompileCache, UseCacheFalseWritesNothing) {
  const fs::path sub = fs::path(dir_) / "not_created";
  CpuCompileOptions o;
  o.use_cache = false;
  o.cache_dir = sub.string();
  ::testing::internal::CaptureStderr();
  auto p = compile_graph_cpu(*fused_, o);
  EXPECT_EQ(::testing::internal::GetCapturedStderr(), "");
  ASSERT_TRUE(p) << p.message();
  EXPECT_EQ((*p)->cache_status, "off");
  EXPECT_EQ((*p)->cache_key.size(), 64u);
  ASSERT_TRUE((*p)->object);
  EXPECT_FALSE(fs::exists(sub));
  EXPECT_TRUE(entries().empty());
  auto ref = runtime::run_graph(*eager_, feeds());
  ASSERT_TRUE(ref);
  expect_same_outputs(run(**p), *ref);
  // Nothing went to the memory cache either.
  auto again = compile_graph_cpu(*fused_, o);
  ASSERT_TRUE(again);
  EXPECT_NE((*again)->module.get(), (*p)->module.get());
}

TEST_F(CompileCache, UnwritableDirWarnsOnceAndCompiles) {
  const fs::path file = fs::path(dir_) / "a_file";
  write_file(file, "x");
  CpuCompileOptions o;
  o.cache_dir = (file / "cache").string();  // below a regular file: cannot be created
  ::testing::internal::CaptureStderr();
  auto p = compile_graph_cpu(*fused_, o);
  const std::string err = ::testing::internal::GetCapturedStderr();
  ASSERT_TRUE(p) << p.message();
  EXPECT_EQ((*p)->cache_status, "miss");
  EXPECT_EQ(count_lines(err), 1) << err;
  EXPECT_EQ(err.rfind("kiln: warning: ", 0), 0u) << err;
  auto ref = runtime::run_graph(*eager_, feeds());
  ASSERT_TRUE(ref);
  expect_same_outputs(run(**p), *ref);
}

TEST_F(CompileCache, CompileTimesOfMissAndHit) {
  // Not a speed assertion beyond "a hit skips LLVM": prints the numbers for the report.
  auto t0 = std::chrono::steady_clock::now();
  auto p1 = compile();
  const double miss_s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  clear_cpu_memory_cache();
  t0 = std::chrono::steady_clock::now();
  auto p2 = compile();
  const double disk_s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  t0 = std::chrono::steady_clock::now();
  auto p3 = compile();
  const double mem_s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  ASSERT_TRUE(p1 && p2 && p3);
  EXPECT_EQ(p2->cache_status, "disk hit");
  EXPECT_EQ(p3->cache_status, "memory hit");
  const auto& st = p1->module->stats();
  std::printf(
      "compile_graph_cpu: miss %.4f s (emit %.4f, O3 %.4f, object+link %.4f); disk hit %.4f s; memory hit %.5f s\n",
      miss_s, st.emit_s, st.optimize_s, st.codegen_s, disk_s, mem_s);
}

}  // namespace
}  // namespace kiln::codegen
