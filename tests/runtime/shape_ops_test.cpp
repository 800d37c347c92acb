// Tests of the shape op-table entries and eager kernels: one-node graphs run by the
// eager interpreter against references computed here with plain index loops
// (Slice/Pad/Gather re-implemented coordinate by coordinate from the ONNX spec),
// over f32, f64, bf16, i64 and bool data; symbolic-shape inference; adjoint
// identities for SliceGrad/GatherGrad; gradient rules via the f64 gradient checker.
#include <gtest/gtest.h>

#include <cmath>
#include <functional>
#include <limits>
#include <random>

#include "ir/op_table.h"
#include "runtime/interpreter.h"
#include "tests/runtime/op_test_util.h"

using namespace kiln;
using namespace kiln::ir;
using namespace kiln::testing;

namespace {

Tensor ints(const std::vector<int64_t>& v) { return Tensor::from_i64(v); }
Tensor iota(DType dt, std::vector<int64_t> dims) {
  Tensor t(dt, std::move(dims));
  for (int64_t i = 0; i < t.numel(); ++i) t.set_f64(i, dt == DType::boolean ? (i % 3 == 0) : static_cast<double>(i));
  return t;
}

/// Output shape of `op` inferred on a graph with the given (possibly symbolic) input shapes;
/// inputs with data are initializers.
Expected<Shape> infer_shape(const std::string& op, const std::vector<std::pair<Shape, Tensor>>& ins,
                            Attributes attrs = {}) {
  Graph g;
  std::vector<Value*> vs;
  for (size_t i = 0; i < ins.size(); ++i) {
    if (ins[i].second.defined())
      vs.push_back(g.add_initializer("c" + std::to_string(i), ins[i].second));
    else
      vs.push_back(g.add_input("x" + std::to_string(i), DType::f32, ins[i].first));
  }
  Node* n = g.add_node(op, "n", vs, {"y"}, std::move(attrs));
  KILN_RETURN_IF_ERROR(infer_node(*n));
  return n->outputs[0]->shape;
}

/// Coordinates of linear index i in dims.
std::vector<int64_t> coords(int64_t i, const std::vector<int64_t>& dims) {
  std::vector<int64_t> c(dims.size());
  for (int d = static_cast<int>(dims.size()) - 1; d >= 0; --d) {
    c[d] = i % dims[d];
    i /= dims[d];
  }
  return c;
}
int64_t linear(const std::vector<int64_t>& c, const std::vector<int64_t>& dims) {
  int64_t o = 0;
  for (size_t d = 0; d < dims.size(); ++d) o = o * dims[d] + c[d];
  return o;
}

const std::vector<DType> kTypes = {DType::f32, DType::f64, DType::bf16, DType::i64, DType::boolean};

}  // namespace

TEST(ShapeOps, ReshapeFlattenSqueezeUnsqueezeKeepData) {
  for (DType dt : kTypes) {
    Tensor x = iota(dt, {2, 3, 4});
    auto r = run_op("Reshape", {x, ints({0, -1, 2})});
    EXPECT_EQ(r[0].dims(), (std::vector<int64_t>{2, 6, 2}));
    expect_eq(r[0], values(x), "Reshape");
    Attributes fa;
    fa.set("axis", int64_t(-1));
    EXPECT_EQ(run_op("Flatten", {x}, fa)[0].dims(), (std::vector<int64_t>{6, 4}));
    fa.set("axis", int64_t(0));
    EXPECT_EQ(run_op("Flatten", {x}, fa)[0].dims(), (std::vector<int64_t>{1, 24}));
    EXPECT_EQ(run_op("Flatten", {x})[0].dims(), (std::vector<int64_t>{2, 12}));
    auto u = run_op("Unsqueeze", {x, ints({-1, 0})});
    EXPECT_EQ(u[0].dims(), (std::vector<int64_t>{1, 2, 3, 4, 1}));
    expect_eq(u[0], values(x), "Unsqueeze");
    auto s = run_op("Squeeze", {u[0], ints({-1})});
    EXPECT_EQ(s[0].dims(), (std::vector<int64_t>{1, 2, 3, 4}));
    EXPECT_EQ(run_op("Squeeze", {u[0]})[0].dims(), (std::vector<int64_t>{2, 3, 4}));
  }
  // allowzero: 0 is a real zero-sized dim.
  Attributes az;
  az.set("allowzero", int64_t(1));
  EXPECT_EQ(run_op("Reshape", {Tensor(DType::f32, {0, 3}), ints({3, 0})}, az)[0].dims(), (std::vector<int64_t>{3, 0}));
  EXPECT_NE(run_error("Reshape", {iota(DType::f32, {2, 3}), ints({4, -1})}), "");
  EXPECT_NE(run_error("Squeeze", {iota(DType::f32, {2, 3}), ints({0})}), "");
}

