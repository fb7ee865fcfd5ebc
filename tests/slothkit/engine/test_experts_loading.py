"""A 4-bit mixture-of-experts model's experts quantised to NF4 as transformers loads them
(slothkit.engine.experts_loading), against quantising them once the model is loaded.

The same NF4 records bit for bit and the same training, while no more than one layer's
experts are ever in full precision at once: counted at every registration of an experts
parameter, over every tensor alive then (the garbage collector's view), where quantising
after loading holds all of them.
"""

import contextlib
import gc
import threading

import pytest
import torch

import slothkit.engine.experts_loading as loading_glue
import slothkit.loading.load_model as load_model_glue
from slothkit import FastModel
from slothkit.core.inspection import nf4_experts_of
from slothkit.core.notices import FallbackWarning
from slothkit.engine.experts import experts_base, experts_modules
from slothkit_kernels.moe import quantize_nf4_experts

from .test_experts import DEVICE, _checkpoint, _random_b

NAMES = ("gate_up_proj", "down_proj")
RECORD_TENSORS = ("packed", "absmax", "nested_absmax", "offset", "code", "nested_code")


@pytest.fixture(autouse=True)
def fresh_notices():
    from slothkit.core.notices import say_once
    from slothkit.loading.load_model import _notice_generic_path, _warn_unsupported

    for notice in (say_once, _notice_generic_path, _warn_unsupported):
        notice.cache_clear()


class LiveExpertWeights:
    """At every registration of an experts parameter holding values, the number of
    distinct storages of full-precision experts weights alive (3-D float tensors of an
    experts parameter's shape with real strides, as a placeholder has none)."""

    def __init__(self, shapes: set[tuple[int, ...]]):
        self.shapes, self.counts = shapes, []

    def __call__(self, module, name, param):
        if name in NAMES and param.device.type != "meta" and nf4_experts_of(param) is None:
            storages = {
                tensor.untyped_storage().data_ptr()
                for tensor in gc.get_objects()
                if isinstance(tensor, torch.Tensor)
                and tensor.dim() == 3
                and tensor.is_floating_point()
                and tuple(tensor.shape) in self.shapes
                and 0 not in tensor.stride()
                and tensor.device.type != "meta"
            }
            self.counts.append(len(storages))


def _load(path, at_load: bool, live: LiveExpertWeights | None = None, **options):
    """FastModel's 4-bit load with the experts quantised as they load, or (``at_load``
    False) once loaded, the registrations counted by ``live``."""
    with pytest.MonkeyPatch.context() as patch, contextlib.ExitStack() as stack:
        if not at_load:
            patch.setattr(
                load_model_glue, "_experts_quantized_while_loading", lambda *a: contextlib.nullcontext()
            )
        if live is not None:
            hook = torch.nn.modules.module.register_module_parameter_registration_hook(live)
            stack.callback(hook.remove)
        options = {"dtype": torch.float32, "load_in_4bit": True, "fused": True, **options}
        model, _ = FastModel.from_pretrained(str(path), **options)
    return model


def _experts(model):
    return [experts_base(module)[0] for module in experts_modules(model)]


def _train(model, steps: int = 2) -> list[float]:
    model = FastModel.get_peft_model(model, r=8, lora_alpha=16, use_gradient_checkpointing=False)
    _random_b(model, seed=9)
    ids = torch.randint(3, 500, (2, 10), generator=torch.Generator().manual_seed(4)).to(DEVICE)
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=2e-3)
    losses = []
    for _ in range(steps):
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(loss.item())
    return losses


