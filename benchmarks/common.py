"""What every benchmark shares: writing its result, starting its Ray cluster as the product does, and finding Ray
Train worker processes."""

from __future__ import annotations

import json
import os
import platform
import sys
from pathlib import Path
from typing import Any

RESULTS = Path(__file__).resolve().parent / "results"


def emit(name: str, result: dict[str, Any]) -> None:
    """Add the machine's description, write ``results/<name>.json`` and print the JSON as the last line."""
    result = {
        **result,
        "machine": {"cpus": os.cpu_count(), "platform": platform.platform(), "python": sys.version.split()[0]},
    }
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / f"{name}.json").write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result), flush=True)


def ray_train_worker_pids() -> list[int]:
    """PIDs of this node's Ray Train worker processes (their command line is ``ray::RayTrainWorker...``), not their
    loader processes (forked from a worker, they carry its command line)."""
    found = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                if (entry / "cmdline").read_bytes().startswith(b"ray::RayTrainWorker"):
                    parent = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
                    found[int(entry.name)] = parent
            except (OSError, IndexError, ValueError):
                continue
    return [pid for pid, parent in found.items() if parent not in found]


def start_ray(*, num_cpus: int, num_gpus: int | None = None) -> dict[str, str] | str:
    """Connect to ``RAY_ADDRESS`` when it is set (that cluster as it is: returns ``"external cluster"``), else start a
    local cluster of ``num_cpus`` CPUs the way the product's Ray task does: the platform's process settings
    and ``ray.init`` arguments (:func:`training_core.parallel.ray_settings.start_local_cluster`). A benchmark adds
    nothing
    a user does not get. Returns the process settings in effect."""
    import ray

    from training_core.parallel.ray_settings import start_local_cluster

    if os.environ.get("RAY_ADDRESS"):
        ray.init(address=os.environ["RAY_ADDRESS"])
        return "external cluster"
    return start_local_cluster(num_cpus=num_cpus, num_gpus=num_gpus)


FAST_NODE_DEATH = {
    "RAY_health_check_period_ms": "1000",
    "RAY_health_check_timeout_ms": "1000",
    "RAY_health_check_failure_threshold": "3",
    "RAY_health_check_initial_delay_ms": "1000",
}
"""The GCS declares a node dead after ``health_check_failure_threshold`` missed checks: about 3 s with these (Ray's
default is 5 checks 3 s apart), so a node-loss run spends its time on the restart, not on noticing the loss."""


_PROBE = """
import json, sys
import ray
ray.init(address=sys.argv[1], log_to_driver=False)
for line in sys.stdin:
    code = json.loads(line)
    try:
        try:
            answer = {"value": eval(code, {"ray": ray})}
        except SyntaxError:  # statements: run, answered by null
            exec(code, {"ray": ray})
            answer = {"value": None}
    except Exception as exc:
        answer = {"error": repr(exc)}
    sys.stdout.write("ANSWER " + json.dumps(answer) + "\\n")  # Ray may print lines of its own
    sys.stdout.flush()
"""
"""The driver behind :meth:`TwoNodeCluster.ask`: one JSON-quoted expression (or statements) a line in, one JSON answer
a line out."""


