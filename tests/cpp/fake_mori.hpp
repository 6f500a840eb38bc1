#pragma once

// A fake MoRI-IO behind the MoriApi seam (no ROCm needed) for tests of the MoRI backend: it
// records every call, moves real bytes between buffers the way MoRI would (offsets relative to
// each registration's start), and counts TransferStatus misuse (freed or reused while MoRI could
// still write to it). One World per fake engine; the test keeps it so it outlives the backend.

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstring>
#include <deque>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <set>
#include <span>
#include <string>
#include <vector>

#include "backends/mori/mori_api.hpp"
#include "backends/mori/mori_backend.hpp"

namespace moriio_native::fake_mori {

namespace mb = moriio_native::detail::mori_backend;

inline constexpr std::uint32_t kSuccess = 0;
inline constexpr std::uint32_t kInit = 1;
inline constexpr std::uint32_t kInProgress = 2;
inline constexpr std::uint32_t kRdmaOp = 13;
// Guards against hangs; never a timing assert.
inline constexpr auto kWait = std::chrono::seconds(10);

inline std::vector<std::uint8_t> Bytes(const std::string& s) { return {s.begin(), s.end()}; }
inline std::string Text(std::span<const std::uint8_t> b) { return {b.begin(), b.end()}; }

// ---- the fake MoRI ------------------------------------------------------------------------------

class FakeStatus;

// Everything the fake records, shared with the test so it outlives the backend (which owns the
// fake API).
struct World {
  struct Session {
    std::uint64_t id = 0;
    std::uint32_t local_id = 0;
    mb::MoriMemory remote;
    bool destroyed = false;
  };
  struct Post {
    std::uint64_t session = 0;
    TransferOp op = TransferOp::kRead;
    std::vector<std::size_t> local_offsets, remote_offsets, sizes;
    FakeStatus* status = nullptr;
  };

  std::mutex mu;
  std::condition_variable cv;
  bool api_alive = true;
  std::map<std::uint32_t, mb::MoriMemory> registered;  // live local registrations
  std::vector<MemoryRange> register_calls;
  std::vector<std::uint32_t> deregister_calls;
  std::vector<std::string> remote_engines;  // RegisterRemoteEngine calls
  std::vector<std::string> deregistered_engines;
  std::vector<Session> sessions;
  std::vector<Post> posts;
  std::set<const FakeStatus*> live_statuses;
  int statuses_made = 0;
  // A status freed while the API (MoRI) lived: MoRI could still write there. Must stay 0.
  int freed_too_early = 0;
  int writers = 0;           // "MoRI" writes in progress
  int resets = 0;            // statuses reused for another batch
  int reset_unfinished = 0;  // ... that had not reached SUCCESS. Must stay 0.
  // A late write found its status already freed. Must stay 0.
  int late_write_to_freed = 0;
  std::deque<mb::MoriPeerFailure> failures;
  // HIP events (Batch::device_wait_event): not completed while in pending_events; those in
  // broken_events cannot be queried. Every other event has completed.
  std::set<std::uint64_t> pending_events;
  std::set<std::uint64_t> broken_events;
  int event_queries = 0;
  // Behaviour switches.
  bool auto_complete = true;  // PostBatch moves the bytes and reports SUCCESS at once
  bool fail_create_session = false;
  bool reject_post = false;

  bool WaitPosts(std::size_t n) {
    return WaitUntil([&] { return posts.size() >= n; });
  }
  template <typename Pred>
  bool WaitUntil(Pred pred) {
    std::unique_lock lock(mu);
    return cv.wait_for(lock, kWait, pred);
  }
  void Complete(std::size_t post, std::uint32_t code, const std::string& message);
  // MoRI may still update a failed status (later CQEs of the same batch): do that to every
  // status ever posted, counting writes that would have hit freed memory.
  void LateWriteAll();
};

class FakeStatus final : public mb::MoriTransferStatus {
 public:
  explicit FakeStatus(std::shared_ptr<World> world) : world_(std::move(world)) {
    std::lock_guard lock(world_->mu);
    world_->live_statuses.insert(this);
    ++world_->statuses_made;
  }
  ~FakeStatus() override {
    std::lock_guard lock(world_->mu);
    world_->live_statuses.erase(this);
    if (world_->api_alive) ++world_->freed_too_early;
  }
  std::uint32_t Code() override { return code_.load(); }
  std::string Message() override {
    std::lock_guard lock(mu_);
    return message_;
  }
  std::uint32_t WaitFor(int timeout_ms) override {
    std::unique_lock lock(mu_);
    cv_.wait_for(lock, std::chrono::milliseconds(timeout_ms),
                 [&] { return code_.load() != kInProgress; });
    return code_.load();
  }
  void Reset() override {
    std::lock_guard lock(world_->mu);
    ++world_->resets;
    if (code_.load() != kSuccess) ++world_->reset_unfinished;
    code_.store(kInit);
  }
  // Like MoRI's TransferStatus::Update: the code is visible before the notify, which happens
  // outside the lock -- so whoever sees the code must not free the status right away.
  void Set(std::uint32_t code, const std::string& message) {
    {
      std::lock_guard lock(mu_);
      message_ = message;
      code_.store(code);
    }
    cv_.notify_all();
  }

