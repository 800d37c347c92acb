// Small IR-building helpers shared by the passes (loss, autodiff, optimizer) and the
// op decompositions of the op table (ir/ops/decompose.cpp).
#pragma once
#include <string>
#include <vector>

#include "ir/graph.h"
#include "ir/op_table.h"

namespace kiln::ir {

/// Appends nodes at the end of a graph, inferring each node's output types at once.
/// Node names are "<prefix>/<op>_<k>", deterministic for a given build order.
class Builder {
 public:
  Builder(Graph& g, std::string prefix) : g_(g), prefix_(std::move(prefix)) {}
  /// Emits one node; returns its outputs. Type inference errors are returned.
  Expected<std::vector<Value*>> emit(const std::string& op, std::vector<Value*> inputs, int num_outputs = 1,
                                     Attributes attrs = {}, const std::string& out_name = "");
  /// Emits a single-output node. On an inference error, records it (see status()) and returns nullptr.
  Value* op(const std::string& op, std::vector<Value*> inputs, Attributes attrs = {}, const std::string& out_name = "");
  /// Scalar constant (rank 0) of the given float dtype, as an initializer.
  Value* scalar(double v, DType dtype);
  /// 1-D i64 constant, as an initializer.
  Value* ints(const std::vector<int64_t>& v);
  /// 1-D i64 tensor of `d`'s extents (a Reshape or Expand target): ints() when every dim
  /// is static, else a SymInts node of the dims' expressions, evaluated at run time from
  /// the symbol values (issue 32). An unknown dim ('?') records an error and returns null.
  Value* dims(const std::vector<Dim>& d);
  /// First inference error recorded by op(), or ok.
  const Status& status() const { return status_; }
  void set_prefix(std::string p) { prefix_ = std::move(p); }
  /// Puts the constants of scalar() and ints() into `g` (the root graph, when building
  /// inside a loop body: bodies read outer initializers as captures). Default: the graph built.
  void set_constant_graph(Graph* g) { consts_ = g; }
  Graph& graph() { return g_; }

 private:
  Graph& g_;
  Graph* consts_ = nullptr;
  std::string prefix_;
  int counter_ = 0;
  Status status_;
};

/// Attribute list helper: attrs({{"axis", int64_t(1)}}).
Attributes make_attrs(std::initializer_list<std::pair<std::string, AttrValue>> kv);

}  // namespace kiln::ir
