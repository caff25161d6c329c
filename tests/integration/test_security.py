#!/usr/bin/env python3
"""Trust boundaries with real processes: each case is an attack an earlier version let through,
made against a real stack (`moeline stack up`), and what must happen instead.

Cases (--case, one per CTest entry):
  input    one request must not take a stage down: max_tokens 2^63-1 (decode crashed), a control
           command whose tenant is a number (the gateway crashed), a 1 MiB prompt (tokenized before
           it was refused), a frame past the hub's size limit from a peer that never said hello,
           credits that would wrap; and a stage that answers jobs it was never given (its tokens
           reached the victim's stream): dropped and counted, the victim's output is the
           reference's. Every stage keeps its pid.
  ipc      the local default: the run directory is its owner's alone (0700) and its sockets 0600,
           so another user cannot reach the hub or the client endpoint.
  curve    `stack up --transport tcp`: Curve on every tcp:// socket; a client with the server key
           is served identically to `moeline run`; a stage key not on the allow-list, and an
           allowed key saying hello as another stage, are refused and learn nothing; a snapshot put
           from a non-prefill stage is dropped; a stage whose settings hash differs is refused; a
           job, hand-over or put sent straight to a stage's intake with a ticket the gateway did
           not sign is dropped and counted.
  apikeys  `stack up --api-keys FILE`: no key and a wrong key are Unauthenticated, a key used for
           another tenant is Forbidden, a user key may not run operator commands, tenants' caches
           stay apart, and a tenant over its in-flight limit is refused while another is served.
  health   200 slow connections on a stage's HTTP port do not get it killed by the supervisor.
"""

import json
import os
import socket
import stat
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from peer_frames import dealer, gateway_logged, hello, settings_hash  # noqa: E402
from stack_harness import Stack, reference, run_cases, wait_for  # noqa: E402


def check(condition, message):
    if not condition:
        raise AssertionError(message)


def pids(stack):
    return {s["name"]: s["pid"] for s in stack.state()["stages"]}


def restarts(stack):
    return {s["name"]: s["restarts"] for s in stack.state()["stages"]}


def credit(n):
    import flatbuffers
    from moeline_client import encode_message
    from moeline.wire import Credit, MessageType
    b = flatbuffers.Builder(32)
    Credit.Start(b)
    Credit.AddCredits(b, n)
    b.Finish(Credit.End(b), file_identifier=b"MLCM")
    return encode_message(MessageType.MessageType.Credit, b.Output())


def token_batch(updates):
    """TokenBatch of (request_id, attempt, token) triples."""
    import flatbuffers
    from moeline_client import encode_message
    from moeline.wire import MessageType, TokenBatch, TokenUpdate
    b = flatbuffers.Builder(256)
    offsets = []
    for request_id, attempt, token in updates:
        TokenUpdate.Start(b)
        TokenUpdate.AddRequestId(b, request_id)
        TokenUpdate.AddAttempt(b, attempt)
        TokenUpdate.AddToken(b, token)
        offsets.append(TokenUpdate.End(b))
    TokenBatch.StartUpdatesVector(b, len(offsets))
    for offset in reversed(offsets):
        b.PrependUOffsetTRelative(offset)
    vector = b.EndVector()
    TokenBatch.Start(b)
    TokenBatch.AddUpdates(b, vector)
    TokenBatch.AddBatchSize(b, len(updates))
    b.Finish(TokenBatch.End(b), file_identifier=b"MLPL")
    return encode_message(MessageType.MessageType.TokenBatch, b.Output())


def snapshot_put(key):
    import flatbuffers
    from moeline_client import encode_message
    from moeline.wire import MessageType, SnapshotEntry, SnapshotPut
    b = flatbuffers.Builder(64)
    SnapshotEntry.Start(b)
    SnapshotEntry.AddKey(b, key)
    SnapshotEntry.AddKind(b, ord("R"))
    entry = SnapshotEntry.End(b)
    SnapshotPut.StartEntriesVector(b, 1)
    b.PrependUOffsetTRelative(entry)
    entries = b.EndVector()
    SnapshotPut.Start(b)
    SnapshotPut.AddEntries(b, entries)
    b.Finish(SnapshotPut.End(b), file_identifier=b"MLPL")
    return encode_message(MessageType.MessageType.SnapshotPut, b.Output())


