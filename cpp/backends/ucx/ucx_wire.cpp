#include "ucx_wire.hpp"

#include <dirent.h>
#include <pthread.h>
#include <sched.h>
#include <sys/stat.h>
#include <sys/uio.h>
#include <unistd.h>

#include <array>
#include <atomic>
#include <chrono>
#include <cerrno>
#include <cctype>
#include <cstddef>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <memory>
#include <mutex>
#include <random>
#include <set>
#include <string>
#include <string_view>
#include <thread>
#include <utility>

namespace moriio_native::detail::ucx {
namespace {

constexpr std::string_view kAddressMagic = "MNUCXAD3";
// Earlier formats, refused by name: 1 had no process identity, 2 no backend instance.
constexpr std::array<std::string_view, 2> kOlderAddressMagics = {"MNUCXAD1", "MNUCXAD2"};
constexpr std::string_view kKeyMagic = "MNUCXRK1";
constexpr std::string_view kPushMagic = "MNUCXPQ1";
constexpr std::size_t kPushHeader = 8 + 8 + 8 + 4 + 4 + 8 + 8 + 8 + 8;
constexpr std::size_t kPushSumAt = kPushHeader - 8;
constexpr std::size_t kIdentityBytes = 4 + 4 + 8 + 8 + 8 + 16;
constexpr std::size_t kAddressHeader = 8 + 4 + 4 + 16 + kIdentityBytes + 8 + 8;
constexpr std::size_t kAddressSumAt = kAddressHeader - 8;
constexpr std::size_t kKeyHeader = 8 + 1 + 1 + 2 + 4 + 8 + 8 + 8;
// A UCX worker address is ~70-300 bytes and an rkey well under a kilobyte; anything far bigger
// is garbage, and refusing it keeps a hostile length from turning into a huge allocation.
constexpr std::uint32_t kMaxBlob = 1u << 20;
// An engine id is at most 1,024 bytes (peer_metadata.hpp, kMaxNameBytes).
constexpr std::uint64_t kMaxOwnerBytes = 1024;

std::uint64_t Fnv1a(std::span<const std::uint8_t> bytes, std::uint64_t h = 0xcbf29ce484222325ull) {
  for (std::uint8_t b : bytes) {
    h ^= b;
    h *= 0x100000001b3ull;
  }
  return h;
}

void Put(std::vector<std::uint8_t>& out, std::uint64_t v, int bytes) {
  for (int i = 0; i < bytes; ++i) out.push_back(static_cast<std::uint8_t>(v >> (8 * i)));
}

std::uint64_t Get(std::span<const std::uint8_t> in, std::size_t at, int bytes) {
  std::uint64_t v = 0;
  for (int i = 0; i < bytes; ++i) v |= static_cast<std::uint64_t>(in[at + i]) << (8 * i);
  return v;
}

std::uint64_t Checksum(std::span<const std::uint8_t> header_without_sum,
                       std::span<const std::uint8_t> blob) {
  return Fnv1a(blob, Fnv1a(header_without_sum));
}

constexpr std::uint64_t kPublishedMagic = 0x3347524255504e4dull;  // "MNPUBRG3"
// More than any process publishes (a record per registered region: 40 bytes and the engine id,
// a few per layer); a peer reads at most this much, so a hostile size cannot make it allocate
// or copy much.
constexpr std::uint64_t kMaxPublishedBytes = std::uint64_t{1} << 20;
constexpr std::size_t kRecordHeader = 5 * 8;  // start, size, kind, instance, owner length

/// What a peer reads at the cookie address (see RegionPublication). The fields a peer reads
/// while this process may change them are atomics, written in seqlock order.
struct PublishedHeader {
  std::array<std::uint8_t, 16> cookie{};
  std::uint64_t magic = kPublishedMagic;
  std::atomic<std::uint64_t> seq{0};
  std::atomic<std::uint64_t> table_bytes{0};
  std::atomic<std::uint64_t> table{0};
};
static_assert(sizeof(PublishedHeader) == 48 && offsetof(PublishedHeader, seq) == 24);

struct Publication {
  std::uint64_t id = 0;
  MemoryRange range;
  RegionOwner owner;
};

/// The cookie and the published regions in static storage (their address stays valid for the
/// life of the process), drawn again in a forked child: parent and child must not prove each
/// other's identity, and the child registered nothing yet.
struct CookieState {
  std::mutex mutex;
  pid_t owner = 0;
  PublishedHeader header;
  std::vector<Publication> publications;
  std::vector<std::uint8_t> table;  // what the header points at: the publications' records
  std::uint64_t next_id = 1;
};

/// The state, its cookie drawn for this pid. Call with `state.mutex` held.
CookieState& OwnedCookie(CookieState& state) {
  if (state.owner != ::getpid()) {
    std::random_device rd;  // the system's random source (getrandom / /dev/urandom)
    for (std::size_t i = 0; i < state.header.cookie.size(); i += 4) {
      const std::uint32_t v = rd();
      std::memcpy(state.header.cookie.data() + i, &v, 4);
    }
    state.publications.clear();
    state.table.clear();
    state.header.table_bytes.store(0);
    state.header.table.store(0);
    state.owner = ::getpid();
  }
  return state;
}

CookieState& Cookie() {
  static CookieState state;
  // A fork while another thread changes the table would leave the child's copy of the mutex
  // locked for good: fork waits for the change to end.
  [[maybe_unused]] static const int at_fork = ::pthread_atfork(
      [] { state.mutex.lock(); }, [] { state.mutex.unlock(); }, [] { state.mutex.unlock(); });
  return state;
}

/// The records of `publications`: per region u64 start, u64 size, u64 memory kind, u64 backend
/// instance, u64 engine id length, the engine id's bytes padded to 8 (native byte order: only
/// this host reads them).
std::vector<std::uint8_t> PublishedTable(const std::vector<Publication>& publications) {
  std::vector<std::uint8_t> out;
  for (const Publication& p : publications) {
    const std::uint64_t fields[] = {p.range.address, p.range.size,
                                    static_cast<std::uint64_t>(p.range.kind), p.owner.instance,
                                    p.owner.engine.size()};
    static_assert(sizeof(fields) == kRecordHeader);
    const auto* raw = reinterpret_cast<const std::uint8_t*>(fields);
    out.insert(out.end(), raw, raw + sizeof(fields));
    out.insert(out.end(), p.owner.engine.begin(), p.owner.engine.end());
    out.resize((out.size() + 7) / 8 * 8);
  }
  return out;
}

/// Changes the publications with `change` between two sequence steps, so that a peer's read that
/// overlapped it sees the sequence move and reads again.
template <typename F>
void ChangePublished(F change) {
  CookieState& state = Cookie();
  std::lock_guard<std::mutex> lock(state.mutex);
  OwnedCookie(state);
  PublishedHeader& h = state.header;
  h.seq.fetch_add(1, std::memory_order_acq_rel);
  std::atomic_thread_fence(std::memory_order_release);
  change(state.publications, state.next_id);
  state.table = PublishedTable(state.publications);
  h.table.store(reinterpret_cast<std::uintptr_t>(state.table.data()), std::memory_order_relaxed);
  h.table_bytes.store(state.table.size(), std::memory_order_relaxed);
  h.seq.fetch_add(1, std::memory_order_release);
}

/// Whether the records in `table` hold `range` in a region `owner` registered: its backend
/// instance, and its engine unless that is empty (any engine). Records cut short end the search:
/// the table is this host's own format, never partial.
bool TableHolds(std::span<const std::uint8_t> table, const MemoryRange& range,
                const RegionOwner& owner) {
  for (std::size_t at = 0; at + kRecordHeader <= table.size();) {
    std::uint64_t f[5];
    static_assert(sizeof(f) == kRecordHeader);
    std::memcpy(f, table.data() + at, sizeof(f));
    const std::uint64_t start = f[0], size = f[1], kind = f[2], instance = f[3],
                        engine_len = f[4];
    at += kRecordHeader;
    if (engine_len > table.size() - at) return false;
    const std::string_view engine(reinterpret_cast<const char*>(table.data() + at), engine_len);
    at += (engine_len + 7) / 8 * 8;
    if (kind == static_cast<std::uint64_t>(range.kind) && range.address >= start &&
        range.size <= size && range.address - start <= size - range.size &&
        instance == owner.instance && (owner.engine.empty() || engine == owner.engine)) {
      return true;
    }
  }
  return false;
}

/// Reads `size` bytes at `address` of process `pid` into `out`; false unless all of them came.
bool ReadPeer(pid_t pid, std::uint64_t address, void* out, std::size_t size) {
  iovec local{out, size};
  iovec remote{reinterpret_cast<void*>(address), size};
  return ::process_vm_readv(pid, &local, 1, &remote, 1, 0) == static_cast<ssize_t>(size);
}

/// What one 16-byte read of a peer's cookie through one thread id found.
enum class CookieRead {
  kCookie,        ///< the peer's cookie: its memory, alive
  kOtherCookie,   ///< other bytes, or nothing mapped there: another image behind the id
  kNoSuchThread,  ///< ESRCH: no such thread, or one whose process's memory is gone
  kRefused,       ///< EPERM or another failure: proves nothing
};

/// Reads `peer`'s cookie through thread id `tid` (any thread's id names its process's memory).
CookieRead ReadCookieThrough(pid_t tid, const ProcessIdentity& peer) {
  std::array<std::uint8_t, 16> got{};
  iovec local{got.data(), got.size()};
  iovec remote{reinterpret_cast<void*>(peer.cookie_address), got.size()};
  const ssize_t n = ::process_vm_readv(tid, &local, 1, &remote, 1, 0);
  if (n == static_cast<ssize_t>(got.size())) {
    return got == peer.cookie ? CookieRead::kCookie : CookieRead::kOtherCookie;
  }
  if (n < 0 && errno == ESRCH) return CookieRead::kNoSuchThread;
  // Nothing mapped at the cookie's address: not the peer's image (its cookie lives as long as
  // it does), as other bytes there would say.
  if (n < 0 && errno == EFAULT) return CookieRead::kOtherCookie;
  return CookieRead::kRefused;
}

/// The threads of `pid`'s thread group that have not been released, its main thread
/// included while the group runs (its `Threads:` line: one counter, read at once); 0 when the
/// process is gone (reaped), -1 when it cannot be read.
int ThreadCount(pid_t pid) {
  std::ifstream status("/proc/" + std::to_string(pid) + "/status");
  if (!status) return errno == ENOENT ? 0 : -1;
  for (std::string line; std::getline(status, line);) {
    if (line.rfind("Threads:", 0) == 0) return std::atoi(line.c_str() + 8);
  }
  return -1;
}

/// The pid of a process whose main thread ended (pthread_exit) while its other threads run
/// answers ESRCH like an exited process's, though its memory is alive and transfers to it may
/// still land. Its other threads, listed in /proc/<pid>/task until the last one exits, reach
/// that memory. A listing proves little: the kernel walks a changing thread list by position,
/// so a listing may miss a thread started meanwhile, or every one, and name threads that have
/// exited; an exited thread's id may even name another process (another cookie). So the
/// process is taken as gone only when its own count says no thread but the main one is left
/// (a zombie) or it was reaped, and as another image only when a thread still listed under
/// it reads another cookie twice. Threads that keep coming for kMaxListings listings leave the
/// answer unknown, never gone.
ProcessPresence ProbeThroughOtherThreads(pid_t pid, const ProcessIdentity& peer) {
  constexpr int kMaxListings = 50;  // a millisecond apart (below)
  std::set<long> tried;
  std::set<long> other_cookie;  // tried threads that read another cookie
  bool refused = false;         // a read refused (EPERM): that thread may live
  for (int listing = 0; listing < kMaxListings; ++listing) {
    const int threads = ThreadCount(pid);
    if (threads == 0 || threads == 1) {
      return refused ? ProcessPresence::kUnknown : ProcessPresence::kGone;
    }
    if (threads < 0) return ProcessPresence::kUnknown;
    const std::unique_ptr<DIR, int (*)(DIR*)> tasks(
        ::opendir(("/proc/" + std::to_string(pid) + "/task").c_str()), ::closedir);
    if (!tasks) return ProcessPresence::kUnknown;  // reaped since: the next probe says so
    while (const dirent* entry = ::readdir(tasks.get())) {
      char* end = nullptr;
      const long tid = std::strtol(entry->d_name, &end, 10);
      if (end == entry->d_name || *end != '\0' || tid <= 0 || tid == pid) continue;
      const bool again = !tried.insert(tid).second;
      if (again && other_cookie.count(tid) == 0) continue;
      switch (ReadCookieThrough(static_cast<pid_t>(tid), peer)) {
        case CookieRead::kCookie:
          return ProcessPresence::kAlive;
        case CookieRead::kRefused:
          refused = true;
          break;
        case CookieRead::kOtherCookie:
          // Listed under the pid after it read another cookie: a thread of this process
          // whose memory holds other bytes, another image.
          if (again) return ProcessPresence::kGone;
          other_cookie.insert(tid);  // the thread may have exited and its id moved on
          break;
        case CookieRead::kNoSuchThread:  // the thread exited
          other_cookie.erase(tid);
          break;
      }
    }
    // Let threads that exited leave the list and new ones join it. A process being killed
    // takes milliseconds to release its threads (tens on a loaded host): the listings span
    // about 50 ms, so a peer whose connection failed as it died is proven gone, not left
    // unknown. Only peers whose pid answers ESRCH come here: dying ones, and the rare one whose
    // main thread ended.
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  }
  return ProcessPresence::kUnknown;
}

}  // namespace

RegionPublication::RegionPublication(const MemoryRange& range, RegionOwner owner) {
  ChangePublished([&](std::vector<Publication>& publications, std::uint64_t& next_id) {
    id_ = next_id++;
    publications.push_back({id_, range, std::move(owner)});
  });
}

RegionPublication::RegionPublication(RegionPublication&& other) noexcept
    : id_(std::exchange(other.id_, 0)) {}

RegionPublication& RegionPublication::operator=(RegionPublication&& other) noexcept {
  if (this != &other) {
    Withdraw();
    id_ = std::exchange(other.id_, 0);
  }
  return *this;
}

RegionPublication::~RegionPublication() { Withdraw(); }

void RegionPublication::Withdraw() {
  if (id_ == 0) return;
  ChangePublished([&](std::vector<Publication>& publications, std::uint64_t&) {
    std::erase_if(publications, [&](const Publication& p) { return p.id == id_; });
  });
  id_ = 0;
}

Status CheckPublishedRegion(const ProcessIdentity& peer, const MemoryRange& range,
                            const RegionOwner& owner, std::uint64_t& held_at) {
  const auto pid = static_cast<pid_t>(peer.pid);
  const std::string who = "peer process " + std::to_string(peer.pid);
  // A table that changes under every read (a peer registering in a loop) is not waited for:
  // this runs on a progress thread that serves every other peer too.
  constexpr int kAttempts = 8;
  for (int attempt = 0; attempt < kAttempts; ++attempt) {
    if (attempt != 0) sched_yield();  // let the changing process finish its change
    std::array<std::uint64_t, 6> head{};  // cookie (2 words), magic, seq, table bytes, table
    static_assert(sizeof(head) == sizeof(PublishedHeader));
    if (!ReadPeer(pid, peer.cookie_address, head.data(), sizeof(head)) ||
        std::memcmp(head.data(), peer.cookie.data(), peer.cookie.size()) != 0) {
      return TransportError("the peer process is gone (pid " + std::to_string(peer.pid) +
                            ": its identity cookie no longer reads back through it, as also "
                            "after its main thread ended while other threads run)");
    }
    if (head[2] != kPublishedMagic) {
      return IncompatibleError(who + " publishes no table of its registered regions (another "
                               "moriio-native version): its ranges cannot be checked");
    }
    const std::uint64_t seq = head[3], bytes = head[4];
    if (seq % 2 != 0) continue;  // changing now
    if (seq == held_at) return Status::OK();  // unchanged since the range was found held
    if (bytes > kMaxPublishedBytes) {
      return FailedPreconditionError(who + " publishes " + std::to_string(bytes) +
                                     " bytes of registered regions, more than a peer reads (" +
                                     std::to_string(kMaxPublishedBytes) + ")");
    }
    std::vector<std::uint8_t> table(bytes);
    if (bytes != 0 && !ReadPeer(pid, head[5], table.data(), bytes)) {
      continue;  // the table moved (freed) while it changed: the sequence says so
    }
    std::uint64_t seq_after = 0;
    if (!ReadPeer(pid, peer.cookie_address + offsetof(PublishedHeader, seq), &seq_after,
                  sizeof(seq_after))) {
      return TransportError("the peer process is gone (pid " + std::to_string(peer.pid) +
                            ": its table no longer reads back)");
    }
    if (seq_after != seq) continue;
    if (TableHolds(table, range, owner)) {
      held_at = seq;
      return Status::OK();
    }
    return OutOfRangeError(
        who + " registered no region that holds it" +
        (owner.engine.empty() ? std::string() : " for engine '" + owner.engine + "'") +
        " through the backend its address names (instance " + std::to_string(owner.instance) +
        "; a backend made again since registers as another)");
  }
  return FailedPreconditionError(who + "'s table of registered regions changed under " +
                                 std::to_string(kAttempts) + " reads in a row");
}

ProcessIdentity LocalProcessIdentity() {
  ProcessIdentity id;
  id.pid = static_cast<std::uint32_t>(::getpid());
  struct stat st{};
  if (::stat("/proc/self/ns/pid", &st) == 0) {
    id.pidns_dev = st.st_dev;
    id.pidns_ino = st.st_ino;
  }
  CookieState& state = Cookie();
  std::lock_guard<std::mutex> lock(state.mutex);
  const PublishedHeader& header = OwnedCookie(state).header;
  id.cookie_address = reinterpret_cast<std::uintptr_t>(&header);
  id.cookie = header.cookie;
  return id;
}

ProcessPresence ProbeProcessIdentity(const ProcessIdentity& peer) {
  struct stat self{};
  if (peer.pid == 0 || ::stat("/proc/self/ns/pid", &self) != 0 || peer.pidns_ino != self.st_ino ||
      peer.pidns_dev != self.st_dev) {
    return ProcessPresence::kUnknown;
  }
  const auto pid = static_cast<pid_t>(peer.pid);
  switch (ReadCookieThrough(pid, peer)) {
    case CookieRead::kCookie:
      return ProcessPresence::kAlive;
    case CookieRead::kOtherCookie:
      return ProcessPresence::kGone;
    case CookieRead::kNoSuchThread:
      return ProbeThroughOtherThreads(pid, peer);
    case CookieRead::kRefused:
      break;
  }
  return ProcessPresence::kUnknown;
}

bool VerifyProcessIdentity(const ProcessIdentity& peer) {
  return ProbeProcessIdentity(peer) == ProcessPresence::kAlive;
}

HostId LocalHostId() {
  static const HostId id = [] {
    HostId out{};
    std::ifstream f("/proc/sys/kernel/random/boot_id");
    std::string text;
    std::getline(f, text);
    std::size_t n = 0;
    int nibble = -1;
    for (char c : text) {
      if (!std::isxdigit(static_cast<unsigned char>(c)) || n == out.size()) continue;
      const int v = std::isdigit(static_cast<unsigned char>(c)) ? c - '0'
                                                                : std::tolower(c) - 'a' + 10;
      if (nibble < 0) {
        nibble = v;
      } else {
        out[n++] = static_cast<std::uint8_t>((nibble << 4) | v);
        nibble = -1;
      }
    }
    if (n != out.size()) {
      // No boot_id (not Linux procfs): the host name is the next best thing.
      char host[256] = {};
      ::gethostname(host, sizeof(host) - 1);
      const std::uint64_t h =
          Fnv1a({reinterpret_cast<const std::uint8_t*>(host), std::strlen(host)});
      for (std::size_t i = 0; i < out.size(); ++i) {
        out[i] = static_cast<std::uint8_t>(h >> (8 * (i % 8)));
      }
    }
    return out;
  }();
  return id;
}

std::vector<std::uint8_t> EncodeAddress(std::uint32_t ucx_version, const HostId& host,
                                        const ProcessIdentity& process, std::uint64_t instance,
                                        std::span<const std::uint8_t> blob,
                                        std::uint32_t flags) {
  std::vector<std::uint8_t> out;
  out.reserve(kAddressHeader + blob.size());
  for (char c : kAddressMagic) out.push_back(static_cast<std::uint8_t>(c));
  Put(out, ucx_version, 4);
  Put(out, blob.size(), 4);
  for (std::uint8_t b : host) out.push_back(b);
  Put(out, process.pid, 4);
  Put(out, flags, 4);
  Put(out, process.pidns_dev, 8);
  Put(out, process.pidns_ino, 8);
  Put(out, process.cookie_address, 8);
  for (std::uint8_t b : process.cookie) out.push_back(b);
  Put(out, instance, 8);
  Put(out, Checksum(out, blob), 8);
  out.insert(out.end(), blob.begin(), blob.end());
  return out;
}

Result<WireAddress> DecodeAddress(std::span<const std::uint8_t> bytes) {
  if (bytes.size() < kAddressHeader) {
    return InvalidArgumentError("UCX peer address is " + std::to_string(bytes.size()) +
                                " bytes, shorter than its " + std::to_string(kAddressHeader) +
                                "-byte header");
  }
  for (std::size_t format = 0; format < kOlderAddressMagics.size(); ++format) {
    const std::string_view magic = kOlderAddressMagics[format];
    if (std::memcmp(bytes.data(), magic.data(), magic.size()) == 0) {
      return InvalidArgumentError("UCX peer address is in format " + std::to_string(format + 1) +
                                  " (an older moriio-native); both sides need the same "
                                  "moriio-native version");
    }
  }
  if (std::memcmp(bytes.data(), kAddressMagic.data(), kAddressMagic.size()) != 0) {
    return InvalidArgumentError(
        "UCX peer address does not start with the ucx backend's magic (not produced by "
        "LocalAddress of a ucx backend)");
  }
  WireAddress out;
  out.ucx_version = static_cast<std::uint32_t>(Get(bytes, 8, 4));
  const auto len = static_cast<std::uint32_t>(Get(bytes, 12, 4));
  if (len == 0 || len > kMaxBlob || bytes.size() != kAddressHeader + len) {
    return InvalidArgumentError("UCX peer address is " + std::to_string(bytes.size()) +
                                " bytes but its header announces " + std::to_string(len) +
                                " bytes of worker address (truncated or corrupted)");
  }
  std::memcpy(out.host.data(), bytes.data() + 16, out.host.size());
  out.process.pid = static_cast<std::uint32_t>(Get(bytes, 32, 4));
  out.flags = static_cast<std::uint32_t>(Get(bytes, 36, 4));
  out.process.pidns_dev = Get(bytes, 40, 8);
  out.process.pidns_ino = Get(bytes, 48, 8);
  out.process.cookie_address = Get(bytes, 56, 8);
  std::memcpy(out.process.cookie.data(), bytes.data() + 64, out.process.cookie.size());
  out.instance = Get(bytes, 80, 8);
  out.blob = bytes.subspan(kAddressHeader);
  if (Checksum(bytes.first(kAddressSumAt), out.blob) != Get(bytes, kAddressSumAt, 8)) {
    return InvalidArgumentError("UCX peer address checksum mismatch (corrupted in transit)");
  }
  return out;
}

std::vector<std::uint8_t> EncodeKey(const WireKey& key) {
  std::vector<std::uint8_t> out;
  out.reserve(kKeyHeader + key.blob.size());
  for (char c : kKeyMagic) out.push_back(static_cast<std::uint8_t>(c));
  Put(out, static_cast<std::uint8_t>(key.kind), 1);
  Put(out, key.flags, 1);
  Put(out, 0, 2);
  Put(out, key.blob.size(), 4);
  Put(out, key.region_start, 8);
  Put(out, key.region_size, 8);
  Put(out, Checksum(out, key.blob), 8);
  out.insert(out.end(), key.blob.begin(), key.blob.end());
  return out;
}

Result<WireKey> DecodeKey(std::span<const std::uint8_t> bytes) {
  if (bytes.size() < kKeyHeader) {
    return InvalidArgumentError("UCX remote key is " + std::to_string(bytes.size()) +
                                " bytes, shorter than its " + std::to_string(kKeyHeader) +
                                "-byte header");
  }
  if (std::memcmp(bytes.data(), kKeyMagic.data(), kKeyMagic.size()) != 0) {
    return InvalidArgumentError(
        "UCX remote key does not start with the ucx backend's magic (not a remote_key of a ucx "
        "backend registration)");
  }
  WireKey out;
  const auto kind = static_cast<std::uint8_t>(Get(bytes, 8, 1));
  if (kind > static_cast<std::uint8_t>(MemoryKind::kRocm)) {
    return InvalidArgumentError("UCX remote key names unknown memory kind " +
                                std::to_string(kind));
  }
  out.kind = static_cast<MemoryKind>(kind);
  out.flags = static_cast<std::uint8_t>(Get(bytes, 9, 1));
  const auto len = static_cast<std::uint32_t>(Get(bytes, 12, 4));
  if (len == 0 || len > kMaxBlob || bytes.size() != kKeyHeader + len) {
    return InvalidArgumentError("UCX remote key is " + std::to_string(bytes.size()) +
                                " bytes but its header announces " + std::to_string(len) +
                                " bytes of rkey (truncated or corrupted)");
  }
  out.region_start = Get(bytes, 16, 8);
  out.region_size = Get(bytes, 24, 8);
  out.blob = bytes.subspan(kKeyHeader);
  if (Checksum(bytes.first(32), out.blob) != Get(bytes, 32, 8)) {
    return InvalidArgumentError("UCX remote key checksum mismatch (corrupted in transit)");
  }
  if (out.region_size == 0 || out.region_start + out.region_size < out.region_start) {
    return InvalidArgumentError("UCX remote key describes an empty or wrapping region");
  }
  return out;
}

namespace {

/// A push request's header (its checksum still zero) and reply address; `count` goes in the run
/// count field.
std::vector<std::uint8_t> PushRequestHead(const PushId& id, std::uint64_t flags,
                                          std::span<const std::uint8_t> reply_address,
                                          std::uint64_t region_start, std::uint64_t region_size,
                                          std::uint64_t count) {
  std::vector<std::uint8_t> out;
  for (char c : kPushMagic) out.push_back(static_cast<std::uint8_t>(c));
  Put(out, id.nonce, 8);
  Put(out, id.seq, 8);
  Put(out, reply_address.size(), 4);
  Put(out, count, 4);
  Put(out, region_start, 8);
  Put(out, region_size, 8);
  Put(out, flags, 8);
  Put(out, 0, 8);  // the checksum: SealPushRequest
  out.insert(out.end(), reply_address.begin(), reply_address.end());
  return out;
}

std::vector<std::uint8_t> SealPushRequest(std::vector<std::uint8_t> out) {
  const std::span<const std::uint8_t> all(out);
  const std::uint64_t sum = Checksum(all.first(kPushSumAt), all.subspan(kPushHeader));
  for (int i = 0; i < 8; ++i) out[kPushSumAt + i] = static_cast<std::uint8_t>(sum >> (8 * i));
  return out;
}

}  // namespace

std::vector<std::uint8_t> EncodePushRequest(const PushId& id, std::uint64_t flags,
                                            std::span<const std::uint8_t> reply_address,
                                            std::uint64_t region_start, std::uint64_t region_size,
                                            std::span<const std::int64_t> offsets,
                                            std::span<const std::int64_t> sizes) {
  std::vector<std::uint8_t> out =
      PushRequestHead(id, flags, reply_address, region_start, region_size, sizes.size());
  for (std::size_t i = 0; i < sizes.size(); ++i) {
    Put(out, static_cast<std::uint64_t>(offsets[i]), 8);
    Put(out, static_cast<std::uint64_t>(sizes[i]), 8);
  }
  return SealPushRequest(std::move(out));
}

std::vector<std::uint8_t> EncodeRegionCheck(const PushId& id, std::uint64_t flags,
                                            std::span<const std::uint8_t> reply_address,
                                            const MemoryRange& range, std::string_view owner,
                                            std::span<const std::uint8_t> key) {
  flags |= kPushFlagRegionCheck | (static_cast<std::uint64_t>(range.kind) << 8);
  std::vector<std::uint8_t> out =
      PushRequestHead(id, flags, reply_address, range.address, range.size, owner.size());
  out.insert(out.end(), owner.begin(), owner.end());
  out.insert(out.end(), key.begin(), key.end());
  return SealPushRequest(std::move(out));
}

Result<PushReplyTo> DecodePushReplyTo(std::span<const std::uint8_t> bytes) {
  if (bytes.size() < kPushHeader ||
      std::memcmp(bytes.data(), kPushMagic.data(), kPushMagic.size()) != 0) {
    return InvalidArgumentError("push request of " + std::to_string(bytes.size()) +
                                " bytes does not start with the ucx backend's push header");
  }
  PushReplyTo out;
  out.id.nonce = Get(bytes, 8, 8);
  out.id.seq = Get(bytes, 16, 8);
  out.flags = Get(bytes, 48, 8);
  const std::uint64_t address_len = Get(bytes, 24, 4);
  if (address_len > bytes.size() - kPushHeader) {
    return InvalidArgumentError("push request " + std::to_string(out.id.seq) + " announces a " +
                                std::to_string(address_len) + "-byte reply address in " +
                                std::to_string(bytes.size()) + " bytes");
  }
  out.reply_address = bytes.subspan(kPushHeader, address_len);
  if (Result<WireAddress> address = DecodeAddress(out.reply_address); !address.ok()) {
    return InvalidArgumentError("push request " + std::to_string(out.id.seq) +
                                ": reply address: " + address.status().message());
  }
  return out;
}

Result<PushRequest> DecodePushRequest(std::span<const std::uint8_t> bytes) {
  Result<PushReplyTo> to = DecodePushReplyTo(bytes);
  if (!to.ok()) return to.status();
  PushRequest out;
  out.id = to->id;
  out.flags = to->flags;
  out.reply_address = to->reply_address;
  const std::uint64_t address_len = to->reply_address.size();
  const bool check = (out.flags & kPushFlagRegionCheck) != 0;
  // A region check carries the engine id it asks about where a push READ carries its runs.
  const std::uint64_t owner_len = check ? Get(bytes, 28, 4) : 0;
  const std::uint64_t runs = check ? 0 : Get(bytes, 28, 4);
  out.region_start = Get(bytes, 32, 8);
  out.region_size = Get(bytes, 40, 8);
  const std::string what = "push request " + std::to_string(out.id.seq);
  if (runs > kMaxPushRuns) {
    return InvalidArgumentError(what + " carries " + std::to_string(runs) +
                                " runs, more than a push request may (" +
                                std::to_string(kMaxPushRuns) + ")");
  }
  if (owner_len > kMaxOwnerBytes) {
    return InvalidArgumentError(what + " names an engine id of " + std::to_string(owner_len) +
                                " bytes, more than one may have (" +
                                std::to_string(kMaxOwnerBytes) + ")");
  }
  // A region check's key is the rest of the message.
  const std::uint64_t fixed = kPushHeader + address_len + 16 * runs + owner_len;
  if (address_len == 0 || address_len > kMaxBlob || bytes.size() < fixed ||
      (check ? bytes.size() - fixed > kMaxBlob : bytes.size() != fixed)) {
    return InvalidArgumentError(what + " is " + std::to_string(bytes.size()) +
                                " bytes but its header announces a " +
                                std::to_string(address_len) + "-byte address and " +
                                std::to_string(runs) + " runs or a " + std::to_string(owner_len) +
                                "-byte engine id (truncated or corrupted)");
  }
  if (Checksum(bytes.first(kPushSumAt), bytes.subspan(kPushHeader)) !=
      Get(bytes, kPushSumAt, 8)) {
    return InvalidArgumentError(what + ": checksum mismatch (corrupted in transit)");
  }
  if (out.region_start + out.region_size < out.region_start) {
    return InvalidArgumentError(what + ": region [" + std::to_string(out.region_start) + ", +" +
                                std::to_string(out.region_size) + ") wraps around");
  }
  if (check && ((out.flags >> 8) & 0xff) > static_cast<std::uint64_t>(MemoryKind::kRocm)) {
    return InvalidArgumentError(what + " is a region check of unknown memory kind " +
                                std::to_string((out.flags >> 8) & 0xff));
  }
  out.offsets.resize(runs);
  out.sizes.resize(runs);
  std::size_t at = kPushHeader + address_len;
  for (std::size_t i = 0; i < runs; ++i, at += 16) {
    out.offsets[i] = Get(bytes, at, 8);
    out.sizes[i] = Get(bytes, at + 8, 8);
  }
  out.owner.assign(reinterpret_cast<const char*>(bytes.data() + at), owner_len);
  out.key.assign(bytes.begin() + static_cast<std::ptrdiff_t>(at + owner_len), bytes.end());
  return out;
}

MemoryKind PushRequestKind(const PushRequest& request) {
  if ((request.flags & kPushFlagRegionCheck) == 0) return MemoryKind::kHost;
  return static_cast<MemoryKind>((request.flags >> 8) & 0xff);
}

Status CheckPushRuns(const PushRequest& request) {
  for (std::size_t i = 0; i < request.sizes.size(); ++i) {
    const std::uint64_t offset = request.offsets[i], size = request.sizes[i];
    if (size == 0 || offset > request.region_size || size > request.region_size - offset) {
      return OutOfRangeError("push request " + std::to_string(request.id.seq) + ": run " +
                             std::to_string(i) + " (offset " + std::to_string(offset) + ", " +
                             std::to_string(size) + " bytes) is empty or not inside the region of " +
                             std::to_string(request.region_size) + " bytes");
    }
  }
  return Status::OK();
}

std::vector<std::uint8_t> EncodePushHeader(std::initializer_list<std::uint64_t> fields) {
  std::vector<std::uint8_t> out;
  out.reserve(8 * fields.size());
  for (std::uint64_t f : fields) Put(out, f, 8);
  return out;
}

std::uint64_t PushHeaderField(std::span<const std::uint8_t> header, std::size_t index) {
  return Get(header, 8 * index, 8);
}

}  // namespace moriio_native::detail::ucx
