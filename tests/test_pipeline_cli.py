"""`python -m autoshard plan ... --pp N`: the pipeline plan (autoshard.plan_pipeline) after the
tensor-parallel report, its --json object, and the errors: autoshard's (exit 1) and bad arguments
(exit 2). In process, as tests/test_plan.py's CLI cases; no process group."""
import json

import pytest

from autoshard import cli

GPT = ["plan", "tests.factories:gpt", "--world-size", "2", "--dtype", "long"]       # 2 blocks


@pytest.fixture
def gpt8(tmp_path) -> str:
    """MODULE:FACTORY of an 8-block GPT (sequence 16)."""
    src = tmp_path / "gpt8.py"
    src.write_text("from models import GPT\n\ndef build():\n    return GPT(512, 64, 4, 8, 16, tied=False)\n")
    return f"{src}:build"


def _fails(capsys, argv) -> tuple[int, str]:
    with pytest.raises(SystemExit) as e:
        cli.main(argv)
    return e.value.code, capsys.readouterr().err


def test_table(capsys):
    assert cli.main([*GPT, "--input-shape", "4,64", "--pp", "2", "--microbatches", "2"]) == 0
    out = capsys.readouterr().out
    assert "autoshard plan" in out and "blocks.0.mlp.fc1" in out              # the tensor-parallel report first
    assert "tensor-parallel plan of one microbatch (2 of the batch's 4)" in out
    pipe = out[out.index("pipeline: 2 stages"):]
    assert pipe.startswith("pipeline: 2 stages on pp 2 x tp 2 x dp 1, schedule 1F1B, 2 microbatches")
    rows = [line.split() for line in pipe.splitlines() if line.split()[:1] in (["0"], ["1"])]
    assert [r[:3] for r in rows] == [["0", "0", "blocks.0"], ["1", "1", rows[1][2]]], pipe
    assert rows[1][2].startswith("blocks.1")        # 2 blocks: the second cut between its children, or whole
    assert "+ embeddings" in pipe and "+ head, loss" in pipe
    assert "predicted step" in pipe and "bubble" in pipe and "slowest stage" in pipe


def test_json(capsys):
    assert cli.main([*GPT, "--input-shape", "4,64", "--pp", "2", "--microbatches", "2", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["world_size"] == 2 and out["dims"]["blocks.0.mlp.fc2"] == 0       # the tensor-parallel summary
    p = out["pipeline"]
    assert (p["pp"], p["tp"], p["schedule"], p["microbatches"], p["stages_per_rank"]) == (2, 2, "1F1B", 2, 1)
    assert len(p["stages"]) == 2 and all(p["stages"])
    names = [b for stage in p["stages"] for b in stage]
    assert names[0] == "blocks.0" and all(b == "blocks.1" or b.startswith("blocks.1.") for b in names[1:])
    assert len(p["forward"]) == len(p["backward"]) == len(p["memory"]) == 2 and len(p["sent_bytes"]) == 1
    assert all(t > 0 for t in p["forward"] + p["backward"]) and all(isinstance(b, int) and b > 0 for b in p["memory"])
    stream = 2 * 64 * 128 * 4                                  # one microbatch's residual stream, whole under tp
    assert p["sent_bytes"][0] > 0 and p["sent_bytes"][0] % stream == 0
    assert p["step_time"] > 0 and 0 <= p["bubble"] < 1 and len(p["idle"]) == 2 and p["balance"] >= 1


def test_interleaved_split_and_defaults(capsys, gpt8):
    """A synthesised input holds one sequence a microbatch (default --pp of them); Interleaved1F1B
    defaults to 2 stages a rank; --split pins the blocks per stage."""
    assert cli.main(["plan", gpt8, "-n", "1", "--pp", "2", "--schedule", "Interleaved1F1B",
                     "--split", "1,3,3,1", "--tokens", "16", "--json"]) == 0
    p = json.loads(capsys.readouterr().out)["pipeline"]
    assert (p["microbatches"], p["stages_per_rank"], p["schedule"]) == (2, 2, "Interleaved1F1B")
    assert [len(s) for s in p["stages"]] == [1, 3, 3, 1]
    assert [b for stage in p["stages"] for b in stage] == [f"blocks.{i}" for i in range(8)]


def test_default_microbatches(capsys, gpt8):
    """Without --microbatches: --pp, or the batch's next divisor above it (said on stderr)."""
    assert cli.main(["plan", gpt8, "-n", "1", "--pp", "4", "--input-shape", "6,16", "--dtype", "long",
                     "--json"]) == 0
    captured = capsys.readouterr()
    p = json.loads(captured.out)["pipeline"]
    assert p["microbatches"] == 6 and len(p["stages"]) == 4
    assert "6 microbatches, the fewest from --pp 4 up that divide the batch of 6 (--input-shape 6,16)" in captured.err


def test_more_stages_than_blocks_exit_1(capsys):
    code, err = _fails(capsys, [*GPT, "--input-shape", "4,64", "--pp", "4"])
    assert code == 1, err
    assert "at pp 4 x tp 2 failed: ShardingError" in err
    assert "4 stages (pp 4 x 1 a rank) but the model has 2 blocks" in err


def test_batch_not_divisible_exit_2(capsys):
    code, err = _fails(capsys, [*GPT, "--input-shape", "3,64", "--pp", "2", "--microbatches", "2"])
    assert code == 2, err
    assert "the example's batch of 3 (--input-shape 3,64) does not split into 2 equal microbatches" in err


@pytest.mark.parametrize("extra,message", [
    (["--microbatches", "2", "--split", "1,1"], "--microbatches, --split: for a pipeline, with --pp 2 or more"),
    (["--pp", "0"], "--pp must be >= 1"),
    (["--pp", "2", "--microbatches", "0"], "--microbatches must be >= 1"),
    (["--pp", "2", "--stages-per-rank", "2"], "for --stages-per-rank 2 use --schedule Interleaved1F1B"),
    (["--pp", "2", "--stages-per-rank", "0"], "--stages-per-rank must be >= 1"),
    (["--pp", "2", "--split", "1,x"], "--split wants blocks per stage like 3,3,2"),
    (["--pp", "2", "--schedule", "ZeroBubble"], "invalid choice"),
    (["--pp", "2", "--export", "hf"], "does not take --pp"),
])
def test_bad_arguments_exit_2(capsys, extra, message):
    code, err = _fails(capsys, [*GPT, "--input-shape", "4,64", *extra])
    assert code == 2 and message in err, err
