"""slothkit.memory.memory_model: what a kept layer saves, counted through autograd, and the
recompute choice as the budget grows."""

import dataclasses
import warnings

import pytest
import torch

from slothkit import FastModel
from slothkit.core.model_state import state_of
from slothkit.memory.memory_model import (
    GIB,
    MemoryBudgetError,
    TrainingMemory,
    activation_bytes,
    kept_layer_bytes,
    lora_bytes,
    weights_bytes,
)
from slothkit.models import shape_by_name
from slothkit.models.shape import shape_from_config
from slothkit.testing import build_tiny_model


def _saved_bytes_per_layer(model, ids) -> list[int]:
    """Bytes each decoder layer's forward hands autograd to keep for backward: distinct
    storages, parameters (frozen or trained) left out, as they are held anyway, and so are
    the layer's inputs other than its hidden states (the position embeddings' cos and sin, the
    mask): the model makes them once per step and every layer reads the same ones."""
    layers = model.get_base_model().model.layers
    held = {p.untyped_storage().data_ptr() for p in model.parameters()}
    current, saved, shared = [None], [dict() for _ in layers], set()

    def pack(tensor):
        storage = tensor.untyped_storage()
        if current[0] is not None and storage.data_ptr() not in held and storage.data_ptr() not in shared:
            saved[current[0]][storage.data_ptr()] = storage.nbytes()
        return tensor

    def enter(index, args, kwargs):
        current[0] = index
        inputs = list(args[1:]) + [v for k, v in kwargs.items() if k != "hidden_states"]
        shared.clear()
        for value in inputs:
            for tensor in value if isinstance(value, (tuple, list)) else (value,):
                if isinstance(tensor, torch.Tensor):
                    shared.add(tensor.untyped_storage().data_ptr())

    handles = []
    for index, layer in enumerate(layers):
        handles.append(
            layer.register_forward_pre_hook(
                lambda _, args, kwargs, i=index: enter(i, args, kwargs), with_kwargs=True
            )
        )
        handles.append(layer.register_forward_hook(lambda *_: current.__setitem__(0, None)))
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        model(input_ids=ids, labels=ids).loss.backward()
    for handle in handles:
        handle.remove()
    return [sum(layer.values()) for layer in saved]


@pytest.mark.skipif(
    torch.cuda.is_available(), reason="counts the CPU's attention; CUDA's kernels save their RNG state too"
)
@pytest.mark.parametrize("arch", ["llama", "gemma", "qwen3", "gemma3", "phi3"])
def test_a_kept_layer_saves_what_the_model_says(arch, tmp_path):
    """Layer by layer, the fused path (the kernels' own autograd Functions, under the
    Triton interpreter) keeps exactly ``kept_layer_bytes``, to the byte: in fp32 on the CPU
    nothing is rounded or padded.  Qwen3's and Gemma 3's q/k norms and Gemma 3's sandwich
    norms keep their inputs and 1/rms on top of Llama's layer.  The first layer is left
    out: its input, the embeddings, needs no gradient, so its first norm saves nothing.
    Gemma 3's window is wider than the sequence, so its sliding layers run unmasked like
    the others: given a mask, transformers' SDPA repeats K and V to every query head and
    the layer keeps those copies, which the model does not count.  Phi-3's fused qkv_proj
    and gate_up_proj, read as row slices, save what Llama's separate projections do."""
    window = {"sliding_window": 32} if arch == "gemma3" else {}
    path = build_tiny_model(arch, tmp_path, num_layers=3, num_heads=4, num_kv_heads=2, **window)
    model, _ = FastModel.from_pretrained(str(path), dtype=torch.float32, load_in_4bit=False, fused=True)
    model = FastModel.get_peft_model(model, r=8, use_gradient_checkpointing=False)
    batch, seq = 2, 20
    ids = torch.randint(3, model.config.vocab_size, (batch, seq), generator=torch.Generator().manual_seed(0))
    measured = _saved_bytes_per_layer(model, ids)
    expected = kept_layer_bytes(shape_from_config(model.config), batch * seq, rank=8, element_bytes=4)
    assert measured[1:] == [expected, expected]


