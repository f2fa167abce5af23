"""A K-quant GGUF end to end on a real daemon: the demo model written as a Q4_K GGUF (the
projections whose rows allow it, ``ffn_down``, in Q4_K; the others, 576 wide, and the
embedding in Q8_0: the demo is already 4-bit, so the file stays close to it), imported with ``kunlun-cli model import-gguf`` (4-bit layers kept as
w4a16, the rest bf16), submitted as a workload on cpu:0, answering through the ``openai``
SDK, and passing ``kunlun-cli validate``."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import openai
import pytest
from gguf import GGMLQuantizationType as QT
from tests.daemons import (
    PATIENT,
    QUALITY_ROWS,
    Daemon,
    Daemons,
    Profile,
    assert_validate_passes,
)
from tests.engine.gguf_files import write_demo_kquant_gguf

NAME = "smollm2-q4k"
KQUANT = Profile(
    "kquant-home",
    (f"model: {NAME}\nname: {NAME}\ndevice: cpu:0\nmax_num_seqs: 4\nmax_model_len: 1024\n"
     "kv_cache_memory_mb: 64\n",),
    files=(PATIENT,), demo=True,
)  # fmt: skip
"""The Q4_K import (made in the home before the daemon starts) as workload ``smollm2-q4k``."""


@pytest.fixture(scope="module")
def kquant(
    request: pytest.FixtureRequest,
    demo_model_dir: Path,
    demo_gguf: Path,
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[Daemon]:
    """A daemon serving the Q4_K import of the demo model as ``smollm2-q4k`` on cpu:0."""
    folder = tmp_path_factory.mktemp("kquant-gguf")
    gguf = write_demo_kquant_gguf(
        folder / "smollm2-q4_k.gguf", demo_model_dir, demo_gguf, fallback=QT.Q8_0
    )
    daemons = Daemons(request)
    home = daemons.home(KQUANT)
    imported = Daemon(home, 0).cli("model", "import-gguf", str(gguf), "--name", NAME,
                                   remote=False, timeout=900)  # fmt: skip
    assert imported.returncode == 0, imported.stderr
    config = json.loads((home / "models" / NAME / "config.json").read_text())
    assert config["quantization_config"]["scheme"] == "w4a16"
    with daemons.serve(KQUANT, home) as daemon:
        yield daemon


def test_a_k_quant_gguf_import_serves_as_w4a16(kquant: Daemon) -> None:
    client = openai.OpenAI(base_url=kquant.url + "/v1", api_key="none", max_retries=0,
                           timeout=300)  # fmt: skip
    answer = client.chat.completions.create(
        model=NAME,
        messages=[{"role": "user", "content": "What is the capital of France?"}],
        max_tokens=12,
        temperature=0,
    )
    assert "Paris" in (answer.choices[0].message.content or "")
    rows = json.loads(kquant.cli("workload", "list", "--json").stdout)
    job = next(w["workload_id"] for w in rows if w["name"] == NAME)
    assert kquant.describe(job)["placement"]["plan"]["quantization"] == "w4a16"


@pytest.mark.parametrize("part", QUALITY_ROWS)
def test_validate_passes_on_the_k_quant_workload(kquant: Daemon, tmp_path: Path, part: str) -> None:
    assert_validate_passes(kquant, NAME, tmp_path / "out", QUALITY_ROWS[part])
