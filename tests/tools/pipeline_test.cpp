// Typed pass options and the declarative training pipeline (tools/driver/pipeline.h):
// the table resolves per option set, every pass it names is registered, an unknown pass
// name is refused before anything runs, `kiln inspect --pipeline` lists the passes in
// order with the options they read, and the trainer reads its batch shapes from the
// program's signature rather than the flags.
#include "tools/driver/pipeline.h"

#include <gtest/gtest.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <map>
#include <sstream>

#include "ir/graph.h"
#include "passes/pass.h"
#include "runtime/data.h"
#include "runtime/program.h"
#include "runtime/trainer.h"
#include "tools/driver/driver.h"
#include "tools/driver/train_run.h"

using namespace kiln;
namespace fs = std::filesystem;
using Names = std::vector<std::string>;

namespace {

const std::string kSrc = KILN_SOURCE_DIR;
const std::string kBin = std::string(KILN_BINARY_DIR) + "/bin/kiln";
const std::string kMlp = "examples/mlp_digits/model.onnx";

struct CmdResult {
  int code;
  std::string out;  ///< stdout and stderr
};

/// Runs kiln from the source directory.
CmdResult kiln_cmd(const std::string& args) {
  const std::string log =
      (fs::temp_directory_path() / ("kiln_pipeline_" + std::to_string(::getpid()) + ".log")).string();
  const std::string cmd = "cd '" + kSrc + "' && '" + kBin + "' " + args + " > '" + log + "' 2>&1";
  const int st = std::system(cmd.c_str());
  std::stringstream ss;
  ss << std::ifstream(log).rdbuf();
  fs::remove(log);
  return {WIFEXITED(st) ? WEXITSTATUS(st) : 128, ss.str()};
}

/// Every pass of `p`, stage after stage.
Names passes_of(const driver::ProgramPipeline& p) {
  Names v;
  for (const auto& s : p.stages) v.insert(v.end(), s.passes.begin(), s.passes.end());
  return v;
}

const Names kLowering = {"gemm_widening", "absorb_transpose", "decompose",    "cse",
                         "fusion",        "fused_inplace",    "multi_tensor", "arena_plan"};

Names concat(Names a, const Names& b) {
  a.insert(a.end(), b.begin(), b.end());
  return a;
}

}  // namespace

TEST(Pipeline, TableResolvesPerOptions) {
  driver::PipelineOptions o;  // fp32, eager, no remat
  driver::Pipeline p = driver::training_pipeline(o);
  EXPECT_EQ(passes_of(p.train), (Names{"fold_constants", "canonicalize", "attach_loss", "autodiff", "canonicalize",
                                       "optimizer", "accumulation", "canonicalize"}));
  EXPECT_EQ(passes_of(p.grads), (Names{"accumulation", "canonicalize"}));
  EXPECT_EQ(p.grads.after_stage, "step");
  EXPECT_EQ(passes_of(p.eval), (Names{"fold_constants", "canonicalize", "attach_loss", "canonicalize"}));
  EXPECT_EQ(p.train.options.mode, passes::Mode::train);
  EXPECT_EQ(p.eval.options.mode, passes::Mode::eval);
  EXPECT_EQ(p.train.options.autodiff.loss_output, "loss");

  o.fp16 = true;
  o.compiled = true;
  o.to_f64 = true;
  o.passes.remat.policy = "blocks";
  p = driver::training_pipeline(o);
  EXPECT_EQ(passes_of(p.train),
            concat({"fold_constants", "canonicalize", "to_float64", "attach_loss", "autocast", "cast_simplify",
                    "loss_scale", "autodiff", "grad_unscale", "autocast_grad", "cast_simplify", "remat", "canonicalize",
                    "optimizer", "grad_scaler_update", "accumulation", "canonicalize"},
                   kLowering));
  EXPECT_EQ(p.train.stage("lowering"), kLowering);
  EXPECT_EQ(passes_of(p.eval), concat({"fold_constants", "canonicalize", "to_float64", "attach_loss", "autocast",
                                       "cast_simplify", "canonicalize"},
                                      kLowering));
  EXPECT_EQ(p.train.options.autodiff.loss_output, "loss.scaled");
  // The eval and gradient programs are built without the debugging switches.
  for (const auto& s : p.eval.stages) EXPECT_FALSE(s.debug) << s.name;
  for (const auto& s : p.grads.stages) EXPECT_FALSE(s.debug) << s.name;
  EXPECT_EQ(driver::compiled_pipeline(), kLowering);
}

TEST(Pipeline, EveryPassOfTheTableIsRegistered) {
  for (int bits = 0; bits < 32; ++bits) {
    driver::PipelineOptions o;
    o.bf16 = bits & 1;
    o.fp16 = bits & 2;
    o.compiled = bits & 4;
    o.to_f64 = bits & 8;
    o.passes.remat.policy = bits & 16 ? "sqrt" : "none";
    const driver::Pipeline p = driver::training_pipeline(o);
    for (const auto* q : {&p.train, &p.grads, &p.eval})
      for (const std::string& name : passes_of(*q)) EXPECT_NE(passes::make_pass(name), nullptr) << name;
  }
}

