"""The model a benchmark worker trains: a named shape with random weights, built on the
device (16-bit, or with NF4 projections for QLoRA), and LoRA and checkpointing added the
way each implementation's users add them.
"""

from __future__ import annotations

import torch

LORA_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
# The words of --cuda-graphs and --keep-sums -> FastModel.get_peft_model's keyword values.
CUDA_GRAPHS = {"auto": None, "on": True, "off": False, "forward": "forward"}
KEEP_SUMS = {"auto": None, "on": True, "off": False}
# The words of --slothkit-checkpointing -> use_gradient_checkpointing.
CHECKPOINTING = {"offload": "offload", "on": True, "auto": "auto"}


def build_model(
    shape_name: str,
    dtype: torch.dtype,
    device: str,
    seed: int,
    quantize_nf4: bool = False,
    quantize_experts: bool = False,
):
    """The named shape with random weights, built directly on the device.

    quantize_nf4: replace the seven projections by bitsandbytes NF4 layers as they are
    built, one at a time, so that the 16-bit model never exists whole: a QLoRA run under
    a memory cap smaller than the 16-bit weights (the --t4 stand-in) can still start.
    The weights are the same either way (one generator, parameters in the same order).
    quantize_experts: with quantize_nf4, also quantise each mixture-of-experts block's 3-D
    expert weights to slothkit's NF4 records as soon as that block is built, as
    FastModel's 4-bit loading does (slothkit.engine.experts_loading): a whole
    Qwen3-30B-A3B (about 57 GiB of 16-bit experts) then starts under a 24 GiB cap.  Only
    for slothkit, whose fused experts read those records; HF + PEFT keeps 16-bit experts.
    """
    from accelerate import init_empty_weights
    from transformers import AutoModelForCausalLM, AutoModelForImageTextToText

    from slothkit.engine.experts import DOWN, GATE_UP, is_experts_module
    from slothkit.engine.experts_nf4 import quantize_expert_parameters
    from slothkit.loading.load_model import attention_for
    from slothkit.models import IMAGE_TEXT_SHAPES, record_for, shape_by_name
    from slothkit.models.image_text import part_of

    image_text = shape_name in IMAGE_TEXT_SHAPES
    if image_text:  # the whole model (vision tower, projector, language model)
        config = IMAGE_TEXT_SHAPES[shape_name].config()
        model_class, attention = AutoModelForImageTextToText, "sdpa"  # as FastVisionModel loads it
    else:
        config = shape_by_name(shape_name).config()
        model_class, attention = AutoModelForCausalLM, attention_for(config)
    record = record_for(config)  # None for a generic shape: its norms scale by w
    neutral_norm = 0.0 if record is not None and record.norm_adds_one else 1.0

    # Parameters on the meta device (no memory, no init time), made real one module at a
    # time below; buffers (rotary inv_freq, Gemma's embed_scale) real from the start.
    with init_empty_weights(include_buffers=False):
        model = model_class.from_config(config, dtype=dtype, attn_implementation=attention)
    generator = torch.Generator(device=device).manual_seed(seed)
    with torch.no_grad():
        # Tied weights (Gemma's embeddings and head) are one meta parameter in two modules:
        # remember the real tensor made for those only, so that a quantised projection's
        # 16-bit weight is freed as soon as it is replaced.
        seen, tied = set(), set()
        for _, meta in model.named_parameters(remove_duplicate=False):
            (tied if id(meta) in seen else seen).add(id(meta))
        built = {}  # id of a tied meta parameter -> its real one
        for module_name, module in list(model.named_modules()):
            for param_name, meta in list(module.named_parameters(recurse=False)):
                if id(meta) not in built:
                    param = torch.nn.Parameter(
                        torch.empty_like(meta, device=device), requires_grad=meta.requires_grad
                    )
                    name = f"{module_name}.{param_name}" if module_name else param_name
                    neutral = _neutral_norm_value(module, param_name) if image_text else None
                    if neutral is not None:
                        param.fill_(neutral)
                    elif not image_text and (name.endswith("norm.weight") or "layernorm" in name):
                        # Neutral norm: 1, or 0 where the norm scales by (1 + w).
                        param.fill_(neutral_norm)
                    else:
                        param.normal_(0.0, 0.02, generator=generator)
                    if id(meta) in tied:
                        built[id(meta)] = param
                else:
                    param = built[id(meta)]
                module._parameters[param_name] = param
            # An image-text model's vision tower and projector stay 16-bit, as FastVisionModel's
            # 4-bit loading leaves them (slothkit.models.image_text.SIXTEEN_BIT_MODULES).
            in_language_model = not image_text or part_of(module_name) == "language"
            if quantize_nf4 and in_language_model and _is_projection(module_name, module):
                _replace_with_nf4(model, module_name, module, dtype)
            if quantize_nf4 and quantize_experts and is_experts_module(module):
                quantize_expert_parameters(module, (GATE_UP, DOWN))
    model.to(device)  # moves the buffers; the parameters are there already
    model.tie_weights()
    return model


