"""``kunlun-installer``: install the platform and its model packages on an air-gapped machine.

Standard library only, so the same code runs before anything is installed: the offline
bundle carries it as ``kunlun-installer.pyz`` (a zipapp of this module and the few
standard-library-only modules it imports), and an installed platform has it as the
``kunlun-installer`` command.

    kunlun-installer bundle -o kunlun-offline.tar --key signing.key     # connected machine
    tar -xf kunlun-offline.tar kunlun-installer.pyz                      # air-gapped machine
    python3 kunlun-installer.pyz install --bundle kunlun-offline.tar --public-key K \\
        --prefix /opt/kunlun --home /var/lib/kunlun --package model.kunlunpkg
    kunlun-installer install --package model.kunlunpkg                  # later packages
    kunlun-installer trust add K | list | remove FINGERPRINT            # what the home trusts
    kunlun-installer --repair                                            # restore damage

``install --bundle`` checks the bundle's signature with the public key given (pure-Python
Ed25519, :mod:`.ed25519`: the bundle's own ``cryptography`` wheel cannot vouch for itself),
then every wheel's SHA-256 and the unpacking limits, creates a virtual environment at
``--prefix`` and installs the platform into it with ``pip --no-index`` from the bundle's
wheels only (pip's configuration files are ignored, so no index or find-links from the
machine leaks in), records the key that verified the bundle as trusted in
``HOME/trusted-keys/`` (and says so), writes the systemd unit, and installs each
``--package`` with the new environment's ``kunlun-installer``. A failure at any step removes
the prefix it created: nothing is left half-installed.

Trust is explicit (:mod:`.trust`): ``HOME/trusted-keys/`` gets a key only from the bundle
install, ``--trust-key``, ``kunlun-installer trust add`` or a home's first package install,
each said in the output and audited; a key given with ``--public-key`` is otherwise used for
that one command only.
"""

from __future__ import annotations

import argparse
import base64
import binascii
import getpass
import hashlib
import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import IO

from kunlun.address import DEFAULT_HOST, DEFAULT_PORT
from kunlun.errors import ConfigError, KunlunError, Location, PackageError, SignatureError
from kunlun.offline import ed25519
from kunlun.offline.archive import ArchiveError, ArchiveReader, Limits, refused
from kunlun.offline.manifest import BUNDLE_FORMAT, FileEntry, ManifestError, parse
from kunlun.offline.trust import key_fingerprint, trust_command, trust_line

PLATFORM_REQUIREMENT = "kunlun-platform[engine]"
"""What a bundle installs (the platform and its portable engine)."""
INSTALLER_MEMBER = "kunlun-installer.pyz"
WHEELS_DIR = "wheels"
UNIT_NAME = "kunlun-platform.service"

UNIT_TEMPLATE = """\
# systemd unit for the Kunlun Platform daemon, written by kunlun-installer.
# Install: copy (or link) to /etc/systemd/system/, then
# `systemctl daemon-reload && systemctl enable --now kunlun-platform`.
[Unit]
Description=Kunlun Platform (chip-agnostic LLM inference)
After=network-online.target
Wants=network-online.target

[Service]
Type=simple
User={user}
Environment=KUNLUN_HOME={home}
# Serves only signed packages; trusted keys are the ones the installer was given.
ExecStart={prefix}/bin/kunlun-platform --host {host} --port {port} --require-signed \
--trusted-keys {home}/trusted-keys
# SIGTERM drains: in-flight requests finish, new ones get 503, then the daemon exits 0.
KillSignal=SIGTERM
# `systemctl reload kunlun-platform`: re-read scheduler_config.yaml now.
ExecReload=/bin/kill -HUP $MAINPID
TimeoutStopSec=180
Restart=on-failure
RestartSec=5
LimitNOFILE=65536
# Everything under KUNLUN_HOME is private (the daemon also sets this umask itself).
UMask=0077
# Lets the worker sandbox make one cgroup v2 per workload (memory.max, cpu.max; docs/sandbox.md).
Delegate=yes

[Install]
WantedBy=multi-user.target
"""


def systemd_unit(prefix: Path, home: Path, user: str) -> str:
    return UNIT_TEMPLATE.format(prefix=prefix, home=home, user=user, host=DEFAULT_HOST,
                                port=DEFAULT_PORT)  # fmt: skip