TEST(Pipeline, OptionsComeFromTheConfig) {
  runtime::TrainConfig cfg;
  cfg.backend = "compiled";
  cfg.fp16 = true;
  cfg.optim = "sgd";
  cfg.momentum = 0.9;
  cfg.nesterov = true;
  cfg.learning_rate = 0.1;
  cfg.lr_scheduler_type = "cosine";
  cfg.warmup_steps = 3;
  cfg.gradient_accumulation_steps = 4;
  cfg.remat_policy = "budget";
  cfg.memory_budget = "2KiB";
  cfg.fp16_init_scale = 1024;
  cfg.label_input = "";
  const driver::PipelineOptions o = driver::pipeline_options(cfg, 50);
  EXPECT_TRUE(o.fp16 && o.compiled && !o.bf16);
  EXPECT_EQ(o.passes.optimizer.optim, "sgd");
  EXPECT_EQ(o.passes.optimizer.momentum, 0.9);
  EXPECT_TRUE(o.passes.optimizer.nesterov);
  EXPECT_EQ(o.passes.optimizer.learning_rate, 0.1);
  EXPECT_EQ(o.passes.optimizer.lr_scheduler_type, "cosine");
  EXPECT_EQ(o.passes.optimizer.total_steps, 50);
  EXPECT_EQ(o.passes.optimizer.warmup_steps, 3);
  EXPECT_EQ(o.passes.accumulation.gradient_accumulation_steps, 4);
  EXPECT_EQ(o.passes.remat.policy, "budget");
  ASSERT_TRUE(o.passes.remat.memory_budget.has_value());
  EXPECT_EQ(*o.passes.remat.memory_budget, 2048);
  EXPECT_EQ(o.passes.autocast.dtype, ir::DType::f16);
  EXPECT_EQ(o.passes.grad_scaler.init_scale, 1024.0);
  EXPECT_EQ(o.passes.loss.label_input, "labels");
  EXPECT_TRUE(o.passes.lowering.widen_f16_gemm);
  // The options a pass reads are what inspect --pipeline prints for it.
  EXPECT_NE(passes::make_pass("optimizer")->describe_options(o.passes).find("optim=sgd learning_rate=0.1 momentum=0.9"),
            std::string::npos);
}

TEST(Pipeline, UnknownPassNameIsRefusedBeforeAnythingRuns) {
  ir::Graph g;
  ir::Value* x = g.add_input("x", ir::DType::f32, ir::Shape::of({2}));
  ir::Node* n = g.add_node("Identity", "id", {x}, {"y"});
  g.outputs = {n->outputs[0]};
  passes::PassContext ctx;
  Status st = passes::run_pipeline(g, {"canonicalize", "no_such_pass"}, ctx);
  ASSERT_FALSE(st);
  EXPECT_NE(st.message().find("unknown pass 'no_such_pass'"), std::string::npos) << st.message();
  EXPECT_NE(st.message().find("known passes: "), std::string::npos) << st.message();
  EXPECT_NE(st.message().find("canonicalize"), std::string::npos) << st.message();
  EXPECT_TRUE(ctx.pass_seconds.empty()) << "a pass ran before the unknown name was refused";
  EXPECT_EQ(g.nodes().size(), 1u);
}

TEST(Pipeline, PrintIrAfterUnknownPassIsOneLine) {
  const CmdResult r = kiln_cmd("inspect " + kMlp + " --memory --print-ir-after=no_such_pass");
  EXPECT_EQ(r.code, 2) << r.out;
  EXPECT_EQ(r.out.rfind("kiln: error: --print-ir-after no_such_pass: no such pass", 0), 0u) << r.out;
  EXPECT_EQ(std::count(r.out.begin(), r.out.end(), '\n'), 1) << r.out;
}

