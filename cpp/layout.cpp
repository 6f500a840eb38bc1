#include "moriio_native/layout.hpp"

#include <algorithm>
#include <cstring>
#include <numeric>

#include "checked_math.hpp"

namespace moriio_native {
namespace {

using detail::CheckedAdd;
using detail::CheckedMul;

// Limits on what any layout may claim. They bound every product below, so a peer's metadata
// cannot make us allocate or compute beyond them.
constexpr std::int64_t kMaxBlocks = std::int64_t{1} << 40;
constexpr std::int64_t kMaxBlockSize = std::int64_t{1} << 20;
constexpr std::int64_t kMaxHeads = std::int64_t{1} << 16;
constexpr std::int64_t kMaxCellsPerBlock = std::int64_t{1} << 24;
constexpr std::int64_t kMaxBytes = std::int64_t{1} << 56;

std::string ShapeString(const std::vector<std::int64_t>& v) {
  // Plain string building: iostreams misbehave when the host process (e.g. torch) loaded another
  // libstdc++ first.
  std::string out = "[";
  for (std::size_t i = 0; i < v.size(); ++i) out += (i ? ", " : "") + std::to_string(v[i]);
  return out + "]";
}

std::string LayerPrefix(const std::string& name) { return "layer '" + name + "'"; }

// One axis of a strided object: `size` steps of `stride` bytes.
struct Axis {
  std::int64_t size;
  std::int64_t stride;
};

// True when no two distinct index tuples of `axes` (each addressing `unit` contiguous bytes)
// overlap: sorted by stride, each axis must step past everything the inner axes cover.
bool AxesDoNotOverlap(std::vector<Axis> axes, std::int64_t unit) {
  std::erase_if(axes, [](const Axis& a) { return a.size <= 1; });
  std::sort(axes.begin(), axes.end(), [](const Axis& a, const Axis& b) { return a.stride < b.stride; });
  std::int64_t covered = unit;
  for (const Axis& a : axes) {
    if (a.stride < covered) return false;
    std::int64_t extent = 0;
    if (!CheckedMul(a.stride, a.size - 1, &extent) || !CheckedAdd(extent, covered, &covered)) {
      return false;
    }
  }
  return true;
}

// Where the token axis of a K/V or latent tensor is, and how blocks split into kernel blocks.
struct TokenAxis {
  int axis = -1;
  int head_axis = -1;
  std::int64_t kernel_block_size = 0;
};

bool KernelSizeFits(std::int64_t kernel_tokens, std::int64_t block_size) {
  return kernel_tokens > 0 && kernel_tokens <= block_size && block_size % kernel_tokens == 0;
}

bool HeadsFit(std::int64_t heads, const CacheSpec& spec) {
  return !spec.num_kv_heads || *spec.num_kv_heads == heads;
}

// The reading of `g` with `tokens` as the token axis (a whole block or a kernel block dividing
// it) and `heads` as the head axis, when the spec allows it.
std::optional<TokenAxis> TokensAt(const TensorGeometry& g, const CacheSpec& spec, int tokens,
                                  int heads) {
  if (!KernelSizeFits(g.shape[tokens], spec.block_size) || !HeadsFit(g.shape[heads], spec)) {
    return std::nullopt;
  }
  return TokenAxis{tokens, heads, g.shape[tokens]};
}

std::string AxisString(const TensorGeometry& g, int axis) {
  return "axis " + std::to_string(axis) + " (size " + std::to_string(g.shape[axis]) + ")";
}

std::string SpecNumbers(const CacheSpec& spec) {
  return "block_size " + std::to_string(spec.block_size) +
         (spec.num_kv_heads ? ", num_kv_heads " + std::to_string(*spec.num_kv_heads)
                            : std::string(", num_kv_heads unknown"));
}

// Picks which of the 5-D axes a (first) and b carries tokens; the other carries heads. The spec's
// axis_order decides when given (and must fit the shape); otherwise the shape must admit exactly
// one reading. Equal sizes (heads == block size or kernel block size) admit both: then the
// answer is "Ambiguous", never a guess, since the two readings address different bytes.
Result<TokenAxis> ResolveTokenAxis(const std::string& name, const TensorGeometry& g,
                                   const CacheSpec& spec, int a, int b) {
  const std::optional<TokenAxis> nhd = TokensAt(g, spec, a, b);
  const std::optional<TokenAxis> hnd = TokensAt(g, spec, b, a);
  if (spec.axis_order != AxisOrder::kAuto) {
    const bool tokens_first = spec.axis_order == AxisOrder::kNhd;
    const std::optional<TokenAxis>& chosen = tokens_first ? nhd : hnd;
    if (chosen) return *chosen;
    const int tokens = tokens_first ? a : b;
    const int heads = tokens_first ? b : a;
    return InvalidArgumentError(LayerPrefix(name) + ": axis_order '" +
                                std::string(AxisOrderName(spec.axis_order)) +
                                "' contradicts shape " +
                                ShapeString(g.shape) + ": tokens at " + AxisString(g, tokens) +
                                " and heads at " + AxisString(g, heads) + " do not fit " +
                                SpecNumbers(spec));
  }
  if (nhd && hnd) {
    // Size-1 axes have no extent: both readings then address the same bytes.
    if (g.shape[a] == 1 && g.shape[b] == 1) return *nhd;
    return InvalidArgumentError(
        "Ambiguous cache shape for " + LayerPrefix(name) + ": " + ShapeString(g.shape) + " (" +
        AxisString(g, a) + " and " + AxisString(g, b) + " can each hold the tokens of " +
        SpecNumbers(spec) + "); set the spec's axis_order to 'nhd' (tokens first) or 'hnd' "
        "(heads first) to say which");
  }
  if (nhd) return *nhd;
  if (hnd) return *hnd;
  return InvalidArgumentError("Unsupported cache shape for " + LayerPrefix(name) + ": " +
                              ShapeString(g.shape) + " has no token axis matching " +
                              SpecNumbers(spec));
}

// Every 4-D form holds heads before tokens ([N,H,B,C]); a caller saying otherwise holds a tensor
// this shape does not describe.
Status CheckHeadsFirst(const std::string& name, const TensorGeometry& g, const CacheSpec& spec) {
  if (spec.axis_order != AxisOrder::kNhd) return Status::OK();
  return InvalidArgumentError(LayerPrefix(name) + ": axis_order 'nhd' contradicts shape " +
                              ShapeString(g.shape) +
                              ": a 4-D cache is [N,H,B,C] (heads before tokens)");
}

Status CheckGeometry(const std::string& name, const TensorGeometry& g, const CacheSpec& spec) {
  if (g.shape.size() != g.strides.size()) {
    return InvalidArgumentError(LayerPrefix(name) + ": shape " + ShapeString(g.shape) +
                                " and strides " + ShapeString(g.strides) + " differ in rank");
  }
  if (g.element_size != spec.dtype_bytes) {
    return InvalidArgumentError(LayerPrefix(name) + ": tensor element size " +
                                std::to_string(g.element_size) + " != spec dtype_bytes " +
                                std::to_string(spec.dtype_bytes));
  }
  for (std::size_t i = 0; i < g.shape.size(); ++i) {
    if (g.shape[i] <= 0 || g.strides[i] < 0) {
      return InvalidArgumentError(LayerPrefix(name) + ": shape " + ShapeString(g.shape) +
                                  " strides " + ShapeString(g.strides) +
                                  " must have positive sizes and non-negative strides");
    }
  }
  if (!g.shape.empty() && g.shape.back() > 1 && g.strides.back() != 1) {
    return InvalidArgumentError(LayerPrefix(name) + ": the last (head content) dimension must be "
                                "contiguous, got strides " + ShapeString(g.strides));
  }
  std::vector<Axis> axes;
  for (std::size_t i = 0; i < g.shape.size(); ++i) {
    std::int64_t stride_bytes = 0;
    if (!CheckedMul(g.strides[i], g.element_size, &stride_bytes)) {
      return InvalidArgumentError(LayerPrefix(name) + ": strides overflow");
    }
    axes.push_back({g.shape[i], stride_bytes});
  }
  if (!AxesDoNotOverlap(axes, g.element_size)) {
    return InvalidArgumentError(LayerPrefix(name) + ": shape " + ShapeString(g.shape) +
                                " with strides " + ShapeString(g.strides) +
                                " addresses some bytes twice (overlapping view)");
  }
  return Status::OK();
}

// Fills the block, kernel-block, head and token fields shared by every branch.
Status FillBlockFields(const std::string& name, const TensorGeometry& g, const CacheSpec& spec,
                       int block_axis, const TokenAxis& tokens, LayoutParams* p) {
  const std::int64_t es = g.element_size;
  const std::int64_t kernel_per_block = spec.block_size / tokens.kernel_block_size;
  if (g.shape[block_axis] % kernel_per_block != 0) {
    return InvalidArgumentError(LayerPrefix(name) + ": shape " + ShapeString(g.shape) + " has " +
                                std::to_string(g.shape[block_axis]) +
                                " kernel blocks, not divisible by " +
                                std::to_string(kernel_per_block) + " kernel blocks per block");
  }
  p->num_blocks = g.shape[block_axis] / kernel_per_block;
  p->block_size = spec.block_size;
  p->kernel_block_size = tokens.kernel_block_size;
  p->dtype_bytes = es;
  p->kernel_block_stride = g.strides[block_axis] * es;
  p->block_stride = p->kernel_block_stride * kernel_per_block;
  p->token_stride = g.strides[tokens.axis] * es;
  p->num_heads = tokens.head_axis >= 0 ? g.shape[tokens.head_axis] : 1;
  p->head_stride = tokens.head_axis >= 0 ? g.strides[tokens.head_axis] * es : 0;
  return Status::OK();
}

Result<LayoutParams> DescribeKeyValue(const std::string& name, const TensorGeometry& g,
                                      const CacheSpec& spec, KvPlaneAxis plane_axis) {
  const auto& s = g.shape;
  const std::int64_t es = g.element_size;
  LayoutParams p;
  p.kind = CacheKind::kKeyValue;
  if (s.size() == 5) {
    int plane = -1;
    if (plane_axis == KvPlaneAxis::kSeparated) plane = 0;
    if (plane_axis == KvPlaneAxis::kInterleaved) plane = 1;
    if (plane_axis == KvPlaneAxis::kAuto) {
      if (s[0] == 2 && s[1] == 2) {
        return InvalidArgumentError("Ambiguous K/V plane axis for " + LayerPrefix(name) + ": " +
                                    ShapeString(s) +
                                    " (both leading axes are 2); pass kv_plane_axis");
      }
      plane = s[0] == 2 ? 0 : (s[1] == 2 ? 1 : -1);
    }
    if (plane < 0 || s[plane] != 2) {
      return InvalidArgumentError("Unsupported K/V cache shape for " + LayerPrefix(name) + ": " +
                                  ShapeString(s) + " has no K/V axis of size 2 in front");
    }
    const std::int64_t d = s[4];
    if ((spec.head_size && *spec.head_size != d) || (spec.head_size_v && *spec.head_size_v != d)) {
      return InvalidArgumentError(LayerPrefix(name) + ": shape " + ShapeString(s) +
                                  " has head size " + std::to_string(d) +
                                  ", the spec says otherwise");
    }
    MORIIO_ASSIGN_OR_RETURN(TokenAxis tokens, ResolveTokenAxis(name, g, spec, 2, 3));
    MORIIO_RETURN_IF_ERROR(FillBlockFields(name, g, spec, 1 - plane, tokens, &p));
    p.plane_offset = {0, g.strides[plane] * es};
    p.plane_bytes = {d * es, d * es};
    return p;
  }
  if (s.size() == 4) {
    const std::int64_t c = s[3];
    std::int64_t dk = 0;
    std::int64_t dv = 0;
    if (spec.head_size) {
      dk = *spec.head_size;
      dv = spec.head_size_v.value_or(dk);
    } else if (spec.head_size_v) {
      dv = *spec.head_size_v;
      dk = c - dv;
    } else if (c % 2 == 0) {
      dk = dv = c / 2;
    }
    if (dk <= 0 || dv <= 0 || dk + dv != c) {
      return InvalidArgumentError(LayerPrefix(name) + ": packed K|V shape " + ShapeString(s) +
                                  " has content " + std::to_string(c) +
                                  ", which does not split into head_size + head_size_v");
    }
    MORIIO_RETURN_IF_ERROR(CheckHeadsFirst(name, g, spec));
    if (!HeadsFit(s[1], spec)) {
      return InvalidArgumentError(LayerPrefix(name) + ": shape " + ShapeString(s) + " has " +
                                  std::to_string(s[1]) + " heads, the spec says " +
                                  std::to_string(*spec.num_kv_heads));
    }
    if (!KernelSizeFits(s[2], spec.block_size)) {
      return InvalidArgumentError("Unsupported K/V cache shape for " + LayerPrefix(name) + ": " +
                                  ShapeString(s) + " token axis does not divide block_size " +
                                  std::to_string(spec.block_size));
    }
    MORIIO_RETURN_IF_ERROR(FillBlockFields(name, g, spec, 0, TokenAxis{2, 1, s[2]}, &p));
    p.plane_offset = {0, dk * es};
    p.plane_bytes = {dk * es, dv * es};
    return p;
  }
  return InvalidArgumentError("Unsupported K/V cache shape for " + LayerPrefix(name) + ": " +
                              ShapeString(s) + " (expected 4 or 5 dimensions)");
}

Result<LayoutParams> DescribeLatent(const std::string& name, const TensorGeometry& g,
                                    const CacheSpec& spec) {
  const auto& s = g.shape;
  if (s.size() != 3 && s.size() != 4) {
    return InvalidArgumentError("Unsupported latent (mla) cache shape for " + LayerPrefix(name) +
                                ": " + ShapeString(s) + " (expected [N,B,D] or [N,H,B,D])");
  }
  if (s.size() == 4) MORIIO_RETURN_IF_ERROR(CheckHeadsFirst(name, g, spec));
  const int token_axis = s.size() == 3 ? 1 : 2;
  const int head_axis = s.size() == 3 ? -1 : 1;
  const std::int64_t heads = head_axis >= 0 ? s[head_axis] : 1;
  const std::int64_t c = s.back();
  if (!HeadsFit(heads, spec) || (spec.head_size && *spec.head_size != c)) {
    return InvalidArgumentError(LayerPrefix(name) + ": latent shape " + ShapeString(s) +
                                " does not match the spec's heads/head_size");
  }
  if (!KernelSizeFits(s[token_axis], spec.block_size)) {
    return InvalidArgumentError("Unsupported latent (mla) cache shape for " + LayerPrefix(name) +
                                ": " + ShapeString(s) + " token axis does not divide block_size " +
                                std::to_string(spec.block_size));
  }
  LayoutParams p;
  p.kind = CacheKind::kLatent;
  MORIIO_RETURN_IF_ERROR(
      FillBlockFields(name, g, spec, 0, TokenAxis{token_axis, head_axis, s[token_axis]}, &p));
  p.plane_offset = {0, 0};
  p.plane_bytes = {c * g.element_size, 0};
  return p;
}

}  // namespace

std::string_view AxisOrderName(AxisOrder order) {
  switch (order) {
    case AxisOrder::kNhd:
      return "nhd";
    case AxisOrder::kHnd:
      return "hnd";
    case AxisOrder::kAuto:
      break;
  }
  return "auto";
}

Status CacheSpec::Validate() const {
  auto positive = [](std::string_view field, std::int64_t v) -> Status {
    if (v > 0) return Status::OK();
    return InvalidArgumentError("CacheSpec." + std::string(field) + " must be positive, got " +
                                std::to_string(v));
  };
  MORIIO_RETURN_IF_ERROR(positive("block_size", block_size));
  MORIIO_RETURN_IF_ERROR(positive("dtype_bytes", dtype_bytes));
  if (num_kv_heads) MORIIO_RETURN_IF_ERROR(positive("num_kv_heads", *num_kv_heads));
  if (head_size) MORIIO_RETURN_IF_ERROR(positive("head_size", *head_size));
  if (head_size_v) MORIIO_RETURN_IF_ERROR(positive("head_size_v", *head_size_v));
  if (axis_order != AxisOrder::kAuto && axis_order != AxisOrder::kNhd &&
      axis_order != AxisOrder::kHnd) {
    return InvalidArgumentError("CacheSpec.axis_order has an unknown value");
  }
  if (kind == CacheKind::kLatent && head_size_v) {
    return InvalidArgumentError("CacheSpec.head_size_v is only meaningful for kind 'kv'");
  }
  return Status::OK();
}

Result<LayerLayout> LayerLayout::FromParams(std::string name, const LayoutParams& p) {
  const std::string where = LayerPrefix(name);
  auto in_range = [&](std::string_view field, std::int64_t v, std::int64_t lo,
                      std::int64_t hi) -> Status {
    if (v >= lo && v <= hi) return Status::OK();
    return InvalidArgumentError(where + ": " + std::string(field) + " = " + std::to_string(v) +
                                " outside [" + std::to_string(lo) + ", " + std::to_string(hi) +
                                "]");
  };
  if (p.kind != CacheKind::kKeyValue && p.kind != CacheKind::kLatent) {
    return InvalidArgumentError(where + ": unknown cache kind");
  }
  MORIIO_RETURN_IF_ERROR(in_range("num_blocks", p.num_blocks, 1, kMaxBlocks));
  MORIIO_RETURN_IF_ERROR(in_range("block_size", p.block_size, 1, kMaxBlockSize));
  MORIIO_RETURN_IF_ERROR(in_range("kernel_block_size", p.kernel_block_size, 1, p.block_size));
  if (p.block_size % p.kernel_block_size != 0) {
    return InvalidArgumentError(where + ": kernel_block_size " +
                                std::to_string(p.kernel_block_size) + " does not divide block_size " +
                                std::to_string(p.block_size));
  }
  MORIIO_RETURN_IF_ERROR(in_range("num_heads", p.num_heads, 1, kMaxHeads));
  MORIIO_RETURN_IF_ERROR(in_range("dtype_bytes", p.dtype_bytes, 1, 64));
  for (std::int64_t v : {p.block_stride, p.kernel_block_stride, p.head_stride, p.token_stride}) {
    MORIIO_RETURN_IF_ERROR(in_range("stride", v, 0, kMaxBytes));
  }
  const int planes = p.num_planes();
  if (p.plane_offset[0] != 0) return InvalidArgumentError(where + ": plane 0 must start at 0");
  for (int i = 0; i < planes; ++i) {
    MORIIO_RETURN_IF_ERROR(in_range("plane_bytes", p.plane_bytes[i], 1, kMaxBytes));
    MORIIO_RETURN_IF_ERROR(in_range("plane_offset", p.plane_offset[i], 0, kMaxBytes));
  }
  if (planes == 1 && (p.plane_offset[1] != 0 || p.plane_bytes[1] != 0)) {
    return InvalidArgumentError(where + ": a latent layout has one plane");
  }
  const std::int64_t kernel_per_block = p.block_size / p.kernel_block_size;
  std::int64_t cells = 0;
  if (!CheckedMul(p.num_heads * planes, p.block_size, &cells) || cells > kMaxCellsPerBlock) {
    return InvalidArgumentError(where + ": too many cells per block");
  }
  // Cells must not overlap, within a block or across blocks. Either test proves it: (a) K and V
  // of a cell as ONE unit of plane_offset[1] + plane_bytes[1] bytes when V starts after K ends
  // (packed K|V, any widths); (b) the plane as an axis of stride plane_offset[1] over units of
  // the wider plane (separated planes).
  const std::vector<Axis> axes = {{p.num_blocks, p.block_stride},
                                  {kernel_per_block, p.kernel_block_stride},
                                  {p.num_heads, p.head_stride},
                                  {p.kernel_block_size, p.token_stride}};
  bool disjoint = planes == 2 && p.plane_offset[1] >= p.plane_bytes[0] &&
                  AxesDoNotOverlap(axes, p.plane_offset[1] + p.plane_bytes[1]);
  if (!disjoint) {
    std::vector<Axis> with_plane = axes;
    if (planes == 2) with_plane.push_back({2, p.plane_offset[1]});
    disjoint = AxesDoNotOverlap(with_plane, std::max(p.plane_bytes[0], p.plane_bytes[1]));
  }
  if (!disjoint) {
    return InvalidArgumentError(where + ": layout cells overlap (strides too small for sizes)");
  }
  // Extent of the layer from its base: the farthest cell end. The first four axes are the
  // block, kernel-block, head and token axes; the planes are accounted for in last_cell_end.
  std::int64_t span = 0;
  for (std::size_t i = 0; i < 4; ++i) {
    std::int64_t step = 0;
    if (axes[i].size > 1 &&
        (!CheckedMul(axes[i].stride, axes[i].size - 1, &step) || !CheckedAdd(span, step, &span))) {
      return InvalidArgumentError(where + ": layout extent overflows");
    }
  }
  std::int64_t last_cell_end = 0;
  for (int i = 0; i < planes; ++i) {
    last_cell_end = std::max(last_cell_end, p.plane_offset[i] + p.plane_bytes[i]);
  }
  if (!CheckedAdd(span, last_cell_end, &span) || span > kMaxBytes) {
    return InvalidArgumentError(where + ": layout extent overflows");
  }
  return LayerLayout(std::move(name), p, span);
}

std::int64_t LayerLayout::block_bytes() const {
  const std::int64_t per_token = params_.plane_bytes[0] + params_.plane_bytes[1];
  return per_token * params_.num_heads * params_.block_size;
}

std::uint64_t LayerLayout::LogicalFingerprint() const {
  // FNV-1a over the logical fields only; stable across processes and builds.
  std::uint64_t h = 1469598103934665603ULL;
  auto mix = [&h](std::int64_t v) {
    for (int i = 0; i < 8; ++i) {
      h ^= static_cast<std::uint64_t>(v >> (8 * i)) & 0xff;
      h *= 1099511628211ULL;
    }
  };
  mix(static_cast<std::int64_t>(params_.kind));
  mix(params_.block_size);
  mix(params_.num_heads);
  mix(params_.plane_bytes[0]);
  mix(params_.plane_bytes[1]);
  mix(params_.dtype_bytes);
  return h;
}

std::string LayerLayout::DescribeLogical() const {
  std::string out = std::string("kind=") +
                    (params_.kind == CacheKind::kKeyValue ? "kv" : "mla") +
                    " block_size=" + std::to_string(params_.block_size) +
                    " heads=" + std::to_string(params_.num_heads);
  if (params_.kind == CacheKind::kKeyValue) {
    out += " K=" + std::to_string(params_.plane_bytes[0]) + "B V=" +
           std::to_string(params_.plane_bytes[1]) + "B";
  } else {
    out += " latent=" + std::to_string(params_.plane_bytes[0]) + "B";
  }
  return out + " dtype_bytes=" + std::to_string(params_.dtype_bytes);
}

Result<LayerLayout> DescribeLayer(std::string name, const TensorGeometry& geometry,
                                  const CacheSpec& spec, KvPlaneAxis plane_axis) {
  MORIIO_RETURN_IF_ERROR(spec.Validate().WithContext(LayerPrefix(name)));
  MORIIO_RETURN_IF_ERROR(CheckGeometry(name, geometry, spec));
  Result<LayoutParams> params = spec.kind == CacheKind::kKeyValue
                                    ? DescribeKeyValue(name, geometry, spec, plane_axis)
                                    : DescribeLatent(name, geometry, spec);
  if (!params.ok()) return params.status();
  return LayerLayout::FromParams(std::move(name), *params);
}

// ---------------------------------------------------------------------------------------------
// Block templates and plans.

namespace {

std::int64_t CellOffset(const LayoutParams& p, int plane, std::int64_t head, std::int64_t token) {
  return p.plane_offset[plane] + head * p.head_stride +
         (token / p.kernel_block_size) * p.kernel_block_stride +
         (token % p.kernel_block_size) * p.token_stride;
}

// Appends a run, extending the previous one when it continues it on both sides.
inline void AppendRun(std::vector<CopyRun>* runs, const CopyRun& r) {
  if (!runs->empty()) {
    CopyRun& last = runs->back();
    if (last.local + last.size == r.local && last.remote + last.size == r.remote) {
      last.size += r.size;
      return;
    }
  }
  runs->push_back(r);
}

// The side of a cell grid over window `w` of `p`, when the token offset is affine over the
// window's tokens (see CellGeometry): no kernel blocks, kernel blocks that continue the token
// stride, or a window inside one kernel block. The grid's cell (0, 0, 0) is the window's first
// cell; its offset from the block base is the caller's (CellOffset).
std::optional<CellSide> CellSideOf(const LayoutParams& p, std::int64_t plane_stride,
                                   const ResolvedWindow& w) {
  const std::int64_t kb = p.kernel_block_size;
  const bool affine = kb == p.block_size || p.kernel_block_stride == kb * p.token_stride ||
                      w.token_begin / kb == (w.token_begin + w.tokens - 1) / kb;
  if (!affine) return std::nullopt;
  return CellSide{p.block_stride, plane_stride, w.heads > 1 ? p.head_stride : 0,
                  w.tokens > 1 ? p.token_stride : 0};
}

// The cell grid of a pair's windows with the same cell content and extent (checked by the
// caller), if any.
std::optional<CellGeometry> CellGeometryOf(const LayoutParams& lp, const LayoutParams& rp,
                                           const ResolvedWindow& lw, const ResolvedWindow& rw) {
  CellGeometry g;
  g.heads = lw.heads;
  g.tokens = lw.tokens;
  // Packed K|V on both sides: K and V of a (head, token) are one contiguous cell.
  const bool packed = lp.num_planes() == 2 && lp.plane_offset[1] == lp.plane_bytes[0] &&
                      rp.plane_offset[1] == rp.plane_bytes[0];
  if (lp.num_planes() == 1 || packed) {
    g.planes = 1;
    g.cell_bytes = lp.plane_bytes[0] + lp.plane_bytes[1];
  } else if (lp.plane_bytes[0] == lp.plane_bytes[1]) {
    g.planes = 2;
    g.cell_bytes = lp.plane_bytes[0];
  } else {
    return std::nullopt;  // K and V of different widths in separate planes: two grids
  }
  const std::optional<CellSide> local =
      CellSideOf(lp, g.planes == 2 ? lp.plane_offset[1] : 0, lw);
  const std::optional<CellSide> remote =
      CellSideOf(rp, g.planes == 2 ? rp.plane_offset[1] : 0, rw);
  if (!local || !remote) return std::nullopt;
  g.local = *local;
  g.remote = *remote;
  return g;
}

// The whole block of `layout` as a window.
ResolvedWindow WholeBlock(const LayerLayout& layout) {
  return {0, layout.num_heads(), 0, layout.block_size()};
}

// "[begin,end)"; the numbers may come from a request, so the end may not fit.
std::string Range(std::int64_t begin, std::int64_t count) {
  std::int64_t end = 0;
  return "[" + std::to_string(begin) + "," +
         (CheckedAdd(begin, count, &end) ? std::to_string(end) : std::string("overflow")) + ")";
}

std::string WindowNumbers(const ResolvedWindow& w, const LayerLayout& layout) {
  return "heads " + Range(w.head_begin, w.heads) + " of " + std::to_string(layout.num_heads()) +
         ", tokens " + Range(w.token_begin, w.tokens) + " of " +
         std::to_string(layout.block_size());
}

// What makes cells of `local` and `remote` unable to pair one to one, or "" when they can:
// the same kind, dtype and bytes per (plane, head, token) cell.
std::string CellContentDifference(const LayoutParams& lp, const LayoutParams& rp) {
  auto kind = [](CacheKind k) { return k == CacheKind::kKeyValue ? "kv" : "mla"; };
  if (lp.kind != rp.kind) return std::string("kind ") + kind(lp.kind) + " vs " + kind(rp.kind);
  if (lp.dtype_bytes != rp.dtype_bytes) {
    return "dtype_bytes " + std::to_string(lp.dtype_bytes) + " vs " +
           std::to_string(rp.dtype_bytes);
  }
  static constexpr std::array<const char*, 2> kPlane = {"K", "V"};
  for (int p = 0; p < lp.num_planes(); ++p) {
    if (lp.plane_bytes[p] != rp.plane_bytes[p]) {
      return std::string(lp.kind == CacheKind::kLatent ? "latent" : kPlane[p]) +
             " bytes per head and token " + std::to_string(lp.plane_bytes[p]) + " vs " +
             std::to_string(rp.plane_bytes[p]);
    }
  }
  return "";
}

}  // namespace

Status CheckCellContent(const LayerLayout& local, const LayerLayout& remote) {
  const std::string differs = CellContentDifference(local.params(), remote.params());
  if (differs.empty()) return Status::OK();
  return IncompatibleError("layer '" + local.name() + "' (" + local.DescribeLogical() +
                           ") and remote layer '" + remote.name() + "' (" +
                           remote.DescribeLogical() + ") hold cells that cannot pair: " + differs);
}

bool ResolvedWindow::Overlaps(const ResolvedWindow& o) const {
  return head_begin < o.head_begin + o.heads && o.head_begin < head_begin + heads &&
         token_begin < o.token_begin + o.tokens && o.token_begin < token_begin + tokens;
}

std::string DescribeWindow(const CellWindow& w, const LayerLayout& layout) {
  // An open count runs to the end of the block, whatever the begin (which may be bad).
  auto axis = [](std::int64_t begin, std::optional<std::int64_t> count, std::int64_t size) {
    if (count) return Range(begin, *count);
    return "[" + std::to_string(begin) + "," + std::to_string(size) + ")";
  };
  return "heads " + axis(w.head_begin, w.heads, layout.num_heads()) + " of " +
         std::to_string(layout.num_heads()) + ", tokens " +
         axis(w.token_begin, w.tokens, layout.block_size()) + " of " +
         std::to_string(layout.block_size());
}

Result<ResolvedWindow> ResolveWindow(const CellWindow& w, const LayerLayout& layout) {
  auto axis = [&](std::string_view what, std::int64_t begin, std::optional<std::int64_t> count,
                  std::int64_t size, std::int64_t* out) -> Status {
    // Bounded before any sum: the numbers may come from a request.
    const bool ok =
        begin >= 0 && begin < size && (!count || (*count > 0 && *count <= size - begin));
    if (!ok) {
      return InvalidArgumentError(LayerPrefix(layout.name()) + ": window " +
                                  DescribeWindow(w, layout) + " leaves the block (" +
                                  std::string(what) + " " + std::to_string(begin) + "+" +
                                  (count ? std::to_string(*count) : std::string("rest")) +
                                  " outside [0," + std::to_string(size) + "))");
    }
    *out = count.value_or(size - begin);
    return Status::OK();
  };
  ResolvedWindow r{w.head_begin, 0, w.token_begin, 0};
  MORIIO_RETURN_IF_ERROR(axis("heads", w.head_begin, w.heads, layout.num_heads(), &r.heads));
  MORIIO_RETURN_IF_ERROR(axis("tokens", w.token_begin, w.tokens, layout.block_size(), &r.tokens));
  return r;
}

bool BlockTemplate::prefers_cell_copy() const {
  // Runs that cover whole planes are what the cell copy would move per tile anyway.
  if (!cell_geometry_ || runs_.size() <= static_cast<std::size_t>(cell_geometry_->planes)) {
    return false;
  }
  return cell_geometry_->block_bytes() < kShortRunBytes * static_cast<std::int64_t>(runs_.size());
}

Result<BlockTemplate> BlockTemplate::Build(const LayerLayout& local, const LayerLayout& remote) {
  if (local.LogicalFingerprint() != remote.LogicalFingerprint() ||
      local.DescribeLogical() != remote.DescribeLogical()) {
    return IncompatibleError("layer '" + local.name() + "': local layout (" +
                             local.DescribeLogical() + ") and remote layer '" + remote.name() +
                             "' (" + remote.DescribeLogical() + ") hold different content");
  }
  return BuildWindows(local, WholeBlock(local), remote, WholeBlock(remote));
}

Result<BlockTemplate> BlockTemplate::Build(const LayerLayout& local,
                                           const CellWindow& local_window,
                                           const LayerLayout& remote,
                                           const CellWindow& remote_window) {
  MORIIO_ASSIGN_OR_RETURN(ResolvedWindow lw, ResolveWindow(local_window, local));
  Result<ResolvedWindow> rw = ResolveWindow(remote_window, remote);
  if (!rw.ok()) return rw.status().WithContext("remote");
  std::string differs = CellContentDifference(local.params(), remote.params());
  if (differs.empty() && (lw.heads != rw->heads || lw.tokens != rw->tokens)) {
    differs = "the windows hold " + std::to_string(lw.heads) + " and " +
              std::to_string(rw->heads) + " heads, " + std::to_string(lw.tokens) + " and " +
              std::to_string(rw->tokens) + " tokens";
  }
  if (!differs.empty()) {
    return IncompatibleError("layer '" + local.name() + "' window " + WindowNumbers(lw, local) +
                             " (" + local.DescribeLogical() + ") and remote layer '" +
                             remote.name() + "' window " + WindowNumbers(*rw, remote) + " (" +
                             remote.DescribeLogical() + ") cannot pair: " + differs);
  }
  return BuildWindows(local, lw, remote, *rw);
}

BlockTemplate BlockTemplate::BuildWindows(const LayerLayout& local, const ResolvedWindow& lw,
                                          const LayerLayout& remote, const ResolvedWindow& rw) {
  const LayoutParams& lp = local.params();
  const LayoutParams& rp = remote.params();
  std::vector<CopyRun> cells;
  cells.reserve(static_cast<std::size_t>(lp.num_planes() * lw.heads * lw.tokens));
  for (int plane = 0; plane < lp.num_planes(); ++plane) {
    for (std::int64_t h = 0; h < lw.heads; ++h) {
      for (std::int64_t t = 0; t < lw.tokens; ++t) {
        cells.push_back({CellOffset(lp, plane, lw.head_begin + h, lw.token_begin + t),
                         CellOffset(rp, plane, rw.head_begin + h, rw.token_begin + t),
                         lp.plane_bytes[plane]});
      }
    }
  }
  std::sort(cells.begin(), cells.end(),
            [](const CopyRun& a, const CopyRun& b) { return a.local < b.local; });
  BlockTemplate t;
  for (const CopyRun& c : cells) AppendRun(&t.runs_, c);
  t.runs_.shrink_to_fit();
  t.local_block_stride_ = lp.block_stride;
  t.remote_block_stride_ = rp.block_stride;
  t.local_num_blocks_ = lp.num_blocks;
  t.remote_num_blocks_ = rp.num_blocks;
  t.local_name_ = local.name();
  t.local_window_ = lw;
  t.remote_window_ = rw;
  t.local_cell_origin_ = CellOffset(lp, 0, lw.head_begin, lw.token_begin);
  t.remote_cell_origin_ = CellOffset(rp, 0, rw.head_begin, rw.token_begin);
  t.cell_geometry_ = CellGeometryOf(lp, rp, lw, rw);
  // A group holds runs that fit within one local block stride of its first run; stamping a group
  // for all (sorted) blocks before the next group keeps the output sorted for every layout vLLM
  // produces (StampBlockCopies still checks, and sorts when a layout defeats this).
  const std::int64_t window = std::max<std::int64_t>(lp.block_stride, 1);
  std::uint32_t begin = 0;
  for (std::uint32_t i = 1; i <= t.runs_.size(); ++i) {
    if (i == t.runs_.size() ||
        t.runs_[i].local + t.runs_[i].size > t.runs_[begin].local + window) {
      t.groups_.emplace_back(begin, i);
      begin = i;
    }
  }
  return t;
}

namespace {

// Whether a bitmap of `max_id + 1` bits is small against `n` ids (the common case: ids below
// the cache's block count); otherwise duplicates are found from a sorted order.
bool BitmapFits(std::size_t n, std::int64_t max_id) {
  return static_cast<std::size_t>(max_id / 64 + 1) <= std::max<std::size_t>(n * 4, 4096);
}

// First id that occurs twice in `ids` (all in [0, max_id]), or -1: in input order when the
// bitmap fits, else the smallest repeated id (from a sorted copy).
std::int64_t FirstDuplicate(std::span<const std::int64_t> ids, std::int64_t max_id) {
  if (BitmapFits(ids.size(), max_id)) {
    std::vector<std::uint64_t> seen(static_cast<std::size_t>(max_id / 64 + 1), 0);
    for (std::int64_t id : ids) {
      std::uint64_t& w = seen[static_cast<std::size_t>(id / 64)];
      const std::uint64_t bit = std::uint64_t{1} << (id % 64);
      if (w & bit) return id;
      w |= bit;
    }
    return -1;
  }
  std::vector<std::int64_t> sorted(ids.begin(), ids.end());
  std::sort(sorted.begin(), sorted.end());
  auto dup = std::adjacent_find(sorted.begin(), sorted.end());
  return dup == sorted.end() ? -1 : *dup;
}

Status DuplicateError(const char* side, std::int64_t id) {
  return InvalidArgumentError(std::string("duplicate ") + side + " block id " +
                              std::to_string(id));
}

// Whether unsorted local ids up to `max_local` are dense enough to be placed by id, in
// O(n + max_local): several times faster than a comparison sort of random ids.
bool PlacesByLocal(std::size_t n, std::int64_t max_local) {
  return static_cast<std::size_t>(max_local) + 1 <= std::max<std::size_t>(n * 8, 4096);
}

// Places each pair at its local id in `table` (max_local + 1 zeros on entry), storing the
// remote id's complement (ids are >= 0, so a stored pair is never 0). Returns the first local
// id repeated, in input order (what FirstDuplicate's bitmap reports: a dense span always fits
// it), or -1.
std::int64_t PlaceByLocal(std::span<const std::int64_t> local,
                          std::span<const std::int64_t> remote, std::vector<std::int64_t>* table) {
  for (std::size_t i = 0; i < local.size(); ++i) {
    std::int64_t& slot = (*table)[static_cast<std::size_t>(local[i])];
    if (slot != 0) return local[i];
    slot = ~remote[i];
  }
  return -1;
}

// Reads the placed pairs back in local id order, over `local` and `remote` (their size). The
// loop has no branch on the random occupancy of the table: every id is written and the output
// position advances only past a placed one. The last id is placed (it is the maximum), so no
// write goes past the n-th position.
void TakePlaced(const std::vector<std::int64_t>& table, std::vector<std::int64_t>* local,
                std::vector<std::int64_t>* remote) {
  std::int64_t* out_local = local->data();
  std::int64_t* out_remote = remote->data();
  std::size_t k = 0;
  for (std::size_t id = 0; id < table.size(); ++id) {
    const std::int64_t v = table[id];
    out_local[k] = static_cast<std::int64_t>(id);
    out_remote[k] = ~v;
    k += static_cast<std::size_t>(v != 0);
  }
}

}  // namespace

Result<BlockPairs> BlockPairs::Create(std::span<const std::int64_t> local_ids,
                                      std::span<const std::int64_t> remote_ids) {
  if (local_ids.size() > remote_ids.size()) {
    return InvalidArgumentError("local_block_ids longer than remote_block_ids: " +
                                std::to_string(local_ids.size()) + " > " +
                                std::to_string(remote_ids.size()));
  }
  const std::size_t n = local_ids.size();
  // Validate a private copy: the caller's memory may change meanwhile (another thread).
  BlockPairs pairs;
  pairs.local_.assign(local_ids.begin(), local_ids.end());
  pairs.remote_.assign(remote_ids.begin(), remote_ids.begin() + static_cast<std::ptrdiff_t>(n));
  std::vector<std::int64_t>& local = pairs.local_;
  std::vector<std::int64_t>& remote = pairs.remote_;
  bool local_sorted = true;
  bool remote_ascending = true;
  for (std::size_t i = 0; i < n; ++i) {
    if (local[i] < 0 || remote[i] < 0) {
      return OutOfRangeError("negative block id at position " + std::to_string(i) + ": local " +
                             std::to_string(local[i]) + ", remote " + std::to_string(remote[i]));
    }
    pairs.max_local_ = std::max(pairs.max_local_, local[i]);
    pairs.max_remote_ = std::max(pairs.max_remote_, remote[i]);
    if (i > 0) {
      local_sorted &= local[i - 1] < local[i];
      remote_ascending &= remote[i - 1] < remote[i];
    }
  }
  // Strictly ascending ids cannot repeat; otherwise check explicitly. A repeated local id is
  // reported before a repeated remote one.
  auto check_remote = [&]() -> Status {
    if (remote_ascending) return Status::OK();
    const std::int64_t dup = FirstDuplicate(remote, pairs.max_remote_);
    return dup >= 0 ? DuplicateError("remote", dup) : Status::OK();
  };
  if (local_sorted) {
    MORIIO_RETURN_IF_ERROR(check_remote());
    return pairs;
  }
  if (PlacesByLocal(n, pairs.max_local_)) {
    std::vector<std::int64_t> table(static_cast<std::size_t>(pairs.max_local_) + 1, 0);
    if (std::int64_t dup = PlaceByLocal(local, remote, &table); dup >= 0) {
      return DuplicateError("local", dup);
    }
    MORIIO_RETURN_IF_ERROR(check_remote());
    TakePlaced(table, &local, &remote);
    return pairs;
  }
  // Sparse ids: sorted by comparison (by local id, then remote: a total order even with
  // repeats). Where no bitmap fits, the sorted order itself finds the smallest repeated id.
  const bool bitmap_fits = BitmapFits(n, pairs.max_local_);
  if (bitmap_fits) {
    if (std::int64_t dup = FirstDuplicate(local, pairs.max_local_); dup >= 0) {
      return DuplicateError("local", dup);
    }
  }
  std::vector<std::pair<std::int64_t, std::int64_t>> zipped(n);
  for (std::size_t i = 0; i < n; ++i) zipped[i] = {local[i], remote[i]};
  std::sort(zipped.begin(), zipped.end());
  if (!bitmap_fits) {
    auto dup = std::adjacent_find(zipped.begin(), zipped.end(),
                                  [](const auto& a, const auto& b) { return a.first == b.first; });
    if (dup != zipped.end()) return DuplicateError("local", dup->first);
  }
  MORIIO_RETURN_IF_ERROR(check_remote());
  for (std::size_t i = 0; i < n; ++i) std::tie(local[i], remote[i]) = zipped[i];
  return pairs;
}

void CopyPlan::clear() {
  local_offsets.clear();
  remote_offsets.clear();
  sizes.clear();
}

std::int64_t CopyPlan::total_bytes() const {
  return std::accumulate(sizes.begin(), sizes.end(), std::int64_t{0});
}

namespace {

// Sorts a plan by local offset and merges runs that became adjacent. Only layouts whose block
// groups interleave across blocks need this; it keeps StampBlockCopies correct for all inputs.
void SortAndMerge(CopyPlan* plan, std::size_t from) {
  const std::size_t n = plan->size() - from;
  std::vector<CopyRun> runs(n);
  for (std::size_t i = 0; i < n; ++i) {
    runs[i] = {plan->local_offsets[from + i], plan->remote_offsets[from + i],
               plan->sizes[from + i]};
  }
  std::sort(runs.begin(), runs.end(),
            [](const CopyRun& a, const CopyRun& b) { return a.local < b.local; });
  std::vector<CopyRun> merged;
  merged.reserve(n);
  for (const CopyRun& r : runs) AppendRun(&merged, r);
  plan->local_offsets.resize(from);
  plan->remote_offsets.resize(from);
  plan->sizes.resize(from);
  for (const CopyRun& r : merged) {
    plan->local_offsets.push_back(r.local);
    plan->remote_offsets.push_back(r.remote);
    plan->sizes.push_back(r.size);
  }
}

}  // namespace

Status StampBlockCopies(const BlockTemplate& tmpl, const BlockPairs& pairs, CopyPlan* out) {
  out->clear();
  return AppendBlockCopies(tmpl, pairs, 0, 0, out);
}

Status CheckBlockIds(const BlockTemplate& tmpl, const BlockPairs& pairs) {
  if (pairs.max_local() >= tmpl.local_num_blocks()) {
    return OutOfRangeError("local block id " + std::to_string(pairs.max_local()) +
                           " out of range for layer '" + tmpl.local_name() + "' with " +
                           std::to_string(tmpl.local_num_blocks()) + " blocks");
  }
  if (pairs.max_remote() >= tmpl.remote_num_blocks()) {
    return OutOfRangeError("remote block id " + std::to_string(pairs.max_remote()) +
                           " out of range for layer '" + tmpl.local_name() +
                           "': the remote cache holds " +
                           std::to_string(tmpl.remote_num_blocks()) + " blocks");
  }
  return Status::OK();
}

Status AppendBlockCopies(const BlockTemplate& tmpl, const BlockPairs& pairs,
                         std::int64_t local_shift, std::int64_t remote_shift, CopyPlan* out) {
  if (pairs.empty()) return Status::OK();
  MORIIO_RETURN_IF_ERROR(CheckBlockIds(tmpl, pairs));
  const std::size_t from = out->size();
  const std::size_t upper = from + pairs.size() * tmpl.runs().size();
  out->local_offsets.resize(upper);
  out->remote_offsets.resize(upper);
  out->sizes.resize(upper);
  const std::int64_t ls = tmpl.local_block_stride();
  const std::int64_t rs = tmpl.remote_block_stride();
  const std::span<const std::int64_t> local = pairs.local_sorted();
  const std::span<const std::int64_t> remote = pairs.remote_by_local();
  const CopyRun* runs = tmpl.runs().data();
  // The merge state lives in registers and runs are written through raw pointers: push_back
  // reloads each vector's end after every store (the stores may alias it), which made stamping
  // several times slower. Every emitted run covers at least one template run, so `upper` holds.
  std::int64_t* const lo = out->local_offsets.data() + from;
  std::int64_t* const ro = out->remote_offsets.data() + from;
  std::int64_t* const so = out->sizes.data() + from;
  std::size_t emitted = 0;
  std::int64_t cur_l = 0, cur_r = 0, cur_s = 0;
  bool have = false;
  bool sorted = true;
  auto flush = [&] {
    lo[emitted] = cur_l;
    ro[emitted] = cur_r;
    so[emitted] = cur_s;
    ++emitted;
  };
  for (const auto& [begin, end] : tmpl.groups()) {
    for (std::size_t i = 0; i < local.size(); ++i) {
      const std::int64_t lbase = local_shift + local[i] * ls;
      const std::int64_t rbase = remote_shift + remote[i] * rs;
      for (std::uint32_t k = begin; k < end; ++k) {
        const std::int64_t l = lbase + runs[k].local;
        const std::int64_t r = rbase + runs[k].remote;
        if (have && l == cur_l + cur_s && r == cur_r + cur_s) {
          cur_s += runs[k].size;
          continue;
        }
        if (have) {
          sorted &= l >= cur_l + cur_s;
          flush();
        }
        cur_l = l;
        cur_r = r;
        cur_s = runs[k].size;
        have = true;
      }
    }
  }
  if (have) flush();
  out->local_offsets.resize(from + emitted);
  out->remote_offsets.resize(from + emitted);
  out->sizes.resize(from + emitted);
  if (!sorted) SortAndMerge(out, from);
  return Status::OK();
}

Status AppendBlockOffsets(const BlockTemplate& tmpl, const BlockPairs& pairs,
                          std::int64_t local_shift, std::int64_t remote_shift, BlockOffsets* out) {
  if (!tmpl.cell_geometry()) {
    return FailedPreconditionError("layer '" + tmpl.local_name() +
                                   "': the layer pair has no cell geometry (K and V of different "
                                   "widths, or kernel blocks that break the token stride)");
  }
  MORIIO_RETURN_IF_ERROR(CheckBlockIds(tmpl, pairs));
  const std::span<const std::int64_t> local = pairs.local_sorted();
  const std::span<const std::int64_t> remote = pairs.remote_by_local();
  const std::size_t had = out->local.size();
  out->local.reserve(had + local.size());
  out->remote.reserve(had + local.size());
  // The ids are inside the layers, but the shifts are the caller's (a Python argument): an
  // offset past int64 is refused, never wrapped, and nothing of this call is kept.
  auto offset = [](std::int64_t shift, std::int64_t origin, std::int64_t id, std::int64_t stride,
                   std::int64_t* at) {
    return CheckedMul(id, stride, at) && CheckedAdd(*at, origin, at) &&
           CheckedAdd(*at, shift, at);
  };
  for (std::size_t i = 0; i < local.size(); ++i) {
    std::int64_t l = 0, r = 0;
    if (!offset(local_shift, tmpl.local_cell_origin(), local[i], tmpl.local_block_stride(), &l) ||
        !offset(remote_shift, tmpl.remote_cell_origin(), remote[i], tmpl.remote_block_stride(),
                &r)) {
      out->local.resize(had);
      out->remote.resize(had);
      return OutOfRangeError("layer '" + tmpl.local_name() + "': local block " +
                             std::to_string(local[i]) + " / remote block " +
                             std::to_string(remote[i]) + " shifted by " +
                             std::to_string(local_shift) + " / " + std::to_string(remote_shift) +
                             " bytes lies past int64");
    }
    out->local.push_back(l);
    out->remote.push_back(r);
  }
  return Status::OK();
}

void CopyBlockCells(const CellGeometry& g, const BlockOffsets& blocks, std::byte* local,
                    std::byte* remote, CellCopyDirection direction) {
  const bool into_local = direction == CellCopyDirection::kRemoteToLocal;
  std::byte* dst = into_local ? local : remote;
  const std::byte* src = into_local ? remote : local;
  const CellSide& ds = into_local ? g.local : g.remote;
  const CellSide& ss = into_local ? g.remote : g.local;
  const auto bytes = static_cast<std::size_t>(g.cell_bytes);
  for (std::size_t b = 0; b < blocks.size(); ++b) {
    const std::int64_t dst_block = into_local ? blocks.local[b] : blocks.remote[b];
    const std::int64_t src_block = into_local ? blocks.remote[b] : blocks.local[b];
    for (int p = 0; p < g.planes; ++p) {
      for (std::int64_t h = 0; h < g.heads; ++h) {
        for (std::int64_t t = 0; t < g.tokens; ++t) {
          std::memcpy(dst + dst_block + p * ds.plane_stride + h * ds.head_stride + t * ds.token_stride,
                      src + src_block + p * ss.plane_stride + h * ss.head_stride + t * ss.token_stride,
                      bytes);
        }
      }
    }
  }
}

Result<CopyPlan> PlanBlockCopies(const LayerLayout& local, const LayerLayout& remote,
                                 std::span<const std::int64_t> local_ids,
                                 std::span<const std::int64_t> remote_ids) {
  MORIIO_ASSIGN_OR_RETURN(BlockPairs pairs, BlockPairs::Create(local_ids, remote_ids));
  MORIIO_ASSIGN_OR_RETURN(BlockTemplate tmpl, BlockTemplate::Build(local, remote));
  CopyPlan plan;
  MORIIO_RETURN_IF_ERROR(StampBlockCopies(tmpl, pairs, &plan));
  return plan;
}

}  // namespace moriio_native
