#include "moeplan/core/model_spec.h"

#include "moeplan/core/parallel_config.h"

#include <gtest/gtest.h>

#include <tuple>

#include "problems.h"
#include "test_support.h"

namespace moeplan {
namespace {

// Mixtral 8x7B (h = 4096, ffn = 14336, 32 layers, 32 heads of 128, 8 KV heads, 8 experts,
// top-2, vocab 32000, untied head):
//   embedding = lm head = 32000 * 4096                       = 131,072,000 each
//   attention per layer = 2*4096*4096 + 2*4096*1024           = 41,943,040
//   norms per layer = 2*4096 = 8,192; router = 4096*8          = 32,768
//   one expert = 3 * 4096 * 14336                             = 176,160,768
//   dense = 2*131,072,000 + 4,096 + 32*(41,943,040 + 8,192 + 32,768)
//         = 262,148,096 + 32*41,984,000                       = 1,605,636,096
//   experts = 32 * 8 * 176,160,768                            = 45,097,156,608
//   total = 46,702,792,704 (the seed's "47 billion")
//   active = dense + 32 * 2 * 176,160,768
//          = 1,605,636,096 + 11,274,289,152 = 12,879,925,248 (the seed's "12.9 billion")
TEST(ModelSpec, Mixtral8x7bParameterCounts) {
  const ParamCounts p = count_parameters(test::model("mixtral-8x7b"));
  EXPECT_EQ(p.embedding, 131'072'000);
  EXPECT_EQ(p.lm_head, 131'072'000);
  EXPECT_EQ(p.attention_per_layer, 41'943'040);
  EXPECT_EQ(p.router_per_layer, 32'768);
  EXPECT_EQ(p.expert, 176'160'768);
  EXPECT_EQ(p.dense(), 1'605'636'096);
  EXPECT_EQ(p.experts(), 45'097'156'608);
  EXPECT_EQ(p.total(), 46'702'792'704);
  EXPECT_EQ(p.active(), 12'879'925'248);
}

// Which blocks have experts: the count over any range agrees with asking block by block, for
// dense blocks first (DeepSeek), every K-th block (Qwen2-MoE, Llama 4) and both.
TEST(ModelSpec, MoeBlocksInAnyRangeMatchTheBlockByBlockPattern) {
  ModelSpec m = test::model("mixtral-8x7b");
  m.dense_intermediate_size = 14336;
  for (const auto& [first, step, offset] : {std::tuple{3, 1, 0}, {0, 2, 1}, {0, 4, 1}, {5, 3, 0}, {2, 3, 2}}) {
    m.first_dense_layers = first;
    m.moe_layer_step = step;
    m.moe_layer_offset = offset;
    for (int64_t begin = 0; begin <= m.num_layers; ++begin)
      for (int64_t end = begin; end <= m.num_layers; ++end) {
        int64_t count = 0;
        for (int64_t i = begin; i < end; ++i) count += m.moe_layer(i) ? 1 : 0;
        ASSERT_EQ(m.moe_layers_in(begin, end), count) << first << " " << step << " " << offset << " [" << begin << ", "
                                                      << end << ")";
      }
  }
  m.first_dense_layers = 0;
  m.moe_layer_step = 2;
  m.moe_layer_offset = 1;  // blocks 1, 3, 5, ...
  EXPECT_FALSE(m.moe_layer(0));
  EXPECT_TRUE(m.moe_layer(1));
  EXPECT_EQ(m.moe_layers(), 16);
}

// Dense blocks among MoE blocks: three dense blocks of width 28,672 in place of three MoE blocks
// lose 3 x (8 experts + router) and gain 3 x 3 x 4096 x 28672; a token passes through the same
// matrices in either (top-2 of 14,336), less the router.
TEST(ModelSpec, DenseBlocksAreCountedApart) {
  const ModelSpec all = test::model("mixtral-8x7b");
  ModelSpec m = all;
  m.first_dense_layers = 3;
  m.dense_intermediate_size = 2 * 14336;
  const ParamCounts a = count_parameters(all), p = count_parameters(m);
  EXPECT_EQ(p.moe_layers, 29);
  EXPECT_EQ(p.dense_layers(), 3);
  EXPECT_EQ(p.dense_mlp_per_layer, 3 * 4096 * 28672);
  EXPECT_EQ(a.total() - p.total(), 3 * (int64_t{8} * 176'160'768 + 32'768 - 3 * 4096 * 28672));
  EXPECT_EQ(a.active() - p.active(), 3 * 32'768);
  EXPECT_DOUBLE_EQ(forward_flops_per_token(all, 4096) - forward_flops_per_token(m, 4096), 2.0 * 3 * 32'768);
  EXPECT_EQ(model_from_json(to_json(m), "profile"), m);
}

// DeepSeek-V3's latent attention per block: q 7168 x 1536 + 1536 x 128 x 192, kv 7168 x (512 +
// 64) + 512 x 128 x (128 + 128), o 128 x 128 x 7168; its norms the two of the block and the two
// latents'. Its attention core scores over 192 and sums over 128 per head.
TEST(ModelSpec, LatentAttentionIsCountedByItsProjections) {
  const ModelSpec m = test::model("deepseek-v3");
  const ParamCounts p = count_parameters(m);
  EXPECT_EQ(p.attention_per_layer, 7168 * 1536 + 1536 * 128 * 192 + 7168 * 576 + 512 * 128 * 256 + 128 * 128 * 7168);
  EXPECT_EQ(p.norms_per_layer, 2 * 7168 + 1536 + 512);
  ModelSpec no_latent = m;  // the same sizes read as plain attention: values of head_dim
  no_latent.kv_lora_rank = no_latent.q_lora_rank = no_latent.qk_rope_head_dim = no_latent.v_head_dim = 0;
  const double context = 4096 / 2.0;
  EXPECT_DOUBLE_EQ(forward_flops_per_token(no_latent, 4096) - forward_flops_per_token(m, 4096),
                   2.0 * static_cast<double>(count_parameters(no_latent).attention_per_layer - p.attention_per_layer) * 62 +
                       2.0 * 128 * (192 - 128) * context * 62);  // 61 blocks and the multi-token prediction one
  EXPECT_EQ(model_from_json(to_json(m), "profile"), m);
}

// Multi-token prediction (DeepSeek-V3's one module): one more MoE block, a 7168 x 14336
// projection with three norms, and one more pass through the lm head, all on the last stage.
TEST(ModelSpec, MultiTokenPredictionAddsABlockAProjectionAndAHead) {
  const ModelSpec m = test::model("deepseek-v3");
  ASSERT_EQ(m.mtp_layers, 1);
  ModelSpec without = m;
  without.mtp_layers = 0;
  const ParamCounts p = count_parameters(m), q = count_parameters(without);
  EXPECT_EQ(p.mtp_projection, 2 * 7168 * 7168 + 3 * 7168);
  EXPECT_EQ(p.total() - q.total(), q.dense_per_layer() + 256 * q.expert + p.mtp_projection);
  EXPECT_EQ(p.active() - q.active(), q.dense_per_layer() + 8 * q.expert + p.mtp_projection);
  // FLOPs per token: its block's GEMMs and attention core, the projection, the head.
  const double block = 2.0 * static_cast<double>(q.attention_per_layer + q.router_per_layer +
                                                 q.shared_expert_per_layer + 8 * q.expert) +
                       2.0 * 128 * (192 + 128) * 2048;
  const double added = block + 2.0 * 2 * 7168 * 7168 + 2.0 * 129280 * 7168;
  EXPECT_NEAR(forward_flops_per_token(m, 4096) - forward_flops_per_token(without, 4096), added, 1e-9 * added);
  // Its block is an MoE block after the last, on the last stage only.
  EXPECT_TRUE(m.moe_layer(61));
  EXPECT_EQ(m.blocks(), 62);
  EXPECT_EQ(m.moe_blocks(), 59);
  const StageBlockCounts one = stage_block_counts(m, ParallelConfig{}, 0);
  EXPECT_EQ(one.layers, 62);
  EXPECT_EQ(one.moe_layers, 59);
  ParallelConfig p2;
  p2.pipeline_parallel_degree = 2;
  p2.first_stage_layers = 31;
  p2.last_stage_layers = 30;
  EXPECT_EQ(stage_block_counts(m, p2, 0).layers, 31);
  EXPECT_EQ(stage_block_counts(m, p2, 0).moe_layers, 28);
  EXPECT_EQ(stage_block_counts(m, p2, 1).layers, 31);
  EXPECT_EQ(stage_block_counts(m, p2, 1).moe_layers, 31);
  const ModelSpec first = stage_blocks(m, p2, 0), last = stage_blocks(m, p2, 1);
  EXPECT_EQ(first.mtp_layers, 0);
  EXPECT_EQ(first.blocks(), 31);
  EXPECT_EQ(last.mtp_layers, 1);
  EXPECT_EQ(last.num_layers, 30);
  EXPECT_EQ(last.blocks(), 31);
  EXPECT_EQ(last.moe_blocks(), 31);
  EXPECT_EQ(model_from_json(to_json(m), "profile"), m);
}

// Windowed and full attention: GPT-OSS's 36 blocks alternate a 128-token window and the whole
// sequence, so a query sees (18 x 128 + 18 x 2048) / 36 = 1,088 keys on average at sequence
// 4,096; its FLOPs count that, and a window as long as the sequence is no window.
TEST(ModelSpec, WindowedBlocksSeeTheirWindow) {
  const ModelSpec m = test::model("gpt-oss-120b");
  EXPECT_DOUBLE_EQ(m.attention_context(4096), 1088.0);
  ModelSpec full = m;
  full.sliding_window.reset();
  full.full_attention_step = 0;
  EXPECT_DOUBLE_EQ(full.attention_context(4096), 2048.0);
  EXPECT_DOUBLE_EQ(m.attention_context(128), 64.0);  // the window covers the sequence
  ModelSpec every = m;
  every.full_attention_step = 0;
  EXPECT_DOUBLE_EQ(every.attention_context(4096), 128.0);
  // A pipeline stage of 9 of the 36 blocks sees the pattern's share, not 4 full blocks of 9.
  ParallelConfig p4;
  p4.pipeline_parallel_degree = 4;
  EXPECT_DOUBLE_EQ(stage_blocks(m, p4, 3).attention_context(4096), 1088.0);
  const double core = 2.0 * (64 * 64 + 64 * 64) * 36;  // per key of context, all blocks
  EXPECT_NEAR(forward_flops_per_token(full, 4096) - forward_flops_per_token(m, 4096), core * (2048 - 1088), 1e-6);
  EXPECT_EQ(model_from_json(to_json(m), "profile"), m);
  EXPECT_THROW(to_hf_config(m, "bfloat16"), InputError);
  EXPECT_STREQ(gpt_oss_variant_field(m), "model.full_attention_step");
  EXPECT_EQ(gpt_oss_variant_field(test::model("mixtral-8x7b")), nullptr);
}

// A pipeline stage's blocks: contiguous without interleaving, V chunks with it; the stages'
// counts add up to the model's either way.
TEST(ModelSpec, StagesCountTheirMoeBlocks) {
  ModelSpec m = test::model("mixtral-8x7b");
  m.first_dense_layers = 3;
  m.dense_intermediate_size = 14336;
  ParallelConfig p;
  p.pipeline_parallel_degree = 4;
  EXPECT_EQ(stage_block_counts(m, p, 0).moe_layers, 5);
  EXPECT_EQ(stage_block_counts(m, p, 1).moe_layers, 8);
  const ModelSpec first = stage_blocks(m, p, 0);
  EXPECT_EQ(first.num_layers, 8);
  EXPECT_EQ(first.first_dense_layers, 3);
  EXPECT_EQ(first.moe_layers(), 5);
  EXPECT_EQ(stage_blocks(m, p, 3).first_dense_layers, 0);  // no dense block there,
  EXPECT_EQ(stage_blocks(m, p, 3).dense_intermediate_size, 14336);  // but the width to price others'
  p.virtual_pipeline_degree = 2;  // chunks of 4 blocks: stage 0 holds blocks 0-3 and 16-19
  EXPECT_EQ(stage_block_counts(m, p, 0).moe_layers, 5);
  m.first_dense_layers = 0;
  m.moe_layer_step = 2;
  m.moe_layer_offset = 1;
  for (int64_t v : {1, 2}) {
    p.virtual_pipeline_degree = v;
    int64_t layers = 0, moe = 0;
    for (int64_t i = 0; i < 4; ++i) {
      layers += stage_block_counts(m, p, i).layers;
      moe += stage_block_counts(m, p, i).moe_layers;
    }
    EXPECT_EQ(layers, 32);
    EXPECT_EQ(moe, 16);
  }
}

TEST(ModelSpec, HuggingFaceConfigGivesTheSameModel) {
  // mistralai/Mixtral-8x7B-v0.1 config.json as published on the Hugging Face hub.
  const Json config = read_json_file(test::data_path("hf/mixtral-8x7b/config.json"));
  const ModelSpec hf = model_from_hf_config(config, "config.json");
  ModelSpec profile = test::model("mixtral-8x7b");
  EXPECT_EQ(count_parameters(hf).total(), count_parameters(profile).total());
  EXPECT_EQ(hf.head_dim, 128);
  EXPECT_EQ(hf.num_experts, 8);
  EXPECT_EQ(hf.experts_per_token, 2);
  EXPECT_FALSE(hf.sliding_window.has_value());
}

TEST(ModelSpec, HuggingFaceConfigRejectsMisspeltField) {
  const Json config = Json::parse(R"({"model_type": "mixtral", "num_local_expert": 16})");
  const auto problems = test::problems_of([&] { model_from_hf_config(config, "config.json"); }, "config.json");
  ASSERT_EQ(problems.size(), 1u);
  EXPECT_EQ(problems[0].path, "num_local_expert");
  EXPECT_EQ(problems[0].message, "unknown field");
}

TEST(ModelSpec, HuggingFaceConfigRejectsOtherArchitectures) {
  const Json config = Json::parse(R"({"model_type": "gpt2"})");
  const auto problems = test::problems_of([&] { model_from_hf_config(config, "config.json"); }, "config.json");
  ASSERT_GE(problems.size(), 1u);
  EXPECT_EQ(problems[0].path, "model_type");
  EXPECT_EQ(problems[0].message, "expected \"mixtral\", \"qwen2_moe\", \"qwen3_moe\", \"deepseek\", \"deepseek_v2\", \"deepseek_v3\", \"kimi_k2\", \"gpt_oss\" or \"llama\", got \"gpt2\"");
}

// Dense models count their parameters as published: Llama 3 8B and Llama 2 70B to the
// parameter (the sums of the tensors of their Hugging Face checkpoints: 8,030,261,248 and
// 68,976,648,192); GPT-3 175B to its rounded 175.0B, less what moeplan leaves out (position
// embeddings and biases, about 0.4B):
//   Llama 3 8B: 2 * 128256 * 4096 + 4096 + 32 * (2*4096*4096 + 2*4096*1024 + 2*4096 + 3*4096*14336)
//   GPT-3: 50257 * 12288 (tied) + 12288 + 96 * (4 * 12288^2 + 2 * 12288 + 2 * 12288 * 49152)
TEST(ModelSpec, DenseModelsHaveTheirPublishedParameterCounts) {
  const ParamCounts llama3 = count_parameters(test::model("llama-3-8b"));
  EXPECT_EQ(llama3.total(), 8'030'261'248);
  EXPECT_EQ(llama3.router_per_layer, 0);
  EXPECT_EQ(llama3.active(), llama3.total());
  EXPECT_EQ(count_parameters(test::model("llama-2-70b")).total(), 68'976'648'192);
  const ModelSpec gpt3 = test::model("gpt3-175b");
  EXPECT_TRUE(gpt3.dense());
  EXPECT_EQ(gpt3.mlp, Mlp::kGelu);
  const ParamCounts g = count_parameters(gpt3);
  EXPECT_EQ(g.expert, 2 * 12288 * 49152);  // fc1 and fc2
  EXPECT_EQ(g.lm_head, 0);                 // tied to the embedding
  EXPECT_EQ(g.total(), 174'566'105'088);
  EXPECT_NEAR(static_cast<double>(g.total()) / 175.0e9, 1.0, 0.003);
  // Forward FLOPs per token: 2 per weight a token passes through (the tied head once more as
  // the lm head's GEMM), plus attention's scores and weighted sum.
  const double weights = 96.0 * (4.0 * 12288 * 12288 + 2.0 * 12288 * 49152) + 50257.0 * 12288;
  EXPECT_DOUBLE_EQ(forward_flops_per_token(gpt3, 2048), 2.0 * weights + 4.0 * 12288 * 1024 * 96);
}

TEST(ModelSpec, HuggingFaceLlamaConfigIsADenseModel) {
  // meta-llama/Llama-2-70b-hf config.json.
  const ModelSpec hf = model_from_hf_config(read_json_file(test::data_path("hf/llama-2-70b/config.json")), "config.json");
  EXPECT_EQ(hf.name, "meta-llama/Llama-2-70b-hf");
  EXPECT_TRUE(hf.dense());
  EXPECT_EQ(hf.experts_per_token, 1);
  EXPECT_EQ(hf.mlp, Mlp::kSwiGlu);
  EXPECT_EQ(hf.num_key_value_heads, 8);
  EXPECT_DOUBLE_EQ(hf.rope_theta, 1e4);  // LlamaConfig's default
  EXPECT_EQ(count_parameters(hf).total(), count_parameters(test::model("llama-2-70b")).total());
  // Without num_key_value_heads, LlamaConfig gives every query head its own.
  const ModelSpec mha = model_from_hf_config(Json::parse(R"({"model_type": "llama", "num_attention_heads": 16,
      "hidden_size": 2048})"), "config.json");
  EXPECT_EQ(mha.num_key_value_heads, 16);
  EXPECT_EQ(mha.head_dim, 128);
  // A Mixtral field in a Llama config is a mistake, and so named.
  const Json mixed = Json::parse(R"({"model_type": "llama", "num_local_experts": 8})");
  const auto problems = test::problems_of([&] { model_from_hf_config(mixed, "config.json"); }, "config.json");
  ASSERT_EQ(problems.size(), 1u);
  EXPECT_EQ(problems[0].path, "num_local_experts");
  EXPECT_EQ(problems[0].message, "unknown field");
}

TEST(ModelSpec, FeedForwardKindIsReadAndWritten) {
  ModelSpec m = test::model("gpt3-175b");
  EXPECT_EQ(model_from_json(Json::parse(to_json(m).dump()), "round trip"), m);
  Json bad = Json::parse(to_json(m).dump());
  bad["mlp"] = "relu";
  const auto problems = test::problems_of([&] { model_from_json(bad, "bad.json"); }, "bad.json");
  ASSERT_EQ(problems.size(), 1u);
  EXPECT_EQ(problems[0].path, "mlp");
  // A profile without the field has SwiGLU, as Mixtral does.
  Json old = Json::parse(to_json(test::model("mixtral-8x7b")).dump());
  old.erase("mlp");
  EXPECT_EQ(model_from_json(old, "old.json").mlp, Mlp::kSwiGlu);
}

TEST(ModelSpec, Mixtral8x22bIsAbout141BillionParameters) {
  const ModelSpec m = test::model("mixtral-8x22b");
  const ParamCounts p = count_parameters(m);
  // Mistral's announcement: 141B total, 39B active.
  EXPECT_NEAR(static_cast<double>(p.total()) / 1e9, 141.0, 0.5);
  EXPECT_NEAR(static_cast<double>(p.active()) / 1e9, 39.0, 0.5);
}

TEST(ModelSpec, ProfileRoundTrips) {
  const ModelSpec m = test::model("mixtral-8x7b");
  const Json text = Json::parse(to_json(m).dump());
  EXPECT_EQ(model_from_json(text, "round trip"), m);
}

}  // namespace
}  // namespace moeplan
