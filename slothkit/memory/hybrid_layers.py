"""The memory terms of a hybrid model's decoder layers (Qwen3.5): gated DeltaNet (linear
attention) layers and gated full-attention layers, each with the model's gated MLP, as
slothkit trains them: transformers' layers (the fused layers leave a partially rotated
head alone: slothkit.engine.generic_layers) with their norms and MLPs in slothkit's
kernels (slothkit.engine.generic_modules), PEFT's adapters, and the delta rule through
slothkit_kernels.delta_rule (slothkit.engine.gated_deltanet).

Qwen3.5-MoE (qwen3_5_moe_text) has the same layers with a mixture of experts for every
MLP.  Here its MLP is the shared expert, a gated MLP of width Ws as the dense model's (I =
Ws below), whose output sigmoid(shared_expert_gate(x)) scales, and the MLP's normed input,
which the router and the routed experts read too; the routed experts and the router are
counted as in any mixture-of-experts model (slothkit.memory.memory_model).

Sizes, per layer: H hidden, I the MLP's width, r the LoRA rank; a full-attention layer has
Hq query heads and Hkv key/value heads of D; a DeltaNet layer HK key heads of dk, HV value
heads of dv, Q = HK dk, V = HV dv, a causal convolution K wide over its N = 2 Q + V
channels, and runs the delta rule in chunks of C = 64 positions.  e is bytes per element
of the model's dtype; what is fp32 whatever that dtype counts 4.

What a layer keeps for backward, per token (``kept_bytes``; tests/slothkit/memory/
test_memory_model.py counts it to the byte through autograd's saved-tensor hooks on a
tiny Qwen3.5 and a tiny Qwen3.5-MoE, in fp32 and bf16, with the kernels under Triton's
interpreter). The layer norms, the q/k norms and the MLP are slothkit's kernels
(slothkit.engine.generic_modules fuses them one by one), the rest transformers' modules
with PEFT's adapters:

  both kinds    the two RMSNorms: each its input and 1/rms, 2 (H e + 4); the fused MLP:
                its input, the gate and up outputs and its three adapters' x A^T,
                (H + 2 I + 3 r) e; each of the mixer's adapters x A^T in fp32 (PEFT keeps
                the adapters in fp32), 4 r per adapter: three in a DeltaNet layer
                (in_proj_qkv, in_proj_z, out_proj), four in a full one; each of those
                adapters' input as its A reads it (``_adapter_inputs``): in an fp32 model
                each input once (the mixer's normed input H, its output), in a 16-bit one an
                fp32 copy for every adapter that reads it.  A shared expert's gate adds
                its sigmoid and the product's other factor, the shared expert's output,
                (H + 1) e.
  DeltaNet      in_proj_qkv's output and the convolution's (its padding makes K - 1 more
                positions per sequence), 2 N e; the SiLU's output (N e) in an fp32 model,
                where a 16-bit one keeps the l2 norms' fp32 copies of q and k (8 Q)
                instead; the l2 norms' 1/norm (8 HK) and the fp32 q and k the kernel reads
                (8 Q); v made contiguous (V e); the decay g and a + dt_bias in fp32 and
                beta (8 HV + HV e); the kernel's per-chunk inverse
                (I + strict_tril(beta K K^T))^-1 and the state entering each chunk, in
                fp32 over whole chunks, 4 HV C and 4 HV dk dv / C; the gated RMSNorm on the
                output (transformers' own: it takes the gate too): its fp32 input, z and
                silu(z) (12 V), 1/rms per head (4 HV), the normed output before the gate
                (V e).
  full          q_norm's input, a view of q_proj's output of queries and gate (2 Hq D e),
                and k_norm's, of k_proj's (Hkv D e); q and k after their norms and RoPE
                and v (Hq D + 2 Hkv D), the attention's output and its (tokens, Hq D)
                copy, the gate's sigmoid (3 Hq D), all in e; the attention's
                log-sum-exp and the q/k norms' 1/rms, 4 (2 Hq + Hkv).  The output's copy
                is the CPU's: CUDA's flash attention writes its output (tokens, heads, D)
                already, and there the copy is a view (the prediction is Hq D e high).

Per layer, whatever the tokens: in a 16-bit model the fused MLP's 16-bit copies of its
three adapters' A and B, 3 r (H + I) e; a DeltaNet layer's -exp(A_log) (4 HV).

The recurrent state a DeltaNet layer carries from chunk to chunk is the per-chunk state
above, in training; each sequence starts from zero and no final state is asked for.
"""

