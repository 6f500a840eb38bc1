#pragma once

// Completion tracking: drives every transfer to exactly one terminal state and queues one event
// for it. Used by the engine; tested on its own (tests/cpp/transfer_tracker_test.cpp).

#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <mutex>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <thread>
#include <unordered_map>
#include <unordered_set>
#include <vector>

#include "moriio_native/engine.hpp"
#include "moriio_native/status.hpp"

namespace moriio_native::detail {

/// How a batch hands its bytes to the backend: runs, a stamped batch (Batch::stamps) or cells
/// (Batch::cells). Counted per transfer in TransferEvent's stamped_batches and cell_batches.
enum class BatchShape { kRuns, kStamped, kCells };

/// Thread-safe (one mutex). Terminal rules:
/// - a transfer is "open" while batches may still be added: a READ until CloseRead, a WRITE
///   until it was sealed for N writes and N distinct layers were scheduled;
/// - a terminal event is reported only when none of the transfer's batches is in flight (the
///   backend contract: a batch completes once none of its operations can write any more). Past
///   its deadline a transfer ends as timed out once its batches drain; after a second timeout
///   period it ends regardless (unless a BeginWrites call still holds it), with `drained` false:
///   its destination is QUARANTINED, and once
///   its last batch completed the id is reported exactly once by PollDrained -- never when a
///   batch's writes were left unconfirmed by the transport (OnBatchUnconfirmed), which also ends
///   its transfer with `drained` false;
/// - aborted beats timed out beats failed beats done; done needs a seal (WRITE), every expected
///   write scheduled and every batch finished;
/// - a WRITE fails (once) as soon as a write failed or was refused (FailWrite) and none is in
///   flight; later writes of it are refused;
/// - a WRITE id is never a READ id: write calls on a READ id are InvalidArgument, no-ops;
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
  /// the transfer is failed, aborted, timed out or terminal (nothing recorded then). `shape`:
  /// how the batch goes to the backend.
  /// InvalidArgument (nothing recorded) when `id` is a READ; InvalidArgument that also fails the
  /// transfer when it writes to another peer or this layer is one more than its seal expects.
  /// `what`: a digest of the write's arguments (its blocks and windows); a repeat of a layer
  /// with another digest fails the transfer, as below.
  Result<std::optional<std::uint64_t>> ScheduleWrite(std::string_view id, std::string_view layer,
                                                     std::string_view peer, std::int64_t bytes,
                                                     std::int64_t runs,
                                                     BatchShape shape = BatchShape::kRuns,
                                                     std::uint64_t what = 0);
  /// WRITE: atomically records that the distinct `layers` of `id` are scheduled (creating the
  /// transfer) and holds it open for their batches: AddBatch adds them, EndWrites releases the
  /// hold; the transfer cannot end while held (past its deadline it ends timed out when the
  /// hold is released; the deadline's quarantine waits for that). `what`: a digest of the
  /// write's arguments (its blocks and windows: the peer is checked apart). Returns false,
  /// recording nothing, when every one of `layers` was scheduled before by a write of the same
  /// digest or the transfer is failed, aborted, timed out or terminal. InvalidArgument (nothing
  /// recorded) when `id` is a READ or `layers` is empty or names a layer twice; InvalidArgument
  /// that also fails the transfer when it writes to another peer, some but not all of `layers`
  /// were scheduled before, or all of them but by a write of other arguments (both the
  /// caller's: an ambiguous retry, whose blocks would otherwise never be written), or they are
  /// more than its seal expects.
  Result<bool> BeginWrites(std::string_view id, std::span<const std::string> layers,
                           std::string_view peer, std::uint64_t what = 0);
  /// WRITE: whether `id` is a live WRITE (pending, not failed, aborted or timed out) that
  /// scheduled every one of `layers` before, each by a write of digest `what`: a write of them
  /// repeats it and does nothing. Lets a caller answer such a call before checking its
  /// arguments, so that a repeated write never fails the live transfer it repeats.
  /// InvalidArgument when every one of `layers` was scheduled but one by a write of another
  /// digest: that write's blocks would never be written (a layer is written once per transfer).
  /// Read-only: the transfer goes on with what was scheduled.
  Result<bool> RepeatsScheduledWrites(std::string_view id, std::span<const std::string> layers,
                                      std::uint64_t what = 0) const;
  /// WRITE: releases BeginWrites' hold; the transfer ends now if it can. Unknown ids: ignored.
  /// Allocates nothing (a caller's destructor may call it).
  void EndWrites(const std::string& id);
  /// WRITE: the caller schedules exactly `expected_writes` distinct layers for this transfer
  /// (before or after this call); it is done once they all completed. 0 says "nothing to send"
  /// and completes an unwritten transfer at once. Creates the transfer when none exists.
  /// InvalidArgument (no change) for a READ id, another peer, a negative count or a second seal
  /// with a different count; InvalidArgument that fails the transfer when more layers were
  /// scheduled already. True when the seal belongs to a live transfer (it made, sealed or
  /// re-sealed it); false for a terminal WRITE id (a late seal, or a reused id): ignored, no
  /// event follows from it. `peer_connected` false: a seal that would create the transfer is
  /// NotFound instead (nothing could ever write it, and with 0 writes it would be reported
  /// done to a peer that does not exist).
  Result<bool> Seal(std::string_view id, std::string_view peer, std::int64_t expected_writes,
                    bool peer_connected = true);
  /// WRITE: a write of this transfer was refused (`why`): the transfer fails (creating it when
  /// none exists), so a seal can no longer make it done. InvalidArgument (no change) when `id`
  /// is a READ; ignored for terminal WRITE ids.
  Status FailWrite(std::string_view id, std::string_view peer, const Status& why);

