#!/usr/bin/env bash
# One H200 device session of issue 18's measurements, in steps (each a separate `run` call so
# that each ends well inside the device tool's 10-minute limit). Run from the repository root on
# the device, with the libucx-cu13 wheel's files in .ucx/ (libucx/include, libucx/lib,
# libucx_cu13.libs) and the previous kernel's source in .variants/old_cudacopy.cu:
#   bash bench/h200_session.sh build      # plugins (this tree + kernel variants), UCX backend
#   bash bench/h200_session.sh kernel     # cudacopy_bench for every variant, kernel pytest
#   bash bench/h200_session.sh e2e        # GPU pytest, compute-sanitizer, gpu_bench presets
#   bash bench/h200_session.sh overlap    # per-layer WRITE overlapped with a synthetic forward
#   bash bench/h200_session.sh cells      # one call: build without UCX, kernel pytest, the
#                                         # transposing cell copy and cudacopy_bench
#   bash bench/h200_session.sh cell-variants  # cell kernel variants (-D values), and the run
#                                         # kernel's submit before (.variants/unfused_cudacopy.cu)
#   bash bench/h200_session.sh cell-e2e   # one call: build with UCX, the engine's cell path
#                                         # (GPU pytest) and gpu_bench NHD -> HND end to end
#   bash bench/h200_session.sh run-kernel # one call: the CTA kernel for aligned runs, its
#                                         # variants and the kernel before it
#                                         # (.variants/base_cudacopy.cu), small-run batches, memcheck
#   bash bench/h200_session.sh run-e2e    # one call: build with UCX, GPU pytest, gpu_bench
#                                         # presets (4 KiB runs too) with this kernel and the one
#                                         # before it
#   bash bench/h200_session.sh checks     # one call: every GPU test (kernels, cells, verify's
#                                         # device checksums, UCX two processes) and the
#                                         # checksums' cost (torch, the plugin's kernel) against
#                                         # a device copy, 1 GiB and 128 MiB in 32 layers, two
#                                         # rounds (with .variants/prev_checksum.cu, else
#                                         # base_checksum.cu, that kernel too, alternating)
#   bash bench/h200_session.sh fair       # one call: build with UCX, kernel pytest, cudacopy_bench
#                                         # with a copy_ in the same memory state beside each
#                                         # size, what degrades the copy (allocator, order), and
#                                         # gpu_bench end to end (llama3-8b-tp8 first)
#   bash bench/h200_session.sh pipeline   # one call: this tree and the engine before it
#                                         # (.variants/base-src.tar, a `git archive`), both with
#                                         # UCX; GPU pytest; gpu_bench end to end for each (also
#                                         # 4 KiB runs; this tree also with progress_mode=busy),
#                                         # one profiled request's timeline each
#   bash bench/h200_session.sh timeline   # one call: this tree's build, gpu_bench's profiled
#                                         # requests (host launch and event-query times too)
#   bash bench/h200_session.sh gap        # one call: build with UCX; gpu_bench with --pre none,
#                                         # settle and prime, READ first and WRITE first (does a
#                                         # WRITE pay for the decode's checks on the shared GPU?);
#                                         # every GPU test; deepseek-v3 if time is left
#   bash bench/h200_session.sh prelaunch  # one call: this tree and base (.variants/base-044b7ad.tar,
#                                         # a `git archive`), both with UCX; every GPU test on
#                                         # this tree; gpu_bench --timeline (CUDA calls before the
#                                         # first launch) for llama3-8b (also progress_mode=busy)
#                                         # and 4 KiB runs, unprimed and primed, per build
#   bash bench/h200_session.sh marks      # one call: this tree built with the engine's timing
#                                         # marks (-DMORIIO_NATIVE_TRACE_MARKS=ON); gpu_bench
#                                         # --timeline for 4 KiB runs and llama3-8b (unprimed
#                                         # and primed): where the host time before the first
#                                         # launch goes
#   bash bench/h200_session.sh versus     # one call: this tree and base (.variants/base-src.tar),
#                                         # both with UCX, marks off; every GPU test on this tree;
#                                         # gpu_bench llama3-8b, deepseek-v3 and 4 KiB runs per
#                                         # build in turn, every byte verified
#   bash bench/h200_session.sh hostcut    # one call: `versus` (tree and base, every GPU test,
#                                         # llama3-8b, 4 KiB runs, deepseek-v3 while time is
#                                         # left), each build's block pairs alone
#                                         # (bench/pairs_bench.py), then both built with the
#                                         # marks: gpu_bench --timeline for llama3-8b per build
#                                         # (7 files in $OUT: the device tool returns 8 at most)
#   bash bench/h200_session.sh stamps     # one call: build with UCX; every GPU test (the stamp
#                                         # kernel's among them) and memcheck of the stamp kernel;
#                                         # gpu_bench llama3-8b, 4 KiB runs and deepseek-v3 with
#                                         # stamped batches (ucx_stamps on, the default) and the
#                                         # engine's runs (off), alternating, bytes verified
#   bash bench/h200_session.sh stamp-groups  # one call: the stamp kernel with at most 32, 8 and 1
#                                         # pieces per warp, 2 rounds
#   bash bench/h200_session.sh small      # one call: this tree built with the marks; every GPU
#                                         # test; gpu_bench --timeline for 4 KiB runs and
#                                         # llama3-8b, unprimed and primed: where a small-run
#                                         # request's host time goes
#   bash bench/h200_session.sh wake       # one call: this tree against itself with
#                                         # progress_mode=busy, alternating, for 4 KiB runs and
#                                         # llama3-8b: what the progress thread's wake-up costs
#   bash bench/h200_session.sh overlap-stamps  # one call: gpu_bench --overlap (per-layer WRITE
#                                         # behind a synthetic forward) for llama3-8b,
#                                         # deepseek-v3 and 4 KiB runs, stamps on and off
#   bash bench/h200_session.sh overlap-wait  # one call: gpu_bench --overlap, two rounds, each
#                                         # layer's event waited for on the GPU (the copy) or
#                                         # on the host (a writer thread), interleaved
#   bash bench/h200_session.sh write-layers  # one call: every GPU test (unless SKIP_GPU_TESTS=1),
#                                         # then gpu_bench READ, WRITE by write_layer per layer
#                                         # and by one write_layers call, two rounds, for 4 KiB
#                                         # runs, llama3-8b and deepseek-v3
#   bash bench/h200_session.sh overlap-trace   # one call: gpu_bench --overlap --overlap-trace,
#                                         # copies as UCX operations and as the kernel, llama3-8b
#                                         # (32 and 256 blocks): where the copies ran against the
#                                         # forward (GPU intervals, host calls)
#   bash bench/h200_session.sh overlap-progress  # one call: the same, copies as UCX operations,
#                                         # llama3-8b 256 blocks: default, progress_mode=busy and
#                                         # UCX_CUDA_IPC_MAX_POLL=1024, two rounds
#   bash bench/h200_session.sh gpu-tests      # one call: build with UCX, every GPU test
#   bash bench/h200_session.sh batch-check    # one call: this tree against base
#                                         # (.variants/base-src.tar, the tree before each CUDA
#                                         # copy batch checked the peer's region), both with UCX;
#                                         # gpu_bench llama3-8b and 4 KiB runs (SMALL_RUNS_ONLY=1:
#                                         # those alone), alternating
#   bash bench/h200_session.sh checksum-variants  # after checks: the checksum kernel, the one
#                                         # before it (.variants/prev_checksum.cu) and -D
#                                         # variants (8-byte loads, no cell table, 4 passes,
#                                         # streaming loads), 2 rounds
#   bash bench/h200_session.sh overlap-contiguous  # one call: llama3-8b 256 blocks as UCX
#                                         # operations, random against consecutive block ids
#                                         # (one operation per layer), two rounds, traced
#   bash bench/h200_session.sh in-flight  # one call: every GPU test (unless SKIP_GPU_TESTS=1),
#                                         # then gpu_bench for 4 KiB runs with 1, 2 and 4
#                                         # requests in flight, two rounds
#   bash bench/h200_session.sh in-flight-large  # the same for llama3-8b and deepseek-v3
#                                         # (IN_FLIGHT_OPS=read,write_layers: gpu_bench's --ops)
#   bash bench/h200_session.sh overlap-parked  # one call: every GPU test (unless
#                                         # SKIP_GPU_TESTS=1), then gpu_bench --overlap with the
#                                         # copies as UCX operations (--direct-copy off: the path
#                                         # to a peer on another node), two rounds: each layer's
#                                         # event polled by the engine against the host wait.
#                                         # BASE_TAR=tree.tar (git archive of an older tree) first
#                                         # runs this tree's event tests against that build
# Logs and JSON go to $OUT (the device tool's result folder) or ./h200-out.
set -uo pipefail
step=${1:?a step named above (build, kernel, e2e, ..., stamps, stamp-groups, small, wake, overlap-stamps, overlap-wait, write-layers, overlap-parked, overlap-trace, overlap-progress, gpu-tests, overlap-contiguous)}
root=$PWD
out=${OUT:-$root/h200-out}
build=/tmp/moriio-gpu-build
variants=/tmp/moriio-variants
mkdir -p "$out" "$variants"
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0
export MORIIO_NATIVE_UCX_LIBRARY_PATH=$root/.ucx/libucx/lib PYTHONPATH=$build/python
cuda_variant() {  # name, source, extra nvcc flags...
  local name=$1 src=$2
  shift 2
  mkdir -p "$variants/$name"
  nvcc -O3 -std=c++17 -gencode arch=compute_90,code=sm_90 -shared -Xcompiler -fPIC \
    -Icpp/cudacopy -cudart static -Xptxas -v "$@" \
    -o "$variants/$name/libmoriio_native_cudacopy.so" "$src" 2>&1 |
    grep -E "Compiling entry|registers|spill|error"
}
plugin_of() {  # the plugin of variant $1: this tree's build (tree) or one cuda_variant built
  if [ "$1" = tree ]; then
    echo "$build/lib/libmoriio_native_cudacopy.so"
  else
    echo "$variants/$1/libmoriio_native_cudacopy.so"
  fi
}
run_kernels() {  # "variants" label log [cudacopy_bench arguments]: each variant in turn, logged
  local names=$1 label=$2 log=$3 v
  shift 3
  for v in $names; do
    echo "== $label, variant $v"
    timeout 90 python3 bench/cudacopy_bench.py --plugin "$(plugin_of "$v")" --repeats 3 "$@" 2>&1 |
      grep -v "^one"
  done 2>&1 | tee "$out/$log"
}
touch_changed_sources() {  # a warm machine keeps $build between calls, and a carried source can
  # be older than the object its previous version built there, which ninja would then keep: each
  # source whose content differs from the last build's is touched (a manifest in $build)
  local manifest=$build/.sources.sha1 now
  mkdir -p $build
  now=$(find cpp include -type f | sort | xargs sha1sum)
  [ -f $manifest ] && diff <(echo "$now") $manifest | sed -n 's/^< [0-9a-f]*  //p' | xargs -r touch
  echo "$now" >$manifest
}
build_without_ucx() {  # the core, the Python module and the CUDA plugin: enough for the kernels
  nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.sm,clocks.mem --format=csv
  touch_changed_sources
  cmake -S . -B $build -G Ninja -DMORIIO_NATIVE_BUILD_PYTHON=ON -DMORIIO_NATIVE_WITH_UCX=OFF \
    -DMORIIO_NATIVE_WITH_CUDA=ON -DMORIIO_NATIVE_WITH_MORI=OFF -DMORIIO_NATIVE_BUILD_TESTS=OFF \
    -DCMAKE_CUDA_ARCHITECTURES=90 -Dpybind11_DIR="$(python3 -m pybind11 --cmakedir)" \
    >/tmp/cmake.log 2>&1 || { tail -30 /tmp/cmake.log; exit 1; }
  cmake --build $build -j16 --target stage_python moriio_native_cudacopy >/tmp/build.log 2>&1 ||
    { tail -40 /tmp/build.log; exit 1; }
}
build_with_ucx() {  # the core, the Python module, the UCX backend and the CUDA plugin
  nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.sm,clocks.mem --format=csv
  touch_changed_sources
  cmake -S . -B $build -G Ninja -DMORIIO_NATIVE_BUILD_PYTHON=ON -DMORIIO_NATIVE_WITH_UCX=ON \
    -DMORIIO_NATIVE_UCX_INCLUDE_DIR=$root/.ucx/libucx/include -DMORIIO_NATIVE_WITH_CUDA=ON \
    -DMORIIO_NATIVE_WITH_MORI=OFF -DMORIIO_NATIVE_BUILD_TESTS=OFF -DCMAKE_CUDA_ARCHITECTURES=90 \
    -DMORIIO_NATIVE_TRACE_MARKS=OFF ${extra_cmake:-} \
    -Dpybind11_DIR="$(python3 -m pybind11 --cmakedir)" >"$out/cmake.log" 2>&1 || {
    tail -30 "$out/cmake.log"; exit 1; }
  cmake --build $build -j16 --target stage_python moriio_native_ucx moriio_native_cudacopy \
    >"$out/build.log" 2>&1 || { tail -40 "$out/build.log"; exit 1; }
}
bench_variant() {  # variant (tree, base, busy), base build, time limit, gpu_bench arguments...
  local v=$1 pp=$build/python opt=""
  [ "$v" = base ] && pp=$2/python
  [ "$v" = busy ] && opt="--option progress_mode=busy"  # this tree, progress never sleeping
  [ "$v" = runs ] && opt="--option ucx_stamps=off"  # this tree, the engine planning runs
  local limit=$3
  shift 3
  nvidia-smi --query-gpu=clocks.sm,clocks.mem,temperature.gpu,power.draw --format=csv,noheader
  PYTHONPATH=$pp timeout "$limit" python3 bench/gpu_bench.py "$@" $opt --skip-per-run 2>&1 |
    grep -E "GB/s|timeline|before the first|exposed|rror"
}
build_tree_and_base() {  # base's source tar, base's build folder: both built with UCX, in parallel
  rm -rf /tmp/moriio-base-src && mkdir -p /tmp/moriio-base-src "$out/base" &&
    tar -C /tmp/moriio-base-src -xf "$1"
  (cd /tmp/moriio-base-src && build=$2 out=$out/base && build_with_ucx >/dev/null) &
  build_with_ucx || exit 1
  wait
  PYTHONPATH=$2/python python3 -c "import moriio_native as m; print('base', m.available_backends())"
  python3 -c "import moriio_native as m; print('tree', m.available_backends())"
}
marked_timelines() {  # label: gpu_bench --timeline of 4 KiB runs and llama3-8b, unprimed and
  # primed, on a build with the marks; logs and JSON named after the label
  local n=0 p
  for p in "--preset llama3-8b-tp8 --layout separated --blocks 4096 --num-blocks 8192 --requests 3" \
    "--preset llama3-8b --requests 3"; do
    n=$((n + 1))
    echo "== tree with marks: $p"
    bench_variant tree "" 150 $p --pre none --pre prime --json "$out/e2e_$1_$n.json" \
      --timeline "$out/timeline_$1_$n.json"
    echo "elapsed ${SECONDS} s"
  done 2>&1 | tee "$out/$1.log"
}
every_gpu_test() {  # this tree's GPU tests: kernels, cells, verify's checksums, UCX two processes
  timeout 200 python3 -m pytest -q -p no:cacheprovider -rs tests/py/test_cudacopy.py tests/py/test_cudacopy_edges.py \
    tests/py/test_cell_geometry.py tests/py/test_cell_transfer.py tests/py/test_verify.py \
    tests/py/test_ucx_two_process.py 2>&1 | tail -8 | tee "$out/checks.log"
  echo "elapsed ${SECONDS} s"
}
case $step in
gpu-tests)  # this tree's GPU tests alone (after a change outside the GPU paths)
  build_with_ucx || exit 1
  every_gpu_test
  ;;
