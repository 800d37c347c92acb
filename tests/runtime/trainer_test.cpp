// Tests of the trainer on a hand-built training step (independent of the passes):
// a softmax-regression SGD-with-momentum step written as one test op. Checks the
// loss sequence against a float64 reference loop, metrics.jsonl keys and means,
// eval metrics, checkpoint round trip / atomic replacement / rotation, exact resume,
// unwritable output_dir, and the config (validate, JSON, HF step arithmetic).
#include "runtime/trainer.h"

#include <gtest/gtest.h>
#include <unistd.h>

#include <cmath>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <set>

#include "ir/op_table.h"
#include "runtime/checkpoint.h"
#include "runtime/interpreter.h"

using namespace kiln;
using namespace kiln::runtime;
using ir::DType;
using ir::Tensor;
namespace fs = std::filesystem;

namespace {

constexpr int64_t D = 3, C = 4, N = 22;

/// Deterministic "dropout-like" factor of (seed, step), so a wrong step index fed on
/// resume changes the result.
double step_factor(uint64_t seed, uint64_t step) {
  return 1.0 + 0.25 * static_cast<double>(mix_seed(seed, step) % 1000) / 1000.0;
}

/// One float64 reference step: softmax regression, mean CE, SGD with momentum,
/// linear lr decay over `total` steps. W, M: (D, C); x: (B, D); y: (B).
double ref_step(std::vector<double>& W, std::vector<double>& M, const std::vector<double>& x,
                const std::vector<int64_t>& y, double lr0, double mom, int64_t total, int64_t step, uint64_t seed,
                double* gnorm, double* lr_out) {
  const int64_t B = static_cast<int64_t>(y.size());
  std::vector<double> g(D * C, 0.0);
  double loss = 0;
  for (int64_t b = 0; b < B; ++b) {
    double z[C], mx = -1e300, s = 0;
    for (int64_t c = 0; c < C; ++c) {
      z[c] = 0;
      for (int64_t d = 0; d < D; ++d) z[c] += x[b * D + d] * W[d * C + c];
      mx = std::max(mx, z[c]);
    }
    for (int64_t c = 0; c < C; ++c) s += std::exp(z[c] - mx);
    loss += -(z[y[b]] - mx - std::log(s));
    for (int64_t c = 0; c < C; ++c) {
      double p = std::exp(z[c] - mx) / s - (c == y[b] ? 1.0 : 0.0);
      for (int64_t d = 0; d < D; ++d) g[d * C + c] += x[b * D + d] * p / B;
    }
  }
  double gn = 0;
  for (double v : g) gn += v * v;
  *gnorm = std::sqrt(gn);
  double lr = lr0 * (1.0 - static_cast<double>(step) / static_cast<double>(total)) * step_factor(seed, step);
  *lr_out = lr;
  for (int64_t i = 0; i < D * C; ++i) {
    M[i] = mom * M[i] + g[i];
    W[i] -= lr * M[i];
  }
  return loss / B;
}

std::vector<double> as_f64(const Tensor& t) {
  std::vector<double> v(t.numel());
  for (int64_t i = 0; i < t.numel(); ++i) v[i] = t.get_f64(i);
  return v;
}

void register_test_ops() {
  static bool done = false;
  if (done) return;
  done = true;
  auto& tab = ir::OpTable::get();
  ir::OpDef step;
  step.name = "KilnTestSoftmaxSGD";
  step.doc = "test only: one softmax-regression SGD-momentum step";
  step.min_inputs = step.max_inputs = 5;
  step.min_outputs = step.max_outputs = 6;
  step.attrs = {{"lr", ir::AttrKind::f}, {"momentum", ir::AttrKind::f}, {"total", ir::AttrKind::i}};
  step.onnx = false;
  step.infer = [](ir::InferContext& c) {
    for (int i = 0; i < 3; ++i) c.out[i] = {DType::f32, ir::Shape::of({})};
    c.out[3] = c.in[2];
    c.out[4] = c.in[3];
    c.out[5] = c.in[4];
    return Status::ok();
  };
  step.kernel = [](ir::KernelContext& k) {
    std::vector<double> W = as_f64(k.in(2)), M = as_f64(k.in(3)), x = as_f64(k.in(0));
    std::vector<int64_t> y = k.in(1).to_i64_vector();
    int64_t s = k.in(4).get_i64(0);
    if (static_cast<uint64_t>(s) != k.step) return k.fail("step counter and RunOptions.step disagree");
    double gn, lr;
    double loss = ref_step(W, M, x, y, k.attrs().get_float("lr", 0), k.attrs().get_float("momentum", 0),
                           k.attrs().get_int("total", 1), s, k.seed, &gn, &lr);
    k.out(0).set_f64(0, loss);
    k.out(1).set_f64(0, gn);
    k.out(2).set_f64(0, lr);
    for (int64_t i = 0; i < D * C; ++i) k.out(3).set_f64(i, W[i]), k.out(4).set_f64(i, M[i]);
    k.out(5).set_f64(0, static_cast<double>(s + 1));
    return Status::ok();
  };
  tab.add(step);
  ir::OpDef ev;
  ev.name = "KilnTestSoftmaxEval";
  ev.doc = "test only: softmax-regression loss and logits";
  ev.min_inputs = ev.max_inputs = 3;
  ev.min_outputs = ev.max_outputs = 2;
  ev.onnx = false;
  ev.infer = [](ir::InferContext& c) {
    c.out[0] = {DType::f32, ir::Shape::of({})};
    int64_t B = c.in[0].shape.dims[0].value;
    c.out[1] = {DType::f32, ir::Shape::of({B, C})};
    return Status::ok();
  };
  ev.kernel = [](ir::KernelContext& k) {
    std::vector<double> W = as_f64(k.in(2)), x = as_f64(k.in(0));
    std::vector<int64_t> y = k.in(1).to_i64_vector();
    const int64_t B = static_cast<int64_t>(y.size());
    double loss = 0;
    for (int64_t b = 0; b < B; ++b) {
      double z[C], mx = -1e300, s = 0;
      for (int64_t c = 0; c < C; ++c) {
        z[c] = 0;
        for (int64_t d = 0; d < D; ++d) z[c] += x[b * D + d] * W[d * C + c];
        mx = std::max(mx, z[c]);
        k.out(1).set_f64(b * C + c, z[c]);
      }
      for (int64_t c = 0; c < C; ++c) s += std::exp(z[c] - mx);
      loss += -(z[y[b]] - mx - std::log(s));
    }
    k.out(0).set_f64(0, loss / B);
    return Status::ok();
  };
  tab.add(ev);
}

Tensor initial_w() {
  Tensor w(DType::f32, {D, C});
  for (int64_t i = 0; i < D * C; ++i) w.data<float>()[i] = 0.1f * static_cast<float>((i * 7) % 5) - 0.2f;
  return w;
}

/// The hand-built program: train_step with state W (parameter), M (optimizer_state),
/// step (counter); eval with W as an input.
struct TestProgram {
  std::unique_ptr<ir::Graph> train, eval;
  TrainGraphs graphs() const { return {train.get(), eval.get(), {"x", "labels"}, "labels", "logits"}; }
};

TestProgram make_program(double lr, double mom, int64_t total, int64_t B) {
  register_test_ops();
  TestProgram p;
  p.train = std::make_unique<ir::Graph>();
  ir::Graph& g = *p.train;
  auto* x = g.add_input("x", DType::f32, ir::Shape::of({B, D}));
  auto* y = g.add_input("labels", DType::i64, ir::Shape::of({B}));
  auto* W = g.add_input("W", DType::f32, ir::Shape::of({D, C}));
  auto* M = g.add_input("M", DType::f32, ir::Shape::of({D, C}));
  auto* s = g.add_input("step", DType::i64, ir::Shape::of({}));
  ir::Attributes a;
  a.set("lr", lr);
  a.set("momentum", mom);
  a.set("total", total);
  ir::Node* n = g.add_node("KilnTestSoftmaxSGD", "sgd", {x, y, W, M, s},
                           {"loss", "grad_norm", "learning_rate", "W.next", "M.next", "step.next"}, a);
  EXPECT_TRUE(ir::infer_node(*n).is_ok());
  for (ir::Value* o : n->outputs) g.outputs.push_back(o);
  g.state.push_back({"parameter", W, n->output(3), std::make_shared<Tensor>(initial_w())});
  g.state.push_back({"optimizer_state", M, n->output(4), std::make_shared<Tensor>(Tensor(DType::f32, {D, C}))});
  g.state.push_back({"counter", s, n->output(5), std::make_shared<Tensor>(Tensor::scalar_i64(0))});

  p.eval = std::make_unique<ir::Graph>();
  ir::Graph& e = *p.eval;
  auto* ex = e.add_input("x", DType::f32, ir::Shape::of({2, D}));
  auto* ey = e.add_input("labels", DType::i64, ir::Shape::of({2}));
  auto* eW = e.add_input("W", DType::f32, ir::Shape::of({D, C}));
  ir::Node* en = e.add_node("KilnTestSoftmaxEval", "eval", {ex, ey, eW}, {"loss", "logits"});
  EXPECT_TRUE(ir::infer_node(*en).is_ok());
  e.outputs = {en->output(0), en->output(1)};
  return p;
}

struct Data {
  Tensor x, y;
};

Data make_data(int64_t n, uint64_t seed) {
  Data d{Tensor(DType::f32, {n, D}), Tensor(DType::i64, {n})};
  std::mt19937_64 rng(seed);
  std::normal_distribution<double> nd;
  for (int64_t i = 0; i < n; ++i) {
    int64_t label = static_cast<int64_t>(rng() % C);
    d.y.data<int64_t>()[i] = label;
    for (int64_t k = 0; k < D; ++k)
      d.x.data<float>()[i * D + k] = static_cast<float>(nd(rng) + (k == label % D ? 1.5 : 0));
  }
  return d;
}

std::vector<DataInputSpec> specs(int64_t B) {
  return {{"x", DType::f32, ir::Shape::of({B, D})}, {"labels", DType::i64, ir::Shape::of({B})}};
}

std::string tmpdir(const std::string& name) {
  auto p = fs::temp_directory_path() / ("kiln_trainer_test_" + name + "_" + std::to_string(getpid()));
  fs::remove_all(p);
  return p.string();
}

TrainConfig base_config(const std::string& out, int64_t B, int64_t max_steps) {
  TrainConfig c;
  c.output_dir = out;
  c.per_device_train_batch_size = B;
  c.per_device_eval_batch_size = 2;
  c.max_steps = max_steps;
  c.logging_steps = 2;
  c.seed = 1234;
  c.loss = "cross_entropy";
  return c;
}

std::vector<nlohmann::json> read_jsonl(const std::string& path) {
  std::vector<nlohmann::json> r;
  std::ifstream f(path);
  std::string line;
  while (std::getline(f, line))
    if (!line.empty()) r.push_back(nlohmann::json::parse(line));
  return r;
}

}  // namespace

