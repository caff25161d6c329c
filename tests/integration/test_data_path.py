#!/usr/bin/env python3
"""Bulk data peer to peer, with real processes: prefill hands a prompt's KV straight to the decode
replica the gateway picked, and its snapshot puts straight to the probe; the gateway only brokers.

Cases (--case, one per CTest entry):
  handover        mixed concurrent requests over 2 decode replicas: ids identical to `moeline run`;
                  every request that goes on past its first token is handed over directly (the
                  decode replicas' accepted hand-overs), no snapshot put reaches the gateway, and
                  the bytes through the gateway per request stay under 64 KiB whatever the
                  prompt's length (only its token ids grow it, never its KV); the expert-usage
                  reports go to the offload manager's intake, none through the gateway; on
                  one node the KV and the puts go through shared memory (--shm-handover, here a
                  folder of the test's own), and no transfer's file is left behind
  handover_socket the same with --shm-handover off: identical ids, every hand-over through the
                  intakes' sockets, none through shared memory
  handover_lost   a decode replica that stops before the hand-overs sent to it arrive (SIGSTOP,
                  then kill -9), and one killed after it has taken hand-overs: every request
                  completes identical to the reference (the retry policy's give-up the only error
                  allowed), none hangs
  trace           one request that reuses nothing, traced by the stages themselves
                  (--trace-requests): the messages on its path before its first token, at most 5
                  (GenerateRequest, ProbeJob, PrefillJob from the probe to prefill's intake,
                  PrefillDone, the first StreamEvent delta), and its KV never through the gateway
  probe_shards    two probes (--probe 2): every request of a namespace is looked up by one probe
                  and its entries stored there (the stages' traces), the namespaces are spread
                  over both, and a repeated request hits the result its first run stored
  probe_lost      one of two probes stops (SIGSTOP, then kill -9) while requests of its namespaces
                  are sent to it: every request completes identical to the reference, moved to
                  the other probe once the hub drops it; none hangs
  forged          a process that reaches a decode replica's, the probe's or the offload manager's
                  intake without a ticket: its hand-overs, puts and usage reports are refused and
                  counted, the requests in flight are untouched and the stages keep serving
"""

import os
import random
import signal
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from stack_harness import Stack, recovery_errors, reference, run_cases, run_concurrently  # noqa: E402
from test_stack import FAST_FAILURE, check, compare, references, vocab_of, workload  # noqa: E402

MAX_GATEWAY_BYTES = 64 * 1024


def sample(stack, name, metric, **labels):
    return stack.metric(name, metric, created_on_first_event=True, **labels)


def wait_until(condition, message, timeout=10):
    deadline = time.time() + timeout
    while not condition():
        check(time.time() < deadline, message)
        time.sleep(0.1)


# What one request moves through the gateway's hub (heartbeats, credits and expert-usage reports
# are the stack's own traffic, not the request's).
REQUEST_TYPES = ("ProbeJob", "ProbePlan", "PrefillJob", "PrefillDone", "HandoverAccepted",
                 "TokenBatch", "SnapshotPut", "JobFailed", "CancelJob")


def hub_bytes(stack):
    metrics = stack.metrics("gateway")
    return sum(value for (name, labels), value in metrics.items()
               if name == "moeline_hub_bytes_total" and dict(labels).get("type") in REQUEST_TYPES)


def handed_over(stack, decodes):
    return sum(sample(stack, f"decode-{i}", "moeline_decode_handovers_total", outcome="accepted")
               for i in range(decodes))


def shm_transfers(stack, names):
    return sum(sample(stack, name, "moeline_shm_handover_total", direction="received")
               for name in names)


