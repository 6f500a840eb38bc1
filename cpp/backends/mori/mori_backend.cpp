#include "backends/mori/mori_backend.hpp"

#include <algorithm>
#include <charconv>
#include <condition_variable>
#include <deque>
#include <limits>
#include <list>
#include <map>
#include <mutex>
#include <optional>
#include <set>
#include <string>
#include <thread>
#include <utility>

#include "event_poll.hpp"

namespace moriio_native::detail::mori_backend {

std::string MoriCodeName(std::uint32_t code) {
  switch (static_cast<MoriCode>(code)) {
    case MoriCode::kSuccess: return "SUCCESS";
    case MoriCode::kInit: return "INIT";
    case MoriCode::kInProgress: return "IN_PROGRESS";
    case MoriCode::kErrBegin: return "ERR_BEGIN";
    case MoriCode::kInvalidArgs: return "ERR_INVALID_ARGS";
    case MoriCode::kNotFound: return "ERR_NOT_FOUND";
    case MoriCode::kRdmaOp: return "ERR_RDMA_OP";
    case MoriCode::kBadState: return "ERR_BAD_STATE";
    case MoriCode::kGpuOp: return "ERR_GPU_OP";
  }
  return "CODE_" + std::to_string(code);
}

Status MoriCodeToStatus(std::uint32_t code, const std::string& mori_message,
                        const std::string& context) {
  if (code == static_cast<std::uint32_t>(MoriCode::kSuccess)) return Status::OK();
  std::string message = "MoRI-IO " + MoriCodeName(code);
  if (!mori_message.empty()) message += ": " + mori_message;
  if (!context.empty()) message += " (" + context + ")";
  return TransportError(std::move(message));
}

// ---- options ----------------------------------------------------------------------------------
namespace {

template <typename T>
Status ParseInteger(const BackendOptions& options, std::string_view key, T min, T max, T* out) {
  auto it = options.find(key);
  if (it == options.end()) return Status::OK();
  const std::string& text = it->second;
  T value{};
  auto [p, ec] = std::from_chars(text.data(), text.data() + text.size(), value);
  if (ec != std::errc() || p != text.data() + text.size() || value < min || value > max) {
    return InvalidArgumentError("MoRI backend option " + std::string(key) +
                                " must be an integer in [" + std::to_string(min) + ", " +
                                std::to_string(max) + "], got '" + text + "'");
  }
  *out = value;
  return Status::OK();
}

Status ParseMilliseconds(const BackendOptions& options, std::string_view key,
                         std::chrono::milliseconds* out) {
  std::int64_t ms = out->count();
  MORIIO_RETURN_IF_ERROR(ParseInteger<std::int64_t>(options, key, 0, 86'400'000, &ms));
  *out = std::chrono::milliseconds(ms);
  return Status::OK();
}

Status ParseChoice(const BackendOptions& options, std::string_view key, std::string_view a,
                   std::string_view b, bool* is_b) {
  auto it = options.find(key);
  if (it == options.end()) return Status::OK();
  if (it->second == a) {
    *is_b = false;
  } else if (it->second == b) {
    *is_b = true;
  } else {
    return InvalidArgumentError("MoRI backend option " + std::string(key) + " must be '" +
                                std::string(a) + "' or '" + std::string(b) + "', got '" +
                                it->second + "'");
  }
  return Status::OK();
}


}  // namespace

Result<MoriOptions> ParseMoriOptions(const BackendOptions& options) {
  // A misspelt mori_* key would otherwise be ignored silently and the user would tune nothing.
  for (const auto& [key, value] : options) {
    if (!key.starts_with("mori_")) continue;
    const auto* const end = std::end(kMoriOptionKeys) - 1;  // before the nullptr
    if (std::find(std::begin(kMoriOptionKeys), end, key) == end) {
      std::string known;
      for (const auto* k = std::begin(kMoriOptionKeys); k != end; ++k) {
        known += (known.empty() ? "" : ", ") + std::string(*k);
      }
      return InvalidArgumentError("unknown MoRI backend option '" + key + "' (known: " + known +
                                  ")");
    }
  }
  MoriOptions o;
  bool xgmi = false;
  MORIIO_RETURN_IF_ERROR(ParseChoice(options, "mori_backend", "rdma", "xgmi", &xgmi));
  o.transport = xgmi ? MoriTransport::kXgmi : MoriTransport::kRdma;
  MORIIO_RETURN_IF_ERROR(ParseChoice(options, "poll_mode", "polling", "event", &o.event_poll));
  int chunking = o.enable_chunking ? 1 : 0;
  MORIIO_RETURN_IF_ERROR(ParseInteger(options, "mori_enable_chunking", 0, 1, &chunking));
  o.enable_chunking = chunking == 1;
  MORIIO_RETURN_IF_ERROR(ParseInteger(options, "qp_per_transfer", 1, 1024, &o.qp_per_transfer));
  MORIIO_RETURN_IF_ERROR(ParseInteger(options, "num_workers", 1, 256, &o.num_workers));
  MORIIO_RETURN_IF_ERROR(ParseInteger(options, "post_batch_size", -1, 65536, &o.post_batch_size));
  if (o.post_batch_size == 0) {
    return InvalidArgumentError(
        "MoRI backend option post_batch_size must be -1 (MoRI picks) or "
        "at least 1, got '0'");
  }
  MORIIO_RETURN_IF_ERROR(ParseInteger<std::uint64_t>(options, "mori_chunk_bytes", 4096,
                                                     std::uint64_t{1} << 31, &o.chunk_bytes));
  MORIIO_RETURN_IF_ERROR(ParseInteger(options, "mori_xgmi_streams", 1, 1024, &o.xgmi_streams));
  MORIIO_RETURN_IF_ERROR(ParseInteger(options, "mori_xgmi_events", 1, 1024, &o.xgmi_events));
  MORIIO_RETURN_IF_ERROR(ParseInteger<std::uint16_t>(options, "mori_port", 0, 65535, &o.port));
  // MoRI rejects one entry of 4 GiB or more ("exceeds UINT32_MAX"); stay below it.
  MORIIO_RETURN_IF_ERROR(ParseInteger<std::uint64_t>(
      options, "mori_max_run_bytes", 4096, (std::uint64_t{1} << 32) - 4096, &o.max_run_bytes));
  // Accepted (and checked) for old configurations, but ignored: a posted batch completes only
  // when MoRI reports it terminal. A success proves none of its writes can land any more; a
  // failure does not (MoRI reports the first error while the batch's other work requests may
  // still run), so a failed WRITE completes unconfirmed. A batch MoRI never finishes leaves its
  // transfer to the engine, which quarantines it.
  std::chrono::milliseconds ignored_transfer_timeout{0};
  MORIIO_RETURN_IF_ERROR(
      ParseMilliseconds(options, "mori_transfer_timeout_ms", &ignored_transfer_timeout));
  MORIIO_RETURN_IF_ERROR(ParseMilliseconds(options, "mori_drain_timeout_ms", &o.drain_timeout));
  if (auto it = options.find("mori_host"); it != options.end()) o.host = it->second;
  if (auto it = options.find("mori_xgmi_kernel"); it != options.end()) o.xgmi_kernel = it->second;
  if (auto it = options.find("mori_engine_key"); it != options.end()) {
    if (it->second.empty()) {
      return InvalidArgumentError("MoRI backend option mori_engine_key must not be empty");
    }
    o.engine_key_prefix = it->second;
  }
  return o;
}

// ---- the backend ------------------------------------------------------------------------------
namespace {

using Clock = std::chrono::steady_clock;

// How often the poster asks again about the events its queued batches wait for while none is
// ready (HIP signals no fd): short against a layer's compute, long against a query (~1 us).
constexpr auto kEventPollInterval = std::chrono::microseconds(50);

std::string Hex(std::uint64_t v) {
  char buf[19] = "0x";
  auto [p, ec] = std::to_chars(buf + 2, buf + sizeof(buf), v, 16);
  return std::string(buf, p);
}

std::string_view OpName(TransferOp op) { return op == TransferOp::kRead ? "read" : "write"; }

std::string_view KindName(MemoryKind kind) {
  switch (kind) {
    case MemoryKind::kHost: return "host";
    case MemoryKind::kCuda: return "CUDA";
    case MemoryKind::kRocm: return "ROCm";
  }
  return "unknown";
}

// [start, start + size) lies inside [outer, outer + outer_size), without overflow.
bool Contains(std::uint64_t outer, std::uint64_t outer_size, std::uint64_t start,
              std::uint64_t size) {
  return start >= outer && start - outer <= outer_size && size <= outer_size - (start - outer);
}

// One MoRI registration; several of our regions may lie inside it (MoRI keys its NIC
// registrations by start address, so registering a second region at the same start would leak
// one MR: such regions share the first registration at an offset instead).
struct Registration {
  MoriMemory mem;
  int regions = 0;
};

struct LocalRegion {
  MemoryRange range;
  std::uint32_t mori_id = 0;
  std::uint64_t base = 0;  // range.address - registration start: added to every local offset
  std::int64_t uses = 0;   // batches submitted and not yet completed
};

struct Peer {
  std::string engine_key;
  std::string failure;  // set once MoRI reported the link failed; Submit refuses then
};

struct RemoteRegion {
  std::uint64_t peer = 0;
  MoriMemory mem;
  std::uint64_t base = 0;  // range.address - mem.data: added to every remote offset
  std::uint64_t size = 0;
};

using SessionKey = std::pair<std::uint32_t, std::uint64_t>;  // (local MoRI id, remote region)

struct SessionEntry {
  std::uint64_t id = 0;
  std::int64_t in_flight = 0;  // posted batches MoRI has not finished
};

// One Batch from Submit to its completion.
struct Work {
  std::uint64_t token = 0;
  TransferOp op = TransferOp::kRead;
  std::uint64_t peer = 0;
  std::uint64_t local_region = 0;
  std::uint64_t remote_region = 0;
  std::uint32_t local_mori_id = 0;
  std::size_t runs = 0;
  // A HIP event (Batch::device_wait_event) the batch is posted only after; 0 once PostLoop saw
  // it completed, or when there is none.
  std::uint64_t wait_event = 0;
  std::vector<std::size_t> local_offsets;
  std::vector<std::size_t> remote_offsets;
  std::vector<std::size_t> sizes;
  // Set once posted.
  std::uint64_t session = 0;
  std::unique_ptr<MoriTransferStatus> status;
  bool peer_disconnected = false;  // report Aborted once MoRI is done with it
  std::string peer_key;
};

using Delivery = std::pair<std::uint64_t, Status>;

class MoriBackend final : public Backend {
 public:
  MoriBackend(std::unique_ptr<MoriApi> api, const MoriOptions& options,
              std::shared_ptr<CompletionSink> sink)
      : api_(std::move(api)), options_(options), sink_(std::move(sink)) {
    poster_ = std::thread([this] { PostLoop(); });
    reaper_ = std::thread([this] { ReapLoop(); });
  }

