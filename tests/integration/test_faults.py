#!/usr/bin/env python3
"""Faults an operator meets, with real processes: the stack must keep serving (slower, without
reuse where it must) and say what happened.

Cases (--case, one per CTest entry):
  store     a corrupted RocksDB MANIFEST under the probe's store (the probe crash-looped and every
            request ended in DeadlineExceeded): the store is moved aside, counted and logged, and
            the stack serves. A full disk (a small tmpfs under RUN/store): failed spills are
            counted and logged, and a probe restarted onto the full disk still comes up; every
            request is served.
  probe     a probe that does not answer (SIGSTOP): requests go to prefill without reuse after
            --probe-timeout-ms (counted) and are identical to `moeline run`.
  gateway   kill -9 of the gateway: every open request of a client (Python SDK) ends with an
            explicit error within 10 s, and `moeline load` (the C++ SDK) ends every request and
            exits instead of waiting forever; the restarted gateway serves.
  drain     SIGTERM of a decode replica under load: it finishes what it holds (nothing lost or
            retried); with a short grace period, what it could not finish is handed back and
            completed elsewhere, identical to `moeline run`.

The store case mounts a tmpfs, which needs root: without it the case exits 77 (CTest: skipped).
"""

import glob
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
import urllib.request

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from stack_harness import Stack, reference, run_cases, wait_for  # noqa: E402

SKIP = 77


def check(condition, message):
    if not condition:
        raise AssertionError(message)


def serve(stack, count, offset=0, max_tokens=4):
    """`count` distinct greedy requests; every one must finish (no error)."""
    from moeline_client import Client
    results = []
    with Client(stack.endpoint, timeout=90) as client:
        for i in range(count):
            tokens = [((offset + i) * 7 + j) % 200 + 3 for j in range(20)]
            results.append((tokens, client.generate(tokens=tokens, max_tokens=max_tokens)))
    return results


def healthy(stack, name):
    import urllib.request
    try:
        url = f"http://127.0.0.1:{stack.http_port(name)}/healthz"
        with urllib.request.urlopen(url, timeout=2) as response:
            return response.status == 200
    except Exception:  # not listening yet, or no port file yet
        return False


def probe_log(stack):
    with open(os.path.join(stack.run_dir, "logs", "probe.log"), errors="replace") as f:
        return f.read()


def corrupt_manifest(args):
    run = os.path.join(args.workdir, "corrupt")
    with Stack(args.moeline, args.model, run) as stack:
        serve(stack, 6)
    # `stack down` flushed the RAM tier to disk; now damage the store's MANIFEST.
    manifests = glob.glob(os.path.join(run, "store", "MANIFEST-*"))
    check(manifests, f"no MANIFEST under {run}/store")
    for path in manifests:
        with open(path, "r+b") as f:
            f.write(b"\xde\xad\xbe\xef" * 64)
    with Stack(args.moeline, args.model, run, clean=False) as stack:
        served = serve(stack, 4, offset=100)
        check(len(served) == 4, "requests were not served")
        moved = stack.metric("probe", "moeline_probe_store_open_failures_total", store="snapshots",
                             outcome="moved_aside")
        check(moved == 1, f"the unusable store should be moved aside once, counted {moved}")
        aside = glob.glob(os.path.join(run, "store.unusable-*"))
        check(aside, "the unusable store is not where the log says")
        check("event=store_unusable" in probe_log(stack) and aside[0] in probe_log(stack),
              "the probe's log should name the moved store")
        print(f"ok store: a corrupt MANIFEST is moved aside to {os.path.basename(aside[0])}; "
              "the stack serves")


