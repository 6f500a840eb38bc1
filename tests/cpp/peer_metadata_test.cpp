// Tests of peer metadata validation (cpp/peer_metadata.hpp, Engine::AddPeer).
//
// Peer metadata arrives from the network, so every number in it is untrusted (DESIGN.md §3.3:
// "add_peer validates every number it receives before anything uses it"). Each test takes the
// valid metadata of a real registered engine, decodes it with msgpack_lite, breaks exactly one
// thing, re-encodes it with the test's own writer and checks that both DecodeMetadata and
// Engine::AddPeer reject it with the documented code, and that the engine is unchanged: no peer
// added, and the valid metadata is still accepted afterwards.

#include "peer_metadata.hpp"

#include <gtest/gtest.h>

#include <algorithm>
#include <cstdint>
#include <cstdlib>
#include <functional>
#include <limits>
#include <memory>
#include <ostream>
#include <string>
#include <vector>

#include "metadata_samples.hpp"
#include "moriio_native/engine.hpp"
#include "msgpack_lite.hpp"
#include "test_printers.hpp"

namespace moriio_native {
namespace {

namespace mp = detail::msgpack;
using Bytes = std::vector<std::uint8_t>;

constexpr std::int64_t kI64Max = std::numeric_limits<std::int64_t>::max();
constexpr std::uint64_t kU64Max = std::numeric_limits<std::uint64_t>::max();

// ---- a small registered engine -------------------------------------------------------------

using test_support::Buffer;
using test_support::kBufferBytes;
using test_support::NewBuffer;
using test_support::NewEngine;

// Two layers in one buffer: a K/V layer [2, N=4, B=4, H=2, D=8] and a latent layer [N=4, B=4,
// D=16], both bf16 and contiguous, at unaligned offsets.
std::vector<LayerRegistration> Layers(const Buffer& buffer) {
  const auto base = reinterpret_cast<std::uint64_t>(buffer.get());
  return test_support::SampleLayers(
      buffer, "model.layers.0.attn", {{2, 4, 4, 2, 8}, {256, 64, 16, 8, 1}, 2, base + 200},
      "model.layers.1.mla", {{4, 4, 16}, {64, 16, 1}, 2, base + 200 + 2 * 256 * 2 + 40});
}

// ---- msgpack editing -----------------------------------------------------------------------

mp::Value& At(mp::Value& map, const std::string& key) {
  for (auto& [k, v] : std::get<mp::Map>(map.v)) {
    if (k == key) return v;
  }
  ADD_FAILURE() << "no key " << key;
  std::abort();
}

mp::Value& At(mp::Value& array, std::size_t i) { return std::get<mp::Array>(array.v).at(i); }

void Erase(mp::Value& map, const std::string& key) {
  auto& m = std::get<mp::Map>(map.v);
  std::erase_if(m, [&](const auto& kv) { return kv.first == key; });
}

// Integers as the decoder produces them: non-negative ones are uint64.
mp::Value Int(std::int64_t v) {
  mp::Value x;
  if (v < 0) {
    x.v = v;
  } else {
    x.v = static_cast<std::uint64_t>(v);
  }
  return x;
}
mp::Value UInt(std::uint64_t v) { return mp::Value{v}; }
mp::Value Str(std::string s) { return mp::Value{std::move(s)}; }

mp::Value& Layer(mp::Value& root, std::size_t i) { return At(At(root, "layers"), i); }
mp::Value& Param(mp::Value& root, std::size_t layer, std::size_t i) {
  return At(At(Layer(root, layer), "params"), i);
}
mp::Value& Region(mp::Value& root, std::size_t i) { return At(At(root, "regions"), i); }

// Indices into a layer's "params" array (the order LayoutParams is encoded in).
constexpr std::size_t kNumBlocks = 1, kBlockSize = 2, kKernelBlock = 3, kHeads = 4, kDtype = 5,
                      kBlockStride = 6, kKernelStride = 7, kHeadStride = 8, kTokenStride = 9,
                      kPlaneOffset1 = 11, kPlaneBytes0 = 12;

// ---- the fixture ------------------------------------------------------------------------------

class BadMetadata : public ::testing::Test {
 protected:
  void SetUp() override {
    ours_ = NewEngine("P");
    theirs_ = NewEngine("D");
    ASSERT_TRUE(ours_ && theirs_);
    ASSERT_TRUE(ours_->RegisterKvCaches(Layers(our_buffer_)).ok());
    Result<Bytes> meta = theirs_->RegisterKvCaches(Layers(their_buffer_));
    ASSERT_TRUE(meta.ok()) << meta.status().ToString();
    valid_ = *meta;
    Result<mp::Value> root = mp::Decode(valid_);
    ASSERT_TRUE(root.ok()) << root.status().ToString();
    root_ = *root;
  }