def forged(kind, request_id=7, attempt=1):
    """A `kind` message (one an intake takes: PrefillJob, PrefillDone, SnapshotPut) for a job this
    test was never given, with a ticket of the right length that no gateway signed."""
    import importlib
    import flatbuffers
    from moeline_client import encode_message
    from moeline.wire import MessageType
    table = importlib.import_module(f"moeline.wire.{kind}")
    b = flatbuffers.Builder(128)
    ticket = b.CreateByteVector(os.urandom(32))
    table.Start(b)
    table.AddRequestId(b, request_id)
    table.AddAttempt(b, attempt)
    table.AddTicket(b, ticket)
    b.Finish(table.End(b), file_identifier=b"MLPL")
    return encode_message(getattr(MessageType.MessageType, kind), b.Output())


def receive(sock, message_type, table, wanted=lambda body: True, timeout=10):
    """The body (as `table`) of the first message of `message_type` that `wanted` accepts, or None
    when none came within `timeout` seconds; other messages are skipped."""
    import zmq
    from moeline_client import decode_message
    deadline = time.time() + timeout
    usual_timeout = sock.getsockopt(zmq.RCVTIMEO)
    try:
        while time.time() < deadline:
            sock.setsockopt(zmq.RCVTIMEO, max(1, int((deadline - time.time()) * 1000)))
            try:
                message = decode_message(sock.recv_multipart())
            except zmq.Again:
                return None
            if message.type == message_type:
                body = table.GetRootAs(message.body, 0)
                if wanted(body):
                    return body
        return None
    finally:
        sock.setsockopt(zmq.RCVTIMEO, usual_timeout)


def hello_reply(sock, timeout=10):
    """(accepted, reason, settings hash) of the hub's answer, or None when it said nothing within
    `timeout` seconds (long enough for a Curve handshake on a busy machine where an answer is
    expected; the caller that expects none may wait less)."""
    from moeline.wire import HelloReply, MessageType
    reply = receive(sock, MessageType.MessageType.HelloReply, HelloReply.HelloReply,
                    timeout=timeout)
    if reply is None:
        return None
    return reply.Accepted(), (reply.Reason() or b"").decode(), reply.SettingsHash()


def rss_kib(pid):
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    return 0


FAST = {"heartbeat-ms": 100, "peer-timeout-ms": 1500}


