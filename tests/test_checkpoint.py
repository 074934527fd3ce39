"""Tests of gossip.checkpoint (the file format) and gossip.train.checkpoint (the run's
manager): atomic saves, verified loads, fingerprints, run directories."""

from __future__ import annotations

import hashlib
import io
import json
import re
import os

import pytest
import torch
from torch import nn

from gossip import checkpoint as ck
from gossip.train import checkpoint as manager
from gossip.checkpoint import CheckpointError, config_fingerprint, load_checkpoint, save_checkpoint
from gossip.data import ShardLoader

CONFIG = {"algo": "ecd", "lr": 0.1, "bits": 8, "topology": "ring", "seed": 0, "out": "runs/x"}
KEYS = ("algo", "lr", "bits", "topology", "seed")


def _payload():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 3), nn.BatchNorm1d(3))
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    model(torch.randn(5, 4)).sum().backward()
    opt.step()
    gen = torch.Generator().manual_seed(3)
    torch.rand(4, generator=gen)
    loader = ShardLoader(torch.randn(20, 2), torch.arange(20) % 2, torch.arange(20), 3, seed=1, node=0)
    loader.next_batch()
    return {
        "step": 12,
        "model": model.state_dict(),
        "optimizer": opt.state_dict(),
        "generator": gen.get_state(),
        "loader": loader.state_dict(),
        "misc": {"loss": 0.25, "name": "ring", "shape": (2, 3), "none": None, "raw": b"\x00\x01", "flag": True},
        "nodes": [0, 1, 2],
    }


