"""``POST /v1/embeddings`` through the real daemon and gateway, with the real openai SDK.

One daemon serves a tiny random Llama three ways: ``kunlun-platform --model DIR --task
embed`` (mean pooling), a YAML spec with ``task: embed`` and ``pooling: last``, and
``kunlun-cli workload submit --model DIR`` for generation. The vectors are checked against
transformers' own final-norm hidden states on the same weights; every refusal is a 400
naming its field."""

from __future__ import annotations

import base64
import json
import shutil
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import openai
import pytest
import torch
import torch.nn.functional as F
from tests import loopback
from tests.daemons import Daemon, Daemons, Profile, assert_unhurt

TEXTS = ["The cat sat on the mat.", "Embeddings are pooled hidden states", "hi"]
MAX_LEN = 64


EMBED = Profile(
    "embed-home",
    (f"model: {{home}}/tiny\nname: tiny-last\ntask: embed\npooling: last\n"
     f"dtype: fp32\nmax_model_len: {MAX_LEN}\nkv_cache_memory_mb: 8\n",),
    args=("--model", "{home}/tiny", "--served-model-name", "tiny-embed", "--task", "embed",
          "--dtype", "float32", "--max-model-len", str(MAX_LEN)),
)  # fmt: skip
"""The home's copy of the tiny model served for embeddings twice (``--model`` with mean
pooling, a workload ``tiny-last`` with last-token pooling)."""


@pytest.fixture(scope="module")
def served(tiny_model: Path, request: pytest.FixtureRequest) -> Iterator[tuple[Daemon, Path]]:
    daemons = Daemons(request)
    home = daemons.home(EMBED)
    tiny = Path(shutil.copytree(tiny_model, home / "tiny"))  # the cached model stays as it is
    config = json.loads((tiny / "config.json").read_text())  # Matryoshka sizes it "declares"
    (tiny / "config.json").write_text(json.dumps({**config, "matryoshka_dimensions": [16, 32]}))
    with daemons.serve(EMBED, home) as daemon:
        proc = daemon.cli("workload", "submit", "--model", str(tiny), "--name", "tiny-gen",
                          "--dtype", "fp32", "--json")  # fmt: skip
        assert proc.returncode == 0, proc.stdout + proc.stderr
        wait_all_ready(daemon, 3)
        yield daemon, tiny


def wait_all_ready(daemon: Daemon, count: int, timeout: float = 300) -> None:
    deadline = time.monotonic() + timeout
    while True:
        rows = daemon.get("/api/v1/workloads").json()
        if len(rows) == count and all(r["ready_replicas"] >= 1 for r in rows):
            return
        if time.monotonic() > deadline or any(r["state"] == "FAILED" for r in rows):
            pytest.fail(f"workloads not ready: {rows}\n{daemon.log()}")
        time.sleep(0.3)


def client(daemon: Daemon) -> openai.OpenAI:
    return openai.OpenAI(base_url=daemon.url + "/v1", api_key="x", max_retries=0)


def token_ids(daemon: Daemon, model: str, text: str) -> list[int]:
    """``text``'s ids as the worker encodes an embeddings input (``/tokenize``)."""
    answer = daemon.get("/tokenize", params=None)  # the route exists (405 for GET)
    assert answer.status_code in (404, 405)
    reply = loopback.post(
        daemon.url + "/tokenize", json={"model": model, "prompt": text}, timeout=30
    )
    assert reply.status_code == 200, reply.text
    return list(reply.json()["tokens"])


def reference(model_dir: Path, batch: list[list[int]], method: str) -> torch.Tensor:
    """transformers' vectors for ``batch``: padded, final-norm hidden states pooled over the
    attention mask (mean, or the last real token), normalised."""
    import transformers

    model = transformers.AutoModel.from_pretrained(model_dir, torch_dtype=torch.float32).eval()
    longest = max(len(ids) for ids in batch)
    ids = torch.tensor([x + [0] * (longest - len(x)) for x in batch])
    mask = torch.tensor([[1] * len(x) + [0] * (longest - len(x)) for x in batch])
    with torch.no_grad():
        hidden = model(input_ids=ids, attention_mask=mask).last_hidden_state
    if method == "mean":
        pooled = (hidden * mask[..., None]).sum(1) / mask.sum(1, keepdim=True)
    else:
        pooled = hidden[torch.arange(len(batch)), mask.sum(1) - 1]
    return F.normalize(pooled, dim=-1)


def post(daemon: Daemon, path: str, body: dict[str, Any]) -> httpx.Response:
    return loopback.post(daemon.url + path, json=body, timeout=60)


