"""Unsloth's public notebooks run whole on slothkit with only their imports changed.

Each script in unsloth_notebooks/ makes one notebook's calls in its order with its
keyword arguments (written in slothkit's own words; the notebooks' text is not copied),
pointed at a tiny offline model and a few records in memory; its docstring lists every
other line that differs and why.  Each test runs a script to its end in a fresh folder and
checks what came out: the loss is finite and the adapters moved, generation decodes, the
saved adapter reloads to the trained model's logits, the merged model gives the adapted
model's logits, and the GGUF files parse (and, where llama-cpp-python is installed, were
verified against the model as they were written).
"""

import math
import os
import runpy
import warnings
from pathlib import Path

import numpy as np
import pytest
import torch

pytest.importorskip("trl")

from slothkit.core.notices import SlothkitNotice, say_once  # noqa: E402

os.environ.setdefault("HF_HUB_OFFLINE", "1")
SCRIPTS = Path(__file__).resolve().parent / "unsloth_notebooks"
PROBE = "Here is a task, with context where there is some. Answer it.\n\n### Task:\nAdd 2 and 3."


@pytest.fixture
def notebook_folder(monkeypatch, tmp_path):
    """A fresh folder to run in, on the kernels' torch references (the Triton interpreter
    costs seconds a step), with each notice shown afresh and recorded."""
    monkeypatch.chdir(tmp_path)
    interpreter = os.environ.get("TRITON_INTERPRET")
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    say_once.cache_clear()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        yield tmp_path, caught
    # Dataset maps with num_proc > 1 leave TRITON_INTERPRET=0 behind in os.environ past
    # monkeypatch's undo; later tests that need the interpreter get it back here.
    if interpreter is None:
        os.environ.pop("TRITON_INTERPRET", None)
    else:
        os.environ["TRITON_INTERPRET"] = interpreter


def _run(name: str, **given) -> dict:
    """The script's globals after running it to its end."""
    return runpy.run_path(str(SCRIPTS / f"{name}.py"), init_globals=given, run_name="__main__")


def _notices(caught) -> list[str]:
    return [str(w.message) for w in caught if issubclass(w.category, SlothkitNotice)]


def _assert_trained(trainer):
    """The loss of every logged step and of the run is finite, and the adapters moved
    (PEFT starts every lora_B at zero)."""
    losses = [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]
    losses.append(trainer.state.log_history[-1]["train_loss"])
    assert all(math.isfinite(loss) for loss in losses), losses
    assert trainer.state.global_step == trainer.args.max_steps
    moved = [n for n, p in trainer.model.named_parameters() if "lora_B" in n and p.detach().abs().max() > 0]
    assert moved


def _assert_loss_fell(trainer, rows=16):
    """The trained adapters lower the loss on the first `rows` training rows below the base
    model's (the adapters off), each row's loss on the labels the trainer learned from."""
    model = trainer.model.eval()

    def mean_loss():
        losses = []
        with torch.no_grad():
            for row in trainer.train_dataset.select(range(min(rows, len(trainer.train_dataset)))):
                ids = torch.tensor([row["input_ids"]], device=model.device)
                labels = torch.tensor([row.get("labels", row["input_ids"])], device=model.device)
                losses.append(model(input_ids=ids, labels=labels).loss.float().item())
        return sum(losses) / len(losses)

    trained = mean_loss()
    with model.disable_adapter():
        base = mean_loss()
    assert trained < base, (trained, base)


def _logits(model, tokenizer, text=PROBE):
    model.eval()
    inputs = tokenizer([text], return_tensors="pt").to(model.device)
    with torch.no_grad():
        return model(**inputs).logits.float()


def _assert_close(actual, expected, rounded_to_16_bits=False):
    # fp32 on the CPU: the same weights by another route (W + BA merged, or reloaded) agree
    # to rounding, which grows with the logits' size; weights rounded to 16 bits (a merged
    # 16-bit save) or 16-bit and 4-bit models on a GPU: to a few hundredths of the largest
    # logit. (tests/slothkit/export checks a merged save's weights bit for bit.)
    largest = max(1.0, expected.abs().max().item())
    exact = not torch.cuda.is_available() and not rounded_to_16_bits
    tolerance = 1e-5 * largest if exact else 3e-2 * largest
    assert (actual - expected).abs().max().item() <= tolerance


def _assert_reloaded(ns, trainer):
    """The notebook's reload cell gave a trainable PeftModel with the trained logits."""
    from peft import PeftModel

    reloaded = ns["model"]
    assert isinstance(reloaded, PeftModel) and reloaded is not trainer.model
    assert any(p.requires_grad for n, p in reloaded.named_parameters() if "lora_" in n)
    _assert_close(_logits(reloaded, ns["tokenizer"]), _logits(trainer.model, ns["tokenizer"]))


def _assert_merged(folder, ns):
    """The merged model loads with plain transformers, is stored in 16 bits, and gives the
    adapted model's logits to the rounding of its weights to 16 bits."""
    from transformers import AutoModelForCausalLM

    merged = AutoModelForCausalLM.from_pretrained(str(folder))
    assert merged.dtype in (torch.bfloat16, torch.float16), f"merged_16bit stored {merged.dtype}"
    merged = merged.float().to(ns["model"].device)
    _assert_close(
        _logits(merged, ns["tokenizer"]), _logits(ns["model"], ns["tokenizer"]), rounded_to_16_bits=True
    )
    return merged


def _assert_gguf(folder, labels=("Q8_0", "F16", "Q4_K_M"), rope_factor=None):
    """One parsable GGUF file and Modelfile per quantisation, all with the same tensors,
    the files named after the model (MODEL.LABEL.gguf, the same MODEL for each)."""
    from gguf import GGUFReader

    names = None
    stems = set()
    for label in labels:
        (path,) = folder.glob(f"*.{label}.gguf")
        stems.add(path.name.removesuffix(f".{label}.gguf"))
        reader = GGUFReader(str(path))
        tensors = sorted(t.name for t in reader.tensors)
        assert tensors and (names is None or tensors == names)
        names = tensors
        arch = bytes(reader.fields["general.architecture"].parts[-1]).decode()
        factor = reader.fields.get(f"{arch}.rope.scaling.factor")
        assert (factor.parts[-1][0] if factor else None) == pytest.approx(rope_factor)
    assert len(stems) == 1 and not stems & {"", "gguf"}, stems
    modelfiles = {p.name for p in folder.glob("Modelfile*")}
    assert modelfiles == {"Modelfile"} | {f"Modelfile.{label}" for label in labels[1:]}


