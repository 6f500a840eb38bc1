#pragma once

/// The transfer engine: registers a process's KV caches, exchanges metadata with peers, turns
/// (request, blocks) into batched transfers on a backend and tracks every transfer to exactly
/// one terminal state. Completions are queued as plain events; nothing calls back into the user.

#include <chrono>
#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "moriio_native/backend.hpp"
#include "moriio_native/layout.hpp"
#include "moriio_native/status.hpp"

namespace moriio_native {

/// One layer to register: its view, spec, and the allocation the view lives in.
struct LayerRegistration {
  std::string name;
  TensorGeometry geometry;  ///< data_ptr must be set
  CacheSpec spec;
  KvPlaneAxis plane_axis = KvPlaneAxis::kAuto;
  /// The whole allocation the view lives in (base, size, memory kind, device). The engine
  /// registers page-aligned regions inside it, never outside, and peers may then read and write
  /// any byte of those regions: the caller guarantees it is one live allocation this process
  /// owns, holding the whole view, allocated until the engine is destroyed, and nothing in it
  /// that peers must not see or change. (The Python facade checks a torch tensor's claim
  /// against its storage; a raw address cannot be checked.)
  MemoryRange allocation;
};

struct EngineConfig {
  std::string engine_id;             ///< unique name peers know us by
  std::string backend = "loopback";  ///< "loopback", "ucx", "mori"
  BackendOptions options;            ///< backend keys (ucx_tls, mori_backend, ...)
  std::chrono::milliseconds transfer_timeout{30000};
  std::size_t terminal_history = 65536;  ///< terminal transfer ids remembered to drop late events
  /// Alignment of registered regions: a power of two in [kMinPageSize, kMaxPageSize]. The
  /// minimum is the smallest OS page of any supported host (memory is pinned and registered with
  /// NICs by whole pages); a smaller value would call unaligned regions aligned.
  std::uint64_t page_size = 4096;

  static constexpr std::uint64_t kMinPageSize = 4096;
  static constexpr std::uint64_t kMaxPageSize = std::uint64_t{1} << 30;  ///< 1 GiB huge pages
};

/// One part of a transfer: `layers` x the block pairs (local_blocks[i], remote_blocks[i]) x the
/// cells of `local_window` <-> `remote_window` of each pair (cell (p, h, t) of the local window
/// pairs with cell (p, h, t) of the remote window; see BlockTemplate::Build with windows).
/// Several segments make one transfer: a decode block filled from several prefill blocks (four
/// 16-token blocks into token windows 0/16/32/48 of one 64-token block), a head range of the
/// peer's heads (heterogeneous TP), or layer groups with their own block ids (hybrid caches).
/// A local list shorter than the remote one pairs with the first remote ids (as Read does).
struct BlockSegment {
  std::vector<std::string> layers;  ///< empty: every layer of the transfer
  std::vector<std::int64_t> local_blocks;
  std::vector<std::int64_t> remote_blocks;
  CellWindow local_window;   ///< default: whole blocks
  CellWindow remote_window;  ///< default: whole blocks
};

enum class TransferKind : std::uint8_t { kRead = 0, kWrite = 1 };
enum class TransferState : std::uint8_t { kPending = 0, kDone, kFailed, kAborted, kTimedOut };

std::string_view TransferStateName(TransferState state);

/// A transfer reached its terminal state (exactly one event per transfer).
struct TransferEvent {
  std::string transfer_id;
  TransferKind kind = TransferKind::kRead;
  TransferState state = TransferState::kDone;
  std::string peer;
  std::string message;  ///< why, for every state but done
  std::int64_t bytes = 0;
  /// Runs of the request's plan; a cell batch counts the runs its cells replace.
  std::int64_t runs = 0;
  std::int64_t batches = 0;
  /// Of `batches`, those handed to the backend as stamped batches (template and block ids, see
  /// Backend::AcceptsStamps) instead of runs, whether or not it took them.
  std::int64_t stamped_batches = 0;
  /// Of `batches`, those that moved whole blocks as cells (a transposing copy, see
  /// Backend::AcceptsCells) instead of runs.
  std::int64_t cell_batches = 0;
  double seconds = 0.0;  ///< from the first submit to the terminal state
  /// True when no operation of this transfer can write any more (always for done).
  /// False when the transfer ended (timed out or aborted) while batches were still in flight
  /// past a second timeout period: its destination is QUARANTINED -- the bytes may still
  /// change -- until Engine::PollDrained reports this id. Also false, and then never reported
  /// by PollDrained, when the transport could not confirm a WRITE batch's writes before its
  /// connection closed (CompletionSink::OnBatchUnconfirmed): the peer's blocks may change at
  /// any time, so they stay quarantined until the caller's own bound.
  bool drained = true;
};

/// A quarantined transfer (TransferEvent::drained was false) whose last operation completed:
/// from now on nothing of it writes its destination. Reported exactly once per such transfer.
struct DrainedTransfer {
  std::string transfer_id;
  TransferKind kind = TransferKind::kRead;
  std::string peer;
  double seconds = 0.0;  ///< from the transfer's start to the drain
};

/// Thread-safe: every method may be called from any thread. Methods block only where noted.
class Engine {
 public:
  /// Creates the backend (BackendUnavailable with the reason when it cannot run here).
  static Result<std::unique_ptr<Engine>> Create(EngineConfig config);
  ~Engine();
  Engine(const Engine&) = delete;
  Engine& operator=(const Engine&) = delete;

