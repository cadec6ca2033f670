"""The examples of docs/engines.md ("Embedding kvferry in Python", "Sidecars from Python") run
as they stand and print what they say."""

import os
import re
import subprocess
import sys

import pytest

from conftest import REPO


def example(section: str) -> str:
    text = (REPO / "docs" / "engines.md").read_text()
    start = text.index(f"## {section}")
    end = text.find("\n## ", start + 1)
    return re.search(r"```python\n(.*?)```", text[start:end], re.S).group(1)


@pytest.mark.parametrize(
    "section, printed",
    [
        ("Embedding kvferry in Python", f"success {3 * 4 * 4 * 32 * 64 * 2} bytes landed"),
        # 40 tokens x 4 layers x (K, V) x 4 heads x 32 dims x 2 bytes.
        ("Sidecars from Python", f"success {40 * 4 * 2 * 4 * 32 * 2} bytes landed"),
    ],
)
def test_the_documented_example_runs(registry, tmp_path, section, printed):
    script = tmp_path / "example.py"
    script.write_text(example(section))
    env = os.environ | {"KVFERRY_BOOTSTRAP": registry}
    out = subprocess.run([sys.executable, str(script)], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == printed, out.stdout
