"""`voicebus settings`: every `Settings` field, its ``VOICEBUS_`` variable, its default, the value
in effect (from the environment) and its meaning (the field's docstring in pipeline/settings.py)."""

from __future__ import annotations


from pydantic import SecretStr

from voicebus.settings import ENV_PREFIX, Settings, field_docs


def register(subparsers) -> None:
    p = subparsers.add_parser("settings", help="list every setting: VOICEBUS_ variable, default, value, meaning")
    from voicebus.cli import add_json_argument

    add_json_argument(p, "every field (an array of objects: field, variable, default, value, meaning) instead of a table")
    p.set_defaults(func=run_settings)


def settings_rows(settings: Settings) -> list[dict[str, str]]:
    """One row per field, in declaration order. Defaults are those of a plain `Settings()`."""
    defaults, docs = Settings(), field_docs()
    rows = []
    for name in Settings.model_fields:
        default, value = getattr(defaults, name), getattr(settings, name)
        shown = _show(value)
        if isinstance(value, SecretStr):  # never print a secret: say only whether it was changed
            shown = "(empty)" if not value else "(the default)" if value == default else "(set)"
            default = "(public default)" if default.get_secret_value() else ""
        rows.append({"field": name, "variable": ENV_PREFIX + name.upper(), "default": _show(default),
                     "value": shown, "meaning": docs[name]})
    return rows


def _show(value) -> str:
    return "" if value is None else str(value)


def run_settings(args, settings: Settings) -> int:
    rows = settings_rows(settings)
    if args.json is not None:
        from voicebus.cli import write_json

        write_json(args.json, rows)
        return 0
    from rich.console import Console
    from rich.table import Table

    console = Console(width=max(160, Console().width))
    table = Table(title="voicebus settings (set each with its environment variable)", show_lines=True)
    table.add_column("variable", no_wrap=True)
    for column in ("default", "value"):
        table.add_column(column, overflow="fold", max_width=30)
    table.add_column("meaning", overflow="fold")
    for row in rows:
        changed = row["value"] != row["default"]
        table.add_row(row["variable"], row["default"], f"[bold]{row['value']}[/]" if changed else row["value"],
                      row["meaning"])
    console.print(table)
    return 0
