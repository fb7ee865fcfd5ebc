"""The ground floor: what every other wing of slothkit may use, importing none of them.

- model_state: the typed records slothkit attaches to the model instances it patches.
- inspection: the transformers model inside a PeftModel, whether it is 4-bit, its dtypes.
- notices: messages shown once per process, each in a category that says what it is.
- configuration: the one place that reads SLOTHKIT_* environment variables.
- environment: versions and accelerator of this machine, for reports and records.
- allocator: torch's CUDA allocator settings (expandable segments).
- distributed: what changes when a launcher starts one process per GPU.
- folder_paths, arguments: checked paths and command-line value types.
- version: slothkit's version.
"""
