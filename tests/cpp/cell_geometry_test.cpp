// The cell geometry of a layer pair (BlockTemplate::cell_geometry) and the CPU reference of a
// cell copy (CopyBlockCells): the grid is derived by hand for a worked example, and for every
// layout pair family the reference must move exactly the bytes the pair's run plan moves, no
// more (bytes outside the cells stay as they were) and no fewer. The GPU kernel is checked
// against the same plans in tests/py/test_cudacopy.py.
// Units: strides in geometries are elements; offsets and strides in results are bytes (bf16).

#include <gtest/gtest.h>

#include <cstddef>
#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

#include "moriio_native/layout.hpp"
#include "plan_support.hpp"
#include "strides.hpp"

namespace moriio_native {
namespace {

using Ids = std::vector<std::int64_t>;

using test_support::ApplyPlan;
using test_support::Contiguous;
using test_support::RandomBytes;

CacheSpec Spec(std::int64_t block_size, std::int64_t heads, std::int64_t head_size,
               AxisOrder order = AxisOrder::kAuto) {
  CacheSpec s;
  s.block_size = block_size;
  s.num_kv_heads = heads;
  s.head_size = head_size;
  s.dtype_bytes = 2;
  s.axis_order = order;
  return s;
}

LayerLayout Layer(const std::string& name, std::vector<std::int64_t> shape, const CacheSpec& spec,
                  std::vector<std::int64_t> strides = {}) {
  if (strides.empty()) strides = Contiguous(shape);
  Result<LayerLayout> r = DescribeLayer(name, TensorGeometry{shape, strides, 2, 0}, spec);
  EXPECT_TRUE(r.ok()) << r.status().ToString();
  return std::move(r).value();
}

BlockTemplate Template(const LayerLayout& local, const LayerLayout& remote) {
  Result<BlockTemplate> t = BlockTemplate::Build(local, remote);
  EXPECT_TRUE(t.ok()) << t.status().ToString();
  return std::move(t).value();
}

BlockPairs Pairs(const Ids& local, const Ids& remote) {
  Result<BlockPairs> p = BlockPairs::Create(local, remote);
  EXPECT_TRUE(p.ok()) << p.status().ToString();
  return std::move(p).value();
}

// Moves `pairs` between two random buffers once by the run plan and once by CopyBlockCells, in
// both directions, and requires byte-identical results.
void ExpectCellCopyEqualsRunPlan(const LayerLayout& local, const LayerLayout& remote,
                                 const Ids& local_ids, const Ids& remote_ids) {
  const BlockTemplate tmpl = Template(local, remote);
  ASSERT_TRUE(tmpl.cell_geometry().has_value()) << local.name() << " / " << remote.name();
  const BlockPairs pairs = Pairs(local_ids, remote_ids);
  CopyPlan plan;
  ASSERT_TRUE(StampBlockCopies(tmpl, pairs, &plan).ok());
  BlockOffsets blocks;
  ASSERT_TRUE(AppendBlockOffsets(tmpl, pairs, 0, 0, &blocks).ok());
  ASSERT_EQ(blocks.size(), local_ids.size());
  EXPECT_EQ(tmpl.cell_geometry()->block_bytes(), local.block_bytes());
  for (CellCopyDirection dir :
       {CellCopyDirection::kRemoteToLocal, CellCopyDirection::kLocalToRemote}) {
    std::vector<std::byte> by_runs_local = RandomBytes(local.span_bytes(), 1);
    std::vector<std::byte> by_runs_remote = RandomBytes(remote.span_bytes(), 2);
    std::vector<std::byte> by_cells_local = by_runs_local;
    std::vector<std::byte> by_cells_remote = by_runs_remote;
    ApplyPlan(plan, by_runs_local.data(), by_runs_remote.data(), dir);
    CopyBlockCells(*tmpl.cell_geometry(), blocks, by_cells_local.data(), by_cells_remote.data(),
                   dir);
    EXPECT_EQ(by_cells_local, by_runs_local) << local.name() << " -> " << remote.name();
    EXPECT_EQ(by_cells_remote, by_runs_remote) << local.name() << " -> " << remote.name();
  }
}

// Local (prefill) [2,N,B,H,D] = [2,8,4,2,3] NHD, strides [192,24,6,3,1] elements -> bytes:
// plane 384, block 48, token 12, head 6. Remote (decode) [N,2,H,B,D] = [16,2,2,4,3] HND,
// strides [48,24,12,3,1] -> bytes: block 96, plane 48, head 24, token 6. A cell is one head of
// one token, 3 * 2 = 6 bytes; no two neighbouring cells of one side are neighbours on the
// other, so the run plan has one 6-byte run per cell: 2 planes * 2 heads * 4 tokens = 16.
TEST(CellGeometryTest, NhdSeparatedAgainstHndInterleavedWorkedExample) {
  const LayerLayout local = Layer("prefill.0", {2, 8, 4, 2, 3}, Spec(4, 2, 3));
  const LayerLayout remote = Layer("decode.0", {16, 2, 2, 4, 3}, Spec(4, 2, 3));
  const BlockTemplate tmpl = Template(local, remote);
  EXPECT_EQ(tmpl.runs().size(), 16u);
  ASSERT_TRUE(tmpl.cell_geometry().has_value());
  const CellGeometry& g = *tmpl.cell_geometry();
  EXPECT_EQ(g.planes, 2);
  EXPECT_EQ(g.heads, 2);
  EXPECT_EQ(g.tokens, 4);
  EXPECT_EQ(g.cell_bytes, 6);
  EXPECT_EQ(g.local, (CellSide{48, 384, 6, 12}));
  EXPECT_EQ(g.remote, (CellSide{96, 48, 24, 6}));
  EXPECT_TRUE(tmpl.prefers_cell_copy());
  // Block offsets in local id order: local 1 -> remote 4, local 3 -> remote 5 (ids given
  // unsorted): (1*48, 4*96) = (48, 384), (3*48, 5*96) = (144, 480), shifted by (1000, 7).
  BlockOffsets blocks;
  ASSERT_TRUE(AppendBlockOffsets(tmpl, Pairs({3, 1}, {5, 4}), 1000, 7, &blocks).ok());
  EXPECT_EQ(blocks.local, (Ids{1048, 1144}));
  EXPECT_EQ(blocks.remote, (Ids{391, 487}));
  ExpectCellCopyEqualsRunPlan(local, remote, {1, 3, 0, 7}, {4, 5, 15, 0});
}

TEST(CellGeometryTest, SameLayoutHasAGeometryButKeepsItsRuns) {
  // [2,8,4,2,3] on both sides: one 48-byte run per plane and block, nothing to transpose.
  const LayerLayout local = Layer("l0", {2, 8, 4, 2, 3}, Spec(4, 2, 3));
  const LayerLayout remote = Layer("r0", {2, 16, 4, 2, 3}, Spec(4, 2, 3));
  const BlockTemplate tmpl = Template(local, remote);
  ASSERT_TRUE(tmpl.cell_geometry().has_value());
  EXPECT_FALSE(tmpl.prefers_cell_copy());
  ExpectCellCopyEqualsRunPlan(local, remote, {0, 2, 5}, {9, 3, 15});
}

TEST(CellGeometryTest, EveryLayoutFamilyMovesWhatItsRunPlanMoves) {
  const CacheSpec spec = Spec(4, 2, 3);
  const std::vector<LayerLayout> family = {
      Layer("sep_nhd", {2, 8, 4, 2, 3}, spec),
      Layer("sep_hnd", {2, 8, 2, 4, 3}, spec),
      Layer("int_nhd", {8, 2, 4, 2, 3}, spec),
      Layer("int_hnd", {8, 2, 2, 4, 3}, spec),
      // Kernel blocks of 2 tokens that continue the token stride (cell b*48 + t*12 + h*6).
      Layer("kernel_sep_nhd", {2, 16, 2, 2, 3}, Spec(4, 2, 3, AxisOrder::kNhd)),
      // Packed [N,H,B,K|V], contiguous and permuted from [N,B,H,C].
      Layer("packed", {8, 2, 4, 6}, spec),
      Layer("packed_nbhc", {8, 2, 4, 6}, spec, {48, 6, 12, 1}),
      // Padded: every block stride 1.5x its bytes, heads strided past a gap.
      Layer("padded_hnd", {2, 8, 2, 4, 3}, spec, {288, 36, 16, 3, 1}),
  };
  for (const LayerLayout& local : family) {
    for (const LayerLayout& remote : family) {
      SCOPED_TRACE(local.name() + " <- " + remote.name());
      ExpectCellCopyEqualsRunPlan(local, remote, {7, 0, 3, 5}, {1, 6, 2, 4});
    }
  }
}

TEST(CellGeometryTest, PackedOnBothSidesIsOneCellPerHeadAndToken) {
  // K 3 | V 2 elements (10 bytes) per (head, token): planes of different widths, but packed on
  // both sides: one plane of 10-byte cells. [N,H,B,C] = [8,2,4,5] against the [N,B,H,C] order.
  CacheSpec spec = Spec(4, 2, 3);
  spec.head_size_v = 2;
  const LayerLayout local = Layer("packed.l", {8, 2, 4, 5}, spec);
  const LayerLayout remote = Layer("packed.r", {16, 2, 4, 5}, spec, {40, 5, 10, 1});
  const BlockTemplate tmpl = Template(local, remote);
  ASSERT_TRUE(tmpl.cell_geometry().has_value());
  EXPECT_EQ(tmpl.cell_geometry()->planes, 1);
  EXPECT_EQ(tmpl.cell_geometry()->cell_bytes, 10);
  // Local cell h*40 + t*10, remote t*20 + h*10.
  EXPECT_EQ(tmpl.cell_geometry()->local, (CellSide{80, 0, 40, 10}));
  EXPECT_EQ(tmpl.cell_geometry()->remote, (CellSide{80, 0, 10, 20}));
  ExpectCellCopyEqualsRunPlan(local, remote, {1, 2, 7}, {15, 0, 8});
}

TEST(CellGeometryTest, LatentCacheIsOnePlane) {
  CacheSpec spec;
  spec.kind = CacheKind::kLatent;
  spec.block_size = 4;
  spec.head_size = 5;
  spec.dtype_bytes = 2;
  const LayerLayout local = Layer("mla.l", {8, 4, 5}, spec);
  const LayerLayout remote = Layer("mla.r", {16, 4, 5}, spec, {40, 10, 1});  // padded tokens
  const BlockTemplate tmpl = Template(local, remote);
  ASSERT_TRUE(tmpl.cell_geometry().has_value());
  EXPECT_EQ(tmpl.cell_geometry()->planes, 1);
  EXPECT_EQ(tmpl.cell_geometry()->heads, 1);
  EXPECT_EQ(tmpl.cell_geometry()->cell_bytes, 10);
  ExpectCellCopyEqualsRunPlan(local, remote, {0, 5}, {3, 11});
}

TEST(CellGeometryTest, NoGeometryWhereTheTokenOffsetIsNotAffine) {
  // [2,Nk,H,kb,D] = [2,16,2,2,3] HND with kernel blocks of 2 tokens: strides [192,12,6,3,1]
  // -> kernel block 24 B, head 12 B, token 6 B; the second kernel block's first token sits
  // 24 B in, not 2 * 6 = 12 B: the token offset is not one stride.
  const LayerLayout local = Layer("kernel_hnd", {2, 16, 2, 2, 3}, Spec(4, 2, 3, AxisOrder::kHnd));
  const LayerLayout remote = Layer("sep_nhd", {2, 8, 4, 2, 3}, Spec(4, 2, 3));
  const BlockTemplate tmpl = Template(local, remote);
  EXPECT_FALSE(tmpl.cell_geometry().has_value());
  EXPECT_FALSE(tmpl.prefers_cell_copy());
  BlockOffsets blocks;
  const Status st = AppendBlockOffsets(tmpl, Pairs({1}, {2}), 0, 0, &blocks);
  EXPECT_EQ(st.code(), StatusCode::kFailedPrecondition);
  EXPECT_NE(st.message().find("layer 'kernel_hnd'"), std::string::npos) << st.message();
  EXPECT_EQ(blocks.size(), 0u);
}

TEST(CellGeometryTest, NoGeometryForSeparatePlanesOfDifferentWidths) {
  // A peer's layout with K (6 B) and V (4 B) in separate planes: the same logical content as
  // packed [8,2,4,5] K 3 | V 2, but K and V cells of one side are not one cell on the other.
  CacheSpec spec = Spec(4, 2, 3);
  spec.head_size_v = 2;
  const LayerLayout packed = Layer("packed", {8, 2, 4, 5}, spec);
  LayoutParams p = packed.params();
  p.head_stride = 6;
  p.token_stride = 12;
  p.block_stride = p.kernel_block_stride = 48;
  p.plane_offset = {0, 8 * 48};
  Result<LayerLayout> separated = LayerLayout::FromParams("peer.separated", p);
  ASSERT_TRUE(separated.ok()) << separated.status().ToString();
  EXPECT_FALSE(Template(packed, *separated).cell_geometry().has_value());
}

TEST(CellGeometryTest, BlockOffsetsRefuseIdsPastEitherSideAndAppendNothing) {
  const LayerLayout local = Layer("prefill.0", {2, 8, 4, 2, 3}, Spec(4, 2, 3));
  const LayerLayout remote = Layer("decode.0", {16, 2, 2, 4, 3}, Spec(4, 2, 3));
  const BlockTemplate tmpl = Template(local, remote);
  BlockOffsets blocks;
  ASSERT_TRUE(AppendBlockOffsets(tmpl, Pairs({0}, {0}), 0, 0, &blocks).ok());
  Status st = AppendBlockOffsets(tmpl, Pairs({8}, {0}), 0, 0, &blocks);
  EXPECT_EQ(st.code(), StatusCode::kOutOfRange);
  EXPECT_NE(st.message().find("local block id 8"), std::string::npos) << st.message();
  st = AppendBlockOffsets(tmpl, Pairs({1}, {16}), 0, 0, &blocks);
  EXPECT_EQ(st.code(), StatusCode::kOutOfRange);
  EXPECT_NE(st.message().find("remote block id 16"), std::string::npos) << st.message();
  EXPECT_EQ(blocks.size(), 1u);
}

}  // namespace
}  // namespace moriio_native
