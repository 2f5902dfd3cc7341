"""The configuration reference, `docs/configuration.md`, generated from `RouterConfig`'s groups and help texts.

Regenerate it with `python -m early_exit_router.cli.config_reference > docs/configuration.md`
(`tests/test_docs.py` checks that the two agree).
"""

from __future__ import annotations

import dataclasses

from early_exit_router.config import GROUPS


def reference() -> str:
    """The reference as markdown: one table per group (field, default, meaning)."""
    lines = [
        "# Configuration",
        "",
        "<!-- Generated from the help texts in early_exit_router/config.py; edit them there and regenerate:",
        "python -m early_exit_router.cli.config_reference > docs/configuration.md (tests/test_docs.py checks that",
        "the two agree). -->",
        "",
        "`RouterConfig` holds every knob of the exit heads and their routing, in four groups. Set them in Python",
        "(`RouterConfig(...)`, `router.config.replace(...)`, or per call `generate(..., config={...})`), on the",
        "command line (`--high-conf-threshold 0.9`: every field is an option of the commands that load a model),",
        "or per request in the server's `early_exit` field (the fields it accepts: docs/serving.md). A saved",
        "router keeps them in `early_exit_config.json`.",
    ]
    for group in GROUPS:
        lines += ["", f"## {group.__name__}", "", " ".join(group.__doc__.split()), ""]
        lines += ["| field | default | meaning |", "|---|---|---|"]
        for f in dataclasses.fields(group):
            text = " ".join(f.metadata["help"].split()).replace("|", "\\|")
            lines.append(f"| `{f.name}` | `{f.default!r}` | {text} |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    print(reference(), end="")
