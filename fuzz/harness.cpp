// The fuzz harness (see harness.h).
#include "fuzz/harness.h"

#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <map>
#include <memory>
#include <random>

#include "frontend/onnx_import.h"
#include "ir/verifier.h"
#include "runtime/checkpoint.h"
#include "runtime/io.h"
#include "runtime/program.h"
#include "runtime/sequences.h"
#include "runtime/train_config.h"

namespace kiln::fuzz {
namespace fs = std::filesystem;

namespace {

/// A folder of this process for the files the readers open, removed at exit:
/// /dev/shm when there is one (no disk writes per input), else the temp folder.
class Scratch {
 public:
  Scratch() {
    std::error_code ec;
    fs::path base = fs::is_directory("/dev/shm", ec) ? fs::path("/dev/shm") : fs::temp_directory_path(ec);
    dir_ = base / ("kiln-fuzz-" + std::to_string(getpid()));
    fs::create_directories(dir_ / "checkpoint", ec);
    // External data next to the model: 4096 bytes of a fixed pattern, under the name the
    // fixtures' good_external.onnx uses (tests/data/bad_models).
    std::string ext(4096, '\0');
    for (size_t i = 0; i < ext.size(); ++i) ext[i] = static_cast<char>((i * 37 + 11) & 0xff);
    write("good_external.bin", ext);
    // A checkpoint folder whose safetensors files are valid: only trainer_state.json varies.
    ir::Tensor w(ir::DType::f32, {2, 2});
    ir::Tensor step(ir::DType::i64, {});
    runtime::io::save_safetensors((dir_ / "checkpoint" / "model.safetensors").string(), {{"w", w}});
    runtime::io::save_safetensors((dir_ / "checkpoint" / "optimizer.safetensors").string(),
                                  {{"w.exp_avg", w}, {"step", step}});
  }
  ~Scratch() {
    std::error_code ec;
    fs::remove_all(dir_, ec);
  }
  /// Writes `bytes` as the file `name` of the scratch folder and returns its path.
  std::string write(const std::string& name, const std::string& bytes) {
    const fs::path p = dir_ / name;
    std::ofstream out(p, std::ios::binary | std::ios::trunc);
    out.write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
    out.close();
    if (!out) {
      std::fprintf(stderr, "kiln fuzz: cannot write %s\n", p.c_str());
      std::abort();
    }
    return p.string();
  }
  std::string path(const std::string& name) const { return (dir_ / name).string(); }

