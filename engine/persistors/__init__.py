"""Model persistors: the initial model, and checkpoints written atomically as safetensors."""
