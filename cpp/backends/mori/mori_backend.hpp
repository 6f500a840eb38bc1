#pragma once

// The MoRI backend's mapping layer: a moriio_native::Backend on top of the MoriApi seam. It
// turns each Batch into one MoRI session BatchRead/BatchWrite, owns every TransferStatus for as
// long as MoRI may write to it, turns statuses and peer failures into CompletionSink calls, and
// never includes a MoRI header (it is built and unit-tested without MoRI).

#include <chrono>
#include <cstdint>
#include <memory>
#include <string>

#include "backends/mori/mori_api.hpp"
#include "moriio_native/backend.hpp"
#include "moriio_native/status.hpp"

namespace moriio_native::detail::mori_backend {

/// Which MoRI-IO transport the engine creates.
enum class MoriTransport : std::uint8_t { kRdma = 0, kXgmi = 1 };

/// Parsed BackendOptions of the MoRI backend (keys in docs/rocm.md).
struct MoriOptions {
  MoriTransport transport = MoriTransport::kRdma;  ///< "mori_backend": "rdma" | "xgmi"
  int qp_per_transfer = 1;                         ///< "qp_per_transfer" (RDMA)
  int post_batch_size = -1;                        ///< "post_batch_size" (RDMA; -1: MoRI picks)
  int num_workers = 1;                             ///< "num_workers" (RDMA worker threads)
  bool event_poll = false;                         ///< "poll_mode": "polling" | "event"
  bool enable_chunking = false;                    ///< "mori_enable_chunking" (RDMA)
  std::uint64_t chunk_bytes = 65536;               ///< "mori_chunk_bytes"
  int xgmi_streams = 64;                           ///< "mori_xgmi_streams"
  int xgmi_events = 64;                            ///< "mori_xgmi_events"
  std::string xgmi_kernel;                         ///< "mori_xgmi_kernel": scatter/gather .hsaco
  std::string host;        ///< "mori_host": control-plane address peers dial ("" = auto)
  std::uint16_t port = 0;  ///< "mori_port" (0: ephemeral)
  std::string engine_key_prefix = "moriio-native";  ///< "mori_engine_key"
  /// "mori_max_run_bytes": runs longer than this go to MoRI as several consecutive entries
  /// (MoRI rejects single entries of 4 GiB or more).
  std::uint64_t max_run_bytes = std::uint64_t{1} << 30;
  /// "mori_drain_timeout_ms": how long destruction waits for posted batches before it stops
  /// MoRI and completes what is left as Aborted.
  std::chrono::milliseconds drain_timeout{5000};
};

/// Every option key of the MoRI backend (BackendPlugin::options; nullptr-terminated).
inline constexpr const char* kMoriOptionKeys[] = {"mori_backend",
                                                  "qp_per_transfer",
                                                  "post_batch_size",
                                                  "num_workers",
                                                  "poll_mode",
                                                  "mori_host",
                                                  "mori_port",
                                                  "mori_engine_key",
                                                  "mori_max_run_bytes",
                                                  "mori_chunk_bytes",
                                                  "mori_transfer_timeout_ms",
                                                  "mori_drain_timeout_ms",
                                                  "mori_enable_chunking",
                                                  "mori_xgmi_streams",
                                                  "mori_xgmi_events",
                                                  "mori_xgmi_kernel",
                                                  nullptr};

/// Parses and range-checks the keys this backend owns ("mori_*", "qp_per_transfer",
/// "post_batch_size", "num_workers", "poll_mode"); other backends' keys are ignored. An unknown
/// "mori_*" key or a bad value is InvalidArgument naming the key and the value. Pure.
Result<MoriOptions> ParseMoriOptions(const BackendOptions& options);

/// The Status for a terminal MoRI code: OK for SUCCESS, Transport naming the MoRI code, MoRI's
/// message and `context` for anything else. Pure.
Status MoriCodeToStatus(std::uint32_t code, const std::string& mori_message,
                        const std::string& context);

/// Creates the backend over `api` (which it owns and destroys before freeing any status).
/// Starts two threads: one posts batches to MoRI (session setup may block on the network), one
/// polls statuses and MoRI's peer failures and calls `sink`. Every sink call comes from the
/// polling thread, or from the destructor for batches still open then (after MoRI is stopped), so
/// the sink may call back into the backend — but must not destroy it.
///
/// A posted batch completes when MoRI's status is terminal (SUCCESS -> OK, failure ->
/// Transport), after DisconnectPeer once MoRI is done with it (Aborted), or at destruction after
/// the drain timeout (Aborted, reported after MoRI stopped); no deadline ends it (see
/// mori_transfer_timeout_ms in ParseMoriOptions).
/// No status is freed before `api` is destroyed: those that reached SUCCESS are reused for later
/// batches (so their number is bounded by the peak number of posted batches), the others are
/// retired until then.
Result<std::unique_ptr<Backend>> CreateMoriBackendWithApi(std::unique_ptr<MoriApi> api,
                                                          const MoriOptions& options,
                                                          std::shared_ptr<CompletionSink> sink);

}  // namespace moriio_native::detail::mori_backend
