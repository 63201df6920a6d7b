// `moeplan compare-published cases.json`: predictions for published training runs beside their
// published steps (validation/published.h).
#include <memory>
#include <string>

#include "command.h"
#include "moeplan/validation/published.h"

namespace moeplan::cli {

Command add_compare_published_command(CLI::App& app) {
  auto p = std::make_shared<validation::ComparePublishedOptions>();
  CLI::App* cmd = app.add_subcommand(
      "compare-published",
      "moeplan's predictions for published training runs in their own layouts, beside the published step");
  cmd->add_option("cases", p->cases, "Cases file (e.g. docs/validation/published/cases.json)")->required();
  cmd->add_option("--profiles", p->profiles, "Folder with hardware/ and models/ profiles");
  cmd->add_flag("--check", p->check, "Exit 1 when an error bound is broken or a case has no plan");
  cmd->add_option("--max-median-error", p->max_median_error, "Largest median |step error|")
      ->capture_default_str()->check(CLI::Range(0.0, 100.0));
  cmd->add_option("--max-worst-error", p->max_worst_error, "Largest |step error| of any case")
      ->capture_default_str()->check(CLI::Range(0.0, 100.0));
  const std::vector<std::string> fitted = validation::fit_parameter_names();
  std::string names;
  for (const std::string& name : fitted) names += (names.empty() ? "" : ", ") + name;
  cmd->add_option("--fit", p->fit,
                  "Fit these kernel-model numbers per chip on the cases of the fit part (" + names +
                      "), then predict every case with them")
      ->delimiter(',')
      ->check(CLI::IsMember(fitted));
  cmd->add_option("--max-mean-error", p->max_mean_error, "Largest |mean signed step error| (the bias)")
      ->capture_default_str()->check(CLI::Range(0.0, 100.0));
  return {cmd, [p] { return validation::compare_published(*p); }};
}

}  // namespace moeplan::cli