def default_home() -> Path:
    return Path(os.environ.get("KUNLUN_HOME") or Path.home() / ".kunlun")


def verify_bundle_header(reader: ArchiveReader, public_keys: Sequence[Path]) -> tuple[str, bytes]:
    """Check the bundle manifest's signature with one of ``public_keys`` (pure Python);
    returns the signer's fingerprint and the manifest bytes."""
    try:
        data, signature_text = reader.header()
    except ArchiveError as exc:
        raise refused(exc, reader.path) from None
    try:
        signature = base64.b64decode(signature_text.strip(), validate=True)
    except (binascii.Error, ValueError):
        signature = b""
    where = Location(f"{reader.path}:manifest.sig")
    tried = []
    for path in public_keys:
        try:
            key = ed25519.public_key_from_pem(path.read_bytes())
        except (OSError, ValueError) as exc:
            raise ConfigError(
                f"not an Ed25519 public key: {exc}", location=Location(str(path))
            ) from None
        try:
            ed25519.verify(key, signature, data)
            return "SHA256:" + hashlib.sha256(key).hexdigest(), data
        except ed25519.BadSignature as exc:
            tried.append(f"{path.name}: {exc}")
    raise SignatureError(
        "the bundle's signature does not verify with the public key(s) given "
        f"({'; '.join(tried)}): signed by an untrusted key, or the bytes were changed",
        location=where,
    )


def run_step(cmd: list[str], what: str, env: dict[str, str] | None = None) -> None:
    """Run one step of an install or a bundle build; a failure is a :class:`PackageError`
    naming the step and ending with the last lines the command printed."""
    done = subprocess.run(cmd, env=env, capture_output=True, text=True)
    if done.returncode != 0:
        tail = (done.stderr or done.stdout).strip().splitlines()[-15:]
        raise PackageError(f"{what} failed (exit {done.returncode}):\n" + "\n".join(tail))


