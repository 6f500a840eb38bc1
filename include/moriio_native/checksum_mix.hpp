#pragma once

/// The per-word terms of the block checksum (checksum.hpp defines the value): one definition
/// for the host core and the CUDA copy plugin's kernel (cpp/cudacopy/checksum.cu), which is
/// compiled as C++17 by nvcc and so cannot include checksum.hpp itself.

#include <cstdint>

#if defined(__CUDACC__)
#define MORIIO_NATIVE_HOST_DEVICE __host__ __device__
#else
#define MORIIO_NATIVE_HOST_DEVICE
#endif

namespace moriio_native {

/// MurmurHash3's 64-bit finalizer (fmix64). Exposed so other implementations can be checked
/// against this one.
constexpr MORIIO_NATIVE_HOST_DEVICE std::uint64_t Mix64(std::uint64_t x) {
  x ^= x >> 33;
  x *= 0xff51afd7ed558ccdULL;
  x ^= x >> 33;
  x *= 0xc4ceb9fe1a85ec53ULL;
  x ^= x >> 33;
  return x;
}

/// The step of the position term: word i is mixed with (i + 1) * kChecksumPositionStep.
inline constexpr std::uint64_t kChecksumPositionStep = 0x9E3779B97F4A7C15ULL;

}  // namespace moriio_native