def _neutral_norm_value(module, param_name: str) -> float | None:
    """What a norm's parameter holds for the norm to change nothing (None for any other
    parameter), by the norm's class, since an image-text model's parts name their norms
    each their own way (SigLIP's layer_norm1, Qwen-VL's norm1 and ln_q): a bias 0, a
    weight 1, or 0 in Gemma's RMSNorm, which scales by (1 + w)."""
    kind = type(module).__name__
    if "Norm" not in kind:
        return None
    if param_name == "bias":
        return 0.0
    return 0.0 if kind.startswith("Gemma") and "RMSNorm" in kind else 1.0


def build_for(impl: str, args, dtype: torch.dtype, device: str):
    """The model ``build_model`` gives implementation ``impl`` of a bench run (``args``: its
    model, seed and mode): with ``--mode qlora`` its projections in NF4 and, for slothkit
    (whose fused experts read them), its experts too, as each implementation's 4-bit
    loading leaves them."""
    qlora = args.mode == "qlora"
    return build_model(
        args.model,
        dtype,
        device,
        args.seed,
        quantize_nf4=qlora,
        quantize_experts=qlora and impl.startswith("slothkit"),
    )


def _is_projection(name: str, module) -> bool:
    from slothkit.loading.lora_setup import FUSED_PROJECTIONS

    leaf = name.rsplit(".", 1)[-1]
    return leaf in (*LORA_TARGETS, *FUSED_PROJECTIONS.values()) and isinstance(module, torch.nn.Linear)


def lora_targets(model) -> list[str]:
    """LORA_TARGETS as ``model`` names its layers: a fused layer in place of the group it
    computes (Phi-3's qkv_proj, gate_up_proj: slothkit.loading.lora_setup.FUSED_PROJECTIONS), the
    layers FastModel adapts for the seven names, so that HF + PEFT adapts the same ones."""
    from slothkit.loading.lora_setup import FUSED_PROJECTIONS

    leaves = {
        name.rsplit(".", 1)[-1]
        for name, module in model.named_modules()
        if isinstance(module, torch.nn.Linear)
    }
    targets = list(LORA_TARGETS)
    for group, fused in FUSED_PROJECTIONS.items():
        if fused in leaves:
            targets = [name for name in targets if name not in group] + [fused]
    return targets


def _replace_with_nf4(model, name: str, module, compute_dtype: torch.dtype) -> None:
    """Swap one projection for a bitsandbytes NF4 (double-quantised) layer."""
    import bitsandbytes as bnb

    quantized = bnb.nn.Linear4bit(
        module.in_features,
        module.out_features,
        bias=module.bias is not None,
        compute_dtype=compute_dtype,
        compress_statistics=True,
        quant_type="nf4",
        quant_storage=torch.uint8,
        device="meta",
    )
    quantized.weight = bnb.nn.Params4bit(
        module.weight.data,
        requires_grad=False,
        compress_statistics=True,
        quant_type="nf4",
        quant_storage=torch.uint8,
    ).to(module.weight.device)
    if module.bias is not None:  # Qwen2's q/k/v: the bias stays 16-bit and frozen
        quantized.bias = torch.nn.Parameter(module.bias.data, requires_grad=False)
    parent_name, _, leaf = name.rpartition(".")
    setattr(model.get_submodule(parent_name), leaf, quantized)
    module._parameters.clear()  # callers hold the old module (a named_modules() list): free its weight


def quantize_to_nf4(model, compute_dtype: torch.dtype):
    """Replace the decoder's projections with bitsandbytes NF4 (double-quantised) layers."""
    for name, module in list(model.named_modules()):
        if _is_projection(name, module):
            _replace_with_nf4(model, name, module, compute_dtype)
    return model