def _assert_answers_decode(ns):
    """The last `outputs` an inference cell made decode to its prompt and new text."""
    outputs = ns["outputs"]
    (text,) = ns["tokenizer"].batch_decode(outputs, skip_special_tokens=True)
    (prompt,) = ns["tokenizer"].batch_decode(
        outputs[:, : ns["inputs"]["input_ids"].shape[1]], skip_special_tokens=True
    )
    assert outputs.shape[1] > ns["inputs"]["input_ids"].shape[1] and text.startswith(prompt) and prompt


def _assert_saved_lora_is_trained(folder, model):
    """model.save_lora wrote the model's adapter tensors exactly (and its tokenizer)."""
    from peft.utils import get_peft_model_state_dict
    from safetensors.torch import load_file

    saved = load_file(folder / "adapter_model.safetensors")
    trained = get_peft_model_state_dict(model)
    assert saved.keys() == trained.keys() and all(torch.equal(saved[k], trained[k].cpu()) for k in saved)
    assert (folder / "tokenizer_config.json").is_file()


def test_llama3_alpaca(notebook_folder):
    folder, caught = notebook_folder
    ns = _run("llama3_alpaca")
    trainer = ns["trainer"]
    _assert_trained(trainer)
    notices = _notices(caught)
    for expected in (
        "SFTTrainer(tokenizer=...) is written SFTTrainer(processing_class=...)",
        "SFTTrainer(max_seq_length=...) is written SFTConfig(max_length=...)",
        "SFTTrainer(dataset_text_field=...) is written SFTConfig(dataset_text_field=...)",
        "SFTTrainer(packing=...) is written SFTConfig(packing=...)",
    ):
        assert sum(expected in notice for notice in notices) == 1, (expected, notices)
    assert (trainer.args.max_length, trainer.args.dataset_text_field, trainer.args.packing) == (
        2048,
        "text",
        False,
    )
    _assert_answers_decode(ns)
    _assert_reloaded(ns, trainer)
    # The reloaded model generates what the trained one does.
    inputs = ns["tokenizer"]([PROBE], return_tensors="pt").to(trainer.model.device)
    expected = trainer.model.generate(**inputs, max_new_tokens=8, do_sample=False)
    assert torch.equal(ns["model"].generate(**inputs, max_new_tokens=8, do_sample=False), expected)
    _assert_merged(folder / "llama_finetune_16bit", ns)
    _assert_gguf(folder / "llama_finetune")


def test_llama3_alpaca_older_with_training_arguments(notebook_folder):
    folder, caught = notebook_folder
    ns = _run("llama3_alpaca_older")
    trainer = ns["trainer"]
    _assert_trained(trainer)
    assert any(
        "SFTTrainer(args=TrainingArguments(...)) is written SFTTrainer(args=SFTConfig(...))" in n
        for n in _notices(caught)
    )
    assert (trainer.args.dataset_num_proc, trainer.args.weight_decay, trainer.args.warmup_steps) == (
        2,
        0.01,
        5,
    )
    _assert_answers_decode(ns)
    _assert_reloaded(ns, trainer)
    # Every save went into "model": the LoRA replaced the merged model, the GGUF files joined it.
    saved = folder / "model"
    assert (saved / "adapter_config.json").is_file() and not (saved / "config.json").exists()
    _assert_gguf(saved)


def test_mistral_v03_alpaca(notebook_folder):
    folder, _ = notebook_folder
    ns = _run("mistral_v03_alpaca")
    _assert_trained(ns["trainer"])
    _assert_answers_decode(ns)
    _assert_reloaded(ns, ns["trainer"])
    _assert_merged(folder / "mistral_v0_finetune_16bit", ns)
    _assert_gguf(folder / "mistral_v0_finetune")


def _assert_replies_alone_are_learned(ns, turn_end):
    """The notebook's check cell: the prompt is masked in the trainer's dataset itself, and
    what is left of each row is its replies, each closed by the turn's end."""
    tokenizer, trainer, dataset = ns["tokenizer"], ns["trainer"], ns["dataset"]
    for index, record in enumerate(dataset):
        labels = trainer.train_dataset[index]["labels"]
        assert labels[0] == -100
        kept = tokenizer.decode([label for label in labels if label != -100])
        replies = [m["content"] for m in record["conversations"] if m["role"] == "assistant"]
        assert kept == "".join(reply + turn_end for reply in replies)


def _assert_eight_bit_adam(trainer):
    """optim="adamw_8bit" ran bitsandbytes' Adam with 8-bit moments, on a CPU too (tensors
    under its min_8bit_size, such as a tiny model's LoRA matrices, keep 32-bit moments)."""
    optimizer = getattr(trainer.optimizer, "optimizer", trainer.optimizer)
    assert type(optimizer).__module__.startswith("bitsandbytes.optim") and optimizer.args.optim_bits == 8
    states = [(p, optimizer.state[p]) for group in optimizer.param_groups for p in group["params"]]
    assert states and all(len(state) > 0 for _, state in states)  # every tensor took a step
    assert all(
        state["state1"].dtype == (torch.uint8 if p.numel() >= optimizer.args.min_8bit_size else torch.float32)
        for p, state in states
    )


def _assert_merged_4bit(folder, ns):
    """The merged 4-bit model loads with transformers and bitsandbytes (NF4) on this device,
    within NF4's rounding of every projection of the trained model (about 0.3 of the logits'
    rms on the tiny random models, see tests/slothkit/export/test_save.py)."""
    from transformers import AutoModelForCausalLM

    loaded = AutoModelForCausalLM.from_pretrained(str(folder)).to(ns["model"].device)
    assert type(loaded.get_parameter("model.layers.0.self_attn.q_proj.weight")).__name__ == "Params4bit"
    got, expected = _logits(loaded, ns["tokenizer"]), _logits(ns["model"], ns["tokenizer"])
    assert ((got - expected).pow(2).mean().sqrt() / expected.pow(2).mean().sqrt()).item() < 0.5


