// Hardware profiles (core/cluster_spec.h, profiles/hardware/*.json): read, sized to another
// number of GPUs as the search does, and read back from what they write.
#include <cstddef>
#include <cstdint>

#include "fuzz_support.h"
#include "moeplan/core/cluster_spec.h"
#include "moeplan/core/errors.h"
#include "moeplan/planner/search.h"

using namespace moeplan;

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string path = fuzz::Scratch::get().write("hardware.json", data, size);
  ClusterSpec cluster;
  try {
    cluster = read_cluster_file(path);
  } catch (const InputError&) {
    return 0;
  }
  try {
    if (cluster_from_json(Json(to_json(cluster)), "again") != cluster)
      fuzz::fail("an accepted hardware profile reads back different after to_json");
  } catch (const InputError& e) {
    fuzz::fail("an accepted hardware profile is refused after to_json: " + e.lines().front());
  }
  try {
    (void)planner::size_cluster(cluster, 2 * cluster.gpus_per_node);
  } catch (const InputError&) {
  }
  return 0;
}
