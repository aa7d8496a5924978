"""The Client API that training scripts use: ``from engine import client as flare``."""
