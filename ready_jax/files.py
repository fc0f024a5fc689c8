"""Crash-safe and race-free writes: every checkpoint, conversion and result file becomes current in one atomic
step, and two processes writing the same place never silently lose one's work.

A file is written whole under a temporary name beside its destination, flushed to disk and renamed over it
(:func:`write_file`); a directory is written whole beside its destination and swapped into place
(:func:`write_directory`), or, where the destination must be new, renamed into place only if nothing holds
it yet (``replace=False``). A process killed at any instant, or a write that runs out of disk, leaves the
previous version or the new one, never a part of one or a mix of both.

Processes that must not share a place take a lock on it: :func:`exclusive_lock` (a run's working directory:
a second run is refused at once, told who holds it) and :func:`update_json` (a manifest several writers add
to: they wait their turn). Both are ``flock`` locks, which die with their process, so a crash never leaves
one behind.

Temporaries are hidden names that carry their writer's process id (``.NAME.PID-RANDOM.tmp`` for a file,
``.NAME.PID-RANDOM.partial`` for a directory, ``.NAME.PID-RANDOM.old`` for a directory renamed aside), so
the next write to ``NAME`` recognises those of a writer that is no longer running and removes them
(:func:`remove_leftovers`); they never block it. Directories left by versions of ready-jax that did not
record the process id are reported, not removed.

Every path is what it claims to be, by one rule for writers (:func:`output_kind`) and one for readers
(:func:`source_file`, :func:`open_regular`): nothing is written through a symbolic link nor replaces one (a link
planted where a lock, a metrics log, a checkpoint or an ``--out`` goes would otherwise have its target
overwritten); a device, FIFO or socket named as an output (``/dev/null``, ``/dev/stdout``) is written in place,
never replaced; a directory where a file goes is refused. A reader opens only regular files, never blocking on a
FIFO, and only files that stay inside the directory they belong to.

:func:`check_output` answers before any long work starts whether a path can be written at all (and whether
the disk has room, when the size is known).
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import fcntl
import json
import os
import re
import secrets
import shutil
import stat
import threading
import time
import warnings
from collections.abc import Callable, Iterator

# A temporary of a write to NAME; a write to a temporary (a checkpoint saved inside a conversion's directory)
# adds a suffix of its own, so every process id of the chain is captured.
_LEFTOVER = r"\.+{name}(?P<chain>(?:\.\d+-[0-9a-f]+\.(?:tmp|partial|old))+)"
_SUFFIX = re.compile(r"\.(\d+)-[0-9a-f]+\.(?:tmp|partial|old)")
# What earlier versions left: a file's ``NAME.tmp-PID`` and an export's mkdtemp directory without a pid.
_OLD_FILE_LEFTOVER = r"{name}\.tmp-(?P<pid>\d+)"
_OLD_DIRECTORY_LEFTOVER = r"\.{name}\.[a-z0-9_]{{8}}\.partial"
_RENAME_EXCHANGE = 2  # linux/fs.h
# Lock files this process holds (exclusive_lock) -> the thread holding each, so a nested claim in that thread passes
# and another thread's is refused like another process's.
_held_locks: dict[str, int] = {}


class DestinationTaken(FileExistsError):
    """Another writer made a directory that had to be new while this one was being written; nothing was
    replaced and this write's temporary was removed."""


class LockHeld(BlockingIOError):
    """Another running process holds the lock (:func:`exclusive_lock`); the message names it and what it runs."""


def write_file(dst: str | os.PathLike, write: Callable[[str], None]) -> None:
    """``write(tmp)`` a file beside ``dst``, flush it to disk and rename it over ``dst``: readers see the
    old file or the whole new one. A failed ``write`` (a full disk) leaves ``dst`` as it was and removes
    the temporary. The file gets the permissions the umask gives any new file. A device, FIFO or socket
    ``dst`` is written in place (``write(dst)``); a directory or a symbolic link is refused (:func:`output_kind`)."""
    dst = os.path.abspath(dst)
    if output_kind(dst) == "in place":
        write(dst)
        return
    remove_leftovers(dst)
    tmp = temporary_name(dst, "tmp")
    try:
        write(tmp)
        _fsync(tmp)
        give_default_mode(tmp)
        os.replace(tmp, dst)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.remove(tmp)
        raise
    _fsync(os.path.dirname(dst))


