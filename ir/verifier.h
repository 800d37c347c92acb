// Structural verifier of a Graph: every op is in the op table, arity and
// attribute kinds follow the op's schema, every input is defined before use,
// value names are unique, and the recorded output types equal re-inference.
#pragma once
#include "ir/graph.h"
#include "ir/status.h"

namespace kiln::ir {

/// Returns the first problem found, naming the node and op, or ok.
Status verify_graph(const Graph& g);

}  // namespace kiln::ir
