// Windowed block templates (BlockTemplate::Build with CellWindows): a head range (heterogeneous
// TP) or a token range (different block sizes) of one side's block against the other's.
//
// The reference is independent of the layout engine: every cell's byte offset is computed from
// the tensor's own index tuple and strides (Cache::Offset below), and the expected destination
// is built by copying cell by cell. The template's run plan (and the cell copy, where the pair
// has a cell geometry) must produce exactly those bytes: every cell of the window, nothing
// outside it (both buffers start random, so a stray byte shows).
// Units: strides are elements, offsets bytes; every cache is bf16.

#include <gtest/gtest.h>

#include <cstddef>
#include <cstdint>
#include <cstring>
#include <limits>
#include <optional>
#include <string>
#include <vector>

#include "moriio_native/layout.hpp"
#include "plan_support.hpp"

namespace moriio_native {
namespace {

using Ids = std::vector<std::int64_t>;
using test_support::ApplyPlan;
using test_support::RandomBytes;
constexpr std::int64_t kElem = 2;

// The layout families vLLM ships (DESIGN 3.1), as tensor shapes.
enum class Family {
  kSeparatedNhd,    // [2,N,B,H,D]
  kSeparatedHnd,    // [2,N,H,B,D]
  kInterleavedNhd,  // [N,2,B,H,D]
  kInterleavedHnd,  // [N,2,H,B,D]
  kPacked,          // standardized [N,H,B,2D], contiguous
  kPackedNbhc,      // standardized [N,H,B,2D], memory order N,B,H,C
  kLatent,          // [N,B,D]
};

const char* FamilyName(Family f) {
  switch (f) {
    case Family::kSeparatedNhd: return "separated_nhd";
    case Family::kSeparatedHnd: return "separated_hnd";
    case Family::kInterleavedNhd: return "interleaved_nhd";
    case Family::kInterleavedHnd: return "interleaved_hnd";
    case Family::kPacked: return "packed";
    case Family::kPackedNbhc: return "packed_nbhc";
    case Family::kLatent: return "latent";
  }
  return "?";
}

constexpr Family kKvFamilies[] = {Family::kSeparatedNhd, Family::kSeparatedHnd,
                                  Family::kInterleavedNhd, Family::kInterleavedHnd,
                                  Family::kPacked, Family::kPackedNbhc};

// A cache tensor of one family: its shape and strides, and the layout the engine reads from it.
struct Cache {
  Family family;
  std::int64_t blocks, block_size, heads, d, kb;
  std::vector<std::int64_t> shape, strides;
  std::optional<LayerLayout> layout;

  int planes() const { return family == Family::kLatent ? 1 : 2; }
  std::int64_t cell_bytes() const { return d * kElem; }

