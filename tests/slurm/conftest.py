"""The real Slurm the Slurm modules share (munge, slurmctld and two slurmds, two nodes on this host, started by
`slurm/local_cluster.py`), built once by the one pytest-xdist worker that runs them all (`WORKER_GROUPS`)."""

from __future__ import annotations

import pytest

from slurm.local_cluster import LocalSlurm, SlurmUnavailable


@pytest.fixture(scope="session")
def cluster(tmp_path_factory) -> LocalSlurm:
    slurm = LocalSlurm(tmp_path_factory.mktemp("slurm"), cpus=2, nodes=2)
    try:
        slurm.start()
    except SlurmUnavailable as error:
        slurm.stop()
        pytest.skip(f"NO REAL SLURM HERE, the Slurm tests did not run: {error}")
    yield slurm
    slurm.stop()