build)
  build_with_ucx
  cuda_variant old .variants/old_cudacopy.cu &
  for spec in "c64 -DMORIIO_CUDACOPY_CHUNK_KIB=64"; do
    set -- $spec
    cuda_variant "$1" cpp/cudacopy/cudacopy.cu "$2" &
  done
  wait
  python3 -c "import moriio_native as m; print(m.available_backends())"
  ;;
kernel)
  for v in new old; do
    plugin=$variants/$v/libmoriio_native_cudacopy.so
    [ "$v" = new ] && plugin=$build/lib/libmoriio_native_cudacopy.so
    echo "== variant $v"
    timeout 120 python3 bench/cudacopy_bench.py --plugin "$plugin" --json "$out/cc_$v.json" 2>&1 |
      tee -a "$out/kernel.log"
  done
  timeout 120 python3 -m pytest -q -p no:cacheprovider tests/py/test_cudacopy.py 2>&1 |
    tee "$out/pytest-kernel.log" | tail -5
  ;;
e2e)
  plugin=$build/lib/libmoriio_native_cudacopy.so
  timeout 120 python3 -m pytest -q -p no:cacheprovider tests/py/test_cudacopy.py \
    tests/py/test_ucx_two_process.py 2>&1 | tail -5
  timeout 240 compute-sanitizer --tool memcheck python3 bench/cudacopy_bench.py --plugin "$plugin" \
    --gib 0.02 --repeats 1 --run-bytes 4100 --run-bytes 65536 --run-bytes 300000 2>&1 |
    grep -E "ERROR SUMMARY|runs of|rror" | head -20
  timeout 300 python3 bench/gpu_bench.py --requests 5 --skip-per-run --json "$out/gpu.json" 2>&1 |
    tee "$out/gpu.log"
  ;;
