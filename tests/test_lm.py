"""Language models: the loss per token, the gpt and lstm models, and training them
through gossip.train (every algorithm, resume, simulation == torchrun)."""

from __future__ import annotations

import contextlib
import io
import json
import math
import subprocess
from pathlib import Path

import pytest
import torch
from torch import nn

from gossip import algorithms, checkpoint, data, models
from gossip.train import evaluation
from gossip import train as gossip_train
from tests.conftest import torchrun_jobs, why

TEXT = ("def greet(name):\n    return f'Grüße, {name}! 🙂'\n\nclass Café:\n    naïve = True\n" * 60)
TINY = ["--data", "text", "--model", "gpt", "--model-opt", "layers=1", "--model-opt", "width=16",
        "--model-opt", "heads=2", "--data-opt", "context=16", "--batch-size", "4", "--no-progress"]


@pytest.fixture
def text_file(tmp_path) -> Path:
    f = tmp_path / "corpus.txt"
    f.write_text(TEXT, encoding="utf-8")
    return f


def train(*args: str) -> subprocess.CompletedProcess:
    """The CLI's main() in this process, its streams captured."""
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            rc = gossip_train.main(list(args))
        except SystemExit as e:
            rc = e.code if isinstance(e.code, int) else 1
    return subprocess.CompletedProcess(args, rc, out.getvalue(), err.getvalue())


def final_params(run_dir: Path) -> torch.Tensor:
    step = max(int(p.name.split("-step")[1].split("-")[0]) for p in run_dir.glob("ckpt-step*-rank*.pt"))
    files = sorted(run_dir.glob(f"ckpt-step{step}-rank*.pt"), key=lambda p: int(p.stem.split("rank")[1]))
    return torch.cat([checkpoint.load_checkpoint(f)["optimizer"]["params"] for f in files])


# --------------------------------------------------------------------------- the loss


class _Bigram(nn.Module):
    """logits[b, t] = table[x[b, t]]: a model whose loss is easy to write by hand."""

    def __init__(self, vocab: int):
        super().__init__()
        self.table = nn.Parameter(torch.randn(vocab, vocab, generator=torch.Generator().manual_seed(1)))

    def forward(self, idx):
        return self.table[idx.long()]


def test_lm_loss_is_the_mean_negative_log_likelihood_per_token_by_hand():
    vocab = 5
    model = _Bigram(vocab)
    x = torch.tensor([[0, 1, 2, 3], [4, 4, 0, 2]], dtype=torch.uint8)
    y = torch.tensor([[1, 2, 3, 4], [4, 0, 2, 1]], dtype=torch.uint8)
    table = model.table.detach().tolist()
    nll = []
    for b in range(2):
        for t in range(4):
            row = table[int(x[b, t])]
            log_z = math.log(sum(math.exp(v) for v in row))
            nll.append(log_z - row[int(y[b, t])])
    want = sum(nll) / len(nll)
    got = evaluation.lm_loss(model(x), y)
    assert abs(float(got.detach()) - want) < 1e-6
    # what a run reports: the same loss on the held-out windows, in bits per byte and perplexity
    ds = data.Dataset(name="t", x_train=x, y_train=y, x_test=x, y_test=y, num_classes=vocab, input_shape=(4,),
                      task="lm")
    m = evaluation.test_metrics(model, ds)
    assert set(m) == {"test_loss", "test_bpb", "test_ppl"}  # no accuracy for a language model
    assert abs(m["test_loss"] - want) < 1e-6
    assert abs(m["test_bpb"] - want / math.log(2)) < 1e-6 and abs(m["test_ppl"] - math.exp(want)) < 1e-5
    with pytest.raises(ValueError, match=r"a language model must return logits \(B, T, vocab\) for targets "
                                         r"\(B, T\) = \(2, 4\), got \(2, 5\)"):
        evaluation.lm_loss(model(x)[:, 0], y)


@pytest.mark.parametrize("name", ["gpt", "lstm"])
def test_language_models_are_causal_with_tied_embeddings(name):
    m = models.build_model(name, input_shape=(12,), num_classes=256, seed=0, layers=2, width=32)
    assert models.model_task(name) == "lm"
    x = torch.randint(0, 256, (3, 12), generator=torch.Generator().manual_seed(0), dtype=torch.int64)
    out = m(x.to(torch.uint8))
    assert out.shape == (3, 12, 256)
    x2 = x.clone()
    x2[:, 7:] = (x2[:, 7:] + 1) % 256
    out2 = m(x2)
    assert torch.equal(out[:, :7], out2[:, :7]) and not torch.allclose(out[:, 7:], out2[:, 7:])
    # the decoder is the embedding: no separate (vocab, width) output matrix
    big = [n for n, p in m.named_parameters() if p.dim() == 2 and 256 in p.shape]
    assert len(big) == 1, big


def test_model_options_are_checked():
    with pytest.raises(ValueError, match=r"^width must be a multiple of heads, got width 30 and heads 4$"):
        models.build_model("gpt", input_shape=(8,), num_classes=256, width=30)
    with pytest.raises(ValueError, match=r"^context 4 is shorter than the data's windows of 8 tokens$"):
        models.build_model("gpt", input_shape=(8,), num_classes=256, context=4)
    with pytest.raises(ValueError, match=r"^model 'lstm' expects input_shape \(context,\) of token ids"):
        models.build_model("lstm", input_shape=(1, 8), num_classes=256)


