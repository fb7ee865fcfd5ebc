"""The families that per-family tests run over, read from the records (slothkit.models), so
that a family's record brings its own coverage: a test parametrised over these runs the new
family with the others, with nothing to list by hand.

    @pytest.mark.parametrize("arch", FUSED_FAMILIES)   # the records the fused decoder patches

(A test of every record, export-only ones too, parametrises over slothkit.models.RECORDS.)
"""

from __future__ import annotations

from slothkit.models import ARCHITECTURES

FUSED_FAMILIES: tuple[str, ...] = tuple(arch.name for arch in ARCHITECTURES)
