"""Try slothkit as a careless user and an unkind machine would, and report what happened.

    python scripts/reliability_probes.py            # every probe, one line each, then the counts
    python scripts/reliability_probes.py -k gguf    # the probes whose name holds "gguf"

The probes are those of docs/reliability.md in quick CPU form, on the tiny models of
slothkit.testing and a LocalHub: bad arguments, full and read-only disks, kill -9 mid-save,
a Hub server that stalls or fails, misspelt options, damaged checkpoints and data. Each
runs in a forked process with a time limit and says

    outcome    "refused: MESSAGE" (a mistake caught), "warned: MESSAGE", "done" (accepted
               as it should be), or "FAILED: ..." (an unexpected exception, a message of
               several lines or none, a wrong result)
    lost       the files the probe set out to keep (an earlier save, the input, the user's
               notes) differ afterwards
    hung       it ran past its time limit
    silent     a mistake went through without an error or a warning

The exit status is 1 when any probe failed, lost data, hung or accepted a mistake silently.
"""

from __future__ import annotations

import argparse
import contextlib
import errno
import io
import json
import multiprocessing
import os
import pathlib
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import textwrap
import time
import traceback
import warnings

PROBES: list[tuple[str, object, float]] = []


def probe(name: str, timeout_s: float = 120.0):
    def register(function):
        PROBES.append((name, function, timeout_s))
        return function

    return register


class ProbeFailure(Exception):
    """The probe saw something wrong (a wrong exit code, a missing file, an unclear message)."""


class Report:
    def __init__(self, outcome: str, lost: bool = False, silent: bool = False):
        self.outcome, self.lost, self.silent = outcome, lost, silent


# ---------------------------------------------------------------------------------------
# Helpers
# ---------------------------------------------------------------------------------------


def tree(folder: pathlib.Path) -> dict:
    if not folder.exists():
        return {}
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


def one_line(message: str, what: str) -> str:
    message = str(message).strip()
    if not message or "\n" in message or "Traceback" in message:
        raise ProbeFailure(f"{what}: not one line: {message[:200]!r}")
    return message


def refused(action, error_type, pattern: str, keep: pathlib.Path | None = None) -> Report:
    """Run `action`, expecting error_type with a message matching `pattern`; `keep` is a
    folder that must be the same afterwards."""
    before = tree(keep) if keep is not None else None
    try:
        action()
    except error_type as error:
        message = one_line(str(error), type(error).__name__)
        if not re.search(pattern, message):
            raise ProbeFailure(f"{type(error).__name__} without {pattern!r}: {message[:200]}") from error
        lost = keep is not None and tree(keep) != before
        return Report(f"refused: {message}", lost=lost)
    lost = keep is not None and tree(keep) != before
    return Report("accepted without a word", lost=lost, silent=True)


def warned(action, pattern: str) -> Report:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        action()
    messages = [str(w.message) for w in caught if re.search(pattern, str(w.message))]
    if not messages:
        return Report("accepted without a word", silent=True)
    return Report(f"warned: {one_line(messages[0], 'warning')}")


def cli(argv: list[str], status: int, pattern: str, keep: pathlib.Path | None = None) -> Report:
    """`slothkit ARGV`: expect exit `status` and one stderr line matching `pattern`."""
    from slothkit.cli import main

    before = tree(keep) if keep is not None else None
    err = io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
        try:
            code = main(argv)
        except SystemExit as exit:  # argparse
            code = exit.code
    text = err.getvalue().strip().splitlines()
    text = text[-1] if text else ""
    lost = keep is not None and tree(keep) != before
    if code == 0:
        return Report("accepted without a word", lost=lost, silent=True)
    if code != status or not re.search(pattern, text) or "Traceback" in err.getvalue():
        raise ProbeFailure(f"exit {code} (expected {status}); stderr: {err.getvalue()[-300:]!r}")
    return Report(f"refused (exit {code}): {text}", lost=lost)


