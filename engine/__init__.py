"""flengine: a declarative, config-driven federated-learning job engine."""

__version__ = "0.1.0"
