#pragma once

// One pass of a backend thread over the batches that wait for their producer's device event
// (UCX's parked batches, MoRI's queued ones). Header-only: the backends are separate plugins.

#include <cstdint>
#include <optional>
#include <utility>
#include <vector>

#include "moriio_native/status.hpp"

namespace moriio_native::detail {

/// Asks about each distinct event once per pass, and about at most kMaxPending events that turn
/// out not to have completed: producers record their events in order (a forward's layers), so
/// the batches behind those few wait for the next pass. Every question is a driver call (about a
/// microsecond), which a thread polling while the forward runs must not make without bound.
class EventPass {
 public:
  static constexpr int kMaxPending = 4;

  /// Whether `event` completed (`query(event)`'s answer, or the one it gave earlier in this
  /// pass); nullopt when the pass already met kMaxPending uncompleted events and asks no more.
  template <typename Query>
  std::optional<Result<bool>> Ask(std::uint64_t event, Query&& query) {
    for (const auto& [seen, answer] : answers_) {
      if (seen == event) return answer;
    }
    if (pending_ == kMaxPending) return std::nullopt;
    Result<bool> answer = query(event);
    if (answer.ok() && !*answer) ++pending_;
    answers_.emplace_back(event, answer);
    return answer;
  }

 private:
  std::vector<std::pair<std::uint64_t, Result<bool>>> answers_;
  int pending_ = 0;
};

}  // namespace moriio_native::detail
