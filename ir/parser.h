// Parser of the IR text form that ir/printer.h writes (DESIGN.md convention 6: a text IR
// that round-trips). parse_graph(graph_to_string(g)) rebuilds the graph's structure:
// inputs with dtypes and (static or symbolic) shapes, initializers, nodes with op,
// name, attributes, output types, nested regions (reading the enclosing graphs' values
// by capture), state bindings and outputs; printing the result gives the same text.
// What the printer leaves out cannot come back: initializer data of more than 4
// elements and tensor attributes of more than 8 are re-imported as zeros of their
// dtype and shape, small values with the printer's 6 significant digits, and state
// bindings without their initial values. Used to re-import `--dump-ir-dir` files and
// `kiln compile`'s DIR/ir/*.txt.
#pragma once
#include <memory>
#include <string>

#include "ir/graph.h"
#include "ir/status.h"

namespace kiln::ir {

/// Parses one top-level graph. Errors: "line N: <what was expected>, got '<text>'".
Expected<std::unique_ptr<Graph>> parse_graph(const std::string& text);

}  // namespace kiln::ir
