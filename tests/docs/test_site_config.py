"""The docs site's configuration: the API reference's signatures are formatted over lines.

mkdocstrings formats a separate signature only when Ruff or Black can be imported; without either it
leaves each signature on one line, past the edge of the page. The ``docs`` extra must bring one.
"""

from __future__ import annotations

import re

import yaml

from doc_snippets import ROOT


def test_the_docs_extra_brings_a_signature_formatter():
    (docs,) = re.findall(r"^docs = \[(.*)\]$", (ROOT / "pyproject.toml").read_text(), re.M)  # (tomllib: 3.11+)
    names = {re.split(r"[<>=!~\[ ;]", req.strip(' "'), maxsplit=1)[0].lower() for req in docs.split(",")}
    assert names & {"ruff", "black"}, f"the docs extra [{docs}] has neither ruff nor black"


def test_mkdocstrings_formats_separate_signatures():
    site = yaml.safe_load((ROOT / "mkdocs.yml").read_text())
    (handler,) = [p["mkdocstrings"] for p in site["plugins"] if isinstance(p, dict) and "mkdocstrings" in p]
    options = handler["handlers"]["python"]["options"]
    assert options["separate_signature"] is True  # only a separate signature is formatted
    assert 60 <= options["line_length"] <= 100
