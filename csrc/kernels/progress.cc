// The progress table (csrc/kernels/progress.h).
#include "kernels/progress.h"

#include <chrono>
#include <cstring>
#include <deque>
#include <functional>
#include <mutex>
#include <string>
#include <thread>
#include <unordered_map>
#include <vector>

namespace hvdx {
namespace progress {

namespace {

struct Table {
  std::mutex mutex;                                   // guards counters, by_key
  std::deque<Counter> counters;                       // stable addresses
  std::unordered_map<std::string, Counter*> by_key;
  std::atomic<int64_t> generation{0};
  std::atomic<int64_t> open{0};
};

Table& table() {
  static Table* t = new Table();  // never destroyed: marks may run while the process exits
  return *t;
}

// The timeline's events (hvdx_timeline_record / _drain).
struct Event {
  const Counter* counter;
  Phase phase;
  int64_t micros;  // since the epoch (system clock: Horovod's timeline starts from it too)
  size_t thread;
};

constexpr size_t kMaxEvents = size_t{1} << 22;

struct Recording {
  std::atomic<int> on{0};
  std::mutex mutex;  // guards events
  std::vector<Event> events;
  std::atomic<int64_t> dropped{0};
};

Recording& recording() {
  static Recording* r = new Recording();  // never destroyed, like the table
  return *r;
}

const char* PhaseName(Phase phase) {
  switch (phase) {
    case Phase::kEnter: return "enter";
    case Phase::kLeave: return "leave";
    case Phase::kBegin: return "begin";
    default: return "end";
  }
}

}  // namespace

Counter* Find(const std::string& label, const std::string& detail) {
  Table& t = table();
  std::string key = label;
  key.push_back('\x1f');
  key += detail;
  std::lock_guard<std::mutex> lock(t.mutex);
  auto it = t.by_key.find(key);
  if (it != t.by_key.end()) return it->second;
  Counter& c = t.counters.emplace_back();
  c.label = label;
  c.detail = detail;
  t.by_key.emplace(std::move(key), &c);
  return &c;
}

void Record(Counter* counter, Phase phase) {
  Table& t = table();
  if (phase == Phase::kEnter) {
    counter->entered.fetch_add(1, std::memory_order_relaxed);
    t.open.fetch_add(1, std::memory_order_relaxed);
  } else if (phase == Phase::kLeave) {
    counter->left.fetch_add(1, std::memory_order_relaxed);
    t.open.fetch_sub(1, std::memory_order_relaxed);
  }
  t.generation.fetch_add(1, std::memory_order_release);
  Recording& r = recording();
  if (r.on.load(std::memory_order_relaxed)) {
    const int64_t micros = std::chrono::duration_cast<std::chrono::microseconds>(
                               std::chrono::system_clock::now().time_since_epoch())
                               .count();
    const size_t thread = std::hash<std::thread::id>()(std::this_thread::get_id());
    std::lock_guard<std::mutex> lock(r.mutex);
    if (r.events.size() < kMaxEvents) {
      r.events.push_back(Event{counter, phase, micros, thread});
    } else {
      r.dropped.fetch_add(1, std::memory_order_relaxed);
    }
  }
}

bool ParsePhase(const std::string& name, Phase* phase) {
  if (name == "enter") {
    *phase = Phase::kEnter;
    return true;
  }
  if (name == "leave") {
    *phase = Phase::kLeave;
    return true;
  }
  if (name == "begin") {
    *phase = Phase::kBegin;
    return true;
  }
  if (name == "end") {
    *phase = Phase::kEnd;
    return true;
  }
  return false;
}

}  // namespace progress
}  // namespace hvdx

extern "C" {

int64_t hvdx_progress_snapshot(char* buf, int64_t size) {
  auto& t = hvdx::progress::table();
  std::string text;
  {
    std::lock_guard<std::mutex> lock(t.mutex);
    for (const auto& c : t.counters) {
      text += c.label + "\t" + c.detail + "\t" + std::to_string(c.entered.load(std::memory_order_relaxed)) + "\t" +
              std::to_string(c.left.load(std::memory_order_relaxed)) + "\n";
    }
  }
  const int64_t n = static_cast<int64_t>(text.size());
  if (n > size || buf == nullptr) return -n;
  std::memcpy(buf, text.data(), text.size());
  return n;
}

int64_t hvdx_progress_generation() {
  return hvdx::progress::table().generation.load(std::memory_order_acquire);
}

int64_t hvdx_progress_open() { return hvdx::progress::table().open.load(std::memory_order_relaxed); }

int hvdx_timeline_record(int on) { return hvdx::progress::recording().on.exchange(on != 0 ? 1 : 0); }

int64_t hvdx_timeline_drain(char* buf, int64_t size) {
  auto& r = hvdx::progress::recording();
  std::lock_guard<std::mutex> lock(r.mutex);
  std::string text;
  for (const auto& e : r.events) {
    text += e.counter->label + "\t" + e.counter->detail + "\t" + hvdx::progress::PhaseName(e.phase) + "\t" +
            std::to_string(e.micros) + "\t" + std::to_string(e.thread % 1000000) + "\n";
  }
  const int64_t n = static_cast<int64_t>(text.size());
  if (n > size || buf == nullptr) return -n;
  std::memcpy(buf, text.data(), text.size());
  r.events.clear();
  return n;
}

int64_t hvdx_timeline_dropped() { return hvdx::progress::recording().dropped.load(std::memory_order_relaxed); }

}  // extern "C"
