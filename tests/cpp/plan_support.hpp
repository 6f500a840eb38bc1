#pragma once

// Byte buffers for the layout tests: random contents, and a copy plan applied with memcpy (the
// reference every other copy path is compared with).

#include <cstddef>
#include <cstdint>
#include <cstring>
#include <random>
#include <vector>

#include "moriio_native/layout.hpp"

namespace moriio_native::test_support {

inline std::vector<std::byte> RandomBytes(std::int64_t n, unsigned seed) {
  std::mt19937 rng(seed);
  std::vector<std::byte> out(static_cast<std::size_t>(n));
  for (std::byte& b : out) b = static_cast<std::byte>(rng() & 0xff);
  return out;
}

/// Copies every run of `plan` between the layer bases `local` and `remote`, in `direction`.
inline void ApplyPlan(const CopyPlan& plan, std::byte* local, std::byte* remote,
                      CellCopyDirection direction) {
  for (std::size_t i = 0; i < plan.size(); ++i) {
    std::byte* l = local + plan.local_offsets[i];
    std::byte* r = remote + plan.remote_offsets[i];
    const auto n = static_cast<std::size_t>(plan.sizes[i]);
    if (direction == CellCopyDirection::kRemoteToLocal) {
      std::memcpy(l, r, n);
    } else {
      std::memcpy(r, l, n);
    }
  }
}

}  // namespace moriio_native::test_support
