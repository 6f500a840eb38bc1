// libmoriio_native_cudacopy.so: one gather/scatter kernel per batch of (dst, src, size) runs.
//
// Why one kernel: every cudaMemcpyAsync or UCX cuda_ipc operation costs ~5-7 us of host CPU, so
// a request of many 4-256 KiB KV runs moves at a few GB/s that way, against ~2 TB/s for device
// copies (measured, UCX 1.22, H200). Here the host writes the run table once (the engine's offset
// arrays as they are; bases are kernel arguments) into mapped pinned memory, and the grid walks
// it: each CTA copies one chunk (a run, or a 128 KiB piece of a longer run) at a time with
// 16-byte vector loads and stores when the two ends share their alignment; the host only polls
// an event. Batches alternate between two streams so one kernel's tail overlaps the next one.

#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <new>
#include <vector>

#include "cudacopy_abi.h"

namespace {

constexpr std::uint64_t kChunk = 128 * 1024;  // most bytes of one run one CTA copies per step
constexpr int kThreads = 256;
constexpr int kStreams = 2;
// A chunk entry packs (run index << kChunkBits) | chunk index within the run, so a CTA finds its
// work with one load (a binary search over prefix sums cost ~16 dependent loads per chunk). The
// table is only built when some run spans several chunks: KV runs (4-128 KiB) map one to one.
constexpr int kChunkBits = 20;  // runs up to 2^20 chunks = 128 GiB

void SetError(char* err, size_t len, const char* what, cudaError_t e) {
  if (err != nullptr && len != 0) {
    std::snprintf(err, len, "%s: %s (%s)", what, cudaGetErrorString(e), cudaGetErrorName(e));
  }
}

__device__ __forceinline__ std::uint64_t Min(std::uint64_t a, std::uint64_t b) {
  return a < b ? a : b;
}

template <typename V>
__device__ __forceinline__ void CopyVectors(unsigned char* d, const unsigned char* s,
                                            std::uint64_t count) {
  V* dv = reinterpret_cast<V*>(d);
  const V* sv = reinterpret_cast<const V*>(s);
  const std::uint64_t step = blockDim.x;
  std::uint64_t i = threadIdx.x;
  // Four loads in flight per thread before the stores: the copy is latency bound otherwise.
  for (; i + 3 * step < count; i += 4 * step) {
    V a = sv[i], b = sv[i + step], c = sv[i + 2 * step], e = sv[i + 3 * step];
    dv[i] = a;
    dv[i + step] = b;
    dv[i + 2 * step] = c;
    dv[i + 3 * step] = e;
  }
  for (; i < count; i += step) dv[i] = sv[i];
}

__device__ __forceinline__ void CopyBytes(unsigned char* d, const unsigned char* s,
                                          std::uint64_t n) {
  for (std::uint64_t i = threadIdx.x; i < n; i += blockDim.x) d[i] = s[i];
}

/// Copies `n` bytes; all threads of the CTA take part.
__device__ void CopyChunk(unsigned char* d, const unsigned char* s, std::uint64_t n) {
  const auto da = reinterpret_cast<std::uintptr_t>(d);
  const auto sa = reinterpret_cast<std::uintptr_t>(s);
  std::uint64_t align = ((da ^ sa) & 15) == 0 ? 16 : ((da ^ sa) & 3) == 0 ? 4 : 1;
  if (align == 1) {
    CopyBytes(d, s, n);
    return;
  }
  // Bytes up to the first common aligned address, the vector body, then the tail.
  const std::uint64_t head = Min(n, (align - (da & (align - 1))) & (align - 1));
  CopyBytes(d, s, head);
  const std::uint64_t body = (n - head) / align;
  if (align == 16) {
    CopyVectors<uint4>(d + head, s + head, body);
  } else {
    CopyVectors<unsigned int>(d + head, s + head, body);
  }
  const std::uint64_t done = head + body * align;
  CopyBytes(d + done, s + done, n - done);
}

/// One chunk's copy: where from, where to, how many bytes.
struct ChunkCopy {
  unsigned char* dst;
  const unsigned char* src;
  std::uint64_t len;
};

/// table: dst offset[n], src offset[n], size[n], then chunk[chunks] (see kChunkBits) unless
/// chunks == n (every run is one chunk: chunk c is run c).
struct RunTable {
  std::uint64_t dst_base;
  std::uint64_t src_base;
  const std::int64_t* table;
  std::uint64_t n;
  std::uint64_t chunks;

