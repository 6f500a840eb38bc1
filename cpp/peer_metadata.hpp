#pragma once

// Peer metadata: what an engine tells its peers (msgpack, versioned). Decoding validates every
// number, because the bytes come from the network.

#include <cstdint>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "moriio_native/backend.hpp"
#include "moriio_native/layout.hpp"
#include "moriio_native/status.hpp"

namespace moriio_native::detail {

inline constexpr std::uint64_t kMetadataVersion = 1;
inline constexpr std::size_t kMaxNameBytes = 1024;
inline constexpr std::size_t kMaxMetadataBytes = std::size_t{64} << 20;
inline constexpr std::size_t kMaxRegions = 4096;
inline constexpr std::size_t kMaxLayers = 65536;
inline constexpr std::size_t kMaxKeyBytes = std::size_t{1} << 20;

/// Whether `name` (an engine id, a backend or layer name: `what` says which) is one a peer's
/// metadata decoder accepts: 1..kMaxNameBytes bytes of well-formed UTF-8 without control,
/// line-separator or bidirectional characters. InvalidArgument naming `what` and the first bad
/// byte otherwise.
Status CheckName(std::string_view name, const std::string& what);

struct RegionRecord {
  MemoryRange range;
  bool aligned = false;
  std::vector<std::uint8_t> key;
};

struct LayerRecord {
  LayerLayout layout;
  std::uint32_t region = 0;
  std::int64_t offset = 0;  ///< layer base - region start
};

struct EngineMetadata {
  std::string engine_id;
  std::string backend;
  std::vector<std::uint8_t> address;
  std::vector<RegionRecord> regions;
  std::vector<LayerRecord> layers;
};

std::vector<std::uint8_t> EncodeMetadata(const EngineMetadata& meta);

/// Errors: InvalidArgument (malformed, out of range, inconsistent; names the field, layer or
/// region), Incompatible (another version). Thread-safe.
Result<EngineMetadata> DecodeMetadata(std::span<const std::uint8_t> bytes);

}  // namespace moriio_native::detail
