// Op table entries: elementwise ops.
#include "ir/op_table.h"

namespace kiln::ir {

void register_elementwise_ops(OpTable& t) { (void)t; }

}  // namespace kiln::ir
