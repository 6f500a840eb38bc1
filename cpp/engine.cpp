#include "moriio_native/engine.hpp"

#include <algorithm>
#include <array>
#include <functional>
#include <iterator>
#include <map>
#include <mutex>
#include <new>
#include <optional>
#include <unordered_map>

#include "column_pool.hpp"
#include "moriio_native/memory.hpp"
#include "moriio_native/trace_marks.hpp"
#include "msgpack_lite.hpp"
#include "peer_metadata.hpp"
#include "transfer_tracker.hpp"

namespace moriio_native {

std::string_view TransferStateName(TransferState state) {
  switch (state) {
    case TransferState::kPending: return "pending";
    case TransferState::kDone: return "done";
    case TransferState::kFailed: return "failed";
    case TransferState::kAborted: return "aborted";
    case TransferState::kTimedOut: return "timed_out";
  }
  return "unknown";
}

namespace {

/// A digest of one write's arguments (its peer, blocks and windows), by which the tracker tells
/// a repeat of a layer's write from another write of the same layer (TransferTracker::
/// BeginWrites): the repeat does nothing, the other write fails the transfer rather than being
/// dropped while its blocks stay unwritten. Not a security measure: a caller's own arguments.
class WriteDigest {
 public:
  WriteDigest& Add(std::uint64_t v) {
    h_ = (h_ ^ v) * 0x100000001b3ull;
    h_ ^= h_ >> 29;
    return *this;
  }
  WriteDigest& Add(std::string_view s) {
    Add(std::uint64_t{s.size()});
    for (char c : s) Add(std::uint64_t{static_cast<unsigned char>(c)});
    return *this;
  }
  WriteDigest& Add(const CellWindow& w) {
    // Whether each optional field is set, then its value: None (the whole block) must not
    // digest as some value a caller can pass (-1 would make a bad window a "repeat").
    return Add(static_cast<std::uint64_t>(w.head_begin))
        .Add(std::uint64_t{w.heads.has_value()})
        .Add(static_cast<std::uint64_t>(w.heads.value_or(0)))
        .Add(static_cast<std::uint64_t>(w.token_begin))
        .Add(std::uint64_t{w.tokens.has_value()})
        .Add(static_cast<std::uint64_t>(w.tokens.value_or(0)));
  }
  std::uint64_t value() const { return h_; }

 private:
  std::uint64_t h_ = 0xcbf29ce484222325ull;
};

/// A full-avalanche finaliser (MurmurHash3's fmix64): every input bit flips each output bit
/// with probability about one half. A bijection.
std::uint64_t Avalanche(std::uint64_t k) {
  k ^= k >> 33;
  k *= 0xff51afd7ed558ccdull;
  k ^= k >> 33;
  k *= 0xc4ceb9fe1a85ec53ull;
  return k ^ (k >> 33);
}

/// The digest of a write's block ids, local then remote, with both counts. Four lanes take
/// every fourth id each, so the multiplies of neighbouring ids overlap: in one chain a layer of
/// 4,096 blocks cost about 15 us a call, and written a layer at a time in 4 KiB runs that held
/// a WRITE to 0.28x of a device copy against 0.45x without it (H200). Each step of a lane is a
/// bijection of the id, so two lists that differ in one id never share a digest. Each lane is
/// mixed through Avalanche before the lanes are combined: combined raw, differences in two
/// lanes cancelled for small ids (46, 48 -> 60, 63 and 46, 62 -> 62, 15 shared a digest), and a
/// second write of a layer with other blocks was taken for a repeat of the first.
std::uint64_t DigestOfIds(std::span<const std::int64_t> local,
                          std::span<const std::int64_t> remote) {
  std::array<std::uint64_t, 4> lanes = {0x9e3779b97f4a7c15ull, 0xbf58476d1ce4e5b9ull,
                                        0x94d049bb133111ebull, 0xd6e8feb86659fd93ull};
  auto feed = [&lanes](std::span<const std::int64_t> ids) {
    for (std::size_t i = 0; i < ids.size(); ++i) {
      std::uint64_t& h = lanes[i % lanes.size()];
      h = (h ^ static_cast<std::uint64_t>(ids[i])) * 0x100000001b3ull;
      h ^= h >> 29;
    }
  };
  feed(local);
  feed(remote);
  WriteDigest d;
  d.Add(std::uint64_t{local.size()}).Add(std::uint64_t{remote.size()});
  for (std::uint64_t lane : lanes) d.Add(Avalanche(lane));
  return d.value();
}

/// The WriteDigest of a write of `segments` to `peer`.
std::uint64_t DigestOfWrite(std::string_view peer, std::span<const BlockSegment> segments) {
  WriteDigest d;
  d.Add(peer).Add(std::uint64_t{segments.size()});
  for (const BlockSegment& s : segments) {
    d.Add(DigestOfIds(s.local_blocks, s.remote_blocks)).Add(s.local_window).Add(s.remote_window);
  }
  return d.value();
}

/// The WriteDigest of a write of whole blocks to `peer`, given their ids' DigestOfIds: that of
/// one segment of them.
std::uint64_t DigestOfWrite(std::string_view peer, std::uint64_t ids_digest) {
  return WriteDigest()
      .Add(peer)
      .Add(std::uint64_t{1})
      .Add(ids_digest)
      .Add(CellWindow{})
      .Add(CellWindow{})
      .value();
}

using detail::BatchShape;
using detail::EngineMetadata;
using detail::LayerRecord;
using detail::RegionRecord;

BatchShape ShapeOf(const Batch& batch) {
  if (batch.cells) return BatchShape::kCells;
  if (batch.stamps) return BatchShape::kStamped;
  return BatchShape::kRuns;
}

// Forwards backend completions to the tracker; maps backend peer handles to peer ids.
class Sink final : public CompletionSink {
 public:
  explicit Sink(std::shared_ptr<detail::TransferTracker> tracker) : tracker_(std::move(tracker)) {}
  void OnBatchComplete(std::uint64_t token, Status status) override {
    tracker_->OnBatchComplete(token, status);
  }
  void OnBatchUnconfirmed(std::uint64_t token, Status status) override {
    tracker_->OnBatchUnconfirmed(token, status);
  }
  void OnPeerFailure(std::uint64_t peer, Status status) override {
    std::string id;
    {
      std::lock_guard lock(mu_);
      auto it = peers_.find(peer);
      if (it == peers_.end()) return;
      id = it->second;
    }
    tracker_->FailPeer(id, status);
  }
  void MapPeer(std::uint64_t handle, const std::string& id) {
    std::lock_guard lock(mu_);
    peers_[handle] = id;
  }
  void UnmapPeer(std::uint64_t handle) {
    std::lock_guard lock(mu_);
    peers_.erase(handle);
  }

 private:
  std::shared_ptr<detail::TransferTracker> tracker_;
  std::mutex mu_;
  std::unordered_map<std::uint64_t, std::string> peers_;
};

struct LocalRegion {
  std::uint64_t handle = 0;
  MemoryRange range;
  bool aligned = false;
  std::vector<std::uint8_t> key;
};

struct LocalLayer {
  LayerLayout layout;
  std::uint32_t region = 0;
  std::int64_t offset = 0;  // layer base - region start
};

// A layer pair's template for one pair of windows, and whether its blocks go as cells.
struct WindowLink {
  BlockTemplate tmpl;
  bool cells = false;
  bool stamps = false;
};

// Windowed templates a peer keeps at most; past it the cache starts over (a request's windows
// come from a few TP ratios and block-size ratios, so this is never reached in serving).
constexpr std::size_t kMaxWindowTemplates = 4096;

// A connected peer. Immutable after AddPeer (but for its cache of windowed templates); shared
// with in-progress submissions.
struct Peer {
  std::string id;
  std::uint64_t handle = 0;
  std::vector<std::uint64_t> remote_regions;  // imported handles, by peer region index
  // For each of OUR layers (same index as Impl::layers): the peer layer's region, offset and
  // layout, and the block template from our layer to it.
  struct LayerLink {
    std::uint32_t region = 0;
    std::int64_t offset = 0;
    LayerLayout remote;  // from the peer's validated metadata: remote windows are read against it
    // Whole blocks: the template, or (other heads or block size) why only windows pair them.
    std::optional<BlockTemplate> tmpl;
    Status whole_error;
    // Whether this layer's blocks go to the backend as cells: the pair prefers a cell copy and
    // the backend takes cells of its geometry for this region pair (asked once, in AddPeer).
    bool cells = false;
    // Else whether they go as a stamped layer (template and block ids, StampedLayer): the
    // backend takes stamped batches for this region pair and the template is short enough.
    bool stamps = false;
  };
  std::vector<LayerLink> links;
  // Whether write_layer to this peer may carry a device event: the backend honours one for
  // every layer's region pair (AcceptsDeviceWaits: UCX from CUDA memory, waiting on the GPU for
  // CUDA IPC on one node, in its progress thread for RDMA to another; MoRI-IO from ROCm memory,
  // in its poster thread; asked once, in AddPeer).
  bool device_waits = false;
  std::vector<std::uint8_t> metadata;

