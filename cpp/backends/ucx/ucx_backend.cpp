#include "ucx_backend.hpp"

#include <pthread.h>
#include <sched.h>
#include <sys/epoll.h>
#include <sys/eventfd.h>
#include <sys/random.h>
#include <sys/uio.h>
#include <unistd.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <cerrno>
#include <chrono>
#include <climits>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <functional>
#include <future>
#include <limits>
#include <list>
#include <map>
#include <mutex>
#include <random>
#include <string>
#include <string_view>
#include <thread>
#include <unordered_map>
#include <utility>
#include <vector>

#include "cudacopy_abi.h"
#include "dynamic_library.hpp"
#include "event_poll.hpp"
#include "moriio_native/trace_marks.hpp"
#include "ucx_api.hpp"
#include "ucx_options.hpp"
#include "ucx_wire.hpp"

namespace moriio_native::detail::ucx {
namespace {

using Clock = std::chrono::steady_clock;

// UCX keeps a request per operation in flight; beyond a few hundred more requests only cost
// memory: the cost per operation is host CPU (about 7 us per cuda_ipc op with UCX 1.22 on an
// H200), which a deeper window does not hide.
constexpr std::size_t kMaxOutstandingOps = 512;
// Runs posted per batch before moving to the next batch, so one huge batch cannot starve others.
constexpr std::size_t kOpsPerBatchPerRound = 64;
// Bytes copied by the direct (rkey_ptr) path per loop iteration, so commands and UCX progress
// still get the thread every millisecond or so.
constexpr std::uint64_t kDirectCopyBudget = 8ull << 20;
// Unfinished CUDA copies PollCudaCopies queries per pass, oldest first (one per plugin stream).
constexpr int kCudaPollAhead = 2;
// How often PollDeviceWaits asks about the events parked batches wait for: short against a
// layer's compute, long against a query (about a microsecond).
constexpr auto kDeviceWaitPollInterval = std::chrono::microseconds(20);
// How long the thread keeps spinning after an ExpectSubmits hint while no batch has arrived: the
// engine plans a request's first piece in tens of microseconds, and a thread asleep on this VM
// took 0.15-0.28 ms to wake (measured on the engine's event wait, docs/benchmarks.md), which the
// first batch would otherwise wait for.
constexpr auto kExpectSpin = std::chrono::microseconds(500);
// How long the thread keeps spinning after the last activity before it sleeps on the event fd.
constexpr auto kSpinBeforeSleep = std::chrono::microseconds(50);
// How long teardown (destructor, a peer DisconnectPeer dropped) waits for operations already
// posted to finish before it force-closes the endpoint, which cancels them.
constexpr auto kDrainDeadline = std::chrono::seconds(5);
// How long teardown then waits for UCX to report the operations the forced close cancelled.
constexpr auto kCancelDeadline = std::chrono::seconds(1);
// How often the progress thread checks that a same-host peer without UCX peer-failure detection
// still exists while operations to it are in flight (one process_vm_readv per such peer).
constexpr auto kLivenessInterval = std::chrono::milliseconds(100);
// Liveness checks (kLivenessInterval apart, the progress thread running between them) after a
// same-host peer's death before a READ whose gets UCX still holds completes: time for the
// progress thread to store the replies the peer queued before it died (CheckPeersAlive).
constexpr int kLandingGracePasses = 10;
// How often it checks the same-host peers nothing is in flight to: one that died still holds
// its shared-memory segments and the GPU memory its endpoint mapped (CUDA IPC) in this process
// until its endpoint closes, and a restarted peer on the same GPU would find that memory taken.
constexpr auto kIdleLivenessInterval = std::chrono::seconds(1);

// ---- Push READ ----------------------------------------------------------------------------------
// Over transports without a one-sided get (tcp, ud), UCX serves a ucp_get_nbx in software: the
// target's UCX answers each get with a reply request it creates inside ucp_worker_progress, and
// UCX 1.22 aborts the target process when that reply's send fails because the reader died
// meanwhile (ucp_request_try_send: "unexpected error"). No request of the target's backend is
// involved, so nothing could catch it. Such READs are therefore served by the target itself:
//   reader -> target  kAmPushRequest: the batch's id, the reader's address and the runs, as
//                     offsets into the target range the reader imported (EncodePushRequest);
//   target -> reader  kAmPushData: the runs' bytes, in run order, as one stream cut in chunks;
//                     kAmPushAnswer: done (with the stream's length) or failed (with the reason).
// The target checks the range against its own registered host regions and every run against the
// range, and answers a request that names anything else as failed, sending nothing of it. It
// sends through an endpoint of its own (peer-failure detection on), so a dead reader fails the
// target's own send requests, which it drops: no abort. The reader writes its local memory
// itself, in its data handler, and only while the batch is active: once the batch completed
// (done, failed, peer death, disconnect), late chunks are dropped, so nothing lands after a
// terminal state. The target never writes the reader's memory, so a stranger's request cannot
// make it write anywhere; all it can read is memory the target registered (as a get could).
// A request of no runs flagged kPushFlagRegionCheck asks only whether the target registered the
// range (of the kind it names, for the engine it names, with the key it carries): a reader sends
// it before the first batch on an imported region on every path but batched cma
// (RegionConfirmed; StartOnPath says why).
// All messages are eager: a rendezvous would make the receiving UCX fetch the payload with a get.
constexpr unsigned kAmPushRequest = 0x6d01;
constexpr unsigned kAmPushData = 0x6d02;
constexpr unsigned kAmPushAnswer = 0x6d03;
// Bytes per data message: one tcp segment (UCX_TCP_TX_SEG_SIZE, 8 KiB by default, less the
// headers), so that UCX sends each as one fragment. A message of several fragments is dropped by
// the reader's UCX unless the endpoint the target's endpoint is paired with still exists (UCX
// pairs the n-th endpoint one worker creates to another with the other's n-th; a reader that
// closed and reopened its endpoint leaves the pairing stale). Then messages in flight per
// request, and over all requests (at most 8 MiB of send buffers however many readers ask).
constexpr std::uint64_t kPushChunk = 7u << 10;
constexpr std::size_t kPushChunksInFlight = 64;
constexpr std::size_t kMaxPushSends = 1024;
// A target holds at most ucx_push_queue requests (waiting to start or being served) and this
// many bytes of them; a request beyond either is not kept but answered "failed" (busy), so a
// flood costs bounded memory and its readers end at the answer, not at their deadlines.
constexpr std::size_t kMaxHeldPushBytes = std::size_t{64} << 20;
// Those refusals waiting for their answer, at most (count and reply-address bytes): an answer
// is one small message per request, never more, and smaller than the request it answers, so
// refusing cannot amplify a flood; beyond these bounds a request is dropped unanswered.
constexpr std::size_t kMaxPushRefusals = 1024;
constexpr std::size_t kMaxPushRefusalBytes = std::size_t{4} << 20;
// The longest failure reason a reader keeps from a target's answer.
constexpr std::size_t kMaxPushReason = 1024;

ucs_memory_type_t ToUcs(MemoryKind kind) {
  switch (kind) {
    case MemoryKind::kHost: return UCS_MEMORY_TYPE_HOST;
    case MemoryKind::kCuda: return UCS_MEMORY_TYPE_CUDA;
    case MemoryKind::kRocm: return UCS_MEMORY_TYPE_ROCM;
  }
  return UCS_MEMORY_TYPE_UNKNOWN;
}

const char* KindName(MemoryKind kind) {
  switch (kind) {
    case MemoryKind::kHost: return "host";
    case MemoryKind::kCuda: return "cuda";
    case MemoryKind::kRocm: return "rocm";
  }
  return "unknown";
}

std::string Hex(std::uint64_t v) {
  char buf[32];
  std::snprintf(buf, sizeof(buf), "0x%llx", static_cast<unsigned long long>(v));
  return buf;
}

std::string RangeText(const MemoryRange& r) {
  return std::string(KindName(r.kind)) + " [" + Hex(r.address) + ", +" + std::to_string(r.size) +
         ")";
}

/// Whether process_vm_readv works in this process at all. A seccomp profile (docker's default)
/// or a missing CAP_SYS_PTRACE refuses it even on our own pid, and then UCX's cma transport fails
/// every operation instead of stepping aside. (Yama's ptrace_scope UCX checks by itself.)
bool CmaUsable() {
  char src[16] = "moriio-cma-test";
  char dst[16] = {};
  iovec local{dst, sizeof(dst)};
  iovec remote{src, sizeof(src)};
  return ::process_vm_readv(::getpid(), &local, 1, &remote, 1, 0) ==
         static_cast<ssize_t>(sizeof(src));
}

/// Whether `tls` (UCX_TLS syntax) is an explicit list naming no transport that reaches a peer on
/// this host through memory or the kernel's process-to-process calls. An empty list (UCX's
/// default), an exclusion list ("^...") or "all" can select shared memory and cma.
bool TlsExcludeSharedMemory(const std::string& tls) {
  if (tls.empty() || tls[0] == '^') return false;
  static constexpr const char* kShared[] = {"all",  "sm",   "shm",      "posix",    "sysv",
                                            "cma",  "knem", "xpmem",    "cuda_ipc", "rocm_ipc",
                                            "cuda", "rocm", "gdr_copy"};
  std::size_t begin = 0;
  while (begin <= tls.size()) {
    std::size_t end = tls.find(',', begin);
    if (end == std::string::npos) end = tls.size();
    std::string name = tls.substr(begin, end - begin);
    // A trailing ":aux" (UCX's auxiliary-transport marker) names the same transport.
    if (const std::size_t colon = name.find(':'); colon != std::string::npos) name.resize(colon);
    for (const char* shared : kShared) {
      if (name == shared) return false;
    }
    begin = end + 1;
  }
  return true;
}

bool CudaDriverPresent() {
  return DynamicLibrary::Open("libcuda.so.1", RTLD_LAZY | RTLD_LOCAL).ok();
}

/// Makes device `device`'s primary CUDA context current on the calling thread (the progress
/// thread), through the driver API loaded at runtime. UCX's CUDA transports register, map
/// (cuda_ipc) and query device memory in the caller's current context; a thread that never
/// touched CUDA has none. Returns "" or why it failed. The context is retained for the process.
std::string BindCudaDevice(int device) {
  using CUresult = int;
  struct Driver {
    CUresult (*init)(unsigned) = nullptr;
    CUresult (*device_get)(int*, int) = nullptr;
    CUresult (*retain)(void**, int) = nullptr;
    CUresult (*set_current)(void*) = nullptr;
    bool ok = false;
  };
  static const Driver driver = [] {
    Driver d;
    Result<DynamicLibrary> lib = DynamicLibrary::Open("libcuda.so.1");
    if (!lib.ok()) return d;
    lib->KeepLoaded();  // the retained contexts live for the process
    auto init = lib->Symbol<decltype(d.init)>("cuInit");
    auto device_get = lib->Symbol<decltype(d.device_get)>("cuDeviceGet");
    auto retain = lib->Symbol<decltype(d.retain)>("cuDevicePrimaryCtxRetain");
    auto set_current = lib->Symbol<decltype(d.set_current)>("cuCtxSetCurrent");
    if (!init.ok() || !device_get.ok() || !retain.ok() || !set_current.ok()) return d;
    d.init = *init;
    d.device_get = *device_get;
    d.retain = *retain;
    d.set_current = *set_current;
    d.ok = d.init(0) == 0;
    return d;
  }();
  if (!driver.ok) return "no usable CUDA driver (libcuda.so.1)";
  thread_local int bound = -1;
  if (bound == device) return "";
  int dev = 0;
  void* ctx = nullptr;
  if (driver.device_get(&dev, device) != 0 || driver.retain(&ctx, dev) != 0 ||
      driver.set_current(ctx) != 0) {
    return "cannot make the primary context of CUDA device " + std::to_string(device) + " current";
  }
  bound = device;
  return "";
}

/// The CUDA gather/scatter plugin, loaded from the directory of this plugin on first need.
struct CudaCopy {
  const moriio_cudacopy_api* api = nullptr;
  std::string why_not;  // when api is null
};

const CudaCopy& LoadCudaCopy() {
  static const CudaCopy loaded = [] {
    CudaCopy out;
    const std::string file = DynamicLibrary::FileOf(reinterpret_cast<const void*>(&LoadCudaCopy));
    if (file.empty()) {
      out.why_not = "cannot locate the ucx plugin's own directory";
      return out;
    }
    std::string path = DynamicLibrary::DirectoryOf(reinterpret_cast<const void*>(&LoadCudaCopy)) +
                       "/libmoriio_native_cudacopy.so";
    Result<DynamicLibrary> lib = DynamicLibrary::Open(path);
    if (!lib.ok()) {
      out.why_not = lib.status().message();
      return out;
    }
    lib->KeepLoaded();  // its kernels and queues are used until the process exits
    auto entry = lib->Symbol<moriio_cudacopy_entry_fn>(MORIIO_CUDACOPY_SYMBOL);
    const moriio_cudacopy_api* api = entry.ok() ? (*entry)() : nullptr;
    if (api == nullptr || api->abi_version != MORIIO_CUDACOPY_ABI_VERSION) {
      out.why_not = path + " has no compatible " MORIIO_CUDACOPY_SYMBOL;
      return out;
    }
    char err[256] = {};
    if (api->probe(err, sizeof(err)) != 0) {
      out.why_not = std::string("CUDA copy plugin unusable: ") + err;
      return out;
    }
    out.api = api;
    return out;
  }();
  return loaded;
}

std::atomic<std::uint64_t> g_path_batches[kPathCount];
std::atomic<std::uint64_t> g_push_unanswered;

/// Counts a push request the target drops without an answer: too malformed to name its reader,
/// no endpoint to the reader, or beyond the bounds on refusals.
void CountUnansweredPush() { g_push_unanswered.fetch_add(1, std::memory_order_relaxed); }

}  // namespace

void PathCounters(std::uint64_t out[kPathCount]) {
  for (int i = 0; i < kPathCount; ++i) out[i] = g_path_batches[i].load(std::memory_order_relaxed);
}

std::uint64_t UnansweredPushRequests() {
  return g_push_unanswered.load(std::memory_order_relaxed);
}

class UcxBackend;

/// Memory from Allocate (UCP_MEM_MAP_ALLOCATE). Regions registered inside it share its memh, so
/// their rkeys carry the shared-memory segment that same-host peers map with ucp_rkey_ptr.
struct Allocation {
  std::uint64_t address = 0;
  std::uint64_t size = 0;
  ucp_mem_h memh = nullptr;
  int registrations = 0;  // guarded by UcxBackend::mutex_
};

struct LocalRegion {
  std::uint64_t id = 0;
  MemoryRange range;
  ucp_mem_h memh = nullptr;
  std::shared_ptr<Allocation> alloc;  // set: memh belongs to the allocation
  int inflight = 0;                   // batches using it; guarded by UcxBackend::mutex_
  bool deregistered = false;          // worker thread only: push jobs stop reading it
  RegionPublication published;        // for same-host peers' checks, until deregistered
  std::vector<std::uint8_t> key;      // the UCX key packed for it (region checks compare it)
};

/// The process an endpoint reaches, as far as its address says: the host, and on it the pid in
/// its pid namespace (pid 0: not known, which matches nothing).
struct RemoteProcess {
  HostId host{};
  std::uint32_t pid = 0;
  std::uint64_t pidns_dev = 0;
  std::uint64_t pidns_ino = 0;

