# %% Save: the LoRA adapter, the merged 16-bit model, GGUF files (each behind its Config flag)
from slothkit.core.distributed import is_main_process
from slothkit.notebook.saving import list_files

out = config.output_dir
if is_main_process():  # under a multi-GPU launch every process holds the same adapters: one saves
    if config.save_lora:  # the adapter alone (megabytes), loaded on top of the base model
        model.save_pretrained(f"{out}/lora")
        tokenizer.save_pretrained(f"{out}/lora")
    if config.save_merged:  # base and adapter as one 16-bit checkpoint, for transformers, vLLM, ...
        model.save_pretrained_merged(
            f"{out}/merged-16bit", tokenizer, save_method="merged_16bit", overwrite=True
        )
    if config.save_gguf:  # for llama.cpp, Ollama (a Modelfile beside each file) and LM Studio
        model.save_pretrained_gguf(
            f"{out}/gguf", tokenizer, quantization_method=config.gguf_quants, overwrite=True
        )
    list_files(out)

# %% Publish to the Hugging Face Hub (when HUB_REPO is set)
if config.hub_repo and is_main_process():
    token = config.hub_token or None  # None: HF_TOKEN, else the login `hf auth login` saved
    if config.save_lora:
        pushed = model.push_to_hub_merged(f"{config.hub_repo}-lora", tokenizer, save_method="lora", token=token)
        print(pushed.commit_url)
    if config.save_merged:
        pushed = model.push_to_hub_merged(config.hub_repo, tokenizer, save_method="merged_16bit", token=token)
        print(pushed.commit_url)
    if config.save_gguf:
        pushed = model.push_to_hub_gguf(
            f"{config.hub_repo}-gguf", tokenizer, quantization_method=config.gguf_quants, token=token
        )
        print(pushed.commit_url)
