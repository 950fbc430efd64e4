"""core/files.py's writers never write through a link planted where a file goes (issue 53): a symbolic link, a named
pipe or a folder there is refused in one line naming it, and the link's target keeps its bytes; a hard link planted
there is never written either (a new file is created O_EXCL and renamed over the name)."""

from __future__ import annotations

import os
import re
from pathlib import Path

import pytest
from helpers.paths import PRECIOUS

from lrattn_lightning.core.errors import InputError
from lrattn_lightning.core.files import (
    LinkError,
    append_file,
    open_new,
    open_own,
    refuse_link,
    replacing,
    write_file,
)
from lrattn_lightning.train.checkpoint.lock import FileLock


def one_line_refusal(err: pytest.ExceptionInfo, path: Path) -> str:
    text = str(err.value)
    assert isinstance(err.value, InputError) and "\n" not in text and str(path) in text, text
    return text


def plant(kind: str, path: Path, victim: Path) -> None:
    if kind == "symlink":
        path.symlink_to(victim)
    elif kind == "fifo":
        os.mkfifo(path)
    else:
        path.mkdir()


@pytest.mark.parametrize("kind", ["symlink", "fifo", "folder"])
def test_write_file_refuses_what_is_not_a_regular_file_and_leaves_the_target(tmp_path, victim, kind):
    path = tmp_path / "report.md"
    plant(kind, path, victim)
    with pytest.raises(LinkError) as err:
        write_file(path, "new")
    text = one_line_refusal(err, path)
    assert ("symbolic link to " + str(victim) if kind == "symlink" else "remove") in text
    assert victim.read_text() == PRECIOUS
    assert sorted(p.name for p in tmp_path.iterdir()) == ["report.md", "victim"]  # no temporary left behind


def test_a_hard_link_planted_where_a_file_is_replaced_keeps_its_bytes(tmp_path, victim):
    path = tmp_path / "meta.json"
    os.link(victim, path)
    write_file(path, "{}\n")
    assert path.read_text() == "{}\n" and victim.read_text() == PRECIOUS


def test_open_new_never_opens_an_existing_name_and_takes_over_a_stale_regular_file_only_when_asked(tmp_path, victim):
    link = tmp_path / ".last.ckpt.1.tmp"
    link.symlink_to(victim)
    with pytest.raises(LinkError) as err:
        open_new(link, "checkpoint", stale=True)
    one_line_refusal(err, link)
    stale = tmp_path / ".x.tmp"
    os.link(victim, stale)  # a hard link: unlinked, never written
    with pytest.raises(FileExistsError):
        open_new(stale)
    os.close(open_new(stale, stale=True))
    assert stale.read_bytes() == b"" and victim.read_text() == PRECIOUS


def test_replacing_removes_its_temporary_when_the_writer_fails(tmp_path):
    with pytest.raises(RuntimeError), replacing(tmp_path / "figure.png", "wb") as file:
        file.write(b"half")
        raise RuntimeError("the plot failed")
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("kind", ["symlink", "fifo", "hard link"])
def test_a_lock_file_is_never_opened_through_a_link_a_pipe_or_a_hard_link(tmp_path, victim, kind):
    path = tmp_path / ".lock"
    os.link(victim, path) if kind == "hard link" else plant(kind, path, victim)
    with pytest.raises(LinkError) as err:
        FileLock(path, "lock file").acquire(blocking=False)
    assert ("hard links" if kind == "hard link" else "remove") in one_line_refusal(err, path)
    assert victim.read_text() == PRECIOUS
    with pytest.raises(LinkError):
        os.close(open_own(path))


def test_an_appended_log_is_never_opened_through_a_link(tmp_path, victim):
    log = tmp_path / "fit.log"
    log.symlink_to(victim)
    with pytest.raises(LinkError) as err:
        append_file(log, "fit log")
    one_line_refusal(err, log)
    log.unlink()
    with append_file(log) as out:
        out.write("a\n")
    with append_file(log) as out:
        out.write("b\n")
    assert log.read_text() == "a\nb\n" and victim.read_text() == PRECIOUS


def test_refuse_link_takes_a_regular_file_or_a_folder_as_asked(tmp_path, victim):
    refuse_link(victim)
    refuse_link(tmp_path / "missing")
    refuse_link(tmp_path, folder=True)
    (tmp_path / "dir-link").symlink_to(tmp_path)
    with pytest.raises(LinkError):
        refuse_link(tmp_path / "dir-link", "--out", folder=True)
    with pytest.raises(LinkError):
        refuse_link(victim, "--out", folder=True)


# ---- every writer of the package goes through core/files.py ---------------------------------------------------
PACKAGE = Path(__file__).resolve().parents[2] / "lrattn_lightning"
# a plain writer (follows a link at its path): write_text/write_bytes, open() for writing, shutil's copies,
# os.open with O_CREAT (without O_EXCL), matplotlib's savefig given a path (not a file object and its format)
RAW_WRITER = re.compile(r"\.write_text\(|\.write_bytes\(|\bopen\([^)]*[\"'][wax]b?\+?[\"']|\.open\([\"'][wax]"
                        r"|shutil\.copy(?:file|2)?\(|O_CREAT(?!.*O_EXCL)|\.savefig\((?![^,]+, format=)")
# where a plain writer is safe: a folder this process just created, private (0700), that nobody else can write into
PRIVATE_FOLDERS = {
    "tools/export.py": 5,  # the export's mkdtemp staging folder, renamed into place whole
    "train/checkpoint/load.py": 1,  # a TemporaryDirectory (a checkpoint's tokenizer file for `tokenizers`)
    "tools/kernels/specs.py": 1,  # a TemporaryDirectory (the records handed to compile_check.py)
}


def test_no_module_writes_a_file_with_a_writer_that_follows_links():
    found: dict[str, list[str]] = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        name = str(path.relative_to(PACKAGE))
        if name == "core/files.py":
            continue
        hits = [f"{name}:{i}: {line.strip()}" for i, line in enumerate(path.read_text().splitlines(), 1)
                if RAW_WRITER.search(line)]
        if hits and len(hits) != PRIVATE_FOLDERS.get(name):
            found[name] = hits
    assert not found, ("write files through core/files.py (write_file, replacing, open_new, open_own, append_file) "
                       f"so that a link planted at the path is refused, not followed: {found}")
