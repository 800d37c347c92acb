// Eager kernels: shape ops.
#include "runtime/kernels/kernels.h"

namespace kiln::runtime::kernels {

void register_shape_kernels(ir::OpTable& t) { (void)t; }

}  // namespace kiln::runtime::kernels