@pytest.mark.cuda
def test_each_kept_layer_adds_what_it_saves_to_the_peak_on_a_gpu(tmp_path):
    """On a GPU (bf16, flash attention): a kept layer's saved tensors within 2 % of
    ``kept_layer_bytes``, an offloaded one's none, and each layer "auto" keeps raising the
    step's allocated peak by that much against every layer offloaded (within 15 %: the two
    peaks fall in different phases, the kept run's as backward starts, the other's in a
    layer's re-run)."""
    from slothkit.engine.checkpointing.recompute_policy import RecomputeNotice

    layers, batch, seq = 8, 4, 512
    path = build_tiny_model(
        "llama",
        tmp_path,
        hidden_size=512,
        intermediate_size=1536,
        num_layers=layers,
        num_heads=8,
        num_kv_heads=2,
    )
    peaks = {}
    for kept in (0, 6):
        model, _ = FastModel.from_pretrained(str(path), dtype=torch.bfloat16, load_in_4bit=False)
        model = FastModel.get_peft_model(model, r=8, use_gradient_checkpointing="auto", max_memory=2**40)
        policy = state_of(model).recompute_policy
        tokens = batch * seq
        # A budget between the peaks of `kept` and `kept + 1` kept layers.
        policy.budget = (policy.memory.reserved(tokens, kept) + policy.memory.reserved(tokens, kept + 1)) / 2
        shape = policy.memory.shape
        ids = torch.randint(3, shape.vocab_size, (batch, seq), device="cuda")
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", RecomputeNotice)
            measured = _saved_bytes_per_layer(model, ids)  # the first step: the policy decides
        # Offloaded layers save nothing in their forward; the kept ones (the last) their share.
        assert measured[: layers - kept] == [0] * (layers - kept)
        for saved in measured[layers - kept :]:
            assert saved == pytest.approx(kept_layer_bytes(shape, tokens, rank=8), rel=0.02)
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", RecomputeNotice)
            model(input_ids=ids, labels=ids).loss.backward()
        torch.cuda.synchronize()
        peaks[kept] = torch.cuda.max_memory_allocated() - base
        assert policy.choice.kept == kept
        del model, policy
        torch.cuda.empty_cache()
    per_layer = (peaks[6] - peaks[0]) / 6
    assert per_layer == pytest.approx(kept_layer_bytes(shape, batch * seq, rank=8), rel=0.15)


@pytest.mark.parametrize("arch", ["llama", "phi3"])
def test_lora_bytes_count_the_adapters_get_peft_model_adds(arch, tmp_path):
    """16 bytes (fp32 weight, gradient, two AdamW moments) per adapter parameter; Phi-3's
    fused qkv_proj and gate_up_proj have one A per group."""
    path = build_tiny_model(arch, tmp_path, num_layers=2, num_heads=4, num_kv_heads=2)
    model, _ = FastModel.from_pretrained(str(path), dtype=torch.float32, load_in_4bit=False, fused=False)
    model = FastModel.get_peft_model(model, r=8, use_gradient_checkpointing=False)
    trained = sum(p.numel() for p in model.parameters() if p.requires_grad)
    assert lora_bytes(shape_from_config(model.config), 8) == 16 * trained


def _memory(**switches) -> TrainingMemory:
    shape = shape_by_name("llama-3-8b")
    return TrainingMemory(shape, "qlora", lora_bytes(shape, 16), **switches)


@pytest.mark.parametrize("switches", [{}, {"cuda_graphs": True, "keep_sums": True}])
def test_the_kept_layers_grow_with_the_budget(switches):
    memory = _memory(**switches)
    tokens = 2 * 2048
    least, most = memory.reserved(tokens, 0), memory.reserved(tokens, 32)
    assert memory.recompute_choice(tokens, least).kept == 0
    assert memory.recompute_choice(tokens, 10**15).kept == 32
    assert memory.recompute_choice(tokens, most).kept == 32
    assert memory.recompute_choice(tokens, most - 1).kept == 31
    kept = [memory.recompute_choice(tokens, least + step * (most - least) / 50).kept for step in range(51)]
    assert kept == sorted(kept) and kept[0] == 0 and kept[-1] == 32
    assert len(set(kept)) > 20  # every layer is a step of its own, not a jump to all
    for budget in (least, (least + most) / 2, most):
        choice = memory.recompute_choice(tokens, budget)
        assert choice.peak_bytes == memory.reserved(tokens, choice.kept) <= budget
        if choice.kept < 32:
            assert memory.reserved(tokens, choice.kept + 1) > budget


