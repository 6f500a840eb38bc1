// Tests of detail::ColumnPool, the recycled run columns of the engine's batches
// (cpp/column_pool.hpp): reuse of storage, the memory bound, batches handing their columns back
// on whichever thread drops them, and the pool outliving its creator while batches live.

#include "column_pool.hpp"

#include <gtest/gtest.h>

#include <cstdint>
#include <latch>
#include <memory>
#include <thread>
#include <utility>
#include <vector>

namespace moriio_native::detail {
namespace {

constexpr std::size_t kWord = sizeof(std::int64_t);

TEST(ColumnPool, TakeFromAnEmptyPoolAllocatesTheCapacityAskedFor) {
  auto pool = ColumnPool::Create();
  std::vector<std::int64_t> c = pool->Take(1000);
  EXPECT_TRUE(c.empty());
  EXPECT_GE(c.capacity(), 1000u);
  EXPECT_EQ(pool->allocated(), 1u);
  EXPECT_EQ(pool->reused(), 0u);
}

TEST(ColumnPool, AGivenColumnIsReusedEmptyWithItsStorage) {
  auto pool = ColumnPool::Create();
  std::vector<std::int64_t> c = pool->Take(4096);
  c.assign(4096, 7);
  const std::int64_t* storage = c.data();
  pool->Give(std::move(c));
  EXPECT_EQ(pool->kept_columns(), 1u);
  EXPECT_EQ(pool->kept_bytes(), 4096 * kWord);

  std::vector<std::int64_t> again = pool->Take(4000);
  EXPECT_EQ(again.data(), storage);  // the same pages, no new allocation
  EXPECT_TRUE(again.empty());        // nothing of the previous batch's runs is left
  EXPECT_EQ(pool->reused(), 1u);
  EXPECT_EQ(pool->kept_columns(), 0u);
  EXPECT_EQ(pool->kept_bytes(), 0u);
}

TEST(ColumnPool, TakePicksTheSmallestColumnThatFits) {
  auto pool = ColumnPool::Create();
  std::vector<std::int64_t> big = pool->Take(1 << 16), small = pool->Take(1 << 10),
                            mid = pool->Take(1 << 13);
  const std::int64_t* mid_storage = mid.data();
  const std::int64_t* big_storage = big.data();
  pool->Give(std::move(big));
  pool->Give(std::move(small));
  pool->Give(std::move(mid));

  EXPECT_EQ(pool->Take(2000).data(), mid_storage);
  // Nothing kept is large enough: a new column, and the kept ones stay.
  std::vector<std::int64_t> huge = pool->Take(1 << 17);
  EXPECT_NE(huge.data(), big_storage);
  EXPECT_GE(huge.capacity(), std::size_t{1} << 17);
  EXPECT_EQ(pool->kept_columns(), 2u);
}

TEST(ColumnPool, ColumnsPastTheBoundAreFreedNotKept) {
  auto pool = ColumnPool::Create(/*max_bytes=*/3 * 1024 * kWord);
  std::vector<std::vector<std::int64_t>> columns;
  for (int i = 0; i < 5; ++i) {
    columns.push_back(pool->Take(1024));
    columns.back().shrink_to_fit();
    columns.back().reserve(1024);
  }
  for (auto& c : columns) pool->Give(std::move(c));
  EXPECT_LE(pool->kept_bytes(), 3 * 1024 * kWord);
  EXPECT_EQ(pool->kept_columns(), 3u);

  auto none = ColumnPool::Create(/*max_bytes=*/0);
  none->Give(none->Take(16));
  EXPECT_EQ(none->kept_columns(), 0u);
  // A column without storage is not worth keeping.
  pool->Give(std::vector<std::int64_t>{});
  EXPECT_EQ(pool->kept_columns(), 3u);
}

TEST(ColumnPool, ABatchHandsItsRunAndCellColumnsBackWhenDropped) {
  auto pool = ColumnPool::Create();
  std::shared_ptr<Batch> batch = pool->NewBatch();
  batch->local_offsets = pool->Take(100);
  batch->remote_offsets = pool->Take(100);
  batch->sizes = pool->Take(100);
  batch->local_offsets.assign(100, 1);
  batch->cells.emplace();
  batch->cells->blocks.local = pool->Take(50);
  batch->cells->blocks.remote = pool->Take(50);
  const std::int64_t* local_storage = batch->local_offsets.data();
  std::shared_ptr<const Batch> held_by_backend = batch;
  batch.reset();
  EXPECT_EQ(pool->kept_columns(), 0u);  // still referenced
  held_by_backend.reset();
  EXPECT_EQ(pool->kept_columns(), 5u);
  bool found = false;
  for (int i = 0; i < 5; ++i) found |= pool->Take(100).data() == local_storage;
  EXPECT_TRUE(found);
}

TEST(ColumnPool, ABatchKeepsItsPoolAliveAfterTheOwnerLetGo) {
  auto pool = ColumnPool::Create();
  std::shared_ptr<Batch> batch = pool->NewBatch();
  batch->sizes = pool->Take(10);
  std::weak_ptr<ColumnPool> weak = pool;
  pool.reset();  // the engine is gone; a backend still holds the batch
  EXPECT_FALSE(weak.expired());
  batch.reset();  // gives its column back to the pool, which then goes (ASan: no use after free)
  EXPECT_TRUE(weak.expired());
}

TEST(ColumnPool, BatchesDroppedOnOtherThreadsWhileTheOwnerTakes) {
  // The engine's thread takes columns and builds batches while backend threads drop them.
  auto pool = ColumnPool::Create(/*max_bytes=*/64 * 4096 * kWord);
  constexpr int kThreads = 4;
  constexpr int kBatches = 400;
  std::latch start(kThreads + 1);
  std::vector<std::thread> threads;
  std::vector<std::vector<std::shared_ptr<const Batch>>> handed(kThreads);
  for (int b = 0; b < kBatches; ++b) {
    std::shared_ptr<Batch> batch = pool->NewBatch();
    batch->sizes = pool->Take(256 + static_cast<std::size_t>(b % 7) * 512);
    batch->sizes.assign(batch->sizes.capacity(), b);
    handed[b % kThreads].push_back(std::move(batch));
  }
  for (int t = 0; t < kThreads; ++t) {
    threads.emplace_back([&, t] {
      start.arrive_and_wait();
      for (auto& b : handed[t]) {
        EXPECT_EQ(b->sizes.size(), b->sizes.capacity());
        b.reset();
      }
    });
  }
  start.arrive_and_wait();
  std::uint64_t checked = 0;
  for (int i = 0; i < kBatches; ++i) {
    std::vector<std::int64_t> c = pool->Take(1024);
    EXPECT_TRUE(c.empty());
    c.assign(1024, -1);
    checked += static_cast<std::uint64_t>(c.size());
    pool->Give(std::move(c));
  }
  for (auto& th : threads) th.join();
  EXPECT_EQ(checked, std::uint64_t{kBatches} * 1024);
  EXPECT_LE(pool->kept_bytes(), 64 * 4096 * kWord);
  EXPECT_GT(pool->reused(), 0u);
}

}  // namespace
}  // namespace moriio_native::detail
