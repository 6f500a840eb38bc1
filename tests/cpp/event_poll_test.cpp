// Tests of detail::EventPass (cpp/event_poll.hpp), how a backend thread asks about the device
// events its batches wait for in one pass: each distinct event once, at most kMaxPending that
// have not completed, errors handed back to every batch of that event.

#include "event_poll.hpp"

#include <gtest/gtest.h>

#include <cstdint>
#include <map>
#include <optional>
#include <vector>

namespace moriio_native::detail {
namespace {

// A fake driver: events in `pending` have not completed, those in `broken` cannot be asked about.
struct Driver {
  std::vector<std::uint64_t> pending;
  std::vector<std::uint64_t> broken;
  std::map<std::uint64_t, int> asked;

  Result<bool> operator()(std::uint64_t event) {
    ++asked[event];
    for (std::uint64_t b : broken) {
      if (b == event) return TransportError("event " + std::to_string(event));
    }
    for (std::uint64_t p : pending) {
      if (p == event) return false;
    }
    return true;
  }
};

TEST(EventPass, AsksAboutEachDistinctEventOncePerPass) {
  Driver driver{.pending = {2}};
  EventPass pass;
  // The batches of one write_layers call share an event; interleaved ones come back to it.
  for (std::uint64_t e : {1, 1, 2, 1, 2, 3}) {
    const std::optional<Result<bool>> completed = pass.Ask(e, driver);
    ASSERT_TRUE(completed.has_value());
    ASSERT_TRUE(completed->ok());
    EXPECT_EQ(**completed, e != 2) << "event " << e;
  }
  EXPECT_EQ(driver.asked, (std::map<std::uint64_t, int>{{1, 1}, {2, 1}, {3, 1}}));
}

TEST(EventPass, StopsAskingAfterMaxPendingUncompletedEvents) {
  Driver driver;
  for (std::uint64_t e = 10; e < 10 + EventPass::kMaxPending + 2; ++e) driver.pending.push_back(e);
  EventPass pass;
  for (std::uint64_t e = 10; e < 10 + EventPass::kMaxPending; ++e) {
    ASSERT_TRUE(pass.Ask(e, driver).has_value()) << "event " << e;
  }
  EXPECT_FALSE(pass.Ask(10 + EventPass::kMaxPending, driver).has_value());
  // Completed events and ones already answered still cost nothing new.
  EXPECT_FALSE(pass.Ask(99, driver).has_value());
  const std::optional<Result<bool>> again = pass.Ask(10, driver);
  ASSERT_TRUE(again.has_value() && again->ok());
  EXPECT_FALSE(**again);
  EXPECT_EQ(driver.asked.size(), static_cast<std::size_t>(EventPass::kMaxPending));
  // A new pass asks again.
  EventPass next;
  EXPECT_TRUE(next.Ask(10 + EventPass::kMaxPending, driver).has_value());
}

TEST(EventPass, AnEventThatCannotBeAskedAboutFailsEveryBatchOfItAndCountsAsNoPending) {
  Driver driver{.broken = {5}};
  EventPass pass;
  for (int batch = 0; batch < 2; ++batch) {
    const std::optional<Result<bool>> completed = pass.Ask(5, driver);
    ASSERT_TRUE(completed.has_value());
    ASSERT_FALSE(completed->ok());
    EXPECT_NE(completed->status().message().find("event 5"), std::string::npos);
  }
  EXPECT_EQ(driver.asked[5], 1);
  for (std::uint64_t e = 20; e < 20 + EventPass::kMaxPending; ++e) {
    driver.pending.push_back(e);
    EXPECT_TRUE(pass.Ask(e, driver).has_value()) << "event " << e;
  }
}

}  // namespace
}  // namespace moriio_native::detail
