// autocast / cast_simplify (issue 4, bf16 mixed precision):
//   - golden listing of the tiny GPT's forward training graph after
//     attach_loss + autocast + cast_simplify: every Cast and every low_precision
//     node ("op name : float input dtypes -> output dtype"),
//     compared with the hand-checked tests/ir/autocast/tiny_gpt.expected;
//   - invariants of the whole --bf16 training step: every low_precision node of
//     forward and backward computes in bf16, parameters/gradients reaching the
//     optimizer, optimizer state and the loss are f32;
//   - cast_simplify on constructed graphs (round trip removed only when its bf16
//     value is otherwise unused, duplicate casts merged, exact bf16->f32->bf16 trips);
//   - numerics: 200 --bf16 training steps of the MLP and the tiny GPT end (mean of
//     the last 20 logged losses) within 2% of the fp32 run (kiln binary, same seed);
//     the tiny GPT one takes about 17 s on an idle 2-core machine.
#include <gtest/gtest.h>
#include <sys/wait.h>

#include <cmath>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <set>
#include <sstream>

#include "ir/op_table.h"
#include "passes/passes.h"
#include "passes/training_util.h"
#include "runtime/interpreter.h"
#include "tools/driver/driver.h"

using namespace kiln;
using namespace kiln::ir;
namespace fs = std::filesystem;

namespace {

const std::string kSrc = KILN_SOURCE_DIR;

std::string read_file(const std::string& p) {
  std::ifstream f(p);
  std::stringstream ss;
  ss << f.rdbuf();
  return ss.str();
}

PrecisionPolicy policy(const Node& n) {
  const OpDef* d = OpTable::get().find(n.op);
  return d ? d->precision : PrecisionPolicy::follow_inputs;
}

/// "op name : float input dtypes -> output dtype" for Cast nodes and low_precision nodes.
std::string listing(const Graph& g) {
  std::ostringstream os;
  for (auto& n : g.nodes()) {
    if (n->op != "Cast" && policy(*n) != PrecisionPolicy::low_precision) continue;
    os << n->op << " " << n->name << " :";
    for (Value* in : n->inputs)
      if (in && is_float(in->dtype)) os << " " << dtype_name(in->dtype);
    os << " -> " << dtype_name(n->outputs[0]->dtype) << "\n";
  }
  return os.str();
}

std::unique_ptr<Graph> tiny_gpt_forward_bf16() {
  auto g = driver::load_model(kSrc + "/examples/tiny_gpt/model.onnx", {{"batch", 2}});
  EXPECT_TRUE(g) << g.message();
  if (!g) return nullptr;
  passes::PassContext ctx;
  ctx.options.mode = passes::Mode::train;
  ctx.options.loss.loss = "cross_entropy";
  Status s = passes::run_pipeline(**g, {"attach_loss", "autocast", "cast_simplify", "canonicalize"}, ctx);
  EXPECT_TRUE(s) << s.message();
  return std::move(*g);
}

}  // namespace

TEST(Autocast, TinyGptGoldenListing) {
  auto g = tiny_gpt_forward_bf16();
  ASSERT_TRUE(g);
  std::string got = listing(*g);
  std::string want = read_file(kSrc + "/tests/ir/autocast/tiny_gpt.expected");
  if (got != want) {
    std::ofstream(fs::temp_directory_path() / "tiny_gpt.autocast.actual") << got;
  }
  EXPECT_EQ(got, want) << "actual listing written to " << (fs::temp_directory_path() / "tiny_gpt.autocast.actual");
}

TEST(Autocast, TinyGptForwardPolicyInvariants) {
  auto g = tiny_gpt_forward_bf16();
  ASSERT_TRUE(g);
  int low = 0;
  for (auto& n : g->nodes()) {
    PrecisionPolicy p = policy(*n);
    if (p == PrecisionPolicy::low_precision) {
      ++low;
      for (Value* in : n->inputs)
        if (in && is_float(in->dtype)) {
          EXPECT_EQ(in->dtype, DType::bf16) << n->name;
        }
      EXPECT_EQ(n->outputs[0]->dtype, DType::bf16) << n->name;
    } else if (p == PrecisionPolicy::fp32) {
      for (Value* in : n->inputs)
        if (in && is_float(in->dtype)) {
          EXPECT_EQ(in->dtype, DType::f32) << n->name;
        }
    }
  }
  EXPECT_EQ(low, 2 * 6 + 1);  // per block: qkv, QK^T, AV, attn proj, fc, mlp proj; plus lm_head
  // Parameters stay f32 inputs; their bf16 copies are named "<param>.bf16".
  for (auto& sb : g->state)
    if (sb.kind == "parameter") {
      EXPECT_EQ(sb.input->dtype, DType::f32) << sb.input->name;
    }
  EXPECT_TRUE(g->find_value("transformer.h.0.attn.c_attn.weight.bf16"));
  EXPECT_EQ(g->find_value("loss")->dtype, DType::f32);
}

