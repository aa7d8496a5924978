"""PTFileModelPersistor: safetensors round trips, atomic writes, the best model, source checkpoints."""

from __future__ import annotations

import json
import struct
import threading
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import safetensors.torch
import torch

from engine.errors import PathOutsideError
from engine.model import FLModel, ParamsType
from engine.paths import JobPaths
from engine.persistors import ModelPersistor, PTFileModelPersistor, checkpoint_files


class Net(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = torch.nn.Linear(3, 2)
        self.bn = torch.nn.BatchNorm1d(2)


@pytest.fixture
def persistor(tmp_path: Path) -> PTFileModelPersistor:
    persistor = PTFileModelPersistor(model=Net())
    persistor.use_workspace(tmp_path / "app")
    return persistor


def params(seed: int = 0) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return {
        "f32": torch.randn(4, 3, generator=generator),
        "f16": torch.randn(5, generator=generator).half(),
        "bf16": torch.randn(2, 2, generator=generator).bfloat16(),
        "f64": torch.randn(3, generator=generator).double(),
        "steps": torch.tensor(7, dtype=torch.int64),
    }


def assert_bitwise_equal(got: dict[str, torch.Tensor], expected: dict[str, Any]) -> None:
    assert sorted(got) == sorted(expected)  # safetensors stores tensors in its own order
    for name, tensor in expected.items():
        tensor = torch.as_tensor(tensor)
        assert got[name].dtype == tensor.dtype, name
        assert torch.equal(got[name], tensor), name


def test_save_writes_safetensors_that_load_bitwise_equal(persistor: PTFileModelPersistor, tmp_path: Path) -> None:
    saved = params()

    path = persistor.save_model(FLModel(params=saved))
    persistor.flush()

    assert path == tmp_path / "app" / "models" / "global.safetensors"
    assert_bitwise_equal(safetensors.torch.load_file(path), saved)


def test_the_last_saved_model_is_given_back_and_none_before_a_save(persistor: PTFileModelPersistor) -> None:
    """What a Swarm round played again sends: the model saved last in this run, never the starting one."""
    with pytest.raises(LookupError, match="no global model was saved yet in this run"):
        persistor.load_saved_model()
    initial = persistor.load_model()  # the starting weights, handed over
    first = {name: value + 1 for name, value in initial.params.items()}
    second = {name: value + 2 for name, value in initial.params.items()}

    persistor.save_model(FLModel(params=first))
    persistor.save_model(FLModel(params=second))
    back = persistor.load_saved_model()

    assert back.params_type is ParamsType.FULL
    assert_bitwise_equal(back.params, second)
    with pytest.raises(LookupError, match="cannot give back the last model it saved"):
        ModelPersistor.load_saved_model(persistor)  # the base class promises nothing


def test_saved_file_is_safetensors_not_pickle(persistor: PTFileModelPersistor) -> None:
    path = persistor.save_model(FLModel(params=params()))
    persistor.flush()

    raw = path.read_bytes()
    (header_size,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8 : 8 + header_size])

    assert set(header) - {"__metadata__"} == set(params())
    assert not raw.startswith(b"\x80")  # a pickle (torch.save's zip holds one) starts with PROTO


def test_numpy_and_non_contiguous_params_are_saved(persistor: PTFileModelPersistor) -> None:
    base = torch.arange(12.0).reshape(3, 4)
    saved = {
        "np": np.arange(6, dtype=np.float32).reshape(2, 3),
        "transposed": base.T,
        "int": np.array([1, 2], dtype=np.int64),
    }

    path = persistor.save_model(FLModel(params=saved))
    persistor.flush()

    loaded = safetensors.torch.load_file(path)
    assert_bitwise_equal(
        loaded, {"np": torch.from_numpy(saved["np"]), "transposed": base.T.contiguous(), "int": torch.tensor([1, 2])}
    )


