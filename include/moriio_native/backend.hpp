#pragma once

/// The transport backend interface. A backend moves bytes between registered memory regions of
/// two engines; it knows nothing of layers, blocks or requests (the engine turns those into
/// batches). Backends other than loopback live in plugin libraries loaded at runtime, so this
/// header includes no transport header.

#include <cstdint>
#include <map>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "moriio_native/layout.hpp"
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

/// The cell part of a batch: every cell of `geometry` of every block pair in `blocks` (offsets
/// of each pair's local and remote block, bytes relative to each region's start), moved by a
/// transposing copy instead of one run per cell (see CellGeometry).
struct BatchCells {
  CellGeometry geometry;
  BlockOffsets blocks;
};

/// One layer of a stamped batch: template runs [first_run, first_run + num_runs) of
/// BatchStamps::runs, stamped for every block pair [first_block, first_block + num_blocks) of
/// BatchStamps::local_ids / remote_ids. Run k of block pair i copies runs[k].size bytes between
///   local_base + local_ids[i] * local_stride + runs[k].local   (local region offset) and
///   remote_base + remote_ids[i] * remote_stride + runs[k].remote (remote region offset),
/// exactly the runs the engine would otherwise stamp itself (AppendBlockCopies), unmerged.
struct StampedLayer {
  std::int64_t local_base = 0;   ///< bytes from the local region's start to the layer's block 0
  std::int64_t remote_base = 0;  ///< the same in the remote region
  std::int64_t local_stride = 0;   ///< bytes between consecutive local blocks
  std::int64_t remote_stride = 0;  ///< bytes between consecutive remote blocks
  std::uint64_t first_block = 0;
  std::uint64_t num_blocks = 0;
  std::uint32_t first_run = 0;
  std::uint32_t num_runs = 0;  ///< 1 .. kMaxStampRunsPerLayer
};

/// Most template runs one stamped layer may have (the GPU kernel keeps a layer's runs in shared
/// memory); the engine plans runs for a layer pair whose template has more.
inline constexpr std::uint32_t kMaxStampRunsPerLayer = 256;
/// Most layers one stamped batch may carry (the GPU kernel's grid has a y index per layer).
inline constexpr std::size_t kMaxStampLayers = 65535;

/// The stamped part of a batch: block ids and per-layer templates instead of one entry per run,
/// so the host's cost of a request is per layer and per block, not per run (4 KiB runs: the
/// engine's planning bounded the copy; docs/benchmarks.md, issue 18). The backend (a GPU kernel,
/// or CopyStampedRuns) computes every run's offsets itself.
struct BatchStamps {
  std::vector<StampedLayer> layers;
  std::vector<CopyRun> runs;  ///< templates: offsets relative to each side's block start
  std::vector<std::int64_t> local_ids;
  std::vector<std::int64_t> remote_ids;

  /// Runs the batch moves (every layer's blocks times its template runs).
  std::int64_t run_count() const;
};

/// The CPU reference of a stamped batch: copies every run of `stamps` between the region bases
/// `local` and `remote`, in `direction` (a memcpy per run). The GPU kernel must produce the same
/// bytes. The caller guarantees the batch passed CheckBatchStamps for these two regions.
/// Blocking; thread-safe for disjoint destinations.
void CopyStampedRuns(const BatchStamps& stamps, std::byte* local, std::byte* remote,
                     CellCopyDirection direction);

/// All runs of one request between one local region and one remote region of one peer, or (a
/// cell batch) all its blocks of one cell geometry between them, or (a stamped batch) its
/// layers' templates and block ids between them.
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
  /// A device event of this process (0: none; a cudaEvent_t, a hipEvent_t for MoRI-IO) that the
  /// copy waits for before it starts (on the GPU or in the backend's own thread; the caller never
  /// waits), when capabilities().device_event_wait and AcceptsDeviceWaits; a backend that cannot
  /// honour it for this batch fails the batch. The caller keeps the event valid and unrecorded
  /// until the batch completes.
  std::uint64_t device_wait_event = 0;
  /// Set: a cell batch, whose three run arrays are empty. Only for a region pair and geometry
  /// for which Backend::AcceptsCells said yes; every other backend refuses it at Submit.
  std::optional<BatchCells> cells;
  /// Set: a stamped batch, whose three run arrays are empty and which has no cells. Only for a
  /// region pair for which Backend::AcceptsStamps said yes; every other backend refuses it.
  std::optional<BatchStamps> stamps;
};

