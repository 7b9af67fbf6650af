"""The main job runs end to end (on small shapes here: the real ones are the benchmark's business)."""
import json

import pytest

from torch_lowbit.bench import __main__ as bench_main
from torch_lowbit.bench import layer


def test_layer_suite_runs_and_writes_json(monkeypatch, tmp_path, capsys):
    monkeypatch.setattr(layer, "LLAMA3_8B", [("a_proj", 48, 64, 2), ("b_proj", 17, 130, 1)])
    path = tmp_path / "out.json"
    assert bench_main.main(["--m", "1,3", "--repeat", "2", "--device", "cpu", "--working-set-mb", "1", "--json", str(path)]) == 0
    out, err = capsys.readouterr()
    assert "[2/2] b_proj" in err and "decoder layer (7)" in out and "max rel err" in out
    rows = json.loads(path.read_text())["rows"]
    assert len(rows) == 2 * 2 * 2 + 2 * 2  # shapes x M x modes, plus a total per (M, mode)
    for r in rows:
        assert r["lowbit_ms"] > 0 and r["speedup"] > 0
        assert 0 < r["max_rel_err"] < (0.08 if r["mode"] == "fp8" else 0.04)


@pytest.mark.parametrize("argv,match", [(["--m", "0"], "--m values must be >= 1"),
                                        (["--m", "x"], "--m must be comma-separated"),
                                        (["--repeat", "0"], "--repeat must be >= 1")])
def test_layer_suite_bad_options(argv, match, capsys):
    with pytest.raises(SystemExit):
        layer.run(argv)
    assert match in capsys.readouterr().err


def test_cpu_suite_runs_at_a_capped_isa(tmp_path, capsys):
    from torch_lowbit.bench import cpu
    from torch_lowbit.testing import cpu_isa
    if cpu_isa() == "portable":
        pytest.skip("the suite's cap is only observable on a CPU above the portable level")
    path = tmp_path / "cpu.json"
    before = cpu_isa()
    assert cpu.run(["--quick", "--rounds", "1", "--working-set-mb", "8", "--isa", "avx2", "--threads", "1",
                    "--json", str(path)]) == 0
    assert cpu_isa() == before  # the cap is lifted again
    data = json.loads(path.read_text())
    assert data["meta"]["isa"] == "avx2" and data["meta"]["amx_gemm"] is False
    assert len(data["rows"]) == 11 and all(r["ms"] > 0 and r["base_ms"] > 0 for r in data["rows"])
    assert data["meta"]["threads"] == [1] and all(r["threads"] == 1 for r in data["rows"])
    names = [r["case"] for r in data["rows"]]
    assert sum(n.startswith("int8_quantize+int8_mm M=1") for n in names) == 2
    assert sum(n.startswith("fp8_mm M=64 bf16 K=") for n in names) == 2
    assert "kernels: avx2" in capsys.readouterr().out
