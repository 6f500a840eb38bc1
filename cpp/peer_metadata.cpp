#include "peer_metadata.hpp"

#include <string_view>
#include <unordered_set>

#include "msgpack_lite.hpp"

namespace moriio_native::detail {
namespace {

namespace mp = msgpack;

constexpr std::string_view kFormat = "moriio-native";
constexpr std::size_t kParamCount = 14;

std::array<std::int64_t, kParamCount> ParamsArray(const LayoutParams& p) {
  return {static_cast<std::int64_t>(p.kind), p.num_blocks, p.block_size, p.kernel_block_size,
          p.num_heads, p.dtype_bytes, p.block_stride, p.kernel_block_stride, p.head_stride,
          p.token_stride, p.plane_offset[0], p.plane_offset[1], p.plane_bytes[0],
          p.plane_bytes[1]};
}

Result<LayoutParams> ParamsFrom(const mp::Array& a, const std::string& what) {
  if (a.size() != kParamCount) {
    return InvalidArgumentError(what + ": layout params must have " + std::to_string(kParamCount) +
                                " entries, got " + std::to_string(a.size()));
  }
  std::array<std::int64_t, kParamCount> v{};
  for (std::size_t i = 0; i < kParamCount; ++i) {
    MORIIO_ASSIGN_OR_RETURN(v[i], mp::AsInt(a[i], what + " param " + std::to_string(i)));
  }
  if (v[0] != 0 && v[0] != 1) return InvalidArgumentError(what + ": unknown cache kind");
  LayoutParams p;
  p.kind = static_cast<CacheKind>(v[0]);
  p.num_blocks = v[1];
  p.block_size = v[2];
  p.kernel_block_size = v[3];
  p.num_heads = v[4];
  p.dtype_bytes = v[5];
  p.block_stride = v[6];
  p.kernel_block_stride = v[7];
  p.head_stride = v[8];
  p.token_stride = v[9];
  p.plane_offset = {v[10], v[11]};
  p.plane_bytes = {v[12], v[13]};
  return p;
}

// Offset of the first byte of `s` that is not part of well-formed UTF-8 (RFC 3629: no overlong
// forms, no surrogates, nothing above U+10FFFF), or npos.
std::size_t FirstInvalidUtf8(std::string_view s) {
  std::size_t i = 0;
  while (i < s.size()) {
    const auto b0 = static_cast<unsigned char>(s[i]);
    if (b0 < 0x80) {
      ++i;
      continue;
    }
    std::size_t len = 0;
    unsigned char lo = 0x80;  // allowed range of the second byte
    unsigned char hi = 0xBF;
    if (b0 >= 0xC2 && b0 <= 0xDF) {
      len = 2;
    } else if (b0 >= 0xE0 && b0 <= 0xEF) {
      len = 3;
      if (b0 == 0xE0) lo = 0xA0;  // overlong
      if (b0 == 0xED) hi = 0x9F;  // surrogates
    } else if (b0 >= 0xF0 && b0 <= 0xF4) {
      len = 4;
      if (b0 == 0xF0) lo = 0x90;  // overlong
      if (b0 == 0xF4) hi = 0x8F;  // above U+10FFFF
    } else {
      return i;
    }
    if (i + len > s.size()) return i;
    for (std::size_t k = 1; k < len; ++k) {
      const auto b = static_cast<unsigned char>(s[i + k]);
      if (b < (k == 1 ? lo : 0x80) || b > (k == 1 ? hi : 0xBF)) return i;
    }
    i += len;
  }
  return std::string_view::npos;
}

/// The first byte of a character in `s` (valid UTF-8) that the control plane never carries in
/// a name: a C0 or C1 control, DEL, U+2028/U+2029, or a bidirectional control (U+202A..U+202E,
/// U+2066..U+2069); names end up in logs, and these would let a peer forge log lines. npos
/// when there is none.
std::size_t FirstUnprintable(std::string_view s) {
  const auto at = [&](std::size_t i) { return static_cast<unsigned char>(s[i]); };
  for (std::size_t i = 0; i < s.size(); ++i) {
    const unsigned char b0 = at(i);
    if (b0 < 0x20 || b0 == 0x7F) return i;
    if (b0 == 0xC2 && at(i + 1) <= 0x9F) return i;  // U+0080..U+009F
    if (b0 == 0xE2 && ((at(i + 1) == 0x80 && at(i + 2) >= 0xA8 && at(i + 2) <= 0xAE) ||
                       (at(i + 1) == 0x81 && at(i + 2) >= 0xA6 && at(i + 2) <= 0xA9))) {
      return i;
    }
  }
  return std::string_view::npos;
}

Result<std::string> BoundedStr(const mp::Value& v, const std::string& what) {
  MORIIO_ASSIGN_OR_RETURN(std::string s, mp::AsStr(v, what));
  MORIIO_RETURN_IF_ERROR(CheckName(s, what));
  return s;
}

Result<RegionRecord> DecodeRegion(const mp::Value& v, std::size_t i) {
  const std::string what = "region " + std::to_string(i);
  MORIIO_ASSIGN_OR_RETURN(const mp::Map* m, mp::AsMap(v, what));
  RegionRecord r;
  MORIIO_ASSIGN_OR_RETURN(const mp::Value* f, mp::Field(*m, "address", what));
  MORIIO_ASSIGN_OR_RETURN(r.range.address, mp::AsUInt(*f, what + " address"));
  MORIIO_ASSIGN_OR_RETURN(f, mp::Field(*m, "size", what));
  MORIIO_ASSIGN_OR_RETURN(r.range.size, mp::AsUInt(*f, what + " size"));
  MORIIO_ASSIGN_OR_RETURN(f, mp::Field(*m, "kind", what));
  MORIIO_ASSIGN_OR_RETURN(std::uint64_t kind, mp::AsUInt(*f, what + " kind"));
  MORIIO_ASSIGN_OR_RETURN(f, mp::Field(*m, "device", what));
  MORIIO_ASSIGN_OR_RETURN(std::int64_t device, mp::AsInt(*f, what + " device"));
  MORIIO_ASSIGN_OR_RETURN(f, mp::Field(*m, "aligned", what));
  MORIIO_ASSIGN_OR_RETURN(r.aligned, mp::AsBool(*f, what + " aligned"));
  MORIIO_ASSIGN_OR_RETURN(f, mp::Field(*m, "key", what));
  MORIIO_ASSIGN_OR_RETURN(r.key, mp::AsBin(*f, what + " key"));
  std::uint64_t end = 0;
  // Offsets inside a region are int64 everywhere downstream: sizes stay far below 2^63.
  constexpr std::uint64_t kMaxRegionBytes = std::uint64_t{1} << 56;
  if (r.range.size == 0 || r.range.address == 0 || r.range.size > kMaxRegionBytes ||
      __builtin_add_overflow(r.range.address, r.range.size, &end)) {
    return InvalidArgumentError(what + ": empty, null, oversized or overflowing range");
  }
  if (kind > static_cast<std::uint64_t>(MemoryKind::kRocm)) {
    return InvalidArgumentError(what + ": unknown memory kind " + std::to_string(kind));
  }
  if (device < -1 || device > 1024) {
    return InvalidArgumentError(what + ": device ordinal " + std::to_string(device) + " out of range");
  }
  if (r.key.size() > kMaxKeyBytes) return InvalidArgumentError(what + ": key too large");
  r.range.kind = static_cast<MemoryKind>(kind);
  r.range.device = static_cast<int>(device);
  return r;
}

Result<LayerRecord> DecodeLayer(const mp::Value& v, std::size_t i,
                                const std::vector<RegionRecord>& regions) {
  std::string what = "layer " + std::to_string(i);
  MORIIO_ASSIGN_OR_RETURN(const mp::Map* m, mp::AsMap(v, what));
  MORIIO_ASSIGN_OR_RETURN(const mp::Value* f, mp::Field(*m, "name", what));
  MORIIO_ASSIGN_OR_RETURN(std::string name, BoundedStr(*f, what + " name"));
  what = "layer '" + name + "'";
  MORIIO_ASSIGN_OR_RETURN(f, mp::Field(*m, "region", what));
  MORIIO_ASSIGN_OR_RETURN(std::uint64_t region, mp::AsUInt(*f, what + " region"));
  MORIIO_ASSIGN_OR_RETURN(f, mp::Field(*m, "offset", what));
  MORIIO_ASSIGN_OR_RETURN(std::uint64_t offset, mp::AsUInt(*f, what + " offset"));
  MORIIO_ASSIGN_OR_RETURN(f, mp::Field(*m, "fingerprint", what));
  MORIIO_ASSIGN_OR_RETURN(std::uint64_t fingerprint, mp::AsUInt(*f, what + " fingerprint"));
  MORIIO_ASSIGN_OR_RETURN(f, mp::Field(*m, "params", what));
  MORIIO_ASSIGN_OR_RETURN(const mp::Array* params_array, mp::AsArray(*f, what + " params"));
  MORIIO_ASSIGN_OR_RETURN(LayoutParams params, ParamsFrom(*params_array, what));
  MORIIO_ASSIGN_OR_RETURN(LayerLayout layout, LayerLayout::FromParams(name, params));
  if (layout.LogicalFingerprint() != fingerprint) {
    return InvalidArgumentError(what + ": fingerprint does not match its layout");
  }
  if (region >= regions.size()) {
    return InvalidArgumentError(what + ": region index " + std::to_string(region) +
                                " out of range (" + std::to_string(regions.size()) + " regions)");
  }
  const std::uint64_t size = regions[region].range.size;
  const auto span = static_cast<std::uint64_t>(layout.span_bytes());
  if (offset > size || span > size - offset) {
    return InvalidArgumentError(what + ": its " + std::to_string(span) + " bytes at offset " +
                                std::to_string(offset) + " exceed region " +
                                std::to_string(region) + " (" + std::to_string(size) + " bytes)");
  }
  return LayerRecord{std::move(layout), static_cast<std::uint32_t>(region),
                     static_cast<std::int64_t>(offset)};
}

}  // namespace

// Names become Python str (peer ids, layer names, error messages): text that is not UTF-8 is
// refused before anything is connected, and never quoted back.
Status CheckName(std::string_view name, const std::string& what) {
  if (name.empty() || name.size() > kMaxNameBytes) {
    return InvalidArgumentError(what + " must be 1.." + std::to_string(kMaxNameBytes) + " bytes");
  }
  if (const std::size_t bad = FirstInvalidUtf8(name); bad != std::string_view::npos) {
    return InvalidArgumentError(what + " is not valid UTF-8 (byte " + std::to_string(bad) +
                                " of " + std::to_string(name.size()) + ")");
  }
  if (const std::size_t bad = FirstUnprintable(name); bad != std::string_view::npos) {
    return InvalidArgumentError(what + " holds a control, line-separator or bidirectional "
                                "character (byte " + std::to_string(bad) + " of " +
                                std::to_string(name.size()) + ")");
  }
  return Status::OK();
}

std::vector<std::uint8_t> EncodeMetadata(const EngineMetadata& meta) {
  mp::Writer w;
  w.MapHeader(7);
  w.Str("format");
  w.Str(kFormat);
  w.Str("version");
  w.UInt(kMetadataVersion);
  w.Str("engine_id");
  w.Str(meta.engine_id);
  w.Str("backend");
  w.Str(meta.backend);
  w.Str("address");
  w.Bin(meta.address);
  w.Str("regions");
  w.ArrayHeader(static_cast<std::uint32_t>(meta.regions.size()));
  for (const RegionRecord& r : meta.regions) {
    w.MapHeader(6);
    w.Str("address");
    w.UInt(r.range.address);
    w.Str("size");
    w.UInt(r.range.size);
    w.Str("kind");
    w.UInt(static_cast<std::uint64_t>(r.range.kind));
    w.Str("device");
    w.Int(r.range.device);
    w.Str("aligned");
    w.Bool(r.aligned);
    w.Str("key");
    w.Bin(r.key);
  }
  w.Str("layers");
  w.ArrayHeader(static_cast<std::uint32_t>(meta.layers.size()));
  for (const LayerRecord& l : meta.layers) {
    w.MapHeader(5);
    w.Str("name");
    w.Str(l.layout.name());
    w.Str("region");
    w.UInt(l.region);
    w.Str("offset");
    w.UInt(static_cast<std::uint64_t>(l.offset));
    w.Str("fingerprint");
    w.UInt(l.layout.LogicalFingerprint());
    w.Str("params");
    w.ArrayHeader(kParamCount);
    for (std::int64_t v : ParamsArray(l.layout.params())) w.Int(v);
  }
  return w.Take();
}

Result<EngineMetadata> DecodeMetadata(std::span<const std::uint8_t> bytes) {
  const std::string what = "peer metadata";
  if (bytes.size() > kMaxMetadataBytes) {
    return InvalidArgumentError(what + " is " + std::to_string(bytes.size()) + " bytes, over the " +
                                std::to_string(kMaxMetadataBytes) + " byte limit");
  }
  MORIIO_ASSIGN_OR_RETURN(mp::Value root, mp::Decode(bytes));
  MORIIO_ASSIGN_OR_RETURN(const mp::Map* m, mp::AsMap(root, what));
  MORIIO_ASSIGN_OR_RETURN(const mp::Value* f, mp::Field(*m, "format", what));
  MORIIO_ASSIGN_OR_RETURN(std::string format, mp::AsStr(*f, what + " format"));
  if (format != kFormat) return InvalidArgumentError(what + ": not moriio-native metadata");
  MORIIO_ASSIGN_OR_RETURN(f, mp::Field(*m, "version", what));
  MORIIO_ASSIGN_OR_RETURN(std::uint64_t version, mp::AsUInt(*f, what + " version"));
  if (version != kMetadataVersion) {
    return IncompatibleError(what + " has version " + std::to_string(version) +
                             ", this build speaks version " + std::to_string(kMetadataVersion));
  }
  EngineMetadata meta;
  MORIIO_ASSIGN_OR_RETURN(f, mp::Field(*m, "engine_id", what));
  MORIIO_ASSIGN_OR_RETURN(meta.engine_id, BoundedStr(*f, what + " engine_id"));
  MORIIO_ASSIGN_OR_RETURN(f, mp::Field(*m, "backend", what));
  MORIIO_ASSIGN_OR_RETURN(meta.backend, BoundedStr(*f, what + " backend"));
  MORIIO_ASSIGN_OR_RETURN(f, mp::Field(*m, "address", what));
  MORIIO_ASSIGN_OR_RETURN(meta.address, mp::AsBin(*f, what + " address"));
  if (meta.address.empty() || meta.address.size() > kMaxKeyBytes) {
    return InvalidArgumentError(what + ": backend address is empty or too large");
  }
  MORIIO_ASSIGN_OR_RETURN(f, mp::Field(*m, "regions", what));
  MORIIO_ASSIGN_OR_RETURN(const mp::Array* regions, mp::AsArray(*f, what + " regions"));
  if (regions->empty() || regions->size() > kMaxRegions) {
    return InvalidArgumentError(what + ": 1.." + std::to_string(kMaxRegions) + " regions expected");
  }
  for (std::size_t i = 0; i < regions->size(); ++i) {
    MORIIO_ASSIGN_OR_RETURN(RegionRecord r, DecodeRegion((*regions)[i], i));
    meta.regions.push_back(std::move(r));
  }
  MORIIO_ASSIGN_OR_RETURN(f, mp::Field(*m, "layers", what));
  MORIIO_ASSIGN_OR_RETURN(const mp::Array* layers, mp::AsArray(*f, what + " layers"));
  if (layers->empty() || layers->size() > kMaxLayers) {
    return InvalidArgumentError(what + ": 1.." + std::to_string(kMaxLayers) + " layers expected");
  }
  std::unordered_set<std::string> names;
  for (std::size_t i = 0; i < layers->size(); ++i) {
    MORIIO_ASSIGN_OR_RETURN(LayerRecord l, DecodeLayer((*layers)[i], i, meta.regions));
    if (!names.insert(l.layout.name()).second) {
      return InvalidArgumentError(what + ": layer '" + l.layout.name() + "' appears twice");
    }
    meta.layers.push_back(std::move(l));
  }
  return meta;
}

}  // namespace moriio_native::detail
