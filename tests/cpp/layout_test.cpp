// Independent tests of the layout engine (include/moriio_native/layout.hpp).
//
// Every expected offset below is derived by hand from the tensor's shape and strides; the
// derivation is written next to it. Nothing here asks the code under test for an expectation.
// Units: strides in the geometries are elements (as torch reports them); offsets are bytes.
// All caches are bf16 (2 bytes per element) unless stated otherwise.

#include <gtest/gtest.h>

#include <algorithm>
#include <cstdint>
#include <limits>
#include <numeric>
#include <optional>
#include <random>
#include <string>
#include <thread>
#include <tuple>
#include <vector>

#include "moriio_native/layout.hpp"
#include "strides.hpp"

namespace moriio_native {
namespace {

using Triple = std::tuple<std::int64_t, std::int64_t, std::int64_t>;  // (local, remote, size)
using Ids = std::vector<std::int64_t>;

constexpr std::int64_t kBf16 = 2;

using test_support::Contiguous;

TensorGeometry Geo(std::vector<std::int64_t> shape, std::vector<std::int64_t> strides = {},
                   std::int64_t element_size = kBf16) {
  if (strides.empty()) strides = Contiguous(shape);
  return TensorGeometry{std::move(shape), std::move(strides), element_size, 0};
}

CacheSpec KvSpec(std::int64_t block_size, std::optional<std::int64_t> heads,
                 std::optional<std::int64_t> head_size, std::int64_t dtype_bytes = kBf16) {
  CacheSpec s;
  s.kind = CacheKind::kKeyValue;
  s.block_size = block_size;
  s.num_kv_heads = heads;
  s.head_size = head_size;
  s.dtype_bytes = dtype_bytes;
  return s;
}

CacheSpec LatentSpec(std::int64_t block_size, std::int64_t head_size,
                     std::int64_t dtype_bytes = kBf16) {
  CacheSpec s;
  s.kind = CacheKind::kLatent;
  s.block_size = block_size;
  s.head_size = head_size;
  s.dtype_bytes = dtype_bytes;
  return s;
}

LayerLayout Describe(const std::string& name, const TensorGeometry& g, const CacheSpec& spec,
                     KvPlaneAxis axis = KvPlaneAxis::kAuto) {
  Result<LayerLayout> r = DescribeLayer(name, g, spec, axis);
  EXPECT_TRUE(r.ok()) << r.status().ToString();
  return std::move(r).value();
}

std::vector<Triple> Runs(const CopyPlan& plan) {
  std::vector<Triple> out;
  for (std::size_t i = 0; i < plan.size(); ++i) {
    out.emplace_back(plan.local_offsets[i], plan.remote_offsets[i], plan.sizes[i]);
  }
  return out;
}

std::vector<Triple> Plan(const LayerLayout& local, const LayerLayout& remote, const Ids& l,
                      const Ids& r) {
  Result<CopyPlan> plan = PlanBlockCopies(local, remote, l, r);
  EXPECT_TRUE(plan.ok()) << plan.status().ToString();
  if (!plan.ok()) return {};
  return Runs(*plan);
}

bool Contains(const std::string& haystack, const std::string& needle) {
  return haystack.find(needle) != std::string::npos;
}

// The block size 4 / 2 heads / head size 3 family used by most tests below.
CacheSpec Small() { return KvSpec(4, 2, 3); }

// `spec` with the shape's token/head axis order stated.
CacheSpec Ordered(CacheSpec spec, AxisOrder order) {
  spec.axis_order = order;
  return spec;
}

// ---------------------------------------------------------------------------------------------
// Contiguous K/V caches, one per shape family.

// [2,N,B,H,D] = [2,8,4,2,3], contiguous strides [192,24,6,3,1] elements
//   -> bytes: plane 384, block 48, token 12, head 6; a cell (one head of one token) is 3*2 = 6 B.
// Inside a block, cell (t,h) sits at t*12 + h*6: the 8 cells of a plane fill [0,48) in order, so
// a block's K plane is one 48-byte run and its V plane another (at +384).
// Remote [2,16,4,2,3]: strides [384,24,6,3,1] -> plane 768, block 48.
// Local [1,3] -> remote [4,5]:
//   K: (1*48, 4*48) = (48,192); (3*48, 5*48) = (144,240)
//   V: (384+48, 768+192) = (432,960); (384+144, 768+240) = (528,1008)      sizes 48 each.
TEST(LayoutTest, SeparatedBlockHeadWorkedExample) {
  LayerLayout local = Describe("l0", Geo({2, 8, 4, 2, 3}), Small());
  LayerLayout remote = Describe("r0", Geo({2, 16, 4, 2, 3}), Small());
  EXPECT_EQ(local.num_blocks(), 8);
  EXPECT_EQ(remote.num_blocks(), 16);
  EXPECT_EQ(local.block_stride(), 48);
  // Logical bytes of a block: 2 planes * 2 heads * 4 tokens * 6 B = 96.
  EXPECT_EQ(local.block_bytes(), 96);
  // Extent: the last V cell of block 7 ends at 384 + 7*48 + 48 = 768 = the whole tensor.
  EXPECT_EQ(local.span_bytes(), 768);
  EXPECT_EQ(Plan(local, remote, {1, 3}, {4, 5}),
            (std::vector<Triple>{{48, 192, 48}, {144, 240, 48}, {432, 960, 48}, {528, 1008, 48}}));
}

// [N,2,B,H,D] = [8,2,4,2,3], strides [48,24,6,3,1] -> bytes: block 96, plane 48, token 12,
// head 6. A block is K [0,48) then V [48,96): with the same layout on the remote side the two
// runs touch on both sides and merge into one 96-byte run per block.
// Remote [16,2,4,2,3]: block stride 96 as well.
//   1 -> 4: (96, 384, 96);  3 -> 5: (288, 480, 96).
TEST(LayoutTest, InterleavedBlockHead) {
  LayerLayout local = Describe("l0", Geo({8, 2, 4, 2, 3}), Small());
  LayerLayout remote = Describe("r0", Geo({16, 2, 4, 2, 3}), Small());
  EXPECT_EQ(local.block_stride(), 96);
  EXPECT_EQ(local.span_bytes(), 768);
  EXPECT_EQ(Plan(local, remote, {1, 3}, {4, 5}),
            (std::vector<Triple>{{96, 384, 96}, {288, 480, 96}}));
}

// [2,N,H,B,D] = [2,8,2,4,3], strides [192,24,12,3,1] -> bytes: plane 384, block 48, head 24,
// token 6. Per plane the block is still [0,48) contiguous, so the runs equal the [2,N,B,H,D]
// case (remote [2,16,2,4,3]: plane 768, block 48).
TEST(LayoutTest, SeparatedHeadBlock) {
  LayerLayout local = Describe("l0", Geo({2, 8, 2, 4, 3}), Small());
  LayerLayout remote = Describe("r0", Geo({2, 16, 2, 4, 3}), Small());
  EXPECT_EQ(local.num_heads(), 2);
  EXPECT_EQ(local.params().token_stride, 6);
  EXPECT_EQ(local.params().head_stride, 24);
  EXPECT_EQ(Plan(local, remote, {1, 3}, {4, 5}),
            (std::vector<Triple>{{48, 192, 48}, {144, 240, 48}, {432, 960, 48}, {528, 1008, 48}}));
}

// [N,2,H,B,D] = [8,2,2,4,3], strides [48,24,12,3,1] -> bytes: block 96, plane 48, head 24,
// token 6. Same runs as [N,2,B,H,D]: (96,384,96), (288,480,96).
TEST(LayoutTest, InterleavedHeadBlock) {
  LayerLayout local = Describe("l0", Geo({8, 2, 2, 4, 3}), Small());
  LayerLayout remote = Describe("r0", Geo({16, 2, 2, 4, 3}), Small());
  EXPECT_EQ(Plan(local, remote, {1, 3}, {4, 5}),
            (std::vector<Triple>{{96, 384, 96}, {288, 480, 96}}));
}

// ---------------------------------------------------------------------------------------------
// Kernel-block splits (kernel block smaller than the manager block).

// [2,16,2,2,3] with block_size 4: 16 kernel blocks of 2 tokens -> 8 manager blocks.
// Strides [192,12,6,3,1] -> bytes: plane 384, kernel block 24, token 12, head 6.
// Cell (p,h,t) of manager block b: p*384 + b*2*24 + (t/2)*24 + (t%2)*12 + h*6
//                                = p*384 + b*48 + t*12 + h*6   (the [2,8,4,2,3] layout exactly).
// So against the [2,16,4,2,3] remote the worked-example runs come out.
TEST(LayoutTest, KernelBlockSeparated) {
  LayerLayout local = Describe("l0", Geo({2, 16, 2, 2, 3}), Ordered(Small(), AxisOrder::kNhd));
  LayerLayout remote = Describe("r0", Geo({2, 16, 4, 2, 3}), Small());
  EXPECT_EQ(local.num_blocks(), 8);
  EXPECT_EQ(local.block_stride(), 48);
  EXPECT_EQ(local.params().kernel_block_size, 2);
  EXPECT_EQ(Plan(local, remote, {1, 3}, {4, 5}),
            (std::vector<Triple>{{48, 192, 48}, {144, 240, 48}, {432, 960, 48}, {528, 1008, 48}}));
}

// [16,2,2,2,3] with block_size 4: [Nk,2,kb,H,D], strides [24,12,6,3,1]
//   -> bytes: kernel block 48, plane 24, token 12, head 6; manager block stride 96.
// Cell (p,h,t) of block b: b*96 + (t/2)*48 + p*24 + (t%2)*12 + h*6.
// Same layout on the remote ([32,2,2,2,3], 16 blocks): the whole block is one run of 96.
//   1 -> 4: (96,384,96); 3 -> 5: (288,480,96).
TEST(LayoutTest, KernelBlockInterleaved) {
  LayerLayout local = Describe("l0", Geo({16, 2, 2, 2, 3}), Ordered(Small(), AxisOrder::kNhd));
  LayerLayout remote = Describe("r0", Geo({32, 2, 2, 2, 3}), Ordered(Small(), AxisOrder::kNhd));
  EXPECT_EQ(local.num_blocks(), 8);
  EXPECT_EQ(remote.num_blocks(), 16);
  EXPECT_EQ(local.block_stride(), 96);
  EXPECT_EQ(Plan(local, remote, {1, 3}, {4, 5}),
            (std::vector<Triple>{{96, 384, 96}, {288, 480, 96}}));
}

// Kernel-block interleaved local ([16,2,2,2,3], above) against a separated remote
// ([2,16,4,2,3]: cell p*768 + rb*48 + t*12 + h*6). Walking the local block in byte order:
//   local [0,24)  = K tokens 0,1 (both heads) -> remote K [0,24)          run (0,   0, 24)
//   local [24,48) = V tokens 0,1              -> remote 768 + [0,24)       run (24, 768, 24)
//   local [48,72) = K tokens 2,3              -> remote [24,48)            run (48,  24, 24)
//   local [72,96) = V tokens 2,3              -> remote 768 + [24,48)      run (72, 792, 24)
// Stamped at local b*96, remote rb*48: 1 -> 4 adds (96,192); 3 -> 5 adds (288,240).
TEST(LayoutTest, KernelInterleavedToSeparatedPairsLogicalContent) {
  LayerLayout local = Describe("l0", Geo({16, 2, 2, 2, 3}), Ordered(Small(), AxisOrder::kNhd));
  LayerLayout remote = Describe("r0", Geo({2, 16, 4, 2, 3}), Small());
  EXPECT_EQ(Plan(local, remote, {1, 3}, {4, 5}), (std::vector<Triple>{{96, 192, 24},
                                                                   {120, 960, 24},
                                                                   {144, 216, 24},
                                                                   {168, 984, 24},
                                                                   {288, 240, 24},
                                                                   {312, 1008, 24},
                                                                   {336, 264, 24},
                                                                   {360, 1032, 24}}));
}

// [2,32,8,2,3] with block_size 16 and 8 heads: axes 2/3 are (8,2). With 8 heads known, axis 2
// is heads and axis 3 a 2-token kernel block: [2,Nk=32,H=8,kb=2,D=3] -> 32/8 = 4 blocks.
// Strides [1536,48,6,3,1] -> bytes: plane 3072, kernel block 96, head 12, token 6; manager
// block stride 8*96 = 768. Each kernel block is [k*96, k*96+96) full, so a plane of a block is
// one 768-byte run. Self-pairing 1 -> 2, 3 -> 0 (sorted by local):
//   K: (768, 1536, 768), (2304, 0, 768);  V: (3072+768, 3072+1536) = (3840, 4608),
//   (3072+2304, 3072+0) = (5376, 3072).
TEST(LayoutTest, KernelBlockHeadsFirstWithHeadsKnown) {
  TensorGeometry g = Geo({2, 32, 8, 2, 3});
  LayerLayout local = Describe("l0", g, KvSpec(16, 8, 3));
  EXPECT_EQ(local.num_blocks(), 4);
  EXPECT_EQ(local.num_heads(), 8);
  EXPECT_EQ(local.block_stride(), 768);
  EXPECT_EQ(local.params().kernel_block_size, 2);
  EXPECT_EQ(Plan(local, local, {3, 1}, {0, 2}), (std::vector<Triple>{{768, 1536, 768},
                                                                 {2304, 0, 768},
                                                                 {3840, 4608, 768},
                                                                 {5376, 3072, 768}}));
}

// Without the head count, 8 and 2 both divide block_size 16: either could be the kernel block.
TEST(LayoutTest, AmbiguousKernelBlockShapeIsAnError) {
  Result<LayerLayout> r = DescribeLayer("layers.7.attn", Geo({2, 32, 8, 2, 3}),
                                        KvSpec(16, std::nullopt, 3));
  ASSERT_FALSE(r.ok());
  EXPECT_EQ(r.status().code(), StatusCode::kInvalidArgument);
  EXPECT_TRUE(Contains(r.status().message(), "Ambiguous")) << r.status().message();
  EXPECT_TRUE(Contains(r.status().message(), "layers.7.attn")) << r.status().message();
}

// Without the head count, [2, N, 16, 8, D] is a full block of 16 tokens x 8 heads, or 8-token
// kernel blocks x 16 heads: the two readings address different bytes, so neither is guessed.
TEST(LayoutTest, FullBlockAgainstKernelBlockReadingIsAmbiguousWithoutHeads) {
  Result<LayerLayout> r =
      DescribeLayer("layers.3.attn", Geo({2, 32, 16, 8, 4}), KvSpec(16, std::nullopt, 4));
  ASSERT_FALSE(r.ok());
  EXPECT_EQ(r.status().code(), StatusCode::kInvalidArgument);
  EXPECT_TRUE(Contains(r.status().message(), "Ambiguous")) << r.status().message();
  EXPECT_TRUE(Contains(r.status().message(), "num_kv_heads")) << r.status().message();
  // The same holds with the axes the other way round (HND).
  r = DescribeLayer("layers.3.attn", Geo({2, 32, 8, 16, 4}), KvSpec(16, std::nullopt, 4));
  ASSERT_FALSE(r.ok());
  EXPECT_TRUE(Contains(r.status().message(), "Ambiguous")) << r.status().message();
  // Given the heads, each reading is settled.
  Result<LayerLayout> nhd =
      DescribeLayer("layers.3.attn", Geo({2, 32, 16, 8, 4}), KvSpec(16, 8, 4));
  ASSERT_TRUE(nhd.ok()) << nhd.status().ToString();
  EXPECT_EQ(nhd->params().kernel_block_size, 16);
  Result<LayerLayout> kernel =
      DescribeLayer("layers.3.attn", Geo({2, 32, 16, 8, 4}), KvSpec(16, 16, 4));
  ASSERT_TRUE(kernel.ok()) << kernel.status().ToString();
  EXPECT_EQ(kernel->params().kernel_block_size, 8);
  // A head axis that cannot be a kernel block leaves one reading: no error.
  Result<LayerLayout> only =
      DescribeLayer("layers.3.attn", Geo({2, 32, 16, 3, 4}), KvSpec(16, std::nullopt, 4));
  ASSERT_TRUE(only.ok()) << only.status().ToString();
  EXPECT_EQ(only->params().kernel_block_size, 16);
}

// Heads equal to the block size: [2,N,B,H,D] and [2,N,H,B,D] have the same shape, and the two
// readings address different bytes, for every 5-D generation. Without the axis order the answer
// is Ambiguous (naming layer and shape), never tokens-first.
TEST(LayoutTest, HeadsEqualToBlockSizeAreAmbiguousWithoutAxisOrder) {
  for (const std::vector<std::int64_t>& shape :
       {std::vector<std::int64_t>{2, 8, 4, 4, 3}, std::vector<std::int64_t>{8, 2, 4, 4, 3}}) {
    Result<LayerLayout> r = DescribeLayer("layers.5.attn", Geo(shape), KvSpec(4, 4, 3));
    ASSERT_FALSE(r.ok());
    EXPECT_EQ(r.status().code(), StatusCode::kInvalidArgument);
    const std::string m = r.status().message();
    EXPECT_TRUE(Contains(m, "Ambiguous")) << m;
    EXPECT_TRUE(Contains(m, "layers.5.attn")) << m;
    EXPECT_TRUE(Contains(m, "[" + std::to_string(shape[0]) + ", " + std::to_string(shape[1]) +
                                ", 4, 4, 3]"))
        << m;
    EXPECT_TRUE(Contains(m, "axis_order")) << m;
  }
  // Heads equal to the kernel block size: [2,16,2,2,3] with block_size 4 is 2-token kernel
  // blocks x 2 heads either way round.
  Result<LayerLayout> kernel = DescribeLayer("layers.6.attn", Geo({2, 16, 2, 2, 3}), Small());
  ASSERT_FALSE(kernel.ok());
  EXPECT_TRUE(Contains(kernel.status().message(), "Ambiguous")) << kernel.status().message();
  // Unknown heads and equal axes: the same.
  Result<LayerLayout> unknown =
      DescribeLayer("layers.7.attn", Geo({2, 8, 4, 4, 3}), KvSpec(4, std::nullopt, 3));
  ASSERT_FALSE(unknown.ok());
  EXPECT_TRUE(Contains(unknown.status().message(), "Ambiguous")) << unknown.status().message();
}

// [2,8,4,4,3] contiguous: strides [384,48,12,3,1] elements -> bytes: plane 768, block 96,
// axis 2 step 24, axis 3 step 6.
//   nhd (axis 2 = tokens): token stride 24, head stride 6.
//   hnd (axis 2 = heads):  head stride 24, token stride 6.
// Interleaved [8,2,4,4,3]: strides [96,48,12,3,1] -> block 192, plane 96, the same two steps.
// Kernel [2,16,2,2,3], block_size 4, 2 heads: strides [192,12,6,3,1] -> kernel block 24; nhd:
// token 12, head 6; hnd: head 12, token 6.
TEST(LayoutTest, AxisOrderSettlesEqualHeadsAndTokens) {
  const CacheSpec four = KvSpec(4, 4, 3);
  LayerLayout nhd = Describe("l", Geo({2, 8, 4, 4, 3}), Ordered(four, AxisOrder::kNhd));
  EXPECT_EQ(nhd.params().token_stride, 24);
  EXPECT_EQ(nhd.params().head_stride, 6);
  EXPECT_EQ(nhd.params().plane_offset[1], 768);
  LayerLayout hnd = Describe("l", Geo({2, 8, 4, 4, 3}), Ordered(four, AxisOrder::kHnd));
  EXPECT_EQ(hnd.params().token_stride, 6);
  EXPECT_EQ(hnd.params().head_stride, 24);
  LayerLayout inter = Describe("l", Geo({8, 2, 4, 4, 3}), Ordered(four, AxisOrder::kHnd));
  EXPECT_EQ(inter.block_stride(), 192);
  EXPECT_EQ(inter.params().plane_offset[1], 96);
  EXPECT_EQ(inter.params().token_stride, 6);
  EXPECT_EQ(inter.params().head_stride, 24);
  LayerLayout kernel = Describe("l", Geo({2, 16, 2, 2, 3}), Ordered(Small(), AxisOrder::kHnd));
  EXPECT_EQ(kernel.params().kernel_block_size, 2);
  EXPECT_EQ(kernel.params().kernel_block_stride, 24);
  EXPECT_EQ(kernel.params().head_stride, 12);
  EXPECT_EQ(kernel.params().token_stride, 6);
  // The byte-level consequence: token t of head h of the nhd block is the (h, t) cell of the hnd
  // block. Copying block 1 -> 1 between them moves each 6-byte cell from t*24 + h*6 to h*24 + t*6
  // (plus 96 for block 1, +768 for V): the diagonal cells stay, the others cross. K, sorted by
  // local offset, first four cells: (t0,h0) 96->96, (t0,h1) 102->120, (t0,h2) 108->144, ...
  Result<CopyPlan> plan = PlanBlockCopies(nhd, hnd, Ids{1}, Ids{1});
  ASSERT_TRUE(plan.ok()) << plan.status().ToString();
  ASSERT_EQ(plan->size(), 32u);  // 2 planes x 16 cells, no two contiguous on both sides
  EXPECT_EQ(Runs(*plan)[0], Triple(96, 96, 6));
  EXPECT_EQ(Runs(*plan)[1], Triple(102, 120, 6));
  EXPECT_EQ(Runs(*plan)[2], Triple(108, 144, 6));
  EXPECT_EQ(Runs(*plan)[4], Triple(120, 102, 6));
}

// A hint the shape contradicts is an error naming the layer and the shape, never overridden.
TEST(LayoutTest, AxisOrderContradictingTheShapeIsAnError) {
  // [2,8,4,2,3], block_size 4, 2 heads: only tokens-first fits.
  Result<LayerLayout> r =
      DescribeLayer("layers.2.attn", Geo({2, 8, 4, 2, 3}), Ordered(Small(), AxisOrder::kHnd));
  ASSERT_FALSE(r.ok());
  EXPECT_EQ(r.status().code(), StatusCode::kInvalidArgument);
  EXPECT_TRUE(Contains(r.status().message(), "layers.2.attn")) << r.status().message();
  EXPECT_TRUE(Contains(r.status().message(), "[2, 8, 4, 2, 3]")) << r.status().message();
  EXPECT_TRUE(Contains(r.status().message(), "'hnd' contradicts")) << r.status().message();
  EXPECT_TRUE(DescribeLayer("l", Geo({2, 8, 4, 2, 3}), Ordered(Small(), AxisOrder::kNhd)).ok());
  // 4-D caches hold heads before tokens ([N,H,B,C]); latent [N,H,B,D] too.
  Result<LayerLayout> packed =
      DescribeLayer("layers.4.attn", Geo({8, 2, 4, 6}), Ordered(Small(), AxisOrder::kNhd));
  ASSERT_FALSE(packed.ok());
  EXPECT_TRUE(Contains(packed.status().message(), "layers.4.attn")) << packed.status().message();
  EXPECT_TRUE(Contains(packed.status().message(), "[8, 2, 4, 6]")) << packed.status().message();
  EXPECT_TRUE(DescribeLayer("l", Geo({8, 2, 4, 6}), Ordered(Small(), AxisOrder::kHnd)).ok());
  CacheSpec mla = LatentSpec(4, 3);
  EXPECT_FALSE(DescribeLayer("mla", Geo({8, 1, 4, 3}), Ordered(mla, AxisOrder::kNhd)).ok());
  EXPECT_TRUE(DescribeLayer("mla", Geo({8, 1, 4, 3}), Ordered(mla, AxisOrder::kHnd)).ok());
  // [N,B,D] has no head axis: every order is consistent with it.
  EXPECT_TRUE(DescribeLayer("mla", Geo({8, 4, 3}), Ordered(mla, AxisOrder::kNhd)).ok());
  EXPECT_TRUE(DescribeLayer("mla", Geo({8, 4, 3}), Ordered(mla, AxisOrder::kHnd)).ok());
  // An out-of-range enum value is refused by the spec check.
  CacheSpec bad = Small();
  bad.axis_order = static_cast<AxisOrder>(7);
  EXPECT_FALSE(DescribeLayer("l", Geo({2, 8, 4, 2, 3}), bad).ok());
}

TEST(LayoutTest, AmbiguousPlaneAxisIsAnErrorUnlessGiven) {
  // [2,2,4,2,3]: is axis 0 or axis 1 the K/V axis?
  Result<LayerLayout> r = DescribeLayer("l0", Geo({2, 2, 4, 2, 3}), Small());
  ASSERT_FALSE(r.ok());
  EXPECT_TRUE(Contains(r.status().message(), "Ambiguous")) << r.status().message();
  // Separated: strides [48,24,6,3,1] -> plane 96 B, block 48 B, so 2 blocks.
  Result<LayerLayout> sep =
      DescribeLayer("l0", Geo({2, 2, 4, 2, 3}), Small(), KvPlaneAxis::kSeparated);
  ASSERT_TRUE(sep.ok()) << sep.status().ToString();
  EXPECT_EQ(sep->params().plane_offset[1], 96);
  EXPECT_EQ(sep->block_stride(), 48);
  // Interleaved: block 96 B, plane 48 B.
  Result<LayerLayout> inter =
      DescribeLayer("l0", Geo({2, 2, 4, 2, 3}), Small(), KvPlaneAxis::kInterleaved);
  ASSERT_TRUE(inter.ok()) << inter.status().ToString();
  EXPECT_EQ(inter->params().plane_offset[1], 48);
  EXPECT_EQ(inter->block_stride(), 96);
}

// ---------------------------------------------------------------------------------------------
// Key-only / latent and standardized [B,H,N,C] caches.

// Key-only [N,B,D] = [8,4,3]: strides [12,3,1] -> bytes: block 24, token 6; one run per block.
// Remote [16,4,3]. 1 -> 4: (24, 96, 24); 3 -> 5: (72, 120, 24).
// Consecutive blocks 1,2 -> 4,5 are contiguous on both sides: one run (24, 96, 48).
TEST(LayoutTest, KeyOnlyLatent) {
  LayerLayout local = Describe("idx", Geo({8, 4, 3}), LatentSpec(4, 3));
  LayerLayout remote = Describe("idx_r", Geo({16, 4, 3}), LatentSpec(4, 3));
  EXPECT_EQ(local.kind(), CacheKind::kLatent);
  EXPECT_EQ(local.num_heads(), 1);
  EXPECT_EQ(local.block_bytes(), 24);
  EXPECT_EQ(local.span_bytes(), 8 * 24);
  EXPECT_EQ(Plan(local, remote, {1, 3}, {4, 5}),
            (std::vector<Triple>{{24, 96, 24}, {72, 120, 24}}));
  EXPECT_EQ(Plan(local, remote, {1, 2}, {4, 5}), (std::vector<Triple>{{24, 96, 48}}));
}

// Standardized packed [N,H,B,C] = [8,2,4,6] with C = K 3 | V 3, contiguous (LBHNC-like):
// strides [48,24,6,1] -> bytes: block 96, head 48, token 12; K at +0, V at +6 of each cell.
// A block is 96 contiguous bytes. Remote of the same kind [16,2,4,6]:
//   1 -> 4: (96, 384, 96); 3 -> 5: (288, 480, 96).
TEST(LayoutTest, StandardizedContiguous) {
  LayerLayout local = Describe("l0", Geo({8, 2, 4, 6}), Small());
  LayerLayout remote = Describe("r0", Geo({16, 2, 4, 6}), Small());
  EXPECT_EQ(local.params().plane_offset[1], 6);
  EXPECT_EQ(local.params().plane_bytes[0], 6);
  EXPECT_EQ(local.block_stride(), 96);
  EXPECT_EQ(Plan(local, remote, {1, 3}, {4, 5}),
            (std::vector<Triple>{{96, 384, 96}, {288, 480, 96}}));
}

// LBNHC-like: memory is [N,B,H,C] contiguous ([48,12,6,1]) exposed as [N,H,B,C] by a permute:
// shape [8,2,4,6], strides [48,6,12,1] -> bytes: block 96, head 12, token 24.
// Local LBHNC (cell h*48 + t*12) to remote LBNHC [16,2,4,6] (cell t*24 + h*12): K and V of one
// (h,t) are adjacent on both sides (12 B), neighbouring cells are not, so 8 runs of 12 B/block:
//   (h*48 + t*12, t*24 + h*12) for h in 0..1, t in 0..3, stamped at local b*96, remote rb*96.
// 1 -> 4 (base 96, 384):  h0: (96,384) (108,408) (120,432) (132,456)
//                         h1: (144,396) (156,420) (168,444) (180,468)
// 3 -> 5 (base 288, 480): h0: (288,480) (300,504) (312,528) (324,552)
//                         h1: (336,492) (348,516) (360,540) (372,564)
TEST(LayoutTest, StandardizedTwoStrideOrders) {
  LayerLayout local = Describe("l0", Geo({8, 2, 4, 6}), Small());
  LayerLayout remote = Describe("r0", Geo({16, 2, 4, 6}, {48, 6, 12, 1}), Small());
  EXPECT_EQ(remote.params().head_stride, 12);
  EXPECT_EQ(remote.params().token_stride, 24);
  std::vector<Triple> expected = {{96, 384, 12},  {108, 408, 12}, {120, 432, 12}, {132, 456, 12},
                               {144, 396, 12}, {156, 420, 12}, {168, 444, 12}, {180, 468, 12},
                               {288, 480, 12}, {300, 504, 12}, {312, 528, 12}, {324, 552, 12},
                               {336, 492, 12}, {348, 516, 12}, {360, 540, 12}, {372, 564, 12}};
  EXPECT_EQ(Plan(local, remote, {1, 3}, {4, 5}), expected);
}

// Packed K|V with K wider than V (head_size 3, head_size_v 2): [8,2,4,5], strides [40,20,5,1]
// -> bytes: block 80, head 40, token 10; K at +0 (6 B), V at +6 (4 B). A (h,t) cell is 10 B,
// cells tile the block: nothing overlaps. block_bytes = 2 heads * 4 tokens * 10 B = 80; extent
// 8 * 80 = 640. Against the same layout with 16 blocks each block is one 80-byte run:
//   1 -> 4: (80, 320, 80); 3 -> 5: (240, 400, 80).
// (K narrower than V, 2|3, is the mirror case and must work the same way.)
TEST(LayoutTest, PackedKeyWiderThanValue) {
  CacheSpec spec = KvSpec(4, 2, 3);
  spec.head_size_v = 2;
  Result<LayerLayout> local = DescribeLayer("l0", Geo({8, 2, 4, 5}), spec);
  ASSERT_TRUE(local.ok()) << "packed [8,2,4,5] K=3 V=2 rejected: " << local.status().ToString();
  Result<LayerLayout> remote = DescribeLayer("r0", Geo({16, 2, 4, 5}), spec);
  ASSERT_TRUE(remote.ok()) << remote.status().ToString();
  EXPECT_EQ(local->block_stride(), 80);
  EXPECT_EQ(local->block_bytes(), 80);
  EXPECT_EQ(local->span_bytes(), 640);
  EXPECT_EQ(local->params().plane_offset[1], 6);
  EXPECT_EQ(local->params().plane_bytes[1], 4);
  EXPECT_EQ(Plan(*local, *remote, {1, 3}, {4, 5}),
            (std::vector<Triple>{{80, 320, 80}, {240, 400, 80}}));
  // The same numbers received from a peer must validate too.
  EXPECT_TRUE(LayerLayout::FromParams("peer.0", local->params()).ok());
}

TEST(LayoutTest, PackedKeyNarrowerThanValue) {
  // [8,2,4,5] with K 2 | V 3: K at +0 (4 B), V at +4 (6 B); the same 80-byte blocks.
  CacheSpec spec = KvSpec(4, 2, 2);
  spec.head_size_v = 3;
  LayerLayout local = Describe("l0", Geo({8, 2, 4, 5}), spec);
  LayerLayout remote = Describe("r0", Geo({16, 2, 4, 5}), spec);
  EXPECT_EQ(local.params().plane_offset[1], 4);
  EXPECT_EQ(local.params().plane_bytes[1], 6);
  EXPECT_EQ(Plan(local, remote, {1, 3}, {4, 5}),
            (std::vector<Triple>{{80, 320, 80}, {240, 400, 80}}));
}

// Block-interleaved padded page: two layers share each 224-byte page (layer 0 at +0, layer 1 at
// +96, 32 B of padding); this is layer 1's view, [8,2,4,6] with strides [112,24,6,1] elements
// -> bytes: block 224 (> 96 logical bytes per block), head 48, token 12.
// Extent: 7*224 + 96 = 1664. Against a contiguous remote [16,2,4,6] (block 96):
//   1 -> 4: (224, 384, 96); 3 -> 5: (672, 480, 96). Local blocks 1,2 do not touch (224+96 !=
//   448), so 1,2 -> 4,5 stays two runs: (224,384,96), (448,480,96).
TEST(LayoutTest, PaddedPageBlockStrideLargerThanBlock) {
  LayerLayout local = Describe("l1", Geo({8, 2, 4, 6}, {112, 24, 6, 1}), Small());
  LayerLayout remote = Describe("r1", Geo({16, 2, 4, 6}), Small());
  EXPECT_EQ(local.block_stride(), 224);
  EXPECT_EQ(local.block_bytes(), 96);
  EXPECT_EQ(local.span_bytes(), 1664);
  EXPECT_EQ(Plan(local, remote, {1, 3}, {4, 5}),
            (std::vector<Triple>{{224, 384, 96}, {672, 480, 96}}));
  EXPECT_EQ(Plan(local, remote, {1, 2}, {4, 5}),
            (std::vector<Triple>{{224, 384, 96}, {448, 480, 96}}));
}

// Packed standardized local ([8,2,4,6]: cell b*96 + h*48 + t*12 + p*6) against a separated
// remote ([2,16,4,2,3]: cell p*768 + rb*48 + t*12 + h*6). Neighbouring local cells (K then V
// of one (h,t), or V of t then K of t+1) never touch on the remote side, so every 6-byte cell
// is its own run. For block 1 -> 4 (bases 96, 192), in local order:
//   h0 t0 K (96,192) V (102,960); h0 t1 K (108,204) V (114,972); h0 t2 K (120,216) V (126,984);
//   h0 t3 K (132,228) V (138,996); h1 t0 K (144,198) V (150,966); h1 t1 K (156,210) V (162,978);
//   h1 t2 K (168,222) V (174,990); h1 t3 K (180,234) V (186,1002).  All 6 B.
TEST(LayoutTest, PackedToSeparatedPairsLogicalContent) {
  LayerLayout local = Describe("l0", Geo({8, 2, 4, 6}), Small());
  LayerLayout remote = Describe("r0", Geo({2, 16, 4, 2, 3}), Small());
  std::vector<Triple> expected = {{96, 192, 6},  {102, 960, 6}, {108, 204, 6}, {114, 972, 6},
                               {120, 216, 6}, {126, 984, 6}, {132, 228, 6}, {138, 996, 6},
                               {144, 198, 6}, {150, 966, 6}, {156, 210, 6}, {162, 978, 6},
                               {168, 222, 6}, {174, 990, 6}, {180, 234, 6}, {186, 1002, 6}};
  EXPECT_EQ(Plan(local, remote, {1}, {4}), expected);
}

// ---------------------------------------------------------------------------------------------
// Block-id handling.

TEST(LayoutTest, UnsortedLocalIdsGiveOutputSortedByLocalOffset) {
  LayerLayout local = Describe("l0", Geo({2, 8, 4, 2, 3}), Small());
  LayerLayout remote = Describe("r0", Geo({2, 16, 4, 2, 3}), Small());
  // Same pairs as the worked example, listed backwards: identical plan.
  EXPECT_EQ(Plan(local, remote, {3, 1}, {5, 4}),
            (std::vector<Triple>{{48, 192, 48}, {144, 240, 48}, {432, 960, 48}, {528, 1008, 48}}));
  // 3 -> 4 and 1 -> 5: block 1 (local 48) pairs with remote 5 (240), block 3 (144) with 4 (192).
  EXPECT_EQ(Plan(local, remote, {3, 1}, {4, 5}),
            (std::vector<Triple>{{48, 240, 48}, {144, 192, 48}, {432, 1008, 48}, {528, 960, 48}}));
}

TEST(LayoutTest, ConsecutiveBlocksMergeWhenBothSidesContiguous) {
  LayerLayout local = Describe("l0", Geo({2, 8, 4, 2, 3}), Small());
  LayerLayout remote = Describe("r0", Geo({2, 16, 4, 2, 3}), Small());
  // 1,2,3 -> 4,5,6: K local [48,192) <- remote [192,336): one 144-byte run; V likewise at
  // local 384+48 = 432, remote 768+192 = 960.
  EXPECT_EQ(Plan(local, remote, {1, 2, 3}, {4, 5, 6}),
            (std::vector<Triple>{{48, 192, 144}, {432, 960, 144}}));
  // 1,2 -> 4,6: local touches, remote does not (192+48 != 288): no merge.
  EXPECT_EQ(Plan(local, remote, {1, 2}, {4, 6}),
            (std::vector<Triple>{{48, 192, 48}, {96, 288, 48}, {432, 960, 48}, {480, 1056, 48}}));
  // The interleaved layout merges K|V of a block and then across blocks: 1,2 -> 4,5 on
  // [8,2,4,2,3] -> [16,2,4,2,3] is local [96,288) <- remote [384,576): (96, 384, 192).
  LayerLayout il = Describe("l1", Geo({8, 2, 4, 2, 3}), Small());
  LayerLayout ir = Describe("r1", Geo({16, 2, 4, 2, 3}), Small());
  EXPECT_EQ(Plan(il, ir, {1, 2}, {4, 5}), (std::vector<Triple>{{96, 384, 192}}));
}

TEST(LayoutTest, LocalShorterThanRemotePairsWithFirstRemoteIds) {
  LayerLayout local = Describe("l0", Geo({2, 8, 4, 2, 3}), Small());
  LayerLayout remote = Describe("r0", Geo({2, 16, 4, 2, 3}), Small());
  // Only 1 -> 4 is copied; remote id 5 is ignored.
  EXPECT_EQ(Plan(local, remote, {1}, {4, 5}),
            (std::vector<Triple>{{48, 192, 48}, {432, 960, 48}}));
}

TEST(LayoutTest, EmptyLocalGivesEmptyPlan) {
  LayerLayout local = Describe("l0", Geo({2, 8, 4, 2, 3}), Small());
  LayerLayout remote = Describe("r0", Geo({2, 16, 4, 2, 3}), Small());
  Result<CopyPlan> p = PlanBlockCopies(local, remote, Ids{}, Ids{4, 5});
  ASSERT_TRUE(p.ok()) << p.status().ToString();
  EXPECT_EQ(p->size(), 0u);
  EXPECT_EQ(p->total_bytes(), 0);
  Result<CopyPlan> q = PlanBlockCopies(local, remote, Ids{}, Ids{});
  ASSERT_TRUE(q.ok()) << q.status().ToString();
  EXPECT_EQ(q->size(), 0u);
}

TEST(LayoutTest, LocalLongerThanRemoteIsAnError) {
  LayerLayout local = Describe("l0", Geo({2, 8, 4, 2, 3}), Small());
  LayerLayout remote = Describe("r0", Geo({2, 16, 4, 2, 3}), Small());
  Result<CopyPlan> p = PlanBlockCopies(local, remote, Ids{1, 2, 3}, Ids{4, 5});
  ASSERT_FALSE(p.ok());
  EXPECT_TRUE(Contains(p.status().message(), "longer than remote")) << p.status().message();
}

TEST(LayoutTest, BlockIdsOutOfRangeOnEitherSide) {
  // Local holds 8 blocks, remote 16: each side is checked against its OWN count.
  LayerLayout local = Describe("l0", Geo({2, 8, 4, 2, 3}), Small());
  LayerLayout remote = Describe("r0", Geo({2, 16, 4, 2, 3}), Small());
  // Highest valid ids on both sides work: 7 -> 15: K (7*48, 15*48) = (336, 720); V (384+336,
  // 768+720) = (720, 1488).
  EXPECT_EQ(Plan(local, remote, {7}, {15}),
            (std::vector<Triple>{{336, 720, 48}, {720, 1488, 48}}));
  Result<CopyPlan> bad_local = PlanBlockCopies(local, remote, Ids{0, 8}, Ids{1, 2});
  ASSERT_FALSE(bad_local.ok());
  EXPECT_EQ(bad_local.status().code(), StatusCode::kOutOfRange);
  EXPECT_TRUE(Contains(bad_local.status().message(), "8")) << bad_local.status().message();
  EXPECT_TRUE(Contains(bad_local.status().message(), "local")) << bad_local.status().message();
  // Remote id 8..15 is fine although local has only 8 blocks; 16 is not.
  EXPECT_TRUE(PlanBlockCopies(local, remote, Ids{0}, Ids{8}).ok());
  Result<CopyPlan> bad_remote = PlanBlockCopies(local, remote, Ids{0, 1}, Ids{3, 16});
  ASSERT_FALSE(bad_remote.ok());
  EXPECT_EQ(bad_remote.status().code(), StatusCode::kOutOfRange);
  EXPECT_TRUE(Contains(bad_remote.status().message(), "remote")) << bad_remote.status().message();
  EXPECT_TRUE(Contains(bad_remote.status().message(), "16")) << bad_remote.status().message();
  // Negative ids.
  EXPECT_FALSE(PlanBlockCopies(local, remote, Ids{-1}, Ids{1}).ok());
  EXPECT_FALSE(PlanBlockCopies(local, remote, Ids{1}, Ids{-1}).ok());
}

TEST(LayoutTest, StampLeavesOutputEmptyOnError) {
  LayerLayout local = Describe("l0", Geo({2, 8, 4, 2, 3}), Small());
  LayerLayout remote = Describe("r0", Geo({2, 16, 4, 2, 3}), Small());
  Result<BlockTemplate> tmpl = BlockTemplate::Build(local, remote);
  ASSERT_TRUE(tmpl.ok()) << tmpl.status().ToString();
  Result<BlockPairs> good = BlockPairs::Create(Ids{1}, Ids{4});
  ASSERT_TRUE(good.ok());
  CopyPlan out;
  ASSERT_TRUE(StampBlockCopies(*tmpl, *good, &out).ok());
  EXPECT_EQ(out.size(), 2u);
  Result<BlockPairs> bad = BlockPairs::Create(Ids{1, 2}, Ids{4, 99});
  ASSERT_TRUE(bad.ok());
  EXPECT_FALSE(StampBlockCopies(*tmpl, *bad, &out).ok());
  EXPECT_EQ(out.size(), 0u);
}

// Unsorted local ids come out ascending with their remote ids carried along, whether the ids
// are dense (placed by id) or sparse (sorted): both orders of the same pairs give one result.
TEST(LayoutTest, BlockPairsSortLocalIdsCarryingRemoteIds) {
  struct Case {
    Ids local, remote, local_sorted, remote_by_local;
  };
  const std::vector<Case> cases = {
      {{7, 2, 9, 0, 4}, {10, 11, 12, 13, 14}, {0, 2, 4, 7, 9}, {13, 11, 14, 10, 12}},
      {{900000, 3, 70000, 12}, {1, 2, 3, 4}, {3, 12, 70000, 900000}, {2, 4, 3, 1}},
      {{5, 1}, {0, 9, 8}, {1, 5}, {9, 0}},  // remote longer: only the first two used
  };
  for (const Case& c : cases) {
    Result<BlockPairs> pairs = BlockPairs::Create(c.local, c.remote);
    ASSERT_TRUE(pairs.ok()) << pairs.status().ToString();
    EXPECT_EQ(Ids(pairs->local_sorted().begin(), pairs->local_sorted().end()), c.local_sorted);
    EXPECT_EQ(Ids(pairs->remote_by_local().begin(), pairs->remote_by_local().end()),
              c.remote_by_local);
    EXPECT_EQ(pairs->max_local(), c.local_sorted.back());
  }
}

// Requests of growing and shrinking sizes and spans, one after another and on several threads
// at once, each come out as a reference sort of their own pairs (nothing left over from the
// call before), and a pairs object stays intact after later ones were created.
TEST(LayoutTest, BlockPairsSortedOneAfterAnotherKeepTheirOwnPairs) {
  auto check = [](std::uint32_t seed) {
    std::mt19937_64 rng(seed);
    std::vector<BlockPairs> kept;
    std::vector<std::vector<std::pair<std::int64_t, std::int64_t>>> expected;
    for (const std::size_t n : {2048u, 64u, 4096u, 1u, 700u, 2048u}) {
      Ids pool(n * 3);
      std::iota(pool.begin(), pool.end(), 0);
      std::shuffle(pool.begin(), pool.end(), rng);
      const Ids local(pool.begin(), pool.begin() + static_cast<std::ptrdiff_t>(n));
      std::shuffle(pool.begin(), pool.end(), rng);
      const Ids remote(pool.begin(), pool.begin() + static_cast<std::ptrdiff_t>(n));
      std::vector<std::pair<std::int64_t, std::int64_t>> ref;
      for (std::size_t i = 0; i < n; ++i) ref.emplace_back(local[i], remote[i]);
      std::sort(ref.begin(), ref.end());
      Result<BlockPairs> pairs = BlockPairs::Create(local, remote);
      ASSERT_TRUE(pairs.ok()) << pairs.status().ToString();
      kept.push_back(std::move(pairs).value());
      expected.push_back(std::move(ref));
    }
    for (std::size_t k = 0; k < kept.size(); ++k) {
      const auto l = kept[k].local_sorted();
      const auto r = kept[k].remote_by_local();
      ASSERT_EQ(l.size(), expected[k].size()) << "request " << k;
      for (std::size_t i = 0; i < l.size(); ++i) {
        ASSERT_EQ(l[i], expected[k][i].first) << "request " << k << " position " << i;
        ASSERT_EQ(r[i], expected[k][i].second) << "request " << k << " position " << i;
      }
    }
  };
  check(1);
  std::vector<std::thread> threads;
  for (std::uint32_t t = 0; t < 3; ++t) threads.emplace_back([&, t] { check(10 + t); });
  for (std::thread& t : threads) t.join();
}

TEST(LayoutTest, DuplicateBlockIdsRejected) {
  LayerLayout local = Describe("l0", Geo({2, 8, 4, 2, 3}), Small());
  LayerLayout remote = Describe("r0", Geo({2, 16, 4, 2, 3}), Small());
  Result<CopyPlan> dup_local = PlanBlockCopies(local, remote, Ids{1, 3, 1}, Ids{4, 5, 6});
  ASSERT_FALSE(dup_local.ok());
  EXPECT_TRUE(Contains(dup_local.status().message(), "duplicate")) << dup_local.status().message();
  // Two local blocks into the same remote block would overwrite each other.
  Result<CopyPlan> dup_remote = PlanBlockCopies(local, remote, Ids{1, 3}, Ids{5, 5});
  ASSERT_FALSE(dup_remote.ok());
  EXPECT_TRUE(Contains(dup_remote.status().message(), "duplicate"))
      << dup_remote.status().message();
  // Unsorted remote duplicates are found too.
  EXPECT_FALSE(PlanBlockCopies(local, remote, Ids{1, 2, 3}, Ids{5, 4, 5}).ok());
}

// Every way BlockPairs orders and checks ids (ascending local ids kept as they are; dense ids
// placed by id; ids too spread for that but within a bitmap; ids too sparse for a bitmap,
// sorted) gives the pairs sorted by local id, or the same error: a negative id before a
// repeated one (naming its position and both ids), a repeated local id before a repeated remote
// one; the repeat reported is the first in input order where a bitmap fits, else the smallest.
TEST(LayoutTest, BlockPairsEveryPathSortsAndRefusesAlike) {
  struct Case {
    const char* what;
    Ids local, remote;
    Ids local_sorted, remote_by_local;  // when it succeeds
    std::string error;                  // the whole message when it fails
  };
  const std::vector<Case> cases = {
      {"ascending local, ascending remote", {1, 4, 6}, {0, 2, 3}, {1, 4, 6}, {0, 2, 3}, ""},
      {"ascending local, unsorted remote", {1, 4, 6}, {3, 0, 2}, {1, 4, 6}, {3, 0, 2}, ""},
      {"ascending local, repeated remote", {1, 4, 6}, {8, 2, 8}, {}, {}, "duplicate remote block id 8"},
      {"dense", {7, 2, 9, 0, 4}, {10, 11, 12, 13, 14}, {0, 2, 4, 7, 9}, {13, 11, 14, 10, 12}, ""},
      {"dense, first id the largest", {4095, 0, 17}, {1, 2, 3}, {0, 17, 4095}, {2, 3, 1}, ""},
      {"dense, remote id 0 and the largest", {2, 1}, {0, std::numeric_limits<std::int64_t>::max()},
       {1, 2}, {std::numeric_limits<std::int64_t>::max(), 0}, ""},
      {"dense, repeats: first in input order", {5, 9, 7, 9, 5}, {0, 1, 2, 3, 4}, {}, {},
       "duplicate local block id 9"},
      {"dense, repeated remote", {3, 1, 2}, {7, 8, 7}, {}, {}, "duplicate remote block id 7"},
      {"dense, both repeated: local first", {3, 1, 3}, {6, 6, 5}, {}, {}, "duplicate local block id 3"},
      {"dense, negative after a repeat", {5, 5, -1}, {0, 1, 2}, {}, {},
       "negative block id at position 2: local -1, remote 2"},
      {"dense, negative remote", {5, 2}, {0, -4}, {}, {},
       "negative block id at position 1: local 2, remote -4"},
      {"spread", {90000, 5, 70000}, {1, 2, 3}, {5, 70000, 90000}, {2, 3, 1}, ""},
      {"spread, repeats: first in input order", {90000, 5, 70000, 90000, 5}, {0, 1, 2, 3, 4}, {},
       {}, "duplicate local block id 90000"},
      {"spread, repeated remote", {90000, 5}, {4, 4}, {}, {}, "duplicate remote block id 4"},
      {"sparse", {900000, 5, 700000}, {1, 2, 3}, {5, 700000, 900000}, {2, 3, 1}, ""},
      {"sparse, repeats: the smallest", {900000, 5, 700000, 900000, 5}, {0, 1, 2, 3, 4}, {}, {},
       "duplicate local block id 5"},
      {"sparse, both repeated: local first", {900000, 7, 900000}, {3, 3, 1}, {}, {},
       "duplicate local block id 900000"},
      {"sparse, repeated remote", {900000, 7}, {1 << 30, 1 << 30}, {}, {},
       "duplicate remote block id 1073741824"},
  };
  for (const Case& c : cases) {
    SCOPED_TRACE(c.what);
    Result<BlockPairs> pairs = BlockPairs::Create(c.local, c.remote);
    if (!c.error.empty()) {
      ASSERT_FALSE(pairs.ok());
      EXPECT_EQ(pairs.status().message(), c.error);
      continue;
    }
    ASSERT_TRUE(pairs.ok()) << pairs.status().ToString();
    EXPECT_EQ(Ids(pairs->local_sorted().begin(), pairs->local_sorted().end()), c.local_sorted);
    EXPECT_EQ(Ids(pairs->remote_by_local().begin(), pairs->remote_by_local().end()),
              c.remote_by_local);
    EXPECT_EQ(pairs->max_local(), c.local_sorted.back());
    EXPECT_EQ(pairs->max_remote(), *std::max_element(c.remote.begin(), c.remote.end()));
  }
}

// A request's worth of random dense ids (as a decode's READ names them) with one local or one
// remote id repeated at random positions: the repeat is the one reported, and without it the
// pairs come out sorted by local id.
TEST(LayoutTest, BlockPairsDenseRepeatsFoundAtAnyPosition) {
  std::mt19937_64 rng(7);
  for (int round = 0; round < 20; ++round) {
    SCOPED_TRACE(round);
    Ids pool(4096);
    std::iota(pool.begin(), pool.end(), 0);
    std::shuffle(pool.begin(), pool.end(), rng);
    Ids local(pool.begin(), pool.begin() + 2048);
    std::shuffle(pool.begin(), pool.end(), rng);
    Ids remote(pool.begin(), pool.begin() + 2048);
    std::uniform_int_distribution<std::size_t> at(0, 2047);
    const std::size_t from = at(rng);
    std::size_t to = at(rng);
    if (to == from) to = (from + 1) % 2048;
    Ids* side = round % 2 == 0 ? &local : &remote;
    const std::int64_t replaced = (*side)[to];
    (*side)[to] = (*side)[from];
    Result<BlockPairs> bad = BlockPairs::Create(local, remote);
    ASSERT_FALSE(bad.ok());
    EXPECT_EQ(bad.status().message(), std::string("duplicate ") +
                                          (round % 2 == 0 ? "local" : "remote") + " block id " +
                                          std::to_string((*side)[from]));
    (*side)[to] = replaced;
    Result<BlockPairs> good = BlockPairs::Create(local, remote);
    ASSERT_TRUE(good.ok()) << good.status().ToString();
    std::vector<std::pair<std::int64_t, std::int64_t>> ref;
    for (std::size_t i = 0; i < local.size(); ++i) ref.emplace_back(local[i], remote[i]);
    std::sort(ref.begin(), ref.end());
    for (std::size_t i = 0; i < ref.size(); ++i) {
      ASSERT_EQ(good->local_sorted()[i], ref[i].first) << "position " << i;
      ASSERT_EQ(good->remote_by_local()[i], ref[i].second) << "position " << i;
    }
  }
}

// ---------------------------------------------------------------------------------------------
// Logical mismatches.

TEST(LayoutTest, LogicalMismatchNamesBothLayouts) {
  LayerLayout base = Describe("model.layers.0", Geo({2, 8, 4, 2, 3}), Small());
  struct Case {
    std::string what;
    TensorGeometry geometry;
    CacheSpec spec;
    std::string remote_token;  // the remote's differing field as DescribeLogical prints it
  };
  std::vector<Case> cases = {
      {"block size", Geo({2, 8, 8, 2, 3}), KvSpec(8, 2, 3), "block_size=8"},
      {"heads", Geo({2, 8, 4, 4, 3}), Ordered(KvSpec(4, 4, 3), AxisOrder::kNhd), "heads=4"},
      {"head size", Geo({2, 8, 4, 2, 5}), KvSpec(4, 2, 5), "K=10B"},
      {"dtype", Geo({2, 8, 4, 2, 3}, {}, 4), KvSpec(4, 2, 3, 4), "dtype_bytes=4"},
  };
  for (const Case& c : cases) {
    LayerLayout other = Describe("peer.layers.0", c.geometry, c.spec);
    Result<BlockTemplate> t = BlockTemplate::Build(base, other);
    ASSERT_FALSE(t.ok()) << c.what;
    EXPECT_EQ(t.status().code(), StatusCode::kIncompatible) << c.what;
    const std::string msg = t.status().message();
    EXPECT_TRUE(Contains(msg, "model.layers.0")) << c.what << ": " << msg;
    EXPECT_TRUE(Contains(msg, "peer.layers.0")) << c.what << ": " << msg;
    // Both sides' values appear: ours (block_size=4 heads=2 K=6B dtype_bytes=2) and theirs.
    EXPECT_TRUE(Contains(msg, "block_size=4")) << c.what << ": " << msg;
    EXPECT_TRUE(Contains(msg, c.remote_token)) << c.what << ": " << msg;
    EXPECT_FALSE(PlanBlockCopies(base, other, Ids{1}, Ids{1}).ok()) << c.what;
  }
  // K/V against latent with the same bytes per block is a different kind.
  LayerLayout latent = Describe("mla", Geo({8, 4, 12}), LatentSpec(4, 12));
  EXPECT_FALSE(BlockTemplate::Build(base, latent).ok());
}

TEST(LayoutTest, SpecMismatchWithTensorIsAnError) {
  // Tensor has head size 3, spec says 4.
  Result<LayerLayout> r = DescribeLayer("l0", Geo({2, 8, 4, 2, 3}), KvSpec(4, 2, 4));
  ASSERT_FALSE(r.ok());
  EXPECT_TRUE(Contains(r.status().message(), "l0")) << r.status().message();
  // Element size 2 but spec dtype_bytes 1.
  EXPECT_FALSE(DescribeLayer("l0", Geo({2, 8, 4, 2, 3}), KvSpec(4, 2, 3, 1)).ok());
  // No axis holds block_size 5 tokens.
  Result<LayerLayout> b = DescribeLayer("l0", Geo({2, 8, 4, 2, 3}), KvSpec(5, 2, 3));
  ASSERT_FALSE(b.ok());
  EXPECT_TRUE(Contains(b.status().message(), "[2, 8, 4, 2, 3]")) << b.status().message();
  // A 3-D tensor is not a K/V cache.
  EXPECT_FALSE(DescribeLayer("l0", Geo({8, 4, 6}), Small()).ok());
  // Kernel blocks that do not fill whole manager blocks: 15 kernel blocks of 2 tokens, block 4.
  EXPECT_FALSE(DescribeLayer("l0", Geo({2, 15, 2, 2, 3}), Small()).ok());
}

// ---------------------------------------------------------------------------------------------
// Views that must be refused.

TEST(LayoutTest, OverlappingViewsRejected) {
  // expand() of the plane axis: K and V are the same bytes (stride 0).
  Result<LayerLayout> expand =
      DescribeLayer("l0", Geo({2, 8, 4, 2, 3}, {0, 24, 6, 3, 1}), Small());
  ASSERT_FALSE(expand.ok());
  EXPECT_TRUE(Contains(expand.status().message(), "overlap")) << expand.status().message();
  // Block stride 0: every block aliases block 0.
  EXPECT_FALSE(DescribeLayer("l0", Geo({2, 8, 4, 2, 3}, {192, 0, 6, 3, 1}), Small()).ok());
  // Block stride 12 elements (24 B) while a block spans 48 B: blocks overlap by half.
  EXPECT_FALSE(DescribeLayer("l0", Geo({2, 8, 4, 2, 3}, {192, 12, 6, 3, 1}), Small()).ok());
  // Head stride 2 elements while a head's content is 3: neighbouring heads share a byte pair.
  EXPECT_FALSE(DescribeLayer("l0", Geo({2, 8, 4, 2, 3}, {192, 24, 6, 2, 1}), Small()).ok());
  // Latent with token stride 0.
  EXPECT_FALSE(DescribeLayer("idx", Geo({8, 4, 3}, {12, 0, 1}), LatentSpec(4, 3)).ok());
}

TEST(LayoutTest, NonContiguousLastDimRejected) {
  // Head content strided by 2: a cell is not contiguous bytes.
  Result<LayerLayout> r = DescribeLayer("l0", Geo({2, 8, 4, 2, 3}, {384, 48, 12, 6, 2}), Small());
  ASSERT_FALSE(r.ok());
  EXPECT_TRUE(Contains(r.status().message(), "contiguous")) << r.status().message();
  EXPECT_FALSE(DescribeLayer("idx", Geo({8, 4, 3}, {24, 6, 2}), LatentSpec(4, 3)).ok());
}

TEST(LayoutTest, BadGeometryRejected) {
  // Rank of shape and strides differ.
  EXPECT_FALSE(DescribeLayer("l0", Geo({2, 8, 4, 2, 3}, {192, 24, 6, 1}), Small()).ok());
  // Negative stride.
  EXPECT_FALSE(DescribeLayer("l0", Geo({2, 8, 4, 2, 3}, {192, -24, 6, 3, 1}), Small()).ok());
  // Zero-sized axis.
  EXPECT_FALSE(DescribeLayer("l0", Geo({2, 0, 4, 2, 3}), Small()).ok());
  // Invalid spec numbers.
  EXPECT_FALSE(DescribeLayer("l0", Geo({2, 8, 4, 2, 3}), KvSpec(0, 2, 3)).ok());
  EXPECT_FALSE(DescribeLayer("l0", Geo({2, 8, 4, 2, 3}), KvSpec(4, 2, 3, 0)).ok());
}

// ---------------------------------------------------------------------------------------------
// LayerLayout::FromParams: numbers received from a peer are untrusted.

// Hand-written params of the [2,8,4,2,3] bf16 layout (see SeparatedBlockHeadWorkedExample).
LayoutParams ValidParams() {
  LayoutParams p;
  p.kind = CacheKind::kKeyValue;
  p.num_blocks = 8;
  p.block_size = 4;
  p.kernel_block_size = 4;
  p.num_heads = 2;
  p.dtype_bytes = 2;
  p.block_stride = 48;
  p.kernel_block_stride = 48;
  p.head_stride = 6;
  p.token_stride = 12;
  p.plane_offset = {0, 384};
  p.plane_bytes = {6, 6};
  return p;
}

TEST(LayoutTest, FromParamsAcceptsValidAndComputesExtent) {
  Result<LayerLayout> l = LayerLayout::FromParams("peer.0", ValidParams());
  ASSERT_TRUE(l.ok()) << l.status().ToString();
  EXPECT_EQ(l->span_bytes(), 768);
  EXPECT_EQ(l->block_bytes(), 96);
  // The same layout described from a tensor pairs with it one-to-one (same runs as the
  // worked example's local side against itself: block 1 -> 1 is (48,48,48), (432,432,48)).
  LayerLayout described = Describe("l0", Geo({2, 8, 4, 2, 3}), Small());
  EXPECT_EQ(Plan(described, *l, {1}, {1}), (std::vector<Triple>{{48, 48, 48}, {432, 432, 48}}));
}

TEST(LayoutTest, FromParamsRejectsZeroSizes) {
  auto rejects = [](const char* what, auto mutate) {
    LayoutParams p = ValidParams();
    mutate(p);
    Result<LayerLayout> l = LayerLayout::FromParams("peer.0", p);
    EXPECT_FALSE(l.ok()) << what;
    if (!l.ok()) {
      EXPECT_EQ(l.status().code(), StatusCode::kInvalidArgument) << what;
      EXPECT_TRUE(Contains(l.status().message(), "peer.0")) << what << ": " << l.status().message();
    }
  };
  rejects("num_blocks 0", [](LayoutParams& p) { p.num_blocks = 0; });
  rejects("block_size 0", [](LayoutParams& p) { p.block_size = 0; });
  rejects("kernel_block_size 0", [](LayoutParams& p) { p.kernel_block_size = 0; });
  rejects("num_heads 0", [](LayoutParams& p) { p.num_heads = 0; });
  rejects("dtype_bytes 0", [](LayoutParams& p) { p.dtype_bytes = 0; });
  rejects("plane_bytes[0] 0", [](LayoutParams& p) { p.plane_bytes[0] = 0; });
  rejects("plane_bytes[1] 0", [](LayoutParams& p) { p.plane_bytes[1] = 0; });
  rejects("negative block stride", [](LayoutParams& p) { p.block_stride = -48; });
  rejects("negative num_blocks", [](LayoutParams& p) { p.num_blocks = -1; });
  rejects("kernel block not dividing", [](LayoutParams& p) { p.kernel_block_size = 3; });
  rejects("kernel block > block", [](LayoutParams& p) { p.kernel_block_size = 8; });
  rejects("plane 0 offset", [](LayoutParams& p) { p.plane_offset[0] = 6; });
  rejects("latent with a second plane", [](LayoutParams& p) { p.kind = CacheKind::kLatent; });
  rejects("unknown kind", [](LayoutParams& p) { p.kind = static_cast<CacheKind>(7); });
}

TEST(LayoutTest, FromParamsRejectsOverlappingCells) {
  auto rejects = [](const char* what, auto mutate) {
    LayoutParams p = ValidParams();
    mutate(p);
    EXPECT_FALSE(LayerLayout::FromParams("peer.0", p).ok()) << what;
  };
  // Heads 4 B apart but a cell is 6 B.
  rejects("head stride < cell", [](LayoutParams& p) { p.head_stride = 4; });
  // Tokens 6 B apart: token t+1 head 0 lands on token t head 1.
  rejects("token stride hits heads", [](LayoutParams& p) { p.token_stride = 6; });
  // Blocks 24 B apart but a plane of a block spans 48 B.
  rejects("block stride < block", [](LayoutParams& p) { p.block_stride = 24; });
  // V plane at 200: inside the K plane's 8 blocks * 48 B = 384 bytes.
  rejects("V inside K", [](LayoutParams& p) { p.plane_offset[1] = 200; });
  // V at offset 0 = K.
  rejects("V on K", [](LayoutParams& p) { p.plane_offset[1] = 0; });
  // Every stride 0.
  rejects("all strides 0", [](LayoutParams& p) {
    p.block_stride = p.kernel_block_stride = p.head_stride = p.token_stride = 0;
  });
  // Kernel blocks 12 B apart inside a block while a kernel block of 2 tokens spans 24 B.
  rejects("kernel blocks overlap", [](LayoutParams& p) {
    p.kernel_block_size = 2;
    p.kernel_block_stride = 12;
  });
}

TEST(LayoutTest, FromParamsRejectsAbsurdAndOverflowingNumbers) {
  auto rejects = [](const char* what, auto mutate) {
    LayoutParams p = ValidParams();
    mutate(p);
    EXPECT_FALSE(LayerLayout::FromParams("peer.0", p).ok()) << what;
  };
  constexpr std::int64_t kBig = std::int64_t{1} << 62;
  rejects("huge num_blocks", [](LayoutParams& p) { p.num_blocks = kBig; });
  rejects("huge block stride", [](LayoutParams& p) { p.block_stride = kBig; });
  rejects("max int64 stride", [](LayoutParams& p) {
    p.block_stride = std::numeric_limits<std::int64_t>::max();
  });
  rejects("huge heads", [](LayoutParams& p) { p.num_heads = kBig; });
  rejects("huge block size", [](LayoutParams& p) {
    p.block_size = kBig;
    p.kernel_block_size = kBig;
  });
  rejects("huge plane bytes", [](LayoutParams& p) { p.plane_bytes = {kBig, kBig}; });
  rejects("huge plane offset", [](LayoutParams& p) { p.plane_offset[1] = kBig; });
  rejects("absurd dtype", [](LayoutParams& p) { p.dtype_bytes = 1 << 20; });
  // Each number inside its own limit, but the extent num_blocks * block_stride overflows int64:
  // 2^40 blocks of 2^40 bytes.
  rejects("extent overflow", [](LayoutParams& p) {
    p.num_blocks = std::int64_t{1} << 40;
    p.block_stride = std::int64_t{1} << 40;
    p.kernel_block_stride = std::int64_t{1} << 40;
    p.plane_offset[1] = std::int64_t{1} << 55;
  });
  // A block of 2^20 tokens * 2^16 heads * 2 planes: far more cells per block than any cache.
  rejects("cells per block", [](LayoutParams& p) {
    p.block_size = p.kernel_block_size = std::int64_t{1} << 20;
    p.num_heads = std::int64_t{1} << 16;
    p.token_stride = 6 << 16;
    p.block_stride = p.kernel_block_stride = p.token_stride << 20;
    p.plane_offset[1] = p.block_stride * 8;
  });
}

}  // namespace
}  // namespace moriio_native
