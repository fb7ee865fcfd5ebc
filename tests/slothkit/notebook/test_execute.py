"""What run_notebook_demo reads back from an executed notebook's printed outputs."""

import nbformat
from nbformat.v4 import new_code_cell, new_notebook, new_output

from slothkit.notebook.execute import _compared_answers, _logged_loss


def _stdout(text: str):
    return new_output("stream", name="stdout", text=text)


def test_a_table_the_kernel_flushed_in_pieces_is_read_whole():
    """The kernel flushes stdout in pieces and the executor keeps each as an output of
    its own, so the answers table can be split anywhere, even mid-line, with stderr
    between the pieces."""
    printed = (
        "What is 12 plus 30?\n  before: It is forty-two, since\n  after:  12 + 30 = 42.\n"
        "Convert 3 kilometres to metres.\n  before: A kilometre is\n  after:  3 kilometres is 3000 metres.\n"
    )
    cut = printed.index("Convert 3 kilo") + 7
    cell = new_code_cell(
        "compare_answers(before, after)",
        outputs=[
            _stdout(printed[:cut]),
            new_output("stream", name="stderr", text="a warning\n"),
            _stdout(printed[cut:]),
        ],
    )
    train = new_code_cell("train()", outputs=[_stdout("24 steps in 9"), _stdout("0 s; loss 2.5 -> 0.75\n")])
    notebook = nbformat.from_dict(new_notebook(cells=[train, cell]))

    assert _compared_answers(notebook) == [
        ("What is 12 plus 30?", "It is forty-two, since", "12 + 30 = 42."),
        ("Convert 3 kilometres to metres.", "A kilometre is", "3 kilometres is 3000 metres."),
    ]
    assert _logged_loss(notebook) == (2.5, 0.75)
