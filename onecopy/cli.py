"""The `onecopy` command: run, serve, transcribe, export, info, bench."""

from __future__ import annotations

import argparse
import logging
import math
import sys
from pathlib import Path

from typing import TYPE_CHECKING

from .errors import InputError, OnecopyError

if TYPE_CHECKING:
    from .runtime.config import EngineConfig


def add_engine_options(p: argparse.ArgumentParser, *, max_queue: int | None) -> None:
    """The `EngineConfig` options a command takes (serve, bench serve): one list, one meaning."""
    g = p.add_argument_group("engine")
    g.add_argument("--max-sessions", type=int, help="requests generated at once (rows of the state pool)")
    g.add_argument("--max-queue", type=int, default=max_queue,
                   help=f"requests waiting for a row before 429 (default {max_queue or 'unbounded'})")
    g.add_argument("--token-budget", type=int, metavar="TOKENS",
                   help="prefill chunks of several prompts per scheduler iteration while the iteration's tokens (a "
                        "decoding session: 1, a chunk: its length) fit, e.g. 4096; the oldest prompt's chunk and every "
                        "decoding session always run (default: one chunk per iteration)")
    g.add_argument("--prefill-chunk", type=int, metavar="TOKENS", help="prompt tokens per prefill call (default 512)")
    g.add_argument("--kv-blocks", type=int, help="KV blocks of the paged cache (default: from free memory)")
    g.add_argument("--new-token-ratio", type=float, default=1.0, metavar="R",
                   help="share of running requests' unwritten max_new_tokens kept free in KV blocks when admitting "
                        "another (default 1: no preemption for requests that run to max_new_tokens; lower admits "
                        "more, betting on early stops)")
    g.add_argument("--deterministic", action="store_true",
                   help="batch-invariant decoding: a session's tokens never depend on its neighbours")
    g.add_argument("--no-prefix-cache", action="store_true",
                   help="no KV blocks shared across requests: every prompt is prefilled whole, except a chat's "
                        "history held by a kept session (the conversation cache, unless --no-conversation-cache)")
    g.add_argument("--kv-host-gib", type=float, default=0.0, metavar="GIB",
                   help="host memory (pinned on CUDA) that keeps the cached KV blocks the device evicts, loaded back "
                        "instead of prefilled (default 0: off)")
    g.add_argument("--kv-disk-dir", metavar="DIR",
                   help="a directory that keeps the cached KV blocks the host tier evicts, and every cached block at "
                        "exit, for this and later engines of the same model (serve: DIR/kv of --state-dir by default)")
    g.add_argument("--kv-disk-gib", type=float, default=16.0, metavar="GIB",
                   help="bytes of KV blocks the disk tier keeps, least recently used deleted first (default 16)")


def engine_config(a: argparse.Namespace, **overrides: object) -> "EngineConfig":
    from .runtime.config import EngineConfig

    options = dict(max_sessions=a.max_sessions, max_queue=a.max_queue, token_budget=a.token_budget,
                   prefill_chunk=a.prefill_chunk, kv_blocks=a.kv_blocks, deterministic=a.deterministic,
                   new_token_ratio=a.new_token_ratio, prefix_cache=not a.no_prefix_cache,
                   kv_host_bytes=int(a.kv_host_gib * 2**30), kv_disk_dir=a.kv_disk_dir,
                   kv_disk_bytes=int(a.kv_disk_gib * 2**30))
    return EngineConfig.of(**{**options, **overrides})


def _cmd_run(a: argparse.Namespace) -> int:
    from .defaults import default_bundle
    from .runtime.engine import Engine
    from .params import SamplingParams

    bundle = Path(a.bundle) if a.bundle else default_bundle(a.device)
    params = SamplingParams(temperature=a.temperature, top_k=a.top_k, top_p=a.top_p, seed=a.seed,
                            max_new_tokens=a.max_new_tokens)
    with Engine.load(bundle, a.device) as engine, engine.open_session() as session:
        for token in session.generate(a.prompt, params, chat=not a.raw):
            sys.stdout.write(token.text)
            sys.stdout.flush()
        sys.stdout.write("\n")
        if a.memory:
            print(engine.memory_report())
    return 0


