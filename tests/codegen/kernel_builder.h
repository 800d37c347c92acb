// Hand-made kernels for the codegen tests: a Kernel with the kernel IR's own builders
// (Kernel::add_*), plus output helpers. Shared by kernel_ir_test.cpp and llvm_cpu_test.cpp.
#pragma once
#include <string>
#include <utility>
#include <vector>

#include "codegen/kernel_ir.h"

namespace kiln::codegen::testing {

struct KB {
  Kernel k;
  explicit KB(std::string name, std::vector<int64_t> domain, std::vector<bool> reduced = {}) {
    k.name = std::move(name);
    k.domain = std::move(domain);
    k.reduced = std::move(reduced);
  }
  int param(const std::string& name, ir::DType dt, std::vector<int64_t> strides, bool out = false,
            int64_t offset = 0) {
    return k.add_param(name, dt, std::move(strides), out, offset);
  }
  int load(int p) { return k.add_load(p); }
  int cst(double v, ir::DType dt) { return k.add_constant(v, dt); }
  int op(ir::ScalarOp o, std::vector<int> args, ir::DType dt) { return k.add_op(o, std::move(args), dt); }
  void store(int p, int e, ReduceKind r = ReduceKind::none) { k.add_store(p, e, r); }
  /// Adds an output param with strides `strides` and stores expr e into it.
  int out(const std::string& name, int e, std::vector<int64_t> strides, ReduceKind r = ReduceKind::none) {
    int p = param(name, k.exprs[e].dtype, std::move(strides), true);
    k.add_store(p, e, r);
    return p;
  }
};

}  // namespace kiln::codegen::testing
