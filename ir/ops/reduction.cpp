// Op table entries: reduction ops.
#include "ir/op_table.h"

namespace kiln::ir {

void register_reduction_ops(OpTable& t) { (void)t; }

}  // namespace kiln::ir
