#pragma once

// A page-aligned host buffer the metadata tests carve layers from.

#include <cstdint>
#include <cstdlib>
#include <memory>

namespace moriio_native::test_support {

struct FreeDeleter {
  void operator()(std::uint8_t* p) const { std::free(p); }
};
using Buffer = std::unique_ptr<std::uint8_t[], FreeDeleter>;
inline constexpr std::size_t kBufferBytes = 64 * 1024;

inline Buffer NewBuffer() {
  Buffer b(static_cast<std::uint8_t*>(std::aligned_alloc(4096, kBufferBytes)));
  if (!b) std::abort();
  return b;
}

}  // namespace moriio_native::test_support
