#include <cstdlib>
#include <iostream>

#include "runtime/kernels/kernels.h"

namespace kiln::runtime::kernels {

void set_kernel(ir::OpTable& t, const char* name, ir::KernelFn fn) {
  ir::OpDef* d = t.find_mutable(name);
  if (!d) {
    std::cerr << "kiln: eager kernel for unknown op '" << name << "'\n";
    std::abort();
  }
  d->kernel = std::move(fn);
}

void set_kernel_writing_all_outputs(ir::OpTable& t, const char* name, ir::KernelFn fn) {
  set_kernel(t, name, std::move(fn));
  t.find_mutable(name)->kernel_writes_all_outputs = true;
}

}  // namespace kiln::runtime::kernels