def output_kind(path: str | os.PathLike, what: str = "output", *, kind: str = "file") -> str:
    """How the ``kind`` ("file" or "directory") at ``path`` is written, by the rule every writer follows: "new" (nothing
    there) or "replace" (a regular file, or a directory for a directory): written whole beside it and renamed over it;
    "in place" (a file only: a character or block device, a FIFO or a socket, or a link to one, such as
    ``/dev/null`` or ``/dev/stdout``): opened and written, never replaced. Anything else is refused (OSError naming
    ``path``): a directory where a file goes, a file where a directory goes, and a symbolic link to anything but a
    device, FIFO or socket, which is neither written through (a link planted in a workdir would have its target
    overwritten) nor replaced (the user's link would be lost)."""
    path = os.fspath(path)
    try:
        mode = os.lstat(path).st_mode
    except FileNotFoundError:
        return "new"
    except NotADirectoryError:
        return "new"  # an ancestor is a file: check_output names it
    if stat.S_ISLNK(mode):
        try:
            followed = os.stat(path).st_mode
        except OSError:
            followed = None
        if kind == "file" and followed is not None and _is_stream(followed):
            return "in place"
        raise OSError(errno.ELOOP, f"cannot write the {what} {path}: it is a symbolic link to "
                      f"{os.path.realpath(path)}; nothing is written through a link nor replaces one (give the "
                      "path itself)")
    if kind == "file" and _is_stream(mode):
        return "in place"
    if kind == "file" and stat.S_ISDIR(mode):
        raise IsADirectoryError(errno.EISDIR, f"cannot write the {what} {path}: it is a directory; name a file")
    if kind == "directory" and not stat.S_ISDIR(mode):
        raise NotADirectoryError(errno.ENOTDIR, f"cannot write the {what} {path}: it is a file, not a directory")
    return "replace"


def _is_stream(mode: int) -> bool:
    """A device, FIFO or socket: written in place, since replacing it would lose what it is (``/dev/null``)."""
    return stat.S_ISCHR(mode) or stat.S_ISBLK(mode) or stat.S_ISFIFO(mode) or stat.S_ISSOCK(mode)


def open_append(path: str | os.PathLike):
    """``path`` opened for appending text (a metrics log), made if missing; a symbolic link, or anything but a
    regular file, is refused (:func:`output_kind`) and never written through."""
    path = os.fspath(path)
    if output_kind(path, "log") == "in place":
        return open(path, "a", encoding="utf-8")  # noqa: SIM115 (the caller closes it)
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o666)
    return os.fdopen(fd, "a", encoding="utf-8")


def source_file(directory: str | os.PathLike, name: str, what: str = "file") -> str:
    """The path of the file ``name`` of the directory ``directory`` (a checkpoint, a conversion's source), refused
    (ValueError) unless it stays inside: ``name`` is a relative path without ``..``, and the file, followed through
    every link, is a regular file (not a FIFO, which would hang the reader, nor a device or a directory) inside
    ``directory`` or, when ``directory`` is a snapshot of the Hugging Face cache
    (``.../models--ORG--NAME/snapshots/REVISION/``), inside that repository's ``blobs/``, where the snapshot's
    links point. A directory handed over by someone else then cannot make a load or a conversion read or copy
    another file of the machine: a ``tokenizer.json`` linking to ``/etc/passwd``, a shard named ``../../secret``.
    A missing file is returned as it is, for the caller to report."""
    directory = os.fspath(directory)
    if not name or os.path.isabs(name) or ".." in name.split("/"):
        raise ValueError(f"the {what} {name!r} of {directory} is not a file name inside it: refusing to read it")
    path = os.path.join(directory, name)
    resolved = os.path.realpath(path)
    if not any(os.path.commonpath([resolved, root]) == root for root in _source_roots(directory)):
        raise ValueError(f"the {what} {path} links to {resolved}, outside {directory}: refusing to read it (put the "
                         "file itself there)")
    if os.path.exists(resolved) and not os.path.isfile(resolved):
        raise ValueError(f"the {what} {path} is not a regular file: refusing to read it")
    return path


