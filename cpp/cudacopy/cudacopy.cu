// libmoriio_native_cudacopy.so: one gather/scatter kernel per batch of (dst, src, size) runs.
//
// Why one kernel: every cudaMemcpyAsync or UCX cuda_ipc operation costs ~5-7 us of host CPU, so
// a request of many 4-256 KiB KV runs moves at a few GB/s that way, against ~2 TB/s for device
// copies (measured, UCX 1.22, H200). Here the host writes the run table once (the engine's offset
// arrays as they are; bases are kernel arguments) into mapped pinned memory, and the grid walks
// it in chunks (a run, or a 128 KiB piece of a longer run): a batch whose every run is 16-byte
// aligned (KV caches) goes to GatherScatterAligned, where a CTA copies a group of chunks as one
// sequence of vectors (see there); any other batch to GatherScatter, where each WARP copies one
// chunk at a time, 4 KiB per step with eight 16-byte loads in flight per lane before their
// stores, when the two ends share their alignment. The host only polls an event. Batches
// alternate between two streams so one kernel's tail overlaps the next one.
//
// Why a warp and not a CTA per chunk (the first version): with a CTA of 256 threads per chunk a
// 4 KiB run was one 16-byte load per thread followed by a wait for the next table entry, read
// over PCIe from pinned memory. A warp looks up its next (up to) 32 chunks with one coalesced
// read, lane j taking entry j, and then copies them one after the other, so the table's PCIe
// latency is paid once per 32 chunks. Measured on an H200 (docs/benchmarks.md, 2026-12-01):
// 32 KiB-2 MiB runs at 0.81-0.84x of a device copy against 0.78-0.80x for the first version in
// the same runs. Unroll 4 or 8, chunks of 32/64/128 KiB, cache hints, write-combined tables and a
// bulk-copy variant (cp.async.bulk through shared memory) all landed at 0.77-0.84x; the CTA
// kernel below and its variants land at the same 0.81-0.82x. Measured since: the first size a
// process measures reaches 0.89-0.90x with either kernel, and a plain device copy timed after
// the runs is 10% slower than one timed before them, so against a copy in the same state of
// device memory the kernels are at 0.89-0.91x. At 4 KiB the host bounds it: 2.0 ns of submit
// per run here (0.83x in 65,536-run batches, 0.54x in 8,192-run ones).

#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <memory>
#include <new>
#include <vector>

#include "checksum.h"
#include "cudacopy_abi.h"

namespace {

// Compile-time tunables, so bench/h200_session.sh can measure builds with other values against
// this one in the same run (docs/benchmarks.md has the outcome).
#ifndef MORIIO_CUDACOPY_CHUNK_KIB
#define MORIIO_CUDACOPY_CHUNK_KIB 128
#endif
#ifndef MORIIO_CUDACOPY_UNROLL
#define MORIIO_CUDACOPY_UNROLL 8
#endif

// Most bytes a warp copies per chunk: 128 KiB measured 0.81-0.84x against 0.80-0.82x for 64 KiB
// and 32 KiB in the same runs (docs/benchmarks.md). The CTA kernel for aligned runs has its own
// (kAlignedChunk, below).
constexpr std::uint64_t kChunk = MORIIO_CUDACOPY_CHUNK_KIB * 1024;
constexpr int kUnroll = MORIIO_CUDACOPY_UNROLL;  // 16-byte loads in flight per lane
constexpr int kThreads = 256;
constexpr int kWarpsPerCta = kThreads / 32;
constexpr int kStreams = 2;
// A chunk entry packs (run index << kChunkBits) | chunk index within the run, so a lane finds its
// chunk with one load (a binary search over prefix sums cost ~16 dependent loads per chunk). The
// table is only built when runs of different sizes span several chunks: runs of one size (a KV
// batch) map to chunks by arithmetic.
constexpr int kChunkBits = 24;  // runs of up to 2^24 chunks (512 GiB of 32 KiB chunks)

void SetError(char* err, size_t len, const char* what, cudaError_t e) {
  if (err != nullptr && len != 0) {
    std::snprintf(err, len, "%s: %s (%s)", what, cudaGetErrorString(e), cudaGetErrorName(e));
  }
}

__device__ __forceinline__ std::uint64_t Min(std::uint64_t a, std::uint64_t b) {
  return a < b ? a : b;
}

/// `count` vectors of type V; the 32 lanes of the calling warp take part.
template <typename V>
__device__ __forceinline__ void WarpCopyVectors(unsigned char* d, const unsigned char* s,
                                                std::uint64_t count, unsigned lane) {
  constexpr unsigned kStep = kUnroll * 32;
  V* dv = reinterpret_cast<V*>(d) + lane;
  const V* sv = reinterpret_cast<const V*>(s) + lane;
  // All kUnroll loads of a step are issued before the first store: one 4 KiB step per warp is one
  // memory round trip, not kUnroll of them. Pointers advance, so each access is base + constant.
#pragma unroll 1
  for (std::uint64_t steps = count / kStep; steps != 0; --steps, dv += kStep, sv += kStep) {
    V r[kUnroll];
#pragma unroll
    for (int k = 0; k < kUnroll; ++k) r[k] = sv[k * 32];
#pragma unroll
    for (int k = 0; k < kUnroll; ++k) dv[k * 32] = r[k];
  }
  // The last partial step, predicated, in halves: a full predicated step would need its own
  // kUnroll registers besides the loop's (ptxas: 109 registers instead of 64, half the warps).
  constexpr unsigned kHalf = kStep / 2;
  const auto rest = static_cast<unsigned>(count % kStep);
#pragma unroll 1
  for (unsigned base = 0; base < rest; base += kHalf, dv += kHalf, sv += kHalf) {
    V r[kUnroll / 2];
#pragma unroll
    for (int k = 0; k < kUnroll / 2; ++k) {
      if (base + lane + k * 32 < rest) r[k] = sv[k * 32];
    }
#pragma unroll
    for (int k = 0; k < kUnroll / 2; ++k) {
      if (base + lane + k * 32 < rest) dv[k * 32] = r[k];
    }
  }
}

__device__ __forceinline__ void WarpCopyBytes(unsigned char* d, const unsigned char* s,
                                              std::uint64_t n, unsigned lane) {
  for (std::uint64_t i = lane; i < n; i += 32) d[i] = s[i];
}

/// Copies `n` bytes whose two ends are not both 16-byte aligned after the same head (4-byte or
/// byte accesses). Out of line: KV runs never take it, and inlined it costs the fast path
/// registers (fewer warps resident, fewer bytes in flight).
__device__ __noinline__ void WarpCopyUnaligned(unsigned char* d, const unsigned char* s,
                                               std::uint64_t n, unsigned lane) {
  const auto da = reinterpret_cast<std::uintptr_t>(d);
  if (((da ^ reinterpret_cast<std::uintptr_t>(s)) & 3) != 0) {
    WarpCopyBytes(d, s, n, lane);
    return;
  }
  const std::uint64_t head = Min(n, (4 - (da & 3)) & 3);
  WarpCopyBytes(d, s, head, lane);
  const std::uint64_t body = (n - head) / 4;
  WarpCopyVectors<unsigned int>(d + head, s + head, body, lane);
  const std::uint64_t done = head + body * 4;
  WarpCopyBytes(d + done, s + done, n - done, lane);
}

/// Copies `n` bytes; the 32 lanes of the calling warp take part.
__device__ __forceinline__ void WarpCopy(unsigned char* d, const unsigned char* s,
                                         std::uint64_t n, unsigned lane) {
  const auto da = reinterpret_cast<std::uintptr_t>(d);
  if (((da ^ reinterpret_cast<std::uintptr_t>(s)) & 15) != 0) {
    WarpCopyUnaligned(d, s, n, lane);
    return;
  }
  // Bytes up to the first common 16-byte aligned address, the vector body, then the tail.
  const std::uint64_t head = Min(n, (16 - (da & 15)) & 15);
  if (head != 0) WarpCopyBytes(d, s, head, lane);
  const std::uint64_t body = (n - head) / 16;
  WarpCopyVectors<uint4>(d + head, s + head, body, lane);
  const std::uint64_t done = head + body * 16;
  if (done != n) WarpCopyBytes(d + done, s + done, n - done, lane);
}

/// One chunk's copy: where from, where to, how many bytes.
struct ChunkCopy {
  unsigned char* dst;
  const unsigned char* src;
  std::uint64_t len;
};

/// table: the offset columns, dst[n] then src[n] (int64 bytes, or, when `compact`, uint32 in
/// 16-byte units: half the bytes the host writes into the mapped table), size[n] (int64; absent
/// when every run has the size `uniform`), then chunk[chunks] (see kChunkBits) unless every run
/// has the size `uniform` (chunk c is piece c % per_run of run c / per_run) or chunks == n
/// (every run is one chunk: chunk c is run c).
struct RunTable {
  std::uint64_t dst_base;
  std::uint64_t src_base;
  const std::int64_t* table;
  std::uint64_t n;
  std::uint64_t chunks;
  std::uint64_t uniform;  // the size of every run, or 0: sizes in the table
  std::uint64_t chunk_bytes;  // most bytes per chunk (a multiple of 16)
  std::uint64_t per_run;      // chunks per run when `uniform`
  bool compact;