  ~MoriBackend() override {
    {
      std::lock_guard lock(mu_);
      stopping_ = true;
      drain_deadline_ = Clock::now() + options_.drain_timeout;
    }
    post_cv_.notify_all();
    reap_cv_.notify_all();
    poster_.join();  // finishes a post in progress; never starts another
    reaper_.join();  // returns once nothing is posted or the drain deadline passed
    std::vector<Delivery> left;
    std::set<std::uint64_t> unconfirmed;  // WRITEs MoRI never confirmed
    {
      std::lock_guard lock(mu_);
      for (auto& w : queue_) {
        ReleaseLocked(*w);
        left.emplace_back(w->token, AbortedError("the MoRI backend was destroyed before batch " +
                                                 std::to_string(w->token) + " was posted"));
      }
      queue_.clear();
      for (auto& w : in_flight_) {
        ReleaseLocked(*w);
        ReleaseSessionLocked(w->session);
        if (w->op == TransferOp::kWrite) unconfirmed.insert(w->token);
        left.emplace_back(
            w->token,
            AbortedError("the MoRI backend was destroyed while " + Describe(*w) +
                         " was in flight (not finished within the " +
                         std::to_string(options_.drain_timeout.count()) + " ms drain timeout)"));
        graveyard_.push_back(std::move(w->status));
      }
      in_flight_.clear();
      for (auto& d : deliver_) left.push_back(std::move(d));
      deliver_.clear();
    }
    // MoRI must be stopped before the unfinished batches are reported: a consumer may reuse
    // their memory at once, and only a stopped engine guarantees no NIC/GPU still writes there.
    // Statuses are freed only after that, since MoRI holds raw pointers to them until then.
    api_.reset();
    Report(left, unconfirmed);
    graveyard_.clear();
    idle_statuses_.clear();
  }

