// The Backend contract (include/moriio_native/backend.hpp) checked the same way over every
// backend: loopback, UCX (two backends, i.e. two UCX workers, in this process) and MoRI through
// its fake MoRI-IO. Each case builds two backends A and B; A registers a local buffer, connects
// to B and imports B's buffer, and the cases drive A.
//
// Holding a batch in flight without timing: the first completion A delivers blocks in the sink
// until the test opens the gate. Every backend finishes batches on the thread that delivers
// completions (loopback's worker, UCX's progress thread, MoRI's reaper), so a batch submitted
// while the gate is shut cannot finish: it is in flight until the gate opens.

#include <gtest/gtest.h>

#include <condition_variable>
#include <cstring>
#include <functional>
#include <ostream>
#include <algorithm>
#include <future>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "backend_test_support.hpp"
#include "backends/mori/mori_backend.hpp"
#include "fake_mori.hpp"
#include "moriio_native/backend.hpp"

namespace {

using namespace moriio_native;  // NOLINT(google-build-using-namespace)
namespace mb = moriio_native::detail::mori_backend;
namespace fake = moriio_native::fake_mori;

constexpr auto kWait = std::chrono::seconds(30);  // a hang guard, never a timing assert
constexpr std::size_t kSize = 64 * 1024;

// Records completions; optionally blocks the first one until Open().
class GateSink final : public CompletionSink {
 public:
  void OnBatchComplete(std::uint64_t token, Status status) override {
    std::unique_lock lock(mu_);
    done_[token].push_back(std::move(status));
    cv_.notify_all();
    if (shut_ && !blocked_once_) {
      blocked_once_ = true;
      blocked_ = true;
      cv_.notify_all();
      cv_.wait(lock, [&] { return !shut_; });
      blocked_ = false;
    }
  }
  void OnPeerFailure(std::uint64_t, Status) override {}

  void Shut() {
    std::lock_guard lock(mu_);
    shut_ = true;
    blocked_once_ = false;
  }
  // Waits until a completion is held at the gate.
  bool AwaitBlocked() {
    std::unique_lock lock(mu_);
    return cv_.wait_for(lock, kWait, [&] { return blocked_; });
  }
  void Open() {
    std::lock_guard lock(mu_);
    shut_ = false;
    cv_.notify_all();
  }
  // The one completion of `token` (waits for it); a second one fails the test.
  Status Await(std::uint64_t token) {
    std::unique_lock lock(mu_);
    if (!cv_.wait_for(lock, kWait, [&] { return done_.count(token) > 0; })) {
      return TimeoutError("no completion for batch " + std::to_string(token));
    }
    EXPECT_EQ(done_[token].size(), 1u) << "batch " << token << " completed more than once";
    return done_[token].front();
  }
  std::size_t Count(std::uint64_t token) {
    std::lock_guard lock(mu_);
    return done_.count(token) ? done_[token].size() : 0;
  }
  std::size_t Total() {
    std::lock_guard lock(mu_);
    std::size_t n = 0;
    for (const auto& [token, statuses] : done_) n += statuses.size();
    return n;
  }