def prepare(
    impl: str,
    model,
    rank: int,
    checkpointing: str = "offload",
    cuda_graphs: str = "auto",
    keep_sums: str = "auto",
    hf_checkpointing: str = "on",
    memory_gib: float | None = None,
    batch: int | None = None,
    seq: int | None = None,
):
    """Add LoRA and checkpointing the way each implementation's users do.

    Args:
        impl: "slothkit", "hf" or "liger".
        model: the model from ``build_model``.
        rank: the LoRA rank (alpha is the same).
        checkpointing: slothkit's use_gradient_checkpointing: "offload" (default, what
            its users get), "on" (plain checkpointing, the layer inputs kept on the GPU)
            or "auto" (the layers that fit ``memory_gib`` not checkpointed).
        cuda_graphs: slothkit's cuda_graphs, as a word of ``CUDA_GRAPHS`` (default
            "auto": FastModel.get_peft_model chooses).
        keep_sums: slothkit's keep_sums, as a word of ``KEEP_SUMS`` (default "auto").
        hf_checkpointing: HF + PEFT's and Liger's gradient checkpointing, "on" (default,
            non-reentrant, as their notebooks set it) or "off".
        memory_gib: with checkpointing "auto", the budget (max_memory); None: the GPU's
            free memory.
        batch: with checkpointing "auto", the batch size it decides for.
        seq: with checkpointing "auto", the sequence length it decides for.
    """
    from peft import LoraConfig, get_peft_model

    if impl == "liger":
        from liger_kernel.transformers import _apply_liger_kernel_to_instance

        _apply_liger_kernel_to_instance(model=model)
    if impl in ("hf", "liger"):
        from slothkit.loading.lora_setup import onto_expert_parameters

        # A mixture-of-experts model's experts: the same 3-D parameters FastModel adapts.
        targets, expert_parameters = onto_expert_parameters(model, lora_targets(model))
        extra = {"target_parameters": expert_parameters} if expert_parameters else {}
        model = get_peft_model(
            model,
            LoraConfig(
                r=rank,
                lora_alpha=rank,
                lora_dropout=0.0,
                target_modules=targets,
                task_type="CAUSAL_LM",
                **extra,
            ),
        )
        if hf_checkpointing == "on":
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
            model.enable_input_require_grads()
        model.config.use_cache = False
        model.train()  # from_config/from_pretrained return eval mode, which skips checkpointing
        return model
    if impl == "slothkit":
        from slothkit import FastModel

        take_fast_model_path(model)
        mode = CHECKPOINTING[checkpointing]
        auto = {}
        if mode == "auto":
            auto = {"max_memory": memory_gib, "batch_size": batch, "max_seq_length": seq}
        return FastModel.get_peft_model(
            model,
            r=rank,
            lora_alpha=rank,
            use_gradient_checkpointing=mode,
            cuda_graphs=CUDA_GRAPHS[cuda_graphs],
            keep_sums=KEEP_SUMS[keep_sums],
            **auto,
        )
    raise ValueError(f"unknown implementation {impl!r}")


def take_fast_model_path(model) -> None:
    """What FastModel.from_pretrained does to a loaded model: the fused decoder where slothkit
    has a fused record for the family, else the generic path (its own modules, the fused
    cross-entropy on its head where that passes its self-check)."""
    from slothkit.engine.decoder import patch_decoder
    from slothkit.loading.load_model import take_generic_path
    from slothkit.models import architecture_for

    arch = architecture_for(model.config)
    if arch is not None:
        patch_decoder(model, arch)
    else:
        take_generic_path(model, None)


def load_with_unsloth(model, args, dtype):
    """Unsloth loads from a checkpoint on disk: save the random model, then load it
    the way Unsloth's notebooks do (its own 4-bit loading, its offloaded checkpointing)."""
    import shutil
    import tempfile

    from unsloth import FastLanguageModel

    from slothkit.testing import build_tiny_tokenizer

    # The checkpoint (16 GB for an 8B model) is deleted once loaded: a few runs on one
    # machine would otherwise fill its disk.
    folder = tempfile.mkdtemp(prefix="slothkit-bench-unsloth-")
    try:
        model.save_pretrained(folder, safe_serialization=True)
        build_tiny_tokenizer("bpe", folder)  # Unsloth wants a tokenizer beside the weights
        del model
        torch.cuda.empty_cache()
        unsloth_model, _ = FastLanguageModel.from_pretrained(
            folder,
            max_seq_length=args.seq,
            dtype=dtype,
            load_in_4bit=args.mode == "qlora",
        )
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    torch.cuda.synchronize()
    loaded = torch.cuda.memory_allocated()
    unsloth_model = FastLanguageModel.get_peft_model(
        unsloth_model,
        r=args.rank,
        lora_alpha=args.rank,
        lora_dropout=0.0,
        bias="none",
        target_modules=LORA_TARGETS,
        use_gradient_checkpointing="unsloth",
        random_state=args.seed,
    )
    # from_pretrained leaves eval mode, in which checkpointing is skipped: train as users do.
    unsloth_model.train()
    return unsloth_model, loaded