TEST(Pipeline, InspectListsThePassesInOrder) {
  const CmdResult r =
      kiln_cmd("inspect " + kMlp + " --pipeline --bf16 --gradient_accumulation_steps 2 --learning_rate 0.25");
  ASSERT_EQ(r.code, 0) << r.out;
  std::map<std::string, Names> got;
  std::map<std::string, std::string> line_of;  // "program pass" -> its last line
  std::istringstream in(r.out);
  for (std::string line; std::getline(in, line);) {
    std::istringstream ls(line);
    std::string program, stage, pass;
    ls >> program >> stage >> pass;
    if (program != "train" && program != "eval") continue;
    got[program].push_back(pass);
    line_of[program + " " + pass] = line;
  }
  EXPECT_EQ(got["train"], concat({"fold_constants", "canonicalize", "attach_loss", "autocast", "cast_simplify",
                                  "autodiff", "autocast_grad", "cast_simplify", "remat", "canonicalize", "optimizer",
                                  "accumulation", "canonicalize"},
                                 kLowering))
      << r.out;
  EXPECT_EQ(
      got["eval"],
      concat({"fold_constants", "canonicalize", "attach_loss", "autocast", "cast_simplify", "canonicalize"}, kLowering))
      << r.out;
  // Each pass with the options it reads.
  EXPECT_NE(line_of["train accumulation"].find("gradient_accumulation_steps=2"), std::string::npos) << r.out;
  EXPECT_NE(line_of["train autocast"].find("autocast_dtype=bf16"), std::string::npos) << r.out;
  EXPECT_NE(line_of["train attach_loss"].find("mode=train"), std::string::npos) << r.out;
  EXPECT_NE(line_of["eval attach_loss"].find("mode=eval"), std::string::npos) << r.out;
  EXPECT_NE(line_of["train optimizer"].find("learning_rate=0.25"), std::string::npos) << r.out;
  EXPECT_NE(line_of["train autodiff"].find("loss_output=loss"), std::string::npos) << r.out;
  // The compiled backend's default remat policy: torch.compile's min-cut partitioning.
  EXPECT_NE(line_of["train remat"].find("policy=min-cut"), std::string::npos) << r.out;
}

TEST(ProgramSignature, TrainerReadsRowsPerStepFromTheProgram) {
  runtime::TrainConfig cfg;
  cfg.model = kSrc + "/" + kMlp;
  cfg.train_data = {"input=" + kSrc + "/examples/mlp_digits/fixtures/batch_input.npy",
                    "labels=" + kSrc + "/examples/mlp_digits/fixtures/batch_labels.npy"};
  cfg.per_device_train_batch_size = 4;
  cfg.gradient_accumulation_steps = 2;
  cfg.per_device_eval_batch_size = 5;
  cfg.max_steps = 1;
  cfg.backend = "eager";
  auto prog = driver::build_training_program(cfg, nullptr, false, false, 1);
  ASSERT_TRUE(prog) << prog.message();
  EXPECT_EQ(prog->signature.microbatch_rows, 4);
  EXPECT_EQ(prog->signature.gradient_accumulation_steps, 2);  // the AccumulationLoop's trip count
  EXPECT_EQ(prog->signature.rows_per_step, 8);
  EXPECT_EQ(prog->signature.eval_rows, 5);

  // Saved and loaded with the program.
  runtime::ProgramFileInfo info;
  auto bytes = runtime::serialize_program(*prog, info);
  ASSERT_TRUE(bytes) << bytes.message();
  auto loaded = runtime::deserialize_program(*bytes, "memory", {});
  ASSERT_TRUE(loaded) << loaded.message();
  EXPECT_EQ(loaded->signature.microbatch_rows, 4);
  EXPECT_EQ(loaded->signature.gradient_accumulation_steps, 2);
  EXPECT_EQ(loaded->signature.rows_per_step, 8);
  EXPECT_EQ(loaded->signature.eval_rows, 5);

  // A trainer given other batch flags still steps over the program's 2 x 4 rows.
  runtime::TrainConfig other = cfg;
  other.per_device_train_batch_size = 2;
  other.gradient_accumulation_steps = 1;
  other.per_device_eval_batch_size = 3;
  auto raw = runtime::load_raw_data(cfg.train_data);
  ASSERT_TRUE(raw) << raw.message();
  auto specs = driver::program_specs(*loaded->train_step, loaded->data_inputs);
  ASSERT_TRUE(specs) << specs.message();
  auto ds = runtime::Dataset::bind(*raw, *specs, driver::data_options(cfg));
  ASSERT_TRUE(ds) << ds.message();
  std::ostringstream log;
  runtime::TrainerOptions to;
  to.out = &log;
  to.progress = 0;
  to.write_files = false;
  runtime::TrainGraphs graphs = driver::graphs_of(*loaded);
  auto tr = runtime::Trainer::create(other, graphs, &*ds, nullptr, to);
  ASSERT_TRUE(tr) << tr.message();
  EXPECT_EQ(tr->rows_per_step(), 8);
  EXPECT_EQ(tr->microbatch_rows(), 4);
  EXPECT_EQ(tr->accumulation_steps(), 2);
  EXPECT_EQ(tr->eval_rows(), 5);
  EXPECT_EQ(tr->steps_per_epoch(), 1);
  auto step = tr->step();
  ASSERT_TRUE(step) << step.message();
  EXPECT_TRUE(std::isfinite(step->loss));

  // Graphs without a program (0: not recorded) fall back to the flags.
  graphs.microbatch_rows = graphs.accumulation_steps = graphs.eval_rows = 0;
  auto flags = runtime::Trainer::create(other, graphs, &*ds, nullptr, to);
  ASSERT_TRUE(flags) << flags.message();
  EXPECT_EQ(flags->rows_per_step(), 2);
}
