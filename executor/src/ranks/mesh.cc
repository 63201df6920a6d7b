#include "moeplan/executor/ranks/mesh.h"

#include <algorithm>

namespace moeplan::executor {

int64_t MeshCoords::of(MeshDim d) const { return const_cast<MeshCoords*>(this)->of(d); }

int64_t& MeshCoords::of(MeshDim d) {
  switch (d) {
    case MeshDim::kReplica: return r;
    case MeshDim::kShard: return s;
    case MeshDim::kExpert: return e;
    case MeshDim::kTensor: return t;
    case MeshDim::kPipeline: return p;
    case MeshDim::kContext: return c;
  }
  return r;
}

MeshLayout::MeshLayout(const ParallelConfig& parallel) : parallel_(parallel), world_size_(parallel.world_size) {}

MeshCoords MeshLayout::coords(int64_t rank) const {
  MeshCoords c;
  for (const MeshDim d : kAllMeshDims) c.of(d) = (rank / parallel_.stride(d)) % parallel_.degree(d);
  return c;
}

int64_t MeshLayout::rank_of(const MeshCoords& c) const {
  int64_t rank = 0;
  for (const MeshDim d : kAllMeshDims) rank += c.of(d) * parallel_.stride(d);
  return rank;
}

int64_t MeshLayout::reader(int64_t rank) const {
  // The readers in rank order: those at t = 0, c = 0 and p = 0.
  const MeshCoords mine = coords(rank);
  int64_t index = 0;
  for (int64_t other = 0; other < world_size_; ++other) {
    const MeshCoords c = coords(other);
    if (c.t != 0 || c.p != 0 || c.c != 0) continue;
    if (c.r == mine.r && c.s == mine.s && c.e == mine.e) return index;
    ++index;
  }
  return index;
}

std::vector<MeshDim> MeshLayout::expert_dims() const {
  std::vector<MeshDim> dims{MeshDim::kExpert};
  if (parallel_.expert_spans_context()) dims.push_back(MeshDim::kContext);
  if (parallel_.expert_tensor_fold() > 1) dims.push_back(MeshDim::kTensor);
  return dims;
}

std::vector<MeshDim> MeshLayout::expert_replica_dims() const {
  if (parallel_.expert_parallel_degree == 1 && parallel_.context_parallel_degree > 1)
    return {MeshDim::kReplica, MeshDim::kContext};
  return {MeshDim::kReplica};
}

std::vector<MeshDim> MeshLayout::routing_dims() const {
  if (parallel_.expert_tensor_fold() > 1) return {MeshDim::kContext, MeshDim::kTensor};
  return {MeshDim::kContext};
}

int64_t MeshLayout::expert_index(int64_t rank) const {
  const std::vector<int64_t> ranks = group(rank, expert_dims());
  return std::find(ranks.begin(), ranks.end(), rank) - ranks.begin();
}

std::vector<int64_t> MeshLayout::group(int64_t rank, const std::vector<MeshDim>& varying) const {
  const MeshCoords mine = coords(rank);
  std::vector<int64_t> ranks;
  for (int64_t other = 0; other < world_size_; ++other) {
    const MeshCoords c = coords(other);
    bool same = true;
    for (const MeshDim d : kAllMeshDims)
      if (std::find(varying.begin(), varying.end(), d) == varying.end() && c.of(d) != mine.of(d)) same = false;
    if (same) ranks.push_back(other);
  }
  return ranks;
}

namespace {

std::string join(const std::vector<int64_t>& ranks) {
  std::string s;
  for (const int64_t r : ranks) s += (s.empty() ? "" : ",") + std::to_string(r);
  return s;
}

// A group's members call this with the same ranks; a group of one needs no process group.
Communicator make_group(const std::string& kind, const std::vector<int64_t>& ranks, int64_t rank,
                        const c10::intrusive_ptr<c10d::Store>& store, std::chrono::milliseconds timeout,
                        const std::string& address, const MeshDevice& on) {
  const std::string name = kind + " {" + join(ranks) + "}";
  const int64_t first = *std::min_element(ranks.begin(), ranks.end());
  if (ranks.size() == 1) return Communicator(BackendGroup(), name, first, on.device);
  const auto me = static_cast<int>(std::find(ranks.begin(), ranks.end(), rank) - ranks.begin());
  const std::string prefix = "group/" + kind + "/" + join(ranks) + "/";
  const int size = static_cast<int>(ranks.size());
  BackendGroup group = on.backend == GroupBackend::kNccl
                           ? make_nccl_group(store, prefix, me, size, timeout, on.device)
                           : make_gloo_group(store, prefix, me, size, timeout, address);
  return Communicator(std::move(group), name, first, on.device);
}

}  // namespace

DeviceMesh::DeviceMesh(const ParallelConfig& parallel, int64_t rank, const c10::intrusive_ptr<c10d::Store>& store,
                       std::chrono::milliseconds timeout, const std::string& address, MeshDevice on)
    : layout_(parallel), rank_(rank), coords_(layout_.coords(rank)), device_(on.device) {
  using D = MeshDim;
  // Every rank creates its groups in the same order, so that no rank waits on a group its peer
  // has not reached.
  world = make_group("world", layout_.group(rank, {kAllMeshDims.begin(), kAllMeshDims.end()}), rank, store, timeout,
                     address, on);
  shard = make_group("shard", layout_.group(rank, {D::kShard}), rank, store, timeout, address, on);
  expert = make_group("expert", layout_.group(rank, layout_.expert_dims()), rank, store, timeout, address, on);
  dense_replicas =
      make_group("dense-replica", layout_.group(rank, {D::kReplica, D::kExpert, D::kContext}), rank, store, timeout,
                 address, on);
  expert_replicas =
      make_group("expert-replica", layout_.group(rank, layout_.expert_replica_dims()), rank, store, timeout, address,
                 on);
  context = make_group("context", layout_.group(rank, {D::kContext}), rank, store, timeout, address, on);
  // Without folding the routing group is the context group (the same process group).
  routing = parallel.expert_tensor_fold() > 1
                ? make_group("routing", layout_.group(rank, layout_.routing_dims()), rank, store, timeout, address, on)
                : context;
  tensor = make_group("tensor", layout_.group(rank, {D::kTensor}), rank, store, timeout, address, on);
  pipeline = make_group("pipeline", layout_.group(rank, {D::kPipeline}), rank, store, timeout, address, on);
}

DeviceMesh::DeviceMesh(const ParallelConfig& parallel, torch::Device device) : layout_(parallel), device_(device) {
  for (Communicator* c :
       {&world, &shard, &expert, &dense_replicas, &expert_replicas, &context, &routing, &tensor, &pipeline})
    *c = Communicator(BackendGroup(), "this rank", 0, device);
}

void DeviceMesh::set_activity(const std::shared_ptr<CollectiveActivity>& activity) {
  for (Communicator* c : {&world, &shard, &expert, &dense_replicas, &expert_replicas, &context, &routing, &tensor, &pipeline})
    c->set_activity(activity);
}

}  // namespace moeplan::executor
