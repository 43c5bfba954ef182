"""The README's results section is generated from results/*.json and must match it."""
from dvi_lite import report


def test_readme_results_match_json():
    text = report.README.read_text()
    assert report.section(text) == report.render().strip("\n")


def test_readme_names_the_two_commands():
    text = report.README.read_text()
    assert "make reproduce" in text and "make test" in text
