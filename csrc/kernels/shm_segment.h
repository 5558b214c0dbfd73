// What every hvdx shared-memory segment shares (hvdx/shm.py creates, maps, counts and removes
// them): the common header at the segment's start, the alignment of its parts, the check of a
// mapped segment's address, and whether a process recorded in a segment still exists. The
// kinds: the node engine's segment (node_shm.h) and the asynchronous methods' shared model
// (shared_model.h), each with its own fields after the common header.
#ifndef HVDX_KERNELS_SHM_SEGMENT_H_
#define HVDX_KERNELS_SHM_SEGMENT_H_

#include <cstdint>

#include "kernels/status.h"

namespace hvdx {
namespace shm {

constexpr uint64_t kAlign = 64;    // a cache line: the alignment of a segment's parts
constexpr uint64_t kPage = 4096;

struct SegmentHeader {          // 32 bytes at every segment's start (hvdx/shm.py's HEADER)
  char magic[8];                // the kind's magic, written last of the header by the creator
  uint32_t layout_version;      // the kind's layout
  int32_t creator_pid;          // the process that created the segment
  uint32_t attached;            // processes that attached, the creator included
  uint32_t ready;               // 1 once the creator wrote the contents
  uint64_t total_bytes;         // the segment's size
};
static_assert(sizeof(SegmentHeader) == 32, "SegmentHeader must be 32 bytes");

// x rounded up to a multiple of `to`.
constexpr uint64_t AlignUp(uint64_t x, uint64_t to = kAlign) { return (x + to - 1) / to * to; }

// The header of the segment mapped at `address`, once checked: an address of a mapping (not
// null, kAlign-aligned), the kind's `magic`, its layout `version`, ready. InvalidArgument
// naming the kind (`what`, e.g. "shared model segment") and the problem otherwise.
Status OpenHeader(uint64_t address, const char (&magic)[8], uint32_t version, const char* what,
                  SegmentHeader** header);

// Whether process `pid` exists and is not a zombie (a killed process its parent has not
// reaped yet is gone for us). False for pid <= 0. hvdx/shm.py's pid_alive is the same rule.
bool ProcessAlive(int32_t pid);

}  // namespace shm
}  // namespace hvdx

#endif  // HVDX_KERNELS_SHM_SEGMENT_H_
