#include "transfer_tracker.hpp"

#include <algorithm>

namespace moriio_native::detail {

TransferTracker::TransferTracker(std::chrono::milliseconds timeout, std::size_t terminal_history)
    : timeout_(timeout), terminal_history_(std::max<std::size_t>(terminal_history, 1)) {}

TransferTracker::Transfer& TransferTracker::CreateLocked(const std::string& id, TransferKind kind,
                                                          std::string_view peer) {
  Transfer& t = pending_[id];
  t.kind = kind;
  t.peer = std::string(peer);
  t.start = Clock::now();
  t.deadline = t.start + timeout_;
  return t;
}

Status TransferTracker::BeginRead(std::string_view id_view, std::string_view peer) {
  std::string id(id_view);
  std::lock_guard lock(mu_);
  if (pending_.count(id) || terminal_.count(id)) {
    return AlreadyExistsError("transfer '" + id + "' exists already");
  }
  if (quarantined_.count(id)) {
    return AlreadyExistsError("transfer '" + id + "' is quarantined: its batches still run");
  }
  CreateLocked(id, TransferKind::kRead, peer);
  return Status::OK();
}

void TransferTracker::CloseRead(std::string_view id_view) {
  std::string id(id_view);
  std::lock_guard lock(mu_);
  auto it = pending_.find(id);
  if (it == pending_.end()) return;
  it->second.open = false;
  MaybeFinishLocked(id, it->second);
}

Status TransferTracker::CheckNotReadLocked(const std::string& id) const {
  // Pending, recently terminal, or quarantined (which may outlive its terminal record).
  bool read = false;
  if (auto it = pending_.find(id); it != pending_.end()) {
    read = it->second.kind == TransferKind::kRead;
  } else if (auto t = terminal_.find(id); t != terminal_.end()) {
    read = t->second == TransferKind::kRead;
  } else if (auto q = quarantined_.find(id); q != quarantined_.end()) {
    read = q->second.kind == TransferKind::kRead;
  }
  if (read) return InvalidArgumentError("transfer '" + id + "' is a READ, not a WRITE");
  return Status::OK();
}

void TransferTracker::FailLocked(const std::string& id, Transfer& t, std::string why) {
  if (t.failure.empty()) t.failure = std::move(why);
  t.open = false;
  MaybeFinishLocked(id, t);
}

Result<bool> TransferTracker::BeginWrites(std::string_view id_view,
                                          std::span<const std::string> layers,
                                          std::string_view peer, std::uint64_t what) {
  std::string id(id_view);
  if (layers.empty()) return InvalidArgumentError("transfer '" + id + "': a write names no layers");
  std::unordered_set<std::string_view> named;
  for (const std::string& layer : layers) {
    if (!named.insert(layer).second) {
      return InvalidArgumentError("transfer '" + id + "': layer '" + layer +
                                  "' is named twice in one write");
    }
  }
  std::lock_guard lock(mu_);
  return BeginWritesLocked(id, layers, peer, what);
}

Result<bool> TransferTracker::RepeatsScheduledWrites(std::string_view id,
                                                     std::span<const std::string> layers,
                                                     std::uint64_t what) const {
  std::lock_guard lock(mu_);
  auto it = pending_.find(std::string(id));
  if (it == pending_.end() || it->second.kind != TransferKind::kWrite) return false;
  const Transfer& t = it->second;
  if (!t.failure.empty() || t.aborted || t.timed_out) return false;
  if (!std::ranges::all_of(layers, [&](const std::string& l) { return t.layers.count(l) > 0; })) {
    return false;
  }
  const auto other = std::ranges::find_if(
      layers, [&](const std::string& l) { return t.layers.at(l) != what; });
  if (other == layers.end()) return true;
  return InvalidArgumentError(
      "transfer '" + std::string(id) + "': layer '" + *other +
      "' was scheduled before with other blocks, windows or peer; a layer is written once per "
      "transfer, and this write was not made (the transfer goes on with the first)");
}

Result<bool> TransferTracker::BeginWritesLocked(const std::string& id,
                                                std::span<const std::string> layers,
                                                std::string_view peer, std::uint64_t what) {
  MORIIO_RETURN_IF_ERROR(CheckNotReadLocked(id));
  if (terminal_.count(id) || quarantined_.count(id)) return false;
  auto it = pending_.find(id);
  Transfer& t = it != pending_.end() ? it->second : CreateLocked(id, TransferKind::kWrite, peer);
  if (!t.failure.empty() || t.aborted || t.timed_out) return false;
  auto scheduled = [&](const std::string& l) { return t.layers.count(l) > 0; };
  const auto repeated = static_cast<std::size_t>(std::ranges::count_if(layers, scheduled));
  auto by_other_write = [&](const std::string& l) { return t.layers.at(l) != what; };
  const bool same_write =
      repeated == layers.size() && std::ranges::none_of(layers, by_other_write);
  if (same_write && t.peer == peer) return false;  // the same write again
  Status refused;
  const std::size_t after = t.layers.size() + layers.size();
  if (t.peer != peer) {
    refused = InvalidArgumentError("transfer '" + id + "' writes to peer '" + t.peer + "', not '" +
                                   std::string(peer) + "'");
  } else if (repeated == layers.size()) {
    refused = InvalidArgumentError(
        "transfer '" + id + "': layer '" + *std::ranges::find_if(layers, by_other_write) +
        "' was scheduled before with other blocks or windows: a layer is written once per "
        "transfer (two writes of it at once)");
  } else if (repeated > 0) {
    refused = InvalidArgumentError(
        "transfer '" + id + "': layer '" + *std::ranges::find_if(layers, scheduled) +
        "' was scheduled before, but " +
        std::to_string(layers.size() - repeated) + " other layers of this write were not");
  } else if (t.expected && static_cast<std::int64_t>(after) > *t.expected) {
    const auto first_extra = static_cast<std::size_t>(*t.expected) - t.layers.size();
    refused = InvalidArgumentError("transfer '" + id + "' was sealed for " +
                                   std::to_string(*t.expected) + " writes; layer '" +
                                   layers[first_extra] + "' is one more");
  }
  if (!refused.ok()) {
    FailLocked(id, t, refused.ToString());
    return refused;
  }
  for (const std::string& layer : layers) t.layers.emplace(layer, what);
  ++t.writers;
  if (t.expected && static_cast<std::int64_t>(t.layers.size()) == *t.expected) t.open = false;
  return true;
}

void TransferTracker::EndWrites(const std::string& id) {
  std::lock_guard lock(mu_);
  auto it = pending_.find(id);
  if (it != pending_.end()) EndWritesLocked(id, it->second);
}

void TransferTracker::EndWritesLocked(const std::string& id, Transfer& t) {
  MORIIO_CHECK(t.writers > 0, "EndWrites without its BeginWrites");
  --t.writers;
  MaybeFinishLocked(id, t);
}

Result<std::optional<std::uint64_t>> TransferTracker::ScheduleWrite(std::string_view id_view,
                                                                    std::string_view layer,
                                                                    std::string_view peer,
                                                                    std::int64_t bytes,
                                                                    std::int64_t runs,
                                                                    BatchShape shape,
                                                                    std::uint64_t what) {
  std::string id(id_view);
  const std::string name(layer);
  std::lock_guard lock(mu_);
  MORIIO_ASSIGN_OR_RETURN(bool began, BeginWritesLocked(id, std::span(&name, 1), peer, what));
  if (!began) return std::optional<std::uint64_t>();
  Transfer& t = pending_.at(id);
  const std::uint64_t token = AddBatchLocked(id, t, bytes, runs, shape);
  EndWritesLocked(id, t);
  return std::optional<std::uint64_t>(token);
}

Result<bool> TransferTracker::Seal(std::string_view id_view, std::string_view peer,
                                   std::int64_t expected_writes, bool peer_connected) {
  std::string id(id_view);
  std::lock_guard lock(mu_);
  MORIIO_RETURN_IF_ERROR(CheckNotReadLocked(id));
  if (expected_writes < 0) {
    return InvalidArgumentError("transfer '" + id + "': expected_writes must be >= 0, got " +
                                std::to_string(expected_writes));
  }
  if (terminal_.count(id) || quarantined_.count(id)) return false;  // a late seal, or a reused id
  auto it = pending_.find(id);
  if (it != pending_.end()) {
    Transfer& t = it->second;
    if (t.peer != peer) {
      return InvalidArgumentError("transfer '" + id + "' writes to peer '" + t.peer +
                                  "', not '" + std::string(peer) + "'");
    }
    if (t.expected && *t.expected != expected_writes) {
      return InvalidArgumentError("transfer '" + id + "' was sealed for " +
                                  std::to_string(*t.expected) + " writes, not " +
                                  std::to_string(expected_writes));
    }
  }
  if (it == pending_.end() && !peer_connected) {
    return NotFoundError("transfer '" + id + "': seal names unknown peer '" + std::string(peer) +
                         "' and no write of it was made; nothing started");
  }
  Transfer& t = it != pending_.end() ? it->second : CreateLocked(id, TransferKind::kWrite, peer);
  if (t.expected) return true;  // the same seal again
  const auto scheduled = static_cast<std::int64_t>(t.layers.size());
  if (scheduled > expected_writes) {
    Status refused = InvalidArgumentError(
        "transfer '" + id + "' was sealed for " + std::to_string(expected_writes) + " writes but " +
        std::to_string(scheduled) + " were scheduled");
    FailLocked(id, t, refused.ToString());
    return refused;
  }
  t.expected = expected_writes;
  if (scheduled == expected_writes) t.open = false;
  MaybeFinishLocked(id, t);
  return true;
}

Status TransferTracker::FailWrite(std::string_view id_view, std::string_view peer,
                                  const Status& why) {
  std::string id(id_view);
  std::lock_guard lock(mu_);
  MORIIO_RETURN_IF_ERROR(CheckNotReadLocked(id));
  if (terminal_.count(id) || quarantined_.count(id)) return Status::OK();
  auto it = pending_.find(id);
  Transfer& t = it != pending_.end() ? it->second : CreateLocked(id, TransferKind::kWrite, peer);
  FailLocked(id, t, "a write was refused: " + why.ToString());
  return Status::OK();
}

Result<std::uint64_t> TransferTracker::AddBatch(std::string_view id_view, std::int64_t bytes,
                                                std::int64_t runs, BatchShape shape) {
  std::string id(id_view);
  std::lock_guard lock(mu_);
  auto it = pending_.find(id);
  if (it == pending_.end()) return FailedPreconditionError("transfer '" + id + "' is not pending");
  Transfer& t = it->second;
  const bool takes = t.kind == TransferKind::kRead
                         ? t.open
                         : t.writers > 0 && !t.aborted && !t.timed_out && t.failure.empty();
  if (!takes) {
    return FailedPreconditionError(
        "transfer '" + id + "' takes no more batches (" +
        (t.kind == TransferKind::kRead ? "a closed read" : "a write not held, or ended") + ")");
  }
  return AddBatchLocked(id, t, bytes, runs, shape);
}

std::uint64_t TransferTracker::AddBatchLocked(const std::string& id, Transfer& t,
                                              std::int64_t bytes, std::int64_t runs,
                                              BatchShape shape) {
  const std::uint64_t token = next_token_++;
  tokens_.emplace(token, id);
  ++t.in_flight;
  ++live_batches_;
  OnLiveBatchesChangedLocked();
  ++t.batches;
  if (shape == BatchShape::kStamped) ++t.stamped_batches;
  if (shape == BatchShape::kCells) ++t.cell_batches;
  t.bytes += bytes;
  t.runs += runs;
  return token;
}

void TransferTracker::OnBatchComplete(std::uint64_t token, const Status& status) {
  std::lock_guard lock(mu_);
  CompleteBatchLocked(token, status, /*unconfirmed=*/false);
}

void TransferTracker::OnBatchUnconfirmed(std::uint64_t token, const Status& status) {
  std::lock_guard lock(mu_);
  CompleteBatchLocked(token, status, /*unconfirmed=*/true);
}

void TransferTracker::CompleteBatchLocked(std::uint64_t token, const Status& status,
                                          bool unconfirmed) {
  auto tok = tokens_.find(token);
  if (tok == tokens_.end()) return;
  const std::string id = std::move(tok->second);
  tokens_.erase(tok);
  auto it = pending_.find(id);
  if (it == pending_.end()) {
    // Ended already (a deadline) while this batch was in flight: the last one drains it.
    auto q = quarantined_.find(id);
    if (q == quarantined_.end()) return;
    q->second.unconfirmed |= unconfirmed;
    if (--q->second.in_flight == 0) {
      // Drained only when every write was confirmed: unconfirmed bytes may land any time.
      if (!q->second.unconfirmed) {
        const double seconds =
            std::chrono::duration<double>(Clock::now() - q->second.start).count();
        drained_.push_back({id, q->second.kind, std::move(q->second.peer), seconds});
      }
      quarantined_.erase(q);
    }
    return;
  }
  Transfer& t = it->second;
  t.unconfirmed |= unconfirmed;
  --t.in_flight;
  --live_batches_;
  OnLiveBatchesChangedLocked();
  if (!status.ok() && t.failure.empty()) t.failure = status.ToString();
  if (unconfirmed && t.failure.empty()) {
    t.failure = "the transport could not confirm the writes of a batch";
  }
  MaybeFinishLocked(id, t);
}

void TransferTracker::FailPeer(std::string_view peer, const Status& status) {
  std::lock_guard lock(mu_);
  for (auto it = pending_.begin(); it != pending_.end();) {
    Transfer& t = it->second;
    auto next = std::next(it);
    if (t.peer == peer) {
      if (t.failure.empty()) t.failure = "peer failure: " + status.ToString();
      t.open = false;
      const std::string id = it->first;
      MaybeFinishLocked(id, t);
    }
    it = next;
  }
}

Status TransferTracker::Abort(std::string_view id_view) {
  std::string id(id_view);
  std::lock_guard lock(mu_);
  // Ended: a no-op, also for a quarantined one whose terminal record was forgotten.
  if (terminal_.count(id) || quarantined_.count(id)) return Status::OK();
  auto it = pending_.find(id);
  if (it == pending_.end()) return NotFoundError("no transfer '" + id + "'");
  it->second.aborted = true;
  it->second.open = false;
  MaybeFinishLocked(id, it->second);
  return Status::OK();
}

void TransferTracker::ExpireDeadlines(Clock::time_point now) {
  std::lock_guard lock(mu_);
  for (auto it = pending_.begin(); it != pending_.end();) {
    auto next = std::next(it);
    Transfer& t = it->second;
    const std::string id = it->first;
    if (!t.timed_out && t.deadline <= now) {
      // Phase 1: the transfer has failed, but its blocks may still be written by batches in
      // flight; it ends once they drain, so the caller never reuses blocks a transport writes.
      t.timed_out = true;
      t.open = false;
      t.deadline = now + timeout_;
      MaybeFinishLocked(id, t);
    } else if (t.timed_out && t.deadline <= now && t.writers == 0) {
      // Phase 2: the transport has not finished them; end anyway rather than hang, but the
      // destination is quarantined: the event says so, and DrainQuarantine reports the drain.
      // Not while a WriteLayers call holds it: the call never waits for the transport, and
      // ending under it would quarantine nothing in flight (never drained) or let its
      // EndWrites reach a new transfer of the same id.
      const std::int64_t in_flight = t.in_flight;
      quarantined_[id] = Quarantined{t.kind, t.peer, t.start, in_flight, t.unconfirmed};
      FinishLocked(id, t, t.aborted ? TransferState::kAborted : TransferState::kTimedOut,
                   "no completion within " + std::to_string(2 * timeout_.count()) + " ms; " +
                       std::to_string(in_flight) +
                       " batches still in flight: destination quarantined until drained",
                   /*drained=*/false);
    }
    it = next;
  }
}

bool TransferTracker::MaybeFinishLocked(const std::string& id, Transfer& t) {
  if (t.in_flight > 0 || t.writers > 0) return false;
  if (t.aborted) {
    FinishLocked(id, t, TransferState::kAborted, "aborted");
    return true;
  }
  // Past its deadline before ExpireDeadlines (run on the poller's schedule) saw it: timed out
  // all the same, never done. A caller was promised an end within the deadline: a READ posted
  // only while the prefill holds its blocks for that long must not be reported done later.
  if (!t.timed_out && t.deadline <= Clock::now()) t.timed_out = true;
  if (t.timed_out) {
    FinishLocked(id, t, TransferState::kTimedOut,
                 "no completion within " + std::to_string(timeout_.count()) + " ms");
    return true;
  }
  const bool write_failed = t.kind == TransferKind::kWrite && !t.failure.empty();
  if (t.open && !write_failed) return false;
  if (!t.failure.empty()) {
    FinishLocked(id, t, TransferState::kFailed, t.failure);
  } else {
    FinishLocked(id, t, TransferState::kDone, "");
  }
  return true;
}

void TransferTracker::FinishLocked(const std::string& id, Transfer& t, TransferState state,
                                   std::string message, bool drained) {
  TransferEvent e;
  e.transfer_id = id;
  e.kind = t.kind;
  e.state = state;
  e.peer = t.peer;
  e.message = std::move(message);
  e.bytes = t.bytes;
  e.runs = t.runs;
  e.batches = t.batches;
  e.stamped_batches = t.stamped_batches;
  e.cell_batches = t.cell_batches;
  e.seconds = std::chrono::duration<double>(Clock::now() - t.start).count();
  e.drained = drained && !t.unconfirmed;
  if (t.unconfirmed) {
    e.message += "; writes the transport could not confirm may still land at the peer: "
                 "destination quarantined, never reported drained";
  }
  const TransferKind kind = t.kind;
  live_batches_ -= static_cast<std::size_t>(t.in_flight);  // a quarantined transfer's batches
  events_.push_back(std::move(e));
  // A quarantined transfer keeps its in-flight tokens: their completions drain it. Every other
  // transfer ends with none in flight, so its tokens are gone from tokens_ already.
  pending_.erase(id);  // `t` dangles from here on
  RememberTerminalLocked(id, kind);
  events_cv_.notify_all();
}

void TransferTracker::RememberTerminalLocked(const std::string& id, TransferKind kind) {
  if (!terminal_.emplace(id, kind).second) return;
  terminal_order_.push_back(id);
  while (terminal_order_.size() > terminal_history_) {
    terminal_.erase(terminal_order_.front());
    terminal_order_.pop_front();
  }
}

bool TransferTracker::LastBatchesInFlightLocked() const {
  return live_batches_ != 0 && live_batches_ <= kSpinBatches;
}

void TransferTracker::OnLiveBatchesChangedLocked() {
  if (!LastBatchesInFlightLocked()) return;
  // A transfer's last batches are in flight, or one of them just completed: a waiter asleep in
  // Drain spins again for kMaxSpin (see Drain).
  spin_until_ = Clock::now() + kMaxSpin;
  events_cv_.notify_all();
}

bool TransferTracker::SpinningLocked(Clock::time_point now) const {
  return LastBatchesInFlightLocked() && now < spin_until_;
}

std::vector<TransferEvent> TransferTracker::Drain(std::size_t max_events,
                                                  std::chrono::milliseconds wait) {
  std::unique_lock lock(mu_);
  if (events_.empty() && wait.count() > 0) {
    const Clock::time_point until = Clock::now() + wait;
    while (events_.empty()) {
      const Clock::time_point now = Clock::now();
      if (now >= until) break;
      if (SpinningLocked(now)) {
        lock.unlock();
        std::this_thread::yield();
        lock.lock();
        continue;
      }
      events_cv_.wait_until(lock, until);
    }
  }
  std::vector<TransferEvent> out;
  while (!events_.empty() && out.size() < max_events) {
    out.push_back(std::move(events_.front()));
    events_.pop_front();
  }
  return out;
}

std::vector<DrainedTransfer> TransferTracker::DrainQuarantine(std::size_t max) {
  std::lock_guard lock(mu_);
  std::vector<DrainedTransfer> out;
  while (!drained_.empty() && out.size() < max) {
    out.push_back(std::move(drained_.front()));
    drained_.pop_front();
  }
  return out;
}

std::size_t TransferTracker::quarantined() const {
  std::lock_guard lock(mu_);
  return quarantined_.size();
}

std::size_t TransferTracker::live_batches() const {
  std::lock_guard lock(mu_);
  return live_batches_;
}

std::size_t TransferTracker::pending() const {
  std::lock_guard lock(mu_);
  return pending_.size();
}

std::size_t TransferTracker::TransfersWith(std::string_view peer) const {
  std::lock_guard lock(mu_);
  std::size_t count = 0;
  for (const auto& [id, t] : pending_) count += t.peer == peer ? 1 : 0;
  for (const auto& [id, q] : quarantined_) count += q.peer == peer ? 1 : 0;
  return count;
}

bool TransferTracker::IsTerminal(std::string_view id) const {
  std::lock_guard lock(mu_);
  return terminal_.count(std::string(id)) > 0;
}

}  // namespace moriio_native::detail