@pytest.mark.parametrize(("model", "method"), [("tiny-embed", "mean"), ("tiny-last", "last")])
def test_vectors_match_transformers_hidden_states(
    served: tuple[Daemon, Path], model: str, method: str
) -> None:
    daemon, tiny = served
    answer = client(daemon).embeddings.create(model=model, input=TEXTS, encoding_format="float")
    assert answer.object == "list" and answer.model == model
    assert [d.index for d in answer.data] == [0, 1, 2]
    got = torch.tensor([d.embedding for d in answer.data])
    ids = [token_ids(daemon, model, t) for t in TEXTS]
    expected = reference(tiny, ids, method)
    assert got.shape == expected.shape == (3, 64)
    assert (F.cosine_similarity(got, expected, dim=-1) > 0.999).all()
    assert torch.allclose(got.norm(dim=-1), torch.ones(3), atol=1e-5)
    total = sum(len(x) for x in ids)
    assert (answer.usage.prompt_tokens, answer.usage.total_tokens) == (total, total)


def test_every_input_form_and_base64_equal_float(served: tuple[Daemon, Path]) -> None:
    daemon, _ = served
    sdk = client(daemon)
    ids = [token_ids(daemon, "tiny-embed", t) for t in TEXTS]
    lists = sdk.embeddings.create(model="tiny-embed", input=TEXTS, encoding_format="float")
    floats = [d.embedding for d in lists.data]
    one = sdk.embeddings.create(model="tiny-embed", input=TEXTS[1], encoding_format="float")
    assert len(one.data) == 1 and np.allclose(one.data[0].embedding, floats[1], atol=1e-6)
    assert one.usage.prompt_tokens == len(ids[1])
    by_ids = sdk.embeddings.create(model="tiny-embed", input=ids[0], encoding_format="float")
    assert np.allclose(by_ids.data[0].embedding, floats[0], atol=1e-6)
    by_lists = sdk.embeddings.create(model="tiny-embed", input=ids, encoding_format="float")
    assert np.allclose([d.embedding for d in by_lists.data], floats, atol=1e-6)
    assert by_lists.usage.prompt_tokens == sum(len(x) for x in ids)
    # the SDK asks for base64 when no format is given, and decodes it
    decoded = sdk.embeddings.create(model="tiny-embed", input=TEXTS)
    assert np.allclose([d.embedding for d in decoded.data], floats, atol=1e-6)
    raw = post(daemon, "/v1/embeddings",
               {"model": "tiny-embed", "input": TEXTS, "encoding_format": "base64",
                "user": "someone"}).json()  # fmt: skip
    vectors = [np.frombuffer(base64.b64decode(d["embedding"]), dtype="<f4") for d in raw["data"]]
    assert np.array_equal(np.stack(vectors), np.array(floats, dtype=np.float32))
    same = sdk.embeddings.create(model="tiny-embed", input=TEXTS[0], dimensions=64,
                                 encoding_format="float")  # fmt: skip
    assert np.allclose(same.data[0].embedding, floats[0], atol=1e-6)
    cut = sdk.embeddings.create(model="tiny-embed", input=TEXTS[0], dimensions=16,
                                encoding_format="float").data[0].embedding  # fmt: skip
    expected = np.array(floats[0][:16]) / np.linalg.norm(floats[0][:16])
    assert len(cut) == 16 and np.allclose(cut, expected, atol=1e-6)


VOCAB = "{vocab_size}"
"""Stands for the model's vocabulary size in what a refusal says."""
REFUSALS = [
    ({"model": "tiny-embed", "input": "x", "encoding_format": "int8"}, "encoding_format", "float"),
    ({"model": "tiny-embed", "input": "x", "dimensions": 20}, "dimensions", "16, 32, 64"),
    ({"model": "tiny-embed", "input": "x", "dimensions": 65}, "dimensions", "16, 32, 64"),
    ({"model": "tiny-embed", "input": "x", "dimensions": 0}, "dimensions", "dimensions"),
    ({"model": "tiny-embed", "input": ""}, "input", "empty"),
    ({"model": "tiny-embed", "input": []}, "input", "empty"),
    ({"model": "tiny-embed", "input": ["ok", [1, 2]]}, "input", "expected"),
    ({"model": "tiny-embed", "input": ["ok", "x " * 200]}, "input.1", str(MAX_LEN)),
    ({"model": "tiny-embed", "input": list(range(MAX_LEN + 1))}, "input", str(MAX_LEN)),
    ({"model": "tiny-embed", "input": [[1], [10**9]]}, "input.1", VOCAB),
    ({"model": "tiny-embed", "input": "x", "normalize": False}, "normalize", "normalize"),
    ({"model": "tiny-gen", "input": "x"}, "model", "--task embed"),
]


