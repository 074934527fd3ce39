"""Byte-level text data: reading files and folders, windows, the held-out tail,
WikiText-2 raw, the default corpus, and the partition of text over nodes."""

from __future__ import annotations

import hashlib

import pytest
import torch

from gossip import data
from gossip.data import text as textdata
from gossip.data import DataError, build_dataset, partition_dataset

TEXT = "Grüße, 世界! naïve café – 🙂\r\nline two\r\n" * 40  # multi-byte UTF-8 and CRLF


def _normalised(text: str) -> bytes:
    return text.replace("\r\n", "\n").encode("utf-8")


def test_file_is_read_as_utf8_bytes_with_crlf_normalised(tmp_path):
    f = tmp_path / "a.txt"
    f.write_bytes(TEXT.encode("utf-8"))
    ds = build_dataset("text", data_dir=f, context=16, test_fraction=0.25)
    want = _normalised(TEXT)
    assert b"\r" not in want and len(want) < len(TEXT.encode("utf-8"))
    assert ds.task == data.LANGUAGE_MODEL and ds.num_classes == 256 and ds.input_shape == (16,)
    assert ds.x_train.dtype == torch.uint8 and ds.x_train.shape == ds.y_train.shape
    # windows of 17 bytes with stride 16: x is bytes 0..15, y bytes 1..16
    n_test = int(len(want) * 0.25)
    train, test = want[:-n_test], want[-n_test:]
    for i in (0, 1, ds.num_train - 1):
        assert bytes(ds.x_train[i].tolist()) == train[16 * i:16 * i + 16]
        assert bytes(ds.y_train[i].tolist()) == train[16 * i + 1:16 * i + 17]
    assert ds.num_train == (len(train) - 1) // 16 and ds.num_test == (len(test) - 1) // 16
    assert bytes(ds.x_test[0].tolist()) == test[:16]
    assert ds.corpus["sha256"] == textdata.corpus_identity("a.txt", train, test)["sha256"]
    assert (ds.corpus["train_bytes"], ds.corpus["test_bytes"]) == (len(train), len(test))
    # a byte-order mark and lone CRs are normalised too: the same text, the same bytes
    g = tmp_path / "b.txt"
    g.write_bytes(b"\xef\xbb\xbf" + TEXT.replace("\r\n", "\r").encode("utf-8"))
    assert textdata.read_text(g) == want


def test_folder_reads_files_in_sorted_order_and_skips_hidden_ones(tmp_path):
    (tmp_path / "b").mkdir()
    (tmp_path / "b" / "2.txt").write_text("second" * 50)
    (tmp_path / "a.txt").write_text("first\n" * 50)
    (tmp_path / "empty.txt").write_text("")
    (tmp_path / ".hidden").write_text("never read")
    got = textdata.read_text(tmp_path)
    assert got == b"first\n" * 50 + b"second" * 50  # a.txt ends in a newline: nothing added
    (tmp_path / "c.txt").write_text("third")
    assert textdata.read_text(tmp_path) == b"first\n" * 50 + b"second" * 50 + b"\nthird"


def test_empty_file_is_one_line(tmp_path):
    f = tmp_path / "empty.txt"
    f.write_bytes(b"")
    with pytest.raises(DataError, match=r"^text file '.*empty\.txt' is empty; expected UTF-8 text of at least "
                                        r"258 bytes$"):
        build_dataset("text", data_dir=f)


def test_file_shorter_than_a_window_names_the_file_and_the_size_needed(tmp_path):
    f = tmp_path / "short.txt"
    f.write_text("é" * 20)  # 40 bytes
    with pytest.raises(DataError, match=r"^text file '.*short\.txt' holds 40 bytes; at least 66 are needed$"):
        build_dataset("text", data_dir=f, context=32)
    d = tmp_path / "folder"
    d.mkdir()
    (d / "x.txt").write_text("abc")
    with pytest.raises(DataError, match=r"^text folder '.*folder' holds 3 bytes in 1 file\(s\); at least 66"):
        build_dataset("text", data_dir=d, context=32)


def test_not_utf8_and_missing_paths_are_one_line(tmp_path):
    f = tmp_path / "latin1.txt"
    f.write_bytes("café".encode("latin-1") * 100)
    with pytest.raises(DataError, match=r"^text file '.*latin1\.txt' is not UTF-8 \(byte 3: b'\\xe9'\); "
                                        r"expected UTF-8 text$"):
        build_dataset("text", data_dir=f)
    with pytest.raises(DataError, match=r"^text path '.*nowhere' does not exist; expected a UTF-8 text file"):
        build_dataset("text", data_dir=tmp_path / "nowhere")
    with pytest.raises(DataError, match=r"^text folder '.*' holds no files"):
        (tmp_path / "void").mkdir()
        build_dataset("text", data_dir=tmp_path / "void")


def test_bad_options_are_one_line(tmp_path):
    f = tmp_path / "a.txt"
    f.write_text(TEXT)
    with pytest.raises(ValueError, match=r"^test_fraction must be a number in \(0, 1\), got 1.5$"):
        build_dataset("text", data_dir=f, test_fraction=1.5)
    with pytest.raises(ValueError, match=r"^max_test_bytes must be .*>= 17"):
        build_dataset("text", data_dir=f, context=16, max_test_bytes=4)
    with pytest.raises(ValueError, match=r"dataset 'text' does not take option\(s\) vocab; accepted: context"):
        build_dataset("text", data_dir=f, vocab=3)


