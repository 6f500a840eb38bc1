#pragma once

// Glue shared by the binding files: Status -> Python exception, and the per-area entry points.

#include <pybind11/pybind11.h>

#include <stdexcept>
#include <utility>

#include "moriio_native/status.hpp"

namespace moriio_native::bindings {

/// Carries a Status across pybind11's exception translation.
class StatusError : public std::exception {
 public:
  explicit StatusError(Status status) : status_(std::move(status)) {}
  const char* what() const noexcept override { return status_.message().c_str(); }
  const Status& status() const { return status_; }

 private:
  Status status_;
};

inline void ThrowIfError(const Status& status) {
  if (!status.ok()) throw StatusError(status);
}

template <typename T>
T Unwrap(Result<T> result) {
  if (!result.ok()) throw StatusError(result.status());
  return std::move(result).value();
}

void RegisterErrors(pybind11::module_& m);
void BindLayout(pybind11::module_& m);
void BindMemory(pybind11::module_& m);
void BindEngine(pybind11::module_& m);

}  // namespace moriio_native::bindings
