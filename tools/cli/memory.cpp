// Peak-RSS measurement through /proc/self/clear_refs and /proc/self/status.
#include "memory.hpp"

#include <cerrno>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <sstream>
#include <string>

#include <fcntl.h>
#include <unistd.h>

namespace flashattn_cli {
namespace {

// A "Key:   1234 kB" line of /proc/self/status, in KiB; -1 when absent.
int64_t proc_kib(const char* file, const char* key) {
  std::ifstream status(file);
  std::string line;
  const size_t key_len = std::strlen(key);
  while (std::getline(status, line)) {
    if (line.compare(0, key_len, key) == 0 && line.size() > key_len && line[key_len] == ':') {
      return std::stoll(line.substr(key_len + 1));
    }
  }
  return -1;
}

int64_t status_kib(const char* key) { return proc_kib("/proc/self/status", key); }

}  // namespace

int64_t available_memory_bytes() {
  const int64_t kib = proc_kib("/proc/meminfo", "MemAvailable");
  return kib < 0 ? -1 : kib * 1024;
}

bool PeakMemory::start() {
  ok_ = false;
  const int fd = ::open("/proc/self/clear_refs", O_WRONLY | O_CLOEXEC);
  if (fd < 0) {
    why_ = std::string("cannot open /proc/self/clear_refs (") + std::strerror(errno) +
           "), so the peak RSS cannot be reset before the call";
    return false;
  }
  const bool written = ::write(fd, "5", 1) == 1;
  const int write_errno = errno;
  ::close(fd);
  if (!written) {
    why_ = std::string("writing 5 to /proc/self/clear_refs failed (") + std::strerror(write_errno) +
           "; needs Linux >= 4.0), so the peak RSS cannot be reset before the call";
    return false;
  }
  rss_before_kib_ = status_kib("VmRSS");
  if (rss_before_kib_ < 0 || status_kib("VmHWM") < 0) {
    why_ = "/proc/self/status has no VmRSS/VmHWM lines";
    return false;
  }
  ok_ = true;
  return true;
}

int64_t PeakMemory::extra_bytes() const {
  if (!ok_) return -1;
  const int64_t hwm = status_kib("VmHWM");
  return hwm > rss_before_kib_ ? (hwm - rss_before_kib_) * 1024 : 0;
}

std::string format_bytes(int64_t bytes) {
  static const char* const kUnits[] = {"B", "KiB", "MiB", "GiB", "TiB"};
  double v = static_cast<double>(bytes);
  int u = 0;
  while (v >= 1024.0 && u < 4) {
    v /= 1024.0;
    ++u;
  }
  char buf[32];
  std::snprintf(buf, sizeof buf, u == 0 ? "%.0f %s" : "%.1f %s", v, kUnits[u]);
  return buf;
}

}  // namespace flashattn_cli