def test_llama32_conversational(notebook_folder):
    folder, caught = notebook_folder
    ns = _run("llama32_conversational")
    tokenizer, trainer, dataset = ns["tokenizer"], ns["trainer"], ns["dataset"]
    # standardize_sharegpt keeps the column and FineTome's others, in role/content.
    assert dataset.column_names[:3] == ["conversations", "source", "score"]
    assert dataset[1]["conversations"][0] == {"role": "user", "content": "What is 7 times 6?"}
    from slothkit.chat_templates import standardize_data_formats

    raw = ns["Dataset"].from_list([{"conversations": ns["turns"]("What is 7 times 6?", "42.")}])
    assert standardize_data_formats(raw)[0]["conversations"] == dataset[1]["conversations"]
    # One BOS a row: the one the formatter wrote is dropped, tokenizing adds its own.
    assert [row["input_ids"].count(tokenizer.bos_token_id) for row in trainer.train_dataset] == [1] * len(
        dataset
    )
    _assert_replies_alone_are_learned(ns, "<|eot_id|>")
    _assert_trained(trainer)
    _assert_eight_bit_adam(trainer)
    # apply_chat_template(..., return_tensors="pt") gave transformers 4's tensor, which
    # generate(input_ids=inputs) takes as it is (no dict to unpack, so no notice).
    assert isinstance(ns["inputs"], torch.Tensor) and ns["inputs"].dim() == 2
    assert not any("is written model.generate(**inputs)" in n for n in _notices(caught))
    inputs, model = ns["inputs"], ns["model"]
    given_as_ids = model.generate(input_ids=inputs, max_new_tokens=6, do_sample=False)
    assert torch.equal(given_as_ids, model.generate(**inputs, max_new_tokens=6, do_sample=False))
    _assert_answers_decode(ns)
    _assert_reloaded(ns, trainer)
    _assert_merged(folder / "llama_finetune_16bit", ns)
    _assert_merged_4bit(folder / "llama_finetune_4bit", ns)
    _assert_gguf(folder / "llama_finetune")


def test_codegemma_conversational(notebook_folder):
    folder, caught = notebook_folder
    ns = _run("codegemma_conversational")
    tokenizer, trainer = ns["tokenizer"], ns["trainer"]
    notices = _notices(caught)
    assert any(
        "exceeds this model's context of 2048 tokens: RoPE is scaled linearly by 2" in n for n in notices
    )
    assert any("has a 'text' column and 'conversations': slothkit trains on 'text'" in n for n in notices)
    # map_eos_token=True: ChatML's <|im_end|>, which the tokenizer lacks, is written as its
    # EOS (the notebook's "Maps <|im_end|> to </s> instead"); <|im_start|> stays text, and
    # nothing is added, said once.
    assert any("no token '<|im_end|>', so each turn ends with its EOS '</s>'" in n for n in notices)
    assert tokenizer.eos_token == "</s>" and "<|im_start|>" not in tokenizer.get_vocab()
    assert len(tokenizer) == 640 and ns["model"].get_input_embeddings().weight.shape[0] >= len(tokenizer)
    row = trainer.train_dataset[0]["input_ids"]
    # Each turn's end, then the EOS TRL appends to a text that ends in "\n" rather than EOS.
    assert row.count(tokenizer.eos_token_id) == 3 and tokenizer.decode(row).count("<|im_start|>user\n") == 1
    _assert_trained(trainer)
    _assert_answers_decode(ns)
    _assert_reloaded(ns, trainer)
    merged = _assert_merged(folder / "codegemma_finetune_16bit", ns)
    assert merged.config.rope_parameters["factor"] == 2.0 and merged.config.max_position_embeddings == 4096
    _assert_gguf(folder / "codegemma_finetune", rope_factor=2.0)


def test_gemma3_conversational(notebook_folder):
    """Unsloth's Gemma 3 (4B) notebook on an image-text Gemma 3, as gemma-3-4b-it is: its
    finetune_* flags, content as typed parts, apply_chat_template's text into
    tokenizer([text]), and save_pretrained_gguf without a tokenizer and with
    quantization_type."""
    from peft import PeftModel

    from slothkit import FastModel

    folder, caught = notebook_folder
    ns = _run("gemma3_conversational")
    model, tokenizer, trainer = ns["model"], ns["tokenizer"], ns["trainer"]
    assert type(model.get_base_model()).__name__ == "Gemma3ForCausalLM"
    adapted = {name.split(".")[-1] for name, module in model.named_modules() if hasattr(module, "lora_A")}
    assert adapted == {"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"}
    notices = _notices(caught)
    assert sum("multimodal gemma3 checkpoint" in n for n in notices) == 1
    assert any("quantization_type='Q8_0') is written quantization_method='Q8_0'" in n for n in notices)
    assert ns["text"].endswith("<start_of_turn>model\n") and "1, 1, 2, 3, 5, 8," in ns["text"]
    # The replies alone are learned, each closed by its turn's end; TRL appends EOS
    # (<end_of_turn>, map_eos_token) to the text, which ends in a newline.
    for index, record in enumerate(ns["dataset"]):
        labels = trainer.train_dataset[index]["labels"]
        kept = tokenizer.decode([label for label in labels if label != -100])
        replies = [m["content"] for m in record["conversations"] if m["role"] == "assistant"]
        assert kept == "".join(reply + "<end_of_turn>\n" for reply in replies) + "<end_of_turn>"
    _assert_trained(trainer)
    _assert_eight_bit_adam(trainer)
    _assert_answers_decode(ns)
    reloaded, _ = FastModel.from_pretrained("gemma-3", load_in_4bit=False)
    assert isinstance(reloaded, PeftModel)
    _assert_close(_logits(reloaded, tokenizer), _logits(model, tokenizer))
    _assert_merged(folder / "gemma-3-finetune", ns)
    _assert_gguf(folder / "gemma-3-finetune", labels=("Q8_0",))


def _image_batch_logits(model, batch):
    model.eval()
    with torch.no_grad():
        return model(**{k: v.to(model.device) for k, v in batch.items()}).logits.float()


