"""FastModel's fused path against plain Hugging Face + PEFT on tiny offline models.

Same checkpoint, same LoRA initialisation (same seed), same data, same optimizer:
the fused model must follow the plain one step for step.
"""

import copy
import os
import warnings

import pytest
import torch

from slothkit import FastModel
from slothkit.engine.nf4_layout import keep_nf4_layout
from slothkit.models import architecture_named
from slothkit.testing import FUSED_FAMILIES, tiny_model_path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

ARCHS = FUSED_FAMILIES
SEVEN = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
# What FastModel adapts for the seven names (slothkit.loading.lora_setup) in a family whose q/k/v
# and gate/up are one layer each (Phi-3), and so what HF + PEFT is given.
FUSED_TARGETS = ["qkv_proj", "o_proj", "gate_up_proj", "down_proj"]
STEPS = 8


def _batch(vocab_size, seed=0, batch=2, seq=12):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, vocab_size, (batch, seq), generator=g)
    labels = ids.clone()
    labels[0, :3] = -100  # a masked prompt, as in instruction tuning
    return ids, labels


def _peft_targets(arch: str) -> list[str]:
    return FUSED_TARGETS if architecture_named(arch).fused_projections else SEVEN


def _attention(path) -> str:
    """A model that soft-caps its attention scores (Gemma 2) runs eager: SDPA cannot cap them."""
    from transformers import AutoConfig

    return "eager" if getattr(AutoConfig.from_pretrained(path), "attn_logit_softcapping", None) else "sdpa"


def _plain_peft(path, load_in_4bit, device, targets=SEVEN):
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM, BitsAndBytesConfig

    quant = None
    if load_in_4bit:
        quant = BitsAndBytesConfig(
            load_in_4bit=True,
            bnb_4bit_quant_type="nf4",
            bnb_4bit_use_double_quant=True,
            bnb_4bit_compute_dtype=torch.float32,
        )
    model = AutoModelForCausalLM.from_pretrained(
        path,
        dtype=torch.float32,
        quantization_config=quant,
        attn_implementation=_attention(path),
        device_map={"": device},
    )
    torch.manual_seed(3407)
    config = LoraConfig(
        r=8,
        lora_alpha=16,
        lora_dropout=0.0,
        task_type="CAUSAL_LM",
        target_modules=targets,
    )
    model = get_peft_model(model, config)
    model.train()
    return model


def _fused(path, load_in_4bit, checkpointing=False, **switches):
    model, _ = FastModel.from_pretrained(str(path), dtype=torch.float32, load_in_4bit=load_in_4bit)
    return FastModel.get_peft_model(
        model, r=8, lora_alpha=16, use_gradient_checkpointing=checkpointing, **switches
    )


def _train(model, ids, labels, steps):
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=2e-3)
    losses, first_grads = [], None
    for step in range(steps):
        loss = model(input_ids=ids, labels=labels).loss
        loss.backward()
        if step == 0:
            first_grads = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.requires_grad}
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(loss.item())
    return losses, first_grads


@pytest.mark.parametrize("load_in_4bit", [False, True], ids=["16bit", "4bit"])
@pytest.mark.parametrize("arch", ARCHS)
def test_fused_training_matches_hf_peft(arch, load_in_4bit, device):
    path = tiny_model_path(arch)
    plain = _plain_peft(path, load_in_4bit, device, _peft_targets(arch))
    fused = _fused(path, load_in_4bit)
    ids, labels = (t.to(device) for t in _batch(plain.config.vocab_size))

    plain_losses, plain_grads = _train(plain, ids, labels, STEPS)
    fused_losses, fused_grads = _train(fused, ids, labels, STEPS)

    assert plain_losses[-1] < plain_losses[0]  # the run actually learns
    torch.testing.assert_close(torch.tensor(fused_losses), torch.tensor(plain_losses), rtol=1e-5, atol=0)
    assert plain_grads.keys() == fused_grads.keys()
    for name, grad in plain_grads.items():
        torch.testing.assert_close(fused_grads[name], grad, rtol=1e-4, atol=1e-6, msg=name)

    # Greedy generation after training is the same token for token. On a CPU with
    # AVX512-BF16 bitsandbytes would repack the plain model's 4-bit weights at its first
    # eval forward, rounding their scales to bf16 (slothkit.engine.nf4_layout); both models
    # keep the weights they trained with.
    FastModel.for_inference(fused)
    keep_nf4_layout(plain)
    plain.eval()
    prompt = ids[:1, :5]
    with torch.no_grad():
        a = plain.generate(input_ids=prompt, max_new_tokens=8, do_sample=False)
        b = fused.generate(input_ids=prompt, max_new_tokens=8, do_sample=False)
    assert torch.equal(a, b)


