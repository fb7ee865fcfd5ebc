"""What the image-text parity tests share: a tiny image-text checkpoint loaded through
FastVisionModel and as plain Hugging Face + PEFT with the same adapters, random batches of
text with images, and a plain training loop run on both.

    fast = load_for_training("slothkit", "qwen2_5_vl", vision=True)
    plain = load_for_training("hf", "qwen2_5_vl", vision=True, targets=adapted_layers(fast))
    batches = [random_batch("qwen2_5_vl", seed) for seed in range(8)]
    fast_losses, plain_losses = train(fast, batches), train(plain, batches)

The batches need no processor (Qwen-VL's needs torchvision): random token ids with one
image's tokens written as its processor writes them (markers around its placeholders),
and its pixels through the checkpoint's image processor.  Needs peft; imported by tests
only.
"""

from __future__ import annotations

import numpy as np
import torch

from slothkit.testing.tiny_image_text import image_text_processor_loads, tiny_image_text_path

SEED = 3407  # the adapters' initialisation (get_peft_model's random_state)
LEARNING_RATE = 1e-2


def load_for_training(
    kind: str,
    family: str,
    vision: bool,
    load_in_4bit: bool = False,
    targets=None,
    dtype=torch.float32,
    fused: bool | None = None,
):
    """The tiny `family` checkpoint with LoRA (r=8, alpha=16), on the GPU where there is
    one (as FastVisionModel places it).

    Args:
        kind: "slothkit" (FastVisionModel's loading, with the processor where it loads,
            and get_peft_model with offloaded checkpointing) or "hf" (transformers and PEFT as a user without slothkit
            writes them).
        family: a name in slothkit.testing.tiny_image_text.IMAGE_TEXT_FAMILIES.
        vision: whether the vision tower's layers are adapted besides the language model's.
        load_in_4bit: NF4 language layers through bitsandbytes (the vision tower, projector
            and head 16-bit), computing in `dtype`.
        targets: "hf" only: the module paths to adapt (adapted_layers of the slothkit
            model: the same layers, so that the two start from the same adapters).
        fused: "slothkit" only: from_pretrained's fused (True: the language model on the
            fused layers, on the CPU through the Triton interpreter).
    """
    path = str(tiny_image_text_path(family))
    if kind == "slothkit":
        from slothkit import FastVisionModel
        from slothkit.loading.load_model import LoadOptions
        from slothkit.loading.vision_model import load_vision_model

        if image_text_processor_loads(family) is None:
            model, _ = FastVisionModel.from_pretrained(
                path, load_in_4bit=load_in_4bit, dtype=dtype, max_seq_length=128, fused=fused
            )
        else:  # the model alone, where transformers cannot build the processor (Qwen-VL's without torchvision)
            options = LoadOptions(load_in_4bit=load_in_4bit, dtype=dtype, max_seq_length=128, fused=fused)
            model = load_vision_model(path, options)
        return FastVisionModel.get_peft_model(
            model, finetune_vision_layers=vision, r=8, lora_alpha=16, random_state=SEED,
            use_gradient_checkpointing="offload",
        )  # fmt: skip

    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForImageTextToText, BitsAndBytesConfig

    quantization = None
    if load_in_4bit:
        quantization = BitsAndBytesConfig(
            load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=True,
            bnb_4bit_compute_dtype=dtype,
            llm_int8_skip_modules=[
                "model.vision_tower", "model.visual", "model.vision_model", "model.multi_modal_projector", "lm_head",
            ],
        )  # fmt: skip
    device_map = (
        {"": torch.cuda.current_device()} if torch.cuda.is_available() else None
    )  # as FastVisionModel
    model = AutoModelForImageTextToText.from_pretrained(
        path, dtype=dtype, quantization_config=quantization, attn_implementation="sdpa", device_map=device_map
    )
    torch.manual_seed(SEED)
    config = LoraConfig(
        r=8, lora_alpha=16, lora_dropout=0.0, target_modules=list(targets), task_type="CAUSAL_LM"
    )
    return get_peft_model(model, config).train()


def adapted_layers(model) -> list[str]:
    """The module paths (in the transformers model) of the layers with LoRA adapters."""
    return [
        name.removeprefix("base_model.model.")
        for name, module in model.named_modules()
        if hasattr(module, "lora_A") and len(module.lora_A)
    ]