def test_tensors_sharing_memory_are_saved_separately(persistor: PTFileModelPersistor) -> None:
    weight = torch.randn(4, 3)
    saved = {"encoder.weight": weight, "decoder.weight": weight, "view": weight.view(12)}

    path = persistor.save_model(FLModel(params=saved))
    persistor.flush()

    assert_bitwise_equal(safetensors.torch.load_file(path), {k: v.clone() for k, v in saved.items()})
    assert weight.untyped_storage().data_ptr() == saved["encoder.weight"].untyped_storage().data_ptr()


def test_load_model_hands_over_the_modules_weights_and_keeps_only_their_shapes(
    persistor: PTFileModelPersistor,
) -> None:
    expected = {name: t.clone() for name, t in persistor._model.state_dict().items()}

    model = persistor.load_model()

    assert model.params_type is ParamsType.FULL
    assert_bitwise_equal(model.params, expected)
    assert all(t.device.type == "cpu" and not t.requires_grad for t in model.params.values())
    kept = persistor._model.state_dict()
    assert all(t.device.type == "meta" and t.shape == expected[n].shape for n, t in kept.items())


def test_a_later_load_model_reads_the_last_saved_global_model(persistor: PTFileModelPersistor) -> None:
    first = persistor.load_model()
    with pytest.raises(RuntimeError, match="handed out and no global model was saved yet"):
        persistor.load_model()
    saved = {name: t + 1 for name, t in first.params.items()}
    persistor.save_model(FLModel(params=saved, params_type=ParamsType.FULL))

    again = persistor.load_model()

    assert_bitwise_equal(again.params, saved)
    assert list(again.params) == list(first.params)


def test_load_model_reads_the_source_checkpoint(tmp_path: Path) -> None:
    source = {name: torch.full_like(t, 0.5) for name, t in Net().state_dict().items()}
    ckpt = tmp_path / "start.safetensors"
    safetensors.torch.save_file(source, ckpt)
    persistor = PTFileModelPersistor(model=Net(), source_ckpt_file_full_name=str(ckpt))

    model = persistor.load_model()

    assert model.params_type is ParamsType.FULL
    assert list(model.params) == list(Net().state_dict())  # the module's order, not the file's
    assert_bitwise_equal(model.params, source)


def test_the_starting_model_is_the_source_checkpoint_read_again_whatever_was_saved_since(tmp_path: Path) -> None:
    source = {name: torch.full_like(t, 0.5) for name, t in Net().state_dict().items()}
    ckpt = tmp_path / "start.safetensors"
    safetensors.torch.save_file(source, ckpt)
    persistor = PTFileModelPersistor(model=Net(), source_ckpt_file_full_name=str(ckpt))
    persistor.use_workspace(tmp_path / "app")
    persistor.drop_initial_model()
    persistor.save_model(FLModel(params={name: t + 1 for name, t in source.items()}))

    again = persistor.load_starting_model()

    assert list(again.params) == list(Net().state_dict())
    assert_bitwise_equal(again.params, source)


def test_starting_weights_from_the_module_cannot_be_read_again(persistor: PTFileModelPersistor) -> None:
    persistor.load_model()  # the module's weights, handed out
    with pytest.raises(LookupError, match=r"name a starting checkpoint \(source_ckpt_file_full_name\)"):
        persistor.load_starting_model()


def test_round_trip_through_the_source_checkpoint(persistor: PTFileModelPersistor, tmp_path: Path) -> None:
    trained = {name: t + 1 for name, t in Net().state_dict().items()}
    path = persistor.save_model(FLModel(params=trained))
    persistor.flush()

    model = PTFileModelPersistor(model=Net(), source_ckpt_file_full_name=str(path)).load_model()

    assert_bitwise_equal(model.params, trained)


def test_missing_source_checkpoint_names_path_and_key(tmp_path: Path) -> None:
    missing = tmp_path / "nowhere.safetensors"
    persistor = PTFileModelPersistor(model=Net(), source_ckpt_file_full_name=str(missing))

    with pytest.raises(FileNotFoundError, match=f"source_ckpt_file_full_name: no such file: {missing}"):
        persistor.load_model()


