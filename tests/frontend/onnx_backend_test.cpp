// ONNX's own backend test suite (Debian's libonnx-testdata, ONNX 1.12: node/,
// pytorch-converted/, pytorch-operator/, simple/; and the node tests of newer ONNX
// releases in tests/data/onnx_node/) run through kiln's importer and eager interpreter.
//
// A test is "supported" when the model can be brought to an opset kiln imports (models
// with opset < 13 are upgraded by ONNX's version converter, as the importer does), its
// graph inputs/outputs are tensors of dtypes kiln has, and every node's op is in kiln's op
// table (default domain). Every supported test must reproduce each test_data_set's
// outputs within ONNX's backend tolerances (rtol 1e-3, atol 1e-7; bf16 and f16 outputs of
// graphs kiln imports as several nodes 4 units in their last place), except the documented
// exceptions in kKnownFailures, each with its reason. Counts per folder, and the reasons
// of the unsupported tests, are printed.
//
// Set KILN_ONNX_BACKEND_VERBOSE=1 to print the reason of every unsupported test.
//
// Test data conventions handled here:
//  - kiln compiles for static shapes, so int64 graph inputs of rank <= 1 (ReduceSum's
//    axes, Reshape's shape, Slice's starts, ...) are passed to the importer as
//    ImportOptions::constant_inputs, and the symbolic dims (dim_param) of the other
//    inputs are bound to the fed tensors' dims (the model is re-imported per
//    test_data_set);
//  - ONNX stores bfloat16 test tensors as UINT16 tensors holding the bf16 bit patterns
//    (numpy has no bfloat16): when the graph declares a bf16 input/output and the .pb is
//    UINT16, the bits are reinterpreted as bf16.
#include <gtest/gtest.h>
#include <onnx/onnx_pb.h>
#include <onnx/shape_inference/implementation.h>
#include <onnx/version_converter/convert.h>

#include <cmath>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <map>
#include <set>

#include "frontend/onnx_import.h"
#include "frontend/onnx_lower.h"
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

/// Short form of a libonnx exception message: first line, without the source location
/// and assertion text ("file:line: fn: Assertion `...` failed: why" -> "why"), at most
/// 120 characters.
std::string short_msg(const std::string& m) {
  std::string s = m.substr(0, m.find('\n'));
  if (auto p = s.find("` failed: "); p != std::string::npos) s = s.substr(p + 10);
  return s.size() > 120 ? s.substr(0, 120) + "..." : s;
}

bool is_default_domain(const std::string& d) { return d.empty() || d == "ai.onnx"; }

/// Name of a value's type when kiln cannot hold it ("" when it can): non-tensor types
/// (sequence, optional, map) and tensor element types without a kiln dtype.
std::string unsupported_type(const onnx::TypeProto& t) {
  if (t.has_sequence_type()) return "sequence";
  if (t.has_optional_type()) return "optional";
  if (t.has_map_type()) return "map";
  if (!t.has_tensor_type()) return "unknown type";
  int et = t.tensor_type().elem_type();
  if (!ir::dtype_from_onnx(et)) return onnx::TensorProto_DataType_Name(et);
  return "";
}

/// Returns "" when the test can run, else why not: "opset N" (above 18), "dtype X" (a
/// graph input/output kiln cannot hold), "version conversion: ..." (the converter failed
/// on an opset < 13 model) or the first op not in kiln's op table (checked on the
/// upgraded model, since the converter may rename ops, e.g. Upsample -> Resize).
std::string unsupported_reason(const onnx::ModelProto& m) {
  int64_t opset = -1;
  for (auto& imp : m.opset_import())
    if (is_default_domain(imp.domain())) opset = imp.version();
  if (opset > frontend::kMaxOpset) return "opset " + std::to_string(opset);
  for (auto* list : {&m.graph().input(), &m.graph().output()})  // before conversion, which may drop types
    for (auto& vi : *list)
      if (std::string t = unsupported_type(vi.type()); !t.empty()) return "dtype " + t;
  onnx::ModelProto upgraded;
  const onnx::ModelProto* cur = &m;
  if (opset >= 1 && opset < 13) {  // no default-domain opset: only other domains' ops, rejected below
    try {
      upgraded = m;  // as the importer does: shapes first (the converter's adapters need them)
      onnx::shape_inference::InferShapes(upgraded);
      upgraded = onnx::version_conversion::ConvertVersion(upgraded, 13);
      cur = &upgraded;
    } catch (const std::exception& e) {
      return "version conversion: " + short_msg(e.what());
    }
  }
  for (auto& n : cur->graph().node()) {
    if (!is_default_domain(n.domain())) return n.domain() + "::" + n.op_type();
    if (!frontend::importable_op(n.op_type())) return n.op_type();
  }
  return "";
}