def case_input(args):
    from moeline_client import Client, ControlError, GenerateError
    from moeline.wire import ErrorCode, StageKind
    E, K = ErrorCode.ErrorCode, StageKind.StageKind
    run = os.path.join(args.workdir, "input")
    with Stack(args.moeline, args.model, run, config=FAST) as stack:
        before = pids(stack)
        client = Client(stack.endpoint, timeout=60)

        # max_tokens 2^63-1: decode summed it with the prompt length and crashed (three times, as
        # the gateway retried). Past the context it is refused; up to it, capped and served.
        try:
            client.generate(tokens=[5, 6, 7], max_tokens=2**63 - 1)
            raise AssertionError("max_tokens 2^63-1 was accepted")
        except GenerateError as e:
            check(e.code == E.InvalidRequest and "context" in e.message,
                  f"max_tokens 2^63-1: {e.code_name}: {e.message}")
            print(f"ok input: max_tokens 2^63-1 refused: {e.message}")
        context = json.load(open(os.path.join(args.model, "config.json")))["max_position_embeddings"]
        result = client.generate(tokens=[5, 6, 7], max_tokens=context, ignore_eos=True)
        check(result.finish_reason == "length" and len(result.ids) == context - 3,
              f"max_tokens {context}: {result.finish_reason}, {len(result.ids)} tokens")
        print(f"ok input: max_tokens {context} with a 3-token prompt capped to {len(result.ids)}, "
              "served; decode alive")

        # A control command whose tenant is a number: a JSON type error killed the gateway.
        try:
            client.control("reuse", json.dumps({"levels": "all", "tenant": 7}))
            raise AssertionError("a numeric tenant was accepted")
        except ControlError as e:
            check("tenant" in str(e), f"the refusal should name the field: {e}")
            print(f"ok input: numeric tenant refused: {e}")

        # A 1 MiB prompt is refused by its byte length, before the tokenizer sees it.
        try:
            client.generate(prompt="a" * (1 << 20), max_tokens=1)
            raise AssertionError("a 1 MiB prompt was accepted")
        except GenerateError as e:
            check(e.code == E.PromptTooLong and "bytes" in e.message,
                  f"1 MiB prompt: {e.code_name}: {e.message}")
            print(f"ok input: 1 MiB prompt refused before tokenizing: {e.message}")

        # A frame past the hub's limit from a peer that never said hello: dropped by ZeroMQ
        # before it is buffered (a 1 GiB one grew the gateway to 1.3 GB).
        hub = stack.state()["hub"]
        gateway = before["gateway"]
        rss_before = rss_kib(gateway)
        limit_bytes = gateway_logged(stack, "hub_max_message_bytes") + (1 << 20)
        big = dealer(hub)
        big.send_multipart([b"x" * 16, b"y" * limit_bytes])
        time.sleep(3)
        big.close()
        grown = rss_kib(gateway) - rss_before
        check(grown < (limit_bytes >> 10) // 2,
              f"the gateway grew by {grown} KiB on a {limit_bytes >> 20} MiB frame")
        print(f"ok input: a {limit_bytes >> 20} MiB frame grew the gateway by {grown} KiB")

        # A peer accepted as a decode stage (on an open ipc:// stack the settings hash is all it
        # needs) floods credits, then answers jobs it was never given.
        rogue = dealer(hub, identity=b"rogue-decode")
        rogue.send_multipart(hello(K.Decode, settings_hash(stack), credits=0))
        reply = hello_reply(rogue)
        check(reply is not None and reply[0], f"the rogue's hello should be accepted here: {reply}")
        for _ in range(3):
            rogue.send_multipart(credit(0xFFFFFFFF))
        time.sleep(0.5)
        status = client.control("status")
        rogue_peer = [p for p in status["peers"] if p["replica"] == "rogue"]
        check(rogue_peer and rogue_peer[0]["credits"] <= (1 << 20),
              f"credits must saturate, not wrap: {rogue_peer}")
        print(f"ok input: credits saturate at {rogue_peer[0]['credits']}")
        # Take its credit away again (a hello resets it) so that no real job goes to it.
        rogue.send_multipart(hello(K.Decode, settings_hash(stack), credits=0))
        hello_reply(rogue)

        # Long enough to be in flight when the forged tokens arrive (a request that has ended
        # leaves nothing to forge for, and the forgery is then not even counted).
        expected = reference(args.moeline, args.model, 500, tokens=[9, 8, 7, 6], ignore_eos=True)
        crid = client.start(tokens=[9, 8, 7, 6], max_tokens=500, ignore_eos=True)
        ids, error = [], None
        first = client.next_event(timeout=60)
        request_id = first.request_id
        # The rogue sends no heartbeats: a slow run (a sanitizer build) may have dropped it by
        # now, and tokens from a peer the hub does not know are refused before the ownership
        # check this case is about. A new hello (credits 0) makes it a live peer again.
        rogue.send_multipart(hello(K.Decode, settings_hash(stack), credits=0))
        hello_reply(rogue)
        # Forged tokens for the victim's request (every attempt it could be on).
        for _ in range(5):
            rogue.send_multipart(token_batch([(request_id, a, 3) for a in (1, 2, 3)]))
        while True:
            event = client.next_event(timeout=60)
            if event.client_request_id != crid:
                continue
            if event.kind == "delta":
                ids += event.token_ids
            if event.kind == "error":
                error = event.error_message
            if event.kind in ("finished", "error"):
                break
        check(error is None and ids == expected["ids"],
              f"the victim's stream was changed: {ids} (error {error}), want {expected['ids']}")
        refused = stack.metric("gateway", "moeline_gateway_stage_messages_refused_total",
                               reason="not_owner", type="TokenBatch")
        check(refused >= 1, f"forged results should be counted, got {refused}")
        print(f"ok input: forged tokens from a peer that did not hold the job dropped "
              f"({refused:.0f} counted); the stream is the reference's")

        # Tokens for a request this gateway never had: what decode replicas that outlive a killed
        # gateway stream to the next one. The replica is told to drop the sequence (it decoded
        # for nobody until its max_tokens), and nothing else happens.
        from moeline.wire import CancelJob, MessageType
        orphan = request_id + (1 << 40)
        rogue.send_multipart(hello(K.Decode, settings_hash(stack), credits=0))
        hello_reply(rogue)
        rogue.send_multipart(token_batch([(orphan, 2, 3)]))
        cancel = receive(rogue, MessageType.MessageType.CancelJob, CancelJob.CancelJob,
                         lambda c: c.RequestId() == orphan, timeout=10)
        check(cancel is not None and cancel.Attempt() == 2,
              "a decode replica streaming a request the gateway does not have was not told to "
              "drop it")
        cancelled = stack.metric("gateway", "moeline_gateway_orphan_streams_cancelled_total")
        check(cancelled >= 1, f"orphan sequences cancelled should be counted, got {cancelled}")
        print(f"ok input: tokens for a request the gateway does not have are answered with its "
              f"cancel ({cancelled:.0f} counted)")
        rogue.close()

        check(pids(stack) == before and not any(restarts(stack).values()),
              f"a stage died: {before} -> {pids(stack)}, restarts {restarts(stack)}")
        client.close()
        print("ok input: every stage kept its pid")


