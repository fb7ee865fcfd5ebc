"""CUDA graphs for checkpointed layers: what may be replayed, and (on a GPU) that
replaying gives the eager path's losses and gradients."""

import functools

import pytest
import torch
from torch import nn

from slothkit.engine.layer_graph_calls import _Call, _has_active_dropout
from slothkit.engine.layer_graphs import LayerGraphs
from slothkit.testing.layer_graphs_on_cpu import GraphsOnCPU


class _Layer(nn.Module):
    def __init__(self, dropout=0.0):
        super().__init__()
        self.proj = nn.Linear(4, 4)
        self.drop = nn.Dropout(dropout)

    def forward(self, hidden, scale=None, position_embeddings=None):
        cos, sin = position_embeddings
        return self.drop(self.proj(hidden)) * scale + cos + sin


def _inputs():
    return torch.randn(2, 3, 4), (torch.randn(3, 4), torch.randn(3, 4))


def test_call_is_split_into_layer_tensors_and_rebuilt():
    layer = _Layer()
    hidden, tables = _inputs()
    for run_function in (
        functools.partial(_Layer.forward, layer, scale=2.0, position_embeddings=tables),
        functools.partial(layer.__call__, scale=2.0, position_embeddings=tables),
    ):
        call = _Call(run_function, ())
        assert call.layer is layer and call.replayable()
        tensors = [leaf for leaf in call.leaves if isinstance(leaf, torch.Tensor)]
        assert len(tensors) == 2  # cos and sin; the scale is a plain value
        torch.testing.assert_close(call(hidden, call.leaves), run_function(hidden), rtol=0, atol=0)
        # Rebuilt around other tensors of the same shape, as a replay reads them.
        fresh = [torch.zeros_like(leaf) if isinstance(leaf, torch.Tensor) else leaf for leaf in call.leaves]
        torch.testing.assert_close(call(hidden, fresh), layer.proj(hidden) * 2.0)


def test_signature_tells_shapes_and_values_apart():
    layer = _Layer()
    hidden, tables = _inputs()
    a = _Call(functools.partial(layer.__call__, scale=2.0, position_embeddings=tables), ())
    b = _Call(functools.partial(layer.__call__, scale=3.0, position_embeddings=tables), ())
    longer = (torch.randn(5, 4), torch.randn(5, 4))
    c = _Call(functools.partial(layer.__call__, scale=2.0, position_embeddings=longer), ())
    signatures = {
        a.signature(hidden, None),
        b.signature(hidden, None),
        c.signature(torch.randn(2, 5, 4), None),
        a.signature(hidden, torch.bfloat16),
    }
    assert len(signatures) == 4


def test_what_is_not_replayed():
    layer = _Layer()
    hidden, tables = _inputs()

    class Cache:  # a KV cache: state a graph cannot carry between replays
        pass

    assert not _Call(
        functools.partial(layer.__call__, position_embeddings=tables, cache=Cache()), ()
    ).replayable()
    assert not _Call(lambda h: layer(h, 1.0, tables), ()).replayable()  # no layer to key the graph on
    assert _has_active_dropout(_Layer(dropout=0.1).train())
    assert not _has_active_dropout(_Layer(dropout=0.1).eval())
    assert not _has_active_dropout(_Layer(dropout=0.0).train())
    attention = _Layer().train()
    attention.attention_dropout = 0.1
    assert _has_active_dropout(attention)
    # On the CPU the caller always runs the layer itself.
    graphs = LayerGraphs()
    run_function = functools.partial(layer.__call__, scale=1.0, position_embeddings=tables)
    for _ in range(3):
        assert graphs.forward(run_function, hidden, (), None) is None
        assert graphs.backward(run_function, [hidden], (), None, torch.ones_like(hidden)) is None
    assert not graphs.graphs


