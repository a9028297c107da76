"""`voicebus settings`: every `Settings` field, its ``VOICEBUS_`` variable, its default, the value
in effect (from the environment) and its meaning (the field's docstring in pipeline/settings.py),
in the groups of `SETTING_GROUPS`; ``--role ROLE`` keeps the fields that role's process reads.

The "Every setting" section of docs/settings.md is generated here from the same fields
(`reference_markdown`): ``python -m voicebus.settings_cli --write-docs`` (the same as
``voicebus settings --write-docs``) rewrites it, ``--markdown`` prints it.
"""

from __future__ import annotations

import re
from pathlib import Path

from pydantic import SecretStr

from voicebus.settings import ENV_PREFIX, ROLES, SETTING_GROUPS, Settings, field_docs, fields_of, group_of

DOCS_PAGE = Path(__file__).resolve().parents[1] / "docs" / "settings.md"  # where a checkout has it
SECTION, NEXT_SECTION = "## Every setting", "## Limits"  # the part of DOCS_PAGE that is generated
REGENERATE = "python -m voicebus.settings_cli --write-docs"
NONE_SHOWN = "–"  # an empty default in the reference


def register(subparsers) -> None:
    p = subparsers.add_parser("settings", help="list every setting: VOICEBUS_ variable, default, value, meaning")
    from voicebus.cli import add_json_argument

    add_json_argument(p, "the fields (an array of objects: field, group, variable, default, value, meaning) "
                         "instead of a table")
    p.add_argument("--role", choices=list(ROLES),
                   help="only the settings this role's process reads: its group's, the bus's, security's, "
                        "tracing's, and the few others it uses")
    p.add_argument("--markdown", action="store_true",
                   help="print the settings reference of docs/settings.md (its \"Every setting\" section)")
    p.add_argument("--write-docs", nargs="?", const=str(DOCS_PAGE), default=None, metavar="PATH",
                   help="rewrite the \"Every setting\" section of PATH (default: this checkout's docs/settings.md) "
                        "from the fields")
    p.set_defaults(func=run_settings)


def settings_rows(settings: Settings, role: str | None = None) -> list[dict[str, str]]:
    """One row per field (`role`'s only, when given), in declaration order. Defaults are those of
    a plain `Settings()`."""
    defaults, docs = Settings(), field_docs()
    rows = []
    for name in (fields_of(role) if role else Settings.model_fields):
        default, value = getattr(defaults, name), getattr(settings, name)
        shown = _show(value)
        if isinstance(value, SecretStr):  # never print a secret: say only whether it was changed
            shown = "(empty)" if not value else "(the default)" if value == default else "(set)"
        rows.append({"field": name, "group": group_of(name), "variable": ENV_PREFIX + name.upper(),
                     "default": _shown_default(default), "value": shown, "meaning": docs[name]})
    return rows


def _show(value) -> str:
    return "" if value is None else str(value)


def _shown_default(default) -> str:
    if isinstance(default, SecretStr):
        return "(public default)" if default.get_secret_value() else ""
    return _show(default)


def run_settings(args, settings: Settings) -> int:
    if args.write_docs is not None:
        path = Path(args.write_docs)
        print(f"{path}: {'rewritten' if write_docs(path) else 'up to date'}")
        return 0
    if args.markdown:
        print(reference_markdown(fields_of(args.role) if args.role else None), end="")
        return 0
    rows = settings_rows(settings, args.role)
    if args.json is not None:
        from voicebus.cli import write_json

        write_json(args.json, rows)
        return 0
    from rich.console import Console
    from rich.table import Table

    console = Console(width=max(160, Console().width))
    role = f" read by the {args.role} role" if args.role else ""
    console.print(f"[bold]voicebus settings{role}[/] (set each with its environment variable)")
    for key, group in SETTING_GROUPS.items():
        shown = [row for row in rows if row["group"] == key]
        if not shown:
            continue
        table = Table(title=group.title, title_justify="left", title_style="bold", show_lines=True)
        table.add_column("variable", no_wrap=True)
        for column in ("default", "value"):
            table.add_column(column, overflow="fold", max_width=30)
        table.add_column("meaning", overflow="fold")
        for row in shown:
            changed = row["value"] != row["default"]
            table.add_row(row["variable"], row["default"], f"[bold]{row['value']}[/]" if changed else row["value"],
                          row["meaning"])
        console.print(table)
    return 0


# --- the reference in docs/settings.md -------------------------------------------------------------

