#pragma once

// Helpers shared by the backend tests: batches, and the options that find the UCX this build
// was configured with (MORIIO_UCX_TEST_LIBRARY_DIR, defined for the tests that load UCX).

#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <vector>

#include "moriio_native/backend.hpp"

namespace moriio_native::testing_support {

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
