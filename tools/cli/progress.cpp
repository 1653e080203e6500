// Progress line: carriage return + erase-line, so each update overwrites the last one.
#include "progress.hpp"

#include <cstdio>

#include <unistd.h>

namespace flashattn_cli {

Progress::Progress() : enabled_(::isatty(STDERR_FILENO) != 0) {}

void Progress::show(const std::string& phase, int i, int n) {
  if (!enabled_) return;
  std::fprintf(stderr, "\r\033[K[flashattn] %s: repeat %d/%d", phase.c_str(), i, n);
  std::fflush(stderr);
  shown_ = true;
}

void Progress::show(const std::string& phase) {
  if (!enabled_) return;
  std::fprintf(stderr, "\r\033[K[flashattn] %s", phase.c_str());
  std::fflush(stderr);
  shown_ = true;
}

void Progress::clear() {
  if (!shown_) return;
  std::fprintf(stderr, "\r\033[K");
  std::fflush(stderr);
  shown_ = false;
}

}  // namespace flashattn_cli
