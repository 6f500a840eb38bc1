#pragma once

// What the metadata tests register to get real metadata: two layers, one of each cache kind, in a
// test buffer, and the engine that registers them. Each test names and places the layers itself
// (names and offsets are what it checks, or what its fuzzing seed is made of); the cache specs
// are the same in all of them.

#include <gtest/gtest.h>

#include <cstdint>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "moriio_native/engine.hpp"
#include "test_buffer.hpp"

namespace moriio_native::test_support {

// A bf16 K/V layer (blocks of 4 tokens, 2 heads of 8) and a bf16 latent layer (blocks of 4
// tokens, 16 wide), both in `buffer`; the geometries' data_ptr say where.
inline std::vector<LayerRegistration> SampleLayers(const Buffer& buffer, std::string kv_name,
                                                   TensorGeometry kv_geometry,
                                                   std::string latent_name,
                                                   TensorGeometry latent_geometry) {
  const MemoryRange allocation{reinterpret_cast<std::uint64_t>(buffer.get()), kBufferBytes,
                               MemoryKind::kHost, -1};
  const CacheSpec kv{.kind = CacheKind::kKeyValue,
                     .block_size = 4,
                     .num_kv_heads = 2,
                     .head_size = 8,
                     .dtype_bytes = 2};
  const CacheSpec latent{
      .kind = CacheKind::kLatent, .block_size = 4, .head_size = 16, .dtype_bytes = 2};
  return {{.name = std::move(kv_name),
           .geometry = std::move(kv_geometry),
           .spec = kv,
           .allocation = allocation},
          {.name = std::move(latent_name),
           .geometry = std::move(latent_geometry),
           .spec = latent,
           .allocation = allocation}};
}

inline std::unique_ptr<Engine> NewEngine(const std::string& id) {
  EngineConfig config;
  config.engine_id = id;
  Result<std::unique_ptr<Engine>> e = Engine::Create(config);
  EXPECT_TRUE(e.ok()) << e.status().ToString();
  return e.ok() ? std::move(e).value() : nullptr;
}

}  // namespace moriio_native::test_support
