"""Checks and choices made before a model is loaded, so that mistakes surface as
clear messages rather than as errors deep inside transformers or bitsandbytes."""

from __future__ import annotations

import importlib.util
import json
import logging
import os
import pathlib

import torch

ALL_PROJECTIONS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]

# bitsandbytes' CPU backend, when bitsandbytes is first imported (by peft in get_peft_model,
# by transformers for a 4-bit load) on a CPU with AVX512-BF16, tries to fetch an optional
# matmul kernel from the Hugging Face Hub through the `kernels` package and logs this when
# it cannot.  bitsandbytes then uses its own CPU code, which is what slothkit expects; the
# line asks a notebook user for a package nothing here needs.
BITSANDBYTES_CPU_LOGGER = "bitsandbytes.backends.cpu.ops"
BITSANDBYTES_KERNEL_NOTICE = "Failed to load CPU gemm_4bit_forward from kernels-community"
# Where the `kernels` package is installed (transformers 5.25 depends on it), that fetch
# offline logs this from the package instead, about the same optional kernel.
KERNELS_HUB_LOGGER = "kernels._internals.hf_hub"
KERNELS_OFFLINE_NOTICE = "Skipping publisher trust check for 'kernels-community/quantization-bitsandbytes'"
KERNEL_NOTICES = {
    BITSANDBYTES_CPU_LOGGER: BITSANDBYTES_KERNEL_NOTICE,
    KERNELS_HUB_LOGGER: KERNELS_OFFLINE_NOTICE,
}


class _WithoutKernelNotice(logging.Filter):
    """Drops the records that start with `notice`; every other record of the logger passes."""

    def __init__(self, notice: str):
        super().__init__()
        self.notice = notice

    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith(self.notice)


def quiet_bitsandbytes_kernel_notice() -> None:
    """Filter each of KERNEL_NOTICES out of its logger, once; a logger exists (and keeps
    the filter) before the library that logs to it is imported."""
    for name, notice in KERNEL_NOTICES.items():
        logger = logging.getLogger(name)
        if not any(isinstance(f, _WithoutKernelNotice) for f in logger.filters):
            logger.addFilter(_WithoutKernelNotice(notice))


quiet_bitsandbytes_kernel_notice()  # every model load imports this module first


def pick_dtype(dtype: torch.dtype | str | None) -> torch.dtype:
    """None: bf16 where the GPU has it, fp16 on T4/V100-class GPUs, fp32 on CPU."""
    if isinstance(dtype, str):
        names = {
            "bfloat16": torch.bfloat16,
            "bf16": torch.bfloat16,
            "float16": torch.float16,
            "fp16": torch.float16,
            "half": torch.float16,
            "float32": torch.float32,
            "fp32": torch.float32,
        }
        if dtype not in names:
            raise ValueError(f"dtype={dtype!r}; accepted: None, {', '.join(names)} or a torch dtype")
        dtype = names[dtype]
    if dtype is None:
        if not torch.cuda.is_available():
            return torch.float32
        return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
    if dtype not in (torch.float32, torch.float16, torch.bfloat16):
        raise ValueError(f"dtype={dtype}; accepted: torch.float32, torch.float16, torch.bfloat16")
    if dtype == torch.bfloat16 and torch.cuda.is_available() and not torch.cuda.is_bf16_supported():
        name = torch.cuda.get_device_name()
        raise ValueError(
            f"dtype=torch.bfloat16 was asked for, but {name} has no bfloat16 support; "
            f"use dtype=torch.float16 (or dtype=None to choose automatically)"
        )
    return dtype


def is_bfloat16_supported() -> bool:
    """Whether this machine trains in bfloat16 on a GPU: False on the CPU (transformers
    refuses bf16=True there without use_cpu=True) and on GPUs without bf16 (T4, V100)."""
    return torch.cuda.is_available() and torch.cuda.is_bf16_supported()


is_bf16_supported = is_bfloat16_supported  # the spelling Unsloth's vision notebooks import


def nf4_settings(compute_dtype: torch.dtype) -> dict:
    """QLoRA's bitsandbytes settings, as ``BitsAndBytesConfig`` keywords: NF4 with double
    quantisation (the absmax constants quantised too), packed two values per uint8."""
    return dict(
        load_in_4bit=True,
        bnb_4bit_quant_type="nf4",
        bnb_4bit_use_double_quant=True,
        bnb_4bit_compute_dtype=compute_dtype,
        bnb_4bit_quant_storage=torch.uint8,
    )


