// Peak extra memory of a call, measured from the kernel's RSS accounting (Linux), not estimated.
#pragma once

#include <cstdint>
#include <string>

namespace flashattn_cli {

// Writing "5" to /proc/self/clear_refs resets the peak RSS (VmHWM) to the current RSS; after
// the call, VmHWM - VmRSS(before) is the most memory the call held at once on top of what was
// already resident. Resolution: the kernel's RSS counters (a page, up to a few hundred KiB of
// per-thread batching on older kernels).
class PeakMemory {
 public:
  // Resets the peak; false (and why() says why) when the peak cannot be reset.
  bool start();
  // Bytes of VmHWM above the RSS at start(); -1 when start() failed.
  int64_t extra_bytes() const;
  const std::string& why() const { return why_; }

 private:
  bool ok_ = false;
  int64_t rss_before_kib_ = 0;
  std::string why_;
};

// MemAvailable of /proc/meminfo in bytes (what can be allocated without swapping or the OOM
// killer); -1 when unknown.
int64_t available_memory_bytes();

// "12.3 MiB"-style formatting of a byte count.
std::string format_bytes(int64_t bytes);

}  // namespace flashattn_cli