def case_ipc(args):
    run = os.path.join(args.workdir, "ipc")
    with Stack(args.moeline, args.model, run):
        mode = stat.S_IMODE(os.stat(run).st_mode)
        check(mode == 0o700, f"the run directory is {oct(mode)}, want 0o700")
        for name in ("hub.sock", "client.sock"):
            sock_mode = stat.S_IMODE(os.stat(os.path.join(run, name)).st_mode)
            check(sock_mode == 0o600, f"{name} is {oct(sock_mode)}, want 0o600")
        # Another user (nobody) tries to connect to the hub's and the client's sockets.
        probe = ("import socket, sys\n"
                 "for path in sys.argv[1:]:\n"
                 "    s = socket.socket(socket.AF_UNIX)\n"
                 "    try:\n"
                 "        s.connect(path); print('connected', path)\n"
                 "    except PermissionError:\n"
                 "        print('refused', path)\n")
        paths = [os.path.join(run, "hub.sock"), os.path.join(run, "client.sock")]
        if os.getuid() == 0:
            out = subprocess.run([sys.executable, "-c", probe, *paths], capture_output=True,
                                 text=True, timeout=30,
                                 preexec_fn=lambda: (os.setgid(65534), os.setuid(65534)))
            check(out.stdout.count("refused") == 2 and "connected" not in out.stdout,
                  f"another user reached the stack's sockets: {out.stdout} {out.stderr}")
            print("ok ipc: another user cannot connect to hub.sock or client.sock")
        else:
            print("ok ipc: modes checked (not root: the other-user connect is not tried)")


def keys_dir(stack):
    return os.path.join(stack.run_dir, "keys")


def read_key(path):
    with open(path) as f:
        return json.load(f)


