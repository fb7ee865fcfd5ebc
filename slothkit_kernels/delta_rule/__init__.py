"""The gated delta rule (Gated DeltaNet's linear attention, as in Qwen3.5), chunked.

* ``ops``: ``gated_delta_rule``, the differentiable op, with transformers' arguments;
* ``reference``: ``gated_delta_rule_reference``, the per-token recurrence in fp32;
* ``chunk``: loading a chunk and its decays, shared by the kernels;
* ``ut_inverse``: each chunk's (I + A)^-1, by forward substitution;
* ``forward`` and ``backward``: the walks over the chunks, the backward's derivation
  in its docstring.
"""

from slothkit_kernels.delta_rule.ops import gated_delta_rule
from slothkit_kernels.delta_rule.reference import gated_delta_rule_reference

__all__ = ["gated_delta_rule", "gated_delta_rule_reference"]
