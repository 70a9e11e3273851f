"""Block quantization round trips: error bounded by half a step of each block's scale."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from dsec.quant import dequantize, encoded_size, from_bytes, quantize, to_bytes  # noqa: E402


@pytest.mark.parametrize("bits", [8, 4])
@pytest.mark.parametrize("numel", [1, 255, 256, 257, 10_000])
def test_round_trip_error_is_bounded(bits: int, numel: int) -> None:
    g = torch.Generator().manual_seed(numel + bits)
    x = torch.randn(numel, generator=g) * torch.logspace(-6, 2, numel)
    qt = quantize(x, bits)
    y = dequantize(qt)
    assert y.shape == (numel,)
    blocks = torch.nn.functional.pad(x, (0, -numel % 256)).view(-1, 256)
    step = blocks.abs().amax(dim=1) / (127 if bits == 8 else 7)
    bound = (step / 2).repeat_interleave(256)[:numel] * (1 + 1e-5) + 1e-12
    assert torch.all((x - y).abs() <= bound)


@pytest.mark.parametrize("bits", [8, 4])
def test_wire_format_round_trip_and_size(bits: int) -> None:
    x = torch.randn(1000)
    qt = quantize(x, bits)
    wire = to_bytes(qt)
    code_bytes, nblocks = encoded_size(1000, bits)
    assert wire.numel() == code_bytes + 4 * nblocks == qt.nbytes
    assert torch.equal(dequantize(from_bytes(wire, 1000, bits)), dequantize(qt))
    ratio = 1000 * 4 / wire.numel()
    assert ratio > (3.5 if bits == 8 else 6.0)


def test_zero_block_and_bad_arguments() -> None:
    assert torch.equal(dequantize(quantize(torch.zeros(300), 4)), torch.zeros(300))
    with pytest.raises(ValueError, match="bits=3"):
        quantize(torch.ones(4), 3)
    with pytest.raises(ValueError, match="does not encode"):
        from_bytes(torch.zeros(7, dtype=torch.uint8), 1000, 8)