def full_disk(args):
    if os.getuid() != 0:
        print("SKIP store (full disk): mounting a tmpfs needs root")
        sys.exit(SKIP)
    run = os.path.join(args.workdir, "full")
    store = os.path.join(run, "store")

    def mount(run_dir):
        os.makedirs(store, exist_ok=True)
        subprocess.run(["mount", "-t", "tmpfs", "-o", "size=48m", "tmpfs", store], check=True)

    # A tiny RAM tier: every stored entry spills to the 48 MiB disk at once, until the disk is
    # filled by someone else below the store's reserve.
    config = {"probe": {"store-ram-bytes": "16KiB", "store-disk-bytes": "1GiB",
                        "store-disk-reserve": "16MiB"}}
    try:
        with Stack(args.moeline, args.model, run, config=config, pre_up=mount) as stack:
            served = serve(stack, 10)
            spilled = stack.metric("probe", "moeline_probe_store_spills")
            check(spilled > 0, "entries should spill to the disk while it has room")
            subprocess.run(["dd", "if=/dev/zero", f"of={store}/filler", "bs=64k"],
                           capture_output=True)
            served = serve(stack, 30, offset=100)
            check(len(served) == 30, "requests were not served on a full disk")
            wait_for(lambda: stack.metric("probe", "moeline_probe_store_spill_failures") > 0, 20,
                     "spills onto a full disk should fail and be counted")
            check("event=store_spill_failed" in probe_log(stack), "a failed spill is not logged")
            print(f"ok store: spills onto a full disk fail, counted "
                  f"({stack.metric('probe', 'moeline_probe_store_spill_failures'):.0f}) and logged")
            # Restart the probe onto the full disk.
            old = stack.kill("probe")
            stack.wait_restarted("probe", old)
            wait_for(lambda: healthy(stack, "probe"), 60,
                     "the probe did not come back on a full disk")
            served = serve(stack, 6, offset=300)
            check(len(served) == 6, "requests were not served after the probe restarted")
            check(stack.metric("probe", "moeline_probe_store_open_failures_total",
                               store="snapshots", outcome="no_disk_tier") == 1,
                  "the restarted probe should run without its disk tier, and count it")
            print("ok store: a probe restarted onto a full disk comes up and the stack serves")
    finally:
        subprocess.run(["umount", "-l", store], capture_output=True)


def case_store(args):
    corrupt_manifest(args)
    full_disk(args)


def case_probe(args):
    from moeline_client import Client
    run = os.path.join(args.workdir, "probe")
    config = {"gateway": {"probe-timeout-ms": 500}}
    with Stack(args.moeline, args.model, run, config=config) as stack:
        prompts = [[5 + i, 6, 7, 8, 9] for i in range(6)]
        expected = [reference(args.moeline, args.model, 6, tokens=p)["ids"] for p in prompts]
        os.kill(stack.stage("probe")["pid"], signal.SIGSTOP)
        try:
            with Client(stack.endpoint, timeout=60) as client:
                got = [client.generate(tokens=p, max_tokens=6).ids for p in prompts]
        finally:
            try:
                os.kill(stack.stage("probe")["pid"], signal.SIGCONT)
            except (ProcessLookupError, KeyError):
                pass
        check(got == expected, f"requests served past a silent probe differ: {got} != {expected}")
        bypassed = stack.metric("gateway", "moeline_gateway_probe_bypassed_total")
        check(bypassed >= 1, f"bypasses should be counted, got {bypassed}")
        print(f"ok probe: a stopped probe is bypassed ({bypassed:.0f} requests, counted); "
              "outputs identical to moeline run")