/// Receives completions. Backends call it from their own threads; implementations must be
/// thread-safe and must not block for long. Exactly one OnBatchComplete or OnBatchUnconfirmed
/// per accepted Submit.
class CompletionSink {
 public:
  virtual ~CompletionSink() = default;
  virtual void OnBatchComplete(std::uint64_t token, Status status) = 0;
  /// Instead of OnBatchComplete: a WRITE batch the transport ended without confirming that its
  /// writes completed at the peer (its connection was closed with them in flight: a peer that
  /// stopped answering, at DisconnectPeer or destruction), so bytes of it may still land there
  /// later, while the peer is not proven dead. The backend is done with the batch's memory. By
  /// default, completed as OnBatchComplete would (for sinks that do not track the peer's
  /// memory).
  virtual void OnBatchUnconfirmed(std::uint64_t token, Status status) {
    OnBatchComplete(token, std::move(status));
  }
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
  /// Whether batches from GPU memory may carry Batch::device_wait_event (AcceptsDeviceWaits
  /// says for which region pairs).
  bool device_event_wait = false;
};

/// String options from the engine config (connector extra config), e.g. {"ucx_tls": "sm,self"}.
///
/// One map may be shared by every backend (the connector's "auto" choice passes ucx_* and mori_*
/// keys together), so keys have owners: a key starting with "<backend>_" ("loopback_", "ucx_",
/// "mori_") belongs to that backend, and the unprefixed keys in kSharedBackendOptionKeys belong
/// to whichever backends list them (their names follow vLLM's MoRIIO connector). CreateBackend
/// refuses, with InvalidArgument naming the key and the keys the backend accepts, any key the
/// backend does not accept unless it belongs to another backend: a misspelt "ucx_tsl" is an
/// error for the ucx backend (and ignored by the others, as "mori_port" is ignored by ucx), an
/// unprefixed key no backend lists (a misspelt "qp_per_transfr") is an error for every backend.
using BackendOptions = std::map<std::string, std::string, std::less<>>;

/// The unprefixed option keys a backend may accept (see BackendOptions). A plugin lists only
/// keys with its own prefix or from this list.
inline constexpr std::string_view kSharedBackendOptionKeys[] = {
    "progress_mode", "qp_per_transfer", "post_batch_size", "num_workers", "poll_mode"};

