// The progress table and the timeline buffer (csrc/kernels/progress.h).
#include "kernels/progress.h"

#include <chrono>
#include <cstring>
#include <deque>
#include <mutex>
#include <string>
#include <unordered_map>
#include <vector>

namespace hvdx {
namespace progress {

namespace {

struct Event {
  int32_t counter;
  int32_t phase;
  int64_t micros;
};

struct Table {
  std::mutex mutex;                                   // guards counters, by_key
  std::deque<Counter> counters;                       // stable addresses
  std::unordered_map<std::string, Counter*> by_key;
  std::mutex events_mutex;                            // guards events, dropped
  std::vector<Event> events;
  int64_t dropped = 0;
  std::atomic<bool> recording{false};
};

Table& table() {
  static Table* t = new Table();  // never destroyed: marks may run while the process exits
  return *t;
}

int64_t NowMicros() {
  return std::chrono::duration_cast<std::chrono::microseconds>(
             std::chrono::system_clock::now().time_since_epoch())
      .count();
}

const char* kPhaseNames[] = {"enter", "leave", "begin", "end"};

// Copies `text` into buf when it fits: the return convention of the C functions.
int64_t Deliver(const std::string& text, char* buf, int64_t size) {
  const int64_t n = static_cast<int64_t>(text.size());
  if (n > size || buf == nullptr) return -n;
  std::memcpy(buf, text.data(), text.size());
  return n;
}

}  // namespace

Counter* Find(const std::string& label, const std::string& detail, const std::string& noun) {
  Table& t = table();
  std::string key = label;
  key.push_back('\x1f');
  key += detail;
  key.push_back('\x1f');
  key += noun;
  std::lock_guard<std::mutex> lock(t.mutex);
  auto it = t.by_key.find(key);
  if (it != t.by_key.end()) return it->second;
  Counter& c = t.counters.emplace_back();
  c.label = label;
  c.detail = detail;
  c.noun = noun;
  c.index = static_cast<int32_t>(t.counters.size() - 1);
  t.by_key.emplace(std::move(key), &c);
  return &c;
}

void Record(Counter* counter, Phase phase) {
  if (phase == Phase::kEnter) counter->entered.fetch_add(1, std::memory_order_relaxed);
  if (phase == Phase::kLeave) counter->left.fetch_add(1, std::memory_order_relaxed);
  Table& t = table();
  if (!t.recording.load(std::memory_order_relaxed)) return;
  const Event event{counter->index, static_cast<int32_t>(phase), NowMicros()};
  std::lock_guard<std::mutex> lock(t.events_mutex);
  if (static_cast<int64_t>(t.events.size()) >= kMaxTimelineEvents) {
    ++t.dropped;
    return;
  }
  t.events.push_back(event);
}

bool ParsePhase(const std::string& name, Phase* phase) {
  for (int i = 0; i < 4; ++i) {
    if (name == kPhaseNames[i]) {
      *phase = static_cast<Phase>(i);
      return true;
    }
  }
  return false;
}

}  // namespace progress
}  // namespace hvdx

using hvdx::progress::table;

extern "C" {

int64_t hvdx_progress_snapshot(char* buf, int64_t size) {
  auto& t = table();
  std::string text;
  {
    std::lock_guard<std::mutex> lock(t.mutex);
    for (const auto& c : t.counters) {
      text += c.label + "\t" + c.detail + "\t" + c.noun + "\t" +
              std::to_string(c.entered.load(std::memory_order_relaxed)) + "\t" +
              std::to_string(c.left.load(std::memory_order_relaxed)) + "\n";
    }
  }
  return hvdx::progress::Deliver(text, buf, size);
}

void hvdx_timeline_record(int on) { table().recording.store(on != 0); }

int64_t hvdx_timeline_drain(char* buf, int64_t size) {
  auto& t = table();
  std::string text;
  {
    std::lock_guard<std::mutex> lock(t.mutex);
    for (const auto& c : t.counters) {
      text += "#" + std::to_string(c.index) + "\t" + c.label + "\t" + c.detail + "\n";
    }
  }
  std::lock_guard<std::mutex> lock(t.events_mutex);
  for (const auto& e : t.events) {
    text += std::to_string(e.counter) + "\t" + hvdx::progress::kPhaseNames[e.phase] + "\t" +
            std::to_string(e.micros) + "\n";
  }
  const int64_t n = hvdx::progress::Deliver(text, buf, size);
  if (n >= 0) t.events.clear();
  return n;
}

int64_t hvdx_timeline_dropped() {
  auto& t = table();
  std::lock_guard<std::mutex> lock(t.events_mutex);
  return t.dropped;
}

}  // extern "C"
