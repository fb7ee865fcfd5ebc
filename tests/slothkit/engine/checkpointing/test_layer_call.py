"""Layers that read tensors with grad besides their input, and write tensors into a mapping
that later layers read (layer_call): the offloaded checkpointer gives the gradients of
no checkpointing, on toy layers and, through FastModel, on the families that have such
layers (Gemma 4 and Gemma 3n: per-layer input embeddings, keys and values shared across
layers), for every use_gradient_checkpointing."""

import collections

import pytest
import torch
from torch import nn
from transformers.modeling_layers import GradientCheckpointingLayer

from slothkit.engine.checkpointing.choice import enable_checkpointing


class _SharingLayer(GradientCheckpointingLayer):
    """hidden + tanh(q(hidden) * k) * side + offsets["bias"][0], where k is this layer's
    own k(hidden) (stored in ``shared`` when ``stores``) or the one a layer before it
    stored (``reuses``)."""

    def __init__(self, width: int, stores: bool, reuses: bool):
        super().__init__()
        self.q = nn.Linear(width, width)
        self.k = None if reuses else nn.Linear(width, width)
        self.stores = stores
        self.cut = False  # read the stored k as a constant: its gradient lost

    def forward(self, hidden, side, shared=None, offsets=None):
        k = shared["k"] if self.k is None else self.k(hidden)
        if self.k is None and self.cut:
            k = k.detach()
        if self.stores:
            shared["k"] = k
        return hidden + torch.tanh(self.q(hidden) * k) * side + offsets["bias"][0]


class _SharingModel(nn.Module):
    """Each layer gets its slice of a side input computed once before the layers (as
    Gemma's per-layer embeddings), positionally, and a bias inside a tuple inside a dict;
    layer 0 stores its k in ``shared`` for layers 2 and 3 (as Gemma's shared k/v)."""

    def __init__(self, width: int = 8, mapping=dict):
        super().__init__()
        self.embed = nn.Linear(width, width)
        self.side = nn.Linear(width, 4 * width)
        self.bias = nn.Parameter(torch.randn(width) * 0.1)
        self.layers = nn.ModuleList(_SharingLayer(width, stores=i == 0, reuses=i >= 2) for i in range(4))
        self.mapping = mapping

    def forward(self, x):
        hidden = self.embed(x)
        sides = torch.tanh(self.side(x)).unflatten(-1, (4, -1))
        shared = self.mapping()
        for i, layer in enumerate(self.layers):
            hidden = layer(hidden, sides[..., i, :], shared=shared, offsets={"bias": (self.bias,)})
        return hidden


@pytest.mark.parametrize("mapping", [dict, collections.UserDict], ids=["dict", "UserDict"])
@pytest.mark.parametrize("mode", ["offload", True])
def test_reads_and_writes_beside_the_input_get_the_gradients_of_no_checkpointing(mode, mapping):
    torch.manual_seed(0)
    model = _SharingModel(mapping=mapping).train()
    x = torch.randn(2, 5, 8)
    grad = torch.randn(2, 5, 8)

    def gradients(checkpointing):
        enable_checkpointing(model.layers, checkpointing, cuda_graphs=False, keep_sums=False)
        model.zero_grad(set_to_none=True)
        model(x).backward(grad)
        return {name: p.grad.clone() for name, p in model.named_parameters()}

    expected, got = gradients(False), gradients(mode)
    assert set(got) == set(expected)  # every parameter, layer 0's k and the shared bias included
    for name, value in expected.items():
        torch.testing.assert_close(got[name], value, rtol=1e-6, atol=1e-7, msg=name)
    # Layer 0's k feeds layers 2 and 3 too: a checkpointer that lost that part of its
    # gradient would be caught.
    for layer in model.layers[2:]:
        layer.cut = True
    lost = gradients(False)["layers.0.k.weight"]
    assert (lost - expected["layers.0.k.weight"]).abs().max() > 1e-3