  static RemoteProcess Of(const WireAddress& wire) {
    return {wire.host, wire.process.pid, wire.process.pidns_dev, wire.process.pidns_ino};
  }
  bool Same(const RemoteProcess& other) const {
    return pid != 0 && pid == other.pid && pidns_dev == other.pidns_dev &&
           pidns_ino == other.pidns_ino && host == other.host;
  }
};

/// An endpoint this backend no longer uses but keeps open while another of its endpoints
/// reaches the same process (UcxBackend::ReleaseEndpoint). Worker thread only.
struct KeptEndpoint {
  ucp_ep_h ep = nullptr;
  bool peer_mode = false;
  RemoteProcess process;
  // The PeerState or PushReader that ep's error handler was created with (its argument): UCX
  // may call that handler for as long as ep is open, so its argument lives until ep is closed.
  std::shared_ptr<const void> handler_arg;
};

struct PeerState : std::enable_shared_from_this<PeerState> {
  std::uint64_t id = 0;
  UcxBackend* owner = nullptr;
  ucp_ep_h ep = nullptr;           // worker thread only
  std::atomic<bool> closed{false};  // DisconnectPeer started: no new batches
  bool failed = false;              // worker thread only
  bool exited = false;  // worker thread only: its process is proven gone (ProvenExited)
  bool failure_reported = false;    // worker thread only
  Status failure;                   // worker thread only
  // Set when ConnectPeer proved the peer is a process of this host and pid namespace (see
  // ProcessIdentity): host memory then moves by batched process_vm_readv/writev.
  ProcessIdentity cma_identity;  // pid 0: not proven
  // Set when ConnectPeer proved the peer a process of this host: its exit can then be proven
  // (ProvenExited). Without UCX peer-failure detection on its endpoint (peer_mode false) the
  // progress thread also watches for it (CheckPeersAlive, ReleaseDeadIdlePeers).
  ProcessIdentity identity;  // pid 0: not proven
  // READs of host memory from this peer take the push path (ConnectPeer decides, once).
  bool push = false;
  // Its backend answers region checks (it serves push requests) and this one can hear them.
  bool checks_regions = false;
  // Who its regions must be registered by: the backend instance its address names (ConnectPeer)
  // and the engine id its metadata claims (ExpectPeerOwner; "" before: any engine). Worker
  // thread only.
  RegionOwner registrant;
  bool peer_mode = false;  // ep has UCX peer-failure detection (push requests say so)
  RemoteProcess process;   // what ep reaches
  bool same_host = false;  // its address names this host (ConnectPeer)
};

struct RemoteRegion {
  std::uint64_t id = 0;
  std::shared_ptr<PeerState> peer;
  MemoryRange range;
  ucp_rkey_h rkey = nullptr;      // worker thread only after import
  std::vector<std::uint8_t> key;  // the UCX key bytes it was imported with (region checks)
  std::uint8_t* direct = nullptr;  // ucp_rkey_ptr mapping of range.address, when available
  // Whether its owner confirmed that it registered `range` for the engine the metadata names
  // (kPushFlagRegionCheck). Every path but batched cma moves bytes only of a confirmed range
  // (StartOnPath says why). Worker thread only.
  enum class Check : std::uint8_t { kUnchecked, kRunning, kConfirmed };
  Check check = Check::kUnchecked;
  // Batched cma: the sequence of the peer's published table when this range was last found
  // held there (CheckPublishedRegion). Worker thread only.
  std::uint64_t published_seq = kNeverHeld;
  Status released;  // guarded by mutex_: why its rkey and mapping went while imported (not OK)
};

enum class Path : std::uint8_t { kOps, kHostCopy, kCudaCopy, kCma, kPush };

/// The largest cell the CUDA copy plugin's cell kernel takes (cudacopy_abi.h).
constexpr std::int64_t kMaxCudaCellBytes = 16384;

/// Whether cell batches of `g` between these regions run on the CUDA copy path, the only one
/// with a transposing copy: both ends CUDA memory, the remote one mapped into this process, the
/// plugin loaded, and a geometry in its ranges. Fixed for the pair's lifetime (the kinds and
/// the mapping are set at registration and import).
/// Whether batches between these regions run on the CUDA copy path: both ends CUDA memory, the
/// peer's mapped into this process (ucp_rkey_ptr: CUDA IPC on one node), the plugin loaded. The
/// only path with kernels for cells and stamps, and the only one that can wait for a CUDA event
/// on the GPU.
bool CopiesOnGpu(const LocalRegion& local, const RemoteRegion& remote) {
  return remote.direct != nullptr && local.range.kind == MemoryKind::kCuda &&
         remote.range.kind == MemoryKind::kCuda && LoadCudaCopy().api != nullptr;
}

/// Whether batches from this region may carry a CUDA event (Batch::device_wait_event): on the
/// CUDA copy path the kernel waits for it on the GPU; on every other path a CUDA region takes
/// (UCX operations: RDMA to another node, or ucx_direct_copy off) the progress thread asks the
/// plugin whether the event completed and posts the batch's first run only then, so the caller
/// never waits for it. Host regions take no event: no producer of theirs records one.
bool TakesDeviceWaits(const LocalRegion& local) {
  return local.range.kind == MemoryKind::kCuda && LoadCudaCopy().api != nullptr;
}

bool TakesCells(const LocalRegion& local, const RemoteRegion& remote, const CellGeometry& g) {
  constexpr std::int64_t kMax32 = std::numeric_limits<std::uint32_t>::max();
  return CopiesOnGpu(local, remote) && (g.planes == 1 || g.planes == 2) && g.heads >= 1 &&
         g.heads <= kMax32 &&
         g.tokens >= 1 && g.tokens <= kMax32 && g.cell_bytes >= 1 &&
         g.cell_bytes <= kMaxCudaCellBytes;
}

/// Whether stamped batches between these regions run on the CUDA copy path, the only one with a
/// stamping kernel (the same conditions as cells, unless ucx_stamps is off).
bool TakesStamps(const LocalRegion& local, const RemoteRegion& remote, bool enabled) {
  return enabled && CopiesOnGpu(local, remote);
}

/// A peer DisconnectPeer dropped while operations of its batches were posted: those read or write
/// through its imports' rkeys, so the endpoint and the rkeys stay until the operations end, or
/// until `deadline`, when closing the endpoint cancels them. The progress loop keeps serving
/// every other peer meanwhile (FinishDrains). Worker thread only.
struct DrainingPeer {
  std::shared_ptr<PeerState> peer;
  std::vector<std::shared_ptr<RemoteRegion>> imports;
  std::chrono::steady_clock::time_point deadline;
};

/// A submitted batch while the worker thread drives it. Worker thread only.
struct ActiveBatch {
  UcxBackend* owner = nullptr;
  std::shared_ptr<const Batch> batch;
  std::shared_ptr<LocalRegion> local;
  std::shared_ptr<RemoteRegion> remote;
  Path path = Path::kOps;
  std::size_t next_run = 0;     // first run not yet posted / copied
  std::size_t outstanding = 0;  // UCX requests (ops + flush) not yet completed
  bool needs_flush = false;     // WRITE over UCX ops: remote completion needs an ep flush
  bool flush_posted = false;
  bool flush_confirmed = false;  // that flush completed OK: every put posted before it landed
  bool puts_posted = false;      // a put of it was accepted by UCX (it may reach the peer)
  void* cuda_op = nullptr;
  // Path::kOps: the CUDA event (Batch::device_wait_event) this batch posts nothing before; 0 once
  // it completed (PollDeviceWaits) or when there is none.
  std::uint64_t awaited_event = 0;
  // Path::kCma: the peer's cookie was read again for this batch, and its published regions hold
  // the remote region.
  bool cma_checked = false;
  // Before its path starts, while its remote region is not confirmed: the batch runs the region
  // check (a push request of no runs, on Path::kPush), or waits for another batch's (parked).
  bool checking = false;
  bool parked = false;
  // Its own check, or the one it parked behind, confirmed its region: its path may start even
  // where each batch needs a check of its own (ChecksEachBatch).
  bool region_confirmed = false;
  // When it started waiting for its region's check, its own or another batch's (the epoch: not
  // yet). Its wait ends ucx_region_check_timeout_ms after this (RegionWaitEnd), whichever batch
  // checks: its own check fails then, and one parked behind a check that got no answer in
  // time checks again itself until then.
  std::chrono::steady_clock::time_point region_wait_since{};
  bool stop = false;  // post nothing more (error, disconnect, shutdown)
  // Completed to the sink while UCX still holds `outstanding` requests of it (a dead peer
  // without peer-failure detection): kept only so their callbacks find it.
  bool abandoned = false;
  // Liveness checks that found its peer dead while UCX held gets of it (CheckPeersAlive).
  int checks_since_death = 0;
  Status error;
  // Path::kPush: the id the target's messages carry, the stream offset where each run starts,
  // the stream's length, the bytes copied in so far, whether the target said done, and the
  // request message (UCX may send from it until its request completes).
  PushId push_id;
  std::vector<std::uint64_t> push_starts;
  std::uint64_t push_total = 0;
  std::uint64_t push_received = 0;
  bool push_done = false;
  std::vector<std::uint8_t> push_request;

  std::size_t runs() const { return batch->sizes.size(); }
  bool Finished() const {
    if (outstanding != 0 || cuda_op != nullptr) return false;
    if (stop) return true;
    if (checking || parked) return false;  // its own path has not started
    if (path == Path::kPush) return push_done && push_received == push_total;
    return next_run == runs() && (!needs_flush || flush_posted);
  }
  /// Fails the batch with `error` unless it already failed; it posts nothing more.
  void Fail(Status why) {
    stop = true;
    if (error.ok()) error = std::move(why);
  }
};

/// The flags every push request of `ab` carries: the reader endpoint's error handling mode.
std::uint64_t PushFlags(const ActiveBatch& ab) {
  return ab.remote->peer->peer_mode ? kPushFlagPeerErrorHandling : 0;
}

/// What a push request of `ab` is, for errors: its push READ or its region check.
std::string PushWhat(const ActiveBatch& ab) {
  if (ab.checking) {
    return "check that peer " + std::to_string(ab.batch->peer) + " registered remote region " +
           std::to_string(ab.remote->id) + " " + RangeText(ab.remote->range) + " (batch " +
           std::to_string(ab.batch->token) + ")";
  }
  return "push READ of batch " + std::to_string(ab.batch->token) + " from peer " +
         std::to_string(ab.batch->peer);
}

/// A target's own endpoint to a reader that asked for push READs, keyed by the reader's address.
/// Worker thread only.
struct PushReader : std::enable_shared_from_this<PushReader> {
  UcxBackend* owner = nullptr;
  ucp_ep_h ep = nullptr;
  bool failed = false;     // UCX reported the endpoint failed: send nothing more, close it
  bool peer_mode = false;  // ep has UCX peer-failure detection
  RemoteProcess process;   // what ep reaches
};

/// A request the target did not keep (it holds too many): who to answer, and why. Worker thread
/// only.
struct PushRefusal {
  PushId id;
  std::uint64_t flags = 0;
  std::vector<std::uint8_t> reply_address;
  Status reason;
};

struct PushJob;

/// One data or answer message of a push job while UCX sends it. Worker thread only.
struct PushSend {
  PushJob* job = nullptr;
  std::vector<std::uint8_t> header;
  std::vector<std::uint8_t> payload;
  std::list<PushSend>::iterator self;
};

/// A push READ the target serves: sends the runs' bytes, then the answer. Worker thread only.
struct PushJob {
  PushId id;
  std::shared_ptr<PushReader> reader;
  std::shared_ptr<LocalRegion> region;  // null for a refused request
  std::uint64_t base = 0;               // address of the request's offset 0
  std::vector<std::uint64_t> offsets;
  std::vector<std::uint64_t> sizes;
  std::uint64_t total = 0;
  std::size_t next_run = 0;      // first run not fully gathered
  std::uint64_t run_done = 0;    // bytes of runs[next_run] gathered
  std::uint64_t sent = 0;        // stream bytes handed to UCX
  std::size_t held_bytes = 0;    // of the request, counted in push_held_bytes_
  Status refusal;                // not OK: answer failed with it, send no data
  bool answered = false;         // the answer was handed to UCX
  bool dropped = false;          // the reader is gone: send nothing more
  std::list<PushSend> sends;     // in flight; the job lives until this is empty
};

class UcxBackend final : public Backend {
 public:
  UcxBackend(const UcxApi* api, UcxOptions options, std::shared_ptr<CompletionSink> sink)
      : api_(api), options_(std::move(options)), sink_(std::move(sink)) {}

  Status Init();
  ~UcxBackend() override;

  std::string_view name() const override { return "ucx"; }
  BackendCapabilities capabilities() const override { return caps_; }
  Result<std::vector<std::uint8_t>> LocalAddress() override { return local_address_; }
  Result<RegisteredRegion> RegisterMemory(const MemoryRange& range) override;
  Status DeregisterMemory(std::uint64_t handle) override;
  Result<std::uint64_t> ConnectPeer(std::span<const std::uint8_t> address) override;
  void SetOwner(std::string_view engine_id) override;
  Status ExpectPeerOwner(std::uint64_t peer, std::string_view engine_id) override;
  bool PeerFailed(std::uint64_t peer) override;
  Result<std::uint64_t> ImportRemoteRegion(std::uint64_t peer, const MemoryRange& range,
                                           std::span<const std::uint8_t> remote_key) override;
  Status DisconnectPeer(std::uint64_t peer) override;
  Status Submit(std::shared_ptr<const Batch> batch) override;
  bool AcceptsCells(std::uint64_t local_region, std::uint64_t remote_region,
                    const CellGeometry& geometry) const override;
  bool AcceptsStamps(std::uint64_t local_region, std::uint64_t remote_region) const override;
  bool AcceptsDeviceWaits(std::uint64_t local_region,
                          std::uint64_t remote_region) const override;
  void ExpectSubmits() override;
  Result<MemoryRange> Allocate(std::uint64_t size, MemoryKind kind, int device) override;
  Status Free(const MemoryRange& range) override;

 private:
  struct Pending {
    std::shared_ptr<const Batch> batch;
    std::shared_ptr<LocalRegion> local;
    std::shared_ptr<RemoteRegion> remote;
  };

  // A batch's completion as the sink gets it (unconfirmed: OnBatchUnconfirmed).
  struct Completion {
    std::uint64_t token;
    Status status;
    bool unconfirmed;
  };

  static void OnOpDone(void* request, ucs_status_t status, void* user_data);
  // The ep flush after a WRITE batch's puts: OnOpDone, and the writes confirmed when it is OK.
  static void OnFlushDone(void* request, ucs_status_t status, void* user_data);
  static void OnPeerError(void* arg, ucp_ep_h ep, ucs_status_t status);
  static void OnPushReaderError(void* arg, ucp_ep_h ep, ucs_status_t status);
  static void OnPushSent(void* request, ucs_status_t status, void* user_data);
  static ucs_status_t OnPushRequest(void* arg, const void* header, std::size_t header_length,
                                    void* data, std::size_t length,
                                    const ucp_am_recv_param_t* param);
  static ucs_status_t OnPushData(void* arg, const void* header, std::size_t header_length,
                                 void* data, std::size_t length, const ucp_am_recv_param_t* param);
  static ucs_status_t OnPushAnswer(void* arg, const void* header, std::size_t header_length,
                                   void* data, std::size_t length,
                                   const ucp_am_recv_param_t* param);

  std::string UcsText(ucs_status_t st) const { return api_->status_string(st); }

  /// Runs `fn` on the worker thread (inline when already there) and returns its result. Every
  /// UCX call goes through here or happens in the loop, so the worker runs in
  /// UCS_THREAD_MODE_SINGLE without locks inside UCX.
  template <typename F>
  auto OnWorker(F fn) -> decltype(fn());

  void Wake();
  void Loop();
  bool RunCommands();
  bool ActivateSubmitted();
  // Picks the batch's data path and starts it, or, when that path needs its remote region
  // confirmed first, starts or joins the region check (RegionConfirmed).
  void StartOnPath(ActiveBatch& ab);
  // Whether the remote region of `ab` is confirmed; otherwise parks `ab` behind the check that
  // runs, starts one, or fails `ab` when the peer cannot answer checks.
  bool RegionConfirmed(ActiveBatch& ab);
  // Whether this process can read the table of regions `peer` published (its identity proven,
  // process_vm_readv usable), and so check a range there before each batch.
  bool ReadsPublishedRegions(const PeerState& peer) const;
  // Whether `ab` needs its own region check, not just the first batch's on its region: a direct
  // host copy through UCX's mapping of the owner's allocation, which outlives the owner's
  // registration, its engine and its backend, to a peer whose published table this process
  // cannot read (DirectHostCopies reads it before each batch where it can).
  bool ChecksEachBatch(const ActiveBatch& ab) const;
  // Whether `path` moves bytes of `ab`'s remote region without the owner's worker taking part.
  bool OneSided(const ActiveBatch& ab, Path path) const;
  // The data path of `ab` (PathOf), chosen once its peer, regions and op are known.
  Path PathOf(const ActiveBatch& ab) const;
  // When the wait of `ab` for its region's check ends (a stopped or dead peer without failure
  // detection never answers).
  Clock::time_point RegionWaitEnd(const ActiveBatch& ab) const {
    return ab.region_wait_since + options_.region_check_timeout;
  }
  // Region checks that ended (answered, failed, stopped) or passed their deadline: the
  // region's state follows each (ResolveRegionCheck: the batches parked behind it start on
  // their paths or fail), and the check's own batch starts on its path, fails, or, with its
  // request's send never ended (a dead peer), is abandoned.
  bool EndRegionChecks();
  void ResolveRegionCheck(ActiveBatch& ab);
  // Completes `it` (stopped, UCX still holding requests of it) and keeps it in abandoned_ for
  // their callbacks; returns the batch after it.
  std::list<ActiveBatch>::iterator Abandon(std::list<ActiveBatch>::iterator it,
                                           std::vector<Completion>& done);
  bool IssueOps();
  void PostRun(ActiveBatch& ab);
  void PostFlush(ActiveBatch& ab);
  bool DirectHostCopies();
  bool CmaCopies();
  void CmaCopy(ActiveBatch& ab, std::uint64_t& budget);
  bool PollCudaCopies();
  bool PollDeviceWaits();
  // Whether CUDA event `event` (of a region on `device`) completed; worker thread only.
  static Result<bool> QueryDeviceEvent(std::uint64_t event, int device);
  bool CheckPeersAlive();
  // A WRITE batch whose puts were posted but never confirmed by its flush (a put's own
  // completion only frees our buffer): unless the peer's process is proven gone, bytes of it
  // may still land there, since closing our endpoint cancels only our side (data already in the
  // peer's socket buffer or on the wire is applied when it gets there).
  bool WritesUnconfirmed(const ActiveBatch& ab);
  // A READ batch over UCX operations whose gets UCX still holds (their peer died without UCX's
  // peer-failure detection): replies the peer sent before it died may be queued on this side
  // (a socket buffer, a shared-memory FIFO), and UCX stores them into the local memory when it
  // reads them, whatever became of the peer (see CheckPeersAlive).
  static bool ReadsMayStillLand(const ActiveBatch& ab);
  // Whether `peer`'s process is proven gone: known already, or a proven same-host identity that
  // reads as gone (ProbeProcessIdentity: one system call, made only for unconfirmed writes; a
  // refused read proves nothing, and the question is asked again next time). With UCX's
  // peer-failure detection a killed peer's connection reset fails its batches before any check
  // of ours would run; its memory was torn down before its sockets closed.
  bool ProvenExited(PeerState& peer);
  // Marks `peer`, a same-host peer whose process is gone, failed (reported to the engine by
  // HandlePeerFailures); `circumstance` ends the failure's text.
  void FailExitedPeer(PeerState& peer, std::string_view circumstance);
  // Fails each same-host peer with nothing in flight whose process is gone, and releases its
  // imports and endpoint (the in-flight ones are CheckPeersAlive's).
  bool ReleaseDeadIdlePeers();
  bool HasBatches(const PeerState& peer) const;
  bool HandlePeerFailures();
  // Ends each draining peer whose operations ended or whose deadline passed: its rkeys and its
  // endpoint go (rkeys first, unless the forced close must cancel stuck operations).
  bool FinishDrains();
  // Push READ, reader side: whether READs from the endpoint's peer go by push (ConnectPeer);
  // the request message; the active batch a target's message names (null: none, or ended); the
  // batch leaving the active list.
  bool ReadsByPush(ucp_ep_h ep, const WireAddress& peer) const;
  void StartPush(ActiveBatch& ab);
  // The id of `ab`'s next push request (a READ or a region check), under which the answer finds
  // it; then the sending of that request (kept in `ab` while UCX may send from it).
  PushId NewPushId(ActiveBatch& ab);
  std::uint64_t NextNonce();
  void SendPushRequest(ActiveBatch& ab, std::vector<std::uint8_t> request);
  ActiveBatch* PushRead(std::span<const std::uint8_t> header, std::size_t header_size);
  void ForgetPushRead(const ActiveBatch& ab);
  // Push READ, target side: starts queued requests, sends their chunks and answers, closes the
  // endpoints of readers that failed.
  bool ServePushes();
  void StartPushJob(std::span<const std::uint8_t> message);
  void RefusePush(PushRefusal refusal);
  PushJob* NewPushJob(const PushReplyTo& to);
  std::shared_ptr<PushReader> PushReaderFor(std::span<const std::uint8_t> address,
                                            bool peer_mode);
  bool PumpPushJob(PushJob& job);
  bool PostPushSend(PushJob& job, unsigned id, std::vector<std::uint8_t> header,
                    std::vector<std::uint8_t> payload);
  bool FinishBatches();
  // Hands `done` to the sink (no lock held).
  void Deliver(std::vector<Completion>& done);
  // A WRITE batch stopped before its flush (a disconnect, destruction): its flush is posted
  // anyway, so that a peer that answers confirms its puts within the drain deadline.
  void ConfirmStoppedWrites(ActiveBatch& ab);
  void StartCudaCopy(ActiveBatch& ab);
  // The cell part of StartCudaCopy: one submit_cells for the whole batch.
  void StartCellCopy(ActiveBatch& ab, void* queue, std::uint64_t local, std::uint64_t remote);
  // The stamped part of StartCudaCopy: one submit_stamps for the whole batch.
  void StartStampCopy(ActiveBatch& ab, void* queue, std::uint64_t local, std::uint64_t remote);
  /// Progresses the worker until `done()` or the deadline; true when done() held.
  bool ProgressUntil(const std::function<bool()>& done, Clock::time_point deadline);
  // Takes the endpoint of `holder` (a PeerState or a PushReader) and queues it for
  // CloseReleasedEndpoints: the close waits for the device (below), and the caller
  // (DisconnectPeer, the liveness checks, a failed push reader) must not.
  template <typename Holder>
  void ReleaseEndpoint(Holder& holder) {
    if (holder.ep == nullptr) return;
    released_.push_back({std::exchange(holder.ep, nullptr), holder.peer_mode, holder.process,
                         holder.shared_from_this()});
  }
  // Closes each released endpoint unless another open endpoint of this backend reaches the same
  // process, in which case it stays open (kept_open_) until the last of them is closed.
  bool CloseReleasedEndpoints();
  bool ReachesProcess(const RemoteProcess& process) const;
  // Starts closing `ep`; a close that does not end at once is finished by FinishClosing.
  void CloseEndpoint(ucp_ep_h ep, bool peer_mode);
  bool FinishClosing();
  void Shutdown();

