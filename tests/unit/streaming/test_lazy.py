"""The disk consumer, lazy dict and refs, their shared temp folder, and run-folder sweeping."""

from __future__ import annotations

import gc
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import safetensors.torch
import torch

from engine.errors import StreamingError
from engine.model import DXO, DataKind, FLModel
from engine.streaming.disk import TENSORS_FILE, DiskDownloads, DiskTensorConsumer, folder_bytes
from engine.streaming.layout import StreamLayout
from engine.streaming.lazy import LazyTensorDict, TempDirRef, cleanup_lazy_refs

from .test_consumers import chunks
from .test_layout import mixed_tensors


def downloaded(root: Path, tensors: dict[str, torch.Tensor] | None = None, chunk_bytes: int = 64) -> LazyTensorDict:
    """A complete disk download of ``tensors`` under ``root``, chunks in reverse order."""
    tensors = mixed_tensors() if tensors is None else tensors
    layout = StreamLayout.of_tensors(tensors)
    consumer = DiskTensorConsumer(StreamLayout.parse(layout.header), chunk_bytes, root)
    for index, frames in reversed(chunks(layout, tensors, chunk_bytes)):
        consumer.accept(index, frames)
    return consumer.finish()


def test_the_consumer_writes_a_safetensors_file_in_a_folder_of_its_own(tmp_path: Path) -> None:
    tensors = mixed_tensors()

    lazy = downloaded(tmp_path, tensors)

    [folder] = tmp_path.iterdir()
    assert folder.name.startswith("xfer-") and lazy.file == folder / TENSORS_FILE
    loaded = safetensors.torch.load_file(lazy.file)
    assert all(torch.equal(loaded[name], tensor) for name, tensor in tensors.items())
    assert list(lazy) == list(lazy.layout.entries[i].name for i in range(len(lazy)))
    assert all(torch.equal(lazy[name], tensor) for name, tensor in tensors.items())


def test_an_aborted_download_leaves_nothing(tmp_path: Path) -> None:
    tensors = mixed_tensors()
    layout = StreamLayout.of_tensors(tensors)
    consumer = DiskTensorConsumer(layout, 64, tmp_path)
    consumer.accept(0, chunks(layout, tensors, 64)[0][1])

    consumer.abort()

    assert list(tmp_path.iterdir()) == []
    with pytest.raises(StreamingError):
        consumer.finish()


def test_a_missing_root_is_an_error_naming_it(tmp_path: Path) -> None:
    layout = StreamLayout.of_tensors(mixed_tensors())
    with pytest.raises(StreamingError, match=rf"cannot make a temp folder in {tmp_path / 'gone'} for a download"):
        DiskTensorConsumer(layout, 64, tmp_path / "gone")


def test_a_ref_is_small_not_a_tensor_and_resolves_to_a_fresh_copy(tmp_path: Path) -> None:
    lazy = downloaded(tmp_path)
    ref = lazy.make_lazy_ref("layers.0.weight")

    first, second = ref.resolve(), ref.resolve()

    assert not isinstance(ref, torch.Tensor)
    assert ref.shape == (33, 17) and ref.dtype is torch.float32
    assert torch.equal(first, mixed_tensors()["layers.0.weight"]) and first.data_ptr() != second.data_ptr()
    assert "layers.0.weight" in repr(ref) and "(33, 17)" in repr(ref)
    assert sys.getsizeof(ref) < 200


def test_an_array_ref_resolves_to_a_numpy_array(tmp_path: Path) -> None:
    lazy = downloaded(tmp_path, {"a": torch.arange(6, dtype=torch.int32).reshape(2, 3)})

    value = lazy.make_lazy_ref("a", as_numpy=True).resolve()

    assert isinstance(value, np.ndarray) and value.tolist() == [[0, 1, 2], [3, 4, 5]]


def open_files() -> list[str]:
    found = []
    for fd in os.listdir("/proc/self/fd"):
        try:
            found.append(os.readlink(f"/proc/self/fd/{fd}"))
        except OSError:  # the listing's own descriptor, closed meanwhile
            pass
    return found


def test_no_file_stays_open_or_mapped_after_resolve(tmp_path: Path) -> None:
    lazy = downloaded(tmp_path)

    lazy.make_lazy_ref("layers.0.weight").resolve()

    mapped = Path(f"/proc/{os.getpid()}/maps").read_text()
    assert str(lazy.file) not in mapped and str(lazy.file) not in open_files()


