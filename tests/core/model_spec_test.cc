#include "moeplan/core/model_spec.h"

#include <gtest/gtest.h>

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
  try {
    model_from_hf_config(config, "config.json");
    FAIL() << "expected an error";
  } catch (const InputError& e) {
    ASSERT_EQ(e.diagnostics().size(), 1u);
    EXPECT_EQ(e.diagnostics()[0].path, "num_local_expert");
    EXPECT_EQ(e.diagnostics()[0].message, "unknown field");
  }
}

TEST(ModelSpec, HuggingFaceConfigRejectsOtherArchitectures) {
  const Json config = Json::parse(R"({"model_type": "llama"})");
  EXPECT_THROW(model_from_hf_config(config, "config.json"), InputError);
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