def test_phi3_default_setup_trains_like_hf_peft_on_its_fused_layers(device, recwarn):
    """FastModel's defaults on Phi-3 (the seven target names, offloaded checkpointing) against
    HF + PEFT given the fused layers' names: 8 steps, the losses and the trained adapters
    within 1e-5, and every projection on the fused path (no fallback warning)."""
    path = tiny_model_path("phi3")
    plain = _plain_peft(path, False, device, FUSED_TARGETS)
    model, _ = FastModel.from_pretrained(str(path), dtype=torch.float32, load_in_4bit=False, fused=True)
    fused = FastModel.get_peft_model(model, r=8, lora_alpha=16)
    assert fused.peft_config["default"].target_modules == set(FUSED_TARGETS)
    g = torch.Generator().manual_seed(7)
    ids = torch.randint(3, plain.config.vocab_size, (2, 24), generator=g).to(device)
    labels = ids.clone()
    labels[1, :5] = -100

    plain_losses, _ = _train(plain, ids, labels, STEPS)
    fused_losses, _ = _train(fused, ids, labels, STEPS)
    assert plain_losses[-1] < plain_losses[0]
    torch.testing.assert_close(torch.tensor(fused_losses), torch.tensor(plain_losses), rtol=1e-5, atol=0)
    trained = {n: p for n, p in fused.named_parameters() if p.requires_grad}
    for name, param in plain.named_parameters():
        if param.requires_grad:
            torch.testing.assert_close(trained[name], param, rtol=1e-5, atol=1e-6, msg=name)
    assert not [w for w in recwarn if "plain PEFT path" in str(w.message)]


def test_phi3_longrope_tables_reach_the_fused_attention(device, tmp_path):
    """Phi-3.5's longrope: the rotary tables come from transformers' model forward (long
    factors past the original context, their attention factor folded into cos and sin), and
    the fused attention rotates with them as they are: HF + PEFT's losses over 8 steps."""
    import json
    import shutil

    path = shutil.copytree(tiny_model_path("phi3"), tmp_path / "phi3-longrope")
    config = json.loads((path / "config.json").read_text())
    half = config["hidden_size"] // config["num_attention_heads"] // 2
    config["rope_parameters"] = {
        "rope_type": "longrope", "rope_theta": 10000.0, "partial_rotary_factor": 1.0,
        "short_factor": [1.0 + 0.1 * k for k in range(half)], "long_factor": [2.0 + k for k in range(half)],
    }  # fmt: skip
    config["original_max_position_embeddings"] = 8  # the batch's 12 tokens take the long factors
    (path / "config.json").write_text(json.dumps(config))
    plain = _plain_peft(path, False, device, FUSED_TARGETS)
    fused = _fused(path, load_in_4bit=False)
    assert fused.config.rope_parameters["rope_type"] == "longrope"
    ids, labels = (t.to(device) for t in _batch(plain.config.vocab_size))
    plain_losses, _ = _train(plain, ids, labels, STEPS)
    fused_losses, _ = _train(fused, ids, labels, STEPS)
    assert plain_losses[-1] < plain_losses[0]
    torch.testing.assert_close(torch.tensor(fused_losses), torch.tensor(plain_losses), rtol=1e-5, atol=0)


def test_phi3_sliding_window_is_applied_as_transformers_applies_it(device, tmp_path):
    """Phi-3-mini-4k's config sets sliding_window (2047): transformers masks keys beyond it
    and hands the window to the attention function, and so does the fused attention. A
    window of 4 over 12 tokens: HF + PEFT's losses over 8 steps, and not the losses
    without the window."""
    import json
    import shutil

    path = shutil.copytree(tiny_model_path("phi3"), tmp_path / "phi3-window")
    config = json.loads((path / "config.json").read_text())
    config["sliding_window"] = 4
    (path / "config.json").write_text(json.dumps(config))
    ids, labels = (t.to(device) for t in _batch(config["vocab_size"]))
    fused_losses, _ = _train(_fused(path, load_in_4bit=False), ids, labels, STEPS)
    plain_losses, _ = _train(_plain_peft(path, False, device, FUSED_TARGETS), ids, labels, STEPS)
    unwindowed, _ = _train(_plain_peft(tiny_model_path("phi3"), False, device, FUSED_TARGETS), ids, labels, 1)
    torch.testing.assert_close(torch.tensor(fused_losses), torch.tensor(plain_losses), rtol=1e-5, atol=0)
    assert abs(unwindowed[0] - plain_losses[0]) > 1e-3  # the window changes the attention


