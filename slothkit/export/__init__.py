"""Saving and publishing fine-tuned models.

    from slothkit.export import save_pretrained_merged, push_to_hub_merged
    save_pretrained_merged(model, "out/merged", tokenizer, save_method="merged_16bit")
    push_to_hub_merged(model, "me/my-model", tokenizer, save_method="lora")

or, on a model passed through `attach_export_methods` (FastModel does this):

    model.save_pretrained_merged("out/merged", tokenizer, save_method="merged_4bit")

GGUF export lives in slothkit.export.gguf.
"""

from slothkit.export.adapter_export import export_adapter
from slothkit.export.atomic import DirectoryNotEmptyError, atomic_directory
from slothkit.export.export_types import EXPORT_TARGETS, SAVE_METHODS
from slothkit.export.hub import (
    HubAuthError,
    HubConnectionError,
    PushResult,
    push_folder_to_hub,
    push_to_hub_merged,
)
from slothkit.export.merge import MergeSource, merged_state_dict
from slothkit.export.methods import attach_export_methods
from slothkit.export.save import SaveResult, save_pretrained_merged

__all__ = [
    "EXPORT_TARGETS",
    "SAVE_METHODS",
    "DirectoryNotEmptyError",
    "HubAuthError",
    "HubConnectionError",
    "MergeSource",
    "PushResult",
    "SaveResult",
    "atomic_directory",
    "attach_export_methods",
    "export_adapter",
    "merged_state_dict",
    "push_folder_to_hub",
    "push_to_hub_merged",
    "save_pretrained_merged",
]
