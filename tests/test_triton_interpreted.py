"""Triton kernels (Qwen3.5's DeltaNet decode step, a prefill's chunk scan, the grouped routed experts; a packed
weight's dequantization; the split-KV decode and the prefill attention; the small linear, float and packed, with
its folds) on the CPU through Triton's interpreter, against float64 and the eager torch ops
(`tests/triton_interpreted.py`): their math in CI, where no GPU runs them. Skipped where Triton is not installed (a
CPU-only torch brings none)."""

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest

# triton_interpreted.FUNCTIONS, run by name
CHECKS = ("deltanet_decode", "deltanet_chunk_scan", "moe_routed", "dequantize", "decode_attention", "small_linear",
          "prefill_attention")
pytestmark = pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="needs Triton (its interpreter)")


@pytest.mark.parametrize("name", CHECKS)
def test_kernel_matches_float64_and_the_eager_ops_in_the_interpreter(name):
    root = Path(__file__).resolve().parents[1]
    env = {**os.environ, "PYTHONPATH": str(root), "TRITON_INTERPRET": "1"}
    done = subprocess.run([sys.executable, str(root / "tests" / "triton_interpreted.py"), name], env=env,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0 and f"{name}: ok" in done.stdout, done.stderr[-3000:]
