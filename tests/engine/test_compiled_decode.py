"""The compiled decode step (kunlun.engine.native) against the reference path: same greedy
tokens and logits, batches of different lengths, every weight scheme; the fallback when it
is switched off or no compiler is found, and the log line that says which path runs."""

from __future__ import annotations

import json
import logging
import os
import random
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from kunlun.engine.model_runner import ModelRunner, StepSeq
from kunlun.engine.quant import QuantSpec, dequantize, int4_tiles, pack_int4
from kunlun.errors import ConfigError

SCHEMES = ("none", "w8a16", "w8a8", "w4a16")


def runner(
    model_dir: Path, path: str, quantization: str = "none", dtype: torch.dtype = torch.float32
) -> ModelRunner:
    group = 32 if quantization == "w4a16" else None
    return ModelRunner(model_dir, block_size=4, num_blocks=96, decode_path=path, dtype=dtype,
                       quantization=quantization, group_size=group)  # fmt: skip


def decode_batch(
    runner: ModelRunner,
    prompts: list[list[int]],
    steps: int,
    feed: list[list[int]] | None = None,
    blocks: list[int] | None = None,
) -> list[torch.Tensor]:
    """Prefill each prompt alone, then ``steps`` greedy decode steps of all of them together
    (different context lengths: the attention of each row sees only its own); the logits of
    every decode step. ``feed``: each sequence's tokens after its prompt come from there (the
    same inputs as another run's), not from this run's own greedy choice; the list is
    filled with the tokens fed. ``blocks``: the KV blocks handed out in turn, 24 per sequence
    (default: all of them, shuffled)."""
    if blocks is None:
        blocks = random.Random(3).sample(range(runner.num_blocks), runner.num_blocks)
    tables, tokens, out = [], [list(p) for p in prompts], []
    for index, prompt in enumerate(prompts):
        table = blocks[index * 24 : (index + 1) * 24]
        tables.append(table)
        logits = runner.execute([StepSeq(tokens[index], 0, len(prompt), table)]).logits
        tokens[index].append(feed[index][len(prompt)] if feed else int(logits[0].argmax()))
    for _ in range(steps):
        seqs = [StepSeq(t, len(t) - 1, 1, table) for t, table in zip(tokens, tables, strict=True)]
        logits = runner.execute(seqs).logits
        out.append(logits)
        for row, t in enumerate(tokens):
            t.append(feed[row][len(t)] if feed else int(logits[row].argmax()))
    if feed is not None and not feed:
        feed.extend(tokens)
    return out


#: The largest log-probability difference allowed between the compiled step and the
#: model's modules running the same kernels, per scheme. Float weights: float32 rounding.
#: Quantized ones round activations to bf16 before each int8 matmul (as torch's int8pack
#: kernel takes them; every quantized model's LM head is int8 rows), where a last-bit
#: difference of a float32 norm (the two paths sum in different orders) can flip a rounding.
TOLERANCE = {"none": 1e-4, "w8a16": 5e-3, "w8a8": 5e-3, "w4a16": 3e-2}


def eager(model_dir: Path, scheme: str, dtype: torch.dtype = torch.float32) -> ModelRunner:
    """A model loaded as the compiled path loads it (the same kernels for its quantized
    layers: Kunlun's int4 kernel where this CPU's measurement chose it), stepping through
    its modules."""
    loaded = runner(model_dir, "compiled", scheme, dtype)
    loaded.compiled = None
    return loaded


