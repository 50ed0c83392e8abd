#!/usr/bin/env bash
# The native packed projection built with several sets of its build-time choices, timed by
# benchmarks/packed_linear_harness.cu. Each argument is NAME=FLAGS (FLAGS: -D definitions, '+'-separated), e.g.
#   bash benchmarks/packed_linear_variants.sh 1,8,16,32,64 q4a,q8s "r54=" "r72=-DONECOPY_RING_KB=72+-DONECOPY_RING16_KB=96"
# (CUDA machine with nvcc, repository root). Rows and layouts as the harness takes them.
set -euo pipefail
SRC=onecopy/kernels/native
rows=$1 layouts=$2
shift 2
for v in "$@"; do
  name=${v%%=*} flags=${v#*=}
  nvcc -O3 -std=c++17 -gencode=arch=compute_90,code=sm_90 ${flags//+/ } -I$SRC \
    -o /tmp/packed_linear_$name benchmarks/packed_linear_harness.cu $SRC/packed_linear.cu &
done
wait
for v in "$@"; do name=${v%%=*}; echo "== $name (${v#*=})"; /tmp/packed_linear_$name "$rows" "$layouts"; done
