"""The chart's values reference (helm/alignedserve/README.md, between the markers), written from
values.schema.json (type, range, description) and values.yaml (default), so the reference cannot drift:

    python tests/deploy/values_reference.py           # rewrite the README's reference
    python tests/deploy/values_reference.py --check   # exit 1 if it is stale (test_chart_schema.py does)
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import yaml

CHART = Path(__file__).resolve().parents[2] / "helm" / "alignedserve"
README = CHART / "README.md"
BEGIN, END = "<!-- values reference: begin -->", "<!-- values reference: end -->"


def leaves(
    node: dict[str, Any], path: tuple[str, ...] = ()
) -> Iterator[tuple[tuple[str, ...], dict[str, Any]]]:
    """Every key a user sets: objects with declared properties are walked, anything else is a leaf."""
    props = node.get("properties")
    if node.get("type") == "object" and props:
        for key, child in props.items():
            yield from leaves(child, (*path, key))
    elif path:
        yield path, node


def kind(node: dict[str, Any]) -> str:
    """The type and the range, as the schema allows them."""
    if "enum" in node:
        return " | ".join(f"`{json.dumps(v)}`" for v in node["enum"])
    if "anyOf" in node:
        return " or ".join(kind(option) for option in node["anyOf"])
    types = node.get("type", "any")
    text = " or ".join(types) if isinstance(types, list) else str(types)
    low = node.get("minimum", node.get("exclusiveMinimum"))
    high = node.get("maximum", node.get("exclusiveMaximum"))
    if low is not None or high is not None:
        text += f" {'' if low is None else low}..{'' if high is None else high}"
    if "pattern" in node:  # a long one (a Kubernetes quantity) is said in the description
        text += f" `{node['pattern']}`" if len(node["pattern"]) <= 40 else " (pattern)"
    return text


def default(values: dict[str, Any], path: tuple[str, ...]) -> str:
    for key in path:
        if not isinstance(values, dict) or key not in values:
            return ""
        values = values[key]
    return f"`{json.dumps(values)}`"


def cell(text: str) -> str:
    """Markdown table cell: | would end it, <name> would be read as an HTML tag."""
    return text.replace("|", "\\|").replace("<", "&lt;").replace("\n", " ")


def reference() -> str:
    schema = json.loads((CHART / "values.schema.json").read_text())
    values = yaml.safe_load((CHART / "values.yaml").read_text())
    groups: dict[str, list[str]] = {}
    for path, node in leaves(schema):
        group = path[0] if len(path) > 1 else "top level"
        row = f"| `{'.'.join(path)}` | {cell(kind(node))} | {cell(default(values, path))} | "
        groups.setdefault(group, []).append(row + f"{cell(node.get('description', ''))} |")
    parts = [BEGIN, ""]
    for group, rows in groups.items():
        parts += [f"### {group if group == 'top level' else f'`{group}`'}", ""]
        parts += ["| key | type | default | description |", "|---|---|---|---|", *rows, ""]
    return "\n".join([*parts, END])


def with_reference(readme: str) -> str:
    head, _, rest = readme.partition(BEGIN)
    _, _, tail = rest.partition(END)
    return head + reference() + tail


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--check", action="store_true", help="exit 1 if the README's reference is stale")
    args = parser.parse_args(argv)
    readme = README.read_text()
    if BEGIN not in readme or END not in readme:
        print(f"{README}: no {BEGIN} ... {END} markers", file=sys.stderr)
        return 1
    fresh = with_reference(readme)
    if args.check:
        if fresh != readme:
            print(f"{README} is stale: python tests/deploy/values_reference.py", file=sys.stderr)
            return 1
        return 0
    README.write_text(fresh)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
