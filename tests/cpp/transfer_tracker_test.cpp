// Tests of detail::TransferTracker, the completion tracker behind the engine.
//
// Expectations come from the class comment in cpp/transfer_tracker.hpp (the terminal rules) and
// DESIGN.md §3.3: every transfer ends in exactly one terminal state, a WRITE finishes when its
// sealed number of writes completed, late messages are ignored, nothing ends while the transport
// still owns its blocks (except by deadline). Deadlines are driven through ExpireDeadlines with an
// explicit time point, so no test here depends on the wall clock.

#include "transfer_tracker.hpp"
#include "test_printers.hpp"

#include <gtest/gtest.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <ctime>
#include <latch>
#include <map>
#include <mutex>
#include <optional>
#include <ostream>
#include <random>
#include <string>
#include <thread>
#include <vector>

namespace moriio_native::detail {
namespace {

using namespace std::chrono_literals;

constexpr auto kLongTimeout = std::chrono::milliseconds(std::chrono::hours(1));

// Everything queued right now (never waits).
std::vector<TransferEvent> DrainNow(TransferTracker& t) { return t.Drain(1 << 20, 0ms); }

// The single event queued now; fails the test unless exactly one is queued.
TransferEvent OnlyEvent(TransferTracker& t) {
  std::vector<TransferEvent> events = DrainNow(t);
  EXPECT_EQ(events.size(), 1u);
  if (events.empty()) {
    TransferEvent none;
    none.transfer_id = "<none>";
    none.state = TransferState::kPending;
    return none;
  }
  return events.front();
}

void ExpectNoEvent(TransferTracker& t, const char* when) {
  std::vector<TransferEvent> events = DrainNow(t);
  EXPECT_TRUE(events.empty()) << when << ": unexpected event for '" << events.front().transfer_id
                              << "' state " << TransferStateName(events.front().state);
}

std::uint64_t Schedule(TransferTracker& t, const std::string& id, const std::string& layer,
                       std::int64_t bytes = 100, std::int64_t runs = 2,
                       const std::string& peer = "decode-0") {
  std::optional<std::uint64_t> token = t.ScheduleWrite(id, layer, peer, bytes, runs).value();
  EXPECT_TRUE(token.has_value()) << "ScheduleWrite(" << id << ", " << layer << ") was refused";
  return token.value_or(0);
}

// ---- WRITE ---------------------------------------------------------------------------------

TEST(TransferTrackerWrite, DuplicateScheduleOfALayerIsRefusedAndCountsOnce) {
  TransferTracker t(kLongTimeout, 16);
  const std::uint64_t a = Schedule(t, "req-1", "layer.0", 64, 1);
  EXPECT_FALSE(t.ScheduleWrite("req-1", "layer.0", "decode-0", 64, 1).value().has_value());
  const std::uint64_t b = Schedule(t, "req-1", "layer.1", 32, 1);
  EXPECT_NE(a, b);
  ASSERT_TRUE(t.Seal("req-1", "decode-0", 2).ok());
  t.OnBatchComplete(a, Status::OK());
  ExpectNoEvent(t, "one of two sealed writes done");
  t.OnBatchComplete(b, Status::OK());
  TransferEvent e = OnlyEvent(t);
  EXPECT_EQ(e.transfer_id, "req-1");
  EXPECT_EQ(e.kind, TransferKind::kWrite);
  EXPECT_EQ(e.state, TransferState::kDone);
  EXPECT_EQ(e.batches, 2);  // the refused duplicate is not counted
  EXPECT_EQ(e.bytes, 96);
  EXPECT_EQ(e.runs, 2);
  EXPECT_EQ(e.peer, "decode-0");
}

// Each batch counts in the shape it was handed over in: runs in neither count, stamped and
// cell batches in theirs, for a READ's batches and a WRITE's alike.
TEST(TransferTrackerShapes, EachBatchCountsInItsShape) {
  TransferTracker t(kLongTimeout, 16);
  ASSERT_TRUE(t.BeginRead("rd", "prefill-0").ok());
  std::vector<std::uint64_t> tokens;
  for (BatchShape shape : {BatchShape::kRuns, BatchShape::kStamped, BatchShape::kStamped,
                           BatchShape::kCells}) {
    tokens.push_back(t.AddBatch("rd", 8, 2, shape).value());
  }
  t.CloseRead("rd");
  for (std::uint64_t token : tokens) t.OnBatchComplete(token, Status::OK());
  TransferEvent e = OnlyEvent(t);
  EXPECT_EQ(e.state, TransferState::kDone);
  EXPECT_EQ(e.batches, 4);
  EXPECT_EQ(e.stamped_batches, 2);
  EXPECT_EQ(e.cell_batches, 1);
  EXPECT_EQ(e.runs, 8);
  const std::uint64_t w0 = t.ScheduleWrite("wr", "l0", "decode-0", 8, 1, BatchShape::kCells)
                               .value()
                               .value_or(0);
  const std::uint64_t w1 = t.ScheduleWrite("wr", "l1", "decode-0", 8, 1, BatchShape::kStamped)
                               .value()
                               .value_or(0);
  const std::uint64_t w2 = Schedule(t, "wr", "l2");  // runs, the default
  ASSERT_TRUE(t.Seal("wr", "decode-0", 3).ok());
  for (std::uint64_t token : {w0, w1, w2}) t.OnBatchComplete(token, Status::OK());
  e = OnlyEvent(t);
  EXPECT_EQ(e.state, TransferState::kDone);
  EXPECT_EQ(e.batches, 3);
  EXPECT_EQ(e.stamped_batches, 1);
  EXPECT_EQ(e.cell_batches, 1);
}

TEST(TransferTrackerWrite, OneTransferWritesToOnePeerOnly) {
  TransferTracker t(kLongTimeout, 16);
  Schedule(t, "req-1", "layer.0", 64, 1, "decode-0");
  auto other = t.ScheduleWrite("req-1", "layer.1", "decode-1", 64, 1);
  ASSERT_FALSE(other.ok());
  EXPECT_EQ(other.status().code(), StatusCode::kInvalidArgument);
  EXPECT_NE(other.status().message().find("decode-0"), std::string::npos);
  EXPECT_EQ(t.pending(), 1u);
}

TEST(TransferTrackerWrite, CompletesOnceAndOnlyAfterTheSealedCount) {
  TransferTracker t(kLongTimeout, 16);
  const std::uint64_t l0 = Schedule(t, "req", "l0", 10, 1);
  const std::uint64_t l1 = Schedule(t, "req", "l1", 20, 2);
  const std::uint64_t l2 = Schedule(t, "req", "l2", 30, 3);
  t.OnBatchComplete(l0, Status::OK());
  t.OnBatchComplete(l1, Status::OK());
  ExpectNoEvent(t, "two of three writes done, not sealed");
  ASSERT_TRUE(t.Seal("req", "decode-0", 3).ok());
  ExpectNoEvent(t, "sealed with one write in flight");
  EXPECT_EQ(t.pending(), 1u);
  EXPECT_FALSE(t.IsTerminal("req"));
  t.OnBatchComplete(l2, Status::OK());
  TransferEvent e = OnlyEvent(t);
  EXPECT_EQ(e.transfer_id, "req");
  EXPECT_EQ(e.state, TransferState::kDone);
  EXPECT_EQ(e.bytes, 60);
  EXPECT_EQ(e.runs, 6);
  EXPECT_EQ(e.batches, 3);
  EXPECT_TRUE(e.message.empty());
  EXPECT_EQ(t.pending(), 0u);
  EXPECT_TRUE(t.IsTerminal("req"));
  ExpectNoEvent(t, "after the done event");
}

TEST(TransferTrackerWrite, AllWritesFinishedBeforeSealWaitsForSeal) {
  TransferTracker t(kLongTimeout, 16);
  const std::uint64_t l0 = Schedule(t, "req", "l0");
  t.OnBatchComplete(l0, Status::OK());
  // More layers may still come from the forward pass: not done yet.
  ExpectNoEvent(t, "every scheduled write done, not sealed");
  const std::uint64_t l1 = Schedule(t, "req", "l1");
  t.OnBatchComplete(l1, Status::OK());
  ExpectNoEvent(t, "still not sealed");
  ASSERT_TRUE(t.Seal("req", "decode-0", 2).ok());
  TransferEvent e = OnlyEvent(t);
  EXPECT_EQ(e.state, TransferState::kDone);
  EXPECT_EQ(e.batches, 2);
}

TEST(TransferTrackerWrite, SealWithNothingScheduledIsDoneAtOnce) {
  TransferTracker t(kLongTimeout, 16);
  ASSERT_TRUE(t.Seal("empty", "decode-3", 0).ok());  // "nothing to send", said explicitly
  TransferEvent e = OnlyEvent(t);
  EXPECT_EQ(e.transfer_id, "empty");
  EXPECT_EQ(e.kind, TransferKind::kWrite);
  EXPECT_EQ(e.state, TransferState::kDone);
  EXPECT_EQ(e.peer, "decode-3");
  EXPECT_EQ(e.bytes, 0);
  EXPECT_EQ(e.batches, 0);
  EXPECT_EQ(t.pending(), 0u);
  // A late write for it must not start the transfer anew.
  EXPECT_FALSE(t.ScheduleWrite("empty", "l0", "decode-3", 1, 1).value().has_value());
  // Nor may a late seal; it says it was ignored, so a caller that scheduled nothing of this
  // id (a reused one) knows no event will come.
  EXPECT_FALSE(t.Seal("empty", "decode-3", 0).value());
  ExpectNoEvent(t, "late schedule/seal after done");
  EXPECT_EQ(t.pending(), 0u);
}

TEST(TransferTrackerWrite, FailureFailsOnceAfterInFlightWritesDrained) {
  TransferTracker t(kLongTimeout, 16);
  const std::uint64_t l0 = Schedule(t, "req", "l0");
  const std::uint64_t l1 = Schedule(t, "req", "l1");
  const std::uint64_t l2 = Schedule(t, "req", "l2");
  t.OnBatchComplete(l0, TransportError("nic down on layer l0"));
  ExpectNoEvent(t, "failure with two writes still in flight");
  // Later writes of a failed transfer are refused (nothing recorded).
  EXPECT_FALSE(t.ScheduleWrite("req", "l3", "decode-0", 1, 1).value().has_value());
  t.OnBatchComplete(l1, TransportError("second failure"));
  ExpectNoEvent(t, "failure with one write still in flight");
  t.OnBatchComplete(l2, Status::OK());
  TransferEvent e = OnlyEvent(t);
  EXPECT_EQ(e.state, TransferState::kFailed);
  EXPECT_NE(e.message.find("nic down on layer l0"), std::string::npos) << e.message;
  EXPECT_EQ(e.batches, 3);
  // Not sealed: the failure alone ended it. A late seal changes nothing.
  EXPECT_TRUE(t.Seal("req", "decode-0", 3).ok());
  ExpectNoEvent(t, "seal after failure");
  EXPECT_EQ(t.pending(), 0u);
}

TEST(TransferTrackerWrite, FailureWithNothingInFlightEndsWithoutSeal) {
  TransferTracker t(kLongTimeout, 16);
  const std::uint64_t l0 = Schedule(t, "req", "l0");
  t.OnBatchComplete(l0, TransportError("rkey rejected"));
  TransferEvent e = OnlyEvent(t);
  EXPECT_EQ(e.state, TransferState::kFailed);
  EXPECT_NE(e.message.find("rkey rejected"), std::string::npos) << e.message;
}

TEST(TransferTrackerWrite, AbortWithInFlightWritesEndsOnlyAfterTheyComplete) {
  TransferTracker t(kLongTimeout, 16);
  const std::uint64_t l0 = Schedule(t, "req", "l0");
  const std::uint64_t l1 = Schedule(t, "req", "l1");
  ASSERT_TRUE(t.Abort("req").ok());
  ExpectNoEvent(t, "abort with two writes in flight");
  EXPECT_EQ(t.pending(), 1u);
  EXPECT_FALSE(t.ScheduleWrite("req", "l2", "decode-0", 1, 1).value().has_value());
  t.OnBatchComplete(l0, Status::OK());
  ExpectNoEvent(t, "abort with one write in flight");
  t.OnBatchComplete(l1, Status::OK());
  TransferEvent e = OnlyEvent(t);
  EXPECT_EQ(e.state, TransferState::kAborted);
  EXPECT_FALSE(e.message.empty());
  EXPECT_EQ(t.pending(), 0u);
}

TEST(TransferTrackerWrite, AbortBeatsFailure) {
  TransferTracker t(kLongTimeout, 16);
  const std::uint64_t l0 = Schedule(t, "req", "l0");
  const std::uint64_t l1 = Schedule(t, "req", "l1");
  t.OnBatchComplete(l0, TransportError("boom"));
  ASSERT_TRUE(t.Abort("req").ok());
  t.OnBatchComplete(l1, Status::OK());
  EXPECT_EQ(OnlyEvent(t).state, TransferState::kAborted);
}

TEST(TransferTrackerWrite, AbortWithNothingInFlightEndsAtOnce) {
  TransferTracker t(kLongTimeout, 16);
  const std::uint64_t l0 = Schedule(t, "req", "l0");
  t.OnBatchComplete(l0, Status::OK());
  ASSERT_TRUE(t.Abort("req").ok());
  TransferEvent e = OnlyEvent(t);
  EXPECT_EQ(e.state, TransferState::kAborted);
  EXPECT_EQ(e.batches, 1);
}

TEST(TransferTrackerWrite, AbortOfUnknownIdIsNotFoundAndOfTerminalIdIsANoOp) {
  TransferTracker t(kLongTimeout, 16);
  Status st = t.Abort("never-seen");
  EXPECT_EQ(st.code(), StatusCode::kNotFound) << st.ToString();
  EXPECT_NE(st.message().find("never-seen"), std::string::npos) << st.ToString();
  ExpectNoEvent(t, "abort of an unknown id");
  ASSERT_TRUE(t.Seal("done-one", "p", 0).ok());
  EXPECT_EQ(OnlyEvent(t).state, TransferState::kDone);
  EXPECT_TRUE(t.Abort("done-one").ok());
  ExpectNoEvent(t, "abort after done");
}

TEST(TransferTrackerWrite, MessagesAfterTerminalAreIgnored) {
  TransferTracker t(kLongTimeout, 16);
  const std::uint64_t l0 = Schedule(t, "req", "l0");
  ASSERT_TRUE(t.Seal("req", "decode-0", 1).ok());
  t.OnBatchComplete(l0, Status::OK());
  EXPECT_EQ(OnlyEvent(t).state, TransferState::kDone);

  t.OnBatchComplete(l0, TransportError("late duplicate completion"));
  t.OnBatchComplete(l0, Status::OK());
  EXPECT_FALSE(t.ScheduleWrite("req", "l0", "decode-0", 1, 1).value().has_value());
  EXPECT_FALSE(t.ScheduleWrite("req", "l9", "decode-0", 1, 1).value().has_value());
  EXPECT_TRUE(t.Seal("req", "decode-0", 1).ok());
  EXPECT_TRUE(t.Abort("req").ok());
  t.FailPeer("decode-0", TransportError("peer lost"));
  EXPECT_EQ(t.BeginRead("req", "decode-0").code(), StatusCode::kAlreadyExists);
  t.ExpireDeadlines(TransferTracker::Clock::now() + std::chrono::hours(2));
  ExpectNoEvent(t, "late messages after done");
  EXPECT_EQ(t.pending(), 0u);
  EXPECT_TRUE(t.IsTerminal("req"));
}

TEST(TransferTrackerWrite, UnknownTokensAreIgnored) {
  TransferTracker t(kLongTimeout, 16);
  const std::uint64_t l0 = Schedule(t, "req", "l0");
  t.OnBatchComplete(l0 + 1000, TransportError("stray"));
  t.OnBatchComplete(0, TransportError("stray"));
  ASSERT_TRUE(t.Seal("req", "decode-0", 1).ok());
  ExpectNoEvent(t, "stray tokens");
  t.OnBatchComplete(l0, Status::OK());
  EXPECT_EQ(OnlyEvent(t).state, TransferState::kDone);
}

// Write calls on a READ id are errors naming it, and leave the READ alone (pending or ended).
TEST(TransferTrackerWrite, WriteCallsOnAReadIdAreInvalidArgumentAndChangeNothing) {
  TransferTracker t(kLongTimeout, 16);
  ASSERT_TRUE(t.BeginRead("rd", "prefill-0").ok());
  auto expect_refused = [&](const Status& st, const char* what) {
    EXPECT_EQ(st.code(), StatusCode::kInvalidArgument) << what << ": " << st.ToString();
    EXPECT_NE(st.message().find("'rd' is a READ"), std::string::npos) << what << ": " << st.ToString();
  };
  expect_refused(t.ScheduleWrite("rd", "l0", "prefill-0", 1, 1).status(), "ScheduleWrite");
  expect_refused(t.Seal("rd", "prefill-0", 0).status(), "Seal");
  expect_refused(t.FailWrite("rd", "prefill-0", OutOfRangeError("bad id")), "FailWrite");
  ExpectNoEvent(t, "write calls on an open READ");
  t.CloseRead("rd");
  TransferEvent e = OnlyEvent(t);
  EXPECT_EQ(e.kind, TransferKind::kRead);
  EXPECT_EQ(e.state, TransferState::kDone);
  EXPECT_EQ(e.batches, 0);
  expect_refused(t.ScheduleWrite("rd", "l0", "prefill-0", 1, 1).status(), "ScheduleWrite, ended");
  expect_refused(t.Seal("rd", "prefill-0", 0).status(), "Seal, ended");
  ExpectNoEvent(t, "write calls on an ended READ");
}

// Issue 12 defect 2: a refused layer fails the transfer, so the seal cannot make it done.
TEST(TransferTrackerWrite, ARefusedLayerFailsTheTransferBeforeAndAfterTheSeal) {
  TransferTracker t(kLongTimeout, 16);
  const std::uint64_t l0 = Schedule(t, "req", "l0");
  ASSERT_TRUE(t.FailWrite("req", "decode-0", OutOfRangeError("remote block id 99")).ok());
  ExpectNoEvent(t, "refused layer, one write in flight");
  EXPECT_FALSE(t.ScheduleWrite("req", "l2", "decode-0", 1, 1).value().has_value());
  EXPECT_TRUE(t.Seal("req", "decode-0", 2).ok());
  t.OnBatchComplete(l0, Status::OK());
  TransferEvent e = OnlyEvent(t);
  EXPECT_EQ(e.state, TransferState::kFailed);
  EXPECT_NE(e.message.find("remote block id 99"), std::string::npos) << e.message;
  // A refusal before anything was scheduled creates the transfer, failed at once.
  ASSERT_TRUE(t.FailWrite("first", "decode-0", NotFoundError("unknown layer 'x'")).ok());
  EXPECT_EQ(OnlyEvent(t).state, TransferState::kFailed);
  EXPECT_FALSE(t.Seal("first", "decode-0", 1).value());  // late: ignored
  ExpectNoEvent(t, "seal after the refusal ended it");
}

// Issue 12 defect 2: the seal carries the number of writes, so one that overtakes its writes
// waits for them, and a seal of an unwritten id is not "done" unless it says 0.
TEST(TransferTrackerWrite, ASealOvertakingItsWritesWaitsForThem) {
  TransferTracker t(kLongTimeout, 16);
  ASSERT_TRUE(t.Seal("req", "decode-0", 2).ok());
  ExpectNoEvent(t, "sealed for two writes, none scheduled");
  EXPECT_TRUE(t.Seal("req", "decode-0", 2).value());  // the same seal again
  EXPECT_EQ(t.Seal("req", "decode-0", 3).status().code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(t.Seal("req", "decode-9", 2).status().code(), StatusCode::kInvalidArgument);
  const std::uint64_t l0 = Schedule(t, "req", "l0");
  t.OnBatchComplete(l0, Status::OK());
  ExpectNoEvent(t, "one of two sealed writes done");
  const std::uint64_t l1 = Schedule(t, "req", "l1");
  // A third layer is one more than the seal said: refused, and the transfer fails.
  auto extra = t.ScheduleWrite("req", "l2", "decode-0", 1, 1);
  EXPECT_EQ(extra.status().code(), StatusCode::kInvalidArgument);
  EXPECT_NE(extra.status().message().find("sealed for 2 writes"), std::string::npos);
  t.OnBatchComplete(l1, Status::OK());
  EXPECT_EQ(OnlyEvent(t).state, TransferState::kFailed);

  ASSERT_TRUE(t.Seal("ok", "decode-0", 2).ok());
  t.OnBatchComplete(Schedule(t, "ok", "l0"), Status::OK());
  t.OnBatchComplete(Schedule(t, "ok", "l1"), Status::OK());
  TransferEvent e = OnlyEvent(t);
  EXPECT_EQ(e.state, TransferState::kDone);
  EXPECT_EQ(e.batches, 2);

  // Sealing for fewer writes than were scheduled fails the transfer.
  const std::uint64_t m0 = Schedule(t, "more", "l0");
  Schedule(t, "more", "l1");
  EXPECT_EQ(t.Seal("more", "decode-0", 1).status().code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(t.Seal("neg", "decode-0", -1).status().code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(t.pending(), 1u);  // "neg" was not created
  t.OnBatchComplete(m0, Status::OK());
  ExpectNoEvent(t, "failed, one write in flight");
}

// Several layers scheduled by one call (Engine::WriteLayers): each counts towards the seal, and
// the transfer cannot end while the call still adds their batches, even when every batch added
// so far completed and the seal is met.
TEST(TransferTrackerWrite, BeginWritesHoldsTheTransferUntilEndWrites) {
  TransferTracker t(kLongTimeout, 16);
  ASSERT_TRUE(t.Seal("req", "decode-0", 3).ok());
  const std::vector<std::string> first = {"l0", "l1"};
  Result<bool> began = t.BeginWrites("req", first, "decode-0");
  ASSERT_TRUE(began.ok()) << began.status().ToString();
  EXPECT_TRUE(*began);
  Result<std::uint64_t> a = t.AddBatch("req", 100, 2, BatchShape::kStamped);
  ASSERT_TRUE(a.ok()) << a.status().ToString();
  t.OnBatchComplete(*a, Status::OK());
  ExpectNoEvent(t, "held, one batch done");
  Result<std::uint64_t> b = t.AddBatch("req", 50, 1);
  ASSERT_TRUE(b.ok()) << b.status().ToString();
  t.EndWrites("req");
  t.OnBatchComplete(*b, Status::OK());
  ExpectNoEvent(t, "two of three sealed layers");
  t.OnBatchComplete(Schedule(t, "req", "l2"), Status::OK());
  TransferEvent e = OnlyEvent(t);
  EXPECT_EQ(e.state, TransferState::kDone) << e.message;
  EXPECT_EQ(e.batches, 3);
  EXPECT_EQ(e.stamped_batches, 1);
  EXPECT_EQ(e.bytes, 250);

  // A held WRITE whose batches all completed ends as soon as the hold is released.
  ASSERT_TRUE(t.Seal("quick", "decode-0", 2).ok());
  ASSERT_TRUE(t.BeginWrites("quick", first, "decode-0").value());
  t.OnBatchComplete(t.AddBatch("quick", 1, 1).value(), Status::OK());
  ExpectNoEvent(t, "held after its last batch");
  t.EndWrites("quick");
  EXPECT_EQ(OnlyEvent(t).state, TransferState::kDone);
  t.EndWrites("quick");  // ended: ignored
  ExpectNoEvent(t, "a second release");
}

TEST(TransferTrackerWrite, BeginWritesRefusalsNameTheLayerAndFailOnlyWhatTheySay) {
  TransferTracker t(kLongTimeout, 16);
  const std::vector<std::string> none;
  const std::vector<std::string> twice = {"l0", "l1", "l0"};
  EXPECT_EQ(t.BeginWrites("req", none, "decode-0").status().code(), StatusCode::kInvalidArgument);
  Result<bool> dup = t.BeginWrites("req", twice, "decode-0");
  EXPECT_EQ(dup.status().code(), StatusCode::kInvalidArgument);
  EXPECT_NE(dup.status().message().find("'l0' is named twice"), std::string::npos)
      << dup.status().ToString();
  EXPECT_EQ(t.pending(), 0u) << "refused before anything was recorded";
  ASSERT_TRUE(t.BeginRead("rd", "decode-0").ok());
  const std::vector<std::string> two = {"l0", "l1"};
  EXPECT_EQ(t.BeginWrites("rd", two, "decode-0").status().code(), StatusCode::kInvalidArgument);
  EXPECT_TRUE(t.AddBatch("rd", 1, 1).ok()) << "the READ is untouched, still open";

  // The same layers again (a retry) change nothing; some of them again is ambiguous.
  const std::uint64_t l0 = Schedule(t, "w", "l0");
  const std::vector<std::string> again = {"l0"};
  EXPECT_FALSE(t.BeginWrites("w", again, "decode-0").value());
  Result<bool> partial = t.BeginWrites("w", two, "decode-0");
  EXPECT_EQ(partial.status().code(), StatusCode::kInvalidArgument);
  EXPECT_NE(partial.status().message().find("layer 'l0' was scheduled before"), std::string::npos)
      << partial.status().ToString();
  t.OnBatchComplete(l0, Status::OK());
  TransferEvent failed = OnlyEvent(t);
  EXPECT_EQ(failed.state, TransferState::kFailed);
  EXPECT_EQ(failed.transfer_id, "w");

  // More layers than the seal said: the first one past it is named, the transfer fails.
  ASSERT_TRUE(t.Seal("s", "decode-0", 1).ok());
  Result<bool> extra = t.BeginWrites("s", two, "decode-0");
  EXPECT_EQ(extra.status().code(), StatusCode::kInvalidArgument);
  EXPECT_NE(extra.status().message().find("layer 'l1' is one more"), std::string::npos)
      << extra.status().ToString();
  EXPECT_EQ(OnlyEvent(t).state, TransferState::kFailed);

  // Another peer than the transfer's fails it.
  t.OnBatchComplete(Schedule(t, "p", "l0"), Status::OK());
  const std::vector<std::string> next = {"l1"};
  EXPECT_EQ(t.BeginWrites("p", next, "decode-9").status().code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(OnlyEvent(t).state, TransferState::kFailed);
}

// An abort (or a deadline) while a call still adds batches stops it: the next AddBatch is
// refused, and the transfer ends aborted once the hold is released and its batches drained.
TEST(TransferTrackerWrite, AHeldWriteTakesNoBatchAfterItsAbort) {
  TransferTracker t(kLongTimeout, 16);
  const std::vector<std::string> two = {"l0", "l1"};
  ASSERT_TRUE(t.BeginWrites("req", two, "decode-0").value());
  const std::uint64_t a = t.AddBatch("req", 1, 1).value();
  ASSERT_TRUE(t.Abort("req").ok());
  EXPECT_EQ(t.AddBatch("req", 1, 1).status().code(), StatusCode::kFailedPrecondition);
  t.EndWrites("req");
  ExpectNoEvent(t, "aborted, one batch in flight");
  t.OnBatchComplete(a, Status::OK());
  TransferEvent e = OnlyEvent(t);
  EXPECT_EQ(e.state, TransferState::kAborted);
  EXPECT_EQ(e.batches, 1);
  // A failed batch stops the call's later batches too.
  ASSERT_TRUE(t.BeginWrites("f", two, "decode-0").value());
  t.OnBatchComplete(t.AddBatch("f", 1, 1).value(), TransportError("link down"));
  EXPECT_EQ(t.AddBatch("f", 1, 1).status().code(), StatusCode::kFailedPrecondition);
  ExpectNoEvent(t, "failed while held");
  t.EndWrites("f");
  EXPECT_EQ(OnlyEvent(t).state, TransferState::kFailed);
  // The deadline's first phase stops it as well.
  ASSERT_TRUE(t.BeginWrites("late", two, "decode-0").value());
  t.ExpireDeadlines(TransferTracker::Clock::now() + 2 * kLongTimeout);
  EXPECT_EQ(t.AddBatch("late", 1, 1).status().code(), StatusCode::kFailedPrecondition);
  t.EndWrites("late");
  EXPECT_EQ(OnlyEvent(t).state, TransferState::kTimedOut);
}

// Past both deadline periods a transfer a WriteLayers call still holds waits for the call to
// let go (the call never waits for the transport): ended under it, it would be quarantined
// with nothing in flight, never drained, and the call's EndWrites could reach a new transfer
// of the same id once the old one left the terminal history.
TEST(TransferTrackerDeadline, AHeldWriteOutlivesTheSecondPeriodUntilItsCallLetsGo) {
  TransferTracker t(kLongTimeout, 1);
  const std::vector<std::string> two = {"l0", "l1"};
  ASSERT_TRUE(t.BeginWrites("req", two, "decode-0").value());
  const TransferTracker::Clock::time_point now = TransferTracker::Clock::now();
  t.ExpireDeadlines(now + 2 * kLongTimeout);  // the first period
  t.ExpireDeadlines(now + 4 * kLongTimeout);  // the second one
  ExpectNoEvent(t, "held past both periods");
  EXPECT_EQ(t.quarantined(), 0u);
  t.EndWrites("req");
  TransferEvent e = OnlyEvent(t);
  EXPECT_EQ(e.state, TransferState::kTimedOut);
  EXPECT_TRUE(e.drained);
  EXPECT_EQ(t.quarantined(), 0u);
  EXPECT_TRUE(t.DrainQuarantine(8).empty());
}

// A batch whose writes the transport could not confirm (OnBatchUnconfirmed: its connection was
// closed with them in flight) may still change the peer's memory: its transfer ends failed and
// quarantined, and is never reported drained -- whether it ends then, or was quarantined by
// its deadline before. A review found such a WRITE reported drained, its bytes landing later.
TEST(TransferTrackerDeadline, AWriteTheTransportCouldNotConfirmIsNeverReportedDrained) {
  TransferTracker t(kLongTimeout, 16);
  const std::uint64_t unconfirmed = Schedule(t, "req", "l0");
  ASSERT_TRUE(t.Seal("req", "decode-0", 1).ok());
  t.OnBatchUnconfirmed(unconfirmed, Status::OK());
  TransferEvent e = OnlyEvent(t);
  EXPECT_EQ(e.state, TransferState::kFailed);
  EXPECT_FALSE(e.drained);
  EXPECT_NE(e.message.find("could not confirm"), std::string::npos) << e.message;
  EXPECT_EQ(t.quarantined(), 0u);
  EXPECT_TRUE(t.DrainQuarantine(8).empty());

  // Quarantined by its deadline with two batches in flight, one of them unconfirmed: the last
  // completion ends the quarantine without a drain notice.
  const std::uint64_t first = Schedule(t, "late", "l0");
  const std::uint64_t second = Schedule(t, "late", "l1");
  const TransferTracker::Clock::time_point now = TransferTracker::Clock::now();
  t.ExpireDeadlines(now + 2 * kLongTimeout);
  t.ExpireDeadlines(now + 4 * kLongTimeout);
  TransferEvent late = OnlyEvent(t);
  EXPECT_EQ(late.state, TransferState::kTimedOut);
  EXPECT_FALSE(late.drained);
  EXPECT_EQ(t.quarantined(), 1u);
  t.OnBatchUnconfirmed(first, AbortedError("peer removed"));
  t.OnBatchComplete(second, AbortedError("peer removed"));
  EXPECT_EQ(t.quarantined(), 0u);
  EXPECT_TRUE(t.DrainQuarantine(8).empty());
}

// ---- waiting in Drain -----------------------------------------------------------------------

// Drain's wait spins while a transfer's last batches are in flight and sleeps otherwise; either
// way an event that arrives during the wait is returned, not the timeout's empty answer.
TEST(TransferTrackerWait, AWaiterGetsTheEventWhetherItSpinsOrSleeps) {
  for (const std::size_t batches : {std::size_t{1}, TransferTracker::kSpinBatches + 3}) {
    SCOPED_TRACE(batches);
    TransferTracker t(kLongTimeout, 16);
    ASSERT_TRUE(t.BeginRead("rd", "prefill-0").ok());
    std::vector<std::uint64_t> tokens;
    for (std::size_t i = 0; i < batches; ++i) tokens.push_back(t.AddBatch("rd", 8, 1).value());
    t.CloseRead("rd");
    EXPECT_EQ(t.live_batches(), batches);
    std::latch waiting(1);
    std::thread completer([&] {
      waiting.wait();
      for (std::uint64_t token : tokens) t.OnBatchComplete(token, Status::OK());
    });
    waiting.count_down();
    // An hour: only the event (never the timeout) ends this wait in the test's lifetime.
    std::vector<TransferEvent> events = t.Drain(16, std::chrono::hours(1));
    completer.join();
    ASSERT_EQ(events.size(), 1u);
    EXPECT_EQ(events[0].transfer_id, "rd");
    EXPECT_EQ(events[0].state, TransferState::kDone);
    EXPECT_EQ(t.live_batches(), 0u);
  }
}

TEST(TransferTrackerWait, AWaitWithBatchesInFlightButNoEventEndsAtItsTimeout) {
  TransferTracker t(kLongTimeout, 16);
  ASSERT_TRUE(t.BeginRead("rd", "prefill-0").ok());
  const std::uint64_t token = t.AddBatch("rd", 8, 1).value();
  EXPECT_TRUE(t.Drain(16, 5ms).empty());  // spins, then gives up at the wait's end
  t.OnBatchComplete(token, Status::OK());
  EXPECT_TRUE(DrainNow(t).empty()) << "the READ is still open";
  t.CloseRead("rd");
  EXPECT_EQ(OnlyEvent(t).state, TransferState::kDone);
}

// A batch that stalls (a stopped peer, until its deadline) must not keep the waiter spinning:
// the spin lasts kMaxSpin after the last change of the in-flight count, then the wait sleeps.
// On a CPU host the waiting thread shares the cores with the model's threads.
std::chrono::nanoseconds ThreadCpuTime() {
  timespec ts{};
  clock_gettime(CLOCK_THREAD_CPUTIME_ID, &ts);
  return std::chrono::seconds(ts.tv_sec) + std::chrono::nanoseconds(ts.tv_nsec);
}

TEST(TransferTrackerWait, AStalledLastBatchIsWaitedForAsleepAfterTheSpinBudget) {
  TransferTracker t(kLongTimeout, 16);
  ASSERT_TRUE(t.BeginRead("rd", "prefill-0").ok());
  const std::uint64_t token = t.AddBatch("rd", 8, 1).value();
  const std::chrono::nanoseconds before = ThreadCpuTime();
  EXPECT_TRUE(t.Drain(16, 1000ms).empty());
  const std::chrono::nanoseconds spent = ThreadCpuTime() - before;
  // A whole second of spinning would use most of it even on a loaded machine; the budget is
  // TransferTracker::kMaxSpin of it, plus the wake-ups of a sleeping wait.
  EXPECT_LT(spent, 100ms) << "the waiter spun for " << spent.count() << " ns of CPU";
  t.OnBatchComplete(token, Status::OK());
  t.CloseRead("rd");
  EXPECT_EQ(OnlyEvent(t).state, TransferState::kDone);
}

// A quarantined transfer's batches may never complete: they stop counting, so no later wait
// spins on them.
TEST(TransferTrackerWait, QuarantinedBatchesNoLongerCountAsLive) {
  TransferTracker t(50ms, 16);
  const auto start = TransferTracker::Clock::now();
  ASSERT_TRUE(t.BeginRead("rd", "prefill-0").ok());
  const std::uint64_t token = t.AddBatch("rd", 8, 1).value();
  const std::uint64_t w = Schedule(t, "wr", "l0");
  EXPECT_EQ(t.live_batches(), 2u);
  t.ExpireDeadlines(start + std::chrono::hours(1));
  t.ExpireDeadlines(start + std::chrono::hours(2));  // both quarantined, batches in flight
  EXPECT_EQ(t.live_batches(), 0u);
  EXPECT_EQ(DrainNow(t).size(), 2u);
  t.OnBatchComplete(token, Status::OK());
  t.OnBatchComplete(w, Status::OK());
  EXPECT_EQ(t.live_batches(), 0u);
  EXPECT_EQ(t.DrainQuarantine(16).size(), 2u);
}

// ---- deadlines ----------------------------------------------------------------------------

TEST(TransferTrackerDeadline, TimedOutTransferEndsWhenItsBatchesDrainOrAfterASecondPeriod) {
  TransferTracker t(50ms, 16);
  const auto start = TransferTracker::Clock::now();
  const std::uint64_t w = Schedule(t, "wr", "l0");
  ASSERT_TRUE(t.BeginRead("rd", "prefill-0").ok());
  Result<std::uint64_t> r = t.AddBatch("rd", 8, 1);
  ASSERT_TRUE(r.ok()) << r.status().ToString();

  t.ExpireDeadlines(start);  // before any deadline
  ExpectNoEvent(t, "before the deadline");
  EXPECT_EQ(t.pending(), 2u);

  // Past the deadline with batches in flight: no event yet (their blocks may still be written),
  // and no new work is accepted.
  const auto late = start + std::chrono::hours(1);
  t.ExpireDeadlines(late);
  ExpectNoEvent(t, "timed out with batches in flight");
  EXPECT_FALSE(t.ScheduleWrite("wr", "l1", "decode-0", 1, 1).value().has_value());
  EXPECT_EQ(t.AddBatch("rd", 1, 1).status().code(), StatusCode::kFailedPrecondition);

  // The write's batch drains: it ends as timed out, once, with nothing in flight.
  t.OnBatchComplete(w, Status::OK());
  std::vector<TransferEvent> events = DrainNow(t);
  ASSERT_EQ(events.size(), 1u);
  EXPECT_EQ(events[0].transfer_id, "wr");
  EXPECT_EQ(events[0].state, TransferState::kTimedOut);
  EXPECT_TRUE(events[0].drained);

  // The read's batch does not complete: after a second period it ends anyway, QUARANTINED.
  t.ExpireDeadlines(late + std::chrono::hours(1));
  events = DrainNow(t);
  ASSERT_EQ(events.size(), 1u);
  EXPECT_EQ(events[0].transfer_id, "rd");
  EXPECT_EQ(events[0].state, TransferState::kTimedOut);
  EXPECT_FALSE(events[0].drained);
  EXPECT_NE(events[0].message.find("quarantined"), std::string::npos) << events[0].message;
  EXPECT_EQ(t.pending(), 0u);
  EXPECT_EQ(t.quarantined(), 1u);
  EXPECT_TRUE(t.DrainQuarantine(16).empty());  // its batch may still write

  // The transport finishes later: that drains the quarantine, reported exactly once; the ids
  // are not reusable for new work.
  EXPECT_EQ(t.BeginRead("rd", "prefill-0").code(), StatusCode::kAlreadyExists);
  t.OnBatchComplete(*r, TransportError("late"));
  std::vector<DrainedTransfer> drained = t.DrainQuarantine(16);
  ASSERT_EQ(drained.size(), 1u);
  EXPECT_EQ(drained[0].transfer_id, "rd");
  EXPECT_EQ(drained[0].kind, TransferKind::kRead);
  EXPECT_EQ(drained[0].peer, "prefill-0");
  EXPECT_EQ(t.quarantined(), 0u);
  t.OnBatchComplete(*r, Status::OK());
  EXPECT_TRUE(t.DrainQuarantine(16).empty());
  EXPECT_TRUE(t.Seal("wr", "decode-0", 1).ok());
  t.CloseRead("rd");
  t.ExpireDeadlines(late + std::chrono::hours(3));
  ExpectNoEvent(t, "after time out");
}

// A quarantined transfer drains only when ALL of its in-flight batches completed.
TEST(TransferTrackerDeadline, QuarantineDrainsAfterTheLastInFlightBatch) {
  TransferTracker t(50ms, 16);
  const std::uint64_t a = Schedule(t, "wr", "l0");
  const std::uint64_t b = Schedule(t, "wr", "l1");
  const auto late = TransferTracker::Clock::now() + std::chrono::hours(1);
  t.ExpireDeadlines(late);
  t.ExpireDeadlines(late + std::chrono::hours(1));
  TransferEvent e = OnlyEvent(t);
  EXPECT_EQ(e.state, TransferState::kTimedOut);
  EXPECT_FALSE(e.drained);
  t.OnBatchComplete(a, Status::OK());
  EXPECT_TRUE(t.DrainQuarantine(16).empty()) << "one batch of two still in flight";
  EXPECT_FALSE(t.ScheduleWrite("wr", "l2", "decode-0", 1, 1).value().has_value());
  t.OnBatchComplete(b, Status::OK());
  std::vector<DrainedTransfer> drained = t.DrainQuarantine(16);
  ASSERT_EQ(drained.size(), 1u);
  EXPECT_EQ(drained[0].kind, TransferKind::kWrite);
  ExpectNoEvent(t, "a drain is not a second terminal event");
}

TEST(TransferTrackerDeadline, AbortedTransferWaitingForBatchesStillEndsOnce) {
  TransferTracker t(50ms, 16);
  const std::uint64_t w = Schedule(t, "wr", "l0");
  ASSERT_TRUE(t.Abort("wr").ok());
  ExpectNoEvent(t, "aborted, in flight");
  const auto late = TransferTracker::Clock::now() + std::chrono::hours(1);
  t.ExpireDeadlines(late);
  ExpectNoEvent(t, "aborted and timed out, still in flight");
  t.ExpireDeadlines(late + std::chrono::hours(1));
  std::vector<TransferEvent> events = DrainNow(t);
  ASSERT_EQ(events.size(), 1u);
  // Either label is defensible; what matters is exactly one terminal event, then silence.
  EXPECT_TRUE(events[0].state == TransferState::kTimedOut ||
              events[0].state == TransferState::kAborted)
      << TransferStateName(events[0].state);
  t.OnBatchComplete(w, Status::OK());
  ExpectNoEvent(t, "completion after the deadline");
}

// ---- READ -------------------------------------------------------------------------------

TEST(TransferTrackerRead, CompletesWhenClosedAndEveryBatchFinished) {
  TransferTracker t(kLongTimeout, 16);
  ASSERT_TRUE(t.BeginRead("rd", "prefill-1").ok());
  Result<std::uint64_t> a = t.AddBatch("rd", 100, 3);
  Result<std::uint64_t> b = t.AddBatch("rd", 50, 2);
  ASSERT_TRUE(a.ok() && b.ok());
  t.OnBatchComplete(*a, Status::OK());
  ExpectNoEvent(t, "open read, one batch done");
  t.CloseRead("rd");
  ExpectNoEvent(t, "closed read, one batch in flight");
  t.OnBatchComplete(*b, Status::OK());
  TransferEvent e = OnlyEvent(t);
  EXPECT_EQ(e.kind, TransferKind::kRead);
  EXPECT_EQ(e.state, TransferState::kDone);
  EXPECT_EQ(e.peer, "prefill-1");
  EXPECT_EQ(e.bytes, 150);
  EXPECT_EQ(e.runs, 5);
  EXPECT_EQ(e.batches, 2);
}

TEST(TransferTrackerRead, LastBatchCompletingPastTheDeadlineTimesOutNeverDone) {
  // Found by a review: the deadline was checked only when the poller next expired deadlines,
  // so a READ whose last batch completed after it, before that check, was reported done -- past
  // the time the caller was promised its end by (a READ posted while the prefill held its blocks
  // for that long could then have read blocks the prefill freed).
  TransferTracker t(std::chrono::milliseconds(1), 16);
  ASSERT_TRUE(t.BeginRead("rd", "prefill-1").ok());
  Result<std::uint64_t> a = t.AddBatch("rd", 100, 3);
  ASSERT_TRUE(a.ok());
  t.CloseRead("rd");
  std::this_thread::sleep_for(5ms);  // past the deadline, no ExpireDeadlines in between
  t.OnBatchComplete(*a, Status::OK());
  TransferEvent e = OnlyEvent(t);
  EXPECT_EQ(e.state, TransferState::kTimedOut) << e.message;
  EXPECT_TRUE(e.drained);
}

TEST(TransferTrackerRead, FailsOnceIfAnyBatchFailed) {
  TransferTracker t(kLongTimeout, 16);
  ASSERT_TRUE(t.BeginRead("rd", "prefill-1").ok());
  Result<std::uint64_t> a = t.AddBatch("rd", 100, 3);
  Result<std::uint64_t> b = t.AddBatch("rd", 50, 2);
  ASSERT_TRUE(a.ok() && b.ok());
  t.CloseRead("rd");
  t.OnBatchComplete(*a, TransportError("remote region gone"));
  ExpectNoEvent(t, "failed batch, another in flight");
  t.OnBatchComplete(*b, Status::OK());
  TransferEvent e = OnlyEvent(t);
  EXPECT_EQ(e.state, TransferState::kFailed);
  EXPECT_NE(e.message.find("remote region gone"), std::string::npos) << e.message;
}

TEST(TransferTrackerRead, FailureWhileStillOpenEndsFailedOnce) {
  TransferTracker t(kLongTimeout, 16);
  ASSERT_TRUE(t.BeginRead("rd", "prefill-1").ok());
  Result<std::uint64_t> a = t.AddBatch("rd", 100, 3);
  ASSERT_TRUE(a.ok());
  t.OnBatchComplete(*a, TransportError("x"));
  t.CloseRead("rd");
  t.CloseRead("rd");
  TransferEvent e = OnlyEvent(t);
  EXPECT_EQ(e.state, TransferState::kFailed);
}

TEST(TransferTrackerRead, ReadWithoutBatchesIsDoneWhenClosed) {
  TransferTracker t(kLongTimeout, 16);
  ASSERT_TRUE(t.BeginRead("rd", "p").ok());
  ExpectNoEvent(t, "open read without batches");
  t.CloseRead("rd");
  EXPECT_EQ(OnlyEvent(t).state, TransferState::kDone);
}

TEST(TransferTrackerRead, DuplicateIdAndBatchesOnClosedOrUnknownReads) {
  TransferTracker t(kLongTimeout, 16);
  ASSERT_TRUE(t.BeginRead("rd", "p").ok());
  Status dup = t.BeginRead("rd", "p");
  EXPECT_EQ(dup.code(), StatusCode::kAlreadyExists) << dup.ToString();
  EXPECT_NE(dup.message().find("rd"), std::string::npos);
  Result<std::uint64_t> a = t.AddBatch("rd", 1, 1);
  ASSERT_TRUE(a.ok());
  t.CloseRead("rd");
  EXPECT_EQ(t.AddBatch("rd", 1, 1).status().code(), StatusCode::kFailedPrecondition);
  EXPECT_EQ(t.AddBatch("nope", 1, 1).status().code(), StatusCode::kFailedPrecondition);
  // A write id is not an open read either.
  Schedule(t, "wr", "l0");
  EXPECT_EQ(t.AddBatch("wr", 1, 1).status().code(), StatusCode::kFailedPrecondition);
  t.OnBatchComplete(*a, Status::OK());
  std::vector<TransferEvent> events = DrainNow(t);
  ASSERT_EQ(events.size(), 1u);
  EXPECT_EQ(events[0].transfer_id, "rd");
  EXPECT_EQ(events[0].batches, 1);  // refused AddBatch calls added nothing
  EXPECT_EQ(t.BeginRead("rd", "p").code(), StatusCode::kAlreadyExists);
}

TEST(TransferTrackerRead, AbortOfReadWithInFlightBatch) {
  TransferTracker t(kLongTimeout, 16);
  ASSERT_TRUE(t.BeginRead("rd", "p").ok());
  Result<std::uint64_t> a = t.AddBatch("rd", 1, 1);
  ASSERT_TRUE(a.ok());
  ASSERT_TRUE(t.Abort("rd").ok());
  EXPECT_EQ(t.AddBatch("rd", 1, 1).status().code(), StatusCode::kFailedPrecondition);
  ExpectNoEvent(t, "aborted read with a batch in flight");
  t.OnBatchComplete(*a, Status::OK());
  EXPECT_EQ(OnlyEvent(t).state, TransferState::kAborted);
}

// ---- peers, history, draining -------------------------------------------------------------

TEST(TransferTrackerPeer, FailPeerFailsOnlyThatPeersTransfersOnceTheyDrain) {
  TransferTracker t(kLongTimeout, 16);
  // Peer A: an idle unsealed write, a write with a batch in flight and a read in flight.
  const std::uint64_t idle = Schedule(t, "a-idle", "l0", 1, 1, "A");
  t.OnBatchComplete(idle, Status::OK());
  const std::uint64_t busy = Schedule(t, "a-busy", "l0", 1, 1, "A");
  ASSERT_TRUE(t.BeginRead("a-read", "A").ok());
  Result<std::uint64_t> rd = t.AddBatch("a-read", 1, 1);
  ASSERT_TRUE(rd.ok());
  // Peer B: unaffected.
  const std::uint64_t b = Schedule(t, "b-write", "l0", 1, 1, "B");

  t.FailPeer("A", TransportError("endpoint closed"));
  std::vector<TransferEvent> events = DrainNow(t);
  ASSERT_EQ(events.size(), 1u);
  EXPECT_EQ(events[0].transfer_id, "a-idle");
  EXPECT_EQ(events[0].state, TransferState::kFailed);
  EXPECT_NE(events[0].message.find("endpoint closed"), std::string::npos) << events[0].message;

  EXPECT_FALSE(t.ScheduleWrite("a-busy", "l1", "A", 1, 1).value().has_value());
  t.OnBatchComplete(busy, Status::OK());  // even a successful completion cannot save it
  t.OnBatchComplete(*rd, Status::OK());
  events = DrainNow(t);
  ASSERT_EQ(events.size(), 2u);
  std::map<std::string, TransferState> states;
  for (const TransferEvent& e : events) states[e.transfer_id] = e.state;
  EXPECT_EQ(states["a-busy"], TransferState::kFailed);
  EXPECT_EQ(states["a-read"], TransferState::kFailed);

  EXPECT_EQ(t.pending(), 1u);
  ASSERT_TRUE(t.Seal("b-write", "B", 1).ok());
  t.OnBatchComplete(b, Status::OK());
  TransferEvent e = OnlyEvent(t);
  EXPECT_EQ(e.transfer_id, "b-write");
  EXPECT_EQ(e.state, TransferState::kDone);
}

TEST(TransferTrackerHistory, TerminalSetIsBounded) {
  constexpr std::size_t kHistory = 8;
  constexpr std::size_t kExtra = 3;
  TransferTracker t(kLongTimeout, kHistory);
  for (std::size_t i = 0; i < kHistory + kExtra; ++i) {
    const std::string id = "t" + std::to_string(i);
    ASSERT_TRUE(t.BeginRead(id, "p").ok()) << id;
    t.CloseRead(id);
  }
  EXPECT_EQ(DrainNow(t).size(), kHistory + kExtra);
  // The oldest kExtra ids are forgotten: they can start again.
  for (std::size_t i = 0; i < kExtra; ++i) {
    const std::string id = "t" + std::to_string(i);
    EXPECT_FALSE(t.IsTerminal(id)) << id;
    EXPECT_TRUE(t.BeginRead(id, "p").ok()) << id;
  }
  // The newest kHistory ids are still remembered.
  for (std::size_t i = kExtra; i < kHistory + kExtra; ++i) {
    const std::string id = "t" + std::to_string(i);
    EXPECT_TRUE(t.IsTerminal(id)) << id;
    EXPECT_EQ(t.BeginRead(id, "p").code(), StatusCode::kAlreadyExists) << id;
    EXPECT_EQ(t.ScheduleWrite(id, "l0", "p", 1, 1).status().code(), StatusCode::kInvalidArgument)
        << id << " is a READ";
  }
  ExpectNoEvent(t, "after re-beginning forgotten ids (still open)");
}

TEST(TransferTrackerDrain, OldestFirstAndBoundedByMaxEvents) {
  TransferTracker t(kLongTimeout, 64);
  for (int i = 0; i < 5; ++i) ASSERT_TRUE(t.Seal("s" + std::to_string(i), "p", 0).ok());
  std::vector<TransferEvent> first = t.Drain(2, 0ms);
  ASSERT_EQ(first.size(), 2u);
  EXPECT_EQ(first[0].transfer_id, "s0");
  EXPECT_EQ(first[1].transfer_id, "s1");
  std::vector<TransferEvent> rest = t.Drain(100, 0ms);
  ASSERT_EQ(rest.size(), 3u);
  EXPECT_EQ(rest[0].transfer_id, "s2");
  EXPECT_EQ(rest[2].transfer_id, "s4");
}

TEST(TransferTrackerDrain, WaitingDrainWakesForAnEventFromAnotherThread) {
  TransferTracker t(kLongTimeout, 16);
  const std::uint64_t token = Schedule(t, "req", "l0", 100, 2, "p");
  ASSERT_TRUE(t.Seal("req", "p", 1).ok());
  std::thread completer([&] {
    std::this_thread::sleep_for(20ms);
    t.OnBatchComplete(token, Status::OK());
  });
  // The generous wait only bounds a hang; the event must be what ends it.
  std::vector<TransferEvent> events = t.Drain(10, std::chrono::milliseconds(60000));
  completer.join();
  ASSERT_EQ(events.size(), 1u);
  EXPECT_EQ(events[0].transfer_id, "req");
}

// ---- concurrency ----------------------------------------------------------------------------

// Several threads drive many transfers at once: schedulers add writes (and reads), completers
// finish batches (some with errors), a sealer, an aborter and a peer-failure thread race them, and
// a drainer collects events concurrently. Afterwards every transfer must have produced exactly
// one terminal event, with a state consistent with what happened to it. Meaningful under TSan:
// every call crosses threads on shared transfers.
TEST(TransferTrackerStress, ExactlyOneTerminalEventPerTransfer) {
  constexpr int kWrites = 2000;
  constexpr int kReads = 600;
  constexpr int kLayers = 4;
  TransferTracker t(kLongTimeout, 1 << 16);

  struct Token {
    std::uint64_t token;
    int transfer;
  };
  std::mutex tokens_mu;
  std::vector<Token> tokens;  // in flight, to be completed
  std::atomic<bool> producing{true};
  // Progress of the producers, so that the sealer and aborter act on transfers in flight.
  std::atomic<int> write_progress{0};    // first scheduler
  std::atomic<int> write_progress_2{0};  // second scheduler
  std::atomic<int> read_progress{kWrites};
  // What each thread did to each transfer, for the consistency check at the end.
  std::vector<std::atomic<bool>> aborted(kWrites + kReads);
  std::vector<std::atomic<bool>> failed_batch(kWrites + kReads);
  std::vector<std::atomic<bool>> peer_failed(kWrites + kReads);
  auto name = [](int i) { return (i < kWrites ? "w" : "r") + std::to_string(i); };
  auto peer_of = [](int i) { return "peer" + std::to_string(i % 7); };

  auto push = [&](std::uint64_t token, int transfer) {
    std::lock_guard lock(tokens_mu);
    tokens.push_back({token, transfer});
  };

  constexpr int kActors = 7;  // threads created below, drainer excluded
  std::latch start(kActors);  // all actors begin together so that they really interleave
  std::vector<std::thread> threads;
  // Two write schedulers, interleaving layers of the same transfers.
  for (int s = 0; s < 2; ++s) {
    threads.emplace_back([&, s] {
      start.arrive_and_wait();
      std::mt19937 rng(100 + s);
      for (int i = 0; i < kWrites; ++i) {
        for (int l = s; l < kLayers; l += 2) {
          std::optional<std::uint64_t> tok =
              t.ScheduleWrite(name(i), "layer" + std::to_string(l), peer_of(i), 10, 1).value();
          if (tok) push(*tok, i);
          // A duplicate of the same layer is never accepted.
          if (rng() % 8 == 0) {
            EXPECT_FALSE(t.ScheduleWrite(name(i), "layer" + std::to_string(l), peer_of(i), 10, 1).value());
          }
        }
        if (s == 0) write_progress = i + 1;
        if (s == 1) write_progress_2 = i + 1;
      }
    });
  }
  // One read producer.
  threads.emplace_back([&] {
    start.arrive_and_wait();
    for (int i = kWrites; i < kWrites + kReads; ++i) {
      ASSERT_TRUE(t.BeginRead(name(i), peer_of(i)).ok());
      for (int b = 0; b < 3; ++b) {
        Result<std::uint64_t> tok = t.AddBatch(name(i), 5, 1);
        if (tok.ok()) push(*tok, i);  // refused once aborted or failed by peer
      }
      if (i % 10 != 5) t.CloseRead(name(i));
      read_progress = i + 1;
    }
  });
  // Two completers; about 3% of batches fail.
  for (int c = 0; c < 2; ++c) {
    threads.emplace_back([&, c] {
      start.arrive_and_wait();
      std::mt19937 rng(200 + c);
      while (true) {
        std::optional<Token> tok;
        {
          std::lock_guard lock(tokens_mu);
          if (!tokens.empty()) {
            const std::size_t k = rng() % tokens.size();
            tok = tokens[k];
            tokens[k] = tokens.back();
            tokens.pop_back();
          }
        }
        if (!tok) {
          if (!producing.load()) {
            std::lock_guard lock(tokens_mu);
            if (tokens.empty()) return;
            continue;
          }
          std::this_thread::yield();
          continue;
        }
        if (rng() % 32 == 0) {
          failed_batch[tok->transfer] = true;
          t.OnBatchComplete(tok->token, TransportError("injected"));
        } else {
          t.OnBatchComplete(tok->token, Status::OK());
        }
        if (rng() % 16 == 0) t.OnBatchComplete(tok->token, Status::OK());  // duplicate: ignored
      }
    });
  }
  // Sealer: seals each write once the first scheduler has scheduled its layers, racing the
  // second scheduler (whose layers of that transfer are then refused or counted).
  threads.emplace_back([&] {
    start.arrive_and_wait();
    for (int i = 0; i < kWrites; ++i) {
      while (write_progress.load() <= i) std::this_thread::yield();
      if (i % 10 != 5) {
        EXPECT_TRUE(t.Seal(name(i), peer_of(i), kLayers).ok());
      }
    }
  });
  // Aborter and peer-failure thread. Every tenth transfer (i % 10 == 5) is never sealed or
  // closed by its producer; this thread aborts it once it exists, racing its in-flight batches.
  threads.emplace_back([&] {
    start.arrive_and_wait();
    std::mt19937 rng(400);
    int next_w = 5;
    int next_r = kWrites + 5;
    int aborts = 0;
    while (next_w < kWrites || next_r < kWrites + kReads) {
      int target = -1;
      if (next_w < kWrites && write_progress.load() > next_w) {
        target = next_w;
        next_w += 10;
      } else if (next_r < kWrites + kReads && read_progress.load() > next_r) {
        target = next_r;
        next_r += 10;
      }
      if (target < 0) {
        std::this_thread::yield();
        continue;
      }
      Status st = t.Abort(name(target));
      EXPECT_TRUE(st.ok()) << st.ToString();
      aborted[target] = true;
      if (++aborts % 60 == 0 && aborts <= 120) {
        const std::string p = "peer" + std::to_string(rng() % 7);
        t.FailPeer(p, TransportError("lost"));
        // FailPeer may have failed any transfer of this peer that existed meanwhile: one a
        // producer had started by now (+1: the one it is working on).
        const int writes_started = std::max(write_progress.load(), write_progress_2.load()) + 1;
        const int reads_started = read_progress.load() + 1;
        for (int j = 0; j < kWrites + kReads; ++j) {
          const bool started = j < kWrites ? j < writes_started : j < reads_started;
          if (started && peer_of(j) == p) peer_failed[j] = true;
        }
      }
    }
  });
  // A concurrent drainer.
  std::mutex events_mu;
  std::vector<TransferEvent> events;
  std::atomic<bool> draining{true};
  std::thread drainer([&] {
    while (draining.load()) {
      std::vector<TransferEvent> got = t.Drain(64, 1ms);
      std::lock_guard lock(events_mu);
      for (TransferEvent& e : got) events.push_back(std::move(e));
    }
  });

  // Completers exit once producers are done and the queue is empty.
  const std::size_t completer_begin = 3;
  for (std::size_t i = 0; i < threads.size(); ++i) {
    if (i == completer_begin || i == completer_begin + 1) continue;
    threads[i].join();
  }
  producing = false;
  threads[completer_begin].join();
  threads[completer_begin + 1].join();
  // Every batch completed and every transfer is aborted, sealed or closed; late seals and closes
  // of terminal transfers are ignored.
  for (int i = 0; i < kWrites; ++i) EXPECT_TRUE(t.Seal(name(i), peer_of(i), kLayers).ok());
  for (int i = kWrites; i < kWrites + kReads; ++i) t.CloseRead(name(i));
  draining = false;
  drainer.join();
  for (TransferEvent& e : DrainNow(t)) events.push_back(std::move(e));

  EXPECT_EQ(t.pending(), 0u);
  std::map<std::string, std::vector<TransferState>> by_id;
  for (const TransferEvent& e : events) by_id[e.transfer_id].push_back(e.state);
  EXPECT_EQ(events.size(), static_cast<std::size_t>(kWrites + kReads));
  std::map<std::string_view, int> state_counts;
  for (int i = 0; i < kWrites + kReads; ++i) {
    auto it = by_id.find(name(i));
    ASSERT_NE(it, by_id.end()) << name(i) << " never ended";
    ASSERT_EQ(it->second.size(), 1u) << name(i) << " ended " << it->second.size() << " times";
    const TransferState s = it->second.front();
    SCOPED_TRACE(name(i) + " ended " + std::string(TransferStateName(s)));
    if (!aborted[i] && !peer_failed[i] && !failed_batch[i]) {
      EXPECT_EQ(s, TransferState::kDone) << name(i);
    }
    if (failed_batch[i] && !aborted[i]) {
      EXPECT_EQ(s, TransferState::kFailed) << name(i);
    }
    if (s == TransferState::kAborted) {
      EXPECT_TRUE(aborted[i]) << name(i);
    }
    if (i % 10 == 5 && !failed_batch[i] && !peer_failed[i]) {
      EXPECT_EQ(s, TransferState::kAborted) << name(i);  // it could not end before its abort
    }
    ++state_counts[TransferStateName(s)];
    EXPECT_NE(s, TransferState::kTimedOut) << name(i);
  }
  for (const auto& [state, n] : state_counts) {
    RecordProperty(std::string(state), n);
    std::printf("  %s: %d\n", std::string(state).c_str(), n);
  }
}

// Review E: a quarantined transfer can outlive its terminal record (terminal_history); the
// tracker still holds it (it refuses the id for a new READ), so Abort is the no-op it is for an
// ended transfer, not NotFound, and WRITE calls on the READ's id are InvalidArgument, not a
// silent "ended" answer.
TEST(TransferTrackerQuarantine, AQuarantinedReadOutlivingItsTerminalRecordIsStillKnown) {
  TransferTracker t(10ms, /*terminal_history=*/1);
  ASSERT_TRUE(t.BeginRead("a", "P").ok());
  Result<std::uint64_t> token = t.AddBatch("a", 64, 1);
  ASSERT_TRUE(token.ok());
  t.CloseRead("a");
  const auto start = TransferTracker::Clock::now();
  t.ExpireDeadlines(start + 20ms);           // timed out, its batch still in flight
  t.ExpireDeadlines(start + std::chrono::hours(1));  // ended: quarantined
  ASSERT_EQ(t.quarantined(), 1u);
  ASSERT_TRUE(t.Seal("b", "P", 0).ok());  // ends at once and pushes 'a' out of the history
  ASSERT_FALSE(t.IsTerminal("a"));
  EXPECT_EQ(t.BeginRead("a", "P").code(), StatusCode::kAlreadyExists);
  EXPECT_TRUE(t.Abort("a").ok()) << t.Abort("a").ToString();
  EXPECT_EQ(t.ScheduleWrite("a", "l0", "P", 64, 1).status().code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(t.Seal("a", "P", 1).status().code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(t.FailWrite("a", "P", AbortedError("x")).code(), StatusCode::kInvalidArgument);
  t.OnBatchComplete(*token, Status::OK());
  const std::vector<DrainedTransfer> drained = t.DrainQuarantine(10);
  ASSERT_EQ(drained.size(), 1u);
  EXPECT_EQ(drained.front().transfer_id, "a");
}

}  // namespace
}  // namespace moriio_native::detail
