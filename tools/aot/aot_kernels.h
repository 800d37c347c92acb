// Runtime of the ahead-of-time training binary written by `kiln compile` (issue 8,
// issue 30): the binary holds its program file (runtime/program.h: the post-pass graphs,
// arenas, signature, configuration and model) as data, and the program's generated
// kernels linked in as object code, found through a function table and the manifest
// (tools/aot/aot_manifest.h); nothing here needs LLVM, the frontend or a pass.
#pragma once
#include <memory>
#include <string>
#include <string_view>

#include "ir/status.h"
#include "runtime/program.h"

namespace kiln::aot {

/// Reads the manifest linked into this binary; error when the binary has none (a broken
/// link) or the manifest is malformed or of another format (one line naming both formats).
Status load_embedded();

/// The program file's bytes linked into the binary (load_embedded first).
std::string_view embedded_program();

/// Binds a program's kernels to the functions linked into this binary, by symbol.
/// Error: a kernel whose symbol the binary does not hold (a program from another build).
runtime::KernelBinder kernel_binder();

}  // namespace kiln::aot