# --------------------------------------------------------------------------- gossip.train


def test_every_algorithm_trains_a_gpt_on_text_or_refuses_in_one_line(text_file, tmp_path):
    for algo in algorithms.available():
        out = tmp_path / algo
        r = train("--simulate", "4", "--algo", algo, "--data-dir", str(text_file), "--max-steps", "3",
                  "--out", str(out), *TINY)
        if r.returncode != 0:  # a refusal: one line that names the algorithm
            lines = r.stderr.strip().splitlines()
            assert len(lines) == 1 and algo in lines[0], (algo, r.stderr)
            continue
        s = json.loads((out / "summary.json").read_text())
        assert s["task"] == "lm" and s["final_test_acc"] is None, algo
        assert 0 < s["final_test_bpb"] < 9 and s["final_test_ppl"] == pytest.approx(
            math.exp(s["final_test_loss"])), algo
        ev = [json.loads(l) for l in (out / "metrics-rank0.jsonl").read_text().splitlines()][-1]
        assert ev["kind"] == "eval" and "test_acc" not in ev and "node_bpb_min" in ev, algo
        # the simulation says why a language model takes the loop path (no failed batched trial)
        why = (f"--algo {algo} steps one node at a time on the event clock" if algorithms.algorithm_class(algo).asynchronous
               else "the data set's task is 'lm'; the batched path serves classification")
        assert f"simulation path: loop (4 nodes one after another: {why})" in r.stdout, (algo, r.stdout)
    cfg = json.loads((tmp_path / "dpsgd" / "config.json").read_text())
    assert cfg["task"] == "lm" and cfg["corpus"]["corpus"] == "corpus.txt" and len(cfg["corpus"]["sha256"]) == 64
    assert cfg["model_options"] == {"heads": 2, "layers": 1, "width": 16} and cfg["data_options"] == {"context": 16}


def test_model_and_data_of_different_tasks_are_refused_in_one_line(text_file, tmp_path):
    r = train("--simulate", "4", "--algo", "dpsgd", "--data", "text", "--data-dir", str(text_file), "--model",
              "cnn1d", "--out", str(tmp_path / "a"), "--no-progress")
    assert r.returncode == 2 and r.stderr.strip().count("\n") == 0
    assert "--model cnn1d is a classification model and --data text is a language data set; models for it: " \
           "gpt, lstm" in r.stderr
    r = train("--simulate", "4", "--algo", "dpsgd", "--data", "synthetic", "--model", "lstm",
              "--out", str(tmp_path / "b"), "--no-progress")
    assert r.returncode == 2 and "--model lstm is a language model and --data synthetic is a classification" in r.stderr
    r = train("--simulate", "4", "--algo", "dpsgd", "--data", "text", "--data-dir", str(text_file),
              "--model-opt", "depth=3", "--out", str(tmp_path / "c"), "--no-progress")
    assert r.returncode != 0 and "--model-opt depth: not an option of --model gpt; accepted: layers, width, heads, " \
                                 "context" in r.stderr
    r = train("--simulate", "4", "--algo", "dpsgd", "--data", "text", "--data-dir", str(tmp_path / "missing.txt"),
              "--out", str(tmp_path / "d"), "--no-progress")
    assert r.returncode == 2 and "text path" in r.stderr and "missing.txt' does not exist" in r.stderr


def test_resume_is_bit_identical_and_refuses_another_corpus(text_file, tmp_path):
    # two short epochs (20 steps each); the interrupted run stops in the first
    common = ["--simulate", "4", "--algo", "dpsgd", "--data-dir", str(text_file), "--epochs", "2", *TINY]
    full, part = tmp_path / "full", tmp_path / "part"
    assert train(*common, "--out", str(full)).returncode == 0
    r = train(*common, "--out", str(part), "--max-steps", "13", "--checkpoint-every", "5")
    assert r.returncode == 0, r.stderr
    assert train(*common, "--resume", str(part)).returncode == 0
    assert torch.equal(final_params(full), final_params(part))
    a, b = (json.loads((d / "summary.json").read_text()) for d in (full, part))
    assert a["final_test_bpb"] == b["final_test_bpb"] and a["final_train_loss"] == b["final_train_loss"]
    # the same file name and length, one byte changed: another corpus, refused by name
    other = tmp_path / "other" / "corpus.txt"
    other.parent.mkdir()
    other.write_text(TEXT.replace("greet", "greeT", 1), encoding="utf-8")
    part2 = tmp_path / "part2"
    assert train(*common, "--out", str(part2), "--max-steps", "5", "--checkpoint-every", "5").returncode == 0
    before = {p.name: p.read_bytes() for p in part2.iterdir() if p.is_file()}
    common2 = [a if a != str(text_file) else str(other) for a in common]
    r = train(*common2, "--resume", str(part2))
    assert r.returncode == 2 and r.stderr.strip().count("\n") == 0, r.stderr
    assert "was trained on another corpus" in r.stderr and "resume with the same --data and --data-dir" in r.stderr
    assert {p.name: p.read_bytes() for p in part2.iterdir() if p.is_file()} == before  # nothing changed