e2e-variant)  # gpu_bench again with a variant's plugin in place of this tree's
  v=${2:?variant}
  cp "$build/lib/libmoriio_native_cudacopy.so" /tmp/plugin-tree.so
  cp "$variants/$v/libmoriio_native_cudacopy.so" "$build/lib/"
  timeout 300 python3 bench/gpu_bench.py --requests 5 --skip-per-run --json "$out/gpu-$v.json" 2>&1 |
    tee "$out/gpu-$v.log"
  cp /tmp/plugin-tree.so "$build/lib/libmoriio_native_cudacopy.so"
  ;;
small-runs)  # 4 KiB runs in batches of 8,192 (as the engine cuts READs) and of 65,536
  plugin=$build/lib/libmoriio_native_cudacopy.so
  for b in 8192 65536; do
    timeout 60 python3 bench/cudacopy_bench.py --plugin "$plugin" --run-bytes 4096 \
      --run-bytes 16384 --batch-runs $b
  done
  ;;
overlap)
  timeout 300 python3 bench/gpu_bench.py --preset llama3-8b --preset deepseek-v3 --overlap \
    --requests 5 --json "$out/overlap.json" 2>&1 | tee "$out/overlap.log"
  ;;
footprint)  # is it the run layout (pages touched at once) that limits every kernel variant?
  for v in new old; do
    plugin=$variants/$v/libmoriio_native_cudacopy.so
    [ "$v" = new ] && plugin=$build/lib/libmoriio_native_cudacopy.so
    echo "== variant $v, small caches"
    timeout 60 python3 bench/cudacopy_bench.py --plugin "$plugin" --gib 0.25 --repeats 20 \
      --run-bytes 65536 --run-bytes 2097152
    echo "== variant $v, 1 GiB runs"
    timeout 60 python3 bench/cudacopy_bench.py --plugin "$plugin" --run-bytes 1073741824
  done
  ;;
cell-e2e)  # the engine's cell path through UCX on the GPU, and NHD -> HND end to end
  build_with_ucx
  python3 -c "import moriio_native as m; print(m.available_backends())"
  timeout 60 python3 -m pytest -q -p no:cacheprovider tests/py/test_cell_transfer.py \
    tests/py/test_ucx_two_process.py::test_mixed_layouts_in_gpu_memory_read_and_write 2>&1 |
    tee "$out/pytest-cells.log" | tail -5
  timeout 100 python3 bench/gpu_bench.py --preset llama3-8b --layout nhd-hnd --skip-per-run \
    --requests 3 --json "$out/gpu-nhd-hnd.json" 2>&1 | tee "$out/gpu-nhd-hnd.log"
  ;;