def test_held_out_tail_is_capped(tmp_path):
    f = tmp_path / "a.txt"
    f.write_text("abcdefgh" * 1000)
    ds = build_dataset("text", data_dir=f, context=8, test_fraction=0.5, max_test_bytes=100)
    assert ds.corpus["test_bytes"] == 100 and ds.corpus["train_bytes"] == 7900


def _write_wikitext(d, train: str, valid: str, test: str) -> None:
    d.mkdir(parents=True, exist_ok=True)
    for name, text in (("wiki.train.raw", train), ("wiki.valid.raw", valid), ("wiki.test.raw", test)):
        (d / name).write_text(text, encoding="utf-8")


def test_wikitext2_raw_trains_on_train_and_tests_on_test(tmp_path):
    # the release's format: " = Title = " headings, blank lines, spaced punctuation, @-@
    train = " \n = Valkyria Chronicles III = \n \n Senjō no Valkyria 3 : Unrecorded Chronicles is a tactical @-@ " \
            "role playing game . \n" * 20
    test = " \n = Robert Boulter = \n \n Robert Boulter is an English film , television and theatre actor . \n" * 5
    _write_wikitext(tmp_path / "wikitext-2-raw", train, " \n = Homarus gammarus = \n", test)
    ds = build_dataset("wikitext2", data_dir=tmp_path, context=32)  # the archive's parent folder works too
    assert ds.task == data.LANGUAGE_MODEL and ds.name == "wikitext2"
    assert bytes(ds.x_train[0].tolist()) == train.encode()[:32]
    assert bytes(ds.x_test[0].tolist()) == test.encode()[:32]
    assert ds.num_test == (len(test.encode()) - 1) // 32
    (tmp_path / "wikitext-2-raw" / "wiki.valid.raw").unlink()
    with pytest.raises(DataError, match=r"^wikitext2 data_dir '.*wikitext-2-raw' lacks wiki\.valid\.raw; expected "
                                        r"a directory holding the WikiText-2 raw files"):
        build_dataset("wikitext2", data_dir=tmp_path)
    with pytest.raises(DataError, match=r"^dataset 'wikitext2' needs data_dir \(--data-dir\)"):
        build_dataset("wikitext2")


def test_sorted_partition_gives_each_node_a_contiguous_segment_of_the_text(tmp_path):
    f = tmp_path / "a.txt"
    f.write_bytes(bytes(range(32, 127)) * 60)
    ds = build_dataset("text", data_dir=f, context=16, test_fraction=0.1)
    shards = partition_dataset(ds, 4, "sorted")
    size = ds.num_train // 4
    stream = f.read_bytes()
    for k, shard in enumerate(shards):
        assert torch.equal(shard, torch.arange(k * size, (k + 1) * size))
        # the node's windows, laid end to end, are one stretch of the text
        seg = b"".join(bytes(ds.x_train[i].tolist()) for i in shard.tolist())
        assert seg == stream[16 * k * size:16 * (k + 1) * size]
    iid = partition_dataset(ds, 4, "iid", seed=3)
    assert all(len(s) == size for s in iid)
    assert len(torch.cat(iid).unique()) == 4 * size
    assert not torch.equal(torch.cat(iid), torch.cat(shards))
    assert torch.equal(torch.cat(iid), torch.cat(partition_dataset(ds, 4, "iid", seed=3)))


def test_language_model_dataset_is_validated():
    x = torch.zeros(4, 8, dtype=torch.uint8)
    with pytest.raises(ValueError, match=r"^task must be one of classification, lm, got 'regression'$"):
        data.Dataset(name="t", x_train=x, y_train=x, x_test=x, y_test=x, num_classes=256, input_shape=(8,),
                     task="regression")
    with pytest.raises(ValueError, match=r"^x_train and y_train must both be shaped \(N, \*input_shape\)"):
        data.Dataset(name="t", x_train=x, y_train=x[:, :4], x_test=x, y_test=x, num_classes=256,
                     input_shape=(8,), task="lm")
    with pytest.raises(ValueError, match=r"^y_test of a language-model data set must be a 2-D uint8/int32/int64"):
        data.Dataset(name="t", x_train=x, y_train=x, x_test=x, y_test=x.float(), num_classes=256,
                     input_shape=(8,), task="lm")


def test_default_corpus_is_the_standard_library_and_identified_by_its_hash():
    ds = build_dataset("text", context=64)
    c = ds.corpus
    assert c["corpus"] == "python-stdlib" and c["files"] > 500 and c["train_bytes"] > 5_000_000
    assert c["test_bytes"] == textdata.DEFAULT_MAX_TEST_BYTES
    # the identity is the hash of exactly the bytes the windows view (train head, test tail)
    train, test = (torch.empty(0, dtype=torch.uint8).set_(x.untyped_storage()).numpy().tobytes()
                   for x in (ds.x_train, ds.x_test))
    assert (len(train), len(test)) == (c["train_bytes"], c["test_bytes"])
    assert c["sha256"] == hashlib.sha256(len(train).to_bytes(8, "little") + train + test).hexdigest()
    assert b"def " in train[:100_000] and b"\r" not in train
