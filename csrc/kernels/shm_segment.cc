// The common parts of hvdx's shared-memory segments (shm_segment.h). Builds without
// TensorFlow too (csrc/harness): only status.h.
#include "kernels/shm_segment.h"

#include <errno.h>
#include <signal.h>

#include <cstdio>
#include <cstring>

namespace hvdx {
namespace shm {

Status OpenHeader(uint64_t address, const char (&magic)[8], uint32_t version, const char* what,
                  SegmentHeader** header) {
  if (address == 0 || address % kAlign != 0) {
    return errors::InvalidArgument(what, " address ", address, " is not a mapped segment's: pass the address of "
                                   "a segment this process attached");
  }
  auto* h = reinterpret_cast<SegmentHeader*>(address);
  if (std::memcmp(h->magic, magic, sizeof(h->magic)) != 0) {
    return errors::InvalidArgument("no ", what, " at address ", address,
                                   " (bad magic): pass the address of a segment this process attached");
  }
  if (h->layout_version != version) {
    return errors::InvalidArgument(what, " has layout ", h->layout_version, ", this op library ", version,
                                   ": every process of a node must run the same hvdx");
  }
  if (__atomic_load_n(&h->ready, __ATOMIC_ACQUIRE) != 1) {
    return errors::InvalidArgument(what, " at address ", address, " is not ready: its creator has not finished "
                                   "writing it");
  }
  *header = h;
  return OkStatus();
}

bool ProcessAlive(int32_t pid) {
  if (pid <= 0) return false;
  if (kill(pid, 0) != 0 && errno == ESRCH) return false;
  char path[64];
  std::snprintf(path, sizeof(path), "/proc/%d/stat", pid);
  FILE* f = std::fopen(path, "r");
  if (f == nullptr) return true;  // no /proc: trust kill()
  char buffer[512];
  size_t got = std::fread(buffer, 1, sizeof(buffer) - 1, f);
  std::fclose(f);
  buffer[got] = '\0';
  const char* paren = std::strrchr(buffer, ')');
  if (paren == nullptr || paren[1] == '\0' || paren[2] == '\0') return true;
  return paren[2] != 'Z' && paren[2] != 'X';
}

}  // namespace shm
}  // namespace hvdx
