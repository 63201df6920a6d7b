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

namespace moeplan::cli {

template <class T, size_t N>
using NameTable = std::array<std::pair<std::string_view, T>, N>;

// `flag` takes a name of `names` and stores its value in `field` (a T, or a std::optional<T>
// that stays empty unless given). The names offered, in this order, are `offered`'s, or all of
// the table's; CLI11 checks them as CLI::IsMember does (its help text and its message), and the
// default shown is the field's name.
template <class Field, class T, size_t N>
CLI::Option* add_choice(CLI::App& app, const std::string& flag, Field& field, const NameTable<T, N>& names,
                        const std::string& description, std::initializer_list<T> offered = {}) {
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

}  // namespace moeplan::cli
