#pragma once

// MoRI-IO's descriptors in their wire form: msgpack of mori::io::EngineDesc (our LocalAddress
// bytes) and mori::io::MemoryDesc (our remote keys), the same bytes MoRI's Python pack() gives,
// so engines of either kind can read each other's. Decoding takes untrusted peer metadata: it
// bounds what msgpack may allocate, rejects trailing bytes and checks every number it returns.
//
// Header-only and free of MoRI's libraries (only its headers), so it is tested on machines where
// MoRI cannot run (tests/cpp/mori_codec_test.cpp). Needs -D__HIP_PLATFORM_AMD__ and
// -DMSGPACK_NO_BOOST, MoRI's include tree, msgpack-c, spdlog, HIP and verbs headers.

#include <cstdint>
#include <exception>
#include <msgpack.hpp>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "backends/mori/mori_api.hpp"
#include "mori/io/common.hpp"
#include "mori/io/enum.hpp"
#include "mori/io/peer_failure.hpp"
#include "moriio_native/status.hpp"

namespace moriio_native::detail::mori_backend::codec {

namespace mio = ::mori::io;

// mori_api.hpp mirrors MoRI's codes by number; a MoRI release that renumbers them breaks here.
#define MORIIO_SAME_CODE(ours, theirs)                                   \
  static_assert(static_cast<std::uint32_t>(MoriCode::ours) ==            \
                    static_cast<std::uint32_t>(mio::StatusCode::theirs), \
                "MoriCode::" #ours " != mori::io::StatusCode::" #theirs)
MORIIO_SAME_CODE(kSuccess, SUCCESS);
MORIIO_SAME_CODE(kInit, INIT);
MORIIO_SAME_CODE(kInProgress, IN_PROGRESS);
MORIIO_SAME_CODE(kErrBegin, ERR_BEGIN);
MORIIO_SAME_CODE(kInvalidArgs, ERR_INVALID_ARGS);
MORIIO_SAME_CODE(kNotFound, ERR_NOT_FOUND);
MORIIO_SAME_CODE(kRdmaOp, ERR_RDMA_OP);
MORIIO_SAME_CODE(kBadState, ERR_BAD_STATE);
MORIIO_SAME_CODE(kGpuOp, ERR_GPU_OP);
#undef MORIIO_SAME_CODE

/// The message of the exception being handled (call inside a catch block only).
inline std::string CurrentExceptionMessage() {
  try {
    throw;
  } catch (const std::exception& e) {
    return e.what();
  } catch (...) {
    return "unknown exception";
  }
}

/// msgpack of `value` (a MoRI descriptor). Pure.
template <typename T>
std::vector<std::uint8_t> Pack(const T& value) {
  msgpack::sbuffer buffer;
  msgpack::pack(buffer, value);
  const auto* p = reinterpret_cast<const std::uint8_t*>(buffer.data());
  return {p, p + buffer.size()};
}

/// How many leading fields of T's msgpack array a peer must send: those without a default
/// (msgpack-c leaves the members past a short array untouched, and EngineDesc::port and
/// MemoryDesc::loc have no initialiser). Later fields keep their defaults (older MoRI sent fewer).
template <typename T>
inline constexpr std::uint32_t kRequiredFields = 0;
template <>
inline constexpr std::uint32_t kRequiredFields<mio::EngineDesc> = 5;  // key .. port
template <>
inline constexpr std::uint32_t kRequiredFields<mio::MemoryDesc> = 7;  // engineKey .. loc

/// Decodes exactly one msgpack object of type T from `bytes`; InvalidArgument naming `what` on
/// malformed input, trailing bytes, missing required fields, or containers/strings beyond
/// descriptor sizes. Pure.
template <typename T>
Result<T> Unpack(std::span<const std::uint8_t> bytes, std::string_view what) {
  try {
    std::size_t offset = 0;
    bool referenced = false;
    // A descriptor has at most ~16 fields, short strings and 64-byte handles.
    const msgpack::unpack_limit limit(/*array=*/64, /*map=*/64, /*str=*/4096, /*bin=*/4096,
                                      /*ext=*/4096, /*depth=*/8);
    msgpack::object_handle handle =
        msgpack::unpack(reinterpret_cast<const char*>(bytes.data()), bytes.size(), offset,
                        referenced, nullptr, nullptr, limit);
    if (offset != bytes.size()) {
      return InvalidArgumentError("malformed MoRI " + std::string(what) + ": " +
                                  std::to_string(bytes.size() - offset) + " trailing bytes");
    }
    const msgpack::object& object = handle.get();
    if constexpr (kRequiredFields<T> > 0) {
      if (object.type == msgpack::type::ARRAY && object.via.array.size < kRequiredFields<T>) {
        return InvalidArgumentError("malformed MoRI " + std::string(what) + ": " +
                                    std::to_string(object.via.array.size) + " fields, at least " +
                                    std::to_string(kRequiredFields<T>) + " needed");
      }
    }
    T value{};  // value-initialised: no member is left indeterminate
    object.convert(value);
    return value;
  } catch (...) {
    return InvalidArgumentError("malformed MoRI " + std::string(what) + " (" +
                                std::to_string(bytes.size()) +
                                " bytes): " + CurrentExceptionMessage());
  }
}

/// Our view of a MoRI MemoryDesc, checked: a known location, an engine key, a non-empty range
/// that does not wrap. `blob` becomes its desc bytes. Pure.
inline Result<MoriMemory> ToMoriMemory(const mio::MemoryDesc& d, std::vector<std::uint8_t> blob) {
  MoriMemory m;
  m.engine_key = d.engineKey;
  m.id = d.id;
  m.data = d.data;
  m.size = d.size;
  m.device = d.deviceId;
  switch (d.loc) {
    case mio::MemoryLocationType::GPU: m.kind = MemoryKind::kRocm; break;
    case mio::MemoryLocationType::CPU: m.kind = MemoryKind::kHost; break;
    default:
      return InvalidArgumentError("MoRI memory " + std::to_string(d.id) + " of engine '" +
                                  d.engineKey + "' has unknown location " +
                                  std::to_string(static_cast<std::uint32_t>(d.loc)));
  }
  if (d.engineKey.empty() || d.data == 0 || d.size == 0 || d.data + d.size < d.data) {
    return InvalidArgumentError("MoRI memory " + std::to_string(d.id) + " of engine '" +
                                d.engineKey + "' describes no valid range (" +
                                std::to_string(d.data) + "+" + std::to_string(d.size) + ")");
  }
  if (m.kind == MemoryKind::kRocm && m.device < 0) {
    return InvalidArgumentError("MoRI GPU memory " + std::to_string(d.id) + " of engine '" +
                                d.engineKey + "' names no device (" + std::to_string(d.deviceId) +
                                ")");
  }
  m.desc = std::move(blob);
  return m;
}

/// Decodes a remote key (MemoryDesc msgpack). Pure.
inline Result<MoriMemory> DecodeMemory(std::span<const std::uint8_t> bytes) {
  auto desc = Unpack<mio::MemoryDesc>(bytes, "MemoryDesc (remote key)");
  if (!desc.ok()) return desc.status();
  return ToMoriMemory(*desc, {bytes.begin(), bytes.end()});
}

/// The engine key of a peer address (EngineDesc msgpack), checked. Pure.
inline Result<std::string> DecodeEngineKey(std::span<const std::uint8_t> bytes) {
  auto desc = Unpack<mio::EngineDesc>(bytes, "EngineDesc (peer address)");
  if (!desc.ok()) return desc.status();
  if (desc->key.empty()) return InvalidArgumentError("MoRI peer address has an empty engine key");
  // 0 is accepted: an engine without an RDMA transport has no control-plane listener to dial.
  if (desc->port < 0 || desc->port > 65535) {
    return InvalidArgumentError("MoRI peer '" + desc->key + "' advertises port " +
                                std::to_string(desc->port));
  }
  return desc->key;
}

/// "PEER_UNREACHABLE", ... or "REASON_<n>" for a number this build does not know.
inline std::string ReasonName(mio::PeerFailureReason reason) {
  switch (reason) {
    case mio::PeerFailureReason::UNKNOWN: return "UNKNOWN";
    case mio::PeerFailureReason::PEER_UNREACHABLE: return "PEER_UNREACHABLE";
    case mio::PeerFailureReason::LOCAL_QP_ERROR: return "LOCAL_QP_ERROR";
    case mio::PeerFailureReason::LOCAL_PORT_DOWN: return "LOCAL_PORT_DOWN";
    case mio::PeerFailureReason::LOCAL_DEVICE_FATAL: return "LOCAL_DEVICE_FATAL";
    case mio::PeerFailureReason::LOCAL_CQ_ERROR: return "LOCAL_CQ_ERROR";
  }
  return "REASON_" + std::to_string(static_cast<std::uint32_t>(reason));
}

}  // namespace moriio_native::detail::mori_backend::codec
