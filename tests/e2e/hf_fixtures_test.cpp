// Hugging Face models exported by current PyTorch exporters (tests/data/hf/, written by
// tools/make_hf_fixtures.sh with PyPI torch 2.15, onnxscript and transformers: GPT-2,
// Llama, BERT, DistilBERT, ViT and T5 from tiny configs; the torch.export-based exporter
// at its default opset, at opset 18 and at opset 23, and the TorchScript exporter; with
// logits out and with the loss inside) against PyTorch's own numbers for one batch:
//   - kiln's trainable parameters are exactly PyTorch's named_parameters() (names, shapes);
//   - forward: logits within 1e-5 of PyTorch's (max abs error over max abs value), or the
//     model's loss within 1e-5 relative;
//   - loss and every parameter gradient in float32: 1e-5 relative loss, 1e-4 per tensor
//     (L2 norm of the difference over the larger of the reference's norm and 1e-3 of the
//     global gradient norm);
//   - 20 AdamW steps on that batch (lr 1e-3, weight decay 0.01 on rank >= 2, clipping at
//     1.0): every loss within 1e-3 relative of PyTorch's in float32, and within 2e-2 of
//     PyTorch's CPU autocast (bfloat16) run with --bf16.
// The eager backend computes gradients (the reference); the trajectories run on the
// compiled backend (the kiln command line's default) and, in float32, on eager too.
// Export: after 3 steps, the trained model kiln writes (the original file with trained
// initializers, ties and restored parameters written back) re-imports with exactly
// PyTorch's parameters holding exactly the trained values, and computes the same loss.
#include <cmath>
#include <set>

#include "e2e_util.h"
#include "tools/driver/export_trained.h"

using namespace kiln;
using namespace kiln::testing;

