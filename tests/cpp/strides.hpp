#pragma once

// Row-major strides for the layout tests' tensors.

#include <cstdint>
#include <vector>

namespace moriio_native::test_support {

/// Row-major (contiguous) strides of `shape`, in elements.
inline std::vector<std::int64_t> Contiguous(const std::vector<std::int64_t>& shape) {
  std::vector<std::int64_t> strides(shape.size());
  std::int64_t s = 1;
  for (std::size_t i = shape.size(); i-- > 0;) {
    strides[i] = s;
    s *= shape[i];
  }
  return strides;
}

}  // namespace moriio_native::test_support
