// Eager kernels: reduction ops.
#include "runtime/kernels/kernels.h"

namespace kiln::runtime::kernels {

void register_reduction_kernels(ir::OpTable& t) { (void)t; }

}  // namespace kiln::runtime::kernels