  const UcxApi* api_;
  const UcxOptions options_;
  std::shared_ptr<CompletionSink> sink_;
  BackendCapabilities caps_;
  std::vector<std::uint8_t> local_address_;

  ucp_context_h context_ = nullptr;
  ucp_worker_h worker_ = nullptr;
  bool cma_usable_ = false;  // process_vm_readv works in this process (Init)
  // The transports in use cannot reach a same-host peer through shared memory or cma (Init):
  // nothing but peer-failure detection then ends operations to a same-host peer that died.
  bool network_only_ = false;
  int epoll_fd_ = -1;
  int wake_fd_ = -1;
  bool pass_memh_ = false;

  std::thread thread_;
  std::atomic<std::thread::id> worker_id_{};

  // Registry: what Submit validates against. Mutated on the worker thread, read anywhere.
  mutable std::mutex mutex_;
  std::uint64_t next_id_ = 1;
  std::unordered_map<std::uint64_t, std::shared_ptr<LocalRegion>> regions_;
  std::unordered_map<std::uint64_t, std::shared_ptr<PeerState>> peers_;
  std::unordered_map<std::uint64_t, std::shared_ptr<RemoteRegion>> remotes_;
  std::map<std::uint64_t, std::shared_ptr<Allocation>> allocations_;  // by address

  // Work queues, filled by any thread and drained by the worker.
  std::mutex queue_mutex_;
  std::deque<std::function<void()>> commands_;
  std::deque<Pending> submitted_;
  std::atomic<std::uint64_t> queued_{0};
  bool stopping_ = false;  // guarded by queue_mutex_
  // ExpectSubmits: the loop keeps spinning until this time (steady clock, ns since its epoch).
  std::atomic<std::int64_t> expect_until_ns_{0};
  // Set while the worker waits in epoll_wait, so ExpectSubmits wakes it only then.
  std::atomic<bool> sleeping_{false};

  // Worker thread only.
  std::list<ActiveBatch> active_;
  std::size_t outstanding_ops_ = 0;
  std::vector<std::uint64_t> failed_peers_;
  Clock::time_point next_liveness_check_{};
  Clock::time_point next_idle_liveness_check_{};
  Clock::time_point next_device_wait_poll_{};  // PollDeviceWaits asks nothing before it
  // Batches completed after their peer died with requests UCX will never end (CheckPeersAlive);
  // dropped once those requests do end, else when the worker is destroyed.
  std::list<ActiveBatch> abandoned_;
  // Peers DisconnectPeer dropped while operations of theirs were posted (FinishDrains).
  std::list<DrainingPeer> draining_;
  std::vector<KeptEndpoint> released_;    // ReleaseEndpoint: to close
  std::vector<KeptEndpoint> kept_open_;   // see CloseReleasedEndpoints
  std::vector<ucs_status_ptr_t> closing_;  // endpoint closes still under way
  std::map<int, void*> cuda_queues_;  // device -> cudacopy queue
  int cuda_device_ = 0;               // device of our CUDA registrations (last one registered)

  // Push READ (worker thread only). serves_push_: the AM handlers are installed (Init).
  bool serves_push_ = false;
  // The engine this backend serves (SetOwner): its registrations are published and its region
  // checks answered as that engine's. Worker thread only.
  std::string engine_id_;
  // Drawn at random in Init and carried in our address: our published registrations are this
  // backend's, never those of a backend made before or after it in this process (RegionOwner).
  std::uint64_t instance_ = 0;
  // Counts this backend's push requests; each draws its own nonce (NewPushId) from nonces_,
  // filled from the system's random source when empty (NextNonce).
  std::uint64_t next_push_seq_ = 0;
  std::array<std::uint64_t, 256> nonces_{};
  std::size_t nonces_left_ = 0;
  std::unordered_map<std::uint64_t, ActiveBatch*> push_reads_;  // by seq, reader side
  std::deque<std::vector<std::uint8_t>> push_requests_;       // received, not yet started
  std::size_t push_held_bytes_ = 0;  // of push_requests_ and the jobs started from them
  std::deque<PushRefusal> push_refusals_;  // received, not kept: to answer "failed"
  std::size_t push_refusal_bytes_ = 0;     // their reply addresses
  std::map<std::vector<std::uint8_t>, std::shared_ptr<PushReader>> push_readers_;
  std::list<PushJob> push_jobs_;
  bool push_reader_failed_ = false;  // some PushReader failed: ServePushes closes it
  std::size_t push_sends_ = 0;       // PushSends UCX holds, over every job
};

// ---- construction -----------------------------------------------------------------------------

Status UcxBackend::Init() {
  ucp_config_t* config = nullptr;
  ucs_status_t st = api_->config_read(nullptr, nullptr, &config);
  if (st != UCS_OK) return BackendUnavailableError("ucp_config_read failed: " + UcsText(st));

  // Explicit options override the environment; defaults apply only where nothing was said.
  std::vector<std::pair<std::string, std::string>> settings;
  auto user_set = [&](const std::string& name) {
    if (std::getenv(("UCX_" + name).c_str()) != nullptr) return true;
    for (const auto& [n, v] : options_.config) {
      if (n == name) return true;
    }
    return (name == "TLS" && !options_.tls.empty()) ||
           (name == "NET_DEVICES" && !options_.net_devices.empty());
  };
  cma_usable_ = CmaUsable();
  if (!user_set("TLS") && !cma_usable_) settings.emplace_back("TLS", "^cma");
  if (CudaDriverPresent()) {
    // Without these, ucp_get_nbx from peer GPU memory is software-emulated (~0.8 GB/s) and hangs
    // while the peer does not progress; with emulation off a missing zero-copy path is an error.
    if (!user_set("CUDA_IPC_ENABLE_GET_ZCOPY")) {
      settings.emplace_back("CUDA_IPC_ENABLE_GET_ZCOPY", "y");
    }
    if (!user_set("PROTO_EMULATION_ENABLE")) settings.emplace_back("PROTO_EMULATION_ENABLE", "n");
  }
  // The transport list UCX will use, by the precedence applied below: ucx_config's TLS, then
  // ucx_tls, then the environment (a default "^cma" is an exclusion list: not network only).
  std::string tls = options_.tls;
  if (tls.empty()) {
    if (const char* env = std::getenv("UCX_TLS")) tls = env;
  }
  for (const auto& [n, v] : options_.config) {
    if (n == "TLS") tls = v;
  }
  network_only_ = TlsExcludeSharedMemory(tls);
  const std::size_t first_explicit = settings.size();
  if (!options_.tls.empty()) settings.emplace_back("TLS", options_.tls);
  if (!options_.net_devices.empty()) settings.emplace_back("NET_DEVICES", options_.net_devices);
  for (const auto& kv : options_.config) settings.push_back(kv);
  for (std::size_t i = 0; i < settings.size(); ++i) {
    const auto& [n, v] = settings[i];
    st = api_->config_modify(config, n.c_str(), v.c_str());
    // A default this UCX does not know (older version, module not loaded) is skipped; an explicit
    // setting that UCX rejects is the user's error.
    if (st != UCS_OK && i >= first_explicit) {
      api_->config_release(config);
      return InvalidArgumentError("UCX rejected setting " + n + "=" + v + ": " + UcsText(st));
    }
  }

  ucp_params_t params{};
  params.field_mask = UCP_PARAM_FIELD_FEATURES;
  params.features = UCP_FEATURE_RMA;
  if (api_->has_push()) params.features |= UCP_FEATURE_AM;
  if (options_.progress_mode == ProgressMode::kThread) params.features |= UCP_FEATURE_WAKEUP;
  st = api_->init_version(UCP_API_MAJOR, UCP_API_MINOR, &params, config, &context_);
  api_->config_release(config);
  if (st != UCS_OK) {
    context_ = nullptr;
    return BackendUnavailableError("ucp_init failed (UCX " +
                                   std::string(api_->get_version_string()) + " from " +
                                   api_->library_path + "): " + UcsText(st));
  }

  ucp_context_attr_t attr{};
  attr.field_mask = UCP_ATTR_FIELD_MEMORY_TYPES;
  std::uint64_t mem_types = 1ull << UCS_MEMORY_TYPE_HOST;
  if (api_->context_query(context_, &attr) == UCS_OK) mem_types = attr.memory_types;
  caps_.host_memory = true;
  caps_.cuda_memory = (mem_types & (1ull << UCS_MEMORY_TYPE_CUDA)) != 0;
  caps_.rocm_memory = (mem_types & (1ull << UCS_MEMORY_TYPE_ROCM)) != 0;
  caps_.unaligned_registration = true;
  caps_.allocation = true;
  // Only the CUDA copy plugin's kernel can wait for an event on the device.
  caps_.device_event_wait = caps_.cuda_memory && LoadCudaCopy().api != nullptr;
  // memh in ucp_request_param_t saves a registration-cache lookup per op; UCX 1.15+ honours it.
  pass_memh_ = api_->version() >= ((1u << 16) | (15u << 8));

  ucp_worker_params_t wparams{};
  wparams.field_mask = UCP_WORKER_PARAM_FIELD_THREAD_MODE;
  wparams.thread_mode = UCS_THREAD_MODE_SINGLE;
  st = api_->worker_create(context_, &wparams, &worker_);
  if (st != UCS_OK) {
    worker_ = nullptr;
    return BackendUnavailableError("ucp_worker_create failed: " + UcsText(st));
  }

  if (api_->has_push()) {
    serves_push_ = true;
    const std::pair<unsigned, ucp_am_recv_callback_t> handlers[] = {
        {kAmPushRequest, &UcxBackend::OnPushRequest},
        {kAmPushData, &UcxBackend::OnPushData},
        {kAmPushAnswer, &UcxBackend::OnPushAnswer}};
    for (const auto& [id, cb] : handlers) {
      ucp_am_handler_param_t hp{};
      hp.field_mask = UCP_AM_HANDLER_PARAM_FIELD_ID | UCP_AM_HANDLER_PARAM_FIELD_FLAGS |
                      UCP_AM_HANDLER_PARAM_FIELD_CB | UCP_AM_HANDLER_PARAM_FIELD_ARG;
      hp.id = id;
      hp.flags = UCP_AM_FLAG_WHOLE_MSG;  // one callback per message, never per fragment
      hp.cb = cb;
      hp.arg = this;
      serves_push_ &= api_->worker_set_am_recv_handler(worker_, &hp) == UCS_OK;
    }
  }

  ucp_address_t* addr = nullptr;
  std::size_t addr_len = 0;
  st = api_->worker_get_address(worker_, &addr, &addr_len);
  if (st != UCS_OK) return TransportError("ucp_worker_get_address failed: " + UcsText(st));
  while (instance_ == 0) instance_ = NextNonce();
  local_address_ = EncodeAddress(api_->version(), LocalHostId(), LocalProcessIdentity(), instance_,
                                 {reinterpret_cast<const std::uint8_t*>(addr), addr_len},
                                 serves_push_ ? kAddressFlagServesPush | kAddressFlagAnswersRegionChecks
                                              : 0);
  api_->worker_release_address(worker_, addr);

  wake_fd_ = ::eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC);
  epoll_fd_ = ::epoll_create1(EPOLL_CLOEXEC);
  if (wake_fd_ < 0 || epoll_fd_ < 0) {
    return InternalError(std::string("eventfd/epoll_create1 failed: ") + std::strerror(errno));
  }
  epoll_event ev{};
  ev.events = EPOLLIN;
  ev.data.fd = wake_fd_;
  ::epoll_ctl(epoll_fd_, EPOLL_CTL_ADD, wake_fd_, &ev);
  if (options_.progress_mode == ProgressMode::kThread) {
    int efd = -1;
    st = api_->worker_get_efd(worker_, &efd);
    if (st != UCS_OK) return TransportError("ucp_worker_get_efd failed: " + UcsText(st));
    ev.data.fd = efd;
    ::epoll_ctl(epoll_fd_, EPOLL_CTL_ADD, efd, &ev);
  }

  thread_ = std::thread([this] { Loop(); });
  worker_id_.store(thread_.get_id());
  ::pthread_setname_np(thread_.native_handle(), "moriio-ucx");
  return Status::OK();
}

UcxBackend::~UcxBackend() {
  if (thread_.joinable()) {
    MORIIO_CHECK(std::this_thread::get_id() != thread_.get_id(),
                 "the ucx backend was destroyed from its own progress thread (a completion sink "
                 "dropped the last reference); destroy it from another thread");
    {
      std::lock_guard<std::mutex> lock(queue_mutex_);
      stopping_ = true;
    }
    queued_.fetch_add(1);
    Wake();
    thread_.join();
  } else {
    // Init failed part way: nothing ran on a thread, release what exists.
    if (worker_ != nullptr) api_->worker_destroy(worker_);
    if (context_ != nullptr) api_->cleanup(context_);
  }
  if (epoll_fd_ >= 0) ::close(epoll_fd_);
  if (wake_fd_ >= 0) ::close(wake_fd_);
}

template <typename F>
auto UcxBackend::OnWorker(F fn) -> decltype(fn()) {
  using R = decltype(fn());
  if (std::this_thread::get_id() == worker_id_.load()) return fn();
  auto task = std::make_shared<std::packaged_task<R()>>(std::move(fn));
  std::future<R> result = task->get_future();
  {
    std::lock_guard<std::mutex> lock(queue_mutex_);
    if (stopping_) return R(AbortedError("the ucx backend is shutting down"));
    commands_.emplace_back([task] { (*task)(); });
  }
  queued_.fetch_add(1);
  Wake();
  return result.get();
}

void UcxBackend::Wake() {
  std::uint64_t one = 1;
  // A full counter (never in practice) still leaves the fd readable, which is all we need.
  [[maybe_unused]] ssize_t n = ::write(wake_fd_, &one, sizeof(one));
}

// ---- public API -------------------------------------------------------------------------------

Result<RegisteredRegion> UcxBackend::RegisterMemory(const MemoryRange& range) {
  if (range.address == 0 || range.size == 0 || range.address + range.size < range.address) {
    return InvalidArgumentError("cannot register " + RangeText(range) +
                                ": null address, empty or wrapping range");
  }
  if ((range.kind == MemoryKind::kCuda && !caps_.cuda_memory) ||
      (range.kind == MemoryKind::kRocm && !caps_.rocm_memory)) {
    return InvalidArgumentError("cannot register " + RangeText(range) + ": UCX (" +
                                api_->library_path + ") has no " + KindName(range.kind) +
                                " memory support on this machine");
  }
  return OnWorker([&]() -> Result<RegisteredRegion> {
    if (range.kind == MemoryKind::kCuda) {
      cuda_device_ = range.device < 0 ? 0 : range.device;
      const std::string why = BindCudaDevice(cuda_device_);
      if (!why.empty()) return TransportError("cannot register " + RangeText(range) + ": " + why);
    }
    std::shared_ptr<Allocation> alloc;
    {
      std::lock_guard<std::mutex> lock(mutex_);
      auto it = allocations_.upper_bound(range.address);
      if (it != allocations_.begin()) {
        const auto& a = *std::prev(it)->second;
        const bool starts_inside = range.address < a.address + a.size;
        if (starts_inside && range.address + range.size > a.address + a.size) {
          return InvalidArgumentError("cannot register " + RangeText(range) +
                                      ": it runs past the end of the backend allocation [" +
                                      Hex(a.address) + ", +" + std::to_string(a.size) + ")");
        }
        if (starts_inside) alloc = std::prev(it)->second;
      }
      if (!alloc && it != allocations_.end() && range.address + range.size > it->first) {
        return InvalidArgumentError("cannot register " + RangeText(range) +
                                    ": it overlaps the start of a backend allocation at " +
                                    Hex(it->first));
      }
    }
    auto region = std::make_shared<LocalRegion>();
    region->range = range;
    if (alloc) {
      region->memh = alloc->memh;
      region->alloc = alloc;
    } else {
      ucp_mem_map_params_t mp{};
      mp.field_mask = UCP_MEM_MAP_PARAM_FIELD_ADDRESS | UCP_MEM_MAP_PARAM_FIELD_LENGTH |
                      UCP_MEM_MAP_PARAM_FIELD_MEMORY_TYPE;
      mp.address = reinterpret_cast<void*>(range.address);
      mp.length = range.size;
      mp.memory_type = ToUcs(range.kind);
      ucs_status_t st = api_->mem_map(context_, &mp, &region->memh);
      if (st != UCS_OK) {
        return TransportError("ucp_mem_map of " + RangeText(range) + " failed: " + UcsText(st));
      }
    }
    void* packed = nullptr;
    std::size_t packed_len = 0;
    ucs_status_t st = api_->rkey_pack(context_, region->memh, &packed, &packed_len);
    if (st != UCS_OK) {
      if (!alloc) api_->mem_unmap(context_, region->memh);
      return TransportError("ucp_rkey_pack for " + RangeText(range) + " failed: " + UcsText(st));
    }
    WireKey key;
    key.kind = range.kind;
    key.flags = alloc ? kKeyFlagAllocated : 0;
    key.region_start = range.address;
    key.region_size = range.size;
    key.blob = {static_cast<const std::uint8_t*>(packed), packed_len};
    region->key.assign(key.blob.begin(), key.blob.end());
    RegisteredRegion out;
    out.remote_key = EncodeKey(key);
    api_->rkey_buffer_release(packed);

    region->published = RegionPublication(range, {instance_, engine_id_});
    std::lock_guard<std::mutex> lock(mutex_);
    region->id = next_id_++;
    out.handle = region->id;
    if (alloc) alloc->registrations++;
    regions_.emplace(region->id, std::move(region));
    return out;
  });
}

