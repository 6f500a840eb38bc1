#include "ucx_options.hpp"

#include <cctype>
#include <cstddef>
#include <optional>
#include <stdexcept>
#include <string>
#include <string_view>

namespace moriio_native::detail::ucx {
namespace {

std::string Trim(std::string_view s) {
  while (!s.empty() && std::isspace(static_cast<unsigned char>(s.front()))) s.remove_prefix(1);
  while (!s.empty() && std::isspace(static_cast<unsigned char>(s.back()))) s.remove_suffix(1);
  return std::string(s);
}

const std::string* Find(const BackendOptions& options, std::string_view key) {
  auto it = options.find(key);
  return it == options.end() ? nullptr : &it->second;
}

bool ValidName(std::string_view name) {
  if (name.empty()) return false;
  for (char ch : name) {
    const auto c = static_cast<unsigned char>(ch);
    if (!(std::isupper(c) || std::isdigit(c) || c == '_')) return false;
  }
  return true;
}

/// `text` (trimmed) as a whole number from `min` to `max`; nullopt for anything else (a sign,
/// trailing characters, out of range).
std::optional<unsigned long long> WholeNumber(std::string_view text, unsigned long long min,
                                              unsigned long long max) {
  const std::string trimmed = Trim(text);
  std::size_t used = 0;
  unsigned long long n = 0;
  try {
    n = std::stoull(trimmed, &used);
  } catch (const std::exception&) {
    return std::nullopt;
  }
  const bool signed_text = !trimmed.empty() && (trimmed[0] == '-' || trimmed[0] == '+');
  if (trimmed.empty() || used != trimmed.size() || signed_text || n < min || n > max) {
    return std::nullopt;
  }
  return n;
}

}  // namespace

Result<UcxOptions> ParseUcxOptions(const BackendOptions& options) {
  UcxOptions out;
  if (const auto* v = Find(options, "ucx_library_path")) out.library_path = Trim(*v);
  if (const auto* v = Find(options, "ucx_tls")) out.tls = Trim(*v);
  if (const auto* v = Find(options, "ucx_net_devices")) out.net_devices = Trim(*v);
  if (const auto* v = Find(options, "progress_mode")) {
    std::string mode = Trim(*v);
    if (mode.empty() || mode == "thread") {
      out.progress_mode = ProgressMode::kThread;
    } else if (mode == "busy") {
      out.progress_mode = ProgressMode::kBusy;
    } else {
      return InvalidArgumentError("option progress_mode='" + *v +
                                  "' is not valid for the ucx backend: use 'thread' or 'busy'");
    }
  }
  if (const auto* v = Find(options, "ucx_direct_copy")) {
    std::string mode = Trim(*v);
    if (mode.empty() || mode == "auto" || mode == "on") {
      out.direct_copy = true;
    } else if (mode == "off") {
      out.direct_copy = false;
    } else {
      return InvalidArgumentError("option ucx_direct_copy='" + *v +
                                  "' is not valid: use 'auto' or 'off'");
    }
  }
  if (const auto* v = Find(options, "ucx_stamps")) {
    const std::string mode = Trim(*v);
    if (mode != "on" && mode != "off") {
      return InvalidArgumentError("option ucx_stamps='" + *v + "' is not valid: use 'on' or 'off'");
    }
    out.stamps = mode == "on";
  }
  if (const auto* v = Find(options, "ucx_error_handling")) {
    std::string mode = Trim(*v);
    if (mode.empty() || mode == "auto") {
      out.error_handling = ErrorHandling::kAuto;
    } else if (mode == "peer") {
      out.error_handling = ErrorHandling::kPeer;
    } else if (mode == "none") {
      out.error_handling = ErrorHandling::kNone;
    } else {
      return InvalidArgumentError("option ucx_error_handling='" + *v +
                                  "' is not valid: use 'auto', 'peer' or 'none'");
    }
  }
  if (const auto* v = Find(options, "ucx_read_push")) {
    std::string mode = Trim(*v);
    if (mode.empty() || mode == "auto") {
      out.read_push = ReadPush::kAuto;
    } else if (mode == "on") {
      out.read_push = ReadPush::kOn;
    } else if (mode == "off") {
      out.read_push = ReadPush::kOff;
    } else {
      return InvalidArgumentError("option ucx_read_push='" + *v +
                                  "' is not valid: use 'auto', 'on' or 'off'");
    }
  }
  if (const auto* v = Find(options, "ucx_push_queue")) {
    const auto n = WholeNumber(*v, 1, 1u << 20);
    if (!n) {
      return InvalidArgumentError("option ucx_push_queue='" + *v +
                                  "' is not valid: use a whole number from 1 to 1048576");
    }
    out.push_queue = static_cast<std::size_t>(*n);
  }
  if (const auto* v = Find(options, "ucx_region_check_timeout_ms")) {
    constexpr unsigned long long kYearMs = 365ULL * 24 * 3600 * 1000;
    const auto ms = WholeNumber(*v, 1, kYearMs);
    if (!ms) {
      return InvalidArgumentError("option ucx_region_check_timeout_ms='" + *v +
                                  "' is not valid: use a whole number of milliseconds from 1 "
                                  "to 31536000000 (a year)");
    }
    out.region_check_timeout = std::chrono::milliseconds(*ms);
  }
  if (const auto* v = Find(options, "ucx_config")) {
    std::string_view rest = *v;
    while (!rest.empty()) {
      std::size_t semi = rest.find(';');
      std::string item = Trim(rest.substr(0, semi));
      rest = semi == std::string_view::npos ? std::string_view() : rest.substr(semi + 1);
      if (item.empty()) continue;
      std::size_t eq = item.find('=');
      std::string name =
          eq == std::string::npos ? item : Trim(std::string_view(item).substr(0, eq));
      if (name.rfind("UCX_", 0) == 0) name = name.substr(4);
      if (eq == std::string::npos || !ValidName(name)) {
        return InvalidArgumentError("option ucx_config: item '" + item +
                                    "' is not NAME=VALUE with an upper-case UCX setting name");
      }
      out.config.emplace_back(name, Trim(std::string_view(item).substr(eq + 1)));
    }
  }
  return out;
}

}  // namespace moriio_native::detail::ucx
