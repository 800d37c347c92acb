// Op table entries: training ops.
#include "ir/op_table.h"

namespace kiln::ir {

void register_training_ops(OpTable& t) { (void)t; }

}  // namespace kiln::ir
