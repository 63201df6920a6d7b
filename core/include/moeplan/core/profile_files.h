#pragma once
// Finding profiles by name: --profiles, then $MOEPLAN_PROFILES, then the source tree's
// profiles/ folder. A value that names a .json file is read as a path. Used by the commands and
// by the validation harness.

#include <string>

#include "moeplan/core/cluster_spec.h"
#include "moeplan/core/model_spec.h"

namespace moeplan {

std::string profile_dir(const std::string& flag);
ClusterSpec load_hardware(const std::string& name_or_path, const std::string& dir);
ModelSpec load_model(const std::string& name_or_path, const std::string& dir);

}  // namespace moeplan