  __device__ ChunkCopy Chunk(std::uint64_t c) const {
    const std::uint64_t offset_words = compact ? n : 2 * n;
    const std::int64_t* size = table + offset_words;
    std::uint64_t r = c;
    std::uint64_t piece = 0;
    if (uniform != 0) {
      if (per_run != 1) {  // 32-bit: the host keeps a batch below 2^32 chunks
        r = static_cast<unsigned>(c) / static_cast<unsigned>(per_run);
        piece = c - r * per_run;
      }
    } else if (chunks != n) {
      const std::uint64_t entry = reinterpret_cast<const std::uint64_t*>(table + offset_words + n)[c];
      r = entry >> kChunkBits;
      piece = entry & ((std::uint64_t{1} << kChunkBits) - 1);
    }
    const std::uint64_t off = piece * chunk_bytes;
    const std::uint64_t len = uniform ? uniform : static_cast<std::uint64_t>(size[r]);
    std::uint64_t dst = 0;
    std::uint64_t src = 0;
    if (compact) {
      const auto* units = reinterpret_cast<const std::uint32_t*>(table);
      dst = std::uint64_t{units[r]} * 16;
      src = std::uint64_t{units[n + r]} * 16;
    } else {
      dst = static_cast<std::uint64_t>(table[r]);
      src = static_cast<std::uint64_t>(table[n + r]);
    }
    return {reinterpret_cast<unsigned char*>(dst_base + dst + off),
            reinterpret_cast<const unsigned char*>(src_base + src + off),
            Min(chunk_bytes, len - off)};
  }
};

/// Warp w of W copies, in round k, the `group` consecutive chunks starting at
/// k * W * group + w * group, where group = min(32, ceil(chunks / W)): lane j loads chunk j's
/// table entry (one coalesced read per group instead of one dependent read per chunk), then the
/// warp copies the group's chunks in turn, taking each one's entry from its lane by shuffle.
/// Consecutive warps work on neighbouring chunks, which the engine sorts by destination.
__global__ void __launch_bounds__(kThreads) GatherScatter(RunTable t) {
  const unsigned lane = threadIdx.x & 31;
  const std::uint64_t warp = (std::uint64_t{blockIdx.x} * kThreads + threadIdx.x) >> 5;
  const std::uint64_t warps = std::uint64_t{gridDim.x} * kWarpsPerCta;
  const std::uint64_t group = Min(32, (t.chunks + warps - 1) / warps);
  for (std::uint64_t first = warp * group; first < t.chunks; first += warps * group) {
    const unsigned here = static_cast<unsigned>(Min(group, t.chunks - first));
    const ChunkCopy mine = lane < here ? t.Chunk(first + lane) : ChunkCopy{nullptr, nullptr, 0};
#pragma unroll 1
    for (unsigned j = 0; j < here; ++j) {
      auto* d = reinterpret_cast<unsigned char*>(
          __shfl_sync(0xffffffffu, reinterpret_cast<std::uintptr_t>(mine.dst), j));
      const auto* s = reinterpret_cast<const unsigned char*>(
          __shfl_sync(0xffffffffu, reinterpret_cast<std::uintptr_t>(mine.src), j));
      const std::uint64_t len = __shfl_sync(0xffffffffu, mine.len, j);
      WarpCopy(d, s, len, lane);
    }
  }
}

// ---- The CTA kernel for batches whose every run is 16-byte aligned (submit) -------------------
//
// Why a second kernel: the warp kernel above gives each warp its own run, so 4,224 warps stream
// 4,224 places at once in 4 KiB steps. The transposing cell kernel below, whose CTAs move
// 32 KiB tiles with every thread's loads of a step contiguous across the CTA, measured 0.88x on
// the same random-block pattern with 4 resident CTAs per SM and unroll 4. This kernel moves
// runs the same way: a CTA takes a group of consecutive chunks (about kGroupBytes), treats them
// as one sequence of 16-byte vectors and copies kRunUnroll * 4 KiB of it per step with all of
// its threads, so a 4 KiB run is one vector per thread and needs no table lookup of its own
// (one per group, loaded while the previous group is copied). Measured on the H200
// (docs/benchmarks.md, sessions 12-14): as fast as the warp kernel from 16 KiB (0.81-0.82x
// against 0.81-0.82x in the same runs, and 0.89-0.90x for both as a process's first
// measurement); unroll 8, 3 or 6 CTAs per SM, chunks and groups of 16 to 128 KiB all within a
// point of it. Kept: no slower than the warp kernel in any measurement, with one table read per
// group instead of per chunk. Taken when the two bases, every offset and every size are multiples of
// 16 (KV caches always are); any other batch goes to the warp kernel, which handles every
// alignment.
#ifndef MORIIO_CUDACOPY_RUN_UNROLL
#define MORIIO_CUDACOPY_RUN_UNROLL 4
#endif
#ifndef MORIIO_CUDACOPY_RUN_CTAS
#define MORIIO_CUDACOPY_RUN_CTAS 4
#endif
#ifndef MORIIO_CUDACOPY_GROUP_KIB
#define MORIIO_CUDACOPY_GROUP_KIB 32
#endif
#ifndef MORIIO_CUDACOPY_ALIGNED_CHUNK_KIB
#define MORIIO_CUDACOPY_ALIGNED_CHUNK_KIB 32
#endif
constexpr int kRunUnroll = MORIIO_CUDACOPY_RUN_UNROLL;  // 16-byte vectors in flight per thread
constexpr int kRunCtasPerSm = MORIIO_CUDACOPY_RUN_CTAS;  // the register budget is cut for these
constexpr unsigned kGroupMax = 32;                       // chunks per group: one warp's lanes
// Bytes a CTA's group aims at: with fewer, neighbouring CTAs work on neighbouring chunks at the
// same moment (the engine sorts runs by destination); with more, fewer table round trips.
constexpr std::uint64_t kGroupBytes = MORIIO_CUDACOPY_GROUP_KIB * 1024;
// Most bytes of a run one CTA copies in one stretch; the next piece goes to the next CTA, as the
// cell kernel's 32 KiB tiles do.
constexpr std::uint64_t kAlignedChunk = MORIIO_CUDACOPY_ALIGNED_CHUNK_KIB * 1024;

/// A group's chunks in shared memory: where each starts on both sides and the vector at which
/// it ends, counted from the group's first vector.
struct GroupEntries {
  uint4* dst[kGroupMax];
  const uint4* src[kGroupMax];
  unsigned end[kGroupMax];
};

/// Lanes of warp 0 publish the group's chunk `mine` (lane < count) into `g`, with the running
/// end of each chunk in vectors (a warp scan). Returns nothing; a barrier must follow.
__device__ __forceinline__ void PublishGroup(GroupEntries& g, const ChunkCopy& mine, unsigned lane,
                                             unsigned count) {
  unsigned end = lane < count ? static_cast<unsigned>(mine.len / 16) : 0;
#pragma unroll
  for (unsigned d = 1; d < 32; d *= 2) {
    const unsigned below = __shfl_up_sync(0xffffffffu, end, d);
    if (lane >= d) end += below;
  }
  if (lane < count) {
    g.dst[lane] = reinterpret_cast<uint4*>(mine.dst);
    g.src[lane] = reinterpret_cast<const uint4*>(mine.src);
    g.end[lane] = end;
  }
}

/// Group k of `group` consecutive chunks goes to CTA k % grid; each group's table entries are
/// loaded (by warp 0, one lane per chunk) while the CTA copies the previous group, into the other
/// half of a double-buffered shared array, so the table's PCIe round trip overlaps the copy.
__global__ void __launch_bounds__(kThreads, kRunCtasPerSm)
    GatherScatterAligned(RunTable t, unsigned group) {
  __shared__ GroupEntries entries[2];
  const unsigned lane = threadIdx.x & 31;
  const bool loader = threadIdx.x < 32;
  const std::uint64_t groups = (t.chunks + group - 1) / group;
  auto count_of = [&](std::uint64_t k) {
    return static_cast<unsigned>(Min(group, t.chunks - k * group));
  };
  auto fetch = [&](std::uint64_t k) {
    return k < groups && lane < count_of(k) ? t.Chunk(k * group + lane)
                                            : ChunkCopy{nullptr, nullptr, 0};
  };
  if (blockIdx.x >= groups) return;
  if (loader) PublishGroup(entries[0], fetch(blockIdx.x), lane, count_of(blockIdx.x));
  __syncthreads();
  unsigned buf = 0;
#pragma unroll 1
  for (std::uint64_t k = blockIdx.x; k < groups; k += gridDim.x, buf ^= 1) {
    const std::uint64_t next = k + gridDim.x;
    ChunkCopy ahead{nullptr, nullptr, 0};
    if (loader) ahead = fetch(next);  // in flight during the copy below
    const GroupEntries& g = entries[buf];
    const unsigned count = count_of(k);
    const unsigned vectors = g.end[count - 1];
    unsigned c = 0;  // the chunk of the thread's current vector; vectors only move forward
#pragma unroll 1
    for (unsigned base = threadIdx.x; base < vectors; base += kThreads * kRunUnroll) {
      uint4 r[kRunUnroll];
      uint4* to[kRunUnroll];
#pragma unroll
      for (int u = 0; u < kRunUnroll; ++u) {
        const unsigned v = base + u * kThreads;
        if (v < vectors) {
          while (v >= g.end[c]) ++c;
          const unsigned within = v - (c != 0 ? g.end[c - 1] : 0);
          r[u] = g.src[c][within];
          to[u] = g.dst[c] + within;
        }
      }
#pragma unroll
      for (int u = 0; u < kRunUnroll; ++u) {
        if (base + u * kThreads < vectors) *to[u] = r[u];
      }
    }
    // The other buffer was last read before the previous barrier: warp 0 may fill it now.
    if (loader && next < groups) PublishGroup(entries[buf ^ 1], ahead, lane, count_of(next));
    __syncthreads();
  }
}

// ---- The stamped copy (submit_stamps) -----------------------------------------------------
//
// Why: with runs, the host writes one table entry per run, and before that the engine plans
// one per run: for 4 KiB runs (a TP-8 rank's one KV head) a request of 262,144 runs cost the
// host ~3.5 ms against ~0.6 ms of copy on the H200 (docs/benchmarks.md, issue 18). A stamped
// batch carries each layer's template runs and the request's block ids once; the kernel stamps
// them. The grid's y index is the layer, whose record and runs a CTA keeps in shared memory;
// each warp takes `group` consecutive pieces at a time (a piece: one run of one block, or a
// 16 KiB chunk of a longer run), each of its first `group` lanes works out one piece's addresses
// (their ids are one coalesced read of the mapped table per warp), and the warp copies the
// pieces one after another with WarpCopy, sharing each lane's addresses by shuffle. `group` is
// 32 when the batch has pieces enough for every resident warp to take 32, fewer when not (one
// layer's WRITE): then every resident warp still gets pieces, not a few warps 32 each.

#ifndef MORIIO_CUDACOPY_STAMP_GROUP
#define MORIIO_CUDACOPY_STAMP_GROUP 32
#endif
constexpr std::uint64_t kStampChunk = 16 * 1024;
constexpr std::uint64_t kStampMaxGroup = MORIIO_CUDACOPY_STAMP_GROUP;  // pieces per warp, 1..32
constexpr std::uint32_t kMaxStampRuns = 256;  // per layer: cudacopy_abi.h, backend.hpp
constexpr int kStampLayerWords = 8;
constexpr int kStampRunWords = 4;

/// A template run as the kernel reads it: offsets, length, and the index of its first chunk
/// among all chunks of the batch's runs (so a layer's chunks are a contiguous range).
struct StampRunEntry {
  std::int64_t dst;
  std::int64_t src;
  std::int64_t size;
  std::int64_t first_chunk;
};

/// table: num_layers records of kStampLayerWords words (dst_layer, src_layer, dst_stride,
/// src_stride, first_block, num_blocks, first_run | num_runs << 32, first_chunk | chunks per
/// block << 32), then num_runs StampRunEntry, then dst ids[num_ids], then src ids[num_ids].
struct StampGrid {
  std::uint64_t dst_base;
  std::uint64_t src_base;
  const std::int64_t* table;
  std::uint32_t num_layers;
  std::uint32_t num_runs;
  std::uint64_t num_ids;
  std::uint32_t group;  // pieces a warp takes at a time, 1..32
};

__global__ void __launch_bounds__(kThreads) StampKernel(StampGrid g) {
  __shared__ std::int64_t layer[kStampLayerWords];
  __shared__ StampRunEntry runs[kMaxStampRuns];
  if (threadIdx.x < kStampLayerWords) {
    layer[threadIdx.x] = g.table[blockIdx.y * kStampLayerWords + threadIdx.x];
  }
  __syncthreads();
  const auto first_run = static_cast<std::uint32_t>(layer[6]);
  const auto num_runs = static_cast<std::uint32_t>(static_cast<std::uint64_t>(layer[6]) >> 32);
  const auto* entries = reinterpret_cast<const StampRunEntry*>(
      g.table + static_cast<std::uint64_t>(g.num_layers) * kStampLayerWords);
  for (std::uint32_t r = threadIdx.x; r < num_runs; r += kThreads) runs[r] = entries[first_run + r];
  __syncthreads();
  const std::int64_t* ids = g.table + static_cast<std::uint64_t>(g.num_layers) * kStampLayerWords +
                            static_cast<std::uint64_t>(g.num_runs) * kStampRunWords;
  const std::int64_t* dst_ids = ids + layer[4];
  const std::int64_t* src_ids = ids + g.num_ids + layer[4];
  const auto first_chunk = static_cast<std::uint32_t>(layer[7]);
  const std::uint64_t per_block = static_cast<std::uint64_t>(layer[7]) >> 32;
  const std::uint64_t pieces = static_cast<std::uint64_t>(layer[5]) * per_block;
  const unsigned lane = threadIdx.x % 32;
  const std::uint64_t stride = static_cast<std::uint64_t>(gridDim.x) * kWarpsPerCta * g.group;
  for (std::uint64_t base = (static_cast<std::uint64_t>(blockIdx.x) * kWarpsPerCta +
                             threadIdx.x / 32) * g.group;
       base < pieces; base += stride) {
    const std::uint64_t q = base + lane;
    std::uint64_t dst = 0, src = 0, len = 0;
    if (lane < g.group && q < pieces) {
      const std::uint64_t block = q / per_block;
      const std::int64_t chunk = first_chunk + static_cast<std::int64_t>(q - block * per_block);
      // The run holding the chunk: the last one whose first chunk is not after it.
      std::uint32_t lo = 0, hi = num_runs;
      while (hi - lo > 1) {
        const std::uint32_t mid = (lo + hi) / 2;
        if (runs[mid].first_chunk <= chunk) lo = mid; else hi = mid;
      }
      const StampRunEntry& run = runs[lo];
      const auto within = static_cast<std::uint64_t>(chunk - run.first_chunk) * kStampChunk;
      len = Min(kStampChunk, static_cast<std::uint64_t>(run.size) - within);
      dst = g.dst_base + layer[0] + dst_ids[block] * layer[2] + run.dst + within;
      src = g.src_base + layer[1] + src_ids[block] * layer[3] + run.src + within;
    }
    const auto count = static_cast<unsigned>(Min(g.group, pieces - base));
    for (unsigned k = 0; k < count; ++k) {
      const std::uint64_t d = __shfl_sync(0xffffffffu, dst, k);
      const std::uint64_t s = __shfl_sync(0xffffffffu, src, k);
      const std::uint64_t n = __shfl_sync(0xffffffffu, len, k);
      WarpCopy(reinterpret_cast<unsigned char*>(d), reinterpret_cast<const unsigned char*>(s), n,
               lane);
    }
  }
}

// ---- The transposing cell copy (submit_cells) -------------------------------------------------
//
// Why: a layer pair whose axes are ordered differently (prefill [2,N,B,H,D] NHD, decode
// [N,2,H,B,D] HND) has one run per (plane, head, token) cell, 256 bytes for llama3-8b: 16.8 M
// runs for a 2,048-block request, which moved at 0.016x of a device copy as runs. Here a CTA
// takes a tile of a block's cells (a range of heads x a range of tokens of one plane): it reads
// the tile in the source's memory order into shared memory, then writes it in the destination's
// memory order, so consecutive lanes touch consecutive bytes on both sides whatever the cell
// size. The host passes one pair of block offsets per block, not one entry per cell.

// Tunables as -D values so bench/h200_session.sh can measure variants against this build in the
// same run. Measured on the H200 (docs/benchmarks.md, llama3-8b NHD -> HND, 4 GiB): 4 resident
// CTAs of unroll 4 with 32 KiB tiles 0.88x of a device copy; 3 CTAs 0.88x; 2 CTAs of unroll 8
// (more bytes in flight per thread, fewer warps) 0.72x; 16 KiB tiles 0.83x; a double-buffered
// variant (cp.async into a second tile while the first is written) 0.88x at best, so not kept.
// While one CTA waits at its barrier between reading and writing its tile, the others keep
// loads in flight: resident CTAs matter more than loads per thread.
#ifndef MORIIO_CUDACOPY_CELL_UNROLL
#define MORIIO_CUDACOPY_CELL_UNROLL 4
#endif
#ifndef MORIIO_CUDACOPY_CELL_TILE_KIB
#define MORIIO_CUDACOPY_CELL_TILE_KIB 32
#endif
#ifndef MORIIO_CUDACOPY_CELL_CTAS
#define MORIIO_CUDACOPY_CELL_CTAS 4
#endif
constexpr int kCellThreads = 256;
constexpr unsigned kTileBytes = MORIIO_CUDACOPY_CELL_TILE_KIB * 1024;  // shared memory per CTA
constexpr int kCellUnroll = MORIIO_CUDACOPY_CELL_UNROLL;  // vectors per thread in flight
// The register budget is cut for this many resident CTAs per SM (4: at most 64 registers).
constexpr int kCellCtasPerSm = MORIIO_CUDACOPY_CELL_CTAS;

/// One side of a tile walk: strides in bytes; heads_outer when a head step is the longer one
/// (HND), so the walk goes along tokens innermost.
struct CellSide {
  std::int64_t plane;
  std::int64_t head;
  std::int64_t token;
  bool heads_outer;
};

struct CellGrid {
  std::uint64_t dst_base;
  std::uint64_t src_base;
  const std::int64_t* table;  // dst block offset[n], src block offset[n]
  std::uint64_t n;
  unsigned planes, heads, tokens;
  unsigned vpc;                      // vectors of V per cell
  unsigned tile_heads, tile_tokens;  // the largest tile (edges are smaller)
  unsigned head_tiles, token_tiles;
  CellSide dst, src;
};

/// Cell `cell` of a th x tt tile in `side`'s memory order -> its (head, token) in the tile.
__device__ __forceinline__ void CellAt(const CellSide& side, unsigned cell, unsigned th,
                                       unsigned tt, unsigned* h, unsigned* t) {
  if (side.heads_outer) {
    *h = cell / tt;
    *t = cell - *h * tt;
  } else {
    *t = cell / th;
    *h = cell - *t * th;
  }
}

/// Where vector `v` of a th x tt tile, walked in `side`'s memory order, lies: its index in the
/// shared tile (held [head][token][vector]) and its global address.
template <typename V>
__device__ __forceinline__ unsigned TileVector(unsigned v, unsigned char* global,
                                               const CellSide& side, unsigned th, unsigned tt,
                                               unsigned vpc, V** at) {
  const unsigned cell = v / vpc;
  const unsigned within = v - cell * vpc;
  unsigned h = 0;
  unsigned t = 0;
  CellAt(side, cell, th, tt, &h, &t);
  *at = reinterpret_cast<V*>(global + h * side.head + t * side.token) + within;
  return (h * tt + t) * vpc + within;
}

/// Reads the tile's `vectors` vectors from global memory in the source's order into shared
/// memory. Every load of a step is issued before the first store: one memory round trip per
/// kCellUnroll vectors per thread.
template <typename V>
__device__ __forceinline__ void LoadTile(V* tile, unsigned char* src, const CellSide& side,
                                         unsigned th, unsigned tt, unsigned vpc,
                                         unsigned vectors) {
  constexpr unsigned kStep = kCellThreads * kCellUnroll;
#pragma unroll 1
  for (unsigned base = threadIdx.x; base < vectors; base += kStep) {
    V r[kCellUnroll];
    unsigned slot[kCellUnroll];
#pragma unroll
    for (int k = 0; k < kCellUnroll; ++k) {
      const unsigned v = base + k * kCellThreads;
      if (v >= vectors) continue;
      V* g = nullptr;
      slot[k] = TileVector<V>(v, src, side, th, tt, vpc, &g);
      r[k] = *g;
    }
#pragma unroll
    for (int k = 0; k < kCellUnroll; ++k) {
      if (base + k * kCellThreads < vectors) tile[slot[k]] = r[k];
    }
  }
}

/// Writes the tile from shared memory to global memory in the destination's order.
template <typename V>
__device__ __forceinline__ void StoreTile(const V* tile, unsigned char* dst,
                                          const CellSide& side, unsigned th, unsigned tt,
                                          unsigned vpc, unsigned vectors) {
  constexpr unsigned kStep = kCellThreads * kCellUnroll;
#pragma unroll 1
  for (unsigned base = threadIdx.x; base < vectors; base += kStep) {
    V r[kCellUnroll];
    V* g[kCellUnroll];
#pragma unroll
    for (int k = 0; k < kCellUnroll; ++k) {
      const unsigned v = base + k * kCellThreads;
      if (v < vectors) r[k] = tile[TileVector<V>(v, dst, side, th, tt, vpc, &g[k])];
    }
#pragma unroll
    for (int k = 0; k < kCellUnroll; ++k) {
      if (base + k * kCellThreads < vectors) *g[k] = r[k];
    }
  }
}

/// Persistent CTAs walk the work items (block, plane, head tile, token tile); consecutive items
/// are tiles of one block, so neighbouring CTAs read and write neighbouring memory.
template <typename V>
__global__ void __launch_bounds__(kCellThreads, kCellCtasPerSm) CellCopyKernel(CellGrid g) {
  extern __shared__ uint4 shared_tile[];
  V* tile = reinterpret_cast<V*>(shared_tile);
  const std::uint64_t per_block = std::uint64_t{g.planes} * g.head_tiles * g.token_tiles;
  const std::uint64_t items = g.n * per_block;
  // The table lives in mapped host memory, a PCIe round trip (~1-2 us) away: the next item's
  // entry is loaded while this one's tile moves, so the wait for it overlaps the copy.
  auto entry = [&](std::uint64_t item, std::int64_t* dst, std::int64_t* src) {
    const std::uint64_t block = item < items ? item / per_block : 0;
    *dst = g.table[block];
    *src = g.table[g.n + block];
  };
  std::int64_t next_dst = 0;
  std::int64_t next_src = 0;
  if (blockIdx.x < items) entry(blockIdx.x, &next_dst, &next_src);
  for (std::uint64_t item = blockIdx.x; item < items; item += gridDim.x) {
    const std::int64_t dst_block = next_dst;
    const std::int64_t src_block = next_src;
    if (item + gridDim.x < items) entry(item + gridDim.x, &next_dst, &next_src);
    const std::uint64_t block = item / per_block;
    auto rest = static_cast<unsigned>(item - block * per_block);
    const unsigned plane = rest / (g.head_tiles * g.token_tiles);
    rest -= plane * g.head_tiles * g.token_tiles;
    const unsigned h0 = rest / g.token_tiles * g.tile_heads;
    const unsigned t0 = rest % g.token_tiles * g.tile_tokens;
    const unsigned th = min(g.tile_heads, g.heads - h0);
    const unsigned tt = min(g.tile_tokens, g.tokens - t0);
    const unsigned vectors = th * tt * g.vpc;
    auto* src = reinterpret_cast<unsigned char*>(g.src_base + src_block + plane * g.src.plane +
                                                 h0 * g.src.head + t0 * g.src.token);
    auto* dst = reinterpret_cast<unsigned char*>(g.dst_base + dst_block + plane * g.dst.plane +
                                                 h0 * g.dst.head + t0 * g.dst.token);
    LoadTile<V>(tile, src, g.src, th, tt, g.vpc, vectors);
    __syncthreads();
    StoreTile<V>(tile, dst, g.dst, th, tt, g.vpc, vectors);
    __syncthreads();  // the next item overwrites the tile
  }
}

/// A run table in mapped pinned host memory: the host writes it, the kernel reads it in place
/// (`device` is the same memory as the GPU addresses it). Measured on an H200 VM: a separate
/// host-to-device copy of the table now and then stalled a batch by ~1 ms, and it cost an
/// extra API call per batch; each CTA reads only 24 bytes per chunk, one chunk ahead.
struct Slot {
  std::int64_t* host = nullptr;
  const std::int64_t* device = nullptr;
  std::size_t capacity = 0;  // 8-byte words
};

struct Queue;

struct Op {
  Queue* queue = nullptr;
  Slot slot;
  cudaEvent_t done = nullptr;
};

struct Queue {
  int device = 0;
  int max_ctas = 0;  // resident CTAs of GatherScatter
  int max_aligned_ctas = 0;  // resident CTAs of GatherScatterAligned
  int max_cell_ctas = 0;  // resident CTAs of CellCopyKernel (the same for every vector type)
  int max_stamp_ctas = 0;  // resident CTAs of StampKernel
  cudaStream_t streams[kStreams] = {};
  int next_stream = 0;
  std::vector<Slot> free_slots;  // reused: pinned allocations cost milliseconds
  std::vector<cudaEvent_t> free_events;
};

void FreeSlot(const Slot& s) {
  if (s.host != nullptr) cudaFreeHost(s.host);
}

int Probe(char* err, size_t err_len) {
  int count = 0;
  cudaError_t e = cudaGetDeviceCount(&count);
  if (e != cudaSuccess) {
    SetError(err, err_len, "cudaGetDeviceCount", e);
    return -1;
  }
  if (count == 0) {
    if (err != nullptr && err_len != 0) std::snprintf(err, err_len, "no CUDA device");
    return -1;
  }
  return 0;
}

/// Lets every cell kernel take kTileBytes of dynamic shared memory (a tile above 48 KiB must
/// be asked for).
cudaError_t AllowCellShared() {
  cudaError_t e = cudaSuccess;
  auto allow = [&](const void* kernel) {
    if (e == cudaSuccess) {
      e = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                               static_cast<int>(kTileBytes));
    }
  };
  allow(reinterpret_cast<const void*>(CellCopyKernel<uint4>));
  allow(reinterpret_cast<const void*>(CellCopyKernel<uint2>));
  allow(reinterpret_cast<const void*>(CellCopyKernel<unsigned>));
  allow(reinterpret_cast<const void*>(CellCopyKernel<unsigned char>));
  return e;
}

