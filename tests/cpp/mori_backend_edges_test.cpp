// A review (2026-12-07) of the MoRI backend's mapping layer (cpp/backends/mori/mori_backend.cpp)
// against the backend contract, with the fake MoRI of fake_mori.hpp. Each test failed on the code
// it was written against.

#include <gtest/gtest.h>

#include <chrono>
#include <condition_variable>
#include <cstdlib>
#include <map>
#include <mutex>
#include <string>
#include <vector>

#include "backend_test_support.hpp"
#include "backends/mori/mori_api.hpp"
#include "backends/mori/mori_backend.hpp"
#include "fake_mori.hpp"

namespace {

using namespace moriio_native;             // NOLINT(google-build-using-namespace)
using namespace moriio_native::fake_mori;  // NOLINT(google-build-using-namespace)
namespace mb = moriio_native::detail::mori_backend;
using moriio_native::testing_support::MakeBatch;

class HookSink final : public CompletionSink {
 public:
  void OnBatchComplete(std::uint64_t token, Status) override { Run(token); }
  void OnBatchUnconfirmed(std::uint64_t token, Status) override { Run(token); }
  void OnPeerFailure(std::uint64_t, Status) override {}
  std::function<void(std::uint64_t)> hook;

 private:
  void Run(std::uint64_t token) {
    if (hook) hook(token);
  }
};

class MoriBackendEdges : public ::testing::Test {
 protected:
  static constexpr std::size_t kSize = 64 * 1024;

  struct Link {
    std::uint64_t local = 0, peer = 0, remote = 0;
  };

  // A backend with one batch (token 1) still in flight when it is destroyed (MoRI never finishes
  // it); `hook` runs inside each completion the destructor reports.
  void DestroyWithOneBatchInFlight(const std::function<void(Backend*, const Link&)>& hook) {
    auto world = std::make_shared<World>();
    world->auto_complete = false;
    auto sink = std::make_shared<HookSink>();
    mb::MoriOptions options;
    options.drain_timeout = std::chrono::milliseconds(20);
    auto made = mb::CreateMoriBackendWithApi(std::make_unique<FakeMoriApi>(world, "A"), options,
                                             sink);
    ASSERT_TRUE(made.ok());
    std::unique_ptr<Backend> backend = std::move(*made);
    auto local = backend->RegisterMemory(local_buf_.range(0, kSize));
    auto peer = backend->ConnectPeer(EngineBlob("B"));
    ASSERT_TRUE(local.ok() && peer.ok());
    mb::MoriMemory m{"B", 3, peer_buf_.addr(), kSize, MemoryKind::kHost, -1, {}};
    auto remote = backend->ImportRemoteRegion(*peer, peer_buf_.range(0, kSize), MemBlob(m));
    ASSERT_TRUE(remote.ok());
    const Link link{local->handle, *peer, *remote};
    Backend* raw = backend.get();
    sink->hook = [&, raw](std::uint64_t token) {
      if (token == 1) hook(raw, link);
    };
    ASSERT_TRUE(backend
                    ->Submit(MakeBatch(TransferOp::kRead, link.local, link.peer, link.remote,
                                       {0}, {0}, {64}, 1))
                    .ok());
    ASSERT_TRUE(world->WaitPosts(1));
    backend.reset();  // reports batch 1 Aborted after MoRI (the API) is gone
  }

  PageAlignedBuffer local_buf_{kSize, 11};
  PageAlignedBuffer peer_buf_{kSize, 99};
};

// mori_backend.hpp: "Every sink call comes from the polling thread, or from the destructor for
// batches still open then (after MoRI is stopped), so the sink may call back into the backend --
// but must not destroy it." ~MoriBackend resets api_ and then reports; only DeregisterMemory
// checks for the missing API (fixed earlier). A sink that reacts to an aborted batch by dropping
// its peer (DisconnectPeer) dereferences the null api_ (DestroySession, DeregisterRemoteEngine).
TEST_F(MoriBackendEdges, DisconnectPeerFromADestructorCompletionIsSafeOnceMoriIsGone) {
  GTEST_FLAG_SET(death_test_style, "threadsafe");
  EXPECT_EXIT(
      {
        DestroyWithOneBatchInFlight(
            [](Backend* b, const Link& link) { (void)b->DisconnectPeer(link.peer); });
        std::exit(0);
      },
      ::testing::ExitedWithCode(0), "")
      << "DisconnectPeer from a completion reported by ~MoriBackend crashed";
}

// The same for the other calls that reach the MoRI API: each should fail cleanly (the backend is
// shutting down), not crash.
TEST_F(MoriBackendEdges, RegisterAndAddressCallsFromADestructorCompletionAreSafeOnceMoriIsGone) {
  GTEST_FLAG_SET(death_test_style, "threadsafe");
  EXPECT_EXIT(
      {
        DestroyWithOneBatchInFlight([this](Backend* b, const Link&) {
          (void)b->LocalAddress();
          (void)b->RegisterMemory(peer_buf_.range(0, 4096));
          (void)b->ConnectPeer(EngineBlob("C"));
        });
        std::exit(0);
      },
      ::testing::ExitedWithCode(0), "")
      << "LocalAddress/RegisterMemory/ConnectPeer from a completion reported by ~MoriBackend "
         "crashed";
}


// RegisterMemory refuses a second MoRI registration at the start of an existing one (MoRI keys
// its NIC registrations by start address: the second leaks an MR, and deregistering either
// frees the first's), but the same-start check sits after `continue` for a registration of
// another kind or device: the same address registered again as ROCm memory of another device
// (or as host memory) reaches MoRI as a second registration at that start.
TEST_F(MoriBackendEdges, SecondRegistrationAtTheSameStartIsRefusedWhateverItsDevice) {
  auto world = std::make_shared<World>();
  auto sink = std::make_shared<HookSink>();
  auto made =
      mb::CreateMoriBackendWithApi(std::make_unique<FakeMoriApi>(world, "A"), {}, sink);
  ASSERT_TRUE(made.ok());
  std::unique_ptr<Backend> backend = std::move(*made);
  const std::uint64_t start = local_buf_.addr();
  auto first = backend->RegisterMemory({start, 4096, MemoryKind::kRocm, 0});
  ASSERT_TRUE(first.ok()) << first.status().ToString();
  auto second = backend->RegisterMemory({start, 8192, MemoryKind::kRocm, 1});
  std::size_t calls = 0;
  {
    std::lock_guard lock(world->mu);
    calls = world->register_calls.size();
  }
  EXPECT_FALSE(second.ok()) << "a second MoRI registration at " << start << " was made";
  EXPECT_EQ(calls, 1u) << "MoRI was asked to register the same start address twice";
}

}  // namespace