def test_qwen25_vl_latex_ocr(notebook_folder):
    """Unsloth's Qwen2.5-VL (7B) LaTeX OCR notebook (on the tiny Qwen2.5-VL where its processor
    builds, else the tiny image-text Gemma 3): FastVisionModel with every finetune_* flag on,
    the processor called with the image and the chat template's text, UnslothVisionDataCollator
    with SFTConfig's skip_prepare_dataset, and both saves, which plain transformers and PEFT
    load back to the trained model's logits on an image batch."""
    from peft import PeftModel
    from transformers import AutoModelForImageTextToText, AutoProcessor

    folder, caught = notebook_folder
    ns = _run("qwen25_vl_latex_ocr")
    model, processor, trainer = ns["model"], ns["tokenizer"], ns["trainer"]
    adapted = {n.split(".lora_A")[0] for n, _ in model.named_parameters() if ".lora_A" in n}
    towers = ("vision_tower", "visual")
    assert any(t in n for n in adapted for t in towers) and any(
        all(t not in n for t in towers) for n in adapted
    )
    notices = _notices(caught)
    assert any("SFTTrainer(tokenizer=...) is written SFTTrainer(processing_class=...)" in n for n in notices)
    assert any("SFTConfig(max_seq_length=...) is written max_length=..." in n for n in notices)
    _assert_trained(trainer)
    outputs, prompt_length = ns["outputs"], ns["inputs"]["input_ids"].shape[1]
    assert outputs.shape[1] > prompt_length
    assert torch.equal(outputs[:, :prompt_length].cpu(), ns["inputs"]["input_ids"].cpu())

    batch = ns["UnslothVisionDataCollator"](model, processor)(ns["converted_dataset"][:2])
    trained = _image_batch_logits(model, batch)
    base = AutoModelForImageTextToText.from_pretrained(ns["MODEL"], dtype=torch.float32)
    reloaded = PeftModel.from_pretrained(base, str(folder / "lora_model"))
    _assert_close(_image_batch_logits(reloaded, batch), trained)
    merged = AutoModelForImageTextToText.from_pretrained(str(folder / "unsloth_finetune"))
    assert merged.dtype in (torch.bfloat16, torch.float16), f"merged_16bit stored {merged.dtype}"
    _assert_close(_image_batch_logits(merged.float(), batch), trained, rounded_to_16_bits=True)
    reloaded_processor = AutoProcessor.from_pretrained(str(folder / "unsloth_finetune"))
    assert reloaded_processor.apply_chat_template(
        ns["messages"], add_generation_prompt=True
    ) == processor.apply_chat_template(ns["messages"], add_generation_prompt=True)


def test_gemma3_vision(notebook_folder):
    """Unsloth's Gemma 3 (4B) Vision notebook: target_modules="all-linear" with the embeddings
    and head trained in full, get_chat_template on the processor (its own template kept: it
    places the images), processing_class=processor.tokenizer, SFTConfig's
    gradient_checkpointing (slothkit's stays) and warmup_ratio; the saved adapter and the
    merged 16-bit model load back with PEFT and transformers to the trained logits."""
    from peft import PeftModel
    from transformers import AutoModelForImageTextToText

    folder, caught = notebook_folder
    ns = _run("gemma3_vision")
    model, processor, trainer = ns["model"], ns["processor"], ns["trainer"]
    notices = _notices(caught)
    assert any("renders the gemma format and places the images: kept" in n for n in notices)
    assert any("SFTConfig(warmup_ratio=0.03) is written warmup_steps=0.03" in n for n in notices)
    trained_in_full = {
        n.split(".modules_to_save")[0] for n, _ in model.named_parameters() if "modules_to_save" in n
    }
    assert {name.rsplit(".", 1)[-1] for name in trained_in_full} == {"lm_head", "embed_tokens"}
    assert any("vision_tower" in n and "lora_A" in n for n, _ in model.named_parameters())
    _assert_trained(trainer)
    prompt_length = ns["inputs"]["input_ids"].shape[1]
    assert ns["result"].shape[1] > prompt_length

    batch = ns["UnslothVisionDataCollator"](model, processor)(ns["converted_dataset"][:2])
    trained = _image_batch_logits(model, batch)
    base = AutoModelForImageTextToText.from_pretrained(ns["MODEL"], dtype=torch.float32)
    reloaded = PeftModel.from_pretrained(base, str(folder / "lora_model"))
    _assert_close(_image_batch_logits(reloaded, batch), trained)
    merged = AutoModelForImageTextToText.from_pretrained(str(folder / "unsloth_finetune"))
    assert merged.dtype in (torch.bfloat16, torch.float16), f"merged_16bit stored {merged.dtype}"
    _assert_close(_image_batch_logits(merged.float(), batch), trained, rounded_to_16_bits=True)


def test_llama32_vision(notebook_folder):
    """Unsloth's Llama 3.2 (11B) Vision radiography notebook on the tiny Mllama: every
    finetune_* flag on (the cross-attention layers and both vision encoders adapted), the
    processor called with the image and the chat template's text, UnslothVisionDataCollator
    with SFTConfig's skip_prepare_dataset; the saved adapter reloads through
    FastVisionModel.from_pretrained to the trained model's logits and greedy answer, and its
    merged 16-bit save, with the processor, loads in plain transformers to the same logits."""
    from peft import PeftModel
    from transformers import AutoModelForImageTextToText, AutoProcessor

    folder, caught = notebook_folder
    ns = _run("llama32_vision")
    trainer, reloaded, processor = ns["trainer"], ns["model"], ns["tokenizer"]
    trained_model = trainer.model
    adapted = {n.split(".lora_A")[0] for n, _ in trained_model.named_parameters() if ".lora_A" in n}
    for part in (".cross_attn.", ".vision_model.transformer.", ".vision_model.global_transformer."):
        assert any(part in n for n in adapted), part
    assert any(
        "SFTTrainer(tokenizer=...) is written SFTTrainer(processing_class=...)" in n for n in _notices(caught)
    )
    _assert_trained(trainer)
    prompt_length = ns["inputs"]["input_ids"].shape[1]
    assert ns["outputs"].shape[1] > prompt_length
    # The reloaded adapter answers as the trained model did (greedy: the notebook's sampling
    # flags are not set on without do_sample).
    assert isinstance(reloaded, PeftModel) and reloaded is not trained_model
    assert torch.equal(ns["reloaded_outputs"].cpu(), ns["outputs"].cpu())

    batch = ns["UnslothVisionDataCollator"](trained_model, processor)(ns["converted_dataset"][:2])
    assert "cross_attention_mask" in batch
    trained = _image_batch_logits(trained_model, batch)
    _assert_close(_image_batch_logits(reloaded, batch), trained)
    merged = AutoModelForImageTextToText.from_pretrained(str(folder / "unsloth_finetune"))
    assert merged.dtype in (torch.bfloat16, torch.float16), f"merged_16bit stored {merged.dtype}"
    _assert_close(_image_batch_logits(merged.float(), batch), trained, rounded_to_16_bits=True)
    reloaded_processor = AutoProcessor.from_pretrained(str(folder / "unsloth_finetune"))
    assert type(reloaded_processor).__name__ == "MllamaProcessor"
    assert reloaded_processor.apply_chat_template(
        ns["messages"], add_generation_prompt=True
    ) == processor.apply_chat_template(ns["messages"], add_generation_prompt=True)


