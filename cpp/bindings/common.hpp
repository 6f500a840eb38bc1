#pragma once

// Glue shared by the binding files: Status -> Python exception, and the per-area entry points.

#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>

#include <exception>
#include <limits>
#include <optional>
#include <stdexcept>
#include <string>
#include <tuple>
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

/// Runs `fn` (pure C++: it touches no Python object) with the GIL released and returns its
/// result. Not pybind11's gil_scoped_release: CPython ends a daemon thread that takes the GIL
/// back while the interpreter finalizes with pthread_exit, whose unwinding must not start in a
/// destructor (destructors are noexcept: std::terminate aborted the process at exit whenever a
/// daemon thread was inside such a call, e.g. one polling events). Here it starts in ordinary
/// code and unwinds the thread's stack, which pybind11 lets pass.
template <typename Fn>
auto WithoutGil(Fn&& fn) -> decltype(fn()) {
  PyThreadState* state = PyEval_SaveThread();
  std::exception_ptr error;
  std::optional<decltype(fn())> result;
  try {
    result.emplace(fn());
  } catch (...) {
    error = std::current_exception();
  }
  PyEval_RestoreThread(state);  // may end this thread (see above): after `fn`, not in a destructor
  if (error) std::rethrow_exception(error);
  return std::move(*result);
}

template <typename T>
T Unwrap(Result<T> result) {
  if (!result.ok()) throw StatusError(result.status());
  return std::move(result).value();
}

inline StatusError IdOutOfRange(const char* what, const std::string& id, std::size_t position) {
  return StatusError(OutOfRangeError(std::string(what) + ": block id " + id + " at position " +
                                     std::to_string(position) +
                                     " is out of range (block ids are below 2^63)"));
}

/// `value` as a Python int, through __index__ (any integer type, numpy's too); None for a bool,
/// which pybind11's integer casters take as 0 or 1 (bool is an int to Python), and for anything
/// else that is not an integer (a numpy array's __index__ refuses all but integer scalars with
/// a TypeError). Errors other than that TypeError propagate. Call with the GIL held.
inline std::optional<pybind11::object> IntegerIndex(const pybind11::handle& value) {
  namespace py = pybind11;
  if (PyBool_Check(value.ptr()) || !PyIndex_Check(value.ptr())) return std::nullopt;
  auto index = py::reinterpret_steal<py::object>(PyNumber_Index(value.ptr()));
  if (index) return index;
  if (!PyErr_ExceptionMatches(PyExc_TypeError)) throw py::error_already_set();
  PyErr_Clear();
  return std::nullopt;
}

/// An integer argument (IntegerIndex) that fits int64; InvalidArgument naming `what` otherwise.
inline std::int64_t StrictInt(const pybind11::handle& value, const std::string& what) {
  namespace py = pybind11;
  auto refuse = [&](const char* expected) {
    return StatusError(InvalidArgumentError(what + " must be " + expected + ", got " +
                                            py::repr(value).cast<std::string>()));
  };
  const std::optional<py::object> index = IntegerIndex(value);
  if (!index) throw refuse("an integer");
  int overflow = 0;
  const long long v = PyLong_AsLongLongAndOverflow(index->ptr(), &overflow);
  if (overflow != 0) throw refuse("an integer that fits 64 bits");
  return v;
}

/// An unsigned 64-bit argument (an address): StrictInt's rules over [0, 2^64).
inline std::uint64_t StrictUint64(const pybind11::handle& value, const std::string& what) {
  namespace py = pybind11;
  const std::optional<py::object> index = IntegerIndex(value);
  if (!index) {
    throw StatusError(InvalidArgumentError(what + " must be an integer, got " +
                                           py::repr(value).cast<std::string>()));
  }
  const unsigned long long v = PyLong_AsUnsignedLongLong(index->ptr());
  if (v == static_cast<unsigned long long>(-1) && PyErr_Occurred()) {
    PyErr_Clear();
    throw StatusError(InvalidArgumentError(what + " must be an integer in [0, 2^64), got " +
                                           py::repr(value).cast<std::string>()));
  }
  return v;
}

/// StrictInt, or nothing for None.
inline std::optional<std::int64_t> OptionalStrictInt(const pybind11::handle& value,
                                                     const std::string& what) {
  if (value.is_none()) return std::nullopt;
  return StrictInt(value, what);
}

