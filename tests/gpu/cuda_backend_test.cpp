// The CUDA backend (runtime/cuda/cuda_backend.h) behind the backend interface: buffers on
// the device (tensors carry Device cuda:N), host round trips, views, and refusal of nodes
// without a CUDA lowering, naming them. Skips with one line without a GPU (fails with
// KILN_REQUIRE_GPU set).
#include "runtime/cuda/cuda_backend.h"

#include <gtest/gtest.h>

#include <cstdlib>

#include "ir/parser.h"

using namespace kiln;

namespace {

std::unique_ptr<runtime::Backend> open_or_skip(std::string& why) {
  auto b = runtime::open_cuda_backend(0);
  if (b) return std::move(*b);
  why = b.message();
  EXPECT_EQ(why.rfind("no CUDA device: ", 0), 0u) << why;
  return nullptr;
}

#define SKIP_WITHOUT_GPU(b)                                                                \
  std::string why;                                                                         \
  auto b = open_or_skip(why);                                                              \
  if (!b) {                                                                                \
    if (std::getenv("KILN_REQUIRE_GPU")) FAIL() << "KILN_REQUIRE_GPU is set but: " << why; \
    std::printf("[ gpu      ] CUDA backend test skipped: %s\n", why.c_str());              \
    GTEST_SKIP() << why;                                                                   \
  }

TEST(CudaBackend, BuffersLiveOnTheDeviceAndRoundTrip) {
  SKIP_WITHOUT_GPU(b);
  EXPECT_EQ(b->name(), "cuda");
  EXPECT_EQ(b->device(), ir::Device::cuda(0));
  ir::Tensor h = ir::Tensor::from_f32({1, -2, 3, -4, 5, -6}, {2, 3});
  auto d = b->to_device(h);
  ASSERT_TRUE(d) << d.message();
  EXPECT_EQ(d->device(), ir::Device::cuda(0));
  auto back = b->to_host(*d);
  ASSERT_TRUE(back) << back.message();
  EXPECT_TRUE(back->device().is_cpu());
  for (int i = 0; i < 6; ++i) EXPECT_EQ(back->get_f64(i), h.get_f64(i));
  auto z = b->zeros(ir::DType::f32, {4});
  ASSERT_TRUE(z) << z.message();
  auto zh = b->to_host(*z);
  ASSERT_TRUE(zh) << zh.message();
  for (int i = 0; i < 4; ++i) EXPECT_EQ(zh->get_f64(i), 0.0);
}

TEST(CudaBackend, RunsViewsAndRefusesNodesWithoutLowering) {
  SKIP_WITHOUT_GPU(b);
  auto view =
      ir::parse_graph("graph main(%x: f32[2, 3], %s: i64[1]) {\n  %y = Reshape(%x, %s) : f32[6]\n  return %y\n}\n");
  ASSERT_TRUE(view) << view.message();
  auto ex = b->load(**view, {});
  ASSERT_TRUE(ex) << ex.message();
  auto out = b->run(**ex, {{"x", ir::Tensor::from_f32({1, 2, 3, 4, 5, 6}, {2, 3})}, {"s", ir::Tensor::from_i64({6})}});
  ASSERT_TRUE(out) << out.message();
  auto y = b->to_host(out->at("y"));
  ASSERT_TRUE(y) << y.message();
  EXPECT_EQ(y->dims(), (std::vector<int64_t>{6}));
  EXPECT_EQ(y->get_f64(5), 6.0);

  auto mm = ir::parse_graph(
      "graph main(%a: f32[2, 2], %b: f32[2, 2]) {\n  %c = MatMul(%a, %b) : f32[2, 2]  # mm\n  return %c\n}\n");
  ASSERT_TRUE(mm) << mm.message();
  auto refused = b->load(**mm, {});
  ASSERT_FALSE(refused);
  EXPECT_NE(refused.message().find("(MatMul) has no CUDA lowering yet"), std::string::npos) << refused.message();
}

}  // namespace