TEST(ShapeOps, SymbolicInference) {
  Shape btc({Dim("B"), Dim("T"), Dim(8)});
  auto s = infer_shape("Reshape", {{btc, {}}, {{}, ints({0, 0, 2, -1})}});
  ASSERT_TRUE(s.has_value()) << s.message();
  EXPECT_EQ(s->to_string(), "[B, T, 2, 4]");
  s = infer_shape("Reshape", {{Shape({Dim("B"), Dim(6)}), {}}, {{}, ints({-1, 3, 2})}});
  ASSERT_TRUE(s.has_value());
  EXPECT_EQ(s->to_string(), "[B, 3, 2]");
  // Element counts are polynomials: -1 is the exact quotient (B*T*8) / 8.
  s = infer_shape("Reshape", {{btc, {}}, {{}, ints({-1, 8})}});
  ASSERT_TRUE(s.has_value());
  EXPECT_EQ(s->to_string(), "[B*T, 8]");
  s = infer_shape("Reshape", {{btc, {}}, {{}, ints({2, -1})}});
  ASSERT_TRUE(s.has_value());
  EXPECT_EQ(s->to_string(), "[2, 4*B*T]");
  // (8*B*T) / 3 is no polynomial: the dim is unknown, not an error (B*T may be a multiple of 3).
  s = infer_shape("Reshape", {{btc, {}}, {{}, ints({-1, 3})}});
  ASSERT_TRUE(s.has_value());
  EXPECT_EQ(s->to_string(), "[?, 3]");
  // Static counts still have to agree.
  EXPECT_FALSE(infer_shape("Reshape", {{Shape::of({2, 3}), {}}, {{}, ints({-1, 4})}}).has_value());
  EXPECT_FALSE(infer_shape("Reshape", {{Shape::of({2, 3}), {}}, {{}, ints({5})}}).has_value());
  // Non-constant shape input: rank from its length, unknown dims.
  Graph g;
  Value* x = g.add_input("x", DType::f32, btc);
  Value* shp = g.add_input("shp", DType::i64, Shape::of({3}));
  Node* n = g.add_node("Reshape", "r", {x, shp}, {"y"});
  ASSERT_TRUE(infer_node(*n).is_ok());
  EXPECT_EQ(n->outputs[0]->shape.to_string(), "[?, ?, ?]");
  // Concat adds the lengths along its axis: [B, 1] and [B, T] give [B, T+1] (gpt2's
  // position ids); an unknown length keeps the sum unknown.
  Attributes last;
  last.set("axis", int64_t(-1));
  s = infer_shape("Concat", {{Shape({Dim("B"), Dim(1)}), {}}, {Shape({Dim("B"), Dim("T")}), {}}}, last);
  ASSERT_TRUE(s.has_value()) << s.message();
  EXPECT_EQ(s->to_string(), "[B, T+1]");
  s = infer_shape("Concat", {{Shape({Dim("B"), Dim()}), {}}, {Shape({Dim("B"), Dim("T")}), {}}}, last);
  ASSERT_TRUE(s.has_value()) << s.message();
  EXPECT_EQ(s->to_string(), "[B, ?]");
  Attributes perm;
  perm.set("perm", std::vector<int64_t>{2, 0, 1});
  s = infer_shape("Transpose", {{btc, {}}}, perm);
  EXPECT_EQ(s->to_string(), "[8, B, T]");
  s = infer_shape("Unsqueeze", {{btc, {}}, {{}, ints({1})}});
  EXPECT_EQ(s->to_string(), "[B, 1, T, 8]");
  Attributes ax;
  ax.set("axis", int64_t(1));
  s = infer_shape("Flatten", {{btc, {}}}, ax);
  EXPECT_EQ(s->to_string(), "[B, 8*T]");  // T * 8 as an expression
  s = infer_shape("Flatten", {{Shape({Dim("B"), Dim(), Dim(8)}), {}}}, ax);
  EXPECT_EQ(s->to_string(), "[B, ?]");  // an unknown factor
  ax.set("axis", int64_t(2));
  s = infer_shape("Flatten", {{Shape({Dim("B"), Dim(1), Dim(8)}), {}}}, ax);
  EXPECT_EQ(s->to_string(), "[B, 8]");
  s = infer_shape("Slice", {{btc, {}}, {{}, ints({1})}, {{}, ints({7})}, {{}, ints({-1})}});
  EXPECT_EQ(s->to_string(), "[B, T, 6]");
  s = infer_shape("Expand", {{Shape({Dim("B"), Dim(1)}), {}}, {{}, ints({1, 5})}});
  EXPECT_EQ(s->to_string(), "[B, 5]");
  Attributes cx;
  cx.set("axis", int64_t(-1));
  s = infer_shape("Concat", {{btc, {}}, {btc, {}}}, cx);
  EXPECT_EQ(s->to_string(), "[B, T, 16]");
}