def test_a_budget_below_full_offload_names_the_least_it_needs():
    memory = _memory()
    least = memory.reserved(4096, 0)
    with pytest.raises(MemoryBudgetError, match=f"needs at least {least / GIB:.2f} GiB") as error:
        memory.recompute_choice(4096, least - 1)
    assert error.value.minimum_bytes == least and error.value.budget_bytes == least - 1
    assert "budget of" in str(error.value) and "max_memory" in str(error.value)
    assert "load_in_4bit" not in str(error.value)  # NF4 already: no advice to load it so
    sixteen_bit = dataclasses.replace(memory, mode="lora")
    with pytest.raises(MemoryBudgetError) as error:
        sixteen_bit.recompute_choice(4096, sixteen_bit.reserved(4096, 0) - 1)
    assert "or load the model with load_in_4bit=True" in str(error.value)


def test_kept_sums_give_way_where_only_that_fits():
    """Between the least a step reserves keeping nothing for the re-runs and the least it
    reserves keeping the sums, a choice that may stop keeping does, and is the choice of
    layers that keep nothing; one that may not names the least with the sums kept."""
    keeping = _memory(keep_sums=True)
    lean = dataclasses.replace(keeping, keep_sums=False)
    tokens = 4096
    least_lean, least_keeping = lean.reserved(tokens, 0), keeping.reserved(tokens, 0)
    assert least_lean < least_keeping
    budget = (least_lean + least_keeping) / 2
    choice = keeping.recompute_choice(tokens, budget, may_stop_keeping=True)
    assert choice.stops_keeping and choice == dataclasses.replace(
        lean.recompute_choice(tokens, budget), stops_keeping=True
    )
    assert "recompute their residual sums and experts' products instead of keeping them" in choice.notice()
    with pytest.raises(MemoryBudgetError, match=f"needs at least {least_keeping / GIB:.2f} GiB"):
        keeping.recompute_choice(tokens, budget)
    # Where the kept sums fit, they stay; below the lean least, nothing fits.
    assert not keeping.recompute_choice(tokens, least_keeping, may_stop_keeping=True).stops_keeping
    with pytest.raises(MemoryBudgetError, match=f"needs at least {least_lean / GIB:.2f} GiB"):
        keeping.recompute_choice(tokens, least_lean - 1, may_stop_keeping=True)


def test_graphs_and_kept_sums_cost_reserved_memory_only_while_layers_are_checkpointed():
    plain, both = _memory(), _memory(cuda_graphs=True, keep_sums=True)
    hidden = 4096 * 4096 * 2  # tokens x H x 2 bytes
    assert both.allocated(4096, 5) == plain.allocated(4096, 5)
    assert both.reserved(4096, 5) - plain.reserved(4096, 5) == pytest.approx(3.5 * 27 * hidden)
    assert both.reserved(4096, 32) == plain.reserved(4096, 32)
    # Past the graphs' token bound the layers run eagerly and keep nothing.
    assert both.reserved(32768, 0) == plain.reserved(32768, 0)


def test_the_default_token_bound_is_the_checkpointer_s():
    from slothkit.engine.checkpointing.offload_checkpoint import OffloadedCheckpointer
    from slothkit.engine.layer_graphs import LayerGraphs

    bound = TrainingMemory(shape_by_name("tiny-llama"), "lora", 0.0).graph_max_tokens
    assert bound == LayerGraphs().max_tokens == OffloadedCheckpointer().keep_max_tokens


def _tiny_qwen3_moe(tmp_path, **peft_options):
    from transformers import AutoConfig, AutoModelForCausalLM

    from slothkit.testing import build_tiny_tokenizer

    config = AutoConfig.for_model(
        "qwen3_moe", hidden_size=48, intermediate_size=40, num_hidden_layers=3, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, vocab_size=512, moe_intermediate_size=24, num_experts=6,
        num_experts_per_tok=2, pad_token_id=0,
    )  # fmt: skip
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config).save_pretrained(tmp_path / "moe")
    build_tiny_tokenizer("bpe", tmp_path / "moe")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the generic path and the experts' adapters are said
        model, _ = FastModel.from_pretrained(
            str(tmp_path / "moe"), dtype=torch.float32, load_in_4bit=False, fused=True
        )
        return FastModel.get_peft_model(model, r=8, **{"use_gradient_checkpointing": False, **peft_options})


