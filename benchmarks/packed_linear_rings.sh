#!/usr/bin/env bash
# The native packed projection at several ring sizes (kRingBytes), timed by benchmarks/packed_linear_harness.cu.
# Usage (CUDA machine with nvcc, repository root): bash benchmarks/packed_linear_rings.sh [36 54 72 100]
set -euo pipefail
SRC=onecopy/kernels/native
sizes=("${@:-36 54 72 100}")
for v in ${sizes[@]}; do
  nvcc -O3 -std=c++17 -gencode=arch=compute_90,code=sm_90 -DONECOPY_RING_KB=$v -I$SRC \
    -o /tmp/packed_linear_ring_$v benchmarks/packed_linear_harness.cu $SRC/packed_linear.cu &
done
wait
for v in ${sizes[@]}; do echo "== ring ${v} KB"; /tmp/packed_linear_ring_$v; done
