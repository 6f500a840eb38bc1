#pragma once

/// Configuration keys of the UCX backend (BackendOptions, i.e. the connector's extra config).
///
///   ucx_library_path  libucp to load: the file, or the directory holding libucp.so.0. Empty: the
///                     environment variable MORIIO_NATIVE_UCX_LIBRARY_PATH, then the system's
///                     libucp.so.0. The Python facade fills it in from the libucx wheel when that
///                     is installed and the key is not set.
///   ucx_tls           UCX transports (UCX_TLS syntax, e.g. "sm,self" or "^cma"). Overrides the
///                     environment variable UCX_TLS. Empty: UCX's default selection.
///   ucx_net_devices   Network devices (UCX_NET_DEVICES syntax, e.g. "mlx5_0:1" or "lo").
///                     Overrides UCX_NET_DEVICES. Empty: all.
///   progress_mode     "thread" (default): one progress thread per backend that sleeps on the
///                     worker's event fd when idle. "busy": the thread never sleeps (lowest
///                     latency, burns one core).
///   ucx_direct_copy   "auto" (default): when ucp_rkey_ptr maps a peer region into this process
///                     (same host and the peer allocated it through UCX, or CUDA IPC), copy with
///                     memcpy / one gather-scatter kernel instead of one UCX operation per run.
///                     "off": always use ucp_put/ucp_get.
///   ucx_error_handling
///                     "auto" (default): endpoints to a peer on another host detect its death
///                     (UCP_ERR_HANDLING_MODE_PEER) and fail its batches; endpoints on one host
///                     do not ask for it, because UCX's shared-memory transports (sysv, posix,
///                     cma, cuda_ipc) cannot provide it and RMA would fall back to emulation over
///                     tcp (a dead same-host peer still fails cma operations with an error;
///                     over network transports the progress thread watches a same-host peer
///                     itself, or asks for peer mode when it cannot prove the peer's identity).
///                     "peer": always ask (and fail to connect when impossible). "none": never
///                     ask (UCX may then abort the process when a remote peer dies).
///   ucx_read_push     "auto" (default): a READ of host memory over UCX operations from a peer
///                     whose endpoint reaches it only through transports that serve a get in
///                     software (tcp, ud: the target's UCX answers each get itself, and UCX 1.22
///                     aborts the target when the reader died meanwhile) is served by the target
///                     instead: the reader asks for the runs with one active message, the target
///                     sends the bytes back as active messages and the reader copies them in.
///                     Only with a peer that serves push READs (this version or newer).
///                     "on": every such READ pushed, whatever the transports (tests, benchmarks).
///                     "off": always ucp_get_nbx.
///   ucx_push_queue    Push READ requests this backend holds at once as a target, serving or
///                     waiting to start (default 4096, 1..1048576). A request beyond them is
///                     answered "failed" at once (the target is busy): its reader recomputes
///                     instead of waiting for its deadline.
///   ucx_stamps        "on" (default): where a batch runs on the CUDA copy path (above), the
///                     engine hands the backend stamped batches (each layer's template and the
///                     request's block ids, backend.hpp BatchStamps) and one kernel computes every
///                     run's offsets, instead of the engine planning one entry per run (measured
///                     faster for 4 KiB to 72 KiB runs, READ and WRITE: docs/benchmarks.md).
///                     "off": runs only (the path before; for comparisons).
///   ucx_region_check_timeout_ms
///                     How long a region check (docs/backends-ucx.md) waits for the region's
///                     owner to answer before it fails its batches (default 5000, 1 ms to a
///                     year). The engine sets it to its transfer_timeout when the key is not
///                     given, so no check fails a batch before the transfer's own deadline (a
///                     peer frozen for seconds on a loaded host answers late, not never).
///   ucx_config        Extra UCX settings, "NAME=VALUE;NAME=VALUE" (NAME with or without the UCX_
///                     prefix), applied with ucp_config_modify after the environment is read.
///
/// Defaults applied only when neither the environment (UCX_<NAME>) nor ucx_config sets them:
///   CUDA_IPC_ENABLE_GET_ZCOPY=y and PROTO_EMULATION_ENABLE=n on machines with a CUDA driver
///   (reads of GPU memory would otherwise be emulated at < 1 GB/s and hang on a passive peer);
///   TLS=^cma when process_vm_readv is refused in this process (seccomp, missing CAP_SYS_PTRACE).
/// Other keys: CreateBackend refuses unknown ucx_* keys and ignores other backends' keys (see
/// BackendOptions); ParseUcxOptions itself reads only the keys above.

#include <chrono>
#include <cstddef>
#include <string>
#include <utility>
#include <vector>

#include "moriio_native/backend.hpp"
#include "moriio_native/status.hpp"

namespace moriio_native::detail::ucx {

/// The keys above, for BackendPlugin::options (nullptr-terminated).
inline constexpr const char* kUcxOptionKeys[] = {
    "ucx_library_path", "ucx_tls", "ucx_net_devices", "progress_mode", "ucx_direct_copy",
    "ucx_error_handling", "ucx_read_push", "ucx_push_queue", "ucx_stamps",
    "ucx_region_check_timeout_ms", "ucx_config", nullptr};

enum class ProgressMode { kThread, kBusy };
enum class ErrorHandling { kAuto, kPeer, kNone };
enum class ReadPush { kAuto, kOn, kOff };


struct UcxOptions {
  std::string library_path;
  std::string tls;
  std::string net_devices;
  ProgressMode progress_mode = ProgressMode::kThread;
  bool direct_copy = true;
  ErrorHandling error_handling = ErrorHandling::kAuto;
  ReadPush read_push = ReadPush::kAuto;
  std::size_t push_queue = 4096;
  bool stamps = true;
  std::chrono::milliseconds region_check_timeout{5000};
  /// NAME (without UCX_) -> VALUE, in the order given.
  std::vector<std::pair<std::string, std::string>> config;
};

/// Parses and validates the keys above. InvalidArgument names the key and the bad value.
/// Pure function: thread-safe, never blocks.
Result<UcxOptions> ParseUcxOptions(const BackendOptions& options);

}  // namespace moriio_native::detail::ucx