def test_qwen3_reasoning_conversational(notebook_folder, capsys):
    """Unsloth's Qwen3 (14B) Reasoning-Conversational notebook: a list of conversations
    through apply_chat_template at once, a pandas mixture of reasoning and chat rows into
    Dataset.from_pandas, enable_thinking on and off, streamed sampling, both merged saves
    and three GGUFs into one folder."""
    folder, _ = notebook_folder
    ns = _run("qwen3_reasoning_conversational")
    tokenizer, trainer = ns["tokenizer"], ns["trainer"]
    # A reasoning reply keeps its own <think> block; a chat reply after the last user turn
    # gets Qwen3's empty one, the earlier replies none.
    problem, reply = ns["reasoning_dataset"][0]["problem"], ns["reasoning_dataset"][0]["generated_solution"]
    assert ns["reasoning_conversations"][0] == (
        f"<|im_start|>user\n{problem}<|im_end|>\n<|im_start|>assistant\n{reply}<|im_end|>\n"
    )
    assert ns["non_reasoning_conversations"][1] == (
        "<|im_start|>user\nSay hi.<|im_end|>\n<|im_start|>assistant\nHi!<|im_end|>\n"
        "<|im_start|>user\nAgain?<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\nHi again!<|im_end|>\n"
    )
    mixture = ns["reasoning_conversations"] + list(ns["non_reasoning_subset"])
    assert len(ns["non_reasoning_subset"]) >= 1 and sorted(ns["combined_dataset"]["text"]) == sorted(mixture)
    # Each training row is its text (and the EOS TRL appends), the pandas index column aside.
    for index, text in enumerate(ns["combined_dataset"]["text"]):
        assert (
            tokenizer.decode(trainer.train_dataset[index]["input_ids"]).removesuffix(tokenizer.eos_token)
            == text
        )
    _assert_trained(trainer)
    _assert_eight_bit_adam(trainer)
    # enable_thinking=False closes the thinking block in the prompt; True leaves it to the model.
    prompt, outputs = ns["no_thinking"]
    assert prompt.endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")
    assert ns["text"].endswith("<|im_start|>assistant\n") and ns["text"] + "<think>\n\n</think>\n\n" == prompt
    prompt_length = len(tokenizer(prompt)["input_ids"])
    assert outputs.shape[1] > prompt_length
    streamed = tokenizer.decode(outputs[0, prompt_length:])
    assert streamed.strip() and streamed in capsys.readouterr().out
    _assert_reloaded(ns, trainer)
    _assert_merged(folder / "model_16bit", ns)
    _assert_merged_4bit(folder / "model_4bit", ns)
    _assert_gguf(folder / "model")


def test_qwen3_grpo(notebook_folder):
    """Unsloth's Qwen3 (4B) GRPO notebook: a reasoning chat template, an SFT stage on
    prompts measured with len(apply_chat_template(...)), GRPO with vllm_sampling_params and
    a batch of one (raised to whole groups), fast_generate before and with the saved LoRA,
    and every save."""
    folder, caught = notebook_folder
    ns = _run("qwen3_grpo")
    tokenizer, trainer = ns["tokenizer"], ns["trainer"]
    # The lengths are token counts (transformers 5's dict would give 2 for every row).
    prompts = [
        tokenizer.apply_chat_template(p, add_generation_prompt=True, tokenize=False)
        for p in ns["dataset"]["prompt"]
    ]
    assert all(length > 10 for length in ns["prompt_lengths"] + ns["pre_format_lengths"])
    assert (
        max(len(tokenizer(p, add_special_tokens=False)["input_ids"]) for p in prompts) <= ns["maximum_length"]
    )
    assert ns["maximum_length"] == int(np.quantile(ns["prompt_lengths"], 0.9))
    _assert_trained(ns["pre_format_trainer"])
    _assert_trained(trainer)
    args = trainer.args
    assert (args.per_device_train_batch_size, args.num_generations, args.generation_batch_size) == (4, 4, 4)
    assert (args.min_p, args.top_k, args.temperature, args.use_vllm) == (0.1, 0, 1.0, False)
    assert args.max_prompt_length == ns["maximum_length"] + 1
    rewards = [entry["reward"] for entry in trainer.state.log_history if "reward" in entry]
    assert len(rewards) == 2 and all(math.isfinite(r) for r in rewards)
    notices = _notices(caught)
    for expected in (
        "fast_inference=True, gpu_memory_utilization=..., max_lora_rank=...) needs no vLLM engine",
        "GRPOConfig(per_device_train_batch_size=1, num_generations=4): each generation batch must hold whole groups",
    ):
        assert sum(expected in notice for notice in notices) == 1, (expected, notices)
    # The two answers decode; the LoRA saved is the trained one.
    assert isinstance(ns["output"], str) and ns["output"]
    _assert_saved_lora_is_trained(folder / "grpo_saved_lora", ns["model"])
    _assert_merged(folder / "model_16bit", ns)
    _assert_merged_4bit(folder / "model_4bit", ns)
    assert (folder / "model" / "adapter_config.json").is_file()
    _assert_gguf(folder / "model")


def test_qwen25_grpo(notebook_folder):
    """Unsloth's Qwen2.5 (3B) GRPO notebook: GSM8K chat prompts (one past
    max_prompt_length, left out), use_vllm=True, a batch of one raised to the group of 8,
    fast_generate without and with the saved LoRA."""
    folder, caught = notebook_folder
    ns = _run("qwen25_grpo")
    trainer = ns["trainer"]
    # Two steps at 5e-6 after warmup, where a random model's completions all score alike
    # (no advantage, so no gradient): the steps ran and logged, the adapters need not move.
    logged = [entry for entry in trainer.state.log_history if "reward" in entry]
    assert trainer.state.global_step == 2 and len(logged) == 2
    assert all(math.isfinite(entry["loss"]) and math.isfinite(entry["reward"]) for entry in logged)
    args = trainer.args
    assert (args.use_vllm, args.per_device_train_batch_size, args.generation_batch_size) == (False, 8, 8)
    assert len(trainer.train_dataset) == len(ns["dataset"]) - 1
    assert all("farmer" not in p[-1]["content"] for p in trainer.train_dataset["prompt"])
    notices = _notices(caught)
    for expected in (
        "GRPOConfig(use_vllm=True): slothkit samples the completions through its own fast decode loop",
        "GRPOConfig(per_device_train_batch_size=1, num_generations=8): each generation batch must hold",
        "max_prompt_length=256: 1 of 6 prompts are longer (the longest, prompt 4,",
    ):
        assert sum(expected in notice for notice in notices) == 1, (expected, notices)
    assert isinstance(ns["output"], str)
    _assert_saved_lora_is_trained(folder / "grpo_saved_lora", ns["model"])