  void TearDown() override {
    if (HasFailure()) return;
    // The engine is unchanged by everything the test fed it: the valid metadata still works.
    ASSERT_TRUE(ours_->Peers().empty());
    Result<std::string> ok = ours_->AddPeer(valid_);
    ASSERT_TRUE(ok.ok()) << "valid metadata refused after the test: " << ok.status().ToString();
    EXPECT_EQ(*ok, "D");
  }

  // A fresh copy of the valid metadata's tree to break.
  mp::Value Tree() const { return root_; }

  // Both the decoder and AddPeer reject `bytes` with `code` (and a message containing `needle`),
  // and no peer appears.
  void ExpectRejected(const Bytes& bytes, StatusCode code, const std::string& needle = "") {
    Result<detail::EngineMetadata> decoded = detail::DecodeMetadata(bytes);
    ASSERT_FALSE(decoded.ok()) << "DecodeMetadata accepted it";
    EXPECT_EQ(decoded.status().code(), code) << decoded.status().ToString();
    EXPECT_FALSE(decoded.status().message().empty());
    if (!needle.empty()) {
      EXPECT_NE(decoded.status().message().find(needle), std::string::npos)
          << "message should name '" << needle << "': " << decoded.status().ToString();
    }
    Result<std::string> added = ours_->AddPeer(bytes);
    ASSERT_FALSE(added.ok()) << "AddPeer accepted it as peer '" << *added << "'";
    EXPECT_EQ(added.status().code(), code) << added.status().ToString();
    EXPECT_TRUE(ours_->Peers().empty());
    EXPECT_EQ(ours_->PendingTransfers(), 0u);
  }
  void ExpectRejected(const mp::Value& tree, StatusCode code, const std::string& needle = "") {
    ExpectRejected(mp::Encode(tree), code, needle);
  }

