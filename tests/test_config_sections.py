"""TrainConfig's sections: flat keys and sections build the same config, each section
checks its own fields, and TOML files may use either form."""

from __future__ import annotations

import dataclasses

import pytest

from gossip.train.config import (
    FLAT_KEYS,
    SECTIONS,
    AlgorithmSection,
    ConfigError,
    OptimSection,
    TrainConfig,
    parse_args,
)


def test_flat_keys_and_sections_build_the_same_config():
    flat = TrainConfig.from_flat(algo="dcd", bits=4, lr=0.1, batch_size=64, data="synthetic", simulate=3)
    sec = TrainConfig(
        algorithm={"name": "dcd", "bits": 4}, optim=OptimSection(lr=0.1),
        data={"name": "synthetic", "batch_size": 64}, comm={"simulate": 3},
    )
    assert flat == sec and hash(flat) == hash(sec)
    assert flat.algorithm.compressor_spec == "quant:bits=4" and flat.model_name == "logreg"
    d = flat.to_dict()
    assert d["algo"] == "dcd" and d["lr"] == 0.1 and d["batch_size"] == 64 and d["compressor_spec"] == "quant:bits=4"
    assert TrainConfig.from_flat({k: v for k, v in d.items() if k in FLAT_KEYS}) == flat


def test_every_section_field_has_one_flat_key():
    fields = {(s, f.name) for s, cls in SECTIONS.items() for f in dataclasses.fields(cls)}
    assert set(FLAT_KEYS.values()) == fields


def test_config_is_frozen():
    cfg = TrainConfig()
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.optim = OptimSection()
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.optim.lr = 1.0


@pytest.mark.parametrize("kw, needle", [
    ({"optim": {"lr": 0}}, "--lr must be a finite number > 0"),
    ({"algorithm": {"name": "nope"}}, "unknown --algo 'nope'"),
    ({"data": {"batch_size": 0}}, "--batch-size must be an integer >= 1"),
    ({"comm": {"lazy": "false"}}, "--lazy must be true or false"),
    ({"run": {"seed": -1}}, "--seed must be an integer >= 0"),
    ({"optim": {"speed": 1}}, r"\[optim\]: unknown key\(s\) \['speed'\]"),
    ({"nope": {}}, "unknown config section"),
    ({"algorithm": {"name": "dcd"}, "comm": {"simulate": 1}}, "--simulate must be >= 2"),
    ({"run": {"max_steps": 0}}, "--max-steps must be a positive integer, got 0"),
    # Muon keeps its own momentum and the AdamW part's betas: the flags would be ignored
    ({"algorithm": {"name": "muloco"}, "optim": {"momentum": 0.9}},
     "--momentum: --algo muloco's default optimizer muon keeps torch.optim.Muon's own momentum"),
    ({"optim": {"optimizer": "muon", "beta1": 0.8, "beta2": 0.99}}, "--beta1/--beta2: --optimizer muon keeps"),
])
def test_each_section_checks_its_fields(kw, needle):
    with pytest.raises(ConfigError, match=needle):
        TrainConfig(**kw)


def test_unknown_flat_key_lists_the_accepted_ones():
    with pytest.raises(ConfigError, match="unknown config key 'speed'; accepted: .*algo"):
        TrainConfig.from_flat(speed=1)


def test_algorithm_section_reads_options_as_the_fields_types():
    a = AlgorithmSection(name="powersgd", options={"rank": "4", "approximator": "best"})
    assert a.options == (("approximator", "best"), ("rank", 4))


def test_toml_sections_and_flat_keys(tmp_path):
    f = tmp_path / "run.toml"
    f.write_text(
        'algo = "powersgd"\nepochs = 2\n\n[optim]\nlr = 0.2\n\n[data]\nname = "synthetic"\nbatch-size = 16\n\n'
        '[algorithm.options]\nrank = 3\n'
    )
    cfg = parse_args(["--config", str(f), "--algo-opt", "approximator=best"])
    assert cfg.algorithm.name == "powersgd" and cfg.run.epochs == 2 and cfg.optim.lr == 0.2
    assert cfg.data.name == "synthetic" and cfg.data.batch_size == 16
    assert dict(cfg.algorithm.options) == {"rank": 3, "approximator": "best"}


def test_toml_tensorboard_key(tmp_path):
    f = tmp_path / "run.toml"
    f.write_text('algo = "allreduce"\n\n[run]\ntensorboard = true\n')
    assert parse_args(["--config", str(f)]).run.tensorboard is True
    f.write_text('tensorboard = true\n')
    assert parse_args(["--config", str(f)]).run.tensorboard is True
    assert parse_args([]).run.tensorboard is False


@pytest.mark.parametrize("text, needle", [
    ('[optim]\nspeed = 1\n', r"unknown key 'speed' in \[optim\]; accepted: lr"),
    ('lr = 0.1\n[optim]\nlr = 0.2\n', r"\[optim\] sets 'lr' a second time"),
])
def test_toml_section_errors_are_one_line(tmp_path, text, needle):
    f = tmp_path / "bad.toml"
    f.write_text(text)
    with pytest.raises(ConfigError, match=needle):
        parse_args(["--config", str(f)])
