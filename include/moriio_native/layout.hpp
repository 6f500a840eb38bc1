#pragma once

/// Layout engine: from a strided KV-cache tensor plus its spec to the byte offsets of every
/// (plane, head, token) cell of every block, and from two layers' layouts to copy plans.
///
/// All offsets are bytes relative to the layer's base (the tensor's data pointer). Everything in
/// this header is a pure function or an immutable value: thread-safe, never blocks.

#include <array>
#include <cstddef>
#include <cstdint>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "moriio_native/status.hpp"

namespace moriio_native {

/// What one block of a layer holds.
enum class CacheKind : std::uint8_t {
  kKeyValue = 0,  ///< two planes, K and V
  kLatent = 1,    ///< one plane: MLA latent, key-only or indexer cache
};

/// The order in which a tensor's SHAPE (as torch reports it: the logical order, whatever the
/// strides) lists the tokens of a block (N) and the heads (H). The memory order is always read
/// from the strides; this only says which shape axis is which. (vLLM's get_kv_cache_layout()
/// names the memory order: it is not this.)
enum class AxisOrder : std::uint8_t {
  /// Read it from the shape and the spec. When both readings fit (num_kv_heads equals the block
  /// size or the kernel block size, or num_kv_heads is unknown), DescribeLayer fails with
  /// "Ambiguous" naming the layer and shape: it never guesses.
  kAuto = 0,
  /// Tokens before heads: `[2,N,B,H,D]`, `[N,2,B,H,D]`.
  kNhd = 1,
  /// Heads before tokens: `[2,N,H,B,D]`, `[N,2,H,B,D]`, and every 4-D form (`[N,H,B,C]`).
  kHnd = 2,
};

/// "auto", "nhd" or "hnd" (the Python spelling; also used in error messages). Thread-safe.
std::string_view AxisOrderName(AxisOrder order);

/// The logical description of a layer's cache, as the model (not the tensor) defines it.
/// Head fields may be unknown; they are then read from the tensor's shape.
struct CacheSpec {
  CacheKind kind = CacheKind::kKeyValue;
  std::int64_t block_size = 0;                 ///< tokens per manager (scheduler) block
  std::optional<std::int64_t> num_kv_heads;    ///< heads stored per token (1 for MLA)
  std::optional<std::int64_t> head_size;       ///< elements of K (or of the latent) per head
  std::int64_t dtype_bytes = 0;                ///< bytes per element
  std::optional<std::int64_t> head_size_v;     ///< elements of V per head (default head_size)
  /// Which shape axis holds tokens and which heads. Callers that know their tensor's shape
  /// order (the vLLM adapter always does) pass it; a hint the shape contradicts is an error.
  /// Layouts without a head axis (latent `[N,B,D]`) are consistent with every value.
  AxisOrder axis_order = AxisOrder::kAuto;

  /// Checks the numbers are positive where given. Returns InvalidArgument naming the field.
  Status Validate() const;
};

/// A strided tensor as torch describes it: shape and strides in elements.
struct TensorGeometry {
  std::vector<std::int64_t> shape;
  std::vector<std::int64_t> strides;
  std::int64_t element_size = 0;
  std::uint64_t data_ptr = 0;
};

/// How a 5-D K/V tensor places its K/V plane axis. kAuto reads it from the shape and fails with
/// "Ambiguous" when both leading axes have size 2.
enum class KvPlaneAxis : std::uint8_t { kAuto = 0, kSeparated = 1, kInterleaved = 2 };

/// Every number that places a layer's bytes; what peers exchange in their metadata.
/// Cell (plane p, head h, token t) of block b starts at
///   b*block_stride + plane_offset[p] + h*head_stride
///   + (t / kernel_block_size)*kernel_block_stride + (t % kernel_block_size)*token_stride
/// and is plane_bytes[p] contiguous bytes long.
struct LayoutParams {
  CacheKind kind = CacheKind::kKeyValue;
  std::int64_t num_blocks = 0;
  std::int64_t block_size = 0;
  std::int64_t kernel_block_size = 0;
  std::int64_t num_heads = 0;
  std::int64_t dtype_bytes = 0;
  std::int64_t block_stride = 0;
  std::int64_t kernel_block_stride = 0;
  std::int64_t head_stride = 0;
  std::int64_t token_stride = 0;
  std::array<std::int64_t, 2> plane_offset{0, 0};
  std::array<std::int64_t, 2> plane_bytes{0, 0};

