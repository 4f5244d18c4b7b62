"""How a checkpoint's files are shared out among the ranks that prove its bytes (`checkpoint/verify.py`'s `shares`,
read by `checkpoint/proof.py`)."""

from __future__ import annotations

import pytest

from megatron_ppo.checkpoint import verify


@pytest.mark.parametrize("parts", [1, 2, 3, 8, 16])
def test_a_checkpoints_files_are_shared_out_by_bytes_every_file_once(parts: int) -> None:
    """`verify.shares`: every file in exactly one share, the heaviest share at most the lightest plus the largest
    file (largest first to the lightest share), the same answer for the same files."""
    sizes = {f"__{i}_0.distcp": (i * 7919) % 10007 + 1 for i in range(40)} | {"manifest.json": 0, ".metadata": 12}
    found = verify.shares(sizes, parts)
    names = [name for share in found for name in share]
    assert sorted(names) == sorted(sizes) and len(names) == len(set(names))
    loads = [sum(sizes[name] for name in share) for share in found]
    assert max(loads) - min(loads) <= max(sizes.values())
    assert verify.shares(dict(reversed(list(sizes.items()))), parts) == found