cells)  # the cell copy (NHD -> HND) and the run kernel, one call: no UCX needed
  build_without_ucx
  cuda_variant c2u8 cpp/cudacopy/cudacopy.cu -DMORIIO_CUDACOPY_CELL_CTAS=2 \
    -DMORIIO_CUDACOPY_CELL_UNROLL=8 &
  plugin=$build/lib/libmoriio_native_cudacopy.so
  timeout 150 python3 -m pytest -q -p no:cacheprovider tests/py/test_cudacopy.py \
    tests/py/test_cell_geometry.py 2>&1 | tee "$out/pytest.log" | tail -5
  timeout 120 python3 bench/cellcopy_bench.py --plugin "$plugin" --json "$out/cellcopy.json" 2>&1 |
    tee "$out/cellcopy.log"
  wait
  echo "== cell copy, the first version's tunables (2 CTAs per SM, unroll 8)"
  timeout 60 python3 bench/cellcopy_bench.py --plugin "$variants/c2u8/libmoriio_native_cudacopy.so" \
    --runs-gib 0 2>&1 | tee -a "$out/cellcopy.log"
  for shape in "--heads 32" "--heads 4 --head-size 64"; do
    echo "== cell copy $shape"
    timeout 60 python3 bench/cellcopy_bench.py --plugin "$plugin" --runs-gib 0 $shape 2>&1 |
      tee -a "$out/cellcopy.log"
  done
  timeout 150 python3 bench/cudacopy_bench.py --plugin "$plugin" --repeats 3 \
    --json "$out/cudacopy.json" 2>&1 |
    tee "$out/cudacopy.log"
  timeout 60 compute-sanitizer --tool memcheck python3 bench/cellcopy_bench.py --plugin "$plugin" \
    --gib 0.01 --runs-gib 0 --repeats 1 --heads 32 2>&1 | grep -E "ERROR SUMMARY|blocks|rror" | head
  ;;
cell-variants)  # kernel variants against this tree's: cell copy, and the run kernel's submit
  build_without_ucx
  plugin=$build/lib/libmoriio_native_cudacopy.so
  k=MORIIO_CUDACOPY_CELL
  specs=("c2u8 -D${k}_CTAS=2 -D${k}_UNROLL=8" "c3u4 -D${k}_CTAS=3"
    "c4u4t16 -D${k}_TILE_KIB=16")
  for spec in "${specs[@]}"; do
    set -- $spec
    name=$1
    shift
    cuda_variant "$name" cpp/cudacopy/cudacopy.cu "$@" >/dev/null &
  done
  [ -f .variants/unfused_cudacopy.cu ] && cuda_variant unfused .variants/unfused_cudacopy.cu >/dev/null &
  timeout 100 python3 -m pytest -q -p no:cacheprovider tests/py/test_cudacopy.py 2>&1 |
    tee "$out/pytest.log" | tail -3
  wait
  for v in tree "${specs[@]%% *}"; do
    p=$(plugin_of "$v")
    echo "== cell copy, variant $v"
    timeout 60 python3 bench/cellcopy_bench.py --plugin "$p" --runs-gib 0 --repeats 3 2>&1 |
      grep -E "x device|rror"
  done 2>&1 | tee "$out/cellvariants.log"
  run_kernels "tree unfused" "run kernel" runvariants.log --run-bytes 4096 --run-bytes 16384 \
    --run-bytes 32768 --run-bytes 2097152
  ;;
run-kernel)  # the run kernel at the limit, kernel alone (no UCX): one call
  build_without_ucx
  k=MORIIO_CUDACOPY
  specs=("nvtree" "c6 -D${k}_RUN_CTAS=6" "u8c3 -D${k}_RUN_UNROLL=8 -D${k}_RUN_CTAS=3"
    "ch128g64 -D${k}_ALIGNED_CHUNK_KIB=128 -D${k}_GROUP_KIB=64"
    "ch64g64 -D${k}_ALIGNED_CHUNK_KIB=64 -D${k}_GROUP_KIB=64"
    "ch16g16 -D${k}_ALIGNED_CHUNK_KIB=16 -D${k}_GROUP_KIB=16")
  for spec in "${specs[@]}"; do
    set -- $spec
    name=$1
    shift
    cuda_variant "$name" cpp/cudacopy/cudacopy.cu "$@" >"$variants/$name.ptxas" 2>&1 &
  done
  cuda_variant base .variants/base_cudacopy.cu >/dev/null &
  plugin=$build/lib/libmoriio_native_cudacopy.so
  timeout 150 python3 -m pytest -q -p no:cacheprovider tests/py/test_cudacopy.py \
    tests/py/test_cell_geometry.py 2>&1 | tee "$out/pytest.log" | tail -3
  wait
  for v in tree base; do
    p=$(plugin_of "$v")
    echo "== run kernel, variant $v (batches as the engine cuts them)"
    timeout 100 python3 bench/cudacopy_bench.py --plugin "$p" --repeats 3 \
      --json "$out/cc_$v.json" 2>&1
  done 2>&1 | tee "$out/runkernel.log"
  for v in "${specs[@]%% *}" tree base; do  # tree and base again: the order's effect
    echo "== run kernel, variant $v"
    p=$(plugin_of "$v")
    [ -f "$variants/$v.ptxas" ] && grep -A2 GatherScatterAligned "$variants/$v.ptxas" |
      grep -E "registers|spill"
    timeout 60 python3 bench/cudacopy_bench.py --plugin "$p" \
      --repeats 3 --run-bytes 32768 --run-bytes 65536 --run-bytes 73728 --run-bytes 2097152 2>&1 |
      grep -v "^one"
  done 2>&1 | tee "$out/runvariants.log"
  run_kernels "tree base" "small runs in batches of 8,192" smallruns.log --batch-runs 8192 \
    --run-bytes 4096 --run-bytes 16384
  timeout 100 compute-sanitizer --tool memcheck python3 bench/cudacopy_bench.py --plugin "$plugin" \
    --gib 0.02 --repeats 1 --run-bytes 4100 --run-bytes 4096 --run-bytes 65536 \
    --run-bytes 300000 2>&1 | grep -E "ERROR SUMMARY|runs of|rror" | head -20
  ;;
