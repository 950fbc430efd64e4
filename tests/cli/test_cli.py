"""`lrattn` dispatch: bad input is one line and exit 2; a failure inside the work keeps its traceback."""

from __future__ import annotations

import pytest

from lrattn_lightning import cli
from lrattn_lightning.model.config import config_error


def _install(monkeypatch, error: BaseException) -> None:
    def boom(argv):
        raise error

    monkeypatch.setattr(cli, "_function", lambda spec: boom)


@pytest.mark.parametrize("error", [config_error("entry-x", "rank", "must be positive"),
                                   FileNotFoundError("no such file: data/meta.json")])
def test_input_errors_are_one_line_and_exit_2(monkeypatch, capsys, error):
    _install(monkeypatch, error)
    assert cli.main(["list"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("lrattn: error: ") and err.count("\n") == 1 and str(error).split(":")[0] in err


@pytest.mark.parametrize("error", [ValueError("Expected all tensors to be on the same device"),
                                   RuntimeError("CUDA error"), OSError(28, "No space left on device")])
def test_other_failures_keep_their_traceback(monkeypatch, error):
    _install(monkeypatch, error)
    with pytest.raises(type(error)):
        cli.main(["list"])


def test_a_closed_pipe_is_not_an_error(tmp_path):
    """`lrattn list | head -1`: no traceback when the reader goes away."""
    import subprocess
    import sys

    proc = subprocess.run(f"'{sys.executable}' -m lrattn_lightning.cli list | head -1", shell=True, cwd=tmp_path,
                          capture_output=True, text=True, timeout=120)
    assert proc.stdout.startswith("registry:") and "Traceback" not in proc.stderr, proc.stderr