@pytest.mark.skipif(
    torch.cuda.is_available(), reason="counts the CPU's attention; CUDA's kernels save their RNG state too"
)
def _tile_schedule_bytes(shape, tokens: int, dtype: torch.dtype) -> int:
    """What the routing's tile schedule keeps, which kept_layer_bytes leaves out (it grows
    with the experts, not the tokens, and its tile rows are the kernel's choice): the
    experts' row offsets, and each tile's expert and first row."""
    import math

    from slothkit_kernels.moe.grouped_gemm import tile_sizes

    experts = shape.experts()
    tiles = math.ceil(tokens * experts.top_k / tile_sizes(dtype)["BLOCK_M"]) + experts.count
    return 4 * (experts.count + 1) + 2 * 4 * tiles


def test_a_kept_mixture_of_experts_layer_saves_what_the_model_says(tmp_path):
    """Qwen3-MoE on the generic path (fused norms, attention with per-head q/k norms, fused
    experts): each layer keeps kept_layer_bytes and the routing's tile schedule, to the
    byte.  Its router does not renormalise (the config's norm_topk_prob), so keeps no
    division.  Its adapters, every expert's, are lora_bytes exactly."""
    model = _tiny_qwen3_moe(tmp_path)
    shape = shape_from_config(model.config)
    assert shape.experts() is not None and shape.experts().count == 6
    assert not shape.experts().renormalised
    trained = sum(p.numel() for p in model.parameters() if p.requires_grad)
    assert lora_bytes(shape, 8) == 16 * trained
    batch, seq = 2, 20
    ids = torch.randint(3, model.config.vocab_size, (batch, seq), generator=torch.Generator().manual_seed(0))
    measured = _saved_bytes_per_layer(model, ids)
    tokens = batch * seq
    expected = kept_layer_bytes(shape, tokens, rank=8, element_bytes=4)
    assert measured[1:] == [expected + _tile_schedule_bytes(shape, tokens, torch.float32)] * 2


def test_a_checkpointed_mixture_of_experts_layer_keeps_what_the_model_says(tmp_path, monkeypatch):
    """Offloaded checkpointing that keeps: each layer's forward keeps its fused experts'
    forward for the re-run, experts_forward_bytes of it, and the routing's tile schedule
    besides (which grows with the experts, not the tokens); TrainingMemory counts it in a
    checkpointed layer's bytes while layers keep, and not above the step size they keep at."""
    import math

    import slothkit.engine.experts as experts_glue
    from slothkit.memory.memory_model import experts_forward_bytes
    from slothkit_kernels.moe.grouped_gemm import tile_sizes

    model = _tiny_qwen3_moe(tmp_path, use_gradient_checkpointing="unsloth", keep_sums=True)
    kept = []
    real = experts_glue.keep_group

    def measured(prefix, tensors):
        kept.append(sum(t.numel() * t.element_size() for t in tensors.values()))
        return real(prefix, tensors)

    monkeypatch.setattr(experts_glue, "keep_group", measured)
    batch, seq = 2, 20
    ids = torch.randint(3, model.config.vocab_size, (batch, seq), generator=torch.Generator().manual_seed(0))
    model(input_ids=ids, labels=ids).loss.backward()

    shape = shape_from_config(model.config)
    tokens, experts = batch * seq, shape.experts()
    tiles = math.ceil(tokens * experts.top_k / tile_sizes(torch.float32)["BLOCK_M"]) + experts.count
    schedule = 4 * (experts.count + 1) + 2 * 4 * tiles  # offsets, each tile's expert and first row
    expected = experts_forward_bytes(shape, tokens, rank=8, element_bytes=4) + schedule
    assert kept == [expected] * shape.num_hidden_layers

    memory = TrainingMemory(shape, "lora", lora_bytes(shape, 8), rank=8, element_bytes=4, keep_sums=True)
    hidden_state = tokens * shape.hidden_size * 4
    per_layer = experts_forward_bytes(shape, tokens, rank=8, element_bytes=4)
    assert memory.checkpoint_bytes(tokens) == 2 * hidden_state + per_layer
    long = memory.graph_max_tokens * 2
    assert memory.checkpoint_bytes(long) == long * shape.hidden_size * 4
    plain = dataclasses.replace(memory, keep_sums=False)
    assert memory.allocated(tokens) == plain.allocated(tokens) + 2 * per_layer


