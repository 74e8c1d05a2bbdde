"""The engine's command-line flags, generated from `Config`: one per field a user sets, as `vllm
serve` has them (`max_num_seqs` is `--max-num-seqs`, a bool `enable_prefix_caching` is
`--enable-prefix-caching` and `--no-enable-prefix-caching`). A new field of Config is a new flag of
`python -m minivllm.serve` and `python -m minivllm`, typed by its annotation and documented by its
comment in Config."""

import argparse
import inspect
import re
from collections.abc import Collection, Iterable
from dataclasses import fields
from typing import Any, Literal, get_args, get_origin

from minivllm.config import Config


def field_docs(cls: type) -> dict[str, str]:
    """The comment after each field in `cls`'s source (Config documents its fields so): the line's
    last comment, none where that is a `# type: ignore[...]`."""
    docs = {}
    for line in inspect.getsource(cls).splitlines():
        if (found := re.match(r"\s+(\w+): .*#\s*(.*)", line)) and not found[2].startswith("type:"):
            docs[found[1]] = found[2]
    return docs


def flag_kwargs(annotation: Any) -> dict[str, Any]:
    """add_argument's type for a field's annotation: a Literal's values are the choices; a bool
    gives --x and --no-x; otherwise the first of int, float and str in it (`int | None`: int; `str |
    torch.dtype`: str)."""
    if get_origin(annotation) is Literal:
        return {"choices": get_args(annotation), "type": type(get_args(annotation)[0])}
    kinds = get_args(annotation) or (annotation,)
    if bool in kinds:
        return {"action": argparse.BooleanOptionalAction}
    for kind in (int, float, str):
        if kind in kinds:
            return {"type": kind}
    raise TypeError(f"no command-line type for {annotation!r}")


def add_engine_args(
    parser: argparse.ArgumentParser, skip: Collection[str] = (), **changes: dict[str, Any]
) -> list[str]:
    """A flag in an "engine" group of `parser` for each init field of Config but `model` (and
    `skip`); returns their fields' names, for `engine_kwargs`. A flag left out leaves no attribute:
    Config's default holds. changes[field]: add_argument's keyword arguments to change for that
    flag, and `aliases`, more option strings (`--tp`)."""
    group = parser.add_argument_group(
        "engine", "LLM(...)'s arguments: the fields of Config (minivllm/config.py)"
    )
    docs, names = field_docs(Config), []
    for field in fields(Config):
        if not field.init or field.name in {"model", *skip}:
            continue
        options = dict(changes.get(field.name, {}))
        aliases = options.pop("aliases", [])
        default = f"default: {options.get('default', field.default)}"
        doc = (f"{docs[field.name]}; {default}" if field.name in docs else default).replace(
            "%", "%%"
        )
        kwargs = {**flag_kwargs(field.type), "default": argparse.SUPPRESS, "help": doc, **options}
        group.add_argument(f"--{field.name.replace('_', '-')}", *aliases, **kwargs)
        names.append(field.name)
    return names


def engine_kwargs(args: argparse.Namespace, names: Iterable[str]) -> dict[str, Any]:
    """The engine's keyword arguments among the fields `names` that the command line gave."""
    return {name: getattr(args, name) for name in names if hasattr(args, name)}