#: the torchrun twins below: algorithm -> its flags
TORCHRUN_CASES = {"dpsgd": ["--topology", "complete"], "diloco": ["--algo-opt", "local_steps=2"]}


@pytest.fixture(scope="module")
def torchrun_gpts(tmp_path_factory):
    """Each case of :data:`TORCHRUN_CASES` on 2 ranks (one thread each), all in ONE
    torchrun launch: each rank runs the CLI's main() once per case."""
    root = tmp_path_factory.mktemp("torchrun-gpts")
    corpus = root / "corpus.txt"
    corpus.write_text(TEXT, encoding="utf-8")
    args = {algo: ["--algo", algo, *extra, "--data-dir", str(corpus), "--max-steps", "4", *TINY]
            for algo, extra in TORCHRUN_CASES.items()}
    r, codes = torchrun_jobs(2, [(algo, [*a, "--out", str(root / algo / "dist")]) for algo, a in args.items()],
                             timeout=300, cwd=root)
    return root, args, r, codes


@pytest.mark.multiprocess
@pytest.mark.parametrize("algo", list(TORCHRUN_CASES))
def test_torchrun_equals_simulation_for_a_gpt(algo, torchrun_gpts):
    root, args, r, codes = torchrun_gpts
    assert codes[algo] == [0, 0], why(r)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # the twin in this process, with the ranks' thread count
    try:
        r = train("--simulate", "2", *args[algo], "--out", str(root / algo / "sim"))
    finally:
        torch.set_num_threads(threads)
    assert r.returncode == 0, r.stderr
    assert torch.equal(final_params(root / algo / "dist"), final_params(root / algo / "sim"))
    a, b = (json.loads((root / algo / d / "summary.json").read_text()) for d in ("dist", "sim"))
    assert a["final_test_bpb"] == b["final_test_bpb"] and a["mode"] == "torchrun" and b["mode"] == "simulate"


def test_library_api_trains_a_gpt_with_the_users_sgd(text_file):
    """GossipOptimizer as a newcomer calls it: gossip's GPT on 4 nodes of a ring, their
    own torch.optim.SGD(momentum=0.9), the language-model loss; the held-out bits per
    byte of the averaged model fall from the untrained model's (about 8) by over 2 bits."""
    import topologies
    from gossip import comm
    from gossip.runtime import GossipOptimizer

    ds = data.build_dataset("text", data_dir=text_file, context=16)
    nets = [models.build_model("gpt", input_shape=ds.input_shape, num_classes=256, seed=0, layers=1, width=32)
            for _ in range(4)]
    before = evaluation.test_metrics(nets[0], ds)["test_bpb"]
    opts = [torch.optim.SGD(m.parameters(), lr=0.3, momentum=0.9) for m in nets]
    opt = GossipOptimizer(nets, opts, algorithms.build("dpsgd", comm.SimulatedCommunicator(
        topologies.build("ring", 4))))
    shards = data.partition_dataset(ds, 4, "sorted")
    gen = torch.Generator().manual_seed(0)
    for _ in range(25):
        opt.zero_grad()
        for m, shard in zip(nets, shards):
            rows = shard[torch.randint(len(shard), (8,), generator=gen)]
            evaluation.lm_loss(m(ds.x_train[rows]), ds.y_train[rows]).backward()
        opt.step()
    avg = models.build_model("gpt", input_shape=ds.input_shape, num_classes=256, layers=1, width=32)
    torch.nn.utils.vector_to_parameters(opt.average(), avg.parameters())
    after = evaluation.test_metrics(avg, ds)["test_bpb"]
    assert 7.0 < before < 9.0 and after < before - 2.0, (before, after)


def test_the_race_runs_language_models_to_a_bits_per_byte_target(text_file, tmp_path):
    import sys

    from tests.conftest import REPO

    from experiments import race
    out = tmp_path / "race"
    flags = f"--data-dir {text_file} --model-opt layers=1 --model-opt width=16 --model-opt heads=2 --data-opt " \
            f"context=16 --batch-size 8 --lr 0.5"
    assert race.main(["--methods", "allreduce,powersgd:2", "--nodes", "2", "--epochs", "1", "--data", "text",
                      "--model", "gpt", "--train-flags", flags, "--target", "7.5", "--out", str(out)]) == 0
    res = json.loads((out / "race.json").read_text())["results"]
    for name in ("allreduce", "powersgd:2"):
        r = res[name]
        assert r["metric"] == "test_bpb" and r["final_score"] < 7.5 and r["final_test_acc"] is None
        assert all("test_acc" not in p for p in r["points"])
        # bits per byte are reached going down: the first evaluation at or below the target
        first = next(p for p in r["points"] if p["score"] <= 7.5)
        assert r["to_target"]["step"] == first["step"]
    md = (out / "race.md").read_text()
    assert "epoch to 7.5 bpb" in md and " bpb |" in md