def test_gemma2_past_its_window_trains_like_hf_peft(device, monkeypatch):
    """Gemma 2 on sequences longer than its window (16 tokens), so the sliding layer masks,
    both soft-caps bend scores and logits, and the fused attention must pass the module's
    cap: 8 fp32 steps give HF + PEFT's (eager) losses and adapters within 1e-5. Plain SGD:
    AdamW divides by the root of its second moment, so an entry whose gradient is near zero
    takes a step of about the learning rate either way, and rounding shows at that scale
    (measured: 2e-4 on one layer's v_proj adapter, against 1e-6 relative in the gradients).
    The fused model's soft-capped attention is slothkit's tiled kernel, HF's is eager."""
    from slothkit.engine import decoder

    tiled_calls = []

    def counted(*args, **kwargs):
        tiled_calls.append(args[0].shape)
        return tiled_attention(*args, **kwargs)

    tiled_attention = decoder.tiled_attention
    monkeypatch.setattr(decoder, "tiled_attention", counted)
    path = tiny_model_path("gemma2")
    ids, labels = (t.to(device) for t in _batch(512, seed=1, seq=40))
    losses, adapters = [], []
    for model in (_plain_peft(path, False, device), _fused(path, load_in_4bit=False)):
        optimizer = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.5)
        run = []
        for _ in range(STEPS):
            loss = model(input_ids=ids, labels=labels).loss
            loss.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            run.append(loss.item())
        losses.append(torch.tensor(run))
        adapters.append({n: p.detach() for n, p in model.named_parameters() if "lora_" in n})
    (plain_losses, fused_losses), (plain, fused) = losses, adapters
    assert tiled_calls, "the fused Gemma 2 did not run the tiled attention"
    assert plain_losses[-1] < plain_losses[0]
    torch.testing.assert_close(fused_losses, plain_losses, rtol=1e-5, atol=0)
    assert plain.keys() == fused.keys() and plain
    for name, weight in plain.items():
        torch.testing.assert_close(fused[name], weight, rtol=1e-5, atol=1e-5, msg=name)


# Keeping the residual sums or not is one switch of the layer body, so one architecture
# runs both; a sandwich layer (Gemma 2 and 3) keeps no sum whatever is asked, so it runs
# the asking case.
CHECKPOINTING_CASES = [
    ("llama", True),
    ("llama", False),
    ("gemma", True),
    ("gemma3", True),
    ("gemma2", True),
    ("phi3", True),
]


@pytest.mark.parametrize(
    "arch, keeps",
    CHECKPOINTING_CASES,
    ids=[f"{a}-{'keeps' if k else 'keeps_nothing'}" for a, k in CHECKPOINTING_CASES],
)
def test_offloaded_checkpointing_gives_same_gradients(arch, keeps, device, mlp_calls, known_sums):
    """Gemma 3's and Gemma 2's sandwich layer normalises the MLP's output, so its re-run
    keeps the down projection, and it adds o_proj's output through a norm: no fused
    residual sum, and no sum kept even when asked."""
    path = tiny_model_path(arch)
    sandwich = architecture_named(arch).sandwich_norms
    results = []
    for mode in (False, "offload", True):
        model = _fused(path, load_in_4bit=False, checkpointing=mode, keep_sums=keeps)
        ids, labels = (t.to(device) for t in _batch(model.config.vocab_size))
        mlp_calls.clear()
        known_sums.clear()
        loss = model(input_ids=ids, labels=labels).loss
        loss.backward()
        grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad}
        results.append((loss.item(), grads))
        # The offload re-run in backward skips the MLP's down projection, and with kept
        # sums the output projection; torch's checkpoint re-runs the whole layer.
        layers = model.config.num_hidden_layers
        expected = {
            False: [False] * layers,
            True: [False] * 2 * layers,
            "offload": [False] * layers + [not sandwich] * layers,
        }[mode]
        assert mlp_calls == expected, mode
        if sandwich:
            expected = []
        elif mode == "offload" and keeps:
            expected = [False] * layers + [True] * layers
        else:
            expected = [False] * len(expected)
        assert known_sums == expected, mode
        if mode == "offload":  # what the "auto" policy's memory model reads
            checkpointer = model.get_base_model().model.layers[0]._gradient_checkpointing_func
            assert checkpointer.keeps is (keeps and not sandwich)
    base_loss, base_grads = results[0]
    for loss, grads in results[1:]:
        assert loss == pytest.approx(base_loss, rel=1e-6)
        for name, grad in base_grads.items():
            assert grads[name] is not None, name
            torch.testing.assert_close(grads[name], grad, rtol=1e-5, atol=1e-7, msg=name)