namespace {

const std::string kRoot = std::string(KILN_SOURCE_DIR) + "/tests/data/hf/";

struct Fixture {
  std::string file, model, variant, route;
  std::vector<std::string> inputs;
};

std::string fixture_name(const Fixture& f) { return f.model + "_" + f.variant + "_" + f.route; }
void PrintTo(const Fixture& f, std::ostream* os) { *os << f.file; }

std::vector<Fixture> exported_fixtures() {
  std::vector<Fixture> out;
  auto m = read_json(kRoot + "manifest.json");
  for (auto& e : m["fixtures"]) {
    if (!e["exported"].get<bool>()) continue;
    Fixture f{e["file"], e["model"], e["variant"], e["route"], {}};
    for (auto& i : e["inputs"]) f.inputs.push_back(i.get<std::string>());
    out.push_back(f);
  }
  return out;
}

nlohmann::json reference(const Fixture& f) { return read_json(kRoot + f.model + "/reference.json"); }

runtime::TrainConfig config(const Fixture& f, const nlohmann::json& ref, const std::string& backend, bool bf16) {
  runtime::TrainConfig cfg;
  cfg.model = kRoot + f.file;
  const int64_t batch = ref["batch"].get<int64_t>();
  cfg.shape["batch"] = batch;
  if (f.model != "vit") cfg.shape["seq"] = ref["seq"].get<int64_t>();
  cfg.per_device_train_batch_size = batch;
  cfg.per_device_eval_batch_size = batch;
  cfg.loss = f.variant == "logits" ? "cross_entropy" : "model";
  const auto& a = ref["adamw"];
  cfg.optim = "adamw_torch";
  cfg.learning_rate = a["learning_rate"].get<double>();
  cfg.adam_beta1 = a["adam_beta1"].get<double>();
  cfg.adam_beta2 = a["adam_beta2"].get<double>();
  cfg.adam_epsilon = a["adam_epsilon"].get<double>();
  cfg.weight_decay = a["weight_decay"].get<double>();
  cfg.max_grad_norm = a["max_grad_norm"].get<double>();
  cfg.lr_scheduler_type = "constant";
  cfg.max_steps = a["steps"].get<int64_t>();
  cfg.backend = backend;
  cfg.bf16 = bf16;
  return cfg;
}

/// The batch of the fixture by data input name: the model inputs, and kiln's label
/// input (the logits variant's labels: next tokens for causal LMs).
std::map<std::string, ir::Tensor> batch_feeds(const Fixture& f, const driver::TrainingProgram& p) {
  std::map<std::string, ir::Tensor> feeds;
  for (const std::string& name : p.data_inputs) {
    const std::string file = (!p.label_input.empty() && name == p.label_input) ? "logit_labels" : name;
    auto t = runtime::io::load_npy(kRoot + f.model + "/" + file + ".npy");
    EXPECT_TRUE(t) << t.message();
    if (t) feeds[name] = *t;
  }
  return feeds;
}

/// Losses of `steps` training steps of p on the same batch, from the initial state;
/// `final_state` (if given) receives the state after the last step.
std::vector<double> losses_on_one_batch(const driver::TrainingProgram& p,
                                        const std::map<std::string, ir::Tensor>& batch, int64_t steps,
                                        std::map<std::string, ir::Tensor>* final_state = nullptr) {
  std::vector<double> losses;
  auto state = initial_state(*p.train_step);
  runtime::RunOptions ro;
  ro.training = true;
  ro.program = p.train_kernels.get();
  ro.arena = p.train_arena.get();
  runtime::ScheduleCache schedule;
  ro.schedule = &schedule;
  for (int64_t i = 0; i < steps; ++i) {
    auto feeds = state;
    for (auto& [k, v] : batch) feeds[k] = v;
    ro.step = static_cast<uint64_t>(i);
    auto out = runtime::run_graph(*p.train_step, feeds, ro);
    if (!out) {
      ADD_FAILURE() << "step " << i << ": " << out.message();
      break;
    }
    losses.push_back((*out)["loss"].get_f64(0));
    for (auto& sb : p.train_step->state) state[sb.input->name] = (*out)[sb.output->name];
  }
  if (final_state) *final_state = state;
  return losses;
}

/// Parameter names and shapes PyTorch lists for the fixture's model.
std::map<std::string, std::vector<int64_t>> pytorch_parameters(const nlohmann::json& ref) {
  std::map<std::string, std::vector<int64_t>> want;
  for (auto& e : ref["parameters"]) want[e[0].get<std::string>()] = e[1].get<std::vector<int64_t>>();
  return want;
}

/// Eval-graph loss of p on `batch` with `state` as its weights.
double eval_loss(const driver::TrainingProgram& p, const std::map<std::string, ir::Tensor>& state,
                 const std::map<std::string, ir::Tensor>& batch) {
  std::map<std::string, ir::Tensor> feeds;
  for (ir::Value* in : p.eval->inputs)
    if (auto it = state.find(in->name); it != state.end()) feeds[in->name] = it->second;
  for (auto& [k, t] : batch) feeds[k] = t;
  auto out = runtime::run_graph(*p.eval, feeds, runtime::RunOptions{});
  EXPECT_TRUE(out) << out.message();
  return out ? out->at("loss").get_f64(0) : std::nan("");
}

class HfFixture : public ::testing::TestWithParam<Fixture> {};

TEST_P(HfFixture, ParametersForwardAndGradients) {
  const Fixture& f = GetParam();
  const auto ref = reference(f);
  const auto& v = ref["variants"][f.variant];
  auto p = driver::build_training_program(config(f, ref, "eager", false), nullptr, /*want_grads=*/true);
  ASSERT_TRUE(p) << p.message();

  // Exactly PyTorch's parameters, by name and shape.
  std::map<std::string, std::vector<int64_t>> want = pytorch_parameters(ref), got;
  for (auto& sb : p->train_step->state)
    if (sb.kind == "parameter") got[sb.input->name] = sb.input->shape.to_vector();
  for (auto& [n, s] : want) {
    auto it = got.find(n);
    if (it == got.end())
      ADD_FAILURE() << "PyTorch parameter " << n << " is not trained by kiln";
    else
      EXPECT_EQ(it->second, s) << n;
  }
  for (auto& [n, s] : got) EXPECT_TRUE(want.count(n)) << "kiln trains " << n << ", which PyTorch does not list";

  const auto batch = batch_feeds(f, *p);
  // Forward (eval program): logits, or the model's loss.
  {
    auto feeds = initial_state(*p->train_step);
    for (auto& [k, t] : batch) feeds[k] = t;
    auto out = runtime::run_graph(*p->eval, feeds, runtime::RunOptions{});
    ASSERT_TRUE(out) << out.message();
    if (f.variant == "logits") {
      auto want_logits = runtime::io::load_npy(kRoot + f.model + "/logits.npy");
      ASSERT_TRUE(want_logits) << want_logits.message();
      const ir::Tensor& l = out->at(p->logits_output);
      ASSERT_EQ(l.numel(), want_logits->numel()) << ir::dims_to_string(l.dims());
      double err = 0, mx = 0;
      for (int64_t i = 0; i < l.numel(); ++i) {
        err = std::max(err, std::abs(l.get_f64(i) - want_logits->get_f64(i)));
        mx = std::max(mx, std::abs(want_logits->get_f64(i)));
      }
      EXPECT_LE(err, 1e-5 * mx) << "logits: max abs error " << err << ", max abs value " << mx;
      std::cout << "[ INFO ] logits: max abs error " << err << " (max abs value " << mx << ")\n";
    }
    const double loss = out->at("loss").get_f64(0), want_loss = v["loss"].get<double>();
    EXPECT_LE(std::abs(loss - want_loss), 1e-5 * std::abs(want_loss)) << "eval loss " << loss << " vs " << want_loss;
  }
  // Loss and gradients.
  {
    auto feeds = initial_state(*p->grads);
    for (auto& [k, t] : batch) feeds[k] = t;
    runtime::RunOptions ro;
    ro.training = true;
    auto out = runtime::run_graph(*p->grads, feeds, ro);
    ASSERT_TRUE(out) << out.message();
    const double loss = out->at("loss").get_f64(0), want_loss = v["loss"].get<double>();
    EXPECT_LE(std::abs(loss - want_loss), 1e-5 * std::abs(want_loss)) << "loss " << loss << " vs " << want_loss;
    auto grads = runtime::io::load_safetensors(kRoot + f.model + "/grads_" + f.variant + ".safetensors");
    ASSERT_TRUE(grads) << grads.message();
    double global = 0;
    for (auto& [n, t] : *grads)
      for (int64_t i = 0; i < t.numel(); ++i) global += t.get_f64(i) * t.get_f64(i);
    global = std::sqrt(global);
    double worst = 0;
    std::string worst_name;
    for (auto& [n, t] : *grads) {
      auto it = out->find(n + ".grad");
      if (it == out->end()) {
        ADD_FAILURE() << "no gradient for " << n;
        continue;
      }
      ASSERT_EQ(it->second.numel(), t.numel()) << n;
      double d = 0, r = 0;
      for (int64_t i = 0; i < t.numel(); ++i) {
        const double x = it->second.get_f64(i) - t.get_f64(i);
        d += x * x;
        r += t.get_f64(i) * t.get_f64(i);
      }
      const double e = std::sqrt(d) / std::max(std::sqrt(r), 1e-3 * global);
      EXPECT_LT(e, 1e-4) << "gradient of " << n << ": relative error " << e;
      if (e >= worst) {
        worst = e;
        worst_name = n;
      }
    }
    std::cout << "[ INFO ] loss " << loss << " (PyTorch " << want_loss << "); largest gradient error " << worst << " ("
              << worst_name << ", " << grads->size() << " tensors)\n";
  }
}

void check_trajectory(const Fixture& f, const std::string& backend, bool bf16) {
  const auto ref = reference(f);
  const auto& v = ref["variants"][f.variant];
  auto cfg = config(f, ref, backend, bf16);
  cfg.no_cache = true;
  auto p = driver::build_training_program(cfg, nullptr, false, false, cfg.max_steps);
  ASSERT_TRUE(p) << p.message();
  const auto want = v[bf16 ? "adamw_bf16" : "adamw_f32"];
  const auto losses = losses_on_one_batch(*p, batch_feeds(f, *p), static_cast<int64_t>(want.size()));
  ASSERT_EQ(losses.size(), want.size());
  const double tol = bf16 ? 2e-2 : 1e-3;
  for (size_t i = 0; i < losses.size(); ++i) {
    const double w = want[i].get<double>();
    EXPECT_LE(std::abs(losses[i] - w), tol * std::abs(w))
        << backend << (bf16 ? " bf16" : " fp32") << " step " << i << ": " << losses[i] << " vs PyTorch " << w;
  }
}

/// Ops of the compiled step's schedule that run their eager kernel (nested loop bodies
/// included; FusedKernel bodies, library calls and ops that only move data are not).
void eager_ops(const ir::Graph& g, std::map<std::string, int>& out) {
  for (auto& n : g.nodes()) {
    if (n->op == "FusedKernel") continue;
    for (auto& r : n->regions) eager_ops(*r, out);
    ++out[n->op];
  }
}

TEST_P(HfFixture, NewOpsRunInGeneratedKernels) {
  // The ops that current exports brought (and their lowerings, gradients and strided
  // forms) never leave an eager node in the compiled training step.
  const Fixture& f = GetParam();
  auto cfg = config(f, reference(f), "compiled", false);
  cfg.no_cache = true;
  auto p = driver::build_training_program(cfg, nullptr, false);
  ASSERT_TRUE(p) << p.message();
  std::map<std::string, int> ops;
  eager_ops(*p->train_step, ops);
  static const std::set<std::string> kNew = {"IsNaN",
                                             "IsInf",
                                             "Sign",
                                             "Floor",
                                             "Ceil",
                                             "Round",
                                             "Mod",
                                             "GatherElements",
                                             "GatherND",
                                             "ScatterElements",
                                             "ScatterND",
                                             "CumSum",
                                             "Trilu",
                                             "Einsum",
                                             "Attention",
                                             "RotaryEmbedding",
                                             "RMSNormalization",
                                             "Gelu",
                                             "GeluGrad",
                                             "Split",
                                             "AsStrided",
                                             "AsStridedScatter",
                                             "Where",
                                             "Cast",
                                             "Expand",
                                             "Concat",
                                             "Pad",
                                             "SliceGrad",
                                             "ReduceMean",
                                             "ReduceMax",
                                             "Softmax",
                                             "SoftmaxGrad",
                                             "Range",
                                             "Trilu"};
  std::string listed;
  for (auto& [op, count] : ops) {
    listed += " " + op + "x" + std::to_string(count);
    EXPECT_FALSE(kNew.count(op)) << count << " eager " << op << " node(s) in the compiled step";
  }
  std::cout << "[ INFO ] nodes outside generated kernels:" << listed << "\n";
}

TEST_P(HfFixture, AdamW20StepsFp32Eager) { check_trajectory(GetParam(), "eager", false); }
TEST_P(HfFixture, AdamW20StepsFp32Compiled) { check_trajectory(GetParam(), "compiled", false); }
TEST_P(HfFixture, AdamW20StepsBf16Compiled) { check_trajectory(GetParam(), "compiled", true); }

/// Trains f 3 steps (eager), exports the trained model, re-imports it and checks that
/// it trains exactly `want`'s parameters holding the trained values, with the same loss.
void check_export_round_trip(const Fixture& f, const std::map<std::string, std::vector<int64_t>>& want) {
  const auto ref = reference(f);
  auto cfg = config(f, ref, "eager", false);
  auto p = driver::build_training_program(cfg, nullptr, false);
  ASSERT_TRUE(p) << p.message();
  const auto batch = batch_feeds(f, *p);
  std::map<std::string, ir::Tensor> state;
  ASSERT_EQ(losses_on_one_batch(*p, batch, 3, &state).size(), 3u);
  std::map<std::string, ir::Tensor> weights;
  for (auto& sb : p->train_step->state)
    if (sb.kind == "parameter" || sb.kind == "buffer") weights[sb.input->name] = state.at(sb.input->name);

  const std::string dir = fresh_tmpdir("hf_export_" + fixture_name(f));
  const std::string out = dir + "/model.onnx";
  Status st = driver::export_trained_model(cfg.model, weights, p->train_step->initializer_origins, out);
  ASSERT_TRUE(st.ok()) << st.message();

  cfg.model = out;
  auto q = driver::build_training_program(cfg, nullptr, false);
  ASSERT_TRUE(q) << "re-import of the exported model: " << q.message();
  auto reloaded = initial_state(*q->train_step);
  int params = 0;
  for (auto& sb : q->train_step->state) {
    if (sb.kind != "parameter") continue;
    ++params;
    const std::string& n = sb.input->name;
    EXPECT_TRUE(want.count(n)) << "the exported model trains " << n << ", which PyTorch does not list";
    ASSERT_TRUE(weights.count(n)) << n;
    const ir::Tensor &a = reloaded.at(n), &b = weights.at(n);
    ASSERT_EQ(a.dims(), b.dims()) << n;
    EXPECT_EQ(std::memcmp(a.raw(), b.raw(), a.nbytes()), 0) << n << " does not hold its trained values";
  }
  EXPECT_EQ(params, static_cast<int>(want.size()));
  const double trained = eval_loss(*p, state, batch), exported = eval_loss(*q, reloaded, batch);
  EXPECT_LE(std::abs(trained - exported), 1e-6 * std::abs(trained)) << exported << " vs " << trained;
}

TEST_P(HfFixture, TrainedModelExportsAndReimports) {
  check_export_round_trip(GetParam(), pytorch_parameters(reference(GetParam())));
}

INSTANTIATE_TEST_SUITE_P(Exports, HfFixture, ::testing::ValuesIn(exported_fixtures()),
                         [](const ::testing::TestParamInfo<Fixture>& i) { return fixture_name(i.param); });

TEST(HfFixtures, ManifestListsEveryRoute) {
  // Every model and variant was exported by every route (a route the exporter failed is
  // recorded with its reason and printed here, not skipped silently).
  auto m = read_json(kRoot + "manifest.json");
  int exported = 0;
  for (auto& e : m["fixtures"]) {
    if (e["exported"].get<bool>())
      ++exported;
    else
      std::cout << "[ NOTE ] " << e["file"].get<std::string>() << " not exported: " << e["reason"] << "\n";
  }
  std::cout << "[ INFO ] " << exported << " of " << m["fixtures"].size() << " exports (" << m["versions"].dump()
            << ")\n";
  EXPECT_EQ(m["fixtures"].size(), 48u);
  EXPECT_GE(exported, 32);
}

}  // namespace

