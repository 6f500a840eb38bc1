// How the MoRI backend (cpp/backends/mori/mori_backend.cpp) ends its batches, against the backend
// contract (include/moriio_native/backend.hpp) and MoRI-IO's real behaviour, with the fake MoRI of
// fake_mori.hpp: which completion a failed or abandoned batch gets, what a sink may do from it,
// and the reaper's idle loop. Each was found by a review (2026-12-07) and failed before its fix.

#include <gtest/gtest.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstring>
#include <functional>
#include <map>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "backend_test_support.hpp"
#include "backends/mori/mori_api.hpp"
#include "backends/mori/mori_backend.hpp"
#include "fake_mori.hpp"

namespace {

using namespace moriio_native;  // NOLINT(google-build-using-namespace)
namespace mb = moriio_native::detail::mori_backend;
using namespace moriio_native::fake_mori;  // NOLINT(google-build-using-namespace)
using moriio_native::testing_support::MakeBatch;

// ---- a sink that tells OnBatchComplete from OnBatchUnconfirmed --------------------------------

class Sink final : public CompletionSink {
 public:
  enum class Kind { kComplete, kUnconfirmed };
  struct Record {
    Kind kind;
    Status status;
  };
  void OnBatchComplete(std::uint64_t token, Status status) override {
    Add(token, Kind::kComplete, std::move(status));
  }
  void OnBatchUnconfirmed(std::uint64_t token, Status status) override {
    Add(token, Kind::kUnconfirmed, std::move(status));
  }
  void OnPeerFailure(std::uint64_t, Status) override {}

  std::optional<Record> Await(std::uint64_t token) {
    std::unique_lock lock(mu_);
    if (!cv_.wait_for(lock, kWait, [&] { return records_.count(token) > 0; })) return std::nullopt;
    EXPECT_EQ(records_[token].size(), 1u) << "token " << token << " completed twice";
    return records_[token].front();
  }
  bool Completed(std::uint64_t token) {
    std::lock_guard lock(mu_);
    return records_.count(token) > 0;
  }
  // Runs inside every completion, before it is recorded (on the reporting thread).
  std::function<void(std::uint64_t)> hook;

 private:
  void Add(std::uint64_t token, Kind kind, Status status) {
    if (hook) hook(token);
    std::lock_guard lock(mu_);
    records_[token].push_back({kind, std::move(status)});
    cv_.notify_all();
  }
  std::mutex mu_;
  std::condition_variable cv_;
  std::map<std::uint64_t, std::vector<Record>> records_;
};

// ---- the fake MoRI with hooks ------------------------------------------------------------------

// FakeMoriApi (final) behind a forwarding layer: counts PopPeerFailure calls (one per reaper pass)
// and can hold CreateSession (MoRI connects QPs there: seconds on a slow network).
class HookedApi final : public FakeMoriApi {
 public:
  struct Hooks {
    std::mutex mu;
    std::condition_variable cv;
    bool hold_create_session = false;
    bool in_create_session = false;
    std::atomic<std::int64_t> pop_calls{0};
  };
  HookedApi(std::shared_ptr<World> world, std::shared_ptr<Hooks> hooks)
      : FakeMoriApi(std::move(world), "A"), hooks_(std::move(hooks)) {}

  Result<std::uint64_t> CreateSession(std::uint32_t local_id, const mb::MoriMemory& r) override {
    {
      std::unique_lock lock(hooks_->mu);
      hooks_->in_create_session = true;
      hooks_->cv.notify_all();
      hooks_->cv.wait(lock, [&] { return !hooks_->hold_create_session; });
      hooks_->in_create_session = false;
    }
    return FakeMoriApi::CreateSession(local_id, r);
  }
  std::optional<mb::MoriPeerFailure> PopPeerFailure() override {
    ++hooks_->pop_calls;
    return FakeMoriApi::PopPeerFailure();
  }

 private:
  std::shared_ptr<Hooks> hooks_;
};

// ---- fixture -----------------------------------------------------------------------------------

class MoriCompletion : public ::testing::Test {
 protected:
  static constexpr std::size_t kSize = 64 * 1024;

