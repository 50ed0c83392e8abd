#!/usr/bin/env bash
# The native packed projection at several ring sizes (kRingBytes), one and 16 rows: benchmarks/packed_linear_variants.sh
# with -DONECOPY_RING_KB=<size> per variant.
# Usage (CUDA machine with nvcc, repository root): bash benchmarks/packed_linear_rings.sh [36 54 72 100]
set -euo pipefail
sizes=("${@:-36 54 72 100}")
variants=()
for v in ${sizes[@]}; do variants+=("ring_${v}kb=-DONECOPY_RING_KB=$v"); done
exec bash "$(dirname "$0")/packed_linear_variants.sh" 1,16 q4a,q8s "${variants[@]}"
