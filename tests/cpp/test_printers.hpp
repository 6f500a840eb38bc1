#pragma once

// Readable gtest messages for the engine's enums (gtest finds PrintTo by argument-dependent
// lookup, so these live in the enums' namespace).

#include <ostream>

#include "moriio_native/engine.hpp"
#include "moriio_native/status.hpp"

namespace moriio_native {
inline void PrintTo(StatusCode code, std::ostream* os) { *os << StatusCodeName(code); }
inline void PrintTo(TransferState state, std::ostream* os) { *os << TransferStateName(state); }
}  // namespace moriio_native