  std::string_view name() const override { return "mori"; }

  BackendCapabilities capabilities() const override {
    const bool rdma = options_.transport == MoriTransport::kRdma;
    // MoRI's RDMA path registers exactly what it is given with the NIC, so regions must be
    // page aligned; XGMI maps IPC handles with an offset and copes with any start.
    return {.host_memory = rdma,
            .cuda_memory = false,
            .rocm_memory = true,
            .unaligned_registration = !rdma,
            .allocation = false,
            .device_event_wait = true};
  }

  // A batch from GPU memory may wait for its producer's HIP event: MoRI posts work on the host
  // (RDMA work requests, XGMI copies), so the poster thread holds it back until the event
  // completed, and the caller never waits. Host memory has no producer that records one.
  bool AcceptsDeviceWaits(std::uint64_t local_region, std::uint64_t remote_region) const override {
    std::lock_guard lock(mu_);
    auto l = locals_.find(local_region);
    return l != locals_.end() && remotes_.count(remote_region) != 0 &&
           l->second.range.kind == MemoryKind::kRocm;
  }

  Result<std::vector<std::uint8_t>> LocalAddress() override {
    std::lock_guard api_lock(api_mu_);
    if (!api_) return GoneError();
    return api_->EngineDesc();
  }

  Result<RegisteredRegion> RegisterMemory(const MemoryRange& range) override {
    if (range.kind == MemoryKind::kCuda) {
      return InvalidArgumentError("the MoRI backend registers ROCm device and host memory, " +
                                  std::string("not CUDA memory (region ") + Hex(range.address) +
                                  ")");
    }
    if (range.kind == MemoryKind::kHost && options_.transport == MoriTransport::kXgmi) {
      return InvalidArgumentError("MoRI's XGMI transport moves GPU memory only; register host " +
                                  std::string("region ") + Hex(range.address) +
                                  " with mori_backend=rdma");
    }
    if (range.address == 0 || range.size == 0) {
      return InvalidArgumentError("cannot register an empty or null memory range with MoRI");
    }
    if (range.address + range.size < range.address) {
      return InvalidArgumentError("memory range " + Hex(range.address) + " + " +
                                  std::to_string(range.size) + " overflows the address space");
    }
    if (range.kind == MemoryKind::kRocm && range.device < 0) {
      return InvalidArgumentError("ROCm region " + Hex(range.address) +
                                  " needs a device ordinal, got " + std::to_string(range.device));
    }
    std::lock_guard api_lock(api_mu_);
    if (!api_) return GoneError();
    {
      std::lock_guard lock(mu_);
      for (auto& [id, reg] : registrations_) {
        const MoriMemory& m = reg.mem;
        if (m.kind != range.kind || m.device != range.device) continue;
        if (Contains(m.data, m.size, range.address, range.size)) {
          ++reg.regions;
          const std::uint64_t handle = next_handle_++;
          locals_[handle] = LocalRegion{range, id, range.address - m.data, 0};
          return RegisteredRegion{handle, m.desc};
        }
      }
      // Whatever its kind or device: MoRI keys its NIC registrations by start address alone.
      for (const auto& [id, reg] : registrations_) {
        const MoriMemory& m = reg.mem;
        if (m.data != range.address) continue;
        return FailedPreconditionError(
            "a MoRI registration starting at " + Hex(m.data) + " (" + std::to_string(m.size) +
            " bytes of " + std::string(KindName(m.kind)) + " memory, device " +
            std::to_string(m.device) + ") exists and does not cover the " +
            std::to_string(range.size) + " bytes of " + std::string(KindName(range.kind)) +
            " memory, device " + std::to_string(range.device) +
            " asked for; MoRI keys registrations by start address, so deregister it first");
      }
    }
    MORIIO_ASSIGN_OR_RETURN(MoriMemory mem, api_->RegisterMemory(range));
    if (mem.data != range.address || mem.size != range.size) {
      return InternalError("MoRI registered " + Hex(mem.data) + "+" + std::to_string(mem.size) +
                           " when asked for " + Hex(range.address) + "+" +
                           std::to_string(range.size));
    }
    std::lock_guard lock(mu_);
    const std::uint64_t handle = next_handle_++;
    const std::uint32_t id = mem.id;
    RegisteredRegion out{handle, mem.desc};
    registrations_[id] = Registration{std::move(mem), 1};
    locals_[handle] = LocalRegion{range, id, 0, 0};
    return out;
  }