  const std::string& engine_id() const;
  const std::string& backend_name() const;

  /// Registers every layer (once; layers sharing an allocation share one memory region) and
  /// returns the local metadata peers need. Nothing is registered if any layer is invalid.
  /// Blocks while the backend registers memory.
  Result<std::vector<std::uint8_t>> RegisterKvCaches(std::span<const LayerRegistration> layers);

  /// The metadata returned by RegisterKvCaches (FailedPrecondition before it).
  Result<std::vector<std::uint8_t>> LocalMetadata() const;

  /// Validates a peer's metadata (every number), checks each of our layers has a peer layer of
  /// the same name whose cells pair with ours (kind, dtype and bytes per head and token equal;
  /// head counts and block sizes may differ: such a layer moves only through segments whose
  /// windows pair, and a whole-block Read or WriteLayer of it is Incompatible naming both
  /// layouts), connects, and returns the peer's engine id. On error
  /// nothing changes. Adding a peer again with identical metadata is a no-op. Blocks on connect.
  /// With `expected_engine_id`, metadata naming another engine is Incompatible (nothing changes):
  /// what a handshake answered as and what its metadata says must agree BEFORE anything is
  /// connected or replaced.
  Result<std::string> AddPeer(std::span<const std::uint8_t> metadata,
                              std::string_view expected_engine_id = {});

  /// As AddPeer, but a peer already connected under the same engine id with OTHER metadata (that
  /// peer restarted: new transport address, new memory) is replaced: the new connection is made
  /// first, then the old one's pending transfers end (never `done`) and it is disconnected. On error
  /// the old peer stays as it was. Identical metadata is a no-op. Thread-safe; blocks on connect.
  /// Use it only where the caller authenticated the metadata as coming from that peer (a
  /// handshake with it), since it ends every transfer to the old instance; pass the id that
  /// handshake answered as in `expected_engine_id`, so that an answer carrying another engine's
  /// id in its metadata cannot replace that engine's connection (as AddPeer).
  Result<std::string> ReplacePeer(std::span<const std::uint8_t> metadata,
                                  std::string_view expected_engine_id = {});

  /// Disconnects `peer`; its pending transfers end (never `done`). NotFound for an unknown id.
  /// Thread-safe; blocks while the backend disconnects.
  Status RemovePeer(std::string_view peer);
  /// As RemovePeer, but only while no transfer with `peer` is pending or quarantined: then
  /// disconnecting it ends and strands nothing, and the result is true. False when one is
  /// (nothing changes); NotFound for an unknown peer; the backend's error when disconnecting
  /// failed (the peer is gone from the engine then too). A call that found the peer before this
  /// one removed it fails as for an unknown peer. What bounds a directory of peers: the least
  /// recently used idle one goes. Thread-safe; blocks while the backend disconnects.
  Result<bool> RemoveIdlePeer(std::string_view peer);
  std::vector<std::string> Peers() const;

