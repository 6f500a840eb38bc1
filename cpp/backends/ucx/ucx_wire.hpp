#pragma once

/// The bytes the UCX backend hands to peers: its worker address (LocalAddress) and, per
/// registered region, a remote key (RegisteredRegion::remote_key). Both wrap the opaque UCX blob in
/// a small checked envelope, because UCX parses these blobs without validating them and a
/// truncated or corrupted blob would crash inside UCX instead of failing with an error.
///
/// Layout (little-endian, fixed header then the UCX bytes):
///   address: magic "MNUCXAD3", u32 UCX version, u32 blob length, 16-byte host id, then the
///            process identity (u32 pid, u32 flags, u64 pid-namespace device, u64 pid-namespace
///            inode, u64 cookie address, 16-byte cookie), u64 backend instance, u64 FNV-1a of
///            everything before it and of the blob, blob. (Format 1, "MNUCXAD1", had no process
///            identity, format 2 no backend instance.)
///   key:     magic "MNUCXRK1", u8 memory kind, u8 flags, u16 zero, u32 blob length, u64 region
///            start, u64 region size, u64 FNV-1a (as above), blob.

#include <array>
#include <cstddef>
#include <initializer_list>
#include <cstdint>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "moriio_native/backend.hpp"
#include "moriio_native/status.hpp"

namespace moriio_native::detail::ucx {

/// Identifies the machine (kernel boot): equal ids mean both processes share one host.
using HostId = std::array<std::uint8_t, 16>;

/// This machine's id: the kernel's boot_id, else a hash of the host name. Thread-safe.
HostId LocalHostId();

/// Who a process is, so that a peer on the same host may read and write its memory with
/// process_vm_readv/writev: a pid means the same process only inside the same pid namespace, and
/// even there it may be stale (the process exited, the pid was reused). So the process also
/// names an address in its memory that holds a random 16-byte cookie: a peer that reads exactly
/// that cookie at that address through the pid has reached this process (a stranger's memory
/// would have to hold the same 128 random bits at the same address).
struct ProcessIdentity {
  std::uint32_t pid = 0;  ///< 0: unknown (the peer offers no identity)
  std::uint64_t pidns_dev = 0;
  std::uint64_t pidns_ino = 0;
  std::uint64_t cookie_address = 0;
  std::array<std::uint8_t, 16> cookie{};
};

/// This process's identity: getpid() and /proc/self/ns/pid now, the cookie drawn once per
/// process from the system's random source and kept in static storage. Thread-safe.
ProcessIdentity LocalProcessIdentity();

/// Whether `peer` is a live process of this host in this pid namespace holding its cookie,
/// checked with one 16-byte process_vm_readv. False (never an error) when anything differs or
/// the read is refused. Thread-safe, does not block beyond that system call.
bool VerifyProcessIdentity(const ProcessIdentity& peer);

/// What a read of a proven peer's identity says about its process.
enum class ProcessPresence {
  kAlive,    ///< the cookie reads back: the same process, alive
  kGone,     ///< no such process any more (ESRCH through the pid and through every thread
             ///< still listed for it: exited, its memory torn down), or another image behind
             ///< the pid (the cookie differs: the pid was reused, or it exec'd)
  kUnknown,  ///< the read was refused (EPERM: the peer became non-dumpable or changed its
             ///< credentials, a tighter ptrace policy) or failed otherwise: maybe alive
};

/// ProcessPresence of `peer`, an identity VerifyProcessIdentity proved before (one 16-byte
/// process_vm_readv; when the pid answers ESRCH, one more per thread the process still has,
/// since the pid of a process whose main thread ended answers so while its other threads run).
/// Only kGone proves an exit: a live peer whose memory this process may no longer read is
/// kUnknown, never kGone. Thread-safe.
ProcessPresence ProbeProcessIdentity(const ProcessIdentity& peer);

/// This process publishes, next to its identity cookie, the memory its UCX backends registered
/// and the engine each registration serves: a same-host peer that moves bytes with
/// process_vm_readv/writev reads it through the same pid and checks each remote range against it
/// first (CheckPublishedRegion). A peer's metadata names the ranges its keys cover and the
/// engine it is, but only the process itself can vouch for them: without this, metadata naming
/// any address of a proven process would have it read or written there.
/// Layout at the cookie address (native byte order, the peer runs on this host): 16-byte cookie,
/// u64 magic "MNPUBRG3", u64 sequence (odd while the table changes), u64 table bytes, u64
/// table address; the table is one record per region: u64 start, u64 size, u64 memory kind, u64
/// backend instance, u64 engine id length, the engine id's bytes padded to 8.
///
/// The backend instance is why a range held by an engine destroyed and made again under the same
/// id in a living process (its new memory at the old address) is not taken for the old one's: a
/// peer checks against the instance in the address it connected to, and every backend draws its
/// own.
struct RegionOwner {
  std::uint64_t instance = 0;  ///< the registering backend's, drawn at random when it starts
  std::string engine;          ///< the engine id it serves ("" for none; in checks: any)
};


/// A published range, for the life of this object (RAII): constructed publishes, destroyed (or
/// assigned over) withdraws it. Thread-safe.
class RegionPublication {
 public:
  RegionPublication() = default;
  RegionPublication(const MemoryRange& range, RegionOwner owner);
  RegionPublication(RegionPublication&& other) noexcept;
  RegionPublication& operator=(RegionPublication&& other) noexcept;
  RegionPublication(const RegionPublication&) = delete;
  RegionPublication& operator=(const RegionPublication&) = delete;
  ~RegionPublication();

