// The layout of a shared model segment (hvdx/asynchronous/shared.py writes it with hvdx/shm.py,
// the kernels of csrc/kernels/shared_model.cc read and update it) and the functors on it.
//
// A segment is one node's copy of a flattened float32 model, updated concurrently by the
// node's processes (gimpel2010 Algorithm 1; kungurtsev2021's ASSM and PASSM, Algorithm 1):
//
//   [0, 64)            Header (shm::SegmentHeader of shm_segment.h, then the model's fields)
//   [64, ...)          uint64 block_begin[num_blocks + 1]   (element offsets, 0 .. n)
//   aligned to 64      BlockRecord[num_blocks]              (one cache line each)
//   data_offset        float params[n]                      (64-byte aligned)
//
// Every field written concurrently is a word accessed with GCC's __atomic builtins, so the
// segment needs no process-shared pthread objects and survives any process's death: a lock
// word holds its owner's pid, and a waiter takes over a lock whose owner no longer exists.
#ifndef HVDX_KERNELS_SHARED_MODEL_H_
#define HVDX_KERNELS_SHARED_MODEL_H_

#include <cstdint>

#include "kernels/shm_segment.h"
#include "kernels/status.h"

namespace hvdx {
namespace shared {

constexpr char kMagic[8] = {'H', 'V', 'D', 'X', 'S', 'H', 'M', '1'};
constexpr uint32_t kLayoutVersion = 2;  // 2: shm::SegmentHeader at the start

struct Header {                 // 64 bytes, at the start of the segment
  shm::SegmentHeader segment;   // magic kMagic, layout kLayoutVersion, creator, attached, ready, size
  uint32_t num_blocks;          // lock / partition blocks
  int32_t whole_lock;           // 0 or the pid holding the lock on the whole vector
  uint64_t size;                // n, float32 elements
  uint64_t data_offset;         // bytes from the segment's start to params
  uint64_t updates;             // updates applied so far (atomic): the model's version
};
static_assert(sizeof(Header) == 64, "Header must be 64 bytes");

struct BlockRecord {            // 64 bytes: one cache line per block
  int32_t lock;                 // 0 or the owner's pid
  uint32_t reserved0;
  uint64_t updates;             // updates applied to this block (atomic)
  uint64_t reserved[6];
};
static_assert(sizeof(BlockRecord) == 64, "BlockRecord must be 64 bytes");

// How an update reaches the shared vector.
enum class Mode {
  kAtomic,  // lock-free: every element by an atomic float fetch-and-add (a CAS loop)
  kBlock,   // under each touched block's lock (ASSM's per-block write locks)
  kWhole,   // under one lock on the whole vector (gimpel2010 Algorithm 1's acquireLock)
  kNone,    // no lock and no atomics (reads only: the inconsistent read of kungurtsev2021 sec. 2)
};

// A validated view of a mapped segment.
struct View {
  Header* header = nullptr;
  const uint64_t* block_begin = nullptr;
  BlockRecord* blocks = nullptr;
  float* params = nullptr;
};

// Checks the segment at `address` (shm::OpenHeader: magic, version, ready; then the block
// table) and fills `view`; InvalidArgument naming the problem otherwise.
Status Open(uint64_t address, View* view);

// Spin lock on a pid word: acquire, release. A waiter that finds the owner's process gone
// (shm::ProcessAlive) takes the lock over.
void Lock(int32_t* word);
void Unlock(int32_t* word);

// out[0, n) = params, block by block under each block's lock (kBlock), under the whole lock
// (kWhole) or as they are (kNone). Returns the model's version (Header::updates) read before
// the copy began.
template <typename Device>
struct Read {
  uint64_t operator()(const Device& d, const View& view, Mode mode, float* out);
};

// params[offset, offset + m) += delta[0, m) in `mode`, then, when `read_back` is not null,
// copies the whole vector into it (under the whole lock in kWhole: Algorithm 1's theta' <- theta
// inside the lock). Returns the version before this update (fetch-and-add on Header::updates),
// from which the caller's staleness is that value minus the version it read.
template <typename Device>
struct Update {
  uint64_t operator()(const Device& d, const View& view, Mode mode, const float* delta, uint64_t offset,
                      uint64_t m, float* read_back);
};

}  // namespace shared
}  // namespace hvdx

#endif  // HVDX_KERNELS_SHARED_MODEL_H_