def test_a_hooked_layer_is_recomputed_in_full(device, mlp_calls):
    """A forward hook on a layer may read the re-run's output, so that layer's re-run
    keeps its down projection; the others still skip it."""
    model = _fused(tiny_model_path("llama"), load_in_4bit=False, checkpointing="offload")
    ids, labels = (t.to(device) for t in _batch(model.config.vocab_size))
    first = model.get_base_model().model.layers[0]
    seen = []
    first.register_forward_hook(lambda module, args, output: seen.append(output.detach().clone()))
    model(input_ids=ids, labels=labels).loss.backward()
    layers = model.config.num_hidden_layers
    # Backward re-runs the layers last to first.
    assert mlp_calls == [False] * layers + [True] * (layers - 1) + [False]
    for output in seen[1:]:  # where this transformers runs hooks in the re-run too
        torch.testing.assert_close(output, seen[0], rtol=0, atol=0)


def test_offload_checkpoint_of_any_function_is_recomputed_in_full(device, mlp_calls):
    """offload_checkpoint(fn) may wrap anything, here two fused MLPs in a row, where the
    first one's output is read in the re-run: it is not marked, so nothing is skipped."""
    from slothkit.engine.checkpointing.offload_checkpoint import offload_checkpoint

    model = _fused(tiny_model_path("llama"), load_in_4bit=False)
    mlp = model.get_base_model().model.layers[0].mlp
    gen = torch.Generator().manual_seed(5)
    x = torch.randn(2, 7, model.config.hidden_size, generator=gen).to(device).requires_grad_()
    dy = torch.randn(2, 7, model.config.hidden_size, generator=gen).to(device)
    params = [x] + [p for p in mlp.parameters() if p.requires_grad]

    def grads(fn):  # the checkpoint adds parameter gradients to .grad, as reentrant ones do
        for p in params:
            p.grad = None
        fn(x).backward(dy)
        return [p.grad.clone() for p in params]

    expected = grads(lambda h: mlp(mlp(h)))
    got = grads(lambda h: offload_checkpoint(lambda inner: mlp(mlp(inner)), h))
    assert True not in mlp_calls
    for a, b in zip(got, expected):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)


def test_long_batches_keep_nothing(device, known_sums):
    """Above the checkpointer's token bound the layers keep nothing and the re-run
    computes the sum itself."""
    model = _fused(tiny_model_path("llama"), load_in_4bit=False, checkpointing="offload", keep_sums=True)
    ids, labels = (t.to(device) for t in _batch(model.config.vocab_size, batch=2, seq=12))
    checkpointer = model.get_base_model().model.layers[0]._gradient_checkpointing_func
    layers = model.config.num_hidden_layers
    for bound, kept_in_rerun in ((24, True), (23, False)):  # the batch has 2 x 12 tokens
        checkpointer.keep_max_tokens = bound
        known_sums.clear()
        model(input_ids=ids, labels=labels).loss.backward()
        assert known_sums == [False] * layers + [kept_in_rerun] * layers, bound


def _switches(model):
    """(phases replayed from CUDA graphs, whether the layers keep sums) of the
    checkpointer get_peft_model installed."""
    checkpointer = model.get_base_model().model.layers[0]._gradient_checkpointing_func
    return (() if checkpointer.graphs is None else checkpointer.graphs.phases), checkpointer.keeps