def lora_model(seed: int = 0):
    import torch

    from slothkit import FastModel
    from slothkit.testing import tiny_model_path

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model, tokenizer = FastModel.from_pretrained(
            str(tiny_model_path("llama")), dtype=torch.float32, load_in_4bit=False
        )
        model = FastModel.get_peft_model(model, r=4, lora_alpha=8, use_gradient_checkpointing=False)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_B" in name:  # PEFT starts B at zero: give the adapter an effect
                param.copy_(torch.randn(param.shape, generator=generator) * 0.05)
    return model, tokenizer


def plain_model():
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from slothkit.testing import tiny_model_path

    path = tiny_model_path("llama")
    return AutoModelForCausalLM.from_pretrained(path), AutoTokenizer.from_pretrained(path)


def saved(work: pathlib.Path, save_method: str = "lora"):
    """(model, tokenizer, folder of an earlier save holding also the user's notes)."""
    model, tokenizer = lora_model()
    folder = work / "out"
    model.save_pretrained_merged(folder, tokenizer, save_method=save_method)
    (folder / "notes.txt").write_text("mine")
    return model, tokenizer, folder


def saved_adapter(work: pathlib.Path) -> pathlib.Path:
    model, tokenizer = lora_model()
    adapter = work / "adapter"
    model.save_pretrained(adapter)
    tokenizer.save_pretrained(adapter)
    return adapter


def disk_with_free(free: int) -> None:
    import collections

    usage = collections.namedtuple("usage", "total used free")
    shutil.disk_usage = lambda path: usage(10**12, 10**12 - free, free)


def checkpoint_copy(work: pathlib.Path) -> pathlib.Path:
    from slothkit.testing import tiny_model_path

    folder = work / "ckpt"
    shutil.copytree(tiny_model_path("llama"), folder)
    return folder


# ---------------------------------------------------------------------------------------
# Saving
# ---------------------------------------------------------------------------------------


@probe("save lora with overwrite into a folder with a merged model and notes")
def _(work):
    model, tokenizer, folder = saved(work, "merged_16bit")
    (folder / "scripts").mkdir()
    (folder / "scripts" / "run.sh").write_text("echo hi")
    model.save_pretrained_merged(folder, tokenizer, save_method="lora", overwrite=True)
    kept = (folder / "notes.txt").read_text() == "mine" and (folder / "scripts" / "run.sh").exists()
    stale = (folder / "model.safetensors").exists()
    if stale:
        raise ProbeFailure("the merged model's weights stayed beside the adapter")
    return Report("done: adapter replaced the merged files, notes and scripts kept", lost=not kept)


@probe("save into a non-empty folder without overwrite")
def _(work):
    model, tokenizer, folder = saved(work)
    return refused(
        lambda: model.save_pretrained_merged(folder, tokenizer), FileExistsError, "overwrite=True", folder
    )


@probe("save_pretrained_merged over the base checkpoint it was loaded from")
def _(work):
    from slothkit.testing import tiny_model_path

    model, tokenizer = lora_model()
    base = tiny_model_path("llama")
    return refused(
        lambda: model.save_pretrained_merged(base, tokenizer, overwrite=True),
        ValueError,
        "base checkpoint|which this",
        base,
    )


@probe("save with save_method='gguf' (a misspelt method)")
def _(work):
    model, tokenizer = lora_model()
    return refused(
        lambda: model.save_pretrained_merged(work / "x", tokenizer, save_method="gguf"),
        ValueError,
        "save_pretrained_gguf",
    )


@probe("save with dtype='float64'")
def _(work):
    model, tokenizer = lora_model()
    return refused(
        lambda: model.save_pretrained_merged(work / "x", tokenizer, dtype="float64"), ValueError, "accepted"
    )


