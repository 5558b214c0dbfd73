// Node-local collectives through one shared-memory segment per node (hvdx/node/shm_engine.py
// creates it with hvdx/shm.py, maps it in every rank of the node, and unlinks it once all have
// attached).
//
// The segment holds `channels` independent communicators (channel 0: the all-to-alls of the
// node-local reduce-scatter, channel 1: the node-local all-gathers), each with its own
// barrier, call records and data slots, so that the two kinds of collectives, each ordered on
// its own, never wait for each other:
//
//   [0, 512)                    NodeHeader: shm::SegmentHeader (shm_segment.h), the node's
//                               fields, the pids of the local ranks at 256
//   channel c at channel_offset + c * channel_stride:
//     [0, 256)                  ChannelHeader (barrier words, failure word and reason)
//     [256, 4352)               RankState[kMaxRanks]: each rank's barrier and call counters
//     [4352, 4352 + 512 n)      CallRecord[2][n]: what each local rank is calling, per buffer
//     slots_offset              two buffers of n data slots of slot_bytes / 2 each
//
// A collective is a sequence of phases: every rank writes its CallRecord and a chunk of its
// data into its own slot of buffer (phase % 2) -> barrier -> every rank checks that all records
// agree (sequence number, kind, name, dtype, sizes; else an error naming both ranks and both
// names) and reads what it needs from the others' slots of that buffer. The next phase writes
// the other buffer, and no rank can write this one again before every rank has entered the next
// barrier, i.e. finished reading: one barrier per phase, and no torn reads.
//
// The barrier is a generation counter: the last rank to arrive resets the count, increments
// the generation and wakes the waiters (futex on the 32-bit generation word, in the kernel:
// no busy polling); a waiter sleeps in FUTEX_WAIT with a short timeout, after which it checks
// that the ranks that have not arrived still exist (kill(pid, 0), pids recorded at attach) and
// that the call's deadline has not passed. Any failure marks the channel failed (a word every
// waiter checks, with the first reason), wakes the waiters, and every later call fails at once.
// All shared words are accessed with GCC __atomic builtins; no process-shared pthread objects.
#ifndef HVDX_KERNELS_NODE_SHM_H_
#define HVDX_KERNELS_NODE_SHM_H_

#include <condition_variable>
#include <cstdint>
#include <deque>
#include <functional>
#include <mutex>
#include <string>
#include <thread>

#include "kernels/shm_segment.h"
#include "kernels/status.h"

