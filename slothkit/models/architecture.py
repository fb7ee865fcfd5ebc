"""What slothkit knows about a decoder architecture, as one record per family.

Each family file (llama.py, mistral.py, gemma.py, gemma3.py, gemma2.py, qwen2.py, qwen3.py, phi3.py,
ministral.py) fills in one Architecture; the
rest of slothkit reads what differs between families from it and from nowhere else:

    field             read by
    model_types       architecture_for (fused records only): FastModel's loading and patching,
                      the bench, the planner; record_for (every record): GGUF export
    fused             which lookup finds the record: False for a family that FastModel would
                      train through plain Hugging Face + PEFT and slothkit only exports
    causal_lm_class   the tiny fixtures' config.json (slothkit.testing)
    hidden_act        the tiny fixtures' config
    activation_keys   activation(): a loaded config's activation, mapped to the fused MLP's;
                      the tiny fixtures' config
    norm_adds_one     the RMSNorm patch (slothkit.engine.decoder), GGUF's norm offset, the
                      neutral norm weight of the fixtures and of the bench's random models
    tied_embeddings   the tiny fixtures, the planner's weight bytes
    sliding_window    the tiny fixtures, GGUF metadata, the GGUF verifier's prompt length
    gguf              GGUF export (slothkit.export.gguf: layout, writer, verify, attention,
                      longrope, experts: the graph's name, tensor layout, rope tensors,
                      query scale, a mixture-of-experts layer's tensors)
    tiny              slothkit.testing.tiny_models (chat_format: the template of the tiny
                      tokenizer, slothkit.testing.tiny_chat_templates)
    shapes            slothkit.models.SHAPES (planner, bench), the notebooks' tiny model
    families          messages
    embedding_scale   the fast decode step (slothkit.inference), where transformers' embedding
                      module does not scale by sqrt(hidden) itself
    qk_norm           the fused attention (slothkit.engine.decoder) and the fast decode step:
                      norm each head's q and k before RoPE
    fused_projections the planner's adapter bytes (slothkit.memory.memory_model.lora_bytes): q/k/v
                      and gate/up are one layer each (Phi-3), so one A serves each group
    sandwich_norms    the fused decoder layer (slothkit.engine.decoder_layer): a norm after
                      attention and after the MLP too (Gemma 3, Gemma 2); such layers keep no residual
                      sum for their re-run (keeps_attention_sum: the checkpointer, the planner),
                      (the fast decode step reads the extra norms off the layer)
    text_tower_of     loading (slothkit.loading.text_tower): a multimodal checkpoint of these
                      model_types loads as this family's text model
    language_model_types  FastVisionModel's fused language path (slothkit.loading.vision_fused,
                      through language_model_architecture): an image-text model's language
                      model of these model_types runs this family's fused layers
    demo_model        `slothkit demo` (slothkit.notebook.execute): the real model it trains
    unsloth_block_compile  the bench's Unsloth runs (slothkit.bench.train_worker)

tests/slothkit/models checks every record against transformers' own classes.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from slothkit.models.shape import Shape


@dataclass(frozen=True)
class GGUFExperts:
    """A mixture-of-experts MLP in llama.cpp's layout (slothkit.export.gguf.experts).

    transformers 5 holds a layer's experts as one module (`experts`) with 3-D parameters
    gate_up_proj (experts, 2 x width, hidden), the gate's rows then the up's, and down_proj
    (experts, hidden, width), or their transposes (gpt-oss), with biases gate_up_proj_bias
    and down_proj_bias where the family has them; the router's weight (experts, hidden), and
    its bias if any, sit in `router`. The file holds them as blk.N.ffn_gate_exps,
    ffn_up_exps, ffn_down_exps (each expert's matrix stacked, (experts, out, in) in torch's
    order, and their biases) and blk.N.ffn_gate_inp.
    """

    count_key: str  # config field: how many experts a layer has (expert_count)
    used_count_key: str  # config field: how many run per token (expert_used_count)
    width_key: str  # config field: an expert's intermediate size (expert_feed_forward_length)
    # config field that must be true: llama.cpp's graph renormalises the chosen experts'
    # softmax weights to sum to 1; None: the family's graph does what HF does.
    renormalised_key: str | None = None
    router: str = "mlp.gate"
    experts: str = "mlp.experts"
    # The parameters are stored (experts, in, out), as x @ W multiplies them (gpt-oss);
    # False: (experts, out, in), as nn.Linear stores a weight.
    transposed: bool = False
    # gate_up_proj's gate and up alternate along its output dimension, the gate first
    # (gpt-oss: gate at even columns, up at odd); False: the gate's half, then the up's.
    interleaved: bool = False
    # config field: the width of a shared expert that every token runs beside the chosen
    # ones, its output gated by a sigmoid (mlp.shared_expert, mlp.shared_expert_gate: Qwen3.5's
    # MoE sizes; expert_shared_feed_forward_length); None: no shared expert.
    shared_width_key: str | None = None
    # Config fields whose value llama.cpp's graph fixes and reads from no key, with that
    # value (gpt-oss's clamped SwiGLU: swiglu_alpha 1.702, swiglu_limit 7.0); a model with
    # another is refused.
    graph_constants: tuple[tuple[str, float], ...] = ()


@dataclass(frozen=True)
class GGUFLayout:
    """How the family's weights go into a GGUF file (slothkit.export.gguf.layout)."""

    arch: str  # llama.cpp's architecture: general.architecture, and the graph llama.cpp runs
    # HF rotates the two halves of each head, llama.cpp's "llama" graph adjacent pairs; the
    # Q and K rows are reordered so that both compute the same attention.
    permute_qk: bool
    # llama.cpp's graph has no output matrix: the head is always the token embeddings.
    output_always_tied: bool
    # Each layer's RMSNorm weights, by the HF module that holds them, and their GGUF name
    # (blk.N.<name>.weight). Llama's post_attention_layernorm normalises the FFN input
    # (ffn_norm); Gemma 3's normalises the attention output and pre_feedforward_layernorm
    # the FFN input, as in llama.cpp's tensor map for gemma2/gemma3.
    norms: tuple[tuple[str, str], ...] = (
        ("input_layernorm", "attn_norm"),
        ("post_attention_layernorm", "ffn_norm"),
    )
    # llama.cpp's graph applies the sliding window, to the layers that the file's
    # attention.sliding_window_pattern marks, with rope.freq_base_swa as their rope base
    # (Gemma 3). False: no window, or one llama.cpp ignores (Mistral under the llama graph).
    windowed_layers: bool = False
    # The family's config may set a sliding window on every layer although its class
    # default sets none (Phi-3-mini-4k and -medium-4k: 2047): the file states it as
    # attention.sliding_window, as for a record with sliding_window.
    optional_window: bool = False
    # With windowed_layers: llama.cpp's graph fixes which layers slide, every Nth one global
    # and the others sliding, the first included (Gemma 2: 2), whatever the file says; None:
    # the file's pattern says (Gemma 3).
    fixed_sliding_pattern: int | None = None
    # llama.cpp's graph soft-caps the attention scores and the output logits, by the file's
    # attn_logit_softcapping and final_logit_softcapping (Gemma 2); False: it caps neither.
    logit_softcapping: bool = False
    # llama.cpp's graph reads 'llama3' rope scaling from a rope_freqs tensor (its "llama"
    # graph); False: a model with that scaling is refused.
    rope_freqs: bool = False
    # llama.cpp's graph reads 'longrope' scaling from rope_factors_long / _short tensors (its
    # "phi3" graph); False: a model with that scaling is refused.
    rope_factors: bool = False
    # llama.cpp's graph runs 'yarn' rope scaling from rope.scaling.type and its keys
    # (slothkit.export.gguf.yarn); False: a model with that scaling is refused.
    yarn: bool = False
    # llama.cpp takes a model of this many layers for the family's 27B, whose queries it
    # scales by 1/sqrt(hidden / heads) instead of 1/sqrt(head_dim) (Gemma 3: 62, Gemma 2: 46).
    query_scale_hidden_layers: int | None = None
    # A mixture-of-experts MLP in every layer, and where its parts are; None: a dense MLP.
    experts: GGUFExperts | None = None
    # Gated DeltaNet (linear attention) layers between the attention layers, every
    # full_attention_interval-th layer attending (Qwen3.5): their tensors and the ssm.* keys
    # (slothkit.export.gguf.deltanet). False: attention in every layer.
    deltanet: bool = False
    # Gemma 4's layers in llama.cpp's gemma4 graph: per-layer input embeddings, keys and values
    # shared by the last layers, per-layer head sizes and feed-forward widths, proportional
    # rope on the full layers (slothkit.export.gguf.gemma4).
    gemma4: bool = False
    # llama.cpp's graph rotates by M-RoPE (qwen2vl): rope.dimension_sections gives how many
    # rotated pairs follow each position axis (time, height, width), in contiguous runs, from
    # the config's mrope_section. A text prompt gives all three axes the same position.
    mrope_sections: bool = False
    # The llama-cpp-python release whose llama.cpp first ran this graph in slothkit's tests
    # (the verifier refuses an older one with this version named); None: every release
    # slothkit supports runs it.
    llama_cpp_python: str | None = None