@pytest.mark.cuda
@pytest.mark.parametrize("setting", [True, "forward"], ids=["both", "forward"])
@pytest.mark.parametrize("load_in_4bit", [False, True], ids=["16bit", "4bit"])
@pytest.mark.parametrize("arch", ["llama", "gemma", "gemma3"])
def test_replayed_layers_train_like_eager_ones(arch, load_in_4bit, setting):
    from slothkit import FastModel
    from slothkit.testing import tiny_model_path

    runs = {}
    for graphs in (setting, False):  # asked for: also on a T4-class GPU
        model, _ = FastModel.from_pretrained(
            str(tiny_model_path(arch)), dtype=torch.float32, load_in_4bit=load_in_4bit
        )
        model = FastModel.get_peft_model(
            model, r=8, lora_alpha=16, use_gradient_checkpointing="offload", cuda_graphs=graphs
        )
        g = torch.Generator().manual_seed(0)
        ids = torch.randint(3, model.config.vocab_size, (2, 16), generator=g).cuda()
        params = [p for p in model.parameters() if p.requires_grad]
        optimizer = torch.optim.AdamW(params, lr=2e-3)
        losses = []
        for step in range(4):  # step 0 eager, step 1 captures, steps 2-3 replay
            loss = model(input_ids=ids, labels=ids).loss
            loss.backward()
            if step == 3:
                grads = [p.grad.clone() for p in params]
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            losses.append(loss.item())
        checkpointer = next(
            m._gradient_checkpointing_func
            for m in model.modules()
            if getattr(m, "gradient_checkpointing", False)
        )
        captured = 0 if checkpointer.graphs is None else len(checkpointer.graphs.graphs)
        runs[graphs] = losses, grads, captured
    (graph_losses, graph_grads, captured), (eager_losses, eager_grads, none) = runs[setting], runs[False]
    layers = model.config.num_hidden_layers
    # A forward and (setting True) a backward graph per layer.
    assert captured == (2 if setting is True else 1) * layers and none == 0
    torch.testing.assert_close(torch.tensor(graph_losses), torch.tensor(eager_losses), rtol=1e-6, atol=0)
    for a, b in zip(graph_grads, eager_grads):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("through_autograd", [False, True], ids=["foreach", "accumulator-nodes"])
def test_gradients_are_added_as_autograd_would(through_autograd):
    from slothkit.engine.layer_graph_buffers import _accumulate

    params = [torch.zeros(3, requires_grad=True), torch.zeros(2, 2, requires_grad=True)]
    params[1].grad = torch.ones(2, 2)
    # What DDP's reducer waits for (its own hook sits on the same accumulator node).
    accumulated = []
    for index, param in enumerate(params):
        param.register_post_accumulate_grad_hook(lambda p, index=index: accumulated.append(index))
    grads = [torch.randn(3), torch.randn(2, 2)]
    _accumulate(params, grads, through_autograd=through_autograd)
    torch.testing.assert_close(params[0].grad, grads[0], rtol=0, atol=0)
    torch.testing.assert_close(params[1].grad, 1 + grads[1], rtol=0, atol=0)
    assert sorted(accumulated) == ([0, 1] if through_autograd else [])
    grads[0].zero_()  # the static buffer is reused by the next replay: .grad is a copy
    assert params[0].grad.abs().sum() > 0


def test_gradients_go_through_autograd_under_a_process_group(monkeypatch):
    from slothkit.engine import layer_graph_buffers

    assert not layer_graph_buffers._gradients_watched()  # no process group in this test process
    monkeypatch.setattr(torch.distributed, "is_initialized", lambda: True)
    assert layer_graph_buffers._gradients_watched()