@pytest.mark.cuda
@pytest.mark.parametrize("cuda_graphs", [False, True])
def test_on_a_gpu_the_offloaded_layers_that_read_and_write_train_the_same(cuda_graphs):
    """On a GPU the layer inputs go to pinned host memory and back, and the layer graphs,
    when on, leave these layers to the checkpointer: the gradients of no checkpointing,
    over three steps (the graphs capture a signature the second time they see it)."""
    torch.manual_seed(0)
    model = _SharingModel(width=64, mapping=collections.UserDict).cuda().train()
    x = torch.randn(2, 16, 64, device="cuda")

    def gradients(checkpointing):
        enable_checkpointing(model.layers, checkpointing, cuda_graphs=cuda_graphs, keep_sums=False)
        steps = []
        for _ in range(3):
            model.zero_grad(set_to_none=True)
            model(x).square().mean().backward()
            steps.append({name: p.grad.clone() for name, p in model.named_parameters()})
        return steps

    expected, got = gradients(False), gradients("offload")
    for step, (got_step, expected_step) in enumerate(zip(got, expected)):
        for name, value in expected_step.items():
            torch.testing.assert_close(got_step[name], value, rtol=1e-5, atol=1e-6, msg=f"{step}: {name}")


def test_a_stored_tensor_that_no_layer_reads_costs_no_gradient():
    """The last layer stores what nobody reads (Gemma 4's producers store their keys and
    values for assistant models too): its checkpoint gets no gradient for it, and the
    layer's own gradients are those of no checkpointing."""
    torch.manual_seed(1)
    model = _SharingModel().train()
    model.layers[3] = _SharingLayer(8, stores=True, reuses=False)
    x = torch.randn(2, 5, 8)

    def gradients(checkpointing):
        enable_checkpointing(model.layers, checkpointing, cuda_graphs=False, keep_sums=False)
        model.zero_grad(set_to_none=True)
        model(x).sum().backward()
        return {name: p.grad.clone() for name, p in model.named_parameters()}

    expected, got = gradients(False), gradients("offload")
    for name, value in expected.items():
        torch.testing.assert_close(got[name], value, rtol=1e-6, atol=1e-7, msg=name)


# The seven projections and the per-layer input path: the model's projection of the
# embeddings into every layer's per-layer input (whose gradient comes only through the
# layers that read it) and each layer's gate and projection of it.
TARGETS = [
    "q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj",
    "per_layer_model_projection", "per_layer_input_gate", "per_layer_projection",
]  # fmt: skip
STEPS = 4
CHECKPOINTING = ["default", "unsloth", "auto", True, False]


# FastModel loads onto the GPU where there is one; the reference trains beside it. On a
# GPU, fp32 matrix products inside Triton kernels round their inputs to TF32 (10-bit
# mantissa), hence the wider tolerance there.
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
TOLERANCE = 2e-3 if DEVICE == "cuda" else 1e-5


@pytest.fixture(scope="module")
def sharing_checkpoints(tmp_path_factory):
    """tiny-gemma4 and tiny-gemma3n (slothkit.models.generic_shapes) as checkpoints with a
    tokenizer, built on first use, with HF + PEFT's losses and LoRA gradients on them."""
    built = {}

    def checkpoint(name):
        if name not in built:
            from transformers import AutoModelForCausalLM

            from slothkit.models.generic_shapes import GENERIC_SHAPES
            from slothkit.testing import build_tiny_tokenizer

            torch.manual_seed(0)
            path = tmp_path_factory.mktemp(name)
            model = AutoModelForCausalLM.from_config(GENERIC_SHAPES[name].config())
            with torch.no_grad():  # as trained: Gemma 3n starts with its per-layer path at 0
                for parameter in model.parameters():
                    if not parameter.any():
                        parameter.normal_(0.0, 0.5)
            model.save_pretrained(path)
            build_tiny_tokenizer("bpe", path)
            built[name] = path, _train(_plain_peft(path))
        return built[name]

    return checkpoint