namespace hvdx {
namespace node_shm {

constexpr char kMagic[8] = {'H', 'V', 'D', 'X', 'N', 'S', 'M', '1'};
constexpr uint32_t kLayoutVersion = 2;  // 2: shm::SegmentHeader at the start
constexpr uint32_t kMaxRanks = 64;
constexpr uint32_t kNameBytes = 200;

struct NodeHeader {             // 512 bytes at the segment's start
  shm::SegmentHeader segment;   // magic kMagic, layout kLayoutVersion, creator, attached, ready, size
  uint32_t num_ranks;           // n, the node's ranks
  uint32_t channels;            // independent communicators
  uint64_t slot_bytes;          // bytes of one rank's data slot in one channel
  uint64_t channel_offset;      // bytes from the segment's start to channel 0
  uint64_t channel_stride;      // bytes between channels
  uint64_t slots_offset;        // bytes from a channel's start to its slot 0
  uint32_t reserved[46];
  int32_t pids[kMaxRanks];      // pid of each local rank, written at attach (0: not attached)
};
static_assert(sizeof(NodeHeader) == 512, "NodeHeader must be 512 bytes");

struct ChannelHeader {          // 256 bytes at a channel's start
  uint32_t count;               // ranks in the current barrier (atomic)
  uint32_t generation;          // barrier generation: the futex word
  uint32_t failed;              // 0, or 1 + the local rank that failed the channel first
  uint32_t reserved0;
  char reason[240];             // the first failure's message (written before `failed`)
};
static_assert(sizeof(ChannelHeader) == 256, "ChannelHeader must be 256 bytes");

enum Kind : uint32_t { kAllToAll = 1, kAllGather = 2 };

struct RankState {              // 64 bytes per local rank, written by that rank only
  uint64_t barriers;            // barriers (= phases) this rank has entered on the channel (atomic)
  uint64_t seq;                 // calls this rank has made on the channel
  uint64_t reserved[6];
};
static_assert(sizeof(RankState) == 64, "RankState must be 64 bytes");

struct CallRecord {             // 256 bytes per local rank and buffer
  uint64_t seq;                 // the channel's call number (1, 2, ...)
  uint64_t phase;               // the phase it was written for
  uint32_t kind;                // Kind
  uint32_t dtype;               // the caller's element type code
  uint32_t element_bytes;       // bytes per element
  uint32_t reserved0;
  uint64_t name_hash;           // FNV-1a of the collective's name
  uint64_t elements;            // all-to-all: the input's elements; all-gather: this rank's rows
  uint64_t splits_hash;         // all-to-all: hash of the splits; all-gather: row elements
  char name[kNameBytes];        // the name, truncated, NUL-terminated
};
static_assert(sizeof(CallRecord) == 256, "CallRecord must be 256 bytes");

// A validated view of one channel of a mapped segment, for the local rank `rank`.
struct Channel {
  NodeHeader* segment = nullptr;
  ChannelHeader* header = nullptr;
  RankState* states = nullptr;
  CallRecord* records = nullptr;   // [2][size]
  char* slots = nullptr;           // [2][size] slots of slot_bytes / 2
  uint32_t rank = 0;
  uint32_t size = 0;
  uint64_t slot_bytes = 0;
};

// Checks the segment at `address` (shm::OpenHeader: magic, version, ready; then sizes, rank <
// num_ranks, channel < channels) and fills `channel`; InvalidArgument naming the problem otherwise.
Status Open(uint64_t address, uint32_t channel_index, uint32_t rank, Channel* channel);

// What one call moves. All-to-all: `input` is `splits[0] + ... + splits[n-1]` elements, slice j
// goes to local rank j, and every rank must pass the same splits; `output` receives n slices of
// splits[rank] elements, in rank order. All-gather: `input` holds `rows` rows of `row_elements`
// elements (row_elements the same on every rank); `output` receives every rank's rows in rank
// order (sized by the caller once `GatherRows` told it the counts).
struct Call {
  Kind kind = kAllToAll;
  std::string name;
  uint32_t dtype = 0;
  uint32_t element_bytes = 4;
  const char* input = nullptr;
  uint64_t elements = 0;                 // all-to-all: the input's elements
  const uint64_t* splits = nullptr;      // all-to-all: n entries
  uint64_t rows = 0;                     // all-gather: this rank's rows
  uint64_t row_elements = 1;             // all-gather
  double timeout_s = 300.0;
};

// The collectives. `allocate(count)` returns where to write the output (all-to-all: `count`
// elements; all-gather: `count` rows) or null with an error in `*status`; it is called once,
// after the ranks agree.
using Allocate = std::function<char*(uint64_t elements, Status* status)>;
Status Run(Channel* channel, const Call& call, const Allocate& allocate);

// The name hash stored in call records (FNV-1a 64).
uint64_t NameHash(const std::string& name);

// One worker thread per channel: calls run in the order they were enqueued (FIFO), so a call
// blocked on the other ranks never occupies TensorFlow's threads. Leaked at process exit.
class Worker {
 public:
  static Worker* For(uint64_t address, uint32_t channel);
  void Enqueue(std::function<void()> work);

 private:
  Worker();
  void Loop();
  std::mutex mu_;
  std::condition_variable cv_;
  std::deque<std::function<void()>> queue_;
  std::thread thread_;
};

}  // namespace node_shm
}  // namespace hvdx

#endif  // HVDX_KERNELS_NODE_SHM_H_
