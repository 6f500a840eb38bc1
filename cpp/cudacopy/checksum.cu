// The integrity check's block checksums of device layers, in one kernel (cudacopy_abi.h's
// checksum_blocks; the value is defined in include/moriio_native/checksum.hpp).
//
// Why here: torch computes the same value (python/moriio_native/verify.py) with a dozen
// elementwise kernels per layer over int64 temporaries, 0.026x of a device copy on an H200
// (docs/benchmarks.md). The value is a sum of independent per-word terms, so one pass that reads
// each byte once and reduces in registers is bound by memory, not launches.
//
// The grid: y = the layer, x walks that layer's (block, cell group) units. A cell's chunks (16
// bytes where every cell of the layer is 16-byte aligned and a multiple of 16 bytes long, else
// 8) are read by a group of lanes (a power of two, up to the warp), consecutive lanes
// consecutive chunks, so a cell of 256 bytes is one coalesced half-warp load; small cells pack
// several per warp. Each warp sums its terms in registers and adds them to its block's value
// with one atomic (a sum modulo 2^64 is what atomicAdd on unsigned 64-bit integers computes, in
// any order).
//
// Finding a cell (its plane, head and token from its index in the block) is integer division,
// which a GPU does in software: 64-bit divisions per cell cost more than the checksum itself.
// So cell indices are 32-bit (a block has fewer than 2^31 cells, checked), a lane's cell moves
// from one pass to the next by adding the pass's step as heads and tokens (no division when a
// plane has at least a pass of cells), a unit's block by adding the grid's stride as blocks and
// units, and tokens split into kernel blocks only where the window crosses one.
//
// What a load cost besides Mix64 was mostly finding its cell and its position term (64-bit
// multiplies, which a GPU builds from 32-bit ones; Mix64's two are the value's own): about 45
// instructions per pass, against about 20 per word for Mix64. So a block of at most kTableCells
// cells (vLLM's blocks) has each cell's offset and first position term computed once per CTA
// into a table in shared memory, and a pass costs one shared load; the next word's term is the
// previous one plus the step; the block's address is computed once per unit and the next unit's
// block id read one unit ahead. 16-byte loads halve the loads and cell lookups per word and
// double the bytes each lane has in flight (kPasses loads of 16 bytes). Together: 3.0-3.2 TB/s
// at 1 GiB on an H200, 1.45-1.54x a device copy of the same bytes, from 0.55-0.64x
// (docs/benchmarks.md, session 19; what each part bought is there too).

#include <cuda_runtime.h>
#include <dlfcn.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <map>
#include <memory>
#include <mutex>
#include <vector>

#include "checksum.h"
#include "moriio_native/checksum_mix.hpp"