/// A --bf16 training config of examples/MODEL with `rows` rows per batch and `steps` steps.
runtime::TrainConfig bf16_config(const std::string& model, int64_t rows, int64_t steps) {
  runtime::TrainConfig cfg;
  cfg.model = kSrc + "/examples/" + model + "/model.onnx";
  cfg.per_device_train_batch_size = rows;
  cfg.per_device_eval_batch_size = rows;
  cfg.max_steps = steps;
  cfg.bf16 = true;
  return cfg;
}

/// The forward Gemms of the MLP (batch 32: 64->128, 128->128, 128->10) with --bf16 and
/// --autocast_min_flops `min_flops`: each one's FLOPs (2 M N K from its shapes) and
/// whether it computes in bf16.
std::vector<std::pair<double, bool>> mlp_gemm_precisions(double min_flops) {
  runtime::TrainConfig cfg = bf16_config("mlp_digits", 32, 1);
  cfg.autocast_min_flops = min_flops;
  auto prog = driver::build_training_program(cfg, nullptr, true);
  EXPECT_TRUE(prog) << prog.message();
  std::vector<std::pair<double, bool>> out;
  if (!prog) return out;
  for (auto& n : prog->train_step->nodes()) {
    if (n->op != "Gemm" || n->name.find("/grad/") != std::string::npos) continue;
    const Shape& a = n->inputs[0]->shape;
    const Shape& y = n->outputs[0]->shape;
    const double flops = 2.0 * y.dims[0].value * y.dims[1].value * a.dims[1].value;
    const bool low = n->inputs[0]->dtype == DType::bf16;
    EXPECT_EQ(low, n->inputs[1]->dtype == DType::bf16) << n->name;
    EXPECT_EQ(n->outputs[0]->dtype, low ? DType::bf16 : DType::f32) << n->name;
    EXPECT_EQ(n->attrs.has("kiln_autocast_kept"), !low) << n->name;
    if (!low) {
      EXPECT_DOUBLE_EQ(n->attrs.get_float("kiln_autocast_kept", -1), flops) << n->name;
    }
    out.push_back({flops, low});
  }
  EXPECT_EQ(out.size(), 3u);
  return out;
}

TEST(Autocast, ProductsBelowMinFlopsStayF32) {
  // 0.52, 1.05 and 0.08 MFLOP: a threshold of 0.6 MFLOP keeps the first and last in f32.
  for (auto [flops, low] : mlp_gemm_precisions(6e5)) EXPECT_EQ(low, flops >= 6e5) << flops;
  // 0: every product in bf16, as torch.autocast.
  for (auto [flops, low] : mlp_gemm_precisions(0)) EXPECT_TRUE(low) << flops;
  // -1 (the default): this CPU's modelled break-even.
  const double be = driver::autocast_break_even_flops(DType::bf16);
  EXPECT_GT(be, 0);
  for (auto [flops, low] : mlp_gemm_precisions(-1)) EXPECT_EQ(low, flops >= be) << flops;
  // --fp16: no product pays on this CPU (no oneDNN f16 kernels): all stay f32 by default.
  EXPECT_TRUE(std::isinf(driver::autocast_break_even_flops(DType::f16)));
  // Bad values are refused by the config check: negative, NaN, infinite, beyond 1e18, and
  // any value without --bf16 or --fp16.
  for (double v : {-2.0, std::nan(""), HUGE_VAL, 1e19}) {
    runtime::TrainConfig bad;
    bad.bf16 = true;
    bad.autocast_min_flops = v;
    EXPECT_FALSE(bad.validate().is_ok()) << v;
  }
  runtime::TrainConfig fp32;
  fp32.autocast_min_flops = 0;
  EXPECT_FALSE(fp32.validate().is_ok());
  fp32.autocast_min_flops = -1;
  EXPECT_TRUE(fp32.validate().is_ok()) << fp32.validate().message();
}

