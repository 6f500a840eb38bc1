#include "moriio_native/checksum.hpp"

#include <bit>
#include <cstring>
#include <string>

namespace moriio_native {
namespace {

// A window's resolved ranges.
struct Ranges {
  std::int64_t head_begin, heads, token_begin, tokens;
};

Status CheckRange(const std::string& layer, const char* axis, std::int64_t begin,
                  std::int64_t count, std::int64_t size) {
  if (begin >= 0 && count > 0 && begin <= size - count) return Status::OK();
  return InvalidArgumentError("layer '" + layer + "': checksum window " + axis + " [" +
                              std::to_string(begin) + ", " + std::to_string(begin) + " + " +
                              std::to_string(count) + ") is empty or outside the block's " +
                              std::to_string(size) + " " + axis);
}

Result<Ranges> Resolve(const LayerLayout& layout, const CellWindow& w) {
  const std::int64_t heads = w.heads.value_or(layout.num_heads() - w.head_begin);
  const std::int64_t tokens = w.tokens.value_or(layout.block_size() - w.token_begin);
  MORIIO_RETURN_IF_ERROR(
      CheckRange(layout.name(), "heads", w.head_begin, heads, layout.num_heads()));
  MORIIO_RETURN_IF_ERROR(
      CheckRange(layout.name(), "tokens", w.token_begin, tokens, layout.block_size()));
  return Ranges{w.head_begin, heads, w.token_begin, tokens};
}

// Adds the terms of one cell's words (positions from `*position`) to `*sum`.
inline void MixCell(const std::byte* cell, std::int64_t bytes, std::uint64_t* position,
                    std::uint64_t* sum) {
  std::uint64_t pos = *position;
  std::uint64_t acc = 0;
  std::int64_t off = 0;
  for (; off + 8 <= bytes; off += 8) {
    std::uint64_t word;
    std::memcpy(&word, cell + off, 8);
    pos += kChecksumPositionStep;
    acc += Mix64(word ^ pos);
  }
  if (off < bytes) {
    std::uint64_t word = 0;  // the tail, zero-padded
    std::memcpy(&word, cell + off, static_cast<std::size_t>(bytes - off));
    pos += kChecksumPositionStep;
    acc += Mix64(word ^ pos);
  }
  *position = pos;
  *sum += acc;
}

}  // namespace

Result<std::vector<std::uint64_t>> ChecksumBlocks(const LayerLayout& layout, const std::byte* base,
                                                  std::span<const std::int64_t> blocks,
                                                  const CellWindow& window) {
  static_assert(std::endian::native == std::endian::little,
                "checksum words are little-endian: a big-endian host must byte-swap them");
  MORIIO_ASSIGN_OR_RETURN(Ranges r, Resolve(layout, window));
  for (std::size_t i = 0; i < blocks.size(); ++i) {
    if (blocks[i] < 0 || blocks[i] >= layout.num_blocks()) {
      return OutOfRangeError("layer '" + layout.name() + "': block id " +
                             std::to_string(blocks[i]) + " at position " + std::to_string(i) +
                             " out of range (the layer has " +
                             std::to_string(layout.num_blocks()) + " blocks)");
    }
  }
  const LayoutParams& p = layout.params();
  std::vector<std::uint64_t> out;
  out.reserve(blocks.size());
  for (const std::int64_t block : blocks) {
    const std::byte* block_base = base + block * p.block_stride;
    std::uint64_t position = 0;
    std::uint64_t sum = 0;
    for (int plane = 0; plane < p.num_planes(); ++plane) {
      for (std::int64_t h = r.head_begin; h < r.head_begin + r.heads; ++h) {
        const std::byte* head = block_base + p.plane_offset[plane] + h * p.head_stride;
        for (std::int64_t t = r.token_begin; t < r.token_begin + r.tokens; ++t) {
          const std::byte* cell = head + (t / p.kernel_block_size) * p.kernel_block_stride +
                                  (t % p.kernel_block_size) * p.token_stride;
          MixCell(cell, p.plane_bytes[plane], &position, &sum);
        }
      }
    }
    out.push_back(sum);
  }
  return out;
}

}  // namespace moriio_native