def _source_roots(directory: str) -> list[str]:
    """Where the files of directory ``directory`` may lie: the directory itself and, for a snapshot of the Hugging
    Face cache (or a folder inside one), the ``blobs/`` of its repository."""
    root = os.path.realpath(directory)
    roots = [root]
    ancestor = root
    while os.path.dirname(ancestor) != ancestor:
        parent = os.path.dirname(ancestor)
        if os.path.basename(parent) == "snapshots" and "--" in os.path.basename(os.path.dirname(parent)):
            roots.append(os.path.join(os.path.dirname(parent), "blobs"))
            break
        ancestor = parent
    return roots


def open_regular(path: str | os.PathLike, what: str = "file", *, dir_fd: int | None = None) -> int:
    """A read-only descriptor of the regular file ``path`` (relative to ``dir_fd`` if given). Opened without blocking,
    then checked: a FIFO, device, socket or directory is a ValueError naming it at once, not a reader that hangs."""
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC, dir_fd=dir_fd)
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise ValueError(f"the {what} {path} is not a regular file: refusing to read it")
    os.set_blocking(fd, True)
    return fd


def write_text(dst: str | os.PathLike, text: str) -> None:
    """:func:`write_file` of ``text`` (UTF-8)."""
    def write(tmp: str) -> None:
        with open(tmp, "w", encoding="utf-8") as f:
            f.write(text)

    write_file(dst, write)


def write_directory(dst: str | os.PathLike, write: Callable[[str], None], *, keep_other_files: bool = False,
                    replace: bool = True) -> None:
    """``write(tmp)`` a fresh directory beside ``dst``, then make it ``dst`` in one atomic step.

    With ``replace=False`` (a destination that must be new: a conversion's output) the new directory is renamed
    onto ``dst`` with rename(2), which takes a missing or empty ``dst`` and refuses, atomically, one that holds
    anything: when another writer got there first, :class:`DestinationTaken` is raised, its output is kept
    and this write's temporary removed.

    Otherwise a missing or empty ``dst`` is replaced by one rename. An existing ``dst`` is exchanged with the new
    directory in one step (``renameat2(RENAME_EXCHANGE)``) and then removed from its temporary name; where the
    system cannot exchange, it is renamed aside first, and a kill between the two renames leaves it under
    the aside name, which the next write to ``dst`` moves back before anything else. With
    ``keep_other_files`` the files of the old ``dst`` that ``write`` did not make are carried into the new
    one (hard links where the filesystem has them). A failed ``write`` leaves ``dst`` as it was.
    """
    dst = os.path.abspath(dst)
    output_kind(dst, "directory", kind="directory")  # never through a link, nor over a file
    parent = os.path.dirname(dst)
    os.makedirs(parent, exist_ok=True)
    remove_leftovers(dst)
    tmp = temporary_name(dst, "partial")
    os.mkdir(tmp)
    try:
        write(tmp)
        old_exists = replace and os.path.isdir(dst) and bool(os.listdir(dst))
        if old_exists and keep_other_files:
            _carry_other_files(dst, tmp)
        os.chmod(tmp, os.stat(dst).st_mode & 0o7777 if old_exists else 0o777 & ~_umask())
        _fsync_tree(tmp)
        if not replace:
            _rename_onto_nothing(tmp, dst)
        elif not old_exists:
            os.rename(tmp, dst)  # also replaces an empty directory
        elif not _exchange(tmp, dst):
            aside = temporary_name(dst, "old")
            os.rename(dst, aside)
            os.rename(tmp, dst)
            tmp = aside
        _fsync(parent)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    if old_exists:
        shutil.rmtree(tmp, ignore_errors=True)  # the old version, now under the temporary name


