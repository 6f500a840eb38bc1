#pragma once

/// Registration planning: which memory regions to register for a set of layer views that live
/// in one allocation. A planned region never extends outside the allocation.

#include <cstdint>
#include <span>
#include <vector>

#include "moriio_native/status.hpp"

namespace moriio_native {

/// One layer view: `nbytes` bytes starting at `ptr`.
struct ViewRange {
  std::uint64_t ptr = 0;
  std::uint64_t nbytes = 0;
};

/// A region to register.
struct PlannedRegion {
  std::uint64_t start = 0;
  std::uint64_t size = 0;
  bool aligned = false;  ///< start and end on page boundaries
  friend bool operator==(const PlannedRegion&, const PlannedRegion&) = default;
};

/// Where each input view lands.
struct Placement {
  std::uint32_t region = 0;
  std::uint64_t offset = 0;  ///< view ptr - region start
  friend bool operator==(const Placement&, const Placement&) = default;
};

struct RegistrationPlan {
  std::vector<PlannedRegion> regions;
  std::vector<Placement> placements;  ///< one per input view, in input order
};

/// Plans the registration of `views`, all inside [allocation_base, allocation_base +
/// allocation_size). The views share ONE region: the smallest page-aligned range covering every
/// view, when that range lies inside the allocation (it never extends before or after it);
/// otherwise, if
/// `allow_unaligned`, the exact span of the views marked unaligned; otherwise InvalidArgument
/// telling the caller to allocate the backing with the aligned allocator. Views outside the
/// allocation, empty views, a zero or non-power-of-two page size, or overflow are errors.
/// Pure function: thread-safe, never blocks.
Result<RegistrationPlan> PlanRegistration(std::uint64_t allocation_base,
                                          std::uint64_t allocation_size,
                                          std::span<const ViewRange> views,
                                          std::uint64_t page_size = 4096,
                                          bool allow_unaligned = true);

}  // namespace moriio_native