@pytest.mark.parametrize(("body", "param", "says"), REFUSALS)
def test_bad_embedding_requests_are_400s_naming_the_field(
    served: tuple[Daemon, Path], body: dict[str, Any], param: str, says: str
) -> None:
    if says == VOCAB:
        says = str(json.loads((served[1] / "config.json").read_text())["vocab_size"])
    answer = post(served[0], "/v1/embeddings", body)
    assert answer.status_code == 400, answer.text
    error = answer.json()["error"]
    assert error["param"] == param and says in error["message"], error


def test_chat_and_completions_to_an_embedding_model_are_refused(
    served: tuple[Daemon, Path],
) -> None:
    daemon, _ = served
    with pytest.raises(openai.BadRequestError) as caught:
        client(daemon).chat.completions.create(
            model="tiny-embed", messages=[{"role": "user", "content": "hi"}], max_tokens=2
        )
    error = caught.value.body
    assert isinstance(error, dict) and error["param"] == "model"
    assert "served for embeddings" in error["message"]
    answer = post(daemon, "/v1/completions", {"model": "tiny-last", "prompt": "hi"})
    assert answer.status_code == 400 and answer.json()["error"]["param"] == "model"
    generated = client(daemon).completions.create(model="tiny-gen", prompt="hi", max_tokens=2)
    assert generated.usage is not None and generated.usage.completion_tokens >= 1


def test_task_and_pooling_round_trip_through_spec_and_cli(served: tuple[Daemon, Path]) -> None:
    daemon, tiny = served
    # the specs as `workload describe` reads them (the API: no CLI start-up per workload)
    specs = {row["name"]: daemon.get(f"/api/v1/workloads/{row['workload_id']}").json()["spec"]
             for row in daemon.get("/api/v1/workloads").json()}  # fmt: skip
    assert (specs["tiny-embed"]["task"], specs["tiny-embed"].get("pooling")) == ("embed", None)
    assert (specs["tiny-last"]["task"], specs["tiny-last"]["pooling"]) == ("embed", "last")
    assert specs["tiny-gen"]["task"] == "generate"
    refused = daemon.cli("workload", "submit", "--model", str(tiny), "--pooling", "last",
                         "--dry-run")  # fmt: skip
    assert refused.returncode != 0 and "pooling" in refused.stdout + refused.stderr
    refused = daemon.cli("workload", "submit", "--model", str(tiny), "--task", "classify",
                         "--dry-run")  # fmt: skip
    assert refused.returncode != 0 and "task" in refused.stdout + refused.stderr


@pytest.mark.parametrize(("model", "figure"), [("tiny-embed", "dim 64"),
                                               ("tiny-gen", "400 (generation model)")])  # fmt: skip
def test_validate_row_api_embeddings_passes(
    served: tuple[Daemon, Path], tmp_path: Path, model: str, figure: str
) -> None:
    daemon, _ = served
    proc = daemon.cli("validate", "--endpoint", daemon.url, "--model", model,
                      "--only", "api.embeddings", "--out", str(tmp_path))  # fmt: skip
    assert proc.returncode == 0, proc.stdout + proc.stderr
    cell = json.loads((tmp_path / "validation.json").read_text())["cells"][model]
    assert cell["api.embeddings"]["status"] == "PASS", cell
    assert cell["api.embeddings"]["figure"] == figure
    cards = {c["id"]: c for c in daemon.get("/v1/models").json()["data"]}
    assert cards["tiny-embed"]["task"] == "embed" and cards["tiny-gen"]["task"] == "generate"


def test_the_documented_2048_inputs_are_answered_while_others_are_served(
    served: tuple[Daemon, Path],
) -> None:
    """Issue 32, bug 6: a request of 2,048 short inputs (OpenAI's limit) is answered, while
    one-input embeddings on the same replica and chats on another are answered within 5 s of
    their usual time, and the embedding replica stays in routing (its probe is one input)."""
    daemon, _ = served
    many = {"model": "tiny-embed", "input": [f"sentence {i} of many" for i in range(2048)]}

    def attack() -> httpx.Response:
        reply = loopback.post(daemon.url + "/v1/embeddings", json=many, timeout=600)
        assert reply.status_code == 200, reply.text
        assert len(reply.json()["data"]) == 2048
        return reply

    def timed(path: str, body: dict[str, Any]) -> Callable[[], float]:
        def once() -> float:
            started = time.monotonic()
            assert post(daemon, path, body).status_code == 200
            return time.monotonic() - started

        return once

    one = timed("/v1/embeddings", {"model": "tiny-embed", "input": "one"})
    chat = timed("/v1/chat/completions", {"model": "tiny-gen", "max_tokens": 8,
                                          "messages": [{"role": "user", "content": "hi"}]})  # fmt: skip
    assert set(assert_unhurt(daemon, one, attack)) == {200}
    assert set(assert_unhurt(daemon, chat, attack)) == {200}
    rows = {r["name"]: r for r in daemon.get("/api/v1/workloads").json()}
    assert all(r["ready_replicas"] >= 1 for r in rows.values()), rows
