"""Screenshots of dashboard pages for the acceptance reports (:mod:`kunlun.validate.screenshots`)
in Debian's chromium, found on PATH, against a real daemon of its own with an admin key (its
own: the wrong keys tried here count against the keyring's limit on wrong keys): two pages
taken whole, a page that answers 404 said as missing while the others are taken, a wrong
key (or none) refused naming the login, and a browser that is not there a reason rather
than an error."""

from __future__ import annotations

import struct
from pathlib import Path

import pytest
from tests.daemons import Daemon, Profile, daemon_fixture

from kunlun.errors import ConfigError
from kunlun.validate.screenshots import BROWSER_ENV, take

CHROMIUM = Path("/usr/bin/chromium")
pytest.importorskip("playwright.sync_api")
pytestmark = pytest.mark.skipif(not CHROMIUM.exists(), reason="needs Debian's chromium")
PNG = b"\x89PNG\r\n\x1a\n"

shots_daemon = daemon_fixture(Profile("shots-home", keys=(("admin", "admin"),)))


def png_size(path: Path) -> tuple[int, int]:
    """A PNG's width and height (its IHDR chunk), after checking its signature."""
    data = path.read_bytes()
    assert data[:8] == PNG and data[12:16] == b"IHDR", data[:16]
    assert len(data) > 5000, len(data)  # a drawn page, not an empty picture
    width, height = struct.unpack(">II", data[16:24])
    return width, height


def test_pages_are_taken_whole_after_logging_in(
    shots_daemon: Daemon, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv(BROWSER_ENV, raising=False)  # the chromium on PATH
    admin = shots_daemon.keys["admin"]
    shots = take(shots_daemon.url, admin, ["/ui/devices", "/ui/workloads"], tmp_path / "a")
    assert shots.missing is None
    assert shots.files == {"/ui/devices": tmp_path / "a" / "devices.png",
                           "/ui/workloads": tmp_path / "a" / "workloads.png"}  # fmt: skip
    for path in shots.files.values():
        width, height = png_size(path)
        assert width == 1280 and height >= 800, (path, width, height)

    shots = take(shots_daemon.url, admin, ["/ui/no-such-page", "/ui/devices"], tmp_path / "b")
    assert list(shots.files) == ["/ui/devices"]
    png_size(shots.files["/ui/devices"])
    assert shots.missing == "no screenshot of /ui/no-such-page (HTTP 404)"


def test_a_wrong_key_is_refused_naming_the_login(shots_daemon: Daemon, tmp_path: Path) -> None:
    with pytest.raises(ConfigError) as refused:
        take(shots_daemon.url, "kl-not-a-real-key", ["/ui/devices"], tmp_path)
    said = str(refused.value)
    assert f"{shots_daemon.url}/ui/login (key)" in said and "not an active API key" in said
    assert "kl-not-a-real-key" not in said and not list(tmp_path.iterdir())
    with pytest.raises(ConfigError, match="needs an API key"):
        take(shots_daemon.url, None, ["/ui/devices"], tmp_path)


def test_no_browser_is_a_reason_not_an_error(
    shots_daemon: Daemon, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(BROWSER_ENV, "/nonexistent")
    shots = take(shots_daemon.url, shots_daemon.keys["admin"], ["/ui/devices"], tmp_path)
    assert shots.files == {} and not list(tmp_path.iterdir())
    assert shots.missing is not None and "KUNLUN_CHROMIUM=/nonexistent" in shots.missing