@pytest.mark.parametrize("keeps", [True, False], ids=["keeps", "keeps_nothing"])
@pytest.mark.parametrize("phases", [("forward", "backward"), ("forward",)], ids=["both", "forward-only"])
@pytest.mark.parametrize("arch", ["llama", "gemma", "gemma3", "gemma2"])
def test_replay_plumbing_trains_like_eager_layers_on_cpu(
    arch, phases, keeps, mlp_calls, known_sums, reference_kernels
):
    """The plumbing, not the kernels, is under test (tests/kernels compare those, and the
    CUDA test above replays the Triton kernels): the fused layers call the kernels' torch
    references, under a second per case where the Triton interpreter took about a minute.
    Gemma 3's and Gemma 2's sandwich layer (their layers alternate sliding and global
    attention, each with its own mask, and Gemma 3's its own rotary tables: leaves of the
    call) skips no down projection and keeps nothing, replayed or not."""
    from slothkit.models import architecture_named

    sandwich = architecture_named(arch).sandwich_norms
    from slothkit import FastModel
    from slothkit.testing import tiny_model_path

    skipped_down = mlp_calls  # the re-run inside a replayed graph skips the down projection too
    # known_sums: and, where the layers keep, each re-run gets the forward's residual sum
    runs = {}
    for graphs in (True, False):
        skipped_down.clear()
        known_sums.clear()
        model, _ = FastModel.from_pretrained(
            str(tiny_model_path(arch)),
            dtype=torch.float32,
            load_in_4bit=False,
            device_map={"": "cpu"},
            fused=True,  # on a GPU machine TRITON_INTERPRET is off: the CPU would keep HF's modules
        )
        model = FastModel.get_peft_model(
            model, r=8, lora_alpha=16, use_gradient_checkpointing="offload", keep_sums=keeps
        )
        checkpointer = next(
            m._gradient_checkpointing_func
            for m in model.modules()
            if getattr(m, "gradient_checkpointing", False)
        )
        checkpointer.graphs = GraphsOnCPU(phases=phases) if graphs else None
        g = torch.Generator().manual_seed(0)
        ids = torch.randint(3, model.config.vocab_size, (2, 12), generator=g)
        params = [p for p in model.parameters() if p.requires_grad]
        optimizer = torch.optim.AdamW(params, lr=2e-3)
        losses = []
        for step in range(4):
            for micro in (ids, ids.flip(1)):  # gradient accumulation: .grad is added to
                loss = model(input_ids=micro, labels=micro).loss
                loss.backward()
                losses.append(loss.item())
            if step == 3:
                grads = [p.grad.clone() for p in params]
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
        runs[graphs] = losses, grads, checkpointer.graphs
        reruns = 8 * model.config.num_hidden_layers  # 8 micro-batches, replayed or not
        assert skipped_down.count(True) == (0 if sandwich else reruns), graphs
        assert known_sums.count(True) == (reruns if keeps and not sandwich else 0)
    (graph_losses, graph_grads, layer_graphs), (eager_losses, eager_grads, _) = runs[True], runs[False]
    layers = model.config.num_hidden_layers
    # The first micro-batch runs eagerly, the second captures (forward and, unless only
    # the forward is graphed, backward of each layer); from then on every micro-batch
    # replays: 7 of the 8.
    graphs_per_layer = len(phases)
    assert sorted({key[0] for key in layer_graphs.graphs}) == sorted(phases)
    assert len(layer_graphs.graphs) == graphs_per_layer * layers
    assert layer_graphs.log.count("capture") == graphs_per_layer * layers
    assert layer_graphs.log.count("release") == graphs_per_layer * layers  # after each capture
    # The graphs of every layer share one set of buffers: the input (overwritten by the
    # output) and, with backward graphs, the incoming gradient and one per LoRA parameter.
    (statics,) = layer_graphs.statics.values()
    assert list(statics.kept) == (["attention_sum"] if keeps and not sandwich else [])
    if "backward" in phases:
        (grads,) = statics.grads.values()
        assert len(grads) == len(params) // layers
    else:
        assert statics.grad_output is None and not statics.grads
    assert layer_graphs.log.count("replay") == 7 * graphs_per_layer * layers
    assert graph_losses == eager_losses
    for a, b in zip(graph_grads, eager_grads):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


