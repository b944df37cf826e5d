"""The configuration reference (docs/configuration.md) is what the generator makes from the code
today."""
from __future__ import annotations

from pagedserve import config_reference
from pagedserve.catalog import catalog


def test_the_page_reference_matches_the_settings_models():
    section = config_reference.current_section(config_reference.PAGE.read_text())
    assert section, "docs/configuration.md lacks the configuration reference markers"
    assert section == config_reference.render(), (
        "docs/configuration.md's configuration reference is stale: run "
        "`python -m pagedserve.config_reference --write`")


def test_the_page_keeps_an_intro_above_the_reference():
    text = config_reference.PAGE.read_text()
    intro = text[:text.find(config_reference.BEGIN)]
    assert intro.startswith("# ") and len(intro.split()) > 20


def test_reference_has_a_row_per_setting_with_its_vllm_flag():
    text = config_reference.render()
    for setting in catalog():
        row = next(line for line in text.splitlines() if line.startswith(f"| `{setting.name}` |"))
        assert (setting.vllm_names[0] in row) if setting.vllm_names else "no equivalent" in row
