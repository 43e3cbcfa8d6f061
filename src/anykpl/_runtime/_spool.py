"""The durable spool: admitted records on disk until they are terminal (``spool_dir``).

Picture (docs/spool.md has the whole of it)::

    submit ──► Intake.enqueue ──► Spool.append ──► active segment (mmap'd file)
                                                    │  one entry per record
    Retrier ──► Intake.finish ──► segment.live -= 1 ┘  live == 0: unlinked (sealed) or
                                                       rewound (active)

A spool directory holds a lock file and segment files ``<sequence>.seg``. A segment is a file
of fixed size, allocated on disk when it is created (``posix_fallocate``: a full disk is an
error then, never a ``SIGBUS`` later) and mapped into memory. Appending a record is two
memory copies into the mapping: no system call per record. The kernel owns the mapped pages,
so an entry is in the page cache the moment it is copied, and survives ``kill -9`` of the
process; it survives power loss once the file is synced, which ``spool_fsync`` decides
(``"off"``, ``"commit"``: every submit waits for a sync shared by every record appended
meanwhile, ``"interval"``: a sync every ``spool_fsync_interval`` seconds).

The file format (entries, checksums, what ends a log) is the core's:
``_core/_spool_format.py``.

Recovery (:meth:`Spool.open`) reads the segments left by a previous process, oldest first,
and hands their records back; those segments stay on disk, read-only, until every record read
from them is terminal, then they are unlinked. New records always go to new segments.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import mmap
import os
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Final

import anyio

from .. import errors
from .._core._spool_format import (
    END_MARK,
    ENTRY_HEADER,
    ENTRY_HEADER_SIZE,
    ENTRY_MAGIC,
    ENTRY_OVERHEAD,
    FILE_HEADER_SIZE,
    VERSION,
    RecoveredEntry,
    encode_prefix,
    generation_seed,
    pack_file_header,
    parse_segment,
    round_up,
    segment_bytes_for,
)
from ..config import SpoolFsync

if TYPE_CHECKING:
    from .._core._records import Record

__all__ = ("RecoveredSegment", "Segment", "Spool", "SpoolStatistics", "SpoolSyncer")

logger = logging.getLogger("anykpl.spool")
#: A segment's data to disk: ``fdatasync`` where the platform has it, ``fsync`` (which also
#: syncs the file's metadata) where not (macOS's Python has no ``os.fdatasync``).
_fdatasync = getattr(os, "fdatasync", os.fsync)

#: Prefixes (stream, key, hash key, tenant → encoded) remembered, cleared when full.
_PREFIX_CACHE_LIMIT: Final = 65536
LOCK_NAME: Final = "LOCK"
_SUFFIX: Final = ".seg"


@dataclass(frozen=True, slots=True)
class SpoolStatistics:
    """The spool's state and counters (``ProducerStatistics.spool``).

    Attributes:
        directory: the spool directory.
        bytes: bytes of segment files on disk now (allocated whole when created).
        segments: segment files on disk now (recovered ones included).
        records: records in the spool that are not yet terminal.
        appended: records appended since the producer opened.
        syncs: file syncs done (``spool_fsync``).
        recovered: records read back from a previous process's segments.
        recovered_pending: those not yet terminal.
        recovered_delivered: those delivered.
        recovered_failed: those that failed (their handles hold the errors).
        corrupt_entries: torn or corrupt entries skipped by recovery (never replayed).
    """

    directory: str
    bytes: int
    segments: int
    records: int
    appended: int
    syncs: int
    recovered: int
    recovered_pending: int
    recovered_delivered: int
    recovered_failed: int
    corrupt_entries: int


class Segment:
    """One segment file: being appended to (``mm`` set), sealed, or recovered (read-only)."""

    __slots__ = (
        "fd",
        "generation",
        "live",
        "mm",
        "path",
        "pos",
        "recovered",
        "seed",
        "sequence",
        "size",
    )

    def __init__(self, sequence: int, path: Path, size: int) -> None:
        self.sequence = sequence
        self.path = path
        self.size = size
        self.fd = -1
        self.mm: mmap.mmap | None = None
        self.pos = FILE_HEADER_SIZE
        self.generation = 0
        self.seed = 0  # CRC-32 of the generation: where every entry's CRC starts
        self.live = 0  # records appended (or recovered) here that are not yet terminal
        self.recovered = False

    def set_generation(self, generation: int) -> None:
        self.generation = generation
        self.seed = generation_seed(generation)


@dataclass(frozen=True, slots=True)
class RecoveredSegment:
    """A previous process's segment and the records read from it."""

    segment: Segment
    entries: tuple[RecoveredEntry, ...]
    corrupt: int


