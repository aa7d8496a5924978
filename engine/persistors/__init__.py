"""Model persistors: the initial model, and checkpoints written atomically as safetensors."""

from engine.persistors.checkpoint_files import write_safetensors_atomic
from engine.persistors.persistor import ModelPersistor
from engine.persistors.pt_file import PTFileModelPersistor

__all__ = ["ModelPersistor", "PTFileModelPersistor", "write_safetensors_atomic"]
