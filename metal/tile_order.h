// The order in which a GEMM's threadgroups walk the output tiles. Threadgroups start in grid order (x fastest);
// walking the tiles row by row makes each wave of concurrent threadgroups read one strip of activations and the
// whole weight, while a Morton (Z) order inside 8 x 8 blocks of tiles keeps a wave on a square patch that
// shares both operands in the cache (the seed's int8 M5 kernel measured 96-99 vs 50-70 Tops/s flat).
#pragma once
#include <metal_stdlib>
using namespace metal;

constant constexpr uint kMortonBlock = 8;  // tiles per side of a Morton block (64 tiles)

// The tile (x = column tile, y = row tile) that the threadgroup with linear index g computes, in a grid of
// tiles_x x tiles_y tiles: a bijection of [0, tiles_x * tiles_y). Whole 8 x 8 blocks first, in Morton order
// inside each; then the tiles right of the blocks, row by row; then the rows below them.
inline uint2 morton_tile(uint g, uint tiles_x, uint tiles_y) {
  const uint bx = tiles_x / kMortonBlock, by = tiles_y / kMortonBlock;
  const uint per_block = kMortonBlock * kMortonBlock;
  if (g < bx * by * per_block) {
    const uint block = g / per_block, i = g % per_block;
    // even bits of i -> x, odd bits -> y
    const uint x = (i & 1u) | ((i >> 1) & 2u) | ((i >> 2) & 4u);
    const uint y = ((i >> 1) & 1u) | ((i >> 2) & 2u) | ((i >> 3) & 4u);
    return uint2((block % bx) * kMortonBlock + x, (block / bx) * kMortonBlock + y);
  }
  uint rest = g - bx * by * per_block;
  const uint right = tiles_x - bx * kMortonBlock;  // width of the strip right of the blocks
  if (rest < by * kMortonBlock * right) {
    return uint2(bx * kMortonBlock + rest % right, rest / right);
  }
  rest -= by * kMortonBlock * right;
  return uint2(rest % tiles_x, by * kMortonBlock + rest / tiles_x);
}