  Buffer our_buffer_ = NewBuffer();
  Buffer their_buffer_ = NewBuffer();
  std::unique_ptr<Engine> ours_;
  std::unique_ptr<Engine> theirs_;
  Bytes valid_;
  mp::Value root_;
};

TEST_F(BadMetadata, ValidMetadataDecodesToWhatWasRegistered) {
  Result<detail::EngineMetadata> m = detail::DecodeMetadata(valid_);
  ASSERT_TRUE(m.ok()) << m.status().ToString();
  EXPECT_EQ(m->engine_id, "D");
  EXPECT_EQ(m->backend, "loopback");
  ASSERT_EQ(m->regions.size(), 1u) << "two layers in one allocation share one region";
  const auto base = reinterpret_cast<std::uint64_t>(their_buffer_.get());
  EXPECT_GE(m->regions[0].range.address, base);
  EXPECT_LE(m->regions[0].range.address + m->regions[0].range.size, base + kBufferBytes);
  ASSERT_EQ(m->layers.size(), 2u);
  EXPECT_EQ(m->layers[0].layout.name(), "model.layers.0.attn");
  EXPECT_EQ(m->layers[1].layout.name(), "model.layers.1.mla");
  EXPECT_EQ(m->layers[0].layout.num_blocks(), 4);
  // Each layer's base = region start + offset, i.e. where it was registered.
  EXPECT_EQ(m->regions[0].range.address + m->layers[0].offset, base + 200);
  EXPECT_EQ(m->regions[0].range.address + m->layers[1].offset, base + 200 + 1024 + 40);
  // The re-encoded tree (the path every test below takes) is still accepted.
  ASSERT_TRUE(detail::DecodeMetadata(mp::Encode(Tree())).ok());
}

TEST_F(BadMetadata, EveryTruncatedPrefixIsRejected) {
  for (std::size_t n = 0; n < valid_.size(); ++n) {
    SCOPED_TRACE("prefix of " + std::to_string(n) + " of " + std::to_string(valid_.size()));
    ExpectRejected(Bytes(valid_.begin(), valid_.begin() + static_cast<std::ptrdiff_t>(n)),
                   StatusCode::kInvalidArgument);
    if (HasFatalFailure()) return;
  }
}

TEST_F(BadMetadata, TrailingBytesAreRejected) {
  Bytes longer = valid_;
  longer.push_back(0xc0);
  ExpectRejected(longer, StatusCode::kInvalidArgument);
  Bytes twice = valid_;
  twice.insert(twice.end(), valid_.begin(), valid_.end());
  ExpectRejected(twice, StatusCode::kInvalidArgument);
}

TEST_F(BadMetadata, OtherVersionIsIncompatible) {
  for (std::uint64_t version :
       {std::uint64_t{0}, std::uint64_t{2}, std::uint64_t{1} << 40, kU64Max}) {
    SCOPED_TRACE("version " + std::to_string(version));
    mp::Value t = Tree();
    At(t, "version") = UInt(version);
    ExpectRejected(t, StatusCode::kIncompatible, "version");
  }
  mp::Value t = Tree();
  At(t, "version") = Str("1");
  ExpectRejected(t, StatusCode::kInvalidArgument, "version");
}

TEST_F(BadMetadata, OtherFormatIsRejected) {
  for (const char* format : {"", "moriio", "vllm-moriio", "MORIIO-NATIVE"}) {
    SCOPED_TRACE(format);
    mp::Value t = Tree();
    At(t, "format") = Str(format);
    ExpectRejected(t, StatusCode::kInvalidArgument);
  }
}

TEST_F(BadMetadata, EveryMissingFieldIsRejectedByName) {
  const mp::Value root = Tree();
  for (const auto& [key, value] : std::get<mp::Map>(root.v)) {
    SCOPED_TRACE("top-level " + key);
    mp::Value t = Tree();
    Erase(t, key);
    ExpectRejected(t, StatusCode::kInvalidArgument, key);
  }
  mp::Value probe = Tree();
  for (const auto& [key, value] : std::get<mp::Map>(Region(probe, 0).v)) {
    SCOPED_TRACE("region " + key);
    mp::Value t = Tree();
    Erase(Region(t, 0), key);
    ExpectRejected(t, StatusCode::kInvalidArgument, key);
  }
  for (const auto& [key, value] : std::get<mp::Map>(Layer(probe, 1).v)) {
    SCOPED_TRACE("layer " + key);
    mp::Value t = Tree();
    Erase(Layer(t, 1), key);
    ExpectRejected(t, StatusCode::kInvalidArgument, key);
  }
}

TEST_F(BadMetadata, WrongTypesAreRejected) {
  struct Case {
    const char* what;
    std::function<void(mp::Value&)> edit;
  };
  const std::vector<Case> cases = {
      {"root is an array", [](mp::Value& t) { t = mp::Value{mp::Array{t}}; }},
      {"engine_id is an int", [](mp::Value& t) { At(t, "engine_id") = UInt(7); }},
      {"engine_id is empty", [](mp::Value& t) { At(t, "engine_id") = Str(""); }},
      {"engine_id is too long",
       [](mp::Value& t) { At(t, "engine_id") = Str(std::string(5000, 'x')); }},
      {"backend is bytes",
       [](mp::Value& t) { At(t, "backend") = mp::Value{mp::Bytes{'u', 'c', 'x'}}; }},
      {"address is a string", [](mp::Value& t) { At(t, "address") = Str("loopback:1:1"); }},
      {"address is empty", [](mp::Value& t) { At(t, "address") = mp::Value{mp::Bytes{}}; }},
      {"regions is a map", [](mp::Value& t) { At(t, "regions") = mp::Value{mp::Map{}}; }},
      {"no regions", [](mp::Value& t) { At(t, "regions") = mp::Value{mp::Array{}}; }},
      {"no layers", [](mp::Value& t) { At(t, "layers") = mp::Value{mp::Array{}}; }},
      {"a layer is a string", [](mp::Value& t) { Layer(t, 0) = Str("model.layers.0.attn"); }},
      {"a region is nil", [](mp::Value& t) { Region(t, 0) = mp::Value{}; }},
      {"region key is a string", [](mp::Value& t) { At(Region(t, 0), "key") = Str("1:1"); }},
      {"region aligned is an int", [](mp::Value& t) { At(Region(t, 0), "aligned") = UInt(1); }},
      {"layer name is empty", [](mp::Value& t) { At(Layer(t, 0), "name") = Str(""); }},
      {"params is a map", [](mp::Value& t) { At(Layer(t, 0), "params") = mp::Value{mp::Map{}}; }},
      {"params has 13 entries",
       [](mp::Value& t) { std::get<mp::Array>(At(Layer(t, 0), "params").v).pop_back(); }},
      {"params has 15 entries",
       [](mp::Value& t) { std::get<mp::Array>(At(Layer(t, 0), "params").v).push_back(UInt(0)); }},
      {"a param is a string", [](mp::Value& t) { Param(t, 0, kHeads) = Str("2"); }},
      {"a param is nil", [](mp::Value& t) { Param(t, 0, kBlockSize) = mp::Value{}; }},
      {"a param exceeds int64", [](mp::Value& t) { Param(t, 0, kNumBlocks) = UInt(kU64Max); }},
      {"unknown cache kind", [](mp::Value& t) { Param(t, 0, 0) = UInt(2); }},
      {"offset is negative", [](mp::Value& t) { At(Layer(t, 0), "offset") = Int(-8); }},
  };
  for (const Case& c : cases) {
    SCOPED_TRACE(c.what);
    mp::Value t = Tree();
    c.edit(t);
    ExpectRejected(t, StatusCode::kInvalidArgument);
  }
}

TEST_F(BadMetadata, LayerRangeOutsideItsRegionIsRejected) {
  Result<detail::EngineMetadata> m = detail::DecodeMetadata(valid_);
  ASSERT_TRUE(m.ok());
  const std::uint64_t region_size = m->regions[0].range.size;
  for (std::size_t layer = 0; layer < 2; ++layer) {
    const auto span = static_cast<std::uint64_t>(m->layers[layer].layout.span_bytes());
    const std::string name = m->layers[layer].layout.name();
    for (std::uint64_t offset :
         {region_size - span + 1, region_size, region_size + 1, std::uint64_t{1} << 63, kU64Max}) {
      SCOPED_TRACE(name + " at offset " + std::to_string(offset));
      mp::Value t = Tree();
      At(Layer(t, layer), "offset") = UInt(offset);
      ExpectRejected(t, StatusCode::kInvalidArgument, name);
    }
    // Exactly at the end is fine for the decoder (it fits); we only check it is not rejected.
    mp::Value t = Tree();
    At(Layer(t, layer), "offset") = UInt(region_size - span);
    EXPECT_TRUE(detail::DecodeMetadata(mp::Encode(t)).ok()) << name << " ending exactly at the end";
  }
  // A region shrunk below its layers.
  mp::Value t = Tree();
  At(Region(t, 0), "size") = UInt(m->layers[0].offset + 16);
  ExpectRejected(t, StatusCode::kInvalidArgument, "model.layers.0.attn");
}

TEST_F(BadMetadata, BadRegionsAreRejected) {
  Result<detail::EngineMetadata> m = detail::DecodeMetadata(valid_);
  ASSERT_TRUE(m.ok());
  struct Case {
    const char* what;
    const char* key;
    mp::Value value;
  };
  const std::vector<Case> cases = {
      {"size 0", "size", UInt(0)},
      {"address 0", "address", UInt(0)},
      {"address + size wraps", "address", UInt(kU64Max - 100)},
      {"unknown memory kind", "kind", UInt(9)},
      {"device below -1", "device", Int(-2)},
      {"absurd device ordinal", "device", UInt(1u << 20)},
      {"oversized key", "key", mp::Value{mp::Bytes(detail::kMaxKeyBytes + 1, 'k')}},
  };
  for (const Case& c : cases) {
    SCOPED_TRACE(c.what);
    mp::Value t = Tree();
    At(Region(t, 0), c.key) = c.value;
    ExpectRejected(t, StatusCode::kInvalidArgument, "region");
  }
}

TEST_F(BadMetadata, AbsurdLayoutNumbersAreRejected) {
  struct Case {
    const char* what;
    std::size_t param;
    std::int64_t value;
  };
  const std::vector<Case> cases = {
      {"num_blocks 2^62", kNumBlocks, std::int64_t{1} << 62},
      {"num_blocks INT64_MAX", kNumBlocks, kI64Max},
      {"num_blocks 0", kNumBlocks, 0},
      {"num_blocks -1", kNumBlocks, -1},
      {"block_size 0", kBlockSize, 0},
      {"block_size 2^40", kBlockSize, std::int64_t{1} << 40},
      {"kernel block does not divide", kKernelBlock, 3},
      {"kernel block 0", kKernelBlock, 0},
      {"heads 2^40", kHeads, std::int64_t{1} << 40},
      {"heads 0", kHeads, 0},
      {"dtype 0", kDtype, 0},
      {"dtype 2^20", kDtype, std::int64_t{1} << 20},
      {"block stride 2^62 (overflows with num_blocks)", kBlockStride, std::int64_t{1} << 62},
      {"block stride INT64_MAX", kBlockStride, kI64Max},
      {"block stride negative", kBlockStride, -64},
      {"kernel block stride negative", kKernelStride, -1},
      {"head stride INT64_MAX", kHeadStride, kI64Max},
      {"token stride INT64_MIN", kTokenStride, std::numeric_limits<std::int64_t>::min()},
      {"plane offset INT64_MAX", kPlaneOffset1, kI64Max},
      {"plane bytes 0", kPlaneBytes0, 0},
      {"plane bytes 2^61", kPlaneBytes0, std::int64_t{1} << 61},
      {"overlapping cells (block stride 2)", kBlockStride, 2},
  };
  for (std::size_t layer = 0; layer < 2; ++layer) {
    for (const Case& c : cases) {
      SCOPED_TRACE("layer " + std::to_string(layer) + ": " + c.what);
      mp::Value t = Tree();
      Param(t, layer, c.param) = Int(c.value);
      ExpectRejected(t, StatusCode::kInvalidArgument);
    }
  }
}

TEST_F(BadMetadata, DuplicateLayerNamesAreRejected) {
  mp::Value renamed = Tree();
  At(Layer(renamed, 1), "name") = Str("model.layers.0.attn");
  ExpectRejected(renamed, StatusCode::kInvalidArgument, "model.layers.0.attn");
  mp::Value appended = Tree();
  mp::Value copy = Layer(appended, 0);
  std::get<mp::Array>(At(appended, "layers").v).push_back(copy);
  ExpectRejected(appended, StatusCode::kInvalidArgument, "model.layers.0.attn");
}

// Names become Python str: bytes that are not UTF-8 are refused by the decoder (so AddPeer
// connects nothing), in every string field, for each kind of malformed sequence.
TEST_F(BadMetadata, NonUtf8StringsAreRejected) {
  const std::vector<std::string> bad = {
      std::string("peer\xff"),                 // never valid
      std::string("\xc0\xaf"),                 // overlong '/'
      std::string("a\xe0\x80\xaf"),            // overlong, 3 bytes
      std::string("\xed\xa0\x80"),             // surrogate U+D800
      std::string("\xf4\x90\x80\x80"),         // above U+10FFFF
      std::string("x\xe2\x82"),                // truncated sequence at the end
      std::string("\x80"),                     // continuation byte first
      std::string("\xc3\x28"),                 // bad continuation
  };
  for (const std::string& s : bad) {
    SCOPED_TRACE(::testing::PrintToString(s));
    mp::Value id = Tree();
    At(id, "engine_id") = Str(s);
    ExpectRejected(id, StatusCode::kInvalidArgument, "engine_id is not valid UTF-8");
    mp::Value backend = Tree();
    At(backend, "backend") = Str(s);
    ExpectRejected(backend, StatusCode::kInvalidArgument, "backend is not valid UTF-8");
    for (std::size_t layer : {0u, 1u}) {
      mp::Value name = Tree();
      At(Layer(name, layer), "name") = Str(s);
      ExpectRejected(name, StatusCode::kInvalidArgument, "name is not valid UTF-8");
    }
  }
  // Well-formed multi-byte names (2, 3 and 4 byte sequences, the largest code point) decode.
  mp::Value good = Tree();
  At(good, "engine_id") = Str("d\xc3\xa9" "code-\xe5\xb1\x82-\xf0\x9f\x98\x80-\xf4\x8f\xbf\xbf");
  Result<detail::EngineMetadata> decoded = detail::DecodeMetadata(mp::Encode(good));
  ASSERT_TRUE(decoded.ok()) << decoded.status().ToString();
  EXPECT_EQ(decoded->engine_id, "d\xc3\xa9" "code-\xe5\xb1\x82-\xf0\x9f\x98\x80-\xf4\x8f\xbf\xbf");
}

// Names end up in logs: a control character, a line separator or a bidirectional control
// would let a peer forge log lines, as the control plane's schema says for its ids. Each is
// refused in every name field; the printable neighbours of each range decode.
TEST_F(BadMetadata, NamesWithControlOrBidirectionalCharactersAreRejected) {
  const std::vector<std::string> bad = {
      std::string("a\nb"),          std::string("a\x1b[31mred"), std::string("del\x7f"),
      std::string("c1\xc2\x85"),    std::string("ls\xe2\x80\xa8"), std::string("ps\xe2\x80\xa9"),
      std::string("rlo\xe2\x80\xae"), std::string("lri\xe2\x81\xa6"), std::string("pdi\xe2\x81\xa9"),
      std::string(1, '\0'),
  };
  for (const std::string& s : bad) {
    SCOPED_TRACE(::testing::PrintToString(s));
    mp::Value id = Tree();
    At(id, "engine_id") = Str(s);
    ExpectRejected(id, StatusCode::kInvalidArgument, "engine_id holds a control");
    mp::Value name = Tree();
    At(Layer(name, 0), "name") = Str(s);
    ExpectRejected(name, StatusCode::kInvalidArgument, "name holds a control");
  }
  for (const std::string& s : {std::string("nbsp\xc2\xa0"), std::string("dash\xe2\x80\x94"),
                               std::string("wj\xe2\x81\xa0"), std::string("tilde~")}) {
    SCOPED_TRACE(::testing::PrintToString(s));
    mp::Value good = Tree();
    At(good, "engine_id") = Str(s);
    Result<detail::EngineMetadata> decoded = detail::DecodeMetadata(mp::Encode(good));
    EXPECT_TRUE(decoded.ok()) << decoded.status().ToString();
  }
}

TEST_F(BadMetadata, RegionIndexOutOfRangeIsRejected) {
  for (std::uint64_t region : {std::uint64_t{1}, std::uint64_t{4096}, kU64Max}) {
    SCOPED_TRACE("region " + std::to_string(region));
    mp::Value t = Tree();
    At(Layer(t, 1), "region") = UInt(region);
    ExpectRejected(t, StatusCode::kInvalidArgument, "model.layers.1.mla");
  }
}

TEST_F(BadMetadata, FingerprintMismatchIsRejected) {
  mp::Value probe = Tree();
  const std::uint64_t fp = std::get<std::uint64_t>(At(Layer(probe, 0), "fingerprint").v);
  for (std::uint64_t bad : {fp ^ 1, fp + 12345, std::uint64_t{0}}) {
    mp::Value t = Tree();
    At(Layer(t, 0), "fingerprint") = UInt(bad);
    ExpectRejected(t, StatusCode::kInvalidArgument, "model.layers.0.attn");
  }
  // Changing the logical content without its fingerprint is caught the same way: 2 heads
  // claimed as 1 (strides still valid) would otherwise pass every range check.
  mp::Value t = Tree();
  Param(t, 0, kHeads) = Int(1);
  ExpectRejected(t, StatusCode::kInvalidArgument, "model.layers.0.attn");
}

// Replaces the first occurrence of `key` (as a fixstr map key) with `replacement` bytes.
Bytes ReplaceKey(const Bytes& in, const std::string& key, const Bytes& replacement) {
  Bytes needle = {static_cast<std::uint8_t>(0xa0 | key.size())};
  needle.insert(needle.end(), key.begin(), key.end());
  auto it = std::search(in.begin(), in.end(), needle.begin(), needle.end());
  EXPECT_NE(it, in.end()) << key;
  Bytes out(in.begin(), it);
  out.insert(out.end(), replacement.begin(), replacement.end());
  out.insert(out.end(), it + static_cast<std::ptrdiff_t>(needle.size()), in.end());
  return out;
}

TEST_F(BadMetadata, NonStringMapKeysAreRejected) {
  // Top level, a region and a layer; int, nil, bool, bin and array keys.
  ExpectRejected(ReplaceKey(valid_, "format", {0x01}), StatusCode::kInvalidArgument);
  ExpectRejected(ReplaceKey(valid_, "size", {0xc0}), StatusCode::kInvalidArgument);
  ExpectRejected(ReplaceKey(valid_, "fingerprint", {0xc3}), StatusCode::kInvalidArgument);
  ExpectRejected(ReplaceKey(valid_, "params", {0xc4, 0x01, 'p'}), StatusCode::kInvalidArgument);
  ExpectRejected(ReplaceKey(valid_, "layers", {0x91, 0xa1, 'l'}), StatusCode::kInvalidArgument);
  ExpectRejected(Bytes{0x81, 0x01, 0x02}, StatusCode::kInvalidArgument);
}

TEST_F(BadMetadata, DeepNestingIsRejectedWithoutExhaustingTheStack) {
  for (std::size_t depth : {std::size_t{9}, std::size_t{64}, std::size_t{100000}}) {
    SCOPED_TRACE("depth " + std::to_string(depth));
    Bytes arrays(depth, 0x91);  // [[[[...nil...]]]]
    arrays.push_back(0xc0);
    ExpectRejected(arrays, StatusCode::kInvalidArgument);
    Bytes maps;
    for (std::size_t i = 0; i < depth; ++i) maps.insert(maps.end(), {0x81, 0xa1, 'k'});
    maps.push_back(0xc0);
    ExpectRejected(maps, StatusCode::kInvalidArgument);
  }
  // Nesting inside an otherwise valid document.
  mp::Value t = Tree();
  mp::Value deep{};
  for (int i = 0; i < 50; ++i) deep = mp::Value{mp::Array{deep}};
  At(t, "layers") = deep;
  ExpectRejected(t, StatusCode::kInvalidArgument);
}

TEST_F(BadMetadata, LengthsBeyondTheInputAreRejectedWithoutAllocating) {
  // Headers that claim 4 GiB of content in a few bytes.
  ExpectRejected(Bytes{0xdb, 0xff, 0xff, 0xff, 0xff, 'a'}, StatusCode::kInvalidArgument);   // str32
  ExpectRejected(Bytes{0xc6, 0xff, 0xff, 0xff, 0xff, 0x00}, StatusCode::kInvalidArgument);  // bin32
  ExpectRejected(Bytes{0xdd, 0xff, 0xff, 0xff, 0xff, 0xc0},
                 StatusCode::kInvalidArgument);  // array32
  ExpectRejected(Bytes{0xdf, 0xff, 0xff, 0xff, 0xff, 0xa0, 0xc0},
                 StatusCode::kInvalidArgument);  // map32
  // Unsupported types (ext, float) are errors, not crashes.
  ExpectRejected(Bytes{0xd4, 0x01, 0x02}, StatusCode::kInvalidArgument);
  ExpectRejected(Bytes{0xcb, 0, 0, 0, 0, 0, 0, 0, 0}, StatusCode::kInvalidArgument);
}

TEST_F(BadMetadata, OversizedMetadataIsRejectedBeforeParsing) {
  Bytes huge(detail::kMaxMetadataBytes + 1, 0);
  std::copy(valid_.begin(), valid_.end(), huge.begin());
  ExpectRejected(huge, StatusCode::kInvalidArgument);
}

}  // namespace
}  // namespace moriio_native