def _plain_peft(path):
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="sdpa")
    model.to(DEVICE)  # where FastModel puts it
    torch.manual_seed(3407)  # FastModel.get_peft_model's random_state
    config = LoraConfig(r=8, lora_alpha=16, lora_dropout=0.0, task_type="CAUSAL_LM", target_modules=TARGETS)
    return get_peft_model(model, config).train()


def _train(model):
    """STEPS steps of AdamW: each step's loss and LoRA gradients."""
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(3, 500, (2, 12), generator=g).to(DEVICE)
    labels = ids.clone()
    labels[0, :3] = -100
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=2e-3)
    steps = []
    for _ in range(STEPS):
        loss = model(input_ids=ids, labels=labels).loss
        loss.backward()
        grads = {n: p.grad.clone() for n, p in model.named_parameters() if "lora_" in n}
        steps.append((loss.item(), grads))
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    return steps


@pytest.mark.parametrize("checkpointing", CHECKPOINTING)
@pytest.mark.parametrize("name", ["tiny-gemma4", "tiny-gemma3n"])
def test_shared_kv_and_per_layer_inputs_train_like_hf_peft(name, checkpointing, sharing_checkpoints):
    """Every use_gradient_checkpointing (left out: the default) gives HF + PEFT's losses
    and LoRA gradients at every step, those of the layers whose keys and values later
    layers reuse and of the per-layer input path included."""
    from slothkit import FastModel

    path, expected = sharing_checkpoints(name)
    model, _ = FastModel.from_pretrained(str(path), dtype=torch.float32, load_in_4bit=False)
    options = {} if checkpointing == "default" else {"use_gradient_checkpointing": checkpointing}
    model = FastModel.get_peft_model(model, r=8, lora_alpha=16, target_modules=TARGETS, **options)
    layers = model.get_base_model().model.layers
    assert all(layer.gradient_checkpointing for layer in layers) is (checkpointing is not False)
    got = _train(model)

    producers = [i for i, layer in enumerate(layers) if layer.self_attn.store_full_length_kv]
    assert producers == [0, 1]  # the last sliding and full layers before the sharing point
    watched = [f"layers.{i}.self_attn.{p}_proj.lora_B" for i in producers for p in "kv"]
    watched.append("per_layer_model_projection.lora_B")
    for (loss, grads), (expected_loss, expected_grads) in zip(got, expected):
        assert loss == pytest.approx(expected_loss, rel=TOLERANCE)
        assert set(grads) == set(expected_grads)
        for part in watched:
            assert any(part in n and expected_grads[n].abs().max() > 0 for n in expected_grads), part
        for n, value in expected_grads.items():
            torch.testing.assert_close(grads[n], value, rtol=TOLERANCE, atol=TOLERANCE, msg=n)


def test_a_forward_without_backward_leaves_nothing_behind():
    """The checkpoints hold copies of the mappings, not the mapping the layers write their
    outputs into (that would be a reference cycle through the graph's nodes, which only
    a backward, or nothing, would break): once the output is dropped the mapping and
    what it holds are freed at once, with the cyclic collector off."""
    import gc
    import weakref

    made = []

    class Watched(collections.UserDict):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            made.append(self)

    torch.manual_seed(2)
    model = _SharingModel(mapping=Watched).train()
    enable_checkpointing(model.layers, "offload", cuda_graphs=False, keep_sums=False)
    gc.disable()
    try:
        output = model(torch.randn(2, 5, 8))
        (mapping,) = made
        stored = weakref.ref(mapping["k"])
        assert stored().grad_fn is not None  # the checkpoint's output, not the no_grad tensor
        mapping, made = weakref.ref(mapping), None
        del output
        assert mapping() is None and stored() is None
    finally:
        gc.enable()