TEST(Trainer, LossesMatchFloat64ReferenceLoop) {
  const int64_t B = 4, total = 12;  // 22 rows -> 5 steps/epoch, 12 steps span 3 epochs
  auto prog = make_program(0.5, 0.9, total, B);
  Data d = make_data(N, 5);
  auto ds = Dataset::from_arrays({{"x", "x.npy", d.x}, {"labels", "y.npy", d.y}}, specs(B), {});
  ASSERT_TRUE(ds) << ds.message();
  std::string out = tmpdir("ref");
  TrainConfig cfg = base_config(out, B, total);
  std::ostringstream log;
  auto res = train(cfg, prog.graphs(), *ds, nullptr, {&log, 0, true});
  ASSERT_TRUE(res) << res.message();
  ASSERT_EQ(res->step_losses.size(), static_cast<size_t>(total));
  // Reference: same order (perm of (seed, epoch)), float64 math, f32 state rounding.
  std::vector<double> W = as_f64(initial_w()), M(D * C, 0.0);
  for (int64_t k = 0; k < total; ++k) {
    auto perm = Dataset::epoch_permutation(N, cfg.seed, k / 5);
    std::vector<double> x;
    std::vector<int64_t> y;
    for (int64_t r = 0; r < B; ++r) {
      int64_t row = perm[(k % 5) * B + r];
      for (int64_t j = 0; j < D; ++j) x.push_back(d.x.data<float>()[row * D + j]);
      y.push_back(d.y.data<int64_t>()[row]);
    }
    double gn, lr;
    double loss = ref_step(W, M, x, y, 0.5, 0.9, total, k, cfg.seed, &gn, &lr);
    for (auto& v : W) v = static_cast<float>(v);  // the graph stores f32 state
    for (auto& v : M) v = static_cast<float>(v);
    EXPECT_NEAR(res->step_losses[k], loss, 1e-5 * std::max(1.0, std::fabs(loss))) << "step " << k;
  }
  EXPECT_EQ(res->global_step, total);
  EXPECT_NEAR(res->epoch, 12.0 / 5.0, 1e-12);
  EXPECT_NE(log.str().find("step 2/12 | epoch 0.40 | loss "), std::string::npos) << log.str();
  fs::remove_all(out);
}