  int num_planes() const { return kind == CacheKind::kKeyValue ? 2 : 1; }
  friend bool operator==(const LayoutParams&, const LayoutParams&) = default;
};

/// A validated layer layout. Immutable value; cheap to copy.
class LayerLayout {
 public:
  /// Validates `params` (positive sizes, no overflow, no two cells overlapping, cells inside
  /// their block's stride pattern). Used for layouts received from peers: every number is
  /// untrusted. Errors name the layer.
  static Result<LayerLayout> FromParams(std::string name, const LayoutParams& params);

  const std::string& name() const { return name_; }
  const LayoutParams& params() const { return params_; }
  CacheKind kind() const { return params_.kind; }
  std::int64_t num_blocks() const { return params_.num_blocks; }
  std::int64_t block_size() const { return params_.block_size; }
  std::int64_t num_heads() const { return params_.num_heads; }
  /// Bytes between consecutive manager blocks.
  std::int64_t block_stride() const { return params_.block_stride; }
  /// Logical bytes of one block, all planes, heads and tokens.
  std::int64_t block_bytes() const;
  /// One past the last byte any cell of any block touches (the layer's extent from its base).
  std::int64_t span_bytes() const { return span_bytes_; }
  /// Hash of the logical content (kind, heads, block size, plane bytes, dtype): two layers can
  /// exchange blocks iff their fingerprints match. Independent of physical strides.
  std::uint64_t LogicalFingerprint() const;
  /// "kind=kv blocks=.. block_size=.. heads=.. K=..B V=..B dtype=.." for error messages.
  std::string DescribeLogical() const;

 private:
  LayerLayout(std::string name, LayoutParams params, std::int64_t span)
      : name_(std::move(name)), params_(params), span_bytes_(span) {}
  std::string name_;
  LayoutParams params_;
  std::int64_t span_bytes_ = 0;
};

/// Reads a layer's layout from its tensor and spec. Recognised (shape as torch reports it, any
/// strides): K/V `[2,N,B,H,D]`, `[2,N,H,B,D]`, `[N,2,B,H,D]`, `[N,2,H,B,D]`, packed/standardized
/// `[N,H,B,Dk+Dv]`; latent `[N,B,D]` and `[N,H,B,D]`; each with kernel blocks (N = blocks *
/// block_size/kb, B = kb). Which 5-D axis holds tokens comes from spec.axis_order, or from the
/// shape when only one reading fits; otherwise the error is "Ambiguous". Errors name the layer
/// and shape.
Result<LayerLayout> DescribeLayer(std::string name, const TensorGeometry& geometry,
                                  const CacheSpec& spec, KvPlaneAxis plane_axis = KvPlaneAxis::kAuto);

/// A rectangle of a block's cell grid: the heads [head_begin, head_begin + heads) and the
/// tokens [token_begin, token_begin + tokens) of every plane. What a transfer moves when a side
/// holds only part of the other's block: a head range when prefill and decode split the KV heads
/// over different TP sizes, a token range when their block sizes differ. nullopt counts run to
/// the end of the block; the default window is the whole block.
struct CellWindow {
  std::int64_t head_begin = 0;
  std::optional<std::int64_t> heads;
  std::int64_t token_begin = 0;
  std::optional<std::int64_t> tokens;
  friend bool operator==(const CellWindow&, const CellWindow&) = default;
};

/// A CellWindow with its counts resolved against one layer's block: the heads
/// [head_begin, head_begin + heads) and tokens [token_begin, token_begin + tokens).
struct ResolvedWindow {
  std::int64_t head_begin = 0;
  std::int64_t heads = 0;
  std::int64_t token_begin = 0;
  std::int64_t tokens = 0;

