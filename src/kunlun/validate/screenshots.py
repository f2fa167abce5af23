"""Screenshots of dashboard pages for the acceptance reports, taken in a real headless browser.

:func:`take` logs in to a daemon's dashboard (``/ui/login``) the way an operator does, opens
each page asked for in a 1280x800 window and writes a full-page PNG of it. The browser is
Playwright's (the ``screenshots`` extra: ``pip install 'kunlun-platform[screenshots]'``)
driving the machine's own Chromium: :data:`BROWSER_ENV` if set, else the first of
:data:`BROWSERS` on ``PATH``. Nothing is ever downloaded (air-gapped sites): there is no
``playwright install`` here, and no browser is a reason said in the report, not an error.

- A daemon with API keys takes the key given; a wrong one (or none) is the operator's input
  and raises :class:`~kunlun.errors.ConfigError` naming the login. A daemon without keys has
  an open dashboard: its login page has only a *Continue* button, which lets anyone in with
  admin rights, and that is what is pressed (the key, if any, is not needed).
- A page that answers with an error status (or sends the browser back to the login) is not
  taken and is said in :attr:`Shots.missing` with the status; the other pages still are.
- Every launch, navigation and screenshot has the timeout ``timeout_s``.

Playwright is imported inside :func:`take` only, so that ``kunlun-cli`` starts without it.
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING
from urllib.parse import urlsplit

from kunlun.errors import ConfigError, Location

if TYPE_CHECKING:
    from playwright.sync_api import Browser, Page, Playwright

BROWSER_ENV = "KUNLUN_CHROMIUM"
"""An executable path: the browser to use, instead of looking on ``PATH``."""
BROWSERS = ("chromium", "chromium-browser", "google-chrome")
"""The browsers looked for on ``PATH``, first found used."""
WIDTH, HEIGHT = 1280, 800
"""The window (the viewport); a page taller than it is taken whole."""
LOGIN = "/ui/login"
INSTALL = "pip install 'kunlun-platform[screenshots]'"
SETTLE_S = 10.0
"""At most this long (within ``timeout_s``) waiting for a page's own requests to end (the
Playground's model list, the Metrics page's series) before its screenshot."""


@dataclass
class Shots:
    """What :func:`take` wrote."""

    files: dict[str, Path] = field(default_factory=dict)
    """Page path (``/ui/devices``) -> the PNG written."""
    missing: str | None = None
    """Why none, or some, were taken (said in the report); None when all were."""


class _NoShots(Exception):
    """Why no screenshot at all can be taken (a browser that does not start, a daemon that
    does not answer), said in :attr:`Shots.missing`."""


def take(
    endpoint: str, key: str | None, pages: list[str], out: Path, timeout_s: float = 60
) -> Shots:
    """Screenshots of ``pages`` (paths such as ``/ui/devices``) of the dashboard at
    ``endpoint``, logged in with ``key``, as ``out/<name>.png`` (:func:`shot_names`).

    Never raises for a missing or broken browser (see :class:`Shots`); raises
    :class:`~kunlun.errors.ConfigError` when the dashboard refuses the key, or needs one and
    none was given."""
    names = shot_names(pages)
    try:
        from playwright.sync_api import Error, sync_playwright
    except ImportError:
        return Shots({}, f"no screenshots: playwright is not installed ({INSTALL})")
    browser = find_browser()
    if isinstance(browser, str):
        return Shots({}, f"no screenshots: {browser}")
    out.mkdir(parents=True, exist_ok=True)
    base = endpoint.rstrip("/")
    ms = timeout_s * 1000
    try:
        with sync_playwright() as play:
            chromium = _launch(play, browser, ms)
            try:
                context = chromium.new_context(viewport={"width": WIDTH, "height": HEIGHT})
                context.set_default_timeout(ms)
                context.set_default_navigation_timeout(ms)
                page = context.new_page()
                _login(page, base, key)
                return _shoot(page, base, names, out, min(ms, SETTLE_S * 1000))
            finally:
                chromium.close()
    except _NoShots as exc:
        return Shots({}, f"no screenshots: {exc}")
    except (Error, OSError) as exc:  # Playwright's driver not starting, the browser dying
        return Shots({}, f"no screenshots: the browser failed: {_first_line(exc)}")


def find_browser() -> Path | str:
    """The Chromium to drive (:data:`BROWSER_ENV`, else the first of :data:`BROWSERS` on
    ``PATH``), or why there is none and how to get one."""
    named = os.environ.get(BROWSER_ENV)
    if named:
        path = Path(named).expanduser()
        if path.is_file() and os.access(path, os.X_OK):
            return path
        return (f"{BROWSER_ENV}={named} is not an executable file (point it at a Chromium, "
                "or unset it to use the chromium on PATH)")  # fmt: skip
    for name in BROWSERS:
        found = shutil.which(name)
        if found:
            return Path(found)
    return f"no Chromium found (install Debian's chromium or set {BROWSER_ENV})"


def shot_names(pages: list[str]) -> dict[str, str]:
    """Page path -> the name of its PNG: the path after ``/ui/`` with any other character
    than letters, digits, ``.``, ``_`` and ``-`` as ``-`` (``/ui/devices`` -> ``devices``,
    ``/ui/workloads/w-1`` -> ``workloads-w-1``, ``/ui`` -> ``ui``); a repeated name gets
    ``-2``, ``-3``..."""
    names: dict[str, str] = {}
    for path in pages:
        if not path.startswith("/"):
            raise ConfigError(f"not a dashboard path: {path!r} (one such as /ui/devices)",
                              location=Location("pages", field=path))  # fmt: skip
        stem = path.split("#", 1)[0]
        stem = stem[len("/ui/") :] if stem.startswith("/ui/") else stem
        name = re.sub(r"[^A-Za-z0-9._-]+", "-", stem).strip("-.") or "ui"
        unique, n = name, 2
        while unique in names.values():
            unique, n = f"{name}-{n}", n + 1
        names.setdefault(path, unique)
    return names


def _launch(play: Playwright, path: Path, ms: float) -> Browser:
    """Headless Chromium at ``path``: sandboxed where it can be; as root (where Chromium's
    sandbox refuses to start) or where the sandbox fails (a container without user
    namespaces), with ``--no-sandbox``. The browser loads only the daemon's own pages, whose
    Content-Security-Policy lets nothing else in."""
    from playwright.sync_api import Error

    tries = [["--no-sandbox"]] if os.geteuid() == 0 else [[], ["--no-sandbox"]]
    failed = ""
    for args in tries:
        try:
            return play.chromium.launch(
                executable_path=str(path), args=args, headless=True, timeout=ms
            )
        except Error as exc:
            failed = _first_line(exc)
    raise _NoShots(f"the browser at {path} did not start: {failed}")


def _login(page: Page, base: str, key: str | None) -> None:
    """Log in at ``/ui/login``: with ``key`` on a daemon with keys, with *Continue* on one
    without (see the module docstring). :class:`ConfigError` when refused."""
    from playwright.sync_api import Error

    url = base + LOGIN
    where = Location(url, field="key")
    try:
        answer = page.goto(url)
    except Error as exc:
        raise _NoShots(f"cannot open {url}: {_first_line(exc)}") from None
    if answer is not None and answer.status >= 400:
        raise _NoShots(f"{url} answered HTTP {answer.status}")
    asks_key = page.locator("input[name=key]").count() > 0
    if asks_key and not key:
        raise ConfigError("the dashboard needs an API key to log in and none was given",
                          location=where, hint="set KUNLUN_API_KEY to an admin key")  # fmt: skip
    if asks_key and key:
        page.fill("input[name=key]", key)
    with page.expect_response(
        lambda r: r.request.method == "POST" and urlsplit(r.url).path == LOGIN
    ) as posted:
        page.click("form button[type=submit]")
    status = posted.value.status
    if status >= 400:
        page.wait_for_load_state()
        error = page.locator("#error")
        said = (error.text_content() or "").strip() if error.count() else ""
        if status >= 500:
            raise _NoShots(f"logging in at {url} failed: HTTP {status} {said}".rstrip())
        raise ConfigError(
            f"the dashboard refused the API key: {said or 'no reason given'} (HTTP {status})",
            location=where,
            hint="pass an active key of this daemon (kunlun-cli apikey list); an admin key "
            "sees every page",
        )
    page.wait_for_url(lambda u: urlsplit(u).path != LOGIN)


def _shoot(page: Page, base: str, names: dict[str, str], out: Path, settle_ms: float) -> Shots:
    """Each page of ``names`` opened and written as ``out/<name>.png``; those not taken said
    in :attr:`Shots.missing` with why."""
    from playwright.sync_api import Error

    files: dict[str, Path] = {}
    missing: list[str] = []
    for path, name in names.items():
        try:
            answer = page.goto(base + path)
            if answer is not None and answer.status >= 400:
                missing.append(f"{path} (HTTP {answer.status})")
                continue
            if urlsplit(page.url).path == LOGIN and path != LOGIN:
                missing.append(f"{path} (sent back to the login: the session ended)")
                continue
            _settle(page, settle_ms)
            target = out / f"{name}.png"
            page.screenshot(path=str(target), full_page=True)
        except Error as exc:  # a navigation or screenshot past its timeout, a network error
            missing.append(f"{path} ({_first_line(exc)})")
            continue
        files[path] = target
    return Shots(files, "no screenshot of " + "; ".join(missing) if missing else None)


def _settle(page: Page, ms: float) -> None:
    """Wait, at most ``ms``, until the page's own requests have ended; a page that keeps
    polling is taken as it is then."""
    from playwright.sync_api import Error

    with contextlib.suppress(Error):
        page.wait_for_load_state("networkidle", timeout=ms)


def _first_line(exc: BaseException) -> str:
    """An error's first line (Playwright's carry a call log after it)."""
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__
