"""Mixture-of-experts layers through slothkit's fused experts, against HF + PEFT.

Tiny random Qwen3-MoE, gpt-oss, Mixtral and Gemma 4 (26B-A4B's layout) checkpoints (their
real layouts: gate and up concatenated or interleaved, weights (out, in) or (in, out),
gpt-oss's biases and clamped SwiGLU, Gemma 4's GELU-tanh gate on experts beside a dense
MLP) train 8 steps on the generic path with the experts fused, and give the losses
and every adapter of HF + PEFT with the same target_parameters, in fp32; the router's
auxiliary loss included where the config asks for it. What the fused experts do not
compute runs the module's own forward, said once, with the same numbers.
"""

import contextlib
import warnings

import pytest
import torch

import slothkit.engine.experts as experts_glue
import slothkit.loading.load_model as load_model_glue
from slothkit import FastModel
from slothkit.core.model_state import patched_module
from slothkit.engine.experts import describe_experts, experts_base, experts_modules
from slothkit.testing import build_tiny_tokenizer

STEPS = 8
# FastModel loads onto the GPU where there is one; HF + PEFT and the batches follow it.
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
ATTENTION = ["q_proj", "k_proj", "v_proj", "o_proj"]
EXPERT_PARAMETERS = ["experts.gate_up_proj", "experts.down_proj"]
FAMILIES = {
    "qwen3_moe": dict(moe_intermediate_size=24, num_experts=6, num_experts_per_tok=2, head_dim=16),
    "gpt_oss": dict(num_local_experts=5, num_experts_per_tok=2, head_dim=16, sliding_window=8),
    "mixtral": dict(num_local_experts=4, num_experts_per_tok=2),
    # 26B-A4B's layout: experts beside the dense MLP, a sliding and a full layer.
    "gemma4_text": dict(
        enable_moe_block=True,
        num_experts=6,
        top_k_experts=2,
        moe_intermediate_size=24,
        hidden_activation="gelu_pytorch_tanh",
        head_dim=16,
        global_head_dim=16,
        hidden_size_per_layer_input=0,
        sliding_window=8,
        layer_types=["sliding_attention", "full_attention"],
    ),
}
# What each family's experts module is, as slothkit reads it.
LAYOUTS = {
    "qwen3_moe": dict(weights_in_out=False, interleaved=False, biases=False, activation="swiglu"),
    "gpt_oss": dict(weights_in_out=True, interleaved=True, biases=True, activation="gpt_oss"),
    "mixtral": dict(weights_in_out=False, interleaved=False, biases=False, activation="swiglu"),
    "gemma4_text": dict(weights_in_out=False, interleaved=False, biases=False, activation="geglu_tanh"),
}


@pytest.fixture(autouse=True)
def fresh_notices():
    from slothkit.core.notices import say_once
    from slothkit.loading.load_model import _notice_generic_path, _warn_unsupported

    for notice in (say_once, _notice_generic_path, _warn_unsupported):
        notice.cache_clear()


@pytest.fixture
def fused_calls(monkeypatch):
    """How many times the fused experts ran."""
    calls = []
    fused = experts_glue.moe_lora_experts

    def counting(*args, **kwargs):
        calls.append(kwargs.get("gate_up_lora") is not None)
        return fused(*args, **kwargs)

    monkeypatch.setattr(experts_glue, "moe_lora_experts", counting)
    return calls


def _checkpoint(tmp_path, model_type: str, **extra):
    from transformers import AutoConfig, AutoModelForCausalLM

    sizes = dict(
        hidden_size=48, intermediate_size=40, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, vocab_size=512, max_position_embeddings=4096, pad_token_id=0,
    )  # fmt: skip
    torch.manual_seed(0)
    config = AutoConfig.for_model(model_type, **{**sizes, **FAMILIES[model_type], **extra})
    model = AutoModelForCausalLM.from_config(config)
    with torch.no_grad():  # gpt-oss's biases start at zero: make them count
        for name, parameter in model.named_parameters():
            if name.endswith("_bias"):
                parameter.normal_(0, 0.1)
    path = tmp_path / model_type
    model.save_pretrained(path)
    build_tiny_tokenizer("bpe", path)
    return path


