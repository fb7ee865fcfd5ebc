"""GPU memory of a LoRA training step, predicted from the model's shape: the arithmetic
that `slothkit plan` (slothkit.memory.plan) and use_gradient_checkpointing="auto"
(slothkit.engine.checkpointing.recompute_policy) share.

In bytes, with e bytes per 16-bit element (2; 4 for an fp32 model):

  weights      16-bit: e per parameter.  NF4: 0.5 per projection parameter plus its
               scales (1/64 of a byte for the uint8 block scale, 4/16384 for the
               nested fp32 scale); embeddings, head and norms stay 16-bit.
  LoRA         r * (in + out) per adapted projection, trained in fp32: weight 4,
               gradient 4, AdamW moments 8 = 16 per adapter parameter.
  activations  with every layer checkpointed (offloaded), the GPU holds one decoder
               layer's saved tensors at a time, its gradients and two layer inputs in
               flight; per token about e * (6 H + 4 I + 2 (Hq + 2 Hkv) D), plus the
               fused loss's d_hidden (e H) and one chunk of logits.  In steps of more
               than 16,384 tokens with every layer offloaded the MLP runs in
               8,192-token chunks, so its 4 I counts for 8,192 tokens only.  Plain
               checkpointing adds one layer input (e H) per layer; each layer that is not
               checkpointed adds what it saves for backward (``kept_layer_bytes``).
  hybrid       a hybrid model's layers (Qwen3.5's gated DeltaNet and gated full-attention
               layers) count by their kind in all three terms: slothkit.memory.hybrid_layers;
               Qwen3.5-MoE's routed experts and router count as any mixture-of-experts
               model's, its shared expert as the hybrid layer's MLP.
  allocated    the sum of the three: the peak ``torch.cuda.max_memory_allocated``
               reports.
  host         with every layer offloaded, each checkpointed layer's input (and kept
               sum, and a mixture-of-experts layer's kept experts' forward:
               ``experts_forward_bytes``, two of them in flight on the GPU) in pinned
               host memory: e H (1 or 2) per token per layer, held in
               power-of-two pieces (``host_checkpoint_bytes``: torch's pinned
               allocator rounds each request up to a power of two, which would cost up
               to 2x); a layer the host budget cannot take keeps them
               on the GPU instead (checkpointed on the GPU), adding as much there.
  reserved     what the caching allocator holds at the peak, and what an
               out-of-memory error is about: the allocated peak plus 4 % and 0.5 GiB of
               allocator slack (rounding, fragmentation), plus, per checkpointed layer,
               0.5 (keep sums: the kept sums' prefetched copies) and 3 (CUDA graphs: the
               graphs' private pool) hidden-state-sized tensors (tokens x H x e).

Where the engine changes what it does with the step's size (graphs and kept sums up to
16,384 tokens, the MLP's chunks beyond, the pinned pieces) is the engine's own rule,
slothkit.memory.sizes, which this model reads.  The fitted constants (the working set, the
slack, the keep-sums and graph terms) come from `slothkit bench train` records on an H200
(results/bench/); the report's test (tests/slothkit/bench/test_report.py) holds every
committed record to them and docs/planner.md compares predictions with measured peaks.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

from slothkit.memory import hybrid_layers
from slothkit.memory.sizes import SHORT_STEP_TOKENS, mlp_token_chunk, pinned_bytes
from slothkit.models import architecture_for
from slothkit.models.generic_shapes import PER_HEAD_QK_NORM_TYPES
from slothkit.models.shape import Shape

if TYPE_CHECKING:  # torch is imported where GPU memory is asked about, not by the planner
    import torch

GIB = 2**30
# Reserved above allocated: the caching allocator's rounding and fragmentation.
ALLOCATOR_SLACK_GIB = 0.5
ALLOCATOR_SLACK_FRACTION = 0.04
# Per checkpointed layer, in hidden-state-sized tensors (tokens x H x e): the kept
# residual sums' copies in flight (keep_sums), and the CUDA graphs' private pool.  Fitted
# to the 2026-12-01 records (Llama-3-8B, Mistral-7B, Gemma-7B at 2 x 2048, every layer
# offloaded); scaling with the checkpointed layers is the model's assumption.
KEEP_SUMS_RESERVE = 0.5
GRAPH_POOL_RESERVE = 3.0
# The default budget leaves this share of the free memory unused.
BUDGET_MARGIN = 0.05


def weights_bytes(shape: Shape, mode: str, element_bytes: int = 2) -> float:
    """The frozen weights: the projections in element_bytes (mode "lora") or NF4 ("qlora"),
    the embeddings, head and norms in element_bytes.  A mixture-of-experts layer's experts
    count as projections (slothkit quantises them to NF4 with the rest), its router stays
    in element_bytes.

    Args:
        shape: the model's shape.
        mode: "lora" or "qlora".
        element_bytes: bytes per 16-bit weight (4 for an fp32 model).
    """
    d = shape.head_dim()
    h, i = shape.hidden_size, shape.intermediate_size
    per_projection = float(element_bytes) if mode == "lora" else 0.5 + 1 / 64 + 4 / 16384
    if shape.linear_attention() is not None:  # a hybrid model: each layer by its kind
        return _hybrid_weights_bytes(shape, per_projection, element_bytes)
    experts = shape.experts()
    sparse = experts.layers if experts else 0
    attention = h * shape.num_attention_heads * d * 2 + h * shape.num_key_value_heads * d * 2
    projections = shape.num_hidden_layers * attention + (shape.num_hidden_layers - sparse) * 3 * h * i
    routers = 0
    if experts:
        projections += sparse * experts.count * 3 * h * experts.width
        routers = sparse * experts.count * h
    norms = (2 * shape.num_hidden_layers + 1) * h
    per_layer_table, per_layer_projections = shape.per_layer_input_parameters()
    projections += per_layer_projections
    embeddings = _embeddings_and_head(shape) + per_layer_table
    return projections * per_projection + element_bytes * (embeddings + norms + routers)


def _embeddings_and_head(shape: Shape) -> int:
    # A shape may say itself (Qwen's small sizes tie, its large ones do not).
    tied = shape.extra.get("tie_word_embeddings")
    if tied is None:
        arch = architecture_for(shape)
        # A family without a record: its transformers config's default (Gemma 4 ties), or
        # untied where this transformers does not know the model_type.
        tied = arch.tied_embeddings if arch is not None else _config_ties(shape)
    return (1 if tied else 2) * shape.vocab_size * shape.hidden_size


def _config_ties(shape: Shape) -> bool:
    try:
        return bool(shape.config().tie_word_embeddings)
    except ValueError:  # a model_type this transformers does not know
        return False


def _hybrid_weights_bytes(shape: Shape, per_projection: float, element_bytes: int) -> float:
    """A hybrid model's weights: its linear projections at per_projection bytes, the rest
    (convolutions, norms, the DeltaNet layers' decay parameters) in element_bytes; in a
    mixture-of-experts model (Qwen3.5-MoE, every layer sparse) each layer's routed experts
    as projections and its router in element_bytes, as in any other."""
    types = shape.layer_types()
    projections = sum(hybrid_layers.projection_parameters(shape, kind) for kind in types)
    others = sum(hybrid_layers.other_parameters(shape, kind) for kind in types) + shape.hidden_size
    experts = shape.experts()
    if experts:
        projections += experts.layers * experts.count * 3 * shape.hidden_size * experts.width
        others += experts.layers * experts.count * shape.hidden_size
    return projections * per_projection + element_bytes * (_embeddings_and_head(shape) + others)


def lora_bytes(shape: Shape, rank: int) -> float:
    """LoRA adapters on all seven projections, trained in fp32, with their gradients and
    AdamW's two moments. Each adapter is r * (in + out): A reads the input, B writes the
    output; where q/k/v and gate/up are one layer each (Phi-3: the record's
    fused_projections), one A reads the input for the group.  In a mixture-of-experts
    layer every expert has its own adapters on its gate/up (one 3-D parameter: A reads
    the input, B writes 2 W) and its down projection.

    Args:
        shape: the model's shape.
        rank: the LoRA rank.
    """
    h, experts = shape.hidden_size, shape.experts()
    # Every expert's gate/up (A reads H, B writes 2 W) and down (A reads W, B writes H).
    expert_columns = experts.count * (h + 2 * experts.width + experts.width + h) if experts else 0
    if shape.linear_attention() is not None:  # a hybrid model: each layer by its kind
        columns = sum(hybrid_layers.adapter_columns(shape, kind) for kind in shape.layer_types())
        return 16.0 * rank * (columns + (experts.layers * expert_columns if experts else 0))
    d = shape.head_dim()
    i = shape.intermediate_size
    q, kv = shape.num_attention_heads * d, shape.num_key_value_heads * d
    arch = architecture_for(shape)
    fused = arch is not None and arch.fused_projections
    attention = (1 if fused else 3) * h + q + (q + 2 * kv + h)  # A columns (o reads q), B rows
    mlp = (1 if fused else 2) * h + i + (2 * i + h)
    sparse = experts.layers if experts else 0
    per_rank = shape.num_hidden_layers * attention + (shape.num_hidden_layers - sparse) * mlp
    return 16.0 * rank * (per_rank + sparse * expert_columns)


def kept_layer_bytes(
    shape: Shape,
    tokens: int,
    rank: int = 16,
    element_bytes: int = 2,
    layer_type: str = "full_attention",
    sequences: int = 1,
) -> float:
    """What one decoder layer that is not checkpointed keeps for backward.  A hybrid
    model's layers (Qwen3.5's gated DeltaNet and gated full-attention layers) keep what
    slothkit.memory.hybrid_layers says, by ``layer_type``; the rest of this docstring is
    about the other models.

    Per token, in element_bytes each: the layer input and the attention's normed input
    (2 H), q, k and v after RoPE and the attention output ((2 Hq + 2 Hkv) D), the sum
    after attention and the MLP's normed input (2 H), the gate and up projections (2 I),
    x A^T of the seven adapters (7 r); in fp32, the attention's log-sum-exp per head and
    the two norms' 1/rms.  That is what slothkit's fused layer saves
    (tests/slothkit/memory/test_memory_model.py counts it through autograd's saved-tensor hooks).

    The architecture's record adds what its further norms keep.  slothkit_kernels'
    RMSNorm saves its input (element_bytes each) and 1/rms per row (fp32); its weight is
    a parameter, held anyway.  So, per token:

        qk_norm         (a record's, or a record-less family of PER_HEAD_QK_NORM_TYPES)
                        q and k before their norms, (Hq + Hkv) D elements, and one 1/rms
                        per head, 4 (Hq + Hkv) bytes; the normed q and k, rotated in
                        place, are the attention's q and k counted above.
        sandwich_norms  post_attention_layernorm's input, o_proj's output, and
                        post_feedforward_layernorm's, the MLP's output: 2 H elements and
                        two 1/rms, 8 bytes; pre_feedforward_layernorm keeps what Llama's
                        post_attention_layernorm keeps (the sum after attention).

    Args:
        shape: the model's shape.
        tokens: tokens per step (batch x sequence).
        rank: the LoRA rank.
        element_bytes: bytes per activation element (2 for bf16/fp16, 4 for fp32).
        layer_type: the layer's kind, as the config's layer_types names it
            ("full_attention" or, in a hybrid model, "linear_attention").
        sequences: how many sequences the tokens are (a DeltaNet layer's convolution and
            chunks are per sequence); one where not known, a few KiB short per further one.
    """
    experts = shape.experts()
    if shape.linear_attention() is not None:
        if layer_type not in ("full_attention", "linear_attention"):
            raise ValueError(f"layer_type={layer_type!r}; accepted: 'full_attention' or 'linear_attention'")
        # The layer's norms, mixer and dense MLP (a mixture-of-experts layer's shared
        # expert and its gate), and the routed experts as in any mixture-of-experts model.
        kept = hybrid_layers.kept_bytes(shape, layer_type, tokens, rank, element_bytes, sequences)
        return kept + (tokens * routed_experts_kept_bytes(shape, rank, element_bytes) if experts else 0.0)
    d = shape.head_dim()
    h, i = shape.hidden_size, shape.intermediate_size
    heads, kv_heads = shape.num_attention_heads, shape.num_key_value_heads
    per_token = element_bytes * (4 * h + 2 * i + 2 * (heads + kv_heads) * d + 7 * rank)
    per_token += 4 * (heads + 2)
    if experts:
        # The routed experts and their router in place of the MLP; the attention's four
        # adapters keep their x A^T.  Layers of both kinds: the larger.
        sparse = element_bytes * (4 * h + 2 * (heads + kv_heads) * d + 4 * rank) + 4 * (heads + 2)
        sparse += routed_experts_kept_bytes(shape, rank, element_bytes)
        per_token = sparse if experts.layers == shape.num_hidden_layers else max(per_token, sparse)
    arch = architecture_for(shape)
    if arch.qk_norm if arch is not None else shape.model_type in PER_HEAD_QK_NORM_TYPES:
        per_token += (element_bytes * d + 4) * (heads + kv_heads)
    if arch is not None and arch.sandwich_norms:
        per_token += 2 * (element_bytes * h + 4)
    return float(tokens * per_token)


def activation_bytes(
    shape: Shape,
    tokens: int,
    checkpointing: str | bool = "offload",
    kept_layers: int = 0,
    rank: int = 16,
    element_bytes: int = 2,
) -> float:
    """Activation memory at the peak of a training step.

    Args:
        shape: the model's shape.
        tokens: tokens per step (batch x sequence).
        checkpointing: how the layers that are not kept are checkpointed: "offload"
            (their inputs in host memory) or True (their inputs on the GPU).
        kept_layers: decoder layers that are not checkpointed.
        rank: the LoRA rank.
        element_bytes: bytes per activation element (2 for bf16/fp16, 4 for fp32).
    """
    if checkpointing is not True and checkpointing != "offload":
        raise ValueError(f"checkpointing={checkpointing!r}; accepted: 'offload' or True")
    d = shape.head_dim()
    h, i = shape.hidden_size, shape.intermediate_size
    per_token = 6 * h + 2 * (shape.num_attention_heads + 2 * shape.num_key_value_heads) * d
    linear = shape.linear_attention()
    if linear is not None:  # the larger of the two kinds' working sets
        per_token = max(per_token, 6 * h + hybrid_layers.deltanet_working_elements(shape, element_bytes))
    per_token += h  # the fused loss's d_hidden
    # The MLP's (tokens, intermediate) tensors: over one chunk of tokens in the long
    # steps of offloaded layers (whose re-runs are chunked); whole where a kept layer's
    # backward (or torch's checkpoint) runs the MLP unchunked.
    chunked = checkpointing == "offload" and kept_layers == 0
    mlp_tokens = (mlp_token_chunk(tokens) or tokens) if chunked else tokens
    logits_chunk = shape.vocab_size * max(1, min(tokens, max(tokens // 16, 4 * 2**20 // shape.vocab_size)))
    mlp = mlp_tokens * 4 * i * element_bytes
    experts = shape.experts()
    if experts:  # the experts' working set, unchunked; a model with dense layers too has both
        sparse = experts_working_bytes(shape, tokens, element_bytes)
        mlp = sparse if experts.layers == shape.num_hidden_layers else max(mlp, sparse)
    total = element_bytes * (tokens * per_token + logits_chunk) + mlp
    if checkpointing is True:
        total += (shape.num_hidden_layers - kept_layers) * tokens * element_bytes * h
    if linear is None:
        return total + kept_layers * kept_layer_bytes(shape, tokens, rank, element_bytes)
    # "auto" keeps the last layers (slothkit.engine.checkpointing.recompute_policy), each its kind.
    kept_types = shape.layer_types()[shape.num_hidden_layers - kept_layers :] if kept_layers else []
    return total + sum(kept_layer_bytes(shape, tokens, rank, element_bytes, kind) for kind in kept_types)


# Per routed (token, expert) row, what slothkit_kernels.moe.route_to_experts keeps: the
# sort order (int64), the row's token, its inverse and its expert (int32 each).
ROUTING_BYTES = 20


def routed_experts_kept_bytes(shape: Shape, rank: int, element_bytes: int = 2) -> float:
    """Per token, what a mixture-of-experts layer's routed experts and router keep for
    backward (beyond the MLP's normed input, which they read): the fused experts keep G
    (2 W), the two adapters' x A^T (2 r) and the row's weight (1), in element_bytes, and
    the routing (ROUTING_BYTES), per routed row; transformers' router its fp32
    probabilities (4 E) and the top-k indices (int64, 8 k), and where it renormalises the
    chosen weights (ExpertsShape.renormalised) the division's fp32 weights and their sum
    (4 k + 4).

    Left out, as it grows with the experts, not the tokens: the routing's tile schedule
    (4 (E + 1) + 8 (M / BLOCK_M + E) bytes for M routed rows, BLOCK_M the grouped GEMM's
    tile rows: slothkit_kernels.moe), a few hundred bytes to a few KiB per layer."""
    experts = shape.experts()
    k = experts.top_k
    routed_rows = k * (element_bytes * (2 * experts.width + 2 * rank + 1) + ROUTING_BYTES)
    router = 4 * experts.count + 8 * k + (4 * k + 4 if experts.renormalised else 0)
    return float(routed_rows + router)


def experts_working_bytes(shape: Shape, tokens: int, element_bytes: int = 2) -> float:
    """The most a mixture-of-experts layer's fused experts (slothkit_kernels.moe) hold at
    once in a training step, beyond the layer's input and output.

    Each token is routed to k experts: M = tokens x k rows of width W.  The backward holds
    the forward's gate/up output G (2 W per row), the gradient of the down projection's
    input and the recomputed activation (W each) and G's gradient (2 W): 6 W elements per
    row; the routing adds ROUTING_BYTES per row, the router its fp32 logits and
    probabilities (8 E per token).  The adapters' (M, r) products are under 1 % of that at r = 16.
    A shared expert of width Ws (Qwen3.5-MoE) adds its fused MLP's gate and up outputs
    (2 Ws per token): it runs first in forward, so autograd runs its backward after the
    routed experts', and they are held throughout theirs.
    """
    experts = shape.experts()
    rows = tokens * experts.top_k
    shared = tokens * 2 * experts.shared_width * element_bytes
    return float(
        rows * (6 * experts.width * element_bytes + ROUTING_BYTES) + tokens * 8 * experts.count + shared
    )


def experts_forward_bytes(shape: Shape, tokens: int, rank: int = 16, element_bytes: int = 2) -> float:
    """What a mixture-of-experts layer's checkpointed forward keeps of its fused experts for
    the re-run (slothkit.engine.experts; slothkit_kernels.moe.ExpertsForward): the output
    (H per token), and per routed row the gate/up products (2 W), the two adapters'
    x A^T (2 r) and the routing (ROUTING_BYTES)."""
    experts = shape.experts()
    rows = tokens * experts.top_k
    return float(
        element_bytes * (tokens * shape.hidden_size + rows * (2 * experts.width + 2 * rank))
        + rows * ROUTING_BYTES
    )


# The most bytes of NF4 experts the grouped GEMMs hold dequantised at once
# (slothkit_kernels.moe.grouped_gemm.NF4_STAGE_BYTES; a test holds the two equal: the
# planner does not import the kernel library, which imports torch).
NF4_EXPERTS_STAGE_BYTES = 2**30


def nf4_experts_stage_bytes(shape: Shape, element_bytes: int = 2) -> float:
    """The buffer NF4 experts are dequantised into, a run at a time: as many whole
    experts' gate/up weights (the larger of the two) as fit NF4_EXPERTS_STAGE_BYTES, at
    least one, at most all of them."""
    experts = shape.experts()
    per_expert = 2 * experts.width * shape.hidden_size * element_bytes
    return float(min(experts.count, max(1, NF4_EXPERTS_STAGE_BYTES // per_expert)) * per_expert)


class MemoryBudgetError(ValueError):
    """Training does not fit the memory budget even with every layer offloaded (or, where
    host memory is short, with every layer checkpointed: the host's share offloaded,
    the rest on the GPU)."""

    def __init__(
        self, minimum_bytes: float, budget_bytes: float, tokens: int, on_gpu: int = 0, quantized: bool = False
    ):
        self.minimum_bytes, self.budget_bytes, self.tokens = minimum_bytes, budget_bytes, tokens
        where = (
            f"every layer checkpointed, {on_gpu} of them on the GPU for want of host memory"
            if on_gpu
            else "every layer's activations offloaded"
        )
        host_hint = ", or free host memory (max_host_memory=)" if on_gpu else ""
        super().__init__(
            f"training at {tokens:,} tokens per step needs at least {minimum_bytes / GIB:.2f} GiB "
            f"(the predicted peak with {where}), more than the budget of {budget_bytes / GIB:.2f} GiB; "
            f"raise max_memory{host_hint}, or lower the batch size or max_seq_length"
            + ("" if quantized else ", or load the model with load_in_4bit=True")
        )


@dataclass(frozen=True)
class RecomputeChoice:
    """What use_gradient_checkpointing="auto" does at one step size: the last ``kept``
    decoder layers keep their activations; of the others, the first ``offloaded`` send
    their inputs to host memory and the next ``on_gpu`` (those the host budget cannot
    take) keep their inputs on the GPU."""

    kept: int
    layers: int
    budget_bytes: float
    peak_bytes: float  # predicted peak reserved
    tokens: int
    on_gpu: int = 0
    host_budget_bytes: float | None = None
    host_bytes: float = 0.0  # predicted pinned host memory of the offloaded layers
    # The checkpointed layers keep nothing for their re-runs (no residual sums, no experts'
    # forward): with them the step does not fit the budget even with every layer offloaded.
    stops_keeping: bool = False

    @property
    def offloaded(self) -> int:
        return self.layers - self.kept - self.on_gpu

    def notice(self) -> str:
        """The one line that says what was chosen."""
        line = (
            f"slothkit: use_gradient_checkpointing='auto' keeps {self.kept} of {self.layers} layers' "
            f"activations at {self.tokens:,} tokens per step (budget {self.budget_bytes / GIB:.1f} GiB, "
            f"predicted peak {self.peak_bytes / GIB:.1f} GiB), offloads {self.offloaded}"
        )
        if self.on_gpu:
            line += (
                f" ({self.host_bytes / GIB:.1f} GiB of host memory, budget "
                f"{self.host_budget_bytes / GIB:.1f} GiB) and checkpoints {self.on_gpu} on the GPU"
            )
        if self.stops_keeping:
            line += (
                "; the re-runs recompute their residual sums and experts' products instead of "
                "keeping them (kept, they would not fit the budget)"
            )
        return line


@dataclass(frozen=True)
class TrainingMemory:
    """The memory one model's LoRA training step needs, as a function of the tokens per
    step and of how many decoder layers keep their activations (are not checkpointed).

    Args:
        shape: the model's shape.
        mode: "lora" (16-bit weights) or "qlora" (NF4 projections).
        trainable_bytes: the trained parameters with their gradients and optimizer moments.
        rank: the LoRA rank (the adapters' saved x A^T per token).
        element_bytes: bytes per 16-bit weight and activation element (4 for fp32 models).
        cuda_graphs: whether checkpointed layers replay from CUDA graphs.
        keep_sums: whether checkpointed layers keep their residual sums for the re-run.
        graph_max_tokens: steps of more tokens run without graphs and kept sums
            (LayerGraphs.max_tokens, OffloadedCheckpointer.keep_max_tokens).
    """

    shape: Shape
    mode: str
    trainable_bytes: float
    rank: int = 16
    element_bytes: int = 2
    cuda_graphs: bool = False
    keep_sums: bool = False
    graph_max_tokens: int = SHORT_STEP_TOKENS

    @property
    def layers(self) -> int:
        return self.shape.num_hidden_layers

    def checkpoint_bytes(self, tokens: int) -> float:
        """What one checkpointed layer saves: its input, and its kept residual sum where
        sums are kept at this step size; in pinned host memory when offloaded, on the GPU
        otherwise.

        Args:
            tokens: tokens per step (batch x sequence).
        """
        hidden_state = tokens * self.shape.hidden_size * self.element_bytes
        return float(self._copies(tokens) * hidden_state + self.experts_kept_bytes(tokens))

    def host_checkpoint_bytes(self, tokens: int) -> float:
        """``checkpoint_bytes`` as pinned host memory holds it (``pinned_bytes``).

        Args:
            tokens: tokens per step (batch x sequence).
        """
        hidden_state = pinned_bytes(tokens * self.shape.hidden_size * self.element_bytes)
        experts = self.experts_kept_bytes(tokens)
        # Each kept tensor is pinned on its own; the largest, the gate/up products, rounds
        # up as one piece (the others are under a tenth of it).
        return float(self._copies(tokens) * hidden_state + (pinned_bytes(int(experts)) if experts else 0.0))

    def _copies(self, tokens: int) -> int:
        return 1 + int(self._keeps(tokens))

    def _keeps(self, tokens: int) -> bool:
        """Whether checkpointed layers keep tensors for their re-runs at this step size
        (OffloadedCheckpointer.keeps_for)."""
        return self.keep_sums and tokens <= self.graph_max_tokens

    def experts_kept_bytes(self, tokens: int) -> float:
        """What one checkpointed layer keeps of its fused experts' forward for the re-run,
        averaged over the decoder layers (``experts_forward_bytes``); 0 where nothing is
        kept at this step size or the model has no experts.

        Args:
            tokens: tokens per step (batch x sequence).
        """
        if not self._keeps(tokens) or not self.shape.experts():
            return 0.0
        share = self.shape.experts().layers / self.layers
        return share * experts_forward_bytes(self.shape, tokens, self.rank, self.element_bytes)

    def allocated(self, tokens: int, kept_layers: int = 0, on_gpu_layers: int = 0) -> float:
        """Predicted peak allocated bytes: weights, trained parameters and activations.

        Args:
            tokens: tokens per step (batch x sequence).
            kept_layers: decoder layers that are not checkpointed.
            on_gpu_layers: checkpointed layers whose inputs stay on the GPU.
        """
        staged = 0.0
        if self.mode == "qlora" and self.shape.experts():
            staged = nf4_experts_stage_bytes(self.shape, self.element_bytes)
        if kept_layers < self.layers and self.experts_kept_bytes(tokens):
            # The experts' kept forward in flight on the GPU: the one being copied to the
            # host in forward, the one prefetched a layer ahead in backward.
            staged += 2 * experts_forward_bytes(self.shape, tokens, self.rank, self.element_bytes)
        return (
            weights_bytes(self.shape, self.mode, self.element_bytes)
            + self.trainable_bytes
            + activation_bytes(self.shape, tokens, "offload", kept_layers, self.rank, self.element_bytes)
            + staged
            + on_gpu_layers * self.checkpoint_bytes(tokens)
        )

    def reserved(self, tokens: int, kept_layers: int = 0, on_gpu_layers: int = 0) -> float:
        """Predicted peak reserved bytes: the allocated peak and the allocator's slack,
        and per checkpointed layer the kept sums' and the graphs' hidden-state-sized
        tensors (module docstring).

        Args:
            tokens: tokens per step (batch x sequence).
            kept_layers: decoder layers that are not checkpointed.
            on_gpu_layers: checkpointed layers whose inputs stay on the GPU.
        """
        reserved = self.allocated(tokens, kept_layers, on_gpu_layers) * (1 + ALLOCATOR_SLACK_FRACTION)
        reserved += ALLOCATOR_SLACK_GIB * GIB
        per_layer = 0.0
        if tokens <= self.graph_max_tokens:
            per_layer = KEEP_SUMS_RESERVE * self.keep_sums + GRAPH_POOL_RESERVE * self.cuda_graphs
        hidden_state = tokens * self.shape.hidden_size * self.element_bytes
        return reserved + per_layer * (self.layers - kept_layers) * hidden_state

    def host_layers(self, tokens: int, host_budget_bytes: float | None = None) -> int:
        """How many checkpointed layers' inputs ``host_budget_bytes`` of pinned host
        memory take (every layer where there is no host budget).

        Args:
            tokens: tokens per step (batch x sequence).
            host_budget_bytes: the host memory offloaded layers may pin, or None.
        """
        if host_budget_bytes is None:
            return self.layers
        return min(self.layers, int(max(host_budget_bytes, 0.0) // self.host_checkpoint_bytes(tokens)))

    def least_reserved(self, tokens: int, host_budget_bytes: float | None = None) -> float:
        """The predicted reserved peak with no layer kept: the host's share of the layers
        offloaded, the rest checkpointed on the GPU.  The least a step of ``tokens``
        needs.

        Args:
            tokens: tokens per step (batch x sequence).
            host_budget_bytes: the host memory offloaded layers may pin, or None.
        """
        return self.reserved(tokens, 0, self.layers - self.host_layers(tokens, host_budget_bytes))

    def recompute_choice(
        self,
        tokens: int,
        budget_bytes: float,
        host_budget_bytes: float | None = None,
        may_stop_keeping: bool = False,
    ) -> RecomputeChoice:
        """The most layers whose activations can be kept with the predicted reserved peak
        at or under ``budget_bytes``; the others are offloaded, as many as
        ``host_budget_bytes`` of pinned host memory take, and the rest checkpointed on the
        GPU.

        Args:
            tokens: tokens per step (batch x sequence).
            budget_bytes: the memory the step may reserve on the GPU.
            host_budget_bytes: the host memory the offloaded layers may pin; None: no limit.
            may_stop_keeping: where the checkpointed layers keep tensors for their re-runs
                (``keep_sums``) and not even every layer offloaded fits, choose as if they
                kept none (the choice's ``stops_keeping``) before giving up.  What they keep
                only saves work (about a third of a mixture-of-experts layer's re-run); a
                step that fits without it beats one that does not run.

        Raises:
            MemoryBudgetError: even with every layer checkpointed the peak exceeds the budget.
        """
        host_layers = self.host_layers(tokens, host_budget_bytes)

        def on_gpu(kept: int) -> int:
            return max(0, self.layers - kept - host_layers)

        peaks = [self.reserved(tokens, kept, on_gpu(kept)) for kept in range(self.layers + 1)]
        if peaks[0] > budget_bytes and may_stop_keeping and self._keeps(tokens):
            lean = replace(self, keep_sums=False).recompute_choice(tokens, budget_bytes, host_budget_bytes)
            return replace(lean, stops_keeping=True)
        if peaks[0] > budget_bytes:
            raise MemoryBudgetError(peaks[0], budget_bytes, tokens, on_gpu(0), quantized=self.mode == "qlora")
        kept = max(k for k, peak in enumerate(peaks) if peak <= budget_bytes)
        offloaded = self.layers - kept - on_gpu(kept)
        return RecomputeChoice(
            kept,
            self.layers,
            budget_bytes,
            peaks[kept],
            tokens,
            on_gpu=on_gpu(kept),
            host_budget_bytes=host_budget_bytes,
            host_bytes=offloaded * self.host_checkpoint_bytes(tokens),
        )


def budget_from_free(free_bytes: float) -> float:
    """The default budget: the memory this process can have, less ``BUDGET_MARGIN`` of it
    for what the prediction misses.

    Args:
        free_bytes: the memory this process can have.
    """
    return free_bytes * (1 - BUDGET_MARGIN)


def free_bytes(device: torch.device) -> float | None:
    """The memory this process can have on ``device``: the free memory plus what its
    caching allocator already holds (the model's weights among it), no more than the
    per-process memory fraction allows; None where there is no GPU memory to budget.

    Args:
        device: the model's device.
    """
    if device.type != "cuda":
        return None
    import torch

    free, total = torch.cuda.mem_get_info(device)
    available = free + torch.cuda.memory_reserved(device)
    fraction = getattr(torch.cuda, "get_per_process_memory_fraction", None)  # torch 2.13 and up
    if fraction is not None:
        available = min(available, fraction(device) * total)
    return float(available)


# The default host budget leaves this share of the available memory unused.
HOST_MARGIN = 0.10


def gib_or_bytes(name: str, value) -> float:
    """A memory size given as GiB (a number under 2**20) or bytes, checked; in bytes.

    Raises:
        ValueError: value is not a positive number.
    """
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
        raise ValueError(
            f"{name}={value!r}; expected a positive number: GiB (such as 40 or 22.5), "
            f"or bytes (2**20 and up, such as 40 * 2**30)"
        )
    return float(value) if value >= 2**20 else float(value) * GIB


def host_budget_bytes(max_host_memory=None) -> float | None:
    """The host memory offloaded layer inputs may pin: ``max_host_memory`` (GiB, or bytes
    from 2**20 up), else the host's available memory less ``HOST_MARGIN``, shared among
    the processes of this host that train together (LOCAL_WORLD_SIZE, set by torchrun
    and accelerate); None where the platform does not say (no limit).

    Args:
        max_host_memory: the budget asked for, or None.

    Raises:
        ValueError: max_host_memory is not a positive number.
    """
    if max_host_memory is not None:
        return gib_or_bytes("max_host_memory", max_host_memory)
    try:
        import psutil
    except ImportError:
        return None
    try:
        processes = max(1, int(os.environ.get("LOCAL_WORLD_SIZE", "1")))
    except ValueError:
        processes = 1
    return float(psutil.virtual_memory().available) * (1 - HOST_MARGIN) / processes