TEST(Trainer, MetricsJsonlHasHfKeysAndMeans) {
  const int64_t B = 4;
  auto prog = make_program(0.3, 0.0, 6, B);
  Data d = make_data(N, 6), e = make_data(6, 7);
  auto ds = Dataset::from_arrays({{"x", "x.npy", d.x}, {"labels", "y.npy", d.y}}, specs(B), {});
  auto es = Dataset::from_arrays({{"x", "ex.npy", e.x}, {"labels", "ey.npy", e.y}}, specs(2), {});
  ASSERT_TRUE(ds && es);
  std::string out = tmpdir("metrics");
  TrainConfig cfg = base_config(out, B, 6);
  cfg.logging_steps = 3;
  cfg.eval_steps = 3;
  std::ostringstream log;
  auto res = train(cfg, prog.graphs(), *ds, &*es, {&log, 0, true});
  ASSERT_TRUE(res) << res.message();
  auto lines = read_jsonl(out + "/metrics.jsonl");
  int logs = 0, evals = 0;
  for (auto& j : lines) {
    if (j.contains("loss")) {
      for (const char* k : {"step", "epoch", "loss", "grad_norm", "learning_rate", "step_time_s", "samples_per_second"})
        EXPECT_TRUE(j.contains(k)) << k << " missing in " << j.dump();
      int64_t s = j["step"].get<int64_t>();
      double mean = (res->step_losses[s - 3] + res->step_losses[s - 2] + res->step_losses[s - 1]) / 3;
      EXPECT_NEAR(j["loss"].get<double>(), mean, 1e-12);
      EXPECT_NEAR(j["epoch"].get<double>(), s / 5.0, 1e-12);
      ++logs;
    }
    if (j.contains("eval_loss")) {
      EXPECT_TRUE(j.contains("eval_accuracy")) << j.dump();
      EXPECT_TRUE(j.contains("step") && j.contains("epoch"));
      double acc = j["eval_accuracy"].get<double>();
      EXPECT_GE(acc, 0.0);
      EXPECT_LE(acc, 1.0);
      ++evals;
    }
  }
  EXPECT_EQ(logs, 2);
  EXPECT_EQ(evals, 2);  // steps 3 and 6 (no duplicate final eval)
  ASSERT_TRUE(res->eval_metrics.count("eval_loss"));
  // eval_loss equals the float64 mean over the 3 sequential eval batches.
  std::vector<double> W = as_f64(res->weights.at("W"));
  double ref = 0;
  for (int64_t b = 0; b < 3; ++b) {
    double sum = 0;
    for (int64_t r = b * 2; r < b * 2 + 2; ++r) {
      double z[C], mx = -1e300, s = 0;
      for (int64_t c = 0; c < C; ++c) {
        z[c] = 0;
        for (int64_t k = 0; k < D; ++k) z[c] += e.x.data<float>()[r * D + k] * W[k * C + c];
        mx = std::max(mx, z[c]);
      }
      for (int64_t c = 0; c < C; ++c) s += std::exp(z[c] - mx);
      sum += -(z[e.y.data<int64_t>()[r]] - mx - std::log(s));
    }
    ref += static_cast<double>(static_cast<float>(sum / 2)) / 3;
  }
  EXPECT_NEAR(res->eval_metrics["eval_loss"], ref, 1e-6);
  fs::remove_all(out);
}

