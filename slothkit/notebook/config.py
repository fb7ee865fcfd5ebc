"""The notebook's settings: Colab form fields, an ipywidgets panel, environment overrides.

The config cell of every notebook assigns plain variables (which Colab shows as a
form through its ``# @param`` comments) and hands them to
``NotebookConfig.from_cell(globals())``.  Every field can then be overridden by an
environment variable ``SLOTHKIT_<FIELD>`` (how the tests point a notebook at a
tiny offline model and a local Hub), and in Jupyter or Kaggle ``config.panel()``
shows the same fields as ipywidgets (7 or 8) that write back into the config.
A field whose default is None belongs to some notebooks only (the GRPO notebook's
generation settings); the others neither show it nor need it.
"""

from __future__ import annotations

import dataclasses
import os


@dataclasses.dataclass
class NotebookConfig:
    model_name: str
    load_in_4bit: bool = True
    max_seq_length: int = 2048
    lora_r: int = 16
    lora_alpha: int = 16
    learning_rate: float = 2e-4
    max_steps: int = 60
    batch_size: int = 2
    grad_accum: int = 4
    dataset: str = "example:alpaca"
    chat_template: str = ""
    # GRPO: completions sampled per prompt (the group each is compared with), and the
    # longest completion in tokens.  None in the notebooks that do not generate.
    num_generations: int | None = None
    max_completion_length: int | None = None
    save_lora: bool = True
    save_merged: bool = False
    save_gguf: bool = False
    gguf_quants: str = "q4_k_m,q8_0"  # comma-separated; parsed by slothkit.export.gguf.quantization_methods
    output_dir: str = "outputs"
    hub_repo: str = ""
    hub_token: str = dataclasses.field(default="", repr=False)  # a secret: never printed

    @classmethod
    def field_names(cls) -> list[str]:
        return [f.name for f in dataclasses.fields(cls)]

    @classmethod
    def from_cell(cls, namespace: dict, environ=None) -> NotebookConfig:
        """Read UPPER_CASE variables of the config cell, then SLOTHKIT_* overrides."""
        environ = os.environ if environ is None else environ
        values = {}
        for field in dataclasses.fields(cls):
            if field.name.upper() in namespace:
                values[field.name] = namespace[field.name.upper()]
        if "model_name" not in values and "SLOTHKIT_MODEL_NAME" not in environ:
            raise ValueError("the config cell must set MODEL_NAME")
        for field in dataclasses.fields(cls):
            key = f"SLOTHKIT_{field.name.upper()}"
            if key in environ:
                values[field.name] = _parse(field, environ[key], key)
        config = cls(**values)
        config.validate()
        return config

    def validate(self) -> None:
        for name in ("max_seq_length", "lora_r", "lora_alpha", "max_steps", "batch_size", "grad_accum"):
            value = getattr(self, name)
            if not _positive_int(value):
                raise ValueError(f"{name.upper()} = {value!r}; expected a positive integer")
        if not self.learning_rate > 0:
            raise ValueError(f"LEARNING_RATE = {self.learning_rate!r}; expected a positive number")
        if self.save_gguf:  # refused here, not after the training run, in the save cell
            from slothkit.export.gguf import quantization_methods

            try:
                quantization_methods(self.gguf_quants)
            except ValueError as error:
                raise ValueError(f"GGUF_QUANTS = {self.gguf_quants!r}: {error}") from None
        if self.max_completion_length is not None and not _positive_int(self.max_completion_length):
            raise ValueError(
                f"MAX_COMPLETION_LENGTH = {self.max_completion_length!r}; expected a positive integer"
            )
        if self.num_generations is not None:
            if not _positive_int(self.num_generations) or self.num_generations < 2:
                raise ValueError(
                    f"NUM_GENERATIONS = {self.num_generations!r}; expected an integer of at least 2 "
                    "(GRPO scores each completion against the others of its prompt)"
                )
            completions = self.batch_size * self.grad_accum
            if completions % self.num_generations:
                raise ValueError(
                    f"BATCH_SIZE x GRAD_ACCUM = {completions} completions per step is not a multiple of "
                    f"NUM_GENERATIONS = {self.num_generations}: each step trains whole groups of a "
                    "prompt's completions"
                )

    def panel(self):
        """An ipywidgets form bound to this config (Jupyter, Kaggle); None if widgets are missing."""
        try:
            import ipywidgets as widgets
        except ImportError:
            return None
        rows = []
        for field in self._shown_fields():
            kind = _kind(field)
            if field.name == "hub_token":
                widget = widgets.Password(value=self.hub_token, description="hub_token")
            elif kind == "bool":
                widget = widgets.Checkbox(value=getattr(self, field.name), description=field.name)
            elif kind == "int":
                widget = widgets.IntText(value=getattr(self, field.name), description=field.name)
            elif kind == "float":
                widget = widgets.FloatText(value=getattr(self, field.name), description=field.name)
            else:
                widget = widgets.Text(value=str(getattr(self, field.name)), description=field.name)
            widget.observe(self._setter(field.name), names="value")
            rows.append(widget)
        return widgets.VBox(rows)

    def _shown_fields(self) -> list:
        """The fields this notebook uses: all but those left at None (module docstring)."""
        return [field for field in dataclasses.fields(self) if getattr(self, field.name) is not None]

    def _setter(self, name):
        def update(change):
            setattr(self, name, change["new"])

        return update

    def show(self) -> None:
        """Print the settings the next cells will use; in Jupyter and Kaggle also display the
        panel to change them (Colab shows its form instead).  The printed copy is what a
        saved or exported notebook shows of the run: a widget keeps no state there."""
        from slothkit.notebook.runtime import detect_runtime

        panel = self.panel() if detect_runtime() != "colab" else None
        if panel is not None:
            try:
                from IPython.display import display

                display(panel)
            except ImportError:
                pass
        fields = self._shown_fields()
        width = max(len(field.name) for field in fields) + 1
        for field in fields:
            value = "***" if field.name == "hub_token" and self.hub_token else getattr(self, field.name)
            print(f"{field.name:{width}s} {value}")


def _positive_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value > 0


def _kind(field) -> str:
    """The field's type name, an optional's without its None: "int | None" -> "int"."""
    kind = field.type if isinstance(field.type, str) else field.type.__name__
    return kind.removesuffix(" | None")


def _parse(field, text: str, key: str):
    kind = _kind(field)
    try:
        if kind == "bool":
            lowered = text.strip().lower()
            if lowered not in ("1", "0", "true", "false", "yes", "no"):
                raise ValueError
            return lowered in ("1", "true", "yes")
        if kind == "int":
            return int(text)
        if kind == "float":
            return float(text)
    except ValueError:
        raise ValueError(f"{key}={text!r} is not a valid {kind}") from None
    return text
