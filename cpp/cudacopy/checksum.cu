// The integrity check's block checksums of device layers, in one kernel (cudacopy_abi.h's
// checksum_blocks; the value is defined in include/moriio_native/checksum.hpp).
//
// Why here: torch computes the same value (python/moriio_native/verify.py) with a dozen
// elementwise kernels per layer over int64 temporaries, 0.026x of a device copy on an H200
// (docs/benchmarks.md). The value is a sum of independent per-word terms, so one pass that reads
// each byte once and reduces in registers is bound by memory, not launches.
//
// The grid: y = the layer, x walks that layer's (block, cell group) units. A cell's words are
// read by a group of lanes (a power of two, up to the warp), consecutive lanes consecutive words,
// so a cell of 256 bytes is one coalesced warp load; small cells pack several per warp. Each warp
// sums its terms in registers and adds them to its block's value with one atomic (a sum modulo
// 2^64 is what atomicAdd on unsigned 64-bit integers computes, in any order).
//
// Finding a cell (its plane, head and token from its index in the block) is integer division,
// which a GPU does in software: 64-bit divisions per cell cost more than the checksum itself.
// So cell indices are 32-bit (a block has fewer than 2^31 cells, checked), a lane's cell moves
// from one pass to the next by adding the pass's step as heads and tokens (no division when a
// plane has at least a pass of cells), a unit's block by adding the grid's stride as blocks and
// units, and tokens split into kernel blocks only where the window crosses one.

#include <cuda_runtime.h>

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
// Cell passes per unit: each lane has this many independent words in flight per unit (a
// compile-time value so that variants can be measured: bench/h200_session.sh).
#ifndef MORIIO_CUDACOPY_CHECKSUM_PASSES
#define MORIIO_CUDACOPY_CHECKSUM_PASSES 8
#endif
constexpr int kPasses = MORIIO_CUDACOPY_CHECKSUM_PASSES;
constexpr std::uint32_t kMaxPlaneBytes = 1u << 20;
constexpr std::uint32_t kMaxLayers = 65535;  // the grid's y dimension

constexpr std::uint64_t kMaxCells = 1u << 31;  // per block: cell indices stay 32-bit

/// One layer as the kernel reads it: the ABI's fields and what follows from them.
struct SumLayer {
  moriio_cudacopy_checksum_layer l;
  std::uint32_t words[2];    // 8-byte words per cell, per plane (the tail zero-padded)
  std::uint32_t lanes_log2;  // lanes per cell: 1 << lanes_log2, at most 32
  std::uint32_t aligned;     // every cell starts 8-byte aligned: whole words load at once
  std::uint32_t one_word_per_lane;  // no cell has more words than lanes (cells <= 256 bytes)
  std::uint32_t per_plane;   // cells per plane: heads * tokens
  std::uint32_t cells;       // cells per block: planes * per_plane
  std::uint32_t units;       // units per block: cells / cells_per_unit, rounded up
  std::uint32_t pass;        // cells from one pass to the next: warps * cells per warp
  std::uint32_t stepped;     // per_plane >= pass: a cursor steps by pass_heads, pass_tokens
  std::uint32_t pass_heads;  // pass / tokens
  std::uint32_t pass_tokens;  // pass % tokens
  std::uint32_t one_kernel_block;  // the window's tokens all lie in the first kernel block
};

/// Word `k` of a cell of `bytes` bytes at `cell`, zero-padded past its end.
__device__ __forceinline__ std::uint64_t LoadWord(const unsigned char* cell, std::uint32_t k,
                                                  std::uint32_t bytes, bool aligned) {
  const std::uint32_t at = k * 8;
  if (aligned && at + 8 <= bytes) return *reinterpret_cast<const std::uint64_t*>(cell + at);
  std::uint64_t word = 0;
  const std::uint32_t n = min(8u, bytes - at);
  for (std::uint32_t i = 0; i < n; ++i) word |= std::uint64_t{cell[at + i]} << (8 * i);
  return word;
}

/// Where a cell's words are: its first byte, its bytes, and the term position of its first
/// word (its index in the block's word stream, plus one).
struct CellAt {
  const unsigned char* bytes;
  std::uint32_t size;
  std::uint32_t words;
  std::uint64_t first;
};

