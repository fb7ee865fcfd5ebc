"""The decoder layers of a model slothkit has no record for, through the fused kernels
where they compute what the model's own modules do, checked at loading.

Many families without a record (Qwen3-MoE, Mixtral, OLMo, Granite, SmolLM3, ...) build
their layers from Llama's parts: an RMSNorm before attention and before the MLP, q/k/v/o
projections with RoPE from the model's rotary tables (some with per-head q/k norms), and
a gated MLP or a mixture-of-experts block. Where a model is built that way, slothkit's
fused decoder pieces (slothkit.engine.decoder: the norms, the attention with its fused
LoRA projections and RoPE, the two residual sums of the decoder layer, a gated MLP) run
in place of those modules, with no record. What the parts do can differ in ways no list
of config fields captures (a residual multiplier, layers without RoPE, attention sinks,
RoPE over part of each head), so the model decides, as for the fused head
(slothkit.engine.generic_head): every layer's attention and MLP outputs and the last
hidden state on one short random batch are computed before and after patching, in eval
mode, and the patches stay only if each pair agrees to the rounding of the model's dtype. Otherwise every patch made here is
undone, and the caller says why once.

A mixture-of-experts block is left to slothkit.engine.experts (its experts fused, its
router as it is); the layer forward calls it as transformers does.
"""

from __future__ import annotations

import copy
import math

import torch
from torch import nn

from slothkit.core.inspection import attention_window
from slothkit.core.model_state import detach_patched_module, patched_module
from slothkit.engine.decoder import patch_attention, patch_decoder_layer, patch_mlp, patch_rms_norm
from slothkit.models.architecture import generic_path_reason

CHECK_TOKENS = 24  # the random batch the hidden states are compared on: 1 x CHECK_TOKENS
PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj")
MLP_PROJECTIONS = ("gate_proj", "up_proj", "down_proj")
# Residual-path dropout, which the fused decoder layer does not apply (the attention's own
# attention_dropout it does).
RESIDUAL_DROPOUTS = ("hidden_dropout", "resid_pdrop", "residual_dropout", "mlp_dropout", "ffn_dropout")
# transformers' activation modules -> the fused MLP's activation.
ACTIVATIONS = {
    "SiLUActivation": "swiglu",
    "SiLU": "swiglu",
    "GELUTanh": "geglu_tanh",
    "PytorchGELUTanh": "geglu_tanh",
    "NewGELUActivation": "geglu_tanh",
    "FastGELUActivation": "geglu_tanh",
    "GELUActivation": "geglu",
}


def relative_tolerance(dtype: torch.dtype) -> float:
    # Norm-wise relative difference of one output: the fused kernels round in other
    # places than the modules they replace, one unit of the dtype per operation, and the
    # inputs of later layers differ by what earlier ones rounded. A semantic difference (a
    # missing multiplier, a layer without RoPE, another norm) moves an output by order one.
    return 1e-4 if dtype == torch.float32 else 3e-2


def _eps(norm: nn.Module) -> float | None:
    eps = getattr(norm, "variance_epsilon", None)
    if eps is None:
        eps = getattr(norm, "eps", None)
    return float(eps) if isinstance(eps, (int, float)) else None


def _is_rms_norm(norm) -> bool:
    weight = getattr(norm, "weight", None)
    return (
        isinstance(norm, nn.Module)
        and isinstance(weight, torch.Tensor)
        and weight.dim() == 1
        and getattr(norm, "bias", None) is None
        and _eps(norm) is not None
    )


def _norm_adds_one(norm: nn.Module) -> bool | None:
    """Whether ``norm`` scales by 1 + weight (Gemma's) or by weight, checked on a random
    input; None when it computes neither RMSNorm."""
    weight = norm.weight
    generator = torch.Generator(device="cpu").manual_seed(0)
    x = torch.randn(3, weight.shape[0], generator=generator).to(weight.device, weight.dtype)
    with torch.no_grad():
        own = norm(x).float()
        normed = x.float() * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + _eps(norm))
        for adds_one in (False, True):
            scale = weight.float() + 1.0 if adds_one else weight.float()
            expected = (normed.to(weight.dtype).float() * scale).to(weight.dtype).float()
            if torch.allclose(own, expected, rtol=relative_tolerance(weight.dtype) / 3, atol=1e-6):
                return adds_one
    return None