  Status DeregisterMemory(std::uint64_t handle) override {
    std::lock_guard api_lock(api_mu_);
    std::optional<std::uint32_t> release;
    std::vector<std::uint64_t> sessions;
    {
      std::lock_guard lock(mu_);
      auto it = locals_.find(handle);
      if (it == locals_.end()) {
        return NotFoundError("no MoRI-registered region " + std::to_string(handle));
      }
      if (it->second.uses > 0) {
        return FailedPreconditionError("region " + std::to_string(handle) + " has " +
                                       std::to_string(it->second.uses) +
                                       " batches in flight; deregister it after they complete");
      }
      const std::uint32_t id = it->second.mori_id;
      locals_.erase(it);
      Registration& reg = registrations_.at(id);
      if (--reg.regions == 0) {
        registrations_.erase(id);
        release = id;
        // No batch uses them: every batch on this registration counted against one of its
        // regions, and the last region had none.
        for (auto s = sessions_.begin(); s != sessions_.end();) {
          if (s->first.first == id) {
            MORIIO_CHECK(s->second.in_flight == 0, "a session of an idle registration is busy");
            sessions.push_back(s->second.id);
            s = sessions_.erase(s);
          } else {
            ++s;
          }
        }
      }
    }
    if (!api_) return Status::OK();  // from a completion ~MoriBackend reports: MoRI is gone
    for (std::uint64_t s : sessions) api_->DestroySession(s);
    if (release) return api_->DeregisterMemory(*release);
    return Status::OK();
  }

  Result<std::uint64_t> ConnectPeer(std::span<const std::uint8_t> address) override {
    if (address.empty()) return InvalidArgumentError("empty MoRI peer address");
    std::lock_guard api_lock(api_mu_);
    if (!api_) return GoneError();
    MORIIO_ASSIGN_OR_RETURN(std::string key, api_->EngineKeyOf(address));
    if (key == api_->engine_key()) {
      return InvalidArgumentError("MoRI peer address names this backend's own engine '" + key +
                                  "'");
    }
    {
      std::lock_guard lock(mu_);
      for (const auto& [handle, peer] : peers_) {
        if (peer.engine_key == key) {
          return AlreadyExistsError("MoRI engine '" + key + "' is already connected as peer " +
                                    std::to_string(handle));
        }
      }
    }
    MORIIO_RETURN_IF_ERROR(api_->RegisterRemoteEngine(address));
    std::lock_guard lock(mu_);
    const std::uint64_t handle = next_handle_++;
    peers_[handle] = Peer{std::move(key), {}};
    return handle;
  }

  Result<std::uint64_t> ImportRemoteRegion(std::uint64_t peer, const MemoryRange& range,
                                           std::span<const std::uint8_t> remote_key) override {
    std::lock_guard api_lock(api_mu_);
    if (!api_) return GoneError();
    std::string peer_key;
    {
      std::lock_guard lock(mu_);
      auto it = peers_.find(peer);
      if (it == peers_.end()) return NotFoundError("unknown MoRI peer " + std::to_string(peer));
      peer_key = it->second.engine_key;
    }
    MORIIO_ASSIGN_OR_RETURN(MoriMemory mem, api_->ParseMemoryDesc(remote_key));
    if (mem.engine_key != peer_key) {
      return InvalidArgumentError("remote key of region " + Hex(range.address) +
                                  " belongs to MoRI engine '" + mem.engine_key + "', not peer '" +
                                  peer_key + "'");
    }
    if (range.size == 0 || !Contains(mem.data, mem.size, range.address, range.size)) {
      return InvalidArgumentError("peer '" + peer_key + "' region " + Hex(range.address) + "+" +
                                  std::to_string(range.size) +
                                  " is not inside the MoRI registration " + Hex(mem.data) + "+" +
                                  std::to_string(mem.size) + " its remote key describes");
    }
    if (mem.kind != range.kind) {
      return InvalidArgumentError("peer '" + peer_key + "' region " + Hex(range.address) + " is " +
                                  std::string(KindName(range.kind)) +
                                  " memory but its MoRI registration says " +
                                  std::string(KindName(mem.kind)));
    }
    std::vector<std::uint32_t> locals;
    std::uint64_t handle = 0;
    {
      std::lock_guard lock(mu_);
      handle = next_handle_++;
      for (const auto& [id, reg] : registrations_) locals.push_back(id);
    }
    // Open the sessions now, not on the first transfer: MoRI connects QPs and exchanges MRs in
    // CreateSession, which is slow and is where an unreachable or misconfigured peer shows up —
    // better at handshake than as a failed first request.
    std::vector<std::pair<SessionKey, std::uint64_t>> opened;
    for (std::uint32_t id : locals) {
      auto s = api_->CreateSession(id, mem);
      if (!s.ok()) {
        for (auto& [key, sid] : opened) api_->DestroySession(sid);
        return s.status().WithContext("opening a MoRI-IO session to peer '" + peer_key +
                                      "' region " + Hex(range.address));
      }
      opened.emplace_back(SessionKey{id, handle}, *s);
    }
    const std::uint64_t base = range.address - mem.data;
    std::lock_guard lock(mu_);
    remotes_[handle] = RemoteRegion{peer, std::move(mem), base, range.size};
    for (auto& [key, sid] : opened) sessions_[key] = SessionEntry{sid, 0};
    return handle;
  }