def case_handover(args, shared_memory=True):
    from moeline_client import Client
    import shutil
    rng = random.Random(11)
    vocab = vocab_of(args.model)
    requests = workload(vocab, 24, seed=23)
    for request in requests:
        request["reuse"] = "none"  # every request computed (a probe's full hit is another path)
    expected = references(args, requests)
    continuing = sum(1 for want in expected if len(want["ids"]) > 1)
    run_dir = os.path.join(args.workdir, "handover" if shared_memory else "handover-socket")
    shm_dir = os.path.join("/dev/shm" if os.path.isdir("/dev/shm") else args.workdir,
                           f"moeline-test-{os.getpid()}")
    shutil.rmtree(shm_dir, ignore_errors=True)
    config = {"shm-handover": shm_dir if shared_memory else "off"}
    with Stack(args.moeline, args.model, run_dir, decode=2, config=config) as stack:
        with Client(stack.endpoint, timeout=120) as client:
            results = run_concurrently(client, requests)
            compare(results, requests, expected)
            # The hub counts messages by type: a prefill job carries one or more requests, and
            # each is answered by one PrefillDone.
            jobs = sample(stack, "gateway", "moeline_hub_messages_total", direction="out",
                          type="PrefillJob")
            done = sample(stack, "gateway", "moeline_hub_messages_total", direction="in",
                          type="PrefillDone")
            print(f"hub messages: {jobs:.0f} PrefillJob out, {done:.0f} PrefillDone in, "
                  f"{len(requests)} requests")
            check(1 <= jobs <= len(requests) and done == len(requests),
                  f"{jobs:.0f} PrefillJob and {done:.0f} PrefillDone for {len(requests)} requests")
            # A job's credit rides on its result (schema 1.14): the probe's, prefill's and
            # decode's finished jobs hand theirs back without a Credit message of their own (the
            # few left: what the compute stages free at start, once their expert plan is in).
            credit_messages = sample(stack, "gateway", "moeline_hub_messages_total",
                                     direction="in", type="Credit")
            in_envelopes = sample(stack, "gateway", "moeline_hub_credits_total",
                                  carried_by="envelope")
            print(f"credit: {in_envelopes:.0f} in envelopes, {credit_messages:.0f} Credit "
                  f"messages, {len(requests)} requests")
            check(in_envelopes >= jobs + continuing,
                  f"{in_envelopes:.0f} credits in envelopes for {len(requests)} requests")
            check(credit_messages < len(requests) / 2,
                  f"{credit_messages:.0f} Credit messages for {len(requests)} requests")
            accepted = handed_over(stack, 2)
            check(accepted == continuing, f"{accepted} hand-overs accepted for {continuing} "
                  "requests that went on past their first token")
            through_shm = shm_transfers(stack, ["decode-0", "decode-1"])
            if shared_memory:
                # Every KV of 64 KiB or more (the default --shm-handover-min-bytes) on this model.
                check(through_shm >= 1, "no hand-over went through shared memory on one node")
            else:
                check(through_shm == 0, f"{through_shm} hand-overs through shared memory with "
                      "--shm-handover off")
            check(sample(stack, "gateway", "moeline_gateway_stage_messages_refused_total",
                         reason="sent_to_the_gateway", type="SnapshotPut") == 0,
                  "prefill sent snapshot puts to the gateway")
            # The compute stages report expert usage to the offload manager's intake, not
            # through the gateway (each process reports once a second while it computes).
            wait_until(lambda: sample(stack, "offload", "moeline_offload_routed_tokens_total") > 0,
                       "the offload manager received no usage report")
            usage_through_hub = sample(stack, "gateway", "moeline_hub_bytes_total",
                                       direction="in", type="ExpertUsage")
            check(usage_through_hub == 0,
                  f"{usage_through_hub:.0f} bytes of usage reports went through the gateway")
            # With reuse on, what prefill computed reaches the probe's store directly.
            puts_before = sample(stack, "probe", "moeline_probe_store_puts_total")
            client.generate(tokens=[rng.randrange(vocab) for _ in range(40)], max_tokens=2)
            wait_until(lambda: sample(stack, "probe", "moeline_probe_store_puts_total") >
                       puts_before, "the probe received no snapshot put from prefill")
            if shared_memory:
                check(shm_transfers(stack, ["probe"]) >= 1,
                      "no snapshot put reached the probe through shared memory")
            # Bytes through the gateway for one request, a short prompt and one 30x longer.
            carried = {}
            for length in (16, 480):
                tokens = [rng.randrange(vocab) for _ in range(length)]
                before = hub_bytes(stack)
                client.generate(tokens=tokens, max_tokens=8, ignore_eos=True, reuse="none")
                time.sleep(0.3)  # the last heartbeats and credits of the request
                carried[length] = hub_bytes(stack) - before
            for length, carried_bytes in carried.items():
                check(carried_bytes < MAX_GATEWAY_BYTES, f"a request with a {length}-token prompt "
                      f"moved {carried_bytes:.0f} bytes through the gateway")
            # The prompt's ids cross the gateway in ProbeJob and PrefillJob (4 bytes each); its
            # KV (here 6 layers x 2 x kv_heads x head_dim x 4 bytes a token) must not.
            grown = carried[480] - carried[16]
            check(grown < 2 * 4 * 464 + 1024, f"a 464-token longer prompt moved {grown:.0f} more "
                  "bytes through the gateway: its KV crossed it")
            through_shm = shm_transfers(stack, ["decode-0", "decode-1", "probe"])
    if shared_memory:
        left = os.listdir(shm_dir)
        shutil.rmtree(shm_dir, ignore_errors=True)
        check(not left, f"transfer files left behind in the shared-memory folder: {left}")
    print(f"ok handover{'' if shared_memory else '_socket'}: {len(requests)} requests identical to "
          f"the reference, {int(accepted)} handed over directly to 2 decode replicas, "
          f"{int(through_shm)} transfers through shared memory, bytes through the gateway per "
          f"request {carried[16]:.0f} (16-token prompt) and {carried[480]:.0f} (480 tokens)")


