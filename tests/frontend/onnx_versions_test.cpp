// The ONNX schema versions kiln says it implements (OpDef::onnx_since for ops of the
// table, Lowering::onnx_since for ops lowered at import) against ONNX's own schema
// history (tests/data/onnx_schema_versions.json, written from PyPI's onnx by
// tools/make_onnx_node_tests.sh): every version of the op from the one in force at
// opset 13 (kiln's oldest; else the op's first) up to kiln's newest opset, none missing,
// none invented. When kMaxOpset is raised, the ops ONNX changed since then fail here
// until their new versions are reviewed and listed.
#include <gtest/gtest.h>

#include <fstream>
#include <nlohmann/json.hpp>

#include "frontend/onnx_import.h"
#include "frontend/onnx_lower.h"
#include "ir/op_table.h"

using namespace kiln;

namespace {

nlohmann::json schema_history() {
  std::ifstream f(std::string(KILN_SOURCE_DIR) + "/tests/data/onnx_schema_versions.json");
  return nlohmann::json::parse(f);
}

/// ONNX's versions of `op` that a model at opsets 13..max can select.
std::vector<int> expected_versions(const nlohmann::json& h, const std::string& op, int64_t max_opset) {
  std::vector<int> all = h["ops"][op].get<std::vector<int>>();
  int start = all.front();
  for (int v : all)
    if (v <= frontend::kMinOpset) start = v;
  std::vector<int> out;
  for (int v : all)
    if (v >= start && v <= max_opset) out.push_back(v);
  return out;
}

}  // namespace

TEST(OnnxVersions, KilnFollowsTheNewestOnnxRelease) {
  auto h = schema_history();
  EXPECT_EQ(frontend::kMaxOpset, h["max_opset"].get<int64_t>())
      << "ONNX " << h["onnx_version"].get<std::string>() << " has opset " << h["max_opset"]
      << ": review the ops it changed, list their versions, then raise frontend::kMaxOpset";
}

TEST(OnnxVersions, EveryOpListsOnnxsVersions) {
  auto h = schema_history();
  int checked = 0;
  for (const auto& [name, def] : ir::OpTable::get().all()) {
    if (!def.onnx) continue;
    SCOPED_TRACE(name);
    ASSERT_TRUE(h["ops"].contains(name)) << "kiln marks " << name << " as an ONNX op; ONNX has no such op";
    EXPECT_EQ(def.onnx_since, expected_versions(h, name, frontend::kMaxOpset));
    ++checked;
  }
  for (const auto& [name, lw] : frontend::onnx_lowerings()) {
    SCOPED_TRACE(name);
    ASSERT_TRUE(h["ops"].contains(name));
    EXPECT_EQ(lw.onnx_since, expected_versions(h, name, frontend::kMaxOpset));
    EXPECT_EQ(ir::OpTable::get().find(name), nullptr) << name << " is both lowered and an op of the table";
    ++checked;
  }
  std::cout << "[ INFO ] " << checked << " ONNX ops checked against ONNX " << h["onnx_version"].get<std::string>()
            << "'s schema history\n";
  EXPECT_GT(checked, 80);
}
