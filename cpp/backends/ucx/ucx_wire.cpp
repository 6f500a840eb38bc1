#include "ucx_wire.hpp"

#include <unistd.h>

#include <cctype>
#include <cstring>
#include <fstream>
#include <string>
#include <string_view>

namespace moriio_native::detail::ucx {
namespace {

constexpr std::string_view kAddressMagic = "MNUCXAD1";
constexpr std::string_view kKeyMagic = "MNUCXRK1";
constexpr std::size_t kAddressHeader = 8 + 4 + 4 + 16 + 8;
constexpr std::size_t kKeyHeader = 8 + 1 + 1 + 2 + 4 + 8 + 8 + 8;
// A UCX worker address is ~70-300 bytes and an rkey well under a kilobyte; anything far bigger
// is garbage, and refusing it keeps a hostile length from turning into a huge allocation.
constexpr std::uint32_t kMaxBlob = 1u << 20;

std::uint64_t Fnv1a(std::span<const std::uint8_t> bytes, std::uint64_t h = 0xcbf29ce484222325ull) {
  for (std::uint8_t b : bytes) {
    h ^= b;
    h *= 0x100000001b3ull;
  }
  return h;
}

void Put(std::vector<std::uint8_t>& out, std::uint64_t v, int bytes) {
  for (int i = 0; i < bytes; ++i) out.push_back(static_cast<std::uint8_t>(v >> (8 * i)));
}

std::uint64_t Get(std::span<const std::uint8_t> in, std::size_t at, int bytes) {
  std::uint64_t v = 0;
  for (int i = 0; i < bytes; ++i) v |= static_cast<std::uint64_t>(in[at + i]) << (8 * i);
  return v;
}

std::uint64_t Checksum(std::span<const std::uint8_t> header_without_sum,
                       std::span<const std::uint8_t> blob) {
  return Fnv1a(blob, Fnv1a(header_without_sum));
}

}  // namespace

HostId LocalHostId() {
  static const HostId id = [] {
    HostId out{};
    std::ifstream f("/proc/sys/kernel/random/boot_id");
    std::string text;
    std::getline(f, text);
    std::size_t n = 0;
    int nibble = -1;
    for (char c : text) {
      if (!std::isxdigit(static_cast<unsigned char>(c)) || n == out.size()) continue;
      const int v = std::isdigit(static_cast<unsigned char>(c)) ? c - '0'
                                                                : std::tolower(c) - 'a' + 10;
      if (nibble < 0) {
        nibble = v;
      } else {
        out[n++] = static_cast<std::uint8_t>((nibble << 4) | v);
        nibble = -1;
      }
    }
    if (n != out.size()) {
      // No boot_id (not Linux procfs): the host name is the next best thing.
      char host[256] = {};
      ::gethostname(host, sizeof(host) - 1);
      const std::uint64_t h =
          Fnv1a({reinterpret_cast<const std::uint8_t*>(host), std::strlen(host)});
      for (std::size_t i = 0; i < out.size(); ++i) {
        out[i] = static_cast<std::uint8_t>(h >> (8 * (i % 8)));
      }
    }
    return out;
  }();
  return id;
}

std::vector<std::uint8_t> EncodeAddress(std::uint32_t ucx_version, const HostId& host,
                                        std::span<const std::uint8_t> blob) {
  std::vector<std::uint8_t> out;
  out.reserve(kAddressHeader + blob.size());
  for (char c : kAddressMagic) out.push_back(static_cast<std::uint8_t>(c));
  Put(out, ucx_version, 4);
  Put(out, blob.size(), 4);
  for (std::uint8_t b : host) out.push_back(b);
  Put(out, Checksum(out, blob), 8);
  out.insert(out.end(), blob.begin(), blob.end());
  return out;
}

Result<WireAddress> DecodeAddress(std::span<const std::uint8_t> bytes) {
  if (bytes.size() < kAddressHeader) {
    return InvalidArgumentError("UCX peer address is " + std::to_string(bytes.size()) +
                                " bytes, shorter than its " + std::to_string(kAddressHeader) +
                                "-byte header");
  }
  if (std::memcmp(bytes.data(), kAddressMagic.data(), kAddressMagic.size()) != 0) {
    return InvalidArgumentError(
        "UCX peer address does not start with the ucx backend's magic (not produced by "
        "LocalAddress of a ucx backend)");
  }
  WireAddress out;
  out.ucx_version = static_cast<std::uint32_t>(Get(bytes, 8, 4));
  const auto len = static_cast<std::uint32_t>(Get(bytes, 12, 4));
  if (len == 0 || len > kMaxBlob || bytes.size() != kAddressHeader + len) {
    return InvalidArgumentError("UCX peer address is " + std::to_string(bytes.size()) +
                                " bytes but its header announces " + std::to_string(len) +
                                " bytes of worker address (truncated or corrupted)");
  }
  std::memcpy(out.host.data(), bytes.data() + 16, out.host.size());
  out.blob = bytes.subspan(kAddressHeader);
  if (Checksum(bytes.first(32), out.blob) != Get(bytes, 32, 8)) {
    return InvalidArgumentError("UCX peer address checksum mismatch (corrupted in transit)");
  }
  return out;
}

std::vector<std::uint8_t> EncodeKey(const WireKey& key) {
  std::vector<std::uint8_t> out;
  out.reserve(kKeyHeader + key.blob.size());
  for (char c : kKeyMagic) out.push_back(static_cast<std::uint8_t>(c));
  Put(out, static_cast<std::uint8_t>(key.kind), 1);
  Put(out, key.flags, 1);
  Put(out, 0, 2);
  Put(out, key.blob.size(), 4);
  Put(out, key.region_start, 8);
  Put(out, key.region_size, 8);
  Put(out, Checksum(out, key.blob), 8);
  out.insert(out.end(), key.blob.begin(), key.blob.end());
  return out;
}

Result<WireKey> DecodeKey(std::span<const std::uint8_t> bytes) {
  if (bytes.size() < kKeyHeader) {
    return InvalidArgumentError("UCX remote key is " + std::to_string(bytes.size()) +
                                " bytes, shorter than its " + std::to_string(kKeyHeader) +
                                "-byte header");
  }
  if (std::memcmp(bytes.data(), kKeyMagic.data(), kKeyMagic.size()) != 0) {
    return InvalidArgumentError(
        "UCX remote key does not start with the ucx backend's magic (not a remote_key of a ucx "
        "backend registration)");
  }
  WireKey out;
  const auto kind = static_cast<std::uint8_t>(Get(bytes, 8, 1));
  if (kind > static_cast<std::uint8_t>(MemoryKind::kRocm)) {
    return InvalidArgumentError("UCX remote key names unknown memory kind " +
                                std::to_string(kind));
  }
  out.kind = static_cast<MemoryKind>(kind);
  out.flags = static_cast<std::uint8_t>(Get(bytes, 9, 1));
  const auto len = static_cast<std::uint32_t>(Get(bytes, 12, 4));
  if (len == 0 || len > kMaxBlob || bytes.size() != kKeyHeader + len) {
    return InvalidArgumentError("UCX remote key is " + std::to_string(bytes.size()) +
                                " bytes but its header announces " + std::to_string(len) +
                                " bytes of rkey (truncated or corrupted)");
  }
  out.region_start = Get(bytes, 16, 8);
  out.region_size = Get(bytes, 24, 8);
  out.blob = bytes.subspan(kKeyHeader);
  if (Checksum(bytes.first(32), out.blob) != Get(bytes, 32, 8)) {
    return InvalidArgumentError("UCX remote key checksum mismatch (corrupted in transit)");
  }
  if (out.region_size == 0 || out.region_start + out.region_size < out.region_start) {
    return InvalidArgumentError("UCX remote key describes an empty or wrapping region");
  }
  return out;
}

}  // namespace moriio_native::detail::ucx