  Status DisconnectPeer(std::uint64_t peer) override {
    std::lock_guard api_lock(api_mu_);
    std::string key;
    std::vector<std::uint64_t> destroy;
    {
      std::lock_guard lock(mu_);
      auto it = peers_.find(peer);
      if (it == peers_.end()) return NotFoundError("unknown MoRI peer " + std::to_string(peer));
      key = it->second.engine_key;
      peers_.erase(it);
      std::set<std::uint64_t> remotes;
      for (auto r = remotes_.begin(); r != remotes_.end();) {
        if (r->second.peer == peer) {
          remotes.insert(r->first);
          r = remotes_.erase(r);
        } else {
          ++r;
        }
      }
      // Never posted: nothing of MoRI's refers to them, so they end now.
      for (auto w = queue_.begin(); w != queue_.end();) {
        if ((*w)->peer == peer) {
          ReleaseLocked(**w);
          deliver_.emplace_back((*w)->token,
                                AbortedError("peer '" + key + "' was disconnected before batch " +
                                             std::to_string((*w)->token) + " was posted"));
          w = queue_.erase(w);
        } else {
          ++w;
        }
      }
      // Posted: MoRI may still be moving their bytes, so they end when MoRI says so (there is
      // no deadline), reported as aborted.
      for (auto& w : in_flight_) {
        if (w->peer == peer &&
            w->status->Code() != static_cast<std::uint32_t>(MoriCode::kSuccess)) {
          w->peer_disconnected = true;
        }
      }
      for (auto s = sessions_.begin(); s != sessions_.end();) {
        if (remotes.count(s->first.second)) {
          if (s->second.in_flight == 0) {
            destroy.push_back(s->second.id);
          } else {
            retired_sessions_[s->second.id] = s->second.in_flight;
          }
          s = sessions_.erase(s);
        } else {
          ++s;
        }
      }
    }
    reap_cv_.notify_all();
    if (!api_) return Status::OK();  // from a completion ~MoriBackend reports: MoRI is gone
    for (std::uint64_t s : destroy) api_->DestroySession(s);
    return api_->DeregisterRemoteEngine(key);
  }

  Status Submit(std::shared_ptr<const Batch> batch) override {
    if (!batch) return InvalidArgumentError("null batch");
    const Batch& b = *batch;
    const std::size_t n = b.sizes.size();
    LocalRegion local;
    RemoteRegion remote;
    std::string peer_key;
    {
      std::lock_guard lock(mu_);
      if (stopping_) return AbortedError("the MoRI backend is shutting down");
      MORIIO_RETURN_IF_ERROR(FindLocked(b, &local, &remote, &peer_key));
      // Region sizes never change, so the runs checked here stay valid for MapRuns below.
      MORIIO_RETURN_IF_ERROR(CheckBatchRuns(b, local.range.size, remote.size));
      if (b.device_wait_event != 0 && local.range.kind != MemoryKind::kRocm) {
        return InvalidArgumentError("batch " + std::to_string(b.token) +
                                    " carries a device event to wait for, but its local region " +
                                    std::to_string(b.local_region) + " is " +
                                    std::string(KindName(local.range.kind)) +
                                    " memory; synchronise the event on the host instead");
      }
      if (n == 0) {
        // Nothing for MoRI to move (MoRI refuses empty batches): complete OK from the reaper,
        // with an event too (a batch of no runs reads nothing of its producer's, on every
        // backend).
        deliver_.emplace_back(b.token, Status::OK());
        reap_cv_.notify_all();
        return Status::OK();
      }
    }
    auto work = std::make_unique<Work>();
    work->token = b.token;
    work->op = b.op;
    work->peer = b.peer;
    work->local_region = b.local_region;
    work->remote_region = b.remote_region;
    work->local_mori_id = local.mori_id;
    work->runs = n;
    work->wait_event = b.device_wait_event;
    work->peer_key = peer_key;
    MORIIO_RETURN_IF_ERROR(MapRuns(b, local, remote, work.get()));
    {
      std::lock_guard lock(mu_);
      if (stopping_) return AbortedError("the MoRI backend is shutting down");
      // Regions may have gone while the runs were mapped (handles are never reused).
      MORIIO_RETURN_IF_ERROR(FindLocked(b, &local, &remote, &peer_key));
      ++locals_.at(b.local_region).uses;
      queue_.push_back(std::move(work));
    }
    post_cv_.notify_one();
    return Status::OK();
  }

 private:
  // What a call that needs MoRI answers once ~MoriBackend destroyed it (a sink calling back from
  // a completion the destructor reports).
  static Status GoneError() {
    return AbortedError("the MoRI backend is shutting down (MoRI-IO already stopped)");
  }

