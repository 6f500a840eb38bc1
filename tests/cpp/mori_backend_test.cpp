// The MoRI backend plugin end to end, through the core's plugin loader: two backends (two MoRI
// engines) in one process register memory, exchange addresses and remote keys, and move bytes
// with batched READ and WRITE that are then verified. Needs a ROCm GPU, ROCm 7 and an RDMA NIC
// (ctest label `rocm`); elsewhere each case skips itself and prints why MoRI cannot run.

#include <dlfcn.h>
#include <gtest/gtest.h>

#include <chrono>
#include <condition_variable>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "moriio_native/backend.hpp"

namespace {

using namespace moriio_native;  // NOLINT(google-build-using-namespace)

constexpr auto kWait = std::chrono::seconds(60);  // a hang guard, not a timing assert
constexpr std::size_t kSize = 4 << 20;

// Loopback control plane so the test needs no routable address; data goes over the NIC.
BackendOptions Options() {
  BackendOptions o{{"mori_backend", "rdma"}, {"mori_host", "127.0.0.1"}, {"qp_per_transfer", "2"}};
  if (const char* extra = std::getenv("MORIIO_TEST_MORI_BACKEND"); extra && *extra) {
    o["mori_backend"] = extra;
  }
  return o;
}

// Why MoRI cannot run here, or "" when it can.
std::string WhyUnavailable() {
  for (const auto& b : AvailableBackends(Options())) {
    if (b.name == "mori") return b.available ? "" : b.reason;
  }
  return "the core does not know a 'mori' backend";
}

#define SKIP_WITHOUT_MORI()                                               \
  do {                                                                    \
    const std::string why = WhyUnavailable();                             \
    if (!why.empty()) GTEST_SKIP() << "MoRI-IO cannot run here: " << why; \
  } while (false)

class Sink final : public CompletionSink {
 public:
  void OnBatchComplete(std::uint64_t token, Status status) override {
    std::lock_guard lock(mu_);
    done_[token].push_back(std::move(status));
    cv_.notify_all();
  }
  void OnPeerFailure(std::uint64_t, Status status) override {
    ADD_FAILURE() << "unexpected peer failure: " << status.ToString();
  }
  Status Await(std::uint64_t token) {
    std::unique_lock lock(mu_);
    if (!cv_.wait_for(lock, kWait, [&] { return done_.count(token) > 0; })) {
      return TimeoutError("no completion for batch " + std::to_string(token));
    }
    EXPECT_EQ(done_[token].size(), 1u);
    return done_[token].front();
  }

 private:
  std::mutex mu_;
  std::condition_variable cv_;
  std::map<std::uint64_t, std::vector<Status>> done_;
};

// HIP through dlopen: the test binary links only the core, like every other test here.
struct Hip {
  int (*set_device)(int) = nullptr;
  int (*alloc)(void**, std::size_t) = nullptr;
  int (*release)(void*) = nullptr;
  int (*copy)(void*, const void*, std::size_t, int) = nullptr;  // kind: 1 = H2D, 2 = D2H
  int (*get_device_count)(int*) = nullptr;

