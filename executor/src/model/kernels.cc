#include "moeplan/executor/model/kernels.h"

#include <ATen/Dispatch.h>
#include <ATen/OpMathType.h>
#include <ATen/Parallel.h>

#include <cmath>
#include <mutex>
#include <vector>

#include "moeplan/executor/model/autograd_ops.h"

// The loops below are written for the compiler to vectorise (this file is built with
// -fopenmp-simd): every sum and product in float (double for double tensors).

namespace moeplan::executor {

namespace {

// Rows per task of at::parallel_for: enough work to be worth a thread.
int64_t grain_rows(int64_t width) { return std::max<int64_t>(1, 32768 / std::max<int64_t>(1, width)); }

// Arithmetic in float for float and the 16-bit types, in double for double.
template <class T>
at::opmath_type<T> wide(T v) {
  return static_cast<at::opmath_type<T>>(v);
}

template <class T>
void rms_norm_rows(const T* x, const T* w, T* out, at::opmath_type<T>* rstd, int64_t begin, int64_t end, int64_t h,
                   double eps) {
  using Acc = at::opmath_type<T>;
  for (int64_t r = begin; r < end; ++r) {
    const T* xr = x + r * h;
    T* yr = out + r * h;
    Acc squares = 0;
#pragma omp simd reduction(+ : squares)
    for (int64_t j = 0; j < h; ++j) squares += wide(xr[j]) * wide(xr[j]);
    const Acc s = Acc(1) / std::sqrt(squares / static_cast<Acc>(h) + static_cast<Acc>(eps));
    rstd[r] = s;
#pragma omp simd
    for (int64_t j = 0; j < h; ++j) yr[j] = static_cast<T>(wide(w[j]) * wide(static_cast<T>(wide(xr[j]) * s)));
  }
}

// d/dx = s * (dn - n * mean(dn * n)) with n = x * s and dn = g * w; d/dw accumulates g * n.
template <class T>
void rms_norm_backward_rows(const T* g, const T* x, const T* w, const at::opmath_type<T>* rstd, T* gx,
                            at::opmath_type<T>* gw, int64_t begin, int64_t end, int64_t h) {
  using Acc = at::opmath_type<T>;
  for (int64_t r = begin; r < end; ++r) {
    const T* gr = g + r * h;
    const T* xr = x + r * h;
    T* out = gx + r * h;
    const Acc s = rstd[r];
    Acc dot = 0;
#pragma omp simd reduction(+ : dot)
    for (int64_t j = 0; j < h; ++j) {
      const Acc n = wide(xr[j]) * s;
      dot += wide(gr[j]) * wide(w[j]) * n;
      gw[j] += wide(gr[j]) * n;
    }
    const Acc mean = dot / static_cast<Acc>(h);
#pragma omp simd
    for (int64_t j = 0; j < h; ++j) {
      const Acc n = wide(xr[j]) * s;
      out[j] = static_cast<T>(s * (wide(gr[j]) * wide(w[j]) - n * mean));
    }
  }
}

// x [rows, heads, d] with cos, sin [rows, d] (rows = B x T, the tables repeated per batch
// entry through `period`): out = x * cos + rotate_half(x) * sin; `transpose` computes the
// backward instead (the rotation's transpose: rotate_half's sign moves to the other half).
template <class T>
void rotary_rows(const T* x, const T* cos, const T* sin, T* out, int64_t begin, int64_t end, int64_t heads, int64_t d,
                 int64_t period, bool transpose) {
  const int64_t half = d / 2;
  for (int64_t r = begin; r < end; ++r) {
    const T* c = cos + (r % period) * d;
    const T* s = sin + (r % period) * d;
    for (int64_t k = 0; k < heads; ++k) {
      const T* xr = x + (r * heads + k) * d;
      T* yr = out + (r * heads + k) * d;
      if (!transpose) {
#pragma omp simd
        for (int64_t j = 0; j < half; ++j) {
          yr[j] = static_cast<T>(wide(xr[j]) * wide(c[j]) - wide(xr[j + half]) * wide(s[j]));
          yr[j + half] = static_cast<T>(wide(xr[j + half]) * wide(c[j + half]) +
                                        wide(xr[j]) * wide(s[j + half]));
        }
      } else {
#pragma omp simd
        for (int64_t j = 0; j < half; ++j) {
          yr[j] = static_cast<T>(wide(xr[j]) * wide(c[j]) + wide(xr[j + half]) * wide(s[j + half]));
          yr[j + half] = static_cast<T>(wide(xr[j + half]) * wide(c[j + half]) -
                                        wide(xr[j]) * wide(s[j]));
        }
      }
    }
  }
}

torch::Tensor rotary_pass(const torch::Tensor& x, const torch::Tensor& cos, const torch::Tensor& sin, bool transpose) {
  const torch::Tensor in = x.contiguous();
  torch::Tensor out = torch::empty_like(in);
  const int64_t t = in.size(1), heads = in.size(2), d = in.size(3), rows = in.size(0) * t;
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, in.scalar_type(), "fused_rotary", [&] {
    const scalar_t* xp = in.const_data_ptr<scalar_t>();
    const scalar_t* cp = cos.const_data_ptr<scalar_t>();
    const scalar_t* sp = sin.const_data_ptr<scalar_t>();
    scalar_t* op = out.data_ptr<scalar_t>();
    at::parallel_for(0, rows, grain_rows(heads * d), [&](int64_t begin, int64_t end) {
      rotary_rows(xp, cp, sp, op, begin, end, heads, d, t, transpose);
    });
  });
  return out;
}

torch::Tensor rotate_half(const torch::Tensor& x) {
  const int64_t half = x.size(-1) / 2;
  return torch::cat({-x.narrow(-1, half, half), x.narrow(-1, 0, half)}, -1);
}

}  // namespace

