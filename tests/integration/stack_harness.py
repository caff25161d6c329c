"""Shared by the integration tests: a real local stack (`moeline stack up`) in a temporary run
directory, its stages' /metrics, and `moeline run` as the in-process reference."""

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import time
import urllib.request


def add_python_paths(build_python, sdk_python):
    for path in (build_python, sdk_python):
        if path not in sys.path:
            sys.path.insert(0, path)


def require(condition, message):
    """An explicit check (a bare assert vanishes under python -O)."""
    if not condition:
        raise AssertionError(message)


class Stack:
    """`moeline stack up` on enter, `moeline stack down` on exit (logs printed on failure)."""

    def __init__(self, moeline, model, run_dir, prefill=1, decode=1, config=None, threads=1,
                 expert_budget=None, extra_args=(), endpoint_prefix="ipc://", clean=True,
                 pre_up=None, http_port="off"):
        self.moeline, self.model, self.run_dir = moeline, model, run_dir
        self.prefill, self.decode, self.config, self.threads = prefill, decode, config, threads
        self.expert_budget, self.extra_args = expert_budget, list(extra_args)
        self.endpoint = None
        self.endpoint_prefix = endpoint_prefix
        # clean: start from an empty run directory; pre_up(run_dir): called just before `up`.
        self.clean, self.pre_up = clean, pre_up
        # The HTTP front: off unless a test asks for it (0: a free port; tests run in parallel).
        self.api_port = http_port

    def __enter__(self):
        os.makedirs(self.run_dir, exist_ok=True)
        # A stack left behind by an interrupted earlier run would hold the run directory, and an
        # earlier run's snapshot store would serve this run's requests: start clean.
        subprocess.run([self.moeline, "stack", "down", "--run-dir", self.run_dir],
                       capture_output=True, timeout=60)
        if self.clean:
            shutil.rmtree(self.run_dir, ignore_errors=True)
        os.makedirs(self.run_dir, exist_ok=True)
        if self.pre_up:
            self.pre_up(self.run_dir)
        cmd = [self.moeline, "stack", "up", "--model", self.model, "--run-dir", self.run_dir,
               "--prefill", str(self.prefill), "--decode", str(self.decode),
               "--threads", str(self.threads), "--timeout-s", "90"]
        if self.expert_budget:
            cmd += ["--expert-budget", str(self.expert_budget)]
        cmd += ["--http-port", str(self.api_port)]
        cmd += self.extra_args
        if self.config:
            path = os.path.join(self.run_dir, "stages.json")
            with open(path, "w") as f:
                json.dump(self.config, f)
            cmd += ["--config", path]
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
        if out.returncode != 0:
            self.dump_logs()
            raise AssertionError(f"stack up failed ({out.returncode}): {out.stderr}")
        self.endpoint = out.stdout.strip().splitlines()[-1]
        require(self.endpoint.startswith(self.endpoint_prefix), out.stdout)
        return self

    def __exit__(self, exc_type, exc, tb):
        if exc_type is not None:
            # The cause first: CI keeps the head and the tail of a long output, and the logs
            # below would push the failed check out of both.
            print(f"FAILED: {exc_type.__name__}: {exc}", file=sys.stderr)
            self.dump_logs()
        out = subprocess.run([self.moeline, "stack", "down", "--run-dir", self.run_dir],
                             capture_output=True, text=True, timeout=60)
        require(out.returncode == 0, out.stderr)
        return False

    def dump_logs(self):
        logs = os.path.join(self.run_dir, "logs")
        for name in sorted(os.listdir(logs)) if os.path.isdir(logs) else []:
            with open(os.path.join(logs, name), errors="replace") as f:
                tail = f.read().splitlines()[-25:]
            print(f"---- {name} (last lines) ----\n" + "\n".join(tail), file=sys.stderr)

    def state(self):
        with open(os.path.join(self.run_dir, "stack.json")) as f:
            return json.load(f)

    def status(self):
        """`moeline stack status --json`: every endpoint, each stage's health."""
        return json.loads(subprocess.run(
            [self.moeline, "stack", "status", "--run-dir", self.run_dir, "--json"],
            capture_output=True, text=True, timeout=30, check=True).stdout)

    def healthy(self):
        """`moeline stack status` says every stage is up and ready (exit status 0)."""
        return subprocess.run([self.moeline, "stack", "status", "--run-dir", self.run_dir],
                              capture_output=True, timeout=30).returncode == 0

    def wait_healthy(self, timeout, message):
        wait_for(self.healthy, timeout, message)

    def intakes(self):
        """{stage name: intake endpoint}, as the stages advertise them."""
        return self.status()["endpoints"]["intakes"]

    def stage(self, name):
        for stage in self.state()["stages"]:
            if stage["name"] == name:
                return stage
        raise KeyError(name)

    def http_port(self, name):
        with open(self.stage(name)["port_file"]) as f:
            return int(f.read())

    def metrics_text(self, name):
        url = f"http://127.0.0.1:{self.http_port(name)}/metrics"
        with urllib.request.urlopen(url, timeout=5) as response:
            return response.read().decode()

    def metrics(self, name):
        """{(metric sample name, frozenset(labels)): value} parsed by prometheus_client."""
        from prometheus_client.parser import text_string_to_metric_families
        out = {}
        for family in text_string_to_metric_families(self.metrics_text(name)):
            for sample in family.samples:
                # Every sample carries the stage's model (one per stack): checks name the rest.
                labels = frozenset((k, v) for k, v in sample.labels.items() if k != "model")
                out[(sample.name, labels)] = sample.value
        return out

    def metrics_once(self, name, ready, timeout=15):
        """self.metrics(name) once ready(metrics) holds, or the last read after `timeout` seconds
        (for the caller's checks to fail on): what a stage publishes every half second or so,
        such as the expert pool's counters, reaches /metrics a little after the work it counts."""
        deadline = time.time() + timeout
        while True:
            metrics = self.metrics(name)
            if ready(metrics) or time.time() > deadline:
                return metrics
            time.sleep(0.1)

    def metric(self, name, sample, created_on_first_event=False, **labels):
        return sample_value(self.metrics(name), sample, name, created_on_first_event, **labels)

    def kill(self, name, sig=signal.SIGKILL):
        pid = self.stage(name)["pid"]
        if pid <= 0:  # between a death and its restart; os.kill(0) would signal this group
            raise ProcessLookupError(f"{name} has no process right now")
        os.kill(pid, sig)
        return pid

    def wait_restarted(self, name, old_pid, timeout=30):
        deadline = time.time() + timeout
        while time.time() < deadline:
            stage = self.stage(name)
            if stage["pid"] not in (0, old_pid):
                return stage
            time.sleep(0.1)
        raise AssertionError(f"{name} was not restarted within {timeout} s")


