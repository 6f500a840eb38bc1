#include <unistd.h>

#include <algorithm>
#include <charconv>
#include <condition_variable>
#include <cstring>
#include <deque>
#include <map>
#include <mutex>
#include <optional>
#include <thread>

#include "backends/loopback/loopback_backend.hpp"

namespace moriio_native::detail {
namespace {

// Loopback peers find each other through this process-wide directory: an address names a
// backend instance, and a remote key names one of its registered regions. Imports are checked
// against it, so a forged key or range fails like it would on a real transport. A copy pins the
// two regions it touches; removing a region waits until nothing pins it, as a real transport
// finishes its DMA before deregistration returns (the owner may free the memory right after).
struct RegionRecord {
  MemoryRange range;
  int pins = 0;
  bool removing = false;  // no new pins: a removal waits for the current ones
};

class Directory {
 public:
  static Directory& Get() {
    static Directory* d = new Directory();  // never destroyed: backends may outlive statics
    return *d;
  }
  std::uint64_t AddInstance() {
    std::lock_guard lock(mu_);
    return next_instance_++;
  }
  void RemoveInstance(std::uint64_t instance) {
    std::unique_lock lock(mu_);
    live_.erase(instance);
    for (auto& [key, record] : regions_) {
      if (key.first == instance) record.removing = true;
    }
    unpinned_.wait(lock, [&] {
      return std::ranges::none_of(regions_, [&](const auto& kv) {
        return kv.first.first == instance && kv.second.pins > 0;
      });
    });
    std::erase_if(regions_, [&](const auto& kv) { return kv.first.first == instance; });
  }
  void MarkLive(std::uint64_t instance) {
    std::lock_guard lock(mu_);
    live_[instance] = true;
  }
  bool IsLive(std::uint64_t instance) {
    std::lock_guard lock(mu_);
    return live_.count(instance) > 0;
  }
  void AddRegion(std::uint64_t instance, std::uint64_t handle, const MemoryRange& range) {
    std::lock_guard lock(mu_);
    regions_[{instance, handle}] = RegionRecord{range};
  }
  void RemoveRegion(std::uint64_t instance, std::uint64_t handle) {
    std::unique_lock lock(mu_);
    if (auto it = regions_.find({instance, handle}); it != regions_.end()) it->second.removing = true;
    unpinned_.wait(lock, [&] {
      auto it = regions_.find({instance, handle});
      return it == regions_.end() || it->second.pins == 0;
    });
    regions_.erase({instance, handle});
  }
  // The registered range, or nullopt when the region is gone.
  std::optional<MemoryRange> FindRegion(std::uint64_t instance, std::uint64_t handle) {
    std::lock_guard lock(mu_);
    auto it = regions_.find({instance, handle});
    if (it == regions_.end()) return std::nullopt;
    return it->second.range;
  }
  // Like FindRegion (also nullopt while a removal waits), and the region stays registered
  // until Unpin.
  std::optional<MemoryRange> Pin(std::uint64_t instance, std::uint64_t handle) {
    std::lock_guard lock(mu_);
    auto it = regions_.find({instance, handle});
    if (it == regions_.end() || it->second.removing) return std::nullopt;
    ++it->second.pins;
    return it->second.range;
  }
  void Unpin(std::uint64_t instance, std::uint64_t handle) {
    {
      std::lock_guard lock(mu_);
      --regions_.at({instance, handle}).pins;
    }
    unpinned_.notify_all();
  }

 private:
  std::mutex mu_;
  std::condition_variable unpinned_;
  std::uint64_t next_instance_ = 1;
  std::map<std::uint64_t, bool> live_;
  std::map<std::pair<std::uint64_t, std::uint64_t>, RegionRecord> regions_;
};

// A region pinned for one copy; empty when the region is no longer registered.
class PinnedRegion {
 public:
  PinnedRegion(std::uint64_t instance, std::uint64_t handle)
      : instance_(instance), handle_(handle), range_(Directory::Get().Pin(instance, handle)) {}
  ~PinnedRegion() {
    if (range_) Directory::Get().Unpin(instance_, handle_);
  }
  PinnedRegion(const PinnedRegion&) = delete;
  PinnedRegion& operator=(const PinnedRegion&) = delete;

  const std::optional<MemoryRange>& range() const { return range_; }

