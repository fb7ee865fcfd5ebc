"""The fused linear cross-entropy on the head of a model slothkit has no record for.

A family without a record (Phi-3, OLMo, Granite, SmolLM3, ...) keeps its Hugging Face
modules, but its training loss need not: the head's (tokens x vocabulary) logits, their
float32 copy and their gradient are the largest tensors of a step at a long sequence or a
large vocabulary, and the fused linear cross-entropy (slothkit.engine.decoder's
``patch_causal_lm``) never builds them. It computes

    loss = CE(softcap(hidden @ head.weight^T), labels)

from the decoder's last hidden state, which is what most causal LMs do. Some do more to
their logits (Granite divides them by ``logits_scaling``, Cohere multiplies them by
``logit_scale``, MiniCPM scales them by its width), and no list of such fields can be
complete; so the model's own forward decides: before the head is patched, both compute
the loss of one short random batch in eval mode, and the head is patched only where the
two agree. Where they do not, or the head is not a plain bias-free Linear over
``causal_lm.model``'s output, the model keeps its own loss, and the caller says why once.
"""

from __future__ import annotations

import torch
from torch import nn

from slothkit.engine.decoder import IGNORE_INDEX, next_token_labels, patch_causal_lm
from slothkit_kernels.fused_linear_cross_entropy import fused_linear_cross_entropy

CHECK_TOKENS = 16  # the random batch the two losses are compared on: 1 x CHECK_TOKENS


def _relative_tolerance(dtype: torch.dtype) -> float:
    # Both losses average float32 log-probabilities; they differ by the head's output
    # rounding, one unit in the last place of the compute dtype at most.
    return 1e-4 if dtype == torch.float32 else 2e-2


def why_head_stays(causal_lm: nn.Module) -> str | None:
    """Why the fused loss would not be the model's own (None: it is, checked numerically)."""
    head = causal_lm.get_output_embeddings()
    if type(head) is not nn.Linear or head.bias is not None:
        return "its head is not a bias-free Linear layer"
    decoder = getattr(causal_lm, "model", None)
    if not isinstance(decoder, nn.Module):
        return "its decoder is not at `.model`"
    device = head.weight.device
    generator = torch.Generator(device="cpu").manual_seed(0)
    ids = torch.randint(0, head.weight.shape[0], (1, CHECK_TOKENS), generator=generator).to(device)
    labels = ids.clone()
    labels[0, : CHECK_TOKENS // 4] = IGNORE_INDEX
    was_training = causal_lm.training
    causal_lm.eval()
    try:
        with torch.no_grad():
            own = causal_lm(input_ids=ids, labels=labels).loss.float()
            hidden = decoder(input_ids=ids).last_hidden_state
            fused = fused_linear_cross_entropy(
                hidden.reshape(-1, hidden.shape[-1]),
                head.weight,
                next_token_labels(labels).reshape(-1),
                ignore_index=IGNORE_INDEX,
                softcap=getattr(causal_lm.config, "final_logit_softcapping", None),
            ).float()
    except (TypeError, AttributeError, ValueError, RuntimeError) as error:
        return f"its forward could not be checked against the fused loss ({type(error).__name__}: {error})"
    finally:
        causal_lm.train(was_training)
    if not torch.isfinite(own) or not torch.isclose(
        fused, own, rtol=_relative_tolerance(hidden.dtype), atol=0
    ):
        return (
            f"its own loss ({own.item():.4f} on a random batch) is not the plain cross-entropy "
            f"of its head's logits ({fused.item():.4f}): it transforms its logits"
        )
    return None


def fuse_generic_head(causal_lm: nn.Module) -> str | None:
    """Patch the fused linear cross-entropy onto ``causal_lm``'s head where its loss is
    the plain one; return why not otherwise (the model is left as it was)."""
    reason = why_head_stays(causal_lm)
    if reason is None:
        patch_causal_lm(causal_lm)
    return reason
