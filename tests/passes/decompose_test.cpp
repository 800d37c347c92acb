// decompose pass (passes/decompose.cpp): LayerNormalizationGrad,
// SoftmaxCrossEntropyLossGrad and the forward SoftmaxCrossEntropyLoss split into ops the
// fusion pass generates. Each case runs
// the original node (eager kernel), the decomposed graph (eager kernels of its ops) and
// the decomposed graph after fusion with generated kernels, against a float64 reference
// computed here from the formulas (PyTorch's layer_norm backward; softmax minus one-hot
// for cross-entropy with ignore_index). Tolerance: 1e-5 relative to the largest
// reference element for f32 results (the generated softmax uses an f32 exp).
#include <gtest/gtest.h>

#include <cmath>
#include <random>

#include "codegen/cpu/program.h"
#include "ir/verifier.h"
#include "passes/pass.h"
#include "passes/training_util.h"
#include "runtime/interpreter.h"

using namespace kiln;
using ir::DType;

namespace {

ir::Tensor random_f32(std::vector<int64_t> dims, uint64_t seed, double scale = 1.0) {
  std::mt19937_64 g(seed);
  std::normal_distribution<double> u(0, scale);
  ir::Tensor t(DType::f32, std::move(dims));
  for (int64_t i = 0; i < t.numel(); ++i) t.set_f64(i, u(g));
  return t;
}

using Results = std::map<std::string, ir::Tensor>;

/// Runs `g` three ways: as is, decomposed (eager) and decomposed + fused (generated
/// kernels). Checks the decomposition happened (no `op` node left, `expect_op` present).
std::vector<Results> run_three_ways(const ir::Graph& g, const std::map<std::string, ir::Tensor>& feeds,
                                    const std::string& op, const std::string& expect_op) {
  runtime::register_eager_kernels();
  std::vector<Results> out;
  auto plain = runtime::run_graph(g, feeds);
  EXPECT_TRUE(plain) << plain.message();
  if (!plain) return {};
  out.push_back(*plain);

  auto dec = g.clone();
  passes::PassContext ctx;
  ctx.verify_each = true;
  EXPECT_TRUE(passes::run_pipeline(*dec, {"decompose"}, ctx).is_ok());
  EXPECT_TRUE(ir::verify_graph(*dec).is_ok());
  bool found = false;
  for (auto& n : dec->nodes()) {
    EXPECT_NE(n->op, op) << "not decomposed";
    found |= n->op == expect_op;
  }
  EXPECT_TRUE(found) << expect_op << " missing";
  auto eager = runtime::run_graph(*dec, feeds);
  EXPECT_TRUE(eager) << eager.message();
  if (!eager) return {};
  out.push_back(*eager);

  auto fused = dec->clone();
  EXPECT_TRUE(passes::run_pipeline(*fused, {"fusion"}, ctx).is_ok());
  int kernels = 0;
  for (auto& n : fused->nodes()) kernels += n->op == "FusedKernel";
  EXPECT_GT(kernels, 0);
  auto prog = codegen::compile_graph_cpu(*fused);
  EXPECT_TRUE(prog) << prog.message();
  if (!prog) return {};
  runtime::RunOptions ro;
  ro.program = prog->get();
  auto gen = runtime::run_graph(*fused, feeds, ro);
  EXPECT_TRUE(gen) << gen.message();
  if (!gen) return {};
  out.push_back(*gen);
  return out;
}

void expect_close(const ir::Tensor& got, const std::vector<double>& ref, double rel, const std::string& what) {
  ASSERT_EQ(got.numel(), static_cast<int64_t>(ref.size())) << what;
  double scale = 0;
  for (double v : ref) scale = std::max(scale, std::fabs(v));
  for (size_t i = 0; i < ref.size(); ++i)
    ASSERT_NEAR(got.get_f64(static_cast<int64_t>(i)), ref[i], rel * std::max(scale, 1e-30)) << what << " element " << i;
}

TEST(Decompose, LayerNormalizationGradMatchesFloat64Reference) {
  const int64_t B = 3, T = 5, D = 48;
  ir::Graph g;
  ir::Value* dy = g.add_input("dY", DType::f32, ir::Shape::of({B, T, D}));
  ir::Value* x = g.add_input("X", DType::f32, ir::Shape::of({B, T, D}));
  ir::Value* s = g.add_input("Scale", DType::f32, ir::Shape::of({D}));
  ir::Attributes a;
  a.set("axis", int64_t(-1));
  a.set("epsilon", 1e-5);
  auto* n = g.add_node("LayerNormalizationGrad", "ln_grad", {dy, x, s}, {"dX", "dScale", "dB"}, a);
  g.outputs = {n->outputs[0], n->outputs[1], n->outputs[2]};
  ASSERT_TRUE(ir::infer_graph(g).is_ok());
  std::map<std::string, ir::Tensor> feeds = {
      {"dY", random_f32({B, T, D}, 1)}, {"X", random_f32({B, T, D}, 2, 3.0)}, {"Scale", random_f32({D}, 3)}};
  auto res = run_three_ways(g, feeds, "LayerNormalizationGrad", "LayerNormalizationInputGrad");
  ASSERT_EQ(res.size(), 3u);

  // float64 reference: xhat = (x - mu) * inv, g = dy * scale,
  // dX = inv * (g - mean(g) - xhat * mean(g * xhat)), dScale = sum_rows dy * xhat, dB = sum_rows dy.
  const ir::Tensor &X = feeds["X"], &DY = feeds["dY"], &S = feeds["Scale"];
  const int64_t R = B * T;
  std::vector<double> dx(R * D), ds(D, 0.0), db(D, 0.0);
  for (int64_t r = 0; r < R; ++r) {
    double mu = 0, var = 0;
    for (int64_t j = 0; j < D; ++j) mu += X.get_f64(r * D + j);
    mu /= D;
    for (int64_t j = 0; j < D; ++j) var += std::pow(X.get_f64(r * D + j) - mu, 2);
    const double inv = 1 / std::sqrt(var / D + 1e-5);
    double mg = 0, mgx = 0;
    for (int64_t j = 0; j < D; ++j) {
      const double xh = (X.get_f64(r * D + j) - mu) * inv, gg = DY.get_f64(r * D + j) * S.get_f64(j);
      mg += gg / D;
      mgx += gg * xh / D;
      ds[j] += DY.get_f64(r * D + j) * xh;
      db[j] += DY.get_f64(r * D + j);
    }
    for (int64_t j = 0; j < D; ++j) {
      const double xh = (X.get_f64(r * D + j) - mu) * inv, gg = DY.get_f64(r * D + j) * S.get_f64(j);
      dx[r * D + j] = inv * (gg - mg - xh * mgx);
    }
  }
  const char* way[] = {"original", "decomposed eager", "decomposed compiled"};
  for (int w = 0; w < 3; ++w) {
    expect_close(res[w].at("dX"), dx, 1e-5, std::string(way[w]) + " dX");
    expect_close(res[w].at("dScale"), ds, 1e-5, std::string(way[w]) + " dScale");
    expect_close(res[w].at("dB"), db, 1e-5, std::string(way[w]) + " dB");
  }
}

/// Cross-entropy gradient for one reduction, with some labels ignored (-100).
void check_sce_grad(const std::string& reduction, int64_t N, int64_t C, bool ignore) {
  SCOPED_TRACE(reduction + " N=" + std::to_string(N) + " C=" + std::to_string(C));
  ir::Graph g;
  const bool none = reduction == "none";
  ir::Value* dl = g.add_input("dL", DType::f32, none ? ir::Shape::of({N}) : ir::Shape());
  ir::Value* x = g.add_input("X", DType::f32, ir::Shape::of({N, C}));
  ir::Value* l = g.add_input("labels", DType::i64, ir::Shape::of({N}));
  ir::Attributes a;
  a.set("reduction", reduction);
  if (ignore) a.set("ignore_index", int64_t(-100));
  auto* n = g.add_node("SoftmaxCrossEntropyLossGrad", "sce_grad", {dl, x, l}, {"dX"}, a);
  g.outputs = {n->outputs[0]};
  ASSERT_TRUE(ir::infer_graph(g).is_ok());
  std::mt19937_64 rng(7);
  ir::Tensor labels(DType::i64, {N});
  int64_t valid = 0;
  for (int64_t i = 0; i < N; ++i) {
    const bool skip = ignore && i % 3 == 1;
    labels.set_f64(i, skip ? -100.0 : static_cast<double>(rng() % C));
    valid += !skip;
  }
  ir::Tensor dL = none ? random_f32({N}, 5) : ir::Tensor(DType::f32, {});
  if (!none) dL.set_f64(0, 0.75);
  std::map<std::string, ir::Tensor> feeds = {{"dL", dL}, {"X", random_f32({N, C}, 4, 4.0)}, {"labels", labels}};
  auto res = run_three_ways(g, feeds, "SoftmaxCrossEntropyLossGrad", "Softmax");
  ASSERT_EQ(res.size(), 3u);

  const ir::Tensor& X = feeds["X"];
  std::vector<double> dx(N * C, 0.0);
  for (int64_t r = 0; r < N; ++r) {
    const int64_t lab = labels.get_i64(r);
    if (ignore && lab == -100) continue;
    double coef = none ? dL.get_f64(r) : dL.get_f64(0);
    if (reduction == "mean") coef /= static_cast<double>(valid);
    double m = -INFINITY, sum = 0;
    for (int64_t c = 0; c < C; ++c) m = std::max(m, X.get_f64(r * C + c));
    for (int64_t c = 0; c < C; ++c) sum += std::exp(X.get_f64(r * C + c) - m);
    for (int64_t c = 0; c < C; ++c)
      dx[r * C + c] = coef * (std::exp(X.get_f64(r * C + c) - m) / sum - (c == lab ? 1.0 : 0.0));
  }
  const char* way[] = {"original", "decomposed eager", "decomposed compiled"};
  for (int w = 0; w < 3; ++w) expect_close(res[w].at("dX"), dx, 1e-5, std::string(way[w]) + " dX");
}

TEST(Decompose, SoftmaxCrossEntropyLossGradMatchesFloat64Reference) {
  for (const char* r : {"mean", "sum", "none"}) check_sce_grad(r, 37, 11, true);
  check_sce_grad("mean", 16, 10, false);
  check_sce_grad("mean", 64, 300, true);
}

TEST(Decompose, AllLabelsIgnoredGiveZeroGradientNotNaN) {
  // The eager kernel writes 0 for ignored positions even when every label is ignored
  // (mean over zero labels); the decomposition must not turn that into 0/0.
  ir::Graph g;
  ir::Value* dl = g.add_input("dL", DType::f32, ir::Shape());
  ir::Value* x = g.add_input("X", DType::f32, ir::Shape::of({4, 5}));
  ir::Value* l = g.add_input("labels", DType::i64, ir::Shape::of({4}));
  ir::Attributes a;
  a.set("reduction", std::string("mean"));
  a.set("ignore_index", int64_t(-100));
  g.outputs = {g.add_node("SoftmaxCrossEntropyLossGrad", "sce_grad", {dl, x, l}, {"dX"}, a)->outputs[0]};
  ASSERT_TRUE(ir::infer_graph(g).is_ok());
  ir::Tensor dL(DType::f32, {});
  dL.set_f64(0, 1.0);
  ir::Tensor labels(DType::i64, {4});
  for (int64_t i = 0; i < 4; ++i) labels.set_f64(i, -100.0);
  auto res = run_three_ways(g, {{"dL", dL}, {"X", random_f32({4, 5}, 9)}, {"labels", labels}},
                            "SoftmaxCrossEntropyLossGrad", "Softmax");
  ASSERT_EQ(res.size(), 3u);
  for (auto& r : res)
    for (int64_t i = 0; i < 20; ++i) EXPECT_EQ(r.at("dX").get_f64(i), 0.0) << i;
}

/// g = SoftmaxCrossEntropyLoss(X f32 (N, C), labels (N), reduction, ignore_index -100 if
/// `ignore`) -> "loss", inferred.
void sce_loss_graph(ir::Graph& g, int64_t N, int64_t C, const std::string& reduction = "mean", bool ignore = true,
                    DType label_dtype = DType::i64) {
  ir::Value* x = g.add_input("X", DType::f32, ir::Shape::of({N, C}));
  ir::Value* l = g.add_input("labels", label_dtype, ir::Shape::of({N}));
  ir::Attributes a;
  a.set("reduction", reduction);
  if (ignore) a.set("ignore_index", int64_t(-100));
  g.outputs = {g.add_node("SoftmaxCrossEntropyLoss", "sce", {x, l}, {"loss"}, a)->outputs[0]};
  ASSERT_TRUE(ir::infer_graph(g).is_ok());
}

/// Forward cross entropy for one reduction against a float64 reference (log-sum-exp
/// with the max subtracted, minus the label's score; ignored labels excluded from the
/// sum and the count). Also checks that after fusion the per-row part is a generated
/// row kernel (no eager loss node is left).
void check_sce(const std::string& reduction, int64_t N, int64_t C, bool ignore, DType label_dtype = DType::i64) {
  SCOPED_TRACE(reduction + " N=" + std::to_string(N) + " C=" + std::to_string(C) + " labels " +
               ir::dtype_name(label_dtype));
  ir::Graph g;
  sce_loss_graph(g, N, C, reduction, ignore, label_dtype);
  std::mt19937_64 rng(11);
  ir::Tensor labels(label_dtype, {N});
  for (int64_t i = 0; i < N; ++i) labels.set_f64(i, ignore && i % 4 == 2 ? -100.0 : static_cast<double>(rng() % C));
  // Scores up to about +-40: exp without the max subtracted would lose the small terms.
  std::map<std::string, ir::Tensor> feeds = {{"X", random_f32({N, C}, 8, 10.0)}, {"labels", labels}};
  auto res = run_three_ways(g, feeds, "SoftmaxCrossEntropyLoss", "SoftmaxCrossEntropyRows");
  ASSERT_EQ(res.size(), 3u);

  const ir::Tensor& X = feeds["X"];
  std::vector<double> per_row(N, 0.0);
  double total = 0, count = 0;
  for (int64_t r = 0; r < N; ++r) {
    const int64_t lab = labels.get_i64(r);
    if (ignore && lab == -100) continue;
    double m = -INFINITY, sum = 0;
    for (int64_t c = 0; c < C; ++c) m = std::max(m, X.get_f64(r * C + c));
    for (int64_t c = 0; c < C; ++c) sum += std::exp(X.get_f64(r * C + c) - m);
    per_row[r] = std::log(sum) + m - X.get_f64(r * C + lab);
    total += per_row[r];
    count += 1;
  }
  std::vector<double> ref = reduction == "none"  ? per_row
                            : reduction == "sum" ? std::vector<double>{total}
                                                 : std::vector<double>{total / count};
  const char* way[] = {"original", "decomposed eager", "decomposed compiled"};
  for (int w = 0; w < 3; ++w) expect_close(res[w].at("loss"), ref, 1e-5, std::string(way[w]) + " loss");
}

TEST(Decompose, SoftmaxCrossEntropyLossMatchesFloat64Reference) {
  for (const char* r : {"mean", "sum", "none"}) check_sce(r, 37, 11, true);
  check_sce("mean", 16, 10, false);
  check_sce("mean", 64, 300, true, DType::i32);
  check_sce("sum", 512, 256, true);
}

TEST(Decompose, SoftmaxCrossEntropyLossRowsAreOneGeneratedRowKernel) {
  ir::Graph g;
  sce_loss_graph(g, 8, 50);
  passes::PassContext ctx;
  ctx.verify_each = true;
  ASSERT_TRUE(passes::run_pipeline(g, {"decompose", "fusion"}, ctx).is_ok());
  int row_kernels_with_loss = 0;
  for (auto& n : g.nodes()) {
    EXPECT_NE(n->op, "SoftmaxCrossEntropyRows") << "the per-row loss was left to its eager kernel";
    if (n->op == "FusedKernel" && n->attrs.get_string("kind", "") == "row")
      for (auto& m : n->regions[0]->nodes()) row_kernels_with_loss += m->op == "SoftmaxCrossEntropyRows";
  }
  EXPECT_EQ(row_kernels_with_loss, 1);
}

/// Runs decompose and fusion on `g` and compiles its kernels into `prog`.
void compile_decomposed(ir::Graph& g, std::shared_ptr<codegen::CpuProgram>& prog) {
  passes::PassContext ctx;
  ASSERT_TRUE(passes::run_pipeline(g, {"decompose", "fusion"}, ctx).is_ok());
  auto p = codegen::compile_graph_cpu(g);
  ASSERT_TRUE(p) << p.message();
  prog = *p;
}

TEST(Decompose, SoftmaxCrossEntropyLossBadLabelIsAnErrorCompiledToo) {
  // The eager loss kernel rejects a label outside [0, C); the decomposed and generated
  // forms must too (CheckLabels), never index past the row.
  ir::Graph g;
  sce_loss_graph(g, 4, 5);
  std::shared_ptr<codegen::CpuProgram> prog;
  compile_decomposed(g, prog);
  ASSERT_NE(prog, nullptr);
  runtime::RunOptions ro;
  ro.program = prog.get();
  for (double bad : {5.0, -1.0}) {
    ir::Tensor labels(DType::i64, {4});
    labels.set_f64(0, 1);
    labels.set_f64(1, -100);
    labels.set_f64(2, bad);
    labels.set_f64(3, 0);
    auto r = runtime::run_graph(g, {{"X", random_f32({4, 5}, 3)}, {"labels", labels}}, ro);
    ASSERT_FALSE(r) << "label " << bad << " accepted";
    EXPECT_NE(r.message().find("label " + std::to_string(static_cast<int>(bad)) + " at position 2 is outside [0, 5)"),
              std::string::npos)
        << r.message();
    EXPECT_NE(r.message().find("sce"), std::string::npos) << "the message names the loss node: " << r.message();
  }
}

TEST(Decompose, SoftmaxCrossEntropyLossBadTokenLabelIsNamedByItsFedIndex) {
  // Token labels [batch, seq] reach the loss flattened by a Reshape (attach_loss): the
  // error names the element as fed, [1, 1] of [2, 3], besides its flat position 4.
  ir::Graph g;
  ir::Value* x = g.add_input("X", DType::f32, ir::Shape::of({6, 5}));
  ir::Value* l = g.add_input("labels", DType::i64, ir::Shape::of({2, 3}));
  ir::Value* shape = g.add_initializer("flat", ir::Tensor::from_i64({6}));
  ir::Value* flat = g.add_node("Reshape", "flatten", {l, shape}, {"labels_flat"})->outputs[0];
  ir::Attributes a;
  a.set("ignore_index", int64_t(-100));
  g.outputs = {g.add_node("SoftmaxCrossEntropyLoss", "sce", {x, flat}, {"loss"}, a)->outputs[0]};
  ASSERT_TRUE(ir::infer_graph(g).is_ok());
  std::shared_ptr<codegen::CpuProgram> prog;
  compile_decomposed(g, prog);
  ASSERT_NE(prog, nullptr);
  runtime::RunOptions ro;
  ro.program = prog.get();
  ir::Tensor labels(DType::i64, {2, 3});
  for (int64_t i = 0; i < 6; ++i) labels.set_f64(i, i == 4 ? 7.0 : (i == 1 ? -100.0 : 2.0));
  auto r = runtime::run_graph(g, {{"X", random_f32({6, 5}, 5)}, {"labels", labels}}, ro);
  ASSERT_FALSE(r) << "label 7 accepted";
  EXPECT_NE(r.message().find("label 7 at position 4 (index [1, 1] of the labels [2, 3]) is outside [0, 5)"),
            std::string::npos)
      << r.message();
}

TEST(Decompose, SoftmaxCrossEntropyLossAllIgnoredMeanIsNaNAsEager) {
  ir::Graph g;
  sce_loss_graph(g, 3, 4);
  ir::Tensor labels(DType::i64, {3});
  for (int64_t i = 0; i < 3; ++i) labels.set_f64(i, -100.0);
  auto res = run_three_ways(g, {{"X", random_f32({3, 4}, 2)}, {"labels", labels}}, "SoftmaxCrossEntropyLoss",
                            "SoftmaxCrossEntropyRows");
  ASSERT_EQ(res.size(), 3u);
  for (auto& r : res) EXPECT_TRUE(std::isnan(r.at("loss").get_f64(0)));
}

}  // namespace

