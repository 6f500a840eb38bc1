// libmoriio_native_cudacopy.so: one gather/scatter kernel per batch of (dst, src, size) runs.
//
// Why one kernel: every cudaMemcpyAsync or UCX cuda_ipc operation costs ~5-7 us of host CPU, so
// a request of many 4-256 KiB KV runs moves at a few GB/s that way, against ~2 TB/s for device
// copies (research/ucx_gpu_probe.md). Here the run table goes to the GPU once and the grid walks
// it: each CTA takes 64 KiB chunks of runs (listed on the host, one table entry per chunk),
// copies with 16-byte vector loads and stores when the two ends share their alignment, and the
// host only polls an event.

#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <new>
#include <vector>

#include "cudacopy_abi.h"

namespace {

constexpr std::uint64_t kChunk = 64 * 1024;  // bytes of one run one CTA copies per step
constexpr int kThreads = 256;
// A chunk entry packs (run index << kChunkBits) | chunk index within the run, so a CTA finds its
// work with one load (a binary search over prefix sums cost ~16 dependent loads per chunk).
constexpr int kChunkBits = 20;  // runs up to 2^20 chunks = 64 GiB

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

/// table: dst[n], src[n], size[n], chunk[chunks] (see kChunkBits).
__global__ void GatherScatter(const std::uint64_t* table, std::uint64_t n, std::uint64_t chunks) {
  const std::uint64_t* dst = table;
  const std::uint64_t* src = table + n;
  const std::uint64_t* size = table + 2 * n;
  const std::uint64_t* chunk = table + 3 * n;
  for (std::uint64_t c = blockIdx.x; c < chunks; c += gridDim.x) {
    const std::uint64_t entry = chunk[c];
    const std::uint64_t r = entry >> kChunkBits;
    const std::uint64_t off = (entry & ((std::uint64_t{1} << kChunkBits) - 1)) * kChunk;
    const std::uint64_t len = Min(kChunk, size[r] - off);
    CopyChunk(reinterpret_cast<unsigned char*>(dst[r] + off),
              reinterpret_cast<const unsigned char*>(src[r] + off), len);
  }
}

/// Run table staging: pinned host memory the table is built in, device memory it is copied to.
struct Slot {
  std::uint64_t* host = nullptr;
  std::uint64_t* device = nullptr;
  std::size_t capacity = 0;  // uint64 words
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
  cudaStream_t stream = nullptr;
  std::vector<Slot> free_slots;  // reused: pinned allocations cost milliseconds
  std::vector<cudaEvent_t> free_events;
};

void FreeSlot(const Slot& s) {
  if (s.host != nullptr) cudaFreeHost(s.host);
  if (s.device != nullptr) cudaFree(s.device);
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
  e = cudaStreamCreateWithFlags(&q->stream, cudaStreamNonBlocking);
  if (e != cudaSuccess) {
    SetError(err, err_len, "cudaStreamCreateWithFlags", e);
    delete q;
    return -1;
  }
  *out = q;
  return 0;
}

void DestroyQueue(void* queue) {
  auto* q = static_cast<Queue*>(queue);
  if (q == nullptr) return;
  cudaSetDevice(q->device);
  cudaStreamSynchronize(q->stream);
  for (const Slot& s : q->free_slots) FreeSlot(s);
  for (cudaEvent_t ev : q->free_events) cudaEventDestroy(ev);
  cudaStreamDestroy(q->stream);
  delete q;
}

int Submit(void* queue, const std::uint64_t* dst, const std::uint64_t* src,
           const std::uint64_t* sizes, std::uint64_t count, void** out, char* err,
           size_t err_len) {
  auto* q = static_cast<Queue*>(queue);
  cudaError_t e = cudaSetDevice(q->device);
  if (e != cudaSuccess) {
    SetError(err, err_len, "cudaSetDevice", e);
    return -1;
  }
  std::uint64_t chunks = 0;
  for (std::uint64_t i = 0; i < count; ++i) {
    const std::uint64_t run_chunks = (sizes[i] + kChunk - 1) / kChunk;
    if (run_chunks >> kChunkBits) {
      if (err != nullptr && err_len != 0) std::snprintf(err, err_len, "a run exceeds 64 GiB");
      return -1;
    }
    chunks += run_chunks;
  }
  const std::size_t words = 3 * count + chunks;
  Slot slot;
  for (std::size_t i = 0; i < q->free_slots.size(); ++i) {
    if (q->free_slots[i].capacity >= words) {
      slot = q->free_slots[i];
      q->free_slots.erase(q->free_slots.begin() + static_cast<std::ptrdiff_t>(i));
      break;
    }
  }
  if (slot.host == nullptr) {
    std::size_t cap = 1024;
    while (cap < words) cap *= 2;
    e = cudaHostAlloc(reinterpret_cast<void**>(&slot.host), cap * 8, cudaHostAllocDefault);
    if (e == cudaSuccess) e = cudaMalloc(reinterpret_cast<void**>(&slot.device), cap * 8);
    if (e != cudaSuccess) {
      FreeSlot(slot);
      SetError(err, err_len, "allocating the run table", e);
      return -1;
    }
    slot.capacity = cap;
  }
  std::uint64_t* t = slot.host;
  std::memcpy(t, dst, count * 8);
  std::memcpy(t + count, src, count * 8);
  std::memcpy(t + 2 * count, sizes, count * 8);
  std::uint64_t* chunk = t + 3 * count;
  for (std::uint64_t i = 0; i < count; ++i) {
    for (std::uint64_t j = 0; j * kChunk < sizes[i]; ++j) *chunk++ = (i << kChunkBits) | j;
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
  e = cudaMemcpyAsync(slot.device, slot.host, words * 8, cudaMemcpyHostToDevice, q->stream);
  if (e == cudaSuccess && chunks > 0) {
    const auto grid = static_cast<unsigned>(std::min<std::uint64_t>(chunks, q->max_ctas));
    GatherScatter<<<grid, kThreads, 0, q->stream>>>(slot.device, count, chunks);
    e = cudaGetLastError();
  }
  if (e == cudaSuccess) e = cudaEventRecord(ev, q->stream);
  if (e != cudaSuccess) {
    // The stream may still read the table: wait before the slot can be reused.
    cudaStreamSynchronize(q->stream);
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