@probe("disk fills mid-save (patched safetensors writer)")
def _(work):
    import safetensors.torch

    model, tokenizer, folder = saved(work)

    def disk_full(tensors, filename, metadata=None):
        pathlib.Path(filename).write_bytes(b"\0" * 4096)
        raise OSError(errno.ENOSPC, "No space left on device", str(filename))

    safetensors.torch.save_file = disk_full
    report = refused(
        lambda: model.save_pretrained_merged(folder, tokenizer, overwrite=True),
        OSError,
        "No space left",
        folder,
    )
    report.lost |= bool(list(work.glob(".out.partial-*")))
    return report


@probe("read-only filesystem (EROFS)")
def _(work):
    from slothkit.export import atomic

    model, tokenizer = lora_model()
    (work / "kept.txt").write_text("x")

    def read_only(*args, **kwargs):
        raise OSError(errno.EROFS, "Read-only file system", str(work))

    atomic.tempfile.mkdtemp = read_only
    return refused(
        lambda: model.save_pretrained_merged(work / "out", tokenizer, save_method="lora"),
        OSError,
        "Read-only",
        work,
    )


@probe("a save too large for the free disk space (patched disk_usage)")
def _(work):
    model, tokenizer, folder = saved(work)
    disk_with_free(50_000)
    return refused(
        lambda: model.save_pretrained_merged(folder, tokenizer, overwrite=True),
        OSError,
        r"needs about .* are free",
        folder,
    )


@probe("kill -9 mid-save, then save again", timeout_s=180)
def _(work):
    from slothkit.export.atomic import atomic_directory

    target = work / "out"
    target.mkdir()
    (target / "model.safetensors").write_bytes(b"previous")
    ready = work / "ready"
    code = textwrap.dedent(
        """
        import pathlib, sys, time
        from slothkit.export.atomic import atomic_directory
        with atomic_directory(sys.argv[1], overwrite=True) as staging:
            (staging / "model.safetensors").write_bytes(b"\\0" * 3_000_000)
            pathlib.Path(sys.argv[2]).write_text("ready")
            time.sleep(120)
        """
    )
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)}
    process = subprocess.Popen([sys.executable, "-c", code, str(target), str(ready)], env=env)
    deadline = time.monotonic() + 60
    while not ready.exists():
        if process.poll() is not None or time.monotonic() > deadline:
            process.kill()
            raise ProbeFailure("the saving subprocess did not start")
        time.sleep(0.05)
    process.send_signal(signal.SIGKILL)
    process.wait()
    lost = (target / "model.safetensors").read_bytes() != b"previous"
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with atomic_directory(target, overwrite=True) as staging:
            (staging / "model.safetensors").write_bytes(b"new")
    left = list(work.glob(".out.partial-*"))
    cleaned = [str(w.message) for w in caught if "removed what interrupted saves left" in str(w.message)]
    if left or not cleaned:
        raise ProbeFailure(f"leftovers {left} not cleaned (warnings: {cleaned})")
    return Report(f"done: earlier save intact; next save {one_line(cleaned[0], 'warning')}", lost=lost)


@probe("NaN weights in a merged save")
def _(work):
    import torch

    model, tokenizer, folder = saved(work, "merged_16bit")
    with torch.no_grad():
        next(p for n, p in model.named_parameters() if "lora_B" in n).view(-1)[0] = float("nan")
    return refused(
        lambda: model.save_pretrained_merged(folder, tokenizer, overwrite=True),
        ValueError,
        r"\(NaN\)",
        folder,
    )


@probe("weights beyond float16's range saved as float16")
def _(work):
    import torch

    model, tokenizer = lora_model()
    with torch.no_grad():
        model.base_model.model.model.norm.weight[0] = 1e6
    return refused(
        lambda: model.save_pretrained_merged(work / "x", tokenizer, dtype=torch.float16),
        ValueError,
        "float16's range",
    )


@probe("saved folder permissions under umask 022")
def _(work):
    from slothkit.export.atomic import atomic_directory

    previous = os.umask(0o022)
    try:
        with atomic_directory(work / "out") as staging:
            (staging / "w.bin").write_bytes(b"w")
    finally:
        os.umask(previous)
    mode = (work / "out").stat().st_mode & 0o777
    if mode != 0o755:
        raise ProbeFailure(f"folder mode {oct(mode)}, expected 0o755")
    return Report("done: folder 0755 as transformers makes it")