@pytest.mark.parametrize("written", ["unchanged", "in place", "through a view"])
def test_a_chained_output_is_not_copied_back_unless_written_since(written):
    """Layer i's output, cloned out of the input buffer, is layer i+1's input: the buffer
    still holds it, so the copy in is skipped, unless the tensor was written in place
    since; likewise for the gradient buffer in backward."""
    layers = [_Layer(), _Layer()]
    hidden, tables = _inputs()
    runs = [functools.partial(layer.__call__, scale=2.0, position_embeddings=tables) for layer in layers]
    graphs = GraphsOnCPU()
    for _ in range(2):  # eager, then capture: each layer replays from here on
        for run_function in runs:
            graphs.forward(run_function, hidden, (), None)
            graphs.backward(run_function, [hidden.clone()], (), None, torch.ones_like(hidden))
    (statics,) = graphs.statics.values()
    copies = []
    load = statics.hidden.copy_
    statics.hidden.copy_ = lambda source: (copies.append("hidden"), load(source))[1]

    def write(tensor):
        if written == "in place":
            tensor.mul_(3.0)
        elif written == "through a view":
            tensor[0, 0].fill_(7.0)

    first = graphs.forward(runs[0], hidden, (), None)
    write(first)
    second = graphs.forward(runs[1], first, (), None)
    # Each replay copies the layer's output into the buffer (2); the copies in are the
    # first layer's input, and the second's only if it was written.
    assert len(copies) == 2 + (1 if written == "unchanged" else 2)
    with torch.no_grad():
        torch.testing.assert_close(second, layers[1](first, 2.0, tables), rtol=0, atol=0)

    # Backward, last layer first: the later layer's input gradient is the earlier's
    # incoming gradient.
    grad_output = torch.randn_like(hidden)
    copies.clear()
    load_grad = statics.grad_output.copy_
    statics.grad_output.copy_ = lambda source: (copies.append("grad"), load_grad(source))[1]
    for layer in layers:
        layer.zero_grad(set_to_none=True)
    grad_first = graphs.backward(runs[1], [first.clone()], (), None, grad_output)
    write(grad_first)
    grad_hidden = graphs.backward(runs[0], [hidden.clone()], (), None, grad_first)
    assert copies.count("grad") == 2 + (1 if written == "unchanged" else 2)  # as in the forward
    # d(2 (x W^T + b) + cos + sin)/dx = 2 dY W
    torch.testing.assert_close(grad_hidden, 2 * grad_first @ layers[0].proj.weight, rtol=0, atol=0)


class _FailingCapture(GraphsOnCPU):
    def _record(self, graph, body):
        raise RuntimeError("operation not permitted when stream is capturing")


@pytest.mark.parametrize("capture", ["works", "fails"])
def test_backward_frees_the_callers_copies_before_the_prefetch(capture):
    """The layer's input and kept tensors, once in the static buffers, are dropped from
    the caller's list before before_replay (the next layer's prefetch) runs; a capture
    that fails gives them back, from the buffers, for the eager re-run."""
    layer = _Layer()
    hidden, tables = _inputs()
    kept = torch.randn(2, 3, 4)
    run_function = functools.partial(layer.__call__, scale=2.0, position_embeddings=tables)
    graphs = (GraphsOnCPU if capture == "works" else _FailingCapture)(phases=("backward",))
    grad_output = torch.randn(2, 3, 4)
    saved = [hidden.clone(), kept.clone()]
    # The first sighting runs eagerly: the list stays as it was, and no hook runs.
    assert (
        graphs.backward(
            run_function,
            saved,
            (),
            None,
            grad_output,
            kept_names=("sum",),
            before_replay=lambda: pytest.fail("no replay"),
        )
        is None
    )
    assert len(saved) == 2
    seen = []
    if capture == "fails":
        with pytest.warns(UserWarning, match="CUDA graphs for the decoder layers are off"):
            result = graphs.backward(
                run_function,
                saved,
                (),
                None,
                grad_output,
                kept_names=("sum",),
                before_replay=lambda: seen.append(list(saved)),
            )
        assert result is None and not graphs.enabled
        assert seen == [[]]
        torch.testing.assert_close(saved, [hidden, kept], rtol=0, atol=0)
        return
    grad = graphs.backward(
        run_function,
        saved,
        (),
        None,
        grad_output,
        kept_names=("sum",),
        before_replay=lambda: seen.append(list(saved)),
    )
    assert seen == [[]] and saved == []
    # d(2 (x W^T + b) + cos + sin) / dx = 2 dY W
    torch.testing.assert_close(grad, 2 * grad_output @ layer.proj.weight)
    torch.testing.assert_close(
        layer.proj.weight.grad, 2 * grad_output.reshape(-1, 4).t() @ hidden.reshape(-1, 4)
    )
    (statics,) = graphs.statics.values()
    torch.testing.assert_close(statics.kept["sum"], kept, rtol=0, atol=0)