int CreateQueue(int device, void** out, char* err, size_t err_len) {
  cudaError_t e = cudaSetDevice(device);
  if (e != cudaSuccess) {
    SetError(err, err_len, "cudaSetDevice", e);
    return -1;
  }
  int sms = 0;
  e = cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device);
  if (e != cudaSuccess) {
    SetError(err, err_len, "cudaDeviceGetAttribute", e);
    return -1;
  }
  std::unique_ptr<Queue> q(new (std::nothrow) Queue);
  if (q == nullptr) return -1;
  q->device = device;
  // As many CTAs as can be resident at once (a persistent grid): more only adds tail effects.
  int per_sm = 0;
  int cell_per_sm = 0;
  int aligned_per_sm = 0;
  int stamp_per_sm = 0;
  e = cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, GatherScatter, kThreads, 0);
  if (e == cudaSuccess) {
    e = cudaOccupancyMaxActiveBlocksPerMultiprocessor(&stamp_per_sm, StampKernel, kThreads, 0);
  }
  if (e == cudaSuccess) {
    e = cudaOccupancyMaxActiveBlocksPerMultiprocessor(&aligned_per_sm, GatherScatterAligned,
                                                      kThreads, 0);
  }
  if (e == cudaSuccess) {
    e = AllowCellShared();
  }
  if (e == cudaSuccess) {
    e = cudaOccupancyMaxActiveBlocksPerMultiprocessor(&cell_per_sm, CellCopyKernel<uint4>,
                                                      kCellThreads, kTileBytes);
  }
  if (e != cudaSuccess) {
    SetError(err, err_len, "cudaOccupancyMaxActiveBlocksPerMultiprocessor", e);
    return -1;
  }
  q->max_ctas = sms * std::max(per_sm, 1);
  q->max_aligned_ctas = sms * std::max(aligned_per_sm, 1);
  q->max_cell_ctas = sms * std::max(cell_per_sm, 1);
  q->max_stamp_ctas = sms * std::max(stamp_per_sm, 1);
  for (cudaStream_t& stream : q->streams) {
    e = cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking);
    if (e != cudaSuccess) {
      SetError(err, err_len, "cudaStreamCreateWithFlags", e);
      for (cudaStream_t created : q->streams) {
        if (created != nullptr) cudaStreamDestroy(created);
      }
      return -1;
    }
  }
  *out = q.release();
  return 0;
}