  static Hip* Get() {
    static Hip* hip = [] {
      void* lib = ::dlopen("libamdhip64.so.7", RTLD_NOW | RTLD_LOCAL);
      if (!lib) return static_cast<Hip*>(nullptr);
      auto* h = new Hip();
      h->set_device = reinterpret_cast<int (*)(int)>(::dlsym(lib, "hipSetDevice"));
      h->alloc = reinterpret_cast<int (*)(void**, std::size_t)>(::dlsym(lib, "hipMalloc"));
      h->release = reinterpret_cast<int (*)(void*)>(::dlsym(lib, "hipFree"));
      h->copy = reinterpret_cast<int (*)(void*, const void*, std::size_t, int)>(
          ::dlsym(lib, "hipMemcpy"));
      h->get_device_count = reinterpret_cast<int (*)(int*)>(::dlsym(lib, "hipGetDeviceCount"));
      const bool ok = h->set_device && h->alloc && h->release && h->copy && h->get_device_count;
      return ok ? h : static_cast<Hip*>(nullptr);
    }();
    return hip;
  }
};

// A region a backend registers: page-aligned host memory, or device memory on one GPU with a
// host mirror for filling and checking.
class Region {
 public:
  Region(MemoryKind kind, int device, std::uint8_t seed) : kind_(kind), device_(device) {
    host_.reset(static_cast<std::uint8_t*>(std::aligned_alloc(4096, kSize)));
    for (std::size_t i = 0; i < kSize; ++i)
      host_[i] = static_cast<std::uint8_t>(seed + i * 13 + i / 509);
    if (kind == MemoryKind::kRocm) {
      Hip* hip = Hip::Get();
      EXPECT_EQ(hip->set_device(device), 0);
      EXPECT_EQ(hip->alloc(&device_ptr_, kSize), 0);  // hipMalloc bases are page aligned
      Upload();
    }
  }
  ~Region() {
    if (device_ptr_) Hip::Get()->release(device_ptr_);
  }
  MemoryRange range() const {
    const auto addr = reinterpret_cast<std::uint64_t>(device_ptr_ ? device_ptr_ : host_.get());
    return {addr, kSize, kind_, kind_ == MemoryKind::kRocm ? device_ : -1};
  }
  void Upload() {
    if (device_ptr_) {
      EXPECT_EQ(Hip::Get()->copy(device_ptr_, host_.get(), kSize, 1), 0);
    }
  }
  // The bytes as they are now (device memory copied back).
  const std::uint8_t* Bytes() {
    if (device_ptr_) {
      EXPECT_EQ(Hip::Get()->copy(host_.get(), device_ptr_, kSize, 2), 0);
    }
    return host_.get();
  }

