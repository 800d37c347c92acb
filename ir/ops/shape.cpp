// Op table entries: shape ops.
#include "ir/op_table.h"

namespace kiln::ir {

void register_shape_ops(OpTable& t) { (void)t; }

}  // namespace kiln::ir