TEST(Checkpoint, RoundTripAtomicReplaceAndRotation) {
  std::string out = tmpdir("ckpt");
  fs::create_directories(out);
  Checkpoint c;
  c.model["W"] = initial_w();
  c.optimizer["step"] = Tensor::scalar_i64(7);
  c.state.global_step = 7;
  c.state.epoch = 1.4;
  c.state.steps_per_epoch = 5;
  c.state.rows_per_step = 4;
  c.state.seed = 99;
  c.state.log_loss_sum = 1.5;
  c.state.log_loss_count = 1;
  c.state.config_json = config_to_json(TrainConfig{});
  // A leftover .tmp of a crashed save is not a checkpoint and is replaced.
  fs::create_directories(out + "/checkpoint-7.tmp");
  std::ofstream(out + "/checkpoint-7.tmp/garbage") << "x";
  ASSERT_TRUE(save_checkpoint(out + "/checkpoint-7", c).is_ok());
  EXPECT_FALSE(fs::exists(out + "/checkpoint-7.tmp"));
  auto l = load_checkpoint(out + "/checkpoint-7");
  ASSERT_TRUE(l) << l.message();
  EXPECT_EQ(as_f64(l->model.at("W")), as_f64(c.model["W"]));
  EXPECT_EQ(l->optimizer.at("step").get_i64(0), 7);
  EXPECT_EQ(l->state.global_step, 7);
  EXPECT_EQ(l->state.steps_per_epoch, 5);
  EXPECT_EQ(l->state.seed, 99u);
  EXPECT_DOUBLE_EQ(l->state.log_loss_sum, 1.5);
  auto cfg_json = nlohmann::json::parse(l->state.config_json);
  EXPECT_EQ(cfg_json["optim"], "adamw_torch");
  // Overwriting an existing checkpoint replaces it completely.
  c.optimizer["step"] = Tensor::scalar_i64(8);
  ASSERT_TRUE(save_checkpoint(out + "/checkpoint-7", c).is_ok());
  EXPECT_EQ(load_checkpoint(out + "/checkpoint-7")->optimizer.at("step").get_i64(0), 8);
  EXPECT_FALSE(fs::exists(out + "/checkpoint-7/garbage"));
  EXPECT_FALSE(fs::exists(out + "/checkpoint-7.tmp"));  // the old one, swapped out and deleted
  EXPECT_FALSE(fs::exists(out + "/checkpoint-7.old"));
  // A save that fails (here a tensor it cannot write) removes its .tmp and keeps the
  // checkpoint of that name as it was.
  Checkpoint broken = c;
  broken.optimizer["__metadata__"] = Tensor::scalar_i64(1);
  Status failed = save_checkpoint(out + "/checkpoint-7", broken);
  ASSERT_FALSE(failed.is_ok());
  EXPECT_NE(failed.message().find("checkpoint '" + out + "/checkpoint-7' not saved: "), std::string::npos)
      << failed.message();
  EXPECT_NE(failed.message().find("; the previous checkpoints are kept"), std::string::npos) << failed.message();
  EXPECT_FALSE(fs::exists(out + "/checkpoint-7.tmp"));
  EXPECT_EQ(load_checkpoint(out + "/checkpoint-7")->optimizer.at("step").get_i64(0), 8);
  // Rotation keeps the newest.
  for (int s : {2, 12, 30}) ASSERT_TRUE(save_checkpoint(out + "/checkpoint-" + std::to_string(s), c).is_ok());
  ASSERT_TRUE(rotate_checkpoints(out, 2).is_ok());
  auto left = list_checkpoints(out);
  ASSERT_EQ(left.size(), 2u);
  EXPECT_EQ(left[0].first, 12);
  EXPECT_EQ(left[1].first, 30);
  for (int s : {2, 7}) EXPECT_FALSE(fs::exists(out + "/checkpoint-" + std::to_string(s) + ".tmp"));
  // Missing files are named.
  fs::remove(out + "/checkpoint-30/optimizer.safetensors");
  auto bad = load_checkpoint(out + "/checkpoint-30");
  ASSERT_FALSE(bad);
  EXPECT_NE(bad.message().find("optimizer.safetensors"), std::string::npos);
  fs::remove_all(out);
}

