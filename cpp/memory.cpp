#include "moriio_native/memory.hpp"

#include <algorithm>
#include <charconv>
#include <string>

namespace moriio_native {
namespace {

std::string Hex(std::uint64_t v) {
  char digits[17];
  auto [end, ec] = std::to_chars(digits, digits + sizeof(digits), v, 16);
  return "0x" + std::string(digits, end);
}

std::string RangeString(std::uint64_t begin, std::uint64_t end) {
  return "[" + Hex(begin) + ", " + Hex(end) + ")";
}

}  // namespace

Result<RegistrationPlan> PlanRegistration(std::uint64_t allocation_base,
                                          std::uint64_t allocation_size,
                                          std::span<const ViewRange> views,
                                          std::uint64_t page_size, bool allow_unaligned) {
  if (page_size == 0 || (page_size & (page_size - 1)) != 0) {
    return InvalidArgumentError("page_size must be a power of two, got " + std::to_string(page_size));
  }
  std::uint64_t alloc_end = 0;
  if (allocation_size == 0 || __builtin_add_overflow(allocation_base, allocation_size, &alloc_end)) {
    return InvalidArgumentError("allocation " + Hex(allocation_base) + " of " +
                                std::to_string(allocation_size) + " bytes is empty or overflows");
  }
  if (views.empty()) return InvalidArgumentError("no views to register");
  std::uint64_t lo = UINT64_MAX;
  std::uint64_t hi = 0;
  for (std::size_t i = 0; i < views.size(); ++i) {
    std::uint64_t end = 0;
    if (views[i].nbytes == 0 || __builtin_add_overflow(views[i].ptr, views[i].nbytes, &end)) {
      return InvalidArgumentError("view " + std::to_string(i) + " at " + Hex(views[i].ptr) +
                                  " is empty or overflows");
    }
    if (views[i].ptr < allocation_base || end > alloc_end) {
      return InvalidArgumentError("view " + std::to_string(i) + " " +
                                  RangeString(views[i].ptr, end) + " lies outside its allocation " +
                                  RangeString(allocation_base, alloc_end));
    }
    lo = std::min(lo, views[i].ptr);
    hi = std::max(hi, end);
  }
  // Round outward to pages, then accept only if that stays inside the allocation: a region that
  // starts before the allocation would expose someone else's bytes to remote peers.
  const std::uint64_t mask = page_size - 1;
  const std::uint64_t aligned_lo = lo & ~mask;
  const std::uint64_t aligned_hi = hi > UINT64_MAX - mask ? 0 : (hi + mask) & ~mask;
  RegistrationPlan plan;
  if (aligned_hi != 0 && aligned_lo >= allocation_base && aligned_hi <= alloc_end) {
    plan.regions.push_back({aligned_lo, aligned_hi - aligned_lo, true});
  } else if (allow_unaligned) {
    plan.regions.push_back({lo, hi - lo, false});
  } else {
    return InvalidArgumentError(
        "cannot register the views " + RangeString(lo, hi) + " as one page-aligned region (page " +
        std::to_string(page_size) + ") inside their allocation " +
        RangeString(allocation_base, alloc_end) +
        ": allocate the KV backing with moriio_native.allocate_kv_backing() so it starts and ends "
        "on page boundaries");
  }
  plan.placements.reserve(views.size());
  for (const ViewRange& v : views) plan.placements.push_back({0, v.ptr - plan.regions[0].start});
  return plan;
}

}  // namespace moriio_native
