// `kiln compile MODEL [train flags] -o DIR` (issue 8): builds the training program
// ahead of time and writes
//   DIR/train               standalone training binary (tools/aot/train_main.cpp): the
//                           generated kernels as object code, kiln's runtime, the model
//                           with its initial weights, the configuration; linked with the
//                           system linker (c++), no LLVM, Python or kiln tree needed to run
//   DIR/ir/NN-PASS.txt      the training program's IR after each pass
//   DIR/kernels/            every kernel in kernel-IR text (PROGRAM_NNN_NAME.kir) and each
//                           program's LLVM IR after O3 (PROGRAM.ll)
//   DIR/memory_plan.txt     the static memory plan of one training step
//   DIR/compile_report.json time per phase, kernel and fused-op counts, planned peak
//                           bytes by category, compile-cache status
//   DIR/obj/, DIR/link.log  the objects linked and the linker's output
#pragma once
#include <ostream>
#include <string>

#include "ir/status.h"
#include "passes/pass.h"
#include "runtime/train_config.h"

namespace kiln::driver {

/// The flags kiln compile refuses: a backend other than compiled, and the per-run flags
/// of DIR/train (--overwrite_output_dir, --resume_from_checkpoint). Error naming the flag.
Status check_compile_flags(const runtime::TrainConfig& cfg);

/// Compiles `cfg` (backend compiled) into `out_dir` as described above and prints a
/// short summary on `out`. The LR schedule needs the number of optimizer steps: from
/// --max_steps, else from --train_data's rows. Errors (one line): no step count, a
/// model with external data, a failed build, an unwritable DIR, no link inputs next to
/// kiln (build/lib/kiln_aot_link.txt), a failed link (the line names DIR/link.log).
Status compile_training_binary(const runtime::TrainConfig& cfg, passes::PassContext& dbg, const std::string& out_dir,
                               std::ostream& out);

}  // namespace kiln::driver
