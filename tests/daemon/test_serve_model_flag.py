"""``kunlun-platform --model SOURCE`` with vLLM's flags: one step from a model to a served
endpoint. SOURCE from the local Hugging Face cache (a real cache layout over the tiny model),
a GGUF file (a tiny one), and bad values of the flags, each refused by name (``--chat-template`` and
``--gpu-memory-utilization`` served: ``test_vllm_flags.py``)."""

from __future__ import annotations

import json
from pathlib import Path

import openai
import pytest
from tests.daemons import Daemons, Profile, make_home, refused
from tests.engine.gguf_bytes import gguf_bytes, tiny_llama

REPO = "kunlun-tests/tiny-llama"
"""A repo id the Hugging Face cache below holds (the tiny model: nothing is downloaded)."""
MODEL = "{tiny}"
"""Stands for the tiny model's folder in the refusals' arguments."""


def hf_cache(root: Path, model_dir: Path) -> Path:
    """A Hugging Face hub cache holding ``REPO`` at one revision (a snapshot of links)."""
    repo = root / "hub" / ("models--" + REPO.replace("/", "--"))
    snapshot = repo / "snapshots" / "0123abcd"
    snapshot.mkdir(parents=True)
    for item in model_dir.iterdir():
        (snapshot / item.name).symlink_to(item.resolve())
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text("0123abcd")
    return root


HF_REPO = Profile(
    "serve-flag-home",
    args=("--model", REPO, "--served-model-name", "tiny-chat", "--dtype", "float32",
          "--max-model-len", "512", "--max-num-seqs", "4"),
    env=(("HF_HOME", "{home}/hf"),), ready=True,
)  # fmt: skip
"""``REPO`` served by ``--model`` from the Hugging Face cache in the home (:func:`hf_cache`)."""


def test_a_repo_id_in_the_hf_cache_is_served_under_the_name_given(
    tiny_model: Path, daemons: Daemons
) -> None:
    home = daemons.home(HF_REPO)
    hf_cache(home / "hf", tiny_model)
    with daemons.serve(HF_REPO, home) as daemon:
        client = openai.OpenAI(base_url=daemon.url + "/v1", api_key="x", max_retries=0)
        (card,) = client.models.list().data
        assert card.id == "tiny-chat" and card.model_extra["max_model_len"] == 512  # type: ignore[index]
        reply = client.chat.completions.create(
            model="tiny-chat", messages=[{"role": "user", "content": "Hi"}], max_tokens=4
        )
        assert reply.choices[0].message.content
        (row,) = json.loads(daemon.cli("workload", "list", "--json").stdout)
        spec = daemon.get(f"/api/v1/workloads/{row['workload_id']}").json()["spec"]
        assert (spec["dtype"], spec["max_num_seqs"], spec["max_model_len"]) == ("fp32", 4, 512)
        assert spec["model"].endswith("snapshots/0123abcd")


@pytest.mark.parametrize(
    ("args", "words"),
    [
        (["--model", "nobody/nothing"], ["--model 'nobody/nothing'", "local cache", "downloaded"]),
        (["--model", MODEL, "--dtype", "fp64"], ["--dtype 'fp64'", "bfloat16"]),
        (["--max-model-len", "512"], ["--max-model-len only apply with --model"]),
        (["--model", MODEL, "--gpu-memory-utilization", "1.5"],
         ["memory_utilization", "less than or equal to 1"]),
        (["--model", MODEL, "--chat-template", "nowhere/t.jinja"],
         ["--chat-template: no such file 'nowhere/t.jinja'"]),
        (["--model", MODEL, "--chat-template", "{% for m in messages %}"],
         ["chat_template: line 1", "endfor"]),
        (["--chat-template", "{{ x }}"], ["--chat-template only apply with --model"]),
        (["--model", MODEL, "--quantization", "fp4"], ["quantization", "fp4"]),
    ],
)  # fmt: skip
def test_what_cannot_be_served_is_refused_by_name(
    tiny_model: Path, tmp_path_factory: pytest.TempPathFactory, args: list[str], words: list[str]
) -> None:
    home = make_home(tmp_path_factory, "serve-refused")
    args = [str(tiny_model) if arg == MODEL else arg for arg in args]
    proc = refused(home, *args, env={"HF_HOME": str(tmp_path_factory.mktemp("empty-hf"))})
    assert proc.returncode == 2, proc.stdout + proc.stderr
    for word in words:
        assert word in proc.stderr, proc.stderr


def test_a_gguf_file_is_imported_once_under_its_stem(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from kunlun import catalog
    from kunlun.state.sqlite import SQLiteStore

    home = tmp_path / "home"
    home.mkdir()
    monkeypatch.setenv("KUNLUN_HOME", str(home))  # the import is written under it
    original = tmp_path / "tiny-llama.gguf"
    original.write_bytes(gguf_bytes(tiny_llama()))
    gguf = tmp_path / "my-model.gguf"
    gguf.symlink_to(original)
    store = SQLiteStore(home / "state.db")
    try:
        assert catalog.model_source(store, str(gguf)) == ("my-model", "my-model")
        record = store.get_model("my-model")
        assert record is not None and record.source == f"gguf:{original.resolve()}"
        assert Path(record.path).is_relative_to(home / "models")
        assert catalog.model_source(store, "my-model") == ("my-model", "my-model")  # known now
    finally:
        store.close()
