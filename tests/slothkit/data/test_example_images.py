"""The formula images shipped with slothkit: committed files equal the generator's output, the
answers are the formulas' LaTeX, and VisionDataCollator takes the records."""

import json
import random
import warnings

import numpy as np
import pytest
import torch

from slothkit.data import VisionDataCollator, example_image_dataset, example_images
from slothkit.data.example_images import (
    EXAMPLE_DIR,
    IMAGE_FOLDER,
    OCR_INSTRUCTION,
    RECORDS,
    build_example_images,
    build_formula,
    formula_latex,
    write_example_images,
)


def test_committed_files_match_the_generator():
    shipped = example_images()
    generated = build_example_images()
    assert len(shipped) == len(generated) == RECORDS
    for record, (image, latex) in zip(shipped, generated):
        assert record["text"] == latex
        assert record["image"].mode == "RGB"
        np.testing.assert_array_equal(np.asarray(record["image"]), np.asarray(image.convert("RGB")))


def test_the_images_are_small_and_distinct():
    files = sorted((EXAMPLE_DIR / IMAGE_FOLDER).glob("*.png"))
    assert len(files) == RECORDS
    assert sum(f.stat().st_size for f in files) < 64 * 1024
    lines = (EXAMPLE_DIR / f"{IMAGE_FOLDER}.jsonl").read_text().splitlines()
    assert len({json.loads(line)["text"] for line in lines}) > RECORDS * 3 // 4
    pixels = {np.asarray(record["image"]).tobytes() for record in example_images()}
    assert len(pixels) == len({json.loads(line)["text"] for line in lines})  # one picture per formula


def test_latex_marks_exponents_and_indices():
    assert formula_latex([("3x", "base"), ("2", "sup"), ("+1", "base")]) == "3x^{2}+1"
    assert formula_latex([("x", "base"), ("i", "sub"), ("=4", "base")]) == "x_{i}=4"
    rng = random.Random(0)
    for _ in range(50):
        runs = build_formula(rng)
        latex = formula_latex(runs)
        assert latex.count("{") == sum(place != "base" for _, place in runs)
        assert latex.replace("^{", "").replace("_{", "").replace("}", "") == "".join(t for t, _ in runs)


def test_a_regenerated_folder_reads_back_as_generated(tmp_path):
    write_example_images(tmp_path)
    rebuilt = example_images(tmp_path)
    assert [r["text"] for r in rebuilt] == [r["text"] for r in example_images()]
    with pytest.raises(FileNotFoundError, match="without its package data"):
        example_images(tmp_path / "nowhere")


def test_the_collator_trains_on_each_formulas_latex():
    from slothkit import FastVisionModel
    from slothkit.testing.tiny_image_text import tiny_image_text_path

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model, processor = FastVisionModel.from_pretrained(
            str(tiny_image_text_path("gemma3")), load_in_4bit=False, dtype=torch.float32
        )
    records = example_image_dataset()
    assert records[0]["messages"][0]["content"][1] == {"type": "text", "text": OCR_INSTRUCTION}
    rows = random.Random(1).sample(range(RECORDS), 3)
    batch = VisionDataCollator(model, processor)([records[row] for row in rows])
    assert batch["pixel_values"].shape[0] == 3
    for index, row in enumerate(rows):
        trained = [int(t) for t in batch["labels"][index] if t != -100]
        answer = records[row]["messages"][1]["content"][0]["text"]
        assert processor.tokenizer.decode(trained) == answer + "<end_of_turn>\n"
