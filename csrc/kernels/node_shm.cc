// The node-local shared-memory collectives (layout and protocol: node_shm.h). Builds without
// TensorFlow too (csrc/harness): only status.h and shm_segment.h.
#include "kernels/node_shm.h"

#include <linux/futex.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <climits>
#include <cstdio>
#include <cstring>
#include <map>
#include <sstream>
#include <utility>
#include <vector>

namespace hvdx {
namespace node_shm {

namespace {

constexpr uint64_t kStatesOffset = sizeof(ChannelHeader);
constexpr uint64_t kRecordsOffset = kStatesOffset + sizeof(RankState) * kMaxRanks;
constexpr int kWaitSliceMs = 100;  // how often a waiter checks its peers and the deadline

using Clock = std::chrono::steady_clock;

long Futex(uint32_t* word, int op, uint32_t value, const struct timespec* timeout) {
  return syscall(SYS_futex, word, op, value, timeout, nullptr, 0);
}

// TensorFlow's DataType codes of the types the ops take (types.proto).
const char* DtypeName(uint32_t code) {
  switch (code) {
    case 1: return "float32";
    case 2: return "float64";
    case 3: return "int32";
    case 4: return "uint8";
    case 5: return "int16";
    case 6: return "int8";
    case 9: return "int64";
    case 10: return "bool";
    case 14: return "bfloat16";
    case 17: return "uint16";
    case 19: return "float16";
    default: return "?";
  }
}

std::string Describe(const CallRecord& r) {
  std::ostringstream out;
  const char* kind = r.kind == kAllToAll ? "all-to-all" : r.kind == kAllGather ? "all-gather" : "nothing";
  out << kind << " '" << std::string(r.name, strnlen(r.name, kNameBytes)) << "' (call #" << r.seq << ", "
      << DtypeName(r.dtype) << ", " << r.elements << (r.kind == kAllGather ? " rows of " : " elements, splits hash ")
      << r.splits_hash << ")";
  return out.str();
}

// Marks the channel failed with `message` (the first failure's message is kept for the others)
// and wakes every waiter. Returns the error to report.
Status Fail(Channel* c, const std::string& message) {
  ChannelHeader* h = c->header;
  uint32_t unclaimed = 0;
  if (__atomic_compare_exchange_n(&h->reserved0, &unclaimed, 1u, false, __ATOMIC_ACQ_REL, __ATOMIC_ACQUIRE)) {
    std::snprintf(h->reason, sizeof(h->reason), "%s", message.c_str());
    __atomic_store_n(&h->failed, c->rank + 1, __ATOMIC_RELEASE);
  }
  __atomic_add_fetch(&h->generation, 0, __ATOMIC_SEQ_CST);
  Futex(&h->generation, FUTEX_WAKE, INT_MAX, nullptr);
  return errors::Internal("hvdx node_engine='shm': ", message);
}

Status Failed(Channel* c) {
  const uint32_t failed = __atomic_load_n(&c->header->failed, __ATOMIC_ACQUIRE);
  if (failed == 0) return OkStatus();
  return errors::Internal("hvdx node_engine='shm': the node's shared-memory communicator failed (on node-local "
                          "rank ", failed - 1, "): ",
                          std::string(c->header->reason, strnlen(c->header->reason, sizeof(c->header->reason))),
                          ". It cannot be used again in this process: restart the job");
}

Status Barrier(Channel* c, Clock::time_point deadline, double timeout_s, const std::string& what) {
  ChannelHeader* h = c->header;
  HVDX_RETURN_IF_ERROR(Failed(c));
  const uint32_t generation = __atomic_load_n(&h->generation, __ATOMIC_ACQUIRE);
  const uint64_t mine = __atomic_add_fetch(&c->states[c->rank].barriers, 1, __ATOMIC_ACQ_REL);
  if (__atomic_add_fetch(&h->count, 1, __ATOMIC_ACQ_REL) == c->size) {
    __atomic_store_n(&h->count, 0, __ATOMIC_RELAXED);
    __atomic_add_fetch(&h->generation, 1, __ATOMIC_ACQ_REL);
    Futex(&h->generation, FUTEX_WAKE, INT_MAX, nullptr);
    return OkStatus();
  }
  const struct timespec slice = {0, kWaitSliceMs * 1000000L};
  while (true) {
    if (__atomic_load_n(&h->generation, __ATOMIC_ACQUIRE) != generation) return OkStatus();
    HVDX_RETURN_IF_ERROR(Failed(c));
    Futex(&h->generation, FUTEX_WAIT, generation, &slice);  // EAGAIN, ETIMEDOUT, EINTR: look again
    if (__atomic_load_n(&h->generation, __ATOMIC_ACQUIRE) != generation) return OkStatus();
    HVDX_RETURN_IF_ERROR(Failed(c));
    const bool late = Clock::now() > deadline;
    std::ostringstream missing;
    for (uint32_t r = 0; r < c->size; ++r) {
      if (r == c->rank || __atomic_load_n(&c->states[r].barriers, __ATOMIC_ACQUIRE) >= mine) continue;
      const int32_t pid = __atomic_load_n(&c->segment->pids[r], __ATOMIC_ACQUIRE);
      if (pid != 0 && !shm::ProcessAlive(pid)) {  // 0: not attached yet (it may still come)
        std::ostringstream message;
        message << "node-local rank " << r << " (pid " << pid << ") is gone while node-local rank " << c->rank
                << " waited for it in " << what;
        return Fail(c, message.str());
      }
      missing << (missing.tellp() > 0 ? ", " : "") << "node-local rank " << r;
      if (pid != 0) missing << " (pid " << pid << ")";
      else missing << " (never attached)";
    }
    if (late) {
      std::ostringstream message;
      message << missing.str() << " did not arrive within " << timeout_s << " s while node-local rank " << c->rank
              << " waited in " << what
              << " (a rank stuck elsewhere, or ranks that issue different collectives; raise the timeout with "
                 "HVDX_NODE_SHM_TIMEOUT)";
      return Fail(c, message.str());
    }
  }
}

// Checks that every rank's record in `buffer` agrees with local rank 0's.
Status Agree(Channel* c, uint64_t buffer) {
  const CallRecord* records = c->records + buffer * c->size;
  const CallRecord& ref = records[0];
  for (uint32_t r = 1; r < c->size; ++r) {
    const CallRecord& other = records[r];
    if (other.seq != ref.seq || other.phase != ref.phase || other.kind != ref.kind || other.name_hash != ref.name_hash ||
        other.dtype != ref.dtype || other.element_bytes != ref.element_bytes ||
        other.splits_hash != ref.splits_hash || (ref.kind == kAllToAll && other.elements != ref.elements)) {
      std::ostringstream message;
      message << "the node's ranks issued different collectives: node-local rank 0 called " << Describe(ref)
              << " but node-local rank " << r << " called " << Describe(other)
              << "; every rank of a node must make the same node-local collectives in the same order";
      return Fail(c, message.str());
    }
  }
  return OkStatus();
}

inline uint64_t Chunk(uint64_t length, uint64_t round, uint64_t chunk) {
  const uint64_t start = round * chunk;
  return start >= length ? 0 : std::min(chunk, length - start);
}

}  // namespace

uint64_t NameHash(const std::string& name) {
  uint64_t h = 1469598103934665603ull;
  for (unsigned char ch : name) {
    h ^= ch;
    h *= 1099511628211ull;
  }
  return h;
}

Status Open(uint64_t address, uint32_t channel_index, uint32_t rank, Channel* channel) {
  shm::SegmentHeader* header = nullptr;
  HVDX_RETURN_IF_ERROR(shm::OpenHeader(address, kMagic, kLayoutVersion, "node segment", &header));
  auto* s = reinterpret_cast<NodeHeader*>(header);
  if (s->num_ranks < 1 || s->num_ranks > kMaxRanks || rank >= s->num_ranks) {
    return errors::InvalidArgument("node_shm: local rank ", rank, " is outside the segment's ", s->num_ranks, " ranks");
  }
  if (channel_index >= s->channels) {
    return errors::InvalidArgument("node_shm: channel ", channel_index, " is outside the segment's ", s->channels);
  }
  const uint64_t records_end = kRecordsOffset + 2 * sizeof(CallRecord) * s->num_ranks;
  if (s->slot_bytes < 128 * s->num_ranks || s->slots_offset < records_end ||
      s->channel_offset < sizeof(NodeHeader) ||
      s->channel_offset + s->channel_stride * s->channels > s->segment.total_bytes ||
      s->slots_offset + s->slot_bytes * s->num_ranks > s->channel_stride) {
    return errors::InvalidArgument("node_shm: the segment at ", address, " has an inconsistent layout");
  }
  char* base = reinterpret_cast<char*>(address) + s->channel_offset + s->channel_stride * channel_index;
  channel->segment = s;
  channel->header = reinterpret_cast<ChannelHeader*>(base);
  channel->states = reinterpret_cast<RankState*>(base + kStatesOffset);
  channel->records = reinterpret_cast<CallRecord*>(base + kRecordsOffset);
  channel->slots = base + s->slots_offset;
  channel->rank = rank;
  channel->size = s->num_ranks;
  channel->slot_bytes = s->slot_bytes;
  return OkStatus();
}

Status Run(Channel* c, const Call& call, const Allocate& allocate) {
  HVDX_RETURN_IF_ERROR(Failed(c));
  const uint32_t n = c->size;
  const uint64_t eb = call.element_bytes;
  if (eb == 0 || eb > 64) return errors::InvalidArgument("node_shm: element size ", eb, " bytes is not supported");
  RankState* state = &c->states[c->rank];
  const uint64_t seq = state->seq + 1;
  state->seq = seq;
  const auto deadline = Clock::now() + std::chrono::duration_cast<Clock::duration>(
                                           std::chrono::duration<double>(call.timeout_s));
  std::ostringstream what_stream;
  what_stream << (call.kind == kAllToAll ? "all-to-all" : "all-gather") << " '" << call.name << "' (call #" << seq
              << ")";
  const std::string what = what_stream.str();

  CallRecord record;
  std::memset(&record, 0, sizeof(record));
  record.seq = seq;
  record.kind = call.kind;
  record.dtype = call.dtype;
  record.element_bytes = call.element_bytes;
  record.name_hash = NameHash(call.name);
  std::snprintf(record.name, kNameBytes, "%s", call.name.c_str());
  const uint64_t half = c->slot_bytes / 2;  // one rank's slot in one of the two buffers
  // A phase writes buffer (phase % 2): this rank's record and slot in it.
  auto buffer_now = [&]() { return __atomic_load_n(&state->barriers, __ATOMIC_RELAXED) % 2; };
  auto slot = [&](uint64_t buffer, uint32_t r) { return c->slots + (buffer * n + r) * half; };
  auto post = [&](uint64_t buffer) {
    record.phase = __atomic_load_n(&state->barriers, __ATOMIC_RELAXED);
    c->records[buffer * n + c->rank] = record;
  };

  if (call.kind == kAllToAll) {
    uint64_t total = 0, max_length = 0, split_hash = 1469598103934665603ull;
    std::vector<uint64_t> offsets(n);
    for (uint32_t j = 0; j < n; ++j) {
      offsets[j] = total;
      total += call.splits[j];
      max_length = std::max(max_length, call.splits[j]);
      split_hash = (split_hash ^ call.splits[j]) * 1099511628211ull;
    }
    if (total != call.elements) {
      return errors::InvalidArgument("node_alltoall '", call.name, "': the splits sum to ", total, " but the input has ",
                                     call.elements, " elements");
    }
    record.elements = call.elements;
    record.splits_hash = split_hash;
    const uint64_t region = half / n / 64 * 64;  // bytes of a slot that go to one rank
    const uint64_t chunk = region / eb;          // elements of one slice per phase
    if (chunk == 0) return errors::InvalidArgument("node_shm: the slots are too small for ", n, " ranks");
    const uint64_t rounds = std::max<uint64_t>(1, (max_length + chunk - 1) / chunk);
    const uint64_t length = call.splits[c->rank];
    char* out = nullptr;
    for (uint64_t round = 0; round < rounds; ++round) {
      const uint64_t buffer = buffer_now();
      post(buffer);
      char* mine = slot(buffer, c->rank);
      for (uint32_t j = 0; j < n; ++j) {
        const uint64_t m = Chunk(call.splits[j], round, chunk);
        if (m) std::memcpy(mine + region * j, call.input + (offsets[j] + round * chunk) * eb, m * eb);
      }
      HVDX_RETURN_IF_ERROR(Barrier(c, deadline, call.timeout_s, what));  // every rank's chunk written
      HVDX_RETURN_IF_ERROR(Agree(c, buffer));
      if (round == 0) {
        Status status;
        out = allocate(length * n, &status);
        if (!status.ok()) return Fail(c, std::string("cannot allocate the output of ") + what);
      }
      const uint64_t m = Chunk(length, round, chunk);
      for (uint32_t i = 0; m && i < n; ++i) {
        std::memcpy(out + (length * i + round * chunk) * eb, slot(buffer, i) + region * c->rank, m * eb);
      }
    }
    return OkStatus();
  }

  // all-gather: every rank's rows, in rank order
  const uint64_t elements = call.rows * call.row_elements;
  record.elements = call.rows;
  record.splits_hash = call.row_elements;
  const uint64_t chunk = half / eb;  // elements of one rank per phase
  std::vector<uint64_t> counts(n), offsets(n);
  uint64_t rounds = 1;
  char* out = nullptr;
  for (uint64_t round = 0; round < rounds; ++round) {
    const uint64_t buffer = buffer_now();
    post(buffer);
    const uint64_t m = Chunk(elements, round, chunk);
    if (m) std::memcpy(slot(buffer, c->rank), call.input + round * chunk * eb, m * eb);
    HVDX_RETURN_IF_ERROR(Barrier(c, deadline, call.timeout_s, what));
    if (round == 0) {
      HVDX_RETURN_IF_ERROR(Agree(c, buffer));
      const CallRecord* records = c->records + buffer * n;
      uint64_t total_rows = 0, total = 0, longest = 0;
      for (uint32_t i = 0; i < n; ++i) {
        total_rows += records[i].elements;
        counts[i] = records[i].elements * call.row_elements;
        offsets[i] = total;
        total += counts[i];
        longest = std::max(longest, counts[i]);
      }
      rounds = std::max<uint64_t>(1, (longest + chunk - 1) / chunk);
      Status status;
      out = allocate(total_rows, &status);
      if (!status.ok()) return Fail(c, std::string("cannot allocate the output of ") + what);
    } else {
      HVDX_RETURN_IF_ERROR(Agree(c, buffer));
    }
    for (uint32_t i = 0; i < n; ++i) {
      const uint64_t k = Chunk(counts[i], round, chunk);
      if (k) std::memcpy(out + (offsets[i] + round * chunk) * eb, slot(buffer, i), k * eb);
    }
  }
  return OkStatus();
}

Worker::Worker() : thread_([this] { Loop(); }) { thread_.detach(); }

Worker* Worker::For(uint64_t address, uint32_t channel) {
  static std::mutex* mu = new std::mutex;
  static auto* workers = new std::map<std::pair<uint64_t, uint32_t>, Worker*>;
  std::lock_guard<std::mutex> lock(*mu);
  Worker*& worker = (*workers)[{address, channel}];
  if (worker == nullptr) worker = new Worker;
  return worker;
}

void Worker::Enqueue(std::function<void()> work) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    queue_.push_back(std::move(work));
  }
  cv_.notify_one();
}

void Worker::Loop() {
  while (true) {
    std::function<void()> work;
    {
      std::unique_lock<std::mutex> lock(mu_);
      cv_.wait(lock, [this] { return !queue_.empty(); });
      work = std::move(queue_.front());
      queue_.pop_front();
    }
    work();
  }
}

}  // namespace node_shm
}  // namespace hvdx
