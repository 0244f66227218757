"""A one-host SLURM cluster for the tests: Debian's ``slurm-wlm`` (22.05) and ``munge``, started as
root in a temporary folder (``munged``, ``slurmctld``, ``slurmd``) with a generated ``slurm.conf``
(the host's own ``slurmd -C`` line, ``AuthType=auth/munge``, free ports, accounting off) and
always stopped. Nothing here touches the host's own SLURM or munge set-up: every path is in the
folder (munge's key and socket in a folder of their own that the munge user can reach, removed at
the end), and clients find the cluster through ``SLURM_CONF`` (:meth:`SlurmCluster.env`).

``SlurmCluster.unavailable()`` says why a cluster cannot start here (not root, a program missing:
``apt-get install slurm-wlm munge``), else ``None``. CI's ``slurm`` stage installs the packages
and runs ``tests/test_slurm.py``; elsewhere those tests skip, saying why.
"""

from __future__ import annotations

import os
import pwd
import shutil
import signal
import socket
import subprocess
import tempfile
import time

PROGRAMS = ("munged", "slurmctld", "slurmd", "srun", "sbatch", "scancel", "sinfo", "squeue")
INSTALL = "apt-get install slurm-wlm munge (Debian), as root"


class SlurmCluster:
    """``with SlurmCluster(folder) as cluster: cluster.run(["srun", ...])``."""

    def __init__(self, folder: str, start_timeout: float = 60.0):
        self.folder = os.path.abspath(folder)
        self.start_timeout = start_timeout
        self.conf = os.path.join(self.folder, "slurm.conf")
        self.host = socket.gethostname().split(".")[0]
        self._daemons: list[subprocess.Popen] = []
        self._munge_dir: str | None = None

    @staticmethod
    def unavailable() -> str | None:
        if os.geteuid() != 0:
            return f"a one-host SLURM cluster starts as root (running as uid {os.geteuid()})"
        missing = [p for p in PROGRAMS if shutil.which(p) is None]
        if missing:
            return f"SLURM is not installed ({', '.join(missing)} missing: {INSTALL})"
        try:
            pwd.getpwnam("munge")
        except KeyError:
            return f"no 'munge' user ({INSTALL})"
        return None

    # --- start and stop -----------------------------------------------------------------------

    def __enter__(self) -> "SlurmCluster":
        try:
            self.start()
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    def start(self) -> None:
        why = self.unavailable()
        if why:
            raise RuntimeError(f"Cannot start a SLURM cluster: {why}.")
        import portpicker
        os.makedirs(self.folder, exist_ok=True)
        self._start_munge()
        ports = [portpicker.pick_unused_port() for _ in range(2)]
        for d in ("state", "spool"):
            os.makedirs(os.path.join(self.folder, d), exist_ok=True)
        with open(self.conf, "w") as f:
            f.write(self._config(*ports))
        env = self.env()
        for daemon in ("slurmctld", "slurmd"):
            log = open(os.path.join(self.folder, f"{daemon}.out"), "w")
            self._daemons.append(subprocess.Popen(
                [daemon, "-D", "-f", self.conf], env=env, stdout=log, stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL, start_new_session=True))
            log.close()
        self._wait_idle()

    def _start_munge(self) -> None:
        munge = pwd.getpwnam("munge")
        # (its own folder in the temporary directory: munged, running as the munge user, must
        # reach it, and pytest's folders are root's alone)
        d = self._munge_dir = tempfile.mkdtemp(prefix="tfdp-munge-")
        key = os.path.join(d, "munge.key")
        with open(key, "wb") as f:
            f.write(os.urandom(1024))
        for path, mode in ((d, 0o700), (key, 0o400)):
            os.chown(path, munge.pw_uid, munge.pw_gid)
            os.chmod(path, mode)
        self.munge_socket = os.path.join(d, "munge.socket")
        log = open(os.path.join(self.folder, "munged.out"), "w")
        self._daemons.append(subprocess.Popen(
            ["runuser", "-u", "munge", "--", "munged", "--foreground", "--force",
             f"--key-file={key}", f"--socket={self.munge_socket}",
             f"--pid-file={d}/munged.pid", f"--log-file={d}/munged.log",
             f"--seed-file={d}/munged.seed"],
            stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
            start_new_session=True))
        log.close()
        self._until(lambda: os.path.exists(self.munge_socket), "munged made its socket")

    def _config(self, ctld_port: int, slurmd_port: int) -> str:
        node = subprocess.run(["slurmd", "-C"], capture_output=True, text=True, timeout=30)
        node_line = next(ln for ln in node.stdout.splitlines() if ln.startswith("NodeName="))
        f = self.folder
        return "\n".join([
            "ClusterName=tfdptest",
            f"SlurmctldHost={self.host}",
            f"SlurmctldPort={ctld_port}",
            f"SlurmdPort={slurmd_port}",
            "AuthType=auth/munge",
            "CredType=cred/munge",
            f"AuthInfo=socket={self.munge_socket}",
            "SlurmUser=root",
            "SlurmdUser=root",
            f"StateSaveLocation={f}/state",
            f"SlurmdSpoolDir={f}/spool",
            f"SlurmctldPidFile={f}/slurmctld.pid",
            f"SlurmdPidFile={f}/slurmd.pid",
            f"SlurmctldLogFile={f}/slurmctld.log",
            f"SlurmdLogFile={f}/slurmd.log",
            "ProctrackType=proctrack/pgid",
            "TaskPlugin=task/none",
            "SelectType=select/cons_tres",
            "SelectTypeParameters=CR_Core",
            "AccountingStorageType=accounting_storage/none",
            "JobAcctGatherType=jobacct_gather/none",
            "JobCompType=jobcomp/none",
            "MpiDefault=none",
            "ReturnToService=2",
            "KillWait=5",
            "SlurmctldTimeout=30",
            "SlurmdTimeout=30",
            "InactiveLimit=0",
            "MinJobAge=300",
            " ".join(w for w in node_line.split() if not w.startswith("UpTime=")) + " State=UNKNOWN",
            f"PartitionName=debug Nodes={self.host} Default=YES MaxTime=INFINITE State=UP",
            "",
        ])

    def _wait_idle(self) -> None:
        def idle():
            out = self.run(["sinfo", "-h", "-o", "%T"], timeout=10, check=False).stdout.split()
            return out and all(state.rstrip("*") == "idle" for state in out)
        self._until(idle, "the node is idle in sinfo")

    def _until(self, condition, what: str) -> None:
        deadline = time.monotonic() + self.start_timeout
        while time.monotonic() < deadline:
            dead = [p for p in self._daemons if p.poll() is not None]
            if dead:
                raise RuntimeError(f"SLURM cluster: {dead[0].args[0]} exited with "
                                   f"{dead[0].returncode} before {what}.\n{self.logs()}")
            if condition():
                return
            time.sleep(0.2)
        raise RuntimeError(f"SLURM cluster: not {what} within {self.start_timeout:.0f} s."
                           f"\n{self.logs()}")

    def stop(self) -> None:
        if os.path.exists(self.conf):
            self.run(["scancel", "--full", "-u", "root"], timeout=10, check=False)
        for p in reversed(self._daemons):
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGTERM)
        for p in reversed(self._daemons):
            try:
                p.wait(timeout=15)
            except subprocess.TimeoutExpired:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait(timeout=5)
        self._daemons.clear()
        if self._munge_dir:
            shutil.rmtree(self._munge_dir, ignore_errors=True)
            self._munge_dir = None

    # --- use ----------------------------------------------------------------------------------

    def env(self, **extra: str) -> dict:
        """The environment of a client of this cluster (srun, sbatch, ...)."""
        env = dict(os.environ, SLURM_CONF=self.conf)
        for name in ("TF_CONFIG", "TFDP_CPU_REPLICAS", "SLURM_JOB_ID", "SLURM_JOBID"):
            env.pop(name, None)
        env.update(extra)
        return env

    def run(self, argv, timeout: float, check: bool = True, env: dict | None = None,
            **kwargs) -> subprocess.CompletedProcess:
        p = subprocess.run(argv, env=env or self.env(), capture_output=True, text=True,
                           timeout=timeout, stdin=subprocess.DEVNULL, **kwargs)
        if check and p.returncode != 0:
            raise AssertionError(f"{' '.join(argv)}: exit {p.returncode}\n{p.stdout[-3000:]}\n"
                                 f"{p.stderr[-3000:]}")
        return p

    def logs(self, tail: int = 20) -> str:
        out = []
        for name in ("munged.out", "slurmctld.out", "slurmctld.log",
                     "slurmd.out", "slurmd.log"):
            path = os.path.join(self.folder, name)
            if os.path.exists(path):
                with open(path, errors="replace") as f:
                    lines = f.read().splitlines()[-tail:]
                out.append(f"--- {name}\n" + "\n".join(lines))
        return "\n".join(out)
