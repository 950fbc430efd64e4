"""`lrattn generate` / `lrattn chat`: streamed text from a checkpoint; chat driven through a real pty."""

from __future__ import annotations

import os
import pty
import select
import subprocess
import sys
import time

import torch
from helpers.models import make_checkpoint
from helpers.paths import TESTS_DIR

from lrattn_lightning.data.tokenizer import ByteTokenizer
from lrattn_lightning.model import generate as generate_module
from lrattn_lightning.model.generate import generate
from lrattn_lightning.tools.generate import TextStream, chat_main, generate_main

TESTS = TESTS_DIR


def test_text_stream_waits_for_whole_characters():
    stream = TextStream(ByteTokenizer())
    pieces = [stream.push(b) for b in "aé✓".encode()]
    assert pieces == ["a", "", "é", "", "", "✓"]


def test_generate_prints_the_greedy_continuation(tmp_path, capsys):
    model = make_checkpoint(tmp_path / "last.ckpt", "p-lr-block-n8-r32", seq_len=64)
    assert generate_main(["--checkpoint", str(tmp_path / "last.ckpt"), "--prompt", "abc",
                          "--max_new_tokens", "10", "--temperature", "0"]) == 0
    out = capsys.readouterr().out
    tok = ByteTokenizer()
    ids = generate(model, torch.tensor([tok.encode("abc")]), 10, eos_id=tok.eos_id)[0].tolist()
    expected = tok.decode(ids[: ids.index(tok.eos_id)] if tok.eos_id in ids else ids)  # the text stops at EOS
    assert out == "abc" + expected + "\n"


def test_generate_keeps_the_whole_prompt_and_says_where_the_window_ends(tmp_path, capsys):
    """A 50-token prompt on a 64-token window with --max_new_tokens 200: the model sees all 50 tokens (it saw
    only the last few before) and writes the 15 that fit, and stderr says why it stopped."""
    model = make_checkpoint(tmp_path / "last.ckpt", "s-lr-block-n8-r64", seq_len=64)
    prompt = "The quick brown fox jumps over the lazy dog; then "  # 50 bytes
    assert generate_main(["--checkpoint", str(tmp_path / "last.ckpt"), "--prompt", prompt,
                          "--max_new_tokens", "200", "--temperature", "0"]) == 0
    captured = capsys.readouterr()
    tok = ByteTokenizer()
    ids = generate(model, torch.tensor([tok.encode(prompt)]), 15)[0].tolist()  # the whole prompt as context
    if tok.eos_id in ids:
        ids = ids[: ids.index(tok.eos_id)]
    assert captured.out == prompt + tok.decode(ids) + "\n"
    if len(ids) == 15:
        assert "stopped after 15 new tokens" in captured.err and "64" in captured.err


def test_generate_sampling_is_seeded_and_bad_options_are_one_line(tmp_path, capsys):
    make_checkpoint(tmp_path / "last.ckpt", "s-lr-block-n8-r64", seq_len=64)
    args = ["--checkpoint", str(tmp_path / "last.ckpt"), "--prompt", "x", "--max_new_tokens", "20",
            "--temperature", "1.0", "--top_k", "40", "--top_p", "0.9"]
    runs = []
    for seed in ("1", "1", "2"):
        assert generate_main([*args, "--seed", seed]) == 0
        runs.append(capsys.readouterr().out)
    assert runs[0] == runs[1] and runs[0] != runs[2]
    for bad, field in ((["--top_p", "1.5"], "--top_p"), (["--temperature", "-1"], "--temperature"),
                       (["--max_new_tokens", "0"], "--max_new_tokens")):
        assert generate_main([*args, *bad]) == 2
        err = capsys.readouterr().err.strip()
        assert err.count("\n") == 0 and field in err
    assert generate_main(["--checkpoint", str(tmp_path / "missing.ckpt"), "--prompt", "x"]) == 2
    assert "missing.ckpt" in capsys.readouterr().err


def test_chat_in_process_keeps_and_resets_its_text(tmp_path):
    import io

    make_checkpoint(tmp_path / "last.ckpt", "baseline", seq_len=64)
    stdin = io.StringIO("hello\n/reset\nagain\n/quit\n")
    stdout = io.StringIO()
    assert chat_main(["--checkpoint", str(tmp_path / "last.ckpt"), "--max_new_tokens", "8"], stdin, stdout) == 0
    text = stdout.getvalue()
    assert text.count("> ") == 4 and "(text forgotten)" in text


def _read_until(fd: int, marker: bytes, timeout: float = 60.0) -> bytes:
    buf, end = b"", time.monotonic() + timeout
    while marker not in buf:
        if time.monotonic() > end:
            raise AssertionError(f"no {marker!r} in {buf[-400:]!r}")
        ready, _, _ = select.select([fd], [], [], 0.5)
        if ready:
            try:
                chunk = os.read(fd, 4096)
            except OSError:
                break
            if not chunk:
                break
            buf += chunk
    return buf


def test_chat_in_a_real_terminal(tmp_path):
    """The chat loop on a pseudo-terminal: prompt, a streamed reply, /reset, /quit, clean exit."""
    make_checkpoint(tmp_path / "last.ckpt", "s-lr-block-n8-r64", seq_len=64)
    main, child = pty.openpty()
    env = {**os.environ, "PYTHONPATH": f"{TESTS}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    code = ("import sys; from lrattn_lightning.tools.generate import chat_main; "
            f"sys.exit(chat_main(['--checkpoint', {str(tmp_path / 'last.ckpt')!r}, '--max_new_tokens', '6']))")
    proc = subprocess.Popen([sys.executable, "-c", code], stdin=child, stdout=child, stderr=child, env=env,
                            close_fds=True)
    os.close(child)
    try:
        assert b"lrattn chat" in _read_until(main, b"> ")
        os.write(main, b"hello there\n")
        reply = _read_until(main, b"> ")
        assert reply.startswith(b"hello there") and len(reply) > len(b"hello there\r\n> ")
        os.write(main, b"/reset\n")
        assert b"(text forgotten)" in _read_until(main, b"> ")
        os.write(main, b"/quit\n")
        assert proc.wait(timeout=30) == 0
    finally:
        proc.kill()
        os.close(main)


def test_generate_with_the_static_cache_prints_the_same_text(tmp_path, capsys, monkeypatch):
    """--cache static, eager and with its decode step compiled (aot_eager on CPU: what Inductor would compile),
    writes what the dynamic cache writes; the gated residual, which keeps its own decoding state, is told to use
    the dynamic cache."""
    make_checkpoint(tmp_path / "last.ckpt", "s-lr-block-n8-r64", seq_len=64)
    args = ["--checkpoint", str(tmp_path / "last.ckpt"), "--prompt", "abc", "--max_new_tokens", "12",
            "--temperature", "0"]
    monkeypatch.setattr(generate_module, "COMPILE_BACKEND", "aot_eager")
    texts = []
    for extra in (["--cache", "dynamic"], ["--cache", "static"], ["--cache", "static", "--compile", "true"]):
        assert generate_main([*args, *extra]) == 0
        texts.append(capsys.readouterr().out)
    assert texts[0] == texts[1] == texts[2] and texts[0].startswith("abc")
    assert generate_main([*args, "--compile", "true"]) == 2  # auto on CPU: the dynamic cache
    assert "--cache static" in capsys.readouterr().err
    make_checkpoint(tmp_path / "gated.ckpt", "gated-residual", seq_len=64)
    assert generate_main(["--checkpoint", str(tmp_path / "gated.ckpt"), "--prompt", "a", "--cache", "static"]) == 2
    assert "--cache dynamic" in capsys.readouterr().err