def require_bitsandbytes() -> None:
    if importlib.util.find_spec("bitsandbytes") is None:
        raise ImportError(
            "load_in_4bit=True needs bitsandbytes, which is not installed: "
            "`pip install bitsandbytes`, or pass load_in_4bit=False to train in 16-bit"
        )


def check_local_checkpoint(folder: str | os.PathLike) -> None:
    """Refuse a local checkpoint folder whose config.json or weight files cannot be read,
    naming the file, what is wrong with it and what to do, before transformers tries (its
    own messages say "no such file" for a file that is there but unreadable or damaged).

    Args:
        folder: a folder holding config.json and weights.

    Raises:
        ValueError: config.json is not a JSON object; a safetensors file is cut short.
        PermissionError: a file cannot be read.
        FileNotFoundError: a weights file is a link to nothing.
    """
    folder = pathlib.Path(folder)
    config = folder / "config.json"
    try:
        text = config.read_text(encoding="utf-8")
        parsed = json.loads(text)
    except ValueError as error:  # JSONDecodeError, UnicodeDecodeError
        raise ValueError(
            f"{str(config)!r} is not valid JSON ({error}); the checkpoint's config is damaged: "
            f"restore it from where the checkpoint came from"
        ) from None
    except OSError as error:
        raise _unreadable(config, error) from None
    if not isinstance(parsed, dict):
        raise ValueError(f"{str(config)!r} holds a JSON {type(parsed).__name__}, not the object a config is")
    for path in sorted([*folder.glob("*.safetensors"), *folder.glob("*.bin")]):
        if path.is_symlink() and not path.exists():
            raise FileNotFoundError(
                f"the weights file {str(path)!r} is a link to {os.readlink(path)!r}, which does not exist; "
                f"fetch the checkpoint again"
            )
        if path.suffix == ".safetensors":
            check_safetensors_complete(path)
        else:
            try:
                with open(path, "rb"):
                    pass
            except OSError as error:
                raise _unreadable(path, error) from None


def check_safetensors_complete(path: pathlib.Path) -> None:
    """Refuse a safetensors file cut short or overwritten, before safetensors says
    "incomplete metadata" about it.

    The file is the length of its JSON header (8 bytes, little-endian), the header (each
    tensor's dtype, shape and byte range), then the tensors' bytes: complete when the
    header parses and the last tensor's range ends inside the file.  Reading the header
    costs a few kilobytes per shard.
    """
    size = path.stat().st_size

    def incomplete(expected: str = "") -> ValueError:
        return ValueError(
            f"the weights file {str(path)!r} is not a complete safetensors file ({size} bytes{expected}); "
            f"the download or save that wrote it did not finish: fetch or save it again"
        )

    try:
        with open(path, "rb") as file:
            head = file.read(8)
            length = int.from_bytes(head, "little")
            if len(head) < 8 or length > size - 8:
                raise incomplete()
            header = file.read(length)
    except OSError as error:
        raise _unreadable(path, error) from None
    try:
        entries = json.loads(header)
        ends = [entry["data_offsets"][1] for name, entry in entries.items() if name != "__metadata__"]
    except (ValueError, TypeError, KeyError, IndexError, AttributeError, RecursionError):
        raise ValueError(
            f"the weights file {str(path)!r} is not a safetensors file: its header is not the JSON "
            f"table of tensors safetensors writes (the file was overwritten or is of another kind); "
            f"fetch or save it again"
        ) from None
    needed = 8 + length + max(ends, default=0)
    if needed > size:
        raise incomplete(f" of the {needed} its header lists")


def _unreadable(path: pathlib.Path, error: OSError) -> OSError:
    reason = error.strerror or str(error)
    if isinstance(error, PermissionError):
        return PermissionError(
            f"cannot read {str(path)!r}: {reason}; make it readable (chmod a+r) or copy the checkpoint "
            f"to a folder you own"
        )
    return OSError(error.errno, f"cannot read {str(path)!r}: {reason}")


def resolve_checkpoint(name_or_path: str, token=None, **config_kwargs):
    """Load the config, turning a missing path or unknown Hub id into one clear error."""
    from transformers import AutoConfig

    if os.path.isdir(name_or_path):
        if not os.path.isfile(os.path.join(name_or_path, "config.json")):
            raise FileNotFoundError(
                f"{name_or_path!r} is a directory but has no config.json: it is not a "
                f"transformers checkpoint (expected config.json and weights)"
            )
        check_local_checkpoint(name_or_path)
    elif os.path.exists(name_or_path):
        raise ValueError(f"{name_or_path!r} is a file; pass the checkpoint's directory or a Hub id")
    try:
        return AutoConfig.from_pretrained(name_or_path, token=token, **config_kwargs)
    except (OSError, ValueError) as error:
        if os.path.isdir(name_or_path):  # there, and readable: transformers refused its config
            raise ValueError(f"cannot load the config of {name_or_path!r}: {error}") from None
        looks_local = (
            name_or_path.startswith((".", "/", "~")) or os.sep in name_or_path.strip("/").split("/", 1)[-1]
        )
        where = "no such directory" if looks_local else "not found locally or on the Hugging Face Hub"
        raise FileNotFoundError(
            f"cannot load model {name_or_path!r}: {where}. Check the spelling, that the "
            f"path exists, or for gated/private Hub models pass token=... "
            f"(underlying error: {error})"
        ) from None


