"""The job folders that ``flengine new`` writes: data only, no code of the engine.

``fedavg/``, ``swarm/`` and ``cse/`` each hold a ``meta.conf`` and ``app/config/``; ``custom/`` is
the job code every template shares (the digits MLP and its training script), copied into the
new job's ``app/custom/``. `engine.config.new_job` writes them.
"""