void DestroyQueue(void* queue) {
  auto* q = static_cast<Queue*>(queue);
  if (q == nullptr) return;
  cudaSetDevice(q->device);
  for (cudaStream_t stream : q->streams) cudaStreamSynchronize(stream);
  for (const Slot& s : q->free_slots) FreeSlot(s);
  for (cudaEvent_t ev : q->free_events) cudaEventDestroy(ev);
  for (cudaStream_t stream : q->streams) cudaStreamDestroy(stream);
  delete q;
}

/// A table of at least `words` 8-byte words: a free one reused, or a new one (rounded up to a
/// power of two, so a queue keeps few sizes; tables stay with the queue until it is destroyed).
bool TakeSlot(Queue* q, std::size_t words, Slot* out, char* err, size_t err_len) {
  // The smallest free table that fits, so a small batch does not hold a large one.
  auto best = q->free_slots.end();
  for (auto it = q->free_slots.begin(); it != q->free_slots.end(); ++it) {
    if (it->capacity >= words && (best == q->free_slots.end() || it->capacity < best->capacity)) {
      best = it;
    }
  }
  if (best != q->free_slots.end()) {
    *out = *best;
    q->free_slots.erase(best);
    return true;
  }
  Slot slot;
  std::size_t cap = 1024;
  while (cap < words) cap *= 2;
  cudaError_t e = cudaHostAlloc(reinterpret_cast<void**>(&slot.host), cap * 8, cudaHostAllocMapped);
  void* mapped = nullptr;
  if (e == cudaSuccess) e = cudaHostGetDevicePointer(&mapped, slot.host, 0);
  if (e != cudaSuccess) {
    FreeSlot(slot);
    SetError(err, err_len, "allocating the run table", e);
    return false;
  }
  slot.device = static_cast<const std::int64_t*>(mapped);
  slot.capacity = cap;
  *out = slot;
  return true;
}

