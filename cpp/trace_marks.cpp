// The process's one recorder of timing marks (include/moriio_native/trace_marks.hpp).

#include "moriio_native/trace_marks.hpp"

#include <array>
#include <atomic>
#include <chrono>
#include <mutex>
#include <string>

namespace moriio_native::trace {
namespace {

constexpr std::size_t kMaxCapacity = std::size_t{1} << 24;

constexpr std::array<std::string_view, kMarkCount> kNames = {
    "call_entry",  "planned",   "piece_cut",         "submit_entry",     "submit_exit",
    "call_exit",   "activated", "copy_submit_entry", "copy_submit_exit", "binding_entry",
    "pairs_checked", "layers_planned", "wake_sent",         "woke",
};

struct Recorder {
  std::atomic<bool> enabled{false};
  std::mutex mu;
  std::vector<Stamp> stamps;  // capacity reserved by Enable; never grows past it
  std::size_t capacity = 0;
  std::uint64_t dropped = 0;
  std::atomic<std::uint32_t> next_thread{1};
};

Recorder& TheRecorder() {
  static Recorder r;  // never destroyed before the threads that record: marks only read it
  return r;
}

}  // namespace

std::string_view MarkName(Mark mark) {
  const auto i = static_cast<std::size_t>(mark);
  return i < kNames.size() ? kNames[i] : std::string_view("unknown");
}

bool CompiledIn() {
#ifdef MORIIO_NATIVE_TRACE_MARKS
  return true;
#else
  return false;
#endif
}

Status Enable(std::size_t capacity) {
  if (!CompiledIn()) {
    return FailedPreconditionError(
        "trace marks are not compiled in: build with -DMORIIO_NATIVE_TRACE_MARKS=ON");
  }
  if (capacity == 0 || capacity > kMaxCapacity) {
    return InvalidArgumentError("trace mark capacity must be 1.." + std::to_string(kMaxCapacity) +
                                ", got " + std::to_string(capacity));
  }
  Recorder& r = TheRecorder();
  std::lock_guard lock(r.mu);
  r.stamps.clear();
  r.stamps.reserve(capacity);
  r.capacity = capacity;
  r.dropped = 0;
  r.enabled.store(true, std::memory_order_release);
  return Status::OK();
}

void Disable() { TheRecorder().enabled.store(false, std::memory_order_release); }

Taken Take() {
  Recorder& r = TheRecorder();
  Taken out;
  std::lock_guard lock(r.mu);
  out.stamps.reserve(r.capacity);
  out.stamps.swap(r.stamps);  // the recorder keeps a buffer of the same capacity
  out.dropped = r.dropped;
  r.dropped = 0;
  return out;
}

#ifdef MORIIO_NATIVE_TRACE_MARKS
void Record(Mark mark, std::uint64_t token) {
  Recorder& r = TheRecorder();
  if (!r.enabled.load(std::memory_order_relaxed)) return;
  const std::int64_t ns = std::chrono::duration_cast<std::chrono::nanoseconds>(
                              std::chrono::steady_clock::now().time_since_epoch())
                              .count();
  thread_local const std::uint32_t thread = r.next_thread.fetch_add(1, std::memory_order_relaxed);
  std::lock_guard lock(r.mu);
  if (r.stamps.size() >= r.capacity) {
    ++r.dropped;
    return;
  }
  r.stamps.push_back(Stamp{mark, ns, token, thread});
}
#endif

}  // namespace moriio_native::trace