torch::Tensor fused_rms_norm(const torch::Tensor& x, const torch::Tensor& weight, double eps) {
  TORCH_CHECK(x.scalar_type() == weight.scalar_type(), "rms_norm: input ", x.scalar_type(), " and weight ",
              weight.scalar_type(), " differ in dtype");
  const int64_t h = x.size(-1);
  if (!x.device().is_cpu()) return at::rms_norm(x, {h}, weight, eps);
  const torch::Tensor in = x.detach().contiguous();
  const torch::Tensor w = weight.detach().contiguous();
  const int64_t rows = in.numel() / h;
  torch::Tensor out = torch::empty_like(in);
  const torch::ScalarType wide_type = in.scalar_type() == torch::kDouble ? torch::kDouble : torch::kFloat;
  torch::Tensor rstd = torch::empty({rows}, in.options().dtype(wide_type));
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, in.scalar_type(), "fused_rms_norm", [&] {
    using Acc = at::opmath_type<scalar_t>;
    const scalar_t* xp = in.const_data_ptr<scalar_t>();
    const scalar_t* wp = w.const_data_ptr<scalar_t>();
    scalar_t* op = out.data_ptr<scalar_t>();
    Acc* sp = rstd.data_ptr<Acc>();
    at::parallel_for(0, rows, grain_rows(h), [&](int64_t begin, int64_t end) {
      rms_norm_rows(xp, wp, op, sp, begin, end, h, eps);
    });
  });
  TensorList outputs{out};
  attach_backward({x, weight}, outputs, "FusedRmsNormBackward", [in, w, rstd, h, rows](TensorList&& grads) {
    if (!grads[0].defined()) return TensorList{torch::Tensor(), torch::Tensor()};
    const torch::Tensor g = grads[0].contiguous();
    torch::Tensor gx = torch::empty_like(in);
    torch::Tensor gw = torch::zeros({h}, rstd.options());
    std::mutex merge;
    AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, in.scalar_type(), "fused_rms_norm_backward", [&] {
      using Acc = at::opmath_type<scalar_t>;
      const scalar_t* gp = g.const_data_ptr<scalar_t>();
      const scalar_t* xp = in.const_data_ptr<scalar_t>();
      const scalar_t* wp = w.const_data_ptr<scalar_t>();
      const Acc* sp = rstd.const_data_ptr<Acc>();
      scalar_t* op = gx.data_ptr<scalar_t>();
      Acc* total = gw.data_ptr<Acc>();
      at::parallel_for(0, rows, grain_rows(h), [&](int64_t begin, int64_t end) {
        std::vector<Acc> part(static_cast<size_t>(h), Acc(0));
        rms_norm_backward_rows(gp, xp, wp, sp, op, part.data(), begin, end, h);
        const std::lock_guard<std::mutex> lock(merge);
        for (int64_t j = 0; j < h; ++j) total[j] += part[static_cast<size_t>(j)];
      });
    });
    return TensorList{gx, gw.to(w.scalar_type())};
  });
  return outputs[0];
}