  struct WindowKey {
    std::size_t layer = 0;
    ResolvedWindow local;
    ResolvedWindow remote;
    auto operator<=>(const WindowKey&) const = default;
  };
  mutable std::mutex windows_mu;
  mutable std::map<WindowKey, std::shared_ptr<const WindowLink>> windows;
};

// One layer pair as a request plans it: the template (whole or windowed), how it goes, where
// the peer holds the layer, and the destination side's window (for the overlap check).
struct LinkPlan {
  const BlockTemplate* tmpl = nullptr;
  bool cells = false;
  bool stamps = false;
  std::uint32_t region = 0;  // peer region index
  std::int64_t offset = 0;   // peer layer base - peer region start
};

struct SegmentLayer {
  std::size_t layer = 0;
  LinkPlan link;
  std::shared_ptr<const WindowLink> hold;  // keeps a windowed template alive while planning
};

// A segment checked against every layer it names: nothing in it can fail while planning.
struct PlannedSegment {
  std::shared_ptr<const BlockPairs> pairs;
  std::vector<SegmentLayer> layers;
};

// Units after which a request's batch for one region pair is closed and submitted while later
// layers are still being planned: the transport starts moving the first piece (a GPU kernel, RDMA
// reads) instead of idling through the whole request's planning. A unit is a run, or a block of
// a cell batch. 8192 runs are 0.5 GiB of 64 KiB KV runs (8192 blocks more), far above any
// per-batch cost, and small enough that planning them takes tens of us.
constexpr std::size_t kPieceUnits = 8192;
// A run batch of small runs stays open past kPieceUnits until it carries kPieceBytes or holds
// kMaxPieceRuns runs: 8192 runs of 4 KiB are 32 MiB, 16 us of an H200's copy against ~40 us of
// host time per submit, and 65,536-run batches moved such runs 2.2x faster (docs/benchmarks.md).
constexpr std::int64_t kPieceBytes = std::int64_t{256} << 20;
constexpr std::size_t kMaxPieceRuns = 65536;
// A request's first pieces are smaller: the GPU idles until the first piece is planned and
// submitted, so piece k (k < kRampPieces) closes at the thresholds above halved
// kRampPieces - k times (1/8, 1/4, 1/2 of them, then whole). Planning runs several times faster
// than the copy moves them (64 KiB runs: ~5-10 ns of host time against ~32 ns of an H200's
// copy), so each piece is planned while the one before is copied.
constexpr std::size_t kRampPieces = 3;
// Layers after which a request's stamped batch is closed (the ramp applies): planning one costs
// nothing per run, but one kernel for a whole READ left its tail unhidden, where consecutive
// batches overlap on the plugin's two streams (docs/benchmarks.md, issue 18).
constexpr std::size_t kStampPieceLayers = 8;

// Collects one request's runs per (local region, remote region) into batches: every layer's
// plan is stamped straight into its region pair's batch, shifted to region offsets. Layers the
// backend moves as cells (Peer::LayerLink::cells) collect their block offsets instead, in one
// cell batch per region pair and cell geometry; layers it moves stamped (LayerLink::stamps) add
// one StampedLayer each to their region pair's stamped batch, which holds each template and each
// set of block ids once, so planning them costs per layer, not per run. Batches and their
// columns come from the engine's ColumnPool, which gets the columns back when the backend drops
// the batch.
class BatchBuilder {
 public:
  static constexpr int kRunsKey = -1;
  static constexpr int kStampsKey = -2;
  struct Key {
    std::uint32_t local = 0;   // local region
    std::uint32_t remote = 0;  // peer region
    int geometry = kRunsKey;   // kRunsKey, kStampsKey, or the cell batch of geometries_[geometry]
    auto operator<=>(const Key&) const = default;
  };

  struct Piece {
    Key key;
    std::shared_ptr<Batch> batch;
    std::int64_t bytes = 0;
    std::int64_t runs = 0;  // runs submitted, or for a cell batch those its cells replace
  };

  BatchBuilder(TransferOp op, const Peer& peer, detail::ColumnPool& pool)
      : op_(op), peer_(peer), pool_(pool) {}
  BatchBuilder(const BatchBuilder&) = delete;
  BatchBuilder& operator=(const BatchBuilder&) = delete;
  // Runs of batches never taken (a planning error) go back to the pool; an open batch's own
  // columns go back with it.
  ~BatchBuilder() {
    for (auto& [key, e] : entries_) {
      pool_.Give(std::move(e.plan.local_offsets));
      pool_.Give(std::move(e.plan.remote_offsets));
      pool_.Give(std::move(e.plan.sizes));
    }
  }

  /// Counts this layer's units towards its batch, so batches are sized once (at most a piece
  /// plus a layer) and Add never reallocates. Call for every layer before Add.
  void Reserve(const LocalLayer& layer, const LinkPlan& link, const BlockPairs& pairs) {
    entries_[KeyOf(layer, link)].upcoming += Units(link, pairs);
  }

  /// Stamps the layer's block template (or its block offsets, for cells) for `pairs`. On error
  /// nothing was added.
  Status Add(const LocalLayer& layer, const LinkPlan& link, const BlockPairs& pairs) {
    Entry& e = entries_[KeyOf(layer, link)];
    if (link.stamps) {
      AddStamped(e, layer, link, pairs);
      return Status::OK();
    }
    const std::size_t units = Units(link, pairs);
    const std::size_t room = std::min(e.upcoming, (link.cells ? kPieceUnits : kMaxPieceRuns) + units);
    if (!e.batch) {
      StartBatch(e, link);
      if (link.cells) {
        e.batch->cells.emplace();
        e.batch->cells->geometry = *link.tmpl->cell_geometry();
        e.batch->cells->blocks.local = pool_.Take(room);
        e.batch->cells->blocks.remote = pool_.Take(room);
      } else {
        e.plan.local_offsets = pool_.Take(room);
        e.plan.remote_offsets = pool_.Take(room);
        e.plan.sizes = pool_.Take(room);
      }
    }
    MORIIO_RETURN_IF_ERROR(
        link.cells
            ? AppendBlockOffsets(*link.tmpl, pairs, layer.offset, link.offset,
                                 &e.batch->cells->blocks)
            : AppendBlockCopies(*link.tmpl, pairs, layer.offset, link.offset, &e.plan));
    e.upcoming -= std::min(e.upcoming, units);
    Count(e, link, pairs);
    return Status::OK();
  }

  /// The open batches that are full (`all`: every open batch, also an empty one), their runs
  /// moved in. A cell batch is full at kPieceUnits blocks, a run batch at kPieceUnits runs that
  /// carry kPieceBytes, or at kMaxPieceRuns runs; the request's first pieces at a fraction of
  /// these (kRampPieces). A stamped batch at kStampPieceLayers layers, ramped alike. Their keys
  /// start new batches on the next Add. Local region handles are filled by the caller.
  std::vector<Piece> Take(bool all) {
    std::vector<Piece> out;
    const std::size_t shift = kRampPieces - std::min(taken_, kRampPieces);
    for (auto& [key, e] : entries_) {
      if (!e.batch) continue;
      const bool cells = e.batch->cells.has_value();
      const bool stamps = e.batch->stamps.has_value();
      const std::size_t units = cells ? e.batch->cells->blocks.size() : e.plan.size();
      const bool full = stamps  ? e.batch->stamps->layers.size() >= kStampPieceLayers >> shift
                        : cells ? units >= kPieceUnits >> shift
                                : units >= kMaxPieceRuns >> shift ||
                                      (units >= kPieceUnits >> shift &&
                                       e.bytes >= kPieceBytes >> shift);
      if (!all && !full) continue;
      ++taken_;
      std::int64_t runs = e.cell_runs;
      if (!cells && !stamps) {
        runs = static_cast<std::int64_t>(e.plan.size());
        e.batch->local_offsets = std::move(e.plan.local_offsets);
        e.batch->remote_offsets = std::move(e.plan.remote_offsets);
        e.batch->sizes = std::move(e.plan.sizes);
        e.plan = CopyPlan{};
      }
      out.push_back({key, std::move(e.batch), e.bytes, runs});
      e.bytes = 0;
      e.cell_runs = 0;
    }
    return out;
  }

 private:
  struct Entry {
    std::shared_ptr<Batch> batch;  // null until the next Add
    CopyPlan plan;                 // a run batch's runs until Take
    std::int64_t bytes = 0;
    std::int64_t cell_runs = 0;  // a cell or stamped batch: the runs it replaces
    std::size_t upcoming = 0;    // units of this batch's layers not yet added (an upper bound)
    // A stamped batch: where each BlockPairs' ids and each template's runs start in it.
    std::map<const BlockPairs*, std::uint64_t> stamped_ids;
    std::map<const BlockTemplate*, std::uint32_t> stamped_runs;
  };

  void StartBatch(Entry& e, const LinkPlan& link) {
    e.batch = pool_.NewBatch();
    e.batch->op = op_;
    e.batch->peer = peer_.handle;
    e.batch->remote_region = peer_.remote_regions[link.region];
  }

