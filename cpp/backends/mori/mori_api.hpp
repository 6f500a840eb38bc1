#pragma once

// The seam between the MoRI backend's mapping layer (mori_backend.cpp: our Batch and regions ->
// MoRI call arguments, TransferStatus ownership, completion delivery) and MoRI-IO itself
// (mori_io_api.cpp, the only file that includes MoRI headers). Tests put a fake behind this
// interface, so everything above MoRI's call arguments runs in CI without ROCm.
//
// Numbers and blobs here are MoRI's: memory ids, engine keys, and the msgpack forms of
// mori::io::EngineDesc / MemoryDesc. This header includes no MoRI header.

#include <cstddef>
#include <cstdint>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "moriio_native/backend.hpp"
#include "moriio_native/status.hpp"

namespace moriio_native::detail::mori_backend {

/// mori::io::StatusCode by number (mori_io_api.cpp static_asserts that the numbers agree).
enum class MoriCode : std::uint32_t {
  kSuccess = 0,
  kInit = 1,
  kInProgress = 2,
  kErrBegin = 10,
  kInvalidArgs = 11,
  kNotFound = 12,
  kRdmaOp = 13,
  kBadState = 14,
  kGpuOp = 15,
};

/// "SUCCESS", "ERR_RDMA_OP", ... or "CODE_<n>" for a number MoRI 1.2.4 does not define.
std::string MoriCodeName(std::uint32_t code);

/// Whether MoRI has finished with a transfer whose status shows `code`: SUCCESS or any failure.
/// INIT and IN_PROGRESS are not terminal; every other number (including ones this build does not
/// know) is treated as a failure, so an unexpected code cannot leave a batch pending forever.
constexpr bool IsTerminalCode(std::uint32_t code) {
  return code != static_cast<std::uint32_t>(MoriCode::kInit) &&
         code != static_cast<std::uint32_t>(MoriCode::kInProgress);
}

/// One mori::io::TransferStatus. MoRI keeps a raw pointer to it while the transfer runs and
/// writes to it from its own threads — even after the code is visible: MoRI's update stores the
/// code and then notifies the status's condition variable outside its lock, and a failed
/// multi-WR transfer may be updated again by later completions. So a status is never freed while
/// the MoriApi that posted it lives: one that reached SUCCESS is Reset and reused (a late notify
/// on a live object is harmless), any other is retired until the MoriApi is destroyed.
/// Thread-safe (MoRI's status is internally synchronised).
class MoriTransferStatus {
 public:
  virtual ~MoriTransferStatus() = default;
  /// The current code as a number (MoriCode). Never blocks (may run MoRI's progress hook).
  virtual std::uint32_t Code() = 0;
  /// MoRI's message for a failure ("" otherwise).
  virtual std::string Message() = 0;
  /// Waits up to `timeout_ms` (> 0) for the code to leave IN_PROGRESS; returns the code.
  virtual std::uint32_t WaitFor(int timeout_ms) = 0;
  /// Makes a status that reached SUCCESS ready for another PostBatch (code INIT, no message, no
  /// MoRI callbacks left from the previous transfer). Never for a status in any other state.
  virtual void Reset() = 0;
};

/// A memory registration as MoRI describes it.
struct MoriMemory {
  std::string engine_key;  ///< the engine that registered it
  std::uint32_t id = 0;    ///< MoRI's per-engine memory id
  std::uint64_t data = 0;  ///< start address in the owner's address space
  std::uint64_t size = 0;
  MemoryKind kind = MemoryKind::kHost;  ///< kRocm (MoRI GPU) or kHost (MoRI CPU)
  int device = -1;
  std::vector<std::uint8_t> desc;  ///< msgpack of mori::io::MemoryDesc (travels to peers)
};

/// A failure MoRI observed on a link (mori::io::PeerFailureEvent).
struct MoriPeerFailure {
  std::string engine_key;  ///< the peer; empty when the failure is not tied to one peer
  std::string reason;      ///< "PEER_UNREACHABLE", "LOCAL_PORT_DOWN", ...
  std::string device;      ///< RDMA device it was seen on
  std::string detail;
};

/// What the mapping layer needs from MoRI-IO. Thread-safety: the mapping layer serialises every
/// call except the status methods, PopPeerFailure and EventCompleted, which may run concurrently
/// with others.
/// Methods return errors, never throw (the MoRI implementation converts exceptions).
class MoriApi {
 public:
  /// Stops MoRI's threads and releases its resources; once it returns, MoRI writes to no status.
  virtual ~MoriApi() = default;

  /// Our MoRI engine key (unique per process incarnation).
  virtual const std::string& engine_key() const = 0;
  /// msgpack of our mori::io::EngineDesc.
  virtual Result<std::vector<std::uint8_t>> EngineDesc() = 0;

  /// Registers [range.address, +range.size) with MoRI. Blocks.
  virtual Result<MoriMemory> RegisterMemory(const MemoryRange& range) = 0;
  virtual Status DeregisterMemory(std::uint32_t id) = 0;

  /// Decodes a peer's EngineDesc blob and returns its engine key. Pure: registers nothing.
  virtual Result<std::string> EngineKeyOf(std::span<const std::uint8_t> engine_desc) = 0;
  /// Decodes a peer's EngineDesc blob and registers the peer with MoRI.
  virtual Status RegisterRemoteEngine(std::span<const std::uint8_t> engine_desc) = 0;
  virtual Status DeregisterRemoteEngine(const std::string& engine_key) = 0;
  /// Decodes a MemoryDesc blob (a peer's registration). Pure: registers nothing.
  virtual Result<MoriMemory> ParseMemoryDesc(std::span<const std::uint8_t> memory_desc) = 0;

  /// Opens a MoRI session between our registration `local_id` and a peer's registration. May
  /// block on the network (MoRI connects QPs and exchanges MRs here).
  virtual Result<std::uint64_t> CreateSession(std::uint32_t local_id, const MoriMemory& remote) = 0;
  virtual void DestroySession(std::uint64_t session) = 0;

  /// A fresh status for one PostBatch; the caller owns it (see MoriTransferStatus).
  virtual std::unique_ptr<MoriTransferStatus> NewStatus() = 0;
  /// One session BatchRead (op kRead) or BatchWrite with these offsets (bytes from the start of
  /// each MoRI registration) and sizes. OK means MoRI accepted it and will move `status` to a
  /// terminal code; an error means it did not, though MoRI may still hold `status`.
  virtual Status PostBatch(std::uint64_t session, TransferOp op,
                           const std::vector<std::size_t>& local_offsets,
                           const std::vector<std::size_t>& remote_offsets,
                           const std::vector<std::size_t>& sizes, MoriTransferStatus* status) = 0;

  /// The oldest link failure MoRI observed and nobody took yet.
  virtual std::optional<MoriPeerFailure> PopPeerFailure() = 0;

  /// Whether the work the HIP event `event` (a hipEvent_t of this process, Batch::
  /// device_wait_event) recorded has finished (hipEventQuery); never blocks. An error when HIP
  /// cannot answer. The mapping layer calls it holding its own lock, so it must never call back
  /// into the backend.
  virtual Result<bool> EventCompleted(std::uint64_t event) = 0;
};

}  // namespace moriio_native::detail::mori_backend
