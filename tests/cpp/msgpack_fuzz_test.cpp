// Deterministic fuzzing of the metadata decoder (cpp/msgpack_lite.hpp, cpp/peer_metadata.hpp)
// and Engine::AddPeer with untrusted bytes.
//
// Inputs: random bytes, byte-level mutations (overwrite, bit flip, insert, erase, truncate,
// splice) of valid metadata, and structure-aware mutations (decode, replace one leaf with an
// "interesting" value, re-encode). The seed is fixed, so a failure reproduces. What must hold for
// every input: no crash, hang or sanitizer report (the ASan/UBSan CI configuration runs this),
// every result is OK or a clean error with a message, an error from the decoder is
// InvalidArgument or Incompatible, AddPeer never accepts what the decoder rejects, and a failed
// AddPeer leaves the engine without a peer.

#include <gtest/gtest.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <limits>
#include <memory>
#include <optional>
#include <ostream>
#include <random>
#include <string>
#include <vector>

#include "metadata_samples.hpp"
#include "moriio_native/engine.hpp"
#include "msgpack_lite.hpp"
#include "peer_metadata.hpp"
#include "test_printers.hpp"

namespace moriio_native {
namespace {

namespace mp = detail::msgpack;
using Bytes = std::vector<std::uint8_t>;

// ---- msgpack helpers -----------------------------------------------------------------------

// Structural equality, with the decoder's rule that non-negative integers are uint64.
bool Same(const mp::Value& a, const mp::Value& b) {
  auto as_u = [](const mp::Value& v) -> std::optional<std::uint64_t> {
    if (auto* u = std::get_if<std::uint64_t>(&v.v)) return *u;
    if (auto* i = std::get_if<std::int64_t>(&v.v); i && *i >= 0) return std::uint64_t(*i);
    return std::nullopt;
  };
  if (auto ua = as_u(a), ub = as_u(b); ua || ub) return ua && ub && *ua == *ub;
  if (a.v.index() != b.v.index()) return false;
  if (auto* x = std::get_if<mp::Array>(&a.v)) {
    const auto& y = std::get<mp::Array>(b.v);
    if (x->size() != y.size()) return false;
    for (std::size_t i = 0; i < x->size(); ++i) {
      if (!Same((*x)[i], y[i])) return false;
    }
    return true;
  }
  if (auto* x = std::get_if<mp::Map>(&a.v)) {
    const auto& y = std::get<mp::Map>(b.v);
    if (x->size() != y.size()) return false;
    for (std::size_t i = 0; i < x->size(); ++i) {
      if ((*x)[i].first != y[i].first || !Same((*x)[i].second, y[i].second)) return false;
    }
    return true;
  }
  if (auto* x = std::get_if<bool>(&a.v)) return *x == std::get<bool>(b.v);
  if (auto* x = std::get_if<std::int64_t>(&a.v)) return *x == std::get<std::int64_t>(b.v);
  if (auto* x = std::get_if<std::string>(&a.v)) return *x == std::get<std::string>(b.v);
  if (auto* x = std::get_if<mp::Bytes>(&a.v)) return *x == std::get<mp::Bytes>(b.v);
  return true;  // both nil
}

// Integers around every encoding boundary.
std::int64_t InterestingInt(std::mt19937_64& rng) {
  // clang-format off
  static const std::int64_t kValues[] = {
      0, 1, -1, 31, -32, -33, 127, 128, 255, 256, 65535, 65536, -129, -32769,
      std::int64_t{1} << 31, (std::int64_t{1} << 32) - 1, std::int64_t{1} << 32,
      std::int64_t{1} << 40, std::int64_t{1} << 56, std::int64_t{1} << 62,
      std::numeric_limits<std::int64_t>::max(), std::numeric_limits<std::int64_t>::min()};
  // clang-format on
  if (rng() % 4 == 0) return static_cast<std::int64_t>(rng());
  return kValues[rng() % std::size(kValues)];
}

// A random msgpack value (for the codec round trip).
mp::Value RandomValue(std::mt19937_64& rng, int depth) {
  const int kind = static_cast<int>(rng() % (depth > 0 ? 8 : 6));
  switch (kind) {
    case 0:
      return mp::Value{};
    case 1:
      return mp::Value{rng() % 2 == 0};
    case 2: {
      const std::int64_t i = InterestingInt(rng);
      mp::Value v;
      if (i < 0) {
        v.v = i;
      } else {
        v.v = static_cast<std::uint64_t>(i);
      }
      return v;
    }
    case 3: {
      // Lengths around the fixstr / str8 / str16 boundaries.
      static const std::size_t kLens[] = {0, 1, 31, 32, 255, 256, 300, 65535, 65536};
      const std::size_t n = kLens[rng() % std::size(kLens)];
      if (n > 300 && rng() % 8 != 0) return mp::Value{std::string("short")};  // big ones rarely
      return mp::Value{std::string(n, char('a' + rng() % 26))};
    }
    case 4: {
      static const std::size_t kLens[] = {0, 1, 255, 256, 65535, 65536};
      const std::size_t n = kLens[rng() % std::size(kLens)];
      if (n > 256 && rng() % 8 != 0) return mp::Value{mp::Bytes{1, 2, 3}};  // big ones rarely
      return mp::Value{mp::Bytes(n, std::uint8_t(rng()))};
    }
    case 5:
      return mp::Value{static_cast<std::uint64_t>(rng())};
    case 6: {
      static const std::size_t kLens[] = {0, 1, 15, 16, 17};
      mp::Array a(kLens[rng() % std::size(kLens)]);
      for (mp::Value& x : a) x = RandomValue(rng, depth - 1);
      return mp::Value{std::move(a)};
    }
    default: {
      static const std::size_t kLens[] = {0, 1, 15, 16};
      mp::Map m(kLens[rng() % std::size(kLens)]);
      // Keys are unique (the decoder rejects duplicates): a random prefix plus the position.
      for (std::size_t i = 0; i < m.size(); ++i) {
        m[i].first = std::string(rng() % 5, 'k') + std::to_string(i);
        m[i].second = RandomValue(rng, depth - 1);
      }
      return mp::Value{std::move(m)};
    }
  }
}

// ---- a registered engine and its peer's metadata -------------------------------------------

using test_support::Buffer;
using test_support::NewBuffer;
using test_support::NewEngine;

std::vector<LayerRegistration> Layers(const Buffer& buffer) {
  const auto base = reinterpret_cast<std::uint64_t>(buffer.get());
  return test_support::SampleLayers(
      buffer, "kv", {{4, 2, 4, 2, 8}, {128, 64, 16, 8, 1}, 2, base + 64},  // [N,2,B,H,D]
      "mla", {{4, 4, 16}, {80, 16, 1}, 2, base + 4096 + 8});               // padded blocks
}

// What one MutateLeaf call changed, so that the seed tree can be restored instead of copied for
// every input (a deep copy per iteration would dominate the run time under ASan).
struct Undo {
  std::vector<std::pair<mp::Value*, mp::Value>> values;
  std::vector<std::pair<std::string*, std::string>> keys;
  void Restore() {
    for (auto it = values.rbegin(); it != values.rend(); ++it) *it->first = std::move(it->second);
    for (auto it = keys.rbegin(); it != keys.rend(); ++it) *it->first = std::move(it->second);
    values.clear();
    keys.clear();
  }
};

// Replaces one random leaf of `v` with an interesting value of a random type.
void MutateLeaf(mp::Value& v, std::mt19937_64& rng, Undo& undo) {
  if (auto* a = std::get_if<mp::Array>(&v.v); a && !a->empty() && rng() % 4 != 0) {
    MutateLeaf((*a)[rng() % a->size()], rng, undo);
    return;
  }
  if (auto* m = std::get_if<mp::Map>(&v.v); m && !m->empty() && rng() % 4 != 0) {
    auto& entry = (*m)[rng() % m->size()];
    if (rng() % 16 == 0) {
      undo.keys.emplace_back(&entry.first, entry.first);
      entry.first = std::string(rng() % 3, 'x');  // rename the key
    } else {
      MutateLeaf(entry.second, rng, undo);
    }
    return;
  }
  undo.values.emplace_back(&v, v);
  switch (rng() % 8) {
    case 0: {
      const std::int64_t i = InterestingInt(rng);
      if (i < 0) {
        v.v = i;
      } else {
        v.v = static_cast<std::uint64_t>(i);
      }
      break;
    }
    case 1:
      v.v = static_cast<std::uint64_t>(rng());
      break;
    case 2:
      v.v = std::string(rng() % 40, 'z');
      break;
    case 3:
      v.v = mp::Bytes(rng() % 40, 0x31);
      break;
    case 4:
      v.v = std::monostate{};
      break;
    case 5:
      v.v = rng() % 2 == 0;
      break;
    case 6:
      v.v = mp::Array{};
      break;
    default:
      if (auto* u = std::get_if<std::uint64_t>(&v.v)) {
        *u += (rng() % 2 == 0 ? 1 : static_cast<std::uint64_t>(-1));  // off by one
      } else {
        v.v = mp::Map{};
      }
  }
}

void MutateBytes(Bytes& b, std::mt19937_64& rng) {
  const int edits = 1 + static_cast<int>(rng() % 6);
  for (int e = 0; e < edits; ++e) {
    const std::size_t pos = b.empty() ? 0 : rng() % b.size();
    switch (rng() % 6) {
      case 0:
        if (!b.empty()) b[pos] = static_cast<std::uint8_t>(rng());
        break;
      case 1:
        if (!b.empty()) b[pos] ^= static_cast<std::uint8_t>(1u << (rng() % 8));
        break;
      case 2:
        b.insert(b.begin() + static_cast<std::ptrdiff_t>(pos), static_cast<std::uint8_t>(rng()));
        break;
      case 3:
        if (!b.empty()) b.erase(b.begin() + static_cast<std::ptrdiff_t>(pos));
        break;
      case 4:
        b.resize(pos);
        break;  // truncate
      default: {
        // Splice in a header byte that claims a large length or count.
        static const std::uint8_t kHeaders[] = {0xdb, 0xc6, 0xdd, 0xdf, 0xdc, 0xde, 0xcf, 0xd3};
        if (!b.empty()) b[pos] = kHeaders[rng() % std::size(kHeaders)];
      }
    }
  }
}

// ---- the tests -------------------------------------------------------------------------------

TEST(MsgpackLite, RandomValuesRoundTrip) {
  std::mt19937_64 rng(7);
  for (int iter = 0; iter < 3000; ++iter) {
    const mp::Value v = RandomValue(rng, 3);
    const Bytes bytes = mp::Encode(v);
    Result<mp::Value> back = mp::Decode(bytes, 8);
    ASSERT_TRUE(back.ok()) << "iteration " << iter << ": " << back.status().ToString();
    ASSERT_TRUE(Same(v, *back)) << "iteration " << iter << " decoded to a different value";
    ASSERT_EQ(mp::Encode(*back), bytes) << "iteration " << iter;
  }
}

TEST(MsgpackLite, LongContainersUseTheirWideHeaders) {
  // 70000 entries need array32 / map32 headers; a fixed value keeps this cheap.
  mp::Array a(70000, mp::Value{true});
  mp::Map m(70000);
  for (std::size_t i = 0; i < m.size(); ++i) m[i].first = "k" + std::to_string(i);
  for (const mp::Value& v : {mp::Value{a}, mp::Value{m}}) {
    const Bytes bytes = mp::Encode(v);
    Result<mp::Value> back = mp::Decode(bytes);
    ASSERT_TRUE(back.ok()) << back.status().ToString();
    EXPECT_TRUE(Same(v, *back));
    // One byte short of the last entry: truncated, not a crash.
    Result<mp::Value> cut = mp::Decode(std::span(bytes).first(bytes.size() - 1));
    EXPECT_EQ(cut.status().code(), StatusCode::kInvalidArgument);
  }
}

TEST(MsgpackLite, DepthIsBounded) {
  Bytes shallow(3, 0x91);
  shallow.push_back(0xc0);
  EXPECT_TRUE(mp::Decode(shallow).ok());
  for (std::size_t depth : {std::size_t{100}, std::size_t{1} << 20}) {
    Bytes deep(depth, 0x91);
    deep.push_back(0xc0);
    Result<mp::Value> r = mp::Decode(deep);
    ASSERT_FALSE(r.ok()) << "depth " << depth;
    EXPECT_EQ(r.status().code(), StatusCode::kInvalidArgument);
  }
}

TEST(MsgpackLite, TypedAccessorsRejectOtherTypes) {
  const mp::Value str{std::string("s")};
  const mp::Value neg{std::int64_t{-5}};
  const mp::Value big{std::numeric_limits<std::uint64_t>::max()};
  EXPECT_EQ(mp::AsUInt(neg, "n").status().code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(mp::AsInt(big, "n").status().code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(mp::AsInt(neg, "n").value(), -5);
  EXPECT_EQ(mp::AsMap(str, "thing").status().code(), StatusCode::kInvalidArgument);
  EXPECT_NE(mp::AsMap(str, "thing").status().message().find("thing"), std::string::npos);
  EXPECT_EQ(mp::AsBin(str, "b").status().code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(mp::AsBool(str, "b").status().code(), StatusCode::kInvalidArgument);
  const mp::Map m = {{"a", mp::Value{true}}};
  EXPECT_TRUE(mp::Field(m, "a", "m").ok());
  EXPECT_NE(mp::Field(m, "zz", "m").status().message().find("zz"), std::string::npos);
}

TEST(MetadataFuzz, DecoderAndAddPeerSurviveHostileBytes) {
  Buffer our_buffer = NewBuffer();
  Buffer their_buffer = NewBuffer();
  std::unique_ptr<Engine> ours = NewEngine("P");
  std::unique_ptr<Engine> theirs = NewEngine("D");
  ASSERT_TRUE(ours && theirs);
  ASSERT_TRUE(ours->RegisterKvCaches(Layers(our_buffer)).ok());
  Result<Bytes> meta = theirs->RegisterKvCaches(Layers(their_buffer));
  ASSERT_TRUE(meta.ok()) << meta.status().ToString();
  const Bytes valid = *meta;
  Result<mp::Value> tree = mp::Decode(valid);
  ASSERT_TRUE(tree.ok());
  ASSERT_TRUE(ours->AddPeer(valid).ok()) << "the seed itself must be accepted";
  ASSERT_TRUE(ours->RemovePeer("D").ok());

  constexpr int kIterations = 200000;
  std::mt19937_64 rng(0x5eed);
  int decoded_ok = 0, added = 0, incompatible = 0;
  Bytes input;
  mp::Value seed = *tree;
  Undo undo;
  for (int iter = 0; iter < kIterations; ++iter) {
    switch (iter % 4) {
      case 0: {  // random bytes, often starting like a map
        input.resize(rng() % 48);
        for (std::uint8_t& b : input) b = static_cast<std::uint8_t>(rng());
        if (!input.empty() && rng() % 2 == 0) input[0] = 0x80 | (rng() % 16);
        break;
      }
      case 1:  // byte-level mutations of valid metadata
        input = valid;
        MutateBytes(input, rng);
        break;
      case 2:  // a truncated prefix, sometimes with a tail of junk
        input.assign(valid.begin(),
                     valid.begin() + static_cast<std::ptrdiff_t>(rng() % valid.size()));
        if (rng() % 4 == 0) input.push_back(static_cast<std::uint8_t>(rng()));
        break;
      default: {               // structure-aware: one leaf replaced
        if (rng() % 4 == 0) {  // two edits: on a copy (a second edit may replace the first's
                               // ancestor, which one undo log cannot restore)
          mp::Value copy = seed;
          Undo discard;
          MutateLeaf(copy, rng, discard);
          MutateLeaf(copy, rng, discard);
          input = mp::Encode(copy);
        } else {
          MutateLeaf(seed, rng, undo);
          input = mp::Encode(seed);
          undo.Restore();
          if (iter % 4096 == 3) {
            ASSERT_EQ(mp::Encode(seed), valid) << "the seed was not restored";
          }
        }
      }
    }

    Result<detail::EngineMetadata> decoded = detail::DecodeMetadata(input);
    // The bare msgpack decoder on a sample (DecodeMetadata runs it on every input already).
    if (iter % 8 == 0 || decoded.ok()) {
      Result<mp::Value> raw = mp::Decode(input);
      if (!raw.ok()) {
        ASSERT_EQ(raw.status().code(), StatusCode::kInvalidArgument) << "iteration " << iter;
      }
      ASSERT_TRUE(raw.ok() || !decoded.ok())
          << "iteration " << iter << ": metadata decoded from bad msgpack";
    }
    if (decoded.ok()) {
      ++decoded_ok;
      // Whatever the decoder accepts re-encodes to something it accepts again, unchanged.
      Result<detail::EngineMetadata> again =
          detail::DecodeMetadata(detail::EncodeMetadata(*decoded));
      ASSERT_TRUE(again.ok()) << "iteration " << iter << ": " << again.status().ToString();
      ASSERT_EQ(again->engine_id, decoded->engine_id);
      ASSERT_EQ(again->layers.size(), decoded->layers.size());
      for (std::size_t i = 0; i < again->layers.size(); ++i) {
        ASSERT_EQ(again->layers[i].layout.params(), decoded->layers[i].layout.params());
        ASSERT_EQ(again->layers[i].offset, decoded->layers[i].offset);
      }
    } else {
      const StatusCode code = decoded.status().code();
      ASSERT_TRUE(code == StatusCode::kInvalidArgument || code == StatusCode::kIncompatible)
          << "iteration " << iter << ": " << decoded.status().ToString();
      ASSERT_FALSE(decoded.status().message().empty());
      if (code == StatusCode::kIncompatible) ++incompatible;
    }

    // AddPeer on every decodable input and on a sample of the rest (its first step is the same
    // decoder; the sample checks that it never accepts what the decoder refused).
    if (!decoded.ok() && iter % 32 != 0) continue;
    Result<std::string> peer = ours->AddPeer(input);
    if (peer.ok()) {
      ASSERT_TRUE(decoded.ok()) << "iteration " << iter << ": AddPeer accepted undecodable bytes";
      ++added;
      ASSERT_EQ(ours->Peers(), std::vector<std::string>{*peer});
      ASSERT_TRUE(ours->RemovePeer(*peer).ok());
    } else {
      ASSERT_NE(peer.status().code(), StatusCode::kInternal) << peer.status().ToString();
      ASSERT_FALSE(peer.status().message().empty());
      ASSERT_TRUE(ours->Peers().empty())
          << "iteration " << iter << ": a failed AddPeer left a peer";
    }
  }
  EXPECT_EQ(ours->PendingTransfers(), 0u);
  // Not assertions on the fuzzer's luck, just what it exercised (visible in the test log).
  RecordProperty("decoded_ok", decoded_ok);
  RecordProperty("added", added);
  RecordProperty("incompatible", incompatible);
  std::printf("  %d inputs: %d decoded, %d added as a peer, %d incompatible\n", kIterations,
              decoded_ok, added, incompatible);
}

}  // namespace
}  // namespace moriio_native