 private:
  std::shared_ptr<World> world_;
  std::atomic<std::uint32_t> code_{kInit};
  std::mutex mu_;
  std::condition_variable cv_;
  std::string message_;
};

// The test thread plays MoRI's completion thread. Like MoRI's, it writes only while the engine
// exists, and destroying the engine waits for a write in progress (MoRI joins its threads).
inline void World::Complete(std::size_t post, std::uint32_t code, const std::string& message) {
  FakeStatus* status = nullptr;
  {
    std::lock_guard lock(mu);
    if (!api_alive) return;
    status = posts.at(post).status;
    if (!live_statuses.count(status)) {
      ++late_write_to_freed;
      return;
    }
    ++writers;
  }
  status->Set(code, message);
  std::lock_guard lock(mu);
  --writers;
  cv.notify_all();
}

inline void World::LateWriteAll() {
  std::vector<FakeStatus*> all;
  {
    std::lock_guard lock(mu);
    if (!api_alive) return;
    for (const Post& p : posts) {
      if (!live_statuses.count(p.status)) ++late_write_to_freed;
      all.push_back(p.status);
    }
    if (late_write_to_freed) return;
    ++writers;
  }
  for (FakeStatus* s : all) {
    const std::uint32_t code = s->Code();
    if (code != kSuccess && code != kInProgress && code != kInit) s->Set(code, "late completion");
  }
  std::lock_guard lock(mu);
  --writers;
  cv.notify_all();
}

// Blob formats of the fake: engine "fake-engine|<key>", memory "fake-mem|<key>|<id>|<data>|
// <size>|<kind>|<device>".
inline std::vector<std::uint8_t> EngineBlob(const std::string& key) {
  return Bytes("fake-engine|" + key);
}

inline std::vector<std::uint8_t> MemBlob(const mb::MoriMemory& m) {
  return Bytes("fake-mem|" + m.engine_key + "|" + std::to_string(m.id) + "|" +
               std::to_string(m.data) + "|" + std::to_string(m.size) + "|" +
               std::to_string(static_cast<int>(m.kind)) + "|" + std::to_string(m.device));
}

inline std::vector<std::string> Split(const std::string& s, char sep) {
  std::vector<std::string> out(1);
  for (char c : s) {
    if (c == sep) {
      out.emplace_back();
    } else {
      out.back() += c;
    }
  }
  return out;
}

/// `n` bytes of host memory on a page boundary, filled with a pattern of `seed` (the fake's
/// engines register whole pages, as MoRI's RDMA path does).
struct PageAlignedBuffer {
  PageAlignedBuffer(const PageAlignedBuffer&) = delete;
  PageAlignedBuffer& operator=(const PageAlignedBuffer&) = delete;
  explicit PageAlignedBuffer(std::size_t n, std::uint8_t seed) : storage(n + 4096) {
    auto base = reinterpret_cast<std::uintptr_t>(storage.data());
    data = reinterpret_cast<std::uint8_t*>((base + 4095) & ~std::uintptr_t{4095});
    size = n;
    for (std::size_t i = 0; i < n; ++i) data[i] = static_cast<std::uint8_t>(seed + i * 7 + i / 251);
  }
  std::uint64_t addr() const { return reinterpret_cast<std::uint64_t>(data); }
  MemoryRange range(std::uint64_t off, std::uint64_t len) const {
    return {addr() + off, len, MemoryKind::kHost, -1};
  }
  std::vector<std::uint8_t> storage;
  std::uint8_t* data = nullptr;
  std::size_t size = 0;
};

class FakeMoriApi : public mb::MoriApi {
 public:
  FakeMoriApi(std::shared_ptr<World> world, std::string key)
      : world_(std::move(world)), key_(std::move(key)) {}
  ~FakeMoriApi() override {
    std::unique_lock lock(world_->mu);
    world_->cv.wait(lock, [&] { return world_->writers == 0; });
    world_->api_alive = false;
  }

  const std::string& engine_key() const override { return key_; }
  Result<std::vector<std::uint8_t>> EngineDesc() override { return EngineBlob(key_); }