def test_switches_are_keyword_arguments_that_beat_the_environment(checkpointing_asked, monkeypatch):
    """cuda_graphs= and keep_sums= reach enable_checkpointing as given; left at None they
    take the SLOTHKIT_* variable's value, and with neither, the hardware's choice (on a
    CPU: no graphs, no kept sums)."""
    asked = checkpointing_asked
    path = tiny_model_path("llama")
    both, forward = ("forward", "backward"), ("forward",)

    monkeypatch.delenv("SLOTHKIT_CUDA_GRAPHS", raising=False)
    monkeypatch.delenv("SLOTHKIT_KEEP_SUMS", raising=False)
    model = _fused(path, load_in_4bit=False, checkpointing="offload")
    assert asked.pop() == {"cuda_graphs": None, "launch_bound": False, "keep_sums": None}
    hardware = torch.cuda.is_available() and torch.cuda.get_device_capability() >= (8, 0)
    assert _switches(model) == ((), hardware)

    monkeypatch.setenv("SLOTHKIT_CUDA_GRAPHS", "0")
    monkeypatch.setenv("SLOTHKIT_KEEP_SUMS", "0")
    model = _fused(path, load_in_4bit=False, checkpointing="offload", cuda_graphs="forward", keep_sums=True)
    assert asked.pop() == {"cuda_graphs": "forward", "launch_bound": False, "keep_sums": True}
    assert _switches(model) == (forward, True)
    model = _fused(path, load_in_4bit=False, checkpointing="offload")
    assert asked.pop() == {"cuda_graphs": False, "launch_bound": False, "keep_sums": False}
    assert _switches(model) == ((), False)

    monkeypatch.setenv("SLOTHKIT_CUDA_GRAPHS", "1")
    monkeypatch.setenv("SLOTHKIT_KEEP_SUMS", "1")
    model = _fused(path, load_in_4bit=False, checkpointing="offload")
    assert asked.pop() == {"cuda_graphs": True, "launch_bound": False, "keep_sums": True}
    assert _switches(model) == (both, True)
    model = _fused(path, load_in_4bit=False, checkpointing="offload", cuda_graphs=False, keep_sums=False)
    assert asked.pop() == {"cuda_graphs": False, "launch_bound": False, "keep_sums": False}
    assert _switches(model) == ((), False)


@pytest.mark.parametrize(
    "switches, message",
    [
        (
            {"cuda_graphs": "both"},
            r"cuda_graphs='both'; accepted: None \(automatic\), True, False, 'forward'",
        ),
        ({"keep_sums": "on"}, r"keep_sums='on'; accepted: None \(automatic\), True, False"),
    ],
)
def test_a_wrong_switch_says_what_is_accepted(switches, message):
    with pytest.raises(ValueError, match=message):
        _fused(tiny_model_path("llama"), load_in_4bit=False, checkpointing="offload", **switches)


@pytest.mark.parametrize(
    "variable, value, accepted",
    [("SLOTHKIT_CUDA_GRAPHS", "yes", "'1', '0', 'forward'"), ("SLOTHKIT_KEEP_SUMS", "true", "'1', '0'")],
)
def test_a_mis_set_variable_names_itself_and_the_accepted_values(monkeypatch, variable, value, accepted):
    monkeypatch.setenv(variable, value)
    with pytest.raises(ValueError, match=f"{variable}='{value}'; accepted: {accepted}, or unset"):
        _fused(tiny_model_path("llama"), load_in_4bit=False, checkpointing="offload")


def test_attentions_and_hidden_states_are_returned_when_asked(device):
    """transformers records them with hooks on the attention modules and layers; the
    patched layer then calls the attention module as transformers does."""
    from transformers import AutoModelForCausalLM

    path = tiny_model_path("llama")
    plain = AutoModelForCausalLM.from_pretrained(
        path, dtype=torch.float32, attn_implementation="eager", device_map={"": device}
    )
    fused, _ = FastModel.from_pretrained(
        str(path),
        dtype=torch.float32,
        load_in_4bit=False,
        attn_implementation="eager",
        device_map={"": device},
    )
    ids, _ = _batch(plain.config.vocab_size)
    with torch.no_grad():
        expected = plain(ids.to(device), output_attentions=True, output_hidden_states=True)
        got = fused(ids.to(device), output_attentions=True, output_hidden_states=True)
    assert len(got.attentions) == len(expected.attentions) == plain.config.num_hidden_layers
    for name in ("attentions", "hidden_states"):
        for a, b in zip(getattr(got, name), getattr(expected, name)):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6, msg=name)
    torch.testing.assert_close(got.logits, expected.logits, rtol=1e-4, atol=1e-5)


def test_importing_slothkit_patches_nothing_and_models_coexist(device):
    from transformers import AutoModelForCausalLM

    path = tiny_model_path("llama")
    fused, _ = FastModel.from_pretrained(str(path), dtype=torch.float32, load_in_4bit=False)
    plain = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).to(device)
    assert "forward" in vars(fused.model.layers[0].mlp)
    assert "forward" not in vars(plain.model.layers[0].mlp)
    ids, _ = (t.to(device) for t in _batch(plain.config.vocab_size))
    with torch.no_grad():
        torch.testing.assert_close(
            fused(input_ids=ids).logits, plain(input_ids=ids).logits, rtol=1e-5, atol=1e-5
        )


