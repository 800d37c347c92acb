// Eager kernels: training ops.
#include "runtime/kernels/kernels.h"

namespace kiln::runtime::kernels {

void register_training_kernels(ir::OpTable& t) { (void)t; }

}  // namespace kiln::runtime::kernels