  /// Adds an in-flight batch of `bytes` in `runs` runs (of `shape`) to an open READ or a WRITE
  /// held by BeginWrites; returns its token. FailedPrecondition when the transfer is no longer
  /// pending, or no longer takes batches (a READ closed, a held WRITE aborted, timed out or
  /// failed).
  Result<std::uint64_t> AddBatch(std::string_view id, std::int64_t bytes, std::int64_t runs,
                                 BatchShape shape = BatchShape::kRuns);
  /// A batch finished (ok or not). Unknown tokens are ignored.
  void OnBatchComplete(std::uint64_t token, const Status& status);
  /// A WRITE batch finished without the transport confirming its writes (see
  /// CompletionSink::OnBatchUnconfirmed): its bytes may still land at the peer, so its transfer
  /// ends with `drained` false and is never reported by PollDrained. Unknown tokens are ignored.
  void OnBatchUnconfirmed(std::uint64_t token, const Status& status);
  /// Fails every pending transfer with `peer` (the transport lost it).
  void FailPeer(std::string_view peer, const Status& status);

  /// Aborts a pending transfer. NotFound for ids never seen; OK (no-op) for terminal ones.
  Status Abort(std::string_view id);

  /// Ends transfers whose deadline passed.
  void ExpireDeadlines(Clock::time_point now);

  /// Up to `max_events` events, oldest first; waits up to `wait` for the first one. While 1 to
  /// kSpinBatches batches of pending transfers are in flight (a transfer's last batches: its
  /// event is at most their copy away) the wait spins, yielding the CPU between checks, instead
  /// of sleeping: a sleeping waiter took 0.15-0.28 ms to wake on the H200 machine, up to a tenth
  /// of a 2.5 ms request (docs/benchmarks.md). The spin lasts at most kMaxSpin after the
  /// in-flight count last changed, so a stalled batch (a stopped peer, until its deadline) is
  /// waited for asleep: on a CPU host the waiter shares the cores with the model. Otherwise it
  /// sleeps until an event, or until the in-flight count falls to kSpinBatches or changes below
  /// it. The spin ends with `wait` (a transfer past its deadline stops counting once it is
  /// quarantined).
  std::vector<TransferEvent> Drain(std::size_t max_events, std::chrono::milliseconds wait);

  /// In-flight batches of pending transfers at or below which Drain spins (see Drain).
  static constexpr std::size_t kSpinBatches = 2;
  /// How long Drain spins after the in-flight count last changed at or below kSpinBatches.
  static constexpr std::chrono::milliseconds kMaxSpin{2};