Status UcxBackend::DeregisterMemory(std::uint64_t handle) {
  return OnWorker([&]() -> Status {
    std::shared_ptr<LocalRegion> region;
    {
      std::lock_guard<std::mutex> lock(mutex_);
      auto it = regions_.find(handle);
      if (it == regions_.end()) {
        return NotFoundError("local region " + std::to_string(handle) + " is not registered");
      }
      if (it->second->inflight > 0) {
        return FailedPreconditionError("local region " + std::to_string(handle) + " has " +
                                       std::to_string(it->second->inflight) +
                                       " batch(es) in flight; deregister after they complete");
      }
      region = it->second;
      regions_.erase(it);
      if (region->alloc) region->alloc->registrations--;
    }
    region->deregistered = true;  // push jobs reading it answer failed (PumpPushJob)
    region->published = RegionPublication();
    if (!region->alloc) {
      ucs_status_t st = api_->mem_unmap(context_, region->memh);
      region->memh = nullptr;
      if (st != UCS_OK) return TransportError("ucp_mem_unmap failed: " + UcsText(st));
    }
    return Status::OK();
  });
}

Result<std::uint64_t> UcxBackend::ConnectPeer(std::span<const std::uint8_t> address) {
  MORIIO_ASSIGN_OR_RETURN(WireAddress wire, DecodeAddress(address));
  return OnWorker([&]() -> Result<std::uint64_t> {
    auto peer = std::make_shared<PeerState>();
    peer->owner = this;
    ucp_ep_params_t ep{};
    ep.field_mask = UCP_EP_PARAM_FIELD_REMOTE_ADDRESS | UCP_EP_PARAM_FIELD_ERR_HANDLING_MODE |
                    UCP_EP_PARAM_FIELD_ERR_HANDLER;
    ep.address = reinterpret_cast<const ucp_address_t*>(wire.blob.data());
    // PEER mode makes a dead peer fail its operations instead of aborting this process, but in
    // UCX 1.22 no shared-memory transport (sysv, posix, cma, cuda_ipc) supports it: asking for it
    // on one host turns every put/get into software emulation over tcp. On one host a dead peer
    // fails cma operations with an error anyway, and the direct paths need no peer at all. Over
    // network transports (UCX_TLS=tcp) nothing in UCX ends the operations of a dead same-host
    // peer without PEER mode, so the progress thread watches a peer whose identity it can prove
    // (CheckPeersAlive); PEER mode is asked for there only for a peer that cannot be watched
    // (identity unproven) or that serves push READs (below).
    // READs over network transports go by push when the peer serves it (ReadsByPush): no get is
    // then queued at the peer, and PEER mode is what makes the target's sends back to a reader
    // that died fail (its endpoint back must use our mode: UCX pairs the two).
    const bool same_host = wire.host == LocalHostId();
    const bool proven = same_host && VerifyProcessIdentity(wire.process);
    const bool may_push = serves_push_ && (wire.flags & kAddressFlagServesPush) != 0 &&
                          options_.read_push != ReadPush::kOff;
    const bool want_peer_mode =
        options_.error_handling == ErrorHandling::kPeer ||
        (options_.error_handling == ErrorHandling::kAuto &&
         (!same_host || (network_only_ && (!proven || may_push))));
    ep.err_mode = want_peer_mode ? UCP_ERR_HANDLING_MODE_PEER : UCP_ERR_HANDLING_MODE_NONE;
    ep.err_handler.cb = &UcxBackend::OnPeerError;
    ep.err_handler.arg = peer.get();
    ucs_status_t st = api_->ep_create(worker_, &ep, &peer->ep);
    if (st == UCS_ERR_UNREACHABLE && want_peer_mode &&
        options_.error_handling == ErrorHandling::kAuto) {
      ep.err_mode = UCP_ERR_HANDLING_MODE_NONE;
      st = api_->ep_create(worker_, &ep, &peer->ep);
    }
    if (st != UCS_OK) {
      return TransportError("cannot create a UCX endpoint to the peer (its UCX is " +
                            std::to_string(wire.ucx_version >> 16) + "." +
                            std::to_string((wire.ucx_version >> 8) & 0xff) + "): " +
                            UcsText(st) +
                            "; check that ucx_tls allows a transport both sides share");
    }
    // Plain host memory of a peer on this host then moves by batched process_vm_readv/writev
    // (UCX's cma issues one call per run), but only through a pid proven to be the peer's.
    if (proven && options_.direct_copy && cma_usable_) peer->cma_identity = wire.process;
    peer->push = ReadsByPush(peer->ep, wire);
    peer->checks_regions = serves_push_ && (wire.flags & kAddressFlagAnswersRegionChecks) != 0;
    peer->peer_mode = ep.err_mode == UCP_ERR_HANDLING_MODE_PEER;
    peer->process = RemoteProcess::Of(wire);
    peer->registrant.instance = wire.instance;
    peer->same_host = same_host;
    if (proven) peer->identity = wire.process;
    std::lock_guard<std::mutex> lock(mutex_);
    peer->id = next_id_++;
    peers_.emplace(peer->id, peer);
    return peer->id;
  });
}

void UcxBackend::SetOwner(std::string_view engine_id) {
  OnWorker([&] { engine_id_ = engine_id; });
}

Status UcxBackend::ExpectPeerOwner(std::uint64_t peer_id, std::string_view engine_id) {
  return OnWorker([&]() -> Status {
    std::lock_guard<std::mutex> lock(mutex_);
    auto it = peers_.find(peer_id);
    if (it == peers_.end() || it->second->closed.load()) {
      return NotFoundError("peer " + std::to_string(peer_id) + " is not connected");
    }
    for (const auto& [rid, remote] : remotes_) {
      if (remote->peer == it->second) {
        // Its regions' checks (and cached table reads) were made for the engine named before.
        return FailedPreconditionError("peer " + std::to_string(peer_id) +
                                       " has imported regions: name its engine before importing");
      }
    }
    it->second->registrant.engine = engine_id;
    return Status::OK();
  });
}

bool UcxBackend::PeerFailed(std::uint64_t peer_id) {
  Result<bool> failed = OnWorker([&]() -> Result<bool> {
    std::lock_guard<std::mutex> lock(mutex_);
    auto it = peers_.find(peer_id);
    return it != peers_.end() && it->second->failed;
  });
  return failed.ok() && *failed;
}

Result<std::uint64_t> UcxBackend::ImportRemoteRegion(std::uint64_t peer_id,
                                                     const MemoryRange& range,
                                                     std::span<const std::uint8_t> remote_key) {
  MORIIO_ASSIGN_OR_RETURN(WireKey key, DecodeKey(remote_key));
  if (key.kind != range.kind) {
    return InvalidArgumentError("remote key of peer " + std::to_string(peer_id) + " is for " +
                                KindName(key.kind) + " memory but the region is " +
                                RangeText(range));
  }
  if (range.size == 0 || range.address < key.region_start ||
      range.address + range.size < range.address ||
      range.address + range.size > key.region_start + key.region_size) {
    return InvalidArgumentError("remote region " + RangeText(range) + " of peer " +
                                std::to_string(peer_id) + " is not inside the region its key " +
                                "covers [" + Hex(key.region_start) + ", +" +
                                std::to_string(key.region_size) + ")");
  }
  const bool want_cuda_copy = options_.direct_copy && range.kind == MemoryKind::kCuda &&
                              LoadCudaCopy().api != nullptr;
  return OnWorker([&]() -> Result<std::uint64_t> {
    if (range.kind == MemoryKind::kCuda) {
      // UCX maps a peer's GPU memory (cuda_ipc) into the current context: use the device our
      // own GPU regions live on, where the copy kernels run.
      const std::string why = BindCudaDevice(cuda_device_);
      if (!why.empty()) return TransportError("cannot import " + RangeText(range) + ": " + why);
    }
    std::shared_ptr<PeerState> peer;
    {
      std::lock_guard<std::mutex> lock(mutex_);
      auto it = peers_.find(peer_id);
      if (it == peers_.end() || it->second->closed.load()) {
        return NotFoundError("peer " + std::to_string(peer_id) + " is not connected");
      }
      peer = it->second;
    }
    if (peer->failed) return peer->failure;
    auto remote = std::make_shared<RemoteRegion>();
    remote->peer = peer;
    remote->range = range;
    remote->key.assign(key.blob.begin(), key.blob.end());
    ucs_status_t st = api_->ep_rkey_unpack(peer->ep, key.blob.data(), &remote->rkey);
    if (st != UCS_OK) {
      return InvalidArgumentError("UCX rejected the remote key of peer " +
                                  std::to_string(peer_id) + " for " + RangeText(range) + ": " +
                                  UcsText(st));
    }
    if (options_.direct_copy && (range.kind == MemoryKind::kHost || want_cuda_copy)) {
      void* first = nullptr;
      void* last = nullptr;
      // Both ends must map, contiguously: the mapping covers the whole region, not just a page.
      if (api_->rkey_ptr(remote->rkey, range.address, &first) == UCS_OK &&
          api_->rkey_ptr(remote->rkey, range.address + range.size - 1, &last) == UCS_OK &&
          static_cast<std::uint8_t*>(last) - static_cast<std::uint8_t*>(first) ==
              static_cast<std::ptrdiff_t>(range.size - 1)) {
        remote->direct = static_cast<std::uint8_t*>(first);
      }
    }
    std::lock_guard<std::mutex> lock(mutex_);
    remote->id = next_id_++;
    remotes_.emplace(remote->id, remote);
    return remote->id;
  });
}

Status UcxBackend::DisconnectPeer(std::uint64_t peer_id) {
  return OnWorker([&]() -> Status {
    std::shared_ptr<PeerState> peer;
    std::vector<std::shared_ptr<RemoteRegion>> imports;
    {
      std::lock_guard<std::mutex> lock(mutex_);
      auto it = peers_.find(peer_id);
      if (it == peers_.end() || it->second->closed.load()) {
        return NotFoundError("peer " + std::to_string(peer_id) + " is not connected");
      }
      peer = it->second;
      peer->closed.store(true);  // Submit refuses it from here on
      for (auto r = remotes_.begin(); r != remotes_.end();) {
        if (r->second->peer == peer) {
          imports.push_back(r->second);
          r = remotes_.erase(r);
        } else {
          ++r;
        }
      }
    }
    for (auto& ab : active_) {
      if (ab.remote->peer != peer) continue;
      // Asked before stopping it: a stopped batch with nothing in flight counts as finished (a
      // push READ has no UCX request in flight while it waits for the target's bytes).
      const bool finished = ab.Finished();
      ab.stop = true;
      if (ab.error.ok() && !finished) {
        ab.error = AbortedError("peer " + std::to_string(peer_id) +
                                " was disconnected while the batch was in flight");
      }
      ConfirmStoppedWrites(ab);
    }
    // Operations already posted read or write through the rkeys: they go once those end, in
    // the loop, which serves the other peers meanwhile (a stalled peer held it for the whole
    // deadline before). Nothing in flight: they go now.
    draining_.push_back({peer, std::move(imports), Clock::now() + kDrainDeadline});
    FinishDrains();
    std::lock_guard<std::mutex> lock(mutex_);
    peers_.erase(peer_id);
    return Status::OK();
  });
}

bool UcxBackend::FinishDrains() {
  bool did = false;
  const auto now = Clock::now();
  for (auto it = draining_.begin(); it != draining_.end();) {
    const bool drained = std::none_of(active_.begin(), active_.end(), [&](const ActiveBatch& ab) {
      return ab.remote->peer == it->peer && (ab.outstanding != 0 || ab.cuda_op != nullptr);
    });
    if (!drained && now < it->deadline) {
      ++it;
      continue;
    }
    auto destroy_rkeys = [&] {
      for (auto& r : it->imports) {
        if (r->rkey != nullptr) api_->rkey_destroy(r->rkey);
        r->rkey = nullptr;
        r->direct = nullptr;
      }
    };
    // UCX wants rkeys destroyed before their endpoint; only operations stuck past the deadline
    // (a hung peer) force the reverse order, since the forced close is what cancels them.
    if (drained) destroy_rkeys();
    ReleaseEndpoint(*it->peer);
    if (!drained) destroy_rkeys();
    it = draining_.erase(it);
    did = true;
  }
  return did;
}

Status UcxBackend::Submit(std::shared_ptr<const Batch> batch) {
  if (!batch) return InvalidArgumentError("Submit: null batch");
  const Batch& b = *batch;
  Pending p;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    auto l = regions_.find(b.local_region);
    if (l == regions_.end()) {
      return NotFoundError("batch " + std::to_string(b.token) + ": local region " +
                           std::to_string(b.local_region) + " is not registered");
    }
    auto r = remotes_.find(b.remote_region);
    if (r == remotes_.end()) {
      return NotFoundError("batch " + std::to_string(b.token) + ": remote region " +
                           std::to_string(b.remote_region) + " is not imported");
    }
    if (!r->second->released.ok()) {
      return r->second->released.WithContext("batch " + std::to_string(b.token));
    }
    if (r->second->peer->id != b.peer || r->second->peer->closed.load()) {
      return InvalidArgumentError("batch " + std::to_string(b.token) + ": remote region " +
                                  std::to_string(b.remote_region) + " does not belong to peer " +
                                  std::to_string(b.peer));
    }
    if (b.cells && !TakesCells(*l->second, *r->second, b.cells->geometry)) {
      return FailedPreconditionError(
          "batch " + std::to_string(b.token) +
          " is a cell batch, but its copy cannot run on the GPU (both ends must be CUDA memory "
          "mapped into this process, with the CUDA copy plugin, and cells of 1.." +
          std::to_string(kMaxCudaCellBytes) + " bytes); AcceptsCells says no for this pair");
    }
    if (b.stamps && !TakesStamps(*l->second, *r->second, options_.stamps)) {
      return FailedPreconditionError(
          "batch " + std::to_string(b.token) +
          " is a stamped batch, but its copy cannot run on the GPU (both ends must be CUDA "
          "memory mapped into this process, with the CUDA copy plugin, and ucx_stamps on); "
          "AcceptsStamps says no for this pair");
    }
    const std::uint64_t local_size = l->second->range.size;
    const std::uint64_t remote_size = r->second->range.size;
    MORIIO_RETURN_IF_ERROR(b.cells    ? CheckBatchCells(b, local_size, remote_size)
                           : b.stamps ? CheckBatchStamps(b, local_size, remote_size)
                                      : CheckBatchRuns(b, local_size, remote_size));
    l->second->inflight++;
    p.local = l->second;
    p.remote = r->second;
  }
  p.batch = std::move(batch);
  {
    std::lock_guard<std::mutex> lock(queue_mutex_);
    if (stopping_) {
      std::lock_guard<std::mutex> rl(mutex_);
      p.local->inflight--;
      return AbortedError("the ucx backend is shutting down");
    }
    submitted_.push_back(std::move(p));
  }
  queued_.fetch_add(1);
#ifdef MORIIO_NATIVE_TRACE_MARKS
  if (sleeping_.load(std::memory_order_seq_cst)) trace::Record(trace::Mark::kWakeSent);
#endif
  Wake();
  return Status::OK();
}

void UcxBackend::ExpectSubmits() {
  const auto until = Clock::now() + kExpectSpin;
  expect_until_ns_.store(std::chrono::duration_cast<std::chrono::nanoseconds>(
                             until.time_since_epoch())
                             .count(),
                         std::memory_order_relaxed);
  // A hint that finds the thread awake costs no system call; one that races with it falling
  // asleep at worst leaves the first Submit to wake it, as without the hint.
  if (sleeping_.load(std::memory_order_seq_cst)) {
    trace::Record(trace::Mark::kWakeSent);
    Wake();
  }
}

bool UcxBackend::AcceptsCells(std::uint64_t local_region, std::uint64_t remote_region,
                              const CellGeometry& geometry) const {
  std::lock_guard<std::mutex> lock(mutex_);
  auto l = regions_.find(local_region);
  auto r = remotes_.find(remote_region);
  return l != regions_.end() && r != remotes_.end() && TakesCells(*l->second, *r->second, geometry);
}

bool UcxBackend::AcceptsStamps(std::uint64_t local_region, std::uint64_t remote_region) const {
  std::lock_guard<std::mutex> lock(mutex_);
  auto l = regions_.find(local_region);
  auto r = remotes_.find(remote_region);
  return l != regions_.end() && r != remotes_.end() &&
         TakesStamps(*l->second, *r->second, options_.stamps);
}

bool UcxBackend::AcceptsDeviceWaits(std::uint64_t local_region,
                                    std::uint64_t remote_region) const {
  std::lock_guard<std::mutex> lock(mutex_);
  auto l = regions_.find(local_region);
  auto r = remotes_.find(remote_region);
  return l != regions_.end() && r != remotes_.end() && TakesDeviceWaits(*l->second);
}

Result<MemoryRange> UcxBackend::Allocate(std::uint64_t size, MemoryKind kind, int device) {
  if (kind != MemoryKind::kHost) {
    return InvalidArgumentError(
        std::string("the ucx backend allocates host memory only (asked for ") + KindName(kind) +
        " memory on device " + std::to_string(device) +
        "); allocate device memory with the framework and register it");
  }
  if (size == 0) return InvalidArgumentError("Allocate: size must be positive");
  return OnWorker([&]() -> Result<MemoryRange> {
    auto alloc = std::make_shared<Allocation>();
    ucp_mem_map_params_t mp{};
    mp.field_mask = UCP_MEM_MAP_PARAM_FIELD_LENGTH | UCP_MEM_MAP_PARAM_FIELD_FLAGS |
                    UCP_MEM_MAP_PARAM_FIELD_MEMORY_TYPE;
    mp.length = size;
    mp.flags = UCP_MEM_MAP_ALLOCATE;
    mp.memory_type = UCS_MEMORY_TYPE_HOST;
    ucs_status_t st = api_->mem_map(context_, &mp, &alloc->memh);
    if (st != UCS_OK) {
      return TransportError("UCX could not allocate " + std::to_string(size) +
                            " bytes of host memory: " + UcsText(st) +
                            " (shared-memory limits: /dev/shm size, kernel.shmmax)");
    }
    ucp_mem_attr_t attr{};
    attr.field_mask = UCP_MEM_ATTR_FIELD_ADDRESS | UCP_MEM_ATTR_FIELD_LENGTH;
    st = api_->mem_query(alloc->memh, &attr);
    if (st != UCS_OK || attr.length < size) {
      api_->mem_unmap(context_, alloc->memh);
      return TransportError("ucp_mem_query on a fresh allocation failed: " + UcsText(st));
    }
    alloc->address = reinterpret_cast<std::uint64_t>(attr.address);
    alloc->size = size;
    if (alloc->address % 4096 != 0) {
      // Every UCX allocator hands out whole pages; the engine relies on it.
      api_->mem_unmap(context_, alloc->memh);
      return InternalError("UCX returned an allocation that is not page aligned: " +
                           Hex(alloc->address));
    }
    MemoryRange out{alloc->address, alloc->size, MemoryKind::kHost, -1};
    std::lock_guard<std::mutex> lock(mutex_);
    allocations_.emplace(alloc->address, std::move(alloc));
    return out;
  });
}

