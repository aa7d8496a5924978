"""Texts of a small valid job whose line numbers the tests rely on."""

from collections.abc import Callable
from pathlib import Path

MakeJob = Callable[..., Path]

META = """\
name = demo
min_clients = 2
deploy_map { app = ["@ALL"] }
"""

SERVER = """\
format_version = 2
tensor_download_chunk_size = 2097152
np_download_chunk_size = 2097152
streaming_per_request_timeout = 600
workflows = [
  { id = wf, path = model.Workflow, args { num_rounds = 2 } }
]
components = [
  { id = persistor, path = model.Persistor, args { model { path = model.Net, args { hidden = 8 } } } }
]
"""

CLIENT = """\
format_version = 2
executors = [
  { tasks = ["*"], executor { path = model.Executor, args { script = train.py } } }
]
"""

MODEL = '''\
"""Job code of the test job."""
from typing import Literal

VALUE = 3


class Workflow:
    def __init__(self, num_rounds: int, persistor_id: str = "persistor", weights: dict[str, float] | None = None):
        self.num_rounds = num_rounds
        self.persistor_id = persistor_id


class Net:
    def __init__(self, hidden: int = 8):
        self.hidden = hidden


class Persistor:
    def __init__(self, model: Net):
        self.model = model


class Executor:
    def __init__(self, script: str, mode: Literal["in_process", "subprocess"] = "in_process"):
        self.script = script
        self.mode = mode
'''

BASE_FILES = {
    "meta.conf": META,
    "app/config/config_fed_server.conf": SERVER,
    "app/config/config_fed_client.conf": CLIENT,
    "app/custom/model.py": MODEL,
}
