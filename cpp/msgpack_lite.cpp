#include "msgpack_lite.hpp"

#include <algorithm>
#include <limits>
#include <unordered_set>

namespace moriio_native::detail::msgpack {

void Writer::PutBE(std::uint64_t v, int bytes) {
  for (int i = bytes - 1; i >= 0; --i) Put(static_cast<std::uint8_t>(v >> (8 * i)));
}

void Writer::Nil() { Put(0xc0); }
void Writer::Bool(bool v) { Put(v ? 0xc3 : 0xc2); }

void Writer::UInt(std::uint64_t v) {
  if (v < 128) {
    Put(static_cast<std::uint8_t>(v));
  } else if (v <= 0xff) {
    Put(0xcc);
    PutBE(v, 1);
  } else if (v <= 0xffff) {
    Put(0xcd);
    PutBE(v, 2);
  } else if (v <= 0xffffffffULL) {
    Put(0xce);
    PutBE(v, 4);
  } else {
    Put(0xcf);
    PutBE(v, 8);
  }
}

void Writer::Int(std::int64_t v) {
  if (v >= 0) return UInt(static_cast<std::uint64_t>(v));
  if (v >= -32) return Put(static_cast<std::uint8_t>(v));
  Put(0xd3);
  PutBE(static_cast<std::uint64_t>(v), 8);
}

void Writer::Str(std::string_view s) {
  const std::uint64_t n = s.size();
  if (n < 32) {
    Put(static_cast<std::uint8_t>(0xa0 | n));
  } else if (n <= 0xff) {
    Put(0xd9);
    PutBE(n, 1);
  } else if (n <= 0xffff) {
    Put(0xda);
    PutBE(n, 2);
  } else {
    Put(0xdb);
    PutBE(n, 4);
  }
  buf_.insert(buf_.end(), s.begin(), s.end());
}

void Writer::Bin(std::span<const std::uint8_t> b) {
  const std::uint64_t n = b.size();
  if (n <= 0xff) {
    Put(0xc4);
    PutBE(n, 1);
  } else if (n <= 0xffff) {
    Put(0xc5);
    PutBE(n, 2);
  } else {
    Put(0xc6);
    PutBE(n, 4);
  }
  buf_.insert(buf_.end(), b.begin(), b.end());
}

void Writer::ArrayHeader(std::uint32_t n) {
  if (n < 16) {
    Put(static_cast<std::uint8_t>(0x90 | n));
  } else if (n <= 0xffff) {
    Put(0xdc);
    PutBE(n, 2);
  } else {
    Put(0xdd);
    PutBE(n, 4);
  }
}

void Writer::MapHeader(std::uint32_t n) {
  if (n < 16) {
    Put(static_cast<std::uint8_t>(0x80 | n));
  } else if (n <= 0xffff) {
    Put(0xde);
    PutBE(n, 2);
  } else {
    Put(0xdf);
    PutBE(n, 4);
  }
}

void Writer::Write(const Value& v) {
  struct Visitor {
    Writer& w;
    void operator()(std::monostate) const { w.Nil(); }
    void operator()(bool b) const { w.Bool(b); }
    void operator()(std::int64_t i) const { w.Int(i); }
    void operator()(std::uint64_t u) const { w.UInt(u); }
    void operator()(const std::string& s) const { w.Str(s); }
    void operator()(const Bytes& b) const { w.Bin(b); }
    void operator()(const Array& a) const {
      w.ArrayHeader(static_cast<std::uint32_t>(a.size()));
      for (const Value& x : a) w.Write(x);
    }
    void operator()(const Map& m) const {
      w.MapHeader(static_cast<std::uint32_t>(m.size()));
      for (const auto& [k, x] : m) {
        w.Str(k);
        w.Write(x);
      }
    }
  };
  std::visit(Visitor{*this}, v.v);
}

Bytes Encode(const Value& v) {
  Writer w;
  w.Write(v);
  return w.Take();
}

namespace {

class Reader {
 public:
  Reader(std::span<const std::uint8_t> data, std::uint64_t max_elements)
      : data_(data), max_elements_(max_elements) {}

