#pragma once

// Completion tracking: drives every transfer to exactly one terminal state and queues one event
// for it. Used by the engine; tested on its own (tests/cpp/transfer_tracker_test.cpp).

#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <mutex>
#include <optional>
#include <string>
#include <string_view>
#include <unordered_map>
#include <unordered_set>
#include <vector>

#include "moriio_native/engine.hpp"
#include "moriio_native/status.hpp"

namespace moriio_native::detail {

/// Thread-safe (one mutex). Terminal rules:
/// - a transfer is "open" while batches may still be added: a READ until CloseRead, a WRITE
///   until Seal;
/// - it never ends while any of its batches is in flight (blocks stay untouched until the
///   transport is done with them); past its deadline it ends as timed out once they drain, or
///   after a second timeout period regardless (the event then says batches were in flight);
/// - aborted beats timed out beats failed beats done; done needs closed and every batch
///   finished;
/// - a WRITE fails (once) as soon as a write failed and none is in flight; later writes of it are
///   refused;
/// - events for unknown or terminal transfers are ignored; the last `terminal_history` terminal
///   ids are remembered so late writes/seals for them are ignored rather than starting anew.
class TransferTracker {
 public:
  using Clock = std::chrono::steady_clock;

  TransferTracker(std::chrono::milliseconds timeout, std::size_t terminal_history);

  /// Starts an (open) READ. AlreadyExists if the id is pending or recently terminal.
  Status BeginRead(std::string_view id, std::string_view peer);
  /// READ: no more batches; completes now if none is outstanding.
  void CloseRead(std::string_view id);

  /// WRITE: atomically records that (id, layer) is scheduled (creating the transfer) and adds its
  /// in-flight batch. Returns the batch token, or nullopt when the layer was scheduled before or
  /// the transfer is sealed, failed, aborted or terminal (nothing recorded then).
  /// InvalidArgument when the transfer already writes to another peer.
  Result<std::optional<std::uint64_t>> ScheduleWrite(std::string_view id, std::string_view layer,
                                                     std::string_view peer, std::int64_t bytes,
                                                     std::int64_t runs);
  /// WRITE: fixes the expected writes to those scheduled; creates an empty transfer (which
  /// completes at once) when none was scheduled. Ignored for terminal ids.
  void Seal(std::string_view id, std::string_view peer);

  /// READ: adds an in-flight batch of `bytes` in `runs` runs to an open READ; returns its token
  /// (FailedPrecondition if the transfer is no longer pending, e.g. it timed out).
  Result<std::uint64_t> AddBatch(std::string_view id, std::int64_t bytes, std::int64_t runs);
  /// A batch finished (ok or not). Unknown tokens are ignored.
  void OnBatchComplete(std::uint64_t token, const Status& status);
  /// Fails every pending transfer with `peer` (the transport lost it).
  void FailPeer(std::string_view peer, const Status& status);

  /// Aborts a pending transfer. NotFound for ids never seen; OK (no-op) for terminal ones.
  Status Abort(std::string_view id);

  /// Ends transfers whose deadline passed.
  void ExpireDeadlines(Clock::time_point now);

  /// Up to `max_events` events, oldest first; waits up to `wait` for the first one.
  std::vector<TransferEvent> Drain(std::size_t max_events, std::chrono::milliseconds wait);

  std::size_t pending() const;
  bool IsTerminal(std::string_view id) const;

 private:
  struct Transfer {
    TransferKind kind;
    std::string peer;
    Clock::time_point start;
    Clock::time_point deadline;
    bool open = true;
    bool aborted = false;
    bool timed_out = false;  // deadline passed; ends when in-flight batches drain
    std::string failure;  // first failure message; non-empty = failed
    std::int64_t in_flight = 0;
    std::int64_t batches = 0;
    std::int64_t bytes = 0;
    std::int64_t runs = 0;
    std::unordered_set<std::string> layers;  // WRITE: scheduled layers
    std::vector<std::uint64_t> tokens;       // every batch token, to forget them at the end
  };

  // Emits the terminal event if `t` can end now; returns true when it ended. Holds mu_.
  bool MaybeFinishLocked(const std::string& id, Transfer& t);
  void FinishLocked(const std::string& id, Transfer& t, TransferState state, std::string message);
  void RememberTerminalLocked(const std::string& id);
  Transfer& CreateLocked(const std::string& id, TransferKind kind, std::string_view peer);
  std::uint64_t AddBatchLocked(const std::string& id, Transfer& t, std::int64_t bytes,
                               std::int64_t runs);

  const std::chrono::milliseconds timeout_;
  const std::size_t terminal_history_;
  mutable std::mutex mu_;
  std::condition_variable events_cv_;
  std::unordered_map<std::string, Transfer> pending_;
  std::unordered_map<std::uint64_t, std::string> tokens_;  // in-flight batch -> transfer id
  std::unordered_set<std::string> terminal_;
  std::deque<std::string> terminal_order_;
  std::deque<TransferEvent> events_;
  std::uint64_t next_token_ = 1;
};

}  // namespace moriio_native::detail