TEST(Trainer, ResumeReproducesUninterruptedRunExactly) {
  const int64_t B = 4, total = 12;
  auto prog = make_program(0.4, 0.8, total, B);
  Data d = make_data(N, 8);
  auto ds = Dataset::from_arrays({{"x", "x.npy", d.x}, {"labels", "y.npy", d.y}}, specs(B), {});
  ASSERT_TRUE(ds);
  std::string a = tmpdir("resume_a"), b = tmpdir("resume_b");
  TrainConfig cfg = base_config(a, B, total);
  cfg.logging_steps = 3;  // checkpoint at 7 falls inside a logging interval
  cfg.save_steps = 7;
  cfg.save_total_limit = 1;
  std::ostringstream la, lb;
  auto ra = train(cfg, prog.graphs(), *ds, nullptr, {&la, 0, true});
  ASSERT_TRUE(ra) << ra.message();
  ASSERT_TRUE(fs::exists(a + "/checkpoint-7/trainer_state.json"));
  TrainConfig cb = cfg;
  cb.output_dir = b;
  cb.resume_from_checkpoint = a + "/checkpoint-7";
  auto rb = train(cb, prog.graphs(), *ds, nullptr, {&lb, 0, true});
  ASSERT_TRUE(rb) << rb.message();
  ASSERT_EQ(rb->step_losses.size(), 5u);
  for (int k = 0; k < 5; ++k) EXPECT_EQ(rb->step_losses[k], ra->step_losses[7 + k]) << "step " << 7 + k;
  EXPECT_EQ(as_f64(rb->weights.at("W")), as_f64(ra->weights.at("W")));
  EXPECT_EQ(rb->train_loss, ra->train_loss);
  // The logged mean at step 9 spans steps 7..9, across the checkpoint.
  auto la_lines = read_jsonl(a + "/metrics.jsonl"), lb_lines = read_jsonl(b + "/metrics.jsonl");
  auto at9 = [](const std::vector<nlohmann::json>& v) {
    for (auto& j : v)
      if (j.contains("loss") && j["step"] == 9) return j["loss"].get<double>();
    return -1.0;
  };
  EXPECT_EQ(at9(la_lines), at9(lb_lines));
  // A checkpoint from another data layout is refused.
  TrainConfig cc = cb;
  cc.per_device_train_batch_size = 2;
  auto prog2 = make_program(0.4, 0.8, total, 2);
  auto ds2 = Dataset::from_arrays({{"x", "x.npy", d.x}, {"labels", "y.npy", d.y}}, specs(2), {});
  auto rc = train(cc, prog2.graphs(), *ds2, nullptr, {&lb, 0, true});
  ASSERT_FALSE(rc);
  EXPECT_NE(rc.message().find("steps per epoch"), std::string::npos) << rc.message();
  fs::remove_all(a);
  fs::remove_all(b);
}

TEST(Trainer, UnwritableOutputDirFailsBeforeTraining) {
  auto prog = make_program(0.1, 0.0, 2, 4);
  Data d = make_data(N, 9);
  auto ds = Dataset::from_arrays({{"x", "x.npy", d.x}, {"labels", "y.npy", d.y}}, specs(4), {});
  TrainConfig cfg = base_config("/proc/kiln_test", 4, 2);
  std::ostringstream log;
  auto r = train(cfg, prog.graphs(), *ds, nullptr, {&log, 0, true});
  ASSERT_FALSE(r);
  EXPECT_NE(r.message().find("output_dir '/proc/kiln_test'"), std::string::npos) << r.message();
  EXPECT_EQ(log.str().find("step "), std::string::npos) << "trained before failing";
}

TEST(Trainer, TooLittleDataIsAnError) {
  auto prog = make_program(0.1, 0.0, 2, 4);
  Data d = make_data(3, 9);
  auto ds = Dataset::from_arrays({{"x", "x.npy", d.x}, {"labels", "y.npy", d.y}}, specs(4), {});
  ASSERT_TRUE(ds);
  auto t = Trainer::create(base_config(tmpdir("small"), 4, 2), prog.graphs(), &*ds, nullptr);
  ASSERT_FALSE(t);
  EXPECT_NE(t.message().find("fewer than one step"), std::string::npos) << t.message();
}