namespace moriio_native {
namespace {

// A map that names a key twice is ambiguous (which value wins differs between parsers): refused.
TEST(MsgpackLite, DuplicateMapKeyIsRejected) {
  detail::msgpack::Writer w;
  w.MapHeader(2);
  w.Str("engine_id");
  w.Str("a");
  w.Str("engine_id");
  w.Str("b");
  const std::vector<std::uint8_t> bytes = w.Take();
  auto decoded = detail::msgpack::Decode(bytes);
  ASSERT_FALSE(decoded.ok());
  EXPECT_NE(decoded.status().message().find("duplicate map key 'engine_id'"), std::string::npos);
}

}  // namespace
}  // namespace moriio_native

namespace moriio_native {
namespace {

// Nested containers whose headers each claim as many elements as bytes remain: refused at the
// header, before anything is allocated for them (formerly ~2.5 GiB per level).
TEST(MsgpackLite, LyingContainerHeadersFailBeforeAllocating) {
  std::vector<std::uint8_t> bytes;
  for (int level = 0; level < 8; ++level) {
    bytes.push_back(0xdd);  // array32
    for (int k = 0; k < 4; ++k) bytes.push_back(0x7f);
  }
  bytes.resize(bytes.size() + (1 << 20), 0x01);  // 1 MiB of fixints: far fewer than declared
  auto decoded = detail::msgpack::Decode(bytes);
  ASSERT_FALSE(decoded.ok());
  EXPECT_NE(decoded.status().message().find("exceed the input"), std::string::npos)
      << decoded.status().message();
}

TEST(MsgpackLite, ElementBudgetIsEnforced) {
  detail::msgpack::Writer w;
  w.ArrayHeader(100);
  for (int i = 0; i < 100; ++i) w.UInt(1);
  const std::vector<std::uint8_t> bytes = w.Take();
  EXPECT_TRUE(detail::msgpack::Decode(bytes, 8, 100).ok());
  auto over = detail::msgpack::Decode(bytes, 8, 99);
  ASSERT_FALSE(over.ok());
  EXPECT_NE(over.status().message().find("more elements than allowed"), std::string::npos);
}

}  // namespace
}  // namespace moriio_native