TEST(ShapeOps, Transpose) {
  for (DType dt : kTypes) {
    Tensor x = iota(dt, {2, 3, 4});
    Attributes a;
    a.set("perm", std::vector<int64_t>{1, 2, 0});
    auto y = run_op("Transpose", {x}, a)[0];
    ASSERT_EQ(y.dims(), (std::vector<int64_t>{3, 4, 2}));
    for (int64_t i = 0; i < y.numel(); ++i) {
      auto c = coords(i, y.dims());
      EXPECT_EQ(y.get_f64(i), x.get_f64(linear({c[2], c[0], c[1]}, x.dims())));
    }
    auto yd = run_op("Transpose", {x})[0];  // default: reversed axes
    ASSERT_EQ(yd.dims(), (std::vector<int64_t>{4, 3, 2}));
    for (int64_t i = 0; i < yd.numel(); ++i) {
      auto c = coords(i, yd.dims());
      EXPECT_EQ(yd.get_f64(i), x.get_f64(linear({c[2], c[1], c[0]}, x.dims())));
    }
  }
}

TEST(ShapeOps, ConcatAndSplit) {
  for (DType dt : kTypes) {
    Tensor a = iota(dt, {2, 1, 3}), b = iota(dt, {2, 2, 3}), c = iota(dt, {2, 3, 3});
    Attributes ax;
    ax.set("axis", int64_t(-2));
    auto y = run_op("Concat", {a, b, c}, ax)[0];
    ASSERT_EQ(y.dims(), (std::vector<int64_t>{2, 6, 3}));
    for (int64_t i = 0; i < y.numel(); ++i) {
      auto co = coords(i, y.dims());
      int64_t j = co[1];
      const Tensor& src = j < 1 ? a : j < 3 ? b : c;
      int64_t jj = j < 1 ? j : j < 3 ? j - 1 : j - 3;
      EXPECT_EQ(y.get_f64(i), src.get_f64(linear({co[0], jj, co[2]}, src.dims())));
    }
    auto parts = run_op("Split", {y, ints({1, 2, 3})}, ax, 3);
    ASSERT_EQ(parts.size(), 3u);
    expect_eq(parts[0], values(a), "split 0");
    expect_eq(parts[1], values(b), "split 1");
    expect_eq(parts[2], values(c), "split 2");
  }
  // Equal split and Split-18 num_outputs with a smaller last chunk.
  Tensor x = iota(DType::f32, {6, 2});
  auto eq = run_op("Split", {x}, {}, 3);
  for (int k = 0; k < 3; ++k) EXPECT_EQ(eq[k].dims(), (std::vector<int64_t>{2, 2}));
  expect_eq(eq[2], {8, 9, 10, 11}, "equal split");
  Attributes no;
  no.set("num_outputs", int64_t(3));
  no.set("axis", int64_t(1));
  auto un = run_op("Split", {iota(DType::f32, {2, 5})}, no, 3);
  EXPECT_EQ(un[0].dims(), (std::vector<int64_t>{2, 2}));
  EXPECT_EQ(un[2].dims(), (std::vector<int64_t>{2, 1}));
  expect_eq(un[2], {4, 9}, "uneven split");
}