def _equal(a, b):
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(_equal(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(_equal(x, y) for x, y in zip(a, b))
    return a == b


@pytest.fixture
def saved(tmp_path):
    path = tmp_path / "run" / "ckpt-step12-rank0.pt"
    payload = _payload()
    save_checkpoint(path, payload, config=CONFIG, fingerprint_keys=KEYS, world_size=4)
    return path, payload


# --------------------------------------------------------------------------- round trip


def test_round_trip_restores_everything(saved):
    path, payload = saved
    loaded = load_checkpoint(path, expect_fingerprint=config_fingerprint(CONFIG, KEYS), expect_world_size=4,
                             expect_config=CONFIG)
    assert _equal(loaded, payload)
    gen = torch.Generator()
    gen.set_state(loaded["generator"])
    ref = torch.Generator()
    ref.set_state(payload["generator"])
    assert torch.equal(torch.rand(3, generator=gen), torch.rand(3, generator=ref))


def test_the_body_loads_with_weights_only(saved):
    """The body is a plain torch.save that the safe unpickler accepts (what load_checkpoint uses)."""
    path, payload = saved
    blob = path.read_bytes()
    magic, hsum, header, body = blob.split(b"\n", 3)
    assert magic == b"GOSSIP-CHECKPOINT"
    assert hsum == b"HSUM " + hashlib.sha256(header + b"\n").hexdigest().encode()  # the header's checksum
    assert _equal(torch.load(io.BytesIO(body), weights_only=True), payload)
    assert json.loads(header)["sha256"] == hashlib.sha256(body).hexdigest()


def _saved_before_streaming(path, payload, **kw):
    """save_checkpoint as it was before the body was streamed: the body serialised in
    memory first, the header line unpadded."""
    header = ck._new_header(kw.get("config"), kw.get("fingerprint_keys"), None, kw.get("world_size"))
    buf = io.BytesIO()
    torch.save(dict(payload), buf)
    body = buf.getvalue()
    header.update(nbytes=len(body), sha256=hashlib.sha256(body).hexdigest())
    line = json.dumps(header, sort_keys=True, separators=(",", ":")).encode() + b"\n"
    path.write_bytes(b"GOSSIP-CHECKPOINT\nHSUM " + hashlib.sha256(line).hexdigest().encode() + b"\n" + line + body)


def _zip_records(body: bytes) -> dict[str, bytes]:
    """The records of ``body`` (a torch.save zip) by name, read from their local headers
    without the CRC-32 check (which zipfile would make), less the serialization id
    torch derives from the CRCs."""
    import struct
    import zipfile

    out = {}
    for info in zipfile.ZipFile(io.BytesIO(body)).infolist():
        o = info.header_offset
        assert body[o: o + 4] == b"PK\x03\x04"
        n, m = struct.unpack("<HH", body[o + 26: o + 30])
        out[info.filename] = body[o + 30 + n + m: o + 30 + n + m + info.compress_size]
    out.pop(next(k for k in out if k.endswith(".data/serialization_id")))
    return out


def test_the_body_carries_no_zip_crcs_and_the_option_is_restored(tmp_path):
    """torch's per-record CRC-32 is skipped (the header's SHA-256 covers the body) and
    torch's setting is left as the caller had it, also after a failed save."""
    import zipfile

    get, set_ = torch.serialization.get_crc32_options, torch.serialization.set_crc32_options
    for before in (True, False):
        set_(before)
        try:
            path = save_checkpoint(tmp_path / f"c{before}.pt", {"x": torch.arange(1000.0)}, world_size=1)
            assert get() is before
            with pytest.raises(TypeError):
                save_checkpoint(tmp_path / "bad.pt", {"x": object()}, world_size=1)
            assert get() is before
        finally:
            set_(True)
        _, _, body = _split(path.read_bytes())
        crcs = [i.CRC for i in zipfile.ZipFile(io.BytesIO(body)).infolist()]
        assert len(crcs) >= 2 and set(crcs) == {0}  # the pickle, the tensor's data, torch's small records
        assert torch.equal(load_checkpoint(path)["x"], torch.arange(1000.0))
        assert torch.equal(torch.load(io.BytesIO(body), weights_only=True)["x"], torch.arange(1000.0))


def test_the_streamed_file_holds_the_bytes_of_the_in_memory_one_and_both_load(saved, tmp_path):
    """Streaming changed only the header's padding, and skipping torch's CRC-32 only the
    zip records' CRC fields (so the body's SHA-256); the other header entries are the
    same, and a file of the earlier writer loads as before."""
    path, payload = saved
    old = tmp_path / "old.pt"
    _saved_before_streaming(old, payload, config=CONFIG, fingerprint_keys=KEYS, world_size=4)
    _, new_head, new_body = _split(path.read_bytes())
    _, old_head, old_body = _split(old.read_bytes())
    # the same records with the same bytes; the zip's CRC-32 fields (now left at zero)
    # and the serialization id derived from them differ
    assert _zip_records(new_body) == _zip_records(old_body) and len(new_body) == len(old_body)
    new_entries, old_entries = json.loads(new_head), json.loads(old_head)
    assert new_entries.pop("sha256") != old_entries.pop("sha256")
    assert new_entries == old_entries
    assert len(new_head) > len(old_head)  # spaces before the newline
    for p in (path, old):
        assert _equal(load_checkpoint(p, expect_config=CONFIG, expect_world_size=4), payload)


def test_a_checkpoint_saves_the_parameter_matrix_without_copying_it():
    """``state_dict(copy=False)`` (what CheckpointManager saves) hands over X itself;
    the default stays a copy that later steps leave alone."""
    from gossip import algorithms, vectorized
    from gossip.comm import SimulatedCommunicator
    from gossip.runtime import GossipOptimizer
    from topologies import ring

    models = [nn.Linear(3, 2) for _ in range(3)]
    loop = GossipOptimizer(models, [torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9) for m in models],
                           algorithms.build("dpsgd", SimulatedCommunicator(ring(3))))
    vec = vectorized.VectorizedOptimizer(nn.Linear(3, 2), lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9),
                                         algorithms.build("dpsgd", SimulatedCommunicator(ring(3))))
    for gopt in (loop, vec):
        assert gopt.state_dict(copy=False)["params"].data_ptr() == gopt.flat.data.data_ptr()
        copied = gopt.state_dict()["params"]
        assert torch.equal(copied, gopt.flat.data) and copied.data_ptr() != gopt.flat.data.data_ptr()


