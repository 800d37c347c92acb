// Eager kernels: elementwise ops.
#include "runtime/kernels/kernels.h"

namespace kiln::runtime::kernels {

void register_elementwise_kernels(ir::OpTable& t) { (void)t; }

}  // namespace kiln::runtime::kernels