TEST(Autocast, ConvolutionsBelowTheirBreakEvenStoreBf16AndComputeF32) {
  // cnn_bn's convolutions (forward and both gradients) at batch 32 under --bf16, FLOPs from
  // their shapes (2 * N * M * C/G * kernel taps * output pixels), with the default
  // threshold (convolutions: autocast_break_even_flops(bf16, true)) and explicit ones. Rule
  // (d): every one stores bf16 (its output, so its saved activations); one below the
  // threshold is marked kiln_compute_f32 = its FLOPs (its kernel computes in f32) and
  // none is kept f32. Rule (e): a marked node reads parameters and graph inputs in f32
  // (no bf16 copy of the weights or the batch), an unmarked one reads bf16.
  const double conv_be = driver::autocast_break_even_flops(DType::bf16, true);
  EXPECT_GE(conv_be, driver::autocast_break_even_flops(DType::bf16, false));
  for (double min_flops : {-1.0, 0.0, 1e6}) {
    runtime::TrainConfig cfg = bf16_config("cnn_bn", 32, 1);
    cfg.autocast_min_flops = min_flops;
    auto prog = driver::build_training_program(cfg, nullptr, true);
    ASSERT_TRUE(prog) << prog.message();
    const Graph& g = *prog->train_step;
    const double threshold = min_flops < 0 ? conv_be : min_flops;
    std::set<const Value*> resident(g.inputs.begin(), g.inputs.end());
    int convs = 0, marked = 0;
    for (auto& n : g.nodes()) {
      if (n->op != "Conv" && n->op != "ConvGradInput" && n->op != "ConvGradWeight") continue;
      ++convs;
      // FLOPs from the (forward) convolution's shapes: x (N, C, ...), w (M, C/G, k...), y (N, M, o...).
      const bool fwd = n->op == "Conv", gi = n->op == "ConvGradInput";
      const Shape& x = fwd ? n->inputs[0]->shape : gi ? n->outputs[0]->shape : n->inputs[1]->shape;
      const Shape& w = fwd ? n->inputs[1]->shape : gi ? n->inputs[1]->shape : n->outputs[0]->shape;
      const Shape& y = fwd ? n->outputs[0]->shape : n->inputs[0]->shape;
      double flops = 2.0 * x.dims[0].value * w.dims[0].value;
      for (int i = 1; i < w.rank(); ++i) flops *= static_cast<double>(w.dims[i].value);
      for (int i = 2; i < y.rank(); ++i) flops *= static_cast<double>(y.dims[i].value);
      const bool below = flops < threshold;
      EXPECT_EQ(n->outputs[0]->dtype, DType::bf16) << n->name;
      EXPECT_FALSE(n->attrs.has("kiln_autocast_kept")) << n->name;
      EXPECT_EQ(n->attrs.has("kiln_compute_f32"), below)
          << n->name << ": " << flops << " FLOPs, threshold " << threshold;
      if (below) {
        ++marked;
        EXPECT_DOUBLE_EQ(n->attrs.get_float("kiln_compute_f32", -1), flops) << n->name;
      }
      for (const Value* in : n->inputs) {
        if (!in || !is_float(in->dtype)) continue;
        if (resident.count(in)) {
          EXPECT_TRUE(below) << n->name << " reads " << in->name << " in f32 unmarked";
        } else {
          EXPECT_EQ(in->dtype, DType::bf16) << n->name << " reads " << in->name;
        }
      }
    }
    EXPECT_EQ(convs, 5) << "cnn_bn: two convolutions, their weight gradients and the second one's input gradient";
    if (min_flops == 0) {
      EXPECT_EQ(marked, 0);
    } else if (min_flops == 1e6) {
      EXPECT_GT(marked, 0);
    }
  }
}

TEST(Autocast, Bf16TrainingStepKeepsMastersGradsAndOptimizerInF32) {
  runtime::TrainConfig cfg = bf16_config("tiny_gpt", 2, 2);
  // Every product in low precision (torch.autocast), whatever its size: the mechanism under test.
  cfg.autocast_min_flops = 0;
  auto prog = driver::build_training_program(cfg, nullptr, true);
  ASSERT_TRUE(prog) << prog.message();
  const Graph& t = *prog->train_step;
  int low = 0;
  for (auto& n : t.nodes())
    if (policy(*n) == PrecisionPolicy::low_precision) {
      ++low;
      for (Value* in : n->inputs)
        if (in && is_float(in->dtype)) {
          EXPECT_EQ(in->dtype, DType::bf16) << n->name;
        }
    }
  EXPECT_GT(low, 9);  // forward and backward MatMuls
  for (auto& sb : t.state) {
    if (sb.input->dtype == DType::i64) continue;
    EXPECT_EQ(sb.input->dtype, DType::f32) << sb.input->name;
    if (sb.output) {
      EXPECT_EQ(sb.output->dtype, DType::f32) << sb.output->name;
    }
  }
  for (auto& p : prog->parameters) {
    Value* gr = prog->grads->find_value(p + ".grad");
    ASSERT_TRUE(gr) << p;
    EXPECT_EQ(gr->dtype, DType::f32) << p;
  }
  EXPECT_EQ(t.find_value("loss")->dtype, DType::f32);
  // The eval graph runs autocast too and still returns f32 logits.
  for (Value* o : prog->eval->outputs) EXPECT_EQ(o->dtype, DType::f32) << o->name;
}

