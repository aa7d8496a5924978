"""The job folders that ``flengine new`` writes: data only, no code of the engine.

``fedavg/``, ``swarm/`` and ``cse/`` each hold a ``meta.conf`` and ``app/config/``; the training
script they share is the digits example's (``engine/examples/train.py``), copied into the new
job's ``app/custom/``. `engine.config.new_job` writes them.
"""