# ---------------------------------------------------------------------------------------
# GGUF
# ---------------------------------------------------------------------------------------


@probe("GGUF export of NaN weights over an earlier export")
def _(work):
    import torch

    from slothkit.export.gguf import save_pretrained_gguf

    model, tokenizer = plain_model()
    save_pretrained_gguf(model, work / "gguf", tokenizer, "q8_0", verify=False)
    with torch.no_grad():
        model.model.layers[0].mlp.down_proj.weight[0, 0] = float("inf")
    return refused(
        lambda: save_pretrained_gguf(model, work / "gguf", tokenizer, "q8_0", verify=False, overwrite=True),
        ValueError,
        r"\(Inf\)",
        work / "gguf",
    )


@probe("q4_k_m export of a model whose rows are not multiples of 256")
def _(work):
    from slothkit.export.gguf import save_pretrained_gguf

    model, tokenizer = plain_model()
    return warned(
        lambda: save_pretrained_gguf(model, work / "q4", tokenizer, "q4_k_m", verify=False), "fell back"
    )


@probe("GGUF of a LoRA model: file name and general.name")
def _(work):
    import gguf

    from slothkit.testing import tiny_model_path

    model, tokenizer = lora_model()
    path = model.save_pretrained_gguf(work / "gguf", tokenizer, quantization_method="q8_0", verify=False)[0]
    name = gguf.GGUFReader(path).fields["general.name"].contents()
    expected = tiny_model_path("llama").name
    if path.name != f"{expected}.Q8_0.gguf" or name != expected:
        raise ProbeFailure(f"named {path.name}, general.name {name!r}; expected the base's name {expected!r}")
    return Report(f"done: {path.name}, general.name {name!r}")


@probe("GGUF with an unknown quantisation 'q3_k_s'")
def _(work):
    from slothkit.export.gguf import save_pretrained_gguf

    model, tokenizer = plain_model()
    return refused(lambda: save_pretrained_gguf(model, work / "g", tokenizer, "q3_k_s"), ValueError, "valid:")


@probe("GGUF of the same quantisation again without overwrite")
def _(work):
    from slothkit.export.gguf import save_pretrained_gguf

    model, tokenizer = plain_model()
    save_pretrained_gguf(model, work / "g", tokenizer, "q8_0", verify=False)
    return refused(
        lambda: save_pretrained_gguf(model, work / "g", tokenizer, "q8_0", verify=False),
        FileExistsError,
        "already holds",
        work / "g",
    )


@probe("disk fills inside the GGUF writer")
def _(work):
    import gguf

    from slothkit.export.gguf import save_pretrained_gguf

    model, tokenizer = plain_model()
    save_pretrained_gguf(model, work / "g", tokenizer, "f16", verify=False)
    real, calls = gguf.GGUFWriter.write_tensor_data, []

    def fills_up(self, tensor, *args, **kwargs):
        calls.append(1)
        if len(calls) > 3:
            raise OSError("12288 requested and 8392 written")
        return real(self, tensor, *args, **kwargs)

    gguf.GGUFWriter.write_tensor_data = fills_up
    return refused(
        lambda: save_pretrained_gguf(model, work / "g", tokenizer, "q8_0", verify=False),
        OSError,
        r"no space left in .* needs about .* were free",
        work / "g",
    )


@probe("GGUF export too large for the free disk space")
def _(work):
    from slothkit.export.gguf import save_pretrained_gguf

    model, tokenizer = plain_model()
    disk_with_free(10_000)
    return refused(
        lambda: save_pretrained_gguf(model, work / "g", tokenizer, "q8_0", verify=False), OSError, "are free"
    )


# ---------------------------------------------------------------------------------------
# The Hub
# ---------------------------------------------------------------------------------------


