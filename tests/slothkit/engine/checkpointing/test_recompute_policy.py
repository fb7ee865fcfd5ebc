"""use_gradient_checkpointing="auto" under a fake GPU memory budget (the free memory
query replaced, so that it runs on a CPU): which layers it keeps, what it says, that it
trains exactly as full checkpointing and none do, and that `slothkit plan` predicts the
same choice.  On a GPU the same tests run there (with layer graphs for 4-bit models)."""

import dataclasses
import warnings

import pytest
import torch

from slothkit import FastModel
from slothkit.core.model_state import state_of
from slothkit.engine.checkpointing import recompute_policy
from slothkit.engine.checkpointing.recompute_policy import RecomputeNotice, budget_bytes, training_memory
from slothkit.memory.memory_model import BUDGET_MARGIN, GIB, MemoryBudgetError
from slothkit.memory.sizes import MIN_PIECE
from slothkit.testing import build_tiny_model

LAYERS = 4
BATCH, SEQ = 2, 24
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.fixture(scope="module")
def tiny_path(tmp_path_factory):
    return build_tiny_model("llama", tmp_path_factory.mktemp("tiny-llama"), num_layers=LAYERS)


def _model(path, mode, dtype=torch.float32, load_in_4bit=False, **kwargs):
    model, _ = FastModel.from_pretrained(str(path), dtype=dtype, load_in_4bit=load_in_4bit, fused=True)
    return FastModel.get_peft_model(model, r=8, lora_alpha=16, use_gradient_checkpointing=mode, **kwargs)


def _layers(model):
    return model.get_base_model().model.layers


def _ids(vocab, seq=SEQ, seed=0):
    return torch.randint(3, vocab, (BATCH, seq), generator=torch.Generator().manual_seed(seed)).to(DEVICE)


def _memory_of(model):
    """The TrainingMemory "auto" predicts with for this model."""
    return training_memory(model.get_base_model(), model, _layers(model)[0]._gradient_checkpointing_func)


@pytest.fixture
def memory(tiny_path, reference_kernels):
    return _memory_of(_model(tiny_path, "offload"))


@pytest.fixture
def free_memory(monkeypatch):
    """Set the GPU memory free for this process, as ``free_bytes`` would report it."""

    def set_free(free):
        monkeypatch.setattr(recompute_policy, "free_bytes", lambda device: free)

    return set_free


def _free_for(memory, kept, tokens=BATCH * SEQ):
    """A free memory whose default budget keeps exactly ``kept`` layers."""
    between = (memory.reserved(tokens, kept) + memory.reserved(tokens, kept + 1)) / 2
    return between / (1 - BUDGET_MARGIN)


def _train(model, ids, steps=3):
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=2e-3)
    losses = []
    for _ in range(steps):
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(loss.item())
    return losses


def test_kept_layers_grow_with_the_budget(tiny_path, memory, free_memory):
    """The first forward decides: none kept at the least the step needs, all at plenty,
    the count never falling as the budget grows; the last layers are the kept ones."""
    ids = _ids(memory.shape.vocab_size)
    tokens = BATCH * SEQ
    least, most = memory.reserved(tokens, 0), memory.reserved(tokens, LAYERS)
    kept = []
    frees = [least * (1 + 1e-9) / (1 - BUDGET_MARGIN)] + [_free_for(memory, k) for k in range(LAYERS)]
    for free in frees + [10 * most]:
        free_memory(free)
        model = _model(tiny_path, "auto")
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", RecomputeNotice)
            model(input_ids=ids, labels=ids)
        flags = [layer.gradient_checkpointing for layer in _layers(model)]
        kept.append(flags.count(False))
        assert flags == [True] * (LAYERS - kept[-1]) + [False] * kept[-1]
    assert kept == [0, 0, 1, 2, 3, LAYERS]


def test_the_notice_says_what_was_chosen(tiny_path, memory, free_memory):
    free_memory(_free_for(memory, 2))
    model = _model(tiny_path, "auto")
    budget = _free_for(memory, 2) * (1 - BUDGET_MARGIN)
    peak = memory.reserved(BATCH * SEQ, 2)
    expected = (
        f"slothkit: use_gradient_checkpointing='auto' keeps 2 of {LAYERS} layers' activations at "
        f"{BATCH * SEQ:,} tokens per step (budget {budget / GIB:.1f} GiB, predicted peak "
        f"{peak / GIB:.1f} GiB), offloads 2"
    )
    ids = _ids(memory.shape.vocab_size)
    with pytest.warns(RecomputeNotice) as said:
        model(input_ids=ids, labels=ids)
    assert [str(w.message) for w in said] == [expected]


