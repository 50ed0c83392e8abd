"""The `onecopy` command as a user runs it (subprocesses)."""

import subprocess
import sys


def onecopy(*args, env=None):
    return subprocess.run([sys.executable, "-m", "onecopy.cli", *args], capture_output=True, text=True, env=env,
                          timeout=600)


def test_info(tiny_bundle):
    r = onecopy("info", str(tiny_bundle))
    assert r.returncode == 0, r.stderr
    assert "method        prefill  weights=external" in r.stdout
    assert "method        decode   weights=external" in r.stdout
    assert "per session" in r.stdout and "max_seq_len=64" in r.stdout


def test_run_streams_the_same_tokens_as_the_api(tiny_bundle):
    import onecopy as oc

    with oc.Engine.load(tiny_bundle) as e:
        want = "".join(t.text for t in e.open_session().generate(" hello", oc.SamplingParams(max_new_tokens=12), chat=False))
    r = onecopy("run", "--bundle", str(tiny_bundle), "--raw", "--max-new-tokens", "12", "--memory", " hello")
    assert r.returncode == 0, r.stderr
    assert r.stdout.startswith(want + "\n")
    assert "duplicated weights" in r.stdout


def test_errors_are_one_clear_line(tmp_path, tiny_bundle):
    r = onecopy("run", "--bundle", str(tmp_path / "missing"), "hi")
    assert r.returncode == 2
    assert r.stderr.startswith("onecopy: error: bundle directory") and "Traceback" not in r.stderr
    r = onecopy("run", "--bundle", str(tiny_bundle), "hi")  # tiny has no chat template
    assert r.returncode == 2 and "no chat template; pass raw=True (--raw)" in r.stderr
    r = onecopy("run", "--bundle", str(tiny_bundle), "--raw", "--top-p", "0", "hi")
    assert r.returncode == 2 and "top_p must be in (0, 1]" in r.stderr


def test_export_from_hf_checkpoint_dir(tmp_path, tiny_source):
    ckpt = tmp_path / "ckpt"
    tiny_source.save_hf(ckpt)
    out = tmp_path / "b"
    r = onecopy("export", str(ckpt), "--out", str(out), "--max-seq-len", "16", "--methods", "decode")
    assert r.returncode == 0, r.stderr
    assert (out / "methods" / "decode.pt2").is_file() and not (out / "methods" / "prefill.pt2").exists()
    r = onecopy("export", str(ckpt), "--out", str(out), "--max-seq-len", "16", "--methods", "decode")
    assert r.returncode == 2 and "already exists; pass overwrite=True (--overwrite)" in r.stderr
    # A decode-only bundle still generates: the prompt goes through decode token by token.
    import onecopy as oc

    with oc.Engine.load(out) as e:
        assert e.methods == ["decode"] and e.prefill_bound == 1
        got = list(e.open_session().generate_ids([1, 2, 3], oc.SamplingParams(max_new_tokens=5), stop_ids=[]))
    from .conftest import hf_greedy

    assert got == hf_greedy(tiny_source, [1, 2, 3], 5)


def test_log_level_info_says_how_the_engine_was_set_up_and_default_is_quiet(tiny_bundle):
    args = ("run", "--bundle", str(tiny_bundle), "--raw", "--max-new-tokens", "2", " hello")
    r = onecopy("--log-level", "debug", *args)
    assert r.returncode == 0, r.stderr
    assert "onecopy.runtime.engine INFO" in r.stderr and "CPU default" in r.stderr  # the pool sizing rule
    assert "onecopy.runtime.loop DEBUG request 0 finished: length" in r.stderr
    r = onecopy(*args)
    assert r.returncode == 0 and "onecopy." not in r.stderr


def test_a_bad_kv_block_is_refused_before_any_export(tmp_path):
    r = onecopy("export", "tiny-llama", "--out", str(tmp_path / "b"), "--kv-block", "sixteen")
    assert r.returncode == 2 and "onecopy: error: --kv-block takes a power of two or 'none', got 'sixteen'" in r.stderr
    r = onecopy("export", "tiny-llama", "--out", str(tmp_path / "b"), "--kv-block", "24")
    assert r.returncode == 2 and "kv_block=24 must be a power of two in 1..4096 (--kv-block)" in r.stderr
    assert not (tmp_path / "b").exists()
