"""Example data and models the bundled jobs import (``engine.examples.digits``).

One home for the code every example job shares, so a fix lands once: each job folder keeps
only its training script in ``app/custom/`` and names the model by its dotted path
(``engine.examples.digits.Net``). Nothing in the engine imports this package.
"""