def vocab_of(model):
    """The vocabulary size in a model folder's config.json."""
    with open(os.path.join(model, "config.json")) as f:
        return json.load(f)["vocab_size"]


def reference(moeline, model, max_tokens, tokens=None, prompt=None, temperature=0.0, seed=None,
              ignore_eos=False, extra=()):
    """`moeline run` in one process: the correctness baseline. `extra`: more of its flags."""
    cmd = [moeline, "run", "--model", model, "--max-tokens", str(max_tokens), "--json",
           "--threads", "1"]
    cmd += ["--tokens", ",".join(map(str, tokens))] if tokens is not None else ["--prompt", prompt]
    if temperature:
        cmd += ["--temperature", str(temperature)]
    if seed is not None:
        cmd += ["--seed", str(seed)]
    if ignore_eos:
        cmd += ["--ignore-eos"]
    cmd += list(extra)
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    require(out.returncode == 0, out.stderr)
    return json.loads(out.stdout)


def run_concurrently(client, requests, timeout=120, on_delta=None):
    """Starts every request at once on one connection and collects each one's events;
    on_delta(n), if given, is called after the n-th delta of any request (a test may kill a
    stage there). Returns {index: {"ids", "text", "finish_reason", "error", "usage", "timings"}}."""
    crid_to_index = {}
    for index, request in enumerate(requests):
        crid_to_index[client.start(**request)] = index
    results = {i: {"ids": [], "text": "", "finish_reason": None, "error": None} for i in
               range(len(requests))}
    pending = set(crid_to_index)
    deltas = 0
    deadline = time.time() + timeout
    while pending:
        left = deadline - time.time()
        if left <= 0:
            raise AssertionError(f"{len(pending)} requests never ended (hung)")
        event = client.next_event(timeout=left)
        result = results[crid_to_index[event.client_request_id]]
        if event.kind == "delta":
            result["ids"] += event.token_ids
            result["text"] += event.text
            deltas += 1
            if on_delta is not None:
                on_delta(deltas)
        elif event.kind == "finished":
            result["text"] += event.text
            result["finish_reason"] = event.finish_reason
            result["usage"], result["timings"] = event.usage, event.timings
        elif event.kind == "error":
            result["error"] = (event.error_code, event.error_message)
        if event.terminal:
            pending.discard(event.client_request_id)
    return results


class Skipped(Exception):
    """A case that cannot run on this host (raised with the reason); run_cases reports it to CTest
    as skipped (exit status SKIP_EXIT_CODE), never as passed."""


SKIP_EXIT_CODE = 77


def gpu_expected():
    """Why this host should have a usable NVIDIA GPU, or None: MOELINE_EXPECT_GPU=1 (0 says none),
    else an NVIDIA device node, else `nvidia-smi -L` listing a GPU. Decided apart from CUDA, whose
    failure is what makes the GPU cases skip."""
    setting = os.environ.get("MOELINE_EXPECT_GPU")
    if setting is not None:
        return f"MOELINE_EXPECT_GPU={setting}" if setting == "1" else None
    if os.path.exists("/dev/nvidia0"):
        return "/dev/nvidia0 exists"
    try:
        out = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return "nvidia-smi lists a GPU" if out.returncode == 0 and "GPU" in out.stdout else None