def case_gateway(args):
    from moeline_client import Client, ErrorCode
    run = os.path.join(args.workdir, "gateway")
    with Stack(args.moeline, args.model, run,
               config={"heartbeat-ms": 100, "peer-timeout-ms": 1500}) as stack:
        # The Python SDK: 8 streams, each past its first token, then kill -9 of the gateway.
        # (Streams as long as the context allows; one that a busy machine lets finish before the
        # kill has nothing to lose and is left out, as long as most are still open.)
        with Client(stack.endpoint, timeout=60) as client:
            first_life_id = client.generate(tokens=[1, 2, 3], max_tokens=1).request_id
            crids = [client.start(tokens=[3 + i, 4, 5], max_tokens=500, ignore_eos=True)
                     for i in range(8)]
            started, finished_early = set(), set()
            while len(started | finished_early) < len(crids):
                event = client.next_event(timeout=60)
                if event.terminal:
                    finished_early.add(event.client_request_id)
                elif event.kind == "delta":
                    started.add(event.client_request_id)
            still_open = started - finished_early
            check(len(still_open) >= 4, f"only {len(still_open)} of 8 streams were still open at "
                  "the kill")
            killed_at = time.time()
            stack.kill("gateway")
            ended = {}
            while len(ended) < len(still_open):
                event = client.next_event(timeout=20)
                if event.terminal:
                    ended[event.client_request_id] = (event.kind, event.error_code,
                                                      time.time() - killed_at)
        slowest = max(t for _, _, t in ended.values())
        check(all(kind == "error" and code == ErrorCode.StageFailed
                  for kind, code, _ in ended.values()), f"after kill -9 of the gateway: {ended}")
        check(slowest < 10, f"the last open request ended {slowest:.1f} s after the kill")
        print(f"ok gateway: kill -9 -> every open request (Python SDK) got an explicit error "
              f"within {slowest:.2f} s")

        # The C++ SDK through `moeline load`: it must end every request and exit on its own.
        wait_for(lambda: healthy(stack, "gateway"), 60, "the gateway did not come back")
        load = subprocess.Popen(
            [args.moeline, "load", "--endpoint", stack.endpoint, "--model", args.model,
             "--concurrency", "4", "--duration-s", "6", "--prompt-tokens", "8",
             "--max-tokens", "200", "--json"], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
            text=True)
        time.sleep(2.5)
        killed_at = time.time()
        stack.kill("gateway")
        out, err = load.communicate(timeout=60)
        took = time.time() - killed_at
        report = json.loads(out.strip().splitlines()[-1])
        check(report["errors"] >= 1 and report["requests"] == report["completed"] +
              report["errors"], f"moeline load after a gateway kill: {report} {err[-400:]}")
        print(f"ok gateway: moeline load ended every request and exited {took:.1f} s after the "
              f"kill ({report['completed']} completed, {report['errors']} explicit errors)")
        wait_for(lambda: healthy(stack, "gateway"), 60, "the gateway did not come back")
        with Client(stack.endpoint, timeout=60) as client:
            served = client.generate(tokens=[1, 2, 3], max_tokens=3)
            check(len(served.ids) > 0, "not serving")
        # Decode replicas outlive the gateway and stream its dead requests' sequences to the next
        # one: a restarted gateway must not hand out an id an earlier life did.
        check(served.request_id > first_life_id + 1000,
              f"the third life's request id {served.request_id} is not past the first life's "
              f"{first_life_id}")
        print(f"ok gateway: the restarted gateway serves, with request ids past its first life's "
              f"({first_life_id} -> {served.request_id})")


def stream_all(stack, prompts, max_tokens, on_started):
    """Starts every prompt, calls on_started() once each has two tokens (the second is decode's:
    every sequence is then held by a decode replica, not on its way to one), and collects the
    ids."""
    from moeline_client import Client
    with Client(stack.endpoint, timeout=120) as client:
        crids = {client.start(tokens=p, max_tokens=max_tokens, ignore_eos=True): i
                 for i, p in enumerate(prompts)}
        ids = {i: [] for i in range(len(prompts))}
        errors, done, started = {}, set(), set()
        fired = False
        while len(done) < len(prompts):
            event = client.next_event(timeout=120)
            i = crids[event.client_request_id]
            if event.kind == "delta":
                ids[i] += event.token_ids
                if len(ids[i]) >= 2:
                    started.add(i)
            elif event.kind == "error":
                errors[i] = event.error_message
            if event.terminal:
                done.add(i)
            if not fired and len(started) == len(prompts):
                fired = True
                on_started()
    return [ids[i] for i in range(len(prompts))], errors