def _tiny_qwen3_5_config(**sizes):
    """A Qwen3.5 text config whose widths all differ (H, I, Hq D, Hkv D, the DeltaNet's
    key and value widths), so that a term counted with the wrong one shows."""
    from transformers import AutoConfig

    defaults = dict(
        hidden_size=48, intermediate_size=40, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
        head_dim=12, vocab_size=512, linear_num_key_heads=2, linear_num_value_heads=6, linear_key_head_dim=8,
        linear_value_head_dim=10, linear_conv_kernel_dim=4, layer_types=["linear_attention"] * 3 + ["full_attention"],
        pad_token_id=0,
    )  # fmt: skip
    return AutoConfig.for_model("qwen3_5_text", **{**defaults, **sizes})


def _is_nf4_in_qlora(name: str, parameter: torch.Tensor) -> bool:
    """Whether QLoRA holds a parameter in NF4: the linear layers' weights (bitsandbytes
    quantises every nn.Linear, the shared expert's gate H -> 1 among them, the head
    aside) and the experts' 3-D parameters (slothkit quantises them as they load); not
    the router's weight, a bare parameter, nor the DeltaNet's convolution."""
    if ".experts." in name:
        return True
    return parameter.dim() == 2 and ("proj" in name or "shared_expert_gate" in name)


@pytest.mark.parametrize("name", ["tiny-qwen3.5", "qwen3.5-9b", "qwen3.5-35b-a3b", "qwen3.5-35b-a3b-8l"])
def test_a_hybrid_model_s_weights_count_its_parameters(name):
    """Qwen3.5 and Qwen3.5-MoE built on the meta device: weights_bytes at one byte a
    parameter is its parameter count, both kinds of layer (the gated attention's double
    q_proj, the DeltaNet layers' projections, convolution and decay parameters) and the
    MoE sizes' routed experts, router, shared expert and its gate included; in NF4 the
    projections and experts shrink and the rest does not."""
    from transformers import AutoModelForCausalLM

    shape = shape_by_name(name)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(shape.config())
    assert weights_bytes(shape, "lora", element_bytes=1) == sum(p.numel() for p in model.parameters())
    nf4 = sum(p.numel() for n, p in model.named_parameters() if _is_nf4_in_qlora(n, p))
    others = sum(p.numel() for p in model.parameters()) - nf4
    expected = nf4 * (0.5 + 1 / 64 + 4 / 16384) + 2 * others
    assert weights_bytes(shape, "qlora") == pytest.approx(expected, rel=1e-12)


def test_qwen3_5_35b_a3b_is_planned_at_its_size():
    """Qwen3.5-35B-A3B: 34.66 billion parameters, about 18 GiB in NF4 (the experts
    quantised with the projections); its adapters, every expert's at r = 16, about 14 GiB
    with their gradients and AdamW's moments."""
    from slothkit.memory.plan import plan

    shape = shape_by_name("qwen3.5-35b-a3b")
    assert weights_bytes(shape, "lora", element_bytes=1) == pytest.approx(34.66e9, rel=1e-3)
    planned = plan("qwen3.5-35b-a3b", gpu="h100", mode="qlora")
    assert 17 < planned.weights_gib < 19
    assert lora_bytes(shape, 16) / GIB == pytest.approx(14.0, rel=0.01)
    assert planned.fits


@pytest.mark.skipif(
    torch.cuda.is_available(), reason="counts the CPU's attention; CUDA's kernels save their RNG state too"
)
@pytest.mark.parametrize(("dtype", "seq"), [(torch.float32, 70), (torch.bfloat16, 20)])
def test_a_kept_qwen3_5_layer_saves_what_the_model_says(dtype, seq, tmp_path):
    """A tiny Qwen3.5 (gated DeltaNet layers through slothkit's delta rule kernel, the
    gated full-attention layer through transformers' modules, PEFT's adapters on both):
    each kind of layer keeps kept_layer_bytes of its kind, to the byte, in fp32 over two
    chunks (the last one partial) and in bf16 (where the norms and the kernel keep fp32
    copies, the adapters fp32 copies of their inputs).  The adapters, in_proj_qkv,
    in_proj_z and out_proj among them, are lora_bytes exactly."""
    from transformers import AutoModelForCausalLM

    from slothkit.testing import build_tiny_tokenizer

    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(_tiny_qwen3_5_config()).save_pretrained(tmp_path / "m")
    build_tiny_tokenizer("bpe", tmp_path / "m")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the generic path and the DeltaNet adapters are said
        model, _ = FastModel.from_pretrained(str(tmp_path / "m"), dtype=dtype, load_in_4bit=False, fused=True)
        model = FastModel.get_peft_model(model, r=8, use_gradient_checkpointing=False)
    shape = shape_from_config(model.config)
    assert shape.linear_attention() is not None
    trained = sum(p.numel() for p in model.parameters() if p.requires_grad)
    assert lora_bytes(shape, 8) == 16 * trained
    batch = 2
    ids = torch.randint(3, 512, (batch, seq), generator=torch.Generator().manual_seed(0))
    measured = _saved_bytes_per_layer(model, ids)
    e = 4 if dtype == torch.float32 else 2
    expected = [
        kept_layer_bytes(shape, batch * seq, rank=8, element_bytes=e, layer_type=kind, sequences=batch)
        for kind in shape.layer_types()
    ]
    assert measured[1:] == expected[1:]
    assert expected[1] != expected[3]