class TwoNodeCluster:
    """A Ray cluster of two nodes on this machine, 1 CPU each (a 2-worker run is placed across both): a head and a
    second node started with ``ray start --address``, each ``ray start --block`` in a session of its own, with the
    platform's process settings and :data:`FAST_NODE_DEATH`. :meth:`lose_second_node` kills the second node's
    raylet and every process it started at once, as a lost machine. Use it as a context manager. Ray's session
    directory goes under ``workdir``: keep it short, since Ray's socket paths are limited to ~107 characters."""

    def __init__(self, workdir: Path, *, log_dir: Path | None = None) -> None:
        self.workdir, self.log_dir = Path(workdir), Path(log_dir or workdir)
        self.env = {**os.environ, **FAST_NODE_DEATH}
        self.env.pop("RAY_ADDRESS", None)  # a cluster of its own
        self.env.setdefault("RAY_AUTH_MODE", "disabled")
        self.nodes: list[Any] = []
        self.address = ""
        self._probe: Any = None

    def _start(self, name: str, args: list[str]):
        import subprocess

        from training_core.parallel.ray_settings import apply_process_env

        apply_process_env(self.env)
        ray = Path(sys.executable).parent / "ray"
        node = subprocess.Popen(
            [str(ray), "start", "--block", "--num-cpus=1", "--num-gpus=0", "--disable-usage-stats", *args],
            stdout=open(self.log_dir / f"{name}.log", "w"),
            stderr=subprocess.STDOUT,
            start_new_session=True,
            env=self.env,
        )
        self.nodes.append(node)
        return node

    def __enter__(self) -> TwoNodeCluster:
        import time

        temp_dir = self.workdir / "ray"
        head = self._start("head", ["--head", "--port=0", "--include-dashboard=false", f"--temp-dir={temp_dir}"])
        try:
            address_file = temp_dir / "ray_current_cluster"
            deadline = time.monotonic() + 120
            while not (address_file.exists() and address_file.read_text().strip()):
                if head.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError((self.log_dir / "head.log").read_text()[-3000:])
                time.sleep(0.5)
            self.address = address_file.read_text().strip()
            self._start("second", [f"--address={self.address}"])
            self._wait_for_nodes(2, deadline)
            return self
        except BaseException:
            self.__exit__(None, None, None)
            raise

    def ask(self, expression: str) -> Any:
        """The JSON value of a Python ``expression`` (``None`` for statements) evaluated, with ``ray`` in scope, by
        one driver attached to the cluster for its lifetime (started at the first question): a question costs
        milliseconds instead of a new Python that imports Ray and connects (seconds). Raises :class:`RuntimeError`
        with the driver's error."""
        import subprocess

        if self._probe is None or self._probe.poll() is not None:
            self._probe = subprocess.Popen(
                [sys.executable, "-u", "-c", _PROBE, self.address],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=open(self.log_dir / "probe.log", "a"),
                text=True,
                env=self.env,
            )
        self._probe.stdin.write(json.dumps(expression) + "\n")
        self._probe.stdin.flush()
        while not (line := self._probe.stdout.readline()).startswith("ANSWER "):
            if not line:
                raise RuntimeError(f"the cluster's probe driver exited; see {self.log_dir / 'probe.log'}")
        answer = json.loads(line.removeprefix("ANSWER "))
        if "error" in answer:
            raise RuntimeError(f"{expression}: {answer['error']}")
        return answer["value"]

    def _wait_for_nodes(self, count: int, deadline: float) -> None:
        """Until the cluster counts ``count`` nodes alive (a lost one is declared dead within seconds here:
        :data:`FAST_NODE_DEATH`)."""
        import time

        while (alive := self.ask("sum(n['Alive'] for n in ray.nodes())")) != count:
            if time.monotonic() > deadline:
                raise RuntimeError(f"{alive} nodes alive, not {count}")
            time.sleep(0.2)

    def drain_second_node(self, *, deadline_s: int, reason: str = "DRAIN_NODE_REASON_PREEMPTION") -> float:
        """Tell the cluster the second node is going away (``ray drain-node``: what KubeRay's autoscaler and a spot
        termination handler do), ``deadline_s`` from now; the node keeps running. Returns the Unix time."""
        import subprocess
        import time

        (node_id,) = self.ask(
            "[n['NodeID'] for n in ray.nodes() if n['Alive'] and 'node:__internal_head__' not in n['Resources']]"
        )
        drained_unix = time.time()
        ray = Path(sys.executable).parent / "ray"
        subprocess.run(
            [str(ray), "drain-node", f"--address={self.address}", f"--node-id={node_id}", f"--reason={reason}",
             "--reason-message=spot instance reclaimed", f"--deadline-remaining-seconds={deadline_s}"],
            capture_output=True, text=True, env=self.env, check=True,
        )  # fmt: skip
        return drained_unix

    def restore_second_node(self) -> float:
        """Capacity returns: a new second node joins (``ray start --address``), as a replacement machine would; a
        second node still running (drained, say) is lost first. Returns the Unix time the new one was started;
        returns once the cluster counts it alive."""
        import time

        if self.nodes[1].poll() is None:
            self._kill(self.nodes[1])
            self._wait_for_nodes(1, time.monotonic() + 60)
        started_unix = time.time()
        self._start("second-again", [f"--address={self.address}"])
        self.nodes[1] = self.nodes.pop()  # in the lost node's place
        self._wait_for_nodes(2, time.monotonic() + 120)
        return started_unix

    @staticmethod
    def _kill(node) -> float:
        """SIGKILL a node's ``ray start`` and every process it started (raylet, GCS, workers); returns the Unix
        time of the kill."""
        import time

        import psutil

        try:
            root = psutil.Process(node.pid)
            doomed = [root, *root.children(recursive=True)]
        except psutil.NoSuchProcess:
            doomed = []
        killed_unix = time.time()
        for process in doomed:
            try:
                process.kill()
            except psutil.NoSuchProcess:
                pass
        node.wait(timeout=30)
        return killed_unix

    def lose_second_node(self) -> float:
        """The second node is lost: its raylet and everything it started die at once. Returns the Unix time."""
        return self._kill(self.nodes[1])

    def __exit__(self, *exc_info: Any) -> None:
        if self._probe is not None and self._probe.poll() is None:
            self._probe.kill()
            self._probe.wait(timeout=30)
        # A throwaway cluster: killed outright (a graceful ``ray stop`` of each node takes tens of seconds).
        for node in reversed(self.nodes):
            if node.poll() is None:
                self._kill(node)


def train_bpe_tokenizer(path: Path, texts: list[str], *, vocab_size: int) -> Path:
    """A byte-level BPE ``tokenizer.json`` (GPT-2's kind, ``<|endoftext|>`` as id 0) trained on ``texts``, written
    to ``path``."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=["<|endoftext|>"], initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    tokenizer.train_from_iterator(texts, trainer)
    path.write_text(tokenizer.to_str())
    return path
