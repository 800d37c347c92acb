// OpDef::kernel_writes_all_outputs: the interpreter allocates such a kernel's outputs
// without a zero fill, so each flagged kernel must write every output element. Each is
// run twice on the same inputs, once into zero-filled outputs and once into outputs
// filled with 0xff bytes (NaN for floats, 255 for bytes); the outputs must be equal byte
// for byte. Every flagged op must have a case here (a newly flagged op without one fails).
#include <gtest/gtest.h>

#include <cstring>
#include <set>

#include "ir/op_table.h"
#include "ir/ops/optim8bit.h"
#include "runtime/interpreter.h"
#include "tests/runtime/op_test_util.h"

using namespace kiln;
using namespace kiln::ir;
using namespace kiln::testing;

namespace {

struct Case {
  std::string op;
  std::vector<Tensor> inputs;
  Attributes attrs;
  int outputs = 1;
  bool training = false;
};

/// Outputs of op's eager kernel when its outputs start as `fill` bytes.
std::vector<Tensor> run_into(const Case& c, uint8_t fill, const std::vector<Tensor>& shapes) {
  Node n;
  n.op = c.op;
  n.name = "writes_" + c.op;
  n.attrs = c.attrs;
  n.outputs.assign(static_cast<size_t>(c.outputs), nullptr);
  KernelContext k{n, {}, {}, c.training, 7, 3, 11};
  for (const Tensor& t : c.inputs) k.inputs.push_back(&t);
  for (const Tensor& s : shapes) {
    Tensor t = Tensor::uninitialized(s.dtype(), s.dims());
    std::memset(t.raw(), fill, t.nbytes());
    k.outputs.push_back(t);
  }
  Status st = OpTable::get().find(c.op)->kernel(k);
  EXPECT_TRUE(st.is_ok()) << c.op << ": " << st.message();
  return k.outputs;
}

TEST(KernelWrites, FlaggedKernelsWriteEveryOutputElement) {
  runtime::register_eager_kernels();
  Attributes ta, axis1, split;
  ta.set("transA", int64_t(1));
  axis1.set("axis", int64_t(1));
  split.set("axis", int64_t(1));
  split.set("num_outputs", int64_t(3));
  Attributes ratio;
  ratio.set("ratio", 0.3);
  auto strided = [](std::vector<int64_t> size, std::vector<int64_t> stride, int64_t offset) {
    Attributes a;
    a.set("size", size);
    a.set("stride", stride);
    a.set("storage_offset", offset);
    return a;
  };
  std::vector<Case> cases = {
      {"MatMul", {rnd(DType::f32, {2, 3, 4}, -1, 1, 1), rnd(DType::f32, {4, 5}, -1, 1, 2)}},
      {"MatMul", {rnd(DType::f32, {3, 0}, -1, 1, 1), rnd(DType::f32, {0, 5}, -1, 1, 2)}},  // K = 0: zeros
      {"MatMul", {rnd(DType::f64, {3, 4}, -1, 1, 1), rnd(DType::f64, {4, 2}, -1, 1, 2)}},
      {"Gemm", {rnd(DType::f32, {4, 3}, -1, 1, 3), rnd(DType::f32, {4, 5}, -1, 1, 4)}, ta},
      {"Gemm", {rnd(DType::f32, {3, 0}, -1, 1, 3), rnd(DType::f32, {0, 5}, -1, 1, 4), rnd(DType::f32, {5}, -1, 1, 5)}},
      {"Dropout", {rnd(DType::f32, {1000}, -1, 1, 6)}, ratio, 2, true},
      {"Dropout", {rnd(DType::f32, {1000}, -1, 1, 6)}, ratio, 2, false},
      {"Dropout", {rnd(DType::bf16, {77}, -1, 1, 6)}, ratio, 2, true},
      {"Concat", {rnd(DType::f32, {2, 3, 2}, -1, 1, 7), rnd(DType::f32, {2, 1, 2}, -1, 1, 8)}, axis1},
      {"Split", {rnd(DType::f32, {2, 6, 2}, -1, 1, 9)}, split, 3},
      // Indexing ops (ir/ops/indexing.cpp): every output element is gathered, copied or summed.
      {"CumSum", {rnd(DType::f32, {3, 4}, -1, 1, 16), Tensor::from_i64({1})}, {}},
      {"GatherElements",
       {rnd(DType::f32, {3, 4}, -1, 1, 17), Tensor::from_i64({0, 2, 1, 2, 1, 1, 0, 2}).reshaped({2, 4})}},
      {"GatherND", {rnd(DType::f32, {3, 4}, -1, 1, 18), Tensor::from_i64({2, 0, 1}).reshaped({3, 1})}},
      {"ScatterElements",
       {rnd(DType::f32, {3, 4}, -1, 1, 19), Tensor::from_i64({0, 2, 1, 2}).reshaped({1, 4}),
        rnd(DType::f32, {1, 4}, -1, 1, 20)}},
      {"ScatterND",
       {rnd(DType::f32, {4, 3}, -1, 1, 21), Tensor::from_i64({3, 0}).reshaped({2, 1}),
        rnd(DType::f32, {2, 3}, -1, 1, 22)}},
      // Their strided forms (passes/decompose.cpp): a transposed window; rows 1..2 replaced.
      {"AsStrided", {rnd(DType::f32, {3, 4}, -1, 1, 23)}, strided({2, 3}, {1, 4}, 1)},
      {"AsStridedScatter",
       {rnd(DType::f32, {4, 3}, -1, 1, 24), rnd(DType::f32, {2, 3}, -1, 1, 25)},
       strided({2, 3}, {3, 1}, 3)},
  };
  // 8-bit optimizer state: 1000 elements = 3 full blocks of 256 and one of 232 (the AVX2
  // path's 8-wide groups, a tail), one block of zeros (the zero-code rule).
  const Tensor qs = Tensor::from_f32(create_dynamic_map(true), {256});
  const Tensor qu = Tensor::from_f32(create_dynamic_map(false), {256});
  Tensor x = rnd(DType::f32, {1000}, -1, 1, 10);
  for (int64_t i = 256; i < 512; ++i) x.data<float>()[i] = 0.f;
  const Tensor codes = rnd(DType::u8, {1000}, 0, 255, 11), absmax = rnd(DType::f32, {4}, 0.01, 1, 12);
  Attributes adam;
  adam.set("beta1", 0.9);
  adam.set("beta2", 0.999);
  adam.set("eps", 1e-8);
  adam.set("weight_decay", 0.01);
  cases.push_back({"BlockwiseQuantize8bit", {x, qs}, {}, 2});
  cases.push_back({"BlockwiseDequantize8bit", {codes, absmax, qu}});
  cases.push_back({"AdamW8bitUpdate",
                   {rnd(DType::f32, {1000}, -1, 1, 13), x, codes, absmax, rnd(DType::u8, {1000}, 0, 255, 14),
                    rnd(DType::f32, {4}, 0.01, 1, 15), qs, qu, Tensor::scalar_f32(1e-3f), Tensor::scalar_f32(1e-2f),
                    Tensor::scalar_f32(0.05f)},
                   adam,
                   5});
  std::set<std::string> covered;
  for (const Case& c : cases) {
    covered.insert(c.op);
    std::vector<const Tensor*> ins;
    for (const Tensor& t : c.inputs) ins.push_back(&t);
    Node n;
    n.op = c.op;
    n.name = "writes_" + c.op;
    n.attrs = c.attrs;
    n.outputs.assign(static_cast<size_t>(c.outputs), nullptr);
    runtime::RunOptions o;
    o.training = c.training;
    auto shapes = runtime::run_node(n, ins, o);
    ASSERT_TRUE(shapes) << c.op << ": " << shapes.message();
    std::vector<Tensor> zero = run_into(c, 0x00, *shapes), poison = run_into(c, 0xff, *shapes);
    ASSERT_EQ(zero.size(), poison.size());
    for (size_t k = 0; k < zero.size(); ++k) {
      ASSERT_EQ(zero[k].nbytes(), poison[k].nbytes());
      EXPECT_EQ(std::memcmp(zero[k].raw(), poison[k].raw(), zero[k].nbytes()), 0)
          << c.op << " output " << k << " " << dims_to_string(zero[k].dims()) << ": depends on the initial contents";
    }
  }
  for (const auto& [name, def] : OpTable::get().all())
    if (def.kernel_writes_all_outputs) EXPECT_TRUE(covered.count(name)) << name << " is flagged but has no case here";
}

}  // namespace
