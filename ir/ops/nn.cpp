// Op table entries: nn ops.
#include "ir/op_table.h"

namespace kiln::ir {

void register_nn_ops(OpTable& t) { (void)t; }

}  // namespace kiln::ir
