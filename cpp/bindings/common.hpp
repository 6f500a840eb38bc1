#pragma once

// Glue shared by the binding files: Status -> Python exception, and the per-area entry points.

#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>

#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

#include "moriio_native/layout.hpp"
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

/// Block ids from any 1-D integer sequence or array, copied (the ids validated are the ids
/// used, whatever another thread does to the caller's array). Non-integer input is refused
/// rather than truncated. Call with the GIL held.
inline std::vector<std::int64_t> BlockIds(const pybind11::handle& ids, const char* what) {
  namespace py = pybind11;
  py::array array = py::array::ensure(ids);
  if (!array || array.ndim() != 1) {
    throw StatusError(InvalidArgumentError(std::string(what) +
                                           " must be a one-dimensional sequence of integers"));
  }
  const char kind = array.dtype().kind();
  if (array.size() > 0 && kind != 'i' && kind != 'u') {
    throw StatusError(InvalidArgumentError(std::string(what) + " must be integers, got dtype " +
                                           py::str(array.dtype()).cast<std::string>()));
  }
  auto ints = py::array_t<std::int64_t, py::array::c_style | py::array::forcecast>::ensure(array);
  return std::vector<std::int64_t>(ints.data(), ints.data() + ints.size());
}

/// "auto" | "separated" | "interleaved" (the Python spelling of KvPlaneAxis).
inline KvPlaneAxis ParsePlaneAxis(const std::string& axis) {
  if (axis == "auto") return KvPlaneAxis::kAuto;
  if (axis == "separated") return KvPlaneAxis::kSeparated;
  if (axis == "interleaved") return KvPlaneAxis::kInterleaved;
  throw StatusError(InvalidArgumentError(
      "kv_plane_axis must be 'auto', 'separated' or 'interleaved', got '" + axis + "'"));
}

void RegisterErrors(pybind11::module_& m);
void BindLayout(pybind11::module_& m);
void BindMemory(pybind11::module_& m);
void BindEngine(pybind11::module_& m);

}  // namespace moriio_native::bindings