def random_batch(family: str, seed: int, rows: int = 2, text_tokens: int = 20) -> dict[str, torch.Tensor]:
    """`rows` rows of random text tokens, each with one random image's tokens after its
    first few, the labels the ids with the image tokens left out (-100), and the token
    types the processor writes (Gemma 3's token_type_ids, Qwen-VL's mm_token_type_ids)."""
    from PIL import Image
    from transformers import AutoConfig, AutoImageProcessor

    path = tiny_image_text_path(family)
    config = AutoConfig.from_pretrained(path)
    rng = np.random.RandomState(seed)
    images = [
        Image.fromarray(rng.randint(0, 255, (56, 42), dtype=np.uint8)).convert("RGB") for _ in range(rows)
    ]
    # Mllama's image processor reads a list of images per row.
    per_row = [[image] for image in images] if family == "mllama" else images
    processed = AutoImageProcessor.from_pretrained(path)(images=per_row, return_tensors="pt")
    # What the model reads (Gemma 3's image processor also counts pan-and-scan crops).
    read = ("pixel_values", "image_grid_thw", "aspect_ratio_ids", "aspect_ratio_mask")
    pixels = {name: processed[name] for name in read if name in processed}
    if family == "mllama":  # one token per image; the text reads the image through cross-attention
        block = [config.image_token_index]
        placeholder = config.image_token_index
    elif family == "gemma3":
        block = [config.boi_token_index] + [config.image_token_index] * config.mm_tokens_per_image
        block += [config.eoi_token_index]
        placeholder = config.image_token_index
    else:
        merge = config.vision_config.spatial_merge_size**2
        count = int(pixels["image_grid_thw"][0].prod()) // merge  # every image the same size
        block = (
            [config.vision_start_token_id] + [config.image_token_id] * count + [config.vision_end_token_id]
        )
        placeholder = config.image_token_id
    text = torch.from_numpy(rng.randint(5, 600, (rows, text_tokens)))
    ids = torch.cat([text[:, :3], torch.tensor([block] * rows), text[:, 3:]], dim=1)
    labels = ids.clone()
    labels[torch.isin(ids, torch.tensor(block))] = -100
    batch = {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": labels, **pixels}
    if family == "gemma3":  # image tokens attend to each other both ways in training
        batch["token_type_ids"] = (ids == placeholder).long()
    if family == "mllama":
        batch["cross_attention_mask"] = _cross_attention_mask(ids, placeholder, pixels["aspect_ratio_mask"])
    if family == "qwen2_5_vl":  # the image tokens' M-RoPE positions (time, height, width) are read from these
        batch["mm_token_type_ids"] = (ids == placeholder).long()
    batch["pixel_values"] = batch["pixel_values"].float()
    return batch


def _cross_attention_mask(ids: torch.Tensor, image_token: int, tiles: torch.Tensor) -> torch.Tensor:
    """Mllama's (rows, tokens, images, tiles) mask of one image a row, as its processor
    writes it: every token from the image's token on attends to the image's real tiles."""
    from_image = (ids == image_token).long().cumsum(dim=1) > 0  # (rows, tokens)
    return (from_image[:, :, None, None] & tiles[:, None, :, :].bool()).long()


def on_device(batch: dict, device: torch.device, dtype: torch.dtype | None = None) -> dict:
    """The batch's tensors on `device`, its pixel values in `dtype` when given."""
    moved = {name: value.to(device) for name, value in batch.items()}
    if dtype is not None:
        moved["pixel_values"] = moved["pixel_values"].to(dtype)
    return moved


def train(model, batches: list[dict]) -> list[float]:
    """AdamW (no weight decay) on the trainable parameters, one step per batch on the
    model's device; the losses."""
    parameters = [p for _, p in sorted(model.named_parameters()) if p.requires_grad]
    optimizer = torch.optim.AdamW(parameters, lr=LEARNING_RATE, weight_decay=0.0)
    losses = []
    device = next(model.parameters()).device
    dtype = next(p.dtype for p in model.parameters() if p.is_floating_point())
    for batch in batches:
        loss = model(**on_device(batch, device, dtype)).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return losses


def lora_weights(model) -> dict[str, torch.Tensor]:
    """The adapters' matrices by name, copied."""
    return {n: p.detach().cpu().clone() for n, p in model.named_parameters() if "lora_" in n}
