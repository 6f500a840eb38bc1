// Tests of the process's timing marks (include/moriio_native/trace_marks.hpp): what is kept, in
// which order, by which thread, and what a build without them does. No timing is asserted.

#include "moriio_native/trace_marks.hpp"

#include <gtest/gtest.h>

#include <set>
#include <string_view>
#include <thread>
#include <utility>
#include <vector>

#include "test_printers.hpp"

namespace moriio_native {
namespace {

using trace::Mark;

// Every test starts from a disabled, empty recorder and leaves one.
class TraceMarks : public ::testing::Test {
 protected:
  void SetUp() override { Reset(); }
  void TearDown() override { Reset(); }
  static void Reset() {
    trace::Disable();
    trace::Take();
  }
};

TEST_F(TraceMarks, ABuildWithoutThemRefusesToEnableAndRecordsNothing) {
  if (trace::CompiledIn()) GTEST_SKIP() << "this build has the marks compiled in";
  const Status st = trace::Enable(16);
  EXPECT_EQ(st.code(), StatusCode::kFailedPrecondition);
  EXPECT_NE(st.message().find("MORIIO_NATIVE_TRACE_MARKS"), std::string::npos) << st.ToString();
  trace::Record(Mark::kCallEntry);
  EXPECT_TRUE(trace::Take().stamps.empty());
}

TEST_F(TraceMarks, ACapacityOutOfRangeIsRefusedAndChangesNothing) {
  if (!trace::CompiledIn()) GTEST_SKIP() << "built without MORIIO_NATIVE_TRACE_MARKS";
  ASSERT_TRUE(trace::Enable(4).ok());
  trace::Record(Mark::kCallEntry, 7);
  EXPECT_EQ(trace::Enable(0).code(), StatusCode::kInvalidArgument);
  const Status big = trace::Enable((std::size_t{1} << 24) + 1);
  EXPECT_EQ(big.code(), StatusCode::kInvalidArgument);
  EXPECT_NE(big.message().find("16777217"), std::string::npos) << big.ToString();
  trace::Record(Mark::kCallExit, 7);  // still enabled, the first stamp still there
  const trace::Taken t = trace::Take();
  ASSERT_EQ(t.stamps.size(), 2u);
  EXPECT_EQ(t.stamps[0].mark, Mark::kCallEntry);
  EXPECT_EQ(t.stamps[1].mark, Mark::kCallExit);
}

TEST_F(TraceMarks, StampsAreKeptInOrderUpToTheCapacityAndTheRestCounted) {
  if (!trace::CompiledIn()) GTEST_SKIP() << "built without MORIIO_NATIVE_TRACE_MARKS";
  trace::Record(Mark::kCallEntry);  // not enabled yet: not kept
  ASSERT_TRUE(trace::Enable(3).ok());
  trace::Record(Mark::kCallEntry);
  trace::Record(Mark::kSubmitEntry, 41);
  trace::Record(Mark::kSubmitExit, 41);
  trace::Record(Mark::kCallExit);
  trace::Record(Mark::kCallExit);
  trace::Taken t = trace::Take();
  ASSERT_EQ(t.stamps.size(), 3u);
  EXPECT_EQ(t.dropped, 2u);
  EXPECT_EQ(t.stamps[0].mark, Mark::kCallEntry);
  EXPECT_EQ(t.stamps[1].mark, Mark::kSubmitEntry);
  EXPECT_EQ(t.stamps[1].token, 41u);
  EXPECT_EQ(t.stamps[2].mark, Mark::kSubmitExit);
  for (std::size_t i = 1; i < t.stamps.size(); ++i) {
    EXPECT_LE(t.stamps[i - 1].ns, t.stamps[i].ns) << "steady clock went back at " << i;
    EXPECT_EQ(t.stamps[i].thread, t.stamps[0].thread);
  }
  // Take empties the recorder and resets the count; recording goes on with room again.
  trace::Record(Mark::kPlanned);
  t = trace::Take();
  ASSERT_EQ(t.stamps.size(), 1u);
  EXPECT_EQ(t.dropped, 0u);
  EXPECT_EQ(t.stamps[0].mark, Mark::kPlanned);
  trace::Disable();
  trace::Record(Mark::kPlanned);
  EXPECT_TRUE(trace::Take().stamps.empty());
}

TEST_F(TraceMarks, EachThreadGetsItsOwnNumber) {
  if (!trace::CompiledIn()) GTEST_SKIP() << "built without MORIIO_NATIVE_TRACE_MARKS";
  ASSERT_TRUE(trace::Enable(64).ok());
  std::vector<std::thread> threads;
  for (int i = 0; i < 4; ++i) {
    threads.emplace_back([] {
      trace::Record(Mark::kActivated, 1);
      trace::Record(Mark::kCopySubmitEntry, 1);
    });
  }
  for (std::thread& t : threads) t.join();
  const trace::Taken t = trace::Take();
  ASSERT_EQ(t.stamps.size(), 8u);
  std::set<std::uint32_t> ids;
  for (const trace::Stamp& s : t.stamps) ids.insert(s.thread);
  EXPECT_EQ(ids.size(), 4u);
  EXPECT_EQ(ids.count(0), 0u) << "thread numbers start at 1";
}

TEST_F(TraceMarks, EveryMarkHasItsName) {
  const std::vector<std::pair<Mark, std::string_view>> names = {
      {Mark::kCallEntry, "call_entry"},
      {Mark::kPlanned, "planned"},
      {Mark::kPieceCut, "piece_cut"},
      {Mark::kSubmitEntry, "submit_entry"},
      {Mark::kSubmitExit, "submit_exit"},
      {Mark::kCallExit, "call_exit"},
      {Mark::kActivated, "activated"},
      {Mark::kCopySubmitEntry, "copy_submit_entry"},
      {Mark::kCopySubmitExit, "copy_submit_exit"},
      {Mark::kBindingEntry, "binding_entry"},
      {Mark::kPairsChecked, "pairs_checked"},
      {Mark::kLayersPlanned, "layers_planned"},
      {Mark::kWakeSent, "wake_sent"},
      {Mark::kWoke, "woke"},
  };
  ASSERT_EQ(names.size(), trace::kMarkCount);
  for (const auto& [mark, name] : names) EXPECT_EQ(trace::MarkName(mark), name);
  EXPECT_EQ(trace::MarkName(static_cast<Mark>(trace::kMarkCount)), "unknown");
}

}  // namespace
}  // namespace moriio_native