run-e2e)  # the run kernel end to end through the engine and UCX, and the kernel before it
  build_with_ucx
  cuda_variant base .variants/base_cudacopy.cu >/dev/null &
  python3 -c "import moriio_native as m; print(m.available_backends())"
  timeout 150 python3 -m pytest -q -p no:cacheprovider tests/py/test_cudacopy.py \
    tests/py/test_ucx_two_process.py 2>&1 | tee "$out/pytest-e2e.log" | tail -3
  wait
  cp "$build/lib/libmoriio_native_cudacopy.so" /tmp/plugin-tree.so
  for v in tree base; do
    [ "$v" = base ] && cp "$variants/base/libmoriio_native_cudacopy.so" "$build/lib/"
    echo "== end to end, kernel $v"
    timeout 120 python3 bench/gpu_bench.py --preset llama3-8b --preset deepseek-v3 \
      --skip-per-run --requests 5 --json "$out/gpu_$v.json" 2>&1 | grep -E "GB/s|rror"
    timeout 80 python3 bench/gpu_bench.py --preset llama3-8b-tp8 --layout separated \
      --blocks 4096 --num-blocks 8192 --skip-per-run --requests 5 \
      --json "$out/gpu4k_$v.json" 2>&1 | grep -E "GB/s|rror"
  done 2>&1 | tee "$out/e2e.log"
  cp /tmp/plugin-tree.so "$build/lib/libmoriio_native_cudacopy.so"
  timeout 150 compute-sanitizer --tool memcheck python3 -m pytest -q -p no:cacheprovider \
    tests/py/test_cudacopy.py -k "aligned or chunks or refused" 2>&1 |
    grep -E "ERROR SUMMARY|passed|failed" | tail -3
  ;;
fair)  # a baseline in the same memory state as the kernel, and what degrades it
  build_with_ucx
  python3 -c "import moriio_native as m; print(m.available_backends())"
  plugin=$build/lib/libmoriio_native_cudacopy.so
  timeout 60 python3 -m pytest -q -p no:cacheprovider tests/py/test_cudacopy.py 2>&1 | tail -2
  cc() {  # label, one VAR=value for the environment, cudacopy_bench arguments...
    local label=$1 var=$2
    shift 2
    echo "== $label"
    nvidia-smi --query-gpu=clocks.sm,clocks.mem,temperature.gpu,power.draw --format=csv,noheader
    timeout 70 env "$var" python3 bench/cudacopy_bench.py --plugin "$plugin" --repeats 3 "$@" 2>&1
  }
  {
    cc "every size, caching allocator, empty_cache between sizes" CC_CASE=1 --json "$out/fair.json" \
      --run-bytes 4096 --run-bytes 32768 --run-bytes 65536 --run-bytes 73728 --run-bytes 2097152
    cc "64 KiB twice, cache kept (the second reuses the first's two 8 GiB segments)" \
      CC_CASE=2 --keep-cache --run-bytes 65536 --run-bytes 65536
    cc "64 KiB twice, cudaMalloc/cudaFree per tensor" PYTORCH_NO_CUDA_MEMORY_CACHING=1 \
      --run-bytes 65536 --run-bytes 65536
    cc "64 KiB twice, expandable segments (cuMemMap, 2 MiB pages)" \
      PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True --run-bytes 65536 --run-bytes 65536
    cc "64 KiB twice, runs in random order (not sorted by destination)" CC_CASE=5 --order random \
      --run-bytes 65536 --run-bytes 65536
  } | tee "$out/fair.log"
  for p in "--preset llama3-8b-tp8 --layout separated --blocks 4096 --num-blocks 8192" \
    "--preset llama3-8b --preset deepseek-v3"; do
    echo "== end to end: $p"
    timeout 120 python3 bench/gpu_bench.py $p --skip-per-run --requests 3 2>&1 |
      grep -E "GB/s|rror"
  done 2>&1 | tee "$out/e2e.log"
  ;;
pipeline)  # where a request's time goes beyond the kernel: this tree against the one before
  base_build=/tmp/moriio-base-build
  logs=/tmp/moriio-pipeline
  rm -rf /tmp/moriio-base-src $logs && mkdir -p /tmp/moriio-base-src $logs/base $logs/tree &&
    tar -C /tmp/moriio-base-src -xf .variants/base-src.tar
  (cd /tmp/moriio-base-src && build=$base_build out=$logs/base && build_with_ucx >/dev/null) &
  (out=$logs/tree && build_with_ucx) || exit 1
  wait
  python3 -c "import moriio_native as m; print(m.available_backends())"
  PYTHONPATH=$base_build/python python3 -c "import moriio_native as m; print('base', m.available_backends())"
  timeout 150 python3 -m pytest -q -p no:cacheprovider -rs tests/py/test_cudacopy.py \
    tests/py/test_cell_geometry.py tests/py/test_ucx_two_process.py 2>&1 | tail -6 |
    tee "$out/pytest.log"
  n=0
  for p in "--preset llama3-8b --preset deepseek-v3 --requests 7" \
    "--preset llama3-8b-tp8 --layout separated --blocks 4096 --num-blocks 8192 --requests 3"; do
    n=$((n + 1))
    for v in tree base busy; do  # busy: this tree, its progress thread never sleeping
      echo "== $v: $p"
      bench_variant "$v" $base_build 150 $p --json "$logs/e2e_${v}_$n.json" \
        --timeline "$logs/timeline_${v}_$n.json"
    done
  done 2>&1 | tee "$out/e2e.log"
  python3 - "$logs" "$out/pipeline.json" <<'PY'
import glob, json, os, sys
merged = {os.path.basename(f)[:-5]: json.load(open(f)) for f in sorted(glob.glob(sys.argv[1] + "/*.json"))}
json.dump(merged, open(sys.argv[2], "w"), indent=1)
PY
  ;;
timeline)  # this tree only: the profiled requests' host launches and last event queries
  (out=/tmp/moriio-timeline-build && mkdir -p $out && build_with_ucx) || exit 1
  PYTHONPATH=$build/python timeout 150 python3 bench/gpu_bench.py --preset llama3-8b \
    --preset deepseek-v3 --skip-per-run --requests 3 --json "$out/e2e.json" \
    --timeline "$out/timeline.json" 2>&1 | grep -E "GB/s|timeline|rror" | tee "$out/e2e.log"
  ;;
gap)  # issue 18: what an unprofiled WRITE pays after the decode's verification and copy
  build_with_ucx
  python3 -c "import moriio_native as m; print(m.available_backends())"
  pre="--pre none --pre settle --pre prime"
  for ops in read,write write,read; do  # the second process: both orders reversed
    echo "== llama3-8b, ops $ops, $pre"
    nvidia-smi --query-gpu=clocks.sm,clocks.mem,temperature.gpu,power.draw --format=csv,noheader
    timeout 90 python3 bench/gpu_bench.py --preset llama3-8b --skip-per-run --requests 6 $pre \
      --ops $ops --json "$out/gap_llama_${ops/,/-}.json" 2>&1 | grep -E "GB/s|rror"
    pre="--pre prime --pre settle --pre none"
  done 2>&1 | tee "$out/gap.log"
  pre="--pre none --pre settle --pre prime"
  timeout 150 python3 -m pytest -q -p no:cacheprovider -rs tests/py/test_cudacopy.py \
    tests/py/test_cell_geometry.py tests/py/test_cell_transfer.py tests/py/test_verify.py \
    tests/py/test_ucx_two_process.py 2>&1 | tail -8 | tee "$out/checks.log"
  echo "elapsed ${SECONDS} s"
  if [ "$SECONDS" -lt 270 ]; then
    echo "== deepseek-v3, ops read,write"
    timeout $((330 - SECONDS)) python3 bench/gpu_bench.py --preset deepseek-v3 --skip-per-run \
      --requests 5 $pre --json "$out/gap_deepseek.json" 2>&1 | grep -E "GB/s|rror"
  fi 2>&1 | tee -a "$out/gap.log"
  echo "elapsed ${SECONDS} s"
  ;;
