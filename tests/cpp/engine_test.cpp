// Tests of Engine (include/moriio_native/engine.hpp) on the loopback backend: two engines in one
// process, a prefill side "P" and a decode side "D", each with ONE host buffer holding several
// layers of different geometry and physical layout (DESIGN.md §2 items 1-3, §3.1-3.3).
//
// Expected bytes are computed here by hand-indexing every (block, plane, head, token, byte) of
// every layer through the tensor's own shape and strides; nothing asks the library for an
// offset. Every transfer test also checks that no byte outside the requested blocks changed.

#include "moriio_native/engine.hpp"
#include "moriio_native/trace_marks.hpp"

#include <gtest/gtest.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdint>
#include <functional>
#include <cstdlib>
#include <cstring>
#include <initializer_list>
#include <map>
#include <memory>
#include <optional>
#include <ostream>
#include <random>
#include <set>
#include <string>
#include <thread>
#include <vector>

#include "msgpack_lite.hpp"
#include "peer_metadata.hpp"
#include "test_printers.hpp"

namespace moriio_native {
namespace {

using namespace std::chrono_literals;
namespace mp = detail::msgpack;

// ---- memory --------------------------------------------------------------------------------

// A page-aligned host allocation (the KV backing every layer of one side lives in).
class AlignedBuffer {
 public:
  explicit AlignedBuffer(std::size_t size) : size_((size + 4095) / 4096 * 4096) {
    data_.reset(static_cast<std::uint8_t*>(std::aligned_alloc(4096, size_)));
    if (!data_) std::abort();
  }
  std::uint8_t* data() const { return data_.get(); }
  std::size_t size() const { return size_; }
  std::uint64_t address() const { return reinterpret_cast<std::uint64_t>(data_.get()); }
  std::vector<std::uint8_t> Snapshot() const { return {data(), data() + size_}; }
  void Fill(std::uint32_t seed) {
    std::mt19937 rng(seed);
    for (std::size_t i = 0; i < size_; ++i) data_[i] = static_cast<std::uint8_t>(rng());
  }

 private:
  struct Free {
    void operator()(std::uint8_t* p) const { std::free(p); }
  };
  std::size_t size_;
  std::unique_ptr<std::uint8_t[], Free> data_;
};

// ---- layers, described the way torch describes them ----------------------------------------

// What each tensor dimension indexes.
enum class Role { kPlane, kBlock, kToken, kHead, kContent, kPackedContent };

// A test layer: logical content plus one physical tensor for it.
struct TestLayer {
  std::string name;
  CacheKind kind = CacheKind::kKeyValue;
  std::int64_t heads = 1;
  std::int64_t block_size = 0;
  std::int64_t head_size = 0;  // elements per head per plane
  std::int64_t elem = 0;       // bytes per element
  std::int64_t num_blocks = 0;
  std::vector<std::int64_t> shape;
  std::vector<Role> roles;
  std::vector<std::int64_t> strides;  // elements
  std::uint64_t offset = 0;           // byte offset of data_ptr inside the side's buffer

  int planes() const { return kind == CacheKind::kKeyValue ? 2 : 1; }
  std::int64_t BlockBytes() const { return planes() * heads * block_size * head_size * elem; }

  // Byte offset (from data_ptr) of byte `byte` of element `d` of cell (plane, head, token) of
  // `block`: sum of index * stride over the tensor's dimensions.
  std::int64_t Offset(std::int64_t block, int plane, std::int64_t head, std::int64_t token,
                      std::int64_t d, std::int64_t byte) const {
    std::int64_t element = 0;
    for (std::size_t i = 0; i < shape.size(); ++i) {
      std::int64_t idx = 0;
      switch (roles[i]) {
        case Role::kPlane:
          idx = plane;
          break;
        case Role::kBlock:
          idx = block;
          break;
        case Role::kToken:
          idx = token;
          break;
        case Role::kHead:
          idx = head;
          break;
        case Role::kContent:
          idx = d;
          break;
        case Role::kPackedContent:
          idx = plane * head_size + d;
          break;
      }
      element += idx * strides[i];
    }
    return element * elem + byte;
  }

  // One past the farthest byte the tensor addresses.
  std::int64_t SpanBytes() const {
    std::int64_t last = 0;
    for (std::size_t i = 0; i < shape.size(); ++i) last += (shape[i] - 1) * strides[i];
    return (last + 1) * elem;
  }
};

// Physical layouts used below; the shape is what torch reports, `order` the physical nesting
// (outermost first), `block_pad` extra elements added to the block stride (padded pages).
enum class Physical {
  kSeparated,       // [2, N, B, H, D]
  kSeparatedHB,     // [2, N, H, B, D]
  kInterleaved,     // [N, 2, B, H, D]
  kInterleavedHB,   // [N, 2, H, B, D]
  kPacked,          // [N, H, B, 2D]
  kPackedPermuted,  // [N, H, B, 2D] stored as [N, B, H, 2D]
  kLatent,          // [N, B, D]
};

TestLayer MakeLayer(std::string name, Physical physical, std::int64_t num_blocks,
                    std::int64_t heads, std::int64_t block_size, std::int64_t head_size,
                    std::int64_t elem, std::int64_t block_pad = 0) {
  TestLayer l;
  l.name = std::move(name);
  l.kind = physical == Physical::kLatent ? CacheKind::kLatent : CacheKind::kKeyValue;
  l.heads = heads;
  l.block_size = block_size;
  l.head_size = head_size;
  l.elem = elem;
  l.num_blocks = num_blocks;
  const std::int64_t n = num_blocks, h = heads, b = block_size, d = head_size;
  std::vector<std::size_t> order;  // physical nesting, outermost first (indices into shape)
  switch (physical) {
    case Physical::kSeparated:
      l.shape = {2, n, b, h, d};
      l.roles = {Role::kPlane, Role::kBlock, Role::kToken, Role::kHead, Role::kContent};
      order = {0, 1, 2, 3, 4};
      break;
    case Physical::kSeparatedHB:
      l.shape = {2, n, h, b, d};
      l.roles = {Role::kPlane, Role::kBlock, Role::kHead, Role::kToken, Role::kContent};
      order = {0, 1, 2, 3, 4};
      break;
    case Physical::kInterleaved:
      l.shape = {n, 2, b, h, d};
      l.roles = {Role::kBlock, Role::kPlane, Role::kToken, Role::kHead, Role::kContent};
      order = {0, 1, 2, 3, 4};
      break;
    case Physical::kInterleavedHB:
      l.shape = {n, 2, h, b, d};
      l.roles = {Role::kBlock, Role::kPlane, Role::kHead, Role::kToken, Role::kContent};
      order = {0, 1, 2, 3, 4};
      break;
    case Physical::kPacked:
      l.shape = {n, h, b, 2 * d};
      l.roles = {Role::kBlock, Role::kHead, Role::kToken, Role::kPackedContent};
      order = {0, 1, 2, 3};
      break;
    case Physical::kPackedPermuted:
      l.shape = {n, h, b, 2 * d};
      l.roles = {Role::kBlock, Role::kHead, Role::kToken, Role::kPackedContent};
      order = {0, 2, 1, 3};  // tokens outside heads in memory
      break;
    case Physical::kLatent:
      l.shape = {n, b, d};
      l.roles = {Role::kBlock, Role::kToken, Role::kContent};
      order = {0, 1, 2};
      break;
  }
  l.strides.assign(l.shape.size(), 0);
  std::int64_t running = 1;
  for (std::size_t k = order.size(); k-- > 0;) {
    const std::size_t dim = order[k];
    if (l.roles[dim] == Role::kBlock) running += block_pad;
    l.strides[dim] = running;
    running *= l.shape[dim];
  }
  return l;
}

CacheSpec SpecOf(const TestLayer& l) {
  CacheSpec s;
  s.kind = l.kind;
  s.block_size = l.block_size;
  s.num_kv_heads = l.heads;
  s.head_size = l.head_size;
  s.dtype_bytes = l.elem;
  return s;
}

// One side: a buffer with its layers at increasing, deliberately unaligned offsets.
struct Side {
  std::unique_ptr<AlignedBuffer> buffer;
  std::vector<TestLayer> layers;
  std::unique_ptr<Engine> engine;  // declared after the buffer: destroyed before it
  std::vector<std::uint8_t> metadata;
  std::uint64_t split = 0;  // non-zero: byte offset where the second allocation starts

  Side() = default;
  Side(Side&&) = default;
  // Engines first: a transport may still be copying into the buffer until its engine is gone.
  Side& operator=(Side&& other) {
    engine.reset();
    buffer = std::move(other.buffer);
    layers = std::move(other.layers);
    engine = std::move(other.engine);
    metadata = std::move(other.metadata);
    split = other.split;
    return *this;
  }
  ~Side() { engine.reset(); }

  const TestLayer& Layer(const std::string& name) const {
    for (const TestLayer& l : layers) {
      if (l.name == name) return l;
    }
    std::abort();
  }

  std::vector<LayerRegistration> Registrations() const {
    std::vector<LayerRegistration> regs;
    for (const TestLayer& l : layers) {
      LayerRegistration r;
      r.name = l.name;
      r.geometry = {l.shape, l.strides, l.elem, buffer->address() + l.offset};
      r.spec = SpecOf(l);
      if (split == 0) {
        r.allocation = {buffer->address(), buffer->size(), MemoryKind::kHost, -1};
      } else if (l.offset < split) {
        r.allocation = {buffer->address(), split, MemoryKind::kHost, -1};
      } else {
        r.allocation = {buffer->address() + split, buffer->size() - split, MemoryKind::kHost, -1};
      }
      regs.push_back(std::move(r));
    }
    return regs;
  }
};

// Destroys the engines of several sides before any of their buffers (declare after the sides).
class EnginesFirst {
 public:
  explicit EnginesFirst(std::initializer_list<Side*> sides) : sides_(sides) {}
  ~EnginesFirst() {
    for (Side* s : sides_) s->engine.reset();
  }

 private:
  std::vector<Side*> sides_;
};

// Places `layers` one after another in a fresh buffer (first at byte 104, 72-byte gaps, so no
// layer starts on a page boundary) and fills the buffer with a seeded pattern.
// With `split_before` = k > 0, layers k.. live in a second allocation (the buffer's upper part,
// from a page boundary on), as when a model's caches come from two allocators.
void Place(Side& side, std::vector<TestLayer> layers, std::uint32_t seed, int split_before = -1) {
  std::uint64_t cursor = 104;
  side.split = 0;
  for (std::size_t i = 0; i < layers.size(); ++i) {
    TestLayer& l = layers[i];
    if (static_cast<int>(i) == split_before) {
      side.split = (cursor + 4095) / 4096 * 4096;
      cursor = side.split + 24;
    }
    l.offset = cursor;
    cursor += static_cast<std::uint64_t>(l.SpanBytes()) + 72;
    cursor = (cursor + 7) / 8 * 8;
  }
  side.layers = std::move(layers);
  side.buffer = std::make_unique<AlignedBuffer>(cursor + 200);
  side.buffer->Fill(seed);
}

// The model used on both sides: same names and logical content, different physical layouts
// and different numbers of blocks (P has 6 blocks per layer, D has 9).
std::vector<TestLayer> PrefillLayers() {
  return {
      MakeLayer("attn.0", Physical::kSeparated, 6, /*heads=*/2, /*block=*/4, /*d=*/8, /*elem=*/2),
      MakeLayer("attn.1", Physical::kPackedPermuted, 6, 2, 8, 4, 4),
      MakeLayer("mla.0", Physical::kLatent, 6, 1, 4, 16, 2, /*block_pad=*/24),
      MakeLayer("attn.2", Physical::kInterleavedHB, 6, 1, 4, 8, 1),
  };
}

std::vector<TestLayer> DecodeLayers() {
  return {
      MakeLayer("attn.0", Physical::kInterleaved, 9, 2, 4, 8, 2),
      MakeLayer("attn.1", Physical::kSeparatedHB, 9, 2, 8, 4, 4),
      MakeLayer("mla.0", Physical::kLatent, 9, 1, 4, 16, 2),
      MakeLayer("attn.2", Physical::kPacked, 9, 1, 4, 8, 1, /*block_pad=*/8),
  };
}

std::unique_ptr<Engine> MakeEngine(const std::string& id, BackendOptions options = {},
                                   std::chrono::milliseconds timeout = 60s,
                                   std::size_t history = 65536) {
  EngineConfig config;
  config.engine_id = id;
  config.backend = "loopback";
  config.options = std::move(options);
  config.transfer_timeout = timeout;
  config.terminal_history = history;
  Result<std::unique_ptr<Engine>> engine = Engine::Create(std::move(config));
  EXPECT_TRUE(engine.ok()) << engine.status().ToString();
  return engine.ok() ? std::move(engine).value() : nullptr;
}

// Creates, registers and returns one side.
void SetUpSide(Side& side, const std::string& id, std::vector<TestLayer> layers, std::uint32_t seed,
               BackendOptions options = {}, std::chrono::milliseconds timeout = 60s,
               int split_before = -1) {
  Place(side, std::move(layers), seed, split_before);
  side.engine = MakeEngine(id, std::move(options), timeout);
  ASSERT_NE(side.engine, nullptr);
  std::vector<LayerRegistration> regs = side.Registrations();
  Result<std::vector<std::uint8_t>> meta = side.engine->RegisterKvCaches(regs);
  ASSERT_TRUE(meta.ok()) << id << ": " << meta.status().ToString();
  side.metadata = *meta;
}

// Collects events of one engine; Wait() polls until the transfer's event arrived.
class Events {
 public:
  explicit Events(Engine* engine) : engine_(engine) {}

  // The terminal event of `id`. Fails the test if none arrives within a minute (a hang guard,
  // not a timing assertion).
  TransferEvent Wait(const std::string& id) {
    const auto give_up = std::chrono::steady_clock::now() + 60s;
    while (true) {
      for (const TransferEvent& e : seen_) {
        if (e.transfer_id == id) return e;
      }
      if (std::chrono::steady_clock::now() > give_up) break;
      Poll(100ms);
    }
    ADD_FAILURE() << "no event for transfer '" << id << "'";
    TransferEvent none;
    none.transfer_id = id;
    none.state = TransferState::kPending;
    return none;
  }

  void Poll(std::chrono::milliseconds wait) {
    for (TransferEvent& e : engine_->PollEvents(64, wait)) seen_.push_back(std::move(e));
  }

  std::size_t Count(const std::string& id) const {
    return static_cast<std::size_t>(std::count_if(
        seen_.begin(), seen_.end(), [&](const TransferEvent& e) { return e.transfer_id == id; }));
  }
  const std::vector<TransferEvent>& seen() const { return seen_; }

 private:
  Engine* engine_;
  std::vector<TransferEvent> seen_;
};

// A window of a block for the reference: heads [head_begin, head_begin + heads) and tokens
// [token_begin, token_begin + tokens); a negative count runs to the end of the block.
struct Win {
  std::int64_t head_begin = 0;
  std::int64_t heads = -1;
  std::int64_t token_begin = 0;
  std::int64_t tokens = -1;
};

// Expected content of `dst` after copying blocks of the named layers from `src`: for every block
// pair and every logical byte of the windows (cell (p, h, t) of the destination window from
// cell (p, h, t) of the source window), dst[dst offset] = src[src offset]. Returns the number
// of bytes.
std::int64_t ApplyReference(const Side& dst, const Side& src,
                            const std::vector<std::string>& layer_names,
                            const std::vector<std::int64_t>& dst_blocks,
                            const std::vector<std::int64_t>& src_blocks,
                            std::vector<std::uint8_t>* expected, std::vector<bool>* touched,
                            Win dst_window = {}, Win src_window = {}) {
  std::int64_t bytes = 0;
  const std::uint8_t* s = src.buffer->data();
  for (const std::string& name : layer_names) {
    const TestLayer& dl = dst.Layer(name);
    const TestLayer& sl = src.Layer(name);
    const std::int64_t heads =
        dst_window.heads >= 0 ? dst_window.heads : dl.heads - dst_window.head_begin;
    const std::int64_t tokens =
        dst_window.tokens >= 0 ? dst_window.tokens : dl.block_size - dst_window.token_begin;
    for (std::size_t i = 0; i < dst_blocks.size(); ++i) {
      for (int p = 0; p < dl.planes(); ++p) {
        for (std::int64_t h = 0; h < heads; ++h) {
          for (std::int64_t t = 0; t < tokens; ++t) {
            const std::int64_t dh = dst_window.head_begin + h, dt = dst_window.token_begin + t;
            const std::int64_t sh = src_window.head_begin + h, st = src_window.token_begin + t;
            for (std::int64_t d = 0; d < dl.head_size; ++d) {
              for (std::int64_t b = 0; b < dl.elem; ++b) {
                const std::uint64_t to = dl.offset + dl.Offset(dst_blocks[i], p, dh, dt, d, b);
                const std::uint64_t from = sl.offset + sl.Offset(src_blocks[i], p, sh, st, d, b);
                EXPECT_FALSE((*touched)[to]) << "reference writes byte " << to << " twice";
                (*expected)[to] = s[from];
                (*touched)[to] = true;
                ++bytes;
              }
            }
          }
        }
      }
    }
  }
  return bytes;
}

// Compares `actual` with `expected` byte by byte, reporting the first few differences with
// whether the byte was supposed to be written.
void ExpectBytes(const std::vector<std::uint8_t>& actual, const std::vector<std::uint8_t>& expected,
                 const std::vector<bool>& touched) {
  ASSERT_EQ(actual.size(), expected.size());
  int reported = 0;
  std::size_t wrong_written = 0, wrong_untouched = 0;
  for (std::size_t i = 0; i < actual.size(); ++i) {
    if (actual[i] == expected[i]) continue;
    (touched[i] ? wrong_written : wrong_untouched)++;
    if (reported++ < 8) {
      ADD_FAILURE() << "byte " << i << (touched[i] ? " (copied)" : " (outside the blocks)")
                    << ": got " << int(actual[i]) << ", expected " << int(expected[i]);
    }
  }
  EXPECT_EQ(wrong_written, 0u) << "bytes that should have arrived but differ";
  EXPECT_EQ(wrong_untouched, 0u) << "bytes outside the requested blocks that changed";
}

std::vector<std::string> Names(const Side& side) {
  std::vector<std::string> names;
  for (const TestLayer& l : side.layers) names.push_back(l.name);
  return names;
}

mp::Value* FieldOf(mp::Value& map, const std::string& key) {
  for (auto& [k, v] : std::get<mp::Map>(map.v)) {
    if (k == key) return &v;
  }
  return nullptr;
}

std::vector<std::uint8_t> WithTopLevelString(const std::vector<std::uint8_t>& meta,
                                             const std::string& key, const std::string& value) {
  Result<mp::Value> root = mp::Decode(meta);
  EXPECT_TRUE(root.ok()) << root.status().ToString();
  mp::Value v = std::move(root).value();
  mp::Value* f = FieldOf(v, key);
  EXPECT_NE(f, nullptr) << key;
  if (f) f->v = value;
  return mp::Encode(v);
}

// ---- the fixture: P and D registered and connected both ways -------------------------------

class EnginePair : public ::testing::Test {
 protected:
  void SetUp() override { Build({}, {}); }