 private:
  void Withdraw();
  std::uint64_t id_ = 0;  // 0: publishes nothing
};

/// Sequence value no table has when stable (odd): `held_at` before a range was ever found held.
inline constexpr std::uint64_t kNeverHeld = 1;

/// OK when `peer` (a process of this host, see VerifyProcessIdentity) publishes a registered
/// region of `range.kind` that holds `range`, registered by `owner` (its backend instance, and
/// its engine unless empty). `held_at`: the table's sequence when this range was last found held (kNeverHeld at
/// first); while the table has not changed since, only its header is read (one system call).
/// Transport when its identity no longer reads back (it exited), Incompatible when it publishes
/// no table (another version), OutOfRange when no published region holds the range,
/// FailedPrecondition for a table that does not read consistently within a few attempts.
/// Thread-safe for distinct `held_at`.
Status CheckPublishedRegion(const ProcessIdentity& peer, const MemoryRange& range,
                            const RegionOwner& owner, std::uint64_t& held_at);

/// Address flag: the backend serves push READs ("Push READ" in ucx_backend.cpp).
inline constexpr std::uint32_t kAddressFlagServesPush = 1;
/// Address flag: the backend answers region checks (kPushFlagRegionCheck). A release that
/// serves push READs but predates region checks would misread one, so a reader asks only a
/// peer that sets this.
inline constexpr std::uint32_t kAddressFlagAnswersRegionChecks = 2;

struct WireAddress {
  std::uint32_t ucx_version = 0;
  std::uint32_t flags = 0;  ///< kAddressFlag*
  HostId host{};
  ProcessIdentity process;
  std::uint64_t instance = 0;  ///< the backend's (RegionOwner::instance)
  std::span<const std::uint8_t> blob;  ///< points into the decoded buffer
};

/// Key flag: the region lies in memory the owner allocated through UCX (sysv/posix segment).
inline constexpr std::uint8_t kKeyFlagAllocated = 1;

struct WireKey {
  MemoryKind kind = MemoryKind::kHost;
  std::uint8_t flags = 0;
  std::uint64_t region_start = 0;
  std::uint64_t region_size = 0;
  std::span<const std::uint8_t> blob;  ///< points into the decoded buffer
};

/// Pure functions: thread-safe, never block.
std::vector<std::uint8_t> EncodeAddress(std::uint32_t ucx_version, const HostId& host,
                                        const ProcessIdentity& process, std::uint64_t instance,
                                        std::span<const std::uint8_t> blob,
                                        std::uint32_t flags = 0);
/// InvalidArgument saying what is wrong (size, magic, checksum) for anything not produced by
/// EncodeAddress.
Result<WireAddress> DecodeAddress(std::span<const std::uint8_t> bytes);

std::vector<std::uint8_t> EncodeKey(const WireKey& key);
Result<WireKey> DecodeKey(std::span<const std::uint8_t> bytes);

/// Names one push request (a READ or a region check): a random nonce the reader drew for it and
/// the reader's sequence number. The nonce keeps anyone but the target the request went to
/// (other targets of the same reader included) from forging an answer the reader accepts.
struct PushId {
  std::uint64_t nonce = 0;
  std::uint64_t seq = 0;
  bool operator==(const PushId&) const = default;
};

/// A reader's request that the target send it the bytes of `runs` of the target's memory
/// [region_start, +region_size) (the range the reader imported), in run order, as one stream.
///   magic "MNUCXPQ1", u64 nonce, u64 seq, u32 reply-address length, u32 run count, u64 region
///   start, u64 region size, u64 flags (kPushFlag*), u64 FNV-1a (as above, of the header and
///   everything after it), the reader's address (EncodeAddress), then per run u64 offset (from
///   region start), u64 size.
struct PushRequest {
  PushId id;
  std::uint64_t flags = 0;
  std::span<const std::uint8_t> reply_address;  ///< points into the decoded buffer
  std::uint64_t region_start = 0;
  std::uint64_t region_size = 0;
  std::vector<std::uint64_t> offsets;
  std::vector<std::uint64_t> sizes;
  /// A region check: the engine id whose registration it asks about ("" for any). It travels
  /// where a push READ's runs do, the run count field holding its length.
  std::string owner;
  /// A region check: the UCX key bytes (WireKey::blob) the reader imported the range with; the
  /// rest of the message after the engine id. The range is vouched for only together with the
  /// key the owner packed for a registration holding it: a key of another allocation maps
  /// other memory (UCX's mapping of it is offset arithmetic from that allocation's base).
  std::vector<std::uint8_t> key;
};

/// The most runs one push request carries (16 MiB of runs): the target holds whole requests
/// while they wait, so their size is bounded; a reader refuses a larger batch itself.
inline constexpr std::size_t kMaxPushRuns = std::size_t{1} << 20;

/// Who a push request asks to be answered: enough of it to send a "failed" answer to, even when
/// the rest of it (the checksum, the runs) is bad or the target cannot serve it.
struct PushReplyTo {
  PushId id;
  std::uint64_t flags = 0;
  std::span<const std::uint8_t> reply_address;  ///< points into the decoded buffer
};

/// Request flag: the reader's endpoint to the target has UCX peer-failure detection. UCX refuses
/// to connect two workers whose endpoints differ in that, so the target's endpoint must match.
inline constexpr std::uint64_t kPushFlagPeerErrorHandling = 1;

/// Request flag: a region check. It carries no runs and asks only whether the target registered
/// memory of the kind in bits 8-15 (MemoryKind) that holds [region_start, +region_size), for the
/// engine the request names (PushRequest::owner, any when empty), and packed the key it carries
/// (PushRequest::key) for that registration; the target answers done (0 bytes sent) or failed
/// with the reason. A peer's metadata names the ranges its keys are for, and nothing but the
/// owner can vouch for them: UCX's software RMA (tcp) takes any address through a key, and its
/// mappings (ucp_rkey_ptr) end where the key's allocation does, not the registration.
inline constexpr std::uint64_t kPushFlagRegionCheck = 2;

/// The memory kind a request asks about: host for a push READ, the kind it names for a region
/// check (DecodePushRequest refused an unknown one).
MemoryKind PushRequestKind(const PushRequest& request);

std::vector<std::uint8_t> EncodePushRequest(const PushId& id, std::uint64_t flags,
                                            std::span<const std::uint8_t> reply_address,
                                            std::uint64_t region_start, std::uint64_t region_size,
                                            std::span<const std::int64_t> offsets,
                                            std::span<const std::int64_t> sizes);
/// A region check (kPushFlagRegionCheck) of `range` (and its memory kind) imported with UCX key
/// bytes `key`, asking for engine `owner`.
std::vector<std::uint8_t> EncodeRegionCheck(const PushId& id, std::uint64_t flags,
                                            std::span<const std::uint8_t> reply_address,
                                            const MemoryRange& range, std::string_view owner,
                                            std::span<const std::uint8_t> key);
/// InvalidArgument when `bytes` has no push header, or its reply address is cut short or does
/// not decode (DecodeAddress, whose own checksum it has): then nobody can be answered. Checks
/// nothing else (DecodePushRequest does).
Result<PushReplyTo> DecodePushReplyTo(std::span<const std::uint8_t> bytes);
/// InvalidArgument naming what is wrong (size, magic, checksum, run count above kMaxPushRuns, a
/// wrapping region, a region check's engine id too long or its memory kind unknown). The runs
/// are not checked: see CheckPushRuns.
Result<PushRequest> DecodePushRequest(std::span<const std::uint8_t> bytes);
/// OutOfRange naming the run index for a run that is empty or does not lie inside the request's
/// region (overflow included).
Status CheckPushRuns(const PushRequest& request);

/// The fixed-size headers of the other push messages (UCX active-message headers):
///   data:   u64 nonce, u64 seq, u64 offset of the payload in the request's byte stream
///   answer: u64 nonce, u64 seq, u64 stream bytes sent, u64 1 = done / 0 = failed (the payload is
///           the reason then)
inline constexpr std::size_t kPushDataHeader = 24;
inline constexpr std::size_t kPushAnswerHeader = 32;

/// Little-endian u64 fields of those headers. The reader side checks the header length first.
std::vector<std::uint8_t> EncodePushHeader(std::initializer_list<std::uint64_t> fields);
std::uint64_t PushHeaderField(std::span<const std::uint8_t> header, std::size_t index);

}  // namespace moriio_native::detail::ucx