/// A transport. Thread-safe: every method may be called from any thread. Methods that talk to
/// the transport may block briefly (registration, connection); Submit never waits for transfer.
///
/// The contract every backend keeps (tests/cpp/backend_contract_test.cpp runs it over each):
/// - Submit either refuses a batch synchronously (an error, no completion, nothing started,
///   nothing changed) or accepts it; an accepted batch gets exactly one OnBatchComplete, always
///   from a backend thread (never inside Submit, so a caller may hold its own locks).
/// - A batch is refused at Submit when its three arrays differ in length (InvalidArgument),
///   when a run has a negative offset or a size <= 0 (InvalidArgument naming the run index),
///   when a run does not lie inside its local or remote region, overflowing offsets included
///   (OutOfRange naming the run index), or when its local region, remote region or peer is
///   unknown or the remote region belongs to another peer. A bad run is never discovered later
///   through the completion.
/// - A batch with no runs is accepted and completes OK without moving bytes. The engine builds
///   such batches for a READ of zero blocks and for layers whose plan is empty; refusing them
///   would fail a valid no-op request, and completing them like any other batch keeps "one
///   completion per accepted Submit" without special cases in the caller.
/// - A region has batches in flight from its accepted Submit until the backend is done with its
///   memory, which is before that batch's OnBatchComplete is called: a caller that saw the
///   completion may deregister at once. DeregisterMemory refuses (FailedPrecondition) while any
///   batch using the region is in flight and changes nothing then.
/// - DisconnectPeer drops the peer and its imported regions at once: Submit to them is refused
///   from then on, and every batch to that peer not yet finished by the transport completes
///   exactly once with an error (Aborted or Transport, naming the peer), possibly after
///   DisconnectPeer returned (UCX: once the transport ended what it had posted, at most a few
///   seconds later for a peer that stopped answering; DisconnectPeer itself does not wait, and
///   the local regions of those batches can be deregistered once they completed). A batch the
///   transport had already finished completes OK. A WRITE batch whose writes the transport could
///   not confirm before the connection closed completes through OnBatchUnconfirmed: it no longer
///   uses the local memory, but the peer's may still change (the backend contract that a
///   completed batch writes no more holds only for OnBatchComplete).
/// - Cell batches (Batch::cells) are an optional capability, asked per region pair and geometry
///   with AcceptsCells before any is built; the engine plans runs wherever the answer is no
///   (loopback takes cells between host regions; UCX only on its CUDA IPC direct path with the
///   CUDA copy plugin loaded; MoRI never). A backend refuses, at Submit, a cell batch it did
///   not accept (FailedPrecondition), one that also carries runs or an invalid geometry
///   (InvalidArgument), and one with a block whose cells leave its region (OutOfRange naming the
///   block index). An accepted cell batch keeps every rule above (one completion, in flight
///   until then, disconnect); one with no blocks completes OK without moving bytes.
/// - Stamped batches (Batch::stamps) likewise, asked per region pair with AcceptsStamps (loopback
///   with its option loopback_stamps; UCX only on its CUDA IPC direct path with the CUDA copy
///   plugin loaded, unless ucx_stamps is off; MoRI never). A backend refuses, at Submit, a
///   stamped batch it did not accept (FailedPrecondition), one that also carries runs or cells or
///   whose layers name runs or ids it does not have (InvalidArgument naming the layer), and one
///   with a run that leaves its region (OutOfRange naming the layer). It moves exactly the runs
///   StampedLayer describes, with every rule above; one with no runs completes OK.
/// - Options: see BackendOptions; each backend reports the keys it accepts (BackendOptionKeys).
class Backend {
 public:
  virtual ~Backend() = default;
  virtual std::string_view name() const = 0;
  virtual BackendCapabilities capabilities() const = 0;
  /// The bytes a peer passes to ConnectPeer to reach this backend (a worker address, ...).
  virtual Result<std::vector<std::uint8_t>> LocalAddress() = 0;
  virtual Result<RegisteredRegion> RegisterMemory(const MemoryRange& range) = 0;
  /// Fails with FailedPrecondition while batches using the region are in flight (see above).
  virtual Status DeregisterMemory(std::uint64_t handle) = 0;
  virtual Result<std::uint64_t> ConnectPeer(std::span<const std::uint8_t> address) = 0;
  /// The engine id this backend serves (the engine calls it once, before registering memory).
  /// A backend that checks remote ranges with their owner (UCX: its region checks and the table
  /// of registered regions a process publishes) vouches only for ranges of this engine.
  /// Default: nothing to record.
  virtual void SetOwner(std::string_view engine_id);
  /// The engine id a peer's metadata claims (the engine calls it after ConnectPeer, before
  /// importing): such a backend then moves bytes of that peer's ranges only once the process
  /// behind the address vouched for them as that engine's, so metadata naming one engine and
  /// another's address reaches nothing. NotFound for an unknown peer. Default: OK, no check.
  virtual Status ExpectPeerOwner(std::uint64_t peer, std::string_view engine_id);
  /// Whether the transport reported the connection to a peer broken, so that every batch to it
  /// fails from then on: the engine then reconnects such a peer when the same metadata is handed
  /// to it again (a handshake after the failure), instead of keeping the broken connection.
  /// False for an unknown peer. Default: false (a backend whose connections never break).
  virtual bool PeerFailed(std::uint64_t peer);
  /// Makes a peer's region addressable; `range` is where it lives in the peer's address space.
  virtual Result<std::uint64_t> ImportRemoteRegion(std::uint64_t peer, const MemoryRange& range,
                                                   std::span<const std::uint8_t> remote_key) = 0;
  /// Drops a peer and everything imported from it; pending batches to it complete with errors
  /// (see above). NotFound for an unknown peer.
  virtual Status DisconnectPeer(std::uint64_t peer) = 0;
  /// Starts a batch. On OK, exactly one completion follows; on error, none (see above).
  virtual Status Submit(std::shared_ptr<const Batch> batch) = 0;
  /// Whether Submit takes cell batches of `geometry` between local region `local_region`
  /// (RegisteredRegion::handle) and imported region `remote_region` (see the contract above).
  /// The answer for a pair stays the same while both stay registered and imported, so a caller
  /// asks once per pair. False for unknown handles. Thread-safe, non-blocking, no transfer.
  /// Default: false (runs only).
  virtual bool AcceptsCells(std::uint64_t local_region, std::uint64_t remote_region,
                            const CellGeometry& geometry) const;
  /// Whether Submit takes stamped batches between local region `local_region` and imported
  /// region `remote_region` (see the contract above); the answer stays the same while both stay
  /// registered and imported. False for unknown handles. Thread-safe, non-blocking, no
  /// transfer. Default: false (runs only).
  virtual bool AcceptsStamps(std::uint64_t local_region, std::uint64_t remote_region) const;
  /// Whether Submit honours Batch::device_wait_event between local region `local_region` and
  /// imported region `remote_region` (the copy starts only after the event's work, without the
  /// caller waiting); a batch carrying one fails otherwise. The answer stays the same while both
  /// stay registered and imported. False for unknown handles. Thread-safe, non-blocking, no
  /// transfer. Default: false.
  virtual bool AcceptsDeviceWaits(std::uint64_t local_region, std::uint64_t remote_region) const;
  /// A hint that Submit calls follow shortly (the engine has started planning a request): a
  /// backend whose progress thread sleeps when idle may wake it now, so that the wake-up
  /// overlaps the planning instead of delaying the first batch. Moves nothing and changes no
  /// state a caller can see; thread-safe, non-blocking. Default: does nothing.
  virtual void ExpectSubmits();

