// Each example model's eager (inference-mode) output matches PyTorch's eval-mode
// output for the committed batch within 1e-5 relative (L2 norm of the difference
// over the L2 norm of the reference).
#include "e2e_util.h"

using namespace kiln;
using namespace kiln::testing;

class ExampleForward : public ::testing::TestWithParam<const char*> {};

TEST_P(ExampleForward, MatchesPyTorch) {
  const std::string model = GetParam();
  auto meta = read_json(example_path(model, "meta.json"));
  auto x = runtime::io::load_npy(example_path(model, "input.npy"));
  ASSERT_TRUE(x) << x.message();
  auto ref = runtime::io::load_npy(example_path(model, "output.npy"));
  ASSERT_TRUE(ref) << ref.message();
  std::map<std::string, int64_t> dims = {{"batch", x->dim(0)}};
  auto g = driver::load_inference_model(example_path(model, "model.onnx"), dims);
  ASSERT_TRUE(g) << g.message();
  std::string in_name = meta["inputs"][0]["name"].get<std::string>();
  auto out = runtime::run_graph(**g, {{in_name, *x}});
  ASSERT_TRUE(out) << out.message();
  const ir::Tensor& y = (*out)[(*g)->outputs[0]->name];
  ASSERT_EQ(y.dims(), ref->dims());
  double e = rel_l2(y, *ref);
  EXPECT_LT(e, 1e-5) << model << ": relative L2 error " << e;
}

INSTANTIATE_TEST_SUITE_P(Examples, ExampleForward, ::testing::Values("mlp_digits", "cnn_bn", "tiny_gpt", "resnet18"));