def reference_markdown(names: tuple[str, ...] | None = None) -> str:
    """The body of the "Every setting" section: per group a bold heading (with its page) and a
    table of its fields (`names` only, when given): variable, default (never a secret's), and the
    first sentence of the docstring."""
    docs, roles = field_docs(), "|".join(ROLES)
    lines = [f"<!-- Generated by `{REGENERATE}` from pipeline/settings.py (each",
             "     field's group and docstring): edit those, then regenerate. -->",
             "",
             "One table per group of settings; each meaning is the first sentence of the field's documentation,",
             "which `voicebus settings` prints whole. What one kind of process reads (its own group, the bus,",
             "security and tracing, and the few fields of other groups it uses):",
             f"`voicebus settings --role {roles}`."]
    for key, group in SETTING_GROUPS.items():
        shown = [name for name in group.fields if names is None or name in names]
        if not shown:
            continue
        page = f" ([{group.doc.partition('#')[0]}]({group.doc}))" if group.doc else ""
        lines += ["", f"**{group.title}**{page}", "", "| variable | default | meaning |", "|---|---|---|"]
        for name in shown:
            lines.append(f"| `{ENV_PREFIX}{name.upper()}` | {_cell(_doc_default(name))} | "
                         f"{_cell(_markdown(first_sentence(docs[name])))} |")
    return "\n".join(lines) + "\n"


def _doc_default(name: str) -> str:
    """A field's default as the reference shows it: the same on every machine (``shown_default``
    where the default is computed at start), a secret's never."""
    field = Settings.model_fields[name]
    extra = field.json_schema_extra if isinstance(field.json_schema_extra, dict) else {}
    if "shown_default" in extra:
        return f"`{extra['shown_default']}`"
    shown = _shown_default(field.get_default(call_default_factory=True))
    return NONE_SHOWN if not shown else shown if shown.startswith("(") else f"`{shown}`"


_ABBREVIATIONS = {"e.g", "i.e", "etc", "vs"}


def first_sentence(text: str) -> str:
    """`text` up to its first full stop that ends a sentence: not in code (backticks), not in
    parentheses, not after an abbreviation."""
    depth, i = 0, 0
    while i < len(text):
        if text[i] == "`":
            tick = "``" if text.startswith("``", i) else "`"
            end = text.find(tick, i + len(tick))
            i = len(text) if end < 0 else end + len(tick)
            continue
        char = text[i]
        if char == "(":
            depth += 1
        elif char == ")":
            depth = max(0, depth - 1)
        elif (char == "." and depth == 0 and text[i + 1:i + 2] in ("", " ")
              and text[:i].rsplit(" ", 1)[-1].lower() not in _ABBREVIATIONS):
            return text[:i + 1]
        i += 1
    return text


def _markdown(text: str) -> str:
    """A docstring's text as Markdown: code in double backticks in single ones, and a mention of
    docs/PAGE.md (with a quoted section: docs/PAGE.md, "Section") a link to it."""
    text = re.sub(r"``(.+?)``", r"`\1`", text)

    def link(match: re.Match) -> str:
        page, section = match.group(1), match.group(2)
        if section is None:
            return f"[{page}]({page})"
        return f"[{page}, \"{section}\"]({page}#{_slug(section)})"

    return re.sub(r'docs/([\w-]+\.md)(?:, "([^"]+)")?', link, text)


def _slug(heading: str) -> str:
    """The anchor GitHub gives a heading."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def _cell(text: str) -> str:
    return text.replace("|", r"\|")


def with_reference(page: str) -> str:
    """`page` (docs/settings.md's text) with its "Every setting" section generated anew: everything
    between that heading and the next, "Limits", is replaced."""
    head, found, rest = page.partition(f"\n{SECTION}\n")
    _, found_next, tail = rest.partition(f"\n{NEXT_SECTION}\n")
    if not (found and found_next):
        raise ValueError(f"no {SECTION!r} section followed by {NEXT_SECTION!r}")
    return f"{head}\n{SECTION}\n\n{reference_markdown()}\n{NEXT_SECTION}\n{tail}"


def write_docs(path: Path = DOCS_PAGE) -> bool:
    """Regenerate the "Every setting" section of `path`; True when that changed the file."""
    old = path.read_text()
    new = with_reference(old)
    if new != old:
        path.write_text(new)
    return new != old


if __name__ == "__main__":
    import sys

    from voicebus.cli import main

    sys.exit(main(["settings", *sys.argv[1:]]))