def case_handover_socket(args):
    case_handover(args, shared_memory=False)


def run_while_stopped(stack, client, requests, name):
    """Streams every request while stage `name` is stopped (SIGSTOP: alive but silent), then
    kills it (kill -9; the supervisor restarts it). Returns the results and its pid."""
    stopped = stack.kill(name, signal.SIGSTOP)
    try:
        return run_concurrently(client, requests), stopped
    finally:
        try:
            os.kill(stopped, signal.SIGKILL)
        except ProcessLookupError:
            pass  # a slow run (sanitizers): the supervisor found it unhealthy and replaced it first


def case_handover_lost(args):
    from moeline_client import Client
    vocab = vocab_of(args.model)
    rng = random.Random(5)
    requests = [{"tokens": [rng.randrange(vocab) for _ in range(rng.choice([40, 100, 200]))],
                 "max_tokens": 24, "ignore_eos": True, "reuse": "none"} for _ in range(12)]
    expected = references(args, requests)
    run_dir = os.path.join(args.workdir, "handover-lost")
    with Stack(args.moeline, args.model, run_dir, decode=2, config=dict(FAST_FAILURE)) as stack:
        with Client(stack.endpoint, timeout=120) as client:
            # Before: decode-0 stops while the hub still counts its credit, so about half of the
            # hand-overs go to a process that never reads them; the gateway must notice and
            # retry them on decode-1.
            results, stopped = run_while_stopped(stack, client, requests, "decode-0")
            retries = sample(stack, "gateway", "moeline_gateway_retries_total")
            check(retries >= 1, "no hand-over to the stopped decode replica was retried")
            given_up = recovery_errors(results, retries, "decode stopped before the hand-over")
            completed = compare(results, requests, expected, allow_errors=True)
            check(completed + given_up == len(requests), "requests lost with the hand-over")
            print(f"ok handover_lost (before the KV): {completed} completed identical to the "
                  f"reference, {given_up} gave up, {int(retries)} retried")
            stack.wait_restarted("decode-0", stopped)

            # After: decode-1 is killed once it has taken hand-overs and streams them. Long
            # streams (prompt and answer within the context of 512), so that on a busy machine
            # decode-1 is still streaming when the harness has seen a token of every request.
            requests = [dict(r, max_tokens=300) for r in requests]
            expected = references(args, requests)
            accepted_before = sample(stack, "decode-1", "moeline_decode_handovers_total",
                                     outcome="accepted")
            killed = {}

            def kill_decode_1(deltas):
                if killed or deltas < len(requests):
                    return
                if sample(stack, "decode-1", "moeline_decode_handovers_total",
                          outcome="accepted") > accepted_before:
                    killed["pid"] = stack.kill("decode-1")

            retries_before = sample(stack, "gateway", "moeline_gateway_retries_total")
            results = run_concurrently(client, requests, on_delta=kill_decode_1)
            check(killed, "decode-1 took no hand-over: nothing to kill")
            retried = sample(stack, "gateway", "moeline_gateway_retries_total") - retries_before
            check(retried >= 1, "nothing was retried after decode-1 died")
            given_up = recovery_errors(results, retried, "decode killed after the hand-over")
            completed = compare(results, requests, expected, allow_errors=True)
            check(completed + given_up == len(requests), "requests lost with decode-1")
            print(f"ok handover_lost (after the KV): {completed} completed identical to the "
                  f"reference, {given_up} gave up, {int(retried)} retried")


