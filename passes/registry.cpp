// Name -> pass factory. Every pass is listed here once.
#include <functional>
#include <map>

#include "passes/pass.h"
#include "passes/passes.h"

namespace kiln::passes {

static const std::map<std::string, std::function<std::unique_ptr<Pass>()>>& factories() {
  static const std::map<std::string, std::function<std::unique_ptr<Pass>()>> f = {
      {"canonicalize", make_canonicalize_pass},
  };
  return f;
}

std::unique_ptr<Pass> make_pass(const std::string& name) {
  auto it = factories().find(name);
  return it == factories().end() ? nullptr : it->second();
}

std::vector<std::string> pass_names() {
  std::vector<std::string> v;
  for (auto& [k, _] : factories()) v.push_back(k);
  return v;
}

}  // namespace kiln::passes
