"""Bad input, as a careless or hostile user gives it: one clear line, a non-zero exit,
no traceback, nothing already saved damaged.

Every case runs ``gossip.train`` (in this process, through ``main``) next to a finished
run directory, and asserts: exit code 2, exactly one line on stderr, starting
``gossip.train: error:`` and containing the given needles (the bad value and what is
accepted), no traceback, and that finished run byte for byte unchanged. The topology
CLI's cases run ``python -m topologies`` the same way.
"""

from __future__ import annotations

import contextlib
import hashlib
import io
import shutil
import sys
from pathlib import Path

import pytest

from gossip import train as gossip_train
from tests.conftest import REPO, child_env, run_process

SIM = ["--simulate", "4", "--data", "synthetic", "--model", "logreg", "--max-steps", "2", "--no-progress"]


def _digest(d: Path) -> dict[str, str]:
    return {str(p.relative_to(d)): hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(d.rglob("*")) if p.is_file()}


@pytest.fixture(scope="module")
def finished(tmp_path_factory) -> Path:
    """A finished run: ecd on 4 nodes, 4 steps, checkpoints at 2 and 4."""
    out = tmp_path_factory.mktemp("bad-input") / "done"
    rc, _, err = _main(*SIM[:-3], "--algo", "ecd", "--max-steps", "4", "--checkpoint-every", "2", "--no-progress",
                       "--out", str(out))
    assert rc == 0, err
    return out


def _main(*args: str) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            rc = gossip_train.main(list(args))
        except SystemExit as e:  # argparse's usage errors
            rc = e.code if isinstance(e.code, int) else 1
    return rc, out.getvalue(), err.getvalue()


def _files(tmp: Path) -> dict[str, Path]:
    """Inputs some cases need, made in the test's own directory."""
    (tmp / "plain.txt").write_text("not a run\n")
    (tmp / "binary.toml").write_bytes(bytes(range(256)) * 4)
    (tmp / "a-dir").mkdir()
    for name, text in [("lazy", 'lazy = "false"\n'), ("out", "out = 5\n"), ("epochs", "epochs = 2.5\n"),
                       ("broken", "lr = = 1\n"), ("unknown", "speed = 1\n"), ("section", "[optim]\nspeed = 1\n"),
                       ("twice", "lr = 0.1\n[optim]\nlr = 0.2\n"), ("opts", "algo_options = 3\n"),
                       ("merge", "merge = true\n"), ("seed", 'seed = "zero"\n')]:
        (tmp / f"{name}.toml").write_text(text)
    (tmp / "deep.toml").write_text("a = " + "[" * 100_000 + "]" * 100_000 + "\n")
    (tmp / "proj").mkdir()
    (tmp / "proj" / "config.json").write_text('{"the user\'s": "own"}')
    return {"tmp": tmp}


