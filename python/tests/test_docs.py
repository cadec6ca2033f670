"""The example of docs/engines.md, "Embedding kvferry in Python", runs as it stands."""

import os
import re
import subprocess
import sys

from conftest import REPO


def test_the_documented_example_runs(registry, tmp_path):
    text = (REPO / "docs" / "engines.md").read_text()
    section = text[text.index("## Embedding kvferry in Python") :]
    code = re.search(r"```python\n(.*?)```", section, re.S).group(1)
    script = tmp_path / "example.py"
    script.write_text(code)
    env = os.environ | {"KVFERRY_BOOTSTRAP": registry}
    out = subprocess.run([sys.executable, str(script)], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == f"success {3 * 4 * 4 * 32 * 64 * 2} bytes landed", out.stdout