 private:
  std::mutex mu_;
  std::condition_variable cv_;
  bool shut_ = false;
  bool blocked_once_ = false;
  bool blocked_ = false;
  std::map<std::uint64_t, std::vector<Status>> done_;
};

// A page-aligned host buffer.
struct Buffer {
  Buffer() : storage(kSize + 4096) {
    auto base = reinterpret_cast<std::uintptr_t>(storage.data());
    data = reinterpret_cast<std::uint8_t*>((base + 4095) & ~std::uintptr_t{4095});
  }
  void Fill(std::uint8_t seed) {
    for (std::size_t i = 0; i < kSize; ++i) data[i] = static_cast<std::uint8_t>(seed + i * 13);
  }
  MemoryRange range() const { return {reinterpret_cast<std::uint64_t>(data), kSize}; }
  std::vector<std::uint8_t> storage;
  std::uint8_t* data = nullptr;
};

// How to build one backend of a kind, and what is special about it.
struct Kind {
  std::string name;
  // "" when it can run here, else why not.
  std::function<std::string()> unavailable;
  // The backend for side `side` (0 = A, 1 = B).
  std::function<Result<std::unique_ptr<Backend>>(int side, std::shared_ptr<CompletionSink>)> make;
  // Checks that a misspelt option key of this backend is refused, naming it and the known keys.
  std::function<void()> unknown_option_refused;
  // Whether DisconnectPeer and DeregisterMemory need the thread the gate holds (UCX runs them
  // on its progress thread): they are then called from another thread while the gate opens, and
  // the held batch may finish before they run.
  bool calls_run_on_progress_thread = false;
  // Whether the transport finishes a posted batch at once (the fake MoRI): one pending at
  // DisconnectPeer has then finished in the transport, and completes OK (backend.hpp).
  bool finishes_when_posted = false;
};

void PrintTo(const Kind& kind, std::ostream* os) { *os << kind.name; }

BackendOptions UcxOptions() { return moriio_native::testing_support::UcxTestOptions(); }

// Refusal of `key` by CreateBackend(name): InvalidArgument naming the key and every known key.
void ExpectUnknownKeyRefused(const std::string& name, BackendOptions options,
                             const std::string& key) {
  options[key] = "1";
  auto created = CreateBackend(name, options, std::make_shared<GateSink>());
  ASSERT_FALSE(created.ok());
  const Status& st = created.status();
  EXPECT_EQ(st.code(), StatusCode::kInvalidArgument) << st.ToString();
  EXPECT_NE(st.message().find("unknown option '" + key + "' for backend " + name + "; known: "),
            std::string::npos)
      << st.ToString();
  auto known = BackendOptionKeys(name);
  ASSERT_TRUE(known.ok()) << known.status().ToString();
  EXPECT_FALSE(known->empty());
  for (const std::string& k : *known) {
    EXPECT_NE(st.message().find(k), std::string::npos) << k << " missing from " << st.ToString();
  }
}

std::vector<Kind> Kinds() {
  std::vector<Kind> kinds;
  kinds.push_back(
      {"loopback", [] { return std::string(); },
       [](int, std::shared_ptr<CompletionSink> sink) {
         return CreateBackend("loopback", {}, std::move(sink));
       },
       [] { ExpectUnknownKeyRefused("loopback", {}, "loopback_delay"); }, false});
  // Loopback with cells off: the contract of a backend that takes runs only.
  kinds.push_back(
      {"loopback_runs", [] { return std::string(); },
       [](int, std::shared_ptr<CompletionSink> sink) {
         return CreateBackend("loopback", {{"loopback_cells", "0"}}, std::move(sink));
       },
       [] { ExpectUnknownKeyRefused("loopback", {{"loopback_cells", "0"}}, "loopback_cell"); },
       false});
  // Loopback with stamped batches on: the contract of a backend that takes them.
  kinds.push_back(
      {"loopback_stamps", [] { return std::string(); },
       [](int, std::shared_ptr<CompletionSink> sink) {
         return CreateBackend("loopback", {{"loopback_stamps", "1"}}, std::move(sink));
       },
       [] { ExpectUnknownKeyRefused("loopback", {{"loopback_stamps", "1"}}, "loopback_stamp"); },
       false});
  kinds.push_back({"ucx",
                   [] {
                     for (const auto& b : AvailableBackends(UcxOptions())) {
                       if (b.name == "ucx") return b.available ? std::string() : b.reason;
                     }
                     return std::string("the core knows no ucx backend");
                   },
                   [](int, std::shared_ptr<CompletionSink> sink) {
                     return CreateBackend("ucx", UcxOptions(), std::move(sink));
                   },
                   [] { ExpectUnknownKeyRefused("ucx", UcxOptions(), "ucx_tsl"); }, true});
  kinds.push_back(
      {"mori_fake", [] { return std::string(); },
       [](int side, std::shared_ptr<CompletionSink> sink) {
         auto api = std::make_unique<fake::FakeMoriApi>(std::make_shared<fake::World>(),
                                                        side == 0 ? "A" : "B");
         return mb::CreateMoriBackendWithApi(std::move(api), mb::MoriOptions{}, std::move(sink));
       },
       [] {
         // The fake is not a plugin: check the plugin's key list and the parser agree instead.
         auto parsed = mb::ParseMoriOptions({{"mori_prot", "1"}});
         ASSERT_FALSE(parsed.ok());
         EXPECT_EQ(parsed.status().code(), StatusCode::kInvalidArgument);
         EXPECT_NE(parsed.status().message().find("'mori_prot'"), std::string::npos);
         for (const char* const* k = mb::kMoriOptionKeys; *k != nullptr; ++k) {
           BackendOptions one{{*k, "1"}};
           auto r = mb::ParseMoriOptions(one);
           EXPECT_TRUE(r.ok() || r.status().message().find("unknown") == std::string::npos)
               << *k << ": " << r.status().ToString();
         }
       },
       false, true});
  return kinds;
}

class BackendContract : public ::testing::TestWithParam<Kind> {
 protected:
  void SetUp() override {
    const std::string why = GetParam().unavailable();
    if (!why.empty()) GTEST_SKIP() << GetParam().name << " cannot run here: " << why;
    a_sink_ = std::make_shared<GateSink>();
    b_sink_ = std::make_shared<GateSink>();
    auto a = GetParam().make(0, a_sink_);
    ASSERT_TRUE(a.ok()) << a.status().ToString();
    a_ = std::move(*a);
    auto b = GetParam().make(1, b_sink_);
    ASSERT_TRUE(b.ok()) << b.status().ToString();
    b_ = std::move(*b);
    a_buf_.Fill(11);
    b_buf_.Fill(99);
    auto local = a_->RegisterMemory(a_buf_.range());
    ASSERT_TRUE(local.ok()) << local.status().ToString();
    local_ = local->handle;
    auto remote_reg = b_->RegisterMemory(b_buf_.range());
    ASSERT_TRUE(remote_reg.ok()) << remote_reg.status().ToString();
    b_region_ = remote_reg->handle;
    auto address = b_->LocalAddress();
    ASSERT_TRUE(address.ok()) << address.status().ToString();
    auto peer = a_->ConnectPeer(*address);
    ASSERT_TRUE(peer.ok()) << peer.status().ToString();
    peer_ = *peer;
    auto remote = a_->ImportRemoteRegion(peer_, b_buf_.range(), remote_reg->remote_key);
    ASSERT_TRUE(remote.ok()) << remote.status().ToString();
    remote_ = *remote;
  }

