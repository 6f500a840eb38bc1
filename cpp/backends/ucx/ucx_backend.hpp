#pragma once

/// The UCX backend: UCP one-sided RMA (ucp_put_nbx / ucp_get_nbx) between registered regions of
/// two processes, with a direct-copy fast path when ucp_rkey_ptr maps the peer's region into this
/// process. See docs/backends-ucx.md for the configuration keys and the data paths.

#include <cstdint>
#include <memory>

#include "moriio_native/backend.hpp"
#include "moriio_native/status.hpp"

namespace moriio_native::detail::ucx {

/// OK when UCX can be loaded with these options; BackendUnavailable naming the library and the
/// reason otherwise; InvalidArgument for a bad option. Thread-safe; may block while UCX loads.
Status ProbeUcx(const BackendOptions& options);

/// Creates a backend with its own UCP context, worker and progress thread. Thread-safe; blocks
/// while UCX initialises. The backend keeps `sink` alive and calls it from its progress thread.
Result<std::unique_ptr<Backend>> CreateUcxBackend(const BackendOptions& options,
                                                  std::shared_ptr<CompletionSink> sink);

inline constexpr int kPathCount = 5;

/// Batches started per data path since the process started, over every UCX backend:
/// [0] UCX operations, [1] host memcpy through ucp_rkey_ptr, [2] CUDA gather/scatter kernel,
/// [3] batched process_vm_readv/writev to a proven same-host peer, [4] push READ (the target
/// sends the runs as active messages).
/// For tests and diagnostics (which path a configuration really takes). Thread-safe.
void PathCounters(std::uint64_t out[kPathCount]);

/// Push READ requests this process's UCX backends dropped as targets without answering them:
/// too malformed to name their reader, no endpoint to the reader, or beyond the bounds on
/// refusals (ucx_backend.cpp, kMaxPushRefusals). For diagnostics and tests. Thread-safe.
std::uint64_t UnansweredPushRequests();

}  // namespace moriio_native::detail::ucx