def test_the_fused_path_is_taken_where_triton_runs_and_chosen_explicitly_elsewhere(monkeypatch):
    """Automatic: fused on a CUDA device or under the Triton interpreter; on a CPU without
    it the plain Hugging Face modules stay (they are faster there than the kernels' torch
    references), said once.  fused=True / False override; a bad value is refused."""
    from slothkit.loading import load_model

    path = str(tiny_model_path("llama"))

    def is_fused(model):
        return "forward" in vars(model.model.layers[0].mlp)

    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert is_fused(FastModel.from_pretrained(path, dtype=torch.float32, load_in_4bit=False)[0])
    assert not is_fused(
        FastModel.from_pretrained(path, dtype=torch.float32, load_in_4bit=False, fused=False)[0]
    )

    monkeypatch.setenv("TRITON_INTERPRET", "0")
    load_model._notice_plain_path.cache_clear()
    device_map = {"": "cpu"}
    with pytest.warns(
        UserWarning, match="Triton cannot run on the cpu, so the model keeps its Hugging Face modules"
    ):
        plain, _ = FastModel.from_pretrained(
            path, dtype=torch.float32, load_in_4bit=False, device_map=device_map
        )
    assert not is_fused(plain)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # said once only
        FastModel.from_pretrained(path, dtype=torch.float32, load_in_4bit=False, device_map=device_map)
    forced, _ = FastModel.from_pretrained(
        path, dtype=torch.float32, load_in_4bit=False, device_map=device_map, fused=True
    )
    assert is_fused(forced)

    with pytest.raises(ValueError, match="fused='yes'; accepted: None"):
        FastModel.from_pretrained(path, load_in_4bit=False, fused="yes")


def test_the_tokenizer_knows_its_model_but_pickles_without_it():
    """datasets.map with num_proc > 1 (dataset_num_proc in TRL's configs) pickles the
    tokenizer with dill into worker processes; a model carried along would be copied into
    each, and CUDA tensors cannot even be loaded in a forked worker."""
    import dill
    from transformers import AutoTokenizer

    from slothkit.data.chat_templates import linked_model

    path = str(tiny_model_path("llama"))
    model, tokenizer = FastModel.from_pretrained(path, dtype=torch.float32, load_in_4bit=False)
    assert linked_model(tokenizer) is model
    plain = AutoTokenizer.from_pretrained(path)
    plain.pad_token = plain.pad_token or plain.eos_token
    plain.padding_side = "right"
    plain.model_max_length = tokenizer.model_max_length
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    assert abs(len(dill.dumps(tokenizer)) - len(dill.dumps(plain))) < weights / 10


def test_clear_errors_for_bad_input(tmp_path):
    with pytest.raises(FileNotFoundError, match="cannot load model"):
        FastModel.from_pretrained(str(tmp_path / "missing"), load_in_4bit=False)
    (tmp_path / "empty").mkdir()
    with pytest.raises(FileNotFoundError, match="no config.json"):
        FastModel.from_pretrained(str(tmp_path / "empty"), load_in_4bit=False)
    path = tiny_model_path("llama")
    with pytest.raises(ValueError, match="exceeds this model's context"):
        FastModel.from_pretrained(str(path), max_seq_length=10**6, load_in_4bit=False)
    with pytest.raises(ValueError, match="accepted"):
        FastModel.from_pretrained(str(path), dtype="float8", load_in_4bit=False)
    model, _ = FastModel.from_pretrained(str(path), dtype=torch.float32, load_in_4bit=False)
    with pytest.raises(ValueError, match="match no layer.*q_proj"):
        FastModel.get_peft_model(model, target_modules=["query_key_value"])
    with pytest.raises(ValueError, match="use_gradient_checkpointing"):
        FastModel.get_peft_model(copy.deepcopy(model), use_gradient_checkpointing="sometimes")