@pytest.mark.parametrize("scheme", SCHEMES)
def test_compiled_steps_match_the_reference_path(scheme: str, make_tiny_model) -> None:
    """The compiled step against the model's modules with the same kernels: the same greedy
    tokens, log-probabilities to float32 rounding (or a bf16 rounding of the activations the
    int8 kernels take). Against the reference path, torch's kernels only (for int4: torch's
    int4pack, which rounds the activations, scales and zero points to bf16), fed the same
    tokens: far closer than quantizing the weights moves either, and the same greedy token
    but where the reference's top two are within a rounding of a tie."""
    model_dir = make_tiny_model("Qwen3ForCausalLM", False)  # per-head q/k norms
    compiled, reference = runner(model_dir, "compiled", scheme), runner(model_dir, "python", scheme)
    assert compiled.decode_status.path == "compiled" and compiled.compiled is not None
    assert reference.decode_status.path == "python" and reference.compiled is None
    rng = random.Random(11)
    prompts = [[rng.randrange(3, 2000) for _ in range(n)] for n in (3, 17, 40)]
    fed: list[list[int]] = []
    ours = decode_batch(compiled, prompts, 24, fed)
    modules = decode_batch(eager(model_dir, scheme), prompts, 24)
    theirs = decode_batch(reference, prompts, 24, fed)
    floating = decode_batch(runner(model_dir, "python"), prompts, 24, fed)
    for step, (a, e, b, f) in enumerate(zip(ours, modules, theirs, floating, strict=True)):
        assert torch.equal(a.argmax(-1), e.argmax(-1)), (scheme, step)
        a, e, b, f = (t.log_softmax(-1) for t in (a, e, b, f))
        torch.testing.assert_close(a, e, atol=TOLERANCE[scheme], rtol=0)
        our_top, their_top = a.argmax(-1, keepdim=True), b.argmax(-1, keepdim=True)
        margin = b.gather(-1, their_top) - b.gather(-1, our_top)  # 0 where both agree
        assert bool((margin <= 2 * TOLERANCE[scheme]).all()), (scheme, step, margin)
        if scheme != "none":  # far inside what quantizing the weights changes
            assert (a - b).abs().max() < (b - f).abs().max() / 10, (scheme, step)


