"""Job folders: reading HOCON/JSON configs, checking them against the schemas, building components.

The public calls:

- `load_job` / `inspect_job` / `validate_job`: a whole job folder.
- `load_config`: one ``.conf`` or ``.json`` file, as plain data that remembers its lines.
- `build_component` / `check_component`: one ``{id, path, args}`` entry, built or dry-built.
- `job_code_on_path`: the app's ``custom/`` folder importable for the duration of a block.
- `job_code_of`: why a job brings its own code (``custom/`` files, classes outside flengine's).
"""

from engine.config.build import ComponentSpec, build_component, check_component
from engine.config.job import AppConfig, Job, inspect_job, load_job, validate_job
from engine.config.jobcode import job_code_on_path
from engine.config.problems import KeyPath, Problem
from engine.config.source import ConfigDocument, load_config
from engine.config.trust import job_code_of

__all__ = [
    "AppConfig",
    "ComponentSpec",
    "ConfigDocument",
    "Job",
    "KeyPath",
    "Problem",
    "build_component",
    "check_component",
    "inspect_job",
    "job_code_of",
    "job_code_on_path",
    "load_config",
    "load_job",
    "validate_job",
]