  /// True when the two windows share at least one (head, token) cell.
  bool Overlaps(const ResolvedWindow& other) const;
  auto operator<=>(const ResolvedWindow&) const = default;
};

/// Resolves `window` against `layout`'s block (nullopt counts run to the end of the block).
/// InvalidArgument naming the layer and the window when a begin is negative, a count is not
/// positive, or the window leaves the block (head_begin + heads > num_heads, token_begin +
/// tokens > block_size). The one place where nullopt counts are read. Pure, thread-safe.
Result<ResolvedWindow> ResolveWindow(const CellWindow& window, const LayerLayout& layout);

/// "heads [2,4) of 8, tokens [0,16) of 64" for messages; a count the window leaves open is
/// shown against `layout` (as ResolveWindow reads it), a window outside the block as given.
std::string DescribeWindow(const CellWindow& window, const LayerLayout& layout);

/// OK when the cells of `local` and `remote` pair one to one, so that some windows of their
/// blocks pair: the same kind, dtype and bytes per (plane, head, token) cell; head counts and
/// block sizes may differ. Incompatible naming both layers and what differs otherwise. Pure.
Status CheckCellContent(const LayerLayout& local, const LayerLayout& remote);

/// One contiguous copy: `size` bytes from local offset to remote offset (or back).
struct CopyRun {
  std::int64_t local = 0;
  std::int64_t remote = 0;
  std::int64_t size = 0;
};

/// Where the cells of a block lie on one side of a CellGeometry: cell (plane p, head h, token t)
/// of the block at byte offset `base` starts at
///   base + p*plane_stride + h*head_stride + t*token_stride.
struct CellSide {
  std::int64_t block_stride = 0;
  std::int64_t plane_stride = 0;
  std::int64_t head_stride = 0;
  std::int64_t token_stride = 0;
  friend bool operator==(const CellSide&, const CellSide&) = default;
};

/// A layer pair's blocks as a grid of equal cells, the same grid on both sides in different
/// places: planes x heads x tokens cells of cell_bytes contiguous bytes each. It lets a copy
/// move whole blocks (a transposing kernel reads one side's cells in that side's memory order
/// and writes them in the other's) where the pair's run plan degenerates into one short run per
/// cell, e.g. [2,N,B,H,D] (NHD) against [N,2,H,B,D] (HND): 256 runs of head_size * dtype bytes
/// per block. Exists when every cell of a block has the same size (K and V of equal width, or
/// packed K|V on both sides, which then form one cell per head and token) and the token offset
/// is affine on both sides (no kernel blocks, or kernel blocks that continue the token stride).
struct CellGeometry {
  int planes = 0;
  std::int64_t heads = 0;
  std::int64_t tokens = 0;
  std::int64_t cell_bytes = 0;
  CellSide local;
  CellSide remote;

  /// Bytes of one block (all its cells).
  std::int64_t block_bytes() const { return planes * heads * tokens * cell_bytes; }
  friend bool operator==(const CellGeometry&, const CellGeometry&) = default;
};

/// The runs that copy one local block to one remote block of the same logical layer (or one
/// window of a block to a window of the other's: see the windowed Build), sorted by local
/// offset, merged where contiguous on both sides. Immutable; build once per layer pair and
/// windows.
class BlockTemplate {
 public:
  /// Fails with Incompatible naming both layouts when their logical content differs.
  static Result<BlockTemplate> Build(const LayerLayout& local, const LayerLayout& remote);

  /// The runs that copy the cells of `local_window` of a local block to the cells of
  /// `remote_window` of a remote block: cell (plane p, head h, token t) of the local window
  /// (h and t counted from the window's begin) pairs with cell (p, h, t) of the remote window.
  /// The two layers may differ in heads and block size (heterogeneous TP: a head range; other
  /// block sizes: a token range) as long as the windows agree. Errors: InvalidArgument naming
  /// the layer and the window when a window leaves its block; Incompatible naming both layers
  /// and both windows when kind, dtype or per-cell plane bytes (K and V bytes per head and
  /// token) differ, or the windows differ in heads or tokens. Whole windows on both sides give
  /// the same runs as Build(local, remote). cell_geometry() is the windows' sub-grid where the
  /// layouts admit one, with the window origins in the block offsets (AppendBlockOffsets).
  static Result<BlockTemplate> Build(const LayerLayout& local, const CellWindow& local_window,
                                     const LayerLayout& remote, const CellWindow& remote_window);

