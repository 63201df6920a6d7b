#include "command.h"

#include <cerrno>
#include <cstdio>
#include <cstring>

#include "moeplan/core/process.h"

namespace moeplan::cli {

std::string Invocation::text() const {
  std::string text = "moeplan";
  for (int i = 1; i < argc; ++i) {
    text += ' ';
    text += argv[i];
  }
  return text;
}

std::vector<std::string> Invocation::words() const { return std::vector<std::string>(argv, argv + argc); }

void print_error(const InputError& e) {
  for (const std::string& line : e.lines()) std::fprintf(stderr, "moeplan: error: %s\n", line.c_str());
}

int exec_sibling(const char* name, const char* command, const char* built_with, const std::vector<std::string>& args,
                 const char* argv0) {
  const std::string self = this_program_path().value_or(argv0);
  const auto slash = self.rfind('/');
  const std::string tool = (slash == std::string::npos ? std::string(".") : self.substr(0, slash)) + "/" + name;
  std::vector<std::string> argv{tool};
  argv.insert(argv.end(), args.begin(), args.end());
  replace_this_process(tool, argv);
  std::fprintf(stderr, "moeplan: error: %s: cannot run %s (%s); it is built with %s\n", command, tool.c_str(),
               std::strerror(errno), built_with);
  return kExitBadInput;
}

}  // namespace moeplan::cli
