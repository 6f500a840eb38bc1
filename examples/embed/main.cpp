// Moves KV blocks between two engines of this process through the public C++ API only:
// describe two differently laid out caches, register them, exchange metadata, READ, verify.

#include <cstdint>
#include <cstdio>
#include <numeric>
#include <vector>

#include "moriio_native/engine.hpp"

using namespace moriio_native;

namespace {

constexpr std::int64_t kBlocks = 8, kBlockSize = 4, kHeads = 2, kHead = 3, kDtype = 2;

// A bf16 K/V cache [2, N, B, H, D] (separated) or [N, 2, B, H, D] (interleaved), contiguous.
LayerRegistration Layer(std::vector<std::uint8_t>& buffer, bool separated) {
  TensorGeometry g;
  g.shape = separated ? std::vector<std::int64_t>{2, kBlocks, kBlockSize, kHeads, kHead}
                      : std::vector<std::int64_t>{kBlocks, 2, kBlockSize, kHeads, kHead};
  g.strides.resize(5);
  std::int64_t step = 1;
  for (int i = 4; i >= 0; --i) {
    g.strides[i] = step;
    step *= g.shape[i];
  }
  g.element_size = kDtype;
  g.data_ptr = reinterpret_cast<std::uint64_t>(buffer.data());
  // Both shapes above list tokens before heads.
  CacheSpec spec{CacheKind::kKeyValue, kBlockSize, kHeads, kHead, kDtype, std::nullopt,
                 AxisOrder::kNhd};
  return {"layer.0", g, spec, KvPlaneAxis::kAuto,
          MemoryRange{g.data_ptr, buffer.size(), MemoryKind::kHost, -1}};
}

int Fail(const char* what, const Status& st) {
  std::fprintf(stderr, "embed: %s failed: %s\n", what, st.ToString().c_str());
  return 1;
}

}  // namespace

int main() {
  for (const BackendAvailability& b : AvailableBackends()) {
    std::printf("backend %-8s %s %s\n", b.name.c_str(), b.available ? "available" : "unavailable",
                b.reason.c_str());
  }
  const std::size_t bytes = 2 * kBlocks * kBlockSize * kHeads * kHead * kDtype;
  std::vector<std::uint8_t> prefill_mem(bytes), decode_mem(bytes, 0);
  std::iota(prefill_mem.begin(), prefill_mem.end(), 0);

  auto prefill = Engine::Create({.engine_id = "prefill"});
  auto decode = Engine::Create({.engine_id = "decode"});
  if (!prefill.ok()) return Fail("create", prefill.status());
  if (!decode.ok()) return Fail("create", decode.status());
  std::vector<LayerRegistration> p_layers{Layer(prefill_mem, true)};
  std::vector<LayerRegistration> d_layers{Layer(decode_mem, false)};
  auto p_meta = (*prefill)->RegisterKvCaches(p_layers);
  auto d_meta = (*decode)->RegisterKvCaches(d_layers);
  if (!p_meta.ok()) return Fail("register", p_meta.status());
  if (!d_meta.ok()) return Fail("register", d_meta.status());
  auto peer = (*decode)->AddPeer(*p_meta);
  if (!peer.ok()) return Fail("add_peer", peer.status());

  const std::vector<std::int64_t> remote{1, 3}, local{6, 2};
  if (Status st = (*decode)->Read("req-1", *peer, local, remote); !st.ok()) return Fail("read", st);
  std::vector<TransferEvent> events;
  while (events.empty()) events = (*decode)->PollEvents(1, std::chrono::milliseconds(1000));
  if (events[0].state != TransferState::kDone) {
    std::fprintf(stderr, "embed: transfer ended %s: %s\n",
                 std::string(TransferStateName(events[0].state)).c_str(), events[0].message.c_str());
    return 1;
  }
  // Decode is interleaved: block b holds K then V, each B*H*D elements; prefill is separated.
  const std::int64_t plane = kBlockSize * kHeads * kHead * kDtype;
  for (std::size_t i = 0; i < local.size(); ++i) {
    for (std::int64_t p = 0; p < 2; ++p) {
      for (std::int64_t k = 0; k < plane; ++k) {
        const std::uint8_t want = prefill_mem[p * kBlocks * plane + remote[i] * plane + k];
        const std::uint8_t got = decode_mem[(local[i] * 2 + p) * plane + k];
        if (want != got) {
          std::fprintf(stderr, "embed: byte mismatch in block %lld\n", static_cast<long long>(local[i]));
          return 1;
        }
      }
    }
  }
  std::printf("embed: moved %lld bytes, verified: OK\n", static_cast<long long>(events[0].bytes));
  return 0;
}
