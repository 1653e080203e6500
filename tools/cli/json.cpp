#include "json.hpp"

#include <charconv>
#include <cmath>
#include <cstdio>

namespace flashattn_cli {

void Json::open(const char* key, char bracket) {
  prefix(key);
  out_ += bracket;
  first_.push_back(true);
}

void Json::close(char bracket) {
  const bool empty = first_.back();  // "[]", not a bracket on a line of its own
  first_.pop_back();
  if (!empty) {
    out_ += '\n';
    out_.append(2 * first_.size(), ' ');  // (not "\n" + std::string: GCC 12 -Wrestrict false positive)
  }
  out_ += bracket;
}

void Json::num(const char* key, double v) {
  prefix(key);
  char buf[32];
  std::snprintf(buf, sizeof buf, "%.9g", v);
  out_ += std::isfinite(v) ? buf : "null";
}

// 0.17f prints 0.17, not 0.170000002.
void Json::num(const char* key, float v) {
  prefix(key);
  char buf[32];
  const auto res = std::to_chars(buf, buf + sizeof buf, v);
  out_ += std::isfinite(v) ? std::string(buf, res.ptr) : "null";
}

void Json::integer(const char* key, int64_t v) {
  prefix(key);
  out_ += std::to_string(v);
}

void Json::boolean(const char* key, bool v) {
  prefix(key);
  out_ += v ? "true" : "false";
}

void Json::null(const char* key) {
  prefix(key);
  out_ += "null";
}

void Json::str(const char* key, const std::string& v) {
  prefix(key);
  out_ += '"';
  for (char c : v) {
    if (c == '"' || c == '\\') {
      out_ += '\\';
      out_ += c;
    } else if (static_cast<unsigned char>(c) < 0x20) {
      char buf[8];
      std::snprintf(buf, sizeof buf, "\\u%04x", static_cast<unsigned char>(c));
      out_ += buf;
    } else {
      out_ += c;
    }
  }
  out_ += '"';
}

void Json::strings(const char* key, const std::vector<std::string>& v) {
  open(key, '[');
  for (const std::string& s : v) str(nullptr, s);
  close(']');
}

void Json::prefix(const char* key) {
  if (!first_.empty()) {
    out_ += first_.back() ? "\n" : ",\n";
    first_.back() = false;
    out_.append(2 * first_.size(), ' ');
  }
  if (key) {
    out_ += '"';
    out_ += key;
    out_ += "\": ";
  }
}

}  // namespace flashattn_cli