class Spool:
    """The spool of one producer: the lock, the segments, appending, releasing, recovery."""

    def __init__(
        self,
        directory: str | os.PathLike[str],
        max_bytes: int,
        fsync: SpoolFsync = "off",
    ) -> None:
        self.directory = Path(directory)
        self.max_bytes = max_bytes
        self.fsync = fsync
        self.segment_bytes = segment_bytes_for(max_bytes)
        self.active: Segment | None = None
        self.segments: dict[int, Segment] = {}  # every segment on disk, by sequence
        self.bytes = 0  # their sizes
        self.records = 0  # records in them not yet terminal
        self.appended = 0
        self.syncs = 0
        self.recovered = 0
        self.recovered_delivered = 0
        self.recovered_failed = 0
        self.corrupt_entries = 0
        self._next_sequence = 1
        self._lock_fd = -1
        self._prefixes: dict[tuple[str, str, str | None, str | None], bytes] = {}
        # segments whose mapping must outlive a sync running in a worker thread
        self._syncing = False
        self._unmap_after_sync: list[Segment] = []
        self._dirty: set[Segment] = set()  # appended to since the last sync
        self._created_since_sync = False

    # -- opening and closing ----------------------------------------------------------------

    def open(self) -> list[RecoveredSegment]:
        """Take the directory (creating it if need be), and read back what a previous process
        left: its segments, oldest first, with their records.

        :raises ~anykpl.errors.SpoolError: the directory cannot be used (not writable, not a
            directory) or another process owns it.
        """
        try:
            self.directory.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise errors.SpoolError(
                f"spool_dir {str(self.directory)!r} cannot be created: {exc.strerror or exc}"
            ) from exc
        self._lock()
        try:
            recovered = self._recover()
        except BaseException:
            self.close()
            raise
        return recovered

    def _lock(self) -> None:
        import fcntl

        path = self.directory / LOCK_NAME
        try:
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
        except OSError as exc:
            raise errors.SpoolError(
                f"spool_dir {str(self.directory)!r} is not usable: cannot open its lock file: "
                f"{exc.strerror or exc}"
            ) from exc
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as exc:
            owner = _read_owner(fd)
            os.close(fd)
            if exc.errno in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
                whom = f"process {owner}" if owner else "another producer"
                raise errors.SpoolLockedError(
                    f"spool_dir {str(self.directory)!r} is in use by {whom}: one producer "
                    "at a time owns a spool directory (give each producer its own)"
                ) from None
            raise errors.SpoolError(
                f"spool_dir {str(self.directory)!r}: cannot lock it: {exc.strerror or exc}"
            ) from exc
        previous = _read_owner(fd)
        if previous and previous != str(os.getpid()):
            logger.info(
                "spool %s: taking over from process %s, which is gone",
                self.directory,
                previous,
                extra={"spool_dir": str(self.directory), "previous_owner": previous},
            )
        try:
            os.ftruncate(fd, 0)
            os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
            # a probe that the directory itself takes new files (the lock file may be old)
            probe = self.directory / f".probe-{os.getpid()}"
            os.close(os.open(probe, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o600))
            os.unlink(probe)
        except OSError as exc:
            os.close(fd)
            raise errors.SpoolError(
                f"spool_dir {str(self.directory)!r} is not writable: {exc.strerror or exc}"
            ) from exc
        self._lock_fd = fd

    def close(self) -> None:
        """Unmap and close every segment and give the directory up. Segments with records
        not yet terminal stay on disk (a crash, or records failed at close still spooled...
        see :meth:`release`); an empty active segment is removed."""
        for segment in list(self.segments.values()):
            if segment.live == 0:
                self._drop(segment)
            else:
                self._unmap(segment)
        self.active = None
        if self._lock_fd >= 0:
            with contextlib.suppress(OSError):  # the lock goes with the descriptor anyway
                os.ftruncate(self._lock_fd, 0)
            os.close(self._lock_fd)
            self._lock_fd = -1

    # -- appending (the hot path) -----------------------------------------------------------

    def has_room(self, size: int) -> bool:
        """Whether a record of ``size`` bytes (data + partition key) fits under
        ``spool_max_bytes`` now."""
        active = self.active
        need = size + ENTRY_OVERHEAD
        if active is not None and active.pos + need <= active.size:
            return True
        grown = max(self.segment_bytes, round_up(FILE_HEADER_SIZE + need))
        used = self.bytes
        if active is not None and active.live == 0:
            used -= active.size  # an empty active segment makes way for the new one
        return used + grown <= self.max_bytes

    def append(self, record: Record) -> None:
        """Write ``record`` into the active segment (a new one if it is full).

        :raises ~anykpl.errors.SpoolError: a new segment could not be created (a full disk).
        """
        key = (record.stream, record.partition_key, record.explicit_hash_key, record.tenant)
        prefix = self._prefixes.get(key)
        if prefix is None:
            prefix = encode_prefix(*key)
            if len(self._prefixes) >= _PREFIX_CACHE_LIMIT:
                self._prefixes.clear()
            self._prefixes[key] = prefix
        data = record.data
        body = len(prefix) + len(data)
        end_of_entry = ENTRY_HEADER_SIZE + body
        segment = self.active
        if segment is None or segment.pos + end_of_entry > segment.size:
            segment = self._new_segment(end_of_entry)
        mm = segment.mm
        assert mm is not None
        pos = segment.pos
        crc = zlib.crc32(data, zlib.crc32(prefix, segment.seed))
        start = pos + ENTRY_HEADER_SIZE
        mm[start : start + len(prefix)] = prefix
        mm[start + len(prefix) : pos + end_of_entry] = data
        end = pos + end_of_entry
        if segment.generation > 1 and end + ENTRY_HEADER_SIZE <= segment.size:
            # the segment started over: mark the end, where an older entry may be cut in two
            mm[end : end + ENTRY_HEADER_SIZE] = END_MARK
        ENTRY_HEADER.pack_into(mm, pos, ENTRY_MAGIC, VERSION, 0, segment.generation, body, crc)
        segment.pos = end
        segment.live += 1
        self.records += 1
        self.appended += 1
        record.spool_segment = segment
        if self.fsync != "off":
            self._dirty.add(segment)

    def _new_segment(self, entry_size: int) -> Segment:
        old = self.active
        if old is not None:
            self.active = None
            if old.live == 0:
                self._drop(old)
            else:
                self._seal(old)
        size = max(self.segment_bytes, round_up(FILE_HEADER_SIZE + entry_size))
        sequence = self._next_sequence
        self._next_sequence += 1
        path = self.directory / f"{sequence:016d}{_SUFFIX}"
        segment = Segment(sequence, path, size)
        try:
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
        except OSError as exc:
            raise _write_error(self.directory, "cannot create a segment", exc) from exc
        try:
            _allocate(fd, size)
            mm = mmap.mmap(fd, size)
        except OSError as exc:
            os.close(fd)
            _unlink_quietly(path)
            what = f"cannot allocate a segment of {size} bytes"
            raise _write_error(self.directory, what, exc) from exc
        segment.fd = fd
        segment.mm = mm
        segment.set_generation(1)
        pack_file_header(mm, 1, sequence)
        self.segments[sequence] = segment
        self.bytes += size
        self.active = segment
        self._created_since_sync = True
        return segment

    def _seal(self, segment: Segment) -> None:
        """A full segment takes no more entries; it goes once its records are terminal."""
        if self.fsync == "off":
            self._unmap(segment)  # nothing to sync later: the mapping is not needed any more

    # -- releasing (the way back) -----------------------------------------------------------

    def release(self, segment: Segment) -> None:
        """Every record of ``segment`` is terminal: remove it, or start the active segment
        over (a new generation: what it holds is stale from now on)."""
        if segment is self.active:
            mm = segment.mm
            assert mm is not None
            generation = segment.generation + 1
            segment.set_generation(generation)
            pack_file_header(mm, generation, segment.sequence)
            mm[FILE_HEADER_SIZE : FILE_HEADER_SIZE + ENTRY_HEADER_SIZE] = END_MARK
            segment.pos = FILE_HEADER_SIZE
            return
        self._drop(segment)

    def finished(self, segment: Segment, success: bool) -> None:
        """A record held in ``segment`` is terminal (``Intake.finish``; and a recovered record
        that can no longer be sent, as a failure)."""
        self.records -= 1
        if segment.recovered:
            if success:
                self.recovered_delivered += 1
            else:
                self.recovered_failed += 1
            self._recovered_finished()
        segment.live -= 1
        if segment.live == 0:
            self.release(segment)

    def _recovered_finished(self) -> None:
        if self.recovered_delivered + self.recovered_failed == self.recovered:
            logger.info(
                "spool %s: every recovered record is terminal: %d delivered, %d failed",
                self.directory,
                self.recovered_delivered,
                self.recovered_failed,
                extra={
                    "spool_dir": str(self.directory),
                    "delivered": self.recovered_delivered,
                    "failed": self.recovered_failed,
                },
            )

    def _drop(self, segment: Segment) -> None:
        if self.segments.pop(segment.sequence, None) is None:
            return
        self.bytes -= segment.size
        self._dirty.discard(segment)
        _unlink_quietly(segment.path)
        self._unmap(segment)

    def _unmap(self, segment: Segment) -> None:
        if self._syncing and (segment.mm is not None or segment.fd >= 0):
            self._unmap_after_sync.append(segment)  # a worker thread may be syncing it
            return
        if segment.mm is not None:
            segment.mm.close()
            segment.mm = None
        if segment.fd >= 0:
            os.close(segment.fd)
            segment.fd = -1

    # -- syncing (spool_fsync) --------------------------------------------------------------

    def sync_targets(self) -> tuple[list[int], bool]:
        """Begin a sync: the descriptors to sync, and whether the directory needs one too
        (a segment was created). Until :meth:`end_sync`, no segment is closed."""
        fds = [s.fd for s in self._dirty if s.fd >= 0]
        self._dirty.clear()
        directory = self._created_since_sync
        self._created_since_sync = False
        self._syncing = True
        return fds, directory

    def sync_files(self, fds: list[int], directory: bool) -> None:
        """Sync the segments' data to disk (run in a worker thread: it blocks)."""
        for fd in fds:
            _fdatasync(fd)
        if directory:
            dir_fd = os.open(self.directory, os.O_RDONLY | os.O_CLOEXEC)
            try:
                os.fsync(dir_fd)
            finally:
                os.close(dir_fd)

    def end_sync(self) -> None:
        self._syncing = False
        self.syncs += 1
        waiting, self._unmap_after_sync = self._unmap_after_sync, []
        for segment in waiting:
            self._unmap(segment)

    # -- recovery ---------------------------------------------------------------------------

    def _recover(self) -> list[RecoveredSegment]:
        found: list[tuple[int, Path]] = []
        for path in self.directory.iterdir():
            name = path.name
            if name.endswith(_SUFFIX) and name[: -len(_SUFFIX)].isdigit():
                found.append((int(name[: -len(_SUFFIX)]), path))
            elif name.startswith(".probe-"):
                _unlink_quietly(path)
        found.sort()
        if found:
            self._next_sequence = found[-1][0] + 1
        recovered: list[RecoveredSegment] = []
        for sequence, path in found:
            read = self._read_segment(sequence, path)
            if read is not None:
                recovered.append(read)
        return recovered

    def _read_segment(self, sequence: int, path: Path) -> RecoveredSegment | None:
        try:
            content = path.read_bytes()
        except OSError as exc:
            raise errors.SpoolError(
                f"spool_dir {str(self.directory)!r}: cannot read {path.name}: {exc.strerror or exc}"
            ) from exc
        entries, corrupt, valid_end = parse_segment(content)
        if content and valid_end == 0:
            # not a segment we can read (a damaged header, another version): set aside, never
            # deleted, and never replayed
            aside = path.with_name(path.name + ".unreadable")
            os.replace(path, aside)
            self.corrupt_entries += 1
            logger.error(
                "spool %s: %s is not a readable segment (damaged header or another format "
                "version); set aside as %s, its records are not sent",
                self.directory,
                path.name,
                aside.name,
                extra={"spool_dir": str(self.directory), "segment": path.name},
            )
            return None
        if corrupt:
            self.corrupt_entries += corrupt
            logger.warning(
                "spool %s: %s holds %d torn or corrupt entr%s; skipped (never replayed)",
                self.directory,
                path.name,
                corrupt,
                "y" if corrupt == 1 else "ies",
                extra={"spool_dir": str(self.directory), "segment": path.name},
            )
        size = len(content)
        if corrupt and entries and valid_end < size:
            # the torn tail goes (recovered segments are only read from now on)
            _truncate_quietly(path, valid_end)
            size = valid_end
        if not entries:
            _unlink_quietly(path)
            return None
        segment = Segment(sequence, path, size)
        segment.recovered = True
        segment.live = len(entries)
        self.segments[sequence] = segment
        self.bytes += size
        self.records += len(entries)
        self.recovered += len(entries)
        return RecoveredSegment(segment, tuple(entries), corrupt)

    def statistics(self) -> SpoolStatistics:
        return SpoolStatistics(
            directory=str(self.directory),
            bytes=self.bytes,
            segments=len(self.segments),
            records=self.records,
            appended=self.appended,
            syncs=self.syncs,
            recovered=self.recovered,
            recovered_pending=self.recovered - self.recovered_delivered - self.recovered_failed,
            recovered_delivered=self.recovered_delivered,
            recovered_failed=self.recovered_failed,
            corrupt_entries=self.corrupt_entries,
        )