def _rename_onto_nothing(tmp: str, dst: str) -> None:
    """Rename directory ``tmp`` to ``dst`` if ``dst`` is missing or an empty directory; the check and the rename
    are one step of the kernel's, so of two writers exactly one succeeds."""
    try:
        os.rename(tmp, dst)
    except OSError as e:
        if e.errno not in (errno.ENOTEMPTY, errno.EEXIST, errno.ENOTDIR, errno.EISDIR):
            raise
        raise DestinationTaken(errno.EEXIST, f"cannot write {dst}: another process wrote it while this one was "
                               "writing; its output was kept and nothing was replaced (write to another "
                               "directory, or remove that one and rerun)") from None


@contextlib.contextmanager
def exclusive_lock(path: str | os.PathLike, record: dict, *, what: str) -> Iterator[None]:
    """Hold an exclusive ``flock`` on the file ``path`` for the block, or raise :class:`LockHeld` at once, naming the
    holder's process id and ``record``, if another process holds it.

    The file exists while the lock is held: made on taking it, with ``record`` (and this process id and the start
    time) written in for a refused process to report (by convention its ``command`` says what the holder runs),
    and removed on release. The kernel drops the lock when the process ends however it ends, so the file a killed
    process leaves blocks nothing: the next claim takes it over. ``what`` names the locked thing in the refusal
    (``"workdir runs/x"``). A claim this process already holds passes (a script and the library function it calls
    both claiming one workdir in one thread); another thread's claim is refused as another process's is. The lock file
    must be a regular file or missing: a symbolic link there is refused, never written through."""
    path = os.path.abspath(path)
    if _held_locks.get(path) == threading.get_ident():
        yield
        return
    fd = _lock_file(path, what)
    try:
        os.ftruncate(fd, 0)
        os.write(fd, json.dumps({"pid": os.getpid(), "started": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
                                 **record}).encode())
        _held_locks[path] = threading.get_ident()
        try:
            yield
        finally:
            del _held_locks[path]
            os.remove(path)  # while still locked: a claim waiting on this file finds it gone and makes a new one
    finally:
        os.close(fd)  # releases the lock


def _lock_file(path: str, what: str) -> int:
    """A descriptor of the file at ``path`` (made if missing) holding its exclusive ``flock``: retried when the file
    was removed by its releasing holder between opening and locking it, so two claims never lock two files. A flock
    belongs to its open file, so a second open in this process (another thread) is refused as another process is."""
    while True:
        if output_kind(path, f"lock of {what}") == "in place":
            raise OSError(errno.EINVAL, f"cannot lock {what}: {path} is not a regular file (remove it)")
        try:
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o666)
        except OSError as e:
            if e.errno != errno.ELOOP:
                raise
            output_kind(path, f"lock of {what}")  # a link made since: refused, naming it
            raise
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = _holder(fd)
            os.close(fd)
            raise LockHeld(errno.EWOULDBLOCK, f"{what} is in use by {holder}; wait for it to end or choose "
                           "another") from None
        with contextlib.suppress(FileNotFoundError):
            if os.stat(path).st_ino == os.fstat(fd).st_ino:
                return fd
        os.close(fd)


def _holder(fd: int) -> str:
    """Who holds the lock on ``fd``, from what it wrote there: waits up to a second for a holder that has the lock
    but has not written yet."""
    for _ in range(20):
        try:
            record = json.loads(os.pread(fd, 1 << 16, 0))
            break
        except ValueError:
            time.sleep(0.05)
    else:
        return "another process (it has not said which yet)"
    settings = record.get("command") or ", ".join(f"{k}={v}" for k, v in record.items()
                                                   if k not in ("pid", "started"))
    return f"process {record.get('pid')} (started {record.get('started')}: {settings})"


