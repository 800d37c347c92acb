// Variable-length token datasets (issue 31): Megatron-LM's indexed dataset (.idx + .bin)
// and JSON Lines of pre-tokenized rows, read into one in-memory SequenceSet.
//
// The readers are neutral about what the trainer accepts: a sequence of length 0 is read
// as such, lengths are not compared with any --max_length and ids not with a vocabulary
// (the trainer decides and names the row with SequenceSet::row_name). Every error is one
// line naming the file and the sequence or line at fault, and every size is checked
// against the bytes present before anything is allocated (the readers are fuzzed:
// tools/fuzz.sh sequences).
#pragma once
#include <cstdint>
#include <map>
#include <span>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "ir/status.h"

namespace kiln::runtime {

/// Variable-length token sequences: n rows, row i = tokens[offsets[i], offsets[i+1]).
struct SequenceSet {
  std::string file;                 ///< what it was read from (messages): the .jsonl, or the .idx of an indexed set
  std::vector<int64_t> offsets{0};  ///< n+1 entries, offsets[0] == 0, non-decreasing, back() == tokens.size()
  std::vector<int32_t> tokens;      ///< token ids (>= 0)
  std::vector<int32_t> labels;      ///< empty, or one per token (a JSONL "labels" list; -100 = ignored)
  std::vector<int64_t> lines;       ///< JSONL: the 1-based line of each row (blank lines are skipped); else empty