checks)  # one call after the merges: every GPU test, and the checksum's cost on the GPU; with
  # .variants/prev_checksum.cu (the committed checksum.cu before a kernel change; else
  # .variants/base_checksum.cu, an earlier one) that kernel too: it and this tree's alternate,
  # two rounds, a 1 GiB call (4,096 blocks x 4 layers) and 128 MiB in 32 layers (64 blocks)
  other=""
  [ -f .variants/base_checksum.cu ] && other=base
  [ -f .variants/prev_checksum.cu ] && other=prev
  [ -n "$other" ] && cuda_variant $other-checksum cpp/cudacopy/cudacopy.cu \
    .variants/${other}_checksum.cu -Iinclude >/dev/null &
  build_with_ucx
  wait
  python3 -c "import moriio_native as m; print(m.available_backends())"
  timeout 300 python3 -m pytest -q -p no:cacheprovider -rs tests/py/test_cudacopy.py \
    tests/py/test_cell_geometry.py tests/py/test_cell_transfer.py tests/py/test_verify.py \
    tests/py/test_ucx_two_process.py 2>&1 | tail -25 | tee "$out/checks.log"
  for round in 1 2; do
    for shape in "4096 4" "64 32"; do
      set -- $shape
      for v in tree ${other:+$other-checksum}; do
        echo "== $v, $1 blocks x $2 layers, round $round"
        timeout 120 python3 bench/verify_bench.py --device-only --blocks-per-request $1 \
          --layers $2 --plugin "$(plugin_of $v)"
      done
    done
  done 2>&1 | tee "$out/verify-device.log"
  ;;
checksum-variants)  # after checks (same machine; built again if it is a fresh one): this tree's
  # checksum kernel, the one before it (.variants/prev_checksum.cu) and this kernel's -D
  # variants (8-byte loads only, every block walked without the cell table, 4 passes per unit,
  # streaming loads), in turn, two rounds, a 1 GiB and a 128 MiB (32 layers) call
  [ -f "$(plugin_of tree)" ] || build_without_ucx
  [ -f .variants/prev_checksum.cu ] && [ ! -f "$(plugin_of prev-checksum)" ] &&
    cuda_variant prev-checksum cpp/cudacopy/cudacopy.cu .variants/prev_checksum.cu -Iinclude \
      >/dev/null &
  for spec in sum-words:WIDE=0 sum-walk:TABLE_CELLS=0 sum-p4:PASSES=4 sum-stream:STREAMING=1; do
    cuda_variant "${spec%%:*}" cpp/cudacopy/cudacopy.cu cpp/cudacopy/checksum.cu -Iinclude \
      "-DMORIIO_CUDACOPY_CHECKSUM_${spec#*:}" | grep -E -A2 "ChecksumKernel|error" | tail -2 |
      sed "s/^ */${spec%%:*}: /" &
  done
  wait
  for round in 1 2; do
    for v in tree prev-checksum sum-words sum-walk sum-p4 sum-stream; do
      [ -f "$(plugin_of $v)" ] || continue
      for shape in "4096 4" "64 32"; do
        set -- $shape
        echo "== $v, $1 blocks x $2 layers, round $round"
        timeout 100 python3 bench/verify_bench.py --device-only --blocks-per-request $1 \
          --layers $2 --plugin "$(plugin_of $v)" | grep -v "^NVIDIA"
      done
    done
  done 2>&1 | tee "$out/checksum-variants.log"
  ;;
prelaunch)  # issue 18: what runs before a request's first launch, and small runs' host cost
  base_build=/tmp/moriio-base-build
  build_tree_and_base .variants/base-044b7ad.tar $base_build
  every_gpu_test
  n=0
  for p in "--preset llama3-8b --requests 3" \
    "--preset llama3-8b-tp8 --layout separated --blocks 4096 --num-blocks 8192 --requests 3"; do
    n=$((n + 1))
    for v in tree base busy; do  # busy: this tree, its progress thread never sleeping
      [ "$v" = busy ] && [ $n = 2 ] && continue
      echo "== $v: $p"
      bench_variant "$v" $base_build 120 $p --pre none --pre prime --json "$out/e2e_${v}_$n.json" \
        --timeline "$out/timeline_${v}_$n.json"
      echo "elapsed ${SECONDS} s"
    done
  done 2>&1 | tee "$out/e2e.log"
  ;;
marks)  # issue 18: the engine's host marks before the first launch (this tree, marks compiled in)
  extra_cmake=-DMORIIO_NATIVE_TRACE_MARKS=ON build_with_ucx || exit 1
  python3 -c "import moriio_native._native as n; print('marks', n.trace_marks_compiled_in())"
  echo "elapsed ${SECONDS} s"
  marked_timelines marks
  ;;
versus)  # issue 18: this tree against base, marks off, every byte verified
  base_build=/tmp/moriio-base-build
  build_tree_and_base .variants/base-src.tar $base_build
  every_gpu_test
  n=0
  for p in "--preset llama3-8b --requests 5" "--preset deepseek-v3 --requests 3" \
    "--preset llama3-8b-tp8 --layout separated --blocks 4096 --num-blocks 8192 --requests 3"; do
    n=$((n + 1))
    for v in tree base; do
      echo "== $v: $p"
      bench_variant "$v" $base_build 100 $p --pre none --pre prime --json "$out/e2e_${v}_$n.json"
      echo "elapsed ${SECONDS} s"
    done
  done 2>&1 | tee "$out/e2e.log"
  ;;
stamps)  # issue 18: stamped batches (templates and ids, offsets on the GPU) against runs
  build_with_ucx || exit 1
  timeout 150 python3 -m pytest -q -p no:cacheprovider -rs tests/py/test_cudacopy.py \
    tests/py/test_ucx_two_process.py 2>&1 | tail -6 | tee "$out/checks.log"
  n=0
  for p in "--preset llama3-8b --requests 5" \
    "--preset llama3-8b-tp8 --layout separated --blocks 4096 --num-blocks 8192 --requests 3" \
    "--preset deepseek-v3 --requests 3"; do
    n=$((n + 1))
    for v in tree runs tree runs; do
      [ "$SECONDS" -gt 400 ] && break 2
      echo "== $v: $p"
      bench_variant "$v" "" 80 $p --pre none --pre prime
      echo "elapsed ${SECONDS} s"
    done
  done 2>&1 | tee "$out/e2e.log"
  [ "$SECONDS" -lt 470 ] && timeout 90 compute-sanitizer --tool memcheck python3 -m pytest -q \
    -p no:cacheprovider tests/py/test_cudacopy.py -k stamps 2>&1 |
    grep -E "ERROR SUMMARY|passed|failed|rror" | head -5 | tee -a "$out/checks.log"
  left=$((570 - SECONDS))
  [ "$left" -gt 20 ] && timeout "$left" python3 -m pytest -q -p no:cacheprovider -rs \
    tests/py/test_cell_geometry.py tests/py/test_cell_transfer.py tests/py/test_verify.py 2>&1 |
    tail -4 | tee -a "$out/checks.log"
  echo "elapsed ${SECONDS} s"
  ;;