def _cmd_transcribe(a: argparse.Namespace) -> int:
    from .defaults import default_bundle
    from .models.source import EMBEDDED_WHISPER
    from .runtime.engine import Engine
    from .transcribe import transcribe_files

    bundle = Path(a.bundle) if a.bundle else default_bundle(a.device, model=EMBEDDED_WHISPER)
    with Engine.load(bundle, a.device) as engine:
        transcripts = transcribe_files(engine, a.files, a.max_new_tokens)
    for path, t in zip(a.files, transcripts):
        print(t.text if len(a.files) == 1 else f"{path}: {t.text}")
    return 0


def _cmd_serve(a: argparse.Namespace) -> int:
    from .bundle import read_manifest
    from .defaults import default_bundle
    from .models.source import EMBEDDED_DEFAULT
    from .runtime.engine import Engine
    from .serve import ServerConfig, serve

    if a.source and a.bundle:
        raise OnecopyError("give a model SOURCE or --bundle DIR, not both")
    if a.max_stored_responses < 1:
        raise OnecopyError(f"--max-stored-responses must be at least 1, got {a.max_stored_responses}")
    bundle = Path(a.bundle) if a.bundle else default_bundle(a.device, model=a.source or EMBEDDED_DEFAULT)
    name = a.model_name or a.source or read_manifest(bundle).build.get("source") or bundle.name
    config = ServerConfig(model_name=str(name), api_key=a.api_key, max_body_bytes=a.max_body_bytes,
                          conversation_cache=not a.no_conversation_cache, conversation_ttl_s=a.conversation_ttl,
                          max_conversations=a.max_conversations, state_dir=a.state_dir,
                          max_stored_responses=a.max_stored_responses, max_state_bytes=int(a.state_dir_gib * 2**30))
    if a.host not in ("127.0.0.1", "localhost", "::1") and not a.api_key:
        print(f"onecopy: warning: serving on {a.host} without --api-key: anyone who reaches this port can use it",
              file=sys.stderr)
    if a.replicas is not None:
        return _serve_replicas(a, bundle, config)
    if a.ray_address is not None:
        raise OnecopyError("--ray-address needs --replicas N (without it onecopy serves in this process)")
    engine = Engine.load(bundle, a.device, serve_engine_config(a))
    serve(engine, config, host=a.host, port=a.port, grace_s=a.grace,
          listening=lambda url: print(f"onecopy: serving {name} on {url}/v1 ({engine.max_sessions} sessions at once)",
                                      file=sys.stderr, flush=True))
    return 0


def serve_engine_config(a: argparse.Namespace) -> "EngineConfig":
    """`engine_config` for serve: the KV blocks' disk tier under --state-dir unless --kv-disk-dir says where (so a
    restarted server continues a stored response from its saved blocks, not by prefilling its history)."""
    if a.kv_disk_dir is None and a.state_dir is not None and a.kv_disk_gib > 0:
        return engine_config(a, kv_disk_dir=str(Path(a.state_dir) / "kv"))
    return engine_config(a)


def _serve_replicas(a: argparse.Namespace, bundle: Path, config) -> int:
    try:
        from .replicas.deployments import ReplicaSpec
        from .replicas.launch import ReplicatedServer
    except ImportError as e:
        raise OnecopyError(f"--replicas runs on Ray Serve, which is not installed ({e}); "
                           "install it with: pip install 'onecopy[ray]'") from None
    spec = ReplicaSpec(bundle=str(bundle.resolve()), device=a.device, engine=serve_engine_config(a), server=config)
    where = f"the Ray cluster at {a.ray_address}" if a.ray_address else "a local Ray cluster"
    print(f"onecopy: serving {config.model_name} on http://{a.host}:{a.port}/v1 from {a.replicas} replica(s) on {where} "
          f"(one engine per {'GPU' if a.device == 'cuda' else 'CPU'})", file=sys.stderr)
    ReplicatedServer(spec, a.replicas, ray_address=a.ray_address, host=a.host, port=a.port,
                     grace_s=a.grace).serve_forever()
    return 0