  void Build(BackendOptions p_options, BackendOptions d_options,
             std::chrono::milliseconds timeout = 60s) {
    p_ = Side{};
    d_ = Side{};
    ASSERT_NO_FATAL_FAILURE(SetUpSide(p_, "P", PrefillLayers(), 1, std::move(p_options), timeout));
    ASSERT_NO_FATAL_FAILURE(SetUpSide(d_, "D", DecodeLayers(), 2, std::move(d_options), timeout));
    Result<std::string> a = p_.engine->AddPeer(d_.metadata);
    ASSERT_TRUE(a.ok()) << a.status().ToString();
    EXPECT_EQ(*a, "D");
    Result<std::string> b = d_.engine->AddPeer(p_.metadata);
    ASSERT_TRUE(b.ok()) << b.status().ToString();
    EXPECT_EQ(*b, "P");
  }

  // Both engines go before either buffer: one side's transport may target the other's memory.
  void TearDown() override {
    p_.engine.reset();
    d_.engine.reset();
  }

  // Nothing was created by a failed call: no pending transfer, no event, no byte moved.
  void ExpectNothingHappened(const std::vector<std::uint8_t>& p_before,
                             const std::vector<std::uint8_t>& d_before) {
    EXPECT_EQ(p_.engine->PendingTransfers(), 0u);
    EXPECT_EQ(d_.engine->PendingTransfers(), 0u);
    EXPECT_TRUE(p_.engine->PollEvents(16, 0ms).empty());
    EXPECT_TRUE(d_.engine->PollEvents(16, 0ms).empty());
    EXPECT_EQ(p_.buffer->Snapshot(), p_before);
    EXPECT_EQ(d_.buffer->Snapshot(), d_before);
  }