def case_curve(args):
    import zmq
    from moeline_client import Client
    from moeline.wire import StageKind
    K = StageKind.StageKind
    run = os.path.join(args.workdir, "curve")
    with Stack(args.moeline, args.model, run, config=FAST, extra_args=["--transport", "tcp"],
               endpoint_prefix="tcp://") as stack:
        state = stack.state()
        check(state["transport"] == "tcp" and state["hub"].startswith("tcp://127.0.0.1:"),
              f"stack.json: {state}")
        status = stack.status()
        check(status["endpoints"]["hub"] == state["hub"] and status["endpoints"]["client"] ==
              stack.endpoint, f"stack status --json should list every endpoint: {status}")
        server_key = os.path.join(keys_dir(stack), "gateway.pub")
        expected = reference(args.moeline, args.model, 12, prompt="to swim:")
        with Client(stack.endpoint, timeout=60, server_key=server_key) as client:
            result = client.generate(prompt="to swim:", max_tokens=12)
        check(result.ids == expected["ids"], f"over Curve: {result.ids} != {expected['ids']}")
        print("ok curve: a client with the server key is served identically to moeline run")

        # No server key: a plain connection to a Curve endpoint gets nowhere.
        plain = subprocess.run(
            [args.moeline, "client", "generate", "--endpoint", stack.endpoint, "--prompt", "x",
             "--timeout-ms", "2000"], capture_output=True, text=True, timeout=30)
        check(plain.returncode != 0, "a client without the server key was served")
        print("ok curve: a client without the server key is not served")

        server = read_key(server_key)["public"].encode()
        hub = state["hub"]
        before = len(Client(stack.endpoint, timeout=10, server_key=server_key).control(
            "status")["peers"])
        # A stage key the allow-list does not hold: the handshake fails, no reply at all.
        public, secret = zmq.curve_keypair()
        stranger = dealer(hub, identity=b"stranger", curve=(server, public, secret))
        try:
            stranger.send_multipart(hello(K.Prefill, 0, credits=8))
            answered = hello_reply(stranger, timeout=3) is not None
        except zmq.Again:
            # The refused handshake can close the connection before the hello is queued:
            # libzmq then has nowhere to put it, which is the same refusal seen earlier.
            answered = False
        check(not answered, "a stage with an unknown key got an answer")
        stranger.close()
        zap_refused = stack.metric("gateway", "moeline_zap_requests_total", domain="moeline-hub",
                                   result="refused")
        check(zap_refused >= 1, f"the refusal should be counted: {zap_refused}")
        print("ok curve: a stage key not on the allow-list is refused at the handshake")

        # An allowed key (decode's) saying hello as a prefill stage: refused, told nothing.
        decode_key = read_key(os.path.join(keys_dir(stack), "decode.key"))
        impostor = dealer(hub, identity=b"impostor",
                          curve=(server, decode_key["public"].encode(),
                                 decode_key["secret"].encode()))
        impostor.send_multipart(hello(K.Prefill, 0, credits=8))
        reply = hello_reply(impostor)
        check(reply is not None and not reply[0] and reply[2] == 0 and
              str(reply[2]) not in reply[1], f"the impostor's refusal: {reply}")
        print(f"ok curve: a decode key saying hello as prefill is refused ({reply[1]!r}), "
              "no settings hash handed out")
        # As itself but with settings other than the stack's (another model, KV layout or
        # arithmetic): refused, and the refusal does not hand out the hub's hash.
        impostor.send_multipart(hello(K.Decode, settings_hash(stack) ^ 1, credits=0))
        reply = hello_reply(impostor)
        check(reply is not None and not reply[0] and "settings hash" in reply[1] and
              str(settings_hash(stack)) not in reply[1] and reply[2] == 0,
              f"a decode stage with another settings hash: {reply}")
        print("ok curve: a stage whose settings hash differs is refused, the hub's not handed out")
        # As itself (a decode stage) it is accepted, but may not store snapshots: puts go to a
        # probe's intake with the gateway's ticket, and the gateway relays none.
        impostor.send_multipart(hello(K.Decode, settings_hash(stack), credits=0))
        reply = hello_reply(impostor)
        check(reply is not None and reply[0], f"decode's key as decode: {reply}")
        impostor.send_multipart(snapshot_put(12345))
        # Labelled by reason and type, the counter appears with the first refusal: until the
        # gateway has read the put, it is not exported at all.
        wait_for(lambda: stack.metric("gateway", "moeline_gateway_stage_messages_refused_total",
                                      created_on_first_event=True, reason="sent_to_the_gateway",
                                      type="SnapshotPut") >= 1, 10,
                 "a snapshot put from a decode stage was not refused")
        impostor.close()
        print("ok curve: a snapshot put from a decode stage is dropped and counted")

        # Jobs, hand-overs and puts travel peer to peer, straight to a stage's intake, which any
        # Curve key may reach (senders are whichever stages the gateway picks): what admits a
        # message there is the gateway's ticket for its job. Each intake sent what it takes, with
        # a forged ticket, by a key no allow-list holds: refused and counted.
        intakes = stack.intakes()
        kinds = {name.split("-")[0] for name in intakes}
        check(kinds == {"probe", "prefill", "decode", "offload"} and "probe" in intakes and
              all(e.startswith("tcp://") for e in intakes.values()),
              f"stack status --json should list every stage's intake: {intakes}")
        public, secret = zmq.curve_keypair()
        for stage, kind in (("probe", "SnapshotPut"), ("prefill-0", "PrefillJob"),
                            ("decode-0", "PrefillDone")):
            role = stage.split("-")[0]
            stage_key = read_key(os.path.join(keys_dir(stack), role + ".key"))["public"].encode()
            forger = dealer(intakes[stage], identity=b"forger", curve=(stage_key, public, secret))
            forger.send_multipart(forged(kind))
            wait_for(lambda: stack.metric(stage, "moeline_intake_refused_total",
                                          created_on_first_event=True, reason="bad_ticket",
                                          type=kind) >= 1, 10,
                     f"a {kind} with a forged ticket at {stage}'s intake was not refused")
            forger.close()
            print(f"ok curve: a {kind} with a forged ticket at {stage}'s intake is dropped and "
                  "counted")
        after = Client(stack.endpoint, timeout=10, server_key=server_key).control("status")
        check(len(after["peers"]) >= before, "real stages were dropped")