def test_header_records_version_world_size_and_config(saved):
    path, _ = saved
    info = ck.checkpoint_info(path)
    assert info["format_version"] == ck.FORMAT_VERSION == 1
    assert info["world_size"] == 4
    assert info["fingerprint"] == config_fingerprint(CONFIG, KEYS)
    assert info["config"] == {k: CONFIG[k] for k in KEYS}  # "out" does not matter to a resume


def test_resumed_loader_continues_identically(tmp_path):
    x, y = torch.randn(30, 2), torch.arange(30) % 3
    loader = ShardLoader(x, y, torch.arange(30), 4, seed=5, node=1)
    for _ in range(9):
        loader.next_batch()
    save_checkpoint(tmp_path / "c.pt", {"loader": loader.state_dict()})
    expected = [loader.next_batch() for _ in range(10)]
    fresh = ShardLoader(x, y, torch.arange(30), 4, seed=5, node=1)
    fresh.load_state_dict(load_checkpoint(tmp_path / "c.pt")["loader"])
    for bx, by in expected:
        fx, fy = fresh.next_batch()
        assert torch.equal(fx, bx) and torch.equal(fy, by)


def test_precomputed_fingerprint_is_stored(tmp_path):
    fp = config_fingerprint(CONFIG, KEYS)
    save_checkpoint(tmp_path / "c.pt", {"a": 1}, fingerprint=fp, world_size=2)
    assert load_checkpoint(tmp_path / "c.pt", expect_fingerprint=fp, expect_world_size=2) == {"a": 1}
    assert "config" not in ck.checkpoint_info(tmp_path / "c.pt")


# --------------------------------------------------------------------------- fingerprint


def test_fingerprint_is_canonical_json_sha256():
    expected = hashlib.sha256(b'{"bits":8,"lr":0.1}').hexdigest()[:16]
    assert config_fingerprint({"lr": 0.1, "bits": 8}) == expected
    assert config_fingerprint({"bits": 8, "lr": 0.1, "out": "a"}, ["lr", "bits"]) == expected
    assert config_fingerprint({"dims": (1, 2)}) == config_fingerprint({"dims": [1, 2]})
    assert config_fingerprint({"lr": 0.1}) != config_fingerprint({"lr": 0.05})


def test_fingerprint_rejects_what_it_cannot_hash():
    with pytest.raises(ValueError, match=r"fingerprint keys 'momentum' are not in the config"):
        config_fingerprint(CONFIG, ["lr", "momentum"])
    with pytest.raises(ValueError, match=r"config\['path'\] = .* cannot be fingerprinted .*; use JSON values"):
        config_fingerprint({"path": object()})
    with pytest.raises(ValueError, match=r"config\['lr'\] = nan cannot be fingerprinted"):
        config_fingerprint({"lr": float("nan")})


# --------------------------------------------------------------------------- atomicity


class _DiskFull:
    """A file object that writes ``budget`` bytes and then fails, like a full disk."""

    def __init__(self, f, budget):
        self._f, self._budget = f, budget

    def write(self, b):
        b = bytes(b)
        if len(b) > self._budget:
            self._f.write(b[: self._budget])
            self._f.flush()
            self._budget = 0
            raise OSError(28, "No space left on device")
        self._budget -= len(b)
        return self._f.write(b)

    def __getattr__(self, name):
        return getattr(self._f, name)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self._f.close()


@pytest.mark.parametrize("failure", [OSError, KeyboardInterrupt])
def test_failed_write_keeps_the_old_checkpoint_and_leaves_no_temp(saved, monkeypatch, failure):
    path, payload = saved
    before = path.read_bytes()
    real_fdopen = os.fdopen
    written = []

    def fdopen(fd, *args, **kwargs):
        f = _DiskFull(real_fdopen(fd, *args, **kwargs), budget=300)
        written.append(f)
        if failure is KeyboardInterrupt:
            def interrupted(b):
                f._f.write(bytes(b)[:10])
                raise KeyboardInterrupt
            f.write = interrupted
        return f

    monkeypatch.setattr(ck.os, "fdopen", fdopen)
    with pytest.raises(failure):
        save_checkpoint(path, {"step": 13, "big": torch.zeros(10_000)}, config=CONFIG, fingerprint_keys=KEYS,
                        world_size=4)
    monkeypatch.undo()
    assert written, "the write never reached the temporary file"
    assert os.listdir(path.parent) == [path.name]
    assert path.read_bytes() == before
    assert _equal(load_checkpoint(path), payload)