def update_json(path: str | os.PathLike, update: Callable[[dict], None], *, empty: dict | None = None) -> None:
    """Read the JSON object at ``path`` (``empty``, or {}, if missing), let ``update`` change it in place and write it
    back (:func:`write_file`), holding an exclusive ``flock`` on its directory throughout, so that writers in other
    processes adding their entries to the same file (a ``MANIFEST.json``) take turns and none loses another's."""
    path = os.path.abspath(path)
    output_kind(path, "record")  # neither read nor written through a link
    fd = os.open(os.path.dirname(path), os.O_RDONLY)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)  # released when fd is closed
        try:
            with open(path, encoding="utf-8") as f:
                record = json.load(f)
        except FileNotFoundError:
            record = dict(empty or {})
        except (ValueError, UnicodeDecodeError, RecursionError) as e:
            raise ValueError(f"cannot update {path}: it is not valid JSON ({e}); restore it or remove it") from None
        if not isinstance(record, dict):
            raise ValueError(f"cannot update {path}: it holds a JSON {type(record).__name__}, not an object; "
                             "restore it or remove it")
        update(record)
        write_text(path, json.dumps(record, indent=1, sort_keys=True))
    finally:
        os.close(fd)


def give_default_mode(path: str) -> None:
    """Set a file's permissions to what the umask gives any new file (0644 under umask 022): writers that go
    through a private temporary of their own (safetensors) leave 0600."""
    os.chmod(path, 0o666 & ~_umask())


def temporary_name(dst: str, kind: str) -> str:
    """A fresh hidden name beside ``dst`` that :func:`remove_leftovers` recognises (``kind``: tmp or partial)."""
    directory, name = os.path.split(dst)
    return os.path.join(directory, f".{name}.{os.getpid()}-{secrets.token_hex(4)}.{kind}")


def is_leftover(name: str, of: str) -> bool:
    """Whether directory entry ``name`` is a temporary of a write to ``of`` (a name in the same directory)."""
    return any(re.fullmatch(pattern.format(name=re.escape(of)), name)
               for pattern in (_LEFTOVER, _OLD_FILE_LEFTOVER, _OLD_DIRECTORY_LEFTOVER))


def remove_leftovers(dst: str) -> None:
    """Remove the temporaries that killed writes to ``dst`` left beside it; warn about those of earlier
    versions that cannot be told from a write in progress. When a kill between the two renames of a
    directory swap left ``dst`` missing, its previous version is moved back first."""
    directory, name = os.path.split(os.path.abspath(dst))
    try:
        entries = sorted(os.listdir(directory))
    except (FileNotFoundError, NotADirectoryError):
        return
    aside = renamed_aside(dst)
    if aside is not None:
        os.rename(aside, dst)
        entries.remove(os.path.basename(aside))
    dead = []
    for entry in entries:
        path = os.path.join(directory, entry)
        match = re.fullmatch(_LEFTOVER.format(name=re.escape(name)), entry)
        if match and not any(_running(int(pid)) for pid in _SUFFIX.findall(match["chain"])):
            dead.append(path)
        match = re.fullmatch(_OLD_FILE_LEFTOVER.format(name=re.escape(name)), entry)
        if match and not _running(int(match["pid"])):
            dead.append(path)
        if re.fullmatch(_OLD_DIRECTORY_LEFTOVER.format(name=re.escape(name)), entry):
            warnings.warn(f"{path} was left by an interrupted write to {dst}; remove it once no conversion to that "
                          "path is running", RuntimeWarning, stacklevel=3)
    for path in dead:
        if os.path.isdir(path) and not os.path.islink(path):
            shutil.rmtree(path, ignore_errors=True)
        else:
            with contextlib.suppress(FileNotFoundError):
                os.remove(path)


def renamed_aside(dst: str | os.PathLike) -> str | None:
    """The previous version of directory ``dst`` when a write was killed between renaming it aside and renaming
    the new one in (only where the system cannot exchange two paths): ``dst`` is missing and that version is
    whole under its aside name until the next write moves it back."""
    directory, name = os.path.split(os.path.abspath(dst))
    if os.path.lexists(dst) or not os.path.isdir(directory):
        return None
    for entry in sorted(os.listdir(directory)):
        match = re.fullmatch(rf"\.{re.escape(name)}\.(\d+)-[0-9a-f]+\.old", entry)
        if match and not _running(int(match[1])):
            return os.path.join(directory, entry)
    return None