  Result<mb::MoriMemory> RegisterMemory(const MemoryRange& range) override {
    std::lock_guard lock(world_->mu);
    world_->register_calls.push_back(range);
    mb::MoriMemory m{key_, next_id_++, range.address, range.size, range.kind, range.device, {}};
    m.desc = MemBlob(m);
    world_->registered[m.id] = m;
    return m;
  }
  Status DeregisterMemory(std::uint32_t id) override {
    std::lock_guard lock(world_->mu);
    world_->deregister_calls.push_back(id);
    if (!world_->registered.erase(id)) return NotFoundError("fake: no memory");
    return Status::OK();
  }
  Result<std::string> EngineKeyOf(std::span<const std::uint8_t> desc) override {
    const std::string text = Text(desc);
    if (!text.starts_with("fake-engine|")) return InvalidArgumentError("fake: bad engine desc");
    return text.substr(12);
  }
  Status RegisterRemoteEngine(std::span<const std::uint8_t> desc) override {
    MORIIO_ASSIGN_OR_RETURN(std::string key, EngineKeyOf(desc));
    std::lock_guard lock(world_->mu);
    world_->remote_engines.push_back(key);
    return Status::OK();
  }
  Status DeregisterRemoteEngine(const std::string& key) override {
    std::lock_guard lock(world_->mu);
    world_->deregistered_engines.push_back(key);
    return Status::OK();
  }
  Result<mb::MoriMemory> ParseMemoryDesc(std::span<const std::uint8_t> desc) override {
    const auto f = Split(Text(desc), '|');
    if (f.size() != 7 || f[0] != "fake-mem") return InvalidArgumentError("fake: bad memory desc");
    mb::MoriMemory m{f[1],
                     static_cast<std::uint32_t>(std::stoul(f[2])),
                     std::stoull(f[3]),
                     std::stoull(f[4]),
                     static_cast<MemoryKind>(std::stoi(f[5])),
                     std::stoi(f[6]),
                     {desc.begin(), desc.end()}};
    return m;
  }
  Result<std::uint64_t> CreateSession(std::uint32_t local_id,
                                      const mb::MoriMemory& remote) override {
    std::lock_guard lock(world_->mu);
    if (world_->fail_create_session) return TransportError("fake: peer unreachable");
    if (!world_->registered.count(local_id)) return NotFoundError("fake: no local memory");
    const std::uint64_t id = world_->sessions.size() + 100;
    world_->sessions.push_back({id, local_id, remote, false});
    return id;
  }
  void DestroySession(std::uint64_t session) override {
    std::lock_guard lock(world_->mu);
    for (auto& s : world_->sessions) {
      if (s.id == session) s.destroyed = true;
    }
    world_->cv.notify_all();
  }
  std::unique_ptr<mb::MoriTransferStatus> NewStatus() override {
    return std::make_unique<FakeStatus>(world_);
  }
  Status PostBatch(std::uint64_t session, TransferOp op, const std::vector<std::size_t>& lo,
                   const std::vector<std::size_t>& ro, const std::vector<std::size_t>& sz,
                   mb::MoriTransferStatus* status) override {
    auto* fake = dynamic_cast<FakeStatus*>(status);
    if (!fake) return InternalError("fake: foreign status");
    bool complete = false;
    {
      std::lock_guard lock(world_->mu);
      world_->posts.push_back({session, op, lo, ro, sz, fake});
      if (world_->reject_post) {
        world_->cv.notify_all();
        return TransportError("fake: send queue full");
      }
      const World::Session* s = nullptr;
      for (const auto& candidate : world_->sessions) {
        if (candidate.id == session && !candidate.destroyed) s = &candidate;
      }
      if (!s) return NotFoundError("fake: no session");
      fake->Set(kInProgress, "");
      if (world_->auto_complete) {
        // Move the bytes the way MoRI would: offsets relative to each registration's start.
        auto* local = reinterpret_cast<std::uint8_t*>(world_->registered.at(s->local_id).data);
        auto* remote = reinterpret_cast<std::uint8_t*>(s->remote.data);
        for (std::size_t i = 0; i < sz.size(); ++i) {
          if (op == TransferOp::kRead) {
            std::memcpy(local + lo[i], remote + ro[i], sz[i]);
          } else {
            std::memcpy(remote + ro[i], local + lo[i], sz[i]);
          }
        }
        complete = true;
      }
      world_->cv.notify_all();
    }
    if (complete) fake->Set(kSuccess, "");
    return Status::OK();
  }
  std::optional<mb::MoriPeerFailure> PopPeerFailure() override {
    std::lock_guard lock(world_->mu);
    if (world_->failures.empty()) return std::nullopt;
    auto f = world_->failures.front();
    world_->failures.pop_front();
    return f;
  }

  Result<bool> EventCompleted(std::uint64_t event) override {
    Result<bool> answer = false;
    {
      std::lock_guard lock(world_->mu);
      ++world_->event_queries;
      answer = world_->broken_events.count(event)
                   ? Result<bool>(TransportError("fake HIP cannot query event " +
                                                 std::to_string(event)))
                   : Result<bool>(world_->pending_events.count(event) == 0);
    }
    world_->cv.notify_all();  // WaitUntil on event_queries
    return answer;
  }

 private:
  std::shared_ptr<World> world_;
  std::string key_;
  std::uint32_t next_id_ = 7;  // not 0/1 so an id mix-up with handles shows
};

}  // namespace moriio_native::fake_mori