  // The layer's bytes, and for a cell or stamped batch the runs it replaces.
  static void Count(Entry& e, const LinkPlan& link, const BlockPairs& pairs) {
    std::int64_t per_block = 0;
    for (const CopyRun& r : link.tmpl->runs()) per_block += r.size;
    const auto blocks = static_cast<std::int64_t>(pairs.size());
    e.bytes += per_block * blocks;
    if (link.cells || link.stamps) {
      e.cell_runs += blocks * static_cast<std::int64_t>(link.tmpl->runs().size());
    }
  }

  // One StampedLayer for `layer` in its region pair's stamped batch; the template's runs and
  // the pairs' ids go in the first time the batch meets them. Ids were checked by PlanSegment.
  void AddStamped(Entry& e, const LocalLayer& layer, const LinkPlan& link,
                  const BlockPairs& pairs) {
    if (!e.batch) {
      StartBatch(e, link);
      e.batch->stamps.emplace();
      e.stamped_ids.clear();
      e.stamped_runs.clear();
    }
    BatchStamps& s = *e.batch->stamps;
    const BlockTemplate& tmpl = *link.tmpl;
    Count(e, link, pairs);
    if (pairs.empty()) return;
    auto [ids, new_ids] = e.stamped_ids.try_emplace(&pairs, s.local_ids.size());
    if (new_ids) {
      s.local_ids.insert(s.local_ids.end(), pairs.local_sorted().begin(),
                         pairs.local_sorted().end());
      s.remote_ids.insert(s.remote_ids.end(), pairs.remote_by_local().begin(),
                          pairs.remote_by_local().end());
    }
    auto [runs, new_runs] =
        e.stamped_runs.try_emplace(&tmpl, static_cast<std::uint32_t>(s.runs.size()));
    if (new_runs) s.runs.insert(s.runs.end(), tmpl.runs().begin(), tmpl.runs().end());
    s.layers.push_back(StampedLayer{layer.offset, link.offset, tmpl.local_block_stride(),
                                    tmpl.remote_block_stride(), ids->second, pairs.size(),
                                    runs->second, static_cast<std::uint32_t>(tmpl.runs().size())});
  }

  static std::size_t Units(const LinkPlan& link, const BlockPairs& pairs) {
    if (link.stamps) return 0;  // a stamped layer reserves no columns
    return link.cells ? pairs.size() : pairs.size() * link.tmpl->runs().size();
  }

  Key KeyOf(const LocalLayer& layer, const LinkPlan& link) {
    Key key{layer.region, link.region, link.stamps ? kStampsKey : kRunsKey};
    if (!link.cells) return key;
    const CellGeometry& g = *link.tmpl->cell_geometry();
    auto it = std::ranges::find(geometries_, g);
    key.geometry = static_cast<int>(it - geometries_.begin());
    if (it == geometries_.end()) geometries_.push_back(g);
    return key;
  }

  TransferOp op_;
  const Peer& peer_;
  detail::ColumnPool& pool_;
  std::size_t taken_ = 0;  // pieces handed out so far (the ramp)
  std::map<Key, Entry> entries_;
  std::vector<CellGeometry> geometries_;  // of the cell batches, few: one per kind of layer
};

// The block pairs of the latest WriteLayer call. A WRITE names the same blocks for every layer,
// and copying, sorting and checking them again per layer cost more than stamping the layer.
class RecentBlockPairs {
 public:
  /// Checked pairs of whole blocks and their ids' DigestOfIds.
  struct Checked {
    std::shared_ptr<const BlockPairs> pairs;
    std::uint64_t ids_digest = 0;
  };

  Result<Checked> Get(std::span<const std::int64_t> local, std::span<const std::int64_t> remote) {
    {
      std::lock_guard lock(mu_);
      if (last_.pairs && std::ranges::equal(local, local_) &&
          std::ranges::equal(remote, remote_)) {
        return last_;
      }
    }
    MORIIO_ASSIGN_OR_RETURN(BlockPairs created, BlockPairs::Create(local, remote));
    const Checked checked{std::make_shared<const BlockPairs>(std::move(created)),
                          DigestOfIds(local, remote)};
    std::lock_guard lock(mu_);
    local_.assign(local.begin(), local.end());
    remote_.assign(remote.begin(), remote.end());
    last_ = checked;
    return checked;
  }

 private:
  std::mutex mu_;
  std::vector<std::int64_t> local_;
  std::vector<std::int64_t> remote_;
  Checked last_;
};

}  // namespace

struct Engine::Impl {
  EngineConfig config;
  std::shared_ptr<detail::TransferTracker> tracker;
  std::shared_ptr<Sink> sink;
  std::unique_ptr<Backend> backend;
  // The run and block-offset columns of every batch, recycled (see column_pool.hpp).
  std::shared_ptr<detail::ColumnPool> columns = detail::ColumnPool::Create();

  mutable std::mutex mu;
  bool registered = false;
  bool registering = false;
  std::vector<LocalRegion> regions;
  std::vector<LocalLayer> layers;
  std::unordered_map<std::string, std::size_t> layer_index;
  std::vector<std::uint8_t> metadata;
  std::map<std::string, std::shared_ptr<const Peer>, std::less<>> peers;
  std::map<std::uint64_t, MemoryRange> allocations;  // AllocateBacking, by address
  RecentBlockPairs write_pairs;

  ~Impl() {
    // The backend completes (or aborts) every outstanding batch while the tracker still lives.
    backend.reset();
  }

  Result<std::shared_ptr<const Peer>> FindPeer(std::string_view id) const {
    std::lock_guard lock(mu);
    auto it = peers.find(id);
    if (it == peers.end()) return NotFoundError("unknown peer '" + std::string(id) + "'");
    return it->second;
  }

  Result<std::size_t> FindLayer(std::string_view name) const {
    auto it = layer_index.find(std::string(name));
    if (it == layer_index.end()) return NotFoundError("unknown layer '" + std::string(name) + "'");
    return it->second;
  }

  Status CheckRegistered() const {
    std::lock_guard lock(mu);
    if (!registered) return FailedPreconditionError("register_kv_caches has not been called");
    return Status::OK();
  }

  // Layer `i`'s template with `peer` for one pair of windows: the whole-block template for
  // whole windows, else the peer's cached windowed template (built and asked AcceptsCells on
  // first use). Errors name the layer and the windows.
  Result<SegmentLayer> LinkFor(const Peer& peer, std::size_t i, const CellWindow& local_window,
                               const CellWindow& remote_window) const {
    const Peer::LayerLink& link = peer.links[i];
    const LayerLayout& mine = layers[i].layout;
    SegmentLayer out{i, LinkPlan{nullptr, false, false, link.region, link.offset}, nullptr};
    auto whole = [&]() -> Result<SegmentLayer> {
      if (!link.tmpl) return link.whole_error;
      out.link.tmpl = &*link.tmpl;
      out.link.cells = link.cells;
      out.link.stamps = link.stamps;
      return out;
    };
    if (local_window == CellWindow{} && remote_window == CellWindow{}) return whole();
    MORIIO_ASSIGN_OR_RETURN(ResolvedWindow lw, ResolveWindow(local_window, mine));
    Result<ResolvedWindow> rw = ResolveWindow(remote_window, link.remote);
    if (!rw.ok()) return rw.status().WithContext("remote");
    if (link.tmpl && lw == link.tmpl->local_window() && *rw == link.tmpl->remote_window()) {
      return whole();
    }
    const Peer::WindowKey key{i, lw, *rw};
    {
      std::lock_guard lock(peer.windows_mu);
      if (auto it = peer.windows.find(key); it != peer.windows.end()) {
        out.hold = it->second;
      }
    }
    if (!out.hold) {
      MORIIO_ASSIGN_OR_RETURN(BlockTemplate tmpl,
                              BlockTemplate::Build(mine, local_window, link.remote, remote_window));
      auto built = std::make_shared<WindowLink>(WindowLink{std::move(tmpl), false, false});
      const CopyPath path = PathFor(built->tmpl, i, peer.remote_regions[link.region]);
      built->cells = path.cells;
      built->stamps = path.stamps;
      std::lock_guard lock(peer.windows_mu);
      if (peer.windows.size() >= kMaxWindowTemplates) peer.windows.clear();
      out.hold = peer.windows.try_emplace(key, std::move(built)).first->second;
    }
    out.link.tmpl = &out.hold->tmpl;
    out.link.cells = out.hold->cells;
    out.link.stamps = out.hold->stamps;
    return out;
  }

  // How layer `layer`'s template `tmpl` to the imported region `remote_region` goes: as cells
  // where the pair prefers a cell copy and the backend takes its geometry; else stamped where
  // the backend takes stamped batches and the template fits one (kMaxStampRunsPerLayer); else
  // (neither) as runs. Asked once per whole-block link (ConnectPeer) and windowed template.
  struct CopyPath {
    bool cells = false;
    bool stamps = false;
  };
  CopyPath PathFor(const BlockTemplate& tmpl, std::size_t layer,
                   std::uint64_t remote_region) const {
    const std::uint64_t local_region = regions[layers[layer].region].handle;
    CopyPath path;
    if (tmpl.prefers_cell_copy()) {
      path.cells = backend->AcceptsCells(local_region, remote_region, *tmpl.cell_geometry());
    }
    path.stamps = !path.cells && !tmpl.runs().empty() &&
                  tmpl.runs().size() <= kMaxStampRunsPerLayer &&
                  backend->AcceptsStamps(local_region, remote_region);
    return path;
  }

