"""A real single-node Slurm on this machine — munge, slurmctld and slurmd from Debian's packages — for the tests and
for trying the sbatch path without a cluster. Everything Slurm writes (state, spool, logs, pid files) lives in DIR.

    python slurm/local_cluster.py install                  # apt-get install (root, Debian/Ubuntu)
    python slurm/local_cluster.py start DIR [--cpus N] [--nodes 2]   # then: export SLURM_CONF=DIR/slurm.conf
    python slurm/local_cluster.py stop DIR

Made for a root shell without systemd or cgroups (containers, CI machines): Linux process tracking, no task plugin,
no accounting, a default partition `local` and a partition `urgent` on the same nodes whose jobs preempt those of
`local` (preempt/partition_prio, PreemptMode=REQUEUE: Slurm requeues the preempted job itself, as a cluster does).
KillWait is Slurm's default 30 s: the time a cancelled or preempted job has to save between SIGTERM and SIGKILL.
"""

from __future__ import annotations

import argparse
import os
import shutil
import signal
import socket
import subprocess
import time
from pathlib import Path

PACKAGES = ["slurmctld", "slurmd", "slurm-client", "munge"]
MUNGE_RUN_DIR = Path("/run/munge")
PARTITION = "local"
URGENT_PARTITION = "urgent"  # same nodes, higher PriorityTier: its jobs preempt (requeue) those of `local`

SLURM_CONF = """\
ClusterName=local
SlurmctldHost={host}(127.0.0.1)
SlurmctldPort={ctld_port}
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
AuthInfo=cred_expire=10
StateSaveLocation={root}/state
SlurmdSpoolDir={root}/spool-%n
SlurmctldPidFile={root}/slurmctld.pid
SlurmdPidFile={root}/slurmd-%n.pid
SlurmctldLogFile={root}/slurmctld.log
SlurmdLogFile={root}/slurmd-%n.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
JobCompType=jobcomp/filetxt
JobCompLoc={root}/jobcomp.txt
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
MpiDefault=none
ReturnToService=2
SlurmdParameters=config_overrides
KillWait=30
MinJobAge=3600
SchedulerParameters=sched_interval=1,bf_interval=1
PreemptType=preempt/partition_prio
PreemptMode=REQUEUE
{node_lines}
PartitionName={partition} Nodes={node_list} Default=YES MaxTime=INFINITE State=UP PriorityTier=1
PartitionName={urgent} Nodes={node_list} MaxTime=INFINITE State=UP PriorityTier=2 PreemptMode=OFF
"""
NODE_LINE = "NodeName={name} NodeHostname={host} NodeAddr=127.0.0.1 Port={port} CPUs={cpus} RealMemory={memory_mb}"


class SlurmUnavailable(RuntimeError):
    """Slurm's daemons are not installed here, or could not be started; the message says which and why."""


def missing_binaries() -> list[str]:
    return [name for name in ("munged", "slurmctld", "slurmd", "sbatch", "scontrol") if shutil.which(name) is None]


def install() -> None:
    """Install Debian's Slurm and munge packages (root only); nothing is started."""
    if os.geteuid() != 0:
        raise SlurmUnavailable("installing Slurm needs root (apt-get)")
    if shutil.which("apt-get") is None:
        raise SlurmUnavailable("installing Slurm needs apt-get (Debian/Ubuntu)")
    command = ["apt-get", "install", "-y", "--no-install-recommends", *PACKAGES]
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    if subprocess.run(command, env=env, check=False).returncode != 0:  # a stale package index: refresh, retry once
        subprocess.run(["apt-get", "update"], env=env, check=True)
        subprocess.run(command, env=env, check=True)


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def _munge_works() -> bool:
    if shutil.which("munge") is None:
        return False
    credential = subprocess.run(["munge", "-n"], capture_output=True, check=False)
    return (
        credential.returncode == 0
        and subprocess.run(["unmunge"], input=credential.stdout, capture_output=True, check=False).returncode == 0
    )


