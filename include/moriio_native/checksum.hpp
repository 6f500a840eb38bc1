#pragma once

/// Block checksums over the LOGICAL cells of a layer: the end-to-end integrity check of a
/// transfer (`"verify": true` in the vLLM connector). Both sides of a transfer compute them over
/// the blocks it moved and compare; since the value depends only on the cells' bytes in a
/// canonical order, two layers of different physical layouts (NHD vs HND, separated vs
/// interleaved K/V, kernel blocks, padded pages) agree whenever their logical content does.
/// Padding and bytes outside the window are never read.
///
/// The value of one block under a window (heads [h0, h0+H), tokens [t0, t0+T)):
///   * the word stream: for each plane p, each head h < H, each token t < T (in that order), the
///     plane_bytes[p] bytes of cell (p, h0+h, t0+t), zero-padded to a multiple of 8 bytes, read
///     as little-endian 64-bit words w_0, w_1, ... (positions count from the window's first
///     cell, so a head range of one side matches the whole block of the other);
///   * checksum = sum over i of Mix64(w_i XOR (i+1) * 0x9E3779B97F4A7C15) modulo 2^64, where
///     Mix64 is MurmurHash3's 64-bit finalizer (a bijection, so any change of one word changes
///     the sum; the position term makes a reordering of words change it too).
/// A sum of independent terms parallelises on a GPU (the torch implementation in
/// python/moriio_native/verify.py computes the same value; tests/py/test_verify.py checks it).
///
/// Pure functions: thread-safe, no allocation beyond the result, never block.

#include <cstddef>
#include <cstdint>
#include <span>
#include <vector>

#include "moriio_native/checksum_mix.hpp"
#include "moriio_native/layout.hpp"
#include "moriio_native/status.hpp"

namespace moriio_native {

/// One checksum per entry of `blocks` (in that order) of the layer whose bytes start at `base`,
/// over the cells of `window` (see the file comment). `base` must hold at least
/// layout.span_bytes() readable bytes; the caller guarantees it (the Python binding checks the
/// buffer it is given).
///
/// Errors, with nothing computed: OutOfRange naming the layer, the position and the id when a
/// block id is negative or not below layout.num_blocks(); InvalidArgument naming the layer when
/// the window is empty or reaches past the block's heads or tokens.
/// Blocking (reads every byte of the window's cells once); thread-safe.
Result<std::vector<std::uint64_t>> ChecksumBlocks(const LayerLayout& layout, const std::byte* base,
                                                  std::span<const std::int64_t> blocks,
                                                  const CellWindow& window = {});

}  // namespace moriio_native