TEST(TrainConfig, ValidateNamesOptionAndValue) {
  TrainConfig c;
  EXPECT_TRUE(c.validate().is_ok());
  c.optim = "foo";
  EXPECT_NE(c.validate().message().find("--optim: unknown value 'foo'"), std::string::npos) << c.validate().message();
  c.optim = "adamw_8bit";
  EXPECT_TRUE(c.validate().is_ok()) << c.validate().message();
  c = TrainConfig{};
  c.accumulation_normalization = "rows";
  EXPECT_NE(c.validate().message().find("--accumulation_normalization: unknown value 'rows'"), std::string::npos)
      << c.validate().message();
  c = TrainConfig{};
  c.loss = "mse";
  c.accumulation_normalization = "tokens";
  EXPECT_NE(c.validate().message().find("needs --loss cross_entropy"), std::string::npos) << c.validate().message();
  c = TrainConfig{};
  c.per_device_train_batch_size = 0;
  EXPECT_NE(c.validate().message().find("per_device_train_batch_size"), std::string::npos);
  c = TrainConfig{};
  c.lr_scheduler_type = "exp";
  EXPECT_NE(c.validate().message().find("lr_scheduler_type"), std::string::npos);
  c = TrainConfig{};
  c.loss = "hinge";
  EXPECT_NE(c.validate().message().find("--loss"), std::string::npos);
  // Options of a mode that is off (were silently ignored).
  c = TrainConfig{};
  c.fp16_init_scale = 1024;
  EXPECT_NE(c.validate().message().find("--fp16_init_scale: only applies with --fp16"), std::string::npos)
      << c.validate().message();
  c.fp16 = true;
  EXPECT_TRUE(c.validate().is_ok()) << c.validate().message();
  c = TrainConfig{};
  c.fp16_growth_interval = 100;
  EXPECT_NE(c.validate().message().find("--fp16_growth_interval: only applies with --fp16"), std::string::npos);
  c = TrainConfig{};
  c.momentum = 0.9;
  EXPECT_NE(c.validate().message().find("--momentum: only applies to --optim sgd"), std::string::npos)
      << c.validate().message();
  c.optim = "sgd";
  EXPECT_TRUE(c.validate().is_ok()) << c.validate().message();
}

TEST(TrainConfig, HfStepArithmetic) {
  TrainConfig c;
  c.num_train_epochs = 3;
  EXPECT_EQ(c.total_steps(10), 30);
  c.num_train_epochs = 2.5;
  EXPECT_EQ(c.total_steps(3), 8);  // ceil(7.5)
  c.max_steps = 5;
  EXPECT_EQ(c.total_steps(100), 5);
  c.warmup_ratio = 0.1;
  EXPECT_EQ(c.warmup(25), 3);  // ceil(2.5)
  c.warmup_steps = 7;
  EXPECT_EQ(c.warmup(25), 7);  // warmup_steps wins when > 0
}

TEST(TrainConfig, JsonUnknownKeyTypesAndRoundTrip) {
  TrainConfig c;
  Status s = config_from_json_text(R"({"learning_rate": 0.001, "lerning_rate": 1})", "cfg.json", c);
  ASSERT_FALSE(s.is_ok());
  EXPECT_NE(s.message().find("cfg.json: unknown key 'lerning_rate'"), std::string::npos) << s.message();
  TrainConfig d;
  s = config_from_json_text(R"({"per_device_train_batch_size": "8"})", "cfg.json", d);
  EXPECT_NE(s.message().find("per_device_train_batch_size"), std::string::npos);
  TrainConfig e;
  ASSERT_TRUE(config_from_json_text(
                  R"({"learning_rate": 0.001, "bf16": true, "train_data": ["x=a.npy", "labels=b.npy"],
                      "shape": {"batch": 8}, "num_train_epochs": 2, "seed": 7})",
                  "cfg.json", e)
                  .is_ok());
  EXPECT_DOUBLE_EQ(e.learning_rate, 0.001);
  EXPECT_TRUE(e.bf16);
  EXPECT_EQ(e.train_data.size(), 2u);
  EXPECT_EQ(e.shape.at("batch"), 8);
  EXPECT_DOUBLE_EQ(e.num_train_epochs, 2.0);
  TrainConfig f;
  ASSERT_TRUE(config_from_json_text(config_to_json(e), "roundtrip", f).is_ok());
  EXPECT_EQ(config_to_json(f), config_to_json(e));
  // Flag-style setters report bad values.
  TrainConfig g;
  for (auto& fld : config_fields(g))
    if (fld.name == "learning_rate") {
      Status bad = set_config_field(fld, "abc");
      EXPECT_NE(bad.message().find("--learning_rate: expected a number, got 'abc'"), std::string::npos);
      EXPECT_TRUE(set_config_field(fld, "3e-4").is_ok());
    }
  EXPECT_DOUBLE_EQ(g.learning_rate, 3e-4);
}

