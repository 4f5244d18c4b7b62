"""GAE over 4096 response tokens: the scan of `algo.gae_advantages` (⌈log₂ T⌉ steps) against verl's per-token
loop (`compute_gae_advantage_return`, T steps of about 8 kernel launches each), on the same rows.

Run: python -m bench.bench_gae   (or `make bench`)
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from verl.trainer.ppo.core_algos import compute_gae_advantage_return

from bench.common import measure, smallest
from megatron_ppo import algo

SIZES = {"full": (8, 4096, 5), "smallest": (2, 64, 1)}  # rows, response tokens, timed repeats


def main(argv: Sequence[str] | None = None) -> None:
    rows, tokens, repeats = SIZES["smallest" if smallest(argv, __doc__) else "full"]
    torch.set_num_threads(1)
    gen = torch.Generator().manual_seed(0)
    lengths = torch.randint(tokens // 2, tokens + 1, (rows,), generator=gen)
    mask = (torch.arange(tokens) < lengths[:, None]).float()
    rewards = torch.zeros(rows, tokens)
    rewards[torch.arange(rows), lengths - 1] = torch.randn(rows, generator=gen)
    values = torch.randn(rows, tokens, generator=gen)
    t_loop, _ = measure(lambda: compute_gae_advantage_return(rewards, values, mask, 1.0, 0.95), repeats)
    t_scan, _ = measure(lambda: algo.gae_advantages(rewards, values, mask, 1.0, 0.95), repeats)
    print(f"GAE + whitening, {rows} rows × {tokens} response tokens, 1 thread")
    print(f"  verl's token loop  : {t_loop * 1e3:8.2f} ms")
    print(f"  megatron-ppo scan  : {t_scan * 1e3:8.2f} ms")
    print(f"  speed-up loop/scan : {t_loop / t_scan:.1f}×")


if __name__ == "__main__":
    main()
