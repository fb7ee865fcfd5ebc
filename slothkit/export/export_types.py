"""The kinds of export slothkit writes, one record each: what the save dispatch
(slothkit.export.save), the model methods (slothkit.export.methods), `slothkit export --to`
(slothkit.export.adapter_export) and the tests read.

    name           written by / pushed by                          what it holds
    merged_16bit   save_pretrained_merged / push_to_hub_merged     base + LoRA merged, 16-bit
    merged_4bit    save_pretrained_merged / push_to_hub_merged     the same, bitsandbytes 4-bit
    lora           save_pretrained_merged / push_to_hub_merged     the adapter only
    gguf           save_pretrained_gguf / push_to_hub_gguf         GGUF files and Modelfiles

The functions are named, with the module that holds them, rather than imported here: the GGUF
writer is an optional part of slothkit (slothkit.export.methods binds its methods only where
it is installed), and the modules that read this table are the ones that define the others.
A type that save_pretrained_merged writes also has its folder writer in slothkit.export.save
(``FOLDER_WRITERS``, under the same name).
"""

from __future__ import annotations

import dataclasses
import importlib


@dataclasses.dataclass(frozen=True)
class ExportType:
    """One kind of export."""

    name: str  # save_method= of save_pretrained_merged, --to of `slothkit export`
    holds: str  # what the export holds, in words (the model card says it too)
    module: str  # the module of the two functions below
    save: str  # the function writing it into a folder, bound as the model method of that name
    push: str  # its Hub counterpart, bound likewise

    def function(self, name: str):
        """The function `name` (self.save or self.push) of self.module, imported now."""
        return getattr(importlib.import_module(self.module), name)


MERGED_MODULE = "slothkit.export"
GGUF_MODULE = "slothkit.export.gguf"

EXPORT_TYPES: dict[str, ExportType] = {
    export.name: export
    for export in (
        ExportType(
            "merged_16bit",
            "LoRA adapter merged into the base weights, saved unquantised",
            MERGED_MODULE,
            "save_pretrained_merged",
            "push_to_hub_merged",
        ),
        ExportType(
            "merged_4bit",
            "LoRA adapter merged into the base weights, saved re-quantised with bitsandbytes 4-bit",
            MERGED_MODULE,
            "save_pretrained_merged",
            "push_to_hub_merged",
        ),
        ExportType(
            "lora",
            "LoRA adapter only (standard PEFT format; load it on top of the base model)",
            MERGED_MODULE,
            "save_pretrained_merged",
            "push_to_hub_merged",
        ),
        ExportType(
            "gguf",
            "GGUF files, one per quantisation method, each with an Ollama Modelfile (llama.cpp, Ollama)",
            GGUF_MODULE,
            "save_pretrained_gguf",
            "push_to_hub_gguf",
        ),
    )
}

# save_method= of save_pretrained_merged and push_to_hub_merged.
SAVE_METHODS = tuple(name for name, export in EXPORT_TYPES.items() if export.save == "save_pretrained_merged")
# --to of `slothkit export` (slothkit.export.export_adapter).
EXPORT_TARGETS = tuple(EXPORT_TYPES)