  /// Allocates `size` bytes the transport reaches fastest (e.g. shared memory that same-host
  /// peers map directly), page aligned. The memory stays valid until Free or the backend's
  /// destruction. Default: FailedPrecondition (capabilities().allocation is false).
  virtual Result<MemoryRange> Allocate(std::uint64_t size, MemoryKind kind, int device);
  /// Frees memory from Allocate; FailedPrecondition while it is registered.
  virtual Status Free(const MemoryRange& range);
};

/// Checks a batch's runs against the sizes of its local and remote regions, as Submit must
/// (see Backend): InvalidArgument or OutOfRange naming the batch token and the run index;
/// FailedPrecondition for a cell batch (a backend that takes cells checks those with
/// CheckBatchCells instead). Pure.
Status CheckBatchRuns(const Batch& batch, std::uint64_t local_size, std::uint64_t remote_size);

/// Checks a cell batch as Submit must (see Backend): InvalidArgument (naming the batch token)
/// when it has no cell part, also carries runs, has a geometry with a count or cell size < 1 or
/// block arrays of different lengths; OutOfRange naming the block index when a block's cells do
/// not lie inside the local or remote region, overflowing offsets included. Pure.
Status CheckBatchCells(const Batch& batch, std::uint64_t local_size, std::uint64_t remote_size);

/// Checks a stamped batch as Submit must (see Backend): InvalidArgument (naming the batch token
/// and, where one is at fault, the layer or run index) when it has no stamped part, also carries
/// runs or cells, has id arrays of different lengths, more than kMaxStampLayers layers (or
/// kMaxStampRunsPerLayer times as many runs), a run
/// (used or not) with a negative offset or a size < 1, a layer whose runs or ids lie outside the
/// batch's arrays, more than kMaxStampRunsPerLayer runs, a negative base, stride or id;
/// OutOfRange naming the layer when one of its runs does not lie inside the local or remote
/// region, overflowing offsets included. Pure; O(runs + layers x runs per layer + ids) when
/// consecutive layers share their block range (a request's layers do).
Status CheckBatchStamps(const Batch& batch, std::uint64_t local_size, std::uint64_t remote_size);

/// Entry points of a backend plugin library `libmoriio_native_<name>.so`, which exports
/// `extern "C" const moriio_native::BackendPlugin* moriio_native_backend_plugin();`.
/// ABI 2 added `options`, ABI 3 Backend::AcceptsStamps and Batch::stamps (the Backend vtable
/// and Batch changed); a plugin of another ABI is reported unavailable.
struct BackendPlugin {
  static constexpr std::uint32_t kAbiVersion = 3;
  std::uint32_t abi_version = kAbiVersion;
  const char* name = nullptr;
  /// OK when the transport can run here; otherwise BackendUnavailable with the precise reason.
  Status (*probe)(const BackendOptions& options) = nullptr;
  Result<std::unique_ptr<Backend>> (*create)(const BackendOptions& options,
                                             std::shared_ptr<CompletionSink> sink) = nullptr;
  /// Every option key the backend accepts, ending with nullptr; static storage. Only keys with
  /// the prefix "<name>_" or from kSharedBackendOptionKeys (else the plugin is refused).
  const char* const* options = nullptr;
};

/// Availability of one backend on this machine.
struct BackendAvailability {
  std::string name;
  bool available = false;
  std::string reason;  ///< why not, when unavailable
};

/// Probes every known backend (loopback, ucx, mori). Thread-safe; loads plugins on first use.
std::vector<BackendAvailability> AvailableBackends(const BackendOptions& options = {});

/// The option keys backend `name` accepts, sorted: NotFound for an unknown name,
/// BackendUnavailable when its plugin cannot be loaded. Thread-safe; loads the plugin once.
Result<std::vector<std::string>> BackendOptionKeys(std::string_view name);

/// Creates a backend by name. BackendUnavailable carries the plugin's reason; NotFound for an
/// unknown name; InvalidArgument for an option key the backend refuses (see BackendOptions),
/// checked before the plugin probes anything.
Result<std::unique_ptr<Backend>> CreateBackend(std::string_view name, const BackendOptions& options,
                                               std::shared_ptr<CompletionSink> sink);

}  // namespace moriio_native

#define MORIIO_NATIVE_PLUGIN_SYMBOL "moriio_native_backend_plugin"
