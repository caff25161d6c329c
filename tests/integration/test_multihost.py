#!/usr/bin/env python3
"""A multi-host stack on one machine: what docker-compose and Kubernetes deployments do, tested
where no cluster is available. Each "host" is a network namespace made by the test, with its own
address on a private switch (a bridge inside a namespace of its own, whose empty firewall forwards
everything) and its own /dev/shm, so that its processes share nothing with the other hosts but
the network: the gateway, the probe and the offload manager on one host, two prefill and two
decode hosts, everything over tcp:// with CurveZMQ, bulk data peer to peer between the hosts'
intakes (never through shared memory: each host's /dev/shm is its own).

Cases (--case):
  hosts   greedy and seeded requests identical to `moeline run`; then every process of a decode
          host killed (kill -9) while its streams run, then every process of a prefill host
          while its queue is full: every request completes identically to `moeline run` or ends
          with the retry policy's give-up (for no more requests than were retried), none hangs.

Needs root (network namespaces, tmpfs mounts) and iproute2: without them the case exits 77 (CTest:
skipped).
"""

import os
import random
import shutil
import signal
import subprocess
import sys
import time
import urllib.request

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from stack_harness import Skipped, recovery_errors, run_cases, run_concurrently  # noqa: E402
from test_stack import FAST_FAILURE, check, compare, references, vocab_of  # noqa: E402


def sh(*argv):
    out = subprocess.run(list(argv), capture_output=True, text=True, timeout=30)
    check(out.returncode == 0, f"{' '.join(argv)}: {out.stderr.strip()}")


class Hosts:
    """Network namespaces on one switch: host i at 10.X.Y.(10 + i)/24, the machine itself at
    10.X.Y.1. Each host's processes run in its namespace with a private tmpfs on /dev/shm."""

    def __init__(self, workdir):
        self.tag = f"{os.getpid() % 10000:04d}"
        rng = random.Random(os.getpid())
        self.prefix = f"10.{rng.randrange(100, 250)}.{rng.randrange(1, 250)}"
        self.switch = f"mls{self.tag}"
        self.namespaces, self.links, self.processes = [self.switch], [], {}
        self.workdir = workdir
        sh("ip", "netns", "add", self.switch)
        sh("ip", "-n", self.switch, "link", "add", "br0", "type", "bridge")
        sh("ip", "-n", self.switch, "link", "set", "br0", "up")
        self.hosts = {}
        # The machine's own port onto the switch: the test's client and /readyz checks use it.
        self._attach("self", 1, namespace=None)

    def _attach(self, name, index, namespace):
        outer, inner = f"mlo{self.tag}{index}", f"mli{self.tag}{index}"
        sh("ip", "link", "add", outer, "type", "veth", "peer", "name", inner)
        self.links.append(inner if namespace is None else outer)
        sh("ip", "link", "set", outer, "netns", self.switch)
        sh("ip", "-n", self.switch, "link", "set", outer, "master", "br0", "up")
        address = f"{self.prefix}.{index}"
        if namespace is None:
            sh("ip", "addr", "add", f"{address}/24", "dev", inner)
            sh("ip", "link", "set", inner, "up")
        else:
            sh("ip", "link", "set", inner, "netns", namespace)
            sh("ip", "-n", namespace, "addr", "add", f"{address}/24", "dev", inner)
            sh("ip", "-n", namespace, "link", "set", inner, "up")
            sh("ip", "-n", namespace, "link", "set", "lo", "up")
        return address

    def add(self, name):
        namespace = f"mlh{self.tag}{len(self.hosts)}"
        sh("ip", "netns", "add", namespace)
        self.namespaces.append(namespace)
        self.hosts[name] = (namespace, self._attach(name, 10 + len(self.hosts), namespace))
        return self.hosts[name][1]

    def start(self, host, label, argv):
        """argv on `host`, in its namespace, with /dev/shm a tmpfs of its own."""
        namespace = self.hosts[host][0]
        log = open(os.path.join(self.workdir, f"{label}.log"), "w")
        wrapper = ["ip", "netns", "exec", namespace, "unshare", "--mount", "--propagation",
                   "private", "sh", "-c", 'mount -t tmpfs -o size=512m shm /dev/shm && exec "$@"',
                   "sh"] + argv
        process = subprocess.Popen(wrapper, stdout=log, stderr=subprocess.STDOUT,
                                   start_new_session=True)
        self.processes.setdefault(host, []).append((label, process))

    def kill_host(self, host):
        for _, process in self.processes.get(host, []):
            os.killpg(process.pid, signal.SIGKILL)
        for _, process in self.processes.get(host, []):
            process.wait(timeout=30)

    def dump_logs(self):
        for host in self.processes.values():
            for label, _ in host:
                with open(os.path.join(self.workdir, f"{label}.log"), errors="replace") as f:
                    tail = f.read().splitlines()[-15:]
                print(f"---- {label} (last lines) ----\n" + "\n".join(tail), file=sys.stderr)

    def close(self):
        for host in self.processes:
            for _, process in self.processes[host]:
                if process.poll() is None:
                    os.killpg(process.pid, signal.SIGKILL)
                    process.wait(timeout=30)
        for link in self.links:
            subprocess.run(["ip", "link", "del", link], capture_output=True)
        for namespace in self.namespaces:
            subprocess.run(["ip", "netns", "del", namespace], capture_output=True)