template <typename... Args>
void SetMessage(char* err, size_t err_len, const char* format, Args... args) {
  if (err != nullptr && err_len != 0) std::snprintf(err, err_len, format, args...);
}

/// Enqueues `launch(stream)` behind `wait_event` on the queue's next stream with an event after
/// it, and hands out the op that owns `slot` (the launched kernel's table). On failure the slot
/// goes back to the queue once no kernel can read it.
template <typename Launch>
int Enqueue(Queue* q, const Slot& slot, std::uint64_t wait_event, Launch launch, void** out,
            char* err, size_t err_len) {
  cudaEvent_t ev = nullptr;
  cudaError_t e = cudaSuccess;
  if (!q->free_events.empty()) {
    ev = q->free_events.back();
    q->free_events.pop_back();
  } else {
    e = cudaEventCreateWithFlags(&ev, cudaEventDisableTiming);
    if (e != cudaSuccess) {
      q->free_slots.push_back(slot);
      SetError(err, err_len, "cudaEventCreateWithFlags", e);
      return -1;
    }
  }
  cudaStream_t stream = q->streams[q->next_stream];
  q->next_stream = (q->next_stream + 1) % kStreams;
  // The copy of a layer waits on the device for the compute that produces it (per-layer WRITE
  // overlapped with the forward pass); the op's event then covers both.
  if (wait_event != 0) e = cudaStreamWaitEvent(stream, reinterpret_cast<cudaEvent_t>(wait_event), 0);
  // The launch is checked with cudaGetLastError(), which also returns an error an earlier call
  // on this thread left behind (a failed create_queue, a refused event): clear it first, so a
  // launch that happened is never reported as failed. A sticky error shows again below.
  if (e == cudaSuccess) {
    (void)cudaGetLastError();
    e = launch(stream);
  }
  if (e == cudaSuccess) e = cudaEventRecord(ev, stream);
  if (e != cudaSuccess) {
    // The kernel may still read the table: wait before the slot can be reused.
    cudaStreamSynchronize(stream);
    q->free_slots.push_back(slot);
    q->free_events.push_back(ev);
    SetError(err, err_len, "launching the copy kernel", e);
    return -1;
  }
  auto* op = new (std::nothrow) Op{q, slot, ev};
  if (op == nullptr) {
    cudaEventSynchronize(ev);
    q->free_slots.push_back(slot);
    q->free_events.push_back(ev);
    return -1;
  }
  *out = op;
  return 0;
}

