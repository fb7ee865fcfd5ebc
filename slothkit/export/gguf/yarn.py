"""YaRN rope scaling (gpt-oss) as a GGUF file states it and as llama.cpp computes it.

Both Hugging Face (transformers' _compute_yarn_parameters) and ggml (ggml_rope_yarn,
ggml_rope_yarn_corr_dims) turn rotated pair i of d at a blend of its own frequency and that
frequency divided by `factor`:

    theta_i = base^(-2i/d) * (r_i / factor + (1 - r_i)),   r_i = clamp((i - low) / (high - low), 0, 1)
    corr(beta) = d * ln(original / (2 pi beta)) / (2 ln base),  low = corr(beta_fast), high = corr(beta_slow)

so the fast pairs (below low) keep their frequency, the slow ones (above high) are slowed by
`factor`, and cos and sin are multiplied by 0.1 ln(factor) + 1 on both sides.

The file (as llama.cpp's converter, GptOssModel, writes it): rope.scaling.type yarn,
rope.scaling.factor, rope.scaling.original_context_length; slothkit adds
rope.scaling.yarn_beta_fast and yarn_beta_slow, which llama.cpp reads (32 and 1 when absent).

Rounding: ggml always rounds low down and high up to whole pairs. HF does so unless the
config says `truncate: false`, as gpt-oss's does; then the two blend the pairs between low
and high differently. For gpt-oss (head_dim 64, base 150,000, original 4096): low 8.09 against
8, high 17.40 against 18, r_i apart by up to 0.057, so pairs 9-17 turn at 1.003 to 0.57 times
llama.cpp's frequency (pair 17, the largest gap: 0.1 radian apart per 1,000 positions).
llama.cpp has no key for the unrounded range, so such a model is written all the same, with
a notice (DataWarning); docs/gguf-export.md gives what it costs on the tiny test model.

Refused, because llama.cpp would compute another scale: an `attention_factor` other than
0.1 ln(factor) + 1, and DeepSeek's `mscale` / `mscale_all_dim`.
"""

from __future__ import annotations

import dataclasses
import math

from slothkit.core.notices import DataWarning, say_once
from slothkit.models import EXPERT_RECORDS, RECORDS, Architecture


@dataclasses.dataclass(frozen=True)
class Yarn:
    factor: float  # how much the slow pairs are slowed
    original_context: int  # original_max_position_embeddings
    beta_fast: float  # rotations within the original context where the blend starts
    beta_slow: float  # and where it ends


def yarn_scaling(config, rope: dict, arch: Architecture) -> Yarn:
    """The YaRN parameters the file states, refused where llama.cpp would compute otherwise.

    Args:
        config: the model's transformers config.
        rope: its rope parameters (slothkit.export.gguf.attention.rope_parameters).
        arch: its record; its GGUF layout says whether llama.cpp's graph runs YaRN.
    """
    if not arch.gguf.yarn:
        graphs = " and ".join(
            sorted({record.gguf.arch for record in RECORDS + EXPERT_RECORDS if record.gguf.yarn})
        )
        raise NotImplementedError(
            f"'yarn' rope scaling is supported for the {graphs} architecture only; this model is "
            f"{arch.gguf.arch!r}"
        )
    original = int(rope["original_max_position_embeddings"])
    factor = float(rope.get("factor") or config.max_position_embeddings / original)
    for key in ("mscale", "mscale_all_dim"):
        if rope.get(key):
            raise NotImplementedError(
                f"llama.cpp scales YaRN's cos and sin by 0.1 ln(factor) + 1; this model's rope sets "
                f"{key}={rope[key]}, which it cannot run; it accepts rope parameters without mscale"
            )
    default_scale = 0.1 * math.log(factor) + 1.0
    scale = rope.get("attention_factor")
    if scale is not None and abs(float(scale) - default_scale) > 1e-6:
        raise NotImplementedError(
            f"llama.cpp scales YaRN's cos and sin by 0.1 ln(factor) + 1 = {default_scale:.6f}; this "
            f"model's rope sets attention_factor={scale}; it accepts that value or none"
        )
    if rope.get("truncate", True) is False:
        say_once(
            "slothkit: this model's YaRN rope keeps its correction range unrounded (truncate: false); "
            "llama.cpp rounds it to whole dimensions and has no setting for it, so a few rotary "
            "frequencies in the GGUF file differ slightly from the model's (docs/gguf-export.md)",
            DataWarning,
        )
    return Yarn(
        factor=factor,
        original_context=original,
        beta_fast=float(rope.get("beta_fast") or 32.0),
        beta_slow=float(rope.get("beta_slow") or 1.0),
    )