def test_decided_at_the_first_training_step_and_again_for_longer_ones(tiny_path, memory, free_memory):
    longer = 2 * BATCH * SEQ  # a budget that keeps one layer at this many tokens
    free_memory(_free_for(memory, 1, tokens=longer))
    model = _model(tiny_path, "auto")
    policy = state_of(model).recompute_policy
    vocab = memory.shape.vocab_size
    assert policy.choice is None  # nothing decided before a step
    with torch.no_grad():
        model(input_ids=_ids(vocab))
    assert policy.choice is None  # nor by a forward without gradients
    with warnings.catch_warnings(record=True) as said:
        warnings.simplefilter("always", RecomputeNotice)
        model(input_ids=_ids(vocab), labels=_ids(vocab))
        first = policy.choice
        model(input_ids=_ids(vocab, seq=SEQ // 2), labels=_ids(vocab, seq=SEQ // 2))
        assert policy.choice is first and first.tokens == BATCH * SEQ and first.kept > 1
        model(input_ids=_ids(vocab, seq=2 * SEQ), labels=_ids(vocab, seq=2 * SEQ))
    assert (
        policy.choice == memory.recompute_choice(longer, policy.budget, policy.host_budget)
        and policy.choice.kept == 1
    )
    assert [layer.gradient_checkpointing for layer in _layers(model)] == [True] * (LAYERS - 1) + [False]
    assert len(said) == 2 and f"keeps 1 of {LAYERS} layers' activations at {longer:,}" in str(said[1].message)


def test_a_batch_size_decides_at_once_and_a_budget_too_small_names_the_least(tiny_path, memory, free_memory):
    free_memory(_free_for(memory, 3))
    with pytest.warns(RecomputeNotice, match=f"keeps 3 of {LAYERS} layers"):
        model = _model(tiny_path, "auto", batch_size=BATCH, max_seq_length=SEQ)
    assert [layer.gradient_checkpointing for layer in _layers(model)] == [True, False, False, False]
    least = memory.reserved(BATCH * SEQ, 0)
    with pytest.raises(MemoryBudgetError, match=f"needs at least {least / GIB:.2f} GiB") as error:
        _model(tiny_path, "auto", batch_size=BATCH, max_seq_length=SEQ, max_memory=least - 1)
    assert error.value.minimum_bytes == least


@pytest.fixture
def keeps_by_default(monkeypatch):
    """The checkpointer's defaults of a GPU of compute capability 9.0 (kept sums on), on
    whatever device the test runs."""
    from types import SimpleNamespace

    from slothkit.engine.checkpointing import choice

    cuda = SimpleNamespace(is_available=lambda: True, get_device_capability=lambda: (9, 0))
    monkeypatch.setattr(choice, "torch", SimpleNamespace(cuda=cuda))


def test_kept_sums_give_way_where_only_that_fits_the_budget(tiny_path, reference_kernels, keeps_by_default):
    """A budget under the least a step reserves with the sums kept, but over the least
    without: "auto" stops keeping them (said in its line) and the step trains as one that
    never kept any; where the user asked for kept sums it refuses instead."""
    model = _model(tiny_path, "auto", max_memory=1.0)  # a budget that keeps every layer
    keeping = _memory_of(model)
    assert keeping.keep_sums and _layers(model)[0]._gradient_checkpointing_func.keeps
    lean = dataclasses.replace(keeping, keep_sums=False)
    tokens = BATCH * SEQ
    budget = (lean.reserved(tokens, 0) + keeping.reserved(tokens, 0)) / 2
    with pytest.warns(RecomputeNotice, match="the re-runs recompute their residual sums"):
        model = _model(tiny_path, "auto", batch_size=BATCH, max_seq_length=SEQ, max_memory=budget)
    policy = state_of(model).recompute_policy
    assert policy.choice.stops_keeping and not policy.checkpointer.keeps and not policy.memory.keep_sums
    assert policy.choice.kept == lean.recompute_choice(tokens, budget).kept
    never_kept = _model(tiny_path, "offload", keep_sums=False)
    ids = _ids(keeping.shape.vocab_size)
    assert _train(model, ids) == _train(never_kept, ids)
    with pytest.raises(
        MemoryBudgetError, match=f"needs at least {keeping.reserved(tokens, 0) / GIB:.2f} GiB"
    ):
        _model(tiny_path, "auto", batch_size=BATCH, max_seq_length=SEQ, max_memory=budget, keep_sums=True)


@pytest.mark.parametrize("load_in_4bit", [False, True], ids=["16bit", "4bit"])
def test_auto_trains_as_full_checkpointing_and_none_do(
    tiny_path, reference_kernels, free_memory, mlp_calls, load_in_4bit
):
    """Two layers kept, two offloaded: the same losses, step for step, as every layer
    offloaded and as none checkpointed; only the offloaded ones are re-run."""
    offloaded = _model(tiny_path, "offload", load_in_4bit=load_in_4bit)
    memory = _memory_of(offloaded)
    ids = _ids(memory.shape.vocab_size)
    losses = {}
    for mode in (False, "offload", "auto"):
        free_memory(_free_for(memory, 2))
        model = offloaded if mode == "offload" else _model(tiny_path, mode, load_in_4bit=load_in_4bit)
        mlp_calls.clear()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", RecomputeNotice)
            losses[mode] = _train(model, ids)
        reruns = {False: 0, "offload": LAYERS, "auto": 2}[mode]
        step = [False] * LAYERS + [True] * reruns
        # Layer graphs (4-bit, on a GPU) replay from the second step on, without Python calls.
        assert mlp_calls[: len(step)] == step, mode
        if not memory.cuda_graphs:
            assert mlp_calls == step * 3, mode
    assert losses[False][-1] < losses[False][0]
    for mode in ("offload", "auto"):
        torch.testing.assert_close(torch.tensor(losses[mode]), torch.tensor(losses[False]), rtol=1e-5, atol=0)


def test_the_plan_command_predicts_the_same_choice(tiny_path, reference_kernels, capsys):
    """`slothkit plan FOLDER --max-memory B` prints the very line the policy says for the
    same model, step and budget."""
    from slothkit.cli import main

    model = _model(tiny_path, "offload", dtype=torch.bfloat16)
    memory = training_memory(model.get_base_model(), model, _layers(model)[0]._gradient_checkpointing_func)
    budget = (memory.reserved(BATCH * SEQ, 1) + memory.reserved(BATCH * SEQ, 2)) / 2
    with pytest.warns(RecomputeNotice) as said:
        _model(
            tiny_path, "auto", dtype=torch.bfloat16, batch_size=BATCH, max_seq_length=SEQ, max_memory=budget
        )
    # A GPU whose defaults are the model's: kept sums from compute capability 8.0 (16-bit:
    # no graphs either way); t4 and a100 both compute in 16 bits.
    newer = torch.cuda.is_available() and torch.cuda.get_device_capability() >= (8, 0)
    arguments = ["plan", str(tiny_path), "--gpu", "a100" if newer else "t4", "--mode", "lora", "--rank", "8"]
    arguments += ["--batch", str(BATCH), "--seq", str(SEQ), "--max-memory", repr(budget / GIB)]
    assert main(arguments) == 0
    lines = [line.strip() for line in capsys.readouterr().out.splitlines()]
    notice = str(said[0].message)
    assert f"keeps 1 of {LAYERS} layers" in notice and notice in lines


@pytest.mark.skipif(torch.cuda.is_available(), reason="the model loads onto the GPU, which has a budget")
def test_no_budget_on_the_cpu_offloads_every_layer(tiny_path, reference_kernels, recwarn):
    recompute_policy._notice_no_budget.cache_clear()
    model = _model(tiny_path, "auto")
    assert all(layer.gradient_checkpointing for layer in _layers(model))
    assert state_of(model).recompute_policy is None
    said = [str(w.message) for w in recwarn if w.category is RecomputeNotice]
    assert said == [], "a CPU has nothing to budget, and its loading notice says so already"


def test_no_budget_elsewhere_is_said_once(recwarn):
    recompute_policy._notice_no_budget.cache_clear()
    recompute_policy._notice_no_budget("mps")
    recompute_policy._notice_no_budget("mps")
    said = [str(w.message) for w in recwarn if w.category is RecomputeNotice]
    assert said == [
        "slothkit: use_gradient_checkpointing='auto' has no memory budget on the mps (give one with "
        "max_memory=): every layer is offloaded, as with 'offload'"
    ]


def test_max_memory_is_gib_or_bytes_and_checked():
    cpu = torch.device("cpu")
    assert budget_bytes(40, cpu) == budget_bytes(40 * GIB, cpu) == 40 * GIB
    assert budget_bytes(22.5, cpu) == 22.5 * GIB
    assert budget_bytes(None, cpu) is None  # no GPU: no free memory to budget
    for wrong in (0, -4, True, "40GB"):
        with pytest.raises(ValueError, match=f"max_memory={wrong!r}; expected a positive number"):
            budget_bytes(wrong, cpu)


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"use_gradient_checkpointing": "offload", "max_memory": 40}, "max_memory set the memory budget"),
        ({"use_gradient_checkpointing": True, "batch_size": 2}, "batch_size set the memory budget"),
        ({"use_gradient_checkpointing": "auto", "batch_size": 0}, "batch_size=0; expected a positive"),
        ({"use_gradient_checkpointing": "sometimes"}, "accepted: 'offload', 'auto', True, False"),
    ],
)
def test_options_of_auto_without_auto_are_refused(tiny_path, kwargs, message):
    model, _ = FastModel.from_pretrained(str(tiny_path), dtype=torch.float32, load_in_4bit=False)
    with pytest.raises(ValueError, match=message):
        FastModel.get_peft_model(model, r=8, **kwargs)


