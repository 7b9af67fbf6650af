"""The distributed suite runs end to end at tiny dims under real torchrun launches (no tp_plan, world 1 and 2): the
rows side by side, every rank of every world generating the same tokens, and each rank of world 2 holding about half
the low-bit bytes."""
import json

import pytest

from torch_lowbit.bench import __main__ as bench_main

pytest.importorskip("transformers")

TINY = ["--hidden", "64", "--intermediate", "128", "--layers", "1", "--heads", "4", "--kv-heads", "2", "--vocab", "96",
        "--prompt", "4", "--tokens", "3", "--repeat", "1", "--timeout", "240"]


def test_distributed_suite_runs_worlds_side_by_side(tmp_path, capsys):
    path = tmp_path / "out.json"
    assert bench_main.main(["--suite", "distributed", *TINY, "--scheme", "int8", "--worlds", "1,2",
                            "--json", str(path)]) == 0
    out, err = capsys.readouterr()
    assert "world 2: torchrun --nproc-per-node 2" in err
    assert "tokens/s" in out and "low-bit MB/rank" in out and "same tokens" in out
    rows = json.loads(path.read_text())["rows"]
    assert [r["world"] for r in rows] == ["1, no tp_plan", "1", "2"]
    for r in rows:
        assert r["same_tokens"] and len(r["tokens"]) == 3 and r["tok_s"] > 0
    plain, one, two = rows
    assert one["lowbit_mb_per_rank"] == plain["lowbit_mb_per_rank"]  # world 1 splits nothing
    # int8 codes split in half; per-channel scales of the row-wise layers (o_proj, down_proj) stay whole
    assert 0.45 <= two["lowbit_mb_per_rank"] / one["lowbit_mb_per_rank"] <= 0.55
    assert two["lowbit_vs_first"] == pytest.approx(two["lowbit_mb_per_rank"] / one["lowbit_mb_per_rank"])


def test_distributed_suite_refuses_bad_worlds(capsys):
    assert bench_main.main(["--suite", "distributed", "--worlds", "two"]) == 2
    assert "--worlds must be positive ints" in capsys.readouterr().out


def test_a_failed_launch_says_which_ranks_wrote_results(tmp_path, capsys):
    # a checkpoint that is not there: every rank fails before its results, and the message says none wrote them
    from torch_lowbit.bench import distributed
    args = distributed._parser().parse_args(TINY)
    assert distributed._launch(args, str(tmp_path / "missing"), 2, 1, str(tmp_path / "out")) is None
    out = capsys.readouterr().out
    assert "world 2: torchrun failed (exit code 1; results written by ranks []):" in out