  void TearDown() override {
    if (a_sink_) a_sink_->Open();
    a_.reset();
    b_.reset();
  }

  std::shared_ptr<Batch> MakeBatch(TransferOp op, std::vector<std::int64_t> lo,
                                   std::vector<std::int64_t> ro, std::vector<std::int64_t> sz,
                                   std::uint64_t token) const {
    return moriio_native::testing_support::MakeBatch(op, local_, peer_, remote_, std::move(lo),
                                                     std::move(ro), std::move(sz), token);
  }

  // Shuts the gate and submits a plug batch whose completion blocks A's completing thread.
  void Plug(std::uint64_t token) {
    a_sink_->Shut();
    ASSERT_TRUE(a_->Submit(MakeBatch(TransferOp::kRead, {0}, {0}, {64}, token)).ok());
    ASSERT_TRUE(a_sink_->AwaitBlocked()) << "the plug batch never completed";
  }

  struct Refused {
    std::shared_ptr<Batch> batch;
    StatusCode code;
    std::string words;
  };

  // Submits every batch of `bad` and expects its refusal, naming the batch and `words`; then a
  // plain batch (`plain`) completes as A's `total`-th completion (a refused batch never
  // completes), B's bytes are still `want_b` (it moved nothing), and A's region is free again.
  void ExpectRefusedAndNothingMoved(const std::vector<Refused>& bad, std::uint64_t plain,
                                    std::size_t total, const std::vector<std::uint8_t>& want_b) {
    for (const Refused& b : bad) {
      const Status st = a_->Submit(b.batch);
      EXPECT_EQ(st.code(), b.code) << "batch " << b.batch->token << ": " << st.ToString();
      EXPECT_NE(st.message().find(b.words), std::string::npos) << st.ToString();
      EXPECT_NE(st.message().find("batch " + std::to_string(b.batch->token)), std::string::npos)
          << st.ToString();
    }
    ASSERT_TRUE(a_->Submit(MakeBatch(TransferOp::kRead, {0}, {0}, {8}, plain)).ok());
    EXPECT_TRUE(a_sink_->Await(plain).ok());
    EXPECT_EQ(a_sink_->Total(), total) << "a refused batch must not complete";
    EXPECT_EQ(std::memcmp(b_buf_.data, want_b.data(), kSize), 0) << "a refused batch moved bytes";
    EXPECT_TRUE(a_->DeregisterMemory(local_).ok()) << "completed batches hold no region";
  }

