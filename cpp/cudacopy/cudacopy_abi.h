#pragma once

/* C ABI between a backend and libmoriio_native_cudacopy.so, the CUDA gather/scatter copy plugin.
 *
 * Why a plugin: the kernel needs nvcc and the CUDA runtime, which neither the core nor the UCX
 * plugin may depend on (the wheel must import on CPU-only machines). The UCX backend dlopens this
 * library only when both ends of a batch are CUDA memory that ucp_rkey_ptr mapped into this
 * process (CUDA IPC on one node), and then moves the whole batch with one kernel launch instead
 * of one UCX operation per run.
 *
 * It also answers whether a CUDA event has completed (query_event), so that a batch whose copies
 * are UCX operations (RDMA to another node) can wait for its producer's event without the caller
 * waiting on the host, and computes the integrity check's block checksums of device layers in one
 * kernel (checksum_blocks, used by python/moriio_native/verify.py).
 *
 * Threading: a queue is used by one thread at a time (the UCX progress thread); different queues
 * are independent. Nothing here blocks except destroy_queue (waits for the queue's kernels).
 * Errors: functions return 0 on success and a negative value on error, writing a NUL-terminated
 * message into `err` (`err_len` bytes, may be 0). */

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

#define MORIIO_CUDACOPY_ABI_VERSION 7u
#define MORIIO_CUDACOPY_SYMBOL "moriio_native_cudacopy_api"

/* The cells of a block pair as one grid, the same on both sides (moriio_native::CellGeometry):
 * cell (plane p, head h, token t) of the block at byte offset B starts at
 * B + p*plane_stride + h*head_stride + t*token_stride on that side and is cell_bytes long. */
typedef struct moriio_cudacopy_cells {
  uint32_t planes;     /* 1 or 2 */
  uint32_t heads;      /* >= 1 */
  uint32_t tokens;     /* >= 1 */
  uint32_t cell_bytes; /* 1 .. 16384 (a longer cell is a long run: use submit) */
  int64_t dst_plane_stride, dst_head_stride, dst_token_stride;
  int64_t src_plane_stride, src_head_stride, src_token_stride;
} moriio_cudacopy_cells;

/* One layer of a stamped copy (moriio_native::StampedLayer, in destination and source terms):
 * for every i < num_blocks and every k < num_runs, runs[first_run + k].size bytes from
 *   src_base + src_layer + src_ids[first_block + i] * src_stride + runs[first_run + k].src
 * to the same expression on the destination side. */
typedef struct moriio_cudacopy_stamp_layer {
  int64_t dst_layer, src_layer;   /* bytes from each base to the layer's block 0, >= 0 */
  int64_t dst_stride, src_stride; /* bytes between consecutive blocks, >= 0 */
  uint64_t first_block, num_blocks;
  uint32_t first_run, num_runs; /* num_runs 1 .. 256 */
} moriio_cudacopy_stamp_layer;

/* A template run: offsets from each side's block start, and its length (> 0). */
typedef struct moriio_cudacopy_stamp_run {
  int64_t dst, src, size;
} moriio_cudacopy_stamp_run;

/* One layer of checksum_blocks (moriio_native::LayoutParams, window resolved): the cell (plane p,
 * head h, token t) of block b starts at
 *   base + b*block_stride + plane_offset[p] + h*head_stride
 *        + (t / kernel_block_size)*kernel_block_stride + (t % kernel_block_size)*token_stride
 * and is plane_bytes[p] long; the checksum covers heads [head_begin, +heads) and tokens
 * [token_begin, +tokens) of planes [0, planes). */
typedef struct moriio_cudacopy_checksum_layer {
  uint64_t base; /* device address of the layer's block 0 */
  int64_t block_stride, head_stride, token_stride, kernel_block_stride;
  int64_t plane_offset[2];
  uint32_t plane_bytes[2]; /* 1 .. 2^20 each */
  uint32_t planes;         /* 1 or 2 */
  uint32_t kernel_block_size;
  uint32_t head_begin, heads, token_begin, tokens; /* heads, tokens >= 1; planes * heads *
                                                      tokens < 2^31 (cells per block) */
} moriio_cudacopy_checksum_layer;

