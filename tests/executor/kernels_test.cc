// The fused kernels against the chains of LibTorch operations they replace, forward and
// backward, and against finite differences in double.

#include <gtest/gtest.h>

#include "moeplan/executor/model/kernels.h"

namespace moeplan::executor {
namespace {

torch::Tensor reference_rms_norm(const torch::Tensor& x, const torch::Tensor& weight, double eps) {
  const torch::Tensor x32 = x.to(torch::kFloat);
  const torch::Tensor normed = x32 * torch::rsqrt(x32.square().mean(-1, /*keepdim=*/true) + eps);
  return weight * normed.to(x.scalar_type());
}

torch::Tensor reference_rotary(const torch::Tensor& x, const torch::Tensor& cos, const torch::Tensor& sin) {
  const int64_t half = x.size(-1) / 2;
  const torch::Tensor rotated = torch::cat({-x.narrow(-1, half, half), x.narrow(-1, 0, half)}, -1);
  return x * cos.unsqueeze(1) + rotated * sin.unsqueeze(1);
}

// Output and the gradients of every input of f and of reference under the same output gradient.
struct Result {
  torch::Tensor out;
  std::vector<torch::Tensor> grads;
};
template <class F>
Result run(F&& f, std::vector<torch::Tensor> inputs, const torch::Tensor& grad_out) {
  for (torch::Tensor& t : inputs) t = t.detach().clone().requires_grad_(true);
  Result r;
  r.out = f(inputs);
  r.out.backward(grad_out);
  for (const torch::Tensor& t : inputs) r.grads.push_back(t.grad());
  return r;
}

void expect_close(const torch::Tensor& a, const torch::Tensor& b, double rtol, double atol, const std::string& what) {
  ASSERT_EQ(a.sizes(), b.sizes()) << what;
  ASSERT_EQ(a.scalar_type(), b.scalar_type()) << what;
  EXPECT_TRUE(torch::allclose(a.to(torch::kFloat), b.to(torch::kFloat), rtol, atol))
      << what << ": largest difference " << (a.to(torch::kFloat) - b.to(torch::kFloat)).abs().max().item<float>();
}

TEST(FusedKernels, RmsNormMatchesTheOperationChain) {
  torch::manual_seed(3);
  // Rows of an uneven count and a width that is not a multiple of any vector length.
  const torch::Tensor x = torch::randn({3, 37, 131}) * 3;
  const torch::Tensor w = torch::randn({131});
  const torch::Tensor g = torch::randn({3, 37, 131});
  auto fused = [](const std::vector<torch::Tensor>& in) { return fused_rms_norm(in[0], in[1], 1e-5); };
  auto reference = [](const std::vector<torch::Tensor>& in) { return reference_rms_norm(in[0], in[1], 1e-5); };
  const Result a = run(fused, {x, w}, g), b = run(reference, {x, w}, g);
  expect_close(a.out, b.out, 1e-5, 1e-6, "fp32 output");
  expect_close(a.grads[0], b.grads[0], 1e-4, 1e-5, "fp32 input gradient");
  expect_close(a.grads[1], b.grads[1], 1e-4, 1e-4, "fp32 weight gradient");
  // bf16: the normalised rows are rounded to bf16 before the weight multiplies them, as in the
  // chain; gradients within bf16's precision.
  const Result c = run(fused, {x.to(torch::kBFloat16), w.to(torch::kBFloat16)}, g.to(torch::kBFloat16));
  const Result d = run(reference, {x.to(torch::kBFloat16), w.to(torch::kBFloat16)}, g.to(torch::kBFloat16));
  expect_close(c.out, d.out, 1e-2, 1e-2, "bf16 output");
  expect_close(c.grads[0], d.grads[0], 3e-2, 3e-2, "bf16 input gradient");
  expect_close(c.grads[1], d.grads[1], 3e-2, 1.0, "bf16 weight gradient");
}

TEST(FusedKernels, RotaryMatchesTheOperationChain) {
  torch::manual_seed(4);
  const int64_t b = 2, t = 19, heads = 3, d = 10;
  const torch::Tensor x = torch::randn({b, t, heads, d});
  const torch::Tensor angles = torch::rand({t, d}) * 6;
  const torch::Tensor cos = angles.cos(), sin = angles.sin();
  const torch::Tensor g = torch::randn({b, t, heads, d});
  auto fused = [&](const std::vector<torch::Tensor>& in) { return fused_rotary(in[0], cos, sin); };
  auto reference = [&](const std::vector<torch::Tensor>& in) { return reference_rotary(in[0], cos, sin); };
  const Result r1 = run(fused, {x}, g), r2 = run(reference, {x}, g);
  expect_close(r1.out, r2.out, 1e-6, 1e-6, "output");
  expect_close(r1.grads[0], r2.grads[0], 1e-6, 1e-6, "input gradient");
  // A transposed (non-contiguous) input, as the projection's view gives it.
  const torch::Tensor strided = torch::randn({b, heads, t, d}).transpose(1, 2);
  expect_close(fused_rotary(strided, cos, sin), reference_rotary(strided, cos, sin), 1e-6, 1e-6, "strided input");
}

// u . (f(x + e v) - f(x - e v)) / 2e against the backward's gradient under u, dotted with v,
// for random directions v of every input and a random output gradient u (double precision).
template <class F>
void expect_directional_derivatives(F&& f, const std::vector<torch::Tensor>& inputs) {
  std::vector<torch::Tensor> leaves;
  for (const torch::Tensor& t : inputs) leaves.push_back(t.detach().clone().requires_grad_(true));
  const torch::Tensor out = f(leaves);
  const torch::Tensor u = torch::randn_like(out);
  out.backward(u);
  const double e = 1e-6;
  for (size_t i = 0; i < inputs.size(); ++i) {
    const torch::Tensor v = torch::randn_like(inputs[i]);
    std::vector<torch::Tensor> plus = inputs, minus = inputs;
    plus[i] = inputs[i] + e * v;
    minus[i] = inputs[i] - e * v;
    torch::NoGradGuard no_grad;
    const double numeric = ((f(plus) - f(minus)) * u).sum().template item<double>() / (2 * e);
    const double analytic = (leaves[i].grad() * v).sum().item<double>();
    EXPECT_NEAR(analytic, numeric, 1e-6 * std::max(1.0, std::abs(numeric))) << "input " << i;
  }
}

TEST(FusedKernels, GradientsAgreeWithFiniteDifferences) {
  torch::manual_seed(5);
  const auto dbl = torch::TensorOptions().dtype(torch::kDouble);
  expect_directional_derivatives(
      [](const std::vector<torch::Tensor>& in) { return fused_rms_norm(in[0], in[1], 1e-5); },
      {torch::randn({4, 6}, dbl), torch::randn({6}, dbl)});
  const torch::Tensor angles = torch::rand({5, 4}, dbl);
  const torch::Tensor cos = angles.cos(), sin = angles.sin();
  expect_directional_derivatives([&](const std::vector<torch::Tensor>& in) { return fused_rotary(in[0], cos, sin); },
                                 {torch::randn({2, 5, 3, 4}, dbl)});
}

// In bf16 on the CPU the backward runs in fp32: against LibTorch's whole-fp32 attention of the
// same (bf16-rounded) inputs, forward and backward, causal and under a sliding-window mask, with
// grouped-query heads; and in fp32 it is LibTorch's own.
TEST(FusedKernels, FlashAttentionMatchesLibTorchsAttention) {
  torch::manual_seed(6);
  const int64_t b = 2, heads = 4, kv = 2, t = 40, d = 16;
  const torch::Tensor q = torch::randn({b, heads, t, d}), k = torch::randn({b, kv, t, d}), v = torch::randn({b, kv, t, d});
  const torch::Tensor g = torch::randn({b, heads, t, d});
  const torch::Tensor i = torch::arange(t).unsqueeze(1), j = torch::arange(t).unsqueeze(0);
  const torch::Tensor window = torch::zeros({t, t}).masked_fill((j > i) | (i - j >= 7), -INFINITY);
  for (const torch::Tensor& mask : {torch::Tensor(), window}) {
    const std::string what = mask.defined() ? "sliding window" : "causal";
    auto reference = [&](const std::vector<torch::Tensor>& in) {
      return at::scaled_dot_product_attention(in[0], in[1], in[2],
                                              mask.defined() ? std::optional<torch::Tensor>(mask) : std::nullopt, 0.0,
                                              !mask.defined(), std::nullopt, /*enable_gqa=*/true);
    };
    auto fused = [&](const std::vector<torch::Tensor>& in) {
      return flash_attention(in[0], in[1], in[2], mask.defined() ? mask.to(in[0].scalar_type()) : mask);
    };
    const Result a = run(fused, {q, k, v}, g), r = run(reference, {q, k, v}, g);
    expect_close(a.out, r.out, 1e-5, 1e-5, what + " fp32 output");
    for (size_t n = 0; n < 3; ++n) expect_close(a.grads[n], r.grads[n], 1e-4, 1e-5, what + " fp32 gradient");
    const auto bf16 = [](const torch::Tensor& x) { return x.to(torch::kBFloat16); };
    const auto rounded = [&](const torch::Tensor& x) { return bf16(x).to(torch::kFloat); };
    const Result h = run(fused, {bf16(q), bf16(k), bf16(v)}, bf16(g));
    const Result w = run(reference, {rounded(q), rounded(k), rounded(v)}, rounded(g));
    expect_close(h.out.to(torch::kFloat), w.out, 2e-2, 2e-2, what + " bf16 output");
    for (size_t n = 0; n < 3; ++n) {
      ASSERT_EQ(h.grads[n].scalar_type(), torch::kBFloat16);
      // The fp32 backward of bf16 values: the reference's gradient, rounded once to bf16.
      expect_close(h.grads[n].to(torch::kFloat), w.grads[n], 1e-2, 1e-2, what + " bf16 gradient");
    }
  }
}

TEST(FusedKernels, BadInputIsNamed) {
  const torch::Tensor x = torch::randn({2, 8});
  EXPECT_THROW(fused_rms_norm(x, torch::ones({8}, torch::kBFloat16), 1e-5), c10::Error);
  const torch::Tensor cos = torch::ones({5, 4});
  EXPECT_THROW(fused_rotary(torch::randn({1, 6, 2, 4}), cos, cos), c10::Error);  // tables for 5 positions, not 6
  EXPECT_THROW(fused_rotary(torch::randn({1, 5, 2, 3}), cos, cos), c10::Error);  // odd head_dim
}

}  // namespace
}  // namespace moeplan::executor