def test_llama3_ollama(notebook_folder, capsys):
    """Unsloth's Llama-3 Ollama notebook: to_sharegpt with an optional part and three
    exchanges a conversation, a prompt with {INPUT} and {OUTPUT} as the chat template,
    generate on its BatchEncoding, and a GGUF whose Modelfile writes that prompt."""
    folder, _ = notebook_folder
    ns = _run("llama3_ollama")
    tokenizer, trainer = ns["tokenizer"], ns["trainer"]
    _assert_trained(trainer)
    texts = ns["dataset"]["text"]
    assert all(
        text.count("### Instruction:\n") == 3 and text.count(tokenizer.eos_token) == 3 for text in texts
    )
    assert "Add the numbers.\nYour input is:\n2 and 3\n\n### Response:\n5" + tokenizer.eos_token in "".join(
        texts
    )
    assert "Say hello.\n\n### Response:\nHello!" in "".join(texts)  # no input: no "Your input is"
    prompt_ids, outputs = ns["first_answer"]
    prompt = tokenizer.decode(prompt_ids["input_ids"][0])
    assert prompt.endswith(
        "### Instruction:\nContinue the fibonacci sequence! Your input is 1, 1, 2, 3, 5, 8,\n\n### Response:\n"
    )
    assert outputs.shape[1] > prompt_ids["input_ids"].shape[1]
    modelfile = (folder / "model" / "Modelfile").read_text()
    template = modelfile.split('TEMPLATE """')[1].split('"""')[0]
    assert template == ns["chat_template"].replace("{INPUT}", "{{ .Prompt }}").replace(
        "{OUTPUT}", "{{ .Response }}" + tokenizer.eos_token
    )
    assert 'PARAMETER stop "### Instruction:"' in modelfile
    assert (
        tokenizer._ollama_modelfile.split("\n", 1)[1]
        == modelfile.split("\n", 1)[1].replace('PARAMETER stop "<|eot_id|>"\n', "")
        or tokenizer._ollama_modelfile.split("\n", 2)[1] == modelfile.split("\n", 2)[1]
    )
    assert tokenizer._ollama_modelfile in capsys.readouterr().out
    _assert_gguf(folder / "model", labels=("Q8_0",))


@pytest.mark.slow
def test_llama3_ollama_on_the_real_checkpoint(notebook_folder, smollm2_path):
    """The Ollama notebook on SmolLM2-135M-Instruct: its prompt template on a real tokenizer,
    the GGUF judged by llama.cpp on a prompt rendered with it (tokens, logits, greedy
    continuation), and the Modelfile writing that prompt as the template renders it."""
    from slothkit.export.gguf import verify_gguf

    folder, _ = notebook_folder
    ns = _run("llama3_ollama", MODEL=str(smollm2_path))
    trainer, tokenizer = ns["trainer"], ns["tokenizer"]
    _assert_trained(trainer)
    conversation = [{"role": "user", "content": "Add the numbers.\nYour input is:\n2 and 3"}]
    prompt = tokenizer.apply_chat_template(conversation, tokenize=False, add_generation_prompt=True)
    assert (
        prompt == ns["chat_template"].split("{INPUT}")[0] + conversation[0]["content"] + "\n\n### Response:\n"
    )
    (path,) = (folder / "model").glob("*.Q8_0.gguf")
    report = verify_gguf(path, trainer.model.eval(), tokenizer, "q8_0", prompts=(prompt,), greedy_tokens=8)
    # llama.cpp's greedy tokens, fed back to both: where one is not HF's argmax, HF's own
    # best logit must beat it by less than twice the file's measured logit error (a near
    # tie that q8_0's rounding may flip; a wrong file moves whole rows instead, which the
    # tolerance catches). This short training's continuation has such ties: on one CPU 5
    # of 8 tokens agreed exactly, the others 0.075 std apart at a logit error of 0.076.
    assert report.greedy_tokens == 8 and report.greedy_exact >= 4, report
    assert report.worst_greedy_gap <= 2 * report.logit_error, report
    modelfile = (folder / "model" / "Modelfile").read_text()
    go = modelfile.split('TEMPLATE """')[1].split('"""')[0]
    assert go.split("{{ .Response }}")[0].replace("{{ .Prompt }}", conversation[0]["content"]) == prompt
    assert 'PARAMETER stop "<|im_end|>"' in modelfile


def test_zephyr_dpo(notebook_folder):
    _, caught = notebook_folder
    ns = _run("zephyr_dpo")
    trainer = ns["dpo_trainer"]
    assert (trainer.args.beta, trainer.args.max_length, trainer.args.max_prompt_length) == (0.1, 1024, 512)
    assert trainer.args.warmup_steps == 0.1 and trainer.args.get_warmup_steps(2) == 1  # ceil(0.1 * 2)
    assert (
        sum("PatchDPOTrainer() does nothing" in n for n in _notices(caught)) == 1
    )  # called twice, said once
    # Each pair is the prompt and its reply, the prompt ending where the reply starts.
    row = ns["raw_datasets"]["train"][0]
    assert row["prompt"].endswith("<|start_header_id|>assistant<|end_header_id|>\n\n")
    assert row["chosen"] == "Mercury.<|eot_id|>" and row["rejected"] == "Jupiter.<|eot_id|>"
    _assert_trained(trainer)
    assert any("rewards/chosen" in entry for entry in trainer.state.log_history)


def test_llama3_orpo(notebook_folder):
    folder, _ = notebook_folder
    ns = _run("llama3_orpo")
    trainer = ns["orpo_trainer"]
    assert (trainer.args.max_length, trainer.args.max_completion_length, trainer._max_prompt_length) == (
        4096,
        2048,
        2048,
    )
    _assert_trained(trainer)
    _assert_answers_decode(ns)
    _assert_reloaded(ns, trainer)
    _assert_merged(folder / "llama_finetune_16bit", ns)
    _assert_gguf(folder / "llama_finetune", rope_factor=2.0)


def test_mistral_text_completion(notebook_folder):
    _, caught = notebook_folder
    ns = _run("mistral_text_completion")
    trainer = ns["trainer"]
    assert ns["model"].peft_config["default"].modules_to_save == ["embed_tokens", "lm_head"]
    assert any("modules_to_save=['embed_tokens', 'lm_head'] in PEFT" in n for n in _notices(caught))
    assert trainer.args.embedding_learning_rate == 5e-6
    # The embeddings' group starts at their own rate; the schedule scales both alike.
    assert sorted({group["initial_lr"] for group in trainer.optimizer.param_groups}) == [5e-6, 5e-5]
    _assert_trained(trainer)
    # The embeddings trained in full moved away from the frozen originals.
    embeddings = ns["model"].get_input_embeddings()
    assert (embeddings.modules_to_save["default"].weight - embeddings.original_module.weight).abs().max() > 0
    streamed = "".join(ns["streamed"]).removeprefix(ns["tokenizer"].bos_token).lstrip()
    assert streamed.startswith("Once upon a time, in a galaxy, far far away,") and len(streamed) > 45


