// Op table entries: loss ops.
#include "ir/op_table.h"

namespace kiln::ir {

void register_loss_ops(OpTable& t) { (void)t; }

}  // namespace kiln::ir
