"""What slothkit's notebooks call: runtime set-up, the config panel, rendering templates."""

from slothkit.notebook.config import NotebookConfig
from slothkit.notebook.runtime import detect_runtime, prepare_runtime

__all__ = ["NotebookConfig", "detect_runtime", "prepare_runtime"]
