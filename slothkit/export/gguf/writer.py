"""GGUF export, written by slothkit itself: no llama.cpp checkout, compiler or binary needed.

    from slothkit.export.gguf import save_pretrained_gguf, push_to_hub_gguf
    paths = save_pretrained_gguf(model, "out/gguf", tokenizer, quantization_method=["q4_k_m", "q8_0"])
    # out/gguf/Llama-3.2-1B.Q4_K_M.gguf, out/gguf/Llama-3.2-1B.Q8_0.gguf, out/gguf/Modelfile.Q4_K_M, ...

Files and general.name (what Ollama and LM Studio show) are named after the model
(model_name: its config's _name_or_path, for a merged LoRA model the base model's), or after
the output folder when the model has no name.

`model` is a plain (merged, 16- or 32-bit) transformers model of a supported architecture;
slothkit.export.merge turns a LoRA/QLoRA model into one. Where each weight goes and how it is
transformed on the way (llama.cpp's convert_hf_to_gguf.py, architecture by architecture):
slothkit.export.gguf.layout, from the model's architecture record (slothkit.models).

Metadata (slothkit.export.gguf.metadata): the hyperparameters llama.cpp builds its graph from,
and the tokenizer as described in slothkit.export.gguf.tokenizer. Mistral's sliding window is
written but llama.cpp's llama graph does not apply it (as with its own converter), so the
GGUF matches HF up to the window length; Gemma 3, Gemma 2 and gpt-oss (records with
windowed_layers) add which layers slide and their rope base, Gemma 2 its two soft-caps
(slothkit.export.gguf.attention), gpt-oss its YaRN scaling (slothkit.export.gguf.yarn), and
are refused where llama.cpp would compute another attention than HF's.

Which tensor gets which type: slothkit.export.gguf.tensor_types. K-quants are encoded in torch on the GPU when
there is one (kquants), everything else with the `gguf` package.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import os
import pathlib
import re
import tempfile
import warnings
from collections.abc import Iterator, Sequence

import numpy as np
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFWriter
from gguf.quants import quant_shape_to_byte_shape

from slothkit.checkpoint.finite import finite_tensors
from slothkit.export.atomic import DirectoryNotEmptyError, atomic_directory
from slothkit.export.disk_space import (
    NotEnoughSpaceError,
    check_free_space,
    free_space,
    is_disk_full,
    megabytes,
)
from slothkit.export.gguf import gemma4, image_text, mmproj
from slothkit.export.gguf import tensor_types as types
from slothkit.export.gguf.experts import Piece, check_experts, cut
from slothkit.export.gguf.layout import architecture_of, gguf_pieces, gguf_shape, to_gguf
from slothkit.export.gguf.metadata import (
    HyperParameters,
    hyperparameters,
    llama3_rope_divisors,
    write_metadata,
)
from slothkit.export.gguf.modelfile import write_modelfile
from slothkit.export.gguf.tensor_types import QuantizationMethod, quantization_methods
from slothkit.export.gguf.tokenizer import gguf_vocab
from slothkit.export.hub import DEFAULT_STALL_TIMEOUT_S
from slothkit.models import RECORDS, Architecture

T = GGMLQuantizationType


# ---------------------------------------------------------------------------------------
# Public API
# ---------------------------------------------------------------------------------------


def save_pretrained_gguf(
    model,
    save_directory: str | os.PathLike,
    tokenizer,
    quantization_method: str | QuantizationMethod | Sequence[str | QuantizationMethod] = "q8_0",
    verify: bool | None = None,
    overwrite: bool = False,
) -> list[pathlib.Path]:
    """Write `model` as one GGUF file per quantisation method, each with an Ollama Modelfile.

    The folder appears only when every file is written (and verified).

    Args:
        model: a plain (merged, 16- or 32-bit) transformers model of a supported architecture
            (llama, mistral, gemma, qwen2, qwen3, gemma3_text, gemma2, phi3, ministral,
            qwen3_5_text, gemma4_text, and the mixture-of-experts qwen3_moe, gpt_oss, mixtral and
            qwen3_5_moe_text), or the image-text gemma3 and qwen2_5_vl (below); slothkit.export.merge turns a
            LoRA/QLoRA model into one, the experts' LoRA updates included.
        save_directory: the folder to write; its name is the stem of the file names when the
            model has none (model_name).
        tokenizer: the model's tokenizer; its vocabulary and chat template go into the files.
        quantization_method: "f32", "f16", "bf16", "q8_0", "q4_0", "q4_k_m", "q5_k_m" or "q6_k"
            (any case), several as a list or separated by commas ("q4_k_m,q8_0"), or
            QuantizationMethod values (tensor_types.quantization_methods).
        verify: load each file with llama-cpp-python and compare its logits and greedy tokens
            with the model (slothkit.export.gguf.verify); None: when llama-cpp-python is
            installed.
        overwrite: replace files of the same names from an earlier save; refused
            otherwise.  Other files in the folder are always kept: a second call with
            another quantisation adds its files beside the first one's, and GGUF files
            may go beside a merged model's.

    An image-text model (Gemma3ForConditionalGeneration or Qwen2_5_VLForConditionalGeneration,
    merged) is written as two kinds of file: its language model's GGUF per method, as the
    text family's (Qwen2.5-VL's as llama.cpp's qwen2vl graph), and one projector file `mmproj-<name>.F16.gguf` for llama.cpp's libmtmd (slothkit.export.gguf.mmproj;
    F16, or F32 when every method is f32), verified with libmtmd against the model's image
    features (slothkit.export.gguf.verify_mmproj). Other image-text families are refused by
    name before any work. `tokenizer` may be the processor.

    Returns:
        The written paths: the GGUF files in the order asked, the projector file of an
        image-text model, then the Modelfiles. With one
        method into a folder without GGUF files the Modelfile is `Modelfile`; otherwise
        `Modelfile.<LABEL>` for each.
    """
    methods = quantization_methods(quantization_method)
    vision_model = None
    if image_text.is_image_text_model(model):  # refused by name before any work
        mmproj.check_projector_family(model.config)
        _check_plain_model(model)
        vision_model, processor = model, tokenizer
        model, tokenizer = image_text.language_model_of(model), image_text.text_tokenizer(tokenizer)
    arch = architecture_of(model)
    _check_plain_model(model)
    target = pathlib.Path(save_directory).expanduser()
    if target.exists() and not target.is_dir():
        raise NotADirectoryError(f"{str(target)!r} exists and is a file; the save target must be a directory")
    stem = model_name(model, fallback=target.name or "model")
    gguf_names = [f"{stem}.{method.label}.gguf" for method in methods]
    modelfile_names = _modelfile_names(target, gguf_names, methods)
    # F16 (llama.cpp's converter's default for projectors) unless every file is F32.
    mmproj_type = T.F32 if all(method.name == "f32" for method in methods) else T.F16
    mmproj_names = [mmproj.mmproj_file_name(stem, mmproj_type)] if vision_model is not None else []
    clashes = [name for name in gguf_names + mmproj_names + modelfile_names if (target / name).exists()]
    if clashes and not overwrite:  # before any work
        raise DirectoryNotEmptyError(
            f"{str(target)!r} already holds {', '.join(clashes)} from an earlier save; pass "
            f"overwrite=True to replace them (the folder's other files are kept), or choose a new folder"
        )
    planned = planned_bytes(model, methods, arch)
    if vision_model is not None:
        planned += mmproj.planned_bytes(vision_model, mmproj_type)
    check_free_space(target, planned, f"the GGUF files ({', '.join(gguf_names + mmproj_names)})")
    if verify is None:
        from slothkit.export.gguf.verify import llama_cpp_available

        verify = llama_cpp_available()

    with atomic_directory(target, overwrite=True, keep_unwritten_files=True) as staging:
        for method, name in zip(methods, gguf_names):
            write_gguf(model, staging / name, tokenizer, method, arch=arch, name=stem)
            if verify:
                from slothkit.export.gguf.verify import verify_gguf

                verify_gguf(staging / name, model, tokenizer, method)
        for name in mmproj_names:
            mmproj.write_mmproj(vision_model, staging / name, processor, mmproj_type, name=stem)
            if verify:
                from slothkit.export.gguf.verify_mmproj import verify_mmproj

                verify_mmproj(staging / name, staging / gguf_names[0], vision_model, mmproj_type)
        for name, modelfile in zip(gguf_names, modelfile_names):
            write_modelfile(staging / modelfile, name, tokenizer, _stop_token_ids(model))
    return [target / name for name in gguf_names + mmproj_names + modelfile_names]


def _modelfile_names(target: pathlib.Path, gguf_names: list[str], methods) -> list[str]:
    """`Modelfile` for a lone GGUF file; `Modelfile.<LABEL>` per file when there are several,
    in this save or beside earlier GGUF files in the folder (whose `Modelfile` stays theirs,
    unless it is this file's own from an earlier save)."""
    if len(methods) == 1:
        earlier = target.is_dir() and any(  # a projector file (mmproj-*) runs with its model's
            p.suffix == ".gguf" and p.name != gguf_names[0] and not p.name.startswith("mmproj-")
            for p in target.iterdir()
        )
        modelfile = target / "Modelfile"
        own = modelfile.is_file() and modelfile.read_text(errors="replace").startswith(
            f"FROM ./{gguf_names[0]}\n"
        )
        if own or not earlier:
            return ["Modelfile"]
    return [f"Modelfile.{method.label}" for method in methods]


def push_to_hub_gguf(
    model,
    repo_id: str,
    tokenizer,
    quantization_method: str | QuantizationMethod | Sequence[str | QuantizationMethod] = "q8_0",
    token: str | None = None,
    private: bool = False,
    *,
    verify: bool | None = None,
    endpoint: str | None = None,
    commit_message: str | None = None,
    stall_timeout_s: float | None = DEFAULT_STALL_TIMEOUT_S,
    use_xet: bool = False,
):
    """Write the GGUF files and Modelfile(s) as save_pretrained_gguf does, into a temporary
    folder, and upload it to `repo_id` in one commit.

    The upload is slothkit.export.hub.push_folder_to_hub: the repo is created if missing and
    transient errors are retried. The token and the methods are checked before any work.
    Files already in the repo stay (other quantisations, a merged model), except those this
    push replaces.

    Args:
        model: as for save_pretrained_gguf.
        repo_id: the Hub repository, "user/name".
        tokenizer: as for save_pretrained_gguf.
        quantization_method: as for save_pretrained_gguf.
        token: a Hub token with write access; default HF_TOKEN or the saved login.
        private: create the repository private (when it does not exist yet).
        verify: as for save_pretrained_gguf.
        endpoint: another Hub; by default huggingface_hub's, i.e. HF_ENDPOINT or huggingface.co.
        commit_message: default "Upload GGUF (<labels>) with slothkit".
        stall_timeout_s: seconds the push may go without a byte sent to or received from
            the Hub, across every request and retry; then it gives up with
            HubConnectionError saying what had been uploaded; pushing again resumes
            (default 180; as for push_folder_to_hub); None: no limit.
        use_xet: as for push_folder_to_hub: True uploads through Xet where
            huggingface_hub would, outside stall_timeout_s; False (default): through the
            Hub's LFS API.

    Returns:
        The hub module's PushResult.
    """
    from huggingface_hub import HfApi

    from slothkit.export.hub import check_repo_id, hub_session, push_folder_to_hub, resolve_token
    from slothkit.export.hub_options import HubOptions

    check_repo_id(repo_id)
    methods = quantization_methods(quantization_method)  # refuse bad input before any work
    if image_text.is_image_text_model(model):
        mmproj.check_projector_family(model.config)
    else:
        architecture_of(model)
    with hub_session(HubOptions(stall_timeout_s=stall_timeout_s), repo_id):
        token = resolve_token(token, HfApi(endpoint=endpoint))
    labels = ", ".join(m.label for m in methods)
    with tempfile.TemporaryDirectory(prefix="slothkit-gguf-") as scratch:
        folder = pathlib.Path(scratch) / repo_id.rsplit("/", 1)[-1]
        save_pretrained_gguf(model, folder, tokenizer, methods, verify=verify)
        return push_folder_to_hub(
            folder,
            repo_id,
            token=token,
            private=private,
            commit_message=commit_message or f"Upload GGUF ({labels}) with slothkit",
            endpoint=endpoint,
            replace_model_files=False,
            stall_timeout_s=stall_timeout_s,
            use_xet=use_xet,
        )


def write_gguf(
    model,
    path: str | os.PathLike,
    tokenizer,
    method: str | QuantizationMethod,
    *,
    arch: Architecture | None = None,
    name: str | None = None,
) -> pathlib.Path:
    """Write one GGUF file (no Modelfile, no verification, not atomic); return its path.

    Args:
        model: as for save_pretrained_gguf.
        path: the file to write.
        tokenizer: the model's tokenizer.
        method: the quantisation: a name ("q8_0") or a parsed QuantizationMethod.
        arch: the architecture record whose layout to write; by default the model's own
            (the tests pass a wrong one on purpose, to see verification catch it).
        name: general.name, the name model runners show; None: model_name(model), else
            the file name up to its first dot.
    """
    method = types.quantization_method(method)
    arch = arch or architecture_of(model)
    _check_plain_model(model)
    hp, plan = _plan(model, method, arch)
    device = _quantization_device(model)

    path = pathlib.Path(path)
    vocab = gguf_vocab(tokenizer, hp.vocab_size, _stop_token_ids(model))
    writer = GGUFWriter(path, arch.gguf.arch)
    write_metadata(writer, hp, method, name=name or model_name(model, fallback=path.name.split(".")[0]))
    vocab.write(writer)
    for tensor in plan:
        nbytes = types.encoded_nbytes(tensor.qtype, tensor.shape)
        if tensor.qtype in (T.F32, T.F16):
            dtype = np.float32 if tensor.qtype == T.F32 else np.float16
            writer.add_tensor_info(tensor.name, tensor.shape, dtype, nbytes, raw_dtype=tensor.qtype)
        else:
            byte_shape = quant_shape_to_byte_shape(tensor.shape, tensor.qtype)
            writer.add_tensor_info(tensor.name, byte_shape, np.uint8, nbytes, raw_dtype=tensor.qtype)
    fallbacks = [t for t in plan if t.qtype != t.intended]
    if fallbacks:
        _warn_about_fallbacks(path.name, method, fallbacks, [t.qtype for t in plan])

    folder, free = free_space(path.parent)
    try:
        writer.write_header_to_file(path)
        writer.write_kv_data_to_file()
        writer.write_ti_data_to_file()
        qtypes = {t.name: t.qtype for t in plan}
        stored_as = {name: torch.float16 for name, qtype in qtypes.items() if qtype == T.F16}
        produced = ((t.name, t.produce()) for t in plan)  # one tensor in memory at a time
        for tensor_name, tensor in finite_tensors(produced, f"the GGUF file {path.name}", stored_as):
            writer.write_tensor_data(types.encode(tensor, qtypes[tensor_name], device))
        writer.close()
    except BaseException as error:
        with contextlib.suppress(OSError):  # the file is abandoned; its flush may fail again
            writer.close()
        if is_disk_full(error):  # numpy's own words are "12288 requested and 8392 written"
            raise NotEnoughSpaceError(
                f"no space left in {str(folder)!r} while writing {path.name}: it needs about "
                f"{megabytes(_file_bytes(plan))} and {megabytes(free)} were free when it was started; "
                f"free some space or write to a folder on a larger disk",
            ) from error
        raise
    return path


@dataclasses.dataclass(frozen=True)
class _PlannedTensor:
    name: str  # in the file
    produce: object  # () -> the tensor in GGUF layout, made when written
    shape: tuple[int, ...]
    qtype: GGMLQuantizationType  # the type it is stored in
    intended: GGMLQuantizationType  # the type the method's mix gives it (qtype unless it fell back)


def _plan(
    model, method: QuantizationMethod, arch: Architecture
) -> tuple[HyperParameters, list[_PlannedTensor]]:
    """The file's tensors in order, with the type each is stored in."""
    hp = hyperparameters(model.config, arch)
    tensors = list(_gguf_tensors(model, arch, hp))
    tied = arch.gguf.output_always_tied or not any(name == "output.weight" for name, *_ in tensors)
    values = types.value_positions([name for name, *_ in tensors], arch.gguf.deltanet)
    plan = []
    for name, produce, shape, layer in tensors:
        # an attn_v's layer and the layer count, as llama-quantize counts them
        position, count = values.get(name, (layer, hp.n_layers))
        intended = types.mix_type(
            method,
            name,
            shape,
            layer=position,
            n_layers=count,
            output_tied_to_embeddings=tied,
            deltanet=arch.gguf.deltanet,
        )
        qtype = intended if intended == T.F32 else types.fallback_type(intended, shape[-1])
        plan.append(_PlannedTensor(name, produce, shape, qtype, intended))
    return hp, plan


def _file_bytes(plan: list[_PlannedTensor]) -> int:
    """The tensor data of a file (its header and vocabulary are small beside it)."""
    return sum(types.encoded_nbytes(t.qtype, t.shape) for t in plan)


def planned_bytes(model, methods: Sequence[QuantizationMethod], arch: Architecture | None = None) -> int:
    """What the GGUF files of `methods` take on disk, from the types their tensors get."""
    arch = arch or architecture_of(model)
    return sum(_file_bytes(_plan(model, method, arch)[1]) for method in methods)


def _warn_about_fallbacks(file_name: str, method, fallbacks: list[_PlannedTensor], qtypes: list) -> None:
    """Say what a file holds when some weights could not get the type their mix names.

    A K-quant block spans 256 values of a row, the others 32; a row of another length gets
    llama-quantize's fallback type (tensor_types).  The file keeps the method's label and
    file type, as llama-quantize's files do (it warns "N of M tensor(s) required fallback
    quantization"), so the warning says what the file holds instead.
    """
    matrices = [q for q in qtypes if q != T.F32]
    held = collections.Counter(q.name for q in matrices)
    holding = ", ".join(f"{count} {name}" for name, count in held.most_common())
    missing = "" if held[method.base.name] else f", no {method.base.name} tensor at all"
    rows = sorted({t.shape[-1] for t in fallbacks})
    blocks = sorted({GGML_QUANT_SIZES[t.intended][0] for t in fallbacks})
    warnings.warn(
        f"{file_name}: {len(fallbacks)} of {len(matrices)} weight matrices could not take the type "
        f"{method.label} gives them (rows of {', '.join(map(str, rows))} values are not multiples of "
        f"{' or '.join(map(str, blocks))}) and fell back: its weight matrices are {holding}{missing}; "
        f"it is labelled {method.label} all the same, as llama.cpp's llama-quantize labels such files "
        f"(with a warning that the tensors 'required fallback quantization')",
        stacklevel=3,
    )


# ---------------------------------------------------------------------------------------
# Hyperparameters and metadata
# ---------------------------------------------------------------------------------------


def _gguf_tensors(model, arch: Architecture, hp: HyperParameters) -> Iterator[tuple]:
    """(gguf name, () -> tensor, shape, layer or None) for every tensor of the file, in order;
    the producer applies the layout's transformation (layout.to_gguf) only when called."""
    state = model.state_dict()
    check_experts(model.config, arch, state)
    embed = state.get("model.embed_tokens.weight")
    head = state.get("lm_head.weight")
    head_is_embed = (
        head is None
        or getattr(model.config, "tie_word_embeddings", False)
        or (embed is not None and head.data_ptr() == embed.data_ptr())
    )
    if arch.gguf.output_always_tied and not head_is_embed and not torch.equal(head, embed):
        raise ValueError(
            f"GGUF's {arch.gguf.arch!r} architecture ties the output layer to the embeddings, but this "
            "model's lm_head differs from embed_tokens; tie them (or train without lm_head) before export"
        )

    if hp.rope_type == "llama3":
        if not arch.gguf.rope_freqs:
            graphs = " and ".join(sorted({record.gguf.arch for record in RECORDS if record.gguf.rope_freqs}))
            raise NotImplementedError(
                f"'llama3' rope scaling is supported for the {graphs} architecture only"
            )
        divisors = llama3_rope_divisors(hp)
        yield "rope_freqs.weight", (lambda d=divisors: d), tuple(divisors.shape), None
    if hp.gemma4 is not None:
        divisors = gemma4.rope_divisors(hp.gemma4)
        yield "rope_freqs.weight", (lambda d=divisors: d), tuple(divisors.shape), None
    if hp.longrope is not None:
        for name, factors in hp.longrope.tensors():
            yield name, (lambda f=factors: f), tuple(factors.shape), None

    unknown = []
    for hf_name, tensor in state.items():
        if "rotary_emb" in hf_name:
            continue  # buffers recomputed by both sides
        if hf_name == "lm_head.weight" and head_is_embed:
            continue
        pieces = gguf_pieces(hf_name, arch)
        if pieces is None:
            unknown.append(hf_name)
            continue
        for piece in pieces:
            shape = gguf_shape(tensor, piece, arch)
            yield piece.name, _producer(tensor, piece, arch, model.config), shape, piece.layer
    if unknown:
        raise ValueError(
            f"GGUF export does not know where these weights go: {unknown[:8]}"
            f"{' ...' if len(unknown) > 8 else ''} (is the model merged and of a supported architecture?)"
        )


def _producer(tensor: torch.Tensor, piece: Piece, arch: Architecture, config):
    def produce() -> torch.Tensor:
        return to_gguf(cut(tensor.detach(), piece), piece.name, arch, config)

    return produce


# ---------------------------------------------------------------------------------------
# Helpers
# ---------------------------------------------------------------------------------------


def _check_plain_model(model) -> None:
    if hasattr(model, "peft_config"):
        raise TypeError(
            "save_pretrained_gguf needs a merged model; this is a PEFT model with adapters. Merge it first "
            "(slothkit.export.merge, or model.merge_and_unload())"
        )
    for name, tensor in model.state_dict().items():
        if tensor.dtype not in (torch.float16, torch.bfloat16, torch.float32):
            raise TypeError(
                f"GGUF export needs a 16- or 32-bit model; {name} is {tensor.dtype} (a quantised model: "
                "merge to 16-bit first)"
            )


def _stop_token_ids(model) -> list[int]:
    ids = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
    if ids is None:
        ids = getattr(model.config, "eos_token_id", None)
    if ids is None:
        return []
    return [int(i) for i in ([ids] if isinstance(ids, int) else ids)]


# Folder names that tempfile.mkdtemp and slothkit's own scratch folders give: never a model's name.
_TEMPORARY_NAME = re.compile(r"^(\.|tmp\w{8}$|slothkit-(gguf|export|push|tiny-models)-)")
# What slothkit's checkpoint caches (slothkit.testing: real and tiny models) append to the
# model's name in a folder's name: 12 hex digits of a content hash, then the stored dtype.
_CACHE_SUFFIX = re.compile(r"-(?=[0-9]*[a-f])[0-9a-f]{12}(-(float32|bfloat16|float16))?$")


def model_name(model, fallback: str) -> str:
    """The model's name for GGUF file names and general.name (what Ollama and LM Studio
    show): the last part of config._name_or_path (a Hub id's name, a local checkpoint
    folder's name less a cache's hash and dtype, the repo of a Hugging Face cache
    snapshot), or `fallback` when that is empty or a temporary folder's name.

    Args:
        model: the model being exported; slothkit.export.save.merged_plain_model gives
            the merged model the base model's name.
        fallback: the name to use otherwise (the output folder's).
    """
    source = pathlib.PurePath(getattr(model.config, "_name_or_path", "") or "")
    name = source.name
    # A Hugging Face cache snapshot: ~/.cache/huggingface/hub/models--org--name/snapshots/SHA
    if source.parent.name == "snapshots" and source.parent.parent.name.startswith("models--"):
        name = source.parent.parent.name.split("--")[-1]
    if not name or _TEMPORARY_NAME.match(name):
        return fallback
    return _CACHE_SUFFIX.sub("", name) or fallback


def _quantization_device(model) -> torch.device:
    """Where the K-quant encoder runs: the model's GPU, else any GPU, else the CPU."""
    try:
        device = next(model.parameters()).device
    except StopIteration:
        device = torch.device("cpu")
    if device.type == "cuda":
        return device
    return torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")