 private:
  fs::path dir_;
};

Scratch& scratch() {
  static Scratch s;
  return s;
}

Status onnx_target(const std::string& bytes) {
  const std::string path = scratch().write("model.onnx", bytes);
  frontend::ImportOptions opts;
  opts.bind_dims = {{"batch", 2}, {"seq", 4}};
  auto g = frontend::import_onnx(path, opts);
  if (!g) return g.status();
  return ir::verify_graph(**g);
}

Status npy_target(const std::string& bytes) {
  auto t = runtime::io::load_npy(scratch().write("input.npy", bytes));
  return t ? Status::ok() : t.status();
}

Status safetensors_target(const std::string& bytes) {
  std::map<std::string, std::string> meta;
  auto t = runtime::io::load_safetensors(scratch().write("input.safetensors", bytes), &meta);
  return t ? Status::ok() : t.status();
}

Status trainer_state_target(const std::string& bytes) {
  scratch().write("checkpoint/trainer_state.json", bytes);
  auto c = runtime::load_checkpoint(scratch().path("checkpoint"));
  return c ? Status::ok() : c.status();
}

Status config_target(const std::string& bytes) {
  runtime::TrainConfig cfg;
  Status s = runtime::load_config_json(scratch().write("config.json", bytes), cfg);
  if (!s) return s;
  // What loaded must load again from its own JSON (as trainer_state.json stores it).
  runtime::TrainConfig again;
  if (Status r = runtime::config_from_json_text(runtime::config_to_json(cfg), "config_to_json", again); !r) {
    std::fprintf(stderr, "kiln fuzz: a loaded config does not load from its config_to_json: %s\n", r.message().c_str());
    std::abort();
  }
  return runtime::check_eval_schedule(cfg);
}

Status tokens_target(const std::string& bytes) {
  auto f = runtime::io::open_token_file(scratch().write("tokens.bin", bytes));
  if (!f) return f.status();
  std::mt19937_64 rng(1);
  auto b = runtime::io::sample_token_batch(*f, 2, 4, rng);
  if (!b) return b.status();
  auto w = runtime::io::token_windows(*f, {0, f->size() - 5}, 4);
  return w ? Status::ok() : w.status();
}

Status program_target(const std::string& payload) {
  const std::string file = wrap_program_payload(payload);
  // Kernel tables are parsed; their object code is not linked (kiln trusts it as it trusts
  // its own executable), an empty kernel set stands in.
  runtime::KernelBinder bind = [](const std::string&,
                                  codegen::CpuObject) -> Expected<std::shared_ptr<codegen::CpuProgram>> {
    return std::make_shared<codegen::CpuProgram>();
  };
  runtime::ProgramFileInfo info;
  auto p = runtime::deserialize_program(file, "fuzz.kiln", bind, &info);
  auto raw = runtime::read_program_info(payload, "fuzz-raw.kiln");  // the header checks on raw bytes
  if (!p) return p.status();
  return Status::ok();
}

[[noreturn]] void sequences_finding(const std::string& what) {
  std::fprintf(stderr, "kiln fuzz: sequences: %s\n", what.c_str());
  std::abort();
}

Status sequences_target(const std::string& bytes) {
  const bool indexed = bytes.size() >= 3 && bytes[0] == 'I';
  Expected<runtime::SequenceSet> s = Status::error("unset");
  if (indexed) {
    const size_t n =
        static_cast<unsigned char>(bytes[1]) | (static_cast<size_t>(static_cast<unsigned char>(bytes[2])) << 8);
    const std::string_view rest = std::string_view(bytes).substr(3);
    s = runtime::parse_indexed_dataset(rest.substr(0, n), rest.substr(std::min(n, rest.size())), "fuzz");
  } else {
    s = runtime::parse_jsonl_dataset(bytes, "fuzz.jsonl");
  }
  if (!s) return s.status();
  if (Status c = runtime::check_sequence_set(*s); !c) sequences_finding("a parsed set fails its check: " + c.message());
  int64_t rows = 0;
  for (const auto& [len, count] : s->length_histogram()) rows += count;
  if (rows != s->size() || s->max_length() != (s->size() ? s->length_histogram().rbegin()->first : 0))
    sequences_finding("length_histogram or max_length disagrees with the rows");
  // What was read reads back the same from kiln's own encoding.
  Expected<runtime::SequenceSet> back = Status::error("unset");
  if (indexed) {
    auto enc = runtime::encode_indexed_dataset(*s);
    if (!enc) sequences_finding("cannot encode what was read: " + enc.message());
    back = runtime::parse_indexed_dataset(enc->first, enc->second, "fuzz-again");
  } else {
    auto enc = runtime::encode_jsonl_dataset(*s);
    if (!enc) sequences_finding("cannot encode what was read: " + enc.message());
    back = runtime::parse_jsonl_dataset(*enc, "fuzz-again.jsonl");
  }
  if (!back) sequences_finding("its own encoding does not read back: " + back.message());
  if (back->offsets != s->offsets || back->tokens != s->tokens || back->labels != s->labels)
    sequences_finding("its own encoding reads back different rows");
  return Status::ok();
}

}  // namespace

const std::vector<std::string>& target_names() {
  static const std::vector<std::string> names = {"onnx",   "npy",    "safetensors", "trainer_state",
                                                 "config", "tokens", "program",     "sequences"};
  return names;
}

std::string wrap_program_payload(const std::string& payload) {
  std::string file("KILNPRG\0", 8);
  for (int i = 0; i < 4; ++i) file += static_cast<char>((runtime::kProgramFormatVersion >> (8 * i)) & 0xff);
  const uint64_t n = payload.size();
  for (int i = 0; i < 8; ++i) file += static_cast<char>((n >> (8 * i)) & 0xff);
  const std::string hex = runtime::sha256_hex(payload);
  for (size_t i = 0; i + 1 < hex.size(); i += 2) file += static_cast<char>(std::stoi(hex.substr(i, 2), nullptr, 16));
  return file + payload;
}

std::string wrap_indexed_dataset(const std::string& idx, const std::string& bin) {
  const size_t n = idx.size();
  std::string out = "I";
  out += static_cast<char>(n & 0xff);
  out += static_cast<char>((n >> 8) & 0xff);
  return out + idx + bin;
}

Status run_target(const std::string& target, const std::string& bytes) {
  if (target == "onnx") return onnx_target(bytes);
  if (target == "npy") return npy_target(bytes);
  if (target == "safetensors") return safetensors_target(bytes);
  if (target == "trainer_state") return trainer_state_target(bytes);
  if (target == "config") return config_target(bytes);
  if (target == "tokens") return tokens_target(bytes);
  if (target == "program") return program_target(bytes);
  if (target == "sequences") return sequences_target(bytes);
  return Status::error("unknown fuzz target '" + target + "'");
}

}  // namespace kiln::fuzz
