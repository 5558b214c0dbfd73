// The progress table of hvdx's watchdog (hvdx/progress.py, hvdx/watchdog.py): counters that
// the graph's marks (HvdxProgressMark, csrc/ops/progress_ops.cc) advance as a collective call
// begins and ends, read from Python through the C functions below (ctypes) by the watchdog's
// thread, never by the step.
//
// A counter is named by (label, detail), e.g. ("hitopk", "grads"): `entered` counts the marks
// before its collectives, `left` those after them, so a rank with entered > left waits in them.
// Two process-wide numbers let the watchdog poll without reading the table: the generation
// (advanced by every mark) and the number of calls entered and not yet left.
//
// No TensorFlow here: the kernel only looks a counter up when it is built and records.
#ifndef HVDX_KERNELS_PROGRESS_H_
#define HVDX_KERNELS_PROGRESS_H_

#include <atomic>
#include <cstdint>
#include <string>

namespace hvdx {
namespace progress {

// enter: before a collective call's first collective; leave: after its last. begin / end:
// the bounds of a span of the timeline inside a call (counted nowhere, only recorded).
enum class Phase : int { kEnter = 0, kLeave = 1, kBegin = 2, kEnd = 3 };

struct Counter {
  std::string label, detail;
  std::atomic<int64_t> entered{0};
  std::atomic<int64_t> left{0};
};

// The counter of (label, detail), created on first use; its address never changes.
Counter* Find(const std::string& label, const std::string& detail);

// Counts an enter or a leave of `counter` (begin / end: nothing); while the timeline records,
// also appends (counter, phase, now) to its event buffer.
void Record(Counter* counter, Phase phase);

// Whether `name` is "enter", "leave", "begin" or "end"; sets *phase.
bool ParsePhase(const std::string& name, Phase* phase);

}  // namespace progress
}  // namespace hvdx

extern "C" {
// Every counter as lines "label\tdetail\tentered\tleft\n" into buf (size bytes).
// Returns the bytes written, or, when they do not fit, minus the bytes needed (nothing written).
int64_t hvdx_progress_snapshot(char* buf, int64_t size);
// Advanced by every mark: equal values mean that no mark ran in between.
int64_t hvdx_progress_generation();
// Calls entered and not yet left, over every counter.
int64_t hvdx_progress_open();
// The timeline's recording (hvdx/timeline.py): on (1) or off (0); every mark run while on is
// kept (at most 2^22 events; later ones are counted as dropped). Returns the previous state.
int hvdx_timeline_record(int on);
// The recorded events, oldest first, as lines "label\tdetail\tphase\tmicroseconds since the
// epoch\tthread\n" into buf (size bytes), removed from the buffer. Returns the bytes written,
// or, when they do not fit, minus the bytes needed (nothing written, nothing removed).
int64_t hvdx_timeline_drain(char* buf, int64_t size);
// Events not kept since the start because the buffer was full.
int64_t hvdx_timeline_dropped();
}

#endif  // HVDX_KERNELS_PROGRESS_H_
