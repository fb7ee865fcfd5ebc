"""RoPE, rotary position embedding of queries and keys: the public ops and their references.

* ``ops``: ``rope`` (in place, with its backward) and ``rotate``, and ``rope_reference``;
* ``cache``: ``rope_into_cache``, a decode step's rotation and key/value cache write in
  one launch;
* ``kernel``: the Triton kernel both launch, and its rounding;
* ``checks``: what the ops accept, checked before anything is written.
"""

from slothkit_kernels.rope.cache import rope_into_cache, rope_into_cache_reference
from slothkit_kernels.rope.ops import rope, rope_reference, rotate

__all__ = ["rope", "rope_into_cache", "rope_into_cache_reference", "rope_reference", "rotate"]