def _split(model):
    """Per layer: "offloaded", "on GPU" (checkpointed, input kept on the GPU) or "kept"."""
    from slothkit.engine.checkpointing.offload_checkpoint import DeviceCheckpointer, OffloadedCheckpointer

    names = []
    for layer in _layers(model):
        func = layer._gradient_checkpointing_func
        if not layer.gradient_checkpointing:
            names.append("kept")
        elif isinstance(func, DeviceCheckpointer):
            names.append("on GPU")
        else:
            assert isinstance(func, OffloadedCheckpointer)
            names.append("offloaded")
    return names


def test_layers_the_host_cannot_take_are_checkpointed_on_the_gpu(tiny_path, memory, free_memory):
    """Host memory for one layer's input: one layer offloaded, the other checkpointed ones
    keep their inputs on the GPU, which the GPU budget pays for; a larger GPU budget keeps
    layers as before (the last ones), taking them from those on the GPU first."""
    tokens = BATCH * SEQ
    per_layer = memory.checkpoint_bytes(tokens)
    assert per_layer == tokens * memory.shape.hidden_size * memory.element_bytes * (1 + memory.keep_sums)
    # On the host each copy takes whole power-of-two pieces (slothkit.engine.checkpointing.pinned_pieces).
    host_per_layer = memory.host_checkpoint_bytes(tokens)
    assert per_layer <= host_per_layer < per_layer + 2 * MIN_PIECE
    host = 1.5 * host_per_layer
    least = memory.least_reserved(tokens, host)
    assert least == memory.reserved(tokens, 0, LAYERS - 1) > memory.reserved(tokens, 0)
    assert memory.allocated(tokens, 0, LAYERS - 1) - memory.allocated(tokens) == (LAYERS - 1) * per_layer
    choice = memory.recompute_choice(tokens, least, host)
    assert (choice.kept, choice.offloaded, choice.on_gpu) == (0, 1, LAYERS - 1)
    assert choice.host_bytes == host_per_layer and choice.peak_bytes == least

    free_memory(least * (1 + 1e-9) / (1 - BUDGET_MARGIN))
    with pytest.warns(RecomputeNotice) as said:
        model = _model(tiny_path, "auto", batch_size=BATCH, max_seq_length=SEQ, max_host_memory=host / GIB)
    assert _split(model) == ["offloaded"] + ["on GPU"] * (LAYERS - 1)
    notice = str(said[0].message)
    assert notice == choice.notice()
    assert f"keeps 0 of {LAYERS} layers' activations" in notice
    assert (
        f"offloads 1 ({host_per_layer / GIB:.1f} GiB of host memory, budget {host / GIB:.1f} GiB)" in notice
    )
    assert notice.endswith(f"and checkpoints {LAYERS - 1} on the GPU")

    budget = memory.reserved(tokens, 2, 1) * (1 + 1e-9)
    with pytest.warns(RecomputeNotice, match=f"keeps 2 of {LAYERS} layers"):
        model = _model(
            tiny_path,
            "auto",
            batch_size=BATCH,
            max_seq_length=SEQ,
            max_host_memory=host / GIB,
            max_memory=budget,
        )
    assert _split(model) == ["offloaded", "on GPU", "kept", "kept"]

    with pytest.raises(MemoryBudgetError, match=f"{LAYERS - 1} of them on the GPU for want of host memory"):
        _model(
            tiny_path,
            "auto",
            batch_size=BATCH,
            max_seq_length=SEQ,
            max_host_memory=host / GIB,
            max_memory=least - 1,
        )