from __future__ import annotations

import math

from slothkit.models.shape import LinearAttentionShape, Shape

# Positions per chunk of the delta rule (slothkit_kernels.delta_rule.ops.CHUNK; a test
# holds the two equal: the planner does not import the kernel library, which imports torch).
DELTA_RULE_CHUNK = 64
FP32 = 4


def _linear(shape: Shape) -> LinearAttentionShape:
    return shape.linear_attention()


def _dense_mlp_width(shape: Shape) -> int:
    """The width of the layer's gated MLP of linear layers: the model's MLP, or in a
    mixture-of-experts model the shared expert (0 where it has none)."""
    experts = shape.experts()
    return shape.intermediate_size if experts is None else experts.shared_width


def _has_shared_expert_gate(shape: Shape) -> bool:
    """Whether the layer scales its shared expert's output by sigmoid(shared_expert_gate(x))."""
    experts = shape.experts()
    return experts is not None and experts.shared_width > 0


def projection_parameters(shape: Shape, layer_type: str) -> int:
    """The parameters of one layer's linear projections (NF4 in QLoRA), the MLP's included:
    in a mixture-of-experts model the shared expert's and its gate's (a linear layer
    H -> 1, which bitsandbytes quantises as it does the others); the routed experts are
    slothkit.memory.memory_model's, as in any mixture-of-experts model."""
    h, i = shape.hidden_size, _dense_mlp_width(shape)
    mlp = 3 * h * i + (h if _has_shared_expert_gate(shape) else 0)
    return shape.attention_parameters(layer_type) + mlp


def other_parameters(shape: Shape, layer_type: str) -> int:
    """One layer's parameters beside its projections, kept in the model's dtype: the two
    layer norms; a DeltaNet layer's convolution, A_log, dt_bias and gated norm; a
    full-attention layer's q and k norms."""
    norms = 2 * shape.hidden_size
    if layer_type == "linear_attention":
        la = _linear(shape)
        return norms + la.conv_channels * la.conv_kernel + 2 * la.value_heads + la.value_dim
    return norms + 2 * shape.head_dim()


def adapter_columns(shape: Shape, layer_type: str) -> int:
    """r times this is one layer's LoRA parameters: A's input width plus B's output width
    for every adapted projection (q/k/v/o asked for adapt in_proj_qkv, in_proj_z and
    out_proj in a DeltaNet layer: slothkit.loading.lora_setup.onto_linear_attention).  In
    a mixture-of-experts model the MLP's are the shared expert's gate/up/down (its gate,
    H -> 1, and the router are not adapted); the routed experts' are
    slothkit.memory.memory_model's."""
    h, i = shape.hidden_size, _dense_mlp_width(shape)
    mlp = 2 * h + i + (2 * i + h) if i else 0
    if layer_type == "linear_attention":
        la = _linear(shape)
        value_width = la.value_heads * la.value_dim
        return 2 * h + value_width + (la.conv_channels + value_width + h) + mlp
    d = shape.head_dim()
    q, kv = shape.num_attention_heads * d, shape.num_key_value_heads * d
    return 3 * h + q + (shape.query_width() + 2 * kv + h) + mlp


def _adapter_inputs(inputs: list[tuple[int, int]], element_bytes: int) -> int:
    """Per token, what the adapters keep of their inputs, given (input width, adapters
    reading it) for each input.  PEFT casts each adapter's input to the adapter's fp32:
    the input itself in an fp32 model, a copy per adapter in a 16-bit one."""
    if element_bytes >= FP32:
        return sum(width * element_bytes for width, _ in inputs)
    return sum(FP32 * width * readers for width, readers in inputs)


