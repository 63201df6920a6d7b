#include "moeplan/core/cluster_spec.h"

#include <algorithm>
#include <cmath>

#include "moeplan/core/parallel_config.h"

namespace moeplan {

namespace {
constexpr int64_t kMaxGpusPerNode = 1024;
constexpr int64_t kMaxNodes = int64_t{1} << 20;
constexpr int64_t kMaxBytes = int64_t{1} << 50;  // 1 PiB
constexpr double kMaxRate = 1e18;
}  // namespace

double ClusterSpec::efficiency_at(double flops) const {
  const auto& pts = matmul_efficiency;
  if (pts.empty()) return 1.0;
  if (flops <= pts.front().flops) return pts.front().efficiency;
  if (flops >= pts.back().flops) return pts.back().efficiency;
  auto hi = std::upper_bound(pts.begin(), pts.end(), flops,
                             [](double f, const EfficiencyPoint& p) { return f < p.flops; });
  auto lo = hi - 1;
  const double t = (std::log(flops) - std::log(lo->flops)) / (std::log(hi->flops) - std::log(lo->flops));
  return lo->efficiency + t * (hi->efficiency - lo->efficiency);
}

static ClusterSpec read_cluster_fields(ObjectReader& r) {
  ClusterSpec c;
  c.name = r.string("name");
  c.description = r.string("description", "");
  c.gpus_per_node = r.integer("gpus_per_node", 1, kMaxGpusPerNode);
  r.integer("schema_version", 1, 1, 1);
  c.num_nodes = r.integer("num_nodes", 1, kMaxNodes, 1);
  if (auto gpu = r.object("gpu")) {
    c.gpu_name = gpu->string("name");
    c.gpu_memory_bytes = gpu->integer("memory_bytes", 1, kMaxBytes);
    c.peak_bf16_flops = gpu->number("peak_bf16_flops", 1.0, kMaxRate);
    c.peak_fp32_flops = gpu->number("peak_fp32_flops", 1.0, kMaxRate);
    c.hbm_bandwidth_bytes_per_s = gpu->number("memory_bandwidth_bytes_per_s", 1.0, kMaxRate);
    if (auto eff = gpu->object("matmul_efficiency")) {
      // The curve's source is a plain string: the curve has no single value to wrap.
      if (const Json* source = eff->child("source", true)) {
        if (!source->is_string())
          r.diagnostics().error(eff->path_of("source"), "expected a string, got " + describe_json(*source));
        else if (r.sources() != nullptr && !source->get<std::string>().empty())
          (*r.sources())[eff->path_of("points")] = source->get<std::string>();
      }
      if (const Json* points = eff->child("points")) {
        const std::string path = eff->path_of("points");
        if (!points->is_array() || points->empty() || points->size() > 64) {
          r.diagnostics().error(path, "expected an array of 1 to 64 [flops, efficiency] pairs");
        } else {
          for (size_t i = 0; i < points->size(); ++i) {
            const Json& p = (*points)[i];
            const std::string at = path + "[" + std::to_string(i) + "]";
            if (!p.is_array() || p.size() != 2 || !p[0].is_number() || !p[1].is_number()) {
              r.diagnostics().error(at, "expected [flops, efficiency], got " + describe_json(p));
              continue;
            }
            const double f = p[0].get<double>();
            const double e = p[1].get<double>();
            if (!(f >= 1.0 && f <= 1e30)) {
              r.diagnostics().error(at, "flops must be in [1, 1e30], got " + p[0].dump());
            } else if (!(e > 0.0 && e <= 1.0)) {
              r.diagnostics().error(at, "efficiency must be in (0, 1], got " + p[1].dump());
            } else if (!c.matmul_efficiency.empty() && f <= c.matmul_efficiency.back().flops) {
              r.diagnostics().error(at, "flops must increase from one point to the next");
            } else {
              c.matmul_efficiency.push_back({f, e});
            }
          }
        }
      }
      eff->finish();
    }
    gpu->finish();
  }
  if (auto intra = r.object("intra_node")) {
    c.intra_node_fabric = intra->string("fabric");
    c.intra_node_bandwidth_bytes_per_s = intra->number("bandwidth_bytes_per_s", 1.0, kMaxRate);
    c.intra_node_latency_s = intra->number("latency_s", 0.0, 1.0);
    intra->finish();
  }
  if (auto inter = r.object("inter_node")) {
    c.inter_node_fabric = inter->string("fabric");
    c.inter_node_bandwidth_bytes_per_s = inter->number("bandwidth_bytes_per_s", 1.0, kMaxRate);
    c.inter_node_latency_s = inter->number("latency_s", 0.0, 1.0);
    inter->finish();
  }
  if (auto host = r.object("host")) {
    c.host_memory_bytes = host->integer("memory_bytes", 1, kMaxBytes);
    c.pcie_bandwidth_bytes_per_s = host->number("pcie_bandwidth_bytes_per_s", 1.0, kMaxRate);
    host->finish();
  }
  if (auto fw = r.object("framework")) {
    c.framework_overhead_bytes = fw->integer("overhead_bytes", 0, kMaxBytes);
    c.fragmentation_factor = fw->number("fragmentation_factor", 1.0, 4.0);
    c.kernels = fw->choice<Kernels>("kernels", kKernelNames, Kernels::kFused);
    c.memory_headroom_bytes = fw->integer("headroom_bytes", 0, kMaxBytes);
    fw->finish();
  }
  r.finish();
  return c;
}

ClusterSpec read_cluster(const Json& json, const std::string& path, Diagnostics& d) {
  SourceMap sources;
  ObjectReader r(json, path, d, &sources);
  if (!r.ok()) return {};
  ClusterSpec c = read_cluster_fields(r);
  // Sources are kept relative to the cluster object, wherever it was read from.
  const std::string prefix = path.empty() ? "" : path + ".";
  for (auto& [key, source] : sources)
    c.sources[key.substr(key.rfind(prefix, 0) == 0 ? prefix.size() : 0)] = source;
  return c;
}

void check_cluster(const ClusterSpec& c, Diagnostics& d, const std::string& prefix) {
  auto at = [&](const char* field) { return prefix.empty() ? std::string(field) : prefix + "." + field; };
  if (c.memory_headroom_bytes + c.framework_overhead_bytes >= c.gpu_memory_bytes)
    d.error(at("framework"), "headroom_bytes + overhead_bytes (" +
                                 std::to_string(c.memory_headroom_bytes + c.framework_overhead_bytes) +
                                 ") leave no device memory of gpu.memory_bytes = " +
                                 std::to_string(c.gpu_memory_bytes));
  if (c.peak_fp32_flops > c.peak_bf16_flops)
    d.error(at("gpu.peak_fp32_flops"), "exceeds gpu.peak_bf16_flops; the two are probably swapped");
}

ClusterSpec cluster_from_json(const Json& json, const std::string& origin) {
  Diagnostics d;
  ClusterSpec c = read_cluster(json, "", d);
  if (d.empty()) check_cluster(c, d, "");
  d.throw_if_any(origin);
  return c;
}

ClusterSpec read_cluster_file(const std::string& path) {
  return cluster_from_json(read_json_file(path), path);
}

OrderedJson to_json(const ClusterSpec& c) {
  auto sourced = [&](const std::string& path, const OrderedJson& value) {
    auto it = c.sources.find(path);
    if (it == c.sources.end()) return value;
    OrderedJson j;
    j["value"] = value;
    j["source"] = it->second;
    return j;
  };
  OrderedJson j;
  j["name"] = sourced("name", c.name);
  j["description"] = sourced("description", c.description);
  j["gpus_per_node"] = sourced("gpus_per_node", c.gpus_per_node);
  j["num_nodes"] = sourced("num_nodes", c.num_nodes);
  OrderedJson gpu;
  gpu["name"] = sourced("gpu.name", c.gpu_name);
  gpu["memory_bytes"] = sourced("gpu.memory_bytes", c.gpu_memory_bytes);
  gpu["peak_bf16_flops"] = sourced("gpu.peak_bf16_flops", c.peak_bf16_flops);
  gpu["peak_fp32_flops"] = sourced("gpu.peak_fp32_flops", c.peak_fp32_flops);
  gpu["memory_bandwidth_bytes_per_s"] =
      sourced("gpu.memory_bandwidth_bytes_per_s", c.hbm_bandwidth_bytes_per_s);
  OrderedJson eff;
  OrderedJson points = OrderedJson::array();
  for (const auto& p : c.matmul_efficiency) points.push_back({p.flops, p.efficiency});
  eff["points"] = points;
  if (auto it = c.sources.find("gpu.matmul_efficiency.points"); it != c.sources.end())
    eff["source"] = it->second;
  gpu["matmul_efficiency"] = eff;
  j["gpu"] = gpu;
  OrderedJson intra;
  intra["fabric"] = sourced("intra_node.fabric", c.intra_node_fabric);
  intra["bandwidth_bytes_per_s"] = sourced("intra_node.bandwidth_bytes_per_s", c.intra_node_bandwidth_bytes_per_s);
  intra["latency_s"] = sourced("intra_node.latency_s", c.intra_node_latency_s);
  j["intra_node"] = intra;
  OrderedJson inter;
  inter["fabric"] = sourced("inter_node.fabric", c.inter_node_fabric);
  inter["bandwidth_bytes_per_s"] = sourced("inter_node.bandwidth_bytes_per_s", c.inter_node_bandwidth_bytes_per_s);
  inter["latency_s"] = sourced("inter_node.latency_s", c.inter_node_latency_s);
  j["inter_node"] = inter;
  OrderedJson host;
  host["memory_bytes"] = sourced("host.memory_bytes", c.host_memory_bytes);
  host["pcie_bandwidth_bytes_per_s"] = sourced("host.pcie_bandwidth_bytes_per_s", c.pcie_bandwidth_bytes_per_s);
  j["host"] = host;
  OrderedJson fw;
  fw["overhead_bytes"] = sourced("framework.overhead_bytes", c.framework_overhead_bytes);
  fw["fragmentation_factor"] = sourced("framework.fragmentation_factor", c.fragmentation_factor);
  fw["kernels"] = sourced("framework.kernels", std::string(name_of(kKernelNames, c.kernels)));
  fw["headroom_bytes"] = sourced("framework.headroom_bytes", c.memory_headroom_bytes);
  j["framework"] = fw;
  return j;
}

}  // namespace moeplan
