#include "command.h"

#include <unistd.h>

#include <cerrno>
#include <cstdio>
#include <cstring>

#include "moeplan/core/units.h"

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

double in_gib(int64_t bytes) { return static_cast<double>(bytes) / static_cast<double>(kGiB); }

int exec_sibling(const char* name, const char* command, const char* built_with, const std::vector<std::string>& args,
                 const char* argv0) {
  std::string self(4096, '\0');
  const ssize_t n = ::readlink("/proc/self/exe", self.data(), self.size() - 1);
  self = n > 0 ? self.substr(0, static_cast<size_t>(n)) : std::string(argv0);
  const auto slash = self.rfind('/');
  const std::string tool = (slash == std::string::npos ? std::string(".") : self.substr(0, slash)) + "/" + name;
  std::vector<std::string> storage{tool};
  storage.insert(storage.end(), args.begin(), args.end());
  std::vector<char*> argv;
  for (std::string& s : storage) argv.push_back(s.data());
  argv.push_back(nullptr);
  std::fflush(stdout);
  ::execv(tool.c_str(), argv.data());
  std::fprintf(stderr, "moeplan: error: %s: cannot run %s (%s); it is built with %s\n", command, tool.c_str(),
               std::strerror(errno), built_with);
  return kExitBadInput;
}

}  // namespace moeplan::cli
