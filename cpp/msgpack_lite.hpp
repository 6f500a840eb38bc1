#pragma once

// A strict MessagePack subset (nil, bool, int, str, bin, array, map with string keys) for peer
// metadata. Hand-written instead of msgpack-cxx so that `pip install .` needs no system package
// and so the decoder of untrusted bytes has exactly the limits we fuzz: bounded depth, element
// counts bounded by the remaining input, no allocation larger than the input.

#include <cstdint>
#include <span>
#include <string>
#include <string_view>
#include <utility>
#include <variant>
#include <vector>

#include "moriio_native/status.hpp"

namespace moriio_native::detail::msgpack {

class Writer {
 public:
  void Nil();
  void Bool(bool v);
  void UInt(std::uint64_t v);
  void Int(std::int64_t v);
  void Str(std::string_view s);
  void Bin(std::span<const std::uint8_t> b);
  void ArrayHeader(std::uint32_t n);
  void MapHeader(std::uint32_t n);
  /// Writes a decoded value back (round trip: Decode(Encode(v)) == v).
  void Write(const struct Value& v);
  std::vector<std::uint8_t> Take() { return std::move(buf_); }

 private:
  void Put(std::uint8_t b) { buf_.push_back(b); }
  void PutBE(std::uint64_t v, int bytes);
  std::vector<std::uint8_t> buf_;
};

struct Value;
struct MapEntry;
using Array = std::vector<Value>;
using Map = std::vector<MapEntry>;
using Bytes = std::vector<std::uint8_t>;

/// A decoded value. Integers keep their sign class: non-negative ones are uint64.
struct Value {
  std::variant<std::monostate, bool, std::int64_t, std::uint64_t, std::string, Bytes, Array, Map> v;
};

/// One key and value of a map. A struct of its own rather than std::pair: a pair of the
/// still-incomplete Value inside Value's own variant is refused by clang with libstdc++.
struct MapEntry {
  std::string first;
  Value second;
};

/// Encodes one value.
Bytes Encode(const Value& v);

/// Decodes exactly one value spanning all of `data`, building at most `max_elements` container
/// elements. Errors are InvalidArgument with the byte offset. Thread-safe.
Result<Value> Decode(std::span<const std::uint8_t> data, int max_depth = 8,
                     std::uint64_t max_elements = std::uint64_t{1} << 22);

// Typed access for schema checks; errors name `what`.
Result<const Map*> AsMap(const Value& v, std::string_view what);
Result<const Array*> AsArray(const Value& v, std::string_view what);
Result<std::string> AsStr(const Value& v, std::string_view what);
Result<Bytes> AsBin(const Value& v, std::string_view what);
Result<std::uint64_t> AsUInt(const Value& v, std::string_view what);
Result<std::int64_t> AsInt(const Value& v, std::string_view what);
Result<bool> AsBool(const Value& v, std::string_view what);
/// The value of `key` in `map` (NotFound-style InvalidArgument when missing).
Result<const Value*> Field(const Map& map, std::string_view key, std::string_view what);

}  // namespace moriio_native::detail::msgpack
