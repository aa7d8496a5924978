"""``python -m engine`` is the ``flengine`` command."""

from engine.cli import console_main

console_main()