  // Checks one segment against every layer it moves: `names` (empty: every layer), or only
  // `write_layer` for a WRITE. Errors carry `where` (when not empty) as context; `bare_lookup`
  // keeps an unknown layer's error as the one-segment Read always gave it.
  Result<PlannedSegment> PlanSegment(const Peer& peer, std::span<const std::string> names,
                                     std::shared_ptr<const BlockPairs> pairs,
                                     const CellWindow& local_window,
                                     const CellWindow& remote_window,
                                     std::optional<std::size_t> write_layer,
                                     const std::string& where, bool bare_lookup) const {
    auto context = [&](const Status& st) { return where.empty() ? st : st.WithContext(where); };
    std::vector<std::size_t> selected;
    if (write_layer) {
      selected.push_back(*write_layer);
    } else if (names.empty()) {
      for (std::size_t i = 0; i < layers.size(); ++i) selected.push_back(i);
    } else {
      std::vector<bool> seen(layers.size(), false);
      for (const std::string& name : names) {
        Result<std::size_t> i = FindLayer(name);
        if (!i.ok()) return bare_lookup ? i.status() : context(i.status());
        if (seen[*i]) return InvalidArgumentError(where + ": layer '" + name + "' listed twice");
        seen[*i] = true;
        selected.push_back(*i);
      }
    }
    PlannedSegment out{std::move(pairs), {}};
    out.layers.reserve(selected.size());
    for (std::size_t i : selected) {
      Result<SegmentLayer> link = LinkFor(peer, i, local_window, remote_window);
      if (!link.ok()) return context(link.status());
      // Every block id against both sides' block counts (the peer's from its registration):
      // a bad id fails the call, not the transfer. Planning cannot fail after that.
      if (Status st = CheckBlockIds(*link->link.tmpl, *out.pairs); !st.ok()) return context(st);
      out.layers.push_back(std::move(link).value());
    }
    return out;
  }

  // Refuses two segments that write the same destination cells of a layer: the same block id
  // (local for a READ, remote for a WRITE) under overlapping destination windows. Within one
  // segment BlockPairs already refused a repeated id.
  Status CheckDisjointDestinations(const Peer& peer, const std::vector<PlannedSegment>& segments,
                                   TransferOp op, const std::string& ctx) const {
    if (segments.size() < 2) return Status::OK();
    const bool remote = op == TransferOp::kWrite;
    // Destination ids of a segment, sorted (local ids are; remote ones sorted on demand).
    std::vector<std::optional<std::vector<std::int64_t>>> sorted(segments.size());
    auto ids = [&](std::size_t k) -> std::span<const std::int64_t> {
      if (!remote) return segments[k].pairs->local_sorted();
      if (!sorted[k]) {
        const std::span<const std::int64_t> r = segments[k].pairs->remote_by_local();
        sorted[k].emplace(r.begin(), r.end());
        std::sort(sorted[k]->begin(), sorted[k]->end());
      }
      return *sorted[k];
    };
    std::vector<std::vector<std::pair<std::size_t, const BlockTemplate*>>> by_layer(layers.size());
    for (std::size_t k = 0; k < segments.size(); ++k) {
      for (const SegmentLayer& l : segments[k].layers) {
        by_layer[l.layer].emplace_back(k, l.link.tmpl);
      }
    }
    for (std::size_t i = 0; i < by_layer.size(); ++i) {
      const auto& uses = by_layer[i];
      for (std::size_t a = 0; a < uses.size(); ++a) {
        for (std::size_t b = a + 1; b < uses.size(); ++b) {
          const BlockTemplate& ta = *uses[a].second;
          const BlockTemplate& tb = *uses[b].second;
          const ResolvedWindow& wa = remote ? ta.remote_window() : ta.local_window();
          const ResolvedWindow& wb = remote ? tb.remote_window() : tb.local_window();
          if (!wa.Overlaps(wb)) continue;
          const std::span<const std::int64_t> ia = ids(uses[a].first);
          const std::span<const std::int64_t> ib = ids(uses[b].first);
          std::vector<std::int64_t> common;
          std::set_intersection(ia.begin(), ia.end(), ib.begin(), ib.end(),
                                std::back_inserter(common));
          if (common.empty()) continue;
          const LayerLayout& dest = remote ? peer.links[i].remote : layers[i].layout;
          auto shown = [&](const ResolvedWindow& w) {
            return DescribeWindow(CellWindow{w.head_begin, w.heads, w.token_begin, w.tokens},
                                  dest);
          };
          return InvalidArgumentError(
              (ctx.empty() ? std::string() : ctx + ": ") + "segments " +
              std::to_string(uses[a].first) + " and " + std::to_string(uses[b].first) +
              " both write " + (remote ? "remote" : "local") +
              " block " + std::to_string(common.front()) + " of layer '" +
              layers[i].layout.name() + "' in overlapping windows (" + shown(wa) + " and " +
              shown(wb) + ")");
        }
      }
    }
    return Status::OK();
  }

  // Begins a READ of `planned` (checked: nothing in it can fail) and submits its batches.
  Status StartRead(std::string_view transfer_id, const Peer& peer,
                   const std::vector<PlannedSegment>& planned, const std::string& ctx);

  // A batch's token from the tracker, given its bytes, runs and shape.
  using AddBatchFn =
      std::function<Result<std::uint64_t>(std::int64_t, std::int64_t, BatchShape)>;

  // Cuts `planned` into batches (BatchBuilder: per region pair and kind; a full one is
  // submitted at once, so the transport starts while later layers are cut) under tokens from
  // `add`, each waiting for `cuda_event` (0: none). A cutting error (unreachable after
  // PlanSegment checked every id) stops it and is returned.
  Status SubmitPlanned(TransferOp op, const Peer& peer, const std::vector<PlannedSegment>& planned,
                       std::string_view transfer_id, std::uint64_t cuda_event,
                       const AddBatchFn& add);

  // `why` with `context`, after failing the WRITE `transfer_id` with it: the caller was told a
  // layer will not arrive, so no later seal may make the transfer done. A READ id is refused
  // without touching the READ.
  Status RefuseWrite(std::string_view transfer_id, std::string_view peer_id, const Status& why,
                     const std::string& context) {
    const Status st = why.WithContext(context);
    MORIIO_RETURN_IF_ERROR(tracker->FailWrite(transfer_id, peer_id, st));
    return st;
  }

  // Why layer `i`'s copy to `peer` cannot wait for a device event; OK when it can.
  Status CheckDeviceWait(const Peer& peer, std::size_t i) const {
    if (regions[layers[i].region].range.kind == MemoryKind::kHost) {
      return FailedPreconditionError("not in GPU memory; a device event cannot order its copy");
    }
    if (!peer.device_waits) {
      return FailedPreconditionError(
          "peer '" + peer.id + "': backend '" + config.backend +
          "' cannot wait for a device event for it (that needs UCX with its CUDA copy plugin, "
          "or MoRI-IO; see waits_for_device_events); synchronise the event and write without "
          "it");
    }
    return Status::OK();
  }

  // Both WriteLayers: the checks every write makes, `plan` (the layer's segments, checked),
  // then one batch for them. Every refusal but a READ id fails the transfer.
  // `what`: the WriteDigest of the call's peer, blocks and windows.
  Result<bool> WriteSegments(
      std::string_view transfer_id, std::string_view layer, std::string_view peer_id,
      std::uint64_t cuda_event, std::uint64_t what,
      const std::function<Result<std::vector<PlannedSegment>>(const Peer&, std::size_t)>& plan);