@dataclass(frozen=True)
class TinyTraits:
    """What the tiny random checkpoint of slothkit.testing keeps of the family's real ones."""

    rope_theta: float
    rms_norm_eps: float
    head_dim: int | None  # None: hidden_size // num_heads
    sliding_window: int | None  # default window; None where the family has none
    tokenizer: str  # default flavour: "bpe" (Llama 3's byte-level BPE), "qwen" (Qwen's) or "sentencepiece"
    # The slothkit.data chat format of the family's instruct models; the tiny checkpoint's own
    # template is written in it (slothkit.testing.tiny_chat_templates).
    chat_format: str
    chat_specials: tuple[str, ...]  # special tokens the chat template needs
    end_of_turn: str | None  # token closing an assistant turn; None: the tokenizer's eos
    # Further config fields of the tiny checkpoint (Gemma 3: its layer pattern). A
    # `layer_types` list is a pattern, repeated over the layers the fixture builds.
    config: Mapping[str, object] = field(default_factory=dict, compare=False)


@dataclass(frozen=True)
class Architecture:
    name: str
    # transformers' `config.model_type` values this record covers.
    model_types: tuple[str, ...]
    # transformers' causal LM class, as config.json's "architectures" names it.
    causal_lm_class: str
    # The gated MLP's activation, as transformers' config spells it.
    hidden_act: str
    # The config keys that name the activation, in the order transformers' MLP looks at them
    # (Gemma in transformers 4.x: hidden_activation before hidden_act).
    activation_keys: tuple[str, ...]
    # RMSNorm scales by (1 + weight) instead of weight (Gemma).
    norm_adds_one: bool
    # The LM head shares the embedding matrix by default (config.tie_word_embeddings).
    tied_embeddings: bool
    # Attention may be limited to a sliding window (config.sliding_window).
    sliding_window: bool
    gguf: GGUFLayout
    tiny: TinyTraits
    # slothkit's fused decoder (slothkit.engine) patches this family. False: FastModel
    # trains it on the generic path (its Hugging Face modules) and architecture_for does
    # not find it; export still reads the record (record_for).
    fused: bool
    # Real checkpoints' sizes by name ("llama-3-8b"), and "tiny-<name>" for CPU runs.
    shapes: Mapping[str, Shape] = field(compare=False)
    # Checkpoints covered, for messages and docs.
    families: tuple[str, ...] = ()
    # The token embeddings are multiplied by sqrt(hidden size) before the first layer
    # (Gemma); transformers does it in the model's forward or in its embedding module.
    embedding_scale: bool = False
    # An RMSNorm over each head's queries and keys (attention modules' q_norm and k_norm)
    # before the rotation (Qwen3); the norms scale by w, or 1 + w as the family's others.
    qk_norm: bool = False
    # Four norms per layer (Gemma 3): the attention's and the MLP's outputs are normalised
    # before their residual sums (post_attention_layernorm, post_feedforward_layernorm), and
    # pre_feedforward_layernorm normalises the MLP's input:
    #     h = x + post_attention_layernorm(attn(input_layernorm(x)))
    #     y = h + post_feedforward_layernorm(mlp(pre_feedforward_layernorm(h)))
    sandwich_norms: bool = False
    # Multimodal model_types whose checkpoints hold this family's text model as their
    # language model (Gemma 3's 4B, 12B and 27B: "gemma3"); FastModel loads that text tower
    # alone (slothkit.loading.text_tower).
    text_tower_of: tuple[str, ...] = ()
    # model_types of an image-text model's language model (its text_config) that are this
    # family's decoder under another name (Qwen2.5-VL's "qwen2_5_vl_text": Qwen2's layers,
    # rotated by M-RoPE tables); FastVisionModel runs them on the fused path
    # (slothkit.loading.vision_fused). A family's own model_types need no entry here.
    language_model_types: tuple[str, ...] = ()
    # q, k, v are one layer (qkv_proj) and gate, up another (gate_up_proj), adapted as they
    # are (Phi-3): one LoRA A per group. The fused path reads them as row slices
    # (slothkit.engine.lora_projection.describe_rows) by the modules it finds.
    fused_projections: bool = False
    # The real pretrained model of this family that `slothkit demo` trains, a name in
    # slothkit.testing.real_models (Llama: SmolLM2-135M-Instruct); None: the demo trains a
    # tiny random one.
    demo_model: str | None = None
    # `slothkit bench --impl unsloth` lets Unsloth compile each decoder block; False where
    # that compile crashes in inductor (Gemma: shared/GPU.md).
    unsloth_block_compile: bool = True

    @property
    def keeps_attention_sum(self) -> bool:
        """Whether a checkpointed fused layer keeps h = x + o_proj(attn) for its re-run, which
        then skips o_proj (slothkit.engine.decoder_layer). A sandwich layer's h adds the
        post-attention norm of o_proj's output, whose backward needs that output: nothing to
        skip, so nothing is kept."""
        return not self.sandwich_norms

    def activation(self, config) -> str:
        """The gated MLP's activation name for slothkit_kernels.lora.lora_mlp."""
        act = next((getattr(config, k) for k in self.activation_keys if getattr(config, k, None)), None)
        if act in ("silu", "swish"):
            return "swiglu"
        if act in ("gelu_pytorch_tanh", "gelu_new", "gelu_fast"):
            return "geglu_tanh"
        if act == "gelu":
            return "geglu"
        raise ValueError(
            f"{self.name}: MLP activation {act!r} is not supported by the fused MLP "
            f"(supported: silu, gelu, gelu_pytorch_tanh)"
        )


def generic_path_reason(config) -> str | None:
    """Why a config of a fused family still trains on the generic path, or None.

    Some checkpoints of a family set what the fused layers do not compute: RoPE over part
    of each head (Phi-4-mini's partial_rotary_factor 0.75; the RoPE kernel rotates whole
    heads) and dropout on the residual terms (Phi-3's resid_pdrop; the fused layer adds
    them as they are). Any object without these fields (a Shape) has neither.
    """
    rope = getattr(config, "rope_parameters", None)
    factor = getattr(config, "partial_rotary_factor", None)
    if isinstance(rope, Mapping) and "partial_rotary_factor" in rope:
        factor = rope["partial_rotary_factor"]
    if factor not in (None, 1, 1.0):
        return f"partial_rotary_factor={factor} rotates part of each head, the fused RoPE whole heads"
    dropout = getattr(config, "resid_pdrop", None)
    if dropout:
        return f"resid_pdrop={dropout}: the fused decoder layer has no dropout on its residual terms"
    return None