@contextlib.contextmanager
def local_hub(work: pathlib.Path):
    from huggingface_hub import constants

    from slothkit.testing.local_hub import LocalHub

    os.environ.pop("HF_TOKEN", None)
    constants.HF_TOKEN_PATH = str(work / "no-token")
    constants.HF_HUB_OFFLINE = False
    hub = LocalHub(tokens={"hf_writer": ("local-user", "write"), "hf_reader": ("local-user", "read")})
    with hub, hub.patched_client():
        yield hub


def pushed_folder(work: pathlib.Path) -> pathlib.Path:
    model, tokenizer = lora_model()
    model.save_pretrained_merged(work / "export", tokenizer, save_method="lora")
    return work / "export"


@probe("Hub push to a server that stops answering mid-upload", timeout_s=90)
def _(work):
    from slothkit.export import push_folder_to_hub

    folder = pushed_folder(work)
    with local_hub(work) as hub:
        hub.stall_next("POST", r"/commit/", seconds=60, times=2)
        report = refused(
            lambda: push_folder_to_hub(
                folder,
                "local-user/x",
                token="hf_writer",
                endpoint=hub.endpoint,
                retries=1,
                retry_wait_s=0,
                timeout_s=0.5,
            ),  # fmt: skip
            ConnectionError,
            "ReadTimeout",
        )
        report.lost = set(hub.files("local-user/x")) != {".gitattributes"}
    return report


@probe("Hub push whose client is rebuilt mid-push, then stalls", timeout_s=90)
def _(work):
    import huggingface_hub

    from slothkit.export import push_folder_to_hub

    folder = pushed_folder(work)
    create_repo = huggingface_hub.HfApi.create_repo

    def and_drop_the_client(self, *args, **kwargs):
        result = create_repo(self, *args, **kwargs)
        huggingface_hub.close_session()
        return result

    huggingface_hub.HfApi.create_repo = and_drop_the_client
    with local_hub(work) as hub:
        hub.stall_next("POST", r"/commit/", seconds=60)
        return refused(
            lambda: push_folder_to_hub(
                folder, "local-user/y", token="hf_writer", endpoint=hub.endpoint, retries=0, timeout_s=0.5
            ),  # fmt: skip
            ConnectionError,
            "ReadTimeout",
        )


@probe("Hub push to a server answering HTTP 500", timeout_s=90)
def _(work):
    from slothkit.export import push_folder_to_hub

    folder = pushed_folder(work)
    with local_hub(work) as hub:
        hub.fail_next("POST", r"/commit/", status=500, times=10)
        return refused(
            lambda: push_folder_to_hub(
                folder,
                "local-user/z",
                token="hf_writer",
                endpoint=hub.endpoint,
                retries=1,
                retry_wait_s=0,
                timeout_s=5,
            ),  # fmt: skip
            ConnectionError,
            "HTTP 500",
        )


@probe("Hub push with nothing listening at the endpoint", timeout_s=60)
def _(work):
    import socket

    from huggingface_hub import constants

    from slothkit.export import push_folder_to_hub

    constants.HF_HUB_OFFLINE = False
    with socket.socket() as unused:
        unused.bind(("127.0.0.1", 0))
        port = unused.getsockname()[1]
    folder = pushed_folder(work)
    return refused(
        lambda: push_folder_to_hub(
            folder, "me/x", token="hf_x", endpoint=f"http://127.0.0.1:{port}", timeout_s=2
        ),
        ConnectionError,
        f"127.0.0.1:{port}",
    )


@probe("Hub push with a read-only token", timeout_s=60)
def _(work):
    from slothkit.export import push_folder_to_hub

    folder = pushed_folder(work)
    with local_hub(work) as hub:
        return refused(
            lambda: push_folder_to_hub(folder, "local-user/r", token="hf_reader", endpoint=hub.endpoint),
            PermissionError,
            "read-only",
        )