@pytest.mark.parametrize("scheme", ["none", "w8a16", "w4a16"])
def test_compiled_bf16_steps_track_the_reference_path(scheme: str, make_tiny_model) -> None:
    """A bfloat16 model rounds where the eager path rounds (norms, rotary, residuals, SiLU,
    attention weights before they multiply the values); a last-bit difference (the order of
    a product's float32 sums, exp, 1/sqrt) may flip a bf16 rounding, so the test holds the
    compiled path to the eager one's accuracy against float32, to the same greedy tokens, and
    a single sequence to within a few bf16 roundings of eager's log-probabilities."""
    model_dir = make_tiny_model("Qwen2ForCausalLM", False)  # q/k/v biases
    bf16 = torch.bfloat16
    compiled = runner(model_dir, "compiled", scheme, bf16)
    assert compiled.compiled is not None
    rng = random.Random(5)
    prompts = [[rng.randrange(3, 2000) for _ in range(n)] for n in (4, 21)]
    ours = decode_batch(compiled, prompts, 16)
    theirs = decode_batch(runner(model_dir, "python", scheme, bf16), prompts, 16)
    floating = decode_batch(runner(model_dir, "python", scheme), prompts, 16)
    agree, our_error, their_error = 0, 0.0, 0.0
    for a, b, f in zip(ours, theirs, floating, strict=True):
        agree += int(torch.equal(a.argmax(-1), b.argmax(-1)))
        a, b, f = a.log_softmax(-1), b.log_softmax(-1), f.log_softmax(-1)
        our_error += float((a - f).abs().mean())
        their_error += float((b - f).abs().mean())
    assert our_error < 1.25 * their_error, (scheme, our_error, their_error)
    assert agree >= 14, (scheme, agree)  # the same greedy tokens, but for near ties
    single = decode_batch(compiled, prompts[:1], 6)
    reference = decode_batch(eager(model_dir, scheme, bf16), prompts[:1], 6)
    for a, b in zip(single, reference, strict=True):
        assert torch.equal(a.argmax(-1), b.argmax(-1)), scheme
        torch.testing.assert_close(a.log_softmax(-1), b.log_softmax(-1), atol=0.05, rtol=0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_compiled_matrix_products_are_as_accurate_as_torchs(dtype: torch.dtype) -> None:
    """``float_matmul`` (AMX tiles for bf16 up to 48 rows where the CPU has them and the
    widths fit (208 outputs; not 200), its own row kernel for a few rows, F.linear past them
    and for widths that are no multiple of 32), ``int8_matmul`` and ``int4_matmul`` (its
    tiles up to 32 rows, dequantized tiles through torch.mm past them) against float64
    references, for 1 to 50 rows: no worse than torch's own kernels, and only last-bit
    roundings apart from them (int8) or within float32 rounding of the exact product (int4,
    float32 activations). (``-march=haswell`` builds of the library pass this file
    too: docs/engines.md.)"""
    from kunlun.engine.native import load

    assert load().compiled
    generator = torch.Generator().manual_seed(3)
    for rows in (1, 2, 3, 5, 8, 9, 16, 20, 33, 48, 50):
        for n, k in ((208, 576), (200, 576), (96, 40)):
            x = torch.randn(rows, k, generator=generator).to(dtype)
            w = (torch.randn(n, k, generator=generator) / 8).to(dtype)
            bias = torch.randn(n, generator=generator).to(dtype)
            exact = x.double() @ w.double().T + bias.double()
            ours = torch.ops.kunlun.float_matmul(x, w, bias)
            theirs = torch.nn.functional.linear(x, w, bias)
            assert ours.dtype == dtype and ours.shape == (rows, n)
            ulp = 2**-7 if dtype == torch.bfloat16 else 1e-5  # sums of 576 products, rounded
            ours_error = (ours.double() - exact).abs().max()
            theirs_error = (theirs.double() - exact).abs().max()
            assert ours_error <= 2 * theirs_error + 1e-5, (rows, n, k, ours_error, theirs_error)
            torch.testing.assert_close(ours.float(), theirs.float(), rtol=ulp, atol=ulp)
        q = torch.randint(-127, 128, (200, 576), dtype=torch.int8, generator=generator)
        scale = (torch.rand(200, generator=generator) / 100).to(torch.bfloat16)
        x = torch.randn(rows, 576, generator=generator).to(dtype)
        ours = torch.ops.kunlun.int8_matmul(x, q, scale.float(), rows)  # Kunlun's rows
        theirs = torch._weight_int8pack_mm(x.to(torch.bfloat16), q, scale)
        torch.testing.assert_close(ours, theirs.float(), rtol=2**-7, atol=1e-3)
        # past rows_up_to, torch's kernel as the eager path runs it (scales after, in float32)
        unit = torch.ones(200, dtype=torch.bfloat16)
        eager = torch._weight_int8pack_mm(x.to(torch.bfloat16), q, unit).float() * scale.float()
        assert torch.equal(torch.ops.kunlun.int8_matmul(x, q, scale.float(), rows - 1), eager)
        for n, group in ((64, 32), (96, 128)):  # int4: tiles of 32 rows, below and past 32 rows
            x = torch.randn(rows, 256, generator=generator).to(dtype)
            q = torch.randint(0, 16, (n, 256), dtype=torch.uint8, generator=generator)
            scale = (torch.rand(n, 256 // group, generator=generator) / 50).half().float()
            minimum = (
                (-8 * scale + torch.randn(scale.shape, generator=generator) / 100).half().float()
            )
            canonical = {
                "weight_packed": pack_int4(q),
                "weight_scale": scale,
                "weight_min": minimum,
            }
            exact = x.double() @ dequantize(canonical, QuantSpec("w4a16", group)).double().T
            tiles = int4_tiles(canonical["weight_packed"], scale, minimum, group)
            ours = torch.ops.kunlun.int4_matmul(x, *tiles, group)
            pairs = torch.stack((scale.t(), (minimum + 8 * scale).t()), -1).to(torch.bfloat16)
            packed = torch._convert_weight_to_int4pack_for_cpu(q.to(torch.int32), 1)
            theirs = torch._weight_int4pack_mm_for_cpu(
                x.bfloat16(), packed, group, pairs.contiguous()
            )
            assert ours.dtype == dtype and ours.shape == (rows, n)
            ours_error = (ours.double() - exact).abs().max()
            theirs_error = (theirs.double() - exact).abs().max()
            assert ours_error <= 2 * theirs_error + 1e-5, (rows, n, group, ours_error, theirs_error)
            if dtype == torch.float32:  # float32 sums of float32 products: float32 rounding
                assert ours_error < 1e-4 * exact.abs().max(), (rows, n, group, ours_error)
            elif rows <= 48:  # bf16 in and out, float32 within: the float32 sums rounded once
                wide = torch.ops.kunlun.int4_matmul(x.float(), *tiles, group)
                assert torch.equal(ours, wide.bfloat16()), (rows, n, group)


def test_attention_bias_and_tied_llama3_rope_match(make_tiny_model) -> None:
    for options in ({"attention_bias": True}, {"llama3_rope": True}):
        model_dir = make_tiny_model("LlamaForCausalLM", "llama3_rope" in options, **options)
        compiled, reference = runner(model_dir, "auto"), runner(model_dir, "python")
        assert compiled.decode_status.path == "compiled"
        prompts = [[5, 9, 300, 41], list(range(100, 127))]
        for a, b in zip(
            decode_batch(compiled, prompts, 12), decode_batch(reference, prompts, 12), strict=True
        ):
            assert torch.equal(a.argmax(-1), b.argmax(-1))
            torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-4)


def test_the_log_says_which_path_runs_and_why(make_tiny_model, caplog) -> None:
    model_dir = make_tiny_model("LlamaForCausalLM", False)
    with caplog.at_level(logging.INFO, logger="kunlun.engine.model_runner"):
        runner(model_dir, "auto")
        runner(model_dir, "python")
        fp16 = ModelRunner(model_dir, block_size=4, num_blocks=8, dtype=torch.float16)
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("decode path")]
    assert lines[0].startswith("decode path: compiled (compiled decode library ")
    assert lines[1] == "decode path: python (decode_path=python asks for the reference path)"
    assert lines[2] == (
        "decode path: python (the compiled decode step runs float32 and bfloat16 models; this "
        "one is torch.float16)"
    )
    assert fp16.compiled is None


def test_a_compiled_path_that_cannot_run_is_refused(make_tiny_model) -> None:
    model_dir = make_tiny_model("LlamaForCausalLM", False)
    with pytest.raises(ConfigError, match="decode_path=compiled: the compiled decode step runs "
                       "float32 and bfloat16 models; this one is torch.float16"):  # fmt: skip
        ModelRunner(model_dir, num_blocks=8, dtype=torch.float16, decode_path="compiled")
    with pytest.raises(ConfigError, match=r"decode_path='fast' is invalid: expected one of auto"):
        ModelRunner(model_dir, num_blocks=8, decode_path="fast")


FALLBACK = """
import json, logging, sys
logging.basicConfig(level=logging.INFO, format="%(message)s", stream=sys.stderr)
from kunlun.engine.model_runner import ModelRunner, StepSeq
runner = ModelRunner(sys.argv[1], block_size=4, num_blocks=32)
tokens = [5, 9, 300, 41]
out = runner.execute([StepSeq(tokens, 0, 4, list(range(8)))])
for _ in range(6):
    tokens.append(int(out.logits[0].argmax()))
    out = runner.execute([StepSeq(tokens, len(tokens) - 1, 1, list(range(8)))])
print(json.dumps({"path": runner.decode_status.path, "tokens": tokens}))
"""


def run_fallback_script(model_dir: Path, env: dict[str, str] | None = None) -> tuple[dict, str]:
    done = subprocess.run([sys.executable, "-c", FALLBACK, str(model_dir)], env=env,
                          capture_output=True, text=True, timeout=300, check=True)  # fmt: skip
    return json.loads(done.stdout), done.stderr


@pytest.fixture(scope="module")
def compiled_tokens(make_tiny_model) -> list[int]:
    """The fallback script's tokens in a process that runs the compiled path."""
    result, _ = run_fallback_script(make_tiny_model("LlamaForCausalLM", False))
    assert result["path"] == "compiled"
    return result["tokens"]


@pytest.mark.parametrize("how", ["no compiler", "environment"])
def test_without_a_compiler_or_switched_off_the_reference_path_runs(
    how: str, make_tiny_model, compiled_tokens: list[int]
) -> None:
    """A process whose PATH has no C++ compiler (or KUNLUN_DECODE_PATH=python) runs the
    reference path, says so in its log, and decodes the same tokens as the compiled path."""
    model_dir = make_tiny_model("LlamaForCausalLM", False)
    env = {k: v for k, v in os.environ.items() if k != "CXX"}
    if how == "no compiler":
        env["PATH"] = str(Path(sys.executable).parent)
    else:
        env["KUNLUN_DECODE_PATH"] = "python"
    result, log = run_fallback_script(model_dir, env)
    assert result["path"] == "python"
    reason = "no C++ compiler on PATH" if how == "no compiler" else "decode_path=python"
    assert "decode path: python (" in log and reason in log
    assert result["tokens"] == compiled_tokens


#: Runs pytest on a library built for another CPU kind: ``-march=haswell`` (AVX2 and FMA, no
#: AVX-512, no AMX), the code an AVX2 machine builds, checked on whatever CPU runs the suite.
OTHER_CPU = """
import sys
import pytest
import kunlun.engine.native as native
native.FLAGS = tuple("-march=haswell" if f == "-march=native" else f for f in native.FLAGS)
sys.exit(pytest.main(sys.argv[1:]))
"""


def test_an_avx2_build_passes_the_same_checks(monkeypatch: pytest.MonkeyPatch) -> None:
    """The kernels' accuracy and the compiled steps against the reference path, every weight
    scheme, with the library built for AVX2. It is built into a folder of its own, once per
    machine like the test models (the build key holds the source, torch, compiler, CPU and
    flags, so a changed source builds again; builds of other keys a day old are removed)."""
    from tests.conftest import machine_cache

    from kunlun.engine import native

    cpuinfo = Path("/proc/cpuinfo")
    cxx = native.compiler()
    if not cpuinfo.is_file() or " avx2" not in cpuinfo.read_text() or cxx is None:
        pytest.skip("not an x86 CPU with AVX2 and a C++ compiler")
    folder = machine_cache().parent / "native-haswell"
    monkeypatch.setattr(native, "FLAGS", tuple(
        "-march=haswell" if f == "-march=native" else f for f in native.FLAGS))  # fmt: skip
    library = folder / f"kunlun_decode_{native.build_key(cxx)}.so"
    env = dict(os.environ, KUNLUN_NATIVE_DIR=str(folder))
    checks = "matrix_products or match_the_reference_path"
    done = subprocess.run([sys.executable, "-c", OTHER_CPU, "-q", "-x", "-p", "no:cacheprovider",
                           __file__, "-k", checks], env=env, capture_output=True, text=True,
                          timeout=600)  # fmt: skip
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-2000:]
    assert "6 passed" in done.stdout, done.stdout[-2000:]
    assert library.is_file()  # the AVX2 build is what the checks loaded (they assert compiled)
    day_ago = time.time() - 86400
    for old in folder.glob("kunlun_decode_*"):
        if not old.name.startswith(library.stem) and old.stat().st_mtime < day_ago:
            old.unlink(missing_ok=True)