  std::shared_ptr<GateSink> a_sink_, b_sink_;
  Buffer a_buf_, b_buf_;  // before the backends: outlive them
  std::unique_ptr<Backend> a_, b_;
  std::uint64_t local_ = 0, b_region_ = 0, peer_ = 0, remote_ = 0;
};

TEST_P(BackendContract, RegisterAndDeregister) {
  EXPECT_TRUE(a_->DeregisterMemory(local_).ok());
  EXPECT_EQ(a_->DeregisterMemory(local_).code(), StatusCode::kNotFound);
  // A batch naming the deregistered region is refused and never completes.
  EXPECT_EQ(a_->Submit(MakeBatch(TransferOp::kRead, {0}, {0}, {8}, 1)).code(),
            StatusCode::kNotFound);
  auto again = a_->RegisterMemory(a_buf_.range());
  ASSERT_TRUE(again.ok()) << again.status().ToString();
  local_ = again->handle;
  ASSERT_TRUE(a_->Submit(MakeBatch(TransferOp::kRead, {0}, {0}, {8}, 2)).ok());
  EXPECT_TRUE(a_sink_->Await(2).ok());
  EXPECT_EQ(a_sink_->Count(1), 0u);
}

TEST_P(BackendContract, DeregisterWhileInFlightIsRefusedAndChangesNothing) {
  ASSERT_NO_FATAL_FAILURE(Plug(1));
  ASSERT_TRUE(a_->Submit(MakeBatch(TransferOp::kRead, {0}, {0}, {4096}, 2)).ok());
  if (GetParam().calls_run_on_progress_thread) {
    auto pending = std::async(std::launch::async, [&] { return a_->DeregisterMemory(local_); });
    a_sink_->Open();
    const Status st = pending.get();
    if (st.ok()) {
      // Only once the held batch had completed (it may run before the call reaches the thread).
      EXPECT_EQ(a_sink_->Count(2), 1u) << "deregistered while batch 2 was in flight";
      return;
    }
    EXPECT_EQ(st.code(), StatusCode::kFailedPrecondition) << st.ToString();
  } else {
    const Status refused = a_->DeregisterMemory(local_);
    EXPECT_EQ(refused.code(), StatusCode::kFailedPrecondition) << refused.ToString();
    a_sink_->Open();
  }
  EXPECT_TRUE(a_sink_->Await(1).ok());
  EXPECT_TRUE(a_sink_->Await(2).ok()) << "the refused deregistration must leave the region";
  EXPECT_EQ(std::memcmp(a_buf_.data, b_buf_.data, 4096), 0);
  EXPECT_TRUE(a_->DeregisterMemory(local_).ok()) << "completed batches hold no region";
}

TEST_P(BackendContract, EmptyBatchCompletesOkWithoutMovingBytes) {
  const std::vector<std::uint8_t> before(a_buf_.data, a_buf_.data + kSize);
  ASSERT_TRUE(a_->Submit(MakeBatch(TransferOp::kRead, {}, {}, {}, 7)).ok());
  const Status st = a_sink_->Await(7);
  EXPECT_TRUE(st.ok()) << st.ToString();
  EXPECT_EQ(std::memcmp(a_buf_.data, before.data(), kSize), 0);
  EXPECT_TRUE(a_->DeregisterMemory(local_).ok());
}

TEST_P(BackendContract, BadRunsAreRefusedAtSubmitNamingTheRunAndNothingStarts) {
  const std::vector<std::uint8_t> a_before(a_buf_.data, a_buf_.data + kSize);
  const std::vector<std::uint8_t> b_before(b_buf_.data, b_buf_.data + kSize);
  struct Bad {
    std::vector<std::int64_t> lo, ro, sz;
    StatusCode code;
    std::string words;
  };
  const std::int64_t n = kSize;
  const std::vector<Bad> bad = {
      {{0, 64}, {0}, {8, 8}, StatusCode::kInvalidArgument, "must be equal"},
      {{0, 64}, {0, 64}, {8, 0}, StatusCode::kInvalidArgument, "run 1"},
      {{0, 64}, {0, 64}, {8, -8}, StatusCode::kInvalidArgument, "run 1"},
      {{-1}, {0}, {8}, StatusCode::kInvalidArgument, "run 0"},
      {{0, 0, 0}, {0, 0, -64}, {8, 8, 8}, StatusCode::kInvalidArgument, "run 2"},
      {{0, n - 4}, {0, 0}, {8, 8}, StatusCode::kOutOfRange, "run 1"},
      {{0}, {n}, {1}, StatusCode::kOutOfRange, "run 0"},
      {{0}, {0}, {n + 1}, StatusCode::kOutOfRange, "run 0"},
      {{0}, {INT64_MAX - 2}, {8}, StatusCode::kOutOfRange, "run 0"},
      {{INT64_MAX}, {0}, {INT64_MAX}, StatusCode::kOutOfRange, "run 0"},
      // The first bad run is named, past good ones and before other bad ones.
      {{0, 8, 16, 24, 32}, {0, 8, 16, n, -8}, {8, 8, 8, 8, 8}, StatusCode::kOutOfRange, "run 3"},
      {{0, 8, 16, n - 8}, {0, 8, 16, n - 8}, {8, 8, 8, 9}, StatusCode::kOutOfRange, "run 3"},
      {{0, 8, 16}, {0, 8, 16}, {8, INT64_MIN, 8}, StatusCode::kInvalidArgument, "run 1"},
  };
  std::uint64_t token = 100;
  for (const Bad& b : bad) {
    // A WRITE: a refused one that had started would change B's buffer.
    const Status st = a_->Submit(MakeBatch(TransferOp::kWrite, b.lo, b.ro, b.sz, ++token));
    EXPECT_EQ(st.code(), b.code) << "batch " << token << ": " << st.ToString();
    EXPECT_NE(st.message().find(b.words), std::string::npos) << st.ToString();
    EXPECT_NE(st.message().find("batch " + std::to_string(token)), std::string::npos)
        << st.ToString();
  }
  auto wrong_region = MakeBatch(TransferOp::kWrite, {0}, {0}, {8}, ++token);
  wrong_region->local_region += 1000;
  EXPECT_EQ(a_->Submit(wrong_region).code(), StatusCode::kNotFound);
  auto wrong_remote = MakeBatch(TransferOp::kWrite, {0}, {0}, {8}, ++token);
  wrong_remote->remote_region += 1000;
  EXPECT_EQ(a_->Submit(wrong_remote).code(), StatusCode::kNotFound);
  EXPECT_EQ(a_->Submit(nullptr).code(), StatusCode::kInvalidArgument);
  // A good batch after all that still works; the refused ones never complete.
  ASSERT_TRUE(a_->Submit(MakeBatch(TransferOp::kRead, {8192}, {8192}, {64}, 1)).ok());
  EXPECT_TRUE(a_sink_->Await(1).ok());
  EXPECT_EQ(a_sink_->Total(), 1u) << "a refused Submit must not complete";
  EXPECT_EQ(std::memcmp(b_buf_.data, b_before.data(), kSize), 0) << "a refused WRITE moved bytes";
  EXPECT_EQ(std::memcmp(a_buf_.data, a_before.data(), 8192), 0);
  EXPECT_TRUE(a_->DeregisterMemory(local_).ok()) << "refused batches hold no region";
}

TEST_P(BackendContract, ReadAndWriteMoveExactlyTheRunsAndCompleteOnce) {
  std::vector<std::uint8_t> want_a(a_buf_.data, a_buf_.data + kSize);
  std::vector<std::uint8_t> want_b(b_buf_.data, b_buf_.data + kSize);
  // READ: three runs of different sizes, out of order, B -> A.
  const std::vector<std::int64_t> lo = {40960, 0, 12345}, ro = {100, 30000, 65536 - 777},
                                  sz = {4096, 1, 777};
  ASSERT_TRUE(a_->Submit(MakeBatch(TransferOp::kRead, lo, ro, sz, 1)).ok());
  for (std::size_t i = 0; i < lo.size(); ++i) {
    std::memcpy(want_a.data() + lo[i], want_b.data() + ro[i], sz[i]);
  }
  ASSERT_TRUE(a_sink_->Await(1).ok());
  EXPECT_EQ(std::memcmp(a_buf_.data, want_a.data(), kSize), 0) << "READ bytes wrong";
  // WRITE: A -> B, many small runs.
  std::vector<std::int64_t> wlo, wro, wsz;
  for (std::int64_t i = 0; i < 200; ++i) {
    wlo.push_back(i * 300);
    wro.push_back(kSize - (i + 1) * 320);
    wsz.push_back(1 + i % 250);
  }
  ASSERT_TRUE(a_->Submit(MakeBatch(TransferOp::kWrite, wlo, wro, wsz, 2)).ok());
  for (std::size_t i = 0; i < wlo.size(); ++i) {
    std::memcpy(want_b.data() + wro[i], want_a.data() + wlo[i], wsz[i]);
  }
  ASSERT_TRUE(a_sink_->Await(2).ok());
  EXPECT_EQ(std::memcmp(b_buf_.data, want_b.data(), kSize), 0) << "WRITE bytes wrong";
  // Many batches at once: exactly one completion each.
  for (std::uint64_t t = 10; t < 60; ++t) {
    ASSERT_TRUE(a_->Submit(MakeBatch(TransferOp::kRead, {0}, {0}, {512}, t)).ok());
  }
  for (std::uint64_t t = 10; t < 60; ++t) EXPECT_TRUE(a_sink_->Await(t).ok());
  EXPECT_EQ(a_sink_->Total(), 52u);
  EXPECT_EQ(b_sink_->Total(), 0u) << "the passive side completes nothing";
}

// An NHD block (tokens outer, heads inner) against an HND one: 2 planes x 4 heads x 8 tokens
// of 16-byte cells, 1 KiB per block on both sides.
CellGeometry NhdHndCells() {
  return {2, 4, 8, 16, {1024, 512, 16, 64}, {1024, 512, 128, 16}};
}

std::shared_ptr<Batch> WithCells(std::shared_ptr<Batch> b, const CellGeometry& g,
                                 std::vector<std::int64_t> local, std::vector<std::int64_t> remote) {
  b->cells = BatchCells{g, {std::move(local), std::move(remote)}};
  return b;
}

TEST_P(BackendContract, CellBatchesAreTakenExactlyWhereAcceptsCellsSaysSo) {
  const CellGeometry g = NhdHndCells();
  EXPECT_FALSE(a_->AcceptsCells(local_ + 1000, remote_, g)) << "unknown local region";
  EXPECT_FALSE(a_->AcceptsCells(local_, remote_ + 1000, g)) << "unknown remote region";
  std::vector<std::uint8_t> want_a(a_buf_.data, a_buf_.data + kSize);
  std::vector<std::uint8_t> want_b(b_buf_.data, b_buf_.data + kSize);
  const std::vector<std::int64_t> lo = {0, 3072, 10240}, ro = {5120, 1024, 64512};
  if (!a_->AcceptsCells(local_, remote_, g)) {
    // Runs only here (host memory on ucx, mori): a cell batch is refused and moves nothing.
    ExpectRefusedAndNothingMoved(
        {{WithCells(MakeBatch(TransferOp::kWrite, {}, {}, {}, 5), g, lo, ro),
          StatusCode::kFailedPrecondition, "cell batch"}},
        6, 1, want_b);
    return;
  }
  // READ B -> A and WRITE A -> B: exactly the bytes of the CPU reference.
  ASSERT_TRUE(a_->Submit(WithCells(MakeBatch(TransferOp::kRead, {}, {}, {}, 1), g, lo, ro)).ok());
  CopyBlockCells(g, {lo, ro}, reinterpret_cast<std::byte*>(want_a.data()),
                 reinterpret_cast<std::byte*>(want_b.data()), CellCopyDirection::kRemoteToLocal);
  ASSERT_TRUE(a_sink_->Await(1).ok());
  EXPECT_EQ(std::memcmp(a_buf_.data, want_a.data(), kSize), 0) << "cell READ bytes wrong";
  const std::vector<std::int64_t> wlo = {1024, 7168}, wro = {0, 2048};
  ASSERT_TRUE(a_->Submit(WithCells(MakeBatch(TransferOp::kWrite, {}, {}, {}, 2), g, wlo, wro)).ok());
  CopyBlockCells(g, {wlo, wro}, reinterpret_cast<std::byte*>(want_a.data()),
                 reinterpret_cast<std::byte*>(want_b.data()), CellCopyDirection::kLocalToRemote);
  ASSERT_TRUE(a_sink_->Await(2).ok());
  EXPECT_EQ(std::memcmp(b_buf_.data, want_b.data(), kSize), 0) << "cell WRITE bytes wrong";
  // No blocks: completes OK without moving bytes.
  ASSERT_TRUE(a_->Submit(WithCells(MakeBatch(TransferOp::kWrite, {}, {}, {}, 3), g, {}, {})).ok());
  EXPECT_TRUE(a_sink_->Await(3).ok());
  EXPECT_EQ(std::memcmp(b_buf_.data, want_b.data(), kSize), 0);
  // Bad cell batches: refused at Submit, naming the batch (and the block), nothing moves.
  CellGeometry empty = g;
  empty.tokens = 0;
  CellGeometry huge = g;
  huge.remote.head_stride = INT64_MAX / 2;
  const std::int64_t n = kSize;
  const std::vector<Refused> bad = {
      {WithCells(MakeBatch(TransferOp::kWrite, {0}, {0}, {8}, 101), g, {0}, {0}),
       StatusCode::kInvalidArgument, "cells and runs"},
      {WithCells(MakeBatch(TransferOp::kWrite, {}, {}, {}, 102), empty, {0}, {0}),
       StatusCode::kInvalidArgument, "tokens 0"},
      {WithCells(MakeBatch(TransferOp::kWrite, {}, {}, {}, 103), g, {0, 1024}, {0}),
       StatusCode::kInvalidArgument, "must be equal"},
      {WithCells(MakeBatch(TransferOp::kWrite, {}, {}, {}, 104), g, {0, 1024}, {0, n - 1023}),
       StatusCode::kOutOfRange, "block 1"},
      {WithCells(MakeBatch(TransferOp::kWrite, {}, {}, {}, 105), g, {-1}, {0}),
       StatusCode::kOutOfRange, "block 0"},
      {WithCells(MakeBatch(TransferOp::kWrite, {}, {}, {}, 106), g, {0, 0, INT64_MAX - 8},
                 {0, 0, 0}),
       StatusCode::kOutOfRange, "block 2"},
      {WithCells(MakeBatch(TransferOp::kWrite, {}, {}, {}, 107), huge, {0}, {0}),
       StatusCode::kInvalidArgument, "overflow"},
  };
  ExpectRefusedAndNothingMoved(bad, 4, 4, want_b);
}

std::shared_ptr<Batch> WithStamps(std::shared_ptr<Batch> b, BatchStamps stamps) {
  b->stamps = std::move(stamps);
  return b;
}

// Two layers over 1 KiB blocks: one of two runs per block (K and V halves, placed differently on
// each side), one of a single run; the second layer starts 16 KiB into each region.
BatchStamps TwoLayerStamps(std::vector<std::int64_t> local_ids,
                           std::vector<std::int64_t> remote_ids) {
  BatchStamps s;
  s.runs = {{0, 512, 512}, {512, 0, 512}, {0, 0, 1024}};
  const auto n = static_cast<std::uint64_t>(local_ids.size());
  s.layers = {{0, 0, 1024, 1024, 0, n, 0, 2}, {16384, 16384, 1024, 2048, 0, n, 2, 1}};
  s.local_ids = std::move(local_ids);
  s.remote_ids = std::move(remote_ids);
  return s;
}

TEST_P(BackendContract, StampedBatchesAreTakenExactlyWhereAcceptsStampsSaysSo) {
  EXPECT_FALSE(a_->AcceptsStamps(local_ + 1000, remote_)) << "unknown local region";
  EXPECT_FALSE(a_->AcceptsStamps(local_, remote_ + 1000)) << "unknown remote region";
  std::vector<std::uint8_t> want_a(a_buf_.data, a_buf_.data + kSize);
  std::vector<std::uint8_t> want_b(b_buf_.data, b_buf_.data + kSize);
  const BatchStamps read = TwoLayerStamps({3, 0, 7}, {5, 1, 2});
  if (!a_->AcceptsStamps(local_, remote_)) {
    ExpectRefusedAndNothingMoved({{WithStamps(MakeBatch(TransferOp::kWrite, {}, {}, {}, 5), read),
                                   StatusCode::kFailedPrecondition, "stamped batch"}},
                                 6, 1, want_b);
    return;
  }
  // READ B -> A and WRITE A -> B: exactly the bytes of the CPU reference.
  ASSERT_TRUE(a_->Submit(WithStamps(MakeBatch(TransferOp::kRead, {}, {}, {}, 1), read)).ok());
  CopyStampedRuns(read, reinterpret_cast<std::byte*>(want_a.data()),
                  reinterpret_cast<std::byte*>(want_b.data()), CellCopyDirection::kRemoteToLocal);
  ASSERT_TRUE(a_sink_->Await(1).ok());
  EXPECT_EQ(std::memcmp(a_buf_.data, want_a.data(), kSize), 0) << "stamped READ bytes wrong";
  const BatchStamps write = TwoLayerStamps({1, 9}, {0, 3});
  ASSERT_TRUE(a_->Submit(WithStamps(MakeBatch(TransferOp::kWrite, {}, {}, {}, 2), write)).ok());
  CopyStampedRuns(write, reinterpret_cast<std::byte*>(want_a.data()),
                  reinterpret_cast<std::byte*>(want_b.data()), CellCopyDirection::kLocalToRemote);
  ASSERT_TRUE(a_sink_->Await(2).ok());
  EXPECT_EQ(std::memcmp(b_buf_.data, want_b.data(), kSize), 0) << "stamped WRITE bytes wrong";
  // No blocks: completes OK without moving bytes.
  ASSERT_TRUE(
      a_->Submit(WithStamps(MakeBatch(TransferOp::kWrite, {}, {}, {}, 3), TwoLayerStamps({}, {})))
          .ok());
  EXPECT_TRUE(a_sink_->Await(3).ok());
  EXPECT_EQ(std::memcmp(b_buf_.data, want_b.data(), kSize), 0);
  // Bad stamped batches: refused at Submit, naming the batch (and the layer), nothing moves.
  auto bad_stamps = [](auto change) {
    BatchStamps s = TwoLayerStamps({0, 1}, {0, 1});
    change(s);
    return s;
  };
  auto batch = [&](std::uint64_t token, BatchStamps s) {
    return WithStamps(MakeBatch(TransferOp::kWrite, {}, {}, {}, token), std::move(s));
  };
  const std::vector<Refused> bad = {
      {WithStamps(MakeBatch(TransferOp::kWrite, {0}, {0}, {8}, 101), TwoLayerStamps({0}, {0})),
       StatusCode::kInvalidArgument, "stamps and runs"},
      {batch(102, bad_stamps([](BatchStamps& s) { s.remote_ids.pop_back(); })),
       StatusCode::kInvalidArgument, "must be equal"},
      {batch(103, bad_stamps([](BatchStamps& s) { s.layers[1].num_runs = 2; })),
       StatusCode::kInvalidArgument, "layer 1 names runs [2, +2)"},
      {batch(104, bad_stamps([](BatchStamps& s) { s.layers[0].num_blocks = 3; })),
       StatusCode::kInvalidArgument, "layer 0 names block ids"},
      {batch(105, bad_stamps([](BatchStamps& s) { s.remote_ids[1] = -1; })),
       StatusCode::kInvalidArgument, "negative block id"},
      {batch(106, bad_stamps([](BatchStamps& s) { s.runs[1].size = 0; })),
       StatusCode::kInvalidArgument, "run 1 (local 512, remote 0, size 0)"},
      {batch(107, bad_stamps([](BatchStamps& s) { s.local_ids[1] = 64; })),
       StatusCode::kOutOfRange, "layer 0"},
      {batch(108, bad_stamps([](BatchStamps& s) { s.remote_ids[0] = 24; })),
       StatusCode::kOutOfRange, "layer 1"},
      {batch(109, bad_stamps([](BatchStamps& s) {
         s.layers[1].remote_stride = INT64_MAX / 2;  // id 3 x stride overflows
         s.remote_ids[1] = 3;
       })),
       StatusCode::kOutOfRange, "layer 1"},
      {batch(111, bad_stamps([](BatchStamps& s) { s.runs.push_back({0, 0, 0}); })),
       StatusCode::kInvalidArgument, "run 3"},  // no layer uses it: refused all the same
      {batch(112, bad_stamps([](BatchStamps& s) {
         s.layers.resize(kMaxStampLayers + 1, s.layers[0]);
       })),
       StatusCode::kInvalidArgument, "65536 layers"},
      {batch(110, bad_stamps([](BatchStamps& s) { s.layers[0].local_base = -8; })),
       StatusCode::kInvalidArgument, "negative base"},
  };
  ExpectRefusedAndNothingMoved(bad, 4, 4, want_b);
}

TEST_P(BackendContract, DisconnectCompletesPendingBatchesWithErrors) {
  ASSERT_NO_FATAL_FAILURE(Plug(1));
  ASSERT_TRUE(a_->Submit(MakeBatch(TransferOp::kWrite, {0}, {0}, {4096}, 2)).ok());
  Status disconnected;
  if (GetParam().calls_run_on_progress_thread) {
    auto pending = std::async(std::launch::async, [&] { return a_->DisconnectPeer(peer_); });
    a_sink_->Open();
    disconnected = pending.get();
  } else {
    disconnected = a_->DisconnectPeer(peer_);
    a_sink_->Open();
  }
  EXPECT_TRUE(disconnected.ok()) << disconnected.ToString();
  EXPECT_TRUE(a_sink_->Await(1).ok());
  const Status held = a_sink_->Await(2);
  if (GetParam().calls_run_on_progress_thread || GetParam().finishes_when_posted) {
    // The batch may have run before the disconnect reached the progress thread, or been posted
    // (and so finished) before the disconnect came: a batch the transport had finished
    // completes OK (backend.hpp).
    EXPECT_TRUE(held.ok() || held.code() == StatusCode::kAborted ||
                held.code() == StatusCode::kTransport)
        << held.ToString();
  } else {
    EXPECT_TRUE(held.code() == StatusCode::kAborted || held.code() == StatusCode::kTransport)
        << "a batch pending at disconnect must fail: " << held.ToString();
  }
  // The peer and its imports are gone: nothing more is accepted for them.
  const Status after = a_->Submit(MakeBatch(TransferOp::kRead, {0}, {0}, {8}, 3));
  EXPECT_FALSE(after.ok());
  EXPECT_EQ(a_->DisconnectPeer(peer_).code(), StatusCode::kNotFound);
  EXPECT_TRUE(a_->DeregisterMemory(local_).ok());
  a_.reset();
  EXPECT_EQ(a_sink_->Count(3), 0u);
  EXPECT_EQ(a_sink_->Count(2), 1u);
}

TEST_P(BackendContract, UnknownOptionIsRefusedNamingTheKnownKeys) {
  GetParam().unknown_option_refused();
}

INSTANTIATE_TEST_SUITE_P(AllBackends, BackendContract, ::testing::ValuesIn(Kinds()),
                         [](const ::testing::TestParamInfo<Kind>& p) { return p.param.name; });

// ---- option keys across backends (the shared map) -----------------------------------------------

TEST(BackendOptionsSharing, OtherBackendsKeysAreIgnoredUnknownOnesRefused) {
  auto sink = std::make_shared<GateSink>();
  // What the connector passes for backend "auto": every backend's keys in one map.
  BackendOptions shared{{"ucx_tls", "sm,self"},    {"mori_port", "1234"},
                        {"qp_per_transfer", "2"}, {"progress_mode", "busy"},
                        {"poll_mode", "event"},   {"loopback_delay_ms", "0"}};
  auto ok = CreateBackend("loopback", shared, sink);
  EXPECT_TRUE(ok.ok()) << ok.status().ToString();
  auto bad = CreateBackend("loopback", {{"qp_per_transfr", "2"}}, sink);
  EXPECT_EQ(bad.status().code(), StatusCode::kInvalidArgument);
  EXPECT_NE(bad.status().message().find("unknown option 'qp_per_transfr' for backend loopback; "
                                        "known: loopback_cells, loopback_delay_ms, "
                                        "loopback_stamps"),
            std::string::npos)
      << bad.status().ToString();
  EXPECT_EQ(BackendOptionKeys("nope").status().code(), StatusCode::kNotFound);
  auto loopback = BackendOptionKeys("loopback");
  ASSERT_TRUE(loopback.ok());
  EXPECT_EQ(*loopback, (std::vector<std::string>{"loopback_cells", "loopback_delay_ms",
                                                 "loopback_stamps"}));
}

TEST(BackendOptionsSharing, UcxListsEveryKeyItParses) {
  auto keys = BackendOptionKeys("ucx");
  if (!keys.ok()) GTEST_SKIP() << keys.status().ToString();
  for (const char* k : {"ucx_library_path", "ucx_tls", "ucx_net_devices", "progress_mode",
                        "ucx_direct_copy", "ucx_error_handling", "ucx_read_push",
                        "ucx_push_queue", "ucx_stamps", "ucx_region_check_timeout_ms",
                        "ucx_config"}) {
    EXPECT_TRUE(std::ranges::binary_search(*keys, std::string(k))) << k;
  }
}

}  // namespace