small)  # issue 18: every GPU test, then where a 4 KiB-run request's time goes (marks compiled in)
  extra_cmake=-DMORIIO_NATIVE_TRACE_MARKS=ON build_with_ucx || exit 1
  [ "${SKIP_GPU_TESTS:-0}" = 1 ] || every_gpu_test
  marked_timelines small
  ;;
in-flight | in-flight-large)  # issue 18: one request against several in flight (--in-flight),
  # 4 KiB runs (in-flight: every GPU test first, unless SKIP_GPU_TESTS=1) or 64 and 72 KiB runs
  build_with_ucx || exit 1
  [ "$step" = in-flight ] && [ "${SKIP_GPU_TESTS:-0}" != 1 ] && every_gpu_test
  presets=("--preset llama3-8b-tp8 --layout separated --blocks 4096 --num-blocks 16384")
  [ "$step" = in-flight-large ] &&
    presets=("--preset llama3-8b --num-blocks 8192" "--preset deepseek-v3 --blocks 1024 --num-blocks 4096")
  for p in "${presets[@]}"; do
    for k in 1 2 4 1 2 4; do
      echo "== $k in flight: $p"
      bench_variant tree "" 80 $p --requests 5 --in-flight $k --pre none --pre prime \
        --ops "${IN_FLIGHT_OPS:-read,write}"
      echo "elapsed ${SECONDS} s"
    done
  done 2>&1 | tee "$out/$step.log"
  ;;
wake)  # issue 18: what the progress thread's wake-up costs a request: tree against busy progress
  build_with_ucx || exit 1
  for p in "--preset llama3-8b-tp8 --layout separated --blocks 4096 --num-blocks 8192 --requests 5" \
    "--preset llama3-8b --requests 5"; do
    for v in tree busy tree busy; do
      echo "== $v: $p"
      bench_variant "$v" "" 80 $p --pre none --pre prime
      echo "elapsed ${SECONDS} s"
    done
  done 2>&1 | tee "$out/wake.log"
  ;;
overlap-stamps)  # issue 18: per-layer WRITE behind compute, stamped batches against runs
  build_with_ucx || exit 1
  for p in "--preset llama3-8b --preset deepseek-v3" \
    "--preset llama3-8b-tp8 --layout separated --blocks 4096 --num-blocks 8192"; do
    for v in tree runs; do
      echo "== $v: $p"
      bench_variant "$v" "" 200 $p --overlap --requests 5
      echo "elapsed ${SECONDS} s"
    done
  done 2>&1 | tee "$out/overlap.log"
  ;;
overlap-wait)  # per-layer WRITE behind compute: each layer's event waited on the GPU or the host
  build_with_ucx || exit 1
  [ "${SKIP_GPU_TESTS:-0}" = 1 ] || every_gpu_test
  for round in 1 2; do
    for p in "--preset llama3-8b --preset deepseek-v3" \
      "--preset llama3-8b-tp8 --layout separated --blocks 4096 --num-blocks 8192"; do
      [ "$SECONDS" -gt 400 ] && break 2
      echo "== round $round: $p"
      bench_variant tree "" 200 $p --overlap --requests 5
      echo "elapsed ${SECONDS} s"
    done
  done 2>&1 | tee "$out/overlap-wait.log"
  ;;
overlap-parked)  # per-layer WRITE as UCX operations: each event polled by the engine, or the host
  if [ -n "${BASE_TAR:-}" ]; then
    build_tree_and_base "$BASE_TAR" /tmp/moriio-base-build
    PYTHONPATH=/tmp/moriio-base-build/python timeout 120 python3 -m pytest -q -p no:cacheprovider \
      tests/py/test_ucx_two_process.py -k "waits_for_its_cuda_event or holds_up_no_other" 2>&1 |
      tail -6 | tee "$out/base-checks.log"
  else
    build_with_ucx || exit 1
  fi
  [ "${SKIP_GPU_TESTS:-0}" = 1 ] || every_gpu_test
  for round in 1 2; do
    for p in "--preset llama3-8b --blocks 32" "--preset llama3-8b --blocks 256" \
      "--preset llama3-8b-tp8 --layout separated --blocks 64 --num-blocks 8192"; do
      [ "$SECONDS" -gt 480 ] && break 2
      echo "== round $round: $p"
      bench_variant tree "" 150 $p --overlap --direct-copy off --requests 5
      echo "elapsed ${SECONDS} s"
    done
  done 2>&1 | tee "$out/overlap-parked.log"
  ;;
overlap-trace)  # issue 18: where an overlapped WRITE's copies ran, UCX operations against the kernel
  build_with_ucx || exit 1
  for p in "--preset llama3-8b --blocks 32" "--preset llama3-8b --blocks 256"; do
    for path in off auto; do
      [ "$SECONDS" -gt 480 ] && break 2
      echo "== $p, direct copy $path"
      bench_variant tree "" 200 $p --overlap --direct-copy $path --requests 3 \
        --overlap-trace "$out/overlap-trace.json"
      echo "elapsed ${SECONDS} s"
    done
  done 2>&1 | tee "$out/overlap-trace.log"
  ;;
overlap-progress)  # issue 18: the UCX-operation path's per-operation pace: progress mode, UCX poll
  build_with_ucx || exit 1
  for round in 1 2; do
    for v in tree busy poll; do
      [ "$SECONDS" -gt 500 ] && break 2
      echo "== round $round: $v"
      if [ "$v" = poll ]; then  # cuda_ipc's completions picked per progress call, raised
        UCX_CUDA_IPC_MAX_POLL=1024 bench_variant tree "" 200 --preset llama3-8b --blocks 256 \
          --overlap --direct-copy off --requests 3 --overlap-trace "$out/overlap-$v.json"
      else
        bench_variant $v "" 200 --preset llama3-8b --blocks 256 --overlap --direct-copy off \
          --requests 3 --overlap-trace "$out/overlap-$v.json"
      fi
      echo "elapsed ${SECONDS} s"
    done
  done 2>&1 | tee "$out/overlap-progress.log"
  ;;
