"""Render notebook templates (templates/, the ``slothkit_templates`` package) for a model.

A template is a jupytext percent-format .py file with ``${key}`` placeholders;
the values come from templates/models.json (what differs between the models'
notebooks, as data) plus ``--set key=value`` overrides.  Output: an .ipynb and
its paired percent-format .py, without outputs.

A model's key in models.json is a named shape (slothkit.models.SHAPES): one an
architecture record names (``architecture_of(model)``, the fused path's family), or a
generic-path shape (slothkit.models.generic_shapes: Qwen3-MoE, gpt-oss), which has no record
and whose ``shape_of(model).model_type`` says what the notebook's model is.
"""

from __future__ import annotations

import json
import re
import string
from importlib import resources
from pathlib import Path

TEMPLATES = {
    "finetune": "base fine-tune on instruction data (Alpaca format)",
    "conversational": "chat fine-tune with the model's chat template, trained on replies only",
    "dpo": "preference tuning with DPO (prompt, chosen, rejected)",
    "grpo": "reinforcement learning with GRPO (prompts, scored by reward functions)",
    "vision": "image-text fine-tune with FastVisionModel (images with their answers; vision_models.json)",
}
# Templates whose models are image-text checkpoints: their values come from
# templates/vision_models.json, keyed by notebook model name like models.json.
IMAGE_TEXT_TEMPLATES = ("vision",)


def _package_file(name: str):
    return resources.files("slothkit_templates").joinpath(name)


def model_data() -> dict[str, dict]:
    """The text models' notebook data (templates/models.json), keyed by named shape."""
    return json.loads(_package_file("models.json").read_text())


def vision_model_data() -> dict[str, dict]:
    """The image-text models' notebook data (templates/vision_models.json): Hub ids, the
    image-text config's model_type, T4 batch sizes and where the defaults fit, for the
    templates of IMAGE_TEXT_TEMPLATES; and save_gguf, SAVE_GGUF's default, which is not
    stored there but asked of the GGUF writer (slothkit.export.gguf.image_text.writes_gguf):
    on where slothkit writes the family's GGUF and projector file, so that a family's
    notebook offers it as soon as its writer does."""
    from slothkit.export.gguf.image_text import writes_gguf

    records = json.loads(_package_file("vision_models.json").read_text())
    for record in records.values():
        record["save_gguf"] = writes_gguf(record["model_type"])
    return records


def models_for(template: str) -> dict[str, dict]:
    """The models a template renders for: the image-text ones for IMAGE_TEXT_TEMPLATES, the
    text ones (models.json) for the others."""
    return vision_model_data() if template in IMAGE_TEXT_TEMPLATES else model_data()


def shape_of(model: str):
    """The named shape (slothkit.models.Shape) of a notebook model: its real config's sizes."""
    from slothkit.models import shape_by_name

    models = model_data()
    if model not in models:
        raise ValueError(f"unknown model {model!r}; valid models: {', '.join(models)}")
    return shape_by_name(model)


def architecture_of(model: str):
    """The architecture record (slothkit.models.Architecture) of a notebook model, or None for
    a model that trains on the generic path (a shape of slothkit.models.generic_shapes)."""
    from slothkit.models import architecture_of_shape
    from slothkit.models.generic_shapes import GENERIC_SHAPES

    shape_of(model)  # an unknown model is refused with the valid ones
    if model in GENERIC_SHAPES:
        return None
    return architecture_of_shape(model)


def family_of(model: str) -> str:
    """The family name of a notebook model: its record's name ("qwen3"), else its
    transformers model_type ("gpt_oss")."""
    record = architecture_of(model)
    return record.name if record is not None else shape_of(model).model_type


INCLUDE = re.compile(r"^# %include (\w+)$", re.MULTILINE)


def template_text(template: str) -> str:
    """The template with its ``# %include NAME`` lines replaced by templates/_NAME.py:
    cells every workflow shares (install, hardware, save) are written once."""
    if template not in TEMPLATES:
        raise ValueError(f"unknown template {template!r}; valid templates: {', '.join(TEMPLATES)}")
    text = _package_file(f"{template}.py").read_text()
    return INCLUDE.sub(lambda m: _package_file(f"_{m.group(1)}.py").read_text().rstrip("\n"), text)


def parse_overrides(pairs: list[str] | None, valid_keys, defaults: dict | None = None) -> dict[str, str]:
    """``--set key=value`` pairs as {key: value}.

    Args:
        pairs: the KEY=VALUE strings.
        valid_keys: the keys a model's record has.
        defaults: the model's record; a key whose default is an integer takes a positive
            integer only (it is written into the notebook as code).

    Raises:
        ValueError: a pair without "=", an unknown key, or a value of the wrong kind.
    """
    overrides = {}
    for pair in pairs or []:
        key, sep, value = pair.partition("=")
        if not sep:
            raise ValueError(f"--set {pair!r}: expected key=value")
        if key not in valid_keys:
            raise ValueError(f"--set {key}: unknown key; valid keys: {', '.join(sorted(valid_keys))}")
        default = (defaults or {}).get(key)
        if isinstance(default, int) and not isinstance(default, bool):
            if not value.strip().isdigit() or int(value) <= 0:
                raise ValueError(f"--set {key}={value}: expected a positive integer such as {default}")
            value = str(int(value))
        overrides[key] = value
    return overrides