def _cmd_bench_serve(a: argparse.Namespace) -> int:
    import contextlib

    import httpx

    from .bench.serve_load import bench_serve, print_table

    levels = [int(x) for x in a.clients.split(",")]
    command = "onecopy " + " ".join(sys.argv[1:])
    out = Path(a.out) if a.out else None
    if a.url:
        models = httpx.get(a.url.rstrip("/") + "/v1/models", timeout=30,
                           headers={"Authorization": f"Bearer {a.api_key}"} if a.api_key else {}).json()
        res = bench_serve(url=a.url.rstrip("/"), engine=None, model=models["data"][0]["id"], levels=levels,
                          requests_per_client=a.requests_per_client, prompt_len=a.prompt_len, max_tokens=a.max_tokens,
                          vocab=256, api_key=a.api_key, out=out, command=command)
    else:
        from .defaults import default_bundle
        from .models.source import EMBEDDED_DEFAULT
        from .runtime.engine import Engine
        from .serve import BackgroundServer, ServerConfig

        bundle = Path(a.bundle) if a.bundle else default_bundle(a.device, model=a.source or EMBEDDED_DEFAULT)
        with contextlib.ExitStack() as stack:
            engine = stack.enter_context(Engine.load(bundle, a.device,
                                                     engine_config(a, max_sessions=a.max_sessions or max(levels))))
            server = stack.enter_context(BackgroundServer(engine, ServerConfig(model_name="bench",
                                                                               conversation_cache=False)))
            res = bench_serve(url=server.url, engine=engine, model="bench", levels=levels,
                              requests_per_client=a.requests_per_client, prompt_len=a.prompt_len,
                              max_tokens=a.max_tokens, vocab=engine.vocab_size, api_key=None, out=out, command=command)
    print_table(res)
    return 0


def _cmd_bench_throughput(a: argparse.Namespace) -> int:
    from .bench.throughput import DEFAULT_POINTS, bench_throughput, parse_points, print_table
    from .defaults import default_bundle
    from .models.source import EMBEDDED_DEFAULT
    from .runtime.engine import Engine

    points = parse_points(a.points or DEFAULT_POINTS)
    if a.requests is not None and a.requests < 1:
        raise InputError(f"--requests must be >= 1, got {a.requests}")
    if a.bundle and not (Path(a.bundle) / "manifest.json").is_file():
        from .export.exporter import export

        export(a.source or EMBEDDED_DEFAULT, a.bundle, device=a.device,
               max_seq_len=max(i + o for i, o in points))
    bundle = Path(a.bundle) if a.bundle else default_bundle(a.device, model=a.source or EMBEDDED_DEFAULT)
    with Engine.load(bundle, a.device, engine_config(a)) as engine:
        res = bench_throughput(engine, points, a.requests, command="onecopy " + " ".join(sys.argv[1:]),
                               out=Path(a.out) if a.out else None, png=Path(a.png) if a.png else None,
                               prefill=a.prefill)
    print_table(res)
    return 0


def _cmd_bench_decode(a: argparse.Namespace) -> int:
    import torch

    from .bench.decode import bench_decode, default_peers, print_table

    if not torch.cuda.is_available():
        raise OnecopyError("onecopy bench compares batch-1 generation on a CUDA GPU, and none is visible")
    packing = f"-{a.quantize}-g{a.group_size}" if a.quantize else ""
    bundle = Path(a.bundle) if a.bundle else Path(a.work) / f"{Path(a.source).name}-msl{a.max_seq_len}{packing}"
    res = bench_decode(a.source, bundle, prompt_lens=[int(x) for x in a.prompt_lens.split(",")],
                       max_seq_len=a.max_seq_len, new_tokens=a.new_tokens, quantize=a.quantize, group_size=a.group_size,
                       peers=[p for p in (a.peers if a.peers is not None else default_peers(a.quantize)).split(",") if p],
                       out_dir=Path(a.out_dir), tag=a.tag,
                       command="onecopy " + " ".join(sys.argv[1:]))
    print_table(res)
    return 0


