#include "ucx_api.hpp"

#include <sys/stat.h>

#include <climits>
#include <cstdlib>
#include <memory>
#include <mutex>

#include "dynamic_library.hpp"

namespace moriio_native::detail::ucx {
namespace {

constexpr const char* kDefaultSoname = "libucp.so.0";
constexpr const char* kEnvPath = "MORIIO_NATIVE_UCX_LIBRARY_PATH";

struct Loaded {
  std::string requested;  // the path as resolved before dlopen (file, or the soname)
  DynamicLibrary library;
  UcxApi api;
};

std::mutex g_mutex;
std::unique_ptr<Loaded> g_loaded;  // set once, never released: UCX must not be unloaded

std::string RealPath(const std::string& path) {
  char buf[PATH_MAX];
  if (::realpath(path.c_str(), buf) == nullptr) return path;
  return buf;
}

/// The file a loaded handle came from (dladdr on one of its symbols).
std::string LoadedFile(const void* symbol) {
  const std::string file = DynamicLibrary::FileOf(symbol);
  return file.empty() ? file : RealPath(file);
}

template <typename Fn>
bool Resolve(const DynamicLibrary& handle, const char* name, Fn& out, std::string& missing) {
  Result<Fn> sym = handle.Symbol<Fn>(name);
  if (!sym.ok()) {
    if (!missing.empty()) missing += ", ";
    missing += name;
    return false;
  }
  out = *sym;
  return true;
}

Status ResolveAll(const DynamicLibrary& handle, UcxApi& api) {
  std::string missing;
  Resolve(handle, "ucp_get_version", api.get_version, missing);
  Resolve(handle, "ucp_get_version_string", api.get_version_string, missing);
  Resolve(handle, "ucp_config_read", api.config_read, missing);
  Resolve(handle, "ucp_config_release", api.config_release, missing);
  Resolve(handle, "ucp_config_modify", api.config_modify, missing);
  Resolve(handle, "ucp_init_version", api.init_version, missing);
  Resolve(handle, "ucp_cleanup", api.cleanup, missing);
  Resolve(handle, "ucp_context_query", api.context_query, missing);
  Resolve(handle, "ucp_worker_create", api.worker_create, missing);
  Resolve(handle, "ucp_worker_destroy", api.worker_destroy, missing);
  Resolve(handle, "ucp_worker_get_address", api.worker_get_address, missing);
  Resolve(handle, "ucp_worker_release_address", api.worker_release_address, missing);
  Resolve(handle, "ucp_worker_progress", api.worker_progress, missing);
  Resolve(handle, "ucp_worker_get_efd", api.worker_get_efd, missing);
  Resolve(handle, "ucp_worker_arm", api.worker_arm, missing);
  Resolve(handle, "ucp_ep_create", api.ep_create, missing);
  Resolve(handle, "ucp_ep_close_nbx", api.ep_close_nbx, missing);
  Resolve(handle, "ucp_ep_flush_nbx", api.ep_flush_nbx, missing);
  Resolve(handle, "ucp_mem_map", api.mem_map, missing);
  Resolve(handle, "ucp_mem_unmap", api.mem_unmap, missing);
  Resolve(handle, "ucp_mem_query", api.mem_query, missing);
  Resolve(handle, "ucp_rkey_pack", api.rkey_pack, missing);
  Resolve(handle, "ucp_rkey_buffer_release", api.rkey_buffer_release, missing);
  Resolve(handle, "ucp_ep_rkey_unpack", api.ep_rkey_unpack, missing);
  Resolve(handle, "ucp_rkey_ptr", api.rkey_ptr, missing);
  Resolve(handle, "ucp_rkey_destroy", api.rkey_destroy, missing);
  Resolve(handle, "ucp_put_nbx", api.put_nbx, missing);
  Resolve(handle, "ucp_get_nbx", api.get_nbx, missing);
  Resolve(handle, "ucp_request_check_status", api.request_check_status, missing);
  Resolve(handle, "ucp_request_free", api.request_free, missing);
  // ucs_status_string lives in libucs, a dependency of libucp; dlsym on the libucp handle
  // searches its dependencies too.
  Resolve(handle, "ucs_status_string", api.status_string, missing);
  if (!missing.empty()) {
    return BackendUnavailableError("UCX library lacks required symbols (" + missing +
                                   "); UCX 1.10 or newer is needed");
  }
  std::string absent;  // optional: a UCX without them keeps reading with ucp_get_nbx
  Resolve(handle, "ucp_am_send_nbx", api.am_send_nbx, absent);
  Resolve(handle, "ucp_worker_set_am_recv_handler", api.worker_set_am_recv_handler, absent);
  Resolve(handle, "ucp_ep_query", api.ep_query, absent);
  if (!absent.empty()) {
    api.am_send_nbx = nullptr;
    api.worker_set_am_recv_handler = nullptr;
    api.ep_query = nullptr;
  }
  return Status::OK();
}

}  // namespace

std::string ResolveUcxLibrary(const std::string& explicit_path) {
  std::string path = explicit_path;
  if (path.empty()) {
    const char* env = std::getenv(kEnvPath);
    if (env != nullptr) path = env;
  }
  if (path.empty()) return kDefaultSoname;
  struct stat st {};
  if (::stat(path.c_str(), &st) == 0 && S_ISDIR(st.st_mode)) {
    std::string dir = path;
    while (dir.size() > 1 && dir.back() == '/') dir.pop_back();
    return dir + "/" + kDefaultSoname;
  }
  return path;
}

Result<const UcxApi*> LoadUcx(const std::string& explicit_path) {
  const std::string origin = !explicit_path.empty()              ? "ucx_library_path"
                             : std::getenv(kEnvPath) != nullptr ? kEnvPath
                                                                : "default search path";
  const std::string file = ResolveUcxLibrary(explicit_path);
  const bool is_path = file.find('/') != std::string::npos;
  if (is_path) {
    struct stat st {};
    if (::stat(file.c_str(), &st) != 0) {
      return BackendUnavailableError("UCX library '" + file + "' (from " + origin +
                                     ") does not exist");
    }
  }

  std::lock_guard<std::mutex> lock(g_mutex);
  if (g_loaded) {
    // Same library again: fine. Another one: refuse, the sonames would collide.
    // A bare soname resolves to the already-loaded library anyway (the loader matches sonames).
    if (!is_path || g_loaded->requested == file || RealPath(file) == g_loaded->api.library_path) {
      return &g_loaded->api;
    }
    return BackendUnavailableError("UCX is already loaded in this process from '" +
                                   g_loaded->api.library_path + "'; cannot also load '" + file +
                                   "' (from " + origin + ")");
  }

  Result<DynamicLibrary> library = DynamicLibrary::Open(file);
  if (!library.ok()) {
    std::string hint = is_path ? "" : " (install the libucx-cu13 wheel or a system UCX, or set "
                                      "ucx_library_path / MORIIO_NATIVE_UCX_LIBRARY_PATH)";
    return BackendUnavailableError("UCX library '" + file + "' (from " + origin +
                                   "): " + library.status().message() + hint);
  }
  auto loaded = std::make_unique<Loaded>();
  loaded->requested = file;
  loaded->library = std::move(*library);
  // On the error returns below `loaded` unloads the library: nothing has initialised UCX yet.
  Status st = ResolveAll(loaded->library, loaded->api);
  if (!st.ok()) return st.WithContext("UCX library '" + file + "'");
  loaded->api.get_version(&loaded->api.major, &loaded->api.minor, &loaded->api.release);
  loaded->api.library_path = LoadedFile(reinterpret_cast<const void*>(loaded->api.get_version));
  if (loaded->api.library_path.empty()) loaded->api.library_path = file;
  if (loaded->api.version() < kMinUcxVersion) {
    std::string v = std::to_string(loaded->api.major) + "." + std::to_string(loaded->api.minor);
    return BackendUnavailableError("UCX library '" + file + "' is version " + v +
                                   "; 1.10 or newer is needed");
  }
  loaded->library.KeepLoaded();  // UCX must never be unloaded once in use
  g_loaded = std::move(loaded);
  return &g_loaded->api;
}

}  // namespace moriio_native::detail::ucx