  void SetUp() override {
    world_ = std::make_shared<World>();
    hooks_ = std::make_shared<HookedApi::Hooks>();
    sink_ = std::make_shared<Sink>();
  }

  void Make(mb::MoriOptions options = {}) {
    auto api = std::make_unique<HookedApi>(world_, hooks_);
    auto backend = mb::CreateMoriBackendWithApi(std::move(api), options, sink_);
    ASSERT_TRUE(backend.ok()) << backend.status().ToString();
    backend_ = std::move(*backend);
  }

  mb::MoriMemory PeerMemory(const std::string& key = "B") const {
    mb::MoriMemory m{key, 3, peer_buf_.addr(), kSize, MemoryKind::kHost, -1, {}};
    m.desc = MemBlob(m);
    return m;
  }

  struct Link {
    std::uint64_t local = 0, peer = 0, remote = 0;
  };
  void LinkWholeBuffers(Link* link) {
    auto local = backend_->RegisterMemory(local_buf_.range(0, kSize));
    auto peer = backend_->ConnectPeer(EngineBlob("B"));
    ASSERT_TRUE(local.ok() && peer.ok());
    auto remote = backend_->ImportRemoteRegion(*peer, peer_buf_.range(0, kSize), PeerMemory().desc);
    ASSERT_TRUE(remote.ok()) << remote.status().ToString();
    *link = {local->handle, *peer, *remote};
  }
  Status SubmitOneRun(const Link& link, TransferOp op, std::uint64_t token,
                      std::int64_t offset = 0) {
    return backend_->Submit(
        MakeBatch(op, link.local, link.peer, link.remote, {offset}, {offset}, {64}, token));
  }