@pytest.mark.parametrize(
    ("content", "match"),
    [
        ({"fc.weight": torch.zeros(2, 3)}, r"does not match the model: missing 'fc.bias'"),
        ({**Net().state_dict(), "extra": torch.zeros(1)}, r"does not match the model: unexpected 'extra'"),
        ({**Net().state_dict(), "fc.bias": torch.zeros(5)}, r"'fc.bias': shape \(5,\), the model's is \(2,\)"),
        (b"not a safetensors file", r"is not a readable safetensors file"),
    ],
    ids=["missing", "unexpected", "shape", "garbage"],
)
def test_mismatching_source_checkpoint_is_refused(tmp_path: Path, content: Any, match: str) -> None:
    ckpt = tmp_path / "bad.safetensors"
    if isinstance(content, bytes):
        ckpt.write_bytes(content)
    else:
        safetensors.torch.save_file({k: v.contiguous() for k, v in content.items()}, ckpt)

    with pytest.raises(ValueError, match=f"source_ckpt_file_full_name: {ckpt} .*{match}"):
        PTFileModelPersistor(model=Net(), source_ckpt_file_full_name=str(ckpt)).load_model()


def job_paths_in(tmp_path: Path, allowed: tuple[Path, ...] = ()) -> JobPaths:
    """The folders of a job ``tmp_path/job`` (app ``app``) running in ``tmp_path/ws/server``."""
    (tmp_path / "job" / "app" / "custom").mkdir(parents=True)
    return JobPaths(tmp_path / "job" / "app", tmp_path / "job", tmp_path / "ws" / "server", allowed)


@pytest.mark.parametrize(
    ("where", "value"),
    [
        pytest.param("job/app/custom/start.safetensors", "custom/start.safetensors", id="relative-in-the-app"),
        pytest.param("job/start.safetensors", "{tmp}/job/start.safetensors", id="absolute-in-the-job"),
        pytest.param("ckpts/start.safetensors", "{tmp}/ckpts/start.safetensors", id="an-allowed-folder"),
    ],
)
def test_a_source_checkpoint_the_job_may_name_loads(tmp_path: Path, where: str, value: str) -> None:
    paths = job_paths_in(tmp_path, (tmp_path / "ckpts",))
    source = {name: torch.full_like(t, 0.25) for name, t in Net().state_dict().items()}
    (tmp_path / where).parent.mkdir(parents=True, exist_ok=True)
    safetensors.torch.save_file(source, tmp_path / where)
    persistor = PTFileModelPersistor(model=Net(), source_ckpt_file_full_name=value.format(tmp=tmp_path))

    persistor.use_job_paths(paths)

    assert_bitwise_equal(persistor.load_model().params, source)


@pytest.mark.parametrize(
    "value",
    [
        pytest.param("/etc/passwd", id="a-system-file"),
        pytest.param("../../x.safetensors", id="dot-dot"),
        pytest.param("custom/link.safetensors", id="a-link-out-of-the-job"),
    ],
)
def test_a_source_checkpoint_outside_the_job_and_allowed_folders_is_refused_at_start(
    tmp_path: Path, value: str
) -> None:
    paths = job_paths_in(tmp_path)
    outside = tmp_path / "x.safetensors"
    safetensors.torch.save_file(dict(Net().state_dict()), outside)
    (tmp_path / "job" / "app" / "custom" / "link.safetensors").symlink_to(outside)
    persistor = PTFileModelPersistor(model=Net(), source_ckpt_file_full_name=value)

    with pytest.raises(
        PathOutsideError,
        match=rf"^source_ckpt_file_full_name: '{value}' leads to .*, outside the job folder, the site's workspace and the folders the site allows \(.*\); .*--allow-dir DIR",
    ):
        persistor.use_job_paths(paths)


