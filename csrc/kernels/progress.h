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

// enter: before a collective call's first collective; leave: after its last.
enum class Phase : int { kEnter = 0, kLeave = 1 };

struct Counter {
  std::string label, detail;
  std::atomic<int64_t> entered{0};
  std::atomic<int64_t> left{0};
};

// The counter of (label, detail), created on first use; its address never changes.
Counter* Find(const std::string& label, const std::string& detail);

// Counts an enter or a leave of `counter`.
void Record(Counter* counter, Phase phase);

// Whether `name` is "enter" or "leave"; sets *phase.
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
}

#endif  // HVDX_KERNELS_PROGRESS_H_