# The fields of _tiny_qwen3_5_config that a Qwen3.5-MoE config shares (not the dense MLP's width).
_TINY_QWEN3_5_FIELDS = (
    "hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads", "head_dim",
    "vocab_size", "linear_num_key_heads", "linear_num_value_heads", "linear_key_head_dim",
    "linear_value_head_dim", "linear_conv_kernel_dim", "layer_types", "pad_token_id",
)  # fmt: skip


def _tiny_qwen3_5_moe(tmp_path, dtype):
    """A tiny Qwen3.5-MoE on slothkit's generic path (fused norms, the shared expert as a
    fused MLP, the routed experts fused, the delta rule kernel), with PEFT's adapters: the
    widths of _tiny_qwen3_5_config, and the experts' (W, 2 W), the shared expert's (Ws)
    and the experts' count all different from them and from each other."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from slothkit.testing import build_tiny_tokenizer

    dense = _tiny_qwen3_5_config().to_dict()
    sizes = {k: dense[k] for k in _TINY_QWEN3_5_FIELDS}
    config = AutoConfig.for_model(
        "qwen3_5_moe_text", **sizes, num_experts=5, num_experts_per_tok=2, moe_intermediate_size=28,
        shared_expert_intermediate_size=20,
    )  # fmt: skip
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config).save_pretrained(tmp_path / "moe")
    build_tiny_tokenizer("bpe", tmp_path / "moe")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the generic path, the DeltaNet and experts' adapters are said
        model, _ = FastModel.from_pretrained(
            str(tmp_path / "moe"), dtype=dtype, load_in_4bit=False, fused=True
        )
        return FastModel.get_peft_model(model, r=8, use_gradient_checkpointing=False)


@pytest.mark.skipif(
    torch.cuda.is_available(), reason="counts the CPU's attention; CUDA's kernels save their RNG state too"
)
@pytest.mark.parametrize(("dtype", "seq"), [(torch.float32, 70), (torch.bfloat16, 20)])
def test_a_kept_qwen3_5_moe_layer_saves_what_the_model_says(dtype, seq, tmp_path):
    """A tiny Qwen3.5-MoE: each kind of layer keeps kept_layer_bytes of its kind (the
    routed experts' and router's terms of Qwen3-MoE, the shared expert's fused MLP, its
    gate's sigmoid and the product's other factor) and the routing's tile schedule, to the
    byte, in fp32 and in bf16 (where the experts keep their rows' weights in bf16 beside
    the router's fp32 ones, and the shared expert's fused MLP 16-bit copies of its
    adapters).  The config's missing intermediate_size is the experts' width; the adapters
    (every expert's through PEFT's target_parameters, the shared expert's gate/up/down as
    linear layers, not its gate nor the router) are lora_bytes exactly, and the weights
    weights_bytes."""
    from slothkit.models.shape import ExpertsShape

    model = _tiny_qwen3_5_moe(tmp_path, dtype)
    shape = shape_from_config(model.config)
    assert shape.intermediate_size == 28
    assert shape.experts() == ExpertsShape(count=5, width=28, top_k=2, layers=4, shared_width=20)
    trained = sum(p.numel() for p in model.parameters() if p.requires_grad)
    assert lora_bytes(shape, 8) == 16 * trained
    frozen = sum(p.numel() for p in model.parameters() if not p.requires_grad)
    assert weights_bytes(shape, "lora", element_bytes=1) == frozen
    batch = 2
    ids = torch.randint(3, 512, (batch, seq), generator=torch.Generator().manual_seed(0))
    measured = _saved_bytes_per_layer(model, ids)
    e = 4 if dtype == torch.float32 else 2
    tokens = batch * seq
    schedule = _tile_schedule_bytes(shape, tokens, dtype)
    expected = [
        kept_layer_bytes(shape, tokens, rank=8, element_bytes=e, layer_type=kind, sequences=batch) + schedule
        for kind in shape.layer_types()
    ]
    assert measured[1:] == expected[1:]
    assert expected[1] != expected[3]


def test_a_hybrid_model_keeps_its_last_layers_by_their_kind():
    """The "auto" policy keeps the last layers: in Qwen3.5-9B the last is a full-attention layer, the
    three before it DeltaNet layers; each adds its own kind's bytes."""
    shape = shape_by_name("qwen3.5-9b")
    tokens = 2 * 2048
    full = kept_layer_bytes(shape, tokens, layer_type="full_attention")
    linear = kept_layer_bytes(shape, tokens, layer_type="linear_attention")
    none = activation_bytes(shape, tokens, kept_layers=0)
    assert activation_bytes(shape, tokens, kept_layers=1) - none == pytest.approx(full)
    assert activation_bytes(shape, tokens, kept_layers=4) - none == pytest.approx(full + 3 * linear)
    assert activation_bytes(shape, tokens, kept_layers=32) - none == pytest.approx(8 * full + 24 * linear)
    with pytest.raises(ValueError, match="layer_type='sliding_attention'; accepted"):
        kept_layer_bytes(shape, tokens, layer_type="sliding_attention")


