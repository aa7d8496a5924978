"""The server's job store: submissions checked and kept on disk, records that survive a restart."""

from __future__ import annotations

import json
import logging
import shutil
import stat
import threading
import zipfile
from pathlib import Path

import pytest

from engine.deploy.archive import JobArchiveError, archive_digest, pack_job
from engine.deploy.job_store import (
    MAX_RESUMES,
    RESUMING_REASON,
    SERVER_STOPPED_REASON,
    JobRecord,
    JobStore,
    JobStoreError,
    StoreStatus,
    utc_now,
)
from engine.errors import ConfigError
from engine.runtime.states import JobState

FEDAVG = Path(__file__).resolve().parents[3] / "jobs" / "fedavg"


@pytest.fixture(scope="module")
def fedavg_zip(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return pack_job(FEDAVG, tmp_path_factory.mktemp("upload") / "fedavg.zip")


@pytest.fixture
def store(tmp_path: Path) -> JobStore:
    return JobStore(tmp_path / "jobs")


def submit(store: JobStore, archive: Path, submitter: str = "alice@a.org") -> JobRecord:
    return store.submit(archive, submitter=submitter, org="a")


def test_a_submitted_job_is_recorded_and_its_files_are_in_place(store: JobStore, fedavg_zip: Path) -> None:
    record = submit(store, fedavg_zip)

    assert record.status == StoreStatus.SUBMITTED
    assert (record.name, record.submitter, record.submitter_org) == ("fedavg", "alice@a.org", "a")
    assert record.digest == archive_digest(fedavg_zip)
    assert record.sites == [] and record.started_at is None and record.port is None
    folder = store.root / record.job_id
    assert sorted(p.name for p in folder.iterdir()) == ["job", "job.zip", "meta.json", "workspace"]
    assert store.archive(record.job_id).read_bytes() == fedavg_zip.read_bytes()
    assert (store.job_folder(record.job_id) / "app" / "custom" / "train.py").is_file()
    assert store.workspace(record.job_id).is_dir()
    assert stat.S_IMODE((folder / "meta.json").stat().st_mode) == 0o600
    assert store.get(record.job_id) == record


def test_an_invalid_job_is_refused_with_its_problems_and_leaves_nothing(store: JobStore, tmp_path: Path) -> None:
    job = shutil.copytree(FEDAVG, tmp_path / "typo")
    config = job / "app" / "config" / "config_fed_server.conf"
    text = config.read_text(encoding="utf-8").replace("format_version = 2", "format_version = 3")
    config.write_text(text, encoding="utf-8")
    archive = pack_job(job, tmp_path / "typo.zip")

    with pytest.raises(ConfigError) as caught:
        submit(store, archive)

    # checked without building anything of the job (the admin's tool checks the args before sending)
    assert str(caught.value).startswith("app/config/config_fed_server.conf:")
    assert "format_version" in str(caught.value)
    assert list(store.root.iterdir()) == []
    assert store.list() == []


def test_a_hostile_archive_is_refused_and_leaves_nothing(store: JobStore, tmp_path: Path) -> None:
    archive = tmp_path / "evil.zip"
    with zipfile.ZipFile(archive, "w") as zf:
        zf.writestr("meta.conf", "name = x\n")
        zf.writestr("../../evil.py", "boom")

    with pytest.raises(JobArchiveError, match="member '../../evil.py'"):
        submit(store, archive)

    assert list(store.root.iterdir()) == []


def test_update_get_and_list(store: JobStore, fedavg_zip: Path) -> None:
    first, second = submit(store, fedavg_zip), submit(store, fedavg_zip, submitter="bob@b.org")

    started = utc_now()
    updated = store.update(
        first.job_id, status=StoreStatus.RUNNING, started_at=started, sites=["site-1", "site-2"], port=8003
    )

    assert updated == store.get(first.job_id)
    assert (updated.status, updated.started_at, updated.sites, updated.port) == (
        "RUNNING",
        started,
        ["site-1", "site-2"],
        8003,
    )
    assert [r.job_id for r in store.list()] == [first.job_id, second.job_id]
    assert store.queued() == [second]


def test_a_new_store_on_the_same_folder_sees_the_same_records(store: JobStore, fedavg_zip: Path) -> None:
    record = submit(store, fedavg_zip)
    finished = store.update(
        record.job_id, status=StoreStatus.FINISHED_COMPLETED, finished_at=utc_now(), reason="3 rounds done"
    )

    restarted = JobStore(store.root)

    assert restarted.list() == [finished]
    assert restarted.get(record.job_id).reason == "3 rounds done"


def test_recover_aborts_the_jobs_the_server_left_running(store: JobStore, fedavg_zip: Path) -> None:
    running, queued = submit(store, fedavg_zip), submit(store, fedavg_zip)
    store.update(running.job_id, status=StoreStatus.RUNNING, started_at=utc_now(), port=8003)
    (store.root / f".incoming-{'0' * 12}").mkdir()  # a submission cut short by the crash

    aborted = JobStore(store.root).recover()

    assert [r.job_id for r in aborted] == [running.job_id]
    record = store.get(running.job_id)
    assert (record.status, record.reason, record.port) == ("FINISHED_ABORTED", SERVER_STOPPED_REASON, None)
    assert record.finished_at is None  # when it stopped is not known: not the time of the restart
    assert store.get(queued.job_id).status == StoreStatus.SUBMITTED
    assert not (store.root / f".incoming-{'0' * 12}").exists()


def test_recover_queues_again_the_running_jobs_that_can_resume_a_few_times(store: JobStore, fedavg_zip: Path) -> None:
    running, other = submit(store, fedavg_zip), submit(store, fedavg_zip)
    for record in (running, other):
        store.update(record.job_id, status=StoreStatus.RUNNING, started_at=utc_now(), sites=["a", "b"], port=8003)

    aborted = JobStore(store.root).recover(resume=lambda record: record.job_id == running.job_id)

    assert [r.job_id for r in aborted] == [other.job_id]  # it kept no checkpoints: aborted as before
    record = store.get(running.job_id)
    assert (record.status, record.resumes, record.reason) == ("SUBMITTED", 1, RESUMING_REASON)
    assert (record.sites, record.port) == (["a", "b"], 8003)  # where it ran: it resumes there
    for resumes in range(2, MAX_RESUMES + 1):
        store.update(running.job_id, status=StoreStatus.RUNNING)
        JobStore(store.root).recover(resume=lambda record: True)
        assert store.get(running.job_id).resumes == resumes
    store.update(running.job_id, status=StoreStatus.RUNNING)
    JobStore(store.root).recover(resume=lambda record: True)
    assert store.get(running.job_id).status == "FINISHED_ABORTED"  # a job that keeps stopping the server


def test_recover_removes_results_claims_a_stop_cut_short(store: JobStore, fedavg_zip: Path) -> None:
    record = submit(store, fedavg_zip)
    claim = store.workspace(record.job_id) / ".taking-site-1"
    claim.mkdir()
    (claim / "results.zip").write_bytes(b"half a download")
    (store.workspace(record.job_id) / "site-2").mkdir()  # results taken before the stop stay

    JobStore(store.root).recover()

    assert sorted(p.name for p in store.workspace(record.job_id).iterdir()) == ["site-2"]


@pytest.mark.parametrize(
    "text",
    ["", '{"job_id": "', "[]", '{"job_id": "abc"}', '{"job_id": "%s", "name": 1}'],
    ids=["empty", "half-written", "not-an-object", "missing-keys", "wrong-type"],
)
def test_a_corrupt_record_is_listed_as_broken_and_logged(
    store: JobStore, fedavg_zip: Path, text: str, caplog: pytest.LogCaptureFixture
) -> None:
    good, bad = submit(store, fedavg_zip), submit(store, fedavg_zip)
    (store.root / bad.job_id / "meta.json").write_text(text.replace("%s", bad.job_id), encoding="utf-8")

    with caplog.at_level(logging.WARNING, logger="engine.deploy.job_store"):
        records = store.list()

    assert [r.job_id for r in records] == [good.job_id, bad.job_id]
    assert records[1].status == StoreStatus.BROKEN and "meta.json cannot be read" in records[1].reason
    assert f"broken job record job_id={bad.job_id}" in caplog.text
    with pytest.raises(JobStoreError, match="its record is broken"):
        store.update(bad.job_id, status=StoreStatus.RUNNING)


def test_a_folder_that_is_not_a_job_is_ignored(store: JobStore, fedavg_zip: Path) -> None:
    record = submit(store, fedavg_zip)
    (store.root / "notes").mkdir()
    (store.root / "ABCDEF123456").mkdir()
    (store.root / "README").write_text("hello", encoding="utf-8")

    assert store.list() == [record]


@pytest.mark.parametrize(
    "job_id",
    ["../../etc", "ABCDEF123456", "abc", "", "0123456789ab/..", "0123456789abc", 12],
    ids=["path", "upper-case", "short", "empty", "suffix", "long", "not-a-string"],
)
def test_a_bad_job_id_from_outside_is_refused(store: JobStore, job_id: object) -> None:
    for call in (store.get, store.job_folder, store.workspace, store.archive, store.update, store.delete):
        with pytest.raises(JobStoreError, match="bad job id .*: expected 12 lowercase hex digits"):
            call(job_id)  # type: ignore[arg-type]


def test_an_unknown_job_id_is_refused(store: JobStore) -> None:
    with pytest.raises(JobStoreError, match="^no job 0123456789ab$"):
        store.get("0123456789ab")


def test_update_refuses_an_unknown_status_and_leaves_the_record(store: JobStore, fedavg_zip: Path) -> None:
    record = submit(store, fedavg_zip)

    with pytest.raises(ValueError, match="'FINISHED'"):
        store.update(record.job_id, status="FINISHED")
    with pytest.raises(ValueError, match="BROKEN"):
        store.update(record.job_id, status=StoreStatus.BROKEN)

    assert store.get(record.job_id) == record


def test_concurrent_updates_leave_a_whole_record(store: JobStore, fedavg_zip: Path) -> None:
    record = submit(store, fedavg_zip)

    def work(i: int) -> None:
        for j in range(20):
            store.update(record.job_id, reason=f"thread {i} step {j}")

    threads = [threading.Thread(target=work, args=(i,)) for i in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=30)

    assert not any(t.is_alive() for t in threads)
    assert store.get(record.job_id).reason.endswith("step 19")
    assert [p.name for p in (store.root / record.job_id).iterdir() if p.name.endswith(".tmp")] == []


def test_only_a_finished_job_can_be_deleted(store: JobStore, fedavg_zip: Path) -> None:
    record = submit(store, fedavg_zip)

    with pytest.raises(JobStoreError, match="is SUBMITTED; only finished jobs can be deleted"):
        store.delete(record.job_id)
    store.update(record.job_id, status=StoreStatus.FINISHED_ABORTED)
    store.delete(record.job_id)

    assert store.list() == [] and list(store.root.iterdir()) == []


def test_a_record_round_trips_through_json() -> None:
    record = JobRecord(
        job_id="0123456789ab",
        name="fedavg",
        submitter="alice@a.org",
        submitter_org="a",
        status=StoreStatus.RUNNING,
        submitted_at=utc_now(),
        sites=["site-1"],
        port=8003,
    )

    assert JobRecord.from_json(json.loads(json.dumps(record.to_json()))) == record
    assert record.to_json()["status"] == "RUNNING"


def test_from_json_names_what_is_missing() -> None:
    with pytest.raises(JobStoreError, match="missing key 'submitter'"):
        JobRecord.from_json({"job_id": "0123456789ab", "name": "x"})


def test_the_runtime_states_are_store_statuses() -> None:
    assert {s.value for s in JobState} <= {s.value for s in StoreStatus}
    assert StoreStatus.FINISHED_REJECTED.is_final and not StoreStatus.RUNNING.is_final


def test_each_status_is_kept_with_its_time_and_an_end_not_known_has_none(store: JobStore, fedavg_zip: Path) -> None:
    record = submit(store, fedavg_zip)
    store.update(record.job_id, status=StoreStatus.RUNNING, started_at=utc_now())
    store.update(record.job_id, port=8003)  # no new status: nothing added
    store.recover()  # the server stopped while it ran: when it ended is not known

    states = store.get(record.job_id).states

    assert [entry["state"] for entry in states] == ["SUBMITTED", "RUNNING", "FINISHED_ABORTED"]
    assert states[0]["time"] == record.submitted_at
    assert states[0]["time"] < states[1]["time"] and states[2]["time"] is None
    # The start's time is the record's own: a duration from the states is the record's (a
    # summary's seconds once differed in the second decimal, read from two clocks).
    assert states[1]["time"] == store.get(record.job_id).started_at


def test_the_exits_of_several_processes_reported_at_once_are_all_kept(store: JobStore, fedavg_zip: Path) -> None:
    record = submit(store, fedavg_zip)
    names = [f"site-{n}" for n in range(8)]
    threads = [
        threading.Thread(target=store.record_exit, args=(record.job_id, name, n)) for n, name in enumerate(names)
    ]

    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(10)

    assert store.get(record.job_id).exit_codes == {name: n for n, name in enumerate(names)}


@pytest.mark.parametrize(
    ("key", "value"),
    [
        ("states", [{"state": 1, "time": None}]),
        ("states", [{"time": "2025-01-31T12:00:00+00:00"}]),
        ("states", "RUNNING"),
        ("exit_codes", {"site-1": "0"}),
        ("exit_codes", {"site-1": True}),
        ("exit_codes", ["site-1", 0]),
    ],
    ids=["state-not-a-string", "no-state", "not-a-list", "code-a-string", "code-a-bool", "not-a-dict"],
)
def test_a_record_with_malformed_states_or_exit_codes_is_refused(key: str, value: object) -> None:
    data = {"job_id": "0123456789ab", "name": "x", "submitter": "a", "submitter_org": "a", "status": "RUNNING"}

    with pytest.raises(JobStoreError, match=f"job record: {key}: unexpected value"):
        JobRecord.from_json({**data, "submitted_at": None, key: value})


def test_a_record_written_before_states_and_exit_codes_were_kept_still_loads() -> None:
    data = {"job_id": "0123456789ab", "name": "x", "submitter": "a", "submitter_org": "a", "status": "RUNNING"}

    record = JobRecord.from_json({**data, "submitted_at": None})

    assert (record.states, record.exit_codes) == ([], {})
