"""Device bytes per extra session vs its state bytes (eager sessions), measured with cudaMemGetInfo.

Usage (CUDA machine, repository root): python benchmarks/session_memory_cuda.py
Exports tiny-llama with a 64k context (16 MiB of KV state per session) and opens sessions one by one.
"""
import os, sys, torch
sys.path.insert(0, ".")
import onecopy
from onecopy.models.source import preset_source
print("PYTORCH_CUDA_ALLOC_CONF", os.environ.get("PYTORCH_CUDA_ALLOC_CONF"), "PYTORCH_ALLOC_CONF", os.environ.get("PYTORCH_ALLOC_CONF"))
src = preset_source("tiny-llama")
p = onecopy.export(src, "/tmp/sessdiag", max_seq_len=65536, device="cuda", dtype="bfloat16", overwrite=True, progress=False)
def used(ec=True):
    torch.cuda.synchronize()
    if ec: torch.cuda.empty_cache()
    f, t = torch.cuda.mem_get_info(); return t - f
with onecopy.Engine.load(p, "cuda", cuda_graphs=False) as e:
    with e.open_session() as s: s.prefill([1, 2, 3])
    print("session_bytes", e.session_bytes)
    base = used()
    ss = []
    for i in range(3):
        b = used(); ss.append(e.open_session()); print("open", i, "delta(ec)", used() - b, "alloc", torch.cuda.memory_allocated(), "reserved", torch.cuda.memory_reserved())
    for s in ss: s.close()
    print("after close", used() - base)
    ss = []
    for i in range(3):
        b = used(False); ss.append(e.open_session()); print("open", i, "delta(no ec)", used(False) - b)
    x = torch.zeros(e.session_bytes, dtype=torch.uint8, device="cuda"); b = used(); y = torch.zeros(e.session_bytes, dtype=torch.uint8, device="cuda"); print("raw zeros delta", used() - b)