bool close(const ir::Tensor& got, const ir::Tensor& want, bool chain, std::string* why) {
  if (got.dims() != want.dims()) {
    *why = "shape " + ir::dims_to_string(got.dims()) + " vs expected " + ir::dims_to_string(want.dims());
    return false;
  }
  if (got.dtype() != want.dtype()) {
    *why = std::string("dtype ") + ir::dtype_name(got.dtype()) + " vs expected " + ir::dtype_name(want.dtype());
    return false;
  }
  // bf16 and f16 results of a chain of ops: 4 units in the last place of the dtype (kiln
  // rounds after every op, ONNX's reference often once at the end: attention in bf16);
  // of one op: ONNX's rtol, so a rounding mode shows (Cast).
  const double rtol = chain && want.dtype() == ir::DType::bf16  ? 4 * std::ldexp(1.0, -7)
                      : chain && want.dtype() == ir::DType::f16 ? 4 * std::ldexp(1.0, -10)
                                                                : 1e-3;
  for (int64_t i = 0; i < want.numel(); ++i) {
    double g = got.get_f64(i), w = want.get_f64(i);
    if (std::isnan(w) && std::isnan(g)) continue;
    if (std::isinf(w) && g == w) continue;
    if (!(std::abs(g - w) <= 1e-7 + rtol * std::abs(w))) {
      *why = "element " + std::to_string(i) + ": " + std::to_string(g) + " vs expected " + std::to_string(w);
      return false;
    }
  }
  return true;
}

/// Reads one input_k.pb / output_k.pb; `declared` is the graph's dtype for it. bf16
/// tensors stored as UINT16 bit patterns (ONNX's convention) are read as bf16.
Expected<ir::Tensor> load_pb(const fs::path& p, int declared) {
  onnx::TensorProto tp;
  std::ifstream f(p, std::ios::binary);
  if (!f || !tp.ParseFromIstream(&f)) return Status::error(p.string() + ": not a TensorProto");
  if (declared == onnx::TensorProto::BFLOAT16 && tp.data_type() == onnx::TensorProto::UINT16)
    tp.set_data_type(onnx::TensorProto::BFLOAT16);  // same 2-byte storage (raw_data or int32_data)
  auto t = frontend::tensor_from_proto(tp, p.parent_path().string());
  if (!t) return Status::error(p.string() + ": " + t.message());
  return t;
}

int elem_type(const onnx::ValueInfoProto& vi) {
  return vi.type().has_tensor_type() ? vi.type().tensor_type().elem_type() : 0;
}

/// Runs one test folder; returns "" on success or the failure reason.
std::string run_one(const fs::path& dir, const onnx::ModelProto& m) {
  // Graph inputs fed by input_k.pb: the declared inputs that are not initializers.
  std::set<std::string> inits;
  for (auto& t : m.graph().initializer()) inits.insert(t.name());
  std::vector<const onnx::ValueInfoProto*> ins;
  for (auto& vi : m.graph().input())
    if (!inits.count(vi.name())) ins.push_back(&vi);
  int sets = 0;
  for (int s = 0;; ++s) {
    fs::path ds = dir / ("test_data_set_" + std::to_string(s));
    if (!fs::exists(ds)) break;
    ++sets;
    frontend::ImportOptions opts;
    std::map<std::string, ir::Tensor> feeds;
    for (size_t k = 0; k < ins.size(); ++k) {
      fs::path p = ds / ("input_" + std::to_string(k) + ".pb");
      if (!fs::exists(p)) return "missing " + p.string();
      auto t = load_pb(p, elem_type(*ins[k]));
      if (!t) return "input: " + t.message();
      // Shape-like inputs are compile-time constants for kiln (static shapes).
      if (t->dtype() == ir::DType::i64 && t->rank() <= 1)
        opts.constant_inputs[ins[k]->name()] = *t;
      else
        feeds[ins[k]->name()] = *t;
      // Symbolic dims are bound from the data (kiln compiles for static shapes).
      const auto& dims = ins[k]->type().tensor_type().shape().dim();
      for (int d = 0; d < dims.size() && d < t->rank(); ++d)
        if (!dims[d].dim_param().empty()) opts.bind_dims[dims[d].dim_param()] = t->dims()[static_cast<size_t>(d)];
    }
    auto g = frontend::import_onnx((dir / "model.onnx").string(), opts);
    if (!g) return "import: " + g.message();
    auto out = runtime::run_graph(**g, feeds);
    if (!out) return "run: " + out.message();
    for (size_t k = 0; k < (*g)->outputs.size(); ++k) {
      fs::path p = ds / ("output_" + std::to_string(k) + ".pb");
      if (!fs::exists(p)) continue;
      auto want = load_pb(p, elem_type(m.graph().output(static_cast<int>(k))));
      if (!want) return "output: " + want.message();
      std::string why;
      if (!close((*out)[(*g)->outputs[k]->name], *want, (*g)->nodes().size() > 1, &why))
        return "output " + std::to_string(k) + " (" + (*g)->outputs[k]->name + "): " + why;
    }
  }
  if (sets == 0) return "no test_data_set";
  return "";
}