def _allocate(fd: int, size: int) -> None:
    """Reserve ``size`` bytes of disk for the file now (so that writing through the mapping
    can never meet a full disk)."""
    if hasattr(os, "posix_fallocate"):
        try:
            os.posix_fallocate(fd, 0, size)
            return
        except OSError as exc:
            if exc.errno not in (errno.EOPNOTSUPP, errno.EINVAL):
                raise
    os.ftruncate(fd, size)  # pragma: no cover - no posix_fallocate: write the zeros
    chunk = b"\0" * 65536  # pragma: no cover
    for offset in range(0, size, len(chunk)):  # pragma: no cover
        os.pwrite(fd, chunk[: size - offset], offset)


def _write_error(directory: Path, what: str, exc: OSError) -> errors.SpoolError:
    reason = exc.strerror or str(exc)
    if exc.errno in (errno.ENOSPC, errno.EDQUOT, errno.EFBIG):
        reason = f"{reason} (the disk or the file size limit is full)"
    return errors.SpoolError(
        f"spool_dir {str(directory)!r}: {what}: {reason}; the record was not admitted"
    )


def _read_owner(fd: int) -> str:
    try:
        return os.pread(fd, 32, 0).decode("ascii", "replace").strip()
    except OSError:  # pragma: no cover
        return ""


