// Finds backends: loopback is built in; every other backend is a plugin library beside the core
// library, loaded on first use and never unloaded (its threads and code may outlive any caller).

#include <dlfcn.h>
#include <sys/stat.h>

#include <cstdlib>
#include <map>
#include <mutex>

#include "backends/loopback/loopback_backend.hpp"
#include "moriio_native/backend.hpp"

namespace moriio_native {

Result<MemoryRange> Backend::Allocate(std::uint64_t, MemoryKind, int) {
  return FailedPreconditionError("backend '" + std::string(name()) +
                                 "' does not allocate memory");
}

Status Backend::Free(const MemoryRange&) {
  return FailedPreconditionError("backend '" + std::string(name()) + "' does not allocate memory");
}

namespace {

constexpr const char* kPluginBackends[] = {"ucx", "mori"};

bool IsPluginBackend(std::string_view name) {
  for (const char* n : kPluginBackends) {
    if (name == n) return true;
  }
  return false;
}

// The directory holding libmoriio_native.so (and its plugins), or $MORIIO_NATIVE_PLUGIN_DIR.
std::string PluginDirectory() {
  if (const char* env = std::getenv("MORIIO_NATIVE_PLUGIN_DIR"); env && *env) return env;
  Dl_info info{};
  if (dladdr(reinterpret_cast<void*>(&PluginDirectory), &info) == 0 || !info.dli_fname) return ".";
  std::string path = info.dli_fname;
  const auto slash = path.rfind('/');
  return slash == std::string::npos ? "." : path.substr(0, slash);
}

struct LoadedPlugin {
  const BackendPlugin* plugin = nullptr;
  Status error;  // why it could not be loaded
};

// Loads (once) and returns the plugin for `name`. Thread-safe.
const LoadedPlugin& LoadPlugin(const std::string& name) {
  static std::mutex mu;
  static auto* cache = new std::map<std::string, LoadedPlugin>();  // plugins live forever
  std::lock_guard lock(mu);
  if (auto it = cache->find(name); it != cache->end()) return it->second;
  LoadedPlugin& entry = (*cache)[name];
  const std::string path = PluginDirectory() + "/libmoriio_native_" + name + ".so";
  struct stat st{};
  if (::stat(path.c_str(), &st) != 0) {
    entry.error = BackendUnavailableError("moriio_native was built without the " + name +
                                          " backend plugin (no " + path + ")");
    return entry;
  }
  void* handle = ::dlopen(path.c_str(), RTLD_NOW | RTLD_LOCAL);
  if (!handle) {
    const char* why = ::dlerror();
    entry.error = BackendUnavailableError("the " + name + " backend plugin cannot be loaded: " +
                                          (why ? why : "unknown dlopen error"));
    return entry;
  }
  using EntryFn = const BackendPlugin* (*)();
  auto fn = reinterpret_cast<EntryFn>(::dlsym(handle, MORIIO_NATIVE_PLUGIN_SYMBOL));
  const BackendPlugin* plugin = fn ? fn() : nullptr;
  if (!plugin || plugin->abi_version != BackendPlugin::kAbiVersion || !plugin->probe ||
      !plugin->create) {
    entry.error = BackendUnavailableError("the " + name + " backend plugin at " + path +
                                          " has no compatible entry point (ABI " +
                                          std::to_string(BackendPlugin::kAbiVersion) + ")");
    return entry;
  }
  entry.plugin = plugin;
  return entry;
}

}  // namespace

std::vector<BackendAvailability> AvailableBackends(const BackendOptions& options) {
  std::vector<BackendAvailability> out;
  out.push_back({"loopback", true, ""});
  for (const char* name : kPluginBackends) {
    const LoadedPlugin& loaded = LoadPlugin(name);
    Status status = loaded.plugin ? loaded.plugin->probe(options) : loaded.error;
    out.push_back({name, status.ok(), status.ok() ? "" : status.message()});
  }
  return out;
}

Result<std::unique_ptr<Backend>> CreateBackend(std::string_view name, const BackendOptions& options,
                                               std::shared_ptr<CompletionSink> sink) {
  if (name == "loopback") return detail::CreateLoopbackBackend(options, std::move(sink));
  if (!IsPluginBackend(name)) {
    return NotFoundError("unknown backend '" + std::string(name) +
                         "' (known: loopback, ucx, mori)");
  }
  const LoadedPlugin& loaded = LoadPlugin(std::string(name));
  if (!loaded.plugin) return loaded.error;
  MORIIO_RETURN_IF_ERROR(loaded.plugin->probe(options));
  return loaded.plugin->create(options, std::move(sink));
}

}  // namespace moriio_native
