"""TRL itself: the lowest version slothkit's fused model trains with, and where this
version keeps each class."""

from __future__ import annotations

import importlib
import importlib.util
import warnings

# 1.15 gave SFT, DPO and GRPO the fused LM head (slothkit.trl.defaults says why it matters);
# 1.16 stopped it launching its Triton kernel on CPU tensors.
MIN_TRL_VERSION = "1.16"

# TRL 1.16 keeps ORPO in trl.experimental.orpo; every other trainer here is at top level.
_EXPERIMENTAL = {"ORPOConfig": "orpo", "ORPOTrainer": "orpo"}


def require_trl():
    """Import trl, checking that it is recent enough for slothkit's fused model.

    Returns:
        The ``trl`` module.

    Raises:
        ImportError: TRL is missing or older than MIN_TRL_VERSION; the message says why
            the version matters and how to upgrade.
    """
    if importlib.util.find_spec("trl") is None:
        raise ImportError(
            f"slothkit's trainers need TRL >= {MIN_TRL_VERSION}: pip install 'trl>={MIN_TRL_VERSION}'"
        )
    import trl
    from packaging.version import Version

    if Version(trl.__version__) < Version(MIN_TRL_VERSION):
        raise ImportError(
            f"TRL {trl.__version__} is too old for slothkit (need >= {MIN_TRL_VERSION}): before 1.15 its "
            "SFTTrainer with loss_type='nll' reads outputs.logits, which slothkit's fused training forward "
            "never builds, and DPO and GRPO build the full logits; 1.15 runs its fused head's Triton kernel "
            f"on CPU tensors. pip install -U 'trl>={MIN_TRL_VERSION}'"
        )
    return trl


def trl_class(name: str):
    """TRL's class `name` ("SFTConfig", "ORPOTrainer", ...), wherever this TRL keeps it.

    Args:
        name: the class name.

    Returns:
        The class.
    """
    trl = require_trl()
    if name not in _EXPERIMENTAL:
        return getattr(trl, name)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # TRL's notice that trl.experimental may change
        module = importlib.import_module(f"trl.experimental.{_EXPERIMENTAL[name]}")
    return getattr(module, name)
