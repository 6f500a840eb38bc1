#pragma once

// Helpers shared by the backend tests: batches, and the options that find the UCX this build
// was configured with (MORIIO_UCX_TEST_LIBRARY_DIR, defined for the tests that load UCX).

#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <vector>

#include "moriio_native/backend.hpp"

namespace moriio_native::testing_support {

/// `bytes`, an envelope of the UCX plugin's wire formats (ucx_wire.hpp: address, key, push
/// request) with the FNV-1a of its header and payload at `sum_at` and its payload from `header`
/// on, with `n` bytes at `at` replaced by `value` (little-endian) and the checksum redone: a test
/// alters a field and still presents a well-formed envelope (the checksum is no secret).
inline std::vector<std::uint8_t> Resealed(std::vector<std::uint8_t> bytes, std::size_t sum_at,
                                          std::size_t header, std::size_t at, int n,
                                          std::uint64_t value) {
  auto fnv1a = [](const std::uint8_t* p, std::size_t len, std::uint64_t h) {
    for (std::size_t i = 0; i < len; ++i) {
      h ^= p[i];
      h *= 0x100000001b3ull;
    }
    return h;
  };
  for (int i = 0; i < n; ++i) bytes[at + i] = static_cast<std::uint8_t>(value >> (8 * i));
  std::uint64_t h = fnv1a(bytes.data(), sum_at, 0xcbf29ce484222325ull);
  h = fnv1a(bytes.data() + header, bytes.size() - header, h);
  for (int i = 0; i < 8; ++i) bytes[sum_at + i] = static_cast<std::uint8_t>(h >> (8 * i));
  return bytes;
}

/// A batch of runs (local offset, remote offset, size) between two regions of one peer.
inline std::shared_ptr<Batch> MakeBatch(TransferOp op, std::uint64_t local, std::uint64_t peer,
                                        std::uint64_t remote, std::vector<std::int64_t> lo,
                                        std::vector<std::int64_t> ro, std::vector<std::int64_t> sz,
                                        std::uint64_t token) {
  auto b = std::make_shared<Batch>();
  b->op = op;
  b->local_region = local;
  b->peer = peer;
  b->remote_region = remote;
  b->local_offsets = std::move(lo);
  b->remote_offsets = std::move(ro);
  b->sizes = std::move(sz);
  b->token = token;
  return b;
}

/// Options pointing at the UCX found at build time, unless the environment names one.
inline BackendOptions UcxTestOptions() {
  BackendOptions o;
#ifdef MORIIO_UCX_TEST_LIBRARY_DIR
  if (std::getenv("MORIIO_NATIVE_UCX_LIBRARY_PATH") == nullptr &&
      std::strlen(MORIIO_UCX_TEST_LIBRARY_DIR) != 0) {
    o["ucx_library_path"] = MORIIO_UCX_TEST_LIBRARY_DIR;
  }
#endif
  return o;
}

}  // namespace moriio_native::testing_support
