#pragma once

// Recycled offset/size columns for the engine's batches. A request's batch of 65,536 small runs
// carries three columns of 512 KiB; allocated afresh per request, every one of their pages is a
// minor fault (glibc returns freed top-of-heap memory to the kernel and the next request's
// columns fault it in again, zeroed): on machine A that was half of Engine.read's host time for
// 4 KiB runs (docs/benchmarks.md, issue 18). The engine takes a batch's columns from this pool
// and gets them back when the backend drops its last reference to the batch, so steady-state
// requests write into pages already resident. Tested on its own (tests/cpp/column_pool_test.cpp).

#include <cstddef>
#include <cstdint>
#include <memory>
#include <mutex>
#include <vector>

#include "moriio_native/backend.hpp"

namespace moriio_native::detail {

/// A bounded pool of empty `std::vector<std::int64_t>` columns with their capacity kept.
///
/// Thread-safe (one mutex, held only to pick or store a column; no allocation or free under it
/// except the free list's own growth). Memory bound: the columns it keeps hold at most
/// `max_bytes` of capacity together; a column given back past that bound is freed. Columns in
/// use (inside batches) are not counted: the pool never limits how much a caller may allocate.
class ColumnPool : public std::enable_shared_from_this<ColumnPool> {
 public:
  /// Default bound of an engine's pool: 32 full 65,536-run batches' columns (1.5 MiB each), or
  /// several concurrent requests of a large model's 64 KiB runs.
  static constexpr std::size_t kDefaultMaxBytes = std::size_t{48} << 20;

  /// A pool keeping up to `max_bytes` of column capacity (0: keeps nothing, every Take
  /// allocates). Shared ownership: batches from NewBatch keep the pool alive until destroyed.
  static std::shared_ptr<ColumnPool> Create(std::size_t max_bytes = kDefaultMaxBytes);

  /// An empty column with capacity for at least `min_size` elements: the smallest kept column
  /// that is large enough, else a new one reserved to `min_size`. Never blocks beyond the
  /// mutex; may allocate (outside it).
  std::vector<std::int64_t> Take(std::size_t min_size);

  /// Keeps `column`'s storage for a later Take (cleared), unless that would pass the bound or it
  /// has no capacity; then it is freed here. Callable from any thread (backend threads).
  void Give(std::vector<std::int64_t> column);

  /// A new Batch whose columns (local/remote offsets and sizes, and a cell part's block
  /// offsets) come back to this pool when its last shared_ptr is dropped, on whichever thread
  /// drops it. The batch's fields are default; the caller fills them (Take the columns).
  std::shared_ptr<Batch> NewBatch();

  /// Bytes of capacity the pool keeps now, and columns kept (for tests and benchmarks).
  std::size_t kept_bytes() const;
  std::size_t kept_columns() const;
  /// Takes served by a kept column, and those that had to allocate, since creation.
  std::uint64_t reused() const;
  std::uint64_t allocated() const;

  ColumnPool(const ColumnPool&) = delete;
  ColumnPool& operator=(const ColumnPool&) = delete;

 private:
  explicit ColumnPool(std::size_t max_bytes) : max_bytes_(max_bytes) {}

  const std::size_t max_bytes_;
  mutable std::mutex mu_;
  std::vector<std::vector<std::int64_t>> kept_;  // unordered; searched linearly (a few dozen)
  std::size_t kept_bytes_ = 0;
  std::uint64_t reused_ = 0;
  std::uint64_t allocated_ = 0;
};

}  // namespace moriio_native::detail
