"""The digits example: its data and model (``engine.examples.digits``) and its training script
(``engine.examples.train``).

One home for the code the example jobs share, so a fix lands once: ``flengine new`` copies
``train.py`` into a new job (to edit), the jobs under ``jobs/`` run it as a module, and every
persistor names the model by its dotted path (``engine.examples.digits.Net``). Nothing in the
engine imports this package.
"""
