#pragma once

/// The UCX functions the plugin calls, resolved at runtime with dlopen/dlsym.
///
/// Why a shim: the wheel must import on machines without UCX, and one build must run against
/// whichever UCX the user has (the libucx-cu13 wheel, a system package, a site build). Only the
/// UCX headers are used at build time; each pointer below has exactly the type of the function
/// the header declares, so a signature change in UCX is a compile error here, not a crash.

#include <ucp/api/ucp.h>

#include <cstdint>
#include <string>

#include "moriio_native/status.hpp"

namespace moriio_native::detail::ucx {

/// Resolved UCX entry points. Immutable once loaded; shared by every backend of the process.
struct UcxApi {
  decltype(&::ucp_get_version) get_version = nullptr;
  decltype(&::ucp_get_version_string) get_version_string = nullptr;
  decltype(&::ucp_config_read) config_read = nullptr;
  decltype(&::ucp_config_release) config_release = nullptr;
  decltype(&::ucp_config_modify) config_modify = nullptr;
  decltype(&::ucp_init_version) init_version = nullptr;
  decltype(&::ucp_cleanup) cleanup = nullptr;
  decltype(&::ucp_context_query) context_query = nullptr;
  decltype(&::ucp_worker_create) worker_create = nullptr;
  decltype(&::ucp_worker_destroy) worker_destroy = nullptr;
  decltype(&::ucp_worker_get_address) worker_get_address = nullptr;
  decltype(&::ucp_worker_release_address) worker_release_address = nullptr;
  decltype(&::ucp_worker_progress) worker_progress = nullptr;
  decltype(&::ucp_worker_get_efd) worker_get_efd = nullptr;
  decltype(&::ucp_worker_arm) worker_arm = nullptr;
  decltype(&::ucp_ep_create) ep_create = nullptr;
  decltype(&::ucp_ep_close_nbx) ep_close_nbx = nullptr;
  decltype(&::ucp_ep_flush_nbx) ep_flush_nbx = nullptr;
  decltype(&::ucp_mem_map) mem_map = nullptr;
  decltype(&::ucp_mem_unmap) mem_unmap = nullptr;
  decltype(&::ucp_mem_query) mem_query = nullptr;
  decltype(&::ucp_rkey_pack) rkey_pack = nullptr;
  decltype(&::ucp_rkey_buffer_release) rkey_buffer_release = nullptr;
  decltype(&::ucp_ep_rkey_unpack) ep_rkey_unpack = nullptr;
  decltype(&::ucp_rkey_ptr) rkey_ptr = nullptr;
  decltype(&::ucp_rkey_destroy) rkey_destroy = nullptr;
  decltype(&::ucp_put_nbx) put_nbx = nullptr;
  decltype(&::ucp_get_nbx) get_nbx = nullptr;
  decltype(&::ucp_request_check_status) request_check_status = nullptr;
  decltype(&::ucp_request_free) request_free = nullptr;
  decltype(&::ucs_status_string) status_string = nullptr;
  // Optional (null when this UCX lacks them): the target-driven READ ("push", see
  // "Push READ" in ucx_backend.cpp) needs active messages and the endpoint's transport list.
  decltype(&::ucp_am_send_nbx) am_send_nbx = nullptr;
  decltype(&::ucp_worker_set_am_recv_handler) worker_set_am_recv_handler = nullptr;
  decltype(&::ucp_ep_query) ep_query = nullptr;

  /// Whether the optional entry points of the push READ were all found.
  bool has_push() const {
    return am_send_nbx != nullptr && worker_set_am_recv_handler != nullptr && ep_query != nullptr;
  }

  /// The libucp file that was loaded (absolute path) and its version.
  std::string library_path;
  unsigned major = 0, minor = 0, release = 0;

  /// (major << 16) | (minor << 8) | release, for comparisons.
  std::uint32_t version() const { return (major << 16) | (minor << 8) | release; }
};

/// Oldest UCX the plugin runs against: the nbx RMA calls and ucp_ep_close_nbx exist from 1.10.
inline constexpr std::uint32_t kMinUcxVersion = (1u << 16) | (10u << 8);

/// Where the plugin looks for libucp, in this order: `explicit_path` (the `ucx_library_path`
/// option) when not empty, then the environment variable MORIIO_NATIVE_UCX_LIBRARY_PATH, then the
/// dynamic linker's default search ("libucp.so.0"). A path may name the libucp file or the
/// directory that holds it.
std::string ResolveUcxLibrary(const std::string& explicit_path);

/// Loads UCX from `explicit_path` (see ResolveUcxLibrary) once per process and returns the symbol
/// table. UCX cannot be loaded twice into one process (both builds use the same sonames), so a
/// later call naming a different library fails. BackendUnavailable names the path and carries
/// dlerror()'s reason. Thread-safe; blocks while the library loads. The library is never unloaded.
Result<const UcxApi*> LoadUcx(const std::string& explicit_path);

}  // namespace moriio_native::detail::ucx