def test_the_folder_lives_until_the_last_holder_lets_go(tmp_path: Path) -> None:
    lazy = downloaded(tmp_path)
    folder = lazy.file.parent
    first, second = lazy.make_lazy_ref("mask"), lazy.make_lazy_ref("steps")

    lazy.release()
    del lazy
    gc.collect()
    assert folder.exists() and first.owner.holds == 2

    first.release()
    first.release()  # a second release changes nothing
    assert folder.exists() and second.resolve().tolist() == [0, 1, 2, 3, 4]

    del second  # garbage collected: its hold goes with it
    gc.collect()
    assert not folder.exists()
    with pytest.raises(StreamingError, match="'mask' was released"):
        first.resolve()


def test_a_dict_nobody_took_refs_from_is_deleted_when_collected(tmp_path: Path) -> None:
    lazy = downloaded(tmp_path)
    folder = lazy.file.parent

    del lazy
    gc.collect()

    assert not folder.exists()


@pytest.mark.parametrize(
    ("damage", "match"),
    [
        (lambda file: file.unlink(), "is gone"),
        (lambda file: os.truncate(file, 40), "is truncated: 40 bytes"),
    ],
    ids=["deleted", "truncated"],
)
def test_a_damaged_file_is_a_clear_error(tmp_path: Path, damage, match: str) -> None:
    ref = downloaded(tmp_path).make_lazy_ref("layers.0.weight")

    damage(ref.file)

    with pytest.raises(StreamingError, match=match):
        ref.verify()
    with pytest.raises(StreamingError, match=match):
        ref.resolve()


def test_cleanup_lazy_refs_deletes_every_folder_found_in_nested_data(tmp_path: Path) -> None:
    one, two = downloaded(tmp_path), downloaded(tmp_path)
    model = FLModel(params={"w": one.make_lazy_ref("mask")}, meta={"dxo": DXO(DataKind.WEIGHTS, {"s": two})})
    assert len(list(tmp_path.iterdir())) == 2

    deleted = cleanup_lazy_refs({"model": model, "plain": [torch.zeros(1), 3]})

    assert deleted == 2 and list(tmp_path.iterdir()) == []
    assert cleanup_lazy_refs(model) == 0  # already gone
    with pytest.raises(StreamingError, match="already cleaned up"):
        one.make_lazy_ref("steps")


def test_a_temp_dir_ref_counts_holds(tmp_path: Path) -> None:
    folder = tmp_path / "f"
    folder.mkdir()
    owner = TempDirRef(folder)

    class Holder:
        pass

    holders = [Holder(), Holder()]
    releases = [owner.hold(h) for h in holders]
    releases[0]()
    assert folder.exists() and owner.holds == 1
    releases[1]()
    assert not folder.exists() and owner.deleted


def test_a_run_folder_is_made_closed_and_counted(tmp_path: Path) -> None:
    downloads = DiskDownloads(tmp_path / "root")
    folder = downloads.open()
    lazy = downloaded(folder)

    assert folder.parent == tmp_path / "root" and folder.name.startswith(f"run-{os.getpid()}-")
    assert downloads.bytes_used() == folder_bytes(folder) == lazy.file.stat().st_size > 0
    consumer = downloads.consumer_factory()(lazy.layout, 64)
    assert isinstance(consumer, DiskTensorConsumer) and consumer.path.parent.parent == folder
    consumer.abort()

    downloads.close()

    assert list((tmp_path / "root").iterdir()) == []


def test_opening_sweeps_the_folders_of_crashed_runs_only(tmp_path: Path) -> None:
    root = tmp_path / "root"
    code = (
        "import os, sys; from pathlib import Path; from engine.streaming.disk import DiskDownloads; "
        "folder = DiskDownloads(Path(sys.argv[1])).open(); (folder / 'partial').write_bytes(b'x' * 1000); "
        "os.kill(os.getpid(), 9)"
    )
    subprocess.run([sys.executable, "-c", code, str(root)], check=False)  # a run that crashed
    [crashed] = root.iterdir()
    alive = DiskDownloads(root)
    alive_folder = alive.open()

    later = DiskDownloads(root)
    later.open()

    assert not crashed.exists()
    assert alive_folder.exists()  # its process (this one) still runs
    alive.close()
    later.close()
    assert list(root.iterdir()) == []
