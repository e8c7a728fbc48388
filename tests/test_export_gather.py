"""The stream engine's byte gather (stream_copy._gather) on real files against numpy's concatenation: pieces joined
on any dim, more rows a block than one preadv takes, rows larger than a block, empty pieces; the CRC of each piece
as copied; a source cut under the copy; and the read-back naming the tensor that differs."""

from __future__ import annotations

import zlib
from pathlib import Path

import numpy as np
import pytest

from ckpt_audit.export.stream_copy import BLOCK, Maps, _runs, tensor_bytes
from ckpt_audit.export.stream_plan import Piece, Planned, StreamError, c_strides
from ckpt_audit.export.stream_write import _read_back, _write_file

_SKIP = 64  # each piece starts this far into its file, as a storage does inside a zip


def _piece(path: Path, a: np.ndarray) -> Piece:
    path.write_bytes(b"z" * _SKIP + a.tobytes())
    return Piece(path=str(path), offset=_SKIP, shape=a.shape, strides=c_strides(a.shape))


def _planned(tmp_path: Path, arrays: list[np.ndarray], dim: int | None, name: str = "t") -> Planned:
    pieces = tuple(_piece(tmp_path / f"{name}{i}.bin", a) for i, a in enumerate(arrays))
    shape = arrays[0].shape if dim is None else np.concatenate(arrays, axis=dim).shape
    return Planned(name=name, shape=shape, dtype=str(arrays[0].dtype), pieces=pieces, dim=dim)


def _gathered(t: Planned) -> tuple[bytes, dict[int, int]]:
    crcs = {i: 0 for i in range(len(t.pieces))}
    with Maps() as maps:
        out = b"".join(bytes(mv) for mv in tensor_bytes(t, t.dtype, maps, crcs))
    return out, crcs


@pytest.mark.parametrize(
    ("shapes", "dim"),
    [
        ([(5000, 3), (5000, 2)], 1),  # 5000 rows a block: preadv's 1024 views a call, several calls
        ([(3, 300_000), (3, 1)], 1),  # one row larger than a block: a run at a time
        ([(10, 4), (0, 4), (7, 4)], 0),  # an empty shard between two
        ([(4, 2, 5), (4, 3, 5)], 1),  # 3-d, joined on the middle dim
        ([(2, 3, 4), (2, 3, 1), (2, 3, 0)], 2),  # the last dim, with an empty piece
        ([(700_000,)], None),  # one piece over several blocks
    ],
)
def test_gather_equals_numpys_concatenation_and_crcs_each_piece(tmp_path, shapes, dim):
    rng = np.random.default_rng(0)
    arrays = [rng.integers(-(2**31), 2**31 - 1, size=s, dtype=np.int32) for s in shapes]
    t = _planned(tmp_path, arrays, dim)
    assert _runs(t, t.dtype) is not None  # the gather, not numpy's path
    got, crcs = _gathered(t)
    assert got == (arrays[0] if dim is None else np.concatenate(arrays, axis=dim)).tobytes()
    assert crcs == {i: zlib.crc32(a.tobytes()) for i, a in enumerate(arrays)}


def test_a_source_cut_while_it_is_copied_is_an_error_not_a_crash(tmp_path):
    """Read with pread, not through a map: a shard truncated under the copy is a short read and a one-line
    StreamError (a mapping would kill the process with SIGBUS)."""
    a = np.arange(3 * BLOCK // 4, dtype=np.int32)  # three blocks
    t = _planned(tmp_path, [a], None)
    with Maps() as maps:
        blocks = tensor_bytes(t, t.dtype, maps)
        assert bytes(next(blocks)) == a.tobytes()[:BLOCK]
        Path(t.pieces[0].path).write_bytes(b"")  # truncated after the first block was read
        with pytest.raises(StreamError, match="ends early"):
            list(blocks)


def test_read_back_names_the_tensor_that_differs(tmp_path):
    arrays = {n: np.full((4, 1000), i, dtype=np.float32) for i, n in enumerate(("a", "b", "c"))}
    group = [_planned(tmp_path, [v], None, name=n) for n, v in arrays.items()]
    out = tmp_path / "model.safetensors"
    with Maps() as maps:
        w = _write_file(out, group, None, maps, lambda n: None, True)
    assert _read_back(out, group, w, lambda: None) == w.file_hash
    with open(out, "r+b") as fh:  # one byte of "b" changed after it was written
        fh.seek(w.data_start + w.lengths[0] + 7)
        fh.write(b"\x01")
    with pytest.raises(StreamError, match="b differs from the concatenation"):
        _read_back(out, group, w, lambda: None)
