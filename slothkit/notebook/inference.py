"""The notebook's try-it cell: the model's answers to the test prompts before and after
training, side by side (the cells themselves build the prompts and call generate)."""

from __future__ import annotations


def compare_answers(before: dict, after: dict, width: int = 100) -> None:
    """Print each prompt with its answer before and after training, one line each (line
    breaks shown as " / ", long answers cut at `width` characters)."""

    def one_line(text: str) -> str:
        text = " / ".join(line.strip() for line in text.strip().splitlines() if line.strip())
        return text if len(text) <= width else text[: width - 3] + "..."

    for prompt, answer in after.items():
        print(prompt)
        print(f"  before: {one_line(before.get(prompt, '(not asked)'))}")
        print(f"  after:  {one_line(answer)}")
