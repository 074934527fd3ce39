"""One schema: the sections' fields give the flags, ``--help``, the TOML keys,
config.json and the fingerprint and agreement keys, so a flag is one edit."""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass

import pytest

from gossip.train import config
from gossip.train.config import ConfigError, TrainConfig, build_parser, option, parse_args


@dataclass(frozen=True, kw_only=True)
class WarmupSection:
    """``[warmup]``: a section only this test declares."""

    warmup_steps: int = option(0, "steps of linear learning-rate warm-up", metavar="N", role="agree")
    warmup_from: float = option(0.1, "the warm-up's first learning rate, as a fraction of --lr",
                                key="warmup_start", role="fingerprint")


@pytest.fixture
def with_warmup(monkeypatch):
    monkeypatch.setitem(config.SECTIONS, "warmup", WarmupSection)


def test_a_field_added_to_a_section_is_a_flag_a_toml_key_and_a_config_json_key(with_warmup, tmp_path):
    cfg = parse_args(["--warmup-steps", "5", "--warmup-start", "0.5", "--lr", "0.1"])
    assert cfg.warmup == WarmupSection(warmup_steps=5, warmup_from=0.5)
    text = " ".join(build_parser().format_help().split())
    assert "[warmup]: a section only this test declares." in text
    assert "--warmup-steps N steps of linear learning-rate warm-up (default: 0)" in text
    assert "--warmup-start WARMUP_START the warm-up's first learning rate" in text
    record = cfg.to_dict()  # config.json
    assert record["warmup_steps"] == 5 and record["warmup_start"] == 0.5
    assert TrainConfig.from_flat({k: v for k, v in record.items() if k in config.FLAT_KEYS}) == cfg
    # the TOML file: the flat key at the top, the field's own name in its section's table
    f = tmp_path / "run.toml"
    f.write_text("warmup-steps = 7\n[warmup]\nwarmup_from = 0.25\n")
    assert parse_args(["--config", str(f)]).warmup == WarmupSection(warmup_steps=7, warmup_from=0.25)
    f.write_text('warmup_steps = "7"\n')
    with pytest.raises(ConfigError, match=r"warmup_steps = '7' has the wrong type; expected an integer"):
        parse_args(["--config", str(f)])
    # its roles: the ranks must agree on both, a checkpoint is fingerprinted with warmup_start
    assert {"warmup_steps", "warmup_start"} <= set(config.agree_keys())
    assert "warmup_start" in config.fingerprint_keys(record) and "warmup_steps" not in config.fingerprint_keys(record)


def test_the_built_in_sections_give_the_keys_earlier_versions_fingerprinted_and_agreed_on():
    """Checkpoints and configs of earlier runs keep their fingerprints: the keys are the
    ones the hand-kept lists held."""
    fingerprint = {"algo", "compressor_spec", "topology", "degree", "rows", "cols", "weights", "lazy", "model_name",
                   "data", "partition", "epochs", "batch_size", "lr", "lr_schedule", "momentum", "local_momentum",
                   "weight_decay", "seed", "merge", "merge_max_groups", "merge_alpha", "algo_options"}
    assert set(config.FINGERPRINT_KEYS) == fingerprint and len(config.FINGERPRINT_KEYS) == len(fingerprint)
    agree = fingerprint | {"max_steps", "checkpoint_every", "log_every", "emulate_latency", "device", "simulate",
                           "tensorboard", "local_optimizer", "betas", "model_options", "data_options",
                           "node_eval",  # agreed on, not fingerprinted: a checkpoint resumes with or without it
                           "muon_precision",  # fingerprinted where set, added since
                           "group_size",  # agreed on: a run's groups
                           "node_speed", "compute_time",  # agreed on: they order an asynchronous run's event clock
                           "byzantine", "attack", "aggregator", "robust"}  # fingerprinted where set (the [trust] section)
    assert set(config.AGREE_KEYS) == agree and len(config.AGREE_KEYS) == len(agree)
    adamw = TrainConfig.from_flat(algo="diloco", model_options={}).to_dict()
    assert set(config.fingerprint_keys(adamw)) == fingerprint | {"local_optimizer", "betas"}
    muloco = TrainConfig.from_flat(algo="muloco", muon_precision="float32").to_dict()
    assert set(config.fingerprint_keys(muloco)) == fingerprint | {"local_optimizer", "betas", "muon_precision"}
    assert "muon_precision" not in config.fingerprint_keys(TrainConfig.from_flat(algo="muloco").to_dict())
    text = TrainConfig.from_flat(data="text", data_options={"context": 64}).to_dict()
    assert set(config.fingerprint_keys({**text, "corpus_sha256": "ab"})) == fingerprint | {"data_options",
                                                                                        "corpus_sha256"}


def test_config_json_keeps_the_order_every_release_wrote():
    keys = list(TrainConfig().to_dict())
    assert keys[:5] == ["algo", "bits", "compressor", "topology", "degree"]
    assert keys[:len(config._RECORD_ORDER)] == list(config._RECORD_ORDER)  # ends with simulate_mode
    # fields added since follow them in the sections' order (--muon-precision's, --ft-verbose's, --no-node-eval's),
    # then the recorded properties
    assert keys[len(config._RECORD_ORDER):] == ["muon_precision", "group_size", "ft_verbose", "node_speed", "link",
                                                "compute_time", "node_eval", "byzantine", "attack", "aggregator",
                                                "robust", "compressor_spec", "model_name",
                                                "local_momentum", "local_optimizer", "betas"]
    assert json.loads(json.dumps(TrainConfig.from_flat(algo="diloco").to_dict()))["betas"] == [0.9, 0.999]


def test_a_field_without_an_option_or_with_an_unknown_role_is_refused(monkeypatch):
    @dataclass(frozen=True, kw_only=True)
    class Bare:
        """``[bare]``"""

        speed: int = 1

    monkeypatch.setitem(config.SECTIONS, "bare", Bare)
    with pytest.raises(TypeError, match=r"Bare.speed is not declared with config.option\(...\)"):
        build_parser()
    with pytest.raises(ValueError, match="Option role must be one of"):
        option(0, "a number", role="fingerprinted")


def test_every_built_in_field_has_help_and_a_flag():
    flags = {s for a in build_parser()._actions for s in a.option_strings}
    for sec, cls in config.SECTIONS.items():
        for f in dataclasses.fields(cls):
            o = f.metadata["option"]
            assert o.help.strip(), f"{sec}.{f.name}"
            flag = o.flag or ("--no-" if f.default is True else "--") + (o.key or f.name).replace("_", "-")
            assert flag in flags, flag


def test_the_data_set_declares_the_model_a_run_trains_without_model(monkeypatch):
    """No data-to-model table in the config: each registered data set names its default
    model, and one registered by the user is honoured the same way."""
    from gossip import data

    assert parse_args(["--data", "mnist1d"]).model_name == "cnn1d"
    assert parse_args(["--data", "synthetic"]).model_name == "logreg"
    assert parse_args(["--data", "text"]).model_name == "gpt"
    monkeypatch.setitem(data.datasets._DEFAULT_MODELS, "mnist1d", "mlp")  # what the registration says is what is used
    assert parse_args(["--data", "mnist1d"]).model_name == "mlp"
    assert parse_args(["--data", "mnist1d", "--model", "logreg"]).model_name == "logreg"
    assert data.default_model("not-registered") == data.FALLBACK_MODEL