def _random_b(model, seed: int) -> None:
    """PEFT starts B at zero; random B makes every expert's update count."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, parameter in sorted(model.named_parameters()):
            if "lora_B" in name:
                parameter.copy_(torch.randn(parameter.shape, generator=generator) * 0.05)


def _plain_peft(path, target_modules=ATTENTION):
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    torch.manual_seed(3407)
    config = LoraConfig(
        r=8,
        lora_alpha=16,
        task_type="CAUSAL_LM",
        target_modules=target_modules,
        target_parameters=EXPERT_PARAMETERS,
    )
    return get_peft_model(model, config).train().to(DEVICE)


def _fused(path):
    model, _ = FastModel.from_pretrained(str(path), dtype=torch.float32, load_in_4bit=False, fused=True)
    return FastModel.get_peft_model(model, r=8, lora_alpha=16, use_gradient_checkpointing=False)


def _train(model, ids, labels):
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=2e-3)
    losses = []
    for _ in range(STEPS):
        loss = model(input_ids=ids, labels=labels).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(loss.item())
    return losses


def _assert_same_training(fast, plain):
    """The first step's gradient of every adapter within fp32 noise of HF + PEFT's (1e-5 of
    the tensor's largest), then STEPS steps of AdamW: the same losses, and adapters within
    5e-5 (AdamW divides each gradient by its own running size, so an entry whose gradient
    is nearly zero, the cancellation noise of a sum taken in another order, still moves
    by up to lr per step: 1.6e-2 over these steps)."""
    ids = torch.randint(3, 500, (2, 11), generator=torch.Generator().manual_seed(1)).to(DEVICE)
    labels = ids.clone()
    labels[0, :3] = -100
    for model in (fast, plain):
        model(input_ids=ids, labels=labels).loss.backward()
    plain_grads = {name: p.grad for name, p in plain.named_parameters() if p.grad is not None}
    fast_grads = {name: p.grad for name, p in fast.named_parameters() if p.grad is not None}
    assert fast_grads.keys() == plain_grads.keys() and any("experts" in name for name in fast_grads)
    for name, grad in plain_grads.items():
        assert grad.abs().max() > 0, name
        torch.testing.assert_close(
            fast_grads[name], grad, rtol=0, atol=1e-5 * grad.abs().max().item(), msg=name
        )
    for model in (fast, plain):
        model.zero_grad(set_to_none=True)

    fast_losses, plain_losses = _train(fast, ids, labels), _train(plain, ids, labels)
    assert plain_losses[-1] < plain_losses[0]
    torch.testing.assert_close(torch.tensor(fast_losses), torch.tensor(plain_losses), rtol=1e-5, atol=0)
    plain_state = plain.state_dict()
    for name, value in fast.state_dict().items():
        if "lora_" in name:
            torch.testing.assert_close(value, plain_state[name], rtol=0, atol=5e-5, msg=name)


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_fused_experts_train_like_hf_peft(family, tmp_path, fused_calls):
    path = _checkpoint(tmp_path, family)
    with pytest.warns(UserWarning, match="experts of its 2 mixture-of-experts layers fused"):
        fast = _fused(path)
    # Gemma 4's dense MLP beside the experts is adapted too: the same modules in both.
    plain = _plain_peft(path, sorted(fast.peft_config["default"].target_modules))
    assert fast.peft_config["default"].target_parameters == plain.peft_config["default"].target_parameters
    _random_b(fast, seed=5)
    _random_b(plain, seed=5)
    fused_calls.clear()  # the loading's checks ran the experts too

    called = experts_modules(fast)
    assert len(called) == 2 and all(patched_module(m) is not None for m in called)
    call = describe_experts(called[0])
    layout = LAYOUTS[family]
    assert (call.weights_in_out, call.interleaved, call.gate.activation) == (
        layout["weights_in_out"], layout["interleaved"], layout["activation"]
    )  # fmt: skip
    assert (call.gate_up_bias is not None) == layout["biases"] == (call.down_bias is not None)
    assert call.gate_up_lora is not None and call.down_lora is not None

    _assert_same_training(fast, plain)
    # Two layers, 1 + STEPS forwards: every one through the fused experts with adapters.
    assert fused_calls == [True] * 2 * (1 + STEPS)


def test_router_auxiliary_loss_is_transformers_own(tmp_path, fused_calls):
    """The router is left as it is, so its logits feed transformers' load-balancing loss."""
    path = _checkpoint(tmp_path, "qwen3_moe", output_router_logits=True, router_aux_loss_coef=0.5)
    fast, plain = _fused(path), _plain_peft(path)
    _random_b(fast, seed=7)
    _random_b(plain, seed=7)
    ids = torch.randint(3, 500, (2, 9), generator=torch.Generator().manual_seed(2)).to(DEVICE)
    fast_out, plain_out = fast(input_ids=ids, labels=ids), plain(input_ids=ids, labels=ids)
    assert plain_out.aux_loss is not None and plain_out.aux_loss > 0
    torch.testing.assert_close(fast_out.aux_loss, plain_out.aux_loss, rtol=1e-6, atol=0)
    torch.testing.assert_close(fast_out.loss, plain_out.loss, rtol=1e-6, atol=0)
    assert fused_calls


def test_what_the_fused_experts_cannot_compute_runs_the_modules_own(tmp_path, fused_calls):
    """Two active adapters: the outer wrapper's own forward runs (said once), with PEFT's
    numbers; with the adapters disabled the fused experts run without them."""
    path = _checkpoint(tmp_path, "mixtral")
    fast, plain = _fused(path), _plain_peft(path)
    for model in (fast, plain):
        torch.manual_seed(11)  # the second adapter's A, alike in both
        model.add_adapter("second", model.peft_config["default"])
        _random_b(model, seed=3)
        model.base_model.set_adapter(["default", "second"])
    fused_calls.clear()
    ids = torch.randint(3, 500, (1, 7), generator=torch.Generator().manual_seed(3)).to(DEVICE)
    assert describe_experts(experts_modules(fast)[0]) == "2 adapters are active at once on experts.down_proj"
    with pytest.warns(UserWarning, match="runs its own experts module: 2 adapters are active"):
        logits = fast(input_ids=ids).logits
    assert not fused_calls
    torch.testing.assert_close(logits, plain(input_ids=ids).logits, rtol=1e-5, atol=1e-6)

    with fast.disable_adapter(), plain.disable_adapter():
        torch.testing.assert_close(
            fast(input_ids=ids).logits, plain(input_ids=ids).logits, rtol=1e-5, atol=1e-6
        )
    assert fused_calls == [False, False]


def test_loading_fuses_the_plain_experts_and_leaves_them_reachable(tmp_path):
    """Before LoRA the block calls the experts module itself; its own forward is kept."""
    path = _checkpoint(tmp_path, "gpt_oss")
    with pytest.warns(UserWarning, match="mixture-of-experts layers fused"):
        model, _ = FastModel.from_pretrained(str(path), dtype=torch.float32, load_in_4bit=False, fused=True)
    (first, second) = experts_modules(model)
    assert experts_base(first) == (first, [])
    record = patched_module(first)
    assert record is not None and record.original_forward.__func__ is type(first).forward


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_greedy_generation_is_hf_peft_s(family, tmp_path, fused_calls):
    """After for_inference with Hugging Face's generate (transformers' loop over the fused
    experts and, where the check accepted them, the fused layers with their key/value
    cache): HF + PEFT's greedy tokens.  slothkit's own decode loop, which a GPU takes for
    Qwen3-MoE, is tested in tests/slothkit/inference/test_decode_experts.py."""
    path = _checkpoint(tmp_path, family)
    fast = _fused(path)
    plain = _plain_peft(path, sorted(fast.peft_config["default"].target_modules))
    _random_b(fast, seed=6)
    _random_b(plain, seed=6)
    FastModel.for_inference(fast, fast_decode=False)
    plain.eval()
    fused_calls.clear()
    ids = torch.randint(3, 500, (1, 6), generator=torch.Generator().manual_seed(0)).to(DEVICE)
    tokens = fast.generate(input_ids=ids, max_new_tokens=8, do_sample=False)
    assert tokens.tolist() == plain.generate(input_ids=ids, max_new_tokens=8, do_sample=False).tolist()
    assert fused_calls.count(True) == 2 * 8  # two layers, a prefill and seven steps


def _loaded_in_16_bits(*args):
    """In place of load_model's choice: the experts load in 16 bits and are quantised
    where the fused experts are bound."""
    return contextlib.nullcontext()


def _load_4bit(path, dequantized_back: bool):
    """A 4-bit model with LoRA; with ``dequantized_back`` its experts' weights are quantised
    as the 4-bit path quantises them and put back as 16-bit tensors of the dequantised
    values, which the fused experts then read as they read any 16-bit weight."""
    from slothkit.core.notices import SettingChangedWarning
    from slothkit_kernels.moe import quantize_nf4_experts

    if dequantized_back:
        done = set()  # NF4 of NF4 values is not the same: quantise once, as the 4-bit path does

        def dequantize_back(experts, names):
            if id(experts) in done:
                return 0
            done.add(id(experts))
            for name in names:
                record = quantize_nf4_experts(getattr(experts, name).detach())
                setattr(experts, name, torch.nn.Parameter(record.dequantize(), requires_grad=False))
            return 0

        # Through get_peft_model too, which binds the fused experts (and quantises) again;
        # loaded in 16 bits, to be quantised where the fused experts are bound.
        with pytest.MonkeyPatch.context() as patch:
            patch.setattr(experts_glue, "quantize_expert_parameters", dequantize_back)
            patch.setattr(load_model_glue, "_experts_quantized_while_loading", _loaded_in_16_bits)
            model, _ = FastModel.from_pretrained(
                str(path), dtype=torch.float32, load_in_4bit=True, fused=True
            )
            return _with_lora(model)
    with pytest.warns(SettingChangedWarning, match="quantised the experts of 2 layers to NF4"):
        model, _ = FastModel.from_pretrained(str(path), dtype=torch.float32, load_in_4bit=True, fused=True)
    return _with_lora(model)


def _with_lora(model):
    model = FastModel.get_peft_model(model, r=8, lora_alpha=16, use_gradient_checkpointing=False)
    _random_b(model, seed=4)
    return model


def _expert_weight_bytes(model) -> int:
    """Bytes the experts' weights hold: NF4 records but their two level tables (1088 bytes
    each, whatever the weight's size: a tiny model's would hide the ratio), or the
    parameters' storage."""
    from slothkit.core.inspection import nf4_experts_of

    total = 0
    for module in experts_modules(model):
        for name in ("gate_up_proj", "down_proj"):
            weight = getattr(experts_base(module)[0], name)
            record = nf4_experts_of(weight)
            total += weight.untyped_storage().nbytes()
            if record is not None:
                total += record.nbytes() - record.code.nbytes - record.nested_code.nbytes
    return total


@pytest.mark.parametrize("family", ["qwen3_moe", "gpt_oss", "gemma4_text"])
def test_4bit_experts_compute_what_their_dequantised_weights_do(family, tmp_path, fused_calls):
    """A 4-bit model's fused experts read NF4 codes in their GEMMs: the loss and every LoRA
    gradient are those of the same model whose experts hold the dequantised values in fp32
    (under the interpreter bit for bit: the kernels multiply the same values in the same
    order; on a GPU within fp32 rounding), in under 1 / 3.5 of the bytes of 16-bit weights
    (4.13 bits per weight against 16)."""
    from slothkit.core.inspection import nf4_experts_of
    from slothkit_kernels.utils import interpreter_enabled

    path = _checkpoint(tmp_path, family)
    quantized, gold = _load_4bit(path, False), _load_4bit(path, True)
    assert all(nf4_experts_of(experts_base(m)[0].down_proj) is not None for m in experts_modules(quantized))
    assert not any(nf4_experts_of(experts_base(m)[0].down_proj) for m in experts_modules(gold))
    assert _expert_weight_bytes(gold) / 2 >= 3.5 * _expert_weight_bytes(quantized)  # gold: fp32

    fused_calls.clear()
    ids = torch.randint(3, 500, (2, 11), generator=torch.Generator().manual_seed(1)).to(DEVICE)
    losses = []
    for model in (quantized, gold):
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        losses.append(loss.detach())
    assert fused_calls == [True] * 4  # two layers, two models
    grads = [{n: p.grad for n, p in m.named_parameters() if p.grad is not None} for m in (quantized, gold)]
    assert grads[0].keys() == grads[1].keys() and any("experts" in n for n in grads[0])
    tolerance = {"rtol": 0, "atol": 0} if interpreter_enabled() else {"rtol": 1e-5, "atol": 1e-7}
    torch.testing.assert_close(losses[0], losses[1], **tolerance)
    for name, grad in grads[1].items():
        assert grad.abs().max() > 0, name
        torch.testing.assert_close(grads[0][name], grad, **tolerance, msg=name)


def test_4bit_experts_generate_as_their_dequantised_weights(tmp_path):
    """After for_inference, greedy generation reads the NF4 experts as training does."""
    path = _checkpoint(tmp_path, "gpt_oss")
    quantized, gold = _load_4bit(path, False), _load_4bit(path, True)
    ids = torch.randint(3, 500, (1, 6), generator=torch.Generator().manual_seed(0)).to(DEVICE)
    tokens = []
    for model in (quantized, gold):
        FastModel.for_inference(model)
        tokens.append(model.generate(input_ids=ids, max_new_tokens=6, do_sample=False).tolist())
    assert tokens[0] == tokens[1]


def test_4bit_experts_refuse_what_only_their_own_forward_computes(tmp_path):
    """NF4 experts have no 16-bit weights for the module's own forward, and none to merge
    into: both are refused with the reason."""
    from slothkit.export.merge import merged_state_dict

    path = _checkpoint(tmp_path, "qwen3_moe")
    model = _load_4bit(path, False)
    ids = torch.randint(3, 500, (1, 7), generator=torch.Generator().manual_seed(3)).to(DEVICE)
    with pytest.raises(
        ValueError, match="experts.base_layer.base_layer.gate_up_proj holds mixture-of-experts weights"
    ):
        merged_state_dict(model, base_weights=None)
    with pytest.raises(ValueError, match="merging into them is not supported"):
        model.save_pretrained_merged(str(tmp_path / "merged"), save_method="merged_16bit")
    assert not (tmp_path / "merged").exists() or not any((tmp_path / "merged").iterdir())
    model.save_pretrained(str(tmp_path / "adapters"))  # the adapters alone
    assert (tmp_path / "adapters" / "adapter_model.safetensors").exists()

    torch.manual_seed(11)
    model.add_adapter("second", model.peft_config["default"])
    model.base_model.set_adapter(["default", "second"])
    with pytest.raises(ValueError, match="quantised to 4 bits .* 2 adapters are active at once"):
        model(input_ids=ids)


def test_4bit_experts_left_unfused_stay_as_loaded(tmp_path):
    """fused=False: nothing computes through the fused experts, so nothing is quantised."""
    from slothkit.core.inspection import nf4_experts_of

    path = _checkpoint(tmp_path, "qwen3_moe")
    model, _ = FastModel.from_pretrained(str(path), dtype=torch.float32, load_in_4bit=True, fused=False)
    experts = [experts_base(m)[0] for m in experts_modules(model)]
    assert experts and all(nf4_experts_of(e.gate_up_proj) is None for e in experts)
    assert all(e.gate_up_proj.untyped_storage().nbytes() == e.gate_up_proj.numel() * 4 for e in experts)


def test_models_with_fused_experts_or_qk_norms_are_launch_bound(tmp_path):
    """FastModel's default for layer graphs: on where the host's launches limit a layer:
    fused experts (Qwen3-MoE, gpt-oss), per-head q/k norms (a record's or on the generic
    path); not a plain 16-bit Llama."""
    from slothkit.loading.training_mode import is_launch_bound
    from slothkit.testing import tiny_model_path

    def loaded(path):
        model, _ = FastModel.from_pretrained(str(path), dtype=torch.float32, load_in_4bit=False, fused=True)
        return model

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        assert not is_launch_bound(loaded(tiny_model_path("llama")))
        assert is_launch_bound(loaded(tiny_model_path("qwen3")))
        assert is_launch_bound(loaded(_checkpoint(tmp_path, "qwen3_moe")))
        assert is_launch_bound(loaded(_checkpoint(tmp_path, "gpt_oss")))


@pytest.mark.parametrize("family", ["qwen3_moe", "gpt_oss", "gemma4_text"])
def test_checkpointed_layers_take_their_kept_experts_forward(family, tmp_path, monkeypatch):
    """Offloaded checkpointing with keep_sums (the default on compute capability 8.0 and
    up): each layer's forward keeps its experts' forward and the re-run takes it, so a step
    runs 4 grouped GEMMs per layer rather than 6, with the gradients of keep_sums=False bit
    for bit (Gemma 4's norm after the experts reads their kept output in the re-run)."""
    import slothkit_kernels.moe.experts as experts_op

    path = _checkpoint(tmp_path, family)
    ids = torch.randint(3, 500, (2, 11), generator=torch.Generator().manual_seed(4)).to(DEVICE)
    products = []
    real = experts_op.grouped_lora_gemm

    def counted(*args, **kwargs):
        products.append(1)
        return real(*args, **kwargs)

    monkeypatch.setattr(experts_op, "grouped_lora_gemm", counted)

    def step(keep_sums: bool):
        model, _ = FastModel.from_pretrained(str(path), dtype=torch.float32, load_in_4bit=False, fused=True)
        model = FastModel.get_peft_model(
            model, r=8, lora_alpha=16, use_gradient_checkpointing="unsloth", keep_sums=keep_sums
        )
        _random_b(model, seed=5)
        products.clear()
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        grads = {name: p.grad for name, p in model.named_parameters() if p.grad is not None}
        return loss.detach(), grads, len(products)

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        kept_loss, kept_grads, kept_products = step(keep_sums=True)
        loss, grads, plain_products = step(keep_sums=False)
    assert (kept_products, plain_products) == (2 * 4, 2 * 6)
    assert torch.equal(kept_loss, loss)
    assert kept_grads.keys() == grads.keys() and any("experts" in name for name in grads)
    for name, grad in grads.items():
        assert torch.equal(kept_grads[name], grad), name
