"""Usage of streams as it is delivered, kept on disk, so a gateway that is killed mid-stream still bills it, once.

A stream's usage row is written when it ends. A gateway killed while streams run (``kill -9``, out of memory)
would lose what those streams had already delivered; so, for every streamed request, this journal appends to a file
under ``--data-dir`` (``usage-journal/streams-*.jsonl``) its grant and token counts as its chunks are written to
the client, and marks it settled once the usage ledger has committed its row. At the next start, ``replay`` bills
each stream the file left unsettled with the tokens it had delivered (``finish_reason`` ``abort``, ``http_status``
503), skipping any whose row the database already has (killed between the commit and the mark), and removes the
file. Writes are plain appends (no fsync): a killed process loses nothing the kernel has; a machine that loses
power may lose the last moments. A file held by a running gateway (an advisory lock) is never replayed.
"""

import fcntl
import logging
import os
import uuid
from dataclasses import dataclass, replace
from pathlib import Path

import msgspec
from aiohttp import web
from sqlalchemy import select

from tenants.models import Usage
from tenants.quota import Granted, QuotaManager
from tenants.store import UsageRecord

logger = logging.getLogger(__name__)

# Records: ["s", request id, grant, usage so far] when a stream first delivers; ["p", request id, prompt, completion,
# cached tokens] as it delivers more; ["d", request id] once its row is committed.
_encoder = msgspec.json.Encoder()
_START = msgspec.json.Decoder(tuple[str, str, Granted, UsageRecord])
_PROGRESS = msgspec.json.Decoder(tuple[str, str, int, int, int])
COMPACT_BYTES = 1 << 20  # a file past this is rewritten with its open streams only


@dataclass(slots=True)
class _Open:
    grant: Granted
    usage: UsageRecord  # its token counts: what was delivered so far


class StreamJournal:
    def __init__(self, directory: Path) -> None:
        self.directory = directory
        self._open: dict[str, _Open] = {}
        self._fd: int | None = None
        self._path: Path | None = None
        self._size = 0

    # -- writing ----------------------------------------------------------------------------------------------

    def _file(self) -> int:
        if self._fd is None:
            self.directory.mkdir(parents=True, exist_ok=True)
            self._path = self.directory / f"streams-{os.getpid()}-{uuid.uuid4().hex[:12]}.jsonl"
            self._fd = os.open(self._path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
            fcntl.flock(self._fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # ours while we run: never replayed meanwhile
            self._size = 0
        return self._fd

    def _append(self, record: list) -> None:
        line = _encoder.encode(record) + b"\n"
        try:
            os.write(self._file(), line)
            self._size += len(line)
        except OSError as e:  # a full disk costs the durability of this stream's usage, not the stream
            logger.warning("stream usage journal: %s", e)

    def delivered(self, grant: Granted, usage: UsageRecord) -> None:
        """``usage`` (its token counts: what the client has been sent) for a stream; cheap when nothing changed."""
        rid = usage.request_id
        entry = self._open.get(rid)
        if entry is None:
            self._open[rid] = _Open(grant, usage)
            self._append(["s", rid, grant, usage])
            return
        last = entry.usage
        if (last.prompt_tokens, last.completion_tokens, last.cached_prompt_tokens) != (
                usage.prompt_tokens, usage.completion_tokens, usage.cached_prompt_tokens):
            entry.usage = usage
            self._append(["p", rid, usage.prompt_tokens, usage.completion_tokens, usage.cached_prompt_tokens])

    def settled(self, request_ids: list[str]) -> None:
        """Their rows are committed (or kept by the ledger's own journal): nothing to replay for them."""
        for rid in request_ids:
            if self._open.pop(rid, None) is not None:
                self._append(["d", rid])
        if self._size > COMPACT_BYTES:
            self._compact()

    def _compact(self) -> None:
        """Start a new file holding the open streams only; the old one goes."""
        old_fd, old_path = self._fd, self._path
        self._fd = None
        for rid, entry in self._open.items():
            self._append(["s", rid, entry.grant, entry.usage])
        if old_fd is not None:
            os.close(old_fd)
            old_path.unlink(missing_ok=True)

    def close(self) -> None:
        """At a clean stop (every stream settled): the file goes."""
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None
            if not self._open:
                self._path.unlink(missing_ok=True)

    # -- at start -----------------------------------------------------------------------------------------------

    async def replay(self, quotas: QuotaManager) -> int:
        """Bill the streams earlier runs left unsettled with what they delivered; returns how many were billed."""
        if not self.directory.is_dir():
            return 0
        billed = 0
        for path in sorted(self.directory.glob("streams-*.jsonl")):
            fd = os.open(path, os.O_RDONLY)
            try:
                try:
                    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                except BlockingIOError:
                    continue  # a running gateway's
                unsettled = _read(path.read_bytes())
                if unsettled:
                    billed += await _bill(quotas, unsettled)
                    logger.info("stream usage journal: billed %d stream(s) cut by a stop in %s", len(unsettled), path)
                path.unlink()
            finally:
                os.close(fd)
        return billed


def _read(data: bytes) -> dict[str, _Open]:
    entries: dict[str, _Open] = {}
    for line in data.splitlines():
        try:
            kind = line[2:3]
            if kind == b"s":
                _, rid, grant, usage = _START.decode(line)
                entries[rid] = _Open(grant, usage)
            elif kind == b"p":
                _, rid, prompt, completion, cached = _PROGRESS.decode(line)
                if rid in entries:
                    entries[rid].usage = replace(entries[rid].usage, prompt_tokens=prompt,
                                                 completion_tokens=completion, cached_prompt_tokens=cached)
            elif kind == b"d":
                entries.pop(msgspec.json.decode(line)[1], None)
        except (msgspec.DecodeError, msgspec.ValidationError, IndexError):
            continue  # the last line of a killed writer may be cut short
    return entries


async def _bill(quotas: QuotaManager, unsettled: dict[str, _Open]) -> int:
    async with quotas.store.sessions() as s:
        written = set((await s.execute(select(Usage.request_id).where(Usage.request_id.in_(list(unsettled))))).scalars())
    items = [(e.grant, replace(e.usage, finish_reason="abort", http_status=503))
             for rid, e in unsettled.items() if rid not in written]
    if items:
        await quotas.settle_many(items)
    return len(items)


STREAM_JOURNAL = web.AppKey("stream_journal", StreamJournal)


class JournaledStream:
    """One streamed request's entry: ``delivered(choices)`` after each chunk written to its client."""

    __slots__ = ("journal", "grant", "usage")

    def __init__(self, journal: StreamJournal, grant: Granted, usage: UsageRecord) -> None:
        self.journal, self.grant, self.usage = journal, grant, usage

    def delivered(self, choices) -> None:
        self.journal.delivered(self.grant, replace(
            self.usage, prompt_tokens=choices.num_prompt_tokens, completion_tokens=choices.num_output_tokens,
            cached_prompt_tokens=choices.num_cached_tokens))


JOURNALED = web.RequestKey("journaled", JournaledStream)
