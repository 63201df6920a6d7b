#pragma once
// Options that take one name of a name table (core's k*Names: pairs of a name and its value)
// and store the value; or the name of a framework of the list (add_framework_choice).

#include <CLI/CLI.hpp>

#include <array>
#include <cstddef>
#include <initializer_list>
#include <optional>
#include <string>
#include <string_view>
#include <type_traits>
#include <utility>
#include <vector>

#include "moeplan/core/parallel_config.h"
#include "moeplan/core/rules.h"
#include "moeplan/frameworks/framework.h"

namespace moeplan::cli {

template <class T, size_t N>
using NameTable = std::array<std::pair<std::string_view, T>, N>;

// `flag` takes a name of `names` and stores its value in `field` (a T, or a std::optional<T>
// that stays empty unless given). The names offered, in this order, are `offered`'s, or all of
// the table's; CLI11 checks them as CLI::IsMember does (its help text and its message), and the
// default shown is the field's name.
template <class Field, class T, size_t N>
CLI::Option* add_choice(CLI::App& app, const std::string& flag, Field& field, const NameTable<T, N>& names,
                        const std::string& description, const std::vector<T>& offered = {}) {
  std::vector<std::string> shown;
  if (offered.size() == 0)
    for (const auto& [name, value] : names) shown.emplace_back(name);
  for (const T value : offered) shown.emplace_back(name_of(names, value));
  auto store = [&field, &names](const CLI::results_t& results) {
    for (const auto& [name, value] : names)
      if (name == results.front()) {
        field = value;
        return true;
      }
    return false;
  };
  auto current = [&field, &names]() -> std::string {
    if constexpr (std::is_same_v<Field, std::optional<T>>)
      return field ? std::string(name_of(names, *field)) : std::string();
    else
      return std::string(name_of(names, field));
  };
  return app.add_option(flag, store, description, false, current)->type_name("TEXT")->check(CLI::IsMember(shown));
}

// `flag` takes the name of a framework (frameworks/CMakeLists.txt's list, in its order, then
// "any"; or only those a plan can be exported to) and stores its rules in `field`. The help
// says what each is between `before` and `after`.
inline CLI::Option* add_framework_choice(CLI::App& app, const std::string& flag, Target& field, bool exported_only,
                                         const std::string& before, const std::string& after = "") {
  std::vector<const Framework*> offered;
  for (const Framework* f : all_frameworks())
    if (!exported_only || f->export_launch) offered.push_back(f);
  if (!exported_only) offered.push_back(&framework(nullptr));
  std::vector<std::string> shown;
  std::string described;  // "megatron (Megatron-LM), ... or any (every layout moeplan models)"
  for (size_t i = 0; i < offered.size(); ++i) {
    shown.emplace_back(offered[i]->name);
    if (i > 0) described += i + 1 == offered.size() ? " or " : ", ";
    described += std::string(offered[i]->name) + " (" + std::string(offered[i]->title) + ")";
  }
  auto store = [&field, offered](const CLI::results_t& results) {
    for (const Framework* f : offered)
      if (f->name == results.front()) {
        field = f->target;
        return true;
      }
    return false;
  };
  auto current = [&field] { return std::string(framework(field).name); };
  return app.add_option(flag, store, before + described + after, false, current)
      ->type_name("TEXT")
      ->check(CLI::IsMember(shown));
}

}  // namespace moeplan::cli
