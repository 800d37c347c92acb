// Eager kernels: nn ops.
#include "runtime/kernels/kernels.h"

namespace kiln::runtime::kernels {

void register_nn_kernels(ir::OpTable& t) { (void)t; }

}  // namespace kiln::runtime::kernels
