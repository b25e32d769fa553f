"""``inspect --html`` in a real browser: headless Chromium renders the page, its screenshot shows
the graph in the fp16 and fp32 colours, and the page's script selects a node (``#node=NAME``, the
code path of a click) and shows its reason and predicted times.

Skipped where no Chromium is installed (Debian: ``apt-get install chromium``)."""

from __future__ import annotations

import shutil
import subprocess

import numpy as np
import onnx
import pytest
from test_plan_view import FIXED, shape_and_constant_model

from onnxcampo.cli import main
from onnxcampo.report.plan_html import COLOURS

BROWSER = next((path for path in map(shutil.which, ("chromium", "chromium-browser", "google-chrome")) if path), None)
pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(BROWSER is None, reason="no headless Chromium here (chromium, chromium-browser or "
                                                          "google-chrome on PATH; Debian: apt-get install chromium)")]


def chromium(tmp_path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([BROWSER, "--headless", "--no-sandbox", "--disable-gpu", "--hide-scrollbars",
                           f"--user-data-dir={tmp_path / 'profile'}", *args],
                          capture_output=True, text=True, timeout=120, check=True)


@pytest.fixture(scope="module")
def page(tmp_path_factory):
    folder = tmp_path_factory.mktemp("html")
    onnx.save(shape_and_constant_model(), str(folder / "m.onnx"))
    assert main(["inspect", str(folder / "m.onnx"), *FIXED, "--html", str(folder / "plan.html")]) == 0
    return folder, folder / "plan.html"


def rgb(colour: str) -> tuple[int, int, int]:
    return tuple(int(colour[i:i + 2], 16) for i in (1, 3, 5))


def test_screenshot_shows_the_graph_in_the_fp16_and_fp32_colours(page):
    PIL = pytest.importorskip("PIL.Image")
    folder, path = page
    shot = folder / "plan.png"
    chromium(folder, "--window-size=1280,900", f"--screenshot={shot}", path.as_uri())
    image = PIL.open(shot).convert("RGB")
    assert image.size == (1280, 900)
    pixels = np.asarray(image, dtype=np.int16).reshape(-1, 3)
    assert len(np.unique(pixels, axis=0)) > 20, "the page rendered blank"

    def count(colour: str) -> int:
        return int((np.abs(pixels - np.array(rgb(colour))) <= 3).all(axis=1).sum())

    # a node box is 132 x 26 pixels, a legend key 14 x 14: more than a key's worth means boxes
    assert count(COLOURS["fp16"]) > 2 * 132 * 20  # MatMul and Add
    assert count(COLOURS["fp32"]) > 132 * 20  # Exp (excluded)
    assert count(COLOURS["cast"]) > 2 * 132 * 20  # the two Casts inserted


def test_selecting_a_node_shows_its_reason_and_times(page):
    folder, path = page
    dom = chromium(folder, "--dump-dom", f"{path.as_uri()}#node=exp").stdout
    assert 'data-ready="1"' in dom
    details = dom.split('<div id="details">', 1)[1].split("</div>", 1)[0]
    assert details.startswith("exp\nExp  fp32\n\nexcluded by the user\n\npredicted fp32 ")
    assert "doc_string:\nonnxcampo: fp32 (excluded by the user)" in details
    assert '<tr data-i="6" class="k-fp32 sel">' in dom  # the table row is selected too


def run_script(tmp_path, page_path, script: str) -> str:
    """The DOM after ``script`` ran on the loaded page (appended as one more script element)."""
    text = page_path.read_text().replace("</body>", f"<script>{script}</script></body>")
    probe = tmp_path / "probe.html"
    probe.write_text(text)
    return chromium(tmp_path, "--dump-dom", probe.as_uri()).stdout


def test_the_page_opens_on_the_compute_and_draws_the_whole_graph_on_request(page, tmp_path):
    """The shape arithmetic (Shape) and the constant are not drawn at first; the checkbox shows
    the whole graph; zoom buttons scale it; a column's name sorts the table."""
    folder, path = page
    dom = chromium(folder, "--dump-dom", path.as_uri()).stdout
    first = dom.split('<svg id="graph"', 1)[1].split("</svg>", 1)[0]
    assert ">Shape<" not in first and ">Constant<" not in first and ">Exp<" in first
    dom = run_script(tmp_path, path, "document.getElementById('all').click();"
                                     "document.getElementById('zin').click();"
                                     "document.querySelectorAll('#rows thead th')[3].click();")
    assert '<svg id="graph"' in dom and 'id="graph" class="graph"' in dom
    graph, whole = (dom.split(f'<svg id="{g}"', 1)[1].split(">", 1)[0] for g in ("graph", "graph-all"))
    assert "display: none" in graph and "display: none" not in whole
    assert ">Shape<" in dom.split('<svg id="graph-all"', 1)[1].split("</svg>", 1)[0]
    assert '<span id="zoom">125 %</span>' in dom
    body = dom.split('<div id="rows">', 1)[1].split("<tbody>", 1)[1].split("</tbody>", 1)[0]
    fp32 = [float(cell) for cell in (row.split("<td>")[4].split("</td>")[0] for row in body.split("<tr")[1:]) if cell]
    assert fp32 == sorted(fp32, reverse=True) and len(fp32) >= 3  # the fp32 us column, largest first
    gains = [row.split("<td>")[7].split("</td>")[0] for row in body.split("<tr")[1:]]
    assert any(gains) and all(g == "" or float(g) == float(g) for g in gains)  # the fp16 gain column, filled