def _unlink_quietly(path: Path) -> None:
    try:
        path.unlink()
    except FileNotFoundError:
        pass
    except OSError as exc:  # pragma: no cover - logged, never raised on the way back
        logger.warning("spool: cannot remove %s: %s", path, exc)


def _truncate_quietly(path: Path, size: int) -> None:
    try:
        os.truncate(path, size)
    except OSError as exc:  # pragma: no cover
        logger.warning("spool: cannot truncate %s: %s", path, exc)


class SpoolSyncer:
    """Syncs the spool's files for ``spool_fsync="commit"`` (group commit: every submit waits
    for a sync that began after its append, and one sync serves every record appended before
    it began) and ``"interval"``. One task (:meth:`run`) does the syncing, in a worker thread."""

    def __init__(self, spool: Spool, interval: float) -> None:
        self.spool = spool
        self.interval = interval
        self.synced = 0  # ``spool.appended`` as of the start of the last sync that finished
        self._kick = anyio.Event()
        self._done: anyio.Event | None = None
        self.stopped = False  # run() ended: nobody syncs any more, and nobody waits

    async def wait(self) -> None:
        """Return once every record appended so far is synced (shielded: the records are
        admitted already, and a sync takes milliseconds)."""
        target = self.spool.appended
        if self.synced >= target:
            return
        with anyio.CancelScope(shield=True):
            while self.synced < target and not self.stopped:
                done = self._done
                if done is None:
                    done = self._done = anyio.Event()
                self._kick.set()
                await done.wait()

    async def run(self) -> None:
        commit = self.spool.fsync == "commit"
        try:
            while True:
                if commit:
                    await self._kick.wait()
                    self._kick = anyio.Event()
                else:
                    await anyio.sleep(self.interval)
                await self.sync()
        finally:
            # the producer is closing: waiters stop waiting (their records are admitted)
            self.stopped = True
            done, self._done = self._done, None
            if done is not None:
                done.set()

    async def sync(self) -> None:
        spool = self.spool
        target = spool.appended
        fds, directory = spool.sync_targets()
        try:
            await anyio.to_thread.run_sync(spool.sync_files, fds, directory)
        except OSError as exc:
            # The records are admitted and go on; only their power-loss safety is in doubt.
            logger.error(
                "spool %s: syncing to disk failed: %s",
                spool.directory,
                exc,
                extra={"spool_dir": str(spool.directory)},
            )
        finally:
            spool.end_sync()
            self.synced = target
            done, self._done = self._done, None
            if done is not None:
                done.set()