def _activation(mlp: nn.Module) -> str | None:
    return ACTIVATIONS.get(type(getattr(mlp, "act_fn", None)).__name__)


def why_layers_stay(causal_lm: nn.Module) -> str | None:
    """Why the fused layers do not apply by structure (None: they may; the numbers decide)."""
    reason = generic_path_reason(causal_lm.config)
    if reason is not None:
        return reason
    for name in RESIDUAL_DROPOUTS:
        if getattr(causal_lm.config, name, 0) or 0:
            return f"{name}={getattr(causal_lm.config, name)}: the fused layer adds its residual terms as they are"
    layers = getattr(getattr(causal_lm, "model", None), "layers", None)
    if not isinstance(layers, nn.ModuleList) or len(layers) == 0:
        return "its decoder layers are not at `.model.layers`"
    for layer in layers:
        if hasattr(layer, "pre_feedforward_layernorm") or hasattr(layer, "post_feedforward_layernorm"):
            return "its layers normalise the MLP's input or output apart from post_attention_layernorm"
        if not (
            _is_rms_norm(getattr(layer, "input_layernorm", None))
            and _is_rms_norm(getattr(layer, "post_attention_layernorm", None))
        ):
            return "its layers do not have Llama's two RMSNorms (input_layernorm, post_attention_layernorm)"
        attention = getattr(layer, "self_attn", None)
        if attention is None or not all(hasattr(attention, name) for name in PROJECTIONS):
            return "its attention does not have q_proj, k_proj, v_proj and o_proj"
        if not hasattr(attention, "head_dim") or not hasattr(attention, "scaling"):
            return "its attention states no head_dim and scaling"
        if hasattr(attention, "q_norm") != hasattr(attention, "k_norm"):
            return "its attention normalises one of q and k only"
        if hasattr(attention, "q_norm") and not (
            _is_rms_norm(attention.q_norm) and _is_rms_norm(attention.k_norm)
        ):
            return "its q/k norms are not RMSNorms"
        mlp = getattr(layer, "mlp", None)
        dense = mlp is not None and all(hasattr(mlp, name) for name in MLP_PROJECTIONS)
        if not dense and not hasattr(mlp, "experts"):
            return "its MLP is neither gate/up/down projections nor a mixture-of-experts block"
        if dense and _activation(mlp) is None:
            return f"its MLP's activation {type(getattr(mlp, 'act_fn', None)).__name__} is not one the fused MLP computes"
    return None


def _norms(causal_lm: nn.Module) -> list[nn.Module]:
    norms = []
    for layer in causal_lm.model.layers:
        norms += [layer.input_layernorm, layer.post_attention_layernorm]
        if hasattr(layer.self_attn, "q_norm"):
            norms += [layer.self_attn.q_norm, layer.self_attn.k_norm]
    final = getattr(causal_lm.model, "norm", None)
    if _is_rms_norm(final):
        norms.append(final)
    return norms


def _is_experts_block(mlp: nn.Module) -> bool:
    return hasattr(mlp, "experts") and not _is_dense(mlp)


def _outputs(causal_lm: nn.Module, ids: torch.Tensor, experts_inputs: list | None = None):
    """What each layer's attention and MLP add to the residual stream, then the last
    hidden state, on ``ids`` (float32 copies), and the inputs of its mixture-of-experts
    blocks. The attention's and the MLP's outputs are compared one by one, since each is
    small beside the residual stream it is added to: at random weights a layer that
    computes its attention otherwise (another RoPE, no RoPE) moves the last hidden state
    by less than a 16-bit dtype's rounding, but its own output by order one. (With a hook
    on it, the patched layer calls its attention module rather than fusing o_proj with the
    residual sum, so the hook sees the fused output.)

    A mixture-of-experts block routes each token to its top-k experts, and at random
    weights many tokens have near-tied router scores: a 16-bit rounding in its input
    flips a choice and moves that token's output by order one. So with
    ``experts_inputs`` (the first run's) each block's input is recorded for comparison
    (it is the post-attention norm's output, listed after the last hidden state) and the
    first run's is passed on in its place: the block, which is not patched here, then routes as it did, and what is
    compared is what the patches change."""
    seen, inputs = [], []

    def record(module, args, output):
        seen.append((output[0] if isinstance(output, tuple) else output).detach().float())

    def route_as_before(module, args, kwargs):
        hidden = args[0] if args else kwargs["hidden_states"]
        inputs.append(hidden.detach())
        if experts_inputs is None:
            return None
        earlier = experts_inputs[len(inputs) - 1]
        return ((earlier, *args[1:]), kwargs) if args else (args, {**kwargs, "hidden_states": earlier})

    hooks = []
    for layer in causal_lm.model.layers:
        hooks.append(layer.self_attn.register_forward_hook(record))
        if _is_experts_block(layer.mlp):
            hooks.append(layer.mlp.register_forward_pre_hook(route_as_before, with_kwargs=True))
        hooks.append(layer.mlp.register_forward_hook(record))
    try:
        with torch.no_grad():
            seen.append(causal_lm.model(input_ids=ids).last_hidden_state.float())
    finally:
        for hook in hooks:
            hook.remove()
    return seen + [hidden.float() for hidden in inputs], inputs


