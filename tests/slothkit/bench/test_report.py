"""The README's benchmark table is the one generated from the committed records."""

from slothkit.bench.report import BEGIN, END, ROOT, load_records, readme_with_table, render


def test_readme_table_matches_the_records():
    readme = (ROOT / "README.md").read_text()
    expected = readme_with_table(readme, render(load_records()))
    assert readme == expected, "README's table is stale: run python -m slothkit.bench.report --write"


def test_every_record_row_is_rendered():
    records = load_records()
    table = render(records)
    assert records, "no benchmark records committed under results/bench/"
    assert table.count("\n") - 1 == sum(len(r["rows"]) for r in records)
    assert BEGIN not in table and END not in table
