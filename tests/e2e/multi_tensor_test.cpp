// Multi-tensor optimizer launches (passes/multi_tensor.cpp, issue 7): the compiled
// pipeline groups the per-parameter updates (kiln_multi_tensor_group: generated kernels,
// and the eager 8-bit AdamW updates as their kernel's pieces),
// the executor runs a group's kernels in one parallel region, and the step arena keeps
// every buffer a member touches live over the whole group. Checked here: which nodes
// form a group (every parameter's update, nothing else; running statistics apart); that no member's output
// shares arena bytes with anything another member reads or writes (the members run at
// the same time); and that a grouped run equals the same program run one kernel after
// the other, bit for bit (losses and every state tensor).
#include <set>

#include "e2e_util.h"
#include "passes/memory_plan.h"

using namespace kiln;
using namespace kiln::testing;

namespace {

/// Members of each group of `g`, in node order.
std::map<int64_t, std::vector<const ir::Node*>> groups_of(const ir::Graph& g) {
  std::map<int64_t, std::vector<const ir::Node*>> m;
  for (auto& n : g.nodes())
    if (int64_t id = n->attrs.get_int("kiln_multi_tensor_group", -1); id >= 0) m[id].push_back(n.get());
  return m;
}

class MultiTensor : public ::testing::TestWithParam<ExampleCase> {};

TEST_P(MultiTensor, UpdatesFormOneGroupWithDisjointBuffersAndRunAsInSequence) {
  const ExampleCase& c = GetParam();
  auto [xs, ys] = load_trajectory(c.model);
  ASSERT_TRUE(xs && ys);
  const int64_t rows = xs->dim(1);
  auto prog = driver::build_training_program(example_case_config(c, "compiled", rows), nullptr, false, false, c.steps);
  ASSERT_TRUE(prog) << prog.message();
  ir::Graph& g = *prog->train_step;

  // One group: the update of every parameter, each writing only new state, nothing
  // else. Generated kernels, and with adamw_8bit also the eager AdamW8bitUpdate nodes of
  // the 8-bit-eligible tensors (run as their kernel's pieces; the small tensors kept in
  // fp32 update in generated code).
  // BatchNormalization's running statistics, generated pointwise kernels after the
  // decompose pass, form groups of their own (one per layer, in the forward pass): every
  // other group writes only "buffer" state.
  auto groups = groups_of(g);
  std::set<const ir::Value*> param_next, buffer_next;
  for (auto& sb : g.state) (sb.kind == "parameter" ? param_next : buffer_next).insert(sb.output);
  std::vector<const ir::Node*> members;
  int update_groups = 0;
  for (const auto& [id, ms] : groups) {
    bool updates = false;
    for (const ir::Node* m : ms)
      for (const ir::Value* o : m->outputs) updates |= param_next.count(o) > 0;
    if (updates) {
      ++update_groups;
      members = ms;
      continue;
    }
    for (const ir::Node* m : ms)
      for (const ir::Value* o : m->outputs)
        EXPECT_TRUE(buffer_next.count(o)) << m->name << " in group " << id << " writes " << o->name;
  }
  ASSERT_EQ(update_groups, 1) << "expected one multi-tensor group of parameter updates";
  // Every parameter's update is a member; parameters with equal gradients (cse: two
  // BatchNorm biases summed by a residual Add) may update in one kernel.
  const int64_t params = static_cast<int64_t>(param_next.size());
  int64_t updated = 0;
  for (const ir::Node* m : members)
    for (const ir::Value* o : m->outputs) updated += param_next.count(o) > 0;
  EXPECT_EQ(updated, params);
  std::set<const ir::Value*> outs(g.outputs.begin(), g.outputs.end());
  int64_t eightbit = 0, generated = 0;
  for (const ir::Node* m : members) {
    eightbit += m->op == "AdamW8bitUpdate";
    generated += m->op == "FusedKernel";
    EXPECT_EQ(m->attrs.get_int("kiln_multi_tensor_size", 0), static_cast<int64_t>(members.size()));
    for (const ir::Value* o : m->outputs) EXPECT_TRUE(outs.count(o)) << m->name << " writes a non-result";
  }
  EXPECT_EQ(eightbit + generated, static_cast<int64_t>(members.size()));
  if (c.optim == "adamw_8bit") {
    EXPECT_GE(eightbit, 1);
    EXPECT_GE(generated, 1);
  } else {
    EXPECT_EQ(eightbit, 0);
  }

  // Arena bytes: an output of one member never overlaps a value another member reads or writes.
  auto plan = driver::plan_step_arena_layout(g);
  ASSERT_TRUE(plan) << plan.message();
  std::map<const ir::Value*, std::pair<int64_t, int64_t>> range;  // value -> [offset, offset + bytes)
  for (const auto& vp : plan->values)
    if (vp.offset >= 0 && vp.bytes > 0) range[vp.value] = {vp.offset, vp.offset + vp.bytes};
  // A donated output (kiln_donate) is written into its own state input's buffer,
  // which no other member may read.
  int64_t checked = 0, donated = 0;
  for (const ir::Node* a : members) {
    const std::vector<int64_t> d = a->attrs.get_ints("kiln_donate");
    for (size_t j = 0; j < a->outputs.size(); ++j) {
      const ir::Value* o = a->outputs[j];
      if (j < d.size() && d[j] >= 0) {
        ++donated;
        const ir::Value* in = a->inputs[static_cast<size_t>(d[j])];
        for (const ir::Node* b : members)
          for (const ir::Value* v : b->inputs)
            EXPECT_TRUE(b == a || v != in) << b->name << " reads " << in->name << ", donated to " << a->name;
        EXPECT_LT(range.count(o), 1u) << o->name << " is donated and also in the arena";
        continue;
      }
      auto ra = range.find(o);
      if (ra == range.end()) continue;
      for (const ir::Node* b : members) {
        if (b == a) continue;
        std::vector<const ir::Value*> touched(b->inputs.begin(), b->inputs.end());
        touched.insert(touched.end(), b->outputs.begin(), b->outputs.end());
        for (const ir::Value* v : touched) {
          auto rb = range.find(v);
          if (rb == range.end()) continue;
          ++checked;
          EXPECT_TRUE(ra->second.second <= rb->second.first || rb->second.second <= ra->second.first)
              << o->name << " (" << a->name << ") overlaps " << v->name << " (" << b->name << ")";
        }
      }
    }
  }
  EXPECT_GT(checked + donated, 0) << "no member output is in the arena or donated";

  // Grouped against one kernel at a time: the same program with the group attributes
  // removed runs its kernels in sequence (same arena layout, which is valid for both).
  std::map<std::string, ir::Tensor> grouped, sequential;
  auto la = trajectory_losses(*prog, *xs, *ys, c.steps, false, &grouped);
  for (auto& n : g.nodes()) {
    n->attrs.erase("kiln_multi_tensor_group");
    n->attrs.erase("kiln_multi_tensor_size");
  }
  ASSERT_TRUE(groups_of(g).empty());
  auto lb = trajectory_losses(*prog, *xs, *ys, c.steps, false, &sequential);
  ASSERT_EQ(la.size(), static_cast<size_t>(c.steps));
  ASSERT_EQ(lb.size(), la.size());
  for (size_t i = 0; i < la.size(); ++i) EXPECT_EQ(la[i], lb[i]) << "step " << i;
  expect_bitwise_equal(grouped, sequential);
}

INSTANTIATE_TEST_SUITE_P(Examples, MultiTensor,
                         ::testing::Values(ExampleCase{"tiny_gpt"},
                                           ExampleCase{"tiny_gpt", "bf16", "adamw_8bit", "none", 2},
                                           ExampleCase{"resnet18", "fp32", "sgd"}, ExampleCase{"mlp_digits"}),
                         [](const ::testing::TestParamInfo<ExampleCase>& i) { return example_case_name(i.param); });

}  // namespace
