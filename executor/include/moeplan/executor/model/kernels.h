#pragma once
// Fused kernels for the parts of a Mixtral block that LibTorch runs on the CPU as a chain of
// elementwise operations, each a pass over memory (RMSNorm, rotary embedding): here one pass
// forward and one backward, with the same results up to the order of float sums. On a GPU they
// defer to LibTorch's own fused kernels where it has them.

#include "moeplan/executor/libtorch.h"

namespace moeplan::executor {

// weight * (x / sqrt(mean(x^2) + eps)) over the last dimension, the normalised rows rounded to
// x's dtype before the weight multiplies them (Hugging Face's MixtralRMSNorm), in fp32
// arithmetic (fp64 for fp64); x and weight of one dtype. Keeps x and a per-row fp32 reciprocal
// for backward.
torch::Tensor fused_rms_norm(const torch::Tensor& x, const torch::Tensor& weight, double eps);

// Rotary position embedding of x [B, T, heads, head_dim] (the projection's layout):
// x * cos + rotate_half(x) * sin, cos and sin [T, head_dim] (Hugging Face's apply_rotary_pos_emb,
// rotate_half(x) = cat(-x2, x1) of x's two halves). Keeps nothing of x for backward.
torch::Tensor fused_rotary(const torch::Tensor& x, const torch::Tensor& cos, const torch::Tensor& sin);

// Causal scaled-dot-product attention of q [B, heads, T, d] over k and v [B, kv_heads, T, d]
// (grouped-query: heads a multiple of kv_heads), under mask_bias [T, T] instead where that is
// defined: LibTorch's, flash attention on the CPU. On the CPU in 16 bits its backward runs in
// fp32 on copies of what the forward kept (in the compute dtype, as LibTorch's keeps them):
// LibTorch's 16-bit flash backward is half again as slow as its fp32 one there.
torch::Tensor flash_attention(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v,
                              const torch::Tensor& mask_bias);

}  // namespace moeplan::executor