def require_namespaces():
    if os.geteuid() != 0:
        raise Skipped("network namespaces and tmpfs mounts need root")
    if shutil.which("ip") is None or shutil.which("unshare") is None:
        raise Skipped("iproute2 (ip) and util-linux (unshare) are needed")
    probe = subprocess.run(["ip", "netns", "add", f"mlprobe{os.getpid()}"], capture_output=True)
    if probe.returncode != 0:
        raise Skipped(f"cannot make a network namespace here: {probe.stderr.decode().strip()}")
    subprocess.run(["ip", "netns", "del", f"mlprobe{os.getpid()}"], capture_output=True)


def wait_ready(urls, timeout=120):
    deadline = time.time() + timeout
    waiting = set(urls)
    while waiting and time.time() < deadline:
        for url in list(waiting):
            try:
                with urllib.request.urlopen(url, timeout=2) as response:
                    if response.status == 200:
                        waiting.discard(url)
            except OSError:
                pass
        time.sleep(0.2)
    check(not waiting, f"not ready after {timeout} s: {sorted(waiting)}")


def metric_sum(url, name):
    """The sum of a sample over its label sets; a stage that does not export it fails the test
    (a check of a metric that is not there must not read 0)."""
    from prometheus_client.parser import text_string_to_metric_families
    with urllib.request.urlopen(url, timeout=5) as response:
        text = response.read().decode()
    values = [sample.value for family in text_string_to_metric_families(text)
              for sample in family.samples if sample.name == name]
    check(values, f"{url} has no {name}")
    return sum(values)