@pytest.mark.slow
def test_zephyr_dpo_on_the_real_checkpoint(notebook_folder, smollm2_path):
    """The DPO notebook on SmolLM2-135M-Instruct: real weights, a real chat template (the
    notebooks with save cells cost minutes more on a 2-core CPU for the same calls)."""
    ns = _run("zephyr_dpo", MODEL=str(smollm2_path))
    trainer, tokenizer = ns["dpo_trainer"], ns["tokenizer"]
    assert ns["model"].peft_config["default"].r == 64  # the notebook's rank fits the real model
    for row in ns["raw_datasets"]["train"]:
        assert row["prompt"].endswith("<|im_start|>assistant\n") and row["chosen"].endswith("<|im_end|>\n")
    _assert_trained(trainer)
    logged = [entry for entry in trainer.state.log_history if "rewards/chosen" in entry]
    assert logged and all(math.isfinite(entry["logps/chosen"]) for entry in logged)
    assert tokenizer.eos_token == "<|im_end|>"


@pytest.mark.slow
def test_llama32_conversational_on_the_real_checkpoint(notebook_folder, smollm2_path):
    """The conversational notebook on SmolLM2-135M-Instruct, saves included: Llama 3.1's
    turn tokens are not in SmolLM2's tokenizer, so each turn ends with SmolLM2's EOS
    <|im_end|> and the header markers are text in ordinary pieces; nothing is added, so
    the embeddings and the tied head keep their 49,152 rows and the adapter holds the LoRA
    matrices alone. llama.cpp judges the GGUF files on a prompt rendered with the chat
    template: its tokens, logits and greedy continuation. (The same saves with the tokens
    added: tests/slothkit/export/test_added_token_saves.py.)"""
    from safetensors import safe_open

    from slothkit.export.gguf import verify_gguf

    folder, caught = notebook_folder
    ns = _run("llama32_conversational", MODEL=str(smollm2_path))
    trainer, tokenizer = ns["trainer"], ns["tokenizer"]  # the tokenizer saved with the adapter
    mapped = [
        n
        for n in _notices(caught)
        if "no token '<|eot_id|>', so each turn ends with its EOS '<|im_end|>'" in n
    ]
    assert len(mapped) == 1  # the notebook installs the template twice; said once
    markers = ["<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"]
    assert len(tokenizer) == 49152 and not set(markers) & set(tokenizer.get_vocab())
    assert tokenizer.eos_token == "<|im_end|>"
    assert trainer.model.get_input_embeddings().weight.shape[0] == 49152
    _assert_replies_alone_are_learned(ns, "<|im_end|>")
    _assert_trained(trainer)
    _assert_eight_bit_adam(trainer)
    adapter = folder / "llama_lora" / "adapter_model.safetensors"
    with safe_open(str(adapter), "pt") as weights:
        assert all("lora_" in name for name in weights.keys())  # no embedding rows saved
    lora_bytes = sum(
        p.numel() * p.element_size() for n, p in trainer.model.named_parameters() if "lora_" in n
    )
    print(f"\nadapter: {adapter.stat().st_size / 2**20:.1f} MiB; LoRA matrices {lora_bytes / 2**20:.1f} MiB")
    assert adapter.stat().st_size < lora_bytes + 2**20  # the matrices and a header, nothing more
    _assert_reloaded(ns, trainer)
    merged = _assert_merged(folder / "llama_finetune_16bit", ns)
    assert merged.get_input_embeddings().weight.shape[0] == 49152
    _assert_merged_4bit(folder / "llama_finetune_4bit", ns)

    # A question from the training data, whose first answer token the trained model picks
    # by a clear margin (SmolLM2 hesitates over the first token of "What is 7 times 6?").
    conversation = [{"role": "user", "content": "What is 2 + 2?"}]
    prompt = tokenizer.apply_chat_template(conversation, tokenize=False, add_generation_prompt=True)
    assert prompt == (
        "<|start_header_id|>user<|end_header_id|>\n\nWhat is 2 + 2?<|im_end|>"
        "<|start_header_id|>assistant<|end_header_id|>\n\n"
    )
    ids = tokenizer(prompt, return_tensors="pt")["input_ids"]
    assert ids.max().item() < 49152 and (ids == tokenizer.eos_token_id).sum().item() == 1
    trained = trainer.model.eval()
    # The merged model continues the chat greedily as the trained model does, wherever the
    # trained model's best token leads its second by more than 16-bit weights can move it.
    greedy = merged.generate(ids, max_new_tokens=8, do_sample=False)
    expected = trained.generate(input_ids=ids, max_new_tokens=8, do_sample=False)
    with torch.no_grad():
        logits = trained(input_ids=greedy).logits[0, ids.shape[1] - 1 : -1].float()
    top2 = logits.topk(2).values
    decided = (top2[:, 0] - top2[:, 1]) > 3e-2 * logits.abs().max()
    assert decided[0] and torch.equal(greedy[0, ids.shape[1] :][decided], logits.argmax(-1)[decided])
    assert torch.equal(greedy[0, : ids.shape[1] + 1], expected[0, : ids.shape[1] + 1])

    from gguf import GGUFReader

    for label, method in (("Q8_0", "q8_0"), ("F16", "f16")):
        (path,) = (folder / "llama_finetune").glob(f"*.{label}.gguf")
        fields = GGUFReader(str(path)).fields
        tokens = fields["tokenizer.ggml.tokens"]
        assert len(tokens.data) == 49152  # SmolLM2's vocabulary, as it was
        assert fields["tokenizer.ggml.eos_token_id"].parts[-1][0] == tokenizer.eos_token_id == 2
        # llama.cpp tokenises the rendered chat as HF does, and its logits and greedy tokens
        # agree with the trained model within the type's tolerance.
        report = verify_gguf(path, trained, tokenizer, method, prompts=(prompt,), greedy_tokens=8)
        assert report.greedy_tokens == 8 and report.greedy_exact >= 6, report
    modelfile = (folder / "llama_finetune" / "Modelfile").read_text()
    assert "<|eot_id|>" not in modelfile and 'PARAMETER stop "<|im_end|>"' in modelfile