namespace moriio_cudacopy {
namespace {

constexpr int kThreads = 256;
constexpr int kWarps = kThreads / 32;
// Cell passes per unit: each lane has this many independent loads in flight per unit. The
// compile-time switches below exist so that variants can be measured (bench/h200_session.sh).
#ifndef MORIIO_CUDACOPY_CHECKSUM_PASSES
#define MORIIO_CUDACOPY_CHECKSUM_PASSES 8
#endif
// 1: 16-byte loads where a layer's cells allow them; 0: 8-byte loads at most.
#ifndef MORIIO_CUDACOPY_CHECKSUM_WIDE
#define MORIIO_CUDACOPY_CHECKSUM_WIDE 1
#endif
// 1: streaming loads (evict first); 0: loads through the read-only data path.
#ifndef MORIIO_CUDACOPY_CHECKSUM_STREAMING
#define MORIIO_CUDACOPY_CHECKSUM_STREAMING 0
#endif
constexpr int kPasses = MORIIO_CUDACOPY_CHECKSUM_PASSES;
constexpr std::uint32_t kMaxPlaneBytes = 1u << 20;
constexpr std::uint32_t kMaxLayers = 65535;  // the grid's y dimension

constexpr std::uint64_t kMaxCells = 1u << 31;  // per block: cell indices stay 32-bit
constexpr std::uint32_t kNoCell = 0xffffffffu;  // not a cell index (they are below kMaxCells)

/// How a layer's words are read: 16 or 8 bytes per load where every cell of the layer starts
/// aligned to that and is a whole number of loads long; otherwise 8-byte words with a byte path
/// for the unaligned and the zero-padded last one.
enum Load : std::uint32_t { kLoadBytes = 0, kLoadWords = 1, kLoadPairs = 2 };

/// One layer as the kernel reads it: the ABI's fields and what follows from them.
struct SumLayer {
  moriio_cudacopy_checksum_layer l;
  // Per plane: where the window's first cell is from its block's start (the token term only
  // when the window lies in the first kernel block).
  std::int64_t plane_origin[2];
  // Per plane: the position term (i + 1) * kChecksumPositionStep of the first word of cell c
  // (c counted from the window's first cell in the block) is c * term_step + term_base.
  std::uint64_t term_step[2];
  std::uint64_t term_base[2];
  std::uint32_t chunks[2];   // loads per cell, per plane (words, or pairs of words)
  std::uint32_t load;        // a Load
  std::uint32_t lanes_log2;  // lanes per cell: 1 << lanes_log2, at most 32
  std::uint32_t aligned;     // every cell starts 8-byte aligned (the byte path's whole words)
  std::uint32_t one_chunk_per_lane;  // no cell has more chunks than lanes
  std::uint32_t per_plane;   // cells per plane: heads * tokens
  std::uint32_t cells;       // cells per block: planes * per_plane
  std::uint32_t units;       // units per block: cells / cells_per_unit, rounded up
  std::uint32_t pass;        // cells from one pass to the next: warps * cells per warp
  std::uint32_t stepped;     // per_plane >= pass: a cursor steps by pass_heads, pass_tokens
  std::uint32_t pass_heads;  // pass / tokens
  std::uint32_t pass_tokens;  // pass % tokens
  std::uint32_t one_kernel_block;  // the window's tokens all lie in the first kernel block
};

// Device code; a harness that defines this as __host__ __device__ __forceinline__ before
// including this file runs the lanes' arithmetic on the CPU (how this kernel was checked lane by
// lane against the definition, over random layouts, alignments and windows).
#ifndef MORIIO_CHECKSUM_HD
#define MORIIO_CHECKSUM_HD __device__ __forceinline__
#endif

/// 8 bytes at `at` (8-byte aligned), little-endian. Through the read-only data path (`__ldg`),
/// which needs memory that nothing writes while the kernel runs: a write to checked cells
/// meanwhile would race the check itself.
MORIIO_CHECKSUM_HD std::uint64_t LoadOne(const unsigned char* at) {
#if defined(__CUDA_ARCH__)
#if MORIIO_CUDACOPY_CHECKSUM_STREAMING
  return __ldcs(reinterpret_cast<const unsigned long long*>(at));
#else
  return __ldg(reinterpret_cast<const unsigned long long*>(at));
#endif
#else
  std::uint64_t word;
  std::memcpy(&word, at, 8);
  return word;
#endif
}

/// 16 bytes at `at` (16-byte aligned) as two little-endian words, in one load.
MORIIO_CHECKSUM_HD void LoadPair(const unsigned char* at, std::uint64_t* word) {
#if defined(__CUDA_ARCH__)
#if MORIIO_CUDACOPY_CHECKSUM_STREAMING
  const ulonglong2 pair = __ldcs(reinterpret_cast<const ulonglong2*>(at));
#else
  const ulonglong2 pair = __ldg(reinterpret_cast<const ulonglong2*>(at));
#endif
  word[0] = pair.x;
  word[1] = pair.y;
#else
  std::memcpy(word, at, 16);
#endif
}

/// Chunk `k` of a cell of `bytes` bytes at `cell`: kLoadPairs two words, else one (the byte
/// path zero-pads past the cell's end).
template <std::uint32_t kLoad>
MORIIO_CHECKSUM_HD void LoadChunk(const unsigned char* cell, std::uint32_t k, std::uint32_t bytes,
                                  bool aligned, std::uint64_t* word) {
  if constexpr (kLoad == kLoadPairs) {
    LoadPair(cell + k * 16, word);
  } else if constexpr (kLoad == kLoadWords) {
    word[0] = LoadOne(cell + k * 8);
  } else {
    const std::uint32_t at = k * 8;
    if (aligned && at + 8 <= bytes) {
      word[0] = LoadOne(cell + at);
      return;
    }
    word[0] = 0;
    const std::uint32_t n = bytes - at < 8 ? bytes - at : 8;
    for (std::uint32_t i = 0; i < n; ++i) word[0] |= std::uint64_t{cell[at + i]} << (8 * i);
  }
}

/// Cell `c` of a block (planes, then heads, then tokens, inside the window) as its plane `p`,
/// head `h` and token `t` (both counted from the window's start).
struct Cursor {
  std::uint32_t c;
  std::uint32_t p;
  std::uint32_t h;
  std::uint32_t t;
};

/// The cursor of cell `c`, by division (once per unit, or per pass in planes smaller than one).
MORIIO_CHECKSUM_HD Cursor CursorAt(const SumLayer& s, std::uint32_t c) {
  const std::uint32_t p = c >= s.per_plane ? 1 : 0;
  const std::uint32_t r = c - p * s.per_plane;
  const std::uint32_t h = r / s.l.tokens;
  return Cursor{c, p, h, r - h * s.l.tokens};
}

/// The cursor one pass on. Stepping is exact when a plane has at least a pass of cells
/// (pass_tokens < tokens and pass_heads <= heads, so each carry happens at most once).
MORIIO_CHECKSUM_HD Cursor NextPass(const SumLayer& s, Cursor k) {
  if (!s.stepped) return CursorAt(s, k.c + s.pass);
  k.c += s.pass;
  k.t += s.pass_tokens;
  k.h += s.pass_heads;
  if (k.t >= s.l.tokens) {
    k.t -= s.l.tokens;
    ++k.h;
  }
  if (k.h >= s.l.heads) {
    k.h -= s.l.heads;
    ++k.p;
  }
  return k;
}

/// Where cell `k` starts, in bytes from its block's start. Indices are 32-bit, so each product
/// with a 64-bit stride is one wide multiply and one multiply-add.
MORIIO_CHECKSUM_HD std::int64_t CellOffset(const SumLayer& s, const Cursor& k) {
  const moriio_cudacopy_checksum_layer& l = s.l;
  const std::int64_t offset = s.plane_origin[k.p] + static_cast<std::int64_t>(k.h) * l.head_stride;
  if (s.one_kernel_block) return offset + static_cast<std::int64_t>(k.t) * l.token_stride;
  const std::uint32_t token = k.t + l.token_begin;
  const std::uint32_t kernel_block = token / l.kernel_block_size;
  return offset + static_cast<std::int64_t>(kernel_block) * l.kernel_block_stride +
         static_cast<std::int64_t>(token - kernel_block * l.kernel_block_size) * l.token_stride;
}

/// The position term of cell `c`'s first word (its plane from its index: c < per_plane is
/// plane 0, and a layer of one plane has no other cells).
MORIIO_CHECKSUM_HD std::uint64_t CellTerm(const SumLayer& s, std::uint32_t c) {
  const std::uint32_t p = c >= s.per_plane ? 1 : 0;
  return std::uint64_t{c} * s.term_step[p] + s.term_base[p];
}

/// A cell of a block as the table of a layer of few cells keeps it: where it starts from its
/// block's start, and its first word's position term.
struct CellEntry {
  std::int64_t offset;
  std::uint64_t term;
};

/// The table's capacity: blocks of up to this many cells (vLLM's blocks of 16 to 128 tokens of
/// 8 KV heads, K and V: 256 to 2,048) are looked up, larger ones walked with a cursor. 32 KiB of
/// shared memory; the registers already keep the CTAs per SM below four. (0: every block
/// walked, a variant to measure.)
#ifndef MORIIO_CUDACOPY_CHECKSUM_TABLE_CELLS
#define MORIIO_CUDACOPY_CHECKSUM_TABLE_CELLS 2048
#endif
constexpr std::uint32_t kTableCells = MORIIO_CUDACOPY_CHECKSUM_TABLE_CELLS;

MORIIO_CHECKSUM_HD CellEntry EntryOf(const SumLayer& s, std::uint32_t c) {
  return CellEntry{CellOffset(s, CursorAt(s, c)), CellTerm(s, c)};
}

/// The terms of this lane's chunks of the unit's cells (from `first_cell`, a pass apart) in the
/// block at `block`; `lane_term` is the position term of the lane's first word in a cell, less
/// the cell's; bit p of `lane_planes` is set where the lane has a chunk in plane p's cells
/// (worked out once, not read from shared memory per pass). kTabled: each cell's offset and
/// term are read from `table` (one shared-memory load instead of a cursor step, two wide
/// multiplies and a branch per pass); otherwise a cursor walks the cells. When no cell has more
/// chunks than its lanes (cells up to 512 bytes with 16-byte loads) a lane takes at most one
/// chunk per cell, and every pass's load is issued before the first term is computed, so each
/// lane has kPasses loads in flight; longer cells loop over their chunks.
template <std::uint32_t kLoad, bool kTabled>
MORIIO_CHECKSUM_HD std::uint64_t UnitTerms(const SumLayer& s, const CellEntry* table,
                                           const unsigned char* block, std::uint32_t first_cell,
                                           std::uint32_t first_chunk, std::uint64_t lane_term,
                                           std::uint32_t lane_planes) {
  constexpr int kWords = kLoad == kLoadPairs ? 2 : 1;  // per chunk
  const bool aligned = s.aligned != 0;
  std::uint64_t sum = 0;
  Cursor k{first_cell, 0, 0, 0};
  if constexpr (!kTabled) k = CursorAt(s, first_cell);
  if (s.one_chunk_per_lane) {
    std::uint64_t word[kPasses][kWords];
    std::uint32_t cell[kPasses];  // its index, kNoCell where the lane has no chunk
#pragma unroll
    for (int pass = 0; pass < kPasses; ++pass) {
      cell[pass] = kNoCell;
      if (k.c < s.cells) {
        const std::uint32_t p = kTabled ? (k.c >= s.per_plane ? 1 : 0) : k.p;
        if ((lane_planes >> p) & 1) {
          const std::int64_t offset = kTabled ? table[k.c].offset : CellOffset(s, k);
          LoadChunk<kLoad>(block + offset, first_chunk, s.l.plane_bytes[p], aligned, word[pass]);
          cell[pass] = k.c;
        }
      }
      if (pass + 1 < kPasses) {
        if constexpr (kTabled) {
          k.c += s.pass;
        } else {
          k = NextPass(s, k);
        }
      }
    }
#pragma unroll
    for (int pass = 0; pass < kPasses; ++pass) {
      if (cell[pass] == kNoCell) continue;
      std::uint64_t term = (kTabled ? table[cell[pass]].term : CellTerm(s, cell[pass])) + lane_term;
#pragma unroll
      for (int i = 0; i < kWords; ++i) {
        sum += moriio_native::Mix64(word[pass][i] ^ term);
        term += moriio_native::kChecksumPositionStep;  // the next word's
      }
    }
    return sum;
  }
  const std::uint32_t lanes = 1u << s.lanes_log2;
  // From one of the lane's chunks to its next: lanes * kWords words on.
  const std::uint64_t lanes_term =
      std::uint64_t{lanes} * kWords * moriio_native::kChecksumPositionStep;
  for (int pass = 0; pass < kPasses && k.c < s.cells; ++pass) {
    const CellEntry entry = kTabled ? table[k.c] : CellEntry{CellOffset(s, k), CellTerm(s, k.c)};
    const std::uint32_t p = kTabled ? (k.c >= s.per_plane ? 1 : 0) : k.p;
    const unsigned char* at = block + entry.offset;
    const std::uint32_t bytes = s.l.plane_bytes[p];
    const std::uint32_t chunks = s.chunks[p];
    std::uint64_t term = entry.term + lane_term;
#pragma unroll 4
    for (std::uint32_t chunk = first_chunk; chunk < chunks; chunk += lanes) {
      std::uint64_t word[kWords];
      LoadChunk<kLoad>(at, chunk, bytes, aligned, word);
#pragma unroll
      for (int i = 0; i < kWords; ++i) {
        sum += moriio_native::Mix64(word[i] ^ (term + i * moriio_native::kChecksumPositionStep));
      }
      term += lanes_term;
    }
    if constexpr (kTabled) {
      k.c += s.pass;
    } else {
      k = NextPass(s, k);
    }
  }
  return sum;
}

/// This CTA's units of layer `s` (kLoad: its Load; kTabled: its cells in `table`), summed into
/// `out`.
template <std::uint32_t kLoad, bool kTabled>
__device__ __forceinline__ void SumUnits(const SumLayer& s, const CellEntry* table,
                                         const std::int64_t* ids, std::uint64_t num_ids,
                                         unsigned long long* out) {
  constexpr std::uint32_t kWords = kLoad == kLoadPairs ? 2 : 1;
  const unsigned lane = threadIdx.x & 31;
  const unsigned warp = threadIdx.x >> 5;
  const unsigned cells_per_warp = 32u >> s.lanes_log2;
  const std::uint32_t slot = warp * cells_per_warp + (lane >> s.lanes_log2);
  const std::uint32_t first_chunk = lane & ((1u << s.lanes_log2) - 1);
  const std::uint64_t lane_term =
      std::uint64_t{first_chunk * kWords} * moriio_native::kChecksumPositionStep;
  const std::uint32_t lane_planes =
      (first_chunk < s.chunks[0] ? 1u : 0u) | (first_chunk < s.chunks[1] ? 2u : 0u);
  const auto* base = reinterpret_cast<const unsigned char*>(s.l.base);
  // This CTA's units, (block index i, unit of the block) from blockIdx.x, gridDim.x apart.
  std::uint64_t i = blockIdx.x / s.units;
  std::uint32_t unit = blockIdx.x - static_cast<std::uint32_t>(i) * s.units;
  const std::uint32_t stride_ids = gridDim.x / s.units;
  const std::uint32_t stride_units = gridDim.x - stride_ids * s.units;
  // Each unit's block id is read one unit ahead: its latency is not paid before the loads.
  std::int64_t id = i < num_ids ? ids[i] : 0;
  while (i < num_ids) {
    std::uint64_t next = i + stride_ids;
    std::uint32_t next_unit = unit + stride_units;
    if (next_unit >= s.units) {
      next_unit -= s.units;
      ++next;
    }
    const std::int64_t next_id = next < num_ids ? ids[next] : 0;
    std::uint64_t sum = UnitTerms<kLoad, kTabled>(s, table, base + id * s.l.block_stride,
                                                  unit * s.pass * kPasses + slot, first_chunk,
                                                  lane_term, lane_planes);
#pragma unroll
    for (int delta = 16; delta > 0; delta >>= 1) sum += __shfl_down_sync(0xffffffffu, sum, delta);
    if (lane == 0 && sum != 0) atomicAdd(out + blockIdx.y * num_ids + i, sum);
    i = next;
    unit = next_unit;
    id = next_id;
  }
}

// 80 registers: 3 CTAs per SM. Asking for 4 (64 registers) spills 136 bytes.
__global__ void __launch_bounds__(kThreads)
    ChecksumKernel(const SumLayer* layers, const std::int64_t* ids, std::uint64_t num_ids,
                   unsigned long long* out) {
  // The layer in shared memory: its fields feed every address, and read from global memory
  // they would be reloaded after each atomic.
  __shared__ SumLayer s;
  __shared__ CellEntry table[kTableCells > 0 ? kTableCells : 1];
  if (threadIdx.x == 0) s = layers[blockIdx.y];
  __syncthreads();
  const bool tabled = s.cells <= kTableCells;
  if (tabled) {
    for (std::uint32_t c = threadIdx.x; c < s.cells; c += kThreads) table[c] = EntryOf(s, c);
    __syncthreads();
  }
  // One path per way of loading and of finding cells (the same for the whole CTA): the
  // whole-load paths have no byte loop and no bounds test per word.
  if (tabled) {
    if (s.load == kLoadPairs) {
      SumUnits<kLoadPairs, true>(s, table, ids, num_ids, out);
    } else if (s.load == kLoadWords) {
      SumUnits<kLoadWords, true>(s, table, ids, num_ids, out);
    } else {
      SumUnits<kLoadBytes, true>(s, table, ids, num_ids, out);
    }
  } else if (s.load == kLoadPairs) {
    SumUnits<kLoadPairs, false>(s, table, ids, num_ids, out);
  } else if (s.load == kLoadWords) {
    SumUnits<kLoadWords, false>(s, table, ids, num_ids, out);
  } else {
    SumUnits<kLoadBytes, false>(s, table, ids, num_ids, out);
  }
}

template <typename... Args>
void Say(char* err, size_t err_len, const char* format, Args... args) {
  if (err != nullptr && err_len != 0) std::snprintf(err, err_len, format, args...);
}

void SayCuda(char* err, size_t err_len, const char* what, cudaError_t e) {
  Say(err, err_len, "%s: %s (%s)", what, cudaGetErrorString(e), cudaGetErrorName(e));
}

/// The kernel's form of layer `index`; false (err set) when a field is outside the ABI's ranges.
bool Prepare(const moriio_cudacopy_checksum_layer& l, std::uint32_t index, SumLayer* out,
             char* err, size_t err_len) {
  if (l.planes < 1 || l.planes > 2 || l.heads < 1 || l.tokens < 1 || l.kernel_block_size < 1) {
    Say(err, err_len,
        "checksum layer %u: planes %u (1 or 2), heads %u, tokens %u and kernel_block_size %u "
        "(each >= 1)",
        index, l.planes, l.heads, l.tokens, l.kernel_block_size);
    return false;
  }
  SumLayer s{};
  s.l = l;
  std::uint64_t misaligned = l.base | static_cast<std::uint64_t>(l.block_stride) |
                             static_cast<std::uint64_t>(l.head_stride) |
                             static_cast<std::uint64_t>(l.token_stride) |
                             static_cast<std::uint64_t>(l.kernel_block_stride);
  std::uint32_t bytes_or = 0;  // any plane's bytes not a multiple of 8 or 16 shows here
  std::uint32_t words[2] = {0, 0};
  for (std::uint32_t p = 0; p < l.planes; ++p) {
    if (l.plane_bytes[p] < 1 || l.plane_bytes[p] > kMaxPlaneBytes) {
      Say(err, err_len, "checksum layer %u: plane %u of %u bytes (1 .. %u)", index, p,
          l.plane_bytes[p], kMaxPlaneBytes);
      return false;
    }
    words[p] = (l.plane_bytes[p] + 7) / 8;
    bytes_or |= l.plane_bytes[p];
    misaligned |= static_cast<std::uint64_t>(l.plane_offset[p]);
  }
  // heads * tokens cannot wrap 64 bits (each factor is below 2^32); times two planes it could,
  // so the per-plane count is bounded first.
  const std::uint64_t per_plane = std::uint64_t{l.heads} * l.tokens;
  const std::uint64_t cells = l.planes * std::min(per_plane, kMaxCells);
  if (cells >= kMaxCells) {
    Say(err, err_len,
        "checksum layer %u: %u * %u * %u cells per block (planes * heads * tokens; fewer than "
        "%llu)",
        index, l.planes, l.heads, l.tokens, static_cast<unsigned long long>(kMaxCells));
    return false;
  }
  s.aligned = (misaligned & 7) == 0;
  s.load = kLoadBytes;
  if (s.aligned && (bytes_or & 7) == 0) s.load = kLoadWords;
  if (MORIIO_CUDACOPY_CHECKSUM_WIDE && (misaligned & 15) == 0 && (bytes_or & 15) == 0) {
    s.load = kLoadPairs;
  }
  const std::uint32_t words_per_chunk = s.load == kLoadPairs ? 2 : 1;
  std::uint32_t most_chunks = 0;
  for (std::uint32_t p = 0; p < l.planes; ++p) {
    s.chunks[p] = words[p] / words_per_chunk;  // exact: a pair layer's words are even
    most_chunks = std::max(most_chunks, s.chunks[p]);
  }
  while (s.lanes_log2 < 5 && (1u << s.lanes_log2) < most_chunks) ++s.lanes_log2;
  s.one_chunk_per_lane = most_chunks <= (1u << s.lanes_log2);
  s.per_plane = l.heads * l.tokens;
  s.cells = static_cast<std::uint32_t>(cells);
  s.pass = kWarps * (32u >> s.lanes_log2);
  s.units = (s.cells + s.pass * kPasses - 1) / (s.pass * kPasses);
  s.stepped = s.per_plane >= s.pass;
  s.pass_heads = s.pass / l.tokens;
  s.pass_tokens = s.pass % l.tokens;
  s.one_kernel_block = std::uint64_t{l.token_begin} + l.tokens <= l.kernel_block_size;
  // Word i of the stream (checksum.hpp) is mixed with (i + 1) * step, all modulo 2^64. Cell c
  // of plane p starts at word first_of_plane(p) + (c - p * per_plane) * words[p], so its term
  // is c * (words[p] * step) + (first_of_plane(p) - p * per_plane * words[p] + 1) * step.
  const std::uint64_t step = moriio_native::kChecksumPositionStep;
  for (std::uint32_t p = 0; p < l.planes; ++p) {
    const std::uint64_t first_of_plane = p == 1 ? std::uint64_t{s.per_plane} * words[0] : 0;
    const std::uint64_t before = std::uint64_t{p} * s.per_plane * words[p];
    s.term_step[p] = words[p] * step;
    s.term_base[p] = (first_of_plane - before + 1) * step;
    s.plane_origin[p] = l.plane_offset[p] + static_cast<std::int64_t>(l.head_begin) * l.head_stride;
    if (s.one_kernel_block) {
      s.plane_origin[p] += static_cast<std::int64_t>(l.token_begin) * l.token_stride;
    }
  }
  *out = s;
  return true;
}

/// The driver's current-context calls (the plugin links no libcuda: the runtime loads it).
struct ContextCalls {
  int (*get)(void**) = nullptr;
  int (*set)(void*) = nullptr;
};

const ContextCalls& Contexts() {
  static const ContextCalls calls = [] {
    ContextCalls c;
    void* lib = dlopen("libcuda.so.1", RTLD_NOW | RTLD_LOCAL);  // kept loaded
    if (lib == nullptr) return c;
    c.get = reinterpret_cast<int (*)(void**)>(dlsym(lib, "cuCtxGetCurrent"));
    c.set = reinterpret_cast<int (*)(void*)>(dlsym(lib, "cuCtxSetCurrent"));
    if (c.get == nullptr || c.set == nullptr) c = ContextCalls{};
    return c;
  }();
  return calls;
}

/// Makes `device` current for its lifetime and the caller's CUDA context current again after --
/// the very context, none included: a thread that had none (a verify pool thread) must not be
/// left with one, and restoring "device 0" (what cudaGetDevice says for such a thread) would
/// create device 0's primary context (cudaSetDevice initialises it, CUDA >= 12) in a process
/// that works on another GPU.
class DeviceScope {
 public:
  explicit DeviceScope(int device) {
    // Before the driver's first use (cuInit) the thread has no context either: none to restore.
    saved_ = Contexts().set != nullptr;
    if (saved_ && Contexts().get(&previous_) != 0) previous_ = nullptr;
    status_ = cudaSetDevice(device);
  }
  ~DeviceScope() {
    if (saved_) Contexts().set(previous_);
  }
  DeviceScope(const DeviceScope&) = delete;
  DeviceScope& operator=(const DeviceScope&) = delete;
  cudaError_t status() const { return status_; }

