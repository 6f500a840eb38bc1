// Finds backends: loopback is built in; every other backend is a plugin library beside the core
// library, loaded on first use and never unloaded (its threads and code may outlive any caller).

#include <sys/stat.h>

#include <algorithm>
#include <cstdlib>
#include <map>
#include <mutex>

#include "backends/loopback/loopback_backend.hpp"
#include "dynamic_library.hpp"
#include "moriio_native/backend.hpp"

namespace moriio_native {

Result<MemoryRange> Backend::Allocate(std::uint64_t, MemoryKind, int) {
  return FailedPreconditionError("backend '" + std::string(name()) +
                                 "' does not allocate memory");
}

Status Backend::Free(const MemoryRange&) {
  return FailedPreconditionError("backend '" + std::string(name()) + "' does not allocate memory");
}

bool Backend::AcceptsCells(std::uint64_t, std::uint64_t, const CellGeometry&) const {
  return false;
}

bool Backend::AcceptsStamps(std::uint64_t, std::uint64_t) const { return false; }

bool Backend::AcceptsDeviceWaits(std::uint64_t, std::uint64_t) const { return false; }

void Backend::ExpectSubmits() {}

void Backend::SetOwner(std::string_view) {}

Status Backend::ExpectPeerOwner(std::uint64_t, std::string_view) { return Status::OK(); }
bool Backend::PeerFailed(std::uint64_t) { return false; }

Status CheckBatchRuns(const Batch& b, std::uint64_t local_size, std::uint64_t remote_size) {
  if (b.cells) {
    return FailedPreconditionError("batch " + std::to_string(b.token) +
                                   " is a cell batch; this backend moves runs only for this "
                                   "region pair (AcceptsCells said no)");
  }
  if (b.stamps) {
    return FailedPreconditionError("batch " + std::to_string(b.token) +
                                   " is a stamped batch; this backend moves runs only for this "
                                   "region pair (AcceptsStamps said no)");
  }
  const std::size_t n = b.sizes.size();
  if (b.local_offsets.size() != n || b.remote_offsets.size() != n) {
    return InvalidArgumentError("batch " + std::to_string(b.token) + " has " +
                                std::to_string(b.local_offsets.size()) + " local offsets, " +
                                std::to_string(b.remote_offsets.size()) + " remote offsets and " +
                                std::to_string(n) + " sizes; they must be equal");
  }
  // One branch-free pass decides whether every run fits (the common case, ~1 ns per run less
  // than the branching pass for 4 KiB-run batches of 65,536 runs); only a batch with a bad run
  // takes the pass below, which names the first one. Signs first; then size - 1 < min(region
  // sizes) holds exactly for 0 < size <= both sizes, after which offset <= region size - size
  // cannot wrap.
  const std::uint64_t smaller = std::min(local_size, remote_size);
  const std::int64_t* const los = b.local_offsets.data();
  const std::int64_t* const ros = b.remote_offsets.data();
  const std::int64_t* const szs = b.sizes.data();
  bool bad = false;
  for (std::size_t i = 0; i < n; ++i) {
    const auto size = static_cast<std::uint64_t>(szs[i]);
    bad |= ((los[i] | ros[i] | szs[i]) < 0) | (size - 1 >= smaller) | (static_cast<std::uint64_t>(los[i]) > local_size - size) |
           (static_cast<std::uint64_t>(ros[i]) > remote_size - size);
  }
  if (!bad) return Status::OK();
  for (std::size_t i = 0; i < n; ++i) {
    const std::int64_t lo = b.local_offsets[i];
    const std::int64_t ro = b.remote_offsets[i];
    const std::int64_t sz = b.sizes[i];
    // Named only for an error: building it for every run cost ~130 ns of CPU per run, as much
    // as an H200 takes to copy 250 KB (a 4 KiB-run batch spent 30x longer here than on the GPU).
    auto what = [&] {
      return "batch " + std::to_string(b.token) + " run " + std::to_string(i) + " (local offset " +
             std::to_string(lo) + ", remote offset " + std::to_string(ro) + ", size " +
             std::to_string(sz) + ")";
    };
    if (lo < 0 || ro < 0 || sz <= 0) {
      return InvalidArgumentError(what() + ": offsets must be >= 0 and sizes > 0");
    }
    // Compared as offset <= size - length, which cannot overflow once length <= size.
    const auto size = static_cast<std::uint64_t>(sz);
    if (size > local_size || static_cast<std::uint64_t>(lo) > local_size - size ||
        size > remote_size || static_cast<std::uint64_t>(ro) > remote_size - size) {
      return OutOfRangeError(what() + " does not fit the local region (" +
                             std::to_string(local_size) + " bytes) and the remote region (" +
                             std::to_string(remote_size) + " bytes)");
    }
  }
  return InternalError("batch " + std::to_string(b.token) +
                       ": the run check found a bad run that the naming pass did not");
}

namespace {

// The bytes a block's cells span on one side, relative to the block's offset: [low, high).
// False when a bound overflows.
bool CellExtent(const CellGeometry& g, const CellSide& side, std::int64_t* low,
                std::int64_t* high) {
  const std::int64_t counts[] = {g.planes, g.heads, g.tokens};
  const std::int64_t strides[] = {side.plane_stride, side.head_stride, side.token_stride};
  std::int64_t lo = 0, hi = g.cell_bytes;
  for (int i = 0; i < 3; ++i) {
    std::int64_t reach = 0;
    if (__builtin_mul_overflow(counts[i] - 1, strides[i], &reach)) return false;
    if (__builtin_add_overflow(reach < 0 ? lo : hi, reach, reach < 0 ? &lo : &hi)) return false;
  }
  *low = lo;
  *high = hi;
  return true;
}

// Whether [offset + low, offset + high) lies inside [0, size).
bool InsideRegion(std::int64_t offset, std::int64_t low, std::int64_t high, std::uint64_t size) {
  std::int64_t begin = 0, end = 0;
  if (__builtin_add_overflow(offset, low, &begin) || __builtin_add_overflow(offset, high, &end)) {
    return false;
  }
  return begin >= 0 && static_cast<std::uint64_t>(end) <= size;
}

}  // namespace

Status CheckBatchCells(const Batch& b, std::uint64_t local_size, std::uint64_t remote_size) {
  const std::string batch = "batch " + std::to_string(b.token);
  if (!b.cells) return InvalidArgumentError(batch + " has no cells");
  if (b.stamps || !b.sizes.empty() || !b.local_offsets.empty() || !b.remote_offsets.empty()) {
    return InvalidArgumentError(batch +
                                " carries cells and runs or stamps; a batch carries one of them");
  }
  const CellGeometry& g = b.cells->geometry;
  if (g.planes < 1 || g.heads < 1 || g.tokens < 1 || g.cell_bytes < 1) {
    return InvalidArgumentError(batch + " has an empty cell geometry (planes " +
                                std::to_string(g.planes) + ", heads " + std::to_string(g.heads) +
                                ", tokens " + std::to_string(g.tokens) + ", cell bytes " +
                                std::to_string(g.cell_bytes) + "); each must be >= 1");
  }
  const BlockOffsets& blocks = b.cells->blocks;
  if (blocks.local.size() != blocks.remote.size()) {
    return InvalidArgumentError(batch + " has " + std::to_string(blocks.local.size()) +
                                " local and " + std::to_string(blocks.remote.size()) +
                                " remote block offsets; they must be equal");
  }
  std::int64_t local_low = 0, local_high = 0, remote_low = 0, remote_high = 0;
  if (!CellExtent(g, g.local, &local_low, &local_high) ||
      !CellExtent(g, g.remote, &remote_low, &remote_high)) {
    return InvalidArgumentError(batch + ": the cell strides overflow");
  }
  for (std::size_t i = 0; i < blocks.size(); ++i) {
    if (!InsideRegion(blocks.local[i], local_low, local_high, local_size) ||
        !InsideRegion(blocks.remote[i], remote_low, remote_high, remote_size)) {
      return OutOfRangeError(batch + " block " + std::to_string(i) + " (local offset " +
                             std::to_string(blocks.local[i]) + ", remote offset " +
                             std::to_string(blocks.remote[i]) +
                             ") has cells outside the local region (" +
                             std::to_string(local_size) + " bytes) or the remote region (" +
                             std::to_string(remote_size) + " bytes)");
    }
  }
  return Status::OK();
}

namespace {

constexpr const char* kPluginBackends[] = {"ucx", "mori"};
constexpr const char* kAllBackends[] = {"loopback", "ucx", "mori"};

bool IsSharedKey(std::string_view key) {
  return std::ranges::find(kSharedBackendOptionKeys, key) != std::end(kSharedBackendOptionKeys);
}

// The backend whose prefix `key` carries ("ucx" for "ucx_tls"), or "" for none.
std::string_view PrefixOwner(std::string_view key) {
  for (const char* name : kAllBackends) {
    const std::string_view n = name;
    if (key.size() > n.size() && key.starts_with(n) && key[n.size()] == '_') return n;
  }
  return {};
}

bool IsPluginBackend(std::string_view name) {
  for (const char* n : kPluginBackends) {
    if (name == n) return true;
  }
  return false;
}

// The directory holding libmoriio_native.so (and its plugins), or $MORIIO_NATIVE_PLUGIN_DIR.
std::string PluginDirectory() {
  if (const char* env = std::getenv("MORIIO_NATIVE_PLUGIN_DIR"); env && *env) return env;
  return detail::DynamicLibrary::DirectoryOf(reinterpret_cast<const void*>(&PluginDirectory));
}

struct LoadedPlugin {
  const BackendPlugin* plugin = nullptr;
  std::vector<std::string> options;  // the keys it accepts, sorted
  Status error;                      // why it could not be loaded
};

// A plugin's option list: every key its own ("<name>_...") or shared, else why not.
Status ReadOptionKeys(const BackendPlugin& plugin, const std::string& name,
                      std::vector<std::string>* out) {
  for (const char* const* key = plugin.options; key != nullptr && *key != nullptr; ++key) {
    const std::string_view k = *key;
    if (PrefixOwner(k) != name && !IsSharedKey(k)) {
      return BackendUnavailableError("the " + name + " backend plugin lists option '" +
                                     std::string(k) + "', which is neither " + name +
                                     "_* nor a shared key");
    }
    out->emplace_back(k);
  }
  std::ranges::sort(*out);
  return Status::OK();
}

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
  Result<detail::DynamicLibrary> library = detail::DynamicLibrary::Open(path);
  if (!library.ok()) {
    entry.error = BackendUnavailableError("the " + name + " backend plugin cannot be loaded: " +
                                          library.status().message());
    return entry;
  }
  // Never unloaded: a plugin's threads and code may outlive any caller.
  library->KeepLoaded();
  using EntryFn = const BackendPlugin* (*)();
  Result<EntryFn> fn = library->Symbol<EntryFn>(MORIIO_NATIVE_PLUGIN_SYMBOL);
  const BackendPlugin* plugin = fn.ok() ? (*fn)() : nullptr;
  if (!plugin || plugin->abi_version != BackendPlugin::kAbiVersion || !plugin->probe ||
      !plugin->create || !plugin->options) {
    entry.error = BackendUnavailableError(
        "the " + name + " backend plugin at " + path + " has no compatible entry point (ABI " +
        std::to_string(BackendPlugin::kAbiVersion) + ", found " +
        (plugin ? "ABI " + std::to_string(plugin->abi_version) : fn.status().message()) + ")");
    return entry;
  }
  if (Status keys = ReadOptionKeys(*plugin, name, &entry.options); !keys.ok()) {
    entry.options.clear();
    entry.error = keys;
    return entry;
  }
  entry.plugin = plugin;
  return entry;
}

// The keys `name` accepts, or why they cannot be known.
Result<std::vector<std::string>> AcceptedKeys(std::string_view name) {
  if (name == "loopback") {
    std::vector<std::string> keys(std::begin(detail::kLoopbackOptionKeys),
                                  std::end(detail::kLoopbackOptionKeys));
    std::ranges::sort(keys);
    return keys;
  }
  if (!IsPluginBackend(name)) {
    return NotFoundError("unknown backend '" + std::string(name) +
                         "' (known: loopback, ucx, mori)");
  }
  const LoadedPlugin& loaded = LoadPlugin(std::string(name));
  if (!loaded.plugin) return loaded.error;
  return loaded.options;
}

// Whether some other backend accepts the unprefixed key (a shared key listed by another backend
// counts; an unloadable plugin's shared keys are given the benefit of the doubt, since its list
// cannot be read and the connector passes them to every backend).
bool OtherBackendMayAccept(std::string_view name, std::string_view key) {
  if (!IsSharedKey(key)) return false;
  for (const char* other : kAllBackends) {
    if (other == name) continue;
    Result<std::vector<std::string>> keys = AcceptedKeys(other);
    if (!keys.ok() || std::ranges::binary_search(*keys, key)) return true;
  }
  return false;
}

// InvalidArgument for the first key `name` refuses (see BackendOptions).
Status CheckOptionKeys(std::string_view name, const std::vector<std::string>& accepted,
                       const BackendOptions& options) {
  for (const auto& [key, value] : options) {
    if (std::ranges::binary_search(accepted, key)) continue;
    const std::string_view owner = PrefixOwner(key);
    if (!owner.empty() && owner != name) continue;  // another backend's key: the map is shared
    if (owner.empty() && OtherBackendMayAccept(name, key)) continue;
    std::string known;
    for (const std::string& k : accepted) known += (known.empty() ? "" : ", ") + k;
    return InvalidArgumentError("unknown option '" + key + "' for backend " + std::string(name) +
                                "; known: " + (known.empty() ? "none" : known));
  }
  return Status::OK();
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

Result<std::vector<std::string>> BackendOptionKeys(std::string_view name) {
  return AcceptedKeys(name);
}

Result<std::unique_ptr<Backend>> CreateBackend(std::string_view name, const BackendOptions& options,
                                               std::shared_ptr<CompletionSink> sink) {
  MORIIO_ASSIGN_OR_RETURN(std::vector<std::string> accepted, AcceptedKeys(name));
  MORIIO_RETURN_IF_ERROR(CheckOptionKeys(name, accepted, options));
  if (name == "loopback") return detail::CreateLoopbackBackend(options, std::move(sink));
  const LoadedPlugin& loaded = LoadPlugin(std::string(name));
  MORIIO_RETURN_IF_ERROR(loaded.plugin->probe(options));
  return loaded.plugin->create(options, std::move(sink));
}

}  // namespace moriio_native
