// The tool's JSON output (`run --json`, `info --json`), written by hand: a few dozen scalars and
// short lists, two levels deep, do not call for a JSON library.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace flashattn_cli {

// A minimal pretty-printing writer: open() / close() nest objects and arrays, the scalar
// writers add one member (or, with a null key, one array element); commas and indentation
// follow the nesting. Non-finite numbers are written as null (JSON has no NaN or infinity).
class Json {
 public:
  void open(const char* key, char bracket);  // bracket '{' or '['
  void close(char bracket);                  // '}' or ']'
  void num(const char* key, double v);
  void num(const char* key, float v);  // shortest decimal that reads back as the same float
  void integer(const char* key, int64_t v);
  void boolean(const char* key, bool v);
  void null(const char* key);
  void str(const char* key, const std::string& v);
  void strings(const char* key, const std::vector<std::string>& v);  // an array of strings
  const std::string& text() const { return out_; }

 private:
  void prefix(const char* key);
  std::string out_;
  std::vector<bool> first_;
};

}  // namespace flashattn_cli