typedef struct moriio_cudacopy_api {
  uint32_t abi_version; /* MORIIO_CUDACOPY_ABI_VERSION */
  /* 0 when a CUDA driver and at least one device are usable in this process. */
  int (*probe)(char* err, size_t err_len);
  /* A copy queue (non-blocking streams plus reusable run tables) on `device`. */
  int (*create_queue)(int device, void** queue, char* err, size_t err_len);
  /* Waits for the queue's work, then frees it. Outstanding ops must be released first. */
  void (*destroy_queue)(void* queue);
  /* Enqueues ONE kernel that copies, for every i < count, sizes[i] bytes from
   * src_base + src_offsets[i] to dst_base + dst_offsets[i] (device addresses, the base possibly
   * IPC-mapped from another process; the caller has checked every run against its regions;
   * a size <= 0 fails the call).
   * Offsets are taken as the engine plans them, so a batch needs no translation pass on the
   * host. The arrays are copied before it returns. `*op` is polled with poll_op and released
   * with release_op. Consecutive submissions may run concurrently: order is not kept.
   * `wait_event`, when not 0, is a cudaEvent_t of this process on the queue's device: the kernel
   * starts on the device only once the work that event recorded has finished (a stream wait;
   * the host never waits). It must have been recorded before submit is called and not be
   * recorded again or destroyed until the op is released. (ABI version 3 added it.) */
  int (*submit)(void* queue, uint64_t dst_base, uint64_t src_base, const int64_t* dst_offsets,
                const int64_t* src_offsets, const int64_t* sizes, uint64_t count,
                uint64_t wait_event, void** op, char* err, size_t err_len);
  /* 1: finished OK; 0: still running; negative: failed (err says why). Never blocks. */
  int (*poll_op)(void* op, char* err, size_t err_len);
  /* Frees an op; a running op is waited for first. */
  void (*release_op)(void* op);
  /* Enqueues ONE kernel that copies every cell of `cells` from the block at
   * src_base + src_blocks[i] to the block at dst_base + dst_blocks[i], for every i < count,
   * through shared-memory tiles: each side is read or written in its own memory order, so a
   * pair of different axis orders (NHD against HND) moves coalesced on both sides. The caller
   * has checked every block against its regions; a geometry out of the ranges above fails the
   * call (err names the field). Ops, `wait_event` and ordering as for submit. (ABI 4.) */
  int (*submit_cells)(void* queue, uint64_t dst_base, uint64_t src_base,
                      const moriio_cudacopy_cells* cells, const int64_t* dst_blocks,
                      const int64_t* src_blocks, uint64_t count, uint64_t wait_event, void** op,
                      char* err, size_t err_len);
  /* Enqueues ONE kernel that copies every run of every layer of a stamped batch (see
   * moriio_cudacopy_stamp_layer): the GPU computes each run's offsets from the layer, its
   * template run and the two block ids, so the host writes per block and per layer, not per run.
   * The caller has checked every run against its regions; a layer whose runs or ids lie outside
   * the arrays, or with num_runs outside 1..256, fails the call (err names the layer). The arrays
   * are copied before it returns. Ops, `wait_event` and ordering as for submit. (ABI 5.) */
  int (*submit_stamps)(void* queue, uint64_t dst_base, uint64_t src_base,
                       const moriio_cudacopy_stamp_layer* layers, uint32_t num_layers,
                       const moriio_cudacopy_stamp_run* runs, uint32_t num_runs,
                       const int64_t* dst_ids, const int64_t* src_ids, uint64_t num_ids,
                       uint64_t wait_event, void** op, char* err, size_t err_len);
  /* Whether the work `event` (a cudaEvent_t of this process, on any device) recorded has
   * finished: 1 yes (or never recorded), 0 not yet, negative: the query failed (err says why).
   * Never blocks; callable from any thread. (ABI 6.) */
  int (*query_event)(uint64_t event, char* err, size_t err_len);
  /* The block checksums of include/moriio_native/checksum.hpp, in one kernel: for every layer
   * l < num_layers and i < num_ids, the checksum of block block_ids[i] of layer l into
   * out[l * num_ids + i] (host memory). Runs on `stream` (a cudaStream_t of this process on
   * `device`; 0: the legacy default stream), so after the work queued there, and returns once
   * the values are in `out` (blocking; the calling thread's current device is restored). The
   * caller has checked every id and window against its layer; a layer outside the ranges above
   * fails the call (err names the layer). Callable from any thread. (ABI 7.) */
  int (*checksum_blocks)(int device, uint64_t stream, const moriio_cudacopy_checksum_layer* layers,
                         uint32_t num_layers, const int64_t* block_ids, uint64_t num_ids,
                         uint64_t* out, char* err, size_t err_len);
} moriio_cudacopy_api;

/* The plugin exports: const moriio_cudacopy_api* moriio_native_cudacopy_api(void); */
typedef const moriio_cudacopy_api* (*moriio_cudacopy_entry_fn)(void);

#ifdef __cplusplus
}
#endif
