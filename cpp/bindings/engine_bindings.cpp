#include <pybind11/numpy.h>
#include <pybind11/stl.h>

#include "bindings/common.hpp"
#include "moriio_native/backend.hpp"
#include "moriio_native/engine.hpp"
#include "moriio_native/trace_marks.hpp"

namespace py = pybind11;

namespace moriio_native::bindings {
namespace {


MemoryKind ParseMemory(const std::string& memory) {
  if (memory == "host" || memory == "cpu") return MemoryKind::kHost;
  if (memory == "cuda") return MemoryKind::kCuda;
  if (memory == "rocm" || memory == "hip") return MemoryKind::kRocm;
  throw StatusError(
      InvalidArgumentError("memory must be 'host', 'cuda' or 'rocm', got '" + memory + "'"));
}

std::span<const std::uint8_t> ByteSpan(const py::bytes& b, std::string& holder) {
  holder = b;  // a copy: the bytes object may not outlive a GIL-free section otherwise
  return {reinterpret_cast<const std::uint8_t*>(holder.data()), holder.size()};
}

// Segments as the Python facade passes them: (layers, local ids, remote ids, local window,
// remote window) per segment. Ids are copied here, with the GIL held.
std::vector<BlockSegment> ToSegments(const py::list& segments) {
  std::vector<BlockSegment> out;
  out.reserve(segments.size());
  for (const py::handle item : segments) {
    const auto t = item.cast<py::tuple>();
    if (t.size() != 5) {
      throw StatusError(InvalidArgumentError(
          "a segment is (layers, local_blocks, remote_blocks, local_window, remote_window)"));
    }
    BlockSegment seg;
    seg.layers = t[0].cast<std::vector<std::string>>();
    seg.local_blocks = BlockIds(t[1], "local_blocks");
    seg.remote_blocks = BlockIds(t[2], "remote_blocks");
    seg.local_window = ToCellWindow(t[3], "local_window");
    seg.remote_window = ToCellWindow(t[4], "remote_window");
    out.push_back(std::move(seg));
  }
  return out;
}

py::bytes ToBytes(const std::vector<std::uint8_t>& v) {
  return py::bytes(reinterpret_cast<const char*>(v.data()), v.size());
}

// Terminal events, waiting up to `timeout_s` for the first in short slices with the GIL
// released, checking for Ctrl-C between them (only while none was taken). NaN or negative: no
// wait; longer than a day: a day (no float->int overflow).
std::vector<TransferEvent> PollEventsWaiting(Engine& e, std::size_t max_events, double timeout_s) {
  if (max_events == 0) return {};
  const double wait_s = timeout_s > 0 ? std::min(timeout_s, 86400.0) : 0.0;
  const auto until = std::chrono::steady_clock::now() +
                     std::chrono::microseconds(static_cast<std::int64_t>(wait_s * 1e6));
  while (true) {
    const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(
        until - std::chrono::steady_clock::now());
    std::vector<TransferEvent> events = WithoutGil([&] {
      return e.PollEvents(max_events, std::clamp(left, std::chrono::milliseconds(0),
                                                 std::chrono::milliseconds(100)));
    });
    if (!events.empty() || std::chrono::steady_clock::now() >= until) return events;
    if (PyErr_CheckSignals() != 0) throw py::error_already_set();
  }
}

}  // namespace

void BindEngine(py::module_& m) {
  m.def("available_backends", [](const std::map<std::string, std::string>& options) {
        BackendOptions opts(options.begin(), options.end());
        // Probing may dlopen libraries.
        const std::vector<BackendAvailability> all =
            WithoutGil([&] { return AvailableBackends(opts); });
        py::list out;
        for (const auto& b : all) out.append(py::make_tuple(b.name, b.available, b.reason));
        return out;
      },
      py::arg("options") = std::map<std::string, std::string>{},
      "List of (name, available, reason) for every known backend.");

  py::class_<LayerRegistration>(m, "_LayerRegistration")
      .def(py::init([](std::string name, TensorGeometry geometry, CacheSpec spec,
                       const std::string& axis, std::uint64_t base, std::uint64_t size,
                       const std::string& memory, int device) {
             const KvPlaneAxis plane = ParsePlaneAxis(axis);
             return LayerRegistration{std::move(name), std::move(geometry), spec, plane,
                                      MemoryRange{base, size, ParseMemory(memory), device}};
           }),
           py::arg("name"), py::arg("geometry"), py::arg("spec"), py::arg("kv_plane_axis"),
           py::arg("allocation_base"), py::arg("allocation_size"), py::arg("memory"),
           py::arg("device"));

  py::class_<TransferEvent>(m, "TransferEvent", "A transfer reached its terminal state.")
      .def_readonly("transfer_id", &TransferEvent::transfer_id)
      .def_property_readonly("kind", [](const TransferEvent& e) {
        return e.kind == TransferKind::kRead ? "read" : "write";
      })
      .def_property_readonly("state", [](const TransferEvent& e) {
        return std::string(TransferStateName(e.state));
      })
      .def_readonly("peer", &TransferEvent::peer)
      .def_readonly("message", &TransferEvent::message)
      .def_readonly("bytes", &TransferEvent::bytes)
      .def_readonly("runs", &TransferEvent::runs)
      .def_readonly("batches", &TransferEvent::batches)
      .def_readonly("stamped_batches", &TransferEvent::stamped_batches,
                    "Of batches, those that went as stamped batches (template and block ids).")
      .def_readonly("cell_batches", &TransferEvent::cell_batches,
                    "Of batches, those that moved whole blocks as cells (a transposing copy).")
      .def_readonly("seconds", &TransferEvent::seconds)
      .def_readonly("drained", &TransferEvent::drained,
                    "False: the transfer ended with batches in flight; its destination is "
                    "quarantined until Engine.poll_drained reports it (never, for writes the "
                    "transport could not confirm before their connection closed).")
      .def("__repr__", [](const TransferEvent& e) {
        return "TransferEvent('" + e.transfer_id + "', " +
               (e.kind == TransferKind::kRead ? "read" : "write") + ", " +
               std::string(TransferStateName(e.state)) + ", bytes=" + std::to_string(e.bytes) +
               (e.drained ? "" : ", quarantined") +
               (e.message.empty() ? "" : ", '" + e.message + "'") + ")";
      });

  py::class_<DrainedTransfer>(m, "DrainedTransfer",
                              "A quarantined transfer whose last operation completed.")
      .def_readonly("transfer_id", &DrainedTransfer::transfer_id)
      .def_property_readonly("kind", [](const DrainedTransfer& d) {
        return d.kind == TransferKind::kRead ? "read" : "write";
      })
      .def_readonly("peer", &DrainedTransfer::peer)
      .def_readonly("seconds", &DrainedTransfer::seconds)
      .def("__repr__", [](const DrainedTransfer& d) {
        return "DrainedTransfer('" + d.transfer_id + "', " +
               (d.kind == TransferKind::kRead ? "read" : "write") + ", peer='" + d.peer + "')";
      });

  py::class_<Engine>(m, "_Engine")
      .def(py::init([](std::string engine_id, std::string backend,
                       const std::map<std::string, std::string>& options, double timeout_s,
                       std::size_t terminal_history, std::uint64_t page_size) {
             if (!(timeout_s > 0) || timeout_s > 365.0 * 86400.0) {
               throw StatusError(InvalidArgumentError(
                   "transfer_timeout must be a positive number of seconds, at most a year"));
             }
             EngineConfig config;
             config.engine_id = std::move(engine_id);
             config.backend = std::move(backend);
             config.options = BackendOptions(options.begin(), options.end());
             config.transfer_timeout =
                 std::chrono::milliseconds(static_cast<std::int64_t>(timeout_s * 1000.0));
             config.terminal_history = terminal_history;
             config.page_size = page_size;
             Result<std::unique_ptr<Engine>> engine = WithoutGil([&] {
               return Engine::Create(std::move(config));
             });
             return Unwrap(std::move(engine));
           }),
           py::arg("engine_id"), py::arg("backend"), py::arg("options"),
           py::arg("transfer_timeout"), py::arg("terminal_history"), py::arg("page_size"))
      .def_property_readonly("engine_id", &Engine::engine_id)
      .def_property_readonly("backend", &Engine::backend_name)
      .def("register_kv_caches",
           [](Engine& e, const std::vector<LayerRegistration>& layers) {
             Result<std::vector<std::uint8_t>> meta = WithoutGil([&] {
               return e.RegisterKvCaches(layers);
             });
             return ToBytes(Unwrap(std::move(meta)));
           })
      .def("local_metadata", [](const Engine& e) { return ToBytes(Unwrap(e.LocalMetadata())); })
      .def(
          "add_peer",
          [](Engine& e, const py::bytes& metadata, bool replace,
             const std::string& expected_engine_id) {
            std::string holder;
            auto span = ByteSpan(metadata, holder);
            Result<std::string> peer = WithoutGil([&] {
              return replace ? e.ReplacePeer(span, expected_engine_id)
                             : e.AddPeer(span, expected_engine_id);
            });
            return Unwrap(std::move(peer));
          },
          py::arg("metadata"), py::arg("replace") = false, py::arg("expected_engine_id") = "")
      .def("remove_peer", [](Engine& e, const std::string& peer) {
        const Status st = WithoutGil([&] { return e.RemovePeer(peer); });
        ThrowIfError(st);
      })
      .def("remove_idle_peer",
           [](Engine& e, const std::string& peer) {
             Result<bool> removed = WithoutGil([&] {
               return e.RemoveIdlePeer(peer);
             });
             return Unwrap(std::move(removed));
           })
      .def("peers", &Engine::Peers)
      .def("waits_for_device_events",
           [](const Engine& e, const std::string& peer) {
             return Unwrap(e.WaitsForDeviceEvents(peer));
           })
      .def("read",
           [](Engine& e, const std::string& tid, const std::string& peer, const py::object& local,
              const py::object& remote, const std::vector<std::string>& layers) {
             trace::Record(trace::Mark::kBindingEntry);
             const auto local_ids = BlockIds(local, "local_blocks");
             const auto remote_ids = BlockIds(remote, "remote_blocks");
             const Status st =
                 WithoutGil([&] { return e.Read(tid, peer, local_ids, remote_ids, layers); });
             ThrowIfError(st);
           })
      .def("write_layer",
           [](Engine& e, const std::string& tid, const std::string& layer, const std::string& peer,
              const py::object& local, const py::object& remote, std::uint64_t cuda_event) {
             trace::Record(trace::Mark::kBindingEntry);
             const auto local_ids = BlockIds(local, "local_blocks");
             const auto remote_ids = BlockIds(remote, "remote_blocks");
             Result<bool> r = WithoutGil([&] {
               return e.WriteLayer(tid, layer, peer, local_ids, remote_ids, cuda_event);
             });
             return Unwrap(std::move(r));
           },
           py::arg("transfer_id"), py::arg("layer"), py::arg("peer"), py::arg("local_blocks"),
           py::arg("remote_blocks"), py::arg("cuda_event") = 0)
      .def("write_layers",
           [](Engine& e, const std::string& tid, const std::vector<std::string>& layers,
              const std::string& peer, const py::object& local, const py::object& remote,
              std::uint64_t cuda_event) {
             trace::Record(trace::Mark::kBindingEntry);
             const auto local_ids = BlockIds(local, "local_blocks");
             const auto remote_ids = BlockIds(remote, "remote_blocks");
             Result<bool> r = WithoutGil([&] {
               return e.WriteLayers(tid, layers, peer, local_ids, remote_ids, cuda_event);
             });
             return Unwrap(std::move(r));
           },
           py::arg("transfer_id"), py::arg("layers"), py::arg("peer"), py::arg("local_blocks"),
           py::arg("remote_blocks"), py::arg("cuda_event") = 0)
      .def(
          "read_segments",
          [](Engine& e, const std::string& tid, const std::string& peer, const py::list& segments) {
            const std::vector<BlockSegment> segs = ToSegments(segments);
            const Status st = WithoutGil([&] { return e.Read(tid, peer, segs); });
            ThrowIfError(st);
          },
          py::arg("transfer_id"), py::arg("peer"), py::arg("segments"))
      .def(
          "write_layer_segments",
          [](Engine& e, const std::string& tid, const std::string& layer, const std::string& peer,
             const py::list& segments, std::uint64_t cuda_event) {
            const std::vector<BlockSegment> segs = ToSegments(segments);
            Result<bool> r = WithoutGil([&] {
              return e.WriteLayer(tid, layer, peer, segs, cuda_event);
            });
            return Unwrap(std::move(r));
          },
          py::arg("transfer_id"), py::arg("layer"), py::arg("peer"), py::arg("segments"),
          py::arg("cuda_event") = 0)
      .def(
          "seal",
          [](Engine& e, const std::string& tid, const std::string& peer,
             std::int64_t expected_writes) { return Unwrap(e.Seal(tid, peer, expected_writes)); },
          py::arg("transfer_id"), py::arg("peer"), py::arg("expected_writes"))
      .def(
          "poll_drained",
          [](Engine& e, std::size_t max_transfers) { return e.PollDrained(max_transfers); },
          py::arg("max_transfers"))
      .def("abort", [](Engine& e, const std::string& tid) { ThrowIfError(e.Abort(tid)); })
      .def("poll_events", &PollEventsWaiting, py::arg("max_events"), py::arg("timeout"))
      .def(
          "poll_events_into",
          [](Engine& e, py::list out, std::size_t max_events, double timeout_s) {
            // Appended here, before the call returns: a Ctrl-C that Python raises as it returns
            // finds the events in the caller's list, not only in a return value it drops.
            std::vector<TransferEvent> events = PollEventsWaiting(e, max_events, timeout_s);
            for (TransferEvent& event : events) out.append(py::cast(std::move(event)));
            return events.size();
          },
          py::arg("out"), py::arg("max_events"), py::arg("timeout"))
      .def("allocate_backing",
           [](Engine& e, std::uint64_t size, const std::string& memory, int device) {
             const MemoryKind kind = ParseMemory(memory);
             Result<MemoryRange> range = WithoutGil([&] {
               return e.AllocateBacking(size, kind, device);
             });
             MemoryRange r = Unwrap(std::move(range));
             return py::make_tuple(r.address, r.size);
           },
           py::arg("size"), py::arg("memory"), py::arg("device"))
      .def("free_backing", [](Engine& e, std::uint64_t address) {
        const Status st = WithoutGil([&] { return e.FreeBacking(address); });
        ThrowIfError(st);
      })
      .def_property_readonly("pending_transfers", &Engine::PendingTransfers)
      .def_property_readonly("quarantined_transfers", &Engine::QuarantinedTransfers);
}

}  // namespace moriio_native::bindings