  // Submits prepared batches of one transfer, each waiting for `cuda_event` (0: none); a batch
  // that cannot be submitted completes as failed so the transfer still ends exactly once.
  // False when the transfer ended meanwhile (deadline, abort): nothing more should be
  // submitted for it.
  bool Submit(std::vector<BatchBuilder::Piece> pieces, std::string_view transfer_id,
              std::uint64_t cuda_event, const AddBatchFn& add) {
    for (BatchBuilder::Piece& piece : pieces) {
      trace::Record(trace::Mark::kPieceCut);
      Batch& batch = *piece.batch;
      batch.local_region = regions[piece.key.local].handle;
      batch.device_wait_event = cuda_event;
      Result<std::uint64_t> token = add(piece.bytes, piece.runs, ShapeOf(batch));
      if (!token.ok()) return false;
      batch.token = *token;
      trace::Record(trace::Mark::kSubmitEntry, *token);
      Status st = backend->Submit(std::move(piece.batch));
      trace::Record(trace::Mark::kSubmitExit, *token);
      if (!st.ok()) {
        tracker->OnBatchComplete(*token,
                                 st.WithContext("transfer '" + std::string(transfer_id) + "'"));
      }
    }
    return true;
  }
};

namespace {

// Stamps a READ or WRITE call's entry and, on every way out, its exit (trace_marks.hpp).
class CallMarks {
 public:
  CallMarks() { trace::Record(trace::Mark::kCallEntry); }
  ~CallMarks() { trace::Record(trace::Mark::kCallExit); }
  CallMarks(const CallMarks&) = delete;
  CallMarks& operator=(const CallMarks&) = delete;
};

// The layers placed in registration region `region`, for an error message: "layer 'a'", or
// "the 32 layers 'a' .. 'z'" (the first and last in the caller's order).
std::string LayersOfRegion(std::span<const LayerRegistration> layers,
                           const std::vector<LocalLayer>& local, std::uint32_t region) {
  std::vector<std::size_t> members;
  for (std::size_t i = 0; i < local.size(); ++i) {
    if (local[i].region == region) members.push_back(i);
  }
  if (members.size() == 1) return "layer '" + layers[members.front()].name + "'";
  return "the " + std::to_string(members.size()) + " layers '" + layers[members.front()].name +
         "' .. '" + layers[members.back()].name + "'";
}

}  // namespace

Engine::Engine(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
Engine::~Engine() = default;

Result<std::unique_ptr<Engine>> Engine::Create(EngineConfig config) {
  // Checked as every peer's metadata decoder will: an id no peer accepts fails here, not at
  // each peer's AddPeer.
  MORIIO_RETURN_IF_ERROR(detail::CheckName(config.engine_id, "engine_id"));
  if (config.transfer_timeout.count() <= 0 || config.transfer_timeout > std::chrono::hours(24 * 365)) {
    return InvalidArgumentError("transfer_timeout must be positive and at most a year");
  }
  const std::uint64_t page = config.page_size;
  if (page < EngineConfig::kMinPageSize || page > EngineConfig::kMaxPageSize ||
      (page & (page - 1)) != 0) {
    return InvalidArgumentError("page_size must be a power of two from " +
                                std::to_string(EngineConfig::kMinPageSize) + " to " +
                                std::to_string(EngineConfig::kMaxPageSize) + ", got " +
                                std::to_string(page));
  }
  auto impl = std::make_unique<Impl>();
  impl->tracker = std::make_shared<detail::TransferTracker>(config.transfer_timeout,
                                                            config.terminal_history);
  impl->sink = std::make_shared<Sink>(impl->tracker);
  // The UCX backend's region check fails its batches at its own deadline: not before the
  // transfer's (a peer frozen for seconds on a loaded host answers late, not never). Other
  // backends ignore the key.
  config.options.try_emplace("ucx_region_check_timeout_ms",
                             std::to_string(config.transfer_timeout.count()));
  MORIIO_ASSIGN_OR_RETURN(impl->backend, CreateBackend(config.backend, config.options, impl->sink));
  impl->backend->SetOwner(config.engine_id);
  impl->config = std::move(config);
  return std::unique_ptr<Engine>(new Engine(std::move(impl)));
}

const std::string& Engine::engine_id() const { return impl_->config.engine_id; }
const std::string& Engine::backend_name() const { return impl_->config.backend; }

Result<bool> Engine::WaitsForDeviceEvents(std::string_view peer) const {
  MORIIO_ASSIGN_OR_RETURN(std::shared_ptr<const Peer> p, impl_->FindPeer(peer));
  return p->device_waits;
}

Result<std::vector<std::uint8_t>> Engine::RegisterKvCaches(
    std::span<const LayerRegistration> layers) {
  Impl& d = *impl_;
  if (layers.empty()) return InvalidArgumentError("no layers to register");
  {
    std::lock_guard lock(d.mu);
    if (d.registered || d.registering) {
      return FailedPreconditionError("KV caches are registered already");
    }
    d.registering = true;  // one registration at a time; cleared on every exit below
  }
  struct ClearRegistering {
    Impl& d;
    ~ClearRegistering() {
      std::lock_guard lock(d.mu);
      d.registering = false;
    }
  } clear_registering{d};
  // Validate everything before registering anything.
  std::vector<LocalLayer> local;
  std::unordered_map<std::string, std::size_t> index;
  struct AllocKey {
    std::uint64_t base, size;
    MemoryKind kind;
    int device;
    auto operator<=>(const AllocKey&) const = default;
  };
  std::map<AllocKey, std::vector<std::size_t>> by_allocation;
  for (const LayerRegistration& l : layers) {
    MORIIO_RETURN_IF_ERROR(
        detail::CheckName(l.name, "layer " + std::to_string(local.size()) + " name"));
    if (!index.emplace(l.name, local.size()).second) {
      return InvalidArgumentError("layer '" + l.name + "' is listed twice");
    }
    MORIIO_ASSIGN_OR_RETURN(LayerLayout layout,
                            DescribeLayer(l.name, l.geometry, l.spec, l.plane_axis));
    const std::uint64_t ptr = l.geometry.data_ptr;
    const std::uint64_t end = ptr + static_cast<std::uint64_t>(layout.span_bytes());
    if (ptr == 0 || ptr < l.allocation.address || end < ptr ||
        end > l.allocation.address + l.allocation.size) {
      return InvalidArgumentError("layer '" + l.name + "' (" + std::to_string(layout.span_bytes()) +
                                  " bytes at data_ptr " + std::to_string(ptr) +
                                  ") does not lie inside its allocation");
    }
    by_allocation[{l.allocation.address, l.allocation.size, l.allocation.kind, l.allocation.device}]
        .push_back(local.size());
    local.push_back({std::move(layout), 0, 0});
  }
  const BackendCapabilities caps = d.backend->capabilities();
  std::vector<LocalRegion> regions;
  for (const auto& [alloc, members] : by_allocation) {
    std::vector<ViewRange> views;
    for (std::size_t i : members) {
      views.push_back({layers[i].geometry.data_ptr,
                       static_cast<std::uint64_t>(local[i].layout.span_bytes())});
    }
    MORIIO_ASSIGN_OR_RETURN(RegistrationPlan plan,
                            PlanRegistration(alloc.base, alloc.size, views, d.config.page_size,
                                             caps.unaligned_registration));
    const auto region_index = static_cast<std::uint32_t>(regions.size());
    const PlannedRegion& r = plan.regions.front();
    regions.push_back({0, {r.start, r.size, alloc.kind, alloc.device}, r.aligned, {}});
    for (std::size_t k = 0; k < members.size(); ++k) {
      local[members[k]].region = region_index;
      local[members[k]].offset = static_cast<std::int64_t>(plan.placements[k].offset);
    }
  }
  EngineMetadata meta;
  meta.engine_id = d.config.engine_id;
  meta.backend = d.config.backend;
  MORIIO_ASSIGN_OR_RETURN(meta.address, d.backend->LocalAddress());
  // Register; undo on the first failure so a failed call leaves nothing behind.
  for (std::size_t i = 0; i < regions.size(); ++i) {
    Result<RegisteredRegion> reg = d.backend->RegisterMemory(regions[i].range);
    if (!reg.ok()) {
      for (std::size_t k = 0; k < i; ++k) (void)d.backend->DeregisterMemory(regions[k].handle);
      return reg.status().WithContext(
          "registering the memory of " +
          LayersOfRegion(layers, local, static_cast<std::uint32_t>(i)));
    }
    regions[i].handle = reg->handle;
    regions[i].key = std::move(reg->remote_key);
  }
  for (const LocalRegion& r : regions) meta.regions.push_back({r.range, r.aligned, r.key});
  for (const LocalLayer& l : local) meta.layers.push_back({l.layout, l.region, l.offset});
  std::lock_guard lock(d.mu);
  d.regions = std::move(regions);
  d.layers = std::move(local);
  d.layer_index = std::move(index);
  d.metadata = detail::EncodeMetadata(meta);
  d.registered = true;
  return d.metadata;
}

Result<std::vector<std::uint8_t>> Engine::LocalMetadata() const {
  MORIIO_RETURN_IF_ERROR(impl_->CheckRegistered());
  std::lock_guard lock(impl_->mu);
  return impl_->metadata;
}

Result<std::string> Engine::AddPeer(std::span<const std::uint8_t> metadata,
                                    std::string_view expected_engine_id) {
  return ConnectPeer(metadata, /*replace=*/false, expected_engine_id);
}

Result<std::string> Engine::ReplacePeer(std::span<const std::uint8_t> metadata,
                                        std::string_view expected_engine_id) {
  return ConnectPeer(metadata, /*replace=*/true, expected_engine_id);
}

Result<std::string> Engine::ConnectPeer(std::span<const std::uint8_t> metadata, bool replace,
                                        std::string_view expected_engine_id) {
  Impl& d = *impl_;
  MORIIO_RETURN_IF_ERROR(d.CheckRegistered());
  MORIIO_ASSIGN_OR_RETURN(EngineMetadata meta, detail::DecodeMetadata(metadata));
  if (!expected_engine_id.empty() && meta.engine_id != expected_engine_id) {
    return IncompatibleError("peer metadata names engine '" + meta.engine_id +
                             "', not the expected '" + std::string(expected_engine_id) +
                             "' (the id its handshake answered as); nothing changed");
  }
  if (meta.backend != d.config.backend) {
    return IncompatibleError("peer '" + meta.engine_id + "' uses backend '" + meta.backend +
                             "', this engine uses '" + d.config.backend + "'");
  }
  if (meta.engine_id == d.config.engine_id) {
    return InvalidArgumentError("peer metadata carries this engine's own id '" + meta.engine_id + "'");
  }
  // The same metadata again whose connection the transport reported broken: connected anew,
  // as a replacement (its transfers fail anyway); else every later transfer to a peer that
  // lives on would fail until something removed it.
  std::shared_ptr<const Peer> broken;
  {
    std::lock_guard lock(d.mu);
    if (auto it = d.peers.find(meta.engine_id); it != d.peers.end()) {
      if (std::equal(it->second->metadata.begin(), it->second->metadata.end(), metadata.begin(),
                     metadata.end())) {
        broken = it->second;
      } else if (!replace) {
        return AlreadyExistsError("peer '" + meta.engine_id +
                                  "' is connected with different metadata; remove it first");
      }
    }
  }
  if (broken != nullptr && !d.backend->PeerFailed(broken->handle)) {
    return meta.engine_id;  // the same handshake again
  }
  // Every one of our layers needs a peer layer of the same name whose cells pair with ours.
  auto peer = std::make_shared<Peer>();
  peer->id = meta.engine_id;
  peer->metadata.assign(metadata.begin(), metadata.end());
  std::unordered_map<std::string, const LayerRecord*> peer_layers;
  for (const LayerRecord& l : meta.layers) peer_layers[l.layout.name()] = &l;
  for (const LocalLayer& mine : d.layers) {
    auto it = peer_layers.find(mine.layout.name());
    if (it == peer_layers.end()) {
      return IncompatibleError("peer '" + meta.engine_id + "' has no layer '" +
                               mine.layout.name() + "'");
    }
    const LayerLayout& theirs = it->second->layout;
    Result<BlockTemplate> tmpl = BlockTemplate::Build(mine.layout, theirs);
    Peer::LayerLink link{it->second->region, it->second->offset, theirs, std::nullopt,
                         Status::OK(), false};
    if (tmpl.ok()) {
      link.tmpl = std::move(tmpl).value();
    } else if (CheckCellContent(mine.layout, theirs).ok()) {
      // Other heads or block size: the layers pair through windows only (heterogeneous TP,
      // other block sizes); a whole-block transfer of this layer is refused with this error.
      link.whole_error = tmpl.status().WithContext("peer '" + meta.engine_id + "'");
    } else {
      return tmpl.status().WithContext("peer '" + meta.engine_id + "'");
    }
    peer->links.push_back(std::move(link));
  }
  // Connect and import; undo on failure. A replaced peer stays connected until the new
  // connection stands, so a failed replacement changes nothing.
  MORIIO_ASSIGN_OR_RETURN(peer->handle, d.backend->ConnectPeer(meta.address));
  // The backend then moves bytes of this peer's ranges only as the claimed engine's: metadata
  // naming this engine id and another engine's address reaches nothing of that engine.
  if (Status owner = d.backend->ExpectPeerOwner(peer->handle, meta.engine_id); !owner.ok()) {
    (void)d.backend->DisconnectPeer(peer->handle);
    return owner.WithContext("peer '" + meta.engine_id + "'");
  }
  for (const RegionRecord& r : meta.regions) {
    Result<std::uint64_t> imported = d.backend->ImportRemoteRegion(peer->handle, r.range, r.key);
    if (!imported.ok()) {
      (void)d.backend->DisconnectPeer(peer->handle);
      return imported.status().WithContext("peer '" + meta.engine_id + "' region " +
                                           std::to_string(peer->remote_regions.size()));
    }
    peer->remote_regions.push_back(*imported);
  }
  // Cell copies where a pair wants one and the backend takes it; else stamped layers where the
  // backend takes them; runs everywhere else.
  for (std::size_t k = 0; k < peer->links.size(); ++k) {
    Peer::LayerLink& link = peer->links[k];
    if (!link.tmpl) continue;
    const Impl::CopyPath path = d.PathFor(*link.tmpl, k, peer->remote_regions[link.region]);
    link.cells = path.cells;
    link.stamps = path.stamps;
  }
  peer->device_waits = d.backend->capabilities().device_event_wait;
  for (std::size_t k = 0; k < peer->links.size() && peer->device_waits; ++k) {
    peer->device_waits = d.backend->AcceptsDeviceWaits(
        d.regions[d.layers[k].region].handle, peer->remote_regions[peer->links[k].region]);
  }
  std::shared_ptr<const Peer> old;
  {
    std::lock_guard lock(d.mu);
    auto it = d.peers.find(peer->id);
    const bool reconnects = it != d.peers.end() && it->second == broken;
    if (it != d.peers.end() && !reconnects && it->second->metadata == peer->metadata) {
      // Another thread added (or reconnected) this very peer meanwhile: the same handshake.
      (void)d.backend->DisconnectPeer(peer->handle);
      return peer->id;
    }
    if (it != d.peers.end() && !reconnects && !replace) {
      (void)d.backend->DisconnectPeer(peer->handle);
      return AlreadyExistsError("peer '" + peer->id +
                                "' was added concurrently with other metadata");
    }
    if (it != d.peers.end()) {
      old = it->second;
      d.peers.erase(it);
    }
  }
  if (old != nullptr) {
    // The old instance's transfers end (aborted) before the new one is reachable under the
    // same id, so none of them can be mistaken for a transfer to the new instance.
    d.sink->UnmapPeer(old->handle);
    d.tracker->FailPeer(old->id, AbortedError(old == broken
                                                  ? "peer reconnected: its connection had failed"
                                                  : "peer replaced by a new instance"));
    (void)d.backend->DisconnectPeer(old->handle);
  }
  std::lock_guard lock(d.mu);
  if (auto [it, inserted] = d.peers.emplace(peer->id, peer); !inserted) {
    // Added concurrently while the old one was being disconnected.
    (void)d.backend->DisconnectPeer(peer->handle);
    if (it->second->metadata == peer->metadata) return peer->id;
    return AlreadyExistsError("peer '" + peer->id + "' was added concurrently with other metadata");
  }
  d.sink->MapPeer(peer->handle, peer->id);
  return peer->id;
}

Status Engine::RemovePeer(std::string_view id) {
  Impl& d = *impl_;
  std::shared_ptr<const Peer> peer;
  {
    std::lock_guard lock(d.mu);
    auto it = d.peers.find(id);
    if (it == d.peers.end()) return NotFoundError("unknown peer '" + std::string(id) + "'");
    peer = it->second;
    d.peers.erase(it);
  }
  d.sink->UnmapPeer(peer->handle);
  d.tracker->FailPeer(peer->id, AbortedError("peer removed"));
  return d.backend->DisconnectPeer(peer->handle);
}

Result<bool> Engine::RemoveIdlePeer(std::string_view id) {
  Impl& d = *impl_;
  std::shared_ptr<const Peer> peer;
  {
    // Under the peer map's lock so that no AddPeer or RemovePeer of the same id interleaves
    // between the count and the erase (lock order: the engine's, then the tracker's).
    std::lock_guard lock(d.mu);
    auto it = d.peers.find(id);
    if (it == d.peers.end()) return NotFoundError("unknown peer '" + std::string(id) + "'");
    if (d.tracker->TransfersWith(id) != 0) return false;
    peer = it->second;
    d.peers.erase(it);
  }
  d.sink->UnmapPeer(peer->handle);
  MORIIO_RETURN_IF_ERROR(d.backend->DisconnectPeer(peer->handle));
  return true;
}

std::vector<std::string> Engine::Peers() const {
  std::lock_guard lock(impl_->mu);
  std::vector<std::string> out;
  for (const auto& [id, peer] : impl_->peers) out.push_back(id);
  return out;
}

Status Engine::Read(std::string_view transfer_id, std::string_view peer_id,
                    std::span<const std::int64_t> local_blocks,
                    std::span<const std::int64_t> remote_blocks,
                    std::span<const std::string> layer_names) {
  const CallMarks marks;
  Impl& d = *impl_;
  MORIIO_RETURN_IF_ERROR(d.CheckRegistered());
  if (transfer_id.empty()) return InvalidArgumentError("transfer_id must not be empty");
  MORIIO_ASSIGN_OR_RETURN(std::shared_ptr<const Peer> peer, d.FindPeer(peer_id));
  d.backend->ExpectSubmits();  // the backend wakes while the first piece is planned
  const std::string ctx = "transfer '" + std::string(transfer_id) + "'";
  Result<BlockPairs> pairs = BlockPairs::Create(local_blocks, remote_blocks);
  if (!pairs.ok()) return pairs.status().WithContext(ctx);
  trace::Record(trace::Mark::kPairsChecked);
  std::vector<PlannedSegment> planned;
  MORIIO_ASSIGN_OR_RETURN(
      planned.emplace_back(),
      d.PlanSegment(*peer, layer_names,
                    std::make_shared<const BlockPairs>(std::move(pairs).value()), CellWindow{},
                    CellWindow{}, std::nullopt, ctx, /*bare_lookup=*/true));
  trace::Record(trace::Mark::kLayersPlanned);
  return d.StartRead(transfer_id, *peer, planned, ctx);
}

Status Engine::Read(std::string_view transfer_id, std::string_view peer_id,
                    std::span<const BlockSegment> segments) {
  const CallMarks marks;
  Impl& d = *impl_;
  MORIIO_RETURN_IF_ERROR(d.CheckRegistered());
  if (transfer_id.empty()) return InvalidArgumentError("transfer_id must not be empty");
  MORIIO_ASSIGN_OR_RETURN(std::shared_ptr<const Peer> peer, d.FindPeer(peer_id));
  d.backend->ExpectSubmits();
  const std::string ctx = "transfer '" + std::string(transfer_id) + "'";
  std::vector<PlannedSegment> planned;
  planned.reserve(segments.size());
  for (std::size_t k = 0; k < segments.size(); ++k) {
    const BlockSegment& seg = segments[k];
    const std::string where = ctx + " segment " + std::to_string(k);
    Result<BlockPairs> pairs = BlockPairs::Create(seg.local_blocks, seg.remote_blocks);
    if (!pairs.ok()) return pairs.status().WithContext(where);
    MORIIO_ASSIGN_OR_RETURN(
        planned.emplace_back(),
        d.PlanSegment(*peer, seg.layers,
                      std::make_shared<const BlockPairs>(std::move(pairs).value()),
                      seg.local_window, seg.remote_window, std::nullopt, where,
                      /*bare_lookup=*/false));
  }
  MORIIO_RETURN_IF_ERROR(d.CheckDisjointDestinations(*peer, planned, TransferOp::kRead, ctx));
  trace::Record(trace::Mark::kLayersPlanned);
  return d.StartRead(transfer_id, *peer, planned, ctx);
}

Status Engine::Impl::StartRead(std::string_view transfer_id, const Peer& peer,
                               const std::vector<PlannedSegment>& planned,
                               const std::string& ctx) {
  MORIIO_RETURN_IF_ERROR(tracker->BeginRead(transfer_id, peer.id));
  auto add = [&](std::int64_t bytes, std::int64_t runs, BatchShape shape) {
    return tracker->AddBatch(transfer_id, bytes, runs, shape);
  };
  // Fails the open transfer with `why` (a batch that failed at once), so it ends now.
  auto fail = [&](const Status& why) {
    if (Result<std::uint64_t> token = add(0, 0, BatchShape::kRuns); token.ok()) {
      tracker->OnBatchComplete(*token, why.WithContext(ctx));
    }
  };
  try {
    if (Status st = SubmitPlanned(TransferOp::kRead, peer, planned, transfer_id, 0, add); !st.ok()) {
      fail(st);
    }
  } catch (const std::bad_alloc&) {
    // Pieces are planned after the transfer began: end it rather than leave it open until its
    // deadline, then let the caller see the allocation failure.
    fail(AbortedError("out of memory while planning the request"));
    tracker->CloseRead(transfer_id);
    throw;
  }
  tracker->CloseRead(transfer_id);
  return Status::OK();
}

Status Engine::Impl::SubmitPlanned(TransferOp op, const Peer& peer,
                                   const std::vector<PlannedSegment>& planned,
                                   std::string_view transfer_id, std::uint64_t cuda_event,
                                   const AddBatchFn& add) {
  BatchBuilder builder(op, peer, *columns);
  for (const PlannedSegment& seg : planned) {
    for (const SegmentLayer& l : seg.layers) builder.Reserve(layers[l.layer], l.link, *seg.pairs);
  }
  trace::Record(trace::Mark::kPlanned);
  for (const PlannedSegment& seg : planned) {
    for (const SegmentLayer& l : seg.layers) {
      MORIIO_RETURN_IF_ERROR(builder.Add(layers[l.layer], l.link, *seg.pairs));
      if (!Submit(builder.Take(/*all=*/false), transfer_id, cuda_event, add)) return Status::OK();
    }
  }
  Submit(builder.Take(/*all=*/true), transfer_id, cuda_event, add);
  return Status::OK();
}

Result<bool> Engine::WriteLayer(std::string_view transfer_id, std::string_view layer,
                                std::string_view peer_id,
                                std::span<const std::int64_t> local_blocks,
                                std::span<const std::int64_t> remote_blocks,
                                std::uint64_t cuda_event) {
  Impl& d = *impl_;
  // The pairs come first for their cached ids digest: a request's layers write the same ids, so
  // only its first layer digests them. Their refusal waits for the plan, after the checks.
  Result<RecentBlockPairs::Checked> pairs = d.write_pairs.Get(local_blocks, remote_blocks);
  const std::uint64_t ids_digest =
      pairs.ok() ? pairs->ids_digest : DigestOfIds(local_blocks, remote_blocks);
  return d.WriteSegments(
      transfer_id, layer, peer_id, cuda_event, DigestOfWrite(peer_id, ids_digest),
      [&](const Peer& peer, std::size_t i) -> Result<std::vector<PlannedSegment>> {
        if (!pairs.ok()) return pairs.status();
        trace::Record(trace::Mark::kPairsChecked);
        std::vector<PlannedSegment> planned;
        MORIIO_ASSIGN_OR_RETURN(planned.emplace_back(),
                                d.PlanSegment(peer, {}, pairs->pairs, CellWindow{}, CellWindow{},
                                              i, "", /*bare_lookup=*/false));
        return planned;
      });
}

Result<bool> Engine::WriteLayer(std::string_view transfer_id, std::string_view layer,
                                std::string_view peer_id, std::span<const BlockSegment> segments,
                                std::uint64_t cuda_event) {
  Impl& d = *impl_;
  return d.WriteSegments(
      transfer_id, layer, peer_id, cuda_event, DigestOfWrite(peer_id, segments),
      [&](const Peer& peer, std::size_t i) -> Result<std::vector<PlannedSegment>> {
        std::vector<PlannedSegment> planned;
        planned.reserve(segments.size());
        for (std::size_t k = 0; k < segments.size(); ++k) {
          const BlockSegment& seg = segments[k];
          const std::string where = "segment " + std::to_string(k);
          if (!seg.layers.empty()) {
            return InvalidArgumentError(where +
                                        ": a write_layer segment names no layers (the call "
                                        "names the layer)");
          }
          Result<BlockPairs> pairs = BlockPairs::Create(seg.local_blocks, seg.remote_blocks);
          if (!pairs.ok()) return pairs.status().WithContext(where);
          MORIIO_ASSIGN_OR_RETURN(
              planned.emplace_back(),
              d.PlanSegment(peer, {}, std::make_shared<const BlockPairs>(std::move(pairs).value()),
                            seg.local_window, seg.remote_window, i, where,
                            /*bare_lookup=*/false));
        }
        MORIIO_RETURN_IF_ERROR(
            d.CheckDisjointDestinations(peer, planned, TransferOp::kWrite, ""));
        return planned;
      });
}

Result<bool> Engine::Impl::WriteSegments(
    std::string_view transfer_id, std::string_view layer, std::string_view peer_id,
    std::uint64_t cuda_event, std::uint64_t what,
    const std::function<Result<std::vector<PlannedSegment>>(const Peer&, std::size_t)>& plan) {
  const CallMarks marks;
  MORIIO_RETURN_IF_ERROR(CheckRegistered());
  if (transfer_id.empty()) return InvalidArgumentError("transfer_id must not be empty");
  // A repeat of a scheduled write (the same peer, blocks and windows) does nothing, whatever
  // else it carries: answered before the checks, so that one they would refuse (a CUDA event
  // the peer cannot honour) does not fail the transfer it repeats. Another write of a scheduled
  // layer is refused, changing nothing: its blocks would never be written.
  const std::string layer_name(layer);
  MORIIO_ASSIGN_OR_RETURN(
      bool repeat,
      tracker->RepeatsScheduledWrites(transfer_id, std::span<const std::string>(&layer_name, 1),
                                      what));
  if (repeat) return false;
  const std::string ctx = "transfer '" + std::string(transfer_id) + "' layer '" +
                          std::string(layer) + "'";
  auto refuse = [&](const Status& why) { return RefuseWrite(transfer_id, peer_id, why, ctx); };
  Result<std::shared_ptr<const Peer>> peer = FindPeer(peer_id);
  if (!peer.ok()) return refuse(peer.status());
  backend->ExpectSubmits();  // a WRITE's first layer: the backend wakes while it is planned
  Result<std::size_t> i = FindLayer(layer);
  if (!i.ok()) return refuse(i.status());
  if (cuda_event != 0) {
    if (Status st = CheckDeviceWait(**peer, *i); !st.ok()) return refuse(st);
  }
  Result<std::vector<PlannedSegment>> planned = plan(**peer, *i);
  if (!planned.ok()) return refuse(planned.status());
  trace::Record(trace::Mark::kLayersPlanned);
  // One batch per write: cells only when every segment goes as cells of one geometry (all
  // segments share the layer's region pair), else stamped when every segment may (a stamped
  // layer each), runs otherwise.
  bool cells = !planned->empty();
  bool stamps = !planned->empty() && planned->size() <= kMaxStampLayers;
  for (const PlannedSegment& seg : *planned) {
    const LinkPlan& link = seg.layers.front().link;
    const LinkPlan& first = planned->front().layers.front().link;
    cells = cells && link.cells && *link.tmpl->cell_geometry() == *first.tmpl->cell_geometry();
    stamps = stamps && link.stamps;
  }
  trace::Record(trace::Mark::kPlanned);
  BatchBuilder builder(TransferOp::kWrite, **peer, *columns);
  for (const PlannedSegment& seg : *planned) {
    LinkPlan link = seg.layers.front().link;
    link.cells = cells;
    link.stamps = !cells && stamps;
    Status st = builder.Add(layers[*i], link, *seg.pairs);
    if (!st.ok()) return refuse(st);
  }
  std::vector<BatchBuilder::Piece> pieces = builder.Take(/*all=*/true);
  MORIIO_CHECK(pieces.size() <= 1, "one write makes one batch");
  const std::int64_t bytes = pieces.empty() ? 0 : pieces.front().bytes;
  const std::int64_t runs = pieces.empty() ? 0 : pieces.front().runs;
  MORIIO_ASSIGN_OR_RETURN(
      std::optional<std::uint64_t> token,
      tracker->ScheduleWrite(transfer_id, layer, (*peer)->id, bytes, runs,
                             runs == 0 ? BatchShape::kRuns : ShapeOf(*pieces.front().batch),
                             what));
  if (!token) return false;
  if (runs == 0) {
    tracker->OnBatchComplete(*token, Status::OK());  // nothing to move for this layer
    return true;
  }
  // ScheduleWrite already counted the batch: submit it under that token.
  Submit(std::move(pieces), transfer_id, cuda_event,
         [&](std::int64_t, std::int64_t, BatchShape) -> Result<std::uint64_t> { return *token; });
  return true;
}

Result<bool> Engine::WriteLayers(std::string_view transfer_id, std::span<const std::string> names,
                                 std::string_view peer_id,
                                 std::span<const std::int64_t> local_blocks,
                                 std::span<const std::int64_t> remote_blocks,
                                 std::uint64_t cuda_event) {
  const CallMarks marks;
  Impl& d = *impl_;
  MORIIO_RETURN_IF_ERROR(d.CheckRegistered());
  if (transfer_id.empty()) return InvalidArgumentError("transfer_id must not be empty");
  const std::string ctx = "transfer '" + std::string(transfer_id) + "'";
  if (names.empty()) return InvalidArgumentError(ctx + ": write_layers names no layers");
  const std::uint64_t what = DigestOfWrite(peer_id, DigestOfIds(local_blocks, remote_blocks));
  MORIIO_ASSIGN_OR_RETURN(bool repeat, d.tracker->RepeatsScheduledWrites(transfer_id, names, what));
  if (repeat) return false;  // as WriteSegments
  auto refuse = [&](const Status& why, const std::string& context) {
    return d.RefuseWrite(transfer_id, peer_id, why, context);
  };
  Result<std::shared_ptr<const Peer>> peer = d.FindPeer(peer_id);
  if (!peer.ok()) return refuse(peer.status(), ctx);
  d.backend->ExpectSubmits();  // the backend wakes while the layers are planned
  Result<RecentBlockPairs::Checked> pairs = d.write_pairs.Get(local_blocks, remote_blocks);
  if (!pairs.ok()) return refuse(pairs.status(), ctx);
  trace::Record(trace::Mark::kPairsChecked);
  std::vector<PlannedSegment> planned;
  Result<PlannedSegment> segment =
      d.PlanSegment(**peer, names, std::move(pairs->pairs), CellWindow{}, CellWindow{},
                    std::nullopt, "write_layers", /*bare_lookup=*/false);
  if (!segment.ok()) return refuse(segment.status(), ctx);
  planned.push_back(std::move(segment).value());
  if (cuda_event != 0) {
    for (const SegmentLayer& l : planned.front().layers) {
      if (Status st = d.CheckDeviceWait(**peer, l.layer); !st.ok()) {
        return refuse(st, ctx + " layer '" + d.layers[l.layer].layout.name() + "'");
      }
    }
  }
  trace::Record(trace::Mark::kLayersPlanned);
  const std::string id(transfer_id);  // made before the hold: releasing it allocates nothing
  MORIIO_ASSIGN_OR_RETURN(bool began, d.tracker->BeginWrites(id, names, (*peer)->id, what));
  if (!began) return false;
  // The transfer cannot end while its batches are still being added; released on every exit.
  struct WriteHold {
    detail::TransferTracker& tracker;
    const std::string& id;
    ~WriteHold() { tracker.EndWrites(id); }
  } hold{*d.tracker, id};
  auto add = [&](std::int64_t bytes, std::int64_t runs, BatchShape shape) {
    return d.tracker->AddBatch(id, bytes, runs, shape);
  };
  try {
    Status st = d.SubmitPlanned(TransferOp::kWrite, **peer, planned, id, cuda_event, add);
    if (!st.ok()) (void)d.tracker->FailWrite(id, (*peer)->id, st.WithContext(ctx));
  } catch (...) {
    // Every layer is recorded as scheduled: without this the batches added so far could end
    // the transfer done with the others never sent.
    (void)d.tracker->FailWrite(id, (*peer)->id,
                               AbortedError("planning the layers threw (out of memory?)"));
    throw;
  }
  return true;
}

Result<bool> Engine::Seal(std::string_view transfer_id, std::string_view peer,
                          std::int64_t expected_writes) {
  if (transfer_id.empty()) return InvalidArgumentError("transfer_id must not be empty");
  if (peer.empty()) {
    return InvalidArgumentError("transfer '" + std::string(transfer_id) +
                                "': seal needs the peer the transfer writes to");
  }
  // A seal that ends a transfer already made (or one the peer's removal ended) needs no
  // connected peer; one that would start it does. Looked up and sealed under the peer map's
  // lock (then the tracker's: the engine's lock order), so a removal lands wholly before the
  // seal (which then starts nothing) or after it (and ends what it started).
  Impl& d = *impl_;
  std::lock_guard lock(d.mu);
  // Each (transfer, layer) counts once, so more writes than layers could never all come: the
  // transfer would only end timed out, its peer waiting out the whole timeout.
  if (expected_writes > static_cast<std::int64_t>(d.layers.size())) {
    return InvalidArgumentError("transfer '" + std::string(transfer_id) + "': seal for " +
                                std::to_string(expected_writes) + " writes, but " +
                                std::to_string(d.layers.size()) +
                                " layers are registered and each layer is written once");
  }
  const bool connected = d.peers.find(peer) != d.peers.end();
  return d.tracker->Seal(transfer_id, peer, expected_writes, connected);
}

Status Engine::Abort(std::string_view transfer_id) { return impl_->tracker->Abort(transfer_id); }

std::vector<TransferEvent> Engine::PollEvents(std::size_t max_events,
                                              std::chrono::milliseconds wait) {
  if (max_events == 0) return {};
  // Deadlines are checked in slices so a wait never sleeps past one. A day bounds "forever" so
  // now + wait cannot overflow.
  constexpr std::chrono::milliseconds kSlice{10};
  const auto until =
      std::chrono::steady_clock::now() + std::clamp(wait, std::chrono::milliseconds(0),
                                                    std::chrono::milliseconds(86'400'000));
  while (true) {
    impl_->tracker->ExpireDeadlines(std::chrono::steady_clock::now());
    const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(
        until - std::chrono::steady_clock::now());
    std::vector<TransferEvent> events =
        impl_->tracker->Drain(max_events, std::clamp(left, std::chrono::milliseconds(0), kSlice));
    if (!events.empty() || std::chrono::steady_clock::now() >= until) return events;
  }
}

Result<MemoryRange> Engine::AllocateBacking(std::uint64_t size, MemoryKind kind, int device) {
  Impl& d = *impl_;
  if (!d.backend->capabilities().allocation) {
    return FailedPreconditionError("backend '" + d.config.backend + "' does not allocate memory");
  }
  MORIIO_ASSIGN_OR_RETURN(MemoryRange range, d.backend->Allocate(size, kind, device));
  std::lock_guard lock(d.mu);
  d.allocations[range.address] = range;
  return range;
}

Status Engine::FreeBacking(std::uint64_t address) {
  Impl& d = *impl_;
  MemoryRange range;
  {
    std::lock_guard lock(d.mu);
    auto it = d.allocations.find(address);
    if (it == d.allocations.end()) {
      return NotFoundError("no backing allocated by this engine at " + std::to_string(address));
    }
    if (d.registering) {
      return FailedPreconditionError("KV caches are being registered; free the backing after");
    }
    if (d.registered) {
      for (const LocalRegion& r : d.regions) {
        if (r.range.address >= address && r.range.address < address + it->second.size) {
          return FailedPreconditionError("the backing at " + std::to_string(address) +
                                         " holds registered KV caches");
        }
      }
    }
    range = it->second;
  }
  MORIIO_RETURN_IF_ERROR(d.backend->Free(range));
  std::lock_guard lock(d.mu);
  d.allocations.erase(address);
  return Status::OK();
}

std::vector<DrainedTransfer> Engine::PollDrained(std::size_t max_transfers) {
  return impl_->tracker->DrainQuarantine(max_transfers);
}

std::size_t Engine::PendingTransfers() const { return impl_->tracker->pending(); }

std::size_t Engine::QuarantinedTransfers() const { return impl_->tracker->quarantined(); }

}  // namespace moriio_native
