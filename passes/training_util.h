// Small IR-building helpers shared by the training passes (loss, autodiff, optimizer):
// ir::Builder and ir::make_attrs (ir/builder.h), under their passes names.
#pragma once
#include "ir/builder.h"

namespace kiln::passes {

using ir::Builder;
using ir::make_attrs;

}  // namespace kiln::passes
