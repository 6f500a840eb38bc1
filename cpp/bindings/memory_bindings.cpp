#include <pybind11/stl.h>

#include "bindings/common.hpp"
#include "moriio_native/memory.hpp"

namespace py = pybind11;

namespace moriio_native::bindings {

void BindMemory(py::module_& m) {
  py::class_<RegistrationPlan>(m, "RegistrationPlan", "Regions to register and where each view lands.")
      .def_property_readonly("regions", [](const RegistrationPlan& p) {
        py::list out;
        for (const PlannedRegion& r : p.regions) out.append(py::make_tuple(r.start, r.size, r.aligned));
        return out;
      }, "List of (start, size, aligned).")
      .def_property_readonly("placements", [](const RegistrationPlan& p) {
        py::list out;
        for (const Placement& pl : p.placements) out.append(py::make_tuple(pl.region, pl.offset));
        return out;
      }, "For each input view, in order: (region_index, offset_in_region).")
      .def("__repr__", [](const RegistrationPlan& p) {
        return "RegistrationPlan(regions=" + std::to_string(p.regions.size()) + ")";
      });

  m.def("plan_registration",
        [](std::uint64_t base, std::uint64_t size, const std::vector<std::pair<std::uint64_t, std::uint64_t>>& regions,
           std::uint64_t page_size, bool allow_unaligned) {
          std::vector<ViewRange> views;
          views.reserve(regions.size());
          for (const auto& [ptr, nbytes] : regions) views.push_back({ptr, nbytes});
          return Unwrap(PlanRegistration(base, size, views, page_size, allow_unaligned));
        },
        py::arg("allocation_base"), py::arg("allocation_size"), py::arg("regions"),
        py::arg("page_size") = 4096, py::arg("allow_unaligned") = true,
        "Plan one memory region for views (ptr, nbytes) that share one allocation.");
}

}  // namespace moriio_native::bindings
