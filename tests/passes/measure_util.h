// Measured peak memory of one eager run, with the accounting the memory planner's eager
// plan uses (passes/memory_plan.h, PlanOptions::eager()): the MemoryStats peak during
// the run, minus the bytes resident before it, plus the bytes the step itself holds
// resident (its feeds and its constant initializers).
#pragma once
#include <gtest/gtest.h>

#include <functional>
#include <map>
#include <string>

#include "ir/graph.h"
#include "ir/tensor.h"
#include "runtime/interpreter.h"

namespace kiln::testing {

/// Runs `g` on `feeds` in training mode and returns its measured peak bytes (-1 after a
/// failed run, reported as a test failure). Every graph input must be fed or have a
/// default (ir::Graph::input_defaults: counted resident like a feed).
/// With `microbatch` (runtime::microbatches_of), data inputs not fed are streamed into
/// the accumulation loop from data held outside the step (as the trainer streams them).
inline int64_t measured_step_peak(
    const ir::Graph& g, const std::map<std::string, ir::Tensor>& feeds,
    std::function<Expected<ir::Tensor>(const ir::Value&, int64_t, int64_t)> microbatch = nullptr) {
  int64_t resident = 0;
  for (ir::Value* in : g.inputs) {
    auto it = feeds.find(in->name);
    if (auto d = g.input_defaults.find(in->name); it == feeds.end() && d != g.input_defaults.end()) {
      resident += static_cast<int64_t>(d->second->nbytes());  // a run-time setting left at its default
      continue;
    }
    if (it == feeds.end() && microbatch) continue;
    if (it == feeds.end()) {
      ADD_FAILURE() << "no feed for graph input " << in->name;
      return -1;
    }
    resident += static_cast<int64_t>(it->second.nbytes());
  }
  for (ir::Value* v : g.initializers) resident += static_cast<int64_t>(v->data->nbytes());
  runtime::RunOptions ro;
  ro.training = true;
  ro.microbatch = std::move(microbatch);
  const int64_t before = ir::MemoryStats::current_bytes();
  ir::MemoryStats::reset_peak();
  {
    auto out = runtime::run_graph(g, feeds, ro);
    if (!out) {
      ADD_FAILURE() << out.message();
      return -1;
    }
  }
  return ir::MemoryStats::peak_bytes() - before + resident;
}

}  // namespace kiln::testing