TEST(CastSimplify, RemovesRoundTripsAndDuplicates) {
  auto cast = [](Graph& g, Value* v, DType to, const std::string& name) {
    return g.add_node("Cast", name, {v}, {name + ".out"}, passes::make_attrs({{"to", int64_t(dtype_to_onnx(to))}}))
        ->outputs[0];
  };
  // x -> bf16 -> f32 -> Relu: the round trip goes, Relu reads x.
  {
    Graph g;
    Value* x = g.add_input("x", DType::f32, Shape::of({2, 3}));
    Value* z = cast(g, cast(g, x, DType::bf16, "down"), DType::f32, "up");
    Node* r = g.add_node("Relu", "relu", {z}, {"y"});
    g.outputs = {r->outputs[0]};
    ASSERT_TRUE(infer_graph(g));
    passes::PassContext ctx;
    ASSERT_TRUE(passes::run_pipeline(g, {"cast_simplify"}, ctx));
    EXPECT_EQ(g.nodes().size(), 1u);
    EXPECT_EQ(r->inputs[0], x);
  }
  // The bf16 value has another user: the f32 round trip is kept (it rounds).
  {
    Graph g;
    Value* x = g.add_input("x", DType::f32, Shape::of({2, 3}));
    Value* lo = cast(g, x, DType::bf16, "down");
    Value* z = cast(g, lo, DType::f32, "up");
    Node* r1 = g.add_node("Relu", "relu", {z}, {"y"});
    Node* r2 = g.add_node("Relu", "relu_lo", {lo}, {"y_lo"});
    g.outputs = {r1->outputs[0], r2->outputs[0]};
    ASSERT_TRUE(infer_graph(g));
    passes::PassContext ctx;
    ASSERT_TRUE(passes::run_pipeline(g, {"cast_simplify"}, ctx));
    EXPECT_EQ(g.nodes().size(), 4u);
    EXPECT_EQ(r1->inputs[0], z);
  }
  // Duplicate casts of x to bf16 merge; bf16 -> f32 -> bf16 is exact and goes.
  {
    Graph g;
    Value* x = g.add_input("x", DType::f32, Shape::of({2, 3}));
    Value* a = cast(g, x, DType::bf16, "a");
    Value* b = cast(g, x, DType::bf16, "b");
    Node* s = g.add_node("Add", "add", {a, b}, {"s"});
    Value* back = cast(g, cast(g, s->outputs[0], DType::f32, "w"), DType::bf16, "n");
    Node* r = g.add_node("Relu", "relu", {back}, {"y"});
    g.outputs = {r->outputs[0]};
    ASSERT_TRUE(infer_graph(g));
    passes::PassContext ctx;
    ASSERT_TRUE(passes::run_pipeline(g, {"cast_simplify"}, ctx));
    EXPECT_EQ(s->inputs[0], a);
    EXPECT_EQ(s->inputs[1], a);
    EXPECT_EQ(r->inputs[0], s->outputs[0]);
    EXPECT_EQ(g.nodes().size(), 3u);  // a, add, relu
  }
}

