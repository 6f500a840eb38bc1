#include <pybind11/numpy.h>
#include <pybind11/stl.h>

#include <optional>

#include "bindings/common.hpp"
#include "moriio_native/checksum.hpp"

namespace py = pybind11;

namespace moriio_native::bindings {
namespace {

// A C-contiguous buffer view held for the duration of one call (released on every path).
class ContiguousBuffer {
 public:
  explicit ContiguousBuffer(const py::handle& obj) {
    if (PyObject_GetBuffer(obj.ptr(), &view_, PyBUF_C_CONTIGUOUS) != 0) {
      PyErr_Clear();
      throw StatusError(InvalidArgumentError(
          std::string("checksum_blocks: the layer's bytes must be a C-contiguous buffer (a "
                      "numpy array, a memoryview), got ") +
          Py_TYPE(obj.ptr())->tp_name));
    }
  }
  ~ContiguousBuffer() { PyBuffer_Release(&view_); }
  ContiguousBuffer(const ContiguousBuffer&) = delete;
  ContiguousBuffer& operator=(const ContiguousBuffer&) = delete;

  const std::byte* data() const { return static_cast<const std::byte*>(view_.buf); }
  std::int64_t size() const { return static_cast<std::int64_t>(view_.len); }

 private:
  Py_buffer view_{};
};

}  // namespace

void BindChecksum(py::module_& m) {
  m.def(
      "checksum_blocks",
      [](const LayerLayout& layout, const py::object& buffer, const py::object& block_ids,
         std::int64_t head_begin, std::optional<std::int64_t> heads, std::int64_t token_begin,
         std::optional<std::int64_t> tokens) {
        const std::vector<std::int64_t> ids = BlockIds(block_ids, "block_ids");
        const ContiguousBuffer bytes(buffer);
        if (bytes.size() < layout.span_bytes()) {
          throw StatusError(InvalidArgumentError(
              "layer '" + layout.name() + "': checksum_blocks got a buffer of " +
              std::to_string(bytes.size()) + " bytes, the layout spans " +
              std::to_string(layout.span_bytes())));
        }
        const CellWindow window{head_begin, heads, token_begin, tokens};
        Result<std::vector<std::uint64_t>> sums = WithoutGil([&] {
          // Reads only the buffer held above; touches no Python object.
          return ChecksumBlocks(layout, bytes.data(), ids, window);
        });
        const std::vector<std::uint64_t> values = Unwrap(std::move(sums));
        py::array_t<std::uint64_t> out(static_cast<py::ssize_t>(values.size()));
        std::copy(values.begin(), values.end(), out.mutable_data());
        return out;
      },
      py::arg("layout"), py::arg("buffer"), py::arg("block_ids"), py::kw_only(),
      py::arg("head_begin") = 0, py::arg("heads") = py::none(), py::arg("token_begin") = 0,
      py::arg("tokens") = py::none(),
      "One uint64 checksum per block id over the logical cells of the window (heads "
      "[head_begin, head_begin + heads), tokens [token_begin, token_begin + tokens); None: to "
      "the end) of the layer whose bytes start at the buffer's first byte (at least "
      "layout.span_bytes long). See include/moriio_native/checksum.hpp for the definition.");
}

}  // namespace moriio_native::bindings
