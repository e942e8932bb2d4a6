"""Models the harness trains: Llama presets (project code or HF transformers) and synthetic token batches."""

from autosp.models.build import build_model, parameter_count
from autosp.models.presets import ModelPreset, get_preset, model_names

__all__ = ["ModelPreset", "build_model", "get_preset", "model_names", "parameter_count"]