def offline_pip_env() -> dict[str, str]:
    """pip's environment for an offline install: no configuration file, no index."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("PIP_")}
    env.update(PIP_CONFIG_FILE=os.devnull, PIP_NO_INDEX="1", PIP_DISABLE_PIP_VERSION_CHECK="1")
    return env


def install_bundle(
    bundle: Path,
    public_keys: Sequence[Path],
    prefix: Path,
    home: Path,
    *,
    trust: Sequence[Path] = (),
    user: str | None = None,
    systemd_dir: Path | None = None,
    python: str = sys.executable,
    say: Callable[[str], object] = print,
) -> Path:
    """Verify ``bundle`` with ``public_keys`` or ``trust`` and install the platform into a new
    virtual environment at ``prefix``; returns the systemd unit's path. ``prefix`` must not
    exist or be empty. The key that verified the bundle, and every key of ``trust``, are
    recorded as trusted in ``HOME/trusted-keys``."""
    if prefix.exists() and any(prefix.iterdir()):
        raise ConfigError(
            "the prefix exists and is not empty; install into a new directory",
            location=Location(str(prefix)),
        )
    if not bundle.is_file():
        raise PackageError("bundle file not found", location=Location(str(bundle)))
    created_prefix = not prefix.exists()
    prefix.parent.mkdir(parents=True, exist_ok=True)
    scratch = Path(tempfile.mkdtemp(prefix=".kunlun-bundle-", dir=prefix.parent))
    try:
        with _open(bundle) as reader:
            signer, data = verify_bundle_header(reader, [*public_keys, *trust])
            try:
                manifest = parse(data, f"{bundle}:manifest.json", BUNDLE_FORMAT)
                Limits().check(manifest, reader.size)
                for _entry in reader.files(manifest, _writer_into(scratch)):
                    pass
            except (ArchiveError, ManifestError) as exc:
                raise refused(exc, bundle) from None
        say(f"bundle {bundle}: signature by {signer}; {len(manifest.files)} files verified")
        home.mkdir(parents=True, exist_ok=True, mode=0o700)
        prefix.mkdir(parents=True, exist_ok=True)
        run_step([python, "-m", "venv", str(prefix)], "creating the virtual environment")
        wheels = scratch / WHEELS_DIR
        run_step(
            [str(prefix / "bin" / "python"), "-m", "pip", "install", "--no-index",
             "--find-links", str(wheels), "--no-compile", "-q", PLATFORM_REQUIREMENT],
            "pip install --no-index from the bundle's wheels",
            env=offline_pip_env(),
        )  # fmt: skip
        say(f"installed {PLATFORM_REQUIREMENT} into {prefix} (pip --no-index)")
        unit_dir = systemd_dir or prefix / "share" / "systemd"
        unit_dir.mkdir(parents=True, exist_ok=True)
        unit = unit_dir / UNIT_NAME
        unit.write_text(systemd_unit(prefix, home, user or getpass.getuser()), encoding="utf-8")
        say(f"systemd unit {unit}")
        # the last step: only an installed platform trusts a key for good
        by_fingerprint = {key_fingerprint(path): path for path in [*public_keys, *trust]}
        recorded = {signer: "it verified the bundle"}
        for path in trust:
            recorded.setdefault(key_fingerprint(path), "--trust-key")
        for fp, reason in recorded.items():
            say(trust_line(home, by_fingerprint[fp], reason))
        return unit
    except BaseException:
        if created_prefix:
            shutil.rmtree(prefix, ignore_errors=True)
        else:  # it was empty: leave it empty
            for child in prefix.iterdir():
                shutil.rmtree(child) if child.is_dir() else child.unlink()
        raise
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


def _open(path: Path) -> ArchiveReader:
    try:
        return ArchiveReader(path, "bundle")
    except ArchiveError as exc:
        raise refused(exc, path) from None


def _writer_into(root: Path) -> Callable[[FileEntry], Callable[[memoryview], object]]:
    handles: list[IO[bytes]] = []

    def sink(entry: FileEntry) -> Callable[[memoryview], object]:
        while handles:
            handles.pop().close()
        target = root / entry.path
        target.parent.mkdir(parents=True, exist_ok=True)
        handle = target.open("xb")
        handles.append(handle)
        return handle.write

    return sink


# ---- the command line ------------------------------------------------------------------


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="kunlun-installer",
        description="Install Kunlun Platform and signed model packages offline.",
    )
    parser.add_argument("--repair", action="store_true",
                        help="re-verify installed packages and restore damaged files")  # fmt: skip
    parser.add_argument(
        "--home", type=Path, help="KUNLUN_HOME (default: $KUNLUN_HOME or ~/.kunlun)"
    )
    parser.add_argument("--public-key", type=Path, action="append", default=[],
                        help="a public key (PEM) trusted for this command only, besides "
                        "HOME/trusted-keys (repeatable)")  # fmt: skip
    parser.add_argument("--package", type=Path, action="append", default=[],
                        help="a model package (.kunlunpkg; repeatable)")  # fmt: skip
    sub = parser.add_subparsers(dest="command")
    b = sub.add_parser("bundle", help="collect the platform's wheels into a signed bundle")
    b.add_argument("-o", "--out", type=Path, required=True)
    b.add_argument("--key", type=Path, required=True, help="private signing key (PEM)")
    b.add_argument("--torch-wheel", type=Path, help="torch wheel for the target's chip")
    b.add_argument("--source", type=Path, help="the platform's source tree (default: found)")
    b.add_argument("--python-version", help="target Python, e.g. 3.11 (default: this one)")
    b.add_argument("--platform", help="target wheel platform, e.g. manylinux_2_28_x86_64")
    b.add_argument("--bundle-version", type=int, help="default: creation time")
    i = sub.add_parser("install", help="install a bundle and/or model packages")
    i.add_argument("--bundle", type=Path, help="the signed offline bundle (kunlun-offline.tar)")
    i.add_argument("--prefix", type=Path, help="new virtual environment (with --bundle)")
    i.add_argument("--systemd-dir", type=Path, help="where the unit goes (default PREFIX/share)")
    i.add_argument("--user", help="the unit's User= (default: this user)")
    i.add_argument("--public-key", type=Path, action="append", default=[], dest="keys",
                   metavar="KEY", help="a public key (PEM) trusted for this command only; with "
                   "--bundle, the one that verifies the bundle is recorded as trusted "
                   "(repeatable)")  # fmt: skip
    i.add_argument("--trust-key", type=Path, action="append", default=[], dest="trust",
                   metavar="KEY", help="a public key (PEM) to use and record as trusted in "
                   "HOME/trusted-keys, for later installs and kunlun-platform "
                   "--require-signed (repeatable)")  # fmt: skip
    i.add_argument("--allow-signer-change", action="store_true",
                   help="let a package signed by another key than the one its model was first "
                   "installed with replace it (the change is recorded and audited)")  # fmt: skip
    i.add_argument("--package", type=Path, action="append", default=[], dest="packages",
                   metavar="PACKAGE", help="a model package (.kunlunpkg; repeatable)")  # fmt: skip
    i.add_argument("--home", type=Path, dest="sub_home", metavar="HOME",
                   help="KUNLUN_HOME (default: $KUNLUN_HOME or ~/.kunlun)")  # fmt: skip
    t = sub.add_parser("trust", help="the keys this home trusts for good (HOME/trusted-keys)")
    actions = t.add_subparsers(dest="trust_action", required=True, metavar="add|list|remove")
    trust_actions = {
        "add": "record a public key (PEM) as trusted",
        "list": "the trusted keys and the models pinned to each (JSON)",
        "remove": "stop trusting a key (its .pub file or fingerprint)",
    }
    for action, text in trust_actions.items():
        a = actions.add_parser(action, help=text)
        if action != "list":
            a.add_argument("key", metavar="KEY")
        a.add_argument("--home", type=Path, dest="sub_home", metavar="HOME",
                       help="KUNLUN_HOME (default: $KUNLUN_HOME or ~/.kunlun)")  # fmt: skip
    u = sub.add_parser("unit", help="print the systemd unit for a prefix and home")
    u.add_argument("--prefix", type=Path, required=True)
    u.add_argument("--home", type=Path, dest="sub_home", metavar="HOME", required=True)
    u.add_argument("--user", default="kunlun")
    listing = sub.add_parser("list", help="installed model packages")
    listing.add_argument("--home", type=Path, dest="sub_home", metavar="HOME",
                         help="KUNLUN_HOME (default: $KUNLUN_HOME or ~/.kunlun)")  # fmt: skip
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    try:
        return _dispatch(args)
    except KunlunError as exc:
        print(f"error [{exc.code}] {exc}", file=sys.stderr)
        return exc.exit_code
    except KeyboardInterrupt:
        return 130


def _dispatch(args: argparse.Namespace) -> int:
    home = (getattr(args, "sub_home", None) or args.home or default_home()).absolute()
    keys = [*args.public_key, *getattr(args, "keys", [])]
    packages = [*args.package, *getattr(args, "packages", [])]
    if args.repair:
        from kunlun.offline.commands import repair_command

        return repair_command(home, keys, packages)
    if args.command == "bundle":
        from kunlun.offline.bundle import build_bundle

        build_bundle(args.out, args.key, torch_wheel=args.torch_wheel, source=args.source,
                     python_version=args.python_version, platform=args.platform,
                     version=args.bundle_version)  # fmt: skip
        return 0
    if args.command == "unit":
        print(systemd_unit(args.prefix.absolute(), home, args.user), end="")
        return 0
    if args.command == "list":
        from kunlun.offline.commands import list_command

        return list_command(home)
    if args.command == "trust":
        return trust_command(home, args.trust_action, getattr(args, "key", None))
    if args.command == "install":
        if args.bundle is None:
            if not packages:
                raise ConfigError("give --bundle or --package", location=Location("install"))
            from kunlun.offline.commands import install_packages

            return install_packages(home, keys, packages, trust=args.trust,
                                    allow_signer_change=args.allow_signer_change)  # fmt: skip
        if not keys and not args.trust:
            raise ConfigError("give the bundle's --public-key", location=Location("--public-key"))
        if args.prefix is None:
            raise ConfigError("--bundle needs --prefix", location=Location("--prefix"))
        prefix = args.prefix.absolute()
        install_bundle(args.bundle, keys, prefix, home, trust=args.trust, user=args.user,
                       systemd_dir=args.systemd_dir)  # fmt: skip
        if packages:  # the bundle's key is trusted now; the other keys for this command only
            env = {**os.environ, "KUNLUN_HOME": str(home)}
            cmd = [str(prefix / "bin" / "kunlun-installer"), "install", "--home", str(home)]
            for key in keys:
                cmd += ["--public-key", str(key.absolute())]
            if args.allow_signer_change:
                cmd.append("--allow-signer-change")
            for package in packages:
                cmd += ["--package", str(package.absolute())]
            return subprocess.run(cmd, env=env).returncode
        return 0
    _parser().print_help()
    return 2


if __name__ == "__main__":
    sys.exit(main())