def sample_value(metrics, sample, where, created_on_first_event=False, **labels):
    """One sample of a Stack.metrics() snapshot. A sample name the stage does not export at all (a
    renamed or removed metric, a typo) fails the check that reads it, rather than reading 0; a
    label set not seen yet on an exported metric reads 0, as Prometheus counts a labelled counter
    before its first event. created_on_first_event: the caller knows that the stage creates this
    metric at its first event (moeline_handler_errors_total), so its absence reads 0 too."""
    value = metrics.get((sample, frozenset(labels.items())))
    if value is not None:
        return value
    require(created_on_first_event or any(key[0] == sample for key in metrics),
            f"{where} does not export {sample} at all (its /metrics has no such sample)")
    return 0.0


def roc_auc(positives, negatives):
    """P(a positive's score is below a negative's), ties counting half: 0.5 means the two cannot
    be told apart, 1.0 that every positive is below every negative."""
    wins = 0.0
    for p in positives:
        for n in negatives:
            wins += 1.0 if p < n else 0.5 if p == n else 0.0
    return wins / (len(positives) * len(negatives))


# How the gateway ends a request whose retries ran out (stages/gateway: retry_or_fail).
RETRY_GIVE_UP = "gave up after"


def recovery_errors(results, retried, label):
    """The errors of a run in which a process was killed: the only one allowed is the retry
    policy's give-up ("... gave up after N attempts": a request retried until its attempts ran
    out), and for at most as many requests as were retried. A request that was not on the killed
    process has nothing to fail of, and one that was is retried, so any other error (a deadline, a
    divergence, a request lost) fails the test. Returns the number that gave up (to be reported)."""
    given_up = []
    for i, got in sorted(results.items()):
        if got["error"] is None:
            continue
        code, message = got["error"]
        require(code != 0 and message and RETRY_GIVE_UP in message,
                f"{label}: request {i} ended with {got['error']}: after a kill only the retry "
                "policy's give-up is allowed")
        given_up.append(i)
    require(len(given_up) <= retried,
            f"{label}: requests {given_up} gave up but only {retried} requests were retried")
    return len(given_up)


def wait_for(predicate, timeout, message, poll_s=0.05):
    """Polls predicate() until it holds; after `timeout` seconds fails with `message` (a string, or
    a function giving one, to say what was seen last)."""
    deadline = time.time() + timeout
    while time.time() < deadline:
        if predicate():
            return
        time.sleep(poll_s)
    raise AssertionError(message() if callable(message) else message)


def until_the_stop_lands(attempt, label, tries=5):
    """Runs attempt() until the stop it makes (a cancel, a disconnect) reaches the pipeline before
    the request's last token. The demo model decodes its whole context in a fraction of a second,
    so on a busy machine a client may read its first token only after the last one was made: such
    a try says nothing about the stop and is repeated. attempt(try_number) returns (landed,
    description) and raises on any other failure; a stop that never lands fails after the last
    try. Each try must ask a prompt of its own (try_number is there to vary it): a try the stop
    missed stored its whole answer, and the same request asked again is replayed from the store,
    far too fast for any stop. Returns the descriptions of the tries."""
    seen = []
    for try_number in range(tries):
        landed, description = attempt(try_number)
        seen.append(description)
        if landed:
            return seen
    raise AssertionError(f"{label}: the request ran to its end on every try: {'; '.join(seen)}")


def process_cpu_seconds(pid):
    """User and system CPU time of a process, all its threads (OSError when it is gone)."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def percentile(values, q):
    """The q-quantile (0..1) of values, linearly interpolated."""
    values = sorted(values)
    index = q * (len(values) - 1)
    lo = int(index)
    hi = min(lo + 1, len(values) - 1)
    return values[lo] + (values[hi] - values[lo]) * (index - lo)


def run_cases(cases, description):
    """The integration tests' command line: --moeline, --model, the Python paths, a work
    directory (under /tmp when long: ipc:// paths must stay short), and --case (default: all)."""
    parser = argparse.ArgumentParser(description=description,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--moeline", required=True)
    parser.add_argument("--model", required=True)
    parser.add_argument("--python-build", required=True, help="build/python (generated wire code)")
    parser.add_argument("--python-sdk", required=True, help="sdk/python")
    parser.add_argument("--workdir", required=True)
    parser.add_argument("--case", choices=sorted(cases), action="append")
    args = parser.parse_args()
    add_python_paths(args.python_build, args.python_sdk)
    args.workdir = os.path.abspath(args.workdir)
    if len(args.workdir) > 60:
        short = os.path.join("/tmp", "moeline-it-" + str(abs(hash(args.workdir)) % 10**8))
        shutil.rmtree(short, ignore_errors=True)
        args.workdir = short
    os.makedirs(args.workdir, exist_ok=True)
    skipped = []
    for name in args.case or sorted(cases):
        try:
            cases[name](args)
        except Skipped as reason:
            print(f"skipped {name}: {reason}")
            skipped.append(name)
    if skipped:
        print(f"skipped: {', '.join(skipped)}; the other cases ok")
        sys.exit(SKIP_EXIT_CODE)
    print("all ok")
