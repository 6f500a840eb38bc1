#pragma once

/// The transport backend interface. A backend moves bytes between registered memory regions of
/// two engines; it knows nothing of layers, blocks or requests (the engine turns those into
/// batches). Backends other than loopback live in plugin libraries loaded at runtime, so this
/// header includes no transport header.

#include <cstdint>
#include <map>
#include <memory>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "moriio_native/status.hpp"

namespace moriio_native {

/// Where memory lives.
enum class MemoryKind : std::uint8_t { kHost = 0, kCuda = 1, kRocm = 2 };

/// A span of memory in some process's address space.
struct MemoryRange {
  std::uint64_t address = 0;
  std::uint64_t size = 0;
  MemoryKind kind = MemoryKind::kHost;
  int device = -1;  ///< GPU ordinal for device memory, -1 for host
};

/// A locally registered region: the backend's handle plus the bytes a peer needs to reach it
/// (an rkey, a MoRI MemoryDesc, ...).
struct RegisteredRegion {
  std::uint64_t handle = 0;
  std::vector<std::uint8_t> remote_key;
};

enum class TransferOp : std::uint8_t { kRead = 0, kWrite = 1 };

/// All runs of one request between one local region and one remote region of one peer.
/// Offsets are bytes relative to each region's start. Immutable once submitted; the backend may
/// keep the shared_ptr for as long as the transport uses it.
struct Batch {
  TransferOp op = TransferOp::kRead;
  std::uint64_t local_region = 0;   ///< RegisteredRegion::handle
  std::uint64_t peer = 0;           ///< from ConnectPeer
  std::uint64_t remote_region = 0;  ///< from ImportRemoteRegion
  std::vector<std::int64_t> local_offsets;
  std::vector<std::int64_t> remote_offsets;
  std::vector<std::int64_t> sizes;
  std::uint64_t token = 0;  ///< passed back in the completion
  /// A cudaEvent_t of this process (0: none) that the copy waits for on the GPU before it starts
  /// (no host wait), when capabilities().device_event_wait; a backend that cannot honour it for
  /// this batch fails the batch. The caller keeps the event valid and unrecorded until the batch
  /// completes.
  std::uint64_t device_wait_event = 0;
};

/// Receives completions. Backends call it from their own threads; implementations must be
/// thread-safe and must not block for long. Exactly one OnBatchComplete per accepted Submit.
class CompletionSink {
 public:
  virtual ~CompletionSink() = default;
  virtual void OnBatchComplete(std::uint64_t token, Status status) = 0;
  /// The transport lost a peer; its pending batches complete with errors separately.
  virtual void OnPeerFailure(std::uint64_t peer, Status status) = 0;
};

/// What a backend can do; the engine adapts registration and submission to it.
struct BackendCapabilities {
  bool host_memory = true;
  bool cuda_memory = false;
  bool rocm_memory = false;
  /// Whether regions may start/end off page boundaries (else the engine registers page-aligned
  /// regions only and fails with guidance when it cannot).
  bool unaligned_registration = true;
  /// Whether Allocate() is implemented (memory peers on this host can map directly).
  bool allocation = false;
  /// Whether GPU-to-GPU batches may carry Batch::device_wait_event (copies run on the GPU).
  bool device_event_wait = false;
};

/// String options from the engine config (connector extra config), e.g. {"ucx_tls": "sm,self"}.
using BackendOptions = std::map<std::string, std::string, std::less<>>;

/// A transport. Thread-safe: every method may be called from any thread. Methods that talk to
/// the transport may block briefly (registration, connection); Submit never waits for transfer.
class Backend {
 public:
  virtual ~Backend() = default;
  virtual std::string_view name() const = 0;
  virtual BackendCapabilities capabilities() const = 0;
  /// The bytes a peer passes to ConnectPeer to reach this backend (a worker address, ...).
  virtual Result<std::vector<std::uint8_t>> LocalAddress() = 0;
  virtual Result<RegisteredRegion> RegisterMemory(const MemoryRange& range) = 0;
  /// Fails with FailedPrecondition while batches using the region are in flight.
  virtual Status DeregisterMemory(std::uint64_t handle) = 0;
  virtual Result<std::uint64_t> ConnectPeer(std::span<const std::uint8_t> address) = 0;
  /// Makes a peer's region addressable; `range` is where it lives in the peer's address space.
  virtual Result<std::uint64_t> ImportRemoteRegion(std::uint64_t peer, const MemoryRange& range,
                                                   std::span<const std::uint8_t> remote_key) = 0;
  /// Drops a peer and everything imported from it; pending batches to it complete with errors.
  virtual Status DisconnectPeer(std::uint64_t peer) = 0;
  /// Starts a batch. On OK, exactly one completion follows; on error, none.
  virtual Status Submit(std::shared_ptr<const Batch> batch) = 0;

  /// Allocates `size` bytes the transport reaches fastest (e.g. shared memory that same-host
  /// peers map directly), page aligned. The memory stays valid until Free or the backend's
  /// destruction. Default: FailedPrecondition (capabilities().allocation is false).
  virtual Result<MemoryRange> Allocate(std::uint64_t size, MemoryKind kind, int device);
  /// Frees memory from Allocate; FailedPrecondition while it is registered.
  virtual Status Free(const MemoryRange& range);
};

/// Entry points of a backend plugin library `libmoriio_native_<name>.so`, which exports
/// `extern "C" const moriio_native::BackendPlugin* moriio_native_backend_plugin();`.
struct BackendPlugin {
  static constexpr std::uint32_t kAbiVersion = 1;
  std::uint32_t abi_version = kAbiVersion;
  const char* name = nullptr;
  /// OK when the transport can run here; otherwise BackendUnavailable with the precise reason.
  Status (*probe)(const BackendOptions& options) = nullptr;
  Result<std::unique_ptr<Backend>> (*create)(const BackendOptions& options,
                                             std::shared_ptr<CompletionSink> sink) = nullptr;
};

/// Availability of one backend on this machine.
struct BackendAvailability {
  std::string name;
  bool available = false;
  std::string reason;  ///< why not, when unavailable
};

/// Probes every known backend (loopback, ucx, mori). Thread-safe; loads plugins on first use.
std::vector<BackendAvailability> AvailableBackends(const BackendOptions& options = {});

/// Creates a backend by name. BackendUnavailable carries the plugin's reason; NotFound for an
/// unknown name.
Result<std::unique_ptr<Backend>> CreateBackend(std::string_view name, const BackendOptions& options,
                                               std::shared_ptr<CompletionSink> sink);

}  // namespace moriio_native

#define MORIIO_NATIVE_PLUGIN_SYMBOL "moriio_native_backend_plugin"