TEST(ShapeOps, SliceMatchesReference) {
  const std::vector<int64_t> dims = {5, 6, 7};
  const int64_t BIG = std::numeric_limits<int64_t>::max(), SMALL = std::numeric_limits<int64_t>::min();
  struct Case {
    std::vector<int64_t> starts, ends, axes, steps;
  };
  std::vector<Case> cases = {
      {{1, 0}, {3, 10}, {0, 2}, {1, 2}}, {{-1}, {SMALL}, {1}, {-1}},     {{4, 5}, {-6, 1}, {0, 1}, {-2, -3}},
      {{0}, {BIG}, {-1}, {3}},           {{2}, {2}, {0}, {1}},           {{-100}, {100}, {2}, {1}},
      {{10}, {-10}, {2}, {-1}},          {{1, 1, 1}, {4, 5, 6}, {}, {}}, {{3}, {0}, {-3}, {-1}},
  };
  // Independent reference: per axis, enumerate the kept indices by walking the ONNX definition.
  auto kept = [](int64_t d, int64_t s, int64_t e, int64_t st) {
    std::vector<int64_t> idx;
    if (s < 0) s += d;
    if (e < 0) e += d;
    if (st > 0) {
      s = std::max<int64_t>(0, std::min(s, d));
      e = std::max<int64_t>(0, std::min(e, d));
      for (int64_t i = s; i < e; i += st) idx.push_back(i);
    } else {
      s = std::max<int64_t>(0, std::min(s, d - 1));
      e = std::max<int64_t>(-1, std::min(e, d - 1));
      for (int64_t i = s; i > e; i += st) idx.push_back(i);
    }
    return idx;
  };
  for (DType dt : {DType::f32, DType::bf16, DType::i64}) {
    Tensor x = iota(dt, dims);
    for (auto& cs : cases) {
      std::vector<std::vector<int64_t>> sel(3);
      for (int d = 0; d < 3; ++d)
        for (int64_t i = 0; i < dims[d]; ++i) sel[d].push_back(i);
      for (size_t k = 0; k < cs.starts.size(); ++k) {
        int64_t a = cs.axes.empty() ? static_cast<int64_t>(k) : cs.axes[k];
        if (a < 0) a += 3;
        sel[a] = kept(dims[a], cs.starts[k], cs.ends[k], cs.steps.empty() ? 1 : cs.steps[k]);
      }
      std::vector<double> ref;
      for (int64_t i : sel[0])
        for (int64_t j : sel[1])
          for (int64_t k : sel[2]) ref.push_back(x.get_f64(linear({i, j, k}, dims)));
      std::vector<Tensor> ins = {x, ints(cs.starts), ints(cs.ends)};
      if (!cs.axes.empty()) ins.push_back(ints(cs.axes));
      if (!cs.steps.empty()) ins.push_back(ints(cs.steps));
      auto y = run_op("Slice", ins)[0];
      EXPECT_EQ(y.dims(),
                (std::vector<int64_t>{(int64_t)sel[0].size(), (int64_t)sel[1].size(), (int64_t)sel[2].size()}));
      expect_eq(y, ref, "Slice case starts[0]=" + std::to_string(cs.starts[0]));
    }
  }
}

