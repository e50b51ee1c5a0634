"""Training text as bytes, read in place: the user's files (``data.paths``) or, by default, the
running interpreter's own standard-library sources (present wherever Python is).

The files are put in a machine-independent order and read as one stream of bytes, capped at
``data.max_bytes`` (0: all of it). The last ``data.eval_fraction`` of the stream is held out
for evaluation (one cut, so no text is in both parts, and one file is enough); the training
bytes are cut into ``data.shards`` contiguous shards, each read as a seeded permutation of
fixed-length windows; the coordinator's data ledger says which windows each site trains on in
each round. Nothing holds the text: windows are read from the files when a round needs them, so
shard sizes (all the coordinator asks for) cost a ``stat`` and an 8 KiB sniff per file.
"""

from __future__ import annotations

import bisect
import hashlib
import itertools
import logging
import math
import os
import sysconfig
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import NoReturn

import torch

log = logging.getLogger(__name__)

SNIFF_BYTES = 8192  # a NUL byte in a file's first 8 KiB marks it binary (git's rule)
GZIP_MAGIC = b"\x1f\x8b"
WINDOWS_PER_SHARD = 1  # the least a shard may hold (the ledger's unit is one window)


def _refuse(message: str) -> NoReturn:
    """Raise the config error the CLI prints as one line (imported here: config imports this package)."""
    from geodiloco.config import ConfigError

    raise ConfigError(message)


def stdlib_sources() -> list[Path]:
    """The interpreter's standard-library ``.py`` files, excluding installed packages."""
    # os.walk, pruned at site-packages: Path.rglob walked the installed packages too, then
    # dropped them (0.5 s in every process that builds the default data, each rank included)
    root = Path(sysconfig.get_paths()["stdlib"])
    found = []
    for folder, dirs, files in os.walk(root):
        dirs[:] = [d for d in dirs if d != "site-packages"]
        found += [Path(folder, f) for f in files if f.endswith(".py")]
    return [p for p in found if "site-packages" not in p.parts and p.is_file()]


def _candidates(paths: list[str]) -> list[tuple[str, int, Path]]:
    """(machine-independent name, entry index, path) of every file ``paths`` names.

    A folder contributes the files below it, named relative to it, except hidden ones (a name
    starting with "."); so the order depends on the layout under each entry, not on where the
    entries are mounted.
    """
    if not paths:
        root = Path(sysconfig.get_paths()["stdlib"])
        return [(str(p.relative_to(root)), 0, p) for p in stdlib_sources()]
    found: list[tuple[str, int, Path]] = []
    for index, raw in enumerate(paths):
        entry = Path(raw)
        if entry.is_dir():
            for p in entry.rglob("*"):
                rel = p.relative_to(entry)
                if p.is_file() and not any(part.startswith(".") for part in rel.parts):
                    found.append((rel.as_posix(), index, p))
        elif entry.is_file():
            found.append((entry.name, index, entry))
        else:
            _refuse(f"data.paths: {raw} does not exist")
    return found


@dataclass(frozen=True, slots=True)
class TextFile:
    path: Path
    size: int  # bytes of it in the stream (the last file may be cut by data.max_bytes)


class TextStream:
    """Files read as one stream of bytes by position, without holding them: each read is a pread."""

    def __init__(self, files: list[TextFile]) -> None:
        self.files = files
        self.ends = list(itertools.accumulate(f.size for f in files))
        self.size = self.ends[-1] if files else 0

    def windows(self, starts: Sequence[int], length: int) -> torch.Tensor:
        """``[len(starts), length]`` uint8: the bytes from each start. Read in order of position,
        so that each file is opened about once per call."""
        if not starts:
            return torch.empty(0, length, dtype=torch.uint8)
        out = bytearray(len(starts) * length)
        view = memoryview(out)
        reader = _Reader(self)
        try:
            for row in sorted(range(len(starts)), key=lambda r: starts[r]):
                reader.read_into(view[row * length : (row + 1) * length], starts[row])
        finally:
            reader.close()
        return torch.frombuffer(out, dtype=torch.uint8).view(len(starts), length)


@dataclass(slots=True)
class _Reader:
    """Reads of one :meth:`TextStream.windows` call; keeps the file it read last open."""

    stream: TextStream
    index: int = -1
    fd: int = -1

    def read_into(self, dest: memoryview, position: int) -> None:
        stream = self.stream
        done = 0
        while done < len(dest):
            i = bisect.bisect_right(stream.ends, position)
            f = stream.files[i]
            offset = position - (stream.ends[i] - f.size)
            n = min(len(dest) - done, f.size - offset)
            try:
                data = os.pread(self._fd(i), n, offset)
            except OSError as exc:  # moved, deleted or unreadable since the run started
                _refuse(f"data.paths: cannot read {f.path} any more: {exc.strerror or exc}")
            if len(data) != n:
                _refuse(f"data.paths: {f.path} changed while the run was reading it (now shorter)")
            dest[done : done + n] = data
            done += n
            position += n

    def _fd(self, i: int) -> int:
        if i != self.index:
            self.close()
            self.index, self.fd = i, os.open(self.stream.files[i].path, os.O_RDONLY)
        return self.fd

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
        self.index, self.fd = -1, -1


