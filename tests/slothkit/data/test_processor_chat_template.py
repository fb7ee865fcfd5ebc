"""get_chat_template on an image-text model's processor: its own template (which places the
images) is kept where it renders the named format, and another format is refused."""

import warnings

import numpy as np
import pytest

from slothkit.chat_templates import get_chat_template
from slothkit.core.notices import FallbackWarning, say_once
from slothkit.testing.tiny_image_text import tiny_image_text_path


@pytest.fixture
def processor():
    from transformers import AutoProcessor

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return AutoProcessor.from_pretrained(tiny_image_text_path("gemma3"))


def _conversation(rng):
    from PIL import Image

    image = Image.fromarray(rng.randint(0, 255, (20, 30, 3), dtype=np.uint8))
    return [
        {"role": "user", "content": [{"type": "image", "image": image}, {"type": "text", "text": "What?"}]},
        {"role": "assistant", "content": [{"type": "text", "text": "Noise."}]},
    ]


def test_the_processors_own_template_is_kept_where_it_renders_the_format(processor):
    conversation = _conversation(np.random.RandomState(0))
    before = processor.apply_chat_template(conversation, tokenize=False)
    say_once.cache_clear()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert get_chat_template(processor, "gemma-3") is processor
    assert processor.apply_chat_template(conversation, tokenize=False) == before
    assert "<start_of_image>" in before  # the image's marker, which the processor expands
    (notice,) = [w for w in caught if issubclass(w.category, FallbackWarning)]
    assert "renders the gemma format and places the images: kept" in str(notice.message)


def test_another_format_or_a_custom_template_is_refused_naming_the_one_it_renders(processor):
    own = processor.chat_template
    with pytest.raises(ValueError, match="renders the gemma format; .* Pass 'gemma', or leave the call out"):
        get_chat_template(processor, "chatml")
    with pytest.raises(ValueError, match="takes a format name only"):
        get_chat_template(processor, ("{{ messages }}", "eos_token"))
    with pytest.raises(ValueError, match="mapping, system_message and add_missing_tokens are not accepted"):
        get_chat_template(processor, "gemma-3", system_message="Be brief.")
    with pytest.raises(ValueError, match="unknown chat template 'gemma-9'"):
        get_chat_template(processor, "gemma-9")
    processor.chat_template = processor.tokenizer.chat_template = None
    with pytest.raises(ValueError, match="has no chat template of its own"):
        get_chat_template(processor, "gemma-3")
    processor.chat_template = own
