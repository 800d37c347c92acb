// Trainer checkpoints: atomic directory writes, loading, rotation (see checkpoint.h).
#include "runtime/checkpoint.h"

#include <fcntl.h>
#include <stdio.h>  // renameat2, RENAME_EXCHANGE
#include <sys/file.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <system_error>

#include "runtime/interrupt.h"
#include "runtime/io.h"
#include "runtime/train_config.h"

namespace kiln::runtime {

namespace fs = std::filesystem;

Status prepare_output_dir(const std::string& dir) {
  if (dir.empty()) return Status::error("output_dir: empty path");
  std::error_code ec;
  fs::create_directories(dir, ec);
  if (ec) return Status::error("output_dir '" + dir + "': cannot create directory (" + ec.message() + ")");
  if (!fs::is_directory(dir, ec)) return Status::error("output_dir '" + dir + "': exists and is not a directory");
  fs::path probe = fs::path(dir) / ".kiln_write_test";
  {
    std::ofstream f(probe);
    if (!f || !(f << "ok") || !(f.flush())) return Status::error("output_dir '" + dir + "': is not writable");
  }
  fs::remove(probe, ec);
  return Status::ok();
}

nlohmann::json trainer_state_to_json(const TrainerState& s) {
  nlohmann::json j;
  j["global_step"] = s.global_step;
  j["epoch"] = s.epoch;
  j["total_steps"] = s.total_steps;
  j["data"] = {{"seed", s.seed},
               {"steps_per_epoch", s.steps_per_epoch},
               {"rows_per_step", s.rows_per_step},
               {"epoch", s.steps_per_epoch > 0 ? s.global_step / s.steps_per_epoch : 0},
               {"batch_index", s.steps_per_epoch > 0 ? s.global_step % s.steps_per_epoch : 0}};
  j["log_accumulators"] = {{"loss_sum", s.log_loss_sum},
                           {"loss_count", s.log_loss_count},
                           {"time_sum", s.log_time_sum},
                           {"total_loss_sum", s.total_loss_sum}};
  nlohmann::json cfg = nlohmann::json::object();
  if (!s.config_json.empty()) {
    try {
      cfg = nlohmann::json::parse(s.config_json);
    } catch (const std::exception&) {
    }
  }
  j["config"] = cfg;
  return j;
}

Expected<TrainerState> trainer_state_from_json(const nlohmann::json& j, const std::string& origin) {
  TrainerState s;
  auto bad = [&](const std::string& key, const std::string& want) {
    return Status::error(origin + ": malformed trainer state: '" + key + "' must be " + want);
  };
  if (!j.is_object()) return Status::error(origin + ": malformed trainer state: not a JSON object");
  // A count: a JSON integer in [0, 2^62] (no fraction, no float spelling such as 1e30).
  auto count = [&](const nlohmann::json& obj, const std::string& path, const char* key, bool required,
                   int64_t& out) -> Status {
    if (!obj.contains(key)) return required ? bad(path + key, "present") : Status::ok();
    const auto& v = obj[key];
    if (!v.is_number_integer() || (v.is_number_unsigned() && v.get<uint64_t>() > (uint64_t{1} << 62)) ||
        (!v.is_number_unsigned() && v.get<int64_t>() < 0))
      return bad(path + key, "a non-negative integer, got " + io::json_excerpt(v));
    out = v.get<int64_t>();
    return Status::ok();
  };
  auto number = [&](const nlohmann::json& obj, const std::string& path, const char* key, double& out) -> Status {
    if (!obj.contains(key)) return Status::ok();
    if (!obj[key].is_number()) return bad(path + key, "a number, got " + io::json_excerpt(obj[key]));
    out = obj[key].get<double>();
    return Status::ok();
  };
  KILN_RETURN_IF_ERROR(count(j, "", "global_step", true, s.global_step));
  if (!j.contains("epoch") || !j["epoch"].is_number()) return bad("epoch", "a number");
  s.epoch = j["epoch"].get<double>();
  KILN_RETURN_IF_ERROR(count(j, "", "total_steps", false, s.total_steps));
  if (s.total_steps > 0 && s.global_step > s.total_steps)
    return bad("global_step",
               "at most total_steps " + std::to_string(s.total_steps) + ", got " + std::to_string(s.global_step));
  if (!j.contains("data") || !j["data"].is_object()) return bad("data", "an object");
  const auto& d = j["data"];
  if (!d.contains("seed") || !d["seed"].is_number_unsigned()) return bad("data.seed", "a non-negative integer");
  s.seed = d["seed"].get<uint64_t>();
  KILN_RETURN_IF_ERROR(count(d, "data.", "steps_per_epoch", true, s.steps_per_epoch));
  KILN_RETURN_IF_ERROR(count(d, "data.", "rows_per_step", true, s.rows_per_step));
  // The data position (written from global_step; a resume recomputes it): must agree.
  if (s.steps_per_epoch > 0) {
    int64_t data_epoch = s.global_step / s.steps_per_epoch, batch_index = s.global_step % s.steps_per_epoch;
    KILN_RETURN_IF_ERROR(count(d, "data.", "epoch", false, data_epoch));
    KILN_RETURN_IF_ERROR(count(d, "data.", "batch_index", false, batch_index));
    if (batch_index >= s.steps_per_epoch)
      return bad("data.batch_index", "less than data.steps_per_epoch " + std::to_string(s.steps_per_epoch) + ", got " +
                                         std::to_string(batch_index));
    if (data_epoch != s.global_step / s.steps_per_epoch || batch_index != s.global_step % s.steps_per_epoch)
      return Status::error(origin + ": malformed trainer state: data position epoch " + std::to_string(data_epoch) +
                           ", batch " + std::to_string(batch_index) + " is not global_step " +
                           std::to_string(s.global_step) + " at " + std::to_string(s.steps_per_epoch) +
                           " steps per epoch");
  }
  if (j.contains("log_accumulators")) {
    const auto& a = j["log_accumulators"];
    if (!a.is_object()) return bad("log_accumulators", "an object");
    KILN_RETURN_IF_ERROR(number(a, "log_accumulators.", "loss_sum", s.log_loss_sum));
    KILN_RETURN_IF_ERROR(count(a, "log_accumulators.", "loss_count", false, s.log_loss_count));
    KILN_RETURN_IF_ERROR(number(a, "log_accumulators.", "time_sum", s.log_time_sum));
    KILN_RETURN_IF_ERROR(number(a, "log_accumulators.", "total_loss_sum", s.total_loss_sum));
  }
  // The run's flags (config_to_json): a resume compares them with its own.
  if (j.contains("config")) {
    const auto& cfg = j["config"];
    if (!cfg.is_object()) return bad("config", "an object of flag values");
    // Each known flag's value of the type config_to_json writes (a string "7" for --seed
    // would be compared with the number 7 and warned about as a change).
    using Kind = ConfigField::Kind;
    TrainConfig probe;
    for (const ConfigField& f : config_fields(probe)) {
      if (!cfg.contains(f.name)) continue;
      const auto& v = cfg[f.name];
      bool list_ok = v.is_array();
      if (list_ok)
        for (const auto& e : v) list_ok = list_ok && e.is_string();
      const std::pair<bool, const char*> check =
          f.kind == Kind::str        ? std::make_pair(v.is_string(), "a string")
          : f.kind == Kind::str_list ? std::make_pair(list_ok, "a list of strings")
          : f.kind == Kind::i64      ? std::make_pair(v.is_number_integer(), "an integer")
          : f.kind == Kind::u64      ? std::make_pair(v.is_number_unsigned(), "a non-negative integer")
          : f.kind == Kind::f64      ? std::make_pair(v.is_number(), "a number")
          : f.kind == Kind::boolean  ? std::make_pair(v.is_boolean(), "true or false")
                                     : std::make_pair(v.is_object(), "an object");
      if (!check.first) return bad("config." + f.name, std::string(check.second) + ", got " + io::json_excerpt(v));
    }
    s.config_json = cfg.dump();
  }
  return s;
}

namespace {
// The files of a checkpoint, written into the folder `tmp` (each fsynced; the folder too).
Status write_checkpoint_files(const fs::path& tmp, const Checkpoint& ckpt) {
  KILN_RETURN_IF_ERROR(io::save_safetensors((tmp / "model.safetensors").string(), ckpt.model));
  KILN_RETURN_IF_ERROR(io::save_safetensors((tmp / "optimizer.safetensors").string(), ckpt.optimizer));
  KILN_RETURN_IF_ERROR(
      io::save_bytes((tmp / "trainer_state.json").string(), trainer_state_to_json(ckpt.state).dump(2) + "\n"));
  std::error_code ec;
  if (!ckpt.log_history.empty() && fs::is_regular_file(ckpt.log_history, ec)) {
    KILN_ASSIGN_OR_RETURN(std::string log, io::read_file(ckpt.log_history));
    KILN_RETURN_IF_ERROR(io::save_bytes((tmp / "metrics.jsonl").string(), log));
  }
  io::sync_to_disk(tmp.string());
  return Status::ok();
}
}  // namespace

Status save_checkpoint(const std::string& dir, const Checkpoint& ckpt) {
  std::error_code ec;
  fs::path final_dir(dir);
  while (final_dir.has_parent_path() && final_dir.filename().empty()) final_dir = final_dir.parent_path();
  fs::path tmp = final_dir;
  tmp += ".tmp";
  fs::remove_all(tmp, ec);  // leftover of a crashed save
  fs::create_directories(tmp, ec);
  if (ec) return Status::error("checkpoint '" + tmp.string() + "': cannot create directory (" + ec.message() + ")");
  if (Status s = write_checkpoint_files(tmp, ckpt); !s) {
    // A full disk, a file-size limit, an I/O error: the half-written folder goes, the
    // checkpoints already saved stay as they are.
    fs::remove_all(tmp, ec);
    return Status::error("checkpoint '" + final_dir.string() + "' not saved: " + s.message() +
                         "; the previous checkpoints are kept");
  }
  fault_point("checkpoint");  // complete, not yet renamed (tests)
  // Replace an existing checkpoint only once the new one is complete.
  fs::path old = final_dir;
  old += ".old";
  bool had_old = fs::exists(final_dir, ec);
  if (had_old && !fs::is_directory(final_dir, ec)) {
    fs::remove_all(tmp, ec);
    return Status::error("checkpoint '" + final_dir.string() +
                         "': a file of that name is in the way (not a checkpoint directory); move it away");
  }
  if (had_old && ::renameat2(AT_FDCWD, tmp.c_str(), AT_FDCWD, final_dir.c_str(), RENAME_EXCHANGE) == 0) {
    // Swapped in one step: a kill now leaves the new checkpoint-N and the old one as
    // checkpoint-N.tmp, which the next run removes.
    fs::remove_all(tmp, ec);
  } else {
    // A file system without RENAME_EXCHANGE (or nothing to replace): move the old one
    // aside first.
    if (had_old) {
      fs::remove_all(old, ec);
      fs::rename(final_dir, old, ec);
      if (ec)
        return Status::error("checkpoint '" + final_dir.string() + "': cannot move the previous one aside (" +
                             ec.message() + ")");
    }
    fs::rename(tmp, final_dir, ec);
    if (ec) {
      if (had_old) fs::rename(old, final_dir, ec);
      return Status::error("checkpoint '" + final_dir.string() + "': rename from .tmp failed (" + ec.message() + ")");
    }
    if (had_old) fs::remove_all(old, ec);
  }
  io::sync_to_disk(final_dir.parent_path().empty() ? std::string(".") : final_dir.parent_path().string());
  return Status::ok();
}

Expected<Checkpoint> load_checkpoint(const std::string& dir) {
  std::error_code ec;
  if (!fs::is_directory(dir, ec)) return Status::error("checkpoint '" + dir + "': not a directory");
  Checkpoint c;
  for (const char* f : {"model.safetensors", "optimizer.safetensors", "trainer_state.json"})
    if (!fs::exists(fs::path(dir) / f, ec)) {
      // An output folder instead of one of its checkpoints is the likely mix-up.
      const bool holds_checkpoints = !list_checkpoints(dir).empty();
      return Status::error("checkpoint '" + dir + "': not a checkpoint folder (no " + f + ")" +
                           (holds_checkpoints ? "; it holds checkpoint-N folders: give one of them, or 'latest' with "
                                                "--output_dir " +
                                                    dir
                                              : "; checkpoints are the checkpoint-N folders that --save_steps writes "
                                                "in --output_dir ('latest' picks the newest)"));
    }
  KILN_ASSIGN_OR_RETURN(c.model, io::load_safetensors((fs::path(dir) / "model.safetensors").string()));
  KILN_ASSIGN_OR_RETURN(c.optimizer, io::load_safetensors((fs::path(dir) / "optimizer.safetensors").string()));
  std::string sp = (fs::path(dir) / "trainer_state.json").string();
  KILN_ASSIGN_OR_RETURN(std::string text, io::read_file(sp));
  if (std::string deep = io::json_nesting_error(text); !deep.empty()) return Status::error(sp + ": " + deep);
  nlohmann::json j;
  try {
    j = io::parse_json_untrusted(text);
  } catch (const std::exception& e) {
    return Status::error(sp + ": invalid JSON");
  }
  KILN_ASSIGN_OR_RETURN(c.state, trainer_state_from_json(j, sp));
  return c;
}

int64_t checkpoint_step(const std::string& name, const std::string& suffix) {
  const size_t digits = name.size() - std::min(name.size(), 11 + suffix.size());
  if (name.rfind("checkpoint-", 0) != 0 || digits == 0 || digits > 18 ||
      name.compare(name.size() - suffix.size(), suffix.size(), suffix) != 0)
    return -1;
  const std::string num = name.substr(11, digits);
  if (num.find_first_not_of("0123456789") != std::string::npos) return -1;
  return std::stoll(num);  // 18 digits always fit in int64
}

std::vector<std::pair<int64_t, std::string>> list_checkpoints(const std::string& output_dir) {
  std::vector<std::pair<int64_t, std::string>> r;
  std::error_code ec;
  for (auto it = fs::directory_iterator(output_dir, ec); !ec && it != fs::directory_iterator(); it.increment(ec)) {
    const int64_t step = checkpoint_step(it->path().filename().string());
    if (step >= 0 && it->is_directory()) r.emplace_back(step, it->path().string());
  }
  std::sort(r.begin(), r.end());
  return r;
}

std::vector<std::string> remove_interrupted_saves(const std::string& output_dir) {
  std::vector<std::string> notes;
  std::error_code ec;
  std::vector<fs::path> found;
  for (auto it = fs::directory_iterator(output_dir, ec); !ec && it != fs::directory_iterator(); it.increment(ec)) {
    if (checkpoint_step(it->path().filename().string(), ".tmp") >= 0 && it->is_directory(ec))
      found.push_back(it->path());
  }
  std::sort(found.begin(), found.end());
  for (const fs::path& p : found) {
    fs::remove_all(p, ec);
    notes.push_back("removed " + p.string() + " (a save or a deletion that was interrupted)");
  }
  return notes;
}

Expected<std::unique_ptr<OutputDirLock>> OutputDirLock::acquire(const std::string& output_dir) {
  const std::string path = (fs::path(output_dir) / ".kiln.lock").string();
  // Read-only suffices for flock; 0666 less the umask, as the other files kiln writes
  // (a group sharing the folder can take the lock in turn).
  const int fd = ::open(path.c_str(), O_CREAT | O_RDONLY | O_CLOEXEC, 0666);
  if (fd < 0) return Status::error(path + ": cannot open the output_dir lock (" + std::strerror(errno) + ")");
  if (::flock(fd, LOCK_EX | LOCK_NB) != 0) {
    const int err = errno;
    ::close(fd);
    if (err == EWOULDBLOCK)
      return Status::error("--output_dir " + output_dir +
                           " is in use by another kiln training run (it holds .kiln.lock); wait for it or choose "
                           "another --output_dir");
    return Status::error(path + ": cannot lock the output_dir (" + std::strerror(err) +
                         "; a file system without locks?)");
  }
  return std::unique_ptr<OutputDirLock>(new OutputDirLock(fd));
}

OutputDirLock::~OutputDirLock() {
  if (fd_ >= 0) ::close(fd_);  // releases the flock
}

Status rotate_checkpoints(const std::string& output_dir, int64_t limit) {
  if (limit <= 0) return Status::ok();
  auto all = list_checkpoints(output_dir);
  std::error_code ec;
  for (size_t i = 0; i + static_cast<size_t>(limit) < all.size(); ++i) {
    // Renamed out of the checkpoints first: a kill during the deletion leaves
    // checkpoint-N.tmp (removed by the next run that saves), never a checkpoint-N with
    // some of its files gone.
    const std::string gone = all[i].second + ".tmp";
    fs::remove_all(gone, ec);
    fs::rename(all[i].second, gone, ec);
    if (ec) return Status::error("checkpoint '" + all[i].second + "': cannot delete (" + ec.message() + ")");
    fs::remove_all(gone, ec);
    if (ec) return Status::error("checkpoint '" + gone + "': cannot delete (" + ec.message() + ")");
  }
  return Status::ok();
}

}  // namespace kiln::runtime