def test_a_killed_writer_leaves_only_an_ignored_temp(tmp_path):
    save_checkpoint(ck.checkpoint_path(tmp_path, 10), {"step": 10})
    (tmp_path / ".ckpt-step20-rank0.pt.abc123.tmp").write_bytes(b"GOSSIP-CHECKPOINT\n{")
    assert ck.latest_checkpoint(tmp_path) == ck.checkpoint_path(tmp_path, 10)
    assert sorted(ck.list_checkpoints(tmp_path)) == [10]


def test_save_replaces_an_existing_checkpoint(saved):
    path, _ = saved
    save_checkpoint(path, {"step": 99})
    assert load_checkpoint(path) == {"step": 99}
    assert os.listdir(path.parent) == [path.name]


# --------------------------------------------------------------------------- CheckpointError


def _split(blob: bytes) -> tuple[bytes, bytes, bytes]:
    """magic, header line, body; the header's checksum line dropped (a file without it is
    still read: checkpoints written before it had none)."""
    magic, rest = blob.split(b"\n", 1)
    if rest.startswith(b"HSUM "):
        rest = rest.split(b"\n", 1)[1]
    head, body = rest.split(b"\n", 1)
    return magic, head, body


def _rewrite(path, *, header=None, body=None):
    magic, head, rest = _split(path.read_bytes())
    h = json.loads(head)
    if header:
        h.update(header)
    path.write_bytes(magic + b"\n" + json.dumps(h).encode() + b"\n" + (rest if body is None else body))


def _framed(path, obj):
    """Write ``obj`` in a valid frame (right length and checksum), bypassing save_checkpoint's checks."""
    buf = io.BytesIO()
    torch.save(obj, buf)
    body = buf.getvalue()
    head = {"format_version": 1, "nbytes": len(body), "sha256": hashlib.sha256(body).hexdigest()}
    path.write_bytes(b"GOSSIP-CHECKPOINT\n" + json.dumps(head).encode() + b"\n" + body)


class _Evil:
    def __reduce__(self):
        return (os.system, ("echo should-not-run",))


def test_missing_file(tmp_path):
    with pytest.raises(CheckpointError, match=r"checkpoint '.*nope.pt' does not exist"):
        load_checkpoint(tmp_path / "nope.pt")
    with pytest.raises(CheckpointError, match=r"checkpoint '.*' is a directory, not a checkpoint file"):
        load_checkpoint(tmp_path)


def test_not_a_gossip_checkpoint(tmp_path):
    torch.save({"a": 1}, tmp_path / "plain.pt")
    with pytest.raises(CheckpointError, match=r"'.*plain.pt' is damaged or not a gossip checkpoint: it does not start"):
        load_checkpoint(tmp_path / "plain.pt")
    (tmp_path / "empty.pt").write_bytes(b"")
    with pytest.raises(CheckpointError, match="does not start with the gossip checkpoint marker"):
        load_checkpoint(tmp_path / "empty.pt")


@pytest.mark.parametrize(
    "cut, msg",
    [
        (30, r"damaged or not a gossip checkpoint: its header line is truncated"),
        (-100, r"damaged: its body has \d+ bytes, the header says \d+ \(truncated\)"),
        (-1, r"\(truncated\)"),
    ],
)
def test_truncated_file(saved, cut, msg):
    path, _ = saved
    blob = path.read_bytes()
    path.write_bytes(blob[:cut])
    with pytest.raises(CheckpointError, match=msg):
        load_checkpoint(path)


def test_trailing_bytes(saved):
    path, _ = saved
    path.write_bytes(path.read_bytes() + b"x")
    with pytest.raises(CheckpointError, match=r"damaged: its body has \d+ bytes, the header says \d+$"):
        load_checkpoint(path)


