// Golden codegen tests (docs/architecture.md, convention 14: tinygrad's process replay):
// the generated code of a small corpus is kept as test expectations, so a change to the
// lowering or an emitter shows its codegen diff.
//
// Every file tests/data/golden/codegen/<name>.ir is one case: '#' comment lines saying what
// the kernels are, then IR text (ir/parser.h) of a graph whose FusedKernel nodes (as the
// fusion pass writes them) are the corpus. Each FusedKernel is lowered to kernel IR
// (codegen::lower_fused, in schedule order), and
//   - the LLVM IR before optimization (codegen::emit_llvm_ir) must equal <name>.ll, which
//     must also parse and pass LLVM's verifier (codegen::verify_llvm_ir_text). It is emitted
//     for a fixed target (kTargetCpu, kTargetFeatures), not the host's, so the text is the
//     same on every machine;
//   - the CUDA C++ translation unit (codegen::emit_cuda), preceded by one comment line per
//     kernel with its launch (schedule, grid, block, shared bytes), must equal <name>.cu
//     (skipped without the CUDA toolkit: no emitter is built then).
//
// Regenerating: KILN_UPDATE_GOLDEN=1 build/bin/test_codegen --gtest_filter='GoldenCodegen*'
// rewrites the .ll and .cu files; review the diff (git diff tests/data/golden) before
// committing. A new case needs only its .ir file: the update run writes the others.
#include <gtest/gtest.h>

#include <algorithm>
#include <cctype>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <sstream>
#include <string>
#include <vector>

#include "codegen/cpu/llvm_cpu.h"
#include "codegen/lower.h"
#include "ir/parser.h"
#ifdef KILN_HAVE_CUDA
#include "codegen/cuda/cuda_emitter.h"
#endif

using namespace kiln;

namespace {

namespace fs = std::filesystem;

const std::string kGoldenDir = std::string(KILN_SOURCE_DIR) + "/tests/data/golden/codegen";
/// The fixed target of the golden LLVM IR: an AVX-512 server core (the emitter prefers
/// 512-bit vectors and 16-lane row loops there).
const char* const kTargetCpu = "skylake-avx512";
const char* const kTargetFeatures = "+avx,+avx2,+avx512bw,+avx512dq,+avx512f,+avx512vl,+f16c,+fma";

bool update_goldens() {
  const char* u = std::getenv("KILN_UPDATE_GOLDEN");
  return u && std::string(u) == "1";
}

std::string read_text(const std::string& path) {
  std::ifstream f(path);
  std::stringstream ss;
  ss << f.rdbuf();
  return ss.str();
}

/// Every <name>.ir of the corpus, sorted.
std::vector<std::string> corpus() {
  std::vector<std::string> names;
  if (fs::is_directory(kGoldenDir))
    for (const auto& e : fs::directory_iterator(kGoldenDir))
      if (e.is_regular_file() && e.path().extension() == ".ir") names.push_back(e.path().stem().string());
  std::sort(names.begin(), names.end());
  return names;
}

/// The kernels of corpus file `name`: its FusedKernel nodes, lowered.
std::vector<codegen::Kernel> corpus_kernels(const std::string& name) {
  std::string text;
  std::istringstream in(read_text(kGoldenDir + "/" + name + ".ir"));
  for (std::string line; std::getline(in, line);)
    if (line.empty() || line[0] != '#') text += line + "\n";
  auto g = ir::parse_graph(text);
  EXPECT_TRUE(g) << name << ".ir: " << g.message();
  std::vector<codegen::Kernel> ks;
  if (!g) return ks;
  for (const ir::Node* n : codegen::fused_nodes(**g)) {
    auto k = codegen::lower_fused(*n);
    EXPECT_TRUE(k) << name << ".ir: " << k.message();
    if (k) ks.push_back(std::move(*k));
  }
  EXPECT_FALSE(ks.empty()) << name << ".ir holds no FusedKernel node";
  return ks;
}

/// Compares `got` with golden file `path`, or rewrites it under KILN_UPDATE_GOLDEN=1.
void expect_golden(const std::string& path, const std::string& got) {
  if (update_goldens()) {
    std::ofstream(path) << got;
    std::cout << "[ NOTE ] rewrote " << path << "\n";
    return;
  }
  ASSERT_TRUE(fs::exists(path)) << "missing golden file " << path << " (KILN_UPDATE_GOLDEN=1 writes it; review it)";
  EXPECT_EQ(got, read_text(path)) << path
                                  << ": the generated code changed; review the diff and rerun with "
                                     "KILN_UPDATE_GOLDEN=1 if it is intended";
}

std::string case_name(const std::string& n) {
  std::string s = n;
  for (char& ch : s)
    if (!std::isalnum(static_cast<unsigned char>(ch))) ch = '_';
  return s;
}

class GoldenCodegen : public ::testing::TestWithParam<std::string> {};

TEST_P(GoldenCodegen, LlvmIr) {
  const std::string name = GetParam();
  auto ks = corpus_kernels(name);
  ASSERT_FALSE(ks.empty());
  auto ll = codegen::emit_llvm_ir(ks, kTargetCpu, kTargetFeatures);
  ASSERT_TRUE(ll) << name << ": " << ll.message();
  const std::string path = kGoldenDir + "/" + name + ".ll";
  expect_golden(path, *ll);
  // The golden text is LLVM IR that parses and verifies (not only text that matches).
  Status st = codegen::verify_llvm_ir_text(read_text(path));
  EXPECT_TRUE(st.is_ok()) << path << ": " << st.message();
}

TEST_P(GoldenCodegen, CudaCpp) {
#ifndef KILN_HAVE_CUDA
  GTEST_SKIP() << "built without the CUDA toolkit: no CUDA emitter";
#else
  const std::string name = GetParam();
  auto ks = corpus_kernels(name);
  ASSERT_FALSE(ks.empty());
  auto mod = codegen::emit_cuda(ks);
  ASSERT_TRUE(mod) << name << ": " << mod.message();
  std::ostringstream os;
  for (const codegen::CudaKernelInfo& k : mod->kernels)
    os << "// launch " << k.name << ": schedule " << k.schedule << ", grid (" << k.grid[0] << ", " << k.grid[1] << ", "
       << k.grid[2] << "), block (" << k.block[0] << ", " << k.block[1] << ", " << k.block[2] << "), shared "
       << k.shared_bytes << " bytes\n";
  os << mod->source;
  expect_golden(kGoldenDir + "/" + name + ".cu", os.str());
#endif
}

INSTANTIATE_TEST_SUITE_P(Corpus, GoldenCodegen, ::testing::ValuesIn(corpus()),
                         [](const ::testing::TestParamInfo<std::string>& info) { return case_name(info.param); });

}  // namespace
