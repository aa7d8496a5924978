"""The JSON Schemas of flengine's job files, installed as the package data ``engine.schemas``.

This folder is the top-level ``schemas/`` of the repository; ``pyproject.toml`` maps it to
``engine.schemas`` so the schemas travel inside the wheel. ``engine.config.schema`` loads them.
"""
