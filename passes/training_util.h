// Small IR-building helpers shared by the training passes (loss, autodiff, optimizer).
#pragma once
#include <string>
#include <vector>

#include "ir/graph.h"
#include "ir/op_table.h"

namespace kiln::passes {

/// Appends nodes at the end of a graph, inferring each node's output types at once.
/// Node names are "<prefix>/<op>_<k>", deterministic for a given build order.
class Builder {
 public:
  Builder(ir::Graph& g, std::string prefix) : g_(g), prefix_(std::move(prefix)) {}
  /// Emits one node; returns its outputs. Type inference errors are returned.
  Expected<std::vector<ir::Value*>> emit(const std::string& op, std::vector<ir::Value*> inputs, int num_outputs = 1,
                                         ir::Attributes attrs = {}, const std::string& out_name = "");
  /// Emits a single-output node. On an inference error, records it (see status()) and returns nullptr.
  ir::Value* op(const std::string& op, std::vector<ir::Value*> inputs, ir::Attributes attrs = {},
                const std::string& out_name = "");
  /// Scalar constant (rank 0) of the given float dtype, as an initializer.
  ir::Value* scalar(double v, ir::DType dtype);
  /// 1-D i64 constant, as an initializer.
  ir::Value* ints(const std::vector<int64_t>& v);
  /// First inference error recorded by op(), or ok.
  const Status& status() const { return status_; }
  void set_prefix(std::string p) { prefix_ = std::move(p); }
  /// Puts the constants of scalar() and ints() into `g` (the root graph, when building
  /// inside a loop body: bodies read outer initializers as captures). Default: the graph built.
  void set_constant_graph(ir::Graph* g) { consts_ = g; }
  ir::Graph& graph() { return g_; }

 private:
  ir::Graph& g_;
  ir::Graph* consts_ = nullptr;
  std::string prefix_;
  int counter_ = 0;
  Status status_;
};

/// Attribute list helper: attrs({{"axis", int64_t(1)}}).
ir::Attributes make_attrs(std::initializer_list<std::pair<std::string, ir::AttrValue>> kv);

}  // namespace kiln::passes
