"""The README's Python examples run as written."""

import pathlib
import re

README = pathlib.Path(__file__).parent.parent / "README.md"


def test_readme_python_blocks_run():
    blocks = re.findall(r"```python\n(.*?)```", README.read_text(), re.S)
    assert blocks
    for code in blocks:
        exec(compile(code, str(README), "exec"), {})


def test_quick_start_has_the_two_commands():
    text = README.read_text()
    assert 'pip install -e ".[demo]" && python -m sharetree demo' in text
    assert 'pip install -e ".[test]" && python -m pytest' in text


def test_readme_summary_output_is_what_summary_prints(capsys):
    text = README.read_text()
    pattern = r"```python\n((?:(?!```).)*?print\(st\.summary\(params\)\)\n)```\n\n```text\n(.*?)```"
    code, shown = re.search(pattern, text, re.S).groups()
    exec(compile(code, str(README), "exec"), {})
    assert capsys.readouterr().out == shown
