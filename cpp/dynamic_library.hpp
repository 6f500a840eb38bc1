#pragma once

// The one dlopen/dlsym wrapper of the core and the plugins: an owned library handle whose errors
// name the library, the symbol and dlerror()'s reason. Header-only so plugins (built as separate
// modules) use the same code without exporting it from the core library.

#include <dlfcn.h>

#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "moriio_native/status.hpp"

namespace moriio_native::detail {

/// An open shared library. Move-only RAII: the destructor dlcloses it unless KeepLoaded() was
/// called (for libraries whose code or threads may outlive every caller: plugins, UCX). Not
/// thread-safe itself; distinct handles may be used from distinct threads (dlerror is per thread).
class DynamicLibrary {
 public:
  DynamicLibrary() = default;
  DynamicLibrary(DynamicLibrary&& other) noexcept
      : name_(std::move(other.name_)),
        handle_(std::exchange(other.handle_, nullptr)),
        keep_(other.keep_) {}
  DynamicLibrary& operator=(DynamicLibrary&& other) noexcept {
    if (this != &other) {
      Close();
      name_ = std::move(other.name_);
      handle_ = std::exchange(other.handle_, nullptr);
      keep_ = other.keep_;
    }
    return *this;
  }
  DynamicLibrary(const DynamicLibrary&) = delete;
  DynamicLibrary& operator=(const DynamicLibrary&) = delete;
  ~DynamicLibrary() { Close(); }

  /// dlopen(`name`, `flags`): a path or a soname searched the loader's way. BackendUnavailable
  /// "cannot load <name>: <dlerror>" on failure. Blocks while the library loads and runs its
  /// initialisers.
  static Result<DynamicLibrary> Open(const std::string& name, int flags = RTLD_NOW | RTLD_LOCAL) {
    ::dlerror();  // a stale error from elsewhere must not be reported as ours
    void* handle = ::dlopen(name.c_str(), flags);
    if (handle == nullptr) {
      return BackendUnavailableError("cannot load " + name + ": " + LastError());
    }
    DynamicLibrary lib;
    lib.name_ = name;
    lib.handle_ = handle;
    return lib;
  }

  /// The first of `names` that opens; BackendUnavailable listing every attempt's reason.
  static Result<DynamicLibrary> OpenFirst(const std::vector<std::string>& names,
                                          int flags = RTLD_NOW | RTLD_LOCAL) {
    std::string reasons;
    for (const std::string& name : names) {
      Result<DynamicLibrary> lib = Open(name, flags);
      if (lib.ok()) return lib;
      reasons += (reasons.empty() ? "" : "; ") + lib.status().message();
    }
    return BackendUnavailableError(reasons.empty() ? "no library named" : reasons);
  }

  /// The address of symbol `symbol` as a `T` (a function pointer type). NotFound
  /// "<library> has no symbol <symbol>: <dlerror>" when it is missing.
  template <typename T>
  Result<T> Symbol(const char* symbol) const {
    if (handle_ == nullptr) return FailedPreconditionError("no library is open");
    ::dlerror();
    void* address = ::dlsym(handle_, symbol);
    if (address == nullptr) {
      return NotFoundError(name_ + " has no symbol " + symbol + ": " + LastError());
    }
    return reinterpret_cast<T>(address);
  }

  /// The name it was opened with.
  const std::string& name() const { return name_; }

  /// Never dlclose this library (the handle may still be destroyed).
  void KeepLoaded() { keep_ = true; }

  /// The file holding the code at `address` (dladdr), or "" when the loader does not know it.
  static std::string FileOf(const void* address) {
    Dl_info info{};
    if (address == nullptr || ::dladdr(address, &info) == 0 || info.dli_fname == nullptr) {
      return "";
    }
    return info.dli_fname;
  }

  /// The directory of FileOf(address) without a trailing slash, or "." when unknown.
  static std::string DirectoryOf(const void* address) {
    const std::string file = FileOf(address);
    const auto slash = file.rfind('/');
    return slash == std::string::npos ? "." : file.substr(0, slash);
  }

 private:
  static std::string LastError() {
    const char* why = ::dlerror();
    return why != nullptr ? why : "unknown dynamic loader error";
  }

  void Close() {
    if (handle_ != nullptr && !keep_) ::dlclose(handle_);
    handle_ = nullptr;
  }

  std::string name_;
  void* handle_ = nullptr;
  bool keep_ = false;
};

}  // namespace moriio_native::detail