@probe("Hub push with no token at all", timeout_s=60)
def _(work):
    from slothkit.export import push_folder_to_hub

    folder = pushed_folder(work)
    with local_hub(work) as hub:
        return refused(
            lambda: push_folder_to_hub(folder, "local-user/n", endpoint=hub.endpoint),
            PermissionError,
            "no Hugging Face token",
        )


# ---------------------------------------------------------------------------------------
# The command line
# ---------------------------------------------------------------------------------------


@probe("slothkit export A --to merged_16bit --output A --overwrite")
def _(work):
    adapter = saved_adapter(work)
    return cli(
        ["export", str(adapter), "--to", "merged_16bit", "--output", str(adapter), "--overwrite"],
        2,
        "adapter",
        adapter,
    )


@probe("slothkit export --output the base model folder --overwrite")
def _(work):
    import json as json_module

    adapter = saved_adapter(work)
    base = json_module.loads((adapter / "adapter_config.json").read_text())["base_model_name_or_path"]
    return cli(
        ["export", str(adapter), "--to", "merged_16bit", "--output", base, "--overwrite"],
        2,
        "base model",
        pathlib.Path(base),
    )


@probe("slothkit export --quant q4_k_m,q3_k_s (one unknown)")
def _(work):
    adapter = saved_adapter(work)
    return cli(["export", str(adapter), "--to", "gguf", "--quant", "q4_k_m,q3_k_s"], 2, "valid:", adapter)


@probe("slothkit export --push 'not a repo id!'")
def _(work):
    adapter = saved_adapter(work)
    return cli(["export", str(adapter), "--to", "lora", "--push", "not a repo id!"], 2, "not a Hub repo id")


@probe("slothkit export into a non-empty folder without --overwrite")
def _(work):
    adapter = saved_adapter(work)
    (work / "out").mkdir()
    (work / "out" / "mine.txt").write_text("x")
    return cli(
        ["export", str(adapter), "--to", "merged_16bit", "--output", str(work / "out")],
        2,
        "--overwrite",
        work / "out",
    )


@probe("slothkit export of an adapter whose base folder is gone")
def _(work):
    adapter = work / "adapter"
    adapter.mkdir()
    (adapter / "adapter_config.json").write_text(json.dumps({"base_model_name_or_path": str(work / "gone")}))
    (adapter / "adapter_model.safetensors").write_bytes(b"")
    return cli(["export", str(adapter), "--to", "merged_16bit"], 2, r"pass --base-model PATH$")


@probe("slothkit export of a folder without adapter weights")
def _(work):
    adapter = work / "adapter"
    adapter.mkdir()
    (adapter / "adapter_config.json").write_text("{}")
    return cli(["export", str(adapter), "--to", "lora"], 2, "no adapter weights")


@probe("slothkit export --too gguf (a misspelt option)")
def _(work):
    return cli(["export", str(work), "--too", "gguf"], 2, "required|unrecognized")


@probe("slothkit export --to gguf too large for the free disk space")
def _(work):
    adapter = saved_adapter(work)
    disk_with_free(10_000)
    return cli(["export", str(adapter), "--to", "gguf", "--output", str(work / "g")], 1, "are free")


def _cli_plan_probes():
    for args, pattern in (
        (["--seq", "0"], "seq=0"),
        (["--seq", "-2048"], "seq=-2048"),
        (["--batch", "0"], "batch=0"),
        (["--batch", "-1"], "batch=-1"),
        (["--rank", "0"], "rank=0"),
        (["--gpu", "no-such-gpu"], "no-such-gpu"),
    ):
        probe(f"slothkit plan llama-3-8b {' '.join(args)}")(
            lambda work, args=args, pattern=pattern: cli(["plan", "llama-3-8b", *args], 2, pattern)
        )
    probe("slothkit plan no-such-model")(lambda work: cli(["plan", "no-such-model"], 2, "no-such-model"))


_cli_plan_probes()