TEST(ShapeOps, Gather) {
  for (DType dt : kTypes) {
    Tensor x = iota(dt, {3, 4, 2});
    Tensor idx = make(DType::i64, {2, 2}, {-1, 0, 2, 2});
    Attributes a;
    a.set("axis", int64_t(1));
    auto y = run_op("Gather", {x, idx}, a)[0];
    ASSERT_EQ(y.dims(), (std::vector<int64_t>{3, 2, 2, 2}));
    for (int64_t i = 0; i < y.numel(); ++i) {
      auto c = coords(i, y.dims());
      int64_t j = idx.get_i64(c[1] * 2 + c[2]);
      if (j < 0) j += 4;
      EXPECT_EQ(y.get_f64(i), x.get_f64(linear({c[0], j, c[3]}, x.dims())));
    }
  }
  // Scalar index drops the axis; i32 indices.
  auto y = run_op("Gather", {iota(DType::f32, {3, 2}), make(DType::i32, {}, {-2})})[0];
  EXPECT_EQ(y.dims(), (std::vector<int64_t>{2}));
  expect_eq(y, {2, 3}, "Gather scalar");
  EXPECT_NE(run_error("Gather", {iota(DType::f32, {3, 2}), ints({3})}), "");
}

TEST(ShapeOps, ExpandShapeConstantOfShapeConstant) {
  Tensor x = iota(DType::f32, {3, 1});
  auto y = run_op("Expand", {x, ints({2, 1, 4})})[0];
  ASSERT_EQ(y.dims(), (std::vector<int64_t>{2, 3, 4}));
  for (int64_t i = 0; i < y.numel(); ++i) EXPECT_EQ(y.get_f64(i), coords(i, y.dims())[1]);
  EXPECT_EQ(run_op("Expand", {iota(DType::i64, {2, 3}), ints({3})})[0].dims(), (std::vector<int64_t>{2, 3}));

  Tensor t = iota(DType::f32, {2, 3, 4, 5});
  expect_eq(run_op("Shape", {t})[0], {2, 3, 4, 5}, "Shape");
  Attributes se;
  se.set("start", int64_t(-3));
  se.set("end", int64_t(-1));
  expect_eq(run_op("Shape", {t}, se)[0], {3, 4}, "Shape start/end");
  se.set("start", int64_t(-10));
  se.set("end", int64_t(10));
  expect_eq(run_op("Shape", {t}, se)[0], {2, 3, 4, 5}, "Shape clamped");

  auto z = run_op("ConstantOfShape", {ints({2, 3})})[0];
  EXPECT_EQ(z.dtype(), DType::f32);
  expect_eq(z, std::vector<double>(6, 0.0), "ConstantOfShape default");
  Attributes v;
  v.set("value", make(DType::i64, {1}, {7}));
  auto z2 = run_op("ConstantOfShape", {ints({4})}, v)[0];
  EXPECT_EQ(z2.dtype(), DType::i64);
  expect_eq(z2, {7, 7, 7, 7}, "ConstantOfShape i64");

  Attributes c1;
  c1.set("value_floats", std::vector<double>{1.5, -2});
  auto k1 = run_op("Constant", {}, c1)[0];
  EXPECT_EQ(k1.dtype(), DType::f32);
  expect_eq(k1, {1.5, -2}, "Constant value_floats");
  Attributes c2;
  c2.set("value_int", int64_t(5));
  auto k2 = run_op("Constant", {}, c2)[0];
  EXPECT_EQ(k2.rank(), 0);
  expect_eq(k2, {5}, "Constant value_int");
  Attributes c3;
  c3.set("value", make(DType::bf16, {2, 1}, {0.5, 3}));
  auto k3 = run_op("Constant", {}, c3)[0];
  EXPECT_EQ(k3.dtype(), DType::bf16);
  expect_eq(k3, {0.5, 3}, "Constant value tensor");
}

TEST(ShapeOps, Range) {
  auto r = run_op("Range", {make(DType::f32, {}, {1}), make(DType::f32, {}, {2.5}), make(DType::f32, {}, {0.4})}, {}, 1,
                  {}, Feed::none)[0];
  expect_eq(r, {1.0f + 0 * 0.4f, 1.0f + 1 * 0.4f, 1.0f + 2 * 0.4f, 1.0f + 3 * 0.4f}, "Range f32");
  auto ri = run_op("Range", {make(DType::i64, {}, {10}), make(DType::i64, {}, {3}), make(DType::i64, {}, {-3})})[0];
  expect_eq(ri, {10, 7, 4}, "Range i64 negative delta");
  auto empty = run_op("Range", {make(DType::i32, {}, {5}), make(DType::i32, {}, {1}), make(DType::i32, {}, {2})})[0];
  EXPECT_EQ(empty.numel(), 0);
}

