"""Where `prepare` builds a folder before it exists: one hidden staging folder per output, held by a lock.

    PARENT/.NAME.tmp-prepare/            the staging folder of --out PARENT/NAME, renamed to NAME when complete
      .prepare/owner.json, recipe.json   who holds it; the arguments and inputs it was started with
      .prepare/parts/                    the parts written so far (data/pipeline.py)

The prepare that runs holds an exclusive flock on the staging folder, so a second prepare of the same --out is
refused in one line while it runs. A staging folder that nobody holds was left by a killed prepare: it is
resumed when started with the same arguments on the same inputs, else emptied, with one line either way.
Leftovers of older prepares of the same output (`.NAME.tmp-*`, `.NAME.old-*`) that nobody holds are removed,
with one line; one that a live process holds is not touched.

A signal (SIGTERM, SIGINT, SIGHUP) stops a prepare with `Interrupted` at the next safe point: the handler only
records it, and the pipeline calls check_stop() between documents, batches, hashed megabytes and uploaded files
(an exception raised from a handler lands anywhere: inside a pool's pipe write, a lock, a finaliser that drops
it). A second signal while the first waits raises at once. While the finished folder is being published,
signals wait and are then dropped: what they would stop is done.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import glob
import json
import os
import shutil
import signal
import socket
import stat
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from lrattn_lightning.core.errors import InputError
from lrattn_lightning.core.files import LinkError, refuse_link, write_file

BOOK = ".prepare"  # the staging folder's bookkeeping, removed when it is published
# held: a finished folder is being published; pending: a signal received and not yet acted on
_SIGNALS: dict[str, Any] = {"held": False, "pending": None}


class Interrupted(BaseException):  # noqa: N818  (a BaseException, like KeyboardInterrupt: no `except Exception` eats it)
    """A signal stopped `prepare`; its staging folder is kept, so the same command continues it."""

    def __init__(self, signum: int) -> None:
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


def say(message: str) -> None:
    print(f"[lrattn prepare] {message}", file=sys.stderr, flush=True)


def _lock(path: Path) -> int | None:
    """An fd holding an exclusive flock on the folder, or None when another process holds it or it is gone."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError:  # gone, not a folder, or a link (ELOOP): never followed
        return None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        return None
    if not path.exists() or os.lstat(path).st_ino != os.fstat(fd).st_ino:  # renamed away meanwhile
        os.close(fd)
        return None
    return fd


def _owner(path: Path) -> str:
    try:
        owner = json.loads((path / BOOK / "owner.json").read_text())
        return f"pid {owner['pid']} on {owner['host']}, started {owner['started']}"
    except (OSError, ValueError, KeyError, TypeError):
        return "its owner unknown"


class Staging:
    """A claimed staging folder: `path`, whether it continues an interrupted prepare (`resumed`)."""

    def __init__(self, path: Path, fd: int, resumed: bool) -> None:
        self.path, self.fd, self.resumed = path, fd, resumed

    def release(self) -> None:
        """Keep the folder for a later resume; let another prepare have it."""
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1

    def remove(self) -> None:
        shutil.rmtree(self.path, ignore_errors=True)
        self.release()


def staging_path(out: Path) -> Path:
    """The staging folder of --out `out`."""
    return out.parent / f".{out.name}.tmp-prepare"


def claim(out: Path, recipe: dict[str, Any]) -> Staging:
    """The staging folder of `out`, locked: a new one, or a dead prepare's (resumed if `recipe` matches, else
    emptied). InputError when a live prepare holds it."""
    parent, name = out.parent, out.name
    parent.mkdir(parents=True, exist_ok=True)
    path = staging_path(out)
    recipe = json.loads(json.dumps(recipe))
    for _ in range(100):
        if os.path.lexists(path):
            _own_private_folder(path)
            fd = _lock(path)
            if fd is None:
                if path.exists():
                    raise InputError(f"--out {out} is being written by another `lrattn prepare` ({_owner(path)}); "
                                     "wait for it to finish, or choose another --out")
                continue
            staging = Staging(path, fd, resumed=False)
            try:
                earlier = json.loads((path / BOOK / "recipe.json").read_text())
            except (OSError, ValueError):
                earlier = None
            if earlier == recipe:
                staging.resumed = True
            else:
                for child in path.iterdir():
                    shutil.rmtree(child) if child.is_dir() and not child.is_symlink() else child.unlink()
                say(f"emptied {path}, left by an interrupted prepare "
                    f"{'of other arguments or inputs' if earlier else 'that had not started'}; starting afresh")
        else:
            tmp = Path(tempfile.mkdtemp(prefix=f".{name}.tmp-", dir=parent))
            fd = _lock(tmp)
            if fd is None:  # another prepare's clean-up took it in the instant before the lock
                continue
            try:
                os.rename(tmp, path)  # fails when another prepare put its folder there first
            except OSError as err:
                os.close(fd)
                shutil.rmtree(tmp, ignore_errors=True)
                if err.errno not in (errno.ENOTEMPTY, errno.EEXIST):
                    raise
                continue
            staging = Staging(path, fd, resumed=False)
        _write(path / BOOK / "owner.json", {"pid": os.getpid(), "host": socket.gethostname(),
                                            "started": time.strftime("%Y-%m-%d %H:%M:%S")})
        _write(path / BOOK / "recipe.json", recipe)
        _remove_leftovers(parent, name, path)
        return staging
    raise InputError(f"--out {out}: could not claim {path} (other prepares keep taking it); try again")


