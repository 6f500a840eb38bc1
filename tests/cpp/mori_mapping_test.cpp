// The MoRI backend's mapping layer against a fake MoRI-IO (no ROCm needed): what reaches MoRI's
// session BatchRead/BatchWrite for a Batch (offsets per session, registration offsets, run
// splitting), that bytes land where the Batch says (the fake moves real bytes between buffers),
// how statuses and peer failures become completions, and that no TransferStatus is freed while
// MoRI could still write to it.

#include <gtest/gtest.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstring>
#include <deque>
#include <map>
#include <mutex>
#include <numeric>
#include <set>
#include <string>
#include <thread>
#include <vector>

#include "backends/mori/mori_api.hpp"
#include "backends/mori/mori_backend.hpp"
#include "backend_test_support.hpp"
#include "event_poll.hpp"
#include "fake_mori.hpp"

namespace {

using namespace moriio_native;  // NOLINT(google-build-using-namespace)
namespace mb = moriio_native::detail::mori_backend;
using namespace moriio_native::fake_mori;  // NOLINT(google-build-using-namespace)
using moriio_native::testing_support::MakeBatch;

// ---- the sink ----------------------------------------------------------------------------------

class Sink final : public CompletionSink {
 public:
  explicit Sink(std::shared_ptr<World> world) : world_(std::move(world)) {}
  void OnBatchComplete(std::uint64_t token, Status status) override {
    bool api_alive = false;
    {
      std::lock_guard lock(world_->mu);
      api_alive = world_->api_alive;
    }
    std::lock_guard lock(mu_);
    completions_[token].push_back(std::move(status));
    api_alive_at_completion_[token] = api_alive;
    cv_.notify_all();
  }
  void OnPeerFailure(std::uint64_t peer, Status status) override {
    std::lock_guard lock(mu_);
    peer_failures_.emplace_back(peer, std::move(status));
    cv_.notify_all();
  }
  // The one completion of `token` (waits for it); fails the test on a second one.
  Status Await(std::uint64_t token) {
    std::unique_lock lock(mu_);
    const bool arrived = cv_.wait_for(lock, kWait, [&] { return completions_.count(token) > 0; });
    if (!arrived) return InternalError("no completion for token " + std::to_string(token));
    EXPECT_EQ(completions_[token].size(), 1u) << "token " << token << " completed twice";
    return completions_[token].front();
  }
  bool Completed(std::uint64_t token) {
    std::lock_guard lock(mu_);
    return completions_.count(token) > 0;
  }
  std::size_t CompletionCount(std::uint64_t token) {
    std::lock_guard lock(mu_);
    return completions_.count(token) ? completions_[token].size() : 0;
  }
  bool ApiAliveAtCompletion(std::uint64_t token) {
    std::lock_guard lock(mu_);
    return api_alive_at_completion_.at(token);
  }
  std::vector<std::pair<std::uint64_t, Status>> AwaitPeerFailures(std::size_t n) {
    std::unique_lock lock(mu_);
    cv_.wait_for(lock, kWait, [&] { return peer_failures_.size() >= n; });
    return peer_failures_;
  }

 private:
  std::shared_ptr<World> world_;
  std::mutex mu_;
  std::condition_variable cv_;
  std::map<std::uint64_t, std::vector<Status>> completions_;
  std::map<std::uint64_t, bool> api_alive_at_completion_;
  std::vector<std::pair<std::uint64_t, Status>> peer_failures_;
};

// ---- fixture -----------------------------------------------------------------------------------

class MoriMappingTest : public ::testing::Test {
 protected:
  static constexpr std::size_t kSize = 64 * 1024;

  void SetUp() override {
    world_ = std::make_shared<World>();
    sink_ = std::make_shared<Sink>(world_);
  }

  void Make(mb::MoriOptions options = {}) {
    auto api = std::make_unique<FakeMoriApi>(world_, "A");
    auto backend = mb::CreateMoriBackendWithApi(std::move(api), options, sink_);
    ASSERT_TRUE(backend.ok()) << backend.status().ToString();
    backend_ = std::move(*backend);
  }

  // The peer "B" owns `peer_buf_`, registered with MoRI as one registration (id 3).
  mb::MoriMemory PeerMemory(std::uint64_t off = 0, std::uint64_t len = kSize) const {
    mb::MoriMemory m{"B", 3, peer_buf_.addr() + off, len, MemoryKind::kHost, -1, {}};
    m.desc = MemBlob(m);
    return m;
  }

  std::uint64_t Connect(const std::string& key = "B") {
    auto peer = backend_->ConnectPeer(EngineBlob(key));
    EXPECT_TRUE(peer.ok()) << peer.status().ToString();
    return peer.ok() ? *peer : 0;
  }


  // The two regions most transfer tests use: all of `local_buf_`, and all of `peer_buf_` imported
  // from peer "B".
  struct Link {
    std::uint64_t local = 0;  // handle of the local region
    std::uint64_t peer = 0;
    std::uint64_t remote = 0;  // handle of the imported region
  };

  // Registers, connects and imports them (call it inside ASSERT_NO_FATAL_FAILURE).
  void LinkWholeBuffers(Link* link) {
    auto local = backend_->RegisterMemory(local_buf_.range(0, kSize));
    const std::uint64_t peer = Connect();
    auto remote = backend_->ImportRemoteRegion(peer, peer_buf_.range(0, kSize), PeerMemory().desc);
    ASSERT_TRUE(local.ok() && remote.ok());
    *link = {local->handle, peer, *remote};
  }

  // A backend with LinkWholeBuffers' regions (`host`), and `gpu`: the same with its local region
  // in gpu_buf_ registered as ROCm memory (the fake moves host bytes all the same; not local_buf_
  // again: MoRI keys registrations by start address, whatever their kind), the regions of
  // batches that may wait for a HIP event.
  void MakeWithGpuRegion(Link* host, Link* gpu) {
    Make();
    ASSERT_NO_FATAL_FAILURE(LinkWholeBuffers(host));
    MemoryRange range = gpu_buf_.range(0, kSize);
    range.kind = MemoryKind::kRocm;
    range.device = 0;
    auto local = backend_->RegisterMemory(range);
    ASSERT_TRUE(local.ok()) << local.status().ToString();
    *gpu = {local->handle, host->peer, host->remote};
  }