  /// Number of rows n (0 for a default-constructed set).
  int64_t size() const { return offsets.empty() ? 0 : static_cast<int64_t>(offsets.size()) - 1; }
  /// Tokens of row i (0 <= i < size(), unchecked).
  int64_t length(int64_t i) const { return offsets[i + 1] - offsets[i]; }
  /// The longest row's length (0 when there are no rows).
  int64_t max_length() const;
  /// length -> number of rows of that length (the input of the bucket planner).
  std::map<int64_t, int64_t> length_histogram() const;
  /// The tokens of row i (unchecked index).
  std::span<const int32_t> row(int64_t i) const {
    return std::span<const int32_t>(tokens.data() + offsets[i], static_cast<size_t>(length(i)));
  }
  /// The labels of row i, or an empty span when the set has no labels.
  std::span<const int32_t> row_labels(int64_t i) const {
    if (labels.empty()) return {};
    return std::span<const int32_t>(labels.data() + offsets[i], static_cast<size_t>(length(i)));
  }
  /// How a message names row i: "line 12" for JSONL (the file's line), else "sequence 7"
  /// (0-based, as Megatron indexes them). E.g. file + ": " + row_name(i) + ": ...".
  std::string row_name(int64_t i) const;
};

/// Checks a SequenceSet's invariants: offsets as documented (n+1 entries from 0,
/// non-decreasing, ending at tokens.size()), every token >= 0, labels empty or one per
/// token with each label >= 0 or -100, lines empty or one per row. Error: one line
/// naming s.file and the first row at fault. Used by the writers; the readers' output
/// always passes.
Status check_sequence_set(const SequenceSet& s);

// ----------------------------------------------------------------------------- indexed
/// The Megatron-LM indexed dataset ("MMIDIDX", megatron/core/datasets/indexed_dataset.py;
/// the same files as GPT-NeoX and nanotron's Megatron-format datasets). PREFIX.idx, all
/// little-endian:
///   9 bytes "MMIDIDX\0\0", u64 version (1), u8 dtype code (1 uint8, 2 int8, 3 int16,
///   4 int32, 5 int64, 6 float64, 7 float32, 8 uint16), u64 sequence_count S, u64
///   document_count D, int32 sequence_lengths[S] (tokens), int64 sequence_pointers[S]
///   (byte offsets into PREFIX.bin), int64 document_indices[D] (sequence indices that
///   delimit documents: 0, then the end of each document), and in multimodal indexes
///   int8 sequence_modes[S] (accepted and ignored).
/// PREFIX.bin: the tokens of each sequence in the dtype, at its pointer.
/// Rows are the sequences (documents do not group them). Errors (one line each, naming
/// PREFIX.idx or PREFIX.bin and the sequence): no MMIDIDX magic, header shorter than 34
/// bytes, version other than 1, unknown or float dtype code, sequence or document counts
/// that need more bytes than the .idx has, other trailing bytes, no sequences, a negative
/// length or pointer, a sequence ending beyond the .bin ("PREFIX.idx: sequence 7 ends at
/// byte 1234 beyond the .bin's 1200 bytes"), sequences holding more bytes together than
/// the .bin (overlaps), document indices decreasing or outside [0, S], a negative token
/// id, an id above int32's range.
/// `prefix` names the files in messages ("PREFIX.idx", "PREFIX.bin"); the result's file
/// is PREFIX.idx.
Expected<SequenceSet> parse_indexed_dataset(std::string_view idx_bytes, std::string_view bin_bytes,
                                            const std::string& prefix);

/// Reads an indexed dataset from disk: `path` may be the prefix, PREFIX.bin or PREFIX.idx
/// (both files are read whole). Errors: those of io::read_file for either file, then
/// those of parse_indexed_dataset.
Expected<SequenceSet> read_indexed_dataset(const std::string& path);

/// The bytes of PREFIX.idx and PREFIX.bin for `s` (first .idx, second .bin), as Megatron's
/// IndexedDatasetBuilder writes them: the dtype chosen by the largest id (uint16 when it
/// is below 65500, Megatron's DType.optimal_dtype bound, else int32), pointers contiguous
/// in row order, each row its own document (document_indices 0, 1, ..., n). Errors: `s`
/// failing check_sequence_set, labels (the format has none).
Expected<std::pair<std::string, std::string>> encode_indexed_dataset(const SequenceSet& s);

/// Writes PREFIX.bin and PREFIX.idx (encode_indexed_dataset; each file written to a .tmp
/// and renamed into place, .bin first). Errors: those of the encoding, or I/O naming the file.
Status write_indexed_dataset(const SequenceSet& s, const std::string& prefix);

// ----------------------------------------------------------------------------- JSONL
/// JSON Lines (jsonlines.org: UTF-8, one JSON value per '\n'-terminated line, "\r\n"
/// accepted), one object per line with "input_ids": [int, ...] and optionally "labels":
/// [int, ...] of the same length (pre-tokenized SFT data as Hugging Face datasets write
/// it; -100 in labels is the ignore index). Other keys (e.g. "attention_mask", "text")
/// are ignored. Blank lines are skipped; rows keep their 1-based line in `lines`.
/// Errors (one line each, "ORIGIN: line 12: ..."): invalid JSON (or nested more than
/// io::kMaxJsonDepth), not an object, no 'input_ids', 'input_ids' or 'labels' not a
/// list of integers, a negative id, an id or label above int32's range, a negative label
/// other than -100, "'labels' has 5 entries, 'input_ids' 6", labels on some lines but
/// not on others, and "ORIGIN: no sequences" for a file without rows.
Expected<SequenceSet> parse_jsonl_dataset(std::string_view text, const std::string& origin);

/// Reads a JSONL dataset from disk (io::read_file, then parse_jsonl_dataset).
Expected<SequenceSet> read_jsonl_dataset(const std::string& path);

/// The JSONL text of `s`: one line {"input_ids":[...]} per row, with "labels" when `s`
/// has them. Errors: `s` failing check_sequence_set.
Expected<std::string> encode_jsonl_dataset(const SequenceSet& s);

/// Writes `s` as JSON Lines to `path` (written to path.tmp and renamed into place).
Status write_jsonl_dataset(const SequenceSet& s, const std::string& path);

// ----------------------------------------------------------------------------- dispatch
/// Whether a --train_data path (without a NAME= prefix) names a variable-length dataset:
/// it ends with .jsonl or .idx, or with .bin and a file PREFIX.idx exists beside it (a
/// .bin without .idx stays a nanoGPT token file). Only the .bin case touches the disk.
bool is_sequence_dataset(const std::string& spec);

/// Reads a variable-length dataset, dispatching on the extension: .jsonl to
/// read_jsonl_dataset, .idx or .bin to read_indexed_dataset; any other path is read as an
/// indexed prefix when PREFIX.idx exists. Error otherwise: one line naming the path and
/// the formats.
Expected<SequenceSet> read_sequence_dataset(const std::string& path);

}  // namespace kiln::runtime
