"""Check a projector file (slothkit.export.gguf.mmproj) against the Hugging Face model with
llama.cpp's libmtmd itself (llama-cpp-python's `llama_cpp.mtmd_cpp` bindings).

libmtmd loads the projector beside the language model's GGUF (it checks that the
projector's output width is the text model's), tokenises a prompt holding one random image
of a size llama.cpp keeps as it is (Gemma 3: the model's own size; Qwen2.5-VL: sides that
are multiples of 28 pixels, at least 8 image tokens and windows of two sizes:
mmproj_qwen2_5_vl.verification_image_shape), encodes the image and hands back its
image-token embeddings. The HF side runs the tower and projector (get_image_features) on
the same pixels normalised as llama.cpp normalises them, with the mean and std written in
the file (uint8 / 255, minus mean, over std: what both families' image processors do; for
Qwen2.5-VL laid out in patches as its image processor lays them out). Compared by

    relative error = rms(llama.cpp - HF) / std(HF)    over every image token's embedding

within TOLERANCES: measured on the tiny Gemma 3 of the tests, 0.0006 for an F32 file and
0.0007 for F16 (matrices rounded to 11 bits); on the tiny Qwen2.5-VL, 0.0003 and 0.0006. A file
without the vision LoRA, or with Gemma 3's projector norm stored without its 1 + w offset,
or Qwen2.5-VL's full-attention blocks placed wrongly, is far beyond them (the tests).
"""

from __future__ import annotations

import contextlib
import copy
import ctypes
import dataclasses
import os
import pathlib

import numpy as np
import torch
from gguf import GGMLQuantizationType, GGUFReader

from slothkit.export.gguf import mmproj_qwen2_5_vl
from slothkit.export.gguf.verify import GGUFVerificationError, _plain_cpu_kernels, llama_cpp_available

T = GGMLQuantizationType
TOLERANCES = {T.F32: 0.01, T.F16: 0.02}
IMAGE_CHUNK = 1  # mtmd_input_chunk_type: MTMD_INPUT_CHUNK_TYPE_IMAGE
GGML_LOG_LEVEL_ERROR = 3  # enum ggml_log_level: NONE, INFO, WARN, ERROR, DEBUG, CONT
_quiet_log = []  # the ctypes callback libmtmd holds, kept alive here


@dataclasses.dataclass(frozen=True)
class MmprojReport:
    relative_error: float
    tolerance: float
    image_tokens: int


def random_image(size: int | tuple[int, int], seed: int = 0) -> np.ndarray:
    """An RGB image of `size` x `size` (or (height, width)) uint8 pixels, uniformly random."""
    height, width = (size, size) if isinstance(size, int) else size
    return np.random.default_rng(seed).integers(0, 256, (height, width, 3), dtype=np.uint8)


def verification_image_shape(config) -> tuple[int, int]:
    """(height, width) of the image verification encodes (module docstring)."""
    if config.model_type == "qwen2_5_vl":
        return mmproj_qwen2_5_vl.verification_image_shape(config.vision_config)
    return config.vision_config.image_size, config.vision_config.image_size


def file_normalisation(path: pathlib.Path) -> tuple[np.ndarray, np.ndarray]:
    reader = GGUFReader(path)
    values = {}
    for key in ("clip.vision.image_mean", "clip.vision.image_std"):
        field = reader.get_field(key)
        values[key] = np.array([float(field.parts[i][0]) for i in field.data], dtype=np.float32)
    return values["clip.vision.image_mean"], values["clip.vision.image_std"]


def hf_image_features(model, image: np.ndarray, mean: np.ndarray, std: np.ndarray) -> np.ndarray:
    """The model's projected image features (image tokens, text width) for uint8 `image`,
    as get_image_features computes them (tower, then projector), in float32: a 16-bit
    model's tower and projector run as float32 copies, since the file holds its weights
    unrounded (F32) or rounded once (F16) and llama.cpp computes in float32."""
    if model.config.model_type == "qwen2_5_vl":
        return mmproj_qwen2_5_vl.hf_image_features(model, image, mean, std)
    tower, projector = model.model.vision_tower, model.model.multi_modal_projector
    if next(tower.parameters()).dtype != torch.float32:
        tower, projector = copy.deepcopy(tower).float(), copy.deepcopy(projector).float()
    pixels = (image.astype(np.float32) / 255.0 - mean) / std
    pixel_values = torch.from_numpy(pixels).permute(2, 0, 1)[None].to(next(tower.parameters()).device)
    with torch.no_grad():
        features = projector(tower(pixel_values=pixel_values, return_dict=True).last_hidden_state)
    return features.reshape(-1, features.shape[-1]).float().cpu().numpy()


def _errors_only_log():
    """A ggml log callback that writes errors to stderr and drops the rest: libmtmd logs
    every hyperparameter and step of the encoding otherwise (dozens of lines in a save, or
    a notebook's save cell), where llama.cpp's own log is quieted by verbose=False."""
    import llama_cpp

    if not _quiet_log:

        @llama_cpp.llama_log_callback
        def log(level, text, user_data):
            if level == GGML_LOG_LEVEL_ERROR:
                os.write(2, text)

        _quiet_log.append(log)
    return _quiet_log[0]


