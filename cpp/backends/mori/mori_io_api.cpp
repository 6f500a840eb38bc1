// The MoriApi implemented on MoRI-IO's C++ API (mori/io/io.hpp), and the plugin entry point.
// With mori_codec.hpp the only code that includes MoRI headers. Every MoRI call is wrapped: MoRI
// reports setup failures by throwing, and nothing may throw across our API.

#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <cstdlib>
#include <exception>
#include <map>
#include <memory>
#include <string>

#include "backends/mori/mori_api.hpp"
#include "backends/mori/mori_backend.hpp"
#include "backends/mori/mori_codec.hpp"
#include "dynamic_library.hpp"
#include "mori/io/io.hpp"
#include "moriio_native/backend.hpp"

namespace moriio_native::detail::mori_backend {
namespace {

using codec::CurrentExceptionMessage;
using codec::Pack;
using codec::ReasonName;
using codec::ToMoriMemory;
using codec::Unpack;
namespace mio = ::mori::io;

// The address of the interface that routes off this host: connecting a UDP socket sends nothing
// but makes the kernel pick the source address. Peers on other nodes dial this.
std::string DefaultHost() {
  const int fd = ::socket(AF_INET, SOCK_DGRAM, 0);
  if (fd < 0) return "127.0.0.1";
  sockaddr_in probe{};
  probe.sin_family = AF_INET;
  probe.sin_port = htons(9);
  ::inet_pton(AF_INET, "192.0.2.1", &probe.sin_addr);  // TEST-NET-1: never answered
  std::string host = "127.0.0.1";
  if (::connect(fd, reinterpret_cast<const sockaddr*>(&probe), sizeof(probe)) == 0) {
    sockaddr_in local{};
    socklen_t len = sizeof(local);
    char text[INET_ADDRSTRLEN] = {};
    if (::getsockname(fd, reinterpret_cast<sockaddr*>(&local), &len) == 0 &&
        ::inet_ntop(AF_INET, &local.sin_addr, text, sizeof(text)) != nullptr) {
      host = text;
    }
  }
  ::close(fd);
  return host;
}

// MoRI caches QPs and remote MRs per engine key, so a restarted process must never reuse one.
std::string MakeEngineKey(const std::string& prefix) {
  static std::atomic<std::uint64_t> counter{0};
  char hostname[256] = {};
  if (::gethostname(hostname, sizeof(hostname) - 1) != 0) hostname[0] = '\0';
  const auto now = std::chrono::system_clock::now().time_since_epoch();
  return prefix + "@" + hostname + ":" + std::to_string(::getpid()) + ":" +
         std::to_string(counter.fetch_add(1)) + ":" +
         std::to_string(std::chrono::duration_cast<std::chrono::microseconds>(now).count());
}

class RealStatus final : public MoriTransferStatus {
 public:
  std::uint32_t Code() override { return static_cast<std::uint32_t>(status.Code()); }
  std::string Message() override { return status.Message(); }
  std::uint32_t WaitFor(int timeout_ms) override {
    return static_cast<std::uint32_t>(status.WaitFor(timeout_ms));
  }
  void Reset() override {
    // An XGMI transfer installs callbacks that refer to its own stream/event state.
    status.SetWaitCallback(nullptr);
    status.SetProgressCallback(nullptr);
    status.SetMessage("");
    status.SetCode(mio::StatusCode::INIT);
  }
  mio::TransferStatus status;  // non-movable; MoRI holds its address while the batch runs
};

// Opens a library already mapped as our dependency (RTLD_NOLOAD finds it), else maps it.
Result<DynamicLibrary> OpenLibrary(const std::string& name) {
  Result<DynamicLibrary> mapped = DynamicLibrary::Open(name, RTLD_NOW | RTLD_LOCAL | RTLD_NOLOAD);
  return mapped.ok() ? std::move(mapped) : DynamicLibrary::Open(name);
}

// hipError_t values of hip_runtime_api.h that EventCompleted tells apart.
constexpr int kHipSuccess = 0;
constexpr int kHipErrorNotReady = 600;
using HipEventQuery = int (*)(void*);  // hipError_t hipEventQuery(hipEvent_t)

class MoriIoApi final : public MoriApi {
 public:
  static Result<std::unique_ptr<MoriApi>> Create(const MoriOptions& o) {
    auto api = std::unique_ptr<MoriIoApi>(new MoriIoApi(MakeEngineKey(o.engine_key_prefix)));
    Result<DynamicLibrary> hip = OpenLibrary("libamdhip64.so.7");
    Result<HipEventQuery> query = hip.ok() ? hip->Symbol<HipEventQuery>("hipEventQuery")
                                           : Result<HipEventQuery>(hip.status());
    if (!query.ok()) {
      return BackendUnavailableError("MoRI-IO's backend needs HIP's hipEventQuery: " +
                                     query.status().message());
    }
    hip->KeepLoaded();  // MoRI itself runs on it until the process exits
    api->event_query_ = *query;
    const std::string host = o.host.empty() ? DefaultHost() : o.host;
    try {
      api->engine_ = std::make_unique<mio::IOEngine>(api->key_, mio::IOEngineConfig{host, o.port});
    } catch (...) {
      return BackendUnavailableError("MoRI-IO could not create an engine on " + host + ":" +
                                     std::to_string(o.port) + ": " + CurrentExceptionMessage());
    }
    try {
      if (o.transport == MoriTransport::kRdma) {
        // Notifications stay off: completion reaches the target through our control plane, and
        // MoRI's notification path can exhaust the send queue under load.
        mio::RdmaBackendConfig config(
            o.qp_per_transfer, o.post_batch_size, o.num_workers,
            o.event_poll ? mio::PollCqMode::EVENT : mio::PollCqMode::POLLING,
            /*enableNotification_=*/false);
        config.enableTransferChunking = o.enable_chunking;
        config.chunkBytes = o.chunk_bytes;
        api->engine_->CreateBackend(mio::BackendType::RDMA, config);
      } else {
        mio::XgmiBackendConfig config(o.xgmi_streams, o.xgmi_events);
        api->engine_->CreateBackend(mio::BackendType::XGMI, config);
        if (!o.xgmi_kernel.empty()) api->engine_->LoadScatterGatherModule(o.xgmi_kernel);
      }
    } catch (...) {
      const bool rdma = o.transport == MoriTransport::kRdma;
      return BackendUnavailableError(
          std::string("MoRI-IO could not create its ") + (rdma ? "RDMA" : "XGMI") +
          " transport: " + CurrentExceptionMessage() +
          (rdma ? " (no active RDMA NIC? mori_backend=xgmi moves GPU memory within one node)"
                : ""));
    }
    return std::unique_ptr<MoriApi>(std::move(api));
  }

