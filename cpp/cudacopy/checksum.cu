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

#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <map>
#include <mutex>
#include <vector>

#include "checksum.h"
#include "moriio_native/checksum_mix.hpp"

namespace moriio_cudacopy {
namespace {

constexpr int kThreads = 256;
constexpr int kWarps = kThreads / 32;
// Cell passes per unit: each lane has this many independent words in flight per unit.
constexpr int kPasses = 8;
constexpr std::uint32_t kMaxPlaneBytes = 1u << 20;
constexpr std::uint32_t kMaxLayers = 65535;  // the grid's y dimension

/// One layer as the kernel reads it: the ABI's fields and what follows from them.
struct SumLayer {
  moriio_cudacopy_checksum_layer l;
  std::uint32_t words[2];    // 8-byte words per cell, per plane (the tail zero-padded)
  std::uint32_t lanes_log2;  // lanes per cell: 1 << lanes_log2, at most 32
  std::uint32_t aligned;     // every cell starts 8-byte aligned: whole words load at once
  std::uint32_t one_word_per_lane;  // no cell has more words than lanes (cells <= 256 bytes)
  std::uint64_t cells;       // cells per block: planes * heads * tokens
  std::uint64_t units;       // units per block: cells / cells_per_unit, rounded up
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

/// Cell `c` (planes, then heads, then tokens, inside the window) of block `block`.
__device__ __forceinline__ CellAt Locate(const SumLayer& s, std::int64_t block, std::uint64_t c) {
  const moriio_cudacopy_checksum_layer& l = s.l;
  const std::uint64_t per_plane = std::uint64_t{l.heads} * l.tokens;
  const std::uint32_t p = c >= per_plane ? 1 : 0;
  const std::uint64_t r = c - p * per_plane;
  const std::uint64_t h = r / l.tokens;
  const std::uint64_t t = r - h * l.tokens + l.token_begin;
  const std::int64_t offset = block * l.block_stride + l.plane_offset[p] +
                              static_cast<std::int64_t>(h + l.head_begin) * l.head_stride +
                              static_cast<std::int64_t>(t / l.kernel_block_size) *
                                  l.kernel_block_stride +
                              static_cast<std::int64_t>(t % l.kernel_block_size) * l.token_stride;
  return CellAt{reinterpret_cast<const unsigned char*>(l.base + offset), l.plane_bytes[p],
                s.words[p], (p == 1 ? per_plane * s.words[0] : 0) + r * s.words[p] + 1};
}

__device__ __forceinline__ std::uint64_t Term(std::uint64_t word, std::uint64_t position) {
  return moriio_native::Mix64(word ^ (position * moriio_native::kChecksumPositionStep));
}

/// The terms of this lane's words of the unit's cells (from `first_cell`, a pass apart). When
/// no cell has more words than its lanes (cells up to 256 bytes) a lane takes at most one word
/// per cell, and every pass's load is issued before the first term is computed, so each lane
/// has kPasses loads in flight; longer cells loop over their words.
__device__ __forceinline__ std::uint64_t UnitTerms(const SumLayer& s, std::int64_t block,
                                                   std::uint64_t first_cell,
                                                   std::uint64_t cells_per_pass,
                                                   std::uint32_t first_word) {
  const bool aligned = s.aligned != 0;
  std::uint64_t sum = 0;
  if (s.one_word_per_lane) {
    std::uint64_t word[kPasses];
    std::uint64_t position[kPasses];
#pragma unroll
    for (int pass = 0; pass < kPasses; ++pass) {
      const std::uint64_t c = first_cell + pass * cells_per_pass;
      position[pass] = 0;
      if (c < s.cells) {
        const CellAt cell = Locate(s, block, c);
        if (first_word < cell.words) {
          word[pass] = LoadWord(cell.bytes, first_word, cell.size, aligned);
          position[pass] = cell.first + first_word;
        }
      }
    }
#pragma unroll
    for (int pass = 0; pass < kPasses; ++pass) {
      if (position[pass] != 0) sum += Term(word[pass], position[pass]);
    }
    return sum;
  }
  for (int pass = 0; pass < kPasses; ++pass) {
    const std::uint64_t c = first_cell + pass * cells_per_pass;
    if (c >= s.cells) break;
    const CellAt cell = Locate(s, block, c);
    for (std::uint32_t k = first_word; k < cell.words; k += 1u << s.lanes_log2) {
      sum += Term(LoadWord(cell.bytes, k, cell.size, aligned), cell.first + k);
    }
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
  const unsigned slot = warp * cells_per_warp + (lane >> s.lanes_log2);
  const std::uint32_t first_word = lane & ((1u << s.lanes_log2) - 1);
  const std::uint64_t cells_per_pass = std::uint64_t{kWarps} * cells_per_warp;
  const std::uint64_t units = num_ids * s.units;
  for (std::uint64_t u = blockIdx.x; u < units; u += gridDim.x) {
    const std::uint64_t i = u / s.units;
    const std::uint64_t first_cell = (u - i * s.units) * cells_per_pass * kPasses + slot;
    std::uint64_t sum = UnitTerms(s, ids[i], first_cell, cells_per_pass, first_word);
#pragma unroll
    for (int delta = 16; delta > 0; delta >>= 1) sum += __shfl_down_sync(0xffffffffu, sum, delta);
    if (lane == 0 && sum != 0) atomicAdd(out + blockIdx.y * num_ids + i, sum);
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
  while (s.lanes_log2 < 5 && (1u << s.lanes_log2) < most_words) ++s.lanes_log2;
  s.aligned = (misaligned & 7) == 0;
  s.one_word_per_lane = most_words <= (1u << s.lanes_log2);
  s.cells = std::uint64_t{l.planes} * l.heads * l.tokens;
  const std::uint64_t per_unit = std::uint64_t{kWarps} * (32u >> s.lanes_log2) * kPasses;
  s.units = (s.cells + per_unit - 1) / per_unit;
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

/// Device memory for the calls' arguments and values, one buffer per device kept for the
/// process (an allocation per call cost more than the kernel: cudaFree synchronises the device,
/// and the default pool of cudaMallocAsync gives its memory back at every synchronisation).
/// Calls hold the lock from taking the buffer to their last use of it.
class Scratch {
 public:
  static Scratch& Shared() {
    static Scratch* shared = new Scratch;  // never destroyed: callable until the process ends
    return *shared;
  }
  std::mutex& lock() { return lock_; }
  /// At least `bytes` on the current device `device` (the lock held); null with `*e` set on
  /// failure.
  unsigned char* Take(int device, std::size_t bytes, cudaError_t* e) {
    Buffer& b = buffers_[device];
    if (b.bytes < bytes) {
      if (b.data != nullptr) cudaFree(b.data);
      b = Buffer{};
      std::size_t size = 64 << 10;
      while (size < bytes) size *= 2;
      *e = cudaMalloc(reinterpret_cast<void**>(&b.data), size);
      if (*e != cudaSuccess) return nullptr;
      b.bytes = size;
    }
    *e = cudaSuccess;
    return b.data;
  }

 private:
  struct Buffer {
    unsigned char* data = nullptr;
    std::size_t bytes = 0;
  };
  std::mutex lock_;
  std::map<int, Buffer> buffers_;
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
  int resident = 0;
  cudaError_t e = ResidentCtas(device, &resident);
  if (e != cudaSuccess) {
    SayCuda(err, err_len, "sizing the checksum grid", e);
    return -1;
  }
  auto* s = reinterpret_cast<cudaStream_t>(stream);
  const std::size_t layer_bytes = prepared.size() * sizeof(SumLayer);
  const std::size_t id_bytes = num_ids * sizeof(std::int64_t);
  const std::size_t out_bytes = std::size_t{num_layers} * num_ids * sizeof(std::uint64_t);
  // The arguments in one host buffer: one copy to the device, not two.
  std::vector<unsigned char> arguments(layer_bytes + id_bytes);
  std::memcpy(arguments.data(), prepared.data(), layer_bytes);
  std::memcpy(arguments.data() + layer_bytes, block_ids, id_bytes);
  Scratch& scratch = Scratch::Shared();
  const std::lock_guard<std::mutex> hold(scratch.lock());
  unsigned char* memory = scratch.Take(device, arguments.size() + out_bytes, &e);
  if (memory == nullptr) {
    SayCuda(err, err_len, "allocating the checksum arguments", e);
    return -1;
  }
  auto* d_layers = reinterpret_cast<SumLayer*>(memory);
  auto* d_ids = reinterpret_cast<std::int64_t*>(memory + layer_bytes);
  auto* d_out = reinterpret_cast<unsigned long long*>(memory + arguments.size());
  const char* what = "copying the checksum arguments";
  e = cudaMemcpyAsync(memory, arguments.data(), arguments.size(), cudaMemcpyHostToDevice, s);
  if (e == cudaSuccess) e = cudaMemsetAsync(d_out, 0, out_bytes, s);
  if (e == cudaSuccess) {
    what = "the checksum kernel";
    // Every resident CTA busy, spread over the layers; none beyond the largest layer's units.
    const std::uint64_t across = std::clamp<std::uint64_t>(
        (static_cast<std::uint64_t>(resident) * 2 + num_layers - 1) / num_layers, 1, most_units);
    ChecksumKernel<<<dim3(static_cast<unsigned>(across), num_layers), kThreads, 0, s>>>(
        d_layers, d_ids, num_ids, d_out);
    e = cudaGetLastError();
  }
  if (e == cudaSuccess) {
    what = "copying the checksums back";
    e = cudaMemcpyAsync(out, d_out, out_bytes, cudaMemcpyDeviceToHost, s);
  }
  // Also after a failure: the buffer is reused only once nothing queued here reads it.
  const cudaError_t done = cudaStreamSynchronize(s);
  if (e == cudaSuccess && done != cudaSuccess) {
    what = "the checksum kernel";
    e = done;
  }
  if (e != cudaSuccess) {
    SayCuda(err, err_len, what, e);
    return -1;
  }
  return 0;
}

}  // namespace moriio_cudacopy
