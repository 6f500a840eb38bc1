#include "column_pool.hpp"

#include <utility>

namespace moriio_native::detail {

namespace {

std::size_t CapacityBytes(const std::vector<std::int64_t>& column) {
  return column.capacity() * sizeof(std::int64_t);
}

// Returns a batch's columns to its pool, then destroys it. Runs on the thread that drops the
// last reference (often a backend's progress thread), so it must not throw or block for long.
struct Recycler {
  std::shared_ptr<ColumnPool> pool;
  void operator()(Batch* batch) const noexcept {
    const std::unique_ptr<Batch> owned(batch);
    pool->Give(std::move(owned->local_offsets));
    pool->Give(std::move(owned->remote_offsets));
    pool->Give(std::move(owned->sizes));
    if (owned->cells) {
      pool->Give(std::move(owned->cells->blocks.local));
      pool->Give(std::move(owned->cells->blocks.remote));
    }
  }
};

}  // namespace

std::shared_ptr<ColumnPool> ColumnPool::Create(std::size_t max_bytes) {
  return std::shared_ptr<ColumnPool>(new ColumnPool(max_bytes));
}

std::vector<std::int64_t> ColumnPool::Take(std::size_t min_size) {
  {
    std::lock_guard lock(mu_);
    // The smallest that fits, so a small batch does not take the storage a large one needs.
    auto best = kept_.end();
    for (auto it = kept_.begin(); it != kept_.end(); ++it) {
      if (it->capacity() >= min_size &&
          (best == kept_.end() || it->capacity() < best->capacity())) {
        best = it;
      }
    }
    if (best != kept_.end()) {
      std::vector<std::int64_t> column = std::move(*best);
      *best = std::move(kept_.back());
      kept_.pop_back();
      kept_bytes_ -= CapacityBytes(column);
      ++reused_;
      return column;
    }
    ++allocated_;
  }
  std::vector<std::int64_t> column;
  column.reserve(min_size);
  return column;
}

void ColumnPool::Give(std::vector<std::int64_t> column) {
  const std::size_t bytes = CapacityBytes(column);
  if (bytes == 0) return;
  column.clear();
  std::lock_guard lock(mu_);
  if (kept_bytes_ + bytes > max_bytes_) return;  // freed as `column` leaves scope
  kept_.push_back(std::move(column));
  kept_bytes_ += bytes;
}

std::shared_ptr<Batch> ColumnPool::NewBatch() {
  std::unique_ptr<Batch, Recycler> batch(new Batch(), Recycler{shared_from_this()});
  return std::shared_ptr<Batch>(std::move(batch));
}

std::size_t ColumnPool::kept_bytes() const {
  std::lock_guard lock(mu_);
  return kept_bytes_;
}

std::size_t ColumnPool::kept_columns() const {
  std::lock_guard lock(mu_);
  return kept_.size();
}

std::uint64_t ColumnPool::reused() const {
  std::lock_guard lock(mu_);
  return reused_;
}

std::uint64_t ColumnPool::allocated() const {
  std::lock_guard lock(mu_);
  return allocated_;
}

}  // namespace moriio_native::detail
