"""demo, sparseloco and noloco through the CLI: torchrun equals the simulation, a resume
in the middle of a round is bit-identical, bad input is one line."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

import topologies
from gossip import algorithms, checkpoint, comm, rundir
from tests.test_train import QUICK, _one_error_line, final_params, torchrun, train, why

CASES = {
    "demo": ["--algo", "demo", "--lr", "0.01", "--weight-decay", "0.01", "--algo-opt", "compression_topk=4"],
    "sparseloco": ["--algo", "sparseloco", "--algo-opt", "local_steps=4", "--algo-opt", "topk_fraction=0.05"],
    "noloco": ["--algo", "noloco", "--algo-opt", "local_steps=4"],
    "muloco": ["--algo", "muloco", "--algo-opt", "local_steps=4"],
}


@pytest.mark.multiprocess
def test_torchrun_equals_the_simulation(tmp_path):
    """The CLI under torchrun (DeMo: its payloads all-gathered between real processes);
    the other two are compared on real processes in test_real_processes_equal_the_simulation."""
    args = [*CASES["demo"], "--max-steps", "10", *QUICK]
    r = torchrun(2, *args, "--out", str(tmp_path / "dist"))
    assert r.returncode == 0, why(r)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # the twin with the ranks' thread count
    try:
        r = train("--simulate", "2", "--simulate-mode", "loop", *args, "--out", str(tmp_path / "sim"))
    finally:
        torch.set_num_threads(threads)
    assert r.returncode == 0, r.stderr
    assert torch.equal(final_params(tmp_path / "dist"), final_params(tmp_path / "sim"))
    a = json.loads((tmp_path / "dist" / "summary.json").read_text())
    b = json.loads((tmp_path / "sim" / "summary.json").read_text())
    assert a["bytes_sent_per_node_total"] == b["bytes_sent_per_node_total"] > 0


@pytest.mark.parametrize("case", list(CASES))
def test_resume_mid_round_is_bit_identical(tmp_path, case):
    common = ["--simulate", "4", *CASES[case], *QUICK]
    full, part = tmp_path / "full", tmp_path / "part"
    assert train(*common, "--out", str(full), "--max-steps", "14").returncode == 0
    r = train(*common, "--out", str(part), "--max-steps", "7", "--checkpoint-every", "7")
    assert r.returncode == 0, r.stderr
    assert checkpoint.load_checkpoint(part / "ckpt-step7-rank0.pt")["optimizer"]["algorithm"]["t"] in (7, 8)
    r = train(*common, "--resume", str(part), "--max-steps", "14")
    assert r.returncode == 0, r.stderr
    assert torch.equal(final_params(full), final_params(part))


@pytest.mark.parametrize("args,needles", [
    (["--algo", "demo", "--algo-opt", "chunk=8"], ["--algo-opt chunk", "not an option of --algo demo"]),
    (["--algo", "sparseloco", "--algo-opt", "topk_fraction=0"], ["topk_fraction", "(0, 1]"]),
    (["--algo", "sparseloco", "--algo-opt", "aggregate=sum"], ["aggregate", "senders, workers", "'sum'"]),
    (["--algo", "demo", "--momentum", "0.9"], ["demo", "momentum"]),
])
def test_bad_input_is_one_line(args, needles):
    _one_error_line(train("--simulate", "2", "--data", "synthetic", "--no-progress", *args), *needles)


WORLD = [("demo", None, {"compression_chunk": 4, "compression_topk": 2}),
         ("sparseloco", None, {"local_steps": 3, "chunk": 4, "topk_fraction": 0.25}),
         ("noloco", "matching", {"local_steps": 3}),
         ("diloco", None, {"local_steps": 4, "fragments": 2, "fragment_sync_delay": 1, "fragment_update_alpha": 0.5,
                           "compressor": "quant:bits=4", "error_feedback": True})]
STEPS, D = 7, 41


def _problem(n: int):
    g = torch.Generator().manual_seed(11)
    return torch.randn(n, D, generator=g), torch.randn(D, generator=g)


def _trajectory(make_comm, X, A):
    out = {}
    layout = algorithms.ParamLayout.from_shapes([(4, 5), (21,)])
    for name, topo, opts in WORLD:
        c = make_comm(topo)
        alg = algorithms.build(name, c, **opts)
        Y = X.clone()
        alg.setup(Y, layout)
        rows = []
        for _ in range(STEPS):
            alg.set_lr(0.1)
            if alg.acts_on == "gradient":
                G = Y - A
                alg.reduce_gradients(G)
                Y -= 0.1 * G
            else:
                alg.step(Y, -0.1 * (Y - A))
            rows.append(Y.clone())
        out[name] = (torch.stack(rows, dim=1), c.ledger.bytes_sent)
    return out


def _rank():
    import torch.distributed as dist

    n, rank = dist.get_world_size(), dist.get_rank()
    A, x1 = _problem(n)
    traj = _trajectory(lambda t: comm.DistCommunicator(topologies.build(t or "complete", n), timeout=30),
                       x1.unsqueeze(0), A[rank:rank + 1])
    return {k: (v[0][0], v[1]) for k, v in traj.items()}


@pytest.mark.multiprocess
def test_real_processes_equal_the_simulation():
    """Each method (and Streaming DiLoCo's overlap, its exchange in flight over an inner
    step) on 2 real processes (gloo) is its 2-node simulation bit for bit, bytes too."""
    from tests._dist import run_world

    results = run_world(2, _rank, timeout=120)
    A, x1 = _problem(2)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as the ranks
    try:
        sim = _trajectory(lambda t: comm.SimulatedCommunicator(topologies.build(t or "complete", 2)),
                          x1.repeat(2, 1), A)
    finally:
        torch.set_num_threads(threads)
    for rank, res in enumerate(results):
        for name, _, _ in WORLD:
            traj, sent = res[name]
            assert torch.equal(traj, sim[name][0][rank]), (name, rank)
            assert sent * 2 == sim[name][1] > 0, name


def test_modern_compare_smoke(tmp_path):
    """The study experiments/studies/modern_compare.toml end to end on a tiny run: a
    2-value grid tuned on the validation carve, the selected rate's final run on the test
    split, the table and the JSON with its provenance, each method's bytes against
    allreduce; a second call redoes no trial."""
    from experiments import bench_data, study

    served = len(bench_data.SERVED)
    argv = ["--epochs", "1", "--tune-epochs", "1", "--lr-factors", "1,3", "--data", "synthetic", "--samples", "256",
            "--model", "mlp", "--nodes", "2", "--methods", "allreduce,sparseloco", "--max-steps", "16",
            "--out", str(tmp_path)]
    assert study.main(argv, name="modern_compare") == 0
    res = json.loads((tmp_path / "results.json").read_text())
    assert "python -m experiments run modern_compare --epochs 1" in res["provenance"]["command"]
    sl = res["results"]["sparseloco"]
    assert [g["lr"] for g in sl["grid"]] == [0.003, 0.009]
    assert sl["lr"] == study.select_lr(sl["grid"]) in (0.003, 0.009)
    assert all(g["val_acc"] is not None for g in sl["grid"])
    # tuning saw only the carve, the final run only the test split
    roles = [s["role"] for s in bench_data.SERVED[served:]]
    assert roles == ["val"] * 4 + ["test"] * 2
    assert res["data"] == {"tune": "bench_data:synthetic_n256_val", "final": "bench_data:synthetic_n256_test"}
    assert (res["nodes"], res["epochs"], res["tune_epochs"], res["lr_factors"]) == (2, 1, 1, [1.0, 3.0])
    assert sl["bytes_vs_allreduce"] == sl["bytes_per_step"] / res["results"]["allreduce"]["bytes_per_step"] < 1
    # what the witnesses re-run: the final runs at their selected rates, as the spec makes them
    s = study.load(study.spec_path("modern_compare"))
    lrs = {n: r["lr"] for n, r in res["results"].items()}
    assert res["provenance"]["configs"] == study.configs(
        s, ["allreduce", "sparseloco"], data="synthetic", lrs=lrs,
        params={"nodes": 2, "epochs": 1, "tune_epochs": 1, "samples": 256, "model": "mlp", "seed": 0})
    assert res["provenance"]["configs"][1][-4:] == ["--lr", f"{sl['lr']:g}", "--seed", "0"]
    assert "| sparseloco |" in (tmp_path / "results.md").read_text()
    # a second call finds every trial done and redoes none
    assert study.main(argv, name="modern_compare") == 0
    assert len(bench_data.SERVED) == served + 6
    with pytest.raises(SystemExit):
        study.main(["--lr-factors", "0,x", "--out", str(tmp_path)], name="modern_compare")


def test_modern_compare_selection_ties_go_to_the_smaller_rate():
    from experiments import study

    grid = [{"lr": 0.01, "val_acc": 0.5}, {"lr": 0.001, "val_acc": 0.5}, {"lr": 0.1, "val_acc": None}]
    assert study.select_lr(grid) == 0.001
    assert study.select_lr([{"lr": 0.1, "val_acc": None}]) is None


def test_modern_compare_reruns_an_interrupted_trial_not_a_failed_one(tmp_path):
    from gossip import rundir

    from experiments import study

    args = ["--lr", "0.1"]
    for status, done in (("ok", True), ("failed", True), ("interrupted", False)):
        rundir.write_json(tmp_path / "trial.json", {"args": args, "status": status})
        assert (study.trial_done(tmp_path, args) is not None) is done, status
    assert study.trial_done(tmp_path, ["--lr", "0.2"]) is None  # other flags: not this trial


def test_docs_tables_come_from_the_results_files():
    """docs/modern.md's two tables are the ones the experiments render from their
    results files in experiments/results/, under the command each was made by (in the
    form that runs it today)."""
    import sys

    from tests.conftest import REPO

    from experiments import _provenance, study, tables
    doc = (REPO / "docs" / "modern.md").read_text(encoding="utf-8")
    res = json.loads((REPO / "experiments" / "results" / "modern_compare.json").read_text())
    assert tables.modern_compare_table(res["results"]) in doc
    assert study.as_study_command(_provenance.as_module(res["provenance"]["command"])) in doc
    for name in ("streaming_overlap.json", "streaming_overlap_taus.json"):
        ov = json.loads((REPO / "experiments" / "results" / name).read_text())
        assert tables.streaming_overlap_table(ov["runs_s_per_step"], ov.get("wait_s_per_step")) in doc
        assert _provenance.as_module(ov["provenance"]["command"]) in doc


def test_streaming_overlap_times_the_steps_and_refuses_an_evaluation_inside(tmp_path):
    """The overlap bench's clock: seconds and waits per step between the end of the
    first round and the last step, from rank 0's records; an epoch's evaluation inside
    the timed steps (a training set too small for the run) is refused, one at the run's
    end is not; the training set it generates is longer than the run."""
    import sys

    from tests.conftest import REPO

    from experiments import streaming_overlap

    def write(run: Path, eval_at: int) -> Path:
        recs = [{"kind": "train", "step": s, "time": 0.5 * s, "wait_s": 0.1 * s} for s in range(1, 13)]
        recs.append({"kind": "eval", "step": eval_at, "time": 6.5})
        path = rundir.metrics_path(run, 0)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text("".join(json.dumps(r) + "\n" for r in recs))
        return run

    step, wait = streaming_overlap.step_times(write(tmp_path / "ok", 12), 8)
    assert step == pytest.approx(0.5) and wait == pytest.approx(0.1)
    with pytest.raises(SystemExit, match="evaluated inside the timed steps 8..12"):
        streaming_overlap.step_times(write(tmp_path / "bad", 10), 8)
    assert streaming_overlap.train_samples(4, 1024, 40) == 4 * 1024 * 41
    assert streaming_overlap.train_samples(4, 8, 10) == 4000  # never below the embedded set