  // Puts `event` in one of the fake HIP's sets (pending_events, broken_events).
  void MarkEvent(std::set<std::uint64_t> World::*events, std::uint64_t event) {
    std::lock_guard lock(world_->mu);
    ((*world_).*events).insert(event);
  }

  // A WRITE of 64 bytes at `offset` on both sides, posted after HIP event `event` (0: none).
  static std::shared_ptr<Batch> WriteWaitingFor(const Link& link, std::uint64_t event,
                                                std::int64_t offset, std::uint64_t token) {
    auto b = MakeBatch(TransferOp::kWrite, link.local, link.peer, link.remote, {offset},
                       {offset}, {64}, token);
    b->device_wait_event = event;
    return b;
  }

  // A batch of one run: the first 64 bytes of each side.
  Status SubmitOneRun(const Link& link, TransferOp op, std::uint64_t token) {
    return backend_->Submit(
        MakeBatch(op, link.local, link.peer, link.remote, {0}, {0}, {64}, token));
  }

  World::Post PostAt(std::size_t i) {
    std::lock_guard lock(world_->mu);
    return world_->posts.at(i);
  }
  std::size_t Posts() {
    std::lock_guard lock(world_->mu);
    return world_->posts.size();
  }

  std::shared_ptr<World> world_;
  std::shared_ptr<Sink> sink_;
  std::unique_ptr<Backend> backend_;
  PageAlignedBuffer local_buf_{kSize, 11};
  PageAlignedBuffer peer_buf_{kSize, 99};
  PageAlignedBuffer gpu_buf_{kSize, 55};
};

// ---- options and codes
// ---------------------------------------------------------------------------

TEST(MoriOptions, DefaultsAndEveryKey) {
  auto d = mb::ParseMoriOptions({{"ucx_tls", "tcp"}});  // other backends' keys are ignored
  ASSERT_TRUE(d.ok()) << d.status().ToString();
  EXPECT_EQ(d->transport, mb::MoriTransport::kRdma);
  EXPECT_EQ(d->qp_per_transfer, 1);
  EXPECT_EQ(d->post_batch_size, -1);
  EXPECT_FALSE(d->event_poll);

  auto o = mb::ParseMoriOptions({{"mori_backend", "xgmi"},
                                 {"qp_per_transfer", "8"},
                                 {"post_batch_size", "32"},
                                 {"num_workers", "4"},
                                 {"poll_mode", "event"},
                                 {"mori_host", "10.0.0.7"},
                                 {"mori_port", "4242"},
                                 {"mori_max_run_bytes", "8192"},
                                 {"mori_transfer_timeout_ms", "0"},
                                 {"mori_enable_chunking", "1"}});
  ASSERT_TRUE(o.ok()) << o.status().ToString();
  EXPECT_EQ(o->transport, mb::MoriTransport::kXgmi);
  EXPECT_EQ(o->qp_per_transfer, 8);
  EXPECT_EQ(o->post_batch_size, 32);
  EXPECT_EQ(o->num_workers, 4);
  EXPECT_TRUE(o->event_poll);
  EXPECT_EQ(o->host, "10.0.0.7");
  EXPECT_EQ(o->port, 4242);
  EXPECT_EQ(o->max_run_bytes, 8192u);
  EXPECT_TRUE(o->enable_chunking);
}

TEST(MoriOptions, BadValuesNameTheKey) {
  const std::vector<std::pair<std::string, std::string>> bad = {
      {"mori_backend", "tcp"},   {"qp_per_transfer", "0"},
      {"qp_per_transfer", "4x"}, {"post_batch_size", "0"},
      {"num_workers", "-2"},     {"poll_mode", "busy"},
      {"mori_port", "70000"},    {"mori_max_run_bytes", "4294967296"},
      {"mori_chunking", "1"},    {"mori_engine_key", ""},
  };
  for (const auto& [key, value] : bad) {
    auto r = mb::ParseMoriOptions({{key, value}});
    ASSERT_FALSE(r.ok()) << key << "=" << value;
    EXPECT_EQ(r.status().code(), StatusCode::kInvalidArgument);
    EXPECT_NE(r.status().message().find(key), std::string::npos) << r.status().message();
  }
}

TEST(MoriCodes, FailuresBecomeTransportErrorsWithMoriDetail) {
  EXPECT_TRUE(mb::MoriCodeToStatus(kSuccess, "", "ctx").ok());
  Status s = mb::MoriCodeToStatus(kRdmaOp, "send queue full", "batch 9");
  EXPECT_EQ(s.code(), StatusCode::kTransport);
  EXPECT_NE(s.message().find("ERR_RDMA_OP"), std::string::npos);
  EXPECT_NE(s.message().find("send queue full"), std::string::npos);
  EXPECT_NE(s.message().find("batch 9"), std::string::npos);
  Status unknown = mb::MoriCodeToStatus(42, "", "");
  EXPECT_EQ(unknown.code(), StatusCode::kTransport);
  EXPECT_NE(unknown.message().find("CODE_42"), std::string::npos);
  // Only INIT and IN_PROGRESS keep a batch pending; an unknown code must not hang it.
  EXPECT_FALSE(mb::IsTerminalCode(kInit));
  EXPECT_FALSE(mb::IsTerminalCode(kInProgress));
  EXPECT_TRUE(mb::IsTerminalCode(kSuccess));
  EXPECT_TRUE(mb::IsTerminalCode(kRdmaOp));
  EXPECT_TRUE(mb::IsTerminalCode(42));
}

// ---- mapping
// -------------------------------------------------------------------------------------

TEST_F(MoriMappingTest, ReadAndWriteMoveBytesAtTheBatchOffsets) {
  Make();
  auto local = backend_->RegisterMemory(local_buf_.range(0, kSize));
  ASSERT_TRUE(local.ok()) << local.status().ToString();
  const std::uint64_t peer = Connect();
  auto remote = backend_->ImportRemoteRegion(peer, peer_buf_.range(0, kSize), PeerMemory().desc);
  ASSERT_TRUE(remote.ok()) << remote.status().ToString();
  {
    std::lock_guard lock(world_->mu);
    ASSERT_EQ(world_->sessions.size(), 1u);  // opened at import, not on the first transfer
    EXPECT_EQ(world_->sessions[0].remote.engine_key, "B");
  }

  const std::vector<std::uint8_t> peer_before(peer_buf_.data, peer_buf_.data + kSize);
  const std::vector<std::int64_t> lo = {0, 8192, 40000}, ro = {4096, 100, 60000},
                                  sz = {512, 3000, 5000};
  ASSERT_TRUE(
      backend_->Submit(MakeBatch(TransferOp::kRead, local->handle, peer, *remote, lo, ro, sz, 1))
          .ok());
  ASSERT_TRUE(sink_->Await(1).ok());
  ASSERT_EQ(Posts(), 1u);  // one BatchRead for the whole batch
  World::Post p = PostAt(0);
  EXPECT_EQ(p.op, TransferOp::kRead);
  EXPECT_EQ(p.local_offsets, std::vector<std::size_t>(lo.begin(), lo.end()));
  EXPECT_EQ(p.remote_offsets, std::vector<std::size_t>(ro.begin(), ro.end()));
  EXPECT_EQ(p.sizes, std::vector<std::size_t>(sz.begin(), sz.end()));
  for (std::size_t i = 0; i < lo.size(); ++i) {
    EXPECT_EQ(std::memcmp(local_buf_.data + lo[i], peer_buf_.data + ro[i], sz[i]), 0)
        << "run " << i;
  }

  const std::vector<std::int64_t> wlo = {100}, wro = {20000}, wsz = {7000};
  ASSERT_TRUE(
      backend_
          ->Submit(MakeBatch(TransferOp::kWrite, local->handle, peer, *remote, wlo, wro, wsz, 2))
          .ok());
  ASSERT_TRUE(sink_->Await(2).ok());
  ASSERT_EQ(Posts(), 2u);
  EXPECT_EQ(PostAt(1).op, TransferOp::kWrite);
  EXPECT_EQ(std::memcmp(peer_buf_.data + 20000, local_buf_.data + 100, 7000), 0);
  // Nothing else of the peer changed.
  EXPECT_EQ(std::memcmp(peer_buf_.data, peer_before.data(), 20000), 0);
  EXPECT_EQ(std::memcmp(peer_buf_.data + 27000, peer_before.data() + 27000, kSize - 27000), 0);
}

TEST_F(MoriMappingTest, RegionInsideAnExistingRegistrationSharesItAtAnOffset) {
  Make();
  auto whole = backend_->RegisterMemory(local_buf_.range(0, kSize));
  ASSERT_TRUE(whole.ok());
  auto inner = backend_->RegisterMemory(local_buf_.range(8192, 16384));
  ASSERT_TRUE(inner.ok()) << inner.status().ToString();
  {
    std::lock_guard lock(world_->mu);
    EXPECT_EQ(world_->register_calls.size(), 1u);  // MoRI keys MRs by start: never twice
  }
  EXPECT_EQ(inner->remote_key, whole->remote_key);
  // Same start, larger: cannot share and must not register a second MR at that start.
  auto bigger = backend_->RegisterMemory(local_buf_.range(0, kSize + 4096));
  EXPECT_EQ(bigger.status().code(), StatusCode::kFailedPrecondition);

  const std::uint64_t peer = Connect();
  auto remote = backend_->ImportRemoteRegion(peer, peer_buf_.range(0, kSize), PeerMemory().desc);
  ASSERT_TRUE(remote.ok());
  ASSERT_TRUE(backend_
                  ->Submit(MakeBatch(TransferOp::kRead, inner->handle, peer, *remote, {100}, {200},
                                     {300}, 5))
                  .ok());
  ASSERT_TRUE(sink_->Await(5).ok());
  World::Post p = PostAt(0);
  EXPECT_EQ(p.local_offsets, std::vector<std::size_t>{8192 + 100});
  EXPECT_EQ(p.remote_offsets, std::vector<std::size_t>{200});
  EXPECT_EQ(std::memcmp(local_buf_.data + 8192 + 100, peer_buf_.data + 200, 300), 0);

  // A run that fits the shared registration but not the region is still refused.
  Status outside = backend_->Submit(
      MakeBatch(TransferOp::kRead, inner->handle, peer, *remote, {16000}, {0}, {1000}, 6));
  EXPECT_EQ(outside.code(), StatusCode::kOutOfRange);

  // The registration goes back to MoRI only with its last region.
  ASSERT_TRUE(backend_->DeregisterMemory(whole->handle).ok());
  {
    std::lock_guard lock(world_->mu);
    EXPECT_TRUE(world_->deregister_calls.empty());
  }
  ASSERT_TRUE(backend_->DeregisterMemory(inner->handle).ok());
  {
    std::lock_guard lock(world_->mu);
    EXPECT_EQ(world_->deregister_calls.size(), 1u);
    EXPECT_TRUE(world_->sessions[0].destroyed);
  }
  EXPECT_EQ(backend_->DeregisterMemory(inner->handle).code(), StatusCode::kNotFound);
}

TEST_F(MoriMappingTest, PeerRegionInsideItsRegistrationAddsTheOffset) {
  Make();
  auto local = backend_->RegisterMemory(local_buf_.range(0, kSize));
  ASSERT_TRUE(local.ok());
  const std::uint64_t peer = Connect();
  // The peer's region starts 4096 bytes into the registration its key describes.
  auto remote = backend_->ImportRemoteRegion(peer, peer_buf_.range(4096, 8192), PeerMemory().desc);
  ASSERT_TRUE(remote.ok()) << remote.status().ToString();
  ASSERT_TRUE(backend_
                  ->Submit(MakeBatch(TransferOp::kRead, local->handle, peer, *remote, {0, 1000},
                                     {10, 5000}, {64, 3000}, 1))
                  .ok());
  ASSERT_TRUE(sink_->Await(1).ok());
  World::Post p = PostAt(0);
  EXPECT_EQ(p.remote_offsets, (std::vector<std::size_t>{4096 + 10, 4096 + 5000}));
  EXPECT_EQ(std::memcmp(local_buf_.data + 1000, peer_buf_.data + 4096 + 5000, 3000), 0);
  // Runs are checked against the imported range, not the whole registration.
  EXPECT_EQ(backend_
                ->Submit(MakeBatch(TransferOp::kRead, local->handle, peer, *remote, {0}, {8000},
                                   {400}, 2))
                .code(),
            StatusCode::kOutOfRange);
}

TEST_F(MoriMappingTest, ImportRejectsKeysThatDoNotMatchAndChangesNothing) {
  Make();
  ASSERT_TRUE(backend_->RegisterMemory(local_buf_.range(0, kSize)).ok());
  const std::uint64_t peer = Connect();
  // Range outside the registration the key describes.
  auto outside =
      backend_->ImportRemoteRegion(peer, peer_buf_.range(4096, kSize), PeerMemory().desc);
  EXPECT_EQ(outside.status().code(), StatusCode::kInvalidArgument);
  // A key of another engine.
  mb::MoriMemory other = PeerMemory();
  other.engine_key = "C";
  other.desc = MemBlob(other);
  auto foreign = backend_->ImportRemoteRegion(peer, peer_buf_.range(0, kSize), other.desc);
  EXPECT_EQ(foreign.status().code(), StatusCode::kInvalidArgument);
  EXPECT_NE(foreign.status().message().find("'C'"), std::string::npos);
  // Memory kind differs from what the key says.
  MemoryRange gpu = peer_buf_.range(0, kSize);
  gpu.kind = MemoryKind::kRocm;
  gpu.device = 0;
  EXPECT_EQ(backend_->ImportRemoteRegion(peer, gpu, PeerMemory().desc).status().code(),
            StatusCode::kInvalidArgument);
  // Garbage key, unknown peer.
  EXPECT_EQ(
      backend_->ImportRemoteRegion(peer, peer_buf_.range(0, kSize), Bytes("junk")).status().code(),
      StatusCode::kInvalidArgument);
  EXPECT_EQ(backend_->ImportRemoteRegion(peer + 1000, peer_buf_.range(0, kSize), PeerMemory().desc)
                .status()
                .code(),
            StatusCode::kNotFound);
  std::lock_guard lock(world_->mu);
  EXPECT_TRUE(world_->sessions.empty());
}

TEST_F(MoriMappingTest, SessionFailureAtImportFailsTheImportAndLeavesNothing) {
  Make();
  ASSERT_TRUE(backend_->RegisterMemory(local_buf_.range(0, kSize)).ok());
  const std::uint64_t peer = Connect();
  world_->fail_create_session = true;
  auto remote = backend_->ImportRemoteRegion(peer, peer_buf_.range(0, kSize), PeerMemory().desc);
  EXPECT_EQ(remote.status().code(), StatusCode::kTransport);
  EXPECT_NE(remote.status().message().find("'B'"), std::string::npos);
  world_->fail_create_session = false;
  // The peer is still usable once it answers.
  EXPECT_TRUE(
      backend_->ImportRemoteRegion(peer, peer_buf_.range(0, kSize), PeerMemory().desc).ok());
}

TEST_F(MoriMappingTest, RegionRegisteredAfterImportGetsItsSessionOnFirstUse) {
  Make();
  const std::uint64_t peer = Connect();
  auto remote = backend_->ImportRemoteRegion(peer, peer_buf_.range(0, kSize), PeerMemory().desc);
  ASSERT_TRUE(remote.ok());
  auto local = backend_->RegisterMemory(local_buf_.range(0, kSize));
  ASSERT_TRUE(local.ok());
  const Link link{local->handle, peer, *remote};
  world_->fail_create_session = true;
  ASSERT_TRUE(SubmitOneRun(link, TransferOp::kRead, 1).ok());
  Status failed = sink_->Await(1);  // reported as the batch's completion, not by Submit
  EXPECT_EQ(failed.code(), StatusCode::kTransport);
  EXPECT_NE(failed.message().find("token 1"), std::string::npos) << failed.message();
  world_->fail_create_session = false;
  ASSERT_TRUE(SubmitOneRun(link, TransferOp::kRead, 2).ok());
  EXPECT_TRUE(sink_->Await(2).ok());
  EXPECT_EQ(std::memcmp(local_buf_.data, peer_buf_.data, 64), 0);
}

TEST_F(MoriMappingTest, LongRunsAreSplitIntoConsecutiveEntriesOfOnePost) {
  mb::MoriOptions options;
  options.max_run_bytes = 4096;
  Make(options);
  Link link;
  ASSERT_NO_FATAL_FAILURE(LinkWholeBuffers(&link));
  ASSERT_TRUE(backend_
                  ->Submit(MakeBatch(TransferOp::kWrite, link.local, link.peer, link.remote,
                                     {1000, 30000}, {50, 40000}, {10000, 100}, 3))
                  .ok());
  ASSERT_TRUE(sink_->Await(3).ok());
  ASSERT_EQ(Posts(), 1u);
  World::Post p = PostAt(0);
  EXPECT_EQ(p.local_offsets, (std::vector<std::size_t>{1000, 5096, 9192, 30000}));
  EXPECT_EQ(p.remote_offsets, (std::vector<std::size_t>{50, 4146, 8242, 40000}));
  EXPECT_EQ(p.sizes, (std::vector<std::size_t>{4096, 4096, 1808, 100}));
  EXPECT_EQ(std::memcmp(peer_buf_.data + 50, local_buf_.data + 1000, 10000), 0);
}

// An empty batch completes OK (the contract) without a post: MoRI itself refuses empty batches.
TEST_F(MoriMappingTest, EmptyBatchNeverReachesMori) {
  Make();
  Link link;
  ASSERT_NO_FATAL_FAILURE(LinkWholeBuffers(&link));
  ASSERT_TRUE(backend_->Submit(MakeBatch(TransferOp::kRead, link.local, link.peer, link.remote, {},
                                         {}, {}, 5))
                  .ok());
  EXPECT_TRUE(sink_->Await(5).ok());
  EXPECT_EQ(Posts(), 0u);
}

TEST_F(MoriMappingTest, BadBatchesAreRefusedBeforeReachingMori) {
  Make();
  auto local = backend_->RegisterMemory(local_buf_.range(0, kSize));
  const std::uint64_t peer = Connect();
  const std::uint64_t peer2 = Connect("B2");
  auto remote = backend_->ImportRemoteRegion(peer, peer_buf_.range(0, kSize), PeerMemory().desc);
  ASSERT_TRUE(local.ok() && remote.ok());
  const std::uint64_t l = local->handle, r = *remote;
  auto expect = [&](std::shared_ptr<Batch> b, StatusCode code, const std::string& words) {
    Status s = backend_->Submit(std::move(b));
    EXPECT_EQ(s.code(), code) << s.ToString();
    EXPECT_NE(s.message().find(words), std::string::npos) << s.message();
  };
  // Run checks are the contract suite's (backend_contract_test); here: none reaches MoRI.
  expect(MakeBatch(TransferOp::kRead, l, peer, r, {0, 10}, {0}, {1, 1}, 1),
         StatusCode::kInvalidArgument, "batch 1");
  expect(MakeBatch(TransferOp::kRead, l, peer, r, {0, 64}, {0, -8}, {8, 8}, 3),
         StatusCode::kInvalidArgument, "run 1");
  expect(MakeBatch(TransferOp::kRead, l, peer, r, {0}, {INT64_MAX - 2}, {8}, 6),
         StatusCode::kOutOfRange, "run 0");
  expect(MakeBatch(TransferOp::kRead, l + 999, peer, r, {0}, {0}, {8}, 7), StatusCode::kNotFound,
         "local region");
  expect(MakeBatch(TransferOp::kRead, l, peer, r + 999, {0}, {0}, {8}, 8), StatusCode::kNotFound,
         "remote region");
  expect(MakeBatch(TransferOp::kRead, l, peer2, r, {0}, {0}, {8}, 9), StatusCode::kInvalidArgument,
         "belongs to peer");
  EXPECT_EQ(backend_->Submit(nullptr).code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(Posts(), 0u);
  for (std::uint64_t t = 1; t <= 9; ++t) EXPECT_FALSE(sink_->Completed(t));
}

// ---- completion and status lifetime ------------------------------------------------------------

TEST_F(MoriMappingTest, EachBatchIsOnePostAndCompletesOnce) {
  world_->auto_complete = false;
  Make();
  Link link;
  ASSERT_NO_FATAL_FAILURE(LinkWholeBuffers(&link));
  for (std::uint64_t t = 1; t <= 5; ++t) {
    ASSERT_TRUE(backend_
                    ->Submit(MakeBatch(TransferOp::kRead, link.local, link.peer, link.remote,
                                       {static_cast<std::int64_t>(t) * 64}, {0}, {64}, t))
                    .ok());
  }
  ASSERT_TRUE(world_->WaitPosts(5));
  std::set<FakeStatus*> statuses;
  for (std::size_t i = 0; i < 5; ++i) statuses.insert(PostAt(i).status);
  EXPECT_EQ(statuses.size(), 5u);  // every post has its own status
  EXPECT_FALSE(sink_->Completed(3));
  // Completing out of order still completes each batch exactly once.
  for (std::size_t i : {4, 0, 2, 1, 3}) world_->Complete(i, kSuccess, "");
  for (std::uint64_t t = 1; t <= 5; ++t) EXPECT_TRUE(sink_->Await(t).ok());
  backend_.reset();
  for (std::uint64_t t = 1; t <= 5; ++t) EXPECT_EQ(sink_->CompletionCount(t), 1u);
  std::lock_guard lock(world_->mu);
  EXPECT_TRUE(world_->live_statuses.empty());
  EXPECT_EQ(world_->freed_too_early, 0);
}

TEST_F(MoriMappingTest, SucceededStatusesAreReusedFailedOnesNever) {
  world_->auto_complete = false;
  Make();
  Link link;
  ASSERT_NO_FATAL_FAILURE(LinkWholeBuffers(&link));
  auto submit = [&](std::uint64_t token) {
    ASSERT_TRUE(SubmitOneRun(link, TransferOp::kRead, token).ok());
    ASSERT_TRUE(world_->WaitPosts(token));
  };
  submit(1);
  world_->Complete(0, kSuccess, "");
  ASSERT_TRUE(sink_->Await(1).ok());
  submit(2);
  EXPECT_EQ(PostAt(1).status, PostAt(0).status);  // reused, not freed while MoRI runs
  world_->Complete(1, kRdmaOp, "remote access error");
  EXPECT_EQ(sink_->Await(2).code(), StatusCode::kTransport);
  submit(3);
  EXPECT_NE(PostAt(2).status, PostAt(1).status);  // a failed status is never handed out again
  // A late update of batch 2's status cannot touch batch 3.
  world_->LateWriteAll();
  EXPECT_FALSE(sink_->Completed(3));
  world_->Complete(2, kSuccess, "");
  EXPECT_TRUE(sink_->Await(3).ok());
  backend_.reset();
  std::lock_guard lock(world_->mu);
  EXPECT_EQ(world_->statuses_made, 2);
  EXPECT_EQ(world_->resets, 1);
  EXPECT_EQ(world_->reset_unfinished, 0);
  EXPECT_EQ(world_->freed_too_early, 0);
  EXPECT_TRUE(world_->live_statuses.empty());
}

TEST_F(MoriMappingTest, FailedStatusIsATransportErrorAndStaysAliveWhileMoriLives) {
  world_->auto_complete = false;
  Make();
  Link link;
  ASSERT_NO_FATAL_FAILURE(LinkWholeBuffers(&link));
  ASSERT_TRUE(SubmitOneRun(link, TransferOp::kWrite, 7).ok());
  ASSERT_TRUE(world_->WaitPosts(1));
  world_->Complete(0, kRdmaOp, "ibv_post_send: send queue full");
  Status s = sink_->Await(7);
  EXPECT_EQ(s.code(), StatusCode::kTransport);
  for (const char* word : {"ERR_RDMA_OP", "send queue full", "token 7", "'B'", "write"}) {
    EXPECT_NE(s.message().find(word), std::string::npos) << word << " not in " << s.message();
  }
  // MoRI may still write to a failed batch's status (later completions of its other WRs).
  world_->LateWriteAll();
  {
    std::lock_guard lock(world_->mu);
    EXPECT_EQ(world_->late_write_to_freed, 0);
    EXPECT_EQ(world_->live_statuses.count(world_->posts[0].status), 1u);
  }
  // The region is free again once the batch completed.
  ASSERT_TRUE(backend_->DeregisterMemory(link.local).ok());
  backend_.reset();
  std::lock_guard lock(world_->mu);
  EXPECT_TRUE(world_->live_statuses.empty());  // freed after MoRI stopped, not leaked
  EXPECT_EQ(world_->freed_too_early, 0);
  EXPECT_EQ(sink_->CompletionCount(7), 1u);
}

TEST_F(MoriMappingTest, RejectedPostIsATransportErrorAndKeepsItsStatus) {
  Make();
  Link link;
  ASSERT_NO_FATAL_FAILURE(LinkWholeBuffers(&link));
  world_->reject_post = true;
  ASSERT_TRUE(SubmitOneRun(link, TransferOp::kRead, 4).ok());
  Status s = sink_->Await(4);
  EXPECT_EQ(s.code(), StatusCode::kTransport);
  EXPECT_NE(s.message().find("send queue full"), std::string::npos) << s.message();
  {
    std::lock_guard lock(world_->mu);
    EXPECT_EQ(world_->live_statuses.size(), 1u);  // MoRI might have kept the pointer
  }
  backend_.reset();
  std::lock_guard lock(world_->mu);
  EXPECT_TRUE(world_->live_statuses.empty());
  EXPECT_EQ(world_->freed_too_early, 0);
}

// Issue 12 defect 3: a batch completes only once MoRI says it is finished -- a completion is the
// proof that none of its writes can land any more -- however long MoRI takes
// (mori_transfer_timeout_ms is accepted but no longer ends a posted batch).
TEST_F(MoriMappingTest, UnfinishedBatchCompletesOnlyWhenMoriFinishesIt) {
  world_->auto_complete = false;
  Make(mb::ParseMoriOptions({{"mori_transfer_timeout_ms", "30"}}).value());
  Link link;
  ASSERT_NO_FATAL_FAILURE(LinkWholeBuffers(&link));
  ASSERT_TRUE(SubmitOneRun(link, TransferOp::kRead, 8).ok());
  ASSERT_TRUE(world_->WaitPosts(1));
  std::this_thread::sleep_for(std::chrono::milliseconds(150));  // past the old 30 ms deadline
  EXPECT_EQ(sink_->CompletionCount(8), 0u) << "completed while MoRI may still write";
  world_->Complete(0, kSuccess, "");
  Status s = sink_->Await(8);
  EXPECT_TRUE(s.ok()) << s.ToString();
  {
    std::lock_guard lock(world_->mu);
    EXPECT_EQ(world_->late_write_to_freed, 0);
  }
  backend_.reset();
  EXPECT_EQ(sink_->CompletionCount(8), 1u);
  std::lock_guard lock(world_->mu);
  EXPECT_TRUE(world_->live_statuses.empty());
  EXPECT_EQ(world_->freed_too_early, 0);
}

TEST_F(MoriMappingTest, DestroyingTheBackendAbortsWhatMoriDidNotFinishAfterStoppingMori) {
  world_->auto_complete = false;
  mb::MoriOptions options;
  options.drain_timeout = std::chrono::milliseconds(50);
  Make(options);
  Link link;
  ASSERT_NO_FATAL_FAILURE(LinkWholeBuffers(&link));
  ASSERT_TRUE(SubmitOneRun(link, TransferOp::kRead, 9).ok());
  ASSERT_TRUE(world_->WaitPosts(1));
  backend_.reset();
  Status s = sink_->Await(9);
  EXPECT_EQ(s.code(), StatusCode::kAborted);
  EXPECT_NE(s.message().find("token 9"), std::string::npos);
  // Reported only once MoRI was stopped: the caller may reuse the memory at once.
  EXPECT_FALSE(sink_->ApiAliveAtCompletion(9));
  std::lock_guard lock(world_->mu);
  EXPECT_TRUE(world_->live_statuses.empty());
  EXPECT_EQ(world_->freed_too_early, 0);  // the in-progress status outlived the MoRI engine
}

TEST_F(MoriMappingTest, DestroyingTheBackendWaitsForBatchesMoriIsStillFinishing) {
  world_->auto_complete = false;
  mb::MoriOptions options;
  options.drain_timeout = std::chrono::seconds(30);
  Make(options);
  Link link;
  ASSERT_NO_FATAL_FAILURE(LinkWholeBuffers(&link));
  ASSERT_TRUE(SubmitOneRun(link, TransferOp::kRead, 10).ok());
  ASSERT_TRUE(world_->WaitPosts(1));
  std::thread destroy([&] { backend_.reset(); });
  std::this_thread::sleep_for(std::chrono::milliseconds(50));  // let destruction begin
  world_->Complete(0, kSuccess, "");
  destroy.join();
  EXPECT_TRUE(sink_->Await(10).ok());  // finished, not aborted
  std::lock_guard lock(world_->mu);
  EXPECT_TRUE(world_->live_statuses.empty());
  EXPECT_EQ(world_->freed_too_early, 0);
}

// ---- peers
// -----------------------------------------------------------------------------------------

TEST_F(MoriMappingTest, ConnectRefusesOurselvesDuplicatesAndGarbage) {
  Make();
  EXPECT_EQ(backend_->ConnectPeer(EngineBlob("A")).status().code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(backend_->ConnectPeer(Bytes("nonsense")).status().code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(backend_->ConnectPeer({}).status().code(), StatusCode::kInvalidArgument);
  const std::uint64_t peer = Connect();
  auto again = backend_->ConnectPeer(EngineBlob("B"));
  EXPECT_EQ(again.status().code(), StatusCode::kAlreadyExists);
  {
    std::lock_guard lock(world_->mu);
    EXPECT_EQ(world_->remote_engines, std::vector<std::string>{"B"});
  }
  auto address = backend_->LocalAddress();
  ASSERT_TRUE(address.ok());
  EXPECT_EQ(Text(*address), "fake-engine|A");
  // After a disconnect the same engine may connect again.
  ASSERT_TRUE(backend_->DisconnectPeer(peer).ok());
  EXPECT_EQ(backend_->DisconnectPeer(peer).code(), StatusCode::kNotFound);
  EXPECT_TRUE(backend_->ConnectPeer(EngineBlob("B")).ok());
}

TEST_F(MoriMappingTest, DisconnectAbortsInFlightBatchesOnceMoriIsDoneWithThem) {
  world_->auto_complete = false;
  Make();
  Link link;
  ASSERT_NO_FATAL_FAILURE(LinkWholeBuffers(&link));
  ASSERT_TRUE(SubmitOneRun(link, TransferOp::kRead, 11).ok());
  ASSERT_TRUE(world_->WaitPosts(1));
  ASSERT_TRUE(backend_->DisconnectPeer(link.peer).ok());
  {
    std::lock_guard lock(world_->mu);
    EXPECT_EQ(world_->deregistered_engines, std::vector<std::string>{"B"});
    // MoRI may still be moving this batch's bytes: its session must stay open until then.
    EXPECT_FALSE(world_->sessions[0].destroyed);
  }
  EXPECT_FALSE(sink_->Completed(11));
  EXPECT_EQ(SubmitOneRun(link, TransferOp::kRead, 12).code(), StatusCode::kNotFound);
  world_->Complete(0, kSuccess, "");
  Status s = sink_->Await(11);
  EXPECT_EQ(s.code(), StatusCode::kAborted);
  EXPECT_NE(s.message().find("disconnected"), std::string::npos);
  // ... and closed once it is.
  EXPECT_TRUE(world_->WaitUntil([&] { return world_->sessions[0].destroyed; }));
  backend_.reset();
  std::lock_guard lock(world_->mu);
  EXPECT_EQ(world_->freed_too_early, 0);
}

TEST_F(MoriMappingTest, PeerFailureReachesTheSinkAndStopsNewBatches) {
  Make();
  auto local = backend_->RegisterMemory(local_buf_.range(0, kSize));
  const std::uint64_t peer_b = Connect("B");
  const std::uint64_t peer_c = Connect("C");
  auto remote = backend_->ImportRemoteRegion(peer_b, peer_buf_.range(0, kSize), PeerMemory().desc);
  ASSERT_TRUE(local.ok() && remote.ok());
  {
    std::lock_guard lock(world_->mu);
    world_->failures.push_back({"B", "PEER_UNREACHABLE", "mlx5_0", "retry count exceeded"});
  }
  auto failures = sink_->AwaitPeerFailures(1);
  ASSERT_EQ(failures.size(), 1u);
  EXPECT_EQ(failures[0].first, peer_b);
  EXPECT_EQ(failures[0].second.code(), StatusCode::kTransport);
  for (const char* word : {"PEER_UNREACHABLE", "mlx5_0", "retry count exceeded", "'B'"}) {
    EXPECT_NE(failures[0].second.message().find(word), std::string::npos) << word;
  }
  Status refused = SubmitOneRun({local->handle, peer_b, *remote}, TransferOp::kRead, 1);
  EXPECT_EQ(refused.code(), StatusCode::kTransport);
  EXPECT_NE(refused.message().find("PEER_UNREACHABLE"), std::string::npos);

  // A failure not tied to one peer (a port went down) is reported for every peer.
  {
    std::lock_guard lock(world_->mu);
    world_->failures.push_back({"", "LOCAL_PORT_DOWN", "mlx5_0", "port 1 down"});
  }
  failures = sink_->AwaitPeerFailures(3);
  ASSERT_EQ(failures.size(), 3u);
  std::set<std::uint64_t> peers = {failures[1].first, failures[2].first};
  EXPECT_EQ(peers, (std::set<std::uint64_t>{peer_b, peer_c}));
  EXPECT_NE(failures[1].second.message().find("LOCAL_PORT_DOWN"), std::string::npos);
}

// ---- batches that wait for their producer's HIP event ----------------------------------------

// MoRI posts on the host, so a batch from GPU memory whose producer's event has not completed is
// held back by the poster, never handed to MoRI, and only it: a later batch without an event
// goes first. Once the event completes the batch is posted and moves the producer's bytes.
TEST_F(MoriMappingTest, BatchWaitingForItsEventIsPostedOnceItCompletedHoldingUpNoOther) {
  Link host, gpu;
  ASSERT_NO_FATAL_FAILURE(MakeWithGpuRegion(&host, &gpu));
  EXPECT_TRUE(backend_->capabilities().device_event_wait);
  EXPECT_TRUE(backend_->AcceptsDeviceWaits(gpu.local, gpu.remote));
  EXPECT_FALSE(backend_->AcceptsDeviceWaits(host.local, host.remote));  // host memory
  EXPECT_FALSE(backend_->AcceptsDeviceWaits(gpu.local, 777));             // unknown import
  // More batches waiting for events than the poster asks about in one pass (a deep forward's
  // layers), then one without an event: it still goes first.
  constexpr std::uint64_t kWaiting = detail::EventPass::kMaxPending + 2;
  for (std::uint64_t i = 0; i < kWaiting; ++i) MarkEvent(&World::pending_events, 0xE1 + i);
  for (std::uint64_t i = 0; i < kWaiting; ++i) {
    ASSERT_TRUE(backend_->Submit(WriteWaitingFor(gpu, 0xE1 + i, 0, 30 + i)).ok());
  }
  ASSERT_TRUE(backend_->Submit(WriteWaitingFor(gpu, 0, 128, 21)).ok());
  ASSERT_TRUE(sink_->Await(21).ok());
  ASSERT_TRUE(world_->WaitUntil(
      [&] { return world_->event_queries >= 2 * detail::EventPass::kMaxPending; }));
  for (std::uint64_t i = 0; i < kWaiting; ++i) EXPECT_FALSE(sink_->Completed(30 + i));
  ASSERT_EQ(Posts(), 1u) << "a batch waiting for its event reached MoRI";
  EXPECT_EQ(PostAt(0).local_offsets, std::vector<std::size_t>{128});
  {
    std::lock_guard lock(world_->mu);
    for (std::uint64_t i = 1; i < kWaiting; ++i) world_->pending_events.erase(0xE1 + i);
  }
  for (std::uint64_t i = 1; i < kWaiting; ++i) ASSERT_TRUE(sink_->Await(30 + i).ok());
  EXPECT_FALSE(sink_->Completed(30)) << "posted before its event completed";
  ASSERT_TRUE(backend_->Submit(WriteWaitingFor(gpu, 0xE1, 0, 20)).ok());
  gpu_buf_.data[0] = 0xAB;  // the producer's work, finished before its event completes
  {
    std::lock_guard lock(world_->mu);
    world_->pending_events.clear();
  }
  for (std::uint64_t token : {20, 30}) {
    Status s = sink_->Await(token);
    EXPECT_TRUE(s.ok()) << s.ToString();
    EXPECT_EQ(sink_->CompletionCount(token), 1u);
  }
  ASSERT_EQ(Posts(), kWaiting + 2);
  EXPECT_EQ(peer_buf_.data[0], 0xAB);
}

// An event HIP cannot answer about fails its batch (naming it) without posting it, and releases
// its region; a host batch carrying an event is refused at Submit, naming the memory kind.
TEST_F(MoriMappingTest, BatchWhoseEventCannotBeQueriedFailsAndHostBatchesTakeNoEvent) {
  Link host, gpu;
  ASSERT_NO_FATAL_FAILURE(MakeWithGpuRegion(&host, &gpu));
  MarkEvent(&World::broken_events, 0xE2);
  ASSERT_TRUE(backend_->Submit(WriteWaitingFor(gpu, 0xE2, 0, 22)).ok());
  Status s = sink_->Await(22);
  EXPECT_EQ(s.code(), StatusCode::kTransport) << s.ToString();
  EXPECT_NE(s.message().find("token 22"), std::string::npos) << s.ToString();
  EXPECT_NE(s.message().find("HIP event"), std::string::npos) << s.ToString();
  EXPECT_EQ(Posts(), 0u);
  EXPECT_TRUE(backend_->DeregisterMemory(gpu.local).ok());  // nothing holds the region

  Status refused = backend_->Submit(WriteWaitingFor(host, 0xE3, 0, 23));
  EXPECT_EQ(refused.code(), StatusCode::kInvalidArgument);
  EXPECT_NE(refused.message().find("host memory"), std::string::npos) << refused.ToString();
  EXPECT_FALSE(sink_->Completed(23));
  EXPECT_EQ(Posts(), 0u);
}

// A batch still waiting for its event when its peer is disconnected, or the backend destroyed,
// ends aborted, once, without ever reaching MoRI.
TEST_F(MoriMappingTest, BatchWaitingForItsEventEndsAbortedOnDisconnectAndTeardown) {
  Link host, gpu;
  ASSERT_NO_FATAL_FAILURE(MakeWithGpuRegion(&host, &gpu));
  MarkEvent(&World::pending_events, 0xE4);
  ASSERT_TRUE(backend_->Submit(WriteWaitingFor(gpu, 0xE4, 0, 24)).ok());
  ASSERT_TRUE(world_->WaitUntil([&] { return world_->event_queries >= 1; }));
  ASSERT_TRUE(backend_->DisconnectPeer(gpu.peer).ok());
  Status s = sink_->Await(24);
  EXPECT_EQ(s.code(), StatusCode::kAborted) << s.ToString();
  EXPECT_NE(s.message().find("disconnected"), std::string::npos) << s.ToString();

  const std::uint64_t peer = Connect("C");
  auto remote = backend_->ImportRemoteRegion(peer, peer_buf_.range(0, kSize), [&] {
    mb::MoriMemory m = PeerMemory();
    m.engine_key = "C";
    m.desc = MemBlob(m);
    return m.desc;
  }());
  ASSERT_TRUE(remote.ok()) << remote.status().ToString();
  ASSERT_TRUE(backend_->Submit(WriteWaitingFor({gpu.local, peer, *remote}, 0xE4, 0, 25)).ok());
  backend_.reset();
  s = sink_->Await(25);
  EXPECT_EQ(s.code(), StatusCode::kAborted) << s.ToString();
  EXPECT_EQ(sink_->CompletionCount(24), 1u);
  EXPECT_EQ(sink_->CompletionCount(25), 1u);
  EXPECT_EQ(Posts(), 0u);
}

TEST_F(MoriMappingTest, CapabilitiesAndMemoryKindsFollowTheTransport) {
  Make();
  EXPECT_EQ(backend_->name(), "mori");
  EXPECT_FALSE(backend_->capabilities().unaligned_registration);  // RDMA: page-aligned MRs only
  EXPECT_TRUE(backend_->capabilities().host_memory);
  EXPECT_TRUE(backend_->capabilities().rocm_memory);
  EXPECT_FALSE(backend_->capabilities().cuda_memory);
  MemoryRange cuda = local_buf_.range(0, kSize);
  cuda.kind = MemoryKind::kCuda;
  cuda.device = 0;
  EXPECT_EQ(backend_->RegisterMemory(cuda).status().code(), StatusCode::kInvalidArgument);
  MemoryRange no_device = local_buf_.range(0, kSize);
  no_device.kind = MemoryKind::kRocm;
  EXPECT_EQ(backend_->RegisterMemory(no_device).status().code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(backend_->RegisterMemory({0, 4096, MemoryKind::kHost, -1}).status().code(),
            StatusCode::kInvalidArgument);
  {
    std::lock_guard lock(world_->mu);
    EXPECT_TRUE(world_->register_calls.empty());
  }

  backend_.reset();
  world_ = std::make_shared<World>();
  sink_ = std::make_shared<Sink>(world_);
  mb::MoriOptions xgmi;
  xgmi.transport = mb::MoriTransport::kXgmi;
  Make(xgmi);
  EXPECT_TRUE(backend_->capabilities().unaligned_registration);
  EXPECT_FALSE(backend_->capabilities().host_memory);
  EXPECT_EQ(backend_->RegisterMemory(local_buf_.range(0, kSize)).status().code(),
            StatusCode::kInvalidArgument);
}

}  // namespace
