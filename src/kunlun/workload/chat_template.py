"""A workload's own chat template: vLLM's ``--chat-template``, the spec's ``chat_template``.

The spec holds the template *text*, never a path: the spec travels whole into the state store
and, in a cluster, to the node that runs a replica, where a file on the submitting machine
does not exist. ``kunlun-platform --model ... --chat-template VALUE`` reads VALUE as vLLM
does: a file's content when it names a file, else the template itself; a value that looks
like a path (ends in ``.jinja`` or ``.j2``, or has a ``/`` and no jinja delimiters) but is
not a file is an error naming it, so a mistyped path is not served as a one-line template.

A template is compiled when the spec is checked, in the sandbox the worker renders it in
(:mod:`kunlun.jinja_sandbox`): a syntax error is refused at submit with its line, not met by
the first chat request. The worker's tokenizer then uses it instead of the model's own
(:attr:`kunlun.engine.launch.EngineLaunch.chat_template`), for chat, ``/tokenize`` and tool
calling alike.
"""

from __future__ import annotations

from pathlib import Path

from kunlun.errors import ConfigError, Location

#: The longest template a spec may hold (characters); real ones are a few KiB.
MAX_CHAT_TEMPLATE_CHARS = 256 * 1024
_PATH_SUFFIXES = (".jinja", ".j2")
_DELIMITERS = ("{{", "{%", "{#")


def template_problem(text: str) -> str | None:
    """Why ``text`` is not a usable chat template (its jinja2 syntax error, with the line),
    or None."""
    import jinja2  # only where a template is checked: the spec's importers need not

    from kunlun.jinja_sandbox import sandbox_environment

    if not text.strip():
        return "the template is empty"
    try:
        sandbox_environment().from_string(text)
    except jinja2.TemplateSyntaxError as exc:
        return f"line {exc.lineno}: {exc.message}"
    return None


def read_chat_template(value: str, flag: str = "--chat-template") -> str:
    """The template ``value`` stands for: the content of the file it names, else ``value``
    itself; a :class:`ConfigError` naming ``flag`` and the file when it looks like a path
    that is not a readable file."""
    path = Path(value).expanduser()
    looks_like_path = value.endswith(_PATH_SUFFIXES) or (
        "/" in value and not any(d in value for d in _DELIMITERS)
    )
    if "\n" not in value and path.is_file():
        try:
            return path.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as exc:
            why = exc.strerror if isinstance(exc, OSError) else "not UTF-8 text"
            raise ConfigError(
                f"{flag}: cannot read {value!r}: {why}", location=Location(flag)
            ) from None
    if looks_like_path:
        raise ConfigError(
            f"{flag}: no such file {value!r}",
            location=Location(flag),
            hint="give a template file, or the template text itself",
        )
    return value
