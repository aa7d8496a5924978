"""``python -m engine`` is the ``flengine`` command."""

import sys

from engine.cli import main

sys.exit(main())