  /// READ: pull `remote_blocks` of every layer (or of `layers` when given, each once) from
  /// `peer` into `local_blocks`. One batch per (local region, remote region), cut at a layer
  /// boundary once it holds 8192 runs of 256 MiB or more, or 65,536 runs (small runs go in
  /// larger batches: the host's time per batch is per run); a layer pair whose runs are short because its two sides
  /// order the axes differently goes as cells (a transposing copy) where the backend takes
  /// cells for that region pair (Backend::AcceptsCells), in one batch per region pair and cell
  /// geometry cut at 8192 blocks; any other layer pair goes as a stamped layer (its template and
  /// the ids, Batch::stamps) where the backend takes stamped batches for the region pair
  /// (Backend::AcceptsStamps), in one batch per region pair cut every 8 layers, and as runs
  /// everywhere else. The first three batches close at 1/8, 1/4 and 1/2 of these thresholds.
  /// Each batch is submitted as soon
  /// as it is planned, so the transport starts while later layers are planned. Every argument (every block id against
  /// every layer) is checked before anything starts: on error no transfer exists. Never blocks
  /// on transfer.
  Status Read(std::string_view transfer_id, std::string_view peer,
              std::span<const std::int64_t> local_blocks,
              std::span<const std::int64_t> remote_blocks,
              std::span<const std::string> layers = {});

  /// READ of several segments as ONE transfer (one terminal event, one abort, one quarantine
  /// unit), batched and cut as Read does (segments of one region pair share its batches). Every
  /// argument is checked before anything starts, and errors name the segment index, layer,
  /// block id and window: an unknown layer, a layer twice in one segment, ids out of range on
  /// either side (the remote side as the peer registered it), a window outside its block (the
  /// remote one checked against the peer's layout), windows that do not pair, and LOCAL
  /// destination cells written twice (the same local block of a layer in two segments whose
  /// local windows overlap; disjoint windows of one block are how several peer blocks or
  /// head ranges fill it). On error no transfer exists and nothing changed. Empty `segments`
  /// make a transfer with nothing to move. Never blocks on transfer.
  Status Read(std::string_view transfer_id, std::string_view peer,
              std::span<const BlockSegment> segments);

  /// WRITE: push one layer's blocks to `peer` (one batch: cells, stamped or runs, chosen as for
  /// Read).
  /// Returns false (and does nothing) when this (transfer, layer) was scheduled before, or the
  /// transfer failed, was aborted, timed out or is terminal. InvalidArgument naming the id, with no change, when `transfer_id` is a READ.
  /// Every other refusal (unknown peer or layer, a bad block id, another peer than the
  /// transfer's, one layer more than the seal said, a CUDA event it cannot honour) returns the
  /// error AND fails the transfer, so a transfer one of whose layers was refused never ends done.
  /// A submission failure fails the transfer too (its event says why). Never blocks on transfer.
  /// `cuda_event` (0: none): a cudaEvent_t (hipEvent_t on ROCm) of this process recorded after
  /// the work that produces this layer's blocks; the copy then starts only once that work has
  /// finished, so the call may come before it has (per-layer WRITE overlapped with the forward
  /// pass). It needs a GPU layer and a peer for which WaitsForDeviceEvents is true
  /// (FailedPrecondition otherwise); keep the event valid and unrecorded until the transfer's
  /// event.
  Result<bool> WriteLayer(std::string_view transfer_id, std::string_view layer,
                          std::string_view peer, std::span<const std::int64_t> local_blocks,
                          std::span<const std::int64_t> remote_blocks,
                          std::uint64_t cuda_event = 0);

  /// WriteLayer of several segments of `layer` as one write of the transfer (one batch: runs,
  /// or cells when every segment's window pair goes as cells of one geometry). The segments'
  /// `layers` must be empty. Checked as Read with segments checks, with REMOTE destination
  /// cells in place of local ones: the same remote block in two segments is fine when their
  /// remote windows are disjoint (two prefill ranks' head ranges into one decode block), an
  /// error when they overlap. Refusals (other than a READ id) fail the transfer as WriteLayer
  /// does; returns false as WriteLayer does. Never blocks on transfer.
  Result<bool> WriteLayer(std::string_view transfer_id, std::string_view layer,
                          std::string_view peer, std::span<const BlockSegment> segments,
                          std::uint64_t cuda_event = 0);

  /// WriteLayer of several whole-block layers in one call: each layer counts as one write of
  /// the transfer (towards the seal), and their blocks go batched as Read batches them (the
  /// stamped layers of one region pair share a batch, cut every 8 layers, the first ones
  /// sooner), so a WRITE flushed after the forward pays one plan and a few batches, not a
  /// batch per layer. Checked before anything is recorded: an unknown or repeated layer, a bad
  /// block id, a CUDA event that one of the layers or the peer cannot honour (each named) is
  /// refused and fails the transfer, as WriteLayer's refusals do; empty `layers` or a READ id
  /// is InvalidArgument with no change. Returns false (and does nothing) when every one of
  /// `layers` was scheduled before or the transfer failed, was aborted, timed out or is
  /// terminal; some of them scheduled before, but not all, is InvalidArgument that fails the
  /// transfer (an ambiguous retry). `cuda_event`: one event, recorded after the work producing
  /// every one of the layers, that each of their batches waits for (as WriteLayer).
  /// Thread-safe; never blocks on transfer.
  Result<bool> WriteLayers(std::string_view transfer_id, std::span<const std::string> layers,
                           std::string_view peer, std::span<const std::int64_t> local_blocks,
                           std::span<const std::int64_t> remote_blocks,
                           std::uint64_t cuda_event = 0);

