"""What to validate: the columns of the matrix, from the command line or a running platform.

A target is an OpenAI-compatible endpoint, a model name on it, and optionally a device pool
(sent as ``X-Kunlun-Pool`` so the platform routes only to that pool's replicas). Columns come
from three places, in this order:

- ``--target NAME=URL[,model=M][,pool=P]``: one named column each;
- ``--endpoint URL`` (repeatable) crossed with ``--model M`` (repeatable): one column per
  pair, named by what varies (``host:port``, the model, or both);
- ``--all-pools``: each of those split per device pool that serves the model (the device
  types of its RUNNING workloads, from the platform's ``GET /api/v1/workloads``; a device
  type served by several engines is one pool per engine, ``cpu/kunlun`` and
  ``cpu/llama.cpp``: :mod:`kunlun.serving.pools`).

The reference column (numerics are measured against it) is named by ``--reference`` (a
column name, or an endpoint URL: a listed one, else a new column), else the first column.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any
from urllib.parse import urlsplit

import httpx

from kunlun import headers as http_headers
from kunlun.address import DEFAULT_ENDPOINT
from kunlun.engines.registry import DEFAULT_ENGINE
from kunlun.errors import ConfigError, Location
from kunlun.serving.pools import columns_of, parse_pool, pool_name
from kunlun.validate.matrix import Column

DEVICE_HEADER = http_headers.DEVICE
REPLICA_HEADER = http_headers.REPLICA


def normalize_endpoint(url: str, where: str = "--endpoint") -> str:
    """``http://host:port`` from what a user typed (``/v1`` and trailing slashes dropped)."""
    parts = urlsplit(url.strip())
    if parts.scheme not in ("http", "https") or not parts.netloc:
        raise ConfigError(
            f"{url!r} is not an http(s) URL",
            location=Location(where),
            hint=f"e.g. {DEFAULT_ENDPOINT}",
        )
    path = parts.path.rstrip("/").removesuffix("/v1").rstrip("/")
    return f"{parts.scheme}://{parts.netloc}{path}"


def parse_target(spec: str, default_model: str | None) -> Column:
    """A column from ``NAME=URL[,model=M][,pool=P]``."""
    where = Location("--target", field=spec)
    name, sep, rest = spec.partition("=")
    if not sep or not name.strip() or not rest.strip():
        raise ConfigError("expected NAME=URL[,model=M][,pool=P]", location=where)
    url, *options = rest.split(",")
    fields: dict[str, str] = {}
    for option in options:
        key, sep, value = option.partition("=")
        if key.strip() not in ("model", "pool") or not sep or not value.strip():
            raise ConfigError(
                f"unknown or empty option {option!r} (options: model=M, pool=P)", location=where
            )
        fields[key.strip()] = value.strip()
    model = fields.get("model") or default_model
    if not model:
        raise ConfigError("no model: add ,model=M or give --model", location=where)
    pool = fields.get("pool")
    if pool is not None:
        try:
            pool = pool_name(*parse_pool(pool))
        except ValueError as exc:
            raise ConfigError(str(exc), location=where) from None
    return Column(name.strip(), normalize_endpoint(url, "--target"), model, pool)


def _host(endpoint: str) -> str:
    return urlsplit(endpoint).netloc


def cross_columns(
    endpoints: Sequence[str],
    models: Sequence[str],
    pools: dict[tuple[str, str], list[str]] | None = None,
) -> list[Column]:
    """One column per endpoint x model, and per pool when ``pools`` maps
    ``(endpoint, model)`` to the pools serving it."""
    columns = []
    for endpoint in endpoints:
        for model in models:
            found: list[str | None] = list((pools or {}).get((endpoint, model), [])) or [None]
            for pool in found:
                parts = []
                if len(endpoints) > 1:
                    parts.append(_host(endpoint))
                if len(models) > 1 or (not parts and pool is None):
                    parts.append(model)
                if pool is not None:
                    parts.append(pool)
                columns.append(Column("/".join(parts), endpoint, model, pool))
    return columns


def discover_pools(
    endpoint: str, model: str, headers: dict[str, str], timeout_s: float = 30.0
) -> list[str]:
    """The device types with a RUNNING workload serving ``model`` on a Kunlun daemon."""
    url = endpoint + "/api/v1/workloads"
    try:
        resp = httpx.get(url, headers=headers, timeout=timeout_s)
    except httpx.TransportError as exc:
        raise ConfigError(f"cannot reach {url}: {exc}", location=Location("--all-pools")) from None
    if resp.status_code != 200:
        raise ConfigError(
            f"GET {url} -> {resp.status_code}; --all-pools needs a Kunlun daemon's admin API",
            location=Location("--all-pools"),
            hint="pass --api-key when the daemon has keys",
        )
    return pools_of(resp.json(), model)


def pools_of(workloads: Any, model: str) -> list[str]:
    """The pools serving ``model`` in a ``GET /api/v1/workloads`` answer: its device types,
    each split per engine where several engines serve it there (:func:`columns_of`)."""
    served: set[tuple[str, str]] = set()
    for w in workloads if isinstance(workloads, list) else []:
        if not isinstance(w, dict) or w.get("state") != "RUNNING" or w.get("name") != model:
            continue
        engine = str(w.get("engine") or DEFAULT_ENGINE)
        for device in str(w.get("target_device") or "").split(","):
            if device.strip():
                served.add((device.strip().rpartition("/")[2].partition(":")[0], engine))
    return columns_of(served)


def with_reference(columns: list[Column], reference: str | None, model: str | None) -> list[Column]:
    """``columns`` with the reference marked (and moved first, since others compare to it);
    a reference URL that is no column yet becomes a new column ``reference``."""
    if not columns and reference is None:
        raise ConfigError(
            "nothing to validate", hint="give --endpoint URL --model M, or --target NAME=URL"
        )
    index = 0
    if reference is not None:
        names = [c.name for c in columns]
        if reference in names:
            index = names.index(reference)
        else:
            if not reference.startswith(("http://", "https://")):
                raise ConfigError(
                    f"{reference!r} is neither a column ({', '.join(names)}) nor an http(s) URL",
                    location=Location("--reference"),
                )
            url = normalize_endpoint(reference, "--reference")
            same = [i for i, c in enumerate(columns) if c.endpoint == url]
            if len(same) == 1:
                index = same[0]
            elif same:
                raise ConfigError(
                    f"{reference!r} matches {len(same)} columns; name one of: {', '.join(names)}",
                    location=Location("--reference"),
                )
            elif model is None:
                raise ConfigError(
                    "a reference endpoint needs --model", location=Location("--reference")
                )
            else:
                columns = [Column("reference", url, model), *columns]
    ordered = [columns[index], *columns[:index], *columns[index + 1 :]]
    ordered[0] = dataclasses.replace(ordered[0], reference=True)
    names = [c.name for c in ordered]
    duplicates = sorted({n for n in names if names.count(n) > 1})
    if duplicates:
        raise ConfigError(
            f"column names must differ; repeated: {', '.join(duplicates)}",
            location=Location("--target"),
        )
    return ordered
