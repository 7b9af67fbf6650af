"""The train suite runs end to end on small shapes (the real ones are the benchmark's business)."""
import json

import pytest

pytest.importorskip("peft")

from torch_lowbit.bench import __main__ as bench_main  # noqa: E402
from torch_lowbit.bench import train  # noqa: E402


def test_train_suite_runs_and_writes_json(monkeypatch, tmp_path, capsys):
    # train.py holds its own reference to the shapes (from .layer import LLAMA3_8B): patch that one
    monkeypatch.setattr(train, "LLAMA3_8B", [("q_proj,o_proj", 64, 64, 2), ("k_proj,v_proj", 16, 64, 2),
                                             ("gate_proj,up_proj", 96, 64, 2), ("down_proj", 64, 96, 1)])
    monkeypatch.setattr(train, "HEADS", 4)
    monkeypatch.setattr(train, "KV_HEADS", 1)
    path = tmp_path / "train.json"
    assert bench_main.main(["--suite", "train", "--tokens", "12", "--batch", "2", "--rank", "2", "--steps", "1",
                            "--json", str(path)]) == 0
    out = capsys.readouterr().out
    assert "step / bf16" in out
    rows = {r["mode"]: r for r in json.loads(path.read_text())["rows"]}
    assert set(rows) == {"bf16", "fp8", "int8", "nvfp4", "mxfp4", "int4", "uint4"}
    for r in rows.values():
        assert r["step_ms"] > 0 and r["bwd_ms"] > 0 and r["train_state_mb"] > 0
    # one byte per weight plus fp32 scales against two bytes per weight
    assert rows["bf16"]["weights_vs_bf16"] == 1 and 0.5 < rows["fp8"]["weights_vs_bf16"] < 0.55
    # half a byte per weight plus the group scales (K = 64, 96 here: int4's group of 128 is one per row, uint4's 64
    # is one or two scale + bias pairs), against two bytes per weight
    assert 0.25 < rows["nvfp4"]["weights_vs_bf16"] < 0.3 and 0.25 < rows["mxfp4"]["weights_vs_bf16"] < 0.3
    assert 0.25 < rows["int4"]["weights_vs_bf16"] < 0.3 and 0.25 < rows["uint4"]["weights_vs_bf16"] < 0.3
    # the small shapes ran: 28672 weights of two bytes, not a Llama-3-8B layer's 416 MB
    assert rows["bf16"]["weights_mb"] * 2 ** 20 == 2 * 28672, rows["bf16"]["weights_mb"]


@pytest.mark.parametrize("argv,match", [(["--tokens", "0"], "--tokens must be >= 1"),
                                        (["--tokens", "5", "--batch", "2"], "must be a multiple of --batch"),
                                        (["--modes", "fp8"], "include bf16")])
def test_train_suite_bad_options(argv, match, capsys):
    with pytest.raises(SystemExit):
        train.run(argv)
    assert match in capsys.readouterr().err