 private:
  void* previous_ = nullptr;
  bool saved_ = false;
  cudaError_t status_ = cudaSuccess;
};

/// Resident CTAs of the kernel on `device`: the grid never needs more.
cudaError_t ResidentCtas(int device, int* out) {
  int sms = 0;
  int per_sm = 0;
  cudaError_t e = cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device);
  if (e == cudaSuccess) {
    e = cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, ChecksumKernel, kThreads, 0);
  }
  *out = sms * std::max(per_sm, 1);
  return e;
}

struct DeviceFree {
  void operator()(unsigned char* p) const { cudaFree(p); }
};
struct PinnedFree {
  void operator()(unsigned char* p) const { cudaFreeHost(p); }
};

/// What every call on one device reuses: device memory for the arguments and values, a pinned
/// host buffer of the same size (copies from and to pageable memory are staged by the driver,
/// synchronously, at several microseconds each), and the kernel's resident CTAs.
struct DeviceScratch {
  std::unique_ptr<unsigned char, DeviceFree> device;
  std::unique_ptr<unsigned char, PinnedFree> host;
  std::size_t bytes = 0;
  int resident = 0;  // 0: not asked yet
};

/// The calls' DeviceScratch, one per device, kept for the process (an allocation per call cost
/// more than the kernel: cudaFree synchronises the device, and the default pool of
/// cudaMallocAsync gives its memory back at every synchronisation). Calls hold the lock from
/// taking the buffers to their last use of them.
class Scratch {
 public:
  static Scratch& Shared() {
    static Scratch* shared = new Scratch;  // never destroyed: callable until the process ends
    return *shared;
  }
  std::mutex& lock() { return lock_; }
  /// Buffers of at least `bytes` on the current device `device` and its resident CTAs (the lock
  /// held); null with `*e` and `*what` set on failure.
  DeviceScratch* Take(int device, std::size_t bytes, cudaError_t* e, const char** what) {
    DeviceScratch& d = devices_[device];
    *e = cudaSuccess;
    if (d.resident == 0) {
      *what = "sizing the checksum grid";
      *e = ResidentCtas(device, &d.resident);
      if (*e != cudaSuccess) {
        d.resident = 0;
        return nullptr;
      }
    }
    if (d.bytes < bytes) {
      d = DeviceScratch{nullptr, nullptr, 0, d.resident};
      std::size_t size = 64 << 10;
      while (size < bytes) size *= 2;
      unsigned char* memory = nullptr;
      *what = "allocating the checksum arguments";
      *e = cudaMalloc(reinterpret_cast<void**>(&memory), size);
      if (*e != cudaSuccess) return nullptr;
      d.device.reset(memory);
      memory = nullptr;
      *e = cudaMallocHost(reinterpret_cast<void**>(&memory), size);
      if (*e != cudaSuccess) return nullptr;
      d.host.reset(memory);
      d.bytes = size;
    }
    return &d;
  }