def case_drain(args):
    prompts = [[20 + i, 21, 22] for i in range(6)]
    for grace_ms, max_tokens in ((30000, 40), (0, 500)):
        expected = [reference(args.moeline, args.model, max_tokens, tokens=p,
                              ignore_eos=True)["ids"] for p in prompts]
        run = os.path.join(args.workdir, f"drain-{grace_ms}")
        # --max-retries 0: a drain is no failure, so a request it moves to another replica must
        # not need one of its retries, and the only way to finish every request is that none
        # was lost on the way (a hand-over arriving as the replica leaves included).
        config = {"heartbeat-ms": 100, "peer-timeout-ms": 1500,
                  "decode": {"drain-grace-ms": grace_ms}, "gateway": {"max-retries": 0}}
        with Stack(args.moeline, args.model, run, decode=2, config=config) as stack:
            victim = {}

            def term():
                victim["pid"] = stack.kill("decode-0", signal.SIGTERM)
            if grace_ms >= 30000:
                got, errors = stream_all(stack, prompts, max_tokens, term)
            else:
                # No grace: SIGTERM as soon as decode-0 holds a sequence, by its own gauge (read
                # from its /metrics text without parsing the rest, to poll often). On two busy
                # cores the client can see the second token of every stream only after a replica
                # has decoded them all (the gateway and the client share the cores with the
                # stages), so waiting for that can leave nothing to hand back.
                url = f"http://127.0.0.1:{stack.http_port('decode-0')}/metrics"
                active = re.compile(r"^moeline_decode_active_sequences(?:\{[^}]*\})? (\S+)$",
                                    re.MULTILINE)
                polls = {"n": 0, "errors": []}

                def when_decode_0_holds_one():
                    deadline = time.time() + 60
                    while time.time() < deadline and "pid" not in victim:
                        polls["n"] += 1
                        try:
                            with urllib.request.urlopen(url, timeout=5) as response:
                                found = active.search(response.read().decode())
                            if found and float(found.group(1)) >= 1:
                                term()
                                return
                        except OSError as e:
                            polls["errors"].append(repr(e))
                        time.sleep(0.001)
                watcher = threading.Thread(target=when_decode_0_holds_one)
                watcher.start()
                got, errors = stream_all(stack, prompts, max_tokens, lambda: None)
                watcher.join()
                check("pid" in victim, f"decode-0 never held a sequence ({polls['n']} polls, "
                      f"errors {polls['errors'][-3:]})")
            check(not errors and got == expected,
                  f"grace {grace_ms} ms: outputs after SIGTERM of a decode replica differ or "
                  f"failed: {errors}")
            stack.wait_restarted("decode-0", victim["pid"])
            with open(os.path.join(run, "logs", "decode-0.log"), errors="replace") as f:
                log = f.read()
            check("event=drain_started" in log and "event=drained" in log,
                  "decode-0 did not log its drain")
            handed = stack.metric("gateway", "moeline_gateway_handed_back_total")
            retried = stack.metric("gateway", "moeline_gateway_retries_total")
            if grace_ms >= 30000:
                check(handed == 0 and retried == 0,
                      f"a drain within its grace lost or retried work: handed back {handed}, "
                      f"retried {retried}")
                print("ok drain: SIGTERM of a decode replica under load: it finished every "
                      "sequence it held (nothing handed back or retried); outputs identical")
            else:
                check(handed >= 1, f"past the grace period sequences must be handed back: {handed}")
                check(retried == handed, f"with no grace, {retried:.0f} requests were moved but "
                      f"only {handed:.0f} handed back: the rest were lost on the way and retried")
                print(f"ok drain: with no grace and --max-retries 0, {handed:.0f} sequences were "
                      "handed back and finished elsewhere, identical to moeline run; nothing was "
                      "retried for a failure")


CASES = {"store": case_store, "probe": case_probe, "gateway": case_gateway, "drain": case_drain}


def main():
    run_cases(CASES, __doc__)


if __name__ == "__main__":
    main()
