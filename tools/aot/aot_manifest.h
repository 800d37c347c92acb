// The manifest of an ahead-of-time training binary (`kiln compile`, issue 8): what the
// builder (tools/cli) writes into the binary's data object and what the binary's
// runtime (tools/aot/aot_kernels.cpp) reads back. JSON (nlohmann-json):
//   {"format": 1, "kiln_version": "...", "cpu": "<host CPU and LLVM feature string>",
//    "config": {TrainConfig as config_to_json writes it},
//    "programs": {"train": [KERNEL...], "eval": [KERNEL...]}}
//   KERNEL = {"node": FusedKernel node name, "fingerprint": hex of kernel_fingerprint,
//             "fn": index into the binary's function table, "parallel_dim": int,
//             "parallel_extent": int, "work_per_index": int, "split_parts": int,
//             "scratch_bytes": int (codegen::CpuKernel)}
#pragma once
#include <cstdint>
#include <string>

#include "codegen/kernel_ir.h"

namespace kiln::aot {

/// Version of the manifest layout; a binary refuses a manifest of another format.
inline constexpr int kManifestFormat = 1;

/// Symbols of the binary's data object (codegen::emit_aot_data_object).
inline constexpr const char* kManifestSymbol = "kiln_aot_manifest";
inline constexpr const char* kModelSymbol = "kiln_aot_model";
inline constexpr const char* kFunctionTableSymbol = "kiln_aot_fns";

/// 64-bit FNV-1a of a lowered kernel's text (Kernel::to_string: names, shapes, dtypes,
/// expressions and constants), as 16 hex digits. Equal fingerprints mean the kernel the
/// binary would lower now is the one compiled into it.
std::string kernel_fingerprint(const codegen::Kernel& k);

}  // namespace kiln::aot
