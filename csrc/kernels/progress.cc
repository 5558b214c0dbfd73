// The progress table (csrc/kernels/progress.h).
#include "kernels/progress.h"

#include <cstring>
#include <deque>
#include <mutex>
#include <string>
#include <unordered_map>

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
  } else {
    counter->left.fetch_add(1, std::memory_order_relaxed);
    t.open.fetch_sub(1, std::memory_order_relaxed);
  }
  t.generation.fetch_add(1, std::memory_order_release);
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

}  // extern "C"
