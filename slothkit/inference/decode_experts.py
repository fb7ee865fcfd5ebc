"""A mixture-of-experts block in a decode step: each token through its top-k experts only.

A decode step has 1 to 8 tokens, each routed to top_k of E experts (Qwen3-30B-A3B: 8 of
128, 9.4 MB of bf16 weights an expert).  Hugging Face's experts module loops over the
experts hit, reading the hit list back to the host (``nonzero``) and launching a few
kernels per expert; slothkit's fused experts (slothkit_kernels.moe, the training path)
schedule tiles for all E experts and, in a 4-bit model, dequantise every expert's NF4
codes.  Here, for the P = N * top_k (token, choice) pairs of N tokens:

    logits, w, ids = router(x)                 the block's own router: w, ids (N, top_k)
    W_p = W[ids_p]                              the chosen experts' weights, read where
                                                they lie (NF4: only theirs dequantised)
    gu_p = x_t W_gu,p^T + s (x_t A_p^T) B_p^T + b_p     one launch over the pairs
    h_p = act(gu_p)                             the experts' gate (SwiGLU, gpt-oss's
                                                clamped SwiGLU, Gemma 4's GELU-tanh)
    y_p = h_p W_d,p^T + s (h_p A_p^T) B_p^T + b_p
    out_t = sum_j w_tj y_tj                     the products in the model's dtype as
                                                transformers forms them, summed in fp32

On a GPU each base product is one launch of slothkit_kernels.moe.expert_gemv over all
pairs, reading each chosen expert's matrix where it lies; elsewhere (a CPU) the P
matrices are gathered and multiplied as a batch, which writes and rereads a copy.  Each
expert's LoRA update is read from PEFT's ``target_parameters`` adapter
(slothkit.engine.experts.describe_experts: A (E, r, in), B (E, out, r) views of its
parameters; B copied expert-major in the compute dtype, refreshed when training changes
it in place).  Every shape follows from N and top_k and
nothing is read back to the host, so the step is captured in the decode's CUDA graph.

A block with a shared expert beside the routed ones (Qwen3.5-MoE) adds, for every token,
sigmoid(shared_expert_gate(x)) * shared_expert(x), through those modules' own forwards.

A prefill of more than ``GATHER_ROWS`` tokens runs the block's own forward (slothkit's
fused experts where the model has them), which reads each expert at most once rather than
once per pair.  So does a block whose experts the description does not cover (several
active adapters, a bias on B), said once.
"""

from __future__ import annotations

import torch
from torch import nn

from slothkit.core.notices import FallbackWarning, say_once
from slothkit.engine.experts import ExpertsCall, describe_experts, experts_base, is_experts_module
from slothkit_kernels.moe import ExpertLoRA, NF4Experts, dequantize_nf4_experts
from slothkit_kernels.moe.activation import expert_activation_reference
from slothkit_kernels.moe.gemv import expert_gemv, expert_gemv_reference

# Tokens up to which a step gathers its chosen experts (a decode step's batch of 1 to 8);
# past it the block's own forward reads each expert once for all its tokens.
GATHER_ROWS = 8

# The router's attribute on transformers' mixture-of-experts blocks (Qwen3-MoE and
# Mixtral call it gate, gpt-oss router); it returns (logits, weights, ids).
_ROUTER_NAMES = ("gate", "router")


def _router(block: nn.Module) -> nn.Module | None:
    for name in _ROUTER_NAMES:
        router = getattr(block, name, None)
        if isinstance(router, nn.Module) and hasattr(router, "top_k"):
            return router
    return None


def is_expert_block(mlp: nn.Module) -> bool:
    """Whether ``mlp`` is transformers' mixture-of-experts block: a top-k router and an
    experts module of 3-D weights (possibly wrapped by PEFT)."""
    experts = getattr(mlp, "experts", None)
    return (
        isinstance(experts, nn.Module)
        and is_experts_module(experts_base(experts)[0])
        and _router(mlp) is not None
    )


def _base_products(x, weight, ids, group: int, weights_in_out: bool, bias) -> torch.Tensor:
    """(P, out): row p // group of ``x`` through expert ids[p]'s base weight (and bias).
    16-bit experts are read where they lie (slothkit_kernels.moe.expert_gemv on a GPU; a
    gather and a batched matmul elsewhere); NF4 ones are dequantised for the P pairs only,
    then read as such a stack."""
    gemv = expert_gemv if x.is_cuda else expert_gemv_reference
    if not isinstance(weight, NF4Experts):
        return gemv(x, ids, weight, group, bias, weights_in_out)
    stacked = dequantize_nf4_experts(weight.select(ids))  # (P, rows, cols), the parameter's layout
    if weight.transposed:
        stacked = stacked.mT
    pairs = torch.arange(ids.shape[0], device=ids.device)
    y = gemv(x, pairs, stacked, group, None, weights_in_out)
    return y if bias is None else y + bias.index_select(0, ids).to(y.dtype)