  /// Quarantined transfers whose last batch completed since the last call, oldest first (each
  /// exactly once). Never blocks.
  std::vector<DrainedTransfer> DrainQuarantine(std::size_t max);
  /// Number of quarantined transfers whose batches are still in flight.
  std::size_t quarantined() const;

  std::size_t pending() const;
  /// Transfers with `peer` that are pending or quarantined (batches of theirs may still be in
  /// flight): a peer with none may be disconnected without ending or stranding anything.
  std::size_t TransfersWith(std::string_view peer) const;
  bool IsTerminal(std::string_view id) const;
  /// Batches in flight for pending transfers (not for quarantined ones): what Drain's spin
  /// looks at.
  std::size_t live_batches() const;

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
    std::int64_t writers = 0;  // WRITE: BeginWrites holds not yet released (EndWrites)
    std::int64_t batches = 0;
    std::int64_t stamped_batches = 0;
    std::int64_t cell_batches = 0;
    std::int64_t bytes = 0;
    std::int64_t runs = 0;
    // WRITE: scheduled layers, each with the digest of the write that scheduled it.
    std::unordered_map<std::string, std::uint64_t> layers;
    std::optional<std::int64_t> expected;     // WRITE: the sealed number of layers
    bool unconfirmed = false;  // a batch's writes may still land: never drained
  };

  // OnBatchComplete and OnBatchUnconfirmed under mu_.
  void CompleteBatchLocked(std::uint64_t token, const Status& status, bool unconfirmed);
  // Emits the terminal event if `t` can end now; returns true when it ended. Holds mu_.
  bool MaybeFinishLocked(const std::string& id, Transfer& t);
  void FinishLocked(const std::string& id, Transfer& t, TransferState state, std::string message,
                    bool drained = true);
  void RememberTerminalLocked(const std::string& id, TransferKind kind);
  Transfer& CreateLocked(const std::string& id, TransferKind kind, std::string_view peer);
  std::uint64_t AddBatchLocked(const std::string& id, Transfer& t, std::int64_t bytes,
                               std::int64_t runs, BatchShape shape);
  // InvalidArgument when `id` (pending or recently terminal) is a READ.
  Status CheckNotReadLocked(const std::string& id) const;
  // BeginWrites under mu_, the layers checked distinct and non-empty.
  Result<bool> BeginWritesLocked(const std::string& id, std::span<const std::string> layers,
                                 std::string_view peer, std::uint64_t what);
  // EndWrites under mu_, for a pending `t`.
  void EndWritesLocked(const std::string& id, Transfer& t);
  void FailLocked(const std::string& id, Transfer& t, std::string why);
  bool LastBatchesInFlightLocked() const;  // 1 to kSpinBatches live batches
  void OnLiveBatchesChangedLocked();
  bool SpinningLocked(Clock::time_point now) const;

  // A transfer that ended while batches were in flight: reported by DrainQuarantine once the
  // last of them completed.
  struct Quarantined {
    TransferKind kind;
    std::string peer;
    Clock::time_point start;
    std::int64_t in_flight = 0;
    bool unconfirmed = false;  // a batch's writes may still land: never reported drained
  };

  const std::chrono::milliseconds timeout_;
  const std::size_t terminal_history_;
  mutable std::mutex mu_;
  std::condition_variable events_cv_;
  std::unordered_map<std::string, Transfer> pending_;
  std::unordered_map<std::uint64_t, std::string> tokens_;  // in-flight batch -> transfer id
  std::unordered_map<std::string, TransferKind> terminal_;
  std::deque<std::string> terminal_order_;
  std::deque<TransferEvent> events_;
  std::size_t live_batches_ = 0;  // in flight for pending transfers (not quarantined ones)
  Clock::time_point spin_until_{};  // Drain spins until then (see OnLiveBatchesChangedLocked)
  std::unordered_map<std::string, Quarantined> quarantined_;
  std::deque<DrainedTransfer> drained_;
  std::uint64_t next_token_ = 1;
};

}  // namespace moriio_native::detail
