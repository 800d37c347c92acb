#include <cctype>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <iostream>

#include "ir/printer.h"
#include "ir/verifier.h"
#include "passes/pass.h"

namespace kiln::passes {

const char* mode_name(Mode m) { return m == Mode::train ? "train" : "eval"; }

std::string format_option(double v) {
  char buf[40];
  for (int prec = 1; prec <= 17; ++prec) {
    std::snprintf(buf, sizeof buf, "%.*g", prec, v);
    if (std::strtod(buf, nullptr) == v) break;
  }
  return buf;
}

OptionText& OptionText::add(const char* name, const std::string& v) {
  if (!text_.empty()) text_ += ' ';
  text_ += name;
  text_ += '=';
  text_ += v.empty() ? std::string("''") : v;
  return *this;
}

Status unknown_pass(const std::string& name) {
  std::string known;
  for (const std::string& n : pass_names()) known += (known.empty() ? "" : ", ") + n;
  return Status::error("unknown pass '" + name + "' (known passes: " + known + ")");
}

Status run_pipeline(ir::Graph& g, const std::vector<std::string>& pipeline, PassContext& ctx) {
  std::ostream& log = ctx.log ? *ctx.log : std::cerr;
  // Every name is checked before any pass runs: a typo is not half a pipeline.
  for (const std::string& name : pipeline)
    if (!make_pass(name)) return unknown_pass(name);
  if (!ctx.print_ir_after.empty() && ctx.print_ir_after != "all" && !make_pass(ctx.print_ir_after))
    return Status::error("--print-ir-after: unknown pass '" + ctx.print_ir_after + "'");
  if (!ctx.dump_ir_dir.empty() && ctx.dump_index == 0) {
    std::error_code ec;
    std::filesystem::create_directories(ctx.dump_ir_dir, ec);
    if (ec) return Status::error("--dump-ir-dir '" + ctx.dump_ir_dir + "': " + ec.message());
    // An earlier run's dumps (NN-pass.txt, another pipeline) would mix with this run's.
    for (auto it = std::filesystem::directory_iterator(ctx.dump_ir_dir, ec);
         !ec && it != std::filesystem::directory_iterator(); it.increment(ec)) {
      // Only the names kiln writes: NN-<registered pass>.txt and 00-input.txt.
      const std::string f = it->path().filename().string();
      if (f.size() > 7 && std::isdigit(static_cast<unsigned char>(f[0])) &&
          std::isdigit(static_cast<unsigned char>(f[1])) && f[2] == '-' && f.compare(f.size() - 4, 4, ".txt") == 0 &&
          (f == "00-input.txt" || make_pass(f.substr(3, f.size() - 7))) && it->is_regular_file(ec)) {
        std::error_code rm;
        std::filesystem::remove(it->path(), rm);
      }
    }
    std::ofstream(ctx.dump_ir_dir + "/00-input.txt") << ir::graph_to_string(g);
  }
  int idx = 0;
  for (const std::string& name : pipeline) {
    ++idx;
    auto pass = make_pass(name);
    if (!pass) return unknown_pass(name);
    auto t0 = std::chrono::steady_clock::now();
    auto changed = pass->run(g, ctx);
    double secs = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    if (!changed) return changed.status().with_context("pass '" + name + "'");
    ctx.pass_seconds[name] += secs;
    if (ctx.time_passes) {
      char buf[160];
      std::snprintf(buf, sizeof buf, "[time-passes] %-28s %9.3f ms%s\n", name.c_str(), secs * 1e3,
                    *changed ? "" : "  (no change)");
      log << buf;
    }
    if (ctx.verify_each) {
      Status st = ir::verify_graph(g);
      if (!st) return st.with_context("verifier after pass '" + name + "'");
    }
    if (ctx.print_ir_after == "all" || ctx.print_ir_after == name)
      log << "// ----- IR after " << name << " -----\n" << ir::graph_to_string(g);
    if (!ctx.dump_ir_dir.empty()) {
      char fn[64];
      std::snprintf(fn, sizeof fn, "/%02d-", ++ctx.dump_index);
      std::ofstream(ctx.dump_ir_dir + fn + name + ".txt") << ir::graph_to_string(g);
    }
    if (ctx.stop_after > 0 && idx >= ctx.stop_after) break;
  }
  return Status::ok();
}

}  // namespace kiln::passes