@probe("slothkit new-notebook --set max_seq_length=abc")
def _(work):
    report = cli(
        ["new-notebook", "llama-3-8b", "-o", str(work / "nb"), "--set", "max_seq_length=abc"],
        2,
        "positive integer",
    )
    if list(work.iterdir()):
        raise ProbeFailure("a notebook was written anyway")
    return report


@probe("slothkit demo --template bogus")
def _(work):
    return cli(["demo", "--template", "bogus"], 2, "invalid choice")


# ---------------------------------------------------------------------------------------
# Models, checkpoints and data
# ---------------------------------------------------------------------------------------


@probe("get_peft_model(target_modules=['q_proj', 'v_prj'])")
def _(work):
    from slothkit import FastModel
    from slothkit.testing import tiny_model_path

    model, _ = FastModel.from_pretrained(str(tiny_model_path("llama")), load_in_4bit=False)
    return refused(
        lambda: FastModel.get_peft_model(model, target_modules=["q_proj", "v_prj"]), ValueError, "v_prj"
    )


@probe("get_peft_model(lora_alpha=0)")
def _(work):
    from slothkit import FastModel
    from slothkit.testing import tiny_model_path

    model, _ = FastModel.from_pretrained(str(tiny_model_path("llama")), load_in_4bit=False)
    return refused(lambda: FastModel.get_peft_model(model, lora_alpha=0), ValueError, "lora_alpha")


@probe("get_peft_model(r=10**6) on a 64-wide model")
def _(work):
    from slothkit import FastModel
    from slothkit.testing import tiny_model_path

    model, _ = FastModel.from_pretrained(str(tiny_model_path("llama")), load_in_4bit=False)
    return refused(lambda: FastModel.get_peft_model(model, r=10**6), ValueError, r"\br\b")


@probe("FastModel.from_pretrained of a folder with an invalid config.json")
def _(work):
    from slothkit import FastModel

    folder = checkpoint_copy(work)
    (folder / "config.json").write_text("{not json")
    return refused(lambda: FastModel.from_pretrained(str(folder)), ValueError, "not valid JSON", folder)


@probe("FastModel.from_pretrained of a cut-short model.safetensors")
def _(work):
    from slothkit import FastModel

    folder = checkpoint_copy(work)
    (folder / "model.safetensors").write_bytes(b"\x10\x00")
    return refused(
        lambda: FastModel.from_pretrained(str(folder)), ValueError, "not a complete safetensors file"
    )


@probe("FastModel.from_pretrained of an unreadable model.safetensors (EACCES)")
def _(work):
    import builtins

    from slothkit import FastModel
    from slothkit.engine import loading

    folder = checkpoint_copy(work)
    weights = str(folder / "model.safetensors")

    def denied(path, *args, **kwargs):  # root reads any file; a user without the right does not
        if os.fspath(path) == weights:
            raise PermissionError(errno.EACCES, "Permission denied", weights)
        return builtins.open(path, *args, **kwargs)

    loading.open = denied
    return refused(lambda: FastModel.from_pretrained(str(folder)), PermissionError, "Permission denied")


@probe("load_data of an empty .jsonl")
def _(work):
    from slothkit.data import load_data

    (work / "train.jsonl").write_text("")
    return refused(lambda: load_data(str(work / "train.jsonl")), ValueError, "is empty")


@probe("load_data of a missing file")
def _(work):
    from slothkit.data import load_data

    return refused(lambda: load_data(str(work / "nope.jsonl")), FileNotFoundError, "no such data file")


@probe("sft_trainer given a plain list of strings")
def _(work):
    from slothkit.trainers import sft_config, sft_trainer

    os.chdir(work)
    model, tokenizer = lora_model()
    return refused(
        lambda: sft_trainer(model, tokenizer, ["a", "b"], args=sft_config(model, output_dir=str(work / "o"))),
        ValueError,
        "records must be dicts",
    )


