"""The gated DeltaNet glue (slothkit.engine.gated_deltanet) on a tiny Qwen3.5 built from
its config: the kernel path computes the layer's own output, the check at fusing undoes
the patches where a layer computes something else, and calls the kernel path does not
serve go to the layer's own forward.  Training against HF + PEFT is in
tests/slothkit/test_generic_path.py."""

import types

import torch
from transformers import AutoConfig, AutoModelForCausalLM

from slothkit.core.model_state import patched_module
from slothkit.engine.gated_deltanet import deltanet_layers, fuse_deltanet_layers
from slothkit.models.generic_shapes import GENERIC_SHAPES
from slothkit_kernels.testing import relative_error


def _tiny_qwen3_5():
    shape = GENERIC_SHAPES["tiny-qwen3.5"]
    extra = {k: v for k, v in shape.extra.items() if k != "vocab_size"}
    config = AutoConfig.for_model(
        "qwen3_5_text", hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=2, vocab_size=256, **extra,
    )  # fmt: skip
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(config).float()


def test_the_kernel_path_computes_the_layers_output_and_its_gradients():
    model = _tiny_qwen3_5()
    assert fuse_deltanet_layers(model) == (3, None)
    layer = deltanet_layers(model)[1]
    x = torch.randn(2, 70, 64, requires_grad=True)
    mask = torch.ones(2, 70)
    mask[1, :9] = 0  # left padding
    ours = layer(x, attention_mask=mask)
    own = patched_module(layer).original_forward(x, attention_mask=mask)
    assert relative_error(ours, own) < 1e-5
    d_out = torch.randn_like(own)
    grads = torch.autograd.grad((ours * d_out).sum(), [x, layer.A_log, layer.dt_bias, layer.conv1d.weight])
    own_grads = torch.autograd.grad((own * d_out).sum(), [x, layer.A_log, layer.dt_bias, layer.conv1d.weight])
    # A_log's and dt_bias's gradients sum dg * (dg/dparameter) over every position, terms
    # of both signs that mostly cancel; transformers' fp32 chunked rule carries about 2e-4
    # relative rounding in dg here (against an fp64 recurrence; the kernel about 1e-5),
    # which that sum magnifies about tenfold.
    for name, a, e, bound in zip(
        ["x", "A_log", "dt_bias", "conv1d"], grads, own_grads, [1e-5, 1e-2, 1e-2, 1e-5]
    ):
        assert relative_error(a, e) < bound, f"{name}: {relative_error(a, e):.2e}"


def test_a_layer_that_computes_something_else_undoes_every_patch():
    model = _tiny_qwen3_5()
    odd = deltanet_layers(model)[2]
    own = odd.forward
    odd.forward = types.MethodType(lambda self, *a, **k: 2 * own(*a, **k), odd)  # a doubled output
    count, reason = fuse_deltanet_layers(model)
    assert count == 0 and "differ by" in reason
    assert all(patched_module(layer) is None for layer in deltanet_layers(model))
    assert "forward" not in vars(deltanet_layers(model)[0])


def test_a_kernel_that_fails_on_this_gpu_undoes_every_patch(monkeypatch):
    """A backward that cannot be compiled or launched (Triton's errors are not
    RuntimeErrors) is met at the check, not at the first training step: every layer keeps
    its own forward and the reason names the error."""
    import slothkit.engine.gated_deltanet as glue

    class OutOfResources(Exception):  # as triton.runtime.errors.OutOfResources
        pass

    class FailingBackward(torch.autograd.Function):
        @staticmethod
        def forward(ctx, q):
            return q.clone()

        @staticmethod
        def backward(ctx, grad):
            raise OutOfResources("out of resource: shared memory, Required: 262144, Hardware limit: 232448")

    kernel = glue.gated_delta_rule

    def failing_in_backward(q, *args, **kwargs):
        output, state = kernel(q, *args, **kwargs)
        return FailingBackward.apply(output), state

    monkeypatch.setattr(glue, "gated_delta_rule", failing_in_backward)
    model = _tiny_qwen3_5()
    count, reason = fuse_deltanet_layers(model)
    assert count == 0 and "OutOfResources: out of resource: shared memory" in reason
    assert all(patched_module(layer) is None for layer in deltanet_layers(model))


def test_a_cache_goes_to_the_layers_own_forward():
    model = _tiny_qwen3_5()
    fuse_deltanet_layers(model)
    layer = deltanet_layers(model)[0]
    record = patched_module(layer)
    seen = []
    own = record.original_forward
    record.original_forward = lambda *a, **k: seen.append(sorted(k)) or own(*a, **k)
    ids = torch.randint(0, 256, (1, 6))
    with torch.no_grad():
        model.generate(input_ids=ids, max_new_tokens=2, do_sample=False)
    assert seen and all("cache" in keys or "cache_params" in keys for keys in seen)