def case_apikeys(args):
    from moeline_client import Client, ControlError, GenerateError
    from moeline.wire import ErrorCode
    E = ErrorCode.ErrorCode
    run = os.path.join(args.workdir, "apikeys")
    os.makedirs(args.workdir, exist_ok=True)
    keys_file = os.path.join(args.workdir, "api-keys.json")
    if os.path.exists(keys_file):
        os.remove(keys_file)

    def add(tenant, *extra):
        out = subprocess.run([args.moeline, "keys", "add", "--file", keys_file, "--tenant", tenant,
                              *extra], capture_output=True, text=True, timeout=30)
        check(out.returncode == 0, out.stderr)
        return out.stdout.strip()

    acme, beta = add("acme"), add("beta", "--max-in-flight", "2")
    operator = add("ops", "--role", "operator")
    with open(keys_file) as f:
        stored = f.read()
    check(acme not in stored and acme.split("_")[1] in stored,
          "the keys file must hold the key's hash and id, never the key")
    check(stat.S_IMODE(os.stat(keys_file).st_mode) == 0o600, "the keys file must be 0600")

    with Stack(args.moeline, args.model, run, extra_args=["--api-keys", keys_file]) as stack:
        def refused(api_key, code, **request):
            with Client(stack.endpoint, timeout=30, api_key=api_key) as c:
                try:
                    c.generate(max_tokens=2, **request)
                except GenerateError as e:
                    check(e.code == code, f"{e.code_name}: {e.message}, want {code}")
                    return e.message
            raise AssertionError(f"served without the right key: {api_key!r} {request}")

        print("ok apikeys: no key ->", refused("", E.Unauthenticated, tokens=[1, 2]))
        print("ok apikeys: a wrong key ->",
              refused("ml_00000000_" + "0" * 64, E.Unauthenticated, tokens=[1, 2]))
        print("ok apikeys: acme's key naming tenant beta ->",
              refused(acme, E.Forbidden, tokens=[1, 2], tenant="beta"))

        prompt = [11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21, 22, 23, 24, 25, 26, 27, 28]
        with Client(stack.endpoint, timeout=60, api_key=acme) as c:
            first = c.generate(tokens=prompt, max_tokens=4)
            again = c.generate(tokens=prompt, max_tokens=4)
        check(again.usage["reuse_level"] == "result", f"acme's repeat: {again.usage}")
        with Client(stack.endpoint, timeout=60, api_key=beta) as c:
            other = c.generate(tokens=prompt, max_tokens=4)
        check(other.usage["reuse_level"] == "none" and other.ids == first.ids,
              f"beta must not be served acme's cache: {other.usage}")
        print("ok apikeys: the tenant comes from the key; beta does not see acme's cache")

        with Client(stack.endpoint, timeout=30, api_key=acme) as c:
            try:
                c.control("status")
                raise AssertionError("a user key ran an operator command")
            except (ControlError, GenerateError) as e:
                check("operator" in str(e), f"{e}")
                print(f"ok apikeys: a user key may not run status: {e}")
        with Client(stack.endpoint, timeout=30, api_key=operator) as c:
            status = c.control("status")
            check("peers" in status, f"operator status: {status}")
            try:
                c.control("reuse", json.dumps({"levels": "all", "tenant": 7}))
                raise AssertionError("a numeric tenant was accepted")
            except ControlError as e:
                print(f"ok apikeys: the operator's key runs status; a numeric tenant -> {e}")

        # Fairness: beta may hold 2 requests; its third is Overloaded while acme is served.
        with Client(stack.endpoint, timeout=120, api_key=beta) as b:
            held = [b.start(tokens=[3, 4, 5], max_tokens=200, ignore_eos=True) for _ in range(2)]
            third = b.start(tokens=[3, 4, 5], max_tokens=200, ignore_eos=True)
            over = None
            while over is None:
                event = b.next_event(timeout=60)
                if event.client_request_id == third and event.kind == "error":
                    over = event
                check(not (event.client_request_id == third and event.kind == "accepted"),
                      "beta's third request was accepted over its limit")
            check(over.error_code == E.Overloaded and "beta" in over.error_message,
                  f"beta over its limit: {over.error_code} {over.error_message}")
            with Client(stack.endpoint, timeout=60, api_key=acme) as a:
                served = a.generate(tokens=[7, 8, 9], max_tokens=4)
            check(len(served.ids) > 0, "acme was not served while beta was at its limit")
            for crid in held:
                b.cancel(crid)
        over_count = stack.metric("gateway", "moeline_gateway_tenant_requests_total",
                                  tenant="beta", result="over_limit")
        check(over_count >= 1, f"the refusal should be counted per tenant: {over_count}")
        print(f"ok apikeys: beta over its limit -> Overloaded ({over.error_message}); acme served")

        status = stack.status()
        check(status["open"] is False, f"stack status should say keys are required: {status}")


