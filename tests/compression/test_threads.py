from concurrent.futures import ThreadPoolExecutor

import torch

from geodiloco.compression import parse_pipeline


def test_concurrent_encodes_give_the_bytes_of_serial_ones() -> None:
    """Quantisers reuse a per-thread scratch buffer; threads must not see each other's."""
    pipeline = parse_pipeline("q8|zstd:1")
    g = torch.Generator().manual_seed(0)
    inputs = [torch.randn(50_000 + 1000 * i, generator=g) * (i + 1) for i in range(16)]
    serial = [pipeline.encode(x) for x in inputs]
    with ThreadPoolExecutor(max_workers=4) as pool:
        for _ in range(3):
            assert list(pool.map(pipeline.encode, inputs)) == serial
