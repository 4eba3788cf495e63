"""The binary frame of the sandboxer.v1 protocol: file content in chunks.

A binary frame is a 13-byte little-endian header (u32 request id, u64 offset, u8 flags; bit 0 of
the flags marks the last chunk of a transfer), then at most 1 MiB of data.
"""
from __future__ import annotations

import struct
from dataclasses import dataclass
from typing import Iterator

HEADER = struct.Struct("<IQB")
HEADER_SIZE = HEADER.size  # 13
MAX_CHUNK = 1 << 20  # bytes of data in one binary frame
FLAG_LAST = 0x01


@dataclass(frozen=True)
class Chunk:
    """One binary frame: which request it belongs to, where its data goes, and the data."""

    request_id: int
    offset: int
    last: bool
    data: bytes
    flags: int = 0

    def encode(self) -> bytes:
        """The frame's bytes: header then data."""
        return encode_chunk(self.request_id, self.offset, self.data, last=self.last, flags=self.flags)


def encode_header(request_id: int, offset: int, *, last: bool, flags: int = 0) -> bytes:
    """Packs a binary frame header. `flags` carries bits other than "last" (reserved today)."""
    if not 0 <= request_id <= 0xFFFFFFFF:
        raise ValueError(f"request id {request_id} does not fit in u32")
    if not 0 <= offset <= 0xFFFFFFFFFFFFFFFF:
        raise ValueError(f"offset {offset} does not fit in u64")
    f = (flags & ~FLAG_LAST & 0xFF) | (FLAG_LAST if last else 0)
    return HEADER.pack(request_id, offset, f)


def encode_chunk(request_id: int, offset: int, data: bytes, *, last: bool, flags: int = 0) -> bytes:
    """A whole binary frame; refuses more than MAX_CHUNK bytes of data."""
    if len(data) > MAX_CHUNK:
        raise ValueError(f"chunk of {len(data)} bytes exceeds the {MAX_CHUNK}-byte frame limit")
    return encode_header(request_id, offset, last=last, flags=flags) + bytes(data)


def decode_chunk(frame: bytes) -> Chunk:
    """Parses a binary frame; raises ValueError naming what is wrong with a malformed one."""
    if len(frame) < HEADER_SIZE:
        raise ValueError(f"binary frame of {len(frame)} bytes is shorter than the {HEADER_SIZE}-byte header")
    rid, off, flags = HEADER.unpack_from(frame)
    data = bytes(frame[HEADER_SIZE:])
    if len(data) > MAX_CHUNK:
        raise ValueError(f"binary frame carries {len(data)} bytes, more than {MAX_CHUNK}")
    return Chunk(rid, off, bool(flags & FLAG_LAST), data, flags)


def iter_chunks(request_id: int, data: bytes, chunk_size: int = MAX_CHUNK) -> Iterator[bytes]:
    """Encodes `data` as consecutive frames, one at a time; an empty payload is one empty frame
    marked last."""
    if not 0 < chunk_size <= MAX_CHUNK:
        raise ValueError(f"chunk size {chunk_size} must be in 1..{MAX_CHUNK}")
    if not data:
        yield encode_chunk(request_id, 0, b"", last=True)
        return
    view = memoryview(data)
    for off in range(0, len(data), chunk_size):
        piece = view[off : off + chunk_size]
        yield encode_chunk(request_id, off, piece.tobytes(), last=off + chunk_size >= len(data))


def split_chunks(request_id: int, data: bytes, chunk_size: int = MAX_CHUNK) -> list[bytes]:
    """Every frame of `data` (see iter_chunks)."""
    return list(iter_chunks(request_id, data, chunk_size))