  Status Read(Value* out, int depth) {
    if (depth < 0) return Error("nesting deeper than allowed");
    std::uint8_t tag = 0;
    MORIIO_RETURN_IF_ERROR(Byte(&tag));
    if (tag <= 0x7f) return Set(out, std::uint64_t{tag});
    if (tag >= 0xe0) return Set(out, std::int64_t{static_cast<std::int8_t>(tag)});
    if ((tag & 0xe0) == 0xa0) return ReadStr(out, tag & 0x1f);
    if ((tag & 0xf0) == 0x90) return ReadArray(out, tag & 0x0f, depth);
    if ((tag & 0xf0) == 0x80) return ReadMap(out, tag & 0x0f, depth);
    std::uint64_t n = 0;
    switch (tag) {
      case 0xc0: out->v = std::monostate{}; return Status::OK();
      case 0xc2: out->v = false; return Status::OK();
      case 0xc3: out->v = true; return Status::OK();
      case 0xcc: case 0xcd: case 0xce: case 0xcf:
        MORIIO_RETURN_IF_ERROR(BigEndian(1 << (tag - 0xcc), &n));
        return Set(out, n);
      case 0xd0: case 0xd1: case 0xd2: case 0xd3: {
        const int bytes = 1 << (tag - 0xd0);
        MORIIO_RETURN_IF_ERROR(BigEndian(bytes, &n));
        // Sign-extend from `bytes` bytes.
        const int shift = 64 - 8 * bytes;
        const auto v = static_cast<std::int64_t>(n << shift) >> shift;
        if (v >= 0) return Set(out, static_cast<std::uint64_t>(v));
        return Set(out, v);
      }
      case 0xd9: case 0xda: case 0xdb:
        MORIIO_RETURN_IF_ERROR(BigEndian(1 << (tag - 0xd9), &n));
        return ReadStr(out, n);
      case 0xc4: case 0xc5: case 0xc6:
        MORIIO_RETURN_IF_ERROR(BigEndian(1 << (tag - 0xc4), &n));
        return ReadBin(out, n);
      case 0xdc: case 0xdd:
        MORIIO_RETURN_IF_ERROR(BigEndian(tag == 0xdc ? 2 : 4, &n));
        return ReadArray(out, n, depth);
      case 0xde: case 0xdf:
        MORIIO_RETURN_IF_ERROR(BigEndian(tag == 0xde ? 2 : 4, &n));
        return ReadMap(out, n, depth);
      default:
        return Error("unsupported msgpack type 0x" + Hex(tag));
    }
  }

  bool AtEnd() const { return pos_ == data_.size(); }
  std::size_t pos() const { return pos_; }

 private:
  static std::string Hex(std::uint8_t b) {
    const char* digits = "0123456789abcdef";
    return {digits[b >> 4], digits[b & 15]};
  }
  Status Error(const std::string& what) const {
    return InvalidArgumentError("malformed msgpack at byte " + std::to_string(pos_) + ": " + what);
  }
  template <typename T>
  static Status Set(Value* out, T v) {
    out->v = v;
    return Status::OK();
  }
  Status Byte(std::uint8_t* b) {
    if (pos_ >= data_.size()) return Error("truncated");
    *b = data_[pos_++];
    return Status::OK();
  }
  Status BigEndian(int bytes, std::uint64_t* out) {
    if (data_.size() - pos_ < static_cast<std::size_t>(bytes)) return Error("truncated");
    std::uint64_t v = 0;
    for (int i = 0; i < bytes; ++i) v = (v << 8) | data_[pos_++];
    *out = v;
    return Status::OK();
  }
  Status Need(std::uint64_t n) const {
    if (n > data_.size() - pos_) return Error("length " + std::to_string(n) + " exceeds the input");
    return Status::OK();
  }
  Status ReadStr(Value* out, std::uint64_t n) {
    MORIIO_RETURN_IF_ERROR(Need(n));
    out->v = std::string(reinterpret_cast<const char*>(data_.data() + pos_), n);
    pos_ += n;
    return Status::OK();
  }
  Status ReadBin(Value* out, std::uint64_t n) {
    MORIIO_RETURN_IF_ERROR(Need(n));
    out->v = Bytes(data_.begin() + static_cast<std::ptrdiff_t>(pos_),
                   data_.begin() + static_cast<std::ptrdiff_t>(pos_ + n));
    pos_ += n;
    return Status::OK();
  }
  // Every element takes at least one byte: the elements declared by all open containers together
  // may not exceed the bytes left, and no more than `max_elements` values are built in all. So a
  // lying header fails before it costs memory, and containers grow as their elements arrive.
  Status Declare(std::uint64_t n) {
    if (outstanding_ + n > data_.size() - pos_) {
      return Error(std::to_string(n) + " declared elements exceed the input");
    }
    if (elements_ + n > max_elements_) return Error("more elements than allowed");
    outstanding_ += n;
    elements_ += n;
    return Status::OK();
  }
  Status ReadElement(Value* v, int depth) {
    --outstanding_;
    return Read(v, depth);
  }
  Status ReadArray(Value* out, std::uint64_t n, int depth) {
    MORIIO_RETURN_IF_ERROR(Declare(n));
    Array items;
    items.reserve(std::min<std::uint64_t>(n, 4096));
    for (std::uint64_t i = 0; i < n; ++i) {
      MORIIO_RETURN_IF_ERROR(ReadElement(&items.emplace_back(), depth - 1));
    }
    out->v = std::move(items);
    return Status::OK();
  }
  Status ReadMap(Value* out, std::uint64_t n, int depth) {
    MORIIO_RETURN_IF_ERROR(Declare(2 * n));  // n < 2^32: no overflow
    Map entries;
    entries.reserve(std::min<std::uint64_t>(n, 4096));
    std::unordered_set<std::string> keys;
    for (std::uint64_t i = 0; i < n; ++i) {
      auto& [key, value] = entries.emplace_back();
      Value k;
      MORIIO_RETURN_IF_ERROR(ReadElement(&k, depth - 1));
      if (!std::holds_alternative<std::string>(k.v)) return Error("map key is not a string");
      key = std::get<std::string>(std::move(k.v));
      // Two parsers that pick different duplicates would disagree on what a peer said.
      if (!keys.insert(key).second) return Error("duplicate map key '" + key + "'");
      MORIIO_RETURN_IF_ERROR(ReadElement(&value, depth - 1));
    }
    out->v = std::move(entries);
    return Status::OK();
  }

