"""The cache cells a run directory keeps for a fast resume (io/cellfiles.py): a cache, never a record. What is read
back is exactly what was written, in order; a torn file, another model's or build's, or a leftover temporary file
is never handed to the engine; clearing keeps the stretches a resume put back."""

from __future__ import annotations

from swiftwrite.io.cellfiles import CellFiles


def test_stretches_come_back_in_order_as_written(tmp_path):
    files = CellFiles(tmp_path, "model-a/build-1")
    files.write(256, 512, "k2", b"\x02" * 100)
    files.write(0, 256, "k1", b"\x01" * 300)
    assert list(files.read()) == [(0, 256, "k1", b"\x01" * 300), (256, 512, "k2", b"\x02" * 100)]


def test_torn_foreign_and_temporary_files_are_not_read(tmp_path):
    files = CellFiles(tmp_path, "model-a/build-1")
    files.write(0, 10, "k1", b"abc" * 50)
    files.write(10, 20, "k2", b"def" * 50)
    files.write(20, 30, "k3", b"ghi" * 50)
    folder = tmp_path / "cells"
    torn = sorted(folder.glob("*.cells"))[1]
    torn.write_bytes(torn.read_bytes()[:-7])  # a write cut short (a power cut: renamed, never synced)
    flipped = sorted(folder.glob("*.cells"))[2]
    data = bytearray(flipped.read_bytes())
    data[-1] ^= 1  # one bit of the cells changed
    flipped.write_bytes(bytes(data))
    (folder / "000000030.cells.tmp").write_bytes(b"half")
    assert [s[:3] for s in files.read()] == [(0, 10, "k1")]
    assert list(CellFiles(tmp_path, "model-b/build-1").read()) == []  # another model's cells: none of them
    assert list(CellFiles(tmp_path, "model-a/build-2").read()) == []  # another build of llama.cpp: none either


def test_clear_keeps_what_was_put_back_and_drops_the_rest(tmp_path):
    files = CellFiles(tmp_path, "m")
    for start in (0, 10, 20):
        files.write(start, start + 10, f"k{start}", b"x")
    (tmp_path / "cells" / "000000030.cells.tmp").write_bytes(b"left over")
    files.clear(keep_before=20)
    assert [s[0] for s in files.read()] == [0, 10]
    assert sorted(p.name for p in (tmp_path / "cells").iterdir()) == ["000000000.cells", "000000010.cells"]
    files.clear()
    assert list((tmp_path / "cells").iterdir()) == []


def test_a_folder_that_cannot_be_written_costs_nothing_but_the_cells(tmp_path):
    (tmp_path / "cells").write_text("a file where the folder would be")
    files = CellFiles(tmp_path, "m")
    files.write(0, 10, "k", b"x")  # no exception: a resume then computes the context
    assert list(files.read()) == []
