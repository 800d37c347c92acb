// OpProfile: per-key call counts and wall seconds, and their table (see profile.h).
#include "runtime/profile.h"

#include <algorithm>
#include <cstdio>
#include <sstream>

#include "ir/graph.h"
#include "ir/op_table.h"

namespace kiln::runtime {

void OpProfile::add(const std::string& key, double seconds) {
  Stat& s = stats_[key];
  ++s.calls;
  s.seconds += seconds;
}

std::vector<OpProfileEntry> OpProfile::entries() const {
  std::vector<OpProfileEntry> out;
  out.reserve(stats_.size());
  for (auto& [k, s] : stats_) out.push_back({k, s.calls, s.seconds});
  std::stable_sort(out.begin(), out.end(),
                   [](const OpProfileEntry& a, const OpProfileEntry& b) { return a.seconds > b.seconds; });
  return out;
}

double OpProfile::total_seconds() const {
  double t = 0;
  for (auto& [k, s] : stats_) t += s.seconds;
  return t;
}

int64_t OpProfile::calls(const std::string& key) const {
  auto it = stats_.find(key);
  return it == stats_.end() ? 0 : it->second.calls;
}

double OpProfile::seconds(const std::string& key) const {
  auto it = stats_.find(key);
  return it == stats_.end() ? 0 : it->second.seconds;
}

namespace {
std::string row(const std::string& key, size_t key_w, int64_t calls, double seconds, double total) {
  char buf[160];
  std::snprintf(buf, sizeof buf, "  %10lld  %12.3f  %12.2f  %7.2f%%", static_cast<long long>(calls), seconds * 1e3,
                calls > 0 ? seconds * 1e6 / static_cast<double>(calls) : 0.0,
                total > 0 ? 100.0 * seconds / total : 0.0);
  std::string k = key;
  if (k.size() > key_w) k = k.substr(0, key_w - 3) + "...";
  k.resize(key_w, ' ');
  return k + buf + "\n";
}
constexpr size_t kMaxKeyWidth = 120;  // longer keys (per-node rows of big fused kernels) end in "..."
}  // namespace

std::string OpProfile::table(int max_rows) const {
  const auto es = entries();
  const double total = total_seconds();
  const size_t shown = max_rows > 0 ? std::min(es.size(), static_cast<size_t>(max_rows)) : es.size();
  size_t key_w = 5;  // "total"
  for (size_t i = 0; i < shown; ++i) key_w = std::max(key_w, std::min(kMaxKeyWidth, es[i].key.size()));
  const std::string rest_key = "(" + std::to_string(es.size() - shown) + " other keys)";
  if (shown < es.size()) key_w = std::max(key_w, rest_key.size());
  std::ostringstream os;
  std::string h = "key";
  h.resize(key_w, ' ');
  char buf[160];
  std::snprintf(buf, sizeof buf, "  %10s  %12s  %12s  %8s", "calls", "total ms", "mean us", "% total");
  os << h << buf << "\n" << std::string(key_w + std::string(buf).size(), '-') << "\n";
  int64_t calls = 0;
  for (auto& e : es) calls += e.calls;
  for (size_t i = 0; i < shown; ++i) os << row(es[i].key, key_w, es[i].calls, es[i].seconds, total);
  if (shown < es.size()) {
    int64_t rc = 0;
    double rs = 0;
    for (size_t i = shown; i < es.size(); ++i) {
      rc += es[i].calls;
      rs += es[i].seconds;
    }
    os << row(rest_key, key_w, rc, rs, total);
  }
  os << row("total", key_w, calls, total, total);
  return os.str();
}

std::string profile_key(const ir::Node& n, bool generated, ProfileGroup group) {
  if (!ir::has_trait(n, ir::OpTrait::fused_kernel)) return group == ProfileGroup::node ? n.name + " " + n.op : n.op;
  std::string key = "FusedKernel[" + n.attrs.get_string("kind", "?") + "]" + (generated ? " (generated)" : " (eager)");
  if (group == ProfileGroup::op) return key;
  key = n.name + " " + key;
  if (n.regions.empty()) return key;
  const auto& body = n.regions[0]->nodes();
  for (size_t i = 0; i < body.size() && i < 3; ++i) key += (i ? ", " : ": ") + body[i]->name;
  if (body.size() > 3) key += ", +" + std::to_string(body.size() - 3);
  return key;
}

}  // namespace kiln::runtime
