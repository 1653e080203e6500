// A one-line progress indicator on stderr, only when stderr is a terminal (CI logs stay clean).
#pragma once

#include <string>

namespace flashattn_cli {

class Progress {
 public:
  Progress();
  ~Progress() { clear(); }
  Progress(const Progress&) = delete;
  Progress& operator=(const Progress&) = delete;

  // Shows "phase: repeat i/n" (i is 1-based), replacing the previous line.
  void show(const std::string& phase, int i, int n);
  void show(const std::string& phase);
  void clear();

 private:
  bool enabled_;
  bool shown_ = false;
};

}  // namespace flashattn_cli
