"""The text tower of a multimodal checkpoint, loaded alone.

Gemma 3's 4B, 12B and 27B checkpoints are image-text models (Gemma3ForConditionalGeneration:
a SigLIP vision tower, a projector, and a Gemma 3 text model as their language model).
Fine-tuning them on text reads and trains only the language model, so FastModel loads that
as the family's causal LM (Gemma3ForCausalLM) from the same files: the fused path patches
it like any Gemma 3 text model, the vision tower's weights stay on disk (about 0.4B
parameters), and every save (adapter, merged, GGUF) is of the text model. That is said
once, since a merged model pushed from it no longer reads images.

Gemma 4's checkpoints (Gemma4ForConditionalGeneration: vision and audio towers around a
Gemma 4 text model) load the same way, their text model on the generic path.

Which multimodal model_types hold which family is the record's `text_tower_of`, and for
families without a record slothkit.models.generic_shapes.TEXT_TOWERS.
"""

from __future__ import annotations

import contextlib
import copy
import logging

from slothkit.core.notices import FallbackWarning, say_once
from slothkit.data.chat_template_calls import accept_older_chat_template_calls
from slothkit.models import RECORDS
from slothkit.models.generic_shapes import TEXT_TOWERS

# Where transformers keeps the language model's weights in such a checkpoint: the layout
# the checkpoints were published in (language_model.model.*, language_model.lm_head.*) and
# the one transformers writes since 4.52 (model.language_model.*, lm_head.*), renamed to
# the causal LM's (model.*, lm_head.*). The vision tower's and projector's weights match
# nothing and are not loaded.
TEXT_TOWER_KEYS = {
    r"^language_model\.model\.": "model.",
    r"^model\.language_model\.": "model.",
    r"^language_model\.lm_head\.": "lm_head.",
}


def text_tower_config(config, model_name: str):
    """The config to load `config`'s checkpoint with as a text model, or None when it is
    not a multimodal checkpoint whose language model has a record's `text_tower_of` (or,
    for a family without a record, an entry of TEXT_TOWERS).

    The text config carries the checkpoint's quantization_config (a checkpoint saved in
    4 bits), with the names of the modules it kept in 16 bits renamed to the text model's.
    """
    text = getattr(config, "text_config", None)
    if text is None or not _holds_text_tower(config.model_type, text.model_type):
        return None
    text = copy.deepcopy(text)
    quantization = getattr(config, "quantization_config", None)
    if quantization is not None:
        text.quantization_config = _renamed_skip_modules(quantization)
    text.name_or_path = getattr(config, "name_or_path", model_name)
    say_once(
        f"slothkit: {model_name} is a multimodal {config.model_type} checkpoint "
        f"({', '.join(config.architectures or [config.model_type])}); slothkit loads its text "
        f"model alone ({text.model_type}) and trains that, so the vision tower is not loaded and "
        f"the adapter, merged and GGUF saves are of the text model (they read no images); its "
        f"tokenizer's apply_chat_template returns text unless asked to tokenize, as the checkpoint's "
        f"processor does",
        FallbackWarning,
    )
    return text


def _holds_text_tower(model_type: str, text_model_type: str) -> bool:
    if TEXT_TOWERS.get(model_type) == text_model_type:
        return True
    return any(model_type in arch.text_tower_of and text_model_type in arch.model_types for arch in RECORDS)


def _renamed_skip_modules(quantization):
    """bitsandbytes' settings with llm_int8_skip_modules named as in the text model."""
    settings = quantization if isinstance(quantization, dict) else quantization.to_dict()
    settings = dict(settings)
    skipped = settings.get("llm_int8_skip_modules")
    if skipped:
        for old, new in (("language_model.model.", "model."), ("model.language_model.", "model.")):
            skipped = [name.replace(old, new) for name in skipped]
        settings["llm_int8_skip_modules"] = skipped
    return settings


@contextlib.contextmanager
def unreported_vision_weights():
    """Within: transformers' load report is not printed. Loading a text tower, it lists
    every weight of the vision tower and projector as unexpected (hundreds of lines), while
    what it would flag for the text model, slothkit checks itself: a missing tensor
    (slothkit.checkpoint.loaded_weights) and a size mismatch (transformers raises)."""
    report_logger = logging.getLogger("transformers.modeling_utils")

    def not_the_report(record: logging.LogRecord) -> bool:
        return "LOAD REPORT" not in str(record.msg)

    report_logger.addFilter(not_the_report)
    try:
        yield
    finally:
        report_logger.removeFilter(not_the_report)


def renders_text_by_default(tokenizer) -> None:
    """Make this tokenizer's apply_chat_template return the text when the call asks for no
    tokens (no tokenize, return_tensors or return_dict), as the checkpoint's processor
    does: what Unsloth returns for such a checkpoint is that processor, and its notebooks
    pass the result to tokenizer([text]). A tokenizer's own default is token ids.  The
    instance's one apply_chat_template wrapper does it (slothkit.data.chat_template_calls)."""
    accept_older_chat_template_calls(tokenizer, text_by_default=True)