def test_max_seq_length_beyond_the_context_scales_rope_linearly():
    """Twice the context: each position p of the extended model turns q and k by the angles
    the original gives p / 2 (linear RoPE scaling), said once; the refusals say the limits."""
    from slothkit.core.notices import SettingChangedWarning, say_once

    path = str(tiny_model_path("llama"))
    say_once.cache_clear()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        extended, tokenizer = FastModel.from_pretrained(path, max_seq_length=4096, load_in_4bit=False)
    notices = [str(w.message) for w in caught if issubclass(w.category, SettingChangedWarning)]
    assert any(
        "exceeds this model's context of 2048 tokens: RoPE is scaled linearly by 2" in n for n in notices
    )
    assert extended.config.rope_parameters == {"rope_theta": 500000.0, "rope_type": "linear", "factor": 2.0}
    assert (extended.config.max_position_embeddings, tokenizer.model_max_length) == (4096, 4096)
    original, _ = FastModel.from_pretrained(path, max_seq_length=2048, load_in_4bit=False)
    assert original.config.rope_parameters["rope_type"] == "default"
    x = torch.zeros(1, 4, 8)
    positions = torch.tensor([[0, 3, 1000, 4095]])
    cos, sin = extended.model.rotary_emb(x, positions)
    cos_half, sin_half = original.model.rotary_emb(x, positions.float() / 2)
    torch.testing.assert_close((cos, sin), (cos_half, sin_half), rtol=0, atol=1e-6)
    # get_peft_model may not go beyond what from_pretrained built: the RoPE is fixed by then.
    with pytest.raises(
        ValueError, match="exceeds this model's context of 4096 .* pass the longer one to from_pretrained"
    ):
        FastModel.get_peft_model(extended, max_seq_length=8192)
    with pytest.raises(ValueError, match="more than 16 times over.*max_seq_length <= 32768"):
        FastModel.from_pretrained(path, max_seq_length=32769, load_in_4bit=False)


def test_a_model_with_scaled_rope_is_not_scaled_again(tmp_path):
    import shutil

    folder = tmp_path / "scaled"
    shutil.copytree(tiny_model_path("llama"), folder)
    config = (folder / "config.json").read_text()
    assert '"rope_type": "default"' in config
    (folder / "config.json").write_text(
        config.replace('"rope_type": "default"', '"rope_type": "linear", "factor": 2.0')
    )
    with pytest.raises(ValueError, match="its RoPE is not a plain one slothkit can scale .*'linear'"):
        FastModel.from_pretrained(str(folder), max_seq_length=4096, load_in_4bit=False)


def test_a_label_outside_the_vocabulary_is_refused_before_the_layers_run(device):
    model = _fused(tiny_model_path("llama"), load_in_4bit=False).to(device)
    vocab = model.config.vocab_size
    ids, labels = (t.to(device) for t in _batch(vocab))
    layers_run = []
    for layer in model.get_base_model().model.layers:
        layer.register_forward_pre_hook(lambda *_: layers_run.append(1))
    for bad in (vocab, -5):
        labels_with_bad = labels.clone()
        labels_with_bad[1, 5] = bad
        with pytest.raises(ValueError, match=rf"labels must lie in \[0, {vocab}\).*found {bad}"):
            model(input_ids=ids, labels=labels_with_bad)
    assert not layers_run
    # The labels are shifted by one, so a label at position 0 is never a target: only
    # labels from position 1 on are checked.
    first_position_only = labels.clone()
    first_position_only[1, 0] = vocab
    assert torch.isfinite(model(input_ids=ids, labels=first_position_only).loss)
    assert layers_run


def test_checkpoint_without_tokenizer_is_refused(tmp_path):
    import shutil

    path = tiny_model_path("llama")
    target = tmp_path / "no-tokenizer"
    target.mkdir()
    for name in ("config.json", "model.safetensors", "generation_config.json"):
        shutil.copy(path / name, target / name)
    with pytest.raises(FileNotFoundError, match="no usable tokenizer"):
        FastModel.from_pretrained(str(target), load_in_4bit=False)


def test_lora_dropout_falls_back_with_one_warning(device):
    from slothkit.engine.lora_projection import warn_fallback_once

    warn_fallback_once.cache_clear()
    path = tiny_model_path("llama")
    model, _ = FastModel.from_pretrained(str(path), dtype=torch.float32, load_in_4bit=False)
    model = FastModel.get_peft_model(model, r=8, lora_dropout=0.1, use_gradient_checkpointing=False)
    ids, labels = (t.to(device) for t in _batch(model.config.vocab_size))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        loss = model(input_ids=ids, labels=labels).loss
    assert torch.isfinite(loss)
    messages = [str(w.message) for w in caught if "plain PEFT path" in str(w.message)]
    assert messages and all("lora_dropout" in m for m in messages)


def test_nf4_weight_record_is_kept_per_parameter():
    # The fused path describes a 4-bit weight once (slothkit.engine.lora_projection.base_weight)
    # and rebuilds the record only when the weight is replaced.
    import bitsandbytes as bnb

    from slothkit.engine.lora_projection import base_weight

    layer = bnb.nn.Linear4bit(128, 64, bias=False, compute_dtype=torch.float32, quant_type="nf4")
    layer.weight = bnb.nn.Params4bit(torch.randn(64, 128), requires_grad=False, quant_type="nf4").to("cpu")
    first = base_weight(layer)
    assert base_weight(layer) is first
    layer.weight = bnb.nn.Params4bit(torch.randn(64, 128), requires_grad=False, quant_type="nf4").to("cpu")
    second = base_weight(layer)
    assert second is not first and second.packed.data_ptr() == layer.weight.data_ptr()


