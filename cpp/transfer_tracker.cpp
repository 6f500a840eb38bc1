#include "transfer_tracker.hpp"

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

Result<std::optional<std::uint64_t>> TransferTracker::ScheduleWrite(std::string_view id_view,
                                                                    std::string_view layer,
                                                                    std::string_view peer,
                                                                    std::int64_t bytes,
                                                                    std::int64_t runs) {
  std::string id(id_view);
  std::lock_guard lock(mu_);
  if (terminal_.count(id)) return std::optional<std::uint64_t>();
  auto it = pending_.find(id);
  if (it != pending_.end() && it->second.peer != peer) {
    return InvalidArgumentError("transfer '" + id + "' writes to peer '" + it->second.peer +
                                "', not '" + std::string(peer) + "'");
  }
  Transfer& t = it != pending_.end() ? it->second : CreateLocked(id, TransferKind::kWrite, peer);
  if (t.kind != TransferKind::kWrite || !t.open || !t.failure.empty() || t.aborted) {
    return std::optional<std::uint64_t>();
  }
  if (!t.layers.emplace(layer).second) return std::optional<std::uint64_t>();
  return std::optional<std::uint64_t>(AddBatchLocked(id, t, bytes, runs));
}

void TransferTracker::Seal(std::string_view id_view, std::string_view peer) {
  std::string id(id_view);
  std::lock_guard lock(mu_);
  if (terminal_.count(id)) return;
  auto it = pending_.find(id);
  Transfer& t = it != pending_.end() ? it->second : CreateLocked(id, TransferKind::kWrite, peer);
  if (t.kind != TransferKind::kWrite) return;
  t.open = false;
  MaybeFinishLocked(id, t);
}

Result<std::uint64_t> TransferTracker::AddBatch(std::string_view id_view, std::int64_t bytes,
                                                std::int64_t runs) {
  std::string id(id_view);
  std::lock_guard lock(mu_);
  auto it = pending_.find(id);
  if (it == pending_.end() || it->second.kind != TransferKind::kRead || !it->second.open) {
    return FailedPreconditionError("transfer '" + id + "' is not an open read");
  }
  return AddBatchLocked(id, it->second, bytes, runs);
}

std::uint64_t TransferTracker::AddBatchLocked(const std::string& id, Transfer& t,
                                              std::int64_t bytes, std::int64_t runs) {
  const std::uint64_t token = next_token_++;
  tokens_.emplace(token, id);
  t.tokens.push_back(token);
  ++t.in_flight;
  ++t.batches;
  t.bytes += bytes;
  t.runs += runs;
  return token;
}

void TransferTracker::OnBatchComplete(std::uint64_t token, const Status& status) {
  std::lock_guard lock(mu_);
  auto tok = tokens_.find(token);
  if (tok == tokens_.end()) return;
  const std::string id = std::move(tok->second);
  tokens_.erase(tok);
  auto it = pending_.find(id);
  if (it == pending_.end()) return;  // ended already (deadline): a late completion
  Transfer& t = it->second;
  --t.in_flight;
  if (!status.ok() && t.failure.empty()) t.failure = status.ToString();
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
  if (terminal_.count(id)) return Status::OK();
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
    } else if (t.timed_out && t.deadline <= now) {
      // Phase 2: the transport never finished them; end anyway rather than hang, and say so.
      FinishLocked(id, t, TransferState::kTimedOut,
                   "no completion within " + std::to_string(2 * timeout_.count()) + " ms; " +
                       std::to_string(t.in_flight) +
                       " batches still in flight: their blocks may still be written");
    }
    it = next;
  }
}

bool TransferTracker::MaybeFinishLocked(const std::string& id, Transfer& t) {
  if (t.in_flight > 0) return false;
  if (t.aborted) {
    FinishLocked(id, t, TransferState::kAborted, "aborted");
    return true;
  }
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
                                   std::string message) {
  TransferEvent e;
  e.transfer_id = id;
  e.kind = t.kind;
  e.state = state;
  e.peer = t.peer;
  e.message = std::move(message);
  e.bytes = t.bytes;
  e.runs = t.runs;
  e.batches = t.batches;
  e.seconds = std::chrono::duration<double>(Clock::now() - t.start).count();
  events_.push_back(std::move(e));
  // Tokens still in flight (a deadline ended the transfer) are forgotten now, so a transport
  // that never completes them cannot grow the map; their late completions are unknown tokens.
  for (std::uint64_t token : t.tokens) tokens_.erase(token);
  pending_.erase(id);  // `t` dangles from here on
  RememberTerminalLocked(id);
  events_cv_.notify_all();
}

void TransferTracker::RememberTerminalLocked(const std::string& id) {
  if (!terminal_.insert(id).second) return;
  terminal_order_.push_back(id);
  while (terminal_order_.size() > terminal_history_) {
    terminal_.erase(terminal_order_.front());
    terminal_order_.pop_front();
  }
}

std::vector<TransferEvent> TransferTracker::Drain(std::size_t max_events,
                                                  std::chrono::milliseconds wait) {
  std::unique_lock lock(mu_);
  if (events_.empty() && wait.count() > 0) {
    events_cv_.wait_for(lock, wait, [&] { return !events_.empty(); });
  }
  std::vector<TransferEvent> out;
  while (!events_.empty() && out.size() < max_events) {
    out.push_back(std::move(events_.front()));
    events_.pop_front();
  }
  return out;
}

std::size_t TransferTracker::pending() const {
  std::lock_guard lock(mu_);
  return pending_.size();
}

bool TransferTracker::IsTerminal(std::string_view id) const {
  std::lock_guard lock(mu_);
  return terminal_.count(std::string(id)) > 0;
}

}  // namespace moriio_native::detail