int Submit(void* queue, std::uint64_t dst_base, std::uint64_t src_base,
           const std::int64_t* dst_offsets, const std::int64_t* src_offsets,
           const std::int64_t* sizes, std::uint64_t count, std::uint64_t wait_event, void** out,
           char* err, size_t err_len) {
  auto* q = static_cast<Queue*>(queue);
  cudaError_t e = cudaSetDevice(q->device);
  if (e != cudaSuccess) {
    SetError(err, err_len, "cudaSetDevice", e);
    return -1;
  }
  // Writing into the mapped pinned table is the slow part of a submit (~4.8 GB/s on the H200
  // VM, docs/benchmarks.md), so the table is as small as the runs allow: no size column when all
  // sizes are equal, offsets as 32-bit 16-byte units when every offset is such a multiple below
  // 64 GiB (KV runs always are). The common batch (that form, one size) is validated and written
  // in ONE branch-free pass over the caller's arrays, which the compiler vectorises; sizes that
  // differ take a second pass over the sizes alone, any other form is written again in its form.
  Slot slot;
  if (!TakeSlot(q, 2 * count, &slot, err, err_len)) return -1;
  auto* units = reinterpret_cast<std::uint32_t*>(slot.host);
  std::int64_t* size_column = slot.host + count;  // follows the 32-bit offset columns
  const std::int64_t first_size = count != 0 ? sizes[0] : 0;
  std::uint64_t any_bits = 0;   // OR of every offset: alignment and range in one test
  std::uint64_t size_bits = 0;  // OR of every size: their alignment
  std::uint64_t differ = 0;     // nonzero when some size is not the first one
  for (std::uint64_t i = 0; i < count; ++i) {
    const auto size = static_cast<std::uint64_t>(sizes[i]);
    const auto d = static_cast<std::uint64_t>(dst_offsets[i]);
    const auto s = static_cast<std::uint64_t>(src_offsets[i]);
    differ |= size ^ static_cast<std::uint64_t>(first_size);
    size_bits |= size;
    any_bits |= d | s;
    units[i] = static_cast<std::uint32_t>(d >> 4);
    units[count + i] = static_cast<std::uint32_t>(s >> 4);
  }
  const bool all_same = differ == 0;
  const bool aligned = ((any_bits | size_bits | dst_base | src_base) & 15) == 0;
  const std::uint64_t chunk_bytes = aligned ? kAlignedChunk : kChunk;
  auto refuse = [&](std::uint64_t i) {
    q->free_slots.push_back(slot);
    SetMessage(err, err_len, "run %llu has size %lld; sizes must be positive",
               static_cast<unsigned long long>(i), static_cast<long long>(sizes[i]));
    return -1;
  };
  auto chunks_of = [&](std::int64_t size) {
    return (static_cast<std::uint64_t>(size) + chunk_bytes - 1) / chunk_bytes;
  };
  std::uint64_t chunks = 0;
  std::uint64_t bytes = 0;
  std::uint64_t per_run = 0;
  if (all_same) {  // one size: checking the first checks them all
    if (count != 0 && first_size <= 0) return refuse(0);
    per_run = count != 0 ? chunks_of(first_size) : 0;
    chunks = count * per_run;
    bytes = count * static_cast<std::uint64_t>(first_size);
  } else {
    for (std::uint64_t i = 0; i < count; ++i) {
      const std::int64_t size = sizes[i];
      if (size <= 0) return refuse(i);
      chunks += chunks_of(size);
      bytes += static_cast<std::uint64_t>(size);
      size_column[i] = size;
    }
  }
  if (per_run >> kChunkBits || chunks >> 32) {
    q->free_slots.push_back(slot);
    SetMessage(err, err_len,
               "a batch of %llu runs of %llu bytes in all is more than one kernel takes (runs "
               "of up to %llu bytes, 2^32 pieces of up to %llu bytes)",
               static_cast<unsigned long long>(count), static_cast<unsigned long long>(bytes),
               static_cast<unsigned long long>(chunk_bytes << kChunkBits),
               static_cast<unsigned long long>(chunk_bytes));
    return -1;
  }
  const std::uint64_t uniform = count != 0 && all_same ? static_cast<std::uint64_t>(first_size) : 0;
  // A chunk column only for runs of different sizes some of which span several chunks.
  const bool chunk_column = uniform == 0 && chunks != count;
  const bool compact = (any_bits & 15) == 0 && (any_bits >> 36) == 0;
  const std::size_t offset_words = compact ? count : 2 * count;
  const std::size_t size_words = uniform != 0 ? 0 : count;
  if (!compact || chunk_column) {
    // A table of another form (and a chunk column): in a slot of its size, the 32-bit columns
    // taken over when they hold, the 64-bit ones copied otherwise.
    Slot fitted;
    const std::size_t words = offset_words + size_words + (chunk_column ? chunks : 0);
    if (!TakeSlot(q, words, &fitted, err, err_len)) {
      q->free_slots.push_back(slot);
      return -1;
    }
    if (compact) {
      std::memcpy(fitted.host, slot.host, count * 8);
    } else {
      std::memcpy(fitted.host, dst_offsets, count * 8);
      std::memcpy(fitted.host + count, src_offsets, count * 8);
    }
    if (size_words != 0) std::memcpy(fitted.host + offset_words, sizes, count * 8);
    q->free_slots.push_back(slot);
    slot = fitted;
  }
  if (chunk_column) {
    std::int64_t* chunk = slot.host + offset_words + size_words;
    for (std::uint64_t i = 0; i < count; ++i) {
      const std::uint64_t run_chunks = chunks_of(sizes[i]);
      if (run_chunks >> kChunkBits) {
        q->free_slots.push_back(slot);
        SetMessage(err, err_len, "run %llu has %llu bytes, more than the %llu one run may have",
                   static_cast<unsigned long long>(i), static_cast<unsigned long long>(sizes[i]),
                   static_cast<unsigned long long>(chunk_bytes << kChunkBits));
        return -1;
      }
      for (std::uint64_t j = 0; j < run_chunks; ++j) {
        *chunk++ = static_cast<std::int64_t>((i << kChunkBits) | j);
      }
    }
  }
  const RunTable table{dst_base, src_base, slot.device, count,   chunks,
                       uniform,  chunk_bytes, per_run,     compact};
  if (aligned && chunks != 0) {
    // Groups of about kGroupBytes, but no more chunks each than spreads them over every CTA.
    const std::uint64_t per_chunk = std::max<std::uint64_t>(bytes / chunks, 1);
    const std::uint64_t spread = (chunks + q->max_aligned_ctas - 1) / q->max_aligned_ctas;
    const auto group = static_cast<unsigned>(std::clamp<std::uint64_t>(
        std::min((kGroupBytes + per_chunk - 1) / per_chunk, spread), 1, kGroupMax));
    const std::uint64_t groups = (chunks + group - 1) / group;
    const auto grid = static_cast<unsigned>(
        std::min<std::uint64_t>(groups, static_cast<std::uint64_t>(q->max_aligned_ctas)));
    return Enqueue(
        q, slot, wait_event,
        [&](cudaStream_t stream) {
          GatherScatterAligned<<<grid, kThreads, 0, stream>>>(table, group);
          return cudaGetLastError();
        },
        out, err, err_len);
  }
  const auto grid = static_cast<unsigned>(
      std::min<std::uint64_t>((chunks + kWarpsPerCta - 1) / kWarpsPerCta, q->max_ctas));
  return Enqueue(
      q, slot, wait_event,
      [&](cudaStream_t stream) {
        if (chunks == 0) return cudaSuccess;
        GatherScatter<<<grid, kThreads, 0, stream>>>(table);
        return cudaGetLastError();
      },
      out, err, err_len);
}