namespace {

// A freshly initialized GPT-2 exported by the default exporter, which merges its
// equal-valued LayerNorm weights and biases into shared initializers and drops its
// all-zero Linear (Conv1D) biases: kiln restores PyTorch's parameters from the
// torch.export signature (written by tools/export_hf_fixtures.py to fresh_parameters.json
// from named_parameters()), and the trained model it exports puts them back into the file.
// The same model exported by the TorchScript exporter aliases the equal-valued
// parameters through Identity nodes named as PyTorch's parameters: each becomes a
// parameter of its own.
const std::vector<Fixture> kFreshGpt2 = {{"gpt2/fresh_dynamo.onnx", "gpt2", "logits", "dynamo", {}},
                                         {"gpt2/fresh_torchscript.onnx", "gpt2", "logits", "torchscript", {}}};

std::map<std::string, std::vector<int64_t>> fresh_parameters() {
  std::map<std::string, std::vector<int64_t>> want;
  for (auto& e : read_json(kRoot + "gpt2/fresh_parameters.json"))
    want[e[0].get<std::string>()] = e[1].get<std::vector<int64_t>>();
  return want;
}

class HfFreshModel : public ::testing::TestWithParam<Fixture> {};

TEST_P(HfFreshModel, MergedAndDroppedParametersRestored) {
  const Fixture& f = GetParam();
  const auto ref = reference(f);
  auto p = driver::build_training_program(config(f, ref, "eager", false), nullptr, false);
  ASSERT_TRUE(p) << p.message();
  const auto want = fresh_parameters();
  std::map<std::string, std::vector<int64_t>> got;
  for (auto& sb : p->train_step->state)
    if (sb.kind == "parameter") got[sb.input->name] = sb.input->shape.to_vector();
  EXPECT_EQ(got, want);
  // Restored parameters start from the exporter's shared values: LayerNorm weights ones,
  // biases zeros (PyTorch's initialization of a fresh GPT-2).
  auto state = initial_state(*p->train_step);
  for (auto& [n, t] : state) {
    if (!want.count(n)) continue;
    const bool ln = n.find(".ln_") != std::string::npos;
    const bool bias = n.size() > 5 && n.compare(n.size() - 5, 5, ".bias") == 0;
    if (!ln && !bias) continue;
    const double v = (ln && !bias) ? 1.0 : 0.0;
    for (int64_t i = 0; i < t.numel(); ++i) ASSERT_EQ(t.get_f64(i), v) << n << "[" << i << "]";
  }
}

TEST_P(HfFreshModel, TrainedModelExportsAndReimports) { check_export_round_trip(GetParam(), fresh_parameters()); }

INSTANTIATE_TEST_SUITE_P(Gpt2, HfFreshModel, ::testing::ValuesIn(kFreshGpt2),
                         [](const ::testing::TestParamInfo<Fixture>& i) { return i.param.route; });

}  // namespace