def test_flipped_byte_fails_the_checksum(saved):
    path, _ = saved
    blob = bytearray(path.read_bytes())
    blob[-500] ^= 0x01
    path.write_bytes(bytes(blob))
    with pytest.raises(CheckpointError, match=r"damaged: checksum mismatch \(sha256 [0-9a-f]{16}\.\.\., header says"):
        load_checkpoint(path)


def test_a_flipped_bit_in_the_header_says_damaged(saved):
    path, _ = saved
    original = path.read_bytes()
    end = original.index(b"\n", original.index(b"HSUM "))
    head_end = original.index(b"\n", end + 1)
    for off in range(0, head_end, 5):  # every 5th byte of the marker, the checksum and the header
        blob = bytearray(original)
        blob[off] ^= 0x10
        path.write_bytes(bytes(blob))
        with pytest.raises(CheckpointError, match=rf"checkpoint '{re.escape(str(path))}' is damaged"):
            load_checkpoint(path)
    path.write_bytes(original)


def test_header_not_json(saved):
    path, _ = saved
    original = path.read_bytes()
    magic, _, rest = _split(original)
    path.write_bytes(magic + b"\n{oops\n" + rest)
    with pytest.raises(CheckpointError, match="its header is not JSON"):
        load_checkpoint(path)
    path.write_bytes(original)
    _rewrite(path, header={"format_version": "one"})
    with pytest.raises(CheckpointError, match="its header has no format_version"):
        load_checkpoint(path)


def test_wrong_format_version(saved):
    path, _ = saved
    _rewrite(path, header={"format_version": 2})
    with pytest.raises(CheckpointError, match=r"has format version 2; this gossip reads version 1"):
        load_checkpoint(path)
    with pytest.raises(CheckpointError, match=r"has format version 2"):
        ck.checkpoint_info(path)


def test_world_size_mismatch(saved):
    path, _ = saved
    with pytest.raises(CheckpointError, match=r"was written for world size 4, this run has 8"):
        load_checkpoint(path, expect_world_size=8)


def test_fingerprint_mismatch_names_the_differing_keys(saved):
    path, _ = saved
    other = {**CONFIG, "lr": 0.05, "bits": 4, "out": "elsewhere"}
    with pytest.raises(CheckpointError, match=r"written with a different config: bits 8 != 4, lr 0.1 != 0.05$"):
        load_checkpoint(path, expect_fingerprint=config_fingerprint(other, KEYS), expect_config=other)
    with pytest.raises(CheckpointError, match=r"different config: lr 0.1 != 0.05"):
        load_checkpoint(path, expect_config={**CONFIG, "lr": 0.05})  # a check on its own too
    fp = config_fingerprint(other, KEYS)
    with pytest.raises(CheckpointError, match=rf"different config: fingerprint [0-9a-f]{{16}} != {fp}"):
        load_checkpoint(path, expect_fingerprint=fp)
    # Keys outside the fingerprinted ones do not matter.
    load_checkpoint(path, expect_config={**CONFIG, "out": "elsewhere"}, expect_fingerprint=config_fingerprint(
        {**CONFIG, "out": "elsewhere"}, KEYS))


def test_missing_config_key_is_reported(saved):
    path, _ = saved
    partial = {k: v for k, v in CONFIG.items() if k != "bits"}
    with pytest.raises(CheckpointError, match=r"different config: bits 8 != \(absent\)"):
        load_checkpoint(path, expect_config=partial)


def test_body_that_needs_code_is_refused(tmp_path):
    _framed(tmp_path / "evil.pt", {"x": _Evil()})
    with pytest.raises(CheckpointError, match=r"damaged: its body cannot be loaded \(UnpicklingError: "):
        load_checkpoint(tmp_path / "evil.pt")
    _framed(tmp_path / "list.pt", [1, 2])
    with pytest.raises(CheckpointError, match=r"its body holds a list, not a dict"):
        load_checkpoint(tmp_path / "list.pt")


def test_every_error_is_one_line(saved, tmp_path):
    path, _ = saved
    _framed(tmp_path / "evil.pt", {"x": _Evil()})
    for target, kwargs in [(tmp_path / "evil.pt", {}), (path, {"expect_world_size": 1}), (tmp_path / "no", {})]:
        with pytest.raises(CheckpointError) as info:
            load_checkpoint(target, **kwargs)
        assert "\n" not in str(info.value)


