"""device-plugin-config.yaml: parsing, line numbers, and the config-error rules."""

from __future__ import annotations

import textwrap

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kunlun.device.declaration import parse_declarations
from kunlun.errors import ConfigError

KNOWN = ["ascend", "cambricon", "cpu", "hygon", "nvidia"]
SPLIT = {
    "ascend": ("hbm_memory_mb", "sys_memory_mb"),
    "cambricon": ("mlu_memory_mb", "ddr_memory_mb"),
    "hygon": ("vram_memory_mb", "gddr6_memory_mb"),
}


def parse(text: str):
    return parse_declarations(textwrap.dedent(text), "cfg.yaml", KNOWN, SPLIT)


def test_fields_and_lines_are_kept() -> None:
    devices = parse(
        """\
        devices:
          - device_type: ascend
            device_id: 0
            hbm_memory_mb: 32768
            supported_dtypes: [fp16, bf16, int8]
            topology_distance: [0, 16]
          - device_type: ascend
            device_id: 1
            topology_distance: [16, 0]
        """
    )
    assert [d.id for d in devices] == ["ascend:0", "ascend:1"]
    first = devices[0]
    assert first.decl.hbm_memory_mb == 32768
    assert first.line == 2
    assert str(first.where("hbm_memory_mb")) == "cfg.yaml:4 (hbm_memory_mb)"
    assert first.declared_fields() == {
        "device_type",
        "device_id",
        "hbm_memory_mb",
        "supported_dtypes",
        "topology_distance",
    }


def test_unknown_device_type_lists_known_ones() -> None:
    with pytest.raises(ConfigError) as err:
        parse("devices:\n  - device_type: ascnd\n    device_id: 0\n")
    text = str(err.value)
    assert "cfg.yaml:2 (device_type)" in text
    assert "'ascnd'" in text and "did you mean 'ascend'" in text
    assert "known: ascend, cambricon, cpu, hygon, nvidia" in text
    assert err.value.exit_code == 2


def test_unknown_key_gets_did_you_mean() -> None:
    with pytest.raises(ConfigError) as err:
        parse("devices:\n  - device_type: nvidia\n    device_id: 0\n    p2p_enable: true\n")
    assert "cfg.yaml:4 (p2p_enable)" in str(err.value)
    assert "did you mean 'p2p_enabled'" in str(err.value)


def test_dtype_outside_vocabulary_is_named() -> None:
    with pytest.raises(ConfigError) as err:
        parse(
            "devices:\n  - device_type: nvidia\n    device_id: 0\n    supported_dtypes: [fp16, fp4]\n"
        )
    text = str(err.value)
    assert "cfg.yaml:4 (supported_dtypes)" in text and "'fp4'" in text


def test_memory_split_of_another_vendor_is_rejected() -> None:
    with pytest.raises(ConfigError) as err:
        parse("devices:\n  - device_type: cambricon\n    device_id: 0\n    hbm_memory_mb: 1024\n")
    text = str(err.value)
    assert "cfg.yaml:4 (hbm_memory_mb)" in text
    assert "cambricon uses mlu_memory_mb / ddr_memory_mb" in text


def test_every_problem_is_reported_at_once() -> None:
    with pytest.raises(ConfigError) as err:
        parse(
            """\
            devices:
              - device_type: nvidia
                device_id: -1
              - device_type: nvidia
                device_id: 0
                total_memory_mb: lots
              - device_type: nvidia
                device_id: 0
              - device_type: nvidia
                device_id: 0
            """
        )
    text = str(err.value)
    assert "cfg.yaml:3 (device_id)" in text and "-1" in text
    assert "cfg.yaml:6 (total_memory_mb)" in text and "'lots'" in text
    assert "declared twice (first at line 7)" in text


def test_duplicate_key_in_one_entry() -> None:
    with pytest.raises(ConfigError, match="given twice"):
        parse("devices:\n  - device_type: nvidia\n    device_id: 0\n    device_id: 1\n")


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("devices: [\n", "not valid YAML"),
        ("- a\n- b\n", "top-level 'devices:' list"),
        ("devices: 3\n", "must be a list"),
        ("devcies: []\n", "did you mean 'devices'"),
        ("devices:\n  - 7\n", "must be a mapping"),
        ("", "top-level 'devices:' list"),
    ],
)
def test_malformed_files(text: str, expected: str) -> None:
    with pytest.raises(ConfigError, match=expected):
        parse(text)


GOOD = textwrap.dedent(
    """\
    devices:
      - device_type: ascend
        device_id: 0
        hbm_memory_mb: 32768
        p2p_enabled: true
        topology_distance: [0, 16]
        supported_dtypes: [fp16, int8]
        custom_attributes: {aclnn_fusion_enabled: true}
      - device_type: ascend
        device_id: 1
        topology_distance: [16, 0]
    """
)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_mangled_yaml_gives_config_error_or_devices(data: st.DataObject) -> None:
    """Any mangling of a good file: a ConfigError naming the file, or devices; never a crash."""
    text = GOOD
    for _ in range(data.draw(st.integers(1, 4))):
        op = data.draw(st.sampled_from(["cut", "insert", "delete_line", "dup_line", "replace"]))
        pos = data.draw(st.integers(0, max(0, len(text) - 1)))
        if op == "cut":
            text = text[:pos]
        elif op == "insert":
            text = text[:pos] + data.draw(st.text(max_size=8)) + text[pos:]
        elif op == "replace":
            text = (
                text[:pos]
                + data.draw(st.sampled_from(["-", ":", "[", "{", "!", "&", "*", "\t", "#"]))
                + text[pos + 1 :]
            )
        else:
            lines = text.splitlines(keepends=True)
            if lines:
                i = data.draw(st.integers(0, len(lines) - 1))
                lines[i : i + 1] = [] if op == "delete_line" else [lines[i], lines[i]]
                text = "".join(lines)
    try:
        devices = parse_declarations(text, "cfg.yaml", KNOWN, SPLIT)
    except ConfigError as exc:
        assert "cfg.yaml" in str(exc)
        assert exc.exit_code == 2
    else:
        assert all(d.decl.device_type in KNOWN for d in devices)