def case_hosts(args):
    from moeline_client import Client
    require_namespaces()
    workdir = os.path.join(args.workdir, "hosts")
    shutil.rmtree(workdir, ignore_errors=True)
    os.makedirs(workdir)
    keys = os.path.join(workdir, "keys")
    subprocess.run([args.moeline, "keys", "init", "--dir", keys], check=True,
                   capture_output=True, timeout=60)
    hosts = Hosts(workdir)
    try:
        gateway_ip = hosts.add("gateway-host")
        hub = f"tcp://{gateway_ip}:5556"
        common = ["--model", args.model, "--curve-dir", keys,
                  "--heartbeat-ms", str(FAST_FAILURE["heartbeat-ms"]),
                  "--peer-timeout-ms", str(FAST_FAILURE["peer-timeout-ms"])]
        moeline = args.moeline
        ready = []

        def stage(host, name, kind, port, extra):
            address = hosts.hosts[host][1]
            hosts.start(host, name, [moeline, kind, *common, "--replica", name,
                                     "--http", f"{address}:{port}", *extra])
            ready.append(f"http://{address}:{port}/readyz")

        stage("gateway-host", "gateway", "gateway", 9100,
              ["--client-bind", f"tcp://{gateway_ip}:5555", "--hub-bind", hub])
        stage("gateway-host", "probe", "probe", 9101,
              ["--hub", hub, "--store-path", os.path.join(workdir, "store")])
        stage("gateway-host", "offload", "offload", 9102, ["--hub", hub])
        for kind in ("prefill", "decode"):
            for i in range(2):
                host = f"{kind}-host-{i}"
                hosts.add(host)
                stage(host, f"{kind}-{i}", kind, 9100, ["--hub", hub, "--threads", "1"])
        wait_ready(ready)
        endpoint = f"tcp://{gateway_ip}:5555"
        server_key = os.path.join(keys, "gateway.pub")
        print(f"ok hosts: 5 hosts on a private switch ({hosts.prefix}.0/24), 7 stages ready over "
              "tcp:// with Curve")

        vocab = vocab_of(args.model)
        rng = random.Random(5)
        requests = [{"tokens": [rng.randrange(vocab) for _ in range(rng.choice([5, 40]))],
                     "max_tokens": 24} for _ in range(12)]
        for i in range(0, len(requests), 4):
            requests[i].update(temperature=0.8, seed=900 + i)
        expected = references(args, requests)
        with Client(endpoint, timeout=120, server_key=server_key) as client:
            results = run_concurrently(client, requests)
        check(compare(results, requests, expected) == len(requests), "not every request served")
        shm = sum(metric_sum(f"http://{hosts.hosts[f'prefill-host-{i}'][1]}:9100/metrics",
                             "moeline_shm_handover_total") for i in range(2))
        check(shm == 0, f"prefill used shared memory across hosts ({shm} hand-overs)")
        handovers = sum(metric_sum(f"http://{hosts.hosts[f'decode-host-{i}'][1]}:9100/metrics",
                                   "moeline_decode_handovers_total") for i in range(2))
        check(handovers >= len(requests), f"decode received {handovers} hand-overs")
        print(f"ok hosts: {len(requests)} requests (greedy and seeded) identical to `moeline "
              "run`, the KV handed over between hosts through their intakes, not shared memory")

        # A decode host dies while its streams run; then a prefill host while its queue is full.
        for victim, requests in (
                ("decode-host-0",
                 [{"tokens": [rng.randrange(vocab) for _ in range(rng.choice([3, 30]))],
                   "max_tokens": 300, "ignore_eos": True} for _ in range(16)]),
                ("prefill-host-0",
                 [{"tokens": [rng.randrange(vocab) for _ in range(300)], "max_tokens": 8}
                  for _ in range(32)])):
            for i in range(0, len(requests), 5):
                requests[i].update(temperature=0.9, seed=700 + i)
            expected = references(args, requests)
            gateway_metrics = f"http://{gateway_ip}:9100/metrics"
            retries_before = metric_sum(gateway_metrics, "moeline_gateway_retries_total")
            kill_after = len(requests) if victim.startswith("decode") else 1
            killed = []

            def kill_victim(deltas):
                if not killed and deltas >= kill_after:
                    hosts.kill_host(victim)
                    killed.append(victim)

            with Client(endpoint, timeout=120, server_key=server_key) as client:
                results = run_concurrently(client, requests, on_delta=kill_victim)
            check(killed, f"{victim} was never killed (too few tokens streamed)")
            retried = metric_sum(gateway_metrics, "moeline_gateway_retries_total") - retries_before
            given_up = recovery_errors(results, retried, victim)
            completed = compare(results, requests, expected, allow_errors=True)
            check(completed + given_up == len(requests),
                  f"{victim}: {completed} completed and {given_up} gave up of {len(requests)}")
            print(f"ok hosts: every process of {victim} killed mid-run: {completed} requests "
                  f"identical to `moeline run`, {given_up} gave up after their retries, 0 hung; "
                  f"{int(retried)} retried on the other host")
    except BaseException:
        hosts.dump_logs()
        raise
    finally:
        hosts.close()


CASES = {"hosts": case_hosts}


def main():
    run_cases(CASES, __doc__)


if __name__ == "__main__":
    main()