  Side p_;
  Side d_;
};

// ---- READ ---------------------------------------------------------------------------------

TEST_F(EnginePair, ReadPullsEveryLayerIntoTheRequestedBlocksOnly) {
  const std::vector<std::uint8_t> p_before = p_.buffer->Snapshot();
  std::vector<std::uint8_t> expected = d_.buffer->Snapshot();
  std::vector<bool> touched(expected.size(), false);
  // Unsorted ids; the remote list may be longer than the local one (extra ids are ignored).
  const std::vector<std::int64_t> local = {7, 2, 8, 0};
  const std::vector<std::int64_t> remote = {0, 5, 3, 4, 1};
  const std::int64_t bytes = ApplyReference(
      d_, p_, Names(d_), local, {remote.begin(), remote.begin() + 4}, &expected, &touched);

  ASSERT_TRUE(d_.engine->Read("req-1", "P", local, remote).ok());
  Events events(d_.engine.get());
  TransferEvent e = events.Wait("req-1");
  EXPECT_EQ(e.state, TransferState::kDone) << e.message;
  EXPECT_EQ(e.kind, TransferKind::kRead);
  EXPECT_EQ(e.peer, "P");
  EXPECT_EQ(e.bytes, bytes);
  EXPECT_GE(e.batches, 1);
  ExpectBytes(d_.buffer->Snapshot(), expected, touched);
  EXPECT_EQ(p_.buffer->Snapshot(), p_before) << "a READ modified its source";
  events.Poll(20ms);
  EXPECT_EQ(events.Count("req-1"), 1u);
  EXPECT_EQ(d_.engine->PendingTransfers(), 0u);
}

TEST_F(EnginePair, ReadOfSelectedLayersTouchesOnlyThem) {
  std::vector<std::uint8_t> expected = d_.buffer->Snapshot();
  std::vector<bool> touched(expected.size(), false);
  const std::vector<std::string> layers = {"mla.0", "attn.1"};
  const std::vector<std::int64_t> local = {3, 4};
  const std::vector<std::int64_t> remote = {5, 0};
  const std::int64_t bytes = ApplyReference(d_, p_, layers, local, remote, &expected, &touched);
  ASSERT_TRUE(d_.engine->Read("req-sel", "P", local, remote, layers).ok());
  Events events(d_.engine.get());
  TransferEvent e = events.Wait("req-sel");
  EXPECT_EQ(e.state, TransferState::kDone) << e.message;
  EXPECT_EQ(e.bytes, bytes);
  ExpectBytes(d_.buffer->Snapshot(), expected, touched);
}

TEST_F(EnginePair, ReadInTheOtherDirectionUsesThePeersGeometry) {
  // P pulls from D: now P's 6 blocks are local and D's 9 remote.
  std::vector<std::uint8_t> expected = p_.buffer->Snapshot();
  std::vector<bool> touched(expected.size(), false);
  const std::vector<std::int64_t> local = {5, 0, 1};
  const std::vector<std::int64_t> remote = {8, 6, 2};
  ApplyReference(p_, d_, Names(p_), local, remote, &expected, &touched);
  ASSERT_TRUE(p_.engine->Read("pull-back", "D", local, remote).ok());
  Events events(p_.engine.get());
  EXPECT_EQ(events.Wait("pull-back").state, TransferState::kDone);
  ExpectBytes(p_.buffer->Snapshot(), expected, touched);
}

TEST_F(EnginePair, ReadWithNoBlocksCompletesWithoutMovingBytes) {
  const std::vector<std::uint8_t> d_before = d_.buffer->Snapshot();
  ASSERT_TRUE(d_.engine->Read("empty", "P", {}, {}).ok());
  Events events(d_.engine.get());
  TransferEvent e = events.Wait("empty");
  EXPECT_EQ(e.state, TransferState::kDone) << e.message;
  EXPECT_EQ(e.bytes, 0);
  EXPECT_EQ(d_.buffer->Snapshot(), d_before);
}

TEST(EngineRegions, LayersInTwoAllocationsMoveOneBatchPerRegionPair) {
  Side p, d;
  EnginesFirst guard({&p, &d});
  // P's layers attn.0, attn.1 live in one allocation and mla.0, attn.2 in another.
  ASSERT_NO_FATAL_FAILURE(SetUpSide(p, "P", PrefillLayers(), 1, {}, 60s, /*split_before=*/2));
  ASSERT_NO_FATAL_FAILURE(SetUpSide(d, "D", DecodeLayers(), 2));
  Result<detail::EngineMetadata> pm = detail::DecodeMetadata(p.metadata);
  ASSERT_TRUE(pm.ok()) << pm.status().ToString();
  ASSERT_EQ(pm->regions.size(), 2u) << "one region per allocation";
  for (const detail::RegionRecord& r : pm->regions) {
    // Each region lies inside its own allocation.
    const bool low = r.range.address < p.buffer->address() + p.split;
    const std::uint64_t lo = low ? p.buffer->address() : p.buffer->address() + p.split;
    const std::uint64_t hi =
        low ? p.buffer->address() + p.split : p.buffer->address() + p.buffer->size();
    EXPECT_GE(r.range.address, lo);
    EXPECT_LE(r.range.address + r.range.size, hi);
  }
  ASSERT_TRUE(p.engine->AddPeer(d.metadata).ok());
  ASSERT_TRUE(d.engine->AddPeer(p.metadata).ok());

  // D pulls every layer: its one region from P's two regions = two batches.
  std::vector<std::uint8_t> expected = d.buffer->Snapshot();
  std::vector<bool> touched(expected.size(), false);
  const std::vector<std::int64_t> d_ids = {6, 1};
  const std::vector<std::int64_t> p_ids = {2, 5};
  ApplyReference(d, p, Names(d), d_ids, p_ids, &expected, &touched);
  ASSERT_TRUE(d.engine->Read("r", "P", d_ids, p_ids).ok());
  Events d_events(d.engine.get());
  TransferEvent e = d_events.Wait("r");
  EXPECT_EQ(e.state, TransferState::kDone) << e.message;
  // attn.1 and attn.2 (one in each of P's regions) pair different axis orders: cells.
  EXPECT_EQ(e.batches - e.cell_batches, 2) << "one run batch per region pair";
  EXPECT_EQ(e.cell_batches, 2) << "one cell batch per region pair";
  ExpectBytes(d.buffer->Snapshot(), expected, touched);

  // P pulls back into both of its allocations.
  std::vector<std::uint8_t> p_expected = p.buffer->Snapshot();
  std::vector<bool> p_touched(p_expected.size(), false);
  ApplyReference(p, d, Names(p), {0, 3}, {8, 4}, &p_expected, &p_touched);
  ASSERT_TRUE(
      p.engine->Read("back", "D", std::vector<std::int64_t>{0, 3}, std::vector<std::int64_t>{8, 4})
          .ok());
  Events p_events(p.engine.get());
  e = p_events.Wait("back");
  EXPECT_EQ(e.state, TransferState::kDone) << e.message;
  EXPECT_EQ(e.batches - e.cell_batches, 2);
  EXPECT_EQ(e.cell_batches, 2);
  ExpectBytes(p.buffer->Snapshot(), p_expected, p_touched);
}

// ---- cell copies (layer pairs of different axis orders) ------------------------------------

// One layer of 4 heads x 8 tokens x 16 two-byte elements per plane in `physical` (32-byte cells).
std::vector<TestLayer> CellLayers(Physical physical, std::int64_t blocks) {
  return {MakeLayer("kv", physical, blocks, /*heads=*/4, /*block=*/8, /*d=*/16, /*elem=*/2)};
}

struct CellCase {
  Physical local, remote;
};

void PrintTo(const CellCase& c, std::ostream* os) {
  *os << static_cast<int>(c.local) << "->" << static_cast<int>(c.remote);
}

// Whether the planner moves this pair as cells, from the library's own layout description.
bool PrefersCells(const TestLayer& local, const TestLayer& remote) {
  auto describe = [](const TestLayer& l) {
    return DescribeLayer(l.name, {l.shape, l.strides, l.elem, 4096}, SpecOf(l));
  };
  Result<LayerLayout> a = describe(local), b = describe(remote);
  EXPECT_TRUE(a.ok() && b.ok());
  Result<BlockTemplate> t = BlockTemplate::Build(*a, *b);
  EXPECT_TRUE(t.ok()) << t.status().ToString();
  return t.ok() && t->prefers_cell_copy();
}

// Every pair of K/V layouts, READ and WRITE through two engines, with the loopback backend
// taking cells, refusing them (the engine's run fallback), and refusing them but taking stamped
// batches: the same bytes as the hand-indexed reference, the same byte and run counts, and cell
// batches exactly where the pair prefers a cell copy and the backend takes cells.
TEST(EngineCells, EveryLayoutPairMovesTheSameBytesAsCellsAndAsRuns) {
  const Physical layouts[] = {Physical::kSeparated,   Physical::kSeparatedHB, Physical::kInterleaved,
                              Physical::kInterleavedHB, Physical::kPacked,    Physical::kPackedPermuted};
  int cell_pairs = 0;
  for (Physical lp : layouts) {
    for (Physical rp : layouts) {
      const CellCase c{lp, rp};
      const bool prefers = PrefersCells(CellLayers(lp, 1)[0], CellLayers(rp, 1)[0]);
      cell_pairs += prefers ? 1 : 0;
      std::map<std::string, std::pair<std::int64_t, std::int64_t>> counts;  // -> (bytes, runs)
      for (const auto& [cells, stamps] : {std::pair{true, false}, {false, false}, {false, true}}) {
        const std::string path = cells ? "cells" : stamps ? "stamps" : "runs";
        SCOPED_TRACE(::testing::PrintToString(c) + " " + path);
        const BackendOptions options{{"loopback_cells", cells ? "1" : "0"},
                                     {"loopback_stamps", stamps ? "1" : "0"}};
        Side d, p;
        EnginesFirst guard({&d, &p});
        ASSERT_NO_FATAL_FAILURE(SetUpSide(d, "D", CellLayers(lp, 7), 3, options));
        ASSERT_NO_FATAL_FAILURE(SetUpSide(p, "P", CellLayers(rp, 5), 4, options));
        ASSERT_TRUE(d.engine->AddPeer(p.metadata).ok());
        ASSERT_TRUE(p.engine->AddPeer(d.metadata).ok());
        const std::vector<std::int64_t> d_ids = {6, 0, 3}, p_ids = {1, 4, 2};
        // READ: D pulls P's blocks.
        std::vector<std::uint8_t> expected = d.buffer->Snapshot();
        std::vector<bool> touched(expected.size(), false);
        const std::int64_t bytes =
            ApplyReference(d, p, {"kv"}, d_ids, p_ids, &expected, &touched);
        ASSERT_TRUE(d.engine->Read("r", "P", d_ids, p_ids).ok());
        Events d_events(d.engine.get());
        TransferEvent e = d_events.Wait("r");
        EXPECT_EQ(e.state, TransferState::kDone) << e.message;
        EXPECT_EQ(e.bytes, bytes);
        EXPECT_EQ(e.batches, 1);
        EXPECT_EQ(e.cell_batches, cells && prefers ? 1 : 0);
        EXPECT_EQ(e.stamped_batches, stamps ? 1 : 0);
        ExpectBytes(d.buffer->Snapshot(), expected, touched);
        counts[path] = {e.bytes, e.runs};
        // WRITE: P pushes its blocks back into other blocks of D's.
        const std::vector<std::int64_t> d_to = {2, 5};
        std::vector<std::uint8_t> w_expected = d.buffer->Snapshot();
        std::vector<bool> w_touched(w_expected.size(), false);
        ApplyReference(d, p, {"kv"}, d_to, {0, 3}, &w_expected, &w_touched);
        Result<bool> w = p.engine->WriteLayer("w", "kv", "D", std::vector<std::int64_t>{0, 3}, d_to);
        ASSERT_TRUE(w.ok() && *w) << w.status().ToString();
        ASSERT_TRUE(p.engine->Seal("w", "D", 1).ok());
        Events p_events(p.engine.get());
        e = p_events.Wait("w");
        EXPECT_EQ(e.state, TransferState::kDone) << e.message;
        EXPECT_EQ(e.cell_batches, cells && prefers ? 1 : 0);
        EXPECT_EQ(e.stamped_batches, stamps ? 1 : 0);
        ExpectBytes(d.buffer->Snapshot(), w_expected, w_touched);
      }
      EXPECT_EQ(counts["cells"], counts["runs"]) << ::testing::PrintToString(c)
                                                 << ": bytes and runs must not depend on the path";
      EXPECT_EQ(counts["stamps"], counts["runs"]) << ::testing::PrintToString(c);
    }
  }
  EXPECT_GE(cell_pairs, 8) << "the NHD/HND pairs must prefer cells";
}

// A READ over layers of two cell geometries and one run layer: one batch each, all bytes.
TEST(EngineCells, LayersOfDifferentGeometriesGoInTheirOwnCellBatches) {
  auto layers = [](bool hnd) {
    const Physical kv = hnd ? Physical::kInterleavedHB : Physical::kSeparated;
    return std::vector<TestLayer>{MakeLayer("a", kv, 6, 4, 8, 16, 2),
                                  MakeLayer("b", kv, 6, 2, 16, 8, 2),
                                  MakeLayer("c", kv, 6, 4, 8, 16, 2),
                                  MakeLayer("lat", Physical::kLatent, 6, 1, 8, 32, 2)};
  };
  Side d, p;
  EnginesFirst guard({&d, &p});
  ASSERT_NO_FATAL_FAILURE(SetUpSide(d, "D", layers(true), 5));
  ASSERT_NO_FATAL_FAILURE(SetUpSide(p, "P", layers(false), 6));
  ASSERT_TRUE(d.engine->AddPeer(p.metadata).ok());
  std::vector<std::uint8_t> expected = d.buffer->Snapshot();
  std::vector<bool> touched(expected.size(), false);
  const std::vector<std::int64_t> d_ids = {5, 1, 2}, p_ids = {0, 4, 3};
  const std::int64_t bytes = ApplyReference(d, p, Names(d), d_ids, p_ids, &expected, &touched);
  ASSERT_TRUE(d.engine->Read("mixed", "P", d_ids, p_ids).ok());
  Events events(d.engine.get());
  const TransferEvent e = events.Wait("mixed");
  EXPECT_EQ(e.state, TransferState::kDone) << e.message;
  EXPECT_EQ(e.bytes, bytes);
  EXPECT_EQ(e.batches, 3) << "a and c share a cell batch, b has its own, lat goes as runs";
  EXPECT_EQ(e.cell_batches, 2);
  ExpectBytes(d.buffer->Snapshot(), expected, touched);
}

// Cell batches are cut at a layer boundary once they hold 8192 blocks, as run batches at 8192
// runs, a request's first three at 1024, 2048 and 4096 (engine.cpp, kRampPieces): five layers
// of 3000 blocks give batches of one layer, one layer, two layers and the last one.
TEST(EngineCells, ManyBlocksAreSubmittedInPiecesAndEveryByteArrives) {
  auto layers = [](Physical physical) {
    std::vector<TestLayer> out;
    for (int i = 0; i < 5; ++i) {
      out.push_back(MakeLayer("kv." + std::to_string(i), physical, 3000, 2, 4, 1, 2));
    }
    return out;
  };
  Side d, p;
  EnginesFirst guard({&d, &p});
  ASSERT_NO_FATAL_FAILURE(SetUpSide(d, "D", layers(Physical::kInterleavedHB), 7));
  ASSERT_NO_FATAL_FAILURE(SetUpSide(p, "P", layers(Physical::kSeparated), 8));
  ASSERT_TRUE(d.engine->AddPeer(p.metadata).ok());
  std::vector<std::int64_t> local(3000), remote(3000);
  for (std::int64_t i = 0; i < 3000; ++i) {
    local[i] = i;
    remote[i] = 2999 - i;
  }
  std::vector<std::uint8_t> expected = d.buffer->Snapshot();
  std::vector<bool> touched(expected.size(), false);
  const std::int64_t bytes = ApplyReference(d, p, Names(d), local, remote, &expected, &touched);
  ASSERT_TRUE(d.engine->Read("big", "P", local, remote).ok());
  Events events(d.engine.get());
  const TransferEvent e = events.Wait("big");
  EXPECT_EQ(e.state, TransferState::kDone) << e.message;
  EXPECT_EQ(e.bytes, bytes);
  EXPECT_EQ(e.batches, 4);
  EXPECT_EQ(e.cell_batches, 4);
  EXPECT_EQ(e.runs, 5 * 3000 * 16) << "the runs the cells replace: 16 per block and layer";
  ExpectBytes(d.buffer->Snapshot(), expected, touched);
}

// Four latent layers of one 4-byte run per block. D's last layer may be one block shorter, so
// an id that is valid for the first layers (planned and submitted first) is out of range only
// there.
std::vector<TestLayer> LargeLayers(std::int64_t last_layer_blocks, std::int64_t blocks = 3000) {
  std::vector<TestLayer> layers;
  for (int i = 0; i < 4; ++i) {
    const std::int64_t layer_blocks = i == 3 ? last_layer_blocks : blocks;
    layers.push_back(MakeLayer("lat." + std::to_string(i), Physical::kLatent, layer_blocks, 1, 1,
                               2, 2, /*block_pad=*/i % 2));
  }
  return layers;
}

// Small runs go in large pieces: a run batch closes at a layer boundary once it holds 8192 runs
// that carry 256 MiB, or 65,536 runs (engine.cpp, kPieceBytes and kMaxPieceRuns), the request's
// first three pieces at 1/8, 1/4 and 1/2 of these (kRampPieces). 4-byte runs carry no bytes to
// speak of, so 4 x 2999 of them go as two batches (the first three layers reach 8192 runs) and
// 4 x 23999 as three: the first layer (past 8192), the second (past 16,384), the last two.
TEST(EngineLargeRead, ManyRunsAreSubmittedInPiecesAndEveryByteArrives) {
  for (const std::int64_t n : {std::int64_t{3000}, std::int64_t{24000}}) {
    SCOPED_TRACE(n);
    Side p, d;
    EnginesFirst guard({&p, &d});
    ASSERT_NO_FATAL_FAILURE(SetUpSide(p, "P", LargeLayers(n, n), 1));
    ASSERT_NO_FATAL_FAILURE(SetUpSide(d, "D", LargeLayers(n - 1, n), 2));
    ASSERT_TRUE(p.engine->AddPeer(d.metadata).ok());
    ASSERT_TRUE(d.engine->AddPeer(p.metadata).ok());

    // Local ids ascending, remote ids descending: no two runs merge, one run per block and layer.
    std::vector<std::int64_t> local(n), remote(n);
    for (std::int64_t i = 0; i < n; ++i) {
      local[i] = i;
      remote[i] = n - 1 - i;
    }
    // Block n - 1 exists in D's first three layers but not in lat.3: the call fails before any
    // piece is submitted.
    const std::vector<std::uint8_t> d_before = d.buffer->Snapshot();
    Status bad = d.engine->Read("too-far", "P", local, remote);
    EXPECT_EQ(bad.code(), StatusCode::kOutOfRange) << bad.ToString();
    EXPECT_NE(bad.message().find("lat.3"), std::string::npos) << bad.ToString();
    EXPECT_EQ(d.engine->PendingTransfers(), 0u);
    EXPECT_TRUE(d.engine->PollEvents(16, 0ms).empty());
    EXPECT_EQ(d.buffer->Snapshot(), d_before);

    local.pop_back();
    remote.erase(remote.begin());
    std::vector<std::uint8_t> expected = d.buffer->Snapshot();
    std::vector<bool> touched(expected.size(), false);
    const std::int64_t bytes =
        ApplyReference(d, p, Names(d), local, remote, &expected, &touched);
    ASSERT_TRUE(d.engine->Read("large", "P", local, remote).ok());
    Events events(d.engine.get());
    TransferEvent e = events.Wait("large");
    EXPECT_EQ(e.state, TransferState::kDone) << e.message;
    EXPECT_EQ(e.bytes, bytes);
    EXPECT_EQ(e.runs, 4 * (n - 1));
    EXPECT_EQ(e.batches, n == 3000 ? 2 : 3);
    ExpectBytes(d.buffer->Snapshot(), expected, touched);
  }
}

// Batches' run columns are recycled (cpp/column_pool.hpp): requests of different sizes and block
// orders, one after the other, each move exactly their own runs (a column holding the runs of
// the request before would show up in the run count and in the bytes).
TEST(EngineLargeRead, RequestsAfterEachOtherReuseColumnsAndMoveOnlyTheirOwnRuns) {
  constexpr std::int64_t n = 20000;
  Side p, d;
  EnginesFirst guard({&p, &d});
  ASSERT_NO_FATAL_FAILURE(SetUpSide(p, "P", LargeLayers(n, n), 1));
  ASSERT_NO_FATAL_FAILURE(SetUpSide(d, "D", LargeLayers(n, n), 2));
  ASSERT_TRUE(p.engine->AddPeer(d.metadata).ok());
  ASSERT_TRUE(d.engine->AddPeer(p.metadata).ok());
  Events events(d.engine.get());
  int request = 0;
  for (const std::int64_t count : {n, std::int64_t{700}, n - 3, std::int64_t{1}, n / 2}) {
    SCOPED_TRACE(count);
    // A different pairing each time, never merging: local ascending, remote descending from a
    // shifting start.
    std::vector<std::int64_t> local(count), remote(count);
    for (std::int64_t i = 0; i < count; ++i) {
      local[i] = i + (n - count) / 2;
      remote[i] = (count - 1 - i) + request % (n - count + 1);
    }
    std::vector<std::uint8_t> expected = d.buffer->Snapshot();
    std::vector<bool> touched(expected.size(), false);
    const std::int64_t bytes = ApplyReference(d, p, Names(d), local, remote, &expected, &touched);
    const std::string id = "again-" + std::to_string(request++);
    ASSERT_TRUE(d.engine->Read(id, "P", local, remote).ok());
    TransferEvent e = events.Wait(id);
    EXPECT_EQ(e.state, TransferState::kDone) << e.message;
    EXPECT_EQ(e.bytes, bytes);
    EXPECT_EQ(e.runs, 4 * count);
    ExpectBytes(d.buffer->Snapshot(), expected, touched);
  }
}

// ---- WRITE --------------------------------------------------------------------------------

// A CUDA event orders a copy only on the GPU: for a host layer (or a backend without the CUDA
// copy kernel) WriteLayer refuses it, naming why, schedules nothing and fails the transfer (its
// caller was told this layer will not arrive).
// Whether a caller may pass CUDA events is a property of the peer (its memory mapped for the GPU
// copy); the loopback backend never copies on a GPU, and an unknown peer is named.
TEST_F(EnginePair, WaitsForDeviceEventsIsAskedPerPeer) {
  Result<bool> d = p_.engine->WaitsForDeviceEvents("D");
  ASSERT_TRUE(d.ok()) << d.status().ToString();
  EXPECT_FALSE(*d);
  Result<bool> unknown = p_.engine->WaitsForDeviceEvents("nobody");
  ASSERT_FALSE(unknown.ok());
  EXPECT_EQ(unknown.status().code(), StatusCode::kNotFound);
  EXPECT_NE(unknown.status().ToString().find("nobody"), std::string::npos)
      << unknown.status().ToString();
}

TEST_F(EnginePair, WriteLayerRefusesACudaEventItCannotHonour) {
  const std::vector<std::int64_t> ids = {4, 1};
  Result<bool> r = p_.engine->WriteLayer("w-ev", "attn.0", "D", ids, ids, /*cuda_event=*/0x1234);
  ASSERT_FALSE(r.ok());
  EXPECT_EQ(r.status().code(), StatusCode::kFailedPrecondition);
  EXPECT_NE(r.status().ToString().find("not in GPU memory"), std::string::npos)
      << r.status().ToString();
  Events events(p_.engine.get());
  EXPECT_EQ(events.Wait("w-ev").state, TransferState::kFailed);
  // The same layer without the event is scheduled as usual.
  Result<bool> plain = p_.engine->WriteLayer("w-plain", "attn.0", "D", ids, ids);
  ASSERT_TRUE(plain.ok()) << plain.status().ToString();
  EXPECT_TRUE(*plain);
  ASSERT_TRUE(p_.engine->Seal("w-plain", "D", 1).ok());
  EXPECT_EQ(events.Wait("w-plain").state, TransferState::kDone);
}

TEST_F(EnginePair, WriteLayerBySealPushesEveryLayerOnce) {
  const std::vector<std::uint8_t> p_before = p_.buffer->Snapshot();
  std::vector<std::uint8_t> expected = d_.buffer->Snapshot();
  std::vector<bool> touched(expected.size(), false);
  const std::vector<std::int64_t> local = {4, 1};
  const std::vector<std::int64_t> remote = {0, 8};
  const std::int64_t bytes = ApplyReference(d_, p_, Names(p_), remote, local, &expected, &touched);

  for (const TestLayer& l : p_.layers) {
    Result<bool> scheduled = p_.engine->WriteLayer("w-1", l.name, "D", local, remote);
    ASSERT_TRUE(scheduled.ok()) << l.name << ": " << scheduled.status().ToString();
    EXPECT_TRUE(*scheduled) << l.name;
    // Scheduling the same layer again (a retry) is refused and moves nothing more.
    Result<bool> again = p_.engine->WriteLayer("w-1", l.name, "D", local, remote);
    ASSERT_TRUE(again.ok()) << again.status().ToString();
    EXPECT_FALSE(*again) << l.name;
  }
  const auto n_layers = static_cast<std::int64_t>(p_.layers.size());
  ASSERT_TRUE(p_.engine->Seal("w-1", "D", n_layers).ok());
  Events events(p_.engine.get());
  TransferEvent e = events.Wait("w-1");
  EXPECT_EQ(e.state, TransferState::kDone) << e.message;
  EXPECT_EQ(e.kind, TransferKind::kWrite);
  EXPECT_EQ(e.peer, "D");
  EXPECT_EQ(e.bytes, bytes);
  EXPECT_EQ(e.batches, static_cast<std::int64_t>(p_.layers.size()));
  ExpectBytes(d_.buffer->Snapshot(), expected, touched);
  EXPECT_EQ(p_.buffer->Snapshot(), p_before) << "a WRITE modified its source";
  events.Poll(20ms);
  EXPECT_EQ(events.Count("w-1"), 1u);
  // Late calls for a finished write neither restart it nor produce another event.
  Result<bool> late = p_.engine->WriteLayer("w-1", "attn.0", "D", local, remote);
  ASSERT_TRUE(late.ok()) << late.status().ToString();
  EXPECT_FALSE(*late);
  EXPECT_TRUE(p_.engine->Seal("w-1", "D", n_layers).ok());
  events.Poll(20ms);
  EXPECT_EQ(events.Count("w-1"), 1u);
  EXPECT_EQ(p_.engine->PendingTransfers(), 0u);
}

// Several layers in one call: each counts towards the seal as one write, the bytes are those of
// per-layer writes, and the layers share batches (one per region pair and kind of copy, not one
// per layer).
TEST_F(EnginePair, WriteLayersPushesSeveralLayersInOneCallEachCountingTowardsTheSeal) {
  const std::vector<std::uint8_t> p_before = p_.buffer->Snapshot();
  std::vector<std::uint8_t> expected = d_.buffer->Snapshot();
  std::vector<bool> touched(expected.size(), false);
  const std::vector<std::int64_t> local = {4, 1};
  const std::vector<std::int64_t> remote = {0, 8};
  const std::vector<std::string> names = Names(p_);
  const std::int64_t bytes = ApplyReference(d_, p_, names, remote, local, &expected, &touched);
  const std::vector<std::string> all_but_last(names.begin(), names.end() - 1);

  Result<bool> r = p_.engine->WriteLayers("wl", all_but_last, "D", local, remote);
  ASSERT_TRUE(r.ok()) << r.status().ToString();
  EXPECT_TRUE(*r);
  // The same layers again (a retry) are refused and move nothing more.
  Result<bool> again = p_.engine->WriteLayers("wl", all_but_last, "D", local, remote);
  ASSERT_TRUE(again.ok()) << again.status().ToString();
  EXPECT_FALSE(*again);
  const auto n_layers = static_cast<std::int64_t>(names.size());
  ASSERT_TRUE(p_.engine->Seal("wl", "D", n_layers).ok());
  Events events(p_.engine.get());
  events.Poll(20ms);
  EXPECT_EQ(events.Count("wl"), 0u) << "done with one sealed layer never written";
  Result<bool> last = p_.engine->WriteLayer("wl", names.back(), "D", local, remote);
  ASSERT_TRUE(last.ok()) << last.status().ToString();
  EXPECT_TRUE(*last);
  TransferEvent e = events.Wait("wl");
  EXPECT_EQ(e.state, TransferState::kDone) << e.message;
  EXPECT_EQ(e.bytes, bytes);
  EXPECT_LT(e.batches, n_layers) << "the call's layers shared batches";
  ExpectBytes(d_.buffer->Snapshot(), expected, touched);
  EXPECT_EQ(p_.buffer->Snapshot(), p_before) << "a WRITE modified its source";
  events.Poll(20ms);
  EXPECT_EQ(events.Count("wl"), 1u);
  EXPECT_EQ(p_.engine->PendingTransfers(), 0u);
}

// Every refusal names what was wrong; the ones about a layer fail the transfer (its caller was
// told those layers will not arrive), an empty list and a READ id change nothing.
TEST_F(EnginePair, WriteLayersRefusesBadInputNamingIt) {
  const std::vector<std::uint8_t> p_before = p_.buffer->Snapshot();
  const std::vector<std::uint8_t> d_before = d_.buffer->Snapshot();
  const std::vector<std::int64_t> ids = {4, 1};
  Events events(p_.engine.get());
  auto expect_refused = [&](const std::string& id, const std::vector<std::string>& layers,
                            std::span<const std::int64_t> local, std::uint64_t cuda_event,
                            StatusCode code, const std::string& named) {
    SCOPED_TRACE(id);
    Result<bool> r = p_.engine->WriteLayers(id, layers, "D", local, ids, cuda_event);
    ASSERT_FALSE(r.ok());
    EXPECT_EQ(r.status().code(), code) << r.status().ToString();
    EXPECT_NE(r.status().ToString().find(named), std::string::npos) << r.status().ToString();
    EXPECT_NE(r.status().ToString().find("'" + id + "'"), std::string::npos)
        << r.status().ToString();
    EXPECT_EQ(events.Wait(id).state, TransferState::kFailed);
  };
  const std::vector<std::string> none;
  Result<bool> empty = p_.engine->WriteLayers("wl-none", none, "D", ids, ids);
  EXPECT_EQ(empty.status().code(), StatusCode::kInvalidArgument);
  ExpectNothingHappened(p_before, d_before);

  expect_refused("wl-unknown", {"attn.0", "nope"}, ids, 0, StatusCode::kNotFound, "'nope'");
  expect_refused("wl-twice", {"attn.0", "mla.0", "attn.0"}, ids, 0, StatusCode::kInvalidArgument,
                 "'attn.0' listed twice");
  const std::vector<std::int64_t> out_of_range = {4, 99};
  expect_refused("wl-id", {"attn.0", "mla.0"}, out_of_range, 0, StatusCode::kOutOfRange, "99");
  expect_refused("wl-event", {"attn.0", "mla.0"}, ids, 0x1234, StatusCode::kFailedPrecondition,
                 "layer 'attn.0'");
  EXPECT_EQ(d_.buffer->Snapshot(), d_before) << "a refused call moved bytes";

  // A READ id: refused, the READ untouched.
  ASSERT_TRUE(p_.engine->Read("rd", "D", ids, ids).ok());
  const std::vector<std::string> one = {"attn.0"};
  Result<bool> on_read = p_.engine->WriteLayers("rd", one, "D", ids, ids);
  EXPECT_EQ(on_read.status().code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(events.Wait("rd").state, TransferState::kDone);

  // Some of the layers written before, not all: an ambiguous retry, refused naming the layer.
  ASSERT_TRUE(p_.engine->WriteLayer("wl-part", "attn.0", "D", ids, ids).value());
  expect_refused("wl-part", {"mla.0", "attn.0"}, ids, 0, StatusCode::kInvalidArgument,
                 "layer 'attn.0' was scheduled before");
  EXPECT_EQ(p_.engine->PendingTransfers(), 0u);
}

// ---- timing marks (trace_marks.hpp) ------------------------------------------------------------

// The marks' names, in recording order, of the calling thread (the loopback backend records none).
std::vector<std::string> MarkNames(const trace::Taken& taken) {
  std::vector<std::string> out;
  for (const trace::Stamp& s : taken.stamps) out.emplace_back(trace::MarkName(s.mark));
  return out;
}

TEST_F(EnginePair, ReadAndWriteLayerStampTheirPathInOrder) {
  if (!trace::CompiledIn()) GTEST_SKIP() << "built without MORIIO_NATIVE_TRACE_MARKS";
  const std::vector<std::int64_t> local = {3, 1};
  const std::vector<std::int64_t> remote = {2, 0};
  ASSERT_TRUE(trace::Enable(1024).ok());
  ASSERT_TRUE(d_.engine->Read("marks-r", "P", local, remote).ok());
  trace::Taken read = trace::Take();
  Result<bool> w = p_.engine->WriteLayer("marks-w", p_.layers.front().name, "D", local, remote);
  ASSERT_TRUE(w.ok()) << w.status().ToString();
  trace::Taken write = trace::Take();
  // A refused call stamps its entry and exit and nothing between.
  EXPECT_FALSE(d_.engine->Read("marks-bad", "nobody", local, remote).ok());
  trace::Taken refused = trace::Take();
  trace::Disable();
  ASSERT_TRUE(p_.engine->Seal("marks-w", "D", 1).ok());
  Events dr(d_.engine.get());
  Events pw(p_.engine.get());
  EXPECT_EQ(dr.Wait("marks-r").state, TransferState::kDone);
  EXPECT_EQ(pw.Wait("marks-w").state, TransferState::kDone);

  // Entry, the ids checked, every layer planned, ready to cut, then per batch the piece and the
  // backend's Submit around its token, then the exit. A WRITE of one layer is one batch; the
  // READ has one batch per region pair of these caches.
  const std::vector<std::string> head = {"call_entry", "pairs_checked", "layers_planned",
                                         "planned"};
  const std::vector<std::string> per_batch = {"piece_cut", "submit_entry", "submit_exit"};
  for (const trace::Taken* t : {&read, &write}) {
    const std::vector<std::string> names = MarkNames(*t);
    EXPECT_EQ(t->dropped, 0u);
    ASSERT_GE(names.size(), head.size() + per_batch.size() + 1) << ::testing::PrintToString(names);
    const std::size_t batches = (names.size() - head.size() - 1) / per_batch.size();
    std::vector<std::string> expected = head;
    for (std::size_t b = 0; b < batches; ++b) {
      expected.insert(expected.end(), per_batch.begin(), per_batch.end());
    }
    expected.push_back("call_exit");
    EXPECT_EQ(names, expected);
    EXPECT_EQ(t->stamps[0].token, 0u);
    std::set<std::uint64_t> tokens;
    for (std::size_t b = 0; b < batches && names == expected; ++b) {
      const trace::Stamp& in = t->stamps[head.size() + b * 3 + 1];
      const trace::Stamp& out = t->stamps[head.size() + b * 3 + 2];
      EXPECT_NE(in.token, 0u) << "submit_entry carries the batch's token";
      EXPECT_EQ(in.token, out.token);
      tokens.insert(in.token);
    }
    EXPECT_EQ(tokens.size(), batches) << "one token per batch";
  }
  EXPECT_EQ(MarkNames(write).size(), head.size() + per_batch.size() + 1) << "one layer, one batch";
  EXPECT_EQ(MarkNames(refused), (std::vector<std::string>{"call_entry", "call_exit"}));
}

TEST_F(EnginePair, WriteIsDoneOnlyAfterSealAndEveryScheduledLayer) {
  // Slow transport on P: the seal arrives while writes are in flight; "done" must still mean
  // that every scheduled layer's bytes are at D.
  Build({{"loopback_delay_ms", "30"}}, {});
  std::vector<std::uint8_t> expected = d_.buffer->Snapshot();
  std::vector<bool> touched(expected.size(), false);
  const std::vector<std::string> layers = {"attn.0", "mla.0", "attn.2"};
  const std::vector<std::int64_t> local = {2, 3, 5};
  const std::vector<std::int64_t> remote = {1, 2, 7};
  ApplyReference(d_, p_, layers, remote, local, &expected, &touched);
  Events events(p_.engine.get());
  for (const std::string& name : layers) {
    ASSERT_TRUE(p_.engine->WriteLayer("w-2", name, "D", local, remote).ok());
    events.Poll(0ms);
    EXPECT_EQ(events.Count("w-2"), 0u) << "done before the seal";
  }
  ASSERT_TRUE(p_.engine->Seal("w-2", "D", 3).ok());
  TransferEvent e = events.Wait("w-2");
  EXPECT_EQ(e.state, TransferState::kDone) << e.message;
  EXPECT_EQ(e.batches, 3);
  ExpectBytes(d_.buffer->Snapshot(), expected, touched);
}

TEST_F(EnginePair, SealWithNothingScheduledIsDoneAtOnce) {
  const std::vector<std::uint8_t> d_before = d_.buffer->Snapshot();
  ASSERT_TRUE(p_.engine->Seal("nothing", "D", 0).ok());  // "nothing to send", said explicitly
  Events events(p_.engine.get());
  TransferEvent e = events.Wait("nothing");
  EXPECT_EQ(e.state, TransferState::kDone);
  EXPECT_EQ(e.bytes, 0);
  EXPECT_EQ(d_.buffer->Snapshot(), d_before);
  // Layers scheduled after the (empty) seal are refused.
  const std::vector<std::int64_t> ids = {0};
  Result<bool> late = p_.engine->WriteLayer("nothing", "attn.0", "D", ids, ids);
  ASSERT_TRUE(late.ok()) << late.status().ToString();
  EXPECT_FALSE(*late);
  EXPECT_EQ(d_.buffer->Snapshot(), d_before);
}

TEST_F(EnginePair, WriteLayersOfOneTransferMayNameDifferentBlocks) {
  // The engine reuses the block pairs of the previous call when the ids repeat; other ids in
  // between must not be served from it.
  std::vector<std::uint8_t> expected = d_.buffer->Snapshot();
  std::vector<bool> touched(expected.size(), false);
  struct Write {
    std::string layer;
    std::vector<std::int64_t> local, remote;
  };
  const std::vector<Write> writes = {
      {"attn.0", {4, 1}, {0, 8}},
      {"attn.1", {4, 1}, {0, 8}},  // the same ids: served from the previous call
      {"mla.0", {4, 1}, {0, 7}},   // same local ids, other remote ids
      {"attn.2", {1, 4}, {7, 0}},  // the same pairs as mla.0, listed in another order
  };
  for (const Write& w : writes) {
    ApplyReference(d_, p_, {w.layer}, w.remote, w.local, &expected, &touched);
    Result<bool> scheduled = p_.engine->WriteLayer("w-ids", w.layer, "D", w.local, w.remote);
    ASSERT_TRUE(scheduled.ok()) << w.layer << ": " << scheduled.status().ToString();
    EXPECT_TRUE(*scheduled) << w.layer;
  }
  ASSERT_TRUE(p_.engine->Seal("w-ids", "D", static_cast<std::int64_t>(writes.size())).ok());
  Events events(p_.engine.get());
  TransferEvent e = events.Wait("w-ids");
  EXPECT_EQ(e.state, TransferState::kDone) << e.message;
  ExpectBytes(d_.buffer->Snapshot(), expected, touched);
}

TEST_F(EnginePair, ManyConcurrentTransfersEachEndOnce) {
  // Threads issue reads (D) and layer writes + seals (P) at the same time. Under TSan this
  // covers the engine's locking around peers, plans, the tracker and the backend.
  constexpr int kThreads = 4;
  constexpr int kPerThread = 25;
  std::vector<std::thread> threads;
  for (int th = 0; th < kThreads; ++th) {
    threads.emplace_back([&, th] {
      std::mt19937 rng(th);
      for (int k = 0; k < kPerThread; ++k) {
        const std::string id = "t" + std::to_string(th) + "-" + std::to_string(k);
        // Reads fill D blocks 0-3 from P blocks 0-2; writes fill D blocks 5-8 from P blocks
        // 3-5. No byte is written by two engines' transports at once (that would be a race in
        // the caller, as it would be on real hardware); concurrent reads of a source are fine.
        const bool read = th % 2 == 0;
        const std::int64_t p_block = read ? rng() % 3 : 3 + rng() % 3;
        const std::int64_t d_block = read ? rng() % 4 : 5 + rng() % 4;
        if (read) {
          EXPECT_TRUE(d_.engine
                          ->Read(id, "P", std::vector<std::int64_t>{d_block},
                                 std::vector<std::int64_t>{p_block})
                          .ok());
        } else {
          for (const TestLayer& l : p_.layers) {
            Result<bool> r =
                p_.engine->WriteLayer(id, l.name, "D", std::vector<std::int64_t>{p_block},
                                      std::vector<std::int64_t>{d_block});
            EXPECT_TRUE(r.ok() && *r) << id;
          }
          EXPECT_TRUE(
              p_.engine->Seal(id, "D", static_cast<std::int64_t>(p_.layers.size())).ok());
        }
      }
    });
  }
  for (std::thread& t : threads) t.join();
  Events p_events(p_.engine.get());
  Events d_events(d_.engine.get());
  for (int th = 0; th < kThreads; ++th) {
    Events& ev = th % 2 == 0 ? d_events : p_events;
    for (int k = 0; k < kPerThread; ++k) {
      const std::string id = "t" + std::to_string(th) + "-" + std::to_string(k);
      EXPECT_EQ(ev.Wait(id).state, TransferState::kDone) << id;
    }
  }
  p_events.Poll(20ms);
  d_events.Poll(20ms);
  EXPECT_EQ(p_events.seen().size() + d_events.seen().size(),
            static_cast<std::size_t>(kThreads * kPerThread));
  EXPECT_EQ(p_.engine->PendingTransfers(), 0u);
  EXPECT_EQ(d_.engine->PendingTransfers(), 0u);
}

// ---- errors that must create nothing -------------------------------------------------------

TEST_F(EnginePair, UnknownPeerOrLayerIsNotFoundAndCreatesNothing) {
  const auto p_before = p_.buffer->Snapshot();
  const auto d_before = d_.buffer->Snapshot();
  const std::vector<std::int64_t> ids = {1};
  Status st = d_.engine->Read("x", "nobody", ids, ids);
  EXPECT_EQ(st.code(), StatusCode::kNotFound) << st.ToString();
  EXPECT_NE(st.message().find("nobody"), std::string::npos) << st.ToString();
  const std::vector<std::string> bad_layers = {"attn.0", "no.such.layer"};
  st = d_.engine->Read("x", "P", ids, ids, bad_layers);
  EXPECT_EQ(st.code(), StatusCode::kNotFound) << st.ToString();
  EXPECT_NE(st.message().find("no.such.layer"), std::string::npos) << st.ToString();
  Result<bool> w = p_.engine->WriteLayer("x", "attn.0", "nobody", ids, ids);
  EXPECT_EQ(w.status().code(), StatusCode::kNotFound) << w.status().ToString();
  w = p_.engine->WriteLayer("y", "no.such.layer", "D", ids, ids);
  EXPECT_EQ(w.status().code(), StatusCode::kNotFound) << w.status().ToString();
  EXPECT_NE(w.status().message().find("no.such.layer"), std::string::npos);
  EXPECT_EQ(p_.buffer->Snapshot(), p_before);
  EXPECT_EQ(d_.buffer->Snapshot(), d_before);
  EXPECT_EQ(d_.engine->PendingTransfers(), 0u);
  // A refused layer fails its WRITE (no seal may make it done), moving nothing.
  Events p_events(p_.engine.get());
  EXPECT_EQ(p_events.Wait("x").state, TransferState::kFailed);
  EXPECT_EQ(p_events.Wait("y").state, TransferState::kFailed);
  EXPECT_FALSE(p_.engine->Seal("y", "D", 1).value());  // late: ignored, and says so
  p_events.Poll(20ms);
  EXPECT_EQ(p_events.Count("y"), 1u);
  // The id was not used up by the failed calls.
  ASSERT_TRUE(d_.engine->Read("x", "P", ids, ids).ok());
  Events events(d_.engine.get());
  EXPECT_EQ(events.Wait("x").state, TransferState::kDone);
}

// WriteLayer and WriteLayers do nothing (return false) for a layer scheduled before with the
// same peer and blocks, whatever else the repeat carries: a CUDA event the peer cannot honour
// failed the live transfer it repeated, which then ended failed instead of done (a review,
// 2026-12-07). A write of the layer with other blocks is refused and changes nothing: before (a
// second review that day), it returned false like a repeat, and the transfer ended done
// without ever writing its blocks.
TEST_F(EnginePair, ARepeatOfScheduledWritesDoesNothingAndAnotherWriteOfTheLayerIsRefused) {
  Build({{"loopback_delay_ms", "300"}}, {});  // the first write is still in flight
  const std::vector<std::int64_t> ids = {0}, into = {1}, out_of_range = {1 << 30};
  Result<bool> first = p_.engine->WriteLayer("rep", "attn.0", "D", ids, into);
  ASSERT_TRUE(first.ok() && *first) << first.status().ToString();
  struct Repeat {
    const char* what;
    std::function<Result<bool>()> call;
  };
  const std::vector<std::string> names = {"attn.0"};
  const std::vector<Repeat> repeats = {
      {"WriteLayer with a CUDA event the loopback peer cannot honour",
       [&] { return p_.engine->WriteLayer("rep", "attn.0", "D", ids, into, 0x1234); }},
      {"WriteLayers of the same blocks",
       [&] { return p_.engine->WriteLayers("rep", names, "D", ids, into); }},
  };
  for (const Repeat& r : repeats) {
    SCOPED_TRACE(r.what);
    Result<bool> again = r.call();
    ASSERT_TRUE(again.ok()) << again.status().ToString();
    EXPECT_FALSE(*again);
  }
  const std::vector<Repeat> others = {
      {"WriteLayer with a remote block id out of range",
       [&] { return p_.engine->WriteLayer("rep", "attn.0", "D", ids, out_of_range); }},
      {"WriteLayers with a remote block id out of range",
       [&] { return p_.engine->WriteLayers("rep", names, "D", ids, out_of_range); }},
      {"WriteLayer of other blocks", [&] { return p_.engine->WriteLayer("rep", "attn.0", "D", into, ids); }},
  };
  for (const Repeat& r : others) {
    SCOPED_TRACE(r.what);
    Result<bool> other = r.call();
    ASSERT_FALSE(other.ok());
    EXPECT_EQ(other.status().code(), StatusCode::kInvalidArgument);
    EXPECT_NE(other.status().message().find("scheduled before with other blocks"),
              std::string::npos)
        << other.status().ToString();
  }
  ASSERT_TRUE(p_.engine->Seal("rep", "D", 1).ok());
  Events events(p_.engine.get());
  const TransferEvent ev = events.Wait("rep");
  EXPECT_EQ(ev.state, TransferState::kDone) << ev.message;
}

// The ids' digest runs in four lanes: lists that differ in one id past the first lane, or in
// their split between local and remote, are other writes; whole blocks and one whole-block
// segment of them are the same write.
TEST_F(EnginePair, AWriteIsTheSameOnlyWhenEveryIdIs) {
  Build({{"loopback_delay_ms", "300"}}, {});  // the first write is still in flight
  const std::vector<std::int64_t> local = {0, 1, 2, 3, 4}, remote = {4, 3, 2, 1, 0};
  Result<bool> first = p_.engine->WriteLayer("ids", "attn.0", "D", local, remote);
  ASSERT_TRUE(first.ok() && *first) << first.status().ToString();
  const std::vector<BlockSegment> one_segment = {{{}, local, remote, {}, {}}};
  Result<bool> same = p_.engine->WriteLayer("ids", "attn.0", "D", one_segment);
  ASSERT_TRUE(same.ok()) << same.status().ToString();
  EXPECT_FALSE(*same) << "one whole-block segment of the same ids is a repeat";
  const std::vector<std::int64_t> last_differs = {4, 3, 2, 1, 5};
  const std::vector<std::int64_t> local_part = {0, 1, 2, 3}, remote_more = {4, 4, 3, 2, 1, 0};
  const std::vector<std::pair<const char*, std::function<Result<bool>()>>> others = {
      {"the fifth remote id differs",
       [&] { return p_.engine->WriteLayer("ids", "attn.0", "D", local, last_differs); }},
      {"the same ids split otherwise between local and remote",
       [&] { return p_.engine->WriteLayer("ids", "attn.0", "D", local_part, remote_more); }},
  };
  for (const auto& [what, call] : others) {
    SCOPED_TRACE(what);
    Result<bool> other = call();
    ASSERT_FALSE(other.ok());
    EXPECT_NE(other.status().message().find("scheduled before with other blocks"),
              std::string::npos)
        << other.status().ToString();
  }
  ASSERT_TRUE(p_.engine->Seal("ids", "D", 1).ok());
  Events events(p_.engine.get());
  const TransferEvent ev = events.Wait("ids");
  EXPECT_EQ(ev.state, TransferState::kDone) << ev.message;
}

TEST_F(EnginePair, BadBlockIdsFailTheCallAndCreateNoTransfer) {
  const auto p_before = p_.buffer->Snapshot();
  const auto d_before = d_.buffer->Snapshot();
  struct Case {
    const char* what;
    std::vector<std::int64_t> local, remote;
    StatusCode code;
    std::string says;  // in the READ's message (the WRITE swaps the lists)
  };
  // D reads from P: local ids are D's (9 blocks), remote ids are P's (6 blocks).
  const std::vector<Case> cases = {
      {"local id == local num_blocks", {1, 9}, {0, 1}, StatusCode::kOutOfRange, "9"},
      {"local id far out of range", {1 << 30}, {0}, StatusCode::kOutOfRange, "1073741824"},
      {"remote id == remote num_blocks", {0, 1}, {2, 6}, StatusCode::kOutOfRange, "6"},
      {"remote id valid locally but not remotely", {0}, {8}, StatusCode::kOutOfRange, "8"},
      {"negative local id", {-1}, {0}, StatusCode::kOutOfRange, "local -1"},
      {"negative remote id", {0}, {-3}, StatusCode::kOutOfRange, "remote -3"},
      {"negative id after a repeat, unsorted", {4, 4, 2, -2}, {0, 1, 2, 3},
       StatusCode::kOutOfRange, "position 3: local -2, remote 3"},
      {"local longer than remote", {0, 1, 2}, {0, 1}, StatusCode::kInvalidArgument, "3 > 2"},
      {"duplicate local id", {3, 3}, {0, 1}, StatusCode::kInvalidArgument,
       "duplicate local block id 3"},
      {"duplicate local id, unsorted", {5, 2, 7, 2, 5}, {0, 1, 2, 3, 4},
       StatusCode::kInvalidArgument, "duplicate local block id 2"},
      {"duplicate remote id", {3, 4}, {1, 1}, StatusCode::kInvalidArgument,
       "duplicate remote block id 1"},
      {"duplicate remote id, unsorted local", {4, 0, 3}, {5, 2, 5}, StatusCode::kInvalidArgument,
       "duplicate remote block id 5"},
  };
  for (const Case& c : cases) {
    SCOPED_TRACE(c.what);
    Status st = d_.engine->Read("bad", "P", c.local, c.remote);
    EXPECT_EQ(st.code(), c.code) << st.ToString();
    EXPECT_NE(st.message().find("transfer 'bad'"), std::string::npos)
        << "names the transfer: " << st.ToString();
    EXPECT_NE(st.message().find(c.says), std::string::npos) << st.ToString();
    EXPECT_EQ(d_.engine->PendingTransfers(), 0u);
    EXPECT_TRUE(d_.engine->PollEvents(16, 0ms).empty()) << "a refused READ created a transfer";
    // P writes to D: local ids are P's (6 blocks), remote ids are D's (9), so the case's lists
    // swap roles; except for the length case, whose point is the order of the lists.
    const bool length_case = c.local.size() > c.remote.size();
    Result<bool> w = length_case ? p_.engine->WriteLayer("bad-w", "attn.1", "D", c.local, c.remote)
                                 : p_.engine->WriteLayer("bad-w", "attn.1", "D", c.remote, c.local);
    EXPECT_FALSE(w.ok()) << "WriteLayer accepted: " << c.what;
    EXPECT_NE(w.status().message().find("bad-w"), std::string::npos) << w.status().ToString();
    EXPECT_EQ(p_.engine->PendingTransfers(), 0u);  // failed at once: nothing was in flight
    EXPECT_EQ(p_.buffer->Snapshot(), p_before);
    EXPECT_EQ(d_.buffer->Snapshot(), d_before);
  }
  // The read id was not recorded: it starts normally now.
  const std::vector<std::int64_t> ok_ids = {0};
  const std::vector<std::int64_t> other_d_block = {1};  // not the block the read fills
  ASSERT_TRUE(d_.engine->Read("bad", "P", ok_ids, ok_ids).ok());
  Events d_events(d_.engine.get());
  EXPECT_EQ(d_events.Wait("bad").state, TransferState::kDone);
  // The refused layers failed the WRITE (issue 12 defect 2): later layers and the seal cannot
  // make it done, and nothing of it reaches D.
  const auto d_after_read = d_.buffer->Snapshot();
  Result<bool> w = p_.engine->WriteLayer("bad-w", "attn.0", "D", ok_ids, other_d_block);
  ASSERT_TRUE(w.ok()) << w.status().ToString();
  EXPECT_FALSE(*w) << "a layer of a failed WRITE was scheduled";
  EXPECT_TRUE(p_.engine->Seal("bad-w", "D", 2).ok());
  Events p_events(p_.engine.get());
  TransferEvent e = p_events.Wait("bad-w");
  EXPECT_EQ(e.state, TransferState::kFailed);
  EXPECT_NE(e.message.find("refused"), std::string::npos) << e.message;
  p_events.Poll(20ms);
  EXPECT_EQ(p_events.Count("bad-w"), 1u);
  EXPECT_EQ(d_.buffer->Snapshot(), d_after_read);
}

// Issue 12 defect 2: write calls on a READ id are errors naming it and leave the READ alone.
TEST_F(EnginePair, WriteLayerAndSealOnAReadIdAreInvalidArgument) {
  Build({}, {{"loopback_delay_ms", "50"}});  // the READ is still pending during the calls
  const std::vector<std::int64_t> ids = {1};
  ASSERT_TRUE(d_.engine->Read("rd", "P", ids, ids).ok());
  Result<bool> w = d_.engine->WriteLayer("rd", "attn.0", "P", ids, ids);
  EXPECT_EQ(w.status().code(), StatusCode::kInvalidArgument) << w.status().ToString();
  EXPECT_NE(w.status().message().find("'rd'"), std::string::npos) << w.status().ToString();
  w = d_.engine->WriteLayer("rd", "attn.0", "P", ids, std::vector<std::int64_t>{999});
  EXPECT_EQ(w.status().code(), StatusCode::kInvalidArgument) << "a bad write must not fail a READ";
  Status st = d_.engine->Seal("rd", "P", 0).status();
  EXPECT_EQ(st.code(), StatusCode::kInvalidArgument) << st.ToString();
  Events events(d_.engine.get());
  EXPECT_EQ(events.Wait("rd").state, TransferState::kDone);
  EXPECT_EQ(d_.engine->Seal("rd", "P", 0).status().code(), StatusCode::kInvalidArgument);  // ended READ
  events.Poll(20ms);
  EXPECT_EQ(events.Count("rd"), 1u);
}

// Issue 12 defect 2: a seal that overtakes its writes waits for the number it names.
TEST_F(EnginePair, SealBeforeItsWritesIsDoneOnlyAfterThem) {
  std::vector<std::uint8_t> expected = d_.buffer->Snapshot();
  std::vector<bool> touched(expected.size(), false);
  const std::vector<std::string> layers = {"attn.0", "mla.0"};
  const std::vector<std::int64_t> local = {2}, remote = {3};
  ApplyReference(d_, p_, layers, remote, local, &expected, &touched);
  ASSERT_TRUE(p_.engine->Seal("early", "D", 2).ok());
  Events events(p_.engine.get());
  ASSERT_TRUE(p_.engine->WriteLayer("early", layers[0], "D", local, remote).ok());
  events.Poll(50ms);
  EXPECT_EQ(events.Count("early"), 0u) << "done with one of two sealed writes";
  ASSERT_TRUE(p_.engine->WriteLayer("early", layers[1], "D", local, remote).ok());
  TransferEvent e = events.Wait("early");
  EXPECT_EQ(e.state, TransferState::kDone) << e.message;
  EXPECT_EQ(e.batches, 2);
  ExpectBytes(d_.buffer->Snapshot(), expected, touched);
}

TEST_F(EnginePair, ReadNamingALayerTwiceIsRejected) {
  // A request that lists a layer twice is malformed (it would move and count the layer twice);
  // like every bad input it must fail with an error naming the layer and create nothing.
  const auto p_before = p_.buffer->Snapshot();
  const auto d_before = d_.buffer->Snapshot();
  const std::vector<std::int64_t> ids = {1};
  const std::vector<std::string> layers = {"attn.0", "mla.0", "attn.0"};
  Status st = d_.engine->Read("twice", "P", ids, ids, layers);
  EXPECT_EQ(st.code(), StatusCode::kInvalidArgument) << st.ToString();
  EXPECT_NE(st.message().find("attn.0"), std::string::npos) << st.ToString();
  if (st.ok()) Events(d_.engine.get()).Wait("twice");  // drain it before the checks below
  ExpectNothingHappened(p_before, st.ok() ? d_.buffer->Snapshot() : d_before);
}

TEST_F(EnginePair, EmptyTransferIdIsRejected) {
  const std::vector<std::int64_t> ids = {0};
  EXPECT_EQ(d_.engine->Read("", "P", ids, ids).code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(p_.engine->WriteLayer("", "attn.0", "D", ids, ids).status().code(),
            StatusCode::kInvalidArgument);
  EXPECT_EQ(p_.engine->Seal("", "D", 0).status().code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(p_.engine->Seal("no-peer", "", 0).status().code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(p_.engine->PendingTransfers(), 0u);
  EXPECT_EQ(d_.engine->PendingTransfers(), 0u);
}

TEST_F(EnginePair, SealNamingAnUnknownPeerStartsNothing) {
  // Before: the seal made a WRITE to a peer that does not exist; with 0 writes it was reported
  // done at once, with more it waited for its deadline.
  for (std::int64_t writes : {0, 2}) {
    const std::string id = "ghost-" + std::to_string(writes);
    Status st = p_.engine->Seal(id, "nobody", writes).status();
    EXPECT_EQ(st.code(), StatusCode::kNotFound) << st.ToString();
    EXPECT_NE(st.message().find("unknown peer 'nobody'"), std::string::npos) << st.ToString();
    EXPECT_NE(st.message().find(id), std::string::npos) << st.ToString();
  }
  EXPECT_EQ(p_.engine->PendingTransfers(), 0u);
  EXPECT_TRUE(p_.engine->PollEvents(16, std::chrono::milliseconds(50)).empty());
  // A known peer's "nothing to send" still ends at once, done.
  ASSERT_TRUE(p_.engine->Seal("nothing", "D", 0).ok());
  const auto events = p_.engine->PollEvents(16, std::chrono::milliseconds(500));
  ASSERT_EQ(events.size(), 1u);
  EXPECT_EQ(events[0].transfer_id, "nothing");
  EXPECT_EQ(events[0].state, TransferState::kDone);
}

// Each (transfer, layer) counts once, so a seal for more writes than there are layers could
// never be met: before, it was accepted and the WRITE could only end timed out (a review found
// it), its peer waiting out the whole timeout. Now it is refused and starts nothing.
TEST_F(EnginePair, SealForMoreWritesThanLayersIsRefusedAndStartsNothing) {
  Status st = p_.engine->Seal("too-many", "D", 1000).status();
  EXPECT_EQ(st.code(), StatusCode::kInvalidArgument) << st.ToString();
  EXPECT_NE(st.message().find("too-many"), std::string::npos) << st.ToString();
  EXPECT_NE(st.message().find("layers are registered"), std::string::npos) << st.ToString();
  EXPECT_EQ(p_.engine->PendingTransfers(), 0u);
  EXPECT_TRUE(p_.engine->PollEvents(16, std::chrono::milliseconds(50)).empty());
}

TEST_F(EnginePair, DuplicateReadIdIsAlreadyExistsWhilePendingAndAfterEnd) {
  Build({}, {{"loopback_delay_ms", "200"}});  // D's reads stay pending for a while
  const auto d_before = d_.buffer->Snapshot();
  const std::vector<std::int64_t> ids = {1};
  ASSERT_TRUE(d_.engine->Read("dup", "P", ids, ids).ok());
  Status st = d_.engine->Read("dup", "P", ids, ids);
  EXPECT_EQ(st.code(), StatusCode::kAlreadyExists) << st.ToString();
  EXPECT_NE(st.message().find("dup"), std::string::npos);
  Events events(d_.engine.get());
  EXPECT_EQ(events.Wait("dup").state, TransferState::kDone);
  st = d_.engine->Read("dup", "P", ids, ids);
  EXPECT_EQ(st.code(), StatusCode::kAlreadyExists) << st.ToString();
  events.Poll(20ms);
  EXPECT_EQ(events.Count("dup"), 1u);
  EXPECT_EQ(d_.engine->PendingTransfers(), 0u);
}

TEST_F(EnginePair, AbortWithBatchesInFlightEndsAbortedOnce) {
  // The batch sleeps 500 ms in the transport, so the abort below lands while it is in flight.
  Build({}, {{"loopback_delay_ms", "500"}});
  const std::vector<std::int64_t> ids = {1, 2};
  ASSERT_TRUE(d_.engine->Read("ab", "P", ids, ids).ok());
  ASSERT_TRUE(d_.engine->Abort("ab").ok());
  Events events(d_.engine.get());
  TransferEvent e = events.Wait("ab");
  EXPECT_EQ(e.state, TransferState::kAborted);
  EXPECT_EQ(d_.engine->PendingTransfers(), 0u);
  EXPECT_TRUE(d_.engine->Abort("ab").ok()) << "abort after the end is a no-op";
  EXPECT_EQ(d_.engine->Abort("never").code(), StatusCode::kNotFound);
  events.Poll(20ms);
  EXPECT_EQ(events.Count("ab"), 1u);
}

TEST_F(EnginePair, DeadlineTimesOutATransferWhoseBatchesAreStillInFlight) {
  // D's transport sleeps far longer than the transfer timeout.
  Build({}, {{"loopback_delay_ms", "1000"}}, /*timeout=*/20ms);
  const std::vector<std::int64_t> ids = {1};
  ASSERT_TRUE(d_.engine->Read("slow", "P", ids, ids).ok());
  Events events(d_.engine.get());
  TransferEvent e = events.Wait("slow");
  EXPECT_EQ(e.state, TransferState::kTimedOut) << e.message;
  EXPECT_FALSE(e.message.empty());
  EXPECT_EQ(d_.engine->PendingTransfers(), 0u);
  // The batch completes later: ignored; the id stays terminal.
  events.Poll(1500ms);
  EXPECT_EQ(events.Count("slow"), 1u);
  EXPECT_EQ(d_.engine->Read("slow", "P", ids, ids).code(), StatusCode::kAlreadyExists);
}

TEST_F(EnginePair, TerminalHistoryIsBoundedByConfig) {
  d_ = Side{};
  Place(d_, DecodeLayers(), 2);
  d_.engine = MakeEngine("D", {}, 60s, /*history=*/4);
  ASSERT_NE(d_.engine, nullptr);
  ASSERT_TRUE(d_.engine->RegisterKvCaches(d_.Registrations()).ok());
  ASSERT_TRUE(d_.engine->AddPeer(p_.metadata).ok());
  Events events(d_.engine.get());
  const std::vector<std::int64_t> ids = {0};
  for (int i = 0; i < 6; ++i) {
    const std::string id = "h" + std::to_string(i);
    ASSERT_TRUE(d_.engine->Read(id, "P", ids, ids).ok());
    EXPECT_EQ(events.Wait(id).state, TransferState::kDone);
  }
  EXPECT_TRUE(d_.engine->Read("h0", "P", ids, ids).ok()) << "oldest id should be forgotten";
  EXPECT_EQ(d_.engine->Read("h5", "P", ids, ids).code(), StatusCode::kAlreadyExists);
}

// ---- configuration --------------------------------------------------------------------------

// A page size that is not a power of two cannot align anything, and one below an OS page would
// call unaligned regions aligned: both are refused when the engine is made, not at registration.
TEST(EngineConfigCheck, PageSizeIsAPowerOfTwoOfAtLeastOnePage) {
  for (std::uint64_t page : {std::uint64_t{0}, std::uint64_t{1}, std::uint64_t{3}, std::uint64_t{2048},
                             std::uint64_t{4097}, std::uint64_t{12288}, std::uint64_t{1} << 31}) {
    SCOPED_TRACE("page_size " + std::to_string(page));
    EngineConfig config;
    config.engine_id = "P";
    config.page_size = page;
    Result<std::unique_ptr<Engine>> engine = Engine::Create(std::move(config));
    ASSERT_FALSE(engine.ok());
    EXPECT_EQ(engine.status().code(), StatusCode::kInvalidArgument);
    EXPECT_NE(engine.status().message().find("page_size"), std::string::npos)
        << engine.status().message();
    EXPECT_NE(engine.status().message().find(std::to_string(page)), std::string::npos)
        << engine.status().message();
  }
  for (std::uint64_t page : {std::uint64_t{4096}, std::uint64_t{65536}, std::uint64_t{1} << 21,
                             std::uint64_t{1} << 30}) {
    SCOPED_TRACE("page_size " + std::to_string(page));
    EngineConfig config;
    config.engine_id = "P";
    config.page_size = page;
    EXPECT_TRUE(Engine::Create(std::move(config)).ok());
  }
}

// An engine id every peer's metadata decoder refuses (not UTF-8, empty, too long, a control
// character) is refused when the engine is made, naming the byte, not at each peer's AddPeer
// after registration.
TEST(EngineConfigCheck, AnEngineIdNoPeerCouldReadIsRefused) {
  for (const std::string& id :
       {std::string(), std::string("prefill-\xc3"), std::string(1025, 'p'),
        std::string("prefill\n[INFO] forged")}) {
    SCOPED_TRACE("engine_id of " + std::to_string(id.size()) + " bytes");
    EngineConfig config;
    config.engine_id = id;
    Result<std::unique_ptr<Engine>> engine = Engine::Create(std::move(config));
    ASSERT_FALSE(engine.ok());
    EXPECT_EQ(engine.status().code(), StatusCode::kInvalidArgument);
    EXPECT_NE(engine.status().message().find("engine_id"), std::string::npos)
        << engine.status().message();
  }
}

// ---- registration ---------------------------------------------------------------------------

TEST(EngineRegistration, RegisterTwiceIsFailedPreconditionAndKeepsTheFirstMetadata) {
  Side side;
  ASSERT_NO_FATAL_FAILURE(SetUpSide(side, "P", PrefillLayers(), 1));
  Result<std::vector<std::uint8_t>> again = side.engine->RegisterKvCaches(side.Registrations());
  EXPECT_EQ(again.status().code(), StatusCode::kFailedPrecondition) << again.status().ToString();
  Result<std::vector<std::uint8_t>> meta = side.engine->LocalMetadata();
  ASSERT_TRUE(meta.ok());
  EXPECT_EQ(*meta, side.metadata);
}

TEST(EngineRegistration, NothingWorksBeforeRegistration) {
  std::unique_ptr<Engine> engine = MakeEngine("fresh");
  ASSERT_NE(engine, nullptr);
  EXPECT_EQ(engine->LocalMetadata().status().code(), StatusCode::kFailedPrecondition);
  Side other;
  ASSERT_NO_FATAL_FAILURE(SetUpSide(other, "other", PrefillLayers(), 3));
  EXPECT_EQ(engine->AddPeer(other.metadata).status().code(), StatusCode::kFailedPrecondition);
  const std::vector<std::int64_t> ids = {0};
  EXPECT_EQ(engine->Read("r", "other", ids, ids).code(), StatusCode::kFailedPrecondition);
  EXPECT_EQ(engine->WriteLayer("w", "attn.0", "other", ids, ids).status().code(),
            StatusCode::kFailedPrecondition);
  EXPECT_TRUE(engine->Peers().empty());
  EXPECT_EQ(engine->PendingTransfers(), 0u);
}

TEST(EngineRegistration, InvalidLayersRegisterNothing) {
  Side side;
  Place(side, PrefillLayers(), 1);
  side.engine = MakeEngine("P");
  ASSERT_NE(side.engine, nullptr);
  const std::vector<LayerRegistration> good = side.Registrations();

  struct Case {
    const char* what;
    std::vector<LayerRegistration> regs;
  };
  std::vector<Case> cases;
  {
    auto regs = good;  // last layer's view runs 1 byte past the allocation
    regs.back().allocation.size = regs.back().geometry.data_ptr - side.buffer->address() +
                                  static_cast<std::uint64_t>(side.layers.back().SpanBytes()) - 1;
    for (auto& r : regs) r.allocation.size = regs.back().allocation.size;
    cases.push_back({"layer ends after its allocation", regs});
  }
  {
    auto regs = good;  // allocation starts after the view
    regs[1].allocation.address = regs[1].geometry.data_ptr + 8;
    regs[1].allocation.size = side.buffer->size();
    cases.push_back({"layer starts before its allocation", regs});
  }
  {
    auto regs = good;
    regs[2].name = regs[0].name;
    cases.push_back({"layer listed twice", regs});
  }
  {
    auto regs = good;
    regs[3].spec.head_size = 7;  // shape says 8
    cases.push_back({"spec disagrees with the shape", regs});
  }
  {
    auto regs = good;
    regs[0].geometry.data_ptr = 0;
    regs[0].allocation.address = 0;
    cases.push_back({"null data pointer", regs});
  }
  // Names every peer's metadata decoder refuses: registered, they would fail only at each
  // peer's AddPeer (a review, 2026-12-07).
  for (const std::string& name : {std::string(), std::string("layer\xff"), std::string(1025, 'x')}) {
    auto regs = good;
    regs[1].name = name;
    cases.push_back({"a layer name no peer could read", regs});
  }
  for (const Case& c : cases) {
    SCOPED_TRACE(c.what);
    Result<std::vector<std::uint8_t>> r = side.engine->RegisterKvCaches(c.regs);
    EXPECT_EQ(r.status().code(), StatusCode::kInvalidArgument) << r.status().ToString();
    EXPECT_EQ(side.engine->LocalMetadata().status().code(), StatusCode::kFailedPrecondition)
        << "a failed registration left metadata behind";
  }
  // The layer named in the error: an outside layer names itself.
  Result<std::vector<std::uint8_t>> r = side.engine->RegisterKvCaches(cases[0].regs);
  EXPECT_NE(r.status().message().find(good.back().name), std::string::npos)
      << r.status().ToString();
  // Nothing was registered by the failures: the good registration still works.
  Result<std::vector<std::uint8_t>> ok = side.engine->RegisterKvCaches(good);
  ASSERT_TRUE(ok.ok()) << ok.status().ToString();
}

// A backend that refuses one allocation's memory is reported with the layers placed there,
// not the engine's internal region index, which the API never shows (a review, 2026-12-07:
// "registering memory region 1").
TEST(EngineRegistration, ABackendRefusalNamesTheLayersOfTheRefusedMemory) {
  Side side;
  Place(side, PrefillLayers(), 1);
  side.engine = MakeEngine("P");
  ASSERT_NE(side.engine, nullptr);
  std::vector<LayerRegistration> regs = side.Registrations();
  LayerRegistration& last = regs.back();
  last.allocation = {last.geometry.data_ptr,
                     static_cast<std::uint64_t>(side.layers.back().SpanBytes()),
                     MemoryKind::kCuda, 0};  // the loopback backend registers host memory only
  Result<std::vector<std::uint8_t>> r = side.engine->RegisterKvCaches(regs);
  ASSERT_FALSE(r.ok());
  EXPECT_NE(r.status().message().find("layer '" + last.name + "'"), std::string::npos)
      << r.status().ToString();
  EXPECT_EQ(side.engine->LocalMetadata().status().code(), StatusCode::kFailedPrecondition);
}

// ---- peers ----------------------------------------------------------------------------------

// A decode side whose layer `changed` differs logically from the prefill model.
std::vector<TestLayer> DecodeLayersWith(const std::string& changed, std::int64_t heads,
                                        std::int64_t block_size, std::int64_t elem) {
  std::vector<TestLayer> layers = DecodeLayers();
  for (TestLayer& l : layers) {
    if (l.name == changed) {
      l = MakeLayer(changed, Physical::kSeparatedHB, 9, heads, block_size, l.head_size, elem);
    }
  }
  return layers;
}

TEST(EnginePeers, IncompatibleLayerIsRejectedNamingIt) {
  // attn.1 on P: 2 heads, block 8, 4-byte elements. Another dtype (or head size) gives cells
  // that cannot pair: refused at AddPeer, both ways.
  Side p;
  ASSERT_NO_FATAL_FAILURE(SetUpSide(p, "P", PrefillLayers(), 1));
  Side bad;
  ASSERT_NO_FATAL_FAILURE(SetUpSide(bad, "D-bad", DecodeLayersWith("attn.1", 2, 8, 2), 2));
  Result<std::string> r = p.engine->AddPeer(bad.metadata);
  EXPECT_EQ(r.status().code(), StatusCode::kIncompatible) << r.status().ToString();
  EXPECT_NE(r.status().message().find("attn.1"), std::string::npos) << r.status().ToString();
  EXPECT_TRUE(p.engine->Peers().empty());
  Result<std::string> back = bad.engine->AddPeer(p.metadata);
  EXPECT_EQ(back.status().code(), StatusCode::kIncompatible) << back.status().ToString();
  EXPECT_TRUE(bad.engine->Peers().empty());
}

// Other heads or another block size pair through windows only (heterogeneous TP, other block
// sizes): the peer is added, and a whole-block transfer of that layer is Incompatible naming
// it, creating nothing; the other layers move as before.
TEST(EnginePeers, OtherHeadsOrBlockSizeAddThePeerButRefuseWholeBlocks) {
  struct Case {
    const char* what;
    std::int64_t heads, block_size;
  };
  for (const Case& c : {Case{"different heads", 4, 8}, Case{"different block size", 2, 16}}) {
    SCOPED_TRACE(c.what);
    Side p, d;
    EnginesFirst guard({&p, &d});
    ASSERT_NO_FATAL_FAILURE(SetUpSide(p, "P", PrefillLayers(), 1));
    ASSERT_NO_FATAL_FAILURE(
        SetUpSide(d, "D", DecodeLayersWith("attn.1", c.heads, c.block_size, 4), 2));
    ASSERT_TRUE(p.engine->AddPeer(d.metadata).ok());
    ASSERT_TRUE(d.engine->AddPeer(p.metadata).ok());
    const auto d_before = d.buffer->Snapshot();
    const std::vector<std::int64_t> ids = {1};
    Status st = d.engine->Read("whole", "P", ids, ids);
    EXPECT_EQ(st.code(), StatusCode::kIncompatible) << st.ToString();
    EXPECT_NE(st.message().find("attn.1"), std::string::npos) << st.ToString();
    EXPECT_NE(st.message().find("hold different content"), std::string::npos) << st.ToString();
    Result<bool> w = p.engine->WriteLayer("whole-w", "attn.1", "D", ids, ids);
    EXPECT_EQ(w.status().code(), StatusCode::kIncompatible) << w.status().ToString();
    EXPECT_EQ(d.engine->PendingTransfers(), 0u);
    EXPECT_TRUE(d.engine->PollEvents(16, 0ms).empty());
    EXPECT_EQ(d.buffer->Snapshot(), d_before);
    const std::vector<std::string> others = {"attn.0", "mla.0", "attn.2"};
    std::vector<std::uint8_t> expected = d.buffer->Snapshot();
    std::vector<bool> touched(expected.size(), false);
    ApplyReference(d, p, others, ids, ids, &expected, &touched);
    ASSERT_TRUE(d.engine->Read("others", "P", ids, ids, others).ok());
    Events events(d.engine.get());
    EXPECT_EQ(events.Wait("others").state, TransferState::kDone);
    ExpectBytes(d.buffer->Snapshot(), expected, touched);
  }
}

TEST(EnginePeers, PeerMissingOneOfOurLayersIsIncompatible) {
  Side p;
  ASSERT_NO_FATAL_FAILURE(SetUpSide(p, "P", PrefillLayers(), 1));
  std::vector<TestLayer> layers = DecodeLayers();
  layers.erase(layers.begin() + 2);  // no mla.0
  Side partial;
  ASSERT_NO_FATAL_FAILURE(SetUpSide(partial, "D-partial", layers, 2));
  Result<std::string> r = p.engine->AddPeer(partial.metadata);
  EXPECT_EQ(r.status().code(), StatusCode::kIncompatible) << r.status().ToString();
  EXPECT_NE(r.status().message().find("mla.0"), std::string::npos) << r.status().ToString();
  EXPECT_TRUE(p.engine->Peers().empty());
  // A peer with MORE layers than ours is fine: the partial side can talk to P.
  Result<std::string> ok = partial.engine->AddPeer(p.metadata);
  EXPECT_TRUE(ok.ok()) << ok.status().ToString();
}

TEST(EnginePeers, PeerOnAnotherBackendIsRejected) {
  Side p, d;
  EnginesFirst guard({&p, &d});
  ASSERT_NO_FATAL_FAILURE(SetUpSide(p, "P", PrefillLayers(), 1));
  ASSERT_NO_FATAL_FAILURE(SetUpSide(d, "D", DecodeLayers(), 2));
  const std::vector<std::uint8_t> ucx = WithTopLevelString(d.metadata, "backend", "ucx");
  Result<std::string> r = p.engine->AddPeer(ucx);
  EXPECT_EQ(r.status().code(), StatusCode::kIncompatible) << r.status().ToString();
  EXPECT_NE(r.status().message().find("ucx"), std::string::npos) << r.status().ToString();
  EXPECT_TRUE(p.engine->Peers().empty());
}

TEST(EnginePeers, MetadataWithOurOwnEngineIdIsRejected) {
  Side p, d;
  EnginesFirst guard({&p, &d});
  ASSERT_NO_FATAL_FAILURE(SetUpSide(p, "P", PrefillLayers(), 1));
  ASSERT_NO_FATAL_FAILURE(SetUpSide(d, "D", DecodeLayers(), 2));
  Result<std::string> self = p.engine->AddPeer(p.metadata);
  EXPECT_EQ(self.status().code(), StatusCode::kInvalidArgument) << self.status().ToString();
  // Another engine's metadata claiming our id.
  Result<std::string> spoof = p.engine->AddPeer(WithTopLevelString(d.metadata, "engine_id", "P"));
  EXPECT_FALSE(spoof.ok());
  EXPECT_TRUE(p.engine->Peers().empty());
}

TEST(EnginePeers, AddingTheSamePeerAgainIsANoOpButDifferentMetadataIsNot) {
  Side p, d, d2;
  EnginesFirst guard({&p, &d, &d2});
  ASSERT_NO_FATAL_FAILURE(SetUpSide(p, "P", PrefillLayers(), 1));
  ASSERT_NO_FATAL_FAILURE(SetUpSide(d, "D", DecodeLayers(), 2));
  ASSERT_NO_FATAL_FAILURE(SetUpSide(d2, "D", DecodeLayers(), 3));  // same id, other memory
  ASSERT_TRUE(p.engine->AddPeer(d.metadata).ok());
  Result<std::string> again = p.engine->AddPeer(d.metadata);
  ASSERT_TRUE(again.ok()) << again.status().ToString();
  EXPECT_EQ(*again, "D");
  EXPECT_EQ(p.engine->Peers(), std::vector<std::string>{"D"});
  Result<std::string> other = p.engine->AddPeer(d2.metadata);
  EXPECT_EQ(other.status().code(), StatusCode::kAlreadyExists) << other.status().ToString();
  EXPECT_EQ(p.engine->Peers(), std::vector<std::string>{"D"});
}

TEST(EnginePeers, ReplacePeerSwapsARestartedPeerAndEndsTheOldTransfersOnce) {
  Side p, d, d2;
  EnginesFirst guard({&p, &d, &d2});
  ASSERT_NO_FATAL_FAILURE(SetUpSide(p, "P", PrefillLayers(), 1, {{"loopback_delay_ms", "100"}}));
  ASSERT_NO_FATAL_FAILURE(SetUpSide(d, "D", DecodeLayers(), 2));
  ASSERT_NO_FATAL_FAILURE(SetUpSide(d2, "D", DecodeLayers(), 3));  // D restarted: other memory
  ASSERT_TRUE(p.engine->AddPeer(d.metadata).ok());
  const std::vector<std::int64_t> ids = {0, 1};
  ASSERT_TRUE(p.engine->WriteLayer("old", "attn.0", "D", ids, ids).ok());  // in flight
  Result<std::string> same = p.engine->ReplacePeer(d.metadata);  // identical: a no-op
  ASSERT_TRUE(same.ok()) << same.status().ToString();
  EXPECT_EQ(p.engine->PendingTransfers(), 1u) << "identical metadata must not end transfers";
  Result<std::string> replaced = p.engine->ReplacePeer(d2.metadata);
  ASSERT_TRUE(replaced.ok()) << replaced.status().ToString();
  EXPECT_EQ(*replaced, "D");
  EXPECT_EQ(p.engine->Peers(), std::vector<std::string>{"D"});
  Events events(p.engine.get());
  TransferEvent e = events.Wait("old");
  EXPECT_NE(e.state, TransferState::kDone) << "a transfer to the old instance cannot succeed";
  EXPECT_NE(e.state, TransferState::kPending);
  // The new instance is reachable under the same id and gets the bytes.
  ASSERT_TRUE(p.engine->Read("new", "D", ids, ids).ok());
  EXPECT_EQ(events.Wait("new").state, TransferState::kDone);
  events.Poll(150ms);
  EXPECT_EQ(events.Count("old"), 1u);
  EXPECT_EQ(p.engine->PendingTransfers(), 0u);
}

TEST(EnginePeers, ReplacementByMetadataOfAnotherEngineThanExpectedChangesNothing) {
  // A handshake answered as engine "X" whose metadata names the connected engine "D" (other
  // memory): without the expected id the replacement would end D's transfers and point "D" at
  // that memory.
  Side p, d, d2;
  EnginesFirst guard({&p, &d, &d2});
  ASSERT_NO_FATAL_FAILURE(SetUpSide(p, "P", PrefillLayers(), 1, {{"loopback_delay_ms", "100"}}));
  ASSERT_NO_FATAL_FAILURE(SetUpSide(d, "D", DecodeLayers(), 2));
  ASSERT_NO_FATAL_FAILURE(SetUpSide(d2, "D", DecodeLayers(), 3));
  ASSERT_TRUE(p.engine->AddPeer(d.metadata).ok());
  const std::vector<std::int64_t> ids = {0, 1};
  ASSERT_TRUE(p.engine->WriteLayer("w", "attn.0", "D", ids, ids).ok());  // in flight
  Result<std::string> replaced = p.engine->ReplacePeer(d2.metadata, "X");
  ASSERT_EQ(replaced.status().code(), StatusCode::kIncompatible) << replaced.status().ToString();
  EXPECT_NE(replaced.status().message().find("names engine 'D', not the expected 'X'"),
            std::string::npos)
      << replaced.status().ToString();
  EXPECT_EQ(p.engine->AddPeer(d2.metadata, "X").status().code(), StatusCode::kIncompatible);
  EXPECT_EQ(p.engine->PendingTransfers(), 1u) << "a refused replacement must end nothing";
  ASSERT_TRUE(p.engine->Seal("w", "D", 1).ok());
  Events events(p.engine.get());
  EXPECT_EQ(events.Wait("w").state, TransferState::kDone);
  Result<std::string> same = p.engine->ReplacePeer(d.metadata, "D");  // agreeing: as before
  ASSERT_TRUE(same.ok()) << same.status().ToString();
}

TEST(EnginePeers, TheSameMetadataAgainReconnectsAPeerWhoseConnectionFailed) {
  // The same metadata handed again (a handshake after a failed transfer) was taken for the
  // same handshake while the backend reported the connection broken: every later transfer to
  // the peer failed, and the caller was told it was connected. It reconnects now (here the
  // peer's loopback instance is gone, so the reconnection fails, naming why).
  Side p, d;
  EnginesFirst guard({&p, &d});
  ASSERT_NO_FATAL_FAILURE(SetUpSide(p, "P", PrefillLayers(), 1));
  ASSERT_NO_FATAL_FAILURE(SetUpSide(d, "D", DecodeLayers(), 2));
  ASSERT_TRUE(p.engine->AddPeer(d.metadata).ok());
  EXPECT_TRUE(p.engine->AddPeer(d.metadata).ok()) << "a healthy peer's metadata again: as before";
  d.engine.reset();  // its backend instance goes with it
  Result<std::string> again = p.engine->ReplacePeer(d.metadata, "D");
  ASSERT_EQ(again.status().code(), StatusCode::kTransport) << again.status().ToString();
  EXPECT_NE(again.status().message().find("is gone"), std::string::npos)
      << again.status().ToString();
  EXPECT_EQ(p.engine->Peers(), std::vector<std::string>{"D"}) << "a failed reconnection keeps it";
}

TEST(EnginePeers, FailedReplacementKeepsTheOldPeer) {
  Side p, d;
  EnginesFirst guard({&p, &d});
  ASSERT_NO_FATAL_FAILURE(SetUpSide(p, "P", PrefillLayers(), 1));
  ASSERT_NO_FATAL_FAILURE(SetUpSide(d, "D", DecodeLayers(), 2));
  ASSERT_TRUE(p.engine->AddPeer(d.metadata).ok());
  std::vector<std::uint8_t> garbage = d.metadata;
  garbage.resize(garbage.size() / 2);
  EXPECT_FALSE(p.engine->ReplacePeer(garbage).ok());
  EXPECT_EQ(p.engine->Peers(), std::vector<std::string>{"D"});
  const std::vector<std::int64_t> ids = {0};
  ASSERT_TRUE(p.engine->Read("r", "D", ids, ids).ok());
  Events events(p.engine.get());
  EXPECT_EQ(events.Wait("r").state, TransferState::kDone);
}

const std::vector<std::int64_t> kWriteIds = {0, 1};  // SetUpAWriteInFlight's blocks

// P (its transport 100 ms slow) connected to D, with WRITE "w" of attn.0 blocks {0, 1} in
// flight and unsealed.
void SetUpAWriteInFlight(Side& p, Side& d) {
  ASSERT_NO_FATAL_FAILURE(SetUpSide(p, "P", PrefillLayers(), 1, {{"loopback_delay_ms", "100"}}));
  ASSERT_NO_FATAL_FAILURE(SetUpSide(d, "D", DecodeLayers(), 2));
  ASSERT_TRUE(p.engine->AddPeer(d.metadata).ok());
  ASSERT_TRUE(p.engine->WriteLayer("w", "attn.0", "D", kWriteIds, kWriteIds).ok());
}

TEST(EnginePeers, RemovePeerFailsItsPendingTransfersOnce) {
  Side p, d;
  EnginesFirst guard({&p, &d});
  ASSERT_NO_FATAL_FAILURE(SetUpAWriteInFlight(p, d));
  const std::vector<std::int64_t>& ids = kWriteIds;
  ASSERT_TRUE(p.engine->RemovePeer("D").ok());
  EXPECT_TRUE(p.engine->Peers().empty());
  Events events(p.engine.get());
  TransferEvent e = events.Wait("w");
  EXPECT_NE(e.state, TransferState::kDone) << "a transfer to a removed peer cannot succeed";
  EXPECT_NE(e.state, TransferState::kPending);
  events.Poll(150ms);
  EXPECT_EQ(events.Count("w"), 1u);
  EXPECT_EQ(p.engine->PendingTransfers(), 0u);
  EXPECT_EQ(p.engine->Read("r", "D", ids, ids).code(), StatusCode::kNotFound);
  EXPECT_EQ(p.engine->RemovePeer("D").code(), StatusCode::kNotFound);
}

TEST(EnginePeers, RemoveIdlePeerKeepsAPeerWithATransferPending) {
  Side p, d;
  EnginesFirst guard({&p, &d});
  ASSERT_NO_FATAL_FAILURE(SetUpAWriteInFlight(p, d));
  const std::vector<std::int64_t>& ids = kWriteIds;
  const Result<bool> busy = p.engine->RemoveIdlePeer("D");
  ASSERT_TRUE(busy.ok()) << busy.status().ToString();
  EXPECT_FALSE(*busy) << "a peer with a transfer pending must stay";
  EXPECT_EQ(p.engine->Peers(), std::vector<std::string>{"D"});
  ASSERT_TRUE(p.engine->Seal("w", "D", 1).ok());
  Events events(p.engine.get());
  EXPECT_EQ(events.Wait("w").state, TransferState::kDone) << "a refused removal ends nothing";
  const Result<bool> idle = p.engine->RemoveIdlePeer("D");
  ASSERT_TRUE(idle.ok() && *idle) << idle.status().ToString();
  EXPECT_TRUE(p.engine->Peers().empty());
  EXPECT_EQ(p.engine->RemoveIdlePeer("D").status().code(), StatusCode::kNotFound);
  EXPECT_EQ(p.engine->Read("r", "D", ids, ids).code(), StatusCode::kNotFound);
}

TEST_F(EnginePair, RemoveIdlePeerKeepsAPeerWithAQuarantinedTransfer) {
  // D's transport sleeps far longer than the transfer timeout: the READ ends timed out with its
  // batch in flight, so its destination is quarantined until the batch completes.
  Build({}, {{"loopback_delay_ms", "1000"}}, /*timeout=*/20ms);
  const std::vector<std::int64_t> ids = {1};
  ASSERT_TRUE(d_.engine->Read("slow", "P", ids, ids).ok());
  Events events(d_.engine.get());
  ASSERT_EQ(events.Wait("slow").state, TransferState::kTimedOut);
  ASSERT_EQ(d_.engine->QuarantinedTransfers(), 1u);
  const Result<bool> busy = d_.engine->RemoveIdlePeer("P");
  ASSERT_TRUE(busy.ok()) << busy.status().ToString();
  EXPECT_FALSE(*busy) << "a quarantined transfer's peer must stay";
  EXPECT_EQ(d_.engine->Peers(), std::vector<std::string>{"P"});
  const auto give_up = std::chrono::steady_clock::now() + 60s;
  while (d_.engine->PollDrained(16).empty() && std::chrono::steady_clock::now() < give_up) {
    std::this_thread::sleep_for(10ms);
  }
  const Result<bool> idle = d_.engine->RemoveIdlePeer("P");
  EXPECT_TRUE(idle.ok() && *idle) << idle.status().ToString();
  EXPECT_TRUE(d_.engine->Peers().empty());
}

TEST(EngineWrite, OneFailedLayerFailsTheWholeTransferOnce) {
  Side p, d;
  EnginesFirst guard({&p, &d});
  ASSERT_NO_FATAL_FAILURE(SetUpSide(p, "P", PrefillLayers(), 1));
  ASSERT_NO_FATAL_FAILURE(SetUpSide(d, "D", DecodeLayers(), 2));
  ASSERT_TRUE(p.engine->AddPeer(d.metadata).ok());
  const std::vector<std::int64_t> ids = {0, 1};
  ASSERT_TRUE(p.engine->WriteLayer("w", "attn.0", "D", ids, ids).ok());
  // The decode engine goes away (its memory is deregistered from the transport); the next
  // layer's write cannot land, so the transfer must fail, not report done.
  d.engine.reset();
  // Scheduled (true), or refused (false) when attn.0's batch already failed because it ran
  // after the peer left: a failed WRITE refuses further layers. Either way it must end failed.
  Result<bool> second = p.engine->WriteLayer("w", "attn.1", "D", ids, ids);
  ASSERT_TRUE(second.ok()) << second.status().ToString();
  ASSERT_TRUE(p.engine->Seal("w", "D", 2).ok());
  Events events(p.engine.get());
  TransferEvent e = events.Wait("w");
  EXPECT_EQ(e.state, TransferState::kFailed) << e.message;
  EXPECT_FALSE(e.message.empty());
  events.Poll(50ms);
  EXPECT_EQ(events.Count("w"), 1u);
  EXPECT_EQ(p.engine->PendingTransfers(), 0u);
}

// ---- shutdown -------------------------------------------------------------------------------

TEST(EngineShutdown, DestroyingEnginesWithTransfersInFlightNeitherHangsNorLeaks) {
  Side p, d;
  EnginesFirst guard({&p, &d});
  ASSERT_NO_FATAL_FAILURE(SetUpSide(p, "P", PrefillLayers(), 1, {{"loopback_delay_ms", "20"}}));
  ASSERT_NO_FATAL_FAILURE(SetUpSide(d, "D", DecodeLayers(), 2, {{"loopback_delay_ms", "20"}}));
  ASSERT_TRUE(p.engine->AddPeer(d.metadata).ok());
  ASSERT_TRUE(d.engine->AddPeer(p.metadata).ok());
  for (int i = 0; i < 5; ++i) {
    // Reads fill D block i, writes fill D block i + 4: no destination byte is shared.
    const std::vector<std::int64_t> ids = {i};
    const std::vector<std::int64_t> write_to = {i + 4};
    const std::string id = "t" + std::to_string(i);
    ASSERT_TRUE(d.engine->Read(id, "P", ids, ids).ok());
    for (const TestLayer& l : p.layers) {
      ASSERT_TRUE(p.engine->WriteLayer(id, l.name, "D", ids, write_to).ok());
    }
    if (i % 2 == 0) {
      ASSERT_TRUE(p.engine->Seal(id, "D", static_cast<std::int64_t>(p.layers.size())).ok());
    }
  }
  EXPECT_GT(p.engine->PendingTransfers() + d.engine->PendingTransfers(), 0u);
  // Destroy the initiators first, each with batches queued; ASan reports leaks at exit.
  p.engine.reset();
  d.engine.reset();
}

// The decode side goes away and frees its KV memory while the prefill side is copying into it:
// the transport must finish (or refuse) its copies before the memory is released, as a real
// transport finishes DMA before deregistration returns. Only a sanitizer build can see a late
// copy (ASan: heap-use-after-free); .ci/run runs this suite under ASan.
TEST(EngineShutdown, PeerMemoryFreedRightAfterItsEngineIsNeverWritten) {
  // 4 x 3000 tiny runs that never merge (remote ids reversed): the copies take long enough for
  // the memory to go between two of them.
  std::vector<std::int64_t> local(3000), remote(3000);
  for (std::int64_t i = 0; i < 3000; ++i) {
    local[i] = i;
    remote[i] = 2999 - i;
  }
  for (int round = 0; round < 20; ++round) {
    Side p, d;
    EnginesFirst guard({&p, &d});
    ASSERT_NO_FATAL_FAILURE(SetUpSide(p, "P", LargeLayers(3000), 1));
    ASSERT_NO_FATAL_FAILURE(SetUpSide(d, "D", LargeLayers(3000), 2));
    ASSERT_TRUE(p.engine->AddPeer(d.metadata).ok());
    for (const TestLayer& l : p.layers) {
      ASSERT_TRUE(p.engine->WriteLayer("w", l.name, "D", local, remote).ok());
    }
    ASSERT_TRUE(p.engine->Seal("w", "D", static_cast<std::int64_t>(p.layers.size())).ok());
    d.engine.reset();
    d.buffer.reset();
    Events events(p.engine.get());
    TransferEvent e = events.Wait("w");
    EXPECT_TRUE(e.state == TransferState::kFailed || e.state == TransferState::kDone)
        << TransferStateName(e.state) << ": " << e.message;
  }
}

TEST(EngineShutdown, PeerDestroyedWhileWritesAreInFlightEndsThemOnce) {
  Side p, d;
  EnginesFirst guard({&p, &d});
  ASSERT_NO_FATAL_FAILURE(SetUpSide(p, "P", PrefillLayers(), 1, {{"loopback_delay_ms", "50"}}));
  ASSERT_NO_FATAL_FAILURE(SetUpSide(d, "D", DecodeLayers(), 2));
  ASSERT_TRUE(p.engine->AddPeer(d.metadata).ok());
  const std::vector<std::int64_t> ids = {0, 1, 2};
  for (const TestLayer& l : p.layers) {
    ASSERT_TRUE(p.engine->WriteLayer("w", l.name, "D", ids, ids).ok());
  }
  ASSERT_TRUE(p.engine->Seal("w", "D", static_cast<std::int64_t>(p.layers.size())).ok());
  d.engine.reset();  // the decode side goes away; its buffer stays allocated (test-owned)
  Events events(p.engine.get());
  TransferEvent e = events.Wait("w");
  EXPECT_TRUE(e.state == TransferState::kFailed || e.state == TransferState::kDone)
      << TransferStateName(e.state) << ": " << e.message;
  events.Poll(100ms);
  EXPECT_EQ(events.Count("w"), 1u);
  EXPECT_EQ(p.engine->PendingTransfers(), 0u);
  p.engine.reset();
}

// ---- segments: windows (heterogeneous TP, other block sizes) and per-group block ids --------

// Layers of one model at `heads` KV heads per rank (block 16 and 32 tokens: never equal to a
// head count, so no shape is ambiguous), in prefill's or decode's physical layouts.
std::vector<TestLayer> TpLayers(std::int64_t heads, bool prefill) {
  if (prefill) {
    return {MakeLayer("attn.0", Physical::kSeparated, 6, heads, 16, 8, 2),
            MakeLayer("attn.1", Physical::kPackedPermuted, 6, heads, 32, 4, 4),
            MakeLayer("mla.0", Physical::kLatent, 6, 1, 16, 16, 2, /*block_pad=*/24)};
  }
  return {MakeLayer("attn.0", Physical::kInterleavedHB, 9, heads, 16, 8, 2),
          MakeLayer("attn.1", Physical::kSeparatedHB, 9, heads, 32, 4, 4),
          MakeLayer("mla.0", Physical::kLatent, 9, 1, 16, 16, 2)};
}

CellWindow HeadWindow(std::int64_t begin, std::int64_t count) {
  return CellWindow{begin, count, 0, std::nullopt};
}

CellWindow TokenWindow(std::int64_t begin, std::int64_t count) {
  return CellWindow{0, std::nullopt, begin, count};
}

// Two sides connected both ways (the fixture's shape for any pair of layer sets).
void Connect(Side& a, Side& b) {
  Result<std::string> ab = a.engine->AddPeer(b.metadata);
  ASSERT_TRUE(ab.ok()) << ab.status().ToString();
  Result<std::string> ba = b.engine->AddPeer(a.metadata);
  ASSERT_TRUE(ba.ok()) << ba.status().ToString();
}

const std::vector<std::string> kTpAttn = {"attn.0", "attn.1"};
const std::vector<std::string> kTpLatent = {"mla.0"};

// Decode at TP 2 (4 heads) reads its half, heads [4,8), of the prefill's 8-head layers; the
// latent cache, which every rank holds whole, goes whole in the same transfer. Then the
// prefill WRITEs the same slice into the decode.
TEST(EngineSegments, HeadSliceReadAndWrite) {
  Side p, d;
  EnginesFirst guard({&p, &d});
  ASSERT_NO_FATAL_FAILURE(SetUpSide(p, "P", TpLayers(8, true), 1));
  ASSERT_NO_FATAL_FAILURE(SetUpSide(d, "D", TpLayers(4, false), 2));
  ASSERT_NO_FATAL_FAILURE(Connect(p, d));
  const std::vector<std::int64_t> local = {7, 2, 0};
  const std::vector<std::int64_t> remote = {1, 5, 3};
  const std::vector<BlockSegment> segments = {
      {kTpAttn, local, remote, CellWindow{}, HeadWindow(4, 4)},
      {kTpLatent, local, remote, CellWindow{}, CellWindow{}}};
  std::vector<std::uint8_t> expected = d.buffer->Snapshot();
  std::vector<bool> touched(expected.size(), false);
  std::int64_t bytes =
      ApplyReference(d, p, kTpAttn, local, remote, &expected, &touched, Win{}, Win{4, 4});
  bytes += ApplyReference(d, p, kTpLatent, local, remote, &expected, &touched);
  const auto p_before = p.buffer->Snapshot();
  ASSERT_TRUE(d.engine->Read("slice", "P", segments).ok());
  Events d_events(d.engine.get());
  TransferEvent e = d_events.Wait("slice");
  EXPECT_EQ(e.state, TransferState::kDone) << e.message;
  EXPECT_EQ(e.bytes, bytes);
  ExpectBytes(d.buffer->Snapshot(), expected, touched);
  EXPECT_EQ(p.buffer->Snapshot(), p_before);
  d_events.Poll(20ms);
  EXPECT_EQ(d_events.Count("slice"), 1u);

  // WRITE: P pushes heads [4,8) of its blocks into other decode blocks, layer by layer.
  const std::vector<std::int64_t> d_blocks = {4, 8};
  const std::vector<std::int64_t> p_blocks = {0, 5};
  expected = d.buffer->Snapshot();
  std::fill(touched.begin(), touched.end(), false);
  bytes = ApplyReference(d, p, kTpAttn, d_blocks, p_blocks, &expected, &touched, Win{}, Win{4, 4});
  bytes += ApplyReference(d, p, kTpLatent, d_blocks, p_blocks, &expected, &touched);
  const std::vector<BlockSegment> slice = {{{}, p_blocks, d_blocks, HeadWindow(4, 4), {}}};
  const std::vector<BlockSegment> whole = {{{}, p_blocks, d_blocks, {}, {}}};
  for (const std::string& layer : kTpAttn) {
    Result<bool> w = p.engine->WriteLayer("push", layer, "D", slice);
    ASSERT_TRUE(w.ok()) << w.status().ToString();
    EXPECT_TRUE(*w);
  }
  Result<bool> again = p.engine->WriteLayer("push", "attn.0", "D", slice);
  ASSERT_TRUE(again.ok());
  EXPECT_FALSE(*again) << "a (transfer, layer) scheduled twice";
  ASSERT_TRUE(p.engine->WriteLayer("push", "mla.0", "D", whole).ok());
  ASSERT_TRUE(p.engine->Seal("push", "D", 3).ok());
  Events p_events(p.engine.get());
  e = p_events.Wait("push");
  EXPECT_EQ(e.state, TransferState::kDone) << e.message;
  EXPECT_EQ(e.bytes, bytes);
  ExpectBytes(d.buffer->Snapshot(), expected, touched);
}

// Decode at TP 1 (8 heads) gathers two prefill ranks' 4 heads each: one READ per peer into
// heads [0,4) and [4,8) of the same blocks; then both prefill ranks WRITE their ranges into
// other blocks of the decode.
TEST(EngineSegments, GatherTwoPeersHeadRangesIntoOneBlock) {
  Side p0, p1, d;
  EnginesFirst guard({&p0, &p1, &d});
  ASSERT_NO_FATAL_FAILURE(SetUpSide(p0, "P0", TpLayers(4, true), 1));
  ASSERT_NO_FATAL_FAILURE(SetUpSide(p1, "P1", TpLayers(4, true), 3));
  ASSERT_NO_FATAL_FAILURE(SetUpSide(d, "D", TpLayers(8, false), 2));
  ASSERT_NO_FATAL_FAILURE(Connect(p0, d));
  ASSERT_NO_FATAL_FAILURE(Connect(p1, d));
  const std::vector<std::int64_t> local = {3, 6};
  const std::vector<std::int64_t> remote = {2, 4};
  std::vector<std::uint8_t> expected = d.buffer->Snapshot();
  std::vector<bool> touched(expected.size(), false);
  ApplyReference(d, p0, kTpAttn, local, remote, &expected, &touched, Win{0, 4}, Win{});
  ApplyReference(d, p1, kTpAttn, local, remote, &expected, &touched, Win{4, 4}, Win{});
  ApplyReference(d, p0, kTpLatent, local, remote, &expected, &touched);
  ASSERT_TRUE(d.engine
                  ->Read("g0", "P0",
                         std::vector<BlockSegment>{
                             {kTpAttn, local, remote, HeadWindow(0, 4), {}},
                             {kTpLatent, local, remote, {}, {}}})
                  .ok());
  ASSERT_TRUE(d.engine
                  ->Read("g1", "P1",
                         std::vector<BlockSegment>{{kTpAttn, local, remote, HeadWindow(4, 4), {}}})
                  .ok());
  Events d_events(d.engine.get());
  EXPECT_EQ(d_events.Wait("g0").state, TransferState::kDone);
  EXPECT_EQ(d_events.Wait("g1").state, TransferState::kDone);
  ExpectBytes(d.buffer->Snapshot(), expected, touched);

  const std::vector<std::int64_t> d_blocks = {0, 8};
  const std::vector<std::int64_t> p_blocks = {5, 1};
  expected = d.buffer->Snapshot();
  std::fill(touched.begin(), touched.end(), false);
  ApplyReference(d, p0, kTpAttn, d_blocks, p_blocks, &expected, &touched, Win{0, 4}, Win{});
  ApplyReference(d, p1, kTpAttn, d_blocks, p_blocks, &expected, &touched, Win{4, 4}, Win{});
  for (auto [side, begin] : {std::pair{&p0, 0}, std::pair{&p1, 4}}) {
    for (const std::string& layer : kTpAttn) {
      Result<bool> w = side->engine->WriteLayer(
          "push", layer, "D",
          std::vector<BlockSegment>{{{}, p_blocks, d_blocks, {}, HeadWindow(begin, 4)}});
      ASSERT_TRUE(w.ok()) << w.status().ToString();
    }
    ASSERT_TRUE(side->engine->Seal("push", "D", 2).ok());
    Events events(side->engine.get());
    EXPECT_EQ(events.Wait("push").state, TransferState::kDone);
  }
  ExpectBytes(d.buffer->Snapshot(), expected, touched);
}

// Prefill 16-token blocks into decode 64-token blocks: four segments with token windows
// 0/16/32/48 of the SAME decode block (disjoint windows: allowed), in one READ; and the
// reverse direction (a 16-token side reads windows of the 64-token side's blocks).
TEST(EngineSegments, BlockSize16Into64AndBack) {
  auto layers = [](std::int64_t block_size, bool prefill) {
    return std::vector<TestLayer>{
        MakeLayer("attn.0", prefill ? Physical::kSeparated : Physical::kInterleavedHB,
                  prefill ? 12 : 4, 2, block_size, 8, 2),
        MakeLayer("mla.0", Physical::kLatent, prefill ? 12 : 4, 1, block_size, 16, 2, 8)};
  };
  const std::vector<std::string> all = {"attn.0", "mla.0"};
  Side p, d;
  EnginesFirst guard({&p, &d});
  ASSERT_NO_FATAL_FAILURE(SetUpSide(p, "P", layers(16, true), 1));
  ASSERT_NO_FATAL_FAILURE(SetUpSide(d, "D", layers(64, false), 2));
  ASSERT_NO_FATAL_FAILURE(Connect(p, d));
  // Decode blocks 2 and 0 hold prefill blocks 4..7 and 8..11.
  std::vector<BlockSegment> segments;
  std::vector<std::uint8_t> expected = d.buffer->Snapshot();
  std::vector<bool> touched(expected.size(), false);
  for (std::int64_t q = 0; q < 4; ++q) {
    const std::vector<std::int64_t> local = {2, 0};
    const std::vector<std::int64_t> remote = {4 + q, 8 + q};
    segments.push_back({{}, local, remote, TokenWindow(16 * q, 16), {}});
    ApplyReference(d, p, all, local, remote, &expected, &touched, Win{0, -1, 16 * q, 16}, Win{});
  }
  ASSERT_TRUE(d.engine->Read("16to64", "P", segments).ok());
  Events d_events(d.engine.get());
  TransferEvent e = d_events.Wait("16to64");
  EXPECT_EQ(e.state, TransferState::kDone) << e.message;
  ExpectBytes(d.buffer->Snapshot(), expected, touched);

  // 64 -> 16: the prefill side pulls decode block 3's four quarters into its blocks 0..3.
  segments.clear();
  expected = p.buffer->Snapshot();
  touched.assign(expected.size(), false);
  for (std::int64_t q = 0; q < 4; ++q) {
    const std::vector<std::int64_t> local = {q};
    const std::vector<std::int64_t> remote = {3};
    segments.push_back({{}, local, remote, {}, TokenWindow(16 * q, 16)});
    ApplyReference(p, d, all, local, remote, &expected, &touched, Win{}, Win{0, -1, 16 * q, 16});
  }
  ASSERT_TRUE(p.engine->Read("64to16", "D", segments).ok());
  Events p_events(p.engine.get());
  e = p_events.Wait("64to16");
  EXPECT_EQ(e.state, TransferState::kDone) << e.message;
  ExpectBytes(p.buffer->Snapshot(), expected, touched);
}

// Layer groups with their own block ids (hybrid caches): two segments naming different layers
// and different ids in one transfer, one event.
TEST_F(EnginePair, SegmentsWithOwnLayersAndIdsAreOneTransfer) {
  const std::vector<std::string> full = {"attn.0", "attn.1"};
  const std::vector<std::string> window = {"mla.0", "attn.2"};
  const std::vector<BlockSegment> segments = {{full, {7, 2, 8}, {0, 5, 3}, {}, {}},
                                              {window, {1}, {4}, {}, {}}};
  std::vector<std::uint8_t> expected = d_.buffer->Snapshot();
  std::vector<bool> touched(expected.size(), false);
  std::int64_t bytes = ApplyReference(d_, p_, full, {7, 2, 8}, {0, 5, 3}, &expected, &touched);
  bytes += ApplyReference(d_, p_, window, {1}, {4}, &expected, &touched);
  ASSERT_TRUE(d_.engine->Read("groups", "P", segments).ok());
  Events events(d_.engine.get());
  TransferEvent e = events.Wait("groups");
  EXPECT_EQ(e.state, TransferState::kDone) << e.message;
  EXPECT_EQ(e.bytes, bytes);
  ExpectBytes(d_.buffer->Snapshot(), expected, touched);
  events.Poll(20ms);
  EXPECT_EQ(events.Count("groups"), 1u);
  EXPECT_EQ(d_.engine->PendingTransfers(), 0u);
  // No segments: nothing to move, done.
  ASSERT_TRUE(d_.engine->Read("none", "P", std::span<const BlockSegment>{}).ok());
  EXPECT_EQ(events.Wait("none").state, TransferState::kDone);
}

// Every bad segment argument fails the call naming the segment (and layer, block, window):
// no transfer exists, no byte moved, the id stays free.
TEST(EngineSegments, BadSegmentsAreRefusedBeforeAnythingStarts) {
  Side p, d;
  EnginesFirst guard({&p, &d});
  ASSERT_NO_FATAL_FAILURE(SetUpSide(p, "P", TpLayers(8, true), 1));
  ASSERT_NO_FATAL_FAILURE(SetUpSide(d, "D", TpLayers(4, false), 2));
  ASSERT_NO_FATAL_FAILURE(Connect(p, d));
  const std::vector<std::int64_t> one = {1};
  struct Case {
    const char* what;
    std::vector<BlockSegment> segments;
    StatusCode code;
    std::vector<std::string> says;
  };
  const std::vector<Case> cases = {
      {"overlapping local windows of one block",
       {{kTpAttn, {1, 2}, {0, 1}, TokenWindow(0, 8), CellWindow{0, 4, 0, 8}},
        {kTpAttn, {3, 2}, {2, 3}, TokenWindow(4, 8), CellWindow{4, 4, 4, 8}}},
       StatusCode::kInvalidArgument,
       {"segments 0 and 1", "local block 2", "attn.0", "tokens [0,8) of 16",
        "tokens [4,12) of 16"}},
      {"the same block twice, whole windows",
       {{kTpLatent, one, one, {}, {}}, {kTpLatent, one, {2}, {}, {}}},
       StatusCode::kInvalidArgument,
       {"segments 0 and 1", "local block 1", "mla.0"}},
      {"remote window outside the peer's block",
       {{kTpAttn, one, one, {}, HeadWindow(6, 4)}},
       StatusCode::kInvalidArgument,
       {"segment 0", "remote", "attn.0", "heads [6,10) of 8"}},
      {"local window outside the block",
       {{kTpLatent, one, one, {}, {}}, {kTpAttn, {2}, one, TokenWindow(12, 8), HeadWindow(0, 4)}},
       StatusCode::kInvalidArgument,
       {"segment 1", "attn.0", "tokens [12,20) of 16"}},
      {"windows that do not pair",
       {{kTpAttn, one, one, {}, HeadWindow(0, 2)}},
       StatusCode::kIncompatible,
       {"segment 0", "attn.0", "heads [0,2) of 8", "4 and 2 heads"}},
      {"whole blocks of layers with other heads",
       {{kTpAttn, one, one, {}, {}}},
       StatusCode::kIncompatible,
       {"segment 0", "attn.0", "hold different content"}},
      {"remote id past the peer's blocks",
       {{kTpLatent, one, one, {}, {}}, {kTpAttn, one, {6}, {}, HeadWindow(4, 4)}},
       StatusCode::kOutOfRange,
       {"segment 1", "remote block id 6", "attn.0"}},
      {"local id past our blocks",
       {{kTpAttn, {9}, one, {}, HeadWindow(4, 4)}},
       StatusCode::kOutOfRange,
       {"segment 0", "local block id 9"}},
      {"unknown layer", {{{"attn.9"}, one, one, {}, {}}}, StatusCode::kNotFound,
       {"segment 0", "attn.9"}},
      {"a layer twice in a segment", {{{"mla.0", "mla.0"}, one, one, {}, {}}},
       StatusCode::kInvalidArgument, {"segment 0", "mla.0", "twice"}},
      {"duplicate local ids in a segment", {{kTpLatent, {1, 1}, {1, 2}, {}, {}}},
       StatusCode::kInvalidArgument, {"segment 0", "duplicate local block id 1"}},
  };
  const auto p_before = p.buffer->Snapshot();
  const auto d_before = d.buffer->Snapshot();
  for (const Case& c : cases) {
    SCOPED_TRACE(c.what);
    Status st = d.engine->Read("bad", "P", c.segments);
    ASSERT_FALSE(st.ok());
    EXPECT_EQ(st.code(), c.code) << st.ToString();
    for (const std::string& s : c.says) {
      EXPECT_NE(st.message().find(s), std::string::npos) << s << " in " << st.ToString();
    }
    EXPECT_NE(st.message().find("'bad'"), std::string::npos) << st.ToString();
    EXPECT_EQ(d.engine->PendingTransfers(), 0u);
    EXPECT_TRUE(d.engine->PollEvents(16, 0ms).empty()) << "a refused READ created a transfer";
  }
  EXPECT_EQ(p.buffer->Snapshot(), p_before);
  EXPECT_EQ(d.buffer->Snapshot(), d_before);
  // The id is still free.
  ASSERT_TRUE(
      d.engine->Read("bad", "P", std::vector<BlockSegment>{{kTpLatent, one, one, {}, {}}}).ok());
  Events events(d.engine.get());
  EXPECT_EQ(events.Wait("bad").state, TransferState::kDone);
}

// WRITE checks the REMOTE destination cells: two prefill-side segments filling disjoint head
// ranges of one decode block are fine, overlapping ones are refused (failing the transfer, as
// every refused layer does); segments naming layers are refused in WriteLayer.
TEST(EngineSegments, WriteSegmentsCheckRemoteDestinations) {
  Side p, d;
  EnginesFirst guard({&p, &d});
  ASSERT_NO_FATAL_FAILURE(SetUpSide(p, "P", TpLayers(4, true), 1));
  ASSERT_NO_FATAL_FAILURE(SetUpSide(d, "D", TpLayers(8, false), 2));
  ASSERT_NO_FATAL_FAILURE(Connect(p, d));
  const auto d_before = d.buffer->Snapshot();
  // P's blocks 1 and 2 into heads [0,4) and [4,8) of D's block 5: one write, two segments.
  std::vector<std::uint8_t> expected = d.buffer->Snapshot();
  std::vector<bool> touched(expected.size(), false);
  ApplyReference(d, p, {"attn.0"}, {5}, {1}, &expected, &touched, Win{0, 4}, Win{});
  ApplyReference(d, p, {"attn.0"}, {5}, {2}, &expected, &touched, Win{4, 4}, Win{});
  Result<bool> w = p.engine->WriteLayer(
      "fill", "attn.0", "D",
      std::vector<BlockSegment>{{{}, {1}, {5}, {}, HeadWindow(0, 4)},
                                {{}, {2}, {5}, {}, HeadWindow(4, 4)}});
  ASSERT_TRUE(w.ok()) << w.status().ToString();
  EXPECT_TRUE(*w);
  ASSERT_TRUE(p.engine->Seal("fill", "D", 1).ok());
  Events events(p.engine.get());
  EXPECT_EQ(events.Wait("fill").state, TransferState::kDone);
  ExpectBytes(d.buffer->Snapshot(), expected, touched);

  const auto d_filled = d.buffer->Snapshot();
  w = p.engine->WriteLayer("overlap", "attn.0", "D",
                           std::vector<BlockSegment>{{{}, {1}, {5}, {}, HeadWindow(0, 4)},
                                                     {{}, {2}, {5}, {}, HeadWindow(2, 4)}});
  ASSERT_FALSE(w.ok());
  EXPECT_EQ(w.status().code(), StatusCode::kInvalidArgument) << w.status().ToString();
  for (const char* s : {"'overlap'", "attn.0", "segments 0 and 1", "remote block 5",
                        "heads [0,4) of 8", "heads [2,6) of 8"}) {
    EXPECT_NE(w.status().message().find(s), std::string::npos) << s << " in "
                                                                << w.status().ToString();
  }
  EXPECT_EQ(events.Wait("overlap").state, TransferState::kFailed);
  w = p.engine->WriteLayer("named", "attn.0", "D",
                           std::vector<BlockSegment>{{{"attn.0"}, {1}, {5}, {}, HeadWindow(0, 4)}});
  EXPECT_EQ(w.status().code(), StatusCode::kInvalidArgument) << w.status().ToString();
  EXPECT_NE(w.status().message().find("segment 0"), std::string::npos) << w.status().ToString();
  EXPECT_EQ(events.Wait("named").state, TransferState::kFailed);
  EXPECT_EQ(d.buffer->Snapshot(), d_filled);
  EXPECT_NE(d_filled, d_before);
  EXPECT_EQ(p.engine->PendingTransfers(), 0u);
}

// The head slice of an NHD prefill layer against an HND decode layer goes as cells where the
// backend takes them (loopback does), and moves the same bytes as runs.
TEST(EngineSegments, HeadSliceGoesAsCellsAndEqualsRuns) {
  for (const char* cells : {"1", "0"}) {
    SCOPED_TRACE(cells);
    Side p, d;
    EnginesFirst guard({&p, &d});
    const BackendOptions options = {{"loopback_cells", cells}};
    ASSERT_NO_FATAL_FAILURE(SetUpSide(
        p, "P", {MakeLayer("attn.0", Physical::kSeparated, 6, 8, 16, 8, 2)}, 1, options));
    ASSERT_NO_FATAL_FAILURE(SetUpSide(
        d, "D", {MakeLayer("attn.0", Physical::kInterleavedHB, 9, 4, 16, 8, 2)}, 2, options));
    ASSERT_NO_FATAL_FAILURE(Connect(p, d));
    const std::vector<std::int64_t> local = {8, 1};
    const std::vector<std::int64_t> remote = {0, 5};
    std::vector<std::uint8_t> expected = d.buffer->Snapshot();
    std::vector<bool> touched(expected.size(), false);
    ApplyReference(d, p, {"attn.0"}, local, remote, &expected, &touched, Win{}, Win{4, 4});
    const std::vector<BlockSegment> segments = {{{}, local, remote, {}, HeadWindow(4, 4)}};
    ASSERT_TRUE(d.engine->Read("c", "P", segments).ok());
    Events events(d.engine.get());
    TransferEvent e = events.Wait("c");
    EXPECT_EQ(e.state, TransferState::kDone) << e.message;
    EXPECT_EQ(e.cell_batches, std::string(cells) == "1" ? 1 : 0);
    ExpectBytes(d.buffer->Snapshot(), expected, touched);
  }
}

// Threads planning segmented READs at once share the peer's windowed-template cache (built on a
// miss by whichever thread comes first): every transfer ends done with its own bytes.
TEST(EngineSegments, ConcurrentSegmentedReadsShareTheWindowCache) {
  Side p, d;
  EnginesFirst guard({&p, &d});
  ASSERT_NO_FATAL_FAILURE(SetUpSide(p, "P", TpLayers(8, true), 1));
  ASSERT_NO_FATAL_FAILURE(SetUpSide(d, "D", TpLayers(2, false), 2));
  ASSERT_NO_FATAL_FAILURE(Connect(p, d));
  // Thread k reads heads [2*(k%4), 2*(k%4)+2) of P's block k%6 into D's block k.
  constexpr int kThreads = 8;
  std::vector<std::uint8_t> expected = d.buffer->Snapshot();
  std::vector<bool> touched(expected.size(), false);
  for (int k = 0; k < kThreads; ++k) {
    ApplyReference(d, p, kTpAttn, {k}, {k % 6}, &expected, &touched, Win{}, Win{2 * (k % 4), 2});
  }
  std::vector<Status> results(kThreads);
  std::vector<std::thread> threads;
  for (int k = 0; k < kThreads; ++k) {
    threads.emplace_back([&, k] {
      const std::vector<BlockSegment> segments = {
          {kTpAttn, {k}, {k % 6}, {}, HeadWindow(2 * (k % 4), 2)}};
      results[k] = d.engine->Read("c" + std::to_string(k), "P", segments);
    });
  }
  for (std::thread& t : threads) t.join();
  Events events(d.engine.get());
  for (int k = 0; k < kThreads; ++k) {
    ASSERT_TRUE(results[k].ok()) << results[k].ToString();
    EXPECT_EQ(events.Wait("c" + std::to_string(k)).state, TransferState::kDone);
  }
  ExpectBytes(d.buffer->Snapshot(), expected, touched);
}

}  // namespace
// The mixed model (dense layers of four layouts, a latent layer with padded pages; different
// layouts on each side) with stamped batches: a READ of its four layers goes in the ramp's
// pieces (one layer, two, then the last), a WRITE one batch per layer, and every byte equals the
// reference.
TEST(EngineStamps, MixedLayersAndWindowsMoveTheReferenceBytesInStampedBatches) {
  const BackendOptions options{{"loopback_cells", "0"}, {"loopback_stamps", "1"}};
  Side d, p;
  EnginesFirst guard({&d, &p});
  ASSERT_NO_FATAL_FAILURE(SetUpSide(d, "D", DecodeLayers(), 3, options));
  ASSERT_NO_FATAL_FAILURE(SetUpSide(p, "P", PrefillLayers(), 4, options));
  ASSERT_NO_FATAL_FAILURE(Connect(p, d));
  Events d_events(d.engine.get());
  Events p_events(p.engine.get());
  const std::vector<std::int64_t> d_ids = {8, 0, 3, 4}, p_ids = {1, 5, 2, 3};
  std::vector<std::uint8_t> expected = d.buffer->Snapshot();
  std::vector<bool> touched(expected.size(), false);
  const std::int64_t bytes = ApplyReference(d, p, Names(d), d_ids, p_ids, &expected, &touched);
  ASSERT_TRUE(d.engine->Read("r", "P", d_ids, p_ids).ok());
  TransferEvent e = d_events.Wait("r");
  EXPECT_EQ(e.state, TransferState::kDone) << e.message;
  EXPECT_EQ(e.bytes, bytes);
  EXPECT_EQ(e.batches, 3) << "stamped pieces of one, two and one layers";
  EXPECT_EQ(e.cell_batches, 0);
  EXPECT_EQ(e.stamped_batches, 3);
  ExpectBytes(d.buffer->Snapshot(), expected, touched);
  // WRITE, layer by layer, into other blocks of D's.
  const std::vector<std::int64_t> w_from = {0, 4}, w_to = {7, 2};
  expected = d.buffer->Snapshot();
  touched.assign(expected.size(), false);
  ApplyReference(d, p, Names(d), w_to, w_from, &expected, &touched);
  for (const std::string& layer : Names(d)) {
    Result<bool> w = p.engine->WriteLayer("w", layer, "D", w_from, w_to);
    ASSERT_TRUE(w.ok() && *w) << layer << ": " << w.status().ToString();
  }
  ASSERT_TRUE(p.engine->Seal("w", "D", static_cast<int>(Names(d).size())).ok());
  e = p_events.Wait("w");
  EXPECT_EQ(e.state, TransferState::kDone) << e.message;
  EXPECT_EQ(e.batches, static_cast<std::int64_t>(Names(d).size()));
  EXPECT_EQ(e.stamped_batches, e.batches) << "a stamped layer per write";
  ExpectBytes(d.buffer->Snapshot(), expected, touched);
}

TEST(EngineStamps, HeadWindowsGoStampedAndEqualTheReference) {
  const BackendOptions options = {{"loopback_cells", "0"}, {"loopback_stamps", "1"}};
  Side p, d;
  EnginesFirst guard({&p, &d});
  ASSERT_NO_FATAL_FAILURE(SetUpSide(
      p, "P", {MakeLayer("attn.0", Physical::kSeparated, 6, 8, 16, 8, 2)}, 1, options));
  ASSERT_NO_FATAL_FAILURE(SetUpSide(
      d, "D", {MakeLayer("attn.0", Physical::kInterleavedHB, 9, 4, 16, 8, 2)}, 2, options));
  ASSERT_NO_FATAL_FAILURE(Connect(p, d));
  Events events(d.engine.get());
  const std::vector<std::int64_t> local = {8, 1}, remote = {0, 5};
  std::vector<std::uint8_t> expected = d.buffer->Snapshot();
  std::vector<bool> touched(expected.size(), false);
  ApplyReference(d, p, {"attn.0"}, local, remote, &expected, &touched, Win{}, Win{4, 4});
  ApplyReference(d, p, {"attn.0"}, {3}, {2}, &expected, &touched, Win{}, Win{0, 4});
  ApplyReference(d, p, {"attn.0"}, {6, 0}, {4, 1}, &expected, &touched, Win{}, Win{2, 4});
  const std::vector<BlockSegment> segments = {{{}, local, remote, {}, HeadWindow(4, 4)},
                                              {{}, {3}, {2}, {}, HeadWindow(0, 4)},
                                              {{}, {6, 0}, {4, 1}, {}, HeadWindow(2, 4)}};
  ASSERT_TRUE(d.engine->Read("c", "P", segments).ok());
  TransferEvent e = events.Wait("c");
  EXPECT_EQ(e.state, TransferState::kDone) << e.message;
  // The ramp's first piece holds segment 0; the second both others' templates and ids.
  EXPECT_EQ(e.batches, 2);
  EXPECT_EQ(e.stamped_batches, 2);
  ExpectBytes(d.buffer->Snapshot(), expected, touched);
}

}  // namespace moriio_native
