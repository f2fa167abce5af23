"""The engine's tokenizer against transformers' ``AutoTokenizer`` on the same directory."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from kunlun.engine.tokenizer import Tokenizer
from kunlun.errors import ModelError, ModelFileMissing

TEXTS = [
    "Hello world",
    " Hello   world  ",
    "你好，世界！",
    "for i in range(10):\n    print(i ** 2)\n",
    "<|im_start|>system\nBe brief.<|im_end|>",
    "It's 5 o'clock; we're done!",
    "🙂 café",
]


def copy_tokenizer(source: Path, target: Path) -> Path:
    target.mkdir()
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(source / name, target / name)
    return target


def edit_json(path: Path, **changes: object) -> None:
    data = json.loads(path.read_text())
    data.update(changes)
    path.write_text(json.dumps(data))


def hf_tokenizer(model_dir: Path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model_dir)


def test_encode_decode_match_transformers(demo_model_dir: Path) -> None:
    ours, theirs = Tokenizer(demo_model_dir), hf_tokenizer(demo_model_dir)
    for text in TEXTS:
        for special in (True, False):
            expected = theirs(text, add_special_tokens=special)["input_ids"]
            assert ours.encode(text, add_special_tokens=special) == expected, (text, special)
        assert ours.decode(expected) == theirs.decode(expected, skip_special_tokens=True)
    assert ours.vocab_size == len(theirs) == 49152
    assert ours.id_to_token(19556) == "Hello" and ours.token_to_id("Hello") == 19556
    assert ours.id_to_token(905) == "Ġworld"
    assert {0, 1, 2} <= ours.all_special_ids


def test_config_bos_flags_follow_transformers(demo_model_dir: Path, tmp_path: Path) -> None:
    """With a tokenizer.json, transformers 5 ignores ``add_bos_token``/``add_eos_token``."""
    folder = copy_tokenizer(demo_model_dir, tmp_path / "bos")
    edit_json(folder / "tokenizer_config.json", add_bos_token=True, add_eos_token=True)
    ours, theirs = Tokenizer(folder), hf_tokenizer(folder)
    for text in TEXTS:
        assert ours.encode(text) == theirs(text)["input_ids"]


def test_post_processor_from_tokenizer_json_matches_transformers(
    demo_model_dir: Path, tmp_path: Path
) -> None:
    folder = copy_tokenizer(demo_model_dir, tmp_path / "post")
    data = json.loads((folder / "tokenizer.json").read_text())
    data["post_processor"] = {
        "type": "TemplateProcessing",
        "single": [
            {"SpecialToken": {"id": "<|endoftext|>", "type_id": 0}},
            {"Sequence": {"id": "A", "type_id": 0}},
        ],
        "pair": [{"Sequence": {"id": "A", "type_id": 0}}, {"Sequence": {"id": "B", "type_id": 1}}],
        "special_tokens": {
            "<|endoftext|>": {"id": "<|endoftext|>", "ids": [0], "tokens": ["<|endoftext|>"]}
        },
    }
    (folder / "tokenizer.json").write_text(json.dumps(data))
    config = json.loads((folder / "tokenizer_config.json").read_text())
    config.pop("add_bos_token"), config.pop("add_eos_token")
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    ours, theirs = Tokenizer(folder), hf_tokenizer(folder)
    assert ours.encode("Hello world") == theirs("Hello world")["input_ids"] == [0, 19556, 905]


def test_chat_template_variables_and_helpers(demo_model_dir: Path, tmp_path: Path) -> None:
    folder = copy_tokenizer(demo_model_dir, tmp_path / "chat")
    (folder / "chat_template.jinja").write_text(
        "{{ bos_token }}{% for m in messages %}"
        "{% if m['role'] == 'tool' %}{{ raise_exception('no tools here') }}{% endif %}"
        "  {{ m['role'] }}: {{ m['content'] | tojson }}\n"
        "{% endfor %}{% if add_generation_prompt %}assistant:{% endif %}"
    )
    ours, theirs = Tokenizer(folder), hf_tokenizer(folder)
    messages = [{"role": "user", "content": '<b>bold</b> & "quoted" 中文'}]
    expected = theirs.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert ours.apply_chat_template(messages) == expected
    assert ours.apply_chat_template(messages).startswith("<|im_start|>")
    with pytest.raises(ModelError, match="no tools here"):
        ours.apply_chat_template([{"role": "tool", "content": "x"}])


def test_template_sandbox_refuses_attribute_escape(demo_model_dir: Path, tmp_path: Path) -> None:
    folder = copy_tokenizer(demo_model_dir, tmp_path / "evil")
    (folder / "chat_template.jinja").write_text("{{ messages.__class__.__mro__ }}")
    with pytest.raises(ModelError):
        Tokenizer(folder).apply_chat_template([{"role": "user", "content": "x"}])


def test_eos_ids_include_generation_config(demo_model_dir: Path, tmp_path: Path) -> None:
    folder = copy_tokenizer(demo_model_dir, tmp_path / "eos")
    (folder / "generation_config.json").write_text(json.dumps({"eos_token_id": [0, 7]}))
    assert Tokenizer(folder).eos_token_ids == {2, 0, 7}
    assert Tokenizer(demo_model_dir).eos_token_ids == {2}


def test_no_chat_template_is_a_clear_error(demo_model_dir: Path, tmp_path: Path) -> None:
    folder = copy_tokenizer(demo_model_dir, tmp_path / "plain")
    config = json.loads((folder / "tokenizer_config.json").read_text())
    del config["chat_template"]
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    tokenizer = Tokenizer(folder)
    assert tokenizer.chat_template is None
    with pytest.raises(ModelError, match="no chat template"):
        tokenizer.apply_chat_template([{"role": "user", "content": "hi"}])


def test_missing_or_broken_files(tmp_path: Path, demo_model_dir: Path) -> None:
    with pytest.raises(ModelFileMissing, match="tokenizer.json") as info:
        Tokenizer(tmp_path)
    assert str(tmp_path / "tokenizer.json") in str(info.value)
    folder = copy_tokenizer(demo_model_dir, tmp_path / "broken")
    (folder / "tokenizer_config.json").write_text("{not json")
    with pytest.raises(ModelError, match="tokenizer_config.json"):
        Tokenizer(folder)
    (folder / "tokenizer_config.json").unlink()
    (folder / "tokenizer.json").write_text('{"version": "1.0"}')
    with pytest.raises(ModelError, match="tokenizer.json"):
        Tokenizer(folder)


def test_long_texts_encode_as_short_ones_do_with_the_gil_released(demo_model_dir: Path) -> None:
    ours, theirs = Tokenizer(demo_model_dir), hf_tokenizer(demo_model_dir)
    text = " ".join(f"word{i % 313} é 中文\n" for i in range(3000))  # past the long-text cut
    for special in (True, False):
        expected = theirs(text, add_special_tokens=special)["input_ids"]
        assert ours.encode(text, add_special_tokens=special) == expected


def test_no_token_stands_for_more_than_max_token_bytes(demo_model_dir: Path) -> None:
    ours = Tokenizer(demo_model_dir)
    longest = ours.max_token_bytes
    assert 1 < longest < 1000
    for token_id in range(ours.vocab_size):  # decoded alone, every entry fits the bound
        assert len(ours.decode([token_id], skip_special_tokens=False).encode()) <= longest
    text = "x" * 50_000  # a text of B bytes has at least B / max_token_bytes tokens
    assert len(ours.encode(text, add_special_tokens=False)) >= len(text) / longest