  // Copies what Submit needs about the batch's regions; errors name what is wrong.
  Status FindLocked(const Batch& b, LocalRegion* local, RemoteRegion* remote,
                    std::string* peer_key) const {
    auto l = locals_.find(b.local_region);
    if (l == locals_.end()) {
      return NotFoundError("batch " + std::to_string(b.token) + " names unknown local region " +
                           std::to_string(b.local_region));
    }
    auto r = remotes_.find(b.remote_region);
    if (r == remotes_.end()) {
      return NotFoundError("batch " + std::to_string(b.token) + " names unknown remote region " +
                           std::to_string(b.remote_region));
    }
    if (r->second.peer != b.peer) {
      return InvalidArgumentError("batch " + std::to_string(b.token) + ": remote region " +
                                  std::to_string(b.remote_region) + " belongs to peer " +
                                  std::to_string(r->second.peer) + ", not peer " +
                                  std::to_string(b.peer));
    }
    const Peer& peer = peers_.at(b.peer);
    if (!peer.failure.empty()) {
      return TransportError("peer '" + peer.engine_key + "' failed: " + peer.failure);
    }
    *local = l->second;
    *remote = r->second;
    *peer_key = peer.engine_key;
    return Status::OK();
  }

  // Batch offsets are relative to our regions; MoRI's are relative to its registrations, which
  // may start before a region (shared registration locally, sub-range of a peer's MR remotely).
  Status MapRuns(const Batch& b, const LocalRegion& local, const RemoteRegion& remote,
                 Work* w) const {
    const std::size_t n = b.sizes.size();
    const std::uint64_t max_run = options_.max_run_bytes;
    std::size_t entries = 0;
    for (std::size_t i = 0; i < n; ++i) {
      const auto size = static_cast<std::uint64_t>(b.sizes[i]);
      entries += static_cast<std::size_t>((size + max_run - 1) / max_run);
    }
    w->local_offsets.reserve(entries);
    w->remote_offsets.reserve(entries);
    w->sizes.reserve(entries);
    for (std::size_t i = 0; i < n; ++i) {
      std::uint64_t l = local.base + static_cast<std::uint64_t>(b.local_offsets[i]);
      std::uint64_t r = remote.base + static_cast<std::uint64_t>(b.remote_offsets[i]);
      std::uint64_t left = static_cast<std::uint64_t>(b.sizes[i]);
      while (left > 0) {
        const std::uint64_t piece = std::min(left, max_run);
        w->local_offsets.push_back(static_cast<std::size_t>(l));
        w->remote_offsets.push_back(static_cast<std::size_t>(r));
        w->sizes.push_back(static_cast<std::size_t>(piece));
        l += piece;
        r += piece;
        left -= piece;
      }
    }
    return Status::OK();
  }

  std::string Describe(const Work& w) const {
    return "MoRI-IO batch " + std::string(OpName(w.op)) + " token " + std::to_string(w.token) +
           " with peer '" + w.peer_key + "' (" + std::to_string(w.runs) + " runs, local region " +
           std::to_string(w.local_region) + ", remote region " + std::to_string(w.remote_region) +
           ")";
  }

  // Hands `done` to the sink (no lock held): the batches in `unconfirmed` (WRITEs whose
  // writes MoRI did not confirm stopped) through OnBatchUnconfirmed, the rest as complete.
  void Report(std::vector<Delivery>& done, const std::set<std::uint64_t>& unconfirmed) {
    for (auto& [token, status] : done) {
      if (unconfirmed.count(token)) {
        sink_->OnBatchUnconfirmed(token, std::move(status));
      } else {
        sink_->OnBatchComplete(token, std::move(status));
      }
    }
  }

  // Drops the counts a batch holds. Caller holds mu_.
  void ReleaseLocked(const Work& w) {
    auto it = locals_.find(w.local_region);
    MORIIO_CHECK(it != locals_.end(), "a region with batches in flight was deregistered");
    --it->second.uses;
  }

  // The session a posted batch used is done with it. Caller holds mu_.
  void ReleaseSessionLocked(std::uint64_t session) {
    for (auto& [key, entry] : sessions_) {
      if (entry.id == session) {
        --entry.in_flight;
        return;
      }
    }
    auto it = retired_sessions_.find(session);
    MORIIO_CHECK(it != retired_sessions_.end(), "a posted batch's session is unknown");
    if (--it->second == 0) {
      retired_sessions_.erase(it);
      sessions_to_destroy_.push_back(session);
    }
  }

  // Whether a queued batch is ready to post: walks the queue oldest first, clearing the wait
  // of each batch whose HIP event completed (EventPass: each distinct event asked once, at most a
  // few pending ones) until one waits for nothing, and fails those whose event HIP cannot
  // answer about. Under mu_, HIP call included: a batch taken off the queue may be delivered at
  // once and its event destroyed, so its event is only ever asked about while it is queued;
  // EventCompleted never calls back into the backend.
  bool PollEventsLocked() {
    EventPass pass;
    for (auto it = queue_.begin(); it != queue_.end();) {
      Work& w = **it;
      if (w.wait_event == 0) return true;
      const std::optional<Result<bool>> completed =
          pass.Ask(w.wait_event, [&](std::uint64_t e) { return api_->EventCompleted(e); });
      if (!completed) {  // not asked this pass; a batch without an event may still follow
        ++it;
        continue;
      }
      if (!completed->ok()) {
        ReleaseLocked(w);
        deliver_.emplace_back(w.token, TransportError(Describe(w) + ": HIP event " +
                                                      std::to_string(w.wait_event) +
                                                      " it waits for cannot be queried: " +
                                                      completed->status().message()));
        reap_cv_.notify_all();
        it = queue_.erase(it);
        continue;
      }
      if (**completed) {
        w.wait_event = 0;
        return true;
      }
      ++it;
    }
    return false;
  }

