// ONNX's own backend test suite (Debian's libonnx-testdata: node/, pytorch-converted/,
// pytorch-operator/, simple/) run through kiln's importer and eager interpreter.
//
// A test is "supported" when every node's op is in kiln's op table (default domain).
// Every supported test must reproduce each test_data_set's outputs within ONNX's
// backend tolerances (rtol 1e-3, atol 1e-7), except the documented exceptions in
// kKnownFailures, each with its reason. Counts per folder are printed.
#include <gtest/gtest.h>

#include <cmath>
#include <filesystem>
#include <fstream>
#include <map>
#include <set>

#include <onnx/onnx_pb.h>

#include "frontend/onnx_import.h"
#include "frontend/tensor_proto.h"
#include "ir/op_table.h"
#include "runtime/interpreter.h"

namespace fs = std::filesystem;
using namespace kiln;

namespace {

const char* kDataRoot = "/usr/share/libonnx-testdata/data";

/// Supported tests that kiln does not pass, with the reason (test folder name -> reason).
const std::map<std::string, std::string> kKnownFailures = {
#include "onnx_backend_exceptions.inc"
};

struct Counts {
  int passed = 0, failed = 0, unsupported = 0, known = 0;
};

/// Returns "" when all ops are supported, else the first unsupported op (or the
/// opset, when the model's default-domain opset is outside kiln's 13..18).
std::string unsupported_op(const onnx::ModelProto& m) {
  for (auto& imp : m.opset_import())
    if ((imp.domain().empty() || imp.domain() == "ai.onnx") && (imp.version() < 13 || imp.version() > 18))
      return "opset " + std::to_string(imp.version());
  for (auto& n : m.graph().node()) {
    if (!n.domain().empty() && n.domain() != "ai.onnx") return n.domain() + "::" + n.op_type();
    const ir::OpDef* d = ir::OpTable::get().find(n.op_type());
    if (!d || !d->onnx) return n.op_type();
  }
  return "";
}

bool close(const ir::Tensor& got, const ir::Tensor& want, std::string* why) {
  if (got.dims() != want.dims()) {
    *why = "shape " + ir::dims_to_string(got.dims()) + " vs expected " + ir::dims_to_string(want.dims());
    return false;
  }
  if (got.dtype() != want.dtype()) {
    *why = std::string("dtype ") + ir::dtype_name(got.dtype()) + " vs expected " + ir::dtype_name(want.dtype());
    return false;
  }
  for (int64_t i = 0; i < want.numel(); ++i) {
    double g = got.get_f64(i), w = want.get_f64(i);
    if (std::isnan(w) && std::isnan(g)) continue;
    if (std::isinf(w) && g == w) continue;
    if (!(std::abs(g - w) <= 1e-7 + 1e-3 * std::abs(w))) {
      *why = "element " + std::to_string(i) + ": " + std::to_string(g) + " vs expected " + std::to_string(w);
      return false;
    }
  }
  return true;
}

/// Runs one test folder; returns "" on success or the failure reason.
std::string run_one(const fs::path& dir) {
  auto g = frontend::import_onnx((dir / "model.onnx").string());
  if (!g) return "import: " + g.message();
  std::vector<ir::Value*> ins = (*g)->inputs;
  int sets = 0;
  for (int s = 0;; ++s) {
    fs::path ds = dir / ("test_data_set_" + std::to_string(s));
    if (!fs::exists(ds)) break;
    ++sets;
    std::map<std::string, ir::Tensor> feeds;
    for (size_t k = 0; k < ins.size(); ++k) {
      fs::path p = ds / ("input_" + std::to_string(k) + ".pb");
      if (!fs::exists(p)) return "missing " + p.string();
      auto t = frontend::load_tensor_pb(p.string());
      if (!t) return "input: " + t.message();
      feeds[ins[k]->name] = *t;
    }
    auto out = runtime::run_graph(**g, feeds);
    if (!out) return "run: " + out.message();
    for (size_t k = 0; k < (*g)->outputs.size(); ++k) {
      fs::path p = ds / ("output_" + std::to_string(k) + ".pb");
      if (!fs::exists(p)) continue;
      auto want = frontend::load_tensor_pb(p.string());
      if (!want) return "output: " + want.message();
      std::string why;
      if (!close((*out)[(*g)->outputs[k]->name], *want, &why))
        return "output " + std::to_string(k) + " (" + (*g)->outputs[k]->name + "): " + why;
    }
  }
  if (sets == 0) return "no test_data_set";
  return "";
}

void run_folder(const std::string& folder) {
  runtime::register_eager_kernels();
  fs::path root = fs::path(kDataRoot) / folder;
  if (!fs::exists(root)) FAIL() << root << " does not exist: install libonnx-testdata (tools/install_deps.sh)";
  std::vector<fs::path> dirs;
  for (auto& e : fs::directory_iterator(root))
    if (fs::exists(e.path() / "model.onnx")) dirs.push_back(e.path());
  std::sort(dirs.begin(), dirs.end());
  Counts c;
  std::map<std::string, int> unsupported_ops;
  for (auto& d : dirs) {
    onnx::ModelProto m;
    std::ifstream f(d / "model.onnx", std::ios::binary);
    if (!m.ParseFromIstream(&f)) {
      ADD_FAILURE() << d << ": cannot parse model.onnx";
      continue;
    }
    std::string op = unsupported_op(m);
    if (!op.empty()) {
      ++c.unsupported;
      ++unsupported_ops[op];
      continue;
    }
    std::string name = folder + "/" + d.filename().string();
    std::string err = run_one(d);
    auto known = kKnownFailures.find(name);
    if (err.empty()) {
      ++c.passed;
      EXPECT_EQ(known, kKnownFailures.end()) << name << " passes now: remove it from the exceptions list";
    } else if (known != kKnownFailures.end()) {
      ++c.known;
    } else {
      ++c.failed;
      ADD_FAILURE() << name << ": " << err;
    }
  }
  std::printf("[onnx-backend] %-18s passed %d, failed %d, known exceptions %d, unsupported %d\n", folder.c_str(),
              c.passed, c.failed, c.known, c.unsupported);
  std::string why;
  for (auto& [op, n] : unsupported_ops) why += " " + op + "(" + std::to_string(n) + ")";
  std::printf("[onnx-backend] %-18s unsupported by:%s\n", folder.c_str(), why.c_str());
  EXPECT_GT(c.passed, 0) << "no test of " << folder << " passed";
}

}  // namespace

TEST(OnnxBackend, Node) { run_folder("node"); }
TEST(OnnxBackend, PytorchConverted) { run_folder("pytorch-converted"); }
TEST(OnnxBackend, PytorchOperator) { run_folder("pytorch-operator"); }
TEST(OnnxBackend, Simple) { run_folder("simple"); }
