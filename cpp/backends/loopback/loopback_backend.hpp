#pragma once

// The loopback backend: peers are other loopback backends in the same process; transfers are
// real memcpy on a worker thread, so completions arrive asynchronously as with a real transport.

#include <memory>
#include <string_view>

#include "moriio_native/backend.hpp"

namespace moriio_native::detail {

/// The option keys the loopback backend accepts (see BackendOptions).
inline constexpr std::string_view kLoopbackOptionKeys[] = {"loopback_delay_ms", "loopback_cells",
                                                           "loopback_stamps"};

/// Options: "loopback_delay_ms" (sleep before each batch, for tests of pending/timeout paths);
/// "loopback_cells" ("1", the default: cell batches between any two regions, copied with the CPU
/// reference CopyBlockCells; "0": runs only, so tests reach the engine's run fallback);
/// "loopback_stamps" ("0", the default: runs; "1": stamped batches between any two regions,
/// copied with the CPU reference CopyStampedRuns, so CPU tests reach the engine's stamped path).
Result<std::unique_ptr<Backend>> CreateLoopbackBackend(const BackendOptions& options,
                                                       std::shared_ptr<CompletionSink> sink);

}  // namespace moriio_native::detail