  // The oldest queued batch that waits for nothing, taken off the queue (null when none).
  std::unique_ptr<Work> TakeReadyLocked() {
    auto it = std::find_if(queue_.begin(), queue_.end(),
                           [](const std::unique_ptr<Work>& w) { return w->wait_event == 0; });
    if (it == queue_.end()) return nullptr;
    std::unique_ptr<Work> w = std::move(*it);
    queue_.erase(it);
    return w;
  }

  void PostLoop() {
    while (true) {
      {
        std::unique_lock lock(mu_);
        post_cv_.wait(lock, [&] { return stopping_ || !queue_.empty(); });
        if (stopping_) {
          // The destructor ends what is still queued. Only now is in_flight_ final: a batch
          // MoRI already took may still be on its way into it.
          poster_stopped_ = true;
          reap_cv_.notify_all();
          return;
        }
        if (!PollEventsLocked()) {
          // Every queued batch waits for an event, which signals nothing: look again shortly,
          // or at once when a batch is submitted.
          post_cv_.wait_for(lock, kEventPollInterval);
          continue;
        }
      }
      // api_mu_ across the whole post: DisconnectPeer/DeregisterMemory cannot remove what this
      // batch uses between the pop and MoRI's call.
      std::lock_guard api_lock(api_mu_);
      std::unique_ptr<Work> w;
      std::optional<std::uint64_t> session;
      MoriMemory remote_mem;
      {
        std::lock_guard lock(mu_);
        if (stopping_) continue;
        w = TakeReadyLocked();
        if (!w) continue;
        auto s = sessions_.find(SessionKey{w->local_mori_id, w->remote_region});
        if (s != sessions_.end()) {
          session = s->second.id;
        } else {
          remote_mem = remotes_.at(w->remote_region).mem;
        }
      }
      if (!session) {
        // A region registered after the peer was imported: open its session now.
        auto s = api_->CreateSession(w->local_mori_id, remote_mem);
        if (!s.ok()) {
          std::lock_guard lock(mu_);
          ReleaseLocked(*w);
          deliver_.emplace_back(
              w->token, TransportError("cannot open a MoRI-IO session for " + Describe(*w) + ": " +
                                       s.status().message()));
          reap_cv_.notify_all();
          continue;
        }
        session = *s;
        std::lock_guard lock(mu_);
        sessions_[SessionKey{w->local_mori_id, w->remote_region}] = SessionEntry{*s, 0};
      }
      w->session = *session;
      {
        std::lock_guard lock(mu_);
        if (!idle_statuses_.empty()) {
          w->status = std::move(idle_statuses_.back());
          idle_statuses_.pop_back();
        }
      }
      if (w->status) {
        w->status->Reset();
      } else {
        w->status = api_->NewStatus();
      }
      Status posted = api_->PostBatch(w->session, w->op, w->local_offsets, w->remote_offsets,
                                      w->sizes, w->status.get());
      {
        std::lock_guard lock(mu_);
        if (!posted.ok()) {
          // MoRI may have stored the pointer before it failed: keep the status to the end.
          graveyard_.push_back(std::move(w->status));
          ReleaseLocked(*w);
          deliver_.emplace_back(w->token, TransportError("MoRI-IO did not accept " + Describe(*w) +
                                                         ": " + posted.message()));
        } else {
          for (auto& [key, entry] : sessions_) {
            if (entry.id == w->session) ++entry.in_flight;
          }
          // The posted offsets are no longer needed; free them while the batch is in flight.
          w->local_offsets = {};
          w->remote_offsets = {};
          w->sizes = {};
          in_flight_.push_back(std::move(w));
        }
      }
      reap_cv_.notify_all();
    }
  }

  void HandlePeerFailure(const MoriPeerFailure& f) {
    std::lock_guard lock(mu_);
    const std::string what = "MoRI-IO reported " + (f.reason.empty() ? "a failure" : f.reason) +
                             (f.device.empty() ? "" : " on " + f.device) +
                             (f.detail.empty() ? "" : ": " + f.detail);
    if (f.engine_key.empty()) {
      // Not tied to one peer (a port or device): every peer may be affected; the engine decides.
      for (const auto& [handle, peer] : peers_) {
        peer_events_.emplace_back(handle, TransportError(what + " (affects every peer on it)"));
      }
      return;
    }
    for (auto& [handle, peer] : peers_) {
      if (peer.engine_key != f.engine_key) continue;
      peer.failure = what;
      for (auto w = queue_.begin(); w != queue_.end();) {
        if ((*w)->peer == handle) {
          ReleaseLocked(**w);
          deliver_.emplace_back(
              (*w)->token, TransportError("peer '" + peer.engine_key + "' failed before batch " +
                                          std::to_string((*w)->token) + " was posted: " + what));
          w = queue_.erase(w);
        } else {
          ++w;
        }
      }
      peer_events_.emplace_back(handle,
                                TransportError("peer '" + peer.engine_key + "' failed: " + what));
    }
  }