def test_failed_write_leaves_old_file_and_no_temp_file(small_disk: Path) -> None:
    persistor = PTFileModelPersistor(model=Net())
    persistor.use_workspace(small_disk / "app")  # 1 MiB: the first model fits, the second does not
    first = persistor.save_model(FLModel(params=params(1)))
    persistor.flush()
    before = first.read_bytes()

    with pytest.raises(OSError, match="No space left on device"):
        persistor.save_model(FLModel(params={**params(2), "big": torch.ones(1 << 19)}))

    assert [p.name for p in first.parent.iterdir()] == ["global.safetensors"]
    assert first.read_bytes() == before


def test_failed_rename_leaves_no_temp_file(persistor: PTFileModelPersistor, monkeypatch: pytest.MonkeyPatch) -> None:
    def refuse(src: str, dst: str) -> None:
        raise PermissionError("read-only")

    monkeypatch.setattr("os.replace", refuse)

    persistor.save_model(FLModel(params=params()))  # renamed in the background: the error comes later

    with pytest.raises(OSError, match=r"checkpoint .*global.safetensors was not saved: read-only"):
        persistor.flush()

    assert list(persistor.models_dir.iterdir()) == []
    persistor.flush()  # reported once


@pytest.mark.parametrize(
    ("bad", "error", "match"),
    [
        ({"w": [1.0, 2.0]}, TypeError, r"params\['w'\]: expected a torch.Tensor or numpy.ndarray, got list"),
        ({"w": np.array([object()])}, TypeError, r"params\['w'\]: a numpy array of Python objects cannot be saved"),
        (None, ValueError, "cannot save a model without params"),
    ],
    ids=["list", "object-array", "no-params"],
)
def test_unsavable_params_fail_before_any_file_is_written(
    persistor: PTFileModelPersistor, bad: Any, error: type[Exception], match: str
) -> None:
    with pytest.raises(error, match=match):
        persistor.save_model(FLModel(params=bad))

    assert not persistor.models_dir.exists()


def test_diff_params_are_not_saved_as_the_global_model(persistor: PTFileModelPersistor) -> None:
    with pytest.raises(ValueError, match="cannot save DIFF params as the global model"):
        persistor.save_model(FLModel(params=params(), params_type=ParamsType.DIFF))


@pytest.mark.parametrize(
    ("negate", "scores", "best_index"),
    [
        (False, [0.5, 0.9, 0.7], 1),
        (True, [0.5, 0.9, 0.2], 2),
        (False, [0.5, None, 0.4], 0),
        (True, [0.3, 0.3, 0.4], 0),
    ],
    ids=["highest", "negated-lowest", "missing-metric", "ties-keep-first"],
)
def test_best_model_by_key_metric(tmp_path: Path, negate: bool, scores: list[float | None], best_index: int) -> None:
    persistor = PTFileModelPersistor(model=Net(), key_metric="score", negate_key_metric=negate)
    persistor.use_workspace(tmp_path)
    rounds = [params(i) for i in range(len(scores))]

    for saved, score in zip(rounds, scores, strict=True):
        persistor.save_model(FLModel(params=saved, metrics=None if score is None else {"score": score}))
    persistor.flush()

    assert_bitwise_equal(
        safetensors.torch.load_file(tmp_path / "models" / "best_global.safetensors"), rounds[best_index]
    )
    assert_bitwise_equal(safetensors.torch.load_file(tmp_path / "models" / "global.safetensors"), rounds[-1])


def test_no_key_metric_writes_no_best_model(persistor: PTFileModelPersistor) -> None:
    persistor.save_model(FLModel(params=params(), metrics={"loss": 0.1}))
    persistor.flush()

    assert [p.name for p in persistor.models_dir.iterdir()] == ["global.safetensors"]