def test_a_split_with_layers_on_the_gpu_trains_as_every_layer_offloaded(
    tiny_path, reference_kernels, free_memory, mlp_calls
):
    """One layer offloaded, two checkpointed on the GPU, one kept: the same losses, step
    for step, as every layer offloaded; the three checkpointed layers re-run."""
    offloaded = _model(tiny_path, "offload")
    memory = _memory_of(offloaded)
    tokens = BATCH * SEQ
    ids = _ids(memory.shape.vocab_size)
    host = 1.5 * memory.host_checkpoint_bytes(tokens)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RecomputeNotice)
        losses = {"offload": _train(offloaded, ids)}
        model = _model(
            tiny_path,
            "auto",
            batch_size=BATCH,
            max_seq_length=SEQ,
            max_host_memory=host / GIB,
            max_memory=memory.reserved(tokens, 1, 2) * (1 + 1e-9),
        )
        assert _split(model) == ["offloaded", "on GPU", "on GPU", "kept"]
        mlp_calls.clear()
        losses["split"] = _train(model, ids)
    assert mlp_calls[: LAYERS + 3] == [False] * LAYERS + [True] * 3
    torch.testing.assert_close(
        torch.tensor(losses["split"]), torch.tensor(losses["offload"]), rtol=1e-5, atol=0
    )


