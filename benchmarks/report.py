"""Shared by the benchmark scripts: their tables in benchmarks/README.md."""
from __future__ import annotations

import re
from pathlib import Path
from typing import Iterable, Sequence


def markdown_table(header: Sequence[str], rows: Iterable[Sequence[object]], text_columns: int = 0) -> str:
    """A Markdown table: the first `text_columns` columns left-aligned, the others (numbers) right."""
    align = ["---"] * text_columns + ["---:"] * (len(header) - text_columns)
    return "\n".join("| " + " | ".join(str(cell) for cell in line) + " |" for line in [header, align, *rows])


def update_readme(section: str, body: str, readme: Path) -> None:
    """Replaces the text between the section's markers in benchmarks/README.md."""
    begin, end = f"<!-- {section}:begin -->", f"<!-- {section}:end -->"
    text = readme.read_text() if readme.exists() else "# hvdx benchmarks\n"
    block = f"{begin}\n{body}\n{end}"
    if begin in text:
        text = re.sub(re.escape(begin) + r".*?" + re.escape(end), lambda _: block, text, flags=re.S)
    else:
        text = text.rstrip() + "\n\n" + block + "\n"
    readme.write_text(text)