def forged_prefill_done(request_id, ticket, kv_bytes=64):
    import flatbuffers
    from moeline_client import encode_message
    from moeline.wire import BulkFrame, MessageType, PrefillDone
    b = flatbuffers.Builder(256)
    PrefillDone.StartTokensVector(b, 1)
    b.PrependInt32(1)
    tokens = b.EndVector()
    ticket_vector = b.CreateByteVector(ticket) if ticket is not None else None
    BulkFrame.Start(b)
    BulkFrame.AddBytes(b, kv_bytes)
    frame = BulkFrame.End(b)
    PrefillDone.StartFramesVector(b, 1)
    b.PrependUOffsetTRelative(frame)
    frames = b.EndVector()
    PrefillDone.Start(b)
    PrefillDone.AddRequestId(b, request_id)
    PrefillDone.AddAttempt(b, 1)
    PrefillDone.AddTokens(b, tokens)
    PrefillDone.AddFirstToken(b, 7)
    PrefillDone.AddFrames(b, frames)
    if ticket_vector is not None:
        PrefillDone.AddTicket(b, ticket_vector)
    b.Finish(PrefillDone.End(b), file_identifier=b"MLPL")
    return encode_message(MessageType.MessageType.PrefillDone, b.Output()) + [b"\0" * kv_bytes]


def forged_usage(reporter, ticket):
    """An ExpertUsage claiming 10^9 tokens on the demo model's shape, with or without a ticket."""
    import flatbuffers
    from moeline_client import encode_message
    from moeline.wire import ExpertUsage, MessageType
    b = flatbuffers.Builder(256)
    name = b.CreateString(reporter) if reporter else None
    ticket_vector = b.CreateByteVector(ticket) if ticket is not None else None
    ExpertUsage.Start(b)
    ExpertUsage.AddLayers(b, 1)
    ExpertUsage.AddExperts(b, 1)
    ExpertUsage.AddTokens(b, 10**9)
    if name is not None:
        ExpertUsage.AddReporter(b, name)
    if ticket_vector is not None:
        ExpertUsage.AddTicket(b, ticket_vector)
    b.Finish(ExpertUsage.End(b), file_identifier=b"MLOF")
    return encode_message(MessageType.MessageType.ExpertUsage, b.Output())