  void ReapLoop() {
    constexpr auto kIdleWait = std::chrono::milliseconds(20);  // peer-failure polling when idle
    constexpr int kSliceMs = 1;  // bounded wait on the oldest status; newer ones are re-polled
    while (true) {
      while (auto failure = api_->PopPeerFailure()) HandlePeerFailure(*failure);
      std::vector<Delivery> done;
      std::set<std::uint64_t> unconfirmed;  // failed WRITEs: other WRs of them may still land
      std::vector<Delivery> peer_events;
      std::vector<std::uint64_t> destroy;
      MoriTransferStatus* oldest = nullptr;
      bool exit = false;
      {
        std::unique_lock lock(mu_);
        const auto now = Clock::now();
        for (auto it = in_flight_.begin(); it != in_flight_.end();) {
          Work& w = **it;
          const std::uint32_t code = w.status->Code();
          // Only MoRI's terminal status ends a posted batch (no deadline does here); only a
          // successful one proves that none of its writes can land any more (below).
          if (!IsTerminalCode(code)) {
            ++it;
            continue;
          }
          Status status;
          if (w.peer_disconnected) {
            status = AbortedError("peer '" + w.peer_key + "' was disconnected while " +
                                  Describe(w) + " was in flight");
          } else {
            status = MoriCodeToStatus(code, w.status->Message(), Describe(w));
          }
          const bool succeeded = code == static_cast<std::uint32_t>(MoriCode::kSuccess);
          if (succeeded) {
            // MoRI may still be notifying through it: reuse it, never free it while MoRI runs.
            idle_statuses_.push_back(std::move(w.status));
          } else {
            graveyard_.push_back(std::move(w.status));  // later CQEs may still update it
          }
          // MoRI fails a batch at its first error while its other work requests (other QPs,
          // earlier post batches) may still write at the peer: not confirmed, not drained.
          if (w.op == TransferOp::kWrite && !succeeded) unconfirmed.insert(w.token);
          ReleaseLocked(w);
          ReleaseSessionLocked(w.session);
          done.emplace_back(w.token, std::move(status));
          it = in_flight_.erase(it);
        }
        for (auto& d : deliver_) done.push_back(std::move(d));
        deliver_.clear();
        peer_events.swap(peer_events_);
        destroy.swap(sessions_to_destroy_);
        if (stopping_ && poster_stopped_ && (in_flight_.empty() || now >= drain_deadline_)) {
          exit = true;
        } else if (done.empty() && peer_events.empty() && (destroy.empty() || destroy_retry_)) {
          if (in_flight_.empty()) {
            reap_cv_.wait_for(lock, kIdleWait);
          } else {
            oldest = in_flight_.front()->status.get();
          }
        }
      }
      for (auto& [peer, status] : peer_events) sink_->OnPeerFailure(peer, std::move(status));
      Report(done, unconfirmed);
      if (!destroy.empty()) {
        // Not worth blocking completions behind a slow post: retry on a later pass instead.
        std::unique_lock api_lock(api_mu_, std::try_to_lock);
        if (api_lock.owns_lock()) {
          for (std::uint64_t s : destroy) api_->DestroySession(s);
          destroy_retry_ = false;
        } else {
          std::lock_guard lock(mu_);
          destroy_retry_ = true;
          sessions_to_destroy_.insert(sessions_to_destroy_.end(), destroy.begin(), destroy.end());
        }
      }
      if (exit) return;
      // Statuses are freed only after MoRI is gone, and only this thread hands a status back for
      // reuse, so `oldest` stays valid and unshared while it waits here.
      if (oldest) oldest->WaitFor(kSliceMs);
    }
  }

  std::unique_ptr<MoriApi> api_;
  const MoriOptions options_;
  const std::shared_ptr<CompletionSink> sink_;

  // Lock order: api_mu_ before mu_. api_mu_ serialises every MoriApi call except statuses and
  // PopPeerFailure (MoRI's registration tables are not thread-safe).
  std::mutex api_mu_;
  mutable std::mutex mu_;
  std::condition_variable post_cv_;
  std::condition_variable reap_cv_;
  bool stopping_ = false;
  bool poster_stopped_ = false;  // PostLoop returned: no batch can join in_flight_ any more
  Clock::time_point drain_deadline_ = Clock::time_point::max();
  std::uint64_t next_handle_ = 1;
  std::map<std::uint32_t, Registration> registrations_;
  std::map<std::uint64_t, LocalRegion> locals_;
  std::map<std::uint64_t, Peer> peers_;
  std::map<std::uint64_t, RemoteRegion> remotes_;
  std::map<SessionKey, SessionEntry> sessions_;
  std::map<std::uint64_t, std::int64_t> retired_sessions_;  // session -> batches still posted
  std::vector<std::uint64_t> sessions_to_destroy_;
  bool destroy_retry_ = false;  // the last DestroySession attempt found api_mu_ held
  std::deque<std::unique_ptr<Work>> queue_;     // submitted, not yet posted
  std::list<std::unique_ptr<Work>> in_flight_;  // posted, oldest first
  // Statuses MoRI may still write to (failed, timed out, rejected): freed after api_ is gone.
  std::vector<std::unique_ptr<MoriTransferStatus>> graveyard_;
  // Statuses that reached SUCCESS, for reuse (at most the peak number of posted batches).
  std::vector<std::unique_ptr<MoriTransferStatus>> idle_statuses_;
  std::vector<Delivery> deliver_;      // completions decided outside the reaper
  std::vector<Delivery> peer_events_;  // peer failures to report
  std::thread poster_;
  std::thread reaper_;
};

}  // namespace

Result<std::unique_ptr<Backend>> CreateMoriBackendWithApi(std::unique_ptr<MoriApi> api,
                                                          const MoriOptions& options,
                                                          std::shared_ptr<CompletionSink> sink) {
  if (!api) return InvalidArgumentError("the MoRI backend needs a MoRI API");
  if (!sink) return InvalidArgumentError("a completion sink is required");
  return std::unique_ptr<Backend>(
      std::make_unique<MoriBackend>(std::move(api), options, std::move(sink)));
}

}  // namespace moriio_native::detail::mori_backend
