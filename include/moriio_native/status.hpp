#pragma once

/// Status / Result<T>: the error model of the whole public C++ API.
///
/// No exception crosses the public API. A Status is cheap when OK (one null pointer) and records
/// the code, a message and the source location where it was raised when it is not.

#include <cstdint>
#include <memory>
#include <optional>
#include <source_location>
#include <string>
#include <string_view>
#include <utility>
#include <variant>

namespace moriio_native {

/// Error codes. Each maps to one Python exception class (see python/moriio_native/errors.py).
enum class StatusCode : std::uint8_t {
  kOk = 0,
  kInvalidArgument,     ///< the caller passed something wrong; nothing changed
  kNotFound,            ///< a named thing (layer, peer, transfer) does not exist
  kAlreadyExists,       ///< a named thing exists already
  kFailedPrecondition,  ///< the object is not in a state that allows the call
  kOutOfRange,          ///< an index (block id, offset) lies outside its valid range
  kIncompatible,        ///< a peer's layout or version does not match ours
  kBackendUnavailable,  ///< a transport backend cannot be loaded on this machine
  kTransport,           ///< the transport reported an error
  kTimeout,             ///< a deadline passed
  kAborted,             ///< the operation was aborted
  kInternal,            ///< a bug: an invariant did not hold
};

/// Name of a code, e.g. "InvalidArgument". Thread-safe, never blocks.
std::string_view StatusCodeName(StatusCode code);

/// Outcome of an operation. Move-only-cheap, copyable; thread-compatible (not shared mutable).
class [[nodiscard]] Status {
 public:
  /// The OK status.
  Status() = default;
  Status(StatusCode code, std::string message,
         std::source_location where = std::source_location::current());

  Status(const Status& other);
  Status& operator=(const Status& other);
  Status(Status&&) noexcept = default;
  Status& operator=(Status&&) noexcept = default;
  ~Status() = default;

  static Status OK() { return Status(); }

  bool ok() const { return state_ == nullptr; }
  StatusCode code() const { return state_ ? state_->code : StatusCode::kOk; }
  /// The message alone ("" when OK).
  const std::string& message() const;
  /// "Code: message" ("OK" when OK).
  std::string ToString() const;
  /// "file:line" where the error was raised ("" when OK).
  std::string Location() const;

  /// A copy whose message is prefixed with `context + ": "`; OK stays OK.
  Status WithContext(std::string_view context) const;

 private:
  struct State {
    StatusCode code;
    std::string message;
    std::source_location where;
  };
  std::unique_ptr<State> state_;
};

#define MORIIO_STATUS_FACTORY(Name)                                                        \
  inline Status Name##Error(std::string message,                                           \
                            std::source_location where = std::source_location::current()) { \
    return Status(StatusCode::k##Name, std::move(message), where);                         \
  }
MORIIO_STATUS_FACTORY(InvalidArgument)
MORIIO_STATUS_FACTORY(NotFound)
MORIIO_STATUS_FACTORY(AlreadyExists)
MORIIO_STATUS_FACTORY(FailedPrecondition)
MORIIO_STATUS_FACTORY(OutOfRange)
MORIIO_STATUS_FACTORY(Incompatible)
MORIIO_STATUS_FACTORY(BackendUnavailable)
MORIIO_STATUS_FACTORY(Transport)
MORIIO_STATUS_FACTORY(Timeout)
MORIIO_STATUS_FACTORY(Aborted)
MORIIO_STATUS_FACTORY(Internal)
#undef MORIIO_STATUS_FACTORY

/// A value or an error Status. Holding an OK Status is a bug (checked).
template <typename T>
class [[nodiscard]] Result {
 public:
  Result(T v) : data_(std::move(v)) {}  // NOLINT(google-explicit-constructor)
  Result(Status status);                       // NOLINT(google-explicit-constructor)

  bool ok() const { return std::holds_alternative<T>(data_); }
  /// The error, or OK.
  Status status() const { return ok() ? Status::OK() : std::get<Status>(data_); }

  /// The value; aborts with the error message when there is none.
  T& value() &;
  const T& value() const&;
  T&& value() &&;

  T& operator*() & { return value(); }
  const T& operator*() const& { return value(); }
  T* operator->() { return &value(); }
  const T* operator->() const { return &value(); }

 private:
  std::variant<T, Status> data_;
};

namespace detail {
[[noreturn]] void CheckFailed(const char* expr, std::string_view message,
                              std::source_location where = std::source_location::current());
}  // namespace detail

template <typename T>
Result<T>::Result(Status status) : data_(std::move(status)) {
  if (std::get<Status>(data_).ok()) {
    detail::CheckFailed("!status.ok()", "Result constructed from an OK Status");
  }
}

template <typename T>
T& Result<T>::value() & {
  if (!ok()) detail::CheckFailed("result.ok()", std::get<Status>(data_).ToString());
  return std::get<T>(data_);
}
template <typename T>
const T& Result<T>::value() const& {
  if (!ok()) detail::CheckFailed("result.ok()", std::get<Status>(data_).ToString());
  return std::get<T>(data_);
}
template <typename T>
T&& Result<T>::value() && {
  if (!ok()) detail::CheckFailed("result.ok()", std::get<Status>(data_).ToString());
  return std::move(std::get<T>(data_));
}

}  // namespace moriio_native

#define MORIIO_CONCAT_INNER(a, b) a##b
#define MORIIO_CONCAT(a, b) MORIIO_CONCAT_INNER(a, b)

/// Returns the Status of `expr` from the enclosing function when it is not OK.
#define MORIIO_RETURN_IF_ERROR(expr)                      \
  do {                                                    \
    ::moriio_native::Status _moriio_st = (expr);          \
    if (!_moriio_st.ok()) return _moriio_st;              \
  } while (false)

#define MORIIO_ASSIGN_OR_RETURN_IMPL(tmp, lhs, expr) \
  auto tmp = (expr);                                 \
  if (!tmp.ok()) return tmp.status();                \
  lhs = std::move(tmp).value()

/// `MORIIO_ASSIGN_OR_RETURN(auto x, MakeX());` declares x from a Result or returns its error.
#define MORIIO_ASSIGN_OR_RETURN(lhs, expr) \
  MORIIO_ASSIGN_OR_RETURN_IMPL(MORIIO_CONCAT(_moriio_result_, __LINE__), lhs, expr)

/// Always-on invariant check: aborts with a message (never compiled out, unlike assert).
#define MORIIO_CHECK(cond, message)                                   \
  do {                                                                \
    if (!(cond)) ::moriio_native::detail::CheckFailed(#cond, (message)); \
  } while (false)