  __device__ ChunkCopy Chunk(std::uint64_t c) const {
    const std::int64_t* dst = table;
    const std::int64_t* src = table + n;
    const std::int64_t* size = table + 2 * n;
    const auto* chunk = reinterpret_cast<const std::uint64_t*>(table + 3 * n);
    const std::uint64_t entry = chunks == n ? c << kChunkBits : chunk[c];
    const std::uint64_t r = entry >> kChunkBits;
    const std::uint64_t off = (entry & ((std::uint64_t{1} << kChunkBits) - 1)) * kChunk;
    return {reinterpret_cast<unsigned char*>(dst_base + dst[r] + off),
            reinterpret_cast<const unsigned char*>(src_base + src[r] + off),
            Min(kChunk, static_cast<std::uint64_t>(size[r]) - off)};
  }
};

__global__ void GatherScatter(RunTable t) {
  std::uint64_t c = blockIdx.x;
  if (c >= t.chunks) return;
  ChunkCopy cur = t.Chunk(c);
  for (; c < t.chunks; c += gridDim.x) {
    // The next chunk's table entries are loaded before this chunk's copy, so their latency
    // hides behind it instead of stalling the CTA between chunks.
    const std::uint64_t next = c + gridDim.x;
    const ChunkCopy following = next < t.chunks ? t.Chunk(next) : ChunkCopy{};
    CopyChunk(cur.dst, cur.src, cur.len);
    cur = following;
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
  int max_ctas = 0;
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
  auto* q = new (std::nothrow) Queue;
  if (q == nullptr) return -1;
  q->device = device;
  // Enough CTAs to keep every SM busy with several resident blocks; more only adds tail effects.
  q->max_ctas = sms * 8;
  for (cudaStream_t& stream : q->streams) {
    e = cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking);
    if (e != cudaSuccess) {
      SetError(err, err_len, "cudaStreamCreateWithFlags", e);
      for (cudaStream_t created : q->streams) {
        if (created != nullptr) cudaStreamDestroy(created);
      }
      delete q;
      return -1;
    }
  }
  *out = q;
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

int Submit(void* queue, std::uint64_t dst_base, std::uint64_t src_base,
           const std::int64_t* dst_offsets, const std::int64_t* src_offsets,
           const std::int64_t* sizes, std::uint64_t count, void** out, char* err,
           size_t err_len) {
  auto* q = static_cast<Queue*>(queue);
  cudaError_t e = cudaSetDevice(q->device);
  if (e != cudaSuccess) {
    SetError(err, err_len, "cudaSetDevice", e);
    return -1;
  }
  std::uint64_t chunks = 0;
  for (std::uint64_t i = 0; i < count; ++i) {
    if (sizes[i] <= 0) {
      if (err != nullptr && err_len != 0) {
        std::snprintf(err, err_len, "run %llu has size %lld; sizes must be positive",
                      static_cast<unsigned long long>(i), static_cast<long long>(sizes[i]));
      }
      return -1;
    }
    chunks += (static_cast<std::uint64_t>(sizes[i]) + kChunk - 1) / kChunk;
  }
  // Every run has at least one chunk, so equal counts mean exactly one each.
  const bool one_chunk_per_run = chunks == count;
  const std::size_t words = 3 * count + (one_chunk_per_run ? 0 : chunks);
  Slot slot;
  if (!TakeSlot(q, words, &slot, err, err_len)) return -1;
  std::int64_t* t = slot.host;
  std::memcpy(t, dst_offsets, count * 8);
  std::memcpy(t + count, src_offsets, count * 8);
  std::memcpy(t + 2 * count, sizes, count * 8);
  if (!one_chunk_per_run) {
    std::int64_t* chunk = t + 3 * count;
    for (std::uint64_t i = 0; i < count; ++i) {
      const std::uint64_t run_chunks = (static_cast<std::uint64_t>(sizes[i]) + kChunk - 1) / kChunk;
      if (run_chunks >> kChunkBits) {
        q->free_slots.push_back(slot);
        if (err != nullptr && err_len != 0) std::snprintf(err, err_len, "a run exceeds 128 GiB");
        return -1;
      }
      for (std::uint64_t j = 0; j < run_chunks; ++j) {
        *chunk++ = static_cast<std::int64_t>((i << kChunkBits) | j);
      }
    }
  }

  cudaEvent_t ev = nullptr;
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
  if (chunks > 0) {
    const auto grid = static_cast<unsigned>(std::min<std::uint64_t>(chunks, q->max_ctas));
    GatherScatter<<<grid, kThreads, 0, stream>>>(
        RunTable{dst_base, src_base, slot.device, count, chunks});
    e = cudaGetLastError();
  }
  if (e == cudaSuccess) e = cudaEventRecord(ev, stream);
  if (e != cudaSuccess) {
    // The kernel may still read the table: wait before the slot can be reused.
    cudaStreamSynchronize(stream);
    q->free_slots.push_back(slot);
    q->free_events.push_back(ev);
    SetError(err, err_len, "launching the gather/scatter kernel", e);
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

int PollOp(void* op_ptr, char* err, size_t err_len) {
  auto* op = static_cast<Op*>(op_ptr);
  cudaError_t e = cudaEventQuery(op->done);
  if (e == cudaSuccess) return 1;
  if (e == cudaErrorNotReady) return 0;
  SetError(err, err_len, "gather/scatter kernel", e);
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
    MORIIO_CUDACOPY_ABI_VERSION, &Probe, &CreateQueue, &DestroyQueue, &Submit, &PollOp, &ReleaseOp,
};

}  // namespace

extern "C" __attribute__((visibility("default"))) const moriio_cudacopy_api*
moriio_native_cudacopy_api(void) {
  return &kApi;
}
