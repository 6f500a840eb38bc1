// The process's timing marks (moriio_native/trace_marks.hpp), for gpu_bench --timeline.

#include <pybind11/stl.h>

#include <string>
#include <tuple>
#include <vector>

#include "bindings/common.hpp"
#include "moriio_native/trace_marks.hpp"

namespace py = pybind11;

namespace moriio_native::bindings {

void BindTrace(py::module_& m) {
  m.def("trace_marks_compiled_in", &trace::CompiledIn,
        "True when this build records timing marks (-DMORIIO_NATIVE_TRACE_MARKS=ON).");
  m.def(
      "trace_marks_enable",
      [](std::size_t capacity) { ThrowIfError(trace::Enable(capacity)); },
      py::arg("capacity") = 65536,
      "Clear the process's marks and record up to `capacity` of them until trace_marks_disable.");
  m.def("trace_marks_disable", &trace::Disable, "Stop recording marks (the recorded ones stay).");
  m.def(
      "trace_marks_take",
      [] {
        trace::Taken taken = trace::Take();
        std::vector<std::tuple<std::string, std::int64_t, std::uint64_t, std::uint32_t>> out;
        out.reserve(taken.stamps.size());
        for (const trace::Stamp& s : taken.stamps) {
          out.emplace_back(std::string(trace::MarkName(s.mark)), s.ns, s.token, s.thread);
        }
        return std::make_tuple(std::move(out), taken.dropped);
      },
      "The marks since enable or the last take as (name, monotonic ns, batch token, thread) in "
      "recording order, and how many were dropped for lack of capacity.");
}

}  // namespace moriio_native::bindings