TEST(ShapeOps, Trilu) {
  for (DType dt : {DType::f32, DType::bf16, DType::i64}) {
    Tensor x = iota(dt, {2, 3, 4});
    for (int upper : {0, 1})
      for (int64_t k : {-1, 0, 2}) {
        Attributes a;
        a.set("upper", int64_t(upper));
        auto y = run_op("Trilu", {x, make(DType::i64, {}, {static_cast<double>(k)})}, a)[0];
        for (int64_t i = 0; i < y.numel(); ++i) {
          auto c = coords(i, y.dims());
          bool keep = upper ? c[2] - c[1] >= k : c[2] - c[1] <= k;
          EXPECT_EQ(y.get_f64(i), keep ? x.get_f64(i) : 0.0);
        }
      }
  }
  auto d = run_op("Trilu", {iota(DType::f32, {2, 2})})[0];  // default upper, k = 0
  expect_eq(d, {0, 1, 0, 3}, "Trilu default");
}

TEST(ShapeOps, PadModes) {
  auto ref_pad = [](const Tensor& x, const std::vector<int64_t>& begin, const std::vector<int64_t>& end,
                    const std::string& mode, double cval) {
    std::vector<int64_t> od;
    for (int d = 0; d < x.rank(); ++d) od.push_back(x.dims()[d] + begin[d] + end[d]);
    std::vector<double> out;
    for (int64_t i = 0; i < numel_of(od); ++i) {
      auto c = coords(i, od);
      bool outside = false;
      for (int d = 0; d < x.rank(); ++d) {
        int64_t n = x.dims()[d], s = c[d] - begin[d];
        if (s >= 0 && s < n) {
          c[d] = s;
          continue;
        }
        if (mode == "constant")
          outside = true;
        else if (mode == "edge")
          s = s < 0 ? 0 : n - 1;
        else if (mode == "wrap")
          s = ((s % n) + n) % n;
        else
          while (s < 0 || s >= n) s = s < 0 ? -s : 2 * (n - 1) - s;  // reflect
        c[d] = s;
      }
      out.push_back(outside ? cval : x.get_f64(linear(c, x.dims())));
    }
    return std::make_pair(od, out);
  };
  for (DType dt : {DType::f32, DType::f64, DType::bf16, DType::i64}) {
    Tensor x = iota(dt, {3, 4});
    for (std::string mode : {"constant", "reflect", "edge", "wrap"}) {
      Attributes a;
      a.set("mode", mode);
      std::vector<Tensor> ins = {x, ints({1, 2, 2, 3})};
      if (mode == "constant") ins.push_back(make(dt, {}, {5}));
      auto y = run_op("Pad", ins, a)[0];
      auto [od, ref] = ref_pad(x, {1, 2}, {2, 3}, mode, mode == "constant" ? 5 : 0);
      EXPECT_EQ(y.dims(), od);
      expect_eq(y, ref, "Pad " + mode + " " + dtype_name(dt));
    }
  }
  // Pad-18 axes input (negative axis) and negative pads (crop).
  Tensor x = iota(DType::f32, {3, 4});
  auto y = run_op("Pad", {x, ints({1, -1}), Tensor(), ints({-1})})[0];
  auto [od, ref] = ref_pad(x, {0, 1}, {0, -1}, "constant", 0);
  EXPECT_EQ(y.dims(), od);
  expect_eq(y, ref, "Pad axes + crop");
}

