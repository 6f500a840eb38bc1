#include "moriio_native/status.hpp"

#include <cstdio>
#include <cstdlib>

namespace moriio_native {

std::string_view StatusCodeName(StatusCode code) {
  switch (code) {
    case StatusCode::kOk: return "OK";
    case StatusCode::kInvalidArgument: return "InvalidArgument";
    case StatusCode::kNotFound: return "NotFound";
    case StatusCode::kAlreadyExists: return "AlreadyExists";
    case StatusCode::kFailedPrecondition: return "FailedPrecondition";
    case StatusCode::kOutOfRange: return "OutOfRange";
    case StatusCode::kIncompatible: return "Incompatible";
    case StatusCode::kBackendUnavailable: return "BackendUnavailable";
    case StatusCode::kTransport: return "Transport";
    case StatusCode::kTimeout: return "Timeout";
    case StatusCode::kAborted: return "Aborted";
    case StatusCode::kInternal: return "Internal";
  }
  return "Unknown";
}

Status::Status(StatusCode code, std::string message, std::source_location where) {
  // An "error" with code OK would be indistinguishable from success: treat it as a bug.
  if (code == StatusCode::kOk) detail::CheckFailed("code != kOk", "error Status with code OK", where);
  state_ = std::make_unique<State>(State{code, std::move(message), where});
}

Status::Status(const Status& other)
    : state_(other.state_ ? std::make_unique<State>(*other.state_) : nullptr) {}

Status& Status::operator=(const Status& other) {
  if (this != &other) state_ = other.state_ ? std::make_unique<State>(*other.state_) : nullptr;
  return *this;
}

const std::string& Status::message() const {
  static const std::string kEmpty;
  return state_ ? state_->message : kEmpty;
}

std::string Status::ToString() const {
  if (ok()) return "OK";
  return std::string(StatusCodeName(state_->code)) + ": " + state_->message;
}

std::string Status::Location() const {
  if (ok()) return "";
  return std::string(state_->where.file_name()) + ":" + std::to_string(state_->where.line());
}

Status Status::WithContext(std::string_view context) const {
  if (ok()) return *this;
  return Status(state_->code, std::string(context) + ": " + state_->message, state_->where);
}

namespace detail {
void CheckFailed(const char* expr, std::string_view message, std::source_location where) {
  std::fprintf(stderr, "moriio_native: check failed at %s:%u: %s: %.*s\n", where.file_name(),
               static_cast<unsigned>(where.line()), expr, static_cast<int>(message.size()),
               message.data());
  std::fflush(stderr);
  std::abort();
}
}  // namespace detail

}  // namespace moriio_native