CASES = [
    # --- flags and their values
    (["--algo", "nope"], ["--algo", "nope", "choose from"]),
    (["--bits", "0"], ["bits", "0"]),
    (["--bits", "17"], ["bits", "17"]),
    (["--topology", "nope"], ["--topology", "nope"]),
    (["--topology", "torus", "--simulate", "7"], ["torus", "world size 7"]),
    (["--simulate", "1", "--algo", "dcd"], ["dcd", "--simulate must be >= 2"]),
    (["--compressor", "nope"], ["compressor", "nope"]),
    (["--compressor", "quant:bits=99"], ["bits", "99"]),
    (["--compressor", "topk:p=2"], ["topk", "p"]),
    (["--compressor", "quant:bits=eight"], ["bits", "eight"]),
    (["--lr", "-1"], ["--lr", "-1"]),
    (["--lr", "nan"], ["--lr", "nan"]),
    (["--lr", "fast"], ["--lr", "fast"]),
    (["--epochs", "0"], ["--epochs", "0"]),
    (["--batch-size", "0"], ["--batch-size", "0"]),
    (["--momentum", "1.5"], ["momentum", "1.5"]),
    (["--weight-decay", "-1"], ["weight-decay", "-1"]),
    (["--seed", "-1"], ["--seed", "-1"]),
    (["--seed", str(2**64)], ["--seed", "2**63"]),
    (["--checkpoint-every", "-1"], ["checkpoint-every", "-1"]),
    (["--log-every", "0"], ["log-every", "0"]),
    (["--max-steps", "0"], ["max", "0"]),
    (["--simulate", "0"], ["simulate", "0"]),
    (["--timeout", "0"], ["timeout", "0"]),
    (["--emulate-latency", "-1"], ["emulate-latency", "-1"]),
    (["--emulate-latency", "1e300"], ["emulate-latency", "60000"]),
    (["--partition", "nope"], ["--partition", "nope"]),
    (["--lr-schedule", "nope"], ["--lr-schedule", "nope"]),
    (["--device", "tpu"], ["--device", "tpu"]),
    (["--model", "nope"], ["--model", "nope"]),
    (["--data", "nope"], ["--data", "nope"]),
    (["--data", "cifar10", "--data-dir", "/nonexistent/cifar"], ["cifar10", "/nonexistent/cifar"]),
    (["--algo", "efsgd", "--merge", "0"], ["--merge", "layer, whole, auto"]),
    (["--algo", "efsgd", "--merge", "everything"], ["--merge", "layer, whole, auto"]),
    (["--algo", "efsgd", "--merge", "layer", "--merge-alpha", "2"], ["--merge-alpha"]),
    (["--algo", "ecd", "--merge", "layer"], ["merge", "efsgd"]),
    (["--algo", "powersgd", "--algo-opt", "rank=0"], ["rank", "0"]),
    (["--algo", "powersgd", "--algo-opt", "ranks=4"], ["ranks", "accepted: rank"]),
    (["--algo", "powersgd", "--algo-opt", "shapes=4"], ["shapes", "not an option of --algo powersgd; accepted: rank"]),
    (["--algo", "powersgd", "--algo-opt", "rank"], ["rank", "KEY=VALUE"]),
    (["--algo", "sketched", "--algo-opt", "p=nan"], ["p=nan", "finite"]),
    (["--algo", "efsgd", "--compressor", "topk:k=99999999999"], ["k=99999999999", "numel=330"]),
    # --- data and model that do not fit, sizes that cannot work
    (["--model", "resnet20"], ["--model resnet20", "--data synthetic", "input_shape"]),
    (["--model", "cnn1d"], ["--model cnn1d", "--data synthetic"]),
    (["--batch-size", "100000"], ["--batch-size 100000", "shard size"]),
    (["--simulate", "100000", "--model", "mlp"], ["--simulate 100000", "GiB", "would fit"]),
    (["--simulate", "5000"], ["over 5000 nodes", "4096 samples", "fewer nodes"]),  # more nodes than samples
    # --- run directories
    (["--out", "{finished}"], ["already holds a run", "--resume", "--overwrite"]),
    (["--out", "{tmp}/plain.txt"], ["is a file"]),
    (["--out", "/proc/gossip-test/run"], ["/proc/gossip-test/run", "cannot create"]),
    (["--resume", "{finished}", "--out", "{tmp}/elsewhere"], ["--resume", "--out", "another"]),
    (["--resume", "{finished}", "--overwrite"], ["--overwrite", "--resume"]),
    (["--resume", "auto"], ["--resume auto", "--out"]),
    (["--resume", "/nonexistent/run"], ["--resume", "/nonexistent/run", "no such run directory"]),
    (["--resume", "{finished}", "--lr", "0.5", "--algo", "ecd"], ["different config", "lr"]),
    (["--resume", "{finished}", "--algo", "ecd", "--simulate", "8"], ["world size"]),
    (["--out", ""], ["--out must name a directory", "''"]),
    (["--out", "  "], ["--out must name a directory"]),
    (["--out", "{tmp}/" + "x" * 300], ["File name too long", "give a shorter --out"]),
    (["--resume", "{tmp}/" + "y" * 300], ["--resume", "File name too long"]),
    (["--resume", "{finished}", "--algo", "ecd", "--max-steps", "4"], ["is finished (step 4 of 4)", "summary.json"]),
    (["--out", "{tmp}/proj", "--overwrite"], ["proj/config.json", "not a gossip run's file", "left alone"]),
    # --- options that would have no effect
    (["--merge-max-groups", "3"], ["--merge-max-groups 3", "no effect with no --merge"]),
    (["--algo", "efsgd", "--merge", "layer", "--merge-alpha", "0.1"], ["--merge-alpha 0.1", "no effect with --merge layer"]),
    # --- TOML files
    (["--config", "{tmp}/deep.toml"], ["deep.toml", "nested too deeply"]),
    (["--config", "{tmp}/lazy.toml"], ["lazy", "'false'", "true or false"]),
    (["--config", "{tmp}/out.toml"], ["out = 5", "text"]),
    (["--config", "{tmp}/epochs.toml"], ["epochs = 2.5", "an integer"]),
    (["--config", "{tmp}/seed.toml"], ["seed = 'zero'", "an integer"]),
    (["--config", "{tmp}/merge.toml"], ["merge = True", "text"]),
    (["--config", "{tmp}/opts.toml"], ["algo_options", "table"]),
    (["--config", "{tmp}/broken.toml"], ["not valid TOML"]),
    (["--config", "{tmp}/unknown.toml"], ["unknown key 'speed'", "accepted"]),
    (["--config", "{tmp}/section.toml"], ["unknown key 'speed' in [optim]"]),
    (["--config", "{tmp}/twice.toml"], ["sets 'lr' a second time"]),
    (["--config", "{tmp}/binary.toml"], ["binary.toml", "TOML"]),
    (["--config", "{tmp}/a-dir"], ["a-dir", "is a directory"]),
    (["--config", "{tmp}/missing.toml"], ["missing.toml", "no such file"]),
]