/// StrictInt of every item of a sequence (a list, a tuple, a 1-D array), named `what`[i].
inline std::vector<std::int64_t> StrictInts(const pybind11::handle& values,
                                            const std::string& what) {
  namespace py = pybind11;
  if (!PySequence_Check(values.ptr()) || PyUnicode_Check(values.ptr()) ||
      PyBytes_Check(values.ptr())) {
    throw StatusError(InvalidArgumentError(what + " must be a sequence of integers, got " +
                                           py::repr(values).cast<std::string>()));
  }
  const auto items = py::reinterpret_borrow<py::sequence>(values);
  std::vector<std::int64_t> out;
  out.reserve(items.size());
  for (std::size_t i = 0; i < items.size(); ++i) {
    out.push_back(StrictInt(items[i], what + "[" + std::to_string(i) + "]"));
  }
  return out;
}

/// A CellWindow as Python passes it: (head_begin, heads or None, token_begin, tokens or None),
/// each field a StrictInt; `what` names the window in errors.
inline CellWindow ToCellWindow(const pybind11::handle& window, const std::string& what) {
  namespace py = pybind11;
  if (!PyTuple_Check(window.ptr()) || PyTuple_GET_SIZE(window.ptr()) != 4) {
    throw StatusError(InvalidArgumentError(
        what + " must be a tuple (head_begin, heads or None, token_begin, tokens or None), got " +
        py::repr(window).cast<std::string>()));
  }
  const auto t = py::reinterpret_borrow<py::tuple>(window);
  return CellWindow{StrictInt(t[0], what + ".head_begin"), OptionalStrictInt(t[1], what + ".heads"),
                    StrictInt(t[2], what + ".token_begin"),
                    OptionalStrictInt(t[3], what + ".tokens")};
}

/// Block ids from any 1-D integer sequence or array, copied (the ids validated are the ids
/// used, whatever another thread does to the caller's array). Non-integer input is refused
/// rather than truncated, and an id past int64 is OutOfRange naming it (never wrapped into a
/// "negative" one). Call with the GIL held.
inline std::vector<std::int64_t> BlockIds(const pybind11::handle& ids, const char* what) {
  namespace py = pybind11;
  if (PyList_Check(ids.ptr()) || PyTuple_Check(ids.ptr())) {
    // Element by element: numpy would store a list mixing small ids with one past int64 as
    // float64, hiding which id was wrong.
    // The size and each item are read afresh, the item held: an __index__ written in Python
    // may change the list while we walk it.
    std::vector<std::int64_t> out;
    out.reserve(static_cast<std::size_t>(PySequence_Fast_GET_SIZE(ids.ptr())));
    for (Py_ssize_t i = 0; i < PySequence_Fast_GET_SIZE(ids.ptr()); ++i) {
      const auto item = py::reinterpret_borrow<py::object>(PySequence_Fast_GET_ITEM(ids.ptr(), i));
      const std::optional<py::object> index = IntegerIndex(item);
      if (!index) {
        throw StatusError(InvalidArgumentError(
            std::string(what) + " must be integers, got " + Py_TYPE(item.ptr())->tp_name +
            " at position " + std::to_string(i)));
      }
      int overflow = 0;
      const long long v = PyLong_AsLongLongAndOverflow(index->ptr(), &overflow);
      if (overflow != 0) {
        throw IdOutOfRange(what, py::str(*index).cast<std::string>(), static_cast<std::size_t>(i));
      }
      if (v == -1 && PyErr_Occurred()) throw py::error_already_set();
      out.push_back(v);
    }
    return out;
  }
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
  if (kind == 'u' && array.itemsize() == sizeof(std::uint64_t)) {
    // The int64 cast below would wrap these into "negative" ids.
    auto wide = py::array_t<std::uint64_t, py::array::c_style | py::array::forcecast>::ensure(array);
    constexpr auto kMax = static_cast<std::uint64_t>(std::numeric_limits<std::int64_t>::max());
    for (py::ssize_t i = 0; i < wide.size(); ++i) {
      if (wide.data()[i] > kMax) {
        throw IdOutOfRange(what, std::to_string(wide.data()[i]), static_cast<std::size_t>(i));
      }
    }
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
void BindChecksum(pybind11::module_& m);
void BindTrace(pybind11::module_& m);

}  // namespace moriio_native::bindings