def _chunks(tokens: int, sequences: int) -> int:
    """The delta rule's chunks in a step: each sequence's positions in whole chunks."""
    return sequences * math.ceil(tokens / sequences / DELTA_RULE_CHUNK)


def kept_bytes(
    shape: Shape, layer_type: str, tokens: int, rank: int, element_bytes: int, sequences: int
) -> float:
    """What one layer of ``layer_type`` that is not checkpointed keeps for backward (module
    docstring), in a step of ``tokens`` tokens in ``sequences`` sequences; of a
    mixture-of-experts layer, all but the routed experts and their router
    (slothkit.memory.memory_model.routed_experts_kept_bytes)."""
    e, h, i = element_bytes, shape.hidden_size, _dense_mlp_width(shape)
    # The two norms' inputs and 1/rms; the MLP's normed input; the fused MLP's gate, up
    # and x A^T (in a mixture-of-experts model the shared expert's).
    common = 2 * (h * e + FP32) + h * e + ((2 * i + 3 * rank) * e if i else 0)
    if _has_shared_expert_gate(shape):
        # sigmoid(gate(x)) * shared_expert(x): the product keeps both factors, the sigmoid its output.
        common += (h + 1) * e
    # The fused MLP's 16-bit copies of its adapters (an fp32 model's are the parameters).
    adapter_copies = 3 * rank * (h + i) * e if e < FP32 and i else 0
    if layer_type == "linear_attention":
        la = _linear(shape)
        n, q = la.conv_channels, la.key_heads * la.key_dim
        v, hv = la.value_heads * la.value_dim, la.value_heads
        per_token = common + 3 * FP32 * rank + _adapter_inputs([(h, 2), (v, 1)], e)
        # in_proj_qkv's output and the convolution's; the SiLU's is what the l2 norms read
        # in an fp32 model, where a 16-bit one keeps their fp32 copies of q and k instead.
        per_token += 2 * n * e + (n * e if e >= FP32 else 2 * FP32 * q)
        per_token += FP32 * (2 * la.key_heads + 2 * q)  # the l2 norms' 1/norm, the kernel's q and k
        per_token += v * e + 2 * FP32 * hv + hv * e  # v, g, a + dt_bias, beta
        per_token += 3 * FP32 * v + FP32 * hv + v * e  # the gated RMSNorm
        chunks = _chunks(tokens, sequences)
        recurrent = chunks * hv * FP32 * (DELTA_RULE_CHUNK**2 + la.key_dim * la.value_dim)
        convolution = sequences * (la.conv_kernel - 1) * n * e
        per_layer = FP32 * hv + adapter_copies
        return float(tokens * per_token + recurrent + convolution + per_layer)
    d = shape.head_dim()
    heads, kv_heads = shape.num_attention_heads, shape.num_key_value_heads
    per_token = common + 4 * FP32 * rank + _adapter_inputs([(h, 3), (heads * d, 1)], e)
    # q_norm reads a view of q_proj's output (queries and gate), k_norm of k_proj's.
    per_token += e * (shape.query_width() + kv_heads * d)
    per_token += e * (heads * d + 2 * kv_heads * d + 3 * heads * d)
    per_token += FP32 * (2 * heads + kv_heads)
    return float(tokens * per_token + adapter_copies)


def deltanet_working_elements(shape: Shape, element_bytes: int) -> float:
    """Per token, in elements of element_bytes, what a DeltaNet layer's re-run holds beside
    the hidden-state-sized tensors a full-attention layer's does (where that one holds
    its q, k, v and their gradients): the convolution's three N-wide tensors, and the
    delta rule's per-chunk inverse and states (fp32, over whole chunks)."""
    la = _linear(shape)
    chunk_buffers = FP32 * la.value_heads * (DELTA_RULE_CHUNK + la.key_dim * la.value_dim / DELTA_RULE_CHUNK)
    return 3 * la.conv_channels + chunk_buffers / element_bytes
