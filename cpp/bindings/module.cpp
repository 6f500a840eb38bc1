#include "bindings/common.hpp"

namespace py = pybind11;

namespace moriio_native::bindings {

void RegisterErrors(py::module_& m) {
  py::register_exception_translator([](std::exception_ptr p) {
    try {
      if (p) std::rethrow_exception(p);
    } catch (const StatusError& e) {
      // The classes live in Python (errors.py) so they can inherit builtins and be documented.
      py::object cls = py::module_::import("moriio_native.errors")
                           .attr("error_class_for")(std::string(StatusCodeName(e.status().code())));
      PyErr_SetString(cls.ptr(), e.status().message().c_str());
    }
  });
  m.def("_raise_status", [](const std::string& code, const std::string& message) {
    for (int c = 1; c <= static_cast<int>(StatusCode::kInternal); ++c) {
      auto sc = static_cast<StatusCode>(c);
      if (StatusCodeName(sc) == code) throw StatusError(Status(sc, message));
    }
    throw StatusError(InvalidArgumentError("unknown status code " + code));
  }, "Raise the exception of a status code (for testing the error mapping).");
}

}  // namespace moriio_native::bindings

PYBIND11_MODULE(_native, m) {
  m.doc() = "moriio_native native core (private; use the moriio_native package)";
  moriio_native::bindings::RegisterErrors(m);
  moriio_native::bindings::BindLayout(m);
  moriio_native::bindings::BindMemory(m);
  moriio_native::bindings::BindEngine(m);
  moriio_native::bindings::BindChecksum(m);
  moriio_native::bindings::BindTrace(m);
}
