"""GAE over 4096 response tokens: the scan of `algo.gae_advantages` (⌈log₂ T⌉ steps) against verl's per-token
loop (`compute_gae_advantage_return`, T steps of about 8 kernel launches each), on the same rows.

Run: python -m bench.bench_gae   (or `make bench`)
"""

from __future__ import annotations

import torch
from verl.trainer.ppo.core_algos import compute_gae_advantage_return

from bench.common import measure
from megatron_ppo import algo

ROWS, TOKENS, REPEATS = 8, 4096, 5


def main() -> None:
    torch.set_num_threads(1)
    gen = torch.Generator().manual_seed(0)
    lengths = torch.randint(TOKENS // 2, TOKENS + 1, (ROWS,), generator=gen)
    mask = (torch.arange(TOKENS) < lengths[:, None]).float()
    rewards = torch.zeros(ROWS, TOKENS)
    rewards[torch.arange(ROWS), lengths - 1] = torch.randn(ROWS, generator=gen)
    values = torch.randn(ROWS, TOKENS, generator=gen)
    t_loop, _ = measure(lambda: compute_gae_advantage_return(rewards, values, mask, 1.0, 0.95), REPEATS)
    t_scan, _ = measure(lambda: algo.gae_advantages(rewards, values, mask, 1.0, 0.95), REPEATS)
    print(f"GAE + whitening, {ROWS} rows × {TOKENS} response tokens, 1 thread")
    print(f"  verl's token loop  : {t_loop * 1e3:8.2f} ms")
    print(f"  megatron-ppo scan  : {t_scan * 1e3:8.2f} ms")
    print(f"  speed-up loop/scan : {t_loop / t_scan:.1f}×")


if __name__ == "__main__":
    main()
