// The fuzz harness: each of kiln's readers driven by one byte string (issue 36).
//
// Shared by the libFuzzer targets (fuzz/fuzz_main.cpp, built with clang by
// tools/fuzz.sh into build-fuzz/) and the regression test that replays the inputs
// the fuzzers found (tests/runtime/fuzz_regressions_test.cpp, in the normal build):
// both call run_target(), so a regression input goes through the same reader.
#pragma once
#include <string>
#include <vector>

#include "ir/status.h"

namespace kiln::fuzz {

/// The target names: onnx, npy, safetensors, trainer_state, config, tokens, program,
/// sequences.
const std::vector<std::string>& target_names();

/// Runs `bytes` through the reader of `target`:
/// - onnx: ONNX model bytes written as model.onnx into a scratch folder next to an
///   external-data file good_external.bin (4096 bytes), imported with
///   frontend::import_onnx (checker, shape inference, lowering into kiln's IR), then
///   ir::verify_graph.
/// - npy: a .npy file through io::load_npy.
/// - safetensors: a .safetensors file through io::load_safetensors (with metadata).
/// - trainer_state: trainer_state.json of a checkpoint folder whose model and optimizer
///   files are valid, through runtime::load_checkpoint.
/// - config: --config JSON text through config_from_json_text; a config that loads must
///   also load again from its config_to_json (aborts otherwise: a finding).
/// - tokens: a nanoGPT token file through io::open_token_file, then a sampled batch and
///   fixed windows.
/// - program: the payload of a kiln program file: wrapped in a valid header (magic,
///   format, length, SHA-256, so that mutations get past the checksum) and loaded with
///   runtime::deserialize_program (kernel tables are parsed; a binder stands in for the
///   JIT, whose object code kiln trusts like an executable), then read_program_info of
///   the raw bytes.
/// - sequences: a variable-length dataset parsed from memory (runtime/sequences.h). Input
///   "I" + u16 little-endian n + rest: an indexed dataset whose .idx is the first n bytes
///   of rest (all of it when shorter) and whose .bin is the remainder
///   (parse_indexed_dataset); any other input is JSONL text (parse_jsonl_dataset), so a
///   .jsonl file is a seed as it is. What parses must pass check_sequence_set and read
///   back the same rows from its own encoding (aborts otherwise: a finding).
/// Returns the reader's status (an error for malformed input). Unknown target: error.
Status run_target(const std::string& target, const std::string& bytes);

/// The program-file header that `program` puts before its payload.
std::string wrap_program_payload(const std::string& payload);

/// The input of the `sequences` target that holds the indexed dataset (idx, bin).
std::string wrap_indexed_dataset(const std::string& idx, const std::string& bin);

}  // namespace kiln::fuzz