# --------------------------------------------------------------------------- save-time checks


@pytest.mark.parametrize(
    "payload, exc, msg",
    [
        ({"a": {"b": object()}}, TypeError, r"payload\['a'\]\['b'\] is a builtins.object; checkpoints hold only"),
        ({"a": [1, {2.5}]}, TypeError, r"payload\['a'\]\[1\] is a builtins.set"),
        ({"a": {(1, 2): 3}}, TypeError, r"payload\['a'\] has a key \(1, 2\) of type tuple"),
        ({1: 2}, TypeError, r"payload must be a dict with str keys"),
        ([("a", 1)], TypeError, r"payload must be a dict with str keys"),
    ],
)
def test_unloadable_payload_is_refused_at_save_time(tmp_path, payload, exc, msg):
    with pytest.raises(exc, match=msg):
        save_checkpoint(tmp_path / "c.pt", payload)
    assert os.listdir(tmp_path) == []


def test_numpy_scalars_are_refused_at_save_time(tmp_path):
    np = pytest.importorskip("numpy")
    with pytest.raises(TypeError, match=r"payload\['loss'\] is a numpy.float64"):
        save_checkpoint(tmp_path / "c.pt", {"loss": np.float64(0.5)})


def test_bad_save_arguments(tmp_path):
    with pytest.raises(ValueError, match="world_size must be a positive integer, got 0"):
        save_checkpoint(tmp_path / "c.pt", {}, world_size=0)
    with pytest.raises(ValueError, match="fingerprint_keys was given without a config"):
        save_checkpoint(tmp_path / "c.pt", {}, fingerprint_keys=["lr"])
    with pytest.raises(ValueError, match="fingerprint 'abc' does not match the config's fingerprint"):
        save_checkpoint(tmp_path / "c.pt", {}, config=CONFIG, fingerprint="abc")


# --------------------------------------------------------------------------- run directories


def _touch(run_dir, step, rank):
    save_checkpoint(ck.checkpoint_path(run_dir, step, rank), {"step": step, "rank": rank})


def test_checkpoint_path_and_listing(tmp_path):
    assert ck.checkpoint_path(tmp_path, 120, 3) == tmp_path / "ckpt-step120-rank3.pt"
    with pytest.raises(ValueError, match="step must be an integer >= 0, got -1"):
        ck.checkpoint_path(tmp_path, -1)
    assert ck.list_checkpoints(tmp_path / "missing") == {}
    assert ck.latest_checkpoint(tmp_path / "missing") is None
    for step, rank in [(5, 0), (5, 1), (10, 0), (10, 1), (15, 1)]:
        _touch(tmp_path, step, rank)
    (tmp_path / "notes.txt").write_text("x")
    (tmp_path / "ckpt-step7-rank0.pt.bak").write_text("x")
    found = ck.list_checkpoints(tmp_path)
    assert {s: sorted(r) for s, r in found.items()} == {5: [0, 1], 10: [0, 1], 15: [1]}


def test_latest_considers_only_complete_steps(tmp_path):
    for step, rank in [(5, 0), (5, 1), (10, 0), (10, 1), (15, 1)]:  # rank 0 crashed before writing step 15
        _touch(tmp_path, step, rank)
    assert ck.latest_step(tmp_path, num_ranks=2) == 10
    assert ck.latest_checkpoint(tmp_path, rank=1, num_ranks=2) == ck.checkpoint_path(tmp_path, 10, 1)
    assert ck.latest_step(tmp_path, num_ranks=3) is None
    # Without num_ranks each rank looks at its own files only.
    assert ck.latest_checkpoint(tmp_path, rank=1) == ck.checkpoint_path(tmp_path, 15, 1)
    assert ck.latest_checkpoint(tmp_path, rank=0) == ck.checkpoint_path(tmp_path, 10, 0)
    assert load_checkpoint(ck.latest_checkpoint(tmp_path, rank=0, num_ranks=2)) == {"step": 10, "rank": 0}
    with pytest.raises(ValueError, match="rank must be < num_ranks = 2, got 2"):
        ck.latest_checkpoint(tmp_path, rank=2, num_ranks=2)


