// Every op the compiled backend generates, against the eager interpreter (DESIGN.md
// invariant 4, issue 7's per-op differential test): each pointwise op with a scalar rule
// and each generated reduction, as a small graph on seeded random inputs with numpy
// broadcasting (a [4, 1, 6] operand against [4, 5, 6] and a [6] operand), in f32, bf16
// and f64 where the op takes floats; the fusion pass groups the graph, codegen compiles
// it, and the generated result must match the eager kernels:
//   f32 and f64: bit-identical for arithmetic (same operations in the same order),
//                1e-6 relative for transcendentals (same libm, but LLVM may pick
//                another libm entry point), sums bit-identical (both accumulate in double);
//   bf16:        at most one bf16 ulp (2^-8 relative) apart;
//   row ops (Softmax family, LayerNormalization, the per-row cross entropy; one "row"
//                kernel each; a row op's dtype here is its input's): the eager
//                kernels compute in double, the generated ones in f32 with double
//                sums: 1e-5 relative in f32, 1e-12 in f64, one bf16 ulp in bf16.
// Each case also checks that the compiled program really has a generated kernel, and runs
// again with symbolic input dims (one kernel with run-time extents, issue 32) at two
// bindings of its symbols, with the same tolerances.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <random>
#include <set>

#include "codegen/cpu/program.h"
#include "compiled_run.h"
#include "ir/op_table.h"
#include "ir/verifier.h"
#include "passes/pass.h"
#include "runtime/interpreter.h"

using namespace kiln;
using ir::DType;