def values_for(model: str, overrides: dict | None = None, template: str = "finetune") -> dict:
    models = models_for(template)
    if model not in models:
        raise ValueError(
            f"unknown model {model!r} for the {template} template; valid models: {', '.join(models)}"
        )
    values = {"model_key": model, **models[model]}
    values.update(overrides or {})
    return values


def render_text(template: str, model: str, overrides: dict | None = None) -> str:
    """The template's percent-format source with the model's values filled in."""
    try:
        return string.Template(template_text(template)).substitute(values_for(model, overrides, template))
    except KeyError as error:
        raise ValueError(
            f"template {template!r} needs a value for {error}, which models.json does not give for {model!r}"
        ) from None


CONFIG_LINE = re.compile(r"^(?P<name>[A-Z][A-Z0-9_]*) = (?P<value>.*?)(?P<form>  # @param.*)$", re.MULTILINE)


def with_config_values(text: str, values: dict | None) -> str:
    """`text` with the config cell's ``NAME = value  # @param ...`` lines set to `values`
    (``{"MAX_STEPS": 24, ...}``, written as Python literals): a notebook whose config
    cell shows what it runs with.  A name the config cell does not have is refused."""
    values = dict(values or {})
    unknown = set(values) - {match["name"] for match in CONFIG_LINE.finditer(text)}
    if unknown:
        raise ValueError(f"the config cell has no {', '.join(sorted(unknown))}")

    def replace(match):
        if match["name"] not in values:
            return match[0]
        return f"{match['name']} = {values[match['name']]!r}{match['form']}"

    return CONFIG_LINE.sub(replace, text)


def render_notebook(template: str, model: str, overrides: dict | None = None, config_values=None):
    import jupytext

    text = with_config_values(render_text(template, model, overrides), config_values)
    notebook = jupytext.reads(text, fmt="py:percent")
    notebook.cells = _with_step_headings(notebook.cells)
    for index, cell in enumerate(notebook.cells):
        cell.id = f"{template}-{index:02d}"  # stable ids: re-rendering changes nothing
    return notebook


def _with_step_headings(cells: list) -> list:
    """A numbered markdown heading before every titled code cell (``# %% Title`` in the
    template), so the steps show as sections in Jupyter, Colab's table of contents and
    the HTML export; the title moves from the cell's metadata into the heading."""
    import nbformat

    result, step = [], 0
    for cell in cells:
        title = cell.metadata.pop("title", None) if cell.cell_type == "code" else None
        if title:
            step += 1
            result.append(nbformat.v4.new_markdown_cell(f"## {step}. {title}"))
        result.append(cell)
    return result


def write_notebook(
    template: str,
    model: str,
    output: str | Path,
    overrides=None,
    overwrite: bool = False,
    config_values: dict | None = None,
) -> tuple[Path, Path]:
    """Write OUTPUT.ipynb and its paired OUTPUT.py; refuse to overwrite unless told to.

    Args:
        template: a name in TEMPLATES.
        model: a key of templates/models.json.
        output: the path of both files, without suffix (a trailing .ipynb or .py is dropped).
        overrides: values for the template's ``${key}`` placeholders (``--set``).
        overwrite: replace files an earlier call wrote.
        config_values: settings written into the config cell (``with_config_values``).
    """
    import jupytext

    output = Path(output)
    # Only a notebook's own suffix is dropped: "qwen2.5-7b-finetune" keeps its dot.
    stem = output.name.removesuffix(".ipynb").removesuffix(".py")
    notebook_path = output.with_name(stem + ".ipynb")
    script_path = output.with_name(stem + ".py")
    for path in (notebook_path, script_path):
        if path.exists() and not overwrite:
            raise FileExistsError(f"{path} exists; pass --force (overwrite=True) to replace it")
    notebook = render_notebook(template, model, overrides, config_values)
    notebook.metadata.setdefault("jupytext", {})["formats"] = "ipynb,py:percent"
    notebook_path.parent.mkdir(parents=True, exist_ok=True)
    jupytext.write(notebook, notebook_path)
    jupytext.write(notebook, script_path, fmt="py:percent")
    return notebook_path, script_path


def listing() -> str:
    lines = ["models:"]
    width = max(map(len, model_data()))
    for name, data in model_data().items():
        lines.append(
            f"  {name:{width}s} {data['display_name']}: 4-bit {data['model_4bit']}, "
            f"chat template {data['chat_template']}, max_seq_length {data['max_seq_length']}, "
            f"T4 batch {data['t4_batch']} x accumulation {data['t4_grad_accum']}"
        )
    lines.append("image-text models (--template vision):")
    width = max(map(len, vision_model_data()))
    for name, data in vision_model_data().items():
        lines.append(
            f"  {name:{width}s} {data['display_name']}: {data['model_4bit']}, "
            f"max_seq_length {data['max_seq_length']}, "
            f"T4 batch {data['t4_batch']} x accumulation {data['t4_grad_accum']}"
        )
    lines.append("templates:")
    for name, description in TEMPLATES.items():
        lines.append(f"  {name:14s} {description}")
    lines.append("keys for --set: " + ", ".join(sorted(next(iter(model_data().values())))))
    return "\n".join(lines)
