// Entry points of libmoriio_native_ucx.so: the plugin table, plus path counters for tests.

#include <cstdint>

#include "moriio_native/backend.hpp"
#include "ucx_backend.hpp"
#include "ucx_options.hpp"

namespace {

moriio_native::Status Probe(const moriio_native::BackendOptions& options) {
  return moriio_native::detail::ucx::ProbeUcx(options);
}

moriio_native::Result<std::unique_ptr<moriio_native::Backend>> Create(
    const moriio_native::BackendOptions& options,
    std::shared_ptr<moriio_native::CompletionSink> sink) {
  return moriio_native::detail::ucx::CreateUcxBackend(options, std::move(sink));
}

const moriio_native::BackendPlugin kPlugin = [] {
  moriio_native::BackendPlugin p;
  p.name = "ucx";
  p.probe = &Probe;
  p.create = &Create;
  p.options = moriio_native::detail::ucx::kUcxOptionKeys;
  return p;
}();

}  // namespace

/// Batches per data path ([0] UCX operations, [1] host memcpy via ucp_rkey_ptr, [2] CUDA kernel,
/// [3] batched process_vm_readv/writev, [4] push READ) since the process started; lets tests
/// check which path a configuration takes. `out` holds 5 counters. Thread-safe.
extern "C" __attribute__((visibility("default"))) void moriio_native_ucx_path_counters(
    std::uint64_t out[5]) {
  moriio_native::detail::ucx::PathCounters(out);
}

/// Push READ requests this process's UCX backends dropped as targets without an answer (see
/// UnansweredPushRequests). Thread-safe.
extern "C" __attribute__((visibility("default"))) std::uint64_t
moriio_native_ucx_unanswered_push_requests() {
  return moriio_native::detail::ucx::UnansweredPushRequests();
}

/// Thread-safe, never blocks; the returned table lives as long as the library is loaded.
extern "C" __attribute__((visibility("default"))) const moriio_native::BackendPlugin*
moriio_native_backend_plugin() {
  return &kPlugin;
}