  // Byte offset of cell (plane p, head h, token t) of manager block b, from the index tuple.
  std::int64_t Offset(int p, std::int64_t h, std::int64_t t, std::int64_t b) const {
    const std::int64_t n = b * (block_size / kb) + t / kb;
    const std::int64_t k = t % kb;
    std::vector<std::int64_t> idx;
    switch (family) {
      case Family::kSeparatedNhd: idx = {p, n, k, h, 0}; break;
      case Family::kSeparatedHnd: idx = {p, n, h, k, 0}; break;
      case Family::kInterleavedNhd: idx = {n, p, k, h, 0}; break;
      case Family::kInterleavedHnd: idx = {n, p, h, k, 0}; break;
      case Family::kPacked:
      case Family::kPackedNbhc: idx = {n, h, k, p * d}; break;
      case Family::kLatent: idx = {n, k, 0}; break;
    }
    std::int64_t off = 0;
    for (std::size_t i = 0; i < idx.size(); ++i) off += idx[i] * strides[i];
    return off * kElem;
  }
};

// Row-major strides of `shape` taken in `order` (outermost first), with `pad` extra elements on
// the stride of axis `padded` (a padded page: block stride larger than the block).
std::vector<std::int64_t> Strides(const std::vector<std::int64_t>& shape,
                                  const std::vector<int>& order, int padded, std::int64_t pad) {
  std::vector<std::int64_t> strides(shape.size());
  std::int64_t s = 1;
  for (std::size_t i = order.size(); i-- > 0;) {
    const int axis = order[i];
    strides[axis] = s + (axis == padded ? pad : 0);
    s = strides[axis] * shape[axis];
  }
  return strides;
}

Cache MakeCache(const std::string& name, Family f, std::int64_t blocks, std::int64_t block_size,
                std::int64_t heads, std::int64_t d, std::int64_t kb = 0, std::int64_t pad = 0) {
  Cache c{f, blocks, block_size, f == Family::kLatent ? 1 : heads, d, kb ? kb : block_size, {}, {},
          std::nullopt};
  const std::int64_t n = blocks * (block_size / c.kb);
  CacheSpec spec;
  spec.kind = f == Family::kLatent ? CacheKind::kLatent : CacheKind::kKeyValue;
  spec.block_size = block_size;
  spec.num_kv_heads = c.heads;
  spec.head_size = d;
  spec.dtype_bytes = kElem;
  KvPlaneAxis plane = KvPlaneAxis::kAuto;
  switch (f) {
    case Family::kSeparatedNhd:
      c.shape = {2, n, c.kb, heads, d};
      c.strides = Strides(c.shape, {0, 1, 2, 3, 4}, 1, pad);
      spec.axis_order = AxisOrder::kNhd;
      plane = KvPlaneAxis::kSeparated;
      break;
    case Family::kSeparatedHnd:
      c.shape = {2, n, heads, c.kb, d};
      c.strides = Strides(c.shape, {0, 1, 2, 3, 4}, 1, pad);
      spec.axis_order = AxisOrder::kHnd;
      plane = KvPlaneAxis::kSeparated;
      break;
    case Family::kInterleavedNhd:
      c.shape = {n, 2, c.kb, heads, d};
      c.strides = Strides(c.shape, {0, 1, 2, 3, 4}, 0, pad);
      spec.axis_order = AxisOrder::kNhd;
      plane = KvPlaneAxis::kInterleaved;
      break;
    case Family::kInterleavedHnd:
      c.shape = {n, 2, heads, c.kb, d};
      c.strides = Strides(c.shape, {0, 1, 2, 3, 4}, 0, pad);
      spec.axis_order = AxisOrder::kHnd;
      plane = KvPlaneAxis::kInterleaved;
      break;
    case Family::kPacked:
      c.shape = {n, heads, c.kb, 2 * d};
      c.strides = Strides(c.shape, {0, 1, 2, 3}, 0, pad);
      spec.axis_order = AxisOrder::kHnd;
      break;
    case Family::kPackedNbhc:
      c.shape = {n, heads, c.kb, 2 * d};
      c.strides = Strides(c.shape, {0, 2, 1, 3}, 0, pad);
      spec.axis_order = AxisOrder::kHnd;
      break;
    case Family::kLatent:
      c.shape = {n, c.kb, d};
      c.strides = Strides(c.shape, {0, 1, 2}, 0, pad);
      break;
  }
  Result<LayerLayout> layout =
      DescribeLayer(name, TensorGeometry{c.shape, c.strides, kElem, 0}, spec, plane);
  EXPECT_TRUE(layout.ok()) << FamilyName(f) << ": " << layout.status().ToString();
  if (layout.ok()) c.layout = std::move(layout).value();
  return c;
}

struct Window {
  std::int64_t head_begin, heads, token_begin, tokens;
};

// The window's numbers, resolved here by hand (not by the code under test).
Window Numbers(const CellWindow& w, const Cache& c) {
  return {w.head_begin, w.heads.value_or(c.heads - w.head_begin), w.token_begin,
          w.tokens.value_or(c.block_size - w.token_begin)};
}

// Builds the windowed template and requires its run plan (and its cell copy, when it has a
// geometry) to move exactly the window's cells, in both directions. Returns whether the pair
// had a cell geometry.
bool ExpectWindowCopy(const Cache& local, const CellWindow& lwin, const Cache& remote,
                      const CellWindow& rwin, const Ids& local_ids, const Ids& remote_ids) {
  const std::string what = std::string(FamilyName(local.family)) + " <- " +
                           FamilyName(remote.family) + " local " +
                           DescribeWindow(lwin, *local.layout) + " remote " +
                           DescribeWindow(rwin, *remote.layout);
  SCOPED_TRACE(what);
  Result<BlockTemplate> built = BlockTemplate::Build(*local.layout, lwin, *remote.layout, rwin);
  EXPECT_TRUE(built.ok()) << built.status().ToString();
  if (!built.ok()) return false;
  const BlockTemplate& tmpl = *built;
  Result<BlockPairs> pairs = BlockPairs::Create(local_ids, remote_ids);
  EXPECT_TRUE(pairs.ok());
  CopyPlan plan;
  const Status st = StampBlockCopies(tmpl, *pairs, &plan);
  EXPECT_TRUE(st.ok()) << st.ToString();
  const Window lw = Numbers(lwin, local);
  const Window rw = Numbers(rwin, remote);
  EXPECT_EQ(plan.total_bytes(), static_cast<std::int64_t>(local_ids.size()) * local.planes() *
                                    lw.heads * lw.tokens * local.cell_bytes());
  std::optional<BlockOffsets> offsets;
  if (tmpl.cell_geometry()) {
    offsets.emplace();
    EXPECT_TRUE(AppendBlockOffsets(tmpl, *pairs, 0, 0, &*offsets).ok());
  }
  for (CellCopyDirection dir :
       {CellCopyDirection::kRemoteToLocal, CellCopyDirection::kLocalToRemote}) {
    const bool into_local = dir == CellCopyDirection::kRemoteToLocal;
    const std::vector<std::byte> local0 = RandomBytes(local.layout->span_bytes(), 11);
    const std::vector<std::byte> remote0 = RandomBytes(remote.layout->span_bytes(), 12);
    // Reference: cell by cell from the index tuples.
    std::vector<std::byte> want_local = local0;
    std::vector<std::byte> want_remote = remote0;
    for (std::size_t i = 0; i < local_ids.size(); ++i) {
      for (int p = 0; p < local.planes(); ++p) {
        for (std::int64_t h = 0; h < lw.heads; ++h) {
          for (std::int64_t t = 0; t < lw.tokens; ++t) {
            const std::int64_t lo =
                local.Offset(p, lw.head_begin + h, lw.token_begin + t, local_ids[i]);
            const std::int64_t ro =
                remote.Offset(p, rw.head_begin + h, rw.token_begin + t, remote_ids[i]);
            const auto n = static_cast<std::size_t>(local.cell_bytes());
            if (into_local) {
              std::memcpy(want_local.data() + lo, remote0.data() + ro, n);
            } else {
              std::memcpy(want_remote.data() + ro, local0.data() + lo, n);
            }
          }
        }
      }
    }
    std::vector<std::byte> got_local = local0;
    std::vector<std::byte> got_remote = remote0;
    ApplyPlan(plan, got_local.data(), got_remote.data(), dir);
    EXPECT_TRUE(got_local == want_local) << "run plan, local side";
    EXPECT_TRUE(got_remote == want_remote) << "run plan, remote side";
    if (offsets) {
      std::vector<std::byte> cells_local = local0;
      std::vector<std::byte> cells_remote = remote0;
      CopyBlockCells(*tmpl.cell_geometry(), *offsets, cells_local.data(), cells_remote.data(),
                     dir);
      EXPECT_TRUE(cells_local == want_local) << "cell copy, local side";
      EXPECT_TRUE(cells_remote == want_remote) << "cell copy, remote side";
    }
  }
  return offsets.has_value();
}

CellWindow Heads(std::int64_t begin, std::optional<std::int64_t> count) {
  return CellWindow{begin, count, 0, std::nullopt};
}

CellWindow Tokens(std::int64_t begin, std::optional<std::int64_t> count) {
  return CellWindow{0, std::nullopt, begin, count};
}

bool Contains(const std::string& haystack, const std::string& needle) {
  return haystack.find(needle) != std::string::npos;
}

// Decode at TP 2 reads its half of an 8-head prefill layer: heads [4,8) of every remote block
// into the whole of a 4-head local block; every family against every family, padded pages and
// kernel blocks included.
TEST(WindowTest, HeadSliceEveryFamilyPair) {
  for (Family lf : kKvFamilies) {
    for (Family rf : kKvFamilies) {
      for (std::int64_t pad : {0, 6}) {
        const Cache local = MakeCache("attn.0", lf, 5, 4, 4, 2, 0, pad);
        const Cache remote = MakeCache("attn.0", rf, 7, 4, 8, 2, 2, pad);
        ASSERT_TRUE(local.layout && remote.layout);
        ExpectWindowCopy(local, {}, remote, Heads(4, std::nullopt), {0, 3, 2}, {6, 1, 4});
        ExpectWindowCopy(local, Heads(1, 2), remote, Heads(5, 2), {4, 1}, {0, 5});
      }
    }
  }
}

// Decode at TP 1 gathers two prefill ranks' 4 heads each into heads [0,4) and [4,8) of its
// 8-head blocks.
TEST(WindowTest, GatherIntoOffsetHeadWindowEveryFamilyPair) {
  for (Family lf : kKvFamilies) {
    for (Family rf : kKvFamilies) {
      const Cache local = MakeCache("attn.0", lf, 4, 4, 8, 2);
      const Cache remote = MakeCache("attn.0", rf, 6, 4, 4, 2);
      ASSERT_TRUE(local.layout && remote.layout);
      ExpectWindowCopy(local, Heads(0, 4), remote, {}, {1, 3}, {5, 0});
      ExpectWindowCopy(local, Heads(4, std::nullopt), remote, Heads(0, 4), {1, 3}, {2, 4});
    }
  }
}

// Prefill 16-token blocks into one 64-token decode block (token windows 0/16/32/48) and back,
// with kernel blocks of 16 inside the 64-token block on either side.
TEST(WindowTest, TokenWindowsBetweenBlockSizesEveryFamilyPair) {
  for (Family lf : kKvFamilies) {
    for (Family rf : kKvFamilies) {
      for (std::int64_t kb : {64, 16}) {
        const Cache big = MakeCache("attn.0", lf, 3, 64, 2, 2, kb);
        const Cache small = MakeCache("attn.0", rf, 9, 16, 2, 2);
        ASSERT_TRUE(big.layout && small.layout);
        for (std::int64_t q = 0; q < 4; ++q) {
          ExpectWindowCopy(big, Tokens(16 * q, 16), small, {}, {2, 0}, {q, 4 + q});
          ExpectWindowCopy(small, {}, big, Tokens(16 * q, 16), {4 + q, q}, {1, 2});
        }
      }
    }
  }
}

TEST(WindowTest, LatentTokenWindowsWithPadding) {
  const Cache big = MakeCache("mla.0", Family::kLatent, 3, 64, 1, 6, 16, 10);
  const Cache small = MakeCache("mla.0", Family::kLatent, 9, 16, 1, 6, 0, 4);
  ASSERT_TRUE(big.layout && small.layout);
  for (std::int64_t q = 0; q < 4; ++q) {
    ExpectWindowCopy(big, Tokens(16 * q, 16), small, {}, {2, 1}, {q, 8 - q});
    ExpectWindowCopy(small, {}, big, Tokens(16 * q, 16), {q, 8 - q}, {2, 0});
  }
  // A latent block has one head: a head window other than [0,1) leaves it.
  Result<BlockTemplate> t = BlockTemplate::Build(*big.layout, Heads(1, 1), *small.layout, {});
  EXPECT_EQ(t.status().code(), StatusCode::kInvalidArgument) << t.status().ToString();
}

TEST(WindowTest, HeadAndTokenWindowTogether) {
  const Cache local = MakeCache("attn.0", Family::kSeparatedNhd, 3, 64, 4, 2, 16);
  const Cache remote = MakeCache("attn.0", Family::kInterleavedHnd, 5, 16, 8, 2);
  ASSERT_TRUE(local.layout && remote.layout);
  ExpectWindowCopy(local, CellWindow{0, std::nullopt, 32, 16}, remote, Heads(4, 4), {1, 2},
                   {3, 0});
}

// Whole windows (given or left open) are the pair's ordinary template.
TEST(WindowTest, WholeWindowsEqualTheWholeTemplate) {
  for (Family lf : kKvFamilies) {
    for (Family rf : kKvFamilies) {
      const Cache local = MakeCache("attn.0", lf, 4, 4, 2, 2);
      const Cache remote = MakeCache("attn.0", rf, 4, 4, 2, 2, 2);
      ASSERT_TRUE(local.layout && remote.layout);
      Result<BlockTemplate> whole = BlockTemplate::Build(*local.layout, *remote.layout);
      ASSERT_TRUE(whole.ok());
      for (const CellWindow& w : {CellWindow{}, CellWindow{0, 2, 0, 4}}) {
        Result<BlockTemplate> win = BlockTemplate::Build(*local.layout, w, *remote.layout, w);
        ASSERT_TRUE(win.ok()) << win.status().ToString();
        ASSERT_EQ(win->runs().size(), whole->runs().size());
        for (std::size_t i = 0; i < whole->runs().size(); ++i) {
          EXPECT_EQ(win->runs()[i].local, whole->runs()[i].local);
          EXPECT_EQ(win->runs()[i].remote, whole->runs()[i].remote);
          EXPECT_EQ(win->runs()[i].size, whole->runs()[i].size);
        }
        EXPECT_EQ(win->cell_geometry(), whole->cell_geometry());
        EXPECT_EQ(win->local_cell_origin(), 0);
        EXPECT_EQ(win->remote_cell_origin(), 0);
      }
    }
  }
}

// The head slice of NHD against HND keeps a cell grid: the transposing copy serves it, with the
// window's origin in the block offsets. Local [2,N,B,H,D] = [2,4,4,4,2] (4 heads; bytes: token
// 16, head 4, block 64, plane 256); remote [N,2,H,B,D] = [6,2,8,4,2] (8 heads; bytes: token 4,
// head 16, plane 128, block 256). Heads [4,8) of the remote block start at 4*16 = 64 bytes.
TEST(WindowTest, HeadSliceOfNhdAgainstHndHasACellGrid) {
  const Cache local = MakeCache("attn.0", Family::kSeparatedNhd, 4, 4, 4, 2);
  const Cache remote = MakeCache("attn.0", Family::kInterleavedHnd, 6, 4, 8, 2);
  Result<BlockTemplate> t =
      BlockTemplate::Build(*local.layout, {}, *remote.layout, Heads(4, std::nullopt));
  ASSERT_TRUE(t.ok()) << t.status().ToString();
  ASSERT_TRUE(t->cell_geometry().has_value());
  const CellGeometry& g = *t->cell_geometry();
  EXPECT_EQ(g.planes, 2);
  EXPECT_EQ(g.heads, 4);
  EXPECT_EQ(g.tokens, 4);
  EXPECT_EQ(g.cell_bytes, 4);
  EXPECT_EQ(g.local, (CellSide{64, 256, 4, 16}));
  EXPECT_EQ(g.remote, (CellSide{256, 128, 16, 4}));
  EXPECT_EQ(t->local_cell_origin(), 0);
  EXPECT_EQ(t->remote_cell_origin(), 64);
  EXPECT_TRUE(t->prefers_cell_copy());
  Result<BlockPairs> pairs = BlockPairs::Create(Ids{1, 3}, Ids{5, 2});
  ASSERT_TRUE(pairs.ok());
  BlockOffsets blocks;
  ASSERT_TRUE(AppendBlockOffsets(*t, *pairs, 1000, 2000, &blocks).ok());
  EXPECT_EQ(blocks.local, (Ids{1000 + 64, 1000 + 192}));
  EXPECT_EQ(blocks.remote, (Ids{2000 + 64 + 5 * 256, 2000 + 64 + 2 * 256}));
  EXPECT_TRUE(ExpectWindowCopy(local, {}, remote, Heads(4, std::nullopt), {1, 3}, {5, 2}));
}

// A token window inside one kernel block keeps a grid even where kernel blocks break the token
// stride (heads before tokens: [2,N,H,B,D] with B = 16 inside a 64-token block); one that
// spans two kernel blocks there has none, and is moved by runs.
TEST(WindowTest, TokenWindowInsideOneKernelBlockHasACellGrid) {
  const Cache big = MakeCache("attn.0", Family::kSeparatedHnd, 3, 64, 2, 2, 16);
  const Cache small = MakeCache("attn.0", Family::kSeparatedNhd, 9, 16, 2, 2);
  const Cache mid = MakeCache("attn.0", Family::kSeparatedNhd, 9, 32, 2, 2);
  EXPECT_TRUE(ExpectWindowCopy(big, Tokens(16, 16), small, {}, {2, 0}, {1, 7}));
  EXPECT_FALSE(ExpectWindowCopy(big, Tokens(16, 32), mid, {}, {2, 0}, {1, 7}));
  Result<BlockTemplate> whole = BlockTemplate::Build(*big.layout, *big.layout);
  ASSERT_TRUE(whole.ok());
  EXPECT_FALSE(whole->cell_geometry().has_value());
}

TEST(WindowTest, DescribeWindowAndResolveWindow) {
  const Cache c = MakeCache("attn.3", Family::kSeparatedNhd, 2, 64, 8, 2);
  EXPECT_EQ(DescribeWindow({}, *c.layout), "heads [0,8) of 8, tokens [0,64) of 64");
  EXPECT_EQ(DescribeWindow(CellWindow{2, 2, 16, std::nullopt}, *c.layout),
            "heads [2,4) of 8, tokens [16,64) of 64");
  Result<ResolvedWindow> r = ResolveWindow(CellWindow{2, 2, 16, std::nullopt}, *c.layout);
  ASSERT_TRUE(r.ok());
  EXPECT_EQ(*r, (ResolvedWindow{2, 2, 16, 48}));
  EXPECT_TRUE(r->Overlaps(ResolvedWindow{3, 5, 0, 17}));
  EXPECT_FALSE(r->Overlaps(ResolvedWindow{4, 4, 0, 64}));
  EXPECT_FALSE(r->Overlaps(ResolvedWindow{0, 8, 0, 16}));
  struct Bad {
    CellWindow w;
    const char* shown;
  };
  for (const Bad& b : {Bad{{6, 4, 0, std::nullopt}, "heads [6,10) of 8"},
                       Bad{{-1, 2, 0, std::nullopt}, "heads [-1,1) of 8"},
                       Bad{{-3, std::nullopt, 0, std::nullopt}, "heads [-3,8) of 8"},
                       Bad{{8, std::nullopt, 0, std::nullopt}, "heads [8,8) of 8"},
                       Bad{{0, 0, 0, std::nullopt}, "heads [0,0) of 8"},
                       Bad{{0, std::nullopt, 48, 32}, "tokens [48,80) of 64"},
                       Bad{{0, std::nullopt, 0, -4}, "tokens [0,-4) of 64"},
                       Bad{{0, std::numeric_limits<std::int64_t>::max(), 0, std::nullopt},
                           "heads [0,"}}) {
    Result<ResolvedWindow> bad = ResolveWindow(b.w, *c.layout);
    ASSERT_FALSE(bad.ok()) << b.shown;
    EXPECT_EQ(bad.status().code(), StatusCode::kInvalidArgument);
    EXPECT_TRUE(Contains(bad.status().message(), "attn.3")) << bad.status().ToString();
    EXPECT_TRUE(Contains(bad.status().message(), b.shown)) << bad.status().ToString();
  }
}

TEST(WindowTest, RefusalsNameBothLayersTheWindowsAndWhatDiffers) {
  const Cache p8 = MakeCache("attn.0", Family::kSeparatedNhd, 4, 16, 8, 2);
  const Cache d4 = MakeCache("attn.0.d", Family::kSeparatedHnd, 4, 16, 4, 2);
  const Cache d4_wide = MakeCache("attn.0.w", Family::kSeparatedHnd, 4, 16, 4, 4);
  const Cache big = MakeCache("attn.0.b", Family::kSeparatedNhd, 4, 64, 4, 2);
  const Cache mla = MakeCache("mla.0", Family::kLatent, 4, 16, 1, 4);
  struct Case {
    const Cache* local;
    CellWindow lw;
    const Cache* remote;
    CellWindow rw;
    StatusCode code;
    std::vector<std::string> says;
  };
  const std::vector<Case> cases = {
      {&d4, {}, &p8, {}, StatusCode::kIncompatible,
       {"attn.0.d", "attn.0", "heads [0,4) of 4", "heads [0,8) of 8", "4 and 8 heads"}},
      {&d4, Heads(0, 2), &p8, Heads(2, 3), StatusCode::kIncompatible, {"2 and 3 heads"}},
      {&d4_wide, {}, &p8, Heads(4, 4), StatusCode::kIncompatible,
       {"attn.0.w", "K bytes per head and token 8 vs 4"}},
      {&big, Tokens(0, 32), &d4, {}, StatusCode::kIncompatible,
       {"tokens [0,32) of 64", "tokens [0,16) of 16", "32 and 16 tokens"}},
      {&mla, {}, &d4, {}, StatusCode::kIncompatible, {"mla.0", "kind mla vs kv"}},
      {&d4, {}, &p8, Heads(6, 4), StatusCode::kInvalidArgument,
       {"remote", "attn.0", "heads [6,10) of 8", "leaves the block"}},
      {&big, Tokens(60, 16), &d4, {}, StatusCode::kInvalidArgument,
       {"attn.0.b", "tokens [60,76) of 64"}},
  };
  for (const Case& c : cases) {
    Result<BlockTemplate> t = BlockTemplate::Build(*c.local->layout, c.lw, *c.remote->layout, c.rw);
    ASSERT_FALSE(t.ok()) << c.says.front();
    EXPECT_EQ(t.status().code(), c.code) << t.status().ToString();
    for (const std::string& s : c.says) {
      EXPECT_TRUE(Contains(t.status().message(), s)) << s << " in " << t.status().ToString();
    }
  }
  // Different dtypes: the same tensor shape read as bf16 and as fp32 cells.
  CacheSpec spec;
  spec.block_size = 16;
  spec.num_kv_heads = 4;
  spec.head_size = 2;
  spec.dtype_bytes = 4;
  spec.axis_order = AxisOrder::kHnd;
  Result<LayerLayout> fp32 = DescribeLayer(
      "attn.0.f", TensorGeometry{d4.shape, d4.strides, 4, 0}, spec, KvPlaneAxis::kSeparated);
  ASSERT_TRUE(fp32.ok()) << fp32.status().ToString();
  Result<BlockTemplate> t = BlockTemplate::Build(*fp32, {}, *p8.layout, Heads(4, 4));
  EXPECT_EQ(t.status().code(), StatusCode::kIncompatible);
  EXPECT_TRUE(Contains(t.status().message(), "dtype_bytes 4 vs 2")) << t.status().ToString();
  // The whole-block Build keeps its message.
  Result<BlockTemplate> whole = BlockTemplate::Build(*d4.layout, *p8.layout);
  EXPECT_EQ(whole.status().code(), StatusCode::kIncompatible);
  EXPECT_TRUE(Contains(whole.status().message(), "hold different content"))
      << whole.status().ToString();
}

}  // namespace
}  // namespace moriio_native