torch::Tensor flash_attention(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v,
                              const torch::Tensor& mask_bias) {
  const bool causal = !mask_bias.defined();
  const std::optional<torch::Tensor> mask = causal ? std::nullopt : std::optional<torch::Tensor>(mask_bias);
  if (!q.device().is_cpu() || q.element_size() >= 4)
    return at::scaled_dot_product_attention(q, k, v, mask, /*dropout_p=*/0.0, /*is_causal=*/causal,
                                            /*scale=*/std::nullopt, /*enable_gqa=*/q.size(1) != k.size(1));
  // The CPU flash kernel takes grouped-query heads as they are.
  const torch::Tensor qd = q.detach(), kd = k.detach(), vd = v.detach();
  torch::Tensor out, logsumexp;  // not a structured binding: clang before 16 cannot capture one
  std::tie(out, logsumexp) = at::_scaled_dot_product_flash_attention_for_cpu(qd, kd, vd, 0.0, causal, mask);
  TensorList outputs{out};
  attach_backward({q, k, v}, outputs, "FlashAttentionBackward",
                  [qd, kd, vd, out, logsumexp, mask_bias, causal](TensorList&& grads) {
                    if (!grads[0].defined()) return TensorList{torch::Tensor(), torch::Tensor(), torch::Tensor()};
                    const auto fp32 = [](const torch::Tensor& t) { return t.to(torch::kFloat); };
                    const std::optional<torch::Tensor> mask =
                        causal ? std::nullopt : std::optional<torch::Tensor>(fp32(mask_bias));
                    auto [gq, gk, gv] = at::_scaled_dot_product_flash_attention_for_cpu_backward(
                        fp32(grads[0]), fp32(qd), fp32(kd), fp32(vd), fp32(out), logsumexp, 0.0, causal, mask);
                    const torch::ScalarType type = qd.scalar_type();
                    return TensorList{gq.to(type), gk.to(type), gv.to(type)};
                  });
  return outputs[0];
}

torch::Tensor fused_rotary(const torch::Tensor& x, const torch::Tensor& cos, const torch::Tensor& sin) {
  TORCH_CHECK(x.dim() == 4 && x.size(-1) % 2 == 0, "rotary: x must be [B, T, heads, even head_dim], not ", x.sizes());
  TORCH_CHECK(cos.scalar_type() == x.scalar_type() && sin.scalar_type() == x.scalar_type(),
              "rotary: the tables' dtype differs from x's");
  TORCH_CHECK(cos.size(0) == x.size(1) && cos.size(1) == x.size(3) && sin.sizes() == cos.sizes(),
              "rotary: tables ", cos.sizes(), " do not fit x ", x.sizes());
  if (!x.device().is_cpu()) {
    const torch::Tensor c = cos.unsqueeze(1), s = sin.unsqueeze(1);  // [T, 1, head_dim]
    return x * c + rotate_half(x) * s;
  }
  const torch::Tensor c = cos.contiguous(), s = sin.contiguous();
  TensorList outputs{rotary_pass(x.detach(), c, s, /*transpose=*/false)};
  attach_backward({x}, outputs, "FusedRotaryBackward", [c, s](TensorList&& grads) {
    if (!grads[0].defined()) return TensorList{torch::Tensor()};
    return TensorList{rotary_pass(grads[0], c, s, /*transpose=*/true)};
  });
  return outputs[0];
}

}  // namespace moeplan::executor