@dataclass(frozen=True, slots=True)
class Corpus:
    """The stream and its one cut: ``[0, train_bytes)`` trains, ``[train_bytes, size)`` is held out."""

    text: TextStream
    train_bytes: int
    eval_fraction: float
    capped_at: int = 0  # data.max_bytes, where it cut the text short
    skipped_binary: int = 0

    @property
    def eval_bytes(self) -> int:
        return self.text.size - self.train_bytes

    @property
    def files(self) -> int:
        return len(self.text.files)


def _sniff(path: Path) -> tuple[int, bytes]:
    """Size and first bytes of ``path``; refuses, naming it, one that cannot be read or is gzip."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError as exc:
        _refuse(f"data.paths: cannot read {path}: {exc.strerror or exc}")
    try:
        size, head = os.fstat(fd).st_size, os.pread(fd, SNIFF_BYTES, 0)
    except OSError as exc:
        _refuse(f"data.paths: cannot read {path}: {exc.strerror or exc}")
    finally:
        os.close(fd)
    if path.suffix == ".gz" or head.startswith(GZIP_MAGIC):
        _refuse(
            f"data.paths: {path} is gzip-compressed, which is not supported (text is read in place, "
            f"by position); decompress it first (gunzip -k {path})"
        )
    return size, head


def held_out_bytes(total: int, eval_fraction: float) -> int:
    """Bytes at the end of a ``total``-byte stream held out for evaluation."""
    return math.ceil(total * eval_fraction)


def load_corpus(paths: list[str], max_bytes: int, eval_fraction: float) -> Corpus:
    """The files in a machine-independent order (a hash of each one's name, then its entry in
    ``paths``) as one stream capped at ``max_bytes`` (0: no cap), with its evaluation cut.

    Binary files (a NUL byte in the first 8 KiB) are skipped and counted in the log; a file that
    cannot be read, or is gzip-compressed, is refused by name.
    """
    candidates = _candidates(paths)
    candidates.sort(key=lambda c: (hashlib.sha1(c[0].encode()).hexdigest(), c[1]))
    files: list[TextFile] = []
    seen: set[Path] = set()
    binary: list[Path] = []
    total = 0
    capped = False
    for _, _, path in candidates:
        if max_bytes and total >= max_bytes:
            capped = True
            break
        real = path.resolve()
        if real in seen:
            continue
        seen.add(real)
        size, head = _sniff(path)
        if b"\0" in head:
            binary.append(path)
            continue
        take = min(size, max_bytes - total) if max_bytes else size
        capped = capped or take < size
        if take > 0:
            files.append(TextFile(path, take))
            total += take
    if binary:
        log.warning(
            "data: skipped %d binary file(s) (a NUL byte in the first %d bytes), e.g. %s",
            len(binary),
            SNIFF_BYTES,
            ", ".join(str(p) for p in binary[:3]),
        )
    if not files:
        where = ", ".join(paths) if paths else "the standard library"
        _refuse(f"data.paths: no text in {where} ({len(binary)} binary file(s) skipped)")
    text = TextStream(files)
    train = text.size - held_out_bytes(text.size, eval_fraction)
    log.info(
        "data: %d bytes of text in %d file(s)%s; the last %d held out for evaluation",
        text.size,
        len(files),
        f" (data.max_bytes={max_bytes} cut it short; 0: all of it)" if capped else "",
        text.size - train,
    )
    return Corpus(text, train, eval_fraction, max_bytes if capped else 0, len(binary))


def _least(ok: Callable[[int], bool]) -> int:
    """The least n >= 0 with ``ok(n)``, for a predicate that stays true once true."""
    hi = 1
    while not ok(hi):
        hi *= 2
    lo = 0
    while lo < hi:
        mid = (lo + hi) // 2
        lo, hi = (lo, mid) if ok(mid) else (mid + 1, hi)
    return lo


def require_text(corpus: Corpus, *, shards: int, seq_len: int, eval_sequences: int) -> None:
    """Refuse, with the numbers and the fields, text too short for the run: every shard needs
    ``WINDOWS_PER_SHARD`` windows of ``seq_len + 1`` bytes, and the held-out part room for
    ``eval_sequences`` windows at distinct positions (``seq_len + eval_sequences`` bytes)."""
    f = corpus.eval_fraction

    def enough(n: int) -> bool:
        e = held_out_bytes(n, f)
        return n - e >= shards * WINDOWS_PER_SHARD * (seq_len + 1) and e >= seq_len + eval_sequences

    if enough(corpus.text.size):
        return
    n, m = corpus.text.size, corpus.files
    _refuse(
        f"data: {n} bytes of text in {m} file{'s' * (m != 1)}; need at least {_least(enough)} bytes for "
        f"{shards} shards of {WINDOWS_PER_SHARD} window{'s' * (WINDOWS_PER_SHARD != 1)} plus "
        f"{eval_sequences} evaluation windows (data.shards, data.eval_sequences, model.seq_len); "
        f"a window is {seq_len + 1} bytes and the last {f * 100:g}% of the text is held out "
        "(data.eval_fraction)"
        + (f"; data.max_bytes={corpus.capped_at} cut it short (0: all of it)" if corpus.capped_at else "")
    )


@dataclass(frozen=True, slots=True)
class DataRange:
    """Windows ``[start, end)`` of shard ``shard`` in pass ``epoch`` over that shard."""

    shard: int
    start: int
    end: int
    epoch: int = 0

    @property
    def windows(self) -> int:
        return self.end - self.start


def split_windows(ranges: Sequence[DataRange], count: int) -> tuple[list[DataRange], list[DataRange]]:
    """The first ``count`` windows of ``ranges`` (in order, as the steps of a round read them)
    and the rest: a round by time trains a prefix of what the ledger reserved."""
    head: list[DataRange] = []
    tail: list[DataRange] = []
    for r in ranges:
        take = max(0, min(count, r.windows))
        count -= take
        if take:
            head.append(DataRange(r.shard, r.start, r.start + take, r.epoch))
        if take < r.windows:
            tail.append(DataRange(r.shard, r.start + take, r.end, r.epoch))
    return head, tail


class DataShards:
    """The training bytes cut into ``count`` contiguous shards of fixed-length windows.

    Each shard is read in its own seeded order; the data ledger hands out ranges of positions
    in that order, so "windows 40-80 of shard 3" names the same text on every machine. The
    orders are drawn when a shard is first read, so the coordinator (which only asks for the
    sizes) never draws them, and a rank draws those of the shards it reads.
    """

    def __init__(self, corpus: Corpus, *, count: int, seq_len: int, seed: int) -> None:
        n = corpus.train_bytes
        self.text = corpus.text
        self.seq_len = seq_len
        self.seed = seed
        self.starts = [n * i // count for i in range(count)]
        self.sizes = [max(0, (n * (i + 1) // count - self.starts[i] - 1) // seq_len) for i in range(count)]
        if min(self.sizes) < WINDOWS_PER_SHARD:
            _refuse(
                f"data: {n} training bytes cut into {count} shards leave a shard shorter than one "
                f"window of {seq_len + 1} bytes (data.shards, model.seq_len)"
            )
        self._orders: dict[int, torch.Tensor] = {}

    def order(self, shard: int) -> torch.Tensor:
        """The seeded permutation in which ``shard``'s windows are read."""
        if shard not in self._orders:
            generator = torch.Generator().manual_seed(self.seed * 1_000_003 + shard)
            self._orders[shard] = torch.randperm(self.sizes[shard], generator=generator)
        return self._orders[shard]

    def windows(self, ranges: Iterable[DataRange]) -> torch.Tensor:
        """The windows (seq_len + 1 bytes each) that ``ranges`` name, in order."""
        starts = [
            self.starts[r.shard] + int(k) * self.seq_len
            for r in ranges
            for k in self.order(r.shard)[r.start : r.end]
        ]
        return self.text.windows(starts, self.seq_len + 1).long()


def rank_batch(
    windows: torch.Tensor, step: int, rank: int, world: int, batch_size: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Inputs and targets for ``rank`` at ``step`` of a round whose windows are ``windows``."""
    first = (step * world + rank) * batch_size
    batch = windows[first : first + batch_size]
    return batch[:, :-1], batch[:, 1:]


def eval_windows(corpus: Corpus, count: int, seq_len: int) -> torch.Tensor:
    """A fixed set of evaluation windows spread evenly over the held-out text."""
    room = corpus.eval_bytes - seq_len - 1
    if room < 0:
        _refuse(
            f"data: the held-out part ({corpus.eval_bytes} bytes, data.eval_fraction) is shorter than "
            f"one window of {seq_len + 1} bytes (model.seq_len)"
        )
    starts = torch.linspace(0, room, count).long() + corpus.train_bytes
    return corpus.text.windows(starts.tolist(), seq_len + 1).long()


def eval_slice(windows: torch.Tensor, part: int, parts: int) -> torch.Tensor:
    """The share of evaluation windows for ``part`` of ``parts`` evaluators."""
    return windows[part::parts]