/// The cell kernel for the widest vector type every address and size of the copy is a multiple
/// of (16 bytes for KV caches; narrower types keep odd geometries correct).
template <typename V>
cudaError_t LaunchCells(CellGrid g, unsigned grid, cudaStream_t stream) {
  g.vpc /= sizeof(V);
  CellCopyKernel<V><<<grid, kCellThreads, kTileBytes, stream>>>(g);
  return cudaGetLastError();
}

int SubmitCells(void* queue, std::uint64_t dst_base, std::uint64_t src_base,
                const moriio_cudacopy_cells* cells, const std::int64_t* dst_blocks,
                const std::int64_t* src_blocks, std::uint64_t count, std::uint64_t wait_event,
                void** out, char* err, size_t err_len) {
  auto* q = static_cast<Queue*>(queue);
  if (cells == nullptr) {
    SetMessage(err, err_len, "no cell geometry");
    return -1;
  }
  const moriio_cudacopy_cells& c = *cells;
  if (c.planes < 1 || c.planes > 2 || c.heads < 1 || c.tokens < 1 || c.cell_bytes < 1 ||
      c.cell_bytes > kTileBytes / 2) {
    SetMessage(err, err_len,
               "cell geometry out of range: planes %u (1 or 2), heads %u, tokens %u (>= 1), "
               "cell_bytes %u (1..%u)",
               c.planes, c.heads, c.tokens, c.cell_bytes, kTileBytes / 2);
    return -1;
  }
  cudaError_t e = cudaSetDevice(q->device);
  if (e != cudaSuccess) {
    SetError(err, err_len, "cudaSetDevice", e);
    return -1;
  }
  // The tile: whole token rows when they fit (HND's inner axis), as many heads as fit beside
  // them (NHD's inner axis); both sides then walk long contiguous stretches.
  const unsigned per_tile = kTileBytes / c.cell_bytes;
  const unsigned tile_tokens = std::min(c.tokens, per_tile);
  const unsigned tile_heads = std::min(c.heads, per_tile / tile_tokens);
  std::uint64_t bits = c.cell_bytes | dst_base | src_base;
  for (std::int64_t v : {c.dst_plane_stride, c.dst_head_stride, c.dst_token_stride,
                         c.src_plane_stride, c.src_head_stride, c.src_token_stride}) {
    bits |= static_cast<std::uint64_t>(v);
  }
  for (std::uint64_t i = 0; i < count; ++i) {
    bits |= static_cast<std::uint64_t>(dst_blocks[i]) | static_cast<std::uint64_t>(src_blocks[i]);
  }
  Slot slot;
  if (!TakeSlot(q, 2 * count, &slot, err, err_len)) return -1;
  std::memcpy(slot.host, dst_blocks, count * 8);
  std::memcpy(slot.host + count, src_blocks, count * 8);
  auto side = [](std::int64_t plane, std::int64_t head, std::int64_t token) {
    return CellSide{plane, head, token, head > token};
  };
  const CellGrid g{dst_base,
                   src_base,
                   slot.device,
                   count,
                   c.planes,
                   c.heads,
                   c.tokens,
                   c.cell_bytes,
                   tile_heads,
                   tile_tokens,
                   (c.heads + tile_heads - 1) / tile_heads,
                   (c.tokens + tile_tokens - 1) / tile_tokens,
                   side(c.dst_plane_stride, c.dst_head_stride, c.dst_token_stride),
                   side(c.src_plane_stride, c.src_head_stride, c.src_token_stride)};
  const std::uint64_t items = count * c.planes * g.head_tiles * g.token_tiles;
  const auto grid = static_cast<unsigned>(
      std::min<std::uint64_t>(items, static_cast<std::uint64_t>(q->max_cell_ctas)));
  return Enqueue(
      q, slot, wait_event,
      [&](cudaStream_t stream) {
        if (items == 0) return cudaSuccess;
        if ((bits & 15) == 0) return LaunchCells<uint4>(g, grid, stream);
        if ((bits & 7) == 0) return LaunchCells<uint2>(g, grid, stream);
        if ((bits & 3) == 0) return LaunchCells<unsigned>(g, grid, stream);
        return LaunchCells<unsigned char>(g, grid, stream);
      },
      out, err, err_len);
}