def _cmd_export(a: argparse.Namespace) -> int:
    from .export.exporter import export

    try:
        kv_block = None if a.kv_block.lower() == "none" else int(a.kv_block)
    except ValueError:
        raise OnecopyError(f"--kv-block takes a power of two or 'none', got {a.kv_block!r}") from None
    out = export(a.source, a.out, max_seq_len=a.max_seq_len, dtype=a.dtype, device=a.device,
                 methods=tuple(a.methods.split(",")) if a.methods else None, overwrite=a.overwrite, kv_block=kv_block,
                 dequantize=a.dequantize, quantize=a.quantize, group_size=a.group_size, kv_dtype=a.kv_dtype,
                 native_kernels=a.native_kernels, jobs=a.jobs)
    print(f"wrote {out}")
    return 0


def _cmd_info(a: argparse.Namespace) -> int:
    from .bundle import parse_dtype, read_manifest
    from .runtime.memory import gpu_reserve

    m = read_manifest(Path(a.bundle))
    weight_bytes = sum(s.nbytes for s in m.weights.values())
    paged = set(m.paged_state)  # per block: a session at max_seq_len holds a table's width of them
    state_bytes = sum(s.nbytes * (m.table_width if k in paged else 1) for k, s in m.state.items())
    cfg = m.config
    print(f"bundle        {a.bundle}  (format v{m.format_version}, built by torch {m.build.get('torch', '?')})")
    shape = " ".join(f"{k}={cfg[k]}" for k in ("n_layers", "dim", "encoder_layers", "decoder_layers", "d_model",
                                                "vocab_size") if k in cfg)
    print(f"model         {m.build.get('source', '?')}  family={m.family}  {shape}")
    print(f"device kind   {m.device_kind}  dtype={m.dtype}  max_seq_len={m.max_seq_len}")
    for name, spec in m.methods.items():
        shapes = ", ".join(f"{i.name}{i.shape}" for i in spec.inputs)
        invariant = " batch-invariant" if spec.batch_invariant else ""
        print(f"method        {name:<8} weights={spec.weights:<8} role={spec.role:<7}{invariant} "
              f"constants={len(spec.constants)} state={len(spec.state)}  inputs: {shapes}")
    print(f"weights       {len(m.weights)} tensors, {weight_bytes / 2**20:,.1f} MiB (held once on the device)")
    if m.packed:
        kinds: dict[str, list[int]] = {}
        for name, p in m.packed.items():
            key = f"{p['layout']} g{p['group']}" + (f" from {p['source']}" if p.get("source") else "")
            floats = math.prod(p["shape"])
            held = sum(m.weights[f].nbytes for f in m.packed_fqns(name))
            acc = kinds.setdefault(key, [0, 0, 0])
            acc[0], acc[1], acc[2] = acc[0] + 1, acc[1] + held, acc[2] + floats
        itemsize = parse_dtype(m.dtype).itemsize
        for key, (n, held, floats) in sorted(kinds.items()):
            print(f"packed        {n} layers {key}: {held / 2**20:,.1f} MiB for {floats / 1e6:,.1f} M values "
                  f"({held / floats:.3g} B/value; {m.dtype} would take {floats * itemsize / 2**20:,.1f} MiB)")
    print(f"state         {len(m.state)} tensors, {state_bytes / 2**20:,.1f} MiB per session at max_seq_len")
    if paged:
        block = sum(m.state[k].nbytes for k in paged)
        print(f"kv cache      paged: blocks of {m.kv_block_size} positions ({block / 2**10:,.1f} KiB), "
              f"{m.table_width} per session at most; sessions share a common prompt's blocks (prefix cache)")
        print(f"kv dtype      {m.kv_dtype_description()}")
    native = sorted({op for spec in m.methods.values() for op in spec.native_ops})
    if native:
        print(f"native ops    {', '.join(native)}: CUDA C++ kernels built with nvcc on first load (kernels.native)")
    print(f"memory        one session needs ~{(weight_bytes + state_bytes) / 2**20:,.1f} MiB "
          f"(weights + state), each further session {state_bytes / 2**20:,.1f} MiB")
    if a.device_memory:
        total = parse_size(a.device_memory)
        reserve = gpu_reserve(total)  # what the Engine keeps free on a GPU of that size
        fit = max(max(total - weight_bytes - reserve, 0) // max(state_bytes, 1) - 1, 0)  # one pool row is scratch
        print(f"capacity      {fit} sessions fit in {a.device_memory} "
              f"(after {weight_bytes / 2**20:,.1f} MiB of weights and a {reserve / 2**20:,.0f} MiB reserve)")
    return 0


def parse_size(text: str) -> int:
    """'80GiB', '512MiB', '1.5GB', '1000000' -> bytes."""
    units = {"kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40, "kb": 10**3, "mb": 10**6, "gb": 10**9,
             "tb": 10**12, "b": 1, "": 1}
    t = text.strip().lower()
    num = t.rstrip("kmgtib")
    try:
        return int(float(num) * units[t[len(num):]])
    except (ValueError, KeyError):
        raise OnecopyError(f"cannot read size {text!r}; write it like 80GiB, 512MiB or 1000000") from None


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="onecopy", description=__doc__)
    p.add_argument("--log-level", default="warning", choices=["debug", "info", "warning", "error"],
                   help="what onecopy logs to stderr (info: loads, pool sizing, graph capture, failures; debug: "
                        "every request admitted and finished); default warning")
    sub = p.add_subparsers(dest="cmd", required=True)

    r = sub.add_parser("run", help="generate a reply to PROMPT (default: the embedded SmolLM2-135M-Instruct)")
    r.add_argument("prompt")
    r.add_argument("--bundle", help="bundle directory (default: build/reuse the embedded default)")
    r.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    r.add_argument("--max-new-tokens", type=int, default=256)
    r.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    r.add_argument("--top-k", type=int, default=0)
    r.add_argument("--top-p", type=float, default=1.0)
    r.add_argument("--seed", type=int)
    r.add_argument("--raw", action="store_true", help="send the prompt as is, without the chat template")
    r.add_argument("--memory", action="store_true", help="print the memory report afterwards")
    r.set_defaults(fn=_cmd_run)

    e = sub.add_parser("export", help="export SOURCE (preset, .gguf, HF checkpoint dir) into a bundle")
    e.add_argument("source")
    e.add_argument("--out", required=True)
    e.add_argument("--max-seq-len", type=int, help="context length (default: 2048 for LLMs, 448 for Whisper)")
    e.add_argument("--dtype", choices=["float32", "bfloat16", "float16"])
    e.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    e.add_argument("--methods", help="comma-separated (default: all of the family's: prefill,decode or encoder,decoder)")
    e.add_argument("--overwrite", action="store_true")
    e.add_argument("--kv-block", default="16",
                   help="positions per KV block (paged KV, what the prefix cache shares; default 16), or 'none': "
                        "a row of max_seq_len positions per session")
    keep = e.add_mutually_exclusive_group()
    keep.add_argument("--dequantize", action="store_true", default=None,
                      help="store a quantized GGUF's (or GPTQ / AWQ checkpoint's) weights as floats (about 4x the bytes "
                           "on CPU, float32)")
    keep.add_argument("--keep-quantized", dest="dequantize", action="store_false",
                      help="keep a quantized GGUF's (or GPTQ / AWQ checkpoint's) weights packed at their size, read "
                           "packed by the decode kernels "
                           "(the default)")
    e.add_argument("--quantize", choices=["int8", "int4", "fp8"],
                   help="quantize a float checkpoint's projections: int8 symmetric or int4 asymmetric, per group; "
                        "fp8: float8 e4m3 with a scale per output feature, multiplied with FP8 activations on FP8 "
                        "tensor cores (compute capability 8.9+; its decode has no batch-invariant form)")
    e.add_argument("--group-size", type=int, default=128, choices=[16, 32, 64, 128],
                   help="values per scale with --quantize (default 128)")
    e.add_argument("--kv-dtype", choices=["bf16", "int8", "fp8"], default="bf16",
                   help="KV cache storage: the model's dtype (bf16, the default) or 8 bits with a float32 scale per "
                        "position and head (int8, fp8 e4m3): half the KV bytes per session and per decode step")
    e.add_argument("--no-native-kernels", dest="native_kernels", action="store_false",
                   help="CUDA, 8-bit KV: decode with the Triton kernel instead of the CUDA C++ one (built with nvcc "
                        "at export and at load)")
    e.add_argument("--jobs", type=int,
                   help="methods compiled at once, each in a worker process (default: one per CPU, or "
                        "$ONECOPY_EXPORT_JOBS); 1: one after another in this process")
    e.set_defaults(fn=_cmd_export)

    t = sub.add_parser("transcribe", help="transcribe WAV files as concurrent sessions (default: the embedded "
                                          "Whisper tiny.en)")
    t.add_argument("files", nargs="+", metavar="FILE")
    t.add_argument("--bundle", help="Whisper bundle directory (default: build/reuse the embedded tiny.en)")
    t.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    t.add_argument("--max-new-tokens", type=int, help="per 30 s window")
    t.set_defaults(fn=_cmd_transcribe)

    v = sub.add_parser("serve", help="an OpenAI-compatible HTTP server (default: the embedded SmolLM2-135M-Instruct)")
    v.add_argument("source", nargs="?", help="model source to export once and serve (preset, .gguf, checkpoint dir)")
    v.add_argument("--bundle", help="serve this bundle directory")
    v.add_argument("--host", default="127.0.0.1", help="interface to listen on (default: loopback only)")
    v.add_argument("--port", type=int, default=8000)
    v.add_argument("--api-key", help="require 'Authorization: Bearer KEY' on /v1 endpoints")
    v.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    add_engine_options(v, max_queue=64)
    v.add_argument("--model-name", help="the model id clients use (default: the source's name)")
    v.add_argument("--grace", type=float, default=10.0, help="seconds streams get to finish after SIGTERM")
    v.add_argument("--max-body-bytes", type=int, default=4 << 20)
    v.add_argument("--no-conversation-cache", action="store_true",
                   help="without a prefix cache (--no-prefix-cache, or a bundle without paged KV): do not keep "
                        "finished chats' sessions; prefill every chat's history again")
    v.add_argument("--conversation-ttl", type=float, default=600.0, help="seconds an idle conversation is kept")
    v.add_argument("--max-conversations", type=int, help="idle conversations kept (default: as rows allow)")
    v.add_argument("--max-stored-responses", type=int, default=10_000,
                   help="/v1/responses turns kept in memory for previous_response_id (least recently used go first)")
    v.add_argument("--state-dir", help="keep /v1/responses here too: a restarted server (or another replica on the "
                                       "same directory) continues them")
    v.add_argument("--state-dir-gib", type=float, default=4.0, metavar="GIB",
                   help="bytes of /v1/responses files --state-dir keeps, the least recently written deleted first "
                        "(their ids then 404; default 4; the KV blocks there have --kv-disk-gib)")
    v.add_argument("--replicas", type=int, metavar="N",
                   help="serve from N engines on Ray Serve, one per GPU (or per CPU): pip install 'onecopy[ray]'")
    v.add_argument("--ray-address", metavar="auto|ADDR",
                   help="with --replicas: join this Ray cluster ('auto': the one `ray start` runs here) instead of "
                        "starting a local one")
    v.set_defaults(fn=_cmd_serve)

    b = sub.add_parser("bench", help="batch-1 generation next to torch.compile and transformers (CUDA); "
                                     "`bench serve`: load on the HTTP server")
    b.add_argument("--source", default="llama3-8b", help="model source (default: the Llama-3-8B shape, random bf16)")
    b.add_argument("--bundle", help="bundle directory: reused if present, else exported there")
    b.add_argument("--work", default="/tmp/onecopy-bench", help="where bundles are exported when --bundle is not given")
    b.add_argument("--prompt-lens", default="128,1024,8192")
    b.add_argument("--quantize", choices=["int8", "int4", "fp8"], help="export onecopy's bundle with packed projections "
                   "(the peers keep bf16: the same run compares them; with int4 the tinygemm peer runs the same int4 "
                   "values through torch's int4 GEMM)")
    b.add_argument("--group-size", type=int, default=128, choices=[16, 32, 64, 128])
    b.add_argument("--max-seq-len", type=int, default=16384)
    b.add_argument("--new-tokens", type=int, default=256)
    b.add_argument("--peers", help="comma-separated among torch.compile, transformers, tinygemm (an int4 bundle's "
                                   "values); empty for none; default: torch.compile,transformers (+ tinygemm with "
                                   "--quantize int4)")
    b.add_argument("--out-dir", default="benchmarks/results")
    b.add_argument("--tag", default="cuda", help="suffix of the JSON and PNG names, e.g. h200")
    b.set_defaults(fn=_cmd_bench_decode)
    bsub = b.add_subparsers(dest="bench")
    bs = bsub.add_parser("serve", help="N concurrent streaming clients against the OpenAI endpoint")
    bs.add_argument("source", nargs="?", help="model source to serve in this process (default: embedded SmolLM2)")
    bs.add_argument("--url", help="benchmark a running server instead (its base URL)")
    bs.add_argument("--bundle", help="bundle directory to serve in this process")
    bs.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    bs.add_argument("--clients", default="1,16,64", help="concurrency levels, comma-separated")
    bs.add_argument("--requests-per-client", type=int, default=4)
    bs.add_argument("--prompt-len", type=int, default=128)
    bs.add_argument("--max-tokens", type=int, default=64)
    add_engine_options(bs, max_queue=None)  # --max-sessions defaults to the largest level
    bs.add_argument("--api-key")
    bs.add_argument("--out", help="write the JSON here (e.g. benchmarks/results/serve_load.json)")
    bs.set_defaults(fn=_cmd_bench_serve)

    bt = bsub.add_parser("throughput", help="offline throughput: N requests at once per input/output point "
                                            "(as trtllm-bench / vllm bench throughput), beside TensorRT-LLM's figures")
    bt.add_argument("source", nargs="?", help="model source (default: the embedded SmolLM2; llama3-8b for the GPU table)")
    bt.add_argument("--bundle", help="bundle directory: reused if present, else exported there")
    bt.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    bt.add_argument("--points", default=None, help="INPUT/OUTPUT token counts, comma-separated (default: TensorRT-LLM's "
                                                   "128/128,1000/1000,2048/2048)")
    bt.add_argument("--requests", type=int, default=None,
                    help="requests submitted at once per point (default on CUDA: TensorRT-LLM's count for the point, "
                         "30000 at 128/128, 3000 at 1000/1000, 1500 at 2048/2048, 1024 for points it did not run; "
                         "32 on the CPU)")
    bt.add_argument("--prefill", default="batched", choices=["batched", "per-chunk", "both"],
                    help="prefill calls: equal-length chunks of several prompts in one call (default), one call per "
                         "chunk (the baseline), or both, each point measured per chunk first")
    add_engine_options(bt, max_queue=None)
    bt.add_argument("--out", help="write the JSON here (e.g. benchmarks/results/throughput_h100.json)")
    bt.add_argument("--png", help="write the bar chart here")
    bt.set_defaults(fn=_cmd_bench_throughput)

    i = sub.add_parser("info", help="summarize a bundle's manifest and estimate its memory")
    i.add_argument("bundle")
    i.add_argument("--device-memory", help="estimate how many sessions fit in this much device memory, e.g. 80GiB")
    i.set_defaults(fn=_cmd_info)
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(format="%(asctime)s %(name)s %(levelname)s %(message)s")
    logging.getLogger("onecopy").setLevel(args.log_level.upper())
    # torch warns "No CUDA runtime is found" when loading a package on a machine with nvcc but no GPU: noise for a
    # CPU run, and not one clear line
    logging.getLogger("torch.utils.cpp_extension").setLevel(logging.ERROR)
    try:
        return args.fn(args)
    except OnecopyError as e:
        print(f"onecopy: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
