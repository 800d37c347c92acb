// Op table entries: elementwise ops (ONNX opsets 13-18 semantics, plus Gelu from
// opset 20 and the kiln-internal GeluGrad). Each entry: schema, dtype/shape
// inference with numpy broadcasting (symbolic dims kept by broadcast_shapes),
// precision policy, fusion class and gradient rule written as IR with forward ops
// (DESIGN.md convention 3). Spec: https://onnx.ai/onnx/operators/
#include <cmath>
#include <limits>

#include "ir/op_table.h"

namespace kiln::ir {

namespace {

constexpr int kVariadic = 1 << 20;

// ---------------------------------------------------------------- inference

Status infer_same(InferContext& c) {
  if (!c.has_input(0)) return c.fail("missing input 0");
  c.out[0] = c.in[0];
  return Status::ok();
}

Status infer_float_unary(InferContext& c) {
  KILN_RETURN_IF_ERROR(infer_same(c));
  if (!is_float(c.in[0].dtype)) return c.fail(std::string("expects a float input, got ") + dtype_name(c.in[0].dtype));
  return Status::ok();
}

/// Broadcast of inputs [first, first+count) (all present inputs), requiring equal dtypes.
Expected<Shape> broadcast_inputs(InferContext& c, int first, int count, bool same_dtype) {
  Shape s;
  bool any = false;
  DType dt = DType::undefined;
  for (int i = first; i < first + count && i < c.num_inputs(); ++i) {
    if (!c.has_input(i)) continue;
    if (same_dtype) {
      if (dt == DType::undefined)
        dt = c.in[i].dtype;
      else if (dt != c.in[i].dtype)
        return c.fail(std::string("input dtypes ") + dtype_name(dt) + " and " + dtype_name(c.in[i].dtype) + " differ");
    }
    if (!any) {
      s = c.in[i].shape;
      any = true;
      continue;
    }
    auto b = broadcast_shapes(s, c.in[i].shape);
    if (!b) return c.fail(b.message());
    s = *b;
  }
  if (!any) return c.fail("no inputs");
  return s;
}

Status infer_binary(InferContext& c) {
  KILN_ASSIGN_OR_RETURN(Shape s, broadcast_inputs(c, 0, c.num_inputs(), true));
  c.out[0] = {c.in[0].dtype, s};
  return Status::ok();
}

Status infer_compare(InferContext& c) {
  KILN_ASSIGN_OR_RETURN(Shape s, broadcast_inputs(c, 0, 2, true));
  c.out[0] = {DType::boolean, s};
  return Status::ok();
}

Status infer_logic(InferContext& c) {
  KILN_ASSIGN_OR_RETURN(Shape s, broadcast_inputs(c, 0, c.num_inputs(), true));
  if (c.in[0].dtype != DType::boolean) return c.fail("expects bool inputs");
  c.out[0] = {DType::boolean, s};
  return Status::ok();
}

// ---------------------------------------------------------------- gradient helpers

Value* zero_of(GradContext& g, const Value* like) { return g.const_f(0.0, like->dtype); }
Value* cst(GradContext& g, double v, const Value* like) { return g.const_f(v, like->dtype); }

/// Registers a unary op whose gradient is dy * d(x) built by `local`.
using LocalGrad = std::function<Value*(GradContext&, Value* dy)>;
GradFn unary_grad(LocalGrad local) {
  return [local](GradContext& g) -> Status {
    Value* dy = g.grad_output(0);
    if (!dy || !g.needs_grad(0)) return Status::ok();
    g.set_grad_input(0, local(g, dy));
    return Status::ok();
  };
}

Value* emit_cast(GradContext& g, Value* v, DType to) {
  if (v->dtype == to) return v;
  Attributes a;
  a.set("to", static_cast<int64_t>(dtype_to_onnx(to)));
  return g.emit1("Cast", {v}, a);
}

}  // namespace

void register_elementwise_ops(OpTable& t) {
  using P = PrecisionPolicy;
  const std::string spec = "ONNX spec (onnx.ai/onnx/operators): ";

  // ---- binary arithmetic
  add_differentiable(
      t, make_op("Add", spec + "Add-14, C = A + B with numpy broadcasting", 2, 2, infer_binary, P::follow_inputs),
      [](GradContext& g) -> Status {
        Value* dy = g.grad_output(0);
        if (!dy) return Status::ok();
        if (g.needs_grad(0)) g.set_grad_input(0, g.unbroadcast(dy, g.input(0)));
        if (g.needs_grad(1)) g.set_grad_input(1, g.unbroadcast(dy, g.input(1)));
        return Status::ok();
      });
  add_differentiable(
      t, make_op("Sub", spec + "Sub-14, C = A - B with numpy broadcasting", 2, 2, infer_binary, P::follow_inputs),
      [](GradContext& g) -> Status {
        Value* dy = g.grad_output(0);
        if (!dy) return Status::ok();
        if (g.needs_grad(0)) g.set_grad_input(0, g.unbroadcast(dy, g.input(0)));
        if (g.needs_grad(1)) g.set_grad_input(1, g.unbroadcast(g.emit1("Neg", {dy}), g.input(1)));
        return Status::ok();
      });
  add_differentiable(
      t, make_op("Mul", spec + "Mul-14, C = A * B with numpy broadcasting", 2, 2, infer_binary, P::follow_inputs),
      [](GradContext& g) -> Status {
        Value* dy = g.grad_output(0);
        if (!dy) return Status::ok();
        if (g.needs_grad(0)) g.set_grad_input(0, g.unbroadcast(g.emit1("Mul", {dy, g.input(1)}), g.input(0)));
        if (g.needs_grad(1)) g.set_grad_input(1, g.unbroadcast(g.emit1("Mul", {dy, g.input(0)}), g.input(1)));
        return Status::ok();
      });
  add_differentiable(t,
                     make_op("Div", spec + "Div-14, C = A / B with numpy broadcasting (integers truncate toward zero)",
                             2, 2, infer_binary, P::follow_inputs),
                     [](GradContext& g) -> Status {
                       Value* dy = g.grad_output(0);
                       if (!dy) return Status::ok();
                       Value* b = g.input(1);
                       if (g.needs_grad(0)) g.set_grad_input(0, g.unbroadcast(g.emit1("Div", {dy, b}), g.input(0)));
                       if (g.needs_grad(1)) {
                         // d(a/b)/db = -y / b
                         Value* t1 = g.emit1("Mul", {dy, g.emit1("Div", {g.output(0), b})});
                         g.set_grad_input(1, g.unbroadcast(g.emit1("Neg", {t1}), b));
                       }
                       return Status::ok();
                     });
  add_differentiable(
      t,
      make_op(
          "Pow", spec + "Pow-15, Z = X ^ Y with numpy broadcasting; Y may have another numeric dtype", 2, 2,
          [](InferContext& c) -> Status {
            KILN_ASSIGN_OR_RETURN(Shape s, broadcast_inputs(c, 0, 2, false));
            if (c.in[1].dtype == DType::boolean || c.in[0].dtype == DType::boolean)
              return c.fail("bool is not a Pow operand type");
            c.out[0] = {c.in[0].dtype, s};
            return Status::ok();
          },
          P::fp32),
      [](GradContext& g) -> Status {
        Value* dy = g.grad_output(0);
        if (!dy) return Status::ok();
        Value* a = g.input(0);
        Value* b = g.input(1);
        Value* y = g.output(0);
        if (g.needs_grad(0)) {
          Value* bb = emit_cast(g, b, a->dtype);
          // dz/da = b * a^(b-1)
          Value* p = g.emit1("Pow", {a, g.emit1("Sub", {bb, cst(g, 1.0, a)})});
          Value* ga = g.emit1("Mul", {dy, g.emit1("Mul", {bb, p})});
          g.set_grad_input(0, g.unbroadcast(ga, a));
        }
        if (g.needs_grad(1) && is_float(b->dtype)) {
          // dz/db = z * log(a), defined as 0 where a == 0 (as PyTorch does)
          Value* t1 = g.emit1("Mul", {dy, g.emit1("Mul", {y, g.emit1("Log", {a})})});
          Value* is0 = g.emit1("Equal", {a, zero_of(g, a)});
          Value* gb = g.emit1("Where", {is0, zero_of(g, t1), t1});
          g.set_grad_input(1, g.unbroadcast(emit_cast(g, gb, b->dtype), b));
        }
        return Status::ok();
      });

  // ---- unary math
  add_differentiable(t, make_op("Neg", spec + "Neg-13, y = -x", 1, 1, infer_same, P::follow_inputs),
                     unary_grad([](GradContext& g, Value* dy) { return g.emit1("Neg", {dy}); }));
  add_differentiable(
      t, make_op("Abs", spec + "Abs-13, y = |x|", 1, 1, infer_same, P::follow_inputs),
      unary_grad([](GradContext& g, Value* dy) {
        Value* x = g.input(0);
        // sign(x) * dy, 0 at x == 0 (PyTorch)
        Value* neg = g.emit1("Where", {g.emit1("Less", {x, zero_of(g, x)}), g.emit1("Neg", {dy}), zero_of(g, dy)});
        return g.emit1("Where", {g.emit1("Greater", {x, zero_of(g, x)}), dy, neg});
      }));
  add_differentiable(t, make_op("Sqrt", spec + "Sqrt-13, y = sqrt(x)", 1, 1, infer_float_unary, P::fp32),
                     unary_grad([](GradContext& g, Value* dy) {
                       Value* y = g.output(0);
                       return g.emit1("Div", {dy, g.emit1("Mul", {y, cst(g, 2.0, y)})});
                     }));
  add_differentiable(t, make_op("Reciprocal", spec + "Reciprocal-13, y = 1 / x", 1, 1, infer_float_unary, P::fp32),
                     unary_grad([](GradContext& g, Value* dy) {
                       Value* y = g.output(0);
                       return g.emit1("Neg", {g.emit1("Mul", {dy, g.emit1("Mul", {y, y})})});
                     }));
  add_differentiable(t, make_op("Exp", spec + "Exp-13, y = e^x", 1, 1, infer_float_unary, P::fp32),
                     unary_grad([](GradContext& g, Value* dy) {
                       return g.emit1("Mul", {dy, g.output(0)});
                     }));
  add_differentiable(t, make_op("Log", spec + "Log-13, y = ln(x)", 1, 1, infer_float_unary, P::fp32),
                     unary_grad([](GradContext& g, Value* dy) {
                       return g.emit1("Div", {dy, g.input(0)});
                     }));
  add_differentiable(t, make_op("Tanh", spec + "Tanh-13, y = tanh(x)", 1, 1, infer_float_unary, P::follow_inputs),
                     unary_grad([](GradContext& g, Value* dy) {
                       Value* y = g.output(0);
                       return g.emit1("Mul", {dy, g.emit1("Sub", {cst(g, 1.0, y), g.emit1("Mul", {y, y})})});
                     }));
  add_differentiable(
      t, make_op("Sigmoid", spec + "Sigmoid-13, y = 1 / (1 + e^-x)", 1, 1, infer_float_unary, P::follow_inputs),
      unary_grad([](GradContext& g, Value* dy) {
        Value* y = g.output(0);
        return g.emit1("Mul", {dy, g.emit1("Mul", {y, g.emit1("Sub", {cst(g, 1.0, y), y})})});
      }));
  add_differentiable(t, make_op("Relu", spec + "Relu-14, y = max(0, x)", 1, 1, infer_same, P::follow_inputs),
                     unary_grad([](GradContext& g, Value* dy) {
                       Value* y = g.output(0);
                       return g.emit1("Where", {g.emit1("Greater", {y, zero_of(g, y)}), dy, zero_of(g, dy)});
                     }));
  {
    OpDef d = make_op("LeakyRelu", spec + "LeakyRelu-16, y = x if x >= 0 else alpha * x (alpha default 0.01)", 1, 1,
                      infer_float_unary, P::follow_inputs);
    d.attrs = {{"alpha", AttrKind::f}};
    add_differentiable(t, d, unary_grad([](GradContext& g, Value* dy) {
                         Value* x = g.input(0);
                         double alpha = g.node().attrs.get_float("alpha", 0.01);
                         Value* small = g.emit1("Mul", {dy, cst(g, alpha, dy)});
                         return g.emit1("Where", {g.emit1("Greater", {x, zero_of(g, x)}), dy, small});
                       }));
  }
  add_differentiable(t, make_op("Erf", spec + "Erf-13, y = erf(x)", 1, 1, infer_float_unary, P::fp32),
                     unary_grad([](GradContext& g, Value* dy) {
                       Value* x = g.input(0);
                       // d erf(x)/dx = 2/sqrt(pi) * exp(-x^2)
                       Value* e = g.emit1("Exp", {g.emit1("Neg", {g.emit1("Mul", {x, x})})});
                       return g.emit1("Mul", {dy, g.emit1("Mul", {e, cst(g, 2.0 / std::sqrt(M_PI), x)})});
                     }));
  {
    OpDef d = make_op(
        "Gelu", spec + "Gelu-20, y = 0.5x(1+erf(x/sqrt2)); approximate='tanh': 0.5x(1+tanh(sqrt(2/pi)(x+0.044715x^3)))",
        1, 1, infer_float_unary, P::follow_inputs);
    d.attrs = {{"approximate", AttrKind::s}};
    add_differentiable(t, d, unary_grad([](GradContext& g, Value* dy) {
                         Attributes a;
                         a.set("approximate", g.node().attrs.get_string("approximate", "none"));
                         return g.emit1("GeluGrad", {dy, g.input(0)}, a);
                       }));
  }
  {
    OpDef d = make_op("GeluGrad",
                      "kiln-internal: dx = dy * Gelu'(x) (inputs dy, x; attr approximate none|tanh as ONNX Gelu-20)", 2,
                      2, infer_binary, P::follow_inputs);
    d.attrs = {{"approximate", AttrKind::s}};
    d.onnx = false;
    t.add(d);
  }
  add_differentiable(
      t, make_op("Softplus", spec + "Softplus-1, y = ln(exp(x) + 1)", 1, 1, infer_float_unary, P::follow_inputs),
      unary_grad([](GradContext& g, Value* dy) {
        return g.emit1("Mul", {dy, g.emit1("Sigmoid", {g.input(0)})});
      }));
  add_differentiable(t, make_op("Sin", spec + "Sin-7, y = sin(x)", 1, 1, infer_float_unary, P::follow_inputs),
                     unary_grad([](GradContext& g, Value* dy) {
                       return g.emit1("Mul", {dy, g.emit1("Cos", {g.input(0)})});
                     }));
  add_differentiable(t, make_op("Cos", spec + "Cos-7, y = cos(x)", 1, 1, infer_float_unary, P::follow_inputs),
                     unary_grad([](GradContext& g, Value* dy) {
                       return g.emit1("Neg", {g.emit1("Mul", {dy, g.emit1("Sin", {g.input(0)})})});
                     }));

  // ---- rounding, sign and classification (not differentiable: their derivative is 0
  // almost everywhere, which is what PyTorch's floor/ceil/round/sign backward returns)
  t.add(make_op("Floor", spec + "Floor-13, largest integer <= x", 1, 1, infer_float_unary, P::follow_inputs));
  t.add(make_op("Ceil", spec + "Ceil-13, smallest integer >= x", 1, 1, infer_float_unary, P::follow_inputs));
  t.add(
      make_op("Round", spec + "Round-22, nearest integer, halves to even", 1, 1, infer_float_unary, P::follow_inputs));
  t.add(make_op("Sign", spec + "Sign-13, -1 / 0 / 1 by the sign of x (NaN stays NaN)", 1, 1, infer_same,
                P::follow_inputs));
  t.add(make_op(
      "IsNaN", spec + "IsNaN-20, bool y = (x is NaN)", 1, 1,
      [](InferContext& c) -> Status {
        KILN_RETURN_IF_ERROR(infer_float_unary(c));
        c.out[0].dtype = DType::boolean;
        return Status::ok();
      },
      P::not_float));
  {
    OpDef d = make_op(
        "IsInf", spec + "IsInf-20, bool y = (x is +inf and detect_positive) or (x is -inf and detect_negative)", 1, 1,
        [](InferContext& c) -> Status {
          KILN_RETURN_IF_ERROR(infer_float_unary(c));
          c.out[0].dtype = DType::boolean;
          return Status::ok();
        },
        P::not_float);
    d.attrs = {{"detect_negative", AttrKind::i}, {"detect_positive", AttrKind::i}};
    t.add(d);
  }
  {
    OpDef d = make_op("Mod",
                      spec +
                          "Mod-28, fmod=0: a - floor(a/b)*b (sign of b; integers, and floats since opset 28), "
                          "fmod=1: a - trunc(a/b)*b (C fmod, sign of a); integer x mod 0 is 0",
                      2, 2, infer_binary, P::fp32);
    d.attrs = {{"fmod", AttrKind::i}};
    // PyTorch's remainder/fmod backward: da = dy, db = -dy * floor(a/b) (fmod: trunc(a/b)).
    add_differentiable(t, d, [](GradContext& g) -> Status {
      Value* dy = g.grad_output(0);
      if (!dy || !is_float(dy->dtype)) return Status::ok();
      if (g.needs_grad(0)) g.set_grad_input(0, g.unbroadcast(dy, g.input(0)));
      if (g.needs_grad(1)) {
        Value* a = g.input(0);
        Value* b = g.input(1);
        // q = (a - mod(a, b)) / b is floor(a/b) (fmod=0) or trunc(a/b) (fmod=1), exactly
        // the quotient the forward op used.
        Value* q = g.emit1("Div", {g.emit1("Sub", {a, g.output(0)}), b});
        g.set_grad_input(1, g.unbroadcast(g.emit1("Neg", {g.emit1("Mul", {dy, q})}), b));
      }
      return Status::ok();
    });
  }

  // ---- Clip
  {
    OpDef d = make_op(
        "Clip", spec + "Clip-13, y = min(max(x, min), max); min/max optional scalar inputs (attrs min/max: Clip-6)", 1,
        3,
        [](InferContext& c) -> Status {
          KILN_RETURN_IF_ERROR(infer_same(c));
          for (int i = 1; i < 3; ++i)
            if (c.has_input(i) && c.in[i].shape.numel() > 1)
              return c.fail("min/max must be scalars, got shape " + c.in[i].shape.to_string());
          return Status::ok();
        },
        P::follow_inputs);
    d.attrs = {{"min", AttrKind::f}, {"max", AttrKind::f}};
    // Gradient passes where min <= x <= max (PyTorch clamp); no gradient to min/max.
    add_differentiable(t, d, unary_grad([](GradContext& g, Value* dy) {
                         Value* x = g.input(0);
                         Value* lo = g.input(1);
                         Value* hi = g.input(2);
                         const Attributes& at = g.node().attrs;
                         if (!lo && at.has("min")) lo = cst(g, at.get_float("min", 0), x);
                         if (!hi && at.has("max")) hi = cst(g, at.get_float("max", 0), x);
                         Value* mask = nullptr;
                         if (lo) mask = g.emit1("GreaterOrEqual", {x, lo});
                         if (hi) {
                           Value* m2 = g.emit1("LessOrEqual", {x, hi});
                           mask = mask ? g.emit1("And", {mask, m2}) : m2;
                         }
                         if (!mask) return dy;
                         return g.emit1("Where", {mask, dy, zero_of(g, dy)});
                       }));
  }

  // ---- variadic Max / Min
  for (const char* name : {"Max", "Min"}) {
    std::string nm = name;
    OpDef d = make_op(nm,
                      spec + nm + "-13, elementwise " + (nm == "Max" ? "maximum" : "minimum") +
                          " of 1..N inputs with numpy broadcasting (NaN propagates)",
                      1, kVariadic, infer_binary, P::follow_inputs);
    // Gradient: dy goes to the inputs equal to the result, split evenly between ties (PyTorch maximum/minimum).
    add_differentiable(t, d, [](GradContext& g) -> Status {
      Value* dy = g.grad_output(0);
      if (!dy) return Status::ok();
      int n = g.node().num_inputs();
      Value* y = g.output(0);
      if (n == 1) {
        if (g.needs_grad(0)) g.set_grad_input(0, dy);
        return Status::ok();
      }
      std::vector<Value*> eq(n);
      Value* count = nullptr;
      for (int i = 0; i < n; ++i) {
        eq[i] = g.emit1("Equal", {g.input(i), y});
        Value* f = emit_cast(g, eq[i], dy->dtype);
        count = count ? g.emit1("Add", {count, f}) : f;
      }
      Value* share = g.emit1("Div", {dy, count});
      for (int i = 0; i < n; ++i)
        if (g.needs_grad(i))
          g.set_grad_input(i, g.unbroadcast(g.emit1("Where", {eq[i], share, zero_of(g, dy)}), g.input(i)));
      return Status::ok();
    });
  }

  // ---- Where
  add_differentiable(
      t,
      make_op(
          "Where", spec + "Where-16, output = condition ? X : Y with numpy broadcasting of all three", 3, 3,
          [](InferContext& c) -> Status {
            if (c.in[0].dtype != DType::boolean) return c.fail("condition must be bool");
            KILN_ASSIGN_OR_RETURN(Shape s, broadcast_inputs(c, 1, 2, true));
            auto b = broadcast_shapes(s, c.in[0].shape);
            if (!b) return c.fail(b.message());
            c.out[0] = {c.in[1].dtype, *b};
            return Status::ok();
          },
          P::follow_inputs),
      [](GradContext& g) -> Status {
        Value* dy = g.grad_output(0);
        if (!dy) return Status::ok();
        Value* c = g.input(0);
        if (g.needs_grad(1)) g.set_grad_input(1, g.unbroadcast(g.emit1("Where", {c, dy, zero_of(g, dy)}), g.input(1)));
        if (g.needs_grad(2)) g.set_grad_input(2, g.unbroadcast(g.emit1("Where", {c, zero_of(g, dy), dy}), g.input(2)));
        return Status::ok();
      });

  // ---- comparisons and logic (not differentiable)
  const char* cmp_doc[][2] = {{"Equal", "Equal-13, C = (A == B), bool output, numpy broadcasting"},
                              {"Less", "Less-13, C = (A < B), bool output, numpy broadcasting"},
                              {"LessOrEqual", "LessOrEqual-16, C = (A <= B), bool output, numpy broadcasting"},
                              {"Greater", "Greater-13, C = (A > B), bool output, numpy broadcasting"},
                              {"GreaterOrEqual", "GreaterOrEqual-16, C = (A >= B), bool output, numpy broadcasting"}};
  for (auto& cd : cmp_doc) t.add(make_op(cd[0], spec + cd[1], 2, 2, infer_compare, P::follow_inputs));
  t.add(
      make_op("And", spec + "And-7, logical and of bool tensors, numpy broadcasting", 2, 2, infer_logic, P::not_float));
  t.add(make_op("Or", spec + "Or-7, logical or of bool tensors, numpy broadcasting", 2, 2, infer_logic, P::not_float));
  t.add(
      make_op("Xor", spec + "Xor-7, logical xor of bool tensors, numpy broadcasting", 2, 2, infer_logic, P::not_float));
  t.add(make_op(
      "Not", spec + "Not-1, logical not of a bool tensor", 1, 1,
      [](InferContext& c) -> Status {
        KILN_RETURN_IF_ERROR(infer_same(c));
        if (c.in[0].dtype != DType::boolean) return c.fail("expects a bool input");
        return Status::ok();
      },
      P::not_float));

  // ---- Cast / CastLike / Identity
  {
    OpDef d = make_op(
        "Cast", spec + "Cast-13, converts to dtype `to` (ONNX TensorProto type); float->int truncates toward zero", 1,
        1,
        [](InferContext& c) -> Status {
          if (!c.has_input(0)) return c.fail("missing input");
          if (!c.attrs().has("to")) return c.fail("missing attribute 'to'");
          auto dt = dtype_from_onnx(static_cast<int>(c.attrs().get_int("to", 0)));
          if (!dt) return c.fail(dt.message());
          c.out[0] = {*dt, c.in[0].shape};
          return Status::ok();
        },
        P::not_float);
    // saturate (Cast-19) and round_mode (Cast-24) concern float8/float4 targets only,
    // which kiln has no dtype for (dtype_from_onnx refuses them by name).
    d.attrs = {{"to", AttrKind::i, true}, {"saturate", AttrKind::i}, {"round_mode", AttrKind::s}};
    add_differentiable(t, d, [](GradContext& g) -> Status {
      Value* dy = g.grad_output(0);
      Value* x = g.input(0);
      if (!dy || !g.needs_grad(0) || !is_float(x->dtype) || !is_float(dy->dtype)) return Status::ok();
      g.set_grad_input(0, emit_cast(g, dy, x->dtype));
      return Status::ok();
    });
  }
  {
    OpDef d = make_op(
        "CastLike", spec + "CastLike-15, casts input to the dtype of target_type (second input)", 2, 2,
        [](InferContext& c) -> Status {
          if (!c.has_input(0) || !c.has_input(1)) return c.fail("missing input");
          c.out[0] = {c.in[1].dtype, c.in[0].shape};
          return Status::ok();
        },
        P::not_float);
    d.attrs = {{"saturate", AttrKind::i}, {"round_mode", AttrKind::s}};  // CastLike-19/-24: float8 targets only
    add_differentiable(t, d, [](GradContext& g) -> Status {
      Value* dy = g.grad_output(0);
      Value* x = g.input(0);
      if (!dy || !g.needs_grad(0) || !is_float(x->dtype) || !is_float(dy->dtype)) return Status::ok();
      g.set_grad_input(0, emit_cast(g, dy, x->dtype));
      return Status::ok();
    });
  }
  add_differentiable(
      t, make_op("Identity", spec + "Identity-16, y = x", 1, 1, infer_same, P::follow_inputs, FusionClass::view),
      unary_grad([](GradContext&, Value* dy) { return dy; }));

  // ---- Dropout
  {
    OpDef d = make_op(
        "Dropout",
        spec +
            "Dropout-13, inputs (data, ratio?, training_mode?), outputs (output, mask?); inference: output = data, "
            "mask = ones; training: Philox mask keyed by (seed, kiln_rng_id or op id, step), kept values scaled "
            "1/(1-ratio)",
        1, 3,
        [](InferContext& c) -> Status {
          KILN_RETURN_IF_ERROR(infer_float_unary(c));
          if (c.out.size() > 1) c.out[1] = {DType::boolean, c.in[0].shape};
          return Status::ok();
        },
        P::follow_inputs, FusionClass::opaque);
    d.max_outputs = 2;
    d.attrs = {{"seed", AttrKind::i}, {"ratio", AttrKind::f}};
    // Gradient: dy * mask * 1/(1-ratio). The training pipeline gives Dropout nodes a mask output
    // (or a kiln_rng_id attribute, in which case the mask is regenerated by a Dropout node with the
    // same rng id applied to dy). The mask form assumes training behaviour (dropout active), which
    // is how autodiff graphs run; a constant training_mode=false makes the gradient dy.
    add_differentiable(t, d, [](GradContext& g) -> Status {
      Value* dy = g.grad_output(0);
      if (!dy || !g.needs_grad(0)) return Status::ok();
      const Node& n = g.node();
      Value* tm = n.input(2);
      if (tm && tm->data && tm->data->numel() == 1 && tm->data->get_i64(0) == 0) {
        g.set_grad_input(0, dy);
        return Status::ok();
      }
      if (n.num_outputs() >= 2) {
        Value* mask = emit_cast(g, g.output(1), dy->dtype);
        Value* scale = nullptr;
        Value* r = n.input(1);
        if (!r) {
          scale = cst(g, 1.0 / (1.0 - n.attrs.get_float("ratio", 0.5)), dy);
        } else if (r->data && r->data->numel() == 1) {
          double rv = r->data->get_f64(0);
          scale = cst(g, rv < 1.0 ? 1.0 / (1.0 - rv) : 0.0, dy);
        } else {
          Value* rr = emit_cast(g, r, dy->dtype);
          scale = g.emit1("Reciprocal", {g.emit1("Sub", {cst(g, 1.0, dy), rr})});
        }
        g.set_grad_input(0, g.emit1("Mul", {g.emit1("Mul", {dy, mask}), scale}));
        return Status::ok();
      }
      if (n.attrs.has("kiln_rng_id")) {
        Attributes a = n.attrs;
        std::vector<Value*> ins = {dy};
        for (int i = 1; i < n.num_inputs(); ++i) ins.push_back(n.input(i));
        g.set_grad_input(0, g.emit1("Dropout", ins, a));
        return Status::ok();
      }
      return Status::error("node '" + n.name +
                           "' (Dropout): gradient needs the mask output or a kiln_rng_id attribute");
    });
  }

  // ONNX schema versions implemented (OpDef::onnx_since; tests/ir/op_table_test.cpp
  // compares them with ONNX's own history).
  set_onnx_since(t, "Abs", {13});
  set_onnx_since(t, "Add", {13, 14});
  set_onnx_since(t, "And", {7});
  set_onnx_since(t, "Cast", {13, 19, 21, 23, 24, 25, 28});
  set_onnx_since(t, "CastLike", {15, 19, 21, 23, 24, 25});
  set_onnx_since(t, "Ceil", {13});
  set_onnx_since(t, "Clip", {13});
  set_onnx_since(t, "Cos", {7, 22});
  set_onnx_since(t, "Div", {13, 14});
  set_onnx_since(t, "Dropout", {13, 22});
  set_onnx_since(t, "Equal", {13, 19});
  set_onnx_since(t, "Erf", {13});
  set_onnx_since(t, "Exp", {13});
  set_onnx_since(t, "Floor", {13});
  set_onnx_since(t, "Gelu", {20});
  set_onnx_since(t, "Greater", {13});
  set_onnx_since(t, "GreaterOrEqual", {12, 16});
  set_onnx_since(t, "Identity", {13, 14, 16, 19, 21, 23, 24, 25});
  set_onnx_since(t, "IsInf", {10, 20});
  set_onnx_since(t, "IsNaN", {13, 20});
  set_onnx_since(t, "LeakyRelu", {6, 16});
  set_onnx_since(t, "Less", {13});
  set_onnx_since(t, "LessOrEqual", {12, 16});
  set_onnx_since(t, "Log", {13});
  set_onnx_since(t, "Max", {13});
  set_onnx_since(t, "Min", {13});
  set_onnx_since(t, "Mod", {13, 28});
  set_onnx_since(t, "Mul", {13, 14});
  set_onnx_since(t, "Neg", {13});
  set_onnx_since(t, "Not", {1});
  set_onnx_since(t, "Or", {7});
  set_onnx_since(t, "Pow", {13, 15});
  set_onnx_since(t, "Reciprocal", {13});
  set_onnx_since(t, "Relu", {13, 14});
  set_onnx_since(t, "Round", {11, 22});
  set_onnx_since(t, "Sigmoid", {13});
  set_onnx_since(t, "Sign", {13});
  set_onnx_since(t, "Sin", {7, 22});
  set_onnx_since(t, "Softplus", {1, 22});
  set_onnx_since(t, "Sqrt", {13});
  set_onnx_since(t, "Sub", {13, 14});
  set_onnx_since(t, "Tanh", {13});
  set_onnx_since(t, "Where", {9, 16});
  set_onnx_since(t, "Xor", {7});
}

// ---------------------------------------------------------------- scalar rules
// Element rules for code generation (OpDef::scalar). Each reproduces its eager kernel
// (runtime/kernels/elementwise.cpp) operation for operation, so that generated code
// equals eager results bit for bit in f32: composite ops widen bf16/f16 inputs to f32,
// compute, and round once at the end, as the eager kernels' compute_t does.
namespace {

using SB = ScalarBuilder;
using Ref = SB::Ref;
using SO = ScalarOp;

/// Compute dtype of a storage dtype (eager compute_t): f32 for bf16/f16.
DType compute_dtype(DType t) { return (t == DType::bf16 || t == DType::f16) ? DType::f32 : t; }
Ref widen(SB& b, Ref r) {
  DType c = compute_dtype(b.dtype(r));
  return c == b.dtype(r) ? r : b.apply(SO::cast, {r}, c);
}
Ref narrow(SB& b, Ref r, DType to) { return b.dtype(r) == to ? r : b.apply(SO::cast, {r}, to); }

/// y = op(x...) on the inputs' own dtype (the emitter rounds bf16/f16 once per op).
ScalarFn direct(SO op, int arity, bool floats_only = false, bool bool_result = false) {
  return [=](SB& b, std::vector<Ref>& out) -> Status {
    std::vector<Ref> a;
    for (int i = 0; i < arity; ++i) a.push_back(b.input(i));
    DType dt = b.dtype(a[0]);
    if (floats_only && !is_float(dt)) return Status::error("float only");
    out = {b.apply(op, a, bool_result ? DType::boolean : dt)};
    return Status::ok();
  };
}

/// y = f(x) computed in the compute dtype of x (floats), rounded once to x's dtype.
template <typename F>
ScalarFn composite_unary(F f) {
  return [f](SB& b, std::vector<Ref>& out) -> Status {
    Ref x = b.input(0);
    DType dt = b.dtype(x);
    if (!is_float(dt)) return Status::error("float only");
    Ref xc = widen(b, x);
    DType c = b.dtype(xc);
    out = {narrow(b, f(b, xc, c), dt)};
    return Status::ok();
  };
}

}  // namespace

void register_scalar_rules(OpTable& t) {
  auto set = [&](const char* name, ScalarFn f) { t.find_mutable(name)->scalar = std::move(f); };
  set("Add", direct(SO::add, 2));
  set("Sub", direct(SO::sub, 2));
  set("Mul", direct(SO::mul, 2));
  set("Div", direct(SO::div, 2, /*floats_only=*/true));  // integer Div's 0 / -1 rules stay eager
  set("Pow", [](SB& b, std::vector<Ref>& out) -> Status {
    Ref x = b.input(0), e = b.input(1);
    DType dt = b.dtype(x);
    if (!is_float(dt)) return Status::error("float only");
    Ref xc = widen(b, x);
    DType c = b.dtype(xc);
    Ref ec = b.dtype(e) == c ? e : b.apply(SO::cast, {e}, c);
    out = {narrow(b, b.apply(SO::pow, {xc, ec}, c), dt)};
    return Status::ok();
  });
  set("Neg", direct(SO::neg, 1));
  set("Abs", [](SB& b, std::vector<Ref>& out) -> Status {
    Ref x = b.input(0);
    DType dt = b.dtype(x);
    Ref lt0 = b.apply(SO::lt, {x, b.constant(0, dt)}, DType::boolean);
    out = {b.apply(SO::select, {lt0, b.apply(SO::neg, {x}, dt), x}, dt)};
    return Status::ok();
  });
  set("Relu", [](SB& b, std::vector<Ref>& out) -> Status {
    Ref x = b.input(0);
    DType dt = b.dtype(x);
    Ref zero = b.constant(0, dt);
    out = {b.apply(SO::select, {b.apply(SO::lt, {x, zero}, DType::boolean), zero, x}, dt)};
    return Status::ok();
  });
  set("Sqrt", direct(SO::sqrt, 1, true));
  set("Exp", direct(SO::exp, 1, true));
  set("Log", direct(SO::log, 1, true));
  set("Tanh", direct(SO::tanh, 1, true));
  set("Erf", direct(SO::erf, 1, true));
  set("Sin", direct(SO::sin, 1, true));
  set("Cos", direct(SO::cos, 1, true));
  set("Reciprocal", composite_unary([](SB& b, Ref x, DType c) { return b.apply(SO::div, {b.constant(1, c), x}, c); }));
  set("Sigmoid", composite_unary([](SB& b, Ref x, DType c) {
        Ref one = b.constant(1, c);
        Ref pos =
            b.apply(SO::div, {one, b.apply(SO::add, {one, b.apply(SO::exp, {b.apply(SO::neg, {x}, c)}, c)}, c)}, c);
        Ref e = b.apply(SO::exp, {x}, c);
        Ref neg = b.apply(SO::div, {e, b.apply(SO::add, {one, e}, c)}, c);
        Ref ge0 = b.apply(SO::ge, {x, b.constant(0, c)}, DType::boolean);
        return b.apply(SO::select, {ge0, pos, neg}, c);
      }));
  t.find_mutable("LeakyRelu")->scalar = [](SB& b, std::vector<Ref>& out) -> Status {
    const double alpha = b.node().attrs.get_float("alpha", 0.01);
    return composite_unary([alpha](SB& b, Ref x, DType c) {
      Ref lt0 = b.apply(SO::lt, {x, b.constant(0, c)}, DType::boolean);
      return b.apply(SO::select, {lt0, b.apply(SO::mul, {b.constant(alpha, c), x}, c), x}, c);
    })(b, out);
  };
  set("Gelu", [](SB& b, std::vector<Ref>& out) -> Status {
    const std::string approx = b.node().attrs.get_string("approximate", "none");
    if (approx != "none" && approx != "tanh") return Status::error("approximate must be none or tanh");
    return composite_unary([approx](SB& b, Ref x, DType c) {
      auto k = [&](double v) { return b.constant(v, c); };
      auto mul = [&](Ref p, Ref q) { return b.apply(SO::mul, {p, q}, c); };
      auto add = [&](Ref p, Ref q) { return b.apply(SO::add, {p, q}, c); };
      if (approx == "tanh") {  // 0.5 x (1 + tanh(k (x + 0.044715 x^3)))
        Ref cube = mul(mul(mul(k(0.044715), x), x), x);
        Ref th = b.apply(SO::tanh, {mul(k(M_SQRT2 * M_2_SQRTPI * 0.5), add(x, cube))}, c);
        return mul(mul(k(0.5), x), add(k(1), th));
      }
      Ref er = b.apply(SO::erf, {mul(x, k(M_SQRT1_2))}, c);  // 0.5 x (1 + erf(x / sqrt 2))
      return mul(mul(k(0.5), x), add(k(1), er));
    })(b, out);
  });
  set("GeluGrad", [](SB& b, std::vector<Ref>& out) -> Status {
    const bool tanh_approx = b.node().attrs.get_string("approximate", "none") == "tanh";
    Ref dy0 = b.input(0), x0 = b.input(1);
    DType dt = b.dtype(dy0);
    if (!is_float(dt) || b.dtype(x0) != dt) return Status::error("float inputs of one dtype only");
    Ref x = widen(b, x0), dy = widen(b, dy0);
    DType c = b.dtype(x);
    auto k = [&](double v) { return b.constant(v, c); };
    auto mul = [&](Ref p, Ref q) { return b.apply(SO::mul, {p, q}, c); };
    auto add = [&](Ref p, Ref q) { return b.apply(SO::add, {p, q}, c); };
    auto sub = [&](Ref p, Ref q) { return b.apply(SO::sub, {p, q}, c); };
    Ref d;
    if (tanh_approx) {
      Ref beta = k(M_SQRT2 * M_2_SQRTPI * 0.5), kappa = k(0.044715);
      Ref inner = mul(beta, add(x, mul(mul(mul(kappa, x), x), x)));
      Ref th = b.apply(SO::tanh, {inner}, c);
      Ref left = mul(k(0.5), add(k(1), th));
      Ref right =
          mul(mul(mul(mul(k(0.5), x), sub(k(1), mul(th, th))), beta), add(k(1), mul(mul(mul(k(3), kappa), x), x)));
      d = add(left, right);
    } else {
      Ref cdf = mul(k(0.5), add(k(1), b.apply(SO::erf, {mul(x, k(M_SQRT1_2))}, c)));
      Ref pdf = mul(b.apply(SO::exp, {mul(mul(k(-0.5), x), x)}, c), k(M_2_SQRTPI * M_SQRT1_2 * 0.5));
      d = add(cdf, mul(x, pdf));
    }
    out = {narrow(b, mul(dy, d), dt)};
    return Status::ok();
  });
  set("Clip", [](SB& b, std::vector<Ref>& out) -> Status {
    Ref x = b.input(0);
    DType dt = b.dtype(x);
    if (!is_float(dt)) return Status::error("float only");
    const Attributes& at = b.node().attrs;
    Ref xc = widen(b, x);
    DType c = b.dtype(xc);
    Ref r = xc;
    Ref lo = b.has_input(1) ? widen(b, b.input(1)) : (at.has("min") ? b.constant(at.get_float("min", 0), c) : -1);
    Ref hi = b.has_input(2) ? widen(b, b.input(2)) : (at.has("max") ? b.constant(at.get_float("max", 0), c) : -1);
    if (lo >= 0) r = b.apply(SO::select, {b.apply(SO::lt, {r, lo}, DType::boolean), lo, r}, c);
    if (hi >= 0) r = b.apply(SO::select, {b.apply(SO::gt, {r, hi}, DType::boolean), hi, r}, c);
    out = {narrow(b, r, dt)};
    return Status::ok();
  });
  for (auto [name, op] : {std::pair{"Max", SO::max}, std::pair{"Min", SO::min}}) {
    SO o = op;
    set(name, [o](SB& b, std::vector<Ref>& out) -> Status {
      const int n = b.node().num_inputs();
      Ref acc = b.input(0);
      for (int i = 1; i < n; ++i) acc = b.apply(o, {acc, b.input(i)}, b.dtype(acc));
      out = {acc};
      return Status::ok();
    });
  }
  set("Where", [](SB& b, std::vector<Ref>& out) -> Status {
    Ref x = b.input(1);
    out = {b.apply(SO::select, {b.input(0), x, b.input(2)}, b.dtype(x))};
    return Status::ok();
  });
  set("Floor", direct(SO::floor, 1, true));
  set("Ceil", direct(SO::ceil, 1, true));
  set("Round", direct(SO::round, 1, true));
  set("Sign", [](SB& b, std::vector<Ref>& out) -> Status {
    Ref x = b.input(0);
    DType dt = b.dtype(x);
    if (dt == DType::boolean) return Status::error("not a bool op");
    Ref zero = b.constant(0, dt);
    Ref s = b.apply(SO::select, {b.apply(SO::eq, {x, zero}, DType::boolean), zero, x}, dt);  // 0 and NaN stay
    s = b.apply(SO::select, {b.apply(SO::lt, {x, zero}, DType::boolean), b.constant(-1, dt), s}, dt);
    out = {b.apply(SO::select, {b.apply(SO::gt, {x, zero}, DType::boolean), b.constant(1, dt), s}, dt)};
    return Status::ok();
  });
  set("IsNaN", [](SB& b, std::vector<Ref>& out) -> Status {
    Ref x = b.input(0);
    if (!is_float(b.dtype(x))) return Status::error("float only");
    out = {b.apply(SO::logical_not, {b.apply(SO::eq, {x, x}, DType::boolean)}, DType::boolean)};
    return Status::ok();
  });
  set("IsInf", [](SB& b, std::vector<Ref>& out) -> Status {
    Ref x = b.input(0);
    DType dt = b.dtype(x);
    if (!is_float(dt)) return Status::error("float only");
    const Attributes& a = b.node().attrs;
    const bool pos = a.get_int("detect_positive", 1) != 0, neg = a.get_int("detect_negative", 1) != 0;
    Ref r = b.constant(0, DType::boolean);
    if (pos) r = b.apply(SO::eq, {x, b.constant(std::numeric_limits<double>::infinity(), dt)}, DType::boolean);
    if (neg) {
      Ref n = b.apply(SO::eq, {x, b.constant(-std::numeric_limits<double>::infinity(), dt)}, DType::boolean);
      r = pos ? b.apply(SO::logical_or, {r, n}, DType::boolean) : n;
    }
    out = {r};
    return Status::ok();
  });
  set("Mod", [](SB& b, std::vector<Ref>& out) -> Status {
    Ref x = b.input(0), y = b.input(1);
    DType dt = b.dtype(x);
    if (dt == DType::boolean) return Status::error("not a bool op");
    Ref xc = widen(b, x), yc = widen(b, y);
    DType c = b.dtype(xc);
    Ref r = b.apply(SO::fmod, {xc, yc}, c);
    if (b.node().attrs.get_int("fmod", 0) == 0) {
      // Floor mod: a nonzero remainder whose sign differs from b's moves by b; a zero
      // remainder of a float takes b's sign (Mod-28).
      Ref zero = b.constant(0, c);
      Ref rneg = b.apply(SO::lt, {r, zero}, DType::boolean), yneg = b.apply(SO::lt, {yc, zero}, DType::boolean);
      Ref nz = b.apply(SO::logical_not, {b.apply(SO::eq, {r, zero}, DType::boolean)}, DType::boolean);
      Ref fix = b.apply(SO::logical_and, {nz, b.apply(SO::logical_xor, {rneg, yneg}, DType::boolean)}, DType::boolean);
      r = b.apply(SO::select, {fix, b.apply(SO::add, {r, yc}, c), r}, c);
      if (is_float(c)) {
        Ref signed_zero = b.apply(SO::select, {yneg, b.constant(-0.0, c), zero}, c);
        r = b.apply(SO::select, {b.apply(SO::eq, {r, zero}, DType::boolean), signed_zero, r}, c);
      }
    }
    out = {narrow(b, r, dt)};
    return Status::ok();
  });
  set("Equal", direct(SO::eq, 2, false, true));
  set("Less", direct(SO::lt, 2, false, true));
  set("LessOrEqual", direct(SO::le, 2, false, true));
  set("Greater", direct(SO::gt, 2, false, true));
  set("GreaterOrEqual", direct(SO::ge, 2, false, true));
  set("And", direct(SO::logical_and, 2, false, true));
  set("Or", direct(SO::logical_or, 2, false, true));
  set("Xor", direct(SO::logical_xor, 2, false, true));
  set("Not", direct(SO::logical_not, 1, false, true));
  auto cast_rule = [](SB& b, std::vector<Ref>& out) -> Status {
    const Node& n = b.node();
    DType to = n.outputs[0]->dtype;
    if (to == DType::undefined) return Status::error("no target dtype");
    Ref x = b.input(0);
    if (to == DType::boolean && b.dtype(x) != DType::boolean) {  // x != 0 (NaN: true, as C++'s bool(x))
      out = {b.apply(SO::logical_not, {b.apply(SO::eq, {x, b.constant(0.0, b.dtype(x))}, DType::boolean)},
                     DType::boolean)};
      return Status::ok();
    }
    out = {b.dtype(x) == to ? x : b.apply(SO::cast, {x}, to)};
    return Status::ok();
  };
  set("Cast", cast_rule);
  set("CastLike", cast_rule);
}

}  // namespace kiln::ir