def _own_private_folder(path: Path) -> None:
    """A staging folder left by an earlier prepare is resumed or emptied only when it is a folder (not a link) of this
    user that nobody else can write into (mkdtemp made it 0700): another user's could hold links planted inside."""
    info = os.lstat(path)
    if not stat.S_ISDIR(info.st_mode):
        refuse_link(path, "staging folder")
        raise LinkError(f"staging folder {path} is not a folder; remove it and run again")
    if info.st_uid != os.getuid() or info.st_mode & 0o022:
        raise LinkError(f"staging folder {path} belongs to another user or others can write into it "
                        f"(mode {stat.S_IMODE(info.st_mode):o}): lrattn writes only into a private folder of its "
                        "own: remove it and run again")


def _remove_leftovers(parent: Path, name: str, keep: Path) -> None:
    for pattern in (f".{glob.escape(name)}.tmp-*", f".{glob.escape(name)}.old-*"):
        for path in sorted(parent.glob(pattern)):
            if path == keep or not path.is_dir():
                continue
            fd = _lock(path)
            if fd is None:
                continue  # a live process holds it: not ours to touch
            shutil.rmtree(path, ignore_errors=True)
            os.close(fd)
            say(f"removed {path}, left by an interrupted `lrattn prepare`")


def _write(path: Path, value: Any) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    write_file(path, json.dumps(value, indent=2) + "\n")


def publish(staging: Staging, out: Path, overwrite: bool) -> None:
    """Rename the finished staging folder to `out` (an old `out` replaced only with `overwrite`), readable as
    the umask says (mkdtemp made it private), without its bookkeeping."""
    with holding_signals():
        staging.path.chmod(0o777 & ~_current_umask())
        if out.exists():
            if not overwrite:
                raise InputError(f"--out {out} appeared while this prepare ran (another one finished it first); "
                                 "it is left as it is: pass --overwrite to replace it, or choose another --out")
            trash = Path(tempfile.mkdtemp(prefix=f".{out.name}.old-", dir=out.parent))
            os.replace(out, trash / out.name)
            os.replace(staging.path, out)
            shutil.rmtree(trash, ignore_errors=True)
        else:
            os.replace(staging.path, out)
        shutil.rmtree(out / BOOK, ignore_errors=True)
        staging.release()


def _current_umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


@contextlib.contextmanager
def holding_signals() -> Iterator[None]:
    """Signals that arrive inside wait until its end, and are then dropped: what they would stop is done."""
    _SIGNALS["held"] = True
    try:
        yield
    finally:
        _SIGNALS["held"] = False
        if _SIGNALS["pending"] is not None:
            say(f"{signal.Signals(_SIGNALS['pending']).name} came while the finished folder was published; it is complete")
            _SIGNALS["pending"] = None


def check_stop() -> None:
    """Interrupted when a signal came since stop_on_signals began (a safe point: call it between units of work,
    in any thread); nothing otherwise, and nothing outside stop_on_signals or while a folder is published."""
    if _SIGNALS["pending"] is not None and not _SIGNALS["held"]:
        raise Interrupted(_SIGNALS["pending"])


@contextlib.contextmanager
def stop_on_signals() -> Iterator[None]:
    """SIGTERM, SIGINT and SIGHUP stop the work at its next check_stop(); a second one while the first waits
    raises Interrupted at once (the command line installs this)."""

    def handler(signum: int, frame: Any) -> None:
        first = _SIGNALS["pending"] is None
        _SIGNALS["pending"] = signum
        if not first and not _SIGNALS["held"]:  # asked twice: the user wants it now, wherever it lands
            raise Interrupted(signum)

    wanted = [signal.SIGTERM, signal.SIGINT, signal.SIGHUP]
    saved = {s: signal.getsignal(s) for s in wanted}
    _SIGNALS.update(held=False, pending=None)
    for s in wanted:
        if saved[s] is not signal.SIG_IGN:  # a signal ignored at launch (nohup) stays ignored
            signal.signal(s, handler)
    try:
        yield
    finally:
        for s, h in saved.items():
            signal.signal(s, h)
        _SIGNALS["pending"] = None