class LocalSlurm:
    """`nodes` (1 or 2) nodes of `cpus` CPUs each in partition `local`, all on this host (one slurmd per node), and
    `env`, what Slurm's clients need. Node names must resolve, since jobs rendezvous on the first: the first node
    is named after this host, the second `localhost`. Two nodes make multi-node jobs real: `--nodes=2` tasks get
    different SLURM_NODEIDs and node names, as on a cluster."""

    def __init__(self, root: str | Path, cpus: int = 2, nodes: int = 1) -> None:
        self.root = Path(root).resolve()
        self.cpus = cpus
        self.conf = self.root / "slurm.conf"
        self.env = {**os.environ, "SLURM_CONF": str(self.conf)}
        self._munge_marker = self.root / "munged.started-here"
        self.host = socket.gethostname().split(".")[0]
        self.nodes = [self.host, "localhost"][:nodes]
        if nodes not in (1, 2) or len(set(self.nodes)) != nodes:
            raise SlurmUnavailable(f"{nodes} nodes on host {self.host!r}: one or two, named differently")

    # --- lifecycle ---------------------------------------------------------------------------------------------
    def start(self, timeout_s: float = 60) -> None:
        if missing := missing_binaries():
            raise SlurmUnavailable(f"not installed: {', '.join(missing)} (python slurm/local_cluster.py install)")
        if os.geteuid() != 0:
            raise SlurmUnavailable("the local cluster runs its daemons as root (SlurmUser=root)")
        for node in self.nodes:
            try:
                socket.gethostbyname(node)
            except OSError as error:
                raise SlurmUnavailable(f"node name {node!r} does not resolve (jobs rendezvous on it): add it to "
                                       f"/etc/hosts ({error})") from error  # fmt: skip
            (self.root / f"spool-{node}").mkdir(parents=True, exist_ok=True)
        (self.root / "state").mkdir(parents=True, exist_ok=True)
        self._start_munge()
        memory_mb = int(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") * 0.9 / 2**20)
        node_lines = [NODE_LINE.format(name=node, host=self.host, port=_free_port(), cpus=self.cpus,
                                       memory_mb=memory_mb) for node in self.nodes]  # fmt: skip
        self.conf.write_text(SLURM_CONF.format(
            host=self.host, root=self.root, ctld_port=_free_port(), node_lines="\n".join(node_lines),
            node_list=",".join(self.nodes), partition=PARTITION, urgent=URGENT_PARTITION,
        ))  # fmt: skip
        subprocess.run(["slurmctld", "-c", "-f", str(self.conf)], env=self.env, check=True)
        for node in self.nodes:
            subprocess.run(["slurmd", "-f", str(self.conf), "-N", node], env=self.env, check=True)
        self._wait_for_idle_nodes(timeout_s)

    def stop(self) -> None:
        """Shut both Slurm daemons down (jobs still running are killed), and munged if `start` started it."""
        if self.conf.is_file():
            subprocess.run(["scontrol", "shutdown"], env=self.env, capture_output=True, check=False)
        for pid_file in [*self.root.glob("slurmd-*.pid"), self.root / "slurmctld.pid"]:
            _stop_pid_file(pid_file)
        if self._munge_marker.is_file():
            _stop_pid_file(MUNGE_RUN_DIR / "munged.pid")
            self._munge_marker.unlink()

    def __enter__(self) -> LocalSlurm:
        self.start()
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.stop()

    def _start_munge(self) -> None:
        if _munge_works():
            return
        MUNGE_RUN_DIR.mkdir(mode=0o755, exist_ok=True)
        shutil.chown(MUNGE_RUN_DIR, "munge", "munge")
        subprocess.run(["runuser", "-u", "munge", "--", "munged"], check=True)
        self._munge_marker.touch()
        deadline = time.monotonic() + 10
        while not _munge_works():
            if time.monotonic() > deadline:
                raise SlurmUnavailable("munged started but no credential could be made and decoded")
            time.sleep(0.1)

    def _wait_for_idle_nodes(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        states: list[str] = []
        while time.monotonic() < deadline:
            states = self.query(["sinfo", "--noheader", "--Node", f"--partition={PARTITION}", "--format=%T"]).split()
            if len(states) == len(self.nodes) and all(state.rstrip("*") == "idle" for state in states):
                return
            time.sleep(0.2)
        log_file = self.root / "slurmctld.log"
        log = log_file.read_text()[-2000:] if log_file.is_file() else ""
        raise SlurmUnavailable(f"nodes {self.nodes} not idle after {timeout_s:.0f} s ({states}); slurmctld log:\n{log}")

    # --- clients -----------------------------------------------------------------------------------------------
    def query(self, command: list[str]) -> str:
        """Run a Slurm client command against this cluster; its stdout, stripped ('' when it fails)."""
        result = subprocess.run(command, env=self.env, capture_output=True, text=True, check=False)
        return result.stdout.strip() if result.returncode == 0 else ""

    def job(self, job_id: str) -> dict[str, str]:
        """`scontrol show job` as a dict (JobState, ExitCode, Restarts, StdOut, ...); {} once Slurm forgot it."""
        fields: dict[str, str] = {}
        for token in self.query(["scontrol", "show", "job", "--oneliner", job_id]).split():
            key, _, value = token.partition("=")
            fields.setdefault(key, value)
        return fields

    def wait_for(self, job_id: str, states: set[str], timeout_s: float) -> dict[str, str]:
        """Poll the job every 0.25 s (`sbatch --wait` polls far more slowly) until its state is one of `states`."""
        deadline = time.monotonic() + timeout_s
        job: dict[str, str] = {}
        while time.monotonic() < deadline:
            job = self.job(job_id)
            if job.get("JobState") in states:
                return job
            time.sleep(0.25)
        raise TimeoutError(f"job {job_id} not in {sorted(states)} after {timeout_s:.0f} s: {job}")


def _stop_pid_file(pid_file: Path, timeout_s: float = 10) -> None:
    try:
        pid = int(pid_file.read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return
    deadline = time.monotonic() + timeout_s
    sent = False
    while time.monotonic() < deadline:
        try:
            os.kill(pid, 0 if sent else signal.SIGTERM)
        except ProcessLookupError:
            return
        sent = True
        time.sleep(0.1)
    os.kill(pid, signal.SIGKILL)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    commands = parser.add_subparsers(dest="command", required=True)
    commands.add_parser("install", help="apt-get install Slurm and munge")
    start = commands.add_parser("start", help="start munge, slurmctld and slurmd with state in DIR")
    start.add_argument("dir")
    start.add_argument("--cpus", type=int, default=os.cpu_count() or 1, help="CPUs per node")
    start.add_argument("--nodes", type=int, default=1, choices=[1, 2], help="nodes, each with its own slurmd")
    stop = commands.add_parser("stop", help="stop the cluster started in DIR")
    stop.add_argument("dir")
    args = parser.parse_args(argv)
    try:
        if args.command == "install":
            install()
        elif args.command == "start":
            LocalSlurm(args.dir, args.cpus, args.nodes).start()
            print(f"export SLURM_CONF={Path(args.dir).resolve() / 'slurm.conf'}")
        else:
            LocalSlurm(args.dir).stop()
    except SlurmUnavailable as error:
        print(f"error: {error}")
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
