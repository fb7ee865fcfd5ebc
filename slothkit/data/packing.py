"""Padding-free packing: a mini-batch as one row of concatenated samples.

Padding wastes compute on tokens that carry no loss.  ``PackingCollator`` joins
the samples of a batch end to end into a single row (shape (1, total_tokens)),
with ``position_ids`` that restart at 0 for every sample.  transformers derives a
block-diagonal causal mask from those restarting positions (SDPA) or sequence
boundaries (flash-attention varlen), so attention never crosses from one sample
into another, and slothkit's RoPE kernel rotates each token by its own
position.

Labels: the first token of every sample is set to -100.  After the usual
one-token shift, that is the label the previous sample's last token would have
been trained on, a prediction across the boundary that must not count.  With
that, the loss of a packed batch equals the token-mean loss of the same samples
run padded (each real token counted once).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch


class PackingCollator:
    """Collate ``[{"input_ids": [...], "labels": [...]?}, ...]`` into one packed row.

    labels default to the input ids.  ``max_length`` truncates each sample (not
    the packed row); ``pad_to_multiple_of`` pads the row's end (with masked
    labels and continuing positions) for kernels that like round sizes.
    """

    def __init__(
        self,
        max_length: int | None = None,
        pad_to_multiple_of: int | None = None,
        pad_token_id: int = 0,
        ignore_index: int = -100,
    ):
        if max_length is not None and max_length <= 1:
            raise ValueError(f"max_length={max_length}; a sample needs at least 2 tokens to train on")
        self.max_length = max_length
        self.pad_to_multiple_of = pad_to_multiple_of
        self.pad_token_id = pad_token_id
        self.ignore_index = ignore_index

    def __call__(self, features: Sequence[Mapping]) -> dict[str, torch.Tensor]:
        if not features:
            raise ValueError("PackingCollator got an empty batch")
        input_ids, labels, positions = [], [], []
        for index, feature in enumerate(features):
            if "input_ids" not in feature:
                raise KeyError(f"sample {index} has no 'input_ids' (keys: {sorted(feature)})")
            ids = list(_as_list(feature["input_ids"]))
            sample_labels = list(_as_list(feature.get("labels", ids)))
            if len(sample_labels) != len(ids):
                raise ValueError(f"sample {index}: {len(ids)} input_ids but {len(sample_labels)} labels")
            if self.max_length is not None:
                ids, sample_labels = ids[: self.max_length], sample_labels[: self.max_length]
            if not ids:
                continue
            sample_labels[0] = self.ignore_index  # no prediction across the boundary
            input_ids.extend(ids)
            labels.extend(sample_labels)
            positions.extend(range(len(ids)))
        if not input_ids:
            raise ValueError("every sample in the batch is empty")
        if self.pad_to_multiple_of:
            extra = -len(input_ids) % self.pad_to_multiple_of
            start = positions[-1] + 1
            input_ids.extend([self.pad_token_id] * extra)
            labels.extend([self.ignore_index] * extra)
            positions.extend(range(start, start + extra))
        return {
            "input_ids": torch.tensor([input_ids], dtype=torch.long),
            "labels": torch.tensor([labels], dtype=torch.long),
            "position_ids": torch.tensor([positions], dtype=torch.long),
        }


def _as_list(values):
    if isinstance(values, torch.Tensor):
        return values.tolist()
    return values