@pytest.mark.parametrize("args, needles", CASES, ids=[" ".join(a)[:60] for a, _ in CASES])
def test_bad_input_is_one_line_and_damages_nothing(args, needles, finished, tmp_path):
    _files(tmp_path)
    before = _digest(finished)
    args = [a.format(finished=finished, tmp=tmp_path) for a in args]
    out = [] if any(a in ("--out", "--resume") for a in args) else ["--out", str(tmp_path / "new")]
    base = [a for a in SIM if not (args and "--simulate" in args and a in ("--simulate", "4"))]
    rc, _, err = _main(*base, *args, *out)
    lines = err.strip().splitlines()
    assert rc == 2, (rc, err)
    assert len(lines) == 1 and lines[0].startswith("gossip.train: error:"), err
    assert "Traceback" not in err
    for n in needles:
        assert n.format(finished=finished, tmp=tmp_path) in lines[0], (n, lines[0])
    assert _digest(finished) == before  # the finished run is untouched
    assert not (tmp_path / "new").exists() or not any((tmp_path / "new").iterdir())


def test_a_damaged_checkpoint_is_named_and_nothing_else_changes(finished, tmp_path):
    run = tmp_path / "copy"
    shutil.copytree(finished, run)
    newest = run / "ckpt-step4-rank0.pt"
    blob = bytearray(newest.read_bytes())
    blob[40] ^= 0x01  # one bit of the header
    newest.write_bytes(bytes(blob))
    before = _digest(run)
    rc, _, err = _main(*SIM[:-3], "--algo", "ecd", "--max-steps", "6", "--no-progress", "--resume", str(run))
    assert rc == 2 and err.count("\n") == 1, err
    assert str(newest) in err and "damaged" in err
    assert _digest(run) == before


@pytest.mark.parametrize("args, needle", [
    (["complete", "100000000"], "at most about n="),
    (["complete", "50000"], "GiB are available"),
    # sparse graphs too, before any allocation (10^10 nodes need terabytes)
    (["ring", "10000000000"], "ring: n=10,000,000,000 has 10,000,000,000 edges"),
    (["expander", "10000000000"], "at most about n="),
    (["onepeer-exp", "10000000000"], "at most about n="),
    (["torus", "7"], "torus"),
    (["nope", "8"], "nope"),
    (["ring", "-3"], "-3"),
])
def test_the_topologies_cli_refuses_in_one_line(args, needle, tmp_path):
    r = run_process([sys.executable, "-m", "topologies", *args], timeout=120, cwd=tmp_path, env=child_env())
    assert r.returncode != 0
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and needle in lines[0] and "Traceback" not in r.stderr, r.stderr