class _ExpertAdapter:
    """One expert projection's adapter as a step reads it: A as PEFT holds it (E, r, in),
    expert-major already, and a copy of B in the compute dtype laid out (E, out, r).  PEFT
    holds B as (out, r * E), so expert e's B is every E-th element: gathering it for a
    few experts would read most of the whole (Qwen3-30B-A3B's down B in fp32: 16.8 MB a
    layer, read for 9.4 MB of chosen expert weights).  The copy is refreshed in place
    (its address kept for the graph) when training changed B (its version counter)."""

    def __init__(self, lora: ExpertLoRA, dtype: torch.dtype):
        self.A, self.scale, self.source = lora.A, lora.scale, lora.B
        self.B = lora.B.to(dtype, copy=True).contiguous()
        self.version = lora.B._version

    def refresh(self) -> None:
        if self.source._version != self.version:
            self.B.copy_(self.source)
            self.version = self.source._version


def _pair_products(x, group: int, weight, ids, weights_in_out: bool, lora: _ExpertAdapter | None, bias):
    """Row p // group of ``x`` (rows, in) through pair p's expert, its adapter added: (P, out)."""
    y = _base_products(x, weight, ids, group, weights_in_out, bias)
    if lora is not None:
        rows = x.repeat_interleave(group, dim=0)[:, None]  # (P, 1, in)
        a = lora.A.index_select(0, ids).to(x.dtype)  # (P, r, in)
        b = lora.B.index_select(0, ids)  # (P, out, r), already x's dtype
        y = y[:, None].baddbmm(torch.bmm(rows, a.transpose(1, 2)), b.transpose(1, 2), alpha=lora.scale)[:, 0]
    return y


def expert_adapters(call: ExpertsCall, dtype: torch.dtype) -> tuple:
    """The (gate_up, down) _ExpertAdapter, or None, of an experts call, as chosen_experts
    reads them."""
    return tuple(
        None if lora is None else _ExpertAdapter(lora, dtype) for lora in (call.gate_up_lora, call.down_lora)
    )


def chosen_experts(
    call: ExpertsCall, adapters: tuple, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor
):
    """The experts' output for tokens ``x`` (N, H) routed to ``ids`` (N, k) with routing
    ``weights`` (N, k): (N, H), reading the chosen experts' weights only; ``adapters``:
    the (gate_up, down) _ExpertAdapter or None of each."""
    tokens, top_k = ids.shape
    flat = ids.reshape(-1)  # (P,), pair p = token p // k, choice p % k
    gate_up_lora, down_lora = adapters
    gate_up = _pair_products(
        x, top_k, call.gate_up, flat, call.weights_in_out, gate_up_lora, call.gate_up_bias
    )
    hidden = expert_activation_reference(
        gate_up, call.gate.activation, call.interleaved, call.alpha, call.limit
    )
    y = _pair_products(hidden, 1, call.down, flat, call.weights_in_out, down_lora, call.down_bias)
    weighted = y.view(tokens, top_k, -1) * weights[..., None].to(y.dtype)  # (N, k, H)
    return weighted.float().sum(dim=1).to(x.dtype)


class DecodeExperts:
    """A mixture-of-experts block as a decode step runs it (module docstring).

    Args:
        block: transformers' mixture-of-experts block (``is_expert_block``).
        dtype: the dtype the step computes in.
    """

    def __init__(self, block: nn.Module, dtype: torch.dtype):
        self.block = block
        self.router = _router(block)
        self.dtype = dtype
        with torch.no_grad():  # the experts' base weights are frozen; adapters read as views
            self.call = describe_experts(block.experts)
        # Qwen3.5-MoE: a shared expert every token runs, scaled by a one-column sigmoid gate.
        self.shared_expert = getattr(block, "shared_expert", None)
        self.shared_expert_gate = getattr(block, "shared_expert_gate", None)
        self.adapters = (None, None)
        if isinstance(self.call, ExpertsCall):
            self.adapters = expert_adapters(self.call, dtype)
        else:
            say_once(
                f"slothkit: a decode step runs this mixture-of-experts block's own forward, which "
                f"reads every expert hit: {self.call}",
                FallbackWarning,
            )

    def refresh(self) -> None:
        """Bring the adapters' B copies up to date with adapters trained in place."""
        for adapter in self.adapters:
            if adapter is not None:
                adapter.refresh()

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        tokens = x.shape[:-1].numel()
        if isinstance(self.call, str) or tokens > GATHER_ROWS:
            out = self.block(x)
            return out[0] if isinstance(out, tuple) else out  # gpt-oss's block adds its scores
        rows = x.reshape(tokens, x.shape[-1])
        _, weights, ids = self.router(rows)
        out = chosen_experts(self.call, self.adapters, rows, weights, ids)
        if self.shared_expert is not None:
            out = out + torch.sigmoid(self.shared_expert_gate(rows)) * self.shared_expert(rows)
        return out.view(x.shape)
