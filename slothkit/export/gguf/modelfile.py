"""The Ollama Modelfile written beside a GGUF file; its text is slothkit.data.ollama_templates'
render_modelfile (the chat format as a Go template, and the stop tokens)."""

from __future__ import annotations

import os
import pathlib

from slothkit.data.ollama_templates import render_modelfile


def write_modelfile(
    path: str | os.PathLike, gguf_file: str, tokenizer, stop_token_ids: list[int] | None = None
) -> pathlib.Path:
    path = pathlib.Path(path)
    path.write_text(render_modelfile(gguf_file, tokenizer, stop_token_ids), encoding="utf-8")
    return path
