"""One live `lrattn fit` per run folder: a `.lock` file held with flock, naming its pid (the kernel drops it when the
process dies, so a stale one is simply taken over); and which launched process is global rank 0. The lock file is
opened without following a link (core/files.py's open_own): a link, a non-regular file or a hard-linked file planted
at `.lock` is refused in one line, never truncated.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import socket
import time
from collections.abc import Callable
from pathlib import Path

from lrattn_lightning.core.errors import InputError
from lrattn_lightning.core.files import open_own


class RunFolderError(InputError):
    """The run folder cannot be used: another live process holds it, or it cannot be written."""


class FileLock:
    """An exclusive flock on `path` that records who holds it; released (and the file removed) by `release`.

    The kernel drops a flock when its process dies, so a lock file left by a killed process is not
    held and is simply taken over: stale locks need no pid checks. After locking, the path must
    still name the locked file (another process may have removed it meanwhile), else we retry.
    """

    def __init__(self, path: Path, what: str = "lock file"):
        self.path = Path(path)
        self.what = what
        self._fd: int | None = None

    def acquire(self, blocking: bool = True, describe: Callable[[str], str] | None = None) -> FileLock:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        while True:
            fd = open_own(self.path, self.what)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | (0 if blocking else fcntl.LOCK_NB))
            except BlockingIOError:
                holder = _read_holder(fd)
                os.close(fd)
                raise RunFolderError(describe(holder) if describe else f"{self.path} is locked by {holder}") from None
            try:
                same = os.fstat(fd).st_ino == os.lstat(self.path).st_ino
            except FileNotFoundError:
                same = False
            if same:
                break
            os.close(fd)
        os.ftruncate(fd, 0)
        os.write(fd, f"pid {os.getpid()} on {socket.gethostname()} since {time.strftime('%Y-%m-%d %H:%M:%S')}\n".encode())
        self._fd = fd
        return self

    def release(self) -> None:
        if self._fd is None:
            return
        with contextlib.suppress(FileNotFoundError):
            self.path.unlink()  # before unlocking: a waiter then finds the path gone and retries
        os.close(self._fd)
        self._fd = None


def _read_holder(fd: int) -> str:
    try:
        return os.pread(fd, 200, 0).decode(errors="replace").strip() or "another process"
    except OSError:
        return "another process"


_HELD: list[tuple[FileLock, list[Path]]] = []


def launched_as_rank_zero() -> bool:
    """Whether this process will be global rank 0, judged from the launcher's environment before the
    Trainer exists (torchrun/mpirun: RANK, srun: SLURM_PROCID, Lightning's own children: LOCAL_RANK
    and NODE_RANK). Only that process owns the run folder and creates the MLflow run."""
    for key in ("RANK", "SLURM_PROCID", "PMI_RANK", "OMPI_COMM_WORLD_RANK"):
        if os.environ.get(key, "").isdigit():
            return int(os.environ[key]) == 0
    return all(os.environ.get(key, "0") == "0" for key in ("LOCAL_RANK", "NODE_RANK", "GROUP_RANK"))


def run_lock_path(run_dir: Path) -> Path:
    """The run folder's lock file."""
    return Path(run_dir) / ".lock"


def lock_run_folder(run_dir: Path) -> FileLock:
    """Hold `run_dir/.lock` until `release_run_locks()`; RunFolderError if a live process holds it."""
    run_dir = Path(run_dir)
    created = [p for p in (run_dir, *run_dir.parents) if not p.exists()]
    lock = FileLock(run_lock_path(run_dir), "the run folder's lock file")
    try:
        lock.acquire(blocking=False, describe=lambda holder: (
            f"run folder {run_dir} is in use by {holder}: two processes would write the same checkpoints. "
            "Wait for it to finish, stop it, or start this run under another --run_name"))
    except OSError as err:
        raise RunFolderError(f"run folder {run_dir} cannot be created or written ({err.strerror or err}); "
                            "choose a writable --runs_dir") from err
    _HELD.append((lock, created))
    return lock


def release_run_locks() -> None:
    """Release the run folders' locks; folders this process created and left empty are removed again."""
    while _HELD:
        lock, created = _HELD.pop()
        lock.release()
        for folder in created:  # deepest first
            try:
                folder.rmdir()
            except OSError:
                break