def case_health(args):
    """Slow connections held open on a stage's HTTP port used to make the supervisor (which asked
    /healthz) kill a healthy stage; it reads the stage's liveness file now."""
    from moeline_client import Client
    run = os.path.join(args.workdir, "health")
    with Stack(args.moeline, args.model, run) as stack:
        before = pids(stack)
        port = stack.http_port("decode-0")
        held = []
        for _ in range(200):
            s = socket.create_connection(("127.0.0.1", port), timeout=5)
            s.send(b"GET /healthz HTTP/1.1\r\n")  # a request that never ends
            held.append(s)
        time.sleep(8)
        after = pids(stack)
        for s in held:
            s.close()
        check(after == before and not any(restarts(stack).values()),
              f"a stage was restarted while slow connections held its port: {before} -> {after}")
        with Client(stack.endpoint, timeout=60) as client:
            check(len(client.generate(tokens=[1, 2, 3], max_tokens=4).ids) > 0, "not serving")
        print("ok health: 200 slow connections on decode's HTTP port for 8 s: no restart, "
              "still serving")


CASES = {"input": case_input, "ipc": case_ipc, "curve": case_curve, "apikeys": case_apikeys,
         "health": case_health}


def main():
    run_cases(CASES, __doc__)


if __name__ == "__main__":
    main()
