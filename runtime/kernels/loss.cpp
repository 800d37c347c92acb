// Eager kernels: loss ops.
#include "runtime/kernels/kernels.h"

namespace kiln::runtime::kernels {

void register_loss_kernels(ir::OpTable& t) { (void)t; }

}  // namespace kiln::runtime::kernels
