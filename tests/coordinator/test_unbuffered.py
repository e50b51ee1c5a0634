import os
from pathlib import Path

import pytest

from geodiloco.coordinator.unbuffered import BLOCK, BUFFER_BYTES, UnbufferedFile


@pytest.mark.parametrize("sizes", [[], [1], [BLOCK - 1, 1], [BLOCK + 1], [7, BUFFER_BYTES, BLOCK * 3 + 5]])
def test_the_file_holds_exactly_what_was_written(tmp_path: Path, sizes: list[int]) -> None:
    """Whatever the pieces' sizes against the block and the buffer: no padding left, no byte lost."""
    pieces = [os.urandom(n) for n in sizes]
    path = tmp_path / "f"
    with UnbufferedFile(path) as f:
        for piece in pieces:
            f.write(memoryview(piece))
        assert f.close() == sum(sizes)
    assert path.read_bytes() == b"".join(pieces)


def test_a_shorter_file_replaces_a_longer_one_whole(tmp_path: Path) -> None:
    path = tmp_path / "f"
    path.write_bytes(os.urandom(3 * BLOCK))
    with UnbufferedFile(path) as f:
        f.write(b"short")
        f.close()
    assert path.read_bytes() == b"short"
