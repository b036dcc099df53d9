"""trsp_ray.common.table: the one renderer behind the benchmark, evaluation and reproduction tables."""

from trsp_ray.common import table

ROWS = [{"method": "dense", "layers": 30, "ppl": 12.3456}, {"method": "trsp|25", "layers": 22, "ppl": 1234.5}]


def test_default_right_aligns_numbers_under_a_rule():
    assert table.render(ROWS, ["method", "layers", "ppl"]).splitlines() == [
        "method   layers       ppl",
        "-------  ------  --------",
        "dense        30     12.35",
        "trsp|25      22  1,234.50",
    ]


def test_report_style_left_aligned_trimmed_with_own_cells():
    text = table.render(ROWS, ["ppl", "method"], fmt=lambda r, c: f"{r[c]:.1f}" if c == "ppl" else r[c],
                        numbers_right=False, rule=False, trim=True)
    assert text.splitlines() == ["ppl     method", "12.3    dense", "1234.5  trsp|25"]


def test_markdown_escapes_a_bar_inside_a_cell():
    assert table.markdown(ROWS, ["method", "layers"]).splitlines() == [
        "| method | layers |", "|---|---|", "| dense | 30 |", "| trsp\\|25 | 22 |"]
