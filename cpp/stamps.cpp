// Stamped batches (backend.hpp, BatchStamps): the check every backend's Submit makes, and the CPU
// reference the GPU kernel is tested against.

#include <algorithm>
#include <cstring>
#include <span>
#include <string>
#include <vector>

#include "checked_math.hpp"
#include "moriio_native/backend.hpp"

namespace moriio_native {

std::int64_t BatchStamps::run_count() const {
  std::int64_t n = 0;
  for (const StampedLayer& l : layers) {
    n += static_cast<std::int64_t>(l.num_blocks) * static_cast<std::int64_t>(l.num_runs);
  }
  return n;
}

void CopyStampedRuns(const BatchStamps& stamps, std::byte* local, std::byte* remote,
                     CellCopyDirection direction) {
  const bool into_local = direction == CellCopyDirection::kRemoteToLocal;
  for (const StampedLayer& l : stamps.layers) {
    for (std::uint64_t i = l.first_block; i < l.first_block + l.num_blocks; ++i) {
      std::byte* const lb = local + l.local_base + stamps.local_ids[i] * l.local_stride;
      std::byte* const rb = remote + l.remote_base + stamps.remote_ids[i] * l.remote_stride;
      for (std::uint32_t k = l.first_run; k < l.first_run + l.num_runs; ++k) {
        const CopyRun& r = stamps.runs[k];
        const auto n = static_cast<std::size_t>(r.size);
        if (into_local) {
          std::memcpy(lb + r.local, rb + r.remote, n);
        } else {
          std::memcpy(rb + r.remote, lb + r.local, n);
        }
      }
    }
  }
}

namespace {

// The smallest and largest id of ids[first, first + count); count >= 1.
struct IdRange {
  std::int64_t low = 0;
  std::int64_t high = 0;
};

IdRange RangeOf(const std::vector<std::int64_t>& ids, std::uint64_t first, std::uint64_t count) {
  const auto begin = ids.begin() + static_cast<std::ptrdiff_t>(first);
  const auto [lo, hi] = std::minmax_element(begin, begin + static_cast<std::ptrdiff_t>(count));
  return {*lo, *hi};
}

// Whether every run of one side, stamped at base + id * stride for ids in `range`, lies inside
// [0, region): the run's offset + size past the largest block start. False on overflow.
bool SideFits(std::int64_t base, std::int64_t stride, IdRange range, std::int64_t run_end,
              std::uint64_t region) {
  std::int64_t last_block = 0, end = 0;
  return detail::CheckedMul(range.high, stride, &last_block) &&
         detail::CheckedAdd(last_block, base, &end) && detail::CheckedAdd(end, run_end, &end) &&
         static_cast<std::uint64_t>(end) <= region;
}

}  // namespace

Status CheckBatchStamps(const Batch& b, std::uint64_t local_size, std::uint64_t remote_size) {
  const std::string batch = "batch " + std::to_string(b.token);
  if (!b.stamps) return InvalidArgumentError(batch + " has no stamped part");
  if (b.cells || !b.sizes.empty() || !b.local_offsets.empty() || !b.remote_offsets.empty()) {
    return InvalidArgumentError(batch +
                                " carries stamps and runs or cells; a batch carries one of them");
  }
  const BatchStamps& s = *b.stamps;
  if (s.local_ids.size() != s.remote_ids.size()) {
    return InvalidArgumentError(batch + " has " + std::to_string(s.local_ids.size()) +
                                " local and " + std::to_string(s.remote_ids.size()) +
                                " remote block ids; they must be equal");
  }
  constexpr std::size_t kMaxRuns = kMaxStampLayers * kMaxStampRunsPerLayer;
  if (s.layers.size() > kMaxStampLayers || s.runs.size() > kMaxRuns) {
    return InvalidArgumentError(batch + " has " + std::to_string(s.layers.size()) + " layers and " +
                                std::to_string(s.runs.size()) +
                                " runs; a stamped batch carries at most " +
                                std::to_string(kMaxStampLayers) + " and " +
                                std::to_string(kMaxRuns));
  }
  // Every run, also one no layer uses (the GPU plugin refuses those too): its end on each side.
  std::vector<std::int64_t> local_ends(s.runs.size()), remote_ends(s.runs.size());
  for (std::size_t k = 0; k < s.runs.size(); ++k) {
    const CopyRun& r = s.runs[k];
    if (r.local < 0 || r.remote < 0 || r.size < 1 ||
        !detail::CheckedAdd(r.local, r.size, &local_ends[k]) ||
        !detail::CheckedAdd(r.remote, r.size, &remote_ends[k])) {
      return InvalidArgumentError(batch + " run " + std::to_string(k) + " (local " +
                                  std::to_string(r.local) + ", remote " +
                                  std::to_string(r.remote) + ", size " + std::to_string(r.size) +
                                  "): offsets must be >= 0 and sizes > 0");
    }
  }
  // Consecutive layers of a request share their block range: its extremes are found once.
  std::uint64_t cached_first = 0, cached_count = 0;
  IdRange local_ids, remote_ids;
  for (std::size_t i = 0; i < s.layers.size(); ++i) {
    const StampedLayer& l = s.layers[i];
    const std::string layer = batch + " layer " + std::to_string(i);
    if (l.num_runs < 1 || l.num_runs > kMaxStampRunsPerLayer ||
        l.first_run > s.runs.size() || l.num_runs > s.runs.size() - l.first_run) {
      return InvalidArgumentError(layer + " names runs [" + std::to_string(l.first_run) + ", +" +
                                  std::to_string(l.num_runs) + ") of the batch's " +
                                  std::to_string(s.runs.size()) + " (1.." +
                                  std::to_string(kMaxStampRunsPerLayer) + " runs per layer)");
    }
    if (l.first_block > s.local_ids.size() || l.num_blocks > s.local_ids.size() - l.first_block) {
      return InvalidArgumentError(layer + " names block ids [" + std::to_string(l.first_block) +
                                  ", +" + std::to_string(l.num_blocks) + ") of the batch's " +
                                  std::to_string(s.local_ids.size()));
    }
    if ((l.local_base | l.remote_base | l.local_stride | l.remote_stride) < 0) {
      return InvalidArgumentError(layer + " has a negative base or block stride");
    }
    if (l.num_blocks == 0) continue;
    if (l.first_block != cached_first || l.num_blocks != cached_count) {
      local_ids = RangeOf(s.local_ids, l.first_block, l.num_blocks);
      remote_ids = RangeOf(s.remote_ids, l.first_block, l.num_blocks);
      cached_first = l.first_block;
      cached_count = l.num_blocks;
    }
    if (local_ids.low < 0 || remote_ids.low < 0) {
      return InvalidArgumentError(layer + " has a negative block id");
    }
    const auto runs = std::span(local_ends).subspan(l.first_run, l.num_runs);
    const auto remote_runs = std::span(remote_ends).subspan(l.first_run, l.num_runs);
    const std::int64_t local_reach = *std::ranges::max_element(runs);
    const std::int64_t remote_reach = *std::ranges::max_element(remote_runs);
    if (!SideFits(l.local_base, l.local_stride, local_ids, local_reach, local_size) ||
        !SideFits(l.remote_base, l.remote_stride, remote_ids, remote_reach, remote_size)) {
      return OutOfRangeError(layer + " (local block ids up to " + std::to_string(local_ids.high) +
                             " at base " + std::to_string(l.local_base) + " stride " +
                             std::to_string(l.local_stride) + ", remote ids up to " +
                             std::to_string(remote_ids.high) + " at base " +
                             std::to_string(l.remote_base) + " stride " +
                             std::to_string(l.remote_stride) +
                             ") has runs outside the local region (" +
                             std::to_string(local_size) + " bytes) or the remote region (" +
                             std::to_string(remote_size) + " bytes)");
    }
  }
  return Status::OK();
}

}  // namespace moriio_native
