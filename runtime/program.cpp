// The program file; see program.h.
#include "runtime/program.h"

#include <openssl/evp.h>

#include <algorithm>
#include <cstring>
#include <fstream>
#include <nlohmann/json.hpp>
#include <sstream>
#include <stdexcept>
#include <string_view>

#include "ir/serialize.h"
#include "ir/verifier.h"
#include "runtime/io.h"

namespace kiln::runtime {

namespace {

constexpr char kMagic[8] = {'K', 'I', 'L', 'N', 'P', 'R', 'G', '\0'};
constexpr size_t kHeaderSize = 8 + 4 + 8 + 32;

std::string sha256_raw(std::string_view bytes) {
  unsigned char md[EVP_MAX_MD_SIZE];
  unsigned int len = 0;
  EVP_Digest(bytes.data(), bytes.size(), md, &len, EVP_sha256(), nullptr);
  return std::string(reinterpret_cast<const char*>(md), len);
}

std::string to_hex(const std::string& raw) {
  static const char* d = "0123456789abcdef";
  std::string s;
  for (unsigned char b : raw) {
    s += d[b >> 4];
    s += d[b & 15];
  }
  return s;
}

nlohmann::json spec_json(const DataInputSpec& s) {
  nlohmann::json dims = nlohmann::json::array();
  for (const ir::Dim& d : s.shape.dims)
    dims.push_back(d.is_static() ? nlohmann::json(d.value) : nlohmann::json(d.to_string()));
  return {{"name", s.name}, {"dtype", ir::dtype_name(s.dtype)}, {"dims", dims}};
}

/// `j` as an int64, which it must be (nlohmann's get<int64_t> converts a double such as
/// 1.7e64 by a cast whose result is undefined: found by fuzz/ program under UBSan).
/// Throws std::runtime_error otherwise (the readers turn it into a one-line error).
int64_t json_int(const nlohmann::json& j) {
  if (!j.is_number_integer()) throw std::runtime_error("expected an integer, got " + io::json_excerpt(j));
  if (j.is_number_unsigned() && j.get<uint64_t>() > static_cast<uint64_t>(INT64_MAX))
    throw std::runtime_error("integer " + j.dump() + " is past int64");
  return j.get<int64_t>();
}

Expected<DataInputSpec> spec_from_json(const nlohmann::json& j) {
  DataInputSpec s;
  s.name = j.at("name").get<std::string>();
  KILN_ASSIGN_OR_RETURN(s.dtype, ir::dtype_from_name(j.at("dtype").get<std::string>()));
  for (const auto& d : j.at("dims"))
    s.shape.dims.push_back(d.is_string() ? ir::Dim::from_text(d.get<std::string>()) : ir::Dim(json_int(d)));
  return s;
}

void write_kernels(const codegen::CpuObject& obj, ir::ByteWriter& w) {
  w.u64(obj.kernels.size());
  for (size_t i = 0; i < obj.kernels.size(); ++i) {
    w.str(codegen::encode_cpu_schedule(obj.kernels[i]));
    w.str(i < obj.symbols.size() ? obj.symbols[i] : std::string());
  }
  w.i64(obj.stats.num_kernels);
  w.i64(obj.stats.num_unique);
  w.str(obj.llvm_ir);
  w.str(obj.object);
}

bool read_kernels(ir::ByteReader& r, codegen::CpuObject& obj) {
  uint64_t n;
  if (!r.count(n, 16)) return false;
  for (uint64_t i = 0; i < n; ++i) {
    codegen::CpuKernel k;
    std::string sched, sym;
    if (!r.str(sched) || !r.str(sym) || !codegen::decode_cpu_schedule(sched, k)) return false;
    obj.kernels.push_back(std::move(k));
    obj.symbols.push_back(std::move(sym));
  }
  int64_t nk, nu;
  if (!r.i64(nk) || !r.i64(nu) || !r.str(obj.llvm_ir) || !r.str(obj.object)) return false;
  obj.stats.num_kernels = static_cast<int>(nk);
  obj.stats.num_unique = static_cast<int>(nu);
  return true;
}

}  // namespace

std::string sha256_hex(const std::string& bytes) { return to_hex(sha256_raw(bytes)); }

Expected<std::string> read_file_bytes(const std::string& path) {
  std::ifstream f(path, std::ios::binary);
  if (!f) return Status::error(path + ": cannot read (" + std::strerror(errno) + ")");
  std::ostringstream ss;
  ss << f.rdbuf();
  if (f.bad()) return Status::error(path + ": read error");
  return ss.str();
}

Expected<std::string> serialize_program(const Program& p, ProgramFileInfo& info) {
  if (!p.train_step) return Status::error("program without a training graph (internal)");
  nlohmann::json sig;
  sig["data_inputs"] = p.data_inputs;
  sig["label_input"] = p.label_input;
  sig["logits_output"] = p.logits_output;
  sig["parameters"] = p.parameters;
  nlohmann::json specs = nlohmann::json::array();
  for (const auto& s : p.signature.forward_specs) specs.push_back(spec_json(s));
  sig["forward_specs"] = specs;
  sig["index_extents"] = p.signature.index_extents;
  sig["classes"] = p.signature.classes;
  sig["microbatch_rows"] = p.signature.microbatch_rows;
  sig["gradient_accumulation_steps"] = p.signature.gradient_accumulation_steps;
  sig["rows_per_step"] = p.signature.rows_per_step;
  sig["world_size"] = p.signature.world_size;
  sig["eval_rows"] = p.signature.eval_rows;
  nlohmann::json meta = {
      {"kiln_version", info.kiln_version},
      {"cpu", info.cpu},
      {"config", info.config_json.empty() ? nlohmann::json::object() : nlohmann::json::parse(info.config_json)},
      {"signature", sig},
      {"planned_peak_bytes", p.signature.planned_peak_bytes}};

  ir::GraphWriter gw;
  ir::ByteWriter graphs;
  gw.write(*p.train_step, graphs);
  graphs.u8(p.eval ? 1 : 0);
  if (p.eval) gw.write(*p.eval, graphs);
  ir::ByteWriter w;
  w.str(meta.dump());
  w.str(info.model_bytes);
  gw.write_tensors(w);
  w.data() += graphs.data();
  struct Part {
    const char* which;
    const codegen::CpuProgram* k;
  };
  for (const Part& part : {Part{"train", p.train_kernels.get()}, Part{"eval", p.eval_kernels.get()}}) {
    const bool kernels = part.k && !part.k->by_node.empty();
    if (kernels && !part.k->object)
      return Status::error(std::string(part.which) + " program: kernels without object code (internal)");
    w.u8(kernels ? 1 : 0);
    if (kernels) write_kernels(*part.k->object, w);
  }
  const std::string& payload = w.data();
  const std::string digest = sha256_raw(payload);
  info.format = kProgramFormatVersion;
  info.payload_sha256 = to_hex(digest);
  ir::ByteWriter file;
  file.bytes(kMagic, 8);
  for (int i = 0; i < 4; ++i) file.u8(static_cast<uint8_t>((kProgramFormatVersion >> (8 * i)) & 0xff));
  file.u64(payload.size());
  file.bytes(digest.data(), digest.size());
  file.data() += payload;
  return std::move(file.data());
}

namespace {

/// Checks the header; on success `payload_at` is where the payload starts.
Status check_header(const std::string& bytes, const std::string& origin, ProgramFileInfo& info, size_t& payload_at) {
  if (bytes.size() < 8 || std::memcmp(bytes.data(), kMagic, 8) != 0)
    return Status::error(origin + ": not a kiln program file (no KILNPRG header)");
  if (bytes.size() < kHeaderSize)
    return Status::error(origin + ": truncated program file (" + std::to_string(bytes.size()) +
                         " bytes, no complete header)");
  uint32_t version = 0;
  for (int i = 0; i < 4; ++i) version |= static_cast<uint32_t>(static_cast<uint8_t>(bytes[8 + i])) << (8 * i);
  if (version != kProgramFormatVersion)
    return Status::error(origin + ": program file format " + std::to_string(version) + ", this kiln reads format " +
                         std::to_string(kProgramFormatVersion) + " (compile the model again with this kiln)");
  uint64_t len = 0;
  for (int i = 0; i < 8; ++i) len |= static_cast<uint64_t>(static_cast<uint8_t>(bytes[12 + i])) << (8 * i);
  const uint64_t have = bytes.size() - kHeaderSize;
  if (have < len)
    return Status::error(origin + ": truncated program file (payload " + std::to_string(have) + " of " +
                         std::to_string(len) + " bytes)");
  if (have > len)
    return Status::error(origin + ": corrupt program file (" + std::to_string(have - len) +
                         " bytes after the payload)");
  const std::string digest = sha256_raw(std::string_view(bytes).substr(kHeaderSize));  // no copy of the payload
  if (std::memcmp(digest.data(), bytes.data() + 20, 32) != 0)
    return Status::error(origin + ": corrupt program file (payload SHA-256 mismatch)");
  info.format = version;
  info.payload_sha256 = to_hex(digest);
  payload_at = kHeaderSize;
  return Status::ok();
}

Status read_meta(ir::ByteReader& r, const std::string& origin, ProgramFileInfo& info, nlohmann::json& meta) {
  std::string text;
  if (!r.str(text) || !r.str(info.model_bytes))
    return Status::error(origin + ": malformed program file (meta section)");
  try {
    meta = io::parse_json_untrusted(text);
    info.kiln_version = meta.at("kiln_version").get<std::string>();
    info.cpu = meta.at("cpu").get<std::string>();
    info.config_json = meta.at("config").dump();
  } catch (const std::exception& e) {
    return Status::error(origin + ": malformed program file (meta: " + e.what() + ")");
  }
  return Status::ok();
}

}  // namespace

Expected<ProgramFileInfo> read_program_info(const std::string& bytes, const std::string& origin) {
  ProgramFileInfo info;
  size_t at = 0;
  KILN_RETURN_IF_ERROR(check_header(bytes, origin, info, at));
  ir::ByteReader r(bytes, at);
  nlohmann::json meta;
  KILN_RETURN_IF_ERROR(read_meta(r, origin, info, meta));
  return info;
}

Expected<Program> deserialize_program(const std::string& bytes, const std::string& origin, const KernelBinder& bind,
                                      ProgramFileInfo* info_out) {
  ProgramFileInfo info;
  size_t at = 0;
  KILN_RETURN_IF_ERROR(check_header(bytes, origin, info, at));
  ir::ByteReader r(bytes, at);
  nlohmann::json meta;
  KILN_RETURN_IF_ERROR(read_meta(r, origin, info, meta));
  auto malformed = [&](const std::string& what) {
    return Status::error(origin + ": malformed program file (" + what + ")");
  };
  Program p;
  try {
    const auto& sig = meta.at("signature");
    p.data_inputs = sig.at("data_inputs").get<std::vector<std::string>>();
    p.label_input = sig.at("label_input").get<std::string>();
    p.logits_output = sig.at("logits_output").get<std::string>();
    p.parameters = sig.at("parameters").get<std::vector<std::string>>();
    for (const auto& s : sig.at("forward_specs")) {
      auto spec = spec_from_json(s);
      if (!spec) return malformed("signature: " + spec.message());
      p.signature.forward_specs.push_back(std::move(*spec));
    }
    for (const auto& [name, extent] : sig.at("index_extents").items())
      p.signature.index_extents[name] = json_int(extent);
    p.signature.classes = json_int(sig.at("classes"));
    // Absent from files written before they were recorded (same format version): 0, and
    // the trainer reads the config.
    auto optional_int = [&](const char* key) { return sig.contains(key) ? json_int(sig.at(key)) : int64_t(0); };
    p.signature.microbatch_rows = optional_int("microbatch_rows");
    p.signature.gradient_accumulation_steps = optional_int("gradient_accumulation_steps");
    p.signature.rows_per_step = optional_int("rows_per_step");
    p.signature.world_size = std::max<int64_t>(1, optional_int("world_size"));
    p.signature.eval_rows = optional_int("eval_rows");
    p.signature.planned_peak_bytes = json_int(meta.at("planned_peak_bytes"));
  } catch (const std::exception& e) {
    return malformed(std::string("signature: ") + e.what());
  }
  ir::GraphReader gr;
  if (Status s = gr.read_tensors(r); !s) return malformed(s.message());
  auto train = gr.read(r);
  if (!train) return malformed("train graph: " + train.message());
  p.train_step = std::move(*train);
  uint8_t has_eval;
  if (!r.u8(has_eval)) return malformed("truncated after the train graph");
  if (has_eval) {
    auto eval = gr.read(r);
    if (!eval) return malformed("eval graph: " + eval.message());
    p.eval = std::move(*eval);
  }
  for (const char* which : {"train", "eval"}) {
    const bool train_part = std::string(which) == "train";
    uint8_t has_k;
    if (!r.u8(has_k)) return malformed(std::string("truncated ") + which + " kernels");
    if (has_k) {
      codegen::CpuObject obj;
      if (!read_kernels(r, obj)) return malformed(std::string(which) + " kernel table");
      if (!bind) return Status::error(origin + ": the program has generated kernels and nothing here can load them");
      auto k = bind(which, std::move(obj));
      if (!k) return Status::error(origin + ": " + which + " kernels: " + k.message());
      (train_part ? p.train_kernels : p.eval_kernels) = std::move(*k);
    }
  }
  if (!r.at_end()) return malformed(std::to_string(r.left()) + " unread bytes at the end");
  if (Status s = ir::verify_graph(*p.train_step); !s) return malformed("train graph: " + s.message());
  if (p.eval)
    if (Status s = ir::verify_graph(*p.eval); !s) return malformed("eval graph: " + s.message());
  // The arenas as the arena planning pass wrote them into the graphs.
  auto arena_of = [&](const ir::Graph& g, const char* which) -> Expected<std::shared_ptr<StepArena>> {
    if (g.arena_bytes < 0) return std::shared_ptr<StepArena>();
    Status bad_slot = Status::ok();
    int64_t end = 0;  // where the last placed value ends: the planner's block ends there too
    auto slot = [&](const ir::Value* v) {
      if (!v->arena.placed()) return;
      if (v->arena.bytes > g.arena_bytes || v->arena.offset > g.arena_bytes - v->arena.bytes)
        bad_slot = Status::error(std::string(which) + " arena: value '" + v->name + "' lies outside the block");
      else
        end = std::max(end, v->arena.offset + v->arena.bytes);
    };
    std::function<void(const ir::Graph&)> check = [&](const ir::Graph& gr) {
      for (const ir::Value* in : gr.inputs) slot(in);
      for (const auto& n : gr.nodes()) {
        for (const ir::Value* o : n->outputs) slot(o);
        for (const auto& r : n->regions) check(*r);
      }
    };
    check(g);
    if (!bad_slot) return malformed(bad_slot.message());
    // A block larger than its values (a corrupted size) would only allocate memory nothing uses.
    if (g.arena_bytes > end)
      return malformed(std::string(which) + " arena: the block is " + std::to_string(g.arena_bytes) +
                       " bytes, its values end at " + std::to_string(end));
    return StepArena::of_graph(g);
  };
  {
    auto a = arena_of(*p.train_step, "train");
    if (!a) return malformed(a.message());
    p.train_arena = *a;
    if (p.eval) {
      auto e = arena_of(*p.eval, "eval");
      if (!e) return malformed(e.message());
      p.eval_arena = *e;
    }
  }
  p.loaded_from = origin;
  if (info_out) *info_out = std::move(info);
  return p;
}

Status check_host_cpu(const std::string& feats) {
  std::string missing;
  auto need = [&](const std::string& llvm_name, bool have) {
    const std::string tok = "+" + llvm_name;
    bool listed = false;
    for (size_t at = feats.find(tok); at != std::string::npos; at = feats.find(tok, at + 1)) {
      const size_t end = at + tok.size();
      if (end == feats.size() || feats[end] == ',') listed = true;
    }
    if (listed && !have) missing += (missing.empty() ? "" : ", ") + llvm_name;
  };
#if defined(__x86_64__)
  __builtin_cpu_init();
  need("sse4.2", __builtin_cpu_supports("sse4.2"));
  need("avx", __builtin_cpu_supports("avx"));
  need("avx2", __builtin_cpu_supports("avx2"));
  need("fma", __builtin_cpu_supports("fma"));
  need("avx512f", __builtin_cpu_supports("avx512f"));
  need("avx512bw", __builtin_cpu_supports("avx512bw"));
  need("avx512dq", __builtin_cpu_supports("avx512dq"));
  need("avx512vl", __builtin_cpu_supports("avx512vl"));
  need("avx512bf16", __builtin_cpu_supports("avx512bf16"));
#endif
  if (!missing.empty())
    return Status::error("the program's kernels were compiled for a CPU with " + missing +
                         ", which this CPU lacks; compile the model again on this machine");
  return Status::ok();
}

}  // namespace kiln::runtime