# fp16 runs the kernels every family shares; these four cover what differs in 16 bits:
# the plain layer, Gemma's scaled embeddings, GeGLU, sandwich norms and soft caps (gemma2),
# q/k norms (qwen3) and fused projections (phi3).  Every family's fp32 parity is above.
FP16_ARCHS = ["llama", "gemma2", "qwen3", "phi3"]


@pytest.mark.parametrize("arch", FP16_ARCHS)
def test_fp16_training_with_loss_scaling_follows_hf_peft(arch, device):
    # The T4 path: fp16 weights, fp32 adapters, autocast to fp16 and a GradScaler, as
    # Trainer(fp16=True) runs it. Tolerance: fp16 keeps 11 bits and the two paths round at
    # different places (fused kernels vs separate ops); measured within 1.6e-4 over 8 steps.
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    path = tiny_model_path(arch)
    targets = _peft_targets(arch)
    plain = AutoModelForCausalLM.from_pretrained(
        path, dtype=torch.float16, attn_implementation=_attention(path), device_map={"": device}
    )
    torch.manual_seed(3407)
    plain = get_peft_model(
        plain, LoraConfig(r=8, lora_alpha=16, lora_dropout=0.0, target_modules=targets, task_type="CAUSAL_LM")
    )
    plain.train()
    fused, _ = FastModel.from_pretrained(str(path), dtype=torch.float16, load_in_4bit=False)
    fused = FastModel.get_peft_model(fused, r=8, lora_alpha=16, use_gradient_checkpointing=False)
    ids, labels = (t.to(device) for t in _batch(plain.config.vocab_size))

    def train(model):
        params = [p for p in model.parameters() if p.requires_grad]
        assert all(p.dtype == torch.float32 for p in params), "adapters train in fp32"
        optimizer = torch.optim.AdamW(params, lr=2e-3)
        scaler = torch.amp.GradScaler(device, init_scale=2.0**12)
        losses = []
        for _ in range(8):
            with torch.autocast(device, dtype=torch.float16):
                loss = model(input_ids=ids, labels=labels).loss
            scaler.scale(loss).backward()
            scaler.step(optimizer)
            scaler.update()
            optimizer.zero_grad(set_to_none=True)
            losses.append(loss.item())
        return losses

    plain_losses, fused_losses = train(plain), train(fused)
    assert all(torch.isfinite(torch.tensor(fused_losses)))
    assert plain_losses[-1] < plain_losses[0] and fused_losses[-1] < fused_losses[0]
    torch.testing.assert_close(torch.tensor(fused_losses), torch.tensor(plain_losses), rtol=1e-3, atol=0)


def test_lora_settings_that_would_train_silently_wrong_are_refused():
    model, _ = FastModel.from_pretrained(
        str(tiny_model_path("llama")), dtype=torch.float32, load_in_4bit=False
    )
    k_width = model.model.layers[0].self_attn.k_proj.out_features  # the narrowest projection
    cases = [
        ({"target_modules": ["q_proj", "v_prj"]}, r"\['v_prj'\] match no layer .*'v_proj'"),
        ({"lora_alpha": 0}, "lora_alpha=0; expected a positive number"),
        ({"lora_alpha": -16}, "lora_alpha=-16; expected a positive number"),
        ({"r": k_width + 1}, f"r={k_width + 1} exceeds {k_width}, the smallest min"),
        ({"r": 10**6, "target_modules": ["q_proj"]}, "r=1000000 exceeds 64"),
    ]
    for kwargs, message in cases:
        with pytest.raises(ValueError, match=message):
            FastModel.get_peft_model(model, use_gradient_checkpointing=False, **kwargs)
    assert not hasattr(model, "peft_config")  # every refusal came before PEFT touched the model

    # PEFT's own "all-linear" is passed on whole, and r up to the narrowest width is accepted.
    peft_model = FastModel.get_peft_model(
        model, r=k_width, target_modules="all-linear", use_gradient_checkpointing=False
    )
    config = peft_model.peft_config["default"]
    assert config.r == k_width
    wrapped = {name.rsplit(".", 1)[-1] for name, m in peft_model.named_modules() if hasattr(m, "lora_A")}
    assert wrapped == {"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"}