  ~MoriIoApi() override {
    // Sessions and registrations first, then the engine, whose destructor stops MoRI's threads:
    // after that nothing writes to any TransferStatus the mapping layer still holds.
    sessions_.clear();
    for (auto& [id, desc] : locals_) {
      try {
        engine_->DeregisterMemory(desc);
      } catch (...) {
      }
    }
    locals_.clear();
    engine_.reset();
  }

  const std::string& engine_key() const override { return key_; }

  Result<std::vector<std::uint8_t>> EngineDesc() override {
    try {
      return Pack(engine_->GetEngineDesc());
    } catch (...) {
      return InternalError("packing MoRI's EngineDesc failed: " + CurrentExceptionMessage());
    }
  }

  Result<MoriMemory> RegisterMemory(const MemoryRange& range) override {
    const bool gpu = range.kind == MemoryKind::kRocm;
    try {
      // MoRI only records the region here; the NIC registration happens with the first session
      // that uses it (MoRI aborts the process if the NIC refuses it there).
      mio::MemoryDesc desc = engine_->RegisterMemory(
          reinterpret_cast<void*>(range.address), range.size, gpu ? range.device : -1,
          gpu ? mio::MemoryLocationType::GPU : mio::MemoryLocationType::CPU);
      auto mem = ToMoriMemory(desc, Pack(desc));
      if (!mem.ok()) {
        engine_->DeregisterMemory(desc);
        return mem.status();
      }
      locals_[desc.id] = desc;
      return mem;
    } catch (...) {
      return TransportError("MoRI-IO could not register " + std::to_string(range.size) +
                            " bytes at " + std::to_string(range.address) + ": " +
                            CurrentExceptionMessage());
    }
  }

  Status DeregisterMemory(std::uint32_t id) override {
    auto it = locals_.find(id);
    if (it == locals_.end()) return NotFoundError("no MoRI memory " + std::to_string(id));
    try {
      engine_->DeregisterMemory(it->second);
    } catch (...) {
      locals_.erase(it);
      return TransportError("MoRI-IO could not deregister memory " + std::to_string(id) + ": " +
                            CurrentExceptionMessage());
    }
    locals_.erase(it);
    return Status::OK();
  }

  Result<std::string> EngineKeyOf(std::span<const std::uint8_t> engine_desc) override {
    return codec::DecodeEngineKey(engine_desc);
  }