@pytest.mark.slow
def test_gemma3_conversational_on_the_real_checkpoint(notebook_folder, gemma3_path):
    """Unsloth's Gemma 3 (4B) notebook on real weights: the real Gemma 3 270M as the language
    model of an image-text checkpoint (what gemma-3-4b-it is), saves included. Gemma's
    turn markers are tokens its tokenizer already holds, so nothing is added and the
    adapter holds no embedding rows; llama.cpp judges the GGUF file on a prompt rendered
    with the chat template: its tokens, logits and greedy continuation."""
    from safetensors import safe_open

    from slothkit import FastModel
    from slothkit.export.gguf import verify_gguf
    from slothkit.testing import build_tiny_image_text_gemma3

    folder, _ = notebook_folder
    checkpoint = build_tiny_image_text_gemma3(folder / "gemma-3-270m-image-text", text_path=gemma3_path)
    ns = _run("gemma3_conversational", MODEL=str(checkpoint))
    trainer, tokenizer, model = ns["trainer"], ns["tokenizer"], ns["model"]
    rows = model.get_input_embeddings().weight.shape[0]
    assert len(tokenizer) <= rows == 262144 and tokenizer.eos_token == "<end_of_turn>"
    with safe_open(str(folder / "gemma-3" / "adapter_model.safetensors"), "pt") as adapter:
        assert all("lora_" in name for name in adapter.keys())  # no embedding rows saved
    _assert_trained(trainer)
    reloaded, _ = FastModel.from_pretrained("gemma-3", load_in_4bit=False, dtype=torch.float32)
    _assert_close(_logits(reloaded, tokenizer), _logits(model, tokenizer))
    _assert_merged(folder / "gemma-3-finetune", ns)

    conversation = [{"role": "user", "content": [{"type": "text", "text": "What is 7 times 6?"}]}]
    prompt = tokenizer.apply_chat_template(conversation, add_generation_prompt=True)
    (path,) = (folder / "gemma-3-finetune").glob("*.Q8_0.gguf")
    report = verify_gguf(path, model.eval(), tokenizer, "q8_0", prompts=(prompt,), greedy_tokens=8)
    assert report.greedy_tokens == 8 and report.greedy_exact >= 6, report


def test_gpt_oss_fine_tuning(notebook_folder, capsys):
    """Unsloth's gpt-oss (20B) fine-tuning notebook: harmony prompts with each reasoning
    effort as a dict of tensors, a `messages` column rendered into `text`, the final
    answers alone learned (train_on_responses_only with harmony's markers), the experts
    adapted, the adapter reloaded from its folder and the merged 16-bit save."""
    folder, _ = notebook_folder
    ns = _run("gpt_oss_fine_tuning")
    tokenizer, trainer, dataset = ns["tokenizer"], ns["trainer"], ns["dataset"]
    # The last prompt: the system message with the reasoning effort asked for, the system
    # text as the developer message, then the generation prompt of the assistant.
    prompt = tokenizer.decode(ns["inputs"]["input_ids"][0])
    assert "Reasoning: high" in prompt and "<|start|>developer<|message|># Instructions" in prompt
    assert prompt.endswith("<|start|>user<|message|>Solve x^5 + 3x^4 - 10 = 3.<|end|><|start|>assistant")
    assert ns["_"].shape[1] > ns["inputs"]["input_ids"].shape[1]
    # Each row learns its answers, each in the final channel and closed by its turn's end
    # (<|return|> for the last answer, <|end|> for the earlier ones), and nothing else.
    for index in (0, 100):
        labels = trainer.train_dataset[index]["labels"]
        kept = tokenizer.decode([label for label in labels if label != -100])
        replies = [m["content"] for m in dataset[index]["messages"] if m["role"] == "assistant"]
        ends = ["<|end|>"] * (len(replies) - 1) + ["<|return|>"]
        assert labels[0] == -100 and kept == "".join(r + end for r, end in zip(replies, ends)), kept
    _assert_trained(trainer)
    _assert_loss_fell(trainer)
    _assert_eight_bit_adam(trainer)
    # The experts are adapted too: gate_up_proj and down_proj through PEFT's target_parameters.
    moved = {n for n, p in trainer.model.named_parameters() if "lora_B" in n and p.detach().abs().max() > 0}
    assert any("experts" in n for n in moved), sorted(moved)
    assert "Reasoning: medium" in capsys.readouterr().out
    _assert_reloaded(ns, trainer)
    _assert_merged(folder / "gpt_oss_finetune_16bit", ns)


def test_qwen3_moe(notebook_folder):
    """Unsloth's Qwen3-30B-A3B (Qwen3_MoE) notebook: the experts adapted through the names it
    gives ("gate_up_proj" among the MLP's), a custom reasoning chat template set on the
    tokenizer, pandas rows measured with len(apply_chat_template(...)), and every save:
    both merged models, the adapter and three GGUFs."""
    folder, _ = notebook_folder
    ns = _run("qwen3_moe")
    tokenizer, trainer = ns["tokenizer"], ns["trainer"]
    config = trainer.model.peft_config["default"]
    assert config.target_modules == {"q_proj", "k_proj", "v_proj", "o_proj"}
    assert sorted(config.target_parameters) == ["experts.down_proj", "experts.gate_up_proj"]
    # The pandas filter kept the numeric answers; each row is its system prompt, problem and
    # formatted answer, and trains as that text.
    assert sorted(trainer.train_dataset["expected_answer"]) == ["-2", "1", "12", "7", "9"]
    for row in trainer.train_dataset:
        text = tokenizer.decode(row["input_ids"]).removesuffix(tokenizer.eos_token)
        assert text.startswith(ns["system_prompt"] + tokenizer.eos_token), text
        assert "<SOLUTION>" + row["expected_answer"] + "</SOLUTION>" in text
    _assert_trained(trainer)
    _assert_loss_fell(trainer)
    _assert_eight_bit_adam(trainer)
    moved = {n for n, p in trainer.model.named_parameters() if "lora_B" in n and p.detach().abs().max() > 0}
    assert any("experts" in n for n in moved), sorted(moved)
    prompt = tokenizer(ns["text"], return_tensors="pt")["input_ids"]
    assert ns["text"].endswith("<start_working_out>") and ns["_"].shape[1] > prompt.shape[1]
    from slothkit import FastLanguageModel

    reloaded, _ = FastLanguageModel.from_pretrained("qwen_lora", load_in_4bit=False, dtype=torch.float32)
    _assert_close(_logits(reloaded, tokenizer), _logits(ns["model"], tokenizer))
    _assert_merged(folder / "qwen_finetune_16bit", ns)
    _assert_merged_4bit(folder / "qwen_finetune_4bit", ns)
    _assert_gguf(folder / "qwen_finetune")
