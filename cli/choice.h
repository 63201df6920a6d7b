#pragma once
// Options that take one name of a name table (core's k*Names: pairs of a name and its value)
// and store the value.

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

// The frameworks an option offers, in the order of their list (frameworks/src/registry.cc):
// every one and "any" (`--target`), or those a plan can be exported to (`--to`); and the same
// names with what each is, for the option's help.
struct FrameworkChoice {
  std::vector<Target> targets;
  std::string described;  // "megatron (Megatron-LM), ... or any (every layout moeplan models)"
};

inline FrameworkChoice framework_choice(bool exported_only) {
  std::vector<const Framework*> offered;
  for (const Framework* f : all_frameworks())
    if (!exported_only || f->export_launch) offered.push_back(f);
  if (!exported_only) offered.push_back(&framework(Target::kAny));
  FrameworkChoice choice;
  for (size_t i = 0; i < offered.size(); ++i) {
    choice.targets.push_back(offered[i]->target);
    if (i > 0) choice.described += i + 1 == offered.size() ? " or " : ", ";
    choice.described += std::string(offered[i]->name) + " (" + std::string(offered[i]->title) + ")";
  }
  return choice;
}

}  // namespace moeplan::cli
