// Runtime of the ahead-of-time training binary written by `kiln compile` (issue 8):
// the generated kernels are linked into the binary as object code together with a
// manifest (tools/aot/aot_manifest.h) and the model; nothing here needs LLVM.
#pragma once
#include <memory>
#include <string>

#include "codegen/cpu/program.h"
#include "ir/graph.h"
#include "ir/status.h"
#include "runtime/train_config.h"

namespace kiln::aot {

/// The manifest and model bytes linked into this binary; error when the binary has
/// none (a broken link) or the manifest is malformed or of another format.
Status load_embedded();

/// The compile-time TrainConfig from the manifest (load_embedded first).
Expected<runtime::TrainConfig> embedded_config();

/// The model bytes linked into the binary (load_embedded first).
std::string_view embedded_model();

/// Checks that this CPU has the instruction-set extensions the kernels were compiled
/// for (those of the manifest's feature string that the compiler can test at run time:
/// SSE4.2, AVX, AVX2, FMA, F16C, AVX-512 F/BW/DQ/VL/BF16). Error: names the missing ones.
Status check_cpu();

/// Kernels of `g` (`which`: "train" or "eval") from the binary's function table: each
/// FusedKernel node is lowered to kernel IR and matched by node name and fingerprint.
/// A node whose kernel differs (a run-time flag such as --max_steps changed a constant
/// of the LR schedule) or is missing gets no entry: the executor runs it op by op, and
/// one note line on stderr says how many. The program has no LLVM module.
Expected<std::shared_ptr<codegen::CpuProgram>> aot_program(const ir::Graph& g, const std::string& which);

}  // namespace kiln::aot