def test_the_plan_predicts_the_same_split_under_a_host_budget(tiny_path, reference_kernels, capsys):
    from slothkit.cli import main

    model = _model(tiny_path, "offload", dtype=torch.bfloat16)
    memory = _memory_of(model)
    tokens = BATCH * SEQ
    host = 2.5 * memory.host_checkpoint_bytes(tokens)
    budget = memory.reserved(tokens, 1, 1) * (1 + 1e-6)
    with pytest.warns(RecomputeNotice) as said:
        _model(
            tiny_path,
            "auto",
            dtype=torch.bfloat16,
            batch_size=BATCH,
            max_seq_length=SEQ,
            max_memory=budget,
            max_host_memory=host / GIB,
        )
    newer = torch.cuda.is_available() and torch.cuda.get_device_capability() >= (8, 0)
    arguments = ["plan", str(tiny_path), "--gpu", "a100" if newer else "t4", "--mode", "lora", "--rank", "8"]
    arguments += ["--batch", str(BATCH), "--seq", str(SEQ), "--max-memory", repr(budget / GIB)]
    arguments += ["--max-host-memory", repr(host / GIB)]
    assert main(arguments) == 0
    lines = [line.strip() for line in capsys.readouterr().out.splitlines()]
    notice = str(said[0].message)
    assert "checkpoints 1 on the GPU" in notice and notice in lines


def test_max_host_memory_is_gib_or_bytes_and_checked(tiny_path):
    from slothkit.memory.memory_model import host_budget_bytes

    assert host_budget_bytes(12) == host_budget_bytes(12 * GIB) == 12 * GIB
    assert 0 < host_budget_bytes() < 2**50  # the host's available memory, less a margin
    for wrong in (0, -1, True, "12GB"):
        with pytest.raises(ValueError, match=f"max_host_memory={wrong!r}; expected a positive number"):
            host_budget_bytes(wrong)
    model, _ = FastModel.from_pretrained(str(tiny_path), dtype=torch.float32, load_in_4bit=False)
    with pytest.raises(ValueError, match="max_host_memory set the memory budget"):
        FastModel.get_peft_model(model, r=8, use_gradient_checkpointing=True, max_host_memory=12)
    # "offload" takes it as the limit of what its offloaded inputs may pin at once.
    peft = FastModel.get_peft_model(model, r=8, use_gradient_checkpointing="offload", max_host_memory=12)
    assert _layers(peft)[0]._gradient_checkpointing_func.host_limit_bytes == 12 * GIB