TEST(ShapeOps, SliceGradAndGatherGradAreAdjoints) {
  // <Slice(x), dy> == <x, SliceGrad(dy)> and <Gather(x), dy> == <x, GatherGrad(dy)> for random x, dy.
  Tensor x = rnd(DType::f64, {4, 5, 6}, -1, 1, 1);
  std::vector<Tensor> sl = {ints({3, 1}), ints({0, 6}), ints({0, 2}), ints({-1, 2})};
  auto y = run_op("Slice", {x, sl[0], sl[1], sl[2], sl[3]})[0];
  Tensor dy = rnd(DType::f64, y.dims(), -1, 1, 2);
  auto gx = run_op("SliceGrad", {dy, ints(x.dims()), sl[0], sl[1], sl[2], sl[3]})[0];
  ASSERT_EQ(gx.dims(), x.dims());
  double lhs = 0, rhs = 0;
  for (int64_t i = 0; i < y.numel(); ++i) lhs += y.get_f64(i) * dy.get_f64(i);
  for (int64_t i = 0; i < x.numel(); ++i) rhs += x.get_f64(i) * gx.get_f64(i);
  EXPECT_NEAR(lhs, rhs, 1e-12);

  for (DType dt : {DType::f64, DType::f32, DType::bf16}) {
    Tensor idx = make(DType::i64, {2, 3}, {1, -1, 1, 0, 4, 1});  // repeated indices accumulate
    Attributes a;
    a.set("axis", int64_t(-2));
    Tensor xd = x.cast(dt);
    auto g = run_op("Gather", {xd, idx}, a)[0];
    Tensor dyg = rnd(dt, g.dims(), -1, 1, 3);
    auto gg = run_op("GatherGrad", {idx, dyg, ints(x.dims())}, a)[0];
    ASSERT_EQ(gg.dims(), x.dims());
    double l = 0, r = 0;
    for (int64_t i = 0; i < g.numel(); ++i) l += g.get_f64(i) * dyg.get_f64(i);
    for (int64_t i = 0; i < x.numel(); ++i) r += xd.get_f64(i) * gg.get_f64(i);
    EXPECT_NEAR(l, r, dt == DType::bf16 ? 0.1 : dt == DType::f32 ? 1e-4 : 1e-12) << dtype_name(dt);
  }
}

// ----------------------------------------------------------------------------- gradient rules

namespace {
/// f64 gradient check of `op` (seed 2000 + op name length), see check_op_grad.
void check_grad(const std::string& op, const std::vector<Tensor>& ins, Attributes attrs = {}, int n_out = 1,
                std::vector<int> wrt = {}) {
  check_op_grad(op, ins, attrs, {.seed_base = 2000, .n_out = n_out, .wrt = wrt});
}
}  // namespace

TEST(ShapeGrad, ViewsAndDataMovement) {
  Tensor x = rnd(DType::f64, {2, 3, 4}, -1, 1, 61);
  check_grad("Reshape", {x, ints({4, -1})}, {}, 1, {0});
  Attributes perm;
  perm.set("perm", std::vector<int64_t>{2, 0, 1});
  check_grad("Transpose", {x}, perm);
  check_grad("Flatten", {x});
  check_grad("Unsqueeze", {x, ints({0, -1})}, {}, 1, {0});
  check_grad("Squeeze", {rnd(DType::f64, {2, 1, 3}, -1, 1, 62), ints({1})}, {}, 1, {0});
  Attributes ax;
  ax.set("axis", int64_t(1));
  check_grad("Concat", {x, rnd(DType::f64, {2, 2, 4}, -1, 1, 63)}, ax);
  check_grad("Split", {x, ints({1, 2})}, ax, 2, {0});
  check_grad("Slice", {x, ints({2, 0}), ints({-100, 3}), ints({2, 1}), ints({-2, 2})}, {}, 1, {0});
  Attributes g0;
  g0.set("axis", int64_t(1));
  check_grad("Gather", {x, make(DType::i64, {4}, {0, 2, 0, -1})}, g0, 1, {0});
  check_grad("Expand", {rnd(DType::f64, {3, 1}, -1, 1, 64), ints({2, 3, 4})}, {}, 1, {0});
  check_grad("Pad", {x, ints({0, 1, 2, 1, 0, 1})}, {}, 1, {0});
  check_grad("Pad", {x, ints({1, 2, 0, 1}), Tensor(DType::f64, {}), ints({0, -1})}, {}, 1, {0});
  Attributes lower;
  lower.set("upper", int64_t(0));
  check_grad("Trilu", {x, make(DType::i64, {}, {1})}, lower, 1, {0});
}