 private:
  struct Free {
    void operator()(std::uint8_t* p) const { std::free(p); }
  };
  MemoryKind kind_;
  int device_;
  std::unique_ptr<std::uint8_t[], Free> host_;
  void* device_ptr_ = nullptr;
};

struct Side {
  std::shared_ptr<Sink> sink = std::make_shared<Sink>();
  std::unique_ptr<Backend> backend;
  RegisteredRegion region;
};

// register -> exchange addresses and keys -> import -> READ then WRITE -> verify.
void RoundTrip(MemoryKind kind, int device_a, int device_b) {
  Side a, b;
  auto ba = CreateBackend("mori", Options(), a.sink);
  auto bb = CreateBackend("mori", Options(), b.sink);
  ASSERT_TRUE(ba.ok()) << ba.status().ToString();
  ASSERT_TRUE(bb.ok()) << bb.status().ToString();
  a.backend = std::move(*ba);
  b.backend = std::move(*bb);
  if (kind == MemoryKind::kHost) {
    ASSERT_TRUE(a.backend->capabilities().host_memory);
  }
  Region mem_a(kind, device_a, 1), mem_b(kind, device_b, 77);
  auto ra = a.backend->RegisterMemory(mem_a.range());
  auto rb = b.backend->RegisterMemory(mem_b.range());
  ASSERT_TRUE(ra.ok()) << ra.status().ToString();
  ASSERT_TRUE(rb.ok()) << rb.status().ToString();

  // The handshake: each side's address and remote key travel as opaque bytes.
  auto addr_b = b.backend->LocalAddress();
  ASSERT_TRUE(addr_b.ok()) << addr_b.status().ToString();
  auto addr_a = a.backend->LocalAddress();
  ASSERT_TRUE(addr_a.ok()) << addr_a.status().ToString();
  auto peer_b = a.backend->ConnectPeer(*addr_b);
  ASSERT_TRUE(peer_b.ok()) << peer_b.status().ToString();
  auto peer_a = b.backend->ConnectPeer(*addr_a);
  ASSERT_TRUE(peer_a.ok()) << peer_a.status().ToString();
  auto remote_b = a.backend->ImportRemoteRegion(*peer_b, mem_b.range(), rb->remote_key);
  ASSERT_TRUE(remote_b.ok()) << remote_b.status().ToString();

  const std::vector<std::uint8_t> b_before(mem_b.Bytes(), mem_b.Bytes() + kSize);

  // READ: a pulls three runs of b (one a whole MiB, one crossing a page, one tiny).
  auto read = std::make_shared<Batch>();
  read->op = TransferOp::kRead;
  read->local_region = ra->handle;
  read->peer = *peer_b;
  read->remote_region = *remote_b;
  read->local_offsets = {0, 1 << 20, 3 << 20};
  read->remote_offsets = {2 << 20, 4096 - 100, 12345};
  read->sizes = {1 << 20, 8192, 17};
  read->token = 1;
  ASSERT_TRUE(a.backend->Submit(read).ok());
  Status read_done = a.sink->Await(1);
  ASSERT_TRUE(read_done.ok()) << read_done.ToString();
  const std::uint8_t* got = mem_a.Bytes();
  for (std::size_t i = 0; i < read->sizes.size(); ++i) {
    EXPECT_EQ(std::memcmp(got + read->local_offsets[i], b_before.data() + read->remote_offsets[i],
                          read->sizes[i]),
              0)
        << "READ run " << i;
  }

  // WRITE: a pushes two runs into b; nothing else of b changes.
  auto write = std::make_shared<Batch>();
  write->op = TransferOp::kWrite;
  write->local_region = ra->handle;
  write->peer = *peer_b;
  write->remote_region = *remote_b;
  write->local_offsets = {64, 2 << 20};
  write->remote_offsets = {0, 3 << 20};
  write->sizes = {4096, 65536};
  write->token = 2;
  const std::vector<std::uint8_t> a_now(mem_a.Bytes(), mem_a.Bytes() + kSize);
  ASSERT_TRUE(a.backend->Submit(write).ok());
  Status write_done = a.sink->Await(2);
  ASSERT_TRUE(write_done.ok()) << write_done.ToString();
  std::vector<std::uint8_t> expected = b_before;
  for (std::size_t i = 0; i < write->sizes.size(); ++i) {
    std::memcpy(expected.data() + write->remote_offsets[i], a_now.data() + write->local_offsets[i],
                write->sizes[i]);
  }
  EXPECT_EQ(std::memcmp(mem_b.Bytes(), expected.data(), kSize), 0) << "WRITE result differs";

  // Out-of-range runs never reach MoRI.
  auto bad = std::make_shared<Batch>(*write);
  bad->token = 3;
  bad->remote_offsets = {kSize - 10, 0};
  EXPECT_EQ(a.backend->Submit(bad).code(), StatusCode::kOutOfRange);

  EXPECT_TRUE(a.backend->DisconnectPeer(*peer_b).ok());
  EXPECT_TRUE(b.backend->DisconnectPeer(*peer_a).ok());
  EXPECT_TRUE(a.backend->DeregisterMemory(ra->handle).ok());
  EXPECT_TRUE(b.backend->DeregisterMemory(rb->handle).ok());
}

TEST(MoriBackend, AvailabilityAgreesWithCreate) {
  const std::string why = WhyUnavailable();
  auto backend = CreateBackend("mori", Options(), std::make_shared<Sink>());
  if (why.empty()) {
    EXPECT_TRUE(backend.ok()) << backend.status().ToString();
  } else {
    ASSERT_FALSE(backend.ok());
    EXPECT_EQ(backend.status().code(), StatusCode::kBackendUnavailable);
    EXPECT_EQ(backend.status().message(), why);
    std::printf("mori unavailable here: %s\n", why.c_str());
  }
}

TEST(MoriBackend, GpuMemoryReadWriteBetweenTwoEngines) {
  SKIP_WITHOUT_MORI();
  ASSERT_NE(Hip::Get(), nullptr) << "MoRI is available but HIP could not be loaded";
  int gpus = 0;
  ASSERT_EQ(Hip::Get()->get_device_count(&gpus), 0);
  RoundTrip(MemoryKind::kRocm, 0, gpus > 1 ? 1 : 0);
}

TEST(MoriBackend, HostMemoryReadWriteBetweenTwoEngines) {
  SKIP_WITHOUT_MORI();
  if (Options().at("mori_backend") != "rdma") GTEST_SKIP() << "XGMI moves GPU memory only";
  RoundTrip(MemoryKind::kHost, -1, -1);
}

TEST(MoriBackend, PeerAddressAndKeysAreValidatedByMori) {
  SKIP_WITHOUT_MORI();
  auto backend = CreateBackend("mori", Options(), std::make_shared<Sink>());
  ASSERT_TRUE(backend.ok()) << backend.status().ToString();
  const std::vector<std::uint8_t> junk = {0xc1, 0x00, 0xff};
  EXPECT_EQ((*backend)->ConnectPeer(junk).status().code(), StatusCode::kInvalidArgument);
  auto own = (*backend)->LocalAddress();
  ASSERT_TRUE(own.ok());
  EXPECT_EQ((*backend)->ConnectPeer(*own).status().code(), StatusCode::kInvalidArgument);
}

}  // namespace