def llama_cpp_image_embeddings(mmproj_path, text_path, image: np.ndarray) -> np.ndarray:
    """libmtmd's embeddings of `image` (image tokens, text width): the projector file read
    beside the language model's GGUF, on the CPU."""
    import llama_cpp
    from llama_cpp import mtmd_cpp as mtmd

    mtmd.mtmd_log_set(_errors_only_log(), ctypes.c_void_p(0))
    with contextlib.ExitStack() as cleanup:
        with _plain_cpu_kernels():
            llm = llama_cpp.Llama(model_path=str(text_path), n_ctx=256, verbose=False)
        cleanup.callback(llm.close)
        params = mtmd.mtmd_context_params_default()
        params.use_gpu = False
        params.print_timings = False
        context = mtmd.mtmd_init_from_file(str(mmproj_path).encode(), llm._model.model, params)
        if not context:
            raise GGUFVerificationError(
                f"{mmproj_path}: llama.cpp's libmtmd (llama-cpp-python {llama_cpp.__version__}) could not "
                f"load the projector file beside {text_path}"
            )
        cleanup.callback(mtmd.mtmd_free, context)
        height, width, _ = image.shape
        pixels = (ctypes.c_uint8 * image.size).from_buffer_copy(np.ascontiguousarray(image).tobytes())
        bitmap = mtmd.mtmd_bitmap_init(width, height, pixels)
        cleanup.callback(mtmd.mtmd_bitmap_free, bitmap)
        chunks = mtmd.mtmd_input_chunks_init()
        cleanup.callback(mtmd.mtmd_input_chunks_free, chunks)
        prompt = mtmd.mtmd_default_marker()
        text = mtmd.mtmd_input_text(text=prompt, text_len=len(prompt), add_special=False, parse_special=True)
        bitmaps = (mtmd.mtmd_bitmap_p_ctypes * 1)(bitmap)
        if mtmd.mtmd_tokenize(context, chunks, ctypes.byref(text), bitmaps, 1) != 0:
            raise GGUFVerificationError(f"{mmproj_path}: libmtmd could not tokenise a prompt with an image")
        for index in range(mtmd.mtmd_input_chunks_size(chunks)):
            chunk = mtmd.mtmd_input_chunks_get(chunks, index)
            if mtmd.mtmd_input_chunk_get_type(chunk) != IMAGE_CHUNK:
                continue
            if mtmd.mtmd_encode_chunk(context, chunk) != 0:
                raise GGUFVerificationError(f"{mmproj_path}: libmtmd failed to encode the image")
            tokens = mtmd.mtmd_input_chunk_get_n_tokens(chunk)
            width_text = llm.n_embd()
            output = mtmd.mtmd_get_output_embd(context)
            return (
                np.ctypeslib.as_array(output, shape=(tokens * width_text,)).reshape(tokens, width_text).copy()
            )
    raise GGUFVerificationError(f"{mmproj_path}: libmtmd made no image chunk of a prompt with an image")


def verify_mmproj(
    mmproj_path: str | os.PathLike,
    text_path: str | os.PathLike,
    model,
    float_type: GGMLQuantizationType,
    seed: int = 0,
) -> MmprojReport:
    """Compare the projector file's image embeddings in llama.cpp with the model's (module
    docstring); raise GGUFVerificationError beyond the tolerance, return the measurement.

    Args:
        mmproj_path: the projector file.
        text_path: the language model's GGUF written beside it.
        model: the (merged) image-text model both were written from.
        float_type: the projector's matrix type (T.F16 or T.F32); it sets the tolerance.
        seed: the random image's.
    """
    if not llama_cpp_available():
        raise ImportError("verifying a GGUF file needs llama-cpp-python: pip install 'slothkit[gguf]'")
    mmproj_path = pathlib.Path(mmproj_path)
    image = random_image(verification_image_shape(model.config), seed)
    mean, std = file_normalisation(mmproj_path)
    reference = hf_image_features(model, image, mean, std)
    embeddings = llama_cpp_image_embeddings(mmproj_path, text_path, image)
    if embeddings.shape != reference.shape:
        raise GGUFVerificationError(
            f"{mmproj_path}: llama.cpp gives {embeddings.shape[0]} image tokens of width {embeddings.shape[1]}, "
            f"Hugging Face {reference.shape[0]} of width {reference.shape[1]}"
        )
    error = float(np.sqrt(np.mean((embeddings - reference) ** 2)) / reference.std())
    tolerance = TOLERANCES[float_type]
    if not error <= tolerance:
        raise GGUFVerificationError(
            f"{mmproj_path}: llama.cpp's image embeddings are {error:.4f} (rms / std) from the model's "
            f"projected image features, above the {tolerance} an {float_type.name} projector file allows"
        )
    return MmprojReport(error, tolerance, reference.shape[0])
