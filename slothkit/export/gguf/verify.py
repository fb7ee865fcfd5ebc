"""Check a GGUF file against the Hugging Face model it came from, with llama.cpp itself.

llama-cpp-python (the optional extra `slothkit[gguf]`) loads the file; a few prompts are
tokenised by both sides, run through both models, and compared:

  1. tokenisation: llama.cpp's tokens for each prompt equal HF's (BOS included); special
     tokens written in a prompt are parsed as Hugging Face parses them, so a prompt rendered
     with the chat template checks that the file holds the template's tokens;
  2. next-token logits at every prompt position (HF token ids fed to both):
         relative error = rms(llama.cpp - HF) / std(HF)   (std over the vocabulary)
     must stay within the tolerance;
  3. greedy tokens: llama.cpp continues each prompt greedily for a few tokens; at every step
     HF's logit for llama.cpp's token must be within GREEDY_MARGIN tolerances (times the
     logit std) of HF's best, i.e. a different pick is accepted only between tokens that the
     measured rounding can swap. (A wrong model picks tokens about 3 std below HF's best, the
     max of a vocabulary of roughly normal logits; for the 4-bit types on the tiny random
     test models the margin approaches that, and the logit check carries the weight.)

Two references:

  reference="model" (what save_pretrained_gguf runs): the model as it is. The tolerance must
  admit the weight rounding of the type, llama.cpp's own arithmetic, and the HF model's own
  rounding when it runs in 16 bits. Measured on the tiny random models of the tests (random
  weights have no redundancy: every layer's rounding reaches the logits) and on a real one,
  SmolLM2-135M-Instruct in fp32, beside llama.cpp's own quantiser (llama_model_quantize) fed
  slothkit's f16 file of the same weights (tests/slothkit/export/gguf/test_real_model_export.py):

      method   tiny random  SmolLM2: slothkit  llama.cpp's  tolerance  what rounds
      f32      0.0005                                       0.01       F16 KV cache only
      f16      0.0012       0.0073                          0.02       weights to 11 bits
      bf16     0.009                                        0.05       weights to 8 bits (and activations)
      q8_0     0.03         0.099              0.104        0.15       8-bit weights and activations
      q6_k     0.08         0.266              0.260        0.35       6-bit weights, 8-bit activations
      q5_k_m   0.15         0.429              0.449        0.55       5-bit weights, 6-bit on a few
      q4_k_m   0.30         0.490              0.487        0.65       4-bit weights, 6-bit on a few
      q4_0     0.35                                         0.75       4-bit weights, one fp16 scale per 32
  A real model costs more than its weights' rounding suggests: a few hidden dimensions carry
  outlier activations, which llama.cpp rounds to 8 bits before every quantised product (even
  the file's own dequantised weights run in HF give 0.22 against llama.cpp at q4_k_m). The
  tolerances admit that with room, and still refuse a file whose structure is wrong (rows
  not permuted, a norm offset missing: errors of 1 or more).
  A model in bf16/fp16 is run in its dtype: its own rounding adds ~0.01, so no tolerance is
  below BF16_REFERENCE_FLOOR for it.

  reference="gguf_weights": two tight checks that hold for every type alike.
  (a) The file's weights, read back into HF's layout and dequantised (layout.hf_weights_from_gguf),
      equal the model's within the type's rounding: relative rms error per tensor at most
      WEIGHT_TOLERANCES[method] (two to five times what the type gives on Gaussian weights).
  (b) The HF model run on those read-back weights matches llama.cpp within
      GGUF_WEIGHTS_TOLERANCE: what is left is llama.cpp's arithmetic alone, its F16 KV cache
      and its 8-bit rounding of activations before quantised matrix products (measured
      0.01-0.03 for every type).
  (a) catches a file whose weights are not the model's (rows not permuted, or permuted where
  they should not be, Gemma's norm offset missing: errors of 1 or more, at Q4 as at F16);
  (b) catches llama.cpp reading the file differently from the rules the writer and reader
  share. Together they check the file's structure as tightly for Q4 as for F16, where the 4-bit
  quality tolerances above could let a subtle fault through. Costs a second copy of the
  weights in memory; the tests use it.

Depth matters on random weights: every layer's rounding reaches the logits and nothing
averages it out. Measured with scripts/time_gguf_export.py (results/export/): on a random
TinyLlama-1.1B shape (22 layers) q4_k_m gives 0.442 for slothkit's file and 0.444 for
llama.cpp's own quantiser's file of the same weights, and 0.059 /
0.058 on reference="gguf_weights" (within 0.06); on a random Llama-3-8B shape (32 layers)
slothkit's file gives 0.86, beyond q4_k_m's tolerance, while its stored tensors' errors equal llama.cpp's
to four digits (0.0713). A random deep model is thus the wrong thing to verify Q4 files
of: a trained one, SmolLM2 above, is the case the tolerances are for.

Prompts must fit a sliding window that llama.cpp does not apply (Mistral's, under its llama
graph; Phi-3-mini-4k's, which its phi3 graph switches off: slothkit.export.gguf.attention):
prompt and greedy tokens are kept within it, the only length where the two agree.

LongRoPE (slothkit.export.gguf.longrope): llama.cpp picks the short or the long factors by
its context, HF by the sequence's length. By default llama.cpp runs a context that keeps the
short factors (at most 512 tokens and original_max_position_embeddings), so both rotate
alike on the prompts. A `context` beyond the original length makes llama.cpp rotate with the
long factors; then every prompt must be longer than the original length, for HF to use the
long ones too (a shorter one is refused: the two would differ by design, not by a fault).
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib.util
import os
import pathlib

import numpy as np
import torch

from slothkit.export.gguf import longrope
from slothkit.export.gguf.attention import ignored_window
from slothkit.export.gguf.layout import architecture_of, hf_weights_from_gguf
from slothkit.export.gguf.metadata import hyperparameters
from slothkit.export.gguf.tensor_types import QuantizationMethod, quantization_method

TOLERANCES = {
    "f32": 0.01,
    "f16": 0.02,
    "bf16": 0.05,
    "q8_0": 0.15,
    "q6_k": 0.35,
    "q5_k_m": 0.55,
    "q4_k_m": 0.65,
    "q4_0": 0.75,
}
GGUF_WEIGHTS_TOLERANCE = 0.06  # llama.cpp's arithmetic alone (see the module docstring)
WEIGHT_TOLERANCES = {  # relative rms error of a stored tensor; 2-5x what Gaussian weights give
    "f32": 1e-5,
    "f16": 1e-3,
    "bf16": 5e-3,
    "q8_0": 0.02,
    "q6_k": 0.04,
    "q5_k_m": 0.08,
    "q4_k_m": 0.16,
    "q4_0": 0.2,
}
BF16_REFERENCE_FLOOR = 0.05  # least tolerance when the HF model itself computes in bf16/fp16
GREEDY_MARGIN = 4.0  # in tolerances x logit std: see the module docstring
DEFAULT_PROMPTS = (
    "The lighthouse on the northern cape was built",
    "Mix the flour with warm water, then",
    "Sloths move slowly because",
)


class GGUFVerificationError(AssertionError):
    """The GGUF file does not reproduce the Hugging Face model within the stated tolerance."""


@dataclasses.dataclass
class VerificationReport:
    method: str
    tolerance: float
    logit_error: float  # the largest relative logit error over the prompts
    greedy_tokens: int  # tokens generated by llama.cpp, over all prompts
    greedy_exact: int  # of which HF's argmax agrees exactly
    worst_greedy_gap: float  # largest (HF best - HF logit of llama.cpp's pick) / std
    weight_error: float | None = None  # reference="gguf_weights": largest per-tensor relative error


def llama_cpp_available() -> bool:
    return importlib.util.find_spec("llama_cpp") is not None


# llama.h's llama_ftype values (LLAMA_FTYPE_MOSTLY_*) of the types slothkit also writes.
LLAMA_FTYPES = {"q4_0": 2, "q8_0": 7, "q4_k_m": 15, "q5_k_m": 17, "q6_k": 18}


def quantize_with_llama_cpp(
    source: str | os.PathLike,
    target: str | os.PathLike,
    method: str,
    pure: bool = False,
    threads: int | None = None,
) -> pathlib.Path:
    """llama.cpp's own quantiser (llama_model_quantize) applied to a GGUF file: the reference
    slothkit's quantised files are measured against.

    Args:
        source: an F16 or F32 GGUF file.
        target: where the quantised file goes.
        method: a key of LLAMA_FTYPES.
        pure: every quantisable tensor in the base type, without llama.cpp's per-tensor mix
            (which keeps some tensors at higher precision).
        threads: quantiser threads; None: every CPU core.

    Returns:
        `target`.

    Raises:
        RuntimeError: llama.cpp refused (its status code is in the message).
    """
    import ctypes

    import llama_cpp

    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = LLAMA_FTYPES[method]
    params.pure = pure
    params.nthread = threads or os.cpu_count() or 1
    code = llama_cpp.llama_model_quantize(str(source).encode(), str(target).encode(), ctypes.byref(params))
    if code != 0:
        raise RuntimeError(f"llama.cpp could not quantise {source} to {method} (status {code})")
    return pathlib.Path(target)


@contextlib.contextmanager
def _plain_cpu_kernels():
    """While a Llama is built inside, llama.cpp loads the model without its extra CPU
    buffer types (weights repacked for AMX or for wider SIMD kernels): the plain CPU
    kernels that any build has.

    Why: on Intel CPUs with AMX under Linux, ggml asks the kernel for the AMX tile-data
    permission on the thread that loads the model only, and its worker threads then die
    of SIGILL on their first tile instruction (ggml-org/llama.cpp#26954; seen with
    llama-cpp-python 0.3.36 on a Xeon with AMX, Q8_0 files), which kills the whole
    Python process mid-export.  The verifier measures numbers, not speed, so the plain
    kernels are what it wants anyway.  llama-cpp-python's ``Llama`` takes no argument for
    this (llama.cpp's ``use_extra_bufts``), so the defaults it starts from are adjusted
    for the duration of the call; versions without the field are left as they are."""
    from llama_cpp import llama_cpp as bindings

    if not hasattr(bindings.llama_model_params, "use_extra_bufts"):
        yield
        return
    make_defaults = bindings.llama_model_default_params

    def without_extra_buffers():
        params = make_defaults()
        params.use_extra_bufts = False
        return params

    bindings.llama_model_default_params = without_extra_buffers
    try:
        yield
    finally:
        bindings.llama_model_default_params = make_defaults


def verify_gguf(
    path: str | os.PathLike,
    model,
    tokenizer,
    method: str | QuantizationMethod,
    prompts: tuple[str, ...] = DEFAULT_PROMPTS,
    greedy_tokens: int = 6,
    reference: str = "model",
    context: int | None = None,
) -> VerificationReport:
    """Compare the GGUF file at `path` with `model` (see the module docstring); raise
    GGUFVerificationError on a mismatch, return the measurements otherwise.

    Args:
        path: the GGUF file.
        model: the transformers model it was written from (or, for a LoRA model's export, the
            LoRA model itself: it computes the same function).
        tokenizer: the model's tokenizer.
        method: the quantisation the file was written with, a name ("q8_0") or a parsed
            QuantizationMethod; it sets the tolerance.
        prompts: the texts both sides run: plain text, or text rendered with the chat
            template (its special tokens written out).
        greedy_tokens: how many tokens llama.cpp generates after each prompt.
        reference: "model" compares with the model as it is, within the method's tolerance
            (TOLERANCES); "gguf_weights" runs the HF model on the file's own weights,
            dequantised (layout.hf_weights_from_gguf), within GGUF_WEIGHTS_TOLERANCE whatever
            the method: this checks the file's structure as tightly for Q4 as for F16, at the
            cost of a second copy of the weights in memory.
        context: the context llama.cpp is started with; None: at most 512 tokens, within
            a window llama.cpp ignores, and, for longrope, where llama.cpp keeps the short
            factors (see the module docstring). Prompts are cut to fit it.
    """
    if not llama_cpp_available():
        raise ImportError("verifying a GGUF file needs llama-cpp-python: pip install 'slothkit[gguf]'")
    import llama_cpp

    method = quantization_method(method)
    if reference not in ("model", "gguf_weights"):
        raise ValueError(f"reference must be 'model' or 'gguf_weights'; got {reference!r}")
    weights, weight_error = None, None
    tolerance = TOLERANCES[method.name]
    if reference == "gguf_weights":
        weights = hf_weights_from_gguf(path, model)
        weight_error = _check_weights(path, weights, model, method.name)
        tolerance = GGUF_WEIGHTS_TOLERANCE
    if _model_dtype(model) in (torch.bfloat16, torch.float16):
        tolerance = max(tolerance, BF16_REFERENCE_FLOOR)
    context = context or _default_context(model)
    length = min(context, ignored_window(model.config, architecture_of(model)) or context)
    prompt_ids = [tokenizer(prompt)["input_ids"][: length - greedy_tokens] for prompt in prompts]
    _check_rope_factors_agree(model, context, prompt_ids)

    arch = architecture_of(model).gguf
    _check_llama_cpp_runs(arch.arch, arch.llama_cpp_python, llama_cpp.__version__)
    try:
        with _plain_cpu_kernels():
            llm = llama_cpp.Llama(
                model_path=str(pathlib.Path(path)),
                n_ctx=context,
                logits_all=True,
                verbose=False,
                seed=0,
            )
    except ValueError as error:  # llama-cpp-python's only word for any load failure
        raise GGUFVerificationError(
            f"{path}: llama.cpp (llama-cpp-python {llama_cpp.__version__}) could not load the file, of "
            f"architecture {arch.arch!r}; a llama.cpp that does not know the architecture fails so: "
            f"upgrade llama-cpp-python, or pass verify=False to write the file for another runner"
        ) from error
    errors, exact, gaps, generated = [], 0, [], 0
    try:
        for prompt, hf_ids in zip(prompts, prompt_ids):
            cpp_ids = llm.tokenize(prompt.encode("utf-8"), add_bos=True, special=True)[: len(hf_ids)]
            if cpp_ids != hf_ids:
                raise GGUFVerificationError(
                    f"{path}: llama.cpp tokenises {prompt!r} as {cpp_ids}, Hugging Face as {hf_ids}"
                )
            llm.reset()
            llm.eval(hf_ids)
            cpp = np.array(llm.scores[: len(hf_ids)], dtype=np.float32)
            picks = []
            for _ in range(greedy_tokens):
                picks.append(int(np.argmax(llm.scores[llm.n_tokens - 1])))
                llm.eval([picks[-1]])
            hf = _hf_logits(model, hf_ids + picks, weights)
            errors.append(_relative_error(cpp, hf[: len(hf_ids)]))
            for step, pick in enumerate(picks):
                row = hf[len(hf_ids) - 1 + step]
                gaps.append(float((row.max() - row[pick]) / row.std()))
                exact += int(row.argmax() == pick)
            generated += len(picks)
    finally:
        llm.close()

    report = VerificationReport(
        method.name, tolerance, max(errors), generated, exact, max(gaps), weight_error
    )
    if report.logit_error > tolerance:
        raise GGUFVerificationError(
            f"{path}: next-token logits differ from the Hugging Face model by {report.logit_error:.4f} "
            f"(rms / std), above the {tolerance} allowed for {method.name}. A higher-"
            f"precision type (q8_0, q6_k) keeps closer to the model; verify=False writes the file "
            f"without this check (an untrained, random model fails it at 4 bits whoever quantises)"
        )
    if report.worst_greedy_gap > GREEDY_MARGIN * tolerance:
        raise GGUFVerificationError(
            f"{path}: llama.cpp's greedy token is {report.worst_greedy_gap:.3f} logit std below Hugging Face's "
            f"best, beyond the {GREEDY_MARGIN * tolerance:.3f} that rounding can explain for {method.name}"
        )
    return report


def _check_llama_cpp_runs(graph: str, first_release: str | None, installed: str) -> None:
    """Refuse a llama-cpp-python older than the first release known to run `graph`: its
    llama.cpp would not load the file (or not as slothkit wrote it)."""
    from packaging.version import Version

    if first_release is not None and Version(installed) < Version(first_release):
        raise GGUFVerificationError(
            f"llama.cpp's {graph!r} architecture needs llama-cpp-python {first_release} or later to "
            f"verify the file; {installed} is installed: pip install -U 'llama-cpp-python>={first_release}', "
            f"or pass verify=False to write the file without running it"
        )


def _check_weights(path, weights: dict[str, torch.Tensor], model, method: str) -> float:
    """Largest relative rms error of a stored tensor against the model's; raise beyond the
    method's rounding."""
    state = model.state_dict()
    missing = [name for name, value in state.items() if name not in weights and "rotary_emb" not in name]
    tied = [n for n in missing if n == "lm_head.weight"]
    if set(missing) != set(tied):
        raise GGUFVerificationError(f"{path}: the file has no tensor for {missing[:5]}")
    worst_name, worst = None, 0.0
    for name, value in weights.items():
        reference = state[name].float()
        scale = max(reference.square().mean().sqrt().item(), 1e-12)
        error = (value.float() - reference).square().mean().sqrt().item() / scale
        if error >= worst:
            worst_name, worst = name, error
    if worst > WEIGHT_TOLERANCES[method]:
        raise GGUFVerificationError(
            f"{path}: the file's weights differ from the model's: {worst_name} by {worst:.4f} (rms / rms), "
            f"above the {WEIGHT_TOLERANCES[method]} that {method} rounding explains"
        )
    return worst


def _relative_error(candidate: np.ndarray, reference: np.ndarray) -> float:
    """rms(candidate - reference) / std(reference), the std taken over the vocabulary per position."""
    diff = np.sqrt(np.mean((candidate - reference) ** 2))
    return float(diff / np.mean(reference.std(axis=-1)))


def _hf_logits(model, ids: list[int], weights: dict[str, torch.Tensor] | None = None) -> np.ndarray:
    """HF's logits for `ids`, with the model's own weights or with `weights` swapped in
    (torch.func.functional_call: the model is not modified)."""
    was_training = model.training
    model.eval()
    try:
        inputs = {"input_ids": torch.tensor([ids], device=next(model.parameters()).device)}
        with torch.no_grad():
            if weights is None:
                out = model(**inputs)
            else:
                out = torch.func.functional_call(model, weights, args=(), kwargs=inputs, strict=False)
        logits = out.logits[0]
    finally:
        model.train(was_training)
    return logits.float().cpu().numpy()


def _model_dtype(model) -> torch.dtype:
    return next(model.parameters()).dtype


def _default_context(model) -> int:
    """The context llama.cpp is started with: 512 tokens, or less to fit a window llama.cpp
    ignores, or where it keeps longrope's short factors (longrope.largest_short_context)."""
    context = min(512, ignored_window(model.config, architecture_of(model)) or 512)
    scaling = _longrope(model)
    if scaling is not None:
        context = min(context, longrope.largest_short_context(scaling.original_context) or context)
    return context


def _longrope(model) -> longrope.LongRope | None:
    return hyperparameters(model.config, architecture_of(model)).longrope


def _check_rope_factors_agree(model, context: int, prompt_ids: list[list[int]]) -> None:
    """Refuse prompts on which llama.cpp and HF rotate with different longrope factors by
    design (the module docstring), whatever the file."""
    scaling = _longrope(model)
    if scaling is None or not longrope.llama_cpp_uses_long_factors(context, scaling.original_context):
        return
    short = [
        len(ids)
        for ids in prompt_ids
        if not longrope.hf_uses_long_factors(len(ids), scaling.original_context)
    ]
    if short:
        raise ValueError(
            f"in a context of {context} tokens (run as {longrope.llama_cpp_context(context)}) llama.cpp rotates "
            f"with the long longrope factors, beyond original_max_position_embeddings "
            f"({scaling.original_context}); prompts of {short} tokens would run HF's short ones. Give prompts "
            f"longer than {scaling.original_context} tokens, or a context of at most {scaling.original_context}"
        )