TEST(Trainer, EvalGraphWithParameterInitializersSeesTrainedWeights) {
  const int64_t B = 4;
  auto prog = make_program(0.3, 0.0, 6, B);
  // Same eval, but W is an initializer holding the *initial* weights.
  auto eval2 = std::make_unique<ir::Graph>();
  auto* ex = eval2->add_input("x", DType::f32, ir::Shape::of({2, D}));
  auto* ey = eval2->add_input("labels", DType::i64, ir::Shape::of({2}));
  auto* eW = eval2->add_initializer("W", initial_w());
  ir::Node* en = eval2->add_node("KilnTestSoftmaxEval", "eval", {ex, ey, eW}, {"loss", "logits"});
  ASSERT_TRUE(ir::infer_node(*en).is_ok());
  eval2->outputs = {en->output(0), en->output(1)};
  Data d = make_data(N, 6), e = make_data(6, 7);
  auto ds = Dataset::from_arrays({{"x", "x.npy", d.x}, {"labels", "y.npy", d.y}}, specs(B), {});
  auto es = Dataset::from_arrays({{"x", "ex.npy", e.x}, {"labels", "ey.npy", e.y}}, specs(2), {});
  std::ostringstream log;
  TrainGraphs g1 = prog.graphs(), g2 = prog.graphs();
  g2.eval = eval2.get();
  auto r1 = train(base_config(tmpdir("ev1"), B, 6), g1, *ds, &*es, {&log, 0, false});
  auto r2 = train(base_config(tmpdir("ev2"), B, 6), g2, *ds, &*es, {&log, 0, false});
  ASSERT_TRUE(r1 && r2) << r1.message() << r2.message();
  EXPECT_EQ(r1->eval_metrics.at("eval_loss"), r2->eval_metrics.at("eval_loss"));
  // The caller's graph keeps its initial weights.
  EXPECT_EQ(as_f64(*eW->data), as_f64(initial_w()));
}

// A hand-edited trainer_state.json: each bad field is named (1e30 was "negative
// global_step", 10.7 was truncated to 10, a string gave nlohmann's type error, and a
// config that is not an object silently turned the resume's flag comparison off).
TEST(Checkpoint, MalformedTrainerStateNamesTheField) {
  const nlohmann::json good = nlohmann::json::parse(
      R"({"global_step": 10, "epoch": 0.5, "total_steps": 20,
          "data": {"seed": 42, "steps_per_epoch": 20, "rows_per_step": 8},
          "log_accumulators": {"loss_sum": 1.5, "loss_count": 3, "time_sum": 0.1, "total_loss_sum": 9.0},
          "config": {"learning_rate": 0.001}})");
  auto ok = trainer_state_from_json(good, "t.json");
  ASSERT_TRUE(ok) << ok.message();
  EXPECT_EQ(ok->global_step, 10);
  EXPECT_EQ(ok->seed, 42u);
  EXPECT_EQ(ok->log_loss_count, 3);
  struct Case {
    const char* pointer;
    nlohmann::json value;
    const char* message;
  };
  const std::vector<Case> cases = {
      {"/global_step", 1e30, "'global_step' must be a non-negative integer, got 1e+30"},
      {"/global_step", 10.7, "'global_step' must be a non-negative integer, got 10.7"},
      {"/global_step", -1, "'global_step' must be a non-negative integer, got -1"},
      {"/global_step", "ten", "'global_step' must be a non-negative integer"},
      {"/data/seed", "x", "'data.seed' must be a non-negative integer"},
      {"/data/rows_per_step", 8.5, "'data.rows_per_step' must be a non-negative integer"},
      {"/log_accumulators/loss_sum", "1", "'log_accumulators.loss_sum' must be a number"},
      {"/config", "hello", "'config' must be an object"},
      {"/data", 3, "'data' must be an object"},
      // The run's flags are type-checked too (a string "7" for the seed was warned about
      // as a change from 7).
      {"/config/learning_rate", "x", "'config.learning_rate' must be a number"},
      {"/config/seed", "7", "'config.seed' must be a non-negative integer"},
      {"/config/bf16", "yes", "'config.bf16' must be true or false"},
      {"/config/freeze", nullptr, "'config.freeze' must be a string, got null"},
      {"/config/train_data", "x.npy", "'config.train_data' must be a list of strings"},
  };
  for (const Case& c : cases) {
    nlohmann::json j = good;
    j[nlohmann::json::json_pointer(c.pointer)] = c.value;
    auto r = trainer_state_from_json(j, "t.json");
    ASSERT_FALSE(r) << c.pointer;
    EXPECT_NE(r.message().find(c.message), std::string::npos) << c.pointer << ": " << r.message();
    EXPECT_EQ(r.message().rfind("t.json: malformed trainer state", 0), 0u) << r.message();
  }
}