  /// Whether WriteLayer to `peer` honours a `cuda_event`: the UCX backend with its CUDA copy
  /// plugin and CUDA layers, or MoRI-IO and ROCm layers. Where UCX maps the peer's memory into
  /// this process (CUDA IPC on one node) the copy waits for the event on the GPU; where the
  /// copies are UCX operations (RDMA to another node, ucx_direct_copy off) the backend's
  /// progress thread polls the event and posts the layer's first operation once it completed;
  /// MoRI-IO's poster thread likewise (hipEventQuery) before it hands the batch to MoRI. Either
  /// way the caller never waits. A caller holding a layer's event passes it when true and waits
  /// for it on the host otherwise (host memory, loopback). NotFound for an unknown peer.
  /// Thread-safe, non-blocking; the answer stays the same while the peer stays added.
  Result<bool> WaitsForDeviceEvents(std::string_view peer) const;

  /// WRITE: the caller schedules exactly `expected_writes` distinct layers of this transfer to
  /// `peer` -- before or after this call (a seal may overtake its writes); the transfer is done
  /// once all of them completed. `expected_writes == 0` is the explicit "nothing to send" (a
  /// full prefix hit): the transfer is done at once. Creates the transfer when nothing was
  /// scheduled yet. InvalidArgument naming the id, with no change, for a READ id, an empty or
  /// other peer, a negative count, a count above the registered layers (each layer is written
  /// once, so it could never be reached) or a second seal with another count; InvalidArgument
  /// that also fails the transfer when more layers than `expected_writes` were scheduled.
  /// True when the seal belongs to a live transfer; false when the engine remembers the WRITE
  /// as ended (a late seal, or an id reused): the seal is ignored and no event follows from it,
  /// so a caller that scheduled nothing of it must not wait for one. Never blocks.
  Result<bool> Seal(std::string_view transfer_id, std::string_view peer,
                    std::int64_t expected_writes);

  /// Ends a pending transfer as aborted (its event follows once in-flight batches drained).
  Status Abort(std::string_view transfer_id);

  /// Terminal events, oldest first. Waits up to `wait` for the first one (in slices; the Python
  /// binding releases the GIL and checks signals between slices). While one or two batches of
  /// pending transfers are in flight the wait spins, yielding the CPU, instead of sleeping.
  std::vector<TransferEvent> PollEvents(std::size_t max_events, std::chrono::milliseconds wait);

  /// Quarantined transfers (see TransferEvent::drained) that drained since the last call, oldest
  /// first, at most `max_transfers`; each quarantined transfer is reported exactly once. Only
  /// then may its destination memory be reused. Never blocks.
  std::vector<DrainedTransfer> PollDrained(std::size_t max_transfers);

  /// Allocates `size` bytes through the backend for use as a KV backing: memory the transport
  /// reaches fastest (UCX: shared memory that same-host peers map and copy with memcpy). Valid
  /// until FreeBacking or the engine's destruction. FailedPrecondition when the backend cannot
  /// allocate (capabilities().allocation is false). Blocks while the backend allocates.
  Result<MemoryRange> AllocateBacking(std::uint64_t size, MemoryKind kind = MemoryKind::kHost,
                                      int device = -1);
  /// Frees memory from AllocateBacking (FailedPrecondition while KV caches registered in it).
  Status FreeBacking(std::uint64_t address);

  /// Number of transfers not yet terminal.
  std::size_t PendingTransfers() const;
  /// Number of terminal transfers still quarantined (batches in flight past their event).
  std::size_t QuarantinedTransfers() const;

  struct Impl;

 private:
  explicit Engine(std::unique_ptr<Impl> impl);
  // AddPeer (replace=false) and ReplacePeer (replace=true).
  Result<std::string> ConnectPeer(std::span<const std::uint8_t> metadata, bool replace,
                                  std::string_view expected_engine_id);
  std::unique_ptr<Impl> impl_;
};

}  // namespace moriio_native
