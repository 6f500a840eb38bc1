#pragma once

/// The bytes the UCX backend hands to peers: its worker address (LocalAddress) and, per
/// registered region, a remote key (RegisteredRegion::remote_key). Both wrap the opaque UCX blob in
/// a small checked envelope, because UCX parses these blobs without validating them and a
/// truncated or corrupted blob would crash inside UCX instead of failing with an error.
///
/// Layout (little-endian, fixed header then the UCX bytes):
///   address: magic "MNUCXAD1", u32 UCX version, u32 blob length, 16-byte host id, u64 FNV-1a
///            of everything before it and of the blob, blob.
///   key:     magic "MNUCXRK1", u8 memory kind, u8 flags, u16 zero, u32 blob length, u64 region
///            start, u64 region size, u64 FNV-1a (as above), blob.

#include <array>
#include <cstdint>
#include <span>
#include <vector>

#include "moriio_native/backend.hpp"
#include "moriio_native/status.hpp"

namespace moriio_native::detail::ucx {

/// Identifies the machine (kernel boot): equal ids mean both processes share one host.
using HostId = std::array<std::uint8_t, 16>;

/// This machine's id: the kernel's boot_id, else a hash of the host name. Thread-safe.
HostId LocalHostId();

struct WireAddress {
  std::uint32_t ucx_version = 0;
  HostId host{};
  std::span<const std::uint8_t> blob;  ///< points into the decoded buffer
};

/// Key flag: the region lies in memory the owner allocated through UCX (sysv/posix segment).
inline constexpr std::uint8_t kKeyFlagAllocated = 1;

struct WireKey {
  MemoryKind kind = MemoryKind::kHost;
  std::uint8_t flags = 0;
  std::uint64_t region_start = 0;
  std::uint64_t region_size = 0;
  std::span<const std::uint8_t> blob;  ///< points into the decoded buffer
};

/// Pure functions: thread-safe, never block.
std::vector<std::uint8_t> EncodeAddress(std::uint32_t ucx_version, const HostId& host,
                                        std::span<const std::uint8_t> blob);
/// InvalidArgument saying what is wrong (size, magic, checksum) for anything not produced by
/// EncodeAddress.
Result<WireAddress> DecodeAddress(std::span<const std::uint8_t> bytes);

std::vector<std::uint8_t> EncodeKey(const WireKey& key);
Result<WireKey> DecodeKey(std::span<const std::uint8_t> bytes);

}  // namespace moriio_native::detail::ucx