  Status RegisterRemoteEngine(std::span<const std::uint8_t> engine_desc) override {
    MORIIO_ASSIGN_OR_RETURN(mio::EngineDesc desc,
                            Unpack<mio::EngineDesc>(engine_desc, "EngineDesc (peer address)"));
    try {
      engine_->RegisterRemoteEngine(desc);
    } catch (...) {
      return TransportError("MoRI-IO could not register peer '" + desc.key + "' (" + desc.host +
                            ":" + std::to_string(desc.port) + "): " + CurrentExceptionMessage());
    }
    remotes_[desc.key] = desc;
    return Status::OK();
  }

  Status DeregisterRemoteEngine(const std::string& engine_key) override {
    auto it = remotes_.find(engine_key);
    if (it == remotes_.end()) return NotFoundError("no MoRI peer '" + engine_key + "'");
    mio::EngineDesc desc = it->second;
    remotes_.erase(it);
    try {
      engine_->DeregisterRemoteEngine(desc);
    } catch (...) {
      return TransportError("MoRI-IO could not deregister peer '" + engine_key +
                            "': " + CurrentExceptionMessage());
    }
    return Status::OK();
  }

  Result<MoriMemory> ParseMemoryDesc(std::span<const std::uint8_t> memory_desc) override {
    return codec::DecodeMemory(memory_desc);
  }

  Result<std::uint64_t> CreateSession(std::uint32_t local_id, const MoriMemory& remote) override {
    auto local = locals_.find(local_id);
    if (local == locals_.end()) return NotFoundError("no MoRI memory " + std::to_string(local_id));
    MORIIO_ASSIGN_OR_RETURN(mio::MemoryDesc remote_desc,
                            Unpack<mio::MemoryDesc>(remote.desc, "MemoryDesc (remote key)"));
    try {
      std::optional<mio::IOEngineSession> session =
          engine_->CreateSession(local->second, remote_desc);
      if (!session) {
        return TransportError("MoRI-IO has no transport between local memory " +
                              std::to_string(local_id) + " and memory " +
                              std::to_string(remote.id) + " of peer '" + remote.engine_key + "'");
      }
      const std::uint64_t id = next_session_++;
      sessions_.emplace(id, *session);
      return id;
    } catch (...) {
      return TransportError("MoRI-IO could not open a session from local memory " +
                            std::to_string(local_id) + " to memory " + std::to_string(remote.id) +
                            " of peer '" + remote.engine_key + "': " + CurrentExceptionMessage());
    }
  }

  void DestroySession(std::uint64_t session) override { sessions_.erase(session); }

  std::unique_ptr<MoriTransferStatus> NewStatus() override {
    return std::make_unique<RealStatus>();
  }

  Status PostBatch(std::uint64_t session, TransferOp op,
                   const std::vector<std::size_t>& local_offsets,
                   const std::vector<std::size_t>& remote_offsets,
                   const std::vector<std::size_t>& sizes, MoriTransferStatus* status) override {
    auto it = sessions_.find(session);
    if (it == sessions_.end()) return NotFoundError("no MoRI session " + std::to_string(session));
    auto* real = dynamic_cast<RealStatus*>(status);
    if (real == nullptr) return InternalError("status not made by this MoRI API");
    // In progress from the start, so a poller never mistakes a not-yet-touched status for done.
    real->status.SetCode(mio::StatusCode::IN_PROGRESS);
    try {
      mio::IOEngineSession& s = it->second;
      const mio::TransferUniqueId id = s.AllocateTransferUniqueId();
      if (op == TransferOp::kRead) {
        s.BatchRead(local_offsets, remote_offsets, sizes, &real->status, id);
      } else {
        s.BatchWrite(local_offsets, remote_offsets, sizes, &real->status, id);
      }
    } catch (...) {
      return TransportError(CurrentExceptionMessage());
    }
    return Status::OK();
  }

  std::optional<MoriPeerFailure> PopPeerFailure() override {
    try {
      mio::PeerFailureEvent event;
      if (!engine_->PopPeerFailure(&event)) return std::nullopt;
      return MoriPeerFailure{event.remoteEngineKey, ReasonName(event.reason), event.deviceName,
                             event.detail};
    } catch (...) {
      return std::nullopt;
    }
  }

  Result<bool> EventCompleted(std::uint64_t event) override {
    const int rc = event_query_(reinterpret_cast<void*>(event));
    if (rc == kHipSuccess) return true;
    if (rc == kHipErrorNotReady) return false;
    return TransportError("hipEventQuery of event " + std::to_string(event) +
                          " failed with HIP error " + std::to_string(rc));
  }

 private:
  explicit MoriIoApi(std::string key) : key_(std::move(key)) {}

