// The kiln command line on models from current PyTorch exporters (tests/data/hf, see
// hf_fixtures_test.cpp): what a user sees.
//   - kiln train on a torch.export-based BERT export: each import note once, the trained
//     model.onnx re-inspects with exactly PyTorch's trainable parameter count (from
//     named_parameters() in reference.json) and stands alone (no external data);
//   - kiln inspect names each initializer's role and where it came from (the torch.export
//     signature, the name rule of TorchScript exports, constants folded at import);
//   - --untie_initializers keeps a folded copy of a tied weight as its own parameter;
//   - --loss model with --gradient_accumulation_steps: batch 1 x 2 microbatches trains like
//     batch 2 (GPT-2's rows have equal label counts, so the mean of microbatch means is the
//     batch mean, HF's microbatch normalization);
//   - batch 1 compiles (T5's label shift scatters a one-element constant) like eager;
//   - kiln ops lists the ops the new opsets brought with the ONNX versions implemented;
//   - symbolic dims are bound from the .npy data (no --shape needed), or named when nothing binds them.
#include <gtest/gtest.h>
#include <sys/wait.h>
#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <regex>
#include <sstream>

#include "e2e_util.h"

namespace fs = std::filesystem;

namespace {

const std::string kSrc = KILN_SOURCE_DIR;
const std::string kBin = std::string(KILN_BINARY_DIR) + "/bin/kiln";
const std::string kHf = kSrc + "/tests/data/hf/";

struct CliRun {
  int code;
  std::string out;
};

CliRun kiln(const std::string& args) {
  const std::string log = (fs::temp_directory_path() / ("kiln_hf_cli_" + std::to_string(::getpid()) + ".log")).string();
  kiln::testing::remove_after_tests(log);
  const std::string cmd = "'" + kBin + "' " + args + " > '" + log + "' 2>&1";
  const int st = std::system(cmd.c_str());
  std::ifstream f(log);
  std::stringstream ss;
  ss << f.rdbuf();
  return {WIFEXITED(st) ? WEXITSTATUS(st) : 128, ss.str()};
}

int count_of(const std::string& text, const std::string& needle) {
  int n = 0;
  for (size_t p = text.find(needle); p != std::string::npos; p = text.find(needle, p + 1)) ++n;
  return n;
}

/// "trainable parameters: N in T tensors" of kiln inspect's output (-1 when absent).
int64_t trainable_count(const std::string& out) {
  std::smatch m;
  if (!std::regex_search(out, m, std::regex("trainable parameters: ([0-9]+) in ([0-9]+) tensors"))) return -1;
  return std::stoll(m[1]);
}

int64_t pytorch_parameter_count(const std::string& model) {
  int64_t total = 0;
  const auto ref = kiln::testing::read_json(kHf + model + "/reference.json");  // outlives the loop
  for (auto& e : ref["parameters"]) {
    int64_t n = 1;
    for (auto& d : e[1]) n *= d.get<int64_t>();
    total += n;
  }
  return total;
}

TEST(HfCli, TrainWritesAModelThatReinspectsWithPyTorchsParameters) {
  const std::string d = kHf + "bert/", out = kiln::testing::fresh_tmpdir("hf_cli_bert");
  CliRun r =
      kiln("train " + d + "loss_dynamo.onnx --loss model --train_data input_ids=" + d +
           "input_ids.npy --train_data attention_mask=" + d + "attention_mask.npy --train_data token_type_ids=" + d +
           "token_type_ids.npy --train_data labels=" + d +
           "labels.npy --shape batch=2,seq=8 --per_device_train_batch_size 2 --max_steps 3 --output_dir " + out);
  ASSERT_EQ(r.code, 0) << r.out;
  EXPECT_EQ(count_of(r.out, "Linear weights that the exporter stored transposed"), 1) << r.out;
  ASSERT_TRUE(fs::exists(out + "/model.onnx"));
  EXPECT_FALSE(fs::exists(out + "/model.onnx.data")) << "a small model is written in one file";
  // The trained model stands alone: moved away from the run's folder, it still loads.
  const std::string moved = kiln::testing::fresh_tmpdir("hf_cli_bert_moved") + "/trained.onnx";
  fs::copy_file(out + "/model.onnx", moved);
  CliRun i = kiln("inspect " + moved + " --shape batch=2,seq=8");
  ASSERT_EQ(i.code, 0) << i.out;
  EXPECT_EQ(trainable_count(i.out), pytorch_parameter_count("bert")) << i.out;
}

TEST(HfCli, InspectNamesRolesAndTheirSources) {
  CliRun dyn = kiln("inspect " + kHf + "gpt2/logits_dynamo.onnx --shape batch=2,seq=8");
  ASSERT_EQ(dyn.code, 0) << dyn.out;
  EXPECT_EQ(trainable_count(dyn.out), pytorch_parameter_count("gpt2")) << dyn.out;
  EXPECT_NE(dyn.out.find("transformer.wpe.weight  f32 [32, 32]  (torch.export signature: PARAMETER"), std::string::npos)
      << dyn.out;
  // The causal mask: a float constant (not trained), computed from the graph at import.
  EXPECT_NE(dyn.out.find("val_202  f32 [2, 1, 8, 8]  constant (folded at import"), std::string::npos) << dyn.out;
  CliRun ts = kiln("inspect " + kHf + "gpt2/logits_torchscript.onnx --shape batch=2,seq=8");
  ASSERT_EQ(ts.code, 0) << ts.out;
  EXPECT_EQ(trainable_count(ts.out), pytorch_parameter_count("gpt2")) << ts.out;
  EXPECT_NE(ts.out.find("(name rule (the model states no roles))"), std::string::npos) << ts.out;
  EXPECT_EQ(count_of(ts.out, "is the transpose of 'transformer.wte.weight'"), 1) << ts.out;
}

TEST(HfCli, UntieInitializersKeepsAFoldedCopyApart) {
  // The TorchScript exporter folds lm_head = wte^T into onnx::MatMul_655 (a [32, 96]
  // copy): tied by default, a parameter of its own with --untie_initializers.
  const std::string m = kHf + "gpt2/logits_torchscript.onnx --shape batch=2,seq=8";
  CliRun tied = kiln("inspect " + m), apart = kiln("inspect " + m + " --untie_initializers");
  ASSERT_EQ(tied.code, 0) << tied.out;
  ASSERT_EQ(apart.code, 0) << apart.out;
  EXPECT_EQ(trainable_count(apart.out) - trainable_count(tied.out), 32 * 96) << apart.out;
  EXPECT_NE(apart.out.find("onnx::MatMul_655  f32 [32, 96]  (kept apart (--untie_initializers)"), std::string::npos)
      << apart.out;
  EXPECT_EQ(tied.out.find("onnx::MatMul_655  f32"), std::string::npos) << tied.out;
}

TEST(HfCli, UntiedCopiesStayParametersOfTheTrainedModel) {
  // Trained apart, the folded copy of a tied weight (dynamo: a val_N the signature does not
  // list; TorchScript: an onnx::MatMul_N name) must re-import as a parameter, not a constant.
  for (const std::string file : {"logits_dynamo.onnx", "logits_torchscript.onnx"}) {
    const std::string d = kHf + "gpt2/", out = kiln::testing::fresh_tmpdir("hf_cli_untie");
    const std::string shape = " --shape batch=2,seq=8";
    // The dynamo export drops the unused attention_mask input; the TorchScript one keeps it.
    const std::string mask =
        file == "logits_torchscript.onnx" ? " --train_data attention_mask=" + d + "attention_mask.npy" : "";
    CliRun apart = kiln("inspect " + d + file + shape + " --untie_initializers");
    ASSERT_EQ(apart.code, 0) << apart.out;
    CliRun t = kiln("train " + d + file + shape + " --untie_initializers --train_data input_ids=" + d +
                    "input_ids.npy" + mask + " --train_data labels=" + d +
                    "logit_labels.npy --per_device_train_batch_size 2 --max_steps 2 --output_dir " + out);
    ASSERT_EQ(t.code, 0) << t.out;
    CliRun again = kiln("inspect " + out + "/model.onnx" + shape);
    ASSERT_EQ(again.code, 0) << again.out;
    EXPECT_EQ(trainable_count(again.out), trainable_count(apart.out)) << file << "\n" << again.out;
    EXPECT_GT(trainable_count(apart.out), pytorch_parameter_count("gpt2")) << apart.out;
  }
}

TEST(HfCli, ModelLossWithGradientAccumulationTrainsLikeOneBatch) {
  const std::string d = kHf + "gpt2/";
  const std::string data = " --loss model --train_data input_ids=" + d + "input_ids.npy --train_data labels=" + d +
                           "labels.npy --max_steps 3 --logging_steps 1 --output_dir ";
  const std::string one = kiln::testing::fresh_tmpdir("hf_cli_accum1"),
                    two = kiln::testing::fresh_tmpdir("hf_cli_accum2");
  CliRun a = kiln("train " + d + "loss_dynamo.onnx --shape batch=2,seq=8 --per_device_train_batch_size 2" + data + one);
  ASSERT_EQ(a.code, 0) << a.out;
  CliRun b = kiln("train " + d +
                  "loss_dynamo.onnx --shape batch=1,seq=8 --per_device_train_batch_size 1 "
                  "--gradient_accumulation_steps 2" +
                  data + two);
  ASSERT_EQ(b.code, 0) << b.out;
  const auto la = kiln::testing::train_losses(one), lb = kiln::testing::train_losses(two);
  ASSERT_EQ(la.size(), 3u);
  ASSERT_EQ(lb.size(), 3u);
  for (auto& [step, loss] : la) EXPECT_NEAR(lb.at(step), loss, 1e-5 * std::abs(loss)) << "step " << step;
}

TEST(HfCli, SymbolicDimsAreBoundFromTheData) {
  // Issue 31: a model exported with dynamic_axes (input_ids [batch, seq]) trained on .npy
  // data needed --shape seq=N ("cross_entropy needs static logits ... got [?, ?, ?]"); the
  // data's (2, 8) now binds seq = 8, and the run trains the losses of --shape seq=8.
  const std::string d = kHf + "gpt2/";
  const std::string data = " --train_data input_ids=" + d + "input_ids.npy --train_data labels=" + d +
                           "labels.npy --per_device_train_batch_size 2 --max_steps 2 --logging_steps 1 --output_dir ";
  const std::string bound = kiln::testing::fresh_tmpdir("hf_cli_dims_shape"),
                    from_data = kiln::testing::fresh_tmpdir("hf_cli_dims_data");
  CliRun a = kiln("train " + d + "logits_dynamo.onnx --shape seq=8" + data + bound);
  ASSERT_EQ(a.code, 0) << a.out;
  CliRun b = kiln("train " + d + "logits_dynamo.onnx" + data + from_data);
  ASSERT_EQ(b.code, 0) << b.out;
  const auto la = kiln::testing::train_losses(bound), lb = kiln::testing::train_losses(from_data);
  ASSERT_EQ(la.size(), 2u);
  ASSERT_EQ(lb.size(), 2u);
  for (auto& [step, loss] : la) EXPECT_EQ(lb.at(step), loss) << "step " << step;
  // Nothing binds seq without data (kiln bench's synthetic batches): one line naming the
  // dim and both ways to bind it.
  CliRun c = kiln("bench " + d + "logits_dynamo.onnx --per_device_train_batch_size 2");
  EXPECT_NE(c.code, 0);
  EXPECT_NE(c.out.find("kiln: error: input 'input_ids' dim 1 ('seq', shape [batch, seq]) is bound by nothing: give "
                       "data for it (--train_data input_ids=FILE.npy) or its value (--shape seq=N)\n"),
            std::string::npos)
      << c.out;
}

TEST(HfCli, ALossExportWithoutLossModelSaysWhatToDo) {
  const std::string d = kHf + "gpt2/";
  CliRun r = kiln("train " + d + "loss_dynamo.onnx --shape batch=2,seq=8 --train_data input_ids=" + d +
                  "input_ids.npy --train_data labels=" + d +
                  "labels.npy --per_device_train_batch_size 2 --max_steps 1 --output_dir " +
                  kiln::testing::fresh_tmpdir("hf_cli_scalar"));
  EXPECT_NE(r.code, 0);
  EXPECT_NE(r.out.find("output 'loss' is a scalar"), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("--loss model"), std::string::npos) << r.out;
}

TEST(HfCli, BatchOfOneCompilesLikeEager) {
  // At batch 1 the T5 loss exports' label shift scatters a one-element constant, which the
  // compiled step must read through its guard (it failed to lower: "reads a value computed
  // in the kernel"). Compiled and eager losses agree.
  const std::string d = kHf + "t5/";
  for (const std::string file : {"loss_dynamo.onnx", "loss_torchscript.onnx"}) {
    const std::string args = "train " + d + file +
                             " --loss model --shape seq=8 --per_device_train_batch_size 1 "
                             "--train_data input_ids=" +
                             d + "input_ids.npy --train_data attention_mask=" + d +
                             "attention_mask.npy --train_data labels=" + d +
                             "labels.npy --max_steps 2 --logging_steps 1 --output_dir ";
    const std::string c = kiln::testing::fresh_tmpdir("hf_cli_b1c"), e = kiln::testing::fresh_tmpdir("hf_cli_b1e");
    CliRun rc = kiln(args + c + " --backend compiled"), re = kiln(args + e + " --backend eager");
    ASSERT_EQ(rc.code, 0) << file << "\n" << rc.out;
    ASSERT_EQ(re.code, 0) << file << "\n" << re.out;
    const auto lc = kiln::testing::train_losses(c), le = kiln::testing::train_losses(e);
    ASSERT_EQ(lc.size(), 2u);
    ASSERT_EQ(le.size(), 2u);
    for (auto& [step, loss] : le) EXPECT_NEAR(lc.at(step), loss, 1e-5 * std::abs(loss)) << file << " step " << step;
  }
}

TEST(HfCli, OpsListsTheNewOpsetsOps) {
  CliRun r = kiln("ops");
  ASSERT_EQ(r.code, 0) << r.out;
  EXPECT_NE(r.out.find("opsets 13..28"), std::string::npos) << r.out;
  for (const char* line : {"Attention                23,24,25", "RMSNormalization         23",
                           "RotaryEmbedding          23", "Gelu                     20", "GatherND                 13"})
    EXPECT_NE(r.out.find(line), std::string::npos) << "missing: " << line << "\n" << r.out;
  CliRun names = kiln("ops --names");
  ASSERT_EQ(names.code, 0);
  EXPECT_EQ(count_of("\n" + names.out, "\nScatterND\n"), 1) << names.out;
}

}  // namespace
