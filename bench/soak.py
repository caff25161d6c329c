#!/usr/bin/env python3
"""Soak: a stack under steady load with a fault every few seconds, for a long time.

16 client streams (Python SDK, one connection each) send greedy requests drawn from a fixed set of
prompts whose outputs `moeline run` computed first (half of them with reuse off, so that prefill
and decode compute them; the rest may be served from the probe's store); every --fault-every-s seconds one fault hits
the stack, in turn: kill -9 of a random stage, SIGSTOP of a random stage (SIGCONT 10 s later, if
the supervisor has not replaced it), SIGTERM of a random stage (a drain), and a full disk under
the probe's store (a tmpfs filled for 20 s; needs root, otherwise skipped). Prints one JSON object:
requests served (and of those wrong: must be 0), failed with an explicit error (by code), hung
(no end within the request's deadline plus a margin: must be 0), retried (the gateways' counters),
and the faults injected.

  soak.py --moeline BIN --model DIR --workdir DIR [--duration-s 1800] [--fault-every-s 30]
          [--streams 16]
"""

import argparse
import collections
import json
import os
import random
import signal
import subprocess
import sys
import threading
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, os.path.join(ROOT, "tests", "integration"))
from stack_harness import Stack, add_python_paths, reference  # noqa: E402

MAX_TOKENS = 24
DEADLINE_MS = 60_000
HUNG_MARGIN_S = 30


def scrape(stack, name, sample):
    try:
        return stack.metric(name, sample)
    except Exception:  # the stage is down or restarting
        return None


class Counters:
    def __init__(self):
        self.lock = threading.Lock()
        self.served = self.wrong = self.hung = 0
        self.errors = collections.Counter()
        self.by_reuse = collections.Counter()  # served requests by usage.reuse_level

    def add(self, field, code=None):
        with self.lock:
            if field == "error":
                self.errors[code] += 1
            else:
                setattr(self, field, getattr(self, field) + 1)


def stream(endpoint, prompts, expected, until, counters, seed):
    from moeline_client import Client, GenerateError
    rng = random.Random(seed)
    client = Client(endpoint, timeout=DEADLINE_MS / 1000 + HUNG_MARGIN_S)
    while time.time() < until:
        i = rng.randrange(len(prompts))
        # Half the requests opt out of reuse, so that prefill and decode compute them (the others
        # may be replayed or prefilled from the probe's store: that path is under test too).
        reuse = "none" if rng.random() < 0.5 else ""
        try:
            result = client.generate(tokens=prompts[i], max_tokens=MAX_TOKENS, ignore_eos=True,
                                     deadline_ms=DEADLINE_MS, reuse=reuse)
            counters.add("served")
            with counters.lock:
                counters.by_reuse[result.usage.get("reuse_level", "none")] += 1
            if result.ids != expected[i]:
                counters.add("wrong")
        except GenerateError as e:
            counters.add("error", e.code_name)
            time.sleep(0.2)
        except TimeoutError:
            counters.add("hung")
    client.close()


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--moeline", required=True)
    ap.add_argument("--model", required=True)
    ap.add_argument("--workdir", required=True)
    ap.add_argument("--python-build", default=os.path.join(ROOT, "build", "python"))
    ap.add_argument("--duration-s", type=float, default=1800)
    ap.add_argument("--fault-every-s", type=float, default=30)
    ap.add_argument("--streams", type=int, default=16)
    ap.add_argument("--seed", type=int, default=1)
    args = ap.parse_args()
    add_python_paths(args.python_build, os.path.join(ROOT, "sdk", "python"))
    rng = random.Random(args.seed)
    prompts = [[rng.randrange(3, 1000) for _ in range(rng.randrange(4, 40))] for _ in range(32)]
    print(f"soak: computing {len(prompts)} references with moeline run", file=sys.stderr)
    expected = [reference(args.moeline, args.model, MAX_TOKENS, tokens=p, ignore_eos=True)["ids"]
                for p in prompts]

    run = os.path.join(args.workdir, "soak")
    store = os.path.join(run, "store")
    can_mount = os.getuid() == 0

    def mount(_):
        if can_mount:
            os.makedirs(store, exist_ok=True)
            subprocess.run(["mount", "-t", "tmpfs", "-o", "size=256m", "tmpfs", store], check=True)

    config = {"heartbeat-ms": 200, "peer-timeout-ms": 2000,
              "probe": {"store-disk-reserve": "64MiB"}}
    counters = Counters()
    faults = collections.Counter()
    retried = {"total": 0.0, "last": 0.0}
    try:
        with Stack(args.moeline, args.model, run, prefill=1, decode=2, config=config,
                   pre_up=mount) as stack:
            stages = [s["name"] for s in stack.state()["stages"]]
            until = time.time() + args.duration_s
            workers = [threading.Thread(target=stream, args=(stack.endpoint, prompts, expected,
                                                             until, counters, args.seed + i))
                       for i in range(args.streams)]
            for w in workers:
                w.start()
            kinds = ["kill9", "sigstop", "sigterm"] + (["disk_full"] if can_mount else [])
            next_fault = time.time() + args.fault_every_s
            turn = 0
            while time.time() < until:
                time.sleep(1)
                value = scrape(stack, "gateway", "moeline_gateway_retries_total")
                if value is not None:
                    if value < retried["last"]:
                        retried["total"] += retried["last"]  # the gateway restarted
                    retried["last"] = value
                if time.time() < next_fault:
                    continue
                next_fault += args.fault_every_s
                kind = kinds[turn % len(kinds)]
                turn += 1
                victim = rng.choice(stages)
                try:
                    if kind == "kill9":
                        stack.kill(victim)
                    elif kind == "sigterm":
                        stack.kill(victim, signal.SIGTERM)
                    elif kind == "sigstop":
                        pid = stack.kill(victim, signal.SIGSTOP)
                        threading.Timer(10, lambda p=pid: _cont(p)).start()
                    else:
                        victim = "probe store"
                        subprocess.run(["dd", "if=/dev/zero", f"of={store}/filler", "bs=1M"],
                                       capture_output=True)
                        threading.Timer(20, lambda: _remove(f"{store}/filler")).start()
                    faults[kind] += 1
                    print(f"soak: t={args.duration_s - (until - time.time()):.0f}s {kind} "
                          f"{victim}", file=sys.stderr)
                except (ProcessLookupError, KeyError) as e:
                    print(f"soak: fault {kind} on {victim} skipped: {e}", file=sys.stderr)
            for w in workers:
                w.join(timeout=DEADLINE_MS / 1000 + HUNG_MARGIN_S + 30)
            still = sum(w.is_alive() for w in workers)
            counters.hung += still
    finally:
        if can_mount:
            subprocess.run(["umount", "-l", store], capture_output=True)
    report = {"duration_s": args.duration_s, "streams": args.streams,
              "fault_every_s": args.fault_every_s, "faults": dict(faults),
              "served": counters.served, "served_by_reuse": dict(counters.by_reuse),
              "wrong": counters.wrong,
              "failed_explicit": dict(counters.errors), "hung": counters.hung,
              "retried": retried["total"] + retried["last"]}
    print(json.dumps(report))
    return 0 if counters.hung == 0 and counters.wrong == 0 else 1


def _cont(pid):
    try:
        os.kill(pid, signal.SIGCONT)
    except ProcessLookupError:
        pass


def _remove(path):
    try:
        os.remove(path)
    except FileNotFoundError:
        pass


if __name__ == "__main__":
    sys.exit(main())