def check_output(path: str | os.PathLike, *, kind: str, size: int | None = None, what: str = "output") -> None:
    """Raise OSError now if the ``kind`` ("file" or "directory") at ``path`` could not be written later: what
    :func:`output_kind` refuses (a directory where a file goes, a file where a directory goes, a symbolic link),
    an ancestor that is a file, a directory that refuses a new file (read-only, or no permission), or, given
    ``size`` in bytes, too little free space. Tried by creating and removing a file in the nearest existing
    directory, which is what the write will do (a permission check alone passes everything for root). Creates
    nothing that stays. A device or FIFO, written in place, passes."""
    path = os.path.abspath(path)
    if output_kind(path, what, kind=kind) == "in place":
        return
    directory = path if kind == "directory" and os.path.isdir(path) else os.path.dirname(path)
    while not os.path.lexists(directory):
        directory = os.path.dirname(directory)
    if not os.path.isdir(directory):
        raise NotADirectoryError(errno.ENOTDIR, f"cannot write the {what} {path}: {directory} is a file, not a "
                                 "directory")
    probe = temporary_name(os.path.join(directory, "probe"), "tmp")
    try:
        os.close(os.open(probe, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o600))
        os.remove(probe)
    except OSError as e:
        raise OSError(e.errno, f"cannot write the {what} {path}: {directory} does not accept new files "
                      f"({e.strerror})") from None
    if size is not None:
        free = shutil.disk_usage(directory).free
        if free < size:
            raise OSError(errno.ENOSPC, f"cannot write the {what} {path}: it needs {size / 2**20:.1f} MiB and "
                          f"{directory} has {free / 2**20:.1f} MiB free")


def _running(pid: int) -> bool:
    if pid == os.getpid():
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process
        return True
    return True


def _carry_other_files(old: str, new: str) -> None:
    """Link or copy into ``new`` what ``old`` holds beside the files ``new`` already has, except temporaries
    of earlier in-place writes of those files."""
    written = os.listdir(new)
    for entry in sorted(os.listdir(old)):
        src, dst = os.path.join(old, entry), os.path.join(new, entry)
        if os.path.lexists(dst) or any(is_leftover(entry, of) for of in written):
            continue
        if os.path.islink(src):
            os.symlink(os.readlink(src), dst)
        elif os.path.isdir(src):
            shutil.copytree(src, dst, symlinks=True, copy_function=_link_or_copy)
        else:
            _link_or_copy(src, dst)


def _link_or_copy(src: str, dst: str) -> None:
    try:
        os.link(src, dst)
    except OSError:
        shutil.copy2(src, dst)


def _exchange(a: str, b: str) -> bool:
    """Swap the paths ``a`` and ``b`` in one atomic step; False where the system or filesystem cannot."""
    renameat2 = getattr(_libc(), "renameat2", None)
    if renameat2 is None:
        return False
    renameat2.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint]
    at_cwd = -100  # AT_FDCWD: the paths are absolute
    if renameat2(at_cwd, os.fsencode(a), at_cwd, os.fsencode(b), _RENAME_EXCHANGE) == 0:
        return True
    code = ctypes.get_errno()
    if code in (errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP, errno.ENOTSUP):
        return False
    raise OSError(code, os.strerror(code), a, None, b)


def _libc():
    try:
        return ctypes.CDLL(None, use_errno=True)
    except OSError:
        return None


def _fsync(path: str) -> None:
    """Flush ``path`` (a file, or a directory's entries) to disk; a no-op where directories cannot be opened."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except (IsADirectoryError, PermissionError):
        return
    try:
        os.fsync(fd)
    except OSError as e:
        if e.errno != errno.EINVAL:  # some filesystems cannot flush a directory
            raise
    finally:
        os.close(fd)


def _fsync_tree(root: str) -> None:
    for directory, _, names in os.walk(root):
        for name in names:
            path = os.path.join(directory, name)
            if not os.path.islink(path):
                _fsync(path)
        _fsync(directory)


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask
