#include <gtest/gtest.h>

#include "moeplan/core/parallel_config.h"

namespace moeplan {
namespace {

ParallelConfig mesh(const char* placement, int64_t w, int64_t e, int64_t s, int64_t t, int64_t p) {
  ParallelConfig c;
  c.world_size = w;
  c.expert_parallel_degree = e;
  c.hybrid_shard_degree = s;
  c.tensor_parallel_degree = t;
  c.pipeline_parallel_degree = p;
  const auto parsed = Placement::parse(placement);
  EXPECT_TRUE(parsed.has_value()) << placement;
  if (parsed) c.placement = *parsed;
  return c;
}

// Three letters keep their meaning: P outermost, T innermost around them.
TEST(Placement, ThreeLettersPutPipelineOutsideAndTensorInside) {
  const Placement p = *Placement::parse("SER");
  EXPECT_EQ(p.outer_to_inner.front(), MeshDim::kPipeline);
  EXPECT_EQ(p.outer_to_inner[1], MeshDim::kShard);
  EXPECT_EQ(p.outer_to_inner[3], MeshDim::kReplica);
  EXPECT_EQ(p.outer_to_inner.back(), MeshDim::kTensor);
  EXPECT_EQ(p.to_string(), "SER");
  EXPECT_EQ(Placement{}.to_string(), "RSE");
  EXPECT_EQ(*Placement::parse("PRSET"), Placement{});
}

TEST(Placement, FiveLettersRoundTrip) {
  for (const char* text : {"TPRSE", "RSEPT", "PTRSE", "ERSTP"}) {
    const auto p = Placement::parse(text);
    ASSERT_TRUE(p.has_value()) << text;
    EXPECT_EQ(p->to_string(), text);
  }
}

// SMP v1: D is reduced data parallelism (here R, S and E), "cluster" is "DPT", "spread" is
// "TPD"; the right-most letter varies fastest.
TEST(Placement, SmpStrings) {
  EXPECT_EQ(Placement::parse("cluster")->to_string(), "RSEPT");
  EXPECT_EQ(Placement::parse("DPT")->to_string(), "RSEPT");
  EXPECT_EQ(Placement::parse("spread")->to_string(), "TPRSE");
  EXPECT_EQ(Placement::parse("PTD")->to_string(), "PTRSE");
  // SMP's table for "PTD" on 8 ranks with T = P = D = 2: rank 1 is rdp 1, rank 2 is tp 1,
  // rank 4 is pp 1.
  const ParallelConfig c = mesh("PTD", 8, 1, 1, 2, 2);
  ASSERT_EQ(c.replica_degree(), 2);
  EXPECT_EQ(c.stride(MeshDim::kReplica), 1);
  EXPECT_EQ(c.stride(MeshDim::kTensor), 2);
  EXPECT_EQ(c.stride(MeshDim::kPipeline), 4);
  // "DPT": tp rank varies fastest, then pp, then rdp.
  const ParallelConfig d = mesh("DPT", 8, 1, 1, 2, 2);
  EXPECT_EQ(d.stride(MeshDim::kTensor), 1);
  EXPECT_EQ(d.stride(MeshDim::kPipeline), 2);
  EXPECT_EQ(d.stride(MeshDim::kReplica), 4);
}

TEST(Placement, RefusesRepeatsMissingLettersAndOthers) {
  for (const char* text : {"", "RS", "RSEE", "DR", "DD", "RSETTP", "RSEX", "rse", "Cluster", "PRSETP"})
    EXPECT_FALSE(Placement::parse(text).has_value()) << text;
}

// W = 64 as [P 2, R 2, S 4, E 2, T 2]: degrees multiply to W and strides follow the order.
TEST(Placement, DegreesAndStridesOfAFiveDimensionalMesh) {
  const ParallelConfig c = mesh("PRSET", 64, 2, 4, 2, 2);
  EXPECT_EQ(c.replica_degree(), 2);
  EXPECT_EQ(c.data_parallel_degree(), 16);
  EXPECT_EQ(c.stride(MeshDim::kTensor), 1);
  EXPECT_EQ(c.stride(MeshDim::kExpert), 2);
  EXPECT_EQ(c.stride(MeshDim::kShard), 4);
  EXPECT_EQ(c.stride(MeshDim::kReplica), 16);
  EXPECT_EQ(c.stride(MeshDim::kPipeline), 32);
  EXPECT_EQ(describe(c).substr(0, 16), "E2 S4 R2 T2 P2 R");
}

}  // namespace
}  // namespace moeplan
