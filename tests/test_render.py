"""The README's and docs' results tables are what experiments/render.py makes of the
committed results files: a figure cannot drift from its source."""

from __future__ import annotations

import pytest

from experiments import _provenance as P
from experiments import render


def test_committed_tables_equal_their_render():
    changed = render.render_all(write=False)
    assert not changed, (
        f"{', '.join(str(f.relative_to(render.REPO)) for f in changed)} differ from the results files: "
        "run `make results-tables` and commit"
    )
    used = render.used_tables()
    assert {"low_precision", "bench_compress", "bench_step", "gpu_summary"} <= set(used)


def test_the_check_command_passes_on_the_committed_tree(capsys):
    assert render.main(["--check"]) == 0
    assert "tables up to date" in capsys.readouterr().out


def test_a_table_is_regenerated_between_its_markers():
    text = "before\n<!-- results:low_precision -->\n| hand-edited | 0.1 |\n<!-- /results:low_precision -->\nafter\n"
    new = render.render_file(text)
    assert "hand-edited" not in new
    assert new.startswith("before\n<!-- results:low_precision -->\n| bits | naive | DCD | ECD |")
    assert "Rendered from `experiments/results/low_precision.json`" in new
    assert new.endswith("<!-- /results:low_precision -->\nafter\n")
    assert render.render_file(new) == new


def test_bad_markers_are_refused():
    with pytest.raises(ValueError, match=r"x.md: unknown results table 'nope'; known: low_precision, "):
        render.render_file("<!-- results:nope -->\n<!-- /results:nope -->\n", "x.md")
    with pytest.raises(ValueError, match=r"x.md: results markers do not pair up: opened \['low_precision'\], closed \[\]"):
        render.render_file("<!-- results:low_precision -->\n", "x.md")


def test_stale_figures_are_marked_with_their_date_and_commit():
    prov = {**P.start(["experiments/render.py"], argv=["python", "cmd"], measure_memcpy=False).finish(),
            "dirty_sources": []}  # as if made at HEAD from a clean tree
    assert "**Stale**" not in render.provenance_line("r.json", prov)
    old = {**prov, "date": "2026-01-02T03:04:05+00:00", "commit": "abcdef1234567",
           "source_ids": {"experiments/render.py": "0" * 40}}
    line = render.provenance_line("r.json", old)
    assert line.startswith("**Stale** (measured 2026-01-02 at commit abcdef1234; changed since: experiments/render.py)")


def test_the_3_bit_row_is_not_called_met():
    rows = [{"compressor": "quant:bits=3", "roundtrip_ratio": 0.249}, {"compressor": "quant:bits=2", "roundtrip_ratio": 0.297},
            {"compressor": "sign", "roundtrip_ratio": 0.2}, {"compressor": "identity", "roundtrip_ratio": 0.2}]
    table = render._bench_compress(rows)
    assert "| quant:bits=3 | 0.249 | ≥ 1/4: **not met** |" in table
    assert "| quant:bits=2 | 0.297 | ≥ 1/4 |" in table
    assert "| sign | 0.200 | ≥ 1/6 |" in table and "| identity | 0.200 |  |" in table


def test_stale_command_lists_results_with_their_reasons(capsys):
    assert render.main(["--stale"]) == 0
    out = capsys.readouterr().out
    for rel, _, why in render.stale_results():
        assert f"{rel}: stale ({'; '.join(why)})" in out


def test_markers_inside_code_fences_are_examples_not_tables():
    text = "```\n<!-- results:NAME -->\n<!-- /results:NAME -->\n```\n"
    assert render.render_file(text) == text