def case_forged(args):
    from moeline_client import Client
    from peer_frames import dealer
    from test_security import snapshot_put
    vocab = vocab_of(args.model)
    victim = {"tokens": [(7 * i) % vocab for i in range(60)], "max_tokens": 40, "ignore_eos": True}
    expected = reference(args.moeline, args.model, 40, tokens=victim["tokens"], ignore_eos=True)
    run_dir = os.path.join(args.workdir, "forged")
    with Stack(args.moeline, args.model, run_dir) as stack:
        decode = dealer(stack.intakes()["decode-0"])
        probe = dealer(stack.intakes()["probe"])
        offload = dealer(stack.intakes()["offload"])
        with Client(stack.endpoint, timeout=60) as client:
            crid = client.start(**victim)
            # Request ids are small integers: a rogue tries them all, with no ticket and with a
            # made-up one, while the victim's request streams.
            sent = 0
            for request_id in range(1, 33):
                for ticket in (None, bytes(32), os.urandom(32)):
                    decode.send_multipart(forged_prefill_done(request_id, ticket))
                    sent += 1
            probe.send_multipart(snapshot_put(0x1234))
            # Usage reports that would skew the router statistics: no ticket, a made-up one, and
            # a real reporter's name with a made-up ticket.
            routed_before = sample(stack, "offload", "moeline_offload_routed_tokens_total")
            for reporter, ticket in ((None, None), ("decode-0", os.urandom(32)),
                                     ("prefill-0", bytes(32))):
                offload.send_multipart(forged_usage(reporter, ticket))
            ids = []
            while True:
                event = client.next_event(timeout=60)
                check(event.client_request_id == crid, "an unexpected event")
                check(event.kind != "error", f"the victim's request failed: {event}")
                if event.kind == "delta":
                    ids += event.token_ids
                if event.terminal:
                    break
            check(ids == expected["ids"], f"the victim's stream changed: {ids} != "
                  f"{expected['ids']}")
            deadline = time.time() + 10
            refused = 0
            while time.time() < deadline:
                refused = sample(stack, "decode-0", "moeline_intake_refused_total",
                                 reason="bad_ticket", type="PrefillDone")
                if refused >= sent:
                    break
                time.sleep(0.2)
            check(refused == sent, f"decode refused {refused:.0f} of {sent} forged hand-overs")
            check(sample(stack, "probe", "moeline_intake_refused_total", reason="bad_ticket",
                         type="SnapshotPut") == 1, "the probe took a put without a ticket")
            wait_until(lambda: sample(stack, "offload", "moeline_intake_refused_total",
                                      reason="bad_ticket", type="ExpertUsage") == 3,
                       "the offload manager did not refuse the 3 forged usage reports")
            # Real reports keep arriving while the victim streams; a forged one would add 10^9.
            check(sample(stack, "offload", "moeline_offload_routed_tokens_total") - routed_before
                  < 10**9, "a forged usage report was counted")
            check(client.generate(tokens=[1, 2, 3], max_tokens=3).ids, "the stack stopped serving")
        decode.close()
        probe.close()
        offload.close()
    print(f"ok forged: {sent} forged hand-overs, a forged put and 3 forged usage reports refused "
          "and counted, the victim's stream identical to the reference")


def traced(stack, request_id, replicas=False):
    """Every `event=trace` line of one request across the stages' logs, in time order:
    [(unix_us, receiving stage, message, via)], and the replica with `replicas`."""
    events = []
    logs = os.path.join(stack.run_dir, "logs")
    for name in os.listdir(logs):
        with open(os.path.join(logs, name), errors="replace") as f:
            for line in f:
                if "event=trace" not in line:
                    continue
                fields = dict(field.split("=", 1) for field in line.split() if "=" in field)
                if int(fields["request_id"]) == request_id:
                    event = (int(fields["unix_us"]), fields["stage"], fields["message"],
                             fields["via"])
                    events.append(event + (fields["replica"],) if replicas else event)
    return sorted(events)


def case_trace(args):
    from moeline_client import Client
    vocab = vocab_of(args.model)
    tokens = [(13 * i + 5) % vocab for i in range(48)]
    run_dir = os.path.join(args.workdir, "trace")
    with Stack(args.moeline, args.model, run_dir, config={"trace-requests": True}) as stack:
        with Client(stack.endpoint, timeout=60) as client:
            result = client.generate(tokens=tokens, max_tokens=4, ignore_eos=True)
            request_id = result.request_id
        time.sleep(0.5)
        events = traced(stack, request_id)
    check(events, f"no trace of request {request_id}")
    first = next(i for i, e in enumerate(events) if e[2] == "StreamEvent:Delta")
    before = events[:first + 1]
    path = [(stage, message, via) for _, stage, message, via in before]
    # The probe's notice of its plan reaches the gateway beside the critical path (nothing waits
    # for it), and so may decode's confirmation; they are listed, not counted.
    beside = {("gateway", "ProbePlan", "hub"), ("gateway", "HandoverAccepted", "hub"),
              ("gateway", "StreamEvent:Accepted", "client"),
              ("probe", "SnapshotPut", "intake"), ("decode", "PrefillDone", "intake")}
    critical = [p for p in path if p not in beside]
    want = [("gateway", "GenerateRequest", "client"), ("probe", "ProbeJob", "link"),
            ("prefill", "PrefillJob", "intake"), ("gateway", "PrefillDone", "hub"),
            ("gateway", "StreamEvent:Delta", "client")]
    check(critical == want, f"the path before the first token is {critical}, not {want}")
    check(len(critical) <= 5, f"{len(critical)} messages before the first token")
    start = before[0][0]
    print(f"ok trace: request {request_id}, {len(critical)} messages before its first token:")
    for unix_us, stage, message, via in events:
        mark = "  " if (stage, message, via) in want else "+ "
        # The gateway logs the events it sends its client; every other line is what a stage got.
        to = "client" if message.startswith("StreamEvent") else stage
        print(f"  {mark}{(unix_us - start) / 1000:8.3f} ms  {to:8} <- {message} ({via})")