def worst_difference(differences: list[float]) -> float:
    """The largest of ``differences`` (0 for none); NaN where any is NaN, which Python's
    max would keep or drop by its place in the list."""
    return float("nan") if any(math.isnan(d) for d in differences) else max(differences, default=0.0)


def largest_difference(fused: list[torch.Tensor], own: list[torch.Tensor]) -> float:
    """The largest norm-wise relative difference between matching outputs (NaN where any
    is NaN)."""
    if len(fused) != len(own):
        return float("inf")
    return worst_difference([((f - o).norm() / o.norm().clamp_min(1e-12)).item() for f, o in zip(fused, own)])


def _causal_mask(tokens: int, window: int | None, device) -> torch.Tensor:
    """The additive (1, 1, T, T) mask transformers builds for one unpadded sequence: 0 where
    query i sees key j (j <= i, and i - j < window), float32's lowest value elsewhere. Given
    to both attentions, since an eager one without a mask attends to every key."""
    position = torch.arange(tokens, device=device)
    visible = position[None, :] <= position[:, None]
    if window is not None:
        visible &= position[:, None] - position[None, :] < window
    lowest = torch.finfo(torch.float32).min
    return torch.zeros(1, 1, tokens, tokens, device=device).masked_fill(~visible, lowest)


def _attention_difference(causal_lm: nn.Module, adds_one: bool) -> float:
    """The largest relative difference between each layer's attention and its fused copy,
    computed in float32 on a copy of the module whose projections hold random weights
    scaled so that the attention scores are of order one (and whose own parameters, such
    as sink logits, random ones of order one), at positions spread over the context. At the model's own small random weights (the tiny checkpoints) the scores
    are near zero and every query attends evenly whatever the rotation, so another RoPE
    (pairs of adjacent dimensions, part of each head, none at all) would go unseen."""
    rotary = getattr(causal_lm.model, "rotary_emb", None)
    if not isinstance(rotary, nn.Module):
        raise ValueError("its rotary embedding is not at `.model.rotary_emb`")
    device = causal_lm.get_input_embeddings().weight.device
    generator = torch.Generator(device="cpu").manual_seed(1)
    hidden = causal_lm.config.hidden_size
    context = getattr(causal_lm.config, "max_position_embeddings", None) or 4096
    positions = (torch.arange(CHECK_TOKENS) * (context // CHECK_TOKENS)).unsqueeze(0).to(device)
    x = torch.randn(1, CHECK_TOKENS, hidden, generator=generator).to(device)
    random_weights = {}  # one random weight per projection shape, shared by the layers

    def random_linear(own: nn.Module) -> nn.Linear:
        key = (own.in_features, own.out_features, own.bias is not None)
        if key not in random_weights:
            weight = (
                torch.randn(own.out_features, own.in_features, generator=generator) / own.in_features**0.5
            )
            bias = torch.randn(own.out_features, generator=generator) * 0.1 if key[2] else None
            random_weights[key] = (weight.to(device), None if bias is None else bias.to(device))
        linear = nn.Linear(own.in_features, own.out_features, bias=key[2], device="meta")
        weight, bias = random_weights[key]
        linear.weight = nn.Parameter(weight, requires_grad=False)
        if bias is not None:
            linear.bias = nn.Parameter(bias, requires_grad=False)
        return linear

    differences = []
    for layer in causal_lm.model.layers:
        # A copy without the projections' weights (the memo stands them in): random float32
        # ones of the same shapes take their place.
        projections = {name: getattr(layer.self_attn, name) for name in PROJECTIONS}
        attention = copy.deepcopy(layer.self_attn, memo={id(m): None for m in projections.values()})
        for name, own in projections.items():
            setattr(attention, name, random_linear(own))
        attention.float()  # q/k norms, attention sinks and the like
        with torch.no_grad():  # the module's own parameters (gpt-oss's sinks), at order one too
            for own in attention.parameters(recurse=False):
                own.copy_(torch.randn(own.shape, generator=generator))
        mask = _causal_mask(CHECK_TOKENS, attention_window(attention), device)
        with torch.no_grad():
            cos, sin = rotary(x, positions)
            own = attention(hidden_states=x, position_embeddings=(cos, sin), attention_mask=mask)[0]
            if hasattr(attention, "q_norm"):
                patch_rms_norm(attention.q_norm, adds_one)
                patch_rms_norm(attention.k_norm, adds_one)
            patch_attention(attention, qk_norm=hasattr(attention, "q_norm"))
            fused = attention(hidden_states=x, position_embeddings=(cos, sin), attention_mask=mask)[0]
        differences.append(largest_difference([fused], [own]))
    return worst_difference(differences)


def _is_dense(mlp: nn.Module) -> bool:
    """Whether ``mlp`` is a gated MLP of gate/up/down projections (else a mixture of experts)."""
    return all(hasattr(mlp, name) for name in MLP_PROJECTIONS)


def _patches(causal_lm: nn.Module, adds_one: bool) -> list[tuple[nn.Module, object]]:
    """(module, patch) for every module the fused layers replace: the norms, attention,
    dense MLPs and layers; a mixture-of-experts block is left as it is."""
    patches = [(norm, lambda m: patch_rms_norm(m, adds_one)) for norm in _norms(causal_lm)]
    for layer in causal_lm.model.layers:
        attention = layer.self_attn
        patches.append((attention, lambda m: patch_attention(m, qk_norm=hasattr(m, "q_norm"))))
        if _is_dense(layer.mlp):
            patches.append((layer.mlp, lambda m: patch_mlp(m, _activation(m))))
        patches.append((layer, patch_decoder_layer))
    return patches


def _unpatch(modules: list[nn.Module]) -> None:
    for module in modules:
        if detach_patched_module(module) is not None:
            module.__dict__.pop("forward", None)


def fuse_generic_layers(causal_lm: nn.Module) -> str | None:
    """Patch the fused decoder pieces onto ``causal_lm``'s layers where they compute what
    its modules do (module docstring); return why not otherwise, the model as it was."""
    reason = why_layers_stay(causal_lm)
    if reason is not None:
        return reason
    if any(patched_module(layer) is not None for layer in causal_lm.model.layers):
        return None  # patched already
    flavours = {_norm_adds_one(norm) for norm in _norms(causal_lm)}
    if None in flavours or len(flavours) > 1:
        return "its norms are not all one RMSNorm (weight, or 1 + weight)"
    (adds_one,) = flavours
    embeddings = causal_lm.get_input_embeddings()
    device, dtype = embeddings.weight.device, causal_lm.model.layers[0].input_layernorm.weight.dtype
    generator = torch.Generator(device="cpu").manual_seed(0)
    ids = torch.randint(0, embeddings.weight.shape[0], (1, CHECK_TOKENS), generator=generator).to(device)
    was_training = causal_lm.training
    causal_lm.eval()
    patched = []  # the modules patched so far, undone if the check fails
    try:
        attention_difference = _attention_difference(causal_lm, adds_one)
        if not attention_difference <= relative_tolerance(torch.float32):
            return (
                f"its attention computes something else than the fused one (in float32 at random "
                f"weights, their outputs differ by {attention_difference:.2g}, relative)"
            )
        own, experts_inputs = _outputs(causal_lm, ids)
        for module, patch in _patches(causal_lm, adds_one):
            patch(module)
            patched.append(module)
        fused, _ = _outputs(causal_lm, ids, experts_inputs)
    except (TypeError, AttributeError, ValueError, RuntimeError, IndexError) as error:
        _unpatch(patched)
        return f"its layers could not be checked against the fused ones ({type(error).__name__}: {error})"
    finally:
        causal_lm.train(was_training)
    difference = largest_difference(fused, own)
    if not difference <= relative_tolerance(dtype):  # a NaN fails too
        _unpatch(patched)
        return (
            f"its layers compute something else than the fused ones (an attention's or MLP's output "
            f"differs by {difference:.2g}, relative, on a random batch)"
        )
    return None