 private:
  std::uint64_t instance_;
  std::uint64_t handle_;
  std::optional<MemoryRange> range_;
};

// Wire forms: address = "loopback:<pid>:<instance>", key = "<instance>:<handle>".
std::vector<std::uint8_t> Bytes(const std::string& s) { return {s.begin(), s.end()}; }

bool ParseU64(std::string_view s, std::uint64_t* out) {
  auto [p, ec] = std::from_chars(s.data(), s.data() + s.size(), *out);
  return ec == std::errc() && p == s.data() + s.size();
}

bool ParsePair(std::string_view s, std::uint64_t* a, std::uint64_t* b) {
  const auto colon = s.find(':');
  return colon != std::string_view::npos && ParseU64(s.substr(0, colon), a) &&
         ParseU64(s.substr(colon + 1), b);
}

// Option `key` as "0" or "1", or `absent` when not given.
Result<bool> ParseFlag(const BackendOptions& options, std::string_view key, bool absent) {
  auto it = options.find(key);
  if (it == options.end()) return absent;
  if (it->second != "0" && it->second != "1") {
    return InvalidArgumentError(std::string(key) + " must be '0' or '1', got '" + it->second + "'");
  }
  return it->second == "1";
}

class LoopbackBackend final : public Backend {
 public:
  LoopbackBackend(std::shared_ptr<CompletionSink> sink, int delay_ms, bool cells, bool stamps)
      : sink_(std::move(sink)),
        delay_ms_(delay_ms),
        cells_(cells),
        stamps_(stamps),
        instance_(Directory::Get().AddInstance()) {
    Directory::Get().MarkLive(instance_);
    worker_ = std::thread([this] { Run(); });
  }

  ~LoopbackBackend() override {
    {
      std::lock_guard lock(mu_);
      stopping_ = true;
    }
    cv_.notify_all();
    worker_.join();
    Directory::Get().RemoveInstance(instance_);
  }

  std::string_view name() const override { return "loopback"; }
  BackendCapabilities capabilities() const override {
    return {.host_memory = true, .unaligned_registration = true};
  }

  Result<std::vector<std::uint8_t>> LocalAddress() override {
    return Bytes("loopback:" + std::to_string(::getpid()) + ":" + std::to_string(instance_));
  }

  Result<RegisteredRegion> RegisterMemory(const MemoryRange& range) override {
    if (range.kind != MemoryKind::kHost) {
      return InvalidArgumentError("the loopback backend registers host memory only");
    }
    if (range.address == 0 || range.size == 0) {
      return InvalidArgumentError("cannot register an empty or null memory range");
    }
    std::lock_guard lock(mu_);
    const std::uint64_t handle = next_handle_++;
    regions_[handle] = range;
    Directory::Get().AddRegion(instance_, handle, range);
    return RegisteredRegion{handle, Bytes(std::to_string(instance_) + ":" + std::to_string(handle))};
  }

  Status DeregisterMemory(std::uint64_t handle) override {
    {
      std::lock_guard lock(mu_);
      auto it = regions_.find(handle);
      if (it == regions_.end()) {
        return NotFoundError("no registered region " + std::to_string(handle));
      }
      if (auto busy = in_flight_.find(handle); busy != in_flight_.end()) {
        return FailedPreconditionError("region " + std::to_string(handle) + " has " +
                                       std::to_string(busy->second) + " batches in flight");
      }
      regions_.erase(it);
    }
    // Outside mu_: the wait for copies in flight must not stall this backend's other calls.
    Directory::Get().RemoveRegion(instance_, handle);
    return Status::OK();
  }

  Result<std::uint64_t> ConnectPeer(std::span<const std::uint8_t> address) override {
    const std::string_view text(reinterpret_cast<const char*>(address.data()), address.size());
    std::uint64_t pid = 0;
    std::uint64_t instance = 0;
    if (!text.starts_with("loopback:") || !ParsePair(text.substr(9), &pid, &instance)) {
      return InvalidArgumentError("malformed loopback peer address");
    }
    if (pid != static_cast<std::uint64_t>(::getpid())) {
      return TransportError("loopback peers must live in the same process (peer pid " +
                            std::to_string(pid) + ")");
    }
    if (!Directory::Get().IsLive(instance)) {
      return TransportError("loopback peer instance " + std::to_string(instance) + " is gone");
    }
    std::lock_guard lock(mu_);
    const std::uint64_t peer = next_handle_++;
    peers_[peer] = instance;
    return peer;
  }

  // The peer's backend instance was destroyed: nothing of it is reachable any more.
  bool PeerFailed(std::uint64_t peer) override {
    std::uint64_t instance = 0;
    {
      std::lock_guard lock(mu_);
      auto it = peers_.find(peer);
      if (it == peers_.end()) return false;
      instance = it->second;
    }
    return !Directory::Get().IsLive(instance);
  }