int SubmitStamps(void* queue, std::uint64_t dst_base, std::uint64_t src_base,
                 const moriio_cudacopy_stamp_layer* layers, std::uint32_t num_layers,
                 const moriio_cudacopy_stamp_run* runs, std::uint32_t num_runs,
                 const std::int64_t* dst_ids, const std::int64_t* src_ids, std::uint64_t num_ids,
                 std::uint64_t wait_event, void** out, char* err, size_t err_len) {
  auto* q = static_cast<Queue*>(queue);
  // Each run's first chunk among all the runs' chunks, so a layer's chunks are a range.
  std::vector<std::int64_t> first_chunk(num_runs + 1, 0);
  for (std::uint32_t r = 0; r < num_runs; ++r) {
    if (runs[r].size < 1) {
      SetMessage(err, err_len, "stamp run %u has size %lld (must be > 0)", r,
                 static_cast<long long>(runs[r].size));
      return -1;
    }
    first_chunk[r + 1] =
        first_chunk[r] + static_cast<std::int64_t>((runs[r].size + kStampChunk - 1) / kStampChunk);
  }
  if (first_chunk[num_runs] > 0xffffffffll) {
    SetMessage(err, err_len, "stamp runs of %lld chunks: at most 2^32 - 1",
               static_cast<long long>(first_chunk[num_runs]));
    return -1;
  }
  std::uint64_t most_pieces = 0, all_pieces = 0;
  for (std::uint32_t i = 0; i < num_layers; ++i) {
    const moriio_cudacopy_stamp_layer& l = layers[i];
    if (l.num_runs < 1 || l.num_runs > kMaxStampRuns || l.first_run > num_runs ||
        l.num_runs > num_runs - l.first_run || l.first_block > num_ids ||
        l.num_blocks > num_ids - l.first_block) {
      SetMessage(err, err_len,
                 "stamp layer %u names runs [%u, +%u) of %u (1..%u per layer) and block ids "
                 "[%llu, +%llu) of %llu",
                 i, l.first_run, l.num_runs, num_runs, kMaxStampRuns,
                 static_cast<unsigned long long>(l.first_block),
                 static_cast<unsigned long long>(l.num_blocks),
                 static_cast<unsigned long long>(num_ids));
      return -1;
    }
    const auto per_block = static_cast<std::uint64_t>(first_chunk[l.first_run + l.num_runs] -
                                                      first_chunk[l.first_run]);
    most_pieces = std::max(most_pieces, l.num_blocks * per_block);
    all_pieces += l.num_blocks * per_block;
  }
  if (num_layers > 65535) {
    SetMessage(err, err_len, "%u stamp layers in one batch: at most 65535", num_layers);
    return -1;
  }
  cudaError_t e = cudaSetDevice(q->device);
  if (e != cudaSuccess) {
    SetError(err, err_len, "cudaSetDevice", e);
    return -1;
  }
  const std::size_t words = std::size_t{num_layers} * kStampLayerWords +
                            std::size_t{num_runs} * kStampRunWords + 2 * num_ids;
  Slot slot;
  if (!TakeSlot(q, words, &slot, err, err_len)) return -1;
  std::int64_t* w = slot.host;
  for (std::uint32_t i = 0; i < num_layers; ++i, w += kStampLayerWords) {
    const moriio_cudacopy_stamp_layer& l = layers[i];
    const auto per_block = static_cast<std::uint64_t>(first_chunk[l.first_run + l.num_runs] -
                                                      first_chunk[l.first_run]);
    w[0] = l.dst_layer;
    w[1] = l.src_layer;
    w[2] = l.dst_stride;
    w[3] = l.src_stride;
    w[4] = static_cast<std::int64_t>(l.first_block);
    w[5] = static_cast<std::int64_t>(l.num_blocks);
    w[6] = static_cast<std::int64_t>(l.first_run | (std::uint64_t{l.num_runs} << 32));
    w[7] = static_cast<std::int64_t>(static_cast<std::uint64_t>(first_chunk[l.first_run]) |
                                     (per_block << 32));
  }
  for (std::uint32_t r = 0; r < num_runs; ++r, w += kStampRunWords) {
    w[0] = runs[r].dst;
    w[1] = runs[r].src;
    w[2] = runs[r].size;
    w[3] = first_chunk[r];
  }
  std::memcpy(w, dst_ids, num_ids * 8);
  std::memcpy(w + num_ids, src_ids, num_ids * 8);
  // Pieces per warp: as many as make the batch's pieces fill every resident warp, 32 at most.
  const std::uint64_t warps = static_cast<std::uint64_t>(q->max_stamp_ctas) * kWarpsPerCta;
  const auto group =
      static_cast<std::uint32_t>(std::clamp<std::uint64_t>((all_pieces + warps - 1) / warps, 1,
                                                           kStampMaxGroup));
  const StampGrid g{dst_base, src_base, slot.device, num_layers, num_runs, num_ids, group};
  // As many CTAs in all as can be resident, spread over the layers; none beyond what the
  // largest layer's pieces need.
  const std::uint64_t per_cta = std::uint64_t{kWarpsPerCta} * group;
  const std::uint64_t wanted = (static_cast<std::uint64_t>(q->max_stamp_ctas) + num_layers - 1) /
                               std::max<std::uint64_t>(num_layers, 1);
  const auto across = static_cast<unsigned>(
      std::max<std::uint64_t>(1, std::min(wanted, (most_pieces + per_cta - 1) / per_cta)));
  return Enqueue(
      q, slot, wait_event,
      [&](cudaStream_t stream) {
        if (most_pieces == 0) return cudaSuccess;
        StampKernel<<<dim3(across, num_layers), kThreads, 0, stream>>>(g);
        return cudaGetLastError();
      },
      out, err, err_len);
}

int PollOp(void* op_ptr, char* err, size_t err_len) {
  auto* op = static_cast<Op*>(op_ptr);
  cudaError_t e = cudaEventQuery(op->done);
  if (e == cudaSuccess) return 1;
  if (e == cudaErrorNotReady) return 0;
  SetError(err, err_len, "gather/scatter kernel", e);
  return -1;
}

int QueryEvent(uint64_t event, char* err, size_t err_len) {
  cudaError_t e = cudaEventQuery(reinterpret_cast<cudaEvent_t>(event));
  if (e == cudaSuccess) return 1;
  if (e == cudaErrorNotReady) return 0;
  SetError(err, err_len, "waited-for event", e);
  return -1;
}

void ReleaseOp(void* op_ptr) {
  auto* op = static_cast<Op*>(op_ptr);
  if (op == nullptr) return;
  cudaSetDevice(op->queue->device);
  cudaEventSynchronize(op->done);
  op->queue->free_slots.push_back(op->slot);
  op->queue->free_events.push_back(op->done);
  delete op;
}

const moriio_cudacopy_api kApi = {
    MORIIO_CUDACOPY_ABI_VERSION,
    &Probe,
    &CreateQueue,
    &DestroyQueue,
    &Submit,
    &PollOp,
    &ReleaseOp,
    &SubmitCells,
    &SubmitStamps,
    &QueryEvent,
    &moriio_cudacopy::ChecksumBlocks,
};

}  // namespace

extern "C" __attribute__((visibility("default"))) const moriio_cudacopy_api*
moriio_native_cudacopy_api(void) {
  return &kApi;
}