Status UcxBackend::Free(const MemoryRange& range) {
  return OnWorker([&]() -> Status {
    std::shared_ptr<Allocation> alloc;
    {
      std::lock_guard<std::mutex> lock(mutex_);
      auto it = allocations_.find(range.address);
      if (it == allocations_.end()) {
        return NotFoundError("Free: " + Hex(range.address) +
                             " is not the start of an allocation of this backend");
      }
      if (range.size != 0 && range.size != it->second->size) {
        return InvalidArgumentError("Free: allocation at " + Hex(range.address) + " has " +
                                    std::to_string(it->second->size) + " bytes, not " +
                                    std::to_string(range.size));
      }
      if (it->second->registrations > 0) {
        return FailedPreconditionError("Free: allocation at " + Hex(range.address) + " still has " +
                                       std::to_string(it->second->registrations) +
                                       " registered region(s); deregister them first");
      }
      alloc = it->second;
      allocations_.erase(it);
    }
    ucs_status_t st = api_->mem_unmap(context_, alloc->memh);
    if (st != UCS_OK) return TransportError("ucp_mem_unmap failed: " + UcsText(st));
    return Status::OK();
  });
}

// ---- worker thread ----------------------------------------------------------------------------

void UcxBackend::OnOpDone(void* request, ucs_status_t status, void* user_data) {
  auto* ab = static_cast<ActiveBatch*>(user_data);
  UcxBackend* self = ab->owner;
  ab->outstanding--;
  if (ab->abandoned) {
    self->api_->request_free(request);
    return;
  }
  self->outstanding_ops_--;
  if (status != UCS_OK && ab->error.ok()) {
    std::string hint;
    if (status == UCS_ERR_IO_ERROR && ab->local->range.kind == MemoryKind::kHost) {
      hint = " (on one host this means the peer process exited, or process_vm_readv/writev "
             "was refused by ptrace restrictions: see docs/backends-ucx.md)";
    }
    ab->error = TransportError(std::string("UCX ") +
                               (ab->batch->op == TransferOp::kWrite ? "write" : "read") +
                               " of batch " + std::to_string(ab->batch->token) + " with peer " +
                               std::to_string(ab->batch->peer) + " failed: " +
                               self->UcsText(status) + hint);
    ab->stop = true;
  }
  // Freed here and only here: freeing a request still in flight would suppress this callback.
  self->api_->request_free(request);
}

void UcxBackend::OnFlushDone(void* request, ucs_status_t status, void* user_data) {
  if (status == UCS_OK) static_cast<ActiveBatch*>(user_data)->flush_confirmed = true;
  OnOpDone(request, status, user_data);
}

void UcxBackend::OnPeerError(void* arg, ucp_ep_h /*ep*/, ucs_status_t status) {
  auto* peer = static_cast<PeerState*>(arg);
  if (peer->failed) return;
  peer->failed = true;
  peer->failure = TransportError("UCX connection to peer " + std::to_string(peer->id) +
                                 " failed: " + peer->owner->UcsText(status));
  peer->owner->failed_peers_.push_back(peer->id);
}

void UcxBackend::Loop() {
  auto last_activity = Clock::now();
  for (;;) {
    bool did = false;
    if (queued_.load(std::memory_order_acquire) != 0) {
      did |= RunCommands();
      did |= ActivateSubmitted();
      std::lock_guard<std::mutex> lock(queue_mutex_);
      if (stopping_) break;
    }
    did |= IssueOps();
    did |= DirectHostCopies();
    did |= CmaCopies();
    did |= PollCudaCopies();
    did |= PollDeviceWaits();
    if (api_->worker_progress(worker_) != 0) did = true;
    did |= ServePushes();
    did |= CheckPeersAlive();
    did |= ReleaseDeadIdlePeers();
    did |= HandlePeerFailures();
    did |= FinishDrains();
    did |= EndRegionChecks();
    did |= FinishBatches();
    did |= CloseReleasedEndpoints();
    if (!closing_.empty()) did |= FinishClosing();

    if (did) {
      last_activity = Clock::now();
      continue;
    }
    if (options_.progress_mode == ProgressMode::kBusy) continue;
    const auto now = Clock::now();
    if (now - last_activity < kSpinBeforeSleep) continue;
    if (std::chrono::duration_cast<std::chrono::nanoseconds>(now.time_since_epoch()).count() <
        expect_until_ns_.load(std::memory_order_relaxed)) {
      continue;  // a batch is coming (ExpectSubmits)
    }
    bool cuda_pending = false;
    for (const auto& ab : active_) cuda_pending |= ab.cuda_op != nullptr || ab.awaited_event != 0;
    if (cuda_pending) {
      // Kernels and events signal no fd; poll them without hogging the CPU from the other
      // threads.
      sched_yield();
      continue;
    }
    if (api_->worker_arm(worker_) == UCS_ERR_BUSY) continue;
    // The timeout is a safety net against a transport that signals no event; the wake fd and
    // the worker fd are what normally end the wait.
    const int timeout_ms =
        (outstanding_ops_ != 0 || !active_.empty() || !push_jobs_.empty() || !closing_.empty() ||
         !draining_.empty())
            ? 1
            : 100;
    epoll_event events[4];
    sleeping_.store(true, std::memory_order_seq_cst);
    int n = ::epoll_wait(epoll_fd_, events, 4, timeout_ms);
    sleeping_.store(false, std::memory_order_relaxed);
    trace::Record(trace::Mark::kWoke, static_cast<std::uint64_t>(std::max(n, 0)));  // 0: timed out
    for (int i = 0; i < n; ++i) {
      if (events[i].data.fd == wake_fd_) {
        std::uint64_t v;
        [[maybe_unused]] ssize_t r = ::read(wake_fd_, &v, sizeof(v));
      }
    }
    last_activity = Clock::now();
  }
  Shutdown();
}

bool UcxBackend::RunCommands() {
  std::deque<std::function<void()>> cmds;
  {
    std::lock_guard<std::mutex> lock(queue_mutex_);
    cmds.swap(commands_);
  }
  if (cmds.empty()) return false;
  queued_.fetch_sub(cmds.size(), std::memory_order_acq_rel);
  for (auto& c : cmds) c();
  return true;
}

bool UcxBackend::ActivateSubmitted() {
  std::deque<Pending> batches;
  {
    std::lock_guard<std::mutex> lock(queue_mutex_);
    batches.swap(submitted_);
  }
  if (batches.empty()) return false;
  queued_.fetch_sub(batches.size(), std::memory_order_acq_rel);
  for (auto& p : batches) {
    trace::Record(trace::Mark::kActivated, p.batch->token);
    ActiveBatch& ab = active_.emplace_back();
    ab.owner = this;
    ab.batch = std::move(p.batch);
    ab.local = std::move(p.local);
    ab.remote = std::move(p.remote);
    PeerState& peer = *ab.remote->peer;
    if (peer.closed.load()) {
      ab.stop = true;
      ab.error = AbortedError("peer " + std::to_string(peer.id) +
                              " was disconnected before batch " +
                              std::to_string(ab.batch->token) + " started");
      continue;
    }
    if (peer.failed) {
      ab.stop = true;
      ab.error = peer.failure;
      continue;
    }
    const MemoryKind lk = ab.local->range.kind;
    const bool cuda_copy = CopiesOnGpu(*ab.local, *ab.remote);
    if (ab.batch->device_wait_event != 0 && !TakesDeviceWaits(*ab.local)) {
      // Host memory: its paths copy from the host's side of time and no producer of it records
      // CUDA events; the engine refuses such a batch before Submit (AcceptsDeviceWaits).
      ab.stop = true;
      ab.error = InvalidArgumentError(
          "batch " + std::to_string(ab.batch->token) + " to peer " + std::to_string(peer.id) +
          " carries a CUDA event to wait for, but its local region " +
          std::to_string(ab.batch->local_region) + " is " + KindName(lk) +
          " memory (or the CUDA copy plugin is missing); synchronise the event on the host "
          "instead");
      continue;
    }
    if ((ab.batch->cells || ab.batch->stamps) && !cuda_copy) {
      // Submit accepted it for this pair, whose memory kinds and mapping never change.
      ab.stop = true;
      ab.error = InternalError(std::string(ab.batch->cells ? "cell" : "stamped") + " batch " +
                               std::to_string(ab.batch->token) +
                               " reached a path other than the CUDA copy");
      continue;
    }
    StartOnPath(ab);
  }
  return true;
}

Path UcxBackend::PathOf(const ActiveBatch& ab) const {
  const PeerState& peer = *ab.remote->peer;
  const MemoryKind lk = ab.local->range.kind, rk = ab.remote->range.kind;
  if (ab.remote->direct != nullptr && lk == rk && lk == MemoryKind::kHost) return Path::kHostCopy;
  if (CopiesOnGpu(*ab.local, *ab.remote)) return Path::kCudaCopy;
  if (lk == rk && lk == MemoryKind::kHost && peer.cma_identity.pid != 0) return Path::kCma;
  if (peer.push && lk == rk && lk == MemoryKind::kHost && ab.batch->op == TransferOp::kRead &&
      ab.runs() != 0) {
    return Path::kPush;
  }
  return Path::kOps;
}

void UcxBackend::StartOnPath(ActiveBatch& ab) {
  const Path path = PathOf(ab);
  // Batched cma checks the range against the table the peer publishes, before each batch
  // (CmaCopy). Every other path moves a range only once its owner confirmed it: the direct
  // copies go through UCX's mappings, which end where the owner's allocation does (and a
  // shared-memory key's not even there), not its registration; a push READ's target checks the
  // range but not the engine the metadata named; UCX operations check nothing over tcp. A direct
  // host copy also checks before each batch: in the owner's published table where this process
  // reads it (DirectHostCopies), else by a check of its own (ChecksEachBatch).
  if (path != Path::kCma && !RegionConfirmed(ab)) return;
  if ((path == Path::kOps || path == Path::kCudaCopy) && OneSided(ab, path) &&
      ReadsPublishedRegions(*ab.remote->peer) &&
      (ab.batch->cells || ab.batch->stamps || ab.runs() != 0)) {
    const PeerState& peer = *ab.remote->peer;
    if (Status held = CheckPublishedRegion(peer.identity, ab.remote->range, peer.registrant,
                                           ab.remote->published_seq);
        !held.ok()) {
      ab.path = path;
      ab.Fail(TransportError("batch " + std::to_string(ab.batch->token) + " with peer " +
                             std::to_string(ab.batch->peer) + ": remote region " +
                             std::to_string(ab.remote->id) + " " + RangeText(ab.remote->range) +
                             ": " + held.message()));
      return;
    }
  }
  ab.path = path;
  if (path == Path::kCudaCopy) {
    StartCudaCopy(ab);
  } else if (path == Path::kPush) {
    StartPush(ab);
  } else if (path == Path::kOps) {
    ab.needs_flush = ab.batch->op == TransferOp::kWrite && ab.runs() != 0;
    // A batch of no runs reads nothing of its producer's: it ends at once, on every backend.
    ab.awaited_event = ab.runs() != 0 ? ab.batch->device_wait_event : 0;
  }
  g_path_batches[static_cast<int>(ab.path)].fetch_add(1, std::memory_order_relaxed);
}

bool UcxBackend::RegionConfirmed(ActiveBatch& ab) {
  RemoteRegion& region = *ab.remote;
  // A batch of no runs touches nothing of the region (cell and stamped batches carry theirs
  // elsewhere: they are checked).
  const Batch& b = *ab.batch;
  if ((!b.cells && !b.stamps && ab.runs() == 0) || ab.region_confirmed ||
      (region.check == RemoteRegion::Check::kConfirmed && !ChecksEachBatch(ab))) {
    return true;
  }
  if (!region.peer->checks_regions) {
    ab.Fail(FailedPreconditionError(
        "batch " + std::to_string(ab.batch->token) + ": peer " + std::to_string(ab.batch->peer) +
        " cannot confirm that it registered remote region " + std::to_string(region.id) + " " +
        RangeText(region.range) +
        " (its UCX backend answers no region checks: another release; or this one cannot "
        "receive active messages), and no byte of it moves unchecked"));
    return false;
  }
  // Path::kPush waits for the target's answer and counts as waiting for the peer
  // (CheckPeersAlive); the batch's own path replaces it once the check ended.
  ab.path = Path::kPush;
  if (ab.region_wait_since == Clock::time_point{}) ab.region_wait_since = Clock::now();
  if (region.check == RemoteRegion::Check::kRunning) {
    ab.parked = true;
    return false;
  }
  region.check = RemoteRegion::Check::kRunning;
  ab.checking = true;
  SendPushRequest(ab, EncodeRegionCheck(NewPushId(ab), PushFlags(ab), local_address_,
                                        region.range, region.peer->registrant.engine, region.key));
  return false;
}

bool UcxBackend::ReadsPublishedRegions(const PeerState& peer) const {
  return peer.identity.pid != 0 && cma_usable_;
}

bool UcxBackend::OneSided(const ActiveBatch& ab, Path path) const {
  // The direct copies go through mappings of the owner's allocation; UCX operations on this
  // host (its cma, shared memory, cuda_ipc) are one-sided too: none needs the owner's worker,
  // so none fails when the backend behind the metadata is gone.
  return path == Path::kHostCopy || path == Path::kCudaCopy ||
         (path == Path::kOps && ab.remote->peer->same_host && !network_only_);
}

bool UcxBackend::ChecksEachBatch(const ActiveBatch& ab) const {
  return OneSided(ab, PathOf(ab)) && !ReadsPublishedRegions(*ab.remote->peer);
}

void UcxBackend::ResolveRegionCheck(ActiveBatch& ab) {
  ForgetPushRead(ab);
  ab.checking = false;
  ab.push_done = false;
  RemoteRegion& region = *ab.remote;
  const bool confirmed = !ab.stop;
  region.check = confirmed ? RemoteRegion::Check::kConfirmed : RemoteRegion::Check::kUnchecked;
  ab.region_confirmed = confirmed;
  // A check that got no answer in time says nothing of the region, and a batch that parked
  // behind it later than it started has time of its own left: such batches check again (the
  // first to start becomes the new checker, the others park behind it).
  const bool unanswered = !confirmed && ab.error.code() == StatusCode::kTimeout;
  const auto now = Clock::now();
  for (auto& other : active_) {
    if (!other.parked || other.remote != ab.remote) continue;
    other.parked = false;
    if (other.stop) continue;
    const bool time_left =
        unanswered && now < RegionWaitEnd(other);
    if (confirmed || time_left) {
      other.region_confirmed = confirmed;
      StartOnPath(other);
    } else {
      other.Fail(ab.error.WithContext("batch " + std::to_string(other.batch->token) +
                                      " waited for batch " + std::to_string(ab.batch->token) +
                                      "'s check of remote region " + std::to_string(region.id)));
    }
  }
}

bool UcxBackend::EndRegionChecks() {
  bool did = false;
  const auto now = Clock::now();
  std::vector<Completion> done;
  for (auto it = active_.begin(); it != active_.end();) {
    ActiveBatch& ab = *it;
    if (!ab.checking) {
      ++it;
      continue;
    }
    const bool past_deadline = now >= RegionWaitEnd(ab);
    if (!ab.stop && !ab.push_done && past_deadline) {
      ab.Fail(TimeoutError(PushWhat(ab) + ": no answer within " +
                           std::to_string(options_.region_check_timeout.count()) +
                           " ms (ucx_region_check_timeout_ms; the peer stopped answering, or "
                           "died); nothing of the batch moved"));
    }
    // A stopped check (timed out, disconnected, its peer failed) whose send UCX still holds at
    // the deadline is abandoned below; an answered one waits for its send's callback.
    const bool abandon = ab.stop && ab.outstanding != 0 && past_deadline;
    if (!(ab.stop || ab.push_done) || (ab.outstanding != 0 && !abandon)) {
      ++it;
      continue;
    }
    did = true;
    ResolveRegionCheck(ab);
    if (ab.outstanding != 0) {
      // The request's send never ended, and UCX may never end it (a dead peer without failure
      // detection): the batch, which moved nothing, completes now and stays allocated, its
      // request bytes with it, for the send's callback.
      it = Abandon(it, done);
      continue;
    }
    ab.push_request.clear();
    if (!ab.stop) StartOnPath(ab);
    ++it;
  }
  Deliver(done);
  return did;
}

std::list<ActiveBatch>::iterator UcxBackend::Abandon(std::list<ActiveBatch>::iterator it,
                                                     std::vector<Completion>& done) {
  ActiveBatch& ab = *it;
  ab.abandoned = true;
  ForgetPushRead(ab);
  outstanding_ops_ -= ab.outstanding;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    ab.local->inflight--;
  }
  done.push_back({ab.batch->token, ab.error, WritesUnconfirmed(ab)});
  auto next = std::next(it);
  abandoned_.splice(abandoned_.end(), active_, it);
  return next;
}

void UcxBackend::StartCudaCopy(ActiveBatch& ab) {
  const moriio_cudacopy_api* cc = LoadCudaCopy().api;
  const int device = ab.local->range.device < 0 ? 0 : ab.local->range.device;
  BindCudaDevice(device);
  void*& queue = cuda_queues_[device];
  char err[256] = {};
  if (queue == nullptr && cc->create_queue(device, &queue, err, sizeof(err)) != 0) {
    queue = nullptr;
    ab.stop = true;
    ab.error = TransportError(std::string("CUDA copy queue on device ") + std::to_string(device) +
                              ": " + err);
    return;
  }
  const Batch& b = *ab.batch;
  const std::uint64_t local = ab.local->range.address;
  const auto remote = reinterpret_cast<std::uint64_t>(ab.remote->direct);
  const bool write = b.op == TransferOp::kWrite;
  if (b.cells) {
    StartCellCopy(ab, queue, local, remote);
    return;
  }
  if (b.stamps) {
    StartStampCopy(ab, queue, local, remote);
    return;
  }
  const std::size_t n = b.sizes.size();
  if (n == 0) {
    ab.next_run = 0;
    return;
  }
  trace::Record(trace::Mark::kCopySubmitEntry, b.token);
  const int rc = write ? cc->submit(queue, remote, local, b.remote_offsets.data(),
                                    b.local_offsets.data(), b.sizes.data(), n,
                                    b.device_wait_event, &ab.cuda_op, err, sizeof(err))
                       : cc->submit(queue, local, remote, b.local_offsets.data(),
                                    b.remote_offsets.data(), b.sizes.data(), n,
                                    b.device_wait_event, &ab.cuda_op, err, sizeof(err));
  trace::Record(trace::Mark::kCopySubmitExit, b.token);
  if (rc != 0) {
    ab.cuda_op = nullptr;
    ab.stop = true;
    ab.error = TransportError(std::string("CUDA gather/scatter copy of batch ") +
                              std::to_string(b.token) + " failed to start: " + err);
    return;
  }
  ab.next_run = n;  // all runs are in the one kernel
}