// ---------------------------------------------------------------- indexing with constant indices
namespace {
// Gathers and scatters whose constant indices are affine in their coordinates become
// AsStrided / AsStridedScatter views, read through strides (or guard boxes) by the
// generated kernel of their reader. The reference is computed here from the ONNX
// definitions of each op (onnx.ai/onnx/operators), independent of kiln's kernels; every
// way must equal it exactly (the ops only move elements; y = 2 * gathered is exact).

/// An i64 tensor of `dims` with element i = f(i).
template <typename F>
ir::Tensor index_tensor(std::vector<int64_t> dims, F f) {
  ir::Tensor t(DType::i64, std::move(dims));
  for (int64_t i = 0; i < t.numel(); ++i) t.set_f64(i, static_cast<double>(f(i)));
  return t;
}

/// Graph: y = 2 * op(data, indices[, updates]) with constant indices; data (and updates) fed.
struct IndexCase {
  std::string op;
  std::vector<int64_t> data_dims;
  ir::Tensor indices;
  std::vector<int64_t> updates_dims;  // scatters only
  ir::Attributes attrs;
  std::vector<double> want;  // y, row-major
};

Results run_index_case(const IndexCase& c, bool expect_rewrite) {
  ir::Graph g;
  ir::Value* data = g.add_input("data", DType::f32, ir::Shape::of(c.data_dims));
  ir::Value* idx = g.add_initializer("indices", c.indices);
  std::vector<ir::Value*> ins = {data, idx};
  std::map<std::string, ir::Tensor> feeds = {{"data", random_f32(c.data_dims, 7)}};
  if (!c.updates_dims.empty()) {
    ins.push_back(g.add_input("updates", DType::f32, ir::Shape::of(c.updates_dims)));
    feeds["updates"] = random_f32(c.updates_dims, 8);
  }
  auto* n = g.add_node(c.op, "index", ins, {"gathered"}, c.attrs);
  ir::Value* two = g.add_initializer("two", ir::Tensor::scalar_f32(2.0f));
  auto* m = g.add_node("Mul", "twice", {n->outputs[0], two}, {"y"});
  g.outputs = {m->outputs[0]};
  EXPECT_TRUE(ir::infer_graph(g).is_ok());
  if (!expect_rewrite) {
    auto dec = g.clone();
    passes::PassContext ctx;
    EXPECT_TRUE(passes::run_pipeline(*dec, {"decompose"}, ctx).is_ok());
    int kept = 0;
    for (auto& k : dec->nodes()) kept += k->op == c.op;
    EXPECT_EQ(kept, 1) << c.op << " with indices that are not affine must stay as it is";
    return {};
  }
  const bool scatter = c.op.rfind("Scatter", 0) == 0;
  {  // the view is read inside the reader's generated kernel: no node outside a kernel
    auto fused = g.clone();
    passes::PassContext ctx;
    EXPECT_TRUE(passes::run_pipeline(*fused, {"decompose", "fusion"}, ctx).is_ok());
    for (auto& k : fused->nodes()) EXPECT_EQ(k->op, "FusedKernel") << c.op << ": " << k->name << " runs eagerly";
  }
  auto res = run_three_ways(g, feeds, c.op, scatter ? "AsStridedScatter" : "AsStrided");
  EXPECT_EQ(res.size(), 3u);
  // The reference, from the definition: element values of data/updates placed by hand.
  std::vector<double> want = c.want;
  const ir::Tensor& d = feeds["data"];
  for (double& w : want) {  // encoded: >= 0 data element, < 0 -(updates element + 1)
    const int64_t e = static_cast<int64_t>(w);
    w = 2.0 * (e >= 0 ? d.get_f64(e) : feeds["updates"].get_f64(-e - 1));
  }
  const char* way[] = {"original", "decomposed eager", "decomposed compiled"};
  for (size_t w = 0; w < res.size(); ++w) expect_close(res[w].at("y"), want, 0.0, c.op + " " + way[w]);
  return res.empty() ? Results{} : res[2];
}

/// Row-major coordinates of element e of dims.
std::vector<int64_t> coords(int64_t e, const std::vector<int64_t>& dims) {
  std::vector<int64_t> c(dims.size());
  for (int d = static_cast<int>(dims.size()) - 1; d >= 0; --d) {
    c[d] = e % dims[d];
    e /= dims[d];
  }
  return c;
}
int64_t offset_of(const std::vector<int64_t>& c, const std::vector<int64_t>& dims) {
  int64_t o = 0;
  for (size_t d = 0; d < dims.size(); ++d) o = o * dims[d] + c[d];
  return o;
}

TEST(Decompose, GatherWithAffineConstantIndicesIsAStridedView) {
  // Gather-13 axis 1: out[a, i, j, b] = data[a, idx[i, j], b], idx = 2 + 3i + j (one
  // negative, wrapped: -6 + 10 = 4).
  IndexCase c{"Gather",
              {3, 10, 4},
              index_tensor({2, 3}, [](int64_t e) { return e == 2 ? -6 : 2 + 3 * (e / 3) + e % 3; }),
              {},
              passes::make_attrs({{"axis", int64_t(1)}}),
              {}};
  const std::vector<int64_t> od = {3, 2, 3, 4}, dd = {3, 10, 4};
  for (int64_t e = 0; e < 3 * 2 * 3 * 4; ++e) {
    auto o = coords(e, od);
    c.want.push_back(static_cast<double>(offset_of({o[0], 2 + 3 * o[1] + o[2], o[3]}, dd)));
  }
  run_index_case(c, true);
  // Position ids 0..T-1 of a position embedding: a leading slice of the table.
  IndexCase p{"Gather", {16, 8}, index_tensor({1, 5}, [](int64_t e) { return e; }), {}, {}, {}};
  for (int64_t e = 0; e < 5 * 8; ++e) p.want.push_back(static_cast<double>(e));
  run_index_case(p, true);
}

TEST(Decompose, GatherElementsAndGatherNDWithAffineIndicesAreStridedViews) {
  // GatherElements-13 axis 0: out[i, j] = data[idx[i, j], j], idx[i, j] = i + 1.
  IndexCase ge{"GatherElements",
               {5, 4},
               index_tensor({3, 4}, [](int64_t e) { return e / 4 + 1; }),
               {},
               passes::make_attrs({{"axis", int64_t(0)}}),
               {}};
  for (int64_t e = 0; e < 12; ++e) ge.want.push_back(static_cast<double>((e / 4 + 1) * 4 + e % 4));
  run_index_case(ge, true);
  // GatherND-13 over broadcast aranges (the attention-mask indexing of BERT's export):
  // idx[i, 0, 0, l] = (i, l) on data [2, 8] -> out [2, 1, 1, 8] = data[i, l].
  IndexCase nd{
      "GatherND", {2, 8}, index_tensor({2, 1, 1, 8, 2}, [](int64_t e) { return e % 2 ? (e / 2) % 8 : e / 16; }),
      {},         {},     {}};
  for (int64_t e = 0; e < 16; ++e) nd.want.push_back(static_cast<double>(e));
  run_index_case(nd, true);
  // batch_dims 1: out[b, j, :] = data[b, idx[b, j, 0], :], idx = j + 1.
  IndexCase nb{"GatherND",
               {2, 5, 3},
               index_tensor({2, 4, 1}, [](int64_t e) { return e % 4 + 1; }),
               {},
               passes::make_attrs({{"batch_dims", int64_t(1)}}),
               {}};
  for (int64_t e = 0; e < 2 * 4 * 3; ++e) {
    auto o = coords(e, {2, 4, 3});
    nb.want.push_back(static_cast<double>(offset_of({o[0], o[1] + 1, o[2]}, {2, 5, 3})));
  }
  run_index_case(nb, true);
}

TEST(Decompose, ScattersWithAffineIndicesAreGuardedViews) {
  // ScatterND-18: rows 1..5 of data [6, 3] replaced by updates [5, 3] (T5's label shift).
  IndexCase nd{"ScatterND", {6, 3}, index_tensor({5, 1}, [](int64_t e) { return e + 1; }), {5, 3}, {}, {}};
  for (int64_t e = 0; e < 18; ++e) nd.want.push_back(e < 3 ? static_cast<double>(e) : -static_cast<double>(e - 3) - 1);
  Results r = run_index_case(nd, true);
  // ScatterElements-18 axis 1: column 0 of data [3, 5] replaced (a select assignment).
  IndexCase se{"ScatterElements",
               {3, 5},
               index_tensor({3, 1}, [](int64_t) { return 0; }),
               {3, 1},
               passes::make_attrs({{"axis", int64_t(1)}}),
               {}};
  for (int64_t e = 0; e < 15; ++e)
    se.want.push_back(e % 5 == 0 ? -static_cast<double>(e / 5) - 1 : static_cast<double>(e));
  run_index_case(se, true);
}

TEST(Decompose, IndicesThatAreNotAffineStayGathers) {
  IndexCase g{"Gather", {10, 4}, index_tensor({4}, [](int64_t e) { return (e * e) % 10; }), {}, {}, {}};
  run_index_case(g, false);
  // A scatter with a reduction is not a placement.
  IndexCase a{"ScatterND",
              {6, 3},
              index_tensor({5, 1}, [](int64_t e) { return e + 1; }),
              {5, 3},
              passes::make_attrs({{"reduction", std::string("add")}}),
              {}};
  run_index_case(a, false);
}

// ---------------------------------------------------------------- batch normalization

/// The statistics batch norm uses per channel, in float64: in training mode X's (N, C,
/// S...) batch mean and biased variance, else the given `mean_in` and `var_in` (C).
void bn_reference_stats(const ir::Tensor& X, bool training, const ir::Tensor& mean_in, const ir::Tensor& var_in,
                        std::vector<double>& mean, std::vector<double>& var) {
  const int64_t N = X.dims()[0], C = X.dims()[1], S = X.numel() / (N * C);
  mean.assign(C, 0.0);
  var.assign(C, 0.0);
  for (int64_t c = 0; c < C; ++c) {
    if (!training) {
      mean[c] = mean_in.get_f64(c);
      var[c] = var_in.get_f64(c);
      continue;
    }
    for (int64_t n = 0; n < N; ++n)
      for (int64_t i = 0; i < S; ++i) mean[c] += X.get_f64((n * C + c) * S + i) / static_cast<double>(N * S);
    for (int64_t n = 0; n < N; ++n)
      for (int64_t i = 0; i < S; ++i)
        var[c] += std::pow(X.get_f64((n * C + c) * S + i) - mean[c], 2) / static_cast<double>(N * S);
  }
}

/// BatchNormalization (training_mode 1 or 0) of X [N, C, H, W] against torch.nn.functional.batch_norm's
/// formulas in float64: y = (x - mean) / sqrt(var + eps) * scale + B; training: batch
/// statistics, running_mean = momentum * mean_in + (1 - momentum) * mean (ONNX's momentum
/// weights the old value), running_var with the unbiased batch variance.
void check_bn_forward(bool training) {
  SCOPED_TRACE(training ? "training" : "evaluation");
  const int64_t N = 4, C = 3, H = 5, W = 6;
  const double eps = 1e-5, mom = 0.9;
  ir::Graph g;
  ir::Value* x = g.add_input("X", DType::f32, ir::Shape::of({N, C, H, W}));
  std::vector<ir::Value*> ins = {x};
  for (const char* nm : {"scale", "B", "mean_in", "var_in"})
    ins.push_back(g.add_input(nm, DType::f32, ir::Shape::of({C})));
  ir::Attributes a;
  a.set("epsilon", eps);
  a.set("momentum", mom);
  a.set("training_mode", int64_t(training ? 1 : 0));
  std::vector<std::string> outs = {"Y"};
  if (training) outs = {"Y", "running_mean", "running_var"};
  auto* n = g.add_node("BatchNormalization", "bn", ins, outs, a);
  g.outputs = n->outputs;
  ASSERT_TRUE(ir::infer_graph(g).is_ok());
  ir::Tensor var_in = random_f32({C}, 14);
  for (int64_t c = 0; c < C; ++c) var_in.set_f64(c, 0.5 + std::fabs(var_in.get_f64(c)));
  std::map<std::string, ir::Tensor> feeds = {{"X", random_f32({N, C, H, W}, 10, 2.0)},
                                             {"scale", random_f32({C}, 11)},
                                             {"B", random_f32({C}, 12)},
                                             {"mean_in", random_f32({C}, 13)},
                                             {"var_in", var_in}};
  auto res = run_three_ways(g, feeds, "BatchNormalization", training ? "ReduceSum" : "Sqrt");
  ASSERT_EQ(res.size(), 3u);
  const ir::Tensor& X = feeds["X"];
  std::vector<double> mean, var;
  bn_reference_stats(X, training, feeds["mean_in"], feeds["var_in"], mean, var);
  const int64_t S = H * W;
  std::vector<double> y(N * C * S), rm(C), rv(C);
  for (int64_t i = 0; i < N * C * S; ++i) {
    const int64_t c = (i / S) % C;
    y[i] = (X.get_f64(i) - mean[c]) / std::sqrt(var[c] + eps) * feeds["scale"].get_f64(c) + feeds["B"].get_f64(c);
  }
  for (int64_t c = 0; c < C; ++c) {
    rm[c] = mom * feeds["mean_in"].get_f64(c) + (1 - mom) * mean[c];
    rv[c] = mom * feeds["var_in"].get_f64(c) + (1 - mom) * var[c] * (N * S) / (N * S - 1.0);
  }
  const char* way[] = {"original", "decomposed eager", "decomposed compiled"};
  for (int w = 0; w < 3; ++w) {
    expect_close(res[w].at("Y"), y, 1e-5, std::string(way[w]) + " Y");
    if (!training) continue;
    expect_close(res[w].at("running_mean"), rm, 1e-6, std::string(way[w]) + " running_mean");
    expect_close(res[w].at("running_var"), rv, 1e-6, std::string(way[w]) + " running_var");
  }
}

TEST(Decompose, BatchNormalizationTrainingMatchesFloat64Reference) { check_bn_forward(true); }
TEST(Decompose, BatchNormalizationEvaluationMatchesFloat64Reference) { check_bn_forward(false); }

/// BatchNormalizationGrad in training mode against the float64 batch-norm backward
/// (PyTorch's native_batch_norm_backward): xhat = (x - mean) * inv,
/// dX = scale * inv / n * (n dy - sum(dy) - xhat * sum(dy * xhat)), dscale = sum(dy * xhat),
/// dB = sum(dy); and in evaluation mode dX = dy * scale * inv with the given statistics.
void check_bn_grad(bool training) {
  SCOPED_TRACE(training ? "training" : "evaluation");
  const int64_t N = 5, C = 4, H = 3, W = 7;
  const double eps = 1e-5;
  ir::Graph g;
  ir::Value* dy = g.add_input("dY", DType::f32, ir::Shape::of({N, C, H, W}));
  ir::Value* x = g.add_input("X", DType::f32, ir::Shape::of({N, C, H, W}));
  std::vector<ir::Value*> ins = {dy, x};
  for (const char* nm : {"scale", "mean", "var"}) ins.push_back(g.add_input(nm, DType::f32, ir::Shape::of({C})));
  ir::Attributes a;
  a.set("epsilon", eps);
  a.set("training_mode", int64_t(training ? 1 : 0));
  auto* n = g.add_node("BatchNormalizationGrad", "bn_grad", ins, {"dX", "dscale", "dB"}, a);
  g.outputs = n->outputs;
  ASSERT_TRUE(ir::infer_graph(g).is_ok());
  ir::Tensor var_in = random_f32({C}, 24);
  for (int64_t c = 0; c < C; ++c) var_in.set_f64(c, 0.5 + std::fabs(var_in.get_f64(c)));
  std::map<std::string, ir::Tensor> feeds = {{"dY", random_f32({N, C, H, W}, 20)},
                                             {"X", random_f32({N, C, H, W}, 21, 3.0)},
                                             {"scale", random_f32({C}, 22)},
                                             {"mean", random_f32({C}, 23)},
                                             {"var", var_in}};
  auto res = run_three_ways(g, feeds, "BatchNormalizationGrad", "ReduceSum");
  ASSERT_EQ(res.size(), 3u);
  const ir::Tensor &X = feeds["X"], &DY = feeds["dY"];
  std::vector<double> mean, var;
  bn_reference_stats(X, training, feeds["mean"], feeds["var"], mean, var);
  const int64_t S = H * W, cnt = N * S;
  std::vector<double> dx(N * C * S), ds(C, 0.0), db(C, 0.0);
  for (int64_t i = 0; i < N * C * S; ++i) {
    const int64_t c = (i / S) % C;
    const double inv = 1 / std::sqrt(var[c] + eps);
    ds[c] += DY.get_f64(i) * (X.get_f64(i) - mean[c]) * inv;
    db[c] += DY.get_f64(i);
  }
  for (int64_t i = 0; i < N * C * S; ++i) {
    const int64_t c = (i / S) % C;
    const double inv = 1 / std::sqrt(var[c] + eps), sc = feeds["scale"].get_f64(c);
    const double xh = (X.get_f64(i) - mean[c]) * inv;
    dx[i] = training ? sc * inv / cnt * (cnt * DY.get_f64(i) - db[c] - xh * ds[c]) : DY.get_f64(i) * sc * inv;
  }
  const char* way[] = {"original", "decomposed eager", "decomposed compiled"};
  for (int w = 0; w < 3; ++w) {
    expect_close(res[w].at("dX"), dx, 1e-5, std::string(way[w]) + " dX");
    expect_close(res[w].at("dscale"), ds, 1e-5, std::string(way[w]) + " dscale");
    expect_close(res[w].at("dB"), db, 1e-5, std::string(way[w]) + " dB");
  }
}

TEST(Decompose, BatchNormalizationGradTrainingMatchesFloat64Reference) { check_bn_grad(true); }
TEST(Decompose, BatchNormalizationGradEvaluationMatchesFloat64Reference) { check_bn_grad(false); }

TEST(Decompose, BatchNormalizationWithoutTrainingModeIsLeftToTheRunFlag) {
  // No training_mode attribute: the run's training flag decides at run time, so the node
  // stays (decomposable() is false) and the eager kernel serves both modes.
  ir::Graph g;
  ir::Value* x = g.add_input("X", DType::f32, ir::Shape::of({2, 3, 4}));
  std::vector<ir::Value*> ins = {x};
  for (const char* nm : {"scale", "B", "mean_in", "var_in"})
    ins.push_back(g.add_input(nm, DType::f32, ir::Shape::of({3})));
  auto* n = g.add_node("BatchNormalization", "bn", ins, {"Y"}, {});
  g.outputs = n->outputs;
  ASSERT_TRUE(ir::infer_graph(g).is_ok());
  passes::PassContext ctx;
  ASSERT_TRUE(passes::run_pipeline(g, {"decompose"}, ctx).is_ok());
  ASSERT_EQ(g.nodes().size(), 1u);
  EXPECT_EQ(g.nodes()[0]->op, "BatchNormalization");
}

}  // namespace
