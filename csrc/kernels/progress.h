// The progress table of hvdx's watchdog (hvdx/watchdog.py) and its timeline buffer: counters
// that the graph's marks (HvdxProgressMark, csrc/ops/progress_ops.cc) advance as a step's
// collectives begin and end, read from Python through the C functions below (ctypes) by the
// watchdog's thread, never by the step.
//
// A counter is named by (label, detail, noun), e.g. ("aggregation 'hitopk'", "buffer v0_b0",
// "steps"): `entered` counts the marks before its collectives, `left` those after them, so a
// rank with entered > left waits in them. When the timeline is on, every mark (also those of
// spans, which count nothing: MSTopK, error feedback) appends (counter, phase, time) to a
// bounded buffer that hvdx writes beside Horovod's timeline (docs/comm.md).
//
// No TensorFlow here: the kernel only looks a counter up when it is built and records.
#ifndef HVDX_KERNELS_PROGRESS_H_
#define HVDX_KERNELS_PROGRESS_H_

#include <atomic>
#include <cstdint>
#include <string>

namespace hvdx {
namespace progress {

// enter / leave: a collective's start and end (counted); begin / end: a span inside one (timeline only).
enum class Phase : int { kEnter = 0, kLeave = 1, kBegin = 2, kEnd = 3 };

struct Counter {
  std::string label, detail, noun;
  int32_t index = 0;
  std::atomic<int64_t> entered{0};
  std::atomic<int64_t> left{0};
};

// The counter of (label, detail, noun), created on first use; its address never changes.
Counter* Find(const std::string& label, const std::string& detail, const std::string& noun);

// Counts an enter / leave, and appends the event to the timeline buffer when it records.
void Record(Counter* counter, Phase phase);

// Whether the phase's name is one of "enter", "leave", "begin", "end"; sets *phase.
bool ParsePhase(const std::string& name, Phase* phase);

// At most this many timeline events are kept between two drains; later ones are counted as dropped.
constexpr int64_t kMaxTimelineEvents = 4 << 20;

}  // namespace progress
}  // namespace hvdx

extern "C" {
// Every counter as lines "label\tdetail\tnoun\tentered\tleft\n" into buf (size bytes).
// Returns the bytes written, or, when they do not fit, minus the bytes needed (nothing written).
int64_t hvdx_progress_snapshot(char* buf, int64_t size);
// Starts (on != 0) or stops recording timeline events.
void hvdx_timeline_record(int on);
// Moves the recorded events out as lines "counter index\tphase\tmicroseconds since the epoch\n",
// after a header of the counters "#index\tlabel\tdetail\n"; the same return convention as
// hvdx_progress_snapshot (nothing is drained when they do not fit).
int64_t hvdx_timeline_drain(char* buf, int64_t size);
// Events dropped since the start because the buffer was full.
int64_t hvdx_timeline_dropped();
}

#endif  // HVDX_KERNELS_PROGRESS_H_
