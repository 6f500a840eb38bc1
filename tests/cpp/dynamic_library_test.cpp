// The one dlopen/dlsym helper: errors name the library, the symbol and the loader's reason, and
// the handle is owned (moves, closes once).

#include "dynamic_library.hpp"

#include <gtest/gtest.h>

#include <cstring>
#include <string>
#include <utility>

#include "moriio_native/backend.hpp"

namespace {

using moriio_native::StatusCode;
using moriio_native::detail::DynamicLibrary;

TEST(DynamicLibrary, MissingLibraryNamesItAndTheLoadersReason) {
  auto lib = DynamicLibrary::Open("/nonexistent/dir/libmoriio_nothing.so");
  ASSERT_FALSE(lib.ok());
  EXPECT_EQ(lib.status().code(), StatusCode::kBackendUnavailable);
  EXPECT_NE(lib.status().message().find("/nonexistent/dir/libmoriio_nothing.so"),
            std::string::npos)
      << lib.status().ToString();
  EXPECT_NE(lib.status().message().find("No such file"), std::string::npos)
      << lib.status().ToString();
}

TEST(DynamicLibrary, OpenFirstListsEveryAttempt) {
  auto lib = DynamicLibrary::OpenFirst({"libmoriio_none_a.so", "libmoriio_none_b.so"});
  ASSERT_FALSE(lib.ok());
  EXPECT_NE(lib.status().message().find("libmoriio_none_a.so"), std::string::npos);
  EXPECT_NE(lib.status().message().find("libmoriio_none_b.so"), std::string::npos);
  auto libc = DynamicLibrary::OpenFirst({"libmoriio_none_a.so", "libc.so.6"});
  ASSERT_TRUE(libc.ok()) << libc.status().ToString();
  EXPECT_EQ(libc->name(), "libc.so.6");
}

TEST(DynamicLibrary, SymbolsResolveAndAMissingOneNamesLibraryAndSymbol) {
  auto libc = DynamicLibrary::Open("libc.so.6");
  ASSERT_TRUE(libc.ok()) << libc.status().ToString();
  using StrlenFn = std::size_t (*)(const char*);
  auto strlen_fn = libc->Symbol<StrlenFn>("strlen");
  ASSERT_TRUE(strlen_fn.ok()) << strlen_fn.status().ToString();
  EXPECT_EQ((*strlen_fn)("moriio"), 6u);
  auto missing = libc->Symbol<StrlenFn>("moriio_no_such_symbol");
  ASSERT_FALSE(missing.ok());
  EXPECT_EQ(missing.status().code(), StatusCode::kNotFound);
  EXPECT_NE(missing.status().message().find("libc.so.6 has no symbol moriio_no_such_symbol"),
            std::string::npos)
      << missing.status().ToString();
}

TEST(DynamicLibrary, MovedFromHandleHasNoLibrary) {
  auto libc = DynamicLibrary::Open("libc.so.6");
  ASSERT_TRUE(libc.ok());
  DynamicLibrary moved = std::move(*libc);
  EXPECT_TRUE(moved.Symbol<void (*)()>("abort").ok());
  EXPECT_EQ(libc->Symbol<void (*)()>("abort").status().code(), StatusCode::kFailedPrecondition);
}

TEST(DynamicLibrary, FileAndDirectoryOfCode) {
  // A function of the core library (libc's could be a sanitizer's interceptor).
  const void* here = reinterpret_cast<const void*>(&moriio_native::AvailableBackends);
  EXPECT_NE(DynamicLibrary::FileOf(here).find("libmoriio_native"), std::string::npos)
      << DynamicLibrary::FileOf(here);
  const std::string dir = DynamicLibrary::DirectoryOf(here);
  EXPECT_FALSE(dir.empty());
  EXPECT_NE(dir.back(), '/');
  EXPECT_EQ(DynamicLibrary::FileOf(nullptr), "");
  EXPECT_EQ(DynamicLibrary::DirectoryOf(nullptr), ".");
}

}  // namespace