void UcxBackend::StartCellCopy(ActiveBatch& ab, void* queue, std::uint64_t local,
                               std::uint64_t remote) {
  const Batch& b = *ab.batch;
  const BatchCells& c = *b.cells;
  if (c.blocks.size() == 0) return;  // nothing to move: done once polled
  const bool write = b.op == TransferOp::kWrite;
  const CellSide& dst = write ? c.geometry.remote : c.geometry.local;
  const CellSide& src = write ? c.geometry.local : c.geometry.remote;
  // The ranges were checked by TakesCells at Submit.
  const moriio_cudacopy_cells cells{static_cast<std::uint32_t>(c.geometry.planes),
                                    static_cast<std::uint32_t>(c.geometry.heads),
                                    static_cast<std::uint32_t>(c.geometry.tokens),
                                    static_cast<std::uint32_t>(c.geometry.cell_bytes),
                                    dst.plane_stride,
                                    dst.head_stride,
                                    dst.token_stride,
                                    src.plane_stride,
                                    src.head_stride,
                                    src.token_stride};
  const moriio_cudacopy_api* cc = LoadCudaCopy().api;
  char err[256] = {};
  trace::Record(trace::Mark::kCopySubmitEntry, b.token);
  const int rc =
      write ? cc->submit_cells(queue, remote, local, &cells, c.blocks.remote.data(),
                               c.blocks.local.data(), c.blocks.size(), b.device_wait_event,
                               &ab.cuda_op, err, sizeof(err))
            : cc->submit_cells(queue, local, remote, &cells, c.blocks.local.data(),
                               c.blocks.remote.data(), c.blocks.size(), b.device_wait_event,
                               &ab.cuda_op, err, sizeof(err));
  trace::Record(trace::Mark::kCopySubmitExit, b.token);
  if (rc != 0) {
    ab.cuda_op = nullptr;
    ab.stop = true;
    ab.error = TransportError(std::string("CUDA cell copy of batch ") + std::to_string(b.token) +
                              " failed to start: " + err);
  }
}

void UcxBackend::StartStampCopy(ActiveBatch& ab, void* queue, std::uint64_t local,
                                std::uint64_t remote) {
  const Batch& b = *ab.batch;
  const BatchStamps& s = *b.stamps;
  if (s.run_count() == 0) return;  // nothing to move: done once polled
  const bool write = b.op == TransferOp::kWrite;
  // The plugin speaks destination and source; the batch local and remote. O(layers + runs).
  std::vector<moriio_cudacopy_stamp_layer> layers;
  layers.reserve(s.layers.size());
  for (const StampedLayer& l : s.layers) {
    layers.push_back(write ? moriio_cudacopy_stamp_layer{l.remote_base, l.local_base,
                                                         l.remote_stride, l.local_stride,
                                                         l.first_block, l.num_blocks,
                                                         l.first_run, l.num_runs}
                           : moriio_cudacopy_stamp_layer{l.local_base, l.remote_base,
                                                         l.local_stride, l.remote_stride,
                                                         l.first_block, l.num_blocks,
                                                         l.first_run, l.num_runs});
  }
  std::vector<moriio_cudacopy_stamp_run> runs;
  runs.reserve(s.runs.size());
  for (const CopyRun& r : s.runs) {
    runs.push_back(write ? moriio_cudacopy_stamp_run{r.remote, r.local, r.size}
                         : moriio_cudacopy_stamp_run{r.local, r.remote, r.size});
  }
  const std::vector<std::int64_t>& dst_ids = write ? s.remote_ids : s.local_ids;
  const std::vector<std::int64_t>& src_ids = write ? s.local_ids : s.remote_ids;
  const moriio_cudacopy_api* cc = LoadCudaCopy().api;
  char err[256] = {};
  trace::Record(trace::Mark::kCopySubmitEntry, b.token);
  const int rc = cc->submit_stamps(queue, write ? remote : local, write ? local : remote,
                                   layers.data(), static_cast<std::uint32_t>(layers.size()),
                                   runs.data(), static_cast<std::uint32_t>(runs.size()),
                                   dst_ids.data(), src_ids.data(), dst_ids.size(),
                                   b.device_wait_event, &ab.cuda_op, err, sizeof(err));
  trace::Record(trace::Mark::kCopySubmitExit, b.token);
  if (rc != 0) {
    ab.cuda_op = nullptr;
    ab.stop = true;
    ab.error = TransportError(std::string("CUDA stamped copy of batch ") +
                              std::to_string(b.token) + " failed to start: " + err);
  }
}

bool UcxBackend::PollCudaCopies() {
  bool did = false;
  const moriio_cudacopy_api* cc = nullptr;
  // Kernels finish about in the order they were launched (active_ is in that order; the plugin
  // alternates two streams), so polling stops at the second unfinished one: a WRITE of 61 layers
  // keeps as many kernels queued, and querying every event on each pass of the loop (~1 us each)
  // would sit on the path of the next launch and of the last completion.
  int unfinished = 0;
  for (auto& ab : active_) {
    if (ab.cuda_op == nullptr) continue;
    if (unfinished == kCudaPollAhead) break;
    if (cc == nullptr) cc = LoadCudaCopy().api;
    char err[256] = {};
    int r = cc->poll_op(ab.cuda_op, err, sizeof(err));
    if (r == 0) {
      ++unfinished;
      continue;
    }
    cc->release_op(ab.cuda_op);
    ab.cuda_op = nullptr;
    if (r < 0 && ab.error.ok()) {
      ab.error = TransportError("CUDA gather/scatter copy of batch " +
                                std::to_string(ab.batch->token) + " failed: " + err);
      ab.stop = true;
    }
    did = true;
  }
  return did;
}

bool UcxBackend::PollDeviceWaits() {
  // The loop passes every few microseconds while a batch is parked, for as long as the forward
  // runs: ask the driver at most every kDeviceWaitPollInterval, not on every pass.
  const auto now = Clock::now();
  if (now < next_device_wait_poll_) return false;
  next_device_wait_poll_ = now + kDeviceWaitPollInterval;
  bool did = false;
  EventPass pass;
  for (auto& ab : active_) {
    if (ab.awaited_event == 0 || ab.stop) continue;
    const std::optional<Result<bool>> completed = pass.Ask(ab.awaited_event, [&](std::uint64_t e) {
      return QueryDeviceEvent(e, ab.local->range.device);
    });
    if (!completed) break;
    if (!completed->ok()) {
      ab.Fail(TransportError("batch " + std::to_string(ab.batch->token) + " to peer " +
                             std::to_string(ab.batch->peer) + ": CUDA event " +
                             std::to_string(ab.awaited_event) +
                             " it waits for cannot be queried: " +
                             completed->status().message()));
      did = true;
    } else if (**completed) {
      ab.awaited_event = 0;
      did = true;
    }
  }
  return did;
}

Result<bool> UcxBackend::QueryDeviceEvent(std::uint64_t event, int device) {
  // The runtime answers in the thread's current context: the producer's device's primary one,
  // as for the copy kernels.
  const std::string unbound = BindCudaDevice(device < 0 ? 0 : device);
  if (!unbound.empty()) return TransportError(unbound);
  char err[256] = {};
  const int answer = LoadCudaCopy().api->query_event(event, err, sizeof(err));
  if (answer < 0) return TransportError(err);
  return answer == 1;
}

bool UcxBackend::IssueOps() {
  bool did = false;
  bool more = true;
  // Round robin: each pass gives every batch up to kOpsPerBatchPerRound runs.
  while (more && outstanding_ops_ < kMaxOutstandingOps) {
    more = false;
    for (auto& ab : active_) {
      if (ab.path != Path::kOps || ab.stop || ab.awaited_event != 0) continue;
      std::size_t quota = kOpsPerBatchPerRound;
      while (ab.next_run < ab.runs() && quota > 0 && !ab.stop &&
             outstanding_ops_ < kMaxOutstandingOps) {
        PostRun(ab);
        --quota;
        did = true;
      }
      if (ab.next_run == ab.runs() && ab.needs_flush && !ab.flush_posted && !ab.stop) {
        PostFlush(ab);
        did = true;
      }
      if (ab.next_run < ab.runs() && !ab.stop) more = true;
      if (outstanding_ops_ >= kMaxOutstandingOps) break;
    }
  }
  return did;
}

void UcxBackend::PostRun(ActiveBatch& ab) {
  const Batch& b = *ab.batch;
  const std::size_t i = ab.next_run++;
  ucp_request_param_t p{};
  p.op_attr_mask =
      UCP_OP_ATTR_FIELD_CALLBACK | UCP_OP_ATTR_FIELD_USER_DATA | UCP_OP_ATTR_FIELD_MEMORY_TYPE;
  p.cb.send = &UcxBackend::OnOpDone;
  p.user_data = &ab;
  p.memory_type = ToUcs(ab.local->range.kind);
  if (pass_memh_) {
    p.op_attr_mask |= UCP_OP_ATTR_FIELD_MEMH;
    p.memh = ab.local->memh;
  }
  void* local = reinterpret_cast<void*>(ab.local->range.address +
                                        static_cast<std::uint64_t>(b.local_offsets[i]));
  const std::uint64_t remote =
      ab.remote->range.address + static_cast<std::uint64_t>(b.remote_offsets[i]);
  const auto size = static_cast<std::size_t>(b.sizes[i]);
  ucp_ep_h ep = ab.remote->peer->ep;
  ucs_status_ptr_t r = b.op == TransferOp::kWrite
                           ? api_->put_nbx(ep, local, size, remote, ab.remote->rkey, &p)
                           : api_->get_nbx(ep, local, size, remote, ab.remote->rkey, &p);
  if (!UCS_PTR_IS_ERR(r) && b.op == TransferOp::kWrite) ab.puts_posted = true;
  if (r == nullptr) return;  // completed in place
  if (UCS_PTR_IS_ERR(r)) {
    ab.stop = true;
    if (ab.error.ok()) {
      ab.error = TransportError(std::string("UCX ") + (b.op == TransferOp::kWrite ? "put" : "get") +
                                " of batch " + std::to_string(b.token) + " run " +
                                std::to_string(i) + " (" + std::to_string(size) +
                                " bytes) to peer " + std::to_string(b.peer) +
                                " failed: " + UcsText(UCS_PTR_STATUS(r)));
    }
    return;
  }
  ab.outstanding++;
  outstanding_ops_++;
}

void UcxBackend::PostFlush(ActiveBatch& ab) {
  ab.flush_posted = true;
  ucp_request_param_t p{};
  p.op_attr_mask = UCP_OP_ATTR_FIELD_CALLBACK | UCP_OP_ATTR_FIELD_USER_DATA;
  p.cb.send = &UcxBackend::OnFlushDone;
  p.user_data = &ab;
  ucs_status_ptr_t r = api_->ep_flush_nbx(ab.remote->peer->ep, &p);
  if (r == nullptr) {  // completed in place
    ab.flush_confirmed = true;
    return;
  }
  if (UCS_PTR_IS_ERR(r)) {
    ab.stop = true;
    if (ab.error.ok()) {
      ab.error = TransportError("UCX flush after the writes of batch " +
                                std::to_string(ab.batch->token) + " failed: " +
                                UcsText(UCS_PTR_STATUS(r)));
    }
    return;
  }
  ab.outstanding++;
  outstanding_ops_++;
}

bool UcxBackend::DirectHostCopies() {
  std::uint64_t budget = kDirectCopyBudget;
  bool did = false;
  for (auto& ab : active_) {
    if (ab.path != Path::kHostCopy || ab.stop || ab.next_run == ab.runs()) continue;
    const Batch& b = *ab.batch;
    // The mapping outlives the owner's registration (and its engine: the shared memory stays
    // while mapped here), so, as on batched cma, the owner's published regions must still hold
    // the range, read before each batch when the peer's identity was proven.
    const PeerState& peer = *ab.remote->peer;
    if (!ab.cma_checked && ReadsPublishedRegions(peer)) {
      if (Status held = CheckPublishedRegion(peer.identity, ab.remote->range, peer.registrant,
                                             ab.remote->published_seq);
          !held.ok()) {
        ab.Fail(TransportError("direct copy of batch " + std::to_string(b.token) + " with peer " +
                               std::to_string(b.peer) + ": remote region " +
                               std::to_string(ab.remote->id) + " " +
                               RangeText(ab.remote->range) + ": " + held.message()));
        did = true;
        continue;
      }
      ab.cma_checked = true;
    }
    auto* local = reinterpret_cast<std::uint8_t*>(ab.local->range.address);
    std::uint8_t* remote = ab.remote->direct;
    const bool write = b.op == TransferOp::kWrite;
    while (ab.next_run < ab.runs() && budget > 0) {
      const std::size_t i = ab.next_run++;
      std::uint8_t* l = local + b.local_offsets[i];
      std::uint8_t* r = remote + b.remote_offsets[i];
      const auto size = static_cast<std::size_t>(b.sizes[i]);
      if (write) {
        std::memcpy(r, l, size);
      } else {
        std::memcpy(l, r, size);
      }
      budget -= std::min<std::uint64_t>(budget, size);
    }
    // Make the copied bytes visible before the completion lets anyone announce them.
    if (ab.next_run == ab.runs()) std::atomic_thread_fence(std::memory_order_seq_cst);
    did = true;
    if (budget == 0) break;
  }
  return did;
}

bool UcxBackend::CmaCopies() {
  std::uint64_t budget = kDirectCopyBudget;
  bool did = false;
  for (auto& ab : active_) {
    if (ab.path != Path::kCma || ab.stop || ab.next_run == ab.runs()) continue;
    CmaCopy(ab, budget);
    did = true;
    if (budget == 0) break;
  }
  return did;
}

void UcxBackend::CmaCopy(ActiveBatch& ab, std::uint64_t& budget) {
  const Batch& b = *ab.batch;
  const ProcessIdentity& peer = ab.remote->peer->cma_identity;
  const auto pid = static_cast<pid_t>(peer.pid);
  const bool write = b.op == TransferOp::kWrite;
  auto fail = [&](const std::string& what) {
    ab.stop = true;
    if (ab.error.ok()) {
      ab.error = TransportError(std::string(write ? "process_vm_writev" : "process_vm_readv") +
                                " of batch " + std::to_string(b.token) + " to peer " +
                                std::to_string(b.peer) + " (pid " + std::to_string(pid) +
                                "): " + what);
    }
  };
  // The pid was proven at connect; read the cookie again before each batch, so a peer that
  // exited (its pid free for reuse by a stranger) fails the batch instead of being written, and
  // with it the regions the peer registered: only a range inside one of them is touched.
  if (!ab.cma_checked) {
    if (Status held = CheckPublishedRegion(peer, ab.remote->range, ab.remote->peer->registrant,
                                           ab.remote->published_seq);
        !held.ok()) {
      fail("remote region " + std::to_string(ab.remote->id) + " " +
           RangeText(ab.remote->range) + ": " + held.message());
      return;
    }
    ab.cma_checked = true;
  }
  // Up to IOV_MAX runs per system call (UCX's cma transport makes one call per run).
  constexpr std::size_t kIov = IOV_MAX;
  std::array<iovec, kIov> local_iov;
  std::array<iovec, kIov> remote_iov;
  auto* local = reinterpret_cast<std::uint8_t*>(ab.local->range.address);
  const std::uint64_t remote = ab.remote->range.address;
  while (ab.next_run < ab.runs() && budget > 0) {
    std::size_t n = 0;
    std::uint64_t bytes = 0;
    for (std::size_t i = ab.next_run; i < ab.runs() && n < kIov && bytes < budget; ++i, ++n) {
      const auto size = static_cast<std::size_t>(b.sizes[i]);
      local_iov[n] = {local + b.local_offsets[i], size};
      remote_iov[n] = {reinterpret_cast<void*>(remote + static_cast<std::uint64_t>(
                                                            b.remote_offsets[i])),
                       size};
      bytes += size;
    }
    // A call may move fewer bytes than asked (it stops at the first iovec it cannot complete):
    // continue from where it stopped; no progress at all is the error.
    std::size_t first = 0;
    std::uint64_t left = bytes;
    while (left > 0) {
      const ssize_t got =
          write ? ::process_vm_writev(pid, &local_iov[first], n - first, &remote_iov[first],
                                      n - first, 0)
                : ::process_vm_readv(pid, &local_iov[first], n - first, &remote_iov[first],
                                     n - first, 0);
      if (got <= 0) {
        fail(got < 0 ? std::strerror(errno) : "no byte moved");
        return;
      }
      left -= static_cast<std::uint64_t>(got);
      for (auto done = static_cast<std::size_t>(got); done > 0;) {
        const std::size_t step = std::min(done, local_iov[first].iov_len);
        local_iov[first].iov_base = static_cast<std::uint8_t*>(local_iov[first].iov_base) + step;
        local_iov[first].iov_len -= step;
        remote_iov[first].iov_base =
            static_cast<std::uint8_t*>(remote_iov[first].iov_base) + step;
        remote_iov[first].iov_len -= step;
        done -= step;
        if (local_iov[first].iov_len == 0) ++first;
      }
    }
    ab.next_run += n;
    budget -= std::min(budget, bytes);
  }
}

