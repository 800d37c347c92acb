// Fills the eager-kernel field of the op table from the kernel groups.
#include <mutex>

#include "ir/op_table.h"
#include "runtime/interpreter.h"
#include "runtime/kernels/kernels.h"

namespace kiln::runtime {

void register_eager_kernels() {
  static std::once_flag once;
  std::call_once(once, [] {
    auto& t = ir::OpTable::get();
    kernels::register_elementwise_kernels(t);
    kernels::register_shape_kernels(t);
    kernels::register_nn_kernels(t);
    kernels::register_reduction_kernels(t);
    kernels::register_loss_kernels(t);
    kernels::register_training_kernels(t);
    kernels::register_optim8bit_kernels(t);
    kernels::register_indexing_kernels(t);
    kernels::register_collective_kernels(t);
    kernels::set_kernel(t, "AccumulationLoop", accumulation_loop_kernel);
    kernels::set_kernel(t, "FusedKernel", fused_kernel_eager);
  });
}

}  // namespace kiln::runtime