  std::span<const std::uint8_t> data_;
  std::size_t pos_ = 0;
  std::uint64_t outstanding_ = 0;  // declared by open containers, not yet read
  std::uint64_t elements_ = 0;     // declared in all
  const std::uint64_t max_elements_;
};

std::string Expected(std::string_view what, std::string_view type) {
  return std::string(what) + " must be " + std::string(type);
}

}  // namespace

Result<Value> Decode(std::span<const std::uint8_t> data, int max_depth,
                     std::uint64_t max_elements) {
  Reader reader(data, max_elements);
  Value v;
  MORIIO_RETURN_IF_ERROR(reader.Read(&v, max_depth));
  if (!reader.AtEnd()) {
    return InvalidArgumentError("malformed msgpack: " + std::to_string(data.size() - reader.pos()) +
                                " trailing bytes");
  }
  return v;
}

Result<const Map*> AsMap(const Value& v, std::string_view what) {
  if (const auto* m = std::get_if<Map>(&v.v)) return m;
  return InvalidArgumentError(Expected(what, "a map"));
}
Result<const Array*> AsArray(const Value& v, std::string_view what) {
  if (const auto* a = std::get_if<Array>(&v.v)) return a;
  return InvalidArgumentError(Expected(what, "an array"));
}
Result<std::string> AsStr(const Value& v, std::string_view what) {
  if (const auto* s = std::get_if<std::string>(&v.v)) return *s;
  return InvalidArgumentError(Expected(what, "a string"));
}
Result<Bytes> AsBin(const Value& v, std::string_view what) {
  if (const auto* b = std::get_if<Bytes>(&v.v)) return *b;
  return InvalidArgumentError(Expected(what, "bytes"));
}
Result<std::uint64_t> AsUInt(const Value& v, std::string_view what) {
  if (const auto* u = std::get_if<std::uint64_t>(&v.v)) return *u;
  return InvalidArgumentError(Expected(what, "a non-negative integer"));
}
Result<std::int64_t> AsInt(const Value& v, std::string_view what) {
  if (const auto* i = std::get_if<std::int64_t>(&v.v)) return *i;
  if (const auto* u = std::get_if<std::uint64_t>(&v.v);
      u && *u <= static_cast<std::uint64_t>(std::numeric_limits<std::int64_t>::max())) {
    return static_cast<std::int64_t>(*u);
  }
  return InvalidArgumentError(Expected(what, "a 64-bit signed integer"));
}
Result<bool> AsBool(const Value& v, std::string_view what) {
  if (const auto* b = std::get_if<bool>(&v.v)) return *b;
  return InvalidArgumentError(Expected(what, "a boolean"));
}
Result<const Value*> Field(const Map& map, std::string_view key, std::string_view what) {
  for (const auto& [k, v] : map) {
    if (k == key) return &v;
  }
  return InvalidArgumentError(std::string(what) + " has no field '" + std::string(key) + "'");
}

}  // namespace moriio_native::detail::msgpack