def case_probe_shards(args):
    from moeline_client import Client
    vocab = vocab_of(args.model)
    tenants = [f"t{i}" for i in range(12)]
    run_dir = os.path.join(args.workdir, "probe-shards")
    owner = {}
    with Stack(args.moeline, args.model, run_dir, config={"trace-requests": True},
               extra_args=["--probe", "2"]) as stack:
        with Client(stack.endpoint, timeout=60) as client:
            ids = {}
            for i, tenant in enumerate(tenants):
                tokens = [(31 * i + 7 * k) % vocab for k in range(40)]
                first = client.generate(tokens=tokens, max_tokens=4, tenant=tenant)
                time.sleep(0.2)  # the result record reaches the store
                again = client.generate(tokens=tokens, max_tokens=4, tenant=tenant)
                check(again.ids == first.ids, f"tenant {tenant}: the repeat differs")
                check(again.usage["reuse_level"] == "result", f"tenant {tenant}: the repeat was "
                      f"not served from its probe's store ({again.usage['reuse_level']})")
                ids[tenant] = [first.request_id, again.request_id]
        time.sleep(0.5)
        for tenant, request_ids in ids.items():
            probes = set()
            for request_id in request_ids:
                for _, stage, message, via, replica in traced(stack, request_id, replicas=True):
                    if stage == "probe" and message in ("ProbeJob", "SnapshotPut"):
                        probes.add(replica)
            check(len(probes) == 1, f"tenant {tenant} was looked up or stored on {probes}")
            owner[tenant] = probes.pop()
    used = sorted(set(owner.values()))
    check(used == ["probe-0", "probe-1"], f"the namespaces all went to {used}")
    shares = {p: sum(1 for o in owner.values() if o == p) for p in used}
    print(f"ok probe_shards: {len(tenants)} namespaces over 2 probes ({shares}), each namespace's "
          "lookups and puts on one probe, repeats served from its store")


def case_probe_lost(args):
    from moeline_client import Client
    vocab = vocab_of(args.model)
    requests = workload(vocab, 24, seed=41)
    for i, request in enumerate(requests):
        request["tenant"] = f"t{i % 6}"
    expected = references(args, requests)
    run_dir = os.path.join(args.workdir, "probe-lost")
    with Stack(args.moeline, args.model, run_dir, config=dict(FAST_FAILURE),
               extra_args=["--probe", "2"]) as stack:
        with Client(stack.endpoint, timeout=120) as client:
            # probe-1 stops answering (and then dies) while requests of its namespaces are sent to
            # it: they must move to probe-0 once the hub drops it, and complete.
            results, stopped = run_while_stopped(stack, client, requests, "probe-1")
            moved = (sample(stack, "gateway", "moeline_gateway_retries_total") +
                     sample(stack, "gateway", "moeline_gateway_probe_bypassed_total"))
            check(moved >= 1, "no request was sent to the stopped probe: nothing was tested")
            given_up = recovery_errors(results, moved, "probe-1 lost")
            completed = compare(results, requests, expected, allow_errors=True)
            check(completed + given_up == len(requests), "requests lost with probe-1")
            stack.wait_restarted("probe-1", stopped)
            check(client.generate(tokens=[1, 2, 3], max_tokens=3, tenant="t1").ids,
                  "the stack does not serve after probe-1 came back")
    print(f"ok probe_lost: probe-1 stopped, then killed, under load: {completed} completed "
          f"identical to the reference, {given_up} gave up, {int(moved)} moved to probe-0")


CASES = {"handover": case_handover, "handover_socket": case_handover_socket, "handover_lost": case_handover_lost, "forged": case_forged,
         "trace": case_trace, "probe_shards": case_probe_shards, "probe_lost": case_probe_lost}


def main():
    run_cases(CASES, __doc__)


if __name__ == "__main__":
    main()
