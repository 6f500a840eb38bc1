// libFuzzer target for the peer-metadata decoder (cpp/peer_metadata.hpp): the bytes a peer sends
// in its handshake reply, before anything trusts them.
//
// What must hold for every input: no crash, hang or sanitizer report (the target is built with
// ASan and UBSan); a refused input gets InvalidArgument or Incompatible with a message; an
// accepted one re-encodes to metadata that decodes to the same records (the decoder and the
// encoder agree on the format).
//
// Build and run: docs/reliability.md, "Fuzzing".

#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <span>
#include <vector>

#include "peer_metadata.hpp"

namespace {

void Require(bool condition, const char* what) {
  if (!condition) {
    std::fprintf(stderr, "peer_metadata_fuzzer: %s\n", what);
    std::abort();
  }
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  using moriio_native::StatusCode;
  namespace detail = moriio_native::detail;
  const auto decoded = detail::DecodeMetadata(std::span<const std::uint8_t>(data, size));
  if (!decoded.ok()) {
    const StatusCode code = decoded.status().code();
    Require(code == StatusCode::kInvalidArgument || code == StatusCode::kIncompatible,
            "a refused input must be InvalidArgument or Incompatible");
    Require(!decoded.status().message().empty(), "a refusal must say why");
    return 0;
  }
  const std::vector<std::uint8_t> again = detail::EncodeMetadata(decoded.value());
  const auto round_trip = detail::DecodeMetadata(again);
  Require(round_trip.ok(), "re-encoded metadata must decode");
  Require(detail::EncodeMetadata(round_trip.value()) == again,
          "decode(encode(m)) must encode to the same bytes");
  return 0;
}
