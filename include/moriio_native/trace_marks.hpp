#pragma once

/// Host-side timing marks on a transfer's path, for profiling (bench/gpu_bench.py --timeline):
/// steady-clock stamps taken where a request crosses from the caller into the engine, from the
/// engine into the backend, and from the backend's progress thread into the copy. Compiled in
/// only when the build sets MORIIO_NATIVE_TRACE_MARKS (CMake option of the same name); without
/// it Record is an empty inline function and Enable refuses. Compiled in but not enabled, a mark
/// costs one call and one relaxed atomic load. The recorder is one per process (the engine, the
/// backends and the bindings share it), bounded: stamps past its capacity are counted, not kept.

#include <cstddef>
#include <cstdint>
#include <string_view>
#include <vector>

#include "moriio_native/status.hpp"

namespace moriio_native::trace {

/// Where a stamp was taken, in the order a request passes them: binding_entry, call_entry,
/// pairs_checked, layers_planned, planned, then per batch piece_cut, submit_entry, submit_exit
/// on the calling thread and activated, copy_submit_entry, copy_submit_exit on the backend's
/// progress thread (UCX), and call_exit; wake_sent and woke where a call wakes the progress
/// thread from its sleep. The numbering is this build's, not a stable ABI.
enum class Mark : std::uint8_t {
  kCallEntry = 0,     ///< Engine::Read / WriteLayer entered (token 0)
  kPlanned,           ///< the transfer exists and its batches are sized: pieces are cut next
  kPieceCut,          ///< a piece (one batch) cut by the batch builder (token 0: not numbered yet)
  kSubmitEntry,       ///< Backend::Submit entered by the engine (token: the batch's)
  kSubmitExit,        ///< Backend::Submit returned to the engine (token: the batch's)
  kCallExit,          ///< Engine::Read / WriteLayer returns (token 0)
  kActivated,         ///< the progress thread took the batch off its queue (token: the batch's)
  kCopySubmitEntry,   ///< the progress thread calls the copy plugin's submit (token: the batch's)
  kCopySubmitExit,    ///< that submit returned: table written, kernel launched (token: the batch's)
  kBindingEntry,      ///< the Python binding of read / write_layer entered (before the ids' copy)
  kPairsChecked,      ///< the block id pairs copied, checked and sorted (BlockPairs; token 0)
  kLayersPlanned,     ///< every layer's link and ids checked (before the transfer exists; token 0)
  kWakeSent,          ///< a caller wrote the sleeping progress thread's wake fd (UCX; token 0)
  kWoke,              ///< the progress thread returned from its sleep (UCX; token: fds ready)
};
inline constexpr std::size_t kMarkCount = 14;

/// The mark's name ("call_entry", "planned", ...), as gpu_bench's timeline lists it.
std::string_view MarkName(Mark mark);

/// One stamp: the mark, std::chrono::steady_clock nanoseconds since its epoch (CLOCK_MONOTONIC
/// on Linux, the clock of Python's time.monotonic_ns), the batch token (0 where none), and the
/// recording thread as a small number (1 for the first thread that recorded, 2 for the next...).
struct Stamp {
  Mark mark = Mark::kCallEntry;
  std::int64_t ns = 0;
  std::uint64_t token = 0;
  std::uint32_t thread = 0;
};

/// True when this build has the marks compiled in.
bool CompiledIn();

/// Clears the recorder and starts recording, at most `capacity` stamps (1 .. 2^24) until
/// Disable. FailedPrecondition when the marks are not compiled in, InvalidArgument for a
/// capacity out of range (no change either way). Thread-safe; allocates the capacity up front.
Status Enable(std::size_t capacity);

/// Stops recording; the stamps stay until Take or the next Enable. Thread-safe.
void Disable();

/// The stamps recorded since Enable or the last Take, in recording order, and how many were
/// dropped for lack of capacity (reset by this call). Recording goes on if enabled. Thread-safe.
struct Taken {
  std::vector<Stamp> stamps;
  std::uint64_t dropped = 0;
};
Taken Take();

#ifdef MORIIO_NATIVE_TRACE_MARKS
/// Records `mark` now when enabled. Thread-safe, never blocks for long (one short lock).
void Record(Mark mark, std::uint64_t token = 0);
#else
inline void Record(Mark /*mark*/, std::uint64_t /*token*/ = 0) {}
#endif

}  // namespace moriio_native::trace