namespace {

ir::Tensor random_tensor(DType dt, std::vector<int64_t> dims, double lo, double hi, uint64_t seed) {
  std::mt19937_64 g(seed);
  std::uniform_real_distribution<double> u(lo, hi);
  ir::Tensor t(dt, std::move(dims));
  for (int64_t i = 0; i < t.numel(); ++i) {
    double v = u(g);
    if (dt == DType::boolean) v = v > 0.5 * (lo + hi) ? 1 : 0;
    t.set_f64(i, v);
  }
  return t;
}

struct OpCase {
  std::string op;
  DType dtype;
  std::vector<DType> in_dtypes;            // per input
  std::vector<std::vector<int64_t>> dims;  // per input
  ir::Attributes attrs;
  double lo = -2, hi = 2;
  bool transcendental = false;
  bool reduction = false;
  bool row = false;  // a row op (OpDef::row): one "row" kernel
};

std::string case_name(const OpCase& c) { return c.op + "_" + ir::dtype_name(c.dtype); }
/// gtest prints parameters with this (stable ctest names and readable failures).
void PrintTo(const OpCase& c, std::ostream* os) { *os << case_name(c); }

std::vector<OpCase> cases() {
  std::vector<OpCase> v;
  const std::vector<int64_t> full = {4, 5, 6}, mid = {4, 1, 6}, row = {6};
  for (DType dt : {DType::f32, DType::bf16, DType::f64}) {
    for (const char* op : {"Add", "Sub", "Mul", "Div", "Max", "Min"})
      v.push_back({op, dt, {dt, dt}, {full, mid}, {}, -2, 2});
    v.push_back({"Pow", dt, {dt, dt}, {full, row}, {}, 0.5, 2, true});
    for (const char* op : {"Neg", "Abs", "Relu", "Reciprocal", "Sigmoid", "LeakyRelu"})
      v.push_back({op, dt, {dt}, {full}, {}, -2, 2, std::string(op) == "Sigmoid"});
    for (const char* op : {"Sqrt", "Log"}) v.push_back({op, dt, {dt}, {full}, {}, 0.1, 3, true});
    for (const char* op : {"Exp", "Tanh", "Erf", "Sin", "Cos"}) v.push_back({op, dt, {dt}, {full}, {}, -2, 2, true});
    {
      OpCase g{"Gelu", dt, {dt}, {full}, {}, -3, 3, true};
      v.push_back(g);
      g.attrs.set("approximate", std::string("tanh"));
      g.op = "Gelu";
      v.push_back(g);
    }
    v.push_back({"GeluGrad", dt, {dt, dt}, {full, full}, {}, -3, 3, true});
    for (const char* op : {"Floor", "Ceil", "Round", "Sign"}) v.push_back({op, dt, {dt}, {full}, {}, -3, 3});
    for (const char* op : {"IsNaN", "IsInf"}) v.push_back({op, DType::boolean, {dt}, {full}, {}, -3, 3});
    {
      OpCase m{"Mod", dt, {dt, dt}, {full, mid}, {}, -3, 3};
      v.push_back(m);  // floor mod (Mod-28 for floats)
      m.attrs.set("fmod", int64_t(1));
      v.push_back(m);
    }
    {
      OpCase c{"Clip", dt, {dt}, {full}, {}, -2, 2};
      c.attrs.set("min", -0.5);
      c.attrs.set("max", 0.75);
      v.push_back(c);
    }
    v.push_back({"Where", dt, {DType::boolean, dt, dt}, {mid, full, row}, {}, -2, 2});
    for (const char* op : {"Equal", "Less", "LessOrEqual", "Greater", "GreaterOrEqual"})
      v.push_back({op, DType::boolean, {dt, dt}, {full, mid}, {}, -1, 1});
    {
      OpCase c{"Cast", DType::f32, {dt}, {full}, {}, -3, 3};
      c.attrs.set("to", static_cast<int64_t>(ir::dtype_to_onnx(dt == DType::f32 ? DType::bf16 : DType::f32)));
      c.dtype = dt == DType::f32 ? DType::bf16 : DType::f32;
      v.push_back(c);
    }
    for (const char* op : {"ReduceSum", "ReduceMax"}) {
      OpCase r{op, dt, {dt}, {full}, {}, -2, 2};
      r.reduction = true;
      v.push_back(r);
    }
    {
      // A Transpose is a generated strided copy (its input read with permuted strides).
      OpCase t{"Transpose", dt, {dt}, {full}, {}, -2, 2};
      t.attrs.set("perm", std::vector<int64_t>{2, 0, 1});
      v.push_back(t);
    }
    // Row ops over the last axis (and LayerNormalization over the last two).
    for (const char* op : {"Softmax", "LogSoftmax"}) {
      OpCase r{op, dt, {dt}, {full}, {}, -4, 4, true};
      r.row = true;
      v.push_back(r);
    }
    {
      OpCase r{"SoftmaxGrad", dt, {dt, dt}, {full, full}, {}, 0.01, 0.5, true};
      r.row = true;
      v.push_back(r);
      r.op = "LogSoftmaxGrad";
      r.lo = -3;
      r.hi = -0.1;
      v.push_back(r);
    }
    {
      OpCase r{"LayerNormalization", dt, {dt, dt, dt}, {full, row, row}, {}, -2, 2, true};
      r.row = true;
      v.push_back(r);
      r.dims = {full, {5, 6}, {5, 6}};
      r.attrs.set("axis", int64_t(1));
      v.push_back(r);
    }
    {
      // dX of LayerNormalization (passes/decompose.cpp's row part): (dY, X, Scale).
      OpCase r{"LayerNormalizationInputGrad", dt, {dt, dt, dt}, {full, full, row}, {}, -2, 2, true};
      r.row = true;
      v.push_back(r);
    }
    {
      // The per-row cross entropy of the decomposed forward loss (passes/decompose.cpp):
      // (scores (N, C), labels (N, 1), classes 0..C-1), f64 result; feeds set below.
      OpCase r{"SoftmaxCrossEntropyRows", dt, {dt, DType::i64, DType::i64}, {{5, 6}, {5, 1}, {6}}, {}, -4, 4, true};
      r.row = true;
      v.push_back(r);
      r.attrs.set("ignore_index", int64_t(3));  // rows whose label is 3 give 0
      v.push_back(r);
    }
  }
  for (const char* op : {"And", "Or", "Xor"})
    v.push_back({op, DType::boolean, {DType::boolean, DType::boolean}, {full, mid}, {}, 0, 1});
  v.push_back({"Not", DType::boolean, {DType::boolean}, {full}, {}, 0, 1});
  v.push_back({"Add", DType::i64, {DType::i64, DType::i64}, {full, row}, {}, -50, 50});
  v.push_back({"Mul", DType::i64, {DType::i64, DType::i64}, {full, row}, {}, -50, 50});
  {
    OpCase c{"Cast", DType::f32, {DType::i64}, {full}, {}, -50, 50};
    c.attrs.set("to", static_cast<int64_t>(ir::dtype_to_onnx(DType::f32)));
    v.push_back(c);
  }
  // Cast to bool: x != 0 (an int64 attention mask cast to bool); zeros, NaN, -0 set below.
  for (DType dt : {DType::i64, DType::f32, DType::bf16}) {
    OpCase c{"Cast", DType::boolean, {dt}, {full}, {}, -2, 2};
    c.attrs.set("to", static_cast<int64_t>(ir::dtype_to_onnx(DType::boolean)));
    v.push_back(c);
  }
  return v;
}

class OpsCompiled : public ::testing::TestWithParam<OpCase> {};

/// Builds case `c`'s graph, runs it eagerly and through its generated kernel, and
/// compares (tolerances in the file comment). `symbolic`: every input dim of extent > 1
/// is a symbol named after its extent (4 -> n, 5 -> m, 6 -> k), so the fusion pass and
/// the code generator see symbolic shapes and the kernel takes its extents at launch
/// (issue 32); the one compiled program then also runs at a second binding (n=2, m=3,
/// k=9), each run against the eager result of the same inputs.
void check_case(const OpCase& c, bool symbolic) {
  runtime::register_eager_kernels();
  const std::map<int64_t, std::string> names = {{4, "n"}, {5, "m"}, {6, "k"}};
  auto shape_of = [&](const std::vector<int64_t>& d) {
    if (!symbolic) return ir::Shape::of(d);
    ir::Shape s;
    for (int64_t e : d) s.dims.push_back(e > 1 ? ir::Dim(names.at(e)) : ir::Dim(e));
    return s;
  };
  // y = op(inputs); for pointwise ops also z = y * y so the kernel fuses two nodes.
  ir::Graph g;
  std::vector<ir::Value*> ins;
  for (size_t i = 0; i < c.in_dtypes.size(); ++i)
    ins.push_back(g.add_input("x" + std::to_string(i), c.in_dtypes[i], shape_of(c.dims[i])));
  if (c.op == "ReduceSum") {
    // Bias-gradient shape: sum over the leading dims of x*x, keepdims 0.
    ir::Value* sq = g.add_node("Mul", "sq", {ins[0], ins[0]}, {"sq"})->outputs[0];
    ir::Value* axes = g.add_initializer("axes", ir::Tensor::from_i64({0, 1}));
    ir::Attributes a;
    a.set("keepdims", int64_t(0));
    g.outputs.push_back(g.add_node("ReduceSum", "sum", {sq, axes}, {"y"}, a)->outputs[0]);
  } else {
    ir::Node* n = g.add_node(c.op, "op", ins, {"y"}, c.attrs);
    g.outputs.push_back(n->outputs[0]);
  }
  ASSERT_TRUE(ir::infer_graph(g).is_ok());
  ASSERT_TRUE(ir::verify_graph(g).is_ok());
  auto fused = g.clone();
  passes::PassContext ctx;
  ctx.verify_each = true;
  auto st = passes::run_pipeline(*fused, {"fusion"}, ctx);
  ASSERT_TRUE(st.is_ok()) << st.message();
  auto prog = codegen::compile_graph_cpu(*fused);
  ASSERT_TRUE(prog) << prog.message();
  ASSERT_EQ((*prog)->kernels.size(), 1u) << "expected one generated kernel";
  EXPECT_EQ((*prog)->kernels[0].is_symbolic(), symbolic) << (*prog)->kernels[0].to_string();

  std::vector<std::map<int64_t, int64_t>> bindings = {{{4, 4}, {5, 5}, {6, 6}}};
  if (symbolic) bindings.push_back({{4, 2}, {5, 3}, {6, 9}});
  for (const auto& at : bindings) {
    std::map<std::string, ir::Tensor> feeds;
    std::vector<std::vector<int64_t>> dims = c.dims;
    for (auto& d : dims)
      for (int64_t& e : d) e = e > 1 ? at.at(e) : e;
    for (size_t i = 0; i < c.in_dtypes.size(); ++i)
      feeds["x" + std::to_string(i)] = random_tensor(c.in_dtypes[i], dims[i], c.lo, c.hi, 1000 + i);
    if (c.op == "SoftmaxCrossEntropyRows") {  // labels in [0, C), classes 0..C-1
      const int64_t rows = dims[0][0], classes = dims[0][1];
      for (int64_t i = 0; i < rows; ++i) feeds["x1"].set_f64(i, static_cast<double>((i * 2) % classes));
      for (int64_t i = 0; i < classes; ++i) feeds["x2"].set_f64(i, static_cast<double>(i));
    }
    if (c.op == "Cast" && c.dtype == DType::boolean) {  // zeros, a NaN and -0.0 for x != 0
      for (int64_t i = 0; i < feeds["x0"].numel(); i += 3) feeds["x0"].set_f64(i, 0.0);
      if (ir::is_float(c.in_dtypes[0])) {
        feeds["x0"].set_f64(1, std::nan(""));
        feeds["x0"].set_f64(4, -0.0);
      }
    }
    const std::string where = symbolic ? " at n=" + std::to_string(at.at(4)) + " m=" + std::to_string(at.at(5)) +
                                             " k=" + std::to_string(at.at(6))
                                       : std::string();
    auto ref = runtime::run_graph(g, feeds);
    ASSERT_TRUE(ref) << ref.message() << where;
    runtime::RunOptions ro;
    ro.program = prog->get();
    auto got = runtime::run_graph(*fused, feeds, ro);
    ASSERT_TRUE(got) << got.message() << where;

    const ir::Tensor& a = got->at("y");
    const ir::Tensor& b = ref->at("y");
    ASSERT_EQ(a.dims(), b.dims()) << where;
    ASSERT_EQ(a.dtype(), b.dtype());
    // Row ops: the eager kernels compute in double, the generated ones in f32 (f64 for f64)
    // with double sums: 1e-5 relative in f32, 1e-12 in f64, one bf16 ulp.
    double tol = c.dtype == DType::bf16 ? std::ldexp(1.0, -8) : c.transcendental ? 1e-6 : 0.0;
    if (c.row && c.dtype == DType::f32) tol = 1e-5;
    if (c.row && c.dtype == DType::f64) tol = 1e-12;
    for (int64_t i = 0; i < b.numel(); ++i) {
      const double x = a.get_f64(i), r = b.get_f64(i);
      if (std::isnan(r)) {
        EXPECT_TRUE(std::isnan(x)) << "element " << i << where;
        continue;
      }
      EXPECT_LE(std::fabs(x - r), tol * std::max(1.0, std::fabs(r)))
          << "element " << i << ": compiled " << x << ", eager " << r << where;
    }
  }
}

TEST_P(OpsCompiled, MatchesEager) { check_case(GetParam(), false); }

TEST_P(OpsCompiled, MatchesEagerWithSymbolicExtents) { check_case(GetParam(), true); }

/// A bias-gradient column sum long enough to be split into row partitions
/// (ir::column_sum_partitions): compiled and eager add in the same partitioned order, so
/// the results agree bit for bit even where the order decides the f32 result. The rows
/// nearly cancel pairwise (+a, -a + tiny, a up to 2^20), so double rounding of the
/// running sum shows in the f32 result: at least one column must differ from the plain
/// index-order double sum, or the order would not be tested.
TEST(OpsCompiled, SplitColumnSumMatchesEagerBitForBit) {
  runtime::register_eager_kernels();
  const int64_t rows = 6000, cols = 40;
  ir::Graph g;
  ir::Value* x = g.add_input("x", DType::f32, ir::Shape::of({rows, cols}));
  ir::Value* axes = g.add_initializer("axes", ir::Tensor::from_i64({0}));
  ir::Attributes a;
  a.set("keepdims", int64_t(0));
  g.outputs.push_back(g.add_node("ReduceSum", "sum", {x, axes}, {"y"}, a)->outputs[0]);
  ASSERT_TRUE(ir::infer_graph(g).is_ok());
  std::mt19937_64 gen(7);
  std::uniform_real_distribution<double> big(-1.0, 1.0), tiny(0.0, 1.0);
  ir::Tensor xt(DType::f32, {rows, cols});
  float* xp = xt.data<float>();
  for (int64_t r = 0; r < rows; r += 2)
    for (int64_t c = 0; c < cols; ++c) {
      const float v = static_cast<float>(std::ldexp(big(gen), static_cast<int>(gen() % 21)));
      xp[r * cols + c] = v;
      xp[(r + 1) * cols + c] = -v + static_cast<float>(std::ldexp(tiny(gen), -30));
    }
  std::map<std::string, ir::Tensor> feeds{{"x", xt}};
  auto ref = runtime::run_graph(g, feeds);
  ASSERT_TRUE(ref) << ref.message();
  auto fused = g.clone();
  passes::PassContext ctx;
  ASSERT_TRUE(passes::run_pipeline(*fused, {"fusion"}, ctx).is_ok());
  std::shared_ptr<codegen::CpuProgram> prog;
  auto got = kiln::testing::run_compiled(*fused, feeds, &prog);
  ASSERT_TRUE(got) << got.message();
  ASSERT_EQ(prog->kernels.size(), 1u);
  EXPECT_EQ(prog->kernels[0].column_split_parts(), 16);
  const float* yc = got->at("y").data<float>();
  const float* ye = ref->at("y").data<float>();
  int order_matters = 0;
  for (int64_t c = 0; c < cols; ++c) {
    EXPECT_EQ(std::memcmp(&yc[c], &ye[c], 4), 0) << "column " << c << ": compiled " << yc[c] << ", eager " << ye[c];
    double seq = 0;
    for (int64_t r = 0; r < rows; ++r) seq += xp[r * cols + c];
    order_matters += static_cast<float>(seq) != ye[c];
  }
  EXPECT_GT(order_matters, 0) << "no column's f32 sum depends on the order: the test does not test it";
}

/// Shapes where the eager ReduceSum and the generated kernel see the split condition
/// differently unless both decide from the shape alone: a size-1 kept dim before the
/// reduced one ([1, 1024, 64] over axis 1), a size-1 reduced dim after the kept one
/// ([1024, 64, 1] over axes 0 and 2), and kept dims a broadcast input keeps from
/// merging (Add(x [1024, 8, 8], b [8, 1]) summed over axis 0). The data makes the order
/// visible: in every column +1e17 at flat row 0, -1e17 at row 256, 1 elsewhere (index
/// order gives 767, four partitions 512, in f32 and in f64, which follows the same
/// order). Compiled must equal eager bit for bit.
TEST(OpsCompiled, SplitColumnSumOrderDecidedFromTheShape) {
  runtime::register_eager_kernels();
  struct Case {
    std::vector<int64_t> x_dims;
    std::vector<int64_t> axes;
    bool add_bias;
    DType dt = DType::f32;
  };
  for (const Case& c : {Case{{1, 1024, 64}, {1}, false}, Case{{1024, 64, 1}, {0, 2}, false},
                        Case{{1024, 8, 8}, {0}, true}, Case{{1024, 64}, {0}, false, DType::f64}}) {
    std::string dims;
    for (int64_t d : c.x_dims) dims += " " + std::to_string(d);
    SCOPED_TRACE("x dims" + dims + (c.dt == DType::f64 ? " f64" : " f32"));
    ir::Graph g;
    ir::Value* x = g.add_input("x", c.dt, ir::Shape::of(c.x_dims));
    std::map<std::string, ir::Tensor> feeds;
    ir::Tensor xt(c.dt, c.x_dims);
    const int64_t cols = 64, n = xt.numel();
    for (int64_t i = 0; i < n; ++i) xt.set_f64(i, i < cols ? 1e17 : (i / cols == 256 ? -1e17 : 1.0));
    feeds["x"] = xt;
    ir::Value* in = x;
    if (c.add_bias) {
      ir::Value* b = g.add_input("b", DType::f32, ir::Shape::of({8, 1}));
      feeds["b"] = ir::Tensor(DType::f32, {8, 1});  // zeros
      in = g.add_node("Add", "add", {x, b}, {"xb"})->outputs[0];
    }
    ir::Value* axes = g.add_initializer("axes", ir::Tensor::from_i64(c.axes));
    ir::Attributes a;
    a.set("keepdims", int64_t(0));
    g.outputs.push_back(g.add_node("ReduceSum", "sum", {in, axes}, {"y"}, a)->outputs[0]);
    ASSERT_TRUE(ir::infer_graph(g).is_ok());
    auto ref = runtime::run_graph(g, feeds);
    ASSERT_TRUE(ref) << ref.message();
    auto fused = g.clone();
    passes::PassContext ctx;
    ASSERT_TRUE(passes::run_pipeline(*fused, {"fusion"}, ctx).is_ok());
    auto got = kiln::testing::run_compiled(*fused, feeds);
    ASSERT_TRUE(got) << got.message();
    const ir::Tensor& yc = got->at("y");
    const ir::Tensor& ye = ref->at("y");
    ASSERT_EQ(yc.numel(), cols);
    for (int64_t i = 0; i < cols; ++i) {
      EXPECT_EQ(ye.get_f64(i), 512.0) << "eager does not sum in four partitions, column " << i;
      EXPECT_EQ(yc.get_f64(i), ye.get_f64(i)) << "column " << i;
    }
  }
}

TEST(OpsCompiled, EveryGeneratedOpHasACase) {
  std::set<std::string> covered;
  for (const OpCase& c : cases()) covered.insert(c.op);
  const std::set<std::string> no_case = {"CastLike"};  // same rule as Cast
  for (auto& [name, d] : ir::OpTable::get().all())
    if ((d.scalar || d.reduce_combine || d.row) && !no_case.count(name))
      EXPECT_TRUE(covered.count(name)) << name << " is generated but has no compiled-vs-eager case";
}

INSTANTIATE_TEST_SUITE_P(AllGenerated, OpsCompiled, ::testing::ValuesIn(cases()),
                         [](const ::testing::TestParamInfo<OpCase>& i) {
                           return case_name(i.param) + "_" + std::to_string(i.index);
                         });

}  // namespace
