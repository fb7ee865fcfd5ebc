"""A dropless mixture-of-experts block's experts with per-expert LoRA adapters:

    out_t = sum_j w_tj * down_e(act(gate_up_e(x_t)))            e = expert_ids[t, j]
    gate_up_e(x) = x W_e^T + s (x A_e^T) B_e^T + bias_e          (2I features)
    down_e(h)    = h V_e^T + s' (h A'_e^T) B'_e^T + bias'_e      (H features)

the experts of transformers' Qwen3MoeExperts, MixtralExperts, GptOssExperts and
Gemma4TextExperts with a LoRA adapter on each expert's projections.  Weights are logically (E, 2I, H) and
(E, H, I), (out, in) as Qwen3-MoE and Mixtral store them; ``weights_in_out=True`` reads
gpt-oss's (E, H, 2I) and (E, I, H) storage (y = x W_e) through transposed strides, with
no copy.  Base weights and biases are frozen; x, the routing weights w and the adapters
get gradients.

Forward, over the M = T * top_k (token, expert) rows sorted by expert (``routing``):
  G  = gate_up(x[token])      grouped GEMM, x's rows gathered, X A^T kept   (M, 2I)
  h  = act(G)                                                                (M, I)
  Y  = down(h)                grouped GEMM, h A'^T kept                      (M, H)
  out_t = sum_j w_tj Y[row(t, j)]                                            (T, H)
Saved: x, w, G and the two (M, r) adapter products; h and Y are not kept.

A forward computed once may be handed to a later differentiable call on the same inputs
(``moe_lora_experts_forward`` returns it as an ``ExpertsForward``; ``moe_lora_experts(...,
forward=)`` takes it): that call runs no GEMM and returns the same output, with the same
backward.  A checkpointed layer's re-run uses this to rebuild its graph without running
the experts' products a second time.

Backward, given dOut (T, H); for row i of token t, expert e, weight w:
  gY_i   = dOut_t V_e + s' (dOut_t B'_e) A'_e       the same grouped GEMM on transposed views
  h, dG  = act backward with dh_i = w gY_i          (h recomputed from G)
  dw_tj  = <dOut_t, Y_i> = <gY_i, h_i> + <dOut_t, bias'_e>
  dA'_e  = s' sum_i w (dOut_t B'_e)^T h_i           dB'_e = s' sum_i w dOut_t^T (h_i A'_e^T)
  dX_i   = dG_i W_e + s (dG_i B_e) A_e               dx_t = sum_j dX_row(t, j)
  dA_e   = s sum_i (dG_i B_e)^T x_t                  dB_e = s sum_i dG_i^T (x_t A_e^T)
The adapter sums run per expert (``expert_sums``) and dx per token (``combine_rows``):
no atomics anywhere, so the gradients are deterministic.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from slothkit_kernels.moe.activation import (
    ACTIVATIONS,
    expert_activation,
    expert_activation_backward,
    expert_activation_reference,
)
from slothkit_kernels.moe.combine import combine_rows
from slothkit_kernels.moe.expert_sums import expert_sums
from slothkit_kernels.moe.grouped_gemm import grouped_lora_gemm, tile_sizes
from slothkit_kernels.moe.lora import ExpertLoRA
from slothkit_kernels.moe.nf4_experts import NF4Experts
from slothkit_kernels.moe.routing import ExpertRouting, route_to_experts
from slothkit_kernels.utils import check_float_dtype, check_not_empty, use_triton, warn_reference_once

MAX_RANK = 64


def _logical_weights(gate_up, down, weights_in_out: bool):
    """(E, 2I, H) and (E, H, I) views of the base weights, whatever their storage
    (tensors, or NF4Experts records, whose ``mT`` is a tensor's)."""
    if weights_in_out:
        return gate_up.mT, down.mT
    return gate_up, down


def _dense(weight: torch.Tensor | NF4Experts) -> torch.Tensor:
    """The weight as a tensor: an NF4Experts record dequantised, in its logical shape."""
    return weight.dequantize() if isinstance(weight, NF4Experts) else weight


def _expert_linear(x, weight, lora: ExpertLoRA | None, bias, e: int):
    y = x @ weight[e].to(x.dtype).t()
    if lora is not None:
        y = y + lora.scale * (x @ lora.A[e].to(x.dtype).t()) @ lora.B[e].to(x.dtype).t()
    if bias is not None:
        y = y + bias[e].to(x.dtype)
    return y


def moe_lora_experts_reference(
    x: torch.Tensor,
    expert_ids: torch.Tensor,
    expert_weights: torch.Tensor,
    gate_up: torch.Tensor | NF4Experts,
    down: torch.Tensor | NF4Experts,
    *,
    gate_up_lora: ExpertLoRA | None = None,
    down_lora: ExpertLoRA | None = None,
    gate_up_bias: torch.Tensor | None = None,
    down_bias: torch.Tensor | None = None,
    activation: str = "swiglu",
    interleaved: bool = False,
    alpha: float = 1.702,
    limit: float = 7.0,
    weights_in_out: bool = False,
) -> torch.Tensor:
    """moe_lora_experts in plain torch, differentiable: a loop over experts as
    transformers' expert modules run it, in x's dtype (the routing weight's product is
    taken in the promoted dtype, then rounded to x's, as they do)."""
    w_gu, w_d = _logical_weights(_dense(gate_up), _dense(down), weights_in_out)
    out = torch.zeros_like(x)
    for e in range(w_gu.shape[0]):
        token_idx, k_pos = torch.where(expert_ids == e)
        if token_idx.numel() == 0:
            continue
        rows = x[token_idx]
        gu = _expert_linear(rows, w_gu, gate_up_lora, gate_up_bias, e)
        h = expert_activation_reference(gu, activation, interleaved, alpha, limit)
        y = _expert_linear(h, w_d, down_lora, down_bias, e)
        weighted = y * expert_weights[token_idx, k_pos, None]
        out = out.index_add(0, token_idx, weighted.to(x.dtype))
    return out


@dataclass
class _Experts:
    """What the autograd Function needs besides its differentiable inputs."""

    gate_up: torch.Tensor | NF4Experts  # (E, 2I, H) logical view
    down: torch.Tensor | NF4Experts  # (E, H, I) logical view
    gate_up_bias: torch.Tensor | None
    down_bias: torch.Tensor | None
    gate_up_scale: float
    down_scale: float
    activation: str
    interleaved: bool
    alpha: float
    limit: float


def _lora(a, b, scale) -> ExpertLoRA | None:
    return None if a is None else ExpertLoRA(a, b, scale)


@dataclass
class ExpertsForward:
    """What one forward of the experts computed (module docstring): the output and what
    the backward reads of it, for a later call on the same inputs to take as they are."""

    out: torch.Tensor  # (T, H)
    gate_up: torch.Tensor  # (M, 2I): G, the gate/up products before the activation
    xa: torch.Tensor | None  # (M, r): x A^T of the gate/up adapter, None without one
    ha: torch.Tensor | None  # (M, r): h A'^T of the down adapter, None without one
    routing: ExpertRouting

    _FIELDS = ("out", "gate_up", "xa", "ha")

    def tensors(self) -> dict[str, torch.Tensor]:
        """Every tensor it holds by name (the routing's as routing0, routing1, ...)."""
        named = {name: getattr(self, name) for name in self._FIELDS if getattr(self, name) is not None}
        named.update((f"routing{i}", t) for i, t in enumerate(self.routing.tensors()))
        return named

    @classmethod
    def from_tensors(cls, named: dict[str, torch.Tensor]) -> ExpertsForward:
        """The record ``tensors()`` flattened, rebuilt (from copies of those tensors, say)."""
        out, gate_up = named["out"], named["gate_up"]
        routing_tensors = [named[f"routing{i}"] for i in range(len(ROUTING_FIELDS))]
        offsets = routing_tensors[ROUTING_FIELDS.index("offsets")]
        routing = ExpertRouting(
            num_experts=offsets.shape[0] - 1,
            top_k=gate_up.shape[0] // out.shape[0],
            block_m=tile_sizes(out.dtype)["BLOCK_M"],
            **dict(zip(ROUTING_FIELDS, routing_tensors)),
        )
        return cls(out, gate_up, named.get("xa"), named.get("ha"), routing)


# ExpertRouting's tensors in the order its tensors() lists them.
ROUTING_FIELDS = ("tokens", "order", "row_expert", "inverse", "offsets", "tile_expert", "tile_row")


def _experts_forward(x, expert_weights, gu_lora, d_lora, experts: _Experts, routing) -> ExpertsForward:
    """The forward's products (module docstring), no autograd."""
    act = (experts.activation, experts.interleaved, experts.alpha, experts.limit)
    gate_up, xa = grouped_lora_gemm(
        x, routing, experts.gate_up, gu_lora, experts.gate_up_bias, gather=True, store_xa=True
    )  # (M, 2I), (M, r)
    h = expert_activation(gate_up, routing, *act)  # (M, I)
    y, ha = grouped_lora_gemm(
        h, routing, experts.down, d_lora, experts.down_bias, gather=False, store_xa=True
    )
    del h  # recomputed in backward
    out = combine_rows(y, routing, expert_weights)  # (T, H)
    return ExpertsForward(out, gate_up, xa, ha, routing)


class _MoELoRAExpertsFunction(torch.autograd.Function):
    """apply(x, expert_weights, gate_up A, gate_up B, down A, down B, experts, routing,
    forward): ``forward`` an ExpertsForward of these inputs to take, or None to compute it."""

    @staticmethod
    def forward(
        ctx, x, expert_weights, gu_a, gu_b, d_a, d_b, experts: _Experts, routing, done: ExpertsForward | None
    ):
        if done is None:
            gu_lora = _lora(gu_a, gu_b, experts.gate_up_scale)
            d_lora = _lora(d_a, d_b, experts.down_scale)
            done = _experts_forward(x, expert_weights, gu_lora, d_lora, experts, routing)
        routing = done.routing
        ctx.save_for_backward(
            x, expert_weights, gu_a, gu_b, d_a, d_b, done.gate_up, done.xa, done.ha, *routing.tensors()
        )
        ctx.experts, ctx.routing = experts, routing
        return done.out

    @staticmethod
    def backward(ctx, d_out):
        x, expert_weights, gu_a, gu_b, d_a, d_b, gate_up, xa, ha, *routing_tensors = ctx.saved_tensors
        experts, routing = ctx.experts, ctx.routing.with_tensors(routing_tensors)
        need_x, need_w, need_gu_a, need_gu_b, need_d_a, need_d_b = ctx.needs_input_grad[:6]
        gu_lora = _lora(gu_a, gu_b, experts.gate_up_scale)
        d_lora = _lora(d_a, d_b, experts.down_scale)
        act = (experts.activation, experts.interleaved, experts.alpha, experts.limit)
        d_out = d_out.to(x.dtype).contiguous()  # (T, H)
        row_weight = expert_weights.reshape(-1)[routing.order]  # (M,)

        # gY = dOut V_e + s' (dOut B'_e) A'_e, with dOut B'_e (M, r) kept for dA'.
        grad_y, dout_b = grouped_lora_gemm(
            d_out,
            routing,
            experts.down.mT,
            None if d_lora is None else d_lora.transposed(),
            gather=True,
            store_xa=need_d_a,
        )  # (M, I)
        h, d_gate_up, dw_rows = expert_activation_backward(
            gate_up, grad_y, row_weight, routing, *act, grad_out=d_out, down_bias=experts.down_bias
        )
        del grad_y, gate_up
        d_da = d_db = d_ga = d_gb = dx = dw = None
        if need_d_a:
            d_da = expert_sums(
                dout_b, h, routing, u_weight=row_weight, scale=d_lora.scale, out_dtype=d_a.dtype
            )
        if need_d_b:
            d_db = expert_sums(
                d_out,
                ha,
                routing,
                u_gather=True,
                u_weight=row_weight,
                scale=d_lora.scale,
                out_dtype=d_b.dtype,
            )
        del h, dout_b
        if need_x or need_gu_a:
            # dX = dG W_e + s (dG B_e) A_e, with dG B_e (M, r) kept for dA.
            dx_rows, dg_b = grouped_lora_gemm(
                d_gate_up,
                routing,
                experts.gate_up.mT,
                None if gu_lora is None else gu_lora.transposed(),
                gather=False,
                store_xa=need_gu_a,
            )  # (M, H)
            if need_gu_a:
                d_ga = expert_sums(dg_b, x, routing, v_gather=True, scale=gu_lora.scale, out_dtype=gu_a.dtype)
            if need_x:
                dx = combine_rows(dx_rows, routing)  # (T, H)
            del dx_rows, dg_b
        if need_gu_b:
            d_gb = expert_sums(d_gate_up, xa, routing, scale=gu_lora.scale, out_dtype=gu_b.dtype)
        if need_w:
            inverse = routing.inverse.long()
            dw = torch.where(inverse >= 0, dw_rows[inverse.clamp(min=0)], 0.0)
            dw = dw.view(expert_weights.shape).to(expert_weights.dtype)
        return dx, dw, d_ga, d_gb, d_da, d_db, None, None, None


def _check_lora(name: str, lora: ExpertLoRA | None, experts: int, out_f: int, in_f: int, x):
    if lora is None:
        return
    if not isinstance(lora, ExpertLoRA):
        raise TypeError(
            f"moe_lora_experts: {name} must be an ExpertLoRA(A, B, scale), got {type(lora).__name__}"
        )
    check_float_dtype(f"moe_lora_experts: {name}.A", lora.A)
    check_float_dtype(f"moe_lora_experts: {name}.B", lora.B)
    a_shape, b_shape = tuple(lora.A.shape), tuple(lora.B.shape)
    rank = a_shape[1] if len(a_shape) == 3 else -1
    if len(a_shape) != 3 or a_shape != (experts, rank, in_f) or b_shape != (experts, out_f, rank):
        raise ValueError(
            f"moe_lora_experts: {name} has A {a_shape} and B {b_shape}; expected A (E, r, in) = "
            f"({experts}, r, {in_f}) and B (E, out, r) = ({experts}, {out_f}, r)"
        )
    if not 1 <= rank <= MAX_RANK:
        raise ValueError(f"moe_lora_experts: {name} has rank {rank}; supported: 1 to {MAX_RANK}")
    if lora.A.device != x.device or lora.B.device != x.device:
        raise ValueError(f"moe_lora_experts: {name} is not on x's device {x.device}")


def _check_nf4(name: str, record: NF4Experts) -> None:
    """An NF4Experts record's tensors agree with its shape and with each other."""
    experts, rows, cols = record.stored_shape
    blocks = -(-rows * cols // record.blocksize)
    expected = {
        "packed": (record.packed, torch.uint8, (experts, (rows * cols + 1) // 2)),
        "absmax": (record.absmax, torch.uint8, (experts, blocks)),
        "nested_absmax": (
            record.nested_absmax,
            torch.float32,
            (experts, -(-blocks // record.nested_blocksize)),
        ),
        "offset": (record.offset, torch.float32, (experts,)),
        "code": (record.code, torch.float32, (16,)),
        "nested_code": (record.nested_code, torch.float32, (256,)),
    }
    for field, (tensor, dtype, shape) in expected.items():
        if tensor.dtype != dtype or tuple(tensor.shape) != shape or tensor.stride()[-1] != 1:
            raise ValueError(
                f"{name}: NF4Experts.{field} is {tensor.dtype} {tuple(tensor.shape)}; a record of "
                f"{experts} experts of ({rows}, {cols}) needs {dtype} {shape}, last dimension contiguous"
            )
        if tensor.device != record.device:
            raise ValueError(
                f"{name}: NF4Experts.{field} is on {tensor.device}, its codes on {record.device}"
            )
    if record.dtype not in (torch.float32, torch.float16, torch.bfloat16):
        raise TypeError(f"{name}: NF4Experts.dtype is {record.dtype}; supported: float32, float16, bfloat16")


def _check_inputs(x, expert_ids, expert_weights, w_gu, w_d, gu_lora, d_lora, gu_bias, d_bias, activation):
    op = "moe_lora_experts"
    check_float_dtype(f"{op}: x", x)
    check_not_empty(f"{op}: x", x)
    if x.dim() != 2:
        raise ValueError(f"{op}: x must be (tokens, hidden), got shape {tuple(x.shape)}")
    tokens, hidden = x.shape
    if expert_ids.dim() != 2 or expert_ids.shape[0] != tokens:
        raise ValueError(
            f"{op}: expert_ids must be (tokens, top_k) = ({tokens}, k), got {tuple(expert_ids.shape)}"
        )
    if expert_ids.dtype.is_floating_point or expert_ids.dtype.is_complex or expert_ids.dtype == torch.bool:
        raise TypeError(f"{op}: expert_ids must be an integer tensor, got {expert_ids.dtype}")
    if expert_weights.shape != expert_ids.shape:
        raise ValueError(
            f"{op}: expert_weights has shape {tuple(expert_weights.shape)}, expert_ids {tuple(expert_ids.shape)}; they must match"
        )
    check_float_dtype(f"{op}: expert_weights", expert_weights)
    if len(w_gu.shape) != 3 or len(w_d.shape) != 3:
        raise ValueError(f"{op}: gate_up and down must be 3-D (experts, ., .)")
    experts, two_i, gu_in = w_gu.shape
    if gu_in != hidden or two_i % 2 or tuple(w_d.shape) != (experts, hidden, two_i // 2):
        raise ValueError(
            f"{op}: with x of {hidden} features, gate_up must be logically (E, 2I, {hidden}) and down "
            f"(E, {hidden}, I); got {tuple(w_gu.shape)} and {tuple(w_d.shape)} (after weights_in_out)"
        )
    for name, w in (("gate_up", w_gu), ("down", w_d)):
        if isinstance(w, NF4Experts):
            _check_nf4(f"{op}: {name}", w)
        else:
            check_float_dtype(f"{op}: {name}", w)
        if w.dtype != x.dtype and not torch.is_autocast_enabled(x.device.type):
            raise TypeError(
                f"{op}: {name} has dtype {w.dtype} but x has {x.dtype}; they must match "
                f"(or run under torch.autocast)"
            )
    for name, bias, n in (("gate_up_bias", gu_bias, two_i), ("down_bias", d_bias, hidden)):
        if bias is not None and tuple(bias.shape) != (experts, n):
            raise ValueError(f"{op}: {name} must be ({experts}, {n}), got {tuple(bias.shape)}")
    if torch.is_grad_enabled():
        for name, t in (("gate_up", w_gu), ("down", w_d), ("gate_up_bias", gu_bias), ("down_bias", d_bias)):
            if isinstance(t, torch.Tensor) and t.requires_grad:
                raise ValueError(
                    f"{op}: {name} requires grad, but the base weights are frozen here; detach it"
                )
    _check_lora("gate_up_lora", gu_lora, experts, two_i, hidden, x)
    _check_lora("down_lora", d_lora, experts, hidden, two_i // 2, x)
    if activation not in ACTIVATIONS:
        raise ValueError(f"{op}: unknown activation {activation!r}; supported: {', '.join(ACTIVATIONS)}")
    tensors = {
        "x": x,
        "expert_ids": expert_ids,
        "expert_weights": expert_weights,
        "gate_up": w_gu,
        "down": w_d,
    }
    tensors.update(gate_up_bias=gu_bias, down_bias=d_bias)
    devices = {name: t.device for name, t in tensors.items() if t is not None}
    if len(set(devices.values())) > 1:
        raise ValueError(f"{op}: tensors must be on one device, got {devices}")


def moe_lora_experts(
    x: torch.Tensor,
    expert_ids: torch.Tensor,
    expert_weights: torch.Tensor,
    gate_up: torch.Tensor | NF4Experts,
    down: torch.Tensor | NF4Experts,
    *,
    gate_up_lora: ExpertLoRA | None = None,
    down_lora: ExpertLoRA | None = None,
    gate_up_bias: torch.Tensor | None = None,
    down_bias: torch.Tensor | None = None,
    activation: str = "swiglu",
    interleaved: bool = False,
    alpha: float = 1.702,
    limit: float = 7.0,
    weights_in_out: bool = False,
    forward: ExpertsForward | None = None,
) -> torch.Tensor:
    """The experts of an MoE block with per-expert LoRA, differentiable (module docstring).

    Args:
        x: (T, H) tokens, float32, float16 or bfloat16: the compute dtype (under
            torch.autocast, autocast's dtype, to which x and the base weights are cast).
        expert_ids: (T, top_k) integer expert of each assignment; an id outside [0, E)
            (as the id E that Qwen3-MoE and Mixtral skip) contributes nothing.
        expert_weights: (T, top_k) routing weights, any float dtype; gets a gradient.
        gate_up: the fused gate/up weights, (E, 2I, H) (out, in), or (E, H, 2I) with
            ``weights_in_out``; x's dtype; frozen.  Either weight may be an NF4Experts
            record of that shape and dtype (``quantize_nf4_experts``): the GEMMs then
            dequantise a run of experts at a time (grouped_gemm.py).
        down: (E, H, I), or (E, I, H) with ``weights_in_out``; frozen.
        gate_up_lora, down_lora: ``ExpertLoRA(A (E, r, in), B (E, out, r), scale)``, any
            strides, r <= 64; get gradients.
        gate_up_bias, down_bias: frozen (E, 2I) and (E, H) biases (gpt-oss).
        activation: "swiglu" (silu(gate) * up), "gpt_oss" (clamped, with ``alpha`` and
            ``limit``) or "geglu_tanh" (gelu_tanh(gate) * up, Gemma 4): activation.py.
        interleaved: gate and up are the even and odd columns of gate_up's output (gpt-oss)
            rather than its first and second halves.
        weights_in_out: the weights are stored (in, out) as gpt-oss's, y = x W_e.
        forward: what ``moe_lora_experts_forward`` computed from these same inputs,
            weights and adapters: taken as this call's forward (no product runs; its
            ``out`` is returned), the backward as always.  Its shapes are checked, its
            values cannot be.

    Returns:
        (T, H) in x's dtype: sum_j expert_weights[t, j] * expert_{expert_ids[t, j]}(x_t).
    """
    setup = _setup(
        x, expert_ids, expert_weights, gate_up, down, gate_up_lora=gate_up_lora, down_lora=down_lora,
        gate_up_bias=gate_up_bias, down_bias=down_bias, activation=activation, interleaved=interleaved,
        alpha=alpha, limit=limit, weights_in_out=weights_in_out,
    )  # fmt: skip
    if setup is None:
        if forward is not None:
            raise ValueError(
                "moe_lora_experts: forward= was given, but the plain-torch reference runs here "
                "(no Triton on x's device), which moe_lora_experts_forward never records for"
            )
        warn_reference_once("moe_lora_experts", x.device.type)
        return moe_lora_experts_reference(
            x, expert_ids, expert_weights, gate_up, down, gate_up_lora=gate_up_lora, down_lora=down_lora,
            gate_up_bias=gate_up_bias, down_bias=down_bias, activation=activation, interleaved=interleaved,
            alpha=alpha, limit=limit, weights_in_out=weights_in_out,
        )  # fmt: skip
    x, experts = setup
    if forward is not None:
        _check_forward(forward, x, expert_ids, experts, gate_up_lora, down_lora)
        routing = forward.routing
    else:
        routing = route_to_experts(expert_ids, experts.gate_up.shape[0], tile_sizes(x.dtype)["BLOCK_M"])
    gu_a, gu_b = (gate_up_lora.A, gate_up_lora.B) if gate_up_lora is not None else (None, None)
    d_a, d_b = (down_lora.A, down_lora.B) if down_lora is not None else (None, None)
    return _MoELoRAExpertsFunction.apply(x, expert_weights, gu_a, gu_b, d_a, d_b, experts, routing, forward)


def moe_lora_experts_forward(
    x: torch.Tensor,
    expert_ids: torch.Tensor,
    expert_weights: torch.Tensor,
    gate_up: torch.Tensor | NF4Experts,
    down: torch.Tensor | NF4Experts,
    **options,
) -> tuple[torch.Tensor, ExpertsForward | None]:
    """moe_lora_experts' output without autograd, and what its forward computed, for a
    later ``moe_lora_experts(..., forward=)`` on the same inputs to take (module
    docstring).  The arguments are moe_lora_experts' (``options`` its keywords but
    ``forward``).

    Returns:
        (the (T, H) output, its ExpertsForward); the record is None where the plain-torch
        reference runs (no Triton on x's device), whose forward keeps nothing to hand on.
    """
    with torch.no_grad():
        if not use_triton(x):
            return moe_lora_experts(x, expert_ids, expert_weights, gate_up, down, **options), None
        x, experts = _setup(x, expert_ids, expert_weights, gate_up, down, **options)
        routing = route_to_experts(expert_ids, experts.gate_up.shape[0], tile_sizes(x.dtype)["BLOCK_M"])
        lora = options.get("gate_up_lora"), options.get("down_lora")
        done = _experts_forward(x, expert_weights, *lora, experts, routing)
        return done.out, done


def _setup(
    x, expert_ids, expert_weights, gate_up, down, *, gate_up_lora=None, down_lora=None, gate_up_bias=None,
    down_bias=None, activation="swiglu", interleaved=False, alpha=1.702, limit=7.0, weights_in_out=False,
) -> tuple[torch.Tensor, _Experts] | None:  # fmt: skip
    """The inputs checked, and (x in the compute dtype, the _Experts record); None where
    the plain-torch reference must run (no Triton on x's device)."""
    w_gu, w_d = _logical_weights(gate_up, down, weights_in_out)
    _check_inputs(
        x, expert_ids, expert_weights, w_gu, w_d, gate_up_lora, down_lora, gate_up_bias, down_bias, activation
    )
    if not use_triton(x):
        return None
    if torch.is_autocast_enabled(x.device.type):
        # The compute dtype is autocast's, as for F.linear: x and the base weights are cast
        # to it (a copy only where they differ); the adapters are read in their own dtype.
        dtype = torch.get_autocast_dtype(x.device.type)
        # An NF4 record is dequantised to its dtype, then rounded to x's in the kernel.
        x = x.to(dtype)
        w_gu, w_d = (w if isinstance(w, NF4Experts) else w.to(dtype) for w in (w_gu, w_d))
        gate_up_bias = None if gate_up_bias is None else gate_up_bias.to(dtype)
        down_bias = None if down_bias is None else down_bias.to(dtype)
    experts = _Experts(
        w_gu,
        w_d,
        gate_up_bias,
        down_bias,
        gate_up_lora.scale if gate_up_lora is not None else 0.0,
        down_lora.scale if down_lora is not None else 0.0,
        activation,
        interleaved,
        float(alpha),
        float(limit),
    )
    return x, experts


def _check_forward(forward, x, expert_ids, experts: _Experts, gate_up_lora, down_lora) -> None:
    """A handed-on ExpertsForward fits this call: its shapes, dtype, device and adapters."""
    if not isinstance(forward, ExpertsForward):
        raise TypeError(f"moe_lora_experts: forward= must be an ExpertsForward, got {type(forward).__name__}")
    rows, width = expert_ids.numel(), experts.gate_up.shape[1]
    expected = {
        "out": (forward.out, tuple(x.shape)),
        "gate_up": (forward.gate_up, (rows, width)),
        "xa": (forward.xa, None if gate_up_lora is None else (rows, gate_up_lora.rank)),
        "ha": (forward.ha, None if down_lora is None else (rows, down_lora.rank)),
    }
    for name, (tensor, shape) in expected.items():
        found = None if tensor is None else tuple(tensor.shape)
        if found != shape or (tensor is not None and (tensor.dtype != x.dtype or tensor.device != x.device)):
            what = "none" if tensor is None else f"{tensor.dtype} {found} on {tensor.device}"
            raise ValueError(
                f"moe_lora_experts: forward.{name} is {what}; this call needs "
                f"{'none' if shape is None else f'{x.dtype} {shape} on {x.device}'}: it was not "
                f"computed from these inputs and adapters"
            )
    if forward.routing.num_rows != rows or forward.routing.num_experts != experts.gate_up.shape[0]:
        raise ValueError(
            f"moe_lora_experts: forward.routing has {forward.routing.num_rows} rows of "
            f"{forward.routing.num_experts} experts; this call routes {rows} rows to {experts.gate_up.shape[0]}"
        )
