"""Bit packing: exact sizes, exact round trips, the documented bit layout, every width."""

import numpy as np
import pytest
import torch

from gossip.compress import pack_bits, packed_nbytes, unpack_bits
from tests.conftest import requires_cuda


def _reference(codes: np.ndarray, bits: int) -> np.ndarray:
    """LSB-first bit stream, written plainly with numpy."""
    stream = ((codes[..., None] >> np.arange(bits)) & 1).reshape(*codes.shape[:-1], -1)
    return np.packbits(stream.astype(np.uint8), axis=-1, bitorder="little")


@pytest.mark.parametrize("bits", range(1, 17))
@pytest.mark.parametrize("n", [1, 3, 7, 8, 9, 64, 100, 1001])
def test_round_trip_and_layout(bits, n):
    g = torch.Generator().manual_seed(bits * 1000 + n)
    codes = torch.randint(0, 1 << bits, (4, n), generator=g)
    packed = pack_bits(codes, bits)
    assert packed.dtype == torch.uint8
    assert packed.shape == (4, (n * bits + 7) // 8) == (4, packed_nbytes(n, bits))
    np.testing.assert_array_equal(packed.numpy(), _reference(codes.numpy(), bits))
    back = unpack_bits(packed, bits, n)
    assert back.dtype == (torch.uint8 if bits <= 8 else torch.int32)
    assert torch.equal(back.long(), codes)


@pytest.mark.parametrize("bits", [1, 2, 4, 5, 8, 11, 16])
def test_extremes_and_batch_dims(bits):
    top = (1 << bits) - 1
    codes = torch.tensor([[0, top, 0, top, top, 0, 1, top, top]] * 2).view(2, 1, 9)
    packed = pack_bits(codes, bits)
    assert packed.shape == (2, 1, packed_nbytes(9, bits))
    assert torch.equal(unpack_bits(packed, bits, 9).long(), codes)


@pytest.mark.parametrize("dtype", [torch.uint8, torch.int16, torch.int32, torch.int64])
def test_input_dtypes(dtype):
    codes = torch.tensor([[1, 0, 3, 2, 3]], dtype=dtype)
    assert torch.equal(unpack_bits(pack_bits(codes, 2), 2, 5).long(), codes.long())


def test_out_argument_and_views():
    codes = torch.randint(0, 16, (3, 10))
    buf = torch.zeros(3, 9, dtype=torch.uint8)
    out = pack_bits(codes, 4, out=buf[:, 2:7])
    assert out.data_ptr() == buf[:, 2:7].data_ptr()
    assert torch.equal(unpack_bits(buf[:, 2:7], 4, 10).long(), codes)
    assert torch.equal(buf[:, :2], torch.zeros(3, 2, dtype=torch.uint8))


def test_known_bytes():
    # b = 3: codes 1, 2, 7 -> bits 100 010 111 (LSB first) -> 0b11010001, 0b1
    assert pack_bits(torch.tensor([1, 2, 7]), 3).tolist() == [0b11010001, 0b1]
    assert pack_bits(torch.tensor([0x1234]), 16).tolist() == [0x34, 0x12]
    assert pack_bits(torch.tensor([1, 0, 0, 0, 0, 0, 0, 1, 1]), 1).tolist() == [0x81, 0x01]


@pytest.mark.parametrize("bits", [0, 17, -1, 2.0, True])
def test_bad_bits(bits):
    with pytest.raises(ValueError, match=r"bits must be an int in 1\.\.16"):
        pack_bits(torch.zeros(3, dtype=torch.int64), bits)
    with pytest.raises(ValueError, match=r"bits must be an int in 1\.\.16"):
        unpack_bits(torch.zeros(3, dtype=torch.uint8), bits, 3)


def test_bad_inputs():
    with pytest.raises(ValueError, match="codes must be an integer tensor"):
        pack_bits(torch.zeros(3), 4)
    with pytest.raises(ValueError, match="packed must be uint8"):
        unpack_bits(torch.zeros(3, dtype=torch.int32), 4, 3)
    with pytest.raises(ValueError, match="need 2 bytes, got 1"):
        unpack_bits(torch.zeros(1, dtype=torch.uint8), 4, 3)


@requires_cuda
@pytest.mark.parametrize("bits", [1, 2, 3, 4, 8, 12, 16])
def test_cuda_matches_cpu(bits):
    codes = torch.randint(0, 1 << bits, (5, 333))
    p_cpu = pack_bits(codes, bits)
    p_gpu = pack_bits(codes.cuda(), bits)
    assert p_gpu.is_cuda and torch.equal(p_gpu.cpu(), p_cpu)
    assert torch.equal(unpack_bits(p_gpu, bits, 333).cpu().long(), codes)
