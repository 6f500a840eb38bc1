// Block checksums over logical cells (ChecksumBlocks): equal across every layout family for the
// same logical bytes, changed by any byte of a moved cell, blind to padding and to bytes outside
// the window, equal between one side's window and the other side's whole smaller block, and
// refusing bad ids and windows. The value's definition is pinned by hand-computed examples.
// Units: strides in geometries are elements (bf16 unless said); offsets are bytes.

#include "moriio_native/checksum.hpp"

#include <gtest/gtest.h>

#include <cstddef>
#include <cstdint>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "moriio_native/layout.hpp"
#include "strides.hpp"

namespace moriio_native {
namespace {

using Ids = std::vector<std::int64_t>;
using Bytes = std::vector<std::byte>;
using test_support::Contiguous;

CacheSpec Spec(std::int64_t block_size, std::int64_t heads, std::int64_t head_size,
               AxisOrder order = AxisOrder::kAuto, std::int64_t dtype_bytes = 2) {
  CacheSpec s;
  s.block_size = block_size;
  s.num_kv_heads = heads;
  s.head_size = head_size;
  s.dtype_bytes = dtype_bytes;
  s.axis_order = order;
  return s;
}

LayerLayout Layer(const std::string& name, std::vector<std::int64_t> shape, const CacheSpec& spec,
                  std::vector<std::int64_t> strides = {}) {
  if (strides.empty()) strides = Contiguous(shape);
  Result<LayerLayout> r =
      DescribeLayer(name, TensorGeometry{shape, strides, spec.dtype_bytes, 0}, spec);
  EXPECT_TRUE(r.ok()) << r.status().ToString();
  return std::move(r).value();
}

Bytes RandomBytes(std::int64_t n, unsigned seed) {
  std::mt19937 rng(seed);
  Bytes out(static_cast<std::size_t>(n));
  for (std::byte& b : out) b = static_cast<std::byte>(rng() & 0xff);
  return out;
}

std::vector<std::uint64_t> Sums(const LayerLayout& layout, const Bytes& bytes, const Ids& blocks,
                                const CellWindow& window = {}) {
  Result<std::vector<std::uint64_t>> r = ChecksumBlocks(layout, bytes.data(), blocks, window);
  EXPECT_TRUE(r.ok()) << r.status().ToString();
  return r.ok() ? *r : std::vector<std::uint64_t>{};
}

// Copies the logical cells of `from`'s blocks into `to`'s blocks of the same ids through the
// pair's run plan (what a transfer moves); every other byte of `to` stays as it was.
void CopyLogical(const LayerLayout& to, Bytes* to_bytes, const LayerLayout& from,
                 const Bytes& from_bytes, const Ids& ids) {
  Result<CopyPlan> plan = PlanBlockCopies(to, from, ids, ids);
  ASSERT_TRUE(plan.ok()) << plan.status().ToString();
  for (std::size_t i = 0; i < plan->size(); ++i) {
    std::memcpy(to_bytes->data() + plan->local_offsets[i],
                from_bytes.data() + plan->remote_offsets[i],
                static_cast<std::size_t>(plan->sizes[i]));
  }
}

// One K/V logical content (8 blocks of 4 tokens, 2 heads, head size 3 bf16: 6-byte cells, so
// every cell ends in a zero-padded partial word) in every layout family vLLM ships.
std::vector<LayerLayout> KvFamily() {
  const CacheSpec spec = Spec(4, 2, 3);
  return {
      Layer("sep_nhd", {2, 8, 4, 2, 3}, spec),
      Layer("sep_hnd", {2, 8, 2, 4, 3}, spec),
      Layer("int_nhd", {8, 2, 4, 2, 3}, spec),
      Layer("int_hnd", {8, 2, 2, 4, 3}, spec),
      // Kernel blocks of 2 tokens: continuing the token stride (NHD) and breaking it (HND).
      Layer("kernel_sep_nhd", {2, 16, 2, 2, 3}, Spec(4, 2, 3, AxisOrder::kNhd)),
      Layer("kernel_int_hnd", {16, 2, 2, 2, 3}, Spec(4, 2, 3, AxisOrder::kHnd)),
      // Packed [N,H,B,K|V], contiguous and permuted from [N,B,H,C].
      Layer("packed", {8, 2, 4, 6}, spec),
      Layer("packed_nbhc", {8, 2, 4, 6}, spec, {48, 6, 12, 1}),
      // Padded: block stride 1.5x its bytes, heads strided past a gap.
      Layer("padded_hnd", {2, 8, 2, 4, 3}, spec, {288, 36, 16, 3, 1}),
  };
}

TEST(ChecksumTest, EveryLayoutFamilyAgreesOnTheSameLogicalBytes) {
  const std::vector<LayerLayout> family = KvFamily();
  const Ids all = {0, 1, 2, 3, 4, 5, 6, 7};
  const Ids asked = {7, 0, 3, 5};
  const Bytes reference = RandomBytes(family[0].span_bytes(), 1);
  const std::vector<std::uint64_t> expected = Sums(family[0], reference, asked);
  ASSERT_EQ(expected.size(), asked.size());
  for (std::size_t i = 0; i < family.size(); ++i) {
    SCOPED_TRACE(family[i].name());
    // Every byte random first (with its own seed): padding differs from layout to layout.
    Bytes bytes = RandomBytes(family[i].span_bytes(), 100 + static_cast<unsigned>(i));
    CopyLogical(family[i], &bytes, family[0], reference, all);
    EXPECT_EQ(Sums(family[i], bytes, asked), expected);
  }
  // Different blocks have different values (the content is random).
  EXPECT_NE(expected[0], expected[1]);
}

TEST(ChecksumTest, LatentAndUnequalPlanesAgreeAcrossLayouts) {
  // Latent [N,B,D] against the same cells with the blocks padded to twice their bytes.
  const CacheSpec latent = [] {
    CacheSpec s = Spec(4, 1, 5);
    s.kind = CacheKind::kLatent;
    return s;
  }();
  const LayerLayout dense = Layer("latent", {6, 4, 5}, latent);
  const LayerLayout padded = Layer("latent_padded", {6, 4, 5}, latent, {40, 5, 1});
  // K of 4 and V of 2 elements per head: separated against interleaved.
  CacheSpec narrow_v = Spec(4, 2, 4);
  narrow_v.head_size_v = 2;
  const LayerLayout packed = Layer("packed_k4_v2", {6, 2, 4, 6}, narrow_v);
  const LayerLayout permuted = Layer("packed_nbhc_k4_v2", {6, 2, 4, 6}, narrow_v, {48, 6, 12, 1});
  const Ids all = {0, 1, 2, 3, 4, 5};
  for (const auto& [a, b] : {std::pair{&dense, &padded}, std::pair{&packed, &permuted}}) {
    SCOPED_TRACE(a->name() + " vs " + b->name());
    const Bytes a_bytes = RandomBytes(a->span_bytes(), 7);
    Bytes b_bytes = RandomBytes(b->span_bytes(), 8);
    CopyLogical(*b, &b_bytes, *a, a_bytes, all);
    EXPECT_EQ(Sums(*a, a_bytes, {5, 1, 2}), Sums(*b, b_bytes, {5, 1, 2}));
  }
}

TEST(ChecksumTest, EveryByteOfAMovedCellChangesOnlyItsBlock) {
  for (const LayerLayout& layout : KvFamily()) {
    SCOPED_TRACE(layout.name());
    Bytes bytes = RandomBytes(layout.span_bytes(), 3);
    const Ids blocks = {2, 5, 6};
    const std::vector<std::uint64_t> before = Sums(layout, bytes, blocks);
    // The bytes a transfer of block 5 moves: its run plan against itself.
    const Ids five = {5};
    Result<CopyPlan> plan = PlanBlockCopies(layout, layout, five, five);
    ASSERT_TRUE(plan.ok());
    std::int64_t flipped = 0;
    for (std::size_t r = 0; r < plan->size(); ++r) {
      for (std::int64_t k = 0; k < plan->sizes[r]; ++k) {
        std::byte& b = bytes[static_cast<std::size_t>(plan->local_offsets[r] + k)];
        b ^= std::byte{0x01};
        const std::vector<std::uint64_t> after = Sums(layout, bytes, blocks);
        EXPECT_EQ(after[0], before[0]);
        EXPECT_NE(after[1], before[1]) << "byte " << plan->local_offsets[r] + k;
        EXPECT_EQ(after[2], before[2]);
        b ^= std::byte{0x01};
        ++flipped;
      }
    }
    EXPECT_EQ(flipped, layout.block_bytes());
    EXPECT_EQ(Sums(layout, bytes, blocks), before);
  }
}

TEST(ChecksumTest, SwappedCellsChangeTheValue) {
  // Two tokens' K cells of one head exchanged: same multiset of words, other positions.
  const LayerLayout layout = Layer("sep_nhd", {2, 3, 4, 1, 4}, Spec(4, 1, 4));
  Bytes bytes = RandomBytes(layout.span_bytes(), 4);
  const std::uint64_t before = Sums(layout, bytes, {1})[0];
  const std::size_t token = 8;  // one head of 4 bf16 per token
  const std::size_t block = 4 * token;
  std::swap_ranges(bytes.begin() + block, bytes.begin() + block + token,
                   bytes.begin() + block + token);
  EXPECT_NE(Sums(layout, bytes, {1})[0], before);
}

TEST(ChecksumTest, PaddingAndBytesOutsideTheWindowAreNeverRead) {
  const LayerLayout layout = Layer("padded_hnd", {2, 8, 2, 4, 3}, Spec(4, 2, 3),
                                   {288, 36, 16, 3, 1});
  const Bytes bytes = RandomBytes(layout.span_bytes(), 5);
  const CellWindow window{1, 1, 1, 2};  // head 1, tokens 1 and 2
  const Ids blocks = {0, 4};
  // Rebuild the buffer from nothing but the window's cells: every other byte differs.
  Bytes only_window = RandomBytes(layout.span_bytes(), 6);
  const LayoutParams& p = layout.params();
  for (std::int64_t b : blocks) {
    for (int plane = 0; plane < 2; ++plane) {
      for (std::int64_t t = 1; t < 3; ++t) {
        const std::int64_t off = b * p.block_stride + p.plane_offset[plane] + 1 * p.head_stride +
                                 t * p.token_stride;
        std::memcpy(only_window.data() + off, bytes.data() + off,
                    static_cast<std::size_t>(p.plane_bytes[plane]));
      }
    }
  }
  EXPECT_EQ(Sums(layout, only_window, blocks, window), Sums(layout, bytes, blocks, window));
  EXPECT_NE(Sums(layout, only_window, blocks), Sums(layout, bytes, blocks));
}

// Fills every cell (plane p, head h, token t) of `to`'s blocks with cell (p, h + head_shift,
// t + token_shift) of the same block of `from` (no kernel blocks on either side).
void CopyShiftedCells(const LayerLayout& to, Bytes* to_bytes, const LayerLayout& from,
                      const Bytes& from_bytes, std::int64_t head_shift, std::int64_t token_shift) {
  const LayoutParams& d = to.params();
  const LayoutParams& s = from.params();
  for (std::int64_t b = 0; b < to.num_blocks(); ++b) {
    for (int plane = 0; plane < d.num_planes(); ++plane) {
      for (std::int64_t h = 0; h < to.num_heads(); ++h) {
        for (std::int64_t t = 0; t < to.block_size(); ++t) {
          std::memcpy(to_bytes->data() + b * d.block_stride + d.plane_offset[plane] +
                          h * d.head_stride + t * d.token_stride,
                      from_bytes.data() + b * s.block_stride + s.plane_offset[plane] +
                          (h + head_shift) * s.head_stride + (t + token_shift) * s.token_stride,
                      static_cast<std::size_t>(d.plane_bytes[plane]));
        }
      }
    }
  }
}

TEST(ChecksumTest, AWindowEqualsTheWholeBlockOfTheSideThatHoldsOnlyIt) {
  // Heterogeneous TP: the prefill holds 4 heads, a decode rank heads 2..3 only.
  const LayerLayout wide = Layer("wide", {2, 3, 4, 4, 3}, Spec(4, 4, 3, AxisOrder::kNhd));
  const LayerLayout narrow = Layer("narrow", {3, 2, 2, 4, 3}, Spec(4, 2, 3, AxisOrder::kHnd));
  const Bytes wide_bytes = RandomBytes(wide.span_bytes(), 9);
  Bytes narrow_bytes = RandomBytes(narrow.span_bytes(), 10);
  CopyShiftedCells(narrow, &narrow_bytes, wide, wide_bytes, 2, 0);
  const Ids blocks = {2, 0, 1};
  EXPECT_EQ(Sums(wide, wide_bytes, blocks, CellWindow{2, std::nullopt, 0, std::nullopt}),
            Sums(narrow, narrow_bytes, blocks));
  EXPECT_NE(Sums(wide, wide_bytes, blocks, CellWindow{0, 2, 0, std::nullopt}),
            Sums(narrow, narrow_bytes, blocks));
  // Different block sizes: the second half of a 4-token block is a whole 2-token block.
  const LayerLayout half = Layer("half", {2, 3, 2, 4, 3}, Spec(2, 4, 3));
  Bytes half_bytes = RandomBytes(half.span_bytes(), 11);
  CopyShiftedCells(half, &half_bytes, wide, wide_bytes, 0, 2);
  EXPECT_EQ(Sums(wide, wide_bytes, blocks, CellWindow{0, std::nullopt, 2, 2}),
            Sums(half, half_bytes, blocks));
}

TEST(ChecksumTest, TheDefinitionByHand) {
  // One latent token of 12 bytes: a full word and a 4-byte tail padded with zeros.
  CacheSpec spec = Spec(1, 1, 12, AxisOrder::kAuto, 1);
  spec.kind = CacheKind::kLatent;
  const LayerLayout layout = Layer("latent12", {2, 1, 12}, spec);
  Bytes bytes(24);
  for (std::size_t i = 0; i < bytes.size(); ++i) bytes[i] = static_cast<std::byte>(i + 1);
  std::uint64_t w0 = 0, w1 = 0;
  std::memcpy(&w0, bytes.data() + 12, 8);
  std::memcpy(&w1, bytes.data() + 20, 4);
  const std::uint64_t expected =
      Mix64(w0 ^ kChecksumPositionStep) + Mix64(w1 ^ (2 * kChecksumPositionStep));
  EXPECT_EQ(Sums(layout, bytes, {1}), std::vector<std::uint64_t>{expected});
  EXPECT_EQ(Mix64(0), 0u);
  EXPECT_EQ(Mix64(1), 0xb456bcfc34c2cb2cULL);  // MurmurHash3 fmix64(1)
  // No block ids: no values, no error.
  EXPECT_TRUE(Sums(layout, bytes, {}).empty());
}

TEST(ChecksumTest, BadIdsAndWindowsAreRefusedNamingTheLayer) {
  const LayerLayout layout = KvFamily()[0];
  const Bytes bytes = RandomBytes(layout.span_bytes(), 12);
  for (const Ids& ids : {Ids{0, 8}, Ids{-1}, Ids{3, 1, 99}}) {
    Result<std::vector<std::uint64_t>> r = ChecksumBlocks(layout, bytes.data(), ids);
    ASSERT_FALSE(r.ok());
    EXPECT_EQ(r.status().code(), StatusCode::kOutOfRange);
    EXPECT_NE(r.status().message().find("layer 'sep_nhd'"), std::string::npos);
    EXPECT_NE(r.status().message().find("block id " + std::to_string(ids.back())),
              std::string::npos)
        << r.status().message();
    EXPECT_NE(r.status().message().find("8 blocks"), std::string::npos);
  }
  for (const CellWindow& w : {CellWindow{0, 3, 0, std::nullopt}, CellWindow{2, std::nullopt, 0,
                                                                            std::nullopt},
                              CellWindow{-1, 1, 0, 1}, CellWindow{0, 0, 0, 1},
                              CellWindow{0, 1, 3, 2}, CellWindow{0, 1, 4, std::nullopt}}) {
    Result<std::vector<std::uint64_t>> r = ChecksumBlocks(layout, bytes.data(), Ids{0}, w);
    ASSERT_FALSE(r.ok());
    EXPECT_EQ(r.status().code(), StatusCode::kInvalidArgument);
    EXPECT_NE(r.status().message().find("layer 'sep_nhd': checksum window"), std::string::npos)
        << r.status().message();
  }
}

}  // namespace
}  // namespace moriio_native
