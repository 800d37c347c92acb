// The manifest of an ahead-of-time training binary (`kiln compile`, issues 8 and 30):
// what the builder (tools/driver/aot_build.cpp) writes into the binary's data object and
// what the binary's runtime (tools/aot/aot_kernels.cpp) reads back. JSON (nlohmann-json):
//   {"format": 2, "kiln_version": "...", "symbols": [SYMBOL...]}
// where symbols[i] is the generated kernel function at index i of the binary's function
// table. The program itself (graphs, arenas, signature, configuration, model) is the
// program file (runtime/program.h) linked in as the blob kProgramSymbol; its kernels
// name their functions by symbol.
#pragma once

namespace kiln::aot {

/// Version of the manifest layout; a binary refuses a manifest of another format.
inline constexpr int kManifestFormat = 2;

/// Symbols of the binary's data object (codegen::emit_aot_data_object).
inline constexpr const char* kManifestSymbol = "kiln_aot_manifest";
inline constexpr const char* kProgramSymbol = "kiln_aot_program";
inline constexpr const char* kFunctionTableSymbol = "kiln_aot_fns";

}  // namespace kiln::aot
