"""The notebook's last cell: save (and publish) what the config asks for."""

from __future__ import annotations

from pathlib import Path


def save_all(model, tokenizer, config) -> dict[str, str]:
    """LoRA adapter, merged 16-bit model and GGUF files, each behind its config flag;
    each pushed to config.hub_repo (with a suffix per kind) when one is set.

    Args:
        model: the trained model, with the export methods FastModel attaches.
        tokenizer: its tokenizer.
        config: the notebook's NotebookConfig (save_lora, save_merged, save_gguf,
            gguf_quants, output_dir, hub_repo, hub_token).

    Under a launcher (the notebook run as a script on several GPUs) only the main
    process saves: the others hold the same adapters (DDP keeps them equal) and would
    write the same files at the same time.

    Returns:
        What was written or pushed, by name ({} in the processes that leave it to the
        main one).
    """
    from slothkit.distributed import is_main_process

    if not is_main_process():
        return {}
    out = Path(config.output_dir)
    token = config.hub_token or None
    saved: dict[str, str] = {}
    if config.save_gguf:  # a bad GGUF_QUANTS is refused before anything is saved
        from slothkit.export.gguf import quantization_methods

        gguf_methods = quantization_methods(config.gguf_quants)
    if config.save_lora:
        result = model.save_pretrained_merged(out / "lora", tokenizer, save_method="lora", overwrite=True)
        saved["lora"] = str(result.path)
        if config.hub_repo:
            push = model.push_to_hub_merged(
                f"{config.hub_repo}-lora", tokenizer, save_method="lora", token=token
            )
            saved["lora (hub)"] = str(getattr(push, "url", push))
    if config.save_merged:
        result = model.save_pretrained_merged(
            out / "merged-16bit", tokenizer, save_method="merged_16bit", overwrite=True
        )
        saved["merged_16bit"] = str(result.path)
        if config.hub_repo:
            push = model.push_to_hub_merged(
                config.hub_repo, tokenizer, save_method="merged_16bit", token=token
            )
            saved["merged (hub)"] = str(getattr(push, "url", push))
    if config.save_gguf:
        paths = model.save_pretrained_gguf(
            out / "gguf", tokenizer, quantization_method=gguf_methods, overwrite=True
        )
        for path in paths if isinstance(paths, (list, tuple)) else [paths]:
            saved[f"gguf {Path(str(path)).name}"] = str(path)
        if config.hub_repo:
            push = model.push_to_hub_gguf(
                f"{config.hub_repo}-gguf", tokenizer, quantization_method=gguf_methods, token=token
            )
            saved["gguf (hub)"] = str(getattr(push, "url", push))
    return saved