  std::shared_ptr<World> world_;
  std::shared_ptr<HookedApi::Hooks> hooks_;
  std::shared_ptr<Sink> sink_;
  std::unique_ptr<Backend> backend_;
  PageAlignedBuffer local_buf_{kSize, 11};
  PageAlignedBuffer peer_buf_{kSize, 99};
};

// ---- a failed MoRI WRITE completes unconfirmed (was: confirmed) -------------------------------
// MoRI sets a failure code on the FIRST error CQE of a batch (rdma/backend_impl.cpp
// ProcessOneCqe: statusPtr->Update(ERR_RDMA_OP); meta->status = nullptr) or when posting stops
// part-way (rdma/common.cpp RdmaBatchReadWrite returns ERR_RDMA_OP after earlier post batches
// went to the NIC; backend_impl.cpp BatchReadWrite: status->Update(ret.code, ...)). The batch's
// other WRs (other QPs with qp_per_transfer > 1, earlier post batches) keep writing to the peer.
// backend.hpp: such a WRITE "completes through OnBatchUnconfirmed". The backend calls
// OnBatchComplete, so the engine reports the transfer drained and the peer reuses blocks that
// may still change.
TEST_F(MoriCompletion, FailedWriteIsReportedThroughOnBatchUnconfirmed) {
  world_->auto_complete = false;
  Make();
  Link link;
  ASSERT_NO_FATAL_FAILURE(LinkWholeBuffers(&link));
  ASSERT_TRUE(SubmitOneRun(link, TransferOp::kWrite, 1).ok());
  ASSERT_TRUE(world_->WaitPosts(1));
  world_->Complete(0, kRdmaOp, "CQE error on QP 1 of 4");
  auto r = sink_->Await(1);
  ASSERT_TRUE(r.has_value());
  EXPECT_EQ(r->status.code(), StatusCode::kTransport);
  EXPECT_EQ(r->kind, Sink::Kind::kUnconfirmed)
      << "a failed MoRI WRITE may still land at the peer, but was reported via OnBatchComplete";
}

// ---- a WRITE in flight at destruction completes unconfirmed (was: confirmed) -----------------
// backend.hpp: a WRITE whose writes were not confirmed when the connection closed "at
// DisconnectPeer or destruction" completes through OnBatchUnconfirmed. ~MoriBackend reports a
// WRITE that MoRI never finished (drain timeout passed) with OnBatchComplete(Aborted).
TEST_F(MoriCompletion, WriteInFlightAtDestructionIsReportedThroughOnBatchUnconfirmed) {
  world_->auto_complete = false;
  mb::MoriOptions options;
  options.drain_timeout = std::chrono::milliseconds(20);
  Make(options);
  Link link;
  ASSERT_NO_FATAL_FAILURE(LinkWholeBuffers(&link));
  ASSERT_TRUE(SubmitOneRun(link, TransferOp::kWrite, 2).ok());
  ASSERT_TRUE(world_->WaitPosts(1));
  backend_.reset();
  auto r = sink_->Await(2);
  ASSERT_TRUE(r.has_value());
  EXPECT_EQ(r->status.code(), StatusCode::kAborted);
  EXPECT_EQ(r->kind, Sink::Kind::kUnconfirmed)
      << "an unfinished WRITE at destruction was reported via OnBatchComplete";
}

// ---- a batch MoRI finished before DisconnectPeer completes OK (was: aborted) -----------------
// backend.hpp (DisconnectPeer): "A batch the transport had already finished completes OK." The
// reaper is held inside an earlier completion; meanwhile MoRI finishes batch 5 (SUCCESS) and the
// peer is disconnected afterwards: batch 5 is reported Aborted.
TEST_F(MoriCompletion, BatchMoriFinishedBeforeDisconnectCompletesOk) {
  world_->auto_complete = false;
  Make();
  Link link;
  ASSERT_NO_FATAL_FAILURE(LinkWholeBuffers(&link));
  std::mutex gate_mu;
  std::condition_variable gate_cv;
  bool hold = true, held = false;
  sink_->hook = [&](std::uint64_t token) {
    if (token != 4) return;
    std::unique_lock lock(gate_mu);
    held = true;
    gate_cv.notify_all();
    gate_cv.wait(lock, [&] { return !hold; });
  };
  ASSERT_TRUE(SubmitOneRun(link, TransferOp::kRead, 4).ok());
  ASSERT_TRUE(SubmitOneRun(link, TransferOp::kRead, 5, 1024).ok());
  ASSERT_TRUE(world_->WaitPosts(2));
  world_->Complete(0, kSuccess, "");
  {
    std::unique_lock lock(gate_mu);
    ASSERT_TRUE(gate_cv.wait_for(lock, kWait, [&] { return held; }));
  }
  world_->Complete(1, kSuccess, "");  // MoRI finished batch 5: its bytes are all there
  ASSERT_TRUE(backend_->DisconnectPeer(link.peer).ok());
  {
    std::lock_guard lock(gate_mu);
    hold = false;
  }
  gate_cv.notify_all();
  auto r = sink_->Await(5);
  ASSERT_TRUE(r.has_value());
  EXPECT_TRUE(r->status.ok()) << "finished before the disconnect, reported "
                              << r->status.ToString();
}

// ---- a sink calling back into the backend from the destructor's completions --------------
// mori_backend.hpp: "Every sink call comes from the polling thread, or from the destructor for
// batches still open then (after MoRI is stopped), so the sink may call back into the backend".
// backend.hpp: "a caller that saw the completion may deregister at once". From a completion that
// ~MoriBackend reports, DeregisterMemory of that batch's region is refused: the destructor never
// released the batch's `uses` (ReleaseLocked), so the region still counts it as in flight.
TEST_F(MoriCompletion, TheRegionOfABatchAbortedAtDestructionCanBeDeregisteredFromItsCompletion) {
  world_->auto_complete = false;
  mb::MoriOptions options;
  options.drain_timeout = std::chrono::milliseconds(20);
  Make(options);
  Link link;
  ASSERT_NO_FATAL_FAILURE(LinkWholeBuffers(&link));
  Status deregistered = InternalError("not called");
  Backend* backend = backend_.get();
  sink_->hook = [&](std::uint64_t token) {
    if (token == 6) deregistered = backend->DeregisterMemory(link.local);
  };
  ASSERT_TRUE(SubmitOneRun(link, TransferOp::kRead, 6).ok());
  ASSERT_TRUE(world_->WaitPosts(1));
  backend_.reset();
  ASSERT_TRUE(sink_->Await(6).has_value());
  // NotFound or OK would both be acceptable answers; "batches in flight" is not.
  EXPECT_NE(deregistered.code(), StatusCode::kFailedPrecondition) << deregistered.ToString();
}

// The same callback for a region WITHOUT batches in flight reaches api_ after
// ~MoriBackend reset it: DeregisterMemory calls api_->DeregisterMemory on a null unique_ptr.
TEST_F(MoriCompletion, DeregisterFromADestructorCompletionIsSafeOnceMoriIsGone) {
  GTEST_FLAG_SET(death_test_style, "threadsafe");
  EXPECT_EXIT(
      {
        world_->auto_complete = false;
        mb::MoriOptions options;
        options.drain_timeout = std::chrono::milliseconds(20);
        Make(options);
        Link link;
        LinkWholeBuffers(&link);
        auto idle = backend_->RegisterMemory(peer_buf_.range(0, 4096));  // no batch uses it
        Backend* backend = backend_.get();
        sink_->hook = [&](std::uint64_t token) {
          if (token == 7) (void)backend->DeregisterMemory(idle->handle);
        };
        (void)SubmitOneRun(link, TransferOp::kRead, 7);
        world_->WaitPosts(1);
        backend_.reset();
        std::exit(0);
      },
      ::testing::ExitedWithCode(0), "")
      << "DeregisterMemory from a completion reported by ~MoriBackend crashed";
}

// ---- the reaper waits while a finished session waits for api_mu_ (was: spun) -----------------
// ReapLoop: when DestroySession cannot take api_mu_ (try_lock) the session goes back to
// sessions_to_destroy_, and because `destroy` was non-empty the loop neither waits on reap_cv_
// nor on a status: it runs again at once, for as long as api_mu_ is held -- CreateSession of an
// import or of a lazily opened session (MoRI connects QPs there), i.e. up to seconds of a core.
TEST_F(MoriCompletion, ReaperDoesNotSpinWhileARetiredSessionWaitsForTheApiLock) {
  world_->auto_complete = false;
  Make();
  Link link;
  ASSERT_NO_FATAL_FAILURE(LinkWholeBuffers(&link));
  ASSERT_TRUE(SubmitOneRun(link, TransferOp::kRead, 8).ok());
  ASSERT_TRUE(world_->WaitPosts(1));
  ASSERT_TRUE(backend_->DisconnectPeer(link.peer).ok());  // session retired, batch in flight
  auto peer_c = backend_->ConnectPeer(EngineBlob("C"));
  ASSERT_TRUE(peer_c.ok());
  {
    std::lock_guard lock(hooks_->mu);
    hooks_->hold_create_session = true;
  }
  std::thread importer([&] {
    (void)backend_->ImportRemoteRegion(*peer_c, peer_buf_.range(0, kSize),
                                       PeerMemory("C").desc);
  });
  {
    std::unique_lock lock(hooks_->mu);
    ASSERT_TRUE(hooks_->cv.wait_for(lock, kWait, [&] { return hooks_->in_create_session; }));
  }
  world_->Complete(0, kSuccess, "");  // the retired session can go now, but api_mu_ is held
  ASSERT_TRUE(sink_->Await(8).has_value());
  const std::int64_t before = hooks_->pop_calls.load();
  std::this_thread::sleep_for(std::chrono::milliseconds(200));
  const std::int64_t passes = hooks_->pop_calls.load() - before;
  {
    std::lock_guard lock(hooks_->mu);
    hooks_->hold_create_session = false;
  }
  hooks_->cv.notify_all();
  importer.join();
  // Idle, the reaper wakes every 20 ms (about 10 passes in 200 ms).
  EXPECT_LT(passes, 100) << "the reaper made " << passes << " passes in 200 ms while idle";
}

}  // namespace