@pytest.mark.parametrize("family", ["qwen3_moe", "gpt_oss", "gemma4_text"])
def test_experts_quantised_as_they_load_are_those_quantised_after(family, tmp_path):
    from transformers import AutoModelForCausalLM

    path = _checkpoint(tmp_path, family)

    def reference_weights():  # the 16-bit path's weights, read once the loads are counted
        model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
        return [{name: getattr(e, name).detach() for name in NAMES} for e in _experts(model)]

    shapes = {tuple(w.shape) for layer in reference_weights() for w in layer.values()}
    gc.collect()
    live_at_load, live_after = LiveExpertWeights(shapes), LiveExpertWeights(shapes)
    with pytest.warns(UserWarning, match="quantised the experts of 2 layers to NF4") as said:
        at_load = _load(path, True, live_at_load)
    assert not [
        w for w in said if issubclass(w.category, FallbackWarning) and "after loading" in str(w.message)
    ]
    after = _load(path, False, live_after)
    # Two layers of two parameters: quantised after loading, all four are held at the
    # last registration; as they load, only the one being registered.
    assert len(live_at_load.counts) == len(live_after.counts) == 4
    assert live_after.counts == [1, 2, 3, 4]
    assert max(live_at_load.counts) == 1

    weights = reference_weights()
    for experts_at_load, experts_after, layer in zip(
        _experts(at_load), _experts(after), weights, strict=True
    ):
        for name in NAMES:
            placeholder = getattr(experts_at_load, name)
            record, other = nf4_experts_of(placeholder), nf4_experts_of(getattr(experts_after, name))
            expected = quantize_nf4_experts(layer[name].to(record.packed.device))
            assert placeholder.shape == layer[name].shape and not placeholder.requires_grad
            assert (record.stored_shape, record.dtype) == (expected.stored_shape, expected.dtype)
            for field in RECORD_TENSORS:
                assert torch.equal(getattr(record, field), getattr(expected, field)), (name, field)
                assert torch.equal(getattr(other, field), getattr(expected, field)), (name, field)

    losses_at_load, losses_after = _train(at_load), _train(after)
    assert losses_at_load[-1] < losses_at_load[0]
    assert losses_at_load == losses_after


def test_experts_left_in_16_bits_by_the_loader_are_quantised_after_it_said_once(tmp_path, monkeypatch):
    """Where the hook does not see the experts (a loader that sets them another way), they
    are quantised after loading as the fallback, said once, to the same records."""
    path = _checkpoint(tmp_path, "qwen3_moe")
    expected = _experts(_load(path, True))
    monkeypatch.setattr(loading_glue, "_quantizable", lambda *args: False)
    with pytest.warns(FallbackWarning, match="experts of 2 mixture-of-experts layers loaded in 16 bits"):
        model = _load(path, True)
    for experts, reference in zip(_experts(model), expected, strict=True):
        for name in NAMES:
            record = nf4_experts_of(getattr(experts, name))
            assert torch.equal(record.packed, nf4_experts_of(getattr(reference, name)).packed)


def test_the_hook_leaves_other_threads_and_unfused_loads_alone(tmp_path):
    """Only the loading thread's experts, and only where the fused experts will run: a
    16-bit load on another thread meanwhile, and a 4-bit fused=False load, keep theirs."""
    from transformers import AutoModelForCausalLM

    path = _checkpoint(tmp_path, "gpt_oss")
    loaded = {}
    with loading_glue.quantized_experts_while_loading(lambda device: True):
        worker = threading.Thread(
            target=lambda: loaded.update(
                model=AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
            )
        )
        worker.start()
        worker.join()
    assert all(nf4_experts_of(getattr(e, name)) is None for e in _experts(loaded["model"]) for name in NAMES)
    unfused = _load(path, True, fused=False)
    assert all(nf4_experts_of(getattr(e, name)) is None for e in _experts(unfused) for name in NAMES)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_loading_never_holds_the_16_bit_experts_on_the_gpu(tmp_path):
    """A checkpoint of 32 layers of 64 experts loads in 4 bits (bf16 otherwise, the
    defaults' fused path) holding, at every registration of a weight on the GPU, under 0.6
    of its experts' 16-bit bytes: the NF4 records take about 0.26 of them and one layer's
    about 0.03, while quantising after loading would hold all of them. Read at the
    registrations (what is held), not as the allocator's peak: transformers warms its
    caching allocator up with one allocation sized by its own estimate of the weights,
    which counts the experts in 16 bits and is freed at once."""
    layers, experts, width, hidden = 32, 64, 128, 128
    path = _checkpoint(
        tmp_path,
        "qwen3_moe",
        hidden_size=hidden,
        num_hidden_layers=layers,
        num_experts=experts,
        moe_intermediate_size=width,
    )
    experts_bytes = layers * experts * 3 * width * hidden * 2
    torch.cuda.empty_cache()
    held = []

    def held_at_registration(module, name, param):
        if param.device.type == "cuda":
            torch.cuda.synchronize()
            held.append(torch.cuda.memory_allocated())

    before = torch.cuda.memory_allocated()
    hook = torch.nn.modules.module.register_module_parameter_registration_hook(held_at_registration)
    try:
        model, _ = FastModel.from_pretrained(str(path), dtype=torch.bfloat16, load_in_4bit=True)
    finally:
        hook.remove()
    assert len(held) >= 2 * layers  # every layer's two experts weights at least
    assert all(nf4_experts_of(getattr(e, name)) is not None for e in _experts(model) for name in NAMES)
    most = max(held) - before
    assert most < 0.6 * experts_bytes, (most, experts_bytes)