bool UcxBackend::CheckPeersAlive() {
  abandoned_.remove_if([](const ActiveBatch& ab) { return ab.outstanding == 0; });
  if (outstanding_ops_ == 0 && push_reads_.empty()) return false;
  const auto now = Clock::now();
  if (now < next_liveness_check_) return false;
  next_liveness_check_ = now + kLivenessInterval;
  std::vector<std::shared_ptr<PeerState>> dead;
  for (auto& ab : active_) {
    const std::shared_ptr<PeerState>& peer = ab.remote->peer;
    // A push READ waits for the target's messages, with no UCX request of its own in flight.
    const bool waiting = ab.outstanding != 0 || (ab.path == Path::kPush && !ab.stop);
    if (!waiting || peer->peer_mode || peer->identity.pid == 0 ||
        std::find(dead.begin(), dead.end(), peer) != dead.end()) {
      continue;
    }
    // A connection error UCX reported (OnPeerError) ends nothing either without PEER mode. A
    // peer found dead before stays dead: its READs that wait out kLandingGracePasses are
    // counted on each check.
    if (peer->failed) {
      dead.push_back(peer);
      continue;
    }
    // A peer whose endpoint DisconnectPeer released at its drain deadline is watched too: the
    // close by flush that released it does not end while the peer does not answer, so only its
    // death ends the batches still in flight to it.
    if (ProbeProcessIdentity(peer->identity) != ProcessPresence::kGone) continue;
    FailExitedPeer(*peer, " with UCX operations in flight to it");
    dead.push_back(peer);
  }
  // Without PEER mode UCX never ends operations to a dead peer, not even on a forced close (it
  // tracks requests per endpoint only in PEER mode): close the endpoint so nothing more goes to
  // it, then complete its batches with the cause and keep them, abandoned, for the callbacks UCX
  // may still make. Nothing more lands at the peer: its memory is gone. A READ whose gets UCX
  // still holds is completed only kLandingGracePasses checks later (ReadsMayStillLand): the
  // replies the dead peer queued before it died are on this host (a socket buffer, a
  // shared-memory FIFO), nothing adds to them any more, and the progress thread, which runs
  // between those checks, stores them into the local memory meanwhile. The rkeys go later
  // with DisconnectPeer, after the endpoint, as after a drain that timed out.
  std::vector<Completion> done;
  for (auto& peer : dead) {
    ReleaseEndpoint(*peer);
    for (auto it = active_.begin(); it != active_.end();) {
      ActiveBatch& ab = *it;
      if (ab.remote->peer != peer || ab.outstanding == 0) {
        ++it;
        continue;
      }
      ab.stop = true;
      if (ab.error.ok()) ab.error = peer->failure;
      if (ab.checking) ResolveRegionCheck(ab);  // the batches parked behind it fail with it
      if (ReadsMayStillLand(ab) && ++ab.checks_since_death < kLandingGracePasses) {
        ++it;
        continue;
      }
      it = Abandon(it, done);
    }
  }
  for (auto& peer : dead) {
    for (auto& ab : active_) {
      if (ab.remote->peer != peer) continue;
      ab.stop = true;
      if (ab.error.ok()) ab.error = peer->failure;
    }
  }
  Deliver(done);
  return !dead.empty();
}

bool UcxBackend::WritesUnconfirmed(const ActiveBatch& ab) {
  return ab.puts_posted && !ab.flush_confirmed && !ProvenExited(*ab.remote->peer);
}

bool UcxBackend::ReadsMayStillLand(const ActiveBatch& ab) {
  return ab.batch->op == TransferOp::kRead && ab.path == Path::kOps && ab.outstanding != 0;
}

bool UcxBackend::ProvenExited(PeerState& peer) {
  if (!peer.exited && peer.identity.pid != 0 &&
      ProbeProcessIdentity(peer.identity) == ProcessPresence::kGone) {
    peer.exited = true;
  }
  return peer.exited;
}

void UcxBackend::FailExitedPeer(PeerState& peer, std::string_view circumstance) {
  peer.failed = true;
  peer.exited = true;
  peer.failure = TransportError("peer " + std::to_string(peer.id) + " (pid " +
                                std::to_string(peer.identity.pid) +
                                " on this host) exited" + std::string(circumstance));
  failed_peers_.push_back(peer.id);
}

bool UcxBackend::ReleaseDeadIdlePeers() {
  const auto now = Clock::now();
  if (now < next_idle_liveness_check_) return false;
  next_idle_liveness_check_ = now + kIdleLivenessInterval;
  std::vector<std::shared_ptr<PeerState>> watched;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    for (const auto& [id, peer] : peers_) {
      if (peer->ep != nullptr && !peer->closed.load() && !peer->failed &&
          !peer->peer_mode && peer->identity.pid != 0) {
        watched.push_back(peer);
      }
    }
  }
  bool did = false;
  for (const auto& peer : watched) {
    if (HasBatches(*peer) || ProbeProcessIdentity(peer->identity) != ProcessPresence::kGone) {
      continue;
    }
    FailExitedPeer(*peer, "");
    {
      // Nothing is in flight to it, and nothing starts (ActivateSubmitted fails its batches):
      // its rkeys and mappings go before its endpoint, as UCX wants.
      std::lock_guard<std::mutex> lock(mutex_);
      for (auto& [id, remote] : remotes_) {
        if (remote->peer != peer || remote->rkey == nullptr) continue;
        api_->rkey_destroy(remote->rkey);
        remote->rkey = nullptr;
        remote->direct = nullptr;
        remote->released = peer->failure;
      }
    }
    ReleaseEndpoint(*peer);
    did = true;
  }
  return did;
}

bool UcxBackend::HasBatches(const PeerState& peer) const {
  const auto of_peer = [&](const ActiveBatch& ab) { return ab.remote->peer.get() == &peer; };
  return std::any_of(active_.begin(), active_.end(), of_peer) ||
         std::any_of(abandoned_.begin(), abandoned_.end(), of_peer);
}

// ---- push READ (see the comment at kAmPushRequest) ---------------------------------------------

namespace {

/// Parameters of an eager active message whose completion calls `cb` with `user_data`.
ucp_request_param_t EagerAmParams(ucp_send_nbx_callback_t cb, void* user_data) {
  ucp_request_param_t p{};
  p.op_attr_mask =
      UCP_OP_ATTR_FIELD_CALLBACK | UCP_OP_ATTR_FIELD_USER_DATA | UCP_OP_ATTR_FIELD_FLAGS;
  p.cb.send = cb;
  p.user_data = user_data;
  p.flags = UCP_AM_SEND_FLAG_EAGER;
  return p;
}

std::span<const std::uint8_t> Bytes(const void* p, std::size_t n) {
  return {static_cast<const std::uint8_t*>(p), n};
}

}  // namespace

bool UcxBackend::ReadsByPush(ucp_ep_h ep, const WireAddress& peer) const {
  if (!serves_push_ || (peer.flags & kAddressFlagServesPush) == 0 ||
      options_.read_push == ReadPush::kOff) {
    return false;
  }
  if (options_.read_push == ReadPush::kOn) return true;
  // The transports of the endpoint's lanes: when none has a one-sided get of its own, UCX serves
  // every get at the target, in software.
  std::array<ucp_transport_entry_t, 16> entries{};
  ucp_ep_attr_t attr{};
  attr.field_mask = UCP_EP_ATTR_FIELD_TRANSPORTS;
  attr.transports.entries = entries.data();
  attr.transports.num_entries = static_cast<unsigned>(entries.size());
  attr.transports.entry_size = sizeof(ucp_transport_entry_t);
  if (api_->ep_query(ep, &attr) != UCS_OK || attr.transports.num_entries == 0) return false;
  static constexpr std::string_view kSoftwareGet[] = {"tcp", "ud_verbs", "ud_mlx5"};
  for (unsigned i = 0; i < attr.transports.num_entries && i < entries.size(); ++i) {
    const char* name = entries[i].transport_name;
    if (name == nullptr || std::find(std::begin(kSoftwareGet), std::end(kSoftwareGet),
                                     std::string_view(name)) == std::end(kSoftwareGet)) {
      return false;
    }
  }
  return true;
}

void UcxBackend::StartPush(ActiveBatch& ab) {
  const Batch& b = *ab.batch;
  if (b.sizes.size() > kMaxPushRuns) {
    // The target would refuse the request; it is never sent, nothing moves.
    ab.Fail(InvalidArgumentError(
        "batch " + std::to_string(b.token) + " to peer " + std::to_string(b.peer) + " has " +
        std::to_string(b.sizes.size()) + " runs, more than a push READ carries (" +
        std::to_string(kMaxPushRuns) + "): split it, or set ucx_read_push=off"));
    return;
  }
  ab.push_starts.resize(ab.runs());
  std::uint64_t at = 0;
  for (std::size_t i = 0; i < ab.runs(); ++i) {
    ab.push_starts[i] = at;
    at += static_cast<std::uint64_t>(b.sizes[i]);
  }
  ab.push_total = at;
  SendPushRequest(ab, EncodePushRequest(NewPushId(ab), PushFlags(ab), local_address_,
                                        ab.remote->range.address, ab.remote->range.size,
                                        b.remote_offsets, b.sizes));
}

PushId UcxBackend::NewPushId(ActiveBatch& ab) {
  // A nonce of the request's own: a peer that saw requests of this backend (sent to it) learns
  // nothing of those sent to another target, so it cannot answer them (a forged "done" to a
  // region check would confirm a range the real target never registered).
  ab.push_id = {NextNonce(), ++next_push_seq_};
  push_reads_[ab.push_id.seq] = &ab;
  return ab.push_id;
}

std::uint64_t UcxBackend::NextNonce() {
  if (nonces_left_ == 0) {
    // One system call per nonces_.size() requests, no exception on the progress thread. getrandom
    // blocks only before the kernel's pool is first ready, long before any engine runs; should
    // it fail (ENOSYS: a kernel before 3.17), the clock keeps nonces distinct though guessable.
    auto* bytes = reinterpret_cast<std::uint8_t*>(nonces_.data());
    std::size_t got = 0;
    while (got < sizeof(nonces_)) {
      const ssize_t n = ::getrandom(bytes + got, sizeof(nonces_) - got, 0);
      if (n > 0) {
        got += static_cast<std::size_t>(n);
      } else if (errno != EINTR) {
        break;
      }
    }
    for (std::size_t i = got / sizeof(std::uint64_t); i < nonces_.size(); ++i) {
      nonces_[i] = static_cast<std::uint64_t>(Clock::now().time_since_epoch().count()) * (i + 1);
    }
    nonces_left_ = nonces_.size();
  }
  return nonces_[--nonces_left_];
}

void UcxBackend::SendPushRequest(ActiveBatch& ab, std::vector<std::uint8_t> request) {
  ab.push_request = std::move(request);
  const ucp_request_param_t p = EagerAmParams(&UcxBackend::OnOpDone, &ab);
  ucs_status_ptr_t r = api_->am_send_nbx(ab.remote->peer->ep, kAmPushRequest, nullptr, 0,
                                         ab.push_request.data(), ab.push_request.size(), &p);
  if (r == nullptr) return;  // sent in place
  if (UCS_PTR_IS_ERR(r)) {
    ab.Fail(TransportError("UCX could not send the request of the " + PushWhat(ab) + ": " +
                           UcsText(UCS_PTR_STATUS(r))));
    return;
  }
  ab.outstanding++;
  outstanding_ops_++;
}

ActiveBatch* UcxBackend::PushRead(std::span<const std::uint8_t> header, std::size_t header_size) {
  if (header.size() != header_size) return nullptr;
  auto it = push_reads_.find(PushHeaderField(header, 1));
  if (it == push_reads_.end() || it->second->stop ||
      it->second->push_id.nonce != PushHeaderField(header, 0)) {
    return nullptr;
  }
  return it->second;
}

void UcxBackend::ForgetPushRead(const ActiveBatch& ab) {
  if (ab.path == Path::kPush) push_reads_.erase(ab.push_id.seq);
}

ucs_status_t UcxBackend::OnPushData(void* arg, const void* header, std::size_t header_length,
                                    void* data, std::size_t length,
                                    const ucp_am_recv_param_t* param) {
  auto* self = static_cast<UcxBackend*>(arg);
  ActiveBatch* ab = self->PushRead(Bytes(header, header_length), kPushDataHeader);
  if (ab == nullptr) return UCS_OK;  // its batch ended (or a stranger's): dropped
  if ((param->recv_attr & UCP_AM_RECV_ATTR_FLAG_RNDV) != 0) {
    ab->Fail(TransportError(PushWhat(*ab) + ": the target sent data by rendezvous"));
    return UCS_OK;
  }
  std::uint64_t offset = PushHeaderField(Bytes(header, header_length), 2);
  if (offset > ab->push_total || length > ab->push_total - offset ||
      length > ab->push_total - ab->push_received) {
    ab->Fail(TransportError(PushWhat(*ab) + ": the target sent " + std::to_string(length) +
                            " bytes at stream offset " + std::to_string(offset) +
                            ", outside the batch's " + std::to_string(ab->push_total) +
                            " bytes or more than it asked for"));
    return UCS_OK;
  }
  ab->push_received += length;
  const Batch& b = *ab->batch;
  auto* local = reinterpret_cast<std::uint8_t*>(ab->local->range.address);
  const auto* src = static_cast<const std::uint8_t*>(data);
  if (length == 0) return UCS_OK;
  std::size_t i = static_cast<std::size_t>(
      std::upper_bound(ab->push_starts.begin(), ab->push_starts.end(), offset) -
      ab->push_starts.begin() - 1);
  for (std::uint64_t left = length; left > 0; ++i) {
    const std::uint64_t in_run = offset - ab->push_starts[i];
    const std::uint64_t n = std::min<std::uint64_t>(left, b.sizes[i] - in_run);
    std::memcpy(local + b.local_offsets[i] + in_run, src, n);
    src += n;
    offset += n;
    left -= n;
  }
  return UCS_OK;
}

ucs_status_t UcxBackend::OnPushAnswer(void* arg, const void* header, std::size_t header_length,
                                      void* data, std::size_t length,
                                      const ucp_am_recv_param_t* param) {
  auto* self = static_cast<UcxBackend*>(arg);
  const auto head = Bytes(header, header_length);
  ActiveBatch* ab = self->PushRead(head, kPushAnswerHeader);
  if (ab == nullptr) return UCS_OK;
  const std::uint64_t sent = PushHeaderField(head, 2);
  if (PushHeaderField(head, 3) != 1) {
    const bool inline_data = (param->recv_attr & UCP_AM_RECV_ATTR_FLAG_RNDV) == 0;
    const std::string reason =
        inline_data ? std::string(static_cast<const char*>(data), std::min(length, kMaxPushReason))
                    : std::string("(no reason given)");
    ab->Fail(TransportError("peer " + std::to_string(ab->batch->peer) + " failed the " +
                            PushWhat(*ab) + ": " + reason));
  } else if (sent != ab->push_total) {
    ab->Fail(TransportError(PushWhat(*ab) + ": the target sent " + std::to_string(sent) +
                            " bytes, the batch reads " + std::to_string(ab->push_total)));
  } else if (ab->push_received != ab->push_total) {
    // The target answers after its last chunk left, on the same lane: chunks missing now were
    // lost (dropped by this UCX), and waiting would wait for good.
    ab->Fail(TransportError(PushWhat(*ab) + ": " + std::to_string(ab->push_received) + " of " +
                            std::to_string(ab->push_total) +
                            " bytes arrived before the target's answer (the rest were lost)"));
  } else {
    ab->push_done = true;  // complete once every byte arrived (FinishBatches)
  }
  return UCS_OK;
}

ucs_status_t UcxBackend::OnPushRequest(void* arg, const void* /*header*/,
                                       std::size_t /*header_length*/, void* data,
                                       std::size_t length, const ucp_am_recv_param_t* param) {
  auto* self = static_cast<UcxBackend*>(arg);
  // Started (or refused) from the loop (ServePushes), not here: creating endpoints and sending
  // from inside ucp_worker_progress is what this path avoids.
  if ((param->recv_attr & UCP_AM_RECV_ATTR_FLAG_RNDV) != 0) {
    CountUnansweredPush();  // a reader of this version sends eagerly: no header to read here
    return UCS_OK;
  }
  const std::span<const std::uint8_t> bytes = Bytes(data, length);
  const std::size_t held = self->push_requests_.size() + self->push_jobs_.size();
  if (held < self->options_.push_queue && length <= kMaxHeldPushBytes - self->push_held_bytes_) {
    self->push_requests_.emplace_back(bytes.begin(), bytes.end());
    self->push_held_bytes_ += length;
    return UCS_OK;
  }
  Result<PushReplyTo> to = DecodePushReplyTo(bytes);
  if (!to.ok() || self->push_refusals_.size() >= kMaxPushRefusals ||
      to->reply_address.size() > kMaxPushRefusalBytes - self->push_refusal_bytes_) {
    CountUnansweredPush();
    return UCS_OK;
  }
  self->push_refusal_bytes_ += to->reply_address.size();
  PushRefusal& refusal = self->push_refusals_.emplace_back();
  refusal.id = to->id;
  refusal.flags = to->flags;
  refusal.reply_address.assign(to->reply_address.begin(), to->reply_address.end());
  refusal.reason = FailedPreconditionError(
      "the target is busy: it holds " + std::to_string(held) + " push requests (" +
      std::to_string(self->push_held_bytes_) + " bytes), its limit is " +
      std::to_string(self->options_.push_queue) + " (ucx_push_queue) and " +
      std::to_string(kMaxHeldPushBytes) + " bytes");
  return UCS_OK;
}

void UcxBackend::OnPushReaderError(void* arg, ucp_ep_h /*ep*/, ucs_status_t /*status*/) {
  auto* reader = static_cast<PushReader*>(arg);
  reader->failed = true;
  reader->owner->push_reader_failed_ = true;
}

void UcxBackend::OnPushSent(void* request, ucs_status_t status, void* user_data) {
  auto* send = static_cast<PushSend*>(user_data);
  PushJob* job = send->job;
  UcxBackend* self = job->reader->owner;
  if (status != UCS_OK) job->dropped = true;  // the reader is gone: nothing to tell it
  job->sends.erase(send->self);
  self->push_sends_--;
  self->api_->request_free(request);
}

bool UcxBackend::ServePushes() {
  if (push_requests_.empty() && push_refusals_.empty() && push_jobs_.empty() &&
      !push_reader_failed_) {
    return false;
  }
  bool did = false;
  while (!push_refusals_.empty()) {
    PushRefusal refusal = std::move(push_refusals_.front());
    push_refusals_.pop_front();
    push_refusal_bytes_ -= refusal.reply_address.size();
    RefusePush(std::move(refusal));
    did = true;
  }
  while (!push_requests_.empty()) {
    std::vector<std::uint8_t> message = std::move(push_requests_.front());
    push_requests_.pop_front();
    StartPushJob(message);
    did = true;
  }
  for (auto it = push_jobs_.begin(); it != push_jobs_.end();) {
    did |= PumpPushJob(*it);
    if (it->sends.empty() && (it->answered || it->dropped)) {
      push_held_bytes_ -= it->held_bytes;
      it = push_jobs_.erase(it);
      did = true;
    } else {
      ++it;
    }
  }
  if (push_reader_failed_) {
    push_reader_failed_ = false;
    // Closing cancels what is still queued to them; OnPushSent drops those sends.
    for (auto it = push_readers_.begin(); it != push_readers_.end();) {
      if (!it->second->failed) {
        ++it;
        continue;
      }
      ReleaseEndpoint(*it->second);
      it = push_readers_.erase(it);
    }
    did = true;
  }
  return did;
}