 private:
  std::mutex lock_;
  std::map<int, DeviceScratch> devices_;
};

}  // namespace

int ChecksumBlocks(int device, std::uint64_t stream, const moriio_cudacopy_checksum_layer* layers,
                   std::uint32_t num_layers, const std::int64_t* block_ids, std::uint64_t num_ids,
                   std::uint64_t* out, char* err, size_t err_len) {
  if (num_layers > kMaxLayers) {
    Say(err, err_len, "%u checksum layers in one call: at most %u", num_layers, kMaxLayers);
    return -1;
  }
  std::vector<SumLayer> prepared(num_layers);
  std::uint64_t most_units = 0;
  for (std::uint32_t i = 0; i < num_layers; ++i) {
    if (!Prepare(layers[i], i, &prepared[i], err, err_len)) return -1;
    most_units = std::max(most_units, prepared[i].units * num_ids);
  }
  if (most_units == 0) return 0;  // no layer or no block: nothing to sum
  const DeviceScope scope(device);
  if (scope.status() != cudaSuccess) {
    SayCuda(err, err_len, "cudaSetDevice", scope.status());
    return -1;
  }
  auto* s = reinterpret_cast<cudaStream_t>(stream);
  const std::size_t layer_bytes = prepared.size() * sizeof(SumLayer);
  const std::size_t id_bytes = num_ids * sizeof(std::int64_t);
  const std::size_t argument_bytes = layer_bytes + id_bytes;
  const std::size_t out_bytes = std::size_t{num_layers} * num_ids * sizeof(std::uint64_t);
  Scratch& scratch = Scratch::Shared();
  const std::lock_guard<std::mutex> hold(scratch.lock());
  const char* what = "";
  cudaError_t e = cudaSuccess;
  DeviceScratch* buffers = scratch.Take(device, argument_bytes + out_bytes, &e, &what);
  if (buffers == nullptr) {
    SayCuda(err, err_len, what, e);
    return -1;
  }
  // The arguments in one pinned buffer: one asynchronous copy to the device.
  unsigned char* host = buffers->host.get();
  std::memcpy(host, prepared.data(), layer_bytes);
  std::memcpy(host + layer_bytes, block_ids, id_bytes);
  unsigned char* memory = buffers->device.get();
  auto* d_layers = reinterpret_cast<SumLayer*>(memory);
  auto* d_ids = reinterpret_cast<std::int64_t*>(memory + layer_bytes);
  auto* d_out = reinterpret_cast<unsigned long long*>(memory + argument_bytes);
  what = "copying the checksum arguments";
  e = cudaMemcpyAsync(memory, host, argument_bytes, cudaMemcpyHostToDevice, s);
  if (e == cudaSuccess) e = cudaMemsetAsync(d_out, 0, out_bytes, s);
  if (e == cudaSuccess) {
    what = "the checksum kernel";
    // Every resident CTA busy, spread over the layers; none beyond the largest layer's units.
    const std::uint64_t across = std::clamp<std::uint64_t>(
        (static_cast<std::uint64_t>(buffers->resident) * 2 + num_layers - 1) / num_layers, 1,
        most_units);
    (void)cudaGetLastError();  // an earlier call's error is not this launch's (see Enqueue)
    ChecksumKernel<<<dim3(static_cast<unsigned>(across), num_layers), kThreads, 0, s>>>(
        d_layers, d_ids, num_ids, d_out);
    e = cudaGetLastError();
  }
  if (e == cudaSuccess) {
    what = "copying the checksums back";
    e = cudaMemcpyAsync(host + argument_bytes, d_out, out_bytes, cudaMemcpyDeviceToHost, s);
  }
  // Also after a failure: the buffers are reused only once nothing queued here uses them.
  const cudaError_t done = cudaStreamSynchronize(s);
  if (e == cudaSuccess && done != cudaSuccess) {
    what = "the checksum kernel";
    e = done;
  }
  if (e != cudaSuccess) {
    SayCuda(err, err_len, what, e);
    return -1;
  }
  std::memcpy(out, host + argument_bytes, out_bytes);
  return 0;
}

}  // namespace moriio_cudacopy
