// KILN_LOGS: readable compiler output while `kiln train` / `kiln bench` / `kiln compile`
// run, one topic per word, in the manner of PyTorch's TORCH_LOGS:
//   KILN_LOGS=graph,fusion,output_code,memory,recompiles,cache,passes   (or "all")
// graph        the training and eval programs after every pass (IR text)
// fusion       each FusedKernel: kind, the ops it absorbed, its inputs and outputs
// output_code  every kernel in kernel-IR text and the module's LLVM IR after O3
// memory       the static memory plan of the training step
// recompiles   one line per program compiled, with why
// cache        compile-cache and program-cache hits, misses and stores
// passes       each model import and each pass pipeline run (none when a program is loaded)
// Every line goes to stderr prefixed "[kiln:TOPIC] ".
#pragma once
#include <string>
#include <vector>

#include "ir/graph.h"

namespace kiln::driver {

/// The topics KILN_LOGS knows, in documentation order.
const std::vector<std::string>& log_topics();

/// Whether `topic` is enabled by $KILN_LOGS (read once per process; unknown words
/// give one warning line on stderr naming them and the known topics).
bool log_enabled(const std::string& topic);

/// Writes `text` to stderr, every line prefixed "[kiln:TOPIC] ", when `topic` is enabled.
void log_text(const std::string& topic, const std::string& text);

/// For tests: re-reads $KILN_LOGS.
void reload_log_settings();

/// Fusion decisions of `g` (top level and loop bodies): one line per FusedKernel node
/// (name, kind, the absorbed ops in order, input and output counts) and a summary line
/// (top-level nodes, kernels, ops absorbed). What KILN_LOGS=fusion prints.
std::string describe_fusion(const ir::Graph& g);

}  // namespace kiln::driver
