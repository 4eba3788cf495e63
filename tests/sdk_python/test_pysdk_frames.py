"""The binary frame header codec (u32 request id, u64 offset, u8 flags, little-endian)."""
import pytest

from sandboxer import frames


def test_header_layout_is_little_endian_13_bytes():
    h = frames.encode_header(0x01020304, 0x1122334455667788, last=True)
    assert h == bytes.fromhex("04030201" "8877665544332211" "01")
    assert frames.HEADER_SIZE == 13


def test_round_trip_keeps_every_field():
    f = frames.encode_chunk(7, 1 << 40, b"abc", last=False)
    c = frames.decode_chunk(f)
    assert (c.request_id, c.offset, c.last, c.data) == (7, 1 << 40, False, b"abc")


def test_reserved_flag_bits_survive_decoding():
    c = frames.decode_chunk(bytes.fromhex("01000000" "0000000000000000" "03") + b"x")
    assert c.last and c.flags == 3


def test_short_frame_is_refused_with_its_length():
    with pytest.raises(ValueError, match="12 bytes"):
        frames.decode_chunk(b"\0" * 12)


def test_oversized_chunk_is_refused():
    with pytest.raises(ValueError, match="exceeds"):
        frames.encode_chunk(1, 0, b"\0" * (frames.MAX_CHUNK + 1), last=True)
    with pytest.raises(ValueError, match="more than"):
        frames.decode_chunk(b"\0" * (frames.HEADER_SIZE + frames.MAX_CHUNK + 1))


@pytest.mark.parametrize("rid,off", [(-1, 0), (1 << 32, 0), (1, -1), (1, 1 << 64)])
def test_out_of_range_fields_are_refused(rid, off):
    with pytest.raises(ValueError):
        frames.encode_header(rid, off, last=True)


def test_split_covers_the_data_with_one_last_frame():
    data = bytes(range(256)) * 10_000  # 2.56 MB: three frames
    fs = [frames.decode_chunk(f) for f in frames.split_chunks(9, data)]
    assert [c.offset for c in fs] == [0, frames.MAX_CHUNK, 2 * frames.MAX_CHUNK]
    assert [c.last for c in fs] == [False, False, True]
    assert b"".join(c.data for c in fs) == data


def test_split_of_empty_data_is_one_empty_last_frame():
    (f,) = frames.split_chunks(3, b"")
    c = frames.decode_chunk(f)
    assert (c.request_id, c.offset, c.last, c.data) == (3, 0, True, b"")
