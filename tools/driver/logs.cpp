// KILN_LOGS topics (see logs.h).
#include "tools/driver/logs.h"

#include <cstdlib>
#include <iostream>
#include <mutex>
#include <set>
#include <sstream>

#include "ir/op_table.h"
namespace kiln::driver {

namespace {

std::mutex& log_mutex() {
  static std::mutex m;
  return m;
}

struct Settings {
  bool loaded = false;
  std::set<std::string> on;
};

Settings& settings() {
  static Settings s;
  return s;
}

void load_locked() {
  Settings& s = settings();
  s.loaded = true;
  s.on.clear();
  const char* env = std::getenv("KILN_LOGS");
  if (!env) return;
  std::string unknown;
  std::stringstream ss(env);
  std::string word;
  while (std::getline(ss, word, ',')) {
    while (!word.empty() && (word.front() == ' ' || word.front() == '+')) word.erase(word.begin());
    while (!word.empty() && word.back() == ' ') word.pop_back();
    if (word.empty()) continue;
    if (word == "all") {
      for (auto& t : log_topics()) s.on.insert(t);
      continue;
    }
    bool known = false;
    for (auto& t : log_topics()) known = known || t == word;
    if (known)
      s.on.insert(word);
    else
      unknown += (unknown.empty() ? "'" : ", '") + word + "'";
  }
  if (!unknown.empty()) {
    std::string names;
    for (auto& t : log_topics()) names += (names.empty() ? "" : ",") + t;
    std::cerr << "kiln: warning: KILN_LOGS: unknown topic " << unknown << " (known: " << names << ",all)\n";
  }
}

void collect_fused(const ir::Graph& g, const std::string& where, std::ostringstream& os, int& kernels, int& absorbed) {
  for (auto& n : g.nodes()) {
    if (ir::has_trait(*n, ir::OpTrait::fused_kernel) && !n->regions.empty()) {
      ++kernels;
      const ir::Graph& body = *n->regions[0];
      absorbed += static_cast<int>(body.nodes().size());
      os << n->name << where << ": " << n->attrs.get_string("kind", "?") << ", " << body.nodes().size() << " ops [";
      bool first = true;
      for (auto& b : body.nodes()) {
        os << (first ? "" : " ") << b->op;
        first = false;
      }
      os << "], " << n->inputs.size() << " inputs, " << n->outputs.size() << " outputs ->";
      for (ir::Value* o : n->outputs) os << " " << o->name << ":" << ir::dtype_name(o->dtype) << o->shape.to_string();
      os << "\n";
    }
    for (auto& r : n->regions)
      if (!ir::has_trait(*n, ir::OpTrait::fused_kernel))
        collect_fused(*r, " (in " + n->name + ")", os, kernels, absorbed);
  }
}

}  // namespace

const std::vector<std::string>& log_topics() {
  static const std::vector<std::string> t = {"graph",      "fusion", "output_code", "memory",
                                             "recompiles", "cache",  "passes"};
  return t;
}

bool log_enabled(const std::string& topic) {
  std::lock_guard<std::mutex> lock(log_mutex());
  if (!settings().loaded) load_locked();
  return settings().on.count(topic) > 0;
}

void reload_log_settings() {
  std::lock_guard<std::mutex> lock(log_mutex());
  load_locked();
}

void log_text(const std::string& topic, const std::string& text) {
  if (!log_enabled(topic)) return;
  std::lock_guard<std::mutex> lock(log_mutex());
  std::stringstream ss(text);
  std::string line;
  std::string out;
  while (std::getline(ss, line)) out += "[kiln:" + topic + "] " + line + "\n";
  std::cerr << out << std::flush;
}

std::string describe_fusion(const ir::Graph& g) {
  std::ostringstream os;
  int kernels = 0, absorbed = 0;
  collect_fused(g, "", os, kernels, absorbed);
  os << g.name << ": " << g.nodes().size() << " top-level nodes, " << kernels << " fused kernels absorbing " << absorbed
     << " ops\n";
  return os.str();
}

}  // namespace kiln::driver
