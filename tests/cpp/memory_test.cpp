// Tests of PlanRegistration (include/moriio_native/memory.hpp).
//
// The property that matters most (DESIGN.md §2 item 3, §3.2): a planned region NEVER extends
// outside the allocation, because whatever it covers is exposed to remote peers. Beyond that: one
// region for all views, page aligned whenever an aligned region inside the allocation can cover
// every view, otherwise the exact span of the views (marked unaligned) or, when unaligned regions
// are not allowed, an InvalidArgument that tells the caller to use allocate_kv_backing.

#include "moriio_native/memory.hpp"

#include <gtest/gtest.h>

#include <algorithm>
#include <cstdint>
#include <limits>
#include <ostream>
#include <random>
#include <string>
#include <vector>

namespace moriio_native {
// Readable gtest messages for the enums compared below (found by argument-dependent lookup).
inline void PrintTo(StatusCode code, std::ostream* os) { *os << StatusCodeName(code); }
}  // namespace moriio_native

namespace moriio_native {
namespace {

constexpr std::uint64_t kPage = 4096;
constexpr std::uint64_t kMax = std::numeric_limits<std::uint64_t>::max();

Result<RegistrationPlan> Plan(std::uint64_t base, std::uint64_t size,
                              const std::vector<ViewRange>& views, std::uint64_t page = kPage,
                              bool allow_unaligned = true) {
  return PlanRegistration(base, size, views, page, allow_unaligned);
}

// Checks every invariant a successful plan must satisfy, whatever the input.
void ExpectSound(const RegistrationPlan& plan, std::uint64_t base, std::uint64_t size,
                 const std::vector<ViewRange>& views, std::uint64_t page) {
  ASSERT_EQ(plan.regions.size(), 1u) << "views of one allocation share one region";
  const PlannedRegion& r = plan.regions[0];
  ASSERT_GT(r.size, 0u);
  // Inside the allocation: nothing before it, nothing after it.
  EXPECT_GE(r.start, base);
  EXPECT_LE(r.start + r.size, base + size);
  if (r.aligned) {
    EXPECT_EQ(r.start % page, 0u) << "region marked aligned starts off a page boundary";
    EXPECT_EQ((r.start + r.size) % page, 0u) << "region marked aligned ends off a page boundary";
  }
  ASSERT_EQ(plan.placements.size(), views.size());
  for (std::size_t i = 0; i < views.size(); ++i) {
    EXPECT_EQ(plan.placements[i].region, 0u);
    EXPECT_EQ(plan.placements[i].offset, views[i].ptr - r.start) << "view " << i;
    EXPECT_GE(views[i].ptr, r.start) << "view " << i << " starts before its region";
    EXPECT_LE(views[i].ptr + views[i].nbytes, r.start + r.size)
        << "view " << i << " ends after its region";
  }
}

void ExpectInvalid(const Result<RegistrationPlan>& r, const std::string& needle = "") {
  ASSERT_FALSE(r.ok()) << "expected an error" << (needle.empty() ? "" : " about " + needle);
  EXPECT_EQ(r.status().code(), StatusCode::kInvalidArgument) << r.status().ToString();
  EXPECT_FALSE(r.status().message().empty());
  if (!needle.empty()) {
    EXPECT_NE(r.status().message().find(needle), std::string::npos) << r.status().ToString();
  }
}

TEST(PlanRegistration, AlignedAllocationWithUnalignedViewsGetsOneAlignedRegion) {
  const std::uint64_t base = 0x7f0000100000;
  const std::uint64_t size = 8 * kPage;
  // Views are not page aligned (layers packed one after another inside a shared buffer), given
  // out of address order.
  const std::vector<ViewRange> views = {
      {base + 3 * kPage + 100, 5000}, {base + 40, 1000}, {base + 1040, 2 * kPage}};
  Result<RegistrationPlan> plan = Plan(base, size, views);
  ASSERT_TRUE(plan.ok()) << plan.status().ToString();
  ExpectSound(*plan, base, size, views, kPage);
  EXPECT_TRUE(plan->regions[0].aligned);
}

TEST(PlanRegistration, ViewsCoveringAWholeAlignedAllocationRegisterExactlyIt) {
  const std::uint64_t base = 0x200000;
  const std::uint64_t size = 3 * kPage;
  const std::vector<ViewRange> views = {{base, kPage}, {base + kPage, 2 * kPage}};
  Result<RegistrationPlan> plan = Plan(base, size, views);
  ASSERT_TRUE(plan.ok()) << plan.status().ToString();
  // The only region that is aligned, inside and covering is the allocation itself.
  EXPECT_EQ(plan->regions[0], (PlannedRegion{base, size, true}));
  EXPECT_EQ(plan->placements[0], (Placement{0, 0}));
  EXPECT_EQ(plan->placements[1], (Placement{0, kPage}));
}

TEST(PlanRegistration, UnalignedBaseNeverRegistersBytesBeforeTheAllocation) {
  // The allocation starts 16 bytes into a page and its first view starts right there: the
  // aligned region would begin 16 bytes BEFORE the allocation (the MiniMax/GSM8K bug). The plan
  // must fall back to the exact span.
  const std::uint64_t base = 0x300010;
  const std::uint64_t size = 2 * kPage;
  const std::vector<ViewRange> views = {{base, kPage}, {base + kPage, kPage}};
  Result<RegistrationPlan> plan = Plan(base, size, views);
  ASSERT_TRUE(plan.ok()) << plan.status().ToString();
  ExpectSound(*plan, base, size, views, kPage);
  EXPECT_EQ(plan->regions[0], (PlannedRegion{base, size, false}));
  EXPECT_EQ(plan->placements[0].offset, 0u);
  EXPECT_EQ(plan->placements[1].offset, kPage);
}

TEST(PlanRegistration, UnalignedEndNeverRegistersBytesAfterTheAllocation) {
  const std::uint64_t base = 0x400000;
  const std::uint64_t size = 2 * kPage + 100;  // ends 100 bytes into a page
  const std::vector<ViewRange> views = {{base + 8, 2 * kPage + 92}};
  Result<RegistrationPlan> plan = Plan(base, size, views);
  ASSERT_TRUE(plan.ok()) << plan.status().ToString();
  ExpectSound(*plan, base, size, views, kPage);
  EXPECT_EQ(plan->regions[0], (PlannedRegion{base + 8, 2 * kPage + 92, false}));
}

TEST(PlanRegistration, UnalignedAllocationStillAlignsWhenViewsSitOnInnerPages) {
  const std::uint64_t base = 0x500010;  // off a page boundary
  const std::uint64_t size = 6 * kPage;
  const std::vector<ViewRange> views = {{0x501000 + 64, 128}, {0x503000, kPage}};
  Result<RegistrationPlan> plan = Plan(base, size, views);
  ASSERT_TRUE(plan.ok()) << plan.status().ToString();
  ExpectSound(*plan, base, size, views, kPage);
  EXPECT_TRUE(plan->regions[0].aligned) << "whole pages inside the allocation cover the views";
}

TEST(PlanRegistration, NoUnalignedFallbackFailsWithAllocatorGuidance) {
  const std::uint64_t base = 0x300010;
  const std::vector<ViewRange> views = {{base, kPage}};
  Result<RegistrationPlan> plan = Plan(base, 2 * kPage, views, kPage, /*allow_unaligned=*/false);
  ExpectInvalid(plan, "allocate_kv_backing");
  // Unaligned end, too.
  ExpectInvalid(Plan(0x400000, kPage + 1, {{0x400000, kPage + 1}}, kPage, false),
                "allocate_kv_backing");
  // The same views with an aligned allocation are fine without the fallback.
  Result<RegistrationPlan> ok = Plan(0x300000, 2 * kPage, {{0x300010, kPage}}, kPage, false);
  ASSERT_TRUE(ok.ok()) << ok.status().ToString();
  EXPECT_TRUE(ok->regions[0].aligned);
}

TEST(PlanRegistration, LargerPowerOfTwoPages) {
  constexpr std::uint64_t kHuge = 2 << 20;  // 2 MiB
  const std::uint64_t base = 0x40000000;
  const std::vector<ViewRange> views = {{base + 12345, 3 << 20}};
  Result<RegistrationPlan> plan = Plan(base, 4 << 20, views, kHuge);
  ASSERT_TRUE(plan.ok()) << plan.status().ToString();
  ExpectSound(*plan, base, 4 << 20, views, kHuge);
  EXPECT_TRUE(plan->regions[0].aligned);
  // With 2 MiB pages an allocation that is only 4 KiB aligned cannot be aligned.
  Result<RegistrationPlan> small = Plan(base + kPage, 4 << 20, {{base + kPage, 1 << 20}}, kHuge);
  ASSERT_TRUE(small.ok()) << small.status().ToString();
  ExpectSound(*small, base + kPage, 4 << 20, {{base + kPage, 1 << 20}}, kHuge);
  EXPECT_FALSE(small->regions[0].aligned);
}

TEST(PlanRegistration, ViewsOutsideTheAllocationAreRejected) {
  const std::uint64_t base = 0x600000;
  const std::uint64_t size = 4 * kPage;
  ExpectInvalid(Plan(base, size, {{base, 64}, {base - 1, 64}}), "view 1");  // starts before
  ExpectInvalid(Plan(base, size, {{base + size - 63, 64}}), "view 0");      // ends after
  ExpectInvalid(Plan(base, size, {{base + size, 1}}), "view 0");            // just past the end
  ExpectInvalid(Plan(base, size, {{0x100, 64}}), "view 0");                 // elsewhere entirely
  // Exactly touching the end is inside.
  Result<RegistrationPlan> edge = Plan(base, size, {{base + size - 64, 64}});
  ASSERT_TRUE(edge.ok()) << edge.status().ToString();
}

TEST(PlanRegistration, EmptyInputsAreRejected) {
  ExpectInvalid(Plan(0x600000, kPage, {}));               // no views
  ExpectInvalid(Plan(0x600000, kPage, {{0x600000, 0}}));  // empty view
  ExpectInvalid(Plan(0x600000, 0, {{0x600000, 16}}));     // empty allocation
}

TEST(PlanRegistration, PageSizeMustBeAPowerOfTwo) {
  const std::vector<ViewRange> views = {{0x600000, 64}};
  for (std::uint64_t page : {std::uint64_t{0}, std::uint64_t{3}, std::uint64_t{4095},
                             std::uint64_t{6000}, std::uint64_t{4097}, kMax}) {
    SCOPED_TRACE("page_size " + std::to_string(page));
    ExpectInvalid(Plan(0x600000, kPage, views, page));
  }
  for (std::uint64_t page : {std::uint64_t{1}, std::uint64_t{64}, std::uint64_t{65536}}) {
    SCOPED_TRACE("page_size " + std::to_string(page));
    Result<RegistrationPlan> plan = Plan(0x600000, kPage, views, page);
    ASSERT_TRUE(plan.ok()) << plan.status().ToString();
    ExpectSound(*plan, 0x600000, kPage, views, page);
  }
}

TEST(PlanRegistration, OverflowIsAnErrorNotAWrap) {
  // View end wraps around 2^64.
  ExpectInvalid(Plan(kMax - 1000, 1000, {{kMax - 10, 100}}));
  // Allocation end wraps around 2^64.
  ExpectInvalid(Plan(kMax - 100, 1000, {{kMax - 50, 10}}));
  // A view with a huge size inside a normal allocation.
  ExpectInvalid(Plan(0x600000, kPage, {{0x600000, kMax}}));
  // Near the top of the address space without wrapping: rounding the end up to a page would
  // wrap, so the region must not be "aligned" past 2^64; the exact span is fine.
  const std::uint64_t base = kMax - 2 * kPage + 1;  // allocation ends exactly at 2^64 - 1
  const std::vector<ViewRange> views = {{kMax - 100, 50}};
  Result<RegistrationPlan> plan = Plan(base, 2 * kPage - 1, views);
  ASSERT_TRUE(plan.ok()) << plan.status().ToString();
  ExpectSound(*plan, base, 2 * kPage - 1, views, kPage);
}

// Random allocations and views: whatever comes out must be sound, aligned exactly when an
// aligned region inside the allocation could cover the views, and errors only when they must be.
TEST(PlanRegistration, RandomizedPlansAreSoundAndAlignedWhenPossible) {
  std::mt19937_64 rng(20240611);
  for (int iter = 0; iter < 20000; ++iter) {
    const std::uint64_t page = std::uint64_t{1} << (6 + rng() % 10);  // 64 B .. 32 KiB
    const std::uint64_t base = page + rng() % (1ull << 40);
    const std::uint64_t size = 1 + rng() % (16 * page);
    std::vector<ViewRange> views;
    const int n = 1 + static_cast<int>(rng() % 4);
    bool inside = true;
    for (int k = 0; k < n; ++k) {
      std::uint64_t off = rng() % size;
      std::uint64_t len = 1 + rng() % (size - off);
      if (rng() % 16 == 0) {  // sometimes past the end
        len = size - off + 1 + rng() % page;
        inside = false;
      }
      if (rng() % 32 == 0) {  // sometimes starting before the allocation
        views.push_back({base - 1 - rng() % page, len});
        inside = false;
        continue;
      }
      views.push_back({base + off, len});
    }
    const bool allow = rng() % 2 == 0;
    std::string trace = "iteration " + std::to_string(iter) + ": base " + std::to_string(base) +
                        " size " + std::to_string(size) + " page " + std::to_string(page) +
                        (allow ? " unaligned allowed" : " aligned only") + ", views";
    for (const ViewRange& v : views) {
      trace += " [" + std::to_string(v.ptr) + " +" + std::to_string(v.nbytes) + ")";
    }
    trace += inside ? " inside" : " outside";
    SCOPED_TRACE(trace);
    Result<RegistrationPlan> plan = Plan(base, size, views, page, allow);
    if (!inside) {
      ExpectInvalid(plan);
      continue;
    }
    std::uint64_t lo = kMax;
    std::uint64_t hi = 0;
    for (const ViewRange& v : views) {
      lo = std::min(lo, v.ptr);
      hi = std::max(hi, v.ptr + v.nbytes);
    }
    const std::uint64_t lo_down = lo / page * page;
    const std::uint64_t hi_up = (hi + page - 1) / page * page;
    const bool alignable = lo_down >= base && hi_up <= base + size;
    if (!alignable && !allow) {
      ExpectInvalid(plan, "allocate_kv_backing");
      continue;
    }
    ASSERT_TRUE(plan.ok()) << plan.status().ToString();
    ExpectSound(*plan, base, size, views, page);
    EXPECT_EQ(plan->regions[0].aligned, alignable);
    if (!alignable) {
      EXPECT_EQ(plan->regions[0], (PlannedRegion{lo, hi - lo, false}));
    }
    if (HasFatalFailure()) return;
  }
}

}  // namespace
}  // namespace moriio_native
