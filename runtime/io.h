// File formats kiln reads and writes: NumPy .npy arrays, safetensors weight files and
// nanoGPT-style uint16 token streams. Every reader validates sizes against the file
// and returns an error naming the file instead of crashing on malformed input.
#pragma once
#include <cstdint>
#include <map>
#include <memory>
#include <nlohmann/json_fwd.hpp>
#include <random>
#include <string>
#include <string_view>
#include <vector>

#include "ir/status.h"
#include "ir/tensor.h"

namespace kiln::runtime::io {

// ----------------------------------------------------------------------------- .npy
/// Reads a NumPy .npy file (format versions 1.0, 2.0 and 3.0; the spec of
/// numpy.lib.format). Supported descr: '<f4' '<f8' '<f2' '<i8' '<i4' '|i1' '|u1' '|b1'
/// ('<' may also be '=' or '|' for one-byte types). C order only. Errors (each naming
/// the file): missing/unreadable file, bad magic, unparsable header, fortran_order True,
/// big-endian ('>'), unsupported dtype (e.g. '<u2', object), data shorter than the shape
/// implies (truncated). Trailing bytes after the data are an error too.
Expected<ir::Tensor> load_npy(const std::string& path);

/// The shape of a .npy file, from its header only (the data is not read: binding a model's
/// symbolic dims from the data files costs no load). Errors: those of load_npy's header.
Expected<std::vector<int64_t>> npy_shape(const std::string& path);

/// Writes `t` as a .npy file, format 1.0 (2.0 if the header needs it), little-endian,
/// C order, header padded to a multiple of 64 bytes as numpy does. bf16 has no .npy
/// dtype: error (cast to f32 first). Written to `path.tmp` and renamed over `path`.
Status save_npy(const std::string& path, const ir::Tensor& t);

/// fsync(2) of a file or folder, best effort (errors ignored): used before and after the
/// renames that publish a file or checkpoint, so that a power loss cannot leave a
/// renamed but empty file, or a rotation that deleted the previous good checkpoint.
void sync_to_disk(const std::string& path);

/// Renames the complete file `tmp` over `path`: fsync of `tmp` before the rename and of
/// the folder after it (a power loss cannot leave an empty renamed file or lose the
/// rename). Error naming the reason (errno text); `tmp` is removed then.
Status publish_file(const std::string& tmp, const std::string& path);

/// Writes `bytes` to `path`.tmp (write, fsync and close each checked), then publishes it
/// over `path` (publish_file). Errors name `path` and the reason, e.g. "write failed (No
/// space left on device)"; `path`.tmp is removed then and an existing `path` is untouched.
Status save_bytes(const std::string& path, const std::string& bytes);

/// The bytes of the regular file `path`, read into a buffer sized from the file (a failed
/// allocation throws std::bad_alloc instead of looking like a short file). Errors: a
/// directory, a device, FIFO or socket (which would be read without end or block), an
/// unopenable or short read.
Expected<std::string> read_file(const std::string& path);

// ----------------------------------------------------------------------------- JSON
/// Deepest nesting of JSON arrays and objects that kiln's readers accept (nlohmann's
/// dump and comparisons recurse, so a hostile file nested a million levels deep would
/// overflow the stack in an error message's dump).
inline constexpr int kMaxJsonDepth = 100;

/// "" when `[begin, end)` nests arrays and objects at most `max_depth` deep (strings and
/// escapes skipped), else "JSON nested more than N levels deep". Linear, no recursion.
std::string json_nesting_error(const char* begin, const char* end, int max_depth = kMaxJsonDepth);
inline std::string json_nesting_error(const std::string& text, int max_depth = kMaxJsonDepth) {
  return json_nesting_error(text.data(), text.data() + text.size(), max_depth);
}

/// nlohmann::json::parse of JSON that a user hands kiln (--config files, trainer_state.json,
/// safetensors headers, program meta, metrics.jsonl lines): text nested deeper than
/// kMaxJsonDepth throws std::invalid_argument (json_nesting_error's line), as malformed
/// JSON throws nlohmann's parse_error, so no later dump or walk recurses without bound.
nlohmann::json parse_json_untrusted(std::string_view text);

/// A JSON value for an error message: compact JSON cut to `max_chars` characters
/// (then "..." appended); never recurses deeper than it prints.
std::string json_excerpt(const nlohmann::json& v, size_t max_chars = 60);

// ----------------------------------------------------------------------------- safetensors
/// Writes a safetensors file (huggingface/safetensors format: u64 little-endian header
/// length N, N bytes of JSON {name: {"dtype", "shape", "data_offsets": [begin, end]}},
/// optional "__metadata__" string->string map, header padded with spaces to 8 bytes,
/// then the raw little-endian tensor bytes, packed in name order). Dtypes: F32 F64 BF16
/// F16 I64 I32 I8 U8 BOOL. Written to `path.tmp`, then renamed over `path`.
/// Errors: undefined tensor, empty or "__metadata__" name, I/O failure.
Status save_safetensors(const std::string& path, const std::map<std::string, ir::Tensor>& tensors,
                        const std::map<std::string, std::string>& metadata = {});

/// Reads a safetensors file. Validates: header length within the file (and <= 100 MB),
/// JSON well formed, known dtype, non-negative shape, data_offsets in order, inside the
/// data area, end - begin == numel * dtype size, and that the tensors cover the data
/// area exactly without holes or overlaps (as the reference implementation checks).
/// If `metadata` is given it receives the "__metadata__" map (string values only).
Expected<std::map<std::string, ir::Tensor>> load_safetensors(const std::string& path,
                                                             std::map<std::string, std::string>* metadata = nullptr);

// ----------------------------------------------------------------------------- tokens
/// Reads a whole nanoGPT-style token file: a flat stream of uint16 little-endian tokens
/// (no header). Errors: unreadable file, odd byte count.
Expected<std::vector<uint16_t>> load_tokens(const std::string& path);

/// A token stream held in memory (read fully; files are a few MB to a few hundred MB).
struct TokenFile {
  std::string path;                                     ///< for error messages
  std::shared_ptr<const std::vector<uint16_t>> tokens;  ///< the whole stream
  /// Number of tokens n.
  int64_t size() const { return tokens ? static_cast<int64_t>(tokens->size()) : 0; }
};

/// Opens a token file (load_tokens) and wraps it.
Expected<TokenFile> open_token_file(const std::string& path);

/// A (B, T) batch of token windows: inputs tokens[s : s+T], targets tokens[s+1 : s+T+1],
/// both i64 tensors of shape (B, T); `starts` holds the B window starts s.
struct TokenBatch {
  ir::Tensor inputs;   ///< i64 (B, T)
  ir::Tensor targets;  ///< i64 (B, T), inputs shifted left by one token
  std::vector<int64_t> starts;
};

/// Samples B windows as nanoGPT's get_batch does: for each row, in order, one draw
/// s = rng() % (n - T), i.e. s uniform in [0, n - T - 1] (the modulo is written out
/// instead of std::uniform_int_distribution so that the sequence is the same with every
/// standard library; its bias is below (n - T) / 2^64). Errors: B or T < 1, n < T + 1.
/// The window starts sample_token_batch draws (batch of them, each in [0, n - T - 1]).
Expected<std::vector<int64_t>> sample_token_starts(const TokenFile& f, int64_t batch, int64_t seq,
                                                   std::mt19937_64& rng);
Expected<TokenBatch> sample_token_batch(const TokenFile& f, int64_t batch, int64_t seq, std::mt19937_64& rng);

/// The windows at the given starts (deterministic batches, e.g. consecutive windows
/// s = (i*B + r) * T used by the PyTorch fixtures). Errors: a start with s + T + 1 > n.
Expected<TokenBatch> token_windows(const TokenFile& f, const std::vector<int64_t>& starts, int64_t seq);

}  // namespace kiln::runtime::io