  Result<std::uint64_t> ImportRemoteRegion(std::uint64_t peer, const MemoryRange& range,
                                           std::span<const std::uint8_t> key) override {
    const std::string_view text(reinterpret_cast<const char*>(key.data()), key.size());
    std::uint64_t instance = 0;
    std::uint64_t handle = 0;
    if (!ParsePair(text, &instance, &handle)) return InvalidArgumentError("malformed loopback key");
    std::lock_guard lock(mu_);
    auto it = peers_.find(peer);
    if (it == peers_.end()) return NotFoundError("unknown loopback peer " + std::to_string(peer));
    if (it->second != instance) return InvalidArgumentError("loopback key belongs to another peer");
    const auto registered = Directory::Get().FindRegion(instance, handle);
    if (!registered || registered->address != range.address || registered->size != range.size) {
      return InvalidArgumentError("loopback key does not match a region the peer registered");
    }
    const std::uint64_t remote = next_handle_++;
    remotes_[remote] = RemoteRegion{peer, instance, handle, range};
    return remote;
  }

  Status DisconnectPeer(std::uint64_t peer) override {
    std::lock_guard lock(mu_);
    if (!peers_.erase(peer)) return NotFoundError("unknown loopback peer " + std::to_string(peer));
    std::erase_if(remotes_, [&](const auto& kv) { return kv.second.peer == peer; });
    return Status::OK();
  }

  Status Submit(std::shared_ptr<const Batch> batch) override {
    if (!batch) return InvalidArgumentError("Submit: null batch");
    std::lock_guard lock(mu_);
    if (stopping_) return AbortedError("loopback backend is shutting down");
    auto local = regions_.find(batch->local_region);
    if (local == regions_.end()) {
      return NotFoundError("batch names unknown local region " + std::to_string(batch->local_region));
    }
    auto remote = remotes_.find(batch->remote_region);
    if (remote == remotes_.end()) {
      return NotFoundError("batch names unknown remote region " + std::to_string(batch->remote_region));
    }
    if (remote->second.peer != batch->peer) {
      return InvalidArgumentError("batch " + std::to_string(batch->token) + ": remote region " +
                                  std::to_string(batch->remote_region) +
                                  " does not belong to peer " + std::to_string(batch->peer));
    }
    if (batch->cells && !cells_) {
      return FailedPreconditionError("batch " + std::to_string(batch->token) +
                                     " is a cell batch; loopback_cells is off");
    }
    if (batch->stamps && !stamps_) {
      return FailedPreconditionError("batch " + std::to_string(batch->token) +
                                     " is a stamped batch; loopback_stamps is off");
    }
    const std::uint64_t local_size = local->second.size;
    const std::uint64_t remote_size = remote->second.range.size;
    MORIIO_RETURN_IF_ERROR(batch->cells    ? CheckBatchCells(*batch, local_size, remote_size)
                           : batch->stamps ? CheckBatchStamps(*batch, local_size, remote_size)
                                           : CheckBatchRuns(*batch, local_size, remote_size));
    ++in_flight_[batch->local_region];
    queue_.push_back(std::move(batch));
    cv_.notify_one();
    return Status::OK();
  }

  // Every region here is host memory, which CopyBlockCells reaches.
  bool AcceptsCells(std::uint64_t local_region, std::uint64_t remote_region,
                    const CellGeometry&) const override {
    std::lock_guard lock(mu_);
    return cells_ && regions_.count(local_region) && remotes_.count(remote_region);
  }

  // The same for stamped batches (CopyStampedRuns), when loopback_stamps is on.
  bool AcceptsStamps(std::uint64_t local_region, std::uint64_t remote_region) const override {
    std::lock_guard lock(mu_);
    return stamps_ && regions_.count(local_region) && remotes_.count(remote_region);
  }

 private:
  struct RemoteRegion {
    std::uint64_t peer;
    std::uint64_t instance;
    std::uint64_t handle;
    MemoryRange range;
  };

