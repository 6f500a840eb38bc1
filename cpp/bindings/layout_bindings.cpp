#include <pybind11/numpy.h>
#include <pybind11/stl.h>

#include <algorithm>
#include <functional>
#include <optional>

#include "bindings/common.hpp"
#include "moriio_native/layout.hpp"

namespace py = pybind11;

namespace moriio_native::bindings {
namespace {


CacheKind ParseKind(const std::string& kind) {
  if (kind == "kv") return CacheKind::kKeyValue;
  if (kind == "mla") return CacheKind::kLatent;
  throw StatusError(InvalidArgumentError("CacheSpec.kind must be 'kv' or 'mla', got '" + kind + "'"));
}

std::string KindName(CacheKind kind) { return kind == CacheKind::kKeyValue ? "kv" : "mla"; }

AxisOrder ParseAxisOrder(const std::string& order) {
  if (order == "auto") return AxisOrder::kAuto;
  if (order == "nhd") return AxisOrder::kNhd;
  if (order == "hnd") return AxisOrder::kHnd;
  throw StatusError(InvalidArgumentError(
      "CacheSpec.axis_order must be 'auto', 'nhd' (tokens before heads in the shape) or 'hnd' "
      "(heads before tokens), got '" + order + "'"));
}

// A CacheSpec count (StrictInt: a bool is refused, naming the field).
std::int64_t SpecInt(const py::handle& value, const char* field) {
  return StrictInt(value, std::string("CacheSpec.") + field);
}

std::optional<std::int64_t> OptionalSpecInt(const py::handle& value, const char* field) {
  return OptionalStrictInt(value, std::string("CacheSpec.") + field);
}

// A view of one of the plan's arrays that keeps the plan object alive.
py::array_t<std::int64_t> PlanArray(const py::object& owner, const std::vector<std::int64_t>& v) {
  return py::array_t<std::int64_t>({static_cast<py::ssize_t>(v.size())}, {sizeof(std::int64_t)},
                                   v.data(), owner);
}

py::dict ParamsDict(const LayoutParams& p) {
  py::dict d;
  d["kind"] = KindName(p.kind);
  d["num_blocks"] = p.num_blocks;
  d["block_size"] = p.block_size;
  d["kernel_block_size"] = p.kernel_block_size;
  d["num_heads"] = p.num_heads;
  d["dtype_bytes"] = p.dtype_bytes;
  d["block_stride"] = p.block_stride;
  d["kernel_block_stride"] = p.kernel_block_stride;
  d["head_stride"] = p.head_stride;
  d["token_stride"] = p.token_stride;
  d["plane_offset"] = py::make_tuple(p.plane_offset[0], p.plane_offset[1]);
  d["plane_bytes"] = py::make_tuple(p.plane_bytes[0], p.plane_bytes[1]);
  return d;
}

py::dict CellSideDict(const CellSide& s) {
  py::dict d;
  d["block_stride"] = s.block_stride;
  d["plane_stride"] = s.plane_stride;
  d["head_stride"] = s.head_stride;
  d["token_stride"] = s.token_stride;
  return d;
}

py::object CellGeometryDict(const std::optional<CellGeometry>& g) {
  if (!g) return py::none();
  py::dict d;
  d["planes"] = g->planes;
  d["heads"] = g->heads;
  d["tokens"] = g->tokens;
  d["cell_bytes"] = g->cell_bytes;
  d["local"] = CellSideDict(g->local);
  d["remote"] = CellSideDict(g->remote);
  return d;
}

py::array_t<std::int64_t> Int64Array(const std::vector<std::int64_t>& v) {
  py::array_t<std::int64_t> out(static_cast<py::ssize_t>(v.size()));
  std::copy(v.begin(), v.end(), out.mutable_data());
  return out;
}

std::size_t HashLayout(const LayerLayout& l) {
  std::size_t h = std::hash<std::string>{}(l.name());
  const LayoutParams& p = l.params();
  for (std::int64_t v : {p.num_blocks, p.block_stride, p.kernel_block_stride, p.head_stride,
                         p.token_stride, p.plane_offset[1], static_cast<std::int64_t>(l.LogicalFingerprint())}) {
    h = h * 1000003u ^ std::hash<std::int64_t>{}(v);
  }
  return h;
}

}  // namespace

void BindLayout(py::module_& m) {
  py::class_<CacheSpec>(m, "CacheSpec", "Logical description of one layer's KV cache.")
      .def(py::init([](const std::string& kind, const py::object& block_size,
                       const py::object& num_kv_heads, const py::object& head_size,
                       const py::object& dtype_bytes, const py::object& head_size_v,
                       const std::string& axis_order) {
             CacheSpec s{ParseKind(kind),
                         SpecInt(block_size, "block_size"),
                         OptionalSpecInt(num_kv_heads, "num_kv_heads"),
                         OptionalSpecInt(head_size, "head_size"),
                         SpecInt(dtype_bytes, "dtype_bytes"),
                         OptionalSpecInt(head_size_v, "head_size_v"),
                         ParseAxisOrder(axis_order)};
             ThrowIfError(s.Validate());
             return s;
           }),
           py::kw_only(), py::arg("kind") = "kv", py::arg("block_size"),
           py::arg("num_kv_heads") = py::none(), py::arg("head_size") = py::none(),
           py::arg("dtype_bytes"), py::arg("head_size_v") = py::none(),
           py::arg("axis_order") = "auto")
      .def_property_readonly("kind", [](const CacheSpec& s) { return KindName(s.kind); })
      .def_readonly("block_size", &CacheSpec::block_size)
      .def_readonly("num_kv_heads", &CacheSpec::num_kv_heads)
      .def_readonly("head_size", &CacheSpec::head_size)
      .def_readonly("dtype_bytes", &CacheSpec::dtype_bytes)
      .def_readonly("head_size_v", &CacheSpec::head_size_v)
      .def_property_readonly("axis_order",
                             [](const CacheSpec& s) { return std::string(AxisOrderName(s.axis_order)); })
      .def("__repr__", [](const CacheSpec& s) {
        auto opt = [](const std::optional<std::int64_t>& v) {
          return v ? std::to_string(*v) : std::string("None");
        };
        return "CacheSpec(kind='" + KindName(s.kind) + "', block_size=" + std::to_string(s.block_size) +
               ", num_kv_heads=" + opt(s.num_kv_heads) + ", head_size=" + opt(s.head_size) +
               ", dtype_bytes=" + std::to_string(s.dtype_bytes) + ", head_size_v=" + opt(s.head_size_v) +
               ", axis_order='" + std::string(AxisOrderName(s.axis_order)) + "')";
      });

  py::class_<TensorGeometry>(m, "TensorGeometry", "Shape and strides (in elements) of a tensor.")
      .def(py::init([](const py::object& shape, const py::object& strides,
                       const py::object& element_size, const py::object& data_ptr) {
             const std::uint64_t ptr = StrictUint64(data_ptr, "TensorGeometry.data_ptr");
             return TensorGeometry{StrictInts(shape, "TensorGeometry.shape"),
                                   StrictInts(strides, "TensorGeometry.strides"),
                                   StrictInt(element_size, "TensorGeometry.element_size"), ptr};
           }),
           py::arg("shape"), py::arg("strides"), py::arg("element_size"), py::arg("data_ptr") = 0)
      .def_readonly("shape", &TensorGeometry::shape)
      .def_readonly("strides", &TensorGeometry::strides)
      .def_readonly("element_size", &TensorGeometry::element_size)
      .def_readonly("data_ptr", &TensorGeometry::data_ptr)
      .def("__repr__", [](const TensorGeometry& g) {
        return "TensorGeometry(shape=" + py::repr(py::cast(g.shape)).cast<std::string>() +
               ", strides=" + py::repr(py::cast(g.strides)).cast<std::string>() +
               ", element_size=" + std::to_string(g.element_size) + ")";
      });

  py::class_<LayerLayout>(m, "LayerLayout", "A validated layer layout (immutable).")
      .def_property_readonly("name", &LayerLayout::name)
      .def_property_readonly("kind", [](const LayerLayout& l) { return KindName(l.kind()); })
      .def_property_readonly("num_blocks", &LayerLayout::num_blocks)
      .def_property_readonly("block_size", &LayerLayout::block_size)
      .def_property_readonly("num_heads", &LayerLayout::num_heads)
      .def_property_readonly("block_stride", &LayerLayout::block_stride)
      .def_property_readonly("block_bytes", &LayerLayout::block_bytes)
      .def_property_readonly("span_bytes", &LayerLayout::span_bytes)
      .def_property_readonly("fingerprint", &LayerLayout::LogicalFingerprint)
      .def_property_readonly("params", [](const LayerLayout& l) { return ParamsDict(l.params()); })
      .def("describe", &LayerLayout::DescribeLogical)
      .def("__eq__", [](const LayerLayout& a, const LayerLayout& b) {
        return a.name() == b.name() && a.params() == b.params();
      })
      .def("__hash__", &HashLayout)
      .def("__repr__", [](const LayerLayout& l) {
        return "LayerLayout('" + l.name() + "', " + l.DescribeLogical() +
               " num_blocks=" + std::to_string(l.num_blocks()) +
               " block_stride=" + std::to_string(l.block_stride()) + ")";
      });

  m.def("_describe_layer",
        [](std::string name, const TensorGeometry& g, const CacheSpec& spec, const std::string& axis) {
          return Unwrap(DescribeLayer(std::move(name), g, spec, ParsePlaneAxis(axis)));
        },
        py::arg("name"), py::arg("geometry"), py::arg("spec"), py::arg("kv_plane_axis") = "auto");

  py::class_<CopyPlan, std::shared_ptr<CopyPlan>>(m, "CopyPlan",
                                                  "Runs sorted by local offset (bytes from each layer base).")
      .def_property_readonly("local_offsets",
                             [](py::object self) { return PlanArray(self, self.cast<CopyPlan&>().local_offsets); })
      .def_property_readonly("remote_offsets",
                             [](py::object self) { return PlanArray(self, self.cast<CopyPlan&>().remote_offsets); })
      .def_property_readonly("sizes",
                             [](py::object self) { return PlanArray(self, self.cast<CopyPlan&>().sizes); })
      .def_property_readonly("total_bytes", &CopyPlan::total_bytes)
      .def("__len__", &CopyPlan::size)
      .def("runs", [](const CopyPlan& p) {
        py::list out;
        for (std::size_t i = 0; i < p.size(); ++i) {
          out.append(py::make_tuple(p.local_offsets[i], p.remote_offsets[i], p.sizes[i]));
        }
        return out;
      }, "The runs as a list of (local_offset, remote_offset, size) tuples.")
      .def("__repr__", [](const CopyPlan& p) {
        return "CopyPlan(runs=" + std::to_string(p.size()) + ", bytes=" + std::to_string(p.total_bytes()) + ")";
      });

  py::class_<BlockPairs>(m, "BlockPairs",
                         "A request's (local, remote) block pairs, validated and sorted once.")
      .def(py::init([](const py::object& local_ids, const py::object& remote_ids) {
             return Unwrap(BlockPairs::Create(BlockIds(local_ids, "local_block_ids"), BlockIds(remote_ids, "remote_block_ids")));
           }),
           py::arg("local_block_ids"), py::arg("remote_block_ids"))
      .def("__len__", &BlockPairs::size);

  py::class_<BlockTemplate>(m, "BlockTemplate", "The runs that copy one block of a layer pair.")
      .def(py::init([](const LayerLayout& local, const LayerLayout& remote) {
             return Unwrap(BlockTemplate::Build(local, remote));
           }),
           py::arg("local"), py::arg("remote"))
      .def(py::init([](const LayerLayout& local, const LayerLayout& remote,
                       const py::object& local_window, const py::object& remote_window) {
             return Unwrap(BlockTemplate::Build(local, ToCellWindow(local_window, "local_window"),
                                                remote,
                                                ToCellWindow(remote_window, "remote_window")));
           }),
           py::arg("local"), py::arg("remote"), py::arg("local_window"), py::arg("remote_window"),
           "The runs that copy the cells of local_window of a local block to those of "
           "remote_window of a remote block; each window is (head_begin, heads or None, "
           "token_begin, tokens or None).")
      .def_property_readonly("runs", [](const BlockTemplate& t) {
        py::list out;
        for (const CopyRun& r : t.runs()) out.append(py::make_tuple(r.local, r.remote, r.size));
        return out;
      })
      .def("plan",
           [](const BlockTemplate& t, const py::object& local_ids, const py::object& remote_ids) {
             const auto local = BlockIds(local_ids, "local_block_ids");
             const auto remote = BlockIds(remote_ids, "remote_block_ids");
             auto plan = std::make_shared<CopyPlan>();
             // Pure C++ on arrays this call holds: no Python object is touched.
             const Status st = WithoutGil([&] {
               Result<BlockPairs> pairs = BlockPairs::Create(local, remote);
               return pairs.ok() ? StampBlockCopies(t, *pairs, plan.get()) : pairs.status();
             });
             ThrowIfError(st);
             return plan;
           },
           py::arg("local_block_ids"), py::arg("remote_block_ids"))
      .def("plan",
           [](const BlockTemplate& t, const BlockPairs& pairs) {
             auto plan = std::make_shared<CopyPlan>();
             const Status st = WithoutGil([&] { return StampBlockCopies(t, pairs, plan.get()); });
             ThrowIfError(st);
             return plan;
           },
           py::arg("pairs"), "Plan a request whose pairs were prepared once for all layers.")
      .def_property_readonly(
          "cell_geometry", [](const BlockTemplate& t) { return CellGeometryDict(t.cell_geometry()); },
          "The pair's blocks as one grid of equal cells: {planes, heads, tokens, cell_bytes, "
          "local, remote} (each side {block_stride, plane_stride, head_stride, token_stride}, "
          "bytes), or None when the layouts admit none.")
      .def_property_readonly(
          "cell_origins",
          [](const BlockTemplate& t) {
            return py::make_tuple(t.local_cell_origin(), t.remote_cell_origin());
          },
          "(local, remote): bytes from a block's base to its window's first cell, the shift "
          "block_offsets adds (0 for whole windows).")
      .def_property_readonly("prefers_cell_copy", &BlockTemplate::prefers_cell_copy,
                             "True when the run plan cuts blocks into short runs that a cell "
                             "copy moves whole.")
      .def(
          "block_offsets",
          [](const BlockTemplate& t, const BlockPairs& pairs, std::int64_t local_shift,
             std::int64_t remote_shift) {
            BlockOffsets blocks;
            ThrowIfError(AppendBlockOffsets(t, pairs, local_shift, remote_shift, &blocks));
            return py::make_tuple(Int64Array(blocks.local), Int64Array(blocks.remote));
          },
          py::arg("pairs"), py::arg("local_shift") = 0, py::arg("remote_shift") = 0,
          "(local, remote) int64 arrays: each pair's block byte offsets, in local id order, for a "
          "cell copy.");
}

}  // namespace moriio_native::bindings