# Linear RoPE scaling (position interpolation, Chen et al. 2023, arXiv:2306.15595) divides
# every position by factor = max_seq_length / context, so the longest sequence spans the
# rotation angles the model was trained on; they fine-tuned LLaMA to 16 times its context
# this way, the most slothkit stretches a model to.
MAX_ROPE_FACTOR = 16


def check_max_seq_length(config, max_seq_length: int, extends: bool = False) -> None:
    """Refuse a max_seq_length that is not a positive integer or that exceeds the model's
    context (config.max_position_embeddings); with `extends`, one that exceeds what
    extend_context can reach.

    Args:
        config: the model's transformers config.
        max_seq_length: the longest sequence to train on, or None (no check).
        extends: whether a longer max_seq_length will extend the context (from_pretrained
            does, before the model is built; later its RoPE is fixed).
    """
    if max_seq_length is None:
        return
    if not isinstance(max_seq_length, int) or max_seq_length <= 0:
        raise ValueError(f"max_seq_length={max_seq_length!r}; expected a positive integer")
    context = getattr(config, "max_position_embeddings", None)
    if context is None or max_seq_length <= context:
        return
    if not extends:
        raise ValueError(
            f"max_seq_length={max_seq_length} exceeds this model's context of {context} tokens "
            f"(config.max_position_embeddings). Use max_seq_length <= {context} here, or pass the "
            f"longer one to from_pretrained, which extends the context with RoPE scaling."
        )
    if max_seq_length > MAX_ROPE_FACTOR * context:
        raise ValueError(
            f"max_seq_length={max_seq_length} exceeds this model's context of {context} tokens "
            f"(config.max_position_embeddings) more than {MAX_ROPE_FACTOR} times over, the most linear "
            f"RoPE scaling stretches it; use max_seq_length <= {MAX_ROPE_FACTOR * context}"
        )
    params = getattr(config, "rope_parameters", None) or {}
    if params.get("rope_type", "default") != "default" or "rope_theta" not in params:
        raise ValueError(
            f"max_seq_length={max_seq_length} exceeds this model's context of {context} tokens "
            f"(config.max_position_embeddings), and its RoPE is not a plain one slothkit can scale "
            f"(rope_parameters={params}); use max_seq_length <= {context}"
        )


def extend_context(config, max_seq_length: int | None) -> bool:
    """Scale RoPE linearly on `config` when max_seq_length exceeds its context, as Unsloth
    does, saying so once; the model built from the config then attends over
    max_seq_length positions (and its saved config and GGUF files say so).

    Args:
        config: the model's transformers config, changed in place; checked first
            (check_max_seq_length with extends=True).
        max_seq_length: the longest sequence to train on, or None.

    Returns:
        Whether the config was changed.
    """
    from slothkit.core.notices import SettingChangedWarning, say_once

    check_max_seq_length(config, max_seq_length, extends=True)
    context = getattr(config, "max_position_embeddings", None)
    if max_seq_length is None or context is None or max_seq_length <= context:
        return False
    factor = max_seq_length / context
    config.rope_parameters = {**config.rope_parameters, "rope_type": "linear", "factor": factor}
    config.max_position_embeddings = max_seq_length
    say_once(
        f"max_seq_length={max_seq_length} exceeds this model's context of {context} tokens: RoPE is "
        f"scaled linearly by {factor:g} (rope_parameters: rope_type='linear', factor={factor:g}) to reach it",
        SettingChangedWarning,
    )
    return True


def matching_modules(model, target_modules) -> list[str]:
    names = []
    for name, _ in model.named_modules():
        leaf = name.rsplit(".", 1)[-1]
        if leaf in target_modules:
            names.append(name)
    return names


def linear_module_leaves(model) -> list[str]:
    leaves = set()
    for name, module in model.named_modules():
        if isinstance(module, torch.nn.Linear) or type(module).__name__ in ("Linear4bit", "Linear8bitLt"):
            leaves.add(name.rsplit(".", 1)[-1])
    return sorted(leaves)