def test_the_int4_kernel_is_chosen_by_a_measurement_recorded_per_cpu(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The loaded library's measurement (both int4 kernels on the same products, for each
    activation dtype; both int8 kernels for each token count) names the faster one per dtype,
    and the token counts up to which Kunlun's int8 rows run; its record is read back only for
    this CPU and this source, newest first."""
    from kunlun.engine import native
    from kunlun.engine.native.measure import INT8_TOKENS, measure

    assert native.load().compiled
    measured = measure()
    assert list(measured.int8_figures) == [str(n) for n in INT8_TOKENS]
    slower = [int(n) for n, f in measured.int8_figures.items() if f["int8pack"] < f["int8_rows"]]
    assert measured.int8_rows_up_to == (
        native.DEQUANTIZE_FROM_TOKENS - 1
        if not slower
        else max([0, *(n for n in INT8_TOKENS if n < slower[0])])
    )
    assert f"Kunlun's int8 rows up to {measured.int8_rows_up_to} token" in measured.describe()
    native.choice()  # recorded per torch thread count: the faster kernel depends on it
    assert native._record_path(native._loaded(), torch.get_num_threads()).exists()
    assert set(measured.figures) == set(native.MEASURED_DTYPES) == {"float32", "bfloat16"}
    for dtype, figures in measured.figures.items():
        assert set(figures) == {"int4_matmul", "int4pack"}
        faster = min(figures, key=figures.__getitem__)
        assert measured.ops(dtype) == (("int4_matmul",) if faster == "int4_matmul" else ())
        assert f"{dtype} activations: int4_matmul" in measured.describe(dtype)
        assert "best of" in measured.describe(dtype)
    assert measured.ops("float16") == measured.ops("float32")  # not measured: float32's
    record = measured.to_record()
    assert native.NativeChoice.from_record(json.loads(json.dumps(record))) == measured
    assert native.NativeChoice.from_record({**record, "cpu": "another CPU"}) is None
    assert native.NativeChoice.from_record({**record, "source": "0" * 16}) is None
    assert native.NativeChoice.from_record({**record, "int8_rows_up_to": "4"}) is None
    monkeypatch.setenv("KUNLUN_NATIVE_DIR", str(tmp_path))
    other = native.NativeChoice({"float32": ("int4_matmul",), "bfloat16": ()},
                                {"float32": {"int4_matmul": 1.0, "int4pack": 9.0}}, "x")  # fmt: skip
    ours = tmp_path / "kunlun_decode_0.choice.json"
    ours.write_text(json.dumps(other.to_record()))
    assert native.recorded_choice() == other  # the newest record for this CPU
    (tmp_path / "kunlun_decode_1.choice.json").write_text(
        json.dumps({**other.to_record(), "cpu": "another CPU", "native_ops": {}})
    )
    assert native.recorded_choice() == other  # another CPU's record is not this one's
    (tmp_path / "kunlun_decode_2.choice.json").write_text(
        json.dumps({**other.to_record(), "native_ops": ["int4_matmul"]})  # an older shape
    )
    assert native.recorded_choice() == other
    ours.write_text("{not json")
    assert native.recorded_choice() != other  # unreadable: the next record for this CPU


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_static_decode_steps_compute_what_the_modules_compute(make_tiny_model, dtype) -> None:
    """The decode step a device graph captures (:mod:`kunlun.engine.graphs`), run uncaptured
    on this CPU: fixed batch sizes (three sequences pad to four; the padding row writes into
    the scratch block beyond ``num_blocks``), block tables padded to ``max_model_len``, a
    mask from the lengths. The same greedy tokens as the model's modules, the same
    log-probabilities to float32 rounding (bf16: to a rounding of bf16), and no sequence's
    cache disturbed by the padding (every step after the first reads what the earlier wrote)."""
    model_dir = make_tiny_model("Qwen3ForCausalLM", False)
    static = ModelRunner(model_dir, block_size=4, num_blocks=96, dtype=dtype, max_model_len=128,
                         graph_batch_sizes=(1, 2, 4))  # fmt: skip
    assert static.decode_status.path == "graphs"
    assert static.decode_status.reason == "static decode steps of 1, 2, 4 rows, uncaptured (cpu)"
    assert static.num_blocks == 96 and static.kv_cache.shape[2] == 97  # the scratch block
    reference = ModelRunner(model_dir, block_size=4, num_blocks=96, dtype=dtype,
                            max_model_len=128, decode_path="python")  # fmt: skip
    rng = random.Random(17)
    prompts = [[rng.randrange(3, 2000) for _ in range(n)] for n in (3, 17, 40)]
    for batch in (prompts, prompts[:2], prompts[:1]):  # sizes 4 (one padding row), 2 and 1
        fed: list[list[int]] = []
        ours = decode_batch(static, batch, 12, fed, list(range(96)))  # block 0: the first's
        theirs = decode_batch(reference, batch, 12, fed, list(range(96)))
        atol = 1e-4 if dtype == torch.float32 else 0.05
        for step, (a, b) in enumerate(zip(ours, theirs, strict=True)):
            assert torch.equal(a.argmax(-1), b.argmax(-1)), (len(batch), step)
            torch.testing.assert_close(a.log_softmax(-1), b.log_softmax(-1), atol=atol, rtol=0)
    small = ModelRunner(model_dir, block_size=4, num_blocks=96, dtype=dtype, max_model_len=128,
                        graph_batch_sizes=(1, 2))  # fmt: skip
    fed = []  # three sequences: more than the largest static size, so the modules run them
    ours = decode_batch(small, prompts, 4, fed, list(range(96)))
    theirs = decode_batch(reference, prompts, 4, fed, list(range(96)))
    assert small.decode_time.compiled_s == 0 < small.decode_time.model_s
    for a, b in zip(ours, theirs, strict=True):
        assert torch.equal(a, b)
    with pytest.raises(ConfigError, match="graph_batch_sizes=\\[0\\]"):
        ModelRunner(model_dir, num_blocks=8, graph_batch_sizes=(0,))