/// Cell `c` of a block (planes, then heads, then tokens, inside the window) as its plane `p`,
/// head `h` and token `t` (both counted from the window's start).
struct Cursor {
  std::uint32_t c;
  std::uint32_t p;
  std::uint32_t h;
  std::uint32_t t;
};

/// The cursor of cell `c`, by division (once per unit, or per pass in planes smaller than one).
__device__ __forceinline__ Cursor CursorAt(const SumLayer& s, std::uint32_t c) {
  const std::uint32_t p = c >= s.per_plane ? 1 : 0;
  const std::uint32_t r = c - p * s.per_plane;
  const std::uint32_t h = r / s.l.tokens;
  return Cursor{c, p, h, r - h * s.l.tokens};
}

/// The cursor one pass on. Stepping is exact when a plane has at least a pass of cells
/// (pass_tokens < tokens and pass_heads <= heads, so each carry happens at most once).
__device__ __forceinline__ Cursor NextPass(const SumLayer& s, Cursor k) {
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

/// Where cell `k` of block `block` is.
__device__ __forceinline__ CellAt Locate(const SumLayer& s, std::int64_t block, const Cursor& k) {
  const moriio_cudacopy_checksum_layer& l = s.l;
  const std::uint32_t token = k.t + l.token_begin;
  std::uint32_t kernel_block = 0;
  std::uint32_t in_kernel_block = token;
  if (!s.one_kernel_block) {
    kernel_block = token / l.kernel_block_size;
    in_kernel_block = token - kernel_block * l.kernel_block_size;
  }
  const std::int64_t offset = block * l.block_stride + l.plane_offset[k.p] +
                              static_cast<std::int64_t>(k.h + l.head_begin) * l.head_stride +
                              static_cast<std::int64_t>(kernel_block) * l.kernel_block_stride +
                              static_cast<std::int64_t>(in_kernel_block) * l.token_stride;
  const std::uint64_t in_plane = std::uint64_t{k.h} * l.tokens + k.t;
  const std::uint64_t first_of_plane = k.p == 1 ? std::uint64_t{s.per_plane} * s.words[0] : 0;
  return CellAt{reinterpret_cast<const unsigned char*>(l.base + offset), l.plane_bytes[k.p],
                s.words[k.p], first_of_plane + in_plane * s.words[k.p] + 1};
}

__device__ __forceinline__ std::uint64_t Term(std::uint64_t word, std::uint64_t position) {
  return moriio_native::Mix64(word ^ (position * moriio_native::kChecksumPositionStep));
}

/// The terms of this lane's words of the unit's cells (from `first_cell`, a pass apart). When
/// no cell has more words than its lanes (cells up to 256 bytes) a lane takes at most one word
/// per cell, and every pass's load is issued before the first term is computed, so each lane
/// has kPasses loads in flight; longer cells loop over their words.
__device__ __forceinline__ std::uint64_t UnitTerms(const SumLayer& s, std::int64_t block,
                                                   std::uint32_t first_cell,
                                                   std::uint32_t first_word) {
  const bool aligned = s.aligned != 0;
  std::uint64_t sum = 0;
  Cursor k = CursorAt(s, first_cell);
  if (s.one_word_per_lane) {
    std::uint64_t word[kPasses];
    std::uint64_t position[kPasses];
#pragma unroll
    for (int pass = 0; pass < kPasses; ++pass) {
      position[pass] = 0;
      if (k.c < s.cells) {
        const CellAt cell = Locate(s, block, k);
        if (first_word < cell.words) {
          word[pass] = LoadWord(cell.bytes, first_word, cell.size, aligned);
          position[pass] = cell.first + first_word;
        }
      }
      if (pass + 1 < kPasses) k = NextPass(s, k);
    }
#pragma unroll
    for (int pass = 0; pass < kPasses; ++pass) {
      if (position[pass] != 0) sum += Term(word[pass], position[pass]);
    }
    return sum;
  }
  for (int pass = 0; pass < kPasses && k.c < s.cells; ++pass) {
    const CellAt cell = Locate(s, block, k);
    for (std::uint32_t w = first_word; w < cell.words; w += 1u << s.lanes_log2) {
      sum += Term(LoadWord(cell.bytes, w, cell.size, aligned), cell.first + w);
    }
    k = NextPass(s, k);
  }
  return sum;
}

__global__ void __launch_bounds__(kThreads)
    ChecksumKernel(const SumLayer* layers, const std::int64_t* ids, std::uint64_t num_ids,
                   unsigned long long* out) {
  // The layer in shared memory: its fields feed every address, and read from global memory
  // they would be reloaded after each atomic.
  __shared__ SumLayer s;
  if (threadIdx.x == 0) s = layers[blockIdx.y];
  __syncthreads();
  const unsigned lane = threadIdx.x & 31;
  const unsigned warp = threadIdx.x >> 5;
  const unsigned cells_per_warp = 32u >> s.lanes_log2;
  const std::uint32_t slot = warp * cells_per_warp + (lane >> s.lanes_log2);
  const std::uint32_t first_word = lane & ((1u << s.lanes_log2) - 1);
  // This CTA's units, (block index i, unit of the block) from blockIdx.x, gridDim.x apart.
  std::uint64_t i = blockIdx.x / s.units;
  std::uint32_t unit = blockIdx.x - static_cast<std::uint32_t>(i) * s.units;
  const std::uint32_t stride_ids = gridDim.x / s.units;
  const std::uint32_t stride_units = gridDim.x - stride_ids * s.units;
  for (; i < num_ids; i += stride_ids) {
    std::uint64_t sum = UnitTerms(s, ids[i], unit * s.pass * kPasses + slot, first_word);
#pragma unroll
    for (int delta = 16; delta > 0; delta >>= 1) sum += __shfl_down_sync(0xffffffffu, sum, delta);
    if (lane == 0 && sum != 0) atomicAdd(out + blockIdx.y * num_ids + i, sum);
    unit += stride_units;
    if (unit >= s.units) {
      unit -= s.units;
      ++i;
    }
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
  std::uint32_t most_words = 0;
  std::uint64_t misaligned = l.base | static_cast<std::uint64_t>(l.block_stride) |
                             static_cast<std::uint64_t>(l.head_stride) |
                             static_cast<std::uint64_t>(l.token_stride) |
                             static_cast<std::uint64_t>(l.kernel_block_stride);
  for (std::uint32_t p = 0; p < l.planes; ++p) {
    if (l.plane_bytes[p] < 1 || l.plane_bytes[p] > kMaxPlaneBytes) {
      Say(err, err_len, "checksum layer %u: plane %u of %u bytes (1 .. %u)", index, p,
          l.plane_bytes[p], kMaxPlaneBytes);
      return false;
    }
    s.words[p] = (l.plane_bytes[p] + 7) / 8;
    most_words = std::max(most_words, s.words[p]);
    misaligned |= static_cast<std::uint64_t>(l.plane_offset[p]);
  }
  const std::uint64_t cells = std::uint64_t{l.planes} * l.heads * l.tokens;
  if (cells >= kMaxCells) {
    Say(err, err_len, "checksum layer %u: %llu cells per block (planes * heads * tokens; < %llu)",
        index, static_cast<unsigned long long>(cells), static_cast<unsigned long long>(kMaxCells));
    return false;
  }
  while (s.lanes_log2 < 5 && (1u << s.lanes_log2) < most_words) ++s.lanes_log2;
  s.aligned = (misaligned & 7) == 0;
  s.one_word_per_lane = most_words <= (1u << s.lanes_log2);
  s.per_plane = l.heads * l.tokens;
  s.cells = static_cast<std::uint32_t>(cells);
  s.pass = kWarps * (32u >> s.lanes_log2);
  s.units = (s.cells + s.pass * kPasses - 1) / (s.pass * kPasses);
  s.stepped = s.per_plane >= s.pass;
  s.pass_heads = s.pass / l.tokens;
  s.pass_tokens = s.pass % l.tokens;
  s.one_kernel_block = std::uint64_t{l.token_begin} + l.tokens <= l.kernel_block_size;
  *out = s;
  return true;
}

/// Makes `device` current for its lifetime and the caller's device current again after.
class DeviceScope {
 public:
  explicit DeviceScope(int device) {
    if (cudaGetDevice(&previous_) != cudaSuccess) previous_ = -1;
    status_ = cudaSetDevice(device);
  }
  ~DeviceScope() {
    if (previous_ >= 0) cudaSetDevice(previous_);
  }
  DeviceScope(const DeviceScope&) = delete;
  DeviceScope& operator=(const DeviceScope&) = delete;
  cudaError_t status() const { return status_; }

 private:
  int previous_ = -1;
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