  // Copies one batch with both regions pinned, so neither side can deregister (and free) its
  // memory during the copy; a region already gone fails the batch instead of being written.
  Status Execute(const Batch& b) {
    RemoteRegion remote;
    {
      std::lock_guard lock(mu_);
      auto r = remotes_.find(b.remote_region);
      if (r == remotes_.end()) {
        return AbortedError("loopback peer " + std::to_string(b.peer) +
                            " was disconnected before batch " + std::to_string(b.token) + " ran");
      }
      remote = r->second;
    }
    const PinnedRegion local(instance_, b.local_region);
    if (!local.range()) return TransportError("local region deregistered during transfer");
    const PinnedRegion peer(remote.instance, remote.handle);
    if (!peer.range()) return TransportError("the peer deregistered the remote region");
    // Runs were checked against these ranges at Submit (a region's range never changes).
    const MemoryRange& l_range = *local.range();
    const MemoryRange& r_range = *peer.range();
    auto* const local_base = reinterpret_cast<std::byte*>(l_range.address);
    auto* const remote_base = reinterpret_cast<std::byte*>(r_range.address);
    const CellCopyDirection direction = b.op == TransferOp::kRead
                                            ? CellCopyDirection::kRemoteToLocal
                                            : CellCopyDirection::kLocalToRemote;
    if (b.cells) {
      CopyBlockCells(b.cells->geometry, b.cells->blocks, local_base, remote_base, direction);
      return Status::OK();
    }
    if (b.stamps) {
      CopyStampedRuns(*b.stamps, local_base, remote_base, direction);
      return Status::OK();
    }
    for (std::size_t i = 0; i < b.sizes.size(); ++i) {
      auto* l = reinterpret_cast<std::uint8_t*>(l_range.address + b.local_offsets[i]);
      auto* r = reinterpret_cast<std::uint8_t*>(r_range.address + b.remote_offsets[i]);
      if (b.op == TransferOp::kRead) {
        std::memcpy(l, r, static_cast<std::size_t>(b.sizes[i]));
      } else {
        std::memcpy(r, l, static_cast<std::size_t>(b.sizes[i]));
      }
    }
    return Status::OK();
  }

  void Run() {
    std::unique_lock lock(mu_);
    while (true) {
      cv_.wait(lock, [&] { return stopping_ || !queue_.empty(); });
      if (queue_.empty()) return;  // stopping and drained
      std::shared_ptr<const Batch> batch = std::move(queue_.front());
      queue_.pop_front();
      const bool abort = stopping_;
      lock.unlock();
      Status status = abort ? AbortedError("loopback backend shut down before the batch ran")
                            : Status::OK();
      if (!abort) {
        if (delay_ms_ > 0) std::this_thread::sleep_for(std::chrono::milliseconds(delay_ms_));
        status = Execute(*batch);
      }
      lock.lock();
      // Done with the memory before the completion, so its receiver may deregister at once.
      if (auto it = in_flight_.find(batch->local_region); --it->second == 0) in_flight_.erase(it);
      lock.unlock();
      sink_->OnBatchComplete(batch->token, std::move(status));
      lock.lock();
    }
  }

  const std::shared_ptr<CompletionSink> sink_;
  const int delay_ms_;
  const bool cells_;
  const bool stamps_;
  const std::uint64_t instance_;
  mutable std::mutex mu_;
  std::condition_variable cv_;
  bool stopping_ = false;
  std::uint64_t next_handle_ = 1;
  std::map<std::uint64_t, MemoryRange> regions_;
  std::map<std::uint64_t, int> in_flight_;  // local region -> accepted batches not yet completed
  std::map<std::uint64_t, std::uint64_t> peers_;  // peer handle -> peer instance
  std::map<std::uint64_t, RemoteRegion> remotes_;
  std::deque<std::shared_ptr<const Batch>> queue_;
  std::thread worker_;
};

}  // namespace

Result<std::unique_ptr<Backend>> CreateLoopbackBackend(const BackendOptions& options,
                                                       std::shared_ptr<CompletionSink> sink) {
  int delay_ms = 0;
  if (auto it = options.find("loopback_delay_ms"); it != options.end()) {
    auto [p, ec] = std::from_chars(it->second.data(), it->second.data() + it->second.size(), delay_ms);
    if (ec != std::errc() || p != it->second.data() + it->second.size() || delay_ms < 0) {
      return InvalidArgumentError("loopback_delay_ms must be a non-negative integer, got '" +
                                  it->second + "'");
    }
  }
  MORIIO_ASSIGN_OR_RETURN(const bool cells, ParseFlag(options, "loopback_cells", true));
  MORIIO_ASSIGN_OR_RETURN(const bool stamps, ParseFlag(options, "loopback_stamps", false));
  if (!sink) return InvalidArgumentError("a completion sink is required");
  return std::unique_ptr<Backend>(
      std::make_unique<LoopbackBackend>(std::move(sink), delay_ms, cells, stamps));
}

}  // namespace moriio_native::detail