  const std::string key_;
  HipEventQuery event_query_ = nullptr;
  std::unique_ptr<mio::IOEngine> engine_;
  std::map<std::uint32_t, mio::MemoryDesc> locals_;
  std::map<std::string, mio::EngineDesc> remotes_;
  std::map<std::uint64_t, mio::IOEngineSession> sessions_;
  std::uint64_t next_session_ = 1;
};

// ---- probe: find out, without letting MoRI exit the process, whether MoRI can run here -------

Status ProbeGpu() {
  Result<DynamicLibrary> hip = OpenLibrary("libamdhip64.so.7");
  if (!hip.ok()) {
    return BackendUnavailableError("MoRI-IO needs ROCm 7's HIP runtime: " + hip.status().message());
  }
  using GetDeviceCount = int (*)(int*);  // hipError_t hipGetDeviceCount(int*)
  Result<GetDeviceCount> get_count = hip->Symbol<GetDeviceCount>("hipGetDeviceCount");
  int count = 0;
  const int rc = get_count.ok() ? (*get_count)(&count) : -1;
  if (rc != 0 || count <= 0) {
    return BackendUnavailableError(
        "MoRI-IO needs an AMD GPU and HIP sees none (hipGetDeviceCount "
        "returned " +
        std::to_string(rc) + ", " + std::to_string(count) + " devices)");
  }
  // MoRI's topology scan calls exit() when it cannot load ROCm SMI: refuse before that happens.
  std::vector<std::string> candidates;
  if (const char* path = std::getenv("MORI_ROCM_SMI_PATH"); path && *path) {
    candidates.emplace_back(path);
  }
  candidates.insert(candidates.end(),
                    {"librocm_smi64.so.1", "/opt/rocm/lib/librocm_smi64.so.1", "librocm_smi64.so"});
  std::string smi_error;
  for (const auto& candidate : candidates) {
    Result<DynamicLibrary> smi = OpenLibrary(candidate);
    if (smi.ok()) return Status::OK();
    smi_error += (smi_error.empty() ? "" : "; ") + smi.status().message();
  }
  return BackendUnavailableError(
      "MoRI-IO needs ROCm SMI (librocm_smi64.so.1) and exits the "
      "process without it: " +
      smi_error);
}

Status ProbeRdma() {
  Result<DynamicLibrary> verbs = OpenLibrary("libibverbs.so.1");
  if (!verbs.ok()) {
    return BackendUnavailableError("MoRI's RDMA transport needs libibverbs: " +
                                   verbs.status().message() +
                                   " (mori_backend=xgmi moves GPU memory within one node)");
  }
  using GetDeviceList = void** (*)(int*);
  using FreeDeviceList = void (*)(void**);
  Result<GetDeviceList> get_list = verbs->Symbol<GetDeviceList>("ibv_get_device_list");
  Result<FreeDeviceList> free_list = verbs->Symbol<FreeDeviceList>("ibv_free_device_list");
  int count = 0;
  if (get_list.ok() && free_list.ok()) {
    if (void** list = (*get_list)(&count)) (*free_list)(list);
  }
  if (count <= 0) {
    return BackendUnavailableError(
        "MoRI's RDMA transport needs an RDMA device and libibverbs "
        "lists none (mori_backend=xgmi moves GPU memory within one "
        "node)");
  }
  return Status::OK();
}

Status Probe(const BackendOptions& options) {
  MORIIO_ASSIGN_OR_RETURN(MoriOptions o, ParseMoriOptions(options));
  MORIIO_RETURN_IF_ERROR(ProbeGpu());
  if (o.transport == MoriTransport::kRdma) MORIIO_RETURN_IF_ERROR(ProbeRdma());
  return Status::OK();
}

Result<std::unique_ptr<Backend>> Create(const BackendOptions& options,
                                        std::shared_ptr<CompletionSink> sink) {
  MORIIO_ASSIGN_OR_RETURN(MoriOptions o, ParseMoriOptions(options));
  MORIIO_RETURN_IF_ERROR(Probe(options));
  MORIIO_ASSIGN_OR_RETURN(std::unique_ptr<MoriApi> api, MoriIoApi::Create(o));
  return CreateMoriBackendWithApi(std::move(api), o, std::move(sink));
}

}  // namespace
}  // namespace moriio_native::detail::mori_backend

/// The plugin's only exported symbol (see moriio_native::BackendPlugin).
extern "C" __attribute__((visibility("default"))) const moriio_native::BackendPlugin*
moriio_native_backend_plugin() {
  static const moriio_native::BackendPlugin plugin{
      .abi_version = moriio_native::BackendPlugin::kAbiVersion,
      .name = "mori",
      .probe = &moriio_native::detail::mori_backend::Probe,
      .create = &moriio_native::detail::mori_backend::Create,
      .options = moriio_native::detail::mori_backend::kMoriOptionKeys,
  };
  return &plugin;
}