std::shared_ptr<PushReader> UcxBackend::PushReaderFor(std::span<const std::uint8_t> address,
                                                      bool peer_mode) {
  std::vector<std::uint8_t> key(address.begin(), address.end());
  key.push_back(peer_mode ? 1 : 0);
  auto it = push_readers_.find(key);
  if (it != push_readers_.end()) {
    if (!it->second->failed) return it->second;
    ReleaseEndpoint(*it->second);
    push_readers_.erase(it);
  }
  Result<WireAddress> wire = DecodeAddress(address);
  if (!wire.ok()) return nullptr;
  auto reader = std::make_shared<PushReader>();
  reader->owner = this;
  reader->peer_mode = peer_mode;
  reader->process = RemoteProcess::Of(*wire);
  ucp_ep_params_t ep{};
  ep.field_mask = UCP_EP_PARAM_FIELD_REMOTE_ADDRESS | UCP_EP_PARAM_FIELD_ERR_HANDLING_MODE |
                  UCP_EP_PARAM_FIELD_ERR_HANDLER;
  ep.address = reinterpret_cast<const ucp_address_t*>(wire->blob.data());
  // The reader's mode: UCX refuses endpoints of two workers that differ in it. With peer-failure
  // detection (what `auto` asks for with push READs), a reader that died fails the sends to it.
  ep.err_mode = peer_mode ? UCP_ERR_HANDLING_MODE_PEER : UCP_ERR_HANDLING_MODE_NONE;
  ep.err_handler.cb = &UcxBackend::OnPushReaderError;
  ep.err_handler.arg = reader.get();
  if (api_->ep_create(worker_, &ep, &reader->ep) != UCS_OK) return nullptr;
  push_readers_.emplace(std::move(key), reader);
  return reader;
}

PushJob* UcxBackend::NewPushJob(const PushReplyTo& to) {
  std::shared_ptr<PushReader> reader =
      PushReaderFor(to.reply_address, (to.flags & kPushFlagPeerErrorHandling) != 0);
  if (!reader) {
    CountUnansweredPush();  // no endpoint to the reader: nothing can reach it
    return nullptr;
  }
  PushJob& job = push_jobs_.emplace_back();
  job.id = to.id;
  job.reader = std::move(reader);
  return &job;
}

void UcxBackend::RefusePush(PushRefusal refusal) {
  PushJob* job = NewPushJob({refusal.id, refusal.flags, refusal.reply_address});
  if (job != nullptr) job->refusal = std::move(refusal.reason);  // answered at once
}

void UcxBackend::StartPushJob(std::span<const std::uint8_t> message) {
  // Without an id and a reply address there is nobody to answer (a reader of this version never
  // sends such a request). Anything else wrong with it is the failed answer's reason.
  Result<PushReplyTo> to = DecodePushReplyTo(message);
  if (!to.ok()) {
    push_held_bytes_ -= message.size();
    CountUnansweredPush();
    return;
  }
  PushJob* started = NewPushJob(*to);
  if (started == nullptr) {
    push_held_bytes_ -= message.size();
    return;
  }
  PushJob& job = *started;
  job.held_bytes = message.size();
  Result<PushRequest> request = DecodePushRequest(message);
  if (!request.ok()) {
    job.refusal = request.status();
    return;
  }
  const std::uint64_t start = request->region_start, size = request->region_size;
  // A push READ reads host memory; a region check asks about memory of the kind it names, and
  // about the key it was imported with: the registration must be the one that key was packed
  // for (a key of another allocation maps other memory).
  const MemoryKind kind = PushRequestKind(*request);
  const bool check = (request->flags & kPushFlagRegionCheck) != 0;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    for (const auto& [id, r] : regions_) {
      const MemoryRange& have = r->range;
      if (have.kind == kind && start >= have.address && size <= have.size &&
          start - have.address <= have.size - size && (!check || r->key == request->key)) {
        job.region = r;
        break;
      }
    }
  }
  if (job.region && !request->owner.empty() && request->owner != engine_id_) {
    job.refusal = FailedPreconditionError(
        "push request " + std::to_string(job.id.seq) + " asks about engine '" + request->owner +
        "', but this target serves engine '" + engine_id_ + "'");
    return;
  }
  if (!job.region) {
    job.refusal = OutOfRangeError("push request " + std::to_string(job.id.seq) + " names " +
                                  RangeText({start, size, kind, -1}) + ", which no registered " +
                                  KindName(kind) + " region of this target holds" +
                                  (check ? " with the key it was imported with" : ""));
    return;
  }
  if (Status runs = CheckPushRuns(*request); !runs.ok()) {
    job.refusal = std::move(runs);
    return;
  }
  job.base = start;
  job.offsets = std::move(request->offsets);
  job.sizes = std::move(request->sizes);
  for (std::uint64_t n : job.sizes) job.total += n;  // each run is inside the region: no wrap
}

bool UcxBackend::PumpPushJob(PushJob& job) {
  if (job.reader->failed) job.dropped = true;
  if (job.dropped || job.answered) return false;
  if (job.refusal.ok() && job.region->deregistered) {
    job.refusal = FailedPreconditionError("the target deregistered its region while push "
                                          "request " + std::to_string(job.id.seq) + " ran");
  }
  bool did = false;
  // Also at most that many chunks per call: sends UCX completes in place leave no trace in
  // `sends`, and one huge batch must not keep the progress thread to itself.
  for (std::size_t posted = 0; job.refusal.ok() && job.sent < job.total &&
                               job.sends.size() < kPushChunksInFlight &&
                               push_sends_ < kMaxPushSends && posted < kPushChunksInFlight;
       ++posted) {
    const std::uint64_t n = std::min(kPushChunk, job.total - job.sent);
    std::vector<std::uint8_t> payload(n);
    for (std::uint64_t filled = 0; filled < n;) {
      const std::uint64_t take = std::min(n - filled, job.sizes[job.next_run] - job.run_done);
      std::memcpy(payload.data() + filled,
                  reinterpret_cast<const std::uint8_t*>(job.base + job.offsets[job.next_run] +
                                                        job.run_done),
                  take);
      filled += take;
      job.run_done += take;
      if (job.run_done == job.sizes[job.next_run]) {
        ++job.next_run;
        job.run_done = 0;
      }
    }
    std::vector<std::uint8_t> header = EncodePushHeader({job.id.nonce, job.id.seq, job.sent});
    job.sent += n;
    did = true;
    if (!PostPushSend(job, kAmPushData, std::move(header), std::move(payload))) return true;
  }
  // Answer once every chunk left (a failure at once): the reader still counts the bytes, so
  // the answer overtaking a chunk on another lane cannot complete a batch early.
  if (job.sends.empty() && (job.sent == job.total || !job.refusal.ok())) {
    const bool ok = job.refusal.ok();
    std::vector<std::uint8_t> header =
        EncodePushHeader({job.id.nonce, job.id.seq, job.sent, ok ? 1u : 0u});
    const std::string reason = ok ? "" : job.refusal.message();
    job.answered = true;
    PostPushSend(job, kAmPushAnswer, std::move(header), {reason.begin(), reason.end()});
    did = true;
  }
  return did;
}

bool UcxBackend::PostPushSend(PushJob& job, unsigned id, std::vector<std::uint8_t> header,
                              std::vector<std::uint8_t> payload) {
  PushSend& send = job.sends.emplace_back();
  send.job = &job;
  send.header = std::move(header);
  send.payload = std::move(payload);
  send.self = std::prev(job.sends.end());
  const ucp_request_param_t p = EagerAmParams(&UcxBackend::OnPushSent, &send);
  ucs_status_ptr_t r =
      api_->am_send_nbx(job.reader->ep, id, send.header.data(), send.header.size(),
                        send.payload.data(), send.payload.size(), &p);
  if (r != nullptr && !UCS_PTR_IS_ERR(r)) {
    push_sends_++;
    return true;  // OnPushSent ends it
  }
  job.sends.erase(send.self);
  if (r == nullptr) return true;  // sent in place
  job.dropped = true;             // the endpoint failed: the reader is gone
  return false;
}

bool UcxBackend::HandlePeerFailures() {
  if (failed_peers_.empty()) return false;
  std::vector<std::uint64_t> ids;
  ids.swap(failed_peers_);
  std::vector<std::pair<std::uint64_t, Status>> reports;
  for (std::uint64_t id : ids) {
    for (auto& ab : active_) {
      PeerState& peer = *ab.remote->peer;
      if (peer.id != id) continue;
      ab.stop = true;
      if (ab.error.ok()) ab.error = peer.failure;
    }
    std::shared_ptr<PeerState> peer;
    {
      std::lock_guard<std::mutex> lock(mutex_);
      auto it = peers_.find(id);
      if (it != peers_.end()) peer = it->second;
    }
    if (peer && !peer->failure_reported && !peer->closed.load()) {
      peer->failure_reported = true;
      reports.emplace_back(id, peer->failure);
    }
  }
  for (auto& [id, st] : reports) sink_->OnPeerFailure(id, st);
  return true;
}

bool UcxBackend::FinishBatches() {
  std::vector<Completion> done;
  // Dropped after the completions are delivered: freeing a batch (its run columns) is not on
  // the path from the last kernel to the caller's event.
  std::vector<std::shared_ptr<const Batch>> finished;
  for (auto it = active_.begin(); it != active_.end();) {
    if (!it->Finished()) {
      ++it;
      continue;
    }
    {
      std::lock_guard<std::mutex> lock(mutex_);
      it->local->inflight--;
    }
    ForgetPushRead(*it);
    done.push_back({it->batch->token, std::move(it->error), WritesUnconfirmed(*it)});
    finished.push_back(std::move(it->batch));
    it = active_.erase(it);
  }
  // The sink runs with no lock held and after the list is consistent: it may submit more work
  // or call back into this backend.
  Deliver(done);
  return !done.empty();
}

void UcxBackend::Deliver(std::vector<Completion>& done) {
  for (auto& [token, status, unconfirmed] : done) {
    if (unconfirmed) {
      sink_->OnBatchUnconfirmed(token, std::move(status));
    } else {
      sink_->OnBatchComplete(token, std::move(status));
    }
  }
}

void UcxBackend::ConfirmStoppedWrites(ActiveBatch& ab) {
  if (ab.puts_posted && !ab.flush_posted && ab.remote->peer->ep != nullptr) {
    PostFlush(ab);
  }
}

bool UcxBackend::ProgressUntil(const std::function<bool()>& done, Clock::time_point deadline) {
  while (!done()) {
    if (Clock::now() >= deadline) return false;
    // Only teardown waits here; a short sleep keeps a stuck peer from costing a whole core.
    if (api_->worker_progress(worker_) == 0) {
      std::this_thread::sleep_for(std::chrono::microseconds(50));
    }
  }
  return true;
}

bool UcxBackend::CloseReleasedEndpoints() {
  if (released_.empty()) return false;
  // UCX's cuda_ipc transport keeps the GPU memory it mapped from a process in one cache per
  // remote process, and destroying any endpoint to that process drops the whole cache: the
  // mappings that another endpoint's imports (ucp_rkey_ptr, the direct copies) still use would
  // go with it. So an endpoint to a process that another open one reaches stays open; the last
  // one closed closes them all. Unmapping a peer's GPU memory waits for this process's work on
  // the device to finish: the reason this runs in the loop, after the peer's batches ended.
  for (KeptEndpoint& released : std::exchange(released_, {})) {
    if (ReachesProcess(released.process)) {
      kept_open_.push_back(released);
      continue;
    }
    CloseEndpoint(released.ep, released.peer_mode);
    std::erase_if(kept_open_, [&](const KeptEndpoint& kept) {
      if (!kept.process.Same(released.process)) return false;
      CloseEndpoint(kept.ep, kept.peer_mode);
      return true;
    });
  }
  return true;
}

bool UcxBackend::ReachesProcess(const RemoteProcess& process) const {
  std::lock_guard<std::mutex> lock(mutex_);
  for (const auto& [id, peer] : peers_) {
    if (peer->ep != nullptr && !peer->closed.load() && peer->process.Same(process)) return true;
  }
  // A draining peer's operations may still use what UCX mapped from that process.
  for (const DrainingPeer& d : draining_) {
    if (d.peer->ep != nullptr && d.peer->process.Same(process)) return true;
  }
  // Not a push reader's endpoint: it maps nothing of the process (push READs move host memory
  // by active messages), and it stays open for as long as its reader lives, so a peer endpoint
  // it kept open would stay open for good, one more per add and remove of that peer.
  return false;
}

void UcxBackend::CloseEndpoint(ucp_ep_h ep, bool peer_mode) {
  if (ep == nullptr) return;
  ucp_request_param_t p{};
  p.op_attr_mask = UCP_OP_ATTR_FIELD_FLAGS;
  // FORCE (no handshake with a peer that may be gone; anything still posted is cancelled) is
  // for endpoints with peer-failure detection only: on the others UCX refuses it and closes
  // nothing, which left every same-host endpoint open, its peer's shared-memory segments
  // attached and its GPU memory mapped, until the worker was destroyed. Those are closed by a
  // flush, which their transports (shared memory, cma, cuda_ipc) complete locally.
  p.flags = peer_mode ? UCP_EP_CLOSE_FLAG_FORCE : 0;
  ucs_status_ptr_t r = api_->ep_close_nbx(ep, &p);
  if (r == nullptr || UCS_PTR_IS_ERR(r)) return;
  api_->worker_progress(worker_);
  if (api_->request_check_status(r) == UCS_INPROGRESS) {
    closing_.push_back(r);
    return;
  }
  api_->request_free(r);
}

bool UcxBackend::FinishClosing() {
  const std::size_t before = closing_.size();
  std::erase_if(closing_, [&](ucs_status_ptr_t r) {
    if (api_->request_check_status(r) == UCS_INPROGRESS) return false;
    api_->request_free(r);
    return true;
  });
  return closing_.size() != before;
}

void UcxBackend::Shutdown() {
  // Batches never started complete as aborted.
  RunCommands();
  ActivateSubmitted();
  for (auto& ab : active_) {
    if (!ab.Finished()) {
      ab.stop = true;
      if (ab.error.ok()) ab.error = AbortedError("the ucx backend was destroyed");
      ConfirmStoppedWrites(ab);
    }
  }
  const bool drained = ProgressUntil(
      [&] {
        PollCudaCopies();
        return outstanding_ops_ == 0 &&
               std::none_of(active_.begin(), active_.end(),
                            [](const ActiveBatch& ab) { return ab.cuda_op != nullptr; });
      },
      Clock::now() + kDrainDeadline);

  std::vector<std::shared_ptr<PeerState>> peers;
  std::vector<std::shared_ptr<RemoteRegion>> remotes;
  std::vector<std::shared_ptr<LocalRegion>> regions;
  std::vector<std::shared_ptr<Allocation>> allocations;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    for (auto& [id, p] : peers_) peers.push_back(p);
    for (auto& [id, r] : remotes_) remotes.push_back(r);
    for (DrainingPeer& d : draining_) {
      peers.push_back(d.peer);
      remotes.insert(remotes.end(), d.imports.begin(), d.imports.end());
    }
    draining_.clear();
    for (auto& [id, r] : regions_) regions.push_back(r);
    for (auto& [addr, a] : allocations_) allocations.push_back(a);
    peers_.clear();
    remotes_.clear();
    regions_.clear();
    allocations_.clear();
  }
  auto destroy_rkeys = [&] {
    for (auto& r : remotes) {
      if (r->rkey != nullptr) api_->rkey_destroy(r->rkey);
      r->rkey = nullptr;
    }
  };
  if (drained) destroy_rkeys();
  for (auto& p : peers) {
    p->closed.store(true);
    CloseEndpoint(std::exchange(p->ep, nullptr), p->peer_mode);
  }
  for (const KeptEndpoint& kept : released_) CloseEndpoint(kept.ep, kept.peer_mode);
  for (const KeptEndpoint& kept : kept_open_) CloseEndpoint(kept.ep, kept.peer_mode);
  released_.clear();
  kept_open_.clear();
  // Push jobs send nothing more; closing their readers' endpoints cancels what UCX still holds.
  push_requests_.clear();
  for (auto& job : push_jobs_) job.dropped = true;
  for (auto& [address, reader] : push_readers_) {
    CloseEndpoint(std::exchange(reader->ep, nullptr), reader->peer_mode);
  }
  push_readers_.clear();
  if (!drained) destroy_rkeys();
  // Operations the forced close cancelled report through their callbacks; flush closes end.
  ProgressUntil(
      [&] {
        FinishClosing();
        return outstanding_ops_ == 0 && push_sends_ == 0 && closing_.empty();
      },
      Clock::now() + kCancelDeadline);
  for (auto& ab : active_) {
    if (ab.cuda_op != nullptr) {
      LoadCudaCopy().api->release_op(ab.cuda_op);  // waits for the kernel
      ab.cuda_op = nullptr;
    }
  }
  failed_peers_.clear();
  FinishBatches();
  // Every batch completes exactly once, also one whose operations UCX never returned. Those stay
  // allocated until the worker is gone: UCX may still call their callbacks while it is destroyed.
  std::list<ActiveBatch> stuck;
  std::vector<Completion> stuck_done;
  for (auto& ab : active_) {
    {
      std::lock_guard<std::mutex> lock(mutex_);
      ab.local->inflight--;
    }
    Status st = ab.error.ok() ? AbortedError("the ucx backend was destroyed") : ab.error;
    stuck_done.push_back({ab.batch->token, std::move(st), WritesUnconfirmed(ab)});
  }
  stuck.splice(stuck.end(), active_);
  stuck.splice(stuck.end(), abandoned_);
  push_reads_.clear();
  // Jobs whose sends UCX never returned stay allocated with the batches above.
  std::list<PushJob> stuck_jobs;
  stuck_jobs.splice(stuck_jobs.end(), push_jobs_);
  Deliver(stuck_done);
  for (auto& [device, queue] : cuda_queues_) LoadCudaCopy().api->destroy_queue(queue);
  cuda_queues_.clear();
  for (auto& r : regions) {
    if (!r->alloc && r->memh != nullptr) api_->mem_unmap(context_, r->memh);
    r->memh = nullptr;
  }
  for (auto& a : allocations) {
    api_->mem_unmap(context_, a->memh);
    a->memh = nullptr;
  }
  api_->worker_destroy(worker_);
  worker_ = nullptr;
  api_->cleanup(context_);
  context_ = nullptr;
  stuck.clear();
  stuck_jobs.clear();
}

// ---- entry points -----------------------------------------------------------------------------

Status ProbeUcx(const BackendOptions& options) {
  MORIIO_ASSIGN_OR_RETURN(UcxOptions opts, ParseUcxOptions(options));
  MORIIO_ASSIGN_OR_RETURN(const UcxApi* api, LoadUcx(opts.library_path));
  (void)api;
  return Status::OK();
}

Result<std::unique_ptr<Backend>> CreateUcxBackend(const BackendOptions& options,
                                                  std::shared_ptr<CompletionSink> sink) {
  if (!sink) return InvalidArgumentError("the ucx backend needs a completion sink");
  MORIIO_ASSIGN_OR_RETURN(UcxOptions opts, ParseUcxOptions(options));
  MORIIO_ASSIGN_OR_RETURN(const UcxApi* api, LoadUcx(opts.library_path));
  auto backend = std::make_unique<UcxBackend>(api, std::move(opts), std::move(sink));
  MORIIO_RETURN_IF_ERROR(backend->Init());
  return std::unique_ptr<Backend>(std::move(backend));
}

}  // namespace moriio_native::detail::ucx
