#!/usr/bin/env bash
# Fetches the amd-mori wheel (MoRI-IO's libraries and headers) without installing it, so the
# MoRI backend plugin can be compiled and linked on a machine without ROCm.
#
#   scripts/fetch_mori.sh DIR            # e.g. .deps/mori
#   cmake ... -DMORI_ROOT="$(scripts/fetch_mori.sh .deps/mori)"
#
# Prints exactly one line on stdout: the MORI_ROOT to pass to CMake (the directory that holds the
# unpacked `mori/` package). Progress and errors go to stderr. Running it again reuses what is
# already there.
#
# Environment:
#   MORI_VERSION   amd-mori version to fetch (default 1.2.4)
#   MORI_WHEEL_TAG "cp310" (manylinux_2_35, ROCm 7.2) or "cp312" (manylinux_2_39, ROCm 7.14);
#                  default: picked from this machine's glibc (cp312 needs glibc >= 2.38).
#   PIP            pip command (default: python3 -m pip)
set -euo pipefail

die() { echo "fetch_mori.sh: $*" >&2; exit 1; }

[[ $# -eq 1 ]] || die "usage: $0 DIR"
dir=$1
version=${MORI_VERSION:-1.2.4}
pip_cmd=${PIP:-python3 -m pip}

glibc=$(getconf GNU_LIBC_VERSION 2>/dev/null | awk '{print $2}') || true
[[ -n ${glibc:-} ]] || die "cannot read the glibc version (getconf GNU_LIBC_VERSION); MoRI wheels need glibc"
glibc_minor=${glibc#*.}

tag=${MORI_WHEEL_TAG:-}
if [[ -z $tag ]]; then
  # The cp312 build needs GLIBC_2.38 and GCC 13's libstdc++; the cp310 build runs from 2.35 on.
  if (( glibc_minor >= 38 )); then tag=cp312; elif (( glibc_minor >= 35 )); then tag=cp310; else
    die "glibc $glibc is older than 2.35, the oldest amd-mori $version wheel's requirement"
  fi
fi
case $tag in
  cp310) pyver=3.10; platform=manylinux_2_35_x86_64 ;;
  cp312) pyver=3.12; platform=manylinux_2_39_x86_64 ;;
  *) die "MORI_WHEEL_TAG must be cp310 or cp312, not '$tag'" ;;
esac

mkdir -p "$dir"
dir=$(cd "$dir" && pwd)
wheel_dir=$dir/wheel
root=$dir/$tag-$version

if [[ ! -f $root/mori/libmori_io.so || ! -f $root/mori/_jit-sources/include/mori/io/io.hpp ]]; then
  mkdir -p "$wheel_dir"
  echo "fetch_mori.sh: downloading amd-mori==$version ($tag, $platform) into $wheel_dir" >&2
  $pip_cmd download --no-deps --only-binary=:all: --python-version "$pyver" --implementation cp \
    --platform "$platform" "amd-mori==$version" -d "$wheel_dir" >&2 \
    || die "pip download of amd-mori==$version for $platform failed (network, index or tag)"
  shopt -s nullglob
  wheels=("$wheel_dir"/amd_mori-"$version"-"$tag"-*"$platform"*.whl)
  shopt -u nullglob
  [[ ${#wheels[@]} -eq 1 ]] || die "expected one amd_mori-$version-$tag wheel in $wheel_dir, found ${#wheels[@]}"
  rm -rf "$root.tmp"
  mkdir -p "$root.tmp"
  # A wheel is a zip; python's zipfile avoids depending on unzip being installed.
  python3 -m zipfile -e "${wheels[0]}" "$root.tmp" >&2 || die "cannot unpack ${wheels[0]}"
  rm -rf "$root"
  mv "$root.tmp" "$root"
fi

for f in mori/libmori_io.so mori/libmori_application.so mori/_jit-sources/include/mori/io/io.hpp \
         mori/_jit-sources/3rdparty/msgpack-c/include/msgpack.hpp \
         mori/_jit-sources/3rdparty/spdlog/include/spdlog/spdlog.h; do
  [[ -f $root/$f ]] || die "unpacked wheel lacks $f (layout changed?) in $root"
done
echo "$root"