  std::span<const CopyRun> runs() const { return runs_; }
  std::int64_t local_block_stride() const { return local_block_stride_; }
  std::int64_t remote_block_stride() const { return remote_block_stride_; }
  std::int64_t local_num_blocks() const { return local_num_blocks_; }
  std::int64_t remote_num_blocks() const { return remote_num_blocks_; }
  /// Index ranges [begin, end) of runs() stamped together for all blocks before the next group,
  /// so that stamped output stays sorted by local offset (e.g. the K and V planes of a
  /// separated layout form two groups).
  std::span<const std::pair<std::uint32_t, std::uint32_t>> groups() const { return groups_; }
  const std::string& local_name() const { return local_name_; }
  /// The windows this template copies, resolved against each side's block.
  const ResolvedWindow& local_window() const { return local_window_; }
  const ResolvedWindow& remote_window() const { return remote_window_; }
  /// Bytes from a block's base to its window's first cell (cell (0, head_begin, token_begin)),
  /// on each side: what AppendBlockOffsets adds to each block offset. 0 for whole windows.
  std::int64_t local_cell_origin() const { return local_cell_origin_; }
  std::int64_t remote_cell_origin() const { return remote_cell_origin_; }
  /// The pair's cells as one grid (see CellGeometry), or nullopt when the layouts admit none.
  /// For a windowed template the grid of its windows' cells (a sub-grid of each block; the
  /// window origins are added to the block offsets by AppendBlockOffsets).
  const std::optional<CellGeometry>& cell_geometry() const { return cell_geometry_; }
  /// True when a cell copy beats the run plan: a grid exists, the run plan splits a block's
  /// planes into several runs, and those average fewer than kShortRunBytes (the kernel's per-run cost then dominates; measured on the H200,
  /// docs/benchmarks.md: 256-byte runs move at 0.016x of a device copy, 32 KiB runs at 0.8x).
  bool prefers_cell_copy() const;
  static constexpr std::int64_t kShortRunBytes = 4096;

 private:
  BlockTemplate() = default;
  // Both Builds, once the windows are resolved and known to pair.
  static BlockTemplate BuildWindows(const LayerLayout& local, const ResolvedWindow& local_window,
                                    const LayerLayout& remote, const ResolvedWindow& remote_window);
  std::optional<CellGeometry> cell_geometry_;
  std::vector<CopyRun> runs_;
  std::vector<std::pair<std::uint32_t, std::uint32_t>> groups_;
  std::int64_t local_block_stride_ = 0;
  std::int64_t remote_block_stride_ = 0;
  std::int64_t local_num_blocks_ = 0;
  std::int64_t remote_num_blocks_ = 0;
  std::string local_name_;
  ResolvedWindow local_window_;
  ResolvedWindow remote_window_;
  std::int64_t local_cell_origin_ = 0;
  std::int64_t remote_cell_origin_ = 0;
};

/// A request's block pairs, validated for duplicates and sorted by local id once, then stamped
/// for every layer. Immutable.
class BlockPairs {
 public:
  /// Pairs local_ids[i] with remote_ids[i] for i < len(local_ids). Errors: local longer than
  /// remote ("longer than remote"), negative ids, duplicate local or remote ids.
  static Result<BlockPairs> Create(std::span<const std::int64_t> local_ids,
                                   std::span<const std::int64_t> remote_ids);

  std::size_t size() const { return local_.size(); }
  bool empty() const { return local_.empty(); }
  std::span<const std::int64_t> local_sorted() const { return local_; }
  std::span<const std::int64_t> remote_by_local() const { return remote_; }
  std::int64_t max_local() const { return max_local_; }
  std::int64_t max_remote() const { return max_remote_; }