def test_save_before_use_workspace_is_refused() -> None:
    with pytest.raises(
        RuntimeError, match=r"PTFileModelPersistor has no models folder yet: call use_workspace\(app_dir\) first"
    ):
        PTFileModelPersistor(model=Net()).save_model(FLModel(params=params()))


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        (
            {"model": {"path": "model.Net"}},
            TypeError,
            r"model: expected a torch.nn.Module \(a \{path, args\} entry that builds one\), got dict",
        ),
        (
            {"model": Net(), "global_model_file_name": "../x.safetensors"},
            ValueError,
            r"global_model_file_name: expected a plain file name",
        ),
        (
            {"model": Net(), "best_global_model_file_name": ""},
            ValueError,
            r"best_global_model_file_name: expected a plain file name",
        ),
    ],
    ids=["not-a-module", "folder-in-name", "empty-name"],
)
def test_bad_arguments_are_refused(kwargs: dict, error: type[Exception], match: str) -> None:
    with pytest.raises(error, match=match):
        PTFileModelPersistor(**kwargs)


def test_is_a_model_persistor() -> None:
    assert isinstance(PTFileModelPersistor(model=Net()), ModelPersistor)


def test_save_returns_before_the_disk_has_it_and_load_waits_for_it(
    persistor: PTFileModelPersistor, monkeypatch: pytest.MonkeyPatch
) -> None:
    disk_ready = threading.Event()
    real_fsync = checkpoint_files.fsync_file

    def slow_disk(path: Path) -> None:
        disk_ready.wait(10)
        real_fsync(path)

    monkeypatch.setattr(checkpoint_files, "fsync_file", slow_disk)
    saved = {name: torch.full_like(t, 3.0) for name, t in persistor.load_model().params.items()}

    path = persistor.save_model(FLModel(params=saved))

    assert not path.exists()  # written, waiting for the disk: the workflow went on meanwhile
    threading.Timer(0.2, disk_ready.set).start()
    assert_bitwise_equal(persistor.load_model().params, saved)  # waited for the commit
    assert [p.name for p in path.parent.iterdir()] == ["global.safetensors"]


def test_a_failed_commit_fails_the_next_save_and_leaves_the_old_file(
    persistor: PTFileModelPersistor, monkeypatch: pytest.MonkeyPatch
) -> None:
    first = persistor.save_model(FLModel(params=params(1)))
    persistor.flush()
    before = first.read_bytes()

    def refuse(src: str, dst: str) -> None:
        raise OSError(28, "No space left on device")

    monkeypatch.setattr("os.replace", refuse)
    persistor.save_model(FLModel(params=params(2)))

    with pytest.raises(OSError, match="global.safetensors was not saved: No space left on device"):
        persistor.save_model(FLModel(params=params(3)))
    monkeypatch.undo()
    assert first.read_bytes() == before
    assert [p.name for p in first.parent.iterdir()] == ["global.safetensors"]
    persistor.save_model(FLModel(params=params(4)))  # the error was reported; saving works again
    persistor.flush()
    assert_bitwise_equal(safetensors.torch.load_file(first), params(4))


def test_the_best_model_is_a_second_name_of_the_same_file(tmp_path: Path) -> None:
    persistor = PTFileModelPersistor(model=Net(), key_metric="score")
    persistor.use_workspace(tmp_path)
    persistor.save_model(FLModel(params=params(1), metrics={"score": 0.9}))
    persistor.flush()
    best, latest = tmp_path / "models" / "best_global.safetensors", tmp_path / "models" / "global.safetensors"
    assert best.stat().st_ino == latest.stat().st_ino  # written once

    persistor.save_model(FLModel(params=params(2), metrics={"score": 0.5}))
    persistor.flush()

    assert_bitwise_equal(safetensors.torch.load_file(best), params(1))
    assert_bitwise_equal(safetensors.torch.load_file(latest), params(2))


def test_use_workspace_deletes_the_temp_files_a_crash_left(tmp_path: Path) -> None:
    models = tmp_path / "models"
    models.mkdir()
    left = [models / ".global.safetensors.k2j4.tmp", models / ".best_global.safetensors.9x.tmp"]
    kept = [models / "global.safetensors", models / ".other.safetensors.1.tmp", models / "notes.txt"]
    for path in left + kept:
        path.write_bytes(b"x")

    PTFileModelPersistor(model=Net()).use_workspace(tmp_path)

    assert sorted(models.iterdir()) == sorted(kept)
