"""Shapes of families slothkit has no record for, by name: `slothkit bench` measures the
generic path (the model's own modules with slothkit's offloaded checkpointing and fused
head) on them, and `slothkit plan` predicts from them with its caveat for that path.

OLMo 2 stands for the record-less families: its layers normalise the attention's and the
MLP's outputs and each full q/k projection, which no fused record covers, and its module
names are Llama's, so HF + PEFT adapts the same seven projections.
"""

from slothkit.models.shape import Shape

_OLMO2 = {"rope_theta": 500_000.0, "rms_norm_eps": 1e-6}

GENERIC_SHAPES: dict[str, Shape] = {
    "olmo-2-7b": Shape("olmo2", 4096, 11008, 32, 32, 32, 100352, 4096, _OLMO2),
    "tiny-olmo2": Shape("olmo2", 64, 192, 2, 4, 4, 512, 2048, _OLMO2),
}
