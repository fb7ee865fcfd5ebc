"""get_peft_model's rank: a positive integer, named where it is not."""

import pytest
import torch

from slothkit import FastModel
from slothkit.testing import tiny_model_path


@pytest.mark.parametrize("rank", [True, False, 16.0, "16", 0, -8])
def test_a_rank_that_is_not_a_positive_integer_is_refused_before_peft(rank):
    """r=True is an int to Python (rank 1 to PEFT, which then failed deep in torch.empty);
    16.0 and "16" are not ranks either."""
    model, _ = FastModel.from_pretrained(str(tiny_model_path("llama")), dtype=torch.float32)
    with pytest.raises(ValueError, match=rf"r={rank!r}; expected a positive integer rank"):
        FastModel.get_peft_model(model, r=rank, use_gradient_checkpointing=False)
    assert not hasattr(model, "peft_config")