// ---- numerics through the kiln binary ----
namespace {

const std::string kBin = std::string(KILN_BINARY_DIR) + "/bin/kiln";

int kiln(const std::string& args, std::string* out) {
  std::string log = (fs::temp_directory_path() / ("kiln_autocast_" + std::to_string(::getpid()) + ".log")).string();
  std::string cmd = "cd '" + kSrc + "' && '" + kBin + "' " + args + " > '" + log + "' 2>&1";
  int st = std::system(cmd.c_str());
  *out = read_file(log);
  fs::remove(log);
  return WIFEXITED(st) ? WEXITSTATUS(st) : 128;
}

/// Mean of the last 20 per-step losses of a 200-step run.
double tail_loss(const std::string& args, const std::string& tag, int seed) {
  fs::path dir = fs::temp_directory_path() / ("kiln_autocast_" + tag + "_" + std::to_string(::getpid()));
  fs::remove_all(dir);
  std::string out;
  int rc =
      kiln(args + " --max_steps 200 --logging_steps 1 --seed " + std::to_string(seed) + " --output_dir " + dir.string(),
           &out);
  EXPECT_EQ(rc, 0) << out;
  std::map<int64_t, double> losses;
  std::ifstream f(dir / "metrics.jsonl");
  std::string line;
  while (std::getline(f, line)) {
    auto j = nlohmann::json::parse(line);
    if (j.contains("loss")) losses[j["step"].get<int64_t>()] = j["loss"].get<double>();
  }
  fs::remove_all(dir);
  EXPECT_EQ(losses.size(), 200u) << out;
  double s = 0;
  int k = 0;
  for (int64_t step = 181; step <= 200; ++step)
    if (losses.count(step)) s += losses[step], ++k;
  return k ? s / k : NAN;
}

/// Tail losses of fp32 and bf16 runs, each averaged over `seeds` (one run per seed and
/// precision; every seed's own gap is printed), must agree within 2%.
void compare_bf16(const std::string& args, const std::string& tag, const std::vector<int>& seeds = {7}) {
  if (!fs::exists(kSrc + "/data/digits/x_train.npy") || !fs::exists(kSrc + "/data/text/train.bin"))
    FAIL() << "data/ is missing: run tools/prepare_test_data.sh (tools/test.sh does)";
  double f32 = 0, bf = 0;
  for (int seed : seeds) {
    const double f = tail_loss(args, tag + "_f32", seed), b = tail_loss(args + " --bf16", tag + "_bf16", seed);
    std::cout << tag << " seed " << seed << ": fp32 tail loss " << f << ", bf16 " << b << ", gap "
              << std::fabs(b - f) / f * 100 << "%\n";
    f32 += f / seeds.size(), bf += b / seeds.size();
  }
  std::cout << tag << ": fp32 tail loss " << f32 << ", bf16 " << bf << ", gap " << std::fabs(bf - f32) / f32 * 100
            << "%\n";
  EXPECT_LT(std::fabs(bf - f32), 0.02 * std::fabs(f32)) << "fp32 " << f32 << " bf16 " << bf;
}

}  // namespace

TEST(Bf16Numerics, MlpDigits200StepsWithin2Percent) {
  compare_bf16(
      "train examples/mlp_digits/model.onnx --train_data input=data/digits/x_train.npy "
      "--train_data labels=data/digits/y_train.npy --per_device_train_batch_size 32 --learning_rate 2e-3",
      "mlp");
}

// 2 x 200 steps: about 17 s on an idle 2-core machine (minutes when it is shared).
// Measured gap 0.40% (fp32 3.2247, bf16 3.2374).
TEST(Bf16Numerics, TinyGpt200StepsWithin2Percent) {
  compare_bf16(
      "train examples/tiny_gpt/model.onnx --train_data data/text/train.bin --block_size 64 "
      "--per_device_train_batch_size 4 --learning_rate 3e-3",
      "gpt");
}

TEST(Bf16Numerics, CnnBn200StepsWithin2Percent) {
  compare_bf16(
      "train examples/cnn_bn/model.onnx --train_data input=data/digits/x_train_img.npy "
      "--train_data labels=data/digits/y_train.npy --per_device_train_batch_size 32 --learning_rate 2e-3",
      "cnn_bn");
}

// ResNet-18 at 32x32 on upsampled digits, batch 8, averaged over three seeds at lr 1e-4.
// With BatchNorm over 8 images its trajectory is chaotic: at lr 1e-3 two fp32 runs that
// differ only in summation order (1 or 2 threads, oneDNN limited to AVX2) end 0.58-0.67,
// +-7%, so one seed at that rate cannot resolve 2% (it passed on an AVX2 machine, 0.58%,
// and failed on an AVX-512 one, 2.39%, with native bf16 convolutions computing the same
// function). At lr 1e-4 the same perturbations move one seed's fp32 tail by up to 1%
// and the 3-seed bf16 gap measured 0.07-0.86% (docs/performance.md, issue 4); a bf16 run
// learning at half the rate ends about 11% higher and fails.
TEST(Bf16Numerics, ResNet18_200StepsWithin2Percent) {
  compare_bf16(
      "train examples/resnet18/model.onnx --train_data input=data/digits/x_train_rgb32.npy "
      "--train_data labels=data/digits/y_train.npy --per_device_train_batch_size 8 --learning_rate 1e-4",
      "resnet18", {7, 8, 9});
}