overlap-contiguous)  # issue 18: the UCX-operation path with fewer, larger operations per layer
  build_with_ucx || exit 1
  for round in 1 2; do
    for ids in random contiguous; do
      [ "$SECONDS" -gt 500 ] && break 2
      flag=""
      [ "$ids" = contiguous ] && flag="--contiguous"
      echo "== round $round: $ids block ids"
      bench_variant tree "" 200 --preset llama3-8b --blocks 256 --overlap --direct-copy off \
        --requests 3 $flag --overlap-trace "$out/overlap-$ids.json"
      echo "elapsed ${SECONDS} s"
    done
  done 2>&1 | tee "$out/overlap-contiguous.log"
  ;;
write-layers)  # issue 18: a WRITE after the forward by one write_layers call, not one per layer
  build_with_ucx || exit 1
  [ "${SKIP_GPU_TESTS:-0}" = 1 ] || every_gpu_test
  for round in 1 2; do
    for p in "--preset llama3-8b-tp8 --layout separated --blocks 4096 --num-blocks 8192" \
      "--preset llama3-8b" "--preset deepseek-v3"; do
      [ "$SECONDS" -gt 460 ] && break 2
      echo "== round $round: $p"
      bench_variant tree "" 100 $p --requests 5 --ops read,write,write_layers \
        --pre none --pre prime
      echo "elapsed ${SECONDS} s"
    done
  done 2>&1 | tee "$out/write-layers.log"
  ;;
stamp-groups)  # issue 18: the stamp kernel's pieces per warp (at most 32, 8, 1)
  build_with_ucx || exit 1
  for g in 8 1; do
    cuda_variant "g$g" cpp/cudacopy/cudacopy.cu -DMORIIO_CUDACOPY_STAMP_GROUP=$g &
  done
  wait
  cp "$build/lib/libmoriio_native_cudacopy.so" "$variants/g32.so"
  for round in 1 2; do
    for g in 32 8 1; do
      if [ "$g" = 32 ]; then
        cp "$variants/g32.so" "$build/lib/libmoriio_native_cudacopy.so"
      else
        cp "$variants/g$g/libmoriio_native_cudacopy.so" "$build/lib/"
      fi
      for p in "--preset llama3-8b --requests 5" \
        "--preset llama3-8b-tp8 --layout separated --blocks 4096 --num-blocks 8192 --requests 3"; do
        [ "$SECONDS" -gt 520 ] && break 3
        echo "== group $g, round $round: $p"
        bench_variant tree "" 60 $p --pre prime
      done
    done
  done 2>&1 | tee "$out/e2e.log"
  cp "$variants/g32.so" "$build/lib/libmoriio_native_cudacopy.so"
  echo "elapsed ${SECONDS} s"
  ;;
batch-check)  # issue 14: what checking the peer's region before each CUDA copy batch costs
  base_build=/tmp/moriio-base-build
  build_tree_and_base .variants/base-src.tar $base_build
  presets=("--preset llama3-8b --requests 5"
    "--preset llama3-8b-tp8 --layout separated --blocks 4096 --num-blocks 8192 --requests 3")
  [ -n "${SMALL_RUNS_ONLY:-}" ] && presets=("${presets[1]}")  # 4 KiB runs alone
  n=0
  for p in "${presets[@]}"; do
    n=$((n + 1))
    for v in tree base tree base; do
      [ "$SECONDS" -gt 470 ] && break 2
      echo "== $v: $p"
      bench_variant "$v" $base_build 90 $p --pre none --pre prime --json "$out/e2e_${v}_$n.json"
      echo "elapsed ${SECONDS} s"
    done
  done 2>&1 | tee "$out/e2e.log"
  ;;
hostcut)  # issue 18: the block ids' check and sort cut: this tree against base, in one call
  base_build=/tmp/moriio-base-build
  build_tree_and_base .variants/base-src.tar $base_build
  rm -rf "$out/base" "$out/cmake.log"  # both built: their logs are not among the 8 files back
  for v in tree base tree base; do  # the ids alone, each build twice, alternating
    pp=$build/python
    [ "$v" = base ] && pp=$base_build/python
    PYTHONPATH=$pp timeout 30 python3 bench/pairs_bench.py --label "$v "
  done 2>&1 | tee "$out/pairs.log"
  every_gpu_test
  n=0
  for p in "--preset llama3-8b --requests 5" \
    "--preset llama3-8b-tp8 --layout separated --blocks 4096 --num-blocks 8192 --requests 3" \
    "--preset deepseek-v3 --requests 3"; do
    n=$((n + 1))
    for v in tree base; do
      [ "$SECONDS" -gt 300 ] && break 2  # leave the marks their time
      echo "== $v: $p"
      bench_variant "$v" $base_build 60 $p --pre none --pre prime  # the log says it all
      echo "elapsed ${SECONDS} s"
    done
  done 2>&1 | tee "$out/e2e.log"
  # The device tool brings back 8 files at most: the marks builds' logs stay in /tmp.
  mkdir -p /tmp/marks-tree /tmp/marks-base
  (cd /tmp/moriio-base-src && extra_cmake=-DMORIIO_NATIVE_TRACE_MARKS=ON \
    build=/tmp/moriio-marks-base out=/tmp/marks-base build_with_ucx >/dev/null) &
  (extra_cmake=-DMORIIO_NATIVE_TRACE_MARKS=ON build=/tmp/moriio-marks-tree out=/tmp/marks-tree \
    build_with_ucx >/dev/null) || { tail -20 /tmp/marks-tree/build.log; exit 1; }
  wait
  echo "elapsed ${SECONDS} s"
  for v in tree base; do
    [ "$SECONDS" -gt 420 ] && break
    echo "== $v with marks: llama3-8b"
    PYTHONPATH=/tmp/moriio-marks-$v/python timeout $((450 - SECONDS)) python3 bench/gpu_bench.py \
      --preset llama3-8b --skip-per-run --requests 3 --pre none --pre prime \
      --timeline "$out/timeline_marks_$v.json" 2>&1 | grep -E "GB/s|timeline|marks|rror"
    echo "elapsed ${SECONDS} s"
  done 2>&1 | tee "$out/marks.log"
  ;;
order)  # is the first size measured in a process faster? the same size twice, other orders
  build_without_ucx
  cuda_variant base .variants/base_cudacopy.cu >/dev/null &
  plugin=$build/lib/libmoriio_native_cudacopy.so
  timeout 100 python3 -m pytest -q -p no:cacheprovider tests/py/test_cudacopy.py 2>&1 | tail -2
  wait
  for v in tree base; do
    p=$(plugin_of "$v")
    for sizes in "65536 65536 32768 65536" "32768 32768 2097152"; do
      echo "== variant $v, sizes $sizes"
      nvidia-smi --query-gpu=clocks.sm,clocks.mem,temperature.gpu,power.draw --format=csv,noheader
      timeout 60 python3 bench/cudacopy_bench.py --plugin "$p" --repeats 3 \
        $(printf -- "--run-bytes %s " $sizes) 2>&1
    done
  done 2>&1 | tee "$out/order.log"
  ;;
esac