// Flag values as Hugging Face's argparse reads them, and the hints for unknown names
// (a value-taking flag without its value took the next flag: "--output_dir --bf16"
// trained in fp32 into "./--bf16"; "--bf16 True" was refused; --fp32 suggested --fp16).
TEST(TrainConfig, FlagValuesAndUnknownFlagHints) {
  const std::set<std::string> values = {"output_dir", "learning_rate", "seed"}, switches = {"bf16"};
  std::vector<std::string> a = {"--bf16", "True", "--output_dir", "out", "--learning_rate", "-1e-3"};
  ASSERT_TRUE(normalize_flag_values(a, values, switches).is_ok());
  EXPECT_EQ(a, (std::vector<std::string>{"--bf16=True", "--output_dir", "out", "--learning_rate", "-1e-3"}));
  std::vector<std::string> b = {"--output_dir", "--bf16"};
  Status sb = normalize_flag_values(b, values, switches);
  ASSERT_FALSE(sb.is_ok());
  EXPECT_NE(sb.message().find("--output_dir needs a value (the next argument is the flag --bf16)"), std::string::npos)
      << sb.message();
  std::vector<std::string> c = {"--seed"};
  EXPECT_FALSE(normalize_flag_values(c, values, switches).is_ok());
  std::vector<std::string> d = {"--bf16", "maybe"};  // not a boolean word: left to the parser
  ASSERT_TRUE(normalize_flag_values(d, values, switches).is_ok());
  EXPECT_EQ(d.size(), 2u);
  std::vector<std::string> y = {"--bf16", "Yes", "--bf16", "n"};  // HF's string_to_bool words, any case
  ASSERT_TRUE(normalize_flag_values(y, values, switches).is_ok());
  EXPECT_EQ(y, (std::vector<std::string>{"--bf16=Yes", "--bf16=n"}));
  // A single-dash option of the command after a value flag is a flag ("--output_dir -h"
  // trained into a folder named -h; "-o --bf16" linked into one named --bf16); other
  // single-dash words are values (a --freeze regex "-foo", a number).
  const std::set<std::string> with_o = {"output_dir", "o"}, shorts = {"h", "o"};
  std::vector<std::string> e = {"--output_dir", "-h"};
  EXPECT_FALSE(normalize_flag_values(e, with_o, switches, shorts).is_ok());
  std::vector<std::string> f = {"-o", "--bf16"};
  EXPECT_FALSE(normalize_flag_values(f, with_o, switches, shorts).is_ok());
  std::vector<std::string> g = {"--output_dir", "-foo", "-o", "-1"};
  EXPECT_TRUE(normalize_flag_values(g, with_o, switches, shorts).is_ok());

  const std::set<std::string> known = {"fp16", "learning_rate", "per_device_train_batch_size", "label_smoothing",
                                       "eps"};
  EXPECT_NE(unknown_flag_hint("eval_strategy", known).find("a Hugging Face flag kiln does not take"),
            std::string::npos);
  EXPECT_NE(unknown_flag_hint("fp32", known).find("kiln trains in fp32 unless --bf16 or --fp16"), std::string::npos);
  EXPECT_EQ(unknown_flag_hint("lr", known), "did you mean --learning_rate?");
  EXPECT_EQ(unknown_flag_hint("bs", known), "did you mean --per_device_train_batch_size?");
  EXPECT_EQ(unknown_flag_hint("label_smoothing_factor", known), "did you mean --label_smoothing?");
  EXPECT_EQ(unknown_flag_hint("learning_rte", known), "did you mean --learning_rate?");
  EXPECT_EQ(unknown_flag_hint("fp61", known), "");  // two edits from fp16: too far for a short name
  EXPECT_EQ(unknown_flag_hint("frobnicate", known), "");
  // Aliases only point at flags the command takes.
  EXPECT_EQ(unknown_flag_hint("lr", {"eps"}), "");
  EXPECT_EQ(unknown_flag_message({"--max_steps", "3", "-lr", "1e-3"}, {"max_steps", "learning_rate"}),
            "unknown flag -lr (did you mean --learning_rate?)");
  EXPECT_EQ(unknown_flag_message({"--max_steps", "-3"}, {"max_steps"}), "");  // a negative number is a value
  // Equally near names are all given (--f16 suggested --bf16 alone); two-letter names never.
  EXPECT_EQ(unknown_flag_hint("f16", {"bf16", "fp16", "h"}), "did you mean --bf16 or --fp16?");
  EXPECT_EQ(unknown_flag_hint("x", {"h", "o"}), "");
  EXPECT_EQ(unknown_flag_hint("per-device-train-batch-size", known), "did you mean --per_device_train_batch_size?");
  EXPECT_EQ(unknown_flag_hint("lr", known, /*as_key=*/true), "did you mean 'learning_rate'?");
  EXPECT_NE(unknown_flag_hint("do_eval", known).find("kiln train evaluates when --eval_data is given"),
            std::string::npos);
  // The value of a known flag is skipped ("--freeze -lr --bogus 1" named -lr).
  const std::set<std::string> vf = {"freeze"};
  EXPECT_EQ(unknown_flag_message({"--freeze", "-lr", "--bogus", "1"}, {"freeze", "learning_rate"}, nullptr, &vf),
            "unknown flag --bogus (--help lists the flags)");
}
