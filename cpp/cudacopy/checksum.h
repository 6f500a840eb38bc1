#pragma once

// checksum_blocks of cudacopy_abi.h (checksum.cu), for the plugin's API table in cudacopy.cu.

#include <stddef.h>
#include <stdint.h>

#include "cudacopy_abi.h"

namespace moriio_cudacopy {

int ChecksumBlocks(int device, uint64_t stream, const moriio_cudacopy_checksum_layer* layers,
                   uint32_t num_layers, const int64_t* block_ids, uint64_t num_ids, uint64_t* out,
                   char* err, size_t err_len);

}  // namespace moriio_cudacopy