def test_prune_keeps_the_last_complete_steps(tmp_path):
    for step in (10, 20, 30, 40):
        _touch(tmp_path, step, 0)
        _touch(tmp_path, step, 1)
    _touch(tmp_path, 50, 1)  # rank 0 has not written step 50 yet
    assert ck.prune_checkpoints(tmp_path, 5, num_ranks=2) == []  # only 4 complete steps
    deleted = ck.prune_checkpoints(tmp_path, 2, num_ranks=2, rank=1)
    assert deleted == [ck.checkpoint_path(tmp_path, s, 1) for s in (10, 20)]
    deleted = ck.prune_checkpoints(tmp_path, 2, num_ranks=2)
    assert deleted == [ck.checkpoint_path(tmp_path, s, 0) for s in (10, 20)]
    assert {s: sorted(r) for s, r in ck.list_checkpoints(tmp_path).items()} == {30: [0, 1], 40: [0, 1], 50: [1]}
    # With one rank, step 50 (rank 1 only) is not complete: keep 40, delete all of step 30.
    assert ck.prune_checkpoints(tmp_path, 1) == [ck.checkpoint_path(tmp_path, 30, r) for r in (0, 1)]
    with pytest.raises(ValueError, match="keep_last must be an integer >= 1, got 0"):
        ck.prune_checkpoints(tmp_path, 0)


def test_loader_states_are_saved_stacked_and_read_back_per_node():
    """Many nodes' loader states go into the file as one tensor per generator (one
    record each, not one per node); reading gives every node its own state back, each
    row a tensor of its own (a generator given a view at an offset crashes torch)."""
    from gossip.data import ShardLoader

    x, y = torch.randn(64, 3), torch.arange(64) % 4
    loaders = [ShardLoader(x, y, torch.arange(16 * r, 16 * r + 16), 4, seed=7, node=r) for r in range(4)]
    for ld in loaders[1:]:
        next(iter(ld))
    states = [ld.state_dict() for ld in loaders]
    stacked = manager._stack_loader_states(states)
    assert stacked["stacked_nodes"] == 4
    assert {k: tuple(t.shape)[0] for k, t in stacked["tensors"].items()} == {"shuffle_generator": 4,
                                                                           "transform_generator": 4}
    back = manager._unstack_loader_states(stacked, "f")
    assert len(back) == 4 and all(set(b) == set(s) for b, s in zip(back, states))
    for b, s in zip(back, states):
        for k in s:
            assert torch.equal(b[k], s[k]) if isinstance(s[k], torch.Tensor) else b[k] == s[k]
        assert all(b[k].storage_offset() == 0 for k in stacked["tensors"])
    fresh = [ShardLoader(x, y, torch.arange(16 * r, 16 * r + 16), 4, seed=7, node=r) for r in range(4)]
    for ld, st, orig in zip(fresh, back, loaders):
        ld.load_state_dict(st)
        assert all(torch.equal(a, b) for a, b in zip(next(iter(ld)), next(iter(orig))))
    assert manager._unstack_loader_states(states, "f") == states  # a list, as saved before stacking
    assert manager._stack_loader_states(states[:1]) == states[:1]


@pytest.mark.parametrize("damage", [lambda s: s.pop("values"), lambda s: s.update(stacked_nodes=5),
                                    lambda s: s["tensors"].update(shuffle_generator=torch.zeros(3, 2))])
def test_damaged_stacked_loader_states_are_one_line(damage):
    from gossip.data import ShardLoader

    x, y = torch.randn(16, 3), torch.arange(16) % 4
    stacked = manager._stack_loader_states([ShardLoader(x, y, torch.arange(8 * r, 8 * r + 8), 2, seed=0, node=r).state_dict()
                                       for r in range(2)])
    damage(stacked)
    with pytest.raises(CheckpointError, match=r"^checkpoint 'f' is damaged: its data-loader states do not unpack") as e:
        manager._unstack_loader_states(stacked, "f")
    assert "\n" not in str(e.value)