@probe("sft_trainer given a plain list of dicts")
def _(work):
    import datasets

    from slothkit.trainers import sft_config, sft_trainer

    os.chdir(work)
    model, tokenizer = lora_model()
    records = [{"text": f"record {i}"} for i in range(3)]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer = sft_trainer(model, tokenizer, records, args=sft_config(model, output_dir=str(work / "o")))
    if not isinstance(trainer.train_dataset, datasets.Dataset):
        raise ProbeFailure(f"train_dataset is {type(trainer.train_dataset).__name__}")
    return Report("done: converted to a datasets.Dataset")


# ---------------------------------------------------------------------------------------
# Running them
# ---------------------------------------------------------------------------------------


def _run_one(index: int, work: str, queue) -> None:
    function = PROBES[index][1]  # by index: the probes' functions are all called `_`
    os.environ.setdefault("HF_HUB_OFFLINE", "1")  # the real Hub is never reached
    os.environ["HF_HUB_DISABLE_XET"] = "1"
    os.environ["HF_HUB_DISABLE_PROGRESS_BARS"] = "1"
    try:
        import transformers

        transformers.utils.logging.disable_progress_bar()
        os.chdir(work)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", FutureWarning)
            report = function(pathlib.Path(work))
        queue.put(("ok", report.outcome, report.lost, report.silent))
    except BaseException as error:  # noqa: BLE001 - every unexpected exception is a finding
        detail = f"{type(error).__name__}: {error}".splitlines()[0][:200]
        queue.put(("failed", detail, False, False, traceback.format_exc()))


def run(selected: list[int], verbose: bool) -> int:
    # Each probe runs in a fresh process from a fork server that imported the heavy
    # modules once and started no threads: a plain fork of a process that has run torch or
    # transformers can deadlock on a lock some thread held.
    context = multiprocessing.get_context("forkserver")
    context.set_forkserver_preload(
        ["torch", "transformers", "peft", "slothkit.export", "slothkit.export.gguf"]
    )
    counts = {"failed": 0, "lost": 0, "hung": 0, "silent": 0}
    width = max(len(PROBES[i][0]) for i in selected)
    for index in selected:
        name, _, timeout_s = PROBES[index]
        with tempfile.TemporaryDirectory(prefix="slothkit-probe-") as work:
            queue = context.Queue()
            process = context.Process(target=_run_one, args=(index, work, queue))
            process.start()
            process.join(timeout_s)
            hung = process.is_alive()
            if hung:
                process.kill()
                process.join()
                result = ("failed", f"no answer within {timeout_s:.0f} s", False, False)
            elif queue.empty():
                result = ("failed", f"the probe process died (exit {process.exitcode})", False, False)
            else:
                result = queue.get()
        status, outcome, lost, silent = result[:4]
        failed = status == "failed"
        counts["failed"] += failed
        counts["lost"] += lost
        counts["hung"] += hung
        counts["silent"] += silent
        text = f"FAILED: {outcome}" if failed else outcome
        yes = {True: "yes", False: "no"}
        print(
            f"{name:<{width}}  | {text[:150]:<150} | data lost: {yes[bool(lost)]:<3} | hung: {yes[hung]:<3} "
            f"| silently accepted: {yes[bool(silent)]}",
            flush=True,
        )
        if failed and verbose and len(result) > 4:
            print(textwrap.indent(result[4], "    "), flush=True)
    print(
        f"{len(selected)} probes: {counts['lost']} data loss, {counts['hung']} hangs, "
        f"{counts['silent']} silent acceptance, {counts['failed']} unexpected failures"
    )
    return 1 if any(counts.values()) else 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("-k", default="", help="run only the probes whose name holds this text")
    parser.add_argument("--verbose", action="store_true", help="print the traceback of a failed probe")
    args = parser.parse_args(argv)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")  # the real Hub is never reached
    os.environ["HF_HUB_DISABLE_XET"] = "1"
    selected = [i for i, (name, _, _) in enumerate(PROBES) if args.k.lower() in name.lower()]
    if not selected:
        parser.error(f"no probe name holds {args.k!r}")
    return run(selected, args.verbose)


if __name__ == "__main__":
    sys.exit(main())