 private:
  BlockPairs() = default;
  std::vector<std::int64_t> local_;
  std::vector<std::int64_t> remote_;
  std::int64_t max_local_ = -1;
  std::int64_t max_remote_ = -1;
};

/// A copy plan in structure-of-arrays form (what transfer engines take), sorted by local offset.
struct CopyPlan {
  std::vector<std::int64_t> local_offsets;
  std::vector<std::int64_t> remote_offsets;
  std::vector<std::int64_t> sizes;

  std::size_t size() const { return sizes.size(); }
  void clear();
  /// Total bytes of all runs.
  std::int64_t total_bytes() const;
};

/// OutOfRange (naming the layer, the id and the block count) when a block id of `pairs` is past
/// either side of `tmpl`; the check StampBlockCopies and AppendBlockCopies make first.
Status CheckBlockIds(const BlockTemplate& tmpl, const BlockPairs& pairs);

/// Stamps `tmpl` for every pair into `out` (cleared first). Block ids are checked against both
/// sides' num_blocks before anything is written; on error `out` is left empty. No allocation per
/// block: `out` grows at most once.
Status StampBlockCopies(const BlockTemplate& tmpl, const BlockPairs& pairs, CopyPlan* out);

/// Like StampBlockCopies, but appends to `out` with every local offset shifted by `local_shift`
/// and every remote offset by `remote_shift` (offsets relative to a region holding the layer).
/// The appended runs are sorted and merged among themselves; on error nothing is appended.
Status AppendBlockCopies(const BlockTemplate& tmpl, const BlockPairs& pairs,
                         std::int64_t local_shift, std::int64_t remote_shift, CopyPlan* out);

/// A request's blocks for a cell copy (CellGeometry): for every pair, in local id order, the
/// byte offset of the local block (local id * local block stride + local_shift) and of the
/// remote one. What a transposing copy takes instead of a CopyPlan: one entry per block, not per
/// cell.
struct BlockOffsets {
  std::vector<std::int64_t> local;
  std::vector<std::int64_t> remote;

  std::size_t size() const { return local.size(); }
};

/// Appends `pairs`' block offsets to `out` (each with the template's cell origin added, so a
/// windowed template's offsets address its window's first cell). FailedPrecondition (naming the
/// layer) when `tmpl` has no cell geometry; block ids checked as CheckBlockIds does; on error
/// nothing is appended.
Status AppendBlockOffsets(const BlockTemplate& tmpl, const BlockPairs& pairs,
                          std::int64_t local_shift, std::int64_t remote_shift, BlockOffsets* out);

/// Which way a cell copy moves bytes.
enum class CellCopyDirection : std::uint8_t { kRemoteToLocal = 0, kLocalToRemote = 1 };

/// The CPU reference of a cell copy: copies every cell of every block pair of `blocks` between
/// the layer bases `local` and `remote`, in `direction`; bytes outside the cells are untouched.
/// The GPU kernel must produce the same bytes (tests/py/test_cudacopy.py), and it equals
/// applying the pair's run plan (tests/cpp/layout_test.cpp). The caller guarantees that the
/// offsets came from AppendBlockOffsets for layouts that describe these two buffers.
/// Blocking (a memcpy per cell); thread-safe for disjoint destinations.
void CopyBlockCells(const CellGeometry& geometry, const BlockOffsets& blocks, std::byte* local,
                    std::byte* remote, CellCopyDirection direction);

/// Convenience for a one-off plan: Build + Create + Stamp, so every call builds the layer
/// pair's template and validates and sorts the ids again. A request over many layers builds
/// each BlockTemplate once per layer pair (cache it) and one BlockPairs per request, then calls
/// StampBlockCopies per layer: the engine's own path.
Result<CopyPlan> PlanBlockCopies(const LayerLayout& local, const LayerLayout& remote,
                                 std::span<const std::int64_t> local_ids,
                                 std::span<const std::int64_t> remote_ids);

}  // namespace moriio_native
