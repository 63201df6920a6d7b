// The LibTorch Mixtral against a reference written here with plain loops in double precision,
// token by token and expert by expert, following Hugging Face's MixtralForCausalLM.

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <numeric>

#include "moeplan/executor/model/mixtral.h"
#include "test_support.h"

namespace moeplan::executor {
namespace {

using Vec = std::vector<double>;

// A row-major matrix [rows, cols] copied out of a tensor.
struct Mat {
  int64_t rows = 0, cols = 0;
  Vec v;
  explicit Mat(const torch::Tensor& t) : rows(t.size(0)), cols(t.dim() > 1 ? t.size(1) : 1) {
    const torch::Tensor d = t.to(torch::kDouble).contiguous();
    v.assign(d.data_ptr<double>(), d.data_ptr<double>() + d.numel());
  }
  Vec times(const Vec& x) const {  // W x for a Linear weight W [out, in]
    Vec y(static_cast<size_t>(rows), 0.0);
    for (int64_t r = 0; r < rows; ++r)
      for (int64_t c = 0; c < cols; ++c) y[r] += v[r * cols + c] * x[c];
    return y;
  }
};

Vec rms_norm(const Vec& x, const Mat& w, double eps) {
  double ms = 0;
  for (double a : x) ms += a * a;
  ms /= static_cast<double>(x.size());
  Vec y(x.size());
  for (size_t i = 0; i < x.size(); ++i) y[i] = w.v[i] * x[i] / std::sqrt(ms + eps);
  return y;
}

// Rotates one head vector to position p (Hugging Face's rotate_half pairing: i with i + d/2).
Vec rope(const Vec& x, int64_t p, double theta) {
  const size_t d = x.size(), half = d / 2;
  Vec y(d);
  for (size_t i = 0; i < half; ++i) {
    const double angle = static_cast<double>(p) / std::pow(theta, static_cast<double>(2 * i) / static_cast<double>(d));
    y[i] = x[i] * std::cos(angle) - x[i + half] * std::sin(angle);
    y[i + half] = x[i + half] * std::cos(angle) + x[i] * std::sin(angle);
  }
  return y;
}

// DeepSeek's rotary layout: pairs (x0, x1), (x2, x3), ... put in halves, x0 x2 ... x1 x3 ...
Vec deinterleave(const Vec& x) {
  const size_t half = x.size() / 2;
  Vec y(x.size());
  for (size_t i = 0; i < half; ++i) {
    y[i] = x[2 * i];
    y[half + i] = x[2 * i + 1];
  }
  return y;
}

double silu(double a) { return a / (1 + std::exp(-a)); }

struct Reference {
  std::vector<Vec> logits;                        // [T][vocab]
  std::vector<std::vector<Vec>> mtp_logits;       // [depth][T][vocab]
  std::vector<std::vector<int64_t>> expert_load;  // [layer][expert]
};

// One sequence, top-k routing by softmax probability (aux_loss / none).
// Under sigmoid scoring `bias` [moe blocks, experts], when defined, is added to the scores the
// choice ranks (not to the weights).
Reference reference_forward(const ModelSpec& s, const std::vector<torch::Tensor>& t, const std::vector<int64_t>& ids,
                            const torch::Tensor& bias = {}) {
  const int64_t T = static_cast<int64_t>(ids.size()), H = s.hidden_size, hd = s.head_dim;
  const int64_t heads = s.num_attention_heads, kv = s.num_key_value_heads, E = s.num_experts;
  size_t at = 0;
  const Mat embed(t[at++]);
  std::vector<Vec> x(static_cast<size_t>(T));
  for (int64_t i = 0; i < T; ++i) x[i] = Vec(embed.v.begin() + ids[i] * H, embed.v.begin() + (ids[i] + 1) * H);
  Reference ref;
  // One block over every token of x, its parameters read from t in order.
  auto run_layer = [&](int64_t l) {
    const Mat ln1(t[at++]);
    // Latent attention (DeepSeek): the query latent's projections and norm (or q_proj), the
    // key-value latent's with the shared rotary key, then o_proj; else q, k, v and o.
    const bool mla = s.mla(), q_latent = mla && s.q_lora_rank > 0;
    const torch::Tensor none = torch::zeros({1, 1});
    const Mat wqa(q_latent ? t[at++] : none), qan(q_latent ? t[at++] : none);
    const Mat wq(t[at++]);  // q_b_proj under a query latent
    const Mat wk(t[at++]);  // kv_a_proj_with_mqa under latent attention
    const Mat kvan(mla ? t[at++] : none);
    const Mat wv(t[at++]);  // kv_b_proj under latent attention
    const Mat wo(t[at++]);
    // Qwen3: an RMSNorm of head_dim over each head's query and key, before the rotation.
    const Mat qn(s.qk_norm ? t[at++] : torch::ones({hd})), kn(s.qk_norm ? t[at++] : torch::ones({hd}));
    auto head_of = [&](const Vec& all, int64_t head, const Mat& norm) {
      const Vec one(all.begin() + head * hd, all.begin() + (head + 1) * hd);
      return s.qk_norm ? rms_norm(one, norm, s.rms_norm_eps) : one;
    };
    const Mat ln2(t[at++]);
    // A dense block: one SwiGLU feed-forward layer, no router.
    const bool moe = s.moe_layer(l);
    std::vector<Mat> dense;
    for (int n = 0; !moe && n < 3; ++n) dense.emplace_back(t[at++]);
    const Mat gate(moe ? t[at++] : torch::zeros({1, 1}));
    std::vector<Mat> w1, w2, w3;
    for (int64_t e = 0; moe && e < E; ++e) {
      w1.emplace_back(t[at++]);
      w2.emplace_back(t[at++]);
      w3.emplace_back(t[at++]);
    }
    // Shared experts (and their sigmoid gate), after the routed ones.
    std::vector<Mat> shared;
    if (moe && s.shared_experts())
      for (int n = 0; n < (s.shared_expert_gate ? 4 : 3); ++n) shared.emplace_back(t[at++]);
    // Within the window, but on every full_attention_step-th decoder block (blocks K-1, 2K-1, ...;
    // the layer_types of GPT-OSS's config), which attends over the whole sequence; the
    // multi-token prediction blocks after the decoder within it.
    const bool windowed = s.sliding_window && !(s.full_attention_step > 0 && l < s.num_layers &&
                                                (l + 1) % s.full_attention_step == 0);
    // Attention, token by token: each head's rotated query and key and its value.
    std::vector<Vec> q(T), k(T), v(T);
    for (int64_t i = 0; i < T; ++i) {
      const Vec h = rms_norm(x[i], ln1, s.rms_norm_eps);
      q[i] = q_latent ? wq.times(rms_norm(wqa.times(h), qan, s.rms_norm_eps)) : wq.times(h);
      k[i] = wk.times(h);  // under latent attention: the latent, then the shared rotary key
      if (mla) {
        const Vec latent(k[i].begin(), k[i].begin() + s.kv_lora_rank);
        v[i] = wv.times(rms_norm(latent, kvan, s.rms_norm_eps));  // each head's key part and value
      } else {
        v[i] = wv.times(h);
      }
    }
    const int64_t rope_dim = s.qk_rope_head_dim, nope = hd - rope_dim, vd = s.value_head_dim();
    auto span = [](const Vec& all, int64_t begin, int64_t n) { return Vec(all.begin() + begin, all.begin() + begin + n); };
    auto joined = [](Vec a, const Vec& b) {
      a.insert(a.end(), b.begin(), b.end());
      return a;
    };
    auto query = [&](int64_t i, int64_t hh) {
      if (!mla) return rope(head_of(q[i], hh, qn), i, s.rope_theta);
      return joined(span(q[i], hh * hd, nope), rope(deinterleave(span(q[i], hh * hd + nope, rope_dim)), i, s.rope_theta));
    };
    auto key = [&](int64_t j, int64_t hh) {
      if (!mla) return rope(head_of(k[j], hh / (heads / kv), kn), j, s.rope_theta);
      return joined(span(v[j], hh * (nope + vd), nope),
                    rope(deinterleave(span(k[j], s.kv_lora_rank, rope_dim)), j, s.rope_theta));
    };
    auto value = [&](int64_t j, int64_t hh) {
      return mla ? span(v[j], hh * (nope + vd) + nope, vd) : span(v[j], hh / (heads / kv) * hd, hd);
    };
    std::vector<Vec> attn_out(T);
    for (int64_t i = 0; i < T; ++i) {
      Vec concat;
      for (int64_t hh = 0; hh < heads; ++hh) {
        const Vec qi = query(i, hh);
        std::vector<double> scores;
        std::vector<int64_t> keys;
        for (int64_t j = 0; j <= i; ++j) {
          if (windowed && i - j >= *s.sliding_window) continue;
          const Vec kj = key(j, hh);
          double dot = 0;
          for (int64_t c = 0; c < hd; ++c) dot += qi[c] * kj[c];
          scores.push_back(dot / std::sqrt(static_cast<double>(hd)));
          keys.push_back(j);
        }
        const double m = *std::max_element(scores.begin(), scores.end());
        double z = 0;
        for (double& sc : scores) z += (sc = std::exp(sc - m));
        Vec out(static_cast<size_t>(vd), 0.0);
        for (size_t n = 0; n < keys.size(); ++n) {
          const Vec vj = value(keys[n], hh);
          for (int64_t c = 0; c < vd; ++c) out[c] += scores[n] / z * vj[c];
        }
        concat.insert(concat.end(), out.begin(), out.end());
      }
      attn_out[i] = wo.times(concat);
    }
    for (int64_t i = 0; i < T; ++i)
      for (int64_t c = 0; c < H; ++c) x[i][c] += attn_out[i][c];
    if (!moe) {
      const Mat &d1 = dense[0], &d2 = dense[1], &d3 = dense[2];
      for (int64_t i = 0; i < T; ++i) {
        const Vec h = rms_norm(x[i], ln2, s.rms_norm_eps);
        const Vec a = d1.times(h), b = d3.times(h);
        Vec act(a.size());
        for (size_t c = 0; c < a.size(); ++c) act[c] = silu(a[c]) * b[c];
        const Vec y = d2.times(act);
        for (int64_t c = 0; c < H; ++c) x[i][c] += y[c];
      }
      return;
    }
    // Sparse MoE, token by token, expert by expert.
    std::vector<int64_t> load(static_cast<size_t>(E), 0);
    for (int64_t i = 0; i < T; ++i) {
      const Vec h = rms_norm(x[i], ln2, s.rms_norm_eps);
      const Vec logits = gate.times(h);
      const double m = *std::max_element(logits.begin(), logits.end());
      Vec p(E);  // softmax probabilities, or sigmoid scores
      double z = 0;
      for (int64_t e = 0; e < E; ++e) z += (p[e] = std::exp(logits[e] - m));
      for (double& pe : p) pe /= z;
      Vec rank = p;  // what the choice ranks by
      if (s.router_scoring == RouterScoring::kSigmoid) {
        for (int64_t e = 0; e < E; ++e) {
          p[e] = 1 / (1 + std::exp(-logits[e]));
          rank[e] = p[e] + (bias.defined() ? bias[s.moe_row(l)][e].item<double>() : 0.0);
        }
        // Group-limited: the groups by the sum of their two best; the others out.
        const int64_t per = E / s.router_groups;
        std::vector<std::pair<double, int64_t>> groups;
        for (int64_t g = 0; g < s.router_groups; ++g) {
          Vec members(rank.begin() + g * per, rank.begin() + (g + 1) * per);
          std::sort(members.rbegin(), members.rend());
          groups.push_back({members[0] + (per > 1 ? members[1] : 0.0), g});
        }
        std::sort(groups.rbegin(), groups.rend());
        for (int64_t n = s.router_group_topk; n < s.router_groups; ++n)
          for (int64_t e = groups[n].second * per; e < (groups[n].second + 1) * per; ++e) rank[e] = 0;
      }
      std::vector<int64_t> order(E);
      std::iota(order.begin(), order.end(), 0);
      std::sort(order.begin(), order.end(), [&](int64_t a, int64_t b) { return rank[a] > rank[b]; });
      double chosen = 0;
      for (int64_t j = 0; j < s.experts_per_token; ++j) chosen += p[order[j]];
      for (int64_t j = 0; j < s.experts_per_token; ++j) {
        const int64_t e = order[j];
        ++load[e];
        const Vec a = w1[e].times(h), b = w3[e].times(h);
        Vec act(a.size());
        for (size_t c = 0; c < a.size(); ++c) act[c] = silu(a[c]) * b[c];
        const Vec y = w2[e].times(act);
        for (int64_t c = 0; c < H; ++c) x[i][c] += p[e] / chosen * s.routed_scaling_factor * y[c];
      }
      if (!shared.empty()) {
        const Vec a = shared[0].times(h), b = shared[2].times(h);
        Vec act(a.size());
        for (size_t c = 0; c < a.size(); ++c) act[c] = silu(a[c]) * b[c];
        const Vec y = shared[1].times(act);
        const double gate = shared.size() > 3 ? 1 / (1 + std::exp(-shared[3].times(h)[0])) : 1.0;
        for (int64_t c = 0; c < H; ++c) x[i][c] += gate * y[c];
      }
    }
    ref.expert_load.push_back(load);
  };
  for (int64_t l = 0; l < s.num_layers; ++l) run_layer(l);
  // The final norm and head are the last two parameters.
  const Mat norm(t[t.size() - 2]), head(t[t.size() - 1]);
  for (int64_t i = 0; i < T; ++i) ref.logits.push_back(head.times(rms_norm(x[i], norm, s.rms_norm_eps)));
  // Multi-token prediction, depth k: each position joins the normed embedding of the token k
  // ahead (token 0 past the end) with its normed output of depth k - 1, through eh_proj; one more
  // block; its own norm, then the shared head.
  for (int64_t k = 1; k <= s.mtp_layers; ++k) {
    const Mat enorm(t[at++]), hnorm(t[at++]), eh(t[at++]);
    for (int64_t i = 0; i < T; ++i) {
      const int64_t ahead = i + k < T ? ids[i + k] : 0;
      Vec joined = rms_norm(Vec(embed.v.begin() + ahead * H, embed.v.begin() + (ahead + 1) * H), enorm, s.rms_norm_eps);
      const Vec h = rms_norm(x[i], hnorm, s.rms_norm_eps);
      joined.insert(joined.end(), h.begin(), h.end());
      x[i] = eh.times(joined);
    }
    run_layer(s.num_layers + k - 1);
    const Mat own_norm(t[at++]);
    std::vector<Vec>& logits = ref.mtp_logits.emplace_back();
    for (int64_t i = 0; i < T; ++i) logits.push_back(head.times(rms_norm(x[i], own_norm, s.rms_norm_eps)));
  }
  return ref;
}

ModelSpec small_spec() {
  ModelSpec s = test::model("mixtral-tiny");
  s.vocab_size = 50;
  s.hidden_size = 16;
  s.intermediate_size = 24;
  s.num_layers = 2;
  s.num_attention_heads = 4;
  s.num_key_value_heads = 2;
  s.head_dim = 8;
  s.num_experts = 4;
  s.experts_per_token = 2;
  s.rope_theta = 10000;
  // Larger than a real init so attention and routing are far from uniform.
  s.initializer_range = 0.3;
  return s;
}

ParameterSet random_model(const ModelSpec& s, uint64_t seed, torch::ScalarType dtype = torch::kFloat) {
  ParameterSet p = ParameterSet::on_meta(mixtral_parameters(s));
  p.materialize(seed, dtype);
  // Norm weights start at one; make them differ so a wrong norm is visible (from the same seed,
  // so that a test sees the same model in every run).
  torch::NoGradGuard no_grad;
  torch::manual_seed(seed);
  for (size_t i = 0; i < p.infos().size(); ++i)
    if (p.infos()[i].init == InitKind::kOnes) p.tensors()[i].uniform_(0.5, 1.5);
  return p;
}

void expect_matches_reference(const ModelSpec& s, uint64_t seed, const torch::Tensor& bias = {}) {
  torch::manual_seed(7);
  const ParameterSet p = random_model(s, seed);
  const int64_t B = 2, T = 9;
  const torch::Tensor ids = torch::randint(s.vocab_size, {B, T}, torch::kLong);
  const ForwardResult out =
      mixtral_forward(s, MixtralWeights::bind(s, p.tensors(), bias), ids, LoadBalancing::kAuxLoss);
  ASSERT_EQ(out.logits.sizes(), (std::vector<int64_t>{B, T, s.vocab_size}));
  // Token counts of the blocks with experts (a dense block has none; the multi-token prediction
  // blocks' last).
  std::vector<std::vector<int64_t>> load(s.moe_blocks(), std::vector<int64_t>(s.num_experts, 0));
  for (int64_t b = 0; b < B; ++b) {
    std::vector<int64_t> seq(ids[b].data_ptr<int64_t>(), ids[b].data_ptr<int64_t>() + T);
    const Reference ref = reference_forward(s, p.tensors(), seq, bias);
    for (int64_t i = 0; i < T; ++i)
      for (int64_t v = 0; v < s.vocab_size; ++v)
        ASSERT_NEAR(out.logits[b][i][v].item<double>(), ref.logits[i][v], 1e-5)
            << "sequence " << b << " token " << i << " vocab " << v;
    ASSERT_EQ(out.mtp_logits.size(), ref.mtp_logits.size());
    for (size_t k = 0; k < ref.mtp_logits.size(); ++k)
      for (int64_t i = 0; i < T; ++i)
        for (int64_t v = 0; v < s.vocab_size; ++v)
          ASSERT_NEAR(out.mtp_logits[k][b][i][v].item<double>(), ref.mtp_logits[k][i][v], 1e-5)
              << "depth " << k + 1 << " sequence " << b << " token " << i << " vocab " << v;
    ASSERT_EQ(ref.expert_load.size(), load.size());
    for (size_t l = 0; l < load.size(); ++l)
      for (int64_t e = 0; e < s.num_experts; ++e) load[l][e] += ref.expert_load[l][e];
  }
  for (int64_t l = 0; l < s.moe_blocks(); ++l)
    for (int64_t e = 0; e < s.num_experts; ++e)
      EXPECT_EQ(out.tokens_per_expert[l][e].item<int64_t>(), load[l][e]) << "layer " << l << " expert " << e;
}

TEST(Mixtral, LogitsMatchPlainReferenceInFp32) { expect_matches_reference(small_spec(), 11); }

// Token dropping: each layer drops, beyond every expert's capacity, exactly the slots over it
// (whatever the policy), a factor with room for every token changes nothing, and a dropped slot
// adds nothing: dropping every slot is the model whose experts output zero.
TEST(Mixtral, CapacityDropsTheSlotsOverIt) {
  const ModelSpec s = small_spec();
  const ParameterSet p = random_model(s, 5);
  torch::manual_seed(3);
  const int64_t B = 2, T = 9;
  const torch::Tensor ids = torch::randint(s.vocab_size, {B, T}, torch::kLong);
  const MixtralWeights w = MixtralWeights::bind(s, p.tensors());
  MoeConfig moe;
  moe.load_balancing = LoadBalancing::kNone;
  const ForwardResult dropless = mixtral_forward(s, w, ids, moe);
  EXPECT_EQ(dropless.dropped_slots.sum().item<int64_t>(), 0);
  for (const TokenDropPolicy policy : {TokenDropPolicy::kProbs, TokenDropPolicy::kPosition}) {
    moe.capacity_factor = 1.0;
    moe.drop_policy = policy;
    const ForwardResult out = mixtral_forward(s, w, ids, moe);
    const int64_t capacity = expert_capacity(B * T, s.experts_per_token, s.num_experts, 1.0);
    EXPECT_GT(out.dropped_slots.sum().item<int64_t>(), 0) << "nothing over capacity: the case tests nothing";
    for (int64_t l = 0; l < s.num_layers; ++l) {
      const int64_t over = (out.tokens_per_expert[l] - capacity).clamp_min(0).sum().item<int64_t>();
      EXPECT_EQ(out.dropped_slots[l].item<int64_t>(), over) << "layer " << l;
    }
  }
  moe.capacity_factor = static_cast<double>(s.num_experts);  // every expert has room for all tokens
  EXPECT_TRUE(torch::equal(mixtral_forward(s, w, ids, moe).logits, dropless.logits));
  // Every slot dropped (a replay that keeps none) against experts whose output is zero.
  moe.capacity_factor = 1.0;
  const RouteOverride keep_none = [&](int64_t, const torch::Tensor& logits) {
    const Routing r = route(logits, s.experts_per_token, LoadBalancing::kNone);
    return ChosenExperts{r.experts, r.experts, torch::zeros_like(r.experts, torch::kBool)};
  };
  const ForwardResult none_kept = mixtral_forward(s, w, ids, moe, keep_none);
  std::vector<torch::Tensor> zeroed;
  for (const torch::Tensor& t : p.tensors()) zeroed.push_back(t.detach().clone());
  MixtralWeights silent = MixtralWeights::bind(s, zeroed);
  for (LayerWeights& layer : silent.layers)
    for (torch::Tensor& w2 : layer.w2) w2.zero_();
  const ForwardResult zero_experts = mixtral_forward(s, silent, ids, LoadBalancing::kNone);
  EXPECT_TRUE(torch::allclose(none_kept.logits, zero_experts.logits, 1e-6, 1e-6));
  EXPECT_FALSE(torch::allclose(none_kept.logits, dropless.logits, 1e-3, 1e-3));
}

TEST(Mixtral, SlidingWindowMatchesReference) {
  ModelSpec s = small_spec();
  s.sliding_window = 3;
  expect_matches_reference(s, 12);
}

// GPT-OSS's pattern: the window on every other block, the whole sequence on the others.
TEST(Mixtral, SlidingWindowOnSomeBlocksMatchesReference) {
  ModelSpec s = small_spec();
  s.sliding_window = 3;
  s.full_attention_step = 2;
  expect_matches_reference(s, 17);
  // Each kind of block on its own would give other logits: the pattern is what was applied.
  ModelSpec all_windowed = s, none_windowed = s;
  all_windowed.full_attention_step = 0;
  none_windowed.sliding_window.reset();
  none_windowed.full_attention_step = 0;
  const ParameterSet p = random_model(s, 17);
  const MixtralWeights w = MixtralWeights::bind(s, p.tensors());
  const torch::Tensor ids = torch::randint(s.vocab_size, {1, 12}, torch::kLong);
  auto logits = [&](const ModelSpec& spec) { return mixtral_forward(spec, w, ids, LoadBalancing::kAuxLoss).logits; };
  EXPECT_FALSE(torch::allclose(logits(s), logits(all_windowed), 1e-5, 1e-5));
  EXPECT_FALSE(torch::allclose(logits(s), logits(none_windowed), 1e-5, 1e-5));
}

// Qwen3-MoE's attention: the norms (made to differ from one by random_model) act per head.
TEST(Mixtral, QkNormMatchesReference) {
  ModelSpec s = small_spec();
  s.qk_norm = true;
  s.experts_per_token = 3;  // fine-grained: more of fewer-wide experts per token
  expect_matches_reference(s, 14);
}

// Shared experts beside the routed ones, every token through them: ungated (DeepSeek) and
// gated by a sigmoid (Qwen2-MoE).
TEST(Mixtral, SharedExpertsMatchReference) {
  ModelSpec s = small_spec();
  s.shared_expert_intermediate_size = 40;
  expect_matches_reference(s, 15);
  s.shared_expert_gate = true;
  expect_matches_reference(s, 16);
}

// Dense blocks among the MoE blocks: DeepSeek's first block (with shared experts in the others),
// and Qwen2-MoE's every other block (blocks 1 and 3 with experts).
TEST(Mixtral, DenseBlocksMatchReference) {
  ModelSpec s = small_spec();
  s.num_layers = 3;
  s.first_dense_layers = 1;
  s.dense_intermediate_size = 36;
  s.shared_expert_intermediate_size = 24;
  expect_matches_reference(s, 17);
  s = small_spec();
  s.num_layers = 4;
  s.moe_layer_step = 2;
  s.moe_layer_offset = 1;
  s.dense_intermediate_size = 36;
  ASSERT_EQ(s.moe_layers(), 2);
  expect_matches_reference(s, 18);
}

// DeepSeek-V3's router: sigmoid scores, top-2 from the best 2 of 4 groups of 2 experts, the
// weights scaled (the balancing bias starts at zero; routing_test.cc checks it moved).
TEST(Mixtral, SigmoidRouterInGroupsMatchesReference) {
  ModelSpec s = small_spec();
  s.num_experts = 8;
  s.router_scoring = RouterScoring::kSigmoid;
  s.router_groups = 4;
  s.router_group_topk = 2;
  s.routed_scaling_factor = 2.5;
  expect_matches_reference(s, 23);
}

// Latent attention with a query latent (DeepSeek-V3) and without one (DeepSeek-V2-Lite): heads
// of 8 (6 without rotation, 2 rotated, DeepSeek's interleaved pairs), values of 4, latents of 6
// and 12.
TEST(Mixtral, LatentAttentionMatchesReference) {
  ModelSpec s = small_spec();
  s.num_key_value_heads = s.num_attention_heads;
  s.head_dim = 8;
  s.qk_rope_head_dim = 2;
  s.v_head_dim = 4;
  s.kv_lora_rank = 12;
  s.q_lora_rank = 6;
  expect_matches_reference(s, 29);
  s.q_lora_rank = 0;
  s.qk_rope_head_dim = 4;
  expect_matches_reference(s, 31);
}

// Multi-token prediction two deep: each depth's logits, the second built on the first's output.
TEST(Mixtral, MultiTokenPredictionMatchesReference) {
  ModelSpec s = small_spec();
  s.mtp_layers = 2;
  expect_matches_reference(s, 37);
}

// DeepSeek-V3's blocks together: latent attention, a dense first block, a shared expert, the
// sigmoid router in groups and a multi-token prediction block after the decoder.
TEST(Mixtral, DeepSeekV3BlocksMatchReference) {
  ModelSpec s = small_spec();
  s.num_layers = 3;
  s.num_experts = 8;
  s.num_key_value_heads = s.num_attention_heads;
  s.qk_rope_head_dim = 2;
  s.v_head_dim = 4;
  s.kv_lora_rank = 12;
  s.q_lora_rank = 6;
  s.first_dense_layers = 1;
  s.dense_intermediate_size = 32;
  s.shared_expert_intermediate_size = 24;
  s.router_scoring = RouterScoring::kSigmoid;
  s.router_groups = 4;
  s.router_group_topk = 2;
  s.routed_scaling_factor = 2.5;
  s.mtp_layers = 1;
  expect_matches_reference(s, 41);
  // With balancing biases, each block with experts its own row (the module's last), large
  // enough to change choices.
  torch::manual_seed(43);
  expect_matches_reference(s, 41, torch::randn({s.moe_blocks(), s.num_experts}) * 0.3);
}

// The modules' loss: each depth's cross entropy against the token k + 1 ahead (none for the last
// k + 1 positions), their mean weighted into the total beside the next-token loss.
TEST(Mixtral, MultiTokenPredictionLossPredictsFurtherAhead) {
  ModelSpec s = small_spec();
  s.mtp_layers = 2;
  s.mtp_loss_weight = 0.3;
  const ParameterSet p = random_model(s, 43);
  torch::manual_seed(5);
  const int64_t T = 7;
  const torch::Tensor ids = torch::randint(s.vocab_size, {2, T}, torch::kLong);
  MoeConfig moe;
  moe.load_balancing = LoadBalancing::kNone;
  const ForwardResult out = mixtral_forward(s, MixtralWeights::bind(s, p.tensors()), ids, moe);
  const LossTerms loss = mixtral_loss(s, moe, out, ids);
  double depths = 0;
  for (int64_t k = 1; k <= 2; ++k) {
    double sum = 0;
    int64_t n = 0;
    for (int64_t b = 0; b < 2; ++b)
      for (int64_t i = 0; i + k + 1 < T; ++i) {
        const torch::Tensor row = out.mtp_logits[static_cast<size_t>(k - 1)][b][i].to(torch::kDouble);
        sum += torch::logsumexp(row, 0).item<double>() - row[ids[b][i + k + 1].item<int64_t>()].item<double>();
        ++n;
      }
    depths += sum / static_cast<double>(n);
  }
  ASSERT_TRUE(loss.mtp.defined());
  EXPECT_NEAR(loss.mtp.item<double>(), depths / 2, 1e-5);
  EXPECT_NEAR(loss.total.item<double>(), loss.lm.item<double>() + 0.3 * depths / 2, 1e-5);
  EXPECT_TRUE(torch::equal(mtp_input_ids(ids, 2).narrow(1, 0, T - 2), ids.narrow(1, 2, T - 2)));
  EXPECT_EQ(mtp_input_ids(ids, 2).narrow(1, T - 2, 2).abs().sum().item<int64_t>(), 0);
}

TEST(Mixtral, MultiQueryAttentionMatchesReference) {
  ModelSpec s = small_spec();
  s.num_key_value_heads = 1;
  s.experts_per_token = 1;
  expect_matches_reference(s, 13);
}

TEST(Mixtral, ReferenceSeesAWrongModel) {
  // The comparison can fail: perturb one expert weight and the logits move beyond tolerance.
  const ModelSpec s = small_spec();
  ParameterSet p = random_model(s, 11);
  const torch::Tensor ids = torch::arange(6, torch::kLong).view({1, 6});
  std::vector<int64_t> seq(ids[0].data_ptr<int64_t>(), ids[0].data_ptr<int64_t>() + 6);
  const Reference before = reference_forward(s, p.tensors(), seq);
  // An expert of the last layer that some token is routed to.
  const std::vector<int64_t>& load = before.expert_load[1];
  const int64_t used = std::max_element(load.begin(), load.end()) - load.begin();
  ASSERT_GT(load[static_cast<size_t>(used)], 0);
  {
    torch::NoGradGuard no_grad;
    const std::string name = "model.layers.1.block_sparse_moe.experts." + std::to_string(used) + ".w2.weight";
    p.tensors()[static_cast<size_t>(p.find(name))].add_(0.05);
  }
  const ForwardResult out = mixtral_forward(s, MixtralWeights::bind(s, p.tensors()), ids, LoadBalancing::kAuxLoss);
  double worst = 0;
  for (int64_t i = 0; i < 6; ++i)
    for (int64_t v = 0; v < s.vocab_size; ++v)
      worst = std::max(worst, std::abs(out.logits[0][i][v].item<double>() - before.logits[i][v]));
  EXPECT_GT(worst, 1e-3);
}

TEST(Mixtral, ParameterCountMatchesModelSpec) {
  const ModelSpec s = test::model("mixtral-tiny");
  const ParameterSet p = ParameterSet::on_meta(mixtral_parameters(s));
  EXPECT_EQ(p.numel(), count_parameters(s).total());
  const ModelSpec big = test::model("mixtral-8x7b");
  EXPECT_EQ(ParameterSet::on_meta(mixtral_parameters(big)).numel(), int64_t{46'702'792'704});
  // The planner's count of DeepSeek-V3 and Qwen3's models is the executor's: latent attention,
  // dense blocks, shared experts and the multi-token prediction module (682.6B for DeepSeek-V3,
  // its report's 671B plus the module's block and projection).
  for (const char* name : {"deepseek-v3", "kimi-k2", "moonlight-16b-a3b", "qwen3-30b-a3b", "deepseek-moe-16b"}) {
    const ModelSpec m = test::model(name);
    EXPECT_EQ(ParameterSet::on_meta(mixtral_parameters(m)).numel(), count_parameters(m).total()) << name;
  }
}

TEST(Mixtral, DelayedInitLeavesNothingOnMeta) {
  const ModelSpec s = small_spec();
  ParameterSet p = ParameterSet::on_meta(mixtral_parameters(s));
  for (const torch::Tensor& t : p.tensors()) EXPECT_TRUE(t.is_meta());
  EXPECT_THROW(p.check_materialized(), std::logic_error);
  p.materialize(5, torch::kFloat);
  EXPECT_NO_THROW(p.check_materialized());
  for (const torch::Tensor& t : p.tensors()) EXPECT_FALSE(t.is_meta());
}

TEST(Mixtral, InitialWeightsDoNotDependOnWhichParametersARankHolds) {
  // A rank holding only expert 3 of layer 1 (as under expert parallelism) gets the same values
  // as the rank holding the whole model.
  const ModelSpec s = small_spec();
  ParameterSet whole = ParameterSet::on_meta(mixtral_parameters(s));
  whole.materialize(99, torch::kFloat);
  std::vector<ParamInfo> mine;
  for (const ParamInfo& info : mixtral_parameters(s))
    if (info.expert == 3 && info.block == 2) mine.push_back(info);
  ASSERT_EQ(mine.size(), 3u);
  ParameterSet part = ParameterSet::on_meta(mine);
  part.materialize(99, torch::kFloat);
  for (size_t i = 0; i < mine.size(); ++i)
    EXPECT_TRUE(torch::equal(part.tensors()[i], whole.tensors()[static_cast<size_t>(whole.find(mine[i].name))]))
        << mine[i].name;
  // And a different seed gives different weights.
  ParameterSet other = ParameterSet::on_meta(mine);
  other.materialize(100, torch::kFloat);
  EXPECT_FALSE(torch::equal(other.tensors()[0], part.tensors()[0]));
  // Init statistics: std close to initializer_range.
  const double std = whole.tensors()[static_cast<size_t>(whole.find("model.embed_tokens.weight"))].std().item<double>();
  EXPECT_NEAR(std, s.initializer_range, 0.05 * s.initializer_range);
}

TEST(Mixtral, Bf16ForwardStaysCloseToFp32) {
  const ModelSpec s = small_spec();
  const ParameterSet p32 = random_model(s, 21);
  std::vector<torch::Tensor> p16;
  for (const torch::Tensor& t : p32.tensors()) p16.push_back(t.to(torch::kBFloat16));
  torch::manual_seed(21);
  const torch::Tensor ids = torch::randint(s.vocab_size, {2, 7}, torch::kLong);
  const auto a = mixtral_forward(s, MixtralWeights::bind(s, p32.tensors()), ids, LoadBalancing::kNone);
  const auto b = mixtral_forward(s, MixtralWeights::bind(s, p16), ids, LoadBalancing::kNone);
  EXPECT_EQ(b.router_logits[0].scalar_type(), torch::kBFloat16);
  EXPECT_EQ(b.logits.scalar_type(), torch::kFloat);
  // bf16 rounding may flip a near-tie in the router to another expert, which legitimately
  // changes that token's output: compare the tokens routed alike in every layer, and require
  // that most are.
  torch::Tensor same = torch::ones({ids.numel()}, torch::kBool);
  for (size_t l = 0; l < a.router_logits.size(); ++l) {
    const auto top = [&](const torch::Tensor& logits) {
      return std::get<0>(torch::sort(std::get<1>(logits.to(torch::kFloat).topk(s.experts_per_token, -1)), -1));
    };
    same &= (top(a.router_logits[l]) == top(b.router_logits[l])).all(-1);
  }
  EXPECT_GE(same.sum().item<int64_t>(), ids.numel() * 8 / 10) << "most tokens keep their experts in bf16";
  const torch::Tensor la = a.logits.reshape({ids.numel(), -1}).index({same});
  const torch::Tensor lb = b.logits.reshape({ids.numel(), -1}).index({same});
  // Relative error of the whole logit matrix (bf16 keeps about 3 significant digits per op).
  const double error = ((la - lb).norm() / la.norm()).item<double>();
  std::printf("bf16 vs fp32 logits: relative error %.4f over %lld tokens\n", error,
              static_cast<long long>(same.sum().item<int64_t>()));
  EXPECT_LT(error, 0.05);
}

TEST(Mixtral, LossIsHuggingFaceShiftedCrossEntropy) {
  const ModelSpec s = small_spec();
  const ParameterSet p = random_model(s, 31);
  const torch::Tensor ids = torch::randint(s.vocab_size, {2, 5}, torch::kLong);
  const ForwardResult out = mixtral_forward(s, MixtralWeights::bind(s, p.tensors()), ids, LoadBalancing::kAuxLoss);
  MoeConfig moe;
  moe.load_balancing = LoadBalancing::kAuxLoss;
  moe.aux_loss_coef = 0.01;
  moe.z_loss_coef = 0.001;
  const LossTerms loss = mixtral_loss(s, moe, out, ids);
  double nll = 0;
  for (int64_t b = 0; b < 2; ++b)
    for (int64_t i = 0; i + 1 < 5; ++i) {
      const torch::Tensor row = out.logits[b][i].to(torch::kDouble);
      nll += (torch::logsumexp(row, 0) - row[ids[b][i + 1].item<int64_t>()]).item<double>();
    }
  EXPECT_NEAR(loss.lm.item<double>(), nll / 8, 1e-5);
  EXPECT_NEAR(loss.total.item<double>(),
              loss.lm.item<double>() + 0.01 * loss.aux.item<double>() + 0.001 * loss.z.item<double>(), 1e-5);
  moe.load_balancing = LoadBalancing::kSinkhorn;  // the aux term belongs to aux_loss only
  EXPECT_NEAR(mixtral_loss(s, moe, out, ids).total.item<double>(),
              loss.lm.item<double>() + 0.001 * loss.z.item<double>(), 1e-5);
}

TEST(Mixtral, GradientsReachEveryUsedParameter) {
  const ModelSpec s = small_spec();
  ParameterSet p = random_model(s, 41);
  for (torch::Tensor& t : p.tensors()) t.requires_grad_(true);
  const torch::Tensor ids = torch::randint(s.vocab_size, {4, 16}, torch::kLong);
  const ForwardResult out = mixtral_forward(s, MixtralWeights::bind(s, p.tensors()), ids, LoadBalancing::kAuxLoss);
  MoeConfig moe;
  moe.load_balancing = LoadBalancing::kAuxLoss;
  mixtral_loss(s, moe, out, ids).total.backward();
  for (size_t i = 0; i < p.infos().size(); ++i) {
    const ParamInfo& info = p.infos()[i];
    const int64_t layer = info.block - 1;
    const bool routed = info.expert < 0 || out.tokens_per_expert[layer][info.expert].item<int64_t>() > 0;
    if (routed) {
      ASSERT_TRUE(p.tensors()[i].grad().defined()) << info.name;
      EXPECT_GT(p.tensors()[i].grad().abs().sum().item<double>(), 0) << info.name;
    }
  }
}


// The grouped kernel over stacked weights against one multiply per expert: the same outputs and
// the same gradients of the rows and of every expert's weights, in fp32 and in bf16, with an
// expert that gets no rows and groups of sizes that are no multiple of the kernel's alignment.
TEST(Mixtral, StackedExpertsMatchEachExpertsOwn) {
  for (const torch::ScalarType type : {torch::kFloat, torch::kBFloat16}) {
    torch::manual_seed(3);
    const int64_t experts = 5, hidden = 16, ffn = 24;
    const std::vector<int64_t> rows_per_expert = {3, 0, 9, 1, 6};
    std::vector<int64_t> expert_of;
    for (int64_t e = 0; e < experts; ++e)
      for (int64_t i = 0; i < rows_per_expert[static_cast<size_t>(e)]; ++i) expert_of.push_back(e);
    const torch::Tensor rows = torch::randn({static_cast<int64_t>(expert_of.size()), hidden}).to(type);
    std::vector<torch::Tensor> w1, w2, w3;
    for (int64_t e = 0; e < experts; ++e) {
      w1.push_back((torch::randn({ffn, hidden}) * 0.3).to(type).requires_grad_(true));
      w2.push_back((torch::randn({hidden, ffn}) * 0.3).to(type).requires_grad_(true));
      w3.push_back((torch::randn({ffn, hidden}) * 0.3).to(type).requires_grad_(true));
    }
    const torch::Tensor upstream = torch::randn({rows.size(0), hidden}).to(type);
    const torch::Tensor x1 = rows.clone().requires_grad_(true);
    const torch::Tensor each = grouped_experts(x1, rows_per_expert, [&](int64_t e) {
      return ExpertWeights{w1[static_cast<size_t>(e)], w2[static_cast<size_t>(e)], w3[static_cast<size_t>(e)]};
    });
    (each * upstream).sum().backward();

    const torch::Tensor w13 = torch::cat({torch::stack(w1), torch::stack(w3)}, 1).detach().requires_grad_(true);
    const torch::Tensor w2s = torch::stack(w2).detach().requires_grad_(true);
    const torch::Tensor x2 = rows.clone().requires_grad_(true);
    const torch::Tensor grouped = stacked_experts(x2, torch::tensor(expert_of, torch::kLong), w13, w2s);
    (grouped * upstream).sum().backward();

    const double tol = type == torch::kFloat ? 1e-5 : 2e-2;
    auto expect_near = [tol](const torch::Tensor& a, const torch::Tensor& b, const std::string& what) {
      const double scale = std::max(1.0, a.to(torch::kDouble).abs().max().item<double>());
      EXPECT_LE((a.to(torch::kDouble) - b.to(torch::kDouble)).abs().max().item<double>(), tol * scale) << what;
    };
    const std::string name = c10::toString(type);
    ASSERT_EQ(grouped.sizes(), each.sizes());
    expect_near(grouped, each, name + " outputs");
    expect_near(x2.grad(), x1.grad(), name + " row gradients");
    for (int64_t e = 0; e < experts; ++e) {
      const auto j = static_cast<size_t>(e);
      const std::string of = name + " expert " + std::to_string(e);
      if (rows_per_expert[j] == 0) {
        EXPECT_EQ(w13.grad()[e].abs().max().item<double>(), 0) << of << ": no rows, no gradient";
        continue;
      }
      expect_near(w13.grad()[e].narrow(0, 0, ffn), w1[j].grad(), of + " w1");
      expect_near(w13.grad()[e].narrow(0, ffn, ffn), w3[j].grad(), of + " w3");
      expect_near(w2s.grad()[e], w2[j].grad(), of + " w2");
    }
  }
}

// The whole model with each block's experts stacked (as the trainer stacks them for the grouped
// kernel): the same logits, and each expert's gradient handed back to its own tensor.
TEST(Mixtral, StackedWeightsGiveTheSameModelAndGradients) {
  const ModelSpec s = small_spec();
  ParameterSet p = random_model(s, 43);
  for (torch::Tensor& t : p.tensors()) t.requires_grad_(true);
  const torch::Tensor ids = torch::randint(s.vocab_size, {3, 16}, torch::kLong);
  MoeConfig moe;
  moe.load_balancing = LoadBalancing::kAuxLoss;
  const ForwardResult each = mixtral_forward(s, MixtralWeights::bind(s, p.tensors()), ids, moe);
  mixtral_loss(s, moe, each, ids).total.backward();

  ExpertStacks stacks(s, p.tensors(), torch::kFloat);
  MixtralWeights weights = MixtralWeights::bind(s, p.tensors());
  stacks.bind(weights);
  ASSERT_TRUE(weights.layers[0].experts_w13.defined());
  const ForwardResult stacked = mixtral_forward(s, weights, ids, moe);
  EXPECT_TRUE(torch::allclose(stacked.logits, each.logits, 1e-5, 1e-5));
  EXPECT_TRUE(torch::equal(stacked.tokens_per_expert, each.tokens_per_expert));
  mixtral_loss(s, moe, stacked, ids).total.backward();
  std::vector<torch::Tensor> grads(p.tensors().size());
  stacks.add_gradients(grads);
  int compared = 0;
  for (size_t i = 0; i < p.infos().size(); ++i) {
    if (!stacks.stacked(i)) {
      EXPECT_FALSE(grads[i].defined()) << p.infos()[i].name;
      continue;
    }
    ASSERT_TRUE(grads[i].defined()) << p.infos()[i].name;
    // The first forward ran through each expert's own tensor, the second through the stack's
    // copy: the stack's gradient, handed back, is the tensor's own (zero for an expert no token
    // chose, whose own tensor got none).
    const torch::Tensor own = p.tensors()[i].grad();
    const torch::Tensor reference = own.defined() ? own : torch::zeros_like(grads[i]);
    EXPECT_TRUE(torch::allclose(grads[i], reference, 1e-4, 1e-6)) << p.infos()[i].name;
    ++compared;
  }
  EXPECT_EQ(compared, 3 * s.num_experts * s.num_layers);
}

}  // namespace
}  // namespace moeplan::executor