def test_graphs_by_default_only_where_the_host_is_the_limit(monkeypatch):
    from slothkit.engine.checkpointing.choice import enable_checkpointing

    class Layer(nn.Module):
        gradient_checkpointing = False

    def graphs_for(capability, setting=None, launch_bound=True):
        """The phases replayed from graphs, () for none."""
        monkeypatch.setattr(torch.cuda, "is_available", lambda: capability is not None)
        monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *a: capability)
        layer = Layer()
        enable_checkpointing([layer], "offload", cuda_graphs=setting, launch_bound=launch_bound)
        graphs = layer._gradient_checkpointing_func.graphs
        return () if graphs is None else graphs.phases

    both, forward = ("forward", "backward"), ("forward",)
    assert graphs_for((9, 0)) == both and graphs_for((8, 0)) == both
    assert graphs_for((7, 5)) == () and graphs_for(None) == ()  # T4, CPU
    # 16-bit Llama-like layers: eager unless asked (the forward graphs' gain is small, their
    # pool is not).
    assert graphs_for((9, 0), launch_bound=False) == ()
    assert graphs_for((9, 0), "forward", launch_bound=False) == forward
    assert graphs_for((7, 5), launch_bound=False) == ()
    assert graphs_for((7, 5), True) == both and graphs_for((9, 0), False) == ()
    assert graphs_for((9, 0), True, launch_bound=False) == both
    assert graphs_for((9, 0), "forward") == forward
    with pytest.raises(ValueError, match="cuda_graphs='yes'; accepted: None .*True, False, 'forward'"):
        graphs_for((9, 0), "yes")


def test_batches_over_max_tokens_run_eagerly():
    layer = _Layer()
    hidden, tables = _inputs()
    tokens = hidden.numel() // hidden.shape[-1]
    run_function = functools.partial(layer.__call__, scale=1.0, position_embeddings=tables)
    for max_tokens, captured in ((tokens - 1, False), (tokens, True)):
        graphs = GraphsOnCPU(max_tokens=max_tokens)
        for _ in range(3):
            graphs.forward(run_function, hidden, (), None)
        assert bool(graphs.graphs) == captured, max_tokens
        assert ("capture" in graphs.log) == captured


@pytest.mark.parametrize(
    "family, load_in_4bit, fused, launch_bound",
    [
        ("llama", False, None, False),
        ("llama", True, None, True),  # a dequantisation per projection
        ("qwen3", False, True, True),  # per-head q/k RMSNorms on the fused path
        ("qwen3", False, False, False),  # Hugging Face's modules: no layer graphs to replay
        ("gemma3", False, True, True),  # q/k norms and four norms per layer
    ],
    ids=["llama-16bit", "llama-4bit", "qwen3-fused-16bit", "qwen3-unfused-16bit", "gemma3-fused-16bit"],
)
def test_fast_model_asks_for_graphs_where_the_host_limits_the_layers(
    family, load_in_4bit, fused, launch_bound, checkpointing_asked, monkeypatch
):
    from slothkit import FastModel
    from slothkit.testing import tiny_model_path

    monkeypatch.delenv("SLOTHKIT_CUDA_GRAPHS", raising=False)
    monkeypatch.delenv("SLOTHKIT_KEEP_SUMS", raising=False)
    model, _ = FastModel.from_pretrained(
        str(tiny_model_path(family)),
        dtype=torch.float32,
        load_in_4bit=load_in_4bit,
        device_map={"": "cpu"},
        fused=fused,
    )
    FastModel.get_peft_model(model, r=8, lora_alpha=16, use_gradient_checkpointing="offload")
    # Gemma 3's fused layers have no sum to keep (Architecture.keeps_attention_sum).
    keep_sums = False if family == "gemma3" and fused else None
    assert checkpointing_asked == [
        {"cuda_graphs": None, "launch_bound": launch_bound, "keep_sums": keep_sums}
    ]


def test_a_model_quantised_after_loading_counts_as_4bit(checkpointing_asked, monkeypatch):
    """The benchmark swaps bitsandbytes NF4 layers into a built model: no
    is_loaded_in_4bit flag, but 4-bit weights all the same."""
    from slothkit import FastModel
    from slothkit.bench.model_setup import build_model

    monkeypatch.delenv("SLOTHKIT_CUDA_GRAPHS", raising=False)
    monkeypatch.delenv("SLOTHKIT_KEEP_SUMS", raising=False)
    model = build_model("tiny-llama", torch.float32, "cpu", seed=0, quantize_nf4=True)
    assert not getattr(model, "is_loaded_in_4bit", False)
    FastModel.get_peft_model(model, r=8, lora_alpha=16, use_gradient_checkpointing="offload")
    assert checkpointing_asked == [{"cuda_graphs": None, "launch_bound": True, "keep_sums": None}]
