"""The `onecopy` command as a user runs it: `onecopy.cli.main` in this process (`run_cli`), and once the installed
console script in a process of its own (`test_the_console_script_runs_end_to_end`)."""

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

import onecopy as oc

from .conftest import hf_greedy, run_cli


def _api_text(bundle, prompt, n):
    with oc.Engine.load(bundle) as e:
        return "".join(t.text for t in e.open_session().generate(prompt, oc.SamplingParams(max_new_tokens=n), chat=False))


def test_info(tiny_bundle):
    r = run_cli("info", tiny_bundle)
    assert r.returncode == 0, r.stderr
    assert "method        prefill  weights=external" in r.stdout
    assert "method        decode   weights=external" in r.stdout
    assert "per session" in r.stdout and "max_seq_len=64" in r.stdout


def test_run_streams_the_same_tokens_as_the_api(tiny_bundle):
    want = _api_text(tiny_bundle, " hello", 12)
    r = run_cli("run", "--bundle", tiny_bundle, "--raw", "--max-new-tokens", "12", "--memory", " hello")
    assert r.returncode == 0, r.stderr
    assert r.stdout.startswith(want + "\n")
    # streamed: written a token's text at a time (12 tokens, some of whose bytes wait for the next), then "\n"
    reply = r.stdout_writes[:r.stdout_writes.index("\n")]
    assert "".join(reply) == want and len(reply) > 3
    assert "duplicated weights" in r.stdout


def test_the_console_script_runs_end_to_end(tiny_bundle):
    """The `onecopy` script pip installed beside this Python, in a process of its own (the one CLI test that
    starts one): entry point, exit status and output as a shell sees them."""
    script = shutil.which("onecopy", path=os.path.dirname(sys.executable))
    if script is None:
        if os.environ.get("CI"):
            pytest.fail("the onecopy console script is not installed beside this Python (pip install -e .)")
        pytest.skip("the onecopy console script is not installed beside this Python (pip install -e .)")
    here = str(Path(oc.__file__).resolve().parents[1])  # the onecopy under test, before any installed copy
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([here, *filter(None, [os.environ.get("PYTHONPATH")])])}
    want = _api_text(tiny_bundle, " hello", 6)
    r = subprocess.run([script, "run", "--bundle", str(tiny_bundle), "--raw", "--max-new-tokens", "6", " hello"],
                       capture_output=True, text=True, env=env, timeout=240)
    assert r.returncode == 0, r.stderr
    assert r.stdout == want + "\n"
    r = subprocess.run([script, "run", "--bundle", str(tiny_bundle), "hi"], capture_output=True, text=True, env=env,
                       timeout=240)
    assert r.returncode == 2 and r.stderr.startswith("onecopy: error: ") and "Traceback" not in r.stderr


def test_errors_are_one_clear_line(tmp_path, tiny_bundle):
    r = run_cli("run", "--bundle", tmp_path / "missing", "hi")
    assert r.returncode == 2
    assert r.stderr.startswith("onecopy: error: bundle directory") and "Traceback" not in r.stderr
    assert r.stderr.count("\n") == 1 and r.stdout == ""  # one line
    r = run_cli("run", "--bundle", tiny_bundle, "hi")  # tiny has no chat template
    assert r.returncode == 2 and "no chat template; pass raw=True (--raw)" in r.stderr and r.stderr.count("\n") == 1
    r = run_cli("run", "--bundle", tiny_bundle, "--raw", "--top-p", "0", "hi")
    assert r.returncode == 2 and "top_p must be in (0, 1]" in r.stderr and r.stderr.count("\n") == 1


def test_export_from_hf_checkpoint_dir(decode_only_export, tiny_source):
    """A real export by the command line (decode only, 32 positions: the session's `decode_only_export`, which
    test_scheduler serves too)."""
    ckpt, out, r = decode_only_export.checkpoint, decode_only_export.out, decode_only_export.result
    assert r.returncode == 0, r.stderr
    assert (out / "methods" / "decode.pt2").is_file() and not (out / "methods" / "prefill.pt2").exists()
    r = run_cli("export", ckpt, "--out", out, "--max-seq-len", "32", "--methods", "decode")
    assert r.returncode == 2 and "already exists; pass overwrite=True (--overwrite)" in r.stderr
    # A decode-only bundle still generates: the prompt goes through decode token by token.
    with oc.Engine.load(out) as e:
        assert e.methods == ["decode"] and e.prefill_bound == 1
        got = list(e.open_session().generate_ids([1, 2, 3], oc.SamplingParams(max_new_tokens=5), stop_ids=[]))
    assert got == hf_greedy(tiny_source, [1, 2, 3], 5)


def test_log_levels_info_and_debug_say_how_the_engine_was_set_up_and_default_is_quiet(tiny_bundle):
    args = ("run", "--bundle", tiny_bundle, "--raw", "--max-new-tokens", "2", " hello")
    r = run_cli("--log-level", "debug", *args)
    assert r.returncode == 0, r.stderr
    assert "onecopy.runtime.engine INFO" in r.stderr and "CPU default" in r.stderr  # the pool sizing rule
    assert "onecopy.runtime.loop DEBUG request 0 finished: length" in r.stderr
    r = run_cli("--log-level", "info", *args)
    assert r.returncode == 0, r.stderr
    assert "onecopy.runtime.engine INFO" in r.stderr and "CPU default" in r.stderr and " DEBUG " not in r.stderr
    r = run_cli(*args)
    assert r.returncode == 0 and "onecopy." not in r.stderr


def test_a_bad_kv_block_is_refused_before_any_export(tmp_path, monkeypatch):
    from onecopy.export import exporter

    traced = []
    monkeypatch.setattr(exporter, "_export_method", lambda *a: traced.append(a) or pytest.fail("traced a method"))
    r = run_cli("export", "tiny-llama", "--out", tmp_path / "b", "--kv-block", "sixteen")
    assert r.returncode == 2 and "onecopy: error: --kv-block takes a power of two or 'none', got 'sixteen'" in r.stderr
    r = run_cli("export", "tiny-llama", "--out", tmp_path / "b", "--kv-block", "24")
    assert r.returncode == 2 and "kv_block=24 must be a power of two in 1..4096 (--kv-block)" in r.stderr
    assert not (tmp_path / "b").exists() and traced == []
