// CPU kernels of the shared model ops (csrc/ops/shared_model_ops.cc): reading one node's
// shared float32 model into a tensor and adding an update to it, lock-free by word-sized
// atomic fetch-and-add or under per-block / whole-vector locks (kungurtsev2021 sec. 2 and
// Algorithm 1; gimpel2010 Algorithm 1). The layout is in shared_model.h. (The OpKernels are
// csrc/ops/shared_model_kernel.cc; this file builds without TensorFlow too, for the harness
// in csrc/harness.)
#define EIGEN_USE_THREADS

#include "kernels/shared_model.h"

#include <sched.h>
#include <unistd.h>

#include <algorithm>
#include <cstring>
#include <string>
#include <vector>

#include "kernels/device.h"
#include "kernels/status.h"

namespace hvdx {
namespace shared {

using CPUDevice = ::hvdx::CpuDevice;

namespace {

constexpr int64_t kChunk = 1 << 14;  // elements per parallel work item

inline void CpuRelax() {
#if defined(__x86_64__) || defined(__i386__)
  __builtin_ia32_pause();
#endif
}

// params[i] += delta[i] for i < n, each element by a compare-and-swap loop on its 32-bit
// word: a fetch-and-add on a float, so no concurrent update of the same word is lost.
void AtomicAdd(float* params, const float* delta, int64_t n) {
  static_assert(sizeof(float) == sizeof(uint32_t), "float must be a 32-bit word");
  uint32_t* words = reinterpret_cast<uint32_t*>(params);
  for (int64_t i = 0; i < n; ++i) {
    if (delta[i] == 0.0f) continue;
    uint32_t seen = __atomic_load_n(words + i, __ATOMIC_RELAXED);
    while (true) {
      float value;
      std::memcpy(&value, &seen, sizeof(value));
      value += delta[i];
      uint32_t wanted;
      std::memcpy(&wanted, &value, sizeof(wanted));
      if (__atomic_compare_exchange_n(words + i, &seen, wanted, /*weak=*/true, __ATOMIC_RELAXED,
                                      __ATOMIC_RELAXED)) {
        break;
      }
    }
  }
}

// The blocks overlapping [lo, hi): [first, last).
void BlockRange(const View& view, uint64_t lo, uint64_t hi, int64_t* first, int64_t* last) {
  const uint32_t nb = view.header->num_blocks;
  const uint64_t* begin = view.block_begin;
  *first = std::upper_bound(begin, begin + nb + 1, lo) - begin - 1;
  *last = std::lower_bound(begin, begin + nb + 1, hi) - begin;
  *first = std::max<int64_t>(*first, 0);
  *last = std::min<int64_t>(*last, nb);
}

// fn(lo, hi) over [0, n) in chunks on the device's threads.
template <typename Fn>
void ParallelChunks(const CPUDevice& d, int64_t n, double bytes_per_element, Fn fn) {
  const int64_t chunks = (n + kChunk - 1) / kChunk;
  if (chunks == 0) return;
  const OpCost cost(kChunk * bytes_per_element, kChunk * 4.0, kChunk * 2.0);
  d.parallelFor(chunks, cost, [&](Index first, Index last) {
    for (Index c = first; c < last; ++c) fn(c * kChunk, std::min<int64_t>(n, (c + 1) * kChunk));
  });
}

}  // namespace

Status Open(uint64_t address, View* view) {
  shm::SegmentHeader* segment = nullptr;
  HVDX_RETURN_IF_ERROR(shm::OpenHeader(address, kMagic, kLayoutVersion, "shared model segment", &segment));
  Header* header = reinterpret_cast<Header*>(segment);
  view->header = header;
  view->block_begin = reinterpret_cast<const uint64_t*>(address + sizeof(Header));
  const uint64_t records = shm::AlignUp(sizeof(Header) + (header->num_blocks + 1) * sizeof(uint64_t));
  view->blocks = reinterpret_cast<BlockRecord*>(address + records);
  view->params = reinterpret_cast<float*>(address + header->data_offset);
  if (view->block_begin[0] != 0 || view->block_begin[header->num_blocks] != header->size) {
    return errors::InvalidArgument("shared model segment's blocks do not cover its ", header->size, " elements");
  }
  return OkStatus();
}

void Lock(int32_t* word) {
  const int32_t me = static_cast<int32_t>(getpid());
  for (uint64_t spins = 0;; ++spins) {
    int32_t owner = 0;
    if (__atomic_compare_exchange_n(word, &owner, me, false, __ATOMIC_ACQUIRE, __ATOMIC_RELAXED)) return;
    if (spins < 128) {
      CpuRelax();
      continue;
    }
    sched_yield();
    // A process killed while holding the lock never releases it: take it over.
    if (spins % 1024 == 0 && owner != 0 && owner != me && !shm::ProcessAlive(owner)) {
      __atomic_compare_exchange_n(word, &owner, 0, false, __ATOMIC_ACQ_REL, __ATOMIC_RELAXED);
    }
  }
}

void Unlock(int32_t* word) { __atomic_store_n(word, 0, __ATOMIC_RELEASE); }

template <>
uint64_t Read<CPUDevice>::operator()(const CPUDevice& d, const View& view, Mode mode, float* out) {
  const uint64_t version = __atomic_load_n(&view.header->updates, __ATOMIC_ACQUIRE);
  const int64_t n = static_cast<int64_t>(view.header->size);
  const float* params = view.params;
  auto copy = [&](int64_t lo, int64_t hi) { std::memcpy(out + lo, params + lo, (hi - lo) * sizeof(float)); };
  if (mode == Mode::kBlock) {
    const int64_t nb = view.header->num_blocks;
    const OpCost cost(static_cast<double>(n) / std::max<int64_t>(nb, 1) * 4, 
                                   static_cast<double>(n) / std::max<int64_t>(nb, 1) * 4, 100);
    d.parallelFor(nb, cost, [&](Index first, Index last) {
      for (Index b = first; b < last; ++b) {
        Lock(&view.blocks[b].lock);
        copy(view.block_begin[b], view.block_begin[b + 1]);
        Unlock(&view.blocks[b].lock);
      }
    });
    return version;
  }
  if (mode == Mode::kWhole) Lock(&view.header->whole_lock);
  ParallelChunks(d, n, 8.0, copy);
  if (mode == Mode::kWhole) Unlock(&view.header->whole_lock);
  return version;
}

template <>
uint64_t Update<CPUDevice>::operator()(const CPUDevice& d, const View& view, Mode mode, const float* delta,
                                       uint64_t offset, uint64_t m, float* read_back) {
  float* params = view.params + offset;
  int64_t first = 0, last = 0;
  BlockRange(view, offset, offset + m, &first, &last);
  if (mode == Mode::kBlock) {
    // Each touched block is written under its own lock, by one thread; blocks in parallel.
    const OpCost cost(static_cast<double>(m) / std::max<int64_t>(last - first, 1) * 8,
                                   static_cast<double>(m) / std::max<int64_t>(last - first, 1) * 4, 100);
    d.parallelFor(last - first, cost, [&](Index lo_block, Index hi_block) {
      for (Index b = first + lo_block; b < first + hi_block; ++b) {
        const uint64_t lo = std::max<uint64_t>(view.block_begin[b], offset);
        const uint64_t hi = std::min<uint64_t>(view.block_begin[b + 1], offset + m);
        Lock(&view.blocks[b].lock);
        AtomicAdd(view.params + lo, delta + (lo - offset), hi - lo);
        Unlock(&view.blocks[b].lock);
      }
    });
  } else {
    if (mode == Mode::kWhole) Lock(&view.header->whole_lock);
    ParallelChunks(d, static_cast<int64_t>(m), 12.0,
                   [&](int64_t lo, int64_t hi) { AtomicAdd(params + lo, delta + lo, hi - lo); });
  }
  for (int64_t b = first; b < last; ++b) __atomic_fetch_add(&view.blocks[b].updates, 1, __ATOMIC_RELAXED);
  const uint64_t before = __atomic_fetch_add(&view.header->updates, 1, __ATOMIC_ACQ_REL);
  if (read_back != nullptr) {
    const int64_t n = static_cast<int64_t>(view.header->size);
    ParallelChunks(d, n, 8.0, [&](int64_t lo, int64_t hi) {
      std::memcpy(read_back + lo, view.params + lo, (hi - lo) * sizeof(float));
    });
  }
  if (mode == Mode::kWhole) Unlock(&view.header->whole_lock);
  return before;
}

}  // namespace shared
}  // namespace hvdx