def test_the_planner_s_delta_rule_chunk_is_the_kernel_s():
    from slothkit.memory.hybrid_layers import DELTA_RULE_CHUNK
    from slothkit_kernels.delta_rule.ops import CHUNK

    assert DELTA_RULE_CHUNK == CHUNK


@pytest.mark.cuda
def test_a_kept_qwen3_5_layer_saves_what_the_model_says_on_a_gpu(tmp_path):
    """On a GPU, in bf16 (the delta rule through its Triton kernel, SDPA's own kernel):
    a DeltaNet layer keeps kept_layer_bytes within 1 %; a full-attention layer within
    5 %, the prediction high by the attention output's copy, which CUDA's kernels make a
    view, less their RNG state."""
    from transformers import AutoModelForCausalLM

    from slothkit.testing import build_tiny_tokenizer

    config = _tiny_qwen3_5_config(
        hidden_size=256, intermediate_size=640, num_attention_heads=8, head_dim=32, linear_num_value_heads=8,
        linear_key_head_dim=64, linear_value_head_dim=64,
    )  # fmt: skip
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config).save_pretrained(tmp_path / "m")
    build_tiny_tokenizer("bpe", tmp_path / "m")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model, _ = FastModel.from_pretrained(
            str(tmp_path / "m"), dtype=torch.bfloat16, load_in_4bit=False, fused=True
        )
        model = FastModel.get_peft_model(model, r=8, use_gradient_checkpointing=False)
    batch, seq = 2, 512
    ids = torch.randint(3, 512, (batch, seq), device="cuda")
    measured = _saved_bytes_per_layer(model, ids)
    shape = shape_from_config(model.config)
    for saved, kind in list(zip(measured, shape.layer_types()))[1:]:
        expected = kept_layer_bytes(shape, batch * seq, rank=8, layer_type=kind, sequences=batch)
        assert saved == pytest.approx(expected, rel=0.01 if kind == "linear_attention" else 0.05)


@pytest.mark.parametrize(
    "name", ["gemma-4-e4b", "gpt-oss-20b", "qwen3-30b-a3b", "qwen3.5-9b", "llama-3-8b", "gemma-7b", "phi-4"]
)
def test_the_weights_counted_are_the_parameters_transformers_builds(name):
    """The planner's weights at one byte each are the parameters of the model transformers
    builds from the shape, to 1% (Gemma 4 E4B's per-layer input embeddings, 2.8 billion of
    its 8.1, included; its wider full-attention heads and its layers without keys and
    values of their own are not counted apart)."""
    from transformers import AutoModelForCausalLM

    shape = shape_by_name(name)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(shape.config())
    parameters = sum(p.numel() for p in model.parameters())
    assert weights_bytes(shape, "lora", element_bytes=1) == pytest.approx(parameters, rel=0.01)