void run_folder(const std::string& folder, const std::string& data_root = kDataRoot) {
  runtime::register_eager_kernels();
  fs::path root = fs::path(data_root) / folder;
  if (!fs::exists(root))
    FAIL() << root
           << " does not exist: install libonnx-testdata (tools/install_deps.sh), or run "
              "tools/make_onnx_node_tests.sh for tests/data/onnx_node";
  std::vector<fs::path> dirs;
  for (auto& e : fs::directory_iterator(root))
    if (fs::exists(e.path() / "model.onnx")) dirs.push_back(e.path());
  std::sort(dirs.begin(), dirs.end());
  Counts c;
  const bool verbose = std::getenv("KILN_ONNX_BACKEND_VERBOSE") != nullptr;  // one line per unsupported test
  std::map<std::string, int> unsupported_why;
  for (auto& d : dirs) {
    onnx::ModelProto m;
    std::ifstream f(d / "model.onnx", std::ios::binary);
    if (!m.ParseFromIstream(&f)) {
      ADD_FAILURE() << d << ": cannot parse model.onnx";
      continue;
    }
    std::string why = unsupported_reason(m);
    if (!why.empty()) {
      ++c.unsupported;
      ++unsupported_why[why];
      if (verbose)
        std::printf("[onnx-backend] unsupported %s/%s: %s\n", folder.c_str(), d.filename().c_str(), why.c_str());
      continue;
    }
    std::string name = folder + "/" + d.filename().string();
    std::string err = run_one(d, m);
    auto known = kKnownFailures.find(name);
    if (err.empty()) {
      ++c.passed;
      EXPECT_EQ(known, kKnownFailures.end()) << name << " passes now: remove it from the exceptions list";
    } else if (known != kKnownFailures.end()) {
      ++c.known;
      std::printf("[onnx-backend] known exception %s: %s (got: %s)\n", name.c_str(), known->second.c_str(),
                  err.c_str());
    } else {
      ++c.failed;
      ADD_FAILURE() << name << ": " << err;
    }
  }
  std::printf("[onnx-backend] %-18s passed %d, failed %d, known exceptions %d, unsupported %d\n", folder.c_str(),
              c.passed, c.failed, c.known, c.unsupported);
  std::string why;
  for (auto& [reason, n] : unsupported_why) why += " " + reason + " (" + std::to_string(n) + ");";
  std::printf("[onnx-backend] %-18s unsupported by:%s\n", folder.c_str(), why.c_str());
  EXPECT_GT(c.passed, 0) << "no test of " << folder << " passed";
}

}  // namespace

TEST(OnnxBackend, Node) { run_folder("node"); }
TEST(OnnxBackend, PytorchConverted) { run_folder("pytorch-converted"); }
TEST(OnnxBackend, PytorchOperator) { run_folder("pytorch-operator"); }
TEST(OnnxBackend, Simple) { run_folder("simple"); }
// Node tests of newer ONNX releases, for the ops kiln imports (tests/data/onnx_node/,
// tools/make_onnx_node_tests.sh): PyPI onnx 1.17's data (opsets <= 22) and the cases of
// onnx 1.23's generators (opsets <= 28), each case whose op versions Debian's data lacks.
TEST(OnnxBackend, NodeOnnx117) { run_folder("onnx-1.17", std::string(KILN_SOURCE_DIR) + "/tests/data/onnx_node"); }
TEST(OnnxBackend, NodeOnnx123) { run_folder("onnx-1.23", std::string(KILN_SOURCE_DIR) + "/tests/data/onnx_node"); }
