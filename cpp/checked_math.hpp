#pragma once

// Overflow-checked integer arithmetic for numbers that may come from untrusted peers.

#include <cstdint>

namespace moriio_native::detail {

/// *out = a * b; false (and *out unspecified) on signed overflow.
inline bool CheckedMul(std::int64_t a, std::int64_t b, std::int64_t* out) {
  return !__builtin_mul_overflow(a, b, out);
}

/// *out = a + b; false (and *out unspecified) on signed overflow.
inline bool CheckedAdd(std::int64_t a, std::int64_t b, std::int64_t* out) {
  return !__builtin_add_overflow(a, b, out);
}

}  // namespace moriio_native::detail
